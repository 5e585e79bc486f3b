"""Failover from Python (docs/architecture.md, "Failover"): the run outlives its master.
The master (in process here; tests/e2e/failover_e2e_test.cpp SIGKILLs a lockstep-master
process) goes away and a new one on the same address takes the same peers back: their
identities, ranks, shared-state revision and the results of their all-reduces carry on.
The new options are checked like the others."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import lockstep
from conftest import CALL_TIMEOUT_S, Cluster

TIME_SCALE = float(os.environ.get("LOCKSTEP_TEST_TIME_SCALE", "1"))
FAILOVER_MS = int(30_000 * TIME_SCALE)


def reduce_until_done(comm: lockstep.Communicator, value: float, tag: int) -> np.ndarray:
    """The documented loop's retry: a failed all-reduce left the buffer as it was."""
    while True:
        a = np.full(50_000, value)
        try:
            comm.all_reduce(a, tag=tag)
            return a
        except lockstep.PeerConnectionLostError:
            assert np.all(a == value)


def test_a_new_master_on_the_same_address_takes_the_run_back():
    # Failover is on by default (failover_timeout_ms=30000): no option here.
    with Cluster(3) as c:
        ids = c.run(lambda i, comm: (comm.id, comm.rank))
        # A shared-state revision that must survive: every peer syncs revision 1.
        tensors = [np.full(1000, 7.0) for _ in c.peers]

        def sync(i, comm):
            state = lockstep.SharedState({"w": tensors[i]}, revision=1)
            comm.sync_shared_state(state)
            return state.revision

        assert c.run(sync) == [1, 1, 1]
        assert [a[0] for a in c.run(lambda i, comm: reduce_until_done(comm, i + 1, 0))] == [6.0] * 3
        port = c.master.port
        c.master.close()  # says "shutting down": the peers look for a master to take them back
        c.master = lockstep.Master(f"127.0.0.1:{port}")
        c.master.run()
        # The same peers, ranks and world; the next all-reduces have every contribution.
        for step in range(3):
            results = c.run(lambda i, comm: reduce_until_done(comm, i + 1 + 10 * step, step + 1))
            assert [a[0] for a in results] == [6.0 + 30 * step] * 3
        assert c.run(lambda i, comm: (comm.id, comm.rank)) == ids
        assert c.run(lambda i, comm: comm.world_size) == [3, 3, 3]
        # The revision sequence goes on from 1: the next sync is revision 2 everywhere.

        def sync_next(i, comm):
            state = lockstep.SharedState({"w": tensors[i]}, revision=2)
            comm.sync_shared_state(state)
            return state.revision

        assert c.run(sync_next) == [2, 2, 2]


def test_the_new_master_knows_the_revision_the_run_had_reached():
    # Revision 3 reached the run before the failover. A master that did not know it would
    # elect revision 3 again; the new one asks for the next, as the old one would have.
    with Cluster(2, failover_timeout_ms=FAILOVER_MS) as c:
        def sync(revision):
            def run(i, comm):
                while True:  # a sync called while the peers resume fails with the retryable error
                    state = lockstep.SharedState({"w": np.full(100, 1.0)}, revision=revision)
                    try:
                        comm.sync_shared_state(state)
                        return state.revision
                    except lockstep.PeerConnectionLostError:
                        continue
            return run

        assert c.run(sync(3)) == [3, 3]
        port = c.master.port
        c.master.close()
        c.master = lockstep.Master(f"127.0.0.1:{port}")
        c.master.run()
        with pytest.raises(lockstep.NoSharedStateAvailableError, match="revision 4"):
            c.run(sync(3))
        assert c.run(sync(4)) == [4, 4]


def test_failover_options_are_checked():
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Communicator("127.0.0.1:1", failover_timeout_ms=-1)
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Communicator("127.0.0.1:1,127.0.0.1:notaport", base_port=0)
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Master("127.0.0.1:0", recovery_quorum=-1)
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Master("127.0.0.1:0", recovery_window_ms=1 << 40)
    with pytest.raises(lockstep.InvalidArgumentError, match="resume_hold_ms"):
        lockstep.Master("127.0.0.1:0", resume_hold_ms=3_600_001)
    comm = lockstep.Communicator("127.0.0.1:1,[::1]:2,localhost", base_port=0, failover_timeout_ms=5000)
    assert comm.master == "127.0.0.1:1"
    comm.close()


def test_a_replacement_master_holds_a_newcomer_until_the_run_is_back():
    # A newcomer that reaches the new master before the run's peers would found a new run
    # that refuses them (KICKED: it went on without them), and their state would be lost.
    # With resume_hold_ms the new master founds nothing in that time: the peers, which
    # try again at most a second apart, are taken back first and vote the newcomer in.
    with Cluster(2, failover_timeout_ms=FAILOVER_MS) as c:
        def sync(revision, value):
            def run(i, comm):
                while True:
                    w = np.full(100, value(i))
                    state = lockstep.SharedState({"w": w}, revision=revision)
                    try:
                        comm.sync_shared_state(state)
                        return float(w[0]), state.revision
                    except lockstep.PeerConnectionLostError:
                        continue
            return run

        assert c.run(sync(1, lambda i: 7.0)) == [(7.0, 1)] * 2
        port = c.master.port
        c.master.close()
        # The peers try again 0, 0.1, 0.3, 0.7, 1.5, 2.5 s after the loss (the pause doubles
        # up to a second): a newcomer that connects as soon as the new master listens, at
        # 2 s, reaches it before they do.
        time.sleep(2.0)
        c.master = lockstep.Master(f"127.0.0.1:{port}", resume_hold_ms=int(5000 * TIME_SCALE))
        c.master.run()
        late = c.add_peer("late")
        assert c.run(lambda i, comm: comm.world_size) == [3, 3, 3]
        assert late.call(lambda comm: comm.rank) == 2
        # The run's state survived: the newcomer receives it with the next revision.
        assert c.run(sync(2, lambda i: 0.0 if i == 2 else 7.0)) == [(7.0, 2)] * 3
