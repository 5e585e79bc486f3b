#!/usr/bin/python3
"""Data-parallel training (DDP) on the digits, as one peer of a lockstep run.

Every step: admit pending peers, sync the shared state (the model, the optimizer's
momentum and the step counter: identical on every peer), compute the gradient of a
mini-batch of this peer's shard, average the gradients with an all-reduce (retried with
the survivors if a peer dies), and apply SGD with momentum. A newcomer's first sync is
receive-only.

    python3 ddp.py --master 127.0.0.1:48148 --name p0 --steps 150
"""

from __future__ import annotations

import time

import torch

import lockstep
from common import (arguments, ready_to_connect, batches, digits, flat_gradients, flat_parameters, load_flat,
                    loss_and_accuracy, model, report, shard, state_hash, membership_step, sync)

LR = 0.1
MOMENTUM = 0.9


def main() -> None:
    args = arguments()
    x, y, x_test, y_test = digits(args.seed)
    net = model(args.seed)
    params = flat_parameters(net).clone()
    velocity = torch.zeros_like(params)
    step = torch.zeros(1, dtype=torch.int64)
    state = lockstep.SharedState({"params": params, "velocity": velocity, "step": step})
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
            load_flat(net, params)
            rank, world = comm.rank, comm.group_world_size
            xs, ys = shard(x, y, rank, world)
            xb, yb = next(batches(xs, ys, args.batch, seed=args.seed * 1000 + int(step.item()) * 7 + rank))
            net.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            gradient = flat_gradients(net)
            try:
                comm.all_reduce(gradient, op="avg", tag=int(step.item()))
            except lockstep.PeerConnectionLostError:
                continue  # a peer died: this step again, with the survivors
            except lockstep.TooFewPeersError:
                continue  # nobody left to average with: this step again once peers joined
            velocity.mul_(MOMENTUM).add_(gradient)
            params.sub_(LR * velocity)
            step += 1
            time.sleep(args.step_delay)  # stands for a larger model's compute
            load_flat(net, params)
            test_loss, accuracy = loss_and_accuracy(net, x_test, y_test)
            report(args.name, event="step", step=int(step.item()), world=world, rank=rank,
                   loss=round(loss.item(), 4), test_loss=round(test_loss, 4), accuracy=round(accuracy, 4),
                   hash=state_hash(state), received=info.bytes_received)
        load_flat(net, params)
        test_loss, accuracy = loss_and_accuracy(net, x_test, y_test)
        report(args.name, event="done", step=int(step.item()), test_loss=round(test_loss, 4), accuracy=round(accuracy, 4),
               hash=state_hash(state))


if __name__ == "__main__":
    main()
