"""The master's status page in a real headless Chromium (Debian's chromium), driven over
the DevTools protocol (python3-websocket): the page loads with no console error and no
exception, shows every peer with the state /api/state gives it, and updates by itself
after a peer is killed. A screenshot is saved under the build directory
(LOCKSTEP_TEST_ARTIFACTS_DIR/status_page.png). Chromium runs in a session of its own
and is always killed at the end."""

from __future__ import annotations

import base64
import json
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

import websocket

from observed_run import WAIT_S, MasterProcess, Peer, admit, stop_process

CHROMIUM = shutil.which("chromium")

# What the page shows, read from its DOM (the nodes of the ring pictures); nothing
# before the page has loaded.
READ_PAGE = """!document.getElementById('page-errors') ? JSON.stringify({updates: 0, nodes: [], errors: []}) :
JSON.stringify({
  updates: Number(document.body.dataset.updates || 0),
  errors: Array.from(document.querySelectorAll('#page-errors > div')).map((e) => e.textContent),
  nodes: Array.from(document.querySelectorAll('#rings .peer-node')).map((n) => ({
    peer: n.dataset.peer, state: n.dataset.state, phase: n.dataset.phase })),
  rows: document.querySelectorAll('#peers .peer-row').length,
  events: document.querySelectorAll('#events .event').length,
  connection: document.getElementById('conn').className,
})"""


class DevTools:
    """A minimal DevTools-protocol client of one page: commands by id, events kept."""

    def __init__(self, url: str) -> None:
        self.ws = websocket.create_connection(url, timeout=WAIT_S, suppress_origin=True)
        self.next_id = 1
        self.events = []

    def call(self, method: str, **params) -> dict:
        my_id = self.next_id
        self.next_id += 1
        self.ws.send(json.dumps({"id": my_id, "method": method, "params": params}))
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            message = json.loads(self.ws.recv())
            if message.get("id") == my_id:
                assert "error" not in message, message
                return message.get("result", {})
            if "method" in message:
                self.events.append(message)
        raise AssertionError(f"no answer to {method}")

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"]["value"]

    def problems(self) -> list:
        """Console errors and warnings, uncaught exceptions and log entries of level error."""
        found = []
        for e in self.events:
            method, params = e["method"], e.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "warning", "assert"):
                found.append(("console", params.get("type"), [a.get("value", a.get("description")) for a in params["args"]]))
            elif method == "Runtime.exceptionThrown":
                found.append(("exception", params["exceptionDetails"].get("text"),
                              params["exceptionDetails"].get("exception", {}).get("description")))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(("log", params["entry"].get("source"), params["entry"].get("text"),
                              params["entry"].get("url")))
        return found

    def close(self) -> None:
        self.ws.close()


def start_chromium(profile: str) -> tuple:
    """Starts headless Chromium on about:blank; returns the process and its DevTools port."""
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                             "--disable-background-networking", "--disable-component-update",
                             "--disable-default-apps", "--no-first-run", "--disable-extensions",
                             "--disable-sync", "--mute-audio", f"--user-data-dir={profile}",
                             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                             "--window-size=1400,1500", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + WAIT_S
    seen = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if m := re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line):
            return proc, int(m.group(1))
    stop_process(proc)
    raise AssertionError("Chromium did not start its DevTools endpoint: " + "".join(seen[-20:]))


def page_target(port: int) -> str:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t.get("type") == "page"]
        if pages:
            return pages[0]["webSocketDebuggerUrl"]
        time.sleep(0.1)
    raise AssertionError("Chromium has no page")


def test_status_page_in_headless_chromium():
    assert CHROMIUM is not None, "chromium is not installed (scripts/apt-packages.txt lists it)"
    master = MasterProcess()
    peers = [Peer(master, f"p{i}") for i in range(3)]
    profile = tempfile.mkdtemp(prefix="lockstep-chromium-")
    browser = None
    devtools = None
    try:
        members = []
        admit(members, peers)
        browser, port = start_chromium(profile)
        devtools = DevTools(page_target(port))
        for domain in ("Runtime.enable", "Log.enable", "Page.enable"):
            devtools.call(domain)
        devtools.call("Page.navigate", url=master.url("/"))

        def shown(count: int, gone: str = ""):
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                page = json.loads(devtools.evaluate(READ_PAGE))
                ids = [n["peer"] for n in page["nodes"]]
                if page["updates"] > 0 and len(ids) == count and gone not in ids:
                    return page
                time.sleep(0.2)
            raise AssertionError(f"the page did not show {count} peers: {page}")

        page = shown(3)
        state = master.state()
        expected = {p["id"]: (p["state"], p["phase"]) for p in state["peers"]}
        assert {n["peer"]: (n["state"], n["phase"]) for n in page["nodes"]} == expected
        assert all(s == ("IDLE", "ACCEPTED") for s in expected.values())
        assert page["rows"] == 3 and page["events"] > 0 and page["connection"] == "ok"

        # Kill a peer: the page, polling by itself, drops it.
        victim = members.pop()
        victim.kill()
        page = shown(2, gone=victim.id)
        assert sorted(n["peer"] for n in page["nodes"]) == sorted(p.id for p in members)
        removed = devtools.evaluate(
            "Array.from(document.querySelectorAll('#events .event[data-kind=removed]')).map((e) => e.textContent)")
        assert any(victim.id in text and "connection closed" in text for text in removed), removed

        artifacts = os.environ.get("LOCKSTEP_TEST_ARTIFACTS_DIR") or tempfile.gettempdir()
        os.makedirs(artifacts, exist_ok=True)
        shot = devtools.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path = os.path.join(artifacts, "status_page.png")
        with open(path, "wb") as f:
            f.write(base64.b64decode(shot["data"]))
        assert os.path.getsize(path) > 10_000

        assert page["errors"] == [], page["errors"]
        assert devtools.problems() == []
    finally:
        if devtools is not None:
            devtools.close()
        if browser is not None:
            stop_process(browser, signal.SIGKILL)
        shutil.rmtree(profile, ignore_errors=True)
        for p in peers:
            p.close()
        master.close()
