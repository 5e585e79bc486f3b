// lockstep-soak: a chaos soak of lockstep with real processes (docs/soak.md).
//   worker: a training-like peer written against the public C API only;
//   run:    the orchestrator: a master, workers, kills, stops and spawns, live checks.
// lockstep-soak-pccl-worker is the same peer written against PCCL's API (pccl.h alone,
// linked with liblockstep-pccl); `run --pccl-workers N` starts it in N worker slots.
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
  // The address other peers reach this one at, and the one its p2p sockets bind to
  // ("": the address the master sees, and 0.0.0.0). Set on the WAN test bed.
  std::string advertised_host;
  std::string bind_host;
  // Accept no inbound connection (listen on no port), as a peer behind a NAT.
  bool no_inbound = false;
  // An all-reduce attempt fails when no byte moves to or from its ring neighbours for
  // this long (0: the library's default, 30000).
  std::uint32_t p2p_stall_timeout_ms = 0;
  // Report an unexpected status of connect or update_topology and go on (see worker.cpp).
  bool keep_going = false;
  // Failover (docs/operations.md): how long the worker waits for a master to take it
  // back when its master is lost (0: off, it ends with MASTER_CONNECTION_LOST).
  std::uint32_t failover_timeout_ms = 0;
  // The native worker leaves out the reduce-scatter, all-gather and broadcast of each
  // step, so that it runs the collectives of a PCCL worker (which has only all-reduces)
  // in the same group.
  bool all_reduces_only = false;
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
  // WAN mode (docs/soak.md): 0 runs on loopback; N >= 3 brings up a test bed of N hosts
  // (lockstep-testbed, prefix testbed_prefix), the master in host 0, the workers round-robin
  // in hosts 1..N-1, every link capped at testbed_rate with testbed_delay_ms one way
  // ("" / 0: none), and partitions among the events.
  std::uint32_t testbed_hosts = 0;
  std::string testbed_prefix;  // "": "sk" and the orchestrator's pid
  std::string testbed_rate = "200mbit";
  double testbed_delay_ms = 5;
  // A partition lasts partition_min_ms..partition_max_ms.
  std::uint32_t partition_min_ms = 500;
  std::uint32_t partition_max_ms = 3000;
  // Worker slots 0..pccl_workers-1 run lockstep-soak-pccl-worker (a worker spawned takes
  // the lowest free slot, so a slot keeps its kind across restarts); with any, every
  // native worker runs --all-reduces-only.
  std::uint32_t pccl_workers = 0;
  // Every no_inbound_every-th native worker spawned accepts no inbound connection
  // (--no-inbound; 0: none): its ring edges run reversed (docs/deployment.md, "NAT").
  std::uint32_t no_inbound_every = 0;
  // The master relays (--relay-port 0) under a run secret that every process reads from
  // LOCKSTEP_SECRET_FILE (a file in the log directory): two workers that accept no
  // inbound connection may be ring neighbours (docs/deployment.md, "Relays").
  bool relay = false;
  // lockstep-relay processes (in the master's host), under the same secret; every
  // relay_churn_ms the one in use is SIGKILLed and a new one started, so that the run
  // moves its relayed edges to the next (docs/deployment.md, "Relays"). 0: none.
  std::uint32_t relay_processes = 0;
  std::uint32_t relay_churn_ms = 10'000;
  // Failover under chaos: every master_kill_ms the master is SIGKILLed and a new one
  // started on its address at once, as a supervisor would (0: never); the workers run with
  // failover on (30 s) and must carry on with every invariant kept.
  std::uint32_t master_kill_ms = 0;
  // WAN mode: the last testbed_nat_hosts hosts sit behind NATs of their own (lockstep-
  // testbed nat): their workers accept no inbound connection, and the master finds it out.
  std::uint32_t testbed_nat_hosts = 0;
  // Passed to every worker.
  WorkerOptions worker;
};

int run_soak(const RunOptions& options, const std::string& self_path);

// Milliseconds of the system's monotonic clock (the same in every process).
std::int64_t now_ms();

}  // namespace lockstep::soak
