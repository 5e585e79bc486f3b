# One process of lockstep-bench's --compare torch or torch-lockstep: torch.distributed
# with the gloo backend, or lockstep's (lockstep.torch: rank 0 hosts the master), over a
# file store, timing the collective that lockstep-bench times, with
# buffers of the same shapes (tools/bench/bench_common.cpp, shape_of). lockstep-bench
# runs it as `python3 -c <this file> ARGS`; it prints {"ready": true} once the group is
# formed, then, for each line on stdin, the next size's times as
# {"size": BYTES, "torch_us": [...]} or {"size": BYTES, "error": "..."}.
import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

DTYPES = {"f32": torch.float32, "f64": torch.float64, "i32": torch.int32, "i64": torch.int64}
OPS = {0: dist.ReduceOp.SUM, 2: dist.ReduceOp.PRODUCT, 3: dist.ReduceOp.MAX, 4: dist.ReduceOp.MIN}


def say(obj):
    print(json.dumps(obj), flush=True)


def collective(kind, size, world, dtype, op):
    """The timed call and the buffers it works on, for `size` contributed bytes."""
    count = max(1, size // torch.tensor([], dtype=dtype).element_size())
    if kind == "allreduce":
        buf = torch.ones(count, dtype=dtype)
        return lambda: dist.all_reduce(buf, op=op)
    if kind == "broadcast":
        buf = torch.ones(count, dtype=dtype)
        return lambda: dist.broadcast(buf, src=0)
    if kind == "allgather":
        src = torch.ones(count, dtype=dtype)
        dst = [torch.empty(count, dtype=dtype) for _ in range(world)]
        return lambda: dist.all_gather(dst, src)
    if kind == "reducescatter":
        per_rank = max(1, count // world)
        src = [torch.ones(per_rank, dtype=dtype) for _ in range(world)]
        dst = torch.empty(per_rank, dtype=dtype)
        return lambda: dist.reduce_scatter(dst, src, op=op)
    return dist.barrier


def main():
    p = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--iterations", "--warmup", "--op"):
        p.add_argument(name, type=int, required=True)
    for name in ("--store", "--collective", "--dtype", "--sizes"):
        p.add_argument(name, required=True)
    p.add_argument("--backend", choices=("gloo", "lockstep"), default="gloo")
    a = p.parse_args()
    if a.backend == "lockstep":
        import lockstep.torch  # noqa: F401 (registers the backend)
    dist.init_process_group(a.backend, init_method="file://" + a.store, rank=a.rank, world_size=a.world)
    say({"ready": True, "torch": torch.__version__})
    for size in (int(x) for x in a.sizes.split(",")):
        if not sys.stdin.readline():
            break
        try:
            run = collective(a.collective, size, a.world, DTYPES[a.dtype], OPS[a.op])
            times = []
            for i in range(a.warmup + a.iterations):
                dist.barrier()
                start = time.perf_counter()
                run()
                elapsed = time.perf_counter() - start
                if i >= a.warmup:
                    times.append(elapsed * 1e6)
            run = None
            say({"size": size, "torch_us": times})
        except RuntimeError as e:
            say({"size": size, "error": str(e).splitlines()[0]})
    dist.barrier()  # leave together
    dist.destroy_process_group()


main()
