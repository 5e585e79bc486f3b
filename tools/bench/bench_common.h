// Shared pieces of lockstep-bench: settings, size parsing, the orchestrator and the
// worker. See main.cpp for the command line.
#pragma once

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
}
namespace lockstep::tools {
class Subprocess;
}

namespace lockstep::bench {

struct Settings {
  std::string mode;  // worker: "allreduce", "recovery", "sync-holder" or "sync-newcomer"
  int peers = 2;
  std::vector<std::uint64_t> sizes;
  lockstep_dtype_t dtype = LOCKSTEP_F32;
  lockstep_reduce_op_t op = LOCKSTEP_SUM;
  lockstep_quantization_t quant = LOCKSTEP_QUANT_NONE;
  int concurrency = 1;
  int pool = 1;
  int streams = 0;          // p2p_streams: 0 adapts
  std::string congestion;   // tcp_congestion: empty for the system's
  int iterations = 9;
  int warmup = 2;
  // allreduce: lockstep, the raw ring and Gloo take turns round by round (true), or each
  // runs all its rounds back to back (false).
  bool in_turns = true;
  int trials = 20;
  bool stop_instead_of_kill = false;  // recovery: SIGSTOP (a silent peer) instead of SIGKILL
  std::uint32_t heartbeat_timeout_ms = 5000;
  bool compare_gloo = false;
  std::string gloo_store;
  std::uint16_t master_port = 0;
  std::string master_host = "127.0.0.1";
  std::string advertised_host;
  bool optimize = false;  // joined mode: optimize the topology between two measurements
  // allreduce: a run secret generated for this run (written to secret_file for the
  // workers) and encrypt_data on every peer.
  bool encrypt = false;
  std::string secret_file;
  int index = 0;
  std::string self;
};

std::vector<std::string> dtype_names();
lockstep_dtype_t dtype_from_name(const std::string& name);
const char* dtype_name(lockstep_dtype_t dtype);
lockstep_reduce_op_t op_from_name(const std::string& name);
lockstep_quantization_t quant_from_name(const std::string& name);
std::optional<std::vector<std::uint64_t>> parse_sizes(const std::string& text);
std::string self_path(const char* argv0);

int run_allreduce(const Settings& s);
int run_recovery(const Settings& s);
int run_sync(const Settings& s);  // sync_bench.cpp
int run_joined(const Settings& s);  // joined_bench.cpp: one peer of a run on several hosts
int run_worker(const Settings& s);
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

}  // namespace lockstep::bench
