#!/usr/bin/python3
"""The showcase: a master and four peers training async DiLoCo on the digits over
loopback. One peer is killed mid-run and a new one joins; later the master itself is
killed (SIGKILL) and a new one, started on its address, takes the same peers back
(failover, docs/operations.md). Every step prints the loss, the world size and each
peer's shared-state hash (they must all be equal), and the run ends with the test
accuracy. Exit status 0 if every step's hashes agreed and the accuracy is at least 90%.

    /usr/bin/python3 examples/python/showcase.py [--steps 40] [--example async_diloco]
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import subprocess
import sys
import time

os.environ.setdefault("LOCKSTEP_LOG_LEVEL", "warn")
HERE = os.path.dirname(os.path.abspath(__file__))

# The master, as a process of its own (so that it can be killed): it prints its port and
# serves until killed, or until the showcase ends (its stdin closes). A new master waits
# up to 20 s for every peer of the run to come back (the default window, 5 s, is short for
# a peer of a loaded machine, which would then be left out: KICKED when it comes). The
# replacement holds a new run's founding for 2 s (resume_hold_ms), so that the run's peers
# are taken back before any newcomer could found another.
MASTER = ("import sys, lockstep\n"
          "m = lockstep.Master(listen=sys.argv[1], recovery_window_ms=20000, resume_hold_ms=int(sys.argv[2]))\n"
          "m.run()\n"
          "print(m.port, flush=True)\n"
          "sys.stdin.read()\n")


def start_master(listen: str, env: dict, resume_hold_ms: int = 0) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", MASTER, listen, str(resume_hold_ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"the master did not start ({p.wait()})")
    return p, int(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--example", default="async_diloco", choices=["async_diloco", "diloco", "ddp"])
    parser.add_argument("--kill-at", type=int, default=10, help="step at which a peer is killed (0: never)")
    parser.add_argument("--join-at", type=int, default=12, help="step at which a new peer is started (0: never)")
    parser.add_argument("--kill-master-at", type=int, default=20,
                        help="step at which the master is killed and a new one started on its address (0: never)")
    parser.add_argument("--step-delay", type=float, default=0.25, help="seconds of pretend compute per step")
    parser.add_argument("--newcomers", type=int, default=1, help="peers that join at --join-at")
    parser.add_argument("--min-accuracy", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0, help="the model's initialization and the data's split")
    parser.add_argument("--quantization", default=None, help="diloco: the all-reduce's quantization (e.g. minmax4)")
    parser.add_argument("--error-feedback", action="store_true", help="diloco: with a residual per peer")
    parser.add_argument("--distribution", default=None, help="diloco: the quantization's distribution hint (normal)")
    args = parser.parse_args()

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
    master, port = start_master("127.0.0.1:0", env)
    address = f"127.0.0.1:{port}"
    try:
        peers: dict[str, subprocess.Popen] = {}
        selector = selectors.DefaultSelector()

        waiting: list[str] = []  # started early, connect when told (imports take seconds)

        def spawn(name: str, initial: bool) -> None:
            p = subprocess.Popen([sys.executable, os.path.join(HERE, f"{args.example}.py"), "--master", address,
                                  "--name", name, "--steps", str(args.steps), "--step-delay", str(args.step_delay),
                                  "--min-peers", str(args.peers if initial else 2), "--seed", str(args.seed)]
                                 + (["--quantization", args.quantization] if args.quantization else [])
                                 + (["--error-feedback"] if args.error_feedback else [])
                                 + (["--distribution", args.distribution] if args.distribution else [])
                                 + ([] if initial else ["--connect-on-stdin"]),
                                 stdin=subprocess.DEVNULL if initial else subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, env=env)
            peers[name] = p
            selector.register(p.stdout, selectors.EVENT_READ, name)
            if not initial:
                waiting.append(name)

        print(f"master at {address}; {args.peers} peers train {args.example} on the digits "
              f"for {args.steps} steps", flush=True)
        for i in range(args.peers):
            spawn(f"p{i}", initial=True)
        if args.join_at:
            for i in range(args.newcomers):
                spawn(f"p{args.peers + i}", initial=False)
        by_step: dict[int, dict[str, dict]] = {}
        done: dict[str, dict] = {}
        killed: set[str] = set()
        printed = 0
        mismatches = 0
        master_killed = False
        deadline = time.monotonic() + 600
        while len(done) + len(killed) < len(peers) and time.monotonic() < deadline:
            # Once every peer that trained has finished, one that never got in cannot.
            trained = {n for r in by_step.values() for n in r}
            if done and trained <= set(done) | killed:
                break
            for key, _ in selector.select(timeout=1):
                name = key.data
                line = key.fileobj.readline()
                if not line:
                    selector.unregister(key.fileobj)
                    if name not in done and name not in killed:
                        print(f"  {name} exited ({peers[name].wait()})", flush=True)
                        killed.add(name)
                    continue
                event = json.loads(line)
                if event["event"] == "step":
                    by_step.setdefault(event["step"], {})[name] = event
                elif event["event"] == "done":
                    done[name] = event
                elif event["event"] == "joined":
                    print(f"  {name} joined at step {event['step']} (world {event['world']})", flush=True)
            # A step is printed once every live peer that trains has reported it (or more).
            latest = {n: max((k for k, r in by_step.items() if n in r), default=0) for n in peers}
            training = [n for n in peers if n not in killed and n not in done and latest[n] > 0]
            ready = min((latest[n] for n in training), default=max(by_step, default=0))
            while printed < ready:
                printed += 1
                reports = by_step.get(printed, {})
                if not reports:
                    continue
                hashes = {n: r["hash"] for n, r in sorted(reports.items())}
                same = len(set(hashes.values())) == 1
                mismatches += 0 if same else 1
                first = next(iter(reports.values()))
                print(f"step {printed:3d}  world {first['world']}  loss {first['loss']:.3f}  test accuracy "
                      f"{first['accuracy']:.3f}  shared state " + " ".join(f"{n}={h[:12]}" for n, h in hashes.items())
                      + ("  (all equal)" if same else "  (DIFFERENT)"), flush=True)
                live = [n for n in peers if n not in killed and n not in done]
                if printed == args.kill_at and len(live) > 2:
                    victim = live[1]
                    peers[victim].send_signal(signal.SIGKILL)
                    killed.add(victim)
                    print(f"  killed {victim} (SIGKILL)", flush=True)
                if printed == args.kill_master_at:
                    master.kill()
                    master.wait()
                    master, _ = start_master(address, env, resume_hold_ms=2000)
                    master_killed = True
                    print(f"  killed the master (SIGKILL); a new one on {address} takes the peers back", flush=True)
                if printed == args.join_at:
                    for name in waiting:
                        peers[name].stdin.write("connect\n")
                        peers[name].stdin.flush()
                        print(f"  started {name}", flush=True)
                    waiting.clear()
        for p in peers.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        finals = {n: e for n, e in done.items()}
        if not finals:
            print("no peer finished", flush=True)
            return 1
        hashes = {e["hash"] for e in finals.values()}
        accuracy = min(e["accuracy"] for e in finals.values())
        first = by_step[min(by_step)] if by_step else {}
        first_loss = max((r["test_loss"] for r in first.values()), default=float("nan"))
        final_loss = max(e["test_loss"] for e in finals.values())
        print(f"done: {len(finals)} peers finished at step {max(e['step'] for e in finals.values())}; "
              f"final shared state {'identical on every peer' if len(hashes) == 1 else 'DIFFERENT'}; "
              f"test loss {first_loss:.3f} -> {final_loss:.3f}; test accuracy {accuracy:.3f}", flush=True)
        ok = len(hashes) == 1 and mismatches == 0 and accuracy >= args.min_accuracy and final_loss < first_loss
        print(json.dumps({"summary": True, "ok": ok, "finished": sorted(finals), "killed": sorted(killed),
                          "master_killed": master_killed,
                          "hashes_equal": len(hashes) == 1 and mismatches == 0, "first_test_loss": first_loss,
                          "final_test_loss": final_loss, "accuracy": accuracy}), flush=True)
        return 0 if ok else 1
    finally:
        master.kill()
        master.wait()


if __name__ == "__main__":
    sys.exit(main())
