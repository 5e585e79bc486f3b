"""Operating a run (docs/operations.md), against real processes: lockstep-master started
from a configuration file (each kind of bad file refused with its line; a flag overrides
the file), its HTTP access token (401 without it or with a wrong one, 200 with it, for
the page, /api/state and /metrics; refusals logged at a bounded rate), lockstep-status
against a scripted run (--json is /api/state; the text names every peer and open vote;
unreachable, 401 and malformed answers give their own exit codes), eviction by the
operator (the evicted peer is told, the others carry on), and the rotation of the run
secret on SIGHUP (both secrets admit newcomers during the window, only the new one
after it)."""

from __future__ import annotations

import base64
import http.server
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional, Tuple

import pytest

import lockstep
from conftest import free_port
from observed_run import WAIT_S, LineReader, Peer, admit, all_call, bin_path, peer_name, stop_process

TOKEN = "0123456789abcdef-operations-token"
KICKED = 14
AUTHENTICATION_FAILED = 24

# lockstep-status's exit codes (tools/status/main.cpp)
EXIT_UNREACHABLE, EXIT_UNAUTHORIZED, EXIT_BAD_ANSWER, EXIT_EVICT_REFUSED = 3, 4, 5, 6


@pytest.fixture
def workdir():
    with tempfile.TemporaryDirectory(prefix="lockstep-ops-") as d:
        yield d


def write(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


class Master:
    """lockstep-master with the given arguments; waits for the lines announcing its ports."""

    def __init__(self, *args: str, http: bool = True) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="lockstep-master-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([bin_path("lockstep-master"), "--log-level", "info", *args],
                                     stdout=subprocess.PIPE, stderr=self.log, start_new_session=True)
        self.address = ""
        self.http = ""
        out = LineReader(self.proc.stdout)
        deadline = time.monotonic() + WAIT_S
        try:
            while not (self.address and (self.http or not http)):
                line = out.readline(max(0.0, deadline - time.monotonic()))
                assert line, f"the master exited: {self.log_text()}"
                if m := re.match(r"lockstep-master http listening on (\S+)$", line.strip()):
                    self.http = m.group(1)
                elif m := re.match(r"lockstep-master listening on (\S+)$", line.strip()):
                    self.address = m.group(1)
        except BaseException:
            self.close()
            raise

    def get(self, path: str, authorization: Optional[str] = None) -> Tuple[int, str]:
        request = urllib.request.Request(f"http://{self.http}{path}")
        if authorization is not None:
            request.add_header("Authorization", authorization)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read().decode("utf-8")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8")

    def state(self) -> dict:
        status, body = self.get("/api/state", f"Bearer {TOKEN}")
        assert status == 200, body
        return json.loads(body)

    def log_text(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def close(self) -> None:
        stop_process(self.proc, signal.SIGTERM)
        self.log.close()
        os.unlink(self.log.name)


def run_master(*args: str, timeout: float = 10) -> subprocess.CompletedProcess:
    """A master that is expected to refuse to start."""
    return subprocess.run([bin_path("lockstep-master"), *args], capture_output=True, text=True, timeout=timeout)


def status_tool(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([bin_path("lockstep-status"), *args], capture_output=True, text=True, timeout=timeout)


class SecretPeer(Peer):
    """A lockstep-testpeer with a secret file."""

    def __init__(self, master: Master, name: str, secret_file: str) -> None:  # noqa: D401 - same protocol as Peer
        self.name = name
        self.proc = subprocess.Popen([bin_path("lockstep-testpeer"), "--master", master.address, "--base-port", "0",
                                      "--name", name, "--secret-file", secret_file],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self.out = LineReader(self.proc.stdout)
        self.id = ""


# ---------------------------------------------------------------- the configuration file


def test_a_master_started_from_its_configuration_file_listens_where_the_file_says(workdir):
    port = free_port()
    write(os.path.join(workdir, "token"), TOKEN + "\n")
    write(os.path.join(workdir, "run.secret"), "a run secret of more than sixteen bytes\n")
    config = write(os.path.join(workdir, "master.conf"), f"""# lockstep-master as a service
listen = "127.0.0.1:{port}"
heartbeat-timeout-ms = 4000     # a comment after a value
http = 127.0.0.1:0
http-token-file = token         # relative to this file's directory
secret-file = "run.secret"
max-peers = 16
log-level = info
""")
    master = Master("--config", config)
    try:
        assert master.address == f"127.0.0.1:{port}"
        assert master.get("/api/state")[0] == 401  # the file's token file is in force
        assert master.state()["peers"] == []
    finally:
        master.close()


def test_a_flag_overrides_the_configuration_file(workdir):
    port = free_port()
    config = write(os.path.join(workdir, "master.conf"), f"listen = 127.0.0.1:{port}\nhttp = 127.0.0.1:0\n")
    master = Master("--config", config, "--listen", "127.0.0.1:0")
    try:
        assert master.address.startswith("127.0.0.1:") and master.address != f"127.0.0.1:{port}"
    finally:
        master.close()


@pytest.mark.parametrize("body, line, reason", [
    ("listen = 127.0.0.1:0\nheartbeat-timeouts-ms = 4000\n", 2, "unknown key 'heartbeat-timeouts-ms'"),
    ("listen = 127.0.0.1:0\n# fast\nheartbeat-timeout-ms = \"fast\"\n", 3,
     "heartbeat-timeout-ms: wrong type: expected a non-negative integer"),
    ("heartbeat-timeout-ms = 4s\n", 1, "heartbeat-timeout-ms: wrong type"),
    ("http-insecure = yes\n", 1, "http-insecure: wrong type: expected true or false"),
    ("listen = 127.0.0.1:0\n\n\nheartbeat-timeout-ms = 10\n", 4, "heartbeat-timeout-ms: out of range"),
    ("bandwidth-streams = 65\n", 1, "bandwidth-streams: out of range"),
    ("log-level = loud\n", 1, "log-level: loud not in"),
    ("listen = 127.0.0.1:0\nsecret-file = /nonexistent/run.secret\n", 2,
     "secret-file: cannot read the secret file '/nonexistent/run.secret'"),
    ("http = 127.0.0.1:0\nhttp-token-file = no-such-token\n", 2, "http-token-file: cannot read the token file"),
    ("listen = 127.0.0.1\n", 1, "listen: must be HOST:PORT"),
    ("listen = 127.0.0.1:0\nlisten = 127.0.0.1:1\n", 2, "listen is given twice (first on line 1)"),
    ("[master]\n", 1, "sections are not supported"),
    ("listen\n", 1, "expected `key = value`"),
])
def test_a_bad_configuration_file_stops_the_master_naming_the_line(workdir, body, line, reason):
    config = write(os.path.join(workdir, "master.conf"), body)
    result = run_master("--config", config)
    assert result.returncode == 2, result
    assert f"{config}:{line}: " in result.stderr, result.stderr
    assert reason in result.stderr, result.stderr
    assert "listening" not in result.stdout


def test_a_short_secret_in_the_file_is_refused_with_its_line(workdir):
    write(os.path.join(workdir, "short.secret"), "too short\n")
    config = write(os.path.join(workdir, "master.conf"), "listen = 127.0.0.1:0\nsecret-file = short.secret\n")
    result = run_master("--config", config)
    assert result.returncode == 2 and f"{config}:2: secret-file: " in result.stderr and "at least 16" in result.stderr


# ---------------------------------------------------------------- the access token


def test_non_loopback_http_needs_a_token_or_an_explicit_insecure_flag(workdir):
    result = run_master("--listen", "127.0.0.1:0", "--http", "0.0.0.0:0")
    assert result.returncode == 2
    assert "--http: 0.0.0.0 is not a loopback address and no access token is set" in result.stderr
    master = Master("--listen", "127.0.0.1:0", "--http", "0.0.0.0:0", "--http-insecure")
    try:
        assert "serving HTTP on 0.0.0.0 without an access token" in master.log_text()
    finally:
        master.close()
    write(os.path.join(workdir, "token"), TOKEN)
    master = Master("--listen", "127.0.0.1:0", "--http", "0.0.0.0:0", "--http-token-file",
                    os.path.join(workdir, "token"))
    master.close()


def test_every_path_wants_the_token(workdir):
    token_file = write(os.path.join(workdir, "token"), TOKEN + "\n")
    master = Master("--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--http-token-file", token_file)
    try:
        basic = "Basic " + base64.b64encode(f"operator:{TOKEN}".encode()).decode()
        for path in ("/", "/api/state", "/metrics"):
            assert master.get(path)[0] == 401, path
            assert master.get(path, "Bearer " + TOKEN[:-1] + "X")[0] == 401, path
            assert master.get(path, "Bearer " + TOKEN + "X")[0] == 401, path
            assert master.get(path, "Bearer " + TOKEN[:-1])[0] == 401, path
            assert master.get(path, "Basic " + base64.b64encode(b"operator:wrong").decode())[0] == 401, path
            assert master.get(path, "Bearer " + TOKEN)[0] == 200, path
            assert master.get(path, basic)[0] == 200, path
        status, body = master.get("/api/state")
        assert status == 401 and "access token" in json.loads(body)["error"]
        # 6 x 3 refusals above and one more: logged once within the interval (10 s)
        refusals = [line for line in master.log_text().splitlines() if "refused GET" in line]
        assert len(refusals) == 1, refusals
        assert "no access token" in refusals[0]
    finally:
        master.close()


def test_too_short_a_token_is_refused_at_start(workdir):
    token_file = write(os.path.join(workdir, "token"), "short\n")
    result = run_master("--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--http-token-file", token_file)
    assert result.returncode == 2 and "--http-token-file: " in result.stderr and "at least 16" in result.stderr


# ---------------------------------------------------------------- lockstep-status


@pytest.fixture
def token_file(workdir):
    return write(os.path.join(workdir, "token"), TOKEN + "\n")


@pytest.fixture
def master(token_file):
    m = Master("--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--http-token-file", token_file)
    yield m
    m.close()


def without_clock(doc):
    """The state without what changes from one request to the next (times, throughput)."""
    if isinstance(doc, dict):
        return {k: without_clock(v) for k, v in doc.items()
                if k not in ("now_ms", "last_seen_ms_ago", "age_ms", "throughput")}
    if isinstance(doc, list):
        return [without_clock(v) for v in doc]
    return doc


def test_status_shows_every_peer_and_open_vote_and_its_json_is_the_api_state(master, token_file):
    peers = [Peer(master, f"p{i}") for i in range(3)]
    try:
        members: List[Peer] = []
        admit(members, peers[:2])
        waiting = peers[2]
        waiting.send("connect")  # registered; it waits for the members' next update
        # an open vote: p0 agrees, p1 does not yet
        peers[0].send("agree 1")
        ids = [p.id for p in peers[:2]]

        def state_with_open_vote():
            s = master.state()
            has_waiting_peer = any(p["phase"] == "REGISTERED" for p in s["peers"])
            return s if s["operations"] and has_waiting_peer else None

        deadline = time.monotonic() + WAIT_S
        while not state_with_open_vote():
            assert time.monotonic() < deadline, master.state()
            time.sleep(0.05)
        waiting_id = next(p["id"] for p in master.state()["peers"] if p["phase"] == "REGISTERED")

        result = status_tool("--http", master.http, "--token-file", token_file)
        assert result.returncode == 0, result.stderr
        text = result.stdout
        for pid in ids + [waiting_id]:
            assert pid in text, text
        assert re.search(rf"agree \(group 0\), voting, .* waiting for {re.escape(ids[1])}", text), text
        assert "ACCEPTED" in text and "REGISTERED" in text
        assert f"ring {ids[0]} {ids[1]}" in text, text
        for peer in master.state()["peers"]:
            assert f"{peer['host']}:{peer['p2p_port']}" in text

        result = status_tool("--http", master.http, "--token-file", token_file, "--json")
        assert result.returncode == 0, result.stderr
        from_tool = json.loads(result.stdout)
        assert without_clock(from_tool) == without_clock(master.state())
        assert len(from_tool["peers"]) == 3 and from_tool["operations"][0]["waiting"] == [ids[1]]

        # --watch refreshes in place until interrupted
        watch = subprocess.Popen([bin_path("lockstep-status"), "--http", master.http, "--token-file", token_file,
                                  "--watch", "0.2"], stdout=subprocess.PIPE, start_new_session=True)
        time.sleep(1.0)
        stop_process(watch, signal.SIGINT)
        screens = watch.stdout.read().decode()
        assert screens.count("\x1b[H\x1b[2J") >= 2 and screens.count(ids[0]) >= 2

        # the vote completes once p1 agrees too
        peers[1].call("agree 1")
        assert peers[0].reply()["code"] == 0
    finally:
        for p in peers:
            p.close()


def test_status_gives_a_specific_error_for_each_failure(master, token_file, workdir):
    closed = free_port()
    result = status_tool("--http", f"127.0.0.1:{closed}")
    assert result.returncode == EXIT_UNREACHABLE and "cannot reach" in result.stderr, result
    result = status_tool("--http", master.http)
    assert result.returncode == EXIT_UNAUTHORIZED and "requires an access token" in result.stderr, result
    wrong = write(os.path.join(workdir, "wrong"), "the-wrong-token-of-some-length\n")
    result = status_tool("--http", master.http, "--token-file", wrong)
    assert result.returncode == EXIT_UNAUTHORIZED and "the access token is wrong" in result.stderr, result
    result = status_tool("--http", "not-an-address")
    assert result.returncode == 2 and "--http must be HOST:PORT" in result.stderr

    # Something that is not a lockstep master.
    class Fake(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name
            body = b"{not json" if self.server.mode == "garbage" else b'{"peers": 3}'
            if self.server.mode == "teapot":
                self.send_response(418)
                body = b'{"error": "short and stout"}'
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Fake)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        where = f"127.0.0.1:{server.server_address[1]}"
        server.mode = "garbage"
        result = status_tool("--http", where)
        assert result.returncode == EXIT_BAD_ANSWER and "/api/state is not JSON" in result.stderr, result
        server.mode = "shape"
        result = status_tool("--http", where)
        assert result.returncode == EXIT_BAD_ANSWER and "has no 'peers' list" in result.stderr, result
        server.mode = "teapot"
        result = status_tool("--http", where)
        assert result.returncode == EXIT_BAD_ANSWER and "HTTP 418: short and stout" in result.stderr, result
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------- eviction


def test_an_evicted_peer_is_told_and_the_others_carry_on(master, token_file):
    peers = [Peer(master, f"p{i}") for i in range(3)]
    try:
        members: List[Peer] = []
        admit(members, peers)
        answers = all_call(members, "allreduce 1000 1 1")
        assert all(a["world"] == 3 and a["value"] == 3 for a in answers)
        victim = members[1]
        result = status_tool("--http", master.http, "--token-file", token_file, "--evict", victim.id)
        assert result.returncode == 0 and result.stdout.strip() == f"evicted {victim.id}", result
        # The evicted peer's next call fails: it was kicked, by the operator.
        victim.send("pending")
        r = victim.reply()
        assert r["code"] == KICKED and "evicted by the operator" in r["error"], r
        survivors = [members[0], members[2]]
        assert all(a["pending"] for a in all_call(survivors, "pending"))
        views = all_call(survivors, "update")
        assert all(len(v["view"]) == 2 for v in views)
        answers = all_call(survivors, "allreduce 1000 2 1")
        assert all(a["world"] == 2 and a["value"] == 2 and a["uniform"] for a in answers), answers
        state = master.state()
        assert victim.id not in [p["id"] for p in state["peers"]]
        removal = [e for e in state["events"] if e["kind"] == "removed" and victim.id in e.get("peers", [])]
        assert removal and "evicted by the operator" in removal[-1]["reason"], state["events"]
        assert "the operator evicts peer " + victim.id in master.log_text()
        # Twice, or a name nobody has: refused with its own exit code.
        result = status_tool("--http", master.http, "--token-file", token_file, "--evict", victim.id)
        assert result.returncode == EXIT_EVICT_REFUSED and "no registered or accepted peer" in result.stderr, result
        # Without the token: 401, and nobody is evicted.
        result = status_tool("--http", master.http, "--evict", members[0].id)
        assert result.returncode == EXIT_UNAUTHORIZED, result
        assert len(master.state()["peers"]) == 2
    finally:
        for p in peers:
            p.close()


def test_eviction_needs_a_master_with_a_token():
    master = Master("--listen", "127.0.0.1:0", "--http", "127.0.0.1:0")
    try:
        result = status_tool("--http", master.http, "--evict", "p1-000000")
        assert result.returncode == EXIT_EVICT_REFUSED and "needs the master's --http-token-file" in result.stderr
    finally:
        master.close()


# ---------------------------------------------------------------- rotation of the run secret


def test_sighup_rotates_the_secret_with_a_window_for_the_previous_one(workdir):
    old_secret = write(os.path.join(workdir, "old.secret"), "the first secret of this run\n")
    new_secret = write(os.path.join(workdir, "new.secret"), "the second secret of this run\n")
    master_secret = write(os.path.join(workdir, "run.secret"), "the first secret of this run\n")
    master = Master("--listen", "127.0.0.1:0", "--secret-file", master_secret, "--secret-rotation-window-s", "3",
                    http=False)
    peers: List[Peer] = []
    try:
        first = SecretPeer(master, "old0", old_secret)
        peers.append(first)
        members: List[Peer] = []
        admit(members, [first])
        write(master_secret, "the second secret of this run\n")
        master.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + WAIT_S
        while "run secret rotated" not in master.log_text():
            assert time.monotonic() < deadline, master.log_text()
            time.sleep(0.05)
        rotated_at = time.monotonic()
        # Within the window both secrets admit newcomers, who then work with the peer
        # that joined before the rotation (p2p keys come from the master, not the secret).
        newcomers = [SecretPeer(master, "new1", new_secret), SecretPeer(master, "old2", old_secret)]
        peers.extend(newcomers)
        admit(members, newcomers)
        assert time.monotonic() - rotated_at < 3, "the test was too slow to join within the window"
        answers = all_call(members, "allreduce 1000 1 1")
        assert all(a["world"] == 3 and a["value"] == 3 for a in answers), answers
        assert "proved the previous run secret (rotation window)" in master.log_text()
        # After the window only the new secret gets in; the members stay.
        while "the previous run secret is no longer accepted" not in master.log_text():
            assert time.monotonic() < deadline, master.log_text()
            time.sleep(0.05)
        late = SecretPeer(master, "old3", old_secret)
        peers.append(late)
        late.send("connect")
        r = late.reply()
        assert r["code"] == AUTHENTICATION_FAILED, r
        answers = all_call(members, "allreduce 1000 2 1")
        assert all(a["world"] == 3 and a["value"] == 3 for a in answers), answers
        # A secret file that cannot be read keeps the current secret.
        os.unlink(master_secret)
        master.proc.send_signal(signal.SIGHUP)
        while "the current secret stays" not in master.log_text():
            assert time.monotonic() < deadline, master.log_text()
            time.sleep(0.05)
        fresh = SecretPeer(master, "new4", new_secret)
        peers.append(fresh)
        admit(members, [fresh])
    finally:
        for p in peers:
            p.close()
        master.close()


# ---------------------------------------------------------------- the embedded master


def test_the_embedded_master_serves_http_with_its_token(workdir, token_file):
    with lockstep.Master("127.0.0.1:0", http="127.0.0.1:0", http_token_file=token_file) as m:
        url = f"http://{m.http_address}/api/state"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=10)
        assert refused.value.code == 401
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200 and json.loads(response.read())["peers"] == []
        result = status_tool("--http", m.http_address, "--token-file", token_file)
        assert result.returncode == 0 and "peers: 0 accepted" in result.stdout, result
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Master("127.0.0.1:0", http="0.0.0.0:0")
    with lockstep.Master("127.0.0.1:0") as m:
        with pytest.raises(lockstep.InvalidUsageError):
            m.http_port
