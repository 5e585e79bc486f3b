"""The run secret from Python: Master(secret_file=...), Communicator(secret_file=... or
secret=...), the LOCKSTEP_SECRET_FILE fallback, AuthenticationFailedError for a missing
or different secret and for a master without one, InvalidArgumentError for a bad secret,
and collectives and syncs over authenticated connections."""

from __future__ import annotations

import numpy as np
import pytest

import lockstep
from conftest import Cluster

SECRET = b"the python tests' run secret, 1\n"


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return str(path)


def test_secured_run_all_reduce_and_sync(secret_file):
    # Two peers: one with the file, one with the same secret as bytes (the trailing line
    # break is ignored), another as str.
    with Cluster(2, master_kwargs={"secret_file": secret_file}, secret=SECRET.strip().decode()) as c:
        def work(i, comm):
            a = np.full(1000, float(i + 1), dtype=np.float32)
            info = comm.all_reduce(a)
            state = lockstep.SharedState({"w": np.full(4096, i, dtype=np.uint8)}, revision=1 - i)
            comm.sync_shared_state(state, "enforce_popular" if i == 0 else "receive_only")
            return info.world_size, float(a[0]), int(state.tensors[0].data[7]), comm.membership()
        results = c.run(work)
        for world, value, byte, view in results:
            assert world == 2 and value == 3.0 and byte == 0
            assert len(view) == 2


def test_encrypted_data_plane_gives_the_same_results(secret_file):
    # The same all-reduces (plain and quantized) and sync with and without encrypt_data.
    results = {}
    for encrypt in (False, True):
        with Cluster(2, master_kwargs={"secret_file": secret_file}, secret_file=secret_file,
                     encrypt_data=encrypt) as c:
            def work(i, comm):
                a = (np.arange(100_000, dtype=np.float32) % 977) * (i + 1)
                comm.all_reduce(a)
                q = (np.arange(50_000, dtype=np.float32) % 89) * (i + 2)
                comm.all_reduce(q, quantization="minmax", tag=1)
                state = lockstep.SharedState({"w": np.arange(3 << 20, dtype=np.uint8) * (1 - i)}, revision=1 - i)
                comm.sync_shared_state(state, "enforce_popular" if i == 0 else "receive_only")
                return a.tobytes(), q.tobytes(), state.tensors[0].data.tobytes()
            results[encrypt] = c.run(work)
    assert results[True] == results[False]
    assert results[True][0] == results[True][1]


def test_encrypt_data_without_a_secret_is_an_invalid_argument(monkeypatch):
    monkeypatch.delenv("LOCKSTEP_SECRET_FILE", raising=False)
    with pytest.raises(lockstep.InvalidArgumentError, match="encrypt_data"):
        lockstep.Communicator("127.0.0.1:1", base_port=0, encrypt_data=True)


def test_peer_without_or_with_another_secret_is_refused(secret_file, tmp_path, monkeypatch):
    monkeypatch.delenv("LOCKSTEP_SECRET_FILE", raising=False)
    other = tmp_path / "other"
    other.write_bytes(b"another secret, not this run's")
    with lockstep.Master("127.0.0.1:0", secret_file=secret_file) as master:
        for kwargs in ({}, {"secret_file": str(other)}, {"secret": b"also not the secret of this run"}):
            with lockstep.Communicator(master.address, base_port=0, connect_timeout_ms=5000, **kwargs) as comm:
                with pytest.raises(lockstep.AuthenticationFailedError) as info:
                    comm.connect()
                assert info.value.status == lockstep.Status.AUTHENTICATION_FAILED
                assert isinstance(info.value, lockstep.FatalError)
        # The refused peers were never registered: a member is alone.
        with lockstep.Communicator(master.address, base_port=0, secret_file=secret_file) as comm:
            comm.connect()
            assert comm.world_size == 1
            assert comm.are_peers_pending() is False


def test_master_without_the_secret_is_refused(secret_file, monkeypatch):
    monkeypatch.delenv("LOCKSTEP_SECRET_FILE", raising=False)
    with lockstep.Master("127.0.0.1:0") as master:
        with lockstep.Communicator(master.address, base_port=0, secret_file=secret_file) as comm:
            with pytest.raises(lockstep.AuthenticationFailedError, match="did not prove the run secret"):
                comm.connect()


def test_secret_file_from_the_environment(secret_file, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_SECRET_FILE", secret_file)
    with lockstep.Master("127.0.0.1:0") as master:  # takes the secret from the environment too
        with lockstep.Communicator(master.address, base_port=0) as comm:
            comm.connect()
            assert comm.world_size == 1
    monkeypatch.delenv("LOCKSTEP_SECRET_FILE")
    with lockstep.Master("127.0.0.1:0", secret_file=secret_file) as master:
        with lockstep.Communicator(master.address, base_port=0, connect_timeout_ms=5000) as comm:
            with pytest.raises(lockstep.AuthenticationFailedError):
                comm.connect()


def test_bad_secrets_are_invalid_arguments(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCKSTEP_SECRET_FILE", raising=False)
    short = tmp_path / "short"
    short.write_bytes(b"too short\n")
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Master("127.0.0.1:0", secret_file=str(short))
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Master("127.0.0.1:0", secret_file=str(tmp_path / "missing"))
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Communicator("127.0.0.1:1", base_port=0, secret=b"")
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Communicator("127.0.0.1:1", base_port=0, secret_file=str(short))
    with pytest.raises(lockstep.InvalidArgumentError):
        lockstep.Communicator("127.0.0.1:1", base_port=0, secret=12345)
