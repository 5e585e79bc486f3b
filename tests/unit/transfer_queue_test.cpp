// peer::TransferQueue: how a sync source's bytes are shared out between the connections
// that fetch from it (peer/transfer_queue.h).
#include "common/limits.h"
#include "peer/transfer_queue.h"
#include "state/hash.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <vector>

namespace lockstep::peer {
namespace {

constexpr std::uint64_t L = state::kHashLeafBytes;
constexpr std::uint64_t MiB = std::uint64_t{1} << 20;

std::vector<proto::SyncFetch> drain(TransferQueue& q) {
  std::vector<proto::SyncFetch> out;
  while (auto unit = q.take()) out.push_back(*unit);
  return out;
}

TEST(TransferQueue, ConnectionsFollowTheBytesUpToTheStreams) {
  const auto connections = [](std::uint64_t bytes, std::uint32_t streams) {
    return TransferQueue({proto::SyncFetch{0, 0, bytes, 0}}, streams).connections();
  };
  EXPECT_EQ(connections(15 * MiB, 4), 1u);
  EXPECT_EQ(connections(40 * MiB, 4), 2u);
  EXPECT_EQ(connections(1024 * MiB, 4), 4u);
  EXPECT_EQ(connections(1024 * MiB, 8), 8u);
  EXPECT_EQ(connections(1024 * MiB, 1), 1u);
  EXPECT_EQ(connections(1024 * MiB, 0), 1u);
  EXPECT_EQ(TransferQueue({}, 4).connections(), 1u);
  EXPECT_FALSE(TransferQueue({}, 4).take().has_value());
}

TEST(TransferQueue, UnitsCoverThePiecesExactlyInOrderCutOnLeafBoundaries) {
  const std::vector<proto::SyncFetch> pieces{{0, 0, 100 * MiB + 3, 1}, {2, 5 * MiB + 7, 3, 1}, {1, 7, 40 * MiB, 1},
                                             {3, 0, 0, 1}, {4, 3 * MiB, L, 1}};
  TransferQueue q(pieces, 4);
  const std::uint64_t total = q.bytes_left();
  EXPECT_EQ(total, 140 * MiB + 3 + 3 + L);
  const auto units = drain(q);
  EXPECT_EQ(q.bytes_left(), 0u);
  std::size_t u = 0;
  for (const auto& p : pieces) {
    if (p.bytes == 0) continue;
    std::uint64_t at = p.offset;
    while (at < p.offset + p.bytes) {
      ASSERT_LT(u, units.size());
      const auto& unit = units[u++];
      EXPECT_EQ(unit.tensor, p.tensor);
      EXPECT_EQ(unit.source, p.source);
      EXPECT_EQ(unit.offset, at);
      ASSERT_GT(unit.bytes, 0u);
      at += unit.bytes;
      // A cut inside a piece falls on a leaf boundary of the tensor.
      if (at < p.offset + p.bytes) {
        EXPECT_EQ(at % L, 0u) << "unit " << u;
      }
    }
    EXPECT_EQ(at, p.offset + p.bytes);
  }
  EXPECT_EQ(u, units.size());
}

TEST(TransferQueue, UnitsShrinkWithWhatIsLeftAndEndAtOneLeaf) {
  TransferQueue q({proto::SyncFetch{0, 0, 256 * MiB, 0}}, 4);
  ASSERT_EQ(q.connections(), 4u);
  std::vector<proto::SyncFetch> units;
  while (q.bytes_left() > 0) {
    const std::uint64_t left = q.bytes_left();
    units.push_back(*q.take());
    // About a 16 x connections-th of what was left, rounded up to a leaf.
    EXPECT_LE(units.back().bytes, (left + 63) / 64 + L);
    EXPECT_GE(units.back().bytes, std::min<std::uint64_t>(left, std::max<std::uint64_t>((left + 63) / 64, L)) - L + 1);
  }
  EXPECT_EQ(units.front().bytes, 4 * MiB);
  // The last units, the ones connections finish on, are single leaves.
  for (std::size_t i = units.size() - 64; i < units.size(); ++i) EXPECT_EQ(units[i].bytes, L) << i;
}

TEST(TransferQueue, NoUnitCoversMoreSegmentsThanARequestMay) {
  // 20 GiB over one connection: a 4 x 1-th would be 5 GiB.
  TransferQueue q({proto::SyncFetch{0, 12345, 20ull << 30, 0}}, 1);
  for (const auto& unit : drain(q)) {
    EXPECT_LE(state::segment_count(unit.offset, unit.bytes), limits::kStateSegmentsPerRequestMax);
  }
}

// Connections of unequal speed (TCP flows rarely share a path evenly) fetch from one
// queue, each taking a unit whenever it has room for one more request: they all run dry
// within about kAskedBytesMax at the slowest one's rate, where equal shares
// fixed up front leave the fast ones idle while the slow one still has most of its share.
TEST(TransferQueue, ConnectionsOfUnequalSpeedFinishTogether) {
  const std::vector<double> rates{1.0, 2.0, 3.0, 6.0};  // bytes per unit of time, relative
  TransferQueue q({proto::SyncFetch{0, 0, 256 * MiB, 0}}, 4);
  ASSERT_EQ(q.connections(), rates.size());
  // Event simulation: each connection asks for units while wants_more() says so, and
  // again each time its oldest finishes; it moves its units one after the other.
  struct Held {
    double end;
    std::uint64_t bytes;
  };
  std::vector<std::deque<Held>> held(rates.size());
  std::vector<std::uint64_t> held_bytes(rates.size(), 0);
  std::vector<double> busy_until(rates.size(), 0.0);
  const auto ask = [&](std::size_t c) {
    while (TransferQueue::wants_more(held[c].size(), held_bytes[c])) {
      const auto unit = q.take();
      if (!unit) return;
      busy_until[c] += static_cast<double>(unit->bytes) / rates[c];
      held[c].push_back({busy_until[c], unit->bytes});
      held_bytes[c] += unit->bytes;
    }
  };
  for (std::size_t c = 0; c < rates.size(); ++c) ask(c);
  while (q.bytes_left() > 0) {
    std::size_t next = rates.size();
    for (std::size_t c = 0; c < rates.size(); ++c) {
      if (!held[c].empty() && (next == rates.size() || held[c].front().end < held[next].front().end)) next = c;
    }
    ASSERT_LT(next, rates.size());
    held_bytes[next] -= held[next].front().bytes;
    held[next].pop_front();
    ask(next);
  }
  const double first = *std::min_element(busy_until.begin(), busy_until.end());
  const double last = *std::max_element(busy_until.begin(), busy_until.end());
  const double tail = static_cast<double>(TransferQueue::kAskedBytesMax + L) / rates[0];
  EXPECT_LE(last - first, tail) << first << " .. " << last;
  // Equal stripes would end at 64 MiB / rate: the slowest at 64 Mi, 3 times later than
  // the 256 MiB / (1 + 2 + 3 + 6) the four can do together.
  EXPECT_LE(last, static_cast<double>(256 * MiB) / 12.0 + tail);
}

}  // namespace
}  // namespace lockstep::peer
