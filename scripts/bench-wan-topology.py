#!/usr/bin/python3
"""Topology optimization and long fat pipes on the WAN test bed (needs root).

1. Six hosts with heterogeneous caps and delays (seeded): the all-reduce throughput in
   join order, the duration of optimize topology, the throughput after it, and what the
   best ring of the configured caps allows (found by brute force over every ring).
2. A 1 Gbit/s pair with 50 ms of round trip: the all-reduce's use of the link for
   connection pool sizes and numbers of concurrent all-reduces.

Every peer is `lockstep-bench allreduce --master ...` in its own host; one JSON line per
figure. Usage: scripts/bench-wan-topology.py [--build build] [--part 1|2|all] [--seed 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))

from lockstep_peers import start_master  # noqa: E402
from testbed import Testbed  # noqa: E402

# TCP payload over a cap that counts Ethernet, IP and TCP headers (docs/testbed.md).
PAYLOAD = 0.956


def run_peers(bed, bin_dir: str, hosts: list[int], args: list[str], timeout: float = 900) -> list[list[dict]]:
    master = start_master(bed, bin_dir, 0)
    procs = []
    try:
        for h in hosts:
            procs.append(bed.popen(h, os.path.join(bin_dir, "lockstep-bench"), "allreduce", "--master",
                                   f"{bed.addr(0)}:7000", "--peers", str(len(hosts)), *args,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err
            outputs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
        return outputs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        master.kill()
        master.wait(timeout=10)


def bottleneck(caps: dict, ring: list[int]) -> float:
    return min(caps[(ring[i], ring[(i + 1) % len(ring)])] for i in range(len(ring)))


def part1(bin_dir: str, seed: int, size: str) -> None:
    n = 6
    rng = random.Random(seed)
    caps = {}
    delays = {}
    for a in range(n):
        for b in range(n):
            if a != b:
                caps[(a, b)] = rng.choice([25, 50, 100, 200])
                delays[(a, b)] = rng.choice([1, 2, 5, 10])
    rings = [[0, *rest] for rest in itertools.permutations(range(1, n))]
    best = max(rings, key=lambda r: bottleneck(caps, r))
    with Testbed(n, command=os.path.join(bin_dir, "lockstep-testbed")) as bed:
        for (a, b), mbit in caps.items():
            bed.cap(a, b, f"{mbit}mbit")
            bed.delay(a, b, delays[(a, b)])
        outputs = run_peers(bed, bin_dir, list(range(n)),
                            ["--size", size, "--iterations", "5", "--warmup", "1", "--optimize"])
    def slowest(order: str) -> dict:
        rows = [r for out in outputs for r in out if r.get("bench") == "allreduce" and r["order"] == order]
        return max(rows, key=lambda r: r["p50_us"])
    joined, optimized = slowest("join"), slowest("optimized")
    optimize_ms = max(r["ms"] for out in outputs for r in out if r.get("bench") == "optimize")
    # The ring of the join order is the hosts' order only if they joined in that order;
    # the bench prints the ring it measured, mapped back to hosts by rank 0's view.
    ring_ids = optimized["ring"]
    rank_of_host = {}
    for host, out in enumerate(outputs):
        rows = [r for r in out if r.get("bench") == "allreduce" and r["order"] == "join"]
        rank_of_host[host] = rows[0]["rank"]
    join_ids = joined["ring"]
    host_of_id = {join_ids[rank]: host for host, rank in rank_of_host.items()}
    join_hosts = [host_of_id[i] for i in join_ids]
    optimized_hosts = [host_of_id[i] for i in ring_ids]
    allowed = PAYLOAD * bottleneck(caps, best) * 1e6 / 8 * n / (2 * (n - 1)) / 1e9
    result = {
        "bench": "wan_topology", "hosts": n, "seed": seed, "bytes": joined["bytes"],
        "join_ring": join_hosts, "join_bottleneck_mbit": bottleneck(caps, join_hosts),
        "join_gbytes_s": round(joined["gbytes_s"], 4),
        "optimize_ms": round(optimize_ms, 1),
        "optimized_ring": optimized_hosts, "optimized_bottleneck_mbit": bottleneck(caps, optimized_hosts),
        "optimized_gbytes_s": round(optimized["gbytes_s"], 4),
        "best_ring": best, "best_bottleneck_mbit": bottleneck(caps, best),
        "best_allows_gbytes_s": round(allowed, 4),
        "of_best": round(optimized["gbytes_s"] / allowed, 3),
    }
    print(json.dumps(result), flush=True)


def part2(bin_dir: str, size: str) -> None:
    with Testbed(2, command=os.path.join(bin_dir, "lockstep-testbed")) as bed:
        bed.cap(0, 1, "1gbit", both=True)
        bed.delay(0, 1, 25, both=True)
        for pool, concurrency in [(1, 1), (1, 4), (2, 2), (4, 4), (8, 8)]:
            outputs = run_peers(bed, bin_dir, [0, 1], ["--size", size, "--iterations", "5", "--warmup", "1",
                                                       "--pool", str(pool), "--concurrency", str(concurrency)])
            rows = [out[0] for out in outputs]
            worst = max(rows, key=lambda r: r["p50_us"])
            # Bytes each peer put on the wire per iteration, over the iteration's time.
            use = max(r["wire_bytes"] for r in rows) * 8 / (worst["p50_us"] / 1e6) / 1e9
            print(json.dumps({"bench": "wan_pool_sweep", "cap_mbit": 1000, "rtt_ms": 50, "bytes": worst["bytes"],
                              "pool": pool, "concurrency": concurrency, "p50_ms": round(worst["p50_us"] / 1e3, 1),
                              "gbytes_s": round(worst["gbytes_s"], 4), "link_use": round(use, 3)}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--part", default="all", choices=["1", "2", "all"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--size", default="16MiB")
    args = parser.parse_args()
    bin_dir = os.path.join(os.path.abspath(args.build), "bin")
    if args.part in ("1", "all"):
        part1(bin_dir, args.seed, args.size)
    if args.part in ("2", "all"):
        part2(bin_dir, args.size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
