"""lockstep: fault-tolerant collective communication for distributed training.

Python bindings of the C API (include/lockstep/lockstep.h). Arrays are NumPy arrays or
CPU PyTorch tensors, used in place through their memory: never copied. Every blocking
call releases the GIL::

    import lockstep, numpy as np

    with lockstep.Master("127.0.0.1:0") as master:            # or a lockstep-master process
        with lockstep.Communicator(master.address, base_port=0) as comm:
            comm.connect()                                     # blocks until accepted
            grad = np.ones(1024, dtype=np.float32)
            comm.all_reduce(grad, op="avg")                    # in place

Main names:

* :class:`Master` -- an in-process master (context manager: starts on enter, stops on exit).
* :class:`Communicator` -- a peer: ``connect``, ``update_topology``, ``optimize_topology``,
  ``are_peers_pending``, ``agree``, ``rank``, ``id``, ``membership``, ``world_size``,
  ``group_world_size``, ``num_groups``, ``largest_group_size``, ``all_reduce``,
  ``broadcast``, ``all_gather``, ``reduce_scatter``, ``barrier`` (each also ``*_async``),
  ``all_reduce_async``, ``all_reduce_multiple_with_retry``, ``sync_shared_state``, ``close``.
* :class:`SharedState`, :class:`TensorInfo` -- the tensors kept identical by a sync.
* :class:`ReduceInfo`, :class:`SyncInfo`, :class:`Member`, :class:`AsyncHandle` -- results.
* :func:`hash` -- the shared-state content digest of an array's bytes.
* :class:`Error` and one subclass per status code; :class:`RetryableError` (retry the
  operation) and :class:`FatalError` (make a new communicator) group them.

Threading: a communicator belongs to the thread that created it, and an async handle
is awaited on the thread that launched it (WrongThreadError otherwise).
"""

from . import _lockstep
from ._communicator import (
    AsyncHandle,
    Communicator,
    Member,
    ReduceInfo,
    SharedState,
    SyncInfo,
    TensorInfo,
)
from ._enums import (
    Distribution,
    DType,
    LogLevel,
    Quantization,
    ReduceOp,
    SyncStrategy,
    set_log_level,
    status_string,
)
from ._errors import (
    ERROR_CLASSES,
    AuthenticationFailedError,
    Error,
    FatalError,
    HashMismatchError,
    InternalError,
    InvalidArgumentError,
    InvalidUsageError,
    KickedError,
    LockstepInterruptedError,
    LockstepTimeoutError,
    MasterConnectionFailedError,
    MasterConnectionLostError,
    NoSharedStateAvailableError,
    NotInitializedError,
    OperationMismatchError,
    PeerConnectionFailedError,
    PeerConnectionLostError,
    PendingAsyncOperationsError,
    ProtocolError,
    RejectedError,
    RetryableError,
    RevisionViolationError,
    SharedStateMismatchError,
    Status,
    TooFewPeersError,
    TopologyOptimizationFailedError,
    UpdateTopologyFailedError,
    ViewChangedError,
    KeyNotFoundError,
    LimitExceededError,
    NonFiniteContributionError,
    NotServingError,
    WrongThreadError,
    error_for_status,
)
from ._master import DEFAULT_MASTER_PORT, Master

# A failing status of the C module raises this package's exception classes.
_lockstep._set_error_factory(error_for_status)

#: The version of the loaded C library ("MAJOR.MINOR.PATCH").
__version__: str = _lockstep.version_string()

#: :func:`lockstep.hash` -- the content digest (``lockstep_hash``) of an array's,
#: tensor's or buffer's bytes as 32 lowercase hex digits.
from ._buffers import content_hash as hash  # noqa: E402  (shadows the builtin inside this module only)

__all__ = [
    "__version__",
    "DEFAULT_MASTER_PORT",
    "AsyncHandle",
    "Communicator",
    "Distribution",
    "DType",
    "LogLevel",
    "Master",
    "Member",
    "Quantization",
    "ReduceInfo",
    "ReduceOp",
    "SharedState",
    "SyncInfo",
    "SyncStrategy",
    "TensorInfo",
    "hash",
    "set_log_level",
    "status_string",
    "Status",
    "ERROR_CLASSES",
    "error_for_status",
    "Error",
    "RetryableError",
    "FatalError",
    "NotInitializedError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidUsageError",
    "TooFewPeersError",
    "MasterConnectionFailedError",
    "MasterConnectionLostError",
    "PeerConnectionFailedError",
    "PeerConnectionLostError",
    "NoSharedStateAvailableError",
    "PendingAsyncOperationsError",
    "UpdateTopologyFailedError",
    "TopologyOptimizationFailedError",
    "KickedError",
    "RejectedError",
    "OperationMismatchError",
    "ProtocolError",
    "LockstepTimeoutError",
    "WrongThreadError",
    "LockstepInterruptedError",
    "RevisionViolationError",
    "SharedStateMismatchError",
    "HashMismatchError",
    "AuthenticationFailedError",
    "ViewChangedError",
    "KeyNotFoundError",
    "LimitExceededError",
    "NonFiniteContributionError",
    "NotServingError",
]
