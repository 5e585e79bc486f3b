// What the soak's two workers share: the native one (worker.cpp, lockstep's C API) and
// the PCCL one (pccl_worker.cpp, pccl.h alone). Nothing here includes a lockstep header,
// so that the PCCL worker is built without one: the deterministic values, the state and
// its advance, the content digest computed locally, the JSON lines, the command line and
// the signal handling. Both workers run the same loop over these and print the same
// lines, which the checker (checker.h) reads without knowing which API printed them.
#pragma once

#include "soak.h"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace CLI {
class App;
}

namespace lockstep::soak {

// splitmix64's finalizer.
std::uint64_t mix(std::uint64_t z);

// Deterministic f32 values in [-0.5, 0.5) from a key (splitmix64 stream).
void fill(std::vector<float>& out, std::uint64_t key);

// The key of a peer's contribution to all-reduce k of the step at `revision`. `who`
// makes the peers' contributions differ (the native worker's rank; the PCCL worker, which
// has no rank, a number drawn from its name); only its low 16 bits count. The results do
// not depend on it: every peer of an all-reduce gets the sum of all contributions.
std::uint64_t contribution_key(std::uint64_t seed, std::uint64_t revision, std::uint32_t k, std::uint64_t who);

// A number for `who` from a worker's name (for a worker without a rank).
std::uint64_t who_of(const std::string& name);

// The shared state: weights and momentum (f32), and the step counter (u64).
struct TrainState {
  explicit TrainState(const WorkerOptions& o);
  std::vector<float> weights;
  std::vector<float> momentum;
  std::vector<std::uint64_t> steps;
};

// Advances the state from the step's all-reduce results, identically on every peer.
void advance(TrainState& state, const std::vector<std::vector<float>>& results);

// The content digest of lockstep's shared state (src/state/hash.h), as 32 lowercase hex
// digits: what lockstep_hash prints, for a worker that has no lockstep call for it.
std::string local_digest(const void* data, std::size_t bytes);

// The state's hash in the sync lines: the digest of the three tensors' digests.
using Digest = std::string (*)(const void* data, std::size_t bytes);
std::string state_hash(const TrainState& state, Digest digest);

// The JSON lines on stdout (docs/soak.md lists them): one object each, with the
// worker's name, the event and the time.
class Lines {
 public:
  explicit Lines(std::string name) : name_(std::move(name)) {}
  nlohmann::json line(const char* ev) const;
  static void emit(const nlohmann::json& j);

 private:
  std::string name_;
};

// The worker's command line (`lockstep-soak worker` and lockstep-soak-pccl-worker take
// the same), and the sizing options `run` passes on to every worker.
void add_worker_cli(CLI::App* app, WorkerOptions& w);
void add_worker_sizing(CLI::App* app, WorkerOptions& w);
// Bad sizes: a message on stderr and false.
bool valid_sizes(const WorkerOptions& o);

// SIGTERM and SIGINT end the loop at the next step boundary: blocked in every thread
// (the library's threads, started later, inherit the mask) and taken by one thread with
// sigwait, which sets the flag stop_requested() reads.
void stop_on_signals();
bool stop_requested();

}  // namespace lockstep::soak
