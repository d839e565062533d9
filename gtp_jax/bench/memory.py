"""``python -m gtp_jax.bench memory``: a training step's peak memory by category, from XLA's
buffer assignment.

XLA writes, with ``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"``, a
``*-live-range.txt`` file per compiled program whose "Live ranges at N (peak)" section lists
every buffer live at the program's peak (instruction N of its schedule) with its bytes. This
module reads that list, looks each buffer's defining instruction up in the optimized HLO
text (its opcode and the JAX operation it came from, ``op_name``) and puts it in one of
`CATEGORIES`:

- ``sharded state``: the step's inputs that are the model's parameters and optimizer state
  (``state[...]`` op names), 1/N per device;
- ``batch``: the other inputs (the token batch);
- ``gathered weights``: all-gather results and what is made of them in the forward pass (a
  buffer of a weight's size and dtype, outside the backward pass, not a matmul's result);
- ``weight gradients``: reduce-scatter inputs and results, and buffers of a weight's size
  made in the backward pass (full per-device gradients before their reduce-scatter);
- ``logits and loss``: buffers with a vocabulary-sized dim;
- ``saved activations``: made in the forward pass and still live at a peak that lies in the
  backward pass (what the remat policy keeps);
- ``optimizer``: made after the backward pass (the update's temporaries, new moments);
- ``temporaries``: everything else (the backward pass's working buffers).

The categories are read off names and shapes, so they are a guide, not a proof; the total
is XLA's own. It works on any backend (a GPU's figures come from the GPU compiler, a CPU
host's from the CPU compiler, which upcasts and fuses differently).

Usage::

    python -m gtp_jax.bench memory --preset llama3-8b --seq 2048 --batch 4 --gtp 4 --dp 1
    python -m gtp_jax.bench memory --dump DIR --preset llama3-8b   # a dump made elsewhere
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

CATEGORIES = ("sharded state", "batch", "gathered weights", "weight gradients",
              "logits and loss", "saved activations", "optimizer", "temporaries")

_PEAK = re.compile(r"^\s*Live ranges at (\d+) \(peak\):")
_LIVE = re.compile(r"^\s*([\w.\-]+)\{[\d,]*\}: (\d+) bytes")
_SEQ = re.compile(r"^\s*(\d+):([\w.\-]+)$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\(.*?\)|[a-z]\w*\[[^\]]*\](?:\{[^}]*\})?|\w+\[\]) "
    r"([a-z][\w\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_DIMS = re.compile(r"(\w+)\[([\d,]*)\]")
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1, "s8": 1, "u8": 1, "pred": 1}


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of the optimized HLO: opcode, result shape text, JAX op name."""

    opcode: str
    shape: str
    op_name: str


@dataclasses.dataclass(frozen=True)
class PeakBreakdown:
    """A program's peak memory (bytes per device) by category.

    Attributes:
      peak_bytes: the sum of the buffers live at the peak (XLA's figure).
      by_category: category -> bytes (every category of `CATEGORIES`, zeros included).
      phase: where the peak lies: "forward", "backward" or "update".
      at: the JAX operation running at the peak.
      largest: the largest buffers, ``(bytes, category, shape, op name)``.
      allocated_bytes: what buffer assignment allocates for the program in device memory
        (its memory-usage report's total; 0 where there is none): above `peak_bytes` by
        the space its heap layout cannot reuse (buffers that are never live together but
        do not fit in each other's place).
    """

    peak_bytes: int
    by_category: dict[str, int]
    phase: str
    at: str
    largest: tuple[tuple[int, str, str, str], ...]
    allocated_bytes: int = 0

    def table(self) -> str:
        gib = 2**30
        lines = [f"peak {self.peak_bytes / gib:.2f} GiB per device, in the {self.phase} pass "
                 f"(at {_short(self.at)})", "", "| category | GiB | share |", "|---|---|---|"]
        for cat in CATEGORIES:
            b = self.by_category.get(cat, 0)
            if b:
                lines.append(f"| {cat} | {b / gib:.2f} | {100 * b / self.peak_bytes:.1f}% |")
        if self.allocated_bytes > self.peak_bytes:
            lines.append(f"| allocated, never live at the peak (heap layout) | "
                         f"{(self.allocated_bytes - self.peak_bytes) / gib:.2f} | - |")
        lines += ["", "| largest buffers | MiB | category | from |", "|---|---|---|---|"]
        lines += [f"| `{shape}` | {b / 2**20:.0f} | {cat} | {_short(op)} |"
                  for b, cat, shape, op in self.largest]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _short(op_name: str, parts: int = 4) -> str:
    return "/".join(op_name.split("/")[-parts:]) if op_name else "-"


def read_instructions(text: str) -> dict[str, Instruction]:
    """Every instruction of an optimized HLO text module (all computations). A fusion with
    no op name of its own takes the first one inside the computation it calls."""
    out: dict[str, Instruction] = {}
    calls: dict[str, str] = {}
    operands: dict[str, str] = {}
    first_op: dict[str, str] = {}
    computation = ""
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            computation = head.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        op = _OP_NAME.search(line)
        name = op.group(1) if op else ""
        if name and "jit(" in name:
            first_op.setdefault(computation, name)
        called = _CALLS.search(line)
        if called:
            calls[m.group(1)] = called.group(1)
        operand = _OPERAND.search(line[m.end():])
        if operand:
            operands[m.group(1)] = operand.group(1)
        out[m.group(1)] = Instruction(m.group(3), m.group(2), name)
    for inst_name, comp in calls.items():
        inst = out[inst_name]
        if not inst.op_name and comp in first_op:
            out[inst_name] = dataclasses.replace(inst, op_name=first_op[comp])
    # Still nameless (a copy or convert XLA made): the name of its first operand's chain.
    for inst_name, inst in list(out.items()):
        source, hops = inst_name, 0
        while not out[source].op_name and source in operands and hops < 8:
            source, hops = operands[source], hops + 1
            if source not in out:
                break
        if not inst.op_name and source in out and out[source].op_name:
            out[inst_name] = dataclasses.replace(inst, op_name=out[source].op_name)
    return out


def _phase(op_name: str) -> str:
    """forward (``jvp(...)`` alone), backward (``transpose(...)``) or update (neither)."""
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "update"


def _elements(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _DIMS.findall(shape)]


def classify(inst: Instruction | None, nbytes: int, *, peak_phase: str,
             weight_elements: frozenset[int], vocab: frozenset[int]) -> str:
    """The category of one buffer live at the peak (see the module docstring)."""
    if inst is None:
        return "temporaries"
    op = inst.op_name
    if inst.opcode == "parameter":
        return "sharded state" if op.startswith("state") else "batch"
    if "all-gather" in inst.opcode or "all_gather" in op:
        return "gathered weights"
    if "reduce-scatter" in inst.opcode or "psum_scatter" in op or "reduce_scatter" in op:
        return "weight gradients"
    phase = _phase(op) if op else peak_phase
    shapes = _elements(inst.shape)
    elements = {_prod(dims) for _, dims in shapes}
    if phase == "update":
        return "optimizer"
    # A matmul's result in the forward pass is an activation, even where its element count
    # is a weight's (llama3-8b at 2048 tokens: the [2048, 28672] gate_up output has the
    # down projection's 4096 x 14336 elements).
    activation = phase == "forward" and op.endswith("dot_general")
    if (elements & weight_elements and not activation
            and not any(set(dims) & vocab and len(dims) >= 3 for _, dims in shapes)):
        return "weight gradients" if phase == "backward" else "gathered weights"
    if any(set(dims) & vocab for _, dims in shapes):
        return "logits and loss"
    if phase == "forward" and peak_phase != "forward":
        return "saved activations"
    return "temporaries"


def _prod(dims: tuple[int, ...]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def peak_breakdown(live_range_text: str, hlo_text: str, *,
                   weight_elements: frozenset[int] = frozenset(),
                   vocab: frozenset[int] = frozenset(), largest: int = 12) -> PeakBreakdown:
    """The peak of one program from its ``*-live-range.txt`` and optimized HLO texts.

    Args:
      weight_elements: element counts of the model's full (per-layer) weights, to tell
        gathered weights and their gradients from other buffers.
      vocab: the vocabulary's size (and its padded sizes), to find logits.

    Raises:
      ValueError: the live-range text has no peak section (an XLA that does not write it).
    """
    lines = live_range_text.splitlines()
    sequence: dict[int, str] = {}
    at = None
    live: list[tuple[str, int]] = []
    in_peak = False
    for line in lines:
        m = _PEAK.match(line)
        if m:
            at, in_peak = int(m.group(1)), True
            continue
        if in_peak:
            lm = _LIVE.match(line)
            if lm:
                live.append((lm.group(1), int(lm.group(2))))
                continue
            if line.strip():
                in_peak = False
        sm = _SEQ.match(line)
        if sm and not in_peak:
            sequence.setdefault(int(sm.group(1)), sm.group(2))
    if at is None:
        raise ValueError("no 'Live ranges at N (peak)' section in the live-range dump; this "
                         "XLA does not write one.")
    instructions = read_instructions(hlo_text)
    at_inst = instructions.get(sequence.get(at, ""))
    at_name = at_inst.op_name if at_inst else sequence.get(at, "")
    # The op at the peak may be a fusion with no op name: look around it for one that has.
    peak_phase = _phase(at_name) if at_name and "jit(" in at_name else None
    for delta in range(1, 50):
        if peak_phase:
            break
        for i in (at - delta, at + delta):
            inst = instructions.get(sequence.get(i, ""))
            if inst and "jit(" in inst.op_name:
                peak_phase, at_name = _phase(inst.op_name), inst.op_name
                break
    peak_phase = peak_phase or "backward"
    by_cat: dict[str, int] = defaultdict(int)
    rows = []
    for name, nbytes in live:
        inst = instructions.get(name)
        cat = classify(inst, nbytes, peak_phase=peak_phase,
                       weight_elements=weight_elements, vocab=vocab)
        by_cat[cat] += nbytes
        shape = re.sub(r"\{[^}]*\}", "", inst.shape) if inst else name
        rows.append((nbytes, cat, shape, inst.op_name if inst and inst.op_name else name))
    rows.sort(key=lambda r: -r[0])
    return PeakBreakdown(peak_bytes=sum(b for _, b in live),
                         by_category={c: by_cat.get(c, 0) for c in CATEGORIES},
                         phase=peak_phase, at=at_name, largest=tuple(rows[:largest]))


_TOTAL = re.compile(r"^Memory Space: default.*\n\s*Total bytes: (\d+)", re.MULTILINE)


def allocated_bytes(report_text: str) -> int:
    """The default memory space's total from a ``*-memory-usage-report.txt`` (0 if none)."""
    m = _TOTAL.search(report_text)
    return int(m.group(1)) if m else 0


def find_dump(directory: str | Path, name: str = "step") -> tuple[Path, Path]:
    """``(live-range file, optimized HLO file)`` of the largest program in an
    ``--xla_dump_to`` folder whose module name contains `name`."""
    directory = Path(directory)
    ranges = [p for p in directory.glob("*after_optimizations-live-range.txt")
              if name in p.name]
    if not ranges:
        raise ValueError(f"{directory}: no *after_optimizations-live-range.txt of a module "
                         f"named like {name!r}; dump with XLA_FLAGS=\"--xla_dump_to=DIR "
                         "--xla_dump_hlo_as_text\".")
    best = max(ranges, key=lambda p: p.with_name(
        p.name.replace("-live-range.txt", ".txt")).stat().st_size
        if p.with_name(p.name.replace("-live-range.txt", ".txt")).exists() else 0)
    return best, best.with_name(best.name.replace("-live-range.txt", ".txt"))


def dump_flags(directory: str | Path) -> str:
    """The ``XLA_FLAGS`` that make XLA write what `peak_breakdown` reads (only the step's
    optimized module, no pass-by-pass dumps)."""
    return (f"--xla_dump_to={directory} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$ "
            "--xla_dump_hlo_module_re=.*step.*")


def breakdown_of_dump(directory: str | Path, *, weight_elements: frozenset[int] = frozenset(),
                      vocab: frozenset[int] = frozenset()) -> PeakBreakdown:
    """`peak_breakdown` of the largest step program dumped in `directory`."""
    ranges, hlo = find_dump(directory)
    result = peak_breakdown(ranges.read_text(), hlo.read_text(),
                            weight_elements=weight_elements, vocab=vocab)
    report = ranges.with_name(ranges.name.replace("-live-range.txt",
                                                  "-memory-usage-report.txt"))
    if report.exists():
        result = dataclasses.replace(result, allocated_bytes=allocated_bytes(report.read_text()))
    return result


def model_shapes(cfg: Any) -> tuple[frozenset[int], frozenset[int]]:
    """(element counts of the full per-layer weights, vocabulary sizes) of a
    `gtp_jax.models.TransformerConfig`, for `classify`."""
    d, ff, hd = cfg.d_model, cfg.d_ff, cfg.head_size
    weights = {d * cfg.n_heads * hd, d * cfg.kv_heads * hd, d * 2 * ff, d * ff,
               cfg.vocab_size * d, 2 * d * cfg.kv_heads * hd}
    vocab = {cfg.vocab_size}
    return frozenset(weights), frozenset(vocab)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gtp_jax.bench memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--preset", default="1b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=None,
                   help="global batch (sequences); default: one per data-parallel device")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--gtp", type=int, default=None, help="default: the devices over --dp")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--remat", default="auto", choices=("auto", "none", "dots", "full"))
    p.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--vocab", type=int, default=None,
                   help="with --dump: the vocabulary size, if not the preset's (to find logits)")
    p.add_argument("--dump", default=None,
                   help="read this --xla_dump_to folder instead of compiling")
    p.add_argument("--keep-dump", default=None, help="compile into this folder and keep it")
    p.add_argument("--json", default=None, help="also write the breakdown here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.dump:
        from gtp_jax.models import preset

        weights, vocab = model_shapes(preset(args.preset))
        if args.vocab:
            vocab = frozenset({args.vocab})
        result = breakdown_of_dump(args.dump, weight_elements=weights, vocab=vocab)
    else:
        folder = args.keep_dump or tempfile.mkdtemp(prefix="gtp_jax_memory_")
        # XLA reads its flags when its backend starts (the first compile), not at import.
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {dump_flags(folder)}"
        result = _compile_and_read(args, folder)
    print(result.table())
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=1))
    return 0


def _compile_and_read(args: argparse.Namespace, folder: str) -> PeakBreakdown:
    import jax

    from gtp_jax.plan.memory import _lowered_step
    from gtp_jax.train.config import TrainConfig, resolve_auto

    n = jax.device_count()
    gtp = args.gtp or max(1, n // (args.dp * args.tp))
    batch = args.batch or args.dp * gtp
    cfg = resolve_auto(TrainConfig(preset=args.preset, layers=args.layers, seq_len=args.seq,
                                   batch_size=batch, dp=args.dp, gtp=gtp, tp=args.tp,
                                   remat=args.remat, unroll_layers=args.unroll_layers,
                                   steps=10, warmup=1))
    return read_compiled(_lowered_step(cfg).compile(), cfg, folder,
                         f"{jax.devices()[0].device_kind} x{n}")


def read_compiled(compiled: Any, cfg: Any, folder: str | Path, devices: str) -> PeakBreakdown:
    """Prints the compiled step's memory figures (XLA's memory analysis; `devices` names
    what it was compiled for) and returns `breakdown_of_dump` of `folder`, where it was
    dumped (`dump_flags`); `cfg` is the resolved `TrainConfig` it was built from."""
    from gtp_jax.plan.memory import MemoryFigure
    from gtp_jax.train.config import model_config

    figure = MemoryFigure.of(compiled)
    weights, vocab = model_shapes(model_config(cfg))
    result = breakdown_of_dump(folder, weight_elements=weights, vocab=vocab)
    print(f"compiled: argument {figure.argument / 2**30:.2f} GiB, temp "
          f"{figure.temp / 2**30:.2f} GiB, peak {figure.peak / 2**30:.2f} GiB ({devices})")
    return result


if __name__ == "__main__":
    raise SystemExit(main())
