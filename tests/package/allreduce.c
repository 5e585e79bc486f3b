/* A 2-peer all-reduce over the installed C API, for the package tests (deb_test.sh):
 * built with `pkg-config --cflags --libs lockstep` against the installed header and
 * library. Joins the run at HOST:PORT, waits for a second peer, sums rank+1 scaled
 * vectors of f32 and i64, and checks the sums bit for bit.
 * Usage: allreduce HOST PORT */
#define _POSIX_C_SOURCE 200809L
#include <lockstep/lockstep.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { kCount = 4096, kWaitSteps = 2400 /* x 25 ms: one minute */ };

static int fail(lockstep_comm_t* comm, const char* what, lockstep_status_t s) {
  fprintf(stderr, "%s: %s: %s\n", what, lockstep_status_string(s), comm ? lockstep_comm_last_error(comm) : "");
  lockstep_comm_destroy(comm);
  return 1;
}

int main(int argc, char** argv) {
  static float values[kCount];
  static int64_t counts[kCount];
  lockstep_comm_config_t config;
  lockstep_comm_t* comm = NULL;
  lockstep_status_t s;
  lockstep_reduce_desc_t desc;
  lockstep_reduce_info_t info;
  int64_t world = 0;
  uint32_t rank = 0;
  int step;
  int i;

  if (argc != 3) {
    fprintf(stderr, "usage: allreduce HOST PORT\n");
    return 2;
  }
  lockstep_comm_config_init(&config);
  config.master_host = argv[1];
  config.master_port = (uint16_t)atoi(argv[2]);
  config.base_port = 0;
  s = lockstep_comm_create(&config, &comm);
  if (s != LOCKSTEP_OK) return fail(NULL, "create", s);
  s = lockstep_comm_connect(comm);
  if (s != LOCKSTEP_OK) return fail(comm, "connect", s);
  /* The first peer admits the second one; the second is accepted when connect returns. */
  for (step = 0; step < kWaitSteps; ++step) {
    int pending = 0;
    lockstep_comm_get_attribute(comm, LOCKSTEP_ATTR_PEER_GROUP_WORLD_SIZE, &world);
    if (world >= 2) break;
    s = lockstep_comm_are_peers_pending(comm, &pending);
    if (s != LOCKSTEP_OK) return fail(comm, "are_peers_pending", s);
    if (pending) {
      while ((s = lockstep_comm_update_topology(comm)) == LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) {
      }
      if (s != LOCKSTEP_OK) return fail(comm, "update_topology", s);
    } else {
      struct timespec pause = {0, 25 * 1000 * 1000};
      nanosleep(&pause, NULL);
    }
  }
  if (world != 2) return fail(comm, "waiting for a second peer", LOCKSTEP_STATUS_TIMEOUT);
  s = lockstep_comm_get_rank(comm, &rank);
  if (s != LOCKSTEP_OK) return fail(comm, "get_rank", s);

  for (i = 0; i < kCount; ++i) {
    values[i] = (float)i * (float)(rank + 1);
    counts[i] = (int64_t)(rank + 1) << 40;
  }
  memset(&desc, 0, sizeof desc); /* fields of later versions stay zero: their defaults */
  desc.src = values;
  desc.dst = values;
  desc.count = kCount;
  desc.dtype = LOCKSTEP_F32;
  desc.op = LOCKSTEP_SUM;
  desc.quantization = LOCKSTEP_QUANT_NONE;
  desc.tag = 0;
  s = lockstep_comm_all_reduce(comm, &desc, &info);
  if (s != LOCKSTEP_OK) return fail(comm, "all_reduce f32", s);
  desc.src = counts;
  desc.dst = counts;
  desc.dtype = LOCKSTEP_I64;
  desc.tag = 1;
  s = lockstep_comm_all_reduce(comm, &desc, &info);
  if (s != LOCKSTEP_OK) return fail(comm, "all_reduce i64", s);
  for (i = 0; i < kCount; ++i) {
    /* ranks 0 and 1: i * 1 + i * 2, exact in f32 below 2^24 */
    if (values[i] != (float)(3 * i) || counts[i] != (int64_t)3 << 40) {
      fprintf(stderr, "wrong sum at %d: %g, %lld\n", i, (double)values[i], (long long)counts[i]);
      lockstep_comm_destroy(comm);
      return 1;
    }
  }
  printf("C peer rank %u of %u: sums ok (library %s)\n", rank, info.world_size, lockstep_version_string());
  lockstep_comm_destroy(comm);
  return 0;
}
