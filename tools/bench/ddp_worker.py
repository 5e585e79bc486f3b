# One process of lockstep-bench ddp: the same training step of a character-level
# transformer (the size of examples/python/torch_text.py's long configuration by
# default) three ways in one process, in turns: without communication ("local"),
# under torch's DistributedDataParallel over gloo, and under lockstep.torch.DataParallel
# over the lockstep backend. Each timed step starts after an untimed barrier. Rank 0
# prints one JSON line: the medians over the timed steps of the slowest rank's time
# per step, and lockstep's time waiting for its reductions and the agree.
import argparse
import json
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lockstep.torch


class CharTransformer(torch.nn.Module):
    """examples/python/torch_text.py's model."""

    def __init__(self, vocab, width, layers, heads, seq):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Embedding(seq, width)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), -math.inf), diagonal=1), persistent=False)

    def forward(self, x):
        t = x.shape[1]
        h = self.embed(x) + self.position(torch.arange(t))
        return self.head(self.norm(self.blocks(h, mask=self.mask[:t, :t])))


def main():
    p = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--steps", "--warmup", "--vocab", "--width", "--layers", "--heads", "--seq",
                 "--batch", "--threads"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--store", required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dist.init_process_group("lockstep", init_method="file://" + a.store, rank=a.rank, world_size=a.world)
    gloo = dist.new_group(backend="gloo")

    def make():
        torch.manual_seed(0)
        model = CharTransformer(a.vocab, a.width, a.layers, a.heads, a.seq)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    local, local_opt = make()
    gloo_model, gloo_opt = make()
    ddp = torch.nn.parallel.DistributedDataParallel(gloo_model, process_group=gloo)
    ours, ours_opt = make()
    dp = lockstep.torch.DataParallel(ours, ours_opt)

    def loss(model, x, y):
        return F.cross_entropy(model(x).reshape(-1, a.vocab), y.reshape(-1))

    def step_local(x, y):
        local_opt.zero_grad()
        loss(local, x, y).backward()
        local_opt.step()

    def step_gloo(x, y):
        gloo_opt.zero_grad()
        loss(ddp, x, y).backward()
        gloo_opt.step()

    def step_lockstep(x, y):
        dp.begin_step(batch_size=len(x))
        loss(ours, x, y).backward()
        if not dp.step():
            raise RuntimeError("a lockstep step was not committed")

    kinds = {"local": step_local, "gloo": step_gloo, "lockstep": step_lockstep}
    times = {k: [] for k in kinds}
    waits = []
    for i in range(a.warmup + a.steps):
        g = torch.Generator().manual_seed(a.rank * 1_000_003 + i)
        tokens = torch.randint(a.vocab, (a.batch, a.seq + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        names = list(kinds)
        for k in names[i % 3:] + names[: i % 3]:  # the order turns from step to step
            dist.barrier(group=gloo)
            start = time.perf_counter()
            kinds[k](x, y)
            if i >= a.warmup:
                times[k].append(time.perf_counter() - start)
        if i >= a.warmup:
            waits.append(dp.last_wait_s)
    # The slowest rank's time of each step.
    rows = torch.tensor([times["local"], times["gloo"], times["lockstep"], waits], dtype=torch.float64)
    dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=gloo)
    diff = max((p - q).abs().max().item() for p, q in zip(gloo_model.parameters(), ours.parameters()))
    if a.rank == 0:
        ms = [statistics.median(r) * 1e3 for r in rows.tolist()]
        print(json.dumps({
            "bench": "ddp", "peers": a.world, "steps": a.steps, "warmup": a.warmup,
            "parameters": sum(p.numel() for p in ours.parameters()), "vocab": a.vocab, "width": a.width,
            "layers": a.layers, "heads": a.heads, "seq": a.seq, "batch": a.batch, "threads": a.threads,
            "torch": torch.__version__,
            "local_step_ms": ms[0], "gloo_ddp_step_ms": ms[1], "lockstep_ddp_step_ms": ms[2],
            "ratio": ms[2] / ms[1], "lockstep_wait_ms": ms[3],
            "gloo_comm_ms": ms[1] - ms[0], "lockstep_comm_ms": ms[2] - ms[0],
            "max_parameter_difference": diff}), flush=True)
    dist.barrier(group=gloo)
    dist.destroy_process_group(gloo)
    lockstep.torch.shutdown()


main()
