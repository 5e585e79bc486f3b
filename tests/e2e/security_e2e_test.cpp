// Security of a run with a secret (docs/security.md), in one process: an embedded
// master and peer threads over loopback, and raw sockets playing the attacker.
//  - a peer without the secret, or with another one, gets AUTHENTICATION_FAILED and is
//    never registered; a recorded handshake replayed to the master fails;
//  - a master without the secret (and a fake one answering with a made-up proof) is
//    refused by the peer with AUTHENTICATION_FAILED;
//  - a tampered control frame ends the connection;
//  - strangers on a peer's p2p and shared-state ports (claiming a member's id or not,
//    with and without a nonce, with a forged proof, with garbage) never get a
//    connection accepted, while the members' all-reduces and syncs stay correct;
//  - 200 idle connections and a client feeding one byte a second are dropped by the
//    handshake limits of the master and of a peer, and the members are unaffected.
#include "cluster.h"

#include "master/master_server.h"
#include "peer/communicator.h"
#include "protocol/codec.h"
#include "security/crypto.h"
#include "transport/framed.h"
#include "transport/socket.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <latch>
#include <mutex>
#include <thread>
#include <vector>

namespace lockstep::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
constexpr int kScale = LOCKSTEP_TEST_TIME_SCALE;

security::Key key_of(const char* text) { return security::derive_secret_key(text).value(); }
const security::Key kSecret = key_of("correct horse battery staple, run 1");
const security::Key kOtherSecret = key_of("a different secret of another run");

std::unique_ptr<master::MasterServer> start_master(std::optional<security::Key> secret,
                                                   std::uint32_t handshake_timeout_ms = 10'000,
                                                   std::uint32_t pending_handshakes_max = 256) {
  master::Options options;
  options.listen_host = "127.0.0.1";
  options.listen_port = 0;
  options.coordinator.heartbeat_timeout_ms = 5000 * kScale;
  options.coordinator.handshake_timeout_ms = handshake_timeout_ms;
  options.coordinator.pending_handshakes_max = pending_handshakes_max;
  options.coordinator.instance_nonce = 0x5ec;
  options.secret = secret;
  auto master = std::make_unique<master::MasterServer>(options);
  Status s = master->start();
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return master;
}

std::unique_ptr<peer::Communicator> make_peer(std::uint16_t master_port, std::optional<security::Key> secret,
                                              std::uint32_t inbound_timeout_ms = limits::kInboundHandshakeTimeoutMsDefault,
                                              std::uint32_t inbound_max = limits::kInboundHandshakesMaxDefault) {
  peer::Options options;
  options.master_port = master_port;
  options.base_port = 0;
  options.connect_timeout_ms = 5000 * kScale;
  options.secret = secret;
  options.inbound_handshake_timeout_ms = inbound_timeout_ms;
  options.inbound_handshakes_max = inbound_max;
  auto created = peer::Communicator::create(options);
  EXPECT_TRUE(created.is_ok()) << created.status().to_string();
  return std::move(created.value());
}

int connect_to(std::uint16_t port) {
  auto fd = transport::connect_tcp("127.0.0.1", port, 2000);
  return fd.is_ok() ? fd.value().release() : -1;
}

// True if the other side closes the connection (EOF or reset) within the timeout;
// whatever it sends first is read and ignored.
bool closed_by_other_side(int fd, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  char buf[4096];
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n == 0) return true;
    if (n < 0 && errno != EINTR && errno != EAGAIN) return true;
  }
  return false;
}

// How many of the first n connections the other side closes by the deadline.
std::size_t closed_by(const std::vector<transport::Fd>& fds, std::size_t n, Clock::time_point deadline) {
  std::size_t closed = 0;
  for (std::size_t i = 0; i < n && i < fds.size(); ++i) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    closed += closed_by_other_side(fds[i].get(), std::max(left, std::chrono::milliseconds(1))) ? 1u : 0u;
  }
  return closed;
}

bool send_bytes(int fd, const std::vector<std::uint8_t>& bytes) {
  return transport::send_all(fd, bytes, 2000).is_ok();
}

// A run of `world` secured peers, each on its own thread; the body runs once all are in.
void run_peers(std::uint16_t master_port, std::size_t world, const std::function<void(peer::Communicator&, std::size_t)>& body,
               std::uint32_t inbound_timeout_ms = limits::kInboundHandshakeTimeoutMsDefault,
               std::uint32_t inbound_max = limits::kInboundHandshakesMaxDefault) {
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < world; ++i) {
    threads.emplace_back([&, i] {
      auto comm = make_peer(master_port, kSecret, inbound_timeout_ms, inbound_max);
      ASSERT_TRUE(comm);
      ASSERT_TRUE(Cluster::join(*comm, world)) << comm->last_error();
      body(*comm, i);
    });
  }
  for (auto& t : threads) t.join();
}

// One f32 sum all-reduce; every element of the result must be the sum of the inputs.
void expect_all_reduce(peer::Communicator& comm, std::uint64_t tag, std::size_t world, std::size_t count = 50'000) {
  const auto rank = comm.rank().value();
  std::vector<float> data(count);
  for (std::size_t i = 0; i < count; ++i) data[i] = static_cast<float>(rank + 1) * static_cast<float>(i % 97);
  peer::ReduceDescriptor d;
  d.src = data.data();
  d.dst = data.data();
  d.count = count;
  d.tag = tag;
  auto r = comm.all_reduce(d);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const float factor = static_cast<float>(world * (world + 1) / 2);
  for (std::size_t i = 0; i < count; ++i) ASSERT_EQ(data[i], factor * static_cast<float>(i % 97)) << "element " << i;
}

// A sync in which peer 0 presents revision `round` with its content and the others
// (receive-only, one revision behind) adopt it.
void expect_sync(peer::Communicator& comm, std::size_t index, std::uint64_t round) {
  std::vector<std::uint8_t> tensor(1 << 20);
  for (std::size_t i = 0; i < tensor.size(); ++i) tensor[i] = static_cast<std::uint8_t>(index == 0 ? (i * 7 + round) : 0);
  std::uint64_t revision = index == 0 ? round : round - 1;
  peer::SharedTensor t;
  t.key = "weights";
  t.data = tensor.data();
  t.count = tensor.size();
  t.dtype = LOCKSTEP_U8;
  auto r = comm.sync_shared_state({t}, &revision,
                                  index == 0 ? proto::SyncStrategy::kEnforcePopular : proto::SyncStrategy::kReceiveOnly);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(revision, round);
  for (std::size_t i = 0; i < tensor.size(); ++i) {
    ASSERT_EQ(tensor[i], static_cast<std::uint8_t>(i * 7 + round)) << "byte " << i;
  }
}

// ------------------------------------------------------------------ the secret itself

TEST(Secret, ShortEmptyAndMissingSecretsAreRefused) {
  EXPECT_EQ(security::derive_secret_key("").status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(security::derive_secret_key("fifteen bytes!!").status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(security::derive_secret_key("\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n").status().code(),
            LOCKSTEP_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(security::load_secret_file("/nonexistent/secret").status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  // A file written by echo (trailing newline) and the same text agree; other text does not.
  EXPECT_EQ(security::derive_secret_key("sixteen bytes ok\n").value(), security::derive_secret_key("sixteen bytes ok").value());
  EXPECT_NE(security::derive_secret_key("sixteen bytes ok").value(), security::derive_secret_key("sixteen bytes OK").value());
}

// ------------------------------------------------------------------ the master's door

// Without the secret or with another one: refused, and never registered.
TEST(MasterAuth, PeerWithoutTheSecretOrWithAnotherIsRefusedAndNeverRegistered) {
  for (const auto& stranger_secret : {std::optional<security::Key>{}, std::optional<security::Key>{kOtherSecret}}) {
    SCOPED_TRACE(stranger_secret ? "another secret" : "no secret");
    auto master = start_master(kSecret);
    auto stranger = make_peer(master->port(), stranger_secret);
    Status s = stranger->connect();
    EXPECT_EQ(s.code(), LOCKSTEP_STATUS_AUTHENTICATION_FAILED) << s.to_string();
    // A member that joins afterwards is alone: the stranger was never registered.
    auto member = make_peer(master->port(), kSecret);
    ASSERT_TRUE(member->connect().is_ok()) << member->last_error();
    EXPECT_EQ(member->attributes().value().global_world_size, 1u);
    auto pending = member->are_peers_pending();
    ASSERT_TRUE(pending.is_ok());
    EXPECT_FALSE(pending.value());
  }
}

TEST(MasterAuth, MasterWithoutTheSecretIsRefusedByThePeer) {
  auto open_master = start_master(std::nullopt);
  auto comm = make_peer(open_master->port(), kSecret);
  Status s = comm->connect();
  EXPECT_EQ(s.code(), LOCKSTEP_STATUS_AUTHENTICATION_FAILED) << s.to_string();
}

// A fake master answers the Hello with a challenge whose proof it cannot compute.
TEST(MasterAuth, FakeMasterWithAMadeUpProofIsRefused) {
  auto listener = transport::listen_tcp("127.0.0.1", 0);
  ASSERT_TRUE(listener.is_ok());
  std::atomic<bool> got_proof{false};
  std::thread fake([&] {
    sockaddr_in sa{};
    socklen_t len = sizeof sa;
    transport::Fd fd(::accept(listener.value().fd.get(), reinterpret_cast<sockaddr*>(&sa), &len));
    auto hello = transport::recv_message(fd.get(), 5000);
    if (!hello.is_ok() || !std::holds_alternative<proto::Hello>(hello.value())) return;
    const auto nonce = security::random_nonce();
    const auto junk = security::random_nonce();
    [[maybe_unused]] Status s = transport::send_message(
        fd.get(), proto::AuthChallenge{security::to_bytes(nonce), security::to_bytes(junk)}, 5000);
    // The peer must not answer with its proof.
    auto next = transport::recv_message(fd.get(), 2000);
    if (next.is_ok() && std::holds_alternative<proto::AuthProof>(next.value())) got_proof = true;
  });
  auto comm = make_peer(listener.value().port, kSecret);
  Status s = comm->connect();
  fake.join();
  EXPECT_EQ(s.code(), LOCKSTEP_STATUS_AUTHENTICATION_FAILED) << s.to_string();
  EXPECT_FALSE(got_proof.load());
}

// The master's own check: a peer that takes whatever the master proves and answers with
// a proof it cannot make (another secret's, over the right transcript and nonces; or
// random bytes) is refused with AUTHENTICATION_FAILED and never registered.
TEST(MasterAuth, PeerThatIgnoresTheMastersProofAndProvesWronglyIsRefusedAndNeverRegistered) {
  auto master = start_master(kSecret);
  for (const bool random_proof : {false, true}) {
    SCOPED_TRACE(random_proof ? "random proof" : "another secret's proof");
    transport::Fd fd(connect_to(master->port()));
    ASSERT_GE(fd.get(), 0);
    proto::Hello hello;
    hello.p2p_port = 40000;
    hello.shared_state_port = hello.benchmark_port = hello.p2p_port;  // a peer names all three ports or none
    hello.shared_state_port = 40001;
    hello.benchmark_port = 40002;
    const auto client_nonce = security::random_nonce();
    hello.auth = security::to_bytes(client_nonce);
    const auto frame = proto::encode_frame(hello);
    ASSERT_TRUE(send_bytes(fd.get(), frame));
    auto challenge = transport::recv_message(fd.get(), 5000);
    ASSERT_TRUE(challenge.is_ok()) << challenge.status().to_string();
    const auto* c = std::get_if<proto::AuthChallenge>(&challenge.value());
    ASSERT_NE(c, nullptr);
    security::Nonce server_nonce{};
    ASSERT_TRUE(security::to_nonce(c->nonce, &server_nonce));
    const std::span<const std::uint8_t> transcript(frame.data() + proto::kFrameHeaderBytes,
                                                   frame.size() - proto::kFrameHeaderBytes);
    const auto wrong = random_proof ? security::to_bytes(security::random_nonce())
                                    : security::to_bytes(security::proof(kOtherSecret, security::kPeerRole, client_nonce,
                                                                         server_nonce, transcript));
    ASSERT_TRUE(send_bytes(fd.get(), proto::encode_frame(proto::AuthProof{wrong})));
    auto verdict = transport::recv_message(fd.get(), 5000);
    ASSERT_TRUE(verdict.is_ok()) << verdict.status().to_string();
    const auto* bye = std::get_if<proto::Goodbye>(&verdict.value());
    ASSERT_NE(bye, nullptr);
    EXPECT_EQ(bye->status, LOCKSTEP_STATUS_AUTHENTICATION_FAILED);
    EXPECT_TRUE(closed_by_other_side(fd.get(), 5s * kScale));
  }
  // A member that joins afterwards is alone: neither was ever registered.
  auto member = make_peer(master->port(), kSecret);
  ASSERT_TRUE(member->connect().is_ok()) << member->last_error();
  EXPECT_EQ(member->attributes().value().global_world_size, 1u);
  auto pending = member->are_peers_pending();
  ASSERT_TRUE(pending.is_ok());
  EXPECT_FALSE(pending.value());
}

// A TCP relay between a peer and the master that records what the peer sends, frame
// by frame, and can flip a byte of one of those frames.
class Relay {
 public:
  Relay(std::uint16_t target, int flip_frame = -1) : target_(target), flip_frame_(flip_frame) {
    auto l = transport::listen_tcp("127.0.0.1", 0);
    port_ = l.value().port;
    listener_ = std::move(l.value().fd);
    thread_ = std::thread([this] { serve(); });
  }
  ~Relay() {
    stop_ = true;
    thread_.join();
  }
  std::uint16_t port() const { return port_; }
  std::vector<std::vector<std::uint8_t>> frames() {
    std::lock_guard<std::mutex> lock(mutex_);
    return frames_;
  }

 private:
  void serve() {
    pollfd p{listener_.get(), POLLIN, 0};
    while (!stop_ && ::poll(&p, 1, 20) <= 0) {
    }
    if (stop_) return;
    transport::Fd client(::accept(listener_.get(), nullptr, nullptr));
    transport::Fd server(connect_to(target_));
    std::vector<std::uint8_t> pending;  // client bytes not yet a whole frame
    while (!stop_) {
      pollfd fds[2] = {{client.get(), POLLIN, 0}, {server.get(), POLLIN, 0}};
      if (::poll(fds, 2, 20) <= 0) continue;
      std::uint8_t buf[65536];
      if (fds[1].revents != 0) {
        const ssize_t n = ::recv(server.get(), buf, sizeof buf, 0);
        if (n <= 0) return;
        if (!send_bytes(client.get(), std::vector<std::uint8_t>(buf, buf + n))) return;
      }
      if (fds[0].revents != 0) {
        const ssize_t n = ::recv(client.get(), buf, sizeof buf, 0);
        if (n <= 0) return;
        pending.insert(pending.end(), buf, buf + n);
        // Forward whole frames only, so that one can be recorded and altered.
        while (pending.size() >= proto::kFrameHeaderBytes) {
          const std::size_t length = std::size_t{pending[0]} | (std::size_t{pending[1]} << 8) | (std::size_t{pending[2]} << 16) |
                                     (std::size_t{pending[3]} << 24);
          if (pending.size() < proto::kFrameHeaderBytes + length) break;
          std::vector<std::uint8_t> frame(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(8 + length));
          pending.erase(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(8 + length));
          {
            std::lock_guard<std::mutex> lock(mutex_);
            if (static_cast<int>(frames_.size()) == flip_frame_ && frame.size() > 8) frame[8] ^= 0x01;
            frames_.push_back(frame);
          }
          if (!send_bytes(server.get(), frame)) return;
        }
      }
    }
  }

  std::uint16_t target_;
  int flip_frame_;
  std::uint16_t port_ = 0;
  transport::Fd listener_;
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::vector<std::vector<std::uint8_t>> frames_;
  std::thread thread_;
};

TEST(MasterAuth, ReplayedHandshakeIsRefused) {
  auto master = start_master(kSecret);
  Relay relay(master->port());
  auto member = make_peer(relay.port(), kSecret);
  ASSERT_TRUE(member->connect().is_ok()) << member->last_error();
  const auto recorded = relay.frames();
  ASSERT_GE(recorded.size(), 2u);
  EXPECT_EQ(recorded[0][4], static_cast<std::uint8_t>(proto::MsgType::kHello));
  EXPECT_EQ(recorded[1][4], static_cast<std::uint8_t>(proto::MsgType::kAuthProof));

  // Replay the recorded Hello and AuthProof on a new connection: the master's nonce is
  // new, so the old proof does not verify.
  transport::Fd fd(connect_to(master->port()));
  ASSERT_TRUE(send_bytes(fd.get(), recorded[0]));
  auto challenge = transport::recv_message(fd.get(), 5000);
  ASSERT_TRUE(challenge.is_ok()) << challenge.status().to_string();
  ASSERT_TRUE(std::holds_alternative<proto::AuthChallenge>(challenge.value()));
  ASSERT_TRUE(send_bytes(fd.get(), recorded[1]));
  auto verdict = transport::recv_message(fd.get(), 5000);
  ASSERT_TRUE(verdict.is_ok()) << verdict.status().to_string();
  const auto* bye = std::get_if<proto::Goodbye>(&verdict.value());
  ASSERT_NE(bye, nullptr);
  EXPECT_EQ(bye->status, LOCKSTEP_STATUS_AUTHENTICATION_FAILED);
  EXPECT_TRUE(closed_by_other_side(fd.get(), 5s * kScale));

  // The whole recorded stream at once (with its sealed frames) fares no better.
  transport::Fd again(connect_to(master->port()));
  std::vector<std::uint8_t> stream;
  for (const auto& f : recorded) stream.insert(stream.end(), f.begin(), f.end());
  send_bytes(again.get(), stream);
  EXPECT_TRUE(closed_by_other_side(again.get(), 5s * kScale));

  // The member is alone and unharmed.
  auto pending = member->are_peers_pending();
  ASSERT_TRUE(pending.is_ok()) << pending.status().to_string();
  EXPECT_FALSE(pending.value());
  EXPECT_EQ(member->attributes().value().global_world_size, 1u);
}

TEST(MasterAuth, TamperedControlFrameEndsTheConnection) {
  auto master = start_master(kSecret);
  // Frame 0: Hello, 1: AuthProof, 2: the first sealed frame (the P2PReport of the
  // newcomer's admission). The master drops the connection on the altered frame and
  // tells the peer why.
  Relay relay(master->port(), /*flip_frame=*/2);
  auto member = make_peer(relay.port(), kSecret);
  Status s = member->connect();
  EXPECT_EQ(s.code(), LOCKSTEP_STATUS_PROTOCOL_ERROR) << s.to_string();
  EXPECT_NE(s.message().find("does not verify"), std::string::npos) << s.to_string();
}

// ------------------------------------------------------------------ peers' doors

// Opens a p2p connection as a stranger would and reports whether the peer accepted it
// (answered P2PHelloAck OK).
struct StrangerResult {
  bool challenged = false;  // got an AuthChallenge
  bool accepted = false;    // got P2PHelloAck OK
  bool closed = false;      // the peer closed the connection
};

StrangerResult stranger_connects(std::uint16_t port, proto::Channel channel, PeerId from, PeerId to, bool with_nonce,
                                 std::chrono::milliseconds patience) {
  StrangerResult out;
  transport::Fd fd(connect_to(port));
  if (!fd.valid()) return out;
  proto::P2PHello hello;
  hello.channel = channel;
  hello.from = from;
  hello.to = to;
  hello.epoch = 1;
  if (with_nonce) hello.auth = security::to_bytes(security::random_nonce());
  if (!transport::send_message(fd.get(), hello, 2000).is_ok()) {
    out.closed = true;
    return out;
  }
  auto reply = transport::recv_message(fd.get(), static_cast<std::uint32_t>(patience.count()));
  if (reply.is_ok() && std::holds_alternative<proto::AuthChallenge>(reply.value())) {
    out.challenged = true;
    // A forged proof, then some payload as if accepted.
    [[maybe_unused]] Status s =
        transport::send_message(fd.get(), proto::AuthProof{security::to_bytes(security::random_nonce())}, 2000);
    std::vector<std::uint8_t> junk(4096, 0x41);
    send_bytes(fd.get(), junk);
    reply = transport::recv_message(fd.get(), static_cast<std::uint32_t>(patience.count()));
  }
  if (reply.is_ok()) {
    const auto* ack = std::get_if<proto::P2PHelloAck>(&reply.value());
    out.accepted = ack != nullptr && ack->status == LOCKSTEP_OK;
  }
  out.closed = closed_by_other_side(fd.get(), patience);
  return out;
}

TEST(PeerAuth, StrangersOnP2PAndSharedStatePortsAreRejectedWhileTheRunWorks) {
  auto master = start_master(kSecret);
  constexpr std::size_t kWorld = 3;
  std::mutex mutex;
  std::vector<PeerId> ids(kWorld);
  std::vector<std::uint16_t> p2p_ports(kWorld), state_ports(kWorld);
  std::latch ready(kWorld + 1);
  std::atomic<bool> attacks_done{false};
  std::thread attacker([&] {
    ready.arrive_and_wait();
    const auto patience = std::chrono::milliseconds(1500 * kScale) + 1000ms;
    for (int round = 0; round < 1; ++round) {
      for (std::size_t victim = 0; victim < kWorld; ++victim) {
        const PeerId member = ids[(victim + 1) % kWorld];
        for (const auto& [port, channel] : {std::pair{p2p_ports[victim], proto::Channel::kRing},
                                            std::pair{state_ports[victim], proto::Channel::kSharedState}}) {
          // Claiming to be a member: challenged, but the forged proof is refused.
          auto spoof = stranger_connects(port, channel, member, ids[victim], true, patience);
          EXPECT_TRUE(spoof.challenged);
          EXPECT_FALSE(spoof.accepted);
          EXPECT_TRUE(spoof.closed);
          // An id the master never named: no challenge, dropped at the handshake timeout.
          auto unknown = stranger_connects(port, channel, PeerId{0xbad, 0xbad}, ids[victim], true, patience);
          EXPECT_FALSE(unknown.challenged);
          EXPECT_FALSE(unknown.accepted);
          EXPECT_TRUE(unknown.closed);
          // No nonce at all (a peer without the secret): dropped.
          auto bare = stranger_connects(port, channel, member, ids[victim], false, patience);
          EXPECT_FALSE(bare.accepted);
          EXPECT_TRUE(bare.closed);
          // Garbage frames.
          transport::Fd fd(connect_to(port));
          std::vector<std::uint8_t> garbage(10'000);
          for (std::size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<std::uint8_t>(i * 31 + static_cast<std::size_t>(round));
          send_bytes(fd.get(), garbage);
          EXPECT_TRUE(closed_by_other_side(fd.get(), patience));
        }
      }
    }
    attacks_done = true;
  });
  run_peers(
      master->port(), kWorld,
      [&](peer::Communicator& comm, std::size_t index) {
        {
          std::lock_guard<std::mutex> lock(mutex);
          ids[index] = comm.id();
          const auto view = comm.membership().value();
          for (const auto& m : view) {
            if (m.id == comm.id()) {
              p2p_ports[index] = m.p2p_port;
              state_ports[index] = m.shared_state_port;
            }
            EXPECT_TRUE(m.key.empty()) << "pair keys leak into the membership view";
          }
        }
        ready.arrive_and_wait();
        std::uint64_t tag = 1;
        std::uint64_t round = 1;
        // Collectives and syncs go on while the attacker works, and after it is done.
        for (;;) {
          const bool last = attacks_done.load();
          expect_all_reduce(comm, tag++, kWorld);
          expect_sync(comm, index, round++);
          // Every peer must agree to stop, so that all leave after the same step.
          auto stop = comm.agree(last);
          ASSERT_TRUE(stop.is_ok()) << stop.status().to_string();
          if (stop.value()) break;
        }
      },
      /*inbound_timeout_ms=*/1500 * kScale);
  attacker.join();
}

// ------------------------------------------------------------------ limits

TEST(Limits, IdleConnectionsAndASlowClientAreDroppedAtTheMaster) {
  const std::uint32_t timeout_ms = 2000 * kScale;
  auto master = start_master(kSecret, timeout_ms, /*pending_handshakes_max=*/100);
  run_peers(master->port(), 2, [&](peer::Communicator& comm, std::size_t index) {
    if (index == 0) {
      // A slow client: a valid Hello, one byte a second.
      proto::Hello hello;
      hello.p2p_port = 1;
      hello.shared_state_port = hello.benchmark_port = hello.p2p_port;  // a peer names all three ports or none
      hello.auth = security::to_bytes(security::random_nonce());
      const auto frame = proto::encode_frame(hello);
      const auto start = Clock::now();
      // 200 idle connections that never send a byte (beyond the cap of 100, each new one
      // displaces the oldest), then the slow client, the newest.
      std::vector<transport::Fd> idle;
      for (int i = 0; i < 200; ++i) idle.emplace_back(connect_to(master->port()));
      transport::Fd slow(connect_to(master->port()));
      bool slow_closed = false;
      std::size_t sent = 0;
      while (Clock::now() - start < std::chrono::milliseconds(timeout_ms) + 5s && !slow_closed) {
        if (sent < frame.size() && ::send(slow.get(), &frame[sent], 1, MSG_NOSIGNAL) == 1) ++sent;
        slow_closed = closed_by_other_side(slow.get(), 1s);
      }
      const auto slow_after = Clock::now() - start;
      EXPECT_TRUE(slow_closed);
      EXPECT_GE(slow_after, std::chrono::milliseconds(timeout_ms) - 100ms);
      // Every idle connection is gone by now: displaced at once, the rest at the timeout.
      EXPECT_EQ(closed_by(idle, idle.size(), start + std::chrono::milliseconds(timeout_ms) + 5s), idle.size());
    }
    // Members were unaffected meanwhile and still work.
    expect_all_reduce(comm, 1, 2);
    auto pending = comm.are_peers_pending();
    ASSERT_TRUE(pending.is_ok()) << pending.status().to_string();
  });
  // A newcomer can still join (the unfinished handshakes are gone).
  auto late = make_peer(master->port(), kSecret);
  EXPECT_TRUE(late->connect().is_ok()) << late->last_error();
}

TEST(Limits, ANewcomerJoinsWhileIdleConnectionsHoldEveryHandshakeSlot) {
  // The handshake timeout is far away: only displacement can make room.
  auto master = start_master(kSecret, /*handshake_timeout_ms=*/600'000, /*pending_handshakes_max=*/50);
  std::vector<transport::Fd> idle;
  for (int i = 0; i < 80; ++i) idle.emplace_back(connect_to(master->port()));
  // The flood's oldest connections made room for its newest ones.
  EXPECT_EQ(closed_by(idle, 30, Clock::now() + 5s), 30u);
  // Every slot is held by an idle connection, and a newcomer still gets in.
  auto newcomer = make_peer(master->port(), kSecret);
  ASSERT_TRUE(newcomer->connect().is_ok()) << newcomer->last_error();
  std::thread joiner([&] {
    auto second = make_peer(master->port(), kSecret);  // a communicator belongs to its creating thread
    EXPECT_TRUE(second->connect().is_ok()) << second->last_error();
  });
  bool admitted = false;
  for (auto deadline = Clock::now() + 30s * kScale; !admitted && Clock::now() < deadline;) {
    auto pending = newcomer->are_peers_pending();
    ASSERT_TRUE(pending.is_ok()) << pending.status().to_string();
    if (pending.value()) {
      ASSERT_TRUE(newcomer->update_topology().is_ok()) << newcomer->last_error();
      admitted = true;
    }
  }
  joiner.join();
  EXPECT_TRUE(admitted);
}

TEST(Limits, IdleConnectionsAndASlowClientAreDroppedAtAPeer) {
  const std::uint32_t timeout_ms = 1500 * kScale;
  auto master = start_master(kSecret);
  std::mutex mutex;
  std::uint16_t victim_port = 0;
  std::barrier sync_point(2);
  run_peers(
      master->port(), 2,
      [&](peer::Communicator& comm, std::size_t index) {
        expect_all_reduce(comm, 1, 2);
        if (index == 1) {
          std::lock_guard<std::mutex> lock(mutex);
          victim_port = comm.p2p_port();
        }
        sync_point.arrive_and_wait();
        if (index == 0) {
          // 200 idle connections (beyond the cap of 100 each displaces the oldest), then
          // the slow client, the newest, so that only the timeout drops it.
          const auto start = Clock::now();
          std::vector<transport::Fd> idle;
          for (int i = 0; i < 200; ++i) idle.emplace_back(connect_to(victim_port));
          transport::Fd slow(connect_to(victim_port));
          const auto frame = proto::encode_frame(proto::P2PHello{});
          bool slow_closed = false;
          std::size_t sent = 0;
          while (Clock::now() - start < std::chrono::milliseconds(timeout_ms) + 5s && !slow_closed) {
            if (sent < frame.size() && ::send(slow.get(), &frame[sent], 1, MSG_NOSIGNAL) == 1) ++sent;
            slow_closed = closed_by_other_side(slow.get(), 1s);
          }
          EXPECT_TRUE(slow_closed);
          EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(timeout_ms) - 100ms);
          // Displaced at once, the rest at the timeout.
          EXPECT_EQ(closed_by(idle, idle.size(), start + std::chrono::milliseconds(timeout_ms) + 5s), idle.size());
        }
        sync_point.arrive_and_wait();
        // The ring and the control plane still work.
        expect_all_reduce(comm, 2, 2);
        ASSERT_TRUE(comm.update_topology().is_ok()) << comm.last_error();
        expect_all_reduce(comm, 3, 2);
      },
      timeout_ms, /*inbound_max=*/100);
}

TEST(Limits, ANewcomerConnectsToPeersWhoseHandshakeSlotsIdleStrangersHold) {
  auto master = start_master(kSecret);
  std::mutex mutex;
  std::vector<std::uint16_t> ports;
  std::barrier flooded(3);
  std::vector<transport::Fd> idle;
  // Grows the group to `world` (the loop of Cluster::join, for peers already accepted).
  const auto grow_to = [](peer::Communicator& comm, std::size_t world) {
    for (auto deadline = Clock::now() + 60s * kScale; Clock::now() < deadline;) {
      if (comm.attributes().value().group_world_size >= world) return true;
      auto pending = comm.are_peers_pending();
      if (!pending.is_ok()) return false;
      if (!pending.value()) {
        std::this_thread::sleep_for(2ms);
        continue;
      }
      Status s = comm.update_topology();
      if (!s.is_ok() && s.code() != LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) return false;
    }
    return false;
  };
  std::thread newcomer([&] {
    flooded.arrive_and_wait();
    auto comm = make_peer(master->port(), kSecret);
    ASSERT_TRUE(Cluster::join(*comm, 3)) << comm->last_error();
    expect_all_reduce(*comm, 7, 3);
  });
  run_peers(
      master->port(), 2,
      [&](peer::Communicator& comm, std::size_t index) {
        {
          std::lock_guard<std::mutex> lock(mutex);
          ports.push_back(comm.p2p_port());
        }
        expect_all_reduce(comm, 1, 2);
        if (index == 0) {
          // Both members' p2p ports: 80 idle connections each against a cap of 50 and a
          // handshake timeout far away, so that only displacement makes room.
          std::vector<std::uint16_t> targets;
          {
            std::lock_guard<std::mutex> lock(mutex);
            targets = ports;
          }
          ASSERT_EQ(targets.size(), 2u);
          for (std::uint16_t port : targets) {
            std::vector<transport::Fd> flood;
            for (int i = 0; i < 80; ++i) flood.emplace_back(connect_to(port));
            EXPECT_EQ(closed_by(flood, 30, Clock::now() + 5s), 30u);
            for (auto& fd : flood) idle.push_back(std::move(fd));
          }
        }
        flooded.arrive_and_wait();
        // The newcomer's ring connections to the flooded ports get through.
        ASSERT_TRUE(grow_to(comm, 3)) << comm.last_error();
        expect_all_reduce(comm, 7, 3);
      },
      /*inbound_timeout_ms=*/600'000, /*inbound_max=*/50);
  newcomer.join();
}

}  // namespace
}  // namespace lockstep::testing
