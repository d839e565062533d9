"""Kernel time per training step by category, from a JAX or a PyTorch profiler trace.

Reads the GPU kernels of one device of a Chrome/Perfetto trace-event file:

- JAX: the ``perfetto_trace.json.gz`` of ``jax.profiler.trace(..., create_perfetto_trace=
  True)`` (kernels are complete events on the stream threads of ``/device:GPU:<n>``);
- PyTorch: the chrome trace of ``torch.profiler`` (``export_chrome_trace``; kernels carry
  ``"cat": "kernel"`` and a ``device`` argument).

Each kernel lands in one category (`CATEGORIES`, first match wins): GEMM, attention,
collectives, copies, optimizer, fusions/elementwise, other. Times are the sum of kernel
durations (streams that run concurrently both count), divided by the number of steps in
the trace. Given the GEMM FLOPs of one step, it also reports the GEMMs' achieved TFLOP/s.

Usage: ``python -m gtp_jax.bench.kernels TRACE [--steps N] [--device K] [--top 15]
[--gemm-tflop T] [--json OUT]``; `TRACE` may be a profiler log directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from gtp_jax.bench.trace import device_kernels, find_trace, load_events

#: (category, pattern) in match order: the first pattern that matches a kernel name wins.
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern, re.IGNORECASE)) for name, pattern in (
        ("collectives", r"nccl|all-?gather|reduce-?scatter|all-?reduce|collective-?permute|"
                        r"all-?to-?all|sendrecv"),
        ("attention", r"cudnn|fmha|flash|sdpa|attention|_attn|softmax_fwd|bprop"),
        ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|matmul|sm90_xmma|^sm\d+_"),
        ("optimizer", r"adam|multi_tensor|foreach|optim"),
        ("copies", r"memcpy|memset|copy|concatenate|dynamic[-_]update[-_]slice|transpose|"
                   r"gather|scatter|pad"),
        ("fusions/elementwise", r"fusion|triton|loop_|input_|reduce|elementwise|convert|"
                                r"broadcast|slice|select|add|multiply|vectorized|kernel"),
    ))
OTHER = "other"


def category(name: str) -> str:
    """The category of a kernel name (`CATEGORIES`, else ``"other"``)."""
    for cat, pattern in CATEGORIES:
        if pattern.search(name):
            return cat
    return OTHER


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Kernel time of one device per step.

    Attributes:
      device: which device of the trace.
      steps: steps the times are divided by.
      per_category_ms: category -> milliseconds per step.
      top: the largest kernels, ``(name, ms per step, category)``.
      kernels: number of kernel launches in the trace.
      gemm_tflops: achieved GEMM TFLOP/s (given the GEMM FLOPs per step), or None.
    """

    device: str
    steps: float
    per_category_ms: dict[str, float]
    top: tuple[tuple[str, float, str], ...]
    kernels: int
    gemm_tflops: float | None = None

    @property
    def total_ms(self) -> float:
        return sum(self.per_category_ms.values())

    def table(self) -> str:
        """A Markdown table: category, ms per step, share; then the top kernels."""
        lines = [f"{self.device}: {self.kernels} kernels, {self.total_ms:.1f} ms of kernel time "
                 f"per step", "", "| category | ms/step | share |", "|---|---|---|"]
        for cat, ms in sorted(self.per_category_ms.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {cat} | {ms:.2f} | {100 * ms / (self.total_ms or 1):.1f}% |")
        if self.gemm_tflops is not None:
            lines += ["", f"GEMM: {self.gemm_tflops:.0f} TFLOP/s achieved"]
        lines += ["", "| top kernels | ms/step | category |", "|---|---|---|"]
        lines += [f"| `{name}` | {ms:.2f} | {cat} |" for name, ms, cat in self.top]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["total_ms"] = self.total_ms
        return out


def trace_kernels(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Kernel events grouped by device, for a JAX (perfetto) or a PyTorch (chrome) trace."""
    torch_kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not torch_kernels:
        return device_kernels(events)
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in torch_kernels:
        out[f"GPU {e.get('args', {}).get('device', e.get('pid'))}"].append(e)
    return dict(out)


def breakdown(events: list[dict[str, Any]], *, steps: float = 1.0, device: int = 0,
              top: int = 15, gemm_flop_per_step: float | None = None) -> Breakdown:
    """Per-step kernel time by category of the `device`-th device (sorted by name) of a trace.

    Raises:
      ValueError: the trace holds no GPU kernels, or `device` / `steps` is out of range.
    """
    if steps <= 0:
        raise ValueError(f"steps={steps} must be > 0 (the number of steps in the trace).")
    per_device = trace_kernels(events)
    if not per_device:
        raise ValueError("the trace holds no GPU kernel events; capture it on a GPU with "
                         "jax.profiler.trace(..., create_perfetto_trace=True) or "
                         "torch.profiler (export_chrome_trace).")
    names = sorted(per_device)
    if not 0 <= device < len(names):
        raise ValueError(f"device={device}: the trace has {len(names)} devices {names}.")
    kernels = per_device[names[device]]
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for e in kernels:
        ms = float(e.get("dur", 0.0)) / 1e3 / steps
        name = e.get("name", "")
        by_cat[category(name)] += ms
        by_name[name[:100]] += ms
    largest = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    gemm_ms = by_cat.get("gemm", 0.0)
    tflops = (gemm_flop_per_step / (gemm_ms / 1e3) / 1e12
              if gemm_flop_per_step and gemm_ms else None)
    return Breakdown(device=names[device], steps=steps, per_category_ms=dict(by_cat),
                     top=tuple((n, ms, category(n)) for n, ms in largest),
                     kernels=len(kernels), gemm_tflops=tflops)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gtp_jax.bench.kernels",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="a trace file (.json or .json.gz) or a jax.profiler "
                        "log directory")
    parser.add_argument("--steps", type=float, default=1.0, help="steps captured in the trace")
    parser.add_argument("--device", type=int, default=0,
                        help="which device of the trace (index in name order)")
    parser.add_argument("--top", type=int, default=15, help="how many top kernels to list")
    parser.add_argument("--gemm-tflop", type=float, default=None,
                        help="GEMM TFLOP per step (to report achieved GEMM TFLOP/s)")
    parser.add_argument("--json", default=None, help="also write the breakdown as JSON here")
    args = parser.parse_args(argv)
    path = Path(args.trace)
    if path.is_dir():
        path = find_trace(path)
    result = breakdown(load_events(path), steps=args.steps, device=args.device, top=args.top,
                       gemm_flop_per_step=args.gemm_tflop * 1e12 if args.gemm_tflop else None)
    print(result.table())
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
