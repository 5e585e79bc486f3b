// peer::Session (session.h): the master link's decisions, from events and the time the
// caller passes in.
#include "peer/session.h"

#include "common/limits.h"
#include "common/log.h"
#include "protocol/codec.h"

#include <algorithm>
#include <cassert>
#include <string>

namespace lockstep::peer {
namespace {

constexpr const char* kLog = "peer";

// Commands built one by one (an initializer list of variants copies each, and GCC 12
// then warns about maybe-uninitialized storage).
template <typename... C>
Commands commands(C&&... c) {
  Commands out;
  out.reserve(sizeof...(C));
  (out.emplace_back(std::forward<C>(c)), ...);
  return out;
}

}  // namespace

// The one place the state changes: forward only.
void Session::change_state(State next) {
  assert(next > state_ && "peer::Session: states only move forward");
  state_ = next;
}

Commands Session::attach(Time now, std::uint32_t heartbeat_timeout_ms) {
  if (state_ != State::kCreated) return {};
  change_state(State::kConnected);
  heartbeat_timeout_ = std::chrono::milliseconds(heartbeat_timeout_ms);
  last_rx_ = now;
  suspect_silence_ = false;
  heartbeat_interval_ = std::max(std::chrono::milliseconds(heartbeat_timeout_ms / 4), kHeartbeatIntervalMin);
  next_heartbeat_ = now + heartbeat_interval_;
  return commands(next_wake());
}

cmd::ArmTimer Session::next_wake() const {
  return cmd::ArmTimer{std::min(next_heartbeat_, last_rx_ + heartbeat_timeout_ + std::chrono::milliseconds(1))};
}

Commands Session::on_timer(Time now) {
  if (state_ != State::kConnected) return {};
  const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - last_rx_);
  if (silent > heartbeat_timeout_) {
    if (!suspect_silence_) {
      suspect_silence_ = true;
      return commands(cmd::ArmTimer{now + kSilenceRecheck});
    }
    return fail(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST,
                       "no message from the master for " + std::to_string(silent.count()) + " ms"));
  }
  suspect_silence_ = false;
  if (now < next_heartbeat_) return commands(next_wake());
  next_heartbeat_ = now + heartbeat_interval_;
  return commands(cmd::SendFrame{proto::encode_frame(proto::Heartbeat{})}, next_wake());
}

Commands Session::on_message(Time now, proto::Message message) {
  if (state_ != State::kConnected) return {};
  last_rx_ = now;  // any frame shows the master is alive
  if (const auto* bye = std::get_if<proto::Goodbye>(&message)) {
    return fail(Status(bye->status, "master: " + bye->reason));
  }
  if (std::holds_alternative<proto::HeartbeatAck>(message)) return {};
  return deliver(std::move(message));
}

Commands Session::send(std::vector<std::uint8_t> frame) {
  if (state_ == State::kEnded) return {};
  return commands(cmd::SendFrame{std::move(frame)});
}

Commands Session::fail(Status status) {
  assert(!status.is_ok());
  if (state_ == State::kEnded) return {};
  change_state(State::kEnded);
  status_ = std::move(status);
  Commands out;
  for (const std::uint64_t tag : ops_) out.push_back(cmd::AbortOp{tag, status_});
  if (establishment_) out.push_back(cmd::CancelEstablishment{});
  out.push_back(cmd::CloseMaster{status_});
  return out;
}

Commands Session::deliver(proto::Message message) {
  Commands out;
  if (auto keys = pair_keys_in(message)) out.push_back(std::move(*keys));
  if (const auto* relay = std::get_if<proto::RelayAddress>(&message)) {
    out.push_back(cmd::UseRelay{relay->host, relay->port});
    return out;
  }

  // Messages about a collective go to its op (or are dropped if it is gone).
  std::optional<std::uint64_t> tag;
  if (const auto* go = std::get_if<proto::CollectiveGo>(&message)) {
    tag = go->tag;
  } else if (const auto* result = std::get_if<proto::CollectiveResult>(&message)) {
    tag = result->tag;
    if (forget_settled(result->tag, result->attempt, true)) return out;
  } else if (const auto* abort = std::get_if<proto::CollectiveAbort>(&message)) {
    tag = abort->tag;
    if (forget_settled(abort->tag, abort->attempt, false)) return out;
  } else if (const auto* refused = std::get_if<proto::Refused>(&message);
             refused != nullptr && refused->request == proto::MsgType::kCollectiveInit) {
    tag = refused->tag;
  }
  if (tag) {
    if (ops_.count(*tag) == 0) {
      LOG_DEBUG(kLog, "dropping a collective message for tag " << *tag << " that nobody waits for");
      return out;
    }
    if (const auto* go = std::get_if<proto::CollectiveGo>(&message)) slots_[go->slot].push_back(go->attempt);
    out.push_back(cmd::RouteToOp{*tag, std::move(message)});
    return out;
  }

  // A failed outcome of the establishment in progress stops its connection setup, which
  // would otherwise wait for a dead or stopped neighbour until the p2p connect timeout.
  if (const auto* t = std::get_if<proto::TopologyResult>(&message); t != nullptr && t->status != LOCKSTEP_OK) {
    if (establishment_ && establishment_epoch_ == t->epoch) out.push_back(cmd::CancelEstablishment{});
  }

  if (mailbox_.size() >= limits::kMailboxMessagesMax) {
    mailbox_.clear();
    Commands failed = fail(Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the master sent more unanswered messages than allowed"));
    out.insert(out.end(), std::make_move_iterator(failed.begin()), std::make_move_iterator(failed.end()));
    return out;
  }
  mailbox_.push_back(std::move(message));
  return out;
}

// With a secret: the pair keys in the master's messages. A successful TopologyResult
// names the whole membership view: keys of peers outside it are forgotten, so that a
// removed peer cannot connect any more.
std::optional<cmd::LearnPairKeys> Session::pair_keys_in(const proto::Message& message) const {
  if (!learns_pair_keys_) return std::nullopt;
  cmd::LearnPairKeys out;
  const auto add = [&out](const proto::MemberInfo& m) { out.keys.emplace_back(m.id, m.key); };
  if (const auto* m = std::get_if<proto::EstablishP2P>(&message)) {
    for (const auto& member : m->ring) add(member);
  } else if (const auto* t = std::get_if<proto::TopologyResult>(&message); t != nullptr && t->status == LOCKSTEP_OK) {
    out.forget_others = true;
    for (const auto& member : t->ring) add(member);
  } else if (const auto* p = std::get_if<proto::SyncPlan>(&message)) {
    for (const auto& member : p->sources) add(member);
  } else if (const auto* b = std::get_if<proto::BandwidthTest>(&message)) {
    add(b->partner);
  } else {
    return std::nullopt;
  }
  return out;
}

std::optional<proto::Message> Session::take(const std::function<bool(const proto::Message&)>& match) {
  for (auto it = mailbox_.begin(); it != mailbox_.end(); ++it) {
    if (match(*it)) {
      proto::Message out = std::move(*it);
      mailbox_.erase(it);
      return out;
    }
  }
  return std::nullopt;
}

void Session::settled_early(std::uint64_t tag, std::uint64_t attempt) {
  if (settled_early_.size() >= kSettledEarlyMax) settled_early_.pop_front();
  settled_early_.emplace_back(tag, attempt);
}

// Whether (tag, attempt) ended here on its commit; its outcome (`last`) ends the watch.
bool Session::forget_settled(std::uint64_t tag, std::uint64_t attempt, bool last) {
  const auto it = std::find(settled_early_.begin(), settled_early_.end(), std::make_pair(tag, attempt));
  if (it == settled_early_.end()) return false;
  if (last) settled_early_.erase(it);
  return true;
}

Commands Session::register_op(std::uint64_t tag) {
  ops_.insert(tag);
  if (state_ == State::kEnded) return commands(cmd::AbortOp{tag, status_});
  return {};
}

Commands Session::set_establishment(std::uint64_t epoch, bool active) {
  establishment_epoch_ = epoch;
  establishment_ = active;
  if (active && state_ == State::kEnded) return commands(cmd::CancelEstablishment{});
  return {};
}

Session::Turn Session::slot_turn(std::uint32_t slot, std::uint64_t attempt) const {
  const auto it = slots_.find(slot);
  if (it == slots_.end()) return Turn::kNotQueued;
  const auto& queue = it->second;
  if (!queue.empty() && queue.front() == attempt) return Turn::kMine;
  return std::find(queue.begin(), queue.end(), attempt) == queue.end() ? Turn::kNotQueued : Turn::kWaiting;
}

void Session::release_slot(std::uint32_t slot, std::uint64_t attempt) {
  const auto it = slots_.find(slot);
  if (it == slots_.end()) return;
  auto& queue = it->second;
  queue.erase(std::remove(queue.begin(), queue.end(), attempt), queue.end());
  if (queue.empty()) slots_.erase(it);
}

}  // namespace lockstep::peer
