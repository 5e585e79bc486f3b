"""The master's HTTP endpoint against scripted runs of real processes (a lockstep-master
with --http and lockstep-testpeer peers): /metrics parses as Prometheus text and its
numbers match the run (joins, a kill, N all-reduces); /api/state matches the run through
joins, a kill and an optimize; a stalled vote names the peers it waits for, in the state
and in the log. The peers' own counters are checked through the Python API (in-process
peers); tests/capi/c99_test.c checks them through the C API."""

from __future__ import annotations

import time

import numpy as np
import pytest

import lockstep
from conftest import Cluster
from observed_run import WAIT_S, MasterProcess, Peer, admit, all_call, parse_prometheus, peer_name

COUNT = 50_000  # f32 elements per all-reduce


@pytest.fixture
def master():
    m = MasterProcess("--bandwidth-test-ms", "200", "--stall-report-ms", "1000")
    yield m
    m.close()


@pytest.fixture
def peers(master):
    started = [Peer(master, f"p{i}") for i in range(3)]
    yield started
    for p in started:
        p.close()


def wait_for(predicate, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def all_reduce(members, tag: int) -> int:
    """One all-reduce on every member; returns the bytes they report having sent."""
    answers = all_call(members, f"allreduce {COUNT} {tag} 1")
    assert all(a["world"] == len(members) and a["value"] == len(members) for a in answers), answers
    return sum(a["bytes_sent"] for a in answers)


def test_endpoints_answer_and_bound_what_they_serve(master):
    status, headers, page = master.get("/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    # Self-contained: no external resource of any kind.
    assert "<script src" not in page and "http://" not in page.replace('"http://www.w3.org/2000/svg"', "")
    assert "https://" not in page
    with pytest.raises(Exception) as missing:
        master.get("/nothing-here")
    assert getattr(missing.value, "code", None) == 404
    state = master.state()
    assert state["peers"] == [] and state["operations"] == [] and state["epoch"] == 0
    metrics = master.metrics()
    assert metrics.value("lockstep_topology_epoch") == 0
    assert metrics.value("lockstep_peers_registered_total") == 0


def test_metrics_match_a_scripted_run(master, peers):
    members = []
    updates = admit(members, peers)
    m = master.metrics()
    assert m.value("lockstep_peers_registered_total") == 3
    assert m.value("lockstep_peers", group="0", phase="ACCEPTED", state="IDLE") == 3
    assert m.total("lockstep_peers") == 3
    assert m.value("lockstep_ring_size", group="0") == 3
    assert m.value("lockstep_operations_succeeded_total", operation="update_topology") == updates
    assert m.value("lockstep_operations_started_total", operation="update_topology") == updates
    assert m.value("lockstep_operations_failed_total", operation="update_topology") == 0

    sent = 0
    for tag in range(1, 6):
        sent += all_reduce(members, tag)
    assert sent > 0

    # A kill: the master sees the connection close and removes the peer at once.
    victim = members.pop()
    victim.kill()
    wait_for(lambda: master.metrics().get("lockstep_peers_removed_total", status="PEER_CONNECTION_LOST") == 1,
             "the removal of the killed peer")
    # The survivors refresh their view (are-peers-pending says yes after a departure).
    assert all(a["pending"] for a in all_call(members, "pending"))
    all_call(members, "update")
    updates += 1
    for tag in range(6, 8):
        sent += all_reduce(members, tag)

    # A peer returns once its ring's commit tokens came: the others' reports may still be
    # on their way to the master.
    wait_for(lambda: master.metrics().get("lockstep_reported_bytes_total", operation="all_reduce",
                                          direction="received") == sent, "every peer's report of its bytes")
    m = master.metrics()
    assert m.value("lockstep_peers_registered_total") == 3
    assert m.value("lockstep_peers", group="0", phase="ACCEPTED", state="IDLE") == 2
    assert m.total("lockstep_peers") == 2
    assert m.value("lockstep_ring_size", group="0") == 2
    assert m.value("lockstep_peers_removed_total", status="PEER_CONNECTION_LOST") == 1
    assert m.total("lockstep_peers_removed_total") == 1
    assert m.value("lockstep_operations_started_total", operation="all_reduce") == 7
    assert m.value("lockstep_operations_succeeded_total", operation="all_reduce") == 7
    assert m.value("lockstep_operations_failed_total", operation="all_reduce") == 0
    assert m.value("lockstep_operations_succeeded_total", operation="update_topology") == updates
    assert m.value("lockstep_operations_succeeded_total", operation="are_peers_pending") >= 1
    # Every all-reduce is one consensus round; their latencies are in the histogram.
    assert m.value("lockstep_consensus_round_seconds_count", operation="all_reduce") == 7
    assert m.value("lockstep_consensus_round_seconds_bucket", operation="all_reduce", le="+Inf") == 7
    assert m.value("lockstep_consensus_round_seconds_sum", operation="all_reduce") > 0
    # Bytes moved: exactly what the peers reported to their callers.
    assert m.value("lockstep_reported_bytes_total", operation="all_reduce", direction="sent") == sent
    assert m.value("lockstep_reported_bytes_total", operation="all_reduce", direction="received") == sent
    assert m.value("lockstep_operations_open", operation="all_reduce") == 0
    assert m.value("lockstep_topology_epoch") == updates
    assert m.types["lockstep_consensus_round_seconds"] == "histogram"
    assert m.types["lockstep_operations_succeeded_total"] == "counter"

    # The log carries the same decisions with their reasons.
    log = master.log_text()
    assert f"peer {victim.id} (ACCEPTED, group 0) removed: connection closed" in log


def test_state_matches_the_run_through_joins_a_kill_and_an_optimize(master, peers):
    members = []
    admit(members, peers)
    view = members[0].call("view")["view"]
    state = master.state()
    ids = [p.id for p in members]
    assert sorted(p["id"] for p in state["peers"]) == sorted(ids)
    for p in state["peers"]:
        assert p["phase"] == "ACCEPTED" and p["state"] == "IDLE" and p["group"] == 0 and p["host"] == "127.0.0.1"
    ring = sorted(view, key=lambda m: m["rank"])
    group = state["groups"][0]
    assert group["group"] == 0
    by_id = {p["id"]: p for p in state["peers"]}
    assert group["ring"] == [peer_name(m["id"]) for m in ring]
    for m in ring:
        p = by_id[peer_name(m["id"])]
        assert p["rank"] == m["rank"] and p["p2p_port"] == m["port"] and p["benchmark_port"] == m["benchmark_port"]
    registered = [e for e in state["events"] if e["kind"] == "registered"]
    assert sorted(e["peers"][0] for e in registered) == sorted(ids)
    assert group["bottleneck_bytes_per_s"] is None  # nothing measured yet
    assert all(v is None for row in group["bandwidth"] for v in row)

    # A kill: the peer is gone from the state, and the event says who and why.
    victim = members.pop(1)
    victim.kill()
    state = wait_for(lambda: (s := master.state()) and len(s["peers"]) == 2 and s, "the removal in the state")
    assert victim.id not in [p["id"] for p in state["peers"]]
    removed = [e for e in state["events"] if e["kind"] == "removed"]
    assert len(removed) == 1 and removed[0]["peers"] == [victim.id]
    assert removed[0]["status"] == "PEER_CONNECTION_LOST" and "connection closed" in removed[0]["reason"]
    assert victim.id not in state["groups"][0]["ring"]

    # One more peer, then an optimize: the matrix is measured and the ring is the solver's.
    newcomer = Peer(master, "p3")
    peers.append(newcomer)
    admit(members, [newcomer])
    assert len(master.state()["groups"][0]["ring"]) == 3
    answers = all_call(members, "optimize")
    state = master.state()
    group = state["groups"][0]
    assert group["ring"] == [peer_name(m["id"]) for m in answers[0]["view"]]
    n = len(group["ring"])
    matrix = group["bandwidth"]
    assert len(matrix) == n and all(len(row) == n for row in matrix)
    for i in range(n):
        for j in range(n):
            assert (matrix[i][j] is None) == (i == j), (i, j, matrix)
    edges = [matrix[i][(i + 1) % n] for i in range(n)]
    assert group["bottleneck_bytes_per_s"] == pytest.approx(min(edges))
    assert state["counters"]["operations"]["optimize_topology"] == {"started": 1, "succeeded": 1, "failed": 0,
                                                                    "refused": 0}
    optimized = [e for e in state["events"] if e["operation"] == "optimize_topology" and "optimized ring" in e["text"]]
    assert len(optimized) == 1 and optimized[0]["reason"].startswith("bottleneck ")
    assert optimized[0]["peers"] == group["ring"]
    metrics = master.metrics()
    assert metrics.value("lockstep_topology_optimizations_total") == 1
    assert metrics.value("lockstep_ring_bottleneck_bytes_per_second", group="0") == pytest.approx(min(edges))
    assert metrics.value("lockstep_bandwidth_edges_measured") == n * (n - 1)


def test_a_stalled_vote_names_the_peers_it_waits_for(master, peers):
    members = []
    admit(members, peers)
    members[0].send("agree 1")  # the others do not vote: the vote waits for them
    late = sorted(p.id for p in members[1:])

    def stalled():
        ops = [o for o in master.state()["operations"] if o["operation"] == "agree" and o["stalled"]]
        return ops[0] if ops else None

    op = wait_for(stalled, "the stalled agree vote")
    assert op["group"] == 0 and op["done"] == [members[0].id] and sorted(op["waiting"]) == late
    # The shell looks for stalls four times a second: the report follows shortly.
    stall_events = wait_for(lambda: [e for e in master.state()["events"] if e["text"].startswith("stall: agree")],
                            "the stall report")
    assert len(stall_events) == 1 and sorted(stall_events[0]["peers"]) == late
    log = master.log_text()
    assert "stall: agree of group 0" in log and all(p in log for p in late)
    assert master.metrics().value("lockstep_stalls_total") == 1
    # The others vote: the round completes and nothing is open any more.
    for p in members[1:]:
        p.send("agree 1")
    assert all(p.reply()["result"] for p in members)
    assert master.state()["operations"] == []


def test_peer_counters_match_a_scripted_run():
    with Cluster(3) as c:
        before = c.run(lambda i, comm: comm.counters())
        for counters in before:
            assert counters["operations_started"] >= 1 and counters["connect_us"] > 0
            assert counters["operations_started"] == counters["operations_succeeded"] + counters["operations_failed"]
            assert counters["all_reduces_started"] == 0 and counters["all_reduce_bytes_sent"] == 0

        def reduce_n(i, comm):
            infos = [comm.all_reduce(np.full(10_000, float(i), dtype=np.float32), tag=t) for t in range(1, 5)]
            return sum(info.bytes_sent for info in infos), sum(info.bytes_received for info in infos)

        moved = c.run(reduce_n)

        # A mismatch (different counts for one tag) fails on every peer; the same tag again is a retry.
        def mismatch_then_retry(i, comm):
            with pytest.raises(lockstep.OperationMismatchError):
                comm.all_reduce(np.zeros(100 + i, dtype=np.float32), tag=9)
            comm.all_reduce(np.zeros(100, dtype=np.float32), tag=9)

        c.run(mismatch_then_retry)

        # A sync: the first peer's content wins at the group's first sync; the others receive it.
        def sync(i, comm):
            w = np.full(4096, 7.0 if i == 0 else float(i), dtype=np.float32)
            strategy = "enforce_popular" if i == 0 else "receive_only"
            return comm.sync_shared_state(lockstep.SharedState({"w": w}, revision=1), strategy)

        infos = c.run(sync)
        after = c.run(lambda i, comm: comm.counters())
        for i, (counters, first) in enumerate(zip(after, before)):
            assert counters["all_reduces_started"] == 6
            assert counters["all_reduces_succeeded"] == 5 and counters["all_reduces_failed"] == 1
            assert counters["retries"] == 1
            assert counters["all_reduce_bytes_sent"] >= moved[i][0]
            assert counters["all_reduce_bytes_received"] >= moved[i][1] > 0
            assert counters["syncs_started"] == 1 and counters["syncs_succeeded"] == 1 and counters["syncs_failed"] == 0
            assert counters["sync_bytes_received"] == infos[i].bytes_received
            assert counters["sync_bytes_sent"] == infos[i].bytes_sent
            assert counters["operations_started"] == first["operations_started"] + 7
            assert counters["operations_started"] == counters["operations_succeeded"] + counters["operations_failed"]
            assert counters["all_reduce_us"] > 0 and counters["sync_us"] > 0
        assert sum(info.bytes_received for info in infos) == 2 * 4096 * 4
        assert sum(counters["sync_bytes_sent"] for counters in after) == 2 * 4096 * 4


def test_peer_counters_exact_all_reduce_bytes():
    with Cluster(2) as c:
        infos = c.run(lambda i, comm: [comm.all_reduce(np.ones(1000, dtype=np.float64), tag=t) for t in (1, 2, 3)])
        counters = c.run(lambda i, comm: comm.counters())
        for mine, got in zip(infos, counters):
            assert got["all_reduce_bytes_sent"] == sum(info.bytes_sent for info in mine) > 0
            assert got["all_reduce_bytes_received"] == sum(info.bytes_received for info in mine) > 0
        c.peers[0].close()
        with pytest.raises(lockstep.InvalidUsageError):
            c.peers[0].comm.counters()


def test_prometheus_parser_rejects_what_it_must():
    good = "# HELP a x\n# TYPE a counter\na 1\n"
    assert parse_prometheus(good).value("a") == 1
    for bad in ["a 1\n",                                        # no TYPE
                "# TYPE a counter\na -1\n",                     # negative counter
                "# TYPE a counter\na 1\na 2\n",                 # duplicate
                "# TYPE a gauge\na{x=\"1\",x=\"2\"} 1\n",       # repeated label
                "# TYPE a gauge\na one\n",                      # bad value
                "# TYPE a gauge\na 1",                          # no final newline
                "# TYPE a gauge\n\na 1\n",                      # empty line
                "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n"]:
        with pytest.raises(AssertionError):
            parse_prometheus(bad)


def test_peer_slot_bytes_show_which_connections_carry_what():
    pool = 4
    with Cluster(2, pool_size=pool) as c:
        assert c.run(lambda i, comm: comm.slot_bytes()) == [[(0, 0)] * pool] * 2

        def reduce_concurrently(i, comm):
            # Sizes differ, so that the slots carry different amounts.
            arrays = [np.full((k + 1) << 17, float(i + k), dtype=np.float32) for k in range(2 * pool)]
            handles = [comm.all_reduce_async(a, tag=20 + k) for k, a in enumerate(arrays)]
            infos = [h.wait() for h in handles]
            assert all(a[0] == 2 * k + 1 for k, a in enumerate(arrays))
            return infos

        infos = c.run(reduce_concurrently)
        slots = c.run(lambda i, comm: comm.slot_bytes())
        counters = c.run(lambda i, comm: comm.counters())
        for mine, got, total in zip(infos, slots, counters):
            # Launched at once, the all-reduces ran on every slot of the pool.
            assert len(got) == pool and all(sent > 0 and received > 0 for sent, received in got), got
            assert sum(sent for sent, _ in got) == total["all_reduce_bytes_sent"] == sum(i.bytes_sent for i in mine)
            assert sum(r for _, r in got) == total["all_reduce_bytes_received"] == sum(i.bytes_received for i in mine)
        c.peers[0].close()
        with pytest.raises(lockstep.InvalidUsageError):
            c.peers[0].comm.slot_bytes()
