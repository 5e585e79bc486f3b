"""Pieces shared by the training examples: the digits data, a small model, flat views of
its parameters, and the membership step of the documented loop.

Every peer loads the same data set (scikit-learn's bundled handwritten digits, no
download) and trains on the shard given by its rank in the membership view.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

import lockstep

torch.set_num_threads(1)  # several peers share the machine's cores


def digits(seed: int = 0):
    """(x_train, y_train, x_test, y_test) as tensors, the same split on every peer."""
    from sklearn.datasets import load_digits  # here: the examples that do not use the digits skip its import

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def flat_parameters(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).contiguous()


def load_flat(net: torch.nn.Module, flat: torch.Tensor) -> None:
    at = 0
    with torch.no_grad():
        for p in net.parameters():
            n = p.numel()
            p.copy_(flat[at:at + n].view_as(p))
            at += n


def flat_gradients(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()]).contiguous()


def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world: int):
    return x[rank::world], y[rank::world]


def batches(x: torch.Tensor, y: torch.Tensor, size: int, seed: int):
    """An endless stream of mini-batches, reshuffled every epoch (deterministic per seed)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(x) - size + 1, size):
            idx = order[i:i + size]
            yield x[idx], y[idx]


def loss_and_accuracy(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        out = net(x)
        loss = torch.nn.functional.cross_entropy(out, y).item()
        accuracy = (out.argmax(dim=1) == y).float().mean().item()
    return loss, accuracy


def ready_to_connect(args) -> None:
    """With --connect-on-stdin, the process is started early (imports take seconds) and
    joins the run when its driver says so."""
    if args.connect_on_stdin:
        sys.stdin.readline()


def update_topology(comm: lockstep.Communicator) -> None:
    """Update topology, retried until it succeeds (its only legal answer to a failure)."""
    while True:
        try:
            comm.update_topology()
            return
        except lockstep.UpdateTopologyFailedError:
            continue


def admit_pending(comm: lockstep.Communicator) -> bool:
    """The membership step of the documented loop: if peers wait to join (or some left),
    update the topology. True if it did."""
    if not comm.are_peers_pending():
        return False
    update_topology(comm)
    return True


def report(name: str, **fields) -> None:
    """One JSON line per event on stdout (the showcase and the tests read them)."""
    print(json.dumps({"peer": name, "t": round(time.time(), 3), **fields}), flush=True)


def membership_step(comm: lockstep.Communicator) -> None:
    """The membership part of a step: admit pending peers (or drop departed ones) with
    at most one update topology, which newcomers follow straight into a sync; alone,
    wait for peers."""
    while True:
        if comm.are_peers_pending():
            update_topology(comm)
            return
        if comm.group_world_size >= 2:
            return
        time.sleep(0.05)


def sync(comm: lockstep.Communicator, state: lockstep.SharedState, strategy: str = "enforce_popular"):
    """One shared-state sync, one revision further (a receive-only newcomer adopts the
    group's revision); if a peer died or a transfer did not verify, every peer of the
    group gets the failure and retries it at the same revision."""
    if strategy != "receive_only":
        state.revision += 1
    while True:
        try:
            return comm.sync_shared_state(state, strategy)
        except (lockstep.PeerConnectionLostError, lockstep.HashMismatchError):
            continue


def wait_for_peers(comm: lockstep.Communicator, minimum: int = 2) -> None:
    """Below `minimum` peers there is nobody to train with: admit newcomers and wait."""
    while comm.group_world_size < minimum:
        if not admit_pending(comm):
            time.sleep(0.05)


def state_hash(state: lockstep.SharedState) -> str:
    return "".join(lockstep.hash(t.data)[:8] for t in state.tensors)


def arguments(argv: list[str] | None = None):
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", default="127.0.0.1:48148")
    parser.add_argument("--name", default="peer")
    parser.add_argument("--steps", type=int, default=40, help="outer steps (DiLoCo) or steps (DDP)")
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-peers", type=int, default=2, help="peers to wait for before the first step")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds of pretend compute per step")
    parser.add_argument("--failover-timeout-ms", type=int, default=30000,
                        help="how long the peer waits for a master to take it back when its master is lost "
                             "(docs/operations.md, \"Failover\"); 0: it ends with MasterConnectionLostError")
    parser.add_argument("--connect-on-stdin", action="store_true",
                        help="load everything, then wait for a line on stdin before connecting")
    parser.add_argument("--quantization", default=None,
                        help="diloco: the pseudo-gradient's all-reduce on the wire (minmax, minmax4, bf16, ...)")
    parser.add_argument("--error-feedback", action="store_true",
                        help="diloco: carry what quantization drops into the next outer step (a residual)")
    parser.add_argument("--distribution", default=None,
                        help="diloco: the quantization's distribution hint (normal: codes fitted to a bell shape)")
    return parser.parse_args(argv if argv is not None else sys.argv[1:])


__all__ = ["digits", "model", "flat_parameters", "load_flat", "flat_gradients", "shard", "batches",
           "loss_and_accuracy", "ready_to_connect", "update_topology", "admit_pending", "membership_step", "sync", "report", "wait_for_peers", "state_hash",
           "arguments", "np"]
