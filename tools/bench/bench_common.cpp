// lockstep-bench: the orchestrator (starts a master and worker processes, combines
// their timings) and the worker (one peer: lockstep's collective, a plain TCP ring
// moving the same bytes, and Gloo's counterpart, in the same process and run).
#include "bench_common.h"

#include "common/log.h"
#include "kernels/reduce.h"
#include "master/master_server.h"
#include "peer/communicator.h"
#include "security/crypto.h"
#include "etcd_process.h"
#include "subprocess.h"
#include "transport/socket.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/barrier_all_to_all.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

namespace lockstep::bench {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

const std::map<std::string, lockstep_dtype_t>& dtypes() {
  static const std::map<std::string, lockstep_dtype_t> table = {
      {"u8", LOCKSTEP_U8},   {"i8", LOCKSTEP_I8},   {"u16", LOCKSTEP_U16}, {"i16", LOCKSTEP_I16},
      {"u32", LOCKSTEP_U32}, {"i32", LOCKSTEP_I32}, {"u64", LOCKSTEP_U64}, {"i64", LOCKSTEP_I64},
      {"f16", LOCKSTEP_F16}, {"bf16", LOCKSTEP_BF16}, {"f32", LOCKSTEP_F32}, {"f64", LOCKSTEP_F64}};
  return table;
}

}  // namespace

Result<peer::Options> communicator_options(const Settings& s) {
  peer::Options options;
  options.master_host = s.master_host;
  options.master_port = s.master_port;
  options.advertised_host = s.advertised_host;
  options.base_port = 0;
  options.p2p_pool_size = static_cast<std::uint32_t>(s.pool);
  options.p2p_streams = static_cast<std::uint32_t>(s.streams);
  options.tcp_congestion = s.congestion;
  if (!s.secret_file.empty()) {
    auto key = security::load_secret_file(s.secret_file);
    if (!key.is_ok()) return key.status();
    options.secret = key.value();
  }
  options.encrypt_data = s.encrypt;
  options.check_finite = s.check_finite;
  options.accept_inbound = !s.no_inbound;
  return options;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto index = static_cast<std::size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(index, v.size() - 1)];
}

namespace {

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// ------------------------------------------------------------------ worker

}  // namespace

// Joins the run and waits until the group has `world` members.
bool join(peer::Communicator& comm, int world) {
  if (!comm.connect().is_ok()) return false;
  for (;;) {
    auto a = comm.attributes();
    if (!a.is_ok()) return false;
    if (static_cast<int>(a.value().group_world_size) >= world) return true;
    auto pending = comm.are_peers_pending();
    if (!pending.is_ok()) return false;
    if (!pending.value()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    Status s = comm.update_topology();
    if (!s.is_ok() && s.code() != LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) return false;
  }
}

namespace {

// Every third element 1, the others 0, in the element type: sums stay small exact
// integers in every dtype, and no float is subnormal (real gradients seldom are, and a
// CPU may take a slow path for them).
void fill_ones_and_zeros(std::uint8_t* data, std::uint64_t count, lockstep_dtype_t dtype) {
  const std::size_t esize = coll::dtype_size(dtype);
  std::uint8_t one[8] = {1};  // integers: 1, little-endian
  const auto put = [&](auto value) { std::memcpy(one, &value, sizeof value); };
  if (dtype == LOCKSTEP_F16) put(coll::f64_to_f16(1.0));
  if (dtype == LOCKSTEP_BF16) put(coll::f64_to_bf16(1.0));
  if (dtype == LOCKSTEP_F32) put(1.0f);
  if (dtype == LOCKSTEP_F64) put(1.0);
  static constexpr std::uint8_t kZero[8] = {};
  for (std::uint64_t i = 0; i < count; ++i) std::memcpy(data + i * esize, i % 3 == 0 ? one : kZero, esize);
}

// A plain TCP ring among the workers, in index order, for the transport bound.
class RawRing {
 public:
  bool setup(int index, int peers) {
    auto listener = transport::listen_tcp("127.0.0.1", 0);
    if (!listener.is_ok()) return false;
    std::printf("{\"port\":%u}\n", listener.value().port);
    std::fflush(stdout);
    std::string line;
    if (!std::getline(std::cin, line)) return false;  // the next worker's port
    const auto next_port = static_cast<std::uint16_t>(std::stoi(line));
    std::thread acceptor([&] { rx_ = transport::Fd(::accept(listener.value().fd.get(), nullptr, nullptr)); });
    auto tx = transport::connect_tcp("127.0.0.1", next_port, 10'000);
    acceptor.join();
    if (!tx.is_ok() || !rx_.valid()) return false;
    tx_ = std::move(tx.value());
    transport::set_nodelay(rx_.get());
    peers_ = peers;
    (void)index;
    return true;
  }

  // Every worker has arrived once a token went n-1 hops around the ring.
  bool barrier() {
    for (int i = 0; i + 1 < peers_; ++i) {
      std::uint8_t token = 1;
      if (!transport::send_all(tx_.get(), {&token, 1}, 60'000).is_ok()) return false;
      if (!transport::recv_exact(rx_.get(), {&token, 1}, 60'000).is_ok()) return false;
    }
    return true;
  }

  // Sends `send` bytes to the next worker while receiving `recv` from the previous one,
  // cycling through `buffer`, without reducing and without waiting for what is
  // forwarded: the bytes a collective moves, at the pace of the links alone.
  double exchange_us(const std::vector<std::uint8_t>& buffer, std::size_t send, std::size_t recv) {
    const std::size_t chunk = buffer.size() / static_cast<std::size_t>(peers_);
    const std::size_t piece = std::min<std::size_t>(256 * 1024, std::max<std::size_t>(1, chunk));
    const std::size_t most = std::max(send, recv);
    if (staging_.size() < std::max(piece, std::min<std::size_t>(recv, 64 * 1024))) {
      staging_.resize(std::max(piece, std::min<std::size_t>(recv, 64 * 1024)));
    }
    const auto start = Clock::now();
    if (most <= 64 * 1024) {
      // Small: the socket buffers hold it all, no second thread needed.
      for (std::size_t sent = 0; sent < send;) {
        const std::size_t n = std::min(buffer.size(), send - sent);
        if (!transport::send_all(tx_.get(), {buffer.data(), n}, 60'000).is_ok()) return 0;
        sent += n;
      }
      if (recv > 0 && !transport::recv_exact(rx_.get(), {staging_.data(), recv}, 60'000).is_ok()) return 0;
      return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    }
    std::thread sender([&] {
      for (std::size_t sent = 0; sent < send;) {
        const std::size_t n = std::min(piece, send - sent);
        const std::size_t offset = sent % std::max<std::size_t>(1, buffer.size() - n + 1);
        if (!transport::send_all(tx_.get(), {buffer.data() + offset, n}, 60'000).is_ok()) return;
        sent += n;
      }
    });
    for (std::size_t got = 0; got < recv;) {
      const std::size_t n = std::min(piece, recv - got);
      if (!transport::recv_exact(rx_.get(), {staging_.data(), n}, 60'000).is_ok()) break;
      got += n;
    }
    sender.join();
    return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  }

 private:
  transport::Fd tx_;
  transport::Fd rx_;
  int peers_ = 1;
  std::vector<std::uint8_t> staging_;
};

using GlooReduce = void (*)(void*, const void*, const void*, std::size_t);

template <typename T>
GlooReduce gloo_reduce(lockstep_reduce_op_t op) {
  switch (op) {
    case LOCKSTEP_PROD: return &gloo::product<T>;
    case LOCKSTEP_MAX: return &gloo::max<T>;
    case LOCKSTEP_MIN: return &gloo::min<T>;
    default: return &gloo::sum<T>;
  }
}

template <typename T>
const gloo::ReductionFunction<T>* gloo_reduction(lockstep_reduce_op_t op) {
  switch (op) {
    case LOCKSTEP_PROD: return gloo::ReductionFunction<T>::product;
    case LOCKSTEP_MAX: return gloo::ReductionFunction<T>::max;
    case LOCKSTEP_MIN: return gloo::ReductionFunction<T>::min;
    default: return gloo::ReductionFunction<T>::sum;
  }
}

// Gloo's counterpart of one collective over buffers of `shape`, what torch.distributed's
// gloo backend runs for CPU tensors where it has one: gloo::allreduce (its ring, the
// default algorithm), gloo::broadcast, gloo::allgather, gloo::barrier. Gloo has no
// reduce-scatter function: ReduceScatterHalvingDoubling stands in (torch 1.13's gloo
// backend has no reduce-scatter at all).
template <typename T>
std::function<void()> gloo_collective(const Settings& s, const std::shared_ptr<gloo::rendezvous::Context>& context,
                                      const Shape& shape) {
  auto src = std::make_shared<std::vector<T>>(shape.src_elements, T(1));
  auto dst = std::make_shared<std::vector<T>>(shape.dst_elements, T(1));
  switch (s.collective) {
    case Collective::kAllReduce:
      return [context, dst, op = s.op] {
        gloo::AllreduceOptions opts(context);
        opts.setOutput(dst->data(), dst->size());
        opts.setReduceFunction(gloo_reduce<T>(op));
        gloo::allreduce(opts);
      };
    case Collective::kBroadcast:
      return [context, dst] {
        gloo::BroadcastOptions opts(context);
        opts.setOutput(dst->data(), dst->size());
        opts.setRoot(0);
        gloo::broadcast(opts);
      };
    case Collective::kAllGather:
      return [context, src, dst] {
        gloo::AllgatherOptions opts(context);
        opts.setInput(src->data(), src->size());
        opts.setOutput(dst->data(), dst->size());
        gloo::allgather(opts);
      };
    case Collective::kReduceScatter: {
      // In place over src; rank r ends with its count_per_rank elements reduced.
      auto algorithm = std::make_shared<gloo::ReduceScatterHalvingDoubling<T>>(
          context, std::vector<T*>{src->data()}, static_cast<int>(src->size()),
          std::vector<int>(static_cast<std::size_t>(s.peers), static_cast<int>(shape.count)),
          gloo_reduction<T>(s.op));
      return [src, algorithm] { algorithm->run(); };
    }
    case Collective::kBarrier:
      return [context] {
        gloo::BarrierOptions opts(context);
        gloo::barrier(opts);
      };
  }
  return {};
}

// One timed Gloo collective per call, after an untimed barrier.
std::function<double()> gloo_round(const Settings& s, const std::shared_ptr<gloo::rendezvous::Context>& context,
                                   const Shape& shape) {
  std::function<void()> run;
  switch (s.dtype) {
    case LOCKSTEP_F32: run = gloo_collective<float>(s, context, shape); break;
    case LOCKSTEP_F64: run = gloo_collective<double>(s, context, shape); break;
    case LOCKSTEP_I32: run = gloo_collective<int32_t>(s, context, shape); break;
    case LOCKSTEP_I64: run = gloo_collective<int64_t>(s, context, shape); break;
    default: return {};
  }
  // The barrier of the same API family as the collective: an old-style algorithm
  // (BarrierAllToAll) before gloo's option-based calls made a 1 MiB gloo::broadcast
  // between two processes take 600 ms instead of 0.3-3 ms.
  const bool old_style = s.collective == Collective::kReduceScatter;
  return [context, run, old_style] {
    if (old_style) {
      gloo::BarrierAllToAll(context).run();
    } else {
      gloo::BarrierOptions opts(context);
      gloo::barrier(opts);
    }
    const auto start = Clock::now();
    run();
    return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  };
}

// The descriptor of collective k of a round over its buffers.
peer::ReduceDescriptor descriptor_of(const Settings& s, const Shape& shape, std::vector<std::uint8_t>& src,
                                     std::vector<std::uint8_t>& dst, int k) {
  peer::ReduceDescriptor d{src.empty() ? dst.data() : src.data(), dst.data(), shape.count, s.dtype, s.op, s.quant,
                           static_cast<std::uint64_t>(k)};
  switch (s.collective) {
    case Collective::kAllReduce: break;
    case Collective::kBroadcast:
      d.kind = proto::CollectiveKind::kBroadcast;
      d.src = nullptr;
      d.root = 0;
      break;
    case Collective::kAllGather:
      d.kind = proto::CollectiveKind::kAllGather;
      d.dst_capacity = shape.dst_elements;
      break;
    case Collective::kReduceScatter: d.kind = proto::CollectiveKind::kReduceScatter; break;
    case Collective::kBarrier:
      d = peer::ReduceDescriptor{};
      d.kind = proto::CollectiveKind::kBarrier;
      d.tag = static_cast<std::uint64_t>(k);
      break;
  }
  return d;
}

// The bytes this worker sends and receives on the plain TCP ring for one collective of
// `bytes_each` contributed bytes (all in flight together): an all-reduce moves 2(n-1)/n
// of its buffer each way, all-gather and reduce-scatter (n-1)/n of the whole, broadcast
// the whole buffer once per hop of the chain from worker 0 to worker n-1.
std::pair<std::size_t, std::size_t> raw_bytes(const Settings& s, std::size_t bytes_each) {
  const auto n = static_cast<std::size_t>(s.peers);
  switch (s.collective) {
    case Collective::kAllReduce: {
      const std::size_t total = 2 * (n - 1) * (bytes_each / n);
      return {total, total};
    }
    case Collective::kReduceScatter: return {(n - 1) * (bytes_each / n), (n - 1) * (bytes_each / n)};
    case Collective::kAllGather: return {(n - 1) * bytes_each, (n - 1) * bytes_each};
    case Collective::kBroadcast:
      return {s.index + 1 < s.peers ? bytes_each : 0, s.index > 0 ? bytes_each : 0};
    case Collective::kBarrier: return {0, 0};
  }
  return {0, 0};
}

int worker_collective(const Settings& s) {
  auto options = communicator_options(s);
  if (!options.is_ok()) {
    std::fprintf(stderr, "worker %d: %s\n", s.index, options.status().to_string().c_str());
    return 1;
  }
  auto created = peer::Communicator::create(options.value());
  if (!created.is_ok() || !join(*created.value(), s.peers)) {
    std::fprintf(stderr, "worker %d: could not join: %s\n", s.index,
                 created.is_ok() ? created.value()->last_error().c_str() : created.status().to_string().c_str());
    return 1;
  }
  auto& comm = *created.value();
  RawRing raw;
  if (s.peers > 1 && !raw.setup(s.index, s.peers)) return 1;
  std::shared_ptr<gloo::rendezvous::Context> gloo_context;
  if (!s.gloo_store.empty() && s.peers > 1) {
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto device = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore store(s.gloo_store);
    gloo_context = std::make_shared<gloo::rendezvous::Context>(s.index, s.peers);
    gloo_context->connectFullMesh(store, device);
  }
  const std::size_t esize = coll::dtype_size(s.dtype);
  const int rounds = s.warmup + s.iterations;
  for (const std::uint64_t bytes : s.sizes) {
    std::string go;
    if (s.paced && !std::getline(std::cin, go)) return 1;  // the orchestrator's turn
    const Shape shape = shape_of(s.collective, bytes, esize, s.peers);
    const auto slots = static_cast<std::size_t>(s.concurrency);
    std::vector<std::vector<std::uint8_t>> srcs(slots, std::vector<std::uint8_t>(shape.src_elements * esize));
    std::vector<std::vector<std::uint8_t>> dsts(slots, std::vector<std::uint8_t>(shape.dst_elements * esize));
    for (auto& b : srcs) fill_ones_and_zeros(b.data(), shape.src_elements, s.dtype);
    for (auto& b : dsts) fill_ones_and_zeros(b.data(), shape.dst_elements, s.dtype);
    json out = {{"size", bytes}};
    std::vector<std::uint8_t> raw_buffer(s.peers > 1 ? std::max<std::size_t>(1, shape.contributed * slots) : 0);
    const auto [raw_send, raw_recv] = raw_bytes(s, raw_buffer.size());
    const std::function<double()> gloo =
        gloo_context && comparable(s) ? gloo_round(s, gloo_context, shape) : std::function<double()>{};
    std::vector<double> lockstep_us;
    std::vector<double> raw_us;
    std::vector<double> gloo_us;
    std::uint64_t wire_bytes = 0;
    // One round of each; false when a peer failed.
    const auto lockstep_turn = [&](bool timed) {
      if (!comm.agree(true).is_ok()) return false;  // everyone starts together
      const auto start = Clock::now();
      std::vector<std::shared_ptr<peer::AsyncReduce>> handles;
      for (int k = 0; k < s.concurrency; ++k) {
        const auto slot = static_cast<std::size_t>(k);
        auto h = comm.all_reduce_async(descriptor_of(s, shape, srcs[slot], dsts[slot], k));
        if (!h.is_ok()) {
          std::fprintf(stderr, "worker %d: %s\n", s.index, h.status().to_string().c_str());
          return false;
        }
        handles.push_back(h.value());
      }
      std::uint64_t sent = 0;
      for (auto& h : handles) {
        auto r = comm.await(h);
        if (!r.is_ok()) {
          std::fprintf(stderr, "worker %d: %s\n", s.index, r.status().to_string().c_str());
          return false;
        }
        sent += r.value().bytes_sent;
      }
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      if (timed) {
        lockstep_us.push_back(us);
        wire_bytes = sent;
      }
      return true;
    };
    const auto raw_turn = [&](bool timed) {
      if (s.peers <= 1) return true;
      if (!raw.barrier()) return false;
      double us = 0;
      if (s.collective == Collective::kBarrier) {
        const auto start = Clock::now();
        if (!raw.barrier()) return false;
        us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      } else {
        us = raw.exchange_us(raw_buffer, raw_send, raw_recv);
      }
      if (timed) raw_us.push_back(us);
      return true;
    };
    const auto gloo_turn = [&](bool timed) {
      if (!gloo) return true;
      const double us = gloo();
      if (timed) gloo_us.push_back(us);
      return true;
    };
    if (s.in_turns) {
      // Round by round, so that the three medians sample the same moments of a shared
      // machine, in an order that changes from round to round: something periodic on the
      // machine whose period is near a round's (BENCHMARKS.md: a VM's memory monitor
      // stalling memory-bound processes every 0.5 s) would otherwise fall on the same
      // one's turns for a whole run. The shuffles come from the run's seed (drawn by the
      // orchestrator), the same in every worker, as the collectives require.
      const std::array<std::function<bool(bool)>, 3> turns = {lockstep_turn, raw_turn, gloo_turn};
      std::mt19937_64 shuffler(s.turn_seed);
      std::array<std::size_t, 3> order = {0, 1, 2};
      for (int round = 0; round < rounds; ++round) {
        const bool timed = round >= s.warmup;
        std::shuffle(order.begin(), order.end(), shuffler);
        for (const std::size_t k : order) {
          if (!turns[k](timed)) return 1;
        }
      }
    } else {
      // Each one's rounds back to back: sequential operations of one library.
      for (int round = 0; round < rounds; ++round) {
        if (!lockstep_turn(round >= s.warmup)) return 1;
      }
      for (int round = 0; round < rounds; ++round) {
        if (!raw_turn(round >= s.warmup)) return 1;
      }
      for (int round = 0; round < rounds; ++round) {
        if (!gloo_turn(round >= s.warmup)) return 1;
      }
    }
    out["lockstep_us"] = lockstep_us;
    out["bytes_sent"] = wire_bytes;
    if (s.peers > 1) out["raw_us"] = raw_us;
    if (gloo) out["gloo_us"] = gloo_us;
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
  }
  // Nobody closes its Gloo connections while another worker is still in its last round
  // (Gloo throws "Connection closed by peer" there).
  if (gloo_context && !comm.agree(true).is_ok()) return 1;
  return 0;
}

// Loops over all-reduces, retrying failures, admitting newcomers between steps, and
// prints the monotonic times at which every successful one began and ended.
int worker_recovery(const Settings& s) {
  peer::Options options;
  options.master_port = s.master_port;
  options.base_port = 0;
  options.failover_timeout_ms = s.failover_timeout_ms;
  if (s.fallback_port != 0) options.master_fallbacks = {{"127.0.0.1", s.fallback_port}};
  auto created = peer::Communicator::create(options);
  if (!created.is_ok() || !created.value()->connect().is_ok()) return 1;
  auto& comm = *created.value();
  const std::uint64_t count = std::max<std::uint64_t>(1, s.sizes.front() / 4);
  std::vector<float> data(count, 1.0f);
  for (;;) {
    auto a = comm.attributes();
    if (a.is_ok() && a.value().group_world_size >= 2) {
      peer::ReduceDescriptor d{data.data(), data.data(), count, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, 0};
      const std::int64_t began = now_ns();
      auto r = comm.all_reduce(d);
      if (r.is_ok()) {
        std::fill(data.begin(), data.end(), 1.0f);
        std::printf("{\"begin_ns\":%lld,\"ok_ns\":%lld,\"world\":%u}\n", static_cast<long long>(began),
                    static_cast<long long>(now_ns()), r.value().world_size);
        std::fflush(stdout);
      } else if (r.status().code() != LOCKSTEP_STATUS_PEER_CONNECTION_LOST) {
        return 1;
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    auto pending = comm.are_peers_pending();
    if (!pending.is_ok()) return 1;
    if (pending.value()) {
      Status u = comm.update_topology();
      if (!u.is_ok() && u.code() != LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) return 1;
    }
  }
}

// ------------------------------------------------------------------ orchestrator

}  // namespace

std::unique_ptr<master::MasterServer> start_master(std::uint32_t heartbeat_timeout_ms, const std::string& secret_file) {
  master::Options options;
  if (!secret_file.empty()) {
    auto key = security::load_secret_file(secret_file);
    if (!key.is_ok()) return nullptr;
    options.secret = key.value();
  }
  options.listen_host = "127.0.0.1";
  options.listen_port = 0;
  options.coordinator.heartbeat_timeout_ms = heartbeat_timeout_ms;
  options.coordinator.instance_nonce = std::random_device{}();
  auto m = std::make_unique<master::MasterServer>(options);
  if (!m->start().is_ok()) return nullptr;
  return m;
}

std::vector<std::string> worker_argv(const Settings& s, const std::string& mode, int index, std::uint16_t port) {
  std::vector<std::string> argv = {s.self, "worker", "--mode", mode, "--master-port", std::to_string(port),
                                   "--index", std::to_string(index), "--peers", std::to_string(s.peers),
                                   "--size", join_sizes(s.sizes), "--dtype", dtype_name(s.dtype),
                                   "--op", std::to_string(static_cast<int>(s.op)), "--concurrency",
                                   std::to_string(s.concurrency), "--pool", std::to_string(s.pool),
                                   "--iterations", std::to_string(s.iterations), "--warmup", std::to_string(s.warmup),
                                   "--order", s.in_turns ? "turns" : "blocks", "--turn-seed",
                                   std::to_string(s.turn_seed)};
  if (s.quant != LOCKSTEP_QUANT_NONE) argv.insert(argv.end(), {"--quant", quant_name(s.quant)});
  if (!s.gloo_store.empty()) {
    argv.push_back("--gloo-store");
    argv.push_back(s.gloo_store);
  }
  if (!s.secret_file.empty()) argv.insert(argv.end(), {"--secret-file", s.secret_file});
  if (s.encrypt) argv.push_back("--encrypt");
  if (s.failover_timeout_ms > 0) argv.insert(argv.end(), {"--failover-timeout-ms", std::to_string(s.failover_timeout_ms)});
  if (s.fallback_port != 0) argv.insert(argv.end(), {"--fallback-port", std::to_string(s.fallback_port)});
  if (s.check_finite) argv.push_back("--check-finite");
  if (s.no_inbound) argv.push_back("--no-inbound");
  if (s.compare_torch || s.compare_torch_lockstep) argv.push_back("--paced");
  argv.insert(argv.end(), {"--streams", std::to_string(s.streams)});
  if (!s.congestion.empty()) argv.insert(argv.end(), {"--cc", s.congestion});
  return argv;
}

std::optional<json> read_json(tools::Subprocess& p, std::chrono::seconds timeout) {
  auto line = p.read_line(timeout);
  if (!line) return std::nullopt;
  auto j = json::parse(*line, nullptr, false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

std::string join_sizes(const std::vector<std::uint64_t>& sizes) {
  std::string out;
  for (auto s : sizes) {
    if (!out.empty()) out += ',';
    out += std::to_string(s);
  }
  return out;
}

// Per iteration, the collective took as long as its slowest peer.
std::vector<double> slowest(const std::vector<json>& replies, const char* key) {
  std::vector<double> out;
  for (const auto& r : replies) {
    if (!r.contains(key)) return {};
    const auto& times = r[key];
    if (out.empty()) out.assign(times.size(), 0.0);
    for (std::size_t i = 0; i < times.size() && i < out.size(); ++i) out[i] = std::max(out[i], times[i].get<double>());
  }
  return out;
}

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::kAllReduce: return "allreduce";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kAllGather: return "allgather";
    case Collective::kReduceScatter: return "reducescatter";
    case Collective::kBarrier: return "barrier";
  }
  return "allreduce";
}

std::optional<Collective> collective_from_name(const std::string& name) {
  for (const Collective c : {Collective::kAllReduce, Collective::kBroadcast, Collective::kAllGather,
                             Collective::kReduceScatter, Collective::kBarrier}) {
    if (name == collective_name(c)) return c;
  }
  return std::nullopt;
}

Shape shape_of(Collective c, std::uint64_t bytes, std::size_t element_size, int world) {
  const std::uint64_t count = std::max<std::uint64_t>(1, bytes / element_size);
  const auto n = static_cast<std::uint64_t>(world);
  Shape shape;
  switch (c) {
    case Collective::kAllReduce:
    case Collective::kBroadcast: shape = {count, 0, count, 0}; break;
    case Collective::kAllGather: shape = {count, count, n * count, 0}; break;
    case Collective::kReduceScatter: {
      const std::uint64_t per_rank = std::max<std::uint64_t>(1, count / n);
      shape = {per_rank, n * per_rank, per_rank, 0};
      break;
    }
    case Collective::kBarrier: return {};
  }
  shape.contributed = (shape.src_elements > 0 ? shape.src_elements : shape.dst_elements) * element_size;
  return shape;
}

bool comparable(const Settings& s) {
  const bool dtype = s.dtype == LOCKSTEP_F32 || s.dtype == LOCKSTEP_F64 || s.dtype == LOCKSTEP_I32 ||
                     s.dtype == LOCKSTEP_I64;
  const bool reduces = s.collective == Collective::kAllReduce || s.collective == Collective::kReduceScatter;
  return s.concurrency == 1 && dtype && !(reduces && s.op == LOCKSTEP_AVG);
}

std::vector<std::string> dtype_names() {
  std::vector<std::string> out;
  for (const auto& [name, t] : dtypes()) out.push_back(name);
  return out;
}
lockstep_dtype_t dtype_from_name(const std::string& name) {
  auto it = dtypes().find(name);
  return it == dtypes().end() ? LOCKSTEP_F32 : it->second;
}
const char* dtype_name(lockstep_dtype_t dtype) {
  for (const auto& [name, t] : dtypes()) {
    if (t == dtype) return name.c_str();
  }
  return "f32";
}
lockstep_reduce_op_t op_from_name(const std::string& name) {
  if (name == "avg" || name == "1") return LOCKSTEP_AVG;
  if (name == "prod" || name == "2") return LOCKSTEP_PROD;
  if (name == "max" || name == "3") return LOCKSTEP_MAX;
  if (name == "min" || name == "4") return LOCKSTEP_MIN;
  return LOCKSTEP_SUM;
}

namespace {
constexpr std::array<const char*, 7> kQuantNames = {"none", "minmax", "zeropoint", "minmax4", "zeropoint4", "f16", "bf16"};
}  // namespace

std::vector<std::string> quant_names() { return {kQuantNames.begin(), kQuantNames.end()}; }

lockstep_quantization_t quant_from_name(const std::string& name) {
  for (std::size_t i = 0; i < kQuantNames.size(); ++i) {
    if (name == kQuantNames[i]) return static_cast<lockstep_quantization_t>(i);
  }
  return LOCKSTEP_QUANT_NONE;
}

const char* quant_name(lockstep_quantization_t quant) {
  const auto i = static_cast<std::size_t>(quant);
  return i < kQuantNames.size() ? kQuantNames[i] : "none";
}

std::optional<std::vector<std::uint64_t>> parse_sizes(const std::string& text) {
  std::vector<std::uint64_t> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    std::size_t used = 0;
    std::uint64_t value = 0;
    try {
      value = std::stoull(item, &used);
    } catch (const std::exception&) {
      return std::nullopt;
    }
    const std::string unit = item.substr(used);
    if (unit == "KiB") value <<= 10;
    else if (unit == "MiB") value <<= 20;
    else if (unit == "GiB") value <<= 30;
    else if (!unit.empty() && unit != "B") return std::nullopt;
    if (value == 0 || value > (std::uint64_t{4} << 30)) return std::nullopt;
    out.push_back(value);
  }
  if (out.empty()) return std::nullopt;
  return out;
}

std::string self_path(const char* argv0) {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(argv0) : p.string();
}

int run_worker(const Settings& s) {
  log::set_level(log::Level::kWarn);
  if (s.mode == "sync-holder" || s.mode == "sync-newcomer") return worker_sync(s);
  if (s.mode == "recovery") return worker_recovery(s);
  const auto collective = collective_from_name(s.mode);
  if (!collective) return 2;
  Settings w = s;
  w.collective = *collective;
  return worker_collective(w);
}

// A fresh random run secret in a private temporary file (hex text: no line breaks).
std::optional<std::string> write_run_secret() {
  char path[] = "/tmp/lockstep-bench-secret-XXXXXX";
  const int fd = ::mkstemp(path);  // mode 0600
  if (fd < 0) return std::nullopt;
  const security::Key bytes = security::random_key();
  static const char* digits = "0123456789abcdef";
  std::string text;
  for (const std::uint8_t b : bytes) {
    text += digits[b >> 4];
    text += digits[b & 15];
  }
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (!ok) {
    std::filesystem::remove(path);
    return std::nullopt;
  }
  return std::string(path);
}

namespace {

// Adds another measurement of the same collective to a figure: <name>_p50_us, and
// <name>_gbytes_s for collectives that move bytes; `versus` gets lockstep's speed over
// it (its median time over lockstep's).
void add_compared(json& out, const std::string& name, const std::vector<double>& us, double contributed,
                  const char* versus) {
  const double p50 = percentile(us, 0.5);
  if (contributed > 0) out[name + "_gbytes_s"] = contributed / (p50 * 1e3);
  out[name + "_p50_us"] = p50;
  out[versus] = p50 / out["p50_us"].get<double>();
}

}  // namespace

int run_collective(const Settings& settings) {
  Settings s = settings;
  log::set_level(log::Level::kWarn);
  if (s.encrypt) {
    auto path = write_run_secret();
    if (!path) {
      std::fprintf(stderr, "lockstep-bench: cannot write a run secret for --encrypt\n");
      return 1;
    }
    s.secret_file = *path;
  }
  // Removed on every return below.
  struct Cleanup {
    std::string secret;
    std::string store_dir;
    ~Cleanup() {
      if (!secret.empty()) std::filesystem::remove(secret);
      if (!store_dir.empty()) std::filesystem::remove_all(store_dir);
    }
  } cleanup{s.secret_file, ""};
  auto master = start_master(60'000, s.secret_file);  // generous: a busy 2-core machine must not evict live workers
  if (!master) return 1;
  if (s.compare_gloo || s.compare_torch || s.compare_torch_lockstep) {
    char tmpl[] = "/tmp/lockstep-bench-store-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return 1;
    cleanup.store_dir = tmpl;
    if (s.compare_gloo) s.gloo_store = cleanup.store_dir + "/gloo";
    if (s.compare_gloo) std::filesystem::create_directory(s.gloo_store);
  }
  std::unique_ptr<TorchPeers> torch;
  if (s.compare_torch && comparable(s)) {
    torch = TorchPeers::start(s, cleanup.store_dir, "gloo");
    if (!torch) return 1;
  }
  std::unique_ptr<TorchPeers> torch_lockstep;
  if (s.compare_torch_lockstep && comparable(s)) {
    torch_lockstep = TorchPeers::start(s, cleanup.store_dir, "lockstep");
    if (!torch_lockstep) return 1;
  }
  std::vector<tools::Subprocess> workers;
  for (int i = 0; i < s.peers; ++i) {
    auto p = tools::Subprocess::spawn(worker_argv(s, collective_name(s.collective), i, master->port()));
    if (!p) return 1;
    workers.push_back(std::move(*p));
  }
  int rc = 0;
  if (s.peers > 1) {
    // Wire the plain TCP ring: each worker announces a port; tell each its next.
    std::vector<int> ports;
    for (auto& w : workers) {
      auto j = read_json(w, std::chrono::seconds(120));
      if (!j || !j->contains("port")) {
        std::fprintf(stderr, "lockstep-bench: a worker did not start\n");
        return 1;
      }
      ports.push_back((*j)["port"].get<int>());
    }
    for (std::size_t i = 0; i < workers.size(); ++i) {
      workers[i].write_line(std::to_string(ports[(i + 1) % workers.size()]));
    }
  }
  const std::size_t esize = coll::dtype_size(s.dtype);
  for (const std::uint64_t bytes : s.sizes) {
    std::vector<json> replies;
    for (auto& w : workers) {
      if (s.compare_torch || s.compare_torch_lockstep) w.write_line("go");
    }
    for (auto& w : workers) {
      auto j = read_json(w, std::chrono::seconds(1800));
      if (!j) {
        std::fprintf(stderr, "lockstep-bench: a worker failed at size %llu\n", static_cast<unsigned long long>(bytes));
        return 1;
      }
      replies.push_back(*j);
    }
    std::string torch_why = "not measured (dtype, op or concurrency not supported by the comparison)";
    std::string torch_lockstep_why = torch_why;
    const auto torch_us = torch ? torch->measure(bytes, &torch_why) : std::vector<double>{};
    const auto torch_lockstep_us =
        torch_lockstep ? torch_lockstep->measure(bytes, &torch_lockstep_why) : std::vector<double>{};
    const auto lockstep_us = slowest(replies, "lockstep_us");
    const auto raw_us = slowest(replies, "raw_us");
    const auto gloo_us = slowest(replies, "gloo_us");
    const double contribution =
        static_cast<double>(shape_of(s.collective, bytes, esize, s.peers).contributed) * s.concurrency;
    const double p50 = percentile(lockstep_us, 0.5);
    std::uint64_t wire_bytes = 0;
    for (const auto& r : replies) wire_bytes = std::max<std::uint64_t>(wire_bytes, r.value("bytes_sent", std::uint64_t{0}));
    json out = {{"bench", collective_name(s.collective)},
                {"peers", s.peers},
                {"bytes", s.collective == Collective::kBarrier ? 0 : bytes},
                {"dtype", dtype_name(s.dtype)},
                {"op", static_cast<int>(s.op)},
                {"concurrency", s.concurrency},
                {"quant", quant_name(s.quant)},
                {"pool", s.pool},
                {"streams", s.streams},
                {"cc", s.congestion.empty() ? "default" : s.congestion},
                {"algorithm", s.collective == Collective::kAllReduce ? s.algorithm : "ring"},
                {"encrypt", s.encrypt},
                {"check_finite", s.check_finite},
                {"no_inbound", s.no_inbound},
                {"iterations", s.iterations},
                {"order", s.in_turns ? "turns" : "blocks"},
                {"pages", s.pages},
                {"p50_us", p50},
                {"p99_us", percentile(lockstep_us, 0.99)},
                {"wire_bytes_per_peer", wire_bytes}};
    if (contribution > 0) out["gbytes_s"] = contribution / (p50 * 1e3);
    if (!raw_us.empty()) add_compared(out, "raw", raw_us, contribution, "efficiency");
    if (!gloo_us.empty()) {
      add_compared(out, "gloo", gloo_us, contribution, "ratio");
    } else if (s.compare_gloo) {
      out["gloo"] = "not measured (dtype, op or concurrency not supported by the comparison)";
    }
    if (!torch_us.empty()) {
      add_compared(out, "torch", torch_us, contribution, "torch_ratio");
    } else if (s.compare_torch) {
      out["torch"] = torch_why;
    }
    if (!torch_lockstep_us.empty()) {
      add_compared(out, "torch_lockstep", torch_lockstep_us, contribution, "torch_lockstep_ratio");
    } else if (s.compare_torch_lockstep) {
      out["torch_lockstep"] = torch_lockstep_why;
    }
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
  }
  for (auto& w : workers) {
    if (w.wait(std::chrono::seconds(30)).value_or(1) != 0) rc = 1;
  }
  if (torch && !torch->finish()) rc = 1;
  if (torch_lockstep && !torch_lockstep->finish()) rc = 1;
  return rc;
}

std::optional<tools::Subprocess> spawn_master_process(const std::string& self, std::uint16_t* port,
                                                     const std::vector<std::string>& extra,
                                                     const std::string& stderr_path) {
  std::vector<std::string> argv = {(std::filesystem::path(self).parent_path() / "lockstep-master").string(), "--listen",
                                   "127.0.0.1:" + std::to_string(*port)};
  argv.insert(argv.end(), extra.begin(), extra.end());
  auto master = tools::Subprocess::spawn(argv, stderr_path);
  if (!master) {
    std::fprintf(stderr, "lockstep-bench: cannot start %s\n", argv[0].c_str());
    return std::nullopt;
  }
  const auto line = master->read_line(std::chrono::seconds(10));
  if (!line) {
    std::fprintf(stderr, "lockstep-bench: the master printed no address\n");
    return std::nullopt;
  }
  *port = static_cast<std::uint16_t>(std::stoi(line->substr(line->rfind(':') + 1)));
  return master;
}

// Whether a line of the log file contains `text`.
bool log_says(const std::string& path, const std::string& text) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.find(text) != std::string::npos) return true;
  }
  return false;
}

// Polls a log file until a line contains `text` (true) or the timeout passes (false, said).
bool wait_for_log(const std::string& path, const std::string& text, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (log_says(path, text)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::fprintf(stderr, "lockstep-bench: %s does not say '%s'\n", path.c_str(), text.c_str());
  return false;
}

int run_recovery(Settings s) {
  log::set_level(log::Level::kWarn);
  // The victim is a peer (the master runs in this process) or the master (a process of
  // its own, restarted on its address at once, the peers with failover on).
  std::unique_ptr<master::MasterServer> master;
  std::optional<tools::Subprocess> master_process;
  std::uint16_t port = 0;
  std::vector<std::string> master_flags = {"--heartbeat-timeout-ms", std::to_string(s.heartbeat_timeout_ms),
                                           "--log-level", "warn"};
  // With --standby: a private etcd, the serving master (master_process, on `port`) and
  // the standby (on s.fallback_port); their logs go to files, where the bench reads when
  // one serves.
  std::optional<tools::EtcdProcess> etcd;
  std::optional<tools::Subprocess> standby_process;
  std::string serving_log, standby_log;
  if (s.kill_master) s.failover_timeout_ms = 30'000;
  if (s.standby) {
    try {
      etcd.emplace();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "lockstep-bench: %s\n", e.what());
      return 1;
    }
    master_flags.insert(master_flags.end(), {"--ha-etcd", etcd->url(), "--ha-key",
                                             "/lockstep-bench", "--ha-lease-ttl-s", std::to_string(s.lease_ttl_s)});
    const std::string logs = std::filesystem::temp_directory_path() / ("lockstep-bench-" + std::to_string(::getpid()));
    serving_log = logs + "-a.log";
    standby_log = logs + "-b.log";
    master_process = spawn_master_process(s.self, &port, master_flags, serving_log);
    if (!master_process || !wait_for_log(serving_log, "serves the run now", std::chrono::seconds(30))) return 1;
    standby_process = spawn_master_process(s.self, &s.fallback_port, master_flags, standby_log);
    if (!standby_process) return 1;
  } else if (s.kill_master) {
    master_process = spawn_master_process(s.self, &port, master_flags);
    if (!master_process) return 1;
  } else {
    master = start_master(s.heartbeat_timeout_ms);
    if (!master) return 1;
    port = master->port();
  }
  std::map<int, tools::Subprocess> workers;
  int next_index = 0;
  auto spawn = [&] {
    auto p = tools::Subprocess::spawn(worker_argv(s, "recovery", next_index, port));
    if (p) workers.emplace(next_index++, std::move(*p));
  };
  // Reads every worker's reports for a while, handing each success (worker, began, ended) to `on_ok`.
  auto drain = [&](std::chrono::milliseconds duration, const std::function<void(int, std::int64_t, std::int64_t)>& on_ok) {
    const auto until = Clock::now() + duration;
    do {
      bool any = false;
      for (auto& [i, w] : workers) {
        while (auto line = w.read_line(std::chrono::milliseconds(0))) {
          auto j = json::parse(*line, nullptr, false);
          if (!j.is_discarded() && j.contains("ok_ns") && j.contains("begin_ns")) {
            on_ok(i, j["begin_ns"].get<std::int64_t>(), j["ok_ns"].get<std::int64_t>());
          }
          any = true;
        }
      }
      if (!any) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } while (Clock::now() < until);
  };
  const auto ignore = [](int, std::int64_t, std::int64_t) {};
  for (int i = 0; i < s.peers; ++i) spawn();
  drain(std::chrono::milliseconds(3000), ignore);
  std::mt19937 random(12345);
  std::vector<double> recovery_ms;
  for (int trial = 0; trial < s.trials; ++trial) {
    // Kill a random worker at a uniformly random moment.
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + random() % 250));
    drain(std::chrono::milliseconds(0), ignore);
    std::int64_t killed_ns = 0;
    std::optional<tools::Subprocess> stopped;
    if (s.standby) {
      // The standby serves from now on; the killed master comes back as the next standby.
      killed_ns = now_ns();
      master_process->kill();
      std::swap(master_process, standby_process);
      std::swap(port, s.fallback_port);
      std::swap(serving_log, standby_log);
      std::filesystem::remove(standby_log);
      standby_process = spawn_master_process(s.self, &s.fallback_port, master_flags, standby_log);
      if (!standby_process) return 1;
    } else if (s.kill_master) {
      killed_ns = now_ns();
      master_process->kill();
      master_process = spawn_master_process(s.self, &port, master_flags);
      if (!master_process) return 1;
    } else {
      auto victim = workers.begin();
      std::advance(victim, static_cast<long>(random() % workers.size()));
      killed_ns = now_ns();
      // A stopped peer is silent, not gone: the survivors wait for the heartbeat timeout.
      stopped = std::move(victim->second);
      if (s.stop_instead_of_kill) {
        stopped->signal(SIGSTOP);
      } else {
        stopped->kill();
      }
      workers.erase(victim);
    }
    // Wait until every survivor has completed an all-reduce that began after the kill
    // (one already in flight at the kill may still complete with every peer: it does not count).
    std::map<int, std::int64_t> after;
    const auto deadline = Clock::now() + std::chrono::milliseconds(s.heartbeat_timeout_ms + 30'000);
    while (after.size() < workers.size() && Clock::now() < deadline) {
      drain(std::chrono::milliseconds(2), [&](int i, std::int64_t began, std::int64_t ended) {
        if (began > killed_ns) after.emplace(i, ended);
      });
    }
    if (after.size() != workers.size()) {
      std::fprintf(stderr, "lockstep-bench: survivors did not recover within the deadline\n");
      return 1;
    }
    std::int64_t latest = 0;
    for (const auto& [i, t] : after) latest = std::max(latest, t);
    recovery_ms.push_back(static_cast<double>(latest - killed_ns) / 1e6);
    if (stopped) {
      stopped->kill();
      spawn();  // a replacement joins; let the run settle
    }
    // Either standby may have won the lease (the killed master's replacement too): the
    // next trial kills the one that serves.
    if (s.standby && !log_says(serving_log, "serves the run now") && log_says(standby_log, "serves the run now")) {
      std::swap(master_process, standby_process);
      std::swap(port, s.fallback_port);
      std::swap(serving_log, standby_log);
    }
    drain(std::chrono::milliseconds(500), ignore);
  }
  if (master_process) master_process->kill();
  if (standby_process) standby_process->kill();
  for (const auto& log : {serving_log, standby_log}) {
    if (!log.empty()) std::filesystem::remove(log);
  }
  json out = {{"bench", "recovery"},
              {"victim", s.kill_master ? (s.standby ? "master (hot standby)" : "master") : "peer"},
              {"signal", s.stop_instead_of_kill ? "SIGSTOP" : "SIGKILL"},
              {"peers", s.peers},
              {"bytes", s.sizes.front()},
              {"trials", s.trials},
              {"heartbeat_timeout_ms", s.heartbeat_timeout_ms},
              {"lease_ttl_s", s.standby ? json(s.lease_ttl_s) : json()},
              {"median_ms", percentile(recovery_ms, 0.5)},
              {"p90_ms", percentile(recovery_ms, 0.9)},
              {"max_ms", percentile(recovery_ms, 1.0)}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace lockstep::bench
