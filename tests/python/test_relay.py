"""The master's relay (relay_port; docs/deployment.md, "Relays"): a ring edge between two
peers that both accept no inbound connection runs through it, sealed end to end whatever
encrypt_data says; the relay forwards only for the pairs the master assigns and drops
strangers; without a run secret there is no relay."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import threading
import urllib.request

import numpy as np
import pytest

import lockstep
from conftest import Cluster
from observed_run import peer_name

COUNT = 256 * 1024  # float32: 1 MiB, over the ring, not with the votes
# 16 bytes that read as finite float32s; a contribution made of them shows on the wire of
# the first reduce-scatter step exactly as here, unless the connection is sealed.
MARKER = b"LKSTrelayMARKER!"


def marked() -> np.ndarray:
    return np.frombuffer(MARKER * (COUNT * 4 // len(MARKER)), dtype=np.float32).copy()


def write_secret(tmp_path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(b"0123456789abcdef0123456789abcdef")
    path.chmod(0o600)
    return str(path)


def metric(master: lockstep.Master, name: str) -> float:
    with urllib.request.urlopen(f"http://{master.http_address}/metrics", timeout=10) as response:
        text = response.read().decode("utf-8")
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


class Tap:
    """A TCP forwarder on 127.0.0.2 for the master's port and the relay's (same numbers, so
    that peers that reach the master through it reach the relay through it too); it keeps
    every byte that goes towards the relay."""

    def __init__(self, master_port: int, relay_port: int) -> None:
        self.relay_bytes = bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listeners = []
        self._sockets = []
        for port, record in ((master_port, False), (relay_port, True)):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.2", port))
            listener.listen(64)
            listener.settimeout(0.1)
            self._listeners.append(listener)
            threading.Thread(target=self._accept, args=(listener, port, record), daemon=True).start()

    def _accept(self, listener: socket.socket, port: int, record: bool) -> None:
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", port))
            self._sockets += [client, upstream]
            threading.Thread(target=self._copy, args=(client, upstream, record), daemon=True).start()
            threading.Thread(target=self._copy, args=(upstream, client, False), daemon=True).start()

    def _copy(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if record:
                    with self._lock:
                        self.relay_bytes += data
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        for s in self._listeners + self._sockets:
            s.close()


def test_a_relay_needs_a_run_secret():
    master = lockstep.Master("127.0.0.1:0", relay_port=0)
    with pytest.raises(lockstep.InvalidArgumentError, match="secret"):
        master.run()
    master.close()
    with pytest.raises(lockstep.InvalidArgumentError, match="relay_port"):
        lockstep.Master("127.0.0.1:0", relay_port=70000)


def test_two_peers_behind_nats_all_reduce_through_the_relay_sealed(tmp_path):
    """Both peers accept no inbound connection: without a relay the second would be
    rejected (no room); with it their two edges run through the relay. encrypt_data is
    off, yet no byte of the contributions crosses the relay in the clear."""
    secret = write_secret(tmp_path)
    master = lockstep.Master("127.0.0.1:0", secret_file=secret, relay_port=0, http="127.0.0.1:0")
    master.run()
    tap = Tap(master.port, master.relay_port)
    try:
        with Cluster(2, master=master, address=f"127.0.0.2:{master.port}", secret_file=secret, inbound=False,
                     encrypt_data=False) as c:
            views = c.run(lambda i, comm: comm.membership())
            assert [m.p2p_port for m in views[0]] == [0, 0]

            def work(i, comm):
                buf = marked()
                comm.all_reduce(buf, op="sum", tag=1)
                return buf

            for got in c.run(work):
                np.testing.assert_array_equal(got, marked() * 2)
            assert metric(master, "lockstep_relay_pairs_total") >= 2  # one per direction
            relayed = metric(master, "lockstep_relay_bytes_total")
            # Each peer sends half its contribution in the clear's size, and half the result.
            assert relayed >= 2 * COUNT * 4, relayed
            with tap._lock:
                seen = bytes(tap.relay_bytes)
            assert len(seen) >= COUNT * 4, len(seen)
            assert MARKER not in seen, "a contribution crossed the relay unsealed"
    finally:
        tap.close()
        master.close()


@pytest.fixture
def relayed(tmp_path):
    """Two reachable peers, then three that accept no inbound connection: one of the
    three has no reachable neighbour, so the ring has direct, reversed and relayed
    edges; two pool slots and four stripes where an edge can have them; shared state sent
    uncompressed (so that its bytes are what the test reads on the wire). The peers reach
    the master and its relay through a Tap (the cluster's `tap`)."""
    secret = write_secret(tmp_path)
    kwargs = {"secret_file": secret, "pool_size": 2, "p2p_streams": 4, "state_compression": "off"}
    master = lockstep.Master("127.0.0.1:0", secret_file=secret, relay_port=0, http="127.0.0.1:0")
    master.run()
    tap = Tap(master.port, master.relay_port)
    try:
        with Cluster(2, master=master, address=f"127.0.0.2:{master.port}", **kwargs) as c:
            for k in (2, 3, 4):
                c.add_peer(f"peer{k}", inbound=False, **kwargs)
            c.tap = tap
            yield c
    finally:
        tap.close()
        master.close()


def test_a_ring_of_direct_reversed_and_relayed_edges_does_every_collective(relayed):
    views = relayed.run(lambda i, comm: comm.membership())
    assert all(v == views[0] for v in views)
    ports = [m.p2p_port for m in views[0]]
    assert any(ports[r] == 0 and ports[(r + 1) % len(ports)] == 0 for r in range(len(ports))), ports
    n = len(ports)

    def contribution(rank):
        return (np.arange(COUNT, dtype=np.float32) % 97) * (rank + 1)

    def work(i, comm):
        rank = comm.rank
        out = {}
        buf = contribution(rank)
        comm.all_reduce(buf, op="sum", tag=1)
        out["sum"] = buf
        handles = [comm.all_reduce_async(contribution(rank) + k, op="max", tag=10 + k) for k in range(4)]
        out["max"] = [h.wait() and h.result for h in handles]
        b = contribution(rank) if rank == n - 1 else np.zeros(COUNT, dtype=np.float32)
        comm.broadcast(b, n - 1, tag=2)
        out["bcast"] = b
        out["gather"] = comm.all_gather(contribution(rank)[:1000], tag=3)
        comm.barrier(tag=5)
        return out

    results = relayed.run(work)
    # The relayed edge is sealed while the others of the ring are not.
    def marked_sum(i, comm):
        buf = marked()
        comm.all_reduce(buf, op="sum", tag=6)
        return buf

    marked_sums = relayed.run(marked_sum)
    assert all(np.array_equal(m, marked_sums[0]) for m in marked_sums)
    with relayed.tap._lock:
        seen = bytes(relayed.tap.relay_bytes)
    assert len(seen) >= COUNT * 4 and MARKER not in seen, len(seen)
    want = sum(contribution(r) for r in range(n))
    for out in results:
        np.testing.assert_array_equal(out["sum"], want)
        for k, got in enumerate(out["max"]):
            np.testing.assert_array_equal(got, contribution(n - 1) + k)
        np.testing.assert_array_equal(out["bcast"], contribution(n - 1))
        np.testing.assert_array_equal(out["gather"], np.stack([contribution(r)[:1000] for r in range(n)]))
    assert metric(relayed.master, "lockstep_relay_bytes_total") > COUNT * 4


def test_shared_state_between_peers_that_accept_no_connection_goes_through_the_relay(relayed):
    """Only two peers that accept no inbound connection hold the state: the reachable
    receivers are dialled by them (reversed), the third unreachable one is served through
    the relay (without it that peer would be removed), sealed though encrypt_data is off."""
    weights = np.tile(marked(), 4)  # 4 MiB
    before = metric(relayed.master, "lockstep_relay_bytes_total")
    with relayed.tap._lock:
        relayed.tap.relay_bytes.clear()
    holders = relayed.peers[3:]  # peer3 and peer4: no inbound connection
    receivers = relayed.peers[:3]  # peer0, peer1 (reachable) and peer2 (no inbound connection)
    states = [lockstep.SharedState({"w": weights.copy()}, revision=1) for _ in holders]
    fresh = [lockstep.SharedState({"w": np.zeros_like(weights)}) for _ in receivers]
    futures = [p.submit(lambda comm, st=st: comm.sync_shared_state(st, "enforce_popular"))
               for p, st in zip(holders, states)]
    futures += [p.submit(lambda comm, st=st: comm.sync_shared_state(st, lockstep.SyncStrategy.RECEIVE_ONLY))
                for p, st in zip(receivers, fresh)]
    infos = [f.result(60) for f in futures]
    for st in fresh:
        np.testing.assert_array_equal(st["w"], weights)
        assert st.revision == 1
    assert infos[4].bytes_received == weights.nbytes, infos[4]
    assert relayed.run(lambda i, comm: comm.group_world_size) == [5] * 5  # nobody was removed
    assert metric(relayed.master, "lockstep_relay_bytes_total") - before >= weights.nbytes
    with relayed.tap._lock:
        seen = bytes(relayed.tap.relay_bytes)
    assert MARKER not in seen, "shared state crossed the relay unsealed"


def test_a_peer_between_two_unreachable_ones_leaves_and_their_edge_is_relayed(relayed):
    """The ring is peer0 peer2 peer1 peer3 peer4 (peer3-peer4 relayed). peer1 leaves: peer2
    and peer3, both unreachable, become neighbours and stay (without a relay the later
    one would be removed); the next all-reduce runs over their new, relayed edge."""
    ids = [p.call(lambda comm: comm.id) for p in relayed.peers]
    ring = [m.id for m in relayed.peers[0].call(lambda comm: comm.membership())]
    assert ring == [ids[0], ids[2], ids[1], ids[3], ids[4]], (ring, ids)
    leaver = relayed.peers.pop(1)
    leaver.close()

    def reduce(i, comm):
        # The attempt in flight when the master learns of the loss fails, for everyone
        # alike; the application retries it (README, "The training loop").
        for _ in range(5):
            buf = np.full(COUNT, float(i + 1), dtype=np.float32)
            try:
                comm.all_reduce(buf, tag=20)
                return buf
            except lockstep.RetryableError as e:
                error = e
        raise AssertionError(f"the all-reduce kept failing: {error}")

    for got in relayed.run(reduce):
        np.testing.assert_array_equal(got, np.full(COUNT, 10.0, dtype=np.float32))
    # The next update topology keeps them side by side, and the ring goes on.
    relayed.run(lambda i, comm: comm.update_topology())
    views = relayed.run(lambda i, comm: comm.membership())
    assert [m.id for m in views[0]] == [ids[0], ids[2], ids[3], ids[4]], views[0]
    assert [m.p2p_port == 0 for m in views[0]] == [False, True, True, True], views[0]
    for got in relayed.run(reduce):
        np.testing.assert_array_equal(got, np.full(COUNT, 10.0, dtype=np.float32))


def test_optimize_topology_measures_relayed_pairs_through_the_relay(relayed):
    """Two peers that both accept no inbound connection are measured through the relay,
    as their edge would run, instead of being given a bandwidth of 0."""
    before = metric(relayed.master, "lockstep_relay_bytes_total")
    relayed.run(lambda i, comm: comm.optimize_topology())
    views = relayed.run(lambda i, comm: comm.membership())
    assert all(v == views[0] for v in views)
    unreachable = {m.id for m in views[0] if m.p2p_port == 0}
    assert len(unreachable) == 3
    with urllib.request.urlopen(f"http://{relayed.master.http_address}/api/state", timeout=10) as response:
        group = json.loads(response.read())["groups"][0]
    names = {peer_name(u) for u in unreachable}
    ring = group["ring"]
    pairs = [(a, b) for a in range(len(ring)) for b in range(len(ring)) if a != b and {ring[a], ring[b]} <= names]
    assert len(pairs) == 6, (ring, unreachable)
    for a, b in pairs:
        assert group["bandwidth"][a][b] and group["bandwidth"][a][b] > 0, (a, b, group["bandwidth"])
    assert metric(relayed.master, "lockstep_relay_bytes_total") > before
    # The ring still does its work.
    relayed.run(lambda i, comm: comm.all_reduce(np.full(COUNT, 1.0, dtype=np.float32), tag=40))


# The protocol version the library speaks (src/protocol/messages.h, kProtocolVersion).
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "protocol", "messages.h")) as _f:
    PROTOCOL_VERSION = int(re.search(r"kProtocolVersion = (\d+);", _f.read()).group(1))


def wire_id(hex_id: str) -> bytes:
    """A peer id as frames carry it: its high and its low 64 bits, each little-endian."""
    raw = bytes.fromhex(hex_id)
    return struct.pack("<QQ", int.from_bytes(raw[:8], "big"), int.from_bytes(raw[8:], "big"))


def hello_frame(channel: int, sender: bytes, receiver: bytes) -> bytes:
    """A P2PHello (docs/protocol.md): magic, version, channel, from, to, epoch (to the
    relay: the relayed connection's channel, 1: ring), pool index, auth (a nonce), flags."""
    payload = struct.pack("<IHB", 0x4C4B5354, PROTOCOL_VERSION, channel) + sender + receiver
    payload += struct.pack("<QI", 1, 0) + struct.pack("<H", 32) + bytes(32) + b"\0"
    return struct.pack("<IHH", len(payload), 128, 0) + payload


def closes_soon(s: socket.socket) -> bytes:
    """What the relay answers before it closes the connection (it must close it)."""
    s.settimeout(10)
    got = b""
    while True:
        try:
            data = s.recv(4096)
        except ConnectionResetError:  # closed with our bytes unread
            return got
        if not data:
            return got
        got += data


def test_the_relay_drops_strangers_and_pairs_it_was_not_assigned(relayed):
    master = relayed.master
    refused = metric(master, "lockstep_relay_refused_total")
    with socket.create_connection(("127.0.0.1", master.relay_port)) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))
        assert closes_soon(s) == b""
    views = relayed.run(lambda i, comm: comm.membership())
    reachable = [m for m in views[0] if m.p2p_port != 0]
    ids = [wire_id(m.id) for m in reachable]
    # Two members, but ones that accept connections: no relayed edge between them.
    with socket.create_connection(("127.0.0.1", master.relay_port)) as s:
        s.sendall(hello_frame(4, ids[0], ids[1]))
        answer = closes_soon(s)
        assert answer[:8] == struct.pack("<IHH", 4, 129, 0) and answer[8:12] != bytes(4), answer
    # Strangers to the run.
    with socket.create_connection(("127.0.0.1", master.relay_port)) as s:
        s.sendall(hello_frame(4, bytes(range(16)), bytes(range(16, 32))))
        assert closes_soon(s)[:8] == struct.pack("<IHH", 4, 129, 0)
    assert metric(master, "lockstep_relay_refused_total") >= refused + 3
    # The relay still serves the run.
    relayed.run(lambda i, comm: comm.all_reduce(np.full(COUNT, 1.0, dtype=np.float32), tag=30))
