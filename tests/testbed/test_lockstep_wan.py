"""lockstep on the WAN test bed: real peers on capped links.

The rates are the ones the caps impose, checked within a wide band (the figures live in
BENCHMARKS.md, from scripts/bench-wan-sync.py). Needs root; $LOCKSTEP_BIN_DIR names the
directory with lockstep-master and lockstep-testpeer.
"""

from __future__ import annotations

import os
import select
import subprocess
import time

from lockstep_peers import TestPeer, admit, start_master
from testbed import TCP_CONNECT

BIN = os.environ.get("LOCKSTEP_BIN_DIR", "")


def test_sync_spreads_over_every_holder(testbed_factory):
    """A newcomer on host 0 receives 64 MiB of shared state from three holders whose links
    to it are capped at 100 Mbit/s each: spread over the three it gets about 300 Mbit/s,
    which no single holder could give it."""
    assert BIN, "set LOCKSTEP_BIN_DIR"
    bed = testbed_factory(4)
    cap_mbit = 100
    for h in (1, 2, 3):
        bed.cap(h, 0, f"{cap_mbit}mbit")
    master = start_master(bed, BIN, 0)
    peers = []
    try:
        address = f"{bed.addr(0)}:7000"
        holders = [TestPeer(bed, BIN, h, address, f"h{h}") for h in (1, 2, 3)]
        newcomer = TestPeer(bed, BIN, 0, address, "n")
        peers = holders + [newcomer]
        size = 64 << 20
        for p in peers:
            p.call(f"tensor weights {size}")
        for p in holders:
            p.call("fill weights 7")
        admit([], holders + [newcomer])
        for p in holders:
            p.call("revision 1")
        for p in holders:
            p.send("sync popular")
        newcomer.send("sync receive")
        got = newcomer.reply(120)
        served = [p.reply(120) for p in holders]
        assert got["code"] == 0 and "hashes" in got, got
        assert all(s["code"] == 0 for s in served), served
        assert got["hashes"] == served[0]["hashes"]
        assert got["bytes_received"] == size
        mbit = size * 8 / (got["ms"] / 1e3) / 1e6
        sent = [s["bytes_sent"] for s in served]
        print(f"\n  64 MiB from 3 holders capped at {cap_mbit} Mbit/s each: {got['ms']:.0f} ms, "
              f"{mbit:.0f} Mbit/s; bytes per holder {sent}")
        assert all(s > size // 6 for s in sent), sent
        # Three links of 100 Mbit/s: TCP payload reaches about 95% of each cap.
        assert 0.6 * 3 * cap_mbit <= mbit <= 1.05 * 3 * cap_mbit, mbit
    finally:
        for p in peers:
            p.close()
        master.kill()
        master.wait(timeout=10)


def test_compressible_state_beats_the_cap_and_random_state_keeps_it(testbed_factory):
    """A newcomer receives 64 MiB of shared state over one 100 Mbit/s link: compressible
    content (f32 values of 16 kinds, about 4.6:1 under zstd) travels compressed, so the
    tensor bytes arrive at well over the cap; random content is sent raw, at the cap."""
    assert BIN, "set LOCKSTEP_BIN_DIR"
    bed = testbed_factory(2)
    cap_mbit = 100
    bed.cap(1, 0, f"{cap_mbit}mbit")
    master = start_master(bed, BIN, 0)
    peers = []
    try:
        address = f"{bed.addr(0)}:7000"
        holder = TestPeer(bed, BIN, 1, address, "h")
        newcomer = TestPeer(bed, BIN, 0, address, "n")
        peers = [holder, newcomer]
        size = 64 << 20
        admit([], peers)
        rates = {}
        for revision, content in enumerate(("compressible", "random"), start=1):
            for p in peers:
                p.call(f"tensor {content} {size}")
            holder.call(f"fill {content} 7" + (" compressible" if content == "compressible" else ""))
            holder.call(f"revision {revision}")
            holder.send("sync popular")
            newcomer.send("sync receive")
            got, served = newcomer.reply(120), holder.reply(120)
            assert got["code"] == 0 and served["code"] == 0, (got, served)
            assert got["hashes"] == served["hashes"]
            assert got["bytes_received"] == size and got["wire_bytes_received"] == served["wire_bytes_sent"]
            rates[content] = size * 8 / (got["ms"] / 1e3) / 1e6
            print(f"\n  64 MiB {content} over {cap_mbit} Mbit/s: {got['ms']:.0f} ms, {rates[content]:.0f} Mbit/s of "
                  f"tensor bytes, {got['wire_bytes_received']} bytes on the wire")
            if content == "compressible":
                assert got["wire_bytes_received"] < size // 3, got
            else:
                assert got["wire_bytes_received"] <= size * 1.01, got
        assert rates["compressible"] >= 2 * cap_mbit, rates
        assert 0.6 * cap_mbit <= rates["random"] <= 1.05 * cap_mbit, rates
    finally:
        for p in peers:
            p.close()
        master.kill()
        master.wait(timeout=10)


def allreduce_ms(peers: list[TestPeer], count: int, tag: int) -> float:
    """One f32 sum all-reduce of `count` elements on every peer; the slowest peer's time."""
    for i, p in enumerate(peers):
        p.send(f"allreduce {count} {tag} {i + 1} inplace")
    replies = [p.reply(300) for p in peers]
    assert all(r["code"] == 0 for r in replies), replies
    assert all(r["value"] == sum(range(1, len(peers) + 1)) for r in replies), replies
    return max(r["ms"] for r in replies)


def test_optimize_finds_the_fast_ring(testbed_factory):
    """Four hosts where the join-order ring 0-1-2-3 crosses 50 Mbit/s links and only the
    ring 0->2->1->3->0 is 200 Mbit/s everywhere: after optimize every peer uses that ring,
    and the all-reduce is faster by at least 70% of the predicted factor of 4."""
    assert BIN, "set LOCKSTEP_BIN_DIR"
    bed = testbed_factory(4)
    fast = {(0, 2), (2, 1), (1, 3), (3, 0)}
    for a in range(4):
        for b in range(4):
            if a != b:
                bed.cap(a, b, "200mbit" if (a, b) in fast else "50mbit")
    master = start_master(bed, BIN, 0)
    peers: list[TestPeer] = []
    try:
        address = f"{bed.addr(0)}:7000"
        peers = [TestPeer(bed, BIN, h, address, f"p{h}") for h in range(4)]
        members: list[TestPeer] = []
        for p in peers:  # one at a time: the join order is the host order
            admit(members, [p])
        views = [p.call("view") for p in peers]
        ids = [v["id"] for v in views]
        assert [m["id"] for m in views[0]["view"]] == ids, "join order is the ring before optimizing"
        count = 2 << 20  # f32: 8 MiB
        before = allreduce_ms(peers, count, 1)
        for p in peers:
            p.send("optimize")
        optimized = [p.reply(120) for p in peers]
        assert all(r["code"] == 0 for r in optimized), optimized
        ring = [m["id"] for m in optimized[0]["view"]]
        assert all([m["id"] for m in r["view"]] == ring for r in optimized)
        assert ring == [ids[0], ids[2], ids[1], ids[3]], ring
        after = allreduce_ms(peers, count, 2)
        speedup = before / after
        print(f"\n  optimize took {optimized[0]['ms']:.0f} ms; 8 MiB all-reduce {before:.0f} ms in join order, "
              f"{after:.0f} ms after: {speedup:.2f}x (predicted 4x)")
        assert optimized[0]["ms"] < 10_000
        assert speedup >= 0.7 * 4, speedup
    finally:
        for p in peers:
            p.close()
        master.kill()
        master.wait(timeout=10)


def test_allreduce_through_loss(testbed_factory):
    """0.1% random loss each way (and 5 + 5 ms): all-reduces complete with the right sums
    on both peers, and the loss really hit their packets."""
    assert BIN, "set LOCKSTEP_BIN_DIR"
    bed = testbed_factory(2)
    bed.cap(0, 1, "200mbit", both=True)
    bed.delay(0, 1, 5, both=True)
    bed.loss(0, 1, 0.001, both=True)
    master = start_master(bed, BIN, 0)
    peers: list[TestPeer] = []
    try:
        address = f"{bed.addr(0)}:7000"
        peers = [TestPeer(bed, BIN, h, address, f"p{h}") for h in range(2)]
        admit([], peers)
        count = 4 << 20  # f32: 16 MiB
        times = [allreduce_ms(peers, count, tag) for tag in (1, 2, 3)]
        stats = {(s["src"], s["dst"]): s for s in bed.stats() if "src" in s}
        dropped = [stats[(0, 1)]["dropped_loss"], stats[(1, 0)]["dropped_loss"]]
        print(f"\n  16 MiB all-reduce through 0.1% loss, 10 ms round trip: {[round(t) for t in times]} ms; "
              f"packets dropped 0->1 {dropped[0]} of {stats[(0, 1)]['received']}, "
              f"1->0 {dropped[1]} of {stats[(1, 0)]['received']}")
        # 3 x 16 MiB each way is about 35,000 wire packets per direction: about 35 lost.
        assert dropped[0] >= 5 and dropped[1] >= 5, stats
    finally:
        for p in peers:
            p.close()
        master.kill()
        master.wait(timeout=10)



def reduce_and_optimize(members: list[TestPeer], hidden: int = 1) -> None:
    """All-reduces, an optimize that measures every pair it can (`hidden` of the peers
    accept no connection: their view entries name no port), and an all-reduce on the new
    ring."""
    for tag in (1, 2):
        allreduce_ms(members, 1 << 20, tag)
    for p in members:
        p.send("optimize")
    optimized = [p.reply(120) for p in members]
    assert all(r["code"] == 0 for r in optimized), optimized
    view = optimized[0]["view"]
    assert sorted(m["port"] == 0 for m in view) == [False] * (len(view) - hidden) + [True] * hidden, view
    allreduce_ms(members, 1 << 20, 3)


def sync_to_hidden_newcomer(members: list[TestPeer], peers: list[TestPeer], size: int, revision: int) -> list[dict]:
    """The last of `peers`, a newcomer that accepts no connection, is admitted and
    receives the state of the three others at `revision`; then an all-reduce and an
    update: of the four, the two that accept no connection are never neighbours. Returns
    what the three holders reported."""
    newcomer = peers[-1]
    newcomer.call(f"tensor weights {size}")
    admit(members, [newcomer])
    for p in peers[:3]:
        p.call(f"revision {revision}")
        p.send("sync popular")
    newcomer.send("sync receive")
    got = newcomer.reply(120)
    served = [p.reply(120) for p in peers[:3]]
    assert got["code"] == 0 and all(s["code"] == 0 for s in served), (got, served)
    assert got["hashes"] == served[0]["hashes"] and got["bytes_received"] == size
    allreduce_ms(members, 1 << 20, 4)
    ring = update_view(members)
    assert sum(m["port"] == 0 for m in ring) == 2, ring
    for k in range(len(ring)):
        assert ring[k]["port"] != 0 or ring[(k + 1) % len(ring)]["port"] != 0, ring
    return served


def reduce_until_done(survivors: list[TestPeer], want: int) -> None:
    """After a loss: all-reduces of the survivors (peer i contributes i + 1), each one's
    attempt failing for all alike until the ring has re-formed, until one completes; its
    value must be `want`."""
    for tag in range(6, 16):
        for i, p in enumerate(survivors):
            p.send(f"allreduce {1 << 20} {tag} {i + 1} inplace")
        replies = [p.reply(120) for p in survivors]
        if all(r["code"] == 0 for r in replies):
            assert all(r["value"] == want for r in replies), replies
            return
    raise AssertionError(f"the survivors never completed an all-reduce: {replies}")


def update_view(members: list[TestPeer]) -> list[dict]:
    """An update topology on every member; the membership view it ends with."""
    for p in members:
        p.send("update")
    views = [p.reply(60) for p in members]
    assert all(v["code"] == 0 for v in views), views
    return views[0]["view"]


def test_peers_behind_a_firewall_dial_their_neighbours(testbed_factory):
    """Hosts 2 and 3 drop every inbound TCP connection, as a NAT without port forwarding
    does. The peer of host 2 says so (--no-inbound); the master finds it out for the
    newcomer of host 3 (its connection to the newcomer's port gets no answer). They run
    with the reachable peers of hosts 0 and 1: every ring edge is dialled by a side that
    can reach the other (reversed where the receiver is behind the firewall), and
    all-reduces, an optimize, and a shared-state sync to the newcomer all succeed."""
    assert BIN, "set LOCKSTEP_BIN_DIR"
    bed = testbed_factory(4)
    for h in (2, 3):
        bed.exec(h, "iptables", "-w", "-A", "INPUT", "-p", "tcp", "--syn", "-j", "DROP")
    # The firewall holds: host 0 cannot open a connection to host 2 (the master's port
    # on host 0 stays reachable from everywhere).
    probe = bed.popen(2, "/usr/bin/python3", "-c",
                      "import socket,time;s=socket.create_server(('0.0.0.0',40001));print('ready',flush=True);"
                      "time.sleep(30)", stdout=subprocess.PIPE, text=True)
    try:
        assert probe.stdout.readline().strip() == "ready"
        assert bed.exec(0, "/usr/bin/python3", "-c", TCP_CONNECT, bed.addr(2), 40001, 1.5).stdout.startswith("failed")
    finally:
        probe.kill()
        probe.wait()
    master = start_master(bed, BIN, 0)
    peers: list[TestPeer] = []
    try:
        address = f"{bed.addr(0)}:7000"
        peers = [TestPeer(bed, BIN, 0, address, "r0"), TestPeer(bed, BIN, 1, address, "r1"),
                 TestPeer(bed, BIN, 2, address, "f2", ("--no-inbound", "--pool", "2"))]
        size = 8 << 20
        for p in peers:
            p.call(f"tensor weights {size}")
            p.call("fill weights 7")
        members: list[TestPeer] = []
        admit(members, peers)
        reduce_and_optimize(members)

        # A newcomer behind the firewall, which listens as usual: the master's probe of
        # its port gets no answer, and it runs as one that accepts no connection. It
        # receives the state from the reachable holders.
        newcomer = TestPeer(bed, BIN, 3, address, "f3")
        peers.append(newcomer)
        served = sync_to_hidden_newcomer(members, peers, size, 1)
        assert served[2]["bytes_sent"] == 0, served  # the hidden holder is never dialled
    finally:
        for p in peers:
            p.close()
        master.kill()
        master.wait(timeout=10)


def test_peers_behind_two_nats(testbed_factory):
    """Hosts 2 and 3 sit behind NATs of their own (MASQUERADE, no port forwarding): their
    peers listen as usual and name their ports, the master's probe of those ports at the
    NATs' addresses gets no answer, and they run as peers that accept no connection. With
    the peers of the open hosts 0 and 1: all-reduces, an optimize, a shared-state sync in
    which the peer behind a NAT serves a receiver through its NAT (it dials out), and a
    newcomer behind the other NAT that receives the state; the two never become ring
    neighbours (their edge would need a relay)."""
    assert BIN, "set LOCKSTEP_BIN_DIR"
    bed = testbed_factory(4)
    for h in (2, 3):
        bed.nat(h)
    master = start_master(bed, BIN, 0)
    peers: list[TestPeer] = []
    try:
        address = f"{bed.addr(0)}:7000"
        peers = [TestPeer(bed, BIN, 0, address, "r0"), TestPeer(bed, BIN, 2, address, "n2", ("--pool", "2")),
                 TestPeer(bed, BIN, 1, address, "r1")]
        size = 32 << 20  # two connections from a source
        for p in peers:
            p.call(f"tensor weights {size}")
        for p in peers[:2]:
            p.call("fill weights 7")
        members: list[TestPeer] = []
        admit(members, peers)
        reduce_and_optimize(members)

        # r0 and n2 hold the state, r1 receives it from both: n2 dials r1 through its NAT.
        for p in peers[:2]:
            p.call("revision 1")
            p.send("sync popular")
        peers[2].send("sync receive")
        served = [p.reply(120) for p in peers[:2]]
        got = peers[2].reply(120)
        assert got["code"] == 0 and all(s["code"] == 0 for s in served), (got, served)
        assert got["hashes"] == served[0]["hashes"] and got["bytes_received"] == size
        assert served[1]["bytes_sent"] > 0 and served[0]["bytes_sent"] > 0, served

        # A newcomer behind the other NAT receives the state from the open holders.
        newcomer = TestPeer(bed, BIN, 3, address, "n3")
        peers.append(newcomer)
        served = sync_to_hidden_newcomer(members, peers, size, 2)
        assert served[1]["bytes_sent"] == 0, served  # n2 and n3 cannot reach each other
    finally:
        for p in peers:
            p.close()
        master.kill()
        master.wait(timeout=10)


def open_and_two_nat_peers(bed, address: str, keyed: tuple, peers: list[TestPeer]) -> list[TestPeer]:
    """The peers of the open host 3 and of the NAT hosts 1 and 2 (appended to `peers`, for
    the caller to close), admitted under the run secret: the two NAT peers' edge is
    relayed; all-reduces and an optimize. Returns the members, in ring order."""
    peers += [TestPeer(bed, BIN, 3, address, "r3", keyed), TestPeer(bed, BIN, 1, address, "n1", keyed),
              TestPeer(bed, BIN, 2, address, "n2", keyed)]
    members: list[TestPeer] = []
    admit(members, list(peers))
    view = update_view(members)
    assert [m["port"] == 0 for m in view] == [False, True, True], view
    reduce_and_optimize(members, hidden=2)
    return members


def test_peers_behind_two_nats_meet_through_the_relay(testbed_factory, tmp_path):
    """Hosts 1 and 2 sit behind NATs of their own; the master on host 0 runs a relay
    (--relay-port, under a run secret). With the peer of the open host 3 there is no ring
    in which the two NAT peers are apart: their edge runs through the relay. All-reduces,
    an optimize, a third NAT peer (which a run without a relay would reject for want of
    room), and a relayed peer killed mid-all-reduce: one outcome for the survivors, then
    the ring re-forms (its two NAT neighbours meet through the relay) and goes on."""
    assert BIN, "set LOCKSTEP_BIN_DIR"
    bed = testbed_factory(4)
    for h in (1, 2):
        bed.nat(h)
    secret = tmp_path / "secret"
    secret.write_text("a run secret of the relayed bed test\n")
    secret.chmod(0o600)
    master = start_master(bed, BIN, 0, "--secret-file", str(secret), "--relay-port", "7001")
    peers: list[TestPeer] = []
    try:
        address = f"{bed.addr(0)}:7000"
        keyed = ("--secret-file", str(secret))
        members = open_and_two_nat_peers(bed, address, keyed, peers)

        late = TestPeer(bed, BIN, 1, address, "n1b", keyed)  # behind the first NAT too
        peers.append(late)
        admit(members, [late])
        view = update_view(members)
        assert sum(m["port"] == 0 for m in view) == 3, view
        allreduce_ms(members, 1 << 20, 4)

        # n2 dies while an all-reduce runs: the survivors all get the same outcome.
        victim = next(p for p in members if p.name == "n2")
        survivors = [p for p in members if p is not victim]
        count = 16 << 20  # 64 MiB: it is still running when the kill lands
        for i, p in enumerate(members):
            p.send(f"allreduce {count} 5 {i + 1} inplace")
        time.sleep(0.3)
        victim.proc.kill()
        victim.proc.wait()
        outcomes = [p.reply(120) for p in survivors]
        assert len({o["code"] for o in outcomes}) == 1, outcomes
        # Then the ring re-forms without it and the all-reduces go on.
        reduce_until_done(survivors, 6)
        view = update_view(survivors)
        assert [m["port"] == 0 for m in view] == [False, True, True], view
        allreduce_ms(survivors, 1 << 20, 20)
    finally:
        for p in peers:
            p.close()
        master.kill()
        master.wait(timeout=10)


def test_a_relay_host_carries_the_nat_edges_and_its_death_parts_them(testbed_factory, tmp_path):
    """Hosts 1 and 2 sit behind NATs of their own; host 4 runs lockstep-relay (a dedicated
    relay host) for the master of host 0, which runs no relay itself. With the open host 3
    the two NAT peers' edge runs through host 4: all-reduces, an optimize (it measures
    that pair through the relay), a newcomer behind the first NAT that receives the shared
    state; then the relay host's process is killed mid-all-reduce: the survivors get one
    outcome, the NAT peers that only the relay could join leave (KICKED, the later of
    each pair), and the ring re-forms without relayed edges."""
    assert BIN, "set LOCKSTEP_BIN_DIR"
    bed = testbed_factory(5)
    for h in (1, 2):
        bed.nat(h)
    secret = tmp_path / "secret"
    secret.write_text("a run secret of the relay host bed test\n")
    secret.chmod(0o600)
    master = start_master(bed, BIN, 0, "--secret-file", str(secret))
    relay = bed.popen(4, os.path.join(BIN, "lockstep-relay"), "--master", f"{bed.addr(0)}:7000", "--secret-file",
                      str(secret), "--listen", f"{bed.addr(4)}:7002", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                      text=True)
    peers: list[TestPeer] = []
    try:
        for word in ("listening", "registered"):
            ready, _, _ = select.select([relay.stdout], [], [], 10)
            assert ready and word in relay.stdout.readline()
        address = f"{bed.addr(0)}:7000"
        keyed = ("--secret-file", str(secret))
        members = open_and_two_nat_peers(bed, address, keyed, peers)

        size = 4 << 20
        newcomer = TestPeer(bed, BIN, 1, address, "n1b", keyed)  # behind the first NAT too
        peers.append(newcomer)
        for p in peers:
            p.call(f"tensor weights {size}")
        for p in members:
            p.call("fill weights 5")
        admit(members, [newcomer])
        holders = [p for p in members if p is not newcomer]
        for p in holders:
            p.call("revision 1")
            p.send("sync popular")
        newcomer.send("sync receive")
        got = newcomer.reply(120)
        served = [p.reply(120) for p in holders]
        assert got["code"] == 0 and all(s["code"] == 0 for s in served), (got, served)
        assert got["hashes"] == served[0]["hashes"] and got["bytes_received"] == size
        view = update_view(members)
        assert sum(m["port"] == 0 for m in view) == 3, view

        # The relay dies while an all-reduce runs.
        count = 16 << 20  # 64 MiB: it is still running when the kill lands
        for i, p in enumerate(members):
            p.send(f"allreduce {count} 5 {i + 1} inplace")
        time.sleep(0.3)
        relay.kill()
        relay.wait()
        outcomes = {p.name: p.reply(120) for p in members}
        kicked = [p for p in members if outcomes[p.name]["code"] == 14]  # LOCKSTEP_STATUS_KICKED
        survivors = [p for p in members if p not in kicked]
        # Of the three NAT peers, the later of each neighbouring pair leaves: two (which
        # two depends on where the optimize put them), never the open host's.
        assert len(kicked) == 2 and "r3" not in [p.name for p in kicked], outcomes
        assert len({outcomes[p.name]["code"] for p in survivors}) == 1, outcomes
        reduce_until_done(survivors, 3)
        view = update_view(survivors)
        assert sorted(m["port"] == 0 for m in view) == [False, True], view
        allreduce_ms(survivors, 1 << 20, 20)
    finally:
        for p in peers:
            p.close()
        if relay.poll() is None:
            relay.kill()
        relay.wait(timeout=10)
        master.kill()
        master.wait(timeout=10)


def test_ipv6_only_run_then_a_mixed_run(testbed_factory):
    """On a bed with IPv6: a master on host 0's IPv6 address and peers that reach it over
    IPv6 only (the view names IPv6 addresses, every ring edge is IPv6) run all-reduces
    over delayed links and a shared-state sync; then a master on [::] (both families)
    and peers of both, one run whose ring edges join IPv4 and IPv6 peers."""
    assert BIN, "set LOCKSTEP_BIN_DIR"
    bed = testbed_factory(4, ipv6=True)
    for h in (1, 2, 3):
        bed.delay(0, h, 2, both=True)
    for listen, families in ((f"[{bed.addr6(0)}]:7000", ("6", "6", "6")), ("[::]:7001", ("4", "6", "4"))):
        master = bed.popen(0, os.path.join(BIN, "lockstep-master"), "--listen", listen,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert "listening" in master.stdout.readline()
        port = listen.rsplit(":", 1)[1]
        peers: list[TestPeer] = []
        try:
            for h, family in zip((1, 2, 3), families):
                address = f"[{bed.addr6(0)}]:{port}" if family == "6" else f"{bed.addr(0)}:{port}"
                peers.append(TestPeer(bed, BIN, h, address, f"p{h}"))
            size = 4 << 20
            for p in peers:
                p.call(f"tensor weights {size}")
            peers[0].call("fill weights 5")
            members: list[TestPeer] = []
            admit(members, peers)
            view = peers[0].call("view")["view"]
            hosts = {m["host"]: m for m in view}
            want = {bed.addr6(h) if f == "6" else bed.addr(h) for h, f in zip((1, 2, 3), families)}
            assert set(hosts) == want, view
            for tag in (1, 2):
                allreduce_ms(members, 1 << 18, tag)
            peers[0].call("revision 1")
            peers[0].send("sync popular")
            for p in peers[1:]:
                p.send("sync receive")
            replies = [p.reply(120) for p in peers]
            assert all(r["code"] == 0 for r in replies), replies
            assert all(r["hashes"] == replies[0]["hashes"] for r in replies), replies
            assert sum(r["bytes_received"] for r in replies) == 2 * size, replies
        finally:
            for p in peers:
                p.close()
            master.kill()
            master.wait(timeout=10)
