// Failover with real processes (docs/architecture.md, "Failover"): a lockstep-master
// SIGKILLed in the middle of a run and started again on its address, or a second master
// on the peers' fallback address, takes the same peers back; the operation in flight
// ends with one outcome for all of them and the run goes on in the same view. Without a
// master, calls block until the failover timeout and then fail as before.
#include "e2e.h"

#include <lockstep/lockstep.h>

#include <set>

namespace lockstep::e2e {
namespace {

// A run of three testpeers with failover on, admitted.
struct ThreePeers {
  explicit ThreePeers(const Master& master, std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = {"--failover-timeout-ms", std::to_string(scaled(30s).count())};
    flags.insert(flags.end(), extra.begin(), extra.end());
    for (int i = 0; i < 3; ++i) peers.push_back(std::make_unique<Peer>(master, numbered("f", i), 0, flags));
    std::vector<Peer*> newcomers;
    for (auto& p : peers) newcomers.push_back(p.get());
    admit(members, newcomers);
  }
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<Peer*> members;
};

// Every reply of an all-reduce of FILL 1 over three peers: one outcome for all (a
// success with the sum, or the retryable failure with the buffer as it was).
void expect_one_outcome(const std::vector<json>& replies) {
  ASSERT_EQ(replies.size(), 3u);
  for (const auto& r : replies) {
    ASSERT_TRUE(r.is_object()) << "a peer did not answer";
    EXPECT_EQ(code(r), code(replies[0])) << r.dump() << " vs " << replies[0].dump();
    if (code(r) == LOCKSTEP_OK) {
      EXPECT_EQ(r["value"].get<double>(), 3.0) << r.dump();
      EXPECT_EQ(r["world"].get<int>(), 3) << r.dump();
    } else {
      EXPECT_EQ(code(r), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << r.dump();
      EXPECT_TRUE(r["unchanged"].get<bool>()) << r.dump();
    }
  }
}

// The run goes on in the same view: all-reduces and an agree succeed with all three.
void expect_same_run(std::vector<Peer*>& members, const std::vector<std::vector<std::string>>& views_before) {
  for (int step = 0; step < 3; ++step) {
    for (const auto& r : call_all(members, "allreduce 100000 " + std::to_string(10 + step) + " 1")) {
      EXPECT_EQ(code(r), 0) << r.dump();
      EXPECT_EQ(r.value("world", 0), 3) << r.dump();
      EXPECT_EQ(r.value("value", 0.0), 3.0) << r.dump();
    }
  }
  for (const auto& r : call_all(members, "agree 1")) EXPECT_EQ(code(r), 0) << r.dump();
  for (std::size_t i = 0; i < members.size(); ++i) {
    EXPECT_EQ(view_ids(members[i]->call("view")), views_before[i]) << members[i]->name();
  }
}

std::vector<std::vector<std::string>> views(std::vector<Peer*>& members) {
  std::vector<std::vector<std::string>> out;
  for (auto* p : members) out.push_back(view_ids(p->call("view")));
  return out;
}

TEST(FailoverE2E, AMasterKilledMidAllReduceAndRestartedOnItsAddressTakesTheSamePeersBack) {
  auto master = std::make_unique<Master>();
  const std::uint16_t port = master->port();
  ThreePeers run(*master);
  for (const auto& r : call_all(run.members, "allreduce 100000 0 1")) ASSERT_EQ(code(r), 0) << r.dump();
  const auto before = views(run.members);
  ASSERT_EQ(before[0].size(), 3u);
  // 16 MiB each: the master dies while the votes or the ring are under way.
  for (auto* p : run.members) p->send("allreduce 4194304 1 1");
  std::this_thread::sleep_for(20ms);
  master->kill();
  master = std::make_unique<Master>(std::vector<std::string>{"--http", "127.0.0.1:0"}, "127.0.0.1", port);
  std::vector<json> replies;
  for (auto* p : run.members) replies.push_back(p->reply(scaled(60s)));
  expect_one_outcome(replies);
  expect_same_run(run.members, before);
  // The new master says what happened: its term is above the first master's, and all
  // three came back.
  const json state = master->state();
  ASSERT_TRUE(state.is_object());
  EXPECT_EQ(state["term"].get<int>(), 2) << state.dump();
  EXPECT_FALSE(state["recovering"].get<bool>());
  ASSERT_TRUE(state["last_recovery"].is_object()) << state.dump();
  EXPECT_EQ(state["last_recovery"]["back"].size(), 3u);
  EXPECT_TRUE(state["last_recovery"]["missing"].empty());
  EXPECT_EQ(master->stop(), 0);
  for (auto* p : run.members) EXPECT_EQ(p->stop(), 0);
}

TEST(FailoverE2E, TheNextAddressOfTheListTakesTheRunBack) {
  Master standby;  // idle until the peers come to it
  auto master = std::make_unique<Master>();
  ThreePeers run(*master, {"--master-fallbacks", standby.address()});
  const auto before = views(run.members);
  master->kill();
  master.reset();
  // An agree called while no master serves blocks, then succeeds with the standby.
  for (const auto& r : call_all(run.members, "agree 1", scaled(60s))) {
    EXPECT_TRUE(code(r) == LOCKSTEP_OK || code(r) == LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << r.dump();
  }
  expect_same_run(run.members, before);
  EXPECT_EQ(standby.stop(), 0);
  for (auto* p : run.members) EXPECT_EQ(p->stop(), 0);
}

TEST(FailoverE2E, AStoppedMasterIsNoticedWithinTheHeartbeatTimeout) {
  // The peer's side of the heartbeat: it expects the master's answer, and a master that
  // is silent (SIGSTOP: connected, but answering nothing) is lost after the heartbeat
  // timeout, as a silent peer is for the master (failover off: the call fails).
  const auto heartbeat = scaled(2s);
  Master master({"--heartbeat-timeout-ms", std::to_string(heartbeat.count())});
  Peer peer(master, "silent-master");
  ASSERT_EQ(code(peer.call("connect")), LOCKSTEP_OK);
  std::this_thread::sleep_for(heartbeat / 3);  // mid-way between two heartbeats
  const auto stopped = std::chrono::steady_clock::now();
  master.proc().signal(SIGSTOP);
  const json r = peer.call("agree 1", scaled(60s));
  const auto noticed = std::chrono::steady_clock::now() - stopped;
  master.proc().signal(SIGCONT);
  EXPECT_EQ(code(r), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST) << r.dump();
  EXPECT_LT(noticed, heartbeat + scaled(1500ms));
  peer.stop();
}

TEST(FailoverE2E, WithoutAMasterCallsBlockUntilTheFailoverTimeoutThenFail) {
  Master master;
  const auto timeout = scaled(1500ms);
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<Peer*> members;
  std::vector<Peer*> newcomers;
  for (int i = 0; i < 2; ++i) {
    peers.push_back(std::make_unique<Peer>(master, numbered("t", i), 0,
                                           std::vector<std::string>{"--failover-timeout-ms",
                                                                    std::to_string(timeout.count())}));
    newcomers.push_back(peers.back().get());
  }
  admit(members, newcomers);
  master.kill();
  const auto start = std::chrono::steady_clock::now();
  for (const auto& r : call_all(members, "agree 1", scaled(60s))) {
    EXPECT_EQ(code(r), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST) << r.dump();
  }
  // Not at once (it waited for a master), and not much later than the timeout.
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, timeout / 2);
  EXPECT_LT(waited, timeout + scaled(10s));
  for (auto* p : members) p->stop();
}

}  // namespace
}  // namespace lockstep::e2e
