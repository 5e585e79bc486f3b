/* A program built against an older lockstep.h and run with today's liblockstep: the
 * promise of docs/abi.md. It compiles against tests/capi/abi/v1/lockstep/lockstep.h, the
 * public header frozen as of the first version with size fields (0.2.0, soname 1), never
 * against include/; once the configs grow, the library knows fields this program does
 * not. Until then, a smaller struct (the frozen configs cut before their secret fields,
 * as a program of a version that ended there would have them) stands for such a program.
 * Checked: init writes only the caller's bytes; create reads only them and gives the
 * documented defaults to the rest (the bytes after the caller's struct hold garbage
 * that fails or crashes create if read); the same for the per-call structs (a shorter
 * descriptor, info and member array); sizes no version can have are refused with
 * INVALID_ARGUMENT and a message naming the struct; a newer program's larger struct is
 * accepted while its unknown bytes are zero. */
#define _POSIX_C_SOURCE 200809L
#include <lockstep/lockstep.h>

#ifndef LOCKSTEP_FROZEN_HEADER_V1
#error "old_program.c must compile against the frozen header in tests/capi/abi/v1"
#endif

#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int failures = 0;
static pthread_mutex_t failures_mutex = PTHREAD_MUTEX_INITIALIZER;
#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      pthread_mutex_lock(&failures_mutex);                                     \
      failures++;                                                              \
      pthread_mutex_unlock(&failures_mutex);                                   \
    }                                                                          \
  } while (0)

#define GARBAGE 0xA5
#define SLACK_BYTES 64

/* Each config lives in a buffer longer than itself, so that bytes a library wrongly
 * wrote or read beyond the caller's struct_size can be seen. */
typedef union {
  lockstep_master_config_t config;
  unsigned char bytes[sizeof(lockstep_master_config_t) + SLACK_BYTES];
} master_buffer_t;
typedef union {
  lockstep_comm_config_t config;
  unsigned char bytes[sizeof(lockstep_comm_config_t) + SLACK_BYTES];
} comm_buffer_t;

static int all_garbage(const unsigned char* bytes, size_t from, size_t to) {
  size_t i;
  for (i = from; i < to; ++i) {
    if (bytes[i] != GARBAGE) return 0;
  }
  return 1;
}

/* The library's log lines (stderr) during one call, to check its message. */
static FILE* captured = NULL;
static int saved_stderr = -1;
static void capture_begin(void) {
  fflush(stderr);
  captured = tmpfile();
  saved_stderr = dup(2);
  dup2(fileno(captured), 2);
}
static void capture_end(char* out, size_t capacity) {
  size_t n;
  fflush(stderr);
  dup2(saved_stderr, 2);
  close(saved_stderr);
  rewind(captured);
  n = fread(out, 1, capacity - 1, captured);
  out[n] = '\0';
  fclose(captured);
}

/* lockstep_comm_create with config->struct_size = size; expects INVALID_ARGUMENT and a
 * log line containing `expected`. */
static void check_refused(comm_buffer_t* buffer, size_t size, const char* expected) {
  char log[4096];
  lockstep_comm_t* comm = NULL;
  lockstep_status_t status;
  buffer->config.struct_size = (uint32_t)size;
  capture_begin();
  status = lockstep_comm_create(&buffer->config, &comm);
  capture_end(log, sizeof log);
  CHECK(status == LOCKSTEP_STATUS_INVALID_ARGUMENT && comm == NULL);
  if (strstr(log, expected) == NULL) {
    fprintf(stderr, "struct_size %zu: expected \"%s\" in the log, got: %s\n", size, expected, log);
    failures++;
  }
}

/* An older program's per-call structs, shorter than the frozen ones: a descriptor
 * without quantization and tag (NONE and 0 by default), an info without
 * bytes_received, members without host and ports; garbage after each. */
static void check_short_call_structs(lockstep_comm_t* comm) {
  const size_t desc_size = offsetof(lockstep_reduce_desc_t, quantization);
  const size_t info_size = offsetof(lockstep_reduce_info_t, bytes_received);
  const size_t member_size = offsetof(lockstep_member_t, host);
  union {
    lockstep_reduce_desc_t desc;
    unsigned char bytes[sizeof(lockstep_reduce_desc_t) + SLACK_BYTES];
  } desc;
  union {
    lockstep_reduce_info_t info;
    unsigned char bytes[sizeof(lockstep_reduce_info_t) + SLACK_BYTES];
  } info;
  union {
    lockstep_member_t members[2];
    unsigned char bytes[2 * sizeof(lockstep_member_t)];
  } view;
  size_t count = 0;
  double values[3] = {0.5, 1.5, 2.5};
  memset(&desc, GARBAGE, sizeof desc);
  desc.desc.src = values;
  desc.desc.dst = values;
  desc.desc.count = 3;
  desc.desc.dtype = LOCKSTEP_F64;
  desc.desc.op = LOCKSTEP_MAX;
  memset(&info, GARBAGE, sizeof info);
  CHECK(lockstep_comm_all_reduce_sized(comm, &desc.desc, desc_size, &info.info, info_size) == LOCKSTEP_OK);
  CHECK(info.info.world_size == 2);
  CHECK(all_garbage(info.bytes, info_size, sizeof info));
  CHECK(values[2] == 2.5);
  memset(&view, GARBAGE, sizeof view);
  CHECK(lockstep_comm_get_membership_sized(comm, view.members, member_size, 2, &count) == LOCKSTEP_OK && count == 2);
  CHECK(view.members[0].rank == 0);
  CHECK(all_garbage(view.bytes, 2 * member_size, sizeof view));
  /* A descriptor size no version has. */
  CHECK(lockstep_comm_all_reduce_sized(comm, &desc.desc, 3, NULL, sizeof(lockstep_reduce_info_t)) ==
        LOCKSTEP_STATUS_INVALID_ARGUMENT);
}

/* The second peer of run_peer's run (a collective needs two): joins with the same
 * config and takes part in the same all-reduces, with whole structs. */
static void* partner(void* arg) {
  const lockstep_comm_config_t* config = (const lockstep_comm_config_t*)arg;
  lockstep_comm_t* comm = NULL;
  lockstep_reduce_desc_t desc;
  float values[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  double doubles[3] = {0.5, 1.5, 2.5};
  CHECK(lockstep_comm_create(config, &comm) == LOCKSTEP_OK);
  if (comm == NULL) return NULL;
  CHECK(lockstep_comm_connect(comm) == LOCKSTEP_OK);
  memset(&desc, 0, sizeof desc);
  desc.src = values;
  desc.dst = values;
  desc.count = 4;
  desc.dtype = LOCKSTEP_F32;
  desc.op = LOCKSTEP_SUM;
  desc.tag = 1;
  CHECK(lockstep_comm_all_reduce(comm, &desc, NULL) == LOCKSTEP_OK && values[3] == 8.0f);
  desc.src = doubles;
  desc.dst = doubles;
  desc.count = 3;
  desc.dtype = LOCKSTEP_F64;
  desc.op = LOCKSTEP_MAX;
  desc.tag = 0;
  CHECK(lockstep_comm_all_reduce(comm, &desc, NULL) == LOCKSTEP_OK && doubles[2] == 2.5);
  CHECK(lockstep_comm_destroy(comm) == LOCKSTEP_OK);
  return NULL;
}

/* Joins the master at `port` with the config (alone first), admits a partner, checks an
 * all-reduce of the two, leaves. */
static void run_peer(const lockstep_comm_config_t* config) {
  lockstep_comm_t* comm = NULL;
  lockstep_reduce_desc_t desc;
  lockstep_reduce_info_t info;
  int64_t world = 0;
  int pending = 0;
  pthread_t other;
  float values[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  CHECK(lockstep_comm_create(config, &comm) == LOCKSTEP_OK);
  if (comm == NULL) return;
  CHECK(lockstep_comm_connect(comm) == LOCKSTEP_OK);
  CHECK(lockstep_comm_get_attribute(comm, LOCKSTEP_ATTR_GLOBAL_WORLD_SIZE, &world) == LOCKSTEP_OK && world == 1);
  CHECK(pthread_create(&other, NULL, partner, (void*)config) == 0);
  while (!pending) {
    CHECK(lockstep_comm_are_peers_pending(comm, &pending) == LOCKSTEP_OK);
    if (!pending) {
      const struct timespec ten_ms = {0, 10 * 1000 * 1000};
      nanosleep(&ten_ms, NULL);
    }
  }
  CHECK(lockstep_comm_update_topology(comm) == LOCKSTEP_OK);
  CHECK(lockstep_comm_get_attribute(comm, LOCKSTEP_ATTR_GLOBAL_WORLD_SIZE, &world) == LOCKSTEP_OK && world == 2);
  memset(&desc, 0, sizeof desc);
  desc.src = values;
  desc.dst = values;
  desc.count = 4;
  desc.dtype = LOCKSTEP_F32;
  desc.op = LOCKSTEP_SUM;
  desc.quantization = LOCKSTEP_QUANT_NONE;
  desc.tag = 1;
  CHECK(lockstep_comm_all_reduce(comm, &desc, &info) == LOCKSTEP_OK && info.world_size == 2);
  CHECK(values[3] == 8.0f);
  check_short_call_structs(comm);
  CHECK(pthread_join(other, NULL) == 0);
  CHECK(lockstep_comm_destroy(comm) == LOCKSTEP_OK);
}

/* A master on an ephemeral loopback port from the caller's config (of its struct_size). */
static lockstep_master_t* start_master(lockstep_master_config_t* config, uint16_t* out_port) {
  lockstep_master_t* master = NULL;
  config->listen_host = "127.0.0.1";
  config->listen_port = 0;
  CHECK(lockstep_master_create(config, &master) == LOCKSTEP_OK);
  if (master == NULL) return NULL;
  CHECK(lockstep_master_run(master) == LOCKSTEP_OK);
  CHECK(lockstep_master_port(master, out_port) == LOCKSTEP_OK);
  return master;
}

static void stop_master(lockstep_master_t* master) {
  if (master == NULL) return;
  CHECK(lockstep_master_interrupt(master) == LOCKSTEP_OK);
  CHECK(lockstep_master_await(master) == LOCKSTEP_OK);
  CHECK(lockstep_master_destroy(master) == LOCKSTEP_OK);
}

int main(void) {
  /* The configs of an older version, cut before their secret fields: everything after
   * them takes its default (no secret, clear data plane, default handshake limits). */
  const size_t old_master_size = offsetof(lockstep_master_config_t, secret_file);
  const size_t old_comm_size = offsetof(lockstep_comm_config_t, secret_file);
  master_buffer_t master_buffer;
  comm_buffer_t comm_buffer;
  lockstep_master_t* master = NULL;
  uint16_t port = 0;

  /* 1. The frozen header's structs, whole: init fills exactly sizeof of them. */
  memset(&master_buffer, GARBAGE, sizeof master_buffer);
  CHECK(lockstep_master_config_init(&master_buffer.config) == LOCKSTEP_OK);
  CHECK(master_buffer.config.struct_size == sizeof(lockstep_master_config_t));
  CHECK(all_garbage(master_buffer.bytes, sizeof(lockstep_master_config_t), sizeof master_buffer));
  CHECK(master_buffer.config.listen_port == LOCKSTEP_DEFAULT_MASTER_PORT);
  CHECK(master_buffer.config.heartbeat_timeout_ms == 5000 && master_buffer.config.secret_file == NULL);
  master = start_master(&master_buffer.config, &port);

  memset(&comm_buffer, GARBAGE, sizeof comm_buffer);
  CHECK(lockstep_comm_config_init(&comm_buffer.config) == LOCKSTEP_OK);
  CHECK(comm_buffer.config.struct_size == sizeof(lockstep_comm_config_t));
  CHECK(all_garbage(comm_buffer.bytes, sizeof(lockstep_comm_config_t), sizeof comm_buffer));
  CHECK(strcmp(comm_buffer.config.master_host, "127.0.0.1") == 0);
  CHECK(comm_buffer.config.master_port == LOCKSTEP_DEFAULT_MASTER_PORT && comm_buffer.config.p2p_pool_size == 1);
  CHECK(comm_buffer.config.base_port == -1 && comm_buffer.config.connect_timeout_ms == 10000);
  CHECK(comm_buffer.config.p2p_stall_timeout_ms == 30000 && comm_buffer.config.encrypt_data == 0);
  CHECK(comm_buffer.config.secret_file == NULL && comm_buffer.config.secret == NULL);
  comm_buffer.config.master_port = port;
  comm_buffer.config.base_port = 0;
  run_peer(&comm_buffer.config);
  stop_master(master);

  /* 2. An older program's smaller configs: init leaves the bytes after them alone, and
   * create reads none of them (a non-NULL secret_file or encrypt_data read from there
   * would crash or fail it). */
  memset(&master_buffer, GARBAGE, sizeof master_buffer);
  CHECK(lockstep_master_config_init_sized(&master_buffer.config, old_master_size) == LOCKSTEP_OK);
  CHECK(master_buffer.config.struct_size == old_master_size);
  CHECK(all_garbage(master_buffer.bytes, old_master_size, sizeof master_buffer));
  CHECK(master_buffer.config.heartbeat_timeout_ms == 5000 && master_buffer.config.peers_max == 0);
  master = start_master(&master_buffer.config, &port);

  memset(&comm_buffer, GARBAGE, sizeof comm_buffer);
  CHECK(lockstep_comm_config_init_sized(&comm_buffer.config, old_comm_size) == LOCKSTEP_OK);
  CHECK(comm_buffer.config.struct_size == old_comm_size);
  CHECK(all_garbage(comm_buffer.bytes, old_comm_size, sizeof comm_buffer));
  CHECK(strcmp(comm_buffer.config.master_host, "127.0.0.1") == 0 && comm_buffer.config.base_port == -1);
  CHECK(comm_buffer.config.p2p_stall_timeout_ms == 30000);
  comm_buffer.config.master_port = port;
  comm_buffer.config.base_port = 0;
  run_peer(&comm_buffer.config);
  stop_master(master);

  /* 3. Sizes that no version of the struct has. */
  memset(&comm_buffer, 0, sizeof comm_buffer);
  CHECK(lockstep_comm_config_init(&comm_buffer.config) == LOCKSTEP_OK);
  comm_buffer.config.base_port = 0;
  check_refused(&comm_buffer, 0, "lockstep_comm_config_t.struct_size is 0, which no version of the struct has");
  check_refused(&comm_buffer, 4, "lockstep_comm_config_t.struct_size is 4, which no version of the struct has");
  check_refused(&comm_buffer, sizeof(lockstep_comm_config_t) + 1, "which no version of the struct has");
  check_refused(&comm_buffer, 1u << 20, "lockstep_comm_config_t.struct_size is 1048576, which no version");
  CHECK(lockstep_comm_config_init_sized(&comm_buffer.config, 4) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
  CHECK(lockstep_master_config_init_sized(&master_buffer.config, 0) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
  CHECK(lockstep_comm_config_init_sized(NULL, sizeof(lockstep_comm_config_t)) == LOCKSTEP_STATUS_INVALID_ARGUMENT);
  master_buffer.config.struct_size = 2;
  CHECK(lockstep_master_create(&master_buffer.config, &master) == LOCKSTEP_STATUS_INVALID_ARGUMENT);

  /* 4. A newer program's larger struct (larger than any library will know; as large as
   * the bound allows): its unknown fields at their defaults (zero) are accepted; one
   * that is set is refused, not ignored. */
  {
    static union {
      lockstep_comm_config_t config;
      unsigned char bytes[4096];
    } newer;
    lockstep_comm_t* comm = NULL;
    memset(&newer, GARBAGE, sizeof newer);
    CHECK(lockstep_comm_config_init_sized(&newer.config, sizeof newer) == LOCKSTEP_OK);
    CHECK(newer.config.struct_size == sizeof newer && newer.bytes[sizeof newer - 1] == 0);
    newer.config.base_port = 0;
    CHECK(lockstep_comm_create(&newer.config, &comm) == LOCKSTEP_OK);
    CHECK(lockstep_comm_destroy(comm) == LOCKSTEP_OK);
    newer.bytes[sizeof newer - 1] = 1;
    {
      char log[4096];
      lockstep_status_t status;
      comm = NULL;
      capture_begin();
      status = lockstep_comm_create(&newer.config, &comm);
      capture_end(log, sizeof log);
      CHECK(status == LOCKSTEP_STATUS_INVALID_ARGUMENT && comm == NULL);
      CHECK(strstr(log, "byte 4095 is set: a field of a newer lockstep.h that this library does not have") != NULL);
    }
  }

  if (failures == 0) printf("ABI test (program built against the frozen v1 header) passed\n");
  return failures == 0 ? 0 : 1;
}
