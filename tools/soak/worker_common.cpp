// What the soak's two workers share (worker_common.h).
#include "worker_common.h"

#include "state/hash.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <pthread.h>
#include <thread>

namespace lockstep::soak {

using nlohmann::json;

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void fill(std::vector<float>& out, std::uint64_t key) {
  std::uint64_t x = mix(key);
  for (auto& v : out) {
    x += 0x9e3779b97f4a7c15ull;
    const auto bits = static_cast<std::uint32_t>(mix(x) >> 40);  // 24 bits
    v = static_cast<float>(bits) * (1.0f / 16777216.0f) - 0.5f;
  }
}

std::uint64_t contribution_key(std::uint64_t seed, std::uint64_t revision, std::uint32_t k, std::uint64_t who) {
  return mix(seed) ^ mix(revision * 0x100000001b3ull + k) ^ (who << 48);
}

std::uint64_t who_of(const std::string& name) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (const char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return mix(h);
}

TrainState::TrainState(const WorkerOptions& o)
    : weights(o.state_elements), momentum(o.state_elements, 0.0f), steps(1, 0) {
  fill(weights, o.seed ^ 0x5eedull);
}

void advance(TrainState& state, const std::vector<std::vector<float>>& results) {
  const std::size_t K = results.size();
  const std::size_t m = results[0].size();
  const std::vector<float>& a = results[0];
  const std::vector<float>& b = results[K > 1 ? 1 : 0];
  const std::vector<float>& c = results[K > 2 ? 2 : 0];
  for (std::size_t i = 0; i < state.weights.size(); ++i) {
    const float g = a[i % m] - b[(i * 3) % m];
    state.momentum[i] = 0.9f * state.momentum[i] + 0.1f * g;
    state.weights[i] = state.weights[i] - 0.01f * state.momentum[i] + 0.001f * c[(i * 7) % m];
  }
  state.steps[0] += 1;
}

std::string local_digest(const void* data, std::size_t bytes) {
  return lockstep::state::hash_bytes(data, bytes, 1).to_hex();
}

std::string state_hash(const TrainState& state, Digest digest) {
  const std::string all = digest(state.weights.data(), state.weights.size() * sizeof(float)) +
                          digest(state.momentum.data(), state.momentum.size() * sizeof(float)) +
                          digest(state.steps.data(), state.steps.size() * sizeof(std::uint64_t));
  return digest(all.data(), all.size());
}

json Lines::line(const char* ev) const {
  json j;
  j["name"] = name_;
  j["ev"] = ev;
  j["t_ms"] = now_ms();
  return j;
}

void Lines::emit(const json& j) {
  const std::string text = j.dump() + "\n";
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
}

void add_worker_sizing(CLI::App* app, WorkerOptions& w) {
  app->add_option("--state-elements", w.state_elements, "f32 elements of each shared-state tensor (weights, momentum)")
      ->capture_default_str();
  app->add_option("--reduce-elements", w.reduce_elements, "f32 elements of each all-reduce")->capture_default_str();
  app->add_option("--reduces", w.reduces, "concurrent all-reduces per step")->capture_default_str();
  app->add_option("--compute-ms", w.compute_ms, "time each step spends computing (a sleep)")->capture_default_str();
  app->add_option("--p2p-stall-timeout-ms", w.p2p_stall_timeout_ms,
                  "an all-reduce attempt fails when no byte moves to or from its ring neighbours this long (0: 30000)")
      ->capture_default_str();
}

void add_worker_cli(CLI::App* app, WorkerOptions& w) {
  app->add_option("--master", w.master, "HOST:PORT of the master")->required();
  app->add_option("--name", w.name, "name printed in every line")->required();
  app->add_option("--seed", w.seed, "seed of every deterministic value")->capture_default_str();
  app->add_flag("--bootstrap", w.bootstrap, "present the initial state at the first sync (the run's first workers)");
  app->add_flag("--keep-going", w.keep_going,
                "after an unexpected status of connect or update_topology (reported), call it again");
  app->add_option("--connect-timeout-ms", w.connect_timeout_ms, "timeout to reach the master")->capture_default_str();
  app->add_option("--advertised-host", w.advertised_host,
                  "address other peers reach this one at (default: as the master sees it)");
  app->add_option("--bind-host", w.bind_host, "IP address the p2p sockets bind to (default: every address of both families)");
  app->add_flag("--no-inbound", w.no_inbound, "accept no inbound connection (listen on no port), as behind a NAT");
  app->add_option("--failover-timeout-ms", w.failover_timeout_ms,
                  "wait this long for a master to take this peer back when its master is lost (0: off)");
  add_worker_sizing(app, w);
}

bool valid_sizes(const WorkerOptions& o) {
  if (o.reduces == 0 || o.reduce_elements == 0 || o.state_elements == 0) {
    std::fprintf(stderr, "--reduces, --reduce-elements and --state-elements must be positive\n");
    return false;
  }
  return true;
}

namespace {
std::atomic<bool> g_stop{false};
}  // namespace

void stop_on_signals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::thread([signals] {
    int received = 0;
    sigwait(&signals, &received);
    g_stop = true;
  }).detach();
}

bool stop_requested() { return g_stop; }

}  // namespace lockstep::soak
