// What lets the checker read the PCCL worker's lines unchanged (tools/soak/pccl_worker.cpp),
// checked against lockstep itself: the digest it computes without the C API equals
// lockstep_hash, byte for byte, on the sizes the soak
// hashes and around the leaf size; and the statuses it reports are lockstep's numbers,
// with a finished communicator read as an eviction and a lost peer as a retryable failure.
#include "checker.h"
#include "pccl_codes.h"
#include "worker_common.h"

#include <lockstep/lockstep.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep::soak {
namespace {

std::string lockstep_digest(const void* data, std::size_t bytes) {
  char hex[33] = {};
  EXPECT_EQ(lockstep_hash(data, bytes, hex), LOCKSTEP_OK);
  return hex;
}

TEST(SoakPcclWorker, LocalDigestIsLockstepHash) {
  constexpr std::size_t kLeaf = std::size_t{1} << 20;
  std::vector<float> values((3 * kLeaf + 12345) / sizeof(float));
  fill(values, 7);
  for (const std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{8}, std::size_t{4096}, kLeaf - 1, kLeaf,
                                  kLeaf + 1, 2 * kLeaf, 3 * kLeaf + 12345}) {
    EXPECT_EQ(local_digest(values.data(), bytes), lockstep_digest(values.data(), bytes)) << bytes << " bytes";
  }
  WorkerOptions o;
  o.state_elements = 65536;
  TrainState state(o);
  state.steps[0] = 42;
  EXPECT_EQ(state_hash(state, local_digest), state_hash(state, lockstep_digest));
}

TEST(SoakPcclWorker, ReportsLockstepsNumbers) {
  using pccl_codes::lockstep_code;
  EXPECT_EQ(lockstep_code(pcclSuccess), LOCKSTEP_OK);
  EXPECT_EQ(lockstep_code(pcclNotInitialized), LOCKSTEP_STATUS_NOT_INITIALIZED);
  EXPECT_EQ(lockstep_code(pcclInternalError), LOCKSTEP_STATUS_INTERNAL_ERROR);
  EXPECT_EQ(lockstep_code(pcclInvalidArgument), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(lockstep_code(pcclInvalidUsage), LOCKSTEP_STATUS_INVALID_USAGE);
  EXPECT_EQ(lockstep_code(pcclTooFewPeers), LOCKSTEP_STATUS_TOO_FEW_PEERS);
  EXPECT_EQ(lockstep_code(pcclMasterConnectionFailed), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST);
  EXPECT_EQ(lockstep_code(pcclRankConnectionFailed), LOCKSTEP_STATUS_PEER_CONNECTION_FAILED);
  EXPECT_EQ(lockstep_code(pcclRankConnectionLost), LOCKSTEP_STATUS_PEER_CONNECTION_LOST);
  EXPECT_EQ(lockstep_code(pcclNoSharedStateAvailable), LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE);
  EXPECT_EQ(lockstep_code(pcclPendingAsyncOps), LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS);
  EXPECT_EQ(lockstep_code(pcclUpdateTopologyFailed), LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
  EXPECT_EQ(lockstep_code(pcclTopologyOptimizationFailed), LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED);
  // The worker exits on pcclMasterConnectionFailed only: the checker must read it as a
  // finished communicator that an evicted (stopped, then resumed) peer may end with.
  EXPECT_TRUE(finished_status(lockstep_code(pcclMasterConnectionFailed)));
  EXPECT_TRUE(eviction_status(lockstep_code(pcclMasterConnectionFailed)));
  for (int r = pcclSuccess; r <= pcclTopologyOptimizationFailed; ++r) {
    if (r == pcclMasterConnectionFailed) continue;
    EXPECT_FALSE(finished_status(lockstep_code(static_cast<pcclResult_t>(r)))) << pccl_codes::pccl_name(static_cast<pcclResult_t>(r));
  }
}

}  // namespace
}  // namespace lockstep::soak
