// Optimize topology with real processes on loopback: every peer gets the same new
// ring (a permutation of the members), collectives work on it, a second optimization
// measures nothing, and a peer killed during the measurements fails the phase for all
// survivors, whose retry succeeds.
#include "e2e.h"

#include <lockstep/lockstep.h>

#include <algorithm>
#include <csignal>

namespace lockstep::e2e {
namespace {

struct Run {
  std::unique_ptr<Master> master;
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<Peer*> members;
};

Run start(std::size_t n) {
  Run run;
  run.master = std::make_unique<Master>(std::vector<std::string>{
      "--bandwidth-test-ms", std::to_string(scaled(300ms).count()), "--heartbeat-timeout-ms",
      std::to_string(scaled(2000ms).count())});
  std::vector<Peer*> newcomers;
  for (std::size_t i = 0; i < n; ++i) {
    run.peers.push_back(std::make_unique<Peer>(*run.master, numbered("t", i)));
    newcomers.push_back(run.peers.back().get());
  }
  admit(run.members, newcomers);
  return run;
}

void expect_same_ring(const std::vector<json>& replies, std::size_t world) {
  for (const auto& r : replies) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_EQ(view_ids(r), view_ids(replies[0]));
    EXPECT_EQ(view_ids(r).size(), world);
  }
  auto ids = view_ids(replies[0]);
  std::sort(ids.begin(), ids.end());
  EXPECT_TRUE(std::adjacent_find(ids.begin(), ids.end()) == ids.end()) << "a peer appears twice in the ring";
}

TEST(OptimizeTopology, EveryPeerAdoptsTheSameRingAndCollectivesWork) {
  auto run = start(4);
  ASSERT_EQ(run.members.size(), 4u);
  const auto optimized = call_all(run.members, "optimize", scaled(60s));
  expect_same_ring(optimized, 4);
  // Ranks follow the ring: each peer's rank is its position in the view.
  for (std::size_t i = 0; i < run.members.size(); ++i) {
    const auto ids = view_ids(optimized[i]);
    const auto at = std::find(ids.begin(), ids.end(), run.members[i]->id()) - ids.begin();
    EXPECT_EQ(optimized[i]["rank"].get<long>(), at);
  }
  for (std::size_t i = 0; i < run.members.size(); ++i) {
    run.members[i]->send("allreduce 100000 1 " + std::to_string(i + 1) + " inplace");
  }
  for (auto* p : run.members) {
    const json r = p->reply();
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_EQ(r["value"].get<double>(), 10.0);
  }
  // Nothing is missing the second time: no measurement, the same ring.
  const auto again = call_all(run.members, "optimize", scaled(60s));
  expect_same_ring(again, 4);
  EXPECT_EQ(view_ids(again[0]), view_ids(optimized[0]));
}

TEST(OptimizeTopology, PeerKilledDuringMeasurementsFailsForAllAndTheRetrySucceeds) {
  auto run = start(4);
  ASSERT_EQ(run.members.size(), 4u);
  for (auto* p : run.members) p->send("optimize");
  // Three rounds of 300 ms tests: the kill lands in the first or second one.
  std::this_thread::sleep_for(scaled(400ms));
  run.members[3]->proc().signal(SIGKILL);
  std::vector<Peer*> survivors = {run.members[0], run.members[1], run.members[2]};
  for (auto* p : survivors) {
    const json r = p->reply(scaled(60s));
    EXPECT_EQ(code(r), LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED) << r.dump();
  }
  const auto retry = call_all(survivors, "optimize", scaled(60s));
  expect_same_ring(retry, 3);
  for (std::size_t i = 0; i < survivors.size(); ++i) {
    survivors[i]->send("allreduce 1000 2 " + std::to_string(i + 1) + " inplace");
  }
  for (auto* p : survivors) {
    const json r = p->reply();
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_EQ(r["value"].get<double>(), 6.0);
  }
}

}  // namespace
}  // namespace lockstep::e2e
