// The coordinator's collectives: the vote on each tag (descriptors compared, refusals
// and the view rule), the attempts started on pool slots with their CollectiveGo, the
// all-reduces that travel with the votes folded here, the peers' reports gathered into
// one CollectiveResult for every participant, and the collectives a major vote blocks.
#include "coordinator/coordinator.h"

#include "kernels/reduce.h"
#include "kernels/vote_carried.h"

#include <algorithm>

namespace lockstep::coord {

using proto::MsgType;

void Coordinator::handle_collective_init(Peer& peer, const proto::CollectiveInit& init, Outbox& out) {
  const MsgType type = MsgType::kCollectiveInit;
  const auto refuse = [&](const Peer& p, MsgType t, StatusCode status, std::string reason, Outbox& o) {
    o.push_back(Event{.text = "refused CollectiveInit from " + p.id.to_string() + ": " + reason,
                      .kind = EventKind::kRefused,
                      .op = Operation::kAllReduce,
                      .reason = reason,
                      .status = status,
                      .group = p.group,
                      .peers = {p.id},
                      .tag = init.tag});
    send(p, proto::Refused{t, init.tag, status, std::move(reason)}, o);
  };
  if (peer.phase != Phase::kAccepted) {
    return refuse(peer, type, LOCKSTEP_STATUS_NOT_INITIALIZED, "peer is not accepted yet", out);
  }
  if (peer.state != PeerState::kIdle) {
    return refuse(peer, type, LOCKSTEP_STATUS_INVALID_USAGE,
                  std::string("collectives cannot start while the peer is in ") + to_string(peer.state), out);
  }
  auto& group = collectives_[peer.group];
  auto it = group.find(init.tag);
  if (it != group.end() &&
      (it->second.votes.count(peer.id) != 0 || it->second.phase == Collective::Phase::kPerforming)) {
    if (group.empty()) collectives_.erase(peer.group);
    return refuse(peer, type, LOCKSTEP_STATUS_INVALID_USAGE,
                  "tag " + std::to_string(init.tag) + " is already in flight", out);
  }
  if (it == group.end() && group.size() >= config_.collectives_per_group_max) {
    if (group.empty()) collectives_.erase(peer.group);
    return refuse(peer, type, LOCKSTEP_STATUS_INVALID_USAGE,
                  "more than " + std::to_string(config_.collectives_per_group_max) + " collectives in flight", out);
  }
  // A small all-reduce carries exactly its contribution, a larger one none (the same rule
  // on both ends); what one peer may park here is bounded.
  const proto::CollectiveDescriptor& d = init.descriptor;
  const bool carried = coll::travels_with_votes(d);
  const std::size_t expected = carried ? d.count * coll::dtype_size(static_cast<lockstep_dtype_t>(d.dtype)) : 0;
  if (init.data.size() != expected) {
    if (group.empty()) collectives_.erase(peer.group);
    return refuse(peer, type, LOCKSTEP_STATUS_INVALID_ARGUMENT,
                  "the vote carries " + std::to_string(init.data.size()) + " bytes of data where its descriptor needs " +
                      std::to_string(expected),
                  out);
  }
  if (carried && contribution_bytes_held(peer) + expected > limits::kVoteCarriedBytesHeldPerPeerMax) {
    if (group.empty()) collectives_.erase(peer.group);
    return refuse(peer, type, LOCKSTEP_STATUS_INVALID_USAGE,
                  "more than " + std::to_string(limits::kVoteCarriedBytesHeldPerPeerMax) +
                      " bytes of small all-reduces waiting for other peers' votes",
                  out);
  }
  if (it == group.end()) {
    it = group.emplace(init.tag, Collective{}).first;
    it->second.started_ms = peer.last_seen_ms;
  }
  it->second.votes[peer.id] = init.descriptor;
  if (carried) it->second.contributions[peer.id] = init.data;
  if (!init.refusal.empty()) it->second.refusals[peer.id] = {init.refusal_status, init.refusal};
}

std::size_t Coordinator::contribution_bytes_held(const Peer& peer) const {
  std::size_t held = 0;
  if (const auto g = collectives_.find(peer.group); g != collectives_.end()) {
    for (const auto& [tag, c] : g->second) {
      if (const auto it = c.contributions.find(peer.id); it != c.contributions.end()) held += it->second.size();
    }
  }
  return held;
}

void Coordinator::handle_collective_done(Peer& peer, const proto::CollectiveDone& done, Outbox& out) {
  auto group = collectives_.find(peer.group);
  if (group == collectives_.end()) return;
  auto it = group->second.find(done.tag);
  // A report for an attempt that already ended (it crossed our outcome on the wire)
  // changes nothing and needs no answer.
  if (it == group->second.end() || it->second.phase != Collective::Phase::kPerforming ||
      it->second.attempt != done.attempt) {
    return;
  }
  Collective& c = it->second;
  // A peer reports `ok` once it holds the result, and `committed` too if its commit
  // exchange ends before the outcome reaches it.
  const bool upgrade = done.ok && done.committed && c.done.count(peer.id) != 0;
  if (!std::binary_search(c.sorted_participants.begin(), c.sorted_participants.end(), peer.id) ||
      (c.done.count(peer.id) != 0 && !upgrade)) {
    return refuse(peer, MsgType::kCollectiveDone, LOCKSTEP_STATUS_INVALID_USAGE,
                  "not a participant of attempt " + std::to_string(done.attempt) + " or already reported", out);
  }
  // One outcome for all (docs/protocol.md, "Completion"): a participant that failed
  // never forwards a commit token, so nobody committed and the attempt fails; one
  // that committed proves that every participant holds the result, so it succeeds.
  if (!done.ok) {
    const std::string reason = !c.abort_reason.empty()
                                   ? c.abort_reason
                                   : "peer " + peer.id.to_string() + " failed attempt " + std::to_string(done.attempt) +
                                         (done.reason.empty() ? "" : ": " + done.reason);
    return finish_collective(peer.group, done.tag, survivors(c), LOCKSTEP_STATUS_PEER_CONNECTION_LOST, reason, out);
  }
  if (done.committed) return finish_collective(peer.group, done.tag, survivors(c), LOCKSTEP_OK, {}, out);
  // It holds the result but saw no commit (its exchange was cut, or the attempt ran by
  // doubling, which has none): the attempt succeeds once every survivor says so.
  c.done.insert(peer.id);
  settle_collective(peer.group, done.tag, out);
}

std::vector<PeerId> Coordinator::survivors(const Collective& c) {
  std::vector<PeerId> out;
  out.reserve(c.participants.size() - c.lost.size());
  for (const PeerId& id : c.participants) {
    if (c.lost.count(id) == 0) out.push_back(id);
  }
  return out;
}

void Coordinator::abort_attempt(std::uint64_t tag, Collective& c, std::string lost_reason, Outbox& out) {
  if (c.abort_reason.empty()) c.abort_reason = std::move(lost_reason);
  if (c.aborting) return;
  c.aborting = true;
  std::vector<PeerId> told;
  for (const PeerId& id : c.participants) {
    if (c.done.count(id) == 0 && c.lost.count(id) == 0) told.push_back(id);
  }
  send_all(told, proto::CollectiveAbort{tag, c.attempt}, out);
}

// Every participant still in the run reported that it holds the result (or none is
// left): the attempt succeeded for them.
void Coordinator::settle_collective(std::uint32_t group, std::uint64_t tag, Outbox& out) {
  const Collective& c = collectives_.at(group).at(tag);
  if (c.done.size() + c.lost.size() == c.participants.size()) {
    finish_collective(group, tag, survivors(c), LOCKSTEP_OK, {}, out);
  }
}

void Coordinator::finish_collective(std::uint32_t group, std::uint64_t tag, std::vector<PeerId> recipients,
                                    StatusCode status, const std::string& reason, Outbox& out,
                                    const std::vector<std::uint8_t>& data) {
  auto& tags = collectives_.at(group);
  const Collective c = std::move(tags.at(tag));  // erased next
  tags.erase(tag);
  if (tags.empty()) collectives_.erase(group);
  const auto world = static_cast<std::uint32_t>(c.participants.size());
  send_all(recipients, proto::CollectiveResult{tag, c.attempt, status, world, reason, data}, out);
  const bool ok = status == LOCKSTEP_OK;
  out.push_back(Event{.text = "group " + std::to_string(group) + " collective tag " + std::to_string(tag) +
                              " attempt " + std::to_string(c.attempt) + (ok ? " succeeded" : " failed: " + reason),
                      .routine = ok,
                      .kind = ok ? EventKind::kSucceeded : EventKind::kFailed,
                      .op = Operation::kAllReduce,
                      .reason = reason,
                      .status = status,
                      .group = group,
                      .peers = c.participants.empty() ? recipients : c.participants,
                      .tag = tag,
                      .attempt = c.attempt,
                      .round_started_ms = c.started_ms});
}

namespace {

// The result of an all-reduce that travelled with the votes: the contributions folded
// in ring order (the first, OP the second, ...), then avg's division once.
std::vector<std::uint8_t> reduce_in_ring_order(const std::map<PeerId, std::vector<std::uint8_t>>& contributions,
                                               const std::vector<PeerId>& ring, const proto::CollectiveDescriptor& d) {
  const auto dtype = static_cast<lockstep_dtype_t>(d.dtype);
  const auto op = static_cast<lockstep_reduce_op_t>(d.op);
  std::vector<std::uint8_t> result = contributions.at(ring.front());
  for (std::size_t k = 1; k < ring.size(); ++k) {
    coll::reduce(result.data(), contributions.at(ring[k]).data(), d.count, dtype, op);
  }
  coll::finalize(result.data(), d.count, dtype, op, static_cast<std::uint32_t>(ring.size()));
  return result;
}

// What makes a descriptor every peer agreed on unusable in its own view (the peers
// refuse these before voting; a peer that does not is answered here), or "".
std::string shape_error(const proto::CollectiveDescriptor& d) {
  if (d.kind == proto::CollectiveKind::kBroadcast && d.root >= d.world) {
    return "broadcast root " + std::to_string(d.root) + " is not a rank of a view of " + std::to_string(d.world);
  }
  if (d.kind == proto::CollectiveKind::kAllGather && !d.counts.empty() && d.counts.size() != d.world) {
    return "all-gather with " + std::to_string(d.counts.size()) + " counts in a view of " + std::to_string(d.world);
  }
  return {};
}

}  // namespace

// Starts every collective whose initiate vote is complete: every accepted peer of the
// group voted for the tag. Differing descriptors fail it for all with a mismatch.
bool Coordinator::try_start_collectives(Outbox& out) {
  bool changed = false;
  for (auto g = collectives_.begin(); g != collectives_.end();) {
    const std::uint32_t group = g->first;
    const auto ring_of_group = rings_.find(group);
    if (ring_of_group == rings_.end() || ring_of_group->second.empty()) {
      ++g;
      continue;
    }
    // Called on every event: a collective is looked at member by member only once it
    // has as many votes as the group has members (a round costs O(members), not
    // O(members^2)).
    std::vector<std::uint64_t> ready;
    for (const auto& [tag, c] : g->second) {
      if (c.phase != Collective::Phase::kVoting || c.votes.size() < ring_of_group->second.size()) continue;
      bool all = true;
      for (const auto& id : ring_of_group->second) all = all && c.votes.count(id) != 0;
      if (all) ready.push_back(tag);
    }
    if (ready.empty()) {
      ++g;
      continue;
    }
    const std::vector<PeerId> members = ring_of_group->second;
    ++g;  // the group may be erased below
    for (const auto tag : ready) {
      changed = true;
      Collective& c = collectives_.at(group).at(tag);
      const proto::CollectiveDescriptor& first = c.votes.begin()->second;
      bool same = true;
      for (const auto& [id, d] : c.votes) same = same && d == first;
      std::vector<PeerId> voters;
      for (const auto& [id, d] : c.votes) voters.push_back(id);
      if (!same) {
        finish_collective(group, tag, voters, LOCKSTEP_STATUS_OPERATION_MISMATCH,
                          "peers started tag " + std::to_string(tag) +
                              " with different collectives, counts, dtype, op, quantization, root or view",
                          out);
        continue;
      }
      const proto::CollectiveDescriptor descriptor = first;
      // Ended before an attempt, the same way for every voter: arguments one of them
      // found unusable, a group of one, a view that lost a peer since the call's shape
      // was set.
      if (!c.refusals.empty()) {
        const auto& [id, refusal] = *c.refusals.begin();
        const auto& [status, why] = refusal;
        std::string who = "peer " + id.to_string();
        if (auto r = std::find(members.begin(), members.end(), id); r != members.end()) {
          who += " (rank " + std::to_string(r - members.begin()) + ")";
        }
        finish_collective(group, tag, voters, status,
                          who +
                              (status == LOCKSTEP_STATUS_NON_FINITE_CONTRIBUTION ? ": its contribution to tag "
                                                                                 : " refused tag ") +
                              std::to_string(tag) + ": " + why,
                          out);
        continue;
      }
      if (members.size() < 2) {
        finish_collective(group, tag, voters, LOCKSTEP_STATUS_TOO_FEW_PEERS,
                          "a collective needs at least two peers; the group has " + std::to_string(members.size()),
                          out);
        continue;
      }
      if (proto::shape_bound(descriptor.kind) && descriptor.world != members.size()) {
        finish_collective(group, tag, voters, LOCKSTEP_STATUS_VIEW_CHANGED,
                          "tag " + std::to_string(tag) + " was called in a view of " + std::to_string(descriptor.world) +
                              " peers and the group now has " + std::to_string(members.size()) +
                              ": update the topology before retrying it",
                          out);
        continue;
      }
      if (const std::string bad = shape_error(descriptor); !bad.empty()) {
        finish_collective(group, tag, voters, LOCKSTEP_STATUS_INVALID_ARGUMENT, bad, out);
        continue;
      }
      const bool carried = !c.contributions.empty();
      if (!carried) c.slot = choose_slot(group, members);  // before this one counts as busy
      c.phase = Collective::Phase::kPerforming;
      c.attempt = next_attempt_++;
      c.participants = members;
      c.sorted_participants = members;
      std::sort(c.sorted_participants.begin(), c.sorted_participants.end());
      c.votes.clear();
      out.push_back(Event{.text = "group " + std::to_string(group) + " collective tag " + std::to_string(tag) +
                                  " attempt " + std::to_string(c.attempt) +
                                  (carried ? " travels with the votes of " + std::to_string(members.size()) + " peer(s)"
                                           : " starts over " + std::to_string(members.size()) + " peer(s) on slot " +
                                                 std::to_string(c.slot)),
                          .routine = true,
                          .kind = EventKind::kStarted,
                          .op = Operation::kAllReduce,
                          .group = group,
                          .peers = members,
                          .tag = tag,
                          .attempt = c.attempt,
                          .round_started_ms = c.started_ms});
      if (carried) {
        // Every participant receives the same bytes: reduced here once, in ring order.
        finish_collective(group, tag, members, LOCKSTEP_OK, {}, out,
                          reduce_in_ring_order(c.contributions, members, descriptor));
        continue;
      }
      // The ring is the group's view less its peers removed since (the ring keeps the
      // view's order): only those travel.
      std::vector<PeerId> absent;
      const std::vector<PeerId>& view = views_.at(group);
      for (std::size_t v = 0, m = 0; v < view.size(); ++v) {
        if (m < members.size() && view[v] == members[m]) {
          ++m;
        } else {
          absent.push_back(view[v]);
        }
      }
      send_all(members, proto::CollectiveGo{tag, c.attempt, c.slot, view_epoch_, std::move(absent)}, out);
    }
  }
  return changed;
}

// The pool slot of a ring attempt: the lowest slot that no attempt of the group is
// performing on, so that concurrent collectives get their own connections while slots
// are free; when every slot is busy, the one with the fewest attempts on it (the lowest
// of those), where the peers take turns in the order of the CollectiveGo messages.
std::uint32_t Coordinator::choose_slot(std::uint32_t group, const std::vector<PeerId>& members) const {
  std::uint16_t pool = 0xffff;
  for (const auto& id : members) pool = std::min(pool, peers_.at(id).pool_size);
  std::vector<std::uint32_t> busy(pool, 0);
  if (auto g = collectives_.find(group); g != collectives_.end()) {
    for (const auto& [tag, c] : g->second) {
      if (c.phase == Collective::Phase::kPerforming && c.contributions.empty() && c.slot < pool) ++busy[c.slot];
    }
  }
  return static_cast<std::uint32_t>(std::min_element(busy.begin(), busy.end()) - busy.begin());
}

bool Coordinator::has_collective_in_flight(const Peer& peer) const {
  auto it = collectives_.find(peer.group);
  if (it == collectives_.end()) return false;
  for (const auto& [tag, c] : it->second) {
    if (c.votes.count(peer.id) != 0) return true;
    if (std::find(c.participants.begin(), c.participants.end(), peer.id) != c.participants.end()) return true;
  }
  return false;
}

// A collective still being voted on in a group where a peer is in the update-topology
// or shared-state vote can never start: that peer may not initiate it, and the voters
// may not join the other vote before their collectives end. It fails at once for its
// voters.
bool Coordinator::fail_collectives_blocked_by_major_vote(Outbox& out) {
  // Nothing to fail (and no walk over every peer) while no collective is being voted on.
  const auto voting = [](const auto& tags) {
    return std::any_of(tags.second.begin(), tags.second.end(),
                       [](const auto& c) { return c.second.phase == Collective::Phase::kVoting; });
  };
  if (std::none_of(collectives_.begin(), collectives_.end(), voting)) return false;
  std::vector<std::uint32_t> groups;
  for (const auto& [group, t] : tally_.groups) {
    if (t.major_voters != 0) groups.push_back(group);
  }
  bool changed = false;
  for (const auto group : groups) {
    auto g = collectives_.find(group);
    if (g == collectives_.end()) continue;
    std::vector<std::pair<std::uint64_t, std::vector<PeerId>>> doomed;
    for (const auto& [tag, c] : g->second) {
      if (c.phase != Collective::Phase::kVoting) continue;
      std::vector<PeerId> voters;
      for (const auto& [id, d] : c.votes) voters.push_back(id);
      doomed.emplace_back(tag, std::move(voters));
    }
    for (const auto& [tag, voters] : doomed) {
      changed = true;
      finish_collective(group, tag, voters, LOCKSTEP_STATUS_OPERATION_MISMATCH,
                        "a peer of the group is in an update-topology or shared-state vote; every peer must await "
                        "its collectives first",
                        out);
    }
  }
  return changed;
}

}  // namespace lockstep::coord
