// lockstep-bench allreduce --master HOST:PORT: one peer of a run whose peers are started
// on several hosts (the WAN test bed, or real machines), each against the same master.
// It joins, waits for the group to reach --peers, and measures the all-reduce as the
// loopback benchmark does (agree as the start barrier, --concurrency async all-reduces
// per iteration, median over --iterations after --warmup); with --optimize it measures
// in join order, optimizes the topology, and measures again. Each peer prints its own
// figures; a run's figure is the slowest peer's (scripts/bench-wan-topology.py).
#include "bench_common.h"

#include "common/log.h"
#include "kernels/reduce.h"
#include "peer/communicator.h"

#include <chrono>
#include <cstdio>

namespace lockstep::bench {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

std::vector<std::string> ring_ids(peer::Communicator& comm) {
  std::vector<std::string> out;
  if (auto view = comm.membership(); view.is_ok()) {
    for (const auto& m : view.value()) out.push_back(m.id.to_string());
  }
  return out;
}

// The p2p port of every peer as the view names it (0: it accepts no inbound connection).
std::vector<std::uint16_t> ring_ports(peer::Communicator& comm) {
  std::vector<std::uint16_t> out;
  if (auto view = comm.membership(); view.is_ok()) {
    for (const auto& m : view.value()) out.push_back(m.p2p_port);
  }
  return out;
}

// Median microseconds per iteration for each size; false on an error.
bool measure(peer::Communicator& comm, const Settings& s, const char* order) {
  const std::size_t esize = coll::dtype_size(s.dtype);
  for (const std::uint64_t bytes : s.sizes) {
    const std::uint64_t count = std::max<std::uint64_t>(1, bytes / esize);
    std::vector<std::vector<std::uint8_t>> buffers(static_cast<std::size_t>(s.concurrency),
                                                   std::vector<std::uint8_t>(count * esize, 0));
    std::vector<double> us;
    std::uint64_t wire = 0;
    for (int round = 0; round < s.warmup + s.iterations; ++round) {
      if (!comm.agree(true).is_ok()) return false;
      const auto start = Clock::now();
      std::vector<std::shared_ptr<peer::AsyncReduce>> handles;
      for (int k = 0; k < s.concurrency; ++k) {
        auto& b = buffers[static_cast<std::size_t>(k)];
        auto h = comm.all_reduce_async(
            peer::ReduceDescriptor{b.data(), b.data(), count, s.dtype, s.op, s.quant, static_cast<std::uint64_t>(k)});
        if (!h.is_ok()) return false;
        handles.push_back(h.value());
      }
      std::uint64_t sent = 0;
      for (auto& h : handles) {
        auto r = comm.await(h);
        if (!r.is_ok()) return false;
        sent += r.value().bytes_sent;
      }
      if (round >= s.warmup) {
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
        wire = sent;
      }
    }
    const double p50 = percentile(us, 0.5);
    json out = {{"bench", "allreduce"},
                {"mode", "joined"},
                {"order", order},
                {"peers", s.peers},
                {"rank", comm.rank().is_ok() ? comm.rank().value() : 0},
                {"bytes", bytes},
                {"concurrency", s.concurrency},
                {"pool", s.pool},
                {"p50_us", p50},
                {"gbytes_s", static_cast<double>(bytes) * s.concurrency / (p50 * 1e3)},
                {"wire_bytes", wire},
                {"ring", ring_ids(comm)},
                {"ports", ring_ports(comm)}};
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
  }
  return true;
}

}  // namespace

int run_joined(const Settings& s) {
  log::set_level(log::Level::kWarn);
  auto options = communicator_options(s);
  if (!options.is_ok()) {
    std::fprintf(stderr, "lockstep-bench: %s\n", options.status().to_string().c_str());
    return 1;
  }
  auto created = peer::Communicator::create(options.value());
  if (!created.is_ok() || !join(*created.value(), s.peers)) {
    std::fprintf(stderr, "lockstep-bench: could not join %s:%u: %s\n", s.master_host.c_str(), s.master_port,
                 created.is_ok() ? created.value()->last_error().c_str() : created.status().to_string().c_str());
    return 1;
  }
  auto& comm = *created.value();
  if (!measure(comm, s, "join")) {
    std::fprintf(stderr, "lockstep-bench: %s\n", comm.last_error().c_str());
    return 1;
  }
  if (s.optimize) {
    const auto start = Clock::now();
    Status st;
    do {
      st = comm.optimize_topology();
    } while (st.code() == LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED);
    if (!st.is_ok()) {
      std::fprintf(stderr, "lockstep-bench: optimize: %s\n", st.to_string().c_str());
      return 1;
    }
    json out = {{"bench", "optimize"},
                {"ms", std::chrono::duration<double, std::milli>(Clock::now() - start).count()},
                {"ring", ring_ids(comm)}};
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
    if (!measure(comm, s, "optimized")) {
      std::fprintf(stderr, "lockstep-bench: %s\n", comm.last_error().c_str());
      return 1;
    }
  }
  // Leave together: nobody tears down its connections while another still measures.
  return comm.agree(true).is_ok() ? 0 : 1;
}

}  // namespace lockstep::bench
