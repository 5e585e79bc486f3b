// Runs over IPv6: a master listening on ::1 with peers that reach it and each other
// there (all-reduce and a shared-state sync), and a dual-stack master ("::") whose
// peers come over both families in one run, their p2p listeners dual-stack too.
#include "e2e.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <set>

namespace lockstep::e2e {
namespace {

// Whether this host can listen on ::1 (a container may have no IPv6 at all).
bool ipv6_loopback() {
  const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in6 sa{};
  sa.sin6_family = AF_INET6;
  sa.sin6_addr = in6addr_loopback;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0;
  ::close(fd);
  return ok;
}

// Every member all-reduces its own fill (1, 2, ...) and gets the sum.
void expect_all_reduce(const std::vector<Peer*>& members, std::uint64_t tag) {
  for (std::size_t i = 0; i < members.size(); ++i) {
    members[i]->send("allreduce 1024 " + std::to_string(tag) + " " + std::to_string(i + 1));
  }
  const double sum = static_cast<double>(members.size() * (members.size() + 1) / 2);
  for (auto* p : members) {
    const json r = p->reply();
    EXPECT_EQ(code(r), 0) << p->name() << ": " << r.dump();
    EXPECT_EQ(r.value("value", -1.0), sum) << p->name() << ": " << r.dump();
  }
}

TEST(Ipv6, RunOnIpv6Loopback) {
  if (!ipv6_loopback()) GTEST_SKIP() << "no IPv6 loopback on this host";
  Master master({}, "::1");
  ASSERT_EQ(master.address().rfind("[::1]:", 0), 0u) << master.address();
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<Peer*> newcomers;
  std::vector<Peer*> members;
  for (int i = 0; i < 3; ++i) {
    peers.push_back(std::make_unique<Peer>(master, numbered("v6-", i)));
    newcomers.push_back(peers.back().get());
  }
  admit(members, newcomers);
  ASSERT_EQ(members.size(), 3u);
  expect_all_reduce(members, 1);
  // A shared-state sync: the first peer's content reaches the others over ::1.
  for (auto* p : members) EXPECT_EQ(code(p->call("tensor w 300000 u8")), 0);
  EXPECT_EQ(code(members[0]->call("fill w 7")), 0);
  EXPECT_EQ(code(members[0]->call("revision 1")), 0);
  members[0]->send("sync send");
  for (std::size_t i = 1; i < members.size(); ++i) members[i]->send("sync receive");
  std::vector<json> synced;
  for (auto* p : members) synced.push_back(p->reply());
  for (const auto& r : synced) EXPECT_EQ(code(r), 0) << r.dump();
  ASSERT_TRUE(synced[0].contains("hashes")) << synced[0].dump();
  for (const auto& r : synced) {
    EXPECT_EQ(r["hashes"], synced[0]["hashes"]) << r.dump();
    EXPECT_EQ(r.value("revision", 0), 1) << r.dump();
  }
  EXPECT_GT(synced[1].value("bytes_received", 0), 0);
}

// A master on "::" takes peers over IPv4 (seen as 127.0.0.1, not as the IPv4-mapped
// ::ffff:127.0.0.1) and over IPv6 (::1) in one run; their rings connect across the
// families because the peers' p2p listeners are dual-stack by default.
TEST(Ipv6, DualStackRunMixesFamilies) {
  if (!ipv6_loopback()) GTEST_SKIP() << "no IPv6 loopback on this host";
  Master master({"--http", "127.0.0.1:0"}, "::");
  const std::string over_v4 = "127.0.0.1:" + std::to_string(master.port());
  const std::string over_v6 = "[::1]:" + std::to_string(master.port());
  Peer a(over_v4, "over-v4-a");
  Peer b(over_v6, "over-v6-b");
  Peer c(over_v4, "over-v4-c");
  Peer d(over_v6, "over-v6-d");
  std::vector<Peer*> members;
  admit(members, {&a, &b, &c, &d});
  ASSERT_EQ(members.size(), 4u);
  const json state = master.state();
  ASSERT_TRUE(state.contains("peers")) << state.dump();
  std::set<std::string> hosts;
  for (const auto& p : state["peers"]) hosts.insert(p.value("host", ""));
  EXPECT_EQ(hosts, (std::set<std::string>{"127.0.0.1", "::1"})) << state["peers"].dump();
  expect_all_reduce(members, 1);
  expect_all_reduce(members, 2);
}

}  // namespace
}  // namespace lockstep::e2e
