"""A real lockstep-master process with its HTTP endpoint, lockstep-testpeer processes
driven line by line, and a strict parser of the Prometheus text format: the pieces of
the observability tests (test_observability.py, test_status_page.py).

The executables come from LOCKSTEP_BIN_DIR (set by tests/CMakeLists.txt). Every wait is
bounded; every process is started in a session of its own and killed at the end."""

from __future__ import annotations

import json
import math
import os
import re
import select
import signal
import subprocess
import tempfile
import time
import urllib.request
from typing import Dict, List, Optional, Tuple

# The build's LOCKSTEP_TEST_TIME_SCALE (slower builds give live peers more time).
TIME_SCALE = float(os.environ.get("LOCKSTEP_TEST_TIME_SCALE", "1"))
WAIT_S = 30 * TIME_SCALE


def bin_path(name: str) -> str:
    bin_dir = os.environ.get("LOCKSTEP_BIN_DIR")
    assert bin_dir, "LOCKSTEP_BIN_DIR is not set (run the test through CTest)"
    path = os.path.join(bin_dir, name)
    assert os.access(path, os.X_OK), f"{path} is not built"
    return path


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Kills the process's whole session (it was started with start_new_session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def peer_name(hex_id: str) -> str:
    """The master's short form of a peer id (PeerId::to_string) from the 32 hex digits
    the C API gives (the nonce, then the counter, both big-endian)."""
    hi, lo = int(hex_id[:16], 16), int(hex_id[16:], 16)
    return f"p{lo}-{hi >> 40:06x}"


class LineReader:
    """Lines from a pipe with a bounded wait (select on the descriptor, its own buffer:
    a buffered file object may hold lines that select cannot see)."""

    def __init__(self, pipe) -> None:
        self.fd = pipe.fileno()
        self.buffer = b""

    def ready(self) -> bool:
        return b"\n" in self.buffer or bool(select.select([self.fd], [], [], 0)[0])

    def readline(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"no line within {timeout} s")
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return ""  # the other end closed
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode("utf-8", "replace") + "\n"


class MasterProcess:
    """lockstep-master --listen 127.0.0.1:0 --http 127.0.0.1:0, with its log in a file."""

    def __init__(self, *extra: str) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="lockstep-master-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([bin_path("lockstep-master"), "--listen", "127.0.0.1:0", "--http",
                                      "127.0.0.1:0", "--log-level", "info", *extra],
                                     stdout=subprocess.PIPE, stderr=self.log, start_new_session=True)
        self.address = ""
        self.http = ""
        deadline = time.monotonic() + WAIT_S
        out = LineReader(self.proc.stdout)
        try:
            while not (self.address and self.http):
                line = out.readline(max(0.0, deadline - time.monotonic()))
                assert line, f"the master exited: {self.log_text()}"
                if m := re.match(r"lockstep-master http listening on (\S+)$", line.strip()):
                    self.http = m.group(1)
                elif m := re.match(r"lockstep-master listening on (\S+)$", line.strip()):
                    self.address = m.group(1)
        except BaseException:
            self.close()
            raise

    def url(self, path: str) -> str:
        return f"http://{self.http}{path}"

    def get(self, path: str) -> Tuple[int, Dict[str, str], str]:
        with urllib.request.urlopen(self.url(path), timeout=10) as response:
            return response.status, dict(response.headers), response.read().decode("utf-8")

    def state(self) -> dict:
        status, headers, body = self.get("/api/state")
        assert status == 200 and headers["Content-Type"].startswith("application/json")
        return json.loads(body)

    def metrics(self) -> "Metrics":
        status, headers, body = self.get("/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse_prometheus(body)

    def log_text(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def close(self) -> None:
        stop_process(self.proc, signal.SIGTERM)
        self.log.close()
        os.unlink(self.log.name)


class Peer:
    """A lockstep-testpeer process: one JSON line answers each command."""

    def __init__(self, master: MasterProcess, name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen([bin_path("lockstep-testpeer"), "--master", master.address, "--base-port", "0",
                                      "--name", name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.out = LineReader(self.proc.stdout)
        self.id = ""

    def send(self, line: str) -> None:
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def reply(self, timeout: float = WAIT_S) -> dict:
        line = self.out.readline(timeout)
        assert line, f"{self.name}: exited"
        r = json.loads(line)
        if r.get("id"):
            self.id = peer_name(r["id"])
        return r

    def call(self, line: str) -> dict:
        self.send(line)
        r = self.reply()
        assert r["code"] == 0, r
        return r

    def kill(self) -> None:
        stop_process(self.proc)

    def close(self) -> None:
        stop_process(self.proc)


def all_call(peers: List[Peer], line: str) -> List[dict]:
    """Sends the same command to every peer at once (a vote), then reads every answer."""
    for p in peers:
        p.send(line)
    answers = [p.reply() for p in peers]
    assert all(a["code"] == 0 for a in answers), answers
    return answers


def admit(members: List[Peer], newcomers: List[Peer]) -> int:
    """Admits the newcomers by the members' votes (the first one into an empty run joins
    alone). Returns the number of successful update-topology rounds it took, counting the
    admission into an empty run."""
    rounds = 0
    waiting = list(newcomers)
    if not members:
        first = waiting.pop(0)
        first.call("connect")
        members.append(first)
        rounds += 1
    for p in waiting:
        p.send("connect")
    deadline = time.monotonic() + WAIT_S
    while waiting:
        assert time.monotonic() < deadline, "newcomers were not admitted in time"
        if not any(a["pending"] for a in all_call(members, "pending")):
            time.sleep(0.05)
            continue
        accepted = len(all_call(members, "update")[0]["view"])
        rounds += 1
        # Those admitted answer their connect; collect them all before the next vote,
        # which every accepted peer must join.
        while len(members) < accepted:
            assert time.monotonic() < deadline, "admitted newcomers did not answer"
            for p in list(waiting):
                if p.out.ready():
                    r = p.reply()
                    assert r["code"] == 0, r
                    waiting.remove(p)
                    members.append(p)
            time.sleep(0.01)
    return rounds


# ---------------------------------------------------------------- Prometheus text format

Sample = Tuple[str, Tuple[Tuple[str, str], ...], float]

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\\\|\\"|\\n)*)"'
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{((?:{_LABEL})(?:,{_LABEL})*)?\}})? (\S+)(?: (-?\d+))?$")


class Metrics:
    def __init__(self) -> None:
        self.types: Dict[str, str] = {}
        self.samples: List[Sample] = []

    def get(self, name: str, **labels: str) -> Optional[float]:
        """The value of the one sample with exactly these labels, or None."""
        want = tuple(sorted(labels.items()))
        found = [v for n, l, v in self.samples if n == name and tuple(sorted(l)) == want]
        assert len(found) <= 1, f"{name}{labels} appears {len(found)} times"
        return found[0] if found else None

    def value(self, name: str, **labels: str) -> float:
        v = self.get(name, **labels)
        assert v is not None, f"no sample {name}{labels}"
        return v

    def total(self, name: str, **labels: str) -> float:
        """The sum over every sample of the name whose labels include these."""
        return sum(v for n, l, v in self.samples if n == name and set(labels.items()) <= set(l))


def _family_of(name: str, types: Dict[str, str]) -> Optional[str]:
    if name in types:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[: -len(suffix)] if name.endswith(suffix) else None
        if base and types.get(base) in ("histogram", "summary"):
            return base
    return None


def parse_prometheus(text: str) -> Metrics:
    """Parses the text exposition format (0.0.4) strictly: every line is a HELP, a TYPE
    or a sample; HELP and TYPE come once per family, before its samples; every sample
    belongs to a declared family, appears once, and has a valid value; histograms have
    cumulative buckets ending in le="+Inf" equal to _count."""
    m = Metrics()
    helps = set()
    seen = set()
    families_done = set()
    current = None
    assert text.endswith("\n"), "the exposition must end with a newline"
    for number, line in enumerate(text.split("\n")[:-1], 1):
        where = f"line {number}: {line!r}"
        assert line, f"{where}: empty line"
        if line.startswith("#"):
            parts = line.split(" ", 3)
            assert len(parts) >= 3 and parts[1] in ("HELP", "TYPE"), f"{where}: a comment that is neither HELP nor TYPE"
            name = parts[2]
            assert re.fullmatch(_NAME, name), f"{where}: bad metric name"
            assert name not in families_done, f"{where}: family {name} continues after another began"
            if parts[1] == "HELP":
                assert name not in helps, f"{where}: second HELP"
                helps.add(name)
            else:
                assert len(parts) == 4 and parts[3] in ("counter", "gauge", "histogram", "summary", "untyped"), where
                assert name not in m.types, f"{where}: second TYPE"
                m.types[name] = parts[3]
            if current is not None and current != name:
                families_done.add(current)
            current = name
            continue
        match = _SAMPLE.match(line)
        assert match, f"{where}: not a sample"
        name = match.group(1)
        family = _family_of(name, m.types)
        assert family is not None, f"{where}: sample of an undeclared family"
        assert family == current, f"{where}: sample outside its family's block"
        labels = tuple(re.findall(_LABEL, match.group(2) or ""))
        assert len({k for k, _ in labels}) == len(labels), f"{where}: repeated label"
        raw = match.group(len(match.groups()) - 1)
        assert re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?|NaN|[+-]Inf", raw), f"{where}: bad value"
        value = float(raw.replace("Inf", "inf"))
        if m.types[family] == "counter":
            assert value >= 0 and not math.isnan(value), f"{where}: a counter must be a number >= 0"
        key = (name, tuple(sorted(labels)))
        assert key not in seen, f"{where}: duplicate sample"
        seen.add(key)
        m.samples.append((name, tuple(sorted(labels)), value))
    # Histograms: cumulative buckets, +Inf last and equal to _count.
    for family, kind in m.types.items():
        if kind != "histogram":
            continue
        series: Dict[tuple, List[Tuple[float, float]]] = {}
        for name, labels, value in m.samples:
            if name == family + "_bucket":
                rest = tuple(kv for kv in labels if kv[0] != "le")
                le = dict(labels)["le"]
                series.setdefault(rest, []).append((float(le.replace("Inf", "inf")), value))
        for rest, buckets in series.items():
            bounds = [b for b, _ in buckets]
            assert bounds == sorted(bounds) and bounds[-1] == math.inf, f"{family}{rest}: bucket bounds"
            counts = [c for _, c in buckets]
            assert counts == sorted(counts), f"{family}{rest}: buckets are not cumulative"
            count = m.get(family + "_count", **dict(rest))
            assert count == counts[-1], f"{family}{rest}: +Inf bucket differs from _count"
            assert m.get(family + "_sum", **dict(rest)) is not None, f"{family}{rest}: no _sum"
    return m
