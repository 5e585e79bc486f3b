// lockstep-soak: a chaos soak of lockstep with real processes (docs/soak.md).
//   worker: a training-like peer written against the public C API only;
//   run:    the orchestrator: a master, workers, kills, stops and spawns, live checks.
#pragma once

#include <cstdint>
#include <string>

namespace lockstep::soak {

struct WorkerOptions {
  std::string master = "127.0.0.1:48148";
  std::string name = "worker";
  // The seed of every deterministic value (all workers of a run use the same one).
  std::uint64_t seed = 1;
  // Started with the run: presents the initial state (revision 1, enforce-popular) at its
  // first sync. Workers started later join receive-only at revision 0.
  bool bootstrap = false;
  // Elements (f32) of each shared-state tensor (weights, momentum) and of each all-reduce.
  std::uint64_t state_elements = 256 * 1024;
  std::uint64_t reduce_elements = 256 * 1024;
  // Concurrent all-reduces per step (distinct tags).
  std::uint32_t reduces = 3;
  // Time spent "computing" per step (a sleep).
  std::uint32_t compute_ms = 10;
  std::uint32_t connect_timeout_ms = 10'000;
  // Report an unexpected status of connect or update_topology and go on (see worker.cpp).
  bool keep_going = false;
};

int run_worker(const WorkerOptions& options);

struct RunOptions {
  double seconds = 150;
  std::uint32_t peers_initial = 4;
  std::uint32_t peers_max = 6;
  std::uint32_t peers_min = 2;
  std::uint64_t seed = 0;  // 0: drawn at random and printed
  std::uint32_t heartbeat_timeout_ms = 1000;
  std::uint32_t event_min_ms = 500;
  std::uint32_t event_max_ms = 1000;
  std::uint32_t stall_margin_ms = 10'000;
  std::uint32_t exit_margin_ms = 5'000;
  std::uint32_t progress_window_ms = 20'000;
  std::uint32_t outcome_skew_ms = 2'000;
  std::uint32_t rss_growth_limit_mib = 32;
  std::string log_dir;  // "": a new directory under /tmp
  bool keep_going = false;
  bool trace = false;
  // Passed to every worker.
  WorkerOptions worker;
};

int run_soak(const RunOptions& options, const std::string& self_path);

// Milliseconds of the system's monotonic clock (the same in every process).
std::int64_t now_ms();

}  // namespace lockstep::soak
