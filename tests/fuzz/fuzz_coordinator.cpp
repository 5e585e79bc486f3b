// fuzz_coordinator: the input drives one Coordinator through a sequence of at most
// kEventsMax events, as the master's IO shell would deliver them: connections open,
// send messages (built from fields chosen by the input for the requests that matter,
// or raw payload bytes of any type through decode_payload), close, send garbage, and
// time passes. The model of the shell is faithful where it matters: connection ids are
// never reused, a connection the coordinator closed (or that closed) is forgotten, a
// message that does not decode is a protocol error, and so is anything but a Hello
// before the Hello was accepted. Only a few events go to forgotten or unknown
// connections, which the coordinator must ignore.
//
// Properties, after every event:
//  - check_invariants() finds nothing;
//  - every message the coordinator sends is a master -> peer type, and its frame
//    decodes to the same message and encodes to the same bytes again (a peer can read
//    everything the master says);
//  - nothing is sent to a connection after the coordinator closed it or learned that it
//    closed;
//  - a request answered with Refused changed nothing (digest()) and got no other answer.
//
// Input layout: a 10-byte configuration and a 2-byte start time, then events, each an
// op byte and its fields (Driver::event); the input ends early when it runs out. The seeds are written by
// the same layout (Script, LOCKSTEP_FUZZ_WRITE_SEEDS).
#include "coordinator/coordinator.h"
#include "fuzz_support.h"
#include "kernels/vote_carried.h"

#include <array>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace lockstep;
namespace p = lockstep::proto;
namespace coll = lockstep::coll;
using coord::ConnId;
using fuzz::fail;

constexpr std::size_t kEventsMax = 200;

enum Op : std::uint8_t {
  kConnect,
  kHello,
  kVoteTopology,
  kReport,
  kVotePending,
  kVoteAgree,
  kInit,
  kDone,
  kSyncVote,
  kSyncDone,
  kHeartbeat,
  kRaw,
  kDisconnect,
  kProtocolError,
  kTick,
  kKeepAlive,
  kVoteOptimize,
  kBandwidthReport,
  kKv,
  kResumeHello,
  kResumeReport,
  kOpCount
};
constexpr std::array<const char*, kOpCount> kOpNames = {
    "connect",   "hello",     "vote-topology", "report",     "vote-pending",   "vote-agree", "init", "done",
    "sync-vote", "sync-done", "heartbeat",     "raw",        "disconnect",     "protocol-error", "tick",
    "keep-alive", "vote-optimize", "bandwidth-report", "kv", "resume-hello", "resume-report"};

// LOCKSTEP_FUZZ_VERBOSE=1: print every event and command (to read a failing input).
bool verbose() {
  static const bool on = std::getenv("LOCKSTEP_FUZZ_VERBOSE") != nullptr;
  return on;
}

// Every type the codec knows (payload_bytes_max is 0 for the others).
const std::vector<p::MsgType>& all_types() {
  static const std::vector<p::MsgType> types = [] {
    std::vector<p::MsgType> out;
    for (std::uint32_t raw = 0; raw <= 0xffff; ++raw) {
      if (p::payload_bytes_max(static_cast<std::uint16_t>(raw)) != 0) out.push_back(static_cast<p::MsgType>(raw));
    }
    return out;
  }();
  return types;
}

const std::array<const char*, 4> kObservedHosts = {"10.0.0.1", "10.0.0.2", "127.0.0.1", "10.0.0.3"};
const std::array<const char*, 4> kAdvertisedHosts = {"", "", "10.9.9.9", "127.0.0.2"};
const std::array<const char*, 4> kKeys = {"w", "b", "step", "w"};
const p::CollectiveDescriptor kDescriptorA{1024, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE};
const p::CollectiveDescriptor kDescriptorB{2048, LOCKSTEP_F16, LOCKSTEP_MAX, LOCKSTEP_QUANT_MINMAX_U8};

coord::Config read_config(fuzz::Input& in) {
  coord::Config config;
  config.heartbeat_timeout_ms = std::array<std::uint32_t, 4>{5000, 1000, 100, 60000}[in.byte() % 4];
  config.vote_timeout_ms = std::array<std::uint32_t, 4>{0, 0, 500, 5000}[in.byte() % 4];
  config.handshake_timeout_ms = std::array<std::uint32_t, 2>{10000, 1000}[in.byte() % 2];
  config.establish_timeout_ms = std::array<std::uint32_t, 2>{30000, 2000}[in.byte() % 2];
  config.peers_max = std::array<std::uint32_t, 4>{1024, 2, 3, 5}[in.byte() % 4];
  config.pending_handshakes_max = std::array<std::uint32_t, 2>{256, 2}[in.byte() % 2];
  config.collectives_per_group_max = std::array<std::uint32_t, 3>{4096, 1, 2}[in.byte() % 3];
  config.instance_nonce = in.u<std::uint16_t>() * 0x9e3779b97f4a7c15ull;
  in.byte();  // reserved
  return config;
}

class Driver {
 public:
  Driver(fuzz::Input& in, const coord::Config& config) : in_(in), c_(config) {}

  void run() {
    now_ = 1'000'000 + in_.u<std::uint16_t>();
    for (std::size_t n = 0; n < kEventsMax && !in_.done(); ++n) {
      const auto op = static_cast<Op>(in_.byte() % kOpCount);
      if (verbose()) std::fprintf(stderr, "-- t=%lld %s\n", static_cast<long long>(now_), kOpNames[op]);
      event(op);
      if (auto violation = c_.check_invariants()) fail("invariant: " + *violation);
    }
  }

 private:
  void event(Op op) {
    switch (op) {
      case kConnect: {
        const ConnId conn = next_conn_++;
        live_.push_back(conn);
        coord::Outbox out;
        c_.on_connect(conn, kObservedHosts[in_.byte() % kObservedHosts.size()], now_, out);
        return apply(out);
      }
      case kHello: {
        const ConnId conn = pick_conn();
        p::Hello hello;
        hello.group = in_.byte() % 3;
        const std::uint8_t pool = in_.byte();
        hello.pool_size = static_cast<std::uint16_t>(pool == 0 ? 0 : 1 + pool % 4);
        const std::uint8_t port = in_.byte();
        // 0: a peer that accepts no inbound connection (it names no port)
        hello.p2p_port = static_cast<std::uint16_t>(port == 0 ? 0 : 48000 + port);
        hello.shared_state_port = static_cast<std::uint16_t>(port == 0 ? 0 : hello.p2p_port + 1);
        hello.benchmark_port = static_cast<std::uint16_t>(port == 0 ? 0 : hello.p2p_port + 2);
        hello.advertised_host = kAdvertisedHosts[in_.byte() % kAdvertisedHosts.size()];
        return deliver(conn, hello);
      }
      case kVoteTopology: return deliver(pick_conn(), p::VoteUpdateTopology{});
      case kReport: {
        const ConnId conn = pick_conn();
        p::P2PReport report;
        switch (in_.byte() % 4) {
          case 0:
          case 1: report.epoch = c_.epoch(); break;
          case 2: report.epoch = c_.epoch() - 1; break;
          default: report.epoch = in_.u<std::uint64_t>(); break;
        }
        const std::size_t n = in_.byte() % 3;
        for (std::size_t i = 0; i < n; ++i) report.unreachable.push_back(pick_id());
        return deliver(conn, report);
      }
      case kVotePending: return deliver(pick_conn(), p::VotePeersPending{});
      case kVoteAgree: return deliver(pick_conn(), p::VoteAgree{in_.flag()});
      case kInit: {
        const ConnId conn = pick_conn();
        p::CollectiveInit init;
        init.tag = in_.byte() % 4;
        switch (in_.byte() % 4) {
          case 0:
          case 1: init.descriptor = kDescriptorA; break;
          case 2: init.descriptor = kDescriptorB; break;
          default:
            init.descriptor.count = in_.u<std::uint64_t>();
            init.descriptor.dtype = in_.byte();
            init.descriptor.op = in_.byte();
            init.descriptor.quantization = in_.byte();
            break;
        }
        // A small all-reduce carries its contribution, now and then one byte short.
        if (coll::travels_with_votes(init.descriptor.count, init.descriptor.dtype, init.descriptor.quantization)) {
          const std::size_t bytes =
              init.descriptor.count * coll::dtype_size(static_cast<lockstep_dtype_t>(init.descriptor.dtype));
          init.data.assign(in_.byte() % 8 == 0 ? bytes - 1 : bytes, in_.byte());
        }
        return deliver(conn, init);
      }
      case kDone: {
        const ConnId conn = pick_conn();
        p::CollectiveDone done;
        done.tag = in_.byte() % 4;
        done.attempt = in_.byte() % 4 == 3 ? in_.u<std::uint64_t>() : collective_attempt(conn, done.tag);
        done.ok = in_.byte() % 4 != 0;
        done.reason = in_.text(in_.byte() % 8);
        return deliver(conn, done);
      }
      case kSyncVote: {
        const ConnId conn = pick_conn();
        p::SyncVote vote;
        vote.strategy = static_cast<p::SyncStrategy>(in_.byte() % 3);
        const std::optional<std::uint64_t> last = group_revision(conn);
        switch (in_.byte() % 4) {
          case 0: vote.revision = last ? *last + 1 : 1; break;
          case 1: vote.revision = last ? *last : 0; break;
          case 2: vote.revision = last ? *last + 2 : 0; break;
          default: vote.revision = in_.u<std::uint64_t>(); break;
        }
        const std::size_t n = in_.byte() % 4;
        for (std::size_t i = 0; i < n; ++i) {
          p::TensorEntry t;
          t.key = kKeys[in_.byte() % kKeys.size()];
          switch (in_.byte() % 4) {
            case 0:
            case 1: t.dtype = LOCKSTEP_F32; break;
            case 2: t.dtype = LOCKSTEP_F16; break;
            default: t.dtype = static_cast<std::uint8_t>(in_.byte() % 13); break;
          }
          switch (in_.byte() % 4) {
            case 0:
            case 1: t.count = 1000; break;
            case 2: t.count = 3u << 20; break;  // 12 MiB in f32: split over distributors
            default: t.count = in_.u<std::uint64_t>(); break;
          }
          const std::uint64_t h = in_.byte() % 3;
          t.hash = state::Digest{h, h};
          t.allow_content_inequality = in_.flag();
          vote.tensors.push_back(std::move(t));
        }
        return deliver(conn, vote);
      }
      case kSyncDone: {
        const ConnId conn = pick_conn();
        p::SyncDone done;
        done.attempt = in_.byte() % 4 == 3 ? in_.u<std::uint64_t>() : sync_attempt(conn);
        switch (in_.byte() % 4) {
          case 0:
          case 1: done.status = LOCKSTEP_OK; break;
          case 2: done.status = LOCKSTEP_STATUS_HASH_MISMATCH; break;
          default: done.status = static_cast<StatusCode>(in_.byte() % 24); break;
        }
        done.reason = in_.text(in_.byte() % 8);
        return deliver(conn, done);
      }
      case kHeartbeat: return deliver(pick_conn(), p::Heartbeat{});
      case kRaw: {
        const ConnId conn = pick_conn();
        const p::MsgType type = all_types()[in_.byte() % all_types().size()];
        const auto payload = in_.bytes(in_.byte());
        return deliver_payload(conn, type, payload);
      }
      case kDisconnect: {
        const ConnId conn = pick_conn();
        forget(conn);
        coord::Outbox out;
        c_.on_disconnect(conn, "closed by peer", now_, out);
        return apply(out);
      }
      case kProtocolError: {
        const ConnId conn = pick_conn();
        coord::Outbox out;
        c_.on_protocol_error(conn, "garbage", now_, out);
        apply(out);
        forget(conn);  // the shell closes the connection whatever the coordinator says
        return;
      }
      case kTick: {
        std::uint64_t step = 0;
        switch (in_.byte() % 4) {
          case 0: step = in_.byte(); break;
          case 1: step = in_.byte() * 100u; break;
          case 2: step = in_.byte() * 1000u; break;
          default: step = in_.u<std::uint32_t>(); break;
        }
        now_ += static_cast<TimeMs>(step);
        coord::Outbox out;
        c_.on_tick(now_, out);
        return apply(out);
      }
      case kKeepAlive: {
        // Every live connection with a peer sends a heartbeat.
        const std::vector<ConnId> conns = live_;
        for (const auto conn : conns) {
          if (c_.peer_of(conn) && is_live(conn)) deliver(conn, p::Heartbeat{});
        }
        return;
      }
      case kVoteOptimize: return deliver(pick_conn(), p::VoteOptimizeTopology{});
      case kBandwidthReport: {
        const ConnId conn = pick_conn();
        p::BandwidthReport report;
        const auto told = last_test_.find(conn);
        if (in_.byte() % 4 != 3 && told != last_test_.end()) {
          report.test = told->second.first;
          report.from = told->second.second;
        } else {
          report.test = in_.u<std::uint64_t>();
          report.from = pick_id();
        }
        switch (in_.byte() % 4) {
          case 0: report.bytes_per_s = 0; break;  // could not measure
          case 1: report.bytes_per_s = 125'000'000; break;
          case 2: report.bytes_per_s = 1'000'000ull * (1 + in_.byte()); break;
          default: report.bytes_per_s = in_.u<std::uint64_t>(); break;
        }
        return deliver(conn, report);
      }
      case kKv: {
        // Few keys, so that sets, waits and deletes meet; now and then an oversized one.
        p::KvRequest request;
        request.request = in_.byte() % 4;
        request.op = static_cast<p::KvOp>(1 + in_.byte() % p::kKvOpMax);
        const std::uint8_t k = in_.byte();
        request.key = k % 16 == 15 ? std::string(300, 'k') : k % 16 == 14 ? "" : "key" + std::to_string(k % 3);
        if (request.op == p::KvOp::kSet) request.value.assign(in_.byte() % 8 == 7 ? 70'000 : in_.byte() % 4, 0x5a);
        if (request.op == p::KvOp::kWait) request.timeout_ms = in_.byte() * 10u;
        return deliver(pick_conn(), request);
      }
      case kResumeHello: {
        // A peer of a lost master's run (ids of another instance, a few of them) asks
        // to be taken back, with the term it granted.
        p::Hello hello;
        const ConnId conn = pick_conn();
        hello.group = in_.byte() % 2;
        hello.p2p_port = static_cast<std::uint16_t>(48000 + in_.byte());
        hello.shared_state_port = static_cast<std::uint16_t>(hello.p2p_port + 1);
        hello.benchmark_port = static_cast<std::uint16_t>(hello.p2p_port + 2);
        hello.resume_id = old_id(in_.byte());
        hello.term = in_.byte() % 4;
        return deliver(conn, hello);
      }
      case kResumeReport: {
        p::ResumeReport report;
        const ConnId conn = pick_conn();
        report.epoch = in_.byte() % 4;
        const std::uint8_t members = in_.byte();
        for (std::uint8_t i = 0; i < 5; ++i) {
          if (members & (1u << i)) report.view.push_back(old_id(i));
        }
        report.epoch_seen = report.epoch + in_.byte() % 2;
        report.attempt_seen = in_.byte();
        report.has_revision = in_.flag();
        report.revision = in_.byte() % 4;
        report.control_count = in_.byte() % 3;
        report.waiting = std::array<std::uint16_t, 4>{0, static_cast<std::uint16_t>(p::MsgType::kVoteAgree),
                                                      static_cast<std::uint16_t>(p::MsgType::kVotePeersPending),
                                                      999}[in_.byte() % 4];
        switch (in_.byte() % 3) {
          case 0: break;
          case 1: report.last_control = p::encode_frame(p::AgreeResult{LOCKSTEP_OK, in_.flag(), "", {}}); break;
          default: report.last_control.assign(in_.byte() % 16, 0xa5); break;  // not a frame
        }
        for (int n = in_.byte() % 3; n > 0; --n) {
          p::ResumeOp entry;
          entry.tag = in_.byte() % 3;
          entry.attempt = in_.byte() % 4;
          report.ops.push_back(entry);
        }
        for (int n = in_.byte() % 3; n > 0; --n) {
          p::ResumeOutcome o;
          o.tag = in_.byte() % 3;
          o.attempt = in_.byte() % 4;
          o.status = in_.flag() ? LOCKSTEP_OK : LOCKSTEP_STATUS_PEER_CONNECTION_LOST;
          o.world_size = in_.byte() % 4;
          report.outcomes.push_back(o);
        }
        report.pending_count = in_.byte() % 3;
        report.last_pending_status = in_.flag() ? LOCKSTEP_OK : LOCKSTEP_STATUS_OPERATION_MISMATCH;
        report.last_pending = in_.flag();
        return deliver(conn, report);
      }
      case kOpCount: break;
    }
  }

  // One of five identities a lost master gave out (a nonce no Config here draws).
  static PeerId old_id(std::uint8_t n) { return PeerId{0xfeedull << 48, 1u + n % 5}; }

  // Mostly a live connection; sometimes one already forgotten, or one never opened.
  ConnId pick_conn() {
    const std::uint8_t b = in_.byte();
    if (!live_.empty() && b < 0xf0) return live_[b % live_.size()];
    if (!gone_.empty() && b < 0xf8) return gone_[b % gone_.size()];
    return (ConnId{1} << 40) + b;
  }

  // Mostly the id of a peer the coordinator knows.
  PeerId pick_id() {
    const std::uint8_t b = in_.byte();
    const auto& peers = c_.peers();
    if (!peers.empty() && b < 0xf0) return std::next(peers.begin(), static_cast<std::ptrdiff_t>(b % peers.size()))->first;
    return PeerId{c_.config().instance_nonce, b};
  }

  const coord::Peer* peer_on(ConnId conn) const {
    const auto id = c_.peer_of(conn);
    return id ? c_.find_peer(*id) : nullptr;
  }
  std::uint64_t collective_attempt(ConnId conn, std::uint64_t tag) const {
    const coord::Peer* peer = peer_on(conn);
    if (peer == nullptr) return 0;
    const auto group = c_.collectives().find(peer->group);
    if (group == c_.collectives().end()) return 0;
    const auto it = group->second.find(tag);
    return it == group->second.end() ? 0 : it->second.attempt;
  }
  std::uint64_t sync_attempt(ConnId conn) const {
    const coord::Peer* peer = peer_on(conn);
    if (peer == nullptr) return 0;
    const auto it = c_.syncs().find(peer->group);
    return it == c_.syncs().end() ? 0 : it->second.attempt;
  }
  std::optional<std::uint64_t> group_revision(ConnId conn) const {
    const coord::Peer* peer = peer_on(conn);
    return peer == nullptr ? std::nullopt : c_.revision(peer->group);
  }

  // A message built from fields goes over the wire like any other: what does not
  // decode is a protocol error.
  void deliver(ConnId conn, const p::Message& message) {
    const std::vector<std::uint8_t> frame = p::encode_frame(message);
    deliver_payload(conn, p::type_of(message), std::span(frame).subspan(p::kFrameHeaderBytes));
  }

  // What the shell does with a frame (master_server.cpp: read_header, on_frame).
  void deliver_payload(ConnId conn, p::MsgType type, std::span<const std::uint8_t> payload) {
    if (verbose()) {
      std::fprintf(stderr, "   %s (%zu bytes) from %llu\n", p::msg_type_name(type), payload.size(),
                   static_cast<unsigned long long>(conn));
    }
    coord::Outbox out;
    if (type != p::MsgType::kHello && !c_.peer_of(conn)) {
      c_.on_protocol_error(conn, std::string("expected Hello, got ") + p::msg_type_name(type), now_, out);
      apply(out);
      forget(conn);
      return;
    }
    auto decoded = p::decode_payload(type, payload);
    if (!decoded.is_ok()) {
      c_.on_protocol_error(conn, decoded.status().message(), now_, out);
      apply(out);
      forget(conn);
      return;
    }
    const std::string before = c_.digest();
    c_.on_message(conn, decoded.value(), now_, out);
    check_refusal(conn, out, before);
    apply(out);
  }

  // A Refused answer means the request was illegal in the current state and nothing
  // changed (messages.h): the decision state is the same and nothing else happens.
  void check_refusal(ConnId conn, const coord::Outbox& out, const std::string& before) const {
    std::size_t sends = 0;
    bool refused = false;
    bool closed = false;
    for (const auto& command : coord::expanded(out)) {
      if (const auto* send = std::get_if<coord::Send>(&command)) {
        ++sends;
        refused = refused || (send->conn == conn && std::holds_alternative<p::Refused>(send->message));
      }
      closed = closed || std::holds_alternative<coord::Close>(command);
    }
    if (!refused) return;
    if (sends != 1 || closed) fail("a refused request was answered with more than the refusal");
    if (c_.digest() != before) fail("a refused request changed the state:\n  " + before + "\n  " + c_.digest());
  }

  bool is_live(ConnId conn) const { return std::find(live_.begin(), live_.end(), conn) != live_.end(); }

  void forget(ConnId conn) {
    auto it = std::find(live_.begin(), live_.end(), conn);
    if (it == live_.end()) return;
    live_.erase(it);
    gone_.push_back(conn);
  }

  // What the shell does with the commands; checks every message sent.
  void apply(const coord::Outbox& out) {
    for (const auto& command : coord::expanded(out)) {
      if (verbose()) print(command);
      if (const auto* send = std::get_if<coord::Send>(&command)) {
        const auto type = static_cast<std::uint16_t>(p::type_of(send->message));
        if (type < 64 || type >= 128) {
          fail(std::string("the coordinator sent a peer -> master message: ") + p::msg_type_name(p::type_of(send->message)));
        }
        fuzz::check_round_trip(send->message);
        if (std::find(gone_.begin(), gone_.end(), send->conn) != gone_.end()) {
          fail(std::string("the coordinator sent ") + p::msg_type_name(p::type_of(send->message)) +
               " to connection " + std::to_string(send->conn) + ", which is closed");
        }
        if (const auto* test = std::get_if<p::BandwidthTest>(&send->message)) {
          last_test_[send->conn] = {test->test, test->partner.id};
        }
      } else if (const auto* close = std::get_if<coord::Close>(&command)) {
        forget(close->conn);
      }
    }
  }

  static void print(const coord::Command& command) {
    if (const auto* send = std::get_if<coord::Send>(&command)) {
      std::fprintf(stderr, "   send %s to %llu\n", p::msg_type_name(p::type_of(send->message)),
                   static_cast<unsigned long long>(send->conn));
    } else if (const auto* close = std::get_if<coord::Close>(&command)) {
      std::fprintf(stderr, "   close %llu: %s\n", static_cast<unsigned long long>(close->conn), close->reason.c_str());
    } else if (const auto* event = std::get_if<coord::Event>(&command)) {
      std::fprintf(stderr, "   event: %s\n", event->text.c_str());
    }
  }

  fuzz::Input& in_;
  coord::Coordinator c_;
  TimeMs now_ = 0;
  ConnId next_conn_ = 1;
  std::vector<ConnId> live_;  // in the order opened
  std::vector<ConnId> gone_;
  // The last bandwidth test each connection was told to run: (test, partner).
  std::map<ConnId, std::pair<std::uint64_t, PeerId>> last_test_;
};

// ---- seeds: short scenarios in the input layout

class Script {
 public:
  Script() {
    for (int i = 0; i < 10; ++i) out_.byte(0);  // the default configuration
    out_.u<std::uint16_t>(0);                   // start time
  }
  explicit Script(std::array<std::uint8_t, 10> config) {
    for (const auto b : config) out_.byte(b);
    out_.u<std::uint16_t>(0);
  }
  // Connections are named by their index among the live ones (in the order opened).
  Script& connect(std::uint8_t host = 0) { return op(kConnect).b(host); }
  Script& hello(std::uint8_t conn, std::uint8_t group = 0) { return op(kHello).b(conn).b(group).b(1).b(1).b(0); }
  Script& vote_topology(std::uint8_t conn) { return op(kVoteTopology).b(conn); }
  Script& report(std::uint8_t conn) { return op(kReport).b(conn).b(0).b(0); }
  Script& report_unreachable(std::uint8_t conn, std::uint8_t peer) { return op(kReport).b(conn).b(0).b(1).b(peer); }
  Script& vote_pending(std::uint8_t conn) { return op(kVotePending).b(conn); }
  Script& vote_agree(std::uint8_t conn, bool flag) { return op(kVoteAgree).b(conn).b(flag ? 1 : 0); }
  Script& init(std::uint8_t conn, std::uint8_t tag, std::uint8_t descriptor = 0) {
    return op(kInit).b(conn).b(tag).b(descriptor);
  }
  Script& done(std::uint8_t conn, std::uint8_t tag, bool ok = true) {
    return op(kDone).b(conn).b(tag).b(0).b(ok ? 1 : 0).b(0);
  }
  // revision: 0 next, 1 same, 2 next + 1; tensors: (key, hash) in f32 of 1000 elements.
  Script& sync_vote(std::uint8_t conn, std::uint8_t strategy, std::uint8_t revision,
                    std::vector<std::pair<std::uint8_t, std::uint8_t>> tensors, bool large = false) {
    op(kSyncVote).b(conn).b(strategy).b(revision).b(static_cast<std::uint8_t>(tensors.size()));
    for (const auto& [key, hash] : tensors) b(key).b(0).b(large ? 2 : 0).b(hash).b(0);
    return *this;
  }
  Script& sync_done(std::uint8_t conn, bool ok = true) { return op(kSyncDone).b(conn).b(0).b(ok ? 0 : 2).b(0); }
  Script& heartbeat(std::uint8_t conn) { return op(kHeartbeat).b(conn); }
  Script& raw(std::uint8_t conn, std::uint8_t type_index, const std::vector<std::uint8_t>& payload) {
    op(kRaw).b(conn).b(type_index).b(static_cast<std::uint8_t>(payload.size()));
    out_.append(payload);
    return *this;
  }
  Script& disconnect(std::uint8_t conn) { return op(kDisconnect).b(conn); }
  Script& protocol_error(std::uint8_t conn) { return op(kProtocolError).b(conn); }
  Script& tick_seconds(std::uint8_t seconds) { return op(kTick).b(2).b(seconds); }
  Script& keep_alive() { return op(kKeepAlive); }
  Script& vote_optimize(std::uint8_t conn) { return op(kVoteOptimize).b(conn); }
  // Reports the last test the connection was told to run, at 1 Gbit/s.
  Script& bandwidth_report(std::uint8_t conn) { return op(kBandwidthReport).b(conn).b(0).b(1); }
  // A peer of a lost master's run (old id n) asks to be taken back, with term 1.
  Script& resume_hello(std::uint8_t conn, std::uint8_t n) { return op(kResumeHello).b(conn).b(0).b(n).b(n).b(1); }
  // Its report: epoch 2, a view of old ids 0..2, nothing in flight.
  Script& resume_report(std::uint8_t conn) {
    return op(kResumeReport).b(conn).b(2).b(0x07).b(0).b(40).b(1).b(3).b(0).b(0).b(0).b(0).b(0).b(0).b(1).b(0);
  }
  // Two peers in group 0, both accepted (the first alone, then the second by a vote).
  Script& two_accepted() {
    connect().hello(0).report(0);
    connect(1).hello(1).vote_topology(0).report(0).report(1);
    return *this;
  }
  std::vector<std::uint8_t> bytes() const { return out_.bytes(); }

 private:
  Script& op(Op o) { return b(static_cast<std::uint8_t>(o)); }
  // One byte, as Driver reads every selector and connection index.
  Script& b(std::uint8_t value) {
    out_.byte(value);
    return *this;
  }
  fuzz::Output out_;
};

fuzz::Seeds make_seeds() {
  fuzz::Seeds seeds;
  const auto add = [&](const char* name, const Script& s) { seeds.emplace_back(name, s.bytes()); };
  add("admit-two", Script().two_accepted().vote_pending(0).vote_pending(1).vote_agree(0, true).vote_agree(1, false));
  add("admit-three-groups", Script()
                                .connect().hello(0, 0).connect(1).hello(1, 1).connect(3).hello(2, 2)
                                .report(0).report(1).report(2)
                                .connect(1).hello(3, 1).vote_topology(0).vote_topology(1).vote_topology(2)
                                .report(0).report(1).report(2).report(3));
  add("unreachable-newcomer", Script().connect().hello(0).report(0).connect(1).hello(1).vote_topology(0)
                                  .report_unreachable(0, 1).report(1).vote_topology(0).report(0));
  add("collective", Script().two_accepted().init(0, 1).init(1, 1).done(0, 1).done(1, 1)
                        .init(0, 2).init(1, 2).done(0, 2, false).init(0, 3).init(1, 3, 2));
  add("collective-lost", Script().two_accepted().init(0, 1).init(1, 1).disconnect(1).done(0, 1));
  add("sync", Script().two_accepted()
                  .sync_vote(0, 0, 0, {{0, 1}, {1, 1}}).sync_vote(1, 1, 1, {{0, 2}, {1, 1}})
                  .sync_done(0).sync_done(1)
                  .sync_vote(0, 0, 0, {{0, 1}, {1, 1}}).sync_vote(1, 0, 2, {{0, 1}, {1, 1}}));
  add("sync-large", Script().connect().hello(0).report(0).connect(1).hello(1).connect(3).hello(2)
                        .vote_topology(0).report(0).report(1).report(2)
                        .sync_vote(0, 0, 0, {{0, 1}}, true).sync_vote(1, 0, 0, {{0, 1}}, true)
                        .sync_vote(2, 1, 1, {{0, 2}}, true).sync_done(2, false));
  add("sync-mismatch", Script().two_accepted().sync_vote(0, 0, 0, {{0, 1}}).sync_vote(1, 2, 0, {{2, 1}}));
  add("vote-mismatch", Script().two_accepted().vote_agree(0, true).vote_pending(1));
  add("timeouts", Script({0, 2, 1, 1, 0, 0, 0, 0, 0, 0})
                      .two_accepted().connect(1).vote_agree(0, true).tick_seconds(1).keep_alive()
                      .init(0, 0).tick_seconds(6).connect().tick_seconds(30));
  add("limits", Script({0, 0, 0, 0, 1, 1, 1, 0, 0, 0})
                    .connect().connect().connect().hello(0).hello(1).report(0).connect(2).hello(1)
                    .init(0, 0).init(0, 1).vote_topology(0));
  {
    Script optimize;
    optimize.connect().hello(0).report(0).connect(1).hello(1).connect(3).hello(2).connect(1).hello(3)
        .vote_topology(0).report(0).report(1).report(2).report(3)
        .vote_optimize(0).vote_optimize(1).vote_optimize(2).vote_optimize(3);
    for (int round = 0; round < 3; ++round) {
      optimize.bandwidth_report(0).bandwidth_report(1).bandwidth_report(2).bandwidth_report(3);
    }
    optimize.report(0).report(1).report(2).report(3);
    add("optimize", optimize);
  }
  add("failover", Script()
                      .connect().resume_hello(0, 0).connect().resume_hello(1, 1).connect().resume_hello(2, 2)
                      .resume_report(0).resume_report(1).resume_report(2).init(0, 1).init(1, 1).init(2, 1)
                      .connect().resume_hello(3, 3).tick_seconds(6));
  add("garbage", Script().connect().raw(0, 1, {}).connect().hello(0).report(0).raw(0, 10, {1, 2, 3})
                     .heartbeat(0).raw(0, 5, {2}).connect(2).protocol_error(0));
  return seeds;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz::write_seeds_if_asked(make_seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Input in(data, size);
  const coord::Config config = read_config(in);
  Driver(in, config).run();
  return 0;
}
