#!/usr/bin/python3
"""Shared-state join-and-sync on the WAN test bed (needs root).

A newcomer on host 0 receives SIZE bytes of shared state from K holders on hosts 1..K.
The newcomer's inbound capacity is CAP: each holder->newcomer link is capped at CAP/K,
so a newcomer fed by one holder at a time could never use more than CAP/K; --delay-ms
adds a one-way delay each way, --loss random loss each way (wire packets). --content: random bytes (incompressible) or
"compressible" (f32 values of 16 kinds); --compression: the newcomer's
state_compression, auto or off; --streams: the newcomer's p2p_streams (0: its default,
each source's part over up to 4 connections); --holders-inbound off: the holders accept
no inbound connection (as behind a NAT) and dial the newcomer, a reversed transfer
(docs/deployment.md, "NAT"; with more than one such holder the master has no room for
them all, so use --holders 1). Prints one JSON line per case: the sync time, the rate
of tensor bytes, the rate over CAP, the bytes on the wire, and the time less one round
trip over what the wire bytes need at CAP ("wire_bound_use": at most 1.1 is the goal).

Usage: scripts/bench-wan-sync.py [--build build] [--cap-mbit 400] [--sizes 256MiB,1GiB]
                                 [--holders 1,3] [--delay-ms 0] [--content random,compressible]
                                 [--compression auto,off] [--streams 0,1] [--loss 0.001]
                                 [--holders-inbound on,off]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))

from lockstep_peers import TestPeer, admit, start_master  # noqa: E402
from testbed import Testbed  # noqa: E402


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def measure(bin_dir: str, holders: int, size: int, cap_mbit: float, delay_ms: float, content: str,
            compression: str, streams: int, loss: float, holders_inbound: bool = True) -> dict:
    with Testbed(holders + 1, command=os.path.join(bin_dir, "lockstep-testbed")) as bed:
        for h in range(1, holders + 1):
            bed.cap(h, 0, f"{int(cap_mbit * 1e6 / holders)}")
            if delay_ms > 0:
                bed.delay(h, 0, delay_ms, both=True)
            if loss > 0:
                bed.loss(h, 0, loss, both=True)
        master = start_master(bed, bin_dir, 0)
        address = f"{bed.addr(0)}:7000"
        sources = [TestPeer(bed, bin_dir, h, address, f"h{h}", () if holders_inbound else ("--no-inbound",))
                   for h in range(1, holders + 1)]
        newcomer = TestPeer(bed, bin_dir, 0, address, "n",
                            (("--no-state-compression",) if compression == "off" else ())
                            + (("--streams", str(streams)) if streams else ()))
        try:
            for p in sources + [newcomer]:
                p.call(f"tensor weights {size}")
            for p in sources:
                p.call("fill weights 7" + (" compressible" if content == "compressible" else ""), timeout=600)
                p.call("revision 1")
            admit([], sources + [newcomer])
            for p in sources:
                p.send("sync popular")
            newcomer.send("sync receive")
            got = newcomer.reply(1800)
            served = [p.reply(1800) for p in sources]
            assert got["code"] == 0 and all(s["code"] == 0 for s in served), (got, served)
            assert got["hashes"] == served[0]["hashes"] and got["bytes_received"] == size
            mbit = size * 8 / (got["ms"] / 1e3) / 1e6
            wire = got["wire_bytes_received"]
            wire_ms = wire * 8 / (cap_mbit * 1e6) * 1e3
            return {"bench": "wan_sync", "holders": holders, "bytes": size, "cap_mbit": cap_mbit,
                    "delay_ms": delay_ms, "content": content, "compression": compression,
                    "streams": got["streams"], "loss": loss, "holders_inbound": holders_inbound,
                    "sync_ms": round(got["ms"], 1), "mbit_s": round(mbit, 1),
                    "cap_use": round(mbit / cap_mbit, 3), "wire_bytes": wire,
                    "wire_ratio": round(wire / size, 4),
                    "wire_bound_use": round((got["ms"] - 2 * delay_ms) / wire_ms, 3),
                    "bytes_per_holder": [s["bytes_sent"] for s in served]}
        finally:
            for p in sources + [newcomer]:
                p.close()
            master.kill()
            master.wait(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--cap-mbit", type=float, default=400)
    parser.add_argument("--sizes", default="256MiB,1GiB")
    parser.add_argument("--holders", default="1,3")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of each holder link, each way")
    parser.add_argument("--content", default="random", help="random and/or compressible, comma-separated")
    parser.add_argument("--compression", default="auto", help="auto and/or off, comma-separated")
    parser.add_argument("--loss", type=float, default=0.0, help="random loss of each holder link, each way")
    parser.add_argument("--streams", default="0",
                        help="the newcomer's p2p_streams (0: the default, up to 4 a source), comma-separated")
    parser.add_argument("--holders-inbound", default="on",
                        help="on: the holders accept inbound connections; off: they dial the newcomer; comma-separated")
    args = parser.parse_args()
    bin_dir = os.path.join(os.path.abspath(args.build), "bin")
    for holders in (int(h) for h in args.holders.split(",")):
        for size in (parse_size(s) for s in args.sizes.split(",")):
            for content in args.content.split(","):
                for compression in args.compression.split(","):
                    for streams in args.streams.split(","):
                        for inbound in args.holders_inbound.split(","):
                            print(json.dumps(measure(bin_dir, holders, size, args.cap_mbit, args.delay_ms, content,
                                                     compression, int(streams), args.loss, inbound == "on")),
                                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
