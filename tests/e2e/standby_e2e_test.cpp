// The hot standby with real processes and a real etcd (docs/operations.md, "Hot
// standby"): two lockstep-master processes compete for one lease; the holder serves, the
// other refuses peers with NOT_SERVING naming it. SIGKILL the serving master and the
// standby takes the run over once the lease expires, with a higher term, and the same
// peers go on in the same view; SIGSTOP it and resume it after the takeover, and it steps
// down on its own; stop it cleanly and the lease is released at once; lose etcd, or the
// key, and the serving master stops serving before its lease could have passed to
// another.
#include "e2e.h"
#include "etcd_process.h"

#include <lockstep/lockstep.h>

namespace lockstep::e2e {
namespace {

using Etcd = tools::EtcdProcess;

// A master of the hot standby, on an ephemeral port, with its HTTP endpoint.
std::unique_ptr<Master> ha_master(const Etcd& etcd, const std::string& ttl_s = "2") {
  return std::make_unique<Master>(std::vector<std::string>{"--http", "127.0.0.1:0", "--ha-etcd", etcd.url(),
                                                           "--ha-key", "/test/run", "--ha-lease-ttl-s", ttl_s});
}

bool becomes_serving(const Master& master) {
  return master.wait_for_state([](const json& s) { return s["ha"].is_object() && s["ha"]["serving"].get<bool>(); });
}

// Which of the two serves (waits until one does and the other knows it).
std::pair<Master*, Master*> serving_and_standby(Master& a, Master& b) {
  const auto deadline = std::chrono::steady_clock::now() + scaled(30s);
  while (std::chrono::steady_clock::now() < deadline) {
    const json sa = a.state(), sb = b.state();
    if (sa["ha"].is_object() && sb["ha"].is_object()) {
      const bool a_serves = sa["ha"]["serving"].get<bool>(), b_serves = sb["ha"]["serving"].get<bool>();
      if (a_serves != b_serves) {
        Master* serving = a_serves ? &a : &b;
        const json& standby_state = a_serves ? sb : sa;
        if (standby_state["ha"]["holder"] == serving->address()) return {serving, a_serves ? &b : &a};
      }
    }
    std::this_thread::sleep_for(20ms);
  }
  ADD_FAILURE() << "no master serves, or the standby does not name it: " << a.state().dump() << " / "
                << b.state().dump();
  return {&a, &b};
}

// `count` testpeers with failover on and the standby as their fallback, admitted into
// the serving master's run.
struct FailoverRun {
  FailoverRun(const Master& serving, const Master& standby, const char* prefix, int count) {
    std::vector<Peer*> newcomers;
    for (int i = 0; i < count; ++i) {
      peers.push_back(std::make_unique<Peer>(serving, numbered(prefix, i), 0,
                                             std::vector<std::string>{"--failover-timeout-ms",
                                                                      std::to_string(scaled(30s).count()),
                                                                      "--master-fallbacks", standby.address()}));
      newcomers.push_back(peers.back().get());
    }
    admit(members, newcomers);
  }
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<Peer*> members;
};

TEST(StandbyE2E, OneMasterServesAndTheStandbyRefusesPeersNamingIt) {
  Etcd etcd;
  auto a = ha_master(etcd);
  auto b = ha_master(etcd);
  auto [serving, standby] = serving_and_standby(*a, *b);
  // A peer that knows only the standby is refused, and told where the run is served.
  Peer lost(standby->address(), "lost");
  const json refused = lost.call("connect");
  EXPECT_EQ(code(refused), LOCKSTEP_STATUS_NOT_SERVING) << refused.dump();
  EXPECT_NE(refused.value("error", "").find(serving->address()), std::string::npos) << refused.dump();
  // With the serving master as its fallback, it joins the run there.
  Peer found(standby->address(), "found", 0, {"--master-fallbacks", serving->address()});
  EXPECT_EQ(code(found.call("connect")), LOCKSTEP_OK);
  const json state = serving->state();
  EXPECT_EQ(state["peers"].size(), 1u) << state.dump();
  EXPECT_EQ(standby->state()["peers"].size(), 0u);
  EXPECT_EQ(found.stop(), 0);
  EXPECT_EQ(a->stop(), 0);
  EXPECT_EQ(b->stop(), 0);
}

TEST(StandbyE2E, TheStandbyTakesTheRunOverWhenTheServingMasterIsKilled) {
  Etcd etcd;
  auto a = ha_master(etcd);
  auto b = ha_master(etcd);
  auto [serving, standby] = serving_and_standby(*a, *b);
  const std::uint64_t first_term = serving->state()["term"].get<std::uint64_t>();
  FailoverRun run(*serving, *standby, "s", 3);
  std::vector<Peer*>& members = run.members;
  for (const auto& r : call_all(members, "allreduce 100000 0 1")) ASSERT_EQ(code(r), 0) << r.dump();
  std::vector<std::vector<std::string>> before;
  for (auto* p : members) before.push_back(view_ids(p->call("view")));
  // 16 MiB each: the master dies while the votes or the ring are under way.
  for (auto* p : members) p->send("allreduce 4194304 1 1");
  std::this_thread::sleep_for(20ms);
  serving->kill();
  std::vector<json> replies;
  for (auto* p : members) replies.push_back(p->reply(scaled(60s)));
  for (const auto& r : replies) {
    EXPECT_TRUE(code(r) == LOCKSTEP_OK || code(r) == LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << r.dump();
    EXPECT_EQ(code(r), code(replies[0])) << "one outcome for all";
  }
  // The run goes on under the standby, in the same view.
  for (int step = 0; step < 3; ++step) {
    for (const auto& r : call_all(members, "allreduce 100000 " + std::to_string(10 + step) + " 1")) {
      EXPECT_EQ(code(r), 0) << r.dump();
      EXPECT_EQ(r.value("value", 0.0), 3.0) << r.dump();
    }
  }
  for (std::size_t i = 0; i < members.size(); ++i) EXPECT_EQ(view_ids(members[i]->call("view")), before[i]);
  const json state = standby->state();
  EXPECT_TRUE(state["ha"]["serving"].get<bool>()) << state.dump();
  EXPECT_EQ(state["ha"]["elections"].get<int>(), 1) << state.dump();
  // The term is the revision that created the key again: above the first by the key's
  // deletion and its creation (one above, as a restarted master would take, is not enough).
  EXPECT_GE(state["term"].get<std::uint64_t>(), first_term + 2) << state.dump();
  ASSERT_TRUE(state["last_recovery"].is_object()) << state.dump();
  EXPECT_EQ(state["last_recovery"]["back"].size(), 3u) << state.dump();
  for (auto* p : members) EXPECT_EQ(p->stop(), 0);
  EXPECT_EQ(standby->stop(), 0);
}

TEST(StandbyE2E, AStoppedMasterResumedAfterTheTakeoverStepsDownAndTheRunStaysWithTheStandby) {
  Etcd etcd;
  const std::vector<std::string> flags = {"--http", "127.0.0.1:0", "--ha-etcd", etcd.url(), "--ha-key", "/test/run",
                                          "--ha-lease-ttl-s", "2", "--heartbeat-timeout-ms",
                                          std::to_string(scaled(2s).count())};
  auto a = std::make_unique<Master>(flags);
  auto b = std::make_unique<Master>(flags);
  auto [serving, standby] = serving_and_standby(*a, *b);
  FailoverRun run(*serving, *standby, "z", 2);
  std::vector<Peer*>& members = run.members;
  // The serving master is silent (SIGSTOP): the peers notice it by the heartbeat timeout,
  // the standby takes the lease when it expires, and the run goes on there.
  serving->proc().signal(SIGSTOP);
  for (const auto& r : call_all(members, "agree 1", scaled(60s))) {
    EXPECT_TRUE(code(r) == LOCKSTEP_OK || code(r) == LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << r.dump();
  }
  ASSERT_TRUE(becomes_serving(*standby));
  // Resumed, the stale master finds its lease gone and steps down at its next tick: it
  // serves nobody, and the run stays with the standby.
  serving->proc().signal(SIGCONT);
  EXPECT_TRUE(serving->wait_for_state(
      [](const json& s) { return !s["ha"]["serving"].get<bool>() && s["ha"]["step_downs"].get<int>() == 1; }))
      << serving->state().dump();
  for (const auto& r : call_all(members, "allreduce 1000 7 1")) {
    EXPECT_EQ(code(r), LOCKSTEP_OK) << r.dump();
    EXPECT_EQ(r.value("value", 0.0), 2.0) << r.dump();
  }
  EXPECT_EQ(standby->state()["peers"].size(), 2u);
  EXPECT_EQ(serving->state()["peers"].size(), 0u);
  for (auto* p : members) EXPECT_EQ(p->stop(), 0);
  EXPECT_EQ(serving->stop(), 0);
  EXPECT_EQ(standby->stop(), 0);
}

TEST(StandbyE2E, AMasterThatStopsReleasesItsLeaseAtOnce) {
  Etcd etcd;
  // A long lease: the standby could take it over only after 60 s if it were not released.
  auto a = ha_master(etcd, "60");
  auto b = ha_master(etcd, "60");
  auto [serving, standby] = serving_and_standby(*a, *b);
  const auto stopped = std::chrono::steady_clock::now();
  EXPECT_EQ(serving->stop(), 0);
  EXPECT_TRUE(becomes_serving(*standby));
  EXPECT_LT(std::chrono::steady_clock::now() - stopped, scaled(30s));
  EXPECT_EQ(standby->stop(), 0);
}

TEST(StandbyE2E, AMasterWhoseKeyIsDeletedStopsServingAndCompetesAgain) {
  Etcd etcd;
  auto master = ha_master(etcd);
  ASSERT_TRUE(becomes_serving(*master));
  const std::uint64_t first_term = master->state()["term"].get<std::uint64_t>();
  // An operator deletes the key (etcdctl del /test/run): the lease lives on, but the key
  // no longer names this master, so it stops serving at its next renewal...
  const auto port = static_cast<std::uint16_t>(std::stoi(etcd.url().substr(etcd.url().rfind(':') + 1)));
  ASSERT_TRUE(http_get(port, "/v3/kv/deleterange", R"({"key":"L3Rlc3QvcnVu"})"));  // base64 of /test/run
  EXPECT_TRUE(master->wait_for_state([](const json& s) { return s["ha"]["step_downs"].get<int>() == 1; }, scaled(10s)))
      << master->state().dump();
  // ... and, the key being free, wins it again with a new term.
  EXPECT_TRUE(master->wait_for_state(
      [&](const json& s) {
        return s["ha"]["serving"].get<bool>() && s["ha"]["elections"].get<int>() == 2 &&
               s["term"].get<std::uint64_t>() > first_term;
      },
      scaled(20s)))
      << master->state().dump();
  EXPECT_EQ(master->stop(), 0);
}

TEST(StandbyE2E, AMasterThatLosesEtcdStopsServingAndTellsItsPeers) {
  Etcd etcd;
  auto master = ha_master(etcd);
  ASSERT_TRUE(becomes_serving(*master));
  Peer peer(*master, "alone");
  ASSERT_EQ(code(peer.call("connect")), LOCKSTEP_OK);
  etcd.kill();
  // Its lease cannot be renewed: it steps down before the 2 s TTL is over, and the peer
  // (failover off) is told the master is gone.
  EXPECT_TRUE(master->wait_for_state(
      [](const json& s) { return !s["ha"]["serving"].get<bool>() && s["ha"]["step_downs"].get<int>() == 1; },
      scaled(10s)))
      << master->state().dump();
  const json r = peer.call("agree 1");
  EXPECT_EQ(code(r), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST) << r.dump();
  EXPECT_NE(r.value("error", "").find("stepped down"), std::string::npos) << r.dump();
  EXPECT_EQ(master->state()["peers"].size(), 0u);
  peer.stop();
  EXPECT_EQ(master->stop(), 0);
}

}  // namespace
}  // namespace lockstep::e2e
