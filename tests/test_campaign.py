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


#: The scripts of the 4- and 8-GPU calls, and the line each prints for a call it has not.
CALL_SCRIPTS = {"four_gpu.sh": "CALL=9: use 1, 2 or 3", "eight_gpu.sh": "CALL=9: use 1 or 2"}


def test_the_call_scripts_run_parts_that_exist_and_refuse_an_unknown_call():
    defined = set(re.findall(r"^part_(\w+)\(\)", SCRIPT.read_text(), re.MULTILINE))
    for name, refusal in CALL_SCRIPTS.items():
        script = SCRIPT.parent / name
        entries = re.findall(r'PARTS="([^"$]+)"', script.read_text())
        parts = {e.split(":")[0] for line in entries for e in line.split()}
        assert parts and parts <= defined, (name, parts - defined)
        proc = subprocess.run(["bash", str(script)], env=cli_env(CALL="9"),
                              capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stdout.strip()) == (2, refusal), proc.stdout


def _tables():
    import runpy

    return runpy.run_path(str(SCRIPT.parent / "campaign_tables.py"))


def _write(path, data):
    path.write_text(json.dumps(data))


def _paper(path, seq, rows):
    """A plan --json file with candidates (layout fields, predicted ms, estimate GiB)."""
    cands = []
    for layout, ms, gib in rows:
        full = {"dp": 1, "gtp": 1, "tp": 1, "cp": 1, "ep": 1, "remat": "dots",
                "loop": "unrolled", "gather_format": None, "offload": False, **layout}
        cands.append({"layout": full, "step_seconds": ms / 1e3, "estimate_bytes": gib * 2**30})
    _write(path, {"preset": "llama3-8b", "seq": seq, "candidates": cands})


def test_the_eight_table_reads_tokens_peers_and_the_reference(tmp_path):
    t = _tables()
    row = {"devices": 8, "seq": 8192, "per_device_batch": 1, "preset": "llama3-8b",
           "peak_mem_gib": 40.0, "mfu": 0.5, "first_step_s": 20.0}
    _write(tmp_path / "eight_8192x1_gtp0_bf16.json", [{**row, "step_ms": 1000.0, "trace": {
        "comm_ms": 300.0, "hidden_fraction": 0.9, "exposed_ms": 30.0}}])
    _write(tmp_path / "eight_8192x1_torch1_bf16.json", {**row, "step_ms": 800.0})
    _write(tmp_path / "eight_8192x1_gtp4_fp8.json", [{**row, "step_ms": 819.2}])
    _paper(tmp_path / "eight_8192x1_paper.json", 8192, [({"gtp": 8}, 950.0, 40.0)])
    text = t["eight"]([str(tmp_path)])
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()}
    # 8192 tokens in 1.0 s: 8,192 tokens/s per GPU, 1.229x torchtitan's 6,667; 1.25x the peer
    gtp8 = lines["gtp8"]
    assert "8,192" in gtp8 and "1.23x" in gtp8 and "1.250x" in gtp8 and "950.0" in gtp8
    assert "| 30.0 |" in gtp8
    # dp2 x gtp4 in FP8 has no float8 peer here, and is read against torchtitan's Float8 figure
    fp8 = lines["dp2 x gtp4"]
    assert "10,000" in fp8 and f"{10000 / 8532:.2f}x" in fp8 and fp8.rstrip(" |").endswith("-")
    assert "6,667" in text and "8,532" in text and "Table 1" in text


def test_the_rank_table_joins_calls_and_takes_gtp4_from_the_breakdown(tmp_path):
    t = _tables()
    call1, call3 = tmp_path / "c1", tmp_path / "c3"
    call1.mkdir()
    call3.mkdir()
    _write(call1 / "breakdown_8192x1.json", {"gtp_jax": {"step": {"step_ms": 870.0}}})
    _write(call3 / "tp2_gtp2.json", [{"variant": "tp_gtp_overlap", "step_ms": 1.0},
                                     {"variant": "tp_gtp", "step_ms": 930.0}])
    _write(call3 / "tp4_gtp1.json", [{"variant": "tp", "step_ms": 990.0}])
    _paper(call3 / "plan_rank.json", 8192,
           [({"gtp": 4}, 957.0, 1), ({"gtp": 2, "tp": 2}, 910.0, 1), ({"tp": 4}, 1089.0, 1)])
    text = t["rank"]([str(call1), str(call3)])
    assert "gtp4 (breakdown's row) | 870.0 | 957.0 | +10.0%" in text
    assert "tp2 x gtp2 | 930.0 | 910.0 | -2.2%" in text
    assert "measured gtp4 (breakdown's row) < tp2 x gtp2 < tp4" in text
    assert "planner tp2 x gtp2 < gtp4 (breakdown's row) < tp4" in text


def test_the_scaling_and_70b_tables(tmp_path):
    t = _tables()
    for n, ms in ((1, 500.0), (8, 1000.0)):
        _write(tmp_path / f"scaling_{n}dev.json", [{
            "devices": n, "layers": 20 if n == 1 else 32, "seq": 8192, "per_device_batch": 1,
            "step_ms": ms, "peak_mem_gib": 50.0, "mfu": 0.5,
            "trace": {"comm_ms": 400.0, "hidden_fraction": 0.75} if n > 1 else None}])
    text = t["scaling"]([str(tmp_path)])
    assert "| 8 | 32 | 1000.0 | 8,192 |" in text and "| 100.0 | 10.0% |" in text
    assert "| 1 | 20 | 500.0 | 16,384 |" in text
    _write(tmp_path / "l70_tp2_gtp4.json", [{"mesh": {"tp": 2, "gtp": 4, "dp": 1},
                                            "layers": 32, "seq": 8192, "batch": 8,
                                            "devices": 8, "step_ms": 3000.0,
                                            "peak_mem_gib": None}])
    _paper(tmp_path / "l70_paper_32.json", 8192, [({"gtp": 4, "tp": 2}, 3300.0, 100.0)])
    text = t["layers_70b"]([str(tmp_path)])
    # batch 8 of 8192 over 8 GPUs in 3 s: 2,731 tokens/s per GPU; no peak on this device
    assert "| tp2 x gtp4 | 32 | 3000.0 | 3300.0 | +10.0% | - | 100.00 | 2,731 |" in text
