// lockstep-bench --compare torch and torch-lockstep: torch.distributed with the gloo
// backend or lockstep's (lockstep.torch), in processes of Debian's /usr/bin/python3
// (python3-torch) running tools/bench/torch_worker.py, which the build embeds. They
// form their group on a file store, then time one size each time the orchestrator asks,
// between lockstep's sizes, so that both sample the same stretch of a shared machine and
// only one side holds its buffers at a time.
#include "bench_common.h"

#include "subprocess.h"
#include "torch_worker.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>

namespace lockstep::bench {

namespace {

// The lockstep Python package of the build tree this program belongs to (BUILD/python,
// next to BUILD/bin), if there is one; an installed lockstep-bench finds the installed one.
std::string build_tree_python() {
  const auto dir = std::filesystem::path(self_path("lockstep-bench")).parent_path().parent_path() / "python";
  std::error_code ec;
  return std::filesystem::exists(dir / "lockstep" / "__init__.py", ec) ? dir.string() : std::string();
}

// `/usr/bin/env VAR=... ` for a Python worker: with gloo, loopback for Gloo's connections
// (as lockstep's and Gloo's own); with lockstep, the build tree's package if there is one,
// and lockstep's logs (of a master rank 0 hosts, too) at lockstep-bench's own level.
std::vector<std::string> python_env(bool gloo, bool lockstep) {
  std::vector<std::string> env = {"/usr/bin/env"};
  if (gloo) env.push_back("GLOO_SOCKET_IFNAME=lo");
  if (!lockstep) return env;
  env.push_back("LOCKSTEP_LOG_LEVEL=warn");
  if (const auto python = build_tree_python(); !python.empty()) {
    std::string var = "PYTHONPATH=" + python;
    if (const char* path = std::getenv("PYTHONPATH"); path != nullptr && *path != 0) var.append(":").append(path);
    env.push_back(var);
  }
  return env;
}

}  // namespace

std::unique_ptr<TorchPeers> TorchPeers::start(const Settings& s, const std::string& store_dir,
                                              const std::string& backend) {
  std::unique_ptr<TorchPeers> peers(new TorchPeers());
  const auto env = python_env(backend == "gloo", backend == "lockstep");
  for (int i = 0; i < s.peers; ++i) {
    auto argv = env;
    argv.insert(argv.end(), {"/usr/bin/python3", "-c", kTorchWorker, "--backend", backend, "--rank", std::to_string(i),
                             "--world", std::to_string(s.peers), "--store", store_dir + "/torch-" + backend,
                             "--collective", collective_name(s.collective), "--dtype", dtype_name(s.dtype), "--op",
                             std::to_string(static_cast<int>(s.op)), "--sizes", join_sizes(s.sizes), "--iterations",
                             std::to_string(s.iterations), "--warmup", std::to_string(s.warmup)});
    auto p = tools::Subprocess::spawn(argv);
    if (!p) return nullptr;
    peers->procs_.push_back(std::move(*p));
  }
  for (auto& p : peers->procs_) {
    auto ready = read_json(p, std::chrono::seconds(300));
    if (!ready || !ready->value("ready", false)) {
      std::fprintf(stderr,
                   "lockstep-bench: --compare %s: torch.distributed did not start (it needs /usr/bin/python3 "
                   "with torch: Debian's python3-torch%s)\n",
                   backend == "gloo" ? "torch" : "torch-lockstep",
                   backend == "gloo" ? "" : ", and lockstep.torch: python3-lockstep-torch or a build with libtorch-dev");
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

int run_ddp(const DdpSettings& d) {
  char tmpl[] = "/tmp/lockstep-bench-ddp-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return 1;
  struct Cleanup {
    std::string dir;
    ~Cleanup() { std::filesystem::remove_all(dir); }
  } cleanup{tmpl};
  std::vector<tools::Subprocess> procs;
  for (int i = 0; i < d.peers; ++i) {
    auto argv = python_env(true, true);
    argv.insert(argv.end(), {"/usr/bin/python3", "-c", kDdpWorker, "--rank", std::to_string(i), "--world",
                             std::to_string(d.peers), "--store", cleanup.dir + "/store", "--steps",
                             std::to_string(d.steps), "--warmup", std::to_string(d.warmup), "--vocab",
                             std::to_string(d.vocab), "--width", std::to_string(d.width), "--layers",
                             std::to_string(d.layers), "--heads", std::to_string(d.heads), "--seq", std::to_string(d.seq),
                             "--batch", std::to_string(d.batch), "--threads", std::to_string(d.threads)});
    auto p = tools::Subprocess::spawn(argv);
    if (!p) return 1;
    procs.push_back(std::move(*p));
  }
  int rc = 0;
  auto result = read_json(procs[0], std::chrono::seconds(3600));
  if (result) {
    std::printf("%s\n", result->dump().c_str());
    std::fflush(stdout);
  } else {
    std::fprintf(stderr,
                 "lockstep-bench ddp: the workers gave no result (they need /usr/bin/python3 with Debian's "
                 "python3-torch and lockstep.torch: python3-lockstep-torch or a build with libtorch-dev)\n");
    rc = 1;
  }
  for (auto& p : procs) {
    if (p.wait(std::chrono::seconds(60)).value_or(1) != 0) rc = 1;
  }
  return rc;
}

}  // namespace lockstep::bench
