// lockstep-testpeer: a peer process driven line by line, for tests and the demo.
// It uses only the public C API. Each command read from stdin is answered with one
// JSON line on stdout; --loop runs the documented membership loop on its own and
// prints a JSON line whenever the membership view changes.
//
// Commands: connect | update | optimize | pending | agree 0|1 | view | reconnect | exit
//           allreduce COUNT TAG FILL [oop|inplace] [minmax|zeropoint|minmax4|zeropoint4|f16|bf16|none] [ramp]
//                     (f32 sum of COUNT elements all equal to FILL; with ramp element i
//                     is FILL * (1 + (i % 1000) / 1000); the reply's digest is the
//                     content hash of the result)
//   shared state (tensors of u8 or f32 elements, in definition order):
//           tensor NAME COUNT [u8|f32] [allow]   define one (zeros; allow: content inequality)
//           fill NAME SEED [compressible]        deterministic content from SEED (random
//                                                bytes, or f32 values of 16 kinds)
//           flip NAME BYTE                       flip the lowest bit of one byte
//           revision N | hashes                  set the revision | print every digest
//           sync [popular|receive|send]          synchronize; prints revision, bytes (tensor
//                                                and wire), digests
#include <lockstep/lockstep.h>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

std::string hex_id(const uint8_t id[16]) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (int i = 0; i < 16; ++i) {
    out += digits[id[i] >> 4];
    out += digits[id[i] & 15];
  }
  return out;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

struct Peer {
  lockstep_comm_t* comm = nullptr;
  std::string name;

  // The membership view as a JSON array, plus rank and world size.
  std::string view_json() const {
    lockstep_member_t members[256];
    size_t count = 0;
    if (lockstep_comm_get_membership(comm, members, 256, &count) != LOCKSTEP_OK) return "\"view\":null";
    std::ostringstream s;
    s << "\"view\":[";
    for (size_t i = 0; i < count; ++i) {
      s << (i ? "," : "") << "{\"id\":\"" << hex_id(members[i].id) << "\",\"rank\":" << members[i].rank
        << ",\"host\":\"" << escape(members[i].host) << "\",\"port\":" << members[i].p2p_port
        << ",\"shared_state_port\":" << members[i].shared_state_port
        << ",\"benchmark_port\":" << members[i].benchmark_port << "}";
    }
    s << "]";
    uint32_t rank = 0;
    lockstep_comm_get_rank(comm, &rank);
    int64_t world = 0;
    int64_t group_world = 0;
    int64_t groups = 0;
    lockstep_comm_get_attribute(comm, LOCKSTEP_ATTR_GLOBAL_WORLD_SIZE, &world);
    lockstep_comm_get_attribute(comm, LOCKSTEP_ATTR_PEER_GROUP_WORLD_SIZE, &group_world);
    lockstep_comm_get_attribute(comm, LOCKSTEP_ATTR_NUM_DISTINCT_PEER_GROUPS, &groups);
    s << ",\"rank\":" << rank << ",\"world\":" << world << ",\"group_world\":" << group_world
      << ",\"groups\":" << groups;
    return s.str();
  }

  std::string id_json() const {
    uint8_t id[16] = {};
    if (lockstep_comm_get_id(comm, id) != LOCKSTEP_OK) return "\"id\":null";
    return "\"id\":\"" + hex_id(id) + "\"";
  }

  void emit(const std::string& op, lockstep_status_t status, const std::string& extra) const {
    std::ostringstream s;
    s << "{\"name\":\"" << escape(name) << "\",\"op\":\"" << op << "\",\"code\":" << static_cast<int>(status)
      << ",\"status\":\"" << escape(lockstep_status_string(status)) << "\"";
    if (status != LOCKSTEP_OK) s << ",\"error\":\"" << escape(lockstep_comm_last_error(comm)) << "\"";
    s << "," << id_json();
    if (!extra.empty()) s << "," << extra;
    s << "}\n";
    std::fputs(s.str().c_str(), stdout);
    std::fflush(stdout);
  }
};

// The shared state this process holds.
struct Tensor {
  std::string name;
  lockstep_dtype_t dtype = LOCKSTEP_U8;
  std::uint64_t count = 0;
  std::vector<std::uint8_t> bytes;
  bool allow = false;
};
struct State {
  std::uint64_t revision = 0;
  std::vector<Tensor> tensors;

  Tensor* find(const std::string& name) {
    for (auto& t : tensors) {
      if (t.name == name) return &t;
    }
    return nullptr;
  }
  std::string json() const {
    std::ostringstream s;
    s << "\"revision\":" << revision << ",\"hashes\":{";
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      char hex[33] = {};
      lockstep_hash(tensors[i].bytes.data(), tensors[i].bytes.size(), hex);
      s << (i ? "," : "") << "\"" << escape(tensors[i].name) << "\":\"" << hex << "\"";
    }
    s << "}";
    return s.str();
  }
};

// splitmix64: the same SEED gives the same bytes in every process.
void fill_bytes(std::vector<std::uint8_t>& bytes, std::uint64_t seed) {
  std::uint64_t x = seed;
  for (std::size_t i = 0; i < bytes.size(); i += 8) {
    x += 0x9e3779b97f4a7c15ull;
    std::uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    for (std::size_t k = 0; k < 8 && i + k < bytes.size(); ++k) bytes[i + k] = static_cast<std::uint8_t>(z >> (8 * k));
  }
}

// Bytes that compress well: f32 values of 16 kinds (k / 16, k < 16 drawn from the seed),
// as a coarsely quantized or mostly constant tensor holds.
void fill_compressible(std::vector<std::uint8_t>& bytes, std::uint64_t seed) {
  std::vector<std::uint8_t> random(bytes.size());
  fill_bytes(random, seed);
  for (std::size_t i = 0; i + 4 <= bytes.size(); i += 4) {
    const float f = static_cast<float>(random[i] % 16) / 16.0f;
    std::memcpy(bytes.data() + i, &f, 4);
  }
}

bool fatal(lockstep_status_t s) {
  return s == LOCKSTEP_STATUS_MASTER_CONNECTION_LOST || s == LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED ||
         s == LOCKSTEP_STATUS_KICKED || s == LOCKSTEP_STATUS_REJECTED || s == LOCKSTEP_STATUS_PROTOCOL_ERROR;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lockstep-testpeer: a scriptable lockstep peer"};
  std::string master = "127.0.0.1:48148";
  std::string name = "peer";
  uint32_t group = 0;
  uint32_t pool = 1;
  uint32_t streams = 0;
  int base_port = 0;
  uint32_t connect_timeout_ms = 10000;
  std::string advertised_host;
  std::string bind_host;
  std::string secret_file;
  bool encrypt = false;
  bool no_state_compression = false;
  bool no_inbound = false;
  bool loop = false;
  uint32_t loop_interval_ms = 100;
  std::string algorithm;
  uint32_t failover_timeout_ms = 0;
  std::string master_fallbacks;
  app.add_option("--master", master, "HOST:PORT of the master");
  app.add_option("--failover-timeout-ms", failover_timeout_ms,
                 "once accepted, look this long for a master to take this peer back when its master is lost (0, "
                 "this harness's default unlike the library's 30000: off, the loss ends it at once)");
  app.add_option("--master-fallbacks", master_fallbacks, "more masters to try after --master: HOST:PORT[,HOST:PORT...]");
  app.add_option("--name", name, "name printed in every line");
  app.add_option("--group", group, "peer group");
  app.add_option("--pool", pool, "p2p connection pool size");
  app.add_option("--streams", streams, "p2p_streams: connections one all-reduce stripes over (0: adaptive)");
  app.add_option("--base-port", base_port, "first port for this peer's sockets (0: ephemeral, -1: above 48148)");
  app.add_option("--connect-timeout-ms", connect_timeout_ms, "timeout to reach the master");
  app.add_option("--advertised-host", advertised_host, "address other peers use to reach this one");
  app.add_option("--bind-host", bind_host, "address to bind the p2p sockets to");
  app.add_option("--secret-file", secret_file, "file holding the run secret");
  app.add_flag("--encrypt", encrypt, "encrypt the data plane (needs the secret)");
  app.add_flag("--no-state-compression", no_state_compression, "ask for shared-state transfers as raw bytes");
  app.add_flag("--no-inbound", no_inbound, "accept no inbound connection (listen on no port: behind a NAT)");
  app.add_flag("--loop", loop, "run the membership loop instead of reading commands");
  app.add_option("--algorithm", algorithm, "all-reduce algorithm: auto, ring or doubling (LOCKSTEP_ALLREDUCE_ALGORITHM)");
  app.add_option("--loop-interval-ms", loop_interval_ms, "pause between loop iterations");
  CLI11_PARSE(app, argc, argv);

  const auto colon = master.rfind(':');
  if (colon == std::string::npos) {
    std::fprintf(stderr, "--master must be HOST:PORT or [IPV6]:PORT\n");
    return 2;
  }
  std::string master_host = master.substr(0, colon);
  if (master_host.size() > 2 && master_host.front() == '[' && master_host.back() == ']') {
    master_host = master_host.substr(1, master_host.size() - 2);
  }
  if (!algorithm.empty()) ::setenv("LOCKSTEP_ALLREDUCE_ALGORITHM", algorithm.c_str(), 1);
  lockstep_comm_config_t config;
  lockstep_comm_config_init(&config);
  config.master_host = master_host.c_str();
  config.master_port = static_cast<uint16_t>(std::stoi(master.substr(colon + 1)));
  config.peer_group = group;
  config.p2p_pool_size = pool;
  config.p2p_streams = streams;
  config.base_port = base_port;
  config.connect_timeout_ms = connect_timeout_ms;
  config.advertised_host = advertised_host.c_str();
  config.bind_host = bind_host.c_str();
  if (!secret_file.empty()) config.secret_file = secret_file.c_str();
  config.encrypt_data = encrypt ? 1 : 0;
  config.state_compression = no_state_compression ? 1 : 0;
  config.no_inbound = no_inbound ? 1 : 0;
  config.failover_timeout_ms = failover_timeout_ms;
  if (!master_fallbacks.empty()) config.master_fallbacks = master_fallbacks.c_str();

  Peer peer;
  peer.name = name;
  lockstep_status_t created = lockstep_comm_create(&config, &peer.comm);
  if (created != LOCKSTEP_OK) {
    std::printf("{\"name\":\"%s\",\"op\":\"create\",\"code\":%d}\n", escape(name).c_str(), static_cast<int>(created));
    return 1;
  }

  if (loop) {
    lockstep_status_t s = lockstep_comm_connect(peer.comm);
    peer.emit("connect", s, s == LOCKSTEP_OK ? peer.view_json() : "");
    if (s != LOCKSTEP_OK) return 1;
    // The documented loop. A newcomer returns from connect where the accepted peers
    // are right after update_topology, so the loop body starts with the step's work
    // (here an agree) and ends with the membership check.
    std::string last_view = peer.view_json();
    bool refresh = false;
    for (;;) {
      int all = 0;
      s = lockstep_comm_agree(peer.comm, 1, &all);
      if (s == LOCKSTEP_OK) {
        std::this_thread::sleep_for(std::chrono::milliseconds(loop_interval_ms));
        int pending = 0;
        s = lockstep_comm_are_peers_pending(peer.comm, &pending);
        if (s == LOCKSTEP_OK && (pending || refresh)) {
          s = lockstep_comm_update_topology(peer.comm);
          refresh = s != LOCKSTEP_OK;
          const std::string view = peer.view_json();
          if (s == LOCKSTEP_OK && view != last_view) {
            peer.emit("view", s, view);
            last_view = view;
          }
        }
      }
      if (s != LOCKSTEP_OK) {
        peer.emit("error", s, "");
        if (fatal(s)) break;
        refresh = true;
      }
    }
    lockstep_comm_destroy(peer.comm);
    return 1;
  }

  State state;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream words(line);
    std::string op;
    words >> op;
    if (op.empty()) continue;
    if (op == "exit") break;
    if (op == "connect") {
      lockstep_status_t s = lockstep_comm_connect(peer.comm);
      peer.emit(op, s, s == LOCKSTEP_OK ? peer.view_json() : "");
    } else if (op == "update" || op == "optimize") {
      const auto start = std::chrono::steady_clock::now();
      lockstep_status_t s =
          op == "update" ? lockstep_comm_update_topology(peer.comm) : lockstep_comm_optimize_topology(peer.comm);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      peer.emit(op, s, "\"ms\":" + std::to_string(ms) + (s == LOCKSTEP_OK ? "," + peer.view_json() : ""));
    } else if (op == "pending") {
      int pending = 0;
      lockstep_status_t s = lockstep_comm_are_peers_pending(peer.comm, &pending);
      peer.emit(op, s, s == LOCKSTEP_OK ? std::string("\"pending\":") + (pending ? "true" : "false") : "");
    } else if (op == "agree") {
      int flag = 1;
      words >> flag;
      int result = 0;
      lockstep_status_t s = lockstep_comm_agree(peer.comm, flag, &result);
      peer.emit(op, s, s == LOCKSTEP_OK ? std::string("\"result\":") + (result ? "true" : "false") : "");
    } else if (op == "agreevalue") {
      // agreevalue equal|first TEXT: the reply's "value" is the text agreed on.
      std::string mode, text;
      words >> mode >> text;
      std::vector<char> out(4096);
      std::size_t size = 0;
      const lockstep_status_t s = lockstep_comm_agree_value(
          peer.comm, mode == "first" ? LOCKSTEP_AGREE_FIRST_ACCEPTED : LOCKSTEP_AGREE_ALL_EQUAL, text.data(), text.size(),
          out.data(), out.size(), &size);
      peer.emit(op, s, s == LOCKSTEP_OK ? "\"value\":\"" + escape(std::string(out.data(), size)) + "\"" : "");
    } else if (op == "kv") {
      // kv set KEY VALUE | kv get KEY | kv wait KEY TIMEOUT_MS | kv delete KEY: the
      // reply's "value" is the value read (get, wait), "size" its size.
      std::string what, key, value;
      words >> what >> key;
      std::vector<char> out(512 << 10);  // the largest value a master may allow
      std::size_t size = 0;
      lockstep_status_t s = LOCKSTEP_STATUS_INVALID_ARGUMENT;
      if (what == "set") {
        words >> value;
        s = lockstep_comm_kv_set(peer.comm, key.c_str(), value.data(), value.size());
      } else if (what == "get") {
        s = lockstep_comm_kv_get(peer.comm, key.c_str(), out.data(), out.size(), &size);
      } else if (what == "wait") {
        std::uint32_t timeout_ms = 0;
        words >> timeout_ms;
        s = lockstep_comm_kv_wait(peer.comm, key.c_str(), timeout_ms, out.data(), out.size(), &size);
      } else if (what == "delete") {
        s = lockstep_comm_kv_delete(peer.comm, key.c_str());
      }
      peer.emit(op, s, s == LOCKSTEP_OK && (what == "get" || what == "wait")
                           ? "\"value\":\"" + escape(std::string(out.data(), size)) + "\",\"size\":" + std::to_string(size)
                           : "");
    } else if (op == "allreduce") {
      // Every element is FILL; the reply says whether the result is uniform, its
      // value, and (on failure) whether the destination kept its previous content.
      std::uint64_t count = 0;
      std::uint64_t tag = 0;
      float fill = 0;
      std::string mode;
      std::string quant;
      std::string pattern;
      words >> count >> tag >> fill >> mode >> quant >> pattern;
      if (count == 0 || count > (std::uint64_t{1} << 30)) {
        peer.emit(op, LOCKSTEP_STATUS_INVALID_ARGUMENT, "");
        continue;
      }
      std::vector<float> src(count, fill);
      if (pattern == "ramp") {
        for (std::uint64_t i = 0; i < count; ++i) src[i] = fill * (1.0f + static_cast<float>(i % 1000) / 1000.0f);
      }
      std::vector<float> dst;
      if (mode == "oop") dst.assign(count, -1.0f);
      std::vector<float>& out = mode == "oop" ? dst : src;
      const std::vector<float> before = out;
      lockstep_reduce_desc_t desc{};
      desc.src = src.data();
      desc.dst = out.data();
      desc.count = count;
      desc.dtype = LOCKSTEP_F32;
      desc.op = LOCKSTEP_SUM;
      desc.quantization = quant == "minmax"       ? LOCKSTEP_QUANT_MINMAX_U8
                          : quant == "zeropoint"  ? LOCKSTEP_QUANT_ZERO_POINT_U8
                          : quant == "minmax4"    ? LOCKSTEP_QUANT_MINMAX_U4
                          : quant == "zeropoint4" ? LOCKSTEP_QUANT_ZERO_POINT_U4
                          : quant == "f16"        ? LOCKSTEP_QUANT_CAST_F16
                          : quant == "bf16"       ? LOCKSTEP_QUANT_CAST_BF16
                                                  : LOCKSTEP_QUANT_NONE;
      desc.tag = tag;
      lockstep_reduce_info_t info = {0, 0, 0, 0};
      const auto start = std::chrono::steady_clock::now();
      lockstep_status_t s = lockstep_comm_all_reduce(peer.comm, &desc, &info);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      bool uniform = true;
      for (float v : out) uniform = uniform && v == out[0];
      char digest[33] = {};
      lockstep_hash(out.data(), out.size() * sizeof(float), digest);
      std::ostringstream extra;
      extra << "\"ms\":" << ms << ",\"world\":" << info.world_size << ",\"bytes_sent\":" << info.bytes_sent
            << ",\"streams\":" << info.streams
            << ",\"value\":";
      if (std::isfinite(out[0])) {
        extra << out[0];
      } else {
        extra << "null";  // JSON has no inf or nan
      }
      extra << ",\"uniform\":" << (uniform ? "true" : "false") << ",\"unchanged\":" << (out == before ? "true" : "false") << ",\"digest\":\"" << digest << "\"";
      peer.emit(op, s, extra.str());
    } else if (op == "collective") {
      // collective KIND COUNT TAG FILL [ROOT]: broadcast (a buffer of FILL on the root),
      // allgather (COUNT elements of FILL from each rank), reducescatter (world x COUNT
      // elements, chunk r of them FILL x (r+1), summed), barrier. The reply: the status,
      // world, whether the destination kept its previous content, and what it holds:
      // `value` and `uniform` of the destination, and for allgather each rank's part
      // (its first element, or null where the part is not uniform).
      std::string kind;
      std::uint64_t count = 0, tag = 0;
      float fill = 0;
      std::uint32_t root = 0;
      words >> kind >> count >> tag >> fill >> root;
      std::uint32_t rank = 0;
      std::size_t world = 0;
      lockstep_comm_get_rank(peer.comm, &rank);
      lockstep_comm_get_membership(peer.comm, nullptr, 0, &world);
      if (count > (std::uint64_t{1} << 28) || world > 4096) {
        peer.emit(op, LOCKSTEP_STATUS_INVALID_ARGUMENT, "");
        continue;
      }
      std::vector<float> src, dst;
      lockstep_status_t s = LOCKSTEP_STATUS_INVALID_ARGUMENT;
      lockstep_reduce_info_t info = {0, 0, 0, 0};
      std::vector<float> before;
      const auto start = std::chrono::steady_clock::now();
      if (kind == "broadcast") {
        dst.assign(count, rank == root ? fill : -1.0f);
        before = dst;
        const lockstep_broadcast_desc_t d = {dst.data(), count, LOCKSTEP_F32, root, tag};
        s = lockstep_comm_broadcast(peer.comm, &d, &info);
      } else if (kind == "allgather") {
        src.assign(count, fill);
        dst.assign(count * world, -1.0f);
        before = dst;
        const lockstep_all_gather_desc_t d = {src.data(), count, dst.data(), dst.size(), LOCKSTEP_F32, nullptr, 0, tag};
        s = lockstep_comm_all_gather(peer.comm, &d, &info);
      } else if (kind == "reducescatter") {
        src.resize(count * world);
        for (std::size_t j = 0; j < src.size(); ++j) src[j] = fill * static_cast<float>(j / count + 1);
        dst.assign(count, -1.0f);
        before = dst;
        const lockstep_reduce_scatter_desc_t d = {src.data(), dst.data(), count, LOCKSTEP_F32, LOCKSTEP_SUM,
                                                  LOCKSTEP_QUANT_NONE, tag};
        s = lockstep_comm_reduce_scatter(peer.comm, &d, &info);
      } else if (kind == "barrier") {
        s = lockstep_comm_barrier(peer.comm, tag);
      }
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      const auto uniform = [](const float* p, std::size_t n) {
        for (std::size_t i = 1; i < n; ++i) {
          if (p[i] != p[0]) return false;
        }
        return true;
      };
      std::ostringstream extra;
      extra << "\"ms\":" << ms << ",\"world\":" << info.world_size << ",\"rank\":" << rank
            << ",\"unchanged\":" << (dst == before ? "true" : "false");
      if (!dst.empty()) {
        extra << ",\"value\":" << dst[0] << ",\"uniform\":" << (uniform(dst.data(), dst.size()) ? "true" : "false");
      }
      if (kind == "allgather" && count > 0) {
        extra << ",\"parts\":[";
        for (std::size_t r = 0; r < world; ++r) {
          if (r != 0) extra << ",";
          if (uniform(dst.data() + r * count, count)) {
            extra << dst[r * count];
          } else {
            extra << "null";
          }
        }
        extra << "]";
      }
      peer.emit(op, s, extra.str());
    } else if (op == "mix") {
      // mix COUNT BASE FILL: an all-reduce, all-gather, reduce-scatter, broadcast (root 0)
      // and barrier in flight at once (tags BASE..BASE+4), each awaited; the reply lists
      // their statuses in that order.
      std::uint64_t count = 0, base = 0;
      float fill = 0;
      words >> count >> base >> fill;
      std::size_t world = 0;
      lockstep_comm_get_membership(peer.comm, nullptr, 0, &world);
      if (count == 0 || count > (std::uint64_t{1} << 26) || world > 4096) {
        peer.emit(op, LOCKSTEP_STATUS_INVALID_ARGUMENT, "");
        continue;
      }
      std::vector<float> a(count, fill), g_src(count, fill), g_dst(count * world), r_src(count * world, fill),
          r_dst(count), b(count, fill);
      const lockstep_reduce_desc_t ar = {a.data(), a.data(), count, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, base, nullptr, LOCKSTEP_DIST_NONE};
      const lockstep_all_gather_desc_t ag = {g_src.data(), count, g_dst.data(), g_dst.size(), LOCKSTEP_F32,
                                             nullptr,      0,     base + 1};
      const lockstep_reduce_scatter_desc_t rs = {r_src.data(), r_dst.data(), count, LOCKSTEP_F32, LOCKSTEP_SUM,
                                                 LOCKSTEP_QUANT_NONE, base + 2};
      const lockstep_broadcast_desc_t bc = {b.data(), count, LOCKSTEP_F32, 0, base + 3};
      lockstep_async_t* handles[5] = {};
      lockstep_status_t started[5] = {
          lockstep_comm_all_reduce_async(peer.comm, &ar, &handles[0]),
          lockstep_comm_all_gather_async(peer.comm, &ag, &handles[1]),
          lockstep_comm_reduce_scatter_async(peer.comm, &rs, &handles[2]),
          lockstep_comm_broadcast_async(peer.comm, &bc, &handles[3]),
          lockstep_comm_barrier_async(peer.comm, base + 4, &handles[4]),
      };
      std::ostringstream extra;
      extra << "\"codes\":[";
      lockstep_status_t worst = LOCKSTEP_OK;
      for (int k = 0; k < 5; ++k) {
        const lockstep_status_t done = started[k] != LOCKSTEP_OK ? started[k] : lockstep_async_wait(handles[k], nullptr);
        if (worst == LOCKSTEP_OK) worst = done;
        extra << (k == 0 ? "" : ",") << static_cast<int>(done);
      }
      extra << "]";
      peer.emit(op, worst, extra.str());
    } else if (op == "multiple") {
      // multiple COUNT N BASE FILL: N all-reduces of COUNT elements of FILL and a barrier
      // (tags BASE..BASE+N) through multiple-with-retry, two in flight.
      std::uint64_t count = 0, n = 0, base = 0;
      float fill = 0;
      words >> count >> n >> base >> fill;
      if (count == 0 || n == 0 || n > 64 || count * n > (std::uint64_t{1} << 28)) {
        peer.emit(op, LOCKSTEP_STATUS_INVALID_ARGUMENT, "");
        continue;
      }
      std::vector<std::vector<float>> buffers(n, std::vector<float>(count, fill));
      std::vector<lockstep_reduce_desc_t> descs;
      for (std::uint64_t k = 0; k < n; ++k) {
        descs.push_back({buffers[k].data(), buffers[k].data(), count, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE,
                         base + k, nullptr, LOCKSTEP_DIST_NONE});
      }
      descs.push_back({nullptr, nullptr, 0, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, base + n, nullptr, LOCKSTEP_DIST_NONE});
      std::vector<lockstep_reduce_info_t> infos(descs.size());
      const lockstep_status_t s =
          lockstep_comm_all_reduce_multiple_with_retry(peer.comm, descs.data(), descs.size(), 2, infos.data());
      std::ostringstream extra;
      extra << "\"world\":" << infos[0].world_size << ",\"value\":" << buffers[0][0];
      peer.emit(op, s, extra.str());
    } else if (op == "reconnect") {
      // A new communicator (a new identity) in the same process.
      lockstep_comm_destroy(peer.comm);
      peer.comm = nullptr;
      lockstep_status_t s = lockstep_comm_create(&config, &peer.comm);
      if (s == LOCKSTEP_OK) s = lockstep_comm_connect(peer.comm);
      peer.emit(op, s, s == LOCKSTEP_OK ? peer.view_json() : "");
    } else if (op == "view") {
      peer.emit(op, LOCKSTEP_OK, peer.view_json());
    } else if (op == "tensor") {
      std::string tensor_name;
      std::uint64_t count = 0;
      std::string type;
      std::string flag;
      words >> tensor_name >> count >> type >> flag;
      const bool f32 = type == "f32";
      const bool allow = type == "allow" || flag == "allow";
      if (tensor_name.empty() || count > (std::uint64_t{1} << 31) || state.find(tensor_name) != nullptr) {
        peer.emit(op, LOCKSTEP_STATUS_INVALID_ARGUMENT, "");
        continue;
      }
      state.tensors.push_back(Tensor{tensor_name, f32 ? LOCKSTEP_F32 : LOCKSTEP_U8, count,
                                     std::vector<std::uint8_t>(count * (f32 ? 4 : 1)), allow});
      peer.emit(op, LOCKSTEP_OK, state.json());
    } else if (op == "fill" || op == "flip") {
      std::string tensor_name;
      std::uint64_t value = 0;
      std::string kind;
      words >> tensor_name >> value >> kind;
      Tensor* t = state.find(tensor_name);
      if (t == nullptr || (op == "flip" && value >= t->bytes.size())) {
        peer.emit(op, LOCKSTEP_STATUS_INVALID_ARGUMENT, "");
        continue;
      }
      if (op == "fill" && kind == "compressible") {
        fill_compressible(t->bytes, value);
      } else if (op == "fill") {
        fill_bytes(t->bytes, value);
      } else {
        t->bytes[value] ^= 1;
      }
      peer.emit(op, LOCKSTEP_OK, state.json());
    } else if (op == "revision") {
      words >> state.revision;
      peer.emit(op, LOCKSTEP_OK, state.json());
    } else if (op == "hashes") {
      peer.emit(op, LOCKSTEP_OK, state.json());
    } else if (op == "sync") {
      std::string strategy;
      words >> strategy;
      std::vector<lockstep_tensor_t> tensors;
      for (auto& t : state.tensors) {
        tensors.push_back(lockstep_tensor_t{t.name.c_str(), t.bytes.data(), t.count, t.dtype, LOCKSTEP_DEVICE_CPU,
                                            t.allow ? 1 : 0});
      }
      lockstep_shared_state_t shared{state.revision, tensors.data(), tensors.size()};
      lockstep_sync_info_t info{};
      const auto start = std::chrono::steady_clock::now();
      lockstep_status_t s = lockstep_comm_sync_shared_state(peer.comm, &shared,
                                                            strategy == "receive" ? LOCKSTEP_SYNC_RECEIVE_ONLY
                                                            : strategy == "send"  ? LOCKSTEP_SYNC_SEND_ONLY
                                                                                  : LOCKSTEP_SYNC_ENFORCE_POPULAR,
                                                            &info);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      state.revision = shared.revision;
      std::ostringstream extra;
      extra << "\"ms\":" << ms << ",\"bytes_sent\":" << info.bytes_sent << ",\"bytes_received\":" << info.bytes_received
            << ",\"wire_bytes_sent\":" << info.wire_bytes_sent << ",\"wire_bytes_received\":" << info.wire_bytes_received
            << ",\"streams\":" << info.streams << "," << state.json();
      peer.emit(op, s, extra.str());
    } else {
      peer.emit(op, LOCKSTEP_STATUS_INVALID_ARGUMENT, "");
    }
  }
  lockstep_comm_destroy(peer.comm);
  return 0;
}
