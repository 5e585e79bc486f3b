// The all-reduce for small buffers among many peers (docs/collectives.md, "All-reduce:
// the ring, or doubling among many peers"): log2(N) pairwise exchanges instead of a
// ring's 2(N-1) steps. Each exchange is a ring all-reduce of two peers (coll::run_ring
// with world 2) over the pair's connections, so attempts, aborts, stall detection and
// encryption are the ring's. Pure planning here; the communicator runs the stages.
#pragma once

#include "protocol/messages.h"

#include <cstddef>
#include <vector>

namespace lockstep::coll {

// `auto` runs an all-reduce by doubling from this many peers, up to this many bytes:
// below, the ring's step count, which grows with the world, costs more than doubling's
// extra bytes (each of its log2(N) exchanges moves the whole buffer).
inline constexpr std::size_t kDoublingWorldMin = 4;
inline constexpr std::size_t kDoublingBytesMax = 256 * 1024;

// Whether an attempt of this (voted) descriptor over `world` peers runs by doubling: an
// unquantized all-reduce forced to, or under `auto` within the bounds above. The same
// on every peer of the attempt: its inputs are the voted descriptor and the attempt's ring.
bool runs_by_doubling(const proto::CollectiveDescriptor& d, std::size_t world);

// One exchange of a rank's plan, in order.
struct DoublingStage {
  enum class Kind { kAllReduce, kBroadcast };
  Kind kind = Kind::kAllReduce;
  std::size_t partner = 0;  // its rank in the attempt's ring
  std::size_t role = 0;     // this peer's rank in the two-peer ring (a broadcast's root is 0)
  // After this stage the rank holds the whole sum: avg divides here, once.
  bool finalize_after = false;
};

// The stages of `rank` among `world` peers (world >= 2). With p the largest power of
// two not above the world, ranks p.. first fold into rank - p (a pair all-reduce), the
// first p ranks exchange with rank XOR 1, 2, 4, ... (the lower half of each pair takes
// role 0, so every pair computes the same function of the same two values and all end
// bit-identical), and the folded ranks get the result back by broadcast.
std::vector<DoublingStage> doubling_stages(std::size_t world, std::size_t rank);

}  // namespace lockstep::coll
