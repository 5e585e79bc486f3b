// liblockstep-pccl: PCCL v1.0's C API (include/pccl.h) over lockstep's public C API.
//
// Every call validates its arguments the way PCCL documents (a call before pcclInit:
// pcclNotInitialized; a null pointer, an enum value PCCL does not define, an unknown
// handle: pcclInvalidArgument), translates PCCL's numbering (dtypes: i16 before u16;
// attributes from 1; quantization as type + algorithm) and structs into lockstep's, calls
// lockstep, and maps the status back by the table in status_map.h (docs/pccl.md).
// Handles are checked against the set of live ones before they are used, so that a
// stale or made-up pointer is refused instead of dereferenced. No exception leaves a call.
#include "pccl/status_map.h"

#include <arpa/inet.h>
#include <lockstep/lockstep.h>
#include <netinet/in.h>
#include <pccl.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <vector>

struct pcclComm_t {
  lockstep_comm_t* comm = nullptr;
  // Async all-reduces launched and not yet awaited, by tag (PCCL's handle is the pair
  // comm, tag, owned by the caller).
  std::mutex mu;
  std::map<std::uint64_t, lockstep_async_t*> pending;
};

struct pcclMasterInstance_t {
  lockstep_master_t* master = nullptr;
  // As PCCL's, awaiting termination is legal only for a master that runs and was
  // interrupted (else it could never return).
  std::atomic<bool> running{false};
  std::atomic<bool> interrupted{false};
};

namespace {

using lockstep::pccl::Call;
using lockstep::pccl::to_pccl;

// At most this many descriptors per pcclAllReduceMultipleWithRetry (a bound before the
// translation allocates).
constexpr std::size_t kMultipleMax = 1u << 20;
// More tensors than lockstep's shared state holds (2048) are refused by lockstep with
// its own message; this bound only keeps the translation's allocation small.
constexpr std::size_t kTensorsMax = 1u << 16;

std::atomic<bool> g_initialized{false};

// The live handles: a handle is used only if it is here.
std::mutex g_handles_mu;
std::set<const pcclComm_t*>& live_comms() {
  static std::set<const pcclComm_t*> comms;
  return comms;
}
std::set<const pcclMasterInstance_t*>& live_masters() {
  static std::set<const pcclMasterInstance_t*> masters;
  return masters;
}

// The handle if it is live, else null (a stale or made-up pointer is never dereferenced).
template <typename Handle>
Handle* find_live(std::set<const Handle*>& live, const Handle* handle) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  return live.count(handle) != 0 ? const_cast<Handle*>(handle) : nullptr;
}
pcclComm_t* find_comm(const pcclComm_t* comm) { return find_live(live_comms(), comm); }
pcclMasterInstance_t* find_master(const pcclMasterInstance_t* master) { return find_live(live_masters(), master); }

// Makes a new handle live and hands it to the caller.
template <typename Handle>
void publish(std::set<const Handle*>& live, Handle* handle, Handle** out) {
  {
    std::lock_guard<std::mutex> lock(g_handles_mu);
    live.insert(handle);
  }
  *out = handle;
}

// Takes a handle out of the live set; false if it was not live.
template <typename Handle>
bool retire(std::set<const Handle*>& live, const Handle* handle) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  return live.erase(handle) != 0;
}

void complain(const char* call, const std::string& why) {
  std::fprintf(stderr, "lockstep-pccl: %s: %s\n", call, why.c_str());
}

// Runs a call's body, turning any exception (an allocation that failed) into
// pcclInternalError.
template <typename F>
pcclResult_t guarded(const char* call, F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    complain(call, "out of memory");
  } catch (...) {
    complain(call, "unexpected exception");
  }
  return pcclInternalError;
}

// The value of an enum field or argument as the caller stored it. A C caller may store any
// int there; loading one outside the enumerators through the C++ enum type would be
// undefined, so every enum that comes from the caller is read through this.
template <typename Enum>
std::int32_t raw(const Enum& value) {
  static_assert(sizeof(Enum) == sizeof(std::int32_t), "PCCL's enums are 4 bytes");
  std::int32_t out;
  std::memcpy(&out, &value, sizeof out);
  return out;
}

std::optional<lockstep_dtype_t> to_dtype(std::int32_t type) {
  switch (type) {
    case pcclUint8: return LOCKSTEP_U8;
    case pcclInt8: return LOCKSTEP_I8;
    case pcclInt16: return LOCKSTEP_I16;
    case pcclUint16: return LOCKSTEP_U16;
    case pcclUint32: return LOCKSTEP_U32;
    case pcclInt32: return LOCKSTEP_I32;
    case pcclUint64: return LOCKSTEP_U64;
    case pcclInt64: return LOCKSTEP_I64;
    case pcclFloat16: return LOCKSTEP_F16;
    case pcclBFloat16: return LOCKSTEP_BF16;
    case pcclFloat: return LOCKSTEP_F32;
    case pcclDouble: return LOCKSTEP_F64;
  }
  return std::nullopt;
}

std::optional<lockstep_reduce_op_t> to_op(std::int32_t op) {
  switch (op) {
    case pcclSum: return LOCKSTEP_SUM;
    case pcclAvg: return LOCKSTEP_AVG;
    case pcclProd: return LOCKSTEP_PROD;
    case pcclMax: return LOCKSTEP_MAX;
    case pcclMin: return LOCKSTEP_MIN;
  }
  return std::nullopt;
}

// PCCL names a quantization by its code type and algorithm: 8-bit codes (pcclUint8) under
// min-max or zero-point/scale, or a cast to pcclFloat16 / pcclBFloat16 (either
// algorithm: a cast has no parameters). The code type of pcclQuantNone is not looked at
// beyond being a dtype (PCCL programs pass their source type there).
std::optional<lockstep_quantization_t> to_quantization(const pcclQuantizationOptions_t& q, std::string* why) {
  const std::int32_t code_type = raw(q.quantized_datatype);
  const std::int32_t algorithm = raw(q.algorithm);
  if (!to_dtype(code_type)) {
    *why = "quantized_datatype " + std::to_string(code_type) + " is not a pcclDataType_t";
    return std::nullopt;
  }
  switch (algorithm) {
    case pcclQuantNone: return LOCKSTEP_QUANT_NONE;
    case pcclQuantMinMax:
    case pcclQuantZeroPointScale:
      if (code_type == pcclFloat16) return LOCKSTEP_QUANT_CAST_F16;
      if (code_type == pcclBFloat16) return LOCKSTEP_QUANT_CAST_BF16;
      if (code_type != pcclUint8) {
        *why = "quantized_datatype must be pcclUint8, pcclFloat16 or pcclBFloat16";
        return std::nullopt;
      }
      return algorithm == pcclQuantMinMax ? LOCKSTEP_QUANT_MINMAX_U8 : LOCKSTEP_QUANT_ZERO_POINT_U8;
  }
  *why = "quantization algorithm " + std::to_string(algorithm) + " is not a pcclQuantizationAlgorithm_t";
  return std::nullopt;
}

bool to_reduce_desc(const void* sendbuf, void* recvbuf, const pcclReduceDescriptor_t& d, lockstep_reduce_desc_t* out,
                    std::string* why) {
  auto dtype = to_dtype(raw(d.src_descriptor.datatype));
  if (!dtype) {
    *why = "datatype " + std::to_string(raw(d.src_descriptor.datatype)) + " is not a pcclDataType_t";
    return false;
  }
  auto op = to_op(raw(d.op));
  if (!op) {
    *why = "op " + std::to_string(raw(d.op)) + " is not a pcclRedOp_t";
    return false;
  }
  lockstep_distribution_t distribution = LOCKSTEP_DIST_NONE;
  switch (raw(d.src_descriptor.distribution_hint)) {
    case pcclDistributionNone: break;
    case pcclDistributionNormal: distribution = LOCKSTEP_DIST_NORMAL; break;
    case pcclDistributionUniform: distribution = LOCKSTEP_DIST_UNIFORM; break;
    default:
      *why = "distribution_hint " + std::to_string(raw(d.src_descriptor.distribution_hint)) +
             " is not a pcclDistributionHint_t";
      return false;
  }
  auto quantization = to_quantization(d.quantization_options, why);
  if (!quantization) return false;
  *out = lockstep_reduce_desc_t{};
  out->src = sendbuf;
  out->dst = recvbuf;
  out->count = d.count;
  out->dtype = *dtype;
  out->op = *op;
  out->quantization = *quantization;
  out->tag = d.tag;
  out->distribution = distribution;
  return true;
}

void fill_info(pcclReduceInfo_t* out, const lockstep_reduce_info_t& info) {
  if (out == nullptr) return;
  out->local_world_size = info.world_size;
  out->tx_bytes = info.bytes_sent;
  out->rx_bytes = info.bytes_received;
}

// The text form of a socket address's host ("a.b.c.d", or an IPv6 literal such as
// "::1"); nothing (and why) for a protocol value PCCL does not define or an IPv4-mapped
// IPv6 address (give the IPv4 address instead).
std::optional<std::string> inet_host(const ccoip_socket_address_t& address, std::string* why) {
  const std::int32_t protocol = raw(address.inet.protocol);
  if (protocol == inetIPv4) {
    const std::uint8_t* a = address.inet.ipv4.data;
    return std::to_string(a[0]) + "." + std::to_string(a[1]) + "." + std::to_string(a[2]) + "." + std::to_string(a[3]);
  }
  if (protocol != inetIPv6) {
    *why = "inet.protocol " + std::to_string(protocol) + " is not a ccoip_inet_protocol_t";
    return std::nullopt;
  }
  in6_addr a;
  std::memcpy(&a, address.inet.ipv6.data, sizeof a);
  if (IN6_IS_ADDR_V4MAPPED(&a)) {
    *why = "an IPv4-mapped IPv6 address; give the IPv4 address (inet.protocol inetIPv4) instead";
    return std::nullopt;
  }
  char text[INET6_ADDRSTRLEN];
  if (::inet_ntop(AF_INET6, &a, text, sizeof text) == nullptr) {
    *why = "an IPv6 address that cannot be written out";
    return std::nullopt;
  }
  return std::string(text);
}

// ---- options PCCL has no call for, from the environment (docs/pccl.md)

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

// An unsigned decimal number of at most `max`, or nothing (and why).
std::optional<std::uint32_t> env_u32(const char* name, std::uint32_t max, std::string* why) {
  const char* value = env(name);
  if (value == nullptr) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  unsigned long long parsed = std::strtoull(value, &end, 10);
  if (*value < '0' || *value > '9' || *end != '\0' || errno != 0 || parsed > max) {
    *why = std::string(name) + "='" + value + "' is not a number from 0 to " + std::to_string(max);
    return std::nullopt;
  }
  return static_cast<std::uint32_t>(parsed);
}

// Fills the communicator options PCCL cannot express; false (and why) if a variable is
// malformed. The strings it points the config at live as long as the environment.
bool comm_options_from_env(lockstep_comm_config_t* config, std::string* why) {
  struct U32Option {
    const char* name;
    std::uint32_t max;
    std::uint32_t* field;
  };
  std::uint32_t encrypt = 0;
  std::uint32_t check_finite = 0;
  std::uint32_t base_port = 0;
  const U32Option options[] = {
      {"LOCKSTEP_P2P_STREAMS", 16, &config->p2p_streams},
      {"LOCKSTEP_P2P_STALL_TIMEOUT_MS", 86'400'000, &config->p2p_stall_timeout_ms},
      {"LOCKSTEP_CONNECT_TIMEOUT_MS", 86'400'000, &config->connect_timeout_ms},
      {"LOCKSTEP_FAILOVER_TIMEOUT_MS", 86'400'000, &config->failover_timeout_ms},
      {"LOCKSTEP_ENCRYPT_DATA", 1, &encrypt},
      {"LOCKSTEP_CHECK_FINITE", 1, &check_finite},
      {"LOCKSTEP_BASE_PORT", 65535, &base_port},
  };
  for (const U32Option& option : options) {
    why->clear();
    auto value = env_u32(option.name, option.max, why);
    if (!why->empty()) return false;
    if (value) *option.field = *value;
  }
  config->encrypt_data = static_cast<int>(encrypt);
  config->check_finite = static_cast<int>(check_finite);
  if (env("LOCKSTEP_BASE_PORT") != nullptr) config->base_port = static_cast<std::int32_t>(base_port);
  if (const char* cc = env("LOCKSTEP_TCP_CONGESTION")) config->tcp_congestion = cc;
  if (const char* host = env("LOCKSTEP_ADVERTISED_HOST")) config->advertised_host = host;
  if (const char* host = env("LOCKSTEP_BIND_HOST")) config->bind_host = host;
  return true;
}

bool master_options_from_env(lockstep_master_config_t* config, std::string* why) {
  why->clear();
  auto heartbeat = env_u32("LOCKSTEP_HEARTBEAT_TIMEOUT_MS", 3'600'000, why);
  if (!why->empty()) return false;
  if (heartbeat) config->heartbeat_timeout_ms = *heartbeat;
  if (const char* http = env("LOCKSTEP_MASTER_HTTP")) config->http_listen = http;
  if (const char* token = env("LOCKSTEP_MASTER_HTTP_TOKEN_FILE")) config->http_token_file = token;
  return true;
}

#define PCCL_REQUIRE_INIT()                                \
  do {                                                     \
    if (!g_initialized.load()) return pcclNotInitialized;  \
  } while (0)

}  // namespace

extern "C" {

pcclResult_t pcclInit(void) {
  g_initialized.store(true);
  return pcclSuccess;
}

pcclResult_t pcclCreateCommunicator(const pcclCommCreateParams_t* params, pcclComm_t** comm_out) {
  PCCL_REQUIRE_INIT();
  if (params == nullptr || comm_out == nullptr) return pcclInvalidArgument;
  return guarded("pcclCreateCommunicator", [&] {
    std::string why;
    auto host = inet_host(params->master_address, &why);
    if (!host) {
      complain("pcclCreateCommunicator", "master_address: " + why);
      return pcclInvalidArgument;
    }
    lockstep_comm_config_t config;
    lockstep_comm_config_init(&config);
    config.master_host = host->c_str();
    config.master_port = params->master_address.port;
    config.peer_group = params->peer_group;
    config.p2p_pool_size = params->p2p_connection_pool_size;
    // A PCCL program is written for a master whose loss ends the run (it reconnects by
    // hand, if at all): failover stays off unless LOCKSTEP_FAILOVER_TIMEOUT_MS asks.
    config.failover_timeout_ms = 0;
    if (!comm_options_from_env(&config, &why)) {
      complain("pcclCreateCommunicator", why);
      return pcclInvalidArgument;
    }
    lockstep_comm_t* comm = nullptr;
    lockstep_status_t status = lockstep_comm_create(&config, &comm);
    if (status != LOCKSTEP_OK) return to_pccl(status, Call::kGeneral);
    auto* handle = new pcclComm_t;
    handle->comm = comm;
    publish(live_comms(), handle, comm_out);
    return pcclSuccess;
  });
}

pcclResult_t pcclGetAttribute(const pcclComm_t* comm, pcclAttribute_t attribute, int* value_out) {
  PCCL_REQUIRE_INIT();
  pcclComm_t* c = find_comm(comm);
  if (c == nullptr || value_out == nullptr) return pcclInvalidArgument;
  lockstep_attribute_t which;
  switch (raw(attribute)) {
    case PCCL_ATTRIBUTE_GLOBAL_WORLD_SIZE: which = LOCKSTEP_ATTR_GLOBAL_WORLD_SIZE; break;
    case PCCL_ATTRIBUTE_PEER_GROUP_WORLD_SIZE: which = LOCKSTEP_ATTR_PEER_GROUP_WORLD_SIZE; break;
    case PCCL_ATTRIBUTE_NUM_DISTINCT_PEER_GROUPS: which = LOCKSTEP_ATTR_NUM_DISTINCT_PEER_GROUPS; break;
    case PCCL_ATTRIBUTE_LARGEST_PEER_GROUP_WORLD_SIZE: which = LOCKSTEP_ATTR_LARGEST_PEER_GROUP_WORLD_SIZE; break;
    default: return pcclInvalidArgument;
  }
  std::int64_t value = 0;
  lockstep_status_t status = lockstep_comm_get_attribute(c->comm, which, &value);
  if (status != LOCKSTEP_OK) return to_pccl(status, Call::kGeneral);
  *value_out = value > INT_MAX ? INT_MAX : static_cast<int>(value);
  return pcclSuccess;
}

pcclResult_t pcclDestroyCommunicator(pcclComm_t* comm) {
  PCCL_REQUIRE_INIT();
  if (!retire(live_comms(), comm)) return pcclInvalidArgument;
  lockstep_comm_destroy(comm->comm);
  // Operations never awaited end with the communicator; their lockstep handles are
  // freed by waiting for them.
  for (auto& [tag, handle] : comm->pending) lockstep_async_wait(handle, nullptr);
  delete comm;
  return pcclSuccess;
}

pcclResult_t pcclConnect(pcclComm_t* comm) {
  PCCL_REQUIRE_INIT();
  pcclComm_t* c = find_comm(comm);
  if (c == nullptr) return pcclInvalidArgument;
  return to_pccl(lockstep_comm_connect(c->comm), Call::kConnect);
}

pcclResult_t pcclUpdateTopology(pcclComm_t* comm) {
  PCCL_REQUIRE_INIT();
  pcclComm_t* c = find_comm(comm);
  if (c == nullptr) return pcclInvalidArgument;
  return to_pccl(lockstep_comm_update_topology(c->comm), Call::kUpdateTopology);
}

pcclResult_t pcclArePeersPending(const pcclComm_t* comm, bool* pending_out) {
  PCCL_REQUIRE_INIT();
  pcclComm_t* c = find_comm(comm);
  if (c == nullptr || pending_out == nullptr) return pcclInvalidArgument;
  int pending = 0;
  lockstep_status_t status = lockstep_comm_are_peers_pending(c->comm, &pending);
  if (status != LOCKSTEP_OK) return to_pccl(status, Call::kGeneral);
  *pending_out = pending != 0;
  return pcclSuccess;
}

pcclResult_t pcclOptimizeTopology(const pcclComm_t* comm) {
  PCCL_REQUIRE_INIT();
  pcclComm_t* c = find_comm(comm);
  if (c == nullptr) return pcclInvalidArgument;
  return to_pccl(lockstep_comm_optimize_topology(c->comm), Call::kOptimizeTopology);
}

pcclResult_t pcclAllReduce(const void* sendbuf, void* recvbuf, const pcclReduceDescriptor_t* descriptor,
                           const pcclComm_t* comm, pcclReduceInfo_t* reduce_info_out) {
  PCCL_REQUIRE_INIT();
  pcclComm_t* c = find_comm(comm);
  if (c == nullptr || descriptor == nullptr) return pcclInvalidArgument;
  return guarded("pcclAllReduce", [&] {
    lockstep_reduce_desc_t desc;
    std::string why;
    if (!to_reduce_desc(sendbuf, recvbuf, *descriptor, &desc, &why)) {
      complain("pcclAllReduce", why);
      return pcclInvalidArgument;
    }
    lockstep_reduce_info_t info{};
    lockstep_status_t status = lockstep_comm_all_reduce(c->comm, &desc, &info);
    if (status == LOCKSTEP_OK) fill_info(reduce_info_out, info);
    return to_pccl(status, Call::kCollective);
  });
}

pcclResult_t pcclAllReduceAsync(const void* sendbuf, void* recvbuf, const pcclReduceDescriptor_t* descriptor,
                                const pcclComm_t* comm, pcclAsyncReduceOp_t* reduce_handle_out) {
  PCCL_REQUIRE_INIT();
  pcclComm_t* c = find_comm(comm);
  if (c == nullptr || descriptor == nullptr || reduce_handle_out == nullptr) return pcclInvalidArgument;
  return guarded("pcclAllReduceAsync", [&] {
    lockstep_reduce_desc_t desc;
    std::string why;
    if (!to_reduce_desc(sendbuf, recvbuf, *descriptor, &desc, &why)) {
      complain("pcclAllReduceAsync", why);
      return pcclInvalidArgument;
    }
    // A peer alone fails at once, as PCCL's does (not at the await).
    std::int64_t world = 0;
    lockstep_status_t status = lockstep_comm_get_attribute(c->comm, LOCKSTEP_ATTR_PEER_GROUP_WORLD_SIZE, &world);
    if (status != LOCKSTEP_OK) return to_pccl(status, Call::kGeneral);
    if (world < 2) return pcclTooFewPeers;
    std::lock_guard<std::mutex> lock(c->mu);
    if (c->pending.count(desc.tag) != 0) {
      complain("pcclAllReduceAsync", "tag " + std::to_string(desc.tag) + " is in flight and not awaited yet");
      return pcclInvalidUsage;
    }
    lockstep_async_t* handle = nullptr;
    status = lockstep_comm_all_reduce_async(c->comm, &desc, &handle);
    if (status != LOCKSTEP_OK) return to_pccl(status, Call::kCollective);
    c->pending.emplace(desc.tag, handle);
    reduce_handle_out->comm = c;
    reduce_handle_out->tag = desc.tag;
    return pcclSuccess;
  });
}

pcclResult_t pcclAwaitAsyncReduce(const pcclAsyncReduceOp_t* reduce_handle, pcclReduceInfo_t* reduce_info_out) {
  PCCL_REQUIRE_INIT();
  if (reduce_handle == nullptr) return pcclInvalidArgument;
  pcclComm_t* c = find_comm(reduce_handle->comm);
  if (c == nullptr) return pcclInvalidArgument;
  lockstep_async_t* handle = nullptr;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    auto it = c->pending.find(reduce_handle->tag);
    if (it == c->pending.end()) return pcclInvalidArgument;
    handle = it->second;
    c->pending.erase(it);
  }
  lockstep_reduce_info_t info{};
  lockstep_status_t status = lockstep_async_wait(handle, &info);
  if (status == LOCKSTEP_OK) fill_info(reduce_info_out, info);
  return to_pccl(status, Call::kCollective);
}

pcclResult_t pcclAllReduceMultipleWithRetry(const pcclReduceOpDescriptor_t* descriptors, size_t count,
                                            const pcclComm_t* comm, pcclReduceInfo_t* reduce_info_out,
                                            int max_in_flight) {
  PCCL_REQUIRE_INIT();
  pcclComm_t* c = find_comm(comm);
  if (c == nullptr || (descriptors == nullptr && count > 0)) return pcclInvalidArgument;
  if (max_in_flight < 1) {
    complain("pcclAllReduceMultipleWithRetry", "max_in_flight must be at least 1");
    return pcclInvalidArgument;
  }
  if (count > kMultipleMax) {
    complain("pcclAllReduceMultipleWithRetry", "at most " + std::to_string(kMultipleMax) + " descriptors");
    return pcclInvalidArgument;
  }
  return guarded("pcclAllReduceMultipleWithRetry", [&] {
    std::vector<lockstep_reduce_desc_t> descs(count);
    std::string why;
    for (std::size_t i = 0; i < count; ++i) {
      if (!to_reduce_desc(descriptors[i].sendbuf, descriptors[i].recvbuf, descriptors[i].descriptor, &descs[i], &why)) {
        complain("pcclAllReduceMultipleWithRetry", "descriptor " + std::to_string(i) + ": " + why);
        return pcclInvalidArgument;
      }
    }
    std::vector<lockstep_reduce_info_t> infos(count);
    lockstep_status_t status = lockstep_comm_all_reduce_multiple_with_retry(
        c->comm, descs.data(), count, static_cast<std::size_t>(max_in_flight), infos.data());
    if (status == LOCKSTEP_OK && reduce_info_out != nullptr) {
      // One info for all: the bytes of every operation, and the world of the last.
      pcclReduceInfo_t sum{};
      for (const lockstep_reduce_info_t& info : infos) {
        sum.local_world_size = info.world_size;
        sum.tx_bytes += info.bytes_sent;
        sum.rx_bytes += info.bytes_received;
      }
      *reduce_info_out = sum;
    }
    return to_pccl(status, Call::kCollective);
  });
}

pcclResult_t pcclSynchronizeSharedState(const pcclComm_t* comm, pcclSharedState_t* shared_state,
                                        pcclSharedStateSyncInfo_t* sync_info_out) {
  PCCL_REQUIRE_INIT();
  pcclComm_t* c = find_comm(comm);
  if (c == nullptr || shared_state == nullptr || (shared_state->infos == nullptr && shared_state->count > 0)) {
    return pcclInvalidArgument;
  }
  if (shared_state->count > kTensorsMax) {
    complain("pcclSynchronizeSharedState", "at most " + std::to_string(kTensorsMax) + " tensors");
    return pcclInvalidArgument;
  }
  return guarded("pcclSynchronizeSharedState", [&] {
    std::vector<lockstep_tensor_t> tensors(shared_state->count);
    for (std::size_t i = 0; i < shared_state->count; ++i) {
      const pcclTensorInfo_t& info = shared_state->infos[i];
      auto dtype = to_dtype(raw(info.datatype));
      const std::int32_t device = raw(info.device_type);
      std::string why;
      if (info.name == nullptr) why = "name is NULL";
      else if (!dtype) why = "datatype " + std::to_string(raw(info.datatype)) + " is not a pcclDataType_t";
      else if (device == pcclDeviceCuda) why = "CUDA tensors are not supported (pcclGetBuildInfo: no CUDA)";
      else if (device != pcclDeviceCpu) why = "device_type " + std::to_string(device) + " is not a pcclDeviceType_t";
      if (!why.empty()) {
        complain("pcclSynchronizeSharedState", "tensor " + std::to_string(i) + ": " + why);
        return pcclInvalidArgument;
      }
      tensors[i] = lockstep_tensor_t{};
      tensors[i].key = info.name;
      tensors[i].data = info.data;
      tensors[i].count = info.count;
      tensors[i].dtype = *dtype;
      tensors[i].device = LOCKSTEP_DEVICE_CPU;
      // A C bool may hold any byte; read it as one.
      unsigned char allow = 0;
      std::memcpy(&allow, &info.allow_content_inequality, 1);
      tensors[i].allow_content_inequality = allow != 0 ? 1 : 0;
    }
    lockstep_shared_state_t state{};
    state.revision = shared_state->revision;
    state.tensors = tensors.data();
    state.count = tensors.size();
    lockstep_sync_info_t info{};
    lockstep_status_t status = lockstep_comm_sync_shared_state(c->comm, &state, LOCKSTEP_SYNC_ENFORCE_POPULAR, &info);
    if (status == LOCKSTEP_OK) {
      shared_state->revision = state.revision;
      if (sync_info_out != nullptr) {
        sync_info_out->tx_bytes = info.bytes_sent;
        sync_info_out->rx_bytes = info.bytes_received;
      }
    }
    return to_pccl(status, Call::kSync);
  });
}

pcclResult_t pcclCreateMaster(ccoip_socket_address_t listen_address, pcclMasterInstance_t** master_out) {
  PCCL_REQUIRE_INIT();
  if (master_out == nullptr) return pcclInvalidArgument;
  return guarded("pcclCreateMaster", [&] {
    std::string why;
    auto host = inet_host(listen_address, &why);
    if (!host) {
      complain("pcclCreateMaster", "listen_address: " + why);
      return pcclInvalidArgument;
    }
    lockstep_master_config_t config;
    lockstep_master_config_init(&config);
    config.listen_host = host->c_str();
    config.listen_port = listen_address.port;
    if (!master_options_from_env(&config, &why)) {
      complain("pcclCreateMaster", why);
      return pcclInvalidArgument;
    }
    lockstep_master_t* master = nullptr;
    lockstep_status_t status = lockstep_master_create(&config, &master);
    if (status != LOCKSTEP_OK) return to_pccl(status, Call::kGeneral);
    auto* handle = new pcclMasterInstance_t;
    handle->master = master;
    publish(live_masters(), handle, master_out);
    return pcclSuccess;
  });
}

pcclResult_t pcclRunMaster(pcclMasterInstance_t* master) {
  PCCL_REQUIRE_INIT();
  pcclMasterInstance_t* m = find_master(master);
  if (m == nullptr) return pcclInvalidArgument;
  pcclResult_t r = to_pccl(lockstep_master_run(m->master), Call::kGeneral);
  if (r == pcclSuccess) m->running = true;
  return r;
}

pcclResult_t pcclInterruptMaster(pcclMasterInstance_t* master) {
  PCCL_REQUIRE_INIT();
  pcclMasterInstance_t* m = find_master(master);
  if (m == nullptr) return pcclInvalidArgument;
  pcclResult_t r = to_pccl(lockstep_master_interrupt(m->master), Call::kGeneral);
  if (r == pcclSuccess) m->interrupted = true;
  return r;
}

pcclResult_t pcclMasterAwaitTermination(pcclMasterInstance_t* master) {
  PCCL_REQUIRE_INIT();
  pcclMasterInstance_t* m = find_master(master);
  if (m == nullptr) return pcclInvalidArgument;
  if (!m->running || !m->interrupted) {
    complain("pcclMasterAwaitTermination", "the master is not running or was not interrupted: it would never end");
    return pcclInvalidUsage;
  }
  return to_pccl(lockstep_master_await(m->master), Call::kGeneral);
}

pcclResult_t pcclDestroyMaster(pcclMasterInstance_t* master) {
  PCCL_REQUIRE_INIT();
  if (!retire(live_masters(), master)) return pcclInvalidArgument;
  lockstep_master_destroy(master->master);
  delete master;
  return pcclSuccess;
}

// Like PCCL's, the one call that needs no pcclInit.
pcclResult_t pcclGetBuildInfo(pcclBuildInfo_t* info_out) {
  if (info_out == nullptr) return pcclInvalidArgument;
  info_out->has_cuda_support = false;
  return pcclSuccess;
}

}  // extern "C"
