"""The optional finiteness check (check_finite): a peer whose contribution to a float
collective holds NaN or an infinity fails the collective on every peer with
NonFiniteContributionError naming that peer and the element, before any byte moves
(every destination unchanged); the retry with finite data succeeds. Every kind: a large
all-reduce (on the ring), a small one (carried by the votes), reduce-scatter, all-gather
and broadcast (only the root's buffer counts). Without the check the NaN goes through."""

from __future__ import annotations

import numpy as np
import pytest

import lockstep
from conftest import Cluster

LARGE = 100_000  # f32 elements: on the ring, not carried by the votes
SMALL = 16


@pytest.fixture(scope="module")
def checked():
    with Cluster(3, check_finite=True) as c:
        yield c


def outcome(fn):
    try:
        return "ok", fn()
    except lockstep.Error as e:
        return type(e).__name__, str(e)


def poison_at(rank: int, count: int, where: int, value: float, dtype=np.float32):
    """Runs on each peer: rank `rank` puts `value` at element `where`."""
    def make(comm: lockstep.Communicator) -> np.ndarray:
        a = np.full(count, comm.rank + 1, dtype=dtype)
        if comm.rank == rank:
            a[where] = value
        return a
    return make


@pytest.mark.parametrize("count,where,value", [(LARGE, LARGE - 1, np.nan), (LARGE, 0, np.inf), (SMALL, 5, -np.inf)])
def test_all_reduce_fails_for_all_naming_the_peer(checked, count, where, value):
    make = poison_at(1, count, where, value)

    def peer(i, comm):
        src = make(comm)
        dst = np.full(count, -7, dtype=np.float32)
        kind, detail = outcome(lambda: comm.all_reduce(src, dst))
        return kind, detail, bool((dst == -7).all())

    expected = "NaN" if np.isnan(value) else ("+inf" if value > 0 else "-inf")
    for kind, detail, untouched in checked.run(peer):
        assert kind == "NonFiniteContributionError", detail
        assert f"(rank 1): its contribution to tag 0: element {where} is {expected}" in detail, detail
        assert untouched, "a destination changed"
    # The same call with finite data succeeds on every peer.
    def finite(i, comm):
        a = np.full(count, comm.rank + 1, dtype=np.float32)
        comm.all_reduce(a)
        return bool((a == 6).all())
    assert checked.run(finite) == [True, True, True]


def test_every_kind_checks_its_contribution(checked):
    def peer(i, comm):
        out = {}
        world = comm.group_world_size
        # reduce-scatter: rank 2's input, in its last rank's slice
        src = np.ones(world * 64, dtype=np.float64)
        if comm.rank == 2:
            src[-1] = np.nan
        dst = np.zeros(64, dtype=np.float64)
        out["reduce_scatter"] = outcome(lambda: comm.reduce_scatter(src, dst))[0], bool((dst == 0).all())
        # all-gather: rank 0's shard (f16)
        shard = np.ones(32, dtype=np.float16)
        if comm.rank == 0:
            shard[3] = np.inf
        gathered = np.zeros(32 * world, dtype=np.float16)
        out["all_gather"] = outcome(lambda: comm.all_gather(shard, gathered))[0], bool((gathered == 0).all())
        # broadcast: a non-root's NaN does not count, the root's does
        buf = np.full(50, 5.0, dtype=np.float32)
        if comm.rank == 1:
            buf[0] = np.nan
        out["broadcast, NaN off the root"] = outcome(lambda: comm.broadcast(buf, root=0))[0], bool((buf == 5).all())
        buf = np.full(50, 5.0, dtype=np.float32)
        if comm.rank == 0:
            buf[49] = np.nan
        out["broadcast, NaN at the root"] = outcome(lambda: comm.broadcast(buf, root=0))[0], None
        # integers are never checked
        ints = np.full(10, comm.rank, dtype=np.int32)
        out["int32"] = outcome(lambda: comm.all_reduce(ints))[0], int(ints[0])
        return out

    for r in checked.run(peer):
        assert r["reduce_scatter"] == ("NonFiniteContributionError", True), r
        assert r["all_gather"] == ("NonFiniteContributionError", True), r
        assert r["broadcast, NaN off the root"] == ("ok", True), r
        assert r["broadcast, NaN at the root"][0] == "NonFiniteContributionError", r
        assert r["int32"] == ("ok", 0 + 1 + 2), r


def test_without_the_check_a_nan_goes_through():
    with Cluster(2) as c:
        def peer(i, comm):
            a = poison_at(0, LARGE, 7, np.nan)(comm)
            comm.all_reduce(a)
            return bool(np.isnan(a[7])), float(a[8])
        assert c.run(peer) == [(True, 3.0), (True, 3.0)]
