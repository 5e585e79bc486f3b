// lockstep-bench --compare torch: torch.distributed with the gloo backend, in processes
// of Debian's /usr/bin/python3 (python3-torch) running tools/bench/torch_worker.py,
// which the build embeds. They form their group on a file store, then time one size
// each time the orchestrator asks, between lockstep's sizes, so that both sample the
// same stretch of a shared machine and only one side holds its buffers at a time.
#include "bench_common.h"

#include "subprocess.h"
#include "torch_worker.h"

#include <cstdio>

namespace lockstep::bench {

std::unique_ptr<TorchPeers> TorchPeers::start(const Settings& s, const std::string& store_dir) {
  std::unique_ptr<TorchPeers> peers(new TorchPeers());
  for (int i = 0; i < s.peers; ++i) {
    // GLOO_SOCKET_IFNAME: loopback, as lockstep's and Gloo's own connections.
    auto p = tools::Subprocess::spawn({"/usr/bin/env", "GLOO_SOCKET_IFNAME=lo", "/usr/bin/python3", "-c",
                                       kTorchWorker, "--rank", std::to_string(i), "--world",
                                       std::to_string(s.peers), "--store", store_dir + "/torch", "--collective",
                                       collective_name(s.collective), "--dtype", dtype_name(s.dtype), "--op",
                                       std::to_string(static_cast<int>(s.op)), "--sizes", join_sizes(s.sizes), "--iterations",
                                       std::to_string(s.iterations), "--warmup", std::to_string(s.warmup)});
    if (!p) return nullptr;
    peers->procs_.push_back(std::move(*p));
  }
  for (auto& p : peers->procs_) {
    auto ready = read_json(p, std::chrono::seconds(300));
    if (!ready || !ready->value("ready", false)) {
      std::fprintf(stderr,
                   "lockstep-bench: --compare torch: torch.distributed did not start (it needs /usr/bin/python3 "
                   "with torch: Debian's python3-torch)\n");
      return nullptr;
    }
  }
  return peers;
}

TorchPeers::~TorchPeers() = default;

std::vector<double> TorchPeers::measure(std::uint64_t bytes, std::string* why) {
  for (auto& p : procs_) p.write_line("go");
  std::vector<nlohmann::json> replies;
  for (auto& p : procs_) {
    auto j = read_json(p, std::chrono::seconds(1800));
    if (!j) {
      *why = "not measured (a torch process failed at size " + std::to_string(bytes) + ")";
      return {};
    }
    if (j->contains("error")) {
      *why = "not measured: " + (*j)["error"].get<std::string>();
      return {};
    }
    replies.push_back(*j);
  }
  return slowest(replies, "torch_us");
}

bool TorchPeers::finish() {
  bool ok = true;
  for (auto& p : procs_) {
    if (p.wait(std::chrono::seconds(60)).value_or(1) != 0) ok = false;
  }
  return ok;
}

}  // namespace lockstep::bench
