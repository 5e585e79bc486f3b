// The coordinator's shared-state sync: vote, revision rule, election, transfer plan and
// outcome (semantics rules 5-7). Same pattern as the rest of the coordinator: handlers
// validate and record, advance() calls try_complete_syncs(), which decides.
#include "common/dtype.h"
#include "coordinator/coordinator.h"

#include <algorithm>
#include <set>
#include <string_view>
#include <tuple>

namespace lockstep::coord {

using proto::MsgType;
using proto::SyncStrategy;

namespace {

// What the election compares: the revision and every tensor's (key, dtype, count,
// digest), by key; a tensor that allows content inequality counts without its digest.
using ContentKey = std::tuple<std::string, std::uint8_t, std::uint64_t, state::Digest>;
using Content = std::pair<std::uint64_t, std::vector<ContentKey>>;

Content content_of(const proto::SyncVote& vote) {
  Content c{vote.revision, {}};
  for (const auto& t : vote.tensors) {
    c.second.emplace_back(t.key, t.dtype, t.count, t.allow_content_inequality ? state::Digest{} : t.hash);
  }
  std::sort(c.second.begin(), c.second.end());
  return c;
}

// A vote's tensors by key: votes hold up to 2048 tensors, and the election looks every
// key of every voter up in the reference and the other way round.
using TensorIndex = std::map<std::string_view, const proto::TensorEntry*>;

TensorIndex index_of(const proto::SyncVote& vote) {
  TensorIndex index;
  for (const auto& t : vote.tensors) index.emplace(t.key, &t);
  return index;
}

const proto::TensorEntry* find_tensor(const TensorIndex& index, const std::string& key) {
  auto it = index.find(key);
  return it == index.end() ? nullptr : it->second;
}

std::string shape_of(const proto::TensorEntry& t) {
  return std::to_string(t.count) + " elements of dtype " + std::to_string(t.dtype);
}

// Why `vote` cannot hold the elected tensors (keys, dtypes, counts), or "" if it can.
std::string shape_mismatch(const proto::SyncVote& vote, const proto::SyncVote& elected) {
  const TensorIndex mine = index_of(vote);
  const TensorIndex theirs = index_of(elected);
  for (const auto& e : elected.tensors) {
    const proto::TensorEntry* t = find_tensor(mine, e.key);
    if (t == nullptr) return "tensor '" + e.key + "' of the elected shared state is missing";
    if (t->dtype != e.dtype || t->count != e.count) {
      return "tensor '" + e.key + "' has " + shape_of(*t) + " but the elected shared state has " + shape_of(e);
    }
  }
  for (const auto& t : vote.tensors) {
    if (find_tensor(theirs, t.key) == nullptr) return "tensor '" + t.key + "' is not in the elected shared state";
  }
  return {};
}

std::uint64_t tensor_bytes(const proto::TensorEntry& t) { return t.count * dtype_bytes(t.dtype); }

}  // namespace

void Coordinator::handle_sync_vote(Peer& peer, const proto::SyncVote& vote, Outbox& out) {
  const MsgType type = MsgType::kSyncVote;
  if (peer.phase != Phase::kAccepted) {
    return refuse(peer, type, LOCKSTEP_STATUS_NOT_INITIALIZED, "peer is not accepted yet", out);
  }
  if (peer.state != PeerState::kIdle || in_control_vote(peer)) {
    return refuse(peer, type, LOCKSTEP_STATUS_INVALID_USAGE,
                  std::string("peer is already in ") + to_string(peer.state) + " or another vote", out);
  }
  if (has_collective_in_flight(peer)) {
    return refuse(peer, type, LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS,
                  "collectives of this peer are still in flight; await them before syncing the shared state", out);
  }
  std::set<std::string> keys;
  for (const auto& t : vote.tensors) {
    if (!keys.insert(t.key).second) {
      return refuse(peer, type, LOCKSTEP_STATUS_INVALID_ARGUMENT, "tensor key '" + t.key + "' appears twice", out);
    }
    if (dtype_bytes(t.dtype) == 0 || t.count > kTensorBytesMax / dtype_bytes(t.dtype)) {
      return refuse(peer, type, LOCKSTEP_STATUS_INVALID_ARGUMENT, "tensor '" + t.key + "' is too large or of an unknown dtype", out);
    }
  }
  auto it = syncs_.find(peer.group);
  if (it != syncs_.end() && it->second.phase == SharedStateSync::Phase::kTransferring) {
    return refuse(peer, type, LOCKSTEP_STATUS_INVALID_USAGE, "a shared-state sync of this group is transferring", out);
  }
  if (it == syncs_.end()) {
    it = syncs_.emplace(peer.group, SharedStateSync{}).first;
    it->second.started_ms = peer.last_seen_ms;  // the vote timeout counts from the first vote
  }
  it->second.votes[peer.id] = vote;
  edit(peer, [](Peer& p) { p.state = PeerState::kVoteSync; });
}

bool Coordinator::try_complete_syncs(Outbox& out) {
  std::vector<std::uint32_t> ready;
  for (const auto& [group, sync] : syncs_) {
    if (sync.phase != SharedStateSync::Phase::kVoting) continue;
    // Looked at member by member only once it has as many votes as the group has members.
    const auto r = rings_.find(group);
    if (r == rings_.end() || sync.votes.size() < r->second.size()) continue;
    bool all = true;
    for (const auto& id : r->second) all = all && sync.votes.count(id) != 0;
    if (all) ready.push_back(group);
  }
  for (const auto group : ready) decide_sync(group, out);
  return !ready.empty();
}

void Coordinator::decide_sync(std::uint32_t group, Outbox& out) {
  const SharedStateSync& sync = syncs_.at(group);
  const std::optional<std::uint64_t> last = revision(group);
  // Rule 5: above the next revision is a violation; the peer leaves, the others go on.
  std::vector<std::pair<PeerId, std::string>> violators;
  if (last) {
    for (const auto& [id, vote] : sync.votes) {
      if (vote.revision > *last + 1) {
        violators.emplace_back(id, "shared-state revision " + std::to_string(vote.revision) + " presented, but the group is at " +
                                       std::to_string(*last) + ": advance the revision by exactly one per sync (" +
                                       std::to_string(*last + 1) + "), or present less to receive the state");
      }
    }
  }
  for (const auto& [id, why] : violators) {
    remove_peer(id, LOCKSTEP_STATUS_REVISION_VIOLATION, why, /*connection_open=*/true, /*straggler=*/false, out);
  }
  if (!violators.empty()) return;  // the vote is complete again without them; advance() decides anew

  // Rule 6: the most popular content among the candidates; ties go to the content of
  // the earliest-accepted peer (the smallest id: ids grow in registration order, and
  // peers are accepted in that order).
  std::map<Content, std::pair<std::size_t, PeerId>> popularity;
  for (const auto& [id, vote] : sync.votes) {  // ordered by id
    if (vote.strategy == SyncStrategy::kReceiveOnly || (last && vote.revision != *last + 1)) continue;
    auto [entry, fresh] = popularity.try_emplace(content_of(vote), 0, id);
    entry->second.first += 1;
  }
  if (popularity.empty()) {
    return finish_sync(group, LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE,
                       last ? "no peer holds revision " + std::to_string(*last + 1) +
                                  " of the shared state (every holder is gone); a peer must present exactly that "
                                  "revision, e.g. restored from a checkpoint"
                            : "no peer may distribute the shared state (every peer syncs receive-only)",
                       out);
  }
  const auto winner = std::max_element(popularity.begin(), popularity.end(), [](const auto& a, const auto& b) {
    return a.second.first != b.second.first ? a.second.first < b.second.first : a.second.second > b.second.second;
  });
  const Content elected = winner->first;
  const PeerId representative = winner->second.second;
  const proto::SyncVote& reference = sync.votes.at(representative);

  // Peers that cannot take the elected content (other keys, dtypes or sizes), and
  // send-only peers that do not hold it, leave; the others go on.
  std::vector<std::pair<PeerId, std::string>> misfits;
  for (const auto& [id, vote] : sync.votes) {
    std::string why = shape_mismatch(vote, reference);
    if (why.empty() && vote.strategy == SyncStrategy::kSendOnly && content_of(vote) != elected) {
      why = "a send-only peer's shared state (revision " + std::to_string(vote.revision) +
            ") differs from the elected content (revision " + std::to_string(elected.first) + ")";
    }
    if (!why.empty()) misfits.emplace_back(id, "shared state mismatch: " + why);
  }
  for (const auto& [id, why] : misfits) {
    remove_peer(id, LOCKSTEP_STATUS_SHARED_STATE_MISMATCH, why, /*connection_open=*/true, /*straggler=*/false, out);
  }
  if (!misfits.empty()) return;
  start_transfers(group, elected.first, representative, out);
}

// Every participant gets its plan. A tensor is received by a peer whose digest differs
// from the representative's, unless the tensor allows content inequality and the peer
// is up to date. Distributors of a tensor are the candidates at the elected revision
// holding the representative's digest of it; large tensors are split into pieces over
// several distributors, always the least loaded ones, so that many receivers do not
// all download from one peer. Of two peers, the one that accepts inbound connections
// is dialled: a distributor that accepts none serves only receivers that do (it dials
// them: SyncPlan.dials), and a peer that needs a tensor no distributor can serve it
// leaves (docs/deployment.md, "NAT").
void Coordinator::start_transfers(std::uint32_t group, std::uint64_t elected_revision, PeerId representative,
                                  Outbox& out) {
  SharedStateSync& sync = syncs_.at(group);
  const proto::SyncVote& reference = sync.votes.at(representative);
  const std::vector<PeerId> members = ring(group);

  const TensorIndex reference_index = index_of(reference);
  std::map<PeerId, TensorIndex> indexes;
  for (const auto& [id, vote] : sync.votes) indexes.emplace(id, index_of(vote));
  std::map<std::string, std::vector<PeerId>> distributors;
  for (const auto& e : reference.tensors) {
    auto& list = distributors[e.key];
    for (const auto& [id, vote] : sync.votes) {
      if (vote.strategy == SyncStrategy::kReceiveOnly || vote.revision != elected_revision) continue;
      const proto::TensorEntry* t = find_tensor(indexes.at(id), e.key);
      if (t != nullptr && t->hash == e.hash) list.push_back(id);
    }
  }
  const auto reachable = [&](PeerId id) { return proto::accepts_inbound(peers_.at(id).info); };
  // The distributors of a tensor that can serve `receiver`: one of the two must accept
  // inbound connections, or, with a relay, the transfer runs through it where no
  // distributor that accepts them holds the tensor (direct ones are preferred).
  const auto sources_for = [&](PeerId receiver, const std::string& key) {
    std::vector<PeerId> from = distributors.at(key);
    if (!reachable(receiver)) {
      std::vector<PeerId> direct = from;
      direct.erase(std::remove_if(direct.begin(), direct.end(), [&](PeerId id) { return !reachable(id); }),
                   direct.end());
      if (!direct.empty() || !relay_) return direct;
    }
    return from;
  };
  // A peer that needs a tensor no source can serve it would fail this sync for
  // everyone, again at every retry: it leaves, and the sync is decided anew without it.
  std::vector<PeerId> unservable;
  for (const auto& [id, vote] : sync.votes) {
    const bool outdated = vote.revision != elected_revision;
    for (const proto::TensorEntry& t : vote.tensors) {
      const proto::TensorEntry& e = *find_tensor(reference_index, t.key);
      if (t.hash == e.hash || (t.allow_content_inequality && !outdated) || tensor_bytes(t) == 0) continue;
      if (sources_for(id, t.key).empty()) {
        unservable.push_back(id);
        break;
      }
    }
  }
  for (const PeerId& id : unservable) {
    remove_peer(id, LOCKSTEP_STATUS_KICKED,
                "this peer accepts no inbound connection and no peer that holds the elected shared state accepts "
                "one, so none can send it to this peer (a peer that holds it and accepts connections must rejoin)",
                /*connection_open=*/true, /*straggler=*/false, out);
  }
  if (!unservable.empty()) return;  // the vote is complete again without them; advance() decides anew
  std::map<PeerId, std::uint64_t> load;
  std::map<PeerId, proto::SyncPlan> plans;
  std::uint64_t total = 0;
  for (const auto& [id, vote] : sync.votes) {
    proto::SyncPlan& plan = plans[id];
    const bool outdated = vote.revision != elected_revision;
    std::vector<std::uint32_t> needed;
    for (std::uint32_t i = 0; i < vote.tensors.size(); ++i) {
      const proto::TensorEntry& t = vote.tensors[i];
      const proto::TensorEntry& e = *find_tensor(reference_index, t.key);
      if (t.hash == e.hash || (t.allow_content_inequality && !outdated)) continue;
      needed.push_back(i);
      plan.expect.push_back(proto::SyncExpect{i, e.hash});
    }
    // Splitting is bounded so that the plan's list of pieces stays within its limit.
    const std::uint64_t pieces_max = needed.empty() ? 1 : std::max<std::uint64_t>(1, limits::kSyncFetchesMax / needed.size());
    std::map<PeerId, std::uint32_t> source_index;
    std::map<PeerId, std::uint64_t> from_source;  // bytes this receiver fetches from each source
    for (const auto i : needed) {
      const proto::TensorEntry& t = vote.tensors[i];
      const std::uint64_t bytes = tensor_bytes(t);
      if (bytes == 0) continue;
      std::vector<PeerId> from = sources_for(id, t.key);
      std::stable_sort(from.begin(), from.end(), [&](PeerId a, PeerId b) { return load[a] < load[b]; });
      const std::uint64_t pieces = std::min<std::uint64_t>(
          {from.size(), std::max<std::uint64_t>(1, bytes / limits::kSyncPieceBytesMin), pieces_max});
      constexpr std::uint64_t kAlign = 4096;
      const std::uint64_t piece = ((bytes + pieces - 1) / pieces + kAlign - 1) / kAlign * kAlign;
      for (std::uint64_t k = 0; k < pieces && k * piece < bytes; ++k) {
        const PeerId source = from[k];
        const std::uint64_t offset = k * piece;
        const std::uint64_t length = std::min(piece, bytes - offset);
        auto [slot, fresh] = source_index.try_emplace(source, static_cast<std::uint32_t>(plan.sources.size()));
        if (fresh) plan.sources.push_back(peers_.at(source).info);
        plan.fetches.push_back(proto::SyncFetch{i, offset, length, slot->second});
        load[source] += length;
        from_source[source] += length;
        total += length;
      }
    }
    // A source that accepts no inbound connection dials this receiver (through the relay
    // where the receiver accepts none either), as many connections as the receiver
    // fetches over from a source (peer/transfer_queue.h).
    for (const auto& [source, bytes] : from_source) {
      if (reachable(source)) continue;
      plans[source].dials.push_back(
          proto::SyncDial{peers_.at(id).info, limits::state_connections(bytes, limits::kStateStreamsDefault)});
    }
  }
  sync.phase = SharedStateSync::Phase::kTransferring;
  sync.attempt = next_attempt_++;
  sync.revision = elected_revision;
  sync.participants = members;
  sync.bytes_planned = total;
  std::size_t receivers = 0;
  for (const auto& id : members) {
    Peer& peer = peers_.at(id);
    edit(peer, [](Peer& p) { p.state = PeerState::kSyncing; });
    proto::SyncPlan& plan = plans.at(id);
    if (!plan.expect.empty()) ++receivers;
    plan.attempt = sync.attempt;
    plan.revision = elected_revision;
    send(peer, std::move(plan), out);
  }
  std::string sources;
  for (const auto& [id, bytes] : load) sources += " " + id.to_string() + "=" + std::to_string(bytes);
  Event event{.text = "group " + std::to_string(group) + " shared-state sync attempt " + std::to_string(sync.attempt) +
                       ": revision " + std::to_string(elected_revision) + " elected (content of " +
                       representative.to_string() + "); " + std::to_string(receivers) + " of " +
                       std::to_string(members.size()) + " peer(s) receive " + std::to_string(total) + " bytes" +
                       (sources.empty() ? "" : "; sent by" + sources),
              .routine = total == 0,
              .kind = EventKind::kStarted,
              .op = Operation::kSharedStateSync,
              .reason = "revision " + std::to_string(elected_revision) + " elected (content of " +
                        representative.to_string() + ")",
              .group = group,
              .peers = members,
              .attempt = sync.attempt,
              .round_started_ms = sync.started_ms};
  out.emplace_back(std::move(event));
}

void Coordinator::handle_sync_done(Peer& peer, const proto::SyncDone& done, Outbox& out) {
  auto it = syncs_.find(peer.group);
  // A report for a transfer that already ended crossed our outcome on the wire.
  if (it == syncs_.end() || it->second.phase != SharedStateSync::Phase::kTransferring ||
      it->second.attempt != done.attempt) {
    return;
  }
  SharedStateSync& sync = it->second;
  if (peer.state != PeerState::kSyncing || sync.done.count(peer.id) != 0) {
    return refuse(peer, MsgType::kSyncDone, LOCKSTEP_STATUS_INVALID_USAGE,
                  "not a participant of sync attempt " + std::to_string(done.attempt) + " or already reported", out);
  }
  if (done.status != LOCKSTEP_OK) {
    // Rule 7: one failed transfer fails the sync for every peer of the group.
    const StatusCode status =
        done.status == LOCKSTEP_STATUS_HASH_MISMATCH ? LOCKSTEP_STATUS_HASH_MISMATCH : LOCKSTEP_STATUS_PEER_CONNECTION_LOST;
    return finish_sync(peer.group, status,
                       "peer " + peer.id.to_string() + " failed its transfers" + (done.reason.empty() ? "" : ": " + done.reason),
                       out);
  }
  sync.done.insert(peer.id);
  if (sync.done.size() == sync.participants.size()) finish_sync(peer.group, LOCKSTEP_OK, {}, out);
}

void Coordinator::finish_sync(std::uint32_t group, StatusCode status, const std::string& reason, Outbox& out) {
  const SharedStateSync sync = syncs_.at(group);
  syncs_.erase(group);
  const bool ok = status == LOCKSTEP_OK;
  if (ok) revisions_[group] = sync.revision;
  std::vector<PeerId> participants;
  for (auto& [id, peer] : peers_) {
    if (peer.group != group || (peer.state != PeerState::kVoteSync && peer.state != PeerState::kSyncing)) continue;
    edit(peer, [](Peer& p) { p.state = PeerState::kIdle; });
    participants.push_back(id);
  }
  send_all(participants, proto::SyncResult{sync.attempt, status, ok ? sync.revision : 0, reason}, out);
  std::vector<PeerId> involved = sync.participants;
  if (involved.empty()) {
    for (const auto& [id, vote] : sync.votes) involved.push_back(id);
  }
  Event event{.text = "group " + std::to_string(group) + " shared-state sync" +
                      (sync.attempt != 0 ? " attempt " + std::to_string(sync.attempt) : std::string()) +
                      (ok ? " succeeded at revision " + std::to_string(sync.revision) : " failed: " + reason),
              .routine = ok && sync.bytes_planned == 0,
              .kind = ok ? EventKind::kSucceeded : EventKind::kFailed,
              .op = Operation::kSharedStateSync,
              .reason = reason,
              .status = status,
              .group = group,
              .peers = std::move(involved),
              .attempt = sync.attempt,
              .round_started_ms = sync.started_ms};
  out.emplace_back(std::move(event));
}

}  // namespace lockstep::coord
