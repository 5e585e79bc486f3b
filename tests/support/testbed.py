"""Pytest support for the lockstep WAN test bed (see docs/testbed.md).

Use it from a conftest.py:

    sys.path.insert(0, "<repo>/tests/support")
    pytest_plugins = ["testbed"]

then in a test:

    def test_something(testbed_factory):
        bed = testbed_factory(4)              # hosts 0..3, a unique prefix
        bed.cap(0, 1, "200mbit")
        bed.delay(0, 1, 25, both=True)
        proc = bed.popen(1, "my-server", "--port", "7000")   # pid = the process itself
        out = bed.exec(0, "my-client", bed.addr(1)).stdout

Every bed is taken down when the test ends, passed or failed. A bed whose test process
died (killed on timeout) is taken down by the next `lockstep-testbed gc`, which the
factory runs before bringing a bed up. Without root the fixture fails the test with a
clear message; it never skips.

The command is found from $LOCKSTEP_TESTBED, else lockstep-testbed on PATH.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
from typing import Iterable, Sequence

import pytest


# A Python program for `bed.exec(host, python, "-c", TCP_CONNECT, address, port, timeout)`:
# prints "connected" when a TCP connection to address:port opens within timeout seconds,
# else "failed" and why.
TCP_CONNECT = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except OSError as e:
    print("failed", e)
"""


class TestbedError(RuntimeError):
    """A lockstep-testbed command failed."""

    __test__ = False  # not a test class, despite the name


def testbed_command() -> str:
    cmd = os.environ.get("LOCKSTEP_TESTBED")
    if cmd:
        if not os.access(cmd, os.X_OK):
            raise TestbedError(f"LOCKSTEP_TESTBED={cmd} is not an executable file")
        return cmd
    found = shutil.which("lockstep-testbed")
    if not found:
        raise TestbedError("lockstep-testbed not found: build it (it lands in <build>/bin) "
                           "and set LOCKSTEP_TESTBED to its path")
    return found


def require_root() -> None:
    """Fails the current test (not a skip) if the bed cannot work here."""
    if os.geteuid() != 0:
        pytest.fail("the lockstep test bed needs root (network namespaces, tc, iptables): "
                    "run the tests as root", pytrace=False)
    if not os.path.isdir("/proc/self/ns") or not os.path.exists("/proc/self/ns/net"):
        pytest.fail("the lockstep test bed needs Linux network namespaces, which this "
                    "system does not offer", pytrace=False)


def unique_prefix() -> str:
    # "t" and 8 hex digits: 9 characters, so interface names stay within 15.
    return "t" + secrets.token_hex(4)


class Testbed:
    """One bed: hosts 0..hosts-1 in network namespaces named <prefix>h<i>."""

    __test__ = False  # not a test class, despite the name

    def __init__(self, hosts: int, *, prefix: str | None = None, cc: str | None = None,
                 tcp_mem_max: int | None = None, subnet: str | None = None,
                 command: str | None = None, ipv6: bool = False):
        self.hosts = hosts
        self.ipv6 = ipv6
        self.prefix = prefix or unique_prefix()
        self.cc = cc
        self.tcp_mem_max = tcp_mem_max
        self.subnet = subnet
        self.command = command or testbed_command()
        self.is_up = False
        self._addrs: list[str] = []

    # -- running the command ------------------------------------------------------
    def run(self, *args: object, check: bool = True, timeout: float = 120,
            input: str | None = None) -> subprocess.CompletedProcess:
        argv = [self.command, "--prefix", self.prefix, *map(str, args)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              input=input, stdin=None if input is not None else subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise TestbedError(f"{' '.join(argv)} failed ({proc.returncode}):\n"
                               f"{proc.stdout}{proc.stderr}")
        return proc

    # -- life cycle ---------------------------------------------------------------
    def up(self) -> "Testbed":
        # Beds left by dead test processes go first.
        subprocess.run([self.command, "gc"], capture_output=True, text=True, timeout=120)
        args: list[object] = ["up", self.hosts, "--owner", os.getpid()]
        if self.cc:
            args += ["--cc", self.cc]
        if self.tcp_mem_max:
            args += ["--tcp-mem-max", self.tcp_mem_max]
        if self.subnet:
            args += ["--subnet", self.subnet]
        if self.ipv6:
            args.append("--ipv6")
        self.run(*args)
        self.is_up = True
        self._addrs = self.status()["addresses"]
        return self

    def down(self) -> None:
        self.run("down")
        self.is_up = False

    def __enter__(self) -> "Testbed":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- hosts --------------------------------------------------------------------
    def addr(self, host: int) -> str:
        return self._addrs[host]

    def addr6(self, host: int) -> str:
        """The host's IPv6 address (a bed made with ipv6=True)."""
        return self.run("addr", host, "--6").stdout.strip()

    def namespace(self, host: int) -> str:
        return f"{self.prefix}h{host}"

    @property
    def namespaces(self) -> list[str]:
        return [self.namespace(i) for i in range(self.hosts)] + [self.prefix + "hub"]

    def exec(self, host: int | str, *cmd: object, check: bool = True, timeout: float = 60,
             input: str | None = None) -> subprocess.CompletedProcess:
        """Runs cmd inside the host's namespace and waits for it."""
        return self.run("exec", host, *cmd, check=check, timeout=timeout, input=input)

    def popen(self, host: int | str, *cmd: object, **kwargs) -> subprocess.Popen:
        """Starts cmd inside the host's namespace; the Popen's pid is cmd's own pid, so
        SIGSTOP (a silent peer) and SIGKILL (a crash) reach it directly."""
        argv = [self.command, "--prefix", self.prefix, "exec", str(host), *map(str, cmd)]
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(argv, **kwargs)

    def nat(self, host: int) -> None:
        """Puts the host behind a NAT (docs/testbed.md): its processes (started after this)
        reach the others with the host's address, and nothing reaches them from outside."""
        self.run("nat", host)

    # -- links --------------------------------------------------------------------
    def cap(self, src: int, dst: int, rate: str, *, both: bool = False,
            queue: int | None = None) -> None:
        args: list[object] = ["cap", src, dst, rate]
        if queue is not None:
            args += ["--queue", queue]
        self.run(*args, *(["--both"] if both else []))

    def uncap(self, src: int | None = None, dst: int | None = None, *, both: bool = False) -> None:
        self.run("uncap", *self._pair(src, dst), *(["--both"] if both else []))

    def delay(self, src: int, dst: int, ms: float, *, both: bool = False) -> None:
        self.run("delay", src, dst, ms, *(["--both"] if both else []))

    def undelay(self, src: int | None = None, dst: int | None = None, *, both: bool = False) -> None:
        self.run("undelay", *self._pair(src, dst), *(["--both"] if both else []))

    def loss(self, src: int, dst: int, rate: float | str, *, both: bool = False) -> None:
        """Drops each wire packet src->dst with probability `rate` (0.001, or "0.1%")."""
        self.run("loss", src, dst, rate, *(["--both"] if both else []))

    def jitter(self, src: int, dst: int, ms: float, *, reorder: bool = False,
               both: bool = False) -> None:
        """Adds 0..ms milliseconds to each packet src->dst, in order unless `reorder`."""
        self.run("jitter", src, dst, ms, *(["--reorder"] if reorder else []),
                 *(["--both"] if both else []))

    def bottleneck(self, host: int, direction: str, rate: str, *, fq: str | bool = False,
                   queue: int | None = None) -> None:
        """Caps everything `host` sends ("egress") or receives ("ingress"); fq=True for
        the bed's per-flow fair queuing, or "sfq"/"fq_codel" for the kernel's."""
        args: list[object] = ["bottleneck", host, direction, rate]
        if fq:
            args += ["--fq"] + ([] if fq is True else [fq])
        if queue is not None:
            args += ["--queue", queue]
        self.run(*args)

    def cut(self, src: int, dst: int, *, both: bool = False) -> None:
        self.run("cut", src, dst, *(["--both"] if both else []))

    def heal(self, src: int | None = None, dst: int | None = None, *, both: bool = False) -> None:
        self.run("heal", *self._pair(src, dst), *(["--both"] if both else []))

    @staticmethod
    def _pair(src: int | None, dst: int | None) -> list[object]:
        if (src is None) != (dst is None):
            raise ValueError("give both src and dst, or neither")
        return [] if src is None else [src, dst]

    # -- inspection -----------------------------------------------------------------
    def status(self) -> dict:
        return json.loads(self.run("status", "--json").stdout)

    def stats(self) -> list[dict]:
        """The counters: one dict per delay program (keys src, dst) and per bottleneck
        (keys host, bottleneck)."""
        return [json.loads(line) for line in self.run("stats").stdout.splitlines() if line.startswith("{")]

    def check(self, *pairs: Sequence[int], seconds: int = 3, omit: int = 1, streams: int = 4,
              concurrent: bool = False, rtt_only: bool = False) -> list[dict]:
        """Runs the self-check; returns one dict per pair (see docs/testbed.md). Pairs
        out of tolerance do not raise: look at each result's "ok"."""
        args: list[object] = ["check", "--json", "--time", seconds, "--omit", omit,
                              "--streams", streams]
        if concurrent:
            args.append("--concurrent")
        if rtt_only:
            args.append("--rtt-only")
        args += [f"{s}:{d}" for s, d in pairs]
        proc = self.run(*args, check=False, timeout=60 + len(pairs) * (seconds + omit + 10))
        if proc.returncode not in (0, 1):
            raise TestbedError(f"check failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


_sigterm_installed = False


def _sigterm_to_interrupt() -> None:
    """A SIGTERM (CTest's or a CI runner's) unwinds the test so its beds come down."""
    global _sigterm_installed
    if _sigterm_installed or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    _sigterm_installed = True


@pytest.fixture
def testbed_factory():
    """testbed_factory(hosts, **options) -> an up Testbed; all are taken down at the end."""
    beds: list[Testbed] = []

    def make(hosts: int, **options) -> Testbed:
        require_root()
        _sigterm_to_interrupt()
        bed = Testbed(hosts, **options)
        beds.append(bed)
        bed.up()
        return bed

    yield make
    errors = []
    for bed in reversed(beds):
        try:
            bed.down()
        except Exception as e:  # noqa: BLE001 - report every bed that failed to go
            errors.append(str(e))
    if errors:
        pytest.fail("taking the test bed down failed:\n" + "\n".join(errors), pytrace=False)


@pytest.fixture
def testbed(request, testbed_factory) -> Testbed:
    """A bed of 2 hosts, or as set by @pytest.mark.testbed(hosts=N, cc=..., ...)."""
    marker = request.node.get_closest_marker("testbed")
    options = dict(marker.kwargs) if marker else {}
    hosts = options.pop("hosts", 2)
    return testbed_factory(hosts, **options)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "testbed(hosts=2, **options): options of the testbed fixture")


def bed_namespaces(prefixes: Iterable[str]) -> list[str]:
    """Namespaces that exist now and belong to one of the given bed prefixes."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    result = []
    for n in names:
        for p in prefixes:
            rest = n[len(p):] if n.startswith(p) else None
            if rest is not None and (rest == "hub" or (rest.startswith("h") and rest[1:].isdigit())):
                result.append(n)
    return result
