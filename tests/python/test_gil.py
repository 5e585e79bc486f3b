"""Blocking calls release the GIL: while one peer's thread waits inside a call for a
late peer, another Python thread keeps running (and the late peer's own thread, which
needs the GIL to make its call at all, gets there)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import lockstep

DELAY_S = 0.6  # how long the second peer comes late
MARGIN_S = 0.15


class Spinner:
    """A pure-Python busy thread that records a timestamp every few thousand iterations."""

    def __init__(self) -> None:
        self.stamps = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            if n % 2000 == 0:
                self.stamps.append(time.monotonic())

    def __enter__(self) -> "Spinner":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def progress_between(self, t0: float, t1: float) -> int:
        return sum(1 for t in self.stamps if t0 <= t <= t1)


def early_and_late(cluster, early_call, late_call):
    """Peer 0 enters early_call at once; peer 1 makes late_call DELAY_S later. Returns the
    interval peer 0 spent inside its call."""

    def early(comm):
        t0 = time.monotonic()
        early_call(comm)
        return t0, time.monotonic()

    def late(comm):
        time.sleep(DELAY_S)
        late_call(comm)

    f_early = cluster.peers[0].submit(early)
    f_late = cluster.peers[1].submit(late)
    t0, t1 = f_early.result(25)
    f_late.result(25)
    return t0, t1


def agree(comm):
    assert comm.agree(True) is True


def all_reduce(comm):
    a = np.ones(1000, np.float32)
    assert comm.all_reduce(a, tag=11).world_size == 2
    assert np.all(a == 2)


def async_wait(comm):
    h = comm.all_reduce_async(np.ones(10, np.int32), tag=12)
    assert h.wait().world_size == 2


def are_peers_pending(comm):
    assert comm.are_peers_pending() is False


def sync_shared_state(comm):
    comm.sync_shared_state(lockstep.SharedState({"w": np.zeros(10)}, revision=1))


@pytest.mark.parametrize("call", [agree, all_reduce, async_wait, are_peers_pending, sync_shared_state],
                         ids=lambda f: f.__name__)
def test_other_threads_run_while_a_call_blocks(cluster2, call):
    with Spinner() as spinner:
        t0, t1 = early_and_late(cluster2, call, call)
    assert t1 - t0 >= DELAY_S - 0.1, "the early peer did not wait for the late one"
    progress = spinner.progress_between(t0 + MARGIN_S, t1 - MARGIN_S)
    assert progress > 10, f"the spinning thread made no progress while {call.__name__} blocked"


def test_connect_releases_the_gil():
    """A newcomer blocks in connect until the accepted peer votes it in: that peer's
    thread (and any other) must keep running meanwhile."""
    with lockstep.Master("127.0.0.1:0") as master:
        first = lockstep.Communicator(master.address, base_port=0)
        first.connect()
        result = {}

        def newcomer():
            with lockstep.Communicator(master.address, base_port=0) as comm:
                t0 = time.monotonic()
                comm.connect()
                result["wait"] = time.monotonic() - t0
                result["size"] = comm.group_world_size

        t = threading.Thread(target=newcomer)
        with Spinner() as spinner:
            t.start()
            start = time.monotonic()
            time.sleep(DELAY_S)  # the newcomer is inside connect()
            while not first.are_peers_pending():
                time.sleep(0.01)
            first.update_topology()
            t.join(25)
        assert result["size"] == 2 and result["wait"] >= DELAY_S - 0.1
        assert spinner.progress_between(start + MARGIN_S, start + DELAY_S - MARGIN_S) > 10
        first.close()
