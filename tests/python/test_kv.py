"""The master's key-value store from Python: a wait on one peer ends when another sets
the key (with the GIL released meanwhile); get, overwrite, delete; KeyNotFoundError (a
KeyError); LockstepTimeoutError at a wait's deadline; the master's bounds
(LimitExceededError naming the flag, nothing changed); bad keys refused before any
message."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

import lockstep
from conftest import CALL_TIMEOUT_S, Cluster


def kv_state(master: lockstep.Master) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{master.http_port}/api/state", timeout=5) as r:
        return json.load(r)["kv"]


def wait_for_waits(master: lockstep.Master, n: int) -> None:
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while kv_state(master)["waits"] != n:
        assert time.monotonic() < deadline, kv_state(master)
        time.sleep(0.01)


def test_key_value_store_between_peers():
    with Cluster(2, master_kwargs={"http": "127.0.0.1:0", "kv_keys_max": 2, "kv_value_bytes_max": 16}) as c:
        a, b = c.peers
        waiting = b.submit(lambda comm: comm.kv_wait("ckpt"))
        wait_for_waits(c.master, 1)
        a.call(lambda comm: comm.kv_set("ckpt", b"/ckpt/100"))
        assert waiting.result(CALL_TIMEOUT_S) == b"/ckpt/100"
        assert b.call(lambda comm: comm.kv_get("ckpt")) == b"/ckpt/100"
        b.call(lambda comm: comm.kv_set("ckpt", bytearray(b"/ckpt/200")))
        assert a.call(lambda comm: comm.kv_get("ckpt")) == b"/ckpt/200"
        # An empty value is a value.
        a.call(lambda comm: comm.kv_set("empty", b""))
        assert b.call(lambda comm: comm.kv_get("empty")) == b""
        assert kv_state(c.master) == {"keys": 2, "bytes": len("ckpt/ckpt/200empty"), "waits": 0}

        with pytest.raises(lockstep.KeyNotFoundError) as missing:
            a.call(lambda comm: comm.kv_get("missing"))
        assert isinstance(missing.value, KeyError) and "missing" in str(missing.value)
        start = time.monotonic()
        with pytest.raises(lockstep.LockstepTimeoutError):
            a.call(lambda comm: comm.kv_wait("missing", timeout_ms=200))
        assert time.monotonic() - start >= 0.2

        with pytest.raises(lockstep.LimitExceededError, match="--kv-keys-max"):
            a.call(lambda comm: comm.kv_set("third", b"x"))
        with pytest.raises(lockstep.LimitExceededError, match="--kv-value-bytes-max"):
            a.call(lambda comm: comm.kv_set("ckpt", b"0123456789abcdefX"))
        assert b.call(lambda comm: comm.kv_get("ckpt")) == b"/ckpt/200"
        a.call(lambda comm: comm.kv_delete("ckpt"))
        a.call(lambda comm: comm.kv_delete("ckpt"))  # absent: fine
        with pytest.raises(lockstep.KeyNotFoundError):
            b.call(lambda comm: comm.kv_get("ckpt"))
        a.call(lambda comm: comm.kv_set("third", b"x"))  # the delete made room

        for bad in ("", "a\0b", b"bytes", 7):
            with pytest.raises(lockstep.InvalidArgumentError):
                a.call(lambda comm, k=bad: comm.kv_get(k))
        with pytest.raises(lockstep.InvalidArgumentError):
            a.call(lambda comm: comm.kv_wait("k", timeout_ms=-1))


def test_key_value_store_needs_a_connection():
    master = lockstep.Master("127.0.0.1:0")
    master.run()
    try:
        comm = lockstep.Communicator(master.address, base_port=0)
        try:
            with pytest.raises(lockstep.NotInitializedError):
                comm.kv_get("k")
        finally:
            comm.close()
    finally:
        master.close()
