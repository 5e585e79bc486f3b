// The soak's chaos schedule (tools/soak/schedule.h) without processes: it gives the
// schedule that the orchestrator gave before the schedule was its own class (recorded
// from `lockstep-soak run --seconds 45 --seed 42`), it is deterministic for a seed, and
// over many seeds of a modelled run it keeps the documented mix and bounds (docs/soak.md).
#include "schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep::soak {
namespace {

using Kind = Fault::Kind;

// The defaults of `lockstep-soak run` (--peers 4..6, 500..1000 ms between events, a
// heartbeat timeout of 1000 ms).
ScheduleConfig defaults() {
  ScheduleConfig c;
  c.peers_min = 2;
  c.peers_max = 6;
  c.event_min_ms = 500;
  c.event_max_ms = 1000;
  c.heartbeat_timeout_ms = 1000;
  return c;
}

// Seed 42 before the split, one line per event: its time (from the first), the state the
// orchestrator saw and what it did ("stop NAME MS": resumed MS later), then "N" and when
// the next event was due.
constexpr const char* kSeed42 = R"(
E 0 active=w1,w2,w3,w4, holders=w1,w2, stopflight=0 part=0 -> kill w3
N 876
E 878 active=w1,w2,w4, holders=w1,w2,w4, stopflight=0 part=0 -> spawn
N 1830
E 1832 active=w1,w2,w4,w5, holders=w1,w2,w4,w5, stopflight=0 part=0 -> spawn
N 2619
E 2626 active=w1,w2,w4,w5,w6, holders=w1,w2,w4,w5,w6, stopflight=0 part=0 -> spawn
N 3263
E 3267 active=w1,w2,w4,w5,w6,w7, holders=w1,w2,w4,w5,w6,w7, stopflight=0 part=0 -> kill w1
N 4029
E 4032 active=w2,w4,w5,w6,w7, holders=w2,w4,w5,w6,w7, stopflight=0 part=0 -> kill w6
N 4946
E 4946 active=w2,w4,w5,w7, holders=w2,w4,w5,w7, stopflight=0 part=0 -> stop w7 2173
N 5469
E 5471 active=w2,w4,w5, holders=w2,w4,w5, stopflight=1 part=0 -> spawn
N 6345
E 6345 active=w2,w4,w5,w8, holders=w2,w4,w5,w8, stopflight=1 part=0 -> spawn
N 7058
E 7062 active=w2,w4,w5,w8,w9, holders=w2,w4,w5,w8,w9, stopflight=1 part=0 -> spawn
N 7634
E 7635 active=w10,w2,w4,w5,w8,w9, holders=w10,w2,w4,w5,w8,w9, stopflight=0 part=0 -> kill w5
N 8358
E 8361 active=w10,w2,w4,w8,w9, holders=w10,w2,w4,w8,w9, stopflight=0 part=0 -> kill w10
N 9234
E 9238 active=w2,w4,w8,w9, holders=w2,w4,w8,w9, stopflight=0 part=0 -> spawn
N 10114
E 10116 active=w11,w2,w4,w8,w9, holders=w11,w2,w4,w8,w9, stopflight=0 part=0 -> stop w11 2890
N 10988
E 10993 active=w2,w4,w8,w9, holders=w2,w4,w8,w9, stopflight=1 part=0 -> spawn
N 11642
E 11645 active=w12,w2,w4,w8,w9, holders=w12,w2,w4,w8,w9, stopflight=1 part=0 -> spawn
N 12495
E 12495 active=w12,w13,w2,w4,w8,w9, holders=w12,w13,w2,w4,w8,w9, stopflight=1 part=0 -> kill w4
N 13239
E 13245 active=w12,w13,w2,w8,w9, holders=w12,w13,w2,w8,w9, stopflight=0 part=0 -> spawn
N 14049
E 14053 active=w12,w13,w14,w2,w8,w9, holders=w12,w13,w14,w2,w8,w9, stopflight=0 part=0 -> kill w14
N 14887
E 14887 active=w12,w13,w2,w8,w9, holders=w12,w13,w2,w8,w9, stopflight=0 part=0 -> kill w2
N 15432
E 15437 active=w12,w13,w8,w9, holders=w12,w13,w8,w9, stopflight=0 part=0 -> spawn
N 16348
E 16352 active=w12,w13,w15,w8,w9, holders=w12,w13,w15,w8,w9, stopflight=0 part=0 -> kill w15
N 17350
E 17351 active=w12,w13,w8,w9, holders=w12,w13,w8,w9, stopflight=0 part=0 -> kill w8
N 18139
E 18141 active=w12,w13,w9, holders=w12,w13,w9, stopflight=0 part=0 -> stop w13 2736
N 18887
E 18895 active=w12,w9, holders=w12,w9, stopflight=1 part=0 -> spawn
N 19550
E 19553 active=w12,w16,w9, holders=w12,w16,w9, stopflight=1 part=0 -> spawn
N 20314
E 20315 active=w12,w16,w17,w9, holders=w12,w16,w17,w9, stopflight=1 part=0 -> spawn
N 21197
E 21199 active=w12,w16,w17,w18,w9, holders=w12,w16,w17,w18,w9, stopflight=0 part=0 -> spawn
N 22042
E 22045 active=w12,w16,w17,w18,w19,w9, holders=w12,w16,w17,w18,w19,w9, stopflight=0 part=0 -> stop w18 2725
N 22939
E 22941 active=w12,w16,w17,w19,w9, holders=w12,w16,w17,w19,w9, stopflight=1 part=0 -> kill w19
N 23642
E 23645 active=w12,w16,w17,w9, holders=w12,w16,w17,w9, stopflight=1 part=0 -> kill w16
N 24295
E 24300 active=w12,w17,w9, holders=w12,w17,w9, stopflight=1 part=0 -> kill w17
N 24976
E 24980 active=w12,w9, holders=w12,w9, stopflight=0 part=0 -> spawn
N 25792
E 25793 active=w12,w20,w9, holders=w12,w20,w9, stopflight=0 part=0 -> kill w20
N 26600
E 26607 active=w12,w9, holders=w12,w9, stopflight=0 part=0 -> spawn
N 27290
E 27295 active=w12,w21,w9, holders=w12,w21,w9, stopflight=0 part=0 -> kill w21
N 27993
E 27993 active=w12,w9, holders=w12,w9, stopflight=0 part=0 -> spawn
N 28864
E 28866 active=w12,w22,w9, holders=w12,w22,w9, stopflight=0 part=0 -> spawn
N 29631
E 29632 active=w12,w22,w23,w9, holders=w12,w22,w23,w9, stopflight=0 part=0 -> spawn
N 30526
E 30526 active=w12,w22,w23,w24,w9, holders=w12,w22,w23,w24,w9, stopflight=0 part=0 -> spawn
N 31072
E 31074 active=w12,w22,w23,w24,w25,w9, holders=w12,w22,w23,w24,w25,w9, stopflight=0 part=0 -> stop w23 1669
N 31920
E 31925 active=w12,w22,w24,w25,w9, holders=w12,w22,w24,w25,w9, stopflight=1 part=0 -> spawn
N 32785
E 32786 active=w12,w22,w24,w25,w26,w9, holders=w12,w22,w24,w25,w26,w9, stopflight=0 part=0 -> kill w24
N 33671
E 33672 active=w12,w22,w25,w26,w9, holders=w12,w22,w25,w26,w9, stopflight=0 part=0 -> stop w9 2086
N 34358
E 34361 active=w12,w22,w25,w26, holders=w12,w22,w25,w26, stopflight=1 part=0 -> kill w26
N 35191
E 35193 active=w12,w22,w25, holders=w12,w22,w25, stopflight=1 part=0 -> kill w12
N 35855
E 35855 active=w22,w25, holders=w22,w25, stopflight=0 part=0 -> spawn
N 36563
E 36564 active=w22,w25,w27, holders=w22,w25,w27, stopflight=0 part=0 -> spawn
N 37490
E 37493 active=w22,w25,w27,w28, holders=w22,w25,w27,w28, stopflight=0 part=0 -> kill w25
N 38403
E 38403 active=w22,w27,w28, holders=w22,w27,w28, stopflight=0 part=0 -> kill w22
N 39341
E 39342 active=w27,w28, holders=w27,w28, stopflight=0 part=0 -> spawn
N 40294
E 40297 active=w27,w28,w29, holders=w27,w28,w29, stopflight=0 part=0 -> stop w27 2617
N 40832
E 40833 active=w28,w29, holders=w28,w29, stopflight=1 part=0 -> spawn
N 41648
E 41650 active=w28,w29,w30, holders=w28,w29,w30, stopflight=1 part=0 -> spawn
N 42316
E 42321 active=w28,w29,w30,w31, holders=w28,w29,w30,w31, stopflight=1 part=0 -> spawn
N 43173
E 43176 active=w28,w29,w30,w31,w32, holders=w28,w29,w30,w31,w32, stopflight=0 part=0 -> spawn
N 44048
E 44050 active=w28,w29,w30,w31,w32,w33, holders=w28,w29,w30,w31,w32,w33, stopflight=0 part=0 -> kill w31
N 44590
)";

std::set<std::string> names(const std::string& list) {
  std::set<std::string> out;
  std::istringstream in(list);
  for (std::string name; std::getline(in, name, ',');) {
    if (!name.empty()) out.insert(name);
  }
  return out;
}

std::string value(const std::string& word, const std::string& key) {
  EXPECT_EQ(word.rfind(key + "=", 0), 0u) << word;
  return word.substr(key.size() + 1);
}

TEST(ChaosSchedule, GivesTheScheduleRecordedBeforeTheSplit) {
  ChaosSchedule schedule(defaults(), 42);
  std::istringstream in(kSeed42);
  const std::int64_t t0 = 1'000'000;  // any clock
  std::size_t events = 0;
  std::optional<std::int64_t> due;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    std::istringstream words(line);
    std::string tag;
    std::int64_t t = 0;
    words >> tag >> t;
    if (tag == "N") {
      ASSERT_EQ(schedule.next_event_ms(), t0 + t) << line;
      due = t0 + t;
      continue;
    }
    ASSERT_EQ(tag, "E");
    std::string active, holders, stop, part, arrow, what;
    words >> active >> holders >> stop >> part >> arrow >> what;
    ScheduleState state;
    state.started = true;
    state.active = names(value(active, "active"));
    state.holders = names(value(holders, "holders"));
    state.stop_in_flight = value(stop, "stopflight") == "1";
    state.partition_in_flight = value(part, "part") == "1";
    if (due) {
      ASSERT_GE(t0 + t, *due);
      EXPECT_EQ(schedule.next(*due - 1, state).kind, Kind::kNone) << "due at " << *due;
    }
    const Fault f = schedule.next(t0 + t, state);
    ++events;
    if (what == "spawn") {
      EXPECT_EQ(f.kind, Kind::kSpawn) << line;
    } else if (what == "kill") {
      EXPECT_EQ(f.kind, Kind::kKill) << line;
      std::string victim;
      words >> victim;
      EXPECT_EQ(f.victim, victim) << line;
    } else if (what == "stop") {
      EXPECT_EQ(f.kind, Kind::kStop) << line;
      std::string victim;
      std::int64_t resume = 0;
      words >> victim >> resume;
      EXPECT_EQ(f.victim, victim) << line;
      EXPECT_EQ(f.resume_after_ms, resume) << line;
    } else {
      FAIL() << "unknown line " << line;
    }
  }
  EXPECT_EQ(events, 57u);
  EXPECT_EQ(schedule.events(), 57u);
  EXPECT_EQ(schedule.stops(), 7u);
}

// A modelled run: workers that the faults act on, the holders those that have been up
// for 3 s (often a single one), a stopped worker resumed when due and gone 50 ms later,
// a partition healed when due. Every 5 ms the schedule is asked, and what it decides is
// checked against the rules of docs/soak.md.
struct Model {
  struct Worker {
    std::uint32_t host = 0;
    std::int64_t since = 0;
    std::int64_t resume_at = -1;  // stopped until then
    std::int64_t gone_at = -1;    // resumed: exits then
  };

  Model(const ScheduleConfig& c, std::uint32_t bed_hosts) : config(c), hosts(bed_hosts) {}

  void spawn(std::int64_t now) {
    Worker w;
    w.since = now;
    w.host = hosts == 0 ? 0 : 1 + static_cast<std::uint32_t>(spawned % (hosts - 1));
    std::string name = "w";  // appended: "w" + to_string() draws a false -Wrestrict from g++ 12 at -O3
    name += std::to_string(++spawned);
    workers[name] = w;
  }

  ScheduleState state(std::int64_t now) {
    ScheduleState s;
    s.started = now >= started_at;
    for (auto it = workers.begin(); it != workers.end();) {
      Worker& w = it->second;
      if (w.resume_at >= 0 && now >= w.resume_at) {
        w.resume_at = -1;
        w.gone_at = now + 50;
      }
      if (w.gone_at >= 0 && now >= w.gone_at) {
        it = workers.erase(it);
        continue;
      }
      if (w.resume_at < 0 && w.gone_at < 0) {
        s.active.insert(it->first);
        if (now - w.since >= 3000) s.holders.insert(it->first);
        if (hosts > 0) s.hosts[it->first] = w.host;
      } else {
        s.stop_in_flight = true;
      }
      ++it;
    }
    if (partition_until >= 0 && now >= partition_until) partition_until = -1;
    s.partition_in_flight = partition_until >= 0;
    return s;
  }

  // Checks the fault against the state it was decided in, then applies it.
  void apply(const Fault& f, const ScheduleState& s, std::int64_t now) {
    ++kinds[f.kind];
    switch (f.kind) {
      case Kind::kNone:
        return;
      case Kind::kTopUp:
        EXPECT_LT(s.active.size(), config.peers_min);
        spawn(now);
        return;
      case Kind::kSpawn:
        EXPECT_LT(s.active.size(), config.peers_max);
        spawn(now);
        break;
      case Kind::kKill:
      case Kind::kStop:
        // Never a worker that is down, never the last holder, never below the minimum.
        EXPECT_EQ(s.active.count(f.victim), 1u) << f.victim;
        EXPECT_GT(s.active.size(), config.peers_min);
        EXPECT_FALSE(s.holders.empty());
        if (s.holders.size() == 1) {
          EXPECT_EQ(s.holders.count(f.victim), 0u) << f.victim;
        }
        if (f.kind == Kind::kKill) {
          workers.erase(f.victim);
        } else {
          EXPECT_FALSE(s.stop_in_flight);
          EXPECT_FALSE(s.partition_in_flight);
          EXPECT_GE(f.resume_after_ms, config.heartbeat_timeout_ms + 500);
          EXPECT_LE(f.resume_after_ms, config.heartbeat_timeout_ms + 2000);
          workers[f.victim].resume_at = now + f.resume_after_ms;
        }
        break;
      case Kind::kPartition: {
        EXPECT_TRUE(config.partitions);
        EXPECT_FALSE(s.stop_in_flight);
        EXPECT_FALSE(s.partition_in_flight);
        EXPECT_GE(f.duration_ms, config.partition_min_ms);
        EXPECT_LE(f.duration_ms, config.partition_max_ms);
        std::map<std::uint32_t, std::vector<std::string>> by_host;
        for (const auto& name : s.active) by_host[s.hosts.at(name)].push_back(name);
        if (f.whole_host) {
          // The state survives the cut: an active holder stays outside.
          EXPECT_EQ(f.cut_off, by_host[f.a]);
          std::size_t outside = 0;
          for (const auto& name : s.holders) outside += s.hosts.at(name) != f.a ? 1u : 0u;
          EXPECT_GT(outside, 0u);
          ++host_partitions;
        } else {
          EXPECT_LT(f.a, f.b);
          EXPECT_EQ(by_host.count(f.a), 1u);
          EXPECT_EQ(by_host.count(f.b), 1u);
          // The state survives the cut: an active holder lives on a third host.
          std::size_t elsewhere = 0;
          for (const auto& name : s.holders) elsewhere += s.hosts.at(name) != f.a && s.hosts.at(name) != f.b ? 1u : 0u;
          EXPECT_GT(elsewhere, 0u);
        }
        partition_until = now + f.duration_ms;
        break;
      }
    }
  }

  ScheduleConfig config;
  std::uint32_t hosts;
  std::int64_t started_at = 2000;
  std::map<std::string, Worker> workers;
  std::uint64_t spawned = 0;
  std::int64_t partition_until = -1;
  std::map<Kind, std::uint64_t> kinds;
  std::uint64_t host_partitions = 0;
};

// Runs the model for `ms` with the given seed; returns the faults decided, in order.
std::vector<std::string> run(const ScheduleConfig& config, std::uint32_t hosts, std::uint64_t seed, std::int64_t ms,
                             Model* out = nullptr) {
  Model model(config, hosts);
  ChaosSchedule schedule(config, seed);
  for (std::uint32_t i = 0; i < 4; ++i) model.spawn(0);
  std::vector<std::string> faults;
  for (std::int64_t now = 0; now < ms; now += 5) {  // the orchestrator's turns: 5 ms when idle
    const ScheduleState s = model.state(now);
    const std::uint64_t events_before = schedule.events();
    const auto due_before = schedule.next_event_ms();
    const Fault f = schedule.next(now, s);
    if (!s.started) {
      EXPECT_EQ(f.kind, Kind::kNone) << "an event before the run holds a state";
    }
    if (f.kind != Kind::kNone && f.kind != Kind::kTopUp) {
      EXPECT_EQ(schedule.events(), events_before + 1);
      // Due now, and the next one event_min_ms..event_max_ms from now.
      EXPECT_LE(due_before.value_or(now), now);
      EXPECT_GE(*schedule.next_event_ms(), now + config.event_min_ms);
      EXPECT_LE(*schedule.next_event_ms(), now + config.event_max_ms);
    }
    // At most one event in five is a stop.
    EXPECT_LE(schedule.stops() * 5, schedule.events());
    model.apply(f, s, now);
    if (f.kind != Kind::kNone) {
      std::ostringstream text;
      text << now << " " << static_cast<int>(f.kind) << " " << f.victim << " " << f.resume_after_ms << " " << f.a << " "
           << f.b << " " << f.duration_ms;
      faults.push_back(text.str());
    }
    if (::testing::Test::HasFailure()) break;
  }
  if (out != nullptr) *out = model;
  return faults;
}

TEST(ChaosSchedule, IsDeterministicForASeed) {
  const auto a = run(defaults(), 0, 7, 120'000);
  const auto b = run(defaults(), 0, 7, 120'000);
  const auto c = run(defaults(), 0, 8, 120'000);
  EXPECT_GT(a.size(), 100u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(ChaosSchedule, KeepsTheBoundsOverManySeeds) {
  std::uint64_t events = 0;
  for (std::uint64_t seed = 1; seed <= 20 && !HasFailure(); ++seed) {
    Model model(defaults(), 0);
    run(defaults(), 0, seed, 300'000, &model);
    EXPECT_EQ(model.kinds[Kind::kPartition], 0u) << "a partition on loopback";
    events += model.kinds[Kind::kKill] + model.kinds[Kind::kSpawn] + model.kinds[Kind::kStop];
  }
  EXPECT_GT(events, 5000u);
}

// The mix in a state where every event is possible: kill, spawn and stop drawn 2:2:1,
// but at most one event in five a stop; with partitions, 2:2:1:2.
std::map<Kind, std::uint64_t> mix(bool partitions, std::uint64_t events) {
  ScheduleConfig config = defaults();
  config.partitions = partitions;
  ChaosSchedule schedule(config, 3);
  ScheduleState s;
  s.started = true;
  s.active = {"w1", "w2", "w3", "w4"};
  s.holders = s.active;
  s.hosts = {{"w1", 1}, {"w2", 2}, {"w3", 3}, {"w4", 1}};
  std::map<Kind, std::uint64_t> out;
  for (std::int64_t now = 0; schedule.events() < events; now = *schedule.next_event_ms()) ++out[schedule.next(now, s).kind];
  return out;
}

TEST(ChaosSchedule, DrawsKillSpawnAndStopTwoToTwoToOne) {
  auto m = mix(false, 20'000);
  EXPECT_EQ(m[Kind::kKill] + m[Kind::kSpawn] + m[Kind::kStop], 20'000u);
  EXPECT_EQ(m[Kind::kPartition], 0u);
  const double kills = static_cast<double>(m[Kind::kKill]);
  EXPECT_NEAR(kills / static_cast<double>(m[Kind::kSpawn]), 1.0, 0.05);
  EXPECT_LE(m[Kind::kStop], 4'000u);
  EXPECT_GE(m[Kind::kStop], 2'000u);
  m = mix(true, 20'000);
  EXPECT_NEAR(static_cast<double>(m[Kind::kPartition]) / static_cast<double>(m[Kind::kKill]), 1.0, 0.05);
  EXPECT_NEAR(static_cast<double>(m[Kind::kSpawn]) / static_cast<double>(m[Kind::kKill]), 1.0, 0.05);
  EXPECT_LE(m[Kind::kStop], 4'000u);
  EXPECT_GE(m[Kind::kStop], 1'000u);
}

TEST(ChaosSchedule, NeverTakesTheLastHolderOfTheState) {
  for (std::uint64_t seed = 1; seed <= 200; ++seed) {
    ChaosSchedule schedule(defaults(), seed);
    ScheduleState s;
    s.started = true;
    s.active = {"w1", "w2", "w3", "w4", "w5"};
    s.holders = {"w3"};
    for (std::int64_t now = 0; schedule.events() < 20; now = *schedule.next_event_ms()) {
      const Fault f = schedule.next(now, s);
      EXPECT_NE(f.victim, "w3") << "seed " << seed;
    }
    // No holder at all: nobody is killed or stopped (the run waits for one).
    s.holders.clear();
    for (std::int64_t now = *schedule.next_event_ms(); schedule.events() < 40; now = *schedule.next_event_ms()) {
      const Fault f = schedule.next(now, s);
      EXPECT_EQ(f.kind, Kind::kSpawn) << "seed " << seed;
    }
  }
}

TEST(ChaosSchedule, PartitionsOnATestBedKeepTheStateAlive) {
  ScheduleConfig config = defaults();
  config.partitions = true;
  std::uint64_t partitions = 0;
  std::uint64_t whole = 0;
  for (std::uint64_t seed = 1; seed <= 10 && !HasFailure(); ++seed) {
    Model model(config, 4);
    run(config, 4, seed, 300'000, &model);
    partitions += model.kinds[Kind::kPartition];
    whole += model.host_partitions;
  }
  EXPECT_GT(partitions, 100u);
  EXPECT_GT(whole, 0u);
  EXPECT_LT(whole, partitions);
}

// Where both kinds are possible, the kind done fewer times so far comes next: a pair
// partition (possible only while holders live on three hosts) is never left to chance.
TEST(ChaosSchedule, AlternatesWholeHostAndPairPartitionsWhereBothArePossible) {
  ScheduleConfig config = defaults();
  config.partitions = true;
  config.peers_min = 3;  // three active workers, none to kill, stop or spawn: every event partitions
  config.peers_max = 3;
  ScheduleState state;
  state.started = true;
  state.active = {"w1", "w2", "w3"};
  state.holders = state.active;
  state.hosts = {{"w1", 1}, {"w2", 2}, {"w3", 3}};
  std::vector<std::uint32_t> hosts;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> pairs;
  partition_choices(state, &hosts, &pairs);
  ASSERT_EQ(hosts.size(), 3u);
  ASSERT_EQ(pairs.size(), 3u);
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    ChaosSchedule schedule(config, seed);
    std::int64_t whole = 0;
    std::int64_t pair = 0;
    for (std::int64_t now = 0; now < 40'000; now += 5) {
      const Fault f = schedule.next(now, state);
      if (f.kind == Kind::kNone) continue;
      ASSERT_EQ(f.kind, Kind::kPartition);
      ++(f.whole_host ? whole : pair);
      ASSERT_LE(std::abs(whole - pair), 1) << "seed " << seed << " after " << whole + pair << " partitions";
    }
    EXPECT_GT(pair, 20) << "seed " << seed;
  }
}

}  // namespace
}  // namespace lockstep::soak
