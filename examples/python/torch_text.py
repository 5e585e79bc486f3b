#!/usr/bin/python3
"""A character-level transformer trained on real text by lockstep peers that come and go.

The corpus is the fortune cookie databases of Debian's ``fortunes`` package (the files
of /usr/share/games/fortunes without a ``.dat`` extension, ``.u8`` links skipped, in
name order; fortunes are separated by lines holding only ``%``). A fortune is a
non-blank piece between those lines, ending in a newline and followed by a ``%`` line
as in the files; every 20th fortune (index 0, 20, 40, ... over all files) is held out
and never trained on. The vocabulary is every character
that occurs at least 20 times in the training text; every other character is one
"unknown" symbol. The model: character and position embeddings, a few pre-norm
``torch.nn.TransformerEncoderLayer`` (causal mask, batch_first), a linear head.

Without ``--master`` this is the driver: it starts a lockstep master and N peer processes
(this file again) on loopback, SIGKILLs one peer mid-run, starts a new one that joins
and is brought up to date, merges the JSON lines each peer writes about its steps and
membership changes, plots the training and held-out losses against the step with the
membership changes marked (PNG), and prints the final model's held-out loss against the
character-unigram cross-entropy of the held-out text (both in nats per character), and
samples of generated text.

Modes:

* ``--mode ddp``: fault-tolerant data parallel with ``lockstep.torch.DataParallel``
  (AdamW; the global batch split over the peers; membership changes between steps).
* ``--mode diloco``: DiLoCo over lockstep's own API: each peer runs H inner AdamW steps
  from the outer model on its own batches (its inner optimizer state is its own), then
  the pseudo-gradients (outer - inner) are averaged by an all-reduce (8-bit on the wire
  with ``--quantize``) and applied by the outer optimizer, SGD with Nesterov momentum
  (learning rate 0.7, momentum 0.9). The shared state is the outer model, the outer
  momentum and the outer step counter; a newcomer's first sync is receive-only.

Both modes train on alone when a kill leaves one peer. The default (long) configuration
makes the README's figure: 3 peers, 2 layers of width 64, context 48, 1600 steps, 4.4
minutes on 2 cores (2.5 with ``--mode ddp``); ``--short`` is the test's (2 peers, 120
steps, under 30 s).

Usage::

    PYTHONPATH=build/python /usr/bin/python3 examples/python/torch_text.py --mode diloco
    PYTHONPATH=build/python /usr/bin/python3 examples/python/torch_text.py --mode ddp --short --out /tmp/run

The driver writes into ``--out`` (default: a new temporary directory): each peer's
JSON lines (``pN.jsonl``) and log (``pN.log``), the merged ``records.jsonl``, the final
model of each peer that finished (``final-pN.pt``), and the plot (``--plot``, default
``torch_text.png`` there). Its last line is a JSON summary. Exit status 0 if the run
finished, every finishing peer holds the same final model, a peer was killed and one
joined, and the held-out loss is below the unigram cross-entropy.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

import lockstep
# common also sets torch to one thread per process: the peers share the machine's cores.
from common import admit_pending, flat_parameters, load_flat, ready_to_connect, report, sync, wait_for_peers

CORPUS = "/usr/share/games/fortunes"
HELD_OUT_EVERY = 20  # fortune i is held out when i % 20 == 0
MIN_COUNT = 20  # rarer characters are the unknown symbol
UNKNOWN = "\ufffd"

# The long configuration makes the README's figure; --short is the test's.
CONFIGS = {
    "long": dict(d_model=64, layers=2, heads=4, context=48, batch=16, steps=1600, lr=5e-3, inner_steps=20,
                 peers=3, eval_every=80, eval_windows=64, deadline_s=3600),
    "short": dict(d_model=48, layers=2, heads=4, context=32, batch=16, steps=120, lr=4e-3, inner_steps=5,
                  peers=2, eval_every=10, eval_windows=32, deadline_s=240),
}
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
WEIGHT_DECAY = 0.01
KILL_AT = 0.35  # fractions of the run's steps
JOIN_AT = 0.55
PROMPTS = ["The ", "Q:\tWhat ", "A computer ", "Love "]


# ---------------------------------------------------------------- the corpus


def fortunes(directory: str = CORPUS) -> List[str]:
    """Every fortune of the databases in `directory`, in file-name order: each piece of a
    file between lines holding only "%" that is not blank, ending in a newline, followed
    by a "%" line."""
    names = sorted(n for n in os.listdir(directory) if not n.endswith(".dat")
                   and not os.path.islink(os.path.join(directory, n)) and os.path.isfile(os.path.join(directory, n)))
    entries: List[str] = []
    for name in names:
        with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
            for piece in re.split(r"^%\n", f.read(), flags=re.M):
                if piece.strip():
                    entries.append(piece + ("" if piece.endswith("\n") else "\n") + "%\n")
    return entries


def split(entries: List[str]) -> Tuple[str, str]:
    """(training text, held-out text): every HELD_OUT_EVERY-th fortune is held out."""
    train = "".join(e for i, e in enumerate(entries) if i % HELD_OUT_EVERY != 0)
    held_out = "".join(e for i, e in enumerate(entries) if i % HELD_OUT_EVERY == 0)
    return train, held_out


class Vocabulary:
    """Symbol 0 is the unknown character; then the training text's characters that occur
    at least MIN_COUNT times, in code point order."""

    def __init__(self, text: str) -> None:
        counts = collections.Counter(text)
        self.chars = [UNKNOWN] + sorted(c for c, n in counts.items() if n >= MIN_COUNT and c != UNKNOWN)
        self._table = np.zeros(max(ord(c) for c in text) + 1 if text else 1, dtype=np.int64)
        for i, c in enumerate(self.chars[1:], 1):
            self._table[ord(c)] = i

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        inside = codes < len(self._table)
        ids = np.zeros(len(codes), dtype=np.int64)
        ids[inside] = self._table[codes[inside]]
        return torch.from_numpy(ids)

    def decode(self, ids: List[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class Corpus:
    def __init__(self, directory: str = CORPUS) -> None:
        train, held_out = split(fortunes(directory))
        self.vocab = Vocabulary(train)
        self.train = self.vocab.encode(train)
        self.held_out = self.vocab.encode(held_out)

    def unigram_cross_entropy(self) -> float:
        """Cross-entropy (nats per character) of the held-out text under the training
        text's character frequencies (add-one smoothed)."""
        counts = torch.bincount(self.train, minlength=len(self.vocab)).double() + 1
        log_p = (counts / counts.sum()).log()
        return float(-log_p[self.held_out].mean())


def batch(ids: torch.Tensor, size: int, context: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """`size` random windows of `context` characters and their next characters."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - context - 1, (size,), generator=g)
    chunk = ids[starts[:, None] + torch.arange(context + 1)]
    return chunk[:, :-1], chunk[:, 1:]


# ---------------------------------------------------------------- the model


class CharTransformer(torch.nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.context = context
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.position = torch.nn.Embedding(context, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)
        # Not part of the state dict: nothing to synchronize.
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), diagonal=1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.position(torch.arange(t))
        return self.head(self.norm(self.encoder(h, mask=self.mask[:t, :t])))


def build_model(vocab: int, cfg: dict, seed: int) -> CharTransformer:
    torch.manual_seed(seed)
    return CharTransformer(vocab, cfg["d_model"], cfg["layers"], cfg["heads"], cfg["context"])


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def held_out_loss(model: CharTransformer, ids: torch.Tensor, windows: Optional[int] = None) -> float:
    """Mean cross-entropy (nats per character) over non-overlapping windows of the
    held-out text: all of them, or `windows` of them spread evenly over it."""
    c = model.context
    n = (len(ids) - 1) // c
    x = ids[:n * c].view(n, c)
    y = ids[1:n * c + 1].view(n, c)
    if windows is not None and windows < n:
        pick = torch.linspace(0, n - 1, windows).long()
        x, y = x[pick], y[pick]
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(x), 64):
            total += float(loss_of(model, x[i:i + 64], y[i:i + 64])) * len(x[i:i + 64])
    model.train(was_training)
    return total / len(x)


def generate(model: CharTransformer, vocab: Vocabulary, prompt: str, length: int = 240, temperature: float = 0.8,
             seed: int = 0) -> str:
    """Samples characters after `prompt` until the end of a fortune (its "%" line) or `length`."""
    g = torch.Generator().manual_seed(seed)
    ids = vocab.encode(prompt).tolist()
    model.eval()
    with torch.no_grad():
        for _ in range(length):
            logits = model(torch.tensor([ids[-model.context:]]))[0, -1]
            ids.append(int(torch.multinomial(torch.softmax(logits / temperature, dim=0), 1, generator=g)))
            if vocab.decode(ids[-3:]) == "\n%\n":
                ids = ids[:-2]
                break
    return vocab.decode(ids)


def learning_rate(cfg: dict, step: int) -> float:
    """Linear warm-up over the first 5% of the steps, then cosine decay to a tenth."""
    warmup = max(1, cfg["steps"] // 20)
    if step < warmup:
        return cfg["lr"] * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg["steps"] - warmup)
    return cfg["lr"] * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def seed_of(*parts: int) -> int:
    s = 0
    for p in parts:
        s = (s * 1_000_003 + p) % (1 << 62)
    return s


# ---------------------------------------------------------------- the peers


def ddp_peer(args: argparse.Namespace, cfg: dict, corpus: Corpus) -> CharTransformer:
    import torch.distributed as dist

    import lockstep.torch as lt

    model = build_model(len(corpus.vocab), cfg, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=WEIGHT_DECAY)
    counter = torch.zeros(1, dtype=torch.int64)  # committed steps: the group's, in the training state
    state = lt.TrainingState(model, optimizer, extra={"step": counter})
    ready_to_connect(args)
    dist.init_process_group("lockstep", init_method=f"lockstep://{args.master}")
    comm = lt.communicator()
    # The first peers wait for each other (every admitted one takes part in the votes).
    while comm.group_world_size < args.min_peers:
        if admit_pending(comm):
            lt.reconfigure()
        else:
            time.sleep(0.05)
    ddp = lt.DataParallel(model, optimizer, state=state)
    world_seen = 0
    while int(counter) < cfg["steps"]:
        ddp.begin_step()  # admits newcomers, drops lost peers, syncs the training state
        step, world, rank = int(counter), dist.get_world_size(), dist.get_rank()
        if world != world_seen:
            report(args.name, event="membership" if world_seen else "joined", step=step, world=world, rank=rank)
            world_seen = world
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        x, y = batch(corpus.train, max(1, cfg["batch"] // world), cfg["context"], seed_of(args.seed, step, rank))
        loss = loss_of(model, x, y)
        loss.backward()
        if not ddp.step():
            report(args.name, event="skipped", step=step, world=world)
            continue
        counter += 1
        fields = {}
        if rank == 0 and (int(counter) % cfg["eval_every"] == 0 or int(counter) == cfg["steps"]):
            fields["held_out"] = round(held_out_loss(model, corpus.held_out, cfg["eval_windows"]), 4)
        report(args.name, event="step", step=int(counter), world=world, rank=rank, loss=round(float(loss), 4), **fields)
    torch.save(model.state_dict(), os.path.join(args.out, f"final-{args.name}.pt"))
    lt.shutdown()
    return model


def diloco_peer(args: argparse.Namespace, cfg: dict, corpus: Corpus) -> CharTransformer:
    model = build_model(len(corpus.vocab), cfg, args.seed)
    h = cfg["inner_steps"]
    outer_steps = cfg["steps"] // h
    outer = flat_parameters(model).clone()
    momentum = torch.zeros_like(outer)
    step = torch.zeros(1, dtype=torch.int64)  # outer steps done
    state = lockstep.SharedState({"outer": outer, "momentum": momentum, "step": step})
    inner = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=WEIGHT_DECAY)  # this peer's own
    quantization = "minmax" if args.quantize else None
    with lockstep.Communicator(master=args.master, base_port=0) as comm:
        ready_to_connect(args)
        comm.connect()
        # Admitted into a running group: receive its state. The first peers wait for each other.
        strategy = "receive_only" if comm.group_world_size > 1 else "enforce_popular"
        wait_for_peers(comm, args.min_peers)
        first, world_seen = True, 0
        while int(step) < outer_steps:
            # The first round goes straight to the sync: a newcomer (and each of the first
            # peers) was just admitted by an update topology, after which the peers that
            # admitted it sync too.
            if not first:
                admit_pending(comm)
            first = False
            sync(comm, state, strategy)
            strategy = "enforce_popular"
            load_flat(model, outer)
            s, world, rank = int(step), comm.group_world_size, comm.rank
            if world != world_seen:
                report(args.name, event="membership" if world_seen else "joined", step=s * h, world=world, rank=rank)
                world_seen = world
            for i in range(h):
                for group in inner.param_groups:
                    group["lr"] = learning_rate(cfg, s * h + i)
                x, y = batch(corpus.train, cfg["batch"], cfg["context"], seed_of(args.seed, s, i, rank))
                inner.zero_grad()
                loss = loss_of(model, x, y)
                loss.backward()
                inner.step()
                report(args.name, event="step", step=s * h + i + 1, world=world, rank=rank, loss=round(float(loss), 4))
            pseudo_gradient = (outer - flat_parameters(model)).contiguous()
            if world > 1:
                try:
                    comm.all_reduce(pseudo_gradient, op="avg", quantization=quantization, tag=s)
                except lockstep.PeerConnectionLostError:
                    report(args.name, event="skipped", step=s * h, world=world)
                    continue  # a peer died: this outer step again, with the survivors
                except lockstep.TooFewPeersError:
                    pass  # alone now: its own pseudo-gradient is the average
            # Nesterov: the step along the gradient plus the momentum it is about to have.
            momentum.mul_(OUTER_MOMENTUM).add_(pseudo_gradient)
            outer.sub_(OUTER_LR * (pseudo_gradient + OUTER_MOMENTUM * momentum))
            step += 1
            if rank == 0 and (int(step) * h % cfg["eval_every"] < h or int(step) == outer_steps):
                load_flat(model, outer)
                report(args.name, event="held_out", step=int(step) * h,
                       held_out=round(held_out_loss(model, corpus.held_out, cfg["eval_windows"]), 4))
    load_flat(model, outer)
    torch.save(model.state_dict(), os.path.join(args.out, f"final-{args.name}.pt"))
    return model


# ---------------------------------------------------------------- the driver


class Run:
    """The peer processes and their JSON lines."""

    def __init__(self, args: argparse.Namespace, master: str) -> None:
        self.args = args
        self.master = master
        self.procs: Dict[str, subprocess.Popen] = {}
        self.records: List[dict] = []
        self._offsets: Dict[str, int] = {}
        self._pending: Dict[str, str] = {}

    def spawn(self, name: str, min_peers: int, newcomer: bool) -> None:
        a = self.args
        cmd = [sys.executable, os.path.abspath(__file__), "--master", self.master, "--name", name, "--mode", a.mode,
               "--out", a.out, "--seed", str(a.seed), "--min-peers", str(min_peers)]
        cmd += (["--short"] if a.short else []) + (["--quantize"] if a.quantize else [])
        cmd += ["--steps", str(a.steps)] if a.steps else []
        cmd += ["--connect-on-stdin"] if newcomer else []
        path = os.path.join(a.out, name)
        with open(f"{path}.jsonl", "w") as out, open(f"{path}.log", "w") as err:
            self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE if newcomer else subprocess.DEVNULL,
                                                stdout=out, stderr=err, text=True)

    def event(self, **fields) -> dict:
        record = {"peer": "driver", "t": round(time.time(), 3), **fields}
        self.records.append(record)
        return record

    def poll(self) -> List[dict]:
        """The lines the peers wrote since the last poll."""
        new = []
        for name in self.procs:
            path = os.path.join(self.args.out, f"{name}.jsonl")
            with open(path) as f:
                f.seek(self._offsets.get(name, 0))
                text = self._pending.get(name, "") + f.read()
                self._offsets[name] = f.tell()
            *lines, self._pending[name] = text.split("\n")
            for line in lines:
                if line.startswith("{"):
                    new.append(json.loads(line))
        self.records.extend(new)
        return new


def drive(args: argparse.Namespace, cfg: dict) -> int:
    start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    n = args.peers or cfg["peers"]
    if n < 2:
        raise SystemExit("--peers: at least 2 (one of them is killed)")
    kill_at, join_at = int(KILL_AT * cfg["steps"]), int(JOIN_AT * cfg["steps"])
    mode = (f"DiLoCo (H={cfg['inner_steps']}{', 8-bit all-reduce' if args.quantize else ''})" if args.mode == "diloco"
            else "DataParallel")
    print(f"{n} peers train a {cfg['layers']}-layer character transformer (d_model {cfg['d_model']}, context "
          f"{cfg['context']}) on the fortunes with {mode} for {cfg['steps']} steps; a peer is killed at step "
          f"{kill_at}, a new one starts at step {join_at}; output in {args.out}", flush=True)
    lockstep.set_log_level("error")  # the driver's master: loopback, no secret needed
    with lockstep.Master("127.0.0.1:0") as master:
        run = Run(args, master.address)
        names = [f"p{i}" for i in range(n)]
        for name in names:
            run.spawn(name, n, newcomer=False)
        newcomer = f"p{n}"
        run.spawn(newcomer, 1, newcomer=True)  # loads torch and the corpus now, connects when told
        victim = names[-1]
        killed = started = False
        latest = 0
        deadline = time.monotonic() + cfg["deadline_s"]
        while time.monotonic() < deadline:
            for r in run.poll():
                if r["event"] == "step":
                    latest = max(latest, r["step"])
                elif r["event"] in ("joined", "membership") and (r["event"] == "membership" or r["step"] > 0):
                    print(f"  {r['peer']}: {'joined' if r['event'] == 'joined' else 'membership changed'} at step "
                          f"{r['step']}, world {r['world']}", flush=True)
                if "held_out" in r:
                    losses = [q["loss"] for q in run.records if q.get("event") == "step" and q["step"] == r["step"]]
                    mean = np.mean(losses) if losses else float("nan")
                    print(f"step {r['step']:5d}  training loss {mean:.3f}  held-out loss {r['held_out']:.3f}",
                          flush=True)
            if not killed and latest >= kill_at:
                run.procs[victim].send_signal(signal.SIGKILL)
                run.procs[victim].wait()
                run.event(event="killed", step=latest, victim=victim)
                print(f"  killed {victim} (SIGKILL) at step {latest}", flush=True)
                killed = True
            if killed and not started and latest >= join_at:
                run.procs[newcomer].stdin.write("connect\n")
                run.procs[newcomer].stdin.flush()
                run.event(event="started", step=latest, newcomer=newcomer)
                print(f"  started {newcomer} at step {latest}", flush=True)
                started = True
            if all(p.poll() is not None for p in run.procs.values()):
                break
            # A newcomer never told to connect (the run ended first) is not waited for.
            if not started and all(p.poll() is not None for k, p in run.procs.items() if k != newcomer):
                break
            time.sleep(0.2)
        for p in run.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        run.poll()
        exits = {k: p.returncode for k, p in run.procs.items()}
    wall = time.monotonic() - start
    with open(os.path.join(args.out, "records.jsonl"), "w") as f:
        for r in sorted(run.records, key=lambda r: r["t"]):
            f.write(json.dumps(r) + "\n")
    return finish(args, cfg, run.records, exits, victim, newcomer, wall)


def finish(args: argparse.Namespace, cfg: dict, records: List[dict], exits: Dict[str, int], victim: str,
           newcomer: str, wall: float) -> int:
    corpus = Corpus()
    finals = {}
    for name, code in exits.items():
        path = os.path.join(args.out, f"final-{name}.pt")
        if code == 0 and os.path.exists(path):
            finals[name] = torch.load(path)
    states = list(finals.values())
    identical = bool(states) and all(all(torch.equal(a, b) for a, b in zip(states[0].values(), other.values()))
                                     for other in states[1:])
    killed = [r for r in records if r.get("event") == "killed"]
    joined = [r for r in records if r.get("event") == "joined" and r["peer"] == newcomer and r["step"] > 0]
    unigram = corpus.unigram_cross_entropy()
    held = float("nan")
    samples: List[str] = []
    if finals:
        model = build_model(len(corpus.vocab), cfg, args.seed)
        model.load_state_dict(next(iter(finals.values())))
        held = held_out_loss(model, corpus.held_out)
        samples = [generate(model, corpus.vocab, p, seed=args.seed + i) for i, p in enumerate(PROMPTS)]
    plot(args, cfg, records, unigram, held, newcomer)
    print(f"finished: {', '.join(sorted(finals)) or 'none'} (exit status {exits}); final model "
          f"{'identical on every peer that finished' if identical else 'DIFFERENT between peers'}", flush=True)
    print(f"held-out loss {held:.3f} nats/char (all {len(corpus.held_out)} held-out characters); character-unigram "
          f"cross-entropy of the held-out text {unigram:.3f}", flush=True)
    for s in samples:
        print("--- sample\n" + s.rstrip("\n"), flush=True)
    print(f"plot: {args.plot}; wall time {wall:.1f} s", flush=True)
    ok = (identical and bool(killed) and bool(joined) and newcomer in finals and held < unigram
          and all(code == 0 for name, code in exits.items() if name != victim))
    print(json.dumps({"summary": True, "ok": ok, "mode": args.mode, "quantize": args.quantize,
                      "held_out_loss": round(held, 4), "unigram_cross_entropy": round(unigram, 4),
                      "held_out_chars": len(corpus.held_out),
                      "identical": identical, "finished": sorted(finals), "killed": [r["victim"] for r in killed],
                      "joined": [r["peer"] for r in joined], "exits": exits, "plot": args.plot,
                      "records": os.path.join(args.out, "records.jsonl"), "wall_s": round(wall, 1)}), flush=True)
    return 0 if ok else 1


def plot(args: argparse.Namespace, cfg: dict, records: List[dict], unigram: float, held_final: float,
         newcomer: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The last report of each (peer, step): a step redone after a failure counts once.
    last: Dict[Tuple[str, int], float] = {}
    for r in records:
        if r.get("event") == "step":
            last[(r["peer"], r["step"])] = r["loss"]
    by_step: Dict[int, List[float]] = collections.defaultdict(list)
    for (_, step), loss in last.items():
        by_step[step].append(loss)
    steps = sorted(by_step)
    train = np.array([np.mean(by_step[s]) for s in steps])
    window = max(1, cfg["steps"] // 60)
    smooth = np.convolve(train, np.ones(window) / window, mode="valid") if len(train) >= window else train
    held = sorted({r["step"]: r["held_out"] for r in records if "held_out" in r}.items())
    # The world size each step trained with (the last report of the step).
    worlds = {}
    for r in sorted((r for r in records if r.get("event") == "step"), key=lambda r: r["t"]):
        worlds[r["step"]] = r["world"]
    fig, (ax, wx) = plt.subplots(2, 1, figsize=(8, 4.8), dpi=90, sharex=True, gridspec_kw={"height_ratios": [4, 1]})
    ax.plot(steps, train, color="tab:blue", alpha=0.25, linewidth=0.8)
    ax.plot(steps[window - 1:], smooth, color="tab:blue", label="training loss (mean over peers)")
    if held:
        ax.plot([s for s, _ in held], [v for _, v in held], "o-", color="tab:orange", markersize=3,
                label="held-out loss")
    ax.axhline(unigram, color="gray", linestyle=":", label=f"character unigram ({unigram:.2f})")
    low = min(float(np.min(train)), min((v for _, v in held), default=unigram)) - 0.15 if len(train) else 1.0
    top = unigram + 0.5
    for r in records:
        if r.get("event") == "killed":
            label, color = f" {r['victim']} killed", "tab:red"
        elif r.get("event") == "joined" and r["peer"] == newcomer and r["step"] > 0:
            label, color = f" {r['peer']} joined", "tab:green"
        else:
            continue
        for a in (ax, wx):
            a.axvline(r["step"], color=color, linestyle="--", linewidth=1)
        ax.text(r["step"], top - 0.03, label, color=color, va="top", fontsize=8)
    ax.set_ylim(low, top)
    ax.set_ylabel("cross-entropy (nats/char)")
    title = "DiLoCo" + (", 8-bit all-reduce" if args.quantize else "") if args.mode == "diloco" else "DataParallel"
    ax.set_title(f"char transformer on the fortunes, {title}: held-out {held_final:.3f} at the end", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    ws = sorted(worlds)
    wx.step(ws, [worlds[s] for s in ws], where="post", color="black", linewidth=1)
    wx.set_ylim(0.5, max(worlds.values(), default=1) + 0.5)
    wx.set_yticks(range(1, max(worlds.values(), default=1) + 1))
    wx.set_ylabel("peers")
    wx.set_xlabel("step" + (" (inner steps)" if args.mode == "diloco" else ""))
    wx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot)
    plt.close(fig)


# ---------------------------------------------------------------- the command line


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["ddp", "diloco"], default="diloco")
    parser.add_argument("--short", action="store_true", help="the small, quick configuration (the test's)")
    parser.add_argument("--quantize", action="store_true", help="diloco: 8-bit (min-max) all-reduce on the wire")
    parser.add_argument("--peers", type=int, default=0, help="peers at the start (default: the configuration's)")
    parser.add_argument("--steps", type=int, default=0, help="training steps (default: the configuration's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for records, models and the plot")
    parser.add_argument("--plot", default=None, help="the PNG (default: OUT/torch_text.png)")
    # The peers' options (the driver passes them).
    parser.add_argument("--master", default=None, help="run as a peer of this master (HOST:PORT)")
    parser.add_argument("--name", default="peer")
    parser.add_argument("--min-peers", type=int, default=1)
    parser.add_argument("--connect-on-stdin", action="store_true")
    args = parser.parse_args(argv)
    cfg = dict(CONFIGS["short" if args.short else "long"])
    if args.steps:
        cfg["steps"] = args.steps
    if args.master is None:
        os.environ.setdefault("LOCKSTEP_LOG_LEVEL", "warn")
        args.out = args.out or tempfile.mkdtemp(prefix="torch-text-")
        args.plot = args.plot or os.path.join(args.out, "torch_text.png")
        return drive(args, cfg)
    lockstep.set_log_level(os.environ.get("LOCKSTEP_LOG_LEVEL", "warn"))
    corpus = Corpus()
    (ddp_peer if args.mode == "ddp" else diloco_peer)(args, cfg, corpus)
    return 0


if __name__ == "__main__":
    sys.exit(main())
