"""The exception hierarchy, argument checks of arrays and tensors, and calls made in the
wrong state (before connect, after close, from another thread, without a master)."""

from __future__ import annotations

import pickle
import socket
import threading
import time

import numpy as np
import pytest

import lockstep
from conftest import free_port
from lockstep import Status

torch = pytest.importorskip("torch")

RETRYABLE = {
    Status.PEER_CONNECTION_LOST, Status.UPDATE_TOPOLOGY_FAILED, Status.TOPOLOGY_OPTIMIZATION_FAILED,
    Status.OPERATION_MISMATCH, Status.HASH_MISMATCH, Status.NO_SHARED_STATE_AVAILABLE,
}
FATAL = {
    Status.MASTER_CONNECTION_LOST, Status.MASTER_CONNECTION_FAILED, Status.KICKED, Status.REJECTED,
    Status.REVISION_VIOLATION, Status.SHARED_STATE_MISMATCH, Status.PROTOCOL_ERROR, Status.AUTHENTICATION_FAILED,
    Status.NOT_SERVING,
}
EXPECTED_NAMES = {
    1: "NotInitializedError", 2: "InternalError", 3: "InvalidArgumentError", 4: "InvalidUsageError",
    5: "TooFewPeersError", 6: "MasterConnectionFailedError", 7: "MasterConnectionLostError",
    8: "PeerConnectionFailedError", 9: "PeerConnectionLostError", 10: "NoSharedStateAvailableError",
    11: "PendingAsyncOperationsError", 12: "UpdateTopologyFailedError", 13: "TopologyOptimizationFailedError",
    14: "KickedError", 15: "RejectedError", 16: "OperationMismatchError", 17: "ProtocolError",
    18: "LockstepTimeoutError", 19: "WrongThreadError", 20: "LockstepInterruptedError",
    21: "RevisionViolationError", 22: "SharedStateMismatchError", 23: "HashMismatchError",
    24: "AuthenticationFailedError", 25: "ViewChangedError", 26: "KeyNotFoundError", 27: "LimitExceededError",
    28: "NonFiniteContributionError", 29: "NotServingError",
}


@pytest.fixture
def offline():
    """A communicator that is never connected (nothing listens at its master address)."""
    comm = lockstep.Communicator(f"127.0.0.1:{free_port()}", base_port=0, connect_timeout_ms=500)
    yield comm
    comm.close()


# ------------------------------------------------------------------ hierarchy


def test_one_class_per_status_with_status_values():
    assert sorted(lockstep.ERROR_CLASSES) == list(range(1, 30))
    assert sorted(lockstep.ERROR_CLASSES) == sorted(s for s in Status if s != Status.OK)
    for code, name in EXPECTED_NAMES.items():
        cls = getattr(lockstep, name)
        assert lockstep.ERROR_CLASSES[code] is cls
        assert issubclass(cls, lockstep.Error) and issubclass(cls, Exception)
        exc = lockstep.error_for_status(code, "the message")
        assert type(exc) is cls
        assert exc.status == code and isinstance(exc.status, int)
        assert exc.status_name == Status(code).name
        assert str(exc) == "the message" and exc.message == "the message"
        assert cls().status == code  # the default status of the class


def test_group_bases_tell_peer_failures_from_misuse():
    for code, cls in lockstep.ERROR_CLASSES.items():
        assert issubclass(cls, lockstep.RetryableError) == (code in RETRYABLE), cls
        assert issubclass(cls, lockstep.FatalError) == (code in FATAL), cls
    assert issubclass(lockstep.InvalidArgumentError, ValueError)
    for cls in (lockstep.NotInitializedError, lockstep.InvalidUsageError, lockstep.WrongThreadError,
                lockstep.TooFewPeersError, lockstep.ViewChangedError, lockstep.KeyNotFoundError,
                lockstep.LimitExceededError, lockstep.NonFiniteContributionError):
        assert not issubclass(cls, (lockstep.RetryableError, lockstep.FatalError))
    assert issubclass(lockstep.KeyNotFoundError, KeyError)
    # Not the builtins of the same name.
    assert not issubclass(lockstep.LockstepTimeoutError, TimeoutError)
    assert not issubclass(lockstep.LockstepInterruptedError, InterruptedError)


def test_errors_pickle_and_unknown_codes():
    exc = lockstep.PeerConnectionLostError("peer p2 lost")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is lockstep.PeerConnectionLostError and back.status == 9 and str(back) == "peer p2 lost"
    unknown = lockstep.error_for_status(99, "?")
    assert type(unknown) is lockstep.Error and unknown.status == 99 and unknown.status_name == "UNKNOWN_STATUS"
    assert lockstep.status_string(9).startswith("a participating peer was lost")
    # The C library's name of every status, the newest included.
    for code in Status:
        assert lockstep._lockstep.status_name(int(code)) == code.name
    assert lockstep._lockstep.status_name(int(max(Status)) + 1) == "UNKNOWN_STATUS"
    assert isinstance(lockstep.__version__, str) and lockstep.__version__.count(".") == 2


# ------------------------------------------------------------- wrong state


def test_calls_before_connect_raise_not_initialized(offline):
    a = np.zeros(4, dtype=np.float32)
    state = lockstep.SharedState({"w": a})
    calls = {
        "update_topology": offline.update_topology,
        "optimize_topology": offline.optimize_topology,
        "are_peers_pending": offline.are_peers_pending,
        "agree": lambda: offline.agree(True),
        "rank": lambda: offline.rank,
        "id": lambda: offline.id,
        "membership": offline.membership,
        "world_size": lambda: offline.world_size,
        "group_world_size": lambda: offline.group_world_size,
        "num_groups": lambda: offline.num_groups,
        "largest_group_size": lambda: offline.largest_group_size,
        "all_reduce": lambda: offline.all_reduce(a),
        "all_reduce_async": lambda: offline.all_reduce_async(a),
        "multiple": lambda: offline.all_reduce_multiple_with_retry([(a, None, "sum", 0)], 1),
        "multiple barrier": lambda: offline.all_reduce_multiple_with_retry([(None, None, None, 0)], 1),
        "broadcast": lambda: offline.broadcast(a, 0),
        "broadcast_async": lambda: offline.broadcast_async(a, 0),
        "all_gather": lambda: offline.all_gather(a, np.zeros(8, np.float32)),
        "all_gather new": lambda: offline.all_gather(a),
        "all_gather counts": lambda: offline.all_gather(a, np.zeros(8, np.float32), counts=[4, 4]),
        "all_gather_async": lambda: offline.all_gather_async(a, np.zeros(8, np.float32)),
        "reduce_scatter": lambda: offline.reduce_scatter(a, np.zeros(2, np.float32)),
        "reduce_scatter_async": lambda: offline.reduce_scatter_async(a),
        "barrier": offline.barrier,
        "barrier_async": offline.barrier_async,
        "sync_shared_state": lambda: offline.sync_shared_state(state),
    }
    for name, call in calls.items():
        with pytest.raises(lockstep.NotInitializedError) as info:
            call()
        assert info.value.status == Status.NOT_INITIALIZED == 1, name
        assert info.value.status_name == "NOT_INITIALIZED"
        assert str(info.value).startswith("NOT_INITIALIZED"), str(info.value)


def test_connect_without_master_fails_fast(offline):
    with pytest.raises(lockstep.MasterConnectionFailedError) as info:
        offline.connect()
    assert isinstance(info.value, lockstep.FatalError)
    assert info.value.status == 6
    assert "unreachable" in str(info.value)
    assert "unreachable" in offline.last_error


def test_closed_communicator_raises_invalid_usage():
    comm = lockstep.Communicator(f"127.0.0.1:{free_port()}", base_port=0)
    with comm:
        assert not comm.closed
    assert comm.closed
    comm.close()  # idempotent
    for call in (comm.connect, comm.are_peers_pending, lambda: comm.rank,
                 lambda: comm.all_reduce(np.zeros(2, dtype=np.int32)), comm.barrier,
                 lambda: comm.broadcast(np.zeros(2, dtype=np.int32), 0)):
        with pytest.raises(lockstep.InvalidUsageError, match="closed"):
            call()


def test_communicator_from_another_thread_raises_wrong_thread(offline):
    caught = []

    def other():
        try:
            offline.agree(True)
        except lockstep.Error as e:
            caught.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join(10)
    assert len(caught) == 1 and isinstance(caught[0], lockstep.WrongThreadError)
    assert caught[0].status == 19 and "thread" in str(caught[0])


def test_master_lifecycle_and_errors():
    master = lockstep.Master("127.0.0.1:0")
    assert not master.running
    with pytest.raises(lockstep.InvalidUsageError, match="run"):
        _ = master.port
    with master:
        assert master.running and master.port > 0
        assert master.address == f"127.0.0.1:{master.port}"
        # A second master on the same port cannot bind.
        with pytest.raises(lockstep.MasterConnectionFailedError):
            lockstep.Master(master.address).run()
    assert not master.running
    master.close()  # idempotent
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Master("127.0.0.1:notaport")
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Master("127.0.0.1:0", heartbeat_timeout_ms=1)
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Master("127.0.0.1:0", peers_max=-1)
    for bad in (99, 3_600_001):
        with pytest.raises(lockstep.InvalidArgumentError, match="newcomer_timeout_ms"):
            lockstep.Master("127.0.0.1:0", newcomer_timeout_ms=bad)
    lockstep.Master("127.0.0.1:0", newcomer_timeout_ms=100).close()


def test_master_wait_returns_after_interrupt():
    master = lockstep.Master("127.0.0.1:0")
    master.run()
    port = master.port
    interrupted = threading.Event()

    def interrupt() -> None:
        interrupted.set()
        master.interrupt()

    timer = threading.Timer(0.2, interrupt)
    timer.start()
    started = time.monotonic()
    master.wait()  # releases the GIL: the timer thread runs
    waited = time.monotonic() - started
    returned_after_interrupt = interrupted.is_set()
    timer.join()
    # wait() returned because of the interrupt, soon after it, and the master has
    # stopped: it has no port and nothing listens on the one it had.
    assert returned_after_interrupt, "wait() returned before the interrupt"
    assert waited < 5, f"wait() returned {waited:.1f} s after it was called"
    with pytest.raises(lockstep.InvalidUsageError, match="not running"):
        _ = master.port
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    master.close()


def test_master_close_while_another_thread_waits():
    master = lockstep.Master("127.0.0.1:0")
    master.run()
    waiter = threading.Thread(target=master.wait)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    master.close()  # interrupts the master; the waiting thread returns
    waiter.join(10)
    assert not waiter.is_alive() and not master.running


def test_communicator_argument_checks():
    for kwargs in ({"base_port": 70000}, {"base_port": -2}, {"group": -1}, {"pool_size": 1 << 40},
                   {"master": "127.0.0.1:notaport"}, {"master": ":48148"}, {"advertised_host": 5},
                   {"p2p_stall_timeout_ms": -1}, {"p2p_stall_timeout_ms": 1 << 32}):
        with pytest.raises(lockstep.InvalidArgumentError):
            lockstep.Communicator(**kwargs)
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Communicator("127.0.0.1:1", pool_size=100000, base_port=0)  # rejected by the C library


def test_stream_count_and_congestion_control_checks():
    # Rejected by the C library: more than 16 streams, names that cannot be an algorithm's.
    for kwargs in ({"p2p_streams": 17}, {"tcp_congestion": "BBR"}, {"tcp_congestion": "a" * 16},
                   {"tcp_congestion": "bbr;rm"}):
        with pytest.raises(lockstep.InvalidArgumentError):
            lockstep.Communicator("127.0.0.1:1", base_port=0, **kwargs)
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Communicator("127.0.0.1:1", base_port=0, p2p_streams=-1)
    # Accepted: a fixed count, adaptive, the algorithm every Linux kernel has, and one the
    # kernel does not have (a warning, and the system's default).
    for kwargs in ({"p2p_streams": 16}, {"p2p_streams": 0}, {"tcp_congestion": "reno"},
                   {"tcp_congestion": "no-such-cc"}):
        lockstep.Communicator("127.0.0.1:1", base_port=0, **kwargs).close()


# ------------------------------------------------------------- array checks

# A call whose arguments pass the package's checks reaches the C library, which says
# NOT_INITIALIZED: that tells "accepted" from "rejected" without any peer.


def accepted(call) -> None:
    with pytest.raises(lockstep.NotInitializedError):
        call()


def rejected(call, match: str) -> None:
    with pytest.raises(lockstep.InvalidArgumentError, match=match) as info:
        call()
    assert info.value.status == Status.INVALID_ARGUMENT
    assert isinstance(info.value, ValueError)


def test_unsupported_dtypes_and_types(offline):
    for bad in (np.zeros(4, dtype=np.bool_), np.zeros(4, dtype=np.complex64), np.zeros(4, dtype=object),
                np.zeros(4, dtype="datetime64[s]")):
        rejected(lambda: offline.all_reduce(bad), "unsupported dtype")
    for bad in (torch.zeros(4, dtype=torch.bool), torch.zeros(4, dtype=torch.complex64)):
        rejected(lambda: offline.all_reduce(bad), "unsupported dtype")
    for bad in ([1.0, 2.0], b"abcd", 3.0, None):
        rejected(lambda: offline.all_reduce(bad), "numpy.ndarray or a CPU torch.Tensor")
    rejected(lambda: offline.all_reduce(np.zeros(4, dtype=">f4")), "byte order")
    rejected(lambda: offline.all_reduce(np.zeros(0, dtype=np.float32)), "empty")
    rejected(lambda: offline.all_reduce(torch.zeros(0)), "empty")


def test_non_contiguous_is_rejected(offline):
    a = np.zeros((4, 6), dtype=np.float32)
    rejected(lambda: offline.all_reduce(a[:, ::2]), "not C-contiguous")
    rejected(lambda: offline.all_reduce(a.T), "not C-contiguous")
    rejected(lambda: offline.all_reduce(np.zeros(4, np.float32), a[::2, :2]), "not C-contiguous")  # as dst
    t = torch.zeros(4, 6)
    rejected(lambda: offline.all_reduce(t[:, ::2]), "not contiguous")
    rejected(lambda: offline.all_reduce(t.t()), "not contiguous")
    accepted(lambda: offline.all_reduce(a[1:3]))  # a contiguous slice is fine (no copy)
    accepted(lambda: offline.all_reduce(t[1]))


def test_src_dst_mismatch_and_read_only(offline):
    rejected(lambda: offline.all_reduce(np.zeros(4, np.float32), np.zeros(5, np.float32)), "size")
    rejected(lambda: offline.all_reduce(np.zeros(4, np.float32), np.zeros(4, np.float64)), "dtype")
    rejected(lambda: offline.all_reduce(torch.zeros(4), torch.zeros(4, dtype=torch.float64)), "dtype")
    rejected(lambda: offline.all_reduce(np.zeros(4, np.float32), torch.zeros(5)), "size")
    ro = np.zeros(4, np.float32)
    ro.setflags(write=False)
    rejected(lambda: offline.all_reduce(np.zeros(4, np.float32), ro), "read-only")
    rejected(lambda: offline.all_reduce(ro), "read-only")  # in place
    accepted(lambda: offline.all_reduce(ro, np.zeros(4, np.float32)))  # a read-only source is fine
    accepted(lambda: offline.all_reduce(np.zeros((2, 3), np.int64), np.zeros(6, np.int64)))  # shapes may differ
    accepted(lambda: offline.all_reduce(np.zeros(4, np.float32), torch.zeros(4)))  # numpy into torch


def test_tensors_requiring_grad_are_rejected_with_advice(offline):
    p = torch.zeros(4, requires_grad=True)
    rejected(lambda: offline.all_reduce(p), r"requires grad.*detach\(\)")
    rejected(lambda: offline.all_reduce(torch.zeros(4), p), "requires grad")
    accepted(lambda: offline.all_reduce(p.detach()))
    rejected(lambda: lockstep.SharedState({"p": p}), "requires grad")


def test_op_quantization_tag_checks(offline):
    a = np.zeros(4, np.float32)
    rejected(lambda: offline.all_reduce(a, op="mean"), "unknown reduce op")
    rejected(lambda: offline.all_reduce(a, op=7), "unknown reduce op")
    rejected(lambda: offline.all_reduce(a, quantization="int4"), "unknown quantization")
    rejected(lambda: offline.all_reduce(a, tag=-1), "tag")
    rejected(lambda: offline.all_reduce(a, tag=1 << 64), "tag")
    for op in ("sum", "AVG", "prod", "max", "min", lockstep.ReduceOp.MAX, 4):
        accepted(lambda: offline.all_reduce(a, op=op, tag=(1 << 64) - 1))
    for q in (None, "none", "minmax", "zeropoint", lockstep.Quantization.ZEROPOINT, "minmax4", "ZeroPoint4", "f16",
              "bf16", lockstep.Quantization.BF16):
        accepted(lambda: offline.all_reduce(a, quantization=q))
    # A cast needs a wider float than the cast type.
    rejected(lambda: offline.all_reduce(np.zeros(4, np.float16), quantization="bf16"), "floating-point")
    # Error feedback: a residual of src's dtype and size, for a quantized sum or avg.
    r = np.zeros(4, np.float32)
    accepted(lambda: offline.all_reduce(a, quantization="minmax4", residual=r))
    rejected(lambda: offline.all_reduce(a, quantization="minmax4", residual=np.zeros(3, np.float32)), "residual")
    rejected(lambda: offline.all_reduce(a, quantization="minmax4", residual=np.zeros(4, np.float64)), "residual")
    rejected(lambda: offline.all_reduce(a, residual=r), "residual")
    rejected(lambda: offline.all_reduce(a, op="max", quantization="minmax4", residual=r), "residual")
    rejected(lambda: offline.all_reduce(a, quantization="minmax4", residual=a), "overlaps")
    # The distribution hint.
    for d in (None, "none", "uniform", "Normal", lockstep.Distribution.NORMAL, 2):
        accepted(lambda: offline.all_reduce(a, quantization="minmax4", distribution=d))
    rejected(lambda: offline.all_reduce(a, quantization="minmax4", distribution="gaussian"), "unknown distribution")
    rejected(lambda: offline.all_reduce(a, quantization="minmax4", distribution=3), "unknown distribution")
    # Quantization of an integer dtype: refused by the C library itself.
    rejected(lambda: offline.all_reduce(np.zeros(4, np.int32), quantization="minmax"), "floating-point")


def test_multiple_with_retry_checks(offline):
    a = np.zeros(4, np.float32)
    rejected(lambda: offline.all_reduce_multiple_with_retry([(a, None)], 1), "expected")
    rejected(lambda: offline.all_reduce_multiple_with_retry([{"dst": a}], 1), "needs 'src'")
    rejected(lambda: offline.all_reduce_multiple_with_retry([{"src": a, "bogus": 1}], 1), "unknown")
    rejected(lambda: offline.all_reduce_multiple_with_retry([(a, None, "sum", 0)], 0), "max_in_flight")
    rejected(lambda: offline.all_reduce_multiple_with_retry([(np.zeros(2, np.bool_), None, "sum", 0)], 1), "dtype")
    accepted(lambda: offline.all_reduce_multiple_with_retry(
        [(a, None, "sum", 0), {"src": np.ones(2), "op": "max", "tag": 1}], 2))


def test_broadcast_all_gather_reduce_scatter_barrier_checks(offline):
    a = np.zeros(4, np.float32)
    rejected(lambda: offline.broadcast(a, -1), "root")
    rejected(lambda: offline.broadcast(a, 1 << 32), "root")
    rejected(lambda: offline.broadcast(np.zeros(0, np.float32), 0), "empty")
    ro = np.zeros(4, np.float32)
    ro.setflags(write=False)
    rejected(lambda: offline.broadcast(ro, 0), "read-only")
    rejected(lambda: offline.broadcast_async(a, 0, tag=-1), "tag")
    accepted(lambda: offline.broadcast(a, 7))  # a root outside the view: refused by the library on every peer
    accepted(lambda: offline.broadcast(torch.zeros(3, dtype=torch.bfloat16), 0, tag=(1 << 64) - 1))

    rejected(lambda: offline.all_gather(a, np.zeros(8, np.float64)), "dtype")
    rejected(lambda: offline.all_gather(np.zeros(0, np.float32), np.zeros(8, np.float32)), "empty")
    rejected(lambda: offline.all_gather(a, ro), "read-only")
    rejected(lambda: offline.all_gather([1.0], np.zeros(8, np.float32)), "numpy.ndarray")
    rejected(lambda: offline.all_gather(a, np.zeros(8, np.float32), counts=[4, -1]), r"counts\[1\]")
    rejected(lambda: offline.all_gather(a, np.zeros(8, np.float32), counts=[]), "counts is empty")
    rejected(lambda: offline.all_gather(a, np.zeros(8, np.float32), counts="44"), "sequence")
    rejected(lambda: offline.all_gather(None, None, counts=[0, 4]), "src or dst")
    rejected(lambda: offline.all_gather(None, np.zeros(8, np.float32)), "numpy.ndarray")  # src needed without counts
    rejected(lambda: offline.all_gather_async(a, np.zeros(8, np.float32), tag=1 << 64), "tag")
    # A destination too small is refused by the library (on every peer), not here.
    accepted(lambda: offline.all_gather(a, np.zeros(1, np.float32)))
    accepted(lambda: offline.all_gather(None, np.zeros(4, np.float32), counts=np.array([0, 4])))
    accepted(lambda: offline.all_gather(torch.zeros(4), torch.zeros(8)))

    rejected(lambda: offline.reduce_scatter(a, np.zeros(2, np.float64)), "dtype")
    rejected(lambda: offline.reduce_scatter(np.zeros(0, np.float32), np.zeros(2, np.float32)), "empty")
    rejected(lambda: offline.reduce_scatter(a, ro[:2]), "read-only")
    rejected(lambda: offline.reduce_scatter(a, np.zeros(2, np.float32), op="mean"), "unknown reduce op")
    rejected(lambda: offline.reduce_scatter(a, np.zeros(2, np.float32), quantization="int4"), "unknown quantization")
    rejected(lambda: offline.reduce_scatter_async(a, np.zeros(2, np.float32), tag=-1), "tag")
    accepted(lambda: offline.reduce_scatter(a, np.zeros(2, np.float32), op="max", quantization="minmax"))

    rejected(lambda: offline.barrier(tag=-1), "tag")
    rejected(lambda: offline.barrier_async(tag=1 << 64), "tag")
    with pytest.raises(TypeError):
        offline.barrier(3)  # the tag is a keyword, as for every collective
    rejected(lambda: offline.all_reduce_multiple_with_retry([(None, a, None, 0)], 1), "barrier")
    rejected(lambda: offline.all_reduce_multiple_with_retry([(None, None, "sum", 0)], 1), "barrier")
    rejected(lambda: offline.all_reduce_multiple_with_retry([{"src": None, "quantization": "minmax"}], 1), "barrier")
    accepted(lambda: offline.all_reduce_multiple_with_retry([{"src": None, "tag": 5}, (a, None, "sum", 6)], 1))


def test_shared_state_checks(offline):
    a = np.zeros(4, np.float32)
    rejected(lambda: lockstep.SharedState({"": a}), "1..255 bytes")
    rejected(lambda: lockstep.SharedState({"k" * 256: a}), "1..255 bytes")
    rejected(lambda: lockstep.SharedState({1: a}), "key must be a str")
    rejected(lambda: lockstep.SharedState([lockstep.TensorInfo("a", a), lockstep.TensorInfo("a", a)]), "duplicate")
    rejected(lambda: lockstep.SharedState(["a"]), "TensorInfo")
    rejected(lambda: lockstep.TensorInfo("a", [1, 2]), "numpy.ndarray")
    rejected(lambda: lockstep.TensorInfo("a", a[::2]), "contiguous")
    rejected(lambda: lockstep.SharedState({"a": a}, revision=-1), "revision")
    state = lockstep.SharedState({"a": a})
    with pytest.raises(lockstep.InvalidArgumentError):
        state.revision = 1 << 64
    rejected(lambda: offline.sync_shared_state({"a": a}), "SharedState")
    rejected(lambda: offline.sync_shared_state(state, "popular"), "strategy")
    ro = np.zeros(4, np.float32)
    ro.setflags(write=False)
    ro_state = lockstep.SharedState({"ro": ro})
    rejected(lambda: offline.sync_shared_state(ro_state, "receive_only"), "read-only")
    accepted(lambda: offline.sync_shared_state(ro_state, "send_only"))  # never written
    accepted(lambda: offline.sync_shared_state(state, lockstep.SyncStrategy.RECEIVE_ONLY))
    assert state["a"] is a


def test_results_are_hashable_values():
    info = lockstep.ReduceInfo(2, 10, 20)
    assert info == lockstep.ReduceInfo(2, 10, 20) and len({info, lockstep.ReduceInfo(2, 10, 20)}) == 1
    with pytest.raises(Exception):
        info.world_size = 3  # frozen
    assert lockstep.SyncInfo(1, 2).bytes_received == 2
