"""The hot standby from Python (docs/operations.md, "Hot standby"): two in-process
masters given the same etcd (a private one, Debian's /usr/bin/etcd on free ports of
loopback) compete for one lease; the holder serves, and a communicator that reaches the
other is refused with NotServingError naming the serving one. Stopping the serving
master hands the run to the standby (tests/e2e/standby_e2e_test.cpp kills processes)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest

import lockstep
from conftest import free_port

TIME_SCALE = float(os.environ.get("LOCKSTEP_TEST_TIME_SCALE", "1"))


@pytest.fixture
def etcd():
    data = tempfile.mkdtemp(prefix="lockstep-etcd-")
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    log = open(os.path.join(data, "etcd.log"), "w+")
    proc = subprocess.Popen(
        ["/usr/bin/etcd", "--name", "t", "--data-dir", os.path.join(data, "data"), "--listen-client-urls", client,
         "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"t={peer}"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30 * TIME_SCALE
        while "serving insecure client requests" not in open(log.name).read():
            assert proc.poll() is None and time.monotonic() < deadline, open(log.name).read()[-2000:]
            time.sleep(0.02)
        yield client
    finally:
        proc.kill()
        proc.wait()
        log.close()
        shutil.rmtree(data, ignore_errors=True)


def state(master: lockstep.Master) -> dict:
    import json
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{master.http_port}/api/state", timeout=5) as r:
        return json.loads(r.read())


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s * TIME_SCALE
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_the_standby_refuses_naming_the_serving_master_and_takes_over_when_it_stops(etcd):
    first = lockstep.Master("127.0.0.1:0", http="127.0.0.1:0", ha_etcd=etcd, ha_key="/py/run", ha_lease_ttl_s=2)
    first.run()
    assert wait_for(lambda: state(first)["ha"]["serving"], 10)
    second = lockstep.Master("127.0.0.1:0", http="127.0.0.1:0", ha_etcd=etcd, ha_key="/py/run", ha_lease_ttl_s=2)
    second.run()
    serving_address = f"127.0.0.1:{first.port}"
    assert wait_for(lambda: state(second)["ha"]["holder"] == serving_address, 10)
    assert not state(second)["ha"]["serving"]

    comm = lockstep.Communicator(f"127.0.0.1:{second.port}", base_port=0)
    with pytest.raises(lockstep.NotServingError, match=re.escape(serving_address)) as refused:
        comm.connect()
    assert isinstance(refused.value, lockstep.FatalError)
    comm.close()

    # Both addresses, failover on: the peer joins where the run is served, and when that
    # master stops (releasing its lease) the standby takes the same peer back.
    comm = lockstep.Communicator(f"127.0.0.1:{second.port},{serving_address}", base_port=0,
                                 failover_timeout_ms=int(30_000 * TIME_SCALE))
    comm.connect()
    peer_id = comm.id
    first.close()
    assert wait_for(lambda: state(second)["ha"]["serving"], 10)
    assert comm.agree(True)  # blocks until the standby took it back
    assert comm.id == peer_id
    assert comm.world_size == 1
    assert len(state(second)["last_recovery"]["back"]) == 1
    comm.close()
    second.close()


def test_hot_standby_options_are_checked():
    for kwargs in ({"ha_etcd": "127.0.0.1:2379"}, {"ha_etcd": "https://127.0.0.1:2379"},
                   {"ha_etcd": "http://127.0.0.1:2379", "ha_lease_ttl_s": 1},
                   {"ha_etcd": "http://127.0.0.1:2379", "ha_key": "k" * 300},
                   {"ha_etcd": "http://127.0.0.1:2379", "ha_advertise": "no-port"},
                   {"ha_key": "/without/etcd"}, {"ha_etcd": 5}):
        with pytest.raises(lockstep.InvalidArgumentError):
            lockstep.Master("127.0.0.1:0", **kwargs)
