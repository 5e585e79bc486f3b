// peer::Session: what a peer decides about its link to the master, as a deterministic
// state machine. It reads no clock (the caller passes the time in), owns no socket,
// thread or lock, and answers every event with the commands its IO shell (peer/link.h)
// carries out: frames to send, messages to route to an in-flight collective, aborts,
// the timer to arm, the connection to close. The messages nobody has asked for yet
// wait in its mailbox. Not thread-safe: the shell calls it under its own mutex.
// Built as its own library target (lockstep_session) on the common and protocol
// layers only, so that it cannot reach Asio, threads or sockets.
#pragma once

#include "common/ids.h"
#include "common/status.h"
#include "protocol/messages.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <variant>
#include <vector>

namespace lockstep::peer {

// Commands for the shell, carried out in the order given.
namespace cmd {
// Send this frame (encoded, not yet sealed) to the master.
struct SendFrame {
  std::vector<std::uint8_t> frame;
};
// Hand the message to the in-flight collective registered for `tag`.
struct RouteToOp {
  std::uint64_t tag = 0;
  proto::Message message;
};
// End every wait of the collective registered for `tag` with `status`.
struct AbortOp {
  std::uint64_t tag = 0;
  Status status;
};
// Stop the p2p establishment in progress.
struct CancelEstablishment {};
// Wake up the session's timer (Session::on_timer) at this time; replaces any earlier.
struct ArmTimer {
  std::chrono::steady_clock::time_point at;
};
// With a run secret: the pair keys the master named (opaque key bytes per member).
// With `forget_others`, every key not listed here is forgotten.
struct LearnPairKeys {
  bool forget_others = false;
  std::vector<std::pair<PeerId, std::vector<std::uint8_t>>> keys;
};
// The relay in use changed (proto::RelayAddress): later relayed connections go there.
struct UseRelay {
  std::string host;  // empty: the master's own address
  std::uint16_t port = 0;  // 0: there is no relay
};
// The link ended with `status` (the first fatal one): close the master connection and
// stop the timer.
struct CloseMaster {
  Status status;
};
// Failover: the master connection was lost. Close it (the p2p connections stay), and
// look for a master to take this peer back (Session::resume_hello) until `deadline`.
struct Reconnect {
  Status status;  // why the connection was lost
};
}  // namespace cmd

using Command = std::variant<cmd::SendFrame, cmd::RouteToOp, cmd::AbortOp, cmd::CancelEstablishment, cmd::ArmTimer,
                             cmd::LearnPairKeys, cmd::UseRelay, cmd::CloseMaster, cmd::Reconnect>;
using Commands = std::vector<Command>;

class Session {
 public:
  using Time = std::chrono::steady_clock::time_point;

  // Every change goes through change_state(), which allows only these edges:
  // created -> connected -> ended, and with failover (set_failover) connected ->
  // reconnecting -> resuming -> connected, resuming -> reconnecting, and any -> ended.
  enum class State {
    kCreated,       // no master connection yet
    kConnected,     // the welcomed master connection is attached: heartbeats, silence checks
    kReconnecting,  // failover: the master was lost; the shell looks for one to take us back
    kResuming,      // failover: a master welcomed us back and has our report; not yet resumed
    kEnded,         // the first fatal status is set (status()); nothing is sent any more
  };

  // A heartbeat goes out every heartbeat interval. While the master is silent for
  // longer than the heartbeat timeout (the timer wakes at that moment), the link is
  // suspected once and looked at again this much later before it fails: after this
  // process was stopped, the timer and the bytes that arrived meanwhile (perhaps the
  // master's reason for closing) become ready together, and the bytes must win.
  static constexpr std::chrono::milliseconds kSilenceRecheck{20};
  // The shortest heartbeat interval (it is a quarter of the heartbeat timeout).
  static constexpr std::chrono::milliseconds kHeartbeatIntervalMin{10};

  // With `learns_pair_keys` (a run secret), the member keys in the master's messages
  // come out as LearnPairKeys commands.
  explicit Session(bool learns_pair_keys) : learns_pair_keys_(learns_pair_keys) {}

  State state() const { return state_; }
  // OK until the session ends; then the first fatal status, for good.
  const Status& status() const { return status_; }
  // This peer's identity, from the master's Welcome (nil before).
  const PeerId& identity() const { return id_; }
  void set_identity(PeerId id) { id_ = id; }

  // ---- failover (docs/architecture.md, "Failover")
  // With a timeout above zero, a peer that is a member of a view (accepted) and loses
  // its master connection does not end: it looks for a master to take it back for up to
  // `timeout` (cmd::Reconnect), holding every operation in flight, and reports to that
  // master what it knew (report()). Without it the session keeps none of the copies the
  // report needs (the votes' frames, the outcomes' data).
  void set_failover(std::chrono::milliseconds timeout) { failover_ = timeout; }
  // The highest master term this peer has granted (0: none); the first master's
  // (its Welcome's) is granted here.
  std::uint64_t term() const { return term_; }
  void grant_term(std::uint64_t term) { term_ = std::max(term_, term); }
  // The Hello that asks a master to take this peer back: `base` with the resume fields.
  proto::Hello resume_hello(proto::Hello base) const;
  // A master welcomed this peer back (state kReconnecting). Its term must be above every
  // term granted before (else it is refused, logged, and the state stays kReconnecting);
  // then the report goes out and the state is kResuming until the master's Resumed.
  Commands resume(Time now, const proto::Welcome& welcome);
  // What this peer reports to a master that takes it back.
  proto::ResumeReport report() const;

  // ---- events from the master connection
  // The welcomed connection is attached at `now`: heartbeats start.
  Commands attach(Time now, std::uint32_t heartbeat_timeout_ms);
  // A frame from the master, decoded, received at `now`.
  Commands on_message(Time now, proto::Message message);
  // The timer armed by ArmTimer fired; `now` is the time it ran.
  Commands on_timer(Time now);
  // The owner sends a message to the master.
  Commands send(const proto::Message& message);
  // The master connection failed (closed, a read or write error) at `now`: with failover
  // and a view, the peer reconnects; otherwise as fail().
  Commands lose(Time now, Status status);
  // The link ends (a fatal status from the master, or the owner stops it). The first
  // fatal status sticks.
  Commands fail(Status status);

  // ---- the mailbox: the master's messages not routed anywhere, until a call takes them
  // The first queued message that `match` accepts, removed; none if there is none.
  std::optional<proto::Message> take(const std::function<bool(const proto::Message&)>& match);
  std::size_t mailbox_size() const { return mailbox_.size(); }

  // ---- collectives in flight, by tag, and the pool slots' turns
  Commands register_op(std::uint64_t tag);
  void unregister_op(std::uint64_t tag) { ops_.erase(tag); }
  // The collective returned on its ring's commit, before the master's outcome of this
  // attempt: that outcome (and any CollectiveAbort of the attempt) is dropped when it
  // comes, so that it never reaches a later collective of the same tag. At most
  // kSettledEarlyMax are remembered (the master answers each within a round trip).
  // False, and nothing is noted, while the master is away (failover): a peer may not
  // end an attempt on its own once it may have to report it (the master that takes the
  // run back decides it from the reports).
  bool settled_early(std::uint64_t tag, std::uint64_t attempt, std::uint32_t world_size);
  static constexpr std::size_t kSettledEarlyMax = 4096;
  // The p2p establishment of `epoch` in progress (`active` false: none).
  Commands set_establishment(std::uint64_t epoch, bool active);

  // Pool slots are used by one attempt at a time, in the order of the attempts'
  // CollectiveGo messages, which every peer receives in the same order.
  enum class Turn { kMine, kWaiting, kNotQueued };
  Turn slot_turn(std::uint32_t slot, std::uint64_t attempt) const;
  void release_slot(std::uint32_t slot, std::uint64_t attempt);

 private:
  void change_state(State next);
  Commands start_heartbeats(Time now, std::uint32_t heartbeat_timeout_ms);
  Commands deliver(proto::Message message);
  void track_request(const proto::Message& message, const std::vector<std::uint8_t>& frame);
  Commands finish_resume();
  bool stale_answer(const proto::Message& message) const;
  void keep_outcome(proto::ResumeOutcome outcome);
  static StatusCode failure_of(proto::MsgType request, bool optimizing);
  bool forget_settled(std::uint64_t tag, std::uint64_t attempt, bool last);
  std::optional<cmd::LearnPairKeys> pair_keys_in(const proto::Message& message) const;

  const bool learns_pair_keys_;
  State state_ = State::kCreated;
  Status status_;
  PeerId id_;

  // Heartbeats and silence.
  std::chrono::milliseconds heartbeat_timeout_{0};
  std::chrono::milliseconds heartbeat_interval_{0};
  Time last_rx_{};
  Time next_heartbeat_{};
  bool suspect_silence_ = false;
  // The timer for the next heartbeat, or for the moment the silence would exceed the
  // timeout if that comes first: a silent master is noticed at the timeout (plus the
  // recheck), not up to one heartbeat interval later.
  cmd::ArmTimer next_wake() const;

  // Failover: the timeout (0: off), the term granted, when the current
  // loss began and until when a master may take the peer back.
  std::chrono::milliseconds failover_{0};
  std::uint64_t term_ = 0;
  Time reconnect_deadline_{};
  // What the report says (proto::ResumeReport): the view of the last successful
  // topology result that named this peer (none: it cannot resume), the highest epoch
  // and attempt the master sent, the revision of the last successful sync.
  bool in_view_ = false;
  std::uint64_t epoch_ = 0;
  std::vector<PeerId> view_;
  std::uint64_t epoch_seen_ = 0;
  std::uint64_t attempt_seen_ = 0;
  std::optional<std::uint64_t> revision_;
  // The group's rounds whose outcome arrived since the view began, and the last one.
  std::uint64_t control_count_ = 0;
  std::vector<std::uint8_t> last_control_;
  // The run-wide are-peers-pending rounds answered since the view began, and the last answer.
  std::uint64_t pending_count_ = 0;
  StatusCode last_pending_status_ = LOCKSTEP_OK;
  bool last_pending_ = false;
  // The control request (a vote, or a report within its round) the owner waits on the
  // answer to (0: none), and whether a round it opened has had no outcome yet (its
  // vote's type, 0: none); `optimizing_`: that round is an optimize topology.
  proto::MsgType waiting_{};
  proto::MsgType round_{};
  std::vector<std::uint8_t> round_vote_;  // the vote that opened the round, to cast again
  bool optimizing_ = false;
  // Key-value requests not answered yet.
  std::set<std::uint64_t> kv_requests_;
  // The last outcome of each tag since the view began, newest last (at most
  // limits::kResumeOutcomesKept).
  std::deque<proto::ResumeOutcome> outcomes_;
  // Answers to what the lost master asked (a CollectiveDone, SyncDone, BandwidthReport
  // of an attempt up to this, a P2PReport of an epoch up to this) go nowhere after a
  // resume: the new master decided those rounds from the reports.
  std::uint64_t stale_attempt_ = 0;
  std::uint64_t stale_epoch_ = 0;
  // Tags whose outcome the resuming master forwarded.
  std::set<std::uint64_t> forwarded_;

  std::deque<proto::Message> mailbox_;
  // Collectives in flight: whether this peer voted, and the attempt it was given.
  struct Op {
    bool voted = false;
    std::uint64_t attempt = 0;
    std::vector<std::uint8_t> vote;  // the CollectiveInit frame, to cast again after a resume
  };
  std::map<std::uint64_t, Op> ops_;
  std::deque<std::pair<std::uint64_t, std::uint64_t>> settled_early_;  // (tag, attempt), oldest first
  bool establishment_ = false;
  std::uint64_t establishment_epoch_ = 0;
  std::map<std::uint32_t, std::deque<std::uint64_t>> slots_;
};

}  // namespace lockstep::peer
