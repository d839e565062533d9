"""llama3-70b on 8 to 64 H200s, on paper: the tables of docs/planning.md, offline (no GPU).

Runs `gtp_jax.plan.plan_on_paper` (what ``python -m gtp_jax plan --on-paper`` prints) for
8, 16, 32 and 64 GPUs at seq 8192 with 1 and 2 sequences per GPU, and prints as Markdown
each case's top layout (and the fastest one whose estimate is not within the estimate's
error of the budget, where the top one's is), then what the inter-node term, the
in-node bandwidth, the measured overlap and the budget change at 64 GPUs.

Usage:

    python docs/results/2026-11-27_CPU/paper_70b/paper_70b.py
    python docs/results/2026-11-27_CPU/paper_70b/paper_70b.py --calibration FILE --memory-gib 139
"""

from __future__ import annotations

import argparse
import dataclasses

from gtp_jax.plan import Topology, load_calibration, plan_on_paper
from gtp_jax.plan.paper import INTER_NODE_GBPS, PaperCandidate, PaperPlan
from gtp_jax.train.config import TrainConfig

CALIBRATION = "docs/results/2026-11-27_2xH200/plan_top5/calibration.json"
SEQ = 8192


def _plan(gpus: int, per_gpu: int, cal, memory_gib: float, topology: Topology) -> PaperPlan:
    base = TrainConfig(preset="llama3-70b", batch_size=gpus * per_gpu, seq_len=SEQ,
                       dtype="bfloat16", dp=1, gtp=1, vocab_size=128256)
    return plan_on_paper(base, gpus=gpus, memory_gib=memory_gib, cal=cal,
                         topology=topology)


def _row(result: PaperPlan, cand: PaperCandidate, label: str) -> str:
    tight = cand.tight(result.budget_bytes)
    return (f"| {label} | {cand.layout.describe()} | {','.join(cand.across_nodes) or '-'} | "
            f"{cand.step_seconds:.2f} | {result.tokens_per_gpu() / cand.step_seconds:.0f} | "
            f"{result.mfu(cand.step_seconds):.1%} | {cand.estimate_bytes / 2**30:.1f} "
            f"({cand.bound_bytes / 2**30:.1f}) | {'tight' if tight else 'fits'} |")


def _picks(result: PaperPlan) -> list[PaperCandidate]:
    best = result.best
    if best is None:
        return []
    picks = [best]
    if best.tight(result.budget_bytes):
        safe = next((c for c in result.candidates
                     if c.fits and not c.tight(result.budget_bytes)), None)
        picks += [safe] if safe is not None else []
    return picks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", default=CALIBRATION)
    parser.add_argument("--memory-gib", type=float, default=139.0)
    args = parser.parse_args()
    cal, origin = load_calibration(args.calibration)
    topology = Topology(8, INTER_NODE_GBPS * 1e9)
    print(f"calibration: {origin}\n")
    print("| GPUs (nodes of 8), tokens per GPU | layout | across nodes | step s | "
          "tokens/s per GPU | MFU | est. (bound) GiB per GPU | memory |")
    print("|---|---|---|---|---|---|---|---|")
    for gpus in (8, 16, 32, 64):
        for per_gpu in (1, 2):
            result = _plan(gpus, per_gpu, cal, args.memory_gib, topology)
            label = f"{gpus} ({max(gpus // 8, 1)}), {per_gpu * SEQ}"
            if result.offload:
                label += f", {result.offload} offloaded"
            for cand in _picks(result):
                print(_row(result, cand, label))
    print("\n64 GPUs, 8192 tokens per GPU: what moves the prediction\n")
    print("| variant | top layout | across nodes | step s | tokens/s per GPU | MFU | "
          "est. (bound) GiB per GPU | memory |")
    print("|---|---|---|---|---|---|---|---|")
    variants = [
        ("as above: 8 GPUs per node, 50 GB/s between nodes", cal, topology, args.memory_gib),
        ("one NVLink domain of 64 (no inter-node term)", cal,
         Topology(64, INTER_NODE_GBPS * 1e9), args.memory_gib),
        ("25 GB/s between nodes", cal, Topology(8, 25e9), args.memory_gib),
        ("100 GB/s between nodes", cal, Topology(8, 100e9), args.memory_gib),
        ("360 GB/s within a node (assumed 8-GPU NVLink rate)", cal,
         Topology(8, INTER_NODE_GBPS * 1e9, 360e9), args.memory_gib),
        ("28% of overlapped collectives exposed (the 8b step's trace at 8192)",
         dataclasses.replace(cal, overlap_exposed=0.28), topology, args.memory_gib),
        ("XLA's default budget, 75% of the card (104.85 GiB)", cal, topology, 104.85),
    ]
    for label, rates, top, gib in variants:
        result = _plan(64, 1, rates, gib, top)
        for cand in _picks(result):
            print(_row(result, cand, label))


if __name__ == "__main__":
    main()
