// lockstep._lockstep: a thin pybind11 layer over the public C API.
//
// The pure-Python package (python/lockstep) validates arrays and tensors and passes
// raw addresses, element counts and dtypes here; this layer calls the C API with the
// GIL released around every call that may block, and turns a failing status into the
// package's exception classes (the factory of lockstep/_errors.py, registered by lockstep/__init__.py).
//
// Lifetime rules kept here:
//  * A communicator is destroyed only when no call on it is running on another thread
//    (close() refuses with INVALID_USAGE otherwise); the checks run with the GIL held.
//  * Buffers of an async collective are kept alive (a Python reference) until the
//    handle is awaited or the communicator is closed, whichever comes first: the
//    communicator owns the unawaited handles, so dropping a handle never frees memory
//    an operation still writes into.
//  * lockstep_async_wait dereferences the communicator the handle came from, so a
//    handle still unawaited when its communicator is closed is never passed to it
//    afterwards: it reports INTERRUPTED and its small C allocation is left behind.
#include <lockstep/lockstep.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// A failed call: translated into lockstep.Error (or a subclass) by the registered factory.
struct StatusError {
  int status;
  std::string message;
};

py::object& error_factory() {
  static py::object* factory = new py::object();  // leaked on purpose: outlives interpreter teardown order
  return *factory;
}

const char* status_name(int status) {
  if (status < LOCKSTEP_OK || status > LOCKSTEP_STATUS_NOT_SERVING) return "UNKNOWN_STATUS";
  return lockstep_status_name(static_cast<lockstep_status_t>(status));
}

// "NAME: description" for a status without a communicator message.
std::string plain_message(int status) {
  return std::string(status_name(status)) + ": " + lockstep_status_string(static_cast<lockstep_status_t>(status));
}

// The communicator's last error message, if it belongs to this status. The C API keeps
// the message of the last failure that carried one, so a failure detected before the
// library records a message (e.g. a null argument) would otherwise show a stale text:
// the message is used only when it starts with the name of the returned status.
std::string message_for(const lockstep_comm_t* comm, int status) {
  const std::string name = status_name(status);
  if (comm != nullptr) {
    std::string last = lockstep_comm_last_error(comm);
    if (last.size() >= name.size() && last.compare(0, name.size(), name) == 0 &&
        (last.size() == name.size() || last[name.size()] == ':')) {
      if (last.size() == name.size()) return plain_message(status);
      return last;
    }
  }
  return plain_message(status);
}

[[noreturn]] void fail(int status, std::string message) { throw StatusError{status, std::move(message)}; }

void check(int status, const lockstep_comm_t* comm) {
  if (status != LOCKSTEP_OK) fail(status, message_for(comm, status));
}

template <typename T>
T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

using InfoTuple = std::tuple<std::uint32_t, std::uint64_t, std::uint64_t>;

InfoTuple to_tuple(const lockstep_reduce_info_t& info) {
  return InfoTuple{info.world_size, info.bytes_sent, info.bytes_received};
}

lockstep_reduce_desc_t make_desc(std::uintptr_t src, std::uintptr_t dst, std::uint64_t count, int dtype, int op,
                                 int quantization, std::uint64_t tag, std::uintptr_t residual = 0,
                                 int distribution = 0) {
  lockstep_reduce_desc_t d;
  std::memset(&d, 0, sizeof d);
  d.src = as_ptr<const void>(src);
  d.dst = as_ptr<void>(dst);
  d.count = count;
  d.dtype = static_cast<lockstep_dtype_t>(dtype);
  d.op = static_cast<lockstep_reduce_op_t>(op);
  d.quantization = static_cast<lockstep_quantization_t>(quantization);
  d.tag = tag;
  d.residual = as_ptr<void>(residual);
  d.distribution = static_cast<lockstep_distribution_t>(distribution);
  return d;
}

lockstep_broadcast_desc_t make_broadcast_desc(std::uintptr_t buf, std::uint64_t count, int dtype, std::uint32_t root,
                                              std::uint64_t tag) {
  lockstep_broadcast_desc_t d;
  std::memset(&d, 0, sizeof d);
  d.buf = as_ptr<void>(buf);
  d.count = count;
  d.dtype = static_cast<lockstep_dtype_t>(dtype);
  d.root = root;
  d.tag = tag;
  return d;
}

// `counts` (all-gatherv) is read by the C call itself, which copies it: it only has to
// outlive the call, not the operation.
lockstep_all_gather_desc_t make_all_gather_desc(std::uintptr_t src, std::uint64_t count, std::uintptr_t dst,
                                                std::uint64_t dst_capacity, int dtype,
                                                const std::vector<std::uint64_t>& counts, std::uint64_t tag) {
  if (counts.size() > UINT32_MAX) fail(LOCKSTEP_STATUS_INVALID_ARGUMENT, "INVALID_ARGUMENT: too many counts");
  lockstep_all_gather_desc_t d;
  std::memset(&d, 0, sizeof d);
  d.src = as_ptr<const void>(src);
  d.count = count;
  d.dst = as_ptr<void>(dst);
  d.dst_capacity = dst_capacity;
  d.dtype = static_cast<lockstep_dtype_t>(dtype);
  d.counts = counts.empty() ? nullptr : counts.data();
  d.counts_len = static_cast<std::uint32_t>(counts.size());
  d.tag = tag;
  return d;
}

lockstep_reduce_scatter_desc_t make_reduce_scatter_desc(std::uintptr_t src, std::uintptr_t dst,
                                                        std::uint64_t count_per_rank, int dtype, int op,
                                                        int quantization, std::uint64_t tag) {
  lockstep_reduce_scatter_desc_t d;
  std::memset(&d, 0, sizeof d);
  d.src = as_ptr<const void>(src);
  d.dst = as_ptr<void>(dst);
  d.count_per_rank = count_per_rank;
  d.dtype = static_cast<lockstep_dtype_t>(dtype);
  d.op = static_cast<lockstep_reduce_op_t>(op);
  d.quantization = static_cast<lockstep_quantization_t>(quantization);
  d.tag = tag;
  return d;
}

// ------------------------------------------------------------------- master

class PyMaster {
 public:
  PyMaster(const std::string& host, std::uint16_t port, std::uint32_t heartbeat_timeout_ms,
           std::uint32_t vote_timeout_ms, std::uint32_t peers_max, const std::string& secret_file,
           std::uint32_t handshake_timeout_ms, std::uint32_t pending_handshakes_max, const std::string& http_listen,
           const std::string& http_token_file, bool http_insecure, std::uint32_t kv_keys_max,
           std::uint32_t kv_key_bytes_max, std::uint32_t kv_value_bytes_max, std::uint32_t newcomer_timeout_ms, int relay_port,
           std::uint32_t recovery_window_ms, std::uint32_t recovery_quorum, const std::string& ha_etcd,
           const std::string& ha_key, const std::string& ha_advertise, std::uint32_t ha_lease_ttl_s,
           std::uint32_t resume_hold_ms) {
    lockstep_master_config_t config;
    check(lockstep_master_config_init(&config), nullptr);
    config.listen_host = host.c_str();
    config.listen_port = port;
    config.heartbeat_timeout_ms = heartbeat_timeout_ms;
    config.vote_timeout_ms = vote_timeout_ms;
    config.peers_max = peers_max;
    config.secret_file = secret_file.c_str();
    config.handshake_timeout_ms = handshake_timeout_ms;
    config.pending_handshakes_max = pending_handshakes_max;
    config.http_listen = http_listen.c_str();
    config.http_token_file = http_token_file.c_str();
    config.http_insecure = http_insecure ? 1 : 0;
    config.kv_keys_max = kv_keys_max;
    config.kv_key_bytes_max = kv_key_bytes_max;
    config.kv_value_bytes_max = kv_value_bytes_max;
    config.newcomer_timeout_ms = newcomer_timeout_ms;
    config.relay = relay_port >= 0 ? 1 : 0;
    config.relay_port = relay_port >= 0 ? static_cast<std::uint32_t>(relay_port) : 0;
    config.recovery_window_ms = recovery_window_ms;
    config.recovery_quorum = recovery_quorum;
    config.ha_etcd = ha_etcd.c_str();
    config.ha_key = ha_key.c_str();
    config.ha_advertise = ha_advertise.c_str();
    config.ha_lease_ttl_s = ha_lease_ttl_s;
    config.resume_hold_ms = resume_hold_ms;
    lockstep_master_t* master = nullptr;
    const int s = lockstep_master_create(&config, &master);
    if (s != LOCKSTEP_OK) {
      fail(s, s == LOCKSTEP_STATUS_INVALID_ARGUMENT
                  ? plain_message(s) + " (heartbeat_timeout_ms out of range, a bad listen address, an "
                                       "unreadable or too short secret file, a bad http address, an unreadable or "
                                       "malformed token file, a non-loopback http address without a token, a kv bound above its "
                                       "maximum, newcomer_timeout_ms out of range, relay_port above 65535, a bad ha_* setting, or resume_hold_ms above 3600000)"
                  : plain_message(s));
    }
    master_ = master;
  }
  PyMaster(const PyMaster&) = delete;
  PyMaster& operator=(const PyMaster&) = delete;
  ~PyMaster() {
    // Joins the master's threads, which never take the GIL.
    lockstep_master_destroy(master_);
  }

  void run() {
    lockstep_master_t* m = live();
    int s = LOCKSTEP_OK;
    {
      py::gil_scoped_release release;
      s = lockstep_master_run(m);
    }
    if (s != LOCKSTEP_OK) {
      fail(s, s == LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED ? plain_message(s) + " (cannot listen on the address)"
              : s == LOCKSTEP_STATUS_INVALID_ARGUMENT
                  ? plain_message(s) + " (a relay needs a run secret: give secret_file)"
                  : plain_message(s));
    }
  }

  std::uint16_t relay_port() {
    std::uint16_t port = 0;
    const int s = lockstep_master_relay_port(live(), &port);
    if (s == LOCKSTEP_STATUS_INVALID_USAGE) {
      fail(s, plain_message(s) + " (the master runs no relay, or is not running: call run() first)");
    }
    check(s, nullptr);
    return port;
  }

  std::uint16_t port() {
    std::uint16_t port = 0;
    const int s = lockstep_master_port(live(), &port);
    if (s == LOCKSTEP_STATUS_INVALID_USAGE) fail(s, plain_message(s) + " (the master is not running: call run() first)");
    check(s, nullptr);
    return port;
  }

  std::uint16_t http_port() {
    std::uint16_t port = 0;
    const int s = lockstep_master_http_port(live(), &port);
    if (s == LOCKSTEP_STATUS_INVALID_USAGE) {
      fail(s, plain_message(s) + " (the master has no http endpoint, or is not running: call run() first)");
    }
    check(s, nullptr);
    return port;
  }

  void interrupt() {
    if (master_ != nullptr) lockstep_master_interrupt(master_);
  }

  void wait() {
    lockstep_master_t* m = live();
    ++busy_;
    {
      py::gil_scoped_release release;
      lockstep_master_await(m);
    }
    --busy_;
  }

  void close() {
    if (master_ == nullptr) return;
    lockstep_master_t* m = master_;
    if (busy_ > 0) {
      // Other threads wait in wait(): stop the master and let them return (they need the
      // GIL to leave the call) before it is freed.
      lockstep_master_interrupt(m);
      while (busy_ > 0) {
        py::gil_scoped_release release;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    master_ = nullptr;
    py::gil_scoped_release release;
    lockstep_master_destroy(m);
  }

  bool closed() const { return master_ == nullptr; }

 private:
  lockstep_master_t* live() {
    if (master_ == nullptr) fail(LOCKSTEP_STATUS_INVALID_USAGE, "INVALID_USAGE: the master is closed");
    return master_;
  }

  lockstep_master_t* master_ = nullptr;
  int busy_ = 0;  // calls in progress on other threads (guarded by the GIL)
};

// ------------------------------------------------------------- communicator

struct AsyncState {
  lockstep_async_t* handle = nullptr;  // null once awaited or orphaned
  bool finished = false;
  int status = LOCKSTEP_OK;
  std::string message;
  lockstep_reduce_info_t info{};
  py::object keepalive;  // the buffers, until the operation has ended
};

struct CommState {
  lockstep_comm_t* comm = nullptr;
  int busy = 0;  // calls in progress with the GIL released (guarded by the GIL)
  std::vector<std::shared_ptr<AsyncState>> outstanding;

  void forget(const std::shared_ptr<AsyncState>& op) {
    outstanding.erase(std::remove(outstanding.begin(), outstanding.end(), op), outstanding.end());
  }
};

// Marks a communicator busy for the duration of a call (constructed with the GIL held,
// destroyed after the GIL is taken back).
class Busy {
 public:
  explicit Busy(CommState& state) : state_(state) {
    if (state_.comm == nullptr) fail(LOCKSTEP_STATUS_INVALID_USAGE, "INVALID_USAGE: the communicator is closed");
    ++state_.busy;
  }
  Busy(const Busy&) = delete;
  Busy& operator=(const Busy&) = delete;
  ~Busy() { --state_.busy; }
  lockstep_comm_t* comm() const { return state_.comm; }

 private:
  CommState& state_;
};

// Runs a C call with the GIL released; returns its status and, on failure, the message
// read on the same thread right after it.
template <typename F>
std::pair<int, std::string> call_released(lockstep_comm_t* comm, F&& body) {
  py::gil_scoped_release release;
  const int s = body();
  if (s == LOCKSTEP_OK) return {s, std::string()};
  return {s, message_for(comm, s)};
}

class PyAsync {
 public:
  PyAsync(std::shared_ptr<CommState> comm, std::shared_ptr<AsyncState> op) : comm_(std::move(comm)), op_(std::move(op)) {}

  bool done() const {
    if (op_->finished || op_->handle == nullptr) return true;
    int d = 0;
    lockstep_async_poll(op_->handle, &d);  // touches only the operation, never the communicator
    return d != 0;
  }

  InfoTuple wait() {
    if (!op_->finished) {
      Busy busy(*comm_);  // comm_->comm is live: the handle is still owned by it
      lockstep_reduce_info_t info{};
      auto [s, message] = call_released(busy.comm(), [&] { return lockstep_async_wait(op_->handle, &info); });
      if (s == LOCKSTEP_STATUS_WRONG_THREAD) fail(s, message);  // the C API keeps the handle: await it on its thread
      op_->handle = nullptr;
      op_->finished = true;
      op_->status = s;
      op_->message = std::move(message);
      op_->info = info;
      op_->keepalive = py::object();
      comm_->forget(op_);
    }
    if (op_->status != LOCKSTEP_OK) fail(op_->status, op_->message);
    return to_tuple(op_->info);
  }

 private:
  std::shared_ptr<CommState> comm_;
  std::shared_ptr<AsyncState> op_;
};

class PyComm {
 public:
  PyComm(const std::string& master_host, std::uint16_t master_port, std::uint32_t group, std::uint32_t pool_size,
         std::int32_t base_port, std::uint32_t connect_timeout_ms, const std::string& advertised_host,
         const std::string& bind_host, const std::string& secret_file, const py::object& secret,
         std::uint32_t inbound_handshake_timeout_ms, std::uint32_t inbound_handshakes_max,
         std::uint32_t p2p_stall_timeout_ms, bool encrypt_data, std::uint32_t p2p_streams,
         const std::string& tcp_congestion, bool check_finite, std::uint32_t state_compression, bool inbound,
         const std::string& master_fallbacks, std::uint32_t failover_timeout_ms)
      : state_(std::make_shared<CommState>()) {
    lockstep_comm_config_t config;
    check(lockstep_comm_config_init(&config), nullptr);
    config.master_host = master_host.c_str();
    config.master_port = master_port;
    config.peer_group = group;
    config.p2p_pool_size = pool_size;
    config.base_port = base_port;
    config.connect_timeout_ms = connect_timeout_ms;
    config.advertised_host = advertised_host.c_str();
    config.bind_host = bind_host.c_str();
    config.secret_file = secret_file.c_str();
    std::string secret_bytes;
    if (!secret.is_none()) {
      secret_bytes = secret.cast<std::string>();  // bytes (the wrapper encodes a str as UTF-8)
      config.secret = secret_bytes.data();
      config.secret_bytes = secret_bytes.size();
    }
    config.inbound_handshake_timeout_ms = inbound_handshake_timeout_ms;
    config.inbound_handshakes_max = inbound_handshakes_max;
    config.p2p_stall_timeout_ms = p2p_stall_timeout_ms;
    config.encrypt_data = encrypt_data ? 1 : 0;
    config.p2p_streams = p2p_streams;
    config.tcp_congestion = tcp_congestion.c_str();
    config.check_finite = check_finite ? 1 : 0;
    config.state_compression = state_compression;
    config.no_inbound = inbound ? 0 : 1;
    config.master_fallbacks = master_fallbacks.c_str();
    config.failover_timeout_ms = failover_timeout_ms;
    lockstep_comm_t* comm = nullptr;
    int s = LOCKSTEP_OK;
    {
      py::gil_scoped_release release;
      s = lockstep_comm_create(&config, &comm);
    }
    if (s != LOCKSTEP_OK) {
      std::string hint;
      if (s == LOCKSTEP_STATUS_INVALID_ARGUMENT) hint = " (a bad pool_size, p2p_streams, tcp_congestion, base_port or host, a bad secret, or encrypt_data without a secret)";
      if (s == LOCKSTEP_STATUS_INTERNAL_ERROR) hint = " (the p2p sockets could not be bound: ports in use?)";
      fail(s, plain_message(s) + hint);
    }
    state_->comm = comm;
  }
  PyComm(const PyComm&) = delete;
  PyComm& operator=(const PyComm&) = delete;
  ~PyComm() {
    // Deallocation: nothing can be running on this object (every call holds a reference).
    try {
      close_locked(/*release_gil=*/false);
    } catch (...) {
    }
  }

  void connect() { simple([](lockstep_comm_t* c) { return lockstep_comm_connect(c); }); }
  void update_topology() { simple([](lockstep_comm_t* c) { return lockstep_comm_update_topology(c); }); }
  void optimize_topology() { simple([](lockstep_comm_t* c) { return lockstep_comm_optimize_topology(c); }); }

  bool are_peers_pending() {
    int pending = 0;
    simple([&](lockstep_comm_t* c) { return lockstep_comm_are_peers_pending(c, &pending); });
    return pending != 0;
  }

  bool agree(bool flag) {
    int result = 0;
    simple([&](lockstep_comm_t* c) { return lockstep_comm_agree(c, flag ? 1 : 0, &result); });
    return result != 0;
  }

  py::bytes agree_value(const std::string& value, int mode) {
    std::string out(4096, '\0');
    std::size_t size = 0;
    simple([&](lockstep_comm_t* c) {
      return lockstep_comm_agree_value(c, static_cast<lockstep_agree_mode_t>(mode), value.data(), value.size(),
                                       out.data(), out.size(), &size);
    });
    out.resize(size);
    return py::bytes(out);
  }

  void kv_set(const std::string& key, const std::string& value) {
    simple([&](lockstep_comm_t* c) { return lockstep_comm_kv_set(c, key.c_str(), value.data(), value.size()); });
  }

  // get (wait false) or wait: into a buffer as large as the largest value a master allows.
  py::bytes kv_read(const std::string& key, bool wait, std::uint32_t timeout_ms) {
    std::string out(512 << 10, '\0');
    std::size_t size = 0;
    simple([&](lockstep_comm_t* c) {
      return wait ? lockstep_comm_kv_wait(c, key.c_str(), timeout_ms, out.data(), out.size(), &size)
                  : lockstep_comm_kv_get(c, key.c_str(), out.data(), out.size(), &size);
    });
    out.resize(size);
    return py::bytes(out);
  }

  void kv_delete(const std::string& key) {
    simple([&](lockstep_comm_t* c) { return lockstep_comm_kv_delete(c, key.c_str()); });
  }

  std::int64_t attribute(int attribute) {
    Busy busy(*state_);
    std::int64_t value = 0;
    check(lockstep_comm_get_attribute(busy.comm(), static_cast<lockstep_attribute_t>(attribute), &value), busy.comm());
    return value;
  }

  std::uint32_t rank() {
    Busy busy(*state_);
    std::uint32_t rank = 0;
    check(lockstep_comm_get_rank(busy.comm(), &rank), busy.comm());
    return rank;
  }

  py::bytes id() {
    Busy busy(*state_);
    std::uint8_t id[16];
    check(lockstep_comm_get_id(busy.comm(), id), busy.comm());
    return py::bytes(reinterpret_cast<const char*>(id), sizeof id);
  }

  std::vector<std::tuple<py::bytes, std::uint32_t, std::string, std::uint16_t, std::uint16_t, std::uint16_t>>
  membership() {
    Busy busy(*state_);
    std::vector<lockstep_member_t> members;
    size_t count = 0;
    int s = LOCKSTEP_OK;
    // The view may grow between the two calls (a topology update on another thread is
    // not legal, but be robust): retry with the reported size.
    for (int attempt = 0; attempt < 8; ++attempt) {
      s = lockstep_comm_get_membership(busy.comm(), members.data(), members.size(), &count);
      if (s == LOCKSTEP_OK) break;
      if (s != LOCKSTEP_STATUS_INVALID_ARGUMENT || count <= members.size()) break;
      members.resize(count);
    }
    check(s, busy.comm());
    std::vector<std::tuple<py::bytes, std::uint32_t, std::string, std::uint16_t, std::uint16_t, std::uint16_t>> out;
    for (size_t i = 0; i < count && i < members.size(); ++i) {
      const lockstep_member_t& m = members[i];
      out.emplace_back(py::bytes(reinterpret_cast<const char*>(m.id), sizeof m.id), m.rank,
                       std::string(m.host, strnlen(m.host, sizeof m.host)), m.p2p_port, m.shared_state_port,
                       m.benchmark_port);
    }
    return out;
  }

  std::string last_error() {
    if (state_->comm == nullptr) return std::string();
    return lockstep_comm_last_error(state_->comm);
  }

  py::dict counters() {
    Busy busy(*state_);
    lockstep_counters_t c{};
    c.struct_size = sizeof c;
    check(lockstep_comm_get_counters(busy.comm(), &c), busy.comm());
    py::dict out;
    out["all_reduce_bytes_sent"] = c.all_reduce_bytes_sent;
    out["all_reduce_bytes_received"] = c.all_reduce_bytes_received;
    out["sync_bytes_sent"] = c.sync_bytes_sent;
    out["sync_bytes_received"] = c.sync_bytes_received;
    out["operations_started"] = c.operations_started;
    out["operations_succeeded"] = c.operations_succeeded;
    out["operations_failed"] = c.operations_failed;
    out["all_reduces_started"] = c.all_reduces_started;
    out["all_reduces_succeeded"] = c.all_reduces_succeeded;
    out["all_reduces_failed"] = c.all_reduces_failed;
    out["syncs_started"] = c.syncs_started;
    out["syncs_succeeded"] = c.syncs_succeeded;
    out["syncs_failed"] = c.syncs_failed;
    out["retries"] = c.retries;
    out["connect_us"] = c.connect_us;
    out["update_topology_us"] = c.update_topology_us;
    out["optimize_topology_us"] = c.optimize_topology_us;
    out["sync_us"] = c.sync_us;
    out["all_reduce_us"] = c.all_reduce_us;
    return out;
  }

  // (sent, received) ring bytes per pool slot; the library answers INVALID_ARGUMENT
  // past the last slot of the pool.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> slot_bytes() {
    Busy busy(*state_);
    std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
    for (std::uint32_t slot = 0;; ++slot) {
      std::uint64_t sent = 0, received = 0;
      const lockstep_status_t s = lockstep_comm_get_slot_bytes(busy.comm(), slot, &sent, &received);
      if (s == LOCKSTEP_STATUS_INVALID_ARGUMENT && slot > 0) break;
      check(s, busy.comm());
      out.emplace_back(sent, received);
    }
    return out;
  }

  InfoTuple all_reduce(std::uintptr_t src, std::uintptr_t dst, std::uint64_t count, int dtype, int op, int quantization,
                       std::uint64_t tag, std::uintptr_t residual, int distribution) {
    Busy busy(*state_);
    const lockstep_reduce_desc_t d = make_desc(src, dst, count, dtype, op, quantization, tag, residual, distribution);
    lockstep_reduce_info_t info{};
    auto [s, message] = call_released(busy.comm(), [&] { return lockstep_comm_all_reduce(busy.comm(), &d, &info); });
    if (s != LOCKSTEP_OK) fail(s, message);
    return to_tuple(info);
  }

  PyAsync all_reduce_async(std::uintptr_t src, std::uintptr_t dst, std::uint64_t count, int dtype, int op,
                           int quantization, std::uint64_t tag, std::uintptr_t residual, int distribution,
                           py::object keepalive) {
    Busy busy(*state_);
    const lockstep_reduce_desc_t d = make_desc(src, dst, count, dtype, op, quantization, tag, residual, distribution);
    lockstep_async_t* handle = nullptr;
    auto [s, message] =
        call_released(busy.comm(), [&] { return lockstep_comm_all_reduce_async(busy.comm(), &d, &handle); });
    if (s != LOCKSTEP_OK) fail(s, message);
    return adopt(handle, std::move(keepalive));
  }

  InfoTuple broadcast(std::uintptr_t buf, std::uint64_t count, int dtype, std::uint32_t root, std::uint64_t tag) {
    Busy busy(*state_);
    const lockstep_broadcast_desc_t d = make_broadcast_desc(buf, count, dtype, root, tag);
    lockstep_reduce_info_t info{};
    auto [s, message] = call_released(busy.comm(), [&] { return lockstep_comm_broadcast(busy.comm(), &d, &info); });
    if (s != LOCKSTEP_OK) fail(s, message);
    return to_tuple(info);
  }

  PyAsync broadcast_async(std::uintptr_t buf, std::uint64_t count, int dtype, std::uint32_t root, std::uint64_t tag,
                          py::object keepalive) {
    Busy busy(*state_);
    const lockstep_broadcast_desc_t d = make_broadcast_desc(buf, count, dtype, root, tag);
    lockstep_async_t* handle = nullptr;
    auto [s, message] =
        call_released(busy.comm(), [&] { return lockstep_comm_broadcast_async(busy.comm(), &d, &handle); });
    if (s != LOCKSTEP_OK) fail(s, message);
    return adopt(handle, std::move(keepalive));
  }

  InfoTuple all_gather(std::uintptr_t src, std::uint64_t count, std::uintptr_t dst, std::uint64_t dst_capacity,
                       int dtype, const std::vector<std::uint64_t>& counts, std::uint64_t tag) {
    Busy busy(*state_);
    const lockstep_all_gather_desc_t d = make_all_gather_desc(src, count, dst, dst_capacity, dtype, counts, tag);
    lockstep_reduce_info_t info{};
    auto [s, message] = call_released(busy.comm(), [&] { return lockstep_comm_all_gather(busy.comm(), &d, &info); });
    if (s != LOCKSTEP_OK) fail(s, message);
    return to_tuple(info);
  }

  PyAsync all_gather_async(std::uintptr_t src, std::uint64_t count, std::uintptr_t dst, std::uint64_t dst_capacity,
                           int dtype, const std::vector<std::uint64_t>& counts, std::uint64_t tag,
                           py::object keepalive) {
    Busy busy(*state_);
    const lockstep_all_gather_desc_t d = make_all_gather_desc(src, count, dst, dst_capacity, dtype, counts, tag);
    lockstep_async_t* handle = nullptr;
    auto [s, message] =
        call_released(busy.comm(), [&] { return lockstep_comm_all_gather_async(busy.comm(), &d, &handle); });
    if (s != LOCKSTEP_OK) fail(s, message);
    return adopt(handle, std::move(keepalive));
  }

  InfoTuple reduce_scatter(std::uintptr_t src, std::uintptr_t dst, std::uint64_t count_per_rank, int dtype, int op,
                           int quantization, std::uint64_t tag) {
    Busy busy(*state_);
    const lockstep_reduce_scatter_desc_t d =
        make_reduce_scatter_desc(src, dst, count_per_rank, dtype, op, quantization, tag);
    lockstep_reduce_info_t info{};
    auto [s, message] =
        call_released(busy.comm(), [&] { return lockstep_comm_reduce_scatter(busy.comm(), &d, &info); });
    if (s != LOCKSTEP_OK) fail(s, message);
    return to_tuple(info);
  }

  PyAsync reduce_scatter_async(std::uintptr_t src, std::uintptr_t dst, std::uint64_t count_per_rank, int dtype, int op,
                               int quantization, std::uint64_t tag, py::object keepalive) {
    Busy busy(*state_);
    const lockstep_reduce_scatter_desc_t d =
        make_reduce_scatter_desc(src, dst, count_per_rank, dtype, op, quantization, tag);
    lockstep_async_t* handle = nullptr;
    auto [s, message] =
        call_released(busy.comm(), [&] { return lockstep_comm_reduce_scatter_async(busy.comm(), &d, &handle); });
    if (s != LOCKSTEP_OK) fail(s, message);
    return adopt(handle, std::move(keepalive));
  }

  void barrier(std::uint64_t tag) {
    Busy busy(*state_);
    auto [s, message] = call_released(busy.comm(), [&] { return lockstep_comm_barrier(busy.comm(), tag); });
    if (s != LOCKSTEP_OK) fail(s, message);
  }

  PyAsync barrier_async(std::uint64_t tag) {
    Busy busy(*state_);
    lockstep_async_t* handle = nullptr;
    auto [s, message] =
        call_released(busy.comm(), [&] { return lockstep_comm_barrier_async(busy.comm(), tag, &handle); });
    if (s != LOCKSTEP_OK) fail(s, message);
    return adopt(handle, py::none());
  }

  std::vector<InfoTuple> all_reduce_multiple_with_retry(
      const std::vector<std::tuple<std::uintptr_t, std::uintptr_t, std::uint64_t, int, int, int, std::uint64_t>>& ops,
      std::size_t max_in_flight) {
    Busy busy(*state_);
    std::vector<lockstep_reduce_desc_t> descs;
    descs.reserve(ops.size());
    for (const auto& [src, dst, count, dtype, op, quantization, tag] : ops) {
      descs.push_back(make_desc(src, dst, count, dtype, op, quantization, tag));
    }
    std::vector<lockstep_reduce_info_t> infos(descs.size());
    auto [s, message] = call_released(busy.comm(), [&] {
      return lockstep_comm_all_reduce_multiple_with_retry(busy.comm(), descs.data(), descs.size(), max_in_flight,
                                                          infos.data());
    });
    if (s != LOCKSTEP_OK) fail(s, message);
    std::vector<InfoTuple> out;
    out.reserve(infos.size());
    for (const auto& info : infos) out.push_back(to_tuple(info));
    return out;
  }

  // tensors: (key, address, count, dtype, allow_content_inequality). Returns
  // (revision, bytes_sent, bytes_received, wire_bytes_sent, wire_bytes_received, streams).
  std::tuple<std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t, std::uint32_t> sync_shared_state(
      const std::vector<std::tuple<std::string, std::uintptr_t, std::uint64_t, int, bool>>& tensors,
      std::uint64_t revision, int strategy) {
    Busy busy(*state_);
    std::vector<lockstep_tensor_t> list;
    list.reserve(tensors.size());
    for (const auto& [key, address, count, dtype, allow] : tensors) {
      lockstep_tensor_t t;
      std::memset(&t, 0, sizeof t);
      t.key = key.c_str();  // the strings live in `tensors` for the whole call
      t.data = as_ptr<void>(address);
      t.count = count;
      t.dtype = static_cast<lockstep_dtype_t>(dtype);
      t.device = LOCKSTEP_DEVICE_CPU;
      t.allow_content_inequality = allow ? 1 : 0;
      list.push_back(t);
    }
    lockstep_shared_state_t state;
    state.revision = revision;
    state.tensors = list.data();
    state.count = list.size();
    lockstep_sync_info_t info{};
    auto [s, message] = call_released(busy.comm(), [&] {
      return lockstep_comm_sync_shared_state(busy.comm(), &state, static_cast<lockstep_sync_strategy_t>(strategy),
                                             &info);
    });
    if (s != LOCKSTEP_OK) fail(s, message);
    return {state.revision,         info.bytes_sent,          info.bytes_received,
            info.wire_bytes_sent,   info.wire_bytes_received, info.streams};
  }

  void close() { close_locked(/*release_gil=*/true); }
  bool closed() const { return state_->comm == nullptr; }

  // The torch backend (lockstep.torch) launches collectives on this communicator from
  // its own thread: while it holds the handle the communicator counts as busy, so that
  // close() refuses instead of freeing it under that thread.
  std::uintptr_t borrow_handle() {
    if (state_->comm == nullptr) fail(LOCKSTEP_STATUS_INVALID_USAGE, "INVALID_USAGE: the communicator is closed");
    ++state_->busy;
    return reinterpret_cast<std::uintptr_t>(state_->comm);
  }
  void return_handle() {
    if (state_->busy > 0) --state_->busy;
  }
  std::size_t outstanding() const { return state_->outstanding.size(); }

 private:
  // A launched operation's handle, owned by this communicator until awaited; `keepalive`
  // (the buffers) stays referenced until then.
  PyAsync adopt(lockstep_async_t* handle, py::object keepalive) {
    auto op_state = std::make_shared<AsyncState>();
    op_state->handle = handle;
    op_state->keepalive = std::move(keepalive);
    state_->outstanding.push_back(op_state);
    return PyAsync(state_, op_state);
  }

  template <typename F>
  void simple(F&& body) {
    Busy busy(*state_);
    auto [s, message] = call_released(busy.comm(), [&] { return body(busy.comm()); });
    if (s != LOCKSTEP_OK) fail(s, message);
  }

  void close_locked(bool release_gil) {
    CommState& st = *state_;
    if (st.comm == nullptr) return;
    if (st.busy > 0) {
      fail(LOCKSTEP_STATUS_INVALID_USAGE,
           "INVALID_USAGE: a call on this communicator is still running on another thread; close it from the owning "
           "thread once that call returned");
    }
    lockstep_comm_t* comm = st.comm;
    // Handles that already ended and were launched on this thread: collect their results.
    for (auto& op : st.outstanding) {
      int d = 0;
      lockstep_async_poll(op->handle, &d);
      if (d == 0) continue;
      lockstep_reduce_info_t info{};
      const int s = lockstep_async_wait(op->handle, &info);
      if (s == LOCKSTEP_STATUS_WRONG_THREAD) continue;  // launched on another thread: still ours
      op->status = s;
      op->message = s == LOCKSTEP_OK ? std::string() : message_for(comm, s);
      op->info = info;
      op->handle = nullptr;
      op->finished = true;
      op->keepalive = py::object();
    }
    st.comm = nullptr;  // from here on, every call sees a closed communicator
    if (release_gil) {
      py::gil_scoped_release release;
      lockstep_comm_destroy(comm);  // joins the threads of operations still running
    } else {
      lockstep_comm_destroy(comm);
    }
    for (auto& op : st.outstanding) {
      if (op->finished) continue;
      // Never passed to lockstep_async_wait again (it would use the freed communicator).
      op->handle = nullptr;
      op->finished = true;
      op->status = LOCKSTEP_STATUS_INTERRUPTED;
      op->message = "INTERRUPTED: the communicator was closed before this operation was awaited";
      op->keepalive = py::object();
    }
    st.outstanding.clear();
  }

  std::shared_ptr<CommState> state_;
};

}  // namespace

PYBIND11_MODULE(_lockstep, m) {
  m.doc() = "Low-level binding of the lockstep C API; use the `lockstep` package instead.";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object& factory = error_factory();
      if (factory && !factory.is_none()) {
        py::object exc = factory(e.status, e.message);
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      } else {
        PyErr_SetString(PyExc_RuntimeError, e.message.c_str());
      }
    }
  });

  m.def(
      "_set_error_factory", [](py::object factory) { error_factory() = std::move(factory); },
      "Registers callable(status: int, message: str) -> BaseException used for failed calls.");
  m.def("version_string", [] { return std::string(lockstep_version_string()); });
  m.def("version", [] { return lockstep_version(); });
  m.def("status_string", [](int status) { return std::string(lockstep_status_string(static_cast<lockstep_status_t>(status))); });
  m.def("status_name", [](int status) { return std::string(status_name(status)); });
  m.def("set_log_level", [](int level) {
    const int s = lockstep_set_log_level(static_cast<lockstep_log_level_t>(level));
    if (s != LOCKSTEP_OK) fail(s, plain_message(s) + " (log level must be 0..4)");
  });
  m.def(
      "hash_address",
      [](std::uintptr_t address, std::size_t bytes) {
        char hex[33];
        int s = LOCKSTEP_OK;
        {
          py::gil_scoped_release release;
          s = lockstep_hash(as_ptr<const void>(address), bytes, hex);
        }
        check(s, nullptr);
        return std::string(hex, 32);
      },
      py::arg("address"), py::arg("nbytes"));
  m.def(
      "hash_buffer",
      [](py::buffer buffer) {
        // A contiguous read-only view; raises BufferError for a non-contiguous one.
        Py_buffer view;
        if (PyObject_GetBuffer(buffer.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
        char hex[33];
        int s = LOCKSTEP_OK;
        {
          py::gil_scoped_release release;
          s = lockstep_hash(view.len > 0 ? view.buf : nullptr, static_cast<std::size_t>(view.len), hex);
        }
        PyBuffer_Release(&view);
        check(s, nullptr);
        return std::string(hex, 32);
      },
      py::arg("buffer"));

  py::class_<PyMaster>(m, "Master")
      .def(py::init<const std::string&, std::uint16_t, std::uint32_t, std::uint32_t, std::uint32_t, const std::string&,
                    std::uint32_t, std::uint32_t, const std::string&, const std::string&, bool, std::uint32_t,
                    std::uint32_t, std::uint32_t, std::uint32_t, int, std::uint32_t, std::uint32_t, const std::string&,
                    const std::string&, const std::string&, std::uint32_t, std::uint32_t>(),
           py::arg("host"), py::arg("port"), py::arg("heartbeat_timeout_ms"), py::arg("vote_timeout_ms"),
           py::arg("peers_max"), py::arg("secret_file") = "", py::arg("handshake_timeout_ms") = 0,
           py::arg("pending_handshakes_max") = 0, py::arg("http_listen") = "", py::arg("http_token_file") = "",
           py::arg("http_insecure") = false, py::arg("kv_keys_max") = 0, py::arg("kv_key_bytes_max") = 0,
           py::arg("kv_value_bytes_max") = 0, py::arg("newcomer_timeout_ms") = 0, py::arg("relay_port") = -1,
           py::arg("recovery_window_ms") = 0, py::arg("recovery_quorum") = 0, py::arg("ha_etcd") = "",
           py::arg("ha_key") = "", py::arg("ha_advertise") = "", py::arg("ha_lease_ttl_s") = 0,
           py::arg("resume_hold_ms") = 0)
      .def("run", &PyMaster::run)
      .def("relay_port", &PyMaster::relay_port)
      .def("port", &PyMaster::port)
      .def("http_port", &PyMaster::http_port)
      .def("interrupt", &PyMaster::interrupt)
      .def("wait", &PyMaster::wait)
      .def("close", &PyMaster::close)
      .def_property_readonly("closed", &PyMaster::closed);

  py::class_<PyAsync>(m, "Async").def("done", &PyAsync::done).def("wait", &PyAsync::wait);

  py::class_<PyComm>(m, "Comm")
      .def(py::init<const std::string&, std::uint16_t, std::uint32_t, std::uint32_t, std::int32_t, std::uint32_t,
                    const std::string&, const std::string&, const std::string&, const py::object&, std::uint32_t,
                    std::uint32_t, std::uint32_t, bool, std::uint32_t, const std::string&, bool, std::uint32_t, bool,
                    const std::string&, std::uint32_t>(),
           py::arg("master_host"), py::arg("master_port"), py::arg("group"), py::arg("pool_size"), py::arg("base_port"),
           py::arg("connect_timeout_ms"), py::arg("advertised_host"), py::arg("bind_host"), py::arg("secret_file") = "",
           py::arg("secret") = py::none(), py::arg("inbound_handshake_timeout_ms") = 0,
           py::arg("inbound_handshakes_max") = 0, py::arg("p2p_stall_timeout_ms") = 0,
           py::arg("encrypt_data") = false, py::arg("p2p_streams") = 0, py::arg("tcp_congestion") = "",
           py::arg("check_finite") = false, py::arg("state_compression") = 0, py::arg("inbound") = true,
           py::arg("master_fallbacks") = "", py::arg("failover_timeout_ms") = 0)
      .def("connect", &PyComm::connect)
      .def("update_topology", &PyComm::update_topology)
      .def("optimize_topology", &PyComm::optimize_topology)
      .def("are_peers_pending", &PyComm::are_peers_pending)
      .def("agree", &PyComm::agree, py::arg("flag"))
      .def("agree_value", &PyComm::agree_value, py::arg("value"), py::arg("mode"))
      .def("kv_set", &PyComm::kv_set, py::arg("key"), py::arg("value"))
      .def("kv_read", &PyComm::kv_read, py::arg("key"), py::arg("wait"), py::arg("timeout_ms"))
      .def("kv_delete", &PyComm::kv_delete, py::arg("key"))
      .def("attribute", &PyComm::attribute, py::arg("attribute"))
      .def("rank", &PyComm::rank)
      .def("id", &PyComm::id)
      .def("membership", &PyComm::membership)
      .def("last_error", &PyComm::last_error)
      .def("counters", &PyComm::counters)
      .def("slot_bytes", &PyComm::slot_bytes)
      .def("all_reduce", &PyComm::all_reduce, py::arg("src"), py::arg("dst"), py::arg("count"), py::arg("dtype"),
           py::arg("op"), py::arg("quantization"), py::arg("tag"), py::arg("residual"), py::arg("distribution"))
      .def("all_reduce_async", &PyComm::all_reduce_async, py::arg("src"), py::arg("dst"), py::arg("count"),
           py::arg("dtype"), py::arg("op"), py::arg("quantization"), py::arg("tag"), py::arg("residual"),
           py::arg("distribution"), py::arg("keepalive"))
      .def("broadcast", &PyComm::broadcast, py::arg("buf"), py::arg("count"), py::arg("dtype"), py::arg("root"),
           py::arg("tag"))
      .def("broadcast_async", &PyComm::broadcast_async, py::arg("buf"), py::arg("count"), py::arg("dtype"),
           py::arg("root"), py::arg("tag"), py::arg("keepalive"))
      .def("all_gather", &PyComm::all_gather, py::arg("src"), py::arg("count"), py::arg("dst"), py::arg("dst_capacity"),
           py::arg("dtype"), py::arg("counts"), py::arg("tag"))
      .def("all_gather_async", &PyComm::all_gather_async, py::arg("src"), py::arg("count"), py::arg("dst"),
           py::arg("dst_capacity"), py::arg("dtype"), py::arg("counts"), py::arg("tag"), py::arg("keepalive"))
      .def("reduce_scatter", &PyComm::reduce_scatter, py::arg("src"), py::arg("dst"), py::arg("count_per_rank"),
           py::arg("dtype"), py::arg("op"), py::arg("quantization"), py::arg("tag"))
      .def("reduce_scatter_async", &PyComm::reduce_scatter_async, py::arg("src"), py::arg("dst"),
           py::arg("count_per_rank"), py::arg("dtype"), py::arg("op"), py::arg("quantization"), py::arg("tag"),
           py::arg("keepalive"))
      .def("barrier", &PyComm::barrier, py::arg("tag"))
      .def("barrier_async", &PyComm::barrier_async, py::arg("tag"))
      .def("all_reduce_multiple_with_retry", &PyComm::all_reduce_multiple_with_retry, py::arg("ops"),
           py::arg("max_in_flight"))
      .def("sync_shared_state", &PyComm::sync_shared_state, py::arg("tensors"), py::arg("revision"),
           py::arg("strategy"))
      .def("close", &PyComm::close)
      .def("_borrow_handle", &PyComm::borrow_handle)
      .def("_return_handle", &PyComm::return_handle)
      .def_property_readonly("closed", &PyComm::closed)
      .def_property_readonly("outstanding", &PyComm::outstanding);
}
