// The coordinator: the master's whole decision logic as a pure, deterministic state
// machine. Events (a connection opened, a decoded message, a connection closed, a
// protocol violation, a clock tick) go in together with the current time; the new
// state and the commands to carry out (send a message, close a connection, log an
// event) come out. No sockets, threads, clock reads or randomness inside, so a test
// can drive it through any interleaving from a seed and replay it exactly.
//
// What it decides (docs/architecture.md has the diagrams):
//  - each peer's connection phase (REGISTERED -> ACCEPTED) and connection state
//    (IDLE, VOTE_ACCEPT_NEW_PEERS, ESTABLISHING_P2P);
//  - update topology: a run-wide vote of all accepted peers, then p2p establishment
//    with the new ring of each group, then acceptance of the newcomers;
//  - the are-peers-pending vote (run-wide) and agree() (per group), which may overlap
//    collectives and are not major operations;
//  - collectives per group and tag: vote to initiate (descriptors must match), a
//    numbered attempt over the group's ring, vote to complete, one outcome for all;
//  - votes as barriers, the optional vote timeout, and detection of peers blocked in
//    different votes (which can never complete) as OPERATION_MISMATCH;
//  - shared-state sync per group: a vote carrying each peer's revision and tensor
//    digests, the revision rule and the election (semantics rules 5-6), a plan of
//    which pieces each outdated peer fetches from which up-to-date peer (spread over
//    all of them), and one outcome for all (rule 7);
//  - optimize topology (run-wide): a vote, bandwidth tests of the missing edges in
//    rounds of disjoint pairs, the ring solver per group, and a rewiring like update
//    topology that admits nobody;
//  - the key-value store of run metadata (kv_store.h), open to every registered peer;
//  - failure detection: closed connections and heartbeat timeouts;
//  - the ring order (join order) and the membership view per group.
#pragma once

#include "common/ids.h"
#include "common/limits.h"
#include "coordinator/kv_store.h"
#include "protocol/messages.h"
#include "topology/solver.h"

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

namespace lockstep::coord {

using ConnId = std::uint64_t;

struct Config {
  std::uint32_t heartbeat_timeout_ms = limits::kHeartbeatTimeoutMsDefault;
  std::uint32_t vote_timeout_ms = 0;  // 0: off (votes are pure barriers)
  std::uint32_t handshake_timeout_ms = limits::kHandshakeTimeoutMsDefault;
  // Participants of a p2p establishment that have not reported after this long are
  // blamed for the failure (a newcomer is rejected, an accepted peer removed).
  std::uint32_t establish_timeout_ms = limits::kEstablishTimeoutMsDefault;
  // Semantics rule 2 bounded in time: a newcomer that has not reported its p2p
  // connections this long after the establishment began is rejected (and the accepted
  // peers' update topology fails), so that no newcomer holds a run for longer.
  std::uint32_t newcomer_timeout_ms = limits::kNewcomerTimeoutMsDefault;
  std::uint32_t peers_max = limits::kPeersMaxDefault;
  std::uint32_t pending_handshakes_max = limits::kPendingHandshakesMax;
  // Collectives (tags) in flight per group; more initiate votes are refused.
  std::uint32_t collectives_per_group_max = limits::kCollectivesPerGroupMaxDefault;
  // Optimize topology: length of one bandwidth test (both directions at once), the
  // connections it uses (at most the pair's smaller pool), how long a round may take
  // before its silent peers are blamed, and the solver's work budget per optimization
  // and per tick of the background search (deterministic step counts, not time).
  std::uint32_t bandwidth_test_ms = 1000;
  std::uint32_t bandwidth_streams_max = 4;
  std::uint32_t measure_round_timeout_ms = limits::kMeasureRoundTimeoutMsDefault;
  std::uint64_t solver_steps = 20'000'000;
  std::uint64_t background_solver_steps_per_tick = 200'000;
  // The background search rests once this many of its steps found no better ring (a
  // large group's search never proves its ring optimal; it must not take a share of
  // the loop for ever). 500 ticks' worth: about 10 s of the loop.
  std::uint64_t background_solver_stall_steps = 100'000'000;
  // Random bits from the shell: the high half of every PeerId this master gives out.
  std::uint64_t instance_nonce = 0;
  // The key-value store's bounds (lockstep-master --kv-*).
  KvConfig kv{};
  // The run starts with a relay (lockstep-master --relay-port): two peers that both accept
  // no inbound connection may be ring neighbours, their edge relayed, so neither the room
  // rule for such peers nor the removal of such neighbours applies (docs/deployment.md).
  // on_relay_change() says when that changes (lockstep-relay processes come and go).
  bool relay = false;
  // Failover (docs/architecture.md, "Failover"): a master that is asked to take back the
  // peers of a run it does not know waits this long for every peer of their last view,
  // then resumes with a quorum of them: a strict majority of the view (all of a view of
  // one or two), or `recovery_quorum` peers where that is set (above 0; lower is risky:
  // docs/operations.md).
  std::uint32_t recovery_window_ms = limits::kRecoveryWindowMsDefault;
  std::uint32_t recovery_quorum = 0;
  // A master that may replace a lost one (restarted on its address, or a standby taking
  // over) holds the first admission of a run this long from `started_ms` (its start):
  // peers of the lost run, reconnecting, come back to it before newcomers found a new run
  // that would refuse them (lockstep-master --resume-hold-ms). 0: newcomers found a run
  // at once.
  std::uint32_t resume_hold_ms = 0;
  TimeMs started_ms = 0;
  // Above 0: this master's term, fixed from the start (a hot standby's, the revision at
  // which it won its lease: higher than every earlier holder's). 0: 1, or one above the
  // highest term the first peer asking to be taken back had granted.
  std::uint64_t term = 0;
};

enum class Phase { kRegistered, kAccepted };
enum class PeerState {
  kIdle,
  kVoteAcceptNewPeers,
  kEstablishingP2P,
  kVoteSync,
  kSyncing,
  kVoteOptimizeTopology,
  kMeasuringBandwidth
};
// kVoting: a run-wide topology vote (update or optimize) is open.
enum class TopologyPhase { kIdle, kVoting, kMeasuring, kEstablishing };
// The major operation a group is in; at most one at a time (the golden rule).
enum class MajorOp { kNone, kUpdateTopology, kCollective, kSharedStateSync };

const char* to_string(Phase phase);
const char* to_string(PeerState state);
const char* to_string(TopologyPhase phase);
const char* to_string(MajorOp op);

struct Peer {
  ConnId conn = 0;
  PeerId id;
  std::uint32_t group = 0;
  Phase phase = Phase::kRegistered;
  PeerState state = PeerState::kIdle;
  proto::MemberInfo info;
  TimeMs last_seen_ms = 0;
  bool voted_pending = false;
  std::optional<bool> agree_flag;  // voted in the group's agree round (with this flag)
  proto::AgreeMode agree_mode = proto::AgreeMode::kFlag;
  std::vector<std::uint8_t> agree_value;  // the proposal, for the modes that agree on a value
  std::uint64_t accepted_epoch = 0;       // the epoch that accepted it (first-accepted agree)
  bool p2p_reported = false;
  std::vector<PeerId> unreachable;
  std::uint16_t pool_size = 1;
  bool measured = false;  // reported the current bandwidth-test round
  bool resuming = false;  // registered to be taken back by a recovery (failover)
};

// One collective (a tag of a group) from its first initiate vote to its outcome.
struct Collective {
  enum class Phase { kVoting, kPerforming };
  Phase phase = Phase::kVoting;
  TimeMs started_ms = 0;
  std::map<PeerId, proto::CollectiveDescriptor> votes;
  // The voters' contributions when the all-reduce travels with the votes.
  std::map<PeerId, std::vector<std::uint8_t>> contributions;
  // Voters that found their own arguments (or contribution) unusable: the status and
  // why (CollectiveInit::refusal, refusal_status).
  std::map<PeerId, std::pair<StatusCode, std::string>> refusals;
  std::uint64_t attempt = 0;
  std::uint32_t slot = 0;
  std::vector<PeerId> participants;  // ring order
  std::vector<PeerId> sorted_participants;  // the same, sorted (to look a reporter up)
  std::set<PeerId> done;  // reported ok (they hold the result) without a commit
  // Participants lost during the attempt (removed from the run): they get no outcome.
  std::set<PeerId> lost;
  // The attempt can no longer end by commit: the participants that had not reported
  // were told to stop (CollectiveAbort); the outcome comes with the last report.
  bool aborting = false;
  std::string abort_reason;  // a lost participant, for the failure outcome
};

// One shared-state sync of a group, from its first vote to its outcome.
struct SharedStateSync {
  enum class Phase { kVoting, kTransferring };
  Phase phase = Phase::kVoting;
  TimeMs started_ms = 0;
  std::map<PeerId, proto::SyncVote> votes;
  std::uint64_t attempt = 0;
  std::uint64_t revision = 0;        // the elected revision
  std::vector<PeerId> participants;  // ring order
  std::set<PeerId> done;
  std::uint64_t bytes_planned = 0;   // tensor bytes the plan moves
};

// Commands for the IO shell.
struct Send {
  ConnId conn = 0;
  proto::Message message;
};
// Send one message to several connections: an outcome every participant gets alike
// (a CollectiveGo with the ring, a TopologyResult with the view) is built once, and
// the shell encodes it once, not once per peer.
struct Broadcast {
  std::vector<ConnId> conns;
  proto::Message message;
};
// Close the connection after flushing what was queued for it.
struct Close {
  ConnId conn = 0;
  std::string reason;
};
// The operation an event concerns (the label of the master's metrics).
enum class Operation {
  kNone,
  kConnection,        // a connection before its Hello, a registration, a removal
  kUpdateTopology,
  kOptimizeTopology,
  kArePeersPending,
  kAgree,
  kAllReduce,
  kSharedStateSync,
};
// What happened to it. Started, succeeded and failed are the operation counters of
// the master's metrics; the others describe membership and refusals.
enum class EventKind {
  kInfo,           // a step inside an operation (a vote complete, a measurement plan)
  kStarted,        // an attempt began (collective attempt, sync plan, establishment)
  kSucceeded,
  kFailed,
  kRefused,        // a request refused without any change
  kRegistered,     // a peer was given an identity
  kRejected,       // a connection or newcomer was turned away
  kRemoved,        // a peer was removed from the run
  kVoteMismatch,   // every open vote failed: peers wait in different votes
};
const char* to_string(Operation op);
const char* to_string(EventKind kind);
// The ids, space-separated (for logs and digests).
std::string id_list(const std::vector<PeerId>& ids);

// A transition worth logging, with its reason. `text` is the whole line for the log;
// the other fields are the same facts in structured form for the master's status page
// and metrics (docs/observability.md).
struct Event {
  std::string text{};
  bool routine = false;  // an everyday success (logged at debug level)
  EventKind kind = EventKind::kInfo;
  Operation op = Operation::kNone;
  // Why: who failed, which vote was missing, which rule was violated. Empty for a
  // plain success.
  std::string reason{};
  StatusCode status = LOCKSTEP_OK;     // the outcome it announces (failures, removals)
  std::optional<std::uint32_t> group{};  // the group, for group-wide operations
  std::vector<PeerId> peers{};         // the peers it concerns (removed, participants, ring)
  std::uint64_t tag = 0;               // collectives
  std::uint64_t attempt = 0;           // collective and sync attempts
  // For an outcome: when the round began (its first vote), in the coordinator's time,
  // so that the shell can measure how long consensus took.
  std::optional<TimeMs> round_started_ms{};
};

// An operation in progress and where each peer stands in it: the voters and the
// peers it still waits for (a vote is a barrier, so a stalled run shows here whom it
// waits for).
struct OpenRound {
  Operation op = Operation::kNone;
  std::string phase{};                 // "voting", "performing", "establishing", ...
  std::optional<std::uint32_t> group{};  // none for run-wide rounds
  std::uint64_t tag = 0;
  std::uint64_t attempt = 0;
  TimeMs started_ms = 0;
  std::vector<PeerId> done{};     // voted, or reported
  std::vector<PeerId> waiting{};  // not yet
};
using Command = std::variant<Send, Broadcast, Close, Event>;
using Outbox = std::vector<Command>;
// The same commands with each Broadcast replaced by one Send per connection, in order:
// for tests and simulations that follow the messages connection by connection.
Outbox expanded(const Outbox& out);

class Coordinator {
 public:
  explicit Coordinator(Config config);

  // A TCP connection was accepted from observed_host.
  void on_connect(ConnId conn, const std::string& observed_host, TimeMs now_ms, Outbox& out);
  // A well-formed message arrived on conn.
  void on_message(ConnId conn, const proto::Message& message, TimeMs now_ms, Outbox& out);
  // The connection closed (the shell has already forgotten it; no Close is emitted).
  void on_disconnect(ConnId conn, const std::string& reason, TimeMs now_ms, Outbox& out);
  // The shell could not decode what conn sent; the peer is removed and told why.
  void on_protocol_error(ConnId conn, const std::string& reason, TimeMs now_ms, Outbox& out);
  // Time passed: heartbeat, handshake, vote and establishment deadlines.
  void on_tick(TimeMs now_ms, Outbox& out);
  // The operator evicts a peer (lockstep-status --evict, docs/operations.md): it is
  // removed exactly as a peer the master kicks (Goodbye KICKED with the reason, every
  // operation it took part in unwinds for the others). False, and nothing changes, if
  // no such peer is registered or accepted.
  bool on_evict(PeerId id, const std::string& reason, TimeMs now_ms, Outbox& out);
  // The run gained its first relay or lost its last one (a lockstep-relay process
  // registered or was lost, and the master runs none), or (`available` while it has one)
  // another relay took over from the one in use. Losing it: every two ring neighbours
  // that both accept no inbound connection are parted as after a removal (the later one
  // is KICKED), and an establishment that proposed such neighbours fails. A takeover
  // fails such an establishment without blaming anyone: its relayed edges were being
  // made through the relay that is gone.
  void on_relay_change(bool available, TimeMs now_ms, Outbox& out);
  bool relay() const { return relay_; }

  // ---- failover (recovery.cpp)
  // This master's term: Config::term, or 1, or one above the highest term the first
  // peer asking to be taken back had granted.
  std::uint64_t term() const { return term_; }
  // A recovery is open: peers of a lost master's run are being taken back.
  bool recovering() const { return recovery_.has_value(); }
  // The last recovery's facts, for the status page and the metrics.
  struct RecoveryRecord {
    TimeMs started_ms = 0;
    TimeMs finished_ms = 0;
    std::vector<PeerId> back;     // taken back
    std::vector<PeerId> missing;  // of the last view, not back (treated as removed)
  };
  const std::optional<RecoveryRecord>& last_recovery() const { return last_recovery_; }

  // ---- read-only views for the shell, tests and invariant checks
  const Config& config() const { return config_; }
  const std::map<PeerId, Peer>& peers() const { return peers_; }
  const Peer* find_peer(PeerId id) const;
  std::optional<PeerId> peer_of(ConnId conn) const;
  // Ring order of a group's accepted peers (the membership view); empty if none.
  std::vector<PeerId> ring(std::uint32_t group) const;
  const std::map<std::uint32_t, std::vector<PeerId>>& rings() const { return rings_; }
  TopologyPhase topology_phase() const { return topology_phase_; }
  std::uint64_t epoch() const { return epoch_; }
  MajorOp major_op(std::uint32_t group) const;
  std::size_t accepted_count() const;
  std::size_t handshaking_count() const { return handshaking_.size(); }
  proto::Attributes attributes(std::uint32_t group) const;
  // A canonical text form of the whole decision state (no timestamps), so that tests
  // can check that a refused request changed nothing.
  std::string digest() const;
  const std::map<std::uint32_t, std::map<std::uint64_t, Collective>>& collectives() const { return collectives_; }
  const std::map<std::uint32_t, SharedStateSync>& syncs() const { return syncs_; }
  // Measured bandwidth in bytes/s, by (sender, receiver).
  const std::map<std::pair<PeerId, PeerId>, std::uint64_t>& bandwidth() const { return bandwidth_; }
  // The bandwidth matrix of a group's current ring order (unknown edges are 0).
  topo::Matrix bandwidth_matrix(const std::vector<PeerId>& ids) const;
  // Steps the background search of a group's ring has spent (0 when none runs).
  std::uint64_t background_search_steps(std::uint32_t group) const;
  const KvStore& kv() const { return kv_; }
  // The revision of the group's last successful sync, if it ever had one.
  std::optional<std::uint64_t> revision(std::uint32_t group) const;
  // True if the peer voted for, or takes part in, a collective that is not finished.
  bool has_collective_in_flight(const Peer& peer) const;
  // Every open vote and running operation with who has and has not voted or reported.
  std::vector<OpenRound> open_rounds() const;
  // Checks the structural invariants; returns a description of the first violation.
  std::optional<std::string> check_invariants() const;
  // With a relay (relay()): the peers of every ring, accepted or proposed, that
  // accept no inbound connection, with their group. Two of one group may be connected
  // through the relay (master::Relay); nobody else. Empty without a relay.
  std::map<PeerId, std::uint32_t> relay_members() const;

 private:
  struct Handshake {
    std::string observed_host;
    TimeMs connected_ms = 0;
  };
  struct Round {
    TimeMs started_ms = 0;
    bool failed = false;
    std::string failure;
  };
  // What the completion checks need to know of the peers, counted as the peers change,
  // so that a check costs O(1) instead of a walk over every peer on every event (a vote
  // round then costs O(participants), not O(participants^2)). Every change to a peer's
  // phase, state or votes goes through edit(); check_invariants() recounts.
  struct Tally {
    struct Group {
      std::size_t agree_voters = 0;  // accepted peers in the group's agree vote
      std::size_t major_voters = 0;  // accepted peers voting to update or optimize the topology, or to sync
      std::size_t rewiring = 0;      // peers establishing connections or measuring bandwidth
      bool operator==(const Group&) const = default;
    };
    std::size_t registered = 0;
    std::size_t control_voters = 0;   // accepted peers waiting in any control vote
    std::size_t pending_voters = 0;   // accepted peers in the are-peers-pending vote
    std::size_t update_voters = 0;    // accepted peers voting to update the topology
    std::size_t optimize_voters = 0;  // accepted peers voting to optimize it
    std::size_t unreported = 0;       // peers establishing connections that have not reported
    std::map<std::uint32_t, Group> groups;  // only groups with a count above zero
    bool operator==(const Tally&) const = default;
    // Adds (sign +1) or removes (-1) what one peer counts for.
    void count(const Peer& peer, int sign);
  };
  // Changes a peer (its phase, state, votes) with the tally kept in step.
  template <class Change>
  void edit(Peer& peer, Change&& change) {
    tally_.count(peer, -1);
    change(peer);
    tally_.count(peer, +1);
  }

  void handle_hello(ConnId conn, const proto::Hello& hello, TimeMs now_ms, Outbox& out);
  void register_peer(ConnId conn, const proto::Hello& hello, PeerId id, const std::string& host,
                     const std::string& observed_host, bool resuming, TimeMs now_ms, Outbox& out);
  // ---- failover (recovery.cpp)
  void handle_resume_hello(ConnId conn, const proto::Hello& hello, const std::string& host,
                           const std::string& observed_host, TimeMs now_ms, Outbox& out);
  void handle_resume_report(Peer& peer, const proto::ResumeReport& report, Outbox& out);
  bool try_finish_recovery(TimeMs now_ms, Outbox& out);
  void finish_recovery(const std::map<std::uint32_t, std::pair<std::uint64_t, std::vector<PeerId>>>& views,
                       const std::set<PeerId>& back, TimeMs now_ms, Outbox& out);
  void resolve_collectives(const std::map<PeerId, proto::ResumeReport>& reports, Outbox& out);
  void resolve_control_rounds(const std::map<PeerId, proto::ResumeReport>& reports, Outbox& out);
  void remove_peers_left_out(const std::map<PeerId, proto::ResumeReport>& reports, Outbox& out);
  void handle_peer_message(Peer& peer, const proto::Message& message, TimeMs now_ms, Outbox& out);
  void refuse(const Peer& peer, proto::MsgType request, StatusCode status, std::string reason, Outbox& out);
  void send(const Peer& peer, proto::Message message, Outbox& out);
  // Sends the message to every peer listed (that is still here), as one Broadcast.
  void send_all(const std::vector<PeerId>& ids, proto::Message message, Outbox& out);
  // A performing attempt that can no longer end by commit (collectives.cpp).
  static std::vector<PeerId> survivors(const Collective& c);
  void abort_attempt(std::uint64_t tag, Collective& c, std::string lost_reason, Outbox& out);
  void settle_collective(std::uint32_t group, std::uint64_t tag, Outbox& out);
  // Removes a peer: tells it why (unless its connection is already gone), closes the
  // connection, and unwinds every operation it took part in.
  void remove_peer(PeerId id, StatusCode status, const std::string& reason, bool connection_open,
                   bool straggler, Outbox& out);
  // Runs every completion check until nothing changes.
  void advance(TimeMs now_ms, Outbox& out);
  void close_abandoned_votes();
  bool agree_has_voter(std::uint32_t group) const;
  bool fail_collectives_blocked_by_major_vote(Outbox& out);
  bool try_complete_topology_vote(TimeMs now_ms, Outbox& out);
  bool try_complete_establish(Outbox& out);
  bool try_complete_pending(Outbox& out);
  bool try_complete_agree(Outbox& out);
  void detect_vote_mismatch(Outbox& out);
  // Rewires every group: with newcomers appended (update topology), or in the given
  // rings with the registered peers left waiting (optimize topology).
  void start_establish(TimeMs now_ms, Outbox& out,
                       const std::optional<std::map<std::uint32_t, std::vector<PeerId>>>& optimized = std::nullopt);
  std::map<PeerId, std::string> without_room() const;
  std::optional<std::string> unreachable_neighbours(const std::vector<PeerId>& ring) const;
  // The same, whether or not the run has a relay: the ring's relayed edges.
  std::optional<std::string> neighbours_accepting_none(const std::vector<PeerId>& ring) const;
  void remove_unreachable_neighbours(std::uint32_t group, const std::string& why, Outbox& out);
  void place_newcomer(std::vector<PeerId>& ring, PeerId id) const;
  void fail_establish(const std::string& reason, Outbox& out);
  std::vector<proto::MemberInfo> members(const std::vector<PeerId>& ids) const;
  bool in_control_vote(const Peer& peer) const;
  void kick_stragglers(TimeMs now_ms, Outbox& out);
  void handle_collective_init(Peer& peer, const proto::CollectiveInit& init, Outbox& out);
  void handle_collective_done(Peer& peer, const proto::CollectiveDone& done, Outbox& out);
  bool try_start_collectives(Outbox& out);
  std::uint32_t choose_slot(std::uint32_t group, const std::vector<PeerId>& members) const;
  // ---- optimize topology (optimize.cpp)
  bool try_complete_optimize_vote(TimeMs now_ms, Outbox& out);
  void start_measurement(TimeMs now_ms, Outbox& out);
  void start_round(TimeMs now_ms, Outbox& out);
  void handle_bandwidth_report(Peer& peer, const proto::BandwidthReport& report, Outbox& out);
  bool try_complete_round(TimeMs now_ms, Outbox& out);
  void fail_optimize(const std::string& reason, Outbox& out);
  void kick_silent_measurers(TimeMs now_ms, Outbox& out);
  void step_background_search();
  // The solver's ring for each group (background results adopted when better).
  std::map<std::uint32_t, std::vector<PeerId>> solve_rings(Outbox& out);

  void send_kv_replies(const KvStore::Replies& replies, Outbox& out);
  void handle_sync_vote(Peer& peer, const proto::SyncVote& vote, Outbox& out);
  void handle_sync_done(Peer& peer, const proto::SyncDone& done, Outbox& out);
  bool try_complete_syncs(Outbox& out);
  // The election of a group whose every peer voted: removes peers that break the
  // revision rule or do not match the elected content (the election then runs again
  // without them), or sends every participant its plan.
  void decide_sync(std::uint32_t group, Outbox& out);
  void start_transfers(std::uint32_t group, std::uint64_t revision, PeerId representative, Outbox& out);
  // Ends a group's sync with one outcome for everyone in it; erases it.
  void finish_sync(std::uint32_t group, StatusCode status, const std::string& reason, Outbox& out);
  // Ends a collective with one outcome sent to `recipients` (with `data`, the result of
  // an all-reduce that travelled with the votes); erases it.
  void finish_collective(std::uint32_t group, std::uint64_t tag, std::vector<PeerId> recipients,
                         StatusCode status, const std::string& reason, Outbox& out,
                         const std::vector<std::uint8_t>& data = {});
  // Bytes of contributions `peer` has in votes of its group not yet complete.
  std::size_t contribution_bytes_held(const Peer& peer) const;

  Config config_;
  bool relay_ = false;  // Config::relay, then on_relay_change
  Tally tally_;
  std::uint64_t next_peer_counter_ = 1;
  std::map<ConnId, Handshake> handshaking_;
  std::map<PeerId, Peer> peers_;
  std::map<ConnId, PeerId> by_conn_;
  // Ring order per group: accepted peers only.
  std::map<std::uint32_t, std::vector<PeerId>> rings_;
  // The rings every peer was last told (the membership views of view_epoch_, the last
  // successful update or optimize topology); each ring is the view less the peers
  // removed since, in the same order, so a CollectiveGo names only those.
  std::map<std::uint32_t, std::vector<PeerId>> views_;
  std::uint64_t view_epoch_ = 0;

  TopologyPhase topology_phase_ = TopologyPhase::kIdle;
  TimeMs topology_started_ms_ = 0;
  // When the current topology round's first vote came (for its latency; the phase
  // deadlines above restart with each phase).
  TimeMs topology_round_started_ms_ = 0;
  std::uint64_t epoch_ = 0;
  std::set<PeerId> newcomers_;
  std::map<std::uint32_t, std::vector<PeerId>> proposed_rings_;

  // An accepted peer left since the last completed update topology: the views are
  // stale, so are-peers-pending answers yes until the next update.
  bool topology_dirty_ = false;
  std::optional<Round> pending_round_;
  std::map<std::uint32_t, Round> agree_rounds_;

  std::map<std::uint32_t, std::map<std::uint64_t, Collective>> collectives_;
  std::uint64_t next_attempt_ = 1;

  // Optimize topology: the rounds of pairs still to measure, and the matrix.
  struct Measurement {
    std::uint64_t test = 0;
    std::vector<std::vector<std::pair<PeerId, PeerId>>> rounds;  // (initiator, partner)
    std::size_t round = 0;
    TimeMs round_started_ms = 0;
  };
  std::optional<Measurement> measurement_;
  bool optimizing_ = false;  // the establishment in progress rewires for an optimization
  std::map<std::pair<PeerId, PeerId>, std::uint64_t> bandwidth_;
  // A search that keeps improving a group's ring between optimizations (for groups the
  // exact solver could not finish); its result is used if the group is unchanged.
  struct Background {
    std::vector<PeerId> members;
    topo::Matrix matrix;
    std::unique_ptr<topo::Improver> improver;
  };
  std::map<std::uint32_t, Background> background_;

  std::map<std::uint32_t, SharedStateSync> syncs_;
  // Revision of each group's last successful sync; kept when every peer is gone, so
  // that a peer restoring a checkpoint must present exactly the next one.
  std::map<std::uint32_t, std::uint64_t> revisions_;

  KvStore kv_;

  // Failover: the term, whether a resume fixed it, the recovery in progress (the
  // reports of the peers taken back so far), the last one's facts.
  struct Recovery {
    TimeMs started_ms = 0;
    std::map<PeerId, proto::ResumeReport> reports;
    std::set<PeerId> welcomed;  // taken back by this recovery (they granted its term)
  };
  std::uint64_t term_ = 1;
  bool term_fixed_ = false;
  std::optional<Recovery> recovery_;
  std::optional<RecoveryRecord> last_recovery_;
};

}  // namespace lockstep::coord
