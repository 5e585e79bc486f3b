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
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _torch
from ._communicator import Communicator, SharedState, SyncInfo, TensorInfo
from ._errors import (Error, HashMismatchError, InvalidArgumentError, InvalidUsageError, KeyNotFoundError,
                      LockstepTimeoutError, OperationMismatchError, PeerConnectionLostError, RetryableError,
                      UpdateTopologyFailedError)
from ._master import Master, _join_address

__all__ = ["BACKEND", "DataParallel", "TrainingState", "communicator", "init_optimizer_state", "reconfigure",
           "shutdown", "view_digest"]

#: The backend's name for ``dist.init_process_group``.
BACKEND = "lockstep"

# Communicator options a lockstep:// URL's query may set (docs/torch.md).
_URL_INT_OPTIONS = ("group", "pool_size", "base_port", "connect_timeout_ms", "p2p_stall_timeout_ms", "p2p_streams")
_URL_STR_OPTIONS = ("secret_file", "advertised_host", "bind_host", "tcp_congestion")
_URL_BOOL_OPTIONS = ("inbound",)
_URL_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


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
            loopback = host in ("127.0.0.1", "localhost", "::1")
            v6 = ":" in host  # an IPv6 literal: the master listens on IPv6 ("[::]": both families)
            listen = ("[::1]:0" if v6 else "127.0.0.1:0") if loopback else ("[::]:0" if v6 else "0.0.0.0:0")
            _run.master = Master(listen)
            _run.master.run()
            store.set("lockstep/master", _join_address(host, _run.master.port))
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
    for name in _URL_BOOL_OPTIONS:
        if name in query:
            if query[name].lower() not in _URL_BOOLS:
                raise InvalidArgumentError(f"{url!r}: {name} must be 1, 0, true or false")
            options[name] = _URL_BOOLS[query[name].lower()]
    unknown = set(query) - set(_URL_INT_OPTIONS) - set(_URL_STR_OPTIONS) - set(_URL_BOOL_OPTIONS) - {"rank", "world_size"}
    if unknown:
        raise InvalidArgumentError(f"{url!r}: unknown option(s) {', '.join(sorted(unknown))}")
    if _run.comm is not None:
        raise InvalidUsageError("this process is connected already; use lockstep.torch.reconfigure()")
    options.setdefault("base_port", 0)
    comm = Communicator(_join_address(parsed.hostname or "", parsed.port or 48148), **options)
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


# ---------------------------------------------------------------- training state


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates the optimizer's per-parameter state (moments, step counters) where it does
    not exist yet, as a fresh optimizer's first step would find it: one step with zero
    gradients and every group's learning rate and weight decay at 0, then the step
    counters set back to 0 and the gradients removed. The parameters do not change. A
    newcomer needs it so that its state dict has the group's keys before its first sync."""
    if all(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]):
        return
    saved = []
    for g in optimizer.param_groups:
        saved.append({k: g[k] for k in ("lr", "weight_decay") if k in g})
        for k in saved[-1]:
            g[k] = 0.0
        for p in g["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    with torch.no_grad():
        optimizer.step()
    for g, values in zip(optimizer.param_groups, saved):
        g.update(values)
        for p in g["params"]:
            p.grad = None
            for key, value in optimizer.state.get(p, {}).items():
                if key == "step":
                    if torch.is_tensor(value):
                        value.zero_()
                    else:
                        optimizer.state[p][key] = 0


class TrainingState:
    """A module's and an optimizer's state dicts as lockstep shared state: parameters,
    buffers, optimizer moments and step counters are synchronized in place (no copies);
    the optimizer's per-group hyperparameters (e.g. a scheduled learning rate) and
    non-tensor state values travel as small tensors and are written back after a sync.
    ``extra`` names more tensors (a data position, an RNG state as a uint8 tensor).

    It keeps the revision rule for you: :meth:`sync` advances the revision by one before
    each sync; after it, every peer holds the group's revision and bit-identical tensors.
    Keys and shapes must be the same on every peer: a difference fails :meth:`sync` on
    every peer with InvalidArgumentError naming the first differing key, before any byte
    moves. :meth:`state_dict` / :meth:`load_state_dict` checkpoint it with its revision,
    so that a peer restarted from a checkpoint presents the right one."""

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 extra: Optional[Dict[str, torch.Tensor]] = None, revision: int = 0) -> None:
        self.model = model
        self.optimizer = optimizer
        self.revision = revision
        self._tensors: Dict[str, torch.Tensor] = {}
        self._scalars: List[Tuple[str, Callable[[], float], Callable[[float], None]]] = []
        for name, t in model.state_dict(keep_vars=True).items():
            self._tensors[f"model/{name}"] = t.detach()
        if optimizer is not None:
            init_optimizer_state(optimizer)
            index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
            for g_i, group in enumerate(optimizer.param_groups):
                for key, value in sorted(group.items()):
                    if key != "params" and isinstance(value, (int, float)) and not isinstance(value, bool):
                        self._add_scalar(f"optimizer/group{g_i}/{key}", group, key)
                for p in group["params"]:
                    for key, value in sorted(optimizer.state.get(p, {}).items()):
                        name = f"optimizer/param{index[id(p)]}/{key}"
                        if torch.is_tensor(value):
                            self._tensors[name] = value.detach()
                        elif isinstance(value, (int, float)) and not isinstance(value, bool):
                            self._add_scalar(name, optimizer.state[p], key)
        for name, t in (extra or {}).items():
            self._tensors[f"extra/{name}"] = t.detach()
        self._scalar_values = torch.zeros(max(1, len(self._scalars)), dtype=torch.float64)
        for name, t in self._tensors.items():
            if not t.is_contiguous() or t.device.type != "cpu":
                raise InvalidArgumentError(f"state tensor {name!r} must be a contiguous CPU tensor")

    def _add_scalar(self, name: str, holder: Dict[Any, Any], key: Any) -> None:
        kind = type(holder[key])
        self._scalars.append((name, lambda: float(holder[key]), lambda v: holder.__setitem__(key, kind(v))))

    def layout(self) -> List[str]:
        """``key:dtype:shape`` of every tensor, in the order they are synchronized."""
        items = [f"{k}:{t.dtype}:{tuple(t.shape)}" for k, t in self._tensors.items()]
        return items + [f"{name}:scalar" for name, _, _ in self._scalars]

    def _check_layout(self, comm: Communicator) -> None:
        layout = self.layout()
        digest = hashlib.blake2b("\n".join(layout).encode(), digest_size=16).digest()
        try:
            comm.agree_value(digest, "all_equal")
            return
        except OperationMismatchError:
            pass
        # Every peer got the mismatch: each shows its layout and names the first difference.
        prefix = f"torch/layout/{view_digest(comm)}/"
        comm.kv_set(prefix + comm.id, "\n".join(layout).encode())
        for m in comm.membership():
            if m.id == comm.id:
                continue
            theirs = comm.kv_wait(prefix + m.id, 30_000).decode().split("\n")
            for i in range(max(len(layout), len(theirs))):
                mine_i = layout[i] if i < len(layout) else "(nothing)"
                theirs_i = theirs[i] if i < len(theirs) else "(nothing)"
                if mine_i != theirs_i:
                    raise InvalidArgumentError(f"the training state differs between peers: here {mine_i!r}, "
                                               f"peer {m.id[:8]} has {theirs_i!r}")
        raise InvalidArgumentError("the training state differs between peers")

    def sync(self, comm: Optional[Communicator] = None, strategy: str = "enforce_popular",
             retries: int = 8) -> SyncInfo:
        """Synchronizes with every peer of the group (all call it): revision + 1, then
        lockstep's sync (retried on a lost peer or a hash mismatch), then the scalars
        written back. Returns the last attempt's bytes."""
        comm = comm or communicator()
        self._check_layout(comm)
        for i, (_, get, _) in enumerate(self._scalars):
            self._scalar_values[i] = get()
        tensors = dict(self._tensors)
        if self._scalars:
            tensors["scalars"] = self._scalar_values
        state = SharedState(tensors, revision=self.revision + 1)
        for attempt in range(retries + 1):
            try:
                info = comm.sync_shared_state(state, strategy)
                break
            except (PeerConnectionLostError, HashMismatchError):
                if attempt == retries:
                    raise
                state.revision = self.revision + 1
        self.revision = state.revision
        for i, (_, _, put) in enumerate(self._scalars):
            put(self._scalar_values[i].item())
        return info

    def state_dict(self) -> Dict[str, Any]:
        """A checkpoint: the model's, the optimizer's, the extra tensors and the revision."""
        out: Dict[str, Any] = {"revision": self.revision, "model": self.model.state_dict()}
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.state_dict()
        extra = {k[len("extra/"):]: t.clone() for k, t in self._tensors.items() if k.startswith("extra/")}
        if extra:
            out["extra"] = extra
        return out

    def load_state_dict(self, checkpoint: Dict[str, Any]) -> None:
        """Restores a checkpoint in place (the tensors this state syncs stay the same)."""
        with torch.no_grad():
            for name, value in checkpoint["model"].items():
                self._tensors[f"model/{name}"].copy_(value)
        if self.optimizer is not None and "optimizer" in checkpoint:
            saved = checkpoint["optimizer"]
            for g, sg in zip(self.optimizer.param_groups, saved["param_groups"]):
                g.update({k: v for k, v in sg.items() if k != "params"})
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            for i, p in enumerate(params):
                for key, value in saved["state"].get(i, {}).items():
                    current = self.optimizer.state[p].get(key)
                    if torch.is_tensor(current):
                        current.copy_(value)
                    else:
                        self.optimizer.state[p][key] = value
        with torch.no_grad():
            for name, value in checkpoint.get("extra", {}).items():
                self._tensors[f"extra/{name}"].copy_(value)
        self.revision = int(checkpoint["revision"])


# ------------------------------------------------------------ fault-tolerant DDP


class DataParallel:
    """Fault-tolerant data parallel training over the lockstep process group.

    ::

        ddp = lockstep.torch.DataParallel(model, optimizer)
        for x, y in batches:
            ddp.begin_step(batch_size=len(x))   # membership changes, newcomers synced
            loss_fn(model(x), y).backward()     # buckets all-reduced during backward
            committed = ddp.step()              # optimizer.step() only if every peer's reductions succeeded

    Gradients are averaged in buckets of about ``bucket_bytes``, each all-reduced as soon
    as its last gradient is ready, overlapping with the rest of the backward pass. With
    ``weight_by_batch`` each peer's gradient counts in proportion to its batch size (a
    constant global batch under churn: the mean over every sample of the step). A step
    commits only if every peer's reductions succeeded (an agree vote): otherwise no peer
    steps, and model and optimizer stay exactly as before. Between steps it admits
    waiting peers, drops lost ones, makes the new process group, and brings every peer's
    :class:`TrainingState` to the group's (newcomers receive it). A peer alone either
    trains on alone (``alone="train"``) or waits in :meth:`begin_step` for a peer
    (``alone="wait"``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, bucket_bytes: int = 25 << 20,
                 weight_by_batch: bool = False, alone: str = "train", state: Optional[TrainingState] = None,
                 wait_poll_s: float = 0.05,
                 reconfigure_timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> None:
        if alone not in ("train", "wait"):
            raise InvalidArgumentError(f"alone must be 'train' or 'wait', not {alone!r}")
        self.model = model
        self.optimizer = optimizer
        self.state = state or TrainingState(model, optimizer)
        self.weight_by_batch = weight_by_batch
        self.alone = alone
        self.wait_poll_s = wait_poll_s
        self.reconfigure_timeout = reconfigure_timeout
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Buckets in reverse order of the parameters (the order backward produces them).
        self.buckets: List[List[torch.nn.Parameter]] = [[]]
        size = 0
        for p in reversed(self.params):
            if size >= bucket_bytes and self.buckets[-1]:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._where: Dict[int, Tuple[int, int]] = {}
        self._flat: List[torch.Tensor] = []
        for b, params in enumerate(self.buckets):
            offset = 0
            for p in params:
                self._where[id(p)] = (b, offset)
                offset += p.numel()
            self._flat.append(torch.zeros(offset, dtype=torch.float32))
        self._missing: List[int] = [0] * len(self.buckets)
        self._works: List[Any] = []
        self._failed: Optional[BaseException] = None
        self._joined = False  # the first begin_step syncs at once (a newcomer's half of the admission)
        self._needs_update = False
        self._weight = 1.0
        self._in_step = False
        for p in self.params:
            if p.dtype != torch.float32:
                raise InvalidArgumentError("DataParallel reduces float32 parameters")
            p.register_hook(self._hook(p))
        #: Steps committed and skipped, and membership changes seen.
        self.committed = 0
        self.skipped = 0
        self.reconfigurations = 0
        #: Seconds the last step() waited for its reductions and the agree vote.
        self.last_wait_s = 0.0

    def _hook(self, p: torch.nn.Parameter) -> Callable[[torch.Tensor], None]:
        def on_grad(grad: torch.Tensor) -> None:
            if not self._in_step:
                return
            b, offset = self._where[id(p)]
            with torch.no_grad():
                self._flat[b][offset:offset + p.numel()].add_(grad.reshape(-1), alpha=self._weight)
            self._missing[b] -= 1
            if self._missing[b] == 0 and dist.get_world_size() > 1:
                try:
                    self._works.append(dist.all_reduce(self._flat[b], async_op=True))
                except Error as e:
                    self._failed = e
        return on_grad

    def _admit_and_sync(self) -> None:
        comm = communicator()
        while True:
            try:
                comm.update_topology()
                break
            except UpdateTopologyFailedError:
                continue
        reconfigure(self.reconfigure_timeout)
        self.reconfigurations += 1
        self.state.sync(comm)

    def begin_step(self, batch_size: int = 1) -> None:
        """Membership between steps, then the step's bookkeeping. Every peer calls it."""
        comm = communicator()
        while True:
            try:
                if not self._joined:
                    self._joined = True
                    self.state.sync(comm)
                elif comm.are_peers_pending() or self._needs_update:
                    self._needs_update = False
                    self._admit_and_sync()
            except (RetryableError, RuntimeError):
                # A peer was lost during the votes, the sync or the new group's barrier:
                # the survivors update again (the failure reached every one of them).
                self._needs_update = True
                continue
            if dist.get_world_size() > 1 or self.alone == "train":
                break
            time.sleep(self.wait_poll_s)
        self._weight = float(batch_size) if self.weight_by_batch else 1.0
        self._batch = float(batch_size)
        self._missing = [len(params) for params in self.buckets]
        for flat in self._flat:
            flat.zero_()
        self._works = []
        self._failed = None
        self._in_step = True
        self.optimizer.zero_grad(set_to_none=False)

    def step(self) -> bool:
        """Waits for the reductions, agrees, and steps the optimizer if every peer's
        reductions succeeded. Returns whether the step was committed."""
        if not self._in_step:
            raise InvalidUsageError("call begin_step() before backward and step()")
        self._in_step = False
        comm = communicator()
        world = dist.get_world_size()
        ok = self._failed is None
        # Buckets with parameters that got no gradient this step (the same on every peer:
        # the same model and graph) are reduced now, their missing part zero.
        for b, missing in enumerate(self._missing):
            if missing > 0 and world > 1 and ok:
                try:
                    self._works.append(dist.all_reduce(self._flat[b], async_op=True))
                except Error:
                    ok = False
        total = torch.tensor([self._batch], dtype=torch.float64)
        waited = time.perf_counter()
        for w in self._works:
            try:
                w.wait()
            except Error:
                ok = False
        if ok and world > 1:
            try:
                if self.weight_by_batch:
                    dist.all_reduce(total)
            except Error:
                ok = False
        if world > 1:
            try:
                ok = comm.agree(ok)
            except RetryableError:
                ok = False
        self.last_wait_s = time.perf_counter() - waited
        if not ok:
            self.skipped += 1
            self._needs_update = True
            self.optimizer.zero_grad(set_to_none=False)
            return False
        divisor = float(total.item()) if self.weight_by_batch else float(world)
        with torch.no_grad():
            for b, params in enumerate(self.buckets):
                for p in params:
                    _, offset = self._where[id(p)]
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.copy_(self._flat[b][offset:offset + p.numel()].view_as(p)).div_(divisor)
        self.optimizer.step()
        self.committed += 1
        return True


if BACKEND.upper() not in dist.Backend._plugins:  # type: ignore[attr-defined]
    dist.Backend.register_backend(BACKEND, _create)
    dist.register_rendezvous_handler("lockstep", _rendezvous)
