"""sync_shared_state with NumPy arrays and PyTorch tensors: revisions, a receive-only
newcomer, content inequality, send-only, removal on a mismatch; and lockstep.hash."""

from __future__ import annotations

import numpy as np
import pytest

import lockstep
from conftest import Cluster

torch = pytest.importorskip("torch")


def make_state(seed: int, revision: int = 0) -> lockstep.SharedState:
    rng = np.random.default_rng(seed)
    return lockstep.SharedState({
        "weights": rng.standard_normal((64, 32)).astype(np.float32),
        "bias": torch.from_numpy(rng.standard_normal(32)).to(torch.bfloat16),
        "step": np.array([seed], dtype=np.int64),
        "adam_m": torch.from_numpy(rng.standard_normal(500)).to(torch.float64),
        "ids": np.arange(300, dtype=np.uint16) * seed,
    }, revision=revision)


def content(state: lockstep.SharedState):
    out = {}
    for t in state.tensors:
        d = t.data
        out[t.key] = lockstep.hash(d)
    return out


def nbytes(state: lockstep.SharedState) -> int:
    total = 0
    for t in state.tensors:
        d = t.data
        total += d.nbytes if isinstance(d, np.ndarray) else d.numel() * d.element_size()
    return total


def test_identical_peers_move_nothing(cluster2):
    states = [make_state(seed=1), make_state(seed=1)]  # identical content

    def sync(i, comm):
        states[i].revision += 1
        return comm.sync_shared_state(states[i], "enforce_popular")

    infos = cluster2.run(sync)
    assert all(isinstance(x, lockstep.SyncInfo) for x in infos)
    assert [(x.bytes_sent, x.bytes_received) for x in infos] == [(0, 0), (0, 0)]
    assert [s.revision for s in states] == [1, 1]


def test_receive_only_newcomer_gets_numpy_and_torch_tensors():
    with Cluster(2) as c:
        states = [make_state(seed=3, revision=4), make_state(seed=3, revision=4)]
        newcomer = c.add_peer("newcomer")
        fresh = make_state(seed=9)
        keep = {t.key: t.data for t in fresh.tensors}
        futures = []
        for p, st in zip(c.peers[:2], states):
            st.revision += 1  # exactly one per sync
            futures.append(p.submit(lambda comm, st=st: comm.sync_shared_state(st, "enforce_popular")))
        futures.append(newcomer.submit(lambda comm: comm.sync_shared_state(fresh, lockstep.SyncStrategy.RECEIVE_ONLY)))
        infos = [f.result(25) for f in futures]
        assert fresh.revision == 5  # the group's revision written into the state
        assert content(fresh) == content(states[0]) == content(states[1])
        assert infos[2].bytes_received == nbytes(fresh)
        assert infos[0].bytes_sent + infos[1].bytes_sent == nbytes(fresh)
        # One connection per source at this size (a stripe carries at least 16 MiB).
        assert infos[2].streams in (1, 2) and infos[0].streams == infos[1].streams == 0
        # Received in place: the same objects, now holding the group's bytes.
        for t in fresh.tensors:
            assert t.data is keep[t.key]
        np.testing.assert_array_equal(fresh["weights"], states[0]["weights"])
        assert torch.equal(fresh["bias"], states[0]["bias"]) and fresh["bias"].dtype == torch.bfloat16
        assert torch.equal(fresh["adam_m"], states[1]["adam_m"])

        # The next sync of all three moves nothing.
        for st in (*states, fresh):
            st.revision += 1
        infos = c.run(lambda i, comm: comm.sync_shared_state((*states, fresh)[i]))
        assert [x.bytes_received for x in infos] == [0, 0, 0]
        assert {s.revision for s in (*states, fresh)} == {6}


def test_popular_content_wins_and_content_inequality_is_allowed(cluster3):
    def run(i, comm):
        st = lockstep.SharedState([
            lockstep.TensorInfo("w", np.full(1000, 1.0 if i < 2 else 2.0, dtype=np.float32)),
            lockstep.TensorInfo("stats", np.full(10, i, dtype=np.int32), allow_content_inequality=True),
        ], revision=0)
        st.revision += 1
        info = comm.sync_shared_state(st)
        return st, info

    results = cluster3.run(run)
    for i, (st, info) in enumerate(results):
        assert np.all(st["w"] == 1.0)  # two of three held 1.0
        assert np.all(st["stats"] == i)  # per-peer content kept
        assert st.revision == 1
    assert results[2][1].bytes_received == 4000


def test_send_only_peer_with_other_content_is_removed():
    with Cluster(3) as c:
        def run(i, comm):
            st = lockstep.SharedState({"w": np.full(100, 7 if i < 2 else 8, dtype=np.int64)}, revision=1)
            try:
                comm.sync_shared_state(st, "send_only" if i == 2 else "enforce_popular")
            except lockstep.SharedStateMismatchError as e:
                assert isinstance(e, lockstep.FatalError)
                return "removed"
            return st.revision

        assert c.run(run) == [1, 1, "removed"]


def test_revision_violation_removes_the_peer():
    with Cluster(2) as c:
        states = [lockstep.SharedState({"w": np.zeros(10)}, revision=1) for _ in range(2)]
        assert [x.bytes_received for x in c.run(lambda i, comm: comm.sync_shared_state(states[i]))] == [0, 0]

        def run(i, comm):
            # The group's revision R is 1: peer 0 presents R+1, peer 1 skips one (R+2).
            states[i].revision += 1 if i == 0 else 2
            try:
                comm.sync_shared_state(states[i])
            except lockstep.RevisionViolationError as e:
                assert e.status == 21 and isinstance(e, lockstep.FatalError)
                return "removed"
            return states[i].revision

        assert c.run(run) == [2, "removed"]
        # The error sticks: every later call of the removed peer fails the same way.
        with pytest.raises(lockstep.RevisionViolationError):
            c.peers[1].call(lambda comm: comm.agree(True))


def test_every_receive_only_gives_no_shared_state_available(cluster3):
    def run(i, comm):
        try:
            comm.sync_shared_state(lockstep.SharedState({"w": np.zeros(3)}, revision=1), "receive_only")
        except lockstep.NoSharedStateAvailableError as e:
            assert isinstance(e, lockstep.RetryableError)
            return e.status
        return None

    assert cluster3.run(run) == [lockstep.Status.NO_SHARED_STATE_AVAILABLE] * 3


# ---------------------------------------------------------------------- hash


def test_hash_of_numpy_equals_hash_of_torch_with_the_same_bytes():
    a = np.arange(1000, dtype=np.float32)
    t = torch.arange(1000, dtype=torch.float32)
    h = lockstep.hash(a)
    assert len(h) == 32 and all(ch in "0123456789abcdef" for ch in h)
    assert h == lockstep.hash(t) == lockstep.hash(a.tobytes()) == lockstep.hash(memoryview(a))
    assert lockstep.hash(np.arange(10, dtype=np.int64).reshape(2, 5)) == lockstep.hash(torch.arange(10))
    bf = torch.randn(77).to(torch.bfloat16)
    assert lockstep.hash(bf) == lockstep.hash(bf.view(torch.int16).numpy())
    assert lockstep.hash(torch.zeros(3, requires_grad=True)) == lockstep.hash(np.zeros(3, np.float32))
    a2 = a.copy()
    a2[500] += 1
    assert lockstep.hash(a2) != h
    assert lockstep.hash(b"") == lockstep.hash(np.zeros(0, np.uint8))


def test_hash_rejects_what_it_cannot_read():
    with pytest.raises(lockstep.InvalidArgumentError, match="contiguous"):
        lockstep.hash(np.arange(10)[::2])
    with pytest.raises(lockstep.InvalidArgumentError, match="contiguous"):
        lockstep.hash(torch.zeros(4, 4).t())
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.hash("text")
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.hash(np.zeros(3, dtype=np.complex64))
