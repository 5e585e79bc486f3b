// Deterministic simulation of the whole control plane from one seed: the real
// Coordinator behind a model of the master's IO shell, simulated peers that follow the
// documented application loop, and a simulated network between them, all driven by one
// priority queue of events in simulated time (docs/simulation.md).
//
// The network: every peer has one TCP connection to the master, two FIFO directions
// with a random delay per message (sub-millisecond to tens of milliseconds, sometimes a
// long tail), so deliveries on different connections interleave arbitrarily while each
// connection keeps its order. Faults at any moment: crashes (the peer's side closes,
// what it sent last may be lost), stops (the peer freezes, buffers what it is sent and
// resumes later), partitions (a set of peers silent in both directions, to the master
// and the other peers, or only to the other peers; held messages are delivered in order
// on heal) and connection drops (each direction delivers a prefix of what was in
// flight, then both ends see the close). New peers join over time.
//
// Each peer's master link is the real peer::Session, fed the simulated time and messages
// and its commands carried out as peer/link.cpp does (heartbeats, the silence check,
// routing by tag, slot turns, commits' late outcomes dropped), and what the peer sends
// goes through it.
//
// The master crashes too (on most seeds): every master connection closes (what was in
// flight to the peers may be lost), what the peers send it is lost, and after a delay
// (mostly seconds, sometimes past the failover timeout) a fresh Coordinator starts with
// a new instance nonce; now and then it crashes again during the recovery. The peers run
// with failover on (most seeds; 30 s): the session's Reconnect is carried out as
// Link::reconnect_loop does (a resume Hello, retried after a pause that doubles from
// 0.1 s to 1 s; refused while no master runs, a 2 s timeout while cut off), its resume
// on Welcome, the report, the forwarded outcomes, Resumed, and its own refusals of the
// rounds the lost master had started.
//
// The peers run the loop of tools/soak/worker.cpp as a state machine: connect and wait
// to be accepted; per step: sync the shared state (retried on PEER_CONNECTION_LOST; after
// NO_SHARED_STATE_AVAILABLE a pause and the membership check first), K concurrent
// collectives (slot turns in Go order, the ring's data flow modelled from who is alive,
// stopped or cut off; failed tags retried with the survivors once all ended), agree,
// are-peers-pending, update topology when pending (retried while it fails), and every
// few rounds an optimize topology with bandwidth tests answered from a seeded matrix.
//
// Checked after every event: the coordinator's own invariants; every message a peer
// receives is one a correct program can receive (no Refused, no OPERATION_MISMATCH,
// no revision violation: these peers never misbehave); one outcome per collective
// attempt, per sync attempt, per agree and per are-peers-pending round; at most one
// major operation per group as the peers see it; the revision rule (R grows by one,
// a peer in step presents R+1 and gets it) and parity (every participant of a
// successful sync holds the elected content); the same membership view and ring on all
// peers of a group at each epoch; sync plans name sources that hold the target. Across
// the master's crashes: one outcome per attempt and per control round (the k-th of a
// view) at every peer still in the run (a peer the new master did not take back may have
// learned another); a peer's revision never goes back, the new master continues from
// the highest revision any peer it took back synced (none lost) and from none above what
// was decided; a peer grants a term only above every term it granted (one master per
// term). Every 50 ms of simulated time: liveness (a group with at least two live,
// connected peers, one of which holds the state, must complete a sync within a bound once
// the faults stopped and the master took the run back; by then no membership view names a
// removed peer), evicted peers learn it, dead peers leave the coordinator, and no peer is
// without a serving master for longer than the failover timeout.
//
// Environment: LOCKSTEP_NETSIM_SEEDS=N runs seeds 1..N (default 200),
// LOCKSTEP_NETSIM_FIRST_SEED=S starts there instead (to split millions of seeds over
// processes), LOCKSTEP_NETSIM_SECONDS=N simulated seconds per seed (default 60),
// LOCKSTEP_NETSIM_SEED=X runs only seed X, LOCKSTEP_NETSIM_VERBOSE=1 prints the whole
// trace of a failing seed instead of its last 300 lines (of that one seed even when it
// passes). A failing seed is run again with tracing on (the run is deterministic) to
// print its trace.
#include "common/dtype.h"
#include "common/log.h"
#include "coordinator/coordinator.h"
#include "peer/session.h"
#include "protocol/codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <queue>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace lockstep::coord {
namespace {

namespace p = lockstep::proto;

using TimeUs = std::int64_t;
constexpr TimeUs kMs = 1000;
constexpr TimeUs kSec = 1000 * kMs;

std::optional<std::uint64_t> env_u64(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::strtoull(value, nullptr, 0);
}

std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Content stands for a digest: the key's hash in the high half, a number in the low.
state::Digest digest_of(const std::string& key, std::uint64_t value) {
  std::uint64_t h = 1469598103934665603ull;
  for (const char ch : key) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
  return state::Digest{h, value};
}

std::string ids(const std::vector<PeerId>& v) {
  std::string s;
  for (const auto& id : v) {
    if (!s.empty()) s += ' ';
    s += id.to_string();
  }
  return s;
}
std::string ids(const std::vector<p::MemberInfo>& v) {
  std::string s;
  for (const auto& m : v) {
    if (!s.empty()) s += ' ';
    s += m.id.to_string();
  }
  return s;
}

std::string describe(const p::Message& m) {
  std::ostringstream s;
  s << p::msg_type_name(p::type_of(m));
  std::visit(
      [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (requires { v.status; }) s << " " << status_name(v.status);
        if constexpr (requires { v.tag; }) s << " tag=" << v.tag;
        if constexpr (requires { v.attempt; }) s << " attempt=" << v.attempt;
        if constexpr (requires { v.epoch; }) s << " epoch=" << v.epoch;
        if constexpr (requires { v.test; }) s << " test=" << v.test;
        if constexpr (std::is_same_v<T, p::EstablishP2P> || std::is_same_v<T, p::TopologyResult>) {
          s << " ring=[" << ids(v.ring) << "]";
        }
        if constexpr (std::is_same_v<T, p::CollectiveGo>) s << " slot=" << v.slot << " absent=[" << ids(v.absent) << "]";
        if constexpr (std::is_same_v<T, p::P2PReport>) s << " unreachable=[" << ids(v.unreachable) << "]";
        if constexpr (std::is_same_v<T, p::CollectiveDone>) s << " ok=" << v.ok;
        if constexpr (std::is_same_v<T, p::AgreeResult>) s << " value=" << v.value;
        if constexpr (std::is_same_v<T, p::VoteAgree>) s << " flag=" << v.flag;
        if constexpr (std::is_same_v<T, p::PeersPendingResult>) s << " pending=" << v.pending;
        if constexpr (std::is_same_v<T, p::Refused>) s << " request=" << p::msg_type_name(v.request);
        if constexpr (std::is_same_v<T, p::Hello>) s << " group=" << v.group << " pool=" << v.pool_size;
        if constexpr (std::is_same_v<T, p::Welcome>) s << " id=" << v.id.to_string();
        if constexpr (std::is_same_v<T, p::SyncVote>) {
          s << " " << p::to_string(v.strategy) << " rev=" << v.revision << " [";
          for (std::size_t i = 0; i < v.tensors.size(); ++i) s << (i ? " " : "") << v.tensors[i].hash.lo;
          s << "]";
        }
        if constexpr (std::is_same_v<T, p::SyncPlan>) {
          s << " rev=" << v.revision << " expect=" << v.expect.size() << " fetches=" << v.fetches.size();
        }
        if constexpr (std::is_same_v<T, p::SyncResult>) s << " rev=" << v.revision;
        if constexpr (std::is_same_v<T, p::BandwidthTest>) s << " partner=" << v.partner.id.to_string();
        if constexpr (std::is_same_v<T, p::BandwidthReport>) s << " from=" << v.from.to_string() << " rate=" << v.bytes_per_s;
        if constexpr (requires { v.reason; }) {
          if (!v.reason.empty()) s << " \"" << v.reason << "\"";
        }
      },
      m);
  return s.str();
}

// What went over the wire is what the codec gives back: every message of the
// simulation is encoded and decoded, as the shells do.
p::Message wire(const p::Message& m) {
  const std::vector<std::uint8_t> bytes = p::encode_frame(m);
  auto header = p::decode_header(std::span<const std::uint8_t, p::kFrameHeaderBytes>(bytes.data(), p::kFrameHeaderBytes));
  if (!header.is_ok()) throw std::runtime_error("codec: header of " + describe(m) + ": " + header.status().to_string());
  auto decoded = p::decode_payload(header.value().type, std::span<const std::uint8_t>(bytes).subspan(p::kFrameHeaderBytes));
  if (!decoded.is_ok()) throw std::runtime_error("codec: payload of " + describe(m) + ": " + decoded.status().to_string());
  return std::move(decoded.value());
}

struct Failure {
  std::string what;
};

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : g_(seed) {}
  std::uint64_t next() { return g_(); }
  std::uint64_t below(std::uint64_t n) { return n == 0 ? 0 : g_() % n; }
  bool chance(unsigned percent) { return below(100) < percent; }
  TimeUs between(TimeUs lo, TimeUs hi) { return lo + static_cast<TimeUs>(below(static_cast<std::uint64_t>(hi - lo + 1))); }

 private:
  std::mt19937_64 g_;
};

// ---------------------------------------------------------------- network

struct Frame {
  enum Kind : std::uint8_t { kMessage, kOpen, kFin };
  Kind kind = kMessage;
  p::Message message;
  TimeUs arrive = 0;
};

// One direction of a TCP connection: FIFO; while held (partitioned) nothing arrives.
// Scheduled deliveries carry the generation they were made for, so that holding,
// truncating or re-timing the queue cancels them.
struct Direction {
  std::deque<Frame> frames;
  TimeUs last_arrival = 0;
  std::uint64_t gen = 0;
  bool held = false;
};

struct Conn {
  ConnId id = 0;
  std::size_t proc = 0;
  Direction up;    // peer -> master
  Direction down;  // master -> peer
  bool master_open = true;  // the shell still feeds it to the coordinator
  bool peer_open = true;    // the peer's side is open
  std::uint32_t gen = 1;    // the master (generation) it was opened to
  bool handshake = false;   // a failover Hello waits for its reply (Welcome or Goodbye)
  TimeUs delay_lo_us = 100, delay_hi_us = 2 * kMs;
};

// ---------------------------------------------------------------- peers

enum class Stage {
  kConnecting,    // Hello sent, waiting for Welcome
  kJoining,       // registered, waiting for an establishment (a newcomer)
  kEstablishing,  // connecting to ring neighbours
  kReported,      // P2PReport sent, waiting for the topology result
  kAlone,         // accepted, group of one: waiting a moment before are-peers-pending
  kSyncVote,
  kSyncTransfer,
  kSyncWait,      // pausing before a sync retry (nobody holds the next revision)
  kCompute,
  kCollectives,
  kAgree,
  kPending,
  kUpdateVote,
  kOptimizeVote,  // also: running bandwidth tests
  kDead,          // the process is gone (crashed, or exited after its communicator ended)
};

const char* to_string(Stage s) {
  switch (s) {
    case Stage::kConnecting: return "connecting";
    case Stage::kJoining: return "joining";
    case Stage::kEstablishing: return "establishing";
    case Stage::kReported: return "reported";
    case Stage::kAlone: return "alone";
    case Stage::kSyncVote: return "sync-vote";
    case Stage::kSyncTransfer: return "sync-transfer";
    case Stage::kSyncWait: return "sync-wait";
    case Stage::kCompute: return "compute";
    case Stage::kCollectives: return "collectives";
    case Stage::kAgree: return "agree";
    case Stage::kPending: return "pending";
    case Stage::kUpdateVote: return "update-vote";
    case Stage::kOptimizeVote: return "optimize-vote";
    case Stage::kDead: return "dead";
  }
  return "?";
}

// A tag of the current step at one peer.
struct TagState {
  enum class St { kVoting, kQueued, kRunning, kLocalDone, kEnded };
  St st = St::kVoting;
  std::uint64_t attempt = 0;
  std::uint32_t slot = 0;
  std::vector<PeerId> ring;
  StatusCode outcome = LOCKSTEP_OK;
  std::uint64_t key = 0;  // the attempt's key in the simulation's records (lineage())
};

// The data flow of one collective attempt, as all its participants do it.
struct RingAttempt {
  std::vector<PeerId> ring;
  // per participant: 0 not started, 1 moving data, 2 finished its part, 3 aborted
  std::map<PeerId, int> state;
};

enum class TimerKind : std::uint8_t {
  kHeartbeat,
  kFlow,            // a pause of the loop ended (compute, alone, sync retry)
  kEstablishCheck,  // arg: epoch
  kRingPoll,        // arg: attempt
  kCommitPoll,      // arg: attempt
  kFetchPoll,       // arg: sync attempt
  kBandwidthDone,   // arg: test; arg2: partner proc
  kReconnect,       // failover: the next try of the reconnect loop; arg: its generation
  kHandshake,       // failover: the reply to a resume Hello is overdue; arg: the connection
  kDrain,           // the owner takes what the session put in its mailbox
};

struct SimEvent {
  enum Kind : std::uint8_t { kTick, kDeliver, kTimer, kChaos, kSpawn, kAudit, kHeal, kResume, kMasterCrash, kMasterRestart };
  TimeUs at = 0;
  std::uint64_t seq = 0;
  Kind kind = kTick;
  std::size_t a = 0;    // conn or proc or partition
  std::uint64_t b = 0;  // direction (0 up, 1 down) or timer kind
  std::uint64_t c = 0;  // generation or timer argument
  std::uint64_t d = 0;  // second timer argument / flow generation
  bool operator>(const SimEvent& o) const { return at != o.at ? at > o.at : seq > o.seq; }
};

struct Proc {
  std::size_t index = 0;
  ConnId conn = 0;
  std::uint32_t group = 0;
  std::uint16_t pool = 1;
  std::string host;
  bool stopped = false;
  bool bootstrap = false;  // presents the initial state (its group had none when it started)
  Stage stage = Stage::kConnecting;
  PeerId id;
  bool accepted = false;
  TimeUs started_us = 0, dead_us = 0;
  // The real peer::Session decides about the master link once welcomed: heartbeats,
  // silence, routing to the collectives by tag, slot turns, commits' late outcomes.
  peer::Session session{false};
  // peer::Session's timer: the next heartbeat, and the generation of the armed wake-up
  // (arming replaces the previous one)
  std::uint64_t heartbeat_gen = 0;
  std::uint64_t flow_gen = 0;
  // membership
  std::uint64_t epoch = 0;
  std::vector<p::MemberInfo> view;
  std::uint32_t world = 0;
  std::uint64_t est_epoch = 0;
  std::vector<p::MemberInfo> est_ring;
  TimeUs est_started_us = 0;
  bool optimizing = false;
  // messages that arrived while it was busy connecting (the real peer's mailbox)
  std::deque<p::Message> mailbox;
  std::uint32_t pending_rounds = 0;  // are-peers-pending rounds since its last topology result
  std::uint32_t control_rounds = 0;  // control outcomes (pending, agree, sync) since then
  // shared state
  std::uint64_t revision = 0;  // the revision it presents at its next sync
  bool synced = false;
  std::vector<std::uint64_t> content;  // per tensor of its group's shape
  std::uint64_t synced_revision = 0;  // of its last successful sync
  p::SyncVote vote;
  p::SyncPlan plan;
  std::uint64_t plan_key = 0;  // the plan's attempt, as lineage() names it
  TimeUs plan_us = 0;          // when it read the plan
  bool done_sent = false;
  bool done_ok = false;  // reported its transfers as verified
  // collectives of the current step
  std::map<std::uint64_t, TagState> tags;
  bool agree_flag = false;
  // a stopped process: what arrived and which timers fired meanwhile
  std::deque<Frame> frozen_frames;
  std::vector<SimEvent> frozen_timers;
  TimeUs ghost_since_us = -1;
  // failover: its first Hello (the base of a resume Hello), the master generation of
  // the message being handled, the reconnect loop (generation, pause), since when it is
  // without a serving master, and the terms it granted (term, master generation)
  p::Hello hello;
  std::uint32_t msg_gen = 0;
  std::uint32_t run = 0;  // the run it joined (Sim::run_)
  std::uint64_t reconnect_gen = 0;
  TimeUs reconnect_pause_us = 0;
  TimeUs failover_since_us = -1;
  TimeUs resumed_us = -1'000'000'000;  // when it last resumed from a stop
  std::vector<std::pair<std::uint64_t, std::uint32_t>> terms;
};

struct Partition {
  std::set<std::size_t> procs;
  bool isolate = false;  // also from the master (else only from the other peers)
  bool active = true;
};

// Totals, to report what the runs exercised.
enum Count : std::size_t {
  kEvents, kDeliveries, kSimUs, kSyncsOk, kSyncsFailed, kNoState, kCollectivesOk, kCollectivesFailed, kCollectiveAborts, kCommits,
  kTopologyOk, kTopologyFailed, kOptimizeOk, kOptimizeFailed, kBandwidthTests, kAgreeOk, kAgreeLost,
  kPendingYes, kPendingNo, kJoined, kKicked, kRejected, kMasterLost, kCrashes, kStops, kIsolations,
  kP2PPartitions, kDrops, kEvictions, kSpawned, kLivenessArmed, kRevisions, kSplitFetches,
  kMasterCrashes, kMasterRestarts, kCrashInRecovery, kCrashInTopologyVote, kCrashInJoin, kCrashInOptimize,
  kCrashInPending, kCrashInAgree, kCrashInCollective, kCrashInSync, kRecoveries, kTakenBack, kForwarded,
  kResumeTries, kTermRefusals, kFailoverKicked, kFailoverTimeouts, kSessionRefusals, kFailoverSeeds, kCounts
};
struct Stats {
  std::array<std::uint64_t, kCounts> n{};
  TimeUs longest_armed_stall_us = 0;
  void add(const Stats& o) {
    for (std::size_t i = 0; i < kCounts; ++i) n[i] += o.n[i];
    longest_armed_stall_us = std::max(longest_armed_stall_us, o.longest_armed_stall_us);
  }
};

const p::CollectiveDescriptor kDescriptor{1 << 16, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE};

// ---------------------------------------------------------------- the simulation

class Sim {
 public:
  Sim(std::uint64_t seed, TimeUs duration_us, bool trace, bool verbose)
      : seed_(seed), rng_(seed), duration_us_(duration_us), trace_(trace), verbose_(verbose), base_config_(make_config()) {
    // Failover on most seeds' peers; the master crashes on most of those. A short
    // recovery window keeps the runs short (the product's default is 5 s).
    failover_ = rng_.chance(80);
    master_crashes_ = failover_ && rng_.chance(75);
    base_config_.recovery_window_ms = static_cast<std::uint32_t>(1'000 + rng_.below(4'000));
    c_ = std::make_unique<Coordinator>(base_config_);
    const std::uint32_t group_ids[] = {0, 7, 0xffffffffu};
    const std::size_t groups = rng_.chance(70) ? 1 : 2 + rng_.below(2);
    groups_.assign(group_ids, group_ids + groups);
    peers_max_ = static_cast<std::size_t>(3 + rng_.below(6)) + (groups > 1 ? 2 : 0);
    reduces_ = static_cast<std::uint32_t>(1 + rng_.below(4));
    optimize_every_ = rng_.chance(60) ? static_cast<std::uint32_t>(2 + rng_.below(4)) : 0;
    // Above the skew of the master's messages to different peers (a delay of up to
    // 50 ms plus a tail of up to 200 ms): each peer's wait for its previous ring
    // neighbour starts when it reads its own EstablishP2P, so a shorter timeout makes
    // an innocent accepted peer report that neighbour unreachable, and be removed,
    // without any fault (seen with 208 ms).
    p2p_connect_timeout_us_ = rng_.between(1000, 3000) * kMs;
    // Liveness bound after the last fault: detection of what the last fault left
    // behind (heartbeat timeout, vote timeout, a p2p connect timeout of a failed
    // establishment, a measurement) plus a few steps.
    live_bound_us_ = 8 * static_cast<TimeUs>(c_->config().heartbeat_timeout_ms) * kMs +
                     2 * static_cast<TimeUs>(c_->config().vote_timeout_ms) * kMs + 4 * p2p_connect_timeout_us_ +
                     static_cast<TimeUs>(c_->config().bandwidth_test_ms) * kMs * static_cast<TimeUs>(peers_max_);
    static const std::uint8_t dtypes[] = {LOCKSTEP_F32, LOCKSTEP_BF16, LOCKSTEP_U8, LOCKSTEP_F64};
    for (const std::uint32_t group : groups_) {
      const std::size_t tensors = 1 + rng_.below(3);
      const std::uint8_t dtype = dtypes[rng_.below(4)];
      auto& shape = shapes_[group];
      for (std::size_t i = 0; i < tensors; ++i) {
        p::TensorEntry t;
        t.key = "w";
        t.key += std::to_string(i);
        t.dtype = dtype;
        t.count = 1 + rng_.below(5000);
        if (i == 0 && rng_.chance(40)) t.count = (2 + rng_.below(5)) << 21;
        t.allow_content_inequality = tensors >= 2 && i + 1 == tensors && rng_.chance(30);
        shape.push_back(t);
      }
    }
  }

  // Returns the failure description, or an empty string.
  std::string run() {
    try {
      schedule(0, SimEvent::kTick);
      schedule(0, SimEvent::kAudit);
      schedule(0, SimEvent::kSpawn);
      schedule(rng_.between(2, 6) * kSec, SimEvent::kChaos);
      while (!queue_.empty()) {
        SimEvent e = queue_.top();
        queue_.pop();
        if (e.at > duration_us_) break;
        now_ = e.at;
        ++stats_.n[kEvents];
        dispatch(e);
      }
      stats_.n[kSimUs] = static_cast<std::uint64_t>(std::min(now_, duration_us_));
      stats_.n[kFailoverSeeds] = failover_ ? 1 : 0;
      for (const auto g : groups_) stats_.n[kRevisions] += highest_revision_[g];
    } catch (const Failure& f) {
      return report(f.what);
    } catch (const std::exception& e) {
      return report(std::string("exception: ") + e.what());
    }
    return {};
  }

  const Stats& stats() const { return stats_; }
  std::string trace() const {
    std::string out;
    for (const auto& line : log_) out += line + "\n";
    return out;
  }

 private:
  Config make_config() {
    Config config;
    config.heartbeat_timeout_ms = 1'000;
    config.handshake_timeout_ms = 2'000;
    config.establish_timeout_ms = 4'000;
    config.vote_timeout_ms = rng_.chance(30) ? static_cast<std::uint32_t>(2'000 + rng_.below(2'000)) : 0;
    config.bandwidth_test_ms = static_cast<std::uint32_t>(50 + rng_.below(250));
    config.measure_round_timeout_ms = 4'000;
    config.instance_nonce = rng_.next();
    return config;
  }

  [[noreturn]] void fail(const std::string& what) { throw Failure{what}; }
  void require(bool ok, const std::string& what) {
    if (!ok) fail(what);
  }

  std::string stamp() const {
    std::ostringstream s;
    s << "t=" << now_ / kMs << "." << (now_ % kMs) / 100 << " ";
    return s.str();
  }
  void note(const std::string& line) {
    if (!trace_) return;
    log_.push_back(stamp() + line);
    if (!verbose_ && log_.size() > 300) log_.pop_front();
  }
  std::string name(const Proc& pr) const {
    std::string s = "#" + std::to_string(pr.index);
    if (!pr.id.is_nil()) s += "(" + pr.id.to_string() + " g" + std::to_string(pr.group) + ")";
    return s;
  }

  std::string report(const std::string& what) {
    std::ostringstream s;
    s << "seed " << seed_ << " failed at t=" << now_ / kMs << " ms: " << what << "\n";
    s << "config: groups=" << groups_.size() << " peers_max=" << peers_max_ << " reduces=" << reduces_
      << " optimize_every=" << optimize_every_ << " vote_timeout_ms=" << c_->config().vote_timeout_ms
      << " bandwidth_test_ms=" << c_->config().bandwidth_test_ms << " p2p_connect_timeout_ms="
      << p2p_connect_timeout_us_ / kMs << " failover=" << failover_ << " master_crashes=" << master_crashes_
      << " recovery_window_ms=" << base_config_.recovery_window_ms << "\n";
    s << "master " << gen_ << ": " << (master_up_ ? "up" : "DOWN") << ", term " << c_->term()
      << (c_->recovering() ? ", recovering" : "") << (awaiting_recovery_ ? ", has not taken the run back yet" : "") << "\n";
    s << "coordinator: " << c_->digest() << "\n";
    s << "the coordinator waits for:" << waiting_for() << "\n";
    s << "peers:\n";
    for (const auto& pr : procs_) {
      if (pr.stage == Stage::kDead) continue;
      const Peer* cp = pr.id.is_nil() ? nullptr : c_->find_peer(pr.id);
      s << "  " << name(pr) << " " << to_string(pr.stage) << (pr.stopped ? " STOPPED" : "")
        << (cut_from_master(pr.index) ? " ISOLATED" : "") << " rev=" << pr.revision << " synced=" << pr.synced
        << " world=" << pr.world << " tags=" << pr.tags.size() << " session=" << session_state(pr) << " coordinator: "
        << (cp == nullptr ? "gone" : std::string(to_string(cp->phase)) + "/" + to_string(cp->state)) << "\n";
    }
    if (trace_) {
      s << "trace (" << (verbose_ ? "all" : "last " + std::to_string(log_.size())) << " lines):\n";
      for (const auto& line : log_) s << "  " << line << "\n";
    }
    s << "replay with: LOCKSTEP_NETSIM_SEED=" << seed_ << " LOCKSTEP_NETSIM_SECONDS=" << duration_us_ / kSec
      << " [LOCKSTEP_NETSIM_VERBOSE=1] ./sim_network_test\n";
    return s.str();
  }

  static const char* session_state(const Proc& pr) {
    switch (pr.session.state()) {
      case peer::Session::State::kCreated: return "created";
      case peer::Session::State::kConnected: return "connected";
      case peer::Session::State::kReconnecting: return "reconnecting";
      case peer::Session::State::kResuming: return "resuming";
      case peer::Session::State::kEnded: return "ended";
    }
    return "?";
  }

  // Who holds up each open vote or phase of the coordinator, from its public state.
  std::string waiting_for() const {
    std::string s;
    const auto missing = [&](const std::string& what, const std::vector<PeerId>& who) {
      if (!who.empty()) s += "\n  " + what + ": " + ids(who);
    };
    std::vector<PeerId> topology, establish, measure, pending;
    bool pending_open = false;
    for (const auto& [id, peer] : c_->peers()) pending_open = pending_open || peer.voted_pending;
    for (const auto& [id, peer] : c_->peers()) {
      if (peer.phase != Phase::kAccepted) continue;
      const bool voted = peer.state == PeerState::kVoteAcceptNewPeers || peer.state == PeerState::kVoteOptimizeTopology;
      if (c_->topology_phase() == TopologyPhase::kVoting && !voted) topology.push_back(id);
      if (c_->topology_phase() == TopologyPhase::kMeasuring && !peer.measured) measure.push_back(id);
      if (pending_open && !peer.voted_pending) pending.push_back(id);
    }
    for (const auto& [id, peer] : c_->peers()) {
      if (peer.state == PeerState::kEstablishingP2P && !peer.p2p_reported) establish.push_back(id);
    }
    missing("topology vote", topology);
    missing("p2p reports", establish);
    missing("bandwidth reports (this round, or later rounds)", measure);
    missing("are-peers-pending vote", pending);
    for (const auto& [group, tags] : c_->collectives()) {
      for (const auto& [tag, c] : tags) {
        std::vector<PeerId> who;
        if (c.phase == Collective::Phase::kVoting) {
          for (const auto& id : c_->ring(group)) {
            if (c.votes.count(id) == 0) who.push_back(id);
          }
        } else {
          for (const auto& id : c.participants) {
            if (c.done.count(id) == 0) who.push_back(id);
          }
        }
        missing("group " + std::to_string(group) + " tag " + std::to_string(tag) +
                    (c.phase == Collective::Phase::kVoting ? " vote" : " attempt " + std::to_string(c.attempt)),
                who);
      }
    }
    for (const auto& [group, sync] : c_->syncs()) {
      std::vector<PeerId> who;
      if (sync.phase == SharedStateSync::Phase::kVoting) {
        for (const auto& id : c_->ring(group)) {
          if (sync.votes.count(id) == 0) who.push_back(id);
        }
      } else {
        for (const auto& id : sync.participants) {
          if (sync.done.count(id) == 0) who.push_back(id);
        }
      }
      missing("group " + std::to_string(group) + " sync " +
                  (sync.phase == SharedStateSync::Phase::kVoting ? "vote" : "attempt " + std::to_string(sync.attempt)),
              who);
    }
    return s.empty() ? " nothing (no vote or phase is open)" : s;
  }

  // ------------------------------------------------------------ events

  void schedule(TimeUs at, SimEvent::Kind kind, std::size_t a = 0, std::uint64_t b = 0, std::uint64_t c = 0,
                std::uint64_t d = 0) {
    queue_.push(SimEvent{at, next_seq_++, kind, a, b, c, d});
  }
  void timer(const Proc& pr, TimeUs delay, TimerKind kind, std::uint64_t arg = 0, std::uint64_t arg2 = 0) {
    schedule(now_ + delay, SimEvent::kTimer, pr.index, static_cast<std::uint64_t>(kind), arg, arg2);
  }

  void dispatch(const SimEvent& e) {
    switch (e.kind) {
      case SimEvent::kTick: {
        if (master_up_) {
          Outbox out;
          c_->on_tick(now_ / kMs, out);
          apply(out);
        }
        schedule(now_ + 20 * kMs, SimEvent::kTick);
        return;
      }
      case SimEvent::kDeliver: return deliver(conns_.at(e.a - 1), e.b == 0, e.c);
      case SimEvent::kTimer: {
        Proc& pr = procs_.at(e.a);
        if (pr.stage == Stage::kDead) return;
        if (pr.stopped) {
          pr.frozen_timers.push_back(e);
          return;
        }
        return on_timer(pr, static_cast<TimerKind>(e.b), e.c, e.d);
      }
      case SimEvent::kChaos: return chaos();
      case SimEvent::kSpawn: return spawn_tick();
      case SimEvent::kAudit:
        audit();
        schedule(now_ + 50 * kMs, SimEvent::kAudit);
        return;
      case SimEvent::kHeal: return heal(e.a);
      case SimEvent::kResume: return resume(procs_.at(e.a));
      case SimEvent::kMasterCrash: return e.a == gen_ ? master_crash() : void();
      case SimEvent::kMasterRestart: return master_restart();
    }
  }

  // ------------------------------------------------------------ network

  TimeUs delay(const Conn& c) {
    TimeUs d = rng_.between(c.delay_lo_us, c.delay_hi_us);
    if (rng_.chance(2)) d += rng_.between(20 * kMs, 200 * kMs);  // a long tail (retransmission)
    return d;
  }

  void push(Conn& c, bool up, Frame frame) {
    Direction& d = up ? c.up : c.down;
    frame.arrive = std::max(now_ + delay(c), d.last_arrival);
    d.last_arrival = frame.arrive;
    d.frames.push_back(std::move(frame));
    if (!d.held) schedule(d.frames.back().arrive, SimEvent::kDeliver, c.id, up ? 0 : 1, d.gen);
  }

  // Cancels what was scheduled for the direction and schedules its frames again, with
  // new arrival times if `retime` (after a partition heals).
  void reschedule(Conn& c, bool up, bool retime) {
    Direction& d = up ? c.up : c.down;
    ++d.gen;
    if (d.held) return;
    TimeUs last = now_;
    for (auto& f : d.frames) {
      f.arrive = retime ? std::max(now_ + delay(c), last) : std::max(f.arrive, last);
      last = f.arrive;
      schedule(f.arrive, SimEvent::kDeliver, c.id, up ? 0 : 1, d.gen);
    }
    d.last_arrival = std::max(d.last_arrival, last);
  }

  void deliver(Conn& c, bool up, std::uint64_t gen) {
    Direction& d = up ? c.up : c.down;
    if (gen != d.gen || d.held || d.frames.empty()) return;
    Frame f = std::move(d.frames.front());
    d.frames.pop_front();
    ++stats_.n[kDeliveries];
    if (up) return deliver_to_master(c, f);
    Proc& pr = procs_.at(c.proc);
    if (pr.stage == Stage::kDead || !c.peer_open) return;
    if (pr.stopped) {
      pr.frozen_frames.push_back(std::move(f));
      return;
    }
    deliver_to_peer(pr, f);
  }

  void deliver_to_master(Conn& c, const Frame& f) {
    if (!master_up_ || c.gen != gen_) return;  // its master crashed: nobody reads it
    Outbox out;
    if (f.kind == Frame::kOpen) {
      note("master: connection " + std::to_string(c.id) + " from " + procs_.at(c.proc).host);
      c_->on_connect(c.id, procs_.at(c.proc).host, now_ / kMs, out);
    } else if (!c.master_open) {
      return;  // the shell closed it: late bytes are dropped
    } else if (f.kind == Frame::kFin) {
      note("master: connection " + std::to_string(c.id) + " closed by the peer");
      c.master_open = false;
      c_->on_disconnect(c.id, "closed by the peer", now_ / kMs, out);
    } else {
      if (trace_) note("master <- " + name(procs_.at(c.proc)) + ": " + describe(f.message));
      c_->on_message(c.id, f.message, now_ / kMs, out);
    }
    apply(out);
  }

  // Carries out the coordinator's commands as the master's shell does, and checks the
  // outcomes it sends as a batch (one decision for all).
  void apply(Outbox& batch) {
    Outbox out = expanded(batch);
    std::map<std::uint32_t, p::AgreeResult> agree;
    std::optional<p::PeersPendingResult> pending;
    bool resumed = false;
    for (auto& cmd : out) {
      if (auto* send = std::get_if<Send>(&cmd)) {
        Conn& c = conns_.at(send->conn - 1);
        require(c.master_open, "the coordinator sent " + describe(send->message) + " on connection " +
                                   std::to_string(send->conn) + ", which it no longer has");
        if (const auto* r = std::get_if<p::AgreeResult>(&send->message)) {
          auto [it, fresh] = agree.try_emplace(procs_.at(c.proc).group, *r);
          require(fresh || it->second == *r, "two agree outcomes in one decision: " + describe(it->second) + " and " +
                                                 describe(*r));
        }
        if (const auto* r = std::get_if<p::PeersPendingResult>(&send->message)) {
          if (!pending) pending = *r;
          require(*pending == *r, "two are-peers-pending outcomes in one decision");
        }
        // the shell knows whose connection it is; the other peers may hear of the new
        // identity (in a ring) before the peer reads its Welcome
        if (const auto* w = std::get_if<p::Welcome>(&send->message)) by_id_[w->id] = c.proc;
        if (const auto* r = std::get_if<p::Resumed>(&send->message)) {
          require(r->term == c_->term(), "Resumed names term " + std::to_string(r->term) + ", the master's is " +
                                             std::to_string(c_->term()));
          resumed = true;
          ++stats_.n[kTakenBack];
        }
        push(c, /*up=*/false, Frame{Frame::kMessage, wire(send->message), 0});
      } else if (auto* close = std::get_if<Close>(&cmd)) {
        Conn& c = conns_.at(close->conn - 1);
        require(c.master_open, "the coordinator closed connection " + std::to_string(close->conn) + " twice");
        note("master: closes connection " + std::to_string(close->conn) + " (" + close->reason + ")");
        c.master_open = false;
        push(c, /*up=*/false, Frame{Frame::kFin, {}, 0});
      } else if (auto* ev = std::get_if<coord::Event>(&cmd)) {
        note("coordinator: " + ev->text);
        if (ev->text.find("forwarding") != std::string::npos) ++stats_.n[kForwarded];
      }
    }
    if (resumed) recovered();
    after_coordinator();
  }

  // The master took the run back (its batch sends Resumed): no successful revision is
  // lost, whatever the peers that did not come back knew.
  void recovered() {
    ++stats_.n[kRecoveries];
    awaiting_recovery_ = false;
    last_fault_us_ = now_;
    for (const auto& pr : procs_) {
      if (pr.stage == Stage::kDead || !pr.synced) continue;
      const Peer* cp = c_->find_peer(pr.id);
      if (cp == nullptr || cp->phase != Phase::kAccepted) continue;
      const auto rev = c_->revision(pr.group);
      require(rev.has_value() && *rev >= pr.synced_revision,
              "the master took the run back at revision " + (rev ? std::to_string(*rev) : "none") + " of group " +
                  std::to_string(pr.group) + ", but " + name(pr) + " had synced revision " +
                  std::to_string(pr.synced_revision) + " (a revision was lost)");
    }
  }

  // Checked after every event the coordinator handled.
  void after_coordinator() {
    if (auto broken = c_->check_invariants()) fail("coordinator invariant: " + *broken);
    for (const auto g : groups_) {
      const auto rev = c_->revision(g);
      auto& last = group_revision_[g];
      if (rev != last) {
        require(rev.has_value() && (!last || *rev == *last + 1),
                "group " + std::to_string(g) + " went from revision " + (last ? std::to_string(*last) : "none") +
                    " to " + (rev ? std::to_string(*rev) : "none") + " (the revision rule: one per sync)");
        // a master that took the run back continues from the highest revision reported,
        // which no master can have gone past
        auto& highest = highest_revision_[g];
        require(last || *rev <= std::max<std::uint64_t>(highest, 1),
                "group " + std::to_string(g) + " starts at revision " + std::to_string(*rev) + " under master " +
                    std::to_string(gen_) + ", above every revision decided before (" + std::to_string(highest) + ")");
        last = rev;
        highest = std::max(highest, *rev);
        last_progress_us_[g] = now_;
      }
    }
  }

  // ------------------------------------------------------------ reachability

  bool cut_from_master(std::size_t proc) const {
    for (const auto& part : partitions_) {
      if (part.active && part.isolate && part.procs.count(proc) != 0) return true;
    }
    return false;
  }
  bool p2p_cut(std::size_t a, std::size_t b) const {
    for (const auto& part : partitions_) {
      if (part.active && (part.procs.count(a) != 0) != (part.procs.count(b) != 0)) return true;
    }
    return false;
  }
  bool in_partition(std::size_t proc) const {
    for (const auto& part : partitions_) {
      if (part.active && part.procs.count(proc) != 0) return true;
    }
    return false;
  }
  Proc* proc_of(PeerId id) {
    auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : &procs_.at(it->second);
  }
  // The p2p path from a to b: kUp, kStalled (b or a stopped, or cut off: TCP waits), or
  // kBroken (b's process is gone: connections are refused or reset).
  enum class Path { kUp, kStalled, kBroken };
  Path path(const Proc& a, const Proc& b) const {
    if (b.stage == Stage::kDead || a.stage == Stage::kDead) return Path::kBroken;
    if (a.stopped || b.stopped || p2p_cut(a.index, b.index)) return Path::kStalled;
    return Path::kUp;
  }

  // ------------------------------------------------------------ peer processes

  void spawn_tick() {
    std::size_t live = 0;
    for (const auto& pr : procs_) live += pr.stage != Stage::kDead ? 1u : 0u;
    // no newcomers while the master is down or has not taken the run back yet (one that
    // came first would start a new run, and the old one's peers would be KICKED)
    const bool master_ready = master_up_ && !awaiting_recovery_;
    if (master_ready && live < peers_max_ && (live < 2 || (!spawns_paused_ && rng_.chance(60)))) spawn();
    // the run starts with a burst of peers; later ones join now and then
    const bool burst = now_ < 2 * kSec;
    schedule(now_ + (live < 2 || burst ? rng_.between(10, 300) * kMs : rng_.between(300, 3000) * kMs), SimEvent::kSpawn);
  }

  // Holders of a group's state: peers that synced it, or that present the initial
  // state while the group has none.
  bool holder(const Proc& pr) const {
    return pr.stage != Stage::kDead && !pr.id.is_nil() && (pr.synced || (pr.bootstrap && !known_revision(pr.group)));
  }
  // The group's revision: the serving master's, or while there is none or it has not
  // taken the run back yet, the last master's.
  std::optional<std::uint64_t> known_revision(std::uint32_t group) const {
    const auto& revisions = master_up_ && !awaiting_recovery_ ? group_revision_ : last_master_revision_;
    const auto it = revisions.find(group);
    return it == revisions.end() ? std::nullopt : it->second;
  }
  std::size_t holders(std::uint32_t group) const {
    std::size_t n = 0;
    for (const auto& pr : procs_) n += pr.group == group && holder(pr) ? 1u : 0u;
    return n;
  }

  void spawn() {
    // Joining a group whose holders are all gone would only wait (no shared state
    // available); prefer groups that can still make progress.
    std::vector<std::uint32_t> alive_groups;
    for (const auto g : groups_) {
      if (!known_revision(g) || holders(g) > 0) alive_groups.push_back(g);
    }
    const auto& choice = alive_groups.empty() ? groups_ : alive_groups;
    Proc pr;
    pr.index = procs_.size();
    pr.group = choice[rng_.below(choice.size())];
    pr.pool = static_cast<std::uint16_t>(1 + rng_.below(3));
    pr.host = "10.0." + std::to_string(pr.index / 200) + "." + std::to_string(1 + pr.index % 200);
    pr.started_us = now_;
    pr.bootstrap = !known_revision(pr.group).has_value();
    const auto& shape = shapes_.at(pr.group);
    pr.content.resize(shape.size());
    const std::uint64_t init = pr.bootstrap ? 500 : 2000 + rng_.below(1000) * 7;
    for (std::size_t i = 0; i < shape.size(); ++i) pr.content[i] = (init + i) % 100003;
    pr.revision = pr.bootstrap ? 1 : 0;
    Conn c;
    c.id = conns_.size() + 1;
    c.proc = pr.index;
    if (rng_.chance(50)) {
      c.delay_lo_us = rng_.between(5, 20) * kMs;
      c.delay_hi_us = c.delay_lo_us + rng_.between(1, 30) * kMs;
    }
    pr.conn = c.id;
    c.gen = gen_;
    if (failover_) pr.session.set_failover(failover_timeout_);
    conns_.push_back(c);
    procs_.push_back(pr);
    Proc& ref = procs_.back();
    ++stats_.n[kSpawned];
    note("spawn " + name(ref) + " group " + std::to_string(ref.group) + (ref.bootstrap ? " (bootstrap)" : ""));
    push(conns_.back(), /*up=*/true, Frame{Frame::kOpen, {}, 0});
    p::Hello hello;
    hello.group = ref.group;
    hello.pool_size = ref.pool;
    hello.p2p_port = static_cast<std::uint16_t>(20000 + ref.index % 10000);
    hello.shared_state_port = static_cast<std::uint16_t>(hello.p2p_port + 1);
    hello.benchmark_port = static_cast<std::uint16_t>(hello.p2p_port + 2);
    ref.hello = hello;
    wire_send(ref, hello);
    arm_heartbeat(ref, now_ + 250 * kMs);
  }

  void arm_heartbeat(Proc& pr, TimeUs at) {
    ++pr.heartbeat_gen;
    timer(pr, at - now_, TimerKind::kHeartbeat, pr.heartbeat_gen);
  }

  // What the peer's owner sends goes through its session (which notes what a report
  // needs, and sends nothing while the master is away), as Link::send does.
  void send(Proc& pr, const p::Message& m) {
    if (pr.stage == Stage::kDead) return;
    if (pr.session.state() == peer::Session::State::kCreated) return wire_send(pr, m);
    execute(pr, pr.session.send(m), /*take=*/false);
    // what the session answers itself (a refusal) the owner's wait takes
    if (pr.session.mailbox_size() > 0) timer(pr, 0, TimerKind::kDrain);
  }

  void wire_send(Proc& pr, const p::Message& m) {
    Conn& c = conns_.at(pr.conn - 1);
    if (pr.stage == Stage::kDead || !c.peer_open) return;
    if (trace_) note(name(pr) + " -> master: " + describe(m));
    push(c, /*up=*/true, Frame{Frame::kMessage, wire(m), 0});
  }

  // The peer's side closes its current master connection.
  void close_conn(Proc& pr) {
    Conn& c = conns_.at(pr.conn - 1);
    c.handshake = false;
    if (!c.peer_open) return;
    c.peer_open = false;
    push(c, /*up=*/true, Frame{Frame::kFin, {}, 0});
  }

  // The communicator ended (kicked, rejected, master lost): the process exits, as the
  // soak's worker does; its side of the connection closes after what it sent.
  void finish(Proc& pr, StatusCode status, const std::string& why) {
    note(name(pr) + " ends: " + status_name(status) + " (" + why + ")");
    if (status == LOCKSTEP_STATUS_KICKED) ++stats_.n[kKicked];
    if (status == LOCKSTEP_STATUS_REJECTED) ++stats_.n[kRejected];
    if (status == LOCKSTEP_STATUS_MASTER_CONNECTION_LOST) ++stats_.n[kMasterLost];
    if (pr.failover_since_us >= 0) {
      if (status == LOCKSTEP_STATUS_MASTER_CONNECTION_LOST) ++stats_.n[kFailoverTimeouts];
      if (status == LOCKSTEP_STATUS_KICKED) ++stats_.n[kFailoverKicked];
    }
    close_conn(pr);
    die(pr);
  }

  void die(Proc& pr) {
    pr.stage = Stage::kDead;
    pr.dead_us = now_;
    pr.stopped = false;
    pr.frozen_frames.clear();
    pr.frozen_timers.clear();
    // its running attempts are over here: ring neighbours see the connections close
    for (auto& [tag, t] : pr.tags) {
      if (t.attempt != 0 && t.st != TagState::St::kEnded) {
        auto it = ring_attempts_.find(t.key);
        if (it != ring_attempts_.end() && it->second.state[pr.id] < 2) it->second.state[pr.id] = 3;
      }
    }
  }

  void on_timer(Proc& pr, TimerKind kind, std::uint64_t arg, std::uint64_t arg2) {
    switch (kind) {
      case TimerKind::kHeartbeat: return arg == pr.heartbeat_gen ? heartbeat(pr) : void();
      case TimerKind::kFlow:
        if (arg != pr.flow_gen) return;
        if (pr.stage == Stage::kAlone) return pending_vote(pr);
        if (pr.stage == Stage::kCompute) return start_collectives(pr);
        // after a pause, the membership check before the retry: update topology is
        // run-wide, and a peer that only retried its sync would starve the newcomers
        // of every group (the next step's sync is the retry)
        if (pr.stage == Stage::kSyncWait) return pending_vote(pr);
        return;
      case TimerKind::kEstablishCheck: return establish_check(pr, arg);
      case TimerKind::kRingPoll: return ring_poll(pr, arg);
      case TimerKind::kCommitPoll: return commit_poll(pr, arg);
      case TimerKind::kFetchPoll: return fetch_poll(pr, arg);
      case TimerKind::kBandwidthDone: return bandwidth_done(pr, arg, arg2);
      case TimerKind::kReconnect: return arg == pr.reconnect_gen ? try_resume(pr) : void();
      case TimerKind::kHandshake: return handshake_timeout(pr, arg);
      case TimerKind::kDrain: return execute(pr, {});
    }
  }

  static peer::Session::Time at_us(TimeUs t) { return peer::Session::Time(std::chrono::microseconds(t)); }

  void heartbeat(Proc& pr) {
    if (pr.stage == Stage::kConnecting) {
      // the blocking connect waits for Welcome at most this long
      if (now_ - pr.started_us > 3 * kSec) {
        return finish(pr, LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED, "no Welcome from the master");
      }
      return arm_heartbeat(pr, now_ + 250 * kMs);
    }
    execute(pr, pr.session.on_timer(at_us(now_)));
  }

  // Carries out the session's commands as the peer's IO shell does (peer/link.cpp), then
  // (with `take`) hands what waits in its mailbox to the loop.
  void execute(Proc& pr, const peer::Commands& commands, bool take = true) {
    for (const auto& command : commands) {
      if (pr.stage == Stage::kDead) return;
      if (const auto* f = std::get_if<peer::cmd::SendFrame>(&command)) {
        require(f->frame.size() >= p::kFrameHeaderBytes, "the session sent a frame without a header");
        const auto header = p::decode_header(std::span<const std::uint8_t, p::kFrameHeaderBytes>(f->frame.data(),
                                                                                                  p::kFrameHeaderBytes));
        require(header.is_ok(), "the session sent a frame that does not decode");
        auto m = p::decode_payload(header.value().type,
                                   std::span<const std::uint8_t>(f->frame).subspan(p::kFrameHeaderBytes));
        require(m.is_ok(), "the session sent a frame that does not decode");
        wire_send(pr, m.value());
      } else if (const auto* route = std::get_if<peer::cmd::RouteToOp>(&command)) {
        on_message(pr, route->message);
      } else if (const auto* arm = std::get_if<peer::cmd::ArmTimer>(&command)) {
        const auto us = std::chrono::duration_cast<std::chrono::microseconds>(arm->at.time_since_epoch()).count();
        arm_heartbeat(pr, std::max<TimeUs>(now_, static_cast<TimeUs>(us)));
      } else if (const auto* close = std::get_if<peer::cmd::CloseMaster>(&command)) {
        const StatusCode code = close->status.code();
        const bool allowed = code == LOCKSTEP_STATUS_KICKED || code == LOCKSTEP_STATUS_MASTER_CONNECTION_LOST ||
                             (code == LOCKSTEP_STATUS_REJECTED && !pr.accepted);
        if (!allowed) fail(name(pr) + "'s link ended with " + close->status.to_string() + ", which a peer following "
                           "the documented loop never sees");
        return finish(pr, code, close->status.message());
      } else if (const auto* lost = std::get_if<peer::cmd::Reconnect>(&command)) {
        // failover: close the connection and look for a master to take the peer back
        note(name(pr) + " lost the master (" + lost->status.message() + "); looking for one to take it back");
        require(failover_ && pr.accepted, name(pr) + " reconnects without failover or before it was accepted");
        close_conn(pr);
        if (pr.failover_since_us < 0) pr.failover_since_us = now_;
        pr.reconnect_pause_us = 100 * kMs;
        timer(pr, 0, TimerKind::kReconnect, ++pr.reconnect_gen);
      }
      // AbortOp, CancelEstablishment: the process ends with the link here (finish);
      // LearnPairKeys: no secret in this run.
    }
    if (pr.session.state() == peer::Session::State::kConnected) pr.failover_since_us = -1;
    while (take && pr.stage != Stage::kDead) {
      auto waiting = pr.session.take([](const p::Message&) { return true; });
      if (!waiting) break;
      on_message(pr, *waiting);
    }
  }

  void deliver_to_peer(Proc& pr, const Frame& f) {
    Conn& c = conns_.at(pr.conn - 1);
    pr.msg_gen = c.gen;
    if (c.handshake) return resume_reply(pr, c, f);
    if (f.kind == Frame::kFin) {
      c.peer_open = false;
      if (pr.stage == Stage::kConnecting) {
        return finish(pr, LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "the master closed the connection");
      }
      return execute(pr, pr.session.lose(at_us(now_), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST,
                                                             "the master closed the connection")));
    }
    if (trace_) note(name(pr) + " <- master: " + describe(f.message));
    // The master never refuses what these peers ask (the session's own refusals after a
    // failover come from its mailbox, not the wire).
    if (std::holds_alternative<p::Refused>(f.message)) unexpected(pr, f.message);
    // The wire's own check: a committed attempt's outcome is a success, whoever reads it
    // (the session drops it unread at the peer that committed), unless the master that
    // decided it took the run back without every peer that committed.
    if (const auto* r = std::get_if<p::CollectiveResult>(&f.message); r != nullptr && r->attempt != 0) {
      check_committed(pr, lineage(c.gen, r->attempt, false), *r);
    }
    if (pr.stage == Stage::kConnecting) return on_message(pr, f.message);  // before Welcome: no session yet
    execute(pr, pr.session.on_message(at_us(now_), f.message));
  }

  void check_committed(const Proc& pr, std::uint64_t key, const p::CollectiveResult& r) {
    const auto it = committed_.find(key);
    if (it == committed_.end() || r.status == LOCKSTEP_OK) return;
    for (const std::size_t q : it->second) {
      require(!in_run(procs_.at(q)), "attempt " + std::to_string(r.attempt) + " was committed by " +
                                         name(procs_.at(q)) + " and then ended with " + describe(r) + " at " + name(pr));
    }
  }

  // ------------------------------------------------------------ failover (peer side)

  // One try of the reconnect loop (Link::reconnect_loop, try_resume): the master's one
  // address; a Hello with the resume fields; its reply within the handshake timeout.
  void try_resume(Proc& pr) {
    if (pr.session.state() != peer::Session::State::kReconnecting) return;
    ++stats_.n[kResumeTries];
    if (!master_up_) {
      // nothing listens: refused at once
      note(name(pr) + " failover: the master's address refuses the connection");
      return resume_later(pr, 0);
    }
    if (cut_from_master(pr.index)) {
      note(name(pr) + " failover: the connection to the master's address times out");
      return resume_later(pr, 2 * kSec);
    }
    Conn c;
    c.id = conns_.size() + 1;
    c.proc = pr.index;
    c.gen = gen_;
    c.handshake = true;
    const Conn& old = conns_.at(pr.conn - 1);
    c.delay_lo_us = old.delay_lo_us;
    c.delay_hi_us = old.delay_hi_us;
    conns_.push_back(c);
    pr.conn = c.id;
    push(conns_.back(), /*up=*/true, Frame{Frame::kOpen, {}, 0});
    const p::Hello hello = pr.session.resume_hello(pr.hello);
    note(name(pr) + " failover: asks master " + std::to_string(gen_) + " to take it back (term " +
         std::to_string(hello.term) + ")");
    wire_send(pr, hello);
    timer(pr, 2 * kSec, TimerKind::kHandshake, c.id);
  }

  // The try failed: the next after the pause, which doubles up to 1 s.
  void resume_later(Proc& pr, TimeUs spent) {
    timer(pr, spent + pr.reconnect_pause_us, TimerKind::kReconnect, ++pr.reconnect_gen);
    pr.reconnect_pause_us = std::min(2 * pr.reconnect_pause_us, 1 * kSec);
  }

  void handshake_timeout(Proc& pr, std::uint64_t conn) {
    if (pr.conn != conn || !conns_.at(conn - 1).handshake) return;
    note(name(pr) + " failover: no answer to its Hello");
    close_conn(pr);
    resume_later(pr, 0);
  }

  // The master's answer to a resume Hello.
  void resume_reply(Proc& pr, Conn& c, const Frame& f) {
    c.handshake = false;
    if (f.kind == Frame::kFin) {
      c.peer_open = false;
      note(name(pr) + " failover: the master closed the connection before answering");
      return resume_later(pr, 0);
    }
    if (trace_) note(name(pr) + " <- master: " + describe(f.message));
    if (const auto* bye = std::get_if<p::Goodbye>(&f.message)) {
      if (bye->status == LOCKSTEP_STATUS_KICKED) {
        return execute(pr, pr.session.fail(Status(bye->status, "master: " + bye->reason)));
      }
      require(bye->status == LOCKSTEP_STATUS_REJECTED, name(pr) + " failover: answered " + describe(f.message));
      close_conn(pr);
      return resume_later(pr, 0);
    }
    const auto* w = std::get_if<p::Welcome>(&f.message);
    if (w == nullptr) unexpected(pr, f.message);
    // the terms it granted, as the simulation saw them (not the session's own record)
    std::uint64_t granted = 0;
    for (const auto& [term, gen] : pr.terms) granted = std::max(granted, term);
    peer::Commands commands = pr.session.resume(at_us(now_), *w);
    if (pr.session.state() != peer::Session::State::kResuming) {
      // refused (a term not above the granted one), or the link ended (another identity)
      require(pr.session.state() == peer::Session::State::kEnded || w->term <= granted,
              name(pr) + " refused master " + std::to_string(c.gen) + "'s term " + std::to_string(w->term) +
                  ", above the term it granted (" + std::to_string(granted) + ")");
      if (pr.session.state() == peer::Session::State::kReconnecting) {
        ++stats_.n[kTermRefusals];
        note(name(pr) + " failover: refuses term " + std::to_string(w->term) + " (it granted " +
             std::to_string(granted) + ")");
        close_conn(pr);
        resume_later(pr, 0);
      }
      return execute(pr, commands);
    }
    // no peer obeys a lower term, nor two masters under one term
    require(w->term > granted, name(pr) + " obeys master " + std::to_string(c.gen) + " under term " +
                                   std::to_string(w->term) + ", not above the term it granted (" +
                                   std::to_string(granted) + ")");
    grant(pr, w->term, c.gen);
    note(name(pr) + " failover: taken back by master " + std::to_string(c.gen) + " under term " + std::to_string(w->term));
    execute(pr, commands);
  }

  // A peer obeys one master per term, and never a lower term than one it granted.
  void grant(Proc& pr, std::uint64_t term, std::uint32_t gen) {
    for (const auto& [t, g] : pr.terms) {
      require(t < term || (t == term && g == gen), name(pr) + " grants term " + std::to_string(term) + " to master " +
                                                       std::to_string(gen) + " after granting term " +
                                                       std::to_string(t) + " to master " + std::to_string(g));
    }
    pr.terms.emplace_back(term, gen);
  }

  [[noreturn]] void unexpected(const Proc& pr, const p::Message& m) {
    fail(name(pr) + " in stage " + to_string(pr.stage) + " received " + describe(m) +
         ", which a peer following the documented loop never receives");
  }

  void on_message(Proc& pr, const p::Message& m) {
    if (const auto* w = std::get_if<p::Welcome>(&m)) {
      if (pr.stage != Stage::kConnecting) unexpected(pr, m);
      pr.id = w->id;
      pr.stage = Stage::kJoining;
      pr.session.set_identity(w->id);
      pr.session.grant_term(w->term);  // as Communicator::connect does (Link::set_identity)
      pr.run = run_;
      grant(pr, w->term, pr.msg_gen);
      return execute(pr, pr.session.attach(at_us(now_), w->heartbeat_timeout_ms));
    }
    if (const auto* bye = std::get_if<p::Goodbye>(&m)) {
      const bool allowed = bye->status == LOCKSTEP_STATUS_KICKED ||
                           (bye->status == LOCKSTEP_STATUS_REJECTED && !pr.accepted);
      if (!allowed) unexpected(pr, m);
      return finish(pr, bye->status, bye->reason);
    }
    if (std::holds_alternative<p::HeartbeatAck>(m)) return;
    if (pr.stage == Stage::kEstablishing) {
      // the calling thread is busy connecting; what arrives waits in the mailbox and
      // is read after the report
      pr.mailbox.push_back(m);
      return;
    }
    if (const auto* r = std::get_if<p::Refused>(&m)) return on_refused(pr, *r, m);
    if (const auto* est = std::get_if<p::EstablishP2P>(&m)) return on_establish(pr, *est, m);
    if (const auto* r = std::get_if<p::TopologyResult>(&m)) {
      if (pr.stage == Stage::kReported && r->epoch == pr.est_epoch) return on_topology_result(pr, *r);
      if (pr.stage == Stage::kOptimizeVote && r->status == LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED) {
        ++stats_.n[kOptimizeFailed];
        return optimize_vote(pr);  // the only legal answer: optimize again
      }
      unexpected(pr, m);
    }
    if (const auto* test = std::get_if<p::BandwidthTest>(&m)) {
      if (pr.stage != Stage::kOptimizeVote) unexpected(pr, m);
      Proc* partner = proc_of(test->partner.id);
      require(partner != nullptr && partner != &pr, "bandwidth test with an unknown partner");
      ++stats_.n[kBandwidthTests];
      timer(pr, static_cast<TimeUs>(test->duration_ms) * kMs + rng_.between(0, 5 * kMs), TimerKind::kBandwidthDone,
            test->test, partner->index);
      return;
    }
    if (const auto* r = std::get_if<p::PeersPendingResult>(&m)) {
      if (pr.stage != Stage::kPending || r->status != LOCKSTEP_OK) unexpected(pr, m);
      count_control(pr, m);
      ++pr.pending_rounds;
      ++(r->pending ? stats_.n[kPendingYes] : stats_.n[kPendingNo]);
      if (r->pending) return update_vote(pr);
      if (optimize_every_ != 0 && pr.pending_rounds % optimize_every_ == 0) return optimize_vote(pr);
      return begin_step(pr);
    }
    if (const auto* r = std::get_if<p::AgreeResult>(&m)) {
      if (pr.stage != Stage::kAgree) unexpected(pr, m);
      count_control(pr, m);
      if (r->status == LOCKSTEP_OK) {
        require(r->value == pr.agree_flag, name(pr) + ": agree of identical flags gave " + describe(m));
        ++stats_.n[kAgreeOk];
      } else if (r->status == LOCKSTEP_STATUS_PEER_CONNECTION_LOST) {
        ++stats_.n[kAgreeLost];
      } else {
        unexpected(pr, m);
      }
      return pending_vote(pr);
    }
    if (const auto* go = std::get_if<p::CollectiveGo>(&m)) return on_go(pr, *go, m);
    if (const auto* r = std::get_if<p::CollectiveResult>(&m)) return on_collective_result(pr, *r, m);
    if (const auto* a = std::get_if<p::CollectiveAbort>(&m)) return on_collective_abort(pr, *a, m);
    if (const auto* plan = std::get_if<p::SyncPlan>(&m)) return on_sync_plan(pr, *plan, m);
    if (const auto* r = std::get_if<p::SyncResult>(&m)) return on_sync_result(pr, *r, m);
    unexpected(pr, m);
  }

  // The session's own refusal (never the master's: deliver_to_peer): a round the lost
  // master had started ends with the operation's retryable failure, which the loop
  // retries (docs/architecture.md, "Failover").
  void on_refused(Proc& pr, const p::Refused& r, const p::Message& m) {
    ++stats_.n[kSessionRefusals];
    using T = p::MsgType;
    const bool topology = r.request == T::kVoteUpdateTopology || r.request == T::kP2PReport;
    const bool optimize = r.request == T::kVoteOptimizeTopology || r.request == T::kBandwidthReport ||
                          (r.request == T::kP2PReport && pr.optimizing);
    if (optimize && (pr.stage == Stage::kOptimizeVote || (pr.stage == Stage::kReported && pr.optimizing))) {
      if (r.status != LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED) unexpected(pr, m);
      ++stats_.n[kOptimizeFailed];
      return optimize_vote(pr);
    }
    if (topology && pr.accepted && (pr.stage == Stage::kUpdateVote || pr.stage == Stage::kReported)) {
      if (r.status != LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) unexpected(pr, m);
      ++stats_.n[kTopologyFailed];
      return update_vote(pr);
    }
    const bool sync = (r.request == T::kSyncVote && pr.stage == Stage::kSyncVote) ||
                      (r.request == T::kSyncDone && pr.stage == Stage::kSyncTransfer);
    if (sync && r.status == LOCKSTEP_STATUS_PEER_CONNECTION_LOST) {
      ++stats_.n[kSyncsFailed];
      return sync_vote(pr);
    }
    unexpected(pr, m);
  }

  // ------------------------------------------------------------ one outcome for all

  // Whether the peer is still in the serving master's run.
  bool in_run(const Proc& q) const {
    return q.stage != Stage::kDead && master_up_ && !q.id.is_nil() && c_->find_peer(q.id) != nullptr &&
           conns_.at(q.conn - 1).gen == gen_;
  }

  // Every peer that learns the outcome of an attempt or round learns the same one. Only
  // a peer that is no longer in the run may have learned another: a master that took
  // the run back without it decided from the others' reports (docs/architecture.md,
  // "Failover"). A peer never learns two.
  template <typename T>
  void one_outcome(std::vector<std::pair<std::size_t, T>>& seen, const Proc& pr, const T& outcome, const std::string& what) {
    for (const auto& [q, other] : seen) {
      if (other == outcome) continue;
      require(q != pr.index, what + " has two outcomes at " + name(pr) + ": " + show(other) + " and " + show(outcome));
      require(!in_run(procs_.at(q)), what + " has two outcomes: " + show(other) + " at " + name(procs_.at(q)) + " and " +
                                         show(outcome) + " at " + name(pr));
    }
    seen.emplace_back(pr.index, outcome);
  }
  static std::string show(const p::CollectiveResult& r) { return describe(r); }
  static std::string show(const p::SyncResult& r) { return describe(r); }
  static std::string show(const std::vector<std::uint8_t>& frame) {
    const auto header = p::decode_header(std::span<const std::uint8_t, p::kFrameHeaderBytes>(frame.data(), p::kFrameHeaderBytes));
    auto m = p::decode_payload(header.value().type, std::span<const std::uint8_t>(frame).subspan(p::kFrameHeaderBytes));
    return m.is_ok() ? describe(m.value()) : "?";
  }

  // The k-th control outcome (are-peers-pending, agree, sync) since a view began is the
  // same round at every peer of the group in that view.
  void count_control(Proc& pr, const p::Message& m) {
    const auto key = std::make_tuple(pr.run, pr.group, pr.epoch, pr.control_rounds++);
    one_outcome(control_outcomes_[key], pr, p::encode_frame(m),
                "control round " + std::to_string(std::get<3>(key)) + " of group " + std::to_string(pr.group) +
                    " in epoch " + std::to_string(pr.epoch));
  }

  // The key of an attempt in the simulation's records. A later master may use the
  // number of an attempt that none of the peers it took back had heard of (it continues
  // from the highest they report): a new attempt (a Go, a plan) belongs to the master
  // that sent it, an outcome to the newest master up to the one it came from that
  // issued that number.
  std::uint64_t lineage(std::uint32_t gen, std::uint64_t attempt, bool issued) {
    auto& gens = issuers_[attempt];
    if (issued || gens.empty()) gens.insert(gen);
    auto it = gens.upper_bound(gen);
    const std::uint32_t origin = it == gens.begin() ? gen : *std::prev(it);
    return (static_cast<std::uint64_t>(origin) << 40) | attempt;
  }

  // ------------------------------------------------------------ membership

  void on_establish(Proc& pr, const p::EstablishP2P& est, const p::Message& m) {
    const bool newcomer = pr.stage == Stage::kJoining;
    if (!newcomer && pr.stage != Stage::kUpdateVote && pr.stage != Stage::kOptimizeVote) unexpected(pr, m);
    const bool self = std::any_of(est.ring.begin(), est.ring.end(), [&](const auto& mi) { return mi.id == pr.id; });
    require(self, name(pr) + " got a ring without itself: " + describe(m));
    pr.optimizing = pr.stage == Stage::kOptimizeVote;
    pr.stage = Stage::kEstablishing;
    pr.est_epoch = est.epoch;
    pr.est_ring = est.ring;
    pr.est_started_us = now_;
    timer(pr, rng_.between(200, 5 * kMs), TimerKind::kEstablishCheck, est.epoch);
  }

  // The peer connects to its next ring neighbour and waits for its previous one (who
  // connects once it has its own EstablishP2P), bounded by the p2p connect timeout.
  void establish_check(Proc& pr, std::uint64_t epoch) {
    if (pr.stage != Stage::kEstablishing || pr.est_epoch != epoch) return;
    const auto& ring = pr.est_ring;
    std::vector<PeerId> unreachable;
    bool waiting = false;
    const auto self = std::find_if(ring.begin(), ring.end(), [&](const auto& mi) { return mi.id == pr.id; });
    const std::size_t n = ring.size();
    if (n >= 2) {
      const std::size_t i = static_cast<std::size_t>(self - ring.begin());
      const PeerId next = ring[(i + 1) % n].id;
      const PeerId prev = ring[(i + n - 1) % n].id;
      Proc* pn = proc_of(next);
      Proc* pp = proc_of(prev);
      require(pn != nullptr && pp != nullptr, "ring names an unknown peer");
      const Path tx = path(pr, *pn);
      if (tx == Path::kBroken) unreachable.push_back(next);
      waiting = waiting || tx == Path::kStalled;
      const Path rx = path(*pp, pr);
      const bool connected = rx == Path::kUp && pp->est_epoch >= epoch;
      if (!connected && (prev != next || unreachable.empty())) {
        if (rx == Path::kBroken) {
          unreachable.push_back(prev);
        } else {
          waiting = true;
        }
      }
      if (waiting && now_ < pr.est_started_us + p2p_connect_timeout_us_) {
        return timer(pr, std::min<TimeUs>(20 * kMs, pr.est_started_us + p2p_connect_timeout_us_ - now_),
                     TimerKind::kEstablishCheck, epoch);
      }
      if (waiting) {
        // the timeout: whatever is not up now could not be reached
        unreachable.clear();
        if (tx != Path::kUp) unreachable.push_back(next);
        if (!connected && (prev != next || unreachable.empty())) unreachable.push_back(prev);
      }
    }
    pr.stage = Stage::kReported;
    send(pr, p::P2PReport{epoch, unreachable});
    while (!pr.mailbox.empty() && pr.stage != Stage::kEstablishing && pr.stage != Stage::kDead) {
      const p::Message m = std::move(pr.mailbox.front());
      pr.mailbox.pop_front();
      on_message(pr, m);
    }
  }

  void on_topology_result(Proc& pr, const p::TopologyResult& r) {
    if (r.status == LOCKSTEP_OK) {
      const bool self = std::any_of(r.ring.begin(), r.ring.end(), [&](const auto& mi) { return mi.id == pr.id; });
      require(self, name(pr) + "'s membership view lacks itself");
      require(r.ring == pr.est_ring, name(pr) + ": the membership view [" + ids(r.ring) +
                                         "] differs from the ring it established [" + ids(pr.est_ring) + "]");
      require(r.attributes.group_world_size == r.ring.size(), "group world size differs from the view");
      // the same view and attributes on every peer of the group at this epoch
      auto [it, fresh] = views_.try_emplace({pr.run, r.epoch, pr.group}, r);
      require(fresh || (it->second.ring == r.ring && it->second.attributes == r.attributes),
              "epoch " + std::to_string(r.epoch) + " group " + std::to_string(pr.group) + ": views differ: [" +
                  ids(it->second.ring) + "] and [" + ids(r.ring) + "] (" + name(pr) + ")");
      if (!pr.accepted) ++stats_.n[kJoined];
      ++(pr.optimizing ? stats_.n[kOptimizeOk] : stats_.n[kTopologyOk]);
      pr.accepted = true;
      pr.view = r.ring;
      pr.world = r.attributes.group_world_size;
      pr.epoch = r.epoch;
      pr.pending_rounds = 0;
      pr.control_rounds = 0;
      pr.optimizing = false;
      return begin_step(pr);
    }
    const StatusCode expected =
        pr.optimizing ? LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED : LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED;
    if (r.status != expected) unexpected(pr, r);
    if (!pr.accepted) {
      pr.stage = Stage::kJoining;  // the master retries the admission with the next vote
      return;
    }
    ++(pr.optimizing ? stats_.n[kOptimizeFailed] : stats_.n[kTopologyFailed]);
    if (pr.optimizing) return optimize_vote(pr);
    return update_vote(pr);
  }

  void update_vote(Proc& pr) {
    pr.stage = Stage::kUpdateVote;
    send(pr, p::VoteUpdateTopology{});
  }
  void optimize_vote(Proc& pr) {
    pr.stage = Stage::kOptimizeVote;
    send(pr, p::VoteOptimizeTopology{});
  }
  void pending_vote(Proc& pr) {
    pr.stage = Stage::kPending;
    send(pr, p::VotePeersPending{});
  }

  void bandwidth_done(Proc& pr, std::uint64_t test, std::uint64_t partner_index) {
    if (pr.stage != Stage::kOptimizeVote) return;  // the phase failed meanwhile
    const Proc& partner = procs_.at(partner_index);
    const std::uint64_t rate = path(partner, pr) == Path::kUp ? bandwidth(partner.index, pr.index) : 0;
    send(pr, p::BandwidthReport{test, partner.id, rate});
  }

  // A seeded asymmetric matrix of link rates, bytes/s.
  std::uint64_t bandwidth(std::size_t from, std::size_t to) const {
    return 10'000'000 + mix(seed_ ^ (from * 1'000'003 + to)) % 990'000'000;
  }

  // ------------------------------------------------------------ the step

  void flow_pause(Proc& pr, Stage stage, TimeUs delay) {
    pr.stage = stage;
    timer(pr, delay, TimerKind::kFlow, ++pr.flow_gen);
  }

  void begin_step(Proc& pr) {
    if (pr.world >= 2) return sync_vote(pr);
    flow_pause(pr, Stage::kAlone, 20 * kMs);  // alone: wait for peers
  }

  void sync_vote(Proc& pr) {
    const auto& shape = shapes_.at(pr.group);
    p::SyncVote vote;
    vote.strategy = pr.synced || pr.bootstrap ? p::SyncStrategy::kEnforcePopular : p::SyncStrategy::kReceiveOnly;
    vote.revision = pr.revision;
    vote.tensors = shape;
    for (std::size_t i = 0; i < shape.size(); ++i) vote.tensors[i].hash = digest_of(shape[i].key, pr.content[i]);
    pr.vote = vote;
    pr.done_sent = false;
    pr.done_ok = false;
    pr.stage = Stage::kSyncVote;
    send(pr, vote);
  }

  void on_sync_plan(Proc& pr, const p::SyncPlan& plan, const p::Message& m) {
    if (pr.stage != Stage::kSyncVote) unexpected(pr, m);
    if (pr.synced && pr.vote.strategy == p::SyncStrategy::kEnforcePopular) {
      require(plan.revision == pr.vote.revision, name(pr) + " is in step at revision " +
                                                     std::to_string(pr.vote.revision) + " but revision " +
                                                     std::to_string(plan.revision) + " was elected");
    }
    check_major_op(pr, Major::kSync);
    const auto& shape = shapes_.at(pr.group);
    std::map<std::uint32_t, std::uint64_t> bytes;
    std::map<std::uint32_t, std::set<std::uint32_t>> sources;
    for (const auto& f : plan.fetches) {
      require(f.tensor < shape.size() && f.source < plan.sources.size(), "plan fetch out of range");
      bytes[f.tensor] += f.bytes;
      sources[f.tensor].insert(f.source);
    }
    for (const auto& e : plan.expect) {
      require(e.tensor < shape.size(), "plan expects an unknown tensor");
      const std::uint64_t size = shape[e.tensor].count * dtype_bytes(shape[e.tensor].dtype);
      require(bytes[e.tensor] == size, name(pr) + ": the plan's pieces of tensor " + std::to_string(e.tensor) +
                                           " cover " + std::to_string(bytes[e.tensor]) + " of " +
                                           std::to_string(size) + " bytes");
      if (sources[e.tensor].size() > 1) ++stats_.n[kSplitFetches];
    }
    pr.plan = plan;
    pr.plan_key = lineage(pr.msg_gen, plan.attempt, /*issued=*/true);
    pr.plan_us = now_;
    pr.stage = Stage::kSyncTransfer;
    if (plan.fetches.empty()) {
      pr.done_sent = pr.done_ok = true;
      return send(pr, p::SyncDone{plan.attempt, LOCKSTEP_OK, {}});
    }
    std::uint64_t total = 0;
    for (const auto& [t, b] : bytes) total += b;
    timer(pr, rng_.between(200, 3 * kMs) + static_cast<TimeUs>(total / 1000), TimerKind::kFetchPoll, plan.attempt);
  }

  // The transfers of a plan: a source whose process is gone, or that no longer serves
  // this attempt, fails them; a stopped or cut-off source stalls them.
  void fetch_poll(Proc& pr, std::uint64_t attempt) {
    if (pr.stage != Stage::kSyncTransfer || pr.plan.attempt != attempt || pr.done_sent) return;
    bool stalled = false;
    for (const auto& f : pr.plan.fetches) {
      const p::MemberInfo& src = pr.plan.sources.at(f.source);
      Proc* s = proc_of(src.id);
      require(s != nullptr, "plan names an unknown source");
      const Path route = path(*s, pr);
      // a source still waiting for its plan keeps the connection for the attempt
      // (stall), up to the p2p connect timeout (its plan may never come: the master that
      // sent it crashed); one that moved past the attempt refuses it
      const bool serving = s->stage == Stage::kSyncTransfer && s->plan_key == pr.plan_key;
      const bool not_yet = s->stage == Stage::kSyncVote && now_ - pr.plan_us < p2p_connect_timeout_us_;
      if (route == Path::kBroken || (route == Path::kUp && !serving && !not_yet)) {
        pr.done_sent = true;
        return send(pr, p::SyncDone{attempt, LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, "source " + src.id.to_string() +
                                                                                        " is unreachable"});
      }
      if (route == Path::kStalled || not_yet) {
        stalled = true;
        continue;
      }
      // the source serves a piece only of the content the plan names
      const auto expect = std::find_if(pr.plan.expect.begin(), pr.plan.expect.end(),
                                       [&](const auto& e) { return e.tensor == f.tensor; });
      require(expect != pr.plan.expect.end(), "a fetch of a tensor the plan does not expect");
      const auto& key = shapes_.at(pr.group)[f.tensor].key;
      require(digest_of(key, s->content[f.tensor]) == expect->hash,
              name(pr) + ": plan source " + name(*s) + " does not hold the elected content of '" + key + "'");
    }
    if (stalled) return timer(pr, 10 * kMs, TimerKind::kFetchPoll, attempt);
    pr.done_sent = pr.done_ok = true;
    send(pr, p::SyncDone{attempt, LOCKSTEP_OK, {}});
  }

  void on_sync_result(Proc& pr, const p::SyncResult& r, const p::Message& m) {
    // (a failover: the outcome of an attempt whose plan this peer never received, which
    // another peer kept, is forwarded; it can only be a failure)
    const bool voting = pr.stage == Stage::kSyncVote && (r.attempt == 0 || failover_);
    const bool transfer = pr.stage == Stage::kSyncTransfer && r.attempt == pr.plan.attempt;
    if ((!voting && !transfer) || (voting && r.status == LOCKSTEP_OK)) unexpected(pr, m);
    count_control(pr, m);
    std::uint64_t key = 0;
    if (r.attempt != 0) {
      key = transfer ? pr.plan_key : lineage(pr.msg_gen, r.attempt, /*issued=*/false);
      one_outcome(sync_outcomes_[key], pr, r, "sync attempt " + std::to_string(r.attempt));
    }
    if (r.status == LOCKSTEP_OK) {
      require(r.revision == pr.plan.revision, "sync result revision differs from the plan's");
      require(pr.done_ok, name(pr) + ": sync attempt " + std::to_string(r.attempt) +
                              " succeeded before its transfers were verified");
      const auto& shape = shapes_.at(pr.group);
      for (const auto& e : pr.plan.expect) pr.content[e.tensor] = e.hash.lo;
      // parity: every participant holds the elected content (tensors that allow
      // inequality excepted, unless they were received)
      std::vector<std::uint64_t> strict;
      for (std::size_t i = 0; i < shape.size(); ++i) {
        strict.push_back(shape[i].allow_content_inequality ? 0 : pr.content[i]);
      }
      auto [it, fresh] = elected_.try_emplace(key, std::make_pair(r.revision, strict));
      require(fresh || it->second == std::make_pair(r.revision, strict),
              name(pr) + " holds other content than the other participants of sync attempt " +
                  std::to_string(r.attempt) + " after it succeeded");
      // a peer's revision never goes back
      require(!pr.synced || r.revision > pr.synced_revision,
              name(pr) + " synced revision " + std::to_string(r.revision) + " after revision " +
                  std::to_string(pr.synced_revision));
      pr.revision = r.revision;
      pr.synced_revision = r.revision;
      pr.synced = true;
      ++stats_.n[kSyncsOk];
      return flow_pause(pr, Stage::kCompute, rng_.between(0, 30 * kMs));
    }
    ++stats_.n[kSyncsFailed];
    if (r.status == LOCKSTEP_STATUS_PEER_CONNECTION_LOST) return sync_vote(pr);
    if (r.status == LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE && voting) {
      ++stats_.n[kNoState];
      return flow_pause(pr, Stage::kSyncWait, 200 * kMs);
    }
    unexpected(pr, m);
  }

  // Training: the next revision's content follows from this one's and the collectives'
  // results (identical everywhere); a tensor that allows inequality also depends on
  // the peer (local statistics).
  void advance_state(Proc& pr) {
    const auto& shape = shapes_.at(pr.group);
    for (std::size_t i = 0; i < shape.size(); ++i) {
      std::uint64_t v = mix(pr.content[i] * 31 + pr.revision * 7 + i) % 1'000'003;
      if (shape[i].allow_content_inequality) v = mix(v ^ (pr.index + 1)) % 1'000'003;
      pr.content[i] = v;
    }
    pr.revision += 1;
  }

  // ------------------------------------------------------------ collectives

  void start_collectives(Proc& pr) {
    pr.stage = Stage::kCollectives;
    pr.tags.clear();
    for (std::uint32_t k = 0; k < reduces_; ++k) {
      const std::uint64_t tag = k;  // the same tags every step, as a training loop calls them
      pr.tags[tag] = TagState{};
      execute(pr, pr.session.register_op(tag));
      send(pr, p::CollectiveInit{tag, kDescriptor});
    }
  }

  void on_go(Proc& pr, const p::CollectiveGo& go, const p::Message& m) {
    auto it = pr.tags.find(go.tag);
    if (pr.stage != Stage::kCollectives || it == pr.tags.end() || it->second.st != TagState::St::kVoting) {
      unexpected(pr, m);
    }
    // The attempt's ring, as a peer reads it: its view less the peers named absent.
    require(go.epoch == pr.epoch, name(pr) + ": attempt " + std::to_string(go.attempt) + " names the view of epoch " +
                                      std::to_string(go.epoch) + ", not its own (" + std::to_string(pr.epoch) + ")");
    for (const auto& id : go.absent) {
      const bool known = std::any_of(pr.view.begin(), pr.view.end(), [&](const auto& mi) { return mi.id == id; });
      require(known, name(pr) + ": attempt " + std::to_string(go.attempt) + " names " + id.to_string() +
                         " absent, who is not in its membership view");
    }
    std::vector<PeerId> ring;
    for (const auto& mi : pr.view) {
      if (std::find(go.absent.begin(), go.absent.end(), mi.id) == go.absent.end()) ring.push_back(mi.id);
    }
    require(std::find(ring.begin(), ring.end(), pr.id) != ring.end(), name(pr) + ": Go without itself");
    const std::uint64_t key = lineage(pr.msg_gen, go.attempt, /*issued=*/true);
    auto [ra, fresh] = ring_attempts_.try_emplace(key, RingAttempt{ring, {}});
    require(ra->second.ring == ring, "attempt " + std::to_string(go.attempt) + " has two rings");
    TagState& t = it->second;
    t.st = TagState::St::kQueued;
    t.attempt = go.attempt;
    t.key = key;
    t.slot = go.slot;
    t.ring = ring;
    next_on_slot(pr, go.slot);
  }

  // Each pool slot carries one attempt at a time, in the order of the Go messages (the
  // session's turns).
  void next_on_slot(Proc& pr, std::uint32_t slot) {
    for (auto& [tag, t] : pr.tags) {
      if (t.st != TagState::St::kQueued || t.slot != slot ||
          pr.session.slot_turn(slot, t.attempt) != peer::Session::Turn::kMine) {
        continue;
      }
      check_major_op(pr, Major::kCollective);
      t.st = TagState::St::kRunning;
      ring_attempts_.at(t.key).state[pr.id] = 1;
      timer(pr, rng_.between(300, 10 * kMs), TimerKind::kRingPoll, t.attempt);
      return;
    }
  }

  TagState* tag_of_attempt(Proc& pr, std::uint64_t attempt) {
    for (auto& [tag, t] : pr.tags) {
      if (t.attempt == attempt) return &t;
    }
    return nullptr;
  }

  // The ring moves data only when every participant runs the attempt and every hop
  // is up; a neighbour whose process is gone or who aborted resets the connection.
  void ring_poll(Proc& pr, std::uint64_t attempt) {
    TagState* t = tag_of_attempt(pr, attempt);
    if (t == nullptr || t->st != TagState::St::kRunning) return;
    RingAttempt& ra = ring_attempts_.at(t->key);
    const auto& ring = ra.ring;
    const std::size_t n = ring.size();
    const std::size_t i = static_cast<std::size_t>(std::find(ring.begin(), ring.end(), pr.id) - ring.begin());
    bool ready = true;
    for (std::size_t k = 0; k < n && n > 1; ++k) {
      Proc* q = proc_of(ring[k]);
      const int st = ra.state[ring[k]];
      const bool neighbour = k == (i + 1) % n || k == (i + n - 1) % n;
      if (neighbour && (st == 3 || (q->stage == Stage::kDead && st < 2))) {
        t->st = TagState::St::kLocalDone;
        ra.state[pr.id] = 3;
        return send(pr, p::CollectiveDone{tag_key(pr, attempt), attempt, false,
                                          "ring neighbour " + ring[k].to_string() + " hung up"});
      }
      if (st == 0 || st == 3 || (st == 1 && (q->stopped || q->stage == Stage::kDead ||
                                             p2p_cut(q->index, proc_of(ring[(k + 1) % n])->index)))) {
        ready = false;
      }
    }
    if (!ready) return timer(pr, 10 * kMs, TimerKind::kRingPoll, attempt);
    t->st = TagState::St::kLocalDone;
    ra.state[pr.id] = 2;
    send(pr, p::CollectiveDone{tag_key(pr, attempt), attempt, true, {}});
    timer(pr, rng_.between(300, 5 * kMs), TimerKind::kCommitPoll, attempt);
  }

  // The commit exchange (docs/protocol.md, "Completion"): its tokens go round once every
  // participant holds the result and every participant and hop is up. A peer whose
  // tokens all came before the master's outcome commits: it says so and returns at
  // once; the outcome, when it comes, must be a success.
  void commit_poll(Proc& pr, std::uint64_t attempt) {
    TagState* t = tag_of_attempt(pr, attempt);
    if (t == nullptr || t->st != TagState::St::kLocalDone) return;
    RingAttempt& ra = ring_attempts_.at(t->key);
    if (ra.state[pr.id] != 2) return;
    const auto& ring = ra.ring;
    const std::size_t n = ring.size();
    bool round = true;
    for (std::size_t k = 0; k < n && round; ++k) {
      const Proc* q = proc_of(ring[k]);
      round = ra.state[ring[k]] == 2 && !q->stopped && q->stage != Stage::kDead &&
              (n == 1 || !p2p_cut(q->index, proc_of(ring[(k + 1) % n])->index));
    }
    if (!round || !rng_.chance(50)) return timer(pr, rng_.between(1 * kMs, 10 * kMs), TimerKind::kCommitPoll, attempt);
    const std::uint64_t tag = tag_key(pr, attempt);
    // while the master is away the attempt waits for the outcome instead, which the
    // master that takes the run back decides (Communicator's collective, Session)
    if (!pr.session.settled_early(tag, attempt, static_cast<std::uint32_t>(n))) return;
    send(pr, p::CollectiveDone{tag, attempt, true, {}, 0, 0, true});
    committed_[t->key].push_back(pr.index);
    ++stats_.n[kCommits];
    end_tag(pr, *t, attempt, LOCKSTEP_OK);
  }

  std::uint64_t tag_key(Proc& pr, std::uint64_t attempt) {
    for (auto& [tag, t] : pr.tags) {
      if (t.attempt == attempt) return tag;
    }
    fail("no tag for attempt " + std::to_string(attempt));
  }

  // The master lost a participant: an attempt that has not reported here stops (its ring
  // closes) and reports; one already reported waits for the outcome.
  void on_collective_abort(Proc& pr, const p::CollectiveAbort& a, const p::Message& m) {
    auto it = pr.tags.find(a.tag);
    if (pr.stage != Stage::kCollectives || it == pr.tags.end() || it->second.attempt != a.attempt) unexpected(pr, m);
    TagState& t = it->second;
    if (t.st != TagState::St::kQueued && t.st != TagState::St::kRunning) return;
    t.st = TagState::St::kLocalDone;
    ring_attempts_.at(t.key).state[pr.id] = 3;
    ++stats_.n[kCollectiveAborts];
    send(pr, p::CollectiveDone{a.tag, a.attempt, false, "the attempt was aborted"});
  }

  void on_collective_result(Proc& pr, const p::CollectiveResult& r, const p::Message& m) {
    auto it = pr.tags.find(r.tag);
    if (pr.stage != Stage::kCollectives || it == pr.tags.end() || it->second.st == TagState::St::kEnded) {
      unexpected(pr, m);
    }
    if (r.status == LOCKSTEP_STATUS_TOO_FEW_PEERS) {
      // Ended before an attempt: the vote found this peer alone in its group. The
      // documented loop goes on alone (no retry).
      require(r.attempt == 0 && it->second.st == TagState::St::kVoting,
              name(pr) + ": TOO_FEW_PEERS for tag " + std::to_string(r.tag) + " after its attempt started");
      const auto* self = c_->find_peer(pr.id);
      require(self == nullptr || c_->ring(self->group).size() <= 1,
              name(pr) + ": TOO_FEW_PEERS while its group has " +
                  std::to_string(self == nullptr ? 0 : c_->ring(self->group).size()) + " members");
      it->second.st = TagState::St::kEnded;
      it->second.outcome = r.status;
      pr.session.unregister_op(r.tag);
      return end_of_collectives(pr);
    }
    TagState& t = it->second;
    if (r.attempt != 0 && t.st == TagState::St::kVoting && failover_) {
      // A failover: the attempt of the round this peer voted in started at other
      // participants only (the lost master's Go to this one was lost); the master that
      // took the run back ends it here as there, with the failure.
      require(r.status != LOCKSTEP_OK, name(pr) + ": attempt " + std::to_string(r.attempt) + " of tag " +
                                           std::to_string(r.tag) + " succeeded where this peer never ran it");
      const std::uint64_t key = lineage(pr.msg_gen, r.attempt, /*issued=*/false);
      check_committed(pr, key, r);
      one_outcome(collective_outcomes_[key], pr, r, "attempt " + std::to_string(r.attempt));
      t.attempt = r.attempt;
      t.key = key;
      t.st = TagState::St::kEnded;
      t.outcome = r.status;
      ++stats_.n[kCollectivesFailed];
      pr.session.unregister_op(r.tag);
      return end_of_collectives(pr);
    }
    if (r.attempt == 0 || r.attempt != t.attempt) unexpected(pr, m);
    check_committed(pr, t.key, r);
    one_outcome(collective_outcomes_[t.key], pr, r, "attempt " + std::to_string(r.attempt));
    if (r.status == LOCKSTEP_OK) {
      require(t.st == TagState::St::kLocalDone && ring_attempts_.at(t.key).state[pr.id] == 2,
              name(pr) + ": attempt " + std::to_string(r.attempt) + " succeeded before it finished its part");
      require(r.world_size == t.ring.size(), "collective world size differs from its ring");
    } else if (r.status != LOCKSTEP_STATUS_PEER_CONNECTION_LOST) {
      unexpected(pr, m);
    }
    auto& ra = ring_attempts_.at(t.key);
    if (ra.state[pr.id] < 2) ra.state[pr.id] = 3;  // an abort: its connections close
    end_tag(pr, t, r.attempt, r.status);
  }

  void end_tag(Proc& pr, TagState& t, std::uint64_t attempt, StatusCode status) {
    t.st = TagState::St::kEnded;
    t.outcome = status;
    ++(status == LOCKSTEP_OK ? stats_.n[kCollectivesOk] : stats_.n[kCollectivesFailed]);
    pr.session.unregister_op(tag_key(pr, attempt));
    pr.session.release_slot(t.slot, attempt);
    next_on_slot(pr, t.slot);
    end_of_collectives(pr);
  }

  void end_of_collectives(Proc& pr) {
    bool alone = false;
    for (const auto& [tag, s] : pr.tags) {
      if (s.st != TagState::St::kEnded) return;
      alone = alone || s.outcome == LOCKSTEP_STATUS_TOO_FEW_PEERS;
    }
    // every tag ended: retry the failed ones with the survivors (unless alone), or advance
    bool retried = false;
    for (auto& [tag, s] : pr.tags) {
      if (s.outcome == LOCKSTEP_OK || alone) continue;
      s = TagState{};
      retried = true;
      execute(pr, pr.session.register_op(tag));
      send(pr, p::CollectiveInit{tag, kDescriptor});
    }
    if (retried) return;
    advance_state(pr);
    pr.agree_flag = pr.revision % 3 != 0;
    pr.stage = Stage::kAgree;
    send(pr, p::VoteAgree{pr.agree_flag});
  }

  // One major operation per group, as the peers see it: while this peer starts one,
  // no member of its group (that the coordinator still counts) is in another.
  enum class Major { kCollective, kSync };
  void check_major_op(const Proc& pr, Major what) {
    if (c_->find_peer(pr.id) == nullptr) return;  // removed: it acts on news the others moved past
    for (const auto& q : procs_) {
      if (q.index == pr.index || q.group != pr.group || q.stage == Stage::kDead || q.id.is_nil() ||
          c_->find_peer(q.id) == nullptr) {
        continue;
      }
      const bool in_topology = q.stage == Stage::kEstablishing || q.stage == Stage::kReported;
      const bool in_sync = q.stage == Stage::kSyncTransfer;
      bool in_collective = false;
      for (const auto& [tag, t] : q.tags) {
        in_collective = in_collective || t.st == TagState::St::kQueued || t.st == TagState::St::kRunning ||
                        t.st == TagState::St::kLocalDone;
      }
      const bool clash = in_topology || (what == Major::kCollective ? in_sync : in_collective);
      require(!clash, name(pr) + " starts " + (what == Major::kCollective ? "a collective attempt" : "a shared-state transfer") +
                          " while " + name(q) + " of its group is in " + to_string(q.stage) +
                          (in_collective ? " with a collective attempt" : ""));
    }
  }

  // ------------------------------------------------------------ faults

  // Holders that are up (not stopped, not cut off): the group can rely on them.
  std::size_t safe_holders(std::uint32_t group) const {
    std::size_t n = 0;
    for (const auto& pr : procs_) n += pr.group == group && holder(pr) && !pr.stopped && !in_partition(pr.index) ? 1u : 0u;
    return n;
  }

  std::vector<std::size_t> fault_candidates() {
    std::vector<std::size_t> v;
    for (const auto& pr : procs_) {
      if (pr.stage == Stage::kDead || pr.stopped) continue;
      // the last holder of a group's state that is up stays (as in the soak): without
      // it the group has, by the API's rules, nothing to give a newcomer
      if (holder(pr) && !in_partition(pr.index) && safe_holders(pr.group) <= 1) continue;
      v.push_back(pr.index);
    }
    return v;
  }

  void chaos() {
    if (now_ >= storm_until_us_) {
      if (in_storm_) {
        in_storm_ = false;
        // some calm phases have no newcomers either: then only the departures of the
        // storm make are-peers-pending say yes
        spawns_paused_ = rng_.chance(50);
        // calm: long enough for the liveness bound to be enforced
        const TimeUs calm = live_bound_us_ + rng_.between(3, 15) * kSec;
        schedule(now_ + calm, SimEvent::kChaos);
        note("chaos: calm for " + std::to_string(calm / kMs) + " ms");
        return;
      }
      in_storm_ = true;
      spawns_paused_ = false;
      storm_until_us_ = now_ + rng_.between(2, 12) * kSec;
      note("chaos: storm until " + std::to_string(storm_until_us_ / kMs) + " ms");
    }
    schedule(now_ + rng_.between(100, 1500) * kMs, SimEvent::kChaos);
    if (master_crashes_ && master_up_ && rng_.chance(8)) return master_crash();
    std::vector<std::size_t> victims = fault_candidates();
    if (victims.empty()) return;
    Proc& v = procs_.at(victims[rng_.below(victims.size())]);
    const TimeUs hb = static_cast<TimeUs>(c_->config().heartbeat_timeout_ms) * kMs;
    last_fault_us_ = now_;
    const auto r = rng_.below(100);
    if (r < 25) {
      ++stats_.n[kCrashes];
      note("fault: crash " + name(v));
      crash(v);
    } else if (r < 45) {
      ++stats_.n[kStops];
      const TimeUs d = rng_.chance(40) ? rng_.between(10 * kMs, hb / 2) : rng_.between(hb, 3 * hb);
      note("fault: stop " + name(v) + " for " + std::to_string(d / kMs) + " ms");
      v.stopped = true;
      schedule(now_ + d, SimEvent::kResume, v.index);
    } else if (r < 80) {
      Partition part;
      part.isolate = r < 65;
      part.procs.insert(v.index);
      if (victims.size() > 2 && rng_.chance(30)) part.procs.insert(victims[rng_.below(victims.size())]);
      const TimeUs d = rng_.chance(50) ? rng_.between(10 * kMs, hb / 2) : rng_.between(hb / 2, 3 * hb);
      ++(part.isolate ? stats_.n[kIsolations] : stats_.n[kP2PPartitions]);
      std::string who;
      for (const auto i : part.procs) who += " " + name(procs_.at(i));
      note(std::string("fault: ") + (part.isolate ? "isolate" : "cut p2p of") + who + " for " +
           std::to_string(d / kMs) + " ms");
      partitions_.push_back(part);
      if (part.isolate) {
        for (const auto i : part.procs) {
          Conn& c = conns_.at(procs_.at(i).conn - 1);
          c.up.held = c.down.held = true;
          reschedule(c, true, false);
          reschedule(c, false, false);
        }
      }
      schedule(now_ + d, SimEvent::kHeal, partitions_.size() - 1);
    } else if (r < 88 && master_up_ && !v.id.is_nil() && c_->find_peer(v.id) != nullptr) {
      // the operator evicts it (lockstep-status --evict): the master's own event
      ++stats_.n[kEvictions];
      note("fault: the operator evicts " + name(v));
      Outbox out;
      require(c_->on_evict(v.id, "by the simulated operator", now_ / kMs, out), "a known peer was not found to evict");
      apply(out);
    } else {
      ++stats_.n[kDrops];
      note("fault: connection of " + name(v) + " dropped");
      Conn& c = conns_.at(v.conn - 1);
      for (Direction* d : {&c.up, &c.down}) {
        d->frames.resize(static_cast<std::size_t>(rng_.below(d->frames.size() + 1)), Frame{});
        d->frames.push_back(Frame{Frame::kFin, {}, d->last_arrival});
      }
      reschedule(c, true, false);
      reschedule(c, false, false);
    }
  }

  void crash(Proc& pr) {
    Conn& c = conns_.at(pr.conn - 1);
    if (c.peer_open) {
      // a reset may lose what was still in flight
      c.up.frames.resize(static_cast<std::size_t>(rng_.below(c.up.frames.size() + 1)), Frame{});
      reschedule(c, true, false);
      c.peer_open = false;
      push(c, /*up=*/true, Frame{Frame::kFin, {}, 0});
    }
    die(pr);
  }

  // ------------------------------------------------------------ the master's crash

  // The master's process is gone: the OS closes its connections (what was still in
  // flight may be lost, a reset), what the peers send it is lost, and a new master
  // starts at the same address after a delay: a fresh Coordinator, term 0 in its
  // Config, a new instance nonce. The peers' failover takes the run back to it.
  void master_crash() {
    if (!master_up_) return;
    ++stats_.n[kMasterCrashes];
    last_fault_us_ = now_;
    master_down_since_us_ = now_;
    // what it was doing
    std::string doing;
    const auto hit = [&](Count what, const char* text) {
      ++stats_.n[what];
      doing += std::string(doing.empty() ? "" : ", ") + text;
    };
    bool newcomers = false, optimizing = false, pending = false, agree = false;
    for (const auto& [id, peer] : c_->peers()) {
      newcomers = newcomers || (peer.phase == Phase::kRegistered && !peer.resuming);
      optimizing = optimizing || peer.state == PeerState::kVoteOptimizeTopology || peer.state == PeerState::kMeasuringBandwidth;
      pending = pending || peer.voted_pending;
      agree = agree || peer.agree_flag.has_value();
    }
    if (c_->recovering()) hit(kCrashInRecovery, "a recovery");
    if (c_->topology_phase() != TopologyPhase::kIdle && optimizing) hit(kCrashInOptimize, "an optimize topology");
    if (c_->topology_phase() != TopologyPhase::kIdle && newcomers) hit(kCrashInJoin, "a join");
    if (c_->topology_phase() != TopologyPhase::kIdle && !optimizing) hit(kCrashInTopologyVote, "an update topology");
    if (pending) hit(kCrashInPending, "an are-peers-pending vote");
    if (agree) hit(kCrashInAgree, "an agree vote");
    if (!c_->collectives().empty()) hit(kCrashInCollective, "collectives");
    if (!c_->syncs().empty()) hit(kCrashInSync, "a sync");
    note("fault: the master (generation " + std::to_string(gen_) + ", term " + std::to_string(c_->term()) +
         ") crashes during " + (doing.empty() ? std::string("nothing") : doing));
    master_up_ = false;
    last_master_revision_ = group_revision_;
    for (auto& c : conns_) {
      if (c.gen != gen_) continue;
      c.up.frames.clear();
      reschedule(c, true, false);
      if (!c.master_open) continue;
      c.master_open = false;
      c.down.frames.resize(static_cast<std::size_t>(rng_.below(c.down.frames.size() + 1)), Frame{});
      c.down.frames.push_back(Frame{Frame::kFin, {}, c.down.last_arrival});
      reschedule(c, false, false);
    }
    // mostly back within seconds; sometimes after the peers' failover timeout
    const auto r = rng_.below(100);
    const TimeUs delay = r < 60   ? rng_.between(50, 3'000) * kMs
                         : r < 94 ? rng_.between(3'000, 15'000) * kMs
                                  : failover_timeout_us() + rng_.between(-2'000, 8'000) * kMs;
    schedule(now_ + delay, SimEvent::kMasterRestart);
  }

  void master_restart() {
    ++stats_.n[kMasterRestarts];
    ++gen_;
    Config config = base_config_;
    config.instance_nonce = rng_.next();
    config.term = 0;
    c_ = std::make_unique<Coordinator>(config);
    master_up_ = true;
    awaiting_recovery_ = true;
    group_revision_.clear();
    last_fault_us_ = now_;
    note("master " + std::to_string(gen_) + " starts after " + std::to_string((now_ - master_down_since_us_) / kMs) +
         " ms down");
    // a crash during the recovery itself, now and then
    if (rng_.chance(25)) schedule(now_ + rng_.between(20, 6'000) * kMs, SimEvent::kMasterCrash, gen_);
  }

  TimeUs failover_timeout_us() const { return static_cast<TimeUs>(failover_timeout_.count()) * kMs; }

  void heal(std::size_t index) {
    Partition& part = partitions_.at(index);
    part.active = false;
    last_fault_us_ = now_;
    note("fault healed: partition " + std::to_string(index));
    if (!part.isolate) return;
    for (const auto i : part.procs) {
      if (cut_from_master(i)) continue;
      Conn& c = conns_.at(procs_.at(i).conn - 1);
      c.up.held = c.down.held = false;
      reschedule(c, true, true);
      reschedule(c, false, true);
    }
  }

  void resume(Proc& pr) {
    if (pr.stage == Stage::kDead || !pr.stopped) return;
    last_fault_us_ = now_;
    note("fault healed: " + name(pr) + " resumes with " + std::to_string(pr.frozen_frames.size()) +
         " message(s) waiting");
    pr.stopped = false;
    pr.resumed_us = now_;
    // what arrived meanwhile is read first (it may say that the peer was removed)
    while (!pr.frozen_frames.empty() && pr.stage != Stage::kDead && !pr.stopped) {
      Frame f = std::move(pr.frozen_frames.front());
      pr.frozen_frames.pop_front();
      deliver_to_peer(pr, f);
    }
    std::vector<SimEvent> timers;
    timers.swap(pr.frozen_timers);
    for (auto e : timers) schedule(now_, e.kind, e.a, e.b, e.c, e.d);
  }

  // ------------------------------------------------------------ time-based checks

  void audit() {
    const TimeUs hb = static_cast<TimeUs>(c_->config().heartbeat_timeout_ms) * kMs;
    // no hang past the failover timeout: a peer without a serving master is taken back
    // or ends (MASTER_CONNECTION_LOST, or KICKED by a master that went on without it)
    bool failing_over = false;
    for (auto& pr : procs_) {
      if (pr.stage == Stage::kDead || !pr.accepted) continue;
      // (one that has not noticed its master's crash yet will look for the next)
      failing_over = failing_over || pr.failover_since_us >= 0 || conns_.at(pr.conn - 1).gen != gen_;
      if (pr.failover_since_us < 0) continue;
      // (a stopped process's timers wait, and run when it resumes)
      const bool frozen = pr.stopped || now_ - pr.resumed_us <= 100 * kMs;
      require(frozen || now_ - pr.failover_since_us <= failover_timeout_us() + 100 * kMs,
              name(pr) + " has been without a serving master for " +
                  std::to_string((now_ - pr.failover_since_us) / kMs) + " ms (session " +
                  (pr.session.state() == peer::Session::State::kResuming ? "resuming" : "reconnecting") +
                  "), past the failover timeout of " + std::to_string(failover_timeout_.count()) + " ms");
    }
    // a restarted master that nobody asks to take a run back serves a new one
    if (master_up_ && awaiting_recovery_ && !c_->recovering() && !failing_over) {
      note("master " + std::to_string(gen_) + ": no peer left to take back; a new run");
      awaiting_recovery_ = false;
      ++run_;
    }
    if (!master_up_) return;  // the rest asks the master
    for (auto& pr : procs_) {
      if (pr.id.is_nil()) continue;
      const bool known = c_->find_peer(pr.id) != nullptr;
      if (known) {
        removed_at_.erase(pr.id);  // (a master that took the run back knows it again)
      } else {
        removed_at_.try_emplace(pr.id, now_);
      }
      // a dead process leaves the coordinator (its connection closes, or it falls silent)
      if (pr.stage == Stage::kDead) {
        require(!known || now_ - pr.dead_us < hb + 500 * kMs,
                name(pr) + " died " + std::to_string((now_ - pr.dead_us) / kMs) + " ms ago but the coordinator still counts it");
        continue;
      }
      // a live, reachable peer that the coordinator removed learns it (one that looks
      // for a master, or has not noticed yet that its master crashed, is bounded above)
      const bool excused = pr.stopped || cut_from_master(pr.index) || pr.failover_since_us >= 0 ||
                           conns_.at(pr.conn - 1).gen != gen_ || awaiting_recovery_;
      if (known || excused) {
        pr.ghost_since_us = -1;
      } else if (pr.ghost_since_us < 0) {
        pr.ghost_since_us = now_;
      } else {
        require(now_ - pr.ghost_since_us < 2 * kSec, name(pr) + " was removed by the coordinator but has not learned it");
      }
    }
    // liveness: a group with two live, connected peers and a holder of its state syncs
    for (const auto g : groups_) {
      std::size_t eligible = 0;
      bool has_holder = false;
      for (const auto& pr : procs_) {
        if (pr.group != g || pr.stage == Stage::kDead || pr.stopped || pr.id.is_nil() || in_partition(pr.index) ||
            c_->find_peer(pr.id) == nullptr) {
          continue;
        }
        ++eligible;
        has_holder = has_holder || holder(pr);
      }
      if (eligible < 2 || !has_holder) {
        live_since_us_[g] = now_;
        continue;
      }
      const bool faults_now = in_storm_ || awaiting_recovery_ || c_->recovering() ||
                              std::any_of(partitions_.begin(), partitions_.end(), [](const auto& part) { return part.active; });
      if (faults_now) {
        live_since_us_[g] = std::max(live_since_us_[g], now_);
        continue;
      }
      const TimeUs since = std::max({live_since_us_[g], last_fault_us_, last_progress_us_[g]});
      const TimeUs quiet = std::max(live_since_us_[g], last_fault_us_);
      if (now_ - quiet > live_bound_us_) {
        // long after the last fault the views name no departed peer: are-peers-pending
        // said yes after the departure, and update topology refreshed them
        for (const auto& pr : procs_) {
          if (pr.group != g || pr.stage == Stage::kDead || !pr.accepted || c_->find_peer(pr.id) == nullptr) continue;
          for (const auto& m : pr.view) {
            if (c_->find_peer(m.id) != nullptr) continue;
            const TimeUs removed = removed_at_.try_emplace(m.id, now_).first->second;
            require(now_ - removed <= live_bound_us_, name(pr) + "'s membership view still names " + m.id.to_string() +
                                                          ", removed " + std::to_string((now_ - removed) / kMs) +
                                                          " ms ago");
          }
        }
        ++stats_.n[kLivenessArmed];
        stats_.longest_armed_stall_us = std::max(stats_.longest_armed_stall_us, now_ - std::max(quiet, last_progress_us_[g]));
      }
      require(now_ - since <= live_bound_us_,
              "stuck: group " + std::to_string(g) + " has " + std::to_string(eligible) +
                  " live, connected peers and a holder of its state, but no sync completed for " +
                  std::to_string((now_ - since) / kMs) + " ms since the last fault (bound " +
                  std::to_string(live_bound_us_ / kMs) + " ms); see who the coordinator waits for below");
    }
  }

  std::uint64_t seed_;
  Rng rng_;
  TimeUs duration_us_;
  bool trace_, verbose_;
  Config base_config_;
  // The serving master; while it is down (master_up_ false), the crashed one's last
  // state, which nothing feeds.
  std::unique_ptr<Coordinator> c_;
  bool failover_ = false;        // the peers run with failover on
  std::chrono::milliseconds failover_timeout_{30'000};
  std::map<std::uint32_t, std::optional<std::uint64_t>> last_master_revision_;  // at the last crash
  bool master_crashes_ = false;  // the master crashes now and then
  bool master_up_ = true;
  std::uint32_t gen_ = 1;        // the master's generation: one per start
  // Set by a restart until the new master took the run back (or no peer is left to
  // ask it): newcomers wait meanwhile (docs/simulation.md).
  bool awaiting_recovery_ = false;
  // The run: a new one when a master starts with nobody to take back (its epochs and
  // revisions start over).
  std::uint32_t run_ = 1;
  TimeUs master_down_since_us_ = 0;
  // Attempt numbers may be used again by a later master (one that never heard of them):
  // the masters that issued each, for lineage().
  std::map<std::uint64_t, std::set<std::uint32_t>> issuers_;
  std::map<std::uint32_t, std::uint64_t> highest_revision_;  // per group, over every master
  // The k-th control outcome (are-peers-pending, agree, sync) of a group's view:
  // (run, group, epoch, k) -> (proc, outcome)
  std::map<std::tuple<std::uint32_t, std::uint32_t, std::uint64_t, std::uint32_t>,
           std::vector<std::pair<std::size_t, std::vector<std::uint8_t>>>>
      control_outcomes_;
  std::vector<std::uint32_t> groups_;
  std::size_t peers_max_ = 4;
  std::uint32_t reduces_ = 2;
  std::uint32_t optimize_every_ = 0;
  TimeUs p2p_connect_timeout_us_ = 500 * kMs;
  TimeUs live_bound_us_ = 10 * kSec;
  std::map<std::uint32_t, std::vector<p::TensorEntry>> shapes_;

  std::priority_queue<SimEvent, std::vector<SimEvent>, std::greater<SimEvent>> queue_;
  std::uint64_t next_seq_ = 0;
  TimeUs now_ = 0;
  std::deque<Conn> conns_;
  std::deque<Proc> procs_;
  std::map<PeerId, std::size_t> by_id_;
  std::vector<Partition> partitions_;
  bool in_storm_ = false;
  bool spawns_paused_ = false;
  TimeUs storm_until_us_ = 0;
  TimeUs last_fault_us_ = 0;

  std::map<std::uint64_t, RingAttempt> ring_attempts_;
  // by attempt (lineage()): who learned which outcome
  std::map<std::uint64_t, std::vector<std::pair<std::size_t, p::CollectiveResult>>> collective_outcomes_;
  std::map<std::uint64_t, std::vector<std::size_t>> committed_;  // attempts peers returned from on their commit
  std::map<std::uint64_t, std::vector<std::pair<std::size_t, p::SyncResult>>> sync_outcomes_;
  std::map<std::uint64_t, std::pair<std::uint64_t, std::vector<std::uint64_t>>> elected_;
  std::map<std::tuple<std::uint32_t, std::uint64_t, std::uint32_t>, p::TopologyResult> views_;  // (run, epoch, group)
  std::map<std::uint32_t, std::optional<std::uint64_t>> group_revision_;
  std::map<std::uint32_t, TimeUs> last_progress_us_;
  std::map<std::uint32_t, TimeUs> live_since_us_;
  std::map<PeerId, TimeUs> removed_at_;  // when the audit first saw the coordinator without it

  std::deque<std::string> log_;
  Stats stats_;
};

TEST(SimNetwork, SeededRuns) {
  // the sessions log their failovers; the trace says what happened
  log::set_level(log::Level::kError);
  const TimeUs duration_us = static_cast<TimeUs>(env_u64("LOCKSTEP_NETSIM_SECONDS").value_or(60)) * kSec;
  const bool verbose = env_u64("LOCKSTEP_NETSIM_VERBOSE").value_or(0) != 0;
  std::vector<std::uint64_t> seeds;
  if (auto one = env_u64("LOCKSTEP_NETSIM_SEED")) {
    seeds.push_back(*one);
  } else {
    const std::uint64_t first = env_u64("LOCKSTEP_NETSIM_FIRST_SEED").value_or(1);
    const std::uint64_t n = env_u64("LOCKSTEP_NETSIM_SEEDS").value_or(200);
    for (std::uint64_t s = first; s < first + n; ++s) seeds.push_back(s);
  }
  Stats total;
  std::uint64_t ran = 0;
  const auto start = std::chrono::steady_clock::now();
  for (const std::uint64_t seed : seeds) {
    // one seed, verbose: its whole trace, even when it passes
    const bool show = verbose && seeds.size() == 1;
    Sim sim(seed, duration_us, /*trace=*/show, verbose);
    const std::string failure = sim.run();
    if (show && failure.empty()) std::cout << sim.trace();
    total.add(sim.stats());
    ++ran;
    if (!failure.empty()) {
      // deterministic: the same seed again, with its trace
      Sim replay(seed, duration_us, /*trace=*/true, verbose);
      ADD_FAILURE() << replay.run();
      break;
    }
  }
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << ran << " seed(s), " << total.n[kSimUs] / kSec << " simulated s, " << total.n[kEvents] << " events ("
            << static_cast<std::uint64_t>(static_cast<double>(total.n[kEvents]) / std::max(wall_s, 1e-9))
            << "/s), " << total.n[kDeliveries] << " messages in " << wall_s << " s\n"
            << "  revisions " << total.n[kRevisions] << "; syncs ok " << total.n[kSyncsOk] << " / failed " << total.n[kSyncsFailed]
            << " (no shared state " << total.n[kNoState] << "), split fetches " << total.n[kSplitFetches]
            << "; collectives ok " << total.n[kCollectivesOk] << " / failed " << total.n[kCollectivesFailed]
            << " (aborts " << total.n[kCollectiveAborts] << ", commits " << total.n[kCommits] << ")"
            << "; agree ok " << total.n[kAgreeOk] << " / lost " << total.n[kAgreeLost] << "; pending yes "
            << total.n[kPendingYes] << " / no " << total.n[kPendingNo] << "; topology ok " << total.n[kTopologyOk]
            << " / failed " << total.n[kTopologyFailed] << "; optimize ok " << total.n[kOptimizeOk] << " / failed "
            << total.n[kOptimizeFailed] << " (" << total.n[kBandwidthTests] << " bandwidth tests)\n"
            << "  peers " << total.n[kSpawned] << " (joined " << total.n[kJoined] << "), kicked " << total.n[kKicked]
            << ", rejected " << total.n[kRejected] << ", master lost " << total.n[kMasterLost] << "; faults: crashes "
            << total.n[kCrashes] << ", stops " << total.n[kStops] << ", isolations " << total.n[kIsolations]
            << ", p2p partitions " << total.n[kP2PPartitions] << ", connection drops " << total.n[kDrops]
            << ", evictions " << total.n[kEvictions] << "\n"
            << "  failover: " << total.n[kFailoverSeeds] << " seed(s) with failover; master crashes " << total.n[kMasterCrashes]
            << " (during: recovery " << total.n[kCrashInRecovery] << ", update topology " << total.n[kCrashInTopologyVote]
            << ", join " << total.n[kCrashInJoin] << ", optimize " << total.n[kCrashInOptimize] << ", are-peers-pending "
            << total.n[kCrashInPending] << ", agree " << total.n[kCrashInAgree] << ", collectives "
            << total.n[kCrashInCollective] << ", sync " << total.n[kCrashInSync] << "), restarts "
            << total.n[kMasterRestarts] << "; recoveries " << total.n[kRecoveries] << " (" << total.n[kTakenBack]
            << " peers taken back, " << total.n[kForwarded] << " outcomes forwarded); resume tries "
            << total.n[kResumeTries] << ", terms refused " << total.n[kTermRefusals] << ", session refusals "
            << total.n[kSessionRefusals] << "; failovers ended KICKED " << total.n[kFailoverKicked]
            << ", MASTER_CONNECTION_LOST " << total.n[kFailoverTimeouts] << "\n"
            << "  liveness enforced at " << total.n[kLivenessArmed] << " checks; longest wait for a sync then "
            << total.longest_armed_stall_us / kMs << " ms\n";
  // the runs must exercise what they claim to, or they prove little
  if (seeds.size() >= 20 && !HasFailure()) {
    EXPECT_GT(total.n[kSyncsOk], 0u);
    EXPECT_GT(total.n[kSyncsFailed], 0u);
    EXPECT_GT(total.n[kCollectivesOk], 0u);
    EXPECT_GT(total.n[kCollectivesFailed], 0u);
    EXPECT_GT(total.n[kCommits], 0u);
    EXPECT_GT(total.n[kCollectiveAborts], 0u);
    EXPECT_GT(total.n[kTopologyOk], 0u);
    EXPECT_GT(total.n[kTopologyFailed], 0u);
    EXPECT_GT(total.n[kOptimizeOk], 0u);
    EXPECT_GT(total.n[kBandwidthTests], 0u);
    EXPECT_GT(total.n[kAgreeOk], 0u);
    EXPECT_GT(total.n[kKicked], 0u);
    EXPECT_GT(total.n[kLivenessArmed], 0u);
    EXPECT_GT(total.n[kSplitFetches], 0u);
    EXPECT_GT(total.n[kEvictions], 0u);
    EXPECT_GT(total.n[kMasterCrashes], 0u);
    EXPECT_GT(total.n[kRecoveries], 0u);
    EXPECT_GT(total.n[kTakenBack], 0u);
    EXPECT_GT(total.n[kFailoverKicked] + total.n[kFailoverTimeouts], 0u);
  }
}

}  // namespace
}  // namespace lockstep::coord
