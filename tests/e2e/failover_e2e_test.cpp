// Failover with real processes (docs/architecture.md, "Failover"): a lockstep-master
// SIGKILLed in the middle of a run and started again on its address, or a second master
// on the peers' fallback address, takes the same peers back; the operation in flight
// ends with one outcome for all of them and the run goes on in the same view. Without a
// master, calls block until the failover timeout and then fail as before.
#include "e2e.h"

#include <lockstep/lockstep.h>

#include <algorithm>
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

// A supervisor's restart: the master SIGKILLed and a new one started at once on its port.
void kill_and_restart(std::unique_ptr<Master>& master) {
  const std::uint16_t port = master->port();
  master->kill();
  master = std::make_unique<Master>(std::vector<std::string>{"--http", "127.0.0.1:0"}, "127.0.0.1", port);
}

// Every reply the same code, one of `allowed`.
void expect_same_code(const std::vector<json>& replies, std::initializer_list<int> allowed) {
  for (const auto& r : replies) {
    ASSERT_TRUE(r.is_object()) << "a peer did not answer";
    EXPECT_EQ(code(r), code(replies[0])) << r.dump() << " vs " << replies[0].dump();
    EXPECT_NE(std::find(allowed.begin(), allowed.end(), code(r)), allowed.end()) << r.dump();
  }
}

std::vector<json> replies_of(std::vector<Peer*>& members) {
  std::vector<json> out;
  for (auto* p : members) out.push_back(p->reply(scaled(60s)));
  return out;
}

// The README's loop for update and optimize topology, in every peer at once: each calls
// again while its call fails with `retry` (a peer whose vote was cast again to the new
// master meets the others' second calls). Returns each peer's last reply.
std::vector<json> until_not(std::vector<Peer*>& members, const std::string& command, int retry) {
  std::vector<json> last(members.size());
  std::vector<int> calls(members.size(), 1);
  const auto deadline = std::chrono::steady_clock::now() + scaled(60s);
  for (std::size_t done = 0; done < members.size() && std::chrono::steady_clock::now() < deadline;) {
    done = 0;
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (last[i].is_object() && code(last[i]) != retry) {
        ++done;
        continue;
      }
      const json r = members[i]->reply(10ms);
      if (r.is_null()) continue;
      last[i] = r;
      if (code(r) == retry && calls[i]++ < 5) members[i]->send(command);
    }
  }
  return last;
}

TEST(FailoverE2E, AMasterKilledMidAllReduceAndRestartedOnItsAddressTakesTheSamePeersBack) {
  auto master = std::make_unique<Master>();
  ThreePeers run(*master);
  for (const auto& r : call_all(run.members, "allreduce 100000 0 1")) ASSERT_EQ(code(r), 0) << r.dump();
  const auto before = views(run.members);
  ASSERT_EQ(before[0].size(), 3u);
  // 16 MiB each: the master dies while the votes or the ring are under way.
  for (auto* p : run.members) p->send("allreduce 4194304 1 1");
  std::this_thread::sleep_for(20ms);
  kill_and_restart(master);
  expect_one_outcome(replies_of(run.members));
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

// A shared-state sync in which the third peer, one revision behind, receives 32 MiB:
// the master dies while the content moves (seen on its state page: a peer in
// SYNC_SHARED_STATE; a sync that ended before the page showed it is tried again at the
// next revision). One outcome for all; a failed sync is retried; the revision sequence
// goes on unbroken and every peer ends with the same bytes.
TEST(FailoverE2E, AMasterKilledMidSyncLeavesTheRevisionSequenceUnbroken) {
  auto master = std::make_unique<Master>(std::vector<std::string>{"--http", "127.0.0.1:0"});
  ThreePeers run(*master);
  for (auto* p : run.members) ASSERT_EQ(code(p->call("tensor weights 33554432")), 0);
  const auto syncing = [](const json& s) {
    for (const auto& p : s["peers"]) {
      if (p["state"] == "SYNC_SHARED_STATE") return true;
    }
    return false;
  };
  bool killed = false;
  std::vector<json> replies;
  int revision = 0;
  while (!killed && revision < 10) {
    ++revision;
    for (std::size_t i = 0; i < run.members.size(); ++i) {
      Peer* p = run.members[i];
      ASSERT_EQ(code(p->call("fill weights " + std::to_string(i < 2 ? revision : 1000 + revision))), 0);
      ASSERT_EQ(code(p->call("revision " + std::to_string(i < 2 ? revision : revision - 1))), 0);
    }
    for (auto* p : run.members) p->send("sync popular");
    killed = master->wait_for_state(syncing, scaled(2s));
    if (killed) kill_and_restart(master);
    replies = replies_of(run.members);
  }
  ASSERT_TRUE(killed) << "no sync was seen under way in 10 tries";
  expect_same_code(replies, {LOCKSTEP_OK, LOCKSTEP_STATUS_PEER_CONNECTION_LOST});
  for (int retry = 0; retry < 3 && code(replies[0]) != LOCKSTEP_OK; ++retry) {
    replies = call_all(run.members, "sync popular", scaled(60s));
  }
  for (const auto& r : replies) {
    ASSERT_EQ(code(r), LOCKSTEP_OK) << r.dump();
    EXPECT_EQ(r["revision"], revision) << r.dump();
    EXPECT_EQ(r["hashes"], replies[0]["hashes"]) << r.dump();
  }
  // The next step of training: the next revision, every peer in agreement, nothing moves.
  for (auto* p : run.members) ASSERT_EQ(code(p->call("revision " + std::to_string(revision + 1))), 0);
  for (const auto& r : call_all(run.members, "sync popular", scaled(60s))) {
    EXPECT_EQ(code(r), LOCKSTEP_OK) << r.dump();
    EXPECT_EQ(r["revision"], revision + 1) << r.dump();
    EXPECT_EQ(r["hashes"], replies[0]["hashes"]) << r.dump();
    EXPECT_EQ(r["bytes_received"], 0) << r.dump();
  }
  EXPECT_EQ(master->state()["term"].get<int>(), 2);
  EXPECT_EQ(master->stop(), 0);
  for (auto* p : run.members) EXPECT_EQ(p->stop(), 0);
}

// The master dies while the members' update topology admits a newcomer: in the README's
// loop the members end their update topology; the newcomer is admitted by the new master
// at the next update topology (its connect either went through before the kill or is
// made again).
TEST(FailoverE2E, AMasterKilledMidJoinAdmitsTheNewcomerAfterwards) {
  auto master = std::make_unique<Master>();
  const std::vector<std::string> flags = {"--failover-timeout-ms", std::to_string(scaled(30s).count())};
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<Peer*> members;
  for (int i = 0; i < 2; ++i) peers.push_back(std::make_unique<Peer>(*master, numbered("j", i), 0, flags));
  admit(members, {peers[0].get(), peers[1].get()});
  ASSERT_EQ(members.size(), 2u);
  Peer newcomer(*master, "j-new", 0, flags);
  newcomer.send("connect");
  const auto deadline = std::chrono::steady_clock::now() + scaled(30s);
  while (std::chrono::steady_clock::now() < deadline) {
    const auto pending = call_all(members, "pending");
    if (pending[0].value("pending", false)) break;
    std::this_thread::sleep_for(10ms);
  }
  for (auto* p : members) p->send("update");
  std::this_thread::sleep_for(5ms);
  kill_and_restart(master);
  for (const auto& r : until_not(members, "update", LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED)) {
    EXPECT_EQ(code(r), LOCKSTEP_OK) << r.dump();
  }
  json joined = newcomer.reply(scaled(60s));
  ASSERT_TRUE(joined.is_object()) << "the newcomer's connect did not return";
  if (code(joined) != LOCKSTEP_OK) {
    // Its first master died before admitting it: it connects again, as a newcomer.
    EXPECT_EQ(code(joined), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST) << joined.dump();
    admit(members, {&newcomer}, "reconnect");
  } else {
    members.push_back(&newcomer);
  }
  ASSERT_EQ(members.size(), 3u);
  for (const auto& r : call_all(members, "allreduce 1000 1 1")) {
    EXPECT_EQ(code(r), LOCKSTEP_OK) << r.dump();
    EXPECT_EQ(r.value("world", 0), 3) << r.dump();
  }
  EXPECT_EQ(master->stop(), 0);
  for (auto* p : members) EXPECT_EQ(p->stop(), 0);
}

// The master dies mid optimize topology: in the README's loop every peer ends its call
// with the same new ring (a peer whose round had started fails once and calls again;
// one whose vote the new master had not seen yet casts it again); the same three peers
// carry on.
TEST(FailoverE2E, AMasterKilledMidOptimizeKeepsTheSamePeers) {
  auto master = std::make_unique<Master>();
  ThreePeers run(*master);
  auto before = views(run.members)[0];
  std::sort(before.begin(), before.end());
  for (auto* p : run.members) p->send("optimize");
  std::this_thread::sleep_for(20ms);
  kill_and_restart(master);
  for (const auto& r : until_not(run.members, "optimize", LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED)) {
    EXPECT_EQ(code(r), LOCKSTEP_OK) << r.dump();
  }
  const auto after = views(run.members);
  for (auto v : after) {
    EXPECT_EQ(v, after[0]);
    std::sort(v.begin(), v.end());
    EXPECT_EQ(v, before);
  }
  for (const auto& r : call_all(run.members, "allreduce 1000 1 1")) {
    EXPECT_EQ(code(r), LOCKSTEP_OK) << r.dump();
    EXPECT_EQ(r.value("world", 0), 3) << r.dump();
  }
  EXPECT_EQ(master->stop(), 0);
  for (auto* p : run.members) EXPECT_EQ(p->stop(), 0);
}

// A master SIGSTOPped past the heartbeat timeout: the peers take the run to the second
// address of their list; the stopped one is continued (SIGCONT) and no peer obeys it:
// the run goes on under the second master's term, with the same three peers.
TEST(FailoverE2E, AStoppedMasterReplacedOnTheNextAddressIsNotObeyedWhenItContinues) {
  const std::vector<std::string> heartbeat = {"--heartbeat-timeout-ms", std::to_string(scaled(2s).count()), "--http",
                                              "127.0.0.1:0"};
  Master standby(heartbeat);
  Master master(heartbeat);
  ThreePeers run(master, {"--master-fallbacks", standby.address()});
  const auto before = views(run.members);
  master.proc().signal(SIGSTOP);
  for (const auto& r : call_all(run.members, "agree 1", scaled(60s))) {
    EXPECT_TRUE(code(r) == LOCKSTEP_OK || code(r) == LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << r.dump();
  }
  master.proc().signal(SIGCONT);
  // The continued master finds its peers gone; the second one serves them, term 2.
  EXPECT_TRUE(master.wait_for_state([](const json& s) { return s["peers"].empty(); })) << master.state().dump();
  expect_same_run(run.members, before);
  const json state = standby.state();
  EXPECT_EQ(state["term"].get<int>(), 2) << state.dump();
  EXPECT_EQ(state["peers"].size(), 3u) << state.dump();
  EXPECT_TRUE(master.state()["peers"].empty()) << master.state().dump();
  EXPECT_EQ(master.stop(), 0);
  EXPECT_EQ(standby.stop(), 0);
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
