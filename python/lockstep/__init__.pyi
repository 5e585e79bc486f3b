"""Type stubs of the lockstep package (fault-tolerant collective communication).

Arrays are ``numpy.ndarray`` or CPU ``torch.Tensor`` objects, used in place through
their memory (never copied): C-contiguous, of a supported dtype, not requiring grad
(pass ``t.detach()``), writeable where lockstep writes. Anything else raises
:class:`InvalidArgumentError`. Every blocking call releases the GIL.
"""

import enum
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Type, Union

__version__: str
DEFAULT_MASTER_PORT: int

#: numpy.ndarray or torch.Tensor (CPU, contiguous)
_ArrayLike = Any
#: (src, dst_or_None, op, tag) or (src, dst_or_None, op, tag, quantization), or a dict
#: with keys src, dst, op, tag, quantization; src None: a barrier of the tag,
#: (None, None, None, tag) or {"src": None, "tag": tag}
_ReduceSpec = Union[Tuple[Any, ...], Mapping[str, Any]]
_OpLike = Union[str, int, "ReduceOp"]
_QuantizationLike = Union[None, str, int, "Quantization"]
_StrategyLike = Union[str, int, "SyncStrategy"]

# ---------------------------------------------------------------- enums

class Status(enum.IntEnum):
    """The C API's status codes (lockstep_status_t), 0..25."""

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

class DType(enum.IntEnum):
    """Element types. NumPy: uint8, int8, uint16, int16, uint32, int32, uint64, int64,
    float16, float32, float64. PyTorch: uint8, int8, int16, int32, int64, float16,
    bfloat16, float32, float64 (and uint16/32/64 where the installed torch has them)."""

    U8 = 0
    I8 = 1
    U16 = 2
    I16 = 3
    U32 = 4
    I32 = 5
    U64 = 6
    I64 = 7
    F16 = 8
    BF16 = 9
    F32 = 10
    F64 = 11

class ReduceOp(enum.IntEnum):
    """Reductions; also accepted as "sum", "avg", "prod", "max", "min". Integer sum and
    prod wrap around; integer avg is the wrapped sum divided by the world size, truncated
    toward zero; max and min propagate NaN; float16/bfloat16 compute in float32."""

    SUM = 0
    AVG = 1
    PROD = 2
    MAX = 3
    MIN = 4

class Quantization(enum.IntEnum):
    """Quantization on the wire (floating-point dtypes only): 8-bit or 4-bit codes, or a
    cast to float16/bfloat16 (float32 and float64 data only); also accepted as
    None / "none", "minmax", "zeropoint", "minmax4", "zeropoint4", "f16", "bf16"."""

    NONE = 0
    MINMAX = 1
    ZEROPOINT = 2
    MINMAX4 = 3
    ZEROPOINT4 = 4
    F16 = 5
    BF16 = 6

class SyncStrategy(enum.IntEnum):
    """Shared-state strategies; also accepted as "enforce_popular", "receive_only", "send_only"."""

    ENFORCE_POPULAR = 0
    RECEIVE_ONLY = 1
    SEND_ONLY = 2

class LogLevel(enum.IntEnum):
    ERROR = 0
    WARN = 1
    INFO = 2
    DEBUG = 3
    TRACE = 4

# ----------------------------------------------------------- exceptions

class Error(Exception):
    """A lockstep call failed. ``str(e)`` is the message (for communicator calls the
    library's ``lockstep_comm_last_error``, "NAME: detail")."""

    default_status: int
    status: int
    status_name: str
    message: str
    def __init__(self, message: str = ..., status: Optional[int] = ...) -> None: ...

class RetryableError(Error):
    """The operation failed on every participant: call the same operation again
    (PeerConnectionLost, UpdateTopologyFailed, TopologyOptimizationFailed,
    OperationMismatch, HashMismatch, NoSharedStateAvailable)."""

class FatalError(Error):
    """The communicator is finished: close it, create a new one (MasterConnectionFailed,
    MasterConnectionLost, Kicked, Rejected, RevisionViolation, SharedStateMismatch,
    ProtocolError)."""

class NotInitializedError(Error):
    """1: not connected (and accepted) yet: call connect() first."""

class InternalError(Error):
    """2: a system call failed unexpectedly, or out of memory."""

class InvalidArgumentError(Error, ValueError):
    """3: a bad argument, including the package's checks of arrays and tensors."""

class InvalidUsageError(Error):
    """4: not legal in the current state (closed communicator, tag in flight, ...)."""

class TooFewPeersError(Error):
    """5: fewer peers than the operation needs: any collective in a group of one (nothing
    was written; wait for peers or go on alone)."""

class MasterConnectionFailedError(FatalError):
    """6: the master could not be reached within connect_timeout_ms."""

class MasterConnectionLostError(FatalError):
    """7: the master closed the connection, died, or was silent."""

class PeerConnectionFailedError(Error):
    """8: a p2p connection could not be made."""

class PeerConnectionLostError(RetryableError):
    """9: a participant was lost; every survivor got it; retry with the survivors."""

class NoSharedStateAvailableError(RetryableError):
    """10: no peer may be elected (every holder of revision R+1 is gone, or all synced receive-only)."""

class PendingAsyncOperationsError(Error):
    """11: collectives of this peer are still in flight; await them first."""

class UpdateTopologyFailedError(RetryableError):
    """12: call update_topology() again."""

class TopologyOptimizationFailedError(RetryableError):
    """13: call optimize_topology() again."""

class KickedError(FatalError):
    """14: the master removed this peer."""

class RejectedError(FatalError):
    """15: the master refused this peer (the message says why)."""

class OperationMismatchError(RetryableError):
    """16: peers were in different votes, or started a tag differently."""

class ProtocolError(FatalError):
    """17: malformed or unexpected bytes from the other side."""

class LockstepTimeoutError(Error):
    """18: a bounded wait expired."""

class WrongThreadError(Error):
    """19: used from a thread that does not own the communicator / did not launch the handle."""

class LockstepInterruptedError(Error):
    """20: interrupted (shutdown, or the communicator was closed before the handle was awaited)."""

class RevisionViolationError(FatalError):
    """21: presented a revision above the group's next one; removed."""

class SharedStateMismatchError(FatalError):
    """22: keys/dtypes/sizes differ from the elected state (or send-only content differs); removed."""

class HashMismatchError(RetryableError):
    """23: a received tensor did not verify; every peer retries the sync."""

class AuthenticationFailedError(FatalError):
    """24: the run secret was not proven (missing or different secret, or not this run's master)."""

class ViewChangedError(Error):
    """25: a broadcast, all-gather or reduce-scatter was called (or retried) after a peer
    left the view; it failed on every peer before any byte moved. update_topology(), then
    call it again with buffers sized for the new view."""

class KeyNotFoundError(Error, KeyError):
    """26: the master's key-value store holds no such key."""

class LimitExceededError(Error):
    """27: a bound of the master was reached (key-value store); nothing changed."""

class NonFiniteContributionError(Error):
    """28: with check_finite, a peer's contribution held NaN or infinity; the collective
    failed on every peer before any byte moved."""

class NotServingError(FatalError):
    """29: every master address tried at connect is a standby (hot standby through etcd)
    or unreachable; the message names the serving master where a standby knows it."""


#: status code -> exception class
ERROR_CLASSES: Mapping[int, Type[Error]]

def error_for_status(status: int, message: str = ...) -> Error:
    """The exception instance of a status code (a plain Error for an unknown code)."""

# ------------------------------------------------------------- results

class ReduceInfo:
    """Frozen dataclass: the result of one collective (all-reduce, broadcast, all-gather,
    reduce-scatter, barrier)."""

    world_size: int  # peers that took part in the successful attempt
    bytes_sent: int  # bytes this peer put on the wire (headers included)
    bytes_received: int
    def __init__(self, world_size: int, bytes_sent: int, bytes_received: int) -> None: ...

class SyncInfo:
    """Frozen dataclass: the result of a shared-state sync."""

    bytes_sent: int  # tensor bytes this peer served to others
    bytes_received: int  # tensor bytes this peer received
    wire_bytes_sent: int  # the same on the wire (compressed blocks and their headers)
    wire_bytes_received: int
    def __init__(self, bytes_sent: int, bytes_received: int, wire_bytes_sent: int = 0,
                 wire_bytes_received: int = 0) -> None: ...

class Member:
    """Frozen dataclass: one entry of the membership view (ordered by rank)."""

    id: str  # 32 lowercase hex digits
    rank: int
    host: str
    p2p_port: int
    shared_state_port: int
    benchmark_port: int
    def __init__(self, id: str, rank: int, host: str, p2p_port: int, shared_state_port: int,
                 benchmark_port: int) -> None: ...

# --------------------------------------------------------------- master

class Master:
    """An in-process master. Context manager: listens on __enter__ (unless running),
    stops on __exit__."""

    def __init__(self, listen: str = "127.0.0.1:0", heartbeat_timeout_ms: int = 0, vote_timeout_ms: int = 0,
                 peers_max: int = 0, secret_file: Optional[str] = None, handshake_timeout_ms: int = 0,
                 pending_handshakes_max: int = 0, http: Optional[str] = None,
                 http_token_file: Optional[str] = None, http_insecure: bool = False, kv_keys_max: int = 0,
                 kv_key_bytes_max: int = 0, kv_value_bytes_max: int = 0,
                 newcomer_timeout_ms: int = 0, relay_port: Optional[int] = None, recovery_window_ms: int = 0,
                 recovery_quorum: int = 0, ha_etcd: Optional[str] = None, ha_key: Optional[str] = None,
                 ha_advertise: Optional[str] = None, ha_lease_ttl_s: int = 0,
                 resume_hold_ms: int = 0) -> None:
        """listen: "host:port" (port 0: ephemeral; empty host: all interfaces).
        heartbeat_timeout_ms: 0 means 5000 (range 100..3600000). vote_timeout_ms: 0 means
        off. peers_max: 0 means 1024. secret_file: the run secret (None: $LOCKSTEP_SECRET_FILE
        or no secret, which admits anyone). handshake_timeout_ms: 0 means 10000.
        pending_handshakes_max: 0 means 256. http: "host:port" of the status page,
        /api/state and /metrics (None: off; port 0: ephemeral). http_token_file: the access
        token every HTTP request must carry (Authorization: Bearer TOKEN). http_insecure:
        allow a non-loopback http host without a token. kv_keys_max, kv_key_bytes_max,
        kv_value_bytes_max: the key-value store's bounds (0: 4096, 256, 65536).
        newcomer_timeout_ms: how long a newcomer may hold an update topology before it is
        rejected (0: 5000; range 100..3600000).
        relay_port: run the relay on this port of the listen host (0: ephemeral; None: no
        relay); needs secret_file (run() raises InvalidArgumentError without one).
        recovery_window_ms: how long a master taking back a lost master's peers waits for
        all of their last view (0: 5000). recovery_quorum: how many must be back after it
        (0: a strict majority; lower is risky, docs/operations.md).
        ha_etcd: a hot standby: etcd endpoints ("http://HOST:PORT", comma-separated);
        this master serves only while it holds the run's lease (None: from the start).
        ha_key: the key the run's masters compete for (None: "/lockstep/master").
        ha_advertise: "host:port" peers reach this master at (None: the listen address).
        ha_lease_ttl_s: the lease's time to live (0: 5; 2..60).
        resume_hold_ms: a master that may replace a lost one waits this long from its
        start (a standby: its election) before newcomers found a new run (0: no wait;
        at most 3600000)."""
    def run(self) -> None:
        """Starts listening and serving on background threads; MasterConnectionFailedError
        if it cannot bind."""
    @property
    def running(self) -> bool: ...
    @property
    def port(self) -> int:
        """The listening port (InvalidUsageError before run())."""
    @property
    def address(self) -> str:
        """"host:port" to connect to (127.0.0.1 when listening on all interfaces)."""
    @property
    def http_port(self) -> int:
        """The HTTP endpoint's port (InvalidUsageError without http, or before run())."""
    @property
    def relay_port(self) -> int:
        """The relay's port (InvalidUsageError without relay_port, or before run())."""
    @property
    def http_address(self) -> str:
        """"host:port" of the HTTP endpoint (127.0.0.1 when listening on all interfaces)."""
    def interrupt(self) -> None:
        """Asks the master to stop (thread-safe, returns at once)."""
    def wait(self) -> None:
        """Blocks until the master stops (interrupt() from another thread, or Ctrl-C)."""
    def close(self) -> None:
        """Stops and frees the master (idempotent)."""
    def __enter__(self) -> "Master": ...
    def __exit__(self, *exc: Any) -> None: ...

# --------------------------------------------------------- shared state

class TensorInfo:
    """One named tensor of a SharedState."""

    key: str
    data: _ArrayLike
    allow_content_inequality: bool
    def __init__(self, key: str, data: _ArrayLike, allow_content_inequality: bool = False) -> None:
        """key: 1..255 bytes of UTF-8, unique. data: used in place. allow_content_inequality:
        differences between up-to-date peers cause no transfer (outdated peers still receive it)."""

class SharedState:
    """Named tensors kept bit-identical across the group, and a revision."""

    tensors: List[TensorInfo]
    def __init__(self, tensors: Union[Mapping[str, _ArrayLike], Sequence[TensorInfo]], revision: int = 0) -> None: ...
    @property
    def revision(self) -> int:
        """Advance by exactly one before each sync; a sync writes the group's revision here."""
    @revision.setter
    def revision(self, value: int) -> None: ...
    def __getitem__(self, key: str) -> _ArrayLike: ...

# ----------------------------------------------------------- collectives

class AsyncHandle:
    """A collective in flight (all_reduce_async, broadcast_async, all_gather_async,
    reduce_scatter_async, barrier_async). Its arrays stay referenced until it is awaited
    (or its communicator is closed: wait() then raises LockstepInterruptedError)."""

    tag: int
    def done(self) -> bool:
        """Non-blocking: whether the operation ended (successfully or not). Any thread."""
    def wait(self) -> ReduceInfo:
        """Blocks (GIL released) until it ended; returns its ReduceInfo or raises its error.
        On the launching thread only (WrongThreadError otherwise; the handle stays valid)."""
    @property
    def result(self) -> Optional[_ArrayLike]:
        """The destination array/tensor (a broadcast's buffer; None for a barrier)."""

class Communicator:
    """A peer of a run. Belongs to the thread that created it. Context manager:
    connect() is not implicit; close() on exit."""

    master: str
    def __init__(self, master: str = "127.0.0.1:48148", group: int = 0, pool_size: int = 1, base_port: int = -1,
                 connect_timeout_ms: int = 0, advertised_host: Optional[str] = None,
                 bind_host: Optional[str] = None, secret_file: Optional[str] = None,
                 secret: Optional[Union[bytes, str]] = None, inbound_handshake_timeout_ms: int = 0,
                 inbound_handshakes_max: int = 0, p2p_stall_timeout_ms: int = 0,
                 encrypt_data: bool = False, p2p_streams: int = 0,
                 tcp_congestion: Optional[str] = None, check_finite: bool = False,
                 state_compression: str = "auto", inbound: bool = True, failover_timeout_ms: int = 30_000) -> None:
        """failover_timeout_ms: once accepted, look this long for a master to take this peer
        back when its master is lost (the first address of master, then the others, comma
        separated); operations in flight end with one outcome for every peer, calls block
        meanwhile; default 30000; 0: off, the loss raises MasterConnectionLostError.
        inbound: False for a peer that accepts no inbound connection (behind a NAT): it
        listens on no port and dials its neighbours and the shared-state receivers it
        serves (connection reversal).
        check_finite: check this peer's contribution to each float collective for NaN
        and infinity first (NonFiniteContributionError on every peer, naming it).
        state_compression: "auto" (zstd blocks where the sender finds it pays) or "off".
        master: "host:port" (port 48148 if omitted). group: the peer group. pool_size: p2p
        connections per neighbour and direction. base_port: -1 first free ports above
        48148, 0 ephemeral, else the first port tried. connect_timeout_ms: 0 means 10000.
        advertised_host: the address others use to reach this peer. bind_host: the
        address the p2p sockets bind to. secret_file / secret: the run secret (a file, or
        bytes/str; None for both: $LOCKSTEP_SECRET_FILE or none); a master that cannot
        prove it raises AuthenticationFailedError. inbound_handshake_timeout_ms: 0 means
        5000. inbound_handshakes_max: 0 means 256. p2p_stall_timeout_ms: an all-reduce
        attempt in which no byte moves to or from the ring neighbours for this long fails
        (PeerConnectionLostError); 0 means 30000. encrypt_data: seal the data plane
        (all-reduce sub-chunks, shared-state transfers) with ChaCha20-Poly1305; needs a
        secret (else InvalidArgumentError); every peer of the run must set the same.
        p2p_streams: connections one all-reduce stripes over per neighbour (0 adapts, 1 to
        16 fixes). tcp_congestion: the p2p connections' congestion control (None: the
        system's)."""
    def connect(self) -> None:
        """Connects and blocks until accepted (the accepted peers' update_topology admits it)."""
    def update_topology(self) -> None:
        """Votes to accept pending peers and rewires the ring (every accepted peer; a barrier)."""
    def optimize_topology(self) -> None:
        """Measures missing bandwidths and reorders every group's ring (every accepted peer)."""
    def are_peers_pending(self) -> bool:
        """Votes whether registered peers wait to join; the same answer for all."""
    def agree(self, flag: bool) -> bool:
        """True for all only if every accepted peer of the group said True."""
    def kv_set(self, key: str, value: bytes) -> None:
        """Stores value under key in the master's key-value store (replacing it; wakes
        waiters). LimitExceededError beyond the master's bounds."""
    def kv_get(self, key: str) -> bytes:
        """The value under key; KeyNotFoundError if none."""
    def kv_wait(self, key: str, timeout_ms: int = 0) -> bytes:
        """The value under key once some peer sets it; LockstepTimeoutError after
        timeout_ms (0: no deadline)."""
    def kv_delete(self, key: str) -> None:
        """Removes key (no error if absent)."""
    def agree_value(self, value: bytes, mode: str = "all_equal") -> bytes:
        """The same value (up to 4096 bytes) for every accepted peer of the group: the
        common proposal ("all_equal"; OperationMismatchError if any differs) or the
        proposal of the peer accepted first ("first_accepted")."""
    @property
    def rank(self) -> int: ...
    @property
    def id(self) -> str:
        """32 lowercase hex digits."""
    def membership(self) -> List[Member]: ...
    @property
    def world_size(self) -> int: ...
    @property
    def group_world_size(self) -> int: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def largest_group_size(self) -> int: ...
    @property
    def last_error(self) -> str: ...
    def counters(self) -> Dict[str, int]:
        """What this communicator did since it was created: bytes (all_reduce_bytes_sent,
        all_reduce_bytes_received, sync_bytes_sent, sync_bytes_received), operations
        (operations_started/succeeded/failed, all_reduces_*, syncs_*), retries, and
        microseconds per call kind (connect_us, update_topology_us, optimize_topology_us,
        sync_us, all_reduce_us). Thread-safe."""
    def slot_bytes(self) -> List[Tuple[int, int]]:
        """(sent, received) ring bytes per p2p pool slot (entry k: slot k, one per slot of
        pool_size), over every all-reduce attempt since creation. Their sums equal the
        counters' all_reduce_bytes_* less all-reduces of up to 16 KiB (they travel with
        the votes, on no slot). Thread-safe."""
    def all_reduce(self, src: _ArrayLike, dst: Optional[_ArrayLike] = None, *, op: _OpLike = "sum",
                   quantization: _QuantizationLike = None, tag: int = 0,
                   residual: Optional[_ArrayLike] = None) -> ReduceInfo:
        """All-reduces src into dst (None: in place). Same dtype and element count; dst
        writeable. On PeerConnectionLostError dst holds what it held before. Alone in the
        group: TooFewPeersError (dst untouched)."""
    def all_reduce_async(self, src: _ArrayLike, dst: Optional[_ArrayLike] = None, *, op: _OpLike = "sum",
                         quantization: _QuantizationLike = None, tag: int = 0,
                         residual: Optional[_ArrayLike] = None) -> AsyncHandle:
        """Starts an all-reduce; distinct tags for operations in flight at once."""
    def broadcast(self, buf: _ArrayLike, root: int, *, tag: int = 0) -> ReduceInfo:
        """Copies buf of the peer of rank root (a rank of the view) into buf on every other
        peer, in place. The same tag, root, size and dtype on every peer (else
        OperationMismatchError for all); a root outside the view: InvalidArgumentError on
        every peer. On failure every buf, the root's included, is as before. After a peer
        left: ViewChangedError on every peer until update_topology(); alone: TooFewPeersError."""
    def broadcast_async(self, buf: _ArrayLike, root: int, *, tag: int = 0) -> AsyncHandle:
        """Starts a broadcast (result: buf)."""
    def all_gather(self, src: Optional[_ArrayLike], dst: Optional[_ArrayLike] = None, *,
                   counts: Optional[Sequence[int]] = None, tag: int = 0) -> _ArrayLike:
        """Every rank's src, in rank order, into dst on every peer; returns dst (None: a new
        array/tensor of src's kind and dtype, shape (world, *src.shape), or (sum(counts),)).
        counts (all-gatherv): one element count per rank of the view, the same on every
        peer; src then holds this rank's count (None or empty where it is 0). src may be a
        view of this rank's place in dst. A dst too small or counts not one per rank on any
        peer: InvalidArgumentError on every peer; sizes, dtypes or counts that differ between
        peers: OperationMismatchError for all. On failure dst is as before. After a peer
        left: ViewChangedError on every peer until update_topology(); alone: TooFewPeersError."""
    def all_gather_async(self, src: Optional[_ArrayLike], dst: Optional[_ArrayLike] = None, *,
                         counts: Optional[Sequence[int]] = None, tag: int = 0) -> AsyncHandle:
        """Starts an all-gather (result: dst, allocated here if None)."""
    def reduce_scatter(self, src: _ArrayLike, dst: Optional[_ArrayLike] = None, *, op: _OpLike = "sum",
                       quantization: _QuantizationLike = None, tag: int = 0) -> _ArrayLike:
        """Reduces src (world x n elements on every peer) and leaves elements
        [r x n, (r+1) x n) of the result in rank r's dst (n elements; None: a new 1-D
        array/tensor); returns dst. op and quantization as for all_reduce. On failure dst
        is as before. After a peer left: ViewChangedError on every peer until
        update_topology(); alone: TooFewPeersError."""
    def reduce_scatter_async(self, src: _ArrayLike, dst: Optional[_ArrayLike] = None, *, op: _OpLike = "sum",
                             quantization: _QuantizationLike = None, tag: int = 0) -> AsyncHandle:
        """Starts a reduce-scatter (result: dst, allocated here if None)."""
    def barrier(self, *, tag: int = 0) -> None:
        """Returns once every peer of the group entered the barrier of this tag (the same
        outcome for all; alone: TooFewPeersError)."""
    def barrier_async(self, *, tag: int = 0) -> AsyncHandle:
        """Enters the barrier of this tag (result: None)."""
    def all_reduce_multiple_with_retry(self, ops: Iterable[_ReduceSpec], max_in_flight: int = 4) -> List[ReduceInfo]:
        """Runs the operations, at most max_in_flight at once, retrying those that failed
        because a peer was lost; raises the first other error (TooFewPeersError once one
        peer is left). An operation whose src is None is a barrier of its tag."""
    def sync_shared_state(self, state: SharedState, strategy: _StrategyLike = "enforce_popular") -> SyncInfo:
        """Synchronizes the shared state with the group (every accepted peer calls it)."""
    def close(self) -> None:
        """Leaves the run and frees the communicator (idempotent); from the owning thread."""
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> "Communicator": ...
    def __exit__(self, *exc: Any) -> None: ...

def hash(data: Any) -> str:
    """lockstep_hash of the bytes of a contiguous array, CPU tensor or bytes-like object:
    32 lowercase hex digits (the shared state's content digest)."""

def set_log_level(level: Union[str, int, LogLevel]) -> None:
    """Process-wide log level: "error", "warn", "info", "debug", "trace"."""

def status_string(status: int) -> str:
    """The C library's description of a status code."""
