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

  static constexpr TimeMs kStallMs = 5'000;
  TimeMs now_ms = 1'000;
  coord::Coordinator coordinator_;
  Observer observer_;
};

// Two accepted peers (conns 1 and 2) of group 0.
void admit_two(ScriptedRun& run) {
  run.connect(1);
  run.report_all({1});  // admitted alone: nobody to vote
  run.connect(2);
  run.send(1, p::VoteUpdateTopology{});
  run.report_all({1, 2});
  ASSERT_EQ(run.coordinator_.ring(0).size(), 2u);
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
