"""The on-paper planner against measured llama3-8b steps, offline (no GPU).

Predicts, with `gtp_jax.plan.paper` (closed-form memory, the time model with a stored
calibration), the llama3-8b layouts measured on 4 and 2 H200s
(`docs/results/2026-11-27_4xH200/breakdown_8b/`: `bench overlap`, gtp = GPUs, dp = 1, remat
dots, 1 sequence per GPU, the preset's 128256-token vocabulary, float32 reduce-scatter, jax
0.11.2), and prints predicted against measured step and peak as a Markdown table; then how far the
closed-form bound and estimate lie from every peak the planner compiled on a GPU in the
plan files under docs/results/ (`plan_*.json`).

Usage:

    python benchmarks/paper_check.py
    python benchmarks/paper_check.py --calibration FILE --intra-node-gbps 225
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics

from gtp_jax.plan.layout import Layout
from gtp_jax.plan.paper import load_calibration, memory_estimate
from gtp_jax.plan.timing import Topology, step_seconds
from gtp_jax.train.config import TrainConfig
from gtp_jax.train.step.memory import memory_bound

CALIBRATION = "docs/results/2026-11-27_2xH200/plan_top5/calibration.json"

#: (GPUs, seq, loop, measured step ms, measured peak GiB, what the peak is): the allocator's
#: peak of the timed run, or the compiled peak where the run reported it
#: (docs/results/2026-11-27_4xH200/breakdown_8b/README.md).
MEASURED = (
    (4, 2048, "unrolled", 302.4, 37.83, "allocator"),
    (4, 2048, "prefetch", 298.7, 38.62, "allocator"),
    (4, 8192, "unrolled", 870.7, 50.14, "allocator"),
    (4, 8192, "prefetch", 891.9, 56.19, "compiled"),
    (2, 2048, "unrolled", 300.7, 73.39, "allocator"),
    (2, 2048, "prefetch", 305.8, 67.75, "allocator"),
)


def rows(calibration: str, intra_gbps: float | None) -> list[dict[str, float | str]]:
    """Predicted against measured, one dict per measured run."""
    cal, _ = load_calibration(calibration)
    topology = Topology(8, 50e9, None if intra_gbps is None else intra_gbps * 1e9)
    out = []
    for gpus, seq, loop, step_ms, peak_gib, kind in MEASURED:
        base = TrainConfig(preset="llama3-8b", batch_size=gpus, seq_len=seq, dtype="bfloat16",
                           dp=1, gtp=1, vocab_size=128256)
        cfg = Layout(gtp=gpus, remat="dots", loop=loop).apply(base)
        predicted = step_seconds(cfg, cal, topology)["total"] * 1e3
        bound = memory_bound(cfg)["total"] / 2**30
        estimate = memory_estimate(cfg)["total"] / 2**30
        shown = "scanned + prefetch" if loop == "prefetch" else loop
        out.append({"case": f"{gpus} GPUs, seq {seq}, {shown}",
                    "step_ms": predicted, "measured_ms": step_ms, "bound": bound,
                    "estimate": estimate, "peak": peak_gib, "kind": kind})
    return out


def estimate_errors(pattern: str = "docs/results/*/**/plan_*.json") -> dict[str, list[float]]:
    """``{"bound": [...], "estimate": [...]}``: figure / compiled peak - 1 of every distinct
    layout (plan case and layout) that a plan JSON under `pattern` compiled on a GPU."""
    out: dict[str, list[float]] = {"bound": [], "estimate": []}
    seen = set()
    for path in sorted(glob.glob(pattern, recursive=True)):
        with open(path) as f:
            plan = json.load(f)
        if not isinstance(plan, dict) or plan.get("calibration", {}).get("platform") != "gpu":
            continue
        base = TrainConfig(preset=plan["preset"], layers=plan.get("layers"),
                           batch_size=plan["batch"], seq_len=plan["seq"], dtype=plan["dtype"],
                           dp=1, gtp=1)
        for cand in plan.get("candidates", []):
            if not cand.get("peak_bytes"):
                continue
            layout = Layout(**{k: tuple(v) if isinstance(v, list) else v
                               for k, v in cand["layout"].items()})
            key = (path.split("/")[2], plan["preset"], plan["seq"], plan["batch"], layout)
            if key in seen:
                continue
            seen.add(key)
            cfg = layout.apply(base)
            out["bound"].append(memory_bound(cfg)["total"] / cand["peak_bytes"] - 1)
            out["estimate"].append(memory_estimate(cfg)["total"] / cand["peak_bytes"] - 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--calibration", default=CALIBRATION)
    parser.add_argument("--intra-node-gbps", type=float, default=None,
                        help="collective bus bandwidth within the host, GB/s (default: the "
                        "calibration's)")
    args = parser.parse_args()
    print("| llama3-8b, gtp = GPUs | predicted step ms | measured ms | error | bound GiB | "
          "estimate GiB | measured peak GiB | bound / estimate error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows(args.calibration, args.intra_node_gbps):
        print(f"| {r['case']} | {r['step_ms']:.1f} | {r['measured_ms']:.1f} | "
              f"{r['step_ms'] / r['measured_ms'] - 1:+.1%} | {r['bound']:.2f} | "
              f"{r['estimate']:.2f} | {r['peak']:.2f} ({r['kind']}) | "
              f"{r['bound'] / r['peak'] - 1:+.0%} / {r['estimate'] / r['peak'] - 1:+.1%} |")
    errors = estimate_errors()
    print(f"\nagainst the {len(errors['estimate'])} layouts compiled on GPUs in docs/results/ "
          "plan files (figure / compiled peak - 1):")
    for name, values in errors.items():
        print(f"  {name}: {min(values):+.1%} to {max(values):+.1%}, median "
              f"{statistics.median(values):+.1%}")


if __name__ == "__main__":
    main()
