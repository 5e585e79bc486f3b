"""A cffi caller shaped like PCCL's Python package (tests/pccl/pccl_shape: ABI mode, PCCL
v1.0's declarations written out, libpccl.so loaded from the package's directory) run on
lockstep's library: proof that a foreign cffi caller sees PCCL's ABI (docs/pccl.md).

Environment: LOCKSTEP_LIB_DIR (the build's lib directory, holding libpccl.so).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
LIB_DIR = os.environ["LOCKSTEP_LIB_DIR"]
TIME_SCALE = float(os.environ.get("LOCKSTEP_TEST_TIME_SCALE", "1"))

# PCCL v1.0 as measured: (size, [offsets of the fields in order]).
PCCL_V1_LAYOUTS = {
    "ccoip_inet_address_t": (24, [0, 4, 8]),
    "ccoip_socket_address_t": (28, [0, 24]),
    "pcclCommCreateParams_t": (36, [0, 28, 32]),
    "pcclReduceInfo_t": (24, [0, 8, 16]),
    "pcclReduceOperandDescriptor_t": (8, [0, 4]),
    "pcclQuantizationOptions_t": (8, [0, 4]),
    "pcclReduceDescriptor_t": (40, [0, 8, 16, 24, 32]),
    "pcclReduceOpDescriptor_t": (56, [0, 8, 16]),
    "pcclAsyncReduceOp_t": (16, [0, 8]),
    "pcclTensorInfo_t": (40, [0, 8, 16, 24, 28, 32]),
    "pcclSharedState_t": (24, [0, 8, 16]),
    "pcclSharedStateSyncInfo_t": (16, [0, 8]),
    "pcclBuildInfo_t": (1, [0]),
}


@pytest.fixture
def package(tmp_path):
    """The package in a directory of its own, its libpccl.so a link to lockstep's library
    (what docs/pccl.md tells PCCL users to do)."""
    target = tmp_path / "pccl_shape"
    shutil.copytree(os.path.join(HERE, "pccl_shape"), target)
    os.symlink(os.path.join(LIB_DIR, "libpccl.so"), target / "libpccl.so")
    return str(tmp_path)


def run_python(package: str, code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": package}, **kwargs)


def test_layouts_values_and_build_info(package):
    proc = run_python(package, """
        import json, pccl_shape as p
        p.init()
        info = p.ffi.new("pcclBuildInfo_t*")
        p.check(p.C.pcclGetBuildInfo(info), "pcclGetBuildInfo")
        print(json.dumps({"layouts": p.layouts(), "cuda": bool(info.has_cuda_support),
                          "i16": p.C.pcclInt16, "u16": p.C.pcclUint16, "f32": p.C.pcclFloat,
                          "attr": p.C.PCCL_ATTRIBUTE_GLOBAL_WORLD_SIZE,
                          "null": p.C.pcclGetBuildInfo(p.ffi.NULL)}))
    """)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    result = json.loads(out)
    assert {k: tuple(v[:1]) + (v[1],) for k, v in result["layouts"].items()} == PCCL_V1_LAYOUTS
    assert (result["i16"], result["u16"], result["f32"], result["attr"]) == (2, 3, 10, 1)
    assert result["cuda"] is False
    assert result["null"] == 3  # pcclInvalidArgument


WORKER = """
    import json, sys, time
    import pccl_shape as p
    C, ffi = p.C, p.ffi
    port, index = int(sys.argv[1]), int(sys.argv[2])
    p.init()
    master = None
    if index == 0:
        master = p.MasterNode("127.0.0.1", port)
        master.run()
        print("master running", flush=True)
    deadline = time.monotonic() + 60
    while True:
        comm = p.Communicator("127.0.0.1", port, p2p_connection_pool_size=2)
        try:
            comm.connect()
            break
        except p.PCCLError as e:  # the master of the other process not up yet
            assert e.name == "pcclMasterConnectionFailed" and time.monotonic() < deadline, e
            del comm
            time.sleep(0.1)
    while comm.get_attribute(C.PCCL_ATTRIBUTE_PEER_GROUP_WORLD_SIZE) < 2:
        assert time.monotonic() < deadline
        if comm.are_peers_pending():
            while True:
                try:
                    comm.update_topology()
                    break
                except p.PCCLError as e:
                    assert e.name == "pcclUpdateTopologyFailed", e
        else:
            time.sleep(0.02)
    n = 5000
    send = ffi.new("float[]", [float(index + 1) * k for k in range(n)])
    recv = ffi.new("float[]", n)
    world, tx, rx = comm.all_reduce(send, recv, n, C.pcclFloat, C.pcclSum, 1)
    sums_ok = all(recv[k] == 3.0 * k for k in range(n))
    # i16, signs that differ between the peers: PCCL's numbering (i16 = 2) must reach lockstep.
    a = ffi.new("int16_t[]", [(k % 50) * (-1 if (k + index) % 2 else 1) for k in range(n)])
    comm.all_reduce(a, a, n, C.pcclInt16, C.pcclMax, 2)
    max_ok = all(a[k] == k % 50 for k in range(n))
    # Quantized through the descriptor's options: 8-bit codes, a quarter of the bytes.
    q = ffi.new("float[]", [k / n for k in range(n * 8)])
    _, qtx, _ = comm.all_reduce(q, q, n * 8, C.pcclFloat, C.pcclSum, 3, C.pcclUint8, C.pcclQuantMinMax)
    # Shared state: revision 1 the same everywhere; then peer 0 advances to revision 2
    # with new content while peer 1 presents 1 with other content: peer 1 receives
    # revision 2 (the group's revision written back into its pcclSharedState_t).
    w = ffi.new("double[]", [float(k) for k in range(n)])
    first = comm.sync_shared_state(1, [("w", w, n, C.pcclDouble)])
    for k in range(n):
        w[k] = 2.0 * k if index == 0 else -1.0
    revision, stx, srx = comm.sync_shared_state(2 if index == 0 else 1, [("w", w, n, C.pcclDouble)])
    state_ok = first == (1, 0, 0) and all(w[k] == 2.0 * k for k in range(n))
    print(json.dumps({"world": world, "tx": tx, "sums_ok": sums_ok, "max_ok": max_ok, "qtx": qtx,
                      "revision": revision, "srx": srx, "state_ok": state_ok}), flush=True)
    del comm  # the finalizer: pcclDestroyCommunicator
    if master is not None:
        sys.stdin.read()  # until the test says the other peer is done
        master.interrupt()
        del master  # the finalizer: pcclMasterAwaitTermination, pcclDestroyMaster
    print("finished", flush=True)
"""


def test_two_peers_through_cffi_with_an_embedded_master(package):
    with socket.socket() as s:  # PCCL's API cannot report an ephemeral port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = run_python(package, WORKER, str(port), "0", stdin=subprocess.PIPE)
    second = run_python(package, WORKER, str(port), "1")
    try:
        out1, err1 = second.communicate(timeout=120 * TIME_SCALE)
        out0, err0 = first.communicate(input="", timeout=60 * TIME_SCALE)
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert first.returncode == 0 and second.returncode == 0, err0 + err1
    r0 = json.loads(out0.splitlines()[1])
    r1 = json.loads(out1.splitlines()[0])
    assert "finished" in out0 and "finished" in out1
    for r in (r0, r1):
        assert r["world"] == 2 and r["sums_ok"] and r["max_ok"] and r["state_ok"] and r["revision"] == 2, r
        assert 0 < r["qtx"] < 0.4 * 4 * 5000 * 8, r  # 8-bit codes of 40000 floats
    assert r1["srx"] >= 5000 * 8 and r0["srx"] == 0
