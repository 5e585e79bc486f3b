// The table of docs/pccl.md: how each lockstep status reaches a PCCL program, per kind
// of call. Every status value, including those no call returns yet, maps to one of
// PCCL's thirteen codes, and only LOCKSTEP_OK to pcclSuccess.
#include "pccl/status_map.h"

#include <gtest/gtest.h>

#include <map>

namespace lockstep::pccl {
namespace {

constexpr Call kCalls[] = {Call::kGeneral, Call::kConnect, Call::kCollective,
                           Call::kSync, Call::kUpdateTopology, Call::kOptimizeTopology};

TEST(PcclStatusMap, EveryStatusMapsToOneOfThirteenCodesAndOnlyOkToSuccess) {
  // Every value the enum can hold (0..31), statuses of later versions included.
  for (int value = 0; value <= 31; ++value) {
    for (Call call : kCalls) {
      pcclResult_t r = to_pccl(static_cast<lockstep_status_t>(value), call);
      EXPECT_GE(static_cast<int>(r), 0) << value;
      EXPECT_LE(static_cast<int>(r), 12) << value;
      EXPECT_EQ(r == pcclSuccess, value == LOCKSTEP_OK) << value;
    }
  }
}

TEST(PcclStatusMap, TheSameWhateverTheCall) {
  const std::map<lockstep_status_t, pcclResult_t> table = {
      // Not connected yet: a usage error (pcclNotInitialized is for calls before pcclInit).
      {LOCKSTEP_STATUS_NOT_INITIALIZED, pcclInvalidUsage},
      {LOCKSTEP_STATUS_INTERNAL_ERROR, pcclInternalError},
      {LOCKSTEP_STATUS_INVALID_ARGUMENT, pcclInvalidArgument},
      {LOCKSTEP_STATUS_INVALID_USAGE, pcclInvalidUsage},
      {LOCKSTEP_STATUS_WRONG_THREAD, pcclInvalidUsage},
      {LOCKSTEP_STATUS_TOO_FEW_PEERS, pcclTooFewPeers},
      {LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS, pcclPendingAsyncOps},
      {LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE, pcclNoSharedStateAvailable},
      {LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED, pcclUpdateTopologyFailed},
      {LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED, pcclTopologyOptimizationFailed},
      // The communicator is finished: PCCL programs end or reconnect, never retry in place.
      {LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED, pcclMasterConnectionFailed},
      {LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, pcclMasterConnectionFailed},
      {LOCKSTEP_STATUS_NOT_SERVING, pcclMasterConnectionFailed},
      {LOCKSTEP_STATUS_KICKED, pcclMasterConnectionFailed},
      {LOCKSTEP_STATUS_REJECTED, pcclMasterConnectionFailed},
      {LOCKSTEP_STATUS_AUTHENTICATION_FAILED, pcclMasterConnectionFailed},
      {LOCKSTEP_STATUS_REVISION_VIOLATION, pcclMasterConnectionFailed},
      {LOCKSTEP_STATUS_SHARED_STATE_MISMATCH, pcclMasterConnectionFailed},
      {LOCKSTEP_STATUS_INTERRUPTED, pcclInternalError},
      {LOCKSTEP_STATUS_KEY_NOT_FOUND, pcclInternalError},
      {LOCKSTEP_STATUS_LIMIT_EXCEEDED, pcclInternalError},
  };
  for (const auto& [status, expected] : table) {
    for (Call call : kCalls) EXPECT_EQ(to_pccl(status, call), expected) << status;
  }
}

TEST(PcclStatusMap, RetryableFailuresSayWhatToCallAgain) {
  const lockstep_status_t retryable[] = {
      LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, LOCKSTEP_STATUS_PEER_CONNECTION_LOST, LOCKSTEP_STATUS_OPERATION_MISMATCH,
      LOCKSTEP_STATUS_HASH_MISMATCH, LOCKSTEP_STATUS_VIEW_CHANGED, LOCKSTEP_STATUS_NON_FINITE_CONTRIBUTION};
  for (lockstep_status_t status : retryable) {
    EXPECT_EQ(to_pccl(status, Call::kCollective), pcclRankConnectionLost) << status;
    EXPECT_EQ(to_pccl(status, Call::kSync), pcclRankConnectionLost) << status;
    EXPECT_EQ(to_pccl(status, Call::kUpdateTopology), pcclUpdateTopologyFailed) << status;
    EXPECT_EQ(to_pccl(status, Call::kOptimizeTopology), pcclTopologyOptimizationFailed) << status;
    EXPECT_EQ(to_pccl(status, Call::kConnect), pcclRankConnectionFailed) << status;
  }
  // A broken or silent master link: retryable inside an operation (its attempt failed for
  // all), fatal outside one.
  for (lockstep_status_t status : {LOCKSTEP_STATUS_PROTOCOL_ERROR, LOCKSTEP_STATUS_TIMEOUT}) {
    EXPECT_EQ(to_pccl(status, Call::kCollective), pcclRankConnectionLost);
    EXPECT_EQ(to_pccl(status, Call::kUpdateTopology), pcclUpdateTopologyFailed);
    EXPECT_EQ(to_pccl(status, Call::kGeneral), pcclMasterConnectionFailed);
    EXPECT_EQ(to_pccl(status, Call::kConnect), pcclMasterConnectionFailed);
  }
}

}  // namespace
}  // namespace lockstep::pccl
