// lockstep-bench: measures lockstep against the transport bound, Gloo and torch.distributed,
// with the definitions of PRODUCT.md and BENCHMARKS.md. It starts a master and N worker
// processes on loopback (workers are this program run as `lockstep-bench worker ...`) and
// prints one JSON object per line per measurement.
//
//   lockstep-bench allreduce --peers 4 --size 1KiB,16MiB,256MiB [--dtype f32] [--op sum] [--encrypt]
//                  [--concurrency K] [--pool P] [--iterations N] [--warmup W] [--quant minmax|minmax4|f16|...]
//                  [--compare gloo,torch,torch-lockstep] [--order turns|blocks]
//   lockstep-bench broadcast|allgather|reducescatter --peers 4 --size 256MiB ...   (the same
//       options; --op and --quant for reducescatter; --size is the bytes one peer contributes)
//   lockstep-bench barrier --peers 4 [--iterations N] [--compare gloo,torch] ...
//   lockstep-bench allreduce --master HOST:PORT --peers N [--optimize] ...   (one peer of a run
//       on several hosts: each host runs it against the same master; see scripts/bench-wan-topology.py)
//   lockstep-bench recovery --peers 4 --size 16MiB --trials 20 [--stop] [--kill peer|master [--standby]]
//   lockstep-bench sync --holders 1 --size 256MiB,1GiB [--trials 3]
//       (join-and-sync time of a newcomer receiving the shared state from the holders)
//   lockstep-bench ddp --peers 2 [--steps 30] [--warmup 5] [--width 64 --layers 2 ...]
//       (a transformer's training step alone, under torch DDP over gloo and under
//        lockstep.torch.DataParallel, in turns)
//   lockstep-bench topology [--peers 100,1000] [--seeds 1,...,10] [--kinds levels,uniform,regions]
//                  [--steps N] [--background-steps N]
//       (the ring solver on large groups against its proven bounds, in this process)
//   lockstep-bench hash [--size 1GiB] [--threads 1,2,N] [--iterations 5]
//       (the shared-state content hash in this process, against a single-thread
//        memcpy; N = hardware threads; no master or workers)
#include "bench_common.h"
#include "hash_bench.h"
#include "topology_bench.h"
#include "transport/socket.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>

int main(int argc, char** argv) {
  CLI::App app{"lockstep-bench: collective throughput and latency, recovery time, shared-state sync, content hash, ring solver"};
  app.require_subcommand(1);
  lockstep::bench::Settings s;
  std::string sizes = "16MiB";
  std::string dtype = "f32";
  std::string op = "sum";
  std::string quant = "none";

  // The collectives share their options; --op and --quant where they reduce.
  std::string order = "turns";
  bool small_pages = false;
  std::vector<std::string> compare;
  const auto add_collective = [&](const char* name, const char* what, bool reduces, bool sized) {
    auto* sub = app.add_subcommand(name, what);
    sub->add_option("--peers", s.peers, "number of peer processes")->check(CLI::Range(2, 64));
    if (sized) {
      sub->add_option("--size", sizes,
                      "bytes one peer contributes, comma-separated (suffixes KiB, MiB, GiB)");
      sub->add_option("--dtype", dtype, "element type")->check(CLI::IsMember(lockstep::bench::dtype_names()));
    }
    if (reduces) {
      sub->add_option("--op", op, "reduce op")->check(CLI::IsMember({"sum", "avg", "prod", "max", "min"}));
      sub->add_option("--quant", quant, "quantization on the wire (8-bit, 4-bit codes; f16, bf16 casts)")
          ->check(CLI::IsMember(lockstep::bench::quant_names()));
    }
    sub->add_option("--concurrency", s.concurrency, "collectives in flight at once")->check(CLI::Range(1, 256));
    sub->add_option("--pool", s.pool, "p2p connections per neighbour")->check(CLI::Range(1, 256));
    sub->add_option("--streams", s.streams, "connections one collective stripes over per hop (0: adaptive)")
        ->check(CLI::Range(0, 16));
    sub->add_option("--cc", s.congestion, "TCP congestion control of the p2p connections (default: the system's)");
    sub->add_option("--iterations", s.iterations, "timed repetitions per size")->check(CLI::Range(5, 100000));
    sub->add_option("--warmup", s.warmup, "untimed repetitions first")->check(CLI::Range(0, 1000));
    sub->add_option("--order", order,
                    "turns: lockstep, the plain ring and Gloo take turns round by round, in an order that changes "
                    "from round to round; blocks: each runs its "
                    "rounds back to back (sequential operations)")
        ->check(CLI::IsMember({"turns", "blocks"}));
    sub->add_flag("--encrypt", s.encrypt,
                  "encrypt the data plane (encrypt_data) under a run secret generated for this run");
    sub->add_flag("--check-finite", s.check_finite,
                  "every peer checks its contribution for NaN and infinity first (check_finite)");
    sub->add_flag("--no-inbound", s.no_inbound,
                  "the peers this process starts accept no inbound connection, as behind a NAT (their ring edges "
                  "run reversed where the other end accepts them)");
    sub->add_flag("--small-pages", small_pages,
                  "leave every process's malloc in the system's default pages (by default the workers of "
                  "every library run with GLIBC_TUNABLES=glibc.malloc.hugetlb=1, unless it is set already)");
    sub->add_option("--compare", compare,
                    "also measure gloo (Gloo's collective in the same processes), torch (torch.distributed, "
                    "gloo backend, in processes of its own) and/or torch-lockstep (torch.distributed over "
                    "lockstep's backend, lockstep.torch), comma-separated")
        ->delimiter(',')
        ->check(CLI::IsMember({"gloo", "torch", "torch-lockstep"}));
    return sub;
  };
  auto* allreduce = add_collective("allreduce", "effective all-reduce throughput, latency percentiles", true, true);
  std::vector<CLI::App*> collectives = {
      allreduce,
      add_collective("broadcast", "broadcast from rank 0: the root's buffer over the slowest peer's time", false, true),
      add_collective("allgather", "all-gather: one peer's input over the slowest peer's time", false, true),
      add_collective("reducescatter", "reduce-scatter: one peer's input over the slowest peer's time", true, true),
      add_collective("barrier", "barrier latency percentiles", false, false)};
  std::string join_master;
  allreduce->add_option("--master", join_master,
                        "HOST:PORT of a running master: be ONE peer of a run started on several hosts (each host "
                        "runs this command; --peers is the group size to wait for) and print this peer's figures");
  allreduce->add_option("--advertised-host", s.advertised_host, "with --master: the address other peers use");
  allreduce->add_option("--secret-file", s.secret_file,
                        "with --master: the run secret's file (the master's; a master with a relay has one)");
  allreduce->add_option("--algorithm", s.algorithm,
                        "how lockstep's all-reduce moves its data: auto (by size and world), ring or doubling "
                        "(LOCKSTEP_ALLREDUCE_ALGORITHM of every peer; docs/collectives.md)")
      ->check(CLI::IsMember({"auto", "ring", "doubling"}));
  allreduce->add_flag("--optimize", s.optimize,
                      "with --master: measure in join order, optimize the topology, measure again");

  auto* recovery = app.add_subcommand("recovery", "time from a peer's SIGKILL to the survivors' next all-reduce");
  recovery->add_option("--peers", s.peers, "number of peer processes")->check(CLI::Range(3, 64));
  recovery->add_option("--size", sizes, "bytes per all-reduce");
  recovery->add_option("--trials", s.trials, "kills (at least 20 for a figure)")->check(CLI::Range(1, 1000));
  recovery->add_option("--heartbeat-timeout-ms", s.heartbeat_timeout_ms, "the master's heartbeat timeout");
  recovery->add_flag("--stop", s.stop_instead_of_kill, "SIGSTOP the victim (a silent peer) instead of SIGKILL");
  std::string victim = "peer";
  recovery->add_option("--kill", victim,
                       "peer (a random peer each trial) or master (a lockstep-master process, restarted on its address "
                       "at once as a supervisor would; the peers run with failover)")
      ->check(CLI::IsMember({"peer", "master"}));
  recovery->add_flag("--standby", s.standby,
                     "with --kill master: two masters of a hot standby on a private etcd (/usr/bin/etcd); the serving "
                     "one is killed and the standby takes over, instead of a restart on the same address");
  recovery->add_option("--lease-ttl-s", s.lease_ttl_s, "with --standby: the masters' lease TTL")
      ->check(CLI::Range(2, 60));

  auto* sync = app.add_subcommand("sync", "join-and-sync time of a newcomer receiving the shared state");
  sync->add_option("--holders", s.peers, "up-to-date peers the newcomer receives from")->check(CLI::Range(1, 64));
  sync->add_option("--size", sizes, "shared-state bytes, comma-separated (one run each)");
  int sync_trials = 3;
  sync->add_option("--trials", sync_trials, "newcomers per size (median)")->check(CLI::Range(1, 1000));

  lockstep::bench::HashSettings hash_settings;
  std::string hash_sizes = "1GiB";
  std::string hash_threads = lockstep::bench::default_thread_counts();
  auto* hash = app.add_subcommand("hash", "content hash throughput against memcpy, per thread count");
  hash->add_option("--size", hash_sizes, "bytes hashed, comma-separated (suffixes KiB, MiB, GiB); one buffer");
  hash->add_option("--threads", hash_threads, "thread counts, comma-separated");
  hash->add_option("--iterations", hash_settings.iterations, "timed repetitions (median)")
      ->check(CLI::Range(1, 100000));

  lockstep::bench::TopologySettings topology_settings;
  auto* topology = app.add_subcommand("topology", "the ring solver on large groups against its proven bounds");
  topology->add_option("--peers", topology_settings.peers, "group sizes, comma-separated")
      ->delimiter(',')
      ->check(CLI::Range(3, 4096));
  topology->add_option("--seeds", topology_settings.seeds, "instance seeds, comma-separated")->delimiter(',');
  topology->add_option("--kinds", topology_settings.kinds, "instance kinds, comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember({"levels", "uniform", "regions"}));
  topology->add_option("--steps", topology_settings.steps, "the solver's step budget (default: the master's)");
  topology->add_option("--background-steps", topology_settings.background_steps,
                       "then this many steps of the background search (default none)");

  lockstep::bench::DdpSettings ddp_settings;
  auto* ddp = app.add_subcommand(
      "ddp", "a training step of a character-level transformer: alone, under torch DDP over gloo, and under "
             "lockstep.torch.DataParallel, in turns");
  ddp->add_option("--peers", ddp_settings.peers, "number of peer processes")->check(CLI::Range(2, 64));
  ddp->add_option("--steps", ddp_settings.steps, "timed steps")->check(CLI::Range(1, 100000));
  ddp->add_option("--warmup", ddp_settings.warmup, "untimed steps first")->check(CLI::Range(0, 1000));
  ddp->add_option("--vocab", ddp_settings.vocab, "characters")->check(CLI::Range(2, 1 << 20));
  ddp->add_option("--width", ddp_settings.width, "model width")->check(CLI::Range(8, 1 << 16));
  ddp->add_option("--layers", ddp_settings.layers, "transformer layers")->check(CLI::Range(1, 256));
  ddp->add_option("--heads", ddp_settings.heads, "attention heads (dividing the width)")->check(CLI::Range(1, 256));
  ddp->add_option("--seq", ddp_settings.seq, "sequence length")->check(CLI::Range(2, 1 << 16));
  ddp->add_option("--batch", ddp_settings.batch, "sequences per peer and step")->check(CLI::Range(1, 1 << 16));
  ddp->add_option("--threads", ddp_settings.threads, "torch's threads per process")->check(CLI::Range(1, 1024));

  lockstep::bench::ControlSettings control_settings;
  auto* control = app.add_subcommand(
      "control", "the master's control plane: vote latency, CPU and memory per peer, with N simulated peers");
  control->add_option("--peers", control_settings.peers, "simulated peers, comma-separated (one master each)")
      ->delimiter(',')
      ->check(CLI::Range(1, 16384));
  control->add_option("--rounds", control_settings.rounds, "rounds of each kind")->check(CLI::Range(1, 100000));
  control->add_option("--tags", control_settings.tags, "collectives in flight at once")->check(CLI::Range(1, 4096));

  auto* worker = app.add_subcommand("worker", "(internal) one peer of a benchmark");
  worker->group("");
  worker->add_option("--mode", s.mode)->required();
  worker->add_option("--failover-timeout-ms", s.failover_timeout_ms);
  worker->add_option("--fallback-port", s.fallback_port);
  worker->add_option("--turn-seed", s.turn_seed);
  worker->add_option("--master-port", s.master_port)->required();
  worker->add_option("--index", s.index)->required();
  worker->add_option("--peers", s.peers);
  worker->add_option("--size", sizes);
  worker->add_option("--dtype", dtype);
  worker->add_option("--op", op);
  worker->add_option("--concurrency", s.concurrency);
  worker->add_option("--pool", s.pool);
  worker->add_option("--streams", s.streams);
  worker->add_option("--cc", s.congestion);
  worker->add_option("--iterations", s.iterations);
  worker->add_option("--warmup", s.warmup);
  worker->add_option("--order", order);
  worker->add_option("--gloo-store", s.gloo_store);
  worker->add_option("--quant", quant);
  worker->add_option("--secret-file", s.secret_file);
  worker->add_flag("--encrypt", s.encrypt);
  worker->add_flag("--check-finite", s.check_finite);
  worker->add_flag("--no-inbound", s.no_inbound);
  worker->add_flag("--paced", s.paced);
  CLI11_PARSE(app, argc, argv);
  // The peers this process starts inherit it.
  if (s.algorithm != "auto") ::setenv("LOCKSTEP_ALLREDUCE_ALGORITHM", s.algorithm.c_str(), 1);

  if (*control) {
    control_settings.self = lockstep::bench::self_path(argv[0]);
    return lockstep::bench::run_control(control_settings);
  }
  if (*topology) return lockstep::bench::run_topology(topology_settings);
  if (*hash) {
    auto hash_parsed = lockstep::bench::parse_sizes(hash_sizes);
    auto threads_parsed = lockstep::bench::parse_thread_counts(hash_threads);
    if (!hash_parsed || !threads_parsed) {
      std::fprintf(stderr, "lockstep-bench: bad --size '%s' or --threads '%s' (e.g. --size 1GiB --threads 1,2,8)\n",
                   hash_sizes.c_str(), hash_threads.c_str());
      return 2;
    }
    hash_settings.sizes = *hash_parsed;
    hash_settings.threads = *threads_parsed;
    return lockstep::bench::run_hash(hash_settings);
  }

  if (*ddp) {
    if (ddp_settings.width % ddp_settings.heads != 0) {
      std::fprintf(stderr, "lockstep-bench ddp: --heads must divide --width\n");
      return 2;
    }
    return lockstep::bench::run_ddp(ddp_settings);
  }

  auto parsed = lockstep::bench::parse_sizes(sizes);
  if (!parsed) {
    std::fprintf(stderr, "lockstep-bench: bad --size '%s' (e.g. 1KiB,16MiB,1GiB)\n", sizes.c_str());
    return 2;
  }
  s.sizes = *parsed;
  s.in_turns = order == "turns";
  s.dtype = lockstep::bench::dtype_from_name(dtype);
  s.op = lockstep::bench::op_from_name(op);
  s.quant = lockstep::bench::quant_from_name(quant);
  s.compare_gloo = std::find(compare.begin(), compare.end(), "gloo") != compare.end();
  s.compare_torch = std::find(compare.begin(), compare.end(), "torch") != compare.end();
  s.compare_torch_lockstep = std::find(compare.begin(), compare.end(), "torch-lockstep") != compare.end();
  s.self = lockstep::bench::self_path(argv[0]);
  if (*worker) return lockstep::bench::run_worker(s);
  if (*allreduce && !join_master.empty()) {
    const auto master = lockstep::transport::split_host_port(join_master);
    if (!master) {
      std::fprintf(stderr, "lockstep-bench: --master must be HOST:PORT or [IPV6]:PORT\n");
      return 2;
    }
    s.master_host = master->first;
    s.master_port = master->second;
    return lockstep::bench::run_joined(s);
  }
  for (auto* sub : collectives) {
    if (*sub) {
      s.collective = *lockstep::bench::collective_from_name(sub->get_name());
      // A barrier has no buffers: one measurement, whatever the (unused) size.
      if (s.collective == lockstep::bench::Collective::kBarrier) s.sizes.resize(1);
      s.turn_seed = (std::uint64_t{std::random_device{}()} << 32) | std::random_device{}();
      // Every worker's buffers in transparent huge pages, lockstep's, the plain ring's, Gloo's
      // and torch's alike: in small pages a VM's memory monitor stalls whichever process it
      // catches walking hundreds of MiB (BENCHMARKS.md, "Huge pages"). The workers inherit it.
      if (std::getenv("GLIBC_TUNABLES") != nullptr) {
        s.pages = "environment";
      } else if (small_pages) {
        s.pages = "small";
      } else {
        ::setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1", 0);
        s.pages = "huge";
      }
      return lockstep::bench::run_collective(s);
    }
  }
  if (*sync) {
    s.trials = sync_trials;
    return lockstep::bench::run_sync(s);
  }
  s.kill_master = victim == "master";
  if (s.standby && !s.kill_master) {
    std::fprintf(stderr, "lockstep-bench recovery: --standby needs --kill master\n");
    return 2;
  }
  if (s.kill_master && s.stop_instead_of_kill) {
    std::fprintf(stderr, "lockstep-bench recovery: --stop applies to a peer, not to --kill master\n");
    return 2;
  }
  return lockstep::bench::run_recovery(s);
}
