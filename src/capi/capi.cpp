// The C API: opaque handles over the C++ master and communicator. Nothing throws
// across this boundary; every entry point validates its arguments first.
#include <lockstep/lockstep.h>

#include "common/log.h"
#include "master/master_server.h"
#include "peer/communicator.h"
#include "state/hash.h"

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <random>
#include <string>

struct lockstep_master {
  std::unique_ptr<lockstep::master::MasterServer> server;
};

struct lockstep_comm {
  std::unique_ptr<lockstep::peer::Communicator> comm;
  // Cleared when the communicator is destroyed; async handles share it.
  std::shared_ptr<bool> alive = std::make_shared<bool>(true);
};

struct lockstep_async {
  // The communicator may be destroyed first: the handle keeps the operation alive and
  // knows from `alive` not to touch the communicator any more.
  lockstep::peer::Communicator* comm = nullptr;
  std::shared_ptr<lockstep::peer::AsyncReduce> op;
  std::shared_ptr<bool> alive;
};

namespace {

template <typename F>
lockstep_status_t guarded(F&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    LOG_ERROR("capi", "out of memory");
    return LOCKSTEP_STATUS_INTERNAL_ERROR;
  } catch (const std::exception& e) {
    LOG_ERROR("capi", "unexpected exception: " << e.what());
    return LOCKSTEP_STATUS_INTERNAL_ERROR;
  }
}

// The value a C caller stored in an enum parameter or field, read as an int: C allows
// any int there, but loading an out-of-range value as a C++ enum is undefined.
template <typename E>
int raw(const E& value) {
  static_assert(sizeof(E) == sizeof(int));
  int out = 0;
  std::memcpy(&out, &value, sizeof out);
  return out;
}

// The run secret's key from a file, from bytes, or from the file named by
// LOCKSTEP_SECRET_FILE; no key (nullopt) when none is given.
lockstep::Result<std::optional<lockstep::security::Key>> load_secret(const char* file, const void* bytes, size_t size) {
  std::string path = file != nullptr ? file : "";
  if (path.empty() && bytes == nullptr) {
    const char* env = std::getenv("LOCKSTEP_SECRET_FILE");
    if (env != nullptr) path = env;
  }
  if (!path.empty()) {
    auto key = lockstep::security::load_secret_file(path);
    if (!key.is_ok()) return key.status();
    return std::optional<lockstep::security::Key>(key.value());
  }
  if (bytes == nullptr) return std::optional<lockstep::security::Key>();
  auto key = lockstep::security::derive_secret_key(std::string_view(static_cast<const char*>(bytes), size));
  if (!key.is_ok()) return key.status();
  return std::optional<lockstep::security::Key>(key.value());
}

}  // namespace

extern "C" {

uint32_t lockstep_version(void) { return LOCKSTEP_VERSION_HEX; }

const char* lockstep_version_string(void) {
#define LOCKSTEP_STR2(x) #x
#define LOCKSTEP_STR(x) LOCKSTEP_STR2(x)
  return LOCKSTEP_STR(LOCKSTEP_VERSION_MAJOR) "." LOCKSTEP_STR(LOCKSTEP_VERSION_MINOR) "." LOCKSTEP_STR(
      LOCKSTEP_VERSION_PATCH);
}

lockstep_status_t lockstep_master_config_init(lockstep_master_config_t* config) {
  if (config == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  std::memset(config, 0, sizeof *config);
  config->listen_port = LOCKSTEP_DEFAULT_MASTER_PORT;
  config->heartbeat_timeout_ms = lockstep::limits::kHeartbeatTimeoutMsDefault;
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_master_create(const lockstep_master_config_t* config, lockstep_master_t** out_master) {
  if (config == nullptr || out_master == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    lockstep::master::Options options;
    if (config->listen_host != nullptr && config->listen_host[0] != '\0') options.listen_host = config->listen_host;
    options.listen_port = config->listen_port;
    const uint32_t heartbeat = config->heartbeat_timeout_ms == 0 ? lockstep::limits::kHeartbeatTimeoutMsDefault
                                                                 : config->heartbeat_timeout_ms;
    if (heartbeat < lockstep::limits::kHeartbeatTimeoutMsMin || heartbeat > lockstep::limits::kHeartbeatTimeoutMsMax) {
      return LOCKSTEP_STATUS_INVALID_ARGUMENT;
    }
    options.coordinator.heartbeat_timeout_ms = heartbeat;
    options.coordinator.vote_timeout_ms = config->vote_timeout_ms;
    if (config->peers_max != 0) options.coordinator.peers_max = config->peers_max;
    if (config->handshake_timeout_ms != 0) options.coordinator.handshake_timeout_ms = config->handshake_timeout_ms;
    if (config->pending_handshakes_max != 0) options.coordinator.pending_handshakes_max = config->pending_handshakes_max;
    auto secret = load_secret(config->secret_file, nullptr, 0);
    if (!secret.is_ok()) {
      LOG_ERROR("capi", "lockstep_master_create: " << secret.status().to_string());
      return secret.status().code();
    }
    options.secret = secret.value();
    std::random_device random;
    options.coordinator.instance_nonce = (static_cast<uint64_t>(random()) << 32) | random();
    auto* master = new lockstep_master;
    master->server = std::make_unique<lockstep::master::MasterServer>(std::move(options));
    *out_master = master;
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_master_run(lockstep_master_t* master) {
  if (master == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    lockstep::Status s = master->server->start();
    if (!s.is_ok()) LOG_ERROR("master", s.to_string());
    return s.code();
  });
}

lockstep_status_t lockstep_master_port(const lockstep_master_t* master, uint16_t* out_port) {
  if (master == nullptr || out_port == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  if (!master->server->running()) return LOCKSTEP_STATUS_INVALID_USAGE;
  *out_port = master->server->port();
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_master_interrupt(lockstep_master_t* master) {
  if (master == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  master->server->interrupt();
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_master_await(lockstep_master_t* master) {
  if (master == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  master->server->wait();
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_master_destroy(lockstep_master_t* master) {
  delete master;  // the server's destructor interrupts and joins
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_comm_config_init(lockstep_comm_config_t* config) {
  if (config == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  std::memset(config, 0, sizeof *config);
  config->master_host = "127.0.0.1";
  config->master_port = LOCKSTEP_DEFAULT_MASTER_PORT;
  config->p2p_pool_size = 1;
  config->base_port = -1;
  config->connect_timeout_ms = lockstep::limits::kConnectTimeoutMsDefault;
  config->p2p_stall_timeout_ms = lockstep::limits::kP2PStallTimeoutMsDefault;
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_comm_create(const lockstep_comm_config_t* config, lockstep_comm_t** out_comm) {
  if (config == nullptr || out_comm == nullptr || config->master_host == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    lockstep::peer::Options options;
    options.master_host = config->master_host;
    options.master_port = config->master_port == 0 ? LOCKSTEP_DEFAULT_MASTER_PORT : config->master_port;
    options.peer_group = config->peer_group;
    options.p2p_pool_size = config->p2p_pool_size == 0 ? 1 : config->p2p_pool_size;
    options.base_port = config->base_port;
    options.connect_timeout_ms = config->connect_timeout_ms == 0 ? lockstep::limits::kConnectTimeoutMsDefault
                                                                 : config->connect_timeout_ms;
    if (config->advertised_host != nullptr) options.advertised_host = config->advertised_host;
    if (config->bind_host != nullptr) options.bind_host = config->bind_host;
    options.p2p_stall_timeout_ms = config->p2p_stall_timeout_ms == 0 ? lockstep::limits::kP2PStallTimeoutMsDefault
                                                                     : config->p2p_stall_timeout_ms;
    if (config->inbound_handshake_timeout_ms != 0) options.inbound_handshake_timeout_ms = config->inbound_handshake_timeout_ms;
    if (config->inbound_handshakes_max != 0) options.inbound_handshakes_max = config->inbound_handshakes_max;
    if (config->secret == nullptr && config->secret_bytes != 0) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
    auto secret = load_secret(config->secret_file, config->secret, config->secret_bytes);
    if (!secret.is_ok()) {
      LOG_ERROR("capi", "lockstep_comm_create: " << secret.status().to_string());
      return secret.status().code();
    }
    options.secret = secret.value();
    options.encrypt_data = config->encrypt_data != 0;
    auto created = lockstep::peer::Communicator::create(options);
    if (!created.is_ok()) {
      LOG_ERROR("capi", "lockstep_comm_create: " << created.status().to_string());
      return created.status().code();
    }
    auto* comm = new lockstep_comm;
    comm->comm = std::move(created.value());
    *out_comm = comm;
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_comm_connect(lockstep_comm_t* comm) {
  if (comm == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] { return comm->comm->connect().code(); });
}

lockstep_status_t lockstep_comm_update_topology(lockstep_comm_t* comm) {
  if (comm == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] { return comm->comm->update_topology().code(); });
}

lockstep_status_t lockstep_comm_optimize_topology(lockstep_comm_t* comm) {
  if (comm == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] { return comm->comm->optimize_topology().code(); });
}

lockstep_status_t lockstep_comm_are_peers_pending(lockstep_comm_t* comm, int* out_pending) {
  if (comm == nullptr || out_pending == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    auto r = comm->comm->are_peers_pending();
    if (!r.is_ok()) return r.status().code();
    *out_pending = r.value() ? 1 : 0;
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_comm_agree(lockstep_comm_t* comm, int flag, int* out_result) {
  if (comm == nullptr || out_result == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    auto r = comm->comm->agree(flag != 0);
    if (!r.is_ok()) return r.status().code();
    *out_result = r.value() ? 1 : 0;
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_comm_get_attribute(const lockstep_comm_t* comm, lockstep_attribute_t attribute,
                                              int64_t* out_value) {
  if (comm == nullptr || out_value == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  auto a = comm->comm->attributes();
  if (!a.is_ok()) return a.status().code();
  switch (raw(attribute)) {
    case LOCKSTEP_ATTR_GLOBAL_WORLD_SIZE: *out_value = a.value().global_world_size; return LOCKSTEP_OK;
    case LOCKSTEP_ATTR_PEER_GROUP_WORLD_SIZE: *out_value = a.value().group_world_size; return LOCKSTEP_OK;
    case LOCKSTEP_ATTR_NUM_DISTINCT_PEER_GROUPS: *out_value = a.value().num_groups; return LOCKSTEP_OK;
    case LOCKSTEP_ATTR_LARGEST_PEER_GROUP_WORLD_SIZE: *out_value = a.value().largest_group_size; return LOCKSTEP_OK;
  }
  return LOCKSTEP_STATUS_INVALID_ARGUMENT;
}

lockstep_status_t lockstep_comm_get_membership(const lockstep_comm_t* comm, lockstep_member_t* out_members,
                                               size_t capacity, size_t* out_count) {
  if (comm == nullptr || out_count == nullptr || (capacity > 0 && out_members == nullptr)) {
    return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  }
  return guarded([&] {
    auto view = comm->comm->membership();
    if (!view.is_ok()) return view.status().code();
    *out_count = view.value().size();
    if (capacity < view.value().size()) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
    for (size_t i = 0; i < view.value().size(); ++i) {
      const auto& m = view.value()[i];
      lockstep_member_t& out = out_members[i];
      std::memset(&out, 0, sizeof out);
      for (int b = 0; b < 8; ++b) {
        out.id[b] = static_cast<uint8_t>(m.id.hi >> (56 - 8 * b));
        out.id[8 + b] = static_cast<uint8_t>(m.id.lo >> (56 - 8 * b));
      }
      out.rank = static_cast<uint32_t>(i);
      std::strncpy(out.host, m.host.c_str(), sizeof out.host - 1);
      out.p2p_port = m.p2p_port;
      out.shared_state_port = m.shared_state_port;
      out.benchmark_port = m.benchmark_port;
    }
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_comm_get_rank(const lockstep_comm_t* comm, uint32_t* out_rank) {
  if (comm == nullptr || out_rank == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  auto r = comm->comm->rank();
  if (!r.is_ok()) return r.status().code();
  *out_rank = r.value();
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_comm_get_id(const lockstep_comm_t* comm, uint8_t out_id[16]) {
  if (comm == nullptr || out_id == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  const auto id = comm->comm->id();
  if (id.is_nil()) return LOCKSTEP_STATUS_NOT_INITIALIZED;
  for (int b = 0; b < 8; ++b) {
    out_id[b] = static_cast<uint8_t>(id.hi >> (56 - 8 * b));
    out_id[8 + b] = static_cast<uint8_t>(id.lo >> (56 - 8 * b));
  }
  return LOCKSTEP_OK;
}

const char* lockstep_comm_last_error(const lockstep_comm_t* comm) {
  if (comm == nullptr) return "";
  thread_local std::string copy;
  copy = comm->comm->last_error();
  return copy.c_str();
}

lockstep_status_t lockstep_comm_get_counters(const lockstep_comm_t* comm, lockstep_counters_t* out) {
  constexpr std::size_t kHeaderBytes = offsetof(lockstep_counters_t, all_reduce_bytes_sent);
  if (comm == nullptr || out == nullptr || out->struct_size < kHeaderBytes) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  const lockstep::peer::Counters c = comm->comm->counters();
  lockstep_counters_t full{};
  full.struct_size = static_cast<uint32_t>(std::min<std::size_t>(out->struct_size, sizeof full));
  full.version = LOCKSTEP_COUNTERS_VERSION;
  full.all_reduce_bytes_sent = c.all_reduce_bytes_sent;
  full.all_reduce_bytes_received = c.all_reduce_bytes_received;
  full.sync_bytes_sent = c.sync_bytes_sent;
  full.sync_bytes_received = c.sync_bytes_received;
  full.operations_started = c.operations_started;
  full.operations_succeeded = c.operations_succeeded;
  full.operations_failed = c.operations_failed;
  full.all_reduces_started = c.all_reduces_started;
  full.all_reduces_succeeded = c.all_reduces_succeeded;
  full.all_reduces_failed = c.all_reduces_failed;
  full.syncs_started = c.syncs_started;
  full.syncs_succeeded = c.syncs_succeeded;
  full.syncs_failed = c.syncs_failed;
  full.retries = c.retries;
  full.connect_us = c.connect_us;
  full.update_topology_us = c.update_topology_us;
  full.optimize_topology_us = c.optimize_topology_us;
  full.sync_us = c.sync_us;
  full.all_reduce_us = c.all_reduce_us;
  // Only the bytes the caller's struct has (an older caller's struct is shorter).
  std::memcpy(out, &full, full.struct_size);
  return LOCKSTEP_OK;
}

namespace {

bool valid_descriptor(const lockstep_reduce_desc_t& d) {
  return raw(d.dtype) >= LOCKSTEP_U8 && raw(d.dtype) <= LOCKSTEP_F64 && raw(d.op) >= LOCKSTEP_SUM &&
         raw(d.op) <= LOCKSTEP_MIN && raw(d.quantization) >= LOCKSTEP_QUANT_NONE &&
         raw(d.quantization) <= LOCKSTEP_QUANT_ZERO_POINT_U8;
}

lockstep::peer::ReduceDescriptor to_descriptor(const lockstep_reduce_desc_t& d) {
  lockstep::peer::ReduceDescriptor out;
  out.src = d.src;
  out.dst = d.dst;
  out.count = d.count;
  out.dtype = d.dtype;
  out.op = d.op;
  out.quantization = d.quantization;
  out.tag = d.tag;
  return out;
}

void to_info(const lockstep::peer::ReduceInfo& in, lockstep_reduce_info_t* out) {
  if (out == nullptr) return;
  out->world_size = in.world_size;
  out->bytes_sent = in.bytes_sent;
  out->bytes_received = in.bytes_received;
}

}  // namespace

lockstep_status_t lockstep_comm_all_reduce(lockstep_comm_t* comm, const lockstep_reduce_desc_t* desc,
                                           lockstep_reduce_info_t* out_info) {
  if (comm == nullptr || desc == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    if (!valid_descriptor(*desc)) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
    auto r = comm->comm->all_reduce(to_descriptor(*desc));
    if (!r.is_ok()) return r.status().code();
    to_info(r.value(), out_info);
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_comm_all_reduce_async(lockstep_comm_t* comm, const lockstep_reduce_desc_t* desc,
                                                 lockstep_async_t** out_handle) {
  if (comm == nullptr || desc == nullptr || out_handle == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    if (!valid_descriptor(*desc)) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
    auto r = comm->comm->all_reduce_async(to_descriptor(*desc));
    if (!r.is_ok()) return r.status().code();
    *out_handle = new lockstep_async{comm->comm.get(), r.value(), comm->alive};
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_async_poll(const lockstep_async_t* handle, int* out_done) {
  if (handle == nullptr || out_done == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  *out_done = handle->op->done() ? 1 : 0;
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_async_wait(lockstep_async_t* handle, lockstep_reduce_info_t* out_info) {
  if (handle == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  if (!*handle->alive) {
    // The communicator is gone; its destruction ended and joined the operation.
    delete handle;
    return LOCKSTEP_STATUS_INTERRUPTED;
  }
  return guarded([&] {
    auto r = handle->comm->await(handle->op);
    if (!r.is_ok() && r.status().code() == LOCKSTEP_STATUS_WRONG_THREAD) return r.status().code();  // handle kept
    delete handle;
    if (!r.is_ok()) return r.status().code();
    to_info(r.value(), out_info);
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_comm_all_reduce_multiple_with_retry(lockstep_comm_t* comm, const lockstep_reduce_desc_t* descs,
                                                               size_t count, size_t max_in_flight,
                                                               lockstep_reduce_info_t* out_infos) {
  if (comm == nullptr || (count > 0 && descs == nullptr)) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    std::vector<lockstep::peer::ReduceDescriptor> list;
    for (size_t i = 0; i < count; ++i) {
      if (!valid_descriptor(descs[i])) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
      list.push_back(to_descriptor(descs[i]));
    }
    std::vector<lockstep::peer::ReduceInfo> infos;
    lockstep::Status s = comm->comm->all_reduce_multiple_with_retry(list, max_in_flight, &infos);
    if (!s.is_ok()) return s.code();
    for (size_t i = 0; out_infos != nullptr && i < count; ++i) to_info(infos[i], &out_infos[i]);
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_comm_sync_shared_state(lockstep_comm_t* comm, lockstep_shared_state_t* state,
                                                  lockstep_sync_strategy_t strategy, lockstep_sync_info_t* out_info) {
  if (comm == nullptr || state == nullptr || (state->count > 0 && state->tensors == nullptr)) {
    return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  }
  if (raw(strategy) < LOCKSTEP_SYNC_ENFORCE_POPULAR || raw(strategy) > LOCKSTEP_SYNC_SEND_ONLY) {
    return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  }
  return guarded([&] {
    std::vector<lockstep::peer::SharedTensor> tensors;
    for (size_t i = 0; i < state->count; ++i) {
      const lockstep_tensor_t& t = state->tensors[i];
      if (t.key == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
      if (raw(t.dtype) < LOCKSTEP_U8 || raw(t.dtype) > LOCKSTEP_F64 || raw(t.device) != LOCKSTEP_DEVICE_CPU) {
        return LOCKSTEP_STATUS_INVALID_ARGUMENT;
      }
      tensors.push_back(lockstep::peer::SharedTensor{std::string(t.key, strnlen(t.key, 256)), t.data, t.count, t.dtype,
                                                     t.allow_content_inequality != 0});
    }
    std::uint64_t revision = state->revision;
    auto r = comm->comm->sync_shared_state(tensors, &revision, static_cast<lockstep::proto::SyncStrategy>(strategy));
    if (!r.is_ok()) return r.status().code();
    state->revision = revision;
    if (out_info != nullptr) {
      out_info->bytes_sent = r.value().bytes_sent;
      out_info->bytes_received = r.value().bytes_received;
    }
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_hash(const void* data, size_t bytes, char out_hex[33]) {
  if ((data == nullptr && bytes > 0) || out_hex == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    const std::string hex = lockstep::state::hash_bytes(data, bytes).to_hex();
    std::memcpy(out_hex, hex.c_str(), hex.size() + 1);
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_comm_destroy(lockstep_comm_t* comm) {
  if (comm != nullptr) *comm->alive = false;
  delete comm;
  return LOCKSTEP_OK;
}

}  // extern "C"
