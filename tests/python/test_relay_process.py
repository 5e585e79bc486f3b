"""lockstep-relay, a relay of its own (docs/deployment.md, "Relays"): it registers with the
master under the run secret and carries the relayed edges; killed in the middle of
all-reduces, every survivor gets one outcome and the ring re-forms (through the next relay
process where there is one, else without the edge: the later of its two peers leaves); a
master without the secret, or with another, refuses it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

import lockstep
from conftest import Cluster
from observed_run import LineReader, bin_path, stop_process
from test_relay import metric, write_secret

COUNT = 1024 * 1024  # float32: 4 MiB, over the ring


class RelayProcess:
    """lockstep-relay --listen 127.0.0.1:0 for the master at `master_port`."""

    def __init__(self, master_port: int, secret: str, tmp_path, name: str) -> None:
        self.log_path = tmp_path / f"{name}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [bin_path("lockstep-relay"), "--master", f"127.0.0.1:{master_port}", "--secret-file", secret,
             "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE, stderr=self.log, start_new_session=True)
        line = LineReader(self.proc.stdout).readline(10)
        found = re.match(r"lockstep-relay listening on 127\.0\.0\.1:(\d+)$", line.strip())
        assert found, line
        self.port = int(found.group(1))

    def kill(self) -> None:
        stop_process(self.proc, signal.SIGKILL)

    def freeze(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def close(self) -> None:
        stop_process(self.proc, signal.SIGTERM)
        self.log.close()

    def stderr(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")


def wait_for(predicate, timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def run_with_relays(tmp_path):
    """A master with a secret and no relay of its own, and a factory of relay processes;
    then a reachable peer and two that accept no inbound connection: the ring of three
    has the two side by side, their edge relayed."""
    secret = write_secret(tmp_path)
    master = lockstep.Master("127.0.0.1:0", secret_file=secret, http="127.0.0.1:0")
    master.run()
    relays = []

    def start_relay() -> RelayProcess:
        relay = RelayProcess(master.port, secret, tmp_path, f"relay{len(relays)}")
        relays.append(relay)
        wait_for(lambda: metric(master, "lockstep_relay_processes") == len(relays), what="the relay's registration")
        return relay

    class Run:
        pass

    run = Run()
    run.master, run.secret, run.start_relay, run.relays = master, secret, start_relay, relays
    try:
        yield run
    finally:
        for relay in relays:
            relay.close()
        master.close()


def join_three(run) -> Cluster:
    kwargs = {"secret_file": run.secret}
    cluster = Cluster(1, master=run.master, **kwargs)
    cluster.add_peer("nat1", inbound=False, **kwargs)
    cluster.add_peer("nat2", inbound=False, **kwargs)
    ports = [m.p2p_port for m in cluster.peers[0].call(lambda comm: comm.membership())]
    assert ports[0] != 0 and ports[1:] == [0, 0], ports
    return cluster


def all_reduces_through_a_kill(cluster: Cluster, relay: RelayProcess, steps: int = 12):
    """Every peer runs `steps` all-reduces (each retried until it succeeds; a kicked peer
    stops). Once every peer has finished three, the relay is frozen (SIGSTOP: the next
    all-reduce cannot pass it), and once every peer is inside that all-reduce, killed.
    Returns per peer the list of (step, outcome) with outcome the result's first value or
    the error's class name."""
    done = [0] * len(cluster.peers)
    inside = [False] * len(cluster.peers)
    lock = threading.Lock()

    def work(i, comm):
        log = []
        for step in range(steps):
            for _ in range(20):
                buf = np.full(COUNT, float(step + 1), dtype=np.float32)
                inside[i] = True
                try:
                    comm.all_reduce(buf, tag=100 + step)
                except lockstep.KickedError:
                    log.append((step, "KickedError"))
                    return log
                except lockstep.Error as e:
                    log.append((step, type(e).__name__))
                    continue
                finally:
                    inside[i] = False
                assert np.all(buf == buf[0])
                log.append((step, float(buf[0])))
                break
            with lock:
                done[i] += 1
        return log

    def kill():
        wait_for(lambda: min(done) >= 3, 60, "three all-reduces")
        relay.freeze()
        wait_for(lambda: all(inside), 60, "every peer inside an all-reduce")
        time.sleep(0.2)
        relay.kill()

    killer = threading.Thread(target=kill)
    killer.start()
    logs = cluster.run(work, timeout=120)
    killer.join()
    return logs


def test_a_relay_process_carries_the_edge_and_its_loss_mid_all_reduce_parts_the_pair(run_with_relays):
    run = run_with_relays
    relay = run.start_relay()
    with join_three(run) as cluster:
        logs = all_reduces_through_a_kill(cluster, relay)
        # The relay was the run's only one: the later of the two unreachable neighbours
        # (nat2) leaves, KICKED; the two others each see the same outcomes, step by step.
        assert logs[2][-1][1] == "KickedError", logs[2]
        assert logs[0] == logs[1], (logs[0], logs[1])
        outcomes = [o for _, o in logs[0]]
        assert all(isinstance(o, float) or o.endswith("Error") for o in outcomes)
        finals = {step: o for step, o in logs[0] if isinstance(o, float)}
        assert sorted(finals) == list(range(12)), logs[0]
        # The step nat2 was kicked in was in flight when the relay died (the relay was
        # frozen before it began): the survivors finished it on their own, or with nat2's
        # contribution where their ring had committed it before the freeze (nat2's call
        # fails all the same: it is out of the run); every earlier step had all three
        # contributions, every later one theirs alone. Nothing counted twice.
        kicked_at = logs[2][-1][0]
        assert kicked_at >= 3, logs[2]
        for step, value in finals.items():
            want = {3 * (step + 1)} if step < kicked_at else {2 * (step + 1)}
            if step == kicked_at:
                want.add(3 * (step + 1))
            assert value in want, (step, logs)
        survivors = cluster.peers[:2]
        cluster.run(lambda i, comm: comm.update_topology(), peers=survivors)
        assert cluster.run(lambda i, comm: comm.group_world_size, peers=survivors) == [2, 2]
        assert metric(run.master, "lockstep_relay_processes") == 0


def test_the_next_relay_process_takes_the_edges_of_a_lost_one(run_with_relays):
    run = run_with_relays
    first = run.start_relay()
    run.start_relay()  # registered second: it waits
    with join_three(run) as cluster:
        logs = all_reduces_through_a_kill(cluster, first)
        # Nobody leaves: the pair's edge goes through the second relay from then on.
        assert logs[0] == logs[1] == logs[2], logs
        finals = {step: o for step, o in logs[0] if isinstance(o, float)}
        assert sorted(finals) == list(range(12)) and set(finals[s] / (s + 1) for s in finals) == {3.0}, finals
        cluster.run(lambda i, comm: comm.update_topology())
        assert cluster.run(lambda i, comm: comm.group_world_size) == [3, 3, 3]
        assert metric(run.master, "lockstep_relay_processes") == 1


def test_a_master_without_the_secret_or_with_another_refuses_a_relay_process(tmp_path):
    secret = write_secret(tmp_path)
    plain = lockstep.Master("127.0.0.1:0")
    plain.run()
    other = tmp_path / "other"
    other.write_bytes(b"another secret of at least 16 bytes")
    other.chmod(0o600)
    keyed = lockstep.Master("127.0.0.1:0", secret_file=str(other))
    keyed.run()
    try:
        for master, why in ((plain, "without a run secret"), (keyed, "could not prove the run secret")):
            relay = RelayProcess(master.port, secret, tmp_path, f"refused{master.port}")
            try:
                assert relay.proc.wait(timeout=20) == 1
                assert "refuses this relay" in relay.stderr() and why in relay.stderr(), relay.stderr()
            finally:
                relay.close()
    finally:
        plain.close()
        keyed.close()


def test_lockstep_relay_checks_its_flags(tmp_path):
    secret = write_secret(tmp_path)
    for args, why in ((["--master", "127.0.0.1", "--secret-file", secret], "--master"),
                      (["--master", "127.0.0.1:1", "--secret-file", secret, "--listen", "nowhere"], "--listen"),
                      (["--master", "127.0.0.1:1", "--secret-file", os.devnull], "--secret-file")):
        done = subprocess.run([bin_path("lockstep-relay"), *args], capture_output=True, text=True, timeout=20)
        assert done.returncode == 2 and why in done.stderr, (args, done.stderr)
