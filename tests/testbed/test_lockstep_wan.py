"""lockstep on the WAN test bed: real peers on capped links.

The rates are the ones the caps impose, checked within a wide band (the figures live in
BENCHMARKS.md, from scripts/bench-wan-sync.py). Needs root; $LOCKSTEP_BIN_DIR names the
directory with lockstep-master and lockstep-testpeer.
"""

from __future__ import annotations

import os

from lockstep_peers import TestPeer, admit, start_master

BIN = os.environ.get("LOCKSTEP_BIN_DIR", "")


def test_sync_spreads_over_every_holder(testbed_factory):
    """A newcomer on host 0 receives 64 MiB of shared state from three holders whose links
    to it are capped at 100 Mbit/s each: spread over the three it gets about 300 Mbit/s,
    which no single holder could give it."""
    assert BIN, "set LOCKSTEP_BIN_DIR"
    bed = testbed_factory(4)
    cap_mbit = 100
    for h in (1, 2, 3):
        bed.cap(h, 0, f"{cap_mbit}mbit")
    master = start_master(bed, BIN, 0)
    peers = []
    try:
        address = f"{bed.addr(0)}:7000"
        holders = [TestPeer(bed, BIN, h, address, f"h{h}") for h in (1, 2, 3)]
        newcomer = TestPeer(bed, BIN, 0, address, "n")
        peers = holders + [newcomer]
        size = 64 << 20
        for p in peers:
            p.call(f"tensor weights {size}")
        for p in holders:
            p.call("fill weights 7")
        admit(holders[0], holders[1:] + [newcomer])
        for p in holders:
            p.call("revision 1")
        for p in holders:
            p.send("sync popular")
        newcomer.send("sync receive")
        got = newcomer.reply(120)
        served = [p.reply(120) for p in holders]
        assert got["code"] == 0, got
        assert all(s["code"] == 0 for s in served), served
        assert got["hashes"] == served[0]["hashes"]
        assert got["bytes_received"] == size
        mbit = size * 8 / (got["ms"] / 1e3) / 1e6
        sent = [s["bytes_sent"] for s in served]
        print(f"\n  64 MiB from 3 holders capped at {cap_mbit} Mbit/s each: {got['ms']:.0f} ms, "
              f"{mbit:.0f} Mbit/s; bytes per holder {sent}")
        assert all(s > size // 6 for s in sent), sent
        # Three links of 100 Mbit/s: TCP payload reaches about 95% of each cap.
        assert 0.6 * 3 * cap_mbit <= mbit <= 1.05 * 3 * cap_mbit, mbit
    finally:
        for p in peers:
            p.close()
        master.kill()
        master.wait(timeout=10)
