// The stream count rule (peer/streams.h) against model paths whose rate depends on the
// number of streams: it climbs where more flows help, stays low where they cost, follows
// a path that changes in both directions, never exceeds its bound, ignores small and
// stale samples, and a fixed count never moves.
#include "peer/streams.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>

namespace {

using lockstep::peer::StreamTuner;

constexpr std::uint64_t kBytes = 64u << 20;

// Feeds `attempts` attempts of a path with rate(streams) bytes per microsecond; returns
// how many attempts ran with each count.
std::map<std::uint32_t, int> drive(StreamTuner& t, const std::function<double(std::uint32_t)>& rate, int attempts) {
  std::map<std::uint32_t, int> used;
  for (int i = 0; i < attempts; ++i) {
    const std::uint32_t s = t.streams();
    ++used[s];
    t.on_attempt(s, kBytes, static_cast<std::uint64_t>(static_cast<double>(kBytes) / rate(s)));
  }
  return used;
}

// A lossy long path: each flow gets 10 units, the link 75.
double lossy(std::uint32_t s) { return std::min(75.0, 10.0 * s); }
// A clean short path: one flow fills it, more only cost.
double clean(std::uint32_t s) { return 100.0 / (1.0 + 0.05 * (s - 1)); }

TEST(StreamTuner, ClimbsWhereMoreFlowsHelp) {
  StreamTuner t(0, 16);
  drive(t, lossy, 40);
  EXPECT_EQ(t.streams(), 8u) << "8 flows fill the link (75 of 80); 16 would not gain 25 %";
  auto used = drive(t, lossy, 1000);
  EXPECT_GT(used[8], 850) << "it stays there, but for brief probes (one down and one up per hold)";
}

TEST(StreamTuner, StaysAtOneWhereMoreFlowsCost) {
  StreamTuner t(0, 16);
  auto used = drive(t, clean, 1000);
  EXPECT_EQ(t.streams(), 1u);
  EXPECT_GT(used[1], 900) << "probes are brief";
  EXPECT_EQ(used.count(4), 0u) << "a probe that lost is not followed by a larger one";
}

TEST(StreamTuner, FollowsAPathThatChangesBothWays) {
  StreamTuner t(0, 16);
  drive(t, lossy, 200);
  EXPECT_EQ(t.streams(), 8u);
  drive(t, clean, 400);
  EXPECT_EQ(t.streams(), 1u) << "the loss is gone: fewer streams do as well";
  drive(t, lossy, 400);
  EXPECT_EQ(t.streams(), 8u) << "the loss is back";
}

TEST(StreamTuner, NeverAboveItsBound) {
  StreamTuner t(0, 4);
  auto used = drive(t, [](std::uint32_t s) { return 10.0 * s; }, 500);
  EXPECT_EQ(t.streams(), 4u);
  EXPECT_EQ(used.rbegin()->first, 4u);
}

TEST(StreamTuner, IgnoresSmallAndStaleSamples) {
  StreamTuner t(0, 16);
  for (int i = 0; i < 100; ++i) t.on_attempt(1, StreamTuner::kSampleBytesMin - 1, 1);  // huge rate, but small
  EXPECT_EQ(t.streams(), 1u);
  t.on_attempt(1, kBytes, 1000);
  t.on_attempt(1, kBytes, 1000);
  ASSERT_EQ(t.streams(), 2u) << "two samples at 1: the probe";
  for (int i = 0; i < 100; ++i) t.on_attempt(1, kBytes, 1);  // of an attempt begun at 1
  EXPECT_EQ(t.streams(), 2u);
}

TEST(StreamTuner, FixedCountNeverMoves) {
  StreamTuner t(3, 16);
  auto used = drive(t, lossy, 200);
  EXPECT_EQ(used.size(), 1u);
  EXPECT_EQ(t.streams(), 3u);
  StreamTuner capped(40, 16);
  EXPECT_EQ(capped.streams(), 16u);
}

}  // namespace
