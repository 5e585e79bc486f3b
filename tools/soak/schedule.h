// The soak's chaos schedule (docs/soak.md): which fault happens when. A deterministic
// function of the seed, the time and the run's state as the orchestrator sees it: no
// IO, no clock reads, no threads. The orchestrator asks it on every turn of its loop and
// carries out what it decides; the same seed and the same sequence of states give the
// same faults.
//
// One event every event_min_ms..event_max_ms once the run holds a state: kill, spawn and
// stop drawn 2:2:1 (and, in WAN mode, a partition, 2), at most one event in five a
// stop, one stop at a time, never a stop and a partition at once; never the last active
// holder of the state killed, stopped or cut off; never more than peers_max workers
// active, never fewer than peers_min (topped up at once, not an event).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace lockstep::soak {

struct ScheduleConfig {
  std::uint32_t peers_min = 2;
  std::uint32_t peers_max = 6;
  std::uint32_t event_min_ms = 500;
  std::uint32_t event_max_ms = 1000;
  std::uint32_t heartbeat_timeout_ms = 1000;
  // WAN mode: partitions among the events, each lasting partition_min_ms..partition_max_ms.
  bool partitions = false;
  std::uint32_t partition_min_ms = 500;
  std::uint32_t partition_max_ms = 3000;
};

// The run as the orchestrator sees it when it asks.
struct ScheduleState {
  // The run holds a state (its first revision was reported): events may start.
  bool started = false;
  // The active workers (running and not stopped) and those of them that hold the state.
  std::set<std::string> active;
  std::set<std::string> holders;
  // WAN mode: the test bed host of each active worker.
  std::map<std::string, std::uint32_t> hosts;
  // A worker is stopped, or was resumed and has not exited yet.
  bool stop_in_flight = false;
  bool partition_in_flight = false;
};

// What the schedule decided.
struct Fault {
  enum class Kind {
    kNone,       // nothing now
    kTopUp,      // spawn a worker: fewer than peers_min are active (not an event)
    kSpawn,      // spawn a worker
    kKill,       // SIGKILL victim
    kStop,       // SIGSTOP victim, SIGCONT it resume_after_ms later
    kPartition,  // cut host a off (whole_host) or the link a <-> b, for duration_ms
  };
  Kind kind = Kind::kNone;
  std::string victim;
  std::int64_t resume_after_ms = 0;
  bool whole_host = false;
  std::uint32_t a = 0;
  std::uint32_t b = 0;
  std::int64_t duration_ms = 0;
  std::vector<std::string> cut_off;  // the active workers of a cut-off host
};

// The partitions possible in a state: worker hosts that may be cut off (active holders
// remain elsewhere, so the state survives their eviction), and pairs of hosts with
// active workers that may be cut apart (an active holder lives on a third host: the
// master may remove the peers on both sides of the cut).
void partition_choices(const ScheduleState& state, std::vector<std::uint32_t>* hosts,
                       std::vector<std::pair<std::uint32_t, std::uint32_t>>* pairs);

class ChaosSchedule {
 public:
  ChaosSchedule(const ScheduleConfig& config, std::uint64_t seed);

  // What to do at now (milliseconds of any clock that does not go back) in this state.
  Fault next(std::int64_t now, const ScheduleState& state);

  // When the next event is due (unset until the run has started).
  std::optional<std::int64_t> next_event_ms() const { return next_event_ms_; }
  // Events decided so far (a top-up is not one), and stops among them.
  std::uint64_t events() const { return events_; }
  std::uint64_t stops() const { return stops_; }

 private:
  std::int64_t uniform(std::int64_t lo, std::int64_t hi);
  Fault event(const ScheduleState& state);
  Fault partition(const ScheduleState& state);

  ScheduleConfig config_;
  std::mt19937_64 rng_;
  std::optional<std::int64_t> next_event_ms_;
  std::uint64_t events_ = 0;
  std::uint64_t stops_ = 0;
  std::uint64_t whole_partitions_ = 0;
  std::uint64_t pair_partitions_ = 0;
};

}  // namespace lockstep::soak
