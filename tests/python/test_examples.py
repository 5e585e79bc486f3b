"""The training examples (examples/python) through their showcase driver: real peer
processes on loopback with one peer killed, newcomers joining and the master killed and
replaced mid-run (the peers run with failover on). Every run must
end with the same shared-state hash on every peer (at every step) and a lower test loss
than at its first step; the async DiLoCo showcase must reach 90% test accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHOWCASE = os.path.join(ROOT, "examples", "python", "showcase.py")


def showcase(*args: str, timeout: float = 400) -> dict:
    run = subprocess.run([sys.executable, SHOWCASE, *args], capture_output=True, text=True, timeout=timeout)
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"summary"')]
    assert lines, f"no summary:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    summary = lines[-1]
    print(run.stdout[-1500:])
    assert run.returncode == (0 if summary["ok"] else 1)
    return summary


@pytest.mark.parametrize("example,steps", [("ddp", 40), ("diloco", 16), ("async_diloco", 16)])
def test_example_survives_a_kill_a_join_and_a_killed_master(example, steps):
    s = showcase("--example", example, "--peers", "3", "--steps", str(steps), "--kill-at", "3", "--join-at", "4",
                 "--kill-master-at", "6", "--step-delay", "0.3", "--min-accuracy", "0")
    assert s["ok"], s
    assert s["master_killed"]
    assert s["hashes_equal"]
    assert s["final_test_loss"] < s["first_test_loss"]
    assert len(s["killed"]) == 1
    assert "p3" in s["finished"], "the newcomer did not finish with the others"


def test_async_newcomers_outnumber_the_peers_that_hold_the_state():
    s = showcase("--example", "async_diloco", "--peers", "2", "--newcomers", "3", "--steps", "24", "--kill-at", "0",
                 "--join-at", "2", "--step-delay", "0.4", "--min-accuracy", "0")
    assert s["ok"], s
    assert {"p2", "p3", "p4"} <= set(s["finished"]), s


def test_showcase_reaches_ninety_percent():
    s = showcase()
    assert s["ok"], s
    assert s["accuracy"] >= 0.9
    assert len(s["killed"]) == 1 and "p4" in s["finished"]
    assert s["master_killed"]


def test_diloco_with_4_bit_error_feedback_matches_the_unquantized_accuracy():
    def mean_accuracy(*flags: str) -> float:
        runs = [showcase("--example", "diloco", "--peers", "3", "--steps", "30", "--kill-at", "0", "--join-at", "0",
                         "--kill-master-at", "0",
                         "--step-delay", "0", "--min-accuracy", "0", "--seed", str(seed), *flags) for seed in (1, 2, 3)]
        assert all(r["ok"] and r["hashes_equal"] for r in runs), runs
        return sum(r["accuracy"] for r in runs) / len(runs)

    plain = mean_accuracy()
    quantized = mean_accuracy("--quantization", "minmax4", "--error-feedback")
    print(f"test accuracy, mean of 3 seeds: unquantized {plain:.4f}, 4-bit with error feedback {quantized:.4f}")
    assert quantized >= plain - 0.01
