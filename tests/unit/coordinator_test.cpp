// Coordinator unit tests: every legal transition, every illegal request in every
// state, failures at each point of update topology, the votes (are-peers-pending,
// agree, mismatch, vote timeout), failure detection and the handshake rules. Every
// step goes through a harness that checks the coordinator's structural invariants.
#include "common/dtype.h"
#include "common/limits.h"
#include "coordinator/coordinator.h"
#include "protocol/codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep {
void PrintTo(const PeerId& id, std::ostream* os) { *os << id.to_string(); }
namespace proto {
void PrintTo(const MemberInfo& m, std::ostream* os) {
  *os << "{" << m.id.to_string() << " " << m.host << ":" << m.p2p_port << "}";
}
}  // namespace proto
}  // namespace lockstep

namespace lockstep::coord {
namespace {

namespace p = lockstep::proto;
namespace limits = lockstep::limits;

// ---------------------------------------------------------------- outbox helpers

std::string describe(const p::Message& m) {
  std::ostringstream s;
  s << p::msg_type_name(p::type_of(m));
  std::visit(
      [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (requires { v.status; }) s << " " << status_name(v.status);
        if constexpr (requires { v.reason; }) {
          if (!v.reason.empty()) s << " \"" << v.reason << "\"";
        }
        if constexpr (std::is_same_v<T, p::EstablishP2P> || std::is_same_v<T, p::TopologyResult>) {
          s << " epoch=" << v.epoch << " ring=[";
          for (const auto& m2 : v.ring) s << m2.id.to_string() << " ";
          s << "]";
        }
        if constexpr (std::is_same_v<T, p::AgreeResult>) s << " value=" << v.value;
        if constexpr (std::is_same_v<T, p::PeersPendingResult>) s << " pending=" << v.pending;
        if constexpr (std::is_same_v<T, p::Refused>) s << " request=" << p::msg_type_name(v.request);
      },
      m);
  return s.str();
}

std::string describe(const Outbox& out) {
  std::ostringstream s;
  for (const auto& cmd : expanded(out)) {
    if (const auto* send = std::get_if<Send>(&cmd)) {
      s << "  send conn " << send->conn << ": " << describe(send->message) << "\n";
    } else if (const auto* close = std::get_if<Close>(&cmd)) {
      s << "  close conn " << close->conn << ": " << close->reason << "\n";
    } else {
      s << "  event: " << std::get<Event>(cmd).text << "\n";
    }
  }
  return s.str();
}

std::vector<p::Message> sent_to(const Outbox& out, ConnId conn) {
  std::vector<p::Message> result;
  for (const auto& cmd : expanded(out)) {
    if (const auto* send = std::get_if<Send>(&cmd); send != nullptr && send->conn == conn) result.push_back(send->message);
  }
  return result;
}

template <typename T>
std::vector<T> all_of(const Outbox& out, ConnId conn) {
  std::vector<T> result;
  for (const auto& m : sent_to(out, conn)) {
    if (const auto* v = std::get_if<T>(&m)) result.push_back(*v);
  }
  return result;
}

// The single message of type T sent to conn, or nullopt (with a test failure) if
// there is none or more than one.
template <typename T>
std::optional<T> one_of(const Outbox& out, ConnId conn) {
  auto all = all_of<T>(out, conn);
  if (all.size() != 1) {
    ADD_FAILURE() << "expected exactly one " << p::msg_type_name(T::kType) << " to conn " << conn << ", got "
                  << all.size() << "; outbox:\n"
                  << describe(out);
    return std::nullopt;
  }
  return all.front();
}

std::size_t send_count(const Outbox& batch) {
  const Outbox out = expanded(batch);
  return static_cast<std::size_t>(std::count_if(out.begin(), out.end(), [](const Command& c) { return std::holds_alternative<Send>(c); }));
}

std::size_t close_count(const Outbox& out) {
  return static_cast<std::size_t>(std::count_if(out.begin(), out.end(), [](const Command& c) { return std::holds_alternative<Close>(c); }));
}

bool closes(const Outbox& out, ConnId conn) {
  return std::any_of(out.begin(), out.end(), [&](const Command& c) {
    const auto* close = std::get_if<Close>(&c);
    return close != nullptr && close->conn == conn;
  });
}

// Position of the first command for conn satisfying pred, or out.size().
std::size_t index_of(const Outbox& out, ConnId conn, p::MsgType type) {
  for (std::size_t i = 0; i < out.size(); ++i) {
    const auto* send = std::get_if<Send>(&out[i]);
    if (send != nullptr && send->conn == conn && p::type_of(send->message) == type) return i;
  }
  return out.size();
}

std::vector<PeerId> ids_of(const std::vector<p::MemberInfo>& ring) {
  std::vector<PeerId> ids;
  for (const auto& m : ring) ids.push_back(m.id);
  return ids;
}

// ---------------------------------------------------------------- harness

struct FakePeer {
  ConnId conn = 0;
  PeerId id;
  std::uint32_t group = 0;
  std::string host;
};

Config test_config() {
  Config config;
  config.heartbeat_timeout_ms = 5'000;
  config.vote_timeout_ms = 0;
  config.handshake_timeout_ms = 2'000;
  config.establish_timeout_ms = 10'000;
  config.instance_nonce = 0xfeedfacecafe0000ull;
  return config;
}

class Harness {
 public:
  explicit Harness(Config config = test_config()) : c(config) {}

  Coordinator c;
  TimeMs now = 1'000'000;
  ConnId next_conn = 1;
  std::uint16_t pool_size = 1;  // the p2p pool size in the Hellos of join()
  bool no_ports = false;        // join() as a peer that accepts no inbound connection
  // join() as a peer that accepts inbound connections or not.
  FakePeer join_as(std::uint32_t group, bool inbound) {
    const bool before = no_ports;
    no_ports = !inbound;
    FakePeer peer = join(group);
    no_ports = before;
    return peer;
  }

  void check() {
    const auto broken = c.check_invariants();
    EXPECT_FALSE(broken.has_value()) << "invariant broken: " << broken.value_or("") << "\nstate: " << c.digest();
  }

  Outbox connect(ConnId conn, const std::string& host) {
    Outbox out;
    c.on_connect(conn, host, now, out);
    check();
    return expanded(out);
  }
  Outbox send(ConnId conn, const p::Message& message) {
    Outbox out;
    c.on_message(conn, message, now, out);
    check();
    return expanded(out);
  }
  Outbox send(const FakePeer& peer, const p::Message& message) { return send(peer.conn, message); }
  Outbox disconnect(ConnId conn) {
    Outbox out;
    c.on_disconnect(conn, "reset by peer", now, out);
    check();
    return expanded(out);
  }
  Outbox disconnect(const FakePeer& peer) { return disconnect(peer.conn); }
  Outbox protocol_error(ConnId conn) {
    Outbox out;
    c.on_protocol_error(conn, "frame of unknown type 999", now, out);
    check();
    return expanded(out);
  }
  Outbox tick() {
    Outbox out;
    c.on_tick(now, out);
    check();
    return expanded(out);
  }
  Outbox advance(TimeMs dt) {
    now += dt;
    return tick();
  }
  // Every given peer sends a heartbeat (so that time can pass without evicting it).
  void heartbeat(const std::vector<FakePeer>& peers) {
    for (const auto& peer : peers) {
      auto out = send(peer, p::Heartbeat{});
      EXPECT_TRUE(one_of<p::HeartbeatAck>(out, peer.conn).has_value());
    }
  }

  static p::Hello hello(std::uint32_t group, std::uint16_t port, std::string advertised = {}) {
    p::Hello h;
    h.group = group;
    h.p2p_port = port;
    h.shared_state_port = static_cast<std::uint16_t>(port + 1);
    h.benchmark_port = static_cast<std::uint16_t>(port + 2);
    h.advertised_host = std::move(advertised);
    return h;
  }

  // Connects and sends a Hello; the peer is registered and welcomed.
  FakePeer join(std::uint32_t group, Outbox* captured = nullptr, std::string host = {}) {
    FakePeer peer;
    peer.conn = next_conn++;
    peer.group = group;
    peer.host = host.empty() ? "10.0." + std::to_string(peer.conn / 256) + "." + std::to_string(peer.conn % 256) : host;
    auto out = connect(peer.conn, peer.host);
    EXPECT_TRUE(out.empty()) << describe(out);
    p::Hello greeting = hello(group, static_cast<std::uint16_t>(20000 + 3 * peer.conn));
    greeting.pool_size = pool_size;
    if (no_ports) greeting.p2p_port = greeting.shared_state_port = greeting.benchmark_port = 0;
    out = send(peer.conn, greeting);
    auto welcome = one_of<p::Welcome>(out, peer.conn);
    if (welcome) {
      peer.id = welcome->id;
      EXPECT_EQ(welcome->observed_host, peer.host);
      EXPECT_EQ(welcome->heartbeat_timeout_ms, c.config().heartbeat_timeout_ms);
      EXPECT_EQ(welcome->id.hi, c.config().instance_nonce);
    }
    EXPECT_FALSE(closes(out, peer.conn)) << describe(out);
    const Peer* state = c.find_peer(peer.id);
    EXPECT_NE(state, nullptr);
    if (state != nullptr) {
      EXPECT_EQ(state->phase, Phase::kRegistered);
      EXPECT_EQ(state->conn, peer.conn);
      EXPECT_EQ(state->group, group);
    }
    if (captured != nullptr) *captured = out;
    return peer;
  }

  // The first peer of an empty run: admitted without a vote.
  FakePeer first(std::uint32_t group, std::string host = {}) {
    Outbox out;
    FakePeer peer = join(group, &out, std::move(host));
    auto establish = one_of<p::EstablishP2P>(out, peer.conn);
    EXPECT_TRUE(establish.has_value());
    if (!establish) return peer;
    out = send(peer, p::P2PReport{establish->epoch, {}});
    auto result = one_of<p::TopologyResult>(out, peer.conn);
    EXPECT_TRUE(result && result->status == LOCKSTEP_OK) << describe(out);
    EXPECT_EQ(phase(peer), Phase::kAccepted);
    return peer;
  }

  // Every voter votes for update topology; returns the outbox of the last vote.
  Outbox vote_topology(const std::vector<FakePeer>& voters) {
    Outbox out;
    for (const auto& v : voters) out = send(v, p::VoteUpdateTopology{});
    return out;
  }
  // Every participant reports its p2p connections as up; returns the last outbox.
  Outbox report_all(const std::vector<FakePeer>& participants) {
    Outbox out;
    const std::uint64_t epoch = c.epoch();
    for (const auto& v : participants) out = send(v, p::P2PReport{epoch, {}});
    return out;
  }
  // A whole successful update topology: returns the outbox with the results.
  Outbox update(const std::vector<FakePeer>& accepted, const std::vector<FakePeer>& newcomers) {
    Outbox out = vote_topology(accepted);
    std::vector<FakePeer> all = accepted;
    all.insert(all.end(), newcomers.begin(), newcomers.end());
    for (const auto& peer : all) EXPECT_TRUE(one_of<p::EstablishP2P>(out, peer.conn).has_value());
    out = report_all(all);
    for (const auto& peer : all) {
      auto result = one_of<p::TopologyResult>(out, peer.conn);
      EXPECT_TRUE(result && result->status == LOCKSTEP_OK) << describe(out);
      EXPECT_EQ(phase(peer), Phase::kAccepted);
    }
    return out;
  }

  // A run with n accepted peers in one group.
  std::vector<FakePeer> run_of(std::size_t n, std::uint32_t group = 1) {
    std::vector<FakePeer> peers{first(group)};
    std::vector<FakePeer> newcomers;
    for (std::size_t i = 1; i < n; ++i) newcomers.push_back(join(group));
    if (!newcomers.empty()) update(peers, newcomers);
    peers.insert(peers.end(), newcomers.begin(), newcomers.end());
    return peers;
  }

  const Peer* peer(const FakePeer& f) const { return c.find_peer(f.id); }
  std::optional<Phase> phase(const FakePeer& f) const {
    const Peer* state = peer(f);
    return state == nullptr ? std::nullopt : std::optional<Phase>(state->phase);
  }
  std::optional<PeerState> state(const FakePeer& f) const {
    const Peer* s = peer(f);
    return s == nullptr ? std::nullopt : std::optional<PeerState>(s->state);
  }
  bool gone(const FakePeer& f) const { return peer(f) == nullptr && !c.peer_of(f.conn).has_value(); }
};

// The peer was told why and its connection closed.
void expect_goodbye(const Outbox& out, const FakePeer& peer, StatusCode status) {
  auto goodbye = one_of<p::Goodbye>(out, peer.conn);
  ASSERT_TRUE(goodbye.has_value());
  EXPECT_EQ(goodbye->status, status) << describe(out);
  EXPECT_FALSE(goodbye->reason.empty());
  EXPECT_TRUE(closes(out, peer.conn)) << describe(out);
  EXPECT_LT(index_of(out, peer.conn, p::MsgType::kGoodbye), out.size());
}

void expect_topology_failed(const Outbox& out, const FakePeer& peer, StatusCode status) {
  auto result = one_of<p::TopologyResult>(out, peer.conn);
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->status, status) << describe(out);
  EXPECT_TRUE(result->ring.empty());
  EXPECT_FALSE(result->reason.empty());
}

void expect_agree(const Outbox& out, const FakePeer& peer, StatusCode status, bool value) {
  auto result = one_of<p::AgreeResult>(out, peer.conn);
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->status, status) << describe(out);
  if (status == LOCKSTEP_OK) {
    EXPECT_EQ(result->value, value);
  } else {
    EXPECT_FALSE(result->reason.empty());
  }
}

void expect_pending(const Outbox& out, const FakePeer& peer, StatusCode status, bool pending) {
  auto result = one_of<p::PeersPendingResult>(out, peer.conn);
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->status, status) << describe(out);
  if (status == LOCKSTEP_OK) {
    EXPECT_EQ(result->pending, pending);
  }
}

// ---------------------------------------------------------------- admission

TEST(CoordinatorAdmission, FirstPeerIsAdmittedWithoutAVote) {
  Harness h;
  Outbox out;
  const FakePeer a = h.join(3, &out);
  const auto establish = one_of<p::EstablishP2P>(out, a.conn);
  ASSERT_TRUE(establish.has_value()) << describe(out);
  EXPECT_LT(index_of(out, a.conn, p::MsgType::kWelcome), index_of(out, a.conn, p::MsgType::kEstablishP2P));
  EXPECT_EQ(establish->epoch, h.c.epoch());
  ASSERT_EQ(establish->ring.size(), 1u);
  EXPECT_EQ(establish->ring[0].id, a.id);
  EXPECT_EQ(establish->ring[0].host, a.host);
  EXPECT_EQ(establish->ring[0].p2p_port, 20000 + 3 * a.conn);
  EXPECT_EQ(establish->ring[0].shared_state_port, 20001 + 3 * a.conn);
  EXPECT_EQ(establish->ring[0].benchmark_port, 20002 + 3 * a.conn);
  EXPECT_EQ(h.phase(a), Phase::kRegistered);
  EXPECT_EQ(h.state(a), PeerState::kEstablishingP2P);
  EXPECT_EQ(h.c.topology_phase(), TopologyPhase::kEstablishing);
  EXPECT_TRUE(h.c.ring(3).empty());
  EXPECT_EQ(h.c.accepted_count(), 0u);

  out = h.send(a, p::P2PReport{establish->epoch, {}});
  const auto result = one_of<p::TopologyResult>(out, a.conn);
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->status, LOCKSTEP_OK);
  EXPECT_EQ(result->epoch, establish->epoch);
  EXPECT_EQ(result->ring, establish->ring);
  EXPECT_EQ(result->attributes, (p::Attributes{1, 1, 1, 1}));
  EXPECT_EQ(h.phase(a), Phase::kAccepted);
  EXPECT_EQ(h.state(a), PeerState::kIdle);
  EXPECT_EQ(h.c.ring(3), std::vector<PeerId>{a.id});
  EXPECT_EQ(h.c.accepted_count(), 1u);
  EXPECT_EQ(h.c.topology_phase(), TopologyPhase::kIdle);
  EXPECT_EQ(h.c.attributes(3), (p::Attributes{1, 1, 1, 1}));
}

TEST(CoordinatorAdmission, PeerIdsAreUniquePerConnection) {
  Harness h;
  const FakePeer a = h.first(1);
  const FakePeer b = h.join(1);
  EXPECT_NE(a.id, b.id);
  h.disconnect(b);
  // the same host connecting again is a new peer with a new identity
  Outbox out;
  const FakePeer b2 = h.join(1, &out, b.host);
  EXPECT_NE(b2.id, b.id);
  EXPECT_NE(b2.id, a.id);
  EXPECT_GT(b2.id.lo, b.id.lo);
}

TEST(CoordinatorAdmission, SecondPeerWaitsRegisteredUntilTheAcceptedPeerVotes) {
  Harness h;
  const FakePeer a = h.first(1);
  Outbox out;
  const FakePeer b = h.join(1, &out);
  EXPECT_EQ(send_count(out), 1u) << describe(out);  // the Welcome only
  EXPECT_TRUE(all_of<p::EstablishP2P>(out, a.conn).empty());
  EXPECT_EQ(h.phase(b), Phase::kRegistered);
  EXPECT_EQ(h.state(b), PeerState::kIdle);
  // time passes (with heartbeats): still registered, nobody asked
  for (int i = 0; i < 5; ++i) {
    h.heartbeat({a, b});
    out = h.advance(1'000);
    EXPECT_EQ(send_count(out), 0u) << describe(out);
  }
  EXPECT_EQ(h.phase(b), Phase::kRegistered);

  out = h.send(a, p::VoteUpdateTopology{});
  const auto ea = one_of<p::EstablishP2P>(out, a.conn);
  const auto eb = one_of<p::EstablishP2P>(out, b.conn);
  ASSERT_TRUE(ea && eb);
  EXPECT_EQ(*ea, *eb);
  EXPECT_EQ(ids_of(ea->ring), (std::vector<PeerId>{a.id, b.id}));
  EXPECT_EQ(h.state(a), PeerState::kEstablishingP2P);
  EXPECT_EQ(h.state(b), PeerState::kEstablishingP2P);

  out = h.send(b, p::P2PReport{ea->epoch, {}});
  EXPECT_EQ(send_count(out), 0u) << describe(out);
  out = h.send(a, p::P2PReport{ea->epoch, {}});
  const auto ra = one_of<p::TopologyResult>(out, a.conn);
  const auto rb = one_of<p::TopologyResult>(out, b.conn);
  ASSERT_TRUE(ra && rb);
  EXPECT_EQ(*ra, *rb);
  EXPECT_EQ(ra->status, LOCKSTEP_OK);
  EXPECT_EQ(ra->ring, ea->ring);
  EXPECT_EQ(ra->attributes, (p::Attributes{2, 2, 1, 2}));
  EXPECT_EQ(h.phase(b), Phase::kAccepted);
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{a.id, b.id}));
}

TEST(CoordinatorAdmission, NewcomersInTwoGroupsGetTheirGroupsRingInJoinOrder) {
  Harness h;
  const FakePeer a = h.first(1);
  const FakePeer b = h.join(1);
  const FakePeer c = h.join(2);
  const FakePeer d = h.join(1);
  const FakePeer e = h.join(2);
  Outbox out = h.send(a, p::VoteUpdateTopology{});
  const std::vector<PeerId> ring1 = {a.id, b.id, d.id};
  const std::vector<PeerId> ring2 = {c.id, e.id};
  for (const auto& f : {a, b, d}) {
    const auto est = one_of<p::EstablishP2P>(out, f.conn);
    ASSERT_TRUE(est.has_value());
    EXPECT_EQ(ids_of(est->ring), ring1);
  }
  for (const auto& f : {c, e}) {
    const auto est = one_of<p::EstablishP2P>(out, f.conn);
    ASSERT_TRUE(est.has_value());
    EXPECT_EQ(ids_of(est->ring), ring2);
    EXPECT_EQ(est->ring[0].host, c.host);
  }
  EXPECT_EQ(send_count(out), 5u) << describe(out);
  EXPECT_EQ(h.c.major_op(1), MajorOp::kUpdateTopology);
  EXPECT_EQ(h.c.major_op(2), MajorOp::kUpdateTopology);

  out = h.report_all({e, d, c, b, a});
  std::optional<p::TopologyResult> g1;
  std::optional<p::TopologyResult> g2;
  for (const auto& f : {a, b, d}) {
    const auto r = one_of<p::TopologyResult>(out, f.conn);
    ASSERT_TRUE(r.has_value());
    if (!g1) g1 = r;
    EXPECT_EQ(*r, *g1);
  }
  for (const auto& f : {c, e}) {
    const auto r = one_of<p::TopologyResult>(out, f.conn);
    ASSERT_TRUE(r.has_value());
    if (!g2) g2 = r;
    EXPECT_EQ(*r, *g2);
  }
  EXPECT_EQ(g1->status, LOCKSTEP_OK);
  EXPECT_EQ(ids_of(g1->ring), ring1);
  EXPECT_EQ(ids_of(g2->ring), ring2);
  EXPECT_EQ(g1->attributes, (p::Attributes{5, 3, 2, 3}));
  EXPECT_EQ(g2->attributes, (p::Attributes{5, 2, 2, 3}));
  EXPECT_EQ(g1->epoch, g2->epoch);
  EXPECT_EQ(h.c.ring(1), ring1);
  EXPECT_EQ(h.c.ring(2), ring2);
  EXPECT_EQ(h.c.accepted_count(), 5u);
  EXPECT_EQ(h.c.major_op(1), MajorOp::kNone);

  // A later newcomer is appended at the end of its group's ring; the other group's
  // membership is unchanged but its attributes follow the run.
  const FakePeer f = h.join(2);
  out = h.update({a, b, c, d, e}, {f});
  const auto rc = one_of<p::TopologyResult>(out, c.conn);
  const auto ra = one_of<p::TopologyResult>(out, a.conn);
  ASSERT_TRUE(rc && ra);
  EXPECT_EQ(ids_of(rc->ring), (std::vector<PeerId>{c.id, e.id, f.id}));
  EXPECT_EQ(ids_of(ra->ring), ring1);
  EXPECT_EQ(rc->attributes, (p::Attributes{6, 3, 2, 3}));
  EXPECT_EQ(ra->attributes, (p::Attributes{6, 3, 2, 3}));
}

TEST(CoordinatorAdmission, AdvertisedHostIsTheMembersAddress) {
  Harness h;
  const FakePeer a = h.first(1);
  h.send(a, p::Heartbeat{});
  const ConnId conn = h.next_conn++;
  h.connect(conn, "10.9.9.9");
  Outbox out = h.send(conn, Harness::hello(1, 7000, "203.0.113.5"));
  const auto welcome = one_of<p::Welcome>(out, conn);
  ASSERT_TRUE(welcome.has_value());
  EXPECT_EQ(welcome->observed_host, "10.9.9.9");
  const FakePeer b{conn, welcome->id, 1, "203.0.113.5"};
  out = h.vote_topology({a});
  const auto est = one_of<p::EstablishP2P>(out, a.conn);
  ASSERT_TRUE(est.has_value());
  ASSERT_EQ(est->ring.size(), 2u);
  EXPECT_EQ(est->ring[1].host, "203.0.113.5");
  EXPECT_EQ(est->ring[1].p2p_port, 7000);
  EXPECT_EQ(est->ring[1].shared_state_port, 7001);
  EXPECT_EQ(est->ring[1].benchmark_port, 7002);
  h.report_all({a, b});
  EXPECT_EQ(h.phase(b), Phase::kAccepted);
}

TEST(CoordinatorAdmission, UpdateWithoutNewcomersSucceedsWithTheSameRing) {
  Harness h;
  const auto peers = h.run_of(3);
  const std::uint64_t epoch = h.c.epoch();
  Outbox out = h.update(peers, {});
  EXPECT_EQ(h.c.epoch(), epoch + 1);
  for (const auto& f : peers) {
    const auto r = one_of<p::TopologyResult>(out, f.conn);
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(ids_of(r->ring), (std::vector<PeerId>{peers[0].id, peers[1].id, peers[2].id}));
  }
}

TEST(CoordinatorAdmission, TopologyVoteWaitsForEveryAcceptedPeerInEveryGroup) {
  Harness h;
  const FakePeer a = h.first(1);
  const FakePeer b = h.join(2);
  h.update({a}, {b});
  const FakePeer n = h.join(1);
  Outbox out = h.send(a, p::VoteUpdateTopology{});
  EXPECT_EQ(send_count(out), 0u) << describe(out);
  EXPECT_EQ(h.c.topology_phase(), TopologyPhase::kVoting);
  EXPECT_EQ(h.state(a), PeerState::kVoteAcceptNewPeers);
  out = h.send(b, p::VoteUpdateTopology{});
  EXPECT_EQ(send_count(out), 3u) << describe(out);
  h.report_all({a, b, n});
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{a.id, n.id}));
}

// ---------------------------------------------------------------- p2p failures

TEST(CoordinatorP2P, UnreachableNewcomerIsRejectedAndTheOthersMayRetry) {
  Harness h;
  const auto accepted = h.run_of(2);
  const FakePeer& a = accepted[0];
  const FakePeer& b = accepted[1];
  const FakePeer n = h.join(1);
  const FakePeer m = h.join(1);
  h.vote_topology(accepted);
  const std::uint64_t epoch = h.c.epoch();
  Outbox out = h.send(a, p::P2PReport{epoch, {n.id}});
  EXPECT_EQ(send_count(out), 0u);
  h.send(n, p::P2PReport{epoch, {}});
  h.send(m, p::P2PReport{epoch, {}});
  out = h.send(b, p::P2PReport{epoch, {}});
  expect_goodbye(out, n, LOCKSTEP_STATUS_REJECTED);
  EXPECT_TRUE(h.gone(n));
  expect_topology_failed(out, a, LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
  expect_topology_failed(out, b, LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
  expect_topology_failed(out, m, LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
  EXPECT_FALSE(closes(out, a.conn));
  EXPECT_FALSE(closes(out, m.conn));
  EXPECT_EQ(h.phase(m), Phase::kRegistered);
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{a.id, b.id}));
  EXPECT_EQ(h.c.topology_phase(), TopologyPhase::kIdle);
  for (const auto& f : {a, b, m}) EXPECT_EQ(h.state(f), PeerState::kIdle);

  // the retry admits the remaining newcomer without the rejected one
  out = h.update(accepted, {m});
  const auto r = one_of<p::TopologyResult>(out, a.conn);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(ids_of(r->ring), (std::vector<PeerId>{a.id, b.id, m.id}));
  EXPECT_TRUE(all_of<p::TopologyResult>(out, n.conn).empty());
}

TEST(CoordinatorP2P, NewcomerThatCannotReachAnAcceptedPeerIsRejected) {
  Harness h;
  const auto accepted = h.run_of(2);
  const FakePeer n = h.join(1);
  h.vote_topology(accepted);
  h.send(n, p::P2PReport{h.c.epoch(), {accepted[1].id}});
  h.send(accepted[1], p::P2PReport{h.c.epoch(), {}});
  Outbox out = h.send(accepted[0], p::P2PReport{h.c.epoch(), {}});
  expect_goodbye(out, n, LOCKSTEP_STATUS_REJECTED);
  for (const auto& f : accepted) {
    expect_topology_failed(out, f, LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
    EXPECT_EQ(h.phase(f), Phase::kAccepted);
  }
  EXPECT_TRUE(h.gone(n));
  EXPECT_EQ(h.c.accepted_count(), 2u);
}

TEST(CoordinatorP2P, AcceptedPeerThatCannotReachItsNeighbourIsKicked) {
  Harness h;
  const auto accepted = h.run_of(3);
  const FakePeer n = h.join(1);
  h.vote_topology(accepted);
  const std::uint64_t epoch = h.c.epoch();
  h.send(accepted[0], p::P2PReport{epoch, {}});
  h.send(n, p::P2PReport{epoch, {}});
  h.send(accepted[2], p::P2PReport{epoch, {}});
  Outbox out = h.send(accepted[1], p::P2PReport{epoch, {accepted[2].id}});
  expect_goodbye(out, accepted[1], LOCKSTEP_STATUS_KICKED);
  EXPECT_TRUE(h.gone(accepted[1]));
  for (const auto& f : {accepted[0], accepted[2], n}) {
    expect_topology_failed(out, f, LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
    EXPECT_FALSE(closes(out, f.conn));
  }
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{accepted[0].id, accepted[2].id}));
  EXPECT_EQ(h.phase(n), Phase::kRegistered);
  // the next update admits the newcomer into the smaller ring
  out = h.update({accepted[0], accepted[2]}, {n});
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{accepted[0].id, accepted[2].id, n.id}));
}

TEST(CoordinatorP2P, EstablishTimeoutBlamesTheParticipantsThatNeverReported) {
  Config config = test_config();
  config.newcomer_timeout_ms = 60'000;  // above establish_timeout_ms: the smaller one holds for newcomers too
  Harness h(config);
  const auto accepted = h.run_of(2);
  const FakePeer n = h.join(1);
  const FakePeer m = h.join(1);
  h.vote_topology(accepted);
  const std::uint64_t epoch = h.c.epoch();
  h.send(accepted[0], p::P2PReport{epoch, {}});
  h.send(accepted[1], p::P2PReport{epoch, {}});
  h.send(m, p::P2PReport{epoch, {}});
  const TimeMs limit = h.c.config().establish_timeout_ms;
  h.now += limit - 1;
  h.heartbeat({accepted[0], accepted[1], n, m});
  Outbox out = h.tick();
  EXPECT_EQ(send_count(out), 0u) << describe(out);
  h.now += 1;
  out = h.tick();
  expect_goodbye(out, n, LOCKSTEP_STATUS_REJECTED);
  for (const auto& f : {accepted[0], accepted[1], m}) expect_topology_failed(out, f, LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
  EXPECT_TRUE(h.gone(n));
  EXPECT_EQ(h.c.topology_phase(), TopologyPhase::kIdle);

  // an accepted peer that never reports is removed (kicked)
  h.vote_topology(accepted);
  h.send(accepted[0], p::P2PReport{h.c.epoch(), {}});
  h.send(m, p::P2PReport{h.c.epoch(), {}});
  h.now += limit;
  h.heartbeat({accepted[0], accepted[1], m});
  out = h.tick();
  expect_goodbye(out, accepted[1], LOCKSTEP_STATUS_KICKED);
  expect_topology_failed(out, accepted[0], LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
  expect_topology_failed(out, m, LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
  EXPECT_EQ(h.c.ring(1), std::vector<PeerId>{accepted[0].id});
}

TEST(CoordinatorP2P, NewcomerThatNeverReportsIsRejectedAfterTheNewcomerTimeout) {
  // A stranger that registers with p2p ports nobody listens on and then only sends
  // heartbeats holds the update no longer than newcomer_timeout_ms; the accepted peers'
  // update fails and the next one goes on without it.
  Harness h;
  const auto accepted = h.run_of(2);
  const FakePeer n = h.join(1);
  h.vote_topology(accepted);
  const std::uint64_t epoch = h.c.epoch();
  h.send(accepted[0], p::P2PReport{epoch, {}});
  h.send(accepted[1], p::P2PReport{epoch, {}});
  const TimeMs limit = h.c.config().newcomer_timeout_ms;
  ASSERT_EQ(limit, limits::kNewcomerTimeoutMsDefault);
  ASSERT_LT(limit, h.c.config().establish_timeout_ms);
  h.now += limit - 1;
  h.heartbeat({accepted[0], accepted[1], n});
  Outbox out = h.tick();
  EXPECT_EQ(send_count(out), 0u) << describe(out);
  h.now += 1;
  out = h.tick();
  expect_goodbye(out, n, LOCKSTEP_STATUS_REJECTED);
  for (const auto& f : accepted) expect_topology_failed(out, f, LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
  EXPECT_TRUE(h.gone(n));
  EXPECT_EQ(h.c.topology_phase(), TopologyPhase::kIdle);
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{accepted[0].id, accepted[1].id}));

  // An accepted peer that has not reported by then is not blamed for it: it has
  // establish_timeout_ms.
  const FakePeer m = h.join(1);
  h.vote_topology(accepted);
  h.send(accepted[0], p::P2PReport{h.c.epoch(), {}});
  h.send(m, p::P2PReport{h.c.epoch(), {}});
  h.now += limit;
  h.heartbeat({accepted[0], accepted[1], m});
  out = h.tick();
  EXPECT_EQ(send_count(out), 0u) << describe(out);
  out = h.send(accepted[1], p::P2PReport{h.c.epoch(), {}});
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{accepted[0].id, accepted[1].id, m.id}));
}

// ---------------------------------------------------------------- disconnects

TEST(CoordinatorDisconnect, DuringTheTopologyVoteTheVoteCompletesWithoutIt) {
  Harness h;
  const auto accepted = h.run_of(3);
  const FakePeer n = h.join(1);
  h.send(accepted[0], p::VoteUpdateTopology{});
  h.send(accepted[1], p::VoteUpdateTopology{});
  Outbox out = h.disconnect(accepted[2]);
  EXPECT_FALSE(closes(out, accepted[2].conn));
  EXPECT_TRUE(all_of<p::Goodbye>(out, accepted[2].conn).empty());
  for (const auto& f : {accepted[0], accepted[1], n}) {
    const auto est = one_of<p::EstablishP2P>(out, f.conn);
    ASSERT_TRUE(est.has_value()) << describe(out);
    EXPECT_EQ(ids_of(est->ring), (std::vector<PeerId>{accepted[0].id, accepted[1].id, n.id}));
  }
  out = h.report_all({accepted[0], accepted[1], n});
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{accepted[0].id, accepted[1].id, n.id}));
}

TEST(CoordinatorDisconnect, AcceptedPeerLostDuringEstablishmentFailsTheUpdateForAll) {
  Harness h;
  const auto accepted = h.run_of(3);
  const FakePeer n = h.join(1);
  h.vote_topology(accepted);
  h.send(accepted[0], p::P2PReport{h.c.epoch(), {}});
  Outbox out = h.disconnect(accepted[1]);
  for (const auto& f : {accepted[0], accepted[2], n}) {
    expect_topology_failed(out, f, LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
  }
  EXPECT_EQ(h.c.topology_phase(), TopologyPhase::kIdle);
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{accepted[0].id, accepted[2].id}));
  EXPECT_EQ(h.phase(n), Phase::kRegistered);
  // retry with the survivors
  out = h.update({accepted[0], accepted[2]}, {n});
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{accepted[0].id, accepted[2].id, n.id}));
}

TEST(CoordinatorDisconnect, NewcomerLostDuringEstablishmentFailsTheUpdateForAll) {
  Harness h;
  const auto accepted = h.run_of(2);
  const FakePeer n = h.join(1);
  const FakePeer m = h.join(2);
  h.vote_topology(accepted);
  h.send(n, p::P2PReport{h.c.epoch(), {}});
  Outbox out = h.disconnect(n);
  for (const auto& f : {accepted[0], accepted[1], m}) {
    expect_topology_failed(out, f, LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
  }
  EXPECT_TRUE(h.gone(n));
  // the accepted ring is untouched; the retry admits m
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{accepted[0].id, accepted[1].id}));
  h.update(accepted, {m});
  EXPECT_EQ(h.c.ring(2), std::vector<PeerId>{m.id});
}

TEST(CoordinatorDisconnect, RegisteredPeerLeavingChangesNothingElse) {
  Harness h;
  const auto accepted = h.run_of(2);
  const FakePeer n = h.join(1);
  h.send(accepted[0], p::VoteUpdateTopology{});
  const std::string before = h.c.digest();
  Outbox out = h.disconnect(n);
  EXPECT_EQ(send_count(out), 0u) << describe(out);
  EXPECT_TRUE(h.gone(n));
  EXPECT_EQ(h.state(accepted[0]), PeerState::kVoteAcceptNewPeers);
  EXPECT_NE(h.c.digest(), before);
  // an accepted peer did not leave, so are-peers-pending says no once the vote resolves
  out = h.send(accepted[1], p::VoteUpdateTopology{});
  h.report_all(accepted);
  h.send(accepted[0], p::VotePeersPending{});
  out = h.send(accepted[1], p::VotePeersPending{});
  expect_pending(out, accepted[0], LOCKSTEP_OK, false);
}

TEST(CoordinatorDisconnect, LastAcceptedPeerLeavingLetsRegisteredPeersIn) {
  Harness h;
  const FakePeer a = h.first(1);
  const FakePeer n = h.join(1);
  const FakePeer m = h.join(2);
  Outbox out = h.disconnect(a);
  // nobody is left to ask: the registered peers are admitted without a vote
  ASSERT_TRUE(one_of<p::EstablishP2P>(out, n.conn).has_value()) << describe(out);
  ASSERT_TRUE(one_of<p::EstablishP2P>(out, m.conn).has_value());
  out = h.report_all({n, m});
  EXPECT_EQ(h.c.ring(1), std::vector<PeerId>{n.id});
  EXPECT_EQ(h.c.ring(2), std::vector<PeerId>{m.id});
  const auto r = one_of<p::TopologyResult>(out, n.conn);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->attributes, (p::Attributes{2, 1, 2, 1}));
}

TEST(CoordinatorDisconnect, LateMessagesAndUnknownConnectionsAreIgnored) {
  Harness h;
  const auto accepted = h.run_of(2);
  h.disconnect(accepted[1]);
  const std::string before = h.c.digest();
  EXPECT_TRUE(h.send(accepted[1], p::VoteAgree{true}).empty());
  EXPECT_TRUE(h.disconnect(accepted[1]).empty());
  EXPECT_TRUE(h.protocol_error(accepted[1].conn).empty());
  EXPECT_TRUE(h.send(999, p::Heartbeat{}).empty());
  EXPECT_TRUE(h.disconnect(999).empty());
  EXPECT_EQ(h.c.digest(), before);
}

// ---------------------------------------------------------------- are-peers-pending

TEST(CoordinatorPending, AnswerIsTheSameForAllAndFollowsTheRule) {
  Harness h;
  const auto peers = h.run_of(3);
  // nothing pending
  h.send(peers[0], p::VotePeersPending{});
  Outbox out = h.send(peers[1], p::VotePeersPending{});
  EXPECT_EQ(send_count(out), 0u);
  EXPECT_TRUE(h.peer(peers[0])->voted_pending);
  out = h.send(peers[2], p::VotePeersPending{});
  for (const auto& f : peers) expect_pending(out, f, LOCKSTEP_OK, false);
  for (const auto& f : peers) EXPECT_FALSE(h.peer(f)->voted_pending);

  // a registered peer: yes
  const FakePeer n = h.join(2);
  for (const auto& f : peers) out = h.send(f, p::VotePeersPending{});
  for (const auto& f : peers) expect_pending(out, f, LOCKSTEP_OK, true);
  EXPECT_TRUE(all_of<p::PeersPendingResult>(out, n.conn).empty());

  // after the update: no
  h.update(peers, {n});
  const std::vector<FakePeer> all = {peers[0], peers[1], peers[2], n};
  for (const auto& f : all) out = h.send(f, p::VotePeersPending{});
  for (const auto& f : all) expect_pending(out, f, LOCKSTEP_OK, false);

  // an accepted peer left: yes, until the next update
  h.disconnect(peers[1]);
  const std::vector<FakePeer> rest = {peers[0], peers[2], n};
  for (int round = 0; round < 2; ++round) {
    for (const auto& f : rest) out = h.send(f, p::VotePeersPending{});
    for (const auto& f : rest) expect_pending(out, f, LOCKSTEP_OK, true);
  }
  h.update(rest, {});
  for (const auto& f : rest) out = h.send(f, p::VotePeersPending{});
  for (const auto& f : rest) expect_pending(out, f, LOCKSTEP_OK, false);
}

TEST(CoordinatorPending, VoteCompletesWhenTheLastNonVoterLeaves) {
  Harness h;
  const auto peers = h.run_of(3);
  h.send(peers[0], p::VotePeersPending{});
  h.send(peers[1], p::VotePeersPending{});
  Outbox out = h.disconnect(peers[2]);
  expect_pending(out, peers[0], LOCKSTEP_OK, true);  // a peer left since the last update
  expect_pending(out, peers[1], LOCKSTEP_OK, true);
}

TEST(CoordinatorPending, IsRunWideAcrossGroups) {
  Harness h;
  const FakePeer a = h.first(1);
  const FakePeer b = h.join(2);
  h.update({a}, {b});
  Outbox out = h.send(a, p::VotePeersPending{});
  EXPECT_EQ(send_count(out), 0u) << "the vote waits for the other group too";
  out = h.send(b, p::VotePeersPending{});
  expect_pending(out, a, LOCKSTEP_OK, false);
  expect_pending(out, b, LOCKSTEP_OK, false);
}

// ---------------------------------------------------------------- agree

TEST(CoordinatorAgree, ResultIsTheAndOfAllFlags) {
  Harness h;
  const auto peers = h.run_of(3);
  for (const auto& flags : std::vector<std::vector<bool>>{{true, true, true}, {true, false, true}, {false, false, false},
                                                           {true, true, false}}) {
    Outbox out;
    for (std::size_t i = 0; i < peers.size(); ++i) {
      out = h.send(peers[i], p::VoteAgree{flags[i]});
      if (i + 1 < peers.size()) {
        EXPECT_EQ(send_count(out), 0u);
      }
    }
    const bool expected = std::all_of(flags.begin(), flags.end(), [](bool f) { return f; });
    for (const auto& f : peers) expect_agree(out, f, LOCKSTEP_OK, expected);
    EXPECT_EQ(send_count(out), peers.size());
  }
}

// Agree on a value: all-equal gives every voter the common proposal, or a mismatch to
// all; first-accepted gives everyone the proposal of the peer accepted first; modes
// that differ are a mismatch.
TEST(CoordinatorAgree, OnAValue) {
  Harness h;
  const auto peers = h.run_of(3);  // accepted together: the first is the lowest id
  using Bytes = std::vector<std::uint8_t>;
  const auto round = [&](const std::vector<p::VoteAgree>& votes) {
    Outbox out;
    for (std::size_t i = 0; i < peers.size(); ++i) out = h.send(peers[i], votes[i]);
    std::vector<p::AgreeResult> results;
    for (const auto& f : peers) {
      const auto r = one_of<p::AgreeResult>(out, f.conn);
      EXPECT_TRUE(r.has_value()) << describe(out);
      results.push_back(r.value_or(p::AgreeResult{}));
    }
    for (const auto& r : results) EXPECT_EQ(r, results[0]) << "voters got different outcomes";
    return results[0];
  };
  const p::VoteAgree step7{true, p::AgreeMode::kAllEqual, Bytes{7, 0, 0, 0}};
  auto r = round({step7, step7, step7});
  EXPECT_EQ(r.status, LOCKSTEP_OK);
  EXPECT_EQ(r.agreed, (Bytes{7, 0, 0, 0}));
  r = round({step7, step7, p::VoteAgree{true, p::AgreeMode::kAllEqual, Bytes{8, 0, 0, 0}}});
  EXPECT_EQ(r.status, LOCKSTEP_STATUS_OPERATION_MISMATCH);
  EXPECT_NE(r.reason.find("different values"), std::string::npos) << r.reason;
  EXPECT_TRUE(r.agreed.empty());
  r = round({p::VoteAgree{true, p::AgreeMode::kFirstAccepted, Bytes{1}},
             p::VoteAgree{true, p::AgreeMode::kFirstAccepted, Bytes{2, 2}},
             p::VoteAgree{true, p::AgreeMode::kFirstAccepted, Bytes{3, 3, 3}}});
  EXPECT_EQ(r.status, LOCKSTEP_OK);
  const auto first = std::min_element(peers.begin(), peers.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  EXPECT_EQ(r.agreed, Bytes(static_cast<std::size_t>(first - peers.begin()) + 1, static_cast<std::uint8_t>(first - peers.begin() + 1)));
  r = round({step7, p::VoteAgree{true, p::AgreeMode::kFirstAccepted, Bytes{7, 0, 0, 0}}, step7});
  EXPECT_EQ(r.status, LOCKSTEP_STATUS_OPERATION_MISMATCH);
  r = round({step7, p::VoteAgree{true}, step7});
  EXPECT_EQ(r.status, LOCKSTEP_STATUS_OPERATION_MISMATCH);
  // A flag round after all that is an ordinary flag round.
  r = round({p::VoteAgree{true}, p::VoteAgree{true}, p::VoteAgree{false}});
  EXPECT_EQ(r.status, LOCKSTEP_OK);
  EXPECT_FALSE(r.value);
}

// First-accepted: the member accepted in the earliest update; once it is gone, the
// oldest of the others (the lowest id among those accepted together); never a newcomer.
TEST(CoordinatorAgree, FirstAcceptedIsTheOldestMember) {
  Harness h;
  auto peers = h.run_of(3);  // peers[0] alone first, then peers[1] and peers[2] together
  const FakePeer late = h.join(1);
  h.update(peers, {late});
  peers.push_back(late);
  const auto agreed = [&](const std::vector<FakePeer>& voters) {
    Outbox out;
    for (const auto& f : voters) {
      out = h.send(f, p::VoteAgree{true, p::AgreeMode::kFirstAccepted,
                                   std::vector<std::uint8_t>{static_cast<std::uint8_t>(f.conn)}});
    }
    const auto r = one_of<p::AgreeResult>(out, voters.back().conn);
    EXPECT_TRUE(r.has_value() && r->agreed.size() == 1) << describe(out);
    return r && r->agreed.size() == 1 ? static_cast<int>(r->agreed[0]) : -1;
  };
  EXPECT_EQ(agreed(peers), static_cast<int>(peers[0].conn));
  h.disconnect(peers[0]);
  peers.erase(peers.begin());
  const auto& oldest = peers[0].id < peers[1].id ? peers[0] : peers[1];
  EXPECT_EQ(agreed(peers), static_cast<int>(oldest.conn));
}

TEST(CoordinatorAgree, SinglePeerDecidesAlone) {
  Harness h;
  const FakePeer a = h.first(1);
  expect_agree(h.send(a, p::VoteAgree{true}), a, LOCKSTEP_OK, true);
  expect_agree(h.send(a, p::VoteAgree{false}), a, LOCKSTEP_OK, false);
}

TEST(CoordinatorAgree, RoundsArePerGroup) {
  Harness h;
  const FakePeer a = h.first(1);
  const FakePeer b = h.join(1);
  const FakePeer c = h.join(2);
  const FakePeer d = h.join(2);
  h.update({a}, {b, c, d});
  h.send(a, p::VoteAgree{true});
  Outbox out = h.send(c, p::VoteAgree{false});
  EXPECT_EQ(send_count(out), 0u);
  out = h.send(d, p::VoteAgree{true});
  expect_agree(out, c, LOCKSTEP_OK, false);
  expect_agree(out, d, LOCKSTEP_OK, false);
  EXPECT_TRUE(sent_to(out, a.conn).empty());
  out = h.send(b, p::VoteAgree{true});
  expect_agree(out, a, LOCKSTEP_OK, true);
  expect_agree(out, b, LOCKSTEP_OK, true);
  EXPECT_EQ(send_count(out), 2u);
}

TEST(CoordinatorAgree, ParticipantLostMidRoundFailsItForAllVoters) {
  Harness h;
  const auto peers = h.run_of(4);
  h.send(peers[0], p::VoteAgree{true});
  h.send(peers[1], p::VoteAgree{true});
  Outbox out = h.disconnect(peers[3]);
  EXPECT_EQ(send_count(out), 0u) << "peers[2] has not voted yet";
  out = h.send(peers[2], p::VoteAgree{true});
  for (int i = 0; i < 3; ++i) expect_agree(out, peers[static_cast<std::size_t>(i)], LOCKSTEP_STATUS_PEER_CONNECTION_LOST, false);
  // a later round works with the survivors
  for (int i = 0; i < 3; ++i) out = h.send(peers[static_cast<std::size_t>(i)], p::VoteAgree{true});
  for (int i = 0; i < 3; ++i) expect_agree(out, peers[static_cast<std::size_t>(i)], LOCKSTEP_OK, true);
}

TEST(CoordinatorAgree, LastMissingParticipantLostCompletesTheRoundAsFailed) {
  Harness h;
  const auto peers = h.run_of(3);
  h.send(peers[0], p::VoteAgree{true});
  h.send(peers[1], p::VoteAgree{true});
  Outbox out = h.disconnect(peers[2]);
  expect_agree(out, peers[0], LOCKSTEP_STATUS_PEER_CONNECTION_LOST, false);
  expect_agree(out, peers[1], LOCKSTEP_STATUS_PEER_CONNECTION_LOST, false);
  out = h.send(peers[0], p::VoteAgree{false});
  out = h.send(peers[1], p::VoteAgree{true});
  expect_agree(out, peers[0], LOCKSTEP_OK, false);
  expect_agree(out, peers[1], LOCKSTEP_OK, false);
}

TEST(CoordinatorAgree, LossInAnotherGroupDoesNotFailTheRound) {
  Harness h;
  const FakePeer a = h.first(1);
  const FakePeer b = h.join(1);
  const FakePeer c = h.join(2);
  h.update({a}, {b, c});
  h.send(a, p::VoteAgree{true});
  h.disconnect(c);
  Outbox out = h.send(b, p::VoteAgree{true});
  expect_agree(out, a, LOCKSTEP_OK, true);
  expect_agree(out, b, LOCKSTEP_OK, true);
}

TEST(CoordinatorAgree, ProtocolViolationOfAParticipantFailsTheRound) {
  Harness h;
  const auto peers = h.run_of(3);
  h.send(peers[0], p::VoteAgree{true});
  h.send(peers[1], p::VoteAgree{true});
  Outbox out = h.send(peers[2], p::Welcome{});
  expect_goodbye(out, peers[2], LOCKSTEP_STATUS_PROTOCOL_ERROR);
  expect_agree(out, peers[0], LOCKSTEP_STATUS_PEER_CONNECTION_LOST, false);
  expect_agree(out, peers[1], LOCKSTEP_STATUS_PEER_CONNECTION_LOST, false);
}

// ---------------------------------------------------------------- mismatch

TEST(CoordinatorMismatch, AgreeAgainstPendingFailsBoth) {
  Harness h;
  const auto peers = h.run_of(2);
  h.send(peers[0], p::VoteAgree{true});
  Outbox out = h.send(peers[1], p::VotePeersPending{});
  expect_agree(out, peers[0], LOCKSTEP_STATUS_OPERATION_MISMATCH, false);
  expect_pending(out, peers[1], LOCKSTEP_STATUS_OPERATION_MISMATCH, false);
  EXPECT_EQ(send_count(out), 2u);
  EXPECT_FALSE(h.peer(peers[0])->agree_flag.has_value());
  EXPECT_FALSE(h.peer(peers[1])->voted_pending);
  // both retry the same operation and it works
  h.send(peers[0], p::VotePeersPending{});
  out = h.send(peers[1], p::VotePeersPending{});
  expect_pending(out, peers[0], LOCKSTEP_OK, false);
  expect_pending(out, peers[1], LOCKSTEP_OK, false);
}

TEST(CoordinatorMismatch, TopologyAgainstAgreeFailsBoth) {
  Harness h;
  const auto peers = h.run_of(2);
  const FakePeer n = h.join(1);
  h.send(peers[0], p::VoteUpdateTopology{});
  Outbox out = h.send(peers[1], p::VoteAgree{false});
  expect_topology_failed(out, peers[0], LOCKSTEP_STATUS_OPERATION_MISMATCH);
  expect_agree(out, peers[1], LOCKSTEP_STATUS_OPERATION_MISMATCH, false);
  EXPECT_TRUE(sent_to(out, n.conn).empty());
  EXPECT_EQ(h.c.topology_phase(), TopologyPhase::kIdle);
  EXPECT_EQ(h.state(peers[0]), PeerState::kIdle);
  h.update(peers, {n});
}

TEST(CoordinatorMismatch, WaitsUntilEveryAcceptedPeerIsBlocked) {
  Harness h;
  const auto peers = h.run_of(3);
  h.send(peers[0], p::VoteAgree{true});
  Outbox out = h.send(peers[1], p::VotePeersPending{});
  EXPECT_EQ(send_count(out), 0u) << "peers[2] may still join either vote";
  out = h.send(peers[2], p::VoteUpdateTopology{});
  expect_agree(out, peers[0], LOCKSTEP_STATUS_OPERATION_MISMATCH, false);
  expect_pending(out, peers[1], LOCKSTEP_STATUS_OPERATION_MISMATCH, false);
  expect_topology_failed(out, peers[2], LOCKSTEP_STATUS_OPERATION_MISMATCH);
}

TEST(CoordinatorMismatch, MismatchFoundWhenTheLastFreePeerLeaves) {
  Harness h;
  const auto peers = h.run_of(3);
  h.send(peers[0], p::VoteAgree{true});
  h.send(peers[1], p::VotePeersPending{});
  Outbox out = h.disconnect(peers[2]);
  // the agree round lost a participant, so it fails either way; the pending vote is a mismatch
  const auto agree = one_of<p::AgreeResult>(out, peers[0].conn);
  ASSERT_TRUE(agree.has_value()) << describe(out);
  EXPECT_NE(agree->status, LOCKSTEP_OK);
  expect_pending(out, peers[1], LOCKSTEP_STATUS_OPERATION_MISMATCH, false);
}

// ---------------------------------------------------------------- vote timeout

TEST(CoordinatorVoteTimeout, OffMeansVotesWaitForever) {
  Harness h;  // vote_timeout_ms = 0
  const auto peers = h.run_of(3);
  h.send(peers[0], p::VoteAgree{true});
  h.send(peers[1], p::VoteUpdateTopology{});
  for (int i = 0; i < 50; ++i) {
    h.heartbeat(peers);
    Outbox out = h.advance(4'000);
    EXPECT_EQ(send_count(out), 0u) << describe(out);
  }
  EXPECT_EQ(h.c.accepted_count(), 3u);
  EXPECT_TRUE(h.peer(peers[0])->agree_flag.has_value());
}

TEST(CoordinatorVoteTimeout, AgreeStragglerIsKickedAndTheOthersDecide) {
  Config config = test_config();
  config.vote_timeout_ms = 3'000;
  Harness h(config);
  const auto peers = h.run_of(3);
  h.send(peers[0], p::VoteAgree{true});
  h.now += 1'000;
  h.send(peers[1], p::VoteAgree{true});
  h.now += 1'999;
  h.heartbeat(peers);
  Outbox out = h.tick();
  EXPECT_EQ(send_count(out), 0u) << describe(out);
  h.now += 1;
  out = h.tick();
  expect_goodbye(out, peers[2], LOCKSTEP_STATUS_KICKED);
  EXPECT_TRUE(h.gone(peers[2]));
  // removed as a straggler, so the round does not fail
  expect_agree(out, peers[0], LOCKSTEP_OK, true);
  expect_agree(out, peers[1], LOCKSTEP_OK, true);
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{peers[0].id, peers[1].id}));
}

TEST(CoordinatorVoteTimeout, TopologyStragglerIsKickedAndTheUpdateGoesOn) {
  Config config = test_config();
  config.vote_timeout_ms = 1'000;
  Harness h(config);
  const auto peers = h.run_of(3);
  const FakePeer n = h.join(1);
  h.vote_topology({peers[0], peers[1]});
  h.now += 1'000;
  h.heartbeat({peers[0], peers[1], peers[2], n});
  Outbox out = h.tick();
  expect_goodbye(out, peers[2], LOCKSTEP_STATUS_KICKED);
  for (const auto& f : {peers[0], peers[1], n}) EXPECT_TRUE(one_of<p::EstablishP2P>(out, f.conn).has_value());
  EXPECT_TRUE(all_of<p::EstablishP2P>(out, peers[2].conn).empty());
  h.report_all({peers[0], peers[1], n});
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{peers[0].id, peers[1].id, n.id}));
}

TEST(CoordinatorVoteTimeout, PendingStragglerIsKicked) {
  Config config = test_config();
  config.vote_timeout_ms = 1'000;
  Harness h(config);
  const auto peers = h.run_of(2);
  h.send(peers[0], p::VotePeersPending{});
  h.now += 1'000;
  h.heartbeat(peers);
  Outbox out = h.tick();
  expect_goodbye(out, peers[1], LOCKSTEP_STATUS_KICKED);
  expect_pending(out, peers[0], LOCKSTEP_OK, true);  // a peer left
}

TEST(CoordinatorVoteTimeout, NoOpenVoteNoKick) {
  Config config = test_config();
  config.vote_timeout_ms = 500;
  Harness h(config);
  const auto peers = h.run_of(3);
  for (int i = 0; i < 20; ++i) {
    h.heartbeat(peers);
    Outbox out = h.advance(1'000);
    EXPECT_EQ(send_count(out), 0u) << describe(out);
  }
  EXPECT_EQ(h.c.accepted_count(), 3u);
}

// A vote whose every voter is gone is no longer waited for by anyone: the vote
// timeout must not remove the remaining peers for "not joining" it, above all not
// while they are in a p2p establishment, where joining a vote is refused.
TEST(CoordinatorVoteTimeout, AbandonedAgreeRoundKicksNobodyDuringEstablishment) {
  Config config = test_config();
  config.vote_timeout_ms = 1'000;
  Harness h(config);
  const auto peers = h.run_of(2);
  const FakePeer n = h.join(1);
  h.send(peers[0], p::VoteAgree{true});
  h.disconnect(peers[0]);  // the only voter is gone
  // peers[1] now updates the topology (legal: it is idle and in no vote)
  Outbox out = h.send(peers[1], p::VoteUpdateTopology{});
  ASSERT_TRUE(one_of<p::EstablishP2P>(out, peers[1].conn).has_value()) << describe(out);
  h.now += 1'500;
  h.heartbeat({peers[1], n});
  out = h.tick();
  EXPECT_TRUE(all_of<p::Goodbye>(out, peers[1].conn).empty())
      << "a peer in ESTABLISHING_P2P was kicked for not joining an agree vote that it may not join:\n"
      << describe(out);
  EXPECT_FALSE(h.gone(peers[1]));
}

TEST(CoordinatorVoteTimeout, AbandonedPendingRoundKicksNobody) {
  Config config = test_config();
  config.vote_timeout_ms = 1'000;
  Harness h(config);
  const auto peers = h.run_of(3);
  h.send(peers[0], p::VotePeersPending{});
  h.disconnect(peers[0]);  // the only voter is gone; nobody waits in this vote
  h.now += 1'500;
  h.heartbeat({peers[1], peers[2]});
  Outbox out = h.tick();
  EXPECT_EQ(close_count(out), 0u) << "the survivors were kicked from a vote no live peer waits in:\n" << describe(out);
  EXPECT_EQ(h.c.accepted_count(), 2u);
}

TEST(CoordinatorVoteTimeout, AbandonedTopologyVoteKicksNobody) {
  Config config = test_config();
  config.vote_timeout_ms = 1'000;
  Harness h(config);
  const auto peers = h.run_of(3);
  h.send(peers[0], p::VoteUpdateTopology{});
  h.disconnect(peers[0]);  // the only voter is gone
  h.now += 1'500;
  h.heartbeat({peers[1], peers[2]});
  Outbox out = h.tick();
  EXPECT_EQ(close_count(out), 0u) << "the survivors were kicked from a vote no live peer waits in:\n" << describe(out);
  EXPECT_EQ(h.c.accepted_count(), 2u);
}

// Rule 1 removes stragglers "so that the others can decide without them". A peer
// blocked in a different vote is not a straggler: once the real straggler is gone the
// mismatch is detected and every vote fails with OPERATION_MISMATCH.
TEST(CoordinatorVoteTimeout, PeersWaitingInAnotherVoteAreNotStragglers) {
  Config config = test_config();
  config.vote_timeout_ms = 1'000;
  Harness h(config);
  const auto peers = h.run_of(3);
  const FakePeer n = h.join(1);
  h.send(peers[0], p::VoteUpdateTopology{});
  h.send(peers[1], p::VotePeersPending{});
  h.now += 1'000;
  h.heartbeat({peers[0], peers[1], peers[2], n});
  Outbox out = h.tick();
  expect_goodbye(out, peers[2], LOCKSTEP_STATUS_KICKED);
  EXPECT_FALSE(h.gone(peers[0])) << describe(out);
  EXPECT_FALSE(h.gone(peers[1])) << describe(out);
  EXPECT_EQ(h.c.accepted_count(), 2u) << describe(out);
}

// ---------------------------------------------------------------- heartbeats

TEST(CoordinatorHeartbeat, HeartbeatIsAnsweredAndChangesNothing) {
  Harness h;
  const FakePeer a = h.first(1);
  const FakePeer n = h.join(1);
  for (const auto& f : {a, n}) {
    const std::string before = h.c.digest();
    Outbox out = h.send(f, p::Heartbeat{});
    EXPECT_EQ(send_count(out), 1u);
    EXPECT_TRUE(one_of<p::HeartbeatAck>(out, f.conn).has_value());
    EXPECT_EQ(h.c.digest(), before);
  }
}

TEST(CoordinatorHeartbeat, SilentPeerIsKickedButNotOneThatSentInTime) {
  Harness h;
  const auto peers = h.run_of(3);
  const FakePeer n = h.join(1);
  const TimeMs timeout = h.c.config().heartbeat_timeout_ms;
  h.now += timeout - 10;
  h.heartbeat({peers[0], peers[2]});
  h.send(n, p::VotePeersPending{});  // any message counts as a sign of life (this one is refused)
  h.now += 9;
  Outbox out = h.tick();
  EXPECT_EQ(close_count(out), 0u) << describe(out);
  h.now += 1;
  out = h.tick();
  expect_goodbye(out, peers[1], LOCKSTEP_STATUS_KICKED);
  EXPECT_NE(one_of<p::Goodbye>(out, peers[1].conn)->reason.find("heartbeat"), std::string::npos);
  EXPECT_EQ(close_count(out), 1u) << describe(out);
  EXPECT_TRUE(h.gone(peers[1]));
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{peers[0].id, peers[2].id}));
  // the registered peer, silent since its last message, goes one timeout after it
  h.now += timeout - 10;
  h.heartbeat({peers[0], peers[2]});
  out = h.tick();
  expect_goodbye(out, n, LOCKSTEP_STATUS_KICKED);
}

TEST(CoordinatorHeartbeat, SilentVoterFailsAnAgreeRound) {
  Harness h;
  const auto peers = h.run_of(2);
  h.send(peers[0], p::VoteAgree{true});
  h.send(peers[1], p::VoteAgree{true});  // completes
  h.send(peers[1], p::VoteAgree{true});  // a new round, waiting for peers[0]
  h.now += h.c.config().heartbeat_timeout_ms;
  h.heartbeat({peers[1]});
  Outbox out = h.tick();
  expect_goodbye(out, peers[0], LOCKSTEP_STATUS_KICKED);
  expect_agree(out, peers[1], LOCKSTEP_STATUS_PEER_CONNECTION_LOST, false);
}

// ---------------------------------------------------------------- handshake

TEST(CoordinatorHandshake, ConnectionWithoutHelloIsClosedAfterTheTimeout) {
  Harness h;
  h.connect(1, "10.0.0.1");
  EXPECT_EQ(h.c.handshaking_count(), 1u);
  Outbox out = h.advance(h.c.config().handshake_timeout_ms - 1);
  EXPECT_TRUE(out.empty()) << describe(out);
  out = h.advance(1);
  EXPECT_TRUE(closes(out, 1)) << describe(out);
  EXPECT_EQ(h.c.handshaking_count(), 0u);
  // a Hello arriving after that is ignored
  out = h.send(1, Harness::hello(1, 5000));
  EXPECT_TRUE(out.empty()) << describe(out);
  EXPECT_TRUE(h.c.peers().empty());
}

TEST(CoordinatorHandshake, PendingHandshakesAreCappedAndTheOldestOfTheBusiestHostMakesRoom) {
  Config config = test_config();
  config.pending_handshakes_max = 3;
  Harness h(config);
  // Two idle connections from a flooding host, then one from a newcomer's host.
  EXPECT_TRUE(h.connect(1, "10.0.0.66").empty());
  h.advance(10);
  EXPECT_TRUE(h.connect(2, "10.0.0.66").empty());
  h.advance(10);
  EXPECT_TRUE(h.connect(3, "10.0.0.5").empty());
  h.advance(10);
  // At the cap: the flooder's oldest connection is closed, not the new one.
  Outbox out = h.connect(4, "10.0.0.66");
  EXPECT_TRUE(closes(out, 1)) << describe(out);
  EXPECT_FALSE(closes(out, 3)) << describe(out);
  EXPECT_FALSE(closes(out, 4)) << describe(out);
  EXPECT_EQ(h.c.handshaking_count(), 3u);
  // Then conn 2 (the flooder's oldest), still not the newcomer.
  out = h.connect(5, "10.0.0.66");
  EXPECT_TRUE(closes(out, 2)) << describe(out);
  EXPECT_FALSE(closes(out, 3)) << describe(out);
  // The newcomer finishes its handshake and is registered.
  out = h.send(3, Harness::hello(1, 5000));
  EXPECT_EQ(all_of<p::Welcome>(out, 3).size(), 1u) << describe(out);
  EXPECT_EQ(h.c.handshaking_count(), 2u);
  // Between hosts with equally many, the oldest goes.
  EXPECT_TRUE(h.connect(6, "10.0.0.7").empty());
  out = h.connect(7, "10.0.0.8");
  EXPECT_TRUE(closes(out, 4)) << describe(out);
  EXPECT_EQ(h.c.handshaking_count(), 3u);
}

TEST(CoordinatorHandshake, PeersMaxRejects) {
  Config config = test_config();
  config.peers_max = 2;
  Harness h(config);
  const FakePeer a = h.first(1);
  const FakePeer b = h.join(1);
  h.connect(10, "10.0.0.10");
  Outbox out = h.send(10, Harness::hello(1, 5000));
  auto goodbye = one_of<p::Goodbye>(out, 10);
  ASSERT_TRUE(goodbye.has_value());
  EXPECT_EQ(goodbye->status, LOCKSTEP_STATUS_REJECTED);
  EXPECT_NE(goodbye->reason.find("maximum"), std::string::npos) << goodbye->reason;
  EXPECT_TRUE(closes(out, 10));
  EXPECT_TRUE(all_of<p::Welcome>(out, 10).empty());
  EXPECT_EQ(h.c.peers().size(), 2u);
  // room again after a peer leaves
  h.disconnect(b);
  h.join(1);
  EXPECT_EQ(h.c.peers().size(), 2u);
  (void)a;
}

TEST(CoordinatorHandshake, LoopbackAndRemoteAddressesAreNotMixed) {
  {
    Harness h;
    h.first(1, "127.0.0.1");
    h.connect(20, "10.1.1.1");
    Outbox out = h.send(20, Harness::hello(1, 5000));
    auto goodbye = one_of<p::Goodbye>(out, 20);
    ASSERT_TRUE(goodbye.has_value());
    EXPECT_EQ(goodbye->status, LOCKSTEP_STATUS_REJECTED);
    EXPECT_NE(goodbye->reason.find("loopback"), std::string::npos) << goodbye->reason;
    EXPECT_NE(goodbye->reason.find("10.1.1.1"), std::string::npos) << goodbye->reason;
    EXPECT_TRUE(closes(out, 20));
    // another loopback peer is fine; the address the others will use decides, so a
    // peer seen remotely that advertises a loopback address joins a loopback run
    h.join(1, nullptr, "127.0.0.2");
    h.connect(21, "10.1.1.2");
    out = h.send(21, Harness::hello(1, 5000, "127.0.0.1"));
    EXPECT_TRUE(one_of<p::Welcome>(out, 21).has_value()) << describe(out);
  }
  {
    Harness h;
    h.first(1, "10.1.1.1");
    h.connect(20, "127.0.0.1");
    Outbox out = h.send(20, Harness::hello(1, 5000));
    auto goodbye = one_of<p::Goodbye>(out, 20);
    ASSERT_TRUE(goodbye.has_value());
    EXPECT_EQ(goodbye->status, LOCKSTEP_STATUS_REJECTED);
    EXPECT_NE(goodbye->reason.find("loopback"), std::string::npos) << goodbye->reason;
    // a peer that reaches the master over loopback but advertises a routable address is fine
    h.connect(21, "127.0.0.1");
    out = h.send(21, Harness::hello(1, 5000, "10.1.1.7"));
    EXPECT_TRUE(one_of<p::Welcome>(out, 21).has_value()) << describe(out);
  }
}

// A peer names all three of its ports, or none (it accepts no inbound connection).
TEST(CoordinatorHandshake, HelloNamingSomePortsButNotAllIsRejected) {
  for (int missing = 0; missing < 3; ++missing) {
    SCOPED_TRACE(missing);
    Harness h;
    h.connect(1, "10.0.0.1");
    p::Hello hello = Harness::hello(1, 4000);
    (missing == 0 ? hello.p2p_port : missing == 1 ? hello.shared_state_port : hello.benchmark_port) = 0;
    Outbox out = h.send(1, hello);
    auto goodbye = one_of<p::Goodbye>(out, 1);
    ASSERT_TRUE(goodbye.has_value());
    EXPECT_EQ(goodbye->status, LOCKSTEP_STATUS_REJECTED);
    EXPECT_NE(goodbye->reason.find("some of its ports but not all"), std::string::npos) << goodbye->reason;
    EXPECT_TRUE(closes(out, 1));
    EXPECT_TRUE(h.c.peers().empty());
    EXPECT_EQ(h.c.handshaking_count(), 0u);
  }
  Harness h;
  h.no_ports = true;
  const FakePeer a = h.first(1);
  EXPECT_EQ(h.phase(a), Phase::kAccepted);
}

// A ring edge needs one end that accepts inbound connections: newcomers that accept
// none go between two peers that do, and one that does goes between two that do not.
TEST(CoordinatorAdmission, NewcomersArePlacedSoThatEveryRingEdgeCanBeMade) {
  Harness h;
  const FakePeer a = h.first(1);
  const FakePeer c = h.join_as(1, false);
  const FakePeer d = h.join_as(1, false);  // at the end, c and d would be neighbours
  const FakePeer b = h.join_as(1, true);
  Outbox out = h.send(a, p::VoteUpdateTopology{});
  const auto est = one_of<p::EstablishP2P>(out, a.conn);
  ASSERT_TRUE(est.has_value());
  EXPECT_EQ(ids_of(est->ring), (std::vector<PeerId>{a.id, c.id, b.id, d.id}));
  for (const auto& m : est->ring) {
    const bool none = m.id == c.id || m.id == d.id;
    EXPECT_EQ(m.p2p_port == 0 && m.shared_state_port == 0 && m.benchmark_port == 0, none);
  }
  // Another that accepts none has no place left (two of four accept connections): it is
  // rejected, saying why, instead of being placed where its edges cannot be made.
  h.report_all({a, b, c, d});
  const FakePeer e = h.join_as(1, false);
  out = h.send(a, p::VoteUpdateTopology{});
  for (const auto& v : {b, c, d}) out = h.send(v, p::VoteUpdateTopology{});
  expect_goodbye(out, e, LOCKSTEP_STATUS_REJECTED);
  EXPECT_NE(describe(out).find("no place in the ring of group 1"), std::string::npos) << describe(out);
  EXPECT_EQ(h.c.find_peer(e.id), nullptr);
  h.report_all({a, b, c, d});
  // With one more that accepts connections in the same update, there is room again.
  const FakePeer f = h.join_as(1, false);
  const FakePeer g = h.join_as(1, true);
  out = h.send(a, p::VoteUpdateTopology{});
  for (const auto& v : {b, c, d}) out = h.send(v, p::VoteUpdateTopology{});
  const auto next = one_of<p::EstablishP2P>(out, f.conn);
  ASSERT_TRUE(next.has_value()) << describe(out);
  EXPECT_EQ(ids_of(next->ring), (std::vector<PeerId>{a.id, c.id, b.id, d.id, g.id, f.id}));
}

// A removal that leaves two peers that accept no inbound connection side by side: their
// edge cannot be made, so the one that joined later leaves at once (every collective of
// the group would fail on that edge until an update topology) and may join again.
TEST(CoordinatorAdmission, UnreachableNeighboursAfterARemovalLoseTheLaterOne) {
  Harness h;
  const FakePeer a = h.first(1);
  const FakePeer c = h.join_as(1, false);
  const FakePeer b = h.join_as(1, true);
  const FakePeer d = h.join_as(1, false);
  const FakePeer e = h.join_as(1, true);
  h.update({a}, {c, b, d, e});
  ASSERT_EQ(h.c.ring(1), (std::vector<PeerId>{a.id, c.id, b.id, d.id, e.id}));
  Outbox out = h.disconnect(b);  // c and d are neighbours now
  expect_goodbye(out, d, LOCKSTEP_STATUS_KICKED);
  EXPECT_NE(describe(out).find("their ring edge cannot be made"), std::string::npos) << describe(out);
  EXPECT_EQ(h.c.find_peer(d.id), nullptr);
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{a.id, c.id, e.id}));
  // It joins again, and is placed between two that accept connections.
  const FakePeer d2 = h.join_as(1, false);
  for (const auto& v : {a, c, e}) out = h.send(v, p::VoteUpdateTopology{});
  const auto est = one_of<p::EstablishP2P>(out, d2.conn);
  ASSERT_TRUE(est.has_value()) << describe(out);
  EXPECT_EQ(ids_of(est->ring), (std::vector<PeerId>{a.id, c.id, e.id, d2.id}));
}

// With a relay (lockstep-master --relay-port) two peers that accept no inbound connection
// may be neighbours: their edge runs through it. Nobody is rejected for want of room or
// removed for such a neighbour, and the relay may connect exactly those peers, per group.
// A run with a relay: a (reachable) first, then c, d, e (accepting no inbound connection;
// without a relay there would be no room for e) and b (reachable): the ring a c b d e.
Config relay_config() {
  Config config = test_config();
  config.relay = true;
  return config;
}
struct RelayRing {
  FakePeer a, c, d, e, b;
};
RelayRing relay_ring(Harness& h) {
  RelayRing r{h.first(1), h.join_as(1, false), h.join_as(1, false), h.join_as(1, false), h.join_as(1, true)};
  h.update({r.a}, {r.c, r.d, r.e, r.b});
  return r;
}

TEST(CoordinatorAdmission, WithARelayUnreachableNeighboursAreKeptAndAssignedToIt) {
  Harness h(relay_config());
  const auto [a, c, d, e, b] = relay_ring(h);
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{a.id, c.id, b.id, d.id, e.id}));
  h.check();
  const FakePeer x = h.join_as(2, false);  // another group's: never relayed to group 1's
  EXPECT_EQ(h.c.relay_members(), (std::map<PeerId, std::uint32_t>{{c.id, 1}, {d.id, 1}, {e.id, 1}}));
  Outbox out = h.disconnect(b);  // c and d are neighbours now, as d and e were
  EXPECT_EQ(describe(out).find("Goodbye"), std::string::npos) << describe(out);
  EXPECT_EQ(h.phase(d), Phase::kAccepted);
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{a.id, c.id, d.id, e.id}));
  h.check();
  EXPECT_EQ(h.c.relay_members(), (std::map<PeerId, std::uint32_t>{{c.id, 1}, {d.id, 1}, {e.id, 1}}));
  out = h.disconnect(d);
  EXPECT_EQ(h.c.relay_members(), (std::map<PeerId, std::uint32_t>{{c.id, 1}, {e.id, 1}}));
  (void)x;
}

// lockstep-relay processes come and go: losing the run's last relay parts every two ring
// neighbours that both accept no inbound connection (the later one is KICKED) and fails
// an establishment that proposed such neighbours; gaining one changes nobody's place.
TEST(CoordinatorAdmission, LosingTheLastRelayPartsUnreachableNeighbours) {
  Harness h(relay_config());
  const auto [a, c, d, e, b] = relay_ring(h);
  ASSERT_EQ(h.c.ring(1), (std::vector<PeerId>{a.id, c.id, b.id, d.id, e.id}));
  Outbox out;
  h.c.on_relay_change(true, h.now, out);  // no change
  EXPECT_TRUE(out.empty()) << describe(out);
  h.c.on_relay_change(false, h.now, out);
  EXPECT_FALSE(h.c.relay());
  expect_goodbye(out, e, LOCKSTEP_STATUS_KICKED);  // d and e were neighbours; e joined later
  EXPECT_NE(describe(out).find("lost its relay"), std::string::npos) << describe(out);
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{a.id, c.id, b.id, d.id}));
  EXPECT_TRUE(h.c.relay_members().empty());
  h.check();
  // Without a relay a newcomer that accepts no connection needs room again: none is left.
  h.c.on_relay_change(true, h.now, out);
  EXPECT_TRUE(h.c.relay());
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{a.id, c.id, b.id, d.id}));
}

// An establishment whose relayed edges were being made fails when the run loses its
// relay, and also when another relay takes over (those edges were being made through
// the one that is gone); nobody is blamed, the newcomer waits for the next vote.
TEST(CoordinatorAdmission, ARelayLostOrReplacedFailsAnEstablishmentThatNeedsIt) {
  for (const bool takeover : {false, true}) {
    SCOPED_TRACE(takeover ? "another relay takes over" : "the last relay is lost");
    Harness h(relay_config());
    const FakePeer a = h.first(1);
    const FakePeer c = h.join_as(1, false);
    h.update({a}, {c});
    const FakePeer d = h.join_as(1, false);  // its place is next to c: a relayed edge
    Outbox out = h.vote_topology({a, c});
    ASSERT_TRUE(one_of<p::EstablishP2P>(out, d.conn).has_value()) << describe(out);
    out.clear();
    h.c.on_relay_change(takeover, h.now, out);
    const std::string why = takeover ? "relay in use changed" : "lost its relay";
    for (const FakePeer* f : {&a, &c}) {
      const auto r = one_of<p::TopologyResult>(out, f->conn);
      ASSERT_TRUE(r.has_value()) << describe(out);
      EXPECT_EQ(r->status, LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
      EXPECT_NE(r->reason.find(why), std::string::npos) << r->reason;
    }
    EXPECT_EQ(describe(out).find("Goodbye"), std::string::npos) << describe(out);
    EXPECT_EQ(h.phase(d), Phase::kRegistered);
    EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{a.id, c.id}));
    h.check();
  }
}

TEST(CoordinatorHandshake, FirstMessageOtherThanHelloIsAProtocolError) {
  const std::vector<p::Message> not_hello = {p::Heartbeat{}, p::VoteUpdateTopology{}, p::VoteAgree{true},
                                             p::P2PReport{1, {}}, p::Welcome{}, p::P2PHello{}, p::Goodbye{}};
  for (const auto& m : not_hello) {
    Harness h;
    h.connect(1, "10.0.0.1");
    Outbox out = h.send(1, m);
    auto goodbye = one_of<p::Goodbye>(out, 1);
    ASSERT_TRUE(goodbye.has_value()) << describe(m);
    EXPECT_EQ(goodbye->status, LOCKSTEP_STATUS_PROTOCOL_ERROR);
    EXPECT_NE(goodbye->reason.find("Hello"), std::string::npos) << goodbye->reason;
    EXPECT_TRUE(closes(out, 1));
    EXPECT_EQ(h.c.handshaking_count(), 0u);
    EXPECT_TRUE(h.c.peers().empty());
  }
}

TEST(CoordinatorHandshake, ProtocolErrorDuringTheHandshake) {
  Harness h;
  h.connect(1, "10.0.0.1");
  Outbox out = h.protocol_error(1);
  auto goodbye = one_of<p::Goodbye>(out, 1);
  ASSERT_TRUE(goodbye.has_value());
  EXPECT_EQ(goodbye->status, LOCKSTEP_STATUS_PROTOCOL_ERROR);
  EXPECT_TRUE(closes(out, 1));
  EXPECT_EQ(h.c.handshaking_count(), 0u);
}

TEST(CoordinatorHandshake, DisconnectDuringTheHandshake) {
  Harness h;
  h.connect(1, "10.0.0.1");
  Outbox out = h.disconnect(1);
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(h.c.handshaking_count(), 0u);
}

TEST(CoordinatorProtocolError, PeerIsRemovedWithAGoodbye) {
  Harness h;
  const auto peers = h.run_of(2);
  const FakePeer n = h.join(1);
  for (const auto& f : {n, peers[1]}) {
    Outbox out = h.protocol_error(f.conn);
    expect_goodbye(out, f, LOCKSTEP_STATUS_PROTOCOL_ERROR);
    EXPECT_TRUE(h.gone(f));
  }
  EXPECT_EQ(h.c.ring(1), std::vector<PeerId>{peers[0].id});
}

TEST(CoordinatorProtocolError, MessagesAPeerMustNeverSendRemoveIt) {
  const std::vector<p::Message> forbidden = {
      p::Hello{},          p::Welcome{},       p::HeartbeatAck{}, p::EstablishP2P{}, p::TopologyResult{},
      p::PeersPendingResult{}, p::AgreeResult{}, p::Refused{},      p::Goodbye{},      p::P2PHello{},
      p::P2PHelloAck{},    p::CollectiveGo{},  p::CollectiveResult{}, p::SyncPlan{}, p::SyncResult{},
      p::StateRequest{},   p::StateResponse{},     p::BandwidthTest{}};
  for (const auto& m : forbidden) {
    for (bool accepted : {true, false}) {
      SCOPED_TRACE(describe(m) + (accepted ? " from an accepted peer" : " from a registered peer"));
      Harness h;
      const auto peers = h.run_of(2);
      const FakePeer n = h.join(1);
      const FakePeer& sender = accepted ? peers[1] : n;
      Outbox out = h.send(sender, m);
      expect_goodbye(out, sender, LOCKSTEP_STATUS_PROTOCOL_ERROR);
      EXPECT_TRUE(h.gone(sender));
      EXPECT_TRUE(sent_to(out, peers[0].conn).empty()) << describe(out);
      EXPECT_EQ(h.c.ring(1).size(), accepted ? 1u : 2u);
      EXPECT_EQ(close_count(out), 1u);
    }
  }
}

// ---------------------------------------------------------------- illegal requests

enum class Where {
  kRegistered,
  kAcceptedIdle,
  kInTopologyVote,
  kInPendingVote,
  kInAgreeVote,
  kEstablishingAccepted,
  kReportedAccepted,
  kEstablishingNewcomer,
  kReportedNewcomer,
};

const char* name(Where w) {
  switch (w) {
    case Where::kRegistered: return "registered";
    case Where::kAcceptedIdle: return "accepted idle";
    case Where::kInTopologyVote: return "in the topology vote";
    case Where::kInPendingVote: return "in the pending vote";
    case Where::kInAgreeVote: return "in an agree vote";
    case Where::kEstablishingAccepted: return "accepted, establishing";
    case Where::kReportedAccepted: return "accepted, reported";
    case Where::kEstablishingNewcomer: return "newcomer, establishing";
    case Where::kReportedNewcomer: return "newcomer, reported";
  }
  return "?";
}

enum class Request { kVoteTopology, kVotePending, kVoteAgree, kReportRightEpoch, kReportWrongEpoch, kReportOldEpoch, kHeartbeat };

const char* name(Request r) {
  switch (r) {
    case Request::kVoteTopology: return "VoteUpdateTopology";
    case Request::kVotePending: return "VotePeersPending";
    case Request::kVoteAgree: return "VoteAgree";
    case Request::kReportRightEpoch: return "P2PReport(current epoch)";
    case Request::kReportWrongEpoch: return "P2PReport(next epoch)";
    case Request::kReportOldEpoch: return "P2PReport(previous epoch)";
    case Request::kHeartbeat: return "Heartbeat";
  }
  return "?";
}

struct Scene {
  Harness h;
  std::vector<FakePeer> accepted;  // three accepted peers
  FakePeer newcomer;
  FakePeer requester;
};

// Builds the state: three accepted peers in group 1 and one registered newcomer;
// the requester is accepted[0] or the newcomer.
void build(Scene& s, Where where) {
  s.accepted = s.h.run_of(3);
  s.newcomer = s.h.join(1);
  s.requester = s.accepted[0];
  switch (where) {
    case Where::kRegistered: s.requester = s.newcomer; break;
    case Where::kAcceptedIdle: break;
    case Where::kInTopologyVote: s.h.send(s.accepted[0], p::VoteUpdateTopology{}); break;
    case Where::kInPendingVote: s.h.send(s.accepted[0], p::VotePeersPending{}); break;
    case Where::kInAgreeVote: s.h.send(s.accepted[0], p::VoteAgree{false}); break;
    case Where::kEstablishingAccepted:
    case Where::kReportedAccepted:
    case Where::kEstablishingNewcomer:
    case Where::kReportedNewcomer:
      s.h.vote_topology(s.accepted);
      ASSERT_EQ(s.h.c.topology_phase(), TopologyPhase::kEstablishing);
      if (where == Where::kEstablishingNewcomer || where == Where::kReportedNewcomer) s.requester = s.newcomer;
      if (where == Where::kReportedAccepted || where == Where::kReportedNewcomer) {
        s.h.send(s.requester, p::P2PReport{s.h.c.epoch(), {}});
      }
      break;
  }
}

p::Message make(Request r, const Coordinator& c) {
  switch (r) {
    case Request::kVoteTopology: return p::VoteUpdateTopology{};
    case Request::kVotePending: return p::VotePeersPending{};
    case Request::kVoteAgree: return p::VoteAgree{true};
    case Request::kReportRightEpoch: return p::P2PReport{c.epoch(), {}};
    case Request::kReportWrongEpoch: return p::P2PReport{c.epoch() + 1, {}};
    case Request::kReportOldEpoch: return p::P2PReport{c.epoch() - 1, {}};
    case Request::kHeartbeat: return p::Heartbeat{};
  }
  return p::Heartbeat{};
}

struct Expectation {
  enum Kind { kLegal, kRefused, kAck, kIgnored } kind;
  StatusCode status = LOCKSTEP_OK;
};

Expectation expected(Where where, Request request) {
  if (request == Request::kHeartbeat) return {Expectation::kAck};
  const bool is_vote = request == Request::kVoteTopology || request == Request::kVotePending || request == Request::kVoteAgree;
  const bool registered = where == Where::kRegistered || where == Where::kEstablishingNewcomer || where == Where::kReportedNewcomer;
  if (is_vote) {
    if (registered) return {Expectation::kRefused, LOCKSTEP_STATUS_NOT_INITIALIZED};
    if (where == Where::kAcceptedIdle) return {Expectation::kLegal};
    return {Expectation::kRefused, LOCKSTEP_STATUS_INVALID_USAGE};
  }
  // Reports: of the current establishment once; a report of no current establishment
  // (one that ended while the peer was still connecting) is ignored without an answer.
  const bool waiting_for_report = where == Where::kEstablishingAccepted || where == Where::kEstablishingNewcomer;
  const bool reported = where == Where::kReportedAccepted || where == Where::kReportedNewcomer;
  if (request == Request::kReportRightEpoch && waiting_for_report) return {Expectation::kLegal};
  if (request == Request::kReportRightEpoch && reported) return {Expectation::kRefused, LOCKSTEP_STATUS_INVALID_USAGE};
  return {Expectation::kIgnored};
}

// What a legal request must have changed.
void check_legal_effect(const Scene& s, Request request) {
  const Peer* peer = s.h.peer(s.requester);
  ASSERT_NE(peer, nullptr);
  switch (request) {
    case Request::kVoteTopology:
      EXPECT_EQ(peer->state, PeerState::kVoteAcceptNewPeers);
      EXPECT_EQ(s.h.c.topology_phase(), TopologyPhase::kVoting);
      break;
    case Request::kVotePending: EXPECT_TRUE(peer->voted_pending); break;
    case Request::kVoteAgree:
      ASSERT_TRUE(peer->agree_flag.has_value());
      EXPECT_TRUE(*peer->agree_flag);
      break;
    case Request::kReportRightEpoch:
      EXPECT_TRUE(peer->p2p_reported);
      EXPECT_EQ(peer->state, PeerState::kEstablishingP2P);
      break;
    default: ADD_FAILURE() << "not a legal request here"; break;
  }
}

TEST(CoordinatorIllegalRequests, EveryRequestInEveryState) {
  const std::vector<Where> states = {Where::kRegistered,          Where::kAcceptedIdle,      Where::kInTopologyVote,
                                     Where::kInPendingVote,       Where::kInAgreeVote,       Where::kEstablishingAccepted,
                                     Where::kReportedAccepted,    Where::kEstablishingNewcomer, Where::kReportedNewcomer};
  const std::vector<Request> requests = {Request::kVoteTopology,     Request::kVotePending,      Request::kVoteAgree,
                                         Request::kReportRightEpoch, Request::kReportWrongEpoch, Request::kReportOldEpoch,
                                         Request::kHeartbeat};
  int refused = 0;
  int legal = 0;
  int ignored = 0;
  for (Where where : states) {
    for (Request request : requests) {
      SCOPED_TRACE(std::string(name(request)) + " from a peer " + name(where));
      Scene s;
      ASSERT_NO_FATAL_FAILURE(build(s, where));
      const std::string before = s.h.c.digest();
      const p::Message message = make(request, s.h.c);
      Outbox out = s.h.send(s.requester, message);
      const Expectation want = expected(where, request);
      switch (want.kind) {
        case Expectation::kAck:
          EXPECT_EQ(send_count(out), 1u) << describe(out);
          EXPECT_TRUE(one_of<p::HeartbeatAck>(out, s.requester.conn).has_value());
          EXPECT_EQ(s.h.c.digest(), before);
          break;
        case Expectation::kIgnored:
          ++ignored;
          EXPECT_EQ(send_count(out), 0u) << describe(out);
          EXPECT_EQ(close_count(out), 0u) << describe(out);
          EXPECT_EQ(s.h.c.digest(), before) << "an ignored report changed the state";
          break;
        case Expectation::kRefused: {
          ++refused;
          EXPECT_EQ(send_count(out), 1u) << describe(out);
          EXPECT_EQ(close_count(out), 0u) << describe(out);
          const auto r = one_of<p::Refused>(out, s.requester.conn);
          ASSERT_TRUE(r.has_value());
          EXPECT_EQ(r->request, p::type_of(message));
          EXPECT_EQ(r->status, want.status) << r->reason;
          EXPECT_FALSE(r->reason.empty());
          EXPECT_EQ(s.h.c.digest(), before) << "a refused request changed the state";
          break;
        }
        case Expectation::kLegal:
          ++legal;
          EXPECT_EQ(send_count(out), 0u) << describe(out);
          EXPECT_NE(s.h.c.digest(), before);
          check_legal_effect(s, request);
          break;
      }
      // whatever happened, the run still works: the requester stays, nobody was closed
      EXPECT_FALSE(s.h.gone(s.requester));
    }
  }
  EXPECT_EQ(legal, 5);
  EXPECT_EQ(refused, 26);
  EXPECT_EQ(ignored, 23);
}

// A refusal keeps the requester's vote: the vote it joined completes normally.
TEST(CoordinatorIllegalRequests, RefusalKeepsTheOpenVote) {
  Harness h;
  const auto peers = h.run_of(2);
  h.send(peers[0], p::VoteAgree{true});
  Outbox out = h.send(peers[0], p::VoteAgree{false});
  ASSERT_TRUE(one_of<p::Refused>(out, peers[0].conn).has_value());
  out = h.send(peers[0], p::VoteUpdateTopology{});
  ASSERT_TRUE(one_of<p::Refused>(out, peers[0].conn).has_value());
  out = h.send(peers[1], p::VoteAgree{true});
  expect_agree(out, peers[0], LOCKSTEP_OK, true);
  expect_agree(out, peers[1], LOCKSTEP_OK, true);
}

// ---------------------------------------------------------------- collectives

// Large enough for the ring (small all-reduces travel with the votes; tests below).
const p::CollectiveDescriptor kSum{1 << 20, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE};

TEST(CoordinatorCollective, AllVoteThenAllCompleteWithOneOutcome) {
  Harness h;
  const auto peers = h.run_of(3);
  Outbox out;
  for (std::size_t i = 0; i < peers.size(); ++i) {
    out = h.send(peers[i], p::CollectiveInit{5, kSum});
    if (i + 1 < peers.size()) {
      EXPECT_EQ(send_count(out), 0u) << describe(out);
    }
  }
  std::optional<p::CollectiveGo> go;
  for (const auto& f : peers) {
    const auto g = one_of<p::CollectiveGo>(out, f.conn);
    ASSERT_TRUE(g.has_value()) << describe(out);
    if (!go) go = g;
    EXPECT_EQ(*g, *go);
  }
  EXPECT_EQ(go->tag, 5u);
  EXPECT_GT(go->attempt, 0u);
  // the ring is the view every peer was sent, whole
  EXPECT_EQ(go->epoch, h.c.epoch());
  EXPECT_TRUE(go->absent.empty());
  EXPECT_EQ(go->slot, 0u);  // pool size 1
  for (std::size_t i = 0; i < peers.size(); ++i) {
    out = h.send(peers[i], p::CollectiveDone{5, go->attempt, true, {}});
    if (i + 1 < peers.size()) {
      EXPECT_EQ(send_count(out), 0u) << describe(out);
    }
  }
  for (const auto& f : peers) {
    const auto r = one_of<p::CollectiveResult>(out, f.conn);
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(*r, (p::CollectiveResult{5, go->attempt, LOCKSTEP_OK, 3, {}}));
  }
  EXPECT_TRUE(h.c.collectives().empty());
}

// ---------------------------------------------------------------- eviction by the operator

// An evicted peer leaves as a kicked one does: it is told why, its running collective
// fails for the others (who retry with the survivors), and the next membership vote
// shows it gone.
TEST(CoordinatorEvict, AcceptedPeerMidCollectiveIsKickedAndTheOthersContinue) {
  Harness h;
  const auto peers = h.run_of(3);
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::CollectiveInit{5, kSum});
  const auto go = one_of<p::CollectiveGo>(out, peers[0].conn);
  ASSERT_TRUE(go.has_value()) << describe(out);
  h.send(peers[0], p::CollectiveDone{5, go->attempt, true, {}});
  out.clear();
  ASSERT_TRUE(h.c.on_evict(peers[1].id, "requested over HTTP", h.now, out));
  h.check();
  expect_goodbye(out, peers[1], LOCKSTEP_STATUS_KICKED);
  const auto bye = one_of<p::Goodbye>(out, peers[1].conn);
  ASSERT_TRUE(bye.has_value());
  EXPECT_NE(bye->reason.find("evicted by the operator: requested over HTTP"), std::string::npos) << bye->reason;
  EXPECT_TRUE(h.gone(peers[1]));
  EXPECT_TRUE(one_of<p::CollectiveAbort>(out, peers[2].conn).has_value()) << describe(out);
  const auto removed = std::find_if(out.begin(), out.end(), [](const Command& c) {
    const auto* e = std::get_if<Event>(&c);
    return e != nullptr && e->kind == EventKind::kRemoved;
  });
  ASSERT_NE(removed, out.end());
  EXPECT_EQ(std::get<Event>(*removed).status, LOCKSTEP_STATUS_KICKED);
  out = h.send(peers[2], p::CollectiveDone{5, go->attempt, false, "the attempt was aborted"});
  for (const auto& f : {peers[0], peers[2]}) {
    const auto r = one_of<p::CollectiveResult>(out, f.conn);
    ASSERT_TRUE(r.has_value()) << describe(out);
    EXPECT_EQ(r->status, LOCKSTEP_STATUS_PEER_CONNECTION_LOST);
  }
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{peers[0].id, peers[2].id}));
  // The survivors see the change at their next are-peers-pending, update, and retry.
  h.send(peers[0], p::VotePeersPending{});
  out = h.send(peers[2], p::VotePeersPending{});
  expect_pending(out, peers[0], LOCKSTEP_OK, true);
  h.update({peers[0], peers[2]}, {});
  for (const auto& f : {peers[0], peers[2]}) out = h.send(f, p::CollectiveInit{6, kSum});
  const auto retry = one_of<p::CollectiveGo>(out, peers[2].conn);
  ASSERT_TRUE(retry.has_value()) << describe(out);
  EXPECT_EQ(retry->epoch, h.c.epoch());  // the new view, whole
  EXPECT_TRUE(retry->absent.empty());
}

TEST(CoordinatorEvict, RegisteredPeerIsRemovedAndUnknownIdsChangeNothing) {
  Harness h;
  const auto accepted = h.run_of(2);
  const FakePeer n = h.join(1);
  Outbox out;
  ASSERT_TRUE(h.c.on_evict(n.id, "", h.now, out));
  h.check();
  expect_goodbye(out, n, LOCKSTEP_STATUS_KICKED);
  EXPECT_TRUE(h.gone(n));
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{accepted[0].id, accepted[1].id}));
  const std::string before = h.c.digest();
  out.clear();
  EXPECT_FALSE(h.c.on_evict(n.id, "again", h.now, out));
  EXPECT_FALSE(h.c.on_evict(PeerId{1, 2}, "never existed", h.now, out));
  EXPECT_TRUE(out.empty()) << describe(out);
  EXPECT_EQ(h.c.digest(), before);
}

std::vector<std::uint8_t> floats_bytes(const std::vector<float>& v) {
  std::vector<std::uint8_t> out(v.size() * sizeof(float));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// A small all-reduce: each vote carries the contribution; once all are in, every
// participant gets one outcome with the same result, folded in ring order, and no ring
// is started.
TEST(CoordinatorCollective, SmallAllReduceTravelsWithTheVotes) {
  Harness h;
  const auto peers = h.run_of(3);
  for (const auto op : {LOCKSTEP_SUM, LOCKSTEP_AVG}) {
    const p::CollectiveDescriptor small{3, LOCKSTEP_F32, static_cast<std::uint8_t>(op), LOCKSTEP_QUANT_NONE};
    // Values whose f32 sum depends on the order: 1e8 + 1 + -1e8 is 0 folded left to right.
    const std::map<PeerId, std::vector<float>> input = {{peers[0].id, {1e8f, 1.0f, 2.0f}},
                                                         {peers[1].id, {1.0f, 2.0f, 3.0f}},
                                                         {peers[2].id, {-1e8f, 3.0f, 4.0f}}};
    const std::uint64_t tag = 40 + static_cast<std::uint64_t>(op);
    Outbox out;
    for (std::size_t i = 0; i < peers.size(); ++i) {
      out = h.send(peers[i], p::CollectiveInit{tag, small, floats_bytes(input.at(peers[i].id))});
      if (i + 1 < peers.size()) {
        EXPECT_EQ(send_count(out), 0u) << describe(out);
      }
    }
    std::vector<float> expected = input.at(h.c.ring(1)[0]);
    for (std::size_t k = 1; k < 3; ++k) {
      for (std::size_t e = 0; e < 3; ++e) expected[e] += input.at(h.c.ring(1)[k])[e];
    }
    if (op == LOCKSTEP_AVG) {
      for (auto& x : expected) x /= 3.0f;
    }
    for (const auto& f : peers) {
      EXPECT_TRUE(all_of<p::CollectiveGo>(out, f.conn).empty()) << describe(out);
      const auto r = one_of<p::CollectiveResult>(out, f.conn);
      ASSERT_TRUE(r.has_value()) << describe(out);
      EXPECT_EQ(r->status, LOCKSTEP_OK);
      EXPECT_EQ(r->world_size, 3u);
      EXPECT_EQ(r->data, floats_bytes(expected));
    }
    EXPECT_TRUE(h.c.collectives().empty());
  }
}

// A small all-reduce's vote must carry exactly count x dtype-size bytes, a larger one
// none; what one peer parks in votes that wait for others is bounded.
TEST(CoordinatorCollective, VoteCarriedDataIsCheckedAndBounded) {
  Harness h;
  const auto peers = h.run_of(2);
  const p::CollectiveDescriptor small{4, LOCKSTEP_F64, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE};
  const std::string before = h.c.digest();
  for (const auto& init : {p::CollectiveInit{1, small, std::vector<std::uint8_t>(31)},
                           p::CollectiveInit{1, small, {}},
                           p::CollectiveInit{1, kSum, std::vector<std::uint8_t>(8)}}) {
    Outbox out = h.send(peers[0], init);
    const auto refused = one_of<p::Refused>(out, peers[0].conn);
    ASSERT_TRUE(refused.has_value()) << describe(out);
    EXPECT_EQ(refused->status, LOCKSTEP_STATUS_INVALID_ARGUMENT);
    EXPECT_EQ(h.c.digest(), before);
  }
  // Quantized all-reduces take the ring whatever their size.
  const p::CollectiveDescriptor quantized{4, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_MINMAX_U8};
  EXPECT_EQ(send_count(h.send(peers[0], p::CollectiveInit{2, quantized})), 0u);
  Outbox out = h.send(peers[1], p::CollectiveInit{2, quantized});
  EXPECT_TRUE(one_of<p::CollectiveGo>(out, peers[1].conn).has_value()) << describe(out);
  // The bound: 16 KiB votes that peer 1 never joins, until the next is refused.
  const p::CollectiveDescriptor full{limits::kVoteCarriedBytesMax / 4, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE};
  const std::size_t fit = limits::kVoteCarriedBytesHeldPerPeerMax / limits::kVoteCarriedBytesMax;
  for (std::size_t t = 0; t < fit; ++t) {
    out = h.send(peers[0], p::CollectiveInit{100 + t, full, std::vector<std::uint8_t>(limits::kVoteCarriedBytesMax)});
    ASSERT_EQ(send_count(out), 0u) << t << ": " << describe(out);
  }
  out = h.send(peers[0], p::CollectiveInit{99, full, std::vector<std::uint8_t>(limits::kVoteCarriedBytesMax)});
  const auto refused = one_of<p::Refused>(out, peers[0].conn);
  ASSERT_TRUE(refused.has_value()) << describe(out);
  EXPECT_EQ(refused->status, LOCKSTEP_STATUS_INVALID_USAGE);
  // Peer 1 joins one of them: it completes, and its bytes are free again.
  out = h.send(peers[1], p::CollectiveInit{100, full, std::vector<std::uint8_t>(limits::kVoteCarriedBytesMax)});
  ASSERT_TRUE(one_of<p::CollectiveResult>(out, peers[0].conn).has_value()) << describe(out);
  out = h.send(peers[0], p::CollectiveInit{99, full, std::vector<std::uint8_t>(limits::kVoteCarriedBytesMax)});
  EXPECT_EQ(send_count(out), 0u) << describe(out);
}

// A voter lost before the vote completes takes its contribution with it: the survivors'
// all-reduce completes over them alone.
TEST(CoordinatorCollective, SmallAllReduceCompletesOverTheSurvivorsOfItsVote) {
  Harness h;
  const auto peers = h.run_of(3);
  const p::CollectiveDescriptor small{2, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE};
  h.send(peers[0], p::CollectiveInit{7, small, floats_bytes({1.0f, 2.0f})});
  h.send(peers[2], p::CollectiveInit{7, small, floats_bytes({100.0f, 200.0f})});
  h.disconnect(peers[2]);
  Outbox out = h.send(peers[1], p::CollectiveInit{7, small, floats_bytes({10.0f, 20.0f})});
  for (const auto& f : {peers[0], peers[1]}) {
    const auto r = one_of<p::CollectiveResult>(out, f.conn);
    ASSERT_TRUE(r.has_value()) << describe(out);
    EXPECT_EQ(r->status, LOCKSTEP_OK);
    EXPECT_EQ(r->world_size, 2u);
    EXPECT_EQ(r->data, floats_bytes({11.0f, 22.0f}));
  }
}

TEST(CoordinatorCollective, DifferentDescriptorsFailForAll) {
  Harness h;
  const auto peers = h.run_of(2);
  h.send(peers[0], p::CollectiveInit{1, kSum});
  p::CollectiveDescriptor other = kSum;
  other.count = kSum.count - 1;
  Outbox out = h.send(peers[1], p::CollectiveInit{1, other});
  for (const auto& f : peers) {
    const auto r = one_of<p::CollectiveResult>(out, f.conn);
    ASSERT_TRUE(r.has_value()) << describe(out);
    EXPECT_EQ(r->status, LOCKSTEP_STATUS_OPERATION_MISMATCH);
    EXPECT_EQ(r->tag, 1u);
  }
  EXPECT_TRUE(all_of<p::CollectiveGo>(out, peers[0].conn).empty());
}

// ---- the collective kinds (docs/collectives.md)

p::CollectiveDescriptor kind_of(p::CollectiveKind kind, std::uint32_t world, std::uint32_t root = 0) {
  p::CollectiveDescriptor d{1 << 20, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE};
  d.kind = kind;
  d.world = world;
  d.root = root;
  return d;
}

// Every voter gets this status before any attempt, and nothing is left in flight.
void expect_ended_for_all(const Harness& h, const Outbox& out, const std::vector<FakePeer>& voters, StatusCode status,
                          const std::string& reason_part = "") {
  for (const auto& f : voters) {
    const auto r = one_of<p::CollectiveResult>(out, f.conn);
    ASSERT_TRUE(r.has_value()) << describe(out);
    EXPECT_EQ(r->status, status) << describe(out);
    EXPECT_EQ(r->attempt, 0u);
    EXPECT_NE(r->reason.find(reason_part), std::string::npos) << r->reason;
    EXPECT_TRUE(all_of<p::CollectiveGo>(out, f.conn).empty()) << describe(out);
  }
  EXPECT_TRUE(h.c.collectives().empty());
}

TEST(CoordinatorCollectiveKinds, AGroupOfOneGetsTooFewPeersForEveryKind) {
  Harness h;
  const auto alone = h.run_of(1);
  std::uint64_t tag = 1;
  for (const auto kind : {p::CollectiveKind::kAllReduce, p::CollectiveKind::kBroadcast, p::CollectiveKind::kAllGather,
                          p::CollectiveKind::kReduceScatter, p::CollectiveKind::kBarrier}) {
    p::CollectiveDescriptor d = kind_of(kind, p::shape_bound(kind) ? 1 : 0);
    if (kind == p::CollectiveKind::kBarrier) d = p::CollectiveDescriptor{0, 0, 0, 0, kind, 0, 0, {}};
    expect_ended_for_all(h, h.send(alone[0], p::CollectiveInit{tag++, d}), alone, LOCKSTEP_STATUS_TOO_FEW_PEERS,
                         "at least two peers");
  }
  // A small all-reduce too, whose data would otherwise come back as the result.
  const p::CollectiveDescriptor small{2, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE};
  expect_ended_for_all(h, h.send(alone[0], p::CollectiveInit{tag, small, floats_bytes({1.0f, 2.0f})}), alone,
                       LOCKSTEP_STATUS_TOO_FEW_PEERS);
}

TEST(CoordinatorCollectiveKinds, ABarrierIsOneVoteWithNoData) {
  Harness h;
  const auto peers = h.run_of(3);
  const p::CollectiveDescriptor barrier{0, 0, 0, 0, p::CollectiveKind::kBarrier, 0, 0, {}};
  Outbox out;
  for (std::size_t i = 0; i < peers.size(); ++i) {
    out = h.send(peers[i], p::CollectiveInit{5, barrier});
    if (i + 1 < peers.size()) {
      EXPECT_EQ(send_count(out), 0u) << "the barrier ended before every peer entered it: " << describe(out);
    }
  }
  for (const auto& f : peers) {
    const auto r = one_of<p::CollectiveResult>(out, f.conn);
    ASSERT_TRUE(r.has_value()) << describe(out);
    EXPECT_EQ(r->status, LOCKSTEP_OK);
    EXPECT_EQ(r->world_size, 3u);
    EXPECT_TRUE(r->data.empty());
    EXPECT_TRUE(all_of<p::CollectiveGo>(out, f.conn).empty()) << describe(out);
  }
}

// After a loss, a shape-bound collective of the old view fails at once for the
// survivors; an all-reduce goes on with them; after update topology the new view's works.
TEST(CoordinatorCollectiveKinds, ShapeBoundCollectivesOfAViewThatLostAPeerFailWithViewChanged) {
  Harness h;
  auto peers = h.run_of(3);
  h.disconnect(peers[2]);
  peers.pop_back();
  for (const auto kind : {p::CollectiveKind::kBroadcast, p::CollectiveKind::kAllGather, p::CollectiveKind::kReduceScatter}) {
    const std::uint64_t tag = 10 + static_cast<std::uint64_t>(kind);
    h.send(peers[0], p::CollectiveInit{tag, kind_of(kind, 3)});
    expect_ended_for_all(h, h.send(peers[1], p::CollectiveInit{tag, kind_of(kind, 3)}), peers,
                         LOCKSTEP_STATUS_VIEW_CHANGED, "update the topology");
  }
  h.send(peers[0], p::CollectiveInit{20, kSum});
  Outbox out = h.send(peers[1], p::CollectiveInit{20, kSum});
  const auto go = one_of<p::CollectiveGo>(out, peers[0].conn);
  ASSERT_TRUE(go.has_value()) << describe(out);
  EXPECT_EQ(go->absent.size(), 1u);  // the view of 3 less the peer that left
  // In a view of two, the same call starts.
  h.send(peers[0], p::CollectiveInit{21, kind_of(p::CollectiveKind::kAllGather, 2)});
  out = h.send(peers[1], p::CollectiveInit{21, kind_of(p::CollectiveKind::kAllGather, 2)});
  EXPECT_TRUE(one_of<p::CollectiveGo>(out, peers[1].conn).has_value()) << describe(out);
}

TEST(CoordinatorCollectiveKinds, ARefusalEndsTheTagForEveryVoterWithItsReason) {
  Harness h;
  const auto peers = h.run_of(2);
  const auto d = kind_of(p::CollectiveKind::kAllGather, 2);
  EXPECT_EQ(send_count(h.send(peers[0], p::CollectiveInit{3, d})), 0u);
  const Outbox out = h.send(peers[1], p::CollectiveInit{3, d, {}, "destination has room for 7 elements"});
  expect_ended_for_all(h, out, peers, LOCKSTEP_STATUS_INVALID_ARGUMENT, "destination has room for 7 elements");
  expect_ended_for_all(h, out, peers, LOCKSTEP_STATUS_INVALID_ARGUMENT, peers[1].id.to_string());
}

// The optional finiteness check: a peer's refusal with NON_FINITE_CONTRIBUTION ends the
// tag for every voter with that status, naming the peer whose contribution it was.
TEST(CoordinatorCollectiveKinds, ANonFiniteContributionEndsTheTagForAllNamingItsPeer) {
  Harness h;
  const auto peers = h.run_of(3);
  EXPECT_EQ(send_count(h.send(peers[0], p::CollectiveInit{4, kSum})), 0u);
  p::CollectiveInit poisoned{4, kSum, {}, "NaN at element 17"};
  poisoned.refusal_status = LOCKSTEP_STATUS_NON_FINITE_CONTRIBUTION;
  EXPECT_EQ(send_count(h.send(peers[2], poisoned)), 0u);  // a vote like any other: waits for all
  const Outbox out = h.send(peers[1], p::CollectiveInit{4, kSum});
  expect_ended_for_all(h, out, peers, LOCKSTEP_STATUS_NON_FINITE_CONTRIBUTION,
                       "peer " + peers[2].id.to_string() + " (rank 2): its contribution to tag 4: NaN at element 17");
}

TEST(CoordinatorCollectiveKinds, DescriptorsThatDifferInKindRootOrCountsFailForAll) {
  Harness h;
  const auto peers = h.run_of(2);
  std::uint64_t tag = 30;
  auto counts_a = kind_of(p::CollectiveKind::kAllGather, 2);
  counts_a.count = 0;
  counts_a.counts = {5, 6};
  auto counts_b = counts_a;
  counts_b.counts = {6, 5};
  const std::vector<std::pair<p::CollectiveDescriptor, p::CollectiveDescriptor>> pairs = {
      {kind_of(p::CollectiveKind::kAllGather, 2), kind_of(p::CollectiveKind::kReduceScatter, 2)},
      {kind_of(p::CollectiveKind::kBroadcast, 2, 0), kind_of(p::CollectiveKind::kBroadcast, 2, 1)},
      {counts_a, counts_b},
      {kind_of(p::CollectiveKind::kBroadcast, 2), kind_of(p::CollectiveKind::kBroadcast, 3)},
  };
  for (const auto& [a, b] : pairs) {
    h.send(peers[0], p::CollectiveInit{tag, a});
    expect_ended_for_all(h, h.send(peers[1], p::CollectiveInit{tag++, b}), peers, LOCKSTEP_STATUS_OPERATION_MISMATCH);
  }
  // The same root outside the world, or counts not one per rank, on both: INVALID_ARGUMENT.
  auto three_counts = counts_a;
  three_counts.counts = {1, 2, 3};
  for (const auto& d : {kind_of(p::CollectiveKind::kBroadcast, 2, 2), three_counts}) {
    h.send(peers[0], p::CollectiveInit{tag, d});
    expect_ended_for_all(h, h.send(peers[1], p::CollectiveInit{tag++, d}), peers, LOCKSTEP_STATUS_INVALID_ARGUMENT);
  }
}

// Every peer votes for `tag`; the attempt's CollectiveGo as peers[0] got it.
std::optional<p::CollectiveGo> start_on_all(Harness& h, const std::vector<FakePeer>& peers, std::uint64_t tag) {
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::CollectiveInit{tag, kSum});
  return one_of<p::CollectiveGo>(out, peers[0].conn);
}

// A participant lost mid-attempt: nobody can commit any more, so the master tells the
// participants that have not reported to stop (CollectiveAbort); their reports decide
// (one that failed its part fails the attempt for all survivors).
TEST(CoordinatorCollective, ParticipantLostAbortsTheAttemptAndTheReportsDecide) {
  Harness h;
  const auto peers = h.run_of(3);
  Outbox out;
  const auto go = start_on_all(h, peers, 2);
  ASSERT_TRUE(go.has_value());
  h.send(peers[0], p::CollectiveDone{2, go->attempt, true, {}});
  out = h.disconnect(peers[2]);
  EXPECT_EQ(one_of<p::CollectiveAbort>(out, peers[1].conn), (p::CollectiveAbort{2, go->attempt})) << describe(out);
  EXPECT_TRUE(all_of<p::CollectiveAbort>(out, peers[0].conn).empty()) << "it has reported";
  EXPECT_TRUE(all_of<p::CollectiveResult>(out, peers[0].conn).empty()) << describe(out);
  out = h.send(peers[1], p::CollectiveDone{2, go->attempt, false, "the attempt was aborted"});
  for (const auto& f : {peers[0], peers[1]}) {
    const auto r = one_of<p::CollectiveResult>(out, f.conn);
    ASSERT_TRUE(r.has_value()) << describe(out);
    EXPECT_EQ(r->status, LOCKSTEP_STATUS_PEER_CONNECTION_LOST);
    EXPECT_EQ(r->attempt, go->attempt);
    EXPECT_NE(r->reason.find("was lost during the collective"), std::string::npos) << r->reason;
  }
  // a late report of the ended attempt changes nothing; the retry gets a new attempt
  const std::string before = h.c.digest();
  EXPECT_EQ(send_count(h.send(peers[1], p::CollectiveDone{2, go->attempt, true, {}})), 0u);
  EXPECT_EQ(h.c.digest(), before);
  h.send(peers[0], p::CollectiveInit{2, kSum});
  out = h.send(peers[1], p::CollectiveInit{2, kSum});
  const auto retry = one_of<p::CollectiveGo>(out, peers[1].conn);
  ASSERT_TRUE(retry.has_value());
  EXPECT_GT(retry->attempt, go->attempt);
  EXPECT_EQ(retry->epoch, go->epoch);  // the same view, less the peer that was lost
  EXPECT_EQ(retry->absent, std::vector<PeerId>{peers[2].id});
}

// Every survivor holds the result (the lost peer may have committed before it went):
// the attempt succeeds for them.
TEST(CoordinatorCollective, ParticipantLostAfterEveryoneHeldTheResultSucceeds) {
  Harness h;
  const auto peers = h.run_of(3);
  Outbox out;
  const auto go = start_on_all(h, peers, 2);
  ASSERT_TRUE(go.has_value());
  out = h.disconnect(peers[2]);
  EXPECT_TRUE(one_of<p::CollectiveAbort>(out, peers[0].conn).has_value()) << describe(out);
  EXPECT_EQ(send_count(h.send(peers[0], p::CollectiveDone{2, go->attempt, true, {}})), 0u);
  out = h.send(peers[1], p::CollectiveDone{2, go->attempt, true, {}});
  for (const auto& f : {peers[0], peers[1]}) {
    EXPECT_EQ(one_of<p::CollectiveResult>(out, f.conn), (p::CollectiveResult{2, go->attempt, LOCKSTEP_OK, 3, {}}))
        << describe(out);
  }
  EXPECT_TRUE(h.c.collectives().empty());
}

// Completion among the peers (docs/protocol.md, "Completion"): one report of a commit
// proves that every participant holds the result, so the attempt succeeds at once for
// all, whoever has not reported yet; the committed peer may call the tag again right
// away, and the others' late reports change nothing.
TEST(CoordinatorCollective, ACommitEndsTheAttemptAtOnceWithSuccess) {
  Harness h;
  const auto peers = h.run_of(3);
  Outbox out;
  const auto go = start_on_all(h, peers, 3);
  ASSERT_TRUE(go.has_value());
  EXPECT_EQ(send_count(h.send(peers[1], p::CollectiveDone{3, go->attempt, true, {}, 10, 10})), 0u);
  // Any other second report is refused and changes nothing.
  for (const bool ok : {true, false}) {
    const std::string before = h.c.digest();
    out = h.send(peers[1], p::CollectiveDone{3, go->attempt, ok, {}});
    EXPECT_EQ(all_of<p::Refused>(out, peers[1].conn).size(), 1u) << describe(out);
    EXPECT_EQ(h.c.digest(), before);
  }
  // It reported ok, then committed before the outcome came: the one report sent twice.
  out = h.send(peers[1], p::CollectiveDone{3, go->attempt, true, {}, 0, 0, true});
  for (const auto& f : peers) {
    EXPECT_EQ(one_of<p::CollectiveResult>(out, f.conn), (p::CollectiveResult{3, go->attempt, LOCKSTEP_OK, 3, {}}))
        << describe(out);
  }
  EXPECT_TRUE(h.c.collectives().empty());
  out = h.send(peers[1], p::CollectiveInit{3, kSum});
  EXPECT_EQ(send_count(out), 0u) << describe(out);  // a new vote, not refused
  EXPECT_EQ(send_count(h.send(peers[0], p::CollectiveDone{3, go->attempt, true, {}, 0, 0, true})), 0u);
  EXPECT_EQ(send_count(h.send(peers[2], p::CollectiveDone{3, go->attempt, true, {}})), 0u);
  // A commit that crossed the master's abort on the wire still wins.
  h.send(peers[0], p::CollectiveInit{3, kSum});
  out = h.send(peers[2], p::CollectiveInit{3, kSum});
  const auto next = one_of<p::CollectiveGo>(out, peers[0].conn);
  ASSERT_TRUE(next.has_value()) << describe(out);
  out = h.disconnect(peers[0]);
  EXPECT_TRUE(one_of<p::CollectiveAbort>(out, peers[2].conn).has_value()) << describe(out);
  out = h.send(peers[1], p::CollectiveDone{3, next->attempt, true, {}, 0, 0, true});
  for (const auto& f : {peers[1], peers[2]}) {
    const auto r = one_of<p::CollectiveResult>(out, f.conn);
    ASSERT_TRUE(r.has_value()) << describe(out);
    EXPECT_EQ(r->status, LOCKSTEP_OK);
  }
}

// Guarantee 1: one participant that reports its part failed (a neighbour it could not
// reach, a stall, a bad frame) fails the attempt at once for every participant, those
// that completed included; a later report of that attempt changes nothing.
TEST(CoordinatorCollective, OneFailedReportFailsTheAttemptForAll) {
  Harness h;
  const auto peers = h.run_of(3);
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::CollectiveInit{4, kSum});
  const auto go = one_of<p::CollectiveGo>(out, peers[0].conn);
  ASSERT_TRUE(go.has_value()) << describe(out);
  EXPECT_EQ(send_count(h.send(peers[0], p::CollectiveDone{4, go->attempt, true, {}})), 0u);
  out = h.send(peers[1], p::CollectiveDone{4, go->attempt, false, "ring stalled"});
  for (const auto& f : peers) {
    const auto r = one_of<p::CollectiveResult>(out, f.conn);
    ASSERT_TRUE(r.has_value()) << describe(out);
    EXPECT_EQ(r->status, LOCKSTEP_STATUS_PEER_CONNECTION_LOST);
    EXPECT_EQ(r->attempt, go->attempt);
    EXPECT_NE(r->reason.find("ring stalled"), std::string::npos) << r->reason;
  }
  EXPECT_TRUE(h.c.collectives().empty());
  EXPECT_EQ(send_count(h.send(peers[2], p::CollectiveDone{4, go->attempt, true, {}})), 0u);
}

// Bad input: the collectives one group may have in flight are bounded; a vote for one
// more tag is refused and changes nothing, a vote for a tag already open is not.
TEST(CoordinatorCollective, CollectivesInFlightPerGroupAreBounded) {
  Config config = test_config();
  config.collectives_per_group_max = 2;
  Harness h(config);
  const auto peers = h.run_of(2);
  EXPECT_EQ(send_count(h.send(peers[0], p::CollectiveInit{1, kSum})), 0u);
  EXPECT_EQ(send_count(h.send(peers[0], p::CollectiveInit{2, kSum})), 0u);
  const std::string before = h.c.digest();
  Outbox out = h.send(peers[0], p::CollectiveInit{3, kSum});
  const auto r = one_of<p::Refused>(out, peers[0].conn);
  ASSERT_TRUE(r.has_value()) << describe(out);
  EXPECT_EQ(r->status, LOCKSTEP_STATUS_INVALID_USAGE);
  EXPECT_NE(r->reason.find("more than 2 collectives in flight"), std::string::npos) << r->reason;
  EXPECT_EQ(h.c.digest(), before);
  out = h.send(peers[1], p::CollectiveInit{1, kSum});
  EXPECT_TRUE(one_of<p::CollectiveGo>(out, peers[1].conn).has_value()) << describe(out);
}

// Concurrent collectives get a pool slot each while slots are free (the smallest pool
// of the group counts); once all are busy they share the least busy ones, and a slot
// freed by a finished attempt is the next one given.
TEST(CoordinatorCollective, ConcurrentCollectivesSpreadOverThePoolSlots) {
  Harness h;
  h.pool_size = 4;
  auto peers = h.run_of(2);
  h.pool_size = 3;  // the group's pool is its smallest
  const FakePeer third = h.join(1);
  h.update(peers, {third});
  peers.push_back(third);
  std::map<std::uint64_t, p::CollectiveGo> gos;
  const auto start = [&](std::uint64_t tag) {
    Outbox out;
    for (const auto& f : peers) out = h.send(f, p::CollectiveInit{tag, kSum});
    const auto go = one_of<p::CollectiveGo>(out, peers[0].conn);
    EXPECT_TRUE(go.has_value()) << describe(out);
    if (go) gos[tag] = *go;
    return go ? go->slot : ~0u;
  };
  EXPECT_EQ(start(10), 0u);
  EXPECT_EQ(start(11), 1u);
  EXPECT_EQ(start(12), 2u);
  EXPECT_EQ(start(13), 0u);  // all busy: the least busy, lowest first
  EXPECT_EQ(start(14), 1u);
  // Tag 11 ends: its slot is free again and goes to the next collective.
  for (const auto& f : peers) h.send(f, p::CollectiveDone{11, gos[11].attempt, true, {}});
  EXPECT_EQ(start(15), 1u);
  // Tag 12 ends: slot 2 (now the only one with one attempt) before 0 and 1 (two each).
  for (const auto& f : peers) h.send(f, p::CollectiveDone{12, gos[12].attempt, true, {}});
  EXPECT_EQ(start(16), 2u);
}

TEST(CoordinatorCollective, TopologyVoteWithACollectiveInFlightIsRefused) {
  Harness h;
  const auto peers = h.run_of(2);
  h.send(peers[0], p::CollectiveInit{3, kSum});
  const std::string before = h.c.digest();
  Outbox out = h.send(peers[0], p::VoteUpdateTopology{});
  const auto refused = one_of<p::Refused>(out, peers[0].conn);
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->status, LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS);
  EXPECT_EQ(h.c.digest(), before);
  // starting a tag that is still in flight is an error
  out = h.send(peers[0], p::CollectiveInit{3, kSum});
  const auto again = one_of<p::Refused>(out, peers[0].conn);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->status, LOCKSTEP_STATUS_INVALID_USAGE);
  EXPECT_EQ(again->tag, 3u);
  EXPECT_EQ(h.c.digest(), before);
}

// One peer votes to update the topology while another started a collective: the
// first cannot join the tag (it is in a vote), the second cannot join the topology
// vote (a collective is in flight). Votes that can never complete must fail with
// OPERATION_MISMATCH rather than wait forever (the vote timeout is off).
// A votes update topology, B initiates a collective. Neither may join the other's
// vote, so without help both would wait forever: the collective fails at once with
// OPERATION_MISMATCH, after which B may join the topology vote and it completes.
TEST(CoordinatorCollective, TopologyVoteAgainstACollectiveVoteDoesNotHang) {
  Harness h;
  const auto peers = h.run_of(2);
  h.send(peers[0], p::VoteUpdateTopology{});
  Outbox out = h.send(peers[1], p::CollectiveInit{4, kSum});
  const auto result = one_of<p::CollectiveResult>(out, peers[1].conn);
  ASSERT_TRUE(result.has_value()) << describe(out);
  EXPECT_EQ(result->status, LOCKSTEP_STATUS_OPERATION_MISMATCH);
  EXPECT_TRUE(h.c.collectives().empty());
  // A, in the topology vote, still may not initiate collectives.
  ASSERT_TRUE(one_of<p::Refused>(h.send(peers[0], p::CollectiveInit{4, kSum}), peers[0].conn).has_value());
  // B, with nothing in flight any more, joins the topology vote: it completes.
  out = h.send(peers[1], p::VoteUpdateTopology{});
  EXPECT_TRUE(one_of<p::EstablishP2P>(out, peers[0].conn).has_value()) << describe(out);
  EXPECT_TRUE(one_of<p::EstablishP2P>(out, peers[1].conn).has_value()) << describe(out);
}

// ---------------------------------------------------------------- joins during an update

// A peer that says Hello while an establishment is running is not part of it (it got
// no EstablishP2P); it stays registered, gets no TopologyResult, and the next update
// admits it.
TEST(CoordinatorJoinDuringUpdate, HelloDuringEstablishmentWaitsForTheNextUpdate) {
  Harness h;
  const auto peers = h.run_of(2);
  const FakePeer n = h.join(1);
  h.vote_topology(peers);
  Outbox out;
  const FakePeer late = h.join(1, &out);
  EXPECT_TRUE(all_of<p::EstablishP2P>(out, late.conn).empty());
  out = h.report_all({peers[0], peers[1], n});
  EXPECT_TRUE(all_of<p::TopologyResult>(out, late.conn).empty())
      << "a peer that took no part in the establishment got its result:\n"
      << describe(out);
  EXPECT_EQ(h.phase(late), Phase::kRegistered);
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{peers[0].id, peers[1].id, n.id}));
  h.update({peers[0], peers[1], n}, {late});
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{peers[0].id, peers[1].id, n.id, late.id}));
}

// The same for the very first admission of an empty run, with the late peer in a
// group that has no ring yet.
TEST(CoordinatorJoinDuringUpdate, HelloInANewGroupDuringTheFirstAdmission) {
  Harness h;
  Outbox out;
  const FakePeer a = h.join(1, &out);
  ASSERT_TRUE(one_of<p::EstablishP2P>(out, a.conn).has_value());
  const FakePeer b = h.join(2, &out);
  EXPECT_TRUE(all_of<p::EstablishP2P>(out, b.conn).empty());
  try {
    out = h.send(a, p::P2PReport{h.c.epoch(), {}});
  } catch (const std::exception& e) {
    FAIL() << "the coordinator threw while completing the establishment: " << e.what();
  }
  EXPECT_EQ(h.phase(a), Phase::kAccepted);
  EXPECT_TRUE(all_of<p::TopologyResult>(out, b.conn).empty()) << describe(out);
  EXPECT_EQ(h.phase(b), Phase::kRegistered);
}

// A Hello while the topology vote is open makes the newcomer part of that update.
TEST(CoordinatorJoinDuringUpdate, HelloDuringTheVoteJoinsThatUpdate) {
  Harness h;
  const auto peers = h.run_of(2);
  h.send(peers[0], p::VoteUpdateTopology{});
  const FakePeer n = h.join(2);
  Outbox out = h.send(peers[1], p::VoteUpdateTopology{});
  ASSERT_TRUE(one_of<p::EstablishP2P>(out, n.conn).has_value());
  h.report_all({peers[0], peers[1], n});
  EXPECT_EQ(h.c.ring(2), std::vector<PeerId>{n.id});
}


// ---------------------------------------------------------------- shared state

constexpr std::uint64_t kMiB = 1u << 20;

// A tensor entry whose digest stands for its content (`content` 0 is "other bytes").
p::TensorEntry tensor(const std::string& key, std::uint64_t content, std::uint64_t count = 1024,
                      std::uint8_t dtype = LOCKSTEP_F32, bool allow_inequality = false) {
  return p::TensorEntry{key, dtype, count, state::Digest{content, ~content}, allow_inequality};
}
// The shared state of a small model: three tensors, one of them large.
std::vector<p::TensorEntry> model(std::uint64_t content) {
  return {tensor("embedding", content), tensor("weights", content + 1, 16 * kMiB), tensor("step", content + 2, 1, LOCKSTEP_U64)};
}
p::SyncVote state_vote(std::uint64_t revision, std::vector<p::TensorEntry> tensors,
                       p::SyncStrategy strategy = p::SyncStrategy::kEnforcePopular) {
  return p::SyncVote{strategy, revision, std::move(tensors)};
}

// Every peer votes its state; returns the outbox of the last vote.
Outbox vote_sync(Harness& h, const std::vector<FakePeer>& peers, const std::vector<p::SyncVote>& votes) {
  Outbox out;
  for (std::size_t i = 0; i < peers.size(); ++i) {
    out = h.send(peers[i], votes[i]);
    if (i + 1 < peers.size()) { EXPECT_EQ(send_count(out), 0u) << describe(out); }
  }
  return out;
}

// Checks a plan's shape against the receiver's own vote: every piece lies inside its
// tensor, the pieces of each expected tensor cover it exactly once, and nothing else is
// fetched. Returns the bytes it moves.
std::uint64_t check_plan(const p::SyncPlan& plan, const p::SyncVote& vote) {
  std::map<std::uint32_t, std::vector<std::pair<std::uint64_t, std::uint64_t>>> pieces;
  std::uint64_t total = 0;
  for (const auto& f : plan.fetches) {
    EXPECT_LT(f.tensor, vote.tensors.size());
    EXPECT_LT(f.source, plan.sources.size());
    pieces[f.tensor].emplace_back(f.offset, f.bytes);
    total += f.bytes;
  }
  std::set<std::uint32_t> expected;
  for (const auto& e : plan.expect) expected.insert(e.tensor);
  for (auto& [index, list] : pieces) {
    EXPECT_EQ(expected.count(index), 1u) << "fetches tensor " << index << " without an expected digest";
    std::sort(list.begin(), list.end());
    std::uint64_t at = 0;
    for (const auto& [offset, bytes] : list) {
      EXPECT_EQ(offset, at);
      EXPECT_GT(bytes, 0u);
      at += bytes;
    }
    const auto& t = vote.tensors.at(index);
    EXPECT_EQ(at, t.count * dtype_bytes(t.dtype)) << t.key;
  }
  for (const auto index : expected) EXPECT_EQ(pieces.count(index), 1u) << "tensor " << index << " expected but not fetched";
  return total;
}

// Every peer reports a successful transfer; returns the outbox of the last report.
Outbox sync_done(Harness& h, const std::vector<FakePeer>& peers, std::uint64_t attempt) {
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::SyncDone{attempt, LOCKSTEP_OK, {}});
  return out;
}

void expect_sync_result(const Outbox& out, const std::vector<FakePeer>& peers, StatusCode status,
                        std::uint64_t revision = 0) {
  for (const auto& f : peers) {
    const auto r = one_of<p::SyncResult>(out, f.conn);
    ASSERT_TRUE(r.has_value()) << describe(out);
    EXPECT_EQ(r->status, status) << describe(out);
    if (status == LOCKSTEP_OK) { EXPECT_EQ(r->revision, revision); }
    if (status != LOCKSTEP_OK) { EXPECT_FALSE(r->reason.empty()); }
  }
}

// A whole sync: votes, plans, reports, result. Returns each peer's plan.
std::vector<p::SyncPlan> sync_round(Harness& h, const std::vector<FakePeer>& peers,
                                    const std::vector<p::SyncVote>& votes, std::uint64_t elected_revision) {
  Outbox out = vote_sync(h, peers, votes);
  std::vector<p::SyncPlan> plans;
  for (std::size_t i = 0; i < peers.size(); ++i) {
    const auto plan = one_of<p::SyncPlan>(out, peers[i].conn);
    if (!plan) return {};
    EXPECT_EQ(plan->revision, elected_revision);
    check_plan(*plan, votes[i]);
    plans.push_back(*plan);
  }
  out = sync_done(h, peers, plans.front().attempt);
  expect_sync_result(out, peers, LOCKSTEP_OK, elected_revision);
  EXPECT_EQ(h.c.revision(peers.front().group), elected_revision);
  for (const auto& f : peers) EXPECT_EQ(h.state(f), PeerState::kIdle);
  return plans;
}

TEST(CoordinatorSync, PeersInAgreementTransferNothingAtEveryRevision) {
  Harness h;
  const auto peers = h.run_of(2);
  for (std::uint64_t revision = 1; revision <= 100; ++revision) {
    const auto plans = sync_round(h, peers, {state_vote(revision, model(revision * 10)), state_vote(revision, model(revision * 10))},
                                  revision);
    ASSERT_EQ(plans.size(), 2u);
    for (const auto& plan : plans) {
      EXPECT_TRUE(plan.fetches.empty());
      EXPECT_TRUE(plan.expect.empty());
    }
  }
}

TEST(CoordinatorSync, NewcomerReceivesEverythingSpreadOverTheHolders) {
  Harness h;
  const auto peers = h.run_of(3);
  const std::vector<p::SyncVote> votes = {state_vote(7, model(100)), state_vote(7, model(100)), state_vote(0, model(5))};
  const auto plans = sync_round(h, peers, votes, 7);
  ASSERT_EQ(plans.size(), 3u);
  EXPECT_TRUE(plans[0].fetches.empty());
  EXPECT_TRUE(plans[1].fetches.empty());
  ASSERT_EQ(plans[2].expect.size(), 3u);
  for (const auto& e : plans[2].expect) EXPECT_EQ(e.hash, votes[0].tensors[e.tensor].hash);
  // The 64 MiB tensor comes from both holders in two halves.
  std::map<PeerId, std::uint64_t> from;
  for (const auto& f : plans[2].fetches) from[plans[2].sources[f.source].id] += f.bytes;
  ASSERT_EQ(from.size(), 2u);
  EXPECT_EQ(from[peers[0].id] + from[peers[1].id], 64 * kMiB + 4096 + 8);
  EXPECT_LE(std::max(from[peers[0].id], from[peers[1].id]) - std::min(from[peers[0].id], from[peers[1].id]), 8192u);
  for (const auto& source : plans[2].sources) EXPECT_NE(source.shared_state_port, 0);
}

// Receivers dial their sources (docs/deployment.md, "NAT"): a holder that accepts no
// inbound connection is never a source, and a peer that needs what only such holders
// have cannot be served; it leaves, and the others' sync goes on without it.
// Checks the dials of the plans of `peers` against their fetches: a source that accepts
// no inbound connection dials each receiver that fetches from it, once, with as many
// connections as the receiver fetches over (limits::state_connections), and only such
// sources dial. Returns the number of dials.
std::size_t check_dials(Harness& h, const std::vector<FakePeer>& peers, const std::vector<p::SyncPlan>& plans,
                        bool relay = false) {
  std::map<std::pair<PeerId, PeerId>, std::uint32_t> wanted;  // (source, receiver) -> connections
  for (std::size_t r = 0; r < peers.size(); ++r) {
    std::map<std::uint32_t, std::uint64_t> bytes;
    for (const auto& f : plans[r].fetches) bytes[f.source] += f.bytes;
    for (const auto& [index, total] : bytes) {
      const p::MemberInfo& source = plans[r].sources.at(index);
      if (!p::accepts_inbound(source)) {
        if (!relay) {
          EXPECT_TRUE(p::accepts_inbound(h.c.find_peer(peers[r].id)->info)) << "two unreachable peers paired";
        }
        wanted[{source.id, peers[r].id}] = limits::state_connections(total, limits::kStateStreamsDefault);
      }
    }
  }
  std::map<std::pair<PeerId, PeerId>, std::uint32_t> got;
  for (std::size_t s = 0; s < peers.size(); ++s) {
    for (const auto& dial : plans[s].dials) {
      EXPECT_TRUE(got.emplace(std::make_pair(peers[s].id, dial.receiver.id), dial.connections).second) << "dialled twice";
    }
  }
  EXPECT_EQ(got, wanted);
  return got.size();
}

TEST(CoordinatorSync, HoldersThatAcceptNoConnectionDialTheirReceivers) {
  Harness h;
  h.no_ports = true;
  const FakePeer hidden = h.first(1);
  h.no_ports = false;
  const FakePeer other_hidden = h.join_as(1, false);
  const FakePeer open = h.join(1);
  const FakePeer newcomer = h.join(1);
  h.update({hidden}, {other_hidden, open, newcomer});
  const std::vector<FakePeer> peers = {hidden, other_hidden, open, newcomer};
  // Every peer holds the content but the newcomer: the load spreads over all three
  // holders, and the two that accept no connection dial it.
  auto plans = sync_round(h, peers,
                          {state_vote(1, model(10)), state_vote(1, model(10)), state_vote(1, model(10)),
                           state_vote(0, model(5), p::SyncStrategy::kReceiveOnly)},
                          1);
  ASSERT_EQ(plans.size(), 4u);
  EXPECT_EQ(plans[3].sources.size(), 3u);
  EXPECT_EQ(check_dials(h, peers, plans), 2u);
  // Next, both reachable peers fall behind: only the two that accept no connection hold
  // the content, and they send it to both.
  const auto behind = state_vote(1, model(7), p::SyncStrategy::kReceiveOnly);
  plans = sync_round(h, peers, {state_vote(2, model(10)), state_vote(2, model(10)), behind, behind}, 2);
  ASSERT_EQ(plans.size(), 4u);
  for (const std::size_t r : {2u, 3u}) {
    ASSERT_FALSE(plans[r].sources.empty());
    for (const auto& source : plans[r].sources) EXPECT_FALSE(p::accepts_inbound(source));
  }
  EXPECT_EQ(check_dials(h, peers, plans), 4u);
}

// A run of four in join order: `hidden` (accepts no inbound connection), `open`,
// `hidden_newcomer` (accepts none) and `other_open`; then a first sync in which the
// reachable holders serve the unreachable newcomer alone, with or without a relay.
std::vector<FakePeer> hidden_holder_run(Harness& h) {
  h.no_ports = true;
  const FakePeer hidden = h.first(1);
  h.no_ports = false;
  const FakePeer open = h.join(1);
  const FakePeer hidden_newcomer = h.join_as(1, false);
  const FakePeer other_open = h.join(1);
  h.update({hidden}, {open, hidden_newcomer, other_open});
  const std::vector<FakePeer> peers = {hidden, open, hidden_newcomer, other_open};
  auto plans = sync_round(h, peers,
                          {state_vote(1, model(10)), state_vote(1, model(10)),
                           state_vote(0, model(5), p::SyncStrategy::kReceiveOnly), state_vote(1, model(10))},
                          1);
  EXPECT_EQ(plans.size(), 4u);
  if (plans.size() != 4u) return peers;
  EXPECT_FALSE(plans[2].sources.empty());
  for (const auto& source : plans[2].sources) EXPECT_TRUE(source.id == open.id || source.id == other_open.id);
  EXPECT_EQ(check_dials(h, peers, plans, h.c.relay()), 0u);
  return peers;
}

TEST(CoordinatorSync, APeerNoHolderCanReachLeaves) {
  Harness h;
  const std::vector<FakePeer> peers = hidden_holder_run(h);
  const FakePeer& hidden = peers[0];
  const FakePeer& open = peers[1];
  const FakePeer& hidden_newcomer = peers[2];
  const FakePeer& other_open = peers[3];
  // Next, only the peer that accepts no connection holds it: the reachable ones are
  // served (dialled), the unreachable one cannot be and leaves.
  const auto behind = state_vote(1, model(7), p::SyncStrategy::kReceiveOnly);
  Outbox out = vote_sync(h, peers, {state_vote(2, model(10)), behind, behind, behind});
  expect_goodbye(out, hidden_newcomer, LOCKSTEP_STATUS_KICKED);
  EXPECT_EQ(h.c.find_peer(hidden_newcomer.id), nullptr);
  const auto plan = one_of<p::SyncPlan>(out, hidden.conn);
  ASSERT_TRUE(plan.has_value()) << describe(out);
  ASSERT_EQ(plan->dials.size(), 2u);
  EXPECT_EQ(plan->dials[0].receiver.id, open.id);
  EXPECT_EQ(plan->dials[1].receiver.id, other_open.id);
  for (const auto& f : {open, other_open}) {
    const auto served = one_of<p::SyncPlan>(out, f.conn);
    ASSERT_TRUE(served.has_value());
    ASSERT_EQ(served->sources.size(), 1u);
    EXPECT_EQ(served->sources[0].id, hidden.id);
  }
}

// With a relay, a receiver that accepts no inbound connection is still served directly
// where a holder that accepts connections exists; where only holders that accept none
// hold the content, one of them dials it through the relay instead of it leaving.
TEST(CoordinatorSync, WithARelayHoldersThatAcceptNoConnectionServeOnesThatAcceptNoneEither) {
  Harness h(relay_config());
  const std::vector<FakePeer> peers = hidden_holder_run(h);
  const FakePeer& hidden = peers[0];
  const FakePeer& hidden_newcomer = peers[2];
  const auto behind = state_vote(1, model(7), p::SyncStrategy::kReceiveOnly);
  const auto plans = sync_round(h, peers, {state_vote(2, model(10)), behind, behind, behind}, 2);
  ASSERT_EQ(plans.size(), 4u);
  EXPECT_NE(h.c.find_peer(hidden_newcomer.id), nullptr);
  ASSERT_EQ(plans[2].sources.size(), 1u);
  EXPECT_EQ(plans[2].sources[0].id, hidden.id);
  EXPECT_EQ(check_dials(h, peers, plans, /*relay=*/true), 3u);
  bool relayed = false;
  for (const auto& dial : plans[0].dials) relayed = relayed || (dial.receiver.id == hidden_newcomer.id && !p::accepts_inbound(dial.receiver));
  EXPECT_TRUE(relayed);
}

// The seeds' async-DiLoCo case: more newcomers than old peers, syncing receive-only,
// end with the old peers' content; with enforce-popular at a first sync the newcomers'
// majority would win instead.
TEST(CoordinatorSync, ReceiveOnlyNewcomersNeverOutvoteTheHolders) {
  Harness h;
  auto peers = h.run_of(2);
  sync_round(h, peers, {state_vote(1, model(10)), state_vote(1, model(10))}, 1);
  std::vector<FakePeer> newcomers = {h.join(1), h.join(1), h.join(1)};
  h.update(peers, newcomers);
  peers.insert(peers.end(), newcomers.begin(), newcomers.end());
  std::vector<p::SyncVote> votes = {state_vote(2, model(20)), state_vote(2, model(20))};
  for (int i = 0; i < 3; ++i) votes.push_back(state_vote(2, model(99), p::SyncStrategy::kReceiveOnly));
  const auto plans = sync_round(h, peers, votes, 2);
  ASSERT_EQ(plans.size(), 5u);
  for (std::size_t i = 2; i < 5; ++i) {
    ASSERT_EQ(plans[i].expect.size(), 3u);
    for (const auto& e : plans[i].expect) EXPECT_EQ(e.hash, votes[0].tensors[e.tensor].hash);
    for (const auto& source : plans[i].sources) EXPECT_TRUE(source.id == peers[0].id || source.id == peers[1].id);
  }

  Harness first_sync;
  const auto fresh = first_sync.run_of(5);
  std::vector<p::SyncVote> popular = {state_vote(2, model(20)), state_vote(2, model(20))};
  for (int i = 0; i < 3; ++i) popular.push_back(state_vote(2, model(99)));
  const auto outcome = sync_round(first_sync, fresh, popular, 2);
  ASSERT_EQ(outcome.size(), 5u);
  EXPECT_EQ(outcome[0].expect.size(), 3u);  // the majority's content won
  EXPECT_TRUE(outcome[4].expect.empty());
}

TEST(CoordinatorSync, OneDifferingTensorIsExactlyWhatMoves) {
  Harness h;
  const auto peers = h.run_of(3);
  sync_round(h, peers, {state_vote(1, model(10)), state_vote(1, model(10)), state_vote(1, model(10))}, 1);
  auto flipped = model(20);
  flipped[1].hash.lo ^= 1;  // one bit of the large tensor differs on the last peer
  const std::vector<p::SyncVote> votes = {state_vote(2, model(20)), state_vote(2, model(20)), state_vote(2, flipped)};
  const auto plans = sync_round(h, peers, votes, 2);
  ASSERT_EQ(plans.size(), 3u);
  ASSERT_EQ(plans[2].expect.size(), 1u);
  EXPECT_EQ(plans[2].expect[0].tensor, 1u);
  EXPECT_EQ(check_plan(plans[2], votes[2]), 64 * kMiB);
  EXPECT_TRUE(plans[0].fetches.empty());
  EXPECT_TRUE(plans[1].fetches.empty());
}

TEST(CoordinatorSync, TieGoesToTheEarliestAcceptedPeer) {
  // Whichever digest sorts first, the content of the earliest-accepted peer wins.
  for (const auto& [early, late] : {std::pair<std::uint64_t, std::uint64_t>{10, 50}, {50, 10}}) {
    Harness h;
    const auto peers = h.run_of(2);
    const std::vector<p::SyncVote> votes = {state_vote(1, model(early)), state_vote(1, model(late))};
    const auto plans = sync_round(h, peers, votes, 1);
    ASSERT_EQ(plans.size(), 2u);
    EXPECT_TRUE(plans[0].expect.empty());
    ASSERT_EQ(plans[1].expect.size(), 3u);
    EXPECT_EQ(plans[1].expect[0].hash, votes[0].tensors[plans[1].expect[0].tensor].hash);
  }
}

TEST(CoordinatorSync, EveryHolderGoneMeansNoSharedStateUntilTheExactRevisionReturns) {
  Harness h;
  const auto peers = h.run_of(2);
  sync_round(h, peers, {state_vote(4, model(1)), state_vote(4, model(1))}, 4);
  h.disconnect(peers[0]);
  h.disconnect(peers[1]);
  EXPECT_EQ(h.c.revision(1), 4u);  // the master remembers the group's revision
  const FakePeer fresh = h.first(1);
  Outbox out = h.send(fresh, state_vote(0, model(2)));
  expect_sync_result(out, {fresh}, LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE);
  EXPECT_NE(one_of<p::SyncResult>(out, fresh.conn)->reason.find("revision 5"), std::string::npos);
  EXPECT_EQ(h.state(fresh), PeerState::kIdle);
  // A checkpoint of revision 4, advanced to 5 as the loop does: it becomes the holder.
  const auto plans = sync_round(h, {fresh}, {state_vote(5, model(1))}, 5);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_TRUE(plans[0].expect.empty());
}

TEST(CoordinatorSync, EveryPeerReceiveOnlyMeansNoSharedState) {
  Harness h;
  const auto peers = h.run_of(2);
  Outbox out = vote_sync(h, peers, {state_vote(1, model(1), p::SyncStrategy::kReceiveOnly),
                                    state_vote(1, model(1), p::SyncStrategy::kReceiveOnly)});
  expect_sync_result(out, peers, LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE);
  EXPECT_FALSE(h.c.revision(1).has_value());
}

TEST(CoordinatorSync, ContentInequalityIsToleratedBetweenUpToDatePeersOnly) {
  Harness h;
  auto peers = h.run_of(2);
  const auto with_stats = [](std::uint64_t stats, std::uint64_t content = 10) {
    auto t = model(content);
    t.push_back(tensor("local_stats", stats, 64, LOCKSTEP_F32, /*allow_inequality=*/true));
    return t;
  };
  const auto plans = sync_round(h, peers, {state_vote(1, with_stats(1)), state_vote(1, with_stats(2))}, 1);
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_TRUE(plans[0].expect.empty());
  EXPECT_TRUE(plans[1].expect.empty());
  const FakePeer n = h.join(1);
  h.update(peers, {n});
  peers.push_back(n);
  const std::vector<p::SyncVote> votes = {state_vote(2, with_stats(1)), state_vote(2, with_stats(2)),
                                          state_vote(0, with_stats(3, 0))};
  const auto next = sync_round(h, peers, votes, 2);
  ASSERT_EQ(next.size(), 3u);
  EXPECT_TRUE(next[0].expect.empty());
  EXPECT_TRUE(next[1].expect.empty());
  ASSERT_EQ(next[2].expect.size(), 4u);  // the newcomer receives the stats too, from their first holder
  for (const auto& e : next[2].expect) EXPECT_EQ(e.hash, votes[0].tensors[e.tensor].hash);
  for (const auto& f : next[2].fetches) {
    if (f.tensor == 3) { EXPECT_EQ(next[2].sources[f.source].id, peers[0].id); }
  }
}

TEST(CoordinatorSync, RevisionViolationRemovesOnlyThatPeer) {
  Harness h;
  const auto peers = h.run_of(3);
  sync_round(h, peers, {state_vote(1, model(1)), state_vote(1, model(1)), state_vote(1, model(1))}, 1);
  Outbox out = vote_sync(h, peers, {state_vote(2, model(2)), state_vote(2, model(2)), state_vote(3, model(2))});
  expect_goodbye(out, peers[2], LOCKSTEP_STATUS_REVISION_VIOLATION);
  EXPECT_TRUE(h.gone(peers[2]));
  const auto plan = one_of<p::SyncPlan>(out, peers[0].conn);
  ASSERT_TRUE(plan.has_value());
  out = sync_done(h, {peers[0], peers[1]}, plan->attempt);
  expect_sync_result(out, {peers[0], peers[1]}, LOCKSTEP_OK, 2);
}

TEST(CoordinatorSync, PeersThatCannotHoldTheElectedStateAreRemoved) {
  struct Case {
    const char* name;
    std::vector<p::TensorEntry> odd;
    const char* reason;
  };
  auto extra = model(1);
  extra.push_back(tensor("extra", 3));
  auto missing = model(1);
  missing.pop_back();
  auto resized = model(1);
  resized[0].count += 1;
  auto retyped = model(1);
  retyped[0].dtype = LOCKSTEP_F64;
  const std::vector<Case> cases = {{"extra key", extra, "'extra' is not in the elected"},
                                   {"missing key", missing, "'step' of the elected shared state is missing"},
                                   {"other count", resized, "'embedding' has 1025 elements"},
                                   {"other dtype", retyped, "'embedding' has 1024 elements of dtype 11"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    Harness h;
    const auto peers = h.run_of(3);
    Outbox out = vote_sync(h, peers, {state_vote(1, model(1)), state_vote(1, model(1)), state_vote(1, c.odd)});
    expect_goodbye(out, peers[2], LOCKSTEP_STATUS_SHARED_STATE_MISMATCH);
    EXPECT_NE(one_of<p::Goodbye>(out, peers[2].conn)->reason.find(c.reason), std::string::npos) << describe(out);
    const auto plan = one_of<p::SyncPlan>(out, peers[1].conn);
    ASSERT_TRUE(plan.has_value());
    expect_sync_result(sync_done(h, {peers[0], peers[1]}, plan->attempt), {peers[0], peers[1]}, LOCKSTEP_OK, 1);
  }
}

TEST(CoordinatorSync, SendOnlyPeersMustHoldTheElectedContent) {
  Harness h;
  const auto peers = h.run_of(4);
  const auto send_only = p::SyncStrategy::kSendOnly;
  // A send-only peer that agrees distributes and never receives.
  const std::vector<p::SyncVote> votes = {state_vote(1, model(1), send_only), state_vote(1, model(1)),
                                          state_vote(1, model(1)), state_vote(0, model(0))};
  const auto plans = sync_round(h, peers, votes, 1);
  ASSERT_EQ(plans.size(), 4u);
  EXPECT_TRUE(plans[0].expect.empty());
  std::set<PeerId> sources;
  for (const auto& s : plans[3].sources) sources.insert(s.id);
  EXPECT_EQ(sources.count(peers[0].id), 1u);
  // One that disagrees with the majority is removed; the others go on.
  Outbox out = vote_sync(h, peers, {state_vote(2, model(2)), state_vote(2, model(2)), state_vote(2, model(9), send_only),
                                    state_vote(2, model(2))});
  expect_goodbye(out, peers[2], LOCKSTEP_STATUS_SHARED_STATE_MISMATCH);
  const auto plan = one_of<p::SyncPlan>(out, peers[0].conn);
  ASSERT_TRUE(plan.has_value());
  expect_sync_result(sync_done(h, {peers[0], peers[1], peers[3]}, plan->attempt), {peers[0], peers[1], peers[3]},
                     LOCKSTEP_OK, 2);
}

TEST(CoordinatorSync, DistributorLostMidTransferFailsForAllAndTheRetryAvoidsIt) {
  Harness h;
  auto peers = h.run_of(3);
  sync_round(h, peers, {state_vote(1, model(1)), state_vote(1, model(1)), state_vote(1, model(1))}, 1);
  const FakePeer n = h.join(1);
  h.update(peers, {n});
  const std::vector<FakePeer> all = {peers[0], peers[1], peers[2], n};
  std::vector<p::SyncVote> votes = {state_vote(2, model(2)), state_vote(2, model(2)), state_vote(2, model(2)),
                                    state_vote(0, model(0))};
  Outbox out = vote_sync(h, all, votes);
  const auto plan = one_of<p::SyncPlan>(out, n.conn);
  ASSERT_TRUE(plan.has_value());
  std::set<PeerId> used;
  for (const auto& s : plan->sources) used.insert(s.id);
  EXPECT_EQ(used.size(), 3u);  // the 64 MiB tensor is spread over all three holders
  h.send(peers[0], p::SyncDone{plan->attempt, LOCKSTEP_OK, {}});
  out = h.disconnect(peers[1]);
  expect_sync_result(out, {peers[0], peers[2], n}, LOCKSTEP_STATUS_PEER_CONNECTION_LOST);
  EXPECT_EQ(h.c.revision(1), 1u);
  EXPECT_TRUE(h.c.syncs().empty());
  // A late report of the failed attempt changes nothing.
  EXPECT_EQ(send_count(h.send(n, p::SyncDone{plan->attempt, LOCKSTEP_OK, {}})), 0u);
  // The retry (same revisions: nothing advanced) plans around the lost distributor.
  const std::vector<FakePeer> survivors = {peers[0], peers[2], n};
  const auto retry = sync_round(h, survivors, {votes[0], votes[2], votes[3]}, 2);
  ASSERT_EQ(retry.size(), 3u);
  for (const auto& s : retry[2].sources) EXPECT_NE(s.id, peers[1].id);
  EXPECT_NE(retry[2].attempt, plan->attempt);
}

TEST(CoordinatorSync, FailedVerificationFailsTheSyncForEveryone) {
  Harness h;
  const auto peers = h.run_of(3);
  Outbox out = vote_sync(h, peers, {state_vote(1, model(1)), state_vote(1, model(1)), state_vote(0, model(0))});
  const auto plan = one_of<p::SyncPlan>(out, peers[2].conn);
  ASSERT_TRUE(plan.has_value());
  h.send(peers[0], p::SyncDone{plan->attempt, LOCKSTEP_OK, {}});
  out = h.send(peers[2], p::SyncDone{plan->attempt, LOCKSTEP_STATUS_HASH_MISMATCH, "tensor 'weights' did not verify"});
  expect_sync_result(out, peers, LOCKSTEP_STATUS_HASH_MISMATCH);
  EXPECT_NE(one_of<p::SyncResult>(out, peers[0].conn)->reason.find("did not verify"), std::string::npos);
  EXPECT_FALSE(h.c.revision(1).has_value());
}

TEST(CoordinatorSync, ManyReceiversSpreadOverEveryHolder) {
  Harness h;
  auto peers = h.run_of(3);
  sync_round(h, peers, {state_vote(1, model(1)), state_vote(1, model(1)), state_vote(1, model(1))}, 1);
  std::vector<FakePeer> newcomers = {h.join(1), h.join(1), h.join(1), h.join(1), h.join(1), h.join(1)};
  h.update(peers, newcomers);
  std::vector<FakePeer> all = peers;
  all.insert(all.end(), newcomers.begin(), newcomers.end());
  std::vector<p::SyncVote> votes(3, state_vote(2, model(2)));
  for (std::size_t i = 0; i < newcomers.size(); ++i) votes.push_back(state_vote(0, model(0), p::SyncStrategy::kReceiveOnly));
  const auto plans = sync_round(h, all, votes, 2);
  ASSERT_EQ(plans.size(), all.size());
  std::map<PeerId, std::uint64_t> load;
  for (std::size_t i = 3; i < plans.size(); ++i) {
    for (const auto& f : plans[i].fetches) load[plans[i].sources[f.source].id] += f.bytes;
  }
  ASSERT_EQ(load.size(), 3u);
  const auto [low, high] = std::minmax_element(load.begin(), load.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  EXPECT_LE(high->second - low->second, 16 * kMiB) << "the load differs by more than one piece";
}

TEST(CoordinatorSync, IllegalSyncRequests) {
  Harness h;
  const auto peers = h.run_of(2);
  const FakePeer n = h.join(1);
  auto refused = [&](const FakePeer& f, const p::Message& m, StatusCode status) {
    const std::string before = h.c.digest();
    Outbox out = h.send(f, m);
    const auto r = one_of<p::Refused>(out, f.conn);
    ASSERT_TRUE(r.has_value()) << describe(out);
    EXPECT_EQ(r->status, status);
    EXPECT_EQ(r->request, p::MsgType::kSyncVote);
    EXPECT_EQ(h.c.digest(), before);
  };
  refused(n, state_vote(1, model(1)), LOCKSTEP_STATUS_NOT_INITIALIZED);
  refused(peers[0], state_vote(1, {tensor("a", 1), tensor("a", 2)}), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  refused(peers[0], state_vote(1, {tensor("huge", 1, std::uint64_t{1} << 62)}), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  h.send(peers[0], p::CollectiveInit{3, kSum});
  refused(peers[0], state_vote(1, model(1)), LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS);
  // A sync vote while another peer waits in a collective vote: the collective can never
  // start, so it fails for its voters; the sync then completes.
  Outbox out = h.send(peers[1], state_vote(1, model(1)));
  const auto r = one_of<p::CollectiveResult>(out, peers[0].conn);
  ASSERT_TRUE(r.has_value()) << describe(out);
  EXPECT_EQ(r->status, LOCKSTEP_STATUS_OPERATION_MISMATCH);
  refused(peers[1], state_vote(1, model(1)), LOCKSTEP_STATUS_INVALID_USAGE);  // already voted
  out = h.send(peers[0], state_vote(1, model(1)));
  EXPECT_TRUE(one_of<p::SyncPlan>(out, peers[0].conn).has_value());
}

TEST(CoordinatorSync, SyncAgainstTopologyVoteIsAMismatchNotAHang) {
  Harness h;
  const auto peers = h.run_of(2);
  h.send(peers[0], state_vote(1, model(1)));
  Outbox out = h.send(peers[1], p::VoteUpdateTopology{});
  expect_sync_result(out, {peers[0]}, LOCKSTEP_STATUS_OPERATION_MISMATCH);
  expect_topology_failed(out, peers[1], LOCKSTEP_STATUS_OPERATION_MISMATCH);
  EXPECT_TRUE(h.c.syncs().empty());
}

TEST(CoordinatorSync, StragglerOfASyncVoteIsRemovedByTheVoteTimeout) {
  Config config = test_config();
  config.vote_timeout_ms = 1'000;
  Harness h(config);
  const auto peers = h.run_of(3);
  h.send(peers[0], state_vote(1, model(1)));
  h.send(peers[1], state_vote(1, model(1)));
  h.now += 1'500;
  h.heartbeat({peers[0], peers[1]});
  Outbox out = h.tick();
  expect_goodbye(out, peers[2], LOCKSTEP_STATUS_KICKED);
  EXPECT_TRUE(one_of<p::SyncPlan>(out, peers[0].conn).has_value()) << describe(out);
}

// ---------------------------------------------------------------- optimize topology

// Answers bandwidth tests until the measurements end: each tested peer reports the rate
// `rate(sender, receiver)` from its partner. Returns the outbox that ended them (with
// the EstablishP2P or the failure) and the rounds seen.
struct Measured {
  Outbox out;
  std::vector<std::vector<std::pair<PeerId, PeerId>>> rounds;  // (receiver, sender)
};
Measured answer_tests(Harness& h, const std::vector<FakePeer>& peers, Outbox out,
                      const std::function<std::uint64_t(PeerId, PeerId)>& rate) {
  Measured m;
  for (int guard = 0; guard < 64; ++guard) {
    std::vector<std::pair<const FakePeer*, p::BandwidthTest>> tests;
    for (const auto& f : peers) {
      for (const auto& t : all_of<p::BandwidthTest>(out, f.conn)) tests.emplace_back(&f, t);
    }
    if (tests.empty()) break;
    std::vector<std::pair<PeerId, PeerId>> round;
    for (const auto& [f, t] : tests) round.emplace_back(f->id, t.partner.id);
    m.rounds.push_back(round);
    Outbox last;
    for (const auto& [f, t] : tests) {
      Outbox o = h.send(*f, p::BandwidthReport{t.test, t.partner.id, rate(t.partner.id, f->id)});
      last.insert(last.end(), o.begin(), o.end());
    }
    out = last;
  }
  m.out = out;
  return m;
}

// Four peers whose join order 0-1-2-3 has slow edges; the only ring with every edge
// fast is 0->2->1->3->0 (100 MB/s); everything else is 10 MB/s.
std::uint64_t planted_rate(const std::vector<FakePeer>& peers, PeerId from, PeerId to) {
  const auto index = [&](PeerId id) {
    for (std::size_t i = 0; i < peers.size(); ++i) {
      if (peers[i].id == id) return static_cast<int>(i);
    }
    return -1;
  };
  const int a = index(from);
  const int b = index(to);
  const bool fast = (a == 0 && b == 2) || (a == 2 && b == 1) || (a == 1 && b == 3) || (a == 3 && b == 0);
  return fast ? 100'000'000 : 10'000'000;
}

TEST(CoordinatorOptimize, MeasuresEveryPairInRoundsThenRewiresInTheSolversOrder) {
  Harness h;
  const auto peers = h.run_of(4);
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::VoteOptimizeTopology{});
  const auto rate = [&](PeerId from, PeerId to) { return planted_rate(peers, from, to); };
  const Measured m = answer_tests(h, peers, out, rate);
  // Circle method: 3 rounds for 4 peers, every peer in each round, each pair once.
  ASSERT_EQ(m.rounds.size(), 3u);
  std::set<std::pair<PeerId, PeerId>> seen;
  for (const auto& round : m.rounds) {
    std::set<PeerId> busy;
    for (const auto& [receiver, sender] : round) {
      EXPECT_TRUE(busy.insert(receiver).second) << "a peer tested twice in one round";
      EXPECT_TRUE(seen.insert({sender, receiver}).second);
    }
  }
  EXPECT_EQ(seen.size(), 12u);
  EXPECT_EQ(h.c.bandwidth().size(), 12u);
  const std::vector<PeerId> best = {peers[0].id, peers[2].id, peers[1].id, peers[3].id};
  for (const auto& f : peers) {
    const auto e = one_of<p::EstablishP2P>(m.out, f.conn);
    ASSERT_TRUE(e.has_value()) << describe(m.out);
    EXPECT_EQ(ids_of(e->ring), best);
  }
  out = h.report_all(peers);
  for (const auto& f : peers) {
    const auto r = one_of<p::TopologyResult>(out, f.conn);
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->status, LOCKSTEP_OK);
    EXPECT_EQ(ids_of(r->ring), best);
  }
  EXPECT_EQ(h.c.ring(1), best);
  // A second optimization with the same peers measures nothing and keeps the ring.
  for (const auto& f : peers) out = h.send(f, p::VoteOptimizeTopology{});
  for (const auto& f : peers) {
    EXPECT_TRUE(all_of<p::BandwidthTest>(out, f.conn).empty());
    const auto e = one_of<p::EstablishP2P>(out, f.conn);
    ASSERT_TRUE(e.has_value()) << describe(out);
    EXPECT_EQ(ids_of(e->ring), best);
  }
  h.report_all(peers);
  EXPECT_EQ(h.c.ring(1), best);
}

// Peers that accept no inbound connection (docs/deployment.md, "NAT"): each bandwidth
// test is dialled towards the side that accepts connections, a pair where neither does is
// not tested (it cannot connect) but given a bandwidth of 0, and the ring keeps them apart.
// Four accepted peers: a and b accept connections, c and d none (joined a, c, b, d).
std::vector<FakePeer> two_unreachable_of_four(Harness& h) {
  const FakePeer a = h.first(1);
  const FakePeer c = h.join_as(1, false);
  const FakePeer b = h.join_as(1, true);
  const FakePeer d = h.join_as(1, false);
  h.update({a}, {c, b, d});
  return {a, b, c, d};
}

TEST(CoordinatorOptimize, UnreachablePeersAreDialledNeverAndNeverNeighbours) {
  Harness h;
  const std::vector<FakePeer> peers = two_unreachable_of_four(h);
  const FakePeer &a = peers[0], &c = peers[2], &d = peers[3];
  const auto unreachable = [&](PeerId id) { return id == c.id || id == d.id; };
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::VoteOptimizeTopology{});
  std::set<std::pair<PeerId, PeerId>> tested;
  for (int guard = 0; guard < 16; ++guard) {
    Outbox last;
    bool any = false;
    for (const auto& f : peers) {
      for (const auto& t : all_of<p::BandwidthTest>(out, f.conn)) {
        any = true;
        // The initiator dials its partner: the partner accepts connections.
        if (unreachable(t.partner.id)) {
          EXPECT_FALSE(t.initiator) << f.id.to_string();
        }
        if (unreachable(f.id)) {
          EXPECT_TRUE(t.initiator) << f.id.to_string();
        }
        EXPECT_FALSE(unreachable(f.id) && unreachable(t.partner.id));
        tested.insert({t.partner.id, f.id});
        Outbox o = h.send(f, p::BandwidthReport{t.test, t.partner.id, 10'000'000});
        last.insert(last.end(), o.begin(), o.end());
      }
    }
    if (!any) break;
    out = last;
  }
  EXPECT_EQ(tested.size(), 10u);  // 5 pairs of the 6, both ways
  EXPECT_EQ(h.c.bandwidth().size(), 12u);
  EXPECT_EQ(h.c.bandwidth().at({c.id, d.id}), 0u);
  const auto e = one_of<p::EstablishP2P>(out, a.conn);
  ASSERT_TRUE(e.has_value()) << describe(out);
  const std::vector<PeerId> ring = ids_of(e->ring);
  ASSERT_EQ(ring.size(), 4u);
  for (std::size_t k = 0; k < ring.size(); ++k) {
    EXPECT_FALSE(unreachable(ring[k]) && unreachable(ring[(k + 1) % ring.size()])) << k;
  }
}

// With a relay, two peers that both accept no inbound connection are measured through
// it (the smaller id initiates), as their edge would run, instead of being given 0.
TEST(CoordinatorOptimize, WithARelayUnreachablePairsAreMeasuredThroughIt) {
  Harness h(relay_config());
  const std::vector<FakePeer> peers = two_unreachable_of_four(h);
  const FakePeer &c = peers[2], &d = peers[3];
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::VoteOptimizeTopology{});
  bool relayed_test = false;
  for (const auto& t : all_of<p::BandwidthTest>(out, c.conn)) {
    if (t.partner.id == d.id) {
      relayed_test = true;
      EXPECT_EQ(t.initiator, c.id < d.id);
    }
  }
  const Measured m = answer_tests(h, peers, out, [](PeerId, PeerId) { return 10'000'000; });
  for (const auto& round : m.rounds) {
    for (const auto& [receiver, sender] : round) relayed_test |= receiver == d.id && sender == c.id;
  }
  EXPECT_TRUE(relayed_test);
  EXPECT_EQ(h.c.bandwidth().size(), 12u);
  EXPECT_EQ(h.c.bandwidth().at({c.id, d.id}), 10'000'000u);
  EXPECT_EQ(h.c.bandwidth().at({d.id, c.id}), 10'000'000u);
}

TEST(CoordinatorOptimize, PeerLostDuringMeasurementsFailsForAllAndTheRetryMeasuresWhatIsMissing) {
  Harness h;
  const auto peers = h.run_of(4);
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::VoteOptimizeTopology{});
  // Answer the first round only.
  std::vector<std::pair<const FakePeer*, p::BandwidthTest>> first;
  for (const auto& f : peers) {
    for (const auto& t : all_of<p::BandwidthTest>(out, f.conn)) first.emplace_back(&f, t);
  }
  ASSERT_EQ(first.size(), 4u);
  for (const auto& [f, t] : first) h.send(*f, p::BandwidthReport{t.test, t.partner.id, 50'000'000});
  EXPECT_EQ(h.c.bandwidth().size(), 4u);
  out = h.disconnect(peers[3]);
  const std::vector<FakePeer> survivors = {peers[0], peers[1], peers[2]};
  for (const auto& f : survivors) {
    const auto r = one_of<p::TopologyResult>(out, f.conn);
    ASSERT_TRUE(r.has_value()) << describe(out);
    EXPECT_EQ(r->status, LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED);
    EXPECT_NE(r->reason.find("lost during the bandwidth measurements"), std::string::npos);
    EXPECT_EQ(h.state(f), PeerState::kIdle);
  }
  for (const auto& [edge, rate] : h.c.bandwidth()) {
    EXPECT_NE(edge.first, peers[3].id);
    EXPECT_NE(edge.second, peers[3].id);
  }
  const std::size_t kept = h.c.bandwidth().size();
  EXPECT_EQ(kept, 2u);  // the first round's pair among the survivors
  for (const auto& f : survivors) out = h.send(f, p::VoteOptimizeTopology{});
  const Measured m = answer_tests(h, survivors, out, [](PeerId, PeerId) { return std::uint64_t{70'000'000}; });
  std::size_t tests = 0;
  for (const auto& round : m.rounds) tests += round.size();
  EXPECT_EQ(tests, 4u);  // two pairs left, both directions
  for (const auto& f : survivors) EXPECT_TRUE(one_of<p::EstablishP2P>(m.out, f.conn).has_value()) << describe(m.out);
  out = h.report_all(survivors);
  for (const auto& f : survivors) EXPECT_EQ(one_of<p::TopologyResult>(out, f.conn)->status, LOCKSTEP_OK);
  EXPECT_EQ(h.c.bandwidth().size(), 6u);
}

TEST(CoordinatorOptimize, RegisteredPeersWaitForTheNextUpdate) {
  Harness h;
  const auto peers = h.run_of(3);
  const FakePeer n = h.join(1);
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::VoteOptimizeTopology{});
  EXPECT_TRUE(sent_to(out, n.conn).empty()) << describe(out);
  const Measured m = answer_tests(h, peers, out, [](PeerId, PeerId) { return std::uint64_t{1'000'000}; });
  EXPECT_TRUE(sent_to(m.out, n.conn).empty());
  out = h.report_all(peers);
  for (const auto& f : peers) EXPECT_EQ(one_of<p::TopologyResult>(out, f.conn)->ring.size(), 3u);
  EXPECT_EQ(h.phase(n), Phase::kRegistered);
  for (const auto& f : peers) out = h.send(f, p::VotePeersPending{});
  for (const auto& f : peers) EXPECT_TRUE(one_of<p::PeersPendingResult>(out, f.conn)->pending);
  h.update(peers, {n});
  EXPECT_EQ(h.c.ring(1).size(), 4u);
}

TEST(CoordinatorOptimize, IllegalAndMismatchedVotes) {
  Harness h;
  const auto peers = h.run_of(2);
  // A collective in flight: refused.
  h.send(peers[0], p::CollectiveInit{1, kSum});
  Outbox out = h.send(peers[0], p::VoteOptimizeTopology{});
  ASSERT_TRUE(one_of<p::Refused>(out, peers[0].conn).has_value());
  EXPECT_EQ(one_of<p::Refused>(out, peers[0].conn)->status, LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS);
  const auto go = one_of<p::CollectiveGo>(h.send(peers[1], p::CollectiveInit{1, kSum}), peers[1].conn);
  ASSERT_TRUE(go.has_value());
  for (const auto& f : peers) h.send(f, p::CollectiveDone{1, go->attempt, true, {}});
  EXPECT_TRUE(h.c.collectives().empty());
  // One peer votes optimize, the other update: a mismatch, not a hang.
  h.send(peers[0], p::VoteOptimizeTopology{});
  out = h.send(peers[1], p::VoteUpdateTopology{});
  for (const auto& f : peers) expect_topology_failed(out, f, LOCKSTEP_STATUS_OPERATION_MISMATCH);
  // A report of no current test (one that crossed a failure on the wire) changes nothing.
  const std::string before = h.c.digest();
  out = h.send(peers[0], p::BandwidthReport{1, peers[1].id, 5});
  EXPECT_EQ(send_count(out), 0u) << describe(out);
  EXPECT_EQ(h.c.digest(), before);
}

TEST(CoordinatorOptimize, SilentMeasurerIsRemovedAfterTheRoundTimeout) {
  Config config = test_config();
  config.measure_round_timeout_ms = 2'000;
  Harness h(config);
  const auto peers = h.run_of(3);
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::VoteOptimizeTopology{});
  // The first tested peer answers; its partner stays silent.
  std::optional<PeerId> silent;
  for (const auto& f : peers) {
    for (const auto& t : all_of<p::BandwidthTest>(out, f.conn)) {
      if (!silent) {
        h.send(f, p::BandwidthReport{t.test, t.partner.id, 1});
        silent = t.partner.id;
      }
    }
  }
  ASSERT_TRUE(silent.has_value());
  h.now += 2'500;
  h.heartbeat(peers);
  out = h.tick();
  const FakePeer& victim = peers[1].id == *silent ? peers[1] : peers[2];
  expect_goodbye(out, victim, LOCKSTEP_STATUS_KICKED);
  for (const auto& f : peers) {
    if (f.id == victim.id) continue;
    EXPECT_EQ(one_of<p::TopologyResult>(out, f.conn)->status, LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED);
  }
}

TEST(CoordinatorOptimize, PeerLostDuringTheRewiringFailsTheOptimization) {
  Harness h;
  const auto peers = h.run_of(3);
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::VoteOptimizeTopology{});
  const Measured m = answer_tests(h, peers, out, [](PeerId, PeerId) { return std::uint64_t{1'000'000}; });
  for (const auto& f : peers) ASSERT_TRUE(one_of<p::EstablishP2P>(m.out, f.conn).has_value());
  h.send(peers[0], p::P2PReport{h.c.epoch(), {}});
  out = h.disconnect(peers[2]);
  for (const auto& f : {peers[0], peers[1]}) {
    expect_topology_failed(out, f, LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED);
  }
  // The retry measures nothing new (the lost peer's edges are forgotten) and succeeds.
  for (const auto& f : {peers[0], peers[1]}) out = h.send(f, p::VoteOptimizeTopology{});
  for (const auto& f : {peers[0], peers[1]}) EXPECT_TRUE(one_of<p::EstablishP2P>(out, f.conn).has_value());
  out = h.report_all({peers[0], peers[1]});
  for (const auto& f : {peers[0], peers[1]}) EXPECT_EQ(one_of<p::TopologyResult>(out, f.conn)->status, LOCKSTEP_OK);
}

// Measured rates of 1-101 MB/s, drawn per ordered pair.
std::map<std::pair<PeerId, PeerId>, std::uint64_t> random_rates(const std::vector<FakePeer>& peers,
                                                                std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::map<std::pair<PeerId, PeerId>, std::uint64_t> rates;
  for (const auto& a : peers) {
    for (const auto& b : peers) rates[{a.id, b.id}] = 1'000'000 + rng() % 100'000'000;
  }
  return rates;
}

// Above the exact solver's size the ring is a heuristic one; the background search keeps
// improving it between optimizations, and the next optimization of the same group never
// adopts a worse ring.
TEST(CoordinatorOptimize, BackgroundSearchNeverMakesTheRingWorse) {
  Config config = test_config();
  config.solver_steps = 20'000;  // small: the first ring is the heuristic's
  Harness h(config);
  const auto peers = h.run_of(18);
  const auto rates = random_rates(peers, 3);
  const auto rate = [&](PeerId from, PeerId to) { return rates.at({from, to}); };
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::VoteOptimizeTopology{});
  answer_tests(h, peers, out, rate);
  h.report_all(peers);
  const auto first = h.c.ring(1);
  const double first_bottleneck = topo::ring_bottleneck(h.c.bandwidth_matrix(first), [&] {
    std::vector<int> order(first.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    return order;
  }());
  for (int i = 0; i < 50; ++i) {
    h.heartbeat(peers);
    h.advance(10);
  }
  for (const auto& f : peers) out = h.send(f, p::VoteOptimizeTopology{});
  for (const auto& f : peers) EXPECT_TRUE(all_of<p::BandwidthTest>(out, f.conn).empty());
  h.report_all(peers);
  const auto second = h.c.ring(1);
  std::vector<int> order(second.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  EXPECT_GE(topo::ring_bottleneck(h.c.bandwidth_matrix(second), order), first_bottleneck);
}

// A large group's search never proves its ring optimal: it rests once it has gone
// background_solver_stall_steps without a better ring, instead of taking a share of the
// loop for ever.
TEST(CoordinatorOptimize, BackgroundSearchRestsWhenItStopsImproving) {
  Config config = test_config();
  config.solver_steps = 20'000;
  config.background_solver_steps_per_tick = 20'000;
  config.background_solver_stall_steps = 200'000;
  Harness h(config);
  const auto peers = h.run_of(18);
  const auto rates = random_rates(peers, 5);
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::VoteOptimizeTopology{});
  answer_tests(h, peers, out, [&](PeerId from, PeerId to) { return rates.at({from, to}); });
  h.report_all(peers);
  const auto run_ticks = [&](int ticks) {
    for (int i = 0; i < ticks; ++i) {
      h.heartbeat(peers);
      h.advance(10);
    }
    return h.c.background_search_steps(1);
  };
  const std::uint64_t early = run_ticks(2);
  EXPECT_GT(early, 0u);
  const std::uint64_t rested = run_ticks(400);
  EXPECT_GT(rested, early);
  EXPECT_EQ(run_ticks(400), rested);  // resting: no more steps
}


// ---- the key-value store (kv_store.h, docs/collectives.md)

std::vector<p::KvResult> kv_results(const Outbox& out, ConnId conn) { return all_of<p::KvResult>(out, conn); }

p::KvResult kv_one(const Outbox& out, const FakePeer& peer) {
  const auto results = kv_results(out, peer.conn);
  EXPECT_EQ(results.size(), 1u) << describe(out);
  return results.empty() ? p::KvResult{~0ull, LOCKSTEP_STATUS_INTERNAL_ERROR, "no answer"} : results[0];
}

std::vector<std::uint8_t> bytes_of(const std::string& text) { return {text.begin(), text.end()}; }

// A registered peer (not yet accepted) may use the store, as may accepted ones.
TEST(CoordinatorKv, SetGetOverwriteDelete) {
  Harness h;
  const auto accepted = h.run_of(1);
  const FakePeer newcomer = h.join(0);
  auto r = kv_one(h.send(accepted[0], p::KvRequest{1, p::KvOp::kSet, "run/step", bytes_of("41")}), accepted[0]);
  EXPECT_EQ(r.request, 1u);
  EXPECT_EQ(r.status, LOCKSTEP_OK);
  r = kv_one(h.send(newcomer, p::KvRequest{7, p::KvOp::kGet, "run/step"}), newcomer);
  EXPECT_EQ(r.request, 7u);
  EXPECT_EQ(r.status, LOCKSTEP_OK);
  EXPECT_EQ(r.value, bytes_of("41"));
  EXPECT_EQ(kv_one(h.send(newcomer, p::KvRequest{8, p::KvOp::kSet, "run/step", bytes_of("42000")}), newcomer).status,
            LOCKSTEP_OK);
  EXPECT_EQ(kv_one(h.send(accepted[0], p::KvRequest{2, p::KvOp::kGet, "run/step"}), accepted[0]).value,
            bytes_of("42000"));
  EXPECT_EQ(h.c.kv().keys(), 1u);
  EXPECT_EQ(h.c.kv().bytes(), std::string("run/step").size() + 5);
  // An empty value is a value.
  EXPECT_EQ(kv_one(h.send(accepted[0], p::KvRequest{3, p::KvOp::kSet, "flag"}), accepted[0]).status, LOCKSTEP_OK);
  r = kv_one(h.send(accepted[0], p::KvRequest{4, p::KvOp::kGet, "flag"}), accepted[0]);
  EXPECT_EQ(r.status, LOCKSTEP_OK);
  EXPECT_TRUE(r.value.empty());
  EXPECT_EQ(kv_one(h.send(newcomer, p::KvRequest{9, p::KvOp::kDelete, "run/step"}), newcomer).status, LOCKSTEP_OK);
  r = kv_one(h.send(newcomer, p::KvRequest{10, p::KvOp::kGet, "run/step"}), newcomer);
  EXPECT_EQ(r.status, LOCKSTEP_STATUS_KEY_NOT_FOUND);
  EXPECT_NE(r.reason.find("run/step"), std::string::npos) << r.reason;
  EXPECT_EQ(kv_one(h.send(newcomer, p::KvRequest{11, p::KvOp::kDelete, "run/step"}), newcomer).status, LOCKSTEP_OK);
  EXPECT_EQ(h.c.kv().keys(), 1u);
  EXPECT_EQ(h.c.kv().bytes(), 4u);
}

// Waits are answered at once when the key is set, else when any peer sets it (every
// waiter of the key, with its own request id), else TIMEOUT at the deadline.
TEST(CoordinatorKv, WaitsEndWhenTheKeyIsSetOrAtTheirDeadline) {
  Harness h;
  const auto peers = h.run_of(3);
  EXPECT_EQ(send_count(h.send(peers[1], p::KvRequest{5, p::KvOp::kWait, "ckpt", {}, 0})), 0u);
  EXPECT_EQ(send_count(h.send(peers[2], p::KvRequest{6, p::KvOp::kWait, "ckpt", {}, 60'000})), 0u);
  EXPECT_EQ(send_count(h.send(peers[2], p::KvRequest{7, p::KvOp::kWait, "other", {}, 0})), 0u);
  EXPECT_EQ(h.c.kv().waits(), 3u);
  Outbox out = h.send(peers[0], p::KvRequest{1, p::KvOp::kSet, "ckpt", bytes_of("/ckpt/100")});
  EXPECT_EQ(kv_one(out, peers[0]).status, LOCKSTEP_OK);
  const auto r1 = kv_one(out, peers[1]);
  EXPECT_EQ(r1.request, 5u);
  EXPECT_EQ(r1.status, LOCKSTEP_OK);
  EXPECT_EQ(r1.value, bytes_of("/ckpt/100"));
  const auto r2 = kv_one(out, peers[2]);
  EXPECT_EQ(r2.request, 6u);
  EXPECT_EQ(r2.value, bytes_of("/ckpt/100"));
  EXPECT_EQ(h.c.kv().waits(), 1u);  // "other" still waits
  // A key already set answers at once.
  const auto now = kv_one(h.send(peers[1], p::KvRequest{8, p::KvOp::kWait, "ckpt", {}, 10}), peers[1]);
  EXPECT_EQ(now.value, bytes_of("/ckpt/100"));
  // A deadline: nothing before it, TIMEOUT at it.
  EXPECT_EQ(send_count(h.send(peers[0], p::KvRequest{2, p::KvOp::kWait, "late", {}, 100})), 0u);
  h.heartbeat(peers);
  EXPECT_TRUE(kv_results(h.advance(99), peers[0].conn).empty());
  const auto timed_out = kv_one(h.advance(1), peers[0]);
  EXPECT_EQ(timed_out.request, 2u);
  EXPECT_EQ(timed_out.status, LOCKSTEP_STATUS_TIMEOUT);
  EXPECT_NE(timed_out.reason.find("late"), std::string::npos) << timed_out.reason;
  EXPECT_EQ(h.c.kv().waits(), 1u);
}

// A peer that leaves takes its waits with it; the store's keys stay.
TEST(CoordinatorKv, TheWaitsOfAPeerThatLeftAreForgotten) {
  Harness h;
  const auto peers = h.run_of(2);
  h.send(peers[0], p::KvRequest{1, p::KvOp::kSet, "kept", bytes_of("v")});
  h.send(peers[1], p::KvRequest{2, p::KvOp::kWait, "never", {}, 0});
  EXPECT_EQ(h.c.kv().waits(), 1u);
  h.disconnect(peers[1]);
  EXPECT_EQ(h.c.kv().waits(), 0u);
  const Outbox out = h.send(peers[0], p::KvRequest{3, p::KvOp::kSet, "never", bytes_of("x")});
  EXPECT_EQ(send_count(out), 1u) << describe(out);  // only the setter's answer
  EXPECT_EQ(kv_one(h.send(peers[0], p::KvRequest{4, p::KvOp::kGet, "kept"}), peers[0]).value, bytes_of("v"));
}

// Every bound is a flag, answered LIMIT_EXCEEDED (malformed requests INVALID_ARGUMENT or
// INVALID_USAGE) with the reason, and a refused request changes nothing.
TEST(CoordinatorKv, BoundsAreRefusedAndChangeNothing) {
  Config config = test_config();
  config.kv = KvConfig{2, 4, 8, 2};
  Harness h(config);
  const auto peers = h.run_of(1);
  const FakePeer& a = peers[0];
  ASSERT_EQ(kv_one(h.send(a, p::KvRequest{1, p::KvOp::kSet, "k1", bytes_of("12345678")}), a).status, LOCKSTEP_OK);
  ASSERT_EQ(kv_one(h.send(a, p::KvRequest{2, p::KvOp::kSet, "k2", {}}), a).status, LOCKSTEP_OK);
  ASSERT_EQ(send_count(h.send(a, p::KvRequest{3, p::KvOp::kWait, "w1", {}, 0})), 0u);  // no answer yet
  struct Case {
    p::KvRequest request;
    StatusCode status;
    std::string reason;
  };
  const std::vector<Case> cases = {
      {p::KvRequest{10, p::KvOp::kSet, "k3", {}}, LOCKSTEP_STATUS_LIMIT_EXCEEDED, "--kv-keys-max"},
      {p::KvRequest{11, p::KvOp::kSet, "long1", {}}, LOCKSTEP_STATUS_LIMIT_EXCEEDED, "--kv-key-bytes-max"},
      {p::KvRequest{12, p::KvOp::kGet, "long1"}, LOCKSTEP_STATUS_LIMIT_EXCEEDED, "--kv-key-bytes-max"},
      {p::KvRequest{13, p::KvOp::kSet, "k1", bytes_of("123456789")}, LOCKSTEP_STATUS_LIMIT_EXCEEDED,
       "--kv-value-bytes-max"},
      {p::KvRequest{14, p::KvOp::kSet, "", {}}, LOCKSTEP_STATUS_INVALID_ARGUMENT, "empty key"},
      {p::KvRequest{15, p::KvOp::kGet, "k1", bytes_of("x")}, LOCKSTEP_STATUS_INVALID_ARGUMENT, "takes none"},
      {p::KvRequest{16, p::KvOp::kDelete, "k1", {}, 5}, LOCKSTEP_STATUS_INVALID_ARGUMENT, "takes none"},
      {p::KvRequest{3, p::KvOp::kWait, "w1", {}, 0}, LOCKSTEP_STATUS_INVALID_USAGE, "already waiting"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.reason);
    const std::string before = h.c.digest();
    const auto r = kv_one(h.send(a, c.request), a);
    EXPECT_EQ(r.request, c.request.request);
    EXPECT_EQ(r.status, c.status) << r.reason;
    EXPECT_NE(r.reason.find(c.reason), std::string::npos) << r.reason;
    EXPECT_EQ(h.c.digest(), before);
  }
  // Waits per peer: the second is taken, the third refused.
  EXPECT_EQ(send_count(h.send(a, p::KvRequest{4, p::KvOp::kWait, "w2", {}, 0})), 0u);
  const std::string before = h.c.digest();
  const auto r = kv_one(h.send(a, p::KvRequest{5, p::KvOp::kWait, "w3", {}, 0}), a);
  EXPECT_EQ(r.status, LOCKSTEP_STATUS_LIMIT_EXCEEDED);
  EXPECT_NE(r.reason.find("2 waits open"), std::string::npos) << r.reason;
  EXPECT_EQ(h.c.digest(), before);
  // A full store still takes new values for its keys, and room made by a delete.
  EXPECT_EQ(kv_one(h.send(a, p::KvRequest{6, p::KvOp::kSet, "k2", bytes_of("new")}), a).status, LOCKSTEP_OK);
  EXPECT_EQ(kv_one(h.send(a, p::KvRequest{7, p::KvOp::kDelete, "k1"}), a).status, LOCKSTEP_OK);
  EXPECT_EQ(kv_one(h.send(a, p::KvRequest{8, p::KvOp::kSet, "k3", {}}), a).status, LOCKSTEP_OK);
  EXPECT_EQ(h.c.kv().keys(), 2u);
}


// ---------------------------------------------------------------- failover (recovery.cpp)

// Ids a lost master gave out (another instance nonce than this one's).
PeerId old_id(std::uint64_t n) { return PeerId{0xabcdef0000000000ull, n}; }

// A report of a peer in the view `view` of `epoch`, nothing in flight.
p::ResumeReport report_of(std::uint64_t epoch, const std::vector<PeerId>& view) {
  p::ResumeReport r;
  r.epoch = epoch;
  r.view = view;
  r.epoch_seen = epoch;
  r.attempt_seen = 40;
  return r;
}

// A peer of the lost master's run asks to be taken back; returns it with the Welcome's
// term (nothing if it was refused).
struct Returning {
  FakePeer peer;
  std::optional<p::Welcome> welcome;
  Outbox out;
};
// Lets the recovery window pass, the peers heartbeating (it is as long as their timeout).
Outbox pass_window(Harness& h, const std::vector<FakePeer>& peers) {
  h.heartbeat(peers);
  h.advance(limits::kRecoveryWindowMsDefault - 1);
  h.heartbeat(peers);
  return h.advance(1);
}

Returning come_back(Harness& h, PeerId id, std::uint64_t term, std::uint32_t group = 1) {
  Returning r;
  r.peer.conn = h.next_conn++;
  r.peer.id = id;
  r.peer.group = group;
  r.peer.host = "10.1.0." + std::to_string(r.peer.conn);
  h.connect(r.peer.conn, r.peer.host);
  p::Hello hello = Harness::hello(group, static_cast<std::uint16_t>(30000 + 3 * r.peer.conn));
  hello.resume_id = id;
  hello.term = term;
  r.out = h.send(r.peer.conn, hello);
  const auto welcomes = all_of<p::Welcome>(r.out, r.peer.conn);
  if (welcomes.size() == 1) r.welcome = welcomes.front();
  return r;
}

TEST(CoordinatorRecovery, AFreshMasterTakesBackEveryPeerOfTheLastView) {
  Harness h;
  const std::vector<PeerId> view{old_id(1), old_id(2), old_id(3)};
  std::vector<FakePeer> peers;
  Outbox last;
  for (std::size_t i = 0; i < view.size(); ++i) {
    Returning r = come_back(h, view[i], 1);
    ASSERT_TRUE(r.welcome.has_value()) << describe(r.out);
    EXPECT_EQ(r.welcome->id, view[i]);
    EXPECT_EQ(r.welcome->term, 2u);  // one above the term the peers had granted
    EXPECT_TRUE(h.c.recovering());
    p::ResumeReport report = report_of(5, view);
    report.has_revision = true;
    report.revision = 7 + i % 2;  // the highest reported wins
    last = h.send(r.peer, report);
    // Nobody resumes before every peer of the view is back (the window has not passed).
    for (const auto& f : peers) EXPECT_TRUE(all_of<p::Resumed>(last, f.conn).empty() || i + 1 == view.size());
    peers.push_back(r.peer);
  }
  for (const auto& f : peers) {
    auto resumed = one_of<p::Resumed>(last, f.conn);
    ASSERT_TRUE(resumed.has_value());
    EXPECT_EQ(resumed->term, 2u);
    EXPECT_EQ(resumed->epoch, 5u);
    EXPECT_EQ(h.phase(f), Phase::kAccepted);
  }
  EXPECT_FALSE(h.c.recovering());
  EXPECT_EQ(h.c.ring(1), view);  // the ring order kept
  EXPECT_EQ(h.c.revision(1), std::optional<std::uint64_t>(8));
  ASSERT_TRUE(h.c.last_recovery().has_value());
  EXPECT_TRUE(h.c.last_recovery()->missing.empty());
  // The run goes on: a collective starts in the old view, numbered above every attempt
  // the peers had seen; nobody is pending.
  Outbox out;
  for (const auto& f : peers) out = h.send(f, p::CollectiveInit{5, kSum});
  for (const auto& f : peers) {
    auto go = one_of<p::CollectiveGo>(out, f.conn);
    ASSERT_TRUE(go.has_value());
    EXPECT_EQ(go->epoch, 5u);
    EXPECT_TRUE(go->absent.empty());
    EXPECT_GT(go->attempt, 40u);
  }
  out = h.send(peers[0], p::VotePeersPending{});
  EXPECT_TRUE(out.empty());
}

TEST(CoordinatorRecovery, AMajorityResumesOnceTheWindowHasPassedAndTheMissingAreRemoved) {
  Harness h;
  const std::vector<PeerId> view{old_id(1), old_id(2), old_id(3)};
  std::vector<FakePeer> peers;
  for (std::size_t i = 0; i < 2; ++i) {
    Returning r = come_back(h, view[i], 0);
    ASSERT_TRUE(r.welcome.has_value());
    EXPECT_TRUE(all_of<p::Resumed>(h.send(r.peer, report_of(5, view)), r.peer.conn).empty());
    peers.push_back(r.peer);
  }
  h.heartbeat(peers);
  Outbox out = h.advance(limits::kRecoveryWindowMsDefault - 1);
  EXPECT_TRUE(all_of<p::Resumed>(out, peers[0].conn).empty()) << describe(out);
  h.heartbeat(peers);
  out = h.advance(1);
  for (const auto& f : peers) EXPECT_TRUE(one_of<p::Resumed>(out, f.conn).has_value()) << describe(out);
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{view[0], view[1]}));
  ASSERT_TRUE(h.c.last_recovery().has_value());
  EXPECT_EQ(h.c.last_recovery()->missing, std::vector<PeerId>{view[2]});
  // The view less the missing one: collectives name it absent; the run is pending an
  // update topology; the missing peer is turned away when it comes back late.
  for (const auto& f : peers) out = h.send(f, p::CollectiveInit{5, kSum});
  auto go = one_of<p::CollectiveGo>(out, peers[0].conn);
  ASSERT_TRUE(go.has_value());
  EXPECT_EQ(go->absent, std::vector<PeerId>{view[2]});
  out = h.send(peers[0], p::VotePeersPending{});
  out = h.send(peers[1], p::VotePeersPending{});
  auto pending = one_of<p::PeersPendingResult>(out, peers[0].conn);
  ASSERT_TRUE(pending.has_value());
  EXPECT_TRUE(pending->pending);
  Returning late = come_back(h, view[2], 0);
  EXPECT_FALSE(late.welcome.has_value());
  auto bye = one_of<p::Goodbye>(late.out, late.peer.conn);
  ASSERT_TRUE(bye.has_value());
  EXPECT_EQ(bye->status, LOCKSTEP_STATUS_KICKED);
}

TEST(CoordinatorRecovery, WithoutAQuorumNothingResumesUnlessTheOperatorLowersIt) {
  for (const std::uint32_t quorum : {0u, 1u}) {
    SCOPED_TRACE(quorum);
    Config config = test_config();
    config.recovery_quorum = quorum;
    Harness h(config);
    const std::vector<PeerId> view{old_id(1), old_id(2), old_id(3)};
    Returning r = come_back(h, view[0], 0);
    h.send(r.peer, report_of(5, view));
    Outbox out = pass_window(h, {r.peer});
    if (quorum == 0) out = pass_window(h, {r.peer});  // nor later
    EXPECT_EQ(all_of<p::Resumed>(out, r.peer.conn).size(), quorum == 1 ? 1u : 0u) << describe(out);
    EXPECT_EQ(h.c.recovering(), quorum == 0);
  }
  // Two peers: both must come back.
  Harness h;
  const std::vector<PeerId> pair{old_id(1), old_id(2)};
  Returning r = come_back(h, pair[0], 0);
  h.send(r.peer, report_of(5, pair));
  EXPECT_TRUE(all_of<p::Resumed>(pass_window(h, {r.peer}), r.peer.conn).empty());
}

TEST(CoordinatorRecovery, AnOutcomeOnePeerReceivedReachesEveryPeerThatMissedIt) {
  Harness h;
  const std::vector<PeerId> view{old_id(1), old_id(2), old_id(3)};
  std::vector<FakePeer> peers;
  Outbox out;
  for (std::size_t i = 0; i < view.size(); ++i) {
    Returning r = come_back(h, view[i], 0);
    p::ResumeReport report = report_of(5, view);
    if (i == 0) {
      // It received tag 4's outcome (or committed it); tag 6 had only started.
      report.outcomes.push_back(p::ResumeOutcome{4, 9, LOCKSTEP_OK, 3, "", {1, 2}});
      report.ops.push_back(p::ResumeOp{6, 11});
      // A small all-reduce that travels with the votes: it got the result of attempt 12.
      report.outcomes.push_back(p::ResumeOutcome{10, 12, LOCKSTEP_OK, 3, "", {5, 6}});
    } else {
      report.ops.push_back(p::ResumeOp{4, 9});
      report.ops.push_back(p::ResumeOp{6, 11});
      report.ops.push_back(p::ResumeOp{8, 0});   // voted only
      // Tag 14: the lost master's CollectiveGo of attempt 13 reached peer 1 only.
      report.ops.push_back(p::ResumeOp{14, i == 1 ? 13u : 0u});
      report.ops.push_back(p::ResumeOp{10, 0});  // voted in the round after its attempt 3
      report.outcomes.push_back(p::ResumeOutcome{10, 3, LOCKSTEP_OK, 3, "", {1, 1}});
    }
    out = h.send(r.peer, report);
    peers.push_back(r.peer);
  }
  EXPECT_TRUE(all_of<p::CollectiveResult>(out, peers[0].conn).empty()) << describe(out);
  for (std::size_t i = 1; i < peers.size(); ++i) {
    std::map<std::uint64_t, p::CollectiveResult> results;  // by tag
    for (const auto& r : all_of<p::CollectiveResult>(out, peers[i].conn)) results.emplace(r.tag, r);
    ASSERT_EQ(results.size(), i == 2 ? 3u : 2u) << describe(out);
    EXPECT_EQ(results.at(10).attempt, 12u);
    EXPECT_EQ(results.at(10).data, (std::vector<std::uint8_t>{5, 6}));
    if (i == 2) {  // it never heard of attempt 13: its failure comes from the master
      EXPECT_EQ(results.at(14).attempt, 13u);
      EXPECT_EQ(results.at(14).status, LOCKSTEP_STATUS_PEER_CONNECTION_LOST);
    }
    std::optional<p::CollectiveResult> result = results.at(4);
    EXPECT_EQ(result->tag, 4u);
    EXPECT_EQ(result->attempt, 9u);
    EXPECT_EQ(result->status, LOCKSTEP_OK);
    EXPECT_EQ(result->world_size, 3u);
    EXPECT_EQ(result->data, (std::vector<std::uint8_t>{1, 2}));
    // The outcome comes before the Resumed that makes the peer fail the rest.
    EXPECT_LT(index_of(out, peers[i].conn, p::MsgType::kCollectiveResult),
              index_of(out, peers[i].conn, p::MsgType::kResumed));
  }
}

TEST(CoordinatorRecovery, AMissedRoundOutcomeIsForwardedAndAPeerFurtherBehindRemoved) {
  Harness h;
  const std::vector<PeerId> view{old_id(1), old_id(2), old_id(3), old_id(4)};
  std::vector<FakePeer> peers;
  Outbox out;
  const p::AgreeResult agreed{LOCKSTEP_OK, true, "", {}};
  for (std::size_t i = 0; i < view.size(); ++i) {
    Returning r = come_back(h, view[i], 0);
    p::ResumeReport report = report_of(5, view);
    if (i < 2) {  // received the agree's outcome: 3 rounds since the view began
      report.control_count = 3;
      report.last_control = p::encode_frame(agreed);
    } else if (i == 2) {  // waits in that agree
      report.control_count = 2;
      report.waiting = static_cast<std::uint16_t>(p::MsgType::kVoteAgree);
    } else {  // missed a round it did not wait in: the lost master had removed it
      report.control_count = 1;
    }
    out = h.send(r.peer, report);
    peers.push_back(r.peer);
  }
  auto forwarded = one_of<p::AgreeResult>(out, peers[2].conn);
  ASSERT_TRUE(forwarded.has_value()) << describe(out);
  EXPECT_EQ(*forwarded, agreed);
  EXPECT_TRUE(all_of<p::AgreeResult>(out, peers[0].conn).empty());
  EXPECT_TRUE(one_of<p::Resumed>(out, peers[2].conn).has_value());
  auto bye = one_of<p::Goodbye>(out, peers[3].conn);
  ASSERT_TRUE(bye.has_value());
  EXPECT_EQ(bye->status, LOCKSTEP_STATUS_KICKED);
  EXPECT_TRUE(h.gone(peers[3]));
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{view[0], view[1], view[2]}));
}

// A peer the lost master had removed without its knowing (it was cut off) comes back in
// the same view, voted for a collective whose round went on without it: the first
// outcome after its own is of a round it was not in. It is removed for the rounds it
// missed, and is sent no collective's outcome before its Goodbye.
TEST(CoordinatorRecovery, APeerRemovedForMissedRoundsIsForwardedNoCollectiveOutcome) {
  Harness h;
  const std::vector<PeerId> view{old_id(1), old_id(2), old_id(3)};
  std::vector<FakePeer> peers;
  Outbox out;
  const p::AgreeResult agreed{LOCKSTEP_OK, true, "", {}};
  for (std::size_t i = 0; i < view.size(); ++i) {
    Returning r = come_back(h, view[i], 0);
    p::ResumeReport report = report_of(5, view);
    if (i < 2) {  // the round of tag 4 after attempt 9 succeeded without peer 3
      report.control_count = 3;
      report.last_control = p::encode_frame(agreed);
      report.outcomes.push_back(p::ResumeOutcome{4, 21, LOCKSTEP_OK, 2, "", {7}});
    } else {  // voted for tag 4 after attempt 9, then was cut off and removed
      report.control_count = 1;
      report.ops.push_back(p::ResumeOp{4, 0});
      report.outcomes.push_back(p::ResumeOutcome{4, 9, LOCKSTEP_OK, 3, "", {1}});
    }
    out = h.send(r.peer, report);
    peers.push_back(r.peer);
  }
  auto bye = one_of<p::Goodbye>(out, peers[2].conn);
  ASSERT_TRUE(bye.has_value()) << describe(out);
  EXPECT_EQ(bye->status, LOCKSTEP_STATUS_KICKED);
  EXPECT_TRUE(all_of<p::CollectiveResult>(out, peers[2].conn).empty()) << describe(out);
  EXPECT_TRUE(h.gone(peers[2]));
  EXPECT_TRUE(one_of<p::Resumed>(out, peers[0].conn).has_value());
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{view[0], view[1]}));
}

// Are-peers-pending is run-wide: a group whose every peer missed the last round's outcome
// (yes or no) gets it from another group of the view, which counted one round more. A
// failed round's outcome is not forwarded (the group casts its vote again).
TEST(CoordinatorRecovery, AMissedPendingOutcomeReachesTheGroupsThatMissedIt) {
  for (const int c : {0, 1, 2}) {
    const bool yes = c == 0;
    const bool failed = c == 2;
    SCOPED_TRACE(yes ? "yes" : failed ? "failed" : "no");
    Harness h;
    const std::vector<PeerId> view{old_id(1), old_id(2), old_id(3)};
    std::vector<FakePeer> peers;
    Outbox out;
    const p::PeersPendingResult result{LOCKSTEP_OK, yes, ""};
    for (std::size_t i = 0; i < view.size(); ++i) {
      Returning r = come_back(h, view[i], 0, i < 2 ? 1 : 2);
      p::ResumeReport report = report_of(5, view);
      if (i < 2) {  // group 1 received the outcome and went on
        report.control_count = 4;
        report.last_control = p::encode_frame(result);
        report.waiting = static_cast<std::uint16_t>(yes ? p::MsgType::kVoteUpdateTopology : p::MsgType::kSyncVote);
        report.pending_count = 3;
        report.last_pending = yes;
        if (failed) report.last_pending_status = LOCKSTEP_STATUS_OPERATION_MISMATCH;
      } else {  // group 2, alone, waits in that round
        report.control_count = 2;
        report.waiting = static_cast<std::uint16_t>(p::MsgType::kVotePeersPending);
        report.pending_count = 2;
      }
      out = h.send(r.peer, report);
      peers.push_back(r.peer);
    }
    const auto forwarded = all_of<p::PeersPendingResult>(out, peers[2].conn);
    ASSERT_EQ(forwarded.size(), failed ? 0u : 1u) << describe(out);
    if (!failed) {
      EXPECT_EQ(forwarded[0], result);
      EXPECT_LT(index_of(out, peers[2].conn, p::MsgType::kPeersPendingResult),
                index_of(out, peers[2].conn, p::MsgType::kResumed));
    }
    EXPECT_TRUE(all_of<p::PeersPendingResult>(out, peers[0].conn).empty());
    EXPECT_TRUE(one_of<p::Resumed>(out, peers[2].conn).has_value());
  }
}

// A peer the lost master had removed without its knowing reports the same view as the
// others; an attempt of its group that ran without it (it did not vote for it, was not
// sent it, has no outcome of it) shows it, and it is not taken back. A peer that voted for
// the tag (the Go did not reach it) or ended that attempt is taken back.
TEST(CoordinatorRecovery, APeerTheLostMasterHadRemovedIsNotTakenBack) {
  for (const int c : {0, 1, 2}) {
    SCOPED_TRACE(c == 0 ? "left out" : c == 1 ? "voted" : "ended");
    Harness h;
    const std::vector<PeerId> view{old_id(1), old_id(2), old_id(3)};
    std::vector<FakePeer> peers;
    Outbox out;
    for (std::size_t i = 0; i < view.size(); ++i) {
      Returning r = come_back(h, view[i], 0);
      p::ResumeReport report = report_of(5, view);  // attempt_seen 40
      if (i > 0) {
        report.attempt_seen = 44;
        report.ops.push_back(p::ResumeOp{3, 44});  // an attempt that started after 40
      } else if (c == 1) {
        report.ops.push_back(p::ResumeOp{3, 0});  // voted; the Go did not reach it
      } else if (c == 2) {
        report.outcomes.push_back(p::ResumeOutcome{3, 44, LOCKSTEP_OK, 3, "", {1}});  // a vote-carried one
      }
      out = h.send(r.peer, report);
      peers.push_back(r.peer);
    }
    if (c == 0) {
      const auto bye = one_of<p::Goodbye>(out, peers[0].conn);
      ASSERT_TRUE(bye.has_value()) << describe(out);
      EXPECT_EQ(bye->status, LOCKSTEP_STATUS_KICKED);
      EXPECT_NE(bye->reason.find("attempt 44 of tag 3 ran without it"), std::string::npos) << bye->reason;
      EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{view[1], view[2]}));
    } else {
      EXPECT_TRUE(all_of<p::Goodbye>(out, peers[0].conn).empty()) << describe(out);
      EXPECT_EQ(h.c.ring(1), view);
    }
    EXPECT_TRUE(one_of<p::Resumed>(out, peers[1].conn).has_value());
  }
}

// Every group gets a view of the same epoch at an update: a group whose every peer
// reports an older one missed the last topology change, and is turned away.
TEST(CoordinatorRecovery, AGroupThatMissedTheLastTopologyChangeIsTurnedAway) {
  Harness h;
  const std::vector<PeerId> group1{old_id(1), old_id(2), old_id(4)};  // peer 4 does not come back
  std::vector<FakePeer> peers;
  for (std::size_t i = 0; i < 2; ++i) {
    Returning r = come_back(h, group1[i], 0, 1);
    ASSERT_TRUE(r.welcome.has_value()) << describe(r.out);
    h.send(r.peer, report_of(6, group1));
    peers.push_back(r.peer);
  }
  Returning c = come_back(h, old_id(3), 0, 2);
  ASSERT_TRUE(c.welcome.has_value()) << describe(c.out);
  h.send(c.peer, report_of(5, {old_id(3)}));  // group 2 missed the TopologyResult of epoch 6
  peers.push_back(c.peer);
  const Outbox out = pass_window(h, peers);
  for (std::size_t i = 0; i < 2; ++i) {
    auto resumed = one_of<p::Resumed>(out, peers[i].conn);
    ASSERT_TRUE(resumed.has_value()) << describe(out);
    EXPECT_EQ(resumed->epoch, 6u);
  }
  auto bye = one_of<p::Goodbye>(out, c.peer.conn);
  ASSERT_TRUE(bye.has_value()) << describe(out);
  EXPECT_EQ(bye->status, LOCKSTEP_STATUS_KICKED);
  EXPECT_TRUE(h.gone(c.peer));
  EXPECT_TRUE(h.c.ring(2).empty());
}

TEST(CoordinatorRecovery, TermsFenceMastersAndAServingMasterTakesNobodyBack) {
  Harness h;
  const std::vector<PeerId> view{old_id(1), old_id(2), old_id(3)};
  Returning a = come_back(h, view[0], 4);
  ASSERT_TRUE(a.welcome.has_value());
  EXPECT_EQ(a.welcome->term, 5u);
  EXPECT_EQ(h.c.term(), 5u);
  // A peer back later that granted this term or a higher one (it heard of a master that
  // the first one back had not: a newcomer the lost master welcomed before its own
  // recovery fixed its term, say) raises the term above its own and is taken back; Resumed
  // gives every peer the raised term. (With a term from an election it is refused:
  // AHotStandbysTerm... below.)
  Returning b = come_back(h, view[1], 5);
  ASSERT_TRUE(b.welcome.has_value()) << describe(b.out);
  EXPECT_EQ(b.welcome->term, 6u);
  Returning c9 = come_back(h, view[2], 9);
  ASSERT_TRUE(c9.welcome.has_value()) << describe(c9.out);
  EXPECT_EQ(c9.welcome->term, 10u);
  EXPECT_EQ(h.c.term(), 10u);
  // The same identity twice is refused.
  Returning twice = come_back(h, view[0], 4);
  EXPECT_FALSE(twice.welcome.has_value());
  Outbox out;
  for (const Returning* r : {&a, &b, &c9}) out = h.send(r->peer, report_of(5, view));
  for (const Returning* r : {&a, &b, &c9}) {
    const auto resumed = one_of<p::Resumed>(out, r->peer.conn);
    ASSERT_TRUE(resumed.has_value()) << describe(out);
    EXPECT_EQ(resumed->term, 10u);
  }
  // A master serving a run of its own takes nobody back.
  Harness serving;
  serving.run_of(2);
  Returning c = come_back(serving, view[2], 1);
  EXPECT_FALSE(c.welcome.has_value());
  auto bye = one_of<p::Goodbye>(c.out, c.peer.conn);
  ASSERT_TRUE(bye.has_value());
  EXPECT_EQ(bye->status, LOCKSTEP_STATUS_KICKED);
  EXPECT_EQ(serving.c.term(), 1u);
  // Unless the peer granted a higher term: this master is stale (a newer one took the
  // run over while it was stopped), and its word must not end the peer.
  Returning d = come_back(serving, view[2], 2);
  EXPECT_FALSE(d.welcome.has_value());
  bye = one_of<p::Goodbye>(d.out, d.peer.conn);
  ASSERT_TRUE(bye.has_value());
  EXPECT_EQ(bye->status, LOCKSTEP_STATUS_REJECTED);
  EXPECT_NE(bye->reason.find("newer master"), std::string::npos) << bye->reason;
  EXPECT_EQ(serving.c.term(), 1u);
}

TEST(CoordinatorRecovery, AHotStandbysTermIsTheElectionsAndFencesPeersThatGrantedAHigherOne) {
  Config config = test_config();
  config.term = 40;  // the etcd revision at which it won its lease
  Harness h(config);
  EXPECT_EQ(h.c.term(), 40u);
  const std::vector<PeerId> view{old_id(1), old_id(2)};
  // A peer of the lost master's run (which granted term 12) is taken back under term 40,
  // not one above what it reports.
  Returning a = come_back(h, view[0], 12);
  ASSERT_TRUE(a.welcome.has_value()) << describe(a.out);
  EXPECT_EQ(a.welcome->term, 40u);
  EXPECT_EQ(h.c.term(), 40u);
  // One that granted term 40 or above already is refused: another master has it.
  Returning b = come_back(h, view[1], 40);
  EXPECT_FALSE(b.welcome.has_value());
  // A newcomer of a new run is welcomed under the same term.
  Harness fresh(config);
  Outbox joined;
  FakePeer first = fresh.join(1, &joined);
  auto welcome = one_of<p::Welcome>(joined, first.conn);
  ASSERT_TRUE(welcome.has_value()) << describe(joined);
  EXPECT_EQ(welcome->term, 40u);
}

TEST(CoordinatorRecovery, ReportsThatDisagreeWithTheLastViewAreTurnedAway) {
  Harness h;
  const std::vector<PeerId> view{old_id(1), old_id(2), old_id(3), old_id(4)};
  std::vector<Returning> back;
  Outbox out;
  for (std::size_t i = 0; i < view.size(); ++i) {
    Returning r = come_back(h, view[i], 0);
    p::ResumeReport report = report_of(6, view);
    if (i == 2) report = report_of(5, view);  // missed the last topology change
    if (i == 3) report = report_of(6, {view[3], view[0], view[1], view[2]});  // another view of the same epoch
    out = h.send(r.peer, report);
    back.push_back(r);
  }
  // Not all of the view is back in it: the window decides.
  for (auto& r : back) EXPECT_TRUE(all_of<p::Resumed>(out, r.peer.conn).empty());
  out = pass_window(h, {back[0].peer, back[1].peer, back[2].peer, back[3].peer});
  // 2 of 4 is no strict majority.
  EXPECT_TRUE(all_of<p::Resumed>(out, back[0].peer.conn).empty()) << describe(out);
  Config config = test_config();
  config.recovery_quorum = 2;
  Harness lowered(config);
  std::vector<Returning> again;
  for (std::size_t i = 0; i < view.size(); ++i) {
    Returning r = come_back(lowered, view[i], 0);
    p::ResumeReport report = report_of(6, view);
    if (i == 2) report = report_of(5, view);
    if (i == 3) report = report_of(6, {view[3], view[0], view[1], view[2]});
    lowered.send(r.peer, report);
    again.push_back(r);
  }
  out = pass_window(lowered, {again[0].peer, again[1].peer, again[2].peer, again[3].peer});
  EXPECT_TRUE(one_of<p::Resumed>(out, again[0].peer.conn).has_value()) << describe(out);
  for (std::size_t i : {2u, 3u}) {
    auto bye = one_of<p::Goodbye>(out, again[i].peer.conn);
    ASSERT_TRUE(bye.has_value());
    EXPECT_EQ(bye->status, LOCKSTEP_STATUS_KICKED);
  }
  EXPECT_EQ(lowered.c.ring(1), (std::vector<PeerId>{view[0], view[1]}));
}

TEST(CoordinatorRecovery, NewcomersWaitForTheFirstUpdateAndStrayReportsAreErrors) {
  Harness h;
  const std::vector<PeerId> view{old_id(1)};
  Returning a = come_back(h, view[0], 0);
  // A newcomer during recovery is registered, not admitted into the (empty) run.
  Outbox out;
  FakePeer newcomer = h.join(1, &out);
  EXPECT_TRUE(all_of<p::EstablishP2P>(out, newcomer.conn).empty()) << describe(out);
  out = h.send(a.peer, report_of(5, view));
  EXPECT_TRUE(one_of<p::Resumed>(out, a.peer.conn).has_value());
  EXPECT_EQ(h.phase(newcomer), Phase::kRegistered);
  // It joins with the next update topology, as usual.
  h.update({a.peer}, {newcomer});
  EXPECT_EQ(h.c.ring(1).size(), 2u);
  // A report from a peer that is not resuming: a protocol error.
  out = h.send(newcomer, report_of(5, view));
  auto bye = one_of<p::Goodbye>(out, newcomer.conn);
  ASSERT_TRUE(bye.has_value());
  EXPECT_EQ(bye->status, LOCKSTEP_STATUS_PROTOCOL_ERROR);
  // A master admitting the first peers of a new run (a newcomer came first) takes no lost
  // run back while it does.
  Harness fresh;
  Outbox admitting;
  FakePeer first = fresh.join(1, &admitting);
  ASSERT_TRUE(one_of<p::EstablishP2P>(admitting, first.conn).has_value());
  Returning refused = come_back(fresh, old_id(9), 0);
  EXPECT_FALSE(refused.welcome.has_value());
  bye = one_of<p::Goodbye>(refused.out, refused.peer.conn);
  ASSERT_TRUE(bye.has_value());
  EXPECT_EQ(bye->status, LOCKSTEP_STATUS_REJECTED);
  // A report whose view leaves its sender out is refused.
  Harness other;
  Returning b = come_back(other, old_id(7), 0);
  out = other.send(b.peer, report_of(5, {old_id(8)}));
  bye = one_of<p::Goodbye>(out, b.peer.conn);
  ASSERT_TRUE(bye.has_value());
  EXPECT_EQ(bye->status, LOCKSTEP_STATUS_REJECTED);
}

// A newcomer that reaches a replacement master before the lost run's peers must not found
// a new run: that run would refuse them (KICKED: it went on without them) and the state
// would be lost with them. The resume hold keeps the founding back.
TEST(CoordinatorRecovery, AResumeHoldLetsTheLostRunComeBackBeforeANewcomerFoundsOne) {
  Config config = test_config();
  config.resume_hold_ms = 2'000;
  config.started_ms = 1'000'000;  // the harness's clock at its start
  Harness h(config);
  h.now = config.started_ms + 59;
  Outbox out;
  FakePeer newcomer = h.join(1, &out);
  EXPECT_TRUE(all_of<p::EstablishP2P>(out, newcomer.conn).empty()) << describe(out);
  h.heartbeat({newcomer});
  out = h.advance(500);
  EXPECT_TRUE(all_of<p::EstablishP2P>(out, newcomer.conn).empty()) << describe(out);
  // The lost run's peer comes back within the hold: taken back, not refused.
  const std::vector<PeerId> view{old_id(1)};
  Returning a = come_back(h, view[0], 1);
  ASSERT_TRUE(a.welcome.has_value()) << describe(a.out);
  out = h.send(a.peer, report_of(5, view));
  EXPECT_TRUE(one_of<p::Resumed>(out, a.peer.conn).has_value()) << describe(out);
  EXPECT_EQ(h.phase(newcomer), Phase::kRegistered);
  // The hold passes; the newcomer waits for the run's next update topology, as usual.
  h.heartbeat({newcomer, a.peer});
  out = h.advance(2'000);
  EXPECT_TRUE(all_of<p::EstablishP2P>(out, newcomer.conn).empty()) << describe(out);
  h.update({a.peer}, {newcomer});
  EXPECT_EQ(h.c.ring(1), (std::vector<PeerId>{view[0], newcomer.id}));

  // With no lost run, the newcomer founds the run once the hold has passed, not before.
  Harness alone(config);
  alone.now = config.started_ms + 59;
  FakePeer first = alone.join(1);
  alone.heartbeat({first});
  out = alone.advance(2'000 - 59 - 1);
  EXPECT_TRUE(all_of<p::EstablishP2P>(out, first.conn).empty()) << describe(out);
  out = alone.advance(1);
  EXPECT_TRUE(one_of<p::EstablishP2P>(out, first.conn).has_value()) << describe(out);
}

}  // namespace
}  // namespace lockstep::coord
