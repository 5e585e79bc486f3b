"""Failures seen from Python: a peer process killed during an all-reduce (every survivor
gets PeerConnectionLostError, the destination and an error-feedback residual are
untouched, the retry succeeds with the survivors), a peer stopped past the heartbeat
timeout (KickedError once it runs again), and a master that goes away
(MasterConnectionLostError)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import lockstep
from conftest import CALL_TIMEOUT_S, Cluster, Peer, join_group
from observed_run import MasterProcess

# The build's LOCKSTEP_TEST_TIME_SCALE (slower builds give live peers more time).
TIME_SCALE = float(os.environ.get("LOCKSTEP_TEST_TIME_SCALE", "1"))

# A peer in a process of its own: joins a group of `size`, says "ready", then runs the
# command it reads from stdin ("agree" prints the outcome) until stdin closes.
PEER_SNIPPET = textwrap.dedent("""
    import sys, time
    import lockstep
    address, size = sys.argv[1], int(sys.argv[2])
    lockstep.set_log_level("error")
    comm = lockstep.Communicator(address, base_port=0)
    comm.connect()
    while comm.group_world_size < size:
        if comm.are_peers_pending():
            comm.update_topology()
        else:
            time.sleep(0.02)
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            if line.strip() == "agree":
                print("agreed", comm.agree(True), flush=True)
            elif line.strip() == "reduce":
                import numpy as np
                a = np.ones(100_000)  # the size of the in-process peers
                print("reducing", flush=True)
                print("reduced", comm.all_reduce(a, tag=1).world_size, flush=True)
            elif line.strip() == "reduce4":  # 4-bit codes with error feedback
                import numpy as np
                a = np.linspace(0.0, 1.0, 100_000)
                print("reducing", flush=True)
                info = comm.all_reduce(a, tag=1, quantization="minmax4", residual=np.zeros_like(a))
                print("reduced", info.world_size, flush=True)
        except lockstep.Error as e:
            print("error", type(e).__name__, e.status, isinstance(e, lockstep.FatalError), flush=True)
""")


def start_peer_process(address: str, size: int) -> subprocess.Popen:
    env = dict(os.environ)
    return subprocess.Popen([sys.executable, "-c", PEER_SNIPPET, address, str(size)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def read_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    assert line, f"the peer process ended (exit code {proc.poll()})"
    return line.strip()


def wait_for_round(master: MasterProcess, tag: int, predicate, what: str) -> None:
    """Polls /api/state until the open all-reduce of this tag satisfies the predicate."""
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while True:
        rounds = [op for op in master.state()["operations"] if op["operation"] == "all_reduce" and op["tag"] == tag]
        if rounds and predicate(rounds[0]):
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {rounds}"
        time.sleep(0.01)


@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "4-bit-error-feedback"])
def test_killed_peer_fails_the_all_reduce_for_every_survivor_then_retry_succeeds(feedback):
    # A master process with its HTTP endpoint: the test follows the round on /api/state.
    master = MasterProcess()
    peers = [Peer(master.address, f"p{i}") for i in range(2)]
    proc = None
    try:
        peers[0].call(lambda c: c.connect())
        proc = start_peer_process(master.address, 3)
        futures = [peers[1].submit(lambda c: join_group(c, 3)),
                   peers[0].submit(lambda c: join_group(c, 3, connect=False))]
        for f in futures:
            f.result(CALL_TIMEOUT_S)
        assert read_line(proc) == "ready"

        if feedback:
            # Spread values (4-bit codes lose some) and residuals left by earlier calls.
            srcs = [np.linspace(0.0, 1.0, 100_000) + i + 1 for i in range(2)]
            residuals = [np.full(100_000, 0.001 * (i + 1)) for i in range(2)]
        else:
            srcs = [np.full(100_000, i + 1, dtype=np.float64) for i in range(2)]
            residuals = [None, None]
        before = [None if r is None else r.copy() for r in residuals]
        dsts = [np.full(100_000, -1.0) for _ in range(2)]
        extra = {"quantization": "minmax4"} if feedback else {}

        def reduce(i, comm):
            return comm.all_reduce(srcs[i], dsts[i], tag=1, residual=residuals[i], **extra)

        def reduce_once(i, comm):
            try:
                return reduce(i, comm)
            except lockstep.PeerConnectionLostError as e:
                return e

        # The third peer starts the all-reduce (tag 1) and is stopped while it waits for
        # the others; once they start the tag too the master lets all three go, so the
        # stopped peer is part of the ring when it is killed. (A peer that dies before it
        # started a tag is not a participant: the others would complete without it.)
        proc.stdin.write("reduce4\n" if feedback else "reduce\n")
        proc.stdin.flush()
        assert read_line(proc) == "reducing"
        wait_for_round(master, 1, lambda r: r["phase"] == "voting" and len(r["done"]) == 1,
                       "the third peer's vote to start tag 1")
        proc.send_signal(signal.SIGSTOP)
        running = [p.submit(lambda c, i=i: reduce_once(i, c)) for i, p in enumerate(peers)]
        wait_for_round(master, 1, lambda r: r["phase"] == "performing", "the master to let the three peers go")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        outcomes = [f.result(CALL_TIMEOUT_S) for f in running]
        for out, dst in zip(outcomes, dsts):
            assert isinstance(out, lockstep.PeerConnectionLostError), out
            assert isinstance(out, lockstep.RetryableError) and out.status == 9
            assert np.all(dst == -1.0)  # the destination holds what it held before
        for r, b in zip(residuals, before):
            assert r is None or np.array_equal(r, b)  # so does the residual

        # Retry with the survivors.
        infos = [p.submit(lambda c, i=i: reduce(i, c)) for i, p in enumerate(peers)]
        assert [f.result(CALL_TIMEOUT_S).world_size for f in infos] == [2, 2]
        if not feedback:
            for dst in dsts:
                assert np.all(dst == 3.0)
        else:
            # Both peers hold the same bits; what the 4-bit result lacks of the exact sum
            # of the contributions (src + residual) is in the new residuals.
            assert np.array_equal(dsts[0], dsts[1])
            exact = srcs[0] + before[0] + srcs[1] + before[1]
            assert np.max(np.abs(exact - dsts[0])) > 1e-3  # the codes lose something
            assert np.allclose(exact - dsts[0], residuals[0] + residuals[1], rtol=0, atol=1e-9)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in peers:
            p.close()
        master.close()


def test_stopped_peer_is_kicked():
    master = lockstep.Master("127.0.0.1:0", heartbeat_timeout_ms=int(500 * TIME_SCALE))
    master.run()
    peer = Peer(master.address, "p0")
    proc = None
    try:
        peer.call(lambda c: c.connect())
        proc = start_peer_process(master.address, 2)
        peer.call(lambda c: join_group(c, 2, connect=False))
        assert read_line(proc) == "ready"
        proc.send_signal(signal.SIGSTOP)  # silent past the heartbeat timeout
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            # The survivor refreshes its view: the silent peer is gone.
            if peer.call(lambda c: c.are_peers_pending()):
                peer.call(lambda c: c.update_topology())
            if peer.call(lambda c: len(c.membership())) == 1:
                break
            try:
                peer.call(lambda c: c.agree(True))
            except lockstep.PeerConnectionLostError:
                pass
            assert time.monotonic() < deadline, "the stopped peer was never removed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write("agree\n")
        proc.stdin.flush()
        assert read_line(proc) == "error KickedError 14 True"
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
        peer.close()
        master.close()


def test_master_gone_is_fatal():
    # With failover off (on by default: test_failover.py), a lost master ends the run.
    with Cluster(2, failover_timeout_ms=0) as c:
        c.master.close()

        def after(i, comm):
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while time.monotonic() < deadline:
                try:
                    comm.agree(True)
                except lockstep.MasterConnectionLostError as e:
                    assert isinstance(e, lockstep.FatalError) and e.status == 7
                    # The error sticks.
                    with pytest.raises(lockstep.MasterConnectionLostError):
                        comm.are_peers_pending()
                    return True
                except lockstep.PeerConnectionLostError:
                    pass
            return False

        assert c.run(after) == [True, True]
