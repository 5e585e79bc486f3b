"""A 2-peer all-reduce with the installed Python package, for the package tests
(pip_test.sh, deb_test.sh).

    allreduce.py [--master HOST:PORT] [--expect-under DIR]

starts two peer processes (this file with --peer) against the master at HOST:PORT, or
against a master of its own in this process (lockstep.Master) when none is given; each
sums rank+1 scaled NumPy vectors of f32 and i64 and checks the sums bit for bit.
--expect-under fails unless the package imported is the one under DIR (not a copy
from the source or build tree).
"""

import argparse
import os
import subprocess
import sys
import time

import numpy as np

import lockstep

WAIT_S = 60
COUNT = 4096


def check_location(expect_under):
    where = os.path.realpath(lockstep.__file__)
    if expect_under and not where.startswith(os.path.realpath(expect_under) + os.sep):
        sys.exit(f"lockstep was imported from {where}, not from under {expect_under}")
    for name in ("__init__.pyi", "py.typed"):
        if not os.path.exists(os.path.join(os.path.dirname(where), name)):
            sys.exit(f"the installed package has no {name}")
    return where


def peer(master):
    with lockstep.Communicator(master, base_port=0) as comm:
        comm.connect()
        deadline = time.monotonic() + WAIT_S
        while comm.group_world_size < 2:  # the first peer admits the second one
            if time.monotonic() > deadline:
                sys.exit("no second peer within a minute")
            if comm.are_peers_pending():
                while True:
                    try:
                        comm.update_topology()
                        break
                    except lockstep.UpdateTopologyFailedError:
                        pass
            else:
                time.sleep(0.025)
        factor = comm.rank + 1
        values = np.arange(COUNT, dtype=np.float32) * factor
        counts = np.full(COUNT, factor << 40, dtype=np.int64)
        info = comm.all_reduce(values, op="sum", tag=0)
        comm.all_reduce(counts, op="sum", tag=1)
        if not np.array_equal(values, np.arange(COUNT, dtype=np.float32) * 3):
            sys.exit(f"wrong f32 sums: {values[:4]}")
        if not np.array_equal(counts, np.full(COUNT, 3 << 40, dtype=np.int64)):
            sys.exit(f"wrong i64 sums: {counts[:4]}")
        print(f"Python peer rank {comm.rank} of {info.world_size}: sums ok (lockstep {lockstep.__version__})")


def run_pair(master, expect_under):
    command = [sys.executable, os.path.abspath(__file__), "--peer", master]
    if expect_under:
        command += ["--expect-under", expect_under]
    peers = [subprocess.Popen(command) for _ in range(2)]
    codes = []
    for p in peers:
        try:
            codes.append(p.wait(timeout=WAIT_S + 30))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append("timeout")
    if codes != [0, 0]:
        sys.exit(f"peers exited with {codes}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", help="HOST:PORT of a running master (default: one in this process)")
    parser.add_argument("--peer", metavar="HOST:PORT", help=argparse.SUPPRESS)
    parser.add_argument("--expect-under", help="the directory the package must be imported from")
    args = parser.parse_args()
    where = check_location(args.expect_under)
    if args.peer:
        peer(args.peer)
    elif args.master:
        run_pair(args.master, args.expect_under)
    else:
        with lockstep.Master("127.0.0.1:0") as master:
            run_pair(master.address, args.expect_under)
    if not args.peer:
        print(f"2-peer all-reduce passed with lockstep from {os.path.dirname(where)}")


if __name__ == "__main__":
    main()
