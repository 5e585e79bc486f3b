// Seeded randomized runs of the coordinator. One Coordinator is driven by simulated
// peers that connect (some with a bad Hello, some never finishing the handshake), join
// 2-3 groups, vote roughly as the documented loop does (update topology, are-peers-
// pending, agree, collectives, shared-state syncs), report p2p results (sometimes naming
// an unreachable ring member), send illegal and forbidden messages, disconnect, fall
// silent, and let time pass; some runs have the vote timeout on. The simulated peers know
// only what the coordinator sent them, so every message is checked against what its
// recipient could legitimately receive (absorb()), and after every step the run is
// checked against the product's guarantees (check_after_step(), check_deadlines()).
//
// Shared state: every peer holds a revision and the tensors of its group (fixed keys,
// dtype and counts per group; a tensor's content is a small number standing for its
// digest). Before a sync it advances its revision by one and "trains" its content
// deterministically, so that peers in step present the same content; sometimes one
// tensor diverges, a newcomer presents revision 0 with other content, a peer syncs
// receive-only or send-only, restores the group's last revision from a "checkpoint", and
// rarely it presents a revision above R+1 or another key set, dtype or count. A peer
// that gets a SyncPlan reports SyncDone (mostly OK, sometimes a hash mismatch or another
// failure; sometimes it dies or falls silent instead) and adopts the elected revision
// and content on an OK result. Every sync decision (removals, plans, "no shared state")
// is compared with an independent election over the votes (rules 5-6), every plan's
// fetches are checked piece by piece, and after every successful sync the participants'
// tensors must be identical (guarantee 4).
//
// Environment: LOCKSTEP_SIM_SEEDS=N runs N seeds (default 300), LOCKSTEP_SIM_STEPS=N
// steps per seed (default 3000), LOCKSTEP_SIM_SEED=X runs only seed X (to replay a
// failure), LOCKSTEP_SIM_VERBOSE=1 prints the whole event log of a failing seed
// instead of its last 50 entries.
#include "common/dtype.h"
#include "coordinator/coordinator.h"
#include "protocol/codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep::coord {
namespace {

namespace p = lockstep::proto;

std::optional<std::uint64_t> env_u64(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::strtoull(value, nullptr, 0);
}

std::string describe(const p::Message& m) {
  std::ostringstream s;
  s << p::msg_type_name(p::type_of(m));
  std::visit(
      [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (requires { v.status; }) s << " " << status_name(v.status);
        if constexpr (std::is_same_v<T, p::EstablishP2P> || std::is_same_v<T, p::TopologyResult>) {
          s << " epoch=" << v.epoch << " ring=[";
          for (std::size_t i = 0; i < v.ring.size(); ++i) s << (i ? " " : "") << v.ring[i].id.to_string();
          s << "]";
        }
        if constexpr (std::is_same_v<T, p::P2PReport>) {
          s << " epoch=" << v.epoch << " unreachable=[";
          for (std::size_t i = 0; i < v.unreachable.size(); ++i) s << (i ? " " : "") << v.unreachable[i].to_string();
          s << "]";
        }
        if constexpr (std::is_same_v<T, p::AgreeResult>) s << " value=" << v.value;
        if constexpr (std::is_same_v<T, p::VoteAgree>) s << " flag=" << v.flag;
        if constexpr (std::is_same_v<T, p::PeersPendingResult>) s << " pending=" << v.pending;
        if constexpr (std::is_same_v<T, p::Refused>) s << " request=" << p::msg_type_name(v.request);
        if constexpr (std::is_same_v<T, p::Hello>) s << " group=" << v.group << " port=" << v.p2p_port;
        if constexpr (requires { v.tag; }) s << " tag=" << v.tag;
        if constexpr (requires { v.attempt; }) s << " attempt=" << v.attempt;
        if constexpr (std::is_same_v<T, p::CollectiveDone>) s << " ok=" << v.ok;
        if constexpr (std::is_same_v<T, p::SyncVote>) {
          s << " " << p::to_string(v.strategy) << " rev=" << v.revision << " [";
          for (std::size_t i = 0; i < v.tensors.size(); ++i) {
            const auto& t = v.tensors[i];
            s << (i ? " " : "") << t.key << ":" << int{t.dtype} << "x" << t.count << "=" << t.hash.lo
              << (t.allow_content_inequality ? "~" : "");
          }
          s << "]";
        }
        if constexpr (std::is_same_v<T, p::SyncPlan>) {
          s << " rev=" << v.revision << " expect=[";
          for (std::size_t i = 0; i < v.expect.size(); ++i) s << (i ? " " : "") << v.expect[i].tensor << ":" << v.expect[i].hash.lo;
          s << "] fetches=" << v.fetches.size() << " sources=" << v.sources.size();
        }
        if constexpr (std::is_same_v<T, p::SyncResult>) s << " rev=" << v.revision;
        if constexpr (requires { v.reason; }) {
          if (!v.reason.empty()) s << " \"" << v.reason << "\"";
        }
      },
      m);
  return s.str();
}

// What a simulated peer is waiting for, from what it sent and what it was sent.
enum class Wait { kNone, kTopologyVote, kEstablish, kReported, kPending, kAgree, kSyncVote, kSyncing };

const char* to_string(Wait w) {
  switch (w) {
    case Wait::kNone: return "none";
    case Wait::kTopologyVote: return "topology-vote";
    case Wait::kEstablish: return "establish";
    case Wait::kReported: return "reported";
    case Wait::kPending: return "pending";
    case Wait::kAgree: return "agree";
    case Wait::kSyncVote: return "sync-vote";
    case Wait::kSyncing: return "sync-transfer";
  }
  return "?";
}

// A collective (tag) this peer voted for, from its CollectiveInit to its result.
struct SimCollective {
  bool performing = false;  // got CollectiveGo
  std::uint64_t attempt = 0;
  std::vector<PeerId> ring;
  bool done_sent = false;  // reported its part as finished
  TimeMs voted_ms = 0;
  // Its part of the attempt: it holds the result (complete) or never will (failed). A
  // complete peer may stay silent (its commit exchange runs) until it commits, reports
  // without a commit, or is told to stop (aborted).
  bool complete = false;
  bool failed = false;
  bool aborted = false;
};

// Large enough for the ring (smaller all-reduces travel with the votes).
const p::CollectiveDescriptor kDescriptor{1 << 20, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE};

struct SimPeer {
  ConnId conn = 0;
  std::string observed_host;
  std::string member_host;  // what the others are told
  std::uint16_t port = 0;
  bool no_inbound = false;  // it named no port (docs/deployment.md, "NAT")
  std::uint16_t pool_size = 1;
  std::uint32_t group = 0;
  bool will_hello = true;
  bool hello_sent = false;
  bool welcomed = false;
  bool accepted = false;
  bool open = true;     // the connection exists (neither side closed it)
  bool straggler = false;  // its Goodbye said it was removed by the vote timeout
  bool silent = false;  // stopped: sends nothing any more
  bool never_reports = false;  // alive, but its p2p establishment never finishes
  bool sluggish = false;       // acts rarely, so votes wait for it
  PeerId id;
  Wait wait = Wait::kNone;
  std::uint64_t establish_epoch = 0;
  std::vector<p::MemberInfo> establish_ring;
  bool agree_flag = false;
  TimeMs last_sent_ms = 0;
  TimeMs waiting_since_ms = 0;  // when it entered its current vote
  TimeMs free_since_ms = 0;     // when it last left a vote (it may join another from then on)
  TimeMs connected_ms = 0;
  std::uint64_t view_epoch = 0;
  std::map<std::uint64_t, SimCollective> collectives;  // by tag
  // (tag, attempt) it committed and returned from: their outcome must be a success.
  std::set<std::pair<std::uint64_t, std::uint64_t>> committed;
  // The report of its last commit, on its way to the master (sent at its next turn).
  std::optional<p::CollectiveDone> unsent_commit;
  std::uint64_t accepted_epoch = 0;  // the epoch that accepted it (earliest accepted wins election ties)
  std::size_t view_size = 0;         // peers in its group's membership view
  std::vector<PeerId> view;          // that view, in ring order
  // shared state
  bool has_state = false;
  bool synced = false;  // holds an elected state (adopted, or restored from a checkpoint)
  std::uint64_t held_revision = 0;
  std::vector<p::TensorEntry> held;
  p::SyncVote sync_vote;  // its vote, from SyncVote to SyncResult
  p::SyncPlan plan;       // its plan, from SyncPlan to SyncResult
  bool sync_done_sent = false;
};

struct Failure {
  std::string what;
};

class Sim {
 public:
  explicit Sim(std::uint64_t seed) : seed_(seed), rng_(seed), c_(make_config(rng_)) {
    const std::uint32_t group_ids[] = {0, 7, 42, 0xffffffffu};
    const std::size_t n = 2 + rng_() % 2;
    groups_.assign(group_ids, group_ids + n);
    max_open_ = 4 + static_cast<std::size_t>(rng_() % 9);
    // the shared state of each group: 1-3 tensors, one dtype, fixed counts (sometimes a
    // tensor of several MiB, so that plans split it over distributors), and sometimes a
    // last tensor that allows content inequality
    static const std::uint8_t dtypes[] = {LOCKSTEP_F32, LOCKSTEP_BF16, LOCKSTEP_U8, LOCKSTEP_F64};
    for (const std::uint32_t group : groups_) {
      const std::size_t tensors = 1 + rng_() % 3;
      const std::uint8_t dtype = dtypes[rng_() % 4];
      std::vector<p::TensorEntry>& shape = shapes_[group];
      for (std::size_t i = 0; i < tensors; ++i) {
        p::TensorEntry t;
        t.key = "w";
        t.key += std::to_string(i);
        t.dtype = dtype;
        t.count = 1 + rng_() % 5000;
        if (i == 0 && chance(50)) t.count = (2 + rng_() % 5) << 21;
        t.allow_content_inequality = tensors >= 2 && i + 1 == tensors && chance(30);
        shape.push_back(t);
      }
    }
  }

  // Returns the failure description, or an empty string.
  std::string run(int steps) {
    try {
      for (step_ = 0; step_ < steps; ++step_) one_step();
    } catch (const Failure& f) {
      return report(f.what);
    } catch (const std::exception& e) {
      return report(std::string("exception from the coordinator: ") + e.what());
    }
    return {};
  }

  // Totals, to check that the runs exercise what they should.
  struct Stats {
    int accepted = 0, topology_ok = 0, topology_failed = 0, mismatches = 0, agree_ok = 0, agree_lost = 0,
        pending_yes = 0, pending_no = 0, refused = 0, kicked = 0, rejected = 0, protocol_errors = 0,
        heartbeat_kicks = 0, straggler_kicks = 0, establish_timeouts = 0, blamed = 0, collectives_ok = 0,
        collectives_failed = 0, collective_commits = 0, collective_aborts = 0;
    // shared-state syncs: attempts that succeeded / failed (of which by a hash mismatch),
    // votes answered "no shared state available" or OPERATION_MISMATCH (per recipient),
    // peers removed for a revision violation / a shared-state mismatch / as stragglers of a
    // sync vote, decisions that removed someone, plans that receive tensors / that fetch
    // one tensor from several distributors
    int syncs_ok = 0, syncs_failed = 0, syncs_hash_mismatch = 0, sync_unavailable = 0, sync_mismatches = 0,
        revision_violations = 0, state_mismatches = 0, sync_stragglers = 0, sync_decisions_with_removals = 0,
        sync_receivers = 0, sync_split_fetches = 0;
  };
  const Stats& stats() const { return stats_; }

 private:
  static Config make_config(std::mt19937_64& rng) {
    Config config;
    config.heartbeat_timeout_ms = 1'000;
    config.handshake_timeout_ms = 1'500;
    config.establish_timeout_ms = 4'000;
    config.vote_timeout_ms = rng() % 2 == 0 ? 0 : static_cast<std::uint32_t>(1'500 + rng() % 2'000);
    config.peers_max = rng() % 4 == 0 ? 5 : limits::kPeersMaxDefault;
    config.pending_handshakes_max = rng() % 4 == 0 ? 2 : limits::kPendingHandshakesMax;
    config.instance_nonce = rng();
    // A master with a relay: peers that accept no inbound connection may be neighbours.
    // Drawn from bits already drawn, so that the other seeds run as they did before.
    config.relay = (config.instance_nonce >> 17) % 3 == 0;
    return config;
  }

  // One sync attempt, from its plans to its outcome.
  struct SyncAttempt {
    std::uint32_t group = 0;
    std::uint64_t revision = 0;  // the elected revision
    std::set<PeerId> participants;
    std::vector<p::TensorEntry> elected;  // the representative's tensors (the targets)
    std::set<PeerId> ok;                  // reported its transfers as OK
    std::optional<StatusCode> failure;    // the outcome a failed report must give
  };
  // What one batch of commands decided about a group's sync vote.
  struct SyncBatch {
    std::set<ConnId> violators, misfits;  // Goodbye REVISION_VIOLATION / SHARED_STATE_MISMATCH
    std::set<ConnId> unavailable;         // SyncResult attempt 0 NO_SHARED_STATE_AVAILABLE
    std::map<ConnId, p::SyncPlan> plans;
  };
  // What the election over a group's complete sync vote must give (rules 5-6).
  struct Election {
    std::set<ConnId> violators, misfits, unavailable, participants;
    std::uint64_t revision = 0;
    PeerId representative;
    std::vector<p::TensorEntry> elected;
    std::map<ConnId, std::vector<p::SyncExpect>> expect;
    std::map<std::string, std::set<PeerId>> distributors;  // by key: who may send the target
  };

  [[noreturn]] void fail(const std::string& what) { throw Failure{what}; }
  void require(bool ok, const std::string& what) {
    if (!ok) fail(what);
  }

  std::string report(const std::string& what) {
    std::ostringstream s;
    s << "seed " << seed_ << " failed at step " << step_ << " (t=" << now_ << " ms): " << what << "\n";
    s << "config: vote_timeout_ms=" << c_.config().vote_timeout_ms << " peers_max=" << c_.config().peers_max
      << " pending_handshakes_max=" << c_.config().pending_handshakes_max << "\n";
    s << "state: " << c_.digest() << "\n";
    s << "last " << log_.size() << " events:\n";
    for (const auto& line : log_) s << line;
    s << "replay with: LOCKSTEP_SIM_SEED=" << seed_ << " ./coordinator_random_test\n";
    return s.str();
  }

  void note(const std::string& line) {
    log_.push_back(line);
    const std::size_t keep = verbose_ ? 1'000'000 : 50;
    while (log_.size() > keep) log_.pop_front();
  }

  std::string name(const SimPeer& sp) const {
    std::string s = "conn " + std::to_string(sp.conn);
    if (sp.welcomed) s += " (" + sp.id.to_string() + " g" + std::to_string(sp.group) + ")";
    return s;
  }

  bool chance(unsigned percent) { return rng_() % 100 < percent; }
  template <typename T>
  const T& pick(const std::vector<T>& v) {
    return v[rng_() % v.size()];
  }

  // ------------------------------------------------------------ stepping

  void one_step() {
    const auto r = rng_() % 100;
    if (r < 6) {
      act_connect();
    } else if (r < 14) {
      act_hello();
    } else if (r < 82) {
      act_peer();
    } else if (r < 84) {
      act_dead_connection();
    } else {
      act_time();
    }
  }

  std::vector<SimPeer*> open_peers(bool welcomed_only) {
    std::vector<SimPeer*> v;
    for (auto& [conn, sp] : peers_) {
      if (sp.open && (!welcomed_only || sp.welcomed)) v.push_back(&sp);
    }
    return v;
  }

  void act_connect() {
    if (open_peers(false).size() >= max_open_) return;
    SimPeer sp;
    sp.conn = next_conn_++;
    sp.observed_host = chance(2) ? "127.0.0.1" : "10.0." + std::to_string(sp.conn / 200) + "." + std::to_string(1 + sp.conn % 200);
    sp.member_host = sp.observed_host;
    sp.will_hello = !chance(5);
    sp.never_reports = chance(2);
    sp.sluggish = chance(15);
    sp.last_sent_ms = now_;
    sp.connected_ms = now_;
    peers_[sp.conn] = sp;
    SimPeer& ref = peers_[sp.conn];
    const std::size_t handshaking = c_.handshaking_count();
    Outbox out;
    c_.on_connect(ref.conn, ref.observed_host, now_, out);
    note("t=" + std::to_string(now_) + " connect conn " + std::to_string(ref.conn) + " from " + ref.observed_host + "\n");
    if (handshaking >= c_.config().pending_handshakes_max) {
      // The oldest unfinished handshake of the busiest host makes room for the new one.
      require(!closes(out, ref.conn), "a new connection at the pending-handshake cap was closed instead of an old one");
      require(out.size() >= 1 && c_.handshaking_count() == handshaking,
              "a connection at the pending-handshake cap displaced no unfinished handshake");
    } else {
      require(out.empty(), "on_connect produced commands below the pending-handshake cap");
    }
    absorb(out, {});
  }

  void act_hello() {
    std::vector<SimPeer*> candidates;
    for (auto& [conn, sp] : peers_) {
      if (sp.open && !sp.hello_sent && sp.will_hello) candidates.push_back(&sp);
    }
    if (candidates.empty()) return;
    SimPeer& sp = *pick(candidates);
    sp.hello_sent = true;
    sp.group = pick(groups_);
    sp.port = static_cast<std::uint16_t>(10000 + sp.conn % 50000);
    sp.last_sent_ms = now_;
    const auto kind = rng_() % 100;
    Outbox out;
    Expect expect;
    if (kind < 4) {
      // a protocol violation before the handshake: the shell could not decode the frame
      note("t=" + std::to_string(now_) + " " + name(sp) + " protocol error during handshake\n");
      c_.on_protocol_error(sp.conn, "garbage", now_, out);
      expect.goodbye = {sp.conn, LOCKSTEP_STATUS_PROTOCOL_ERROR};
    } else if (kind < 8) {
      const auto which = rng_() % 3;
      const p::Message m = which == 0   ? p::Message(p::VoteUpdateTopology{})
                           : which == 1 ? p::Message(p::P2PHello{})
                                        : p::Message(p::SyncVote{});
      note("t=" + std::to_string(now_) + " " + name(sp) + " sends " + describe(m) + " instead of Hello\n");
      c_.on_message(sp.conn, m, now_, out);
      expect.goodbye = {sp.conn, LOCKSTEP_STATUS_PROTOCOL_ERROR};
    } else {
      p::Hello hello;
      hello.group = sp.group;
      // 8..11: a Hello naming some ports but not all (rejected); 12..21 (12..39 in a
      // run with a relay, which may place them side by side): a peer that accepts no
      // inbound connection (all three 0, docs/deployment.md "NAT").
      const std::uint64_t nat_end = c_.config().relay ? 40 : 22;
      const bool no_inbound = kind >= 12 && kind < nat_end;
      sp.no_inbound = no_inbound;
      hello.p2p_port = kind < nat_end ? 0 : sp.port;
      hello.shared_state_port = no_inbound ? 0 : static_cast<std::uint16_t>(sp.port + 1);
      hello.benchmark_port = no_inbound ? 0 : static_cast<std::uint16_t>(sp.port + 2);
      sp.pool_size = static_cast<std::uint16_t>(1 + rng_() % 4);
      hello.pool_size = sp.pool_size;
      if (chance(10)) {
        hello.advertised_host = "192.168.1." + std::to_string(sp.conn % 250);
        sp.member_host = hello.advertised_host;
      }
      // what the coordinator must answer
      bool reject = (hello.p2p_port == 0 && !no_inbound) || c_.peers().size() >= c_.config().peers_max;
      for (const auto& [id, other] : c_.peers()) {
        if (is_loopback(other.info.host) != is_loopback(sp.member_host)) reject = true;
      }
      note("t=" + std::to_string(now_) + " " + name(sp) + " sends " + describe(hello) + "\n");
      c_.on_message(sp.conn, hello, now_, out);
      if (reject) {
        expect.goodbye = {sp.conn, LOCKSTEP_STATUS_REJECTED};
      } else {
        expect.welcome = sp.conn;
      }
    }
    absorb(out, expect);
  }

  static bool is_loopback(const std::string& host) {
    return host.rfind("127.", 0) == 0 || host == "localhost" || host == "::1";
  }

  // A welcomed peer does something: the documented loop, an illegal request, a
  // forbidden message, a disconnect, a protocol error, or it falls silent.
  void act_peer() {
    std::vector<SimPeer*> candidates;
    for (SimPeer* sp : open_peers(true)) {
      if (!sp->silent) candidates.push_back(sp);
    }
    if (candidates.empty()) return;
    SimPeer& sp = *pick(candidates);
    // A commit's report left this peer when it committed; it reaches the master now,
    // after whatever the other peers did meanwhile (a loss, other reports).
    if (sp.unsent_commit) {
      const p::CollectiveDone done = *sp.unsent_commit;
      sp.unsent_commit.reset();
      return request(sp, done, true);
    }
    if (sp.sluggish && chance(85)) return send_heartbeat(sp);
    const auto r = rng_() % 1000;
    if (r < 15) return act_disconnect(sp);
    if (r < 22) return act_protocol_error(sp);
    if (r < 25) return act_evict(sp);
    if (r < 30) {
      note("t=" + std::to_string(now_) + " " + name(sp) + " falls silent\n");
      sp.silent = true;
      return;
    }
    if (r < 40) return act_forbidden(sp);
    if (r < 140) return act_illegal(sp);
    if (r < 150) return act_stale_report(sp);
    if (r < 200) return send_heartbeat(sp);
    // the documented loop
    if (sp.wait == Wait::kEstablish && sp.never_reports) return send_heartbeat(sp);
    if (sp.wait == Wait::kEstablish) {
      p::P2PReport report{sp.establish_epoch, {}};
      if (chance(7)) {
        if (chance(80) && sp.establish_ring.size() > 1) {
          PeerId target = sp.id;
          while (target == sp.id) target = pick(sp.establish_ring).id;
          report.unreachable.push_back(target);
        } else {
          report.unreachable.push_back(PeerId{rng_(), rng_()});
        }
      }
      return request(sp, report, /*legal=*/true, Wait::kReported);
    }
    if (sp.wait == Wait::kSyncing) return act_sync_transfer(sp);
    // the application calls the same operation on every peer of a group: once one of them
    // waits in a sync vote, the others mostly follow (after awaiting their collectives)
    const bool free = sp.accepted && sp.wait == Wait::kNone && sp.collectives.empty();
    if (free && group_votes_sync(sp.group) && chance(85)) return act_sync_vote(sp);
    const bool may_collect = sp.accepted && sp.wait != Wait::kTopologyVote && sp.wait != Wait::kEstablish &&
                             sp.wait != Wait::kReported && sp.wait != Wait::kSyncVote;
    if (may_collect && chance(35)) return act_collective(sp);
    if (!sp.accepted || sp.wait != Wait::kNone) return send_heartbeat(sp);
    // (syncing is what the loop does after its group changed: more often with company)
    if (free && chance(sp.view_size > 1 ? 25 : 8)) return act_sync_vote(sp);
    const auto v = rng_() % 100;
    if (v < 30 && sp.collectives.empty()) return request(sp, p::VoteUpdateTopology{}, true, Wait::kTopologyVote);
    if (v < 30) return send_heartbeat(sp);
    if (v < 60) return request(sp, p::VotePeersPending{}, true, Wait::kPending);
    sp.agree_flag = !chance(15);
    return request(sp, p::VoteAgree{sp.agree_flag}, true, Wait::kAgree);
  }

  // Collectives: finish an attempt it was told to perform (sometimes failing it), or
  // start a tag (all peers of a group start the same tags; sometimes with a
  // different descriptor, which must fail the tag for all).
  void act_collective(SimPeer& sp) {
    std::vector<std::uint64_t> running;
    for (const auto& [tag, c] : sp.collectives) {
      // (one that reported ok may still commit before the outcome reaches it)
      if (c.performing && (!c.done_sent || (c.complete && !c.aborted))) running.push_back(tag);
    }
    if (!running.empty() && chance(70)) {
      const std::uint64_t tag = pick(running);
      SimCollective& c = sp.collectives.at(tag);
      if (!c.complete) {
        c.failed = chance(5);
        c.complete = !c.failed;
        if (c.complete) holders_[c.attempt].insert(sp.id);
        if (c.complete && chance(50)) return send_heartbeat(sp);  // silent: its commit exchange runs
        c.done_sent = true;
        return request(sp, p::CollectiveDone{tag, c.attempt, c.complete, c.complete ? "" : "ring neighbour hung up"},
                       true);
      }
      // The commit tokens went round: every participant holds the result (the lost
      // ones did before they went). It returns at once, and may call the tag again.
      if (!c.aborted && holders_[c.attempt].size() == c.ring.size() && chance(60)) {
        const std::uint64_t attempt = c.attempt;
        committed_.insert(attempt);
        ++stats_.collective_commits;
        sp.committed.emplace(tag, attempt);
        sp.collectives.erase(tag);
        if (sp.collectives.empty()) sp.free_since_ms = now_;
        sp.unsent_commit = p::CollectiveDone{tag, attempt, true, {}, 0, 0, true};
        return;
      }
      if (c.done_sent || (!c.aborted && chance(70))) return send_heartbeat(sp);
      c.done_sent = true;
      return request(sp, p::CollectiveDone{tag, c.attempt, true, {}}, true);
    }
    const std::uint64_t tag = 1 + rng_() % 3;
    if (sp.collectives.count(tag) != 0) return send_heartbeat(sp);
    p::CollectiveDescriptor d = kDescriptor;
    if (chance(4)) d.op = LOCKSTEP_MAX;
    sp.collectives[tag].voted_ms = now_;
    request(sp, p::CollectiveInit{tag, d}, true);
  }

  // ------------------------------------------------------------ shared state

  // Content stands for a digest: the tensor's key in the high half, a small number in
  // the low half.
  static state::Digest digest_of(const std::string& key, std::uint64_t value) {
    std::uint64_t h = 1469598103934665603ull;
    for (const char ch : key) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
    return state::Digest{h, value};
  }

  bool group_votes_sync(std::uint32_t group) const {
    return std::any_of(peers_.begin(), peers_.end(), [&](const auto& entry) {
      return entry.second.open && entry.second.group == group && entry.second.wait == Wait::kSyncVote;
    });
  }

  std::optional<std::uint64_t> known_revision(std::uint32_t group) const {
    const auto it = revisions_.find(group);
    if (it == revisions_.end()) return std::nullopt;
    return it->second;
  }

  // A peer's first shared state: its group's tensors at revision 0, mostly initialized
  // like the others' (same "init seed"), sometimes with other content.
  void init_state(SimPeer& sp) {
    sp.has_state = true;
    sp.synced = false;
    sp.held_revision = 0;
    sp.held = shapes_.at(sp.group);
    const bool other = chance(40);
    const std::uint64_t base = 2000 + rng_() % 20 * 10;
    for (std::size_t i = 0; i < sp.held.size(); ++i) {
      sp.held[i].hash = digest_of(sp.held[i].key, other ? base + i : 500 + i);
    }
  }

  // The content after the training steps that lead to `revision`: deterministic in the
  // held content, so that peers in step present the same; a tensor that allows
  // inequality also depends on the peer (local statistics).
  std::vector<p::TensorEntry> trained(const SimPeer& sp, std::uint64_t revision) const {
    std::vector<p::TensorEntry> tensors = sp.held;
    for (auto& t : tensors) {
      std::uint64_t value = (t.hash.lo * 31 + revision * 7 + 3) % 997;
      if (t.allow_content_inequality) value = (value + sp.conn * 13) % 997;
      t.hash = digest_of(t.key, value);
    }
    return tensors;
  }

  // The documented sync: advance the revision by one and present the state.
  void act_sync_vote(SimPeer& sp) {
    if (!sp.has_state) init_state(sp);
    const std::optional<std::uint64_t> last = known_revision(sp.group);
    if (last && sp.held_revision < *last && group_state_.count(sp.group) != 0 && chance(15)) {
      // restores the group's last revision from a checkpoint (the way back after every
      // holder left)
      sp.held = group_state_.at(sp.group);
      sp.held_revision = *last;
      sp.synced = true;
      note("t=" + std::to_string(now_) + " " + name(sp) + " restores revision " + std::to_string(*last) + "\n");
    }
    p::SyncVote vote;
    vote.revision = sp.held_revision + 1;
    if (!sp.synced && chance(50)) vote.revision = sp.held_revision;  // a newcomer presenting its revision as is
    vote.tensors = vote.revision == sp.held_revision ? sp.held : trained(sp, vote.revision);
    const auto strategy = rng_() % 100;
    if (strategy < (sp.synced ? 8u : 40u)) {
      vote.strategy = p::SyncStrategy::kReceiveOnly;
    } else if (strategy >= 95) {
      vote.strategy = p::SyncStrategy::kSendOnly;
    }
    if (chance(5)) {
      // one tensor diverges (nondeterminism, a bug)
      auto& t = vote.tensors[rng_() % vote.tensors.size()];
      t.hash = digest_of(t.key, 1000 + rng_() % 50);
    }
    if (last && chance(2)) vote.revision = std::max(sp.held_revision + 1, *last + 1) + 1 + rng_() % 3;
    if (chance(2)) {
      // another model definition: a key more or less, another count or dtype
      switch (rng_() % 4) {
        case 0: {
          std::string key = "extra";
          while (find_tensor(vote.tensors, key) != nullptr) key += "+";
          vote.tensors.push_back(p::TensorEntry{key, LOCKSTEP_F32, 16, digest_of(key, 1), false});
          break;
        }
        case 1:
          if (vote.tensors.size() > 1) {
            vote.tensors.erase(vote.tensors.begin() + static_cast<std::ptrdiff_t>(rng_() % vote.tensors.size()));
          } else {
            vote.tensors[0].key += "'";
          }
          break;
        case 2: vote.tensors[rng_() % vote.tensors.size()].count += 1; break;
        default: {
          auto& t = vote.tensors[rng_() % vote.tensors.size()];
          t.dtype = t.dtype == LOCKSTEP_F32 ? LOCKSTEP_F64 : LOCKSTEP_F32;
          break;
        }
      }
    }
    if (chance(30)) std::shuffle(vote.tensors.begin(), vote.tensors.end(), rng_);  // the order is the peer's
    sp.sync_vote = vote;
    request(sp, vote, /*legal=*/true, Wait::kSyncVote);
  }

  // A participant of a transfer: reports, mostly OK; or dies or falls silent instead.
  void act_sync_transfer(SimPeer& sp) {
    if (sp.sync_done_sent) return send_heartbeat(sp);
    const auto r = rng_() % 100;
    if (r < 2) return act_disconnect(sp);
    if (r < 3) {
      note("t=" + std::to_string(now_) + " " + name(sp) + " falls silent during its transfers\n");
      sp.silent = true;
      return;
    }
    p::SyncDone done{sp.plan.attempt, LOCKSTEP_OK, {}};
    if (r < 8) {
      done.status = LOCKSTEP_STATUS_HASH_MISMATCH;
      done.reason = "a received tensor did not verify";
    } else if (r < 10) {
      done.status = LOCKSTEP_STATUS_PEER_CONNECTION_FAILED;
      done.reason = "a source could not be reached";
    }
    sp.sync_done_sent = true;
    SyncAttempt& attempt = sync_attempts_.at(sp.plan.attempt);
    if (done.status == LOCKSTEP_OK) {
      attempt.ok.insert(sp.id);
    } else {
      attempt.failure = done.status == LOCKSTEP_STATUS_HASH_MISMATCH ? LOCKSTEP_STATUS_HASH_MISMATCH
                                                                     : LOCKSTEP_STATUS_PEER_CONNECTION_LOST;
    }
    request(sp, done, /*legal=*/true);
  }

  // A report of something that is not running (it crossed the outcome on the wire) is
  // ignored: no answer, no change. A CollectiveDone or SyncDone of an attempt that is not
  // running, or a P2PReport of no current establishment (another epoch, or none).
  void act_stale_report(SimPeer& sp) {
    std::uint64_t attempt = (std::uint64_t{1} << 60) + rng_() % 1000;
    const auto kind = rng_() % 3;
    // a report of the peer's previous sync attempt, which has ended
    if (kind == 1 && sp.wait != Wait::kSyncing && sp.plan.attempt != 0 && chance(50)) attempt = sp.plan.attempt;
    std::uint64_t epoch = c_.epoch() + 1 + rng_() % 3;
    if (sp.wait != Wait::kEstablish && sp.wait != Wait::kReported) {
      if (chance(50)) epoch = chance(50) ? c_.epoch() : rng_() % 5;
    } else if (sp.establish_epoch > 0 && chance(50)) {
      epoch = sp.establish_epoch - 1;
    }
    const p::Message done =
        kind == 0   ? p::Message(p::CollectiveDone{1 + rng_() % 3, attempt, chance(50), {}})
        : kind == 1 ? p::Message(p::SyncDone{attempt, chance(50) ? LOCKSTEP_OK : LOCKSTEP_STATUS_HASH_MISMATCH, {}})
                    : p::Message(p::P2PReport{epoch, chance(50) ? std::vector<PeerId>{} : std::vector<PeerId>{sp.id}});
    const std::string before = c_.digest();
    sp.last_sent_ms = now_;
    note("t=" + std::to_string(now_) + " " + name(sp) + " sends stale " + describe(done) + "\n");
    Outbox out;
    c_.on_message(sp.conn, done, now_, out);
    note(describe_out(out));
    for (const auto& cmd : expanded(out)) {
      require(!std::holds_alternative<Send>(cmd) && !std::holds_alternative<Close>(cmd),
              "a report of something that is not running was answered");
    }
    require(c_.digest() == before, "a report of something that is not running changed the state");
    check_after_step();
  }

  // A well-formed request the peer's own knowledge says is illegal now.
  void act_illegal(SimPeer& sp) {
    std::vector<std::pair<p::Message, StatusCode>> options;
    const StatusCode usage = LOCKSTEP_STATUS_INVALID_USAGE;
    const StatusCode not_accepted = LOCKSTEP_STATUS_NOT_INITIALIZED;
    if (!sp.accepted || sp.wait != Wait::kNone) {
      const StatusCode st = sp.accepted ? usage : not_accepted;
      options.emplace_back(p::VoteUpdateTopology{}, st);
      options.emplace_back(p::VotePeersPending{}, st);
      options.emplace_back(p::VoteAgree{chance(50)}, st);
    } else if (!sp.collectives.empty()) {
      options.emplace_back(p::VoteUpdateTopology{}, LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS);
    }
    // a second report of the current establishment (reports of no current establishment
    // are ignored: act_stale_report())
    if (sp.wait == Wait::kReported) options.emplace_back(p::P2PReport{sp.establish_epoch, {}}, usage);
    // collectives: not accepted, in a topology vote or establishment, or a tag in flight
    if (!sp.accepted) {
      options.emplace_back(p::CollectiveInit{1 + rng_() % 3, kDescriptor}, not_accepted);
    } else if (sp.wait == Wait::kTopologyVote || sp.wait == Wait::kEstablish || sp.wait == Wait::kReported ||
               sp.wait == Wait::kSyncVote || sp.wait == Wait::kSyncing) {
      options.emplace_back(p::CollectiveInit{1 + rng_() % 3, kDescriptor}, usage);
    }
    // shared-state sync: not accepted, in another vote or transfer, collectives in
    // flight, or a malformed vote; a second report of its transfers
    const p::SyncVote vote{p::SyncStrategy::kEnforcePopular, 1, shapes_.at(sp.group)};
    if (!sp.accepted) {
      options.emplace_back(vote, not_accepted);
    } else if (sp.wait != Wait::kNone) {
      options.emplace_back(vote, usage);
    } else if (!sp.collectives.empty()) {
      options.emplace_back(vote, LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS);
    } else {
      p::SyncVote bad = vote;
      switch (rng_() % 3) {
        case 0: bad.tensors.push_back(bad.tensors.front()); break;  // a key twice
        case 1: bad.tensors.front().dtype = 200; break;              // no such dtype
        default: bad.tensors.front().count = std::uint64_t{1} << 62; break;  // too large
      }
      options.emplace_back(bad, LOCKSTEP_STATUS_INVALID_ARGUMENT);
    }
    if (sp.wait == Wait::kSyncing && sp.sync_done_sent) {
      options.emplace_back(p::SyncDone{sp.plan.attempt, LOCKSTEP_OK, {}}, usage);
    }
    for (const auto& [tag, c] : sp.collectives) {
      if (sp.accepted && sp.wait != Wait::kTopologyVote) options.emplace_back(p::CollectiveInit{tag, kDescriptor}, usage);
      if (c.performing && c.done_sent) options.emplace_back(p::CollectiveDone{tag, c.attempt, true, {}}, usage);
    }
    const auto& [m, status] = pick(options);
    request(sp, m, /*legal=*/false, std::nullopt, status);
  }

  // Messages a peer never sends the master. (A switch, not a braced list of conversions
  // to the variant: GCC 12 runs out of memory on such a list.)
  static p::Message forbidden_message(std::uint64_t which) {
    switch (which) {
      case 0: return p::Hello{};
      case 1: return p::Welcome{};
      case 2: return p::HeartbeatAck{};
      case 3: return p::EstablishP2P{};
      case 4: return p::TopologyResult{};
      case 5: return p::PeersPendingResult{};
      case 6: return p::AgreeResult{};
      case 7: return p::Refused{};
      case 8: return p::Goodbye{};
      case 9: return p::P2PHello{};
      case 10: return p::P2PHelloAck{};
      case 11: return p::CollectiveGo{};
      case 12: return p::CollectiveResult{};
      case 13: return p::SyncPlan{};
      case 14: return p::SyncResult{};
      case 15: return p::StateRequest{};
      default: return p::StateResponse{};
    }
  }

  void act_forbidden(SimPeer& sp) {
    const p::Message m = forbidden_message(rng_() % 17);
    sp.last_sent_ms = now_;
    note("t=" + std::to_string(now_) + " " + name(sp) + " sends forbidden " + describe(m) + "\n");
    Outbox out;
    c_.on_message(sp.conn, m, now_, out);
    Expect expect;
    expect.goodbye = {sp.conn, LOCKSTEP_STATUS_PROTOCOL_ERROR};
    absorb(out, expect);
  }

  void act_disconnect(SimPeer& sp) {
    note("t=" + std::to_string(now_) + " " + name(sp) + " disconnects\n");
    mark_closed(sp);
    Outbox out;
    c_.on_disconnect(sp.conn, "reset", now_, out);
    absorb(out, {});
  }

  void act_protocol_error(SimPeer& sp) {
    note("t=" + std::to_string(now_) + " " + name(sp) + " sends an undecodable frame\n");
    Outbox out;
    c_.on_protocol_error(sp.conn, "bad frame", now_, out);
    Expect expect;
    expect.goodbye = {sp.conn, LOCKSTEP_STATUS_PROTOCOL_ERROR};
    absorb(out, expect);
  }

  // The operator evicts the peer (lockstep-status --evict): kicked like a silent one.
  void act_evict(SimPeer& sp) {
    note("t=" + std::to_string(now_) + " the operator evicts " + name(sp) + "\n");
    Outbox out;
    require(c_.on_evict(sp.id, "by the simulated operator", now_, out), "a welcomed open peer was not found to evict");
    Expect expect;
    expect.goodbye = {sp.conn, LOCKSTEP_STATUS_KICKED};
    absorb(out, expect);
  }

  // Events for connections that are already gone must change nothing.
  void act_dead_connection() {
    std::vector<SimPeer*> dead;
    for (auto& [conn, sp] : peers_) {
      if (!sp.open) dead.push_back(&sp);
    }
    if (dead.empty()) return;
    SimPeer& sp = *pick(dead);
    const std::string before = c_.digest();
    Outbox out;
    switch (rng_() % 4) {
      case 0: c_.on_message(sp.conn, p::VoteAgree{true}, now_, out); break;
      case 1: c_.on_disconnect(sp.conn, "late", now_, out); break;
      case 2: require(!c_.on_evict(sp.id, "late", now_, out), "a closed peer was found to evict"); break;
      default: c_.on_protocol_error(sp.conn, "late", now_, out); break;
    }
    note("t=" + std::to_string(now_) + " late event for closed " + name(sp) + "\n");
    require(out.empty(), "an event for a closed connection produced commands");
    require(c_.digest() == before, "an event for a closed connection changed the state");
    check_after_step();
  }

  void send_heartbeat(SimPeer& sp) {
    const std::string before = c_.digest();
    sp.last_sent_ms = now_;
    Outbox out;
    c_.on_message(sp.conn, p::Heartbeat{}, now_, out);
    note("t=" + std::to_string(now_) + " " + name(sp) + " heartbeat\n");
    std::size_t sends = 0;
    for (const auto& cmd : expanded(out)) {
      if (const auto* s = std::get_if<Send>(&cmd)) {
        ++sends;
        require(s->conn == sp.conn && std::holds_alternative<p::HeartbeatAck>(s->message),
                "a heartbeat produced something other than its HeartbeatAck: " + describe(s->message));
      }
      require(!std::holds_alternative<Close>(cmd), "a heartbeat closed a connection");
    }
    require(sends == 1, "a heartbeat was not answered exactly once");
    require(c_.digest() == before, "a heartbeat changed the decision state");
    check_after_step();
  }

  // Sends a request; a legal one puts the peer into `next` before the coordinator answers.
  // A legal request moves the peer into `next` (when given) before the coordinator
  // answers; an illegal one must be refused with `refused_status` and change nothing.
  void request(SimPeer& sp, const p::Message& m, bool legal, std::optional<Wait> next = std::nullopt,
               StatusCode refused_status = LOCKSTEP_STATUS_INVALID_USAGE) {
    sp.last_sent_ms = now_;
    const std::string before = c_.digest();
    note("t=" + std::to_string(now_) + " " + name(sp) + " [" + to_string(sp.wait) + (sp.accepted ? ", accepted" : "") +
         "] sends " + describe(m) + (legal ? "" : " (illegal)") + "\n");
    if (legal && next) {
      sp.wait = *next;
      sp.waiting_since_ms = now_;
      if (*next == Wait::kAgree) {
        auto& round = agree_rounds_[sp.group];
        if (!round.open) round = AgreeRound{true, false};
      }
    }
    Outbox out;
    c_.on_message(sp.conn, m, now_, out);
    if (!legal) {
      std::size_t sends = 0;
      for (const auto& cmd : expanded(out)) {
        if (const auto* s = std::get_if<Send>(&cmd)) {
          ++sends;
          const auto* refused = std::get_if<p::Refused>(&s->message);
          require(s->conn == sp.conn && refused != nullptr,
                  "an illegal " + describe(m) + " was answered with " + describe(s->message) + " to conn " +
                      std::to_string(s->conn));
          require(refused->request == p::type_of(m), "Refused names the wrong request");
          require(refused->status == refused_status, std::string("Refused with ") + status_name(refused->status) +
                                                         ", expected " + status_name(refused_status) + " for " +
                                                         describe(m) + " (" + refused->reason + ")");
          if (const auto* init = std::get_if<p::CollectiveInit>(&m)) {
            require(refused->tag == init->tag, "Refused names the wrong tag");
          }
        }
        require(!std::holds_alternative<Close>(cmd), "an illegal request closed a connection");
      }
      require(sends == 1, "an illegal request was not refused exactly once");
      require(c_.digest() == before, "a refused request changed the decision state:\nbefore " + before + "\nafter  " + c_.digest());
      ++stats_.refused;
      note(describe_out(out));
      check_after_step();
      return;
    }
    Expect expect;
    expect.legal_from = sp.conn;
    absorb(out, expect);
  }

  // Time passes; live peers keep sending heartbeats, silent ones do not.
  void act_time() {
    const TimeMs hb = c_.config().heartbeat_timeout_ms;
    TimeMs dt = 1 + static_cast<TimeMs>(rng_() % static_cast<std::uint64_t>(hb / 2));
    if (chance(3)) dt = 0;
    for (SimPeer* sp : open_peers(true)) {
      if (!sp->silent && now_ + dt - sp->last_sent_ms >= hb / 2) send_heartbeat(*sp);
    }
    now_ += dt;
    note("t=" + std::to_string(now_) + " tick (+" + std::to_string(dt) + " ms)\n");
    Outbox out;
    c_.on_tick(now_, out);
    absorb(out, {});
    check_deadlines();
    // A run that started with a relay loses it now and then and gets one back (the
    // lockstep-relay processes come and go): decided by the time, not by another draw,
    // so that every seed's draws stay as they were.
    if (c_.config().relay && (now_ / 7'919) % 2 == static_cast<TimeMs>(c_.relay())) {
      note("t=" + std::to_string(now_) + (c_.relay() ? " the run loses its relay\n" : " the run gets a relay again\n"));
      Outbox changed;
      c_.on_relay_change(!c_.relay(), now_, changed);
      absorb(changed, {});
    }
  }

  // After a tick every deadline that has passed has been acted on.
  void check_deadlines() {
    const Config& config = c_.config();
    for (const auto& [conn, sp] : peers_) {
      if (!sp.open) continue;
      if (!sp.welcomed) {
        require(now_ - sp.connected_ms < config.handshake_timeout_ms,
                name(sp) + " is still connected without a finished handshake after the handshake timeout");
        continue;
      }
      require(now_ - sp.last_sent_ms < config.heartbeat_timeout_ms,
              name(sp) + " has been silent past the heartbeat timeout and is still in the run");
    }
    bool establishing = false;
    for (const auto& [conn, sp] : peers_) {
      establishing |= sp.open && (sp.wait == Wait::kEstablish || sp.wait == Wait::kReported);
    }
    if (establishing) {
      require(now_ - establish_started_ms_ < config.establish_timeout_ms,
              "an establishment is still undecided after the establish timeout");
    }
    if (config.vote_timeout_ms == 0) return;
    // a vote in which a live peer has waited for the whole timeout has no free stragglers left
    for (const auto& [conn, voter] : peers_) {
      if (!voter.open || !voter.accepted) continue;
      if (voter.wait != Wait::kTopologyVote && voter.wait != Wait::kPending && voter.wait != Wait::kAgree &&
          voter.wait != Wait::kSyncVote) {
        continue;
      }
      if (now_ - voter.waiting_since_ms < config.vote_timeout_ms) continue;
      for (const auto& [conn2, other] : peers_) {
        if (!other.open || !other.accepted || other.wait != Wait::kNone) continue;
        if ((voter.wait == Wait::kAgree || voter.wait == Wait::kSyncVote) && other.group != voter.group) continue;
        // a peer with collectives in flight may not join a topology or sync vote: it is
        // busy, not a straggler (its collectives end, then it may vote)
        if ((voter.wait == Wait::kTopologyVote || voter.wait == Wait::kSyncVote) && !other.collectives.empty()) continue;
        // freed by this very event (its own vote just ended): the next tick decides
        if (other.free_since_ms == now_) continue;
        fail(name(voter) + " has waited in its " + to_string(voter.wait) + " vote for " +
             std::to_string(now_ - voter.waiting_since_ms) + " ms, past the vote timeout, but straggler " + name(other) +
             " is still in the run");
      }
    }
  }

  void mark_closed(SimPeer& sp) {
    if (!sp.open) return;
    sp.open = false;
    if (sp.accepted) {
      dirty_ = true;
      // a participant lost while its group's agree round is open fails that round,
      // unless the vote timeout removed it so that the others could decide
      auto& round = agree_rounds_[sp.group];
      if (round.open && !sp.straggler) round.lost = true;
    }
  }

  static bool closes(const Outbox& out, ConnId conn) {
    return std::any_of(out.begin(), out.end(), [&](const Command& c) {
      const auto* close = std::get_if<Close>(&c);
      return close != nullptr && close->conn == conn;
    });
  }

  std::string describe_out(const Outbox& out) const {
    std::ostringstream s;
    for (const auto& cmd : expanded(out)) {
      if (const auto* send = std::get_if<Send>(&cmd)) {
        s << "    -> conn " << send->conn << ": " << describe(send->message) << "\n";
      } else if (const auto* close = std::get_if<Close>(&cmd)) {
        s << "    close conn " << close->conn << " (" << close->reason << ")\n";
      } else {
        s << "    event: " << std::get<Event>(cmd).text << "\n";
      }
    }
    return s.str();
  }

  // ------------------------------------------------------------ checking an outbox

  struct Expect {
    std::optional<std::pair<ConnId, StatusCode>> goodbye;  // this conn must get this Goodbye and a Close
    std::optional<ConnId> welcome;                          // this conn must be welcomed
    std::optional<ConnId> legal_from;                       // this conn's request was legal: no Refused
  };

  // Applies what the coordinator sent to the simulated peers, checking each message
  // against what the peer could legitimately receive, then the per-batch rules.
  void absorb(const Outbox& batch, const Expect& expect) {
    const Outbox out = expanded(batch);
    note(describe_out(out));
    closed_in_batch_.clear();
    std::set<ConnId>& closed_here = closed_in_batch_;
    std::set<ConnId> goodbye_here;
    struct GroupResult {
      std::uint64_t epoch;
      std::vector<p::MemberInfo> ring;
      p::Attributes attributes;
    };
    std::map<std::uint32_t, GroupResult> ok_results;            // per group
    std::map<std::uint32_t, p::EstablishP2P> establish_by_group;
    std::set<PeerId> establish_recipients;
    std::optional<std::uint64_t> establish_epoch;
    std::optional<std::pair<StatusCode, bool>> pending_result;
    std::map<std::uint32_t, std::pair<StatusCode, bool>> agree_results;
    std::map<std::uint32_t, std::vector<std::pair<SimPeer*, bool>>> agree_voters;  // recipient and its flag
    std::map<std::uint64_t, std::set<ConnId>> failed_results;  // epoch -> recipients of UPDATE_TOPOLOGY_FAILED
    bool welcomed = false;
    bool mismatch = false;
    bool topology_updated = false;
    struct Go {
      p::CollectiveGo go;
      std::vector<PeerId> ring;  // as its recipients read it: their view less the absent
    };
    std::map<std::pair<std::uint32_t, std::uint64_t>, Go> gos;                            // (group, tag)
    std::map<std::pair<std::uint32_t, std::uint64_t>, p::CollectiveResult> coll_results;  // (group, tag)
    // Shared state: the decisions of this batch per group (checked against the election
    // over the votes as they stood before it), and the outcomes per attempt.
    std::map<std::uint32_t, SyncBatch> sync_batches;
    std::map<std::uint64_t, std::pair<StatusCode, std::uint64_t>> sync_outcomes;  // attempt -> status, revision
    const std::uint64_t attempt_floor = max_attempt_;
    std::map<std::uint32_t, std::map<PeerId, SimPeer*>> voters_before;  // open accepted peers in a sync vote
    std::map<std::uint32_t, std::set<ConnId>> members_before;           // open accepted peers
    if (std::any_of(out.begin(), out.end(), is_sync_decision)) {
      for (auto& [conn, sp] : peers_) {
        if (!sp.open || !sp.accepted) continue;
        members_before[sp.group].insert(conn);
        if (sp.wait == Wait::kSyncVote) voters_before[sp.group][sp.id] = &sp;
      }
    }

    for (const auto& cmd : out) {
      if (const auto* close = std::get_if<Close>(&cmd)) {
        auto it = peers_.find(close->conn);
        require(it != peers_.end(), "Close for an unknown connection " + std::to_string(close->conn));
        require(it->second.open || closed_here.count(close->conn) == 0, "a connection was closed twice");
        require(it->second.open, "Close for a connection that was already gone: " + name(it->second));
        closed_here.insert(close->conn);
        mark_closed(it->second);
        continue;
      }
      const auto* send = std::get_if<Send>(&cmd);
      if (send == nullptr) continue;
      auto it = peers_.find(send->conn);
      require(it != peers_.end(), "message to an unknown connection " + std::to_string(send->conn));
      SimPeer& sp = it->second;
      require(sp.open, "message to a closed connection: " + name(sp) + ": " + describe(send->message));
      const p::Message& m = send->message;
      if (const auto* welcome = std::get_if<p::Welcome>(&m)) {
        require(sp.hello_sent && !sp.welcomed, "Welcome without a Hello, or twice");
        require(expect.welcome == sp.conn, "a Hello that had to be rejected was welcomed");
        require(welcome->observed_host == sp.observed_host, "Welcome names the wrong observed host");
        require(welcome->heartbeat_timeout_ms == c_.config().heartbeat_timeout_ms, "Welcome names the wrong timeout");
        for (const auto& [conn, other] : peers_) {
          require(!other.welcomed || other.id != welcome->id, "a PeerId was given out twice");
        }
        sp.welcomed = true;
        sp.id = welcome->id;
        welcomed = true;
      } else if (std::holds_alternative<p::HeartbeatAck>(m)) {
        require(sp.welcomed, "HeartbeatAck to a peer that is not welcomed");
      } else if (const auto* est = std::get_if<p::EstablishP2P>(&m)) {
        require(sp.welcomed, "EstablishP2P before Welcome");
        require((sp.accepted && sp.wait == Wait::kTopologyVote) || (!sp.accepted && sp.wait == Wait::kNone),
                "EstablishP2P to " + name(sp) + " waiting for " + to_string(sp.wait) +
                    (sp.accepted ? " (accepted)" : " (registered)"));
        require(est->epoch == c_.epoch(), "EstablishP2P of an old epoch");
        require(!establish_epoch || *establish_epoch == est->epoch, "two establishments in one batch");
        establish_epoch = est->epoch;
        establish_started_ms_ = now_;
        require(std::any_of(est->ring.begin(), est->ring.end(), [&](const p::MemberInfo& mi) { return mi.id == sp.id; }),
                "EstablishP2P ring without the recipient");
        auto [g, inserted] = establish_by_group.emplace(sp.group, *est);
        require(inserted || g->second == *est, "members of one group got different EstablishP2P rings");
        establish_recipients.insert(sp.id);
        sp.wait = Wait::kEstablish;
        sp.establish_epoch = est->epoch;
        sp.establish_ring = est->ring;
      } else if (const auto* result = std::get_if<p::TopologyResult>(&m)) {
        require(sp.welcomed, "TopologyResult before Welcome");
        if (result->status == LOCKSTEP_OK) {
          require(sp.wait == Wait::kReported,
                  "TopologyResult OK to " + name(sp) + " waiting for " + to_string(sp.wait) + " (it never reported)");
          require(result->epoch == sp.establish_epoch, "TopologyResult of another epoch than the establishment");
          require(ids(result->ring) == ids(sp.establish_ring), "the accepted ring differs from the proposed ring");
          require(result->ring == sp.establish_ring, "the accepted ring's addresses differ from the proposed ones");
          auto [g, inserted] = ok_results.emplace(sp.group, GroupResult{result->epoch, result->ring, result->attributes});
          require(inserted || (g->second.epoch == result->epoch && g->second.ring == result->ring &&
                               g->second.attributes == result->attributes),
                  "members of group " + std::to_string(sp.group) + " got different membership views");
          if (!sp.accepted) {
            ++stats_.accepted;
            sp.accepted_epoch = result->epoch;
          }
          sp.accepted = true;
          sp.view_epoch = result->epoch;
          sp.view_size = result->ring.size();
          sp.view = ids(result->ring);
          dirty_ = false;
          ++stats_.topology_ok;
          topology_updated = true;
        } else if (sp.wait == Wait::kTopologyVote) {
          require(result->status == LOCKSTEP_STATUS_OPERATION_MISMATCH,
                  std::string("a topology voter got ") + status_name(result->status) + " before any establishment");
          on_mismatch(mismatch);
        } else {
          require(sp.wait == Wait::kEstablish || sp.wait == Wait::kReported,
                  "TopologyResult " + std::string(status_name(result->status)) + " to " + name(sp) + " waiting for " +
                      to_string(sp.wait));
          require(result->status == LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED,
                  std::string("a failed establishment reported ") + status_name(result->status));
          require(result->epoch == sp.establish_epoch, "failure of another epoch than the establishment");
          failed_results[result->epoch].insert(sp.conn);
          ++stats_.topology_failed;
        }
        sp.wait = Wait::kNone;
        sp.free_since_ms = now_;
      } else if (const auto* pending = std::get_if<p::PeersPendingResult>(&m)) {
        require(sp.wait == Wait::kPending, "PeersPendingResult to " + name(sp) + " waiting for " + to_string(sp.wait));
        require(sp.accepted, "PeersPendingResult to a registered peer");
        const auto value = std::make_pair(pending->status, pending->pending);
        require(!pending_result || *pending_result == value, "are-peers-pending answers differ within one round");
        pending_result = value;
        if (pending->status == LOCKSTEP_OK) {
          bool registered = false;
          for (const auto& [conn, other] : peers_) registered |= other.open && other.welcomed && !other.accepted;
          require(pending->pending == (registered || dirty_),
                  std::string("are-peers-pending answered ") + (pending->pending ? "yes" : "no") + " with registered=" +
                      (registered ? "yes" : "no") + " and a departed accepted peer=" + (dirty_ ? "yes" : "no"));
          ++(pending->pending ? stats_.pending_yes : stats_.pending_no);
        } else {
          require(pending->status == LOCKSTEP_STATUS_OPERATION_MISMATCH,
                  std::string("are-peers-pending failed with ") + status_name(pending->status));
          on_mismatch(mismatch);
        }
        sp.wait = Wait::kNone;
        sp.free_since_ms = now_;
      } else if (const auto* agree = std::get_if<p::AgreeResult>(&m)) {
        require(sp.wait == Wait::kAgree, "AgreeResult to " + name(sp) + " waiting for " + to_string(sp.wait));
        const auto value = std::make_pair(agree->status, agree->status == LOCKSTEP_OK ? agree->value : false);
        auto [g, inserted] = agree_results.emplace(sp.group, value);
        require(inserted || g->second == value, "agree results differ within group " + std::to_string(sp.group));
        agree_voters[sp.group].emplace_back(&sp, sp.agree_flag);
        if (agree->status != LOCKSTEP_STATUS_OPERATION_MISMATCH) {
          const AgreeRound round = agree_rounds_[sp.group];
          require(round.open, "an agree result for a round that is not open");
          require((agree->status == LOCKSTEP_STATUS_PEER_CONNECTION_LOST) == round.lost,
                  round.lost ? "an agree round that lost a participant did not fail"
                             : "an agree round failed although no participant was lost");
        }
        if (agree->status == LOCKSTEP_OK) {
          ++stats_.agree_ok;
        } else if (agree->status == LOCKSTEP_STATUS_PEER_CONNECTION_LOST) {
          ++stats_.agree_lost;
        } else {
          require(agree->status == LOCKSTEP_STATUS_OPERATION_MISMATCH,
                  std::string("agree failed with ") + status_name(agree->status));
          on_mismatch(mismatch);
        }
        sp.wait = Wait::kNone;
        sp.free_since_ms = now_;
      } else if (const auto* refused = std::get_if<p::Refused>(&m)) {
        require(expect.legal_from != sp.conn,
                "a request the peer's knowledge makes legal was refused: " + std::string(p::msg_type_name(refused->request)) +
                    " (" + refused->reason + ")");
        fail("unexpected Refused to " + name(sp));
      } else if (const auto* go = std::get_if<p::CollectiveGo>(&m)) {
        require(sp.accepted, "CollectiveGo to a registered peer");
        auto c = sp.collectives.find(go->tag);
        require(c != sp.collectives.end() && !c->second.performing,
                "CollectiveGo for tag " + std::to_string(go->tag) + " to " + name(sp) + " that did not start it");
        require(go->epoch == sp.view_epoch, "CollectiveGo names the view of epoch " + std::to_string(go->epoch) +
                                                " where " + name(sp) + " has that of " + std::to_string(sp.view_epoch));
        std::vector<PeerId> ring;
        for (const auto& id : sp.view) {
          if (std::find(go->absent.begin(), go->absent.end(), id) == go->absent.end()) ring.push_back(id);
        }
        require(ring.size() + go->absent.size() == sp.view.size(), "CollectiveGo names an absent peer outside the view");
        auto [g, inserted] = gos.emplace(std::make_pair(sp.group, go->tag), Go{*go, ring});
        require(inserted || g->second.go == *go, "members of a group got different CollectiveGo for one tag");
        require(std::find(ring.begin(), ring.end(), sp.id) != ring.end(), "CollectiveGo ring without the recipient");
        c->second.performing = true;
        c->second.attempt = go->attempt;
        c->second.ring = ring;
        max_attempt_ = std::max(max_attempt_, go->attempt);
      } else if (const auto* abort = std::get_if<p::CollectiveAbort>(&m)) {
        const auto c = sp.collectives.find(abort->tag);
        const bool mine = c != sp.collectives.end() && c->second.performing && c->second.attempt == abort->attempt;
        require(mine || sp.committed.count({abort->tag, abort->attempt}) != 0,
                "CollectiveAbort of an attempt " + name(sp) + " does not perform");
        if (mine) c->second.aborted = true;
        ++stats_.collective_aborts;
      } else if (const auto* late = std::get_if<p::CollectiveResult>(&m);
                 late != nullptr && sp.committed.count({late->tag, late->attempt}) != 0) {
        // It returned on its commit: the outcome can only confirm it.
        require(late->status == LOCKSTEP_OK, name(sp) + " committed attempt " + std::to_string(late->attempt) +
                                                 " and then got " + status_name(late->status));
        auto [g, inserted] = coll_results.emplace(std::make_pair(sp.group, late->tag), *late);
        require(inserted || g->second == *late, "participants of a collective got different outcomes");
        sp.committed.erase({late->tag, late->attempt});
      } else if (const auto* outcome = std::get_if<p::CollectiveResult>(&m)) {
        auto c = sp.collectives.find(outcome->tag);
        require(c != sp.collectives.end(),
                "CollectiveResult for tag " + std::to_string(outcome->tag) + " to " + name(sp) + " that did not start it");
        auto [g, inserted] = coll_results.emplace(std::make_pair(sp.group, outcome->tag), *outcome);
        require(inserted || g->second == *outcome, "participants of a collective got different outcomes");
        if (outcome->status == LOCKSTEP_STATUS_OPERATION_MISMATCH) {
          require(!c->second.performing && outcome->attempt == 0, "a descriptor mismatch after the attempt started");
        } else if (outcome->status == LOCKSTEP_STATUS_TOO_FEW_PEERS) {
          require(!c->second.performing && outcome->attempt == 0, "TOO_FEW_PEERS after the attempt started");
          const auto* self = c_.find_peer(sp.id);
          require(self == nullptr || c_.ring(self->group).size() <= 1, "TOO_FEW_PEERS in a group of several");
        } else {
          require(c->second.performing && outcome->attempt == c->second.attempt,
                  "a collective outcome for an attempt the peer was not told to perform");
          require(outcome->world_size == c->second.ring.size(), "the outcome's world size is not the ring's");
          require(outcome->status == LOCKSTEP_OK || outcome->status == LOCKSTEP_STATUS_PEER_CONNECTION_LOST,
                  std::string("a collective ended with ") + status_name(outcome->status));
          // Success only where every participant holds the result (the lost ones
          // included: they may have committed before they went); failure never after
          // a commit.
          if (outcome->status == LOCKSTEP_OK) {
            const auto& holders = holders_[outcome->attempt];
            for (const auto& id : c->second.ring) {
              require(holders.count(id) != 0 || c_.find_peer(id) == nullptr,
                      "a collective succeeded while participant " + id.to_string() + " does not hold the result");
            }
          } else {
            require(committed_.count(outcome->attempt) == 0,
                    "attempt " + std::to_string(outcome->attempt) + " failed after a participant committed it");
          }
        }
        ++(outcome->status == LOCKSTEP_OK ? stats_.collectives_ok : stats_.collectives_failed);
        sp.collectives.erase(c);
        // Its last collective ended (at once, for a peer left alone): from now on it may vote.
        if (sp.collectives.empty()) sp.free_since_ms = now_;
      } else if (const auto* plan = std::get_if<p::SyncPlan>(&m)) {
        require(sp.accepted && sp.wait == Wait::kSyncVote,
                "SyncPlan to " + name(sp) + " waiting for " + to_string(sp.wait) + " (it did not vote to sync)");
        require(plan->attempt > attempt_floor, "a SyncPlan reuses attempt number " + std::to_string(plan->attempt));
        SyncBatch& b = sync_batches[sp.group];
        if (!b.plans.empty()) {
          const p::SyncPlan& first = b.plans.begin()->second;
          require(first.attempt == plan->attempt && first.revision == plan->revision,
                  "the participants of one sync got plans with different attempts or revisions");
        }
        for (const auto& [other_group, other] : sync_batches) {
          require(other_group == sp.group || other.plans.empty() || other.plans.begin()->second.attempt != plan->attempt,
                  "two groups' syncs got the same attempt number");
        }
        b.plans[sp.conn] = *plan;
        SyncAttempt& a = sync_attempts_[plan->attempt];
        a.group = sp.group;
        a.revision = plan->revision;
        a.participants.insert(sp.id);
        max_attempt_ = std::max(max_attempt_, plan->attempt);
        sp.plan = *plan;
        sp.sync_done_sent = false;
        sp.wait = Wait::kSyncing;
      } else if (const auto* sync_result = std::get_if<p::SyncResult>(&m)) {
        absorb_sync_result(sp, *sync_result, sync_batches, sync_outcomes, mismatch);
      } else if (const auto* goodbye = std::get_if<p::Goodbye>(&m)) {
        require(goodbye_here.insert(sp.conn).second, "two Goodbyes to one connection");
        require(!goodbye->reason.empty(), "a Goodbye without a reason");
        if (expect.goodbye && expect.goodbye->first == sp.conn) {
          require(goodbye->status == expect.goodbye->second,
                  std::string("Goodbye ") + status_name(goodbye->status) + ", expected " + status_name(expect.goodbye->second));
        }
        if (goodbye->reason.find("did not report") != std::string::npos) ++stats_.establish_timeouts;
        if (goodbye->reason.find("could not be established") != std::string::npos) ++stats_.blamed;
        if (goodbye->reason.find("heartbeat") != std::string::npos) {
          ++stats_.heartbeat_kicks;
          require(now_ - sp.last_sent_ms >= c_.config().heartbeat_timeout_ms,
                  "a peer that sent within the heartbeat timeout was removed for silence");
        }
        if (goodbye->reason.find("vote timeout") != std::string::npos) {
          ++stats_.straggler_kicks;
          check_straggler(sp, goodbye->reason);
          sp.straggler = true;
        }
        switch (goodbye->status) {
          case LOCKSTEP_STATUS_KICKED: ++stats_.kicked; break;
          case LOCKSTEP_STATUS_REJECTED: ++stats_.rejected; break;
          case LOCKSTEP_STATUS_PROTOCOL_ERROR: ++stats_.protocol_errors; break;
          case LOCKSTEP_STATUS_REVISION_VIOLATION:
          case LOCKSTEP_STATUS_SHARED_STATE_MISMATCH: {
            const bool violation = goodbye->status == LOCKSTEP_STATUS_REVISION_VIOLATION;
            require(sp.accepted && sp.wait == Wait::kSyncVote,
                    std::string("Goodbye ") + status_name(goodbye->status) + " to " + name(sp) + " waiting for " +
                        to_string(sp.wait) + " (it did not vote to sync)");
            SyncBatch& b = sync_batches[sp.group];
            (violation ? b.violators : b.misfits).insert(sp.conn);
            ++(violation ? stats_.revision_violations : stats_.state_mismatches);
            break;
          }
          default: fail(std::string("Goodbye with status ") + status_name(goodbye->status));
        }
      } else {
        fail("the coordinator sent a peer-to-master message: " + describe(m));
      }
    }

    // ---- per-batch rules
    for (const auto& [group, b] : sync_batches) {
      check_sync_decision(group, b, voters_before[group], members_before[group], closed_here);
    }
    for (const auto& [attempt, outcome] : sync_outcomes) check_sync_outcome(attempt, outcome.first, outcome.second);
    for (const auto& [group, value] : agree_results) agree_rounds_[group] = AgreeRound{};
    // A successful update topology starts a new step for everyone: a failed agree round
    // that nobody waits in any more ends with it.
    if (topology_updated) {
      for (auto& [group, round] : agree_rounds_) {
        const bool waiting = std::any_of(peers_.begin(), peers_.end(), [&, g = group](const auto& entry) {
          return entry.second.open && entry.second.group == g && entry.second.wait == Wait::kAgree;
        });
        if (!waiting) round = AgreeRound{};
      }
    }
    for (auto& [group, round] : agree_rounds_) {
      // a round whose group has no accepted member left ends without a result
      const bool members = std::any_of(peers_.begin(), peers_.end(), [&, g = group](const auto& entry) {
        return entry.second.open && entry.second.accepted && entry.second.group == g;
      });
      if (!members) round = AgreeRound{};
    }
    if (mismatch) {
      // every vote failed: nobody may still be waiting in one
      agree_rounds_.clear();
      for (const auto& [conn, sp] : peers_) {
        require(!(sp.open && in_vote(sp.wait)),
                "after a vote mismatch " + name(sp) + " still waits in its " + to_string(sp.wait) + " vote");
      }
    }
    for (ConnId conn : goodbye_here) require(closed_here.count(conn) != 0, "a Goodbye without a Close");
    if (expect.goodbye) {
      require(goodbye_here.count(expect.goodbye->first) != 0 && closed_here.count(expect.goodbye->first) != 0,
              "conn " + std::to_string(expect.goodbye->first) + " was not sent its Goodbye and closed");
    }
    if (expect.welcome) require(welcomed, "a valid Hello was not welcomed");

    // One decision for all: every accepted member of a group got the same view, and it
    // is the coordinator's ring; attributes agree with the coordinator's.
    for (const auto& [group, result] : ok_results) {
      require(ids(result.ring) == c_.ring(group), "the membership view sent differs from coordinator.ring()");
      require(result.attributes == c_.attributes(group), "the attributes sent differ from coordinator.attributes()");
      for (const auto& [conn, sp] : peers_) {
        if (sp.open && sp.accepted && sp.group == group) {
          require(sp.view_epoch == result.epoch, "accepted " + name(sp) + " did not get the new view of its group");
        }
      }
    }
    if (!ok_results.empty()) {
      // a success reaches every group's accepted peers, not only the groups with newcomers
      for (const auto& [conn, sp] : peers_) {
        if (sp.open && sp.accepted) require(ok_results.count(sp.group) != 0, "a group missed the topology result");
      }
    }
    // A failed establishment is reported to every participant still connected.
    for (const auto& [epoch, recipients] : failed_results) {
      for (const auto& [conn, sp] : peers_) {
        if (sp.open && sp.establish_epoch == epoch && (sp.wait == Wait::kEstablish || sp.wait == Wait::kReported)) {
          fail("participant " + name(sp) + " of failed epoch " + std::to_string(epoch) + " got no result");
        }
      }
    }
    // A new establishment includes every peer of the run, with rings made of the
    // group's accepted ring followed by its newcomers in join order; where peers that
    // accept no inbound connection take part, newcomers are placed between others
    // instead (and some may be rejected), the accepted peers keeping their order.
    if (establish_epoch) {
      std::set<PeerId> everyone;
      for (const auto& [id, peer] : c_.peers()) everyone.insert(id);
      require(establish_recipients == everyone, "an establishment did not include every peer of the run");
      for (const auto& [group, est] : establish_by_group) {
        std::vector<PeerId> want = c_.ring(group);
        std::vector<PeerId> newcomers;
        for (const auto& [id, peer] : c_.peers()) {
          if (peer.group == group && peer.phase == Phase::kRegistered) newcomers.push_back(id);
        }
        std::sort(newcomers.begin(), newcomers.end());
        const std::vector<PeerId> accepted = want;
        want.insert(want.end(), newcomers.begin(), newcomers.end());
        const bool placed = std::any_of(want.begin(), want.end(), [&](PeerId id) { return by_id(id)->no_inbound; });
        if (!placed) {
          require(ids(est.ring) == want, "the proposed ring of group " + std::to_string(group) +
                                             " is not the accepted ring followed by the newcomers in join order");
        } else {
          std::vector<PeerId> kept;
          for (const auto& mi : est.ring) {
            if (std::find(accepted.begin(), accepted.end(), mi.id) != accepted.end()) kept.push_back(mi.id);
            require(std::find(want.begin(), want.end(), mi.id) != want.end(),
                    "the proposed ring names a peer that is neither accepted nor registered");
          }
          require(kept == accepted, "the proposed ring of group " + std::to_string(group) +
                                        " does not keep the accepted peers in their order");
          for (const PeerId& id : want) {
            const bool in = std::any_of(est.ring.begin(), est.ring.end(), [&](const auto& mi) { return mi.id == id; });
            require(in || by_id(id)->no_inbound, "a newcomer that accepts connections was left out of the ring");
          }
        }
        for (const auto& mi : est.ring) {
          const SimPeer* owner = by_id(mi.id);
          require(owner != nullptr, "the ring names an unknown peer");
          require(mi == member_info(*owner), "the ring carries a wrong address for " + mi.id.to_string());
        }
      }
    }
    // collectives: a started attempt runs on the group's current ring, is sent to all of
    // it, and uses a pool slot every participant has; an outcome reaches everyone.
    for (const auto& [key, started] : gos) {
      const auto& [group, tag] = key;
      const p::CollectiveGo& go = started.go;
      require(started.ring == c_.ring(group), "a collective attempt's ring is not the group's ring");
      std::uint16_t pool = 0xffff;
      for (const auto& id : started.ring) {
        const SimPeer* member = by_id(id);
        require(member != nullptr && member->open, "a collective ring names a peer that is gone");
        const auto c = member->collectives.find(tag);
        require(c != member->collectives.end() && c->second.performing && c->second.attempt == go.attempt,
                "participant " + member->id.to_string() + " did not get the CollectiveGo");
        pool = std::min(pool, member->pool_size);
      }
      require(go.slot < pool, "a collective runs on a pool slot some participant does not have");
    }
    for (const auto& [key, result] : coll_results) {
      const auto& [group, tag] = key;
      for (const auto& [conn, sp] : peers_) {
        if (!sp.open || sp.group != group) continue;
        const auto c = sp.collectives.find(tag);
        if (c == sp.collectives.end()) continue;
        require(result.attempt == 0 ? c->second.performing : c->second.attempt != result.attempt,
                name(sp) + " did not get the outcome of tag " + std::to_string(tag));
      }
    }
    // agree: a successful round's value is the AND of every voter's flag, and every
    // accepted member of the group voted.
    for (const auto& [group, value] : agree_results) {
      if (value.first != LOCKSTEP_OK) continue;
      bool all = true;
      std::set<ConnId> voters;
      for (const auto& [sp, flag] : agree_voters[group]) {
        all = all && flag;
        voters.insert(sp->conn);
      }
      require(value.second == all, "agree value is not the AND of the flags");
      for (const auto& [conn, sp] : peers_) {
        if (sp.open && sp.accepted && sp.group == group) {
          require(voters.count(conn) != 0, "an agree round succeeded without accepted member " + name(sp));
        }
      }
    }
    check_after_step();
  }

  // Rule 1: the vote timeout removes an accepted peer that holds up a vote others
  // wait in. It must be free to join that vote (not in an establishment, where votes
  // are refused, nor blocked in another vote: that is a mismatch, not a straggler), and
  // a live peer must be waiting in that vote.
  // Open, or removed by the same event (stragglers are chosen together, then removed).
  bool live_in_batch(const SimPeer& sp) const { return sp.open || closed_in_batch_.count(sp.conn) != 0; }

  void check_straggler(const SimPeer& sp, const std::string& reason) {
    require(c_.config().vote_timeout_ms != 0, "removed by a vote timeout that is off");
    require(sp.accepted, "a registered peer removed as a vote straggler");
    require(sp.wait != Wait::kEstablish && sp.wait != Wait::kReported,
            "a peer in a p2p establishment (where it may not vote) was removed as a vote straggler: " + reason);
    TimeMs longest = -1;
    if (const auto at = reason.find("collective tag "); at != std::string::npos) {
      // a collective's initiate vote: joinable unless the peer is in a topology vote
      const std::uint64_t tag = std::strtoull(reason.c_str() + at + 15, nullptr, 10);
      require(sp.wait != Wait::kTopologyVote,
              "a peer in the topology vote (where it may not start a collective) was removed as a straggler of the "
              "collective vote instead of the votes failing with OPERATION_MISMATCH: " + reason);
      require(sp.collectives.count(tag) == 0, "a peer that started the tag was removed as its straggler");
      for (const auto& [conn, other] : peers_) {
        if (!live_in_batch(other) || !other.accepted || other.group != sp.group) continue;
        const auto c = other.collectives.find(tag);
        if (c != other.collectives.end() && !c->second.performing) longest = std::max(longest, now_ - c->second.voted_ms);
      }
    } else {
      require(sp.wait == Wait::kNone,
              "a peer waiting in another vote (" + std::string(to_string(sp.wait)) +
                  ") was removed as a straggler instead of the votes failing with OPERATION_MISMATCH: " + reason);
      Wait kind = Wait::kAgree;
      if (reason.find("update-topology") != std::string::npos) kind = Wait::kTopologyVote;
      if (reason.find("are-peers-pending") != std::string::npos) kind = Wait::kPending;
      if (reason.find("shared-state sync") != std::string::npos) {
        kind = Wait::kSyncVote;
        ++stats_.sync_stragglers;
      }
      if (kind == Wait::kTopologyVote || kind == Wait::kSyncVote) {
        require(sp.collectives.empty(),
                "a peer with a collective in flight (which may not vote to update the topology or sync) was removed "
                "as a straggler of that vote instead of waiting for its collectives: " + reason);
      }
      for (const auto& [conn, other] : peers_) {
        if (!live_in_batch(other) || !other.accepted || other.wait != kind) continue;
        if ((kind == Wait::kAgree || kind == Wait::kSyncVote) && other.group != sp.group) continue;
        longest = std::max(longest, now_ - other.waiting_since_ms);
      }
    }
    // (the deadline counts from the vote's first voter, who may be gone since: only
    // the existence of a live voter is checked, not how long it waited)
    require(longest >= 0, "removed as a straggler of a vote in which no live peer waits: " + reason);
  }

  // Blocked in a control vote (a barrier) rather than free or in a transfer.
  static bool in_vote(Wait w) {
    return w == Wait::kTopologyVote || w == Wait::kPending || w == Wait::kAgree || w == Wait::kSyncVote;
  }

  // The first OPERATION_MISMATCH of a batch: the votes could never have completed,
  // i.e. every live accepted peer was blocked in a vote, and not all in one that
  // completes by itself.
  void on_mismatch(bool& seen) {
    ++stats_.mismatches;
    if (seen) return;
    seen = true;
    std::set<Wait> kinds;
    for (const auto& [conn, sp] : peers_) {
      if (!sp.open || !sp.accepted) continue;
      require(in_vote(sp.wait),
              "OPERATION_MISMATCH while " + name(sp) + " was still free to join a vote (" + to_string(sp.wait) + ")");
      kinds.insert(sp.wait);
    }
    require(kinds.size() > 1, "OPERATION_MISMATCH although every accepted peer waited in the same kind of vote");
  }

  static std::vector<PeerId> ids(const std::vector<p::MemberInfo>& ring) {
    std::vector<PeerId> v;
    for (const auto& m : ring) v.push_back(m.id);
    return v;
  }

  const SimPeer* by_id(PeerId id) const {
    for (const auto& [conn, sp] : peers_) {
      if (sp.welcomed && sp.id == id) return &sp;
    }
    return nullptr;
  }

  // ------------------------------------------------------------ shared-state checks

  static bool is_sync_decision(const Command& cmd) {
    const auto* send = std::get_if<Send>(&cmd);
    if (send == nullptr) return false;
    if (std::holds_alternative<p::SyncPlan>(send->message)) return true;
    if (const auto* r = std::get_if<p::SyncResult>(&send->message)) {
      return r->attempt == 0 && r->status == LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE;
    }
    if (const auto* g = std::get_if<p::Goodbye>(&send->message)) {
      return g->status == LOCKSTEP_STATUS_REVISION_VIOLATION || g->status == LOCKSTEP_STATUS_SHARED_STATE_MISMATCH;
    }
    return false;
  }

  static const p::TensorEntry* find_tensor(const std::vector<p::TensorEntry>& tensors, const std::string& key) {
    for (const auto& t : tensors) {
      if (t.key == key) return &t;
    }
    return nullptr;
  }

  // What the election compares: the revision and every tensor's key, dtype, count and
  // digest (without the digest for a tensor that allows inequality), whatever the order.
  static std::string content_key(const p::SyncVote& vote) {
    std::vector<std::string> parts;
    for (const auto& t : vote.tensors) {
      std::ostringstream part;
      part << t.key << ':' << int{t.dtype} << ':' << t.count << ':';
      if (t.allow_content_inequality) {
        part << '*';
      } else {
        part << t.hash.hi << '/' << t.hash.lo;
      }
      parts.push_back(part.str());
    }
    std::sort(parts.begin(), parts.end());
    std::string key = std::to_string(vote.revision);
    for (const auto& part : parts) key += "|" + part;
    return key;
  }

  // Same keys, and each with the same dtype and count.
  static bool same_shape(const std::vector<p::TensorEntry>& a, const std::vector<p::TensorEntry>& b) {
    if (a.size() != b.size()) return false;
    for (const auto& t : a) {
      const p::TensorEntry* u = find_tensor(b, t.key);
      if (u == nullptr || u->dtype != t.dtype || u->count != t.count) return false;
    }
    return true;
  }

  p::MemberInfo member_info(const SimPeer& sp) const {
    if (sp.no_inbound) return p::MemberInfo{sp.id, sp.member_host, 0, 0, 0};
    return p::MemberInfo{sp.id, sp.member_host, sp.port, static_cast<std::uint16_t>(sp.port + 1),
                         static_cast<std::uint16_t>(sp.port + 2)};
  }

  // The election, written from the rules: voters above R+1 leave (and the election runs
  // again without them); candidates are the non-receive-only voters at R+1 (at the first
  // sync: all of them); the content held by most candidates wins, a tie goes to the
  // earliest-accepted holder; voters that cannot hold it, and send-only voters that do
  // not hold it, leave (and it runs again); then every voter is a participant.
  Election elect(std::uint32_t group, std::map<PeerId, SimPeer*> voters) const {
    Election e;
    const std::optional<std::uint64_t> last = known_revision(group);
    while (!voters.empty()) {
      std::vector<PeerId> leaving;
      for (const auto& [id, sp] : voters) {
        if (last && sp->sync_vote.revision > *last + 1) leaving.push_back(id);
      }
      if (!leaving.empty()) {
        for (const auto& id : leaving) {
          e.violators.insert(voters.at(id)->conn);
          voters.erase(id);
        }
        continue;
      }
      struct Holders {
        std::size_t count = 0;
        std::pair<std::uint64_t, PeerId> earliest;  // (accepting epoch, id)
        const SimPeer* first = nullptr;
      };
      std::map<std::string, Holders> popularity;
      for (const auto& [id, sp] : voters) {
        const p::SyncVote& v = sp->sync_vote;
        if (v.strategy == p::SyncStrategy::kReceiveOnly || (last && v.revision != *last + 1)) continue;
        Holders& h = popularity[content_key(v)];
        const auto rank = std::make_pair(sp->accepted_epoch, id);
        if (h.count == 0 || rank < h.earliest) {
          h.earliest = rank;
          h.first = sp;
        }
        ++h.count;
      }
      if (popularity.empty()) {
        for (const auto& [id, sp] : voters) e.unavailable.insert(sp->conn);
        break;
      }
      const Holders* winner = nullptr;
      std::string winning;
      for (const auto& [key, h] : popularity) {
        if (winner == nullptr || h.count > winner->count || (h.count == winner->count && h.earliest < winner->earliest)) {
          winner = &h;
          winning = key;
        }
      }
      const p::SyncVote& reference = winner->first->sync_vote;
      for (const auto& [id, sp] : voters) {
        const p::SyncVote& v = sp->sync_vote;
        if (!same_shape(v.tensors, reference.tensors) ||
            (v.strategy == p::SyncStrategy::kSendOnly && content_key(v) != winning)) {
          leaving.push_back(id);
        }
      }
      if (!leaving.empty()) {
        for (const auto& id : leaving) {
          e.misfits.insert(voters.at(id)->conn);
          voters.erase(id);
        }
        continue;
      }
      e.revision = reference.revision;
      e.representative = winner->first->id;
      e.elected = reference.tensors;
      for (const auto& [id, sp] : voters) {
        const p::SyncVote& v = sp->sync_vote;
        e.participants.insert(sp->conn);
        std::vector<p::SyncExpect>& expect = e.expect[sp->conn];
        const bool up_to_date = v.revision == e.revision;
        for (std::uint32_t i = 0; i < v.tensors.size(); ++i) {
          const p::TensorEntry& t = v.tensors[i];
          const p::TensorEntry& target = *find_tensor(reference.tensors, t.key);
          if (t.hash == target.hash) {
            if (up_to_date && v.strategy != p::SyncStrategy::kReceiveOnly) e.distributors[t.key].insert(id);
            continue;
          }
          if (t.allow_content_inequality && up_to_date) continue;
          expect.push_back(p::SyncExpect{i, target.hash});
        }
      }
      break;
    }
    return e;
  }

  // A batch decided a group's sync vote: it was complete (every accepted peer of the
  // group voted), and its removals, plans or "no shared state" are the election's.
  void check_sync_decision(std::uint32_t group, const SyncBatch& b, const std::map<PeerId, SimPeer*>& voters_before,
                           const std::set<ConnId>& members_before, const std::set<ConnId>& closed_here) {
    const std::string g = "group " + std::to_string(group);
    // peers removed by this batch for other reasons (before the decision) were not voters
    const auto counts = [&](ConnId conn) {
      return closed_here.count(conn) == 0 || b.violators.count(conn) != 0 || b.misfits.count(conn) != 0;
    };
    std::map<PeerId, SimPeer*> voters;
    std::set<ConnId> voting, members;
    for (const auto& [id, sp] : voters_before) {
      if (!counts(sp->conn)) continue;
      voters.emplace(id, sp);
      voting.insert(sp->conn);
    }
    for (const ConnId conn : members_before) {
      if (counts(conn)) members.insert(conn);
    }
    require(voting == members, g + "'s sync vote was decided before every accepted peer of the group voted");
    const Election e = elect(group, voters);
    const auto list = [&](const std::set<ConnId>& conns) {
      std::string s;
      for (const ConnId conn : conns) {
        s += ' ';
        s += name(peers_.at(conn));
      }
      return "[" + s + " ]";
    };
    require(b.violators == e.violators, g + ": removed for revision violations " + list(b.violators) +
                                            ", the revision rule removes " + list(e.violators));
    require(b.misfits == e.misfits, g + ": removed for shared-state mismatches " + list(b.misfits) +
                                        ", the election removes " + list(e.misfits));
    require(b.unavailable == e.unavailable, g + ": told no shared state is available " + list(b.unavailable) +
                                                ", the election says so to " + list(e.unavailable));
    std::set<ConnId> planned;
    for (const auto& [conn, plan] : b.plans) planned.insert(conn);
    require(planned == e.participants, g + ": plans sent to " + list(planned) + ", participants are " + list(e.participants));
    if (!b.violators.empty() || !b.misfits.empty()) ++stats_.sync_decisions_with_removals;
    stats_.sync_unavailable += static_cast<int>(!b.unavailable.empty());
    if (b.plans.empty()) return;

    const std::optional<std::uint64_t> last = known_revision(group);
    std::map<std::string, state::Digest> targets;  // one elected content: the same digest per key for all
    for (const auto& [conn, plan] : b.plans) {
      const SimPeer& sp = peers_.at(conn);
      const std::string who = name(sp);
      require(!last || plan.revision == *last + 1, g + " elected revision " + std::to_string(plan.revision) +
                                                       " after revision " + std::to_string(*last));
      require(plan.revision == e.revision, "the plan for " + who + " names revision " + std::to_string(plan.revision) +
                                               ", the election gives " + std::to_string(e.revision));
      for (const auto& x : plan.expect) {
        require(x.tensor < sp.sync_vote.tensors.size(), "the plan for " + who + " expects a tensor it does not have");
        const p::TensorEntry& t = sp.sync_vote.tensors[x.tensor];
        require(t.hash != x.hash, "the plan for " + who + " makes it receive tensor '" + t.key + "' that it holds");
        const auto [it, fresh] = targets.emplace(t.key, x.hash);
        require(fresh || it->second == x.hash, g + ": plans expect different digests of tensor '" + t.key + "'");
      }
      const std::vector<p::SyncExpect>& want = e.expect.at(conn);
      if (plan.expect != want) {
        std::ostringstream s;
        s << "the plan for " << who << " expects [";
        for (const auto& x : plan.expect) s << " " << x.tensor << ":" << x.hash.lo;
        s << " ], the election (content of " << e.representative.to_string() << ") gives [";
        for (const auto& x : want) s << " " << x.tensor << ":" << x.hash.lo;
        s << " ]";
        fail(s.str());
      }
      check_fetches(sp, plan, e);
      stats_.sync_receivers += static_cast<int>(!plan.expect.empty());
    }
    SyncAttempt& a = sync_attempts_.at(b.plans.begin()->second.attempt);
    a.elected = e.elected;
  }

  // Every piece lies inside its tensor, the pieces of each expected tensor cover it
  // exactly once, nothing else is fetched, and every source is another participant that
  // presented the elected revision with the target digest and is not receive-only.
  void check_fetches(const SimPeer& sp, const p::SyncPlan& plan, const Election& e) {
    const std::string who = "the plan for " + name(sp);
    std::set<std::uint32_t> expected;
    for (const auto& x : plan.expect) {
      require(expected.insert(x.tensor).second, who + " expects tensor " + std::to_string(x.tensor) + " twice");
    }
    std::set<PeerId> listed;
    for (const auto& source : plan.sources) {
      require(listed.insert(source.id).second, who + " lists source " + source.id.to_string() + " twice");
    }
    std::map<std::uint32_t, std::vector<std::pair<std::uint64_t, std::uint64_t>>> pieces;
    std::map<std::uint32_t, std::set<PeerId>> sources_of;
    for (const auto& f : plan.fetches) {
      require(expected.count(f.tensor) != 0, who + " fetches tensor " + std::to_string(f.tensor) + " it does not expect");
      const p::TensorEntry& t = sp.sync_vote.tensors[f.tensor];
      const std::uint64_t size = t.count * dtype_bytes(t.dtype);
      require(f.bytes > 0 && f.offset < size && f.bytes <= size - f.offset,
              who + " fetches bytes [" + std::to_string(f.offset) + ", +" + std::to_string(f.bytes) + ") of tensor '" +
                  t.key + "' of " + std::to_string(size) + " bytes");
      require(f.source < plan.sources.size(), who + " names a source it does not list");
      const p::MemberInfo& source = plan.sources[f.source];
      require(source.id != sp.id, who + " fetches from itself");
      const auto d = e.distributors.find(t.key);
      require(d != e.distributors.end() && d->second.count(source.id) != 0,
              who + " fetches tensor '" + t.key + "' from " + source.id.to_string() +
                  ", which is not a participant holding its target at the elected revision (or is receive-only)");
      const SimPeer* owner = by_id(source.id);
      require(owner != nullptr && source == member_info(*owner), who + " carries a wrong address for " + source.id.to_string());
      // Two peers that accept no inbound connection are paired only through a relay, and
      // only where no holder that accepts connections holds the tensor.
      const bool relayed = c_.relay() && std::none_of(d->second.begin(), d->second.end(), [&](PeerId id) {
                             const SimPeer* holder = by_id(id);
                             return holder != nullptr && !holder->no_inbound;
                           });
      require(!owner->no_inbound || !sp.no_inbound || relayed,
              who + " fetches from " + source.id.to_string() + " while neither accepts inbound connections" +
                  (c_.relay() ? " and a holder that accepts them holds the tensor" : " (no relay)"));
      pieces[f.tensor].emplace_back(f.offset, f.bytes);
      sources_of[f.tensor].insert(source.id);
    }
    for (const std::uint32_t index : expected) {
      const p::TensorEntry& t = sp.sync_vote.tensors[index];
      auto& list = pieces[index];
      std::sort(list.begin(), list.end());
      std::uint64_t at = 0;
      for (const auto& [offset, bytes] : list) {
        require(offset == at, who + ": the pieces of tensor '" + t.key + "' overlap or leave a gap at byte " + std::to_string(at));
        at += bytes;
      }
      require(at == t.count * dtype_bytes(t.dtype), who + ": the pieces of tensor '" + t.key + "' do not cover it");
      stats_.sync_split_fetches += static_cast<int>(sources_of[index].size() > 1);
    }
  }

  void absorb_sync_result(SimPeer& sp, const p::SyncResult& r, std::map<std::uint32_t, SyncBatch>& batches,
                          std::map<std::uint64_t, std::pair<StatusCode, std::uint64_t>>& outcomes, bool& mismatch) {
    const std::string what = std::string("SyncResult ") + status_name(r.status) + " attempt " + std::to_string(r.attempt);
    if (r.attempt == 0) {
      // decided before any transfer: no shared state available, or a vote mismatch
      require(sp.accepted && sp.wait == Wait::kSyncVote, what + " to " + name(sp) + " waiting for " + to_string(sp.wait));
      if (r.status == LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE) {
        batches[sp.group].unavailable.insert(sp.conn);
      } else {
        require(r.status == LOCKSTEP_STATUS_OPERATION_MISMATCH, what + ": a sync vote cannot end that way");
        ++stats_.sync_mismatches;
        on_mismatch(mismatch);
      }
    } else {
      require(sp.wait == Wait::kSyncing && sp.plan.attempt == r.attempt,
              what + " to " + name(sp) + " waiting for " + to_string(sp.wait) + " (plan attempt " +
                  std::to_string(sp.plan.attempt) + ")");
      SyncAttempt& a = sync_attempts_.at(r.attempt);
      const auto [o, first] = outcomes.emplace(r.attempt, std::make_pair(r.status, r.revision));
      require(first || o->second == std::make_pair(r.status, r.revision),
              "the participants of sync attempt " + std::to_string(r.attempt) + " got different outcomes");
      if (r.status == LOCKSTEP_OK) {
        require(r.revision == a.revision, what + " names revision " + std::to_string(r.revision) +
                                              ", the plans named " + std::to_string(a.revision));
        for (const PeerId& id : a.participants) {
          require(a.ok.count(id) != 0, what + " before participant " + id.to_string() + " reported OK");
        }
        // the peer adopts the elected revision and the expected digests
        sp.held = sp.sync_vote.tensors;
        for (const auto& x : sp.plan.expect) sp.held[x.tensor].hash = x.hash;
        sp.held_revision = r.revision;
        sp.synced = true;
      } else if (first) {
        if (a.failure) {
          require(r.status == *a.failure, what + " after a report that must give " + status_name(*a.failure));
        } else {
          require(r.status == LOCKSTEP_STATUS_PEER_CONNECTION_LOST, what + ": a transfer cannot fail that way");
          bool lost = false;
          for (const PeerId& id : a.participants) {
            const SimPeer* participant = by_id(id);
            lost |= participant == nullptr || !participant->open;
          }
          require(lost, what + " although every participant is there and none reported a failure");
        }
      }
    }
    sp.wait = Wait::kNone;
    sp.free_since_ms = now_;
  }

  // An attempt ended: every participant still there got its outcome; after success R is
  // the elected revision (R+1 of the previous one) and every participant holds the same
  // tensors, the elected ones (apart from tensors that allow inequality).
  void check_sync_outcome(std::uint64_t attempt, StatusCode status, std::uint64_t revision) {
    const SyncAttempt a = sync_attempts_.at(attempt);
    sync_attempts_.erase(attempt);
    const std::string what = "sync attempt " + std::to_string(attempt) + " of group " + std::to_string(a.group);
    std::vector<const SimPeer*> holders;
    for (const PeerId& id : a.participants) {
      const SimPeer* sp = by_id(id);
      if (sp == nullptr || !sp->open) continue;
      require(!(sp->wait == Wait::kSyncing && sp->plan.attempt == attempt), what + ": " + name(*sp) + " got no outcome");
      holders.push_back(sp);
    }
    if (status != LOCKSTEP_OK) {
      ++stats_.syncs_failed;
      stats_.syncs_hash_mismatch += static_cast<int>(status == LOCKSTEP_STATUS_HASH_MISMATCH);
      return;
    }
    ++stats_.syncs_ok;
    require(holders.size() == a.participants.size(), what + " succeeded without all of its participants");
    const std::optional<std::uint64_t> last = known_revision(a.group);
    require(!last || revision == *last + 1, what + " moved the group from revision " + std::to_string(*last) + " to " +
                                                std::to_string(revision));
    const auto canonical = [](std::vector<p::TensorEntry> tensors) {
      for (auto& t : tensors) {
        if (t.allow_content_inequality) t.hash = {};
      }
      std::sort(tensors.begin(), tensors.end(), [](const auto& x, const auto& y) { return x.key < y.key; });
      return tensors;
    };
    const auto elected = canonical(a.elected);
    for (const SimPeer* sp : holders) {
      require(sp->held_revision == revision, what + ": " + name(*sp) + " is not at the elected revision");
      require(canonical(sp->held) == elected, what + ": " + name(*sp) + " does not hold the elected tensors afterwards");
    }
    revisions_[a.group] = revision;
    group_state_[a.group] = a.elected;
    shapes_[a.group] = a.elected;  // the model definition the group now has (for newcomers)
  }

  // ------------------------------------------------------------ after every step

  void check_after_step() {
    if (auto broken = c_.check_invariants()) fail("invariant broken: " + *broken);
    // the model and the coordinator agree on who is there and in which phase
    std::size_t open_welcomed = 0;
    for (const auto& [conn, sp] : peers_) {
      if (!sp.open || !sp.welcomed) continue;
      ++open_welcomed;
      const Peer* peer = c_.find_peer(sp.id);
      require(peer != nullptr, "the coordinator forgot " + name(sp) + " without telling it");
      require(peer->conn == conn, "the coordinator maps a peer to another connection");
      require((peer->phase == Phase::kAccepted) == sp.accepted, "the phase of " + name(sp) + " differs from what it was told");
    }
    require(open_welcomed == c_.peers().size(), "the coordinator holds peers that were told they are gone");

    std::vector<const SimPeer*> accepted;
    for (const auto& [conn, sp] : peers_) {
      if (sp.open && sp.accepted) accepted.push_back(&sp);
    }
    // One major operation per group: the accepted peers of a group are all in the
    // establishment or none is.
    std::map<std::uint32_t, std::set<bool>> establishing;
    for (const SimPeer* sp : accepted) {
      const bool in = sp->wait == Wait::kEstablish || sp->wait == Wait::kReported;
      establishing[sp->group].insert(in);
      require((c_.major_op(sp->group) == MajorOp::kUpdateTopology) == in, "major_op disagrees with the establishment");
    }
    for (const auto& [group, set] : establishing) require(set.size() == 1, "a group is half in an establishment");
    for (const SimPeer* sp : accepted) {
      if (sp->wait == Wait::kEstablish || sp->wait == Wait::kReported) {
        for (const SimPeer* other : accepted) {
          require(other->group != sp->group || other->collectives.empty(),
                  "a group runs a collective during an update topology");
        }
      }
    }
    // Collectives: a tag every accepted member of the group started is started (or
    // failed) at once; a running attempt that lost a participant was aborted for every
    // participant that had not reported.
    std::map<std::pair<std::uint32_t, std::uint64_t>, std::size_t> tag_votes;
    std::map<std::uint32_t, std::size_t> group_size;
    for (const SimPeer* sp : accepted) {
      ++group_size[sp->group];
      for (const auto& [tag, c] : sp->collectives) {
        if (!c.performing) ++tag_votes[{sp->group, tag}];
        if (!c.performing) continue;
        for (const auto& id : c.ring) {
          const SimPeer* member = by_id(id);
          require((member != nullptr && member->open) || c.aborted || c.done_sent,
                  "attempt " + std::to_string(c.attempt) + " lost participant " + id.to_string() +
                      " and was not aborted for " + name(*sp));
        }
      }
    }
    for (const auto& [key, votes] : tag_votes) {
      require(votes < group_size[key.first], "every member of group " + std::to_string(key.first) + " started tag " +
                                                 std::to_string(key.second) + " and it did not start");
    }

    // Progress: votes that every live accepted peer has joined are decided at once.
    if (!accepted.empty()) {
      const bool all_voting = std::all_of(accepted.begin(), accepted.end(), [](const SimPeer* sp) { return in_vote(sp->wait); });
      require(!all_voting, "every accepted peer waits in a vote and nothing was decided");
      std::map<std::uint32_t, bool> group_all_agree;
      for (const SimPeer* sp : accepted) {
        auto [it, inserted] = group_all_agree.emplace(sp->group, true);
        it->second = it->second && sp->wait == Wait::kAgree;
      }
      for (const auto& [group, all] : group_all_agree) {
        require(!all, "every accepted peer of group " + std::to_string(group) + " voted agree and nothing was decided");
      }
    }
    // Shared-state syncs, per group: the accepted peers are all in one transfer or none
    // is; a transfer that lost a participant has failed; one whose participants all
    // reported is decided; a vote that every accepted peer joined is decided at once; the
    // coordinator's revision is the one the peers were told.
    std::map<std::uint32_t, std::vector<const SimPeer*>> members_of;
    for (const SimPeer* sp : accepted) members_of[sp->group].push_back(sp);
    for (const auto& [group, members] : members_of) {
      std::size_t syncing = 0, voting = 0, reported = 0;
      for (const SimPeer* sp : members) {
        syncing += sp->wait == Wait::kSyncing;
        voting += sp->wait == Wait::kSyncVote;
        reported += sp->wait == Wait::kSyncing && sp->sync_done_sent;
      }
      const std::string g = std::to_string(group);
      require(syncing == 0 || syncing == members.size(), "group " + g + " is half in a shared-state transfer");
      require((c_.major_op(group) == MajorOp::kSharedStateSync) == (syncing != 0),
              "major_op disagrees with the shared-state transfer of group " + g);
      require(voting < members.size(), "every accepted peer of group " + g + " voted to sync and nothing was decided");
      // a collective vote can never start while a peer of the group is in a sync or
      // update-topology vote (that peer may not join it): it has failed at once
      const bool major_vote = std::any_of(members.begin(), members.end(), [](const SimPeer* sp) {
        return sp->wait == Wait::kSyncVote || sp->wait == Wait::kTopologyVote;
      });
      for (const SimPeer* sp : members) {
        for (const auto& [tag, c] : sp->collectives) {
          require(!major_vote || c.performing, "tag " + std::to_string(tag) + " of " + name(*sp) +
                                                   " is still voted on while a peer of its group waits in a sync or "
                                                   "topology vote");
        }
      }
      if (syncing == 0) continue;
      const std::uint64_t attempt = members.front()->plan.attempt;
      const auto a = sync_attempts_.find(attempt);
      require(a != sync_attempts_.end(), "group " + g + " transfers in an attempt that was never planned");
      for (const SimPeer* sp : members) {
        require(sp->plan.attempt == attempt, "group " + g + " runs two sync attempts at once");
        require(a->second.participants.count(sp->id) != 0, name(*sp) + " transfers without being a participant");
      }
      for (const PeerId& id : a->second.participants) {
        const SimPeer* participant = by_id(id);
        require(participant != nullptr && participant->open,
                "sync attempt " + std::to_string(attempt) + " lost participant " + id.to_string() + " and still runs");
      }
      require(reported < members.size(), "every participant of sync attempt " + std::to_string(attempt) +
                                              " reported OK and the sync was not decided");
    }
    for (const std::uint32_t group : groups_) {
      require(c_.revision(group) == known_revision(group),
              "coordinator.revision(" + std::to_string(group) + ") differs from the revision the peers were told");
    }
    // Progress: an establishment whose participants all reported is decided at once.
    bool any_participant = false;
    bool any_unreported = false;
    for (const auto& [conn, sp] : peers_) {
      if (!sp.open) continue;
      if (sp.wait == Wait::kEstablish || sp.wait == Wait::kReported) any_participant = true;
      if (sp.wait == Wait::kEstablish) any_unreported = true;
    }
    require(!any_participant || any_unreported, "every participant reported and the establishment was not decided");
    // An empty run admits its registered peers without a vote.
    if (accepted.empty() && !any_participant) {
      for (const auto& [conn, sp] : peers_) {
        require(!(sp.open && sp.welcomed), "registered " + name(sp) + " waits in a run without accepted peers");
      }
    }
  }

  std::uint64_t seed_;
  std::mt19937_64 rng_;
  Coordinator c_;
  std::vector<std::uint32_t> groups_;
  std::size_t max_open_ = 8;
  std::map<ConnId, SimPeer> peers_;
  ConnId next_conn_ = 1;
  TimeMs now_ = 0;
  int step_ = 0;
  bool dirty_ = false;  // an accepted peer left since the last successful update
  std::set<ConnId> closed_in_batch_;  // connections closed by the outbox being absorbed
  TimeMs establish_started_ms_ = 0;
  struct AgreeRound {
    bool open = false;  // a vote arrived and no result was sent since
    bool lost = false;  // an accepted member of the group was lost meanwhile
  };
  std::map<std::uint32_t, AgreeRound> agree_rounds_;
  // shared state
  std::map<std::uint32_t, std::vector<p::TensorEntry>> shapes_;       // each group's tensors (for newcomers)
  std::map<std::uint32_t, std::uint64_t> revisions_;                  // R per group, as the peers were told
  std::map<std::uint32_t, std::vector<p::TensorEntry>> group_state_;  // the elected tensors at R (a "checkpoint")
  std::map<std::uint64_t, SyncAttempt> sync_attempts_;                // planned and not yet ended
  std::uint64_t max_attempt_ = 0;                                     // the last attempt number given out
  // Collective attempts: the participants that hold the result, and those committed.
  std::map<std::uint64_t, std::set<PeerId>> holders_;
  std::set<std::uint64_t> committed_;
  std::deque<std::string> log_;
  bool verbose_ = env_u64("LOCKSTEP_SIM_VERBOSE").value_or(0) != 0;
  Stats stats_;
};

TEST(CoordinatorRandom, SeededRuns) {
  const int steps = static_cast<int>(env_u64("LOCKSTEP_SIM_STEPS").value_or(3000));
  std::vector<std::uint64_t> seeds;
  if (auto one = env_u64("LOCKSTEP_SIM_SEED")) {
    seeds.push_back(*one);
  } else {
    const std::uint64_t n = env_u64("LOCKSTEP_SIM_SEEDS").value_or(300);
    for (std::uint64_t s = 1; s <= n; ++s) seeds.push_back(s);
  }
  std::vector<std::uint64_t> failed;
  Sim::Stats total;
  for (std::uint64_t seed : seeds) {
    Sim sim(seed);
    const std::string failure = sim.run(steps);
    if (!failure.empty()) {
      if (failed.size() < 3) ADD_FAILURE() << failure;
      failed.push_back(seed);
    }
    const auto& s = sim.stats();
    total.accepted += s.accepted;
    total.topology_ok += s.topology_ok;
    total.topology_failed += s.topology_failed;
    total.mismatches += s.mismatches;
    total.agree_ok += s.agree_ok;
    total.agree_lost += s.agree_lost;
    total.pending_yes += s.pending_yes;
    total.pending_no += s.pending_no;
    total.refused += s.refused;
    total.kicked += s.kicked;
    total.rejected += s.rejected;
    total.protocol_errors += s.protocol_errors;
    total.heartbeat_kicks += s.heartbeat_kicks;
    total.straggler_kicks += s.straggler_kicks;
    total.establish_timeouts += s.establish_timeouts;
    total.blamed += s.blamed;
    total.collectives_ok += s.collectives_ok;
    total.collectives_failed += s.collectives_failed;
    total.collective_commits += s.collective_commits;
    total.collective_aborts += s.collective_aborts;
    total.syncs_ok += s.syncs_ok;
    total.syncs_failed += s.syncs_failed;
    total.syncs_hash_mismatch += s.syncs_hash_mismatch;
    total.sync_unavailable += s.sync_unavailable;
    total.sync_mismatches += s.sync_mismatches;
    total.revision_violations += s.revision_violations;
    total.state_mismatches += s.state_mismatches;
    total.sync_stragglers += s.sync_stragglers;
    total.sync_decisions_with_removals += s.sync_decisions_with_removals;
    total.sync_receivers += s.sync_receivers;
    total.sync_split_fetches += s.sync_split_fetches;
  }
  std::ostringstream summary;
  summary << seeds.size() << " seeds x " << steps << " steps: accepted " << total.accepted << ", topology ok "
          << total.topology_ok << " / failed " << total.topology_failed << ", mismatches " << total.mismatches
          << ", agree ok " << total.agree_ok << " / lost " << total.agree_lost << ", pending yes " << total.pending_yes
          << " / no " << total.pending_no << ", refused " << total.refused << ", kicked " << total.kicked
          << ", rejected " << total.rejected << ", protocol errors " << total.protocol_errors << "; removed for silence "
          << total.heartbeat_kicks << ", as vote stragglers " << total.straggler_kicks << ", for not reporting p2p "
          << total.establish_timeouts << ", blamed for p2p failures " << total.blamed << "; collectives ok "
           << total.collectives_ok << " / failed " << total.collectives_failed << " (commits " << total.collective_commits
          << ", aborts " << total.collective_aborts << "); syncs ok " << total.syncs_ok
          << " / failed " << total.syncs_failed << " (hash mismatch " << total.syncs_hash_mismatch
          << "), no shared state available " << total.sync_unavailable << ", sync votes mismatched "
          << total.sync_mismatches << ", decisions with removals " << total.sync_decisions_with_removals
          << " (revision violations " << total.revision_violations << ", shared-state mismatches "
          << total.state_mismatches << "), sync vote stragglers " << total.sync_stragglers << ", receiving plans "
          << total.sync_receivers << ", tensors split over sources " << total.sync_split_fetches;
  std::cout << summary.str() << "\n";
  if (!failed.empty()) {
    std::ostringstream list;
    for (std::size_t i = 0; i < failed.size() && i < 30; ++i) list << (i ? ", " : "") << failed[i];
    ADD_FAILURE() << failed.size() << " of " << seeds.size() << " seeds failed; first ones: " << list.str();
  }
  // the runs must exercise the interesting paths, or they prove little (judged only
  // when every seed ran to the end)
  if (seeds.size() >= 50 && failed.empty()) {
    EXPECT_GT(total.topology_ok, 0);
    EXPECT_GT(total.topology_failed, 0);
    EXPECT_GT(total.mismatches, 0);
    EXPECT_GT(total.agree_ok, 0);
    EXPECT_GT(total.agree_lost, 0);
    EXPECT_GT(total.collective_commits, 0);
    EXPECT_GT(total.collective_aborts, 0);
    EXPECT_GT(total.pending_yes, 0);
    EXPECT_GT(total.pending_no, 0);
    EXPECT_GT(total.refused, 0);
    EXPECT_GT(total.kicked, 0);
    EXPECT_GT(total.rejected, 0);
    EXPECT_GT(total.protocol_errors, 0);
    EXPECT_GT(total.heartbeat_kicks, 0);
    EXPECT_GT(total.straggler_kicks, 0);
    EXPECT_GT(total.establish_timeouts, 0);
    EXPECT_GT(total.blamed, 0);
    EXPECT_GT(total.collectives_ok, 0);
    EXPECT_GT(total.collectives_failed, 0);
    EXPECT_GT(total.syncs_ok, 0);
    EXPECT_GT(total.syncs_failed, 0);
    EXPECT_GT(total.syncs_hash_mismatch, 0);
    EXPECT_GT(total.sync_unavailable, 0);
    EXPECT_GT(total.sync_mismatches, 0);
    EXPECT_GT(total.revision_violations, 0);
    EXPECT_GT(total.state_mismatches, 0);
    EXPECT_GT(total.sync_stragglers, 0);
    EXPECT_GT(total.sync_receivers, 0);
    EXPECT_GT(total.sync_split_fetches, 0);
  }
}

}  // namespace
}  // namespace lockstep::coord
