"""Broadcast, all-gather (with counts per rank), reduce-scatter and barrier, blocking and
async, over 2, 3 and 4 peer processes against a NumPy reference, with results identical
across peers; arguments that differ between peers (OperationMismatchError for all) or
that one peer cannot use (InvalidArgumentError for all); a group of one
(TooFewPeersError); and a peer killed during a large reduce-scatter or all-gather: the
same failure for every survivor with its destination untouched, ViewChangedError for the
same call until update_topology, then success with the survivors.

Every peer is a process of its own (collective_worker.py) running the module-level
peer_* functions below on its communicator; the master lives in the test process, with
its HTTP state, which the tests poll where they need a peer to be inside a call."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from multiprocessing.connection import Connection
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import pytest

import lockstep
from conftest import CALL_TIMEOUT_S, join_group

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "collective_worker.py")
COUNT = 1001  # elements per rank: odd, not a multiple of the ring's chunking


# ------------------------------------------------------------------- processes


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a peer process."""

    def __str__(self) -> str:
        return self.args[0]


class NoAnswer(AssertionError):
    """A peer process did not answer in time, or ended."""


class WorkerPeer:
    """A peer process (collective_worker.py) and the test's end of its socket pair."""

    def __init__(self, master_address: str, name: str) -> None:
        self.name = name
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen([sys.executable, WORKER, str(theirs.fileno()), master_address, name],
                                         pass_fds=[theirs.fileno()], start_new_session=True)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        assert self.conn.poll(CALL_TIMEOUT_S), f"{name} did not start"
        assert self.conn.recv() == ("ready", name)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Sends fn(comm, *args, **kwargs) to the peer; result() collects its answer."""
        self.conn.send((fn, args, kwargs))

    def result(self, timeout: float = CALL_TIMEOUT_S) -> Any:
        if not self.conn.poll(max(0.0, timeout)):
            raise NoAnswer(f"{self.name}: no answer within {timeout:.0f} s")
        try:
            reply = self.conn.recv()
        except EOFError:
            raise NoAnswer(f"{self.name}: the process ended (exit code {self.proc.poll()})") from None
        if reply[0] == "ok":
            return reply[1]
        _, exc, tb = reply
        raise exc from RemoteTraceback(f"in {self.name}:\n{tb}")

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.submit(fn, *args, **kwargs)
        return self.result()

    def close(self, graceful: bool = True) -> None:
        """Ends the process: asks it to close its communicator, or (not graceful: it may be
        stuck inside a call) kills it."""
        if graceful and self.proc.poll() is None:
            try:
                self.conn.send(None)
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.conn.close()


class ProcessCluster:
    """A master in this process (with its HTTP state) and `size` peer processes of one
    group, every one admitted."""

    def __init__(self, size: int) -> None:
        self.master = lockstep.Master("127.0.0.1:0", http="127.0.0.1:0")
        self.master.run()
        # Set once a call failed or did not answer: the peers may be out of step (some
        # still inside a collective), so the cluster is not reused.
        self.broken = False
        self.peers: List[WorkerPeer] = []
        try:
            self.peers = [WorkerPeer(self.master.address, f"peer{i}") for i in range(size)]
            # The first peer is admitted alone; the others register while it votes.
            self.peers[0].call(peer_connect)
            for p in self.peers[1:]:
                p.submit(join_group, size)
            self.peers[0].submit(join_group, size, connect=False)
            self.results(self.peers)
        except BaseException:
            self.close()
            raise

    @property
    def size(self) -> int:
        return len(self.peers)

    def results(self, peers: List[WorkerPeer], timeout: float = CALL_TIMEOUT_S) -> List[Any]:
        """The answers of the peers, in their order; the first failure is re-raised once
        every peer answered (or one did not answer in time)."""
        deadline = time.monotonic() + timeout
        outcomes = []
        try:
            for p in peers:
                try:
                    outcomes.append((True, p.result(deadline - time.monotonic())))
                except NoAnswer:
                    raise  # nothing more to wait for
                except BaseException as e:
                    outcomes.append((False, e))
        except BaseException:
            self.broken = True
            raise
        for ok, value in outcomes:
            if not ok:
                self.broken = True
                raise value
        return [value for _, value in outcomes]

    def run(self, fn: Callable[..., Any], *args: Any, peers: Optional[List[WorkerPeer]] = None,
            **kwargs: Any) -> List[Any]:
        """Runs fn(comm, *args, **kwargs) on every peer at once; the results in peer order."""
        peers = self.peers if peers is None else peers
        for p in peers:
            p.submit(fn, *args, **kwargs)
        return self.results(peers)

    def state(self) -> dict:
        with urllib.request.urlopen(f"http://{self.master.http_address}/api/state", timeout=10) as response:
            return json.loads(response.read().decode("utf-8"))

    def wait_for_round(self, tag: int, predicate: Callable[[dict], bool], what: str) -> None:
        """Polls the master's open rounds until the collective of this tag satisfies the predicate."""
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            rounds = [op for op in self.state()["operations"] if op["tag"] == tag and op["operation"] == "all_reduce"]
            if rounds and predicate(rounds[0]):
                return
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {rounds}"
            time.sleep(0.01)

    def close(self) -> None:
        for p in self.peers:
            try:
                p.close(graceful=not self.broken)
            except Exception:
                pass
        self.master.close()


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}peers")
def cluster_slot(request):
    """The cluster of one size shared by the tests of this module."""
    slot: Dict[str, Any] = {"size": request.param, "cluster": None}
    yield slot
    if slot["cluster"] is not None:
        slot["cluster"].close()


@pytest.fixture
def cluster(cluster_slot):
    """The shared cluster of this size; a fresh one after a test that left it broken."""
    c = cluster_slot["cluster"]
    if c is not None and c.broken:
        c.close()
        c = cluster_slot["cluster"] = None
    if c is None:
        c = cluster_slot["cluster"] = ProcessCluster(cluster_slot["size"])
    return c


# --------------------------------------------------------------- the reference


def values(dtype: Any, rank: int, case: int, count: int = COUNT) -> np.ndarray:
    """Deterministic data of one rank. Integers span the whole range (sums wrap); floats
    are small multiples of 1/2, so sums of four are exact in every float type and the
    order of the ring's additions does not matter."""
    rng = np.random.default_rng(7919 * case + rank)
    dt = np.dtype(dtype)
    if dt.kind in "ui":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=count, dtype=dt, endpoint=True)
    return (rng.integers(-4, 5, size=count) / 2).astype(dt)


def reduced(inputs: List[np.ndarray], op: str) -> np.ndarray:
    dt = inputs[0].dtype
    with np.errstate(over="ignore"):
        if op == "max":
            return np.maximum.reduce(inputs)
        total = inputs[0].copy()
        for x in inputs[1:]:
            total = total + x  # wraps for integers
        if op == "sum":
            return total.astype(dt)
        assert op == "avg" and dt.kind == "f"
        return (total.astype(np.float64) / len(inputs)).astype(dt)


def gather_counts(world: int) -> List[int]:
    """Counts per rank for the all-gatherv: uneven, rank 1 contributes nothing."""
    counts = [3 + (5 * r) % 7 for r in range(world)]
    counts[1] = 0
    return counts


def assert_identical(arrays: List[np.ndarray], what: str) -> None:
    for a in arrays[1:]:
        assert a.dtype == arrays[0].dtype and a.tobytes() == arrays[0].tobytes(), what


# ------------------------------------------------ functions run by the peers


def peer_connect(comm: lockstep.Communicator) -> None:
    comm.connect()


def peer_view(comm: lockstep.Communicator) -> tuple:
    return comm.rank, comm.group_world_size


def outcome(call: Callable[[], Any]) -> tuple:
    """("ok", result) or (exception class name, status) of a call."""
    try:
        return ("ok", call())
    except lockstep.Error as e:
        return (type(e).__name__, e.status)


BROADCAST_DTYPES = [np.float32, np.int64, np.uint8, np.float16]


def peer_broadcast(comm: lockstep.Communicator, tag: int) -> tuple:
    rank, world = comm.rank, comm.group_world_size
    out = {}
    for root in range(world):
        for case, dt in enumerate(BROADCAST_DTYPES):
            buf = values(dt, rank, case)
            info = comm.broadcast(buf, root, tag=tag)
            assert info.world_size == world
            out[(root, case)] = buf
        # A larger buffer, pipelined down the ring in many sub-chunks.
        big = values(np.float64, rank, 99, 300_000)
        comm.broadcast(big, root, tag=tag + 1)
        out[(root, "big")] = big
    return rank, world, out


def peer_all_gather(comm: lockstep.Communicator, tag: int) -> tuple:
    rank, world = comm.rank, comm.group_world_size
    out = {}
    # dst=None: a new array of shape (world, *src.shape).
    src = values(np.float32, rank, 1, 77).reshape(7, 11)
    out["new"] = comm.all_gather(src, tag=tag)
    assert out["new"].shape == (world, 7, 11) and out["new"].dtype == np.float32
    # A given destination, 1-D; the call returns it.
    src = values(np.int32, rank, 2)
    dst = np.full(world * COUNT, -1, dtype=np.int32)
    assert comm.all_gather(src, dst, tag=tag) is dst
    out["given"] = dst
    # In place: the source is this rank's own place in the destination.
    dst = np.zeros(world * COUNT, dtype=np.float64)
    dst[rank * COUNT:(rank + 1) * COUNT] = values(np.float64, rank, 3)
    comm.all_gather(dst[rank * COUNT:(rank + 1) * COUNT], dst, tag=tag)
    out["in_place"] = dst
    # With counts per rank (rank 1 contributes nothing): dst=None with an empty source,
    # then a given destination with src=None on the rank whose count is 0.
    counts = gather_counts(world)
    src = values(np.uint16, rank, 4, counts[rank])
    out["counts_new"] = comm.all_gather(src, counts=counts, tag=tag)
    dst = np.full(sum(counts), 9, dtype=np.uint16)
    comm.all_gather(src if counts[rank] else None, dst, counts=counts, tag=tag)
    out["counts_given"] = dst
    return rank, world, out


REDUCE_SCATTER_CASES = [(np.float32, "sum"), (np.float64, "avg"), (np.float32, "max"), (np.int32, "sum"),
                        (np.int64, "max"), (np.float16, "sum")]


def peer_reduce_scatter(comm: lockstep.Communicator, tag: int) -> tuple:
    rank, world = comm.rank, comm.group_world_size
    out = {}
    for case, (dt, op) in enumerate(REDUCE_SCATTER_CASES):
        src = values(dt, rank, 10 + case, world * COUNT)
        original = src.copy()
        if case % 2 == 0:
            dst = comm.reduce_scatter(src, op=op, tag=tag)  # dst=None: a new array
            assert dst.shape == (COUNT,) and dst.dtype == np.dtype(dt)
        else:
            dst = np.full(COUNT, 3, dtype=dt)
            assert comm.reduce_scatter(src, dst, op=lockstep.ReduceOp[op.upper()], tag=tag) is dst
        np.testing.assert_array_equal(src, original)  # the source is left alone
        out[case] = dst
    return rank, world, out


QUANTIZED = 4096  # elements per rank


def quantized_input(rank: int, world: int) -> np.ndarray:
    return np.linspace(-1, 1, world * QUANTIZED, dtype=np.float32) * (rank + 1)


def peer_reduce_scatter_quantized(comm: lockstep.Communicator, tag: int) -> tuple:
    rank, world = comm.rank, comm.group_world_size
    out = {}
    for q in ("minmax", "zeropoint", lockstep.Quantization.MINMAX):
        out[str(q)] = comm.reduce_scatter(quantized_input(rank, world), quantization=q, tag=tag)
    return rank, world, out


def peer_barrier(comm: lockstep.Communicator, tag: int) -> None:
    assert comm.barrier(tag=tag) is None


def peer_barrier_async_start(comm: lockstep.Communicator, tag: int) -> bool:
    global _BARRIER
    _BARRIER = comm.barrier_async(tag=tag)
    assert _BARRIER.result is None
    return _BARRIER.done()


def peer_barrier_async_done(comm: lockstep.Communicator) -> bool:
    return _BARRIER.done()


def peer_barrier_async_wait(comm: lockstep.Communicator) -> int:
    return _BARRIER.wait().world_size


_BARRIER: Any = None


def peer_async_forms(comm: lockstep.Communicator, tag: int) -> tuple:
    """Every async form in flight at once (distinct tags), polled, then awaited."""
    rank, world = comm.rank, comm.group_world_size
    bcast = values(np.float32, rank, 20, 50_000)
    gather_src = values(np.int64, rank, 21)
    rs_src = values(np.float64, rank, 22, world * COUNT)
    rs_dst = np.full(COUNT, -1.0)
    counts = gather_counts(world)
    gv_src = values(np.int8, rank, 23, counts[rank])
    handles = [
        comm.broadcast_async(bcast, world - 1, tag=tag),
        comm.all_gather_async(gather_src, tag=tag + 1),
        comm.reduce_scatter_async(rs_src, rs_dst, op="sum", tag=tag + 2),
        comm.all_gather_async(gv_src, counts=counts, tag=tag + 3),
        comm.barrier_async(tag=tag + 4),
        comm.reduce_scatter_async(rs_src, op="max", tag=tag + 5),
    ]
    assert [h.tag for h in handles] == [tag + k for k in range(6)]
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while not all(h.done() for h in handles):  # poll without blocking
        assert time.monotonic() < deadline, "the async collectives did not end"
        time.sleep(0.001)
    infos = [h.wait() for h in handles]
    assert all(isinstance(i, lockstep.ReduceInfo) and i.world_size == world for i in infos), infos
    assert handles[0].wait() == infos[0]  # waiting again returns the same result
    assert handles[0].result is bcast and handles[2].result is rs_dst and handles[4].result is None
    return rank, world, {"bcast": bcast, "gather": handles[1].result, "rs_sum": rs_dst, "gatherv": handles[3].result,
                         "rs_max": handles[5].result}


def peer_torch(comm: lockstep.Communicator, tag: int) -> tuple:
    import torch

    rank, world = comm.rank, comm.group_world_size
    out = {}
    buf = torch.from_numpy(values(np.float32, rank, 30)).to(torch.bfloat16)
    comm.broadcast(buf, 0, tag=tag)
    out["bcast"] = buf.float().numpy()
    gathered = comm.all_gather(torch.from_numpy(values(np.int32, rank, 31)), tag=tag)
    assert isinstance(gathered, torch.Tensor) and gathered.shape == (world, COUNT) and gathered.dtype == torch.int32
    out["gather"] = gathered.numpy()
    src = torch.from_numpy(values(np.float64, rank, 32, world * COUNT))
    scattered = comm.reduce_scatter(src, op="sum", tag=tag)
    assert isinstance(scattered, torch.Tensor) and scattered.dtype == torch.float64
    out["rs"] = scattered.numpy()
    dst = torch.zeros(COUNT, dtype=torch.float64)
    handle = comm.reduce_scatter_async(src, dst, op="max", tag=tag + 1)
    assert handle.wait().world_size == world and handle.result is dst
    out["rs_async"] = dst.numpy()
    return rank, world, out


def peer_mismatches(comm: lockstep.Communicator, tag: int) -> tuple:
    """Each call differs between the peers; every destination must stay as it was."""
    rank, world = comm.rank, comm.group_world_size
    results = {}
    buf = np.full(COUNT, rank, dtype=np.float32)
    results["broadcast roots"] = outcome(lambda: comm.broadcast(buf, rank, tag=tag))
    assert np.all(buf == rank)
    # All-gatherv: a list of counts per peer, each consistent with its own source.
    counts = [COUNT + (1 if r == rank else 0) for r in range(world)]
    dst = np.full(sum(counts), -1, dtype=np.int16)
    results["gather counts"] = outcome(
        lambda: comm.all_gather(np.zeros(counts[rank], np.int16), dst, counts=counts, tag=tag + 1))
    assert np.all(dst == -1)
    # All-gather: another source size on each peer.
    dst = np.full(world * (COUNT + world), -1, dtype=np.int16)
    results["gather sizes"] = outcome(lambda: comm.all_gather(np.zeros(COUNT + rank, np.int16), dst, tag=tag + 2))
    assert np.all(dst == -1)
    # Reduce-scatter: float32 on even ranks, float64 on odd ones.
    dt = np.float32 if rank % 2 == 0 else np.float64
    dst = np.full(COUNT, -1, dtype=dt)
    results["scatter dtypes"] = outcome(
        lambda: comm.reduce_scatter(np.ones(world * COUNT, dtype=dt), dst, tag=tag + 3))
    assert np.all(dst == -1)
    # The group is still usable.
    comm.barrier(tag=tag + 4)
    return results


def peer_unusable_arguments(comm: lockstep.Communicator, tag: int) -> tuple:
    """Arguments the same on every peer but unusable (a root outside the view, counts
    not one per rank), and a destination too small on rank 0 only."""
    rank, world = comm.rank, comm.group_world_size
    results = {}
    buf = np.full(COUNT, rank, dtype=np.float32)
    results["root outside"] = outcome(lambda: comm.broadcast(buf, world, tag=tag))
    assert np.all(buf == rank)
    counts = [2] * (world + 1)
    dst = np.full(2 * (world + 1), -1, dtype=np.float32)
    results["counts length"] = outcome(lambda: comm.all_gather(np.ones(2, np.float32), dst, counts=counts, tag=tag + 1))
    assert np.all(dst == -1)
    dst = np.full(world * COUNT - (1 if rank == 0 else 0), -1, dtype=np.float32)
    results["dst too small"] = outcome(lambda: comm.all_gather(np.ones(COUNT, np.float32), dst, tag=tag + 2))
    assert np.all(dst == -1)
    comm.barrier(tag=tag + 3)  # the group is still usable
    return results


def peer_alone(comm: lockstep.Communicator) -> Dict[str, tuple]:
    """Every collective in a group of one: TooFewPeersError, nothing written."""
    assert comm.group_world_size == 1
    buf = np.arange(8, dtype=np.float32)
    dst = np.full(8, -1, dtype=np.float32)
    results = {
        "all_reduce": outcome(lambda: comm.all_reduce(buf, dst, tag=1)),
        "broadcast": outcome(lambda: comm.broadcast(buf, 0, tag=2)),
        "all_gather": outcome(lambda: comm.all_gather(buf, dst, tag=3)),
        "all_gatherv": outcome(lambda: comm.all_gather(buf, dst, counts=[8], tag=4)),
        "reduce_scatter": outcome(lambda: comm.reduce_scatter(buf, dst, tag=5)),
        "barrier": outcome(lambda: comm.barrier(tag=6)),
        "broadcast_async": outcome(lambda: comm.broadcast_async(buf, 0, tag=7).wait()),
        "all_gather_async": outcome(lambda: comm.all_gather_async(buf, dst, tag=8).wait()),
        "reduce_scatter_async": outcome(lambda: comm.reduce_scatter_async(buf, dst, tag=9).wait()),
        "barrier_async": outcome(lambda: comm.barrier_async(tag=10).wait()),
        "multiple": outcome(lambda: comm.all_reduce_multiple_with_retry([(buf, dst, "sum", 11), (None, None, None, 12)])),
    }
    assert np.all(buf == np.arange(8)) and np.all(dst == -1)
    return results


def kill_buffers(kind: str, rank: int, world: int, n: int) -> tuple:
    """Source and destination of the large collective of the kill test, for `world` ranks."""
    if kind == "reduce_scatter":
        return values(np.float32, rank, 40, world * n), np.full(n, -7.0, dtype=np.float32)
    return values(np.float32, rank, 41, n), np.full(world * n, -7.0, dtype=np.float32)


def run_kind(comm: lockstep.Communicator, kind: str, src: np.ndarray, dst: np.ndarray, tag: int) -> None:
    if kind == "reduce_scatter":
        comm.reduce_scatter(src, dst, tag=tag)
    else:
        comm.all_gather(src, dst, tag=tag)


def peer_kill_victim(comm: lockstep.Communicator, kind: str, tag: int, n: int) -> None:
    src, dst = kill_buffers(kind, comm.rank, comm.group_world_size, n)
    run_kind(comm, kind, src, dst, tag)  # never returns: stopped, then killed, inside


def peer_kill_survivor(comm: lockstep.Communicator, kind: str, tag: int, n: int) -> dict:
    """The collective a peer is killed in, its retry in the old view, update topology and
    the call again with buffers for the new view."""
    world = comm.group_world_size
    src, dst = kill_buffers(kind, comm.rank, world, n)
    untouched = dst.copy()
    r = {"first": outcome(lambda: run_kind(comm, kind, src, dst, tag))}
    r["first_dst_unchanged"] = bool(np.array_equal(dst, untouched))
    r["retry"] = outcome(lambda: run_kind(comm, kind, src, dst, tag))  # the same call, the same view
    r["retry_dst_unchanged"] = bool(np.array_equal(dst, untouched))
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while True:
        try:
            comm.update_topology()
            break
        except lockstep.UpdateTopologyFailedError:
            assert time.monotonic() < deadline, "update_topology kept failing"
    rank, world = comm.rank, comm.group_world_size
    src, dst = kill_buffers(kind, rank, world, n)
    run_kind(comm, kind, src, dst, tag)
    r["after"] = (rank, world, dst)
    return r


# ------------------------------------------------------------------------ tests


def by_rank(results: List[tuple], world: int) -> Dict[int, Any]:
    ranks = {r[0]: r[2] for r in results}
    assert sorted(ranks) == list(range(world)) and all(r[1] == world for r in results), results
    return ranks


def test_broadcast_from_every_root(cluster):
    world = cluster.size
    per_rank = by_rank(cluster.run(peer_broadcast, 100), world)
    for root in range(world):
        for case, dt in enumerate(BROADCAST_DTYPES):
            expected = values(dt, root, case)
            got = [per_rank[r][(root, case)] for r in range(world)]
            for r, a in enumerate(got):
                np.testing.assert_array_equal(a, expected, err_msg=f"root {root} {np.dtype(dt).name} rank {r}")
            assert_identical(got, f"root {root} case {case}")
        big = [per_rank[r][(root, "big")] for r in range(world)]
        np.testing.assert_array_equal(big[0], values(np.float64, root, 99, 300_000))
        assert_identical(big, f"root {root} big")


def test_all_gather_with_equal_counts_and_with_counts_per_rank(cluster):
    world = cluster.size
    per_rank = by_rank(cluster.run(peer_all_gather, 200), world)
    counts = gather_counts(world)
    expected = {
        "new": np.stack([values(np.float32, r, 1, 77).reshape(7, 11) for r in range(world)]),
        "given": np.concatenate([values(np.int32, r, 2) for r in range(world)]),
        "in_place": np.concatenate([values(np.float64, r, 3) for r in range(world)]),
        "counts_new": np.concatenate([values(np.uint16, r, 4, counts[r]) for r in range(world)]),
    }
    expected["counts_given"] = expected["counts_new"]
    for key, want in expected.items():
        got = [per_rank[r][key] for r in range(world)]
        for r, a in enumerate(got):
            assert a.shape == want.shape, (key, r)
            np.testing.assert_array_equal(a, want, err_msg=f"{key} rank {r}")
        assert_identical(got, key)


def test_reduce_scatter_sum_avg_max(cluster):
    world = cluster.size
    per_rank = by_rank(cluster.run(peer_reduce_scatter, 300), world)
    for case, (dt, op) in enumerate(REDUCE_SCATTER_CASES):
        full = reduced([values(dt, r, 10 + case, world * COUNT) for r in range(world)], op)
        for r in range(world):
            got, want = per_rank[r][case], full[r * COUNT:(r + 1) * COUNT]
            what = f"{np.dtype(dt).name} {op} rank {r}"
            assert got.dtype == np.dtype(dt), what
            if op == "avg":
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=what)
            else:
                np.testing.assert_array_equal(got, want, err_msg=what)


def test_reduce_scatter_quantized_is_close(cluster):
    world = cluster.size
    per_rank = by_rank(cluster.run(peer_reduce_scatter_quantized, 400), world)
    full = sum(quantized_input(r, world).astype(np.float64) for r in range(world))
    # 8-bit codes per chunk: each of the world - 1 hops of the reduction may be off by
    # half a step of its chunk's range (at most the full range / 255).
    tolerance = world * (full.max() - full.min()) / 255
    for r in range(world):
        want = full[r * QUANTIZED:(r + 1) * QUANTIZED]
        for q, got in per_rank[r].items():
            assert got.shape == (QUANTIZED,) and got.dtype == np.float32
            np.testing.assert_allclose(got, want, atol=tolerance, rtol=0, err_msg=f"{q} rank {r}")
            # Not the exact sum: the data went through the 8-bit encoding.
            assert not np.array_equal(got, want.astype(np.float32)), f"{q} rank {r}"


def test_barrier_waits_for_every_peer(cluster):
    assert cluster.run(peer_barrier, 500) == [None] * cluster.size
    # Every peer but the first enters; the barrier must hold them until the first does.
    late, early = cluster.peers[0], cluster.peers[1:]
    cluster.run(peer_barrier_async_start, 501, peers=early)
    cluster.wait_for_round(501, lambda r: len(r["done"]) == len(early), "the early peers' barrier votes")
    assert cluster.run(peer_barrier_async_done, peers=early) == [False] * len(early)
    late.call(peer_barrier, 501)
    assert cluster.run(peer_barrier_async_wait, peers=early) == [cluster.size] * len(early)


def test_async_forms(cluster):
    world = cluster.size
    per_rank = by_rank(cluster.run(peer_async_forms, 600), world)
    counts = gather_counts(world)
    rs = [values(np.float64, r, 22, world * COUNT) for r in range(world)]
    expected_common = {
        "bcast": values(np.float32, world - 1, 20, 50_000),
        "gather": np.stack([values(np.int64, r, 21) for r in range(world)]),
        "gatherv": np.concatenate([values(np.int8, r, 23, counts[r]) for r in range(world)]),
    }
    for key, want in expected_common.items():
        got = [per_rank[r][key] for r in range(world)]
        for a in got:
            np.testing.assert_array_equal(a, want, err_msg=key)
        assert_identical(got, key)
    for key, op in (("rs_sum", "sum"), ("rs_max", "max")):
        full = reduced(rs, op)
        for r in range(world):
            np.testing.assert_array_equal(per_rank[r][key], full[r * COUNT:(r + 1) * COUNT], err_msg=f"{key} {r}")


def test_cpu_torch_tensors(cluster):
    pytest.importorskip("torch", reason="the Debian package python3-torch is not installed")
    import torch

    world = cluster.size
    per_rank = by_rank(cluster.run(peer_torch, 700), world)
    bcast = torch.from_numpy(values(np.float32, 0, 30)).to(torch.bfloat16).float().numpy()
    gather = np.stack([values(np.int32, r, 31) for r in range(world)])
    rs = [values(np.float64, r, 32, world * COUNT) for r in range(world)]
    for r in range(world):
        np.testing.assert_array_equal(per_rank[r]["bcast"], bcast)
        np.testing.assert_array_equal(per_rank[r]["gather"], gather)
        np.testing.assert_array_equal(per_rank[r]["rs"], reduced(rs, "sum")[r * COUNT:(r + 1) * COUNT])
        np.testing.assert_array_equal(per_rank[r]["rs_async"], reduced(rs, "max")[r * COUNT:(r + 1) * COUNT])


def test_arguments_that_differ_between_peers_fail_on_every_peer(cluster):
    mismatch = ("OperationMismatchError", lockstep.Status.OPERATION_MISMATCH)
    for results in cluster.run(peer_mismatches, 800):
        assert results == {"broadcast roots": mismatch, "gather counts": mismatch, "gather sizes": mismatch,
                           "scatter dtypes": mismatch}, results


def test_unusable_arguments_fail_on_every_peer(cluster):
    invalid = ("InvalidArgumentError", lockstep.Status.INVALID_ARGUMENT)
    for results in cluster.run(peer_unusable_arguments, 900):
        assert results == {"root outside": invalid, "counts length": invalid, "dst too small": invalid}, results


def peer_agree_values(comm: lockstep.Communicator) -> dict:
    out = {"equal": comm.agree_value(b"step=7;lr=0.1")}
    try:
        comm.agree_value(f"rank {comm.rank}".encode())
        out["differing"] = "agreed"
    except lockstep.Error as e:
        out["differing"] = type(e).__name__
    out["first"] = comm.agree_value(f"rank {comm.rank}".encode(), mode="first_accepted")
    try:
        comm.agree_value(b"x", mode="majority")
    except lockstep.InvalidArgumentError:
        out["bad mode"] = "InvalidArgumentError"
    return out


def test_agree_on_a_value(cluster):
    results = cluster.run(peer_agree_values)
    for r in results:
        assert r["equal"] == b"step=7;lr=0.1", r
        assert r["differing"] == "OperationMismatchError", r
        assert r["bad mode"] == "InvalidArgumentError", r
    firsts = {r["first"] for r in results}
    assert len(firsts) == 1 and firsts.pop().startswith(b"rank "), results


def test_a_single_peer_gets_too_few_peers():
    c = ProcessCluster(1)
    try:
        results = c.peers[0].call(peer_alone)
    finally:
        c.close()
    too_few = ("TooFewPeersError", lockstep.Status.TOO_FEW_PEERS)
    assert results == {name: too_few for name in results} and len(results) == 11, results


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
def test_peer_killed_during_a_large_collective(kind):
    n = 1_000_000 if kind == "reduce_scatter" else 400_000  # elements per rank
    tag = 1000
    c = ProcessCluster(3)
    try:
        victim, survivors = c.peers[2], c.peers[:2]
        # The victim starts the collective and is stopped while it waits for the others;
        # once they start it too the master lets all three go, so the stopped peer is part
        # of the ring when it is killed.
        victim.submit(peer_kill_victim, kind, tag, n)
        c.wait_for_round(tag, lambda r: r["phase"] == "voting" and len(r["done"]) == 1, "the victim's vote")
        os.kill(victim.pid, signal.SIGSTOP)
        for p in survivors:
            p.submit(peer_kill_survivor, kind, tag, n)
        c.wait_for_round(tag, lambda r: r["phase"] == "performing", "the master to let the three peers go")
        os.kill(victim.pid, signal.SIGKILL)
        victim.proc.wait(10)
        results = c.results(survivors, timeout=2 * CALL_TIMEOUT_S)
    finally:
        c.close()
    lost = ("PeerConnectionLostError", lockstep.Status.PEER_CONNECTION_LOST)
    view_changed = ("ViewChangedError", lockstep.Status.VIEW_CHANGED)
    for r in results:
        assert r["first"] == lost and r["first_dst_unchanged"], r
        assert r["retry"] == view_changed and r["retry_dst_unchanged"], r
    # After update_topology: the survivors' ranks of a view of two, and the right result.
    after = {rank: dst for rank, world, dst in (r["after"] for r in results) if world == 2}
    assert sorted(after) == [0, 1], [r["after"][:2] for r in results]
    if kind == "reduce_scatter":
        full = reduced([kill_buffers(kind, rank, 2, n)[0] for rank in range(2)], "sum")
        for rank, dst in after.items():
            np.testing.assert_array_equal(dst, full[rank * n:(rank + 1) * n])
    else:
        want = np.concatenate([kill_buffers(kind, rank, 2, n)[0] for rank in range(2)])
        for dst in after.values():
            np.testing.assert_array_equal(dst, want)
