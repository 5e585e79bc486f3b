"""Real lockstep peers on the WAN test bed: lockstep-testpeer processes inside the bed's
hosts, driven line by line (one JSON reply per command), and the admission loop. Used by
tests/testbed/test_lockstep_wan.py and scripts/bench-wan-sync.py."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time


class TestPeer:
    """A lockstep-testpeer in a host of the bed, driven line by line."""

    __test__ = False

    def __init__(self, bed, bin_dir: str, host: int, master: str, name: str, extra: tuple = ()):
        self.name = name
        self.proc = bed.popen(host, os.path.join(bin_dir, "lockstep-testpeer"), "--master", master,
                              "--base-port", "0", "--name", name, *extra,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, bufsize=1)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float = 120) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"{self.name}: no reply within {timeout} s"
        line = self.proc.stdout.readline()
        assert line, f"{self.name}: exited"
        return json.loads(line)

    def call(self, line: str, timeout: float = 120) -> dict:
        self.send(line)
        r = self.reply(timeout)
        assert r["code"] == 0, r
        return r

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def start_master(bed, bin_dir: str, host: int, *extra: str) -> subprocess.Popen:
    master = bed.popen(host, os.path.join(bin_dir, "lockstep-master"), "--listen", f"{bed.addr(host)}:7000", *extra,
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ready, _, _ = select.select([master.stdout], [], [], 10)
    assert ready and "listening" in master.stdout.readline()
    return master


def admit(members: list[TestPeer], newcomers: list[TestPeer], timeout: float = 60) -> None:
    """The newcomers connect and are admitted by the members' are-peers-pending and
    update-topology votes (into an empty run, the first newcomer joins alone first).
    `members` grows by those admitted, in ring (join) order."""
    waiting = list(newcomers)
    if not members:
        first = waiting.pop(0)
        first.call("connect")
        members.append(first)
    for p in waiting:
        p.send("connect")
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        for p in members:
            p.send("pending")
        answers = [p.reply() for p in members]
        assert all(a.get("code") == 0 and "pending" in a for a in answers), answers
        if not any(a["pending"] for a in answers):
            time.sleep(0.05)
            continue
        for p in members:
            p.send("update")
        updates = [p.reply() for p in members]
        assert all(u.get("code") == 0 for u in updates), updates
        world = updates[0]["world"]
        while len(members) < world:
            ready, _, _ = select.select([p.proc.stdout for p in waiting], [], [], 30)
            assert ready, "an admitted peer did not answer"
            joined = next(p for p in waiting if p.proc.stdout in ready)
            assert joined.reply()["code"] == 0
            members.append(joined)
            waiting.remove(joined)
    assert not waiting, "not every peer was admitted"
