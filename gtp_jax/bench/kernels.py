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

With a JAX trace, each kernel is also attributed to the HLO instruction it runs for (the
trace's "XLA Ops" rows), and the largest instructions are listed; given the optimized HLO
text of the step (``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"``, ``--hlo DIR``),
each gets its shape and the JAX operation and source line it came from, which is how a
fusion or copy is traced back to the model code.

Usage: ``python -m gtp_jax.bench.kernels TRACE [--steps N] [--device K] [--top 15]
[--gemm-tflop T] [--hlo FILE_OR_DIR] [--json OUT]``; `TRACE` may be a profiler log
directory.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from gtp_jax.bench.trace import device_kernels, device_ops, find_trace, load_events

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
                                r"broadcast|slice|select|add|multiply|vectorized|kernel|"
                                r"swiglu|rms_?norm|rope"),
    ))
OTHER = "other"


def category(name: str) -> str:
    """The category of a kernel name (`CATEGORIES`, else ``"other"``)."""
    for cat, pattern in CATEGORIES:
        if pattern.search(name):
            return cat
    return OTHER


@dataclasses.dataclass(frozen=True)
class OpTime:
    """Kernel time of one HLO instruction per step.

    Attributes:
      op: the instruction's name in the optimized HLO (e.g. ``loop_add_fusion.5``).
      ms: its kernels' time per step.
      category: the category of most of that time.
      shape: its result shape, from the HLO text ("" without one).
      source: the JAX operation and source line it came from ("" without HLO text).
    """

    op: str
    ms: float
    category: str
    shape: str = ""
    source: str = ""


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
      ops: the largest HLO instructions (JAX traces with "XLA Ops" rows; else empty).
    """

    device: str
    steps: float
    per_category_ms: dict[str, float]
    top: tuple[tuple[str, float, str], ...]
    kernels: int
    gemm_tflops: float | None = None
    ops: tuple[OpTime, ...] = ()

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
        if self.ops:
            lines += ["", "| top HLO instructions | ms/step | category | shape | from |",
                      "|---|---|---|---|---|"]
            lines += [f"| `{o.op}` | {o.ms:.2f} | {o.category} | `{o.shape}` | {o.source} |"
                      for o in self.ops]
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
              top: int = 15, gemm_flop_per_step: float | None = None,
              hlo: dict[str, tuple[str, str]] | None = None) -> Breakdown:
    """Per-step kernel time by category of the `device`-th device (sorted by name) of a trace,
    and per HLO instruction (`attribute`; `hlo` from `read_hlo` adds shapes and sources).

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
    ops = attribute(kernels, device_ops(events).get(names[device], []), steps=steps,
                    hlo=hlo or {})
    return Breakdown(device=names[device], steps=steps, per_category_ms=dict(by_cat),
                     top=tuple((n, ms, category(n)) for n, ms in largest),
                     kernels=len(kernels), gemm_tflops=tflops, ops=tuple(ops[:top]))


def attribute(kernels: list[dict[str, Any]], ops: list[dict[str, Any]], *, steps: float,
              hlo: dict[str, tuple[str, str]]) -> list[OpTime]:
    """Kernel time per HLO instruction, largest first.

    Each kernel goes to the innermost "XLA Ops" event that covers its start (ops may nest,
    e.g. a while loop and its body). Traces without those rows (kernels replayed from CUDA
    graphs) are matched by name instead: XLA names a fusion's kernel after the instruction
    (``loop_add_fusion_5`` runs ``loop_add_fusion.5``); library kernels (cuBLAS, cuDNN,
    copies) keep their own names. `hlo` maps instruction names to ``(shape, source)``
    (`hlo_instructions`).
    """
    if not ops and not hlo:
        return []
    instruction = instruction_of(ops, hlo)
    ms: dict[str, float] = defaultdict(float)
    cats: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for k in kernels:
        name = instruction(k)
        d = float(k.get("dur", 0.0)) / 1e3 / steps
        ms[name] += d
        cats[name][category(k.get("name", ""))] += d
    return [OpTime(op=name, ms=t, category=max(cats[name].items(), key=lambda kv: kv[1])[0],
                   shape=hlo.get(name, ("", ""))[0], source=hlo.get(name, ("", ""))[1])
            for name, t in sorted(ms.items(), key=lambda kv: -kv[1])]


def instruction_of(ops: list[dict[str, Any]], hlo: Any = None) -> Any:
    """``f(kernel) -> HLO instruction name``: the innermost "XLA Ops" event (`ops`) covering
    the kernel's start, or without those rows (kernels replayed from CUDA graphs) the name
    XLA gives a fusion's kernel (``loop_add_fusion_5`` runs ``loop_add_fusion.5``; with
    `hlo`, a collection of instruction names, only where that name exists)."""
    if not ops:
        def named_instruction(kernel: dict[str, Any]) -> str:
            name = kernel.get("name", "")
            dotted = re.sub(r"_(\d+)$", r".\1", name)
            if hlo is None:
                return dotted
            return dotted if dotted in hlo and name not in hlo else name

        return named_instruction
    ops = sorted(ops, key=lambda e: float(e["ts"]))
    starts = [float(e["ts"]) for e in ops]

    def covering_op(kernel: dict[str, Any]) -> str:
        t = float(kernel.get("ts", 0.0))
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0 and float(ops[i]["ts"]) + float(ops[i]["dur"]) < t:
            i -= 1
        return ops[i]["name"] if i >= 0 else "(no XLA op)"

    return covering_op


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SOURCE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')


def hlo_instructions(text: str) -> dict[str, tuple[str, str]]:
    """``name -> (shape, source)`` for every instruction of an HLO text module; `source`
    is the last part of the JAX op name and the source file and line, when present."""
    out: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        op_name = _OP_NAME.search(line)
        where = _SOURCE.search(line)
        parts = [opcode]
        if op_name:
            parts.append("/".join(op_name.group(1).split("/")[-4:]))
        if where:
            parts.append(f"{Path(where.group(1)).name}:{where.group(2)}")
        out[name] = (re.sub(r"\{[^}]*\}", "", shape), " ".join(parts))
    return out


def read_hlo(path: str | Path) -> dict[str, tuple[str, str]]:
    """`hlo_instructions` of an optimized HLO text file, or of the largest
    ``*after_optimizations.txt`` file of an ``--xla_dump_to`` folder (the training step)."""
    path = Path(path)
    if path.is_dir():
        dumps = sorted(path.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
        if not dumps:
            raise ValueError(f"--hlo {path}: no *after_optimizations.txt file; dump with "
                             'XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text".')
        path = dumps[-1]
    return hlo_instructions(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gtp_jax.bench.kernels",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("trace", help="a trace file (.json or .json.gz) or a jax.profiler "
                        "log directory")
    parser.add_argument("--steps", type=float, default=1.0, help="steps captured in the trace")
    parser.add_argument("--device", type=int, default=0,
                        help="which device of the trace (index in name order)")
    parser.add_argument("--top", type=int, default=15, help="how many top kernels to list")
    parser.add_argument("--gemm-tflop", type=float, default=None,
                        help="GEMM TFLOP per step (to report achieved GEMM TFLOP/s)")
    parser.add_argument("--hlo", default=None,
                        help="optimized HLO text of the step (a file, or an --xla_dump_to "
                        "folder) to name each HLO instruction's shape and source")
    parser.add_argument("--json", default=None, help="also write the breakdown as JSON here")
    args = parser.parse_args(argv)
    path = Path(args.trace)
    if path.is_dir():
        path = find_trace(path)
    result = breakdown(load_events(path), steps=args.steps, device=args.device, top=args.top,
                       gemm_flop_per_step=args.gemm_tflop * 1e12 if args.gemm_tflop else None,
                       hlo=read_hlo(args.hlo) if args.hlo else None)
    print(result.table())
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
