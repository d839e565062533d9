"""Replays a planner accuracy run with this version's time model, offline (no GPU).

`benchmarks/plan_accuracy.sh` keeps each plan (`plan_<case>.json`: its calibration and
every candidate's layout) and each run's measured step. This predicts those layouts' step
times again with the current `gtp_jax.plan.step_seconds`, from the run's own calibration or
with some of its rates replaced, and prints predicted against measured: what a change of the
model, or a better-measured rate, would have predicted for runs already made.

Usage:

    python benchmarks/plan_replay.py docs/results/2026-11-26_2xH100/plan_calibration_v5
    python benchmarks/plan_replay.py DIR --gemm-tflops 745 --attention 2048:175 4096:210

DIR holds the plan JSON files (or a plan_accuracy/ folder of them) and the run table
(`summary.json` or `plan_accuracy.json`, as the campaign scripts write it). Calibrations of
older formats are read as they were measured: a single attention rate was measured at 2048
tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
from typing import Any

from gtp_jax.plan.layout import Layout
from gtp_jax.plan.timing import Calibration, step_seconds
from gtp_jax.train.config import TrainConfig

#: Where the calibrations before format version 6 measured their one attention rate.
_OLD_ATTENTION_SEQ = 2048


def calibration_of(plan: dict[str, Any]) -> Calibration:
    """The `Calibration` a plan JSON recorded, from any format version."""
    fields = dict(plan["calibration"])
    if "attention_flops" in fields:
        fields["attention_rates"] = ((_OLD_ATTENTION_SEQ, fields.pop("attention_flops")),)
    known = {f.name for f in dataclasses.fields(Calibration)}
    return Calibration(**{k: v for k, v in fields.items() if k in known})


def replay(directory: str, *, gemm_tflops: float | None = None,
           attention: tuple[tuple[int, float], ...] = ()) -> list[dict[str, Any]]:
    """Rows ``{case, layout, recorded_ms, predicted_ms, measured_ms}`` for every run of
    `directory` that has a measured step (rates in TFLOP/s replace the calibration's)."""
    table = next((p for p in (os.path.join(directory, "summary.json"),
                              os.path.join(directory, "plan_accuracy.json"))
                  if os.path.exists(p)), None)
    if table is None:
        raise SystemExit(f"{directory}: no summary.json or plan_accuracy.json")
    measured = {(r["case"], r["flags"]): r["measured_step_s"]
                for r in json.load(open(table))["rows"] if r.get("measured_step_s")}
    rows = []
    # The plans lie beside the table, or in the plan_accuracy/ folder the script writes.
    plans = [p for pattern in ("plan_*.json", os.path.join("plan_accuracy", "plan_*.json"))
             for p in sorted(glob.glob(os.path.join(directory, pattern)))
             if os.path.basename(p) != "plan_accuracy.json"]
    for path in plans:
        case = os.path.basename(path)[len("plan_"):-len(".json")]
        plan = json.load(open(path))
        cal = calibration_of(plan)
        if gemm_tflops:
            cal = dataclasses.replace(cal, gemm_flops=gemm_tflops * 1e12)
        if attention:
            cal = dataclasses.replace(cal, attention_rates=tuple(
                (seq, tflops * 1e12) for seq, tflops in attention))
        base = TrainConfig(preset=plan["preset"], layers=plan.get("layers"),
                           batch_size=plan["batch"],
                           seq_len=plan["seq"], dtype=plan["dtype"], dp=1, gtp=1)
        for cand in plan["candidates"]:
            step = measured.get((case, cand["flags"]))
            if step is None:
                continue
            layout = Layout(**cand["layout"])
            rows.append({"case": case, "layout": layout.describe(),
                         "recorded_ms": cand["step_seconds"] * 1e3,
                         "predicted_ms": step_seconds(layout.apply(base), cal)["total"] * 1e3,
                         "measured_ms": step * 1e3})
    return rows


def _attention_pair(text: str) -> tuple[int, float]:
    seq, _, tflops = text.partition(":")
    try:
        return int(seq), float(tflops)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--attention {text!r}: write SEQ:TFLOPS, e.g. "
                                         "4096:210") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("directory")
    parser.add_argument("--gemm-tflops", type=float, default=None,
                        help="replace the calibration's GEMM rate (TFLOP/s)")
    parser.add_argument("--attention", type=_attention_pair, nargs="+", default=(),
                        help="replace its attention rates: SEQ:TFLOPS pairs by increasing SEQ")
    args = parser.parse_args(argv)
    rows = replay(args.directory, gemm_tflops=args.gemm_tflops,
                  attention=tuple(args.attention))
    print(f"{'case':<16} {'layout':<44} {'recorded':>9} {'replayed':>9} {'measured':>9} "
          f"{'error':>7}")
    within = 0
    for r in rows:
        error = r["predicted_ms"] / r["measured_ms"] - 1
        within += abs(error) <= 0.10
        print(f"{r['case']:<16} {r['layout']:<44} {r['recorded_ms']:9.1f} "
              f"{r['predicted_ms']:9.1f} {r['measured_ms']:9.1f} {error:+7.1%}")
    print(f"{within} of {len(rows)} replayed step times within 10% of the measured ones")
    return 0


if __name__ == "__main__":
    sys.exit(main())
