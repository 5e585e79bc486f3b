// Names and descriptions of the status codes, shared by the C API and the logs.
#include "common/status.h"

#include <cstring>

namespace lockstep {

const char* status_name(StatusCode code) {
  switch (code) {
    case LOCKSTEP_OK: return "OK";
    case LOCKSTEP_STATUS_NOT_INITIALIZED: return "NOT_INITIALIZED";
    case LOCKSTEP_STATUS_INTERNAL_ERROR: return "INTERNAL_ERROR";
    case LOCKSTEP_STATUS_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case LOCKSTEP_STATUS_INVALID_USAGE: return "INVALID_USAGE";
    case LOCKSTEP_STATUS_TOO_FEW_PEERS: return "TOO_FEW_PEERS";
    case LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED: return "MASTER_CONNECTION_FAILED";
    case LOCKSTEP_STATUS_MASTER_CONNECTION_LOST: return "MASTER_CONNECTION_LOST";
    case LOCKSTEP_STATUS_PEER_CONNECTION_FAILED: return "PEER_CONNECTION_FAILED";
    case LOCKSTEP_STATUS_PEER_CONNECTION_LOST: return "PEER_CONNECTION_LOST";
    case LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE: return "NO_SHARED_STATE_AVAILABLE";
    case LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS: return "PENDING_ASYNC_OPERATIONS";
    case LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED: return "UPDATE_TOPOLOGY_FAILED";
    case LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED: return "TOPOLOGY_OPTIMIZATION_FAILED";
    case LOCKSTEP_STATUS_KICKED: return "KICKED";
    case LOCKSTEP_STATUS_REJECTED: return "REJECTED";
    case LOCKSTEP_STATUS_OPERATION_MISMATCH: return "OPERATION_MISMATCH";
    case LOCKSTEP_STATUS_PROTOCOL_ERROR: return "PROTOCOL_ERROR";
    case LOCKSTEP_STATUS_TIMEOUT: return "TIMEOUT";
    case LOCKSTEP_STATUS_WRONG_THREAD: return "WRONG_THREAD";
    case LOCKSTEP_STATUS_INTERRUPTED: return "INTERRUPTED";
    case LOCKSTEP_STATUS_REVISION_VIOLATION: return "REVISION_VIOLATION";
    case LOCKSTEP_STATUS_SHARED_STATE_MISMATCH: return "SHARED_STATE_MISMATCH";
    case LOCKSTEP_STATUS_HASH_MISMATCH: return "HASH_MISMATCH";
    case LOCKSTEP_STATUS_AUTHENTICATION_FAILED: return "AUTHENTICATION_FAILED";
    case LOCKSTEP_STATUS_VIEW_CHANGED: return "VIEW_CHANGED";
    case LOCKSTEP_STATUS_KEY_NOT_FOUND: return "KEY_NOT_FOUND";
    case LOCKSTEP_STATUS_LIMIT_EXCEEDED: return "LIMIT_EXCEEDED";
    case LOCKSTEP_STATUS_NON_FINITE_CONTRIBUTION: return "NON_FINITE_CONTRIBUTION";
    case LOCKSTEP_STATUS_NOT_SERVING: return "NOT_SERVING";
  }
  return "UNKNOWN_STATUS";
}

std::string Status::to_string() const {
  std::string out = status_name(code_);
  if (!message_.empty()) {
    out += ": ";
    out += message_;
  }
  return out;
}

}  // namespace lockstep

extern "C" const char* lockstep_status_name(lockstep_status_t status) {
  // Read as an int: C may pass any int, and loading an out-of-range C++ enum is undefined.
  int raw = 0;
  static_assert(sizeof raw == sizeof status);
  std::memcpy(&raw, &status, sizeof raw);
  if (raw < 0 || raw > static_cast<int>(lockstep::kStatusCodeMax)) return "UNKNOWN_STATUS";
  return lockstep::status_name(static_cast<lockstep::StatusCode>(raw));
}

extern "C" const char* lockstep_status_string(lockstep_status_t status) {
  switch (status) {
    case LOCKSTEP_OK: return "success";
    case LOCKSTEP_STATUS_NOT_INITIALIZED: return "not initialized: connect the communicator first";
    case LOCKSTEP_STATUS_INTERNAL_ERROR: return "internal error";
    case LOCKSTEP_STATUS_INVALID_ARGUMENT: return "invalid argument";
    case LOCKSTEP_STATUS_INVALID_USAGE: return "invalid usage: the call is not legal in the current state";
    case LOCKSTEP_STATUS_TOO_FEW_PEERS: return "too few peers";
    case LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED: return "could not connect to the master";
    case LOCKSTEP_STATUS_MASTER_CONNECTION_LOST: return "connection to the master lost";
    case LOCKSTEP_STATUS_PEER_CONNECTION_FAILED: return "could not connect to a peer";
    case LOCKSTEP_STATUS_PEER_CONNECTION_LOST: return "a participating peer was lost; retry with the survivors";
    case LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE: return "no shared state available: every holder of the current revision is gone";
    case LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS: return "async operations are still pending";
    case LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED: return "update topology failed; call it again";
    case LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED: return "topology optimization failed; call it again";
    case LOCKSTEP_STATUS_KICKED: return "this peer was removed from the run by the master";
    case LOCKSTEP_STATUS_REJECTED: return "the master refused this peer";
    case LOCKSTEP_STATUS_OPERATION_MISMATCH: return "peers requested different operations";
    case LOCKSTEP_STATUS_PROTOCOL_ERROR: return "protocol error: malformed or unexpected message";
    case LOCKSTEP_STATUS_TIMEOUT: return "timed out";
    case LOCKSTEP_STATUS_WRONG_THREAD: return "called from a thread that does not own the communicator";
    case LOCKSTEP_STATUS_INTERRUPTED: return "interrupted";
    case LOCKSTEP_STATUS_REVISION_VIOLATION: return "shared-state revision violation: advance the revision by exactly one per sync";
    case LOCKSTEP_STATUS_SHARED_STATE_MISMATCH: return "shared state differs from the elected one in keys, dtypes or sizes (or a send-only peer's content differs)";
    case LOCKSTEP_STATUS_HASH_MISMATCH: return "a transferred shared-state tensor did not match its hash; retry the sync";
    case LOCKSTEP_STATUS_AUTHENTICATION_FAILED: return "the other side could not prove the run secret (missing or different secret, or not this run's master)";
    case LOCKSTEP_STATUS_VIEW_CHANGED: return "a peer left since the last update topology; a collective whose shape depends on the world needs a new view";
    case LOCKSTEP_STATUS_KEY_NOT_FOUND: return "the key-value store holds no such key";
    case LOCKSTEP_STATUS_LIMIT_EXCEEDED: return "a bound of the master was reached; nothing changed";
    case LOCKSTEP_STATUS_NON_FINITE_CONTRIBUTION: return "a peer's contribution held NaN or infinity; the collective failed on every peer";
    case LOCKSTEP_STATUS_NOT_SERVING: return "this master is a standby: another master holds the run's lease and serves its peers";
  }
  return "unknown status";
}
