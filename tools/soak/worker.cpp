// The soak's worker: a training-like peer that uses only the public C API.
//
// The loop (docs/architecture.md, "The application loop"), with the sync first so that
// a newcomer, whose connect returns where the accepted peers' update_topology returns,
// starts every step at the same point as the others:
//
//   connect
//   loop:
//     if the group has >= 2 peers:
//       sync the shared state (a newcomer: receive-only at revision 0; the others:
//         enforce-popular at the revision they advanced to); retry on
//         PEER_CONNECTION_LOST / HASH_MISMATCH; now every peer holds revision R
//       "compute" (a sleep), then K concurrent async all-reduces of values derived
//         from (seed, R, k, rank), tags R*(K+3)+k; those that fail with
//         PEER_CONNECTION_LOST are retried with the survivors
//       a reduce-scatter, an all-gather of its result and a broadcast (bound to the
//         view: after a loss they fail until the next update topology, and the step
//         goes on without them; the state does not depend on them), unless
//         --all-reduces-only (a run with PCCL workers, which have none of them)
//       weights, momentum, steps += f(results); revision R+1 (synced next step)
//     are-peers-pending -> update topology (retried while UPDATE_TOPOLOGY_FAILED); also
//       after a collective found this peer alone (TOO_FEW_PEERS: the step goes on alone,
//       each all-reduce's result its own contribution, as a world of one gives)
//
// Every line on stdout is one JSON object with "ev": sync (after every successful
// sync: revision, hash of the whole state, world, t_ms), allreduce (after every
// attempt: tag, attempt, status, world, checksum of the result or whether the buffer
// was restored), topology, sync_retry, exit (the communicator is finished: why),
// unexpected (a status a correct program never sees), stop (SIGTERM: a clean end).
// Exit status: 0 after SIGTERM, 3 after "exit", 4 after "unexpected", 2 bad usage.
// With --keep-going an unexpected status of connect or update_topology is reported and
// the call made again (with a new communicator for connect), so that a long run goes on
// looking for more after a first finding.
// The values, the state and its advance, the lines and the command line are shared with
// the PCCL worker (worker_common.h, pccl_worker.cpp), which runs the same loop.
#include "checker.h"
#include "soak.h"
#include "worker_common.h"

#include <lockstep/lockstep.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace lockstep::soak {
namespace {

using nlohmann::json;

std::string hash_of(const void* data, std::size_t bytes) {
  char hex[33] = {};
  lockstep_hash(data, bytes, hex);
  return hex;
}

bool finished(lockstep_status_t s) { return finished_status(s); }

class Worker {
 public:
  explicit Worker(const WorkerOptions& o)
      : o_(o), lines_(o.name), state_(o), buffers_(o.reduces, std::vector<float>(o.reduce_elements)),
        expected_(o.reduce_elements) {}
  ~Worker() { lockstep_comm_destroy(comm_); }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  int run() {
    const auto colon = o_.master.rfind(':');
    if (colon == std::string::npos) {
      std::fprintf(stderr, "--master must be HOST:PORT\n");
      return 2;
    }
    host_ = o_.master.substr(0, colon);
    json started = line("start");
    started["pid"] = static_cast<std::int64_t>(::getpid());
    started["bootstrap"] = o_.bootstrap;
    started["api"] = "lockstep";
    emit(started);
    lockstep_comm_config_t config;
    lockstep_comm_config_init(&config);
    config.master_host = host_.c_str();
    config.master_port = static_cast<std::uint16_t>(std::stoi(o_.master.substr(colon + 1)));
    config.base_port = 0;
    config.connect_timeout_ms = o_.connect_timeout_ms;
    if (!o_.advertised_host.empty()) config.advertised_host = o_.advertised_host.c_str();
    if (!o_.bind_host.empty()) config.bind_host = o_.bind_host.c_str();
    config.p2p_stall_timeout_ms = o_.p2p_stall_timeout_ms;
    config.no_inbound = o_.no_inbound ? 1 : 0;
    config.failover_timeout_ms = o_.failover_timeout_ms;
    lockstep_status_t s = lockstep_comm_create(&config, &comm_);
    if (s != LOCKSTEP_OK) return end("create", s);
    for (int tries = 1;; ++tries) {
      s = lockstep_comm_connect(comm_);
      if (s == LOCKSTEP_OK) break;
      if (finished(s) || !o_.keep_going || tries >= 10) return end("connect", s);
      // --keep-going: report the status, then join again with a new communicator.
      report_unexpected("connect", s);
      lockstep_comm_destroy(comm_);
      comm_ = nullptr;
      s = lockstep_comm_create(&config, &comm_);
      if (s != LOCKSTEP_OK) return end("create", s);
    }
    json j = line("connected");
    j["world"] = world();
    emit(j);

    revision_ = o_.bootstrap ? 1 : 0;
    while (!stop_requested()) {
      if (world() >= 2) {
        if (int rc = sync(); rc >= 0) return rc;
        if (stop_requested()) break;
        if (o_.compute_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o_.compute_ms));
        if (int rc = reduce_and_advance(); rc >= 0) return rc;
        if (stop_requested()) break;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // alone: wait for peers
      }
      if (int rc = membership(); rc >= 0) return rc;
    }
    emit(line("stop"));
    return 0;
  }

 private:
  json line(const char* ev) const { return lines_.line(ev); }
  static void emit(const json& j) { Lines::emit(j); }
  void with_status(json& j, lockstep_status_t s) const {
    j["code"] = static_cast<int>(s);
    j["status"] = lockstep_status_string(s);
    if (s != LOCKSTEP_OK && comm_ != nullptr) j["error"] = lockstep_comm_last_error(comm_);
  }
  std::int64_t world() const {
    std::int64_t w = 0;
    lockstep_comm_get_attribute(comm_, LOCKSTEP_ATTR_PEER_GROUP_WORLD_SIZE, &w);
    return w;
  }
  void report_unexpected(const char* op, lockstep_status_t s) {
    json j = line("unexpected");
    j["op"] = op;
    with_status(j, s);
    j["revision"] = revision_;
    j["going_on"] = true;
    emit(j);
  }
  // Ends the worker: 3 if the communicator is finished (an evicted peer, the master
  // gone), 4 for a status a correct program never sees.
  int end(const char* op, lockstep_status_t s) {
    json j = line(finished(s) ? "exit" : "unexpected");
    j["op"] = op;
    with_status(j, s);
    j["revision"] = revision_;
    emit(j);
    return finished(s) ? 3 : 4;
  }

  std::string state_hash() const { return soak::state_hash(state_, hash_of); }

  // Returns -1 to go on, or the process's exit status.
  int sync() {
    const lockstep_tensor_t tensors[] = {
        {"weights", state_.weights.data(), state_.weights.size(), LOCKSTEP_F32, LOCKSTEP_DEVICE_CPU, 0},
        {"momentum", state_.momentum.data(), state_.momentum.size(), LOCKSTEP_F32, LOCKSTEP_DEVICE_CPU, 0},
        {"steps", state_.steps.data(), state_.steps.size(), LOCKSTEP_U64, LOCKSTEP_DEVICE_CPU, 0},
    };
    const bool receive = !synced_ && !o_.bootstrap;
    for (std::uint64_t attempt = 1;; ++attempt) {
      lockstep_shared_state_t state = {revision_, tensors, 3};
      lockstep_sync_info_t info{};
      const auto start = std::chrono::steady_clock::now();
      const lockstep_status_t s = lockstep_comm_sync_shared_state(
          comm_, &state, receive ? LOCKSTEP_SYNC_RECEIVE_ONLY : LOCKSTEP_SYNC_ENFORCE_POPULAR, &info);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (s == LOCKSTEP_OK) {
        revision_ = state.revision;
        synced_ = true;
        json j = line("sync");
        j["revision"] = revision_;
        j["hash"] = state_hash();
        j["world"] = world();
        j["strategy"] = receive ? "receive" : "popular";
        j["attempt"] = attempt;
        j["bytes_received"] = info.bytes_received;
        j["bytes_sent"] = info.bytes_sent;
        j["steps"] = state_.steps[0];
        j["ms"] = ms;
        emit(j);
        return -1;
      }
      if (finished(s)) return end("sync", s);
      if (s != LOCKSTEP_STATUS_PEER_CONNECTION_LOST && s != LOCKSTEP_STATUS_HASH_MISMATCH &&
          s != LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE) {
        return end("sync", s);
      }
      json j = line("sync_retry");
      j["revision"] = revision_;
      j["attempt"] = attempt;
      with_status(j, s);
      emit(j);
      if (stop_requested()) return -1;
      // Nobody holds the next revision: wait rather than spin (the checker reports it).
      if (s == LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

  std::uint64_t contribution_key(std::uint32_t k) const { return soak::contribution_key(o_.seed, revision_, k, rank_); }

  int reduce_and_advance() {
    lockstep_comm_get_rank(comm_, &rank_);
    const std::uint32_t K = o_.reduces;
    for (std::uint32_t k = 0; k < K; ++k) fill(buffers_[k], contribution_key(k));
    std::vector<std::uint64_t> attempts(K, 0);
    std::vector<bool> done(K, false);
    lockstep_status_t fatal = LOCKSTEP_OK;
    bool alone = false;
    const char* fatal_op = "allreduce";
    for (;;) {
      std::vector<std::uint32_t> todo;
      for (std::uint32_t k = 0; k < K; ++k) {
        if (!done[k]) todo.push_back(k);
      }
      if (todo.empty()) break;
      // Launch every outstanding one, await them in launch order, then retry the
      // failed ones: by then the master has taken the lost peer out of the ring.
      std::vector<std::pair<std::uint32_t, lockstep_async_t*>> running;
      std::vector<lockstep_reduce_desc_t> descs(K);
      for (const auto k : todo) {
        descs[k] = lockstep_reduce_desc_t{buffers_[k].data(), buffers_[k].data(), o_.reduce_elements, LOCKSTEP_F32,
                                          LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, revision_ * (K + 3) + k, nullptr,
                                          LOCKSTEP_DIST_NONE};
        lockstep_async_t* handle = nullptr;
        ++attempts[k];
        const lockstep_status_t s = lockstep_comm_all_reduce_async(comm_, &descs[k], &handle);
        if (s != LOCKSTEP_OK) {
          if (fatal == LOCKSTEP_OK) fatal = s;
          fatal_op = "allreduce_async";
          break;
        }
        running.emplace_back(k, handle);
      }
      // When each one ends here (polled), so that the checker can compare the moments
      // at which the peers learn one attempt's outcome.
      std::vector<std::int64_t> ended(running.size(), 0);
      const std::int64_t launched = now_ms();
      for (std::size_t left = running.size(); left > 0;) {
        for (std::size_t i = 0; i < running.size(); ++i) {
          int is_done = 0;
          if (ended[i] == 0 && lockstep_async_poll(running[i].second, &is_done) == LOCKSTEP_OK && is_done) {
            ended[i] = now_ms();
            --left;
          }
        }
        if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      for (std::size_t i = 0; i < running.size(); ++i) {
        const auto [k, handle] = running[i];
        lockstep_reduce_info_t info = {0, 0, 0, 0};
        const lockstep_status_t s = lockstep_async_wait(handle, &info);
        json j = line("allreduce");
        j["end_ms"] = ended[i];
        j["ms"] = ended[i] - launched;
        j["step"] = revision_;
        j["tag"] = revision_ * (K + 3) + k;
        j["attempt"] = attempts[k];
        with_status(j, s);
        if (s == LOCKSTEP_OK) {
          done[k] = true;
          j["world"] = info.world_size;
          j["checksum"] = hash_of(buffers_[k].data(), buffers_[k].size() * sizeof(float));
        } else {
          // Why it failed (the checker counts stale frames and failures nothing explains).
          j["error"] = std::string(lockstep_comm_last_error(comm_)).substr(0, 300);
          // A failed all-reduce leaves the buffer exactly as it was before the call.
          fill(expected_, contribution_key(k));
          j["restored"] = std::memcmp(expected_.data(), buffers_[k].data(), expected_.size() * sizeof(float)) == 0;
          if (s == LOCKSTEP_STATUS_TOO_FEW_PEERS) {
            // The others are gone: the step goes on alone. The buffer holds this peer's
            // own contribution, which is what an all-reduce over one peer gives.
            done[k] = true;
            alone = true;
          } else if (s != LOCKSTEP_STATUS_PEER_CONNECTION_LOST && fatal == LOCKSTEP_OK) {
            fatal = s;
          }
        }
        emit(j);
      }
      if (fatal != LOCKSTEP_OK) return end(fatal_op, fatal);
    }
    // Alone: the view is learned anew at the end of the step (the revision advances as
    // always: the next sync presents exactly one more).
    if (alone) refresh_view_ = true;
    if (!alone && !o_.all_reduces_only) {
      if (int rc = shape_collectives(); rc >= 0) return rc;
    }
    // Advance the state from the results, identically on every peer.
    advance(state_, buffers_);
    revision_ += 1;  // exactly one per sync
    return -1;
  }

  // The step's reduce-scatter (each rank's slice of a sum of world x m elements), an
  // all-gather of the slices (then every peer holds the whole sum: one checksum for all)
  // and a broadcast from rank revision % world, tags R*(K+3)+K+0..2. They are bound to
  // the view: after a loss they fail (PEER_CONNECTION_LOST, then VIEW_CHANGED) until the
  // next update topology; the step goes on without them.
  int shape_collectives() {
    std::size_t world = 0;
    (void)lockstep_comm_get_membership(comm_, nullptr, 0, &world);  // the count, whatever the capacity
    if (world < 2) return -1;
    const std::uint64_t m = o_.reduce_elements;
    const std::uint64_t base = revision_ * (o_.reduces + 3) + o_.reduces;
    const auto root = static_cast<std::uint32_t>(revision_ % world);
    shape_src_.resize(world * m);
    fill(shape_src_, contribution_key(1000));
    shape_part_.assign(m, -1.0f);
    shape_all_.assign(world * m, -1.0f);
    shape_bcast_.resize(m);
    fill(shape_bcast_, mix(o_.seed) ^ mix(revision_ * 0x9e3779b97f4a7c15ull + (rank_ == root ? 0 : rank_ + 1)));
    const std::vector<float> bcast_before = shape_bcast_;
    lockstep_reduce_info_t info = {0, 0, 0, 0};
    const lockstep_reduce_scatter_desc_t rs = {shape_src_.data(), shape_part_.data(), m, LOCKSTEP_F32, LOCKSTEP_SUM,
                                               LOCKSTEP_QUANT_NONE, base};
    lockstep_status_t s = lockstep_comm_reduce_scatter(comm_, &rs, &info);
    // The slices differ by rank: no checksum to compare.
    if (!report_shape(base, s, info, "", [&] { return std::all_of(shape_part_.begin(), shape_part_.end(), [](float v) { return v == -1.0f; }); })) {
      return shape_failure_expected(s) ? -1 : end("reduce_scatter", s);
    }
    const lockstep_all_gather_desc_t ag = {shape_part_.data(), m, shape_all_.data(), shape_all_.size(), LOCKSTEP_F32,
                                           nullptr, 0, base + 1};
    s = lockstep_comm_all_gather(comm_, &ag, &info);
    if (!report_shape(base + 1, s, info, hash_of(shape_all_.data(), shape_all_.size() * sizeof(float)),
                      [&] { return std::all_of(shape_all_.begin(), shape_all_.end(), [](float v) { return v == -1.0f; }); })) {
      return shape_failure_expected(s) ? -1 : end("all_gather", s);
    }
    const lockstep_broadcast_desc_t bc = {shape_bcast_.data(), m, LOCKSTEP_F32, root, base + 2};
    s = lockstep_comm_broadcast(comm_, &bc, &info);
    if (!report_shape(base + 2, s, info, hash_of(shape_bcast_.data(), shape_bcast_.size() * sizeof(float)),
                      [&] { return shape_bcast_ == bcast_before; })) {
      return shape_failure_expected(s) ? -1 : end("broadcast", s);
    }
    return -1;
  }

  // After a loss they fail (PEER_CONNECTION_LOST, then VIEW_CHANGED, or TOO_FEW_PEERS
  // once alone) until the next update topology: the step goes on without them.
  static bool shape_failure_expected(lockstep_status_t s) {
    return s == LOCKSTEP_STATUS_PEER_CONNECTION_LOST || s == LOCKSTEP_STATUS_VIEW_CHANGED ||
           s == LOCKSTEP_STATUS_TOO_FEW_PEERS;
  }

  // One shape-bound collective's line, like an all-reduce's (the checker holds them to
  // the same rules: one outcome, one world and checksum for all, destinations restored
  // on failure). True if it succeeded.
  template <typename Restored>
  bool report_shape(std::uint64_t tag, lockstep_status_t s, const lockstep_reduce_info_t& info,
                    const std::string& checksum, Restored restored) {
    json j = line("allreduce");
    j["end_ms"] = now_ms();
    j["step"] = revision_;
    j["tag"] = tag;
    j["attempt"] = 1;
    with_status(j, s);
    if (s == LOCKSTEP_OK) {
      j["world"] = info.world_size;
      j["checksum"] = checksum;
    } else {
      j["restored"] = restored();
    }
    emit(j);
    return s == LOCKSTEP_OK;
  }

  int membership() {
    int pending = 0;
    lockstep_status_t s = lockstep_comm_are_peers_pending(comm_, &pending);
    if (s != LOCKSTEP_OK) return end("are_peers_pending", s);
    if (!pending && !refresh_view_) return -1;
    refresh_view_ = false;
    std::uint64_t attempt = 1;
    for (int unexpected = 0;; ++attempt) {
      s = lockstep_comm_update_topology(comm_);
      if (s == LOCKSTEP_OK) break;
      if (s == LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) {
        json j = line("topology");
        j["attempt"] = attempt;
        with_status(j, s);
        emit(j);
        continue;
      }
      if (finished(s) || !o_.keep_going || ++unexpected >= 10) return end("update_topology", s);
      // --keep-going: report the status, then call it again.
      report_unexpected("update_topology", s);
    }
    json j = line("topology");
    j["attempt"] = attempt;
    with_status(j, s);
    j["world"] = world();
    emit(j);
    return -1;
  }

  WorkerOptions o_;
  Lines lines_;
  std::string host_;
  lockstep_comm_t* comm_ = nullptr;
  std::uint64_t revision_ = 0;
  bool synced_ = false;
  std::uint32_t rank_ = 0;
  TrainState state_;
  std::vector<std::vector<float>> buffers_;
  std::vector<float> expected_;
  std::vector<float> shape_src_, shape_part_, shape_all_, shape_bcast_;
  bool refresh_view_ = false;  // a collective found this peer alone: update the view
};

}  // namespace

int run_worker(const WorkerOptions& options) {
  stop_on_signals();
  if (!valid_sizes(options)) return 2;
  Worker worker(options);
  return worker.run();
}

}  // namespace lockstep::soak
