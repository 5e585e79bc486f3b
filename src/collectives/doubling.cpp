#include "collectives/doubling.h"

#include "kernels/reduce.h"

#include <bit>

namespace lockstep::coll {

bool runs_by_doubling(const proto::CollectiveDescriptor& d, std::size_t world) {
  if (d.kind != proto::CollectiveKind::kAllReduce || d.quantization != LOCKSTEP_QUANT_NONE || world < 2 ||
      !dtype_valid(d.dtype)) {
    return false;
  }
  switch (d.algorithm) {
    case proto::Algorithm::kRing: return false;
    case proto::Algorithm::kDoubling: return true;
    case proto::Algorithm::kAuto: break;
  }
  const std::size_t bytes = static_cast<std::size_t>(d.count) * dtype_size(static_cast<lockstep_dtype_t>(d.dtype));
  return world >= kDoublingWorldMin && bytes <= kDoublingBytesMax;
}

std::vector<DoublingStage> doubling_stages(std::size_t world, std::size_t rank) {
  using Kind = DoublingStage::Kind;
  std::vector<DoublingStage> stages;
  if (world < 2 || rank >= world) return stages;
  const std::size_t p = std::bit_floor(world);
  if (rank >= p) {  // folded: give, then receive the result
    stages.push_back({Kind::kAllReduce, rank - p, 1, false});
    stages.push_back({Kind::kBroadcast, rank - p, 1, false});
    return stages;
  }
  if (rank < world - p) stages.push_back({Kind::kAllReduce, rank + p, 0, false});
  for (std::size_t k = 1; k < p; k <<= 1) stages.push_back({Kind::kAllReduce, rank ^ k, (rank & k) != 0 ? 1u : 0u, false});
  stages.back().finalize_after = true;
  if (rank < world - p) stages.push_back({Kind::kBroadcast, rank + p, 0, false});
  return stages;
}

}  // namespace lockstep::coll
