"""The peer (:class:`Communicator`), its shared state (:class:`SharedState`,
:class:`TensorInfo`), its async handles and the results it returns."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _lockstep
from ._buffers import _as_buffer, _Buffer, _describe
from ._enums import (Distribution, Quantization, ReduceOp, SyncStrategy, _check_uint, _parse_distribution, _parse_op,
                     _parse_quantization, _parse_strategy)
from ._errors import InvalidArgumentError
from ._master import DEFAULT_MASTER_PORT, _join_address, _split_address

# -------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class ReduceInfo:
    """What a collective (all-reduce, broadcast, all-gather, reduce-scatter, barrier) did:
    the peers that took part in the successful attempt and the bytes this peer put on /
    took off the wire (headers included)."""

    world_size: int
    bytes_sent: int
    bytes_received: int


@dataclasses.dataclass(frozen=True)
class SyncInfo:
    """What a shared-state sync moved: tensor bytes this peer served and received, and
    the same on the wire (compressed blocks and their headers; equal where nothing was
    compressed), and the connections the received bytes came over (each source's part
    striped over up to 4, or ``p2p_streams``)."""

    bytes_sent: int
    bytes_received: int
    wire_bytes_sent: int = 0
    wire_bytes_received: int = 0
    streams: int = 0


@dataclasses.dataclass(frozen=True)
class Member:
    """One entry of the membership view, ordered by rank."""

    id: str  # 32 hex digits
    rank: int
    host: str
    p2p_port: int
    shared_state_port: int
    benchmark_port: int


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
    """A collective in flight (from :meth:`Communicator.all_reduce_async`,
    :meth:`~Communicator.broadcast_async`, :meth:`~Communicator.all_gather_async`,
    :meth:`~Communicator.reduce_scatter_async` or :meth:`~Communicator.barrier_async`).

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
        """The destination array/tensor (a broadcast's buffer; None for a barrier)."""
        return self._dst

    def __repr__(self) -> str:
        return f"<lockstep.AsyncHandle tag={self.tag} done={self.done()}>"


_OpSpec = Union[Tuple[Any, ...], Mapping[str, Any]]


def _allocate_like(buf: _Buffer, shape: Tuple[int, ...]) -> Any:
    """A new uninitialized array (or CPU tensor) of buf's kind and dtype."""
    if buf.kind == "torch":
        return sys.modules["torch"].empty(shape, dtype=buf.obj.dtype)
    return sys.modules["numpy"].empty(shape, dtype=buf.obj.dtype)


def _check_counts(counts: Any) -> List[int]:
    if isinstance(counts, (str, bytes)) or not isinstance(counts, Iterable):
        raise InvalidArgumentError(f"counts must be a sequence of element counts, one per rank, not {counts!r}")
    out = [_check_uint("counts[%d]" % i, c, 64) for i, c in enumerate(counts)]
    if not out:
        raise InvalidArgumentError("counts is empty: it needs one element count per rank of the view")
    return out


class Communicator:
    """A peer of a run (``lockstep_comm_*``): membership votes, collectives (all-reduce,
    broadcast, all-gather, reduce-scatter, barrier), shared state.

    It belongs to the thread that created it: call it from that thread only (the
    documented exceptions: :meth:`are_peers_pending` from the owner while collectives
    run on one other thread, and ``done()`` of async handles). Every blocking call
    releases the GIL.

    Use it as a context manager: ``with Communicator(...) as comm: comm.connect()`` --
    ``connect()`` is not implicit; the communicator is closed on exit.

    Args:
        master: ``"host:port"`` of the master, ``"[ipv6]:port"`` for an IPv6 literal (port
            defaults to 48148). Several, separated by commas (``"a:48148,b:48148"``): with
            failover, the others are where this peer looks for a master to take it back,
            in order, after the first.
        group: the peer group; collectives and syncs span one group.
        pool_size: p2p connections per ring neighbour and direction (0 means 1).
        base_port: -1 takes the first free ports above 48148; 0 puts every socket on
            an ephemeral port; any other value is the first port tried.
        connect_timeout_ms: how long :meth:`connect` waits for the master; 0 means 10000.
        advertised_host: the address other peers use to reach this one (None: the
            address the master sees).
        bind_host: the IPv4 or IPv6 address the p2p sockets bind to (None: every address
            of both families).
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
        p2p_streams: connections one all-reduce stripes over towards each ring
            neighbour: 0 adapts the count to the path (1 up to 8, more only while they
            raise the throughput: docs/wan.md); 1 to 16 fixes it. The results are the
            same bits with any count. Also the connections a shared-state sync fetches
            each source's part over (0: up to 4, each carrying at least 16 MiB).
        tcp_congestion: TCP congestion control of the p2p connections (e.g. ``"bbr"``);
            None: the system's default. One the kernel refuses is logged once and the
            default used.
        check_finite: before each float collective, check this peer's contribution for
            NaN and infinity; one found fails the collective on every peer with
            NonFiniteContributionError (naming this peer and the element) before any
            byte moves. Costs one read of the contribution.
        state_compression: ``"auto"`` (default): this peer's shared-state transfers
            travel in blocks that the sending peer compresses (zstd) where it measures
            that it pays; ``"off"``: raw bytes.
        inbound: False for a peer that accepts no inbound connection (behind a NAT or
            a firewall): it opens no listening socket, dials the ring neighbours that
            accept connections (connection reversal), and serves shared state only to
            peers that accept connections, by dialling them (a peer that accepts none
            either and that only such peers could serve is removed). Two such peers cannot be
            ring neighbours: the master places them apart where the run allows
            (docs/deployment.md). The master also finds out by itself: it registers a
            peer whose port it cannot reach as one that accepts no connection.
        failover_timeout_ms: once accepted, a peer that loses its master looks this long
            for a master to take it back (the first address of ``master``, then the
            others); operations in flight end with one outcome for every peer (a
            retryable error where no peer received one) and calls block meanwhile; only
            then MasterConnectionLostError. Default 30000; 0: off, the loss raises
            MasterConnectionLostError at once (docs/architecture.md, "Failover").
    """

    def __init__(self, master: str = f"127.0.0.1:{DEFAULT_MASTER_PORT}", group: int = 0, pool_size: int = 1,
                 base_port: int = -1, connect_timeout_ms: int = 0, advertised_host: Optional[str] = None,
                 bind_host: Optional[str] = None, secret_file: Optional[str] = None,
                 secret: Optional[Union[bytes, str]] = None, inbound_handshake_timeout_ms: int = 0,
                 inbound_handshakes_max: int = 0, p2p_stall_timeout_ms: int = 0,
                 encrypt_data: bool = False, p2p_streams: int = 0,
                 tcp_congestion: Optional[str] = None, check_finite: bool = False,
                 state_compression: str = "auto", inbound: bool = True, failover_timeout_ms: int = 30_000) -> None:
        if not isinstance(master, str):
            raise InvalidArgumentError("master must be a str")
        first, *others = master.split(",")
        host, port = _split_address(first, DEFAULT_MASTER_PORT, "master")
        fallbacks = [_join_address(*_split_address(o, DEFAULT_MASTER_PORT, "master")) for o in others]
        if state_compression not in ("auto", "off"):
            raise InvalidArgumentError(f"state_compression must be 'auto' or 'off', not {state_compression!r}")
        if not host:
            raise InvalidArgumentError(f"master {master!r}: the host is empty")
        if isinstance(base_port, bool) or not isinstance(base_port, int) or not -1 <= base_port <= 65535:
            raise InvalidArgumentError(f"base_port must be -1, 0 or a port number, got {base_port!r}")
        for name, value in (("advertised_host", advertised_host), ("bind_host", bind_host),
                            ("secret_file", secret_file), ("tcp_congestion", tcp_congestion)):
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
            _check_uint("p2p_stall_timeout_ms", p2p_stall_timeout_ms, 32), bool(encrypt_data),
            _check_uint("p2p_streams", p2p_streams, 32), tcp_congestion or "", bool(check_finite),
            0 if state_compression == "auto" else 1, bool(inbound), ",".join(fallbacks),
            _check_uint("failover_timeout_ms", failover_timeout_ms, 32))
        self.master = _join_address(host, port)

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

    def agree_value(self, value: bytes, mode: str = "all_equal") -> bytes:
        """Every accepted peer of the group proposes a value of up to 4096 bytes and all
        get the same one: with mode "all_equal" the common proposal
        (OperationMismatchError for all if any differs), with "first_accepted" the
        proposal of the peer accepted first. PeerConnectionLostError if a participant is
        lost during the vote."""
        modes = {"all_equal": 1, "first_accepted": 2}
        if mode not in modes:
            raise InvalidArgumentError(f"agree_value mode must be one of {sorted(modes)}, not {mode!r}")
        value = bytes(value)
        if len(value) > 4096:
            raise InvalidArgumentError(f"agree_value takes at most 4096 bytes, not {len(value)}")
        return self._impl.agree_value(value, modes[mode])

    # ---- the master's key-value store (docs/collectives.md)

    @staticmethod
    def _kv_key(key: str) -> str:
        if not isinstance(key, str) or not key or "\0" in key:
            raise InvalidArgumentError(f"a key-value store key is a non-empty str without NUL, not {key!r}")
        return key

    def kv_set(self, key: str, value: bytes) -> None:
        """Stores ``value`` (bytes-like, up to 64 KiB by default) under ``key`` (up to 256
        UTF-8 bytes by default) in the master's key-value store, replacing any earlier
        value, and wakes every peer waiting for it. LimitExceededError beyond the
        master's bounds (keys held, key or value size)."""
        self._impl.kv_set(self._kv_key(key), bytes(value))

    def kv_get(self, key: str) -> bytes:
        """The value under ``key``; KeyNotFoundError (a KeyError) if there is none."""
        return self._impl.kv_read(self._kv_key(key), False, 0)

    def kv_wait(self, key: str, timeout_ms: int = 0) -> bytes:
        """The value under ``key``, waiting until some peer sets it: LockstepTimeoutError
        after ``timeout_ms`` (0: no deadline). The GIL is released while waiting."""
        return self._impl.kv_read(self._kv_key(key), True, _check_uint("timeout_ms", timeout_ms, 32))

    def kv_delete(self, key: str) -> None:
        """Removes ``key`` and its value (no error if absent)."""
        self._impl.kv_delete(self._kv_key(key))

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

    def slot_bytes(self) -> List[Tuple[int, int]]:
        """Ring bytes (headers included) sent and received on each p2p pool slot since
        creation (``lockstep_comm_get_slot_bytes``): entry k is ``(sent, received)`` of
        slot k, one entry per slot of ``pool_size``. The master gives each all-reduce in
        flight its own slot while slots are free, so this shows which connections carry
        what. Summed over the slots they equal ``all_reduce_bytes_sent`` / ``_received``
        of :meth:`counters`, less the all-reduces that travel with the votes (up to
        16 KiB: no ring). May be called from any thread."""
        return [(int(sent), int(received)) for sent, received in self._impl.slot_bytes()]

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

    def _descriptor(self, src: Any, dst: Any, op: Any, quantization: Any, tag: Any,
                    residual: Any = None, distribution: Any = None) -> Tuple[Tuple[Any, ...], _Buffer, _Buffer, Any]:
        s, d = self._buffers(src, dst)
        r_address = 0
        if residual is not None:
            r = _as_buffer(residual, "residual", write=True)
            if r.dtype != s.dtype or r.count != s.count:
                raise InvalidArgumentError(
                    f"residual must have src's dtype and size ({s.dtype.name}, {s.count} elements), "
                    f"not {r.dtype.name}, {r.count}")
            r_address = r.address
        desc = (s.address, d.address, s.count, int(s.dtype), _parse_op(op), _parse_quantization(quantization),
                _check_uint("tag", tag, 64), r_address, _parse_distribution(distribution))
        return desc, s, d, residual

    def all_reduce(self, src: Any, dst: Any = None, *, op: Union[str, ReduceOp] = "sum",
                   quantization: Union[None, str, Quantization] = None, tag: int = 0,
                   residual: Any = None, distribution: Union[None, str, Distribution] = None) -> ReduceInfo:
        """All-reduces ``src`` into ``dst`` (``dst=None``: in place into ``src``).

        Every peer of the group calls it with the same tag, size, dtype, op and
        quantization. On success every participant holds bit-identical results; on
        PeerConnectionLostError ``dst`` holds what it held before and the call can be
        retried with the survivors.

        src/dst: contiguous NumPy arrays or CPU tensors of the same dtype and element
        count (shapes may differ); ``dst`` writeable. op: 'sum', 'avg', 'prod', 'max',
        'min' or :class:`ReduceOp`. quantization: None, 'minmax', 'zeropoint' (8-bit
        codes), 'minmax4', 'zeropoint4' (4-bit codes), 'f16' or 'bf16' (casts, float32 and
        float64 only), or :class:`Quantization` (floating-point dtypes only).

        residual: error feedback for a quantized all-reduce with op 'sum' or 'avg': an
        array of src's dtype and size, zeros before the first call, owned by the caller
        and passed to every call of this all-reduce. The call contributes src + residual;
        when it succeeds, residual holds what quantization dropped of this peer's part
        (added back next time); when it fails, residual is unchanged.

        distribution: a hint for the 8-bit and 4-bit codes, None, 'uniform' or 'normal'
        (or :class:`Distribution`): with 'normal' each chunk's codes span its mean ± 4
        (8-bit) or 2.5 (4-bit) standard deviations and the values beyond are clamped,
        which lowers the error on bell-shaped data such as gradients. This peer's own
        choice: results stay bit-identical whatever each peer chose.
        """
        desc, s, d, _ = self._descriptor(src, dst, op, quantization, tag, residual, distribution)
        return ReduceInfo(*self._impl.all_reduce(*desc))

    def all_reduce_async(self, src: Any, dst: Any = None, *, op: Union[str, ReduceOp] = "sum",
                         quantization: Union[None, str, Quantization] = None, tag: int = 0,
                         residual: Any = None, distribution: Union[None, str, Distribution] = None) -> AsyncHandle:
        """Starts an all-reduce and returns an :class:`AsyncHandle` at once. Several may be
        in flight with distinct tags. The arrays are referenced until the handle is
        awaited; do not touch ``dst`` (or ``residual``) before that."""
        desc, s, d, r = self._descriptor(src, dst, op, quantization, tag, residual, distribution)
        keep = (s.obj, d.obj, r)
        impl = self._impl.all_reduce_async(*desc, keep)
        return AsyncHandle(impl, s.obj, d.obj, desc[6])

    def _broadcast_args(self, buf: Any, root: Any, tag: Any) -> Tuple[Tuple[Any, ...], _Buffer]:
        b = _as_buffer(buf, "buf", write=True)
        if b.count == 0:
            raise InvalidArgumentError("cannot broadcast an empty array or tensor (count is zero)")
        return (b.address, b.count, int(b.dtype), _check_uint("root", root, 32), _check_uint("tag", tag, 64)), b

    def broadcast(self, buf: Any, root: int, *, tag: int = 0) -> ReduceInfo:
        """Copies ``buf`` of the peer of rank ``root`` into ``buf`` on every other peer (in
        place; the ring is pipelined from the root).

        Every peer of the group calls it with the same tag, root, size and dtype (else
        OperationMismatchError for all). ``root`` is a rank of the membership view
        (:attr:`rank`); one outside the view fails the call on every peer with
        InvalidArgumentError. On failure every buffer, the root's included, holds what it
        held before. Once a peer has left, it fails on every peer with ViewChangedError
        until :meth:`update_topology`; a group of one gets TooFewPeersError.

        buf: a contiguous, writeable NumPy array or CPU tensor (on every peer, the root's
        included).
        """
        args, _ = self._broadcast_args(buf, root, tag)
        return ReduceInfo(*self._impl.broadcast(*args))

    def broadcast_async(self, buf: Any, root: int, *, tag: int = 0) -> AsyncHandle:
        """Starts a :meth:`broadcast` and returns an :class:`AsyncHandle` at once (its
        ``result`` is ``buf``); do not touch ``buf`` before it is awaited."""
        args, b = self._broadcast_args(buf, root, tag)
        impl = self._impl.broadcast_async(*args, (b.obj,))
        return AsyncHandle(impl, b.obj, b.obj, args[-1])

    def _all_gather_args(self, src: Any, dst: Any, counts: Any, tag: Any) -> Tuple[Tuple[Any, ...], Any, Any]:
        tag = _check_uint("tag", tag, 64)
        if counts is None:
            s = _as_buffer(src, "src", write=False)
            if s.count == 0:
                raise InvalidArgumentError("cannot all-gather an empty array or tensor (count is zero); "
                                           "pass counts= for ranks that contribute nothing")
            if dst is None:
                dst = _allocate_like(s, (self.group_world_size,) + tuple(s.obj.shape))
            d = _as_buffer(dst, "dst", write=True)
            if s.dtype != d.dtype:
                raise InvalidArgumentError(f"src and dst differ in dtype ({s.dtype.name} vs {d.dtype.name})")
            return (s.address, s.count, d.address, d.count, int(s.dtype), [], tag), s.obj, d.obj
        per_rank = _check_counts(counts)
        s = None if src is None else _as_buffer(src, "src", write=False)
        if dst is None:
            if s is None:
                raise InvalidArgumentError("all_gather needs src or dst (the dtype of the result)")
            dst = _allocate_like(s, (sum(per_rank),))
        d = _as_buffer(dst, "dst", write=True)
        if s is not None and s.dtype != d.dtype:
            raise InvalidArgumentError(f"src and dst differ in dtype ({s.dtype.name} vs {d.dtype.name})")
        rank = self._impl.rank()
        # counts of another length than the view's are refused by every peer (the library).
        if s is not None and rank < len(per_rank) and s.count != per_rank[rank]:
            raise InvalidArgumentError(
                f"src has {s.count} elements where counts[{rank}] (this peer's rank) is {per_rank[rank]}")
        # No input (src None, or empty): NULL, which the library accepts for a rank whose
        # count is 0 and refuses on every peer otherwise.
        address = s.address if s is not None and s.count > 0 else 0
        return (address, 0, d.address, d.count, int(d.dtype), per_rank, tag), None if s is None else s.obj, d.obj

    def all_gather(self, src: Any, dst: Any = None, *, counts: Optional[Sequence[int]] = None, tag: int = 0) -> Any:
        """Gathers every rank's ``src``, in rank order, into ``dst`` on every peer; returns
        ``dst`` (the one given, or a new array/tensor of ``src``'s kind and dtype).

        Without ``counts`` every rank contributes ``src.size`` elements (the same on every
        peer) and ``dst`` needs room for world x that many (``dst=None``: a new array of
        shape ``(world, *src.shape)``, ``world`` being :attr:`group_world_size`). With
        ``counts`` (all-gatherv: one element count per rank of the view, the same list on
        every peer) rank r contributes ``counts[r]`` elements, ``src`` holds exactly this
        rank's count (``src=None`` or an empty array where it is 0), and ``dst`` needs room
        for their sum (``dst=None``: a new 1-D array). ``src`` may be a view of this rank's
        own place in ``dst`` (in place).

        Every peer calls it with the same tag, dtype and counts (else
        OperationMismatchError for all). A ``dst`` too small, or ``counts`` not one per
        rank, on any peer fails the call on every peer with InvalidArgumentError. On
        failure ``dst`` holds what it held before. Once a peer has left, it fails on every
        peer with ViewChangedError until :meth:`update_topology`; a group of one gets
        TooFewPeersError.
        """
        args, _, d = self._all_gather_args(src, dst, counts, tag)
        self._impl.all_gather(*args)
        return d

    def all_gather_async(self, src: Any, dst: Any = None, *, counts: Optional[Sequence[int]] = None,
                         tag: int = 0) -> AsyncHandle:
        """Starts an :meth:`all_gather` and returns an :class:`AsyncHandle` at once; its
        ``result`` is the destination (allocated here when ``dst`` is None)."""
        args, s, d = self._all_gather_args(src, dst, counts, tag)
        impl = self._impl.all_gather_async(*args, (s, d))
        return AsyncHandle(impl, s, d, args[-1])

    def _reduce_scatter_args(self, src: Any, dst: Any, op: Any, quantization: Any,
                             tag: Any) -> Tuple[Tuple[Any, ...], _Buffer, _Buffer]:
        s = _as_buffer(src, "src", write=False)
        if s.count == 0:
            raise InvalidArgumentError("cannot reduce-scatter an empty array or tensor (count is zero)")
        op_code, q_code, tag = _parse_op(op), _parse_quantization(quantization), _check_uint("tag", tag, 64)
        if dst is not None:
            d = _as_buffer(dst, "dst", write=True)
            if s.dtype != d.dtype:
                raise InvalidArgumentError(f"src and dst differ in dtype ({s.dtype.name} vs {d.dtype.name})")
        world = self.group_world_size
        if dst is None:
            if s.count % world != 0:
                raise InvalidArgumentError(
                    f"src has {s.count} elements, not a multiple of the {world} ranks of the view")
            d = _as_buffer(_allocate_like(s, (s.count // world,)), "dst", write=True)
        # The library reads world x dst's count elements of src: exactly src's.
        if d.count == 0 or s.count != d.count * world:
            raise InvalidArgumentError(
                f"src has {s.count} elements where the view's {world} ranks x dst's {d.count} are {world * d.count}")
        return (s.address, d.address, d.count, int(s.dtype), op_code, q_code, tag), s, d

    def reduce_scatter(self, src: Any, dst: Any = None, *, op: Union[str, ReduceOp] = "sum",
                       quantization: Union[None, str, Quantization] = None, tag: int = 0) -> Any:
        """Reduces ``src`` over the group and leaves rank r's share of the result in its
        ``dst``: elements [r x n, (r+1) x n) of the reduction, n = ``dst.size``; returns
        ``dst`` (the one given, or a new 1-D array/tensor of ``src``'s kind and dtype).

        ``src`` holds world x n elements on every peer (``world`` being
        :attr:`group_world_size`). op and quantization as for :meth:`all_reduce` (a
        quantized result is the decoded form of one encoding). Every peer calls it with
        the same tag, size, dtype, op and quantization (else OperationMismatchError for
        all). On failure ``dst`` holds what it held before. Once a peer has left, it fails
        on every peer with ViewChangedError until :meth:`update_topology`; a group of one
        gets TooFewPeersError.
        """
        args, _, d = self._reduce_scatter_args(src, dst, op, quantization, tag)
        self._impl.reduce_scatter(*args)
        return d.obj

    def reduce_scatter_async(self, src: Any, dst: Any = None, *, op: Union[str, ReduceOp] = "sum",
                             quantization: Union[None, str, Quantization] = None, tag: int = 0) -> AsyncHandle:
        """Starts a :meth:`reduce_scatter` and returns an :class:`AsyncHandle` at once; its
        ``result`` is the destination (allocated here when ``dst`` is None)."""
        args, s, d = self._reduce_scatter_args(src, dst, op, quantization, tag)
        impl = self._impl.reduce_scatter_async(*args, (s.obj, d.obj))
        return AsyncHandle(impl, s.obj, d.obj, args[-1])

    def barrier(self, *, tag: int = 0) -> None:
        """Returns once every peer of the group has entered the barrier of this tag, with
        the same outcome for all (one vote, no data). PeerConnectionLostError if a peer
        was lost meanwhile; TooFewPeersError in a group of one."""
        self._impl.barrier(_check_uint("tag", tag, 64))

    def barrier_async(self, *, tag: int = 0) -> AsyncHandle:
        """Enters the barrier of this tag and returns an :class:`AsyncHandle` at once
        (``result`` is None)."""
        tag = _check_uint("tag", tag, 64)
        return AsyncHandle(self._impl.barrier_async(tag), None, None, tag)

    def all_reduce_multiple_with_retry(self, ops: Iterable[_OpSpec], max_in_flight: int = 4) -> List[ReduceInfo]:
        """Runs several all-reduces, at most ``max_in_flight`` at once; those that fail
        because a peer was lost are retried with the survivors. Returns one
        :class:`ReduceInfo` per operation, or raises the first error that is not a lost peer.

        Each operation is a tuple ``(src, dst_or_None, op, tag[, quantization])`` or a
        dict with keys ``src``, ``dst`` (optional), ``op`` (default 'sum'), ``tag``
        (default: its position) and ``quantization`` (optional). Tags must be distinct.
        An operation whose ``src`` is None is a barrier of its tag (``dst``, ``op`` and
        ``quantization`` None or absent): ``(None, None, None, tag)`` or
        ``{"src": None, "tag": tag}``.
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
                op, tag, q = spec.get("op", None if src is None else "sum"), spec.get("tag", i), spec.get("quantization")
            elif isinstance(spec, (tuple, list)) and len(spec) in (4, 5):
                src, dst, op, tag = spec[:4]
                q = spec[4] if len(spec) == 5 else None
            else:
                raise InvalidArgumentError(
                    f"operation {i}: expected (src, dst_or_None, op, tag[, quantization]) or a dict, got {spec!r}")
            if src is None:
                if dst is not None or op is not None or q is not None:
                    raise InvalidArgumentError(
                        f"operation {i}: a barrier (src None) takes no dst, op or quantization")
                descs.append((0, 0, 0, 0, 0, 0, _check_uint("tag", tag, 64)))
                continue
            desc, s, d, _ = self._descriptor(src, dst, op, q, tag)
            descs.append(desc[:7])  # no residual here
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
        revision, sent, received, wire_sent, wire_received, streams = self._impl.sync_shared_state(
            tensors, state.revision, code)
        state.revision = revision
        return SyncInfo(sent, received, wire_sent, wire_received, streams)

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
