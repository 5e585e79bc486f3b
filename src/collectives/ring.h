// The pipelined ring all-reduce of one attempt, over one connection to the next peer
// (tx) and one from the previous peer (rx). The buffer is split into one chunk per
// peer; in 2(n-1) steps each peer sends chunk (rank - s) mod n and receives chunk
// (rank - s - 1) mod n: the first n-1 steps reduce (reduce-scatter), the rest copy
// (all-gather). Chunks move in sub-chunks, each with a 16-byte header naming the
// attempt and a sequence number, so sending, receiving and reducing overlap and a
// byte of another attempt is never taken for this one (semantics rule 3).
//
// The destination is backed up, sub-chunk by sub-chunk, right before its first
// write (a reduce-scatter sub-chunk by the reduce itself, which reads the old bytes
// anyway: reduce3_saving); restore() puts it back exactly when the master declares
// the attempt failed. Non-blocking sockets, driven by one thread, or for large buffers
// where the plan asks for it by two (one receives and reduces, one sends); poll() also
// watches an abort descriptor, so aborting costs the data path nothing.
//
// With quantization each sub-chunk travels as 8-bit codes plus a 16-byte parameter
// header (collectives/quantize.h). Reduce-scatter hops carry quantized partial sums;
// the owner of a chunk quantizes its final value once, replaces its own copy with the
// decoded form, and the all-gather forwards those encoded bytes unchanged, so every
// peer decodes the same bits. Error bound per element: the sum over the n-1
// reduce-scatter hops and the one all-gather encoding of each encoding's bound
// (scale/2 plus rounding, see quantize.h).
//
// Encrypted (each direction on its own: RingIo's seal set for what this peer sends, open
// for what it receives; with encrypt_data both, without it only a relayed edge's): each
// sub-chunk travels as its 16-byte header
// in clear, the ChaCha20-Poly1305 ciphertext of the wire payload (raw or quantized) and
// a 16-byte tag; the header is the associated data and the nonce a per-direction counter
// kept by the connection's Aead, so an altered, replayed, reordered or cut frame does
// not open. The sender seals from the source into a scratch buffer; the receiver reads
// into another and opens into the real target only once the tag verifies (a failure
// fails the attempt with PROTOCOL_ERROR and restores the destination like any other).
//
// Striped (streams): the sender of each hop may spread the sub-chunks over up to
// kRingStreamsMax connections to its next peer: sub-chunk j of every chunk travels on
// stream j mod S, each stream in the order of the unstriped ring. The chunks, sub-chunks,
// reduction order and quantization are those of the unstriped ring, so the results are
// the same bits. Every frame header names its stream and the hop's stream count S; the
// receiver learns S from the first header on stream 0 and then takes the other streams'
// connections (RingIo::rx_more). Each hop chooses its own S (peer/streams.h); a send of
// step s waits for the receive of the same sub-chunk at step s-1, on whichever stream it
// came.
#pragma once

#include "common/status.h"
#include "security/crypto.h"

#include <lockstep/lockstep.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

namespace lockstep::coll {

// The collectives the ring runs (ring.cpp's Layout says how each walks the ring).
enum class RingKind { kAllReduce, kBroadcast, kAllGather, kReduceScatter };

struct RingPlan {
  RingKind kind = RingKind::kAllReduce;
  std::size_t world = 1;
  std::size_t rank = 0;
  // All-reduce: count elements in, count out (src may equal dst: in place).
  // Broadcast: the root's src, every other peer's dst, of count elements (in place:
  //   src == dst on every peer).
  // All-gather: count is the output's elements; src holds this rank's counts[rank]
  //   (or count / world) elements, dst all of them in rank order (src may be dst's
  //   own place).
  // Reduce-scatter: src holds count = world x n elements, dst this rank's n (chunk
  //   `rank` of the reduced whole).
  const void* src = nullptr;
  void* dst = nullptr;
  std::size_t count = 0;
  std::size_t root = 0;                 // broadcast
  std::vector<std::size_t> counts;      // all-gather: elements per rank (empty: equal)
  lockstep_dtype_t dtype = LOCKSTEP_F32;
  lockstep_reduce_op_t op = LOCKSTEP_SUM;
  lockstep_quantization_t quantization = LOCKSTEP_QUANT_NONE;
  // Error feedback (a quantized all-reduce with op sum or avg; docs/collectives.md): count
  // elements of dtype. The attempt contributes src + residual (RingScratch::contribution)
  // and leaves in RingScratch::residual_next what this peer's encodings dropped: for each
  // element, the value it encoded (its input, a partial sum it forwarded, or, as the
  // chunk's owner, the final sum) less that encoding's decoded form, the final one
  // multiplied by the world for avg; 0 where either is not finite. Summed over the
  // peers, the residuals are what the result lacks (the contributions' sum less the
  // result, or less world x result for avg). commit_residual() copies it into residual
  // once the attempt succeeded everywhere; residual itself is only read.
  void* residual = nullptr;
  // The encodings' distribution hint (quantize()).
  lockstep_distribution_t distribution = LOCKSTEP_DIST_NONE;
  std::uint64_t attempt = 0;
  std::size_t subchunk_bytes = 1024 * 1024;
  // Buffers of at least this many bytes are sent by a second thread (ring.cpp says
  // why); the default: never.
  std::size_t sender_thread_bytes_min = std::numeric_limits<std::size_t>::max();
  // Microseconds the one-thread ring polls without sleeping, when it can move nothing,
  // before it sleeps in poll (ring_spin_us); 0: it sleeps at once. The two-thread ring
  // ignores it.
  std::uint32_t spin_us = 0;
  // Tuning of the one-thread ring for neighbours on the same host (tune_same_host):
  // the send buffer of the connection to the next peer and the receive buffer of the
  // connection from the previous one, in bytes (0: the kernel sizes them), and how many
  // bytes of the current sub-chunk must have arrived before poll reports it
  // (SO_RCVLOWAT, never more than the bytes still due; 0: one byte). The low-water mark
  // goes back to one byte before the attempt returns.
  int tx_buffer_bytes = 0;
  int rx_buffer_bytes = 0;
  std::size_t rx_lowat_bytes = 0;
};

// The sub-chunk size of a ring of `world` peers. Both ends of a connection must use
// the same (it is not on the wire), so it depends only on what every peer of the ring
// knows alike. Chosen by measurement (BENCHMARKS.md, 2-core host): 2 peers ran at the
// transport bound with 1 MiB and about 20% below it with 256 KiB; 4 peers ran faster
// with 256 KiB, whose staging buffer stays in a core's L2 while peers time-slice cores.
inline std::size_t ring_subchunk_bytes(std::size_t world) {
  return world <= 2 ? std::size_t{1024 * 1024} : std::size_t{256 * 1024};
}

// Whether a peer sends from a second thread while its first receives and reduces, given
// how many peers of the ring run on its host and how many cores the host has. Measured at
// 256 MiB (BENCHMARKS.md): with a spare core per peer (16 cores; 2, 4 and 8 peers) the
// second thread roughly doubled throughput, as one thread cannot copy both ways at once;
// where the host's cores are oversubscribed (4 peers on 2 cores) it keeps a peer sending
// while its receiving half waits for the CPU, and gained too; where the peers just fill
// the cores (2 peers on 2 cores) a second thread per peer only competed for them and lost.
inline bool ring_sender_thread(std::size_t peers_on_host, unsigned cores) {
  if (cores == 0 || peers_on_host == 0) return false;  // unknown: one thread
  return peers_on_host > cores || 2 * peers_on_host <= cores;
}

// How long the one-thread ring polls without sleeping before it sleeps in poll, given
// the same facts. Measured on the 2-core host (BENCHMARKS.md), 2 peers, 256 MiB: each
// peer slept for 12-17 ms of every 90, whenever its neighbour was busy reducing for a
// moment, and paid a wake-up each time; 50 us of polling first took the peers from
// 2.8-2.9 GB/s to 3.0-3.2 (and in the host's slow spells from 2.3-2.4 to 2.5-2.7). Where
// the cores are oversubscribed a polling thread would hold a core that a neighbour
// needs: no spinning. (On the 16-core host, where the ring runs two threads, spinning
// there too changed nothing measurable.)
inline constexpr std::uint32_t kRingSpinUs = 50;
inline std::uint32_t ring_spin_us(std::size_t peers_on_host, unsigned cores) {
  if (cores == 0 || peers_on_host == 0 || peers_on_host > cores) return 0;
  return kRingSpinUs;
}

// Where the one-thread spinning ring sends to or receives from a peer on the same host,
// the connection to the next peer gets a send buffer of 512 KiB, the one from the
// previous peer a receive buffer of 1 MiB, and poll waits for 64 KiB (one loopback
// segment) of the current sub-chunk. Measured on the 2-core host, 2 peers, 256 MiB
// (BENCHMARKS.md, "Same-host buffers"): at most about a sub-chunk is then on its way
// between two peers, and stays in the caches, and a peer wakes once per segment rather
// than per fragment; medians of 3.50 GB/s where it had 3.14, and in the host's slow spells
// (when its two cores sit on different L3 caches) 3.19 where it had 2.66. Not with a
// second thread or oversubscribed cores (4 peers on 2 cores lost 30% with a fixed 1 MiB
// receive buffer), nor between hosts, where the buffers must grow to the link's
// bandwidth-delay product. The kernel keeps a buffer size set by hand for the
// connection's life.
inline constexpr int kRingSameHostSndBufBytes = 512 * 1024;
inline constexpr int kRingSameHostRcvBufBytes = 1024 * 1024;
inline constexpr std::size_t kRingRcvLowatBytes = 64 * 1024;
inline constexpr std::size_t kRingSameHostTuningBytesMin = 4 * 1024 * 1024;
// Sets them on a plan whose spin and sender thread are already chosen, for buffers of
// kRingSameHostTuningBytesMin or more.
void tune_same_host(RingPlan& plan, bool previous_peer_on_this_host, bool next_peer_on_this_host);

// From this size on, where ring_sender_thread says so. A judgement rather than a
// measurement: a thread per attempt costs tens of microseconds, which weighs on small
// buffers, and on the loaded test machine 1 and 16 MiB showed no difference that stood
// out from the run-to-run spread.
inline constexpr std::size_t kSenderThreadBytesMin = 4 * 1024 * 1024;

// One more connection of a striped hop, and its cipher when encrypted.
struct RingStream {
  int fd = -1;
  security::Aead* aead = nullptr;
};

struct RingIo {
  int tx_fd = -1;                                 // to the next peer (non-blocking): stream 0
  int rx_fd = -1;                                 // from the previous peer (non-blocking): stream 0
  // Streams 1.. to the next peer (at most kRingStreamsMax - 1): this hop's stripes.
  std::vector<RingStream> tx_more;
  // Called at most once, when the previous peer's first header announces `streams` > 1:
  // the connections of its streams 1..streams-1 (non-blocking), in order, or why they
  // cannot be had (the attempt then fails with that status). Unset: only one stream is
  // accepted.
  std::function<Status(std::size_t streams, std::vector<RingStream>* out)> rx_more;
  // Called when the first frame on stream k's receiving connection belongs to an older
  // attempt: the previous peer is still in an attempt that has already ended here (it
  // ended before its turn here, so this peer never read its frames) and drops the
  // connection when it learns so. The connection is given up and a newer one from the
  // same peer returned (non-blocking; the wait ends with the attempt's abort), or why
  // there is none. Unset: such a frame fails the attempt.
  std::function<Result<RingStream>(std::size_t stream)> rx_replace;
  int abort_fd = -1;                              // readable when the attempt must stop
  const std::atomic<bool>* abort_flag = nullptr;  // checked between sub-chunks
  // run_ring_commit: set (and abort_fd made readable) when the master's successful
  // outcome arrived, so that no more commit tokens need be waited for.
  const std::atomic<bool>* settled_flag = nullptr;
  // The attempt fails when no byte moves in either direction for this long (0: never):
  // a link cut between two ring neighbours that both still reach the master would
  // otherwise hold the collective, and every peer voting on it, forever.
  std::uint32_t stall_timeout_ms = 0;
  // Both set: the data plane is encrypted (see above). They belong to the connections
  // (tx seals, rx opens) and live as long as they do, so that the counters stay in step
  // on both ends across the attempts that reuse a connection.
  security::Aead* seal = nullptr;
  security::Aead* open = nullptr;
};

struct RingStats {
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  std::uint32_t streams = 1;  // connections the sends went over
};

// Reused across attempts so that the steady state allocates nothing.
struct RingScratch {
  std::vector<std::uint8_t> backup;   // the destination's previous content
  std::vector<std::uint8_t> work;     // reduce-scatter: the partial sums passed on
  std::vector<std::uint8_t> staging;  // per receiving stream: one sub-chunk before it is reduced
  std::vector<std::uint8_t> touched;  // per sub-chunk of the destination: backed up
  // Quantized attempts: per sending stream one encoded sub-chunk on its way out, and
  // every encoded sub-chunk of the all-gather, forwarded verbatim so that all peers
  // decode the same bytes.
  std::vector<std::uint8_t> encoded_send;
  std::vector<std::uint8_t> encoded_gather;
  // Encrypted attempts: per stream one sealed sub-chunk (ciphertext and tag) in each direction.
  std::vector<std::uint8_t> sealed_send;
  std::vector<std::uint8_t> sealed_recv;
  // Error feedback: this attempt's contribution (src + residual) and the next residual.
  std::vector<std::uint8_t> contribution;
  std::vector<std::uint8_t> residual_next;
};

// The frame header: magic (2 bytes, "LS"), stream index, stream count (1 byte each),
// the stream's sequence number (4 bytes) and the attempt (8 bytes), little-endian.
inline constexpr std::size_t kRingHeaderBytes = 16;
inline constexpr std::uint16_t kRingMagic = 0x534c;  // "LS"
inline constexpr std::size_t kRingStreamsMax = 16;
struct RingHeader {
  std::uint8_t stream = 0;
  std::uint8_t streams = 1;
  std::uint32_t seq = 0;
  std::uint64_t attempt = 0;
};
void put_ring_header(std::uint8_t* out, const RingHeader& h);
// The header's fields, or why it cannot be one: a bad magic, a stream count of 0 or
// above kRingStreamsMax, a stream index not below the count.
Result<RingHeader> parse_ring_header(const std::uint8_t* in);

// Runs the attempt of plan.kind. On failure (a socket error, a bad header, an abort)
// the destination is restored before returning. On success the backup is kept in
// scratch until the caller knows the outcome.
Status run_ring(const RingPlan& plan, const RingIo& io, RingScratch& scratch, RingStats* stats);
inline Status run_ring_all_reduce(const RingPlan& plan, const RingIo& io, RingScratch& scratch, RingStats* stats) {
  return run_ring(plan, io, scratch, stats);
}
// The commit exchange, after a successful run_ring of every kind (docs/protocol.md,
// "Completion"): each peer sends its next peer world-1 tokens, the first once it holds
// the result, then one more for each token it receives but the last; the k-th token a
// peer receives says that the k peers before it hold the result, so the (world-1)-th
// says that every participant does. A token is a frame header (stream 0, sequence
// kRingTokenSeq, the attempt) with no payload (sealed: its 16-byte tag).
//   kCommitted: every token came (all of this peer's are sent): the attempt can only
//     succeed, and the caller may return without the master's outcome.
//   kSettled: io.settled_flag rose first (the master's successful outcome came): this
//     peer's remaining tokens went out at once, and the previous peer's that are still
//     due are skipped by the next attempt on the connection (run_ring skips a token of
//     an older attempt where the first frame of a connection is due, run_ring_commit
//     where a token is due: a broadcast's root reads nothing before its exchange).
// Any other end is an error, and the connections are then out of step and must go: an
// abort, a lost or stalled connection, a frame that is not this attempt's token, or an
// outcome that came while this peer's tokens could not leave at once or one was half
// read (once settled, nothing is waited for).
// The destination is never touched.
enum class CommitEnd { kCommitted, kSettled };
inline constexpr std::uint32_t kRingTokenSeq = 0xffffffffu;
Result<CommitEnd> run_ring_commit(const RingPlan& plan, const RingIo& io, RingStats* stats);
// Puts back every part of the destination written by the last run with this scratch.
void restore(const RingPlan& plan, RingScratch& scratch);
// Error feedback: once the attempt succeeded everywhere, its residual becomes the
// caller's (plan.residual); nothing without one.
void commit_residual(const RingPlan& plan, const RingScratch& scratch);

}  // namespace lockstep::coll
