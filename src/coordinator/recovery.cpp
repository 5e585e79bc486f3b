// The coordinator's failover half (docs/architecture.md, "Failover"): a master that is
// asked to take back the peers of a run it does not know rebuilds the run from their
// reports, and forwards to each the outcomes it missed.
#include "coordinator/coordinator.h"
#include "protocol/codec.h"

#include <algorithm>
#include <array>
#include <span>
#include <string>

namespace lockstep::coord {
namespace {

using proto::MsgType;

// The outcome message that answers a round opened by a vote of this type.
std::optional<MsgType> outcome_of(std::uint16_t waiting) {
  switch (static_cast<MsgType>(waiting)) {
    case MsgType::kVotePeersPending: return MsgType::kPeersPendingResult;
    case MsgType::kVoteAgree: return MsgType::kAgreeResult;
    case MsgType::kSyncVote: return MsgType::kSyncResult;
    default: return std::nullopt;
  }
}

// A frame a peer kept (ResumeReport::last_control), decoded; none if it is not one.
std::optional<proto::Message> decode_kept(const std::vector<std::uint8_t>& frame) {
  if (frame.size() < proto::kFrameHeaderBytes) return std::nullopt;
  const std::span<const std::uint8_t, proto::kFrameHeaderBytes> header(frame.data(), proto::kFrameHeaderBytes);
  auto h = proto::decode_header(header);
  if (!h.is_ok() || h.value().payload_bytes != frame.size() - proto::kFrameHeaderBytes) return std::nullopt;
  auto message = proto::decode_payload(h.value().type, std::span(frame).subspan(proto::kFrameHeaderBytes));
  if (!message.is_ok()) return std::nullopt;
  return std::move(message.value());
}

}  // namespace

// A peer of a lost master's run asks to be taken back. A master serving a run of its
// own refuses (KICKED: that run went on without the peer); otherwise the first such
// peer opens the recovery and fixes the term one above the term it had granted (raised
// for a peer back later that had granted more).
void Coordinator::handle_resume_hello(ConnId conn, const proto::Hello& hello, const std::string& host,
                                      const std::string& observed_host, TimeMs now_ms, Outbox& out) {
  const PeerId id = hello.resume_id;
  const auto refuse = [&](StatusCode status, const std::string& why) {
    out.push_back(Event{.text = "peer " + id.to_string() + " from " + host + " not taken back: " + why,
                        .kind = EventKind::kRejected,
                        .op = Operation::kConnection,
                        .reason = why,
                        .status = status,
                        .peers = {id}});
    out.push_back(Send{conn, proto::Goodbye{status, why}});
    out.push_back(Close{conn, why});
  };
  if (!recovery_ && accepted_count() > 0) {
    // A peer that granted a higher term has been taken back by a newer master: this one
    // is stale (stopped, then continued) and has no say over it; the peer tries its next
    // address. Otherwise this master (or an older one) went on without the peer.
    if (hello.term > term_) {
      return refuse(LOCKSTEP_STATUS_REJECTED, "this peer granted term " + std::to_string(hello.term) +
                                                  " to a newer master; this one's is " + std::to_string(term_));
    }
    return refuse(LOCKSTEP_STATUS_KICKED, "this master serves a run that went on without this peer");
  }
  // A master already admitting the first peers of a new run (a newcomer came first) is
  // not free to take a lost run back; the peer tries again (and is KICKED once that run
  // exists).
  if (!recovery_ && topology_phase_ != TopologyPhase::kIdle) {
    return refuse(LOCKSTEP_STATUS_REJECTED, "this master is admitting the first peers of a new run");
  }
  if (!recovery_) {
    if (!term_fixed_) {
      term_ = std::max(term_, hello.term + 1);
      term_fixed_ = true;
    }
    recovery_ = Recovery{now_ms, {}, {}};
    out.push_back(Event{.text = "recovery began: peer " + id.to_string() + " asks to be taken back; term " +
                                std::to_string(term_),
                        .op = Operation::kConnection,
                        .reason = "a peer of a lost master's run reconnected",
                        .peers = {id}});
  }
  if (hello.term >= term_ && config_.term == 0 && recovery_->welcomed.count(id) == 0 && peers_.count(id) == 0) {
    // The term was fixed by the first peer back, which had not heard of a later master
    // (a newcomer that the lost master welcomed before its own recovery fixed its term,
    // say): the term goes above this peer's too. The peers welcomed before grant it with
    // Resumed; nothing completes during a recovery, so no operation sees two terms.
    term_ = hello.term + 1;
    out.push_back(Event{.text = "recovery: term raised to " + std::to_string(term_) + " for peer " + id.to_string() +
                                ", which granted term " + std::to_string(hello.term),
                        .op = Operation::kConnection,
                        .reason = "a peer back later had granted a higher term than the first",
                        .peers = {id}});
  }
  if (hello.term >= term_) {
    return refuse(LOCKSTEP_STATUS_REJECTED, "this peer granted term " + std::to_string(hello.term) +
                                                " to a master; this one's is " + std::to_string(term_));
  }
  if (peers_.count(id) > 0) return refuse(LOCKSTEP_STATUS_REJECTED, "a peer with this identity is already here");
  recovery_->welcomed.insert(id);
  register_peer(conn, hello, id, host, observed_host, /*resuming=*/true, now_ms, out);
}

void Coordinator::handle_resume_report(Peer& peer, const proto::ResumeReport& report, Outbox& out) {
  if (!recovery_ || !peer.resuming || recovery_->reports.count(peer.id) > 0) {
    return remove_peer(peer.id, LOCKSTEP_STATUS_PROTOCOL_ERROR, "protocol error: a ResumeReport out of place",
                       /*connection_open=*/true, /*straggler=*/false, out);
  }
  if (std::find(report.view.begin(), report.view.end(), peer.id) == report.view.end()) {
    return remove_peer(peer.id, LOCKSTEP_STATUS_REJECTED, "its reported view of epoch " + std::to_string(report.epoch) +
                                                              " does not include it",
                       /*connection_open=*/true, /*straggler=*/false, out);
  }
  recovery_->reports.emplace(peer.id, report);
}

// Recovery ends when every peer of the last view is back, or once the window has
// passed with a quorum of it. The last view of a group is the one of the highest epoch
// any of its peers reports (the one most of them report, if they differ).
bool Coordinator::try_finish_recovery(TimeMs now_ms, Outbox& out) {
  if (!recovery_ || recovery_->reports.empty() || topology_phase_ != TopologyPhase::kIdle) return false;
  std::map<std::uint32_t, std::pair<std::uint64_t, std::vector<PeerId>>> views;
  {
    std::map<std::uint32_t, std::map<std::pair<std::uint64_t, std::vector<PeerId>>, std::size_t>> counts;
    for (const auto& [id, report] : recovery_->reports) {
      const Peer* peer = find_peer(id);
      if (peer != nullptr) ++counts[peer->group][{report.epoch, report.view}];
    }
    for (const auto& [group, by_view] : counts) {
      const auto best = std::max_element(by_view.begin(), by_view.end(), [](const auto& a, const auto& b) {
        return a.first.first != b.first.first ? a.first.first < b.first.first : a.second < b.second;
      });
      views[group] = best->first;
    }
  }
  // Views are run-wide (every update gives every group's peers one of the same epoch): a
  // group whose peers all report an older one missed the last topology change, as a
  // peer that reports an older view than its group's does; they are turned away.
  std::uint64_t last_epoch = 0;
  for (const auto& [group, view] : views) last_epoch = std::max(last_epoch, view.first);
  std::erase_if(views, [&](const auto& entry) { return entry.second.first < last_epoch; });
  std::set<PeerId> expected;
  std::set<PeerId> back;
  for (const auto& [group, view] : views) expected.insert(view.second.begin(), view.second.end());
  for (const auto& [id, report] : recovery_->reports) {
    const Peer* peer = find_peer(id);
    if (peer == nullptr) continue;
    const auto& view = views[peer->group];
    if (report.epoch == view.first && report.view == view.second) back.insert(id);
  }
  const std::size_t n = expected.size();
  const std::size_t quorum = config_.recovery_quorum > 0 ? std::min<std::size_t>(config_.recovery_quorum, n)
                             : n <= 2                    ? n
                                                         : n / 2 + 1;
  const bool all_back = back.size() == n;
  if (!all_back && (now_ms - recovery_->started_ms < config_.recovery_window_ms || back.size() < quorum)) return false;
  finish_recovery(views, back, now_ms, out);
  return true;
}

void Coordinator::finish_recovery(const std::map<std::uint32_t, std::pair<std::uint64_t, std::vector<PeerId>>>& views,
                                  const std::set<PeerId>& back, TimeMs now_ms, Outbox& out) {
  const TimeMs started = recovery_->started_ms;
  std::map<PeerId, proto::ResumeReport> reports = std::move(recovery_->reports);
  recovery_.reset();
  // The peers that asked to come back but do not fit the last view (or never reported).
  std::vector<PeerId> turned_away;
  for (const auto& [id, peer] : peers_) {
    if (peer.resuming && back.count(id) == 0) turned_away.push_back(id);
  }
  for (const PeerId& id : turned_away) {
    remove_peer(id, LOCKSTEP_STATUS_KICKED,
                reports.count(id) > 0 ? "its view does not match the run's last view (it missed a topology change)"
                                      : "it did not report before the run resumed",
                /*connection_open=*/true, /*straggler=*/false, out);
  }
  for (auto it = reports.begin(); it != reports.end();) it = back.count(it->first) > 0 ? std::next(it) : reports.erase(it);

  // The run as its peers knew it, less the peers that did not come back.
  std::vector<PeerId> missing;
  std::uint64_t epoch = 0;
  for (const auto& [group, view] : views) {
    views_[group] = view.second;
    epoch = std::max(epoch, view.first);
    auto& ring = rings_[group];
    ring.clear();
    for (const PeerId& id : view.second) {
      // (a view that names a peer of another group does not put it in this ring)
      if (back.count(id) > 0 && peers_.at(id).group == group) ring.push_back(id);
      else if (back.count(id) == 0) missing.push_back(id);
    }
    if (ring.empty()) rings_.erase(group);
  }
  view_epoch_ = epoch;
  epoch_ = std::max(epoch_, epoch);
  for (const auto& [id, report] : reports) {
    epoch_ = std::max(epoch_, report.epoch_seen);
    next_attempt_ = std::max(next_attempt_, report.attempt_seen + 1);
    if (report.has_revision) {
      auto& revision = revisions_[peers_.at(id).group];
      revision = std::max(revision, report.revision);
    }
  }
  for (const PeerId& id : back) {
    edit(peers_.at(id), [&](Peer& p) {
      p.phase = Phase::kAccepted;
      p.state = PeerState::kIdle;
      p.resuming = false;
      p.accepted_epoch = view_epoch_;
    });
  }
  // Peers that came back may now be neighbours that both accept no inbound connection
  // (the one between them did not): parted as after a removal (each removal parts the
  // next such pair), unless a relay joins them.
  if (!relay_) {
    for (const auto& [group, view] : views) {
      remove_unreachable_neighbours(group, "the run resumed without the peers between them", out);
    }
  }
  topology_dirty_ = topology_dirty_ || !missing.empty();
  last_recovery_ = RecoveryRecord{started, now_ms, std::vector<PeerId>(back.begin(), back.end()), missing};
  out.push_back(Event{.text = "recovery finished after " + std::to_string(now_ms - started) + " ms: " +
                              std::to_string(back.size()) + " peer(s) back" +
                              (missing.empty() ? std::string() : ", missing (removed): " + id_list(missing)) +
                              "; term " + std::to_string(term_) + ", epoch " + std::to_string(view_epoch_),
                      .kind = EventKind::kSucceeded,
                      .op = Operation::kConnection,
                      .reason = missing.empty() ? std::string() : "peers of the last view did not come back in time",
                      .peers = std::vector<PeerId>(back.begin(), back.end())});
  // The peers the lost master had removed first, then the control rounds: a peer further
  // behind in them is removed before any collective's outcome is forwarded to it (the
  // first outcome after its own may be of a round that the lost master ran without it).
  remove_peers_left_out(reports, out);
  resolve_control_rounds(reports, out);
  resolve_collectives(reports, out);
  std::vector<PeerId> resumed;
  for (const PeerId& id : back) {
    if (peers_.count(id) > 0) resumed.push_back(id);
  }
  send_all(resumed, proto::Resumed{term_, view_epoch_}, out);
}

// Guarantee 1 across the failover: a collective whose outcome any peer received (or
// which any peer committed) has that outcome for every participant that reports it in
// flight: the attempt it was given, or, for one that had only voted (a small all-reduce
// that travels with the votes has no attempt before its outcome), the round after its
// own last outcome of the tag. A peer that had only voted in a round whose attempt had
// started elsewhere (the lost master's CollectiveGo reached some participants only) gets
// that attempt's failure, as the others give it to themselves. Every other collective in
// flight is cast again (a vote) or failed (a started attempt) by its peers themselves
// when they resume (peer::Session).
void Coordinator::resolve_collectives(const std::map<PeerId, proto::ResumeReport>& reports, Outbox& out) {
  using Key = std::pair<std::uint32_t, std::uint64_t>;  // (group, tag)
  std::map<Key, std::map<std::uint64_t, const proto::ResumeOutcome*>> outcomes;
  std::map<Key, std::set<std::uint64_t>> started;
  for (const auto& [id, report] : reports) {
    const Peer* peer = find_peer(id);
    if (peer == nullptr) continue;  // removed for the control rounds it missed: behind
    const std::uint32_t group = peer->group;
    for (const auto& o : report.outcomes) outcomes[{group, o.tag}].emplace(o.attempt, &o);
    for (const auto& op : report.ops) {
      if (op.attempt > 0) started[{group, op.tag}].insert(op.attempt);
    }
  }
  for (const auto& [id, report] : reports) {
    const Peer* peer = find_peer(id);
    if (peer == nullptr) continue;
    for (const auto& op : report.ops) {
      std::uint64_t mine = 0;  // its own last outcome of the tag
      for (const auto& o : report.outcomes) {
        if (o.tag == op.tag) mine = o.attempt;
      }
      const proto::ResumeOutcome* o = nullptr;
      if (const auto of_tag = outcomes.find({peer->group, op.tag}); of_tag != outcomes.end()) {
        if (op.attempt > 0) {
          const auto it = of_tag->second.find(op.attempt);
          if (mine != op.attempt && it != of_tag->second.end()) o = it->second;
        } else if (const auto it = of_tag->second.upper_bound(mine); it != of_tag->second.end()) {
          o = it->second;
        }
      }
      if (o == nullptr && op.attempt == 0) {
        const auto of_tag = started.find({peer->group, op.tag});
        const auto it = of_tag == started.end() ? std::set<std::uint64_t>::const_iterator{} : of_tag->second.upper_bound(mine);
        if (of_tag != started.end() && it != of_tag->second.end()) {
          out.push_back(Event{.text = "tag " + std::to_string(op.tag) + " attempt " + std::to_string(*it) + ": failed for " +
                                      id.to_string() + ", which never heard of it",
                              .op = Operation::kAllReduce,
                              .reason = "the lost master started it at other participants only",
                              .group = peer->group,
                              .peers = {id},
                              .tag = op.tag,
                              .attempt = *it});
          send(*peer, proto::CollectiveResult{op.tag, *it, LOCKSTEP_STATUS_PEER_CONNECTION_LOST, 0,
                                              "the master was replaced during this operation"}, out);
        }
        continue;
      }
      if (o == nullptr) continue;
      out.push_back(Event{.text = "tag " + std::to_string(op.tag) + " attempt " + std::to_string(o->attempt) +
                                  ": forwarding its outcome (" + status_name(o->status) + ") to " + id.to_string(),
                          .op = Operation::kAllReduce,
                          .reason = "another participant received it from the lost master",
                          .group = peer->group,
                          .peers = {id},
                          .tag = op.tag,
                          .attempt = o->attempt});
      send(*peer, proto::CollectiveResult{op.tag, o->attempt, o->status, o->world_size, o->reason, o->data}, out);
    }
  }
}

// A peer the lost master had removed without its knowing (its Goodbye lost with the
// master) reports the same view as the others: a removal changes no view. The others'
// reports show it: a collective attempt starts only once every member has voted, so an
// attempt of its group that it neither voted for nor was sent nor has the outcome of (a
// tag it has no vote in flight for, a number above every attempt it was sent and above
// its own last outcome of the tag: a small all-reduce's outcome has no attempt before it)
// ran without it.
void Coordinator::remove_peers_left_out(const std::map<PeerId, proto::ResumeReport>& reports, Outbox& out) {
  std::map<std::uint32_t, std::set<std::pair<std::uint64_t, std::uint64_t>>> attempts;  // group -> (tag, attempt)
  for (const auto& [id, report] : reports) {
    const Peer* peer = find_peer(id);
    if (peer == nullptr) continue;
    for (const auto& op : report.ops) {
      if (op.attempt > 0) attempts[peer->group].emplace(op.tag, op.attempt);
    }
    for (const auto& o : report.outcomes) attempts[peer->group].emplace(o.tag, o.attempt);
  }
  for (const auto& entry : reports) {
    const PeerId& id = entry.first;
    const proto::ResumeReport& report = entry.second;  // named: Clang 14 lambdas capture no structured binding
    const Peer* peer = find_peer(id);
    if (peer == nullptr) continue;
    const auto& of_group = attempts[peer->group];
    const auto without = std::find_if(of_group.begin(), of_group.end(), [&](const auto& a) {
      if (a.second <= report.attempt_seen) return false;
      const bool voted = std::any_of(report.ops.begin(), report.ops.end(), [&](const proto::ResumeOp& op) {
        return op.tag == a.first && (op.attempt == 0 || op.attempt == a.second);
      });
      const bool ended = std::any_of(report.outcomes.begin(), report.outcomes.end(), [&](const proto::ResumeOutcome& o) {
        return o.tag == a.first && o.attempt >= a.second;
      });
      return !voted && !ended;
    });
    if (without == of_group.end()) continue;
    remove_peer(id, LOCKSTEP_STATUS_KICKED,
                "the lost master had removed it: attempt " + std::to_string(without->second) + " of tag " +
                    std::to_string(without->first) + " ran without it",
                /*connection_open=*/true, /*straggler=*/false, out);
  }
}

// The group's rounds (are-peers-pending, agree, sync) are numbered by the outcomes each
// peer received since its view began. A peer one outcome behind, waiting in that round,
// gets the outcome another peer received; a peer further behind missed a round it did
// not wait in (the lost master had removed it): it is removed.
//
// Are-peers-pending is run-wide: every peer of a view counts the same rounds
// (ResumeReport.pending_count). A group whose peers all missed the last one's outcome,
// waiting in it, gets it (yes or no) from a peer of another group of the same view that
// received it; casting the vote again would put that group one round behind the others
// (its next round their next one), and a run-wide operation the loop calls every so many
// rounds would then meet a different one (OPERATION_MISMATCH).
void Coordinator::resolve_control_rounds(const std::map<PeerId, proto::ResumeReport>& reports, Outbox& out) {
  std::map<std::uint64_t, const proto::ResumeReport*> pending_ahead;  // the most rounds, by the view's epoch
  for (const auto& [id, report] : reports) {
    if (find_peer(id) == nullptr) continue;
    auto& best = pending_ahead[report.epoch];
    if (best == nullptr || report.pending_count > best->pending_count) best = &report;
  }
  std::map<std::uint32_t, const proto::ResumeReport*> ahead;  // a report with the most outcomes, per group
  for (const auto& [id, report] : reports) {
    const Peer* peer = find_peer(id);
    if (peer == nullptr) continue;  // removed: the lost master had left it out
    auto& best = ahead[peer->group];
    if (best == nullptr || report.control_count > best->control_count) best = &report;
  }
  for (const auto& [id, report] : reports) {
    const Peer* peer = find_peer(id);
    if (peer == nullptr) continue;
    const proto::ResumeReport& best = *ahead.at(peer->group);
    if (report.control_count == best.control_count) {
      const proto::ResumeReport& run_best = *pending_ahead.at(report.epoch);  // it is among them
      if (report.pending_count + 1 == run_best.pending_count && run_best.last_pending_status == LOCKSTEP_OK &&
          report.waiting == static_cast<std::uint16_t>(MsgType::kVotePeersPending)) {
        out.push_back(Event{.text = std::string("forwarding a missed PeersPendingResult (") +
                                    (run_best.last_pending ? "yes" : "no") + ") to " + id.to_string(),
                            .reason = "a peer of another group received it from the lost master",
                            .group = peer->group,
                            .peers = {id}});
        send(*peer, proto::PeersPendingResult{LOCKSTEP_OK, run_best.last_pending, {}}, out);
      }
      continue;
    }
    std::optional<proto::Message> outcome;
    if (report.control_count + 1 == best.control_count) outcome = decode_kept(best.last_control);
    const auto wanted = outcome_of(report.waiting);
    if (!outcome || !wanted || proto::type_of(*outcome) != *wanted) {
      remove_peer(id, LOCKSTEP_STATUS_KICKED,
                  "it missed " + std::to_string(best.control_count - report.control_count) +
                      " outcome(s) of its group's rounds that others received",
                  /*connection_open=*/true, /*straggler=*/false, out);
      continue;
    }
    out.push_back(Event{.text = std::string("forwarding a missed ") + proto::msg_type_name(*wanted) + " to " +
                                id.to_string(),
                        .reason = "another peer of its group received it from the lost master",
                        .group = peer->group,
                        .peers = {id}});
    send(*peer, std::move(*outcome), out);
  }
}

}  // namespace lockstep::coord
