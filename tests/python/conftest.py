"""Fixtures of the Python tests: an in-process master and peers on threads of their own.

A communicator belongs to the thread that created it, so every :class:`Peer` owns one
worker thread (a one-worker executor) that creates its communicator and runs every call
on it; the test thread hands work over with :meth:`Peer.submit` / :meth:`Cluster.run`.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import time
from typing import Any, Callable, List, Optional

import pytest

import lockstep

# Every wait of the tests is bounded: a hang fails the test instead of the CTest timeout.
CALL_TIMEOUT_S = float(os.environ.get("LOCKSTEP_PY_TEST_TIMEOUT_S", "25"))


def free_port() -> int:
    """A port of loopback that is free now (nothing listens there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Peer:
    """A communicator living on a thread of its own."""

    def __init__(self, address: str, name: str, **kwargs: Any) -> None:
        self.name = name
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        kwargs.setdefault("base_port", 0)  # ephemeral ports: tests may run in parallel
        self.comm: lockstep.Communicator = self._executor.submit(
            lambda: lockstep.Communicator(address, **kwargs)).result(CALL_TIMEOUT_S)

    def submit(self, fn: Callable[[lockstep.Communicator], Any]) -> "concurrent.futures.Future[Any]":
        """Runs fn(comm) on the peer's thread."""
        return self._executor.submit(fn, self.comm)

    def call(self, fn: Callable[[lockstep.Communicator], Any], timeout: float = CALL_TIMEOUT_S) -> Any:
        return self.submit(fn).result(timeout)

    def close(self) -> None:
        if self._executor is None:
            return
        try:
            self._executor.submit(self.comm.close).result(CALL_TIMEOUT_S)
        finally:
            self._executor.shutdown(wait=False)
            self._executor = None


def join_group(comm: lockstep.Communicator, size: int, *, connect: bool = True) -> None:
    """Connects (unless already connected) and takes part in the membership votes until the
    group has `size` peers. Every accepted peer runs the same loop, so every peer votes
    the same number of times (all get the same answers)."""
    if connect:
        comm.connect()
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while comm.group_world_size < size:
        if time.monotonic() > deadline:
            raise AssertionError(f"the group did not reach {size} peers")
        if comm.are_peers_pending():
            while True:
                try:
                    comm.update_topology()
                    break
                except lockstep.UpdateTopologyFailedError:
                    continue
        else:
            time.sleep(0.02)


class Cluster:
    """A master and `size` connected peers of one group."""

    def __init__(self, size: int, master_kwargs: Optional[dict] = None, listen: str = "127.0.0.1:0",
                 master: Optional[lockstep.Master] = None, address: Optional[str] = None,
                 **peer_kwargs: Any) -> None:
        """`master`: a running master to use (closed with the cluster) instead of a new
        one; `address`: where the peers reach the master (default: its address)."""
        if master is None:
            master = lockstep.Master(listen, **(master_kwargs or {}))
            master.run()
        self.master = master
        self._address = address or master.address
        self.peers: List[Peer] = []
        try:
            self.peers = [Peer(self.address, f"peer{i}", **peer_kwargs) for i in range(size)]
            # The first peer is admitted alone; the others register while it votes.
            self.peers[0].call(lambda c: c.connect())
            futures = [p.submit(lambda c: join_group(c, size)) for p in self.peers[1:]]
            futures.append(self.peers[0].submit(lambda c: join_group(c, size, connect=False)))
            for f in futures:
                f.result(CALL_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        return self._address

    def run(self, fn: Callable[[int, lockstep.Communicator], Any], peers: Optional[List[Peer]] = None,
            timeout: float = CALL_TIMEOUT_S) -> List[Any]:
        """Runs fn(index, comm) on every peer at once; returns the results in peer order and
        re-raises the first exception."""
        peers = self.peers if peers is None else peers
        futures = [p.submit(lambda c, i=i: fn(i, c)) for i, p in enumerate(peers)]
        deadline = time.monotonic() + timeout
        return [f.result(max(0.0, deadline - time.monotonic())) for f in futures]

    def add_peer(self, name: str, **peer_kwargs: Any) -> Peer:
        """Admits one more peer: the newcomer connects while the others vote it in."""
        size = len(self.peers) + 1
        peer = Peer(self.address, name, **peer_kwargs)
        newcomer = peer.submit(lambda c: join_group(c, size))
        others = [p.submit(lambda c: join_group(c, size, connect=False)) for p in self.peers]
        for f in [newcomer, *others]:
            f.result(CALL_TIMEOUT_S)
        self.peers.append(peer)
        return peer

    def close(self) -> None:
        for p in self.peers:
            try:
                p.close()
            except Exception:
                pass
        self.master.close()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@pytest.fixture
def cluster2():
    with Cluster(2) as c:
        yield c


@pytest.fixture
def cluster3():
    with Cluster(3) as c:
        yield c


@pytest.fixture(scope="module")
def shared_cluster3():
    """Three peers shared by the tests of one module (for the cheap, independent checks)."""
    with Cluster(3) as c:
        yield c


@pytest.fixture(autouse=True)
def _quiet_logs():
    lockstep.set_log_level(os.environ.get("LOCKSTEP_TEST_LOG_LEVEL", "warn"))
    yield
