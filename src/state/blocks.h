// Shared-state transfers in blocks, compressed where it pays (protocol version 8: a
// StateRequest with encoding proto::kStateEncodingBlocks).
//
// The answer to such a request is its StateResponse followed by the range's bytes as
// blocks, in order: an 8-byte header (raw length u32, then wire length u32 whose top bit
// says "zstd-compressed", little-endian) and the wire bytes. A raw block's wire length
// equals its raw length; a compressed block holds one zstd frame that decompresses to
// exactly its raw length. A block holds at most kBlockBytes raw bytes (the peer's
// sender starts each connection at 256 KiB and doubles up to it). The receiver bounds everything before it reads it (parse_block_header): a raw
// length of 1 to kBlockBytes and no more than the range has left, a wire length of at
// most compress_bound(raw); a frame that decompresses to another size, or fails, is a
// PROTOCOL_ERROR of the transfer, and what it decompressed never reaches the tensor
// (BlockDecompressor writes into a buffer of its own first).
//
// Whether a block is compressed is the sender's choice, made by CompressionPolicy from
// what it measured on the connection: compression pays when the bytes it saves take
// longer to send than compressing takes, (1 - wire/raw) x compress speed > link speed.
// The link speed is what left the socket while its queue never ran dry (on_sent); until
// 8 MiB went out it is not known: compressible blocks are compressed. The first block of
// every range (on_new_range: the sender calls it for a new tensor) is tried, as each
// tensor compresses differently, unless
// the connection already showed that compressing is slower than the link. A block that
// did not shrink by 3 % is sent raw; while blocks go raw, one in every 8, 16, ... up to
// 256 is compressed again to see whether the data (or the link) changed. Level 3 below
// 25 MB/s, level 1 above.
#pragma once

#include "common/status.h"
#include "state/hash.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace lockstep::state {

inline constexpr std::size_t kBlockBytes = std::size_t{4} << 20;
inline constexpr std::size_t kBlockHeaderBytes = 8;
inline constexpr std::uint32_t kBlockCompressedBit = 0x80000000u;

struct BlockHeader {
  std::uint32_t raw = 0;   // bytes of the tensor the block holds
  std::uint32_t wire = 0;  // bytes that follow the header
  bool compressed = false;
};

void put_block_header(std::uint8_t* out, const BlockHeader& h);
// The header of a block of a range with `remaining` raw bytes still to come, bounded as
// above; PROTOCOL_ERROR (naming the field) otherwise.
Result<BlockHeader> parse_block_header(const std::uint8_t* in, std::uint64_t remaining);
// The largest zstd frame of `raw` bytes.
std::size_t compress_bound(std::size_t raw);

// The sender's choice per block (pure: it is told the sizes and the seconds).
class CompressionPolicy {
 public:
  // Bytes of another tensor follow: how well they compress is not known yet.
  void on_new_range();
  bool compress_next() const;
  int level() const;
  // A block compressed from `raw` to `wire` bytes in `seconds` (wire == raw: it did not
  // shrink enough and goes raw).
  void on_compressed(std::size_t raw, std::size_t wire, double seconds);
  // A block sent raw without trying.
  void on_skipped();
  // `wire` bytes (header included) written to the connection by a send call that took
  // `seconds`, with `queued_before` bytes not yet acknowledged in the socket before the
  // call and `queued_after` after it (SIOCOUTQ), `since_last` seconds after the end of
  // the previous call (negative for the connection's first). The link's speed is what
  // left the socket over a time in which its queue never ran dry: since the previous
  // call when the queue still held bytes before this one, else during this call alone.
  // (How long a send call takes says nothing by itself: the socket takes megabytes at
  // once, so a slow link looks fast until its buffer fills.)
  void on_sent(std::size_t wire, double seconds, std::uint64_t queued_before = 0, std::uint64_t queued_after = 0,
               double since_last = -1.0);
  double link_bytes_per_second() const;  // 0 until known

 private:
  bool measured_ = false;       // the ratio of this range is known
  double ratio_ = 1.0;          // wire / raw of the last compressed block
  double compress_bps_ = 0.0;   // raw bytes compressed per second, last block
  double link_bytes_ = 0.0;
  double link_seconds_ = 0.0;
  std::uint64_t queued_ = 0;    // unacknowledged in the socket after the last send
  std::size_t skipped_ = 0;     // raw blocks since the last try
  std::size_t probe_every_ = 8;
};

// One zstd compression context and its output buffer (one per serving connection).
class BlockCompressor {
 public:
  BlockCompressor();
  ~BlockCompressor();
  BlockCompressor(const BlockCompressor&) = delete;
  BlockCompressor& operator=(const BlockCompressor&) = delete;
  // Compresses `raw` bytes (at most kBlockBytes) at `level`; returns the frame's size,
  // or 0 when it would not save 3 % (or zstd failed): send the block raw then.
  std::size_t compress(const std::uint8_t* raw, std::size_t bytes, int level);
  const std::uint8_t* data() const { return out_.data(); }

 private:
  struct Context;
  std::unique_ptr<Context> ctx_;
  std::vector<std::uint8_t> out_;
};

// One zstd decompression context and its buffer (one per fetching connection).
class BlockDecompressor {
 public:
  BlockDecompressor();
  ~BlockDecompressor();
  BlockDecompressor(const BlockDecompressor&) = delete;
  BlockDecompressor& operator=(const BlockDecompressor&) = delete;
  // Decompresses the frame in `wire` (`wire_bytes`) into dst, which receives exactly
  // `raw` bytes and nothing unless the frame decompresses to exactly that many.
  Status decompress(const std::uint8_t* wire, std::size_t wire_bytes, std::uint8_t* dst, std::size_t raw);

 private:
  struct Context;
  std::unique_ptr<Context> ctx_;
  std::vector<std::uint8_t> out_;
};

}  // namespace lockstep::state
