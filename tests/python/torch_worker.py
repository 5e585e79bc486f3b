"""A torch.distributed process on the lockstep backend, driven by test_torch.py.

    torch_worker.py fixed tcp://127.0.0.1:PORT RANK WORLD
    torch_worker.py elastic lockstep://HOST:PORT

It joins with dist.init_process_group("lockstep", ...), prints one JSON line
{"ready": ..., "rank", "world"}, then runs the commands it reads from stdin (one JSON
object per line) and answers each with one JSON line. Inputs are the deterministic
functions below, which the test uses for its references.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import lockstep
import lockstep.torch as lt

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64"]
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
       "product": dist.ReduceOp.PRODUCT}


def contribution(rank: int, n: int, dtype: str, salt: int = 0) -> torch.Tensor:
    """Rank-dependent small integers (exact in every dtype, products included)."""
    values = [((rank + 1) * (i + 3 + salt)) % 5 + 1 for i in range(n)]
    return torch.tensor(values, dtype=getattr(torch, dtype))


def emit(obj: Dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def collectives(rank: int, world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for dtype in DTYPES:
        for op in (["sum", "avg", "max", "min", "product"] if dtype == "float32" else ["sum", "max"]):
            t = contribution(rank, 7, dtype)
            dist.all_reduce(t, op=OPS[op])
            out[f"all_reduce/{dtype}/{op}"] = t.double().tolist()
    for root in range(world):
        t = contribution(rank, 6, "float32", salt=root) if rank == root else torch.zeros(6)
        dist.broadcast(t, src=root)
        out[f"broadcast/{root}"] = t.tolist()
    gathered = [torch.zeros(4, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, contribution(rank, 4, "int64"))
    out["all_gather"] = [g.tolist() for g in gathered]
    flat = torch.zeros(world * 4)
    dist._all_gather_base(flat, contribution(rank, 4, "float32"))
    out["all_gather_base"] = flat.tolist()
    rs = torch.zeros(3)
    dist.reduce_scatter(rs, [contribution(rank, 3, "float32", salt=r) for r in range(world)])
    out["reduce_scatter"] = rs.tolist()
    rs_base = torch.zeros(3, dtype=torch.float64)
    dist._reduce_scatter_base(rs_base, torch.cat([contribution(rank, 3, "float64", salt=r) for r in range(world)]))
    out["reduce_scatter_base"] = rs_base.tolist()
    tensors = [contribution(rank, 5, "float32", salt=k) for k in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for w in reversed(works):
        w.wait()
    out["async"] = [t.tolist() for t in tensors]
    fut = dist.all_reduce(contribution(rank, 2, "float64"), async_op=True).get_future()
    out["future"] = fut.wait()[0].tolist()
    dist.barrier()
    return out


def bad(kind: str) -> Dict[str, Any]:
    """One call with the argument `kind` names (every peer calls at once)."""
    if kind == "good":
        t = torch.ones(8)
    elif kind == "non_contiguous":
        t = torch.ones(8, 2).t()
    elif kind == "requires_grad":
        t = torch.ones(8, requires_grad=True)
    elif kind == "bool":
        t = torch.ones(8, dtype=torch.bool)
    elif kind == "longer":
        t = torch.ones(9)
    else:
        raise ValueError(kind)
    try:
        dist.all_reduce(t)
        return {"ok": True, "value": t.tolist()}
    except lockstep.Error as e:
        return {"ok": False, "error": type(e).__name__, "status": e.status_name, "message": str(e)}


def update(comm: lockstep.Communicator) -> int:
    """Update topology until it succeeds (a vote that lost a peer fails for all: again)."""
    for _ in range(50):
        try:
            comm.update_topology()
            break
        except lockstep.UpdateTopologyFailedError:
            continue
    return comm.group_world_size


def run(cmd: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    what = cmd["cmd"]
    if what == "collectives":
        return {"results": collectives(rank, world)}
    if what == "bad":
        return bad(cmd["kind"])
    if what == "loop":
        # All-reduces of a large tensor until one fails; says "looping" first.
        t = contribution(rank, 1 << 22, "float32")
        before = t.clone()
        emit({"looping": True})
        for i in range(10_000):
            try:
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                before.copy_(t)
            except lockstep.Error as e:
                return {"error": type(e).__name__, "retryable": isinstance(e, lockstep.RetryableError),
                        "unchanged": bool(torch.equal(t, before)), "iterations": i}
        return {"error": None}
    if what == "update":
        # After a peer was lost: the survivors' update removes it from the view.
        return {"world": update(lt.communicator())}
    if what == "stale":
        try:
            dist.all_reduce(torch.ones(3))
            return {"error": None}
        except lockstep.Error as e:
            return {"error": type(e).__name__}
    if what == "admit":
        # The accepted peers admit a newcomer: vote until someone waits, then update.
        comm = lt.communicator()
        deadline = time.monotonic() + 30
        while not comm.are_peers_pending():
            if time.monotonic() > deadline:
                return {"error": "nobody pending"}
            time.sleep(0.02)
        return {"world": update(comm)}
    if what == "reconfigure":
        lt.reconfigure()
        return {"rank": dist.get_rank(), "world": dist.get_world_size()}
    if what == "sum":
        t = torch.full((16,), float(lt.communicator().rank + 1))
        dist.all_reduce(t)
        return {"value": t[0].item(), "rank": dist.get_rank(), "world": dist.get_world_size()}
    raise ValueError(what)


def main() -> None:
    lockstep.set_log_level("error")
    mode, url = sys.argv[1], sys.argv[2]
    if mode == "fixed":
        rank, world = int(sys.argv[3]), int(sys.argv[4])
        dist.init_process_group("lockstep", init_method=url, rank=rank, world_size=world)
    else:
        dist.init_process_group("lockstep", init_method=url)
    emit({"ready": True, "rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
          "view_rank": lt.communicator().rank})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            emit(run(json.loads(line), dist.get_rank(), dist.get_world_size()))
        except Exception as e:  # a bug of the test: say it and go on
            emit({"exception": type(e).__name__, "message": str(e), "trace": traceback.format_exc()})
    lt.shutdown()


if __name__ == "__main__":
    main()
