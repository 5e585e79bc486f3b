"""The README's "Quick start in Python" runs as written: two peer processes against a master."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import lockstep

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def quick_start_code() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Quick start in Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "no python block in the README's Quick start in Python"
    return blocks[0]


def test_readme_quick_start_runs(tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(quick_start_code(), encoding="utf-8")
    env = dict(os.environ, LOCKSTEP_LOG_LEVEL="warn")
    with lockstep.Master("127.0.0.1:0") as master:
        procs = [subprocess.Popen([sys.executable, str(script), master.address, "20"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
        outputs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=25)
                outputs.append((p.returncode, out, err))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for code, out, err in outputs:
        assert code == 0, err
        steps = [line for line in out.splitlines() if line.startswith("step ")]
        assert len(steps) == 20, out
        assert steps[-1].startswith("step 20:") and " of 2," in steps[-1]
    # Both peers hold the same weights at the end, the founder's shared state included.
    finals = {out.splitlines()[-1].split("weights[0] = ")[1] for _, out, _ in outputs}
    assert len(finals) == 1
