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

// The one place the state changes, along the edges the State enum lists.
void Session::change_state(State next) {
  [[maybe_unused]] const bool allowed =
      next == State::kEnded ? state_ != State::kEnded
      : next == State::kConnected ? state_ == State::kCreated || state_ == State::kResuming
      : next == State::kReconnecting ? state_ == State::kConnected || state_ == State::kResuming
      : next == State::kResuming && state_ == State::kReconnecting;
  assert(allowed && "peer::Session: no such state change");
  state_ = next;
}

Commands Session::attach(Time now, std::uint32_t heartbeat_timeout_ms) {
  if (state_ != State::kCreated) return {};
  change_state(State::kConnected);
  return start_heartbeats(now, heartbeat_timeout_ms);
}

Commands Session::start_heartbeats(Time now, std::uint32_t heartbeat_timeout_ms) {
  heartbeat_timeout_ = std::chrono::milliseconds(heartbeat_timeout_ms);
  last_rx_ = now;
  suspect_silence_ = false;
  heartbeat_interval_ = std::max(std::chrono::milliseconds(heartbeat_timeout_ms / 4), kHeartbeatIntervalMin);
  next_heartbeat_ = now + heartbeat_interval_;
  return commands(next_wake());
}

cmd::ArmTimer Session::next_wake() const {
  const Time wake = std::min(next_heartbeat_, last_rx_ + heartbeat_timeout_ + std::chrono::milliseconds(1));
  return cmd::ArmTimer{state_ == State::kResuming ? std::min(wake, reconnect_deadline_) : wake};
}

Commands Session::on_timer(Time now) {
  if (state_ == State::kReconnecting) {
    if (now < reconnect_deadline_) return commands(cmd::ArmTimer{reconnect_deadline_});
    return fail(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST,
                       "no master took this peer back within the failover timeout of " +
                           std::to_string(failover_.count()) + " ms"));
  }
  if (state_ != State::kConnected && state_ != State::kResuming) return {};
  // A master that took the peer back but does not resume the run (it waits for a quorum
  // that does not come) holds it no longer than the failover timeout either.
  if (state_ == State::kResuming && now >= reconnect_deadline_) {
    return fail(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST,
                       "no master resumed the run within the failover timeout of " +
                           std::to_string(failover_.count()) + " ms"));
  }
  const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - last_rx_);
  if (silent > heartbeat_timeout_) {
    if (!suspect_silence_) {
      suspect_silence_ = true;
      return commands(cmd::ArmTimer{now + kSilenceRecheck});
    }
    return lose(now, Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST,
                            "no message from the master for " + std::to_string(silent.count()) + " ms"));
  }
  suspect_silence_ = false;
  if (now < next_heartbeat_) return commands(next_wake());
  next_heartbeat_ = now + heartbeat_interval_;
  return commands(cmd::SendFrame{proto::encode_frame(proto::Heartbeat{})}, next_wake());
}

Commands Session::on_message(Time now, proto::Message message) {
  if (state_ != State::kConnected && state_ != State::kResuming) return {};
  last_rx_ = now;  // any frame shows the master is alive
  if (const auto* bye = std::get_if<proto::Goodbye>(&message)) {
    // A master that shuts down says so; a supervisor may start another in its place.
    Status status(bye->status, "master: " + bye->reason);
    if (bye->status == LOCKSTEP_STATUS_MASTER_CONNECTION_LOST) return lose(now, std::move(status));
    return fail(std::move(status));
  }
  if (std::holds_alternative<proto::HeartbeatAck>(message)) return {};
  if (const auto* resumed = std::get_if<proto::Resumed>(&message)) {
    // The new master may have raised its term during the recovery (a peer back after this
    // one had granted a higher one): this peer grants it now.
    if (state_ != State::kResuming || resumed->term < term_) {
      return fail(Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the master sent Resumed (term " + std::to_string(resumed->term) +
                                                             ") where this peer was not resuming under that term"));
    }
    term_ = resumed->term;
    return finish_resume();
  }
  if (state_ == State::kResuming) {
    // What the resuming master forwards: outcomes this peer missed.
    if (const auto* result = std::get_if<proto::CollectiveResult>(&message)) forwarded_.insert(result->tag);
  }
  return deliver(std::move(message));
}

Commands Session::send(const proto::Message& message) {
  if (state_ == State::kEnded) return {};
  if (state_ == State::kConnected && stale_answer(message)) {
    // It answers what the lost master asked, in a round the new master ended from the
    // reports: the owner, still in that round, gets its retryable failure.
    const auto type = proto::type_of(message);
    if (round_ != proto::MsgType{} && type != proto::MsgType::kCollectiveDone) {
      mailbox_.push_back(proto::Refused{type, 0, failure_of(type, optimizing_),
                                        "the master was replaced during this operation"});
      round_ = proto::MsgType{};
      waiting_ = proto::MsgType{};
    }
    return {};
  }
  std::vector<std::uint8_t> frame = proto::encode_frame(message);
  track_request(message, frame);
  // While the master is away the request goes nowhere: the master that takes this peer
  // back ends every operation in flight from the reports (finish_resume).
  if (state_ == State::kReconnecting || state_ == State::kResuming) return {};
  return commands(cmd::SendFrame{std::move(frame)});
}

// Notes what the owner asked the master, for the report and for finish_resume.
void Session::track_request(const proto::Message& message, const std::vector<std::uint8_t>& frame) {
  using proto::MsgType;
  const MsgType type = proto::type_of(message);
  const bool keeps = failover_.count() > 0;  // the frames are cast again after a resume
  switch (type) {
    case MsgType::kCollectiveInit:
      if (auto it = ops_.find(std::get<proto::CollectiveInit>(message).tag); it != ops_.end()) {
        it->second.voted = true;
        if (keeps) it->second.vote = frame;
      }
      return;
    case MsgType::kKvRequest:
      kv_requests_.insert(std::get<proto::KvRequest>(message).request);
      return;
    case MsgType::kVoteUpdateTopology:
    case MsgType::kVoteOptimizeTopology:
    case MsgType::kVotePeersPending:
    case MsgType::kVoteAgree:
    case MsgType::kSyncVote:
      round_ = type;
      if (keeps) round_vote_ = frame;
      optimizing_ = type == MsgType::kVoteOptimizeTopology;
      waiting_ = type;
      return;
    case MsgType::kP2PReport:
    case MsgType::kBandwidthReport:
    case MsgType::kSyncDone:
      waiting_ = type;
      return;
    default:
      return;
  }
}

bool Session::stale_answer(const proto::Message& message) const {
  if (const auto* m = std::get_if<proto::CollectiveDone>(&message)) return m->attempt <= stale_attempt_;
  if (const auto* m = std::get_if<proto::SyncDone>(&message)) return m->attempt <= stale_attempt_;
  if (const auto* m = std::get_if<proto::BandwidthReport>(&message)) return m->test <= stale_attempt_;
  if (const auto* m = std::get_if<proto::P2PReport>(&message)) return m->epoch <= stale_epoch_;
  return false;
}

// The retryable failure of an operation whose master was replaced before its outcome.
StatusCode Session::failure_of(proto::MsgType request, bool optimizing) {
  using proto::MsgType;
  if (request == MsgType::kVoteUpdateTopology || (request == MsgType::kP2PReport && !optimizing)) {
    return LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED;
  }
  if (request == MsgType::kVoteOptimizeTopology || request == MsgType::kBandwidthReport ||
      request == MsgType::kP2PReport) {
    return LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED;
  }
  return LOCKSTEP_STATUS_PEER_CONNECTION_LOST;
}

Commands Session::lose(Time now, Status status) {
  assert(!status.is_ok());
  if (state_ == State::kEnded) return {};
  if (failover_.count() == 0 || !in_view_ || (state_ != State::kConnected && state_ != State::kResuming)) {
    return fail(std::move(status));
  }
  // The failover timeout runs from the loss of a serving master; a master lost while it
  // was taking the peer back does not extend it.
  if (state_ == State::kConnected) reconnect_deadline_ = now + failover_;
  change_state(State::kReconnecting);
  forwarded_.clear();
  suspect_silence_ = false;
  return commands(cmd::Reconnect{std::move(status)}, cmd::ArmTimer{reconnect_deadline_});
}

proto::Hello Session::resume_hello(proto::Hello base) const {
  base.resume_id = id_;
  base.term = term_;
  return base;
}

Commands Session::resume(Time now, const proto::Welcome& welcome) {
  if (state_ != State::kReconnecting) return {};
  if (welcome.id != id_) {
    return fail(Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the master took this peer back as " + welcome.id.to_string() +
                                                           " where it is " + id_.to_string()));
  }
  if (welcome.term <= term_) {
    LOG_WARN(kLog, "refusing a master with term " << welcome.term << ": this peer has granted term " << term_
                                                  << " (a master that lost the run, or a second one)");
    return {};
  }
  term_ = welcome.term;
  change_state(State::kResuming);
  Commands out = start_heartbeats(now, welcome.heartbeat_timeout_ms);
  out.insert(out.begin(), cmd::SendFrame{proto::encode_frame(report())});
  return out;
}

proto::ResumeReport Session::report() const {
  proto::ResumeReport r;
  r.epoch = epoch_;
  r.view = view_;
  r.epoch_seen = epoch_seen_;
  r.attempt_seen = attempt_seen_;
  r.has_revision = revision_.has_value();
  r.revision = revision_.value_or(0);
  r.control_count = control_count_;
  r.waiting = round_ == proto::MsgType{} ? 0 : static_cast<std::uint16_t>(round_);
  r.last_control = last_control_;
  for (const auto& [tag, op] : ops_) {
    if (op.voted && r.ops.size() < limits::kCollectivesPerGroupMaxDefault) r.ops.push_back(proto::ResumeOp{tag, op.attempt});
  }
  r.outcomes.assign(outcomes_.begin(), outcomes_.end());
  r.pending_count = pending_count_;
  r.last_pending_status = last_pending_status_;
  r.last_pending = last_pending_;
  return r;
}

// The master has forwarded every outcome this peer missed. What is still in flight:
// a vote whose round had not started (no attempt, no plan, no establishment, no test)
// goes to the new master again, where the peers that had not voted yet will meet it
// (failing it would let them start a round this peer is no longer in); a round that had
// started (every member had voted) ends with its retryable failure, as for a lost peer,
// on every member alike.
Commands Session::finish_resume() {
  change_state(State::kConnected);
  const std::string why = "the master was replaced during this operation";
  Commands out;
  for (const auto& [tag, op] : ops_) {
    if (!op.voted || forwarded_.count(tag) > 0) continue;
    if (op.attempt > 0) {
      out.push_back(cmd::RouteToOp{tag, proto::CollectiveResult{tag, op.attempt, LOCKSTEP_STATUS_PEER_CONNECTION_LOST, 0, why}});
    } else {
      out.push_back(cmd::SendFrame{op.vote});
    }
  }
  forwarded_.clear();
  if (round_ != proto::MsgType{} && waiting_ == round_) {
    out.push_back(cmd::SendFrame{round_vote_});
  } else if (waiting_ != proto::MsgType{}) {
    mailbox_.push_back(proto::Refused{waiting_, 0, failure_of(waiting_, optimizing_), why});
    waiting_ = proto::MsgType{};
    round_ = proto::MsgType{};
  }
  for (const std::uint64_t id : kv_requests_) {
    mailbox_.push_back(proto::KvResult{id, LOCKSTEP_STATUS_MASTER_CONNECTION_LOST,
                                       "the master was replaced; its key-value store is gone"});
  }
  kv_requests_.clear();
  stale_attempt_ = attempt_seen_;
  stale_epoch_ = epoch_seen_;
  LOG_INFO(kLog, "resumed under master term " << term_);
  return out;
}

void Session::keep_outcome(proto::ResumeOutcome outcome) {
  const auto same = std::find_if(outcomes_.begin(), outcomes_.end(), [&](const auto& o) { return o.tag == outcome.tag; });
  if (same != outcomes_.end()) outcomes_.erase(same);
  if (outcomes_.size() >= limits::kResumeOutcomesKept) outcomes_.pop_front();
  outcomes_.push_back(std::move(outcome));
}

Commands Session::fail(Status status) {
  assert(!status.is_ok());
  if (state_ == State::kEnded) return {};
  change_state(State::kEnded);
  status_ = std::move(status);
  Commands out;
  for (const auto& [tag, op] : ops_) out.push_back(cmd::AbortOp{tag, status_});
  if (establishment_) out.push_back(cmd::CancelEstablishment{});
  out.push_back(cmd::CloseMaster{status_});
  return out;
}

Commands Session::deliver(proto::Message message) {
  Commands out;
  if (auto keys = pair_keys_in(message)) out.push_back(std::move(*keys));
  // What the report will say, and the control round's state.
  if (const auto* t = std::get_if<proto::TopologyResult>(&message)) {
    if (t->status == LOCKSTEP_OK) {
      view_.clear();
      for (const auto& m : t->ring) view_.push_back(m.id);
      in_view_ = std::find(view_.begin(), view_.end(), id_) != view_.end();
      epoch_ = t->epoch;
      control_count_ = 0;
      last_control_.clear();
      pending_count_ = 0;
      last_pending_status_ = LOCKSTEP_OK;
      last_pending_ = false;
      // The collectives' outcomes too: a view begins with no collective in flight at any
      // of its members (update and optimize topology wait for them), so no member can
      // miss an older one. Kept, they would be taken for the outcome of a round that a
      // member of the new view voted in without an attempt: the new master forwards the
      // first outcome after that member's own last one of the tag, and a newcomer has none.
      outcomes_.clear();
    }
    round_ = waiting_ = proto::MsgType{};
  } else if (const auto* e = std::get_if<proto::EstablishP2P>(&message)) {
    epoch_seen_ = std::max(epoch_seen_, e->epoch);
    waiting_ = proto::MsgType{};
  } else if (const auto* plan = std::get_if<proto::SyncPlan>(&message)) {
    attempt_seen_ = std::max(attempt_seen_, plan->attempt);
    waiting_ = proto::MsgType{};
  } else if (const auto* test = std::get_if<proto::BandwidthTest>(&message)) {
    attempt_seen_ = std::max(attempt_seen_, test->test);
    waiting_ = proto::MsgType{};
  } else if (std::holds_alternative<proto::PeersPendingResult>(message) ||
             std::holds_alternative<proto::AgreeResult>(message) || std::holds_alternative<proto::SyncResult>(message)) {
    ++control_count_;
    if (failover_.count() > 0) {
      last_control_ = proto::encode_frame(message);
      if (last_control_.size() > limits::kResumeControlBytesMax) last_control_.clear();
    }
    if (const auto* r = std::get_if<proto::SyncResult>(&message); r != nullptr && r->status == LOCKSTEP_OK) {
      revision_ = r->revision;
    }
    if (const auto* r = std::get_if<proto::PeersPendingResult>(&message)) {
      ++pending_count_;
      last_pending_status_ = r->status;
      last_pending_ = r->pending;
    }
    round_ = waiting_ = proto::MsgType{};
  } else if (const auto* r = std::get_if<proto::Refused>(&message);
             r != nullptr && r->request != proto::MsgType::kCollectiveInit && r->request != proto::MsgType::kKvRequest) {
    round_ = waiting_ = proto::MsgType{};
  } else if (const auto* kv = std::get_if<proto::KvResult>(&message)) {
    kv_requests_.erase(kv->request);
  }
  if (const auto* relay = std::get_if<proto::RelayAddress>(&message)) {
    out.push_back(cmd::UseRelay{relay->host, relay->port});
    return out;
  }

  // Messages about a collective go to its op (or are dropped if it is gone).
  std::optional<std::uint64_t> tag;
  if (const auto* go = std::get_if<proto::CollectiveGo>(&message)) {
    tag = go->tag;
    attempt_seen_ = std::max(attempt_seen_, go->attempt);
  } else if (const auto* result = std::get_if<proto::CollectiveResult>(&message)) {
    tag = result->tag;
    if (forget_settled(result->tag, result->attempt, true)) return out;
    if (result->attempt > 0 && failover_.count() > 0) {  // (only a report needs them)
      keep_outcome(proto::ResumeOutcome{result->tag, result->attempt, result->status, result->world_size,
                                        result->reason, result->data});
    }
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
    if (const auto* go = std::get_if<proto::CollectiveGo>(&message)) {
      slots_[go->slot].push_back(go->attempt);
      ops_[*tag].attempt = go->attempt;
    }
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

bool Session::settled_early(std::uint64_t tag, std::uint64_t attempt, std::uint32_t world_size) {
  if (state_ != State::kConnected) return false;
  if (settled_early_.size() >= kSettledEarlyMax) settled_early_.pop_front();
  settled_early_.emplace_back(tag, attempt);
  if (failover_.count() > 0) keep_outcome(proto::ResumeOutcome{tag, attempt, LOCKSTEP_OK, world_size, {}, {}});
  return true;
}

// Whether (tag, attempt) ended here on its commit; its outcome (`last`) ends the watch.
bool Session::forget_settled(std::uint64_t tag, std::uint64_t attempt, bool last) {
  const auto it = std::find(settled_early_.begin(), settled_early_.end(), std::make_pair(tag, attempt));
  if (it == settled_early_.end()) return false;
  if (last) settled_early_.erase(it);
  return true;
}

Commands Session::register_op(std::uint64_t tag) {
  ops_[tag] = Op{};
  // A new collective of a tag whose outcome the resuming master forwarded (the owner
  // retried before Resumed): its vote, held until then, goes out at the resume.
  forwarded_.erase(tag);
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
