// The coordinator's optimize-topology phase. A run-wide vote (like update topology);
// then the edges of each group that were never measured are measured, in rounds in
// which every peer is in at most one pair (both directions of a pair at once), so the
// whole matrix takes about n-1 rounds; then the solver orders each group's ring for
// the best bottleneck and every accepted peer rewires as in update topology, but
// nobody is admitted. A lost peer fails the phase for everyone
// (TOPOLOGY_OPTIMIZATION_FAILED); measurements already reported are kept, so the
// retry measures only what is missing.
#include "coordinator/coordinator.h"

#include <algorithm>
#include <sstream>

namespace lockstep::coord {

namespace {

std::string mbit(double bytes_per_s) {
  std::ostringstream s;
  s.precision(1);
  s << std::fixed << bytes_per_s * 8 / 1e6 << " Mbit/s";
  return s.str();
}

}  // namespace

topo::Matrix Coordinator::bandwidth_matrix(const std::vector<PeerId>& ids) const {
  topo::Matrix m(ids.size(), std::vector<double>(ids.size(), 0.0));
  for (std::size_t i = 0; i < ids.size(); ++i) {
    for (std::size_t j = 0; j < ids.size(); ++j) {
      if (auto it = bandwidth_.find({ids[i], ids[j]}); i != j && it != bandwidth_.end()) {
        m[i][j] = static_cast<double>(it->second);
      }
    }
  }
  return m;
}

bool Coordinator::try_complete_optimize_vote(TimeMs now_ms, Outbox& out) {
  if (topology_phase_ != TopologyPhase::kVoting || accepted_count() == 0 ||
      tally_.optimize_voters != accepted_count()) {
    return false;
  }
  out.push_back(Event{.text = "optimize-topology vote complete (" + std::to_string(accepted_count()) + " voters)",
                      .kind = EventKind::kStarted,
                      .op = Operation::kOptimizeTopology,
                      .round_started_ms = topology_round_started_ms_});
  start_measurement(now_ms, out);
  return true;
}

// Pairs of each group with an edge never measured, ordered by the round the circle
// method gives them (every peer meets every other once in n-1 rounds, or n when n is
// odd); a greedy pass then packs them into rounds of disjoint pairs.
void Coordinator::start_measurement(TimeMs now_ms, Outbox& out) {
  Measurement m;
  m.test = next_attempt_++;
  std::vector<std::tuple<std::size_t, PeerId, PeerId>> pairs;  // (circle round, initiator, partner)
  for (const auto& [group, ids] : rings_) {
    std::vector<PeerId> sorted = ids;
    std::sort(sorted.begin(), sorted.end());
    const std::size_t n = sorted.size();
    const std::size_t slots = n + (n % 2);  // a bye when odd
    for (std::size_t i = 0; i < n; ++i) {
      for (std::size_t j = i + 1; j < n; ++j) {
        const PeerId a = sorted[i];
        const PeerId b = sorted[j];
        if (bandwidth_.count({a, b}) != 0 && bandwidth_.count({b, a}) != 0) continue;
        // Neither accepts inbound connections: without a relay no test can connect them,
        // and no ring edge either (the solver sees a bandwidth of 0 and keeps them apart
        // if it can); with one, the test runs through it as their edge would.
        if (!relay_ && !proto::accepts_inbound(peers_.at(a).info) && !proto::accepts_inbound(peers_.at(b).info)) {
          bandwidth_[{a, b}] = 0;
          bandwidth_[{b, a}] = 0;
          continue;
        }
        // Circle method: slot k = slots-1 is fixed and meets slot r in round r; two
        // other slots i, j meet in the round r with 2r = i + j (mod k), and since k is
        // odd, 2 has the inverse slots/2.
        const std::size_t k = slots - 1;
        const std::size_t round = j == k ? i : ((i + j) * (slots / 2)) % k;
        pairs.emplace_back(round, a, b);
      }
    }
  }
  std::sort(pairs.begin(), pairs.end());
  std::vector<bool> placed(pairs.size(), false);
  for (std::size_t left = pairs.size(); left > 0;) {
    std::vector<std::pair<PeerId, PeerId>> round;
    std::set<PeerId> busy;
    for (std::size_t i = 0; i < pairs.size(); ++i) {
      const auto& [order, a, b] = pairs[i];
      if (placed[i] || busy.count(a) != 0 || busy.count(b) != 0) continue;
      placed[i] = true;
      busy.insert(a);
      busy.insert(b);
      round.emplace_back(a, b);
      --left;
    }
    m.rounds.push_back(std::move(round));
  }
  for (auto& [id, peer] : peers_) {
    if (peer.phase != Phase::kAccepted) continue;
    edit(peer, [](Peer& p) { p.state = PeerState::kMeasuringBandwidth; });
    peer.measured = false;
  }
  topology_phase_ = TopologyPhase::kMeasuring;
  topology_started_ms_ = now_ms;
  out.push_back(Event{.text = "optimize topology: " + std::to_string(pairs.size()) + " pair(s) to measure in " +
                              std::to_string(m.rounds.size()) + " round(s)",
                      .op = Operation::kOptimizeTopology});
  measurement_ = std::move(m);
  start_round(now_ms, out);
}

void Coordinator::start_round(TimeMs now_ms, Outbox& out) {
  Measurement& m = *measurement_;
  m.round_started_ms = now_ms;
  if (m.round >= m.rounds.size()) return;
  for (const auto& [a, b] : m.rounds[m.round]) {
    const Peer& pa = peers_.at(a);
    const Peer& pb = peers_.at(b);
    const std::uint32_t streams =
        std::min<std::uint32_t>({pa.pool_size, pb.pool_size, std::max<std::uint32_t>(1, config_.bandwidth_streams_max)});
    // The initiator connects to its partner: the one that accepts inbound connections
    // is the partner (both directions are measured either way); where neither does, a
    // (the smaller id) initiates through the relay.
    const bool a_dials = proto::accepts_inbound(pb.info) || !proto::accepts_inbound(pa.info);
    send(pa, proto::BandwidthTest{m.test, pb.info, a_dials, config_.bandwidth_test_ms, streams}, out);
    send(pb, proto::BandwidthTest{m.test, pa.info, !a_dials, config_.bandwidth_test_ms, streams}, out);
  }
}

void Coordinator::handle_bandwidth_report(Peer& peer, const proto::BandwidthReport& report, Outbox& out) {
  const auto refuse_report = [&](const std::string& why) {
    refuse(peer, proto::MsgType::kBandwidthReport, LOCKSTEP_STATUS_INVALID_USAGE, why, out);
  };
  // A report of a test that already ended (the phase failed while it ran) crossed the
  // outcome on the wire: it changes nothing and needs no answer.
  if (!measurement_ || peer.state != PeerState::kMeasuringBandwidth || report.test != measurement_->test) return;
  if (measurement_->round >= measurement_->rounds.size()) return refuse_report("no bandwidth test is waiting");
  const auto& round = measurement_->rounds[measurement_->round];
  const auto pair = std::find_if(round.begin(), round.end(), [&](const auto& p) {
    return (p.first == peer.id && p.second == report.from) || (p.second == peer.id && p.first == report.from);
  });
  if (pair == round.end() || peer.measured) return refuse_report("not a pair of this round, or already reported");
  peer.measured = true;
  bandwidth_[{report.from, peer.id}] = report.bytes_per_s;
}

bool Coordinator::try_complete_round(TimeMs now_ms, Outbox& out) {
  if (topology_phase_ != TopologyPhase::kMeasuring || !measurement_) return false;
  Measurement& m = *measurement_;
  if (m.round < m.rounds.size()) {
    for (const auto& [a, b] : m.rounds[m.round]) {
      if (!peers_.at(a).measured || !peers_.at(b).measured) return false;
    }
    for (const auto& [a, b] : m.rounds[m.round]) {
      peers_.at(a).measured = false;
      peers_.at(b).measured = false;
    }
    ++m.round;
    if (m.round < m.rounds.size()) {
      start_round(now_ms, out);
      return true;
    }
  }
  measurement_.reset();
  auto rings = solve_rings(out);
  start_establish(now_ms, out, rings);
  return true;
}

std::map<std::uint32_t, std::vector<PeerId>> Coordinator::solve_rings(Outbox& out) {
  std::map<std::uint32_t, std::vector<PeerId>> result = rings_;
  for (auto& [group, ids] : result) {
    if (ids.size() < 3) continue;  // one or two peers: every order is the same ring
    const topo::Matrix matrix = bandwidth_matrix(ids);
    topo::Solution best = topo::solve_ring(matrix, topo::Budget{config_.solver_steps});
    auto bg = background_.find(group);
    if (bg != background_.end() && bg->second.members == ids && bg->second.matrix == matrix &&
        topo::better_ring(matrix, bg->second.improver->best().ring, best.ring)) {
      best = bg->second.improver->best();
      out.push_back(Event{.text = "group " + std::to_string(group) + ": the background search found a better ring",
                          .op = Operation::kOptimizeTopology,
                          .group = group});
    }
    std::vector<int> join_order(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) join_order[i] = static_cast<int>(i);
    std::vector<PeerId> ring;
    std::string names;
    for (const int i : best.ring) {
      ring.push_back(ids[static_cast<std::size_t>(i)]);
      if (!names.empty()) names += ' ';
      names += ids[static_cast<std::size_t>(i)].to_string();
    }
    const std::string why = "bottleneck " + mbit(best.bottleneck) + " (" + (best.optimal ? "optimal" : "heuristic") +
                            "), previous order " + mbit(topo::ring_bottleneck(matrix, join_order));
    out.push_back(Event{.text = "group " + std::to_string(group) + ": optimized ring [" + names + "], " + why,
                        .op = Operation::kOptimizeTopology,
                        .reason = why,
                        .group = group,
                        .peers = ring});
    // A solution not proven optimal keeps improving in the background; ring order
    // changes the indices, so the search works on the new order's matrix.
    if (!best.optimal) {
      Background next{ring, bandwidth_matrix(ring), nullptr};
      next.improver = std::make_unique<topo::Improver>(next.matrix, ring.front().lo);
      background_[group] = std::move(next);
    } else {
      background_.erase(group);
    }
    ids = std::move(ring);
  }
  return result;
}

std::uint64_t Coordinator::background_search_steps(std::uint32_t group) const {
  const auto it = background_.find(group);
  return it == background_.end() ? 0 : it->second.improver->steps();
}

void Coordinator::step_background_search() {
  for (auto it = background_.begin(); it != background_.end();) {
    if (ring(it->first) != it->second.members) {
      it = background_.erase(it);  // membership changed: the search no longer applies
      continue;
    }
    const topo::Improver& search = *it->second.improver;
    if (!search.done() && search.steps() - search.best().steps < config_.background_solver_stall_steps) {
      it->second.improver->step(topo::Budget{config_.background_solver_steps_per_tick});
    }
    ++it;
  }
}

void Coordinator::fail_optimize(const std::string& reason, Outbox& out) {
  measurement_.reset();
  topology_phase_ = TopologyPhase::kIdle;
  std::vector<PeerId> participants;
  for (auto& [id, peer] : peers_) {
    if (peer.state != PeerState::kMeasuringBandwidth) continue;
    edit(peer, [](Peer& p) { p.state = PeerState::kIdle; });
    peer.measured = false;
    participants.push_back(id);
  }
  send_all(participants, proto::TopologyResult{epoch_, LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED, reason, {}, {}},
           out);
  out.push_back(Event{.text = "optimize topology failed: " + reason,
                      .kind = EventKind::kFailed,
                      .op = Operation::kOptimizeTopology,
                      .reason = reason,
                      .status = LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED,
                      .round_started_ms = topology_round_started_ms_});
}

// Peers of a round that never report are blamed, like silent establishment participants.
void Coordinator::kick_silent_measurers(TimeMs now_ms, Outbox& out) {
  if (topology_phase_ != TopologyPhase::kMeasuring || !measurement_ ||
      now_ms - measurement_->round_started_ms < config_.measure_round_timeout_ms ||
      measurement_->round >= measurement_->rounds.size()) {
    return;
  }
  std::vector<PeerId> late;
  for (const auto& [a, b] : measurement_->rounds[measurement_->round]) {
    if (!peers_.at(a).measured) late.push_back(a);
    if (!peers_.at(b).measured) late.push_back(b);
  }
  for (const auto& id : late) {
    remove_peer(id, LOCKSTEP_STATUS_KICKED,
                "did not report its bandwidth test within " + std::to_string(config_.measure_round_timeout_ms) + " ms",
                /*connection_open=*/true, /*straggler=*/false, out);
  }
}

}  // namespace lockstep::coord
