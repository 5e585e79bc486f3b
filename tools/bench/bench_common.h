// Shared pieces of lockstep-bench: settings, size parsing, the orchestrator and the
// worker. See main.cpp for the command line.
#pragma once

#include "common/status.h"
#include "subprocess.h"

#include <lockstep/lockstep.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lockstep::master {
class MasterServer;
}
namespace lockstep::peer {
class Communicator;
struct Options;
}
namespace lockstep::tools {
class Subprocess;
}

namespace lockstep::bench {

// The collectives the loopback benchmark times, one subcommand each.
enum class Collective { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kBarrier };
const char* collective_name(Collective c);  // the subcommand: "allreduce", "broadcast", ...
std::optional<Collective> collective_from_name(const std::string& name);

struct Settings {
  // worker: a collective's name, "recovery", "sync-holder" or "sync-newcomer"
  std::string mode;
  Collective collective = Collective::kAllReduce;
  int peers = 2;
  std::vector<std::uint64_t> sizes;
  lockstep_dtype_t dtype = LOCKSTEP_F32;
  lockstep_reduce_op_t op = LOCKSTEP_SUM;
  lockstep_quantization_t quant = LOCKSTEP_QUANT_NONE;
  int concurrency = 1;
  int pool = 1;
  int streams = 0;          // p2p_streams: 0 adapts
  std::string congestion;   // tcp_congestion: empty for the system's
  std::string algorithm = "auto";  // the all-reduce's (LOCKSTEP_ALLREDUCE_ALGORITHM of every peer)
  int iterations = 9;
  int warmup = 2;
  // allreduce: lockstep, the raw ring and Gloo take turns round by round, in an order
  // that changes from round to round (true), or each
  // runs all its rounds back to back (false).
  bool in_turns = true;
  std::uint64_t turn_seed = 0;  // the turns' shuffle, drawn once per run for all workers
  int trials = 20;
  bool stop_instead_of_kill = false;  // recovery: SIGSTOP (a silent peer) instead of SIGKILL
  // recovery: the victim is the master (a lockstep-master process, started again on its
  // address at once, as a supervisor would), the peers with failover on.
  bool kill_master = false;
  // recovery --kill master --standby: two masters of a hot standby on a private etcd; the
  // serving one is killed, the standby takes over (the killed one is started again as the
  // next standby). lease_ttl_s: theirs.
  bool standby = false;
  std::uint32_t lease_ttl_s = 5;
  std::uint16_t fallback_port = 0;  // worker: the second master's port
  std::uint32_t failover_timeout_ms = 0;  // worker: Options::failover_timeout_ms
  std::uint32_t heartbeat_timeout_ms = 5000;
  bool compare_gloo = false;
  std::string gloo_store;
  // --compare torch: torch.distributed (gloo backend) in its own processes, size by size
  // between lockstep's; the workers then wait for a line on stdin before each size.
  bool compare_torch = false;
  // --compare torch-lockstep: the same through torch.distributed's lockstep backend
  // (lockstep.torch), to show what the backend adds to the C API's time.
  bool compare_torch_lockstep = false;
  bool paced = false;
  std::uint16_t master_port = 0;
  std::string master_host = "127.0.0.1";
  std::string advertised_host;
  bool optimize = false;  // joined mode: optimize the topology between two measurements
  // allreduce: a run secret generated for this run (written to secret_file for the
  // workers) and encrypt_data on every peer.
  bool encrypt = false;
  bool check_finite = false;
  bool no_inbound = false;  // the peers accept no inbound connection (their ring edges run reversed)
  // The workers' pages: "huge" (GLIBC_TUNABLES set for them), "small", or "environment"
  // (GLIBC_TUNABLES was set already).
  std::string pages = "small";
  std::string secret_file;
  int index = 0;
  std::string self;
};

std::vector<std::string> dtype_names();
lockstep_dtype_t dtype_from_name(const std::string& name);
const char* dtype_name(lockstep_dtype_t dtype);
lockstep_reduce_op_t op_from_name(const std::string& name);
// Quantizations by name: none, minmax, zeropoint, minmax4, zeropoint4, f16, bf16.
std::vector<std::string> quant_names();
lockstep_quantization_t quant_from_name(const std::string& name);
const char* quant_name(lockstep_quantization_t quant);
std::optional<std::vector<std::uint64_t>> parse_sizes(const std::string& text);
std::string self_path(const char* argv0);
std::string join_sizes(const std::vector<std::uint64_t>& sizes);  // "1024,16777216"

int run_collective(const Settings& s);  // allreduce, broadcast, allgather, reducescatter, barrier
int run_recovery(Settings s);
// A lockstep-master process from beside this program (`self`), listening on
// 127.0.0.1:*port (0: an ephemeral port) with these flags; *port is then the port it
// listens on. nullopt (and why on stderr) if it did not start.
// stderr_path: where its log goes (appended; empty: this process's stderr).
std::optional<tools::Subprocess> spawn_master_process(const std::string& self, std::uint16_t* port,
                                                     const std::vector<std::string>& extra,
                                                     const std::string& stderr_path = "");
int run_sync(const Settings& s);  // sync_bench.cpp
int run_joined(const Settings& s);  // joined_bench.cpp: one peer of a run on several hosts
int run_worker(const Settings& s);

// lockstep-bench ddp (torch_compare.cpp): a training step of a character-level
// transformer without communication, under torch DDP over gloo and under
// lockstep.torch.DataParallel, in turns (tools/bench/ddp_worker.py).
struct DdpSettings {
  int peers = 2;
  int steps = 30;
  int warmup = 5;
  // The model and batch of examples/python/torch_text.py's long configuration.
  int vocab = 96;
  int width = 64;
  int layers = 2;
  int heads = 4;
  int seq = 48;
  int batch = 16;
  int threads = 1;  // torch's threads per process
};
int run_ddp(const DdpSettings& d);

// lockstep-bench control (control_bench.cpp): the master's vote rounds with N simulated peers.
struct ControlSettings {
  std::vector<int> peers = {16, 64, 256};
  int rounds = 20;
  int tags = 8;  // collectives in flight at once
  std::string self;
};
int run_control(const ControlSettings& c);
int worker_sync(const Settings& s);  // sync_bench.cpp

// Shared by the benchmarks.
double percentile(std::vector<double> v, double p);
// An in-process master on an ephemeral loopback port, or null.
// secret_file (if not empty): the run secret's file.
std::unique_ptr<master::MasterServer> start_master(std::uint32_t heartbeat_timeout_ms, const std::string& secret_file = "");
// The next JSON line of a worker, or nullopt on timeout or garbage.
std::optional<nlohmann::json> read_json(tools::Subprocess& p, std::chrono::seconds timeout);
// Joins the run and waits until the group has `world` members.
bool join(peer::Communicator& comm, int world);
// The communicator options of a peer of the bench (its master, pool, streams, congestion
// control, secret, encryption, check_finite, inbound); the secret file's error if any.
Result<peer::Options> communicator_options(const Settings& s);
// Per iteration, the time of the slowest worker: replies[w][key] is worker w's list.
std::vector<double> slowest(const std::vector<nlohmann::json>& replies, const char* key);

// What one peer holds and moves in one collective for a --size of `bytes` (the bytes
// one peer contributes): broadcast, the root's buffer; all-gather, one peer's input;
// reduce-scatter, one peer's input (world x count_per_rank elements).
struct Shape {
  std::uint64_t count = 0;        // the descriptor's count (all-gather, reduce-scatter: per rank)
  std::uint64_t src_elements = 0;  // 0: in place (all-reduce, broadcast) or none (barrier)
  std::uint64_t dst_elements = 0;
  std::uint64_t contributed = 0;   // bytes: the throughput's numerator
};
Shape shape_of(Collective c, std::uint64_t bytes, std::size_t element_size, int world);
// The comparisons (Gloo, torch) time one collective at a time in the dtypes both take;
// Gloo and torch have no average.
bool comparable(const Settings& s);

// --compare torch and torch-lockstep (torch_compare.cpp): the torch.distributed
// processes of one run, with the gloo or the lockstep backend.
class TorchPeers {
 public:
  // Starts s.peers processes of /usr/bin/python3 on a file store in store_dir and waits
  // until they have formed their group; null (with a message on stderr) if they could not.
  // backend: "gloo" or "lockstep".
  static std::unique_ptr<TorchPeers> start(const Settings& s, const std::string& store_dir, const std::string& backend);
  ~TorchPeers();
  // Runs the next size of s.sizes on every process: the slowest process's microseconds
  // per iteration, or why there are none (*why).
  std::vector<double> measure(std::uint64_t bytes, std::string* why);
  // Waits for the processes to exit; false if one failed.
  bool finish();

 private:
  TorchPeers() = default;
  std::vector<tools::Subprocess> procs_;
};

}  // namespace lockstep::bench
