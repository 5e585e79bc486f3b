"""The Python API over lockstep._lockstep (see the package docstring)."""

from __future__ import annotations

import dataclasses
import enum
import sys
import threading
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _lockstep
from ._errors import (
    InvalidArgumentError,
    error_for_status,
)

_lockstep._set_error_factory(error_for_status)

DEFAULT_MASTER_PORT = 48148

# ------------------------------------------------------------------------ enums


class DType(enum.IntEnum):
    """Element types (``lockstep_dtype_t``)."""

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
    """Reduction operations (``lockstep_reduce_op_t``). Integer sum and prod wrap around;
    integer avg is the wrapped sum divided by the world size, truncated toward zero;
    max and min propagate NaN; f16 and bf16 compute in f32."""

    SUM = 0
    AVG = 1
    PROD = 2
    MAX = 3
    MIN = 4


class Quantization(enum.IntEnum):
    """Quantization on the wire (floating-point dtypes only)."""

    NONE = 0
    MINMAX = 1
    ZEROPOINT = 2


class SyncStrategy(enum.IntEnum):
    """Shared-state sync strategies (``lockstep_sync_strategy_t``)."""

    ENFORCE_POPULAR = 0
    RECEIVE_ONLY = 1
    SEND_ONLY = 2


class LogLevel(enum.IntEnum):
    ERROR = 0
    WARN = 1
    INFO = 2
    DEBUG = 3
    TRACE = 4


_ITEMSIZE = {
    DType.U8: 1, DType.I8: 1, DType.U16: 2, DType.I16: 2, DType.U32: 4, DType.I32: 4,
    DType.U64: 8, DType.I64: 8, DType.F16: 2, DType.BF16: 2, DType.F32: 4, DType.F64: 8,
}

_NUMPY_DTYPES = {
    "uint8": DType.U8, "int8": DType.I8, "uint16": DType.U16, "int16": DType.I16,
    "uint32": DType.U32, "int32": DType.I32, "uint64": DType.U64, "int64": DType.I64,
    "float16": DType.F16, "float32": DType.F32, "float64": DType.F64,
    "bfloat16": DType.BF16,  # ml_dtypes' bfloat16, where installed
}

_TORCH_DTYPE_NAMES = {
    "uint8": DType.U8, "int8": DType.I8, "uint16": DType.U16, "int16": DType.I16,
    "uint32": DType.U32, "int32": DType.I32, "uint64": DType.U64, "int64": DType.I64,
    "float16": DType.F16, "bfloat16": DType.BF16, "float32": DType.F32, "float64": DType.F64,
}
_torch_dtype_map: Optional[Dict[Any, DType]] = None


def _torch_dtypes(torch: Any) -> Dict[Any, DType]:
    global _torch_dtype_map
    if _torch_dtype_map is None:
        # uint16/uint32/uint64 exist in newer PyTorch releases only.
        _torch_dtype_map = {
            getattr(torch, name): code for name, code in _TORCH_DTYPE_NAMES.items() if hasattr(torch, name)
        }
    return _torch_dtype_map


def _parse_op(op: Union[str, int, ReduceOp]) -> int:
    if isinstance(op, str):
        try:
            return ReduceOp[op.strip().upper()]
        except KeyError:
            raise InvalidArgumentError(
                f"unknown reduce op {op!r}: use 'sum', 'avg', 'prod', 'max', 'min' or lockstep.ReduceOp"
            ) from None
    if isinstance(op, int) and not isinstance(op, bool):
        try:
            return ReduceOp(op)
        except ValueError:
            pass
    raise InvalidArgumentError(f"unknown reduce op {op!r}: use 'sum', 'avg', 'prod', 'max', 'min' or lockstep.ReduceOp")


def _parse_quantization(q: Union[None, str, int, Quantization]) -> int:
    if q is None:
        return Quantization.NONE
    if isinstance(q, str):
        name = q.strip().upper().replace("-", "").replace("_", "")
        aliases = {"NONE": Quantization.NONE, "MINMAX": Quantization.MINMAX, "MINMAXU8": Quantization.MINMAX,
                   "ZEROPOINT": Quantization.ZEROPOINT, "ZEROPOINTU8": Quantization.ZEROPOINT}
        if name in aliases:
            return aliases[name]
    elif isinstance(q, int) and not isinstance(q, bool):
        try:
            return Quantization(q)
        except ValueError:
            pass
    raise InvalidArgumentError(f"unknown quantization {q!r}: use None, 'minmax', 'zeropoint' or lockstep.Quantization")


def _parse_strategy(strategy: Union[str, int, SyncStrategy]) -> int:
    if isinstance(strategy, str):
        try:
            return SyncStrategy[strategy.strip().upper().replace("-", "_")]
        except KeyError:
            pass
    elif isinstance(strategy, int) and not isinstance(strategy, bool):
        try:
            return SyncStrategy(strategy)
        except ValueError:
            pass
    raise InvalidArgumentError(
        f"unknown sync strategy {strategy!r}: use 'enforce_popular', 'receive_only', 'send_only' or lockstep.SyncStrategy"
    )


def _check_uint(name: str, value: Any, bits: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = value.__index__()
        except (AttributeError, TypeError):
            raise InvalidArgumentError(f"{name} must be an int, not {type(value).__name__}") from None
    if not 0 <= value < (1 << bits):
        raise InvalidArgumentError(f"{name} must be in 0..{(1 << bits) - 1}, got {value}")
    return int(value)


# ---------------------------------------------------------------------- buffers


@dataclasses.dataclass(frozen=True)
class _Buffer:
    """A validated view of an array or tensor: address, element count and dtype; `obj`
    keeps the memory alive for as long as this view is referenced."""

    obj: Any
    address: int
    count: int
    dtype: DType
    writable: bool
    kind: str  # "numpy" or "torch"

    @property
    def nbytes(self) -> int:
        return self.count * _ITEMSIZE[self.dtype]


def _describe(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _as_buffer(obj: Any, what: str, *, write: bool, allow_grad: bool = False) -> _Buffer:
    """Validates a NumPy array or a CPU PyTorch tensor without copying it.

    Raises InvalidArgumentError for anything that cannot be used in place: another
    type, an unsupported dtype, a non-contiguous layout, a non-CPU tensor, a tensor that
    requires grad, or (when `write`) a read-only array.
    """
    np = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch_buffer(torch, obj, what, write=write, allow_grad=allow_grad)
    if np is not None and isinstance(obj, np.ndarray):
        return _numpy_buffer(obj, what, write=write)
    raise InvalidArgumentError(
        f"{what} must be a numpy.ndarray or a CPU torch.Tensor, not {_describe(obj)}"
    )


def _numpy_buffer(arr: Any, what: str, *, write: bool) -> _Buffer:
    dt = arr.dtype
    code = _NUMPY_DTYPES.get(dt.name)
    if code is None or dt.itemsize != _ITEMSIZE[code]:
        raise InvalidArgumentError(
            f"{what} has unsupported dtype {dt.name}; supported: uint8, int8, uint16, int16, uint32, int32, "
            "uint64, int64, float16, float32, float64"
        )
    if not dt.isnative:
        raise InvalidArgumentError(
            f"{what} has non-native byte order ({dt.str}); convert it with arr.astype(arr.dtype.newbyteorder('='))"
        )
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{what} is not C-contiguous (strides {arr.strides}); lockstep works in place and never copies: "
            "pass numpy.ascontiguousarray(x) (a copy) and copy the result back"
        )
    if write and not arr.flags.writeable:
        raise InvalidArgumentError(f"{what} is read-only but lockstep writes into it; pass a writeable array")
    address, _readonly = arr.__array_interface__["data"]
    return _Buffer(arr, int(address), int(arr.size), code, bool(arr.flags.writeable), "numpy")


def _torch_buffer(torch: Any, t: Any, what: str, *, write: bool, allow_grad: bool) -> _Buffer:
    code = _torch_dtypes(torch).get(t.dtype)
    if code is None:
        supported = ", ".join(str(d).replace("torch.", "") for d in _torch_dtypes(torch))
        raise InvalidArgumentError(f"{what} has unsupported dtype {t.dtype}; supported: {supported}")
    if t.layout != torch.strided:
        raise InvalidArgumentError(f"{what} has layout {t.layout}; only dense (strided) tensors are supported")
    if t.device.type != "cpu":
        raise InvalidArgumentError(
            f"{what} is on device {t.device}; lockstep works on CPU memory only: move it with t.cpu() "
            "(and copy the result back)"
        )
    if not t.is_contiguous():
        raise InvalidArgumentError(
            f"{what} is not contiguous (strides {tuple(t.stride())}); lockstep works in place and never copies: "
            "pass t.contiguous() (a copy) and copy the result back"
        )
    if t.requires_grad and not allow_grad:
        raise InvalidArgumentError(
            f"{what} requires grad; lockstep reads and writes its memory outside autograd: "
            "pass t.detach() (a view sharing the same memory), e.g. param.detach() or param.grad"
        )
    return _Buffer(t, int(t.data_ptr()), int(t.numel()), code, True, "torch")


def content_hash(data: Any) -> str:
    """The shared-state content digest (``lockstep_hash``) of an array's or tensor's bytes:
    32 lowercase hex digits. Accepts a contiguous NumPy array, a contiguous CPU PyTorch
    tensor (requires_grad is allowed: it is only read) or any C-contiguous buffer
    (bytes, bytearray, memoryview). The same bytes give the same digest, whatever the type."""
    np = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    if (torch is not None and isinstance(data, torch.Tensor)) or (np is not None and isinstance(data, np.ndarray)):
        buf = _as_buffer(data, "data", write=False, allow_grad=True)
        return _lockstep.hash_address(buf.address if buf.count else 0, buf.nbytes)
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidArgumentError(
            f"hash() needs a numpy.ndarray, a CPU torch.Tensor or a bytes-like object, not {_describe(data)}"
        ) from None
    with view:
        if not view.c_contiguous:
            raise InvalidArgumentError("hash() needs a C-contiguous buffer")
        return _lockstep.hash_buffer(view)


# -------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class ReduceInfo:
    """What an all-reduce did: the peers that took part in the successful attempt and the
    bytes this peer put on / took off the wire (headers included)."""

    world_size: int
    bytes_sent: int
    bytes_received: int


@dataclasses.dataclass(frozen=True)
class SyncInfo:
    """What a shared-state sync moved: tensor bytes this peer served and received."""

    bytes_sent: int
    bytes_received: int


@dataclasses.dataclass(frozen=True)
class Member:
    """One entry of the membership view, ordered by rank."""

    id: str  # 32 hex digits
    rank: int
    host: str
    p2p_port: int
    shared_state_port: int
    benchmark_port: int


def _split_address(address: str, default_port: int, what: str) -> Tuple[str, int]:
    if not isinstance(address, str):
        raise InvalidArgumentError(f"{what} must be a 'host:port' string, not {type(address).__name__}")
    host, sep, port_text = address.rpartition(":")
    if not sep:
        return address, default_port
    try:
        port = int(port_text)
    except ValueError:
        raise InvalidArgumentError(f"{what} {address!r}: the port is not a number") from None
    if not 0 <= port <= 65535:
        raise InvalidArgumentError(f"{what} {address!r}: the port must be in 0..65535")
    return host, port


# ---------------------------------------------------------------------- master


class Master:
    """An in-process master (``lockstep_master_*``). It serves on background threads.

    Use it as a context manager (``with Master() as m:``): it starts listening on
    ``__enter__`` (unless already running) and stops on ``__exit__``. Or call
    :meth:`run` and :meth:`close` yourself.

    Args:
        listen: ``"host:port"`` to listen on; port 0 picks an ephemeral port (see
            :attr:`port`); an empty host means all interfaces.
        heartbeat_timeout_ms: a peer silent this long is removed; 0 means 5000.
        vote_timeout_ms: an accepted peer that has not joined an open vote after this
            long is removed; 0 turns it off.
        peers_max: the maximum number of peers; 0 means 1024.
        secret_file: path of the run secret (at least 16 bytes; trailing line breaks
            ignored). Peers must prove the same secret; control messages are encrypted and
            p2p connections authenticated (docs/security.md). None: the environment
            variable LOCKSTEP_SECRET_FILE if set, else none (the master admits anyone who
            can reach it, and logs a warning).
        handshake_timeout_ms: a connection that has not finished its handshake after this
            long is closed; 0 means 10000.
        pending_handshakes_max: connections that may be in their handshake at once; 0
            means 256.
    """

    def __init__(self, listen: str = "127.0.0.1:0", heartbeat_timeout_ms: int = 0, vote_timeout_ms: int = 0,
                 peers_max: int = 0, secret_file: Optional[str] = None, handshake_timeout_ms: int = 0,
                 pending_handshakes_max: int = 0) -> None:
        host, port = _split_address(listen, DEFAULT_MASTER_PORT, "listen")
        if secret_file is not None and not isinstance(secret_file, str):
            raise InvalidArgumentError("secret_file must be a str or None")
        self._host = host
        self._impl = _lockstep.Master(
            host, port, _check_uint("heartbeat_timeout_ms", heartbeat_timeout_ms, 32),
            _check_uint("vote_timeout_ms", vote_timeout_ms, 32), _check_uint("peers_max", peers_max, 32),
            secret_file or "", _check_uint("handshake_timeout_ms", handshake_timeout_ms, 32),
            _check_uint("pending_handshakes_max", pending_handshakes_max, 32))
        self._running = False

    def run(self) -> None:
        """Binds the listening socket and starts serving; returns once it listens.
        Raises MasterConnectionFailedError if it cannot bind."""
        self._impl.run()
        self._running = True

    @property
    def running(self) -> bool:
        """Whether :meth:`run` succeeded and the master was not closed."""
        return self._running and not self._impl.closed

    @property
    def port(self) -> int:
        """The port it listens on (after :meth:`run`)."""
        return self._impl.port()

    @property
    def address(self) -> str:
        """``"host:port"`` for :class:`Communicator` (127.0.0.1 when it listens on all interfaces)."""
        host = self._host if self._host not in ("", "0.0.0.0") else "127.0.0.1"
        return f"{host}:{self.port}"

    def interrupt(self) -> None:
        """Asks the master to stop (thread-safe, returns at once)."""
        self._impl.interrupt()

    def wait(self) -> None:
        """Blocks until the master has stopped: :meth:`interrupt` from another thread, or
        Ctrl-C (KeyboardInterrupt, which stops the master and propagates)."""
        done = threading.Event()

        def waiter() -> None:
            try:
                self._impl.wait()
            finally:
                done.set()

        # The C call runs on a helper thread so that this one stays interruptible by signals.
        threading.Thread(target=waiter, name="lockstep-master-wait", daemon=True).start()
        try:
            while not done.wait(0.2):
                pass
        except BaseException:
            self._impl.interrupt()
            raise

    def close(self) -> None:
        """Stops the master and frees it (idempotent). The peers lose their master."""
        self._impl.close()
        self._running = False

    def __enter__(self) -> "Master":
        if not self.running:
            self.run()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.running:
            return f"<lockstep.Master {self.address}>"
        return "<lockstep.Master (not running)>"


# -------------------------------------------------------------- shared state


class TensorInfo:
    """One named tensor of a :class:`SharedState`.

    Args:
        key: unique within the shared state, 1..255 bytes of UTF-8.
        data: a contiguous, writeable NumPy array or CPU PyTorch tensor (not requiring
            grad: pass ``param.detach()``); used in place, never copied.
        allow_content_inequality: a difference on this tensor between up-to-date peers
            does not cause a transfer (e.g. per-peer statistics); an outdated peer
            still receives it.
    """

    __slots__ = ("key", "data", "allow_content_inequality")

    def __init__(self, key: str, data: Any, allow_content_inequality: bool = False) -> None:
        if not isinstance(key, str):
            raise InvalidArgumentError(f"a tensor key must be a str, not {type(key).__name__}")
        encoded = key.encode("utf-8")
        if not 1 <= len(encoded) <= 255 or b"\0" in encoded:
            raise InvalidArgumentError(f"tensor key {key!r} must be 1..255 bytes of UTF-8 without NUL")
        _as_buffer(data, f"shared-state tensor {key!r}", write=False)
        self.key: str = key
        self.data: Any = data
        self.allow_content_inequality: bool = bool(allow_content_inequality)

    def __repr__(self) -> str:
        buf = _as_buffer(self.data, self.key, write=False)
        return (f"TensorInfo(key={self.key!r}, {buf.kind} {buf.dtype.name} x {buf.count}, "
                f"allow_content_inequality={self.allow_content_inequality})")


class SharedState:
    """The shared state of a peer: named tensors kept bit-identical across the group by
    :meth:`Communicator.sync_shared_state`, plus a revision.

    Args:
        tensors: ``{key: array_or_tensor}`` or a list of :class:`TensorInfo`.
        revision: advance it by exactly one before each sync (semantics rule 5); a sync
            writes the group's revision here.
    """

    def __init__(self, tensors: Union[Mapping[str, Any], Sequence[TensorInfo]], revision: int = 0) -> None:
        if isinstance(tensors, Mapping):
            infos = [TensorInfo(k, v) for k, v in tensors.items()]
        else:
            infos = []
            for t in tensors:
                if not isinstance(t, TensorInfo):
                    raise InvalidArgumentError(
                        f"SharedState takes a dict of arrays/tensors or a list of TensorInfo, got {_describe(t)}")
                infos.append(t)
        keys = [t.key for t in infos]
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError(f"duplicate tensor keys in the shared state: {keys}")
        self.tensors: List[TensorInfo] = infos
        self.revision = revision

    @property
    def revision(self) -> int:
        return self._revision

    @revision.setter
    def revision(self, value: int) -> None:
        self._revision = _check_uint("revision", value, 64)

    def __getitem__(self, key: str) -> Any:
        for t in self.tensors:
            if t.key == key:
                return t.data
        raise KeyError(key)

    def __repr__(self) -> str:
        return f"SharedState(revision={self.revision}, keys={[t.key for t in self.tensors]})"


# ------------------------------------------------------------------- collectives


class AsyncHandle:
    """An all-reduce in flight (from :meth:`Communicator.all_reduce_async`).

    :meth:`done` polls without blocking (any thread); :meth:`wait` blocks until it ended
    and returns its :class:`ReduceInfo` or raises its error. Await it on the thread that
    launched it (WrongThreadError otherwise). The arrays stay referenced until then; a
    handle still unawaited when its communicator is closed raises
    LockstepInterruptedError from :meth:`wait`.
    """

    __slots__ = ("_impl", "_src", "_dst", "_info", "tag")

    def __init__(self, impl: Any, src: Any, dst: Any, tag: int) -> None:
        self._impl = impl
        self._src = src
        self._dst = dst
        self._info: Optional[ReduceInfo] = None
        self.tag = tag

    def done(self) -> bool:
        """Whether the operation has ended (successfully or not); never blocks."""
        return self._info is not None or self._impl.done()

    def wait(self) -> ReduceInfo:
        """Waits for the operation (GIL released) and returns its result; may be called
        again after success and returns the same result."""
        if self._info is None:
            self._info = ReduceInfo(*self._impl.wait())
        return self._info

    @property
    def result(self) -> Any:
        """The destination array/tensor."""
        return self._dst

    def __repr__(self) -> str:
        return f"<lockstep.AsyncHandle tag={self.tag} done={self.done()}>"


_OpSpec = Union[Tuple[Any, ...], Mapping[str, Any]]


class Communicator:
    """A peer of a run (``lockstep_comm_*``): membership votes, all-reduce, shared state.

    It belongs to the thread that created it: call it from that thread only (the
    documented exceptions: :meth:`are_peers_pending` from the owner while collectives
    run on one other thread, and ``done()`` of async handles). Every blocking call
    releases the GIL.

    Use it as a context manager: ``with Communicator(...) as comm: comm.connect()`` --
    ``connect()`` is not implicit; the communicator is closed on exit.

    Args:
        master: ``"host:port"`` of the master (port defaults to 48148).
        group: the peer group; collectives and syncs span one group.
        pool_size: p2p connections per ring neighbour and direction (0 means 1).
        base_port: -1 takes the first free ports above 48148; 0 puts every socket on
            an ephemeral port; any other value is the first port tried.
        connect_timeout_ms: how long :meth:`connect` waits for the master; 0 means 10000.
        advertised_host: the address other peers use to reach this one (None: the
            address the master sees).
        bind_host: the IPv4 address the p2p sockets bind to (None: all interfaces).
        secret_file: path of the run secret; or
        secret: the run secret itself (``bytes``, or a ``str`` taken as UTF-8), used when
            secret_file is None. At least 16 bytes; trailing line breaks are ignored.
            With a secret, :meth:`connect` joins only a master proving the same secret
            (else AuthenticationFailedError) and p2p connections are authenticated.
            Neither: the environment variable LOCKSTEP_SECRET_FILE if set, else none.
        inbound_handshake_timeout_ms: an incoming p2p connection that has not finished
            its handshake after this long is closed; 0 means 5000.
        inbound_handshakes_max: incoming p2p connections that may be in their handshake
            at once (more are closed); 0 means 256.
        p2p_stall_timeout_ms: an all-reduce attempt fails (PeerConnectionLostError)
            when no byte moves to or from its ring neighbours for this long, e.g. a
            link cut between two peers that both still reach the master; 0 means 30000.
        encrypt_data: seal the data plane (all-reduce sub-chunks, shared-state transfers)
            with ChaCha20-Poly1305 under per-connection keys. Needs a secret (else
            InvalidArgumentError); every peer of the run must set the same value (p2p
            connections between peers that differ are refused). An altered sub-chunk
            fails the all-reduce on every peer (PeerConnectionLostError). Costs
            throughput (BENCHMARKS.md).
    """

    def __init__(self, master: str = f"127.0.0.1:{DEFAULT_MASTER_PORT}", group: int = 0, pool_size: int = 1,
                 base_port: int = -1, connect_timeout_ms: int = 0, advertised_host: Optional[str] = None,
                 bind_host: Optional[str] = None, secret_file: Optional[str] = None,
                 secret: Optional[Union[bytes, str]] = None, inbound_handshake_timeout_ms: int = 0,
                 inbound_handshakes_max: int = 0, p2p_stall_timeout_ms: int = 0,
                 encrypt_data: bool = False) -> None:
        host, port = _split_address(master, DEFAULT_MASTER_PORT, "master")
        if not host:
            raise InvalidArgumentError(f"master {master!r}: the host is empty")
        if isinstance(base_port, bool) or not isinstance(base_port, int) or not -1 <= base_port <= 65535:
            raise InvalidArgumentError(f"base_port must be -1, 0 or a port number, got {base_port!r}")
        for name, value in (("advertised_host", advertised_host), ("bind_host", bind_host),
                            ("secret_file", secret_file)):
            if value is not None and not isinstance(value, str):
                raise InvalidArgumentError(f"{name} must be a str or None")
        if isinstance(secret, str):
            secret = secret.encode("utf-8")
        if secret is not None and not isinstance(secret, (bytes, bytearray)):
            raise InvalidArgumentError("secret must be bytes, a str or None")
        self._impl = _lockstep.Comm(
            host, port, _check_uint("group", group, 32), _check_uint("pool_size", pool_size, 32), base_port,
            _check_uint("connect_timeout_ms", connect_timeout_ms, 32), advertised_host or "", bind_host or "",
            secret_file or "", None if secret is None else bytes(secret),
            _check_uint("inbound_handshake_timeout_ms", inbound_handshake_timeout_ms, 32),
            _check_uint("inbound_handshakes_max", inbound_handshakes_max, 32),
            _check_uint("p2p_stall_timeout_ms", p2p_stall_timeout_ms, 32), bool(encrypt_data))
        self.master = f"{host}:{port}"

    # -- membership ---------------------------------------------------------

    def connect(self) -> None:
        """Connects to the master and blocks until this peer is accepted into the run
        (the accepted peers must call :meth:`update_topology` for that, unless the run is
        empty). MasterConnectionFailedError, RejectedError on failure."""
        self._impl.connect()

    def update_topology(self) -> None:
        """Votes to accept pending peers and rewires the ring; every accepted peer calls
        it (a barrier). UpdateTopologyFailedError: call it again."""
        self._impl.update_topology()

    def optimize_topology(self) -> None:
        """Measures missing bandwidths and reorders every group's ring (a run-wide vote
        like update_topology). TopologyOptimizationFailedError: call it again."""
        self._impl.optimize_topology()

    def are_peers_pending(self) -> bool:
        """Votes whether registered peers wait to join; every accepted peer gets the same answer."""
        return self._impl.are_peers_pending()

    def agree(self, flag: bool) -> bool:
        """Every accepted peer of the group contributes a flag; all get True only if all
        said True. PeerConnectionLostError if a participant is lost during the vote."""
        return self._impl.agree(bool(flag))

    @property
    def rank(self) -> int:
        """This peer's rank in the membership view (0-based position in the group's ring)."""
        return self._impl.rank()

    @property
    def id(self) -> str:
        """This peer's identity: 32 lowercase hex digits (NotInitializedError before connect)."""
        return self._impl.id().hex()

    def membership(self) -> List[Member]:
        """The group's membership view ordered by rank, as of the last topology update."""
        return [Member(raw_id.hex(), rank, host, p2p, shared, bench)
                for raw_id, rank, host, p2p, shared, bench in self._impl.membership()]

    @property
    def world_size(self) -> int:
        """Peers in the whole run (all groups), as of the last topology update."""
        return self._impl.attribute(0)

    @property
    def group_world_size(self) -> int:
        """Peers in this peer's group, as of the last topology update."""
        return self._impl.attribute(1)

    @property
    def num_groups(self) -> int:
        """Distinct peer groups in the run, as of the last topology update."""
        return self._impl.attribute(2)

    @property
    def largest_group_size(self) -> int:
        """The size of the largest group, as of the last topology update."""
        return self._impl.attribute(3)

    @property
    def last_error(self) -> str:
        """The message of this communicator's last failure ("" if none)."""
        return self._impl.last_error()

    def counters(self) -> Dict[str, int]:
        """What this communicator did since it was created (``lockstep_comm_get_counters``):
        bytes of all-reduces and shared-state syncs (``all_reduce_bytes_sent``,
        ``sync_bytes_received``, ...), operations started, succeeded and failed (all, and
        ``all_reduces_*`` / ``syncs_*``), ``retries``, and microseconds spent in each call
        (``connect_us``, ``update_topology_us``, ``optimize_topology_us``, ``sync_us``,
        ``all_reduce_us``). Operations are connect, update and optimize topology,
        all-reduces and syncs; a retry is one started after the previous one of its kind
        (an all-reduce: of its tag) failed. May be called from any thread."""
        return dict(self._impl.counters())

    # -- collectives --------------------------------------------------------

    @staticmethod
    def _buffers(src: Any, dst: Any) -> Tuple[_Buffer, _Buffer]:
        if dst is None or dst is src:
            s = _as_buffer(src, "src (in place)", write=True)
            d = s
        else:
            s = _as_buffer(src, "src", write=False)
            d = _as_buffer(dst, "dst", write=True)
            if s.dtype != d.dtype:
                raise InvalidArgumentError(f"src and dst differ in dtype ({s.dtype.name} vs {d.dtype.name})")
            if s.count != d.count:
                raise InvalidArgumentError(f"src and dst differ in size ({s.count} vs {d.count} elements)")
        if s.count == 0:
            raise InvalidArgumentError("cannot all-reduce an empty array or tensor (count is zero)")
        return s, d

    def _descriptor(self, src: Any, dst: Any, op: Any, quantization: Any, tag: Any) -> Tuple[Tuple[Any, ...], _Buffer, _Buffer]:
        s, d = self._buffers(src, dst)
        desc = (s.address, d.address, s.count, int(s.dtype), _parse_op(op), _parse_quantization(quantization),
                _check_uint("tag", tag, 64))
        return desc, s, d

    def all_reduce(self, src: Any, dst: Any = None, *, op: Union[str, ReduceOp] = "sum",
                   quantization: Union[None, str, Quantization] = None, tag: int = 0) -> ReduceInfo:
        """All-reduces ``src`` into ``dst`` (``dst=None``: in place into ``src``).

        Every peer of the group calls it with the same tag, size, dtype, op and
        quantization. On success every participant holds bit-identical results; on
        PeerConnectionLostError ``dst`` holds what it held before and the call can be
        retried with the survivors.

        src/dst: contiguous NumPy arrays or CPU tensors of the same dtype and element
        count (shapes may differ); ``dst`` writeable. op: 'sum', 'avg', 'prod', 'max',
        'min' or :class:`ReduceOp`. quantization: None, 'minmax' or 'zeropoint'
        (floating-point dtypes only).
        """
        desc, s, d = self._descriptor(src, dst, op, quantization, tag)
        return ReduceInfo(*self._impl.all_reduce(*desc))

    def all_reduce_async(self, src: Any, dst: Any = None, *, op: Union[str, ReduceOp] = "sum",
                         quantization: Union[None, str, Quantization] = None, tag: int = 0) -> AsyncHandle:
        """Starts an all-reduce and returns an :class:`AsyncHandle` at once. Several may be
        in flight with distinct tags. The arrays are referenced until the handle is
        awaited; do not touch ``dst`` before that."""
        desc, s, d = self._descriptor(src, dst, op, quantization, tag)
        keep = (s.obj, d.obj)
        impl = self._impl.all_reduce_async(*desc, keep)
        return AsyncHandle(impl, s.obj, d.obj, desc[-1])

    def all_reduce_multiple_with_retry(self, ops: Iterable[_OpSpec], max_in_flight: int = 4) -> List[ReduceInfo]:
        """Runs several all-reduces, at most ``max_in_flight`` at once; those that fail
        because a peer was lost are retried with the survivors. Returns one
        :class:`ReduceInfo` per operation, or raises the first error that is not a lost peer.

        Each operation is a tuple ``(src, dst_or_None, op, tag[, quantization])`` or a
        dict with keys ``src``, ``dst`` (optional), ``op`` (default 'sum'), ``tag``
        (default: its position) and ``quantization`` (optional). Tags must be distinct.
        """
        descs = []
        keep = []
        for i, spec in enumerate(ops):
            if isinstance(spec, Mapping):
                unknown = set(spec) - {"src", "dst", "op", "tag", "quantization"}
                if unknown or "src" not in spec:
                    raise InvalidArgumentError(
                        f"operation {i}: a dict needs 'src' and may have 'dst', 'op', 'tag', 'quantization'"
                        + (f" (unknown: {sorted(unknown)})" if unknown else ""))
                src, dst = spec["src"], spec.get("dst")
                op, tag, q = spec.get("op", "sum"), spec.get("tag", i), spec.get("quantization")
            elif isinstance(spec, (tuple, list)) and len(spec) in (4, 5):
                src, dst, op, tag = spec[:4]
                q = spec[4] if len(spec) == 5 else None
            else:
                raise InvalidArgumentError(
                    f"operation {i}: expected (src, dst_or_None, op, tag[, quantization]) or a dict, got {spec!r}")
            desc, s, d = self._descriptor(src, dst, op, q, tag)
            descs.append(desc)
            keep.append((s.obj, d.obj))
        max_in_flight = _check_uint("max_in_flight", max_in_flight, 63)
        if max_in_flight == 0:
            raise InvalidArgumentError("max_in_flight must be at least 1")
        return [ReduceInfo(*t) for t in self._impl.all_reduce_multiple_with_retry(descs, max_in_flight)]

    # -- shared state ---------------------------------------------------------

    def sync_shared_state(self, state: SharedState,
                          strategy: Union[str, SyncStrategy] = "enforce_popular") -> SyncInfo:
        """Synchronizes ``state`` with every accepted peer of the group (a vote: all call it).

        strategy: 'enforce_popular' (the most popular content wins), 'receive_only'
        (adopt the elected content, e.g. a newcomer) or 'send_only' (never receive;
        this peer's content must equal the elected one). On success every peer holds
        bit-identical tensors and ``state.revision`` is the group's revision. Retry on
        PeerConnectionLostError / HashMismatchError.
        """
        if not isinstance(state, SharedState):
            raise InvalidArgumentError(f"state must be a lockstep.SharedState, not {_describe(state)}")
        code = _parse_strategy(strategy)
        write = code != SyncStrategy.SEND_ONLY
        tensors = []
        keep = []
        for t in state.tensors:
            buf = _as_buffer(t.data, f"shared-state tensor {t.key!r}", write=write)
            if buf.count == 0:
                raise InvalidArgumentError(f"shared-state tensor {t.key!r} is empty")
            tensors.append((t.key, buf.address, buf.count, int(buf.dtype), t.allow_content_inequality))
            keep.append(buf)
        revision, sent, received = self._impl.sync_shared_state(tensors, state.revision, code)
        state.revision = revision
        return SyncInfo(sent, received)

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Leaves the run and frees the communicator (idempotent). Collectives still in
        flight end with LockstepInterruptedError. Call it from the owning thread."""
        self._impl.close()

    @property
    def closed(self) -> bool:
        return self._impl.closed

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<lockstep.Communicator (closed)>"
        return f"<lockstep.Communicator master={self.master}>"


def set_log_level(level: Union[str, int, LogLevel]) -> None:
    """Sets the process-wide log level: 'error', 'warn', 'info', 'debug', 'trace' (or :class:`LogLevel`)."""
    if isinstance(level, str):
        try:
            level = LogLevel[level.strip().upper()]
        except KeyError:
            raise InvalidArgumentError(f"unknown log level {level!r}") from None
    _lockstep.set_log_level(int(level))


def status_string(status: int) -> str:
    """The C library's description of a status code (``lockstep_status_string``)."""
    return _lockstep.status_string(int(status))
