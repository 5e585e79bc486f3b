// lockstep-soak-pccl-worker: the soak's worker written against PCCL v1.0's C API. It is
// compiled against pccl.h alone (its include path holds that one header, no lockstep
// header) and linked with liblockstep-pccl (libpccl.so.1), as a PCCL program is. It runs
// the native worker's loop (worker.cpp) restricted to what PCCL has, with the same
// values, state and lines (worker_common.h), so that the checker checks it unchanged and
// the two kinds run in one group (`lockstep-soak run --pccl-workers N`; the native
// workers then leave out the collectives PCCL lacks):
//
//   connect
//   loop:
//     if the group has >= 2 peers:
//       sync the shared state: PCCL's sync is always enforce-popular, so a newcomer
//         presents revision 0, below the group's, and receives (its line says
//         "receive"); the others present the revision they advanced to; retried on
//         pcclRankConnectionLost
//       "compute", then K concurrent pcclAllReduceAsync of the native worker's values
//         and tags, awaited in launch order (PCCL has no poll: an attempt's end_ms is
//         when its await returned); those that fail with pcclRankConnectionLost are
//         retried with the survivors
//       weights, momentum, steps += f(results); revision R+1
//     are-peers-pending -> update topology (retried while pcclUpdateTopologyFailed);
//       also after a collective found this peer alone (pcclTooFewPeers, at the launch
//       or the await: the step goes on alone, each result its own contribution)
//
// Where the native worker uses what PCCL lacks, this one computes it: the contribution's
// `who` is drawn from its name (no rank), and the digests of the state and of the
// results are lockstep's content hash (local_digest, linked from the soak's common
// code), so that they compare with the native workers'. Options PCCL has no
// parameter for (p2p base port 0, connect and stall timeouts, advertised and bind host)
// go through the LOCKSTEP_* variables the library reads at pcclCreateCommunicator.
// Results are reported in lockstep's numbers (pccl_codes.h). Exit status as the native
// worker's: 0 after SIGTERM, 3 after "exit", 4 after "unexpected", 2 bad usage.
#if __has_include(<lockstep/lockstep.h>)
#error "lockstep-soak-pccl-worker is built against pccl.h alone: no lockstep header may be on its include path"
#endif

#include "pccl_codes.h"
#include "soak.h"
#include "worker_common.h"

#include <pccl.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

namespace lockstep::soak {
namespace {

using nlohmann::json;
using pccl_codes::lockstep_code;
using pccl_codes::pccl_name;

bool finished(pcclResult_t r) { return r == pcclMasterConnectionFailed; }

class PcclWorker {
 public:
  explicit PcclWorker(const WorkerOptions& o)
      : o_(o),
        lines_(o.name),
        who_(who_of(o.name)),
        state_(o),
        buffers_(o.reduces, std::vector<float>(o.reduce_elements)),
        expected_(o.reduce_elements) {}
  ~PcclWorker() {
    if (comm_ != nullptr) pcclDestroyCommunicator(comm_);
  }
  PcclWorker(const PcclWorker&) = delete;
  PcclWorker& operator=(const PcclWorker&) = delete;

  int run() {
    if (!parse_master()) return 2;
    json started = line("start");
    started["pid"] = static_cast<std::int64_t>(::getpid());
    started["bootstrap"] = o_.bootstrap;
    started["api"] = "pccl";
    emit(started);
    // What lockstep_comm_config_t says for the native worker, the library reads here.
    ::setenv("LOCKSTEP_BASE_PORT", "0", 1);
    ::setenv("LOCKSTEP_CONNECT_TIMEOUT_MS", std::to_string(o_.connect_timeout_ms).c_str(), 1);
    if (o_.p2p_stall_timeout_ms != 0) {
      ::setenv("LOCKSTEP_P2P_STALL_TIMEOUT_MS", std::to_string(o_.p2p_stall_timeout_ms).c_str(), 1);
    }
    if (!o_.advertised_host.empty()) ::setenv("LOCKSTEP_ADVERTISED_HOST", o_.advertised_host.c_str(), 1);
    if (!o_.bind_host.empty()) ::setenv("LOCKSTEP_BIND_HOST", o_.bind_host.c_str(), 1);
    pcclResult_t r = pcclInit();
    if (r != pcclSuccess) return end("init", r);
    r = pcclCreateCommunicator(&params_, &comm_);
    if (r != pcclSuccess) return end("create", r);
    for (int tries = 1;; ++tries) {
      r = pcclConnect(comm_);
      if (r == pcclSuccess) break;
      if (finished(r) || !o_.keep_going || tries >= 10) return end("connect", r);
      // --keep-going: report the result, then join again with a new communicator.
      report_unexpected("connect", r);
      pcclDestroyCommunicator(comm_);
      comm_ = nullptr;
      r = pcclCreateCommunicator(&params_, &comm_);
      if (r != pcclSuccess) return end("create", r);
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
  // "A.B.C.D:PORT" into PCCL's socket address (IPv4 only, as the library takes).
  bool parse_master() {
    const auto colon = o_.master.rfind(':');
    in_addr addr{};
    int port = 0;
    if (colon != std::string::npos) {
      try {
        port = std::stoi(o_.master.substr(colon + 1));
      } catch (const std::exception&) {
        port = 0;
      }
    }
    if (colon == std::string::npos || ::inet_pton(AF_INET, o_.master.substr(0, colon).c_str(), &addr) != 1 ||
        port <= 0 || port > 65535) {
      std::fprintf(stderr, "--master must be A.B.C.D:PORT (PCCL's master address is IPv4)\n");
      return false;
    }
    std::memset(&params_, 0, sizeof params_);
    params_.master_address.inet.protocol = inetIPv4;
    std::memcpy(params_.master_address.inet.ipv4.data, &addr.s_addr, 4);  // network order: a.b.c.d
    params_.master_address.port = static_cast<std::uint16_t>(port);
    params_.peer_group = 0;
    params_.p2p_connection_pool_size = 0;  // 1, as the native worker's
    return true;
  }

  json line(const char* ev) const { return lines_.line(ev); }
  static void emit(const json& j) { Lines::emit(j); }
  static void with_status(json& j, pcclResult_t r) {
    j["code"] = lockstep_code(r);
    j["status"] = pccl_name(r);
    j["pccl"] = static_cast<int>(r);
  }
  int world() const {
    int w = 0;
    pcclGetAttribute(comm_, PCCL_ATTRIBUTE_PEER_GROUP_WORLD_SIZE, &w);
    return w;
  }
  void report_unexpected(const char* op, pcclResult_t r) {
    json j = line("unexpected");
    j["op"] = op;
    with_status(j, r);
    j["revision"] = revision_;
    j["going_on"] = true;
    emit(j);
  }
  // Ends the worker: 3 if the communicator is finished, 4 for a result a correct
  // program never sees.
  int end(const char* op, pcclResult_t r) {
    json j = line(finished(r) ? "exit" : "unexpected");
    j["op"] = op;
    with_status(j, r);
    j["revision"] = revision_;
    emit(j);
    return finished(r) ? 3 : 4;
  }

  // Returns -1 to go on, or the process's exit status.
  int sync() {
    pcclTensorInfo_t infos[] = {
        {"weights", state_.weights.data(), state_.weights.size(), pcclFloat, pcclDeviceCpu, false},
        {"momentum", state_.momentum.data(), state_.momentum.size(), pcclFloat, pcclDeviceCpu, false},
        {"steps", state_.steps.data(), state_.steps.size(), pcclUint64, pcclDeviceCpu, false},
    };
    // A newcomer presents revision 0: not a candidate, it receives the group's state.
    const bool receive = !synced_ && !o_.bootstrap;
    for (std::uint64_t attempt = 1;; ++attempt) {
      pcclSharedState_t shared = {revision_, 3, infos};
      pcclSharedStateSyncInfo_t info = {0, 0};
      const auto start = std::chrono::steady_clock::now();
      const pcclResult_t r = pcclSynchronizeSharedState(comm_, &shared, &info);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (r == pcclSuccess) {
        revision_ = shared.revision;
        synced_ = true;
        json j = line("sync");
        j["revision"] = revision_;
        j["hash"] = state_hash(state_, local_digest);
        j["world"] = world();
        j["strategy"] = receive ? "receive" : "popular";
        j["attempt"] = attempt;
        j["bytes_received"] = info.rx_bytes;
        j["bytes_sent"] = info.tx_bytes;
        j["steps"] = state_.steps[0];
        j["ms"] = ms;
        emit(j);
        return -1;
      }
      if (finished(r)) return end("sync", r);
      if (r != pcclRankConnectionLost && r != pcclNoSharedStateAvailable) return end("sync", r);
      json j = line("sync_retry");
      j["revision"] = revision_;
      j["attempt"] = attempt;
      with_status(j, r);
      emit(j);
      if (stop_requested()) return -1;
      // Nobody holds the next revision: wait rather than spin (the checker reports it).
      if (r == pcclNoSharedStateAvailable) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }

  std::uint64_t key(std::uint32_t k) const { return contribution_key(o_.seed, revision_, k, who_); }
  std::uint64_t tag(std::uint32_t k) const { return revision_ * (o_.reduces + 3) + k; }

  // One attempt's line, as the native worker prints it. True if it succeeded.
  bool report(std::uint32_t k, std::uint64_t attempt, pcclResult_t r, const pcclReduceInfo_t& info,
              std::int64_t launched, std::int64_t ended) {
    json j = line("allreduce");
    j["end_ms"] = ended;
    j["ms"] = ended - launched;
    j["step"] = revision_;
    j["tag"] = tag(k);
    j["attempt"] = attempt;
    with_status(j, r);
    if (r == pcclSuccess) {
      j["world"] = info.local_world_size;
      j["checksum"] = local_digest(buffers_[k].data(), buffers_[k].size() * sizeof(float));
    } else {
      // A failed all-reduce leaves the buffer exactly as it was before the call.
      fill(expected_, key(k));
      j["restored"] = std::memcmp(expected_.data(), buffers_[k].data(), expected_.size() * sizeof(float)) == 0;
    }
    emit(j);
    return r == pcclSuccess;
  }

  int reduce_and_advance() {
    const std::uint32_t K = o_.reduces;
    for (std::uint32_t k = 0; k < K; ++k) fill(buffers_[k], key(k));
    std::vector<std::uint64_t> attempts(K, 0);
    std::vector<bool> done(K, false);
    pcclResult_t fatal = pcclSuccess;
    bool alone = false;
    const char* fatal_op = "allreduce";
    for (;;) {
      std::vector<std::uint32_t> todo;
      for (std::uint32_t k = 0; k < K; ++k) {
        if (!done[k]) todo.push_back(k);
      }
      if (todo.empty()) break;
      // Launch every outstanding one, await them in launch order, then retry the
      // failed ones with the survivors.
      std::vector<std::pair<std::uint32_t, pcclAsyncReduceOp_t>> running;
      for (const auto k : todo) {
        pcclReduceDescriptor_t desc;
        std::memset(&desc, 0, sizeof desc);
        desc.count = o_.reduce_elements;
        desc.op = pcclSum;
        desc.tag = tag(k);
        desc.src_descriptor.datatype = pcclFloat;
        desc.src_descriptor.distribution_hint = pcclDistributionNone;
        desc.quantization_options.quantized_datatype = pcclFloat;
        desc.quantization_options.algorithm = pcclQuantNone;
        pcclAsyncReduceOp_t handle = {nullptr, 0};
        ++attempts[k];
        const pcclResult_t r = pcclAllReduceAsync(buffers_[k].data(), buffers_[k].data(), &desc, comm_, &handle);
        if (r == pcclTooFewPeers) {
          // PCCL refuses the launch once this peer is alone (lockstep's await would say
          // TOO_FEW_PEERS): the step goes on alone, as the native worker's does.
          const std::int64_t now = now_ms();
          report(k, attempts[k], r, pcclReduceInfo_t{}, now, now);
          done[k] = true;
          alone = true;
          continue;
        }
        if (r != pcclSuccess) {
          if (fatal == pcclSuccess) fatal = r;
          fatal_op = "allreduce_async";
          break;
        }
        running.emplace_back(k, handle);
      }
      const std::int64_t launched = now_ms();
      for (const auto& [k, handle] : running) {
        pcclReduceInfo_t info = {0, 0, 0};
        const pcclResult_t r = pcclAwaitAsyncReduce(&handle, &info);
        const std::int64_t ended = now_ms();
        if (report(k, attempts[k], r, info, launched, ended)) {
          done[k] = true;
        } else if (r == pcclTooFewPeers) {
          // The others are gone: the buffer holds this peer's own contribution, which is
          // what an all-reduce over one peer gives.
          done[k] = true;
          alone = true;
        } else if (r != pcclRankConnectionLost && fatal == pcclSuccess) {
          fatal = r;
        }
      }
      if (fatal != pcclSuccess) return end(fatal_op, fatal);
    }
    // Alone: the view is learned anew at the end of the step.
    if (alone) refresh_view_ = true;
    advance(state_, buffers_);
    revision_ += 1;  // exactly one per sync
    return -1;
  }

  int membership() {
    bool pending = false;
    pcclResult_t r = pcclArePeersPending(comm_, &pending);
    if (r != pcclSuccess) return end("are_peers_pending", r);
    if (!pending && !refresh_view_) return -1;
    refresh_view_ = false;
    std::uint64_t attempt = 1;
    for (int unexpected = 0;; ++attempt) {
      r = pcclUpdateTopology(comm_);
      if (r == pcclSuccess) break;
      if (r == pcclUpdateTopologyFailed) {
        json j = line("topology");
        j["attempt"] = attempt;
        with_status(j, r);
        emit(j);
        continue;
      }
      if (finished(r) || !o_.keep_going || ++unexpected >= 10) return end("update_topology", r);
      // --keep-going: report the result, then call it again.
      report_unexpected("update_topology", r);
    }
    json j = line("topology");
    j["attempt"] = attempt;
    with_status(j, r);
    j["world"] = world();
    emit(j);
    return -1;
  }

  WorkerOptions o_;
  Lines lines_;
  std::uint64_t who_;
  pcclCommCreateParams_t params_{};
  pcclComm_t* comm_ = nullptr;
  std::uint64_t revision_ = 0;
  bool synced_ = false;
  TrainState state_;
  std::vector<std::vector<float>> buffers_;
  std::vector<float> expected_;
  bool refresh_view_ = false;  // a collective found this peer alone: update the view
};

}  // namespace
}  // namespace lockstep::soak

int main(int argc, char** argv) {
  CLI::App app{"lockstep-soak-pccl-worker: the soak's worker written against PCCL's API (started by "
               "`lockstep-soak run --pccl-workers N`; docs/soak.md)"};
  lockstep::soak::WorkerOptions options;
  lockstep::soak::add_worker_cli(&app, options);
  CLI11_PARSE(app, argc, argv);
  lockstep::soak::stop_on_signals();
  if (!lockstep::soak::valid_sizes(options)) return 2;
  lockstep::soak::PcclWorker worker(options);
  return worker.run();
}
