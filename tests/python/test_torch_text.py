"""The text-model example (examples/python/torch_text.py) in its short configuration, in
both modes: a character transformer trained on the fortune databases by real peer
processes, one of them SIGKILLed mid-run and a newcomer joining. The held-out loss at
the end must be below the character-unigram cross-entropy of the held-out text, which
this test computes itself from the corpus (the example's split and vocabulary rules,
written out again here); the plot must be a PNG; the example's records must show the
kill, the newcomer's join and its steps after it; every peer that finished must hold
the same final model."""

from __future__ import annotations

import collections
import json
import math
import os
import re
import subprocess
import sys

import pytest

# Skips this module where test_torch skips itself (no torch, or no lockstep._torch).
from test_torch import TIME_SCALE  # noqa: E402

CORPUS = "/usr/share/games/fortunes"
# A dependency (scripts/apt-packages.txt), so its absence fails rather than skips.
assert os.path.isdir(CORPUS), "no fortune databases: the fortunes package (scripts/apt-packages.txt) is missing"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "python", "torch_text.py")


def held_out_and_unigram() -> tuple[int, float]:
    """(held-out characters, their cross-entropy in nats under the training text's
    character frequencies): every 20th fortune held out; characters seen fewer than 20
    times in the training text are one symbol; add-one smoothing."""
    fortunes = []
    for name in sorted(os.listdir(CORPUS)):
        path = os.path.join(CORPUS, name)
        if name.endswith(".dat") or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for piece in re.split(r"^%\n", f.read(), flags=re.M):
                if piece.strip():
                    fortunes.append(piece + ("" if piece.endswith("\n") else "\n") + "%\n")
    train = collections.Counter("".join(f for i, f in enumerate(fortunes) if i % 20 != 0))
    held = collections.Counter("".join(f for i, f in enumerate(fortunes) if i % 20 == 0))
    known = {c for c, n in train.items() if n >= 20}
    counts: collections.Counter = collections.Counter()
    for c, n in train.items():
        counts[c if c in known else None] += n
    total = sum(train.values()) + len(known) + 1
    nats = sum(n * -math.log((counts[c if c in known else None] + 1) / total) for c, n in held.items())
    return sum(held.values()), nats / sum(held.values())


@pytest.fixture(scope="module")
def unigram() -> tuple[int, float]:
    return held_out_and_unigram()


@pytest.mark.parametrize("mode", [["--mode", "ddp"], ["--mode", "diloco", "--quantize"]], ids=["ddp", "diloco"])
def test_text_model_learns_through_a_kill_and_a_join(mode, unigram, tmp_path):
    run = subprocess.run([sys.executable, EXAMPLE, "--short", *mode, "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=300 * TIME_SCALE)
    print(run.stdout[-3000:])
    summaries = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"summary"')]
    assert summaries, f"no summary (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    summary = summaries[-1]

    held_chars, unigram_nats = unigram
    assert summary["held_out_chars"] == held_chars, "the example's held-out text differs from the test's"
    assert summary["held_out_loss"] < unigram_nats, (summary["held_out_loss"], unigram_nats)

    with open(summary["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    with open(summary["records"]) as f:
        records = [json.loads(line) for line in f]
    kills = [r for r in records if r["event"] == "killed"]
    assert len(kills) == 1, kills
    victim = kills[0]["victim"]
    assert not [r for r in records if r["peer"] == victim and r["event"] == "step" and r["t"] > kills[0]["t"]]
    # The survivors went on without the victim, then with the newcomer.
    worlds = [r["world"] for r in records if r["event"] == "membership"]
    assert worlds and min(worlds) < max(worlds), worlds
    newcomer = [r["newcomer"] for r in records if r["event"] == "started"]
    assert newcomer, "no newcomer was started"
    joined = [r for r in records if r["peer"] == newcomer[0] and r["event"] == "joined"]
    assert joined and joined[0]["step"] > kills[0]["step"], joined
    trained = [r for r in records if r["peer"] == newcomer[0] and r["event"] == "step"]
    assert trained and trained[-1]["step"] > joined[0]["step"], "the newcomer did not train"

    assert summary["identical"], "the peers that finished hold different models"
    assert newcomer[0] in summary["finished"]
    assert run.returncode == 0, run.stderr[-3000:]
