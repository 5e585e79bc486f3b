// The coordinator seen from outside: the open rounds (who is done, who is awaited) for
// the status page, a digest of the whole state for the simulations' replay checks, and
// check_invariants(), which the simulations call after every event and the master's
// debug builds assert.
#include "coordinator/coordinator.h"

#include <algorithm>
#include <sstream>

namespace lockstep::coord {

std::vector<OpenRound> Coordinator::open_rounds() const {
  std::vector<OpenRound> rounds;
  const auto split = [&](OpenRound& r, auto&& in_round, auto&& has_done) {
    for (const auto& [id, peer] : peers_) {
      if (!in_round(peer)) continue;
      (has_done(peer) ? r.done : r.waiting).push_back(id);
    }
    if (!r.done.empty() || !r.waiting.empty()) rounds.push_back(std::move(r));
  };
  const auto accepted = [](const Peer& p) { return p.phase == Phase::kAccepted; };
  if (topology_phase_ == TopologyPhase::kVoting) {
    // One vote for both kinds: the first voter's kind names it.
    bool optimize = false;
    for (const auto& [id, peer] : peers_) {
      if (peer.state == PeerState::kVoteOptimizeTopology) optimize = true;
      if (peer.state == PeerState::kVoteAcceptNewPeers) break;
    }
    OpenRound r{.op = optimize ? Operation::kOptimizeTopology : Operation::kUpdateTopology,
                .phase = "voting",
                .started_ms = topology_round_started_ms_};
    split(r, accepted, [](const Peer& p) {
      return p.state == PeerState::kVoteAcceptNewPeers || p.state == PeerState::kVoteOptimizeTopology;
    });
  } else if (topology_phase_ == TopologyPhase::kMeasuring && measurement_ && measurement_->round < measurement_->rounds.size()) {
    std::set<PeerId> in_pairs;
    for (const auto& [a, b] : measurement_->rounds[measurement_->round]) {
      in_pairs.insert(a);
      in_pairs.insert(b);
    }
    OpenRound r{.op = Operation::kOptimizeTopology,
                .phase = "measuring round " + std::to_string(measurement_->round + 1) + " of " +
                         std::to_string(measurement_->rounds.size()),
                .attempt = measurement_->test,
                .started_ms = measurement_->round_started_ms};
    split(r, [&](const Peer& p) { return in_pairs.count(p.id) != 0; }, [](const Peer& p) { return p.measured; });
  } else if (topology_phase_ == TopologyPhase::kEstablishing) {
    OpenRound r{.op = optimizing_ ? Operation::kOptimizeTopology : Operation::kUpdateTopology,
                .phase = "establishing epoch " + std::to_string(epoch_),
                .started_ms = topology_started_ms_};
    split(r, [](const Peer& p) { return p.state == PeerState::kEstablishingP2P; },
          [](const Peer& p) { return p.p2p_reported; });
  }
  if (pending_round_) {
    OpenRound r{.op = Operation::kArePeersPending, .phase = "voting", .started_ms = pending_round_->started_ms};
    split(r, accepted, [](const Peer& p) { return p.voted_pending; });
  }
  for (const auto& [group, round] : agree_rounds_) {
    OpenRound r{.op = Operation::kAgree, .phase = round.failed ? "failed" : "voting", .group = group,
                .started_ms = round.started_ms};
    split(r, [&, g = group](const Peer& p) { return p.phase == Phase::kAccepted && p.group == g; },
          [](const Peer& p) { return p.agree_flag.has_value(); });
  }
  for (const auto& [group, tags] : collectives_) {
    for (const auto& [tag, c] : tags) {
      OpenRound r{.op = Operation::kAllReduce, .group = group, .tag = tag, .attempt = c.attempt,
                  .started_ms = c.started_ms};
      if (c.phase == Collective::Phase::kVoting) {
        r.phase = "voting";
        split(r, [&, g = group](const Peer& p) { return p.phase == Phase::kAccepted && p.group == g; },
              [&votes = c.votes](const Peer& p) { return votes.count(p.id) != 0; });
      } else {
        r.phase = "performing";
        for (const auto& id : c.participants) {
          if (c.lost.count(id) == 0) (c.done.count(id) != 0 ? r.done : r.waiting).push_back(id);
        }
        rounds.push_back(std::move(r));
      }
    }
  }
  for (const auto& [group, sy] : syncs_) {
    OpenRound r{.op = Operation::kSharedStateSync, .group = group, .attempt = sy.attempt, .started_ms = sy.started_ms};
    if (sy.phase == SharedStateSync::Phase::kVoting) {
      r.phase = "voting";
      split(r, [&, g = group](const Peer& p) { return p.phase == Phase::kAccepted && p.group == g; },
            [&votes = sy.votes](const Peer& p) { return votes.count(p.id) != 0; });
    } else {
      r.phase = "transferring";
      for (const auto& id : sy.participants) (sy.done.count(id) != 0 ? r.done : r.waiting).push_back(id);
      rounds.push_back(std::move(r));
    }
  }
  return rounds;
}

std::string Coordinator::digest() const {
  std::ostringstream s;
  s << "epoch=" << epoch_ << " topo=" << to_string(topology_phase_) << " next=" << next_peer_counter_;
  s << " handshaking=[";
  for (const auto& [conn, hs] : handshaking_) s << conn << "@" << hs.observed_host << " ";
  s << "] peers=[";
  for (const auto& [id, p] : peers_) {
    s << id.to_string() << ":" << p.conn << ":" << p.group << ":" << to_string(p.phase) << ":" << to_string(p.state)
      << ":" << p.voted_pending << ":" << (p.agree_flag ? (*p.agree_flag ? "T" : "F") : "-") << ":" << p.p2p_reported
      << ":" << p.unreachable.size() << " ";
  }
  s << "] view_epoch=" << view_epoch_ << " views=[";
  for (const auto& [g, ids] : views_) s << g << ":" << id_list(ids) << " ";
  s << "] rings=[";
  for (const auto& [g, ids] : rings_) {
    s << g << ":";
    for (const auto& id : ids) s << id.to_string() << ",";
    s << " ";
  }
  s << "] proposed=[";
  for (const auto& [g, ids] : proposed_rings_) {
    s << g << ":";
    for (const auto& id : ids) s << id.to_string() << ",";
    s << " ";
  }
  s << "] dirty=" << topology_dirty_ << " newcomers=" << newcomers_.size() << " pending=" << (pending_round_ ? "open" : "-") << " agree=[";
  for (const auto& [g, r] : agree_rounds_) s << g << (r.failed ? ":failed " : ":open ");
  s << "] collectives=[";
  for (const auto& [g, tags] : collectives_) {
    for (const auto& [tag, c] : tags) {
      s << g << "/" << tag << ":" << (c.phase == Collective::Phase::kVoting ? "voting" : "performing") << ":"
        << c.votes.size() << ":" << c.contributions.size() << ":" << c.attempt << ":" << c.done.size() << ":" << c.lost.size() << (c.aborting ? ":aborting" : "") << " ";
    }
  }
  s << "] next_attempt=" << next_attempt_ << " syncs=[";
  for (const auto& [g, sy] : syncs_) {
    s << g << ":" << (sy.phase == SharedStateSync::Phase::kVoting ? "voting" : "transferring") << ":" << sy.votes.size()
      << ":" << sy.attempt << ":" << sy.done.size() << " ";
  }
  s << "] optimizing=" << optimizing_ << " measurement="
    << (measurement_ ? std::to_string(measurement_->test) + "/" + std::to_string(measurement_->round) : "-")
    << " bandwidth=" << bandwidth_.size() << " revisions=[";
  for (const auto& [g, r] : revisions_) s << g << ":" << r << " ";
  s << "] " << kv_.digest();
  return s.str();
}

// Two neighbours of `ring` that both accept no inbound connection (without a relay their
// edge cannot be made), named; nothing if there are none, or if the master has a relay.
std::optional<std::string> Coordinator::unreachable_neighbours(const std::vector<PeerId>& ring) const {
  if (relay_) return std::nullopt;
  return neighbours_accepting_none(ring);
}

std::optional<std::string> Coordinator::neighbours_accepting_none(const std::vector<PeerId>& ring) const {
  const auto refuses = [this](PeerId id) {
    const Peer* p = find_peer(id);
    return p != nullptr && !proto::accepts_inbound(p->info);
  };
  for (std::size_t k = 0; k < ring.size() && ring.size() >= 2; ++k) {
    const PeerId next = ring[(k + 1) % ring.size()];
    if (refuses(ring[k]) && refuses(next)) {
      return "neighbours " + ring[k].to_string() + " and " + next.to_string() + " both accept no inbound connection";
    }
  }
  return std::nullopt;
}

std::map<PeerId, std::uint32_t> Coordinator::relay_members() const {
  std::map<PeerId, std::uint32_t> out;
  if (!relay_) return out;
  for (const auto* rings : {&rings_, &proposed_rings_}) {
    for (const auto& [group, ids] : *rings) {
      for (const PeerId& id : ids) {
        const Peer* p = find_peer(id);
        if (p != nullptr && !proto::accepts_inbound(p->info)) out[id] = group;
      }
    }
  }
  return out;
}

std::optional<std::string> Coordinator::check_invariants() const {
  if (auto kv = kv_.check_invariants([this](PeerId id) { return peers_.count(id) != 0; })) return kv;
  for (const auto& [group, ids] : proposed_rings_) {
    if (auto edge = unreachable_neighbours(ids)) return "proposed ring of group " + std::to_string(group) + ": " + *edge;
  }
  // The ring of each group lists exactly its accepted peers, each once.
  std::size_t in_rings = 0;
  for (const auto& [group, ids] : rings_) {
    if (ids.empty()) return "empty ring kept for group " + std::to_string(group);
    std::set<PeerId> seen;
    for (const auto& id : ids) {
      const Peer* p = find_peer(id);
      if (p == nullptr) return "ring of group " + std::to_string(group) + " lists unknown peer " + id.to_string();
      if (p->phase != Phase::kAccepted || p->group != group) return "ring lists " + id.to_string() + " wrongly";
      if (!seen.insert(id).second) return "ring lists " + id.to_string() + " twice";
    }
    in_rings += ids.size();
    if (auto edge = unreachable_neighbours(ids)) return "ring of group " + std::to_string(group) + ": " + *edge;
    // The ring is its view less the peers removed since, in the view's order.
    const auto view = views_.find(group);
    if (view == views_.end()) return "group " + std::to_string(group) + " has a ring but no view";
    std::size_t m = 0;
    for (std::size_t v = 0; v < view->second.size() && m < ids.size(); ++v) {
      if (view->second[v] == ids[m]) ++m;
    }
    if (m != ids.size()) return "the ring of group " + std::to_string(group) + " is not its view less removed peers";
  }
  std::size_t accepted = 0;
  for (const auto& [id, p] : peers_) {
    if (p.phase == Phase::kAccepted) ++accepted;
    if (by_conn_.count(p.conn) == 0 || by_conn_.at(p.conn) != id) return "connection map broken for " + id.to_string();
    if (p.phase == Phase::kRegistered && (p.voted_pending || p.agree_flag || p.state == PeerState::kVoteAcceptNewPeers)) {
      return "registered peer " + id.to_string() + " is in a vote";
    }
    // Every accepted peer takes part in an establishment; a peer that registered
    // during one waits, idle, for the next.
    if (p.state == PeerState::kEstablishingP2P && topology_phase_ != TopologyPhase::kEstablishing) {
      return "peer " + id.to_string() + " establishes p2p connections outside an establishment";
    }
    if (p.phase == Phase::kAccepted && topology_phase_ == TopologyPhase::kEstablishing &&
        p.state != PeerState::kEstablishingP2P) {
      return "accepted peer " + id.to_string() + " is not part of the establishment";
    }
    if ((p.state == PeerState::kVoteAcceptNewPeers || p.state == PeerState::kVoteOptimizeTopology) &&
        topology_phase_ != TopologyPhase::kVoting) {
      return "peer " + id.to_string() + " votes for a topology update that is not open";
    }
    if ((p.state == PeerState::kMeasuringBandwidth) != (topology_phase_ == TopologyPhase::kMeasuring &&
                                                       p.phase == Phase::kAccepted)) {
      return "peer " + id.to_string() + " and the measurement phase disagree";
    }
  }
  if (accepted != in_rings) return "accepted peers and ring members differ";
  Tally recount;
  for (const auto& [id, p] : peers_) recount.count(p, +1);
  if (!(recount == tally_)) return "the tally of the peers' votes and states differs from a recount";
  if (by_conn_.size() != peers_.size()) return "connection map size differs from peers";
  // One major operation per group: every peer of a group is in the same one.
  std::map<std::uint32_t, std::set<MajorOp>> ops;
  for (const auto& [id, p] : peers_) {
    if (p.phase != Phase::kAccepted) continue;
    ops[p.group].insert(p.state == PeerState::kEstablishingP2P || p.state == PeerState::kMeasuringBandwidth
                            ? MajorOp::kUpdateTopology
                            : MajorOp::kNone);
  }
  for (const auto& [group, set] : ops) {
    if (set.size() > 1) return "group " + std::to_string(group) + " runs more than one major operation";
    if (set.count(MajorOp::kUpdateTopology) != 0 && collectives_.count(group) != 0) {
      return "group " + std::to_string(group) + " runs collectives during an update topology";
    }
  }
  for (const auto& [group, tags] : collectives_) {
    if (tags.empty()) return "empty collective map kept for group " + std::to_string(group);
    for (const auto& [tag, c] : tags) {
      for (const auto& [id, d] : c.votes) {
        const Peer* p = find_peer(id);
        if (p == nullptr || p->phase != Phase::kAccepted || p->group != group) return "collective vote from a non-member";
      }
      for (const auto& id : c.participants) {
        const Peer* p = find_peer(id);
        if (c.lost.count(id) == 0 && (p == nullptr || p->group != group)) return "collective participant is gone or foreign";
        if (c.lost.count(id) != 0 && c.done.count(id) != 0) return "a lost participant counted as reported";
      }
      if (c.lost.size() > c.participants.size()) return "more lost participants than participants";
      if (!c.lost.empty() && !c.aborting) return "an attempt that lost a participant is not aborting";
      if (c.phase == Collective::Phase::kPerforming && c.done.size() + c.lost.size() == c.participants.size()) {
        return "an attempt every participant reported on is still open";
      }
      if (c.phase == Collective::Phase::kVoting && c.votes.empty()) return "collective vote without voters";
    }
  }
  if (pending_round_ && accepted == 0) return "are-peers-pending round open without accepted peers";
  // Shared-state syncs: voters are exactly the peers in VOTE_SYNC of the group; a
  // transfer's participants are in SYNC and nothing else runs in their group.
  for (const auto& [id, p] : peers_) {
    const auto sy = syncs_.find(p.group);
    if (p.state == PeerState::kVoteSync &&
        (sy == syncs_.end() || sy->second.phase != SharedStateSync::Phase::kVoting || sy->second.votes.count(id) == 0)) {
      return "peer " + id.to_string() + " is in VOTE_SYNC without a vote";
    }
    if (p.state == PeerState::kSyncing &&
        (sy == syncs_.end() || sy->second.phase != SharedStateSync::Phase::kTransferring ||
         std::find(sy->second.participants.begin(), sy->second.participants.end(), id) == sy->second.participants.end())) {
      return "peer " + id.to_string() + " is in SYNC without taking part in a transfer";
    }
  }
  for (const auto& [group, sy] : syncs_) {
    if (sy.phase == SharedStateSync::Phase::kVoting) {
      if (sy.votes.empty()) return "shared-state vote without voters in group " + std::to_string(group);
      for (const auto& [id, v] : sy.votes) {
        const Peer* p = find_peer(id);
        if (p == nullptr || p->group != group || p->state != PeerState::kVoteSync) return "stale shared-state vote";
      }
    } else {
      if (collectives_.count(group) != 0) return "group " + std::to_string(group) + " runs collectives during a sync";
      for (const auto& id : sy.participants) {
        const Peer* p = find_peer(id);
        if (p == nullptr || p->state != PeerState::kSyncing) return "sync participant is gone or not syncing";
      }
      if (revisions_.count(group) != 0 && sy.revision != revisions_.at(group) + 1) {
        return "group " + std::to_string(group) + " elected a revision that breaks the revision rule";
      }
    }
  }
  return std::nullopt;
}

}  // namespace lockstep::coord
