// lockstep-bench: the orchestrator (starts a master and worker processes, combines
// their timings) and the worker (one peer: lockstep, a plain TCP ring moving the
// same bytes, and Gloo's ring all-reduce, in the same process and run).
#include "bench_common.h"

#include "common/log.h"
#include "kernels/reduce.h"
#include "master/master_server.h"
#include "peer/communicator.h"
#include "security/crypto.h"
#include "subprocess.h"
#include "transport/socket.h"

#include <gloo/allreduce_ring.h>
#include <gloo/barrier_all_to_all.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
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

std::string join_sizes(const std::vector<std::uint64_t>& sizes) {
  std::string out;
  for (auto s : sizes) {
    if (!out.empty()) out += ',';
    out += std::to_string(s);
  }
  return out;
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

  // Moves 2(n-1)/n of the buffer each way, as a ring all-reduce does, without reducing.
  double exchange_us(std::vector<std::uint8_t>& buffer) {
    const std::size_t chunk = buffer.size() / static_cast<std::size_t>(peers_);
    const std::size_t total = 2 * static_cast<std::size_t>(peers_ - 1) * chunk;
    const std::size_t piece = std::min<std::size_t>(256 * 1024, std::max<std::size_t>(1, chunk));
    if (staging_.size() < std::max(piece, std::min<std::size_t>(total, 64 * 1024))) {
      staging_.resize(std::max(piece, std::min<std::size_t>(total, 64 * 1024)));
    }
    const auto start = Clock::now();
    if (total <= 64 * 1024) {
      // Small: the socket buffers hold it all, no second thread needed.
      if (!transport::send_all(tx_.get(), {buffer.data(), std::min(total, buffer.size())}, 60'000).is_ok()) return 0;
      if (total > buffer.size() && !transport::send_all(tx_.get(), {buffer.data(), total - buffer.size()}, 60'000).is_ok()) {
        return 0;
      }
      if (!transport::recv_exact(rx_.get(), {staging_.data(), total}, 60'000).is_ok()) return 0;
      return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    }
    std::thread sender([&] {
      for (std::size_t sent = 0; sent < total;) {
        const std::size_t n = std::min(piece, total - sent);
        const std::size_t offset = sent % std::max<std::size_t>(1, buffer.size() - n + 1);
        if (!transport::send_all(tx_.get(), {buffer.data() + offset, n}, 60'000).is_ok()) return;
        sent += n;
      }
    });
    for (std::size_t got = 0; got < total;) {
      const std::size_t n = std::min(piece, total - got);
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

// One timed Gloo ring all-reduce per call, over a buffer of `bytes`, after a barrier.
template <typename T>
std::function<double()> gloo_round(const std::shared_ptr<gloo::rendezvous::Context>& context, std::uint64_t bytes) {
  auto data = std::make_shared<std::vector<T>>(std::max<std::uint64_t>(1, bytes / sizeof(T)), T(1));
  std::vector<T*> ptrs = {data->data()};
  auto ring = std::make_shared<gloo::AllreduceRing<T>>(context, ptrs, static_cast<int>(data->size()));
  return [context, data, ring] {
    gloo::BarrierAllToAll(context).run();
    const auto start = Clock::now();
    ring->run();
    return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  };
}

std::function<double()> gloo_for(lockstep_dtype_t t, const std::shared_ptr<gloo::rendezvous::Context>& c,
                                 std::uint64_t bytes) {
  switch (t) {
    case LOCKSTEP_F32: return gloo_round<float>(c, bytes);
    case LOCKSTEP_F64: return gloo_round<double>(c, bytes);
    case LOCKSTEP_I32: return gloo_round<int32_t>(c, bytes);
    case LOCKSTEP_I64: return gloo_round<int64_t>(c, bytes);
    default: return {};
  }
}

int worker_allreduce(const Settings& s) {
  peer::Options options;
  options.master_port = s.master_port;
  options.base_port = 0;
  options.p2p_pool_size = static_cast<std::uint32_t>(s.pool);
  options.p2p_streams = static_cast<std::uint32_t>(s.streams);
  options.tcp_congestion = s.congestion;
  if (!s.secret_file.empty()) {
    auto key = security::load_secret_file(s.secret_file);
    if (!key.is_ok()) {
      std::fprintf(stderr, "worker %d: %s\n", s.index, key.status().to_string().c_str());
      return 1;
    }
    options.secret = key.value();
  }
  options.encrypt_data = s.encrypt;
  auto created = peer::Communicator::create(options);
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
    const std::uint64_t count = std::max<std::uint64_t>(1, bytes / esize);
    std::vector<std::vector<std::uint8_t>> buffers(static_cast<std::size_t>(s.concurrency),
                                                   std::vector<std::uint8_t>(count * esize));
    for (auto& b : buffers) fill_ones_and_zeros(b.data(), count, s.dtype);
    json out = {{"size", bytes}};
    std::vector<std::uint8_t> raw_buffer(s.peers > 1 ? count * esize * static_cast<std::size_t>(s.concurrency) : 0);
    const std::function<double()> gloo =
        gloo_context && s.concurrency == 1 ? gloo_for(s.dtype, gloo_context, bytes) : std::function<double()>{};
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
        auto& b = buffers[static_cast<std::size_t>(k)];
        peer::ReduceDescriptor d{b.data(), b.data(), count, s.dtype, s.op, s.quant, static_cast<std::uint64_t>(k)};
        auto h = comm.all_reduce_async(d);
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
      const double us = raw.exchange_us(raw_buffer);
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
      // Round by round, so that the three medians sample the same moments of a shared machine.
      for (int round = 0; round < rounds; ++round) {
        const bool timed = round >= s.warmup;
        if (!lockstep_turn(timed) || !raw_turn(timed) || !gloo_turn(timed)) return 1;
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
// prints the monotonic time of every success.
int worker_recovery(const Settings& s) {
  peer::Options options;
  options.master_port = s.master_port;
  options.base_port = 0;
  auto created = peer::Communicator::create(options);
  if (!created.is_ok() || !created.value()->connect().is_ok()) return 1;
  auto& comm = *created.value();
  const std::uint64_t count = std::max<std::uint64_t>(1, s.sizes.front() / 4);
  std::vector<float> data(count, 1.0f);
  for (;;) {
    auto a = comm.attributes();
    if (a.is_ok() && a.value().group_world_size >= 2) {
      peer::ReduceDescriptor d{data.data(), data.data(), count, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, 0};
      auto r = comm.all_reduce(d);
      if (r.is_ok()) {
        std::fill(data.begin(), data.end(), 1.0f);
        std::printf("{\"ok_ns\":%lld,\"world\":%u}\n", static_cast<long long>(now_ns()), r.value().world_size);
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
                                   "--order", s.in_turns ? "turns" : "blocks"};
  if (s.quant == LOCKSTEP_QUANT_MINMAX_U8) argv.insert(argv.end(), {"--quant", "minmax"});
  if (s.quant == LOCKSTEP_QUANT_ZERO_POINT_U8) argv.insert(argv.end(), {"--quant", "zeropoint"});
  if (!s.gloo_store.empty()) {
    argv.push_back("--gloo-store");
    argv.push_back(s.gloo_store);
  }
  if (!s.secret_file.empty()) argv.insert(argv.end(), {"--secret-file", s.secret_file});
  if (s.encrypt) argv.push_back("--encrypt");
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

namespace {

// Per iteration, the all-reduce took as long as its slowest peer.
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

}  // namespace

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

lockstep_quantization_t quant_from_name(const std::string& name) {
  if (name == "minmax") return LOCKSTEP_QUANT_MINMAX_U8;
  if (name == "zeropoint") return LOCKSTEP_QUANT_ZERO_POINT_U8;
  return LOCKSTEP_QUANT_NONE;
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
  return s.mode == "recovery" ? worker_recovery(s) : worker_allreduce(s);
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

int run_allreduce(const Settings& settings) {
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
  struct SecretFile {
    std::string path;
    ~SecretFile() {
      if (!path.empty()) std::filesystem::remove(path);
    }
  } secret_file{s.secret_file};
  auto master = start_master(60'000, s.secret_file);  // generous: a busy 2-core machine must not evict live workers
  if (!master) return 1;
  std::string store_dir;
  if (s.compare_gloo) {
    char tmpl[] = "/tmp/lockstep-bench-gloo-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return 1;
    store_dir = tmpl;
    s.gloo_store = store_dir;
  }
  std::vector<tools::Subprocess> workers;
  for (int i = 0; i < s.peers; ++i) {
    auto p = tools::Subprocess::spawn(worker_argv(s, "allreduce", i, master->port()));
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
  for (const std::uint64_t bytes : s.sizes) {
    std::vector<json> replies;
    for (auto& w : workers) {
      auto j = read_json(w, std::chrono::seconds(1800));
      if (!j) {
        std::fprintf(stderr, "lockstep-bench: a worker failed at size %llu\n", static_cast<unsigned long long>(bytes));
        return 1;
      }
      replies.push_back(*j);
    }
    const auto lockstep_us = slowest(replies, "lockstep_us");
    const auto raw_us = slowest(replies, "raw_us");
    const auto gloo_us = slowest(replies, "gloo_us");
    const double contribution = static_cast<double>(bytes) * s.concurrency;
    const double p50 = percentile(lockstep_us, 0.5);
    json out = {{"bench", "allreduce"},
                {"peers", s.peers},
                {"bytes", bytes},
                {"dtype", dtype_name(s.dtype)},
                {"op", static_cast<int>(s.op)},
                {"concurrency", s.concurrency},
                {"quant", s.quant == LOCKSTEP_QUANT_NONE ? "none" : (s.quant == LOCKSTEP_QUANT_MINMAX_U8 ? "minmax" : "zeropoint")},
                {"pool", s.pool},
                {"streams", s.streams},
                {"cc", s.congestion.empty() ? "default" : s.congestion},
                {"encrypt", s.encrypt},
                {"iterations", s.iterations},
                {"order", s.in_turns ? "turns" : "blocks"},
                {"gbytes_s", contribution / (p50 * 1e3)},
                {"p50_us", p50},
                {"p99_us", percentile(lockstep_us, 0.99)},
                {"wire_bytes_per_peer", replies[0].value("bytes_sent", 0)}};
    if (!raw_us.empty()) {
      const double raw = contribution / (percentile(raw_us, 0.5) * 1e3);
      out["raw_gbytes_s"] = raw;
      out["efficiency"] = out["gbytes_s"].get<double>() / raw;
    }
    if (!gloo_us.empty()) {
      const double gloo = static_cast<double>(bytes) / (percentile(gloo_us, 0.5) * 1e3);
      out["gloo_gbytes_s"] = gloo;
      out["gloo_p50_us"] = percentile(gloo_us, 0.5);
      out["ratio"] = out["gbytes_s"].get<double>() / gloo;
    } else if (s.compare_gloo) {
      out["gloo"] = "not measured (dtype or concurrency not supported by the comparison)";
    }
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
  }
  for (auto& w : workers) {
    if (w.wait(std::chrono::seconds(30)).value_or(1) != 0) rc = 1;
  }
  if (!store_dir.empty()) std::filesystem::remove_all(store_dir);
  return rc;
}

int run_recovery(const Settings& s) {
  log::set_level(log::Level::kWarn);
  auto master = start_master(s.heartbeat_timeout_ms);
  if (!master) return 1;
  std::map<int, tools::Subprocess> workers;
  int next_index = 0;
  auto spawn = [&] {
    auto p = tools::Subprocess::spawn(worker_argv(s, "recovery", next_index, master->port()));
    if (p) workers.emplace(next_index++, std::move(*p));
  };
  // Reads every worker's successes for a while; returns the last success time of each.
  auto drain = [&](std::chrono::milliseconds duration, std::map<int, std::int64_t>& last_ok) {
    const auto until = Clock::now() + duration;
    while (Clock::now() < until) {
      bool any = false;
      for (auto& [i, w] : workers) {
        while (auto line = w.read_line(std::chrono::milliseconds(0))) {
          auto j = json::parse(*line, nullptr, false);
          if (!j.is_discarded() && j.contains("ok_ns")) last_ok[i] = j["ok_ns"].get<std::int64_t>();
          any = true;
        }
      }
      if (!any) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  for (int i = 0; i < s.peers; ++i) spawn();
  std::map<int, std::int64_t> last_ok;
  drain(std::chrono::milliseconds(3000), last_ok);
  std::mt19937 random(12345);
  std::vector<double> recovery_ms;
  for (int trial = 0; trial < s.trials; ++trial) {
    // Kill a random worker at a uniformly random moment.
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + random() % 250));
    drain(std::chrono::milliseconds(0), last_ok);
    auto victim = workers.begin();
    std::advance(victim, static_cast<long>(random() % workers.size()));
    const std::int64_t killed_ns = now_ns();
    // A stopped peer is silent, not gone: the survivors wait for the heartbeat timeout.
    tools::Subprocess stopped = std::move(victim->second);
    if (s.stop_instead_of_kill) {
      stopped.signal(SIGSTOP);
    } else {
      stopped.kill();
    }
    workers.erase(victim);
    std::map<int, std::int64_t> after;
    const auto deadline = Clock::now() + std::chrono::milliseconds(s.heartbeat_timeout_ms + 30'000);
    // Wait until every survivor has completed an all-reduce that began after the kill.
    for (;;) {
      std::map<int, std::int64_t> seen;
      drain(std::chrono::milliseconds(2), seen);
      for (const auto& [i, t] : seen) {
        if (t > killed_ns && after.count(i) == 0) after[i] = t;
      }
      if (after.size() == workers.size() || Clock::now() > deadline) break;
    }
    if (after.size() != workers.size()) {
      std::fprintf(stderr, "lockstep-bench: survivors did not recover within the deadline\n");
      return 1;
    }
    std::int64_t latest = 0;
    for (const auto& [i, t] : after) latest = std::max(latest, t);
    recovery_ms.push_back(static_cast<double>(latest - killed_ns) / 1e6);
    stopped.kill();
    spawn();  // a replacement joins; let the run settle
    drain(std::chrono::milliseconds(500), last_ok);
  }
  json out = {{"bench", "recovery"},
              {"signal", s.stop_instead_of_kill ? "SIGSTOP" : "SIGKILL"},
              {"peers", s.peers},
              {"bytes", s.sizes.front()},
              {"trials", s.trials},
              {"heartbeat_timeout_ms", s.heartbeat_timeout_ms},
              {"median_ms", percentile(recovery_ms, 0.5)},
              {"p90_ms", percentile(recovery_ms, 0.9)},
              {"max_ms", percentile(recovery_ms, 1.0)}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace lockstep::bench
