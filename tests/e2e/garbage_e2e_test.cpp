// Hostile input to the master's port while a run goes on: garbage bytes, truncated
// frames, zero- and one-byte frames, unknown types, and a huge length prefix
// followed by hundreds of MiB. Each connection must be closed, the run must keep
// working, and the master's resident memory must stay flat. The same for a peer's
// p2p, shared-state and benchmark ports: strangers are dropped, and the members'
// all-reduces and shared-state syncs stay correct.
#include "e2e.h"

#include "protocol/codec.h"

#include <arpa/inet.h>
#include <cerrno>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <random>
#include <thread>
#include <sys/socket.h>
#include <unistd.h>

namespace lockstep::e2e {
namespace {

int connect_to(std::uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Sends everything it can; returns the bytes the kernel accepted before an error.
std::size_t send_some(int fd, const std::vector<std::uint8_t>& bytes) {
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<std::size_t>(n);
  }
  return sent;
}

// True if the master closes the connection (EOF or reset) within the timeout.
// Whatever it sends first (a Goodbye) is read and ignored.
bool closed_by_master(int fd, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  char buf[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n == 0) return true;
    if (n < 0 && errno != EINTR && errno != EAGAIN) return true;
  }
  return false;
}

std::vector<std::uint8_t> header(std::uint32_t length, std::uint16_t type) {
  return {static_cast<std::uint8_t>(length), static_cast<std::uint8_t>(length >> 8),
          static_cast<std::uint8_t>(length >> 16), static_cast<std::uint8_t>(length >> 24),
          static_cast<std::uint8_t>(type), static_cast<std::uint8_t>(type >> 8), 0, 0};
}

class GarbageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    master_ = std::make_unique<Master>();
    a_ = std::make_unique<Peer>(*master_, "g0");
    b_ = std::make_unique<Peer>(*master_, "g1");
    members_.clear();
    admit(members_, {a_.get(), b_.get()});
    ASSERT_EQ(members_.size(), 2u);
  }

  void expect_run_works() {
    for (const auto& r : call_all(members_, "agree 1")) {
      ASSERT_EQ(code(r), 0) << r.dump();
      EXPECT_TRUE(r["result"].get<bool>());
    }
  }

  void probe(const std::string& what, const std::vector<std::uint8_t>& bytes) {
    SCOPED_TRACE(what);
    int fd = connect_to(master_->port());
    ASSERT_GE(fd, 0);
    send_some(fd, bytes);
    EXPECT_TRUE(closed_by_master(fd, scaled(5s))) << what << ": master kept the connection open";
    ::close(fd);
  }

  std::unique_ptr<Master> master_;
  std::unique_ptr<Peer> a_;
  std::unique_ptr<Peer> b_;
  std::vector<Peer*> members_;
};

TEST_F(GarbageTest, EveryMalformedInputClosesItsConnectionAndTheRunContinues) {
  expect_run_works();
  const long rss_before = rss_kib(master_->proc().pid());
  ASSERT_GT(rss_before, 0);

  std::mt19937 random(1234);
  std::vector<std::uint8_t> garbage(4096);
  for (auto& b : garbage) b = static_cast<std::uint8_t>(random());
  probe("random garbage", garbage);
  probe("text", {'G', 'E', 'T', ' ', '/', ' ', 'H', 'T', 'T', 'P', '/', '1', '.', '1', '\r', '\n', '\r', '\n'});

  // A valid Hello cut short, then the connection half-closed.
  auto hello = proto::encode_frame(proto::Hello{});
  {
    int fd = connect_to(master_->port());
    ASSERT_GE(fd, 0);
    send_some(fd, std::vector<std::uint8_t>(hello.begin(), hello.begin() + 12));
    ::shutdown(fd, SHUT_WR);
    EXPECT_TRUE(closed_by_master(fd, scaled(5s))) << "truncated frame";
    ::close(fd);
  }
  probe("zero-length frame", header(0, static_cast<std::uint16_t>(proto::MsgType::kHello)));
  auto one = header(1, static_cast<std::uint16_t>(proto::MsgType::kHello));
  one.push_back(0x42);
  probe("one-byte frame", one);
  probe("unknown message type", header(4, 0x7777));
  probe("nonzero flags", {0, 0, 0, 0, 2, 0, 1, 0});
  probe("a peer-to-master vote before any Hello", header(0, static_cast<std::uint16_t>(proto::MsgType::kVoteUpdateTopology)));

  // A huge length prefix followed by hundreds of MiB.
  {
    int fd = connect_to(master_->port());
    ASSERT_GE(fd, 0);
    send_some(fd, header(0xfffffff0u, static_cast<std::uint16_t>(proto::MsgType::kHello)));
    std::vector<std::uint8_t> chunk(1 << 20, 0xab);
    std::size_t accepted = 0;
    for (int i = 0; i < 300; ++i) {
      const std::size_t n = send_some(fd, chunk);
      accepted += n;
      if (n < chunk.size()) break;
    }
    EXPECT_TRUE(closed_by_master(fd, scaled(5s))) << "huge length prefix";
    EXPECT_LT(accepted, std::size_t{300} << 20) << "the master kept reading a frame it should have refused";
    ::close(fd);
  }
  // A registered peer that then misbehaves is removed; the others go on.
  {
    int fd = connect_to(master_->port());
    ASSERT_GE(fd, 0);
    proto::Hello h;
    h.p2p_port = 9;  // never contacted: it is removed before any update
    h.shared_state_port = h.benchmark_port = h.p2p_port;  // a peer names all three ports or none
    send_some(fd, proto::encode_frame(h));
    send_some(fd, header(5, static_cast<std::uint16_t>(proto::MsgType::kHeartbeat)));
    EXPECT_TRUE(closed_by_master(fd, scaled(5s))) << "registered peer sending a bad frame";
    ::close(fd);
  }

  expect_run_works();
  // Nothing pending: the misbehaving registrations are gone.
  for (const auto& r : call_all(members_, "pending")) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_FALSE(r["pending"].get<bool>()) << r.dump();
  }
  const long rss_after = rss_kib(master_->proc().pid());
  EXPECT_LT(rss_after - rss_before, 16 * 1024) << "master RSS grew from " << rss_before << " to " << rss_after << " KiB";
  EXPECT_EQ(master_->stop(), 0) << "the master did not shut down cleanly";
}

// What a peer's listening socket does with a stranger: the first reply frame it sends
// (if any) and whether it closed the connection in time.
struct Verdict {
  std::optional<proto::Message> reply;
  bool closed = false;
};

Verdict probe_peer(std::uint16_t port, const std::vector<std::uint8_t>& bytes, std::chrono::milliseconds timeout) {
  Verdict v;
  int fd = connect_to(port);
  if (fd < 0) return v;
  send_some(fd, bytes);
  std::vector<std::uint8_t> got;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  char buf[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n > 0) {
      got.insert(got.end(), buf, buf + n);
      continue;
    }
    if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
      v.closed = true;
      break;
    }
  }
  ::close(fd);
  if (got.size() >= proto::kFrameHeaderBytes) {
    auto h = proto::decode_header(std::span<const std::uint8_t, proto::kFrameHeaderBytes>(got.data(), proto::kFrameHeaderBytes));
    if (h.is_ok() && got.size() >= proto::kFrameHeaderBytes + h.value().payload_bytes) {
      auto m = proto::decode_payload(h.value().type, std::span<const std::uint8_t>(got).subspan(proto::kFrameHeaderBytes,
                                                                                              h.value().payload_bytes));
      if (m.is_ok()) v.reply = m.value();
    }
  }
  return v;
}

PeerId id_from_hex(const std::string& hex) {
  PeerId id;
  for (int i = 0; i < 16; ++i) id.hi = (id.hi << 4) | std::stoull(hex.substr(static_cast<std::size_t>(i), 1), nullptr, 16);
  for (int i = 16; i < 32; ++i) id.lo = (id.lo << 4) | std::stoull(hex.substr(static_cast<std::size_t>(i), 1), nullptr, 16);
  return id;
}

TEST_F(GarbageTest, StrangersOnAPeersPortsAreDroppedAndTheRunStaysCorrect) {
  const json view = b_->call("view");
  std::optional<json> target;
  for (const auto& m : view["view"]) {
    if (m["id"] == a_->id()) target = m;
  }
  ASSERT_TRUE(target.has_value()) << view.dump();
  const PeerId a_id = id_from_hex(a_->id());
  std::mt19937 random(7);
  std::vector<std::uint8_t> noise(64 * 1024);
  for (auto& byte : noise) byte = static_cast<std::uint8_t>(random());
  const auto hello = [&](proto::Channel channel, PeerId to) {
    proto::P2PHello h;
    h.channel = channel;
    h.from = PeerId{0xdead, 1};
    h.to = to;
    h.epoch = ~0ull;
    return proto::encode_frame(h);
  };
  const std::vector<std::pair<const char*, proto::Channel>> ports = {
      {"port", proto::Channel::kRing}, {"shared_state_port", proto::Channel::kSharedState},
      {"benchmark_port", proto::Channel::kBenchmark}};
  for (const auto& [field, channel] : ports) {
    SCOPED_TRACE(field);
    const auto port = (*target)[field].get<std::uint16_t>();
    ASSERT_NE(port, 0);
    EXPECT_TRUE(probe_peer(port, noise, scaled(5s)).closed) << "random bytes";
    EXPECT_TRUE(probe_peer(port, header(16, 999), scaled(5s)).closed) << "unknown type";
    EXPECT_TRUE(probe_peer(port, header(1u << 30, static_cast<std::uint16_t>(proto::MsgType::kP2PHello)), scaled(5s)).closed)
        << "huge length";
    EXPECT_TRUE(probe_peer(port, header(0, static_cast<std::uint16_t>(proto::MsgType::kHello)), scaled(5s)).closed)
        << "a master's message";
    // A well-formed hello for someone else: refused, then closed.
    const Verdict wrong = probe_peer(port, hello(channel, PeerId{1, 2}), scaled(5s));
    EXPECT_TRUE(wrong.closed);
    ASSERT_TRUE(wrong.reply.has_value());
    EXPECT_EQ(std::get<proto::P2PHelloAck>(*wrong.reply).status, LOCKSTEP_STATUS_REJECTED);
    // The right target on the wrong socket: refused too.
    const auto other = channel == proto::Channel::kRing ? proto::Channel::kSharedState : proto::Channel::kRing;
    const Verdict misplaced = probe_peer(port, hello(other, a_id), scaled(5s));
    EXPECT_TRUE(misplaced.closed);
    ASSERT_TRUE(misplaced.reply.has_value());
    EXPECT_NE(std::get<proto::P2PHelloAck>(*misplaced.reply).status, LOCKSTEP_OK);
  }
  // Silence: dropped by the handshake deadline (5 s), on all three sockets at once.
  std::vector<int> silent;
  for (const auto& [field, channel] : ports) silent.push_back(connect_to((*target)[field].get<std::uint16_t>()));
  for (const int fd : silent) {
    ASSERT_GE(fd, 0);
    EXPECT_TRUE(closed_by_master(fd, 5s + scaled(5s))) << "a silent connection was kept";
    ::close(fd);
  }
  // The members' data path is unaffected: an exact all-reduce and a sync.
  a_->send("allreduce 262144 1 1 inplace");
  b_->send("allreduce 262144 1 2 inplace");
  for (auto* p : {a_.get(), b_.get()}) {
    const json r = p->reply();
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_EQ(r["value"].get<double>(), 3.0);
    EXPECT_TRUE(r["uniform"].get<bool>());
  }
  for (auto* p : {a_.get(), b_.get()}) {
    ASSERT_EQ(code(p->call("tensor w 1048576")), 0);
    ASSERT_EQ(code(p->call("revision 1")), 0);
  }
  ASSERT_EQ(code(a_->call("fill w 5")), 0);
  const json expected = a_->call("hashes");
  a_->send("sync popular");
  b_->send("sync receive");
  for (const auto& r : {a_->reply(), b_->reply()}) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_EQ(r["hashes"], expected["hashes"]);
  }
}

TEST_F(GarbageTest, ManyStrangersThatNeverSpeakDoNotBlockMembers) {
  std::vector<int> fds;
  for (int i = 0; i < 64; ++i) {
    int fd = connect_to(master_->port());
    ASSERT_GE(fd, 0);
    fds.push_back(fd);
  }
  expect_run_works();
  for (int fd : fds) ::close(fd);
}

// Semantics rule 2 bounded in time (lockstep-master --newcomer-timeout-ms): a stranger
// that registers with a p2p port that accepts connections but never answers (as a
// firewall or a wrong port would), then only sends heartbeats, holds the members'
// update topology no longer than the bound (not the 30 s establish timeout); it is
// rejected, the update fails with UPDATE_TOPOLOGY_FAILED, and the next one goes on
// without it.
TEST(NewcomerBound, ARegisteredStrangerThatNeverConnectsHoldsTheUpdateOnlyForTheNewcomerTimeout) {
  Master master({"--newcomer-timeout-ms", "2000"});
  Peer a(master, "n0");
  Peer b(master, "n1");
  std::vector<Peer*> members;
  admit(members, {&a, &b});
  ASSERT_EQ(members.size(), 2u);

  // A socket that listens and never accepts: connects succeed, the handshake gets no answer.
  int silent = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(silent, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(::listen(silent, 16), 0);
  socklen_t len = sizeof sa;
  ASSERT_EQ(::getsockname(silent, reinterpret_cast<sockaddr*>(&sa), &len), 0);

  int fd = connect_to(master.port());
  ASSERT_GE(fd, 0);
  proto::Hello h;
  h.p2p_port = ntohs(sa.sin_port);
  h.shared_state_port = h.p2p_port;
  h.benchmark_port = h.p2p_port;
  send_some(fd, proto::encode_frame(h));
  // Heartbeats every 200 ms, so that silence is never why it goes; whatever the master
  // sends is read and dropped; EOF ends the loop.
  std::atomic<bool> stop{false};
  std::atomic<bool> closed{false};
  std::thread stranger([&] {
    const auto heartbeat = proto::encode_frame(proto::Heartbeat{});
    char buf[4096];
    while (!stop.load()) {
      send_some(fd, heartbeat);
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 200) > 0) {
        const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
          closed = true;
          return;
        }
      }
    }
  });
  // The members see it waiting (an are-peers-pending vote).
  bool pending = false;
  for (const auto deadline = std::chrono::steady_clock::now() + scaled(10s);
       !pending && std::chrono::steady_clock::now() < deadline;) {
    pending = call_all(members, "pending")[0].value("pending", false);
  }
  ASSERT_TRUE(pending) << "the stranger was never registered";

  const auto started = std::chrono::steady_clock::now();
  const auto updates = call_all(members, "update");
  const auto took = std::chrono::steady_clock::now() - started;
  for (const auto& r : updates) {
    EXPECT_EQ(code(r), LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) << r.dump();
  }
  // 2 s bound, 30 s establish timeout: 15 s tells them apart under any sanitizer.
  EXPECT_LT(took, 15s) << "the stranger held the update for "
                       << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
  for (const auto deadline = std::chrono::steady_clock::now() + scaled(5s);
       !closed.load() && std::chrono::steady_clock::now() < deadline;) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(closed.load()) << "the stranger was not rejected";
  stop = true;
  stranger.join();
  ::close(fd);
  ::close(silent);

  for (const auto& r : call_all(members, "update")) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_EQ(r.value("world", 0), 2) << r.dump();
  }
  for (const auto& r : call_all(members, "agree 1")) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_TRUE(r["result"].get<bool>());
  }
}

}  // namespace
}  // namespace lockstep::e2e
