"""Fault-tolerant data parallel training in a process of its own, driven by test_torch.py.

    torch_ddp_worker.py fixed tcp://HOST:PORT RANK WORLD STEPS
    torch_ddp_worker.py elastic lockstep://HOST:PORT - - STEPS

Trains the model below with lockstep.torch.DataParallel until the group's step counter
(part of the training state) reaches STEPS (STEPS 0: one step per "go" line read from
stdin, until another line or the end of it), printing one JSON line per begin_step
({"begin": step, "hash": ...}: the state every peer holds after the membership changes)
and per step ({"step": step after it, "committed": ..., "hash": ...}), then the final
parameters. LOCKSTEP_TEST_RESUME=FILE starts from a checkpoint (TrainingState.state_dict,
torch.save'd); LOCKSTEP_TEST_CHECKPOINT=FILE writes one when the steps are done.
LOCKSTEP_TEST_UNEVEN=1 splits each global batch unevenly (rank r's share in proportion to
world - r) and weights the gradients by batch (weight_by_batch).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import List

import torch
import torch.distributed as dist

import lockstep
import lockstep.torch as lt

GLOBAL_BATCH = 12


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def global_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g)
    y = torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)
    return x, y


def shares(world: int, uneven: bool) -> List[int]:
    """Each rank's part of the global batch."""
    if not uneven:
        return [GLOBAL_BATCH // world] * world
    weights = [world - r for r in range(world)]
    return [GLOBAL_BATCH * w // sum(weights) for w in weights]


def state_hash(state: lt.TrainingState) -> str:
    h = hashlib.sha256()
    for name, t in state._tensors.items():
        h.update(name.encode())
        h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def emit(obj) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    lockstep.set_log_level("error")
    mode, url, steps = sys.argv[1], sys.argv[2], int(sys.argv[5])
    if mode == "fixed":
        dist.init_process_group("lockstep", init_method=url, rank=int(sys.argv[3]), world_size=int(sys.argv[4]))
    else:
        dist.init_process_group("lockstep", init_method=url)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    counter = torch.zeros(1, dtype=torch.int64)
    state = lt.TrainingState(model, optimizer, extra={"step": counter})
    if "LOCKSTEP_TEST_RESUME" in os.environ:
        state.load_state_dict(torch.load(os.environ["LOCKSTEP_TEST_RESUME"]))
    # Elastic peers wait for a second one instead of training alone (the test's schedule
    # needs the group, not a first peer that finished alone).
    uneven = os.environ.get("LOCKSTEP_TEST_UNEVEN") == "1"
    ddp = lt.DataParallel(model, optimizer, state=state, alone="wait" if mode == "elastic" else "train",
                          weight_by_batch=uneven)
    emit({"ready": True})
    while (int(counter) < steps) if steps > 0 else (sys.stdin.readline().strip() == "go"):
        share = shares(dist.get_world_size(), uneven)
        rank = dist.get_rank()
        ddp.begin_step(batch_size=share[rank])
        emit({"begin": int(counter), "hash": state_hash(state), "world": dist.get_world_size(),
              "revision": state.revision})
        x, y = global_batch(int(counter))
        first = sum(share[:rank])
        xs, ys = x[first:first + share[rank]], y[first:first + share[rank]]
        torch.nn.functional.cross_entropy(model(xs), ys).backward()
        committed = ddp.step()
        if committed:
            counter += 1
        emit({"step": int(counter), "committed": committed, "hash": state_hash(state)})
    if "LOCKSTEP_TEST_CHECKPOINT" in os.environ:
        torch.save(state.state_dict(), os.environ["LOCKSTEP_TEST_CHECKPOINT"])
    emit({"done": True, "params": [p.detach().double().flatten().tolist() for p in model.parameters()],
          "committed": ddp.committed, "skipped": ddp.skipped})
    if steps > 0:
        sys.stdin.read()  # stay until told: the others may still need this peer for their last step
    lt.shutdown()


if __name__ == "__main__":
    main()
