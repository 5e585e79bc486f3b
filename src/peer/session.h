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
}  // namespace cmd

using Command = std::variant<cmd::SendFrame, cmd::RouteToOp, cmd::AbortOp, cmd::CancelEstablishment, cmd::ArmTimer,
                             cmd::LearnPairKeys, cmd::UseRelay, cmd::CloseMaster>;
using Commands = std::vector<Command>;

class Session {
 public:
  using Time = std::chrono::steady_clock::time_point;

  // Forward only: each state is entered at most once, in this order (some may be
  // skipped), through change_state().
  enum class State {
    kCreated,    // no master connection yet
    kConnected,  // the welcomed master connection is attached: heartbeats, silence checks
    kEnded,      // the first fatal status is set (status()); nothing is sent any more
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

  // ---- events from the master connection
  // The welcomed connection is attached at `now`: heartbeats start.
  Commands attach(Time now, std::uint32_t heartbeat_timeout_ms);
  // A frame from the master, decoded, received at `now`.
  Commands on_message(Time now, proto::Message message);
  // The timer armed by ArmTimer fired; `now` is the time it ran.
  Commands on_timer(Time now);
  // The owner sends a message (an encoded frame) to the master.
  Commands send(std::vector<std::uint8_t> frame);
  // The connection failed, or the owner stops the link. The first fatal status sticks.
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
  void settled_early(std::uint64_t tag, std::uint64_t attempt);
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
  Commands deliver(proto::Message message);
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

  std::deque<proto::Message> mailbox_;
  std::set<std::uint64_t> ops_;
  std::deque<std::pair<std::uint64_t, std::uint64_t>> settled_early_;  // (tag, attempt), oldest first
  bool establishment_ = false;
  std::uint64_t establishment_epoch_ = 0;
  std::map<std::uint32_t, std::deque<std::uint64_t>> slots_;
};

}  // namespace lockstep::peer
