// A relay (master/relay.h: the master's, and lockstep-relay's) over real loopback sockets,
// with hand-made ends: it joins the two ends of an assigned edge once each proved the
// relay key of their pair (never the pair key itself) and copies
// bytes both ways; it refuses pairs it was not assigned and wrong proofs, drops an end
// whose other end never comes, drops a pair whose reader stops reading, closes an edge
// the master stops assigning, and makes room for the run's peers at its connection cap.
#include "master/relay.h"

#include "peer/handshake.h"
#include "protocol/messages.h"
#include "transport/socket.h"

#include <gtest/gtest.h>

#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <future>
#include <thread>

namespace lockstep::master {
namespace {

using namespace std::chrono_literals;

const PeerId kA{1, 11};
const PeerId kB{1, 22};
const PeerId kC{1, 33};

struct Fixture {
  explicit Fixture(RelayOptions options = {}) {
    options.listen_host = "127.0.0.1";
    relay = std::make_unique<Relay>(options);
    EXPECT_TRUE(relay->start().is_ok());
  }
  // What the master assigns for these members (peer -> group).
  void assign(const std::map<PeerId, std::uint32_t>& members) const { relay->assign(relay_pairs(members, run_key)); }
  // What the two ends prove to the relay.
  std::vector<std::uint8_t> key(PeerId a, PeerId b) const {
    return security::to_bytes(security::relay_key(security::pair_key(run_key, a, b)));
  }

  // One end: `from` connects for its edge with `to` on slot 0 (`receiver`: it receives)
  // proving `key`, and waits for the relay's answer. The socket, or the handshake's error.
  Result<transport::Fd> end(PeerId from, PeerId to, bool receiver, const std::vector<std::uint8_t>& proof_key,
                            std::uint32_t timeout_ms = 5000) const {
    auto fd = transport::connect_tcp("127.0.0.1", relay->port(), 2000);
    if (!fd.is_ok()) return fd.status();
    proto::P2PHello hello;
    hello.channel = proto::Channel::kRelay;
    hello.from = from;
    hello.to = to;
    hello.epoch = static_cast<std::uint64_t>(proto::Channel::kRing);  // the relayed connection's channel
    if (receiver) hello.flags |= proto::kP2PFlagReversed;
    Status s = peer::p2p_handshake(fd.value().get(), hello, true, proof_key, timeout_ms);
    if (!s.is_ok()) return s;
    return std::move(fd.value());
  }

  // Both ends of the edge A -> B, joined.
  std::pair<transport::Fd, transport::Fd> joined() const {
    auto sender = std::async(std::launch::async, [&] { return end(kA, kB, false, key(kA, kB)); });
    auto receiver = end(kB, kA, true, key(kA, kB));
    auto s = sender.get();
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    EXPECT_TRUE(receiver.is_ok()) << receiver.status().to_string();
    if (!s.is_ok() || !receiver.is_ok()) return {};
    return {std::move(s.value()), std::move(receiver.value())};
  }

  security::Key run_key = security::random_key();
  std::unique_ptr<Relay> relay;
};

// Whether the other side closed `fd` within `within` (EOF or a reset on read).
bool closed_within(int fd, std::chrono::milliseconds within) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  char buf[65536];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return true;
  }
  return false;
}

TEST(Relay, JoinsTheTwoEndsOfAnAssignedEdgeAndCopiesBothWays) {
  Fixture f;
  f.assign({{kA, 1}, {kB, 1}});
  std::this_thread::sleep_for(50ms);  // assign() is carried out on the relay's thread
  auto [a, b] = f.joined();
  ASSERT_TRUE(a.valid() && b.valid());
  const std::string there = "from a to b", back = "and back from b";
  ASSERT_TRUE(transport::send_all(a.get(), {reinterpret_cast<const std::uint8_t*>(there.data()), there.size()}, 2000).is_ok());
  std::string got(there.size(), '\0');
  ASSERT_TRUE(transport::recv_exact(b.get(), {reinterpret_cast<std::uint8_t*>(got.data()), got.size()}, 2000).is_ok());
  EXPECT_EQ(got, there);
  ASSERT_TRUE(transport::send_all(b.get(), {reinterpret_cast<const std::uint8_t*>(back.data()), back.size()}, 2000).is_ok());
  got.assign(back.size(), '\0');
  ASSERT_TRUE(transport::recv_exact(a.get(), {reinterpret_cast<std::uint8_t*>(got.data()), got.size()}, 2000).is_ok());
  EXPECT_EQ(got, back);
  const RelayStats s = f.relay->stats();
  EXPECT_EQ(s.pairs, 1u);
  EXPECT_EQ(s.active, 1u);
  EXPECT_EQ(s.bytes, there.size() + back.size());
  // One end leaves: the other is closed too.
  a.reset();
  EXPECT_TRUE(closed_within(b.get(), 5000ms));
}

TEST(Relay, RefusesPairsItWasNotAssignedAndWrongProofs) {
  RelayOptions options;
  options.assignment_wait_ms = 200;
  Fixture f(options);
  f.assign({{kA, 1}, {kB, 1}, {kC, 2}});
  std::this_thread::sleep_for(50ms);
  // Another group's peer: refused once the assignment wait is over, without a proof asked.
  auto other_group = f.end(kA, kC, false, f.key(kA, kC));
  ASSERT_FALSE(other_group.is_ok());
  EXPECT_EQ(other_group.status().code(), LOCKSTEP_STATUS_PEER_CONNECTION_FAILED) << other_group.status().to_string();
  // A stranger to the run.
  auto stranger = f.end(PeerId{9, 9}, kB, false, f.key(PeerId{9, 9}, kB));
  ASSERT_FALSE(stranger.is_ok());
  // An assigned pair, but a key that is not theirs: the relay's own proof does not verify
  // for the end, and the end's proof would not verify for the relay.
  auto wrong = f.end(kA, kB, false, f.key(kA, kC));
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_EQ(wrong.status().code(), LOCKSTEP_STATUS_AUTHENTICATION_FAILED) << wrong.status().to_string();
  // The pair key itself is not what the relay knows: it holds only the key derived from it.
  auto pair_key = f.end(kA, kB, false, security::to_bytes(security::pair_key(f.run_key, kA, kB)));
  ASSERT_FALSE(pair_key.is_ok());
  EXPECT_EQ(pair_key.status().code(), LOCKSTEP_STATUS_AUTHENTICATION_FAILED) << pair_key.status().to_string();
  // Garbage.
  auto fd = transport::connect_tcp("127.0.0.1", f.relay->port(), 2000);
  ASSERT_TRUE(fd.is_ok());
  const std::string junk(64, 'x');
  (void)transport::send_all(fd.value().get(), {reinterpret_cast<const std::uint8_t*>(junk.data()), junk.size()}, 2000);
  EXPECT_TRUE(closed_within(fd.value().get(), 5000ms));
  EXPECT_GE(f.relay->stats().refused, 4u);
  EXPECT_EQ(f.relay->stats().pairs, 0u);
}

// The master's assignment and its EstablishP2P to the peers travel on different
// connections: ends that come before their pair is assigned wait for it (at most the
// assignment wait), then go on as usual.
TEST(Relay, EndsThatComeBeforeTheirAssignmentWaitForIt) {
  Fixture f;
  auto sender = std::async(std::launch::async, [&] { return f.end(kA, kB, false, f.key(kA, kB)); });
  auto receiver = std::async(std::launch::async, [&] { return f.end(kB, kA, true, f.key(kA, kB)); });
  // Both hellos are at the relay before the pair is (its stats count no refusal).
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(f.relay->stats().refused, 0u);
  f.assign({{kA, 1}, {kB, 1}});
  auto a = sender.get();
  auto b = receiver.get();
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  EXPECT_EQ(f.relay->stats().pairs, 1u);
}

TEST(Relay, AnEndWhoseOtherEndNeverComesIsDropped) {
  RelayOptions options;
  options.match_timeout_ms = 200;
  Fixture f(options);
  f.assign({{kA, 1}, {kB, 1}});
  std::this_thread::sleep_for(50ms);
  const auto started = std::chrono::steady_clock::now();
  auto alone = f.end(kA, kB, false, f.key(kA, kB));
  EXPECT_FALSE(alone.is_ok());
  EXPECT_LT(std::chrono::steady_clock::now() - started, 4s);  // the relay's 200 ms, not the end's 5 s
  EXPECT_EQ(f.relay->stats().waiting, 0u);
}

TEST(Relay, APairWhoseReaderStopsReadingIsDropped) {
  RelayOptions options;
  options.stall_timeout_ms = 300;
  options.buffer_bytes = 64 * 1024;
  Fixture f(options);
  f.assign({{kA, 1}, {kB, 1}});
  std::this_thread::sleep_for(50ms);
  auto [a, b] = f.joined();
  ASSERT_TRUE(a.valid() && b.valid());
  // a sends for ever, b never reads: once the socket buffers are full the relay's write
  // to b stalls, and after 300 ms it closes both (a's sends then fail).
  transport::set_nonblocking(a.get());
  std::vector<char> chunk(64 * 1024, 'z');
  bool failed = false;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!failed && std::chrono::steady_clock::now() < deadline) {
    const ssize_t n = ::send(a.get(), chunk.data(), chunk.size(), MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) failed = true;
    if (n < 0) std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(failed) << "the relay kept a pair whose reader stopped reading";
  EXPECT_EQ(f.relay->stats().active, 0u);
}

TEST(Relay, AnEdgeTheMasterNoLongerAssignsIsClosed) {
  Fixture f;
  f.assign({{kA, 1}, {kB, 1}});
  std::this_thread::sleep_for(50ms);
  auto [a, b] = f.joined();
  ASSERT_TRUE(a.valid() && b.valid());
  f.assign({{kA, 1}});  // B left the run
  EXPECT_TRUE(closed_within(a.get(), 5000ms));
  EXPECT_TRUE(closed_within(b.get(), 5000ms));
}

// At the connection cap, idle connections that never prove a key make room for the
// run's peers (the oldest of them is closed), instead of keeping them out until the
// handshake timeout.
TEST(Relay, IdleStrangersAtTheCapMakeRoomForTheRunsPeers) {
  RelayOptions options;
  options.connections_max = 8;
  Fixture f(options);
  f.assign({{kA, 1}, {kB, 1}});
  std::vector<transport::Fd> idle;
  for (int i = 0; i < 8; ++i) {
    auto fd = transport::connect_tcp("127.0.0.1", f.relay->port(), 2000);
    ASSERT_TRUE(fd.is_ok());
    idle.push_back(std::move(fd.value()));
  }
  std::this_thread::sleep_for(100ms);  // all eight accepted
  auto [a, b] = f.joined();
  ASSERT_TRUE(a.valid() && b.valid());
  EXPECT_EQ(f.relay->stats().pairs, 1u);
  // Two of the idle ones were closed for them, the oldest first.
  EXPECT_TRUE(closed_within(idle[0].get(), 2000ms));
  EXPECT_TRUE(closed_within(idle[1].get(), 2000ms));
  EXPECT_FALSE(closed_within(idle[7].get(), 200ms));
}

}  // namespace
}  // namespace lockstep::master
