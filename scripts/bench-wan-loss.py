#!/usr/bin/python3
"""All-reduce over lossy long links on the WAN test bed, beside iperf3 (needs root).

For each number of hosts, congestion control and loss rate, one bed: every pair of hosts
capped at CAP each way, RTT/2 of delay each way and LOSS random loss each way (counted
in wire packets: docs/testbed.md). On that bed, first the anchors: iperf3 from host 0 to
host 1 with one stream (-P1) and with eight (-P8); then, on the same links, every size,
concurrency and stream count with `lockstep-bench allreduce --master` on each host.

One JSON line per case:
  {"bench": "wan_loss", "hosts", "master", "cap_mbit", "rtt_ms", "loss", "cc", "bytes",
   "concurrency", "streams", "pool", "quant", "reversed", "p50_ms", "link_use", "mbit_s",
   "effective_mbit_s", "iperf3_p1_mbit", "iperf3_p8_mbit"}
p50_ms: the slowest peer's median time of one iteration (all `concurrency` all-reduces);
mbit_s: the payload bits one peer sent per second (its bytes on the wire per iteration
x 8 / p50); link_use: mbit_s / cap, as in BENCHMARKS.md's pool sweep; effective_mbit_s:
the bits all-reduced per second (bytes x concurrency x 8 / p50: quantization raises it
above mbit_s). A case that does not finish within --timeout seconds prints "error" and
null figures.

Usage: scripts/bench-wan-loss.py [--build build] [--hosts 2,4] [--cap 1000]
         [--rtt-ms 50] [--loss 0.001] [--cc reno] [--sizes 16MiB]
         [--concurrency 1,8] [--quant none] [--streams 1] [--pool N] [--iterations 5]
         [--iperf-seconds 10] [--timeout 600] [--master-apart]
         [--reversal | --relay | --relay-process] [--rounds N]
Lists are comma-separated. --streams is passed on as `lockstep-bench allreduce
--streams N` (0: the communicator adapts the count to the path, docs/wan.md; 1 to 16
fixes it) only where that command offers it; otherwise every line says "streams": 1.
--reversal runs each case direct, then with host 1's peer accepting no inbound connection;
--relay runs it direct, then with every peer accepting none and the master (on a host of
its own: --master-apart is implied) relaying every ring edge; --relay-process as --relay
with lockstep-relay on one more host of its own relaying instead of the master; all under
a run secret.
Each line's "edges" says which ran ("direct", "reversed" or "relayed"), checked against
the ports of the view each peer printed.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))

from lockstep_peers import start_master  # noqa: E402
from testbed import Testbed  # noqa: E402

IPERF_PORT = 5201


def fail(message: str) -> None:
    print(f"bench-wan-loss: {message}", file=sys.stderr)
    sys.exit(2)


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def parse_list(text: str, kind, name: str, low: float, high: float) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        fail(f"--{name} '{text}': give comma-separated numbers")
    if not values:
        fail(f"--{name} is empty")
    for v in values:
        if not low <= v <= high:
            fail(f"--{name} {v} out of range: {low:g} to {high:g}")
    return values


def congestion_controls(names: list[str]) -> None:
    """Each name must be available to the kernel; loads its module if it is not yet."""
    path = "/proc/sys/net/ipv4/tcp_available_congestion_control"
    for name in names:
        if name in open(path).read().split():
            continue
        try:
            subprocess.run(["modprobe", f"tcp_{name}"], capture_output=True)
        except FileNotFoundError:
            pass  # no modprobe: the check below says so
        available = open(path).read().split()
        if name not in available:
            fail(f"congestion control '{name}' is not available on this kernel "
                 f"(modprobe tcp_{name} did not help; available: {' '.join(available)})")


def set_cc(bed: Testbed, cc: str) -> None:
    for h in range(bed.hosts):
        p = bed.exec(h, "sysctl", "-w", f"net.ipv4.tcp_congestion_control={cc}", check=False)
        got = bed.exec(h, "cat", "/proc/sys/net/ipv4/tcp_congestion_control").stdout.strip()
        if got != cc:
            fail(f"host {h} refused congestion control '{cc}' (it has '{got}'): {p.stderr.strip()}")


def bench_has_streams(bench: str) -> bool:
    out = subprocess.run([bench, "allreduce", "--help"], capture_output=True, text=True).stdout
    return "--streams" in out


def iperf3(bed: Testbed, streams: int, seconds: int) -> float | None:
    """Mbit/s received from host 0 at host 1 with `streams` TCP streams."""
    server = bed.popen(1, "iperf3", "-s", "-1", "-p", IPERF_PORT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            if bed.exec(1, "ss", "-Hltn", f"sport = :{IPERF_PORT}").stdout.strip():
                break
            time.sleep(0.01)
        p = bed.exec(0, "iperf3", "-c", bed.addr(1), "-p", IPERF_PORT, "-t", seconds, "-O", 2,
                     "-P", streams, "-J", check=False, timeout=seconds + 60)
        try:
            return round(json.loads(p.stdout)["end"]["sum_received"]["bits_per_second"] / 1e6, 1)
        except (ValueError, KeyError):
            print(f"bench-wan-loss: iperf3 -P{streams} gave no result: {p.stdout[-300:]} {p.stderr[-300:]}",
                  file=sys.stderr)
            return None
    finally:
        server.kill()
        server.wait()


def allreduce(bed: Testbed, bin_dir: str, peers: int, args: list[str], timeout: float,
              no_inbound_hosts: tuple = (), secret: str = "", relay: str = "") -> list[dict] | str:
    """Runs lockstep-bench allreduce on hosts 0..peers-1, the master on host 0 or, with a
    host more than peers, on host `peers` (the peers of no_inbound_hosts accept no inbound
    connection; `secret`: the run secret's file; `relay`: "master", the master relays, or
    "process", lockstep-relay on host peers+1 does); each peer's figures, or an error."""
    master_host = peers if bed.hosts > peers else 0
    master = start_master(bed, bin_dir, master_host, *(["--secret-file", secret] if secret else []),
                          *(["--relay-port", "7001"] if relay == "master" else []))
    procs = []
    if relay == "process":
        procs.append(bed.popen(peers + 1, os.path.join(bin_dir, "lockstep-relay"), "--master",
                               f"{bed.addr(master_host)}:7000", "--secret-file", secret, "--listen",
                               f"{bed.addr(peers + 1)}:7002", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True))
        for word in ("listening", "registered"):
            ready, _, _ = select.select([procs[0].stdout], [], [], 10)
            if not ready or word not in procs[0].stdout.readline():
                master.kill()
                master.wait(timeout=10)
                procs[0].kill()
                procs[0].wait()
                return f"lockstep-relay did not say it is {word}"
    relays = len(procs)
    try:
        for h in range(peers):
            procs.append(bed.popen(h, os.path.join(bin_dir, "lockstep-bench"), "allreduce", "--master",
                                   f"{bed.addr(master_host)}:7000", "--peers", peers, *args,
                                   *(["--no-inbound"] if h in no_inbound_hosts else []),
                                   *(["--secret-file", secret] if secret else []),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + timeout
        rows = []
        for p in procs[relays:]:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return f"timeout after {timeout:g} s"
            if p.returncode != 0:
                return f"a peer failed ({p.returncode}): {err.strip()[-300:]}"
            lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            if not lines:
                return "a peer printed no figures"
            rows.append(lines[0])
        return rows
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        master.kill()
        master.wait(timeout=10)


def edges(rows: list[dict]) -> str:
    """What the views say the ring's edges were: relayed where two neighbours name no
    port, reversed where one does, else direct (the most unusual one present)."""
    ports = rows[0].get("ports", [])
    kinds = {"direct"}
    for k in range(len(ports)):
        a, b = ports[k], ports[(k + 1) % len(ports)]
        kinds.add("relayed" if a == 0 and b == 0 else "reversed" if a == 0 or b == 0 else "direct")
    return "relayed" if "relayed" in kinds else "reversed" if "reversed" in kinds else "direct"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--hosts", default="2,4")
    parser.add_argument("--cap", type=float, default=1000, help="Mbit/s each way on every pair")
    parser.add_argument("--rtt-ms", type=float, default=50, help="round trip; half each way")
    parser.add_argument("--loss", default="0.001", help="loss rate(s) each way, e.g. 0,0.001,0.01")
    parser.add_argument("--cc", default="reno", help="congestion control(s) of the hosts, e.g. reno,bbr")
    parser.add_argument("--sizes", default="16MiB")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--quant", default="none", help="quantization(s) of lockstep-bench, e.g. none,minmax4")
    parser.add_argument("--streams", default="1")
    parser.add_argument("--pool", type=int, default=0, help="connections per neighbour (default: the concurrency)")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iperf-seconds", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per case")
    parser.add_argument("--master-apart", action="store_true",
                        help="run the master on a host of its own (one more, on the same links) "
                             "rather than beside the peer of host 0")
    parser.add_argument("--reversal", action="store_true",
                        help="run each case twice on the same bed, direct and with host 1's peer accepting no "
                             "inbound connection (its ring edges reversed), alternating --rounds times")
    parser.add_argument("--relay", action="store_true",
                        help="run each case twice on the same bed, direct and with every peer accepting no inbound "
                             "connection and the master, on a host of its own, relaying (implies --master-apart)")
    parser.add_argument("--relay-process", action="store_true",
                        help="as --relay, but lockstep-relay on a host of its own relays (a master that relays "
                             "nothing on another)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --reversal or --relay: direct/other pairs per case")
    args = parser.parse_args()
    if args.reversal + args.relay + args.relay_process > 1:
        fail("--reversal, --relay and --relay-process are exclusive")
    relay_mode = "process" if args.relay_process else "master" if args.relay else ""
    if relay_mode:
        args.master_apart = True

    if os.geteuid() != 0:
        fail("must run as root: the test bed needs network namespaces, tc and iptables")
    hosts_list = parse_list(args.hosts, int, "hosts", 2, 120)
    losses = parse_list(args.loss, float, "loss", 0, 1)
    concurrencies = parse_list(args.concurrency, int, "concurrency", 1, 256)
    streams_list = parse_list(args.streams, int, "streams", 0, 16)
    if not 0.008 <= args.cap <= 100_000:
        fail(f"--cap {args.cap:g} out of range: 0.008 to 100000 Mbit/s")
    if not 0 <= args.rtt_ms <= 2000:
        fail(f"--rtt-ms {args.rtt_ms:g} out of range: 0 to 2000")
    if not 5 <= args.iterations <= 100000:
        fail(f"--iterations {args.iterations} out of range: 5 to 100000 (lockstep-bench's own range)")
    if args.pool and not 1 <= args.pool <= 256:
        fail(f"--pool {args.pool} out of range: 1 to 256")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ccs = [c for c in args.cc.split(",") if c]
    congestion_controls(ccs)
    bin_dir = os.path.join(os.path.abspath(args.build), "bin")
    bench = os.path.join(bin_dir, "lockstep-bench")
    if not os.access(bench, os.X_OK):
        fail(f"{bench} not found: build lockstep-bench, lockstep-master and lockstep-testbed")
    has_streams = bench_has_streams(bench)
    if not has_streams and any(s not in (0, 1) for s in streams_list):
        print("bench-wan-loss: this lockstep-bench has no --streams; every case runs with one stream",
              file=sys.stderr)
        streams_list = [1]

    secret = ""
    if args.reversal or relay_mode:  # both ways of a pair run under the same run secret
        fd, secret = tempfile.mkstemp(prefix="lockstep-bench-secret-")
        os.write(fd, os.urandom(32).hex().encode())
        os.close(fd)
        atexit.register(os.unlink, secret)

    for hosts in hosts_list:
        for cc in ccs:
            for loss in losses:
                bed_hosts = hosts + (1 if args.master_apart else 0) + (1 if relay_mode == "process" else 0)
                with Testbed(bed_hosts, command=os.path.join(bin_dir, "lockstep-testbed")) as bed:
                    set_cc(bed, cc)
                    for a in range(bed_hosts):
                        for b in range(a + 1, bed_hosts):
                            bed.cap(a, b, f"{int(args.cap * 1e6)}", both=True)
                            if args.rtt_ms > 0:
                                bed.delay(a, b, args.rtt_ms / 2, both=True)
                            if loss > 0:
                                bed.loss(a, b, f"{loss:.9g}", both=True)
                    p1 = iperf3(bed, 1, args.iperf_seconds)
                    p8 = iperf3(bed, 8, args.iperf_seconds)
                    for size in sizes:
                        for conc, quant in [(c, q) for c in concurrencies for q in args.quant.split(",")]:
                            paired = args.reversal or bool(relay_mode)
                            for streams, other in [(s, r) for s in streams_list
                                                   for _ in range(args.rounds if paired else 1)
                                                   for r in ((False, True) if paired else (False,))]:
                                pool = args.pool or conc
                                cmd = ["--size", str(size), "--iterations", str(args.iterations),
                                       "--warmup", str(args.warmup), "--pool", str(pool),
                                       "--concurrency", str(conc), "--quant", quant]
                                if has_streams:
                                    cmd += ["--streams", str(streams)]
                                hidden = ((1,) if args.reversal else tuple(range(hosts))) if other else ()
                                result = allreduce(bed, bin_dir, hosts, cmd, args.timeout, hidden,
                                                   secret if paired else "", relay=relay_mode if other else "")
                                want = ("reversed" if args.reversal else "relayed") if other else "direct"
                                line = {"bench": "wan_loss", "hosts": hosts,
                                        "master": "apart" if args.master_apart else "host 0", "cap_mbit": args.cap,
                                        "rtt_ms": args.rtt_ms, "loss": loss, "cc": cc, "bytes": size,
                                        "concurrency": conc, "streams": streams, "pool": pool, "quant": quant,
                                        "edges": want, "relay": (relay_mode or None) if other else None}
                                if not isinstance(result, str) and edges(result) != want:
                                    result = f"the views show {edges(result)} edges, not {want}: {result[0].get('ports')}"
                                if isinstance(result, str):
                                    line.update(p50_ms=None, link_use=None, mbit_s=None, error=result)
                                else:
                                    worst = max(result, key=lambda r: r["p50_us"])
                                    wire = max(r["wire_bytes"] for r in result)
                                    mbit = wire * 8 / (worst["p50_us"] / 1e6) / 1e6
                                    # The data's own rate: the bytes all-reduced per second.
                                    effective = size * conc * 8 / (worst["p50_us"] / 1e6) / 1e6
                                    line.update(p50_ms=round(worst["p50_us"] / 1e3, 1),
                                                link_use=round(mbit / args.cap, 4), mbit_s=round(mbit, 2),
                                                effective_mbit_s=round(effective, 2))
                                line.update(iperf3_p1_mbit=p1, iperf3_p8_mbit=p8)
                                print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
