"""Peers that accept no inbound connection (inbound=False, as behind a NAT): they listen
on no port, their ring edges run reversed (the receiver dials), and a run that mixes
them with reachable peers does every collective, a shared-state sync and an optimize
exactly as a run of reachable peers does."""

from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import pytest

import lockstep
from conftest import Cluster, Peer

COUNT = 300_000  # float32: large enough to run over the ring, not with the votes


def contribution(rank: int) -> np.ndarray:
    return (np.arange(COUNT, dtype=np.float32) % 97) * (rank + 1)


@pytest.fixture
def mixed():
    """Four peers in join order: reachable, reachable, unreachable, unreachable (joined
    in that order at the ring's end, the last two would be neighbours); two pool slots
    and four stripes per edge where an edge can have them."""
    with Cluster(2, pool_size=2, p2p_streams=4) as c:
        for k in (2, 3):
            c.add_peer(f"peer{k}", pool_size=2, p2p_streams=4, inbound=False)
        yield c


def test_listens_on_no_port_and_the_master_places_it_between_reachable_peers(mixed):
    views = mixed.run(lambda i, comm: comm.membership())
    assert all(v == views[0] for v in views)
    ports = [(m.p2p_port, m.shared_state_port, m.benchmark_port) for m in views[0]]
    assert sorted(p[0] == 0 for p in ports) == [False, False, True, True], ports
    assert all(p == (0, 0, 0) or 0 not in p for p in ports), ports
    # No ring edge joins two peers that both refuse inbound connections.
    n = len(ports)
    for r in range(n):
        assert ports[r][0] != 0 or ports[(r + 1) % n][0] != 0, ports


def test_every_collective_over_reversed_edges(mixed):
    n = len(mixed.peers)

    def work(i, comm):
        rank = comm.rank
        out = {}
        buf = contribution(rank)
        started = time.monotonic()
        comm.all_reduce(buf, op="sum", tag=1)
        # A generous bound, far below the 5 s p2p connect timeout that a reversed edge's
        # sender would wait for each stripe its receiver never dials.
        assert time.monotonic() - started < 4.0, "the all-reduce waited for a connection"
        out["sum"] = buf
        # Several in flight at once use both pool slots.
        handles = [comm.all_reduce_async(contribution(rank) + k, op="max", tag=10 + k) for k in range(4)]
        out["max"] = [h.wait() and h.result for h in handles]
        root = next(m.rank for m in comm.membership() if m.p2p_port == 0)  # an unreachable root
        b = contribution(rank) if rank == root else np.zeros(COUNT, dtype=np.float32)
        comm.broadcast(b, root, tag=2)
        out["bcast"] = (root, b)
        out["gather"] = comm.all_gather(contribution(rank)[:1000], tag=3)
        out["rs"] = comm.reduce_scatter(np.tile(contribution(rank)[:1000], n), op="sum", tag=4)
        comm.barrier(tag=5)
        out["rank"] = rank
        return out

    results = mixed.run(work)
    # Optimize: the pairs where one side accepts connections are measured (it is the
    # one dialled), the unreachable pair is not (it cannot be connected), and the ring
    # it keeps has every edge possible: the collectives go on.
    mixed.run(lambda i, comm: comm.optimize_topology())
    test_listens_on_no_port_and_the_master_places_it_between_reachable_peers(mixed)
    results += mixed.run(work)
    want = sum(contribution(r) for r in range(n))
    for out in results:
        np.testing.assert_array_equal(out["sum"], want)
        for k, got in enumerate(out["max"]):
            np.testing.assert_array_equal(got, contribution(n - 1) + k)
        root, b = out["bcast"]
        np.testing.assert_array_equal(b, contribution(root))
        np.testing.assert_array_equal(out["gather"], np.stack([contribution(r)[:1000] for r in range(n)]))
        np.testing.assert_array_equal(out["rs"], want[:1000])


def sync_to_newcomer(holders, states, newcomer, fresh) -> list:
    """One sync: the holders (one more revision each) and a receive-only newcomer."""
    futures = []
    for p, st in zip(holders, states):
        st.revision += 1
        futures.append(p.submit(lambda comm, st=st: comm.sync_shared_state(st, "enforce_popular")))
    futures.append(newcomer.submit(lambda comm: comm.sync_shared_state(fresh, lockstep.SyncStrategy.RECEIVE_ONLY)))
    return [f.result(25) for f in futures]


def test_shared_state_reaches_an_unreachable_newcomer_and_optimize_keeps_the_edges_possible():
    with Cluster(2) as c:
        rng = np.random.default_rng(5)
        # 16 MiB: a later receiver's sync is split in pieces over every source it may use
        weights = rng.standard_normal(4 << 20).astype(np.float32)
        states = [lockstep.SharedState({"w": weights.copy()}, revision=3) for _ in range(2)]
        newcomer = c.add_peer("unreachable", inbound=False)
        fresh = lockstep.SharedState({"w": np.zeros_like(weights)})
        infos = sync_to_newcomer(c.peers[:2], states, newcomer, fresh)
        np.testing.assert_array_equal(fresh["w"], weights)
        assert fresh.revision == 4 and infos[2].bytes_received == weights.nbytes

        # Optimize measures every pair (the reachable side of each accepts the test's
        # connection) and keeps a ring whose every edge can be made.
        c.run(lambda i, comm: comm.optimize_topology())
        views = c.run(lambda i, comm: comm.membership())
        assert all(v == views[0] for v in views) and len(views[0]) == 3
        sums = c.run(lambda i, comm: comm.all_reduce(np.full(COUNT, float(i), dtype=np.float32), tag=7) and None)
        assert sums == [None, None, None]

        # A reachable newcomer fetches from all three sources: the unreachable one dials
        # it (a reversed shared-state transfer) and sends its share like the others.
        states.append(fresh)
        late = c.add_peer("late")
        empty = lockstep.SharedState({"w": np.zeros_like(weights)})
        infos = sync_to_newcomer(c.peers[:3], states, late, empty)
        np.testing.assert_array_equal(empty["w"], weights)
        assert all(info.bytes_sent > 0 for info in infos[:3]), infos
        assert sum(info.bytes_sent for info in infos[:3]) == weights.nbytes, infos


@pytest.mark.parametrize("encrypt", [False, True])
def test_reversed_edges_with_a_run_secret(tmp_path, encrypt):
    """With a run secret the reversed connections are authenticated like the others, and
    with encrypt_data their data is sealed by the side that sends it: the acceptor on a
    ring edge, the serving side of a shared-state transfer (here the only holder, which
    accepts no connection and dials both receivers)."""
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b"0123456789abcdef0123456789abcdef")
    secret_file.chmod(0o600)
    kwargs = {"secret_file": str(secret_file), "encrypt_data": encrypt, "pool_size": 2}
    with Cluster(1, master_kwargs={"secret_file": str(secret_file)}, **kwargs) as c:
        c.add_peer("unreachable", inbound=False, **kwargs)
        c.add_peer("reachable", **kwargs)
        n = len(c.peers)

        def work(i, comm):
            buf = contribution(comm.rank)
            comm.all_reduce(buf, tag=1)
            handles = [comm.all_reduce_async(contribution(comm.rank) + k, op="min", tag=2 + k) for k in range(3)]
            return buf, [h.wait() and h.result for h in handles]

        want = sum(contribution(r) for r in range(n))
        for total, mins in c.run(work):
            np.testing.assert_array_equal(total, want)
            for k, got in enumerate(mins):
                np.testing.assert_array_equal(got, contribution(0) + k)

        weights = np.random.default_rng(9).standard_normal(8 << 20).astype(np.float32)  # 32 MiB: 2 connections
        states = [lockstep.SharedState({"w": np.zeros_like(weights)}) for _ in range(n)]
        states[1] = lockstep.SharedState({"w": weights.copy()}, revision=1)  # the unreachable peer's

        def sync(i, comm):
            strategy = lockstep.SyncStrategy.RECEIVE_ONLY if i != 1 else lockstep.SyncStrategy.SEND_ONLY
            return comm.sync_shared_state(states[i], strategy)

        infos = c.run(sync)
        for st in states:
            np.testing.assert_array_equal(st["w"], weights)
            assert st.revision == 1
        assert infos[1].bytes_sent == 2 * weights.nbytes, infos
        assert [info.streams for info in infos] == [2, 0, 2], infos


def test_the_master_finds_a_port_it_cannot_reach():
    """Reachability measured: a peer whose listening sockets are bound where the master
    cannot reach them (127.0.0.2, while it connects from 127.0.0.1, the address the
    others would dial) names its ports, but the master's connection to them fails, so it
    is registered as accepting no inbound connection, and runs as one: nothing dials it."""
    with Cluster(2) as c:
        hidden = c.add_peer("bound-elsewhere", bind_host="127.0.0.2")
        views = c.run(lambda i, comm: comm.membership())
        assert all(v == views[0] for v in views)
        ports = {m.id: m.p2p_port for m in views[0]}
        assert ports[hidden.comm.id] == 0 and sorted(ports.values())[1:] != [0, 0], ports
        def reduce(i, comm):
            buf = contribution(comm.rank)
            comm.all_reduce(buf, tag=1)
            return buf

        want = sum(contribution(r) for r in range(3))
        for got in c.run(reduce):
            np.testing.assert_array_equal(got, want)


def test_each_unreachable_peer_keeps_reachable_neighbours():
    """Each peer that accepts no inbound connection must sit between two that do. A
    newcomer beyond that is rejected, saying why, at the update that would admit it; and
    where a removal leaves two such peers side by side, the one that joined later is
    removed at once (KICKED, saying why), so that the others' collectives go on."""
    with Cluster(2, master_kwargs={"http": "127.0.0.1:0"}) as c:
        c.add_peer("u1", inbound=False)
        c.add_peer("u2", inbound=False)  # two of four accept connections: room for no more
        extra = Peer(c.address, "u3", inbound=False)
        try:
            joining = extra.submit(lambda comm: comm.connect())
            deadline = time.monotonic() + 10
            while not all(c.run(lambda i, comm: comm.are_peers_pending())):
                assert time.monotonic() < deadline, "the newcomer never registered"
                time.sleep(0.02)
            c.run(lambda i, comm: comm.update_topology())
            with pytest.raises(lockstep.RejectedError, match="no place in the ring of group"):
                joining.result(10)
        finally:
            extra.close()
        assert c.run(lambda i, comm: comm.group_world_size) == [4] * 4

        # The ring is peer0 u1 peer1 u2; without peer1, u1 and u2 would be neighbours.
        ring = [m.id for m in c.peers[0].call(lambda comm: comm.membership())]
        ids = [p.call(lambda comm: comm.id) for p in c.peers]
        assert ring == [ids[0], ids[2], ids[1], ids[3]], (ring, ids)
        c.peers[1].close()
        deadline = time.monotonic() + 10
        while len(master_state(c.master)["peers"]) != 2:  # peer1 left, u2 was removed
            assert time.monotonic() < deadline, master_state(c.master)["peers"]
            time.sleep(0.02)
        with pytest.raises(lockstep.KickedError, match="their ring edge cannot be made"):
            c.peers[3].call(lambda comm: comm.all_reduce(contribution(3), tag=99))
        survivors = [c.peers[0], c.peers[2]]
        sums = c.run(lambda i, comm: comm.all_reduce(contribution(i), tag=99) and None, peers=survivors)
        assert sums == [None, None]


def master_state(master: lockstep.Master) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{master.http_port}/api/state", timeout=5) as r:
        return json.load(r)
