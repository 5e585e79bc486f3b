// How the PCCL worker (pccl_worker.cpp) reports PCCL's result codes in its lines. The
// checker reads lockstep's status numbers in "code" (a stable ABI: include/lockstep/
// lockstep.h); a PCCL program sees PCCL's thirteen codes, several of which stand for
// more than one lockstep status (src/pccl/status_map.h). Each is reported as the lockstep
// status the soak's loop would meet in its place, so that the checker reads a PCCL
// worker's lines unchanged; the line also carries PCCL's own name ("status") and number
// ("pccl"). What this cannot tell apart:
//  - pcclMasterConnectionFailed is every way a communicator ends (evicted, kicked, the
//    master gone, rejected, a revision violation, a state mismatch): it is reported as
//    MASTER_CONNECTION_LOST, an eviction; so a PCCL worker removed for a revision
//    violation reads as an evicted one (an unexpected exit in the summary if nothing
//    was done to it), and its state is checked by parity instead;
//  - pcclRankConnectionLost is every retryable failure of a collective or a sync (a
//    peer lost, a hash mismatch, a view changed, a timeout): it is reported as
//    PEER_CONNECTION_LOST, and retried as the native worker retries that one; in a group
//    with native workers, an attempt that failed otherwise shows as a difference of
//    outcomes between the two kinds.
// Included by the PCCL worker (which sees no lockstep header, hence the numbers here)
// and by the checker's test, which holds them to lockstep's.
#pragma once

#include <pccl.h>

namespace lockstep::soak::pccl_codes {

// lockstep's status numbers the PCCL worker reports.
inline constexpr int kOk = 0;
inline constexpr int kNotInitialized = 1;
inline constexpr int kInternalError = 2;
inline constexpr int kInvalidArgument = 3;
inline constexpr int kInvalidUsage = 4;
inline constexpr int kTooFewPeers = 5;
inline constexpr int kMasterConnectionLost = 7;
inline constexpr int kPeerConnectionFailed = 8;
inline constexpr int kPeerConnectionLost = 9;
inline constexpr int kNoSharedStateAvailable = 10;
inline constexpr int kPendingAsyncOperations = 11;
inline constexpr int kUpdateTopologyFailed = 12;
inline constexpr int kTopologyOptimizationFailed = 13;

// The lockstep status a PCCL result is reported as ("code").
inline int lockstep_code(pcclResult_t r) {
  switch (r) {
    case pcclSuccess: return kOk;
    case pcclNotInitialized: return kNotInitialized;
    case pcclInternalError: return kInternalError;
    case pcclInvalidArgument: return kInvalidArgument;
    case pcclInvalidUsage: return kInvalidUsage;
    case pcclTooFewPeers: return kTooFewPeers;
    case pcclMasterConnectionFailed: return kMasterConnectionLost;
    case pcclRankConnectionFailed: return kPeerConnectionFailed;
    case pcclRankConnectionLost: return kPeerConnectionLost;
    case pcclNoSharedStateAvailable: return kNoSharedStateAvailable;
    case pcclPendingAsyncOps: return kPendingAsyncOperations;
    case pcclUpdateTopologyFailed: return kUpdateTopologyFailed;
    case pcclTopologyOptimizationFailed: return kTopologyOptimizationFailed;
  }
  return kInternalError;
}

// PCCL's name of a result ("status").
inline const char* pccl_name(pcclResult_t r) {
  switch (r) {
    case pcclSuccess: return "pcclSuccess";
    case pcclNotInitialized: return "pcclNotInitialized";
    case pcclInternalError: return "pcclInternalError";
    case pcclInvalidArgument: return "pcclInvalidArgument";
    case pcclInvalidUsage: return "pcclInvalidUsage";
    case pcclTooFewPeers: return "pcclTooFewPeers";
    case pcclMasterConnectionFailed: return "pcclMasterConnectionFailed";
    case pcclRankConnectionFailed: return "pcclRankConnectionFailed";
    case pcclRankConnectionLost: return "pcclRankConnectionLost";
    case pcclNoSharedStateAvailable: return "pcclNoSharedStateAvailable";
    case pcclPendingAsyncOps: return "pcclPendingAsyncOps";
    case pcclUpdateTopologyFailed: return "pcclUpdateTopologyFailed";
    case pcclTopologyOptimizationFailed: return "pcclTopologyOptimizationFailed";
  }
  return "unknown";
}

}  // namespace lockstep::soak::pccl_codes
