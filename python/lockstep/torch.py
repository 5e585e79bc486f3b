"""PyTorch over lockstep: the ``torch.distributed`` backend ``"lockstep"`` (docs/torch.md).

``import lockstep.torch`` registers the backend and the ``lockstep://`` rendezvous. Two
ways in:

* A fixed-size job written for gloo keeps its launch line and changes the backend's name::

      dist.init_process_group("lockstep", init_method="tcp://HOST:PORT", rank=r, world_size=n)

  Rank 0 hosts a lockstep master (its address goes through torch's store); every rank
  connects to it and waits until all ``n`` are in. torch's ranks stay those the launcher
  gave (lockstep orders its ring by itself; results come back in torch's rank order).

* An elastic job names a running ``lockstep-master`` and passes neither rank nor size::

      dist.init_process_group("lockstep", init_method="lockstep://HOST:PORT")

  The process connects, waits to be accepted, and gets its rank and the world size from
  the membership view, and a store shared by the peers of that view.

A process group belongs to one membership view. After :func:`communicator`'s
``update_topology()`` or ``optimize_topology()`` changed the view (peers joined, left, or
were renumbered), every call on the old group raises :class:`lockstep.ViewChangedError`;
:func:`reconfigure` makes the new group (the default group of ``torch.distributed``).
Failures are lockstep's exceptions (``lockstep.PeerConnectionLostError``, ...): retryable
ones leave every tensor as it was before the call.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import time
import urllib.parse
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _torch
from ._communicator import Communicator
from ._errors import (InvalidArgumentError, InvalidUsageError, KeyNotFoundError, LockstepTimeoutError,
                      UpdateTopologyFailedError)
from ._master import Master

__all__ = ["BACKEND", "communicator", "reconfigure", "shutdown", "view_digest"]

#: The backend's name for ``dist.init_process_group``.
BACKEND = "lockstep"

# Communicator options a lockstep:// URL's query may set (docs/torch.md).
_URL_INT_OPTIONS = ("group", "pool_size", "base_port", "connect_timeout_ms", "p2p_stall_timeout_ms", "p2p_streams")
_URL_STR_OPTIONS = ("secret_file", "advertised_host", "bind_host", "tcp_congestion")


class _Run:
    """What this process holds: its communicator, the master it hosts, the current group."""

    def __init__(self) -> None:
        self.comm: Optional[Communicator] = None
        self.master: Optional[Master] = None
        self.pg: Optional[Any] = None
        self.borrowed = False
        # The store of the current view: torch's C++ side holds it too, but a store
        # written in Python must also stay referenced from Python to keep its methods.
        self.store: Optional[_ViewStore] = None


_run = _Run()


def communicator() -> Communicator:
    """The lockstep communicator under the process group, for lockstep's own calls
    (``are_peers_pending``, ``update_topology``, ``sync_shared_state``, ...). Call them
    on the thread that called ``init_process_group``, while no collective is in flight."""
    if _run.comm is None:
        raise InvalidUsageError("no lockstep process group: call dist.init_process_group('lockstep', ...) first")
    return _run.comm


def view_digest(comm: Communicator) -> str:
    """16 hex digits naming the membership view (its member ids in rank order): the same
    on every peer of the view, different for any other view."""
    h = hashlib.blake2b(digest_size=8)
    for m in comm.membership():
        h.update(bytes.fromhex(m.id))
    return h.hexdigest()


class _ViewStore(dist.Store):
    """A torch store over the master's key-value store, its keys prefixed by the view's
    digest, so that the peers of one view share it and another view starts afresh.

    ``add`` is counted per peer: each peer keeps its own running total under its id, and
    the value is the sum over the view's peers. That is what torch's barriers need (each
    adds 1, then waits for the size); it is not a ticket dispenser (two peers adding at
    once may both read the same total)."""

    def __init__(self, comm: Communicator, timeout: datetime.timedelta) -> None:
        super().__init__()
        self._comm = comm
        self._prefix = f"torch/{view_digest(comm)}/"
        self._ids = [m.id for m in comm.membership()]
        self._own: Dict[str, int] = {}
        self._timeout = timeout

    def _ms(self, timeout: Optional[datetime.timedelta] = None) -> int:
        t = self._timeout if timeout is None else timeout
        return max(1, int(t.total_seconds() * 1000))

    def set(self, key: str, value: Any) -> None:
        self._comm.kv_set(self._prefix + key, value if isinstance(value, bytes) else str(value).encode())

    def get(self, key: str) -> bytes:
        return self._comm.kv_wait(self._prefix + key, self._ms())

    def add(self, key: str, amount: int) -> int:
        mine = self._own.get(key, 0) + int(amount)
        self._own[key] = mine
        self._comm.kv_set(f"{self._prefix}{key}/+{self._comm.id}", str(mine).encode())
        total = 0
        for peer in self._ids:
            try:
                total += int(self._comm.kv_get(f"{self._prefix}{key}/+{peer}"))
            except KeyNotFoundError:
                pass
        return total

    def check(self, keys: List[str]) -> bool:
        for key in keys:
            try:
                self._comm.kv_get(self._prefix + key)
            except KeyNotFoundError:
                return False
        return True

    def wait(self, keys: List[str], timeout: Optional[datetime.timedelta] = None) -> None:
        for key in keys:
            self._comm.kv_wait(self._prefix + key, self._ms(timeout))

    def delete_key(self, key: str) -> bool:
        self._comm.kv_delete(self._prefix + key)
        return True


def _underlying_tcp_host(store: Any) -> Optional[str]:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.host if isinstance(store, dist.TCPStore) else None


def _wait_for_world(comm: Communicator, world_size: int, timeout: datetime.timedelta) -> None:
    """Accepted peers admit the others until the group has world_size peers. Every
    accepted peer runs the same votes in the same order (are_peers_pending, then
    update_topology when someone waits), so they end together."""
    deadline = time.monotonic() + timeout.total_seconds()
    while comm.group_world_size < world_size:
        if time.monotonic() > deadline:
            raise LockstepTimeoutError(f"{comm.group_world_size} of {world_size} ranks joined within {timeout}")
        if comm.are_peers_pending():
            try:
                comm.update_topology()
            except UpdateTopologyFailedError:
                continue  # a peer went away during the vote: vote again
        else:
            time.sleep(0.02)
    if comm.group_world_size != world_size:
        raise InvalidUsageError(f"the group has {comm.group_world_size} peers, more than world_size {world_size}: "
                                "is another job using the same master?")


def _fixed_size_start(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Tuple[List[int], List[str]]:
    """init_process_group with a torch store, rank and size (tcp://, env://, file://)."""
    master_address = os.environ.get("LOCKSTEP_MASTER")
    if master_address is None:
        if rank == 0:
            host = os.environ.get("LOCKSTEP_MASTER_HOST") or _underlying_tcp_host(store) or os.environ.get("MASTER_ADDR") \
                or "127.0.0.1"
            loopback = host in ("127.0.0.1", "localhost")
            _run.master = Master(f"{'127.0.0.1' if loopback else '0.0.0.0'}:0")
            _run.master.run()
            store.set("lockstep/master", f"{host}:{_run.master.port}")
        master_address = store.get("lockstep/master").decode()
    comm = Communicator(master_address, base_port=0)
    _run.comm = comm
    comm.connect()
    _wait_for_world(comm, world_size, timeout)
    store.set(f"lockstep/id/{rank}", comm.id)
    ids = [store.get(f"lockstep/id/{r}").decode() for r in range(world_size)]
    view = [m.id for m in comm.membership()]
    if sorted(ids) != sorted(view):
        raise InvalidUsageError("the ranks of this job and the peers of the lockstep group differ: "
                                "is another job using the same master?")
    return [view.index(i) for i in ids], view


def _create(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """torch's creator for the backend (init_process_group, reconfigure)."""
    if _run.pg is not None:
        raise InvalidUsageError("a lockstep process group exists already: lockstep spans the whole group "
                                "(dist.new_group is not supported); use lockstep.torch.reconfigure() after a change")
    if _run.comm is None:
        view_rank, view = _fixed_size_start(store, rank, world_size, timeout)
    else:
        comm = _run.comm
        if world_size != comm.group_world_size or rank != comm.rank:
            raise InvalidArgumentError(f"rank {rank} of {world_size}: the lockstep view says rank {comm.rank} of "
                                       f"{comm.group_world_size} (pass neither with lockstep://)")
        view = [m.id for m in comm.membership()]
        view_rank = list(range(world_size))
    assert _run.comm is not None
    handle = _run.comm._impl._borrow_handle()
    _run.borrowed = True
    _run.pg = _torch.ProcessGroupLockstep(handle, rank, world_size, view_rank, view)
    return _run.pg


def _release_group() -> None:
    if _run.pg is not None:
        _run.pg._shutdown()
        _run.pg = None
    if _run.borrowed and _run.comm is not None:
        _run.comm._impl._return_handle()
        _run.borrowed = False


def _rendezvous(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                **kwargs: Any) -> Iterator[Tuple[Any, int, int]]:
    """The lockstep:// rendezvous: connect to the master, wait to be accepted, and
    yield (store of the view, rank, world size) from the membership view."""
    parsed = urllib.parse.urlparse(url)
    if not parsed.hostname:
        raise InvalidArgumentError(f"{url!r}: expected lockstep://HOST:PORT")
    query = dict(urllib.parse.parse_qsl(parsed.query))
    if query.get("rank", "-1") != "-1" or query.get("world_size", "-1") != "-1":
        raise InvalidArgumentError("lockstep:// takes its rank and world size from the membership view: pass neither")
    options: Dict[str, Any] = {}
    for name in _URL_INT_OPTIONS:
        if name in query:
            try:
                options[name] = int(query[name])
            except ValueError:
                raise InvalidArgumentError(f"{url!r}: {name} must be an integer") from None
    for name in _URL_STR_OPTIONS:
        if name in query:
            options[name] = query[name]
    unknown = set(query) - set(_URL_INT_OPTIONS) - set(_URL_STR_OPTIONS) - {"rank", "world_size"}
    if unknown:
        raise InvalidArgumentError(f"{url!r}: unknown option(s) {', '.join(sorted(unknown))}")
    if _run.comm is not None:
        raise InvalidUsageError("this process is connected already; use lockstep.torch.reconfigure()")
    options.setdefault("base_port", 0)
    comm = Communicator(f"{parsed.hostname}:{parsed.port or 48148}", **options)
    _run.comm = comm
    comm.connect()
    _run.store = _ViewStore(comm, timeout)
    yield _run.store, comm.rank, comm.group_world_size
    raise InvalidUsageError("the lockstep:// rendezvous runs once per process; use lockstep.torch.reconfigure()")


def reconfigure(timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> Any:
    """Makes the process group of the current membership view (after an update or
    optimize topology, on every peer of the view) the default group and returns it.
    Ranks are the view's. The old group is shut down first (its calls fail)."""
    comm = communicator()
    _release_group()
    if dist.is_initialized():
        dist.destroy_process_group()
    _run.store = _ViewStore(comm, timeout)
    # The prefix torch gives a rendezvous' store, so that a newcomer (lockstep://) and the
    # peers reconfiguring for it meet on the same keys.
    dist.init_process_group(BACKEND, store=dist.PrefixStore("default_pg", _run.store), rank=comm.rank, world_size=comm.group_world_size, timeout=timeout)
    return dist.group.WORLD


def shutdown() -> None:
    """Destroys the process group, closes the communicator and stops a master this
    process hosts. Safe to call more than once."""
    _release_group()
    if dist.is_initialized():
        dist.destroy_process_group()
    _run.store = None
    if _run.comm is not None:
        _run.comm.close()
        _run.comm = None
    if _run.master is not None:
        _run.master.close()
        _run.master = None


if BACKEND.upper() not in dist.Backend._plugins:  # type: ignore[attr-defined]
    dist.Backend.register_backend(BACKEND, _create)
    dist.register_rendezvous_handler("lockstep", _rendezvous)
