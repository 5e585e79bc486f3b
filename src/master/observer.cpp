// Observer implementation: counters from structured events, and the two renderings
// (JSON for the status page, Prometheus text for scrapers). Both are built on demand on
// the master's loop thread, from the coordinator's read-only views.
#include "master/observer.h"

#include "common/limits.h"
#include "common/status.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace lockstep::master {
namespace {

using coord::EventKind;
using coord::Operation;
using nlohmann::json;

constexpr Operation kOperations[] = {Operation::kUpdateTopology, Operation::kOptimizeTopology,
                                     Operation::kArePeersPending, Operation::kAgree,
                                     Operation::kAllReduce,       Operation::kSharedStateSync};

std::int64_t second_of(TimeMs ms) { return ms >= 0 ? ms / 1000 : -((-ms + 999) / 1000); }

// A label value in the text format: backslash, double quote and newline escaped.
std::string label_value(const std::string& value) {
  std::string out;
  for (const char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string number(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", value);
  return buf;
}

// Writes one metric family: HELP and TYPE once, then its samples.
class Family {
 public:
  Family(std::ostringstream& out, const std::string& name, const char* type, const char* help) : out_(out), name_(name) {
    out_ << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
  }
  Family& sample(const std::vector<std::pair<std::string, std::string>>& labels, double value,
                 const std::string& suffix = "") {
    out_ << name_ << suffix;
    if (!labels.empty()) {
      out_ << "{";
      for (std::size_t i = 0; i < labels.size(); ++i) {
        out_ << (i ? "," : "") << labels[i].first << "=\"" << label_value(labels[i].second) << "\"";
      }
      out_ << "}";
    }
    out_ << " " << number(value) << "\n";
    return *this;
  }

 private:
  std::ostringstream& out_;
  std::string name_;
};

json ids_json(const std::vector<PeerId>& ids) {
  json out = json::array();
  for (const auto& id : ids) out.push_back(id.to_string());
  return out;
}

// The slowest edge of a group's ring (bytes/s), if every edge of it was measured.
std::optional<double> predicted_bottleneck(const coord::Coordinator& c, const std::vector<PeerId>& ring) {
  if (ring.size() < 2) return std::nullopt;
  double slowest = 0;
  for (std::size_t i = 0; i < ring.size(); ++i) {
    auto it = c.bandwidth().find({ring[i], ring[(i + 1) % ring.size()]});
    if (it == c.bandwidth().end()) return std::nullopt;
    const auto rate = static_cast<double>(it->second);
    slowest = i == 0 ? rate : std::min(slowest, rate);
  }
  return slowest;
}

// The pool slots a group's collectives can use now: the smallest pool of its ring's
// peers (as the coordinator chooses slots); 0 without a ring.
std::uint32_t pool_slots(const coord::Coordinator& c, const std::vector<PeerId>& ring) {
  std::uint32_t pool = 0;
  for (std::size_t i = 0; i < ring.size(); ++i) {
    const coord::Peer* p = c.find_peer(ring[i]);
    const std::uint32_t size = p == nullptr ? 1 : p->pool_size;
    pool = i == 0 ? size : std::min(pool, size);
  }
  return std::min(pool, limits::kP2PPoolSizeMax);
}

}  // namespace

void Observer::on_event(const coord::Event& event, TimeMs now_ms) {
  switch (event.kind) {
    case EventKind::kStarted: ++started_[event.op]; break;
    case EventKind::kSucceeded: ++succeeded_[event.op]; break;
    case EventKind::kFailed:
      ++failed_[event.op];
      ++failures_[{event.op, status_name(event.status)}];
      break;
    case EventKind::kRefused: ++refusals_[event.op]; break;
    case EventKind::kRegistered: ++registrations_; break;
    case EventKind::kRejected: ++rejections_; break;
    case EventKind::kRemoved:
      ++removals_[status_name(event.status)];
      for (const auto& id : event.peers) peer_bytes_.erase(id);
      break;
    case EventKind::kVoteMismatch: ++vote_mismatches_; break;
    case EventKind::kInfo: break;
  }
  if ((event.kind == EventKind::kSucceeded || event.kind == EventKind::kFailed) && event.round_started_ms) {
    Histogram& h = latency_[event.op];
    const double seconds = static_cast<double>(std::max<TimeMs>(0, now_ms - *event.round_started_ms)) / 1000.0;
    const auto bucket = std::lower_bound(kLatencyBucketsS.begin(), kLatencyBucketsS.end(), seconds);
    if (bucket != kLatencyBucketsS.end()) ++h.buckets[static_cast<std::size_t>(bucket - kLatencyBucketsS.begin())];
    ++h.count;
    h.sum_s += seconds;
  }
  remember(event, now_ms);
}

void Observer::remember(const coord::Event& event, TimeMs now_ms) {
  Stored stored{next_seq_++, now_ms, event, 0};
  if (stored.event.peers.size() > limits::kEventPeersListedMax) {
    stored.peers_omitted = stored.event.peers.size() - limits::kEventPeersListedMax;
    stored.event.peers.resize(limits::kEventPeersListedMax);
  }
  auto& buffer = event.routine ? routine_events_ : events_;
  const std::size_t max = event.routine ? limits::kObservedRoutineEventsMax : limits::kObservedEventsMax;
  buffer.push_back(std::move(stored));
  while (buffer.size() > max) buffer.pop_front();
}

void Observer::on_bytes_reported(PeerId peer, bool all_reduce, std::uint64_t bytes_sent, std::uint64_t bytes_received,
                                 TimeMs now_ms) {
  (all_reduce ? all_reduce_sent_ : sync_sent_) += bytes_sent;
  (all_reduce ? all_reduce_received_ : sync_received_) += bytes_received;
  PeerBytes& p = peer_bytes_[peer];
  p.sent += bytes_sent;
  p.received += bytes_received;
  // A sync's sender may still be serving when it reports; what each receiver got is
  // complete, so syncs count the bytes received.
  add_throughput(all_reduce, all_reduce ? bytes_sent : bytes_received, now_ms);
}

void Observer::on_slot_bytes_reported(const coord::Coordinator& c, PeerId peer, std::uint64_t tag,
                                      std::uint64_t attempt, std::uint64_t bytes_sent, std::uint64_t bytes_received) {
  const coord::Peer* p = c.find_peer(peer);
  if (p == nullptr) return;
  std::pair<std::uint32_t, std::uint32_t> key;
  if (const auto known = attempt_slots_.find(attempt); known != attempt_slots_.end()) {
    if (known->second.first != p->group) return;
    key = known->second;  // also a report after the attempt ended on a commit
  } else {
    const auto group = c.collectives().find(p->group);
    if (group == c.collectives().end()) return;
    const auto it = group->second.find(tag);
    if (it == group->second.end()) return;
    const coord::Collective& collective = it->second;
    if (collective.phase != coord::Collective::Phase::kPerforming || collective.attempt != attempt ||
        !collective.contributions.empty() || collective.slot >= limits::kP2PPoolSizeMax) {
      return;
    }
    key = {p->group, collective.slot};
    if (attempt_slots_.size() >= kAttemptSlotsMax) attempt_slots_.erase(attempt_slots_.begin());
    attempt_slots_.emplace(attempt, key);
  }
  const auto first = slot_bytes_.lower_bound({p->group, 0});
  if (first == slot_bytes_.end() || first->first.first != p->group) {
    // A group seen for the first time: forget the groups that have no peer any more.
    std::set<std::uint32_t> present;
    for (const auto& [id, other] : c.peers()) present.insert(other.group);
    for (auto e = slot_bytes_.begin(); e != slot_bytes_.end();) {
      e = present.count(e->first.first) == 0 ? slot_bytes_.erase(e) : std::next(e);
    }
  }
  PeerBytes& bytes = slot_bytes_[key];
  bytes.sent += bytes_sent;
  bytes.received += bytes_received;
}

void Observer::add_throughput(bool all_reduce, std::uint64_t bytes, TimeMs now_ms) {
  const std::int64_t second = second_of(now_ms);
  if (throughput_.empty() || throughput_.back().second < second) throughput_.push_back(Bucket{second, 0, 0});
  Bucket& b = throughput_.back();  // the clock is monotonic: never an older second
  (all_reduce ? b.all_reduce_bytes : b.sync_bytes) += bytes;
  while (!throughput_.empty() && throughput_.front().second <= second - limits::kThroughputHistorySeconds) {
    throughput_.pop_front();
  }
}

bool Observer::stalled(const coord::OpenRound& round, TimeMs now_ms) const {
  return stall_after_ms_ > 0 && !round.waiting.empty() && now_ms - round.started_ms >= stall_after_ms_;
}

std::vector<std::string> Observer::check_stalls(const coord::Coordinator& coordinator, TimeMs now_ms) {
  std::vector<std::string> lines;
  std::set<RoundKey> open;
  for (const auto& r : coordinator.open_rounds()) {
    const RoundKey key{static_cast<int>(r.op), r.group.value_or(~0u), r.tag, r.attempt, r.started_ms};
    open.insert(key);
    if (!stalled(r, now_ms) || reported_stalls_.count(key) != 0) continue;
    reported_stalls_.insert(key);
    ++stalls_;
    std::string waiting;
    for (const auto& id : r.waiting) {
      if (!waiting.empty()) waiting += ' ';
      waiting += id.to_string();
    }
    std::string line = std::string("stall: ") + coord::to_string(r.op) +
                       (r.group ? " of group " + std::to_string(*r.group) : std::string()) +
                       (r.tag != 0 || r.op == Operation::kAllReduce ? " tag " + std::to_string(r.tag) : std::string()) +
                       " (" + r.phase + ") has waited " + std::to_string((now_ms - r.started_ms) / 1000) +
                       " s for " + std::to_string(r.waiting.size()) + " peer(s): " + waiting;
    coord::Event event{.text = line,
                       .op = r.op,
                       .reason = "waiting for " + waiting,
                       .group = r.group,
                       .peers = r.waiting,
                       .tag = r.tag,
                       .attempt = r.attempt};
    remember(event, now_ms);
    lines.push_back(std::move(line));
  }
  // Forget rounds that ended, so that the set stays as small as the open rounds.
  for (auto it = reported_stalls_.begin(); it != reported_stalls_.end();) {
    it = open.count(*it) == 0 ? reported_stalls_.erase(it) : std::next(it);
  }
  return lines;
}

std::string Observer::state_json(const coord::Coordinator& c, TimeMs now_ms) const {
  json root;
  root["now_ms"] = now_ms;
  root["epoch"] = c.epoch();
  root["topology_phase"] = coord::to_string(c.topology_phase());
  root["stall_after_ms"] = stall_after_ms_;
  // Failover: this master's term, whether it is taking a lost master's run back, and the
  // last such recovery (which peers came back, which were treated as lost, how long).
  root["term"] = c.term();
  root["recovering"] = c.recovering();
  if (const auto& r = c.last_recovery()) {
    json back = json::array();
    for (const PeerId& id : r->back) back.push_back(id.to_string());
    json missing = json::array();
    for (const PeerId& id : r->missing) missing.push_back(id.to_string());
    root["last_recovery"] = json{{"started_ms", r->started_ms},
                                 {"ms", r->finished_ms - r->started_ms},
                                 {"back", std::move(back)},
                                 {"missing", std::move(missing)}};
  } else {
    root["last_recovery"] = nullptr;
  }
  // The hot standby: whether this master serves, and which one does.
  if (ha_) {
    root["ha"] = json{{"store", ha_->store},
                      {"serving", ha_->serving},
                      {"holder", ha_->holder},
                      {"elections", ha_->elections},
                      {"step_downs", ha_->step_downs}};
  } else {
    root["ha"] = nullptr;
  }

  // Peers, with their rank in the ring (accepted peers) and the bytes they reported.
  std::map<PeerId, std::size_t> ranks;
  for (const auto& [group, ring] : c.rings()) {
    for (std::size_t i = 0; i < ring.size(); ++i) ranks[ring[i]] = i;
  }
  json peers = json::array();
  for (const auto& [id, p] : c.peers()) {
    json votes = json::array();
    if (p.voted_pending) votes.push_back("are_peers_pending");
    if (p.agree_flag) votes.push_back("agree");
    json peer{{"id", id.to_string()},
              {"host", p.info.host},
              {"p2p_port", p.info.p2p_port},
              {"shared_state_port", p.info.shared_state_port},
              {"benchmark_port", p.info.benchmark_port},
              {"group", p.group},
              {"phase", coord::to_string(p.phase)},
              {"state", coord::to_string(p.state)},
              {"votes", votes},
              {"collective_in_flight", c.has_collective_in_flight(p)},
              {"last_seen_ms_ago", now_ms - p.last_seen_ms}};
    if (auto r = ranks.find(id); r != ranks.end()) peer["rank"] = r->second;
    else peer["rank"] = nullptr;
    const auto bytes = peer_bytes_.find(id);
    peer["bytes_sent"] = bytes == peer_bytes_.end() ? 0 : bytes->second.sent;
    peer["bytes_received"] = bytes == peer_bytes_.end() ? 0 : bytes->second.received;
    peers.push_back(std::move(peer));
  }
  root["peers"] = std::move(peers);
  root["kv"] = json{{"keys", c.kv().keys()}, {"bytes", c.kv().bytes()}, {"waits", c.kv().waits()}};

  // Per pool slot of a group: the ring bytes reported on it and the all-reduce attempts
  // running on it now; every slot of the current pool, and any other that carried bytes.
  const auto slots_json = [&](std::uint32_t group, const std::vector<PeerId>& ring) {
    std::map<std::uint32_t, std::uint64_t> running;
    if (auto g = c.collectives().find(group); g != c.collectives().end()) {
      for (const auto& [tag, collective] : g->second) {
        if (collective.phase == coord::Collective::Phase::kPerforming && collective.contributions.empty()) {
          ++running[collective.slot];
        }
      }
    }
    std::set<std::uint32_t> slots;
    for (std::uint32_t k = 0; k < pool_slots(c, ring); ++k) slots.insert(k);
    for (auto it = slot_bytes_.lower_bound({group, 0}); it != slot_bytes_.end() && it->first.first == group; ++it) {
      slots.insert(it->first.second);
    }
    json out = json::array();
    for (const auto slot : slots) {
      const auto bytes = slot_bytes_.find({group, slot});
      const auto in_flight = running.find(slot);
      out.push_back({{"slot", slot},
                     {"bytes_sent", bytes == slot_bytes_.end() ? 0 : bytes->second.sent},
                     {"bytes_received", bytes == slot_bytes_.end() ? 0 : bytes->second.received},
                     {"in_flight", in_flight == running.end() ? 0 : in_flight->second}});
    }
    return out;
  };

  // Groups: every group with a peer or a revision.
  std::set<std::uint32_t> group_ids;
  for (const auto& [id, p] : c.peers()) group_ids.insert(p.group);
  for (const auto& [group, ring] : c.rings()) group_ids.insert(group);
  json groups = json::array();
  for (const auto group : group_ids) {
    const std::vector<PeerId> ring = c.ring(group);
    json g{{"group", group}, {"ring", ids_json(ring)}, {"major_operation", coord::to_string(c.major_op(group))}};
    const auto revision = c.revision(group);
    g["revision"] = revision ? json(*revision) : json(nullptr);
    const auto bottleneck = predicted_bottleneck(c, ring);
    g["bottleneck_bytes_per_s"] = bottleneck ? json(*bottleneck) : json(nullptr);
    // The measured matrix in ring order (null: not measured); only for groups small
    // enough to draw.
    if (ring.size() <= limits::kBandwidthMatrixPeersMax) {
      json matrix = json::array();
      for (const auto& from : ring) {
        json row = json::array();
        for (const auto& to : ring) {
          auto it = c.bandwidth().find({from, to});
          row.push_back(from != to && it != c.bandwidth().end() ? json(it->second) : json(nullptr));
        }
        matrix.push_back(std::move(row));
      }
      g["bandwidth"] = std::move(matrix);
    } else {
      g["bandwidth"] = nullptr;
    }
    g["slots"] = slots_json(group, ring);
    groups.push_back(std::move(g));
  }
  root["groups"] = std::move(groups);

  json rounds = json::array();
  for (const auto& r : c.open_rounds()) {
    json round{{"operation", coord::to_string(r.op)},
               {"phase", r.phase},
               {"group", r.group ? json(*r.group) : json(nullptr)},
               {"tag", r.tag},
               {"attempt", r.attempt},
               {"age_ms", now_ms - r.started_ms},
               {"done", ids_json(r.done)},
               {"waiting", ids_json(r.waiting)},
               {"stalled", stalled(r, now_ms)}};
    rounds.push_back(std::move(round));
  }
  root["operations"] = std::move(rounds);

  json counters;
  for (const auto op : kOperations) {
    const auto get = [op](const auto& m) {
      auto it = m.find(op);
      return it == m.end() ? std::uint64_t{0} : it->second;
    };
    counters["operations"][coord::to_string(op)] = {
        {"started", get(started_)}, {"succeeded", get(succeeded_)}, {"failed", get(failed_)}, {"refused", get(refusals_)}};
  }
  json failures = json::object();
  for (const auto& [key, n] : failures_) failures[coord::to_string(key.first)][key.second] = n;
  counters["failures"] = std::move(failures);
  counters["removals"] = removals_;
  counters["registrations"] = registrations_;
  counters["rejections"] = rejections_;
  counters["vote_mismatches"] = vote_mismatches_;
  counters["stalls"] = stalls_;
  counters["bytes"] = {{"all_reduce", {{"sent", all_reduce_sent_}, {"received", all_reduce_received_}}},
                       {"shared_state_sync", {{"sent", sync_sent_}, {"received", sync_received_}}}};
  json latency = json::object();
  for (const auto& [op, h] : latency_) {
    latency[coord::to_string(op)] = {{"count", h.count}, {"sum_s", h.sum_s}};
  }
  counters["consensus_latency"] = std::move(latency);
  root["counters"] = std::move(counters);

  // Throughput: bytes sent per second as peers reported them, the last seconds first
  // filled in with zeros so that a chart can draw the time axis as it is.
  json throughput = json::array();
  const std::int64_t last = second_of(now_ms);
  if (!throughput_.empty()) {
    const std::int64_t first = std::max(throughput_.front().second, last - limits::kThroughputHistorySeconds + 1);
    auto it = throughput_.begin();
    for (std::int64_t s = first; s <= last; ++s) {
      while (it != throughput_.end() && it->second < s) ++it;
      const bool here = it != throughput_.end() && it->second == s;
      throughput.push_back({{"t_s", s},
                            {"all_reduce", here ? it->all_reduce_bytes : 0},
                            {"shared_state_sync", here ? it->sync_bytes : 0}});
    }
  }
  root["throughput"] = std::move(throughput);

  // The recent events, oldest first.
  std::vector<const Stored*> merged;
  for (const auto& e : events_) merged.push_back(&e);
  for (const auto& e : routine_events_) merged.push_back(&e);
  std::sort(merged.begin(), merged.end(), [](const Stored* a, const Stored* b) { return a->seq < b->seq; });
  json events = json::array();
  for (const Stored* s : merged) {
    const coord::Event& e = s->event;
    json item{{"seq", s->seq},
              {"t_ms", s->time_ms},
              {"kind", coord::to_string(e.kind)},
              {"operation", coord::to_string(e.op)},
              {"routine", e.routine},
              {"text", e.text},
              {"reason", e.reason},
              {"status", status_name(e.status)},
              {"group", e.group ? json(*e.group) : json(nullptr)},
              {"peers", ids_json(e.peers)},
              {"peers_omitted", s->peers_omitted}};
    if (e.tag != 0 || e.op == Operation::kAllReduce) item["tag"] = e.tag;
    if (e.attempt != 0) item["attempt"] = e.attempt;
    events.push_back(std::move(item));
  }
  root["events"] = std::move(events);
  // Invalid UTF-8 (a host name or reason from a peer) is replaced, never thrown on.
  return root.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string Observer::metrics_text(const coord::Coordinator& c, TimeMs now_ms) const {
  std::ostringstream out;
  {
    // Every (group, phase, state) with a peer; a scraper sees a missing series as 0.
    std::map<std::tuple<std::uint32_t, std::string, std::string>, std::size_t> counts;
    for (const auto& [id, p] : c.peers()) ++counts[{p.group, coord::to_string(p.phase), coord::to_string(p.state)}];
    Family f(out, "lockstep_peers", "gauge", "Peers of the run by group, connection phase and state.");
    for (const auto& [key, n] : counts) {
      f.sample({{"group", std::to_string(std::get<0>(key))}, {"phase", std::get<1>(key)}, {"state", std::get<2>(key)}},
               static_cast<double>(n));
    }
  }
  Family(out, "lockstep_topology_epoch", "gauge", "Topology epoch (advances with every p2p establishment).")
      .sample({}, static_cast<double>(c.epoch()));
  Family(out, "lockstep_master_term", "gauge",
         "This master's term (failover: above every term its peers granted to an earlier master).")
      .sample({}, static_cast<double>(c.term()));
  Family(out, "lockstep_master_serving", "gauge",
         "1 while this master serves the run; 0 while it is a hot standby (another holds the lease).")
      .sample({}, !ha_ || ha_->serving ? 1.0 : 0.0);
  if (ha_) {
    Family(out, "lockstep_master_elections_total", "counter", "Times this master won the run's lease.")
        .sample({}, static_cast<double>(ha_->elections));
    Family(out, "lockstep_master_step_downs_total", "counter", "Times this master lost the lease and stopped serving.")
        .sample({}, static_cast<double>(ha_->step_downs));
  }
  Family(out, "lockstep_recovering", "gauge", "1 while this master takes a lost master's run back, else 0.")
      .sample({}, c.recovering() ? 1.0 : 0.0);
  if (const auto& r = c.last_recovery()) {
    Family(out, "lockstep_last_recovery_seconds", "gauge", "How long the last recovery took.")
        .sample({}, static_cast<double>(r->finished_ms - r->started_ms) / 1000.0);
    Family(out, "lockstep_last_recovery_peers", "gauge", "Peers of the last recovery: taken back, or missing.")
        .sample({{"outcome", "back"}}, static_cast<double>(r->back.size()))
        .sample({{"outcome", "missing"}}, static_cast<double>(r->missing.size()));
  }
  {
    Family f(out, "lockstep_peers_registered_total", "counter", "Peers given an identity (joins).");
    f.sample({}, static_cast<double>(registrations_));
  }
  {
    Family f(out, "lockstep_connections_rejected_total", "counter",
             "Connections and newcomers turned away before they became peers.");
    f.sample({}, static_cast<double>(rejections_));
  }
  {
    Family f(out, "lockstep_peers_removed_total", "counter", "Peers removed from the run, by status.");
    for (const auto& [status, n] : removals_) f.sample({{"status", status}}, static_cast<double>(n));
  }
  const auto per_op = [&](const char* name, const char* help, const std::map<Operation, std::uint64_t>& m) {
    Family f(out, name, "counter", help);
    for (const auto op : kOperations) {
      auto it = m.find(op);
      f.sample({{"operation", coord::to_string(op)}}, it == m.end() ? 0.0 : static_cast<double>(it->second));
    }
  };
  per_op("lockstep_operations_started_total",
         "Attempts started: collective attempts, sync plans, establishments, optimizations.", started_);
  per_op("lockstep_operations_succeeded_total", "Operations that succeeded for every participant.", succeeded_);
  per_op("lockstep_operations_failed_total", "Operations that failed for every participant.", failed_);
  per_op("lockstep_requests_refused_total", "Requests refused without any change (wrong state or usage).", refusals_);
  {
    Family f(out, "lockstep_operation_failures_total", "counter", "Failed operations by operation and status.");
    for (const auto& [key, n] : failures_) {
      f.sample({{"operation", coord::to_string(key.first)}, {"status", key.second}}, static_cast<double>(n));
    }
  }
  Family(out, "lockstep_vote_mismatches_total", "counter", "Times every open vote failed with OPERATION_MISMATCH.")
      .sample({}, static_cast<double>(vote_mismatches_));
  Family(out, "lockstep_stalls_total", "counter", "Rounds that waited for peers longer than the stall threshold.")
      .sample({}, static_cast<double>(stalls_));
  {
    Family f(out, "lockstep_consensus_round_seconds", "histogram",
             "Time from a round's first vote to its outcome, by operation.");
    for (const auto& [op, h] : latency_) {
      std::uint64_t cumulative = 0;
      for (std::size_t i = 0; i < kLatencyBucketsS.size(); ++i) {
        cumulative += h.buckets[i];
        f.sample({{"operation", coord::to_string(op)}, {"le", number(kLatencyBucketsS[i])}},
                 static_cast<double>(cumulative), "_bucket");
      }
      f.sample({{"operation", coord::to_string(op)}, {"le", "+Inf"}}, static_cast<double>(h.count), "_bucket");
      f.sample({{"operation", coord::to_string(op)}}, h.sum_s, "_sum");
      f.sample({{"operation", coord::to_string(op)}}, static_cast<double>(h.count), "_count");
    }
  }
  {
    Family f(out, "lockstep_reported_bytes_total", "counter",
             "Bytes peers report having moved (all-reduce: ring bytes with headers, or a small all-reduce's data with its vote; sync: tensor bytes).");
    f.sample({{"operation", "all_reduce"}, {"direction", "sent"}}, static_cast<double>(all_reduce_sent_));
    f.sample({{"operation", "all_reduce"}, {"direction", "received"}}, static_cast<double>(all_reduce_received_));
    f.sample({{"operation", "shared_state_sync"}, {"direction", "sent"}}, static_cast<double>(sync_sent_));
    f.sample({{"operation", "shared_state_sync"}, {"direction", "received"}}, static_cast<double>(sync_received_));
  }
  {
    // Every slot of each ring's current pool (0 until it carries bytes), and every slot
    // that carried bytes in a group still present.
    std::map<std::pair<std::uint32_t, std::uint32_t>, PeerBytes> slots = slot_bytes_;
    for (const auto& [g, ring] : c.rings()) {
      for (std::uint32_t k = 0; k < pool_slots(c, ring); ++k) slots.try_emplace({g, k});
    }
    Family f(out, "lockstep_slot_bytes_total", "counter",
             "Ring bytes peers report for all-reduce attempts, by group and p2p pool slot (the connections each "
             "attempt ran on).");
    for (const auto& [key, bytes] : slots) {
      const std::string group = std::to_string(key.first), slot = std::to_string(key.second);
      f.sample({{"group", group}, {"slot", slot}, {"direction", "sent"}}, static_cast<double>(bytes.sent));
      f.sample({{"group", group}, {"slot", slot}, {"direction", "received"}}, static_cast<double>(bytes.received));
    }
  }
  {
    std::map<Operation, std::size_t> running;
    for (const auto& r : c.open_rounds()) ++running[r.op];
    Family f(out, "lockstep_operations_open", "gauge", "Votes and operations in progress, by operation.");
    for (const auto op : kOperations) {
      auto it = running.find(op);
      f.sample({{"operation", coord::to_string(op)}}, it == running.end() ? 0.0 : static_cast<double>(it->second));
    }
  }
  std::set<std::uint32_t> groups;
  for (const auto& [id, p] : c.peers()) groups.insert(p.group);
  for (const auto& [group, ring] : c.rings()) groups.insert(group);
  {
    Family f(out, "lockstep_shared_state_revision", "gauge", "Revision of each group's last successful sync.");
    for (const auto g : groups) {
      if (auto r = c.revision(g)) f.sample({{"group", std::to_string(g)}}, static_cast<double>(*r));
    }
  }
  {
    Family f(out, "lockstep_ring_size", "gauge", "Accepted peers in each group's ring.");
    for (const auto& [g, ring] : c.rings()) f.sample({{"group", std::to_string(g)}}, static_cast<double>(ring.size()));
  }
  {
    Family f(out, "lockstep_ring_bottleneck_bytes_per_second", "gauge",
             "Predicted bottleneck of each group's current ring: its slowest measured edge (only when every edge "
             "is measured).");
    for (const auto& [g, ring] : c.rings()) {
      if (auto b = predicted_bottleneck(c, ring)) f.sample({{"group", std::to_string(g)}}, *b);
    }
  }
  Family(out, "lockstep_bandwidth_edges_measured", "gauge", "Measured directed edges of the bandwidth matrix.")
      .sample({}, static_cast<double>(c.bandwidth().size()));
  Family(out, "lockstep_kv_keys", "gauge", "Keys in the key-value store.").sample({}, static_cast<double>(c.kv().keys()));
  Family(out, "lockstep_kv_bytes", "gauge", "Bytes of the key-value store's keys and values.")
      .sample({}, static_cast<double>(c.kv().bytes()));
  Family(out, "lockstep_kv_waits", "gauge", "Open waits for a key-value store key.")
      .sample({}, static_cast<double>(c.kv().waits()));
  {
    auto it = succeeded_.find(Operation::kOptimizeTopology);
    Family(out, "lockstep_topology_optimizations_total", "counter", "Topology optimizations that rewired the run.")
        .sample({}, it == succeeded_.end() ? 0.0 : static_cast<double>(it->second));
  }
  Family(out, "lockstep_master_uptime_seconds", "gauge", "Seconds since the master started.")
      .sample({}, static_cast<double>(now_ms) / 1000.0);
  return out.str();
}

}  // namespace lockstep::master
