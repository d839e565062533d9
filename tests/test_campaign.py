"""`benchmarks/campaign.sh`, the GPU campaign runner: every part its header lists exists,
and a part runs end to end scaled down on simulated CPU devices (``SCALE=cpu``)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from helpers import cli_env

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "campaign.sh"


def test_every_listed_part_is_defined():
    text = SCRIPT.read_text()
    header = text.split("\nset -u", 1)[0]
    listed = set(re.findall(r"^#   (\w+)\s{2,}", header, re.MULTILINE))
    defined = set(re.findall(r"^part_(\w+)\(\)", text, re.MULTILINE))
    assert listed and listed <= defined, listed - defined
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_an_unknown_part_is_refused_in_one_line(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT)], env=cli_env(SCALE="cpu", OUT=str(tmp_path),
                                                             PARTS="nope"),
                          capture_output=True, text=True, timeout=120,
                          cwd=SCRIPT.parents[1])
    assert proc.returncode == 2 and "unknown part 'nope'" in proc.stdout


def test_the_breakdown_part_runs_on_cpu(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT)],
                          env=cli_env(SCALE="cpu", OUT=str(tmp_path), PARTS="breakdown",
                                      WORK=str(tmp_path / "work")),
                          capture_output=True, text=True, timeout=600, cwd=SCRIPT.parents[1])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "breakdown_64x2.json").read_text())
    assert result["gtp_jax"]["memory"]["peak_bytes"] > 0
