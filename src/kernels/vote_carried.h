// Small all-reduces that travel with the votes (docs/architecture.md, "Small
// all-reduces"): the peer and the master apply the same rule to the descriptor, so every
// participant of a collective takes the same path.
#pragma once

#include "kernels/reduce.h"
#include "common/limits.h"
#include "protocol/messages.h"

#include <lockstep/lockstep.h>

#include <cstdint>

namespace lockstep::coll {

// Whether an all-reduce of `count` elements of `dtype` with this quantization travels
// with the votes: unquantized (quantization is there to save link bytes, and a few
// kilobytes through the master cost none worth saving), a known dtype, and at most
// limits::kVoteCarriedBytesMax bytes.
inline bool travels_with_votes(std::uint64_t count, int dtype, int quantization) {
  if (quantization != LOCKSTEP_QUANT_NONE || !dtype_valid(dtype)) return false;
  const std::uint64_t size = dtype_size(static_cast<lockstep_dtype_t>(dtype));
  return count >= 1 && count <= limits::kVoteCarriedBytesMax / size;
}

// The rule for any collective: a barrier always (it has no data), an all-reduce as
// above, the others never (their results differ by rank or come from one rank).
inline bool travels_with_votes(const proto::CollectiveDescriptor& d) {
  if (d.kind == proto::CollectiveKind::kBarrier) return true;
  return d.kind == proto::CollectiveKind::kAllReduce && travels_with_votes(d.count, d.dtype, d.quantization);
}

}  // namespace lockstep::coll
