"""Tests of the WAN test bed (lockstep-testbed and its delay program).

They need root; without it they fail with a message saying so. CTest runs each test
on its own (label "testbed"); the ones that measure rates run alone on the machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from testbed import TCP_CONNECT, Testbed, TestbedError, bed_namespaces, require_root, testbed_command

# --- helpers -----------------------------------------------------------------------

UDP_RECEIVER = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
want, deadline = int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
print("ready", flush=True)
n = 0
while n < want:
    left = deadline - time.monotonic()
    if left <= 0:
        break
    s.settimeout(left)
    try:
        s.recv(2048)
        n += 1
    except socket.timeout:
        break
print(n, flush=True)
"""

UDP_SENDER = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[3])):
    try:
        s.sendto(b"x" * 100, (sys.argv[1], int(sys.argv[2])))
    except OSError:
        pass
    time.sleep(0.005)
"""


PY = "/usr/bin/python3"

TCP_SINK = r"""
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
c, _ = s.accept()
n = 0
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    n += len(b)
print(n, flush=True)
"""

TCP_SOURCE = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
block, left = bytes(65536), int(sys.argv[3])
while left > 0:
    c.sendall(block[:min(left, len(block))])
    left -= min(left, len(block))
c.shutdown(socket.SHUT_WR)
c.recv(1)  # the sink's close: everything was received
"""


def udp_delivered(bed: Testbed, src: int, dst: int, count: int = 20, port: int = 40000,
                  wait: float = 1.0) -> int:
    """Sends `count` datagrams src->dst (5 ms apart); returns how many dst received
    within `wait` seconds of being ready."""
    rx = bed.popen(dst, PY, "-c", UDP_RECEIVER, port, count, wait,
                   stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready"
        bed.exec(src, PY, "-c", UDP_SENDER, bed.addr(dst), port, count)
        out, _ = rx.communicate(timeout=30)
        return int(out.strip())
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()


def tcp_connects(bed: Testbed, src: int, dst: int, port: int = 40001) -> bool:
    srv = bed.popen(dst, PY, "-c",
                    "import socket,sys;s=socket.create_server(('0.0.0.0',int(sys.argv[1])));"
                    "print('ready',flush=True);c,_=s.accept();c.close()",
                    port, stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "ready"
        out = bed.exec(src, PY, "-c", TCP_CONNECT, bed.addr(dst), port, 1.5).stdout
        return out.startswith("connected")
    finally:
        srv.kill()
        srv.wait()


def ping(bed: Testbed, src: int, dst: int, count: int = 5) -> tuple[int, float | None]:
    """(replies, average RTT in ms)"""
    out = bed.exec(src, "ping", "-n", "-q", "-c", count, "-i", "0.05", "-W", "1",
                   bed.addr(dst), check=False).stdout
    m = re.search(r"(\d+) received", out)
    r = re.search(r"= [\d.]+/([\d.]+)/", out)
    return (int(m.group(1)) if m else 0), (float(r.group(1)) if r else None)


def show(results: list[dict]) -> None:
    for r in results:
        rate = f"{r['measured_bps'] / 1e6:.1f} Mbit/s" if r.get("measured_bps") else "-"
        cap = f"{r['cap_bps'] / 1e6:g} Mbit/s" if r.get("cap_bps") else "none"
        ratio = f" ({100 * r['rate_ratio']:.1f}%)" if r.get("rate_ratio") is not None else ""
        print(f"\n  measured {r['src']}->{r['dst']}: rate {rate} of cap {cap}{ratio}, "
              f"rtt {r['rtt_ms']} ms of configured {r['rtt_configured_ms']} ms, "
              f"{r['streams']} streams, ok={r['ok']}")


def root_snapshot() -> dict:
    """What the root namespace looks like; a bed must change none of it."""
    def run(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True).stdout

    snap = {
        "links": run("ip", "-o", "link", "show"),
        "addrs": run("ip", "-o", "addr", "show"),
        "routes": run("ip", "route", "show", "table", "all"),
        "rules": run("ip", "rule", "show"),
        "qdiscs": run("tc", "qdisc", "show"),
    }
    for table in ("filter", "nat", "mangle", "raw"):
        snap["iptables-" + table] = run("iptables", "-w", "-t", table, "-S")
    return snap


def net_ns_holders(inode: str) -> list[int]:
    """pids of processes whose network namespace is `inode` (e.g. net:[4026532...])."""
    holders = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/ns/net") == inode:
                    holders.append(int(pid))
            except OSError:
                pass
    return holders


def ns_inode(name: str) -> str:
    return f"net:[{os.stat(f'/run/netns/{name}').st_ino}]"


def wait_in_ns(proc: subprocess.Popen, ns: str) -> None:
    """Waits until a process started with Testbed.popen runs inside namespace ns."""
    want, deadline = ns_inode(ns), time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{proc.pid}/ns/net") == want:
                return
        except OSError:
            pass
        assert proc.poll() is None, f"the process ended ({proc.returncode}) before entering {ns}"
        time.sleep(0.005)
    raise AssertionError(f"the process did not enter {ns}")


# --- life cycle ---------------------------------------------------------------------

def test_up_down_repeated():
    """10 times up (8 hosts, with caps, delays, a cut and a running process) and down:
    nothing of the bed is left, and the root namespace is exactly as before."""
    rounds = 10
    require_root()
    before = root_snapshot()
    bed = Testbed(8)
    t0 = time.monotonic()
    try:
        for round_ in range(rounds):
            bed.up()
            assert sorted(bed_namespaces([bed.prefix])) == sorted(bed.namespaces)
            inodes = [ns_inode(n) for n in bed.namespaces]
            bed.cap(0, 1, "100mbit")
            bed.delay(1, 2, 5, both=True)
            bed.cut(2, 3)
            proc = bed.popen(3, "sleep", "600")
            hub_proc = bed.popen("hub", "sleep", "600")
            wait_in_ns(proc, bed.namespace(3))
            wait_in_ns(hub_proc, bed.prefix + "hub")
            if round_ == 0:
                replies, rtt = ping(bed, 1, 2, count=3)
                assert replies == 3 and rtt is not None and rtt >= 10.0, (replies, rtt)
                assert ping(bed, 2, 3, count=2)[0] == 0
            bed.down()
            assert proc.wait(timeout=10) == -signal.SIGKILL
            assert hub_proc.wait(timeout=10) == -signal.SIGKILL
            assert bed_namespaces([bed.prefix]) == []
            for inode in inodes:
                assert net_ns_holders(inode) == [], f"a process still lives in {inode}"
            assert not os.path.exists(f"/run/lockstep-testbed/{bed.prefix}")
            assert root_snapshot() == before, f"round {round_}: the root namespace changed"
    finally:
        if bed.is_up:
            bed.down()
    print(f"\n  {rounds} x up/down of 8 hosts took {time.monotonic() - t0:.1f} s")


def test_down_kills_processes_and_leftovers(testbed_factory):
    """down finds a bed without its state, gc takes down beds whose owner died, and
    down is idempotent."""
    cmd = testbed_command()
    # 1. The state directory is lost (an aborted run): down still finds the namespaces.
    bed = testbed_factory(3)
    bed.delay(0, 1, 5)
    proc = bed.popen(0, "sleep", "600")
    wait_in_ns(proc, bed.namespace(0))
    shutil.rmtree(f"/run/lockstep-testbed/{bed.prefix}")
    subprocess.run([cmd, "--prefix", bed.prefix, "down"], check=True, capture_output=True)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert bed_namespaces([bed.prefix]) == []
    bed.down()  # idempotent: nothing left, still succeeds
    bed.down()

    # 2. The owner of a bed died: gc takes it down; live owners' beds stay.
    owner = subprocess.Popen(["sleep", "600"])
    orphan = Testbed(2)
    try:
        orphan.run("up", 2, "--owner", owner.pid)
        keep = testbed_factory(2)
        proc = orphan.popen(1, "sleep", "600")
        wait_in_ns(proc, orphan.namespace(1))
        owner.kill()
        owner.wait()
        out = subprocess.run([cmd, "gc"], check=True, capture_output=True, text=True).stdout
        assert f"bed '{orphan.prefix}' down" in out
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert bed_namespaces([orphan.prefix]) == []
        assert sorted(bed_namespaces([keep.prefix])) == sorted(keep.namespaces)
    finally:
        owner.kill()
        owner.wait()
        orphan.down()


def test_command_errors(testbed_factory):
    cmd = testbed_command()

    def fails(*args: object, message: str) -> None:
        p = subprocess.run([cmd, *map(str, args)], capture_output=True, text=True)
        assert p.returncode != 0, (args, p.stdout)
        assert message in p.stderr, (args, p.stderr)

    fails("--prefix", "t" + "x" * 10, "up", 2, message="bad prefix")
    fails("--prefix", "terr1", "up", 0, message="number of hosts")
    fails("--prefix", "terr1", "up", 2, "--cc", "cubic", message="reno or bbr")
    fails("--prefix", "terr1", "up", 2, "--subnet", "10.1.2.0/16", message="--subnet")
    fails("--prefix", "terr1", "cap", 0, 1, "1gbit", message="no bed 'terr1' is up")
    assert bed_namespaces(["terr1"]) == []
    bed = testbed_factory(2)
    fails("--prefix", bed.prefix, "up", 2, message="already up")
    fails("--prefix", bed.prefix, "cap", 0, 2, "1gbit", message="no host 2")
    fails("--prefix", bed.prefix, "cap", 0, 1, "fast", message="bad rate")
    fails("--prefix", bed.prefix, "delay", 0, 0, 5, message="same host")
    # Loss, jitter and bottlenecks: the value and the range in the message.
    fails("--prefix", bed.prefix, "cap", 0, 1, "200gbit", message="rate '200gbit' out of range (8kbit..100gbit)")
    fails("--prefix", bed.prefix, "loss", 0, 1, "1.5", message="rate '1.5' out of range: a probability from 0 to 1")
    fails("--prefix", bed.prefix, "loss", 0, 1, "101%", message="rate '101%' out of range")
    fails("--prefix", bed.prefix, "loss", 0, 1, "-0.1", message="bad rate '-0.1'")
    fails("--prefix", bed.prefix, "loss", 0, 1, "lots", message="bad rate 'lots'")
    fails("--prefix", bed.prefix, "jitter", 0, 1, "70000", message="'70000' ms out of range: 0 to 60000 ms")
    fails("--prefix", bed.prefix, "jitter", 0, 1, "-1", message="bad value '-1'")
    fails("--prefix", bed.prefix, "bottleneck", 0, "egress", "1kbit", message="rate '1kbit' out of range (8kbit..100gbit)")
    fails("--prefix", bed.prefix, "bottleneck", 0, "sideways", "1gbit", message="direction 'sideways'")
    fails("--prefix", bed.prefix, "bottleneck", 0, "egress", "1gbit", "--fq", "red", message="usage: bottleneck")
    fails("--prefix", bed.prefix, "bottleneck", 0, "egress", "1gbit", "--queue", "10", message="--queue '10' out of range")
    fails("--prefix", bed.prefix, "bottleneck", 2, "egress", "1gbit", message="no host 2")
    assert bed.status()["delays"] == [] and bed.status()["bottlenecks"] == []
    # The bed is still whole after the refused commands.
    assert sorted(bed_namespaces([bed.prefix])) == sorted(bed.namespaces)
    assert ping(bed, 0, 1, count=2)[0] == 2
    # Without root: a clear refusal.
    if shutil.which("setpriv"):
        p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            cmd, "--prefix", "terr2", "up", "2"], capture_output=True, text=True)
        assert p.returncode != 0 and "must run as root" in p.stderr, p.stderr


def test_host_settings(testbed_factory):
    """Inside each host: IPv6 off, the chosen congestion control, raised TCP buffers."""
    bed = testbed_factory(2, cc="bbr", tcp_mem_max=32 << 20)
    for h in range(2):
        def sysctl(name: str) -> list[str]:
            return bed.exec(h, "cat", f"/proc/sys/net/{name}").stdout.split()
        assert sysctl("ipv4/tcp_congestion_control") == ["bbr"]
        assert sysctl("ipv4/tcp_wmem")[2] == str(32 << 20)
        assert sysctl("ipv4/tcp_rmem")[2] == str(32 << 20)
        assert sysctl("ipv6/conf/all/disable_ipv6") == ["1"]
        assert bed.exec(h, "ip", "-6", "-o", "addr", "show").stdout.strip() == ""
        links = bed.exec(h, "ip", "-o", "link", "show").stdout
        assert "lo: <LOOPBACK,UP" in links
        assert f"{bed.prefix}h{h}@" in links
    assert bed.status()["cc"] == "bbr"


# --- rates and delays (the self-check measures) -------------------------------------

def test_cap_reaches_rate(testbed_factory):
    bed = testbed_factory(2)
    bed.cap(0, 1, "300mbit")
    [r] = bed.check((0, 1), seconds=3)
    show([r])
    assert r["cap_bps"] == 300_000_000
    assert 0.85 <= r["rate_ratio"] <= 1.05, r
    assert r["ok"]
    # The human-readable form: one line per pair.
    out = bed.run("check", "0:1", "--time", "1", "--omit", "1").stdout
    print("\n  " + out.strip())
    assert re.match(r"0->1  rate [\d.]+ Mbit/s of cap 300 Mbit/s \([\d.]+%\)  rtt [\d.]+ ms", out)


def test_asymmetric_pair_both_rates_at_once(testbed_factory):
    bed = testbed_factory(2)
    bed.cap(0, 1, "200mbit")
    bed.cap(1, 0, "1gbit")
    results = bed.check((0, 1), (1, 0), seconds=3, concurrent=True)
    show(results)
    by_pair = {(r["src"], r["dst"]): r for r in results}
    fwd, back = by_pair[(0, 1)], by_pair[(1, 0)]
    assert 0.85 <= fwd["rate_ratio"] <= 1.05, fwd
    assert 0.85 <= back["rate_ratio"] <= 1.05, back
    # Both transfers ran at the same time (their intervals overlap almost fully).
    overlap = min(fwd["end"], back["end"]) - max(fwd["start"], back["start"])
    assert overlap >= 0.8 * (fwd["end"] - fwd["start"]), (fwd["start"], fwd["end"], back["start"], back["end"])


def test_delay_rtt(testbed_factory):
    bed = testbed_factory(3)
    bed.delay(0, 1, 25, both=True)
    bed.delay(0, 2, 10)   # asymmetric one-way delays add up too
    bed.delay(2, 0, 40)
    results = bed.check((0, 1), (0, 2), rtt_only=True)
    show(results)
    for r in results:
        assert r["rtt_configured_ms"] == 50
        assert abs(r["rtt_ms"] - 50) <= 5, r
        assert r["rtt_min_ms"] >= 49.5, r  # really delayed, never early
        assert r["ok"]
    # A pair without delay stays fast.
    replies, rtt = ping(bed, 1, 2)
    assert replies == 5 and rtt < 5, rtt


def test_delay_change_has_no_gap(testbed_factory):
    """Changing a pair's delay hands it to a new delay program first: while a ping
    runs through the change, no packet is lost and none passes undelayed."""
    bed = testbed_factory(2)
    bed.delay(0, 1, 25, both=True)
    ping_proc = bed.popen(0, "ping", "-n", "-c", 150, "-i", "0.01", "-W", "2", bed.addr(1),
                          stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    bed.delay(0, 1, 40)
    out, _ = ping_proc.communicate(timeout=30)
    rtts = [float(x) for x in re.findall(r"time=([\d.]+) ms", out)]
    print(f"\n  ping through a delay change 25 -> 40 ms: {len(rtts)}/150 answered, "
          f"rtt {min(rtts):.2f}..{max(rtts):.2f} ms")
    assert len(rtts) == 150, out[-500:]
    assert min(rtts) >= 49.5
    assert abs(rtts[-1] - 65) <= 5  # the new delay: 40 + 25
    [d] = [d for d in bed.status()["delays"] if (d["src"], d["dst"]) == (0, 1)]
    assert d["ms"] == 40 and d["alive"]


def test_gigabit_with_delay(testbed_factory):
    """1 Gbit/s with 25+25 ms: the delay program must not be the bottleneck."""
    bed = testbed_factory(2)
    bed.cap(0, 1, "1gbit")
    bed.delay(0, 1, 25, both=True)
    [r] = bed.check((0, 1), seconds=4, streams=4)
    show([r])
    assert r["rate_ratio"] >= 0.85, r
    assert r["rate_ratio"] <= 1.05, r
    assert abs(r["rtt_ms"] - 50) <= 5, r
    stats = bed.status()
    assert all(d["alive"] for d in stats["delays"])


def test_delay_program_memory_is_bounded(testbed_factory):
    """At most --max-packets packets are held; the rest are dropped and counted."""
    bed = testbed_factory(2)
    bed.run("delay", 0, 1, 600, "--max-packets", 8)
    # 50 datagrams in 250 ms, all inside one 600 ms delay: 8 are held, 42 dropped.
    assert udp_delivered(bed, 0, 1, count=50, wait=2.0) == 8
    [st] = [json.loads(line) for line in bed.run("stats").stdout.splitlines()]
    print(f"\n  delay program counters: {st}")
    assert (st["src"], st["dst"]) == (0, 1)
    assert st["max_packets"] == 8 and st["max_held"] == 8
    assert st["received"] == 50 and st["released"] == 8 and st["dropped_full"] == 42
    assert st["kernel_queue_dropped"] == 0 and st["kernel_user_dropped"] == 0


# --- failures ----------------------------------------------------------------------

def test_delay_program_killed_fails_closed(testbed_factory):
    bed = testbed_factory(3)
    bed.delay(0, 1, 25, both=True)
    bed.delay(2, 1, 5)
    replies, rtt = ping(bed, 0, 1)
    assert replies == 5 and rtt >= 49.5, rtt
    assert udp_delivered(bed, 0, 1) == 20

    [prog] = [d for d in bed.status()["delays"] if (d["src"], d["dst"]) == (0, 1)]
    os.kill(prog["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{prog['pid']}") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(f"/proc/{prog['pid']}")

    # 0->1 is dropped, not passed on undelayed; the other pairs are untouched.
    assert udp_delivered(bed, 0, 1) == 0
    assert ping(bed, 0, 1)[0] == 0
    assert not tcp_connects(bed, 0, 1)
    assert udp_delivered(bed, 1, 0) == 20
    assert udp_delivered(bed, 2, 1) == 20
    [dead] = [d for d in bed.status()["delays"] if (d["src"], d["dst"]) == (0, 1)]
    assert not dead["alive"]
    assert "DEAD" in bed.run("status").stdout

    # Setting the delay again restores the pair.
    bed.delay(0, 1, 25)
    replies, rtt = ping(bed, 0, 1)
    assert replies == 5 and abs(rtt - 50) <= 5, rtt


def test_nat_hides_a_host(testbed_factory):
    """A host behind a NAT reaches the others, which see its connections come from its
    address; nothing reaches it, neither from an open host nor from another NAT's host;
    caps still apply to its traffic."""
    bed = testbed_factory(3)
    bed.nat(1)
    bed.nat(2)
    assert json.loads(bed.run("status", "--json").stdout)["nats"] == [1, 2]
    srv = bed.popen(0, PY, "-c",
                    "import socket;s=socket.create_server(('0.0.0.0',40001));print('ready',flush=True);"
                    "c,a=s.accept();print(a[0],flush=True)", stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "ready"
        assert bed.exec(1, PY, "-c", TCP_CONNECT, bed.addr(0), 40001, 1.5).stdout.startswith("connected")
        assert srv.stdout.readline().strip() == bed.addr(1)  # the NAT's address, not 192.168.0.2
    finally:
        srv.kill()
        srv.wait()
    assert bed.exec(1, "ip", "-4", "-brief", "addr").stdout.count("192.168.0.2/30") == 1
    assert not tcp_connects(bed, 0, 1)
    assert not tcp_connects(bed, 1, 2)
    assert tcp_connects(bed, 2, 0)
    # The machine behind the NAT sends at host 1's cap (measured from inside it).
    bed.cap(1, 0, "20mbit")
    srv = bed.popen(0, "iperf3", "-s", "-1", "-p", 40010, stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = bed.exec(1, "iperf3", "-c", bed.addr(0), "-p", 40010, "-t", 2, "-J").stdout
        rate = json.loads(out)["end"]["sum_received"]["bits_per_second"]
        assert 0.85 * 20e6 * 0.956 <= rate <= 1.05 * 20e6, rate
    finally:
        srv.kill()
        srv.wait()
    with pytest.raises(TestbedError, match="already"):
        bed.nat(1)


def test_ipv6_caps_delays_and_cuts(testbed_factory):
    """A bed made with ipv6=True: every host also has an IPv6 address, and caps, delays
    and cuts apply to IPv6 as to IPv4 (one delay program per pair serves both)."""
    bed = testbed_factory(3, ipv6=True)
    a1 = bed.addr6(1)
    assert a1.startswith("fd00:") and a1.endswith("::2"), a1
    assert json.loads(bed.run("status", "--json").stdout)["ipv6"]
    bed.delay(0, 1, 15, both=True)
    out = bed.exec(0, "ping", "-6", "-n", "-q", "-c", 5, "-i", "0.05", "-W", 2, a1).stdout
    rtt = float(re.search(r"= [\d.]+/([\d.]+)/", out).group(1))
    assert 29 <= rtt <= 36, out
    bed.cap(2, 0, "30mbit")
    srv = bed.popen(0, "iperf3", "-s", "-1", "-p", 40011, stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = bed.exec(2, "iperf3", "-6", "-c", bed.addr6(0), "-p", 40011, "-t", 2, "-J").stdout
        rate = json.loads(out)["end"]["sum_received"]["bits_per_second"]
        assert 0.85 * 30e6 * 0.95 <= rate <= 1.05 * 30e6, rate
    finally:
        srv.kill()
        srv.wait()
    bed.cut(0, 2, both=True)
    out = bed.exec(0, "ping", "-6", "-n", "-q", "-c", 2, "-W", 1, bed.addr6(2), check=False).stdout
    assert " 0 received" in out, out
    bed.heal()
    out = bed.exec(0, "ping", "-6", "-n", "-q", "-c", 2, "-W", 1, bed.addr6(2), check=False).stdout
    assert " 2 received" in out, out
    with pytest.raises(TestbedError, match="no IPv6"):
        testbed_factory(1).addr6(0)


def test_partition_and_heal(testbed_factory):
    bed = testbed_factory(3)
    assert udp_delivered(bed, 0, 1) == 20 and udp_delivered(bed, 1, 0) == 20

    bed.cut(0, 1)  # one direction only
    assert udp_delivered(bed, 0, 1) == 0
    assert udp_delivered(bed, 1, 0) == 20
    bed.cut(1, 0)  # now both ways
    assert udp_delivered(bed, 0, 1) == 0
    assert udp_delivered(bed, 1, 0) == 0
    assert ping(bed, 0, 1)[0] == 0 and ping(bed, 1, 0)[0] == 0
    assert not tcp_connects(bed, 0, 1) and not tcp_connects(bed, 1, 0)
    # Host 2 still reaches both sides.
    assert udp_delivered(bed, 2, 0) == 20 and udp_delivered(bed, 1, 2) == 20
    [r] = bed.check((0, 1), rtt_only=True)
    assert r["cut"] and r["ping_received"] == 0 and r["ok"]

    bed.heal()
    assert udp_delivered(bed, 0, 1) == 20 and udp_delivered(bed, 1, 0) == 20
    assert ping(bed, 0, 1)[0] == 5
    assert tcp_connects(bed, 0, 1) and tcp_connects(bed, 1, 0)

    # --both cuts and heals a pair both ways.
    bed.cut(0, 2, both=True)
    assert udp_delivered(bed, 0, 2) == 0 and udp_delivered(bed, 2, 0) == 0
    bed.heal(2, 0, both=True)
    assert udp_delivered(bed, 0, 2) == 20 and udp_delivered(bed, 2, 0) == 20


# --- loss, jitter, shared bottlenecks ---------------------------------------------------

UDPPROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support", "udpprobe.py")


def udp_probe(bed: Testbed, src: int, dst: int, count: int, pps: int, port: int = 40100,
              idle: float = 1.0) -> dict:
    """Sends `count` numbered datagrams src->dst at `pps`; what dst saw (udpprobe.py)."""
    rx = bed.popen(dst, PY, UDPPROBE, "recv", port, count, "--idle", idle, "--deadline", 60,
                   stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready"
        bed.exec(src, PY, UDPPROBE, "send", bed.addr(dst), port, count, "--pps", pps, timeout=120)
        out, _ = rx.communicate(timeout=90)
        return json.loads(out.strip().splitlines()[-1])
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()


def pair_stats(bed: Testbed, src: int, dst: int) -> dict:
    [st] = [s for s in (json.loads(line) for line in bed.run("stats").stdout.splitlines())
            if (s.get("src"), s.get("dst")) == (src, dst)]
    return st


def test_loss_rate_counts_wire_packets(testbed_factory):
    """loss drops each wire packet with the set probability: 5% of 20,000 datagrams is
    measured within 20% of 5% at the receiver and by the program's counter; a TCP
    transfer through a lossy pair reaches the delay program as MTU-sized packets, not
    64 KB offload bundles; the other direction is untouched; unloss restores the pair."""
    bed = testbed_factory(2)
    bed.run("loss", 0, 1, "5%")
    [d] = bed.status()["delays"]
    assert (d["src"], d["dst"], d["loss"], d["ms"]) == (0, 1, 0.05, 0.0), d
    r = udp_probe(bed, 0, 1, 20000, 20000)
    st = pair_stats(bed, 0, 1)
    print(f"\n  loss 5% over 20,000 datagrams: {r['lost']} lost ({100 * r['loss']:.2f}%); "
          f"dropped_loss {st['dropped_loss']} of {st['received']}")
    assert 0.04 <= r["loss"] <= 0.06, r
    assert 0.04 <= st["dropped_loss"] / st["received"] <= 0.06, st
    # What the program dropped never arrived; little else was lost (an idle machine
    # loses nothing else: the counts were equal in every run there).
    assert 0 <= r["lost"] - st["dropped_loss"] <= 200, (r, st)
    assert st["segmented"] and st["dropped_full"] == 0, st
    assert udp_delivered(bed, 1, 0) == 20  # one direction only

    # TCP: 8 MiB in 64 KiB writes; the kernel hands the program every wire packet.
    bed.run("loss", 0, 1, "0.001")
    srv = bed.popen(1, PY, "-c", TCP_SINK, 40200, stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "ready"
        bed.exec(0, PY, "-c", TCP_SOURCE, bed.addr(1), 40200, 8 << 20, timeout=60)
        out, _ = srv.communicate(timeout=60)
        assert int(out.strip()) == 8 << 20, out
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    st = pair_stats(bed, 0, 1)
    packets = st["received"]
    print(f"  8 MiB over TCP with loss 0.1%: {packets} packets seen, {st['dropped_loss']} dropped")
    assert packets >= (8 << 20) // 1500, st  # at most one MTU each
    bed.run("unloss")
    assert bed.status()["delays"] == []
    assert udp_delivered(bed, 0, 1) == 20


def test_jitter_bounded_in_order_and_reordering(testbed_factory):
    """jitter adds 0..J ms to each packet: without --reorder every datagram arrives
    within [delay, delay + J] and in sending order; with --reorder later datagrams
    overtake earlier ones, still within the bound. The bound is checked exactly on the
    delay program's counter (the extra delay it gave) and, at the receiver, on the 99th
    percentile with room for a busy machine's scheduling (SLACK_MS): a receiver stalled
    once for 100 ms delays every datagram that arrived meanwhile."""
    SLACK_MS = 15
    bed = testbed_factory(2)
    bed.delay(0, 1, 10)
    bed.run("jitter", 0, 1, 10)
    r = udp_probe(bed, 0, 1, 2000, 2000, idle=0.5)
    st = pair_stats(bed, 0, 1)
    print(f"\n  delay 10 ms, jitter 10 ms, in order: {r}\n  counters: jittered {st['jittered']}, "
          f"reordered {st['reordered']}, max_extra_us {st['max_extra_us']}")
    assert r["received"] == 2000 and r["out_of_order"] == 0, r
    assert r["delay_min_ms"] >= 9.9 and r["delay_p99_ms"] <= 10 + 10 + SLACK_MS, r
    assert r["delay_p99_ms"] - r["delay_min_ms"] >= 5, r  # the jitter is there
    assert st["jittered"] > 1000 and st["reordered"] == 0 and not st["reorder"], st
    assert st["max_extra_us"] <= 10_000, st

    bed.run("jitter", 0, 1, 10, "--reorder")
    [d] = bed.status()["delays"]
    assert d["reorder"] and d["jitter_ms"] == 10 and d["ms"] == 10, d
    r = udp_probe(bed, 0, 1, 2000, 2000, idle=0.5, port=40101)
    st = pair_stats(bed, 0, 1)
    print(f"  with --reorder: {r}\n  counters: reordered {st['reordered']}")
    assert r["received"] == 2000 and r["out_of_order"] >= 200, r
    assert r["delay_min_ms"] >= 9.9 and r["delay_p99_ms"] <= 10 + 10 + SLACK_MS, r
    assert st["reorder"] and st["reordered"] >= 200 and st["max_extra_us"] <= 10_000, st

    bed.run("unjitter")
    [d] = bed.status()["delays"]
    assert d["jitter_ms"] == 0 and d["ms"] == 10, d
    r = udp_probe(bed, 0, 1, 500, 2000, idle=0.5, port=40102)
    st = pair_stats(bed, 0, 1)
    assert r["received"] == 500 and r["out_of_order"] == 0 and r["delay_min_ms"] >= 9.9, r
    assert st["jitter_ms"] == 0 and st["jittered"] == 0 and st["released"] == 500, st


def test_bottleneck_caps_the_sum(testbed_factory):
    """An egress bottleneck caps what a host sends to all others together (with --fq in
    equal shares), an ingress bottleneck what it receives from all others; a pair that
    does not cross the bottleneck is not slowed."""
    bed = testbed_factory(3)
    bed.run("bottleneck", 0, "egress", "100mbit", "--fq")
    # The two transfers run at once, but their measuring windows do not coincide (each
    # waits for its own server): the sum may pass the bottleneck by that much. A
    # bottleneck per pair instead of shared would give twice its rate, none 40 Gbit/s.
    results = bed.check((0, 1), (0, 2), seconds=3, concurrent=True)
    show(results)
    total = sum(r["measured_bps"] for r in results)
    print(f"\n  egress bottleneck 100 Mbit/s with --fq, two pairs at once: {total / 1e6:.1f} Mbit/s in all")
    assert 0.75e8 <= total <= 1.3e8, total
    [eg] = [json.loads(line) for line in bed.run("stats").stdout.splitlines()]
    # Four flows each, in per-flow fair shares: about half each (a FIFO gave 8% to one).
    # Once in many runs one pair got 12% (not reproduced in 8 runs after it): the message
    # carries the windows and the buckets' counters to tell which was to blame.
    windows = [(r["src"], r["dst"], r["measured_bps"], r["start"], r["end"]) for r in results]
    assert all(r["measured_bps"] >= 0.25 * total for r in results), f"{windows} {json.dumps(eg)}"
    assert (eg["host"], eg["bottleneck"], eg["bps"], eg["fq"]) == (0, "egress", 100_000_000, "fq"), eg
    assert eg["sent_bytes"] >= 0.8 * total / 8 * 3, eg
    # Eight data flows (and two control connections) hashed into 16 buckets: a broken
    # hash puts them all in one, which the shares above may not show (a FIFO is often
    # fair to equal flows).
    assert eg["fq_buckets_busy"] >= 3, eg

    bed.run("unbottleneck", 0)
    bed.run("bottleneck", 2, "ingress", "60mbit")
    results = bed.check((0, 2), (1, 2), seconds=3, concurrent=True)
    show(results)
    total = sum(r["measured_bps"] for r in results)
    print(f"  ingress bottleneck 60 Mbit/s, two pairs at once: {total / 1e6:.1f} Mbit/s in all")
    assert 0.75 * 60e6 <= total <= 1.3 * 60e6, total
    [r] = bed.check((1, 0), seconds=1)  # not through the bottleneck
    assert r["measured_bps"] >= 200e6, r
    [ing] = [json.loads(line) for line in bed.run("stats").stdout.splitlines()]
    assert (ing["host"], ing["bottleneck"]) == (2, "ingress") and ing["sent_bytes"] > 0, ing
    assert bed.status()["bottlenecks"] == [{"host": 2, "direction": "ingress", "bps": 60_000_000,
                                            "queue_bytes": 375000, "fq": "none"}]
