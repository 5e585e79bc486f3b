// lockstep-soak: the chaos soak (docs/soak.md).
//   lockstep-soak run [--seconds 150] [--peers 4..6] [--seed S] [--pccl-workers N] ...
//   lockstep-soak worker --master HOST:PORT --name N [--bootstrap] ...   (started by run)
#include "soak.h"
#include "worker_common.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <unistd.h>

namespace {

std::string self_path(const char* argv0) {
  char self[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  return n > 0 ? std::string(self, static_cast<std::size_t>(n)) : std::string(argv0);
}

// "4..6" (start with 4, keep at most 6) or "5" (start with 5, at most 5 + 2).
bool parse_peers(const std::string& text, std::uint32_t* initial, std::uint32_t* max) {
  try {
    const auto dots = text.find("..");
    if (dots == std::string::npos) {
      *initial = static_cast<std::uint32_t>(std::stoul(text));
      *max = *initial + 2;
    } else {
      *initial = static_cast<std::uint32_t>(std::stoul(text.substr(0, dots)));
      *max = static_cast<std::uint32_t>(std::stoul(text.substr(dots + 2)));
    }
  } catch (const std::exception&) {
    return false;
  }
  return *initial >= 2 && *max >= *initial && *max <= 64;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lockstep-soak: a chaos soak of lockstep with real processes (docs/soak.md)"};
  app.require_subcommand(1);

  lockstep::soak::WorkerOptions worker;
  CLI::App* w = app.add_subcommand("worker", "a training-like peer (started by `run`)");
  lockstep::soak::add_worker_cli(w, worker);
  w->add_flag("--all-reduces-only", worker.all_reduces_only,
              "leave out each step's reduce-scatter, all-gather and broadcast, which PCCL v1.0 lacks (run sets it "
              "when it has PCCL workers)");

  lockstep::soak::RunOptions run;
  std::string peers = "4..6";
  CLI::App* r = app.add_subcommand("run", "the orchestrator: a master, workers and chaos, checked live");
  r->add_option("--seconds", run.seconds, "length of the chaos (hours are fine)")->capture_default_str();
  r->add_option("--peers", peers, "workers at the start .. at most (at least 2 are kept alive)")->capture_default_str();
  r->add_option("--seed", run.seed, "seed of the events and the workers' values (0: random; always printed)");
  r->add_option("--heartbeat-timeout-ms", run.heartbeat_timeout_ms, "the master's heartbeat timeout")
      ->check(CLI::Range(100u, 600'000u))
      ->capture_default_str();
  r->add_option("--event-min-ms", run.event_min_ms, "shortest pause between two events")->capture_default_str();
  r->add_option("--event-max-ms", run.event_max_ms, "longest pause between two events")->capture_default_str();
  r->add_option("--stall-margin-ms", run.stall_margin_ms,
                "a worker without progress for the heartbeat timeout plus this is a violation")
      ->capture_default_str();
  r->add_option("--exit-margin-ms", run.exit_margin_ms,
                "a resumed (evicted) worker must exit within the heartbeat timeout plus this")
      ->capture_default_str();
  r->add_option("--progress-window-ms", run.progress_window_ms,
                "the highest revision must grow within every window this long (at least 3 heartbeat timeouts)")
      ->capture_default_str();
  r->add_option("--outcome-skew-ms", run.outcome_skew_ms,
                "the peers of one all-reduce attempt must learn its outcome within this long of each other (0: off)")
      ->capture_default_str();
  r->add_option("--rss-growth-mib", run.rss_growth_limit_mib,
                "allowed growth of the master's RSS from the first minute (30 s for runs under 2 min) to the end")
      ->capture_default_str();
  r->add_option("--log-dir", run.log_dir, "where the master's, workers' and the soak's logs go (default: a new /tmp dir)");
  r->add_flag("--keep-going", run.keep_going, "go on after the first violation");
  r->add_flag("--trace", run.trace, "also write every worker line to LOG_DIR/trace.jsonl");
  r->add_option("--testbed", run.testbed_hosts,
                "WAN mode: run on a lockstep-testbed bed of N hosts (master in host 0, workers in 1..N-1), with partitions; needs root")
      ->check(CLI::Range(3u, 120u));
  r->add_option("--testbed-prefix", run.testbed_prefix, "the bed's prefix (default: sk and this process's pid)");
  r->add_option("--testbed-rate", run.testbed_rate, "cap of every link, each direction (\"\": none)")->capture_default_str();
  r->add_option("--testbed-delay-ms", run.testbed_delay_ms, "one-way delay of every link (0: none)")->capture_default_str();
  r->add_option("--partition-min-ms", run.partition_min_ms, "shortest partition")->capture_default_str();
  r->add_option("--partition-max-ms", run.partition_max_ms, "longest partition")->capture_default_str();
  r->add_option("--pccl-workers", run.pccl_workers,
                "worker slots that run lockstep-soak-pccl-worker (PCCL's API over liblockstep-pccl) instead of the "
                "native worker; restarts keep a slot's kind, and the native workers then run only all-reduces")
      ->capture_default_str();
  r->add_option("--no-inbound-every", run.no_inbound_every,
                "every Nth worker spawned accepts no inbound connection, as behind a NAT (0: none)")
      ->capture_default_str();
  r->add_flag("--relay", run.relay,
              "the master relays the ring edges between workers that accept no inbound connection (a run secret "
              "in the log directory, given to every process through LOCKSTEP_SECRET_FILE)");
  r->add_option("--relay-processes", run.relay_processes,
                "lockstep-relay processes beside the master (a run secret as for --relay); the one in use is "
                "killed and replaced every --relay-churn-ms")
      ->check(CLI::Range(0u, 8u))
      ->capture_default_str();
  r->add_option("--master-kill-ms", run.master_kill_ms,
                "SIGKILL the master this often and start a new one on its address at once; the workers run with "
                "failover on (0: never)")
      ->capture_default_str();
  r->add_option("--relay-churn-ms", run.relay_churn_ms, "how often the relay process in use is killed")
      ->check(CLI::Range(1000u, 3'600'000u))
      ->capture_default_str();
  r->add_option("--testbed-nat-hosts", run.testbed_nat_hosts,
                "WAN mode: the last K hosts sit behind NATs of their own (their workers accept no inbound connection)")
      ->capture_default_str();
  lockstep::soak::add_worker_sizing(r, run.worker);

  CLI11_PARSE(app, argc, argv);
  if (w->parsed()) return lockstep::soak::run_worker(worker);
  if (!parse_peers(peers, &run.peers_initial, &run.peers_max)) {
    std::fprintf(stderr, "--peers must be N or MIN..MAX with 2 <= MIN <= MAX <= 64\n");
    return 2;
  }
  if (run.pccl_workers > run.peers_max) {
    std::fprintf(stderr, "--pccl-workers must be at most the largest number of workers (--peers)\n");
    return 2;
  }
  if (run.master_kill_ms > 0 && (run.pccl_workers > 0 || run.relay_processes > 0)) {
    // PCCL's API has no failover (its workers end with the master), and relay processes
    // register with one master.
    std::fprintf(stderr, "--master-kill-ms goes with neither --pccl-workers nor --relay-processes\n");
    return 2;
  }
  if (run.event_min_ms == 0 || run.event_max_ms < run.event_min_ms) {
    std::fprintf(stderr, "--event-min-ms must be positive and at most --event-max-ms\n");
    return 2;
  }
  if (run.testbed_nat_hosts > 0 && (run.testbed_hosts == 0 || run.testbed_nat_hosts + 2 > run.testbed_hosts)) {
    std::fprintf(stderr, "--testbed-nat-hosts needs --testbed and leaves the master's host and one worker host open\n");
    return 2;
  }
  if (run.partition_min_ms == 0 || run.partition_max_ms < run.partition_min_ms) {
    std::fprintf(stderr, "--partition-min-ms must be positive and at most --partition-max-ms\n");
    return 2;
  }
  return lockstep::soak::run_soak(run, self_path(argv[0]));
}
