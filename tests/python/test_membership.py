"""Membership calls: connect, update/optimize topology, are_peers_pending, agree, rank, id,
membership view and attributes, peer groups."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

import lockstep
from conftest import Cluster, Peer, join_group


def test_a_lone_peer_is_admitted_at_once():
    with lockstep.Master("127.0.0.1:0") as master:
        with lockstep.Communicator(master.address, base_port=0) as comm:
            comm.connect()
            assert comm.rank == 0
            assert re.fullmatch(r"[0-9a-f]{32}", comm.id)
            assert (comm.world_size, comm.group_world_size, comm.num_groups, comm.largest_group_size) == (1, 1, 1, 1)
            [me] = comm.membership()
            assert isinstance(me, lockstep.Member)
            assert me.id == comm.id and me.rank == 0 and me.host == "127.0.0.1"
            assert me.p2p_port > 0 and me.shared_state_port > 0 and me.benchmark_port > 0
            assert comm.are_peers_pending() is False
            assert comm.agree(True) is True
            assert comm.agree(False) is False
            comm.update_topology()  # legal with nobody pending
            a = np.arange(5, dtype=np.int16)
            with pytest.raises(lockstep.TooFewPeersError):  # a collective needs two peers
                comm.all_reduce(a)
            assert list(a) == [0, 1, 2, 3, 4]
            with pytest.raises(lockstep.InvalidUsageError, match="already connected"):
                comm.connect()


def test_three_peers_view_ranks_and_ids(cluster3):
    views = cluster3.run(lambda i, c: (c.rank, c.id, c.membership(), c.group_world_size, c.world_size))
    ranks = sorted(v[0] for v in views)
    assert ranks == [0, 1, 2]
    ids = {v[1] for v in views}
    assert len(ids) == 3
    first_view = views[0][2]
    assert [m.rank for m in first_view] == [0, 1, 2]
    assert {m.id for m in first_view} == ids
    for rank, ident, view, group_size, world in views:
        assert view == first_view  # every peer sees the same view
        assert view[rank].id == ident
        assert group_size == world == 3


def test_agree_is_all_or_nothing(cluster3):
    assert cluster3.run(lambda i, c: c.agree(True)) == [True] * 3
    assert cluster3.run(lambda i, c: c.agree(i != 1)) == [False] * 3
    assert cluster3.run(lambda i, c: c.are_peers_pending()) == [False] * 3


def test_newcomer_joins_through_update_topology():
    with Cluster(2) as c:
        before = c.peers[0].call(lambda comm: comm.membership())
        newcomer = c.add_peer("newcomer")
        after = c.peers[0].call(lambda comm: comm.membership())
        assert len(before) == 2 and len(after) == 3
        assert newcomer.call(lambda comm: comm.membership()) == after
        assert newcomer.call(lambda comm: comm.id) in {m.id for m in after}
        assert c.run(lambda i, comm: comm.group_world_size) == [3, 3, 3]


def test_optimize_topology_keeps_the_group():
    with Cluster(2) as c:
        c.run(lambda i, comm: comm.optimize_topology(), timeout=30)
        views = c.run(lambda i, comm: comm.membership())
        assert views[0] == views[1] and len(views[0]) == 2
        assert all(x.world_size == 2 for x in c.run(lambda i, comm: comm.all_reduce(np.ones(3), tag=1)))


def test_peer_groups_and_attributes():
    """Two peers in group 0 and one in group 1: collectives span one group only."""
    with lockstep.Master("127.0.0.1:0") as master:
        peers = [Peer(master.address, "g0a", group=0), Peer(master.address, "g0b", group=0),
                 Peer(master.address, "g1", group=1)]
        try:
            peers[0].call(lambda c: c.connect())

            def join(c, connect=True):
                if connect:
                    c.connect()
                while c.world_size < 3:
                    if c.are_peers_pending():
                        c.update_topology()
                    else:
                        time.sleep(0.02)

            futures = [p.submit(join) for p in peers[1:]] + [peers[0].submit(lambda c: join(c, connect=False))]
            for f in futures:
                f.result(25)
            attrs = [p.call(lambda c: (c.world_size, c.group_world_size, c.num_groups, c.largest_group_size))
                     for p in peers]
            assert attrs == [(3, 2, 2, 2), (3, 2, 2, 2), (3, 1, 2, 2)]
            assert len(peers[2].call(lambda c: c.membership())) == 1
            # Group 0 reduces as two; the lone peer of group 1 has nobody to reduce with
            # (TooFewPeersError, its buffer untouched).
            f = [p.submit(lambda c: c.all_reduce(np.ones(4, np.int32), tag=9)) for p in peers[:2]]
            assert [x.result(25).world_size for x in f] == [2, 2]
            lone = np.ones(4, np.int32)
            with pytest.raises(lockstep.TooFewPeersError):
                peers[2].call(lambda c: c.all_reduce(lone, tag=9))
            assert np.all(lone == 1)
        finally:
            for p in peers:
                p.close()


def test_join_group_helper_handles_repeated_votes():
    # join_group is used by every test: a newcomer is admitted while the others vote.
    with lockstep.Master("127.0.0.1:0") as master:
        a, b = Peer(master.address, "a"), Peer(master.address, "b")
        try:
            a.call(lambda c: c.connect())
            fb = b.submit(lambda c: join_group(c, 2))
            fa = a.submit(lambda c: join_group(c, 2, connect=False))
            fa.result(25)
            fb.result(25)
            assert a.call(lambda c: c.group_world_size) == b.call(lambda c: c.group_world_size) == 2
        finally:
            a.close()
            b.close()


def test_close_is_refused_while_another_thread_is_inside_a_call(cluster2):
    early = cluster2.peers[0].submit(lambda c: c.agree(True))  # waits for peer 1
    time.sleep(0.2)
    with pytest.raises(lockstep.InvalidUsageError, match="still running on another thread"):
        cluster2.peers[0].comm.close()
    assert cluster2.peers[1].call(lambda c: c.agree(True)) is True
    assert early.result(25) is True
    assert not cluster2.peers[0].comm.closed
