#!/usr/bin/python3
"""Async DiLoCo on the digits, as one peer of a lockstep run.

Each outer step: a few inner AdamW steps from the outer model on this peer's shard;
the pseudo-gradient (outer - inner) goes into an all-reduce in the background while
the next inner steps run; the averaged pseudo-gradient of the previous step is applied
one step late by the outer optimizer (SGD with learning rate 0.5: with the one-step
delay, outer momentum makes the outer model oscillate on this problem; the momentum
buffer stays in the shared state for runs that set OUTER_MOMENTUM). The shared state is what must be
identical everywhere: the outer model, the outer momentum and the outer step counter
(each peer's inner AdamW state is its own).

Churn (technical report 3.3.1): peers that are pending are admitted only with no
all-reduce in flight, so the in-flight one is awaited first; its result was computed
without the newcomers, so the state is synced twice: once before the delayed outer
update (the newcomers get the model the old peers are about to advance) and once after
it (they get the advanced one); newcomers sync receive-only, so that however many join
at once they never outvote the peers that hold the state.

    python3 async_diloco.py --master 127.0.0.1:48148 --name p0 --steps 40
"""

from __future__ import annotations

import time

import torch

import lockstep
from common import (arguments, ready_to_connect, batches, digits, flat_parameters, load_flat, loss_and_accuracy, model, report,
                    shard, state_hash, sync, update_topology)

OUTER_LR = 0.5
OUTER_MOMENTUM = 0.0
INNER_LR = 3e-3


class Peer:
    def __init__(self, args):
        self.args = args
        self.x, self.y, self.x_test, self.y_test = digits(args.seed)
        self.net = model(args.seed)
        self.outer = flat_parameters(self.net).clone()
        self.momentum = torch.zeros_like(self.outer)
        self.step = torch.zeros(1, dtype=torch.int64)
        self.state = lockstep.SharedState({"outer": self.outer, "momentum": self.momentum, "step": self.step})
        self.comm = lockstep.Communicator(master=args.master, failover_timeout_ms=args.failover_timeout_ms)
        self.handle = None
        self.tag = 0
        self.pseudo_gradient = torch.zeros_like(self.outer)

    # -- the shared state
    def sync(self, strategy: str = "enforce_popular") -> lockstep.SyncInfo:
        return sync(self.comm, self.state, strategy)

    def outer_update(self, averaged: torch.Tensor) -> None:
        """The outer step on the averaged pseudo-gradient (identical on every peer)."""
        self.momentum.mul_(OUTER_MOMENTUM).add_(averaged)
        self.outer.sub_(OUTER_LR * (averaged + OUTER_MOMENTUM * self.momentum))
        self.step += 1

    # -- the all-reduce of pseudo-gradients
    def await_previous(self):
        """The averaged pseudo-gradient of the all-reduce in flight (None if there is none);
        if a peer died during it, the same all-reduce again with the survivors (alone: its
        own pseudo-gradient)."""
        if self.handle is None:
            return None
        handle, self.handle = self.handle, None
        try:
            handle.wait()
        except (lockstep.PeerConnectionLostError, lockstep.TooFewPeersError):
            while True:
                try:
                    self.comm.all_reduce(self.pseudo_gradient, op="avg", tag=self.tag)
                    break
                except lockstep.PeerConnectionLostError:
                    continue
                except lockstep.TooFewPeersError:
                    break  # no survivor but this peer: the average over one is its own (left untouched)
        return self.pseudo_gradient

    def admit(self, result) -> None:
        """After an update topology: the double sync around the delayed outer update."""
        self.sync()
        if result is not None:
            self.outer_update(result)
        self.sync()

    def inner_steps(self) -> float:
        load_flat(self.net, self.outer)
        rank, world = self.comm.rank, self.comm.group_world_size
        x, y = shard(self.x, self.y, rank, world)
        optimizer = torch.optim.AdamW(self.net.parameters(), lr=INNER_LR)
        stream = batches(x, y, self.args.batch, seed=self.args.seed * 1000 + int(self.step.item()) * 7 + rank)
        loss = 0.0
        for _ in range(self.args.inner_steps):
            xb, yb = next(stream)
            optimizer.zero_grad()
            out = torch.nn.functional.cross_entropy(self.net(xb), yb)
            out.backward()
            optimizer.step()
            loss = out.item()
        return loss

    def run(self) -> None:
        ready_to_connect(self.args)
        self.comm.connect()
        if self.comm.group_world_size > 1:  # admitted into a running group: the double sync
            self.sync("receive_only")
            self.sync("receive_only")
            report(self.args.name, event="joined", step=int(self.step.item()), world=self.comm.group_world_size)
        while int(self.step.item()) < self.args.steps:
            # Too few peers (at the start: --min-peers): finish the all-reduce in flight,
            # then admit newcomers as they come, every admission with its double sync.
            needed = max(2, self.args.min_peers) if int(self.step.item()) == 0 else 2
            if self.comm.group_world_size < needed:
                result = self.await_previous()
                if result is not None:
                    self.outer_update(result)
                    self.sync()
                if self.comm.are_peers_pending():
                    update_topology(self.comm)
                    self.admit(None)
                else:
                    time.sleep(0.05)
                continue
            # Pending peers may be asked about with the all-reduce in flight; admitting
            # them may not overlap it.
            if self.comm.are_peers_pending():
                result = self.await_previous()
                update_topology(self.comm)
                self.admit(result)
                continue
            start = self.outer.clone()
            loss = self.inner_steps()
            time.sleep(self.args.step_delay)  # stands for a larger model's compute
            current = start - flat_parameters(self.net)
            previous = self.await_previous()
            if previous is not None:
                self.outer_update(previous)
            info = self.sync()
            test_loss, accuracy = loss_and_accuracy(self.eval_net(), self.x_test, self.y_test)
            report(self.args.name, event="step", step=int(self.step.item()), world=self.comm.group_world_size,
                   rank=self.comm.rank, loss=round(loss, 4), test_loss=round(test_loss, 4),
                   accuracy=round(accuracy, 4), hash=state_hash(self.state), revision=self.state.revision,
                   received=info.bytes_received)
            self.pseudo_gradient.copy_(current)
            self.tag = int(self.step.item())
            self.handle = self.comm.all_reduce_async(self.pseudo_gradient, op="avg", tag=self.tag)
        self.await_previous()
        test_loss, accuracy = loss_and_accuracy(self.eval_net(), self.x_test, self.y_test)
        report(self.args.name, event="done", step=int(self.step.item()), test_loss=round(test_loss, 4),
               accuracy=round(accuracy, 4), hash=state_hash(self.state))
        self.comm.close()

    def eval_net(self) -> torch.nn.Module:
        net = model(0)
        load_flat(net, self.outer)
        return net


if __name__ == "__main__":
    Peer(arguments()).run()
