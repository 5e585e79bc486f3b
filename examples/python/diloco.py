#!/usr/bin/python3
"""DiLoCo on the digits, as one peer of a lockstep run.

Each outer step: a few inner AdamW steps from the outer model on this peer's shard,
then the pseudo-gradient (outer - inner) is averaged over the group with an all-reduce
(retried with the survivors if a peer dies) and applied with outer Nesterov momentum.
``--quantization minmax4 --error-feedback`` sends it as 4-bit codes and carries what
they drop into the next outer step (each peer's residual is its own; a newcomer's
starts at zero); ``--distribution normal`` fits the codes to a bell shape.
The shared state is the outer model, the outer momentum and the outer step counter;
each peer's inner AdamW state is its own. A newcomer's first sync is receive-only.

    python3 diloco.py --master 127.0.0.1:48148 --name p0 --steps 30
"""

from __future__ import annotations

import time

import torch

import lockstep
from common import (arguments, ready_to_connect, batches, digits, flat_parameters, load_flat, loss_and_accuracy, model, report,
                    shard, state_hash, membership_step, sync)

OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
INNER_LR = 3e-3


def main() -> None:
    args = arguments()
    x, y, x_test, y_test = digits(args.seed)
    net = model(args.seed)
    outer = flat_parameters(net).clone()
    momentum = torch.zeros_like(outer)
    step = torch.zeros(1, dtype=torch.int64)
    state = lockstep.SharedState({"outer": outer, "momentum": momentum, "step": step})
    residual = torch.zeros_like(outer) if args.error_feedback else None
    with lockstep.Communicator(master=args.master, failover_timeout_ms=args.failover_timeout_ms) as comm:
        ready_to_connect(args)
        comm.connect()
        # A newcomer goes straight to its first sync, as the peers that admitted it do.
        strategy = "receive_only" if comm.group_world_size > 1 else "enforce_popular"
        while int(step.item()) < args.steps:
            if strategy != "receive_only":
                membership_step(comm)
            info = sync(comm, state, strategy)
            strategy = "enforce_popular"
            load_flat(net, outer)
            rank, world = comm.rank, comm.group_world_size
            xs, ys = shard(x, y, rank, world)
            optimizer = torch.optim.AdamW(net.parameters(), lr=INNER_LR)
            stream = batches(xs, ys, args.batch, seed=args.seed * 1000 + int(step.item()) * 7 + rank)
            for _ in range(args.inner_steps):
                xb, yb = next(stream)
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(net(xb), yb)
                loss.backward()
                optimizer.step()
            pseudo_gradient = (outer - flat_parameters(net)).contiguous()
            try:
                comm.all_reduce(pseudo_gradient, op="avg", quantization=args.quantization, residual=residual,
                                distribution=args.distribution, tag=int(step.item()))
            except lockstep.PeerConnectionLostError:
                continue  # a peer died: this outer step again, with the survivors
            except lockstep.TooFewPeersError:
                continue  # nobody left to average with: this step again once peers joined
            momentum.mul_(OUTER_MOMENTUM).add_(pseudo_gradient)
            outer.sub_(OUTER_LR * (pseudo_gradient + OUTER_MOMENTUM * momentum))
            step += 1
            time.sleep(args.step_delay)  # stands for a larger model's compute
            load_flat(net, outer)
            test_loss, accuracy = loss_and_accuracy(net, x_test, y_test)
            report(args.name, event="step", step=int(step.item()), world=world, rank=rank, loss=round(loss.item(), 4),
                   test_loss=round(test_loss, 4), accuracy=round(accuracy, 4), hash=state_hash(state),
                   received=info.bytes_received)
        load_flat(net, outer)
        test_loss, accuracy = loss_and_accuracy(net, x_test, y_test)
        report(args.name, event="done", step=int(step.item()), test_loss=round(test_loss, 4), accuracy=round(accuracy, 4),
               hash=state_hash(state))


if __name__ == "__main__":
    main()
