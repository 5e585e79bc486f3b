// What one source of a shared-state sync still has to send, handed out a unit at a time
// to the connections that fetch from it: a pure rule (no IO, no threads; the fetcher
// holds a lock around it).
//
// A source's pieces travel over connections() connections: one per
// limits::kStateStripeBytesMin bytes, at least 1, at most `streams` (p2p_streams, or
// limits::kStateStreamsDefault). Several connections ramp up together after their slow
// start, share a lossy path's bandwidth as several flows do, and let the source compress
// on as many cores. Each connection takes the next unit whenever wants_more() says it
// has room for another request (guided self-scheduling): the front of what is left, a
// kShareDivisor × connections-th of it, at least one 1 MiB leaf of the content hash and
// at most limits::kStateSegmentsPerRequestMax segments, cut at a leaf boundary of its
// tensor. Units shrink as the work runs out, so a connection that moves faster takes
// more of them, and every connection runs dry at about the same time whatever the
// flows' rates: within about kAskedBytesMax at the slowest one's rate.
#pragma once

#include "protocol/messages.h"

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

namespace lockstep::peer {

class TransferQueue {
 public:
  static constexpr std::uint64_t kShareDivisor = 16;
  // Requests in flight on one connection: two (its source never waits for the next one
  // where a unit takes longer than a round trip), and up to kRequestsInFlight while they
  // ask for less than kAskedBytesMax in all (small units and small tensors hide the round
  // trip), few enough that requests never fill a socket buffer (no deadlock) and that
  // no connection holds much of what the others could move.
  static constexpr std::size_t kRequestsInFlight = 16;
  static constexpr std::uint64_t kAskedBytesMax = std::uint64_t{4} << 20;
  static constexpr bool wants_more(std::size_t asked, std::uint64_t asked_bytes) {
    return asked < 2 || (asked < kRequestsInFlight && asked_bytes < kAskedBytesMax);
  }

  TransferQueue(const std::vector<proto::SyncFetch>& pieces, std::uint32_t streams);

  std::uint32_t connections() const { return connections_; }
  std::uint64_t bytes_left() const { return bytes_left_; }
  // The next unit, or nothing when every byte has been handed out.
  std::optional<proto::SyncFetch> take();

 private:
  std::deque<proto::SyncFetch> left_;
  std::uint64_t bytes_left_ = 0;
  std::uint32_t connections_ = 1;
};

}  // namespace lockstep::peer
