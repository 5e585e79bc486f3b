#include "peer/transfer_queue.h"

#include "common/limits.h"
#include "state/hash.h"

#include <algorithm>

namespace lockstep::peer {

TransferQueue::TransferQueue(const std::vector<proto::SyncFetch>& pieces, std::uint32_t streams) {
  for (const auto& p : pieces) {
    if (p.bytes == 0) continue;
    left_.push_back(p);
    bytes_left_ += p.bytes;
  }
  connections_ = limits::state_connections(bytes_left_, streams);
}

std::optional<proto::SyncFetch> TransferQueue::take() {
  if (left_.empty()) return std::nullopt;
  constexpr std::uint64_t L = state::kHashLeafBytes;
  proto::SyncFetch& front = left_.front();
  const std::uint64_t share = (bytes_left_ + kShareDivisor * connections_ - 1) / (kShareDivisor * connections_);
  // The unit ends at the first leaf boundary at or after offset + share, and leaves at
  // most kStateSegmentsPerRequestMax segments in the request.
  const std::uint64_t end = std::min((front.offset + std::max<std::uint64_t>(share, 1) + L - 1) / L * L,
                                     (front.offset / L + limits::kStateSegmentsPerRequestMax) * L);
  proto::SyncFetch unit = front;
  unit.bytes = std::min(front.bytes, end - front.offset);
  front.offset += unit.bytes;
  front.bytes -= unit.bytes;
  bytes_left_ -= unit.bytes;
  if (front.bytes == 0) left_.pop_front();
  return unit;
}

}  // namespace lockstep::peer
