// lockstep-bench sync: join-and-sync time of a newcomer that receives the shared state
// from K up-to-date peers. The holders run the documented loop (admit pending peers,
// then sync every step, enforce-popular); for each trial a newcomer process connects,
// is admitted, syncs receive-only and reports how long each part took and whether it
// ends with the holders' digest. Loopback, one run per (size, holders) pair.
#include "bench_common.h"

#include "common/log.h"
#include "master/master_server.h"
#include "peer/communicator.h"
#include "state/hash.h"
#include "subprocess.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

namespace lockstep::bench {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// Deterministic content: the same bytes in every holder.
void fill(std::vector<std::uint8_t>& bytes, std::uint64_t seed) {
  std::uint64_t x = seed;
  for (std::size_t i = 0; i + 8 <= bytes.size(); i += 8) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    std::memcpy(bytes.data() + i, &x, 8);
  }
}

std::vector<std::string> argv_for(const Settings& s, const std::string& mode, int index, std::uint16_t port,
                                  std::uint64_t bytes) {
  return {s.self, "worker", "--mode", mode, "--master-port", std::to_string(port), "--index", std::to_string(index),
          "--peers", std::to_string(s.peers), "--size", std::to_string(bytes)};
}

}  // namespace

int worker_sync(const Settings& s) {
  peer::Options options;
  options.master_port = s.master_port;
  options.base_port = 0;
  auto created = peer::Communicator::create(options);
  if (!created.is_ok()) return 1;
  auto& comm = *created.value();
  std::vector<std::uint8_t> data(s.sizes.front());
  const std::vector<peer::SharedTensor> tensors = {{"weights", data.data(), data.size(), LOCKSTEP_U8, false}};
  if (s.mode == "sync-newcomer") {
    const auto start = Clock::now();
    if (!comm.connect().is_ok()) return 1;
    const double join_ms = ms_since(start);
    const auto sync_start = Clock::now();
    std::uint64_t revision = 0;
    auto r = comm.sync_shared_state(tensors, &revision, proto::SyncStrategy::kReceiveOnly);
    if (!r.is_ok()) {
      std::fprintf(stderr, "newcomer: %s\n", r.status().to_string().c_str());
      return 1;
    }
    const double sync_ms = ms_since(sync_start);
    json out = {{"join_ms", join_ms},
                {"sync_ms", sync_ms},
                {"bytes_received", r.value().bytes_received},
                {"revision", revision},
                {"digest", state::hash_bytes(data.data(), data.size()).to_hex()}};
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
    return 0;
  }
  // A holder: the same content everywhere, then the loop until the orchestrator stops it.
  fill(data, 42);
  if (!join(comm, s.peers)) return 1;
  std::printf("{\"digest\":\"%s\"}\n", state::hash_bytes(data.data(), data.size()).to_hex().c_str());
  std::fflush(stdout);
  std::uint64_t revision = 0;
  for (;;) {
    auto pending = comm.are_peers_pending();
    if (!pending.is_ok()) return 1;
    if (pending.value()) {
      Status u = comm.update_topology();
      if (!u.is_ok() && u.code() != LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) return 1;
    }
    ++revision;
    auto r = comm.sync_shared_state(tensors, &revision, proto::SyncStrategy::kEnforcePopular);
    if (!r.is_ok()) {
      if (r.status().code() != LOCKSTEP_STATUS_PEER_CONNECTION_LOST) return 1;
      --revision;  // the same step again
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

int run_sync(const Settings& s) {
  log::set_level(log::Level::kWarn);
  for (const std::uint64_t bytes : s.sizes) {
    auto master = start_master(60'000);
    if (!master) return 1;
    std::vector<tools::Subprocess> holders;
    for (int i = 0; i < s.peers; ++i) {
      auto p = tools::Subprocess::spawn(argv_for(s, "sync-holder", i, master->port(), bytes));
      if (!p) return 1;
      holders.push_back(std::move(*p));
    }
    std::string digest;
    for (auto& h : holders) {
      auto j = read_json(h, std::chrono::seconds(300));
      if (!j || !j->contains("digest")) {
        std::fprintf(stderr, "lockstep-bench: a holder did not start\n");
        return 1;
      }
      digest = (*j)["digest"].get<std::string>();
    }
    std::vector<double> join_ms;
    std::vector<double> sync_ms;
    bool identical = true;
    for (int trial = 0; trial < s.trials; ++trial) {
      auto n = tools::Subprocess::spawn(argv_for(s, "sync-newcomer", s.peers, master->port(), bytes));
      if (!n) return 1;
      auto j = read_json(*n, std::chrono::seconds(600));
      if (!j || !j->contains("sync_ms") || n->wait(std::chrono::seconds(60)).value_or(1) != 0) {
        std::fprintf(stderr, "lockstep-bench: the newcomer failed\n");
        return 1;
      }
      join_ms.push_back((*j)["join_ms"].get<double>());
      sync_ms.push_back((*j)["sync_ms"].get<double>());
      identical = identical && (*j)["digest"] == digest && (*j)["bytes_received"] == bytes;
    }
    const double p50 = percentile(sync_ms, 0.5);
    json out = {{"bench", "sync"},
                {"holders", s.peers},
                {"bytes", bytes},
                {"trials", s.trials},
                {"join_ms_p50", percentile(join_ms, 0.5)},
                {"sync_ms_p50", p50},
                {"sync_ms_max", percentile(sync_ms, 1.0)},
                {"gbytes_s", static_cast<double>(bytes) / (p50 * 1e6)},
                {"identical", identical}};
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
    for (auto& h : holders) h.kill();
    if (!identical) return 1;
  }
  return 0;
}

}  // namespace lockstep::bench
