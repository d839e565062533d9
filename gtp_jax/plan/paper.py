"""Planning on paper: the layouts of a run on GPUs that are not here, ranked without
compiling (``python -m gtp_jax plan --on-paper``).

The planner proper compiles each layout's training step for its exact peak memory, which
needs the devices (or as many simulated CPU devices, too slow for a 70B model on a small
host). On paper, nothing is built or compiled:

- memory per GPU is closed-form: the trainer's own lower bound (`memory_bound`, what its
  refusal checks) rejects a layout that cannot fit; `memory_estimate` judges the rest (the
  bound counts only one ``d_model`` vector per token and layer and no second copy of
  anything, so it undershoots a compiled peak by 10-40%);
- step time is `gtp_jax.plan.timing.step_seconds` with a calibration read from a file
  (`load_calibration`: rates measured earlier on the GPU kind, by ``plan`` there) and a
  `Topology` (nodes of GPUs, a slower network between them).

Every figure is a prediction; the table says which calibration it used and where it came
from. Optimizer offload is planned as `gtp_jax.plan.plan_fitting` plans it (only when no
layout fits with the state on the device; master weights only when none fits offloaded
either); partial offload (`keep_what_fits`) and the pinned host memory check are not (they
need a compiled peak and the host). See docs/planning.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

import numpy as np

from gtp_jax.base.errors import UsageError
from gtp_jax.plan.layout import MESH_AXES, Layout, PlanSpace, enumerate_layouts
from gtp_jax.plan.planner import table_tail
from gtp_jax.plan.timing import (
    Calibration,
    Topology,
    _saved_per_token,
    spans_nodes,
    step_seconds,
)
from gtp_jax.train.config import TrainConfig, model_config, resolve_auto
from gtp_jax.train.outputs.observe import peak_flops
from gtp_jax.train.step.memory import memory_bound, resident_params

GIB = 2**30

#: Defaults of the topology flags: 8 GPUs per node (an HGX / DGX node), and one 400 Gb/s
#: InfiniBand link per GPU, 50 GB/s of bus bandwidth at best (an assumption, not measured).
GPUS_PER_NODE = 8
INTER_NODE_GBPS = 50.0

#: The largest fraction by which `memory_estimate` fell short of a compiled peak, over the
#: 122 layouts compiled on H100 and H200 GPUs that docs/results holds (1b and llama3-8b;
#: it exceeded others by up to 22%): a layout whose estimate is within it of the budget is
#: marked tight.
ESTIMATE_SHORTFALL = 0.23

#: Units of an offloaded optimizer state the step holds at once while its copies overlap
#: the updates (`gtp_jax.train.step.memory.memory_bound` counts the one it cannot do without).
_UNITS_IN_FLIGHT = 4


@dataclasses.dataclass(frozen=True)
class PaperCandidate:
    """One layout on paper.

    Attributes:
      layout: the `Layout`.
      bound_bytes: the trainer's lower bound of the peak, bytes per GPU (`memory_bound`).
      estimate_bytes: the closed-form estimate of the peak, bytes per GPU
        (`memory_estimate`).
      step_seconds: predicted seconds per step.
      parts: the step's parts in seconds (`step_seconds`' keys).
      across_nodes: the mesh axes whose collectives span nodes (empty on one node).
      rejected: why it does not fit (bound or estimate over the budget); None if it fits.
    """

    layout: Layout
    bound_bytes: int
    estimate_bytes: int
    step_seconds: float
    parts: tuple[tuple[str, float], ...]
    across_nodes: tuple[str, ...]
    rejected: str | None = None

    @property
    def fits(self) -> bool:
        """Within the budget by its estimate (and its bound)."""
        return self.rejected is None

    def tight(self, budget: int) -> bool:
        """Fits, but its estimate is within `ESTIMATE_SHORTFALL` of `budget` bytes: the
        compiled step might not fit."""
        return self.fits and self.estimate_bytes * (1 + ESTIMATE_SHORTFALL) > budget


@dataclasses.dataclass(frozen=True)
class PaperPlan:
    """The candidates on paper: those that fit by predicted step time, then the rejected
    ones by memory. `offload`: "" (the state on the device), "optimizer" or "master" when
    nothing fitted without that much offload (those candidates first)."""

    base: TrainConfig
    gpus: int
    budget_bytes: int
    calibration: Calibration
    origin: str
    topology: Topology
    candidates: tuple[PaperCandidate, ...]
    skipped: int
    offload: str = ""

    @property
    def best(self) -> PaperCandidate | None:
        return self.candidates[0] if self.candidates and self.candidates[0].fits else None

    def tokens_per_gpu(self) -> float:
        """Tokens each GPU's share of a step covers (global batch tokens / GPUs)."""
        return self.base.batch_size * self.base.seq_len / self.gpus

    def mfu(self, seconds: float) -> float | None:
        """Model FLOPs utilization of a step of `seconds` (the CLI's count:
        `TransformerConfig.train_flops_per_token` over the device kind's dense peak), or
        None for a device kind without a known peak."""
        peak = peak_flops(self.calibration.device_kind, self.base.dtype)
        if not peak:
            return None
        flops = model_config(self.base).train_flops_per_token(self.base.seq_len)
        return flops * self.tokens_per_gpu() / seconds / peak


def load_calibration(path: str) -> tuple[Calibration, str]:
    """The `Calibration` in the JSON file `path`, and where it came from.

    The file holds `Calibration`'s fields (``Calibration.to_json``) with an optional
    ``"origin"`` string, or is a ``python -m gtp_jax plan --json`` file (its
    ``"calibration"``). The origin defaults to the device kind and count it was measured on.

    Raises:
      UsageError: the file cannot be read, is not JSON, or lacks or misnames a field.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as err:
        raise UsageError(f"calibration={path!r}: cannot read it ({err.strerror}); pass a "
                         "JSON file of gtp_jax.plan.Calibration fields.") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"calibration={path!r} is not JSON ({err.msg} at line {err.lineno}); "
                         "pass a JSON file of gtp_jax.plan.Calibration fields.") from None
    if isinstance(data, dict) and isinstance(data.get("calibration"), dict):
        data = data["calibration"]  # a plan --json file
    if not isinstance(data, dict):
        raise UsageError(f"calibration={path!r} holds a JSON {type(data).__name__}; pass an "
                         "object of gtp_jax.plan.Calibration fields.")
    fields = {f.name for f in dataclasses.fields(Calibration)}
    required = {f.name for f in dataclasses.fields(Calibration)
                if f.default is dataclasses.MISSING}
    extra = sorted(set(data) - fields - {"origin"})
    missing = sorted(required - set(data))
    if extra or missing:
        what = "; ".join(part for part in (
            f"unknown fields {extra}" if extra else "",
            f"missing fields {missing}" if missing else "") if part)
        raise UsageError(f"calibration={path!r}: {what}; its fields are those of "
                         f"gtp_jax.plan.Calibration: {sorted(fields)} (and 'origin').")
    try:
        cal = Calibration(**{k: v for k, v in data.items() if k in fields})
    except (TypeError, ValueError) as err:
        raise UsageError(f"calibration={path!r}: {' '.join(str(err).split())}") from None
    origin = data.get("origin") or (f"measured on {cal.devices}x {cal.device_kind} "
                                    f"({cal.platform})")
    return cal, str(origin)


def memory_estimate(cfg: TrainConfig) -> dict[str, int]:
    """A closed-form estimate of the training step's peak bytes per device: not a bound (a
    compiled peak may lie on either side of it), the figure the on-paper planner judges fit
    by. Checked against compiled peaks on H100 and H200 (docs/planning.md, "on paper").

    The peak is at the start of the backward pass or in the update:

        backward = grads + saved + logits
        update   = 2 * grads + embedding gradient
        estimate = state + max(backward, update)

    state and grads are `memory_bound`'s (float32 parameters and AdamW's moments, or with
    offload the parameters, the moments kept on the device and those of the units in
    flight, about 4); saved =
    tokens * n_layers * values saved per token and layer by the remat policy (as the time
    model counts them: "full" the layer input and one layer's recompute, "dots" the matmul
    outputs, "none" also the norms and MLP products) in the compute dtype / tp; logits =
    tokens * vocab float32 values / tp; the update holds a second copy of the gradients
    (the layer-stacked gradient buffers beside the reduce-scattered ones) and the
    embedding's gradient whole in the compute dtype. tokens: one microbatch's per device.

    Returns:
      ``{"state", "grads", "saved", "logits", "backward", "update", "total"}`` in bytes.
    """
    cfg = resolve_auto(cfg)
    mc = model_config(cfg)
    bound = memory_bound(cfg)
    a_item = np.dtype(mc.dtype).itemsize
    optimizer = bound["optimizer"]
    if cfg.offload_optimizer:  # the units in flight, not the one the bound counts, beside
        # the moments (and masters) kept on the device
        parts = 3 if cfg.offload_master_weights else 2
        kept = parts * resident_params(cfg) * np.dtype(mc.param_dtype).itemsize // (
            cfg.gtp * cfg.tp * cfg.ep)
        optimizer = kept + _UNITS_IN_FLIGHT * (optimizer - kept)
    state = bound["params"] + optimizer
    grads = bound["grads"]
    tokens = (cfg.batch_size // cfg.grad_accum) * cfg.seq_len // (
        cfg.dp * cfg.ep * cfg.gtp * cfg.cp)
    per_token = mc.n_layers * _saved_per_token(mc)
    if mc.remat == "full":  # one layer recomputed whole during its backward
        per_token += _saved_per_token(dataclasses.replace(mc, remat="none"))
    saved = tokens * per_token * a_item // cfg.tp
    logits = tokens * mc.vocab_size * 4 // cfg.tp
    backward = grads + saved + logits
    update = 2 * grads + mc.vocab_size * mc.d_model * a_item
    return {"state": state, "grads": grads, "saved": saved, "logits": logits,
            "backward": backward, "update": update, "total": state + max(backward, update)}


def plan_on_paper(base: TrainConfig, *, gpus: int, memory_gib: float, cal: Calibration,
                  origin: str = "", topology: Topology | None = None,
                  space: PlanSpace | None = None, fallback: bool = True) -> PaperPlan:
    """Ranks the layouts of `base` on `gpus` GPUs of `memory_gib` each, on paper (see the
    module docstring): no device is used and nothing is compiled.

    Args:
      base: the run (compute dtype "auto" means bfloat16 here, as on a GPU; its vocabulary
        is the model's as given: `TrainConfig.vocab_size`).
      gpus: GPUs to plan for.
      memory_gib: usable memory per GPU, GiB.
      cal: the rates (`load_calibration`).
      origin: where `cal` came from (printed with the table).
      topology: nodes and network; None: ``Topology(GPUS_PER_NODE, INTER_NODE_GBPS GB/s)``.
      space: the layouts to consider (default `PlanSpace()`).
      fallback: with `space`'s ``offload=(False,)`` (and ``master``), plan the same layouts
        with the optimizer state offloaded when none fits without, and then with the master
        weights too, as `gtp_jax.plan.plan_fitting` does.

    Returns:
      A `PaperPlan`, candidates ranked.

    Raises:
      UsageError: `gpus` below 1 or not whole nodes, `memory_gib` not a positive number.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise UsageError(f"gpus={gpus!r} must be an int >= 1.")
    if isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float)) or \
            not math.isfinite(memory_gib) or memory_gib <= 0:
        raise UsageError(f"memory_gib={memory_gib!r} must be a positive number of GiB.")
    topology = topology or Topology(GPUS_PER_NODE, INTER_NODE_GBPS * 1e9)
    if gpus > topology.gpus_per_node and gpus % topology.gpus_per_node:
        raise UsageError(f"gpus={gpus} is not a whole number of nodes of "
                         f"gpus_per_node={topology.gpus_per_node}; plan for a multiple of it.")
    base = resolve_auto(base, backend="gpu")
    space = PlanSpace() if space is None else space
    budget = int(memory_gib * GIB)
    tiers = [("", space)]
    if fallback and space.offload == (False,) and space.master == (False,):
        tiers += [("optimizer", dataclasses.replace(space, offload=(True,))),
                  ("master", dataclasses.replace(space, offload=(True,), master=(True,)))]
    ranked: list[tuple[str, list[PaperCandidate], int]] = []
    for name, tier in tiers:
        layouts, skipped = enumerate_layouts(base, gpus, tier)
        cands = [_candidate(layout, base, cal, topology, budget) for layout in layouts]
        ranked.append((name, cands, skipped))
        if any(c.fits for c in cands):
            break
    fitting = [c for _, cands, _ in ranked for c in cands if c.fits]
    fitting.sort(key=lambda c: (c.step_seconds, c.estimate_bytes, c.layout.sort_key))
    rejected = [c for _, cands, _ in ranked for c in cands if not c.fits]
    rejected.sort(key=lambda c: (c.estimate_bytes, c.layout.sort_key))
    offload = ranked[-1][0] if fitting else ""
    return PaperPlan(base=base, gpus=gpus, budget_bytes=budget, calibration=cal,
                     origin=origin, topology=topology, candidates=(*fitting, *rejected),
                     skipped=ranked[0][2], offload=offload)


def _candidate(layout: Layout, base: TrainConfig, cal: Calibration, topology: Topology,
               budget: int) -> PaperCandidate:
    cfg = layout.apply(base)
    bound = memory_bound(cfg)["total"]
    estimate = memory_estimate(cfg)["total"]
    parts = step_seconds(cfg, cal, topology)
    across = tuple(a for a in MESH_AXES
                   if getattr(cfg, a) > 1 and spans_nodes(cfg, (a,), topology.gpus_per_node))
    rejected = None
    if bound > budget:
        rejected = f"bound {bound / GIB:.1f} GiB > {budget / GIB:.1f}"
    elif estimate > budget:
        rejected = f"estimate {estimate / GIB:.1f} GiB > {budget / GIB:.1f}"
    return PaperCandidate(layout=layout, bound_bytes=bound, estimate_bytes=estimate,
                          step_seconds=parts["total"], parts=tuple(parts.items()),
                          across_nodes=across, rejected=rejected)


def format_paper_table(result: PaperPlan, limit: int | None = 20) -> str:
    """The ranked table of a `PaperPlan`, headed by what its figures are."""
    cal, top = result.calibration, result.topology
    mc = model_config(result.base)
    per_node = min(top.gpus_per_node, result.gpus)
    nodes = max(result.gpus // top.gpus_per_node, 1)
    intra = (f"{top.intra_node_bandwidth / 1e9:.3g} GB/s" if top.intra_node_bandwidth else
             f"all-gather {cal.all_gather_bandwidth / 1e9:.3g} GB/s, reduce-scatter "
             f"{cal.reduce_scatter_bandwidth / 1e9:.3g} GB/s (the calibration's)")
    lines = [
        f"plan ON PAPER (nothing compiled; every figure a prediction): preset="
        f"{result.base.preset} ({mc.num_params() / 1e9:.2f}B parameters, vocab "
        f"{mc.vocab_size}) on {result.gpus} GPUs ({nodes} node{'s' * (nodes > 1)} of "
        f"{per_node}), batch={result.base.batch_size} seq={result.base.seq_len} "
        f"({result.tokens_per_gpu():.0f} tokens per GPU) dtype={result.base.dtype}, "
        f"budget {result.budget_bytes / GIB:.2f} GiB per GPU",
        f"calibration: {cal.device_kind}, {result.origin}: GEMM {cal.gemm_flops / 1e12:.3g} "
        f"TFLOP/s, attention {cal.attention_flops(result.base.seq_len) / 1e12:.3g} TFLOP/s "
        f"at seq {result.base.seq_len}, memory {cal.memory_bandwidth / 1e12:.3g} TB/s, "
        f"optimizer {cal.optimizer_rate / 1e9:.3g} G parameters/s, host <-> device "
        f"{cal.host_bandwidth / 1e9:.3g} GB/s, overlapped collectives "
        f"{cal.overlap_exposed:.0%} exposed",
        f"collectives: within a node {intra}; spanning nodes "
        f"{top.inter_node_bandwidth / 1e9:.3g} GB/s per GPU",
        "memory: 'bound' is the trainer's lower bound (a layout over it cannot run), "
        "'estimate' the closed-form estimate a layout must fit (neither compiled)",
    ]
    if result.offload == "optimizer":
        lines.append("no layout fits with the optimizer state on the device: the first "
                     "layouts keep it in host memory (--offload-optimizer)")
    elif result.offload == "master":
        lines.append("no layout fits with the optimizer state on the device, nor offloaded: "
                     "the first layouts keep it and the float32 master weights in host "
                     "memory (--offload-optimizer --offload-master-weights)")
    shown = result.candidates if limit is None else result.candidates[:limit]
    width = max([40, *(len(c.layout.describe()) for c in shown)])
    lines.append(f"{'#':>3}  {'layout':<{width}} {'bound GiB':>9} {'est. GiB':>9} "
                 f"{'step ms':>10} {'tok/s/GPU':>9} {'MFU':>6}  {'across nodes':<12} status")
    for i, c in enumerate(shown, 1):
        mfu = result.mfu(c.step_seconds)
        lines.append(
            f"{i:>3}  {c.layout.describe():<{width}} {c.bound_bytes / GIB:9.1f} "
            f"{c.estimate_bytes / GIB:9.1f} {c.step_seconds * 1e3:10.1f} "
            f"{result.tokens_per_gpu() / c.step_seconds:9.0f} "
            f"{'-' if mfu is None else f'{mfu:.1%}':>6}  {','.join(c.across_nodes) or '-':<12} "
            f"{_status(c, result.budget_bytes)}")
    return "\n".join(lines + table_tail(len(result.candidates) - len(shown), result.skipped))


def _status(c: PaperCandidate, budget: int) -> str:
    if not c.fits:
        return f"over: {c.rejected}"
    return f"tight (est. within {ESTIMATE_SHORTFALL:.0%})" if c.tight(budget) else "fits (est.)"


def paper_json(result: PaperPlan) -> dict[str, Any]:
    """A `PaperPlan` as JSON values (bytes, seconds)."""
    top = result.topology
    return {
        "on_paper": True, "preset": result.base.preset, "layers": result.base.layers,
        "vocab": model_config(result.base).vocab_size, "batch": result.base.batch_size,
        "seq": result.base.seq_len, "dtype": result.base.dtype, "gpus": result.gpus,
        "budget_bytes": result.budget_bytes, "calibration": result.calibration.to_json(),
        "calibration_origin": result.origin,
        "topology": dataclasses.asdict(top), "offload_fallback": result.offload,
        "candidates": [{"layout": dataclasses.asdict(c.layout), "flags": c.layout.flags(),
                        "bound_bytes": c.bound_bytes, "estimate_bytes": c.estimate_bytes,
                        "step_seconds": c.step_seconds, "parts": dict(c.parts),
                        "tokens_per_s_per_gpu": result.tokens_per_gpu() / c.step_seconds,
                        "mfu": result.mfu(c.step_seconds), "across_nodes": c.across_nodes,
                        "status": _status(c, result.budget_bytes)}
                       for c in result.candidates],
    }


def main_on_paper(args: argparse.Namespace) -> int:
    """``python -m gtp_jax plan --on-paper``: `args` are the plan command's (see its
    ``--help``). Prints the table and the best layout's train command; 0 when a layout
    fits, 1 when none does, 2 (one line on stderr) for bad flags."""
    try:
        return _main(args)
    except UsageError as err:
        from gtp_jax.train.cli.command import cli_message  # noqa: PLC0415

        print(f"error: {cli_message(err)}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    for name in ("calibration", "gpus_per_node", "inter_node_gbps", "intra_node_gbps"):
        if not hasattr(args, name):  # the plan command leaves unset ones out
            setattr(args, name, None)
    needs = [flag for flag, value in (("--gpus N", args.gpus), ("--memory-gib GIB",
                                      args.memory_gib), ("--calibration FILE",
                                      args.calibration)) if value is None]
    if needs:
        raise UsageError(f"--on-paper plans for GPUs that are not here: pass {', '.join(needs)} "
                         "(e.g. --gpus 64 --memory-gib 139 --calibration "
                         "docs/results/2026-11-27_2xH200/plan_top5/calibration.json).")
    if args.calibrate:
        raise UsageError("--calibrate measures this machine's rates; on paper the rates come "
                         "from --calibration FILE: drop --calibrate.")
    if args.memory_gib <= 0 or not math.isfinite(args.memory_gib):
        raise UsageError(f"--memory-gib {args.memory_gib} must be a positive number of GiB.")
    per_node = GPUS_PER_NODE if args.gpus_per_node is None else args.gpus_per_node
    if per_node < 1:
        raise UsageError(f"--gpus-per-node {per_node} must be >= 1.")
    if args.gpus > per_node and args.gpus % per_node:
        raise UsageError(f"--gpus {args.gpus} is not a whole number of nodes of "
                         f"--gpus-per-node {per_node}: pass a multiple of it.")
    bandwidths = {}
    for flag, name, value in (("--inter-node-gbps", "inter", args.inter_node_gbps),
                              ("--intra-node-gbps", "intra", args.intra_node_gbps)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"{flag} {value} must be a positive number of GB/s.")
        bandwidths[name] = None if value is None else value * 1e9
    topology = Topology(per_node, bandwidths["inter"] or INTER_NODE_GBPS * 1e9,
                        bandwidths["intra"])
    try:
        cal, origin = load_calibration(args.calibration)
    except UsageError as err:
        raise UsageError(str(err).replace("calibration=", "--calibration ", 1)) from None
    from gtp_jax.models import PRESETS  # noqa: PLC0415

    if args.preset not in PRESETS:
        raise UsageError(f"--preset {args.preset!r}: use one of {sorted(PRESETS)}.")
    formats = tuple(f for f in args.gather_formats.split(",") if f)
    offload = {"both": (False, True), "on": (True,), "off": (False,),
               "auto": (False,)}[args.offload]
    try:
        space = PlanSpace(gather_formats=(None, *formats), offload=offload)
    except UsageError as err:
        raise UsageError(f"--gather-formats {args.gather_formats!r}: use fp8, mxfp8 or "
                         f"nvfp4, comma-separated ({' '.join(str(err).split())})") from None
    base = TrainConfig(preset=args.preset, layers=args.layers, batch_size=args.batch,
                       seq_len=args.seq, steps=args.steps, warmup=args.warmup,
                       dtype="bfloat16" if args.dtype == "auto" else args.dtype, dp=1, gtp=1,
                       vocab_size=PRESETS[args.preset].vocab_size)
    result = plan_on_paper(base, gpus=args.gpus, memory_gib=args.memory_gib, cal=cal,
                           origin=f"{origin}; {args.calibration}", topology=topology,
                           space=space, fallback=args.offload == "auto")
    print(format_paper_table(result, limit=args.limit or None), flush=True)
    if result.best is not None:
        layers = "" if args.layers is None else f"--layers {args.layers} "
        command = (f"python -m gtp_jax train --preset {args.preset} {layers}--batch "
                   f"{args.batch} --seq {args.seq}")
        print(f"best (predicted): {command} {result.best.layout.flags()}")
        if result.best.tight(result.budget_bytes):
            safe = next((c for c in result.candidates
                         if c.fits and not c.tight(result.budget_bytes)), None)
            if safe is not None:
                print(f"best not tight (predicted {safe.step_seconds * 1e3:.1f} ms): {command} "
                      f"{safe.layout.flags()}")
    else:
        print("no layout fits on paper: lower --batch or --seq, raise --memory-gib, or plan "
              "for more --gpus")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(paper_json(result), f, indent=1)
    return 0 if result.best is not None else 1
