"""``python -m gtp_jax.bench breakdown``: where one training step's time and memory go,
gtp_jax and the PyTorch FSDP2 peer side by side.

It runs gtp_jax's step (``bench overlap``'s ``gtp`` variant, remat as given) traced, with the
optimized HLO dumped, and the peer (``benchmarks/torch_fsdp2.py``, blocks compiled) traced,
on the same model, sequence and batch; then reads each trace (`step_breakdown`) and gtp_jax's
buffer assignment (`gtp_jax.bench.memory`):

- time per step by category: GEMM, attention, elementwise (fusions), optimizer (JAX: the
  kernels of the update, found through the HLO instructions they run for; PyTorch: its
  AdamW kernels), copies, other; and the wall time split into compute (some compute kernel
  running), exposed collectives (a collective running and no compute) and idle (nothing);
- peak memory by category (gtp_jax: `gtp_jax.bench.memory`; the peer: its allocator's peak
  beside the bytes of its sharded parameters, gradients and optimizer state);
- the time to the first step of each side (``first_step_s`` in ``breakdown.json``; gtp_jax's
  split into the compile, with the persistent compilation cache's hit or miss, and the run).

Usage::

    python -m gtp_jax.bench breakdown --preset llama3-8b --seq 2048 --per-device-batch 1 \\
        --out runs/breakdown_8b_2048

Any further options after ``--`` go to ``bench overlap`` (e.g. ``-- --reduce-dtype
bfloat16``). ``--analyze DIR`` re-reads a folder an earlier run wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from gtp_jax.bench.kernels import breakdown as kernel_breakdown
from gtp_jax.bench.kernels import category, hlo_instructions, instruction_of
from gtp_jax.bench.trace import (
    COMM_PATTERN,
    device_ops,
    find_trace,
    intersect,
    length,
    load_events,
    union,
)

#: Categories of compute kernel time, in table order.
TIME_CATEGORIES = ("gemm", "attention", "elementwise", "optimizer", "copies", "other")
_KERNEL_CATEGORY = {"gemm": "gemm", "attention": "attention", "optimizer": "optimizer",
                    "copies": "copies", "fusions/elementwise": "elementwise"}


@dataclasses.dataclass(frozen=True)
class StepBreakdown:
    """One device's time per step (milliseconds).

    Attributes:
      kernel_ms: compute kernel time by `TIME_CATEGORIES` (sums of kernel durations).
      collective_ms: time some collective ran (union).
      exposed_ms: time a collective ran and no compute kernel did.
      compute_ms: time some compute kernel ran (union).
      idle_ms: time no kernel ran, within the traced steps.
      wall_ms: the traced window per step (first kernel start to last kernel end).
    """

    kernel_ms: dict[str, float]
    collective_ms: float
    exposed_ms: float
    compute_ms: float
    idle_ms: float
    wall_ms: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def step_breakdown(events: list[dict[str, Any]], *, steps: int, device: int = 0,
                   update_ops: frozenset[str] = frozenset()) -> StepBreakdown:
    """`StepBreakdown` of the `device`-th device (name order) of a JAX or PyTorch trace of
    `steps` steps. `update_ops`: names of the HLO instructions of the optimizer update (JAX
    traces; their kernels count as "optimizer")."""
    from gtp_jax.bench.kernels import trace_kernels

    per_device = trace_kernels(events)
    if not per_device:
        raise ValueError("the trace holds no GPU kernels")
    name = sorted(per_device)[device]
    kernels = per_device[name]
    op_of = instruction_of(device_ops(events).get(name, []))
    by_cat: dict[str, float] = defaultdict(float)
    comm, compute, every = [], [], []
    for k in kernels:
        t0 = float(k["ts"])
        span = (t0, t0 + float(k.get("dur", 0.0)))
        every.append(span)
        kname = k.get("name", "")
        if COMM_PATTERN.search(kname):
            comm.append(span)
            continue
        compute.append(span)
        cat = _KERNEL_CATEGORY.get(category(kname), "other")
        if cat in ("elementwise", "copies", "other") and op_of(k) in update_ops:
            cat = "optimizer"
        by_cat[cat] += (span[1] - span[0]) / 1e3 / steps
    comm_u, compute_u, busy = union(comm), union(compute), union(every)
    window = (busy[-1][1] - busy[0][0]) if busy else 0.0
    hidden = length(intersect(comm_u, compute_u))
    return StepBreakdown(
        kernel_ms={c: by_cat.get(c, 0.0) for c in TIME_CATEGORIES},
        collective_ms=length(comm_u) / 1e3 / steps,
        exposed_ms=(length(comm_u) - hidden) / 1e3 / steps,
        compute_ms=length(compute_u) / 1e3 / steps,
        idle_ms=(window - length(busy)) / 1e3 / steps,
        wall_ms=window / 1e3 / steps)


def update_instructions(hlo_text: str) -> frozenset[str]:
    """Names of the HLO instructions that belong to the optimizer update (op names outside
    the forward and backward passes: neither ``jvp(`` nor ``transpose(``)."""
    from gtp_jax.bench.memory import read_instructions

    return frozenset(n for n, inst in read_instructions(hlo_text).items()
                     if inst.op_name.startswith("jit(") and "jvp(" not in inst.op_name)


def side_by_side(rows: dict[str, StepBreakdown], step_ms: dict[str, float]) -> str:
    """A Markdown table with one column per run."""
    names = list(rows)
    head = "| ms per step | " + " | ".join(names) + " |"
    lines = [head, "|---" * (len(names) + 1) + "|"]

    def row(label: str, values: list[float]) -> None:
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + " |")

    row("step (timed median)", [step_ms.get(n, float("nan")) for n in names])
    row("traced window", [rows[n].wall_ms for n in names])
    for cat in TIME_CATEGORIES:
        row(f"kernels: {cat}", [rows[n].kernel_ms[cat] for n in names])
    row("collectives (any running)", [rows[n].collective_ms for n in names])
    row("compute (any kernel running)", [rows[n].compute_ms for n in names])
    row("exposed collectives", [rows[n].exposed_ms for n in names])
    row("idle", [rows[n].idle_ms for n in names])
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gtp_jax.bench breakdown", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--per-device-batch", type=int, default=1)
    p.add_argument("--remat", default="dots", choices=("none", "dots", "full"))
    p.add_argument("--steps", type=int, default=8, help="timed steps of each side")
    p.add_argument("--out", default="runs/breakdown", help="folder for traces and dumps")
    p.add_argument("--no-torch", action="store_true", help="gtp_jax only")
    p.add_argument("--torch-env", default="", help="extra KEY=VALUE,... for the peer "
                   "(e.g. AC=full)")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per side")
    p.add_argument("--analyze", default=None, help="re-read a folder an earlier run wrote")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = _parser().parse_args(argv)
    out = Path(args.analyze or args.out)
    if not args.analyze:
        out.mkdir(parents=True, exist_ok=True)
        _run_sides(args, out, extra)
    return _report(out)


def _run_sides(args: argparse.Namespace, out: Path, extra: list[str]) -> None:
    from gtp_jax.bench.memory import dump_flags
    from gtp_jax.bench.overlap import run_for_result

    variant = "gtp_dots" if args.remat == "dots" else "gtp"  # none, or full via --remat
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {dump_flags(out / 'dump')}".strip()
    cmd = [sys.executable, "-m", "gtp_jax.bench", "overlap", "--preset", args.preset,
           "--seq", str(args.seq), "--per-device-batch", str(args.per_device_batch),
           "--steps", str(args.steps), "--warmup", "2", "--variants", variant,
           "--profile-dir", str(out / "profile"), "--profile-variants", variant,
           "--json", str(out / "gtp_jax.json"), "--timeout", str(args.timeout), *extra]
    if args.remat == "full":
        cmd += ["--remat", "full"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, timeout=args.timeout + 60)
    if args.no_torch:
        return
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "torch_fsdp2.py"
    import jax

    tenv = dict(os.environ, PRESET=args.preset, SEQ=str(args.seq),
                MB=str(args.per_device_batch), STEPS=str(args.steps), COMPILE="1",
                PROFILE=str(out / "torch_trace.json"), AC="full" if args.remat == "full"
                else "none")
    for item in filter(None, args.torch_env.split(",")):
        key, _, value = item.partition("=")
        tenv[key] = value
    row = run_for_result("torch", ["torchrun", f"--nproc_per_node={jax.device_count()}",
                                    str(script)], args.timeout, tenv)
    if row:
        (out / "torch.json").write_text(json.dumps(row, indent=1))


def _report(out: Path) -> int:
    from gtp_jax.bench.memory import breakdown_of_dump, model_shapes
    from gtp_jax.bench.overlap import first_step_text

    rows: dict[str, StepBreakdown] = {}
    step_ms: dict[str, float] = {}
    summary: dict[str, Any] = {}
    kernel_tables: dict[str, str] = {}
    jax_rows = json.loads((out / "gtp_jax.json").read_text()) if (
        out / "gtp_jax.json").exists() else []
    if jax_rows:
        r = jax_rows[0]
        from gtp_jax.bench.memory import find_dump

        _, hlo = find_dump(out / "dump")
        update = update_instructions(hlo.read_text())
        steps = 3  # bench overlap's PROFILE_STEPS
        try:
            events = load_events(find_trace(out / "profile"))
            rows["gtp_jax"] = step_breakdown(events, steps=steps, update_ops=update)
            kernel_tables["gtp_jax"] = kernel_breakdown(
                events, steps=steps, top=15, hlo=hlo_instructions(hlo.read_text())).table()
        except ValueError as err:  # a CPU trace has no device kernels
            print(f"gtp_jax trace: {err}")
        step_ms["gtp_jax"] = r["step_ms"]
        from gtp_jax.models import preset

        cfg = preset(r["preset"])
        weights, vocab = model_shapes(cfg)
        mem = breakdown_of_dump(out / "dump", weight_elements=weights, vocab=vocab)
        summary["gtp_jax"] = {"step": r, "memory": mem.as_dict()}
        summary["first_step_s"] = {"gtp_jax": r.get("first_step_s")}
        print(f"gtp_jax: {r['step_ms']:.1f} ms, MFU {_pct(r.get('mfu'))}, allocator peak "
              f"{r['peak_mem_gib']:.2f} GiB, state {r['state_gib']:.2f} GiB "
              f"({r['device_kind']} x{r['devices']}){first_step_text(r)}")
        print(mem.table())
    if (out / "torch.json").exists() and (out / "torch_trace.json").exists():
        t = json.loads((out / "torch.json").read_text())
        events = load_events(out / "torch_trace.json")
        rows["torch_fsdp2"] = step_breakdown(events, steps=3)
        kernel_tables["torch_fsdp2"] = kernel_breakdown(events, steps=3, top=15).table()
        step_ms["torch_fsdp2"] = t["step_ms"]
        summary["torch_fsdp2"] = {"step": t}
        summary.setdefault("first_step_s", {})["torch_fsdp2"] = t.get("first_step_s")
        state = t.get("state_gib")
        print(f"\ntorch_fsdp2 ({t.get('recipe', 'compiled')}): {t['step_ms']:.1f} ms, MFU "
              f"{_pct(t.get('mfu'))}, allocator peak {t['peak_mem_gib']:.2f} GiB"
              + (f", sharded params + grads + optimizer {state:.2f} GiB, the rest "
                 f"{t['peak_mem_gib'] - state:.2f} GiB" if state else "")
              + first_step_text(t))
    for name, table in kernel_tables.items():
        print(f"\n## {name}: kernels\n\n{table}")
    if rows:
        print()
        print(side_by_side(rows, step_ms))
        summary["time"] = {k: v.as_dict() for k, v in rows.items()}
    if summary:
        (out / "breakdown.json").write_text(json.dumps(summary, indent=1))
        return 0
    print(f"{out}: nothing to report (no gtp_jax.json or torch.json)", file=sys.stderr)
    return 1


def _pct(x: float | None) -> str:
    return f"{x * 100:.1f}%" if x else "-"


if __name__ == "__main__":
    raise SystemExit(main())
