#!/usr/bin/python3
"""Counts what a path does to a stream of numbered UDP datagrams: loss, one-way delay,
reordering. Used by the test bed's tests and for the figures of docs/testbed.md.

  udpprobe.py recv PORT COUNT [--idle S] [--deadline S]
      prints "ready", then receives until COUNT datagrams arrived, or S seconds
      (default 1) passed without one after the first, or the deadline (default 60 s);
      prints one JSON line: received, lost (COUNT - received), loss (the fraction),
      out_of_order (datagrams that arrived after one sent later), duplicates, and the
      one-way delay min/max/mean in ms (both ends read CLOCK_MONOTONIC, which every
      network namespace of a machine shares).
  udpprobe.py send ADDR PORT COUNT [--pps N]
      sends COUNT datagrams (sequence number and send time), N per second (default
      20000), in bursts of at most 1 ms worth.

Each datagram is 64 bytes of payload: one wire packet.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux; Python names it from 3.12 on
HEADER = struct.Struct("!QQ")  # sequence, send time (ns, CLOCK_MONOTONIC)
SIZE = 64


def recv(port: int, count: int, idle: float, deadline: float) -> dict:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # Past net.core.rmem_max (root only): a receiver that a busy machine stalls for a
    # moment must not drop what the path delivered.
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 32 << 20)
    except OSError:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
    s.bind(("0.0.0.0", port))
    print("ready", flush=True)
    end = time.monotonic() + deadline
    seen = bytearray(count)
    received = out_of_order = duplicates = 0
    highest = -1
    delays = []
    first = False
    while received < count:
        left = end - time.monotonic()
        if left <= 0:
            break
        s.settimeout(min(left, idle) if first else left)
        try:
            data = s.recv(2048)
        except socket.timeout:
            break
        now = time.monotonic_ns()
        first = True
        seq, sent = HEADER.unpack_from(data)
        if seq >= count:
            continue
        if seen[seq]:
            duplicates += 1
            continue
        seen[seq] = 1
        received += 1
        if seq < highest:
            out_of_order += 1
        else:
            highest = seq
        delays.append((now - sent) / 1e6)
    return {"sent": count, "received": received, "lost": count - received,
            "loss": (count - received) / count, "out_of_order": out_of_order,
            "duplicates": duplicates,
            "delay_min_ms": round(min(delays), 3) if received else None,
            "delay_max_ms": round(max(delays), 3) if received else None,
            "delay_mean_ms": round(sum(delays) / received, 3) if received else None,
            # The receiver's own scheduling shows in the tail: a busy machine that stalls
            # it for 100 ms delays every datagram queued meanwhile. The 99th percentile
            # shows the path.
            "delay_p99_ms": round(sorted(delays)[-(-received * 99 // 100) - 1], 3)
            if received else None}


def send(addr: str, port: int, count: int, pps: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    pad = bytes(SIZE - HEADER.size)
    burst = max(1, pps // 1000)
    start = time.monotonic()
    seq = 0
    while seq < count:
        for _ in range(min(burst, count - seq)):
            while True:
                try:
                    s.sendto(HEADER.pack(seq, time.monotonic_ns()) + pad, (addr, port))
                    break
                except BlockingIOError:
                    time.sleep(0.0001)
            seq += 1
        ahead = start + seq / pps - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("recv")
    r.add_argument("port", type=int)
    r.add_argument("count", type=int)
    r.add_argument("--idle", type=float, default=1.0)
    r.add_argument("--deadline", type=float, default=60.0)
    t = sub.add_parser("send")
    t.add_argument("addr")
    t.add_argument("port", type=int)
    t.add_argument("count", type=int)
    t.add_argument("--pps", type=int, default=20000)
    a = p.parse_args()
    if a.mode == "recv":
        print(json.dumps(recv(a.port, a.count, a.idle, a.deadline)), flush=True)
    else:
        send(a.addr, a.port, a.count, a.pps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
