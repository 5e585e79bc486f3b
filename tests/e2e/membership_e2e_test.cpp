// End-to-end membership tests with real processes: a lockstep-master and
// lockstep-testpeer processes on loopback. Peers join in waves across two groups,
// are SIGKILLed and SIGSTOPped, reconnect as new peers, vote with agree(), and the
// master is fed garbage while the run goes on.
#include "e2e.h"

#include <lockstep/lockstep.h>

#include <arpa/inet.h>
#include <csignal>
#include <map>
#include <netinet/in.h>
#include <set>
#include <sys/socket.h>
#include <unistd.h>

namespace lockstep::e2e {
namespace {

// Every peer of each group reports the same membership view, ranks are 0..n-1 in
// order, and the global world size is the sum of the groups.
void expect_consistent_views(const std::vector<Peer*>& peers, const std::map<std::string, int>& group_of) {
  std::map<int, std::vector<std::string>> view_of_group;
  std::size_t total = 0;
  std::map<int, std::size_t> group_sizes;
  for (auto* p : peers) group_sizes[group_of.at(p->name())]++;
  for (const auto& [g, n] : group_sizes) total += n;
  for (auto* p : peers) {
    auto r = p->call("view");
    ASSERT_EQ(code(r), 0) << r.dump();
    const int group = group_of.at(p->name());
    auto ids = view_ids(r);
    for (std::size_t i = 0; i < r["view"].size(); ++i) {
      EXPECT_EQ(r["view"][i]["rank"].get<std::size_t>(), i);
    }
    EXPECT_EQ(ids.size(), group_sizes[group]) << p->name() << " sees " << r.dump();
    EXPECT_EQ(r["world"].get<std::size_t>(), total) << p->name();
    EXPECT_EQ(r["group_world"].get<std::size_t>(), group_sizes[group]) << p->name();
    EXPECT_EQ(r["groups"].get<std::size_t>(), group_sizes.size()) << p->name();
    EXPECT_EQ(ids.at(r["rank"].get<std::size_t>()), p->id()) << p->name() << " is not at its own rank";
    auto [it, fresh] = view_of_group.emplace(group, ids);
    if (!fresh) {
      EXPECT_EQ(it->second, ids) << p->name() << " disagrees with its group's view";
    }
  }
}

TEST(Membership, EightPeersJoinInWavesAcrossTwoGroups) {
  Master master;
  std::vector<std::unique_ptr<Peer>> peers;
  std::map<std::string, int> group_of;
  std::vector<Peer*> members;
  const std::vector<int> waves = {3, 3, 2};
  int index = 0;
  for (int wave : waves) {
    std::vector<Peer*> newcomers;
    for (int i = 0; i < wave; ++i, ++index) {
      const std::string name = numbered("p", index);
      const int group = index % 2;
      peers.push_back(std::make_unique<Peer>(master, name, static_cast<std::uint32_t>(group)));
      group_of[name] = group;
      newcomers.push_back(peers.back().get());
    }
    admit(members, newcomers);
    ASSERT_EQ(members.size(), static_cast<std::size_t>(index));
    expect_consistent_views(members, group_of);
  }
  // Identities are unique.
  std::set<std::string> ids;
  for (auto* p : members) ids.insert(p->id());
  EXPECT_EQ(ids.size(), members.size());
  // Nothing pending now: every peer gets the same "no".
  for (const auto& r : call_all(members, "pending")) {
    EXPECT_EQ(code(r), 0);
    EXPECT_FALSE(r["pending"].get<bool>());
  }
  // Clean exits (under sanitizers this also checks for leaks and errors at exit).
  for (auto* p : members) EXPECT_EQ(p->stop(), 0) << p->name();
  EXPECT_EQ(master.stop(), 0);
}

TEST(Membership, KilledPeerIsGoneFromEverySurvivorsView) {
  Master master;
  std::vector<std::unique_ptr<Peer>> peers;
  std::map<std::string, int> group_of;
  std::vector<Peer*> newcomers;
  for (int i = 0; i < 4; ++i) {
    peers.push_back(std::make_unique<Peer>(master, numbered("k", i)));
    group_of[peers.back()->name()] = 0;
    newcomers.push_back(peers.back().get());
  }
  std::vector<Peer*> members;
  admit(members, newcomers);
  ASSERT_EQ(members.size(), 4u);
  expect_consistent_views(members, group_of);
  const std::string victim_id = members[1]->id();
  members[1]->proc().signal(SIGKILL);
  members[1]->proc().kill();
  std::vector<Peer*> survivors = {members[0], members[2], members[3]};
  // The departure makes are-peers-pending say yes on every survivor.
  for (const auto& r : call_all(survivors, "pending")) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_TRUE(r["pending"].get<bool>());
  }
  for (const auto& r : call_all(survivors, "update")) {
    ASSERT_EQ(code(r), 0) << r.dump();
    auto ids = view_ids(r);
    EXPECT_EQ(ids.size(), 3u);
    EXPECT_EQ(std::count(ids.begin(), ids.end(), victim_id), 0) << r.dump();
  }
  expect_consistent_views(survivors, group_of);
}

TEST(Membership, StoppedPeerIsRemovedAfterHeartbeatTimeoutAndRejoinsAsNewPeer) {
  const auto heartbeat = scaled(1500ms);
  Master master({"--heartbeat-timeout-ms", std::to_string(heartbeat.count())});
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<Peer*> newcomers;
  for (int i = 0; i < 3; ++i) {
    peers.push_back(std::make_unique<Peer>(master, numbered("s", i)));
    newcomers.push_back(peers.back().get());
  }
  std::vector<Peer*> members;
  admit(members, newcomers);
  ASSERT_EQ(members.size(), 3u);
  Peer* stopped = members[2];
  const std::string old_id = stopped->id();
  ASSERT_TRUE(stopped->proc().signal(SIGSTOP));
  std::vector<Peer*> survivors = {members[0], members[1]};
  // The stopped peer holds the vote (votes are barriers) until the master removes it.
  const auto start = std::chrono::steady_clock::now();
  auto pending = call_all(survivors, "pending", heartbeat + scaled(10s));
  const auto waited = std::chrono::steady_clock::now() - start;
  for (const auto& r : pending) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_TRUE(r["pending"].get<bool>());
  }
  EXPECT_GE(waited, heartbeat - 200ms) << "removed before its heartbeat timeout";
  EXPECT_LE(waited, heartbeat + scaled(3s)) << "removal took far longer than the heartbeat timeout";
  for (const auto& r : call_all(survivors, "update")) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_EQ(view_ids(r).size(), 2u);
  }
  // Resumed, the old peer learns it was removed, and every call fails fast.
  ASSERT_TRUE(stopped->proc().signal(SIGCONT));
  auto after = stopped->call("agree 1");
  EXPECT_TRUE(code(after) == LOCKSTEP_STATUS_KICKED || code(after) == LOCKSTEP_STATUS_MASTER_CONNECTION_LOST)
      << after.dump();
  EXPECT_EQ(code(stopped->call("pending")), code(after));
  // It can come back, as a new peer.
  stopped->send("reconnect");
  std::vector<Peer*> members2 = survivors;
  const auto deadline = std::chrono::steady_clock::now() + scaled(30s);
  json rejoined;
  while (rejoined.is_null() && std::chrono::steady_clock::now() < deadline) {
    auto p = call_all(members2, "pending");
    if (p[0].value("pending", false)) {
      for (const auto& r : call_all(members2, "update")) ASSERT_EQ(code(r), 0) << r.dump();
    }
    rejoined = stopped->reply(scaled(100ms));
  }
  ASSERT_EQ(code(rejoined), 0) << rejoined.dump();
  EXPECT_NE(rejoined["id"].get<std::string>(), old_id) << "a reconnected peer must get a new identity";
  EXPECT_EQ(view_ids(rejoined).size(), 3u);
}

TEST(Agree, OneFalseMakesEveryAnswerFalse) {
  Master master;
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<Peer*> newcomers;
  for (int i = 0; i < 5; ++i) {
    peers.push_back(std::make_unique<Peer>(master, numbered("a", i)));
    newcomers.push_back(peers.back().get());
  }
  std::vector<Peer*> members;
  admit(members, newcomers);
  ASSERT_EQ(members.size(), 5u);
  for (const auto& r : call_all(members, "agree 1")) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_TRUE(r["result"].get<bool>());
  }
  for (int dissenter = 0; dissenter < 5; dissenter += 2) {
    for (int i = 0; i < 5; ++i) members[static_cast<std::size_t>(i)]->send(i == dissenter ? "agree 0" : "agree 1");
    for (auto* p : members) {
      auto r = p->reply();
      ASSERT_EQ(code(r), 0) << r.dump();
      EXPECT_FALSE(r["result"].get<bool>()) << p->name();
    }
  }
}

TEST(Agree, PeerKilledDuringAgreeGivesEverySurvivorTheSameOutcome) {
  Master master({"--http", "127.0.0.1:0"});
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<Peer*> newcomers;
  for (int i = 0; i < 5; ++i) {
    peers.push_back(std::make_unique<Peer>(master, numbered("d", i)));
    newcomers.push_back(peers.back().get());
  }
  std::vector<Peer*> members;
  admit(members, newcomers);
  ASSERT_EQ(members.size(), 5u);
  std::vector<Peer*> survivors(members.begin(), members.begin() + 4);
  for (auto* p : survivors) p->send("agree 1");
  // The fifth peer dies with the round open: the survivors' four votes are in and the
  // round waits for the fifth alone.
  const bool open = master.wait_for_state([](const json& state) {
    for (const auto& op : state["operations"]) {
      if (op["operation"] == "agree" && op["done"].size() == 4 && op["waiting"].size() == 1) return true;
    }
    return false;
  });
  ASSERT_TRUE(open) << "the four votes never reached the master: " << master.state().dump();
  members[4]->proc().kill();
  std::vector<json> replies;
  for (auto* p : survivors) replies.push_back(p->reply());
  for (const auto& r : replies) {
    EXPECT_EQ(code(r), code(replies[0])) << "survivors got different outcomes: " << r.dump();
    EXPECT_EQ(r.value("result", false), replies[0].value("result", false));
  }
  EXPECT_EQ(code(replies[0]), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << replies[0].dump();
  // The survivors go on: the next agree works among them.
  for (const auto& r : call_all(survivors, "agree 1")) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_TRUE(r["result"].get<bool>());
  }
}

TEST(Membership, NewcomerWithUnreachableP2PPortIsRejected) {
  Master master;
  Peer a(master, "u0");
  Peer b(master, "u1");
  std::vector<Peer*> members;
  admit(members, {&a, &b});
  ASSERT_EQ(members.size(), 2u);
  // The newcomer listens on 127.0.0.2 but tells the others to use 127.0.0.1, where
  // nobody listens on its port: nobody can connect to it.
  Peer bad(master, "u2", 0, {"--bind-host", "127.0.0.2", "--advertised-host", "127.0.0.1"});
  bad.send("connect");
  json pending;
  const auto deadline = std::chrono::steady_clock::now() + scaled(20s);
  while (std::chrono::steady_clock::now() < deadline) {
    auto p = call_all(members, "pending");
    if (p[0].value("pending", false)) break;
    std::this_thread::sleep_for(20ms);
  }
  for (const auto& r : call_all(members, "update")) {
    EXPECT_EQ(code(r), LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) << r.dump();
  }
  auto rejected = bad.reply();
  EXPECT_EQ(code(rejected), LOCKSTEP_STATUS_REJECTED) << rejected.dump();
  // The accepted peers' next update succeeds without it.
  for (const auto& r : call_all(members, "update")) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_EQ(view_ids(r).size(), 2u);
  }
}

// A newcomer that stops before the accepted peers' update: they connect to it (the
// kernel completes the TCP connect of a stopped process) and wait for its handshake
// answer. When the master evicts it at the heartbeat timeout and ends the epoch, their
// connection setup must stop at once, not at the p2p connect timeout (5 s).
TEST(Membership, NewcomerStoppedDuringEstablishmentFailsTheUpdateAtTheHeartbeatTimeout) {
  const auto heartbeat = scaled(1500ms);
  Master master({"--heartbeat-timeout-ms", std::to_string(heartbeat.count())});
  Peer a(master, "e0");
  Peer b(master, "e1");
  std::vector<Peer*> members;
  admit(members, {&a, &b});
  ASSERT_EQ(members.size(), 2u);
  Peer late(master, "e2");
  late.send("connect");
  const auto deadline = std::chrono::steady_clock::now() + scaled(20s);
  bool pending = false;
  while (!pending && std::chrono::steady_clock::now() < deadline) {
    pending = call_all(members, "pending")[0].value("pending", false);
    if (!pending) std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(pending) << "the newcomer never registered";
  ASSERT_TRUE(late.proc().signal(SIGSTOP));
  const auto start = std::chrono::steady_clock::now();
  for (const auto& r : call_all(members, "update", heartbeat + scaled(20s))) {
    EXPECT_EQ(code(r), LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) << r.dump();
  }
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_LE(waited, heartbeat + scaled(2500ms)) << "connection setup outlived the failed epoch";
  for (const auto& r : call_all(members, "update")) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_EQ(view_ids(r).size(), 2u);
  }
  ASSERT_TRUE(late.proc().signal(SIGCONT));
}

TEST(Membership, MixingLoopbackAndRemoteAddressesIsRefusedWithAReason) {
  Master master;
  Peer a(master, "l0");
  std::vector<Peer*> members;
  admit(members, {&a});
  // The master sees this peer on loopback but it claims a non-loopback address; it is
  // refused at registration (nothing ever connects to that address).
  Peer remote(master, "l1", 0, {"--advertised-host", "192.0.2.10"});
  auto r = remote.call("connect");
  EXPECT_EQ(code(r), LOCKSTEP_STATUS_REJECTED) << r.dump();
  EXPECT_NE(r.value("error", "").find("loopback"), std::string::npos) << r.dump();
}

TEST(Membership, UnreachableMasterGivesAClearErrorNotAHang) {
  // A port that was just free: nobody listens there.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  socklen_t len = sizeof sa;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  auto p = tools::Subprocess::spawn({bin("lockstep-testpeer"), "--master", "127.0.0.1:" + std::to_string(ntohs(sa.sin_port)),
                                     "--base-port", "0", "--connect-timeout-ms", "2000"});
  ASSERT_TRUE(p);
  p->write_line("connect");
  auto line = p->read_line(scaled(10s));
  ASSERT_TRUE(line);
  EXPECT_EQ(code(json::parse(*line)), LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED) << *line;
}

TEST(Membership, MasterThatNeverAnswersGivesATimeoutNotAHang) {
  // A socket that listens but never accepts: the TCP connection succeeds, no Welcome comes.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(::listen(fd, 8), 0);
  socklen_t len = sizeof sa;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  auto p = tools::Subprocess::spawn({bin("lockstep-testpeer"), "--master", "127.0.0.1:" + std::to_string(ntohs(sa.sin_port)),
                                     "--base-port", "0", "--connect-timeout-ms", "1000"});
  ASSERT_TRUE(p);
  const auto start = std::chrono::steady_clock::now();
  p->write_line("connect");
  auto line = p->read_line(scaled(10s));
  const auto waited = std::chrono::steady_clock::now() - start;
  ::close(fd);
  ASSERT_TRUE(line);
  EXPECT_EQ(code(json::parse(*line)), LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED) << *line;
  EXPECT_GE(waited, 900ms);
}

// The master's /api/state shows an agree round that waits for one peer.
bool agree_waits_for_one(const json& state) {
  for (const auto& op : state["operations"]) {
    if (op["operation"] == "agree" && op["done"].size() == 1 && op["waiting"].size() == 1) return true;
  }
  return false;
}

TEST(Membership, MasterDeathGivesEveryPeerAnErrorNotAHang) {
  auto master = std::make_unique<Master>(std::vector<std::string>{"--http", "127.0.0.1:0"});
  Peer a(*master, "m0");
  Peer b(*master, "m1");
  std::vector<Peer*> members;
  admit(members, {&a, &b});
  ASSERT_EQ(members.size(), 2u);
  a.send("agree 1");  // blocked: b does not vote
  ASSERT_TRUE(master->wait_for_state(agree_waits_for_one)) << master->state().dump();
  master->proc().kill();
  auto r = a.reply(scaled(10s));
  EXPECT_EQ(code(r), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST) << r.dump();
  auto rb = b.call("agree 1", scaled(10s));
  EXPECT_EQ(code(rb), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST) << rb.dump();
}

// A stopped master (its connections open, nothing read or answered) is noticed by a
// peer waiting in a vote at the heartbeat timeout after the master's last word, plus
// the recheck: within the timeout and half a second of the stop.
TEST(Membership, StoppedMasterIsNoticedWithinTheHeartbeatTimeout) {
  const auto heartbeat = scaled(2000ms);
  Master master({"--http", "127.0.0.1:0", "--heartbeat-timeout-ms", std::to_string(heartbeat.count())});
  Peer a(master, "t0");
  Peer b(master, "t1");
  std::vector<Peer*> members;
  admit(members, {&a, &b});
  ASSERT_EQ(members.size(), 2u);
  a.send("agree 1");  // blocked: b does not vote
  ASSERT_TRUE(master.wait_for_state(agree_waits_for_one)) << master.state().dump();
  const auto stopped = std::chrono::steady_clock::now();
  ASSERT_TRUE(master.proc().signal(SIGSTOP));
  auto r = a.reply(heartbeat + scaled(10s));
  const auto waited = std::chrono::steady_clock::now() - stopped;
  ASSERT_TRUE(master.proc().signal(SIGCONT));
  EXPECT_EQ(code(r), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST) << r.dump();
  EXPECT_GE(waited, heartbeat - heartbeat / 4 - 100ms) << "noticed before the master was silent for the timeout";
  EXPECT_LE(waited, heartbeat + scaled(500ms)) << "noticed later than the heartbeat timeout and half a second";
}

}  // namespace
}  // namespace lockstep::e2e
