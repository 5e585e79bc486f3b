"""PCCL programs on lockstep: C programs built against pccl.h alone (tests/pccl/pccl_peer.c),
run as 1-4 processes against a real lockstep master (docs/pccl.md).

Every scenario's checks run inside the programs (each prints "ok NAME" or "FAIL NAME:
why"); this driver starts the master and the processes, kills a peer where the scenario
asks for it, and checks that every process passed, that the results every peer printed a
digest of are bit-identical across peers, and that no process outlived its bound.

Environment: LOCKSTEP_BIN_DIR (lockstep-master, lockstep-testpeer), LOCKSTEP_PCCL_PEER (the
C program), LOCKSTEP_TEST_TIME_SCALE (slower builds: longer bounds).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from typing import Dict, List, Optional

import pytest

BIN_DIR = os.environ["LOCKSTEP_BIN_DIR"]
PEER = os.environ["LOCKSTEP_PCCL_PEER"]
TIME_SCALE = float(os.environ.get("LOCKSTEP_TEST_TIME_SCALE", "1"))
BOUND_S = 120 * TIME_SCALE


class Process:
    """A child whose stdout is read line by line on a thread of its own."""

    def __init__(self, args: List[str], env: Optional[Dict[str, str]] = None, stdin: bool = False) -> None:
        self.args = args
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})
        self.lines: List[str] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_line(self, pattern: str, timeout: float = BOUND_S) -> re.Match:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no line matching {pattern!r} from {self.args}:\n" + "\n".join(self.lines))
                self._cv.wait(min(left, 0.2))

    def finish(self, timeout: float = BOUND_S) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.args} did not end within {timeout:.0f} s:\n" + "\n".join(self.lines))
        self._reader.join(10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(10)


@pytest.fixture
def master():
    """lockstep-master on an ephemeral loopback port; yields the port."""
    yield from lockstep_master("127.0.0.1:0")


def lockstep_master(listen: str):
    """Runs lockstep-master on `listen` (port 0: ephemeral); yields its port."""
    proc = Process([os.path.join(BIN_DIR, "lockstep-master"), "--listen", listen,
                    "--heartbeat-timeout-ms", str(int(2000 * TIME_SCALE))])
    try:
        yield int(proc.wait_line(r"lockstep-master listening on \S+:(\d+)$", 30)[1])
    finally:
        proc.proc.send_signal(signal.SIGTERM)
        try:
            proc.finish(30)
        except AssertionError:
            proc.kill()


def start_peers(scenario: str, port: int, peers: int, extra: Optional[List[str]] = None,
                indices: Optional[List[int]] = None) -> List[Process]:
    procs = []
    for index in (range(peers) if indices is None else indices):
        procs.append(Process([PEER, scenario, "--port", str(port), "--index", str(index), "--peers", str(peers)]
                             + (extra or [])))
        # The first peer is admitted alone; the others register while it runs the loop.
        if index == 0 and peers > 1:
            time.sleep(0.2)
    return procs


def finish_all(procs: List[Process], expect_rc: Optional[List[int]] = None) -> List[List[str]]:
    outputs = []
    try:
        for i, proc in enumerate(procs):
            rc = proc.finish()
            out = "\n".join(proc.lines)
            want = 0 if expect_rc is None else expect_rc[i]
            assert rc == want, f"peer {i} exited with {rc}, expected {want}:\n{out}"
            if want == 0:
                assert "FAIL" not in out, f"peer {i}:\n{out}"
                assert "done" in proc.lines, f"peer {i}:\n{out}"
            outputs.append(proc.lines)
    finally:
        for proc in procs:
            proc.kill()
    return outputs


def digests(lines: List[str]) -> Dict[str, str]:
    return {m[1]: m[2] for line in lines if (m := re.match(r"digest (\S+) (\S+)$", line))}


def assert_bit_identical(outputs: List[List[str]]) -> int:
    """The results every peer printed a digest of are the same bits everywhere."""
    first = digests(outputs[0])
    assert first, "no digests printed"
    for i, lines in enumerate(outputs[1:], start=1):
        assert digests(lines) == first, f"peer {i} differs from peer 0"
    return len(first)


def checks(lines: List[str]) -> List[str]:
    return [line[3:] for line in lines if line.startswith("ok ")]


@pytest.mark.parametrize("peers", [2, 4])
def test_every_dtype_and_op(master, peers):
    outputs = finish_all(start_peers("collectives", master, peers))
    # 12 dtypes x 5 ops, out of place and in place, and two quantizations (+ their bytes).
    assert sum(c.startswith("allreduce_") for c in checks(outputs[0])) == 60
    assert sum(c.startswith("inplace_") for c in checks(outputs[0])) == 60
    assert assert_bit_identical(outputs) == 62


def test_ipv6_master_and_peers():
    """A PCCL socket address of protocol inetIPv6 (::1) reaches a master listening on
    [::1]: two PCCL peers join and run their all-reduces over IPv6."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    for port in lockstep_master("[::1]:0"):
        outputs = finish_all(start_peers("multiple", port, 2, extra=["--ipv6", "1"]))
        assert assert_bit_identical(outputs) > 0


def test_async_in_flight_awaited_out_of_order(master):
    outputs = finish_all(start_peers("async", master, 2))
    assert "async_tag_in_flight" in checks(outputs[0])
    assert assert_bit_identical(outputs) == 6


def test_multiple_with_retry(master):
    outputs = finish_all(start_peers("multiple", master, 3, ["--pool", "3"]))
    assert assert_bit_identical(outputs) == 1


def test_shared_state_popular_content_wins(master):
    outputs = finish_all(start_peers("sync", master, 3))
    for lines in outputs:
        assert {"sync_popular", "sync_allowed_inequality", "sync_bytes", "sync_unchanged"} <= set(checks(lines))
    assert_bit_identical(outputs)


def test_optimize_topology(master):
    finish_all(start_peers("optimize", master, 2))


def test_peer_killed_mid_all_reduce(master):
    """Peer 2 of 3 is SIGKILLed while 16 MiB all-reduces run: the survivors retry
    (pcclRankConnectionLost, recvbuf as before), go on with two, and the last one alone
    gets pcclTooFewPeers from the retry helper. (The status a lost peer maps to is also
    pinned by pccl_status_map_test, whatever moment the kill hits.)"""
    procs = start_peers("churn", master, 3, ["--victim", "2", "--iterations", "3"])
    try:
        for proc in procs:
            proc.wait_line(r"^iteration 1 ")
    except AssertionError:
        finish_all(procs)
        raise
    procs[2].kill()
    outputs = finish_all(procs[:2])
    for lines in outputs:
        assert {"churn_restored", "churn_survivors"} <= set(checks(lines))
    # Where the kill fell inside an all-reduce's data (almost always: they run back to
    # back), an attempt failed and churn_restored checked the buffer; where it fell in a
    # vote, the master removed the peer first and the attempt went on with two.
    lost = [int(m[1]) for lines in outputs for line in lines if (m := re.match(r"lost (\d+)$", line))]
    assert len(lost) == 2, lost
    assert {"churn_alone", "churn_alone_async"} <= set(checks(outputs[0]))


def test_invalid_calls_get_pccl_codes(master):
    outputs = finish_all(start_peers("errors", master, 1))
    assert len(checks(outputs[0])) >= 50


def test_embedded_master_serves_pccl_programs():
    """pcclCreateMaster + pcclRunMaster in one process, two PCCL peers against it."""
    for _ in range(5):
        with socket.socket() as s:  # a free port for the master (PCCL's API cannot report one)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        master_proc = Process([PEER, "master", "--port", str(port)], stdin=True)
        try:
            master_proc.wait_line(r"^master running$", 30 * TIME_SCALE)
        except AssertionError:
            if master_proc.finish() == 75:  # the port was taken meanwhile: another one
                continue
            raise
        try:
            finish_all(start_peers("multiple", port, 2))
        finally:
            assert master_proc.proc.stdin is not None
            master_proc.proc.stdin.close()
        assert master_proc.finish() == 0, "\n".join(master_proc.lines)
        assert {"ok master_run_twice", "ok master_await_uninterrupted", "ok master_destroy_twice"} <= set(master_proc.lines)
        return
    pytest.fail("no free port for the embedded master")


def test_mixed_run_with_a_native_peer(master):
    """A native lockstep peer (lockstep-testpeer) and a PCCL program in one run: one
    all-reduce, each side checking the sum of both contributions."""
    native = Process([os.path.join(BIN_DIR, "lockstep-testpeer"), "--master", f"127.0.0.1:{master}",
                      "--base-port", "0", "--name", "native"], stdin=True)
    assert native.proc.stdin is not None

    def command(text: str, op: str) -> dict:
        count = len([line for line in native.lines if line.startswith("{")])
        native.proc.stdin.write(text + "\n")
        native.proc.stdin.flush()
        deadline = time.monotonic() + BOUND_S
        while True:
            replies = [line for line in native.lines if line.startswith("{")]
            if len(replies) > count:
                reply = json.loads(replies[count])
                assert reply.get("op") == op, reply
                return reply
            assert time.monotonic() < deadline and native.proc.poll() is None, "\n".join(native.lines)
            time.sleep(0.02)

    try:
        assert command("connect", "connect")["code"] == 0
        pccl = start_peers("fill", master, 2, ["--count", "100000", "--tag", "77", "--fill", "5", "--expect", "8"],
                           indices=[1])
        deadline = time.monotonic() + BOUND_S
        while not command("pending", "pending").get("pending"):
            assert time.monotonic() < deadline, "the PCCL peer never registered"
            time.sleep(0.05)
        while command("update", "update")["code"] != 0:
            pass
        reply = command("allreduce 100000 77 3", "allreduce")
        assert reply["code"] == 0 and reply["value"] == 8 and reply["uniform"] and reply["world"] == 2, reply
        finish_all(pccl)
        native.proc.stdin.write("exit\n")
        native.proc.stdin.flush()
        native.finish(30)
    finally:
        native.kill()
