#include "schedule.h"

#include <algorithm>

namespace lockstep::soak {

namespace {

Fault of(Fault::Kind kind) {
  Fault f;
  f.kind = kind;
  return f;
}

// The worker hosts that hold at least one active worker, with those workers.
std::map<std::uint32_t, std::vector<std::string>> active_by_host(const ScheduleState& state) {
  std::map<std::uint32_t, std::vector<std::string>> out;
  for (const auto& name : state.active) out[state.hosts.at(name)].push_back(name);
  return out;
}

}  // namespace

void partition_choices(const ScheduleState& state, std::vector<std::uint32_t>* hosts,
                       std::vector<std::pair<std::uint32_t, std::uint32_t>>* pairs) {
  const auto by_host = active_by_host(state);
  const auto& holders = state.holders;
  const auto holders_on = [&](std::uint32_t host) {
    std::size_t inside = 0;
    for (const auto& n : by_host.at(host)) inside += holders.count(n);
    return inside;
  };
  for (const auto& [host, names] : by_host) {
    if (holders.size() > holders_on(host)) hosts->push_back(host);
    // A cut between two hosts makes the master remove the ring neighbours across it
    // that fail to connect at the next update (both ends): some holder must live on a
    // third host, or the cut may evict every one of them and the state with them.
    for (const auto& [other, unused] : by_host) {
      if (other > host && holders.size() > holders_on(host) + holders_on(other)) pairs->emplace_back(host, other);
    }
  }
}

ChaosSchedule::ChaosSchedule(const ScheduleConfig& config, std::uint64_t seed) : config_(config), rng_(seed) {}

std::int64_t ChaosSchedule::uniform(std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, std::max(lo, hi))(rng_);
}

Fault ChaosSchedule::next(std::int64_t now, const ScheduleState& state) {
  // Events start once the run holds a state (the first revision is reported).
  if (!state.started) return {};
  if (!next_event_ms_) next_event_ms_ = now;
  if (state.active.size() < config_.peers_min) return of(Fault::Kind::kTopUp);
  if (now < *next_event_ms_) return {};
  Fault f = event(state);
  next_event_ms_ = now + uniform(config_.event_min_ms, config_.event_max_ms);
  return f;
}

Fault ChaosSchedule::event(const ScheduleState& state) {
  const auto& active = state.active;
  const auto& holders = state.holders;
  std::vector<std::string> victims;
  // Never the last active holder of the state: a newcomer could not get it back.
  for (const auto& name : active) {
    if (holders.size() >= 2 || holders.count(name) == 0) victims.push_back(name);
  }
  if (holders.empty()) victims.clear();
  const bool can_spawn = active.size() < config_.peers_max;
  const bool can_kill = active.size() > config_.peers_min && !victims.empty();
  // A stop and a partition are never in flight at once (their stalls would add up).
  const bool can_stop =
      can_kill && !state.stop_in_flight && !state.partition_in_flight && (stops_ + 1) * 5 <= events_ + 1;
  bool can_partition = false;
  if (config_.partitions && !state.partition_in_flight && !state.stop_in_flight) {
    std::vector<std::uint32_t> hosts;
    std::vector<std::pair<std::uint32_t, std::uint32_t>> pairs;
    partition_choices(state, &hosts, &pairs);
    can_partition = !hosts.empty() || !pairs.empty();
  }
  const int w_kill = can_kill ? 2 : 0;
  const int w_spawn = can_spawn ? 2 : 0;
  const int w_stop = can_stop ? 1 : 0;
  const int w_partition = can_partition ? 2 : 0;
  if (w_kill + w_spawn + w_stop + w_partition == 0) return {};
  const auto pick = uniform(0, w_kill + w_spawn + w_stop + w_partition - 1);
  ++events_;
  if (pick < w_spawn) return of(Fault::Kind::kSpawn);
  if (pick >= w_spawn + w_kill + w_stop) return partition(state);
  Fault f;
  f.victim = victims[static_cast<std::size_t>(uniform(0, static_cast<std::int64_t>(victims.size()) - 1))];
  if (pick < w_spawn + w_kill) {
    f.kind = Fault::Kind::kKill;
  } else {
    f.kind = Fault::Kind::kStop;
    // Past the heartbeat timeout, so that the master has evicted it when it resumes.
    f.resume_after_ms = config_.heartbeat_timeout_ms + uniform(500, 2000);
    ++stops_;
  }
  return f;
}

Fault ChaosSchedule::partition(const ScheduleState& state) {
  std::vector<std::uint32_t> hosts;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> pairs;
  partition_choices(state, &hosts, &pairs);
  Fault f;
  f.kind = Fault::Kind::kPartition;
  // Where both kinds are possible, the one done fewer times so far (a coin where equal):
  // a pair partition becomes possible only once holders live on three hosts, which may
  // be rare in a short run, and then it should not be missed.
  bool whole = !hosts.empty();
  if (whole && !pairs.empty()) {
    whole = whole_partitions_ == pair_partitions_ ? uniform(0, 1) == 0 : whole_partitions_ < pair_partitions_;
  }
  ++(whole ? whole_partitions_ : pair_partitions_);
  if (whole) {
    f.whole_host = true;
    f.a = hosts[static_cast<std::size_t>(uniform(0, static_cast<std::int64_t>(hosts.size()) - 1))];
    f.cut_off = active_by_host(state)[f.a];
  } else {
    const auto& pair = pairs[static_cast<std::size_t>(uniform(0, static_cast<std::int64_t>(pairs.size()) - 1))];
    f.a = pair.first;
    f.b = pair.second;
  }
  f.duration_ms = uniform(config_.partition_min_ms, config_.partition_max_ms);
  return f;
}

}  // namespace lockstep::soak
