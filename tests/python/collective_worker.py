"""A lockstep peer in a process of its own, driven by a test (test_collectives.py) over
one end of a socket pair: it creates its communicator on its main thread, then runs the
functions it receives, one at a time, as fn(comm, *args, **kwargs), and answers each with
("ok", result) or ("err", exception, traceback). The functions travel pickled by
reference (module-level functions of the test module, importable here from this
directory). None, or the other end closing, ends it.

Usage: collective_worker.py FD MASTER_ADDRESS NAME (FD: the inherited socket).
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Connection

import lockstep


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    master, name = sys.argv[2], sys.argv[3]
    if "LOCKSTEP_LOG_LEVEL" not in os.environ:  # set it to see the peers' logs
        lockstep.set_log_level("error")
    comm = lockstep.Communicator(master, base_port=0)
    try:
        conn.send(("ready", name))
        while True:
            try:
                message = conn.recv()
            except EOFError:
                break
            if message is None:
                break
            fn, args, kwargs = message
            try:
                reply = ("ok", fn(comm, *args, **kwargs))
            except BaseException as e:  # handed to the test, which re-raises it
                reply = ("err", e, traceback.format_exc())
            try:
                conn.send(reply)
            except Exception as e:  # a result or an exception that does not pickle
                conn.send(("err", RuntimeError(f"{name}: unpicklable reply: {e!r}"), traceback.format_exc()))
    finally:
        comm.close()
        conn.close()


if __name__ == "__main__":
    main()
