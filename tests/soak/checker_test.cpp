// The soak's checker on invented lines and times: every assertion fires on the fault it
// is meant to catch and stays quiet on the legitimate outcomes around it (an evicted
// peer's late or fatal reports, a lone worker, a killed worker).
#include "checker.h"

#include <lockstep/lockstep.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>

namespace lockstep::soak {
namespace {

using nlohmann::json;

constexpr std::int64_t kStart = 1'000'000;

CheckerConfig config() {
  CheckerConfig c;
  c.heartbeat_timeout_ms = 1000;
  c.stall_margin_ms = 10'000;
  c.progress_window_ms = 20'000;
  c.exit_margin_ms = 5'000;
  c.outcome_skew_ms = 2'000;
  return c;
}

std::string sync_line(const std::string& name, std::uint64_t revision, const std::string& hash,
                      const std::string& strategy = "popular") {
  return json{{"name", name}, {"ev", "sync"}, {"revision", revision}, {"hash", hash}, {"strategy", strategy}}.dump();
}

std::string reduce_line(const std::string& name, std::uint64_t tag, std::uint64_t attempt, int code,
                        const std::string& checksum, std::uint64_t world, std::int64_t end_ms, bool restored = true) {
  json j = {{"name", name}, {"ev", "allreduce"}, {"tag", tag},       {"attempt", attempt},
            {"code", code}, {"world", world},    {"end_ms", end_ms}};
  if (code == LOCKSTEP_OK) {
    j["checksum"] = checksum;
  } else {
    j["restored"] = restored;
  }
  return j.dump();
}

std::string exit_line(const std::string& name, int code) {
  return json{{"name", name}, {"ev", "exit"}, {"op", "sync"}, {"code", code}, {"error", "why"}}.dump();
}

std::string kinds(const Checker& c) {
  std::string out;
  for (const auto& v : c.violations()) out += v.kind + ": " + v.text + "\n";
  return out;
}

TEST(SoakChecker, EqualHashesPassAndADivergentOneIsReported) {
  Checker c(config(), kStart);
  c.spawned("a", kStart);
  c.spawned("b", kStart);
  c.line("a", sync_line("a", 1, "h1"), kStart + 10);
  c.line("b", sync_line("b", 1, "h1"), kStart + 10);
  c.line("a", sync_line("a", 2, "h2"), kStart + 20);
  EXPECT_TRUE(c.ok()) << kinds(c);
  c.line("b", sync_line("b", 2, "h2-other"), kStart + 20);
  ASSERT_EQ(c.violations().size(), 1u);
  EXPECT_EQ(c.violations()[0].kind, "parity");
  EXPECT_EQ(c.max_revision(), 2u);
  EXPECT_EQ(c.syncs_reported(), 4u);
}

TEST(SoakChecker, RevisionsAdvanceByExactlyOneAfterTheFirstSync) {
  Checker c(config(), kStart);
  c.spawned("n", kStart);
  c.line("n", sync_line("n", 40, "h", "receive"), kStart + 1);  // a newcomer adopts the group's
  c.line("n", sync_line("n", 41, "h2"), kStart + 2);
  EXPECT_TRUE(c.ok()) << kinds(c);
  EXPECT_EQ(c.newcomer_syncs(), 1u);
  c.line("n", sync_line("n", 43, "h3"), kStart + 3);
  ASSERT_EQ(c.violations().size(), 1u);
  EXPECT_EQ(c.violations()[0].kind, "revision");
}

TEST(SoakChecker, OneOutcomePerAttempt) {
  Checker c(config(), kStart);
  for (const char* n : {"a", "b", "c", "d"}) c.spawned(n, kStart);
  // Same success everywhere.
  c.line("a", reduce_line("a", 7, 1, LOCKSTEP_OK, "x", 4, kStart + 5), kStart + 5);
  c.line("b", reduce_line("b", 7, 1, LOCKSTEP_OK, "x", 4, kStart + 5), kStart + 5);
  // An evicted peer's fatal status does not count against the others' success.
  c.line("c", reduce_line("c", 7, 1, LOCKSTEP_STATUS_KICKED, "", 0, kStart + 5), kStart + 5);
  EXPECT_TRUE(c.ok()) << kinds(c);
  EXPECT_EQ(c.allreduces_completed(), 1u);
  // A different checksum for the same attempt.
  c.line("d", reduce_line("d", 7, 1, LOCKSTEP_OK, "y", 4, kStart + 5), kStart + 5);
  ASSERT_EQ(c.violations().size(), 1u);
  EXPECT_EQ(c.violations()[0].kind, "allreduce");
  // A failure for some and a success for others.
  c.line("a", reduce_line("a", 8, 1, LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "", 0, kStart + 6), kStart + 6);
  c.line("b", reduce_line("b", 8, 1, LOCKSTEP_OK, "z", 3, kStart + 6), kStart + 6);
  ASSERT_EQ(c.violations().size(), 2u);
  EXPECT_EQ(c.violations()[1].kind, "allreduce");
  // The retry is a different attempt.
  c.line("a", reduce_line("a", 8, 2, LOCKSTEP_OK, "z", 3, kStart + 7), kStart + 7);
  c.line("b", reduce_line("b", 8, 2, LOCKSTEP_OK, "z", 3, kStart + 7), kStart + 7);
  EXPECT_EQ(c.violations().size(), 2u) << kinds(c);
}

// A failed attempt that began long after anything was done to the run is unexplained
// (once per attempt, however many peers report it); one near a kill, a spawn or during
// a partition is not; a frame of another attempt is counted by its reason.
TEST(SoakChecker, FailuresNothingExplainsAndStaleFramesAreCounted) {
  Checker c(config(), kStart);
  for (const char* n : {"a", "b", "c"}) c.spawned(n, kStart);
  auto failed = [](const std::string& name, std::uint64_t tag, std::int64_t end_ms, const std::string& error) {
    json j = json::parse(reduce_line(name, tag, 1, LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "", 0, end_ms));
    j["ms"] = 40;
    j["error"] = error;
    return j.dump();
  };
  // Within the heartbeat timeout and the window after the spawns: explained.
  c.line("a", failed("a", 1, kStart + 3'000, "ring neighbour hung up"), kStart + 3'000);
  EXPECT_EQ(c.unexplained_failures(), 0u);
  // 20 s later, nothing done since: unexplained, once for both reports.
  const std::int64_t t = kStart + 20'000;
  c.line("a", failed("a", 2, t, "write failed: Broken pipe"), t);
  c.line("b", failed("b", 2, t, "write failed: Broken pipe"), t);
  EXPECT_EQ(c.unexplained_failures(), 1u);
  ASSERT_EQ(c.unexplained_samples().size(), 1u);
  EXPECT_NE(c.unexplained_samples()[0].find("Broken pipe"), std::string::npos) << c.unexplained_samples()[0];
  // A kill just before the attempt began explains it; so does one during it.
  c.killed("c", t + 1'000);
  c.line("a", failed("a", 3, t + 1'030, "ring neighbour hung up"), t + 1'030);
  // ... but not a kill after it ended (its line read late).
  c.killed("b", t + 31'000);
  c.line("a", failed("a", 4, t + 30'000, "x"), t + 31'010);
  EXPECT_EQ(c.unexplained_failures(), 2u);
  // During a partition: explained.
  c.spawned("d", t + 40'000);
  c.partition_started({}, t + 50'000);
  c.line("a", failed("a", 5, t + 58'000, "no data moved"), t + 58'000);
  c.partition_healed(t + 59'000);
  EXPECT_EQ(c.unexplained_failures(), 2u);
  EXPECT_TRUE(c.ok()) << kinds(c);
  // An attempt lost to a frame of another attempt: counted once, and a violation.
  EXPECT_EQ(c.stale_frame_failures(), 0u);
  c.line("a", failed("a", 6, t + 59'010, "p3: ring frame of attempt 2 during attempt 3"), t + 59'010);
  c.line("b", failed("b", 6, t + 59'010, "p3: ring frame of attempt 2 during attempt 3"), t + 59'010);
  EXPECT_EQ(c.stale_frame_failures(), 1u);
  ASSERT_EQ(c.violations().size(), 1u) << kinds(c);
  EXPECT_EQ(c.violations()[0].kind, "stale_frame");
}

TEST(SoakChecker, AFailedAllReduceMustRestoreItsBuffer) {
  Checker c(config(), kStart);
  c.spawned("a", kStart);
  c.line("a", reduce_line("a", 3, 1, LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "", 0, kStart, true), kStart);
  EXPECT_TRUE(c.ok());
  c.line("a", reduce_line("a", 4, 1, LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "", 0, kStart, false), kStart);
  ASSERT_EQ(c.violations().size(), 1u);
  EXPECT_EQ(c.violations()[0].kind, "restore");
}

TEST(SoakChecker, ThePeersOfAnAttemptLearnItsOutcomeTogether) {
  Checker c(config(), kStart);
  for (const char* n : {"a", "b", "s"}) c.spawned(n, kStart);
  const int lost = LOCKSTEP_STATUS_PEER_CONNECTION_LOST;
  c.line("a", reduce_line("a", 5, 1, lost, "", 0, kStart + 100), kStart + 100);
  c.line("b", reduce_line("b", 5, 1, lost, "", 0, kStart + 1900), kStart + 1900);  // within 2 s
  EXPECT_TRUE(c.ok()) << kinds(c);
  // A stopped peer learns it late: not counted.
  c.stopped("s", kStart + 50);
  c.line("s", reduce_line("s", 5, 1, lost, "", 0, kStart + 9000), kStart + 9000);
  EXPECT_TRUE(c.ok()) << kinds(c);
  // An active survivor that learns it 5 s after the others.
  c.line("a", reduce_line("a", 6, 1, lost, "", 0, kStart + 10'000), kStart + 10'000);
  c.line("b", reduce_line("b", 6, 1, lost, "", 0, kStart + 15'000), kStart + 15'000);
  ASSERT_EQ(c.violations().size(), 1u);
  EXPECT_EQ(c.violations()[0].kind, "outcome_skew");
  EXPECT_EQ(c.outcome_skews(), 1u);
  EXPECT_EQ(c.largest_outcome_skew_ms(), 5000);
}

TEST(SoakChecker, AStallCountsOnlyWhileTwoWorkersAreActive) {
  Checker c(config(), kStart);
  c.spawned("a", kStart);
  c.line("a", sync_line("a", 1, "h"), kStart + 19'000);
  c.tick(kStart + 30'000);  // alone for 30 s: waiting for peers is no stall
  EXPECT_TRUE(c.ok()) << kinds(c);
  c.spawned("b", kStart + 30'000);
  c.tick(kStart + 35'000);
  c.line("a", sync_line("a", 2, "h2"), kStart + 35'000);
  c.line("b", sync_line("b", 2, "h2", "receive"), kStart + 35'000);
  EXPECT_TRUE(c.ok()) << kinds(c);
  EXPECT_EQ(c.longest_stall_ms(), 5000);
  // b stops making progress while a goes on.
  for (std::int64_t t = 36'000; t <= 46'000; t += 1000) {
    c.line("a", sync_line("a", static_cast<std::uint64_t>(3 + (t - 36'000) / 1000), std::string("h").append(std::to_string(t))),
           kStart + t);
    c.tick(kStart + t);
  }
  EXPECT_TRUE(c.ok()) << kinds(c);
  c.tick(kStart + 46'001);
  ASSERT_EQ(c.violations().size(), 1u);
  EXPECT_EQ(c.violations()[0].kind, "stall");
  EXPECT_EQ(c.longest_stall_worker(), "b");
}

TEST(SoakChecker, TheHighestRevisionMustGrowWithinTheWindow) {
  Checker c(config(), kStart);
  c.spawned("a", kStart);
  c.line("a", sync_line("a", 1, "h"), kStart + 1000);
  c.tick(kStart + 21'000);
  EXPECT_TRUE(c.ok()) << kinds(c);
  c.tick(kStart + 21'001);
  ASSERT_EQ(c.violations().size(), 1u);
  EXPECT_EQ(c.violations()[0].kind, "progress");
  EXPECT_EQ(c.longest_revision_gap_ms(kStart + 25'000), 24'000);
}

TEST(SoakChecker, AResumedWorkerMustFailFastWithAnEvictionStatus) {
  Checker c(config(), kStart);
  for (const char* n : {"a", "b", "c"}) c.spawned(n, kStart);
  c.stopped("a", kStart + 100);
  EXPECT_EQ(c.active().size(), 2u);
  c.resumed("a", kStart + 2000);
  c.line("a", exit_line("a", LOCKSTEP_STATUS_KICKED), kStart + 2010);
  c.exited("a", 3, kStart + 2011);
  EXPECT_TRUE(c.ok()) << kinds(c);
  EXPECT_EQ(c.longest_resume_exit_ms(), 11);
  EXPECT_TRUE(c.unexpected_exits().empty());
  // One that goes on after its resumption.
  c.stopped("b", kStart + 3000);
  c.resumed("b", kStart + 5000);
  c.tick(kStart + 11'000);
  EXPECT_TRUE(c.ok()) << kinds(c);
  c.tick(kStart + 11'001);
  ASSERT_EQ(c.violations().size(), 1u);
  EXPECT_EQ(c.violations()[0].kind, "resume");
  // One that ends with a status an evicted peer never gets.
  c.spawned("d", kStart + 12'000);
  c.stopped("d", kStart + 12'000);
  c.resumed("d", kStart + 14'000);
  c.line("d", exit_line("d", LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED), kStart + 14'001);
  ASSERT_EQ(c.violations().size(), 2u);
  EXPECT_EQ(c.violations()[1].kind, "resume");
}

TEST(SoakChecker, AWorkerStoppedWhenTheMasterWasReplacedMayBeTakenBack) {
  Checker c(config(), kStart);
  for (const char* n : {"a", "b", "c"}) c.spawned(n, kStart);
  c.stopped("a", kStart + 100);
  c.master_replaced(kStart + 200);  // before the old master could evict it
  c.resumed("a", kStart + 2000);
  // The new master took it back: it progresses again, past the exit margin.
  c.tick(kStart + 9000);
  for (const char* n : {"a", "b", "c"}) c.line(n, sync_line(n, 5, "h5"), kStart + 9000);
  c.tick(kStart + 12'000);
  EXPECT_TRUE(c.ok()) << kinds(c);
  EXPECT_EQ(c.active(), (std::set<std::string>{"a", "b", "c"}));
  // One stopped later, with the master in place, is held to failing fast again.
  c.stopped("b", kStart + 13'000);
  c.resumed("b", kStart + 15'000);
  for (const char* n : {"a", "c"}) c.line(n, sync_line(n, 6, "h6"), kStart + 18'000);
  c.tick(kStart + 21'001);
  ASSERT_EQ(c.violations().size(), 1u) << kinds(c);
  EXPECT_EQ(c.violations()[0].kind, "resume");
}

TEST(SoakChecker, CrashesAndForbiddenStatusesAreViolationsEvictionsAreNot) {
  Checker c(config(), kStart);
  for (const char* n : {"a", "b", "c", "d", "e"}) c.spawned(n, kStart);
  c.killed("a", kStart + 1);  // SIGKILL by the orchestrator
  c.exited("a", 137, kStart + 2);
  // An active worker evicted on its own: reported, not a violation.
  c.line("b", exit_line("b", LOCKSTEP_STATUS_KICKED), kStart + 3);
  c.exited("b", 3, kStart + 3);
  EXPECT_TRUE(c.ok()) << kinds(c);
  ASSERT_EQ(c.unexpected_exits().size(), 1u);
  // A crash.
  c.exited("c", 134, kStart + 4);
  ASSERT_EQ(c.violations().size(), 1u);
  EXPECT_EQ(c.violations()[0].kind, "crash");
  // A status a correct program never sees.
  c.line("d", exit_line("d", LOCKSTEP_STATUS_REVISION_VIOLATION), kStart + 5);
  c.line("e", json{{"name", "e"}, {"ev", "unexpected"}, {"op", "sync"}, {"code", 16}}.dump(), kStart + 5);
  ASSERT_EQ(c.violations().size(), 3u);
  EXPECT_EQ(c.violations()[1].kind, "status");
  EXPECT_EQ(c.violations()[2].kind, "status");
  // A clean end after SIGTERM.
  c.exited("e", 0, kStart + 6, /*shutting_down=*/true);
  EXPECT_EQ(c.violations().size(), 3u);
}

TEST(SoakChecker, LostStateAndGarbledOutputAreViolations) {
  Checker c(config(), kStart);
  c.spawned("a", kStart);
  c.line("a", json{{"name", "a"}, {"ev", "sync_retry"}, {"code", LOCKSTEP_STATUS_PEER_CONNECTION_LOST}}.dump(), kStart);
  EXPECT_TRUE(c.ok()) << kinds(c);
  c.line("a", json{{"name", "a"}, {"ev", "sync_retry"}, {"code", LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE}}.dump(),
         kStart);
  c.line("a", "not json", kStart);
  ASSERT_EQ(c.violations().size(), 2u);
  EXPECT_EQ(c.violations()[0].kind, "state");
  EXPECT_EQ(c.violations()[1].kind, "output");
}

TEST(SoakChecker, HoldersAreTheActiveWorkersThatSynced) {
  Checker c(config(), kStart);
  for (const char* n : {"a", "b", "c"}) c.spawned(n, kStart);
  c.line("a", sync_line("a", 1, "h"), kStart);
  c.line("b", sync_line("b", 1, "h"), kStart);
  EXPECT_EQ(c.active_holders(), (std::set<std::string>{"a", "b"}));
  c.stopped("b", kStart + 1);
  EXPECT_EQ(c.active_holders(), (std::set<std::string>{"a"}));
  EXPECT_EQ(c.active(), (std::set<std::string>{"a", "c"}));
  EXPECT_TRUE(c.has_synced("b"));
  EXPECT_FALSE(c.has_synced("c"));
}

TEST(SoakChecker, WorkersCutOffByAPartitionReturnOrFailFastWhenHealed) {
  CheckerConfig cc = config();
  cc.partition_allowance_ms = 10'000;
  Checker c(cc, kStart);
  for (const char* n : {"a", "b", "c", "d"}) c.spawned(n, kStart);
  c.partition_started({"a", "b"}, kStart + 100);  // their host is cut off
  EXPECT_EQ(c.active(), (std::set<std::string>{"c", "d"}));
  // A late report of a cut-off worker counts for one outcome but not for the skew.
  c.line("c", reduce_line("c", 1, 0, LOCKSTEP_OK, "x", 4, kStart + 200), kStart + 200);
  c.line("a", reduce_line("a", 1, 0, LOCKSTEP_OK, "x", 4, kStart + 2500), kStart + 2500);
  EXPECT_EQ(c.outcome_skews(), 0u);
  c.partition_healed(kStart + 3000);
  EXPECT_EQ(c.active(), (std::set<std::string>{"c", "d"}));  // not before they show it
  // An all-reduce that ended before the cut, read after the heal, says nothing yet.
  c.line("a", reduce_line("a", 0, 0, LOCKSTEP_OK, "w", 4, kStart + 50), kStart + 3500);
  EXPECT_EQ(c.active(), (std::set<std::string>{"c", "d"}));
  // a was not evicted: it progresses and is active again.
  c.line("a", sync_line("a", 5, "h5"), kStart + 4000);
  EXPECT_EQ(c.active(), (std::set<std::string>{"a", "c", "d"}));
  // b was evicted: it ends with an eviction status, fast.
  c.line("b", exit_line("b", LOCKSTEP_STATUS_MASTER_CONNECTION_LOST), kStart + 4500);
  c.exited("b", 3, kStart + 4501);
  EXPECT_TRUE(c.ok()) << kinds(c);
  EXPECT_EQ(c.partitioned_returned(), 1u);
  EXPECT_EQ(c.partitioned_evicted(), 1u);
  EXPECT_EQ(c.longest_heal_settle_ms(), 1501);
  EXPECT_TRUE(c.unexpected_exits().empty());
  // The one outcome still holds for a cut-off worker's report.
  c.line("a", reduce_line("a", 2, 0, LOCKSTEP_OK, "y", 4, kStart + 5000), kStart + 5000);
  c.line("c", reduce_line("c", 2, 0, LOCKSTEP_OK, "z", 4, kStart + 5000), kStart + 5000);
  ASSERT_EQ(c.violations().size(), 1u);
  EXPECT_EQ(c.violations()[0].kind, "allreduce");
}

TEST(SoakChecker, AHealedWorkerThatNeitherReturnsNorFailsFastIsReported) {
  CheckerConfig cc = config();
  cc.partition_allowance_ms = 10'000;
  cc.progress_window_ms = 100'000;
  Checker c(cc, kStart);
  c.spawned("a", kStart);
  c.spawned("b", kStart);
  c.partition_started({"a"}, kStart);
  c.partition_healed(kStart + 1000);
  // Silent for heartbeat + stall margin + allowance (21 s) after the heal.
  c.tick(kStart + 22'000);
  EXPECT_TRUE(c.ok()) << kinds(c);
  c.tick(kStart + 22'001);
  ASSERT_EQ(c.violations().size(), 1u);
  EXPECT_EQ(c.violations()[0].kind, "heal");
  // Evicted but slow to exit (more than heartbeat + exit margin after the heal).
  c.partition_started({"b"}, kStart + 30'000);
  c.partition_healed(kStart + 31'000);
  c.line("b", exit_line("b", LOCKSTEP_STATUS_KICKED), kStart + 37'001);
  c.exited("b", 3, kStart + 37'001);
  ASSERT_EQ(c.violations().size(), 2u);
  EXPECT_EQ(c.violations()[1].kind, "heal");
  // Ends with a status an evicted peer never gets.
  c.spawned("c", kStart + 39'000);
  c.partition_started({"c"}, kStart + 40'000);
  c.line("c", exit_line("c", LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED), kStart + 40'500);
  ASSERT_EQ(c.violations().size(), 3u);
  EXPECT_EQ(c.violations()[2].kind, "heal");
}

TEST(SoakChecker, AStallOverlappingAPartitionGetsTheAllowanceOthersDoNot) {
  CheckerConfig cc = config();
  cc.partition_allowance_ms = 10'000;
  cc.progress_window_ms = 100'000;
  Checker c(cc, kStart);
  c.spawned("a", kStart);
  c.spawned("b", kStart);
  c.partition_started({}, kStart + 1000);  // a link between two worker hosts
  c.partition_healed(kStart + 3000);
  c.tick(kStart + 21'000);  // 21 s: within 1 + 10 + 10 s
  EXPECT_TRUE(c.ok()) << kinds(c);
  c.line("a", sync_line("a", 1, "h"), kStart + 21'000);
  c.line("b", sync_line("b", 1, "h"), kStart + 21'000);
  // No partition since: the plain bound (11 s) applies.
  c.tick(kStart + 32'000);
  EXPECT_TRUE(c.ok()) << kinds(c);
  c.tick(kStart + 32'001);
  ASSERT_EQ(c.violations().size(), 1u);
  EXPECT_EQ(c.violations()[0].kind, "stall");
}

}  // namespace
}  // namespace lockstep::soak
