// How lockstep's statuses become PCCL's thirteen result codes (the table of
// docs/pccl.md). The same lockstep status may mean different things to a PCCL program
// depending on the call that returned it: a lost peer is pcclRankConnectionLost for a
// collective or a sync (retry it), pcclUpdateTopologyFailed for update topology (call it
// again). Nothing but LOCKSTEP_OK maps to pcclSuccess, and every value, known or not,
// maps to one of the thirteen codes (PCCL's Python package raises on any other).
#pragma once

#include <lockstep/lockstep.h>
#include <pccl.h>

namespace lockstep::pccl {

// The kind of call that returned a status.
enum class Call {
  kGeneral,           // create, attributes, are-peers-pending, the master, awaiting bookkeeping
  kConnect,           // pcclConnect
  kCollective,        // all-reduce (blocking, async, multiple with retry)
  kSync,              // pcclSynchronizeSharedState
  kUpdateTopology,    // pcclUpdateTopology
  kOptimizeTopology,  // pcclOptimizeTopology
};

// A failure the call's participants all got, after which the same call may be made
// again (with the survivors).
inline pcclResult_t retryable(Call call) {
  switch (call) {
    case Call::kUpdateTopology: return pcclUpdateTopologyFailed;
    case Call::kOptimizeTopology: return pcclTopologyOptimizationFailed;
    case Call::kConnect: return pcclRankConnectionFailed;
    case Call::kGeneral:
    case Call::kCollective:
    case Call::kSync: break;
  }
  return pcclRankConnectionLost;
}

inline pcclResult_t to_pccl(lockstep_status_t status, Call call) {
  switch (status) {
    case LOCKSTEP_OK: return pcclSuccess;
    case LOCKSTEP_STATUS_INVALID_ARGUMENT: return pcclInvalidArgument;
    // lockstep's NOT_INITIALIZED is an operation before connect, a usage error to PCCL
    // (whose pcclNotInitialized, a call before pcclInit, the library returns itself).
    case LOCKSTEP_STATUS_NOT_INITIALIZED:
    case LOCKSTEP_STATUS_INVALID_USAGE:
    case LOCKSTEP_STATUS_WRONG_THREAD: return pcclInvalidUsage;
    case LOCKSTEP_STATUS_TOO_FEW_PEERS: return pcclTooFewPeers;
    case LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS: return pcclPendingAsyncOps;
    case LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE: return pcclNoSharedStateAvailable;
    case LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED: return pcclUpdateTopologyFailed;
    case LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED: return pcclTopologyOptimizationFailed;
    // The communicator is finished: a PCCL program ends or reconnects, never retries in place.
    case LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED:
    case LOCKSTEP_STATUS_MASTER_CONNECTION_LOST:
    case LOCKSTEP_STATUS_NOT_SERVING:
    case LOCKSTEP_STATUS_KICKED:
    case LOCKSTEP_STATUS_REJECTED:
    case LOCKSTEP_STATUS_AUTHENTICATION_FAILED:
    case LOCKSTEP_STATUS_REVISION_VIOLATION:
    case LOCKSTEP_STATUS_SHARED_STATE_MISMATCH: return pcclMasterConnectionFailed;
    // Failed on every participant; call it again.
    case LOCKSTEP_STATUS_PEER_CONNECTION_FAILED:
    case LOCKSTEP_STATUS_PEER_CONNECTION_LOST:
    case LOCKSTEP_STATUS_OPERATION_MISMATCH:
    case LOCKSTEP_STATUS_HASH_MISMATCH:
    case LOCKSTEP_STATUS_VIEW_CHANGED:
    case LOCKSTEP_STATUS_NON_FINITE_CONTRIBUTION: return retryable(call);
    // The master link broke or timed out: outside a collective or a sync the
    // communicator cannot go on.
    case LOCKSTEP_STATUS_PROTOCOL_ERROR:
    case LOCKSTEP_STATUS_TIMEOUT:
      return call == Call::kGeneral || call == Call::kConnect ? pcclMasterConnectionFailed : retryable(call);
    // Not reachable through PCCL's calls (the key-value store, a destroyed communicator).
    case LOCKSTEP_STATUS_INTERNAL_ERROR:
    case LOCKSTEP_STATUS_INTERRUPTED:
    case LOCKSTEP_STATUS_KEY_NOT_FOUND:
    case LOCKSTEP_STATUS_LIMIT_EXCEEDED: break;
  }
  return pcclInternalError;
}

}  // namespace lockstep::pccl
