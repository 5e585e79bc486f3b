/* The README's C quick start: join a run, wait for a second peer, make each step
 * atomic with agree(), and admit newcomers between steps.
 * Usage: quickstart [HOST [PORT [STEPS]]] */
#define _POSIX_C_SOURCE 200809L
#include <lockstep/lockstep.h>

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int main(int argc, char** argv) {
  lockstep_comm_config_t config;
  lockstep_comm_t* comm = NULL;
  lockstep_status_t s;
  int steps = argc > 3 ? atoi(argv[3]) : 100;
  int step;

  lockstep_comm_config_init(&config); /* master at 127.0.0.1:48148, group 0 */
  if (argc > 1) config.master_host = argv[1];
  if (argc > 2) config.master_port = (uint16_t)atoi(argv[2]);
  config.base_port = 0; /* ephemeral ports for this peer's sockets */

  if (lockstep_comm_create(&config, &comm) != LOCKSTEP_OK) return 1;
  s = lockstep_comm_connect(comm); /* blocks until accepted into the run */
  if (s != LOCKSTEP_OK) {
    fprintf(stderr, "connect: %s: %s\n", lockstep_status_string(s), lockstep_comm_last_error(comm));
    lockstep_comm_destroy(comm);
    return 1;
  }
  step = 0;
  while (step < steps) {
    int all_ok = 0;
    int pending = 0;
    uint32_t rank = 0;
    int64_t world = 0;
    lockstep_comm_get_attribute(comm, LOCKSTEP_ATTR_PEER_GROUP_WORLD_SIZE, &world);
    if (world >= 2) {
      /* ... the step's work; then every peer of the group agrees that it succeeded: */
      s = lockstep_comm_agree(comm, /* my part succeeded */ 1, &all_ok);
      if (s != LOCKSTEP_OK && s != LOCKSTEP_STATUS_PEER_CONNECTION_LOST) break; /* kicked, master gone */
      if (s == LOCKSTEP_OK) {
        lockstep_comm_get_rank(comm, &rank);
        printf("step %d: %s, rank %u of %lld\n", step, all_ok ? "committed" : "skipped", rank, (long long)world);
        ++step;
      } /* else a peer died during the step: redo it with the survivors */
    } else {
      struct timespec pause = {0, 50 * 1000 * 1000};
      nanosleep(&pause, NULL); /* alone: wait for peers */
    }
    /* The end of every step: admit newcomers, refresh the view after departures. */
    s = lockstep_comm_are_peers_pending(comm, &pending);
    if (s != LOCKSTEP_OK) break;
    if (pending) {
      while ((s = lockstep_comm_update_topology(comm)) == LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED) {
      }
      if (s != LOCKSTEP_OK) break;
    }
  }
  if (s != LOCKSTEP_OK) fprintf(stderr, "%s: %s\n", lockstep_status_string(s), lockstep_comm_last_error(comm));
  lockstep_comm_destroy(comm);
  return s == LOCKSTEP_OK ? 0 : 1;
}
