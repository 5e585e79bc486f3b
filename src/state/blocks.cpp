// Shared-state blocks (see blocks.h): the header, the sender's policy, and zstd.
#include "state/blocks.h"

#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace lockstep::state {
namespace {

constexpr double kWarmUpBytes = 8.0 * 1024 * 1024;
constexpr double kSlowLinkBytesPerSecond = 25e6;
constexpr std::size_t kProbeEveryMax = 256;
// A frame must save this much of the block to be sent instead of the raw bytes.
constexpr double kMinSaving = 0.03;

void put_u32(std::uint8_t* out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
std::uint32_t get_u32(const std::uint8_t* in) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(in[i]) << (8 * i);
  return v;
}

}  // namespace

void put_block_header(std::uint8_t* out, const BlockHeader& h) {
  put_u32(out, h.raw);
  put_u32(out + 4, h.wire | (h.compressed ? kBlockCompressedBit : 0u));
}

std::size_t compress_bound(std::size_t raw) { return ZSTD_compressBound(raw); }

Result<BlockHeader> parse_block_header(const std::uint8_t* in, std::uint64_t remaining) {
  BlockHeader h;
  h.raw = get_u32(in);
  const std::uint32_t wire = get_u32(in + 4);
  h.compressed = (wire & kBlockCompressedBit) != 0;
  h.wire = wire & ~kBlockCompressedBit;
  const std::uint64_t most = std::min<std::uint64_t>(kBlockBytes, remaining);
  if (h.raw == 0 || h.raw > most) {
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "state block: raw length " + std::to_string(h.raw) +
                                                      " outside 1.." + std::to_string(most));
  }
  if (!h.compressed && h.wire != h.raw) {
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "state block: a raw block of " + std::to_string(h.raw) +
                                                      " bytes announces " + std::to_string(h.wire) + " on the wire");
  }
  if (h.compressed && (h.wire == 0 || h.wire > compress_bound(h.raw))) {
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "state block: a compressed block of " + std::to_string(h.raw) +
                                                      " bytes announces " + std::to_string(h.wire) + " on the wire");
  }
  return h;
}

// ---------------------------------------------------------------- policy

double CompressionPolicy::link_bytes_per_second() const {
  if (link_bytes_ < kWarmUpBytes || link_seconds_ <= 0.0) return 0.0;
  return link_bytes_ / link_seconds_;
}

void CompressionPolicy::on_new_range() {
  measured_ = false;
  skipped_ = 0;
}

bool CompressionPolicy::compress_next() const {
  const double link = link_bytes_per_second();
  if (!measured_) {
    // Try the range's first block, unless compressing is known to be slower than the
    // link (then even bytes that vanished would not pay): probes only.
    if (compress_bps_ == 0.0 || link == 0.0 || compress_bps_ > link) return true;
    return skipped_ + 1 >= probe_every_;
  }
  const bool shrinks = ratio_ < 1.0 - kMinSaving;
  // Compressing pays when the bytes it saves take longer to send than compressing takes.
  const bool pays = shrinks && (link == 0.0 || (1.0 - ratio_) * compress_bps_ > link);
  return pays || skipped_ + 1 >= probe_every_;
}

int CompressionPolicy::level() const {
  const double link = link_bytes_per_second();
  return link > 0.0 && link < kSlowLinkBytesPerSecond ? 3 : 1;
}

void CompressionPolicy::on_compressed(std::size_t raw, std::size_t wire, double seconds) {
  measured_ = true;
  ratio_ = raw == 0 ? 1.0 : static_cast<double>(wire) / static_cast<double>(raw);
  compress_bps_ = seconds > 0.0 ? static_cast<double>(raw) / seconds : 1e12;
  const bool was_probe = skipped_ > 0;
  skipped_ = 0;
  // A probe that still does not pay waits twice as long for the next.
  if (was_probe && !compress_next()) probe_every_ = std::min(kProbeEveryMax, probe_every_ * 2);
  if (compress_next()) probe_every_ = 8;
}

void CompressionPolicy::on_skipped() { ++skipped_; }

void CompressionPolicy::on_sent(std::size_t wire, double seconds, std::uint64_t queued_before,
                                std::uint64_t queued_after, double since_last) {
  const bool backlogged = queued_before > 0 && since_last >= 0.0;
  const std::uint64_t written = (backlogged ? queued_ : 0) + wire;
  link_bytes_ += static_cast<double>(written - std::min(written, queued_after));
  link_seconds_ += std::max(backlogged ? since_last : seconds, 0.0);
  queued_ = queued_after;
}

// ---------------------------------------------------------------- zstd

struct BlockCompressor::Context {
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ~Context() { ZSTD_freeCCtx(cctx); }
};

BlockCompressor::BlockCompressor() : ctx_(std::make_unique<Context>()), out_(compress_bound(kBlockBytes)) {}
BlockCompressor::~BlockCompressor() = default;

std::size_t BlockCompressor::compress(const std::uint8_t* raw, std::size_t bytes, int level) {
  if (ctx_->cctx == nullptr || bytes == 0 || bytes > kBlockBytes) return 0;
  const std::size_t n = ZSTD_compressCCtx(ctx_->cctx, out_.data(), out_.size(), raw, bytes, level);
  if (ZSTD_isError(n) != 0) return 0;
  if (static_cast<double>(n) > static_cast<double>(bytes) * (1.0 - kMinSaving)) return 0;
  return n;
}

struct BlockDecompressor::Context {
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  ~Context() { ZSTD_freeDCtx(dctx); }
};

BlockDecompressor::BlockDecompressor() : ctx_(std::make_unique<Context>()), out_(kBlockBytes) {}
BlockDecompressor::~BlockDecompressor() = default;

Status BlockDecompressor::decompress(const std::uint8_t* wire, std::size_t wire_bytes, std::uint8_t* dst,
                                     std::size_t raw) {
  if (ctx_->dctx == nullptr) return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "no zstd decompression context");
  if (raw == 0 || raw > out_.size()) {
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "state block: raw length " + std::to_string(raw) + " out of bounds");
  }
  // Room for one byte more than announced: a frame that holds more is caught, not cut.
  const std::size_t room = std::min(out_.size(), raw + 1);
  const std::size_t n = ZSTD_decompressDCtx(ctx_->dctx, out_.data(), room, wire, wire_bytes);
  if (ZSTD_isError(n) != 0) {
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR,
                  std::string("state block: the compressed frame does not decompress: ") + ZSTD_getErrorName(n));
  }
  if (n != raw) {
    return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "state block: the compressed frame decompresses to " +
                                                      std::to_string(n) + " bytes, announced " + std::to_string(raw));
  }
  std::memcpy(dst, out_.data(), raw);
  return Status::ok();
}

}  // namespace lockstep::state
