// The master's Observer driven by a real Coordinator with scripted events and a fake
// clock: structured events become counters and a latency histogram, open rounds name
// the peers a vote waits for, a stall is reported once, the recent-events buffer is
// bounded, and both renderings hold what happened.
#include "common/limits.h"
#include "coordinator/coordinator.h"
#include "master/observer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>
#include <vector>

namespace lockstep::master {
namespace {

namespace p = lockstep::proto;
using coord::ConnId;
using coord::Outbox;

class ScriptedRun {
 public:
  ScriptedRun() : coordinator_(config()), observer_(kStallMs) {}

  static coord::Config config() {
    coord::Config c;
    c.heartbeat_timeout_ms = 600'000;  // the fake clock jumps; nobody is silent
    c.instance_nonce = 0xabcdef0000000000ull;
    return c;
  }

  // Applies an outbox the way the master's shell does: events to the observer.
  Outbox feed(Outbox out) {
    for (const auto& command : out) {
      if (const auto* event = std::get_if<coord::Event>(&command)) observer_.on_event(*event, now_ms);
    }
    return out;
  }
  Outbox connect(ConnId conn) {
    Outbox out;
    coordinator_.on_connect(conn, "127.0.0.1", now_ms, out);
    p::Hello hello;
    hello.p2p_port = static_cast<std::uint16_t>(1000 + conn);
    hello.shared_state_port = hello.benchmark_port = hello.p2p_port;  // a peer names all three ports or none
    hello.pool_size = pool_size;
    hello.group = group;
    coordinator_.on_message(conn, hello, now_ms, out);
    return feed(std::move(out));
  }
  Outbox send(ConnId conn, const p::Message& message) {
    Outbox out;
    coordinator_.on_message(conn, message, now_ms, out);
    return feed(std::move(out));
  }
  Outbox disconnect(ConnId conn) {
    Outbox out;
    coordinator_.on_disconnect(conn, "closed by peer", now_ms, out);
    return feed(std::move(out));
  }
  // Every participant reports its p2p connections for the current epoch.
  void report_all(const std::vector<ConnId>& conns) {
    for (const auto conn : conns) send(conn, p::P2PReport{coordinator_.epoch(), {}});
  }
  PeerId id(ConnId conn) const { return *coordinator_.peer_of(conn); }
  // A CollectiveDone as the master's shell takes it: the bytes first (counted for the
  // attempt's slot while the attempt is open), then the coordinator.
  Outbox report_done(ConnId conn, const p::CollectiveDone& done) {
    observer_.on_bytes_reported(id(conn), true, done.bytes_sent, done.bytes_received, now_ms);
    observer_.on_slot_bytes_reported(coordinator_, id(conn), done.tag, done.attempt, done.bytes_sent,
                                     done.bytes_received);
    return send(conn, done);
  }

  // What the next connections say in their Hello.
  std::uint16_t pool_size = 1;
  std::uint32_t group = 0;

  static constexpr TimeMs kStallMs = 5'000;
  TimeMs now_ms = 1'000;
  coord::Coordinator coordinator_;
  Observer observer_;
};

// Two accepted peers (conns 1 and 2) of the group (run.group says it in their Hello).
void admit_two(ScriptedRun& run, std::uint32_t group = 0) {
  run.connect(1);
  run.report_all({1});  // admitted alone: nobody to vote
  run.connect(2);
  run.send(1, p::VoteUpdateTopology{});
  run.report_all({1, 2});
  ASSERT_EQ(run.coordinator_.ring(group).size(), 2u);
}

double metric(const std::string& text, const std::string& series) {
  const auto at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + series.size() + 2));
}

TEST(Observer, EventsBecomeCountersAndTheStateShowsTheRun) {
  ScriptedRun run;
  admit_two(run);
  const std::string metrics = run.observer_.metrics_text(run.coordinator_, run.now_ms);
  EXPECT_EQ(metric(metrics, "lockstep_peers_registered_total"), 2);
  EXPECT_EQ(metric(metrics, "lockstep_operations_started_total{operation=\"update_topology\"}"), 2);
  EXPECT_EQ(metric(metrics, "lockstep_operations_succeeded_total{operation=\"update_topology\"}"), 2);
  EXPECT_EQ(metric(metrics, "lockstep_peers{group=\"0\",phase=\"ACCEPTED\",state=\"IDLE\"}"), 2);
  EXPECT_EQ(metric(metrics, "lockstep_topology_epoch"), 2);

  const auto state = nlohmann::json::parse(run.observer_.state_json(run.coordinator_, run.now_ms));
  ASSERT_EQ(state["peers"].size(), 2u);
  EXPECT_EQ(state["groups"][0]["ring"], nlohmann::json::array({run.id(1).to_string(), run.id(2).to_string()}));
  EXPECT_EQ(state["peers"][1]["rank"], 1);
  std::vector<std::string> kinds;
  for (const auto& e : state["events"]) kinds.push_back(e["kind"]);
  EXPECT_EQ(std::count(kinds.begin(), kinds.end(), "registered"), 2);
  EXPECT_EQ(std::count(kinds.begin(), kinds.end(), "succeeded"), 2);

  // A removal carries its status and reason.
  const PeerId second = run.id(2);
  run.observer_.on_bytes_reported(second, true, 100, 100, run.now_ms);
  run.disconnect(2);
  const auto after = nlohmann::json::parse(run.observer_.state_json(run.coordinator_, run.now_ms));
  EXPECT_EQ(after["counters"]["removals"]["PEER_CONNECTION_LOST"], 1);
  const auto& last = after["events"].back();
  EXPECT_EQ(last["kind"], "removed");
  EXPECT_EQ(last["peers"], nlohmann::json::array({second.to_string()}));
  const std::string reason = last["reason"];
  EXPECT_NE(reason.find("closed by peer"), std::string::npos) << reason;
  EXPECT_EQ(after["counters"]["bytes"]["all_reduce"]["sent"], 100);
  EXPECT_EQ(after["throughput"].back()["all_reduce"], 100);
}

TEST(Observer, AStalledVoteNamesWhomItWaitsForOnceAndItsLatencyIsMeasured) {
  ScriptedRun run;
  admit_two(run);
  run.send(1, p::VoteAgree{true});
  const auto rounds = run.coordinator_.open_rounds();
  ASSERT_EQ(rounds.size(), 1u);
  EXPECT_EQ(rounds[0].op, coord::Operation::kAgree);
  EXPECT_EQ(rounds[0].done, std::vector<PeerId>{run.id(1)});
  EXPECT_EQ(rounds[0].waiting, std::vector<PeerId>{run.id(2)});

  run.now_ms += ScriptedRun::kStallMs - 1;
  EXPECT_TRUE(run.observer_.check_stalls(run.coordinator_, run.now_ms).empty());
  run.now_ms += 1;
  const auto lines = run.observer_.check_stalls(run.coordinator_, run.now_ms);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("stall: agree of group 0"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find(run.id(2).to_string()), std::string::npos) << lines[0];
  EXPECT_TRUE(run.observer_.check_stalls(run.coordinator_, run.now_ms + 1000).empty());  // once
  const auto state = nlohmann::json::parse(run.observer_.state_json(run.coordinator_, run.now_ms));
  ASSERT_EQ(state["operations"].size(), 1u);
  EXPECT_EQ(state["operations"][0]["stalled"], true);

  run.now_ms += 7'000;  // 12 s after the first vote
  run.send(2, p::VoteAgree{true});
  EXPECT_TRUE(run.coordinator_.open_rounds().empty());
  const std::string metrics = run.observer_.metrics_text(run.coordinator_, run.now_ms);
  EXPECT_EQ(metric(metrics, "lockstep_consensus_round_seconds_bucket{operation=\"agree\",le=\"10\"}"), 0);
  EXPECT_EQ(metric(metrics, "lockstep_consensus_round_seconds_bucket{operation=\"agree\",le=\"30\"}"), 1);
  EXPECT_EQ(metric(metrics, "lockstep_consensus_round_seconds_sum{operation=\"agree\"}"), 12);
  EXPECT_EQ(metric(metrics, "lockstep_stalls_total"), 1);
}

TEST(Observer, RecentEventsAreBoundedAndRoutineOnesCannotPushOutFailures) {
  ScriptedRun run;
  run.observer_.on_event(coord::Event{.text = "the failure", .kind = coord::EventKind::kFailed}, 0);
  for (std::size_t i = 0; i < limits::kObservedRoutineEventsMax * 5; ++i) {
    run.observer_.on_event(coord::Event{.text = "routine", .routine = true, .kind = coord::EventKind::kSucceeded}, 1);
  }
  for (std::size_t i = 0; i + 2 < limits::kObservedEventsMax; ++i) {
    run.observer_.on_event(coord::Event{.text = "notable"}, 2);
  }
  auto state = nlohmann::json::parse(run.observer_.state_json(run.coordinator_, 3));
  EXPECT_EQ(state["events"].size(), limits::kObservedEventsMax - 1 + limits::kObservedRoutineEventsMax);
  EXPECT_EQ(state["events"][0]["text"], "the failure");
  for (std::size_t i = 0; i < 10; ++i) run.observer_.on_event(coord::Event{.text = "notable"}, 4);
  state = nlohmann::json::parse(run.observer_.state_json(run.coordinator_, 5));
  EXPECT_EQ(state["events"].size(), limits::kObservedEventsMax + limits::kObservedRoutineEventsMax);
  EXPECT_NE(state["events"][0]["text"], "the failure");  // the oldest notable one went first
}

TEST(Observer, ThroughputKeepsTenMinutesOfSeconds) {
  ScriptedRun run;
  for (TimeMs t = 0; t < 2 * limits::kThroughputHistorySeconds * 1000; t += 500) {
    run.observer_.on_bytes_reported(PeerId{1, 1}, false, 1, 10, t);
  }
  const TimeMs now = 2 * limits::kThroughputHistorySeconds * 1000;
  const auto state = nlohmann::json::parse(run.observer_.state_json(run.coordinator_, now));
  EXPECT_EQ(state["throughput"].size(), static_cast<std::size_t>(limits::kThroughputHistorySeconds));
  // Syncs count the bytes received (complete when a peer reports); two reports a second.
  EXPECT_EQ(state["throughput"][0]["shared_state_sync"], 20);
}

}  // namespace
}  // namespace lockstep::master

namespace lockstep::master {
namespace {

// Starts the all-reduce `tag` on both peers (conns 1 and 2, a ring) and returns its attempt.
std::uint64_t start_all_reduce(ScriptedRun& run, std::uint32_t group, std::uint64_t tag, std::uint64_t count = 1u << 20) {
  const p::CollectiveDescriptor d{count, static_cast<std::uint8_t>(LOCKSTEP_F32), static_cast<std::uint8_t>(LOCKSTEP_SUM),
                                  static_cast<std::uint8_t>(LOCKSTEP_QUANT_NONE)};
  std::vector<std::uint8_t> data;
  if (count < 16) data.assign(count * 4, 0);  // small enough to travel with the votes
  for (const ConnId conn : {ConnId{1}, ConnId{2}}) run.send(conn, p::CollectiveInit{tag, d, data});
  const auto& collectives = run.coordinator_.collectives();
  const auto g = collectives.find(group);
  if (g == collectives.end() || g->second.count(tag) == 0) return 0;
  return g->second.at(tag).attempt;
}

std::string slot_series(std::uint32_t group, std::uint32_t slot, const char* direction) {
  return "lockstep_slot_bytes_total{group=\"" + std::to_string(group) + "\",slot=\"" + std::to_string(slot) +
         "\",direction=\"" + direction + "\"}";
}

TEST(Observer, RingBytesAreCountedPerPoolSlot) {
  ScriptedRun run;
  run.pool_size = 4;
  admit_two(run);
  // Three all-reduces in flight on a pool of 4 take slots 0, 1 and 2.
  std::vector<std::uint64_t> attempts;
  for (std::uint64_t tag = 1; tag <= 3; ++tag) attempts.push_back(start_all_reduce(run, 0, tag));
  for (std::uint64_t k = 0; k < 3; ++k) {
    ASSERT_NE(attempts[k], 0u);
    ASSERT_EQ(run.coordinator_.collectives().at(0).at(k + 1).slot, k);
  }
  const auto busy = nlohmann::json::parse(run.observer_.state_json(run.coordinator_, run.now_ms));
  ASSERT_EQ(busy["groups"][0]["slots"].size(), 4u);
  EXPECT_EQ(busy["groups"][0]["slots"][2]["in_flight"], 1);
  EXPECT_EQ(busy["groups"][0]["slots"][3]["in_flight"], 0);
  // Each peer reports distinct bytes per tag: slot k carries exactly its tag's bytes.
  for (std::uint64_t k = 0; k < 3; ++k) {
    run.report_done(1, p::CollectiveDone{k + 1, attempts[k], true, "", 1000 * (k + 1), 10 * (k + 1)});
    run.report_done(2, p::CollectiveDone{k + 1, attempts[k], true, "", 100 * (k + 1), 1 * (k + 1)});
  }
  ASSERT_TRUE(run.coordinator_.collectives().count(0) == 0 || run.coordinator_.collectives().at(0).empty());
  // A report of an attempt that already ended (it came after a commit) counts on the
  // attempt's slot; one that names no attempt the master ran counts in the totals only.
  run.report_done(1, p::CollectiveDone{1, attempts[0], true, "", 5, 5});
  run.report_done(1, p::CollectiveDone{1, attempts[2] + 100, true, "", 7, 7});
  // An all-reduce that travels with the votes runs on no slot either.
  start_all_reduce(run, 0, 9, /*count=*/4);

  const std::string metrics = run.observer_.metrics_text(run.coordinator_, run.now_ms);
  const auto state = nlohmann::json::parse(run.observer_.state_json(run.coordinator_, run.now_ms));
  const auto& slots = state["groups"][0]["slots"];
  ASSERT_EQ(slots.size(), 4u);
  for (std::uint32_t k = 0; k < 3; ++k) {
    const std::uint32_t late = k == 0 ? 5 : 0;
    EXPECT_EQ(metric(metrics, slot_series(0, k, "sent")), 1100.0 * (k + 1) + late) << metrics;
    EXPECT_EQ(metric(metrics, slot_series(0, k, "received")), 11.0 * (k + 1) + late);
    EXPECT_EQ(slots[k]["slot"], k);
    EXPECT_EQ(slots[k]["bytes_sent"], 1100 * (k + 1) + late);
    EXPECT_EQ(slots[k]["bytes_received"], 11 * (k + 1) + late);
    EXPECT_EQ(slots[k]["in_flight"], 0);
  }
  // The idle slot of the pool is shown, at zero.
  EXPECT_EQ(metric(metrics, slot_series(0, 3, "sent")), 0);
  EXPECT_EQ(slots[3]["bytes_sent"], 0);
  EXPECT_EQ(metric(metrics, slot_series(0, 4, "sent")), -1);  // not in the pool
  EXPECT_EQ(state["counters"]["bytes"]["all_reduce"]["sent"], 6600 + 5 + 7);
}

TEST(Observer, SlotBytesOfGroupsThatLeftAreForgotten) {
  ScriptedRun run;
  run.pool_size = 2;
  run.group = 5;
  admit_two(run, 5);
  const std::uint64_t attempt = start_all_reduce(run, 5, 1);
  ASSERT_NE(attempt, 0u);
  run.report_done(1, p::CollectiveDone{1, attempt, true, "", 64, 64});
  EXPECT_EQ(metric(run.observer_.metrics_text(run.coordinator_, run.now_ms), slot_series(5, 0, "sent")), 64);
  run.disconnect(1);
  run.disconnect(2);
  // Group 5 is gone; the next group to report replaces its series.
  run.group = 6;
  run.connect(3);
  run.report_all({3});
  run.connect(4);
  run.send(3, p::VoteUpdateTopology{});
  run.report_all({3, 4});
  ASSERT_EQ(run.coordinator_.ring(6).size(), 2u);
  const p::CollectiveDescriptor d{1u << 20, static_cast<std::uint8_t>(LOCKSTEP_F32),
                                  static_cast<std::uint8_t>(LOCKSTEP_SUM), static_cast<std::uint8_t>(LOCKSTEP_QUANT_NONE)};
  run.send(3, p::CollectiveInit{2, d});
  run.send(4, p::CollectiveInit{2, d});
  const std::uint64_t second = run.coordinator_.collectives().at(6).at(2).attempt;
  run.report_done(3, p::CollectiveDone{2, second, true, "", 32, 32});
  const std::string metrics = run.observer_.metrics_text(run.coordinator_, run.now_ms);
  EXPECT_EQ(metric(metrics, slot_series(6, 0, "sent")), 32) << metrics;
  EXPECT_EQ(metrics.find("group=\"5\",slot"), std::string::npos) << metrics;
}

}  // namespace
}  // namespace lockstep::master
