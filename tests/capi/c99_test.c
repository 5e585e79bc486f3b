/* The public header compiled as strict C99, and the C API used from C: an embedded
 * master, one communicator that joins it, an agree, the attributes and the view, the
 * content hash, a shared-state sync of a lone peer, and the communicator's counters. */
#include <lockstep/lockstep.h>

#include <stdio.h>
#include <string.h>

static int failures = 0;
#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      failures++;                                                     \
    }                                                                 \
  } while (0)

int main(void) {
  lockstep_master_config_t master_config;
  lockstep_master_t* master = NULL;
  lockstep_comm_config_t comm_config;
  lockstep_comm_t* comm = NULL;
  uint16_t port = 0;
  int result = 0;
  int64_t world = 0;
  lockstep_member_t members[4];
  size_t count = 0;
  uint32_t rank = 99;
  int code;
  float weights[1000];
  uint8_t step[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  lockstep_tensor_t tensors[2];
  lockstep_shared_state_t state;
  lockstep_sync_info_t info;
  char hex[33];
  char hex_again[33];
  int i;
  lockstep_reduce_desc_t desc;
  lockstep_async_t* handle = NULL;
  lockstep_counters_t counters;
  uint64_t counters_sent_before_size_checks = 0;
  lockstep_reduce_info_t reduce_info;

  CHECK(lockstep_version() == LOCKSTEP_VERSION_HEX);
  CHECK(strlen(lockstep_version_string()) >= 5);
  for (code = 0; code <= (int)LOCKSTEP_STATUS_AUTHENTICATION_FAILED; ++code) {
    CHECK(lockstep_status_string((lockstep_status_t)code) != NULL);
    CHECK(strcmp(lockstep_status_name((lockstep_status_t)code), "UNKNOWN_STATUS") != 0);
  }
  CHECK(strcmp(lockstep_status_name(LOCKSTEP_STATUS_PEER_CONNECTION_LOST), "PEER_CONNECTION_LOST") == 0);
  CHECK(strcmp(lockstep_status_name((lockstep_status_t)99), "UNKNOWN_STATUS") == 0);
  CHECK(lockstep_master_create(NULL, &master) == LOCKSTEP_STATUS_INVALID_ARGUMENT);

  CHECK(lockstep_master_config_init(&master_config) == LOCKSTEP_OK);
  CHECK(master_config.listen_port == LOCKSTEP_DEFAULT_MASTER_PORT);
  CHECK(master_config.struct_size == sizeof master_config);
  CHECK(master_config.http_listen == NULL && master_config.http_token_file == NULL && master_config.http_insecure == 0);
  master_config.listen_host = "127.0.0.1";
  master_config.listen_port = 0;
  /* The HTTP endpoint: a non-loopback address needs a token (or http_insecure). */
  master_config.http_listen = "0.0.0.0:0";
  CHECK(lockstep_master_create(&master_config, &master) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
  master_config.http_listen = "127.0.0.1";
  CHECK(lockstep_master_create(&master_config, &master) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
  master_config.http_listen = "127.0.0.1:0";
  master_config.http_token_file = "/nonexistent/token";
  CHECK(lockstep_master_create(&master_config, &master) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
  master_config.http_token_file = NULL;
  CHECK(lockstep_master_create(&master_config, &master) == LOCKSTEP_OK);
  CHECK(lockstep_master_http_port(master, &port) == LOCKSTEP_STATUS_INVALID_USAGE); /* not running yet */
  CHECK(lockstep_master_run(master) == LOCKSTEP_OK);
  CHECK(lockstep_master_http_port(master, &port) == LOCKSTEP_OK);
  CHECK(port != 0);
  CHECK(lockstep_master_port(master, &port) == LOCKSTEP_OK);
  CHECK(port != 0);

  CHECK(lockstep_comm_config_init(&comm_config) == LOCKSTEP_OK);
  CHECK(comm_config.struct_size == sizeof comm_config); /* docs/abi.md */
  comm_config.master_port = port;
  comm_config.base_port = 0;
  CHECK(comm_config.encrypt_data == 0);
  CHECK(comm_config.failover_timeout_ms == 30000); /* failover on by default (0.16) */
  comm_config.encrypt_data = 1; /* needs a run secret, and this run has none */
  CHECK(lockstep_comm_create(&comm_config, &comm) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
  comm_config.encrypt_data = 0;
  CHECK(comm_config.no_inbound == 0 && comm_config.reserved_0_10 == 0);
  comm_config.reserved_0_10 = 1;
  CHECK(lockstep_comm_create(&comm_config, &comm) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
  comm_config.reserved_0_10 = 0;
  comm_config.no_inbound = 1; /* a peer behind a NAT: it listens on no port */
  CHECK(lockstep_comm_create(&comm_config, &comm) == LOCKSTEP_OK);
  CHECK(lockstep_comm_agree(comm, 1, &result) == LOCKSTEP_STATUS_NOT_INITIALIZED);
  CHECK(lockstep_comm_connect(comm) == LOCKSTEP_OK);
  CHECK(lockstep_comm_agree(comm, 1, &result) == LOCKSTEP_OK && result == 1);
  CHECK(lockstep_comm_agree(comm, 0, &result) == LOCKSTEP_OK && result == 0);
  CHECK(lockstep_comm_get_attribute(comm, LOCKSTEP_ATTR_GLOBAL_WORLD_SIZE, &world) == LOCKSTEP_OK && world == 1);
  CHECK(lockstep_comm_get_membership(comm, members, 0, &count) == LOCKSTEP_STATUS_INVALID_ARGUMENT && count == 1);
  CHECK(lockstep_comm_get_membership(comm, members, 4, &count) == LOCKSTEP_OK && count == 1);
  CHECK(lockstep_comm_get_rank(comm, &rank) == LOCKSTEP_OK && rank == 0);
  CHECK(members[0].rank == 0 && strcmp(members[0].host, "127.0.0.1") == 0);
  CHECK(members[0].p2p_port == 0 && members[0].shared_state_port == 0 && members[0].benchmark_port == 0);
  CHECK(lockstep_comm_update_topology(comm) == LOCKSTEP_OK);

  /* The master's key-value store: set, get (a buffer too small says the size), wait,
   * delete, KEY_NOT_FOUND, TIMEOUT, bad arguments. */
  {
    char value[16];
    size_t size = 0;
    CHECK(lockstep_comm_kv_set(comm, "step", "12345", 5) == LOCKSTEP_OK);
    CHECK(lockstep_comm_kv_get(comm, "step", value, sizeof value, &size) == LOCKSTEP_OK && size == 5 &&
          memcmp(value, "12345", 5) == 0);
    CHECK(lockstep_comm_kv_get(comm, "step", value, 2, &size) == LOCKSTEP_STATUS_INVALID_ARGUMENT && size == 5);
    CHECK(lockstep_comm_kv_wait(comm, "step", 0, value, sizeof value, &size) == LOCKSTEP_OK && size == 5);
    CHECK(lockstep_comm_kv_wait(comm, "absent", 50, value, sizeof value, &size) == LOCKSTEP_STATUS_TIMEOUT);
    CHECK(lockstep_comm_kv_delete(comm, "step") == LOCKSTEP_OK);
    CHECK(lockstep_comm_kv_get(comm, "step", value, sizeof value, &size) == LOCKSTEP_STATUS_KEY_NOT_FOUND);
    CHECK(lockstep_comm_kv_set(comm, "", "x", 1) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
    CHECK(lockstep_comm_kv_set(comm, NULL, "x", 1) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
    CHECK(lockstep_comm_kv_get(comm, "step", NULL, 0, NULL) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
    CHECK(strcmp(lockstep_status_name(LOCKSTEP_STATUS_LIMIT_EXCEEDED), "LIMIT_EXCEEDED") == 0);
  }

  /* The content hash: 32 hex digits, the same for the same bytes, different otherwise. */
  for (i = 0; i < 1000; ++i) weights[i] = (float)i * 0.5f;
  CHECK(lockstep_hash(weights, sizeof weights, hex) == LOCKSTEP_OK && strlen(hex) == 32);
  CHECK(lockstep_hash(weights, sizeof weights, hex_again) == LOCKSTEP_OK && strcmp(hex, hex_again) == 0);
  CHECK(lockstep_hash(weights, sizeof weights - 1, hex_again) == LOCKSTEP_OK && strcmp(hex, hex_again) != 0);
  CHECK(lockstep_hash(NULL, 0, hex_again) == LOCKSTEP_OK);
  CHECK(lockstep_hash(NULL, 4, hex_again) == LOCKSTEP_STATUS_INVALID_ARGUMENT);

  /* A lone peer's shared state: it is elected, moves nothing, keeps its revision. */
  tensors[0].key = "weights";
  tensors[0].data = weights;
  tensors[0].count = 1000;
  tensors[0].dtype = LOCKSTEP_F32;
  tensors[0].device = LOCKSTEP_DEVICE_CPU;
  tensors[0].allow_content_inequality = 0;
  tensors[1] = tensors[0];
  tensors[1].key = "step";
  tensors[1].data = step;
  tensors[1].count = 8;
  tensors[1].dtype = LOCKSTEP_U8;
  state.revision = 1;
  state.tensors = tensors;
  state.count = 2;
  CHECK(lockstep_comm_sync_shared_state(comm, &state, LOCKSTEP_SYNC_ENFORCE_POPULAR, &info) == LOCKSTEP_OK);
  CHECK(state.revision == 1 && info.bytes_sent == 0 && info.bytes_received == 0);
  state.revision = 2;
  CHECK(lockstep_comm_sync_shared_state(comm, &state, LOCKSTEP_SYNC_ENFORCE_POPULAR, NULL) == LOCKSTEP_OK);
  CHECK(lockstep_comm_sync_shared_state(comm, &state, (lockstep_sync_strategy_t)7, NULL) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
  tensors[1].key = "weights"; /* a duplicate key */
  CHECK(lockstep_comm_sync_shared_state(comm, &state, LOCKSTEP_SYNC_ENFORCE_POPULAR, NULL) == LOCKSTEP_STATUS_INVALID_ARGUMENT);

  memset(&desc, 0, sizeof desc); /* fields of later versions stay zero: their defaults */
  desc.src = weights;
  desc.dst = weights;
  desc.count = 1000;
  desc.dtype = LOCKSTEP_F32;
  desc.op = LOCKSTEP_SUM;
  desc.quantization = LOCKSTEP_QUANT_NONE;
  desc.tag = 8;
  /* A lone peer's collectives: TOO_FEW_PEERS, buffers untouched. */
  weights[0] = 42.0f;
  CHECK(lockstep_comm_all_reduce(comm, &desc, &reduce_info) == LOCKSTEP_STATUS_TOO_FEW_PEERS && weights[0] == 42.0f);
  /* The distribution hint (0.7): a value outside lockstep_distribution_t is refused. */
  desc.distribution = (lockstep_distribution_t)3;
  CHECK(lockstep_comm_all_reduce(comm, &desc, &reduce_info) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
  desc.distribution = LOCKSTEP_DIST_NONE;
  {
    lockstep_broadcast_desc_t broadcast = {weights, 1000, LOCKSTEP_F32, 0, 20};
    lockstep_all_gather_desc_t gather = {weights, 10, weights + 100, 100, LOCKSTEP_F32, NULL, 0, 21};
    lockstep_reduce_scatter_desc_t scatter = {weights, weights + 500, 10, LOCKSTEP_F32, LOCKSTEP_SUM,
                                              LOCKSTEP_QUANT_NONE, 22};
    CHECK(lockstep_comm_broadcast(comm, &broadcast, NULL) == LOCKSTEP_STATUS_TOO_FEW_PEERS);
    CHECK(lockstep_comm_all_gather(comm, &gather, NULL) == LOCKSTEP_STATUS_TOO_FEW_PEERS);
    CHECK(lockstep_comm_reduce_scatter(comm, &scatter, NULL) == LOCKSTEP_STATUS_TOO_FEW_PEERS);
    CHECK(lockstep_comm_barrier(comm, 23) == LOCKSTEP_STATUS_TOO_FEW_PEERS);
    broadcast.dtype = (lockstep_dtype_t)99;
    CHECK(lockstep_comm_broadcast(comm, &broadcast, NULL) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
    CHECK(lockstep_comm_barrier(NULL, 23) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
    CHECK(weights[0] == 42.0f);
  }

  /* The counters of this run: connect, update topology, two syncs, one all-reduce and
   * four other collectives, which failed (calls refused for bad arguments are not
   * operations). */
  memset(&counters, 0xff, sizeof counters);
  counters.struct_size = sizeof counters;
  CHECK(lockstep_comm_get_counters(comm, &counters) == LOCKSTEP_OK);
  CHECK(counters.struct_size == sizeof counters && counters.version == LOCKSTEP_COUNTERS_VERSION);
  CHECK(counters.operations_started == 9 && counters.operations_succeeded == 4 && counters.operations_failed == 5);
  CHECK(counters.syncs_started == 2 && counters.syncs_succeeded == 2 && counters.syncs_failed == 0);
  CHECK(counters.all_reduces_started == 1 && counters.all_reduces_succeeded == 0 && counters.all_reduces_failed == 1);
  CHECK(counters.sync_bytes_sent == 0 && counters.sync_bytes_received == 0);
  CHECK(counters.all_reduce_bytes_sent == 0);
  counters_sent_before_size_checks = counters.all_reduce_bytes_sent;
  CHECK(counters.retries == 0 && counters.optimize_topology_us == 0);
  CHECK(counters.connect_us > 0 && counters.update_topology_us > 0 && counters.sync_us > 0);
  /* An older caller's shorter struct: only its fields are written. */
  memset(&counters, 0xff, sizeof counters);
  counters.struct_size = 8;
  CHECK(lockstep_comm_get_counters(comm, &counters) == LOCKSTEP_OK);
  CHECK(counters.struct_size == 8 && counters.version == LOCKSTEP_COUNTERS_VERSION);
  CHECK(counters.operations_started == UINT64_MAX);
  counters.struct_size = 4;
  CHECK(lockstep_comm_get_counters(comm, &counters) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
  CHECK(lockstep_comm_get_counters(comm, NULL) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
  /* The pool of one slot: slot 0 is there, slot 1 is not (tests/capi/slot_bytes_test.cpp
   * runs a pool of four). */
  {
    uint64_t slot_sent = 0, slot_received = 0;
    CHECK(lockstep_comm_get_slot_bytes(comm, 0, &slot_sent, &slot_received) == LOCKSTEP_OK);
    CHECK(slot_sent <= counters_sent_before_size_checks);
    CHECK(lockstep_comm_get_slot_bytes(comm, 1, &slot_sent, &slot_received) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
  }

  /* A handle outlives its communicator: awaiting it afterwards is safe. */
  desc.tag = 9;
  CHECK(lockstep_comm_all_reduce_async(comm, &desc, &handle) == LOCKSTEP_OK);
  CHECK(lockstep_comm_destroy(comm) == LOCKSTEP_OK);
  CHECK(lockstep_async_wait(handle, NULL) == LOCKSTEP_STATUS_INTERRUPTED);

  CHECK(lockstep_master_interrupt(master) == LOCKSTEP_OK);
  CHECK(lockstep_master_await(master) == LOCKSTEP_OK);
  CHECK(lockstep_master_destroy(master) == LOCKSTEP_OK);
  if (failures == 0) printf("c99 API test passed\n");
  return failures == 0 ? 0 : 1;
}
