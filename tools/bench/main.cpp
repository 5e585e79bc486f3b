// lockstep-bench: measures lockstep against the transport bound and Gloo, with the
// definitions of PRODUCT.md. It starts a master and N worker processes on loopback
// (workers are this program run as `lockstep-bench worker ...`) and prints one JSON
// object per line per measurement.
//
//   lockstep-bench allreduce --peers 4 --size 1KiB,16MiB,256MiB [--dtype f32] [--op sum] [--encrypt]
//                  [--concurrency K] [--pool P] [--iterations N] [--warmup W] [--quant minmax]
//                  [--compare gloo] [--order turns|blocks]
//   lockstep-bench allreduce --master HOST:PORT --peers N [--optimize] ...   (one peer of a run
//       on several hosts: each host runs it against the same master; see scripts/bench-wan-topology.py)
//   lockstep-bench recovery --peers 4 --size 16MiB --trials 20 [--stop]
//   lockstep-bench sync --holders 1 --size 256MiB,1GiB [--trials 3]
//       (join-and-sync time of a newcomer receiving the shared state from the holders)
//   lockstep-bench hash [--size 1GiB] [--threads 1,2,N] [--iterations 5]
//       (the shared-state content hash in this process, against a single-thread
//        memcpy; N = hardware threads; no master or workers)
#include "bench_common.h"
#include "hash_bench.h"

#include <CLI/CLI.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  CLI::App app{"lockstep-bench: all-reduce throughput and latency, recovery time, shared-state sync, content hash"};
  app.require_subcommand(1);
  lockstep::bench::Settings s;
  std::string sizes = "16MiB";
  std::string dtype = "f32";
  std::string op = "sum";
  std::string compare;
  std::string quant = "none";

  auto* allreduce = app.add_subcommand("allreduce", "effective all-reduce throughput, latency percentiles");
  allreduce->add_option("--peers", s.peers, "number of peer processes")->check(CLI::Range(1, 64));
  allreduce->add_option("--size", sizes, "bytes per peer, comma-separated (suffixes KiB, MiB, GiB)");
  allreduce->add_option("--dtype", dtype, "element type")->check(CLI::IsMember(lockstep::bench::dtype_names()));
  allreduce->add_option("--op", op, "reduce op")->check(CLI::IsMember({"sum", "avg", "prod", "max", "min"}));
  allreduce->add_option("--concurrency", s.concurrency, "all-reduces in flight at once")->check(CLI::Range(1, 256));
  allreduce->add_option("--pool", s.pool, "p2p connections per neighbour")->check(CLI::Range(1, 256));
  allreduce->add_option("--streams", s.streams, "connections one all-reduce stripes over per hop (0: adaptive)")
      ->check(CLI::Range(0, 16));
  allreduce->add_option("--cc", s.congestion, "TCP congestion control of the p2p connections (default: the system's)");
  allreduce->add_option("--iterations", s.iterations, "timed repetitions per size")->check(CLI::Range(5, 100000));
  allreduce->add_option("--warmup", s.warmup, "untimed repetitions first")->check(CLI::Range(0, 1000));
  std::string order = "turns";
  allreduce
      ->add_option("--order", order,
                   "turns: lockstep, the plain ring and Gloo take turns round by round; blocks: each runs its "
                   "rounds back to back (sequential operations)")
      ->check(CLI::IsMember({"turns", "blocks"}));
  allreduce->add_option("--quant", quant, "8-bit quantization on the wire")
      ->check(CLI::IsMember({"none", "minmax", "zeropoint"}));
  allreduce->add_flag("--encrypt", s.encrypt,
                      "encrypt the data plane (encrypt_data) under a run secret generated for this run");
  allreduce->add_option("--compare", compare, "also measure this library (gloo)")->check(CLI::IsMember({"gloo"}));
  std::string join_master;
  allreduce->add_option("--master", join_master,
                        "HOST:PORT of a running master: be ONE peer of a run started on several hosts (each host "
                        "runs this command; --peers is the group size to wait for) and print this peer's figures");
  allreduce->add_option("--advertised-host", s.advertised_host, "with --master: the address other peers use");
  allreduce->add_flag("--optimize", s.optimize,
                      "with --master: measure in join order, optimize the topology, measure again");

  auto* recovery = app.add_subcommand("recovery", "time from a peer's SIGKILL to the survivors' next all-reduce");
  recovery->add_option("--peers", s.peers, "number of peer processes")->check(CLI::Range(3, 64));
  recovery->add_option("--size", sizes, "bytes per all-reduce");
  recovery->add_option("--trials", s.trials, "kills (at least 20 for a figure)")->check(CLI::Range(1, 1000));
  recovery->add_option("--heartbeat-timeout-ms", s.heartbeat_timeout_ms, "the master's heartbeat timeout");
  recovery->add_flag("--stop", s.stop_instead_of_kill, "SIGSTOP the victim (a silent peer) instead of SIGKILL");

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

  auto* worker = app.add_subcommand("worker", "(internal) one peer of a benchmark");
  worker->group("");
  worker->add_option("--mode", s.mode)->required();
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
  CLI11_PARSE(app, argc, argv);

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
  s.compare_gloo = compare == "gloo";
  s.self = lockstep::bench::self_path(argv[0]);
  if (*worker) return lockstep::bench::run_worker(s);
  if (*allreduce && !join_master.empty()) {
    const auto colon = join_master.rfind(':');
    if (colon == std::string::npos) {
      std::fprintf(stderr, "lockstep-bench: --master must be HOST:PORT\n");
      return 2;
    }
    s.master_host = join_master.substr(0, colon);
    s.master_port = static_cast<std::uint16_t>(std::stoi(join_master.substr(colon + 1)));
    return lockstep::bench::run_joined(s);
  }
  if (*allreduce) return lockstep::bench::run_allreduce(s);
  if (*sync) {
    s.trials = sync_trials;
    return lockstep::bench::run_sync(s);
  }
  return lockstep::bench::run_recovery(s);
}
