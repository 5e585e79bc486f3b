"""Status codes and the exception hierarchy of the lockstep package.

Every failed call raises a subclass of :class:`Error` named after the C status code
(docs/errors.md). Two group bases tell a peer failure from misuse:

* :class:`RetryableError` -- the operation failed on every participant; call the same
  operation again (with the survivors): PEER_CONNECTION_LOST, UPDATE_TOPOLOGY_FAILED,
  TOPOLOGY_OPTIMIZATION_FAILED, OPERATION_MISMATCH, HASH_MISMATCH,
  NO_SHARED_STATE_AVAILABLE.
* :class:`FatalError` -- this communicator is finished; close it and create a new one
  (a new identity): MASTER_CONNECTION_FAILED, MASTER_CONNECTION_LOST, KICKED, REJECTED,
  REVISION_VIOLATION, SHARED_STATE_MISMATCH, PROTOCOL_ERROR, AUTHENTICATION_FAILED.

Two peer conditions that no retry as such resolves derive from :class:`Error` directly:
TOO_FEW_PEERS (a collective in a group of one: wait for peers), VIEW_CHANGED (a
broadcast, all-gather or reduce-scatter after a peer left: update the topology, then
call it again with buffers sized for the new view) and NON_FINITE_CONTRIBUTION (a
peer's contribution held NaN or infinity: fix the data). KEY_NOT_FOUND and
LIMIT_EXCEEDED answer key-value store requests. Everything else (NOT_INITIALIZED,
INVALID_ARGUMENT, INVALID_USAGE, WRONG_THREAD, ...) derives from :class:`Error` directly
and is a bug in the calling program.
"""

from __future__ import annotations

import enum
from typing import Dict, Optional, Type


class Status(enum.IntEnum):
    """The C API's status codes (``lockstep_status_t``)."""

    OK = 0
    NOT_INITIALIZED = 1
    INTERNAL_ERROR = 2
    INVALID_ARGUMENT = 3
    INVALID_USAGE = 4
    TOO_FEW_PEERS = 5
    MASTER_CONNECTION_FAILED = 6
    MASTER_CONNECTION_LOST = 7
    PEER_CONNECTION_FAILED = 8
    PEER_CONNECTION_LOST = 9
    NO_SHARED_STATE_AVAILABLE = 10
    PENDING_ASYNC_OPERATIONS = 11
    UPDATE_TOPOLOGY_FAILED = 12
    TOPOLOGY_OPTIMIZATION_FAILED = 13
    KICKED = 14
    REJECTED = 15
    OPERATION_MISMATCH = 16
    PROTOCOL_ERROR = 17
    TIMEOUT = 18
    WRONG_THREAD = 19
    INTERRUPTED = 20
    REVISION_VIOLATION = 21
    SHARED_STATE_MISMATCH = 22
    HASH_MISMATCH = 23
    AUTHENTICATION_FAILED = 24
    VIEW_CHANGED = 25
    KEY_NOT_FOUND = 26
    LIMIT_EXCEEDED = 27
    NON_FINITE_CONTRIBUTION = 28
    NOT_SERVING = 29


class Error(Exception):
    """A lockstep call failed.

    Attributes:
        status: the C status code (an ``int``, also a :class:`Status`).
        status_name: the code's name, e.g. ``"PEER_CONNECTION_LOST"``.
        message: the message that came with the failure (``lockstep_comm_last_error``
            for communicator calls), also ``str(exc)``.
    """

    #: The status code a subclass stands for (overridden per subclass).
    default_status: int = Status.INTERNAL_ERROR

    def __init__(self, message: str = "", status: Optional[int] = None) -> None:
        code = self.default_status if status is None else int(status)
        try:
            name = Status(code).name
        except ValueError:
            name = "UNKNOWN_STATUS"
        if not message:
            message = name
        super().__init__(message)
        self.status: int = code
        self.status_name: str = name
        self.message: str = message

    def __reduce__(self):  # picklable across processes (multiprocessing, queues)
        return (type(self), (self.message, self.status))


class RetryableError(Error):
    """The operation failed on every participant: call the same operation again."""


class FatalError(Error):
    """This communicator is finished: close it and create a new one (a new identity)."""


class NotInitializedError(Error):
    """NOT_INITIALIZED: the communicator is not connected (and accepted) yet; call connect() first."""

    default_status = Status.NOT_INITIALIZED


class InternalError(Error):
    """INTERNAL_ERROR: a system call failed unexpectedly, or out of memory."""

    default_status = Status.INTERNAL_ERROR


class InvalidArgumentError(Error, ValueError):
    """INVALID_ARGUMENT: a bad argument (also raised by the package's own checks of
    arrays and tensors: dtype, contiguity, device, writability, sizes). A ValueError."""

    default_status = Status.INVALID_ARGUMENT


class InvalidUsageError(Error):
    """INVALID_USAGE: the call is not legal in the current state (e.g. a closed communicator,
    a tag already in flight, a second vote while one is open)."""

    default_status = Status.INVALID_USAGE


class TooFewPeersError(Error):
    """TOO_FEW_PEERS: fewer peers than the operation needs: a collective (all-reduce,
    broadcast, all-gather, reduce-scatter, barrier) in a group of one. Nothing was
    written; wait for peers (are_peers_pending, update_topology) or go on alone."""

    default_status = Status.TOO_FEW_PEERS


class MasterConnectionFailedError(FatalError):
    """MASTER_CONNECTION_FAILED: the master could not be reached within connect_timeout_ms."""

    default_status = Status.MASTER_CONNECTION_FAILED


class MasterConnectionLostError(FatalError):
    """MASTER_CONNECTION_LOST: the master closed the connection, died or went silent."""

    default_status = Status.MASTER_CONNECTION_LOST


class PeerConnectionFailedError(Error):
    """PEER_CONNECTION_FAILED: a p2p connection could not be made."""

    default_status = Status.PEER_CONNECTION_FAILED


class PeerConnectionLostError(RetryableError):
    """PEER_CONNECTION_LOST: a participant was lost; every survivor got it. Retry with
    the survivors (an all-reduce destination holds what it held before the call)."""

    default_status = Status.PEER_CONNECTION_LOST


class NoSharedStateAvailableError(RetryableError):
    """NO_SHARED_STATE_AVAILABLE: no peer may be elected; a peer restores a checkpoint
    with revision R+1 and everyone retries the sync."""

    default_status = Status.NO_SHARED_STATE_AVAILABLE


class PendingAsyncOperationsError(Error):
    """PENDING_ASYNC_OPERATIONS: collectives of this peer are still in flight; await them first."""

    default_status = Status.PENDING_ASYNC_OPERATIONS


class UpdateTopologyFailedError(RetryableError):
    """UPDATE_TOPOLOGY_FAILED: call update_topology() again (the only legal action)."""

    default_status = Status.UPDATE_TOPOLOGY_FAILED


class TopologyOptimizationFailedError(RetryableError):
    """TOPOLOGY_OPTIMIZATION_FAILED: call optimize_topology() again (the only legal action)."""

    default_status = Status.TOPOLOGY_OPTIMIZATION_FAILED


class KickedError(FatalError):
    """KICKED: the master removed this peer; rejoin with a new communicator."""

    default_status = Status.KICKED


class RejectedError(FatalError):
    """REJECTED: the master refused this peer (the message says why)."""

    default_status = Status.REJECTED


class OperationMismatchError(RetryableError):
    """OPERATION_MISMATCH: peers were in different votes or started a tag differently;
    every peer got it; call the same operation on every peer."""

    default_status = Status.OPERATION_MISMATCH


class ProtocolError(FatalError):
    """PROTOCOL_ERROR: malformed or unexpected bytes from the other side."""

    default_status = Status.PROTOCOL_ERROR


class LockstepTimeoutError(Error):
    """TIMEOUT: a bounded wait expired; retry. (Not the builtin TimeoutError.)"""

    default_status = Status.TIMEOUT


class WrongThreadError(Error):
    """WRONG_THREAD: a communicator (or an async handle) was used from a thread that does
    not own it; call from the creating (launching) thread."""

    default_status = Status.WRONG_THREAD


class LockstepInterruptedError(Error):
    """INTERRUPTED: the operation was interrupted (shutdown, or its communicator was
    closed before it was awaited). (Not the builtin InterruptedError.)"""

    default_status = Status.INTERRUPTED


class RevisionViolationError(FatalError):
    """REVISION_VIOLATION: this peer presented a revision above the group's next one and
    was removed; advance the revision by exactly one per sync."""

    default_status = Status.REVISION_VIOLATION


class SharedStateMismatchError(FatalError):
    """SHARED_STATE_MISMATCH: this peer's keys, dtypes or sizes differ from the elected
    shared state (or a send-only peer's content differs); it was removed."""

    default_status = Status.SHARED_STATE_MISMATCH


class HashMismatchError(RetryableError):
    """HASH_MISMATCH: a received tensor did not verify; every peer of the group retries the sync."""

    default_status = Status.HASH_MISMATCH


class AuthenticationFailedError(FatalError):
    """AUTHENTICATION_FAILED: the master refused this peer's proof of the run secret (no
    secret or a different one), or the master could not prove it (it runs without the
    secret or is not this run's master); nothing was registered."""

    default_status = Status.AUTHENTICATION_FAILED


class ViewChangedError(Error):
    """VIEW_CHANGED: a broadcast, all-gather or reduce-scatter (whose shapes depend on the
    world) was called, or retried, in a membership view that has lost a peer since; it
    failed on every peer before any byte moved. Call update_topology(), then call it
    again with buffers sized for the new view."""

    default_status = Status.VIEW_CHANGED


class KeyNotFoundError(Error, KeyError):
    """KEY_NOT_FOUND: the master's key-value store holds no such key (kv_get)."""

    default_status = Status.KEY_NOT_FOUND

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return Error.__str__(self)


class LimitExceededError(Error):
    """LIMIT_EXCEEDED: a bound of the master was reached (the key-value store's keys, key
    or value size, or open waits per peer); the message names the bound and its flag.
    Nothing changed."""

    default_status = Status.LIMIT_EXCEEDED


class NonFiniteContributionError(Error):
    """NON_FINITE_CONTRIBUTION: with check_finite, a peer's contribution to a float
    collective held NaN or infinity; the collective failed on every peer before any byte
    moved (buffers unchanged) and the message names the peer. Fix the data, then call it
    again."""

    default_status = Status.NON_FINITE_CONTRIBUTION


class NotServingError(FatalError):
    """NOT_SERVING: every master address tried at connect is a standby of a run with a hot
    standby (an etcd lease) or unreachable; the message names the serving master where a
    standby knows it. Give the communicator that address too, or try again once the
    takeover is over."""

    default_status = Status.NOT_SERVING


#: The exception class of every non-OK status code.
ERROR_CLASSES: Dict[int, Type[Error]] = {
    cls.default_status: cls
    for cls in (
        NotInitializedError,
        InternalError,
        InvalidArgumentError,
        InvalidUsageError,
        TooFewPeersError,
        MasterConnectionFailedError,
        MasterConnectionLostError,
        PeerConnectionFailedError,
        PeerConnectionLostError,
        NoSharedStateAvailableError,
        PendingAsyncOperationsError,
        UpdateTopologyFailedError,
        TopologyOptimizationFailedError,
        KickedError,
        RejectedError,
        OperationMismatchError,
        ProtocolError,
        LockstepTimeoutError,
        WrongThreadError,
        LockstepInterruptedError,
        RevisionViolationError,
        SharedStateMismatchError,
        HashMismatchError,
        AuthenticationFailedError,
        ViewChangedError,
        KeyNotFoundError,
        LimitExceededError,
        NonFiniteContributionError,
        NotServingError,
    )
}


def error_for_status(status: int, message: str = "") -> Error:
    """The exception instance for a status code (an unknown code gives a plain :class:`Error`)."""
    cls = ERROR_CLASSES.get(int(status), Error)
    return cls(message, int(status))
