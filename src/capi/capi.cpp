// The C API: opaque handles over the C++ master and communicator. Nothing throws
// across this boundary; every entry point validates its arguments first.
#include <lockstep/lockstep.h>

#include "common/log.h"
#include "master/etcd.h"
#include "master/http_server.h"
#include "master/master_server.h"
#include "peer/communicator.h"
#include "state/hash.h"
#include "transport/socket.h"

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
  // The HTTP endpoint (config http_listen); declared after the server, so that it is
  // stopped first.
  std::optional<std::pair<std::string, std::uint16_t>> http_address;
  lockstep::master::HttpOptions http_options;
  std::unique_ptr<lockstep::master::HttpServer> http;
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

#define LOCKSTEP_STR2(x) #x
#define LOCKSTEP_STR(x) LOCKSTEP_STR2(x)

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

// The library reads and writes a public struct only as far as the caller's sizeof of it
// (docs/abi.md): the configs carry it in struct_size, the per-call structs get it as an
// argument of the *_sized entry points. A size is possible if some version of the struct
// can have it: it holds the struct's first field (after struct_size, if it has one), is a
// multiple of the struct's alignment (every sizeof is), and stays below a bound that no
// struct of a few fields reaches.
constexpr std::size_t kStructSizeMax = 65536;

// The end of a struct's first field: the smallest size a version of it may have.
#define LOCKSTEP_FIELD_END(T, field) (offsetof(T, field) + sizeof(T::field))

template <typename T>
lockstep::Status check_struct_size(std::size_t size, std::size_t first_field_end, const char* size_name) {
  if (size >= first_field_end && size <= kStructSizeMax && size % alignof(T) == 0) return lockstep::Status::ok();
  return lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                          std::string(size_name) + " is " + std::to_string(size) +
                              ", which no version of the struct has (at least " + std::to_string(first_field_end) +
                              ", at most " + std::to_string(kStructSizeMax) + ", a multiple of " +
                              std::to_string(alignof(T)) + ")");
}

// Reads the caller's struct of `size` bytes over `out`, which holds the defaults: the
// fields beyond the caller's size keep them. A caller built against a newer header may
// pass more bytes than this library knows, as long as they are all zero (its new fields
// left at their defaults); a set one is refused, not ignored.
template <typename T>
lockstep::Status read_prefix(const void* in, std::size_t size, std::size_t first_field_end, const char* size_name, T& out) {
  lockstep::Status valid = check_struct_size<T>(size, first_field_end, size_name);
  if (!valid.is_ok()) return valid;
  const auto* bytes = static_cast<const unsigned char*>(in);
  for (std::size_t i = sizeof(T); i < size; ++i) {
    if (bytes[i] != 0) {
      return lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                              std::string(size_name) + " is " + std::to_string(size) + " but this liblockstep " +
                                  LOCKSTEP_STR(LOCKSTEP_VERSION_MAJOR) "." LOCKSTEP_STR(LOCKSTEP_VERSION_MINOR) " knows " +
                                  std::to_string(sizeof(T)) + " bytes of the struct, and byte " + std::to_string(i) +
                                  " is set: a field of a newer lockstep.h that this library does not have");
    }
  }
  std::memcpy(&out, in, std::min(size, sizeof(T)));
  return lockstep::Status::ok();
}

// Writes the first `size` bytes of the caller's struct: those this library knows from
// `value`, zeros beyond them (a newer header's fields, whose zero is their default).
template <typename T>
void write_prefix(void* out, std::size_t size, const T& value) {
  std::memcpy(out, &value, std::min(size, sizeof value));
  if (size > sizeof value) std::memset(static_cast<unsigned char*>(out) + sizeof value, 0, size - sizeof value);
}

// The configs: struct_size is the caller's size; read into a struct of this library's.
template <typename T>
lockstep::Status read_config(const T* in, std::size_t first_field_end, const char* size_name, T& out) {
  lockstep::Status read = read_prefix(in, in->struct_size, first_field_end, size_name, out);
  out.struct_size = static_cast<uint32_t>(sizeof(T));
  return read;
}

template <typename T>
void write_config(T* out, T defaults, std::size_t size) {
  defaults.struct_size = static_cast<uint32_t>(size);
  write_prefix(out, size, defaults);
}

// Logs why a call was refused and returns its code.
lockstep_status_t refuse(const char* function, const lockstep::Status& status) {
  LOG_ERROR("capi", function << ": " << status.to_string());
  return status.code();
}

lockstep_master_config_t master_config_defaults() {
  lockstep_master_config_t config{};
  config.struct_size = sizeof config;
  config.listen_port = LOCKSTEP_DEFAULT_MASTER_PORT;
  config.heartbeat_timeout_ms = lockstep::limits::kHeartbeatTimeoutMsDefault;
  return config;
}

lockstep_comm_config_t comm_config_defaults() {
  lockstep_comm_config_t config{};
  config.struct_size = sizeof config;
  config.master_host = "127.0.0.1";
  config.master_port = LOCKSTEP_DEFAULT_MASTER_PORT;
  config.p2p_pool_size = 1;
  config.base_port = -1;
  config.connect_timeout_ms = lockstep::limits::kConnectTimeoutMsDefault;
  config.p2p_stall_timeout_ms = lockstep::limits::kP2PStallTimeoutMsDefault;
  config.failover_timeout_ms = lockstep::limits::kFailoverTimeoutMsDefault;
  return config;
}

constexpr std::size_t kMasterConfigFirstFieldEnd = LOCKSTEP_FIELD_END(lockstep_master_config_t, listen_host);
constexpr std::size_t kCommConfigFirstFieldEnd = LOCKSTEP_FIELD_END(lockstep_comm_config_t, master_host);
constexpr std::size_t kMemberFirstFieldEnd = LOCKSTEP_FIELD_END(lockstep_member_t, id);
constexpr std::size_t kDescFirstFieldEnd = LOCKSTEP_FIELD_END(lockstep_reduce_desc_t, src);
constexpr std::size_t kReduceInfoFirstFieldEnd = LOCKSTEP_FIELD_END(lockstep_reduce_info_t, world_size);
constexpr std::size_t kStateFirstFieldEnd = LOCKSTEP_FIELD_END(lockstep_shared_state_t, revision);
constexpr std::size_t kTensorFirstFieldEnd = LOCKSTEP_FIELD_END(lockstep_tensor_t, key);
constexpr std::size_t kSyncInfoFirstFieldEnd = LOCKSTEP_FIELD_END(lockstep_sync_info_t, bytes_sent);

}  // namespace

extern "C" {

uint32_t lockstep_version(void) { return LOCKSTEP_VERSION_HEX; }

const char* lockstep_version_string(void) {
  return LOCKSTEP_STR(LOCKSTEP_VERSION_MAJOR) "." LOCKSTEP_STR(LOCKSTEP_VERSION_MINOR) "." LOCKSTEP_STR(
      LOCKSTEP_VERSION_PATCH);
}

lockstep_status_t lockstep_master_config_init_sized(lockstep_master_config_t* config, size_t struct_size) {
  if (config == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  lockstep::Status valid =
      check_struct_size<lockstep_master_config_t>(struct_size, kMasterConfigFirstFieldEnd, "lockstep_master_config_t.struct_size");
  if (!valid.is_ok()) return refuse("lockstep_master_config_init", valid);
  write_config(config, master_config_defaults(), struct_size);
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_master_create(const lockstep_master_config_t* caller_config, lockstep_master_t** out_master) {
  if (caller_config == nullptr || out_master == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    lockstep_master_config_t full = master_config_defaults();
    lockstep::Status read = read_config(caller_config, kMasterConfigFirstFieldEnd, "lockstep_master_config_t.struct_size", full);
    if (!read.is_ok()) return refuse("lockstep_master_create", read);
    const lockstep_master_config_t* config = &full;
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
    using lockstep::limits::kKvKeysMaxLimit, lockstep::limits::kKvKeyBytesMaxLimit, lockstep::limits::kKvValueBytesMaxLimit;
    if (config->kv_keys_max > kKvKeysMaxLimit || config->kv_key_bytes_max > kKvKeyBytesMaxLimit ||
        config->kv_value_bytes_max > kKvValueBytesMaxLimit) {
      return refuse("lockstep_master_create",
                    lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                                     "kv_keys_max, kv_key_bytes_max or kv_value_bytes_max above its maximum (" +
                                         std::to_string(kKvKeysMaxLimit) + ", " + std::to_string(kKvKeyBytesMaxLimit) +
                                         ", " + std::to_string(kKvValueBytesMaxLimit) + ")"));
    }
    if (config->newcomer_timeout_ms != 0) {
      if (config->newcomer_timeout_ms < lockstep::limits::kNewcomerTimeoutMsMin ||
          config->newcomer_timeout_ms > lockstep::limits::kNewcomerTimeoutMsMax) {
        return refuse("lockstep_master_create",
                      lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                                       "newcomer_timeout_ms is " + std::to_string(config->newcomer_timeout_ms) +
                                           ", outside " + std::to_string(lockstep::limits::kNewcomerTimeoutMsMin) +
                                           ".." + std::to_string(lockstep::limits::kNewcomerTimeoutMsMax)));
      }
      options.coordinator.newcomer_timeout_ms = config->newcomer_timeout_ms;
    }
    if (config->kv_keys_max != 0) options.coordinator.kv.keys_max = config->kv_keys_max;
    if (config->kv_key_bytes_max != 0) options.coordinator.kv.key_bytes_max = config->kv_key_bytes_max;
    if (config->kv_value_bytes_max != 0) options.coordinator.kv.value_bytes_max = config->kv_value_bytes_max;
    if (config->relay_port > 0xffff) {
      return refuse("lockstep_master_create", lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                                                               "relay_port is " + std::to_string(config->relay_port) +
                                                                   ", above 65535"));
    }
    if (config->relay != 0) options.relay_port = static_cast<std::uint16_t>(config->relay_port);
    if (config->recovery_window_ms != 0) options.coordinator.recovery_window_ms = config->recovery_window_ms;
    options.coordinator.recovery_quorum = config->recovery_quorum;
    if (config->resume_hold_ms > lockstep::limits::kResumeHoldMsMax) {
      return refuse("lockstep_master_create",
                    lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                                     "resume_hold_ms is " + std::to_string(config->resume_hold_ms) + ", above " +
                                         std::to_string(lockstep::limits::kResumeHoldMsMax)));
    }
    options.coordinator.resume_hold_ms = config->resume_hold_ms;
    const auto c_string = [](const char* value) { return value == nullptr ? std::string() : std::string(value); };
    if (!c_string(config->ha_etcd).empty()) {
      lockstep::master::EtcdOptions etcd;
      etcd.endpoints = lockstep::master::split_endpoints(config->ha_etcd);
      if (!c_string(config->ha_key).empty()) etcd.key = config->ha_key;
      if (config->ha_lease_ttl_s != 0) etcd.lease_ttl_s = config->ha_lease_ttl_s;
      if (auto checked = lockstep::master::check_etcd_options(etcd); !checked.is_ok()) {
        return refuse("lockstep_master_create", checked);
      }
      options.advertise = c_string(config->ha_advertise);
      if (!options.advertise.empty() && (!lockstep::transport::split_host_port(options.advertise) ||
                                         options.advertise.size() > lockstep::limits::kHaAdvertiseBytesMax)) {
        return refuse("lockstep_master_create",
                      lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                                       "ha_advertise must be HOST:PORT or [IPV6]:PORT of at most " +
                                           std::to_string(lockstep::limits::kHaAdvertiseBytesMax) + " bytes"));
      }
      options.election = lockstep::master::make_etcd_election(std::move(etcd));
    } else if (!c_string(config->ha_key).empty() || !c_string(config->ha_advertise).empty() || config->ha_lease_ttl_s != 0) {
      return refuse("lockstep_master_create", lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                                                               "ha_key, ha_advertise or ha_lease_ttl_s set without ha_etcd"));
    }
    auto secret = load_secret(config->secret_file, nullptr, 0);
    if (!secret.is_ok()) {
      LOG_ERROR("capi", "lockstep_master_create: " << secret.status().to_string());
      return secret.status().code();
    }
    options.secret = secret.value();
    std::optional<std::pair<std::string, std::uint16_t>> http_address;
    lockstep::master::HttpOptions http_options;
    if (config->http_listen != nullptr && config->http_listen[0] != '\0') {
      const std::string text = config->http_listen;
      http_address = lockstep::transport::split_host_port(text);
      if (!http_address) {
        return refuse("lockstep_master_create",
                      lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                                       "http_listen must be HOST:PORT or [IPV6]:PORT, got '" + text + "'"));
      }
      if (config->http_token_file != nullptr && config->http_token_file[0] != '\0') {
        auto token = lockstep::security::load_token_file(config->http_token_file);
        if (!token.is_ok()) return refuse("lockstep_master_create", token.status());
        http_options.token = token.value();
      }
      http_options.insecure = config->http_insecure != 0;
      if (http_options.token.empty() && !http_options.insecure && !lockstep::master::is_loopback_host(http_address->first)) {
        return refuse("lockstep_master_create",
                      lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                                       "http_listen " + text + " is not a loopback address: it needs http_token_file "
                                       "(or http_insecure)"));
      }
    } else if (config->http_token_file != nullptr && config->http_token_file[0] != '\0') {
      return refuse("lockstep_master_create", lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                                                               "http_token_file is set without http_listen"));
    }
    std::random_device random;
    options.coordinator.instance_nonce = (static_cast<uint64_t>(random()) << 32) | random();
    auto* master = new lockstep_master;
    master->server = std::make_unique<lockstep::master::MasterServer>(std::move(options));
    master->http_address = std::move(http_address);
    master->http_options = std::move(http_options);
    *out_master = master;
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_master_run(lockstep_master_t* master) {
  if (master == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    if (master->http) return refuse("lockstep_master_run", lockstep::Status(LOCKSTEP_STATUS_INVALID_USAGE, "already running"));
    lockstep::Status s = master->server->start();
    if (!s.is_ok()) {
      LOG_ERROR("master", s.to_string());
      return s.code();
    }
    if (master->http_address) {
      auto http = std::make_unique<lockstep::master::HttpServer>(*master->server, master->http_options);
      s = http->start(master->http_address->first, master->http_address->second);
      if (!s.is_ok()) {
        LOG_ERROR("master", s.to_string());
        master->server->interrupt();
        master->server->wait();
        return static_cast<lockstep_status_t>(LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED);
      }
      LOG_INFO("master", "http listening on " << master->http_address->first << ":" << http->port()
                                              << (master->http_options.token.empty() ? "" : " (access token required)"));
      master->http = std::move(http);
    }
    return static_cast<lockstep_status_t>(LOCKSTEP_OK);
  });
}

lockstep_status_t lockstep_master_http_port(const lockstep_master_t* master, uint16_t* out_port) {
  if (master == nullptr || out_port == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  if (!master->server->running() || !master->http) return LOCKSTEP_STATUS_INVALID_USAGE;
  *out_port = master->http->port();
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_master_relay_port(const lockstep_master_t* master, uint16_t* out_port) {
  if (master == nullptr || out_port == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  if (!master->server->running() || master->server->relay_port() == 0) return LOCKSTEP_STATUS_INVALID_USAGE;
  *out_port = master->server->relay_port();
  return LOCKSTEP_OK;
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
  if (master->http) master->http->stop();
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_master_destroy(lockstep_master_t* master) {
  delete master;  // the server's destructor interrupts and joins
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_comm_config_init_sized(lockstep_comm_config_t* config, size_t struct_size) {
  if (config == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  lockstep::Status valid =
      check_struct_size<lockstep_comm_config_t>(struct_size, kCommConfigFirstFieldEnd, "lockstep_comm_config_t.struct_size");
  if (!valid.is_ok()) return refuse("lockstep_comm_config_init", valid);
  write_config(config, comm_config_defaults(), struct_size);
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_comm_create(const lockstep_comm_config_t* caller_config, lockstep_comm_t** out_comm) {
  if (caller_config == nullptr || out_comm == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    lockstep_comm_config_t full = comm_config_defaults();
    lockstep::Status read = read_config(caller_config, kCommConfigFirstFieldEnd, "lockstep_comm_config_t.struct_size", full);
    if (!read.is_ok()) return refuse("lockstep_comm_create", read);
    const lockstep_comm_config_t* config = &full;
    if (config->master_host == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
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
    options.p2p_streams = config->p2p_streams;
    if (config->tcp_congestion != nullptr) options.tcp_congestion = config->tcp_congestion;
    options.check_finite = config->check_finite != 0;
    if (config->state_compression > 1 || config->reserved_0_7 != 0 || config->reserved_0_10 != 0 ||
        config->reserved_0_14 != 0) {
      LOG_ERROR("capi", "lockstep_comm_create: INVALID_ARGUMENT: state_compression is 0 (compress where it pays) or 1 "
                        "(off), and reserved_0_7, reserved_0_10 and reserved_0_14 are 0");
      return LOCKSTEP_STATUS_INVALID_ARGUMENT;
    }
    if (config->master_fallbacks != nullptr) {
      auto fallbacks = lockstep::transport::parse_address_list(config->master_fallbacks);
      if (!fallbacks) {
        LOG_ERROR("capi", "lockstep_comm_create: INVALID_ARGUMENT: master_fallbacks is not HOST:PORT[,HOST:PORT...] "
                          "(at most 16, ports above 0): \"" << config->master_fallbacks << "\"");
        return LOCKSTEP_STATUS_INVALID_ARGUMENT;
      }
      options.master_fallbacks = std::move(*fallbacks);
    }
    options.failover_timeout_ms = config->failover_timeout_ms;
    options.accept_inbound = config->no_inbound == 0;
    options.compress_state = config->state_compression == 0;
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

namespace {
// Copies a value into the caller's buffer, or says how large it is.
lockstep_status_t give_value(const char* function, const std::vector<std::uint8_t>& value, void* out,
                             size_t out_capacity, size_t* out_size) {
  *out_size = value.size();
  if (value.size() > out_capacity) {
    return refuse(function, lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                                             "the value has " + std::to_string(value.size()) +
                                                 " bytes; out_capacity is " + std::to_string(out_capacity)));
  }
  if (!value.empty()) std::memcpy(out, value.data(), value.size());
  return LOCKSTEP_OK;
}
}  // namespace

lockstep_status_t lockstep_comm_agree(lockstep_comm_t* comm, int flag, int* out_result) {
  if (comm == nullptr || out_result == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    auto r = comm->comm->agree(flag != 0);
    if (!r.is_ok()) return r.status().code();
    *out_result = r.value() ? 1 : 0;
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_comm_agree_value(lockstep_comm_t* comm, lockstep_agree_mode_t mode, const void* value,
                                            size_t size, void* out, size_t out_capacity, size_t* out_size) {
  if (comm == nullptr || out_size == nullptr || (size > 0 && value == nullptr) || (out_capacity > 0 && out == nullptr)) {
    return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  }
  if (raw(mode) != LOCKSTEP_AGREE_ALL_EQUAL && raw(mode) != LOCKSTEP_AGREE_FIRST_ACCEPTED) {
    return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  }
  return guarded([&] {
    const auto* bytes = static_cast<const std::uint8_t*>(value);
    auto r = comm->comm->agree_value(static_cast<lockstep::proto::AgreeMode>(raw(mode)),
                                     std::vector<std::uint8_t>(bytes, bytes + size));
    if (!r.is_ok()) return r.status().code();
    return give_value("lockstep_comm_agree_value", r.value(), out, out_capacity, out_size);
  });
}

lockstep_status_t lockstep_comm_kv_set(lockstep_comm_t* comm, const char* key, const void* value, size_t size) {
  if (comm == nullptr || key == nullptr || (size > 0 && value == nullptr)) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  if (size > lockstep::limits::kKvValueBytesMaxLimit) {
    return refuse("lockstep_comm_kv_set", lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                                                           "a value of " + std::to_string(size) + " bytes; at most " +
                                                               std::to_string(lockstep::limits::kKvValueBytesMaxLimit)));
  }
  return guarded([&] {
    const auto* bytes = static_cast<const std::uint8_t*>(value);
    return comm->comm->kv_set(key, std::vector<std::uint8_t>(bytes, bytes + size)).code();
  });
}

lockstep_status_t lockstep_comm_kv_get(lockstep_comm_t* comm, const char* key, void* out, size_t out_capacity,
                                       size_t* out_size) {
  if (comm == nullptr || key == nullptr || out_size == nullptr || (out_capacity > 0 && out == nullptr)) {
    return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  }
  return guarded([&] {
    auto r = comm->comm->kv_get(key);
    if (!r.is_ok()) return r.status().code();
    return give_value("lockstep_comm_kv_get", r.value(), out, out_capacity, out_size);
  });
}

lockstep_status_t lockstep_comm_kv_wait(lockstep_comm_t* comm, const char* key, uint32_t timeout_ms, void* out,
                                        size_t out_capacity, size_t* out_size) {
  if (comm == nullptr || key == nullptr || out_size == nullptr || (out_capacity > 0 && out == nullptr)) {
    return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  }
  return guarded([&] {
    auto r = comm->comm->kv_wait(key, timeout_ms);
    if (!r.is_ok()) return r.status().code();
    return give_value("lockstep_comm_kv_wait", r.value(), out, out_capacity, out_size);
  });
}

lockstep_status_t lockstep_comm_kv_delete(lockstep_comm_t* comm, const char* key) {
  if (comm == nullptr || key == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] { return comm->comm->kv_delete(key).code(); });
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

lockstep_status_t lockstep_comm_get_membership_sized(const lockstep_comm_t* comm, lockstep_member_t* out_members,
                                                     size_t member_size, size_t capacity, size_t* out_count) {
  if (comm == nullptr || out_count == nullptr || (capacity > 0 && out_members == nullptr)) {
    return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  }
  lockstep::Status valid = check_struct_size<lockstep_member_t>(member_size, kMemberFirstFieldEnd, "member_size (sizeof lockstep_member_t)");
  if (!valid.is_ok()) return refuse("lockstep_comm_get_membership", valid);
  return guarded([&] {
    auto view = comm->comm->membership();
    if (!view.is_ok()) return view.status().code();
    *out_count = view.value().size();
    if (capacity < view.value().size()) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
    for (size_t i = 0; i < view.value().size(); ++i) {
      const auto& m = view.value()[i];
      lockstep_member_t out{};
      for (int b = 0; b < 8; ++b) {
        out.id[b] = static_cast<uint8_t>(m.id.hi >> (56 - 8 * b));
        out.id[8 + b] = static_cast<uint8_t>(m.id.lo >> (56 - 8 * b));
      }
      out.rank = static_cast<uint32_t>(i);
      std::strncpy(out.host, m.host.c_str(), sizeof out.host - 1);
      out.p2p_port = m.p2p_port;
      out.shared_state_port = m.shared_state_port;
      out.benchmark_port = m.benchmark_port;
      // The caller's array has its own element size (an older or newer header's).
      write_prefix(reinterpret_cast<unsigned char*>(out_members) + i * member_size, member_size, out);
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

lockstep_status_t lockstep_comm_get_slot_bytes(const lockstep_comm_t* comm, uint32_t slot, uint64_t* out_sent,
                                               uint64_t* out_received) {
  if (comm == nullptr || out_sent == nullptr || out_received == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  const lockstep::peer::Counters c = comm->comm->counters();
  if (slot >= c.slot_bytes_sent.size()) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  *out_sent = c.slot_bytes_sent[slot];
  *out_received = c.slot_bytes_received[slot];
  return LOCKSTEP_OK;
}

namespace {
// C++ linkage for the helpers below (check_info_size returns a class): this block lies
// inside extern "C".
extern "C++" {

bool valid_descriptor(const lockstep_reduce_desc_t& d) {
  return raw(d.dtype) >= LOCKSTEP_U8 && raw(d.dtype) <= LOCKSTEP_F64 && raw(d.op) >= LOCKSTEP_SUM &&
         raw(d.op) <= LOCKSTEP_MIN && raw(d.quantization) >= LOCKSTEP_QUANT_NONE &&
         raw(d.quantization) <= LOCKSTEP_QUANT_CAST_BF16 && raw(d.distribution) >= LOCKSTEP_DIST_NONE &&
         raw(d.distribution) <= LOCKSTEP_DIST_NORMAL;
}

// Writes an all-reduce's info into the caller's struct of info_size bytes (if any).
void to_info(const lockstep::peer::ReduceInfo& in, void* out, std::size_t info_size) {
  if (out == nullptr) return;
  lockstep_reduce_info_t info{};
  info.world_size = in.world_size;
  info.bytes_sent = in.bytes_sent;
  info.bytes_received = in.bytes_received;
  info.streams = in.streams;
  write_prefix(out, info_size, info);
}

// The size of the caller's info struct, when there is one (out_info may be NULL).
lockstep::Status check_info_size(const void* out_info, std::size_t info_size) {
  if (out_info == nullptr) return lockstep::Status::ok();
  return check_struct_size<lockstep_reduce_info_t>(info_size, kReduceInfoFirstFieldEnd, "info_size (sizeof lockstep_reduce_info_t)");
}

// Refuses a call for an argument: logs why, unless the reason is only the code (a bad
// enum value, as before the sizes existed).
lockstep_status_t refuse_quietly(const char* function, const lockstep::Status& status) {
  if (status.message().empty()) return status.code();
  return refuse(function, status);
}

// ---- the collectives since 0.4: each struct's first version is whole (no shorter size).
bool valid_dtype(const lockstep_dtype_t& d) { return raw(d) >= LOCKSTEP_U8 && raw(d) <= LOCKSTEP_F64; }

lockstep::Result<lockstep::peer::ReduceDescriptor> to_descriptor(const lockstep_reduce_desc_t& d) {
  if (!valid_descriptor(d)) return lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "");
  lockstep::peer::ReduceDescriptor out;
  out.src = d.src;
  out.dst = d.dst;
  out.count = d.count;
  out.dtype = d.dtype;
  out.op = d.op;
  out.quantization = d.quantization;
  out.tag = d.tag;
  out.residual = d.residual;
  out.distribution = d.distribution;
  // A descriptor with no count and no buffers is a barrier (multiple-with-retry's).
  if (d.count == 0 && d.src == nullptr && d.dst == nullptr) out.kind = lockstep::proto::CollectiveKind::kBarrier;
  return out;
}

lockstep::Result<lockstep::peer::ReduceDescriptor> to_descriptor(const lockstep_broadcast_desc_t& d) {
  if (!valid_dtype(d.dtype)) return lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "");
  lockstep::peer::ReduceDescriptor out;
  out.kind = lockstep::proto::CollectiveKind::kBroadcast;
  out.dst = d.buf;
  out.count = d.count;
  out.dtype = d.dtype;
  out.root = d.root;
  out.tag = d.tag;
  return out;
}
lockstep::Result<lockstep::peer::ReduceDescriptor> to_descriptor(const lockstep_all_gather_desc_t& d) {
  if (!valid_dtype(d.dtype)) return lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "");
  if (d.counts == nullptr && d.counts_len != 0) {
    return lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "counts is NULL but counts_len is not 0");
  }
  if (d.counts_len > lockstep::limits::kMembersPerMessageMax) {
    return lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                            "counts_len above " + std::to_string(lockstep::limits::kMembersPerMessageMax));
  }
  lockstep::peer::ReduceDescriptor out;
  out.kind = lockstep::proto::CollectiveKind::kAllGather;
  out.src = d.src;
  out.dst = d.dst;
  out.count = d.count;
  out.dst_capacity = d.dst_capacity;
  out.dtype = d.dtype;
  if (d.counts != nullptr) out.counts.assign(d.counts, d.counts + d.counts_len);
  out.tag = d.tag;
  return out;
}
lockstep::Result<lockstep::peer::ReduceDescriptor> to_descriptor(const lockstep_reduce_scatter_desc_t& d) {
  // The enums are checked before they are copied (loading an out-of-range one is undefined).
  lockstep_reduce_desc_t as_reduce{};
  std::memcpy(&as_reduce.dtype, &d.dtype, sizeof d.dtype);
  std::memcpy(&as_reduce.op, &d.op, sizeof d.op);
  std::memcpy(&as_reduce.quantization, &d.quantization, sizeof d.quantization);
  if (!valid_descriptor(as_reduce)) return lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "");
  as_reduce.src = d.src;
  as_reduce.dst = d.dst;
  as_reduce.count = d.count_per_rank;
  as_reduce.tag = d.tag;
  auto out = to_descriptor(as_reduce);
  if (out.is_ok()) out.value().kind = lockstep::proto::CollectiveKind::kReduceScatter;
  return out;
}
// The caller's descriptor of desc_size bytes, as the communicator's.
template <typename T>
lockstep::Result<lockstep::peer::ReduceDescriptor> read_collective(const T* in, std::size_t desc_size) {
  T desc{};
  const std::size_t first_field_end =
      std::is_same_v<T, lockstep_reduce_desc_t> ? kDescFirstFieldEnd : sizeof(T);
  lockstep::Status read = read_prefix(in, desc_size, first_field_end, "desc_size (sizeof the descriptor)", desc);
  if (!read.is_ok()) return read;
  return to_descriptor(desc);
}

template <typename T>
lockstep_status_t run_blocking(const char* function, lockstep_comm_t* comm, const T* caller_desc, size_t desc_size,
                               lockstep_reduce_info_t* out_info, size_t info_size) {
  if (comm == nullptr || caller_desc == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    auto desc = read_collective(caller_desc, desc_size);
    if (!desc.is_ok()) return refuse_quietly(function, desc.status());
    lockstep::Status info_valid = check_info_size(out_info, info_size);
    if (!info_valid.is_ok()) return refuse(function, info_valid);
    auto r = comm->comm->all_reduce(desc.value());
    if (!r.is_ok()) return r.status().code();
    to_info(r.value(), out_info, info_size);
    return LOCKSTEP_OK;
  });
}

template <typename T>
lockstep_status_t run_async(const char* function, lockstep_comm_t* comm, const T* caller_desc, size_t desc_size,
                            lockstep_async_t** out_handle) {
  if (comm == nullptr || caller_desc == nullptr || out_handle == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    auto desc = read_collective(caller_desc, desc_size);
    if (!desc.is_ok()) return refuse_quietly(function, desc.status());
    auto r = comm->comm->all_reduce_async(desc.value());
    if (!r.is_ok()) return r.status().code();
    *out_handle = new lockstep_async{comm->comm.get(), r.value(), comm->alive};
    return LOCKSTEP_OK;
  });
}

}  // extern "C++"

}  // namespace

lockstep_status_t lockstep_comm_all_reduce_sized(lockstep_comm_t* comm, const lockstep_reduce_desc_t* caller_desc,
                                                 size_t desc_size, lockstep_reduce_info_t* out_info, size_t info_size) {
  if (caller_desc != nullptr && caller_desc->count == 0 && caller_desc->src == nullptr && caller_desc->dst == nullptr) {
    return refuse("lockstep_comm_all_reduce", lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "count is zero"));
  }
  return run_blocking("lockstep_comm_all_reduce", comm, caller_desc, desc_size, out_info, info_size);
}

lockstep_status_t lockstep_comm_all_reduce_async_sized(lockstep_comm_t* comm, const lockstep_reduce_desc_t* caller_desc,
                                                       size_t desc_size, lockstep_async_t** out_handle) {
  if (caller_desc != nullptr && caller_desc->count == 0 && caller_desc->src == nullptr && caller_desc->dst == nullptr) {
    return refuse("lockstep_comm_all_reduce_async", lockstep::Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "count is zero"));
  }
  return run_async("lockstep_comm_all_reduce_async", comm, caller_desc, desc_size, out_handle);
}

lockstep_status_t lockstep_comm_broadcast_sized(lockstep_comm_t* comm, const lockstep_broadcast_desc_t* desc,
                                                size_t desc_size, lockstep_reduce_info_t* out_info, size_t info_size) {
  return run_blocking("lockstep_comm_broadcast", comm, desc, desc_size, out_info, info_size);
}
lockstep_status_t lockstep_comm_broadcast_async_sized(lockstep_comm_t* comm, const lockstep_broadcast_desc_t* desc,
                                                      size_t desc_size, lockstep_async_t** out_handle) {
  return run_async("lockstep_comm_broadcast_async", comm, desc, desc_size, out_handle);
}
lockstep_status_t lockstep_comm_all_gather_sized(lockstep_comm_t* comm, const lockstep_all_gather_desc_t* desc,
                                                 size_t desc_size, lockstep_reduce_info_t* out_info, size_t info_size) {
  return run_blocking("lockstep_comm_all_gather", comm, desc, desc_size, out_info, info_size);
}
lockstep_status_t lockstep_comm_all_gather_async_sized(lockstep_comm_t* comm, const lockstep_all_gather_desc_t* desc,
                                                       size_t desc_size, lockstep_async_t** out_handle) {
  return run_async("lockstep_comm_all_gather_async", comm, desc, desc_size, out_handle);
}
lockstep_status_t lockstep_comm_reduce_scatter_sized(lockstep_comm_t* comm, const lockstep_reduce_scatter_desc_t* desc,
                                                     size_t desc_size, lockstep_reduce_info_t* out_info,
                                                     size_t info_size) {
  return run_blocking("lockstep_comm_reduce_scatter", comm, desc, desc_size, out_info, info_size);
}
lockstep_status_t lockstep_comm_reduce_scatter_async_sized(lockstep_comm_t* comm,
                                                           const lockstep_reduce_scatter_desc_t* desc, size_t desc_size,
                                                           lockstep_async_t** out_handle) {
  return run_async("lockstep_comm_reduce_scatter_async", comm, desc, desc_size, out_handle);
}

lockstep_status_t lockstep_comm_barrier(lockstep_comm_t* comm, uint64_t tag) {
  const lockstep_reduce_desc_t barrier{nullptr, nullptr, 0, LOCKSTEP_U8, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, tag, nullptr, LOCKSTEP_DIST_NONE};
  return run_blocking("lockstep_comm_barrier", comm, &barrier, sizeof barrier, nullptr, 0);
}
lockstep_status_t lockstep_comm_barrier_async(lockstep_comm_t* comm, uint64_t tag, lockstep_async_t** out_handle) {
  const lockstep_reduce_desc_t barrier{nullptr, nullptr, 0, LOCKSTEP_U8, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, tag, nullptr, LOCKSTEP_DIST_NONE};
  return run_async("lockstep_comm_barrier_async", comm, &barrier, sizeof barrier, out_handle);
}

lockstep_status_t lockstep_async_poll(const lockstep_async_t* handle, int* out_done) {
  if (handle == nullptr || out_done == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  *out_done = handle->op->done() ? 1 : 0;
  return LOCKSTEP_OK;
}

lockstep_status_t lockstep_async_wait_sized(lockstep_async_t* handle, lockstep_reduce_info_t* out_info,
                                            size_t info_size) {
  if (handle == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  lockstep::Status info_valid = check_info_size(out_info, info_size);
  if (!info_valid.is_ok()) return refuse("lockstep_async_wait", info_valid);  // handle kept
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
    to_info(r.value(), out_info, info_size);
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_comm_all_reduce_multiple_with_retry_sized(lockstep_comm_t* comm,
                                                                     const lockstep_reduce_desc_t* descs,
                                                                     size_t desc_size, size_t count,
                                                                     size_t max_in_flight,
                                                                     lockstep_reduce_info_t* out_infos,
                                                                     size_t info_size) {
  if (comm == nullptr || (count > 0 && descs == nullptr)) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  return guarded([&] {
    lockstep::Status info_valid = check_info_size(out_infos, info_size);
    if (!info_valid.is_ok()) return refuse("lockstep_comm_all_reduce_multiple_with_retry", info_valid);
    // The caller's arrays step by its own struct sizes (an older or newer header's).
    std::vector<lockstep::peer::ReduceDescriptor> list;
    for (size_t i = 0; i < count; ++i) {
      auto desc = read_collective(reinterpret_cast<const lockstep_reduce_desc_t*>(
                                      reinterpret_cast<const unsigned char*>(descs) + i * desc_size),
                                  desc_size);
      if (!desc.is_ok()) return refuse_quietly("lockstep_comm_all_reduce_multiple_with_retry", desc.status());
      list.push_back(desc.value());
    }
    std::vector<lockstep::peer::ReduceInfo> infos;
    lockstep::Status s = comm->comm->all_reduce_multiple_with_retry(list, max_in_flight, &infos);
    if (!s.is_ok()) return s.code();
    for (size_t i = 0; out_infos != nullptr && i < count; ++i) {
      to_info(infos[i], reinterpret_cast<unsigned char*>(out_infos) + i * info_size, info_size);
    }
    return LOCKSTEP_OK;
  });
}

lockstep_status_t lockstep_comm_sync_shared_state_sized(lockstep_comm_t* comm, lockstep_shared_state_t* caller_state,
                                                        size_t state_size, size_t tensor_size,
                                                        lockstep_sync_strategy_t strategy,
                                                        lockstep_sync_info_t* out_info, size_t info_size) {
  if (comm == nullptr || caller_state == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  lockstep_shared_state_t state{};
  lockstep::Status valid = read_prefix(caller_state, state_size, kStateFirstFieldEnd, "state_size (sizeof lockstep_shared_state_t)", state);
  if (valid.is_ok()) {
    valid = check_struct_size<lockstep_tensor_t>(tensor_size, kTensorFirstFieldEnd, "tensor_size (sizeof lockstep_tensor_t)");
  }
  if (valid.is_ok() && out_info != nullptr) {
    valid = check_struct_size<lockstep_sync_info_t>(info_size, kSyncInfoFirstFieldEnd, "info_size (sizeof lockstep_sync_info_t)");
  }
  if (!valid.is_ok()) return refuse("lockstep_comm_sync_shared_state", valid);
  if (state.count > 0 && state.tensors == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  if (raw(strategy) < LOCKSTEP_SYNC_ENFORCE_POPULAR || raw(strategy) > LOCKSTEP_SYNC_SEND_ONLY) {
    return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  }
  return guarded([&] {
    std::vector<lockstep::peer::SharedTensor> tensors;
    for (size_t i = 0; i < state.count; ++i) {
      // The caller's array steps by its own struct size (an older or newer header's).
      lockstep_tensor_t t{};
      lockstep::Status read = read_prefix(reinterpret_cast<const unsigned char*>(state.tensors) + i * tensor_size,
                                          tensor_size, kTensorFirstFieldEnd, "tensor_size (sizeof lockstep_tensor_t)", t);
      if (!read.is_ok()) return refuse("lockstep_comm_sync_shared_state", read);
      if (t.key == nullptr) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
      if (raw(t.dtype) < LOCKSTEP_U8 || raw(t.dtype) > LOCKSTEP_F64 || raw(t.device) != LOCKSTEP_DEVICE_CPU) {
        return LOCKSTEP_STATUS_INVALID_ARGUMENT;
      }
      tensors.push_back(lockstep::peer::SharedTensor{std::string(t.key, strnlen(t.key, 256)), t.data, t.count, t.dtype,
                                                     t.allow_content_inequality != 0});
    }
    std::uint64_t revision = state.revision;
    auto r = comm->comm->sync_shared_state(tensors, &revision, static_cast<lockstep::proto::SyncStrategy>(strategy));
    if (!r.is_ok()) return r.status().code();
    caller_state->revision = revision;  // the first field: within every valid state_size
    if (out_info != nullptr) {
      lockstep_sync_info_t info{};
      info.bytes_sent = r.value().bytes_sent;
      info.bytes_received = r.value().bytes_received;
      info.wire_bytes_sent = r.value().wire_bytes_sent;
      info.wire_bytes_received = r.value().wire_bytes_received;
      info.streams = r.value().streams;
      write_prefix(out_info, info_size, info);
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
