"""all_reduce over three peers: every op and every dtype of NumPy and PyTorch, in place
and out of place, checked against a reference; async handles (poll, wait, threads);
all_reduce_multiple_with_retry; quantization."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

import lockstep
from conftest import CALL_TIMEOUT_S, Cluster

torch = pytest.importorskip("torch")

N = 3  # peers
COUNT = 1001  # elements: odd, not a multiple of the ring's chunking

NUMPY_DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
                np.float16, np.float32, np.float64]
TORCH_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                torch.float32, torch.float64]
TORCH_DTYPES += [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]
OPS = ["sum", "avg", "prod", "max", "min"]

# torch dtype -> the numpy dtype of the reference (bfloat16: computed in float32, rounded below)
TORCH_TO_NUMPY = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
                  torch.int64: np.int64, torch.float16: np.float16, torch.bfloat16: np.float32,
                  torch.float32: np.float32, torch.float64: np.float64}
for _n in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _n):
        TORCH_TO_NUMPY[getattr(torch, _n)] = getattr(np, _n)


def peer_values(np_dtype, peer: int, case: int) -> np.ndarray:
    """Deterministic input of one peer. Integers span the whole range (sum and prod wrap);
    floats are small multiples of 1/2, so sums and products of three are exact in every
    float type (bfloat16 included) and the order of the ring's additions does not matter."""
    rng = np.random.default_rng(1000 * case + peer)
    dt = np.dtype(np_dtype)
    if dt.kind in "ui":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=COUNT, dtype=dt, endpoint=True)
    return (rng.integers(-4, 5, size=COUNT) / 2).astype(dt)


def reference(inputs, op: str, np_dtype) -> np.ndarray:
    dt = np.dtype(np_dtype)
    with np.errstate(over="ignore"):
        if op == "max":
            return np.maximum.reduce(inputs)
        if op == "min":
            return np.minimum.reduce(inputs)
        if op == "prod":
            out = inputs[0].copy()
            for x in inputs[1:]:
                out = out * x  # wraps for integers
            return out.astype(dt)
        total = inputs[0].copy()
        for x in inputs[1:]:
            total = total + x  # wraps for integers
        if op == "sum":
            return total.astype(dt)
        if dt.kind == "f":
            return (total.astype(np.float64) / len(inputs)).astype(dt)
        # Integer avg: the wrapped sum divided by the world size, truncated toward zero.
        objs = [int(v) for v in total]
        return np.array([(abs(v) // len(inputs)) * (1 if v >= 0 else -1) for v in objs], dtype=dt)


def check(result: np.ndarray, expected: np.ndarray, op: str, what: str) -> None:
    if result.dtype.kind == "f" and op == "avg":
        tol = {2: 1e-2, 4: 1e-6, 8: 1e-12}[result.dtype.itemsize]
        np.testing.assert_allclose(result.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol,
                                   err_msg=what)
    else:
        np.testing.assert_array_equal(result, expected, err_msg=what)


def to_numpy(t) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.numpy()


def round_bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16).float().numpy()


@pytest.fixture(scope="module")
def cluster():
    with Cluster(N) as c:
        yield c


def numpy_cases():
    return [(dt, op, inplace) for dt in NUMPY_DTYPES for op in OPS for inplace in (True, False)]


def torch_cases():
    return [(dt, op, inplace) for dt in TORCH_DTYPES for op in OPS for inplace in (True, False)]


def test_numpy_every_op_and_dtype(cluster):
    cases = numpy_cases()

    def work(i, comm):
        results = []
        for case, (dt, op, inplace) in enumerate(cases):
            src = peer_values(dt, i, case)
            if inplace:
                info = comm.all_reduce(src, op=op, tag=case)
                out = src
            else:
                original = src.copy()
                out = np.full_like(src, 7)
                info = comm.all_reduce(src, out, op=op, tag=case)
                np.testing.assert_array_equal(src, original)  # the source is left alone
            assert info.world_size == N and info.bytes_sent > 0 and info.bytes_received > 0
            results.append(out)
        return results

    per_peer = cluster.run(work)
    for case, (dt, op, inplace) in enumerate(cases):
        expected = reference([peer_values(dt, p, case) for p in range(N)], op, dt)
        for p in range(N):
            got = per_peer[p][case]
            assert got.dtype == np.dtype(dt)
            check(got, expected, op, f"numpy {np.dtype(dt).name} {op} inplace={inplace} peer {p}")
            # Every participant holds bit-identical results.
            assert got.tobytes() == per_peer[0][case].tobytes()


def test_torch_every_op_and_dtype(cluster):
    cases = torch_cases()

    def inputs(dt, peer, case):
        base = peer_values(TORCH_TO_NUMPY[dt], peer, case)
        return torch.from_numpy(base.copy()).to(dt)

    def work(i, comm):
        results = []
        for case, (dt, op, inplace) in enumerate(cases):
            src = inputs(dt, i, case)
            if inplace:
                comm.all_reduce(src, op=lockstep.ReduceOp[op.upper()], tag=case)
                out = src
            else:
                out = torch.zeros_like(src)
                comm.all_reduce(src, out, op=op, tag=case)
            results.append(out)
        return results

    per_peer = cluster.run(work)
    for case, (dt, op, inplace) in enumerate(cases):
        ins = [to_numpy(inputs(dt, p, case)) for p in range(N)]
        expected = reference(ins, op, TORCH_TO_NUMPY[dt])
        if dt == torch.bfloat16:
            expected = round_bf16(expected)
        for p in range(N):
            got = per_peer[p][case]
            assert got.dtype == dt
            check(to_numpy(got), expected, op, f"torch {dt} {op} inplace={inplace} peer {p}")
            assert torch.equal(got, per_peer[0][case])


def test_numpy_and_torch_mixed_and_multidimensional(cluster):
    def work(i, comm):
        src = np.full((4, 5), i + 1, dtype=np.float32)
        dst = torch.zeros(20)  # same dtype and element count, another shape and kind
        comm.all_reduce(src, dst, op="sum", tag=1)
        return dst

    for dst in cluster.run(work):
        assert torch.equal(dst, torch.full((20,), float(sum(range(1, N + 1)))))


def test_quantization_is_close(cluster):
    # Each kind with the error its codes allow here (the sum's range is 2 x 6: half a
    # step is 12/510 for 8-bit codes, 12/30 for 4-bit ones, per encoding; a cast errs by
    # its relative precision); every peer holds the same bits.
    kinds = [("minmax", 0.1), ("zeropoint", 0.1), (lockstep.Quantization.MINMAX, 0.1), ("minmax4", 2.0),
             ("zeropoint4", 2.0), (lockstep.Quantization.MINMAX4, 2.0), ("f16", 0.01), ("bf16", 0.1)]

    def work(i, comm):
        out = {}
        for tag, (q, _) in enumerate(kinds):
            a = np.linspace(-1, 1, 4096, dtype=np.float32) * (i + 1)
            comm.all_reduce(a, op="sum", quantization=q, tag=tag)
            out[tag] = a
        return out

    results = cluster.run(work)
    expected = np.linspace(-1, 1, 4096, dtype=np.float32) * sum(range(1, N + 1))
    for r in results:
        for tag, a in r.items():
            np.testing.assert_allclose(a, expected, atol=kinds[tag][1])
            assert a.tobytes() == results[0][tag].tobytes()


def test_error_feedback_keeps_what_quantization_drops(cluster):
    # Ten rounds of the same 4-bit average with a residual per peer: each round's
    # residuals sum to what its result lacks, so the mean of the results converges to
    # the exact average, which a plain 4-bit all-reduce misses by its fixed error.
    rounds = 10

    def work(i, comm):
        src = np.sin(np.arange(8192, dtype=np.float64) * (i + 1) * 0.01)
        residual = np.zeros_like(src)
        plain, fed = np.zeros_like(src), np.zeros_like(src)
        for r in range(rounds):
            a = src.copy()
            comm.all_reduce(a, op="avg", quantization="minmax4", tag=2 * r)
            plain += a / rounds
            b = src.copy()
            comm.all_reduce(b, op="avg", quantization="minmax4", tag=2 * r + 1, residual=residual)
            fed += b / rounds
        return src, plain, fed

    results = cluster.run(work)
    exact = sum(r[0] for r in results) / N
    plain_error = np.max(np.abs(results[0][1] - exact))
    fed_error = np.max(np.abs(results[0][2] - exact))
    assert all(np.array_equal(r[2], results[0][2]) for r in results)
    assert fed_error < plain_error / 4, (fed_error, plain_error)


def test_normal_hint_lowers_the_error_of_bell_shaped_data(cluster):
    # 4-bit codes of normally distributed values: with the hint each encoding's error is
    # several times smaller (docs/collectives.md: 3.7x), and every peer holds the same bits.
    def work(i, comm):
        src = np.random.default_rng(i).standard_normal(65536).astype(np.float32)
        plain, hinted = src.copy(), src.copy()
        comm.all_reduce(plain, quantization="minmax4", tag=1)
        handle = comm.all_reduce_async(hinted, quantization="minmax4", tag=2, distribution="normal")
        assert handle.tag == 2
        handle.wait()
        return src, plain, hinted

    results = cluster.run(work)
    exact = sum(r[0].astype(np.float64) for r in results)
    assert all(r[1].tobytes() == results[0][1].tobytes() and r[2].tobytes() == results[0][2].tobytes()
               for r in results)
    plain_mse = np.mean((results[0][1] - exact) ** 2)
    hinted_mse = np.mean((results[0][2] - exact) ** 2)
    assert hinted_mse * 2 < plain_mse, (hinted_mse, plain_mse)


def test_async_poll_and_wait(cluster):
    def work(i, comm):
        arrays = [np.full(50_000, i + k, dtype=np.float64) for k in range(4)]
        tensors = [torch.full((1000,), float(i), dtype=torch.float32) for _ in range(2)]
        handles = [comm.all_reduce_async(a, op="sum", tag=100 + k) for k, a in enumerate(arrays)]
        outs = [torch.zeros(1000) for _ in tensors]
        handles += [comm.all_reduce_async(t, o, op="max", tag=200 + k) for k, (t, o) in enumerate(zip(tensors, outs))]
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while not all(h.done() for h in handles):  # poll without blocking
            assert time.monotonic() < deadline
            time.sleep(0.001)
        infos = [h.wait() for h in handles]
        assert infos[0] == handles[0].wait()  # waiting again returns the same result
        assert handles[-1].result is outs[-1]
        return arrays, outs, infos

    for arrays, outs, infos in cluster.run(work):
        for k, a in enumerate(arrays):
            assert np.all(a == sum(i + k for i in range(N)))
        for o in outs:
            assert torch.all(o == N - 1)
        assert all(info.world_size == N for info in infos)


def test_async_handle_must_be_awaited_on_its_thread(cluster):
    handles = cluster.run(lambda i, comm: comm.all_reduce_async(np.ones(10, np.int32), tag=300))
    for h in handles:
        with pytest.raises(lockstep.WrongThreadError):
            h.wait()  # from the test thread
    infos = [p.call(lambda c, h=h: h.wait()) for p, h in zip(cluster.peers, handles)]
    assert all(info.world_size == N for info in infos)


def test_tag_in_flight_cannot_be_started_twice(cluster):
    a = cluster.peers[0].call(lambda c: c.all_reduce_async(np.ones(4, np.int64), tag=400))
    with pytest.raises(lockstep.InvalidUsageError, match="in flight"):
        cluster.peers[0].call(lambda c: c.all_reduce_async(np.ones(4, np.int64), tag=400))
    # The others start the tag; the first operation completes.
    rest = cluster.run(lambda i, comm: comm.all_reduce_async(np.ones(4, np.int64), tag=400),
                       peers=cluster.peers[1:])
    assert cluster.peers[0].call(lambda c: a.wait()).world_size == N
    for p, h in zip(cluster.peers[1:], rest):
        assert p.call(lambda c, h=h: h.wait()).world_size == N


def test_dropping_a_handle_keeps_the_buffers_alive(cluster):
    def work(i, comm):
        comm.all_reduce_async(np.full(100_000, 1.0), tag=500)  # handle and array dropped at once
        import gc
        gc.collect()
        return comm.all_reduce(np.ones(3), tag=501)  # later operations still work

    assert all(info.world_size == N for info in cluster.run(work))


def test_multiple_with_retry(cluster):
    def work(i, comm):
        a = np.full(10_000, i, dtype=np.int32)
        b = torch.full((333,), float(i + 1), dtype=torch.float64)
        b_out = torch.zeros(333, dtype=torch.float64)
        c = np.full(7, i, dtype=np.uint8)
        ops = [
            (a, None, "sum", 0),
            (b, b_out, lockstep.ReduceOp.PROD, 1),
            {"src": c, "op": "max", "tag": 2},
            (np.full(64, i, dtype=np.float32), None, "avg", 3, "minmax"),
        ]
        infos = comm.all_reduce_multiple_with_retry(ops, max_in_flight=2)
        return a, b_out, c, infos

    fact = 1.0
    for k in range(1, N + 1):
        fact *= k
    for a, b_out, c, infos in cluster.run(work):
        assert np.all(a == sum(range(N)))
        assert torch.all(b_out == fact)
        assert np.all(c == N - 1)
        assert len(infos) == 4 and all(isinstance(x, lockstep.ReduceInfo) and x.world_size == N for x in infos)


def test_mismatched_operations_fail_on_every_peer(cluster):
    def work(i, comm):
        try:
            comm.all_reduce(np.ones(8 + i, np.float32), tag=600)  # a different count on each peer
        except lockstep.OperationMismatchError as e:
            assert isinstance(e, lockstep.RetryableError)
            return e.status
        return None

    assert cluster.run(work) == [lockstep.Status.OPERATION_MISMATCH] * N
    # The group is still usable.
    assert all(x.world_size == N for x in cluster.run(lambda i, c: c.all_reduce(np.ones(8, np.float32), tag=601)))


def test_unawaited_handle_ends_interrupted_when_closed():
    with Cluster(2) as c:
        lone = c.peers[0].call(lambda comm: comm.all_reduce_async(np.ones(16), tag=7))  # the other never joins
        assert not lone.done()
        c.peers[0].close()
        assert lone.done()
        with pytest.raises(lockstep.LockstepInterruptedError, match="closed"):
            lone.wait()


def test_pending_async_blocks_shared_state_sync(cluster):
    h = cluster.peers[0].call(lambda c: c.all_reduce_async(np.ones(4), tag=700))
    state = lockstep.SharedState({"w": np.zeros(4)})
    with pytest.raises(lockstep.PendingAsyncOperationsError):
        cluster.peers[0].call(lambda c: c.sync_shared_state(state))
    rest = cluster.run(lambda i, comm: comm.all_reduce(np.ones(4), tag=700), peers=cluster.peers[1:])
    assert cluster.peers[0].call(lambda c: h.wait()).world_size == N
    assert all(r.world_size == N for r in rest)


def test_collectives_from_one_other_thread(cluster):
    """A communicator's collectives may be launched (and awaited) from one other thread."""
    results = {}

    def other_thread(index, comm):
        try:
            a = np.full(5, index, dtype=np.int64)
            results[index] = (comm.all_reduce(a, tag=800), a)
        except BaseException as e:  # pragma: no cover - reported below
            results[index] = e

    threads = []
    for i, p in enumerate(cluster.peers):
        t = threading.Thread(target=other_thread, args=(i, p.comm))
        threads.append(t)
        t.start()
    for t in threads:
        t.join(CALL_TIMEOUT_S)
    for i in range(N):
        info, a = results[i]
        assert info.world_size == N and np.all(a == sum(range(N)))


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_run_over_ipv6():
    with Cluster(2, listen="[::1]:0") as c:
        assert c.master.address == f"[::1]:{c.master.port}"
        assert all(p.comm.master == c.master.address for p in c.peers)

        def work(i, comm):
            buf = np.full(1000, i + 1, dtype=np.float32)
            comm.all_reduce(buf, tag=1)
            return float(buf.min()), float(buf.max())

        assert c.run(work) == [(3.0, 3.0), (3.0, 3.0)]


def test_master_addresses_of_both_families():
    for bad in ("[::1]:notaport", "[::1", "[::1]x", "127.0.0.1:70000"):
        with pytest.raises(lockstep.InvalidArgumentError):
            lockstep.Master(bad)
    # Refused when the master binds (the reason, which names the IPv4 address to give
    # instead, goes to the log: the C API's master has no last-error text).
    for bad in ("[::ffff:127.0.0.1]:0", "localhost:0"):
        with pytest.raises(lockstep.InvalidArgumentError):
            lockstep.Master(bad).run()
