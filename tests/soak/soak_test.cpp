// The chaos soak as a test: `lockstep-soak run` for 90 s (35 s with a longer heartbeat
// timeout and smaller buffers under the sanitizers, whose builds set
// LOCKSTEP_TEST_TIME_SCALE above 1), and its JSON summary must say "ok": true; then 40 s
// (30 s) more with the master killed and replaced every 12 s.
// Two of its worker slots run the PCCL worker (lockstep-soak-pccl-worker, PCCL's API over
// liblockstep-pccl) in the same group as the native ones, and they must have synced and
// all-reduced. LOCKSTEP_SOAK_PCCL_WORKERS=N changes how many (0: none). Every third
// native worker spawned accepts no inbound connection, as behind a NAT (its ring edges
// and shared-state transfers run reversed); LOCKSTEP_SOAK_NO_INBOUND_EVERY=N changes
// that (0: none).
// LOCKSTEP_SOAK_SEED=S replays a seed; LOCKSTEP_SOAK_SECONDS=N changes the length.
// LOCKSTEP_SOAK_TESTBED=N runs the WAN mode on a test bed of N hosts, with partitions
// (CTest testbed.soak_wan, registered with the test bed's tests: it needs root);
// LOCKSTEP_SOAK_NAT_HOSTS=K puts the last K of them behind NATs. Two lockstep-relay
// processes run beside the master, the one in use killed and replaced every 10 s (so the
// run has a secret, and NAT workers may be neighbours); LOCKSTEP_SOAK_RELAY_PROCESSES=R
// changes how many (0: none).
#include "e2e.h"

#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <unistd.h>

namespace lockstep::e2e {
namespace {

std::string env(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::string(value) : fallback;
}

// Runs lockstep-soak for `seconds` (the common flags, then `extra`) and returns its
// summary, checked: "ok", exit status 0, revisions and kills.
json run_soak(const std::string& seconds, const std::vector<std::string>& extra) {
  const bool sanitized = kTimeScale > 1;
  const std::string seed = env("LOCKSTEP_SOAK_SEED", "0");  // 0: a random seed, printed
  const std::string log_dir = std::string(LOCKSTEP_SOAK_LOG_ROOT) + "/run-" + std::to_string(::getpid()) + "-" +
                              ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::vector<std::string> argv = {bin("lockstep-soak"),
                                   "run",
                                   "--seconds",
                                   seconds,
                                   "--seed",
                                   seed,
                                   "--log-dir",
                                   log_dir,
                                   "--heartbeat-timeout-ms",
                                   std::to_string(1000 * kTimeScale),
                                   "--stall-margin-ms",
                                   std::to_string(10'000 * kTimeScale),
                                   "--exit-margin-ms",
                                   std::to_string(5'000 * kTimeScale),
                                   "--outcome-skew-ms",
                                   std::to_string(2'000 * kTimeScale),
                                   "--progress-window-ms",
                                   std::to_string(20'000 * kTimeScale)};
  argv.insert(argv.end(), extra.begin(), extra.end());
  if (sanitized) {
    // Slower processes: fewer events, smaller buffers, the same assertions, but for the
    // master's memory: AddressSanitizer's quarantine (256 MiB) keeps freed blocks resident,
    // so the RSS grows without a leak; LeakSanitizer checks the master when it exits.
    for (const char* arg : {"--event-min-ms", "1000", "--event-max-ms", "2000", "--state-elements", "65536",
                            "--reduce-elements", "65536", "--rss-growth-mib", "1024"}) {
      argv.emplace_back(arg);
    }
  }
  auto proc = tools::Subprocess::spawn(argv);
  if (!proc) {
    ADD_FAILURE() << "cannot start lockstep-soak";
    return json();
  }
  json summary;
  std::optional<int> status;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(std::stoi(seconds)) + scaled(120s);
  const auto handle = [&](const std::string& line) {
    std::cout << line << std::endl;  // seed, progress, violations and the summary
    auto j = json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.value("soak", "") == "summary") summary = j;
  };
  while (std::chrono::steady_clock::now() < deadline) {
    auto line = proc->read_line(5s);
    if (line) {
      handle(*line);
      continue;
    }
    if ((status = proc->wait(1s))) {
      // It has ended: what it printed last may still be in the pipe.
      while (auto rest = proc->read_line(1s)) handle(*rest);
      break;
    }
  }
  if (!status) status = proc->wait(scaled(30s));
  if (!summary.is_object()) {
    ADD_FAILURE() << "no summary from lockstep-soak (logs in " << log_dir << ")";
    return json();
  }
  EXPECT_TRUE(summary.value("ok", false)) << "first violation: " << summary["first_violation"].dump()
                                          << "\nreplay with LOCKSTEP_SOAK_SEED=" << summary["seed"].dump()
                                          << "; logs in " << log_dir;
  EXPECT_EQ(status.value_or(-1), 0);
  EXPECT_GT(summary.value("revisions", 0), 0);
  EXPECT_GT(summary["events"].value("kills", 0), 0);
  return summary;
}

TEST(Soak, ChaosKeepsParityOneOutcomeAndProgress) {
  const bool sanitized = kTimeScale > 1;
  const std::string testbed = env("LOCKSTEP_SOAK_TESTBED", "");
  const std::string pccl_workers = env("LOCKSTEP_SOAK_PCCL_WORKERS", "2");
  std::vector<std::string> extra = {"--pccl-workers", pccl_workers, "--no-inbound-every",
                                    env("LOCKSTEP_SOAK_NO_INBOUND_EVERY", "3"), "--relay-processes",
                                    env("LOCKSTEP_SOAK_RELAY_PROCESSES", "2")};
  if (!testbed.empty()) {
    // The master in host 0, workers in the others; links capped and delayed (the
    // defaults of --testbed-rate and --testbed-delay-ms); the bed's prefix is derived
    // from the soak's pid, so that it does not collide with other beds.
    extra.insert(extra.end(), {"--testbed", testbed, "--testbed-nat-hosts", env("LOCKSTEP_SOAK_NAT_HOSTS", "0")});
  }
  const json summary = run_soak(env("LOCKSTEP_SOAK_SECONDS", sanitized ? "35" : "90"), extra);
  ASSERT_TRUE(summary.is_object());
  if (std::stoi(pccl_workers) > 0) {
    // The PCCL workers took part: started, synced and all-reduced.
    ASSERT_TRUE(summary["pccl"].is_object()) << summary.dump();
    EXPECT_GE(summary["pccl"].value("workers_started", 0), std::stoi(pccl_workers));
    EXPECT_GT(summary["pccl"].value("syncs", 0), 0);
    EXPECT_GT(summary["pccl"].value("allreduces_ok", 0), 0);
  }
  if (!testbed.empty()) {
    EXPECT_GT(summary["events"].value("host_partitions", 0), 0);
    EXPECT_GT(summary["events"].value("pair_partitions", 0), 0);
  }
}

// Failover under chaos: the master SIGKILLed every 12 s (10 s in the slower sanitizer
// builds) and a new one started on its
// address at once, the workers (all native: PCCL's API has no failover) with failover on;
// every invariant holds across the failovers. LOCKSTEP_SOAK_MASTER_SECONDS changes the
// length.
TEST(Soak, TheRunOutlivesItsMasterUnderChaos) {
  const bool sanitized = kTimeScale > 1;
  const std::string seconds = env("LOCKSTEP_SOAK_MASTER_SECONDS", sanitized ? "30" : "40");
  const json summary = run_soak(seconds, {"--master-kill-ms", sanitized ? "10000" : "12000"});
  ASSERT_TRUE(summary.is_object());
  EXPECT_GE(summary["events"].value("master_kills", 0), 2) << summary.dump();
}

}  // namespace
}  // namespace lockstep::e2e
