/* The public header compiled as strict C99, and the C API used from C: an embedded
 * master, one communicator that joins it, an agree, the attributes and the view. */
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

  CHECK(lockstep_version() == LOCKSTEP_VERSION_HEX);
  CHECK(strlen(lockstep_version_string()) >= 5);
  for (code = 0; code <= (int)LOCKSTEP_STATUS_INTERRUPTED; ++code) {
    CHECK(lockstep_status_string((lockstep_status_t)code) != NULL);
  }
  CHECK(lockstep_master_create(NULL, &master) == LOCKSTEP_STATUS_INVALID_ARGUMENT);

  CHECK(lockstep_master_config_init(&master_config) == LOCKSTEP_OK);
  CHECK(master_config.listen_port == LOCKSTEP_DEFAULT_MASTER_PORT);
  master_config.listen_host = "127.0.0.1";
  master_config.listen_port = 0;
  CHECK(lockstep_master_create(&master_config, &master) == LOCKSTEP_OK);
  CHECK(lockstep_master_run(master) == LOCKSTEP_OK);
  CHECK(lockstep_master_port(master, &port) == LOCKSTEP_OK);
  CHECK(port != 0);

  CHECK(lockstep_comm_config_init(&comm_config) == LOCKSTEP_OK);
  comm_config.master_port = port;
  comm_config.base_port = 0;
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
  CHECK(lockstep_comm_update_topology(comm) == LOCKSTEP_OK);
  CHECK(lockstep_comm_destroy(comm) == LOCKSTEP_OK);

  CHECK(lockstep_master_interrupt(master) == LOCKSTEP_OK);
  CHECK(lockstep_master_await(master) == LOCKSTEP_OK);
  CHECK(lockstep_master_destroy(master) == LOCKSTEP_OK);
  if (failures == 0) printf("c99 API test passed\n");
  return failures == 0 ? 0 : 1;
}
