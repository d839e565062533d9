"""``python -m gtp_jax plan``: the ranked layout table; and the layout choice behind
``python -m gtp_jax train --plan auto`` (`auto_layout`).

On a machine without accelerators the planner plans for ``--gpus`` simulated CPU devices
(``--xla_force_host_platform_device_count``, set before JAX starts a backend), with the CPU
compiler's memory figures; on a GPU host it compiles for the GPUs present.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from typing import Any

from gtp_jax.base.compile_cache import HELP as COMPILE_CACHE_HELP
from gtp_jax.base.compile_cache import OFF as COMPILE_CACHE_OFF
from gtp_jax.base.compile_cache import compile_cache_dir, use_compile_cache
from gtp_jax.base.errors import UsageError
from gtp_jax.base.xla_flags import MAX_SIMULATED_DEVICES, simulate_cpu_devices

#: How `gtp_jax.plan.plan` words a layout rejected for the host's memory.
HOST_REJECTION = "host:"
#: Flags of ``python -m gtp_jax train`` that fix a layout choice under ``--plan auto``.
LAYOUT_FLAGS = {"dp": "--dp", "gtp": "--gtp", "tp": "--tp", "cp": "--cp", "ep": "--ep",
                "remat": "--remat", "unroll_layers": "--[no-]unroll-layers",
                "prefetch": "--prefetch", "gather_format": "--gather-format",
                "offload_optimizer": "--[no-]offload-optimizer"}


def _parser() -> argparse.ArgumentParser:
    from gtp_jax.train.cli.command import OneLineParser, PathArg  # noqa: PLC0415

    parser = OneLineParser(
        prog="python -m gtp_jax plan",
        description="Rank the layouts of a training run (mesh sizes, remat, layer loop, "
        "gather format, optimizer offload): exact peak memory per device from the compiled "
        "training step, step time predicted from measured rates. Without GPUs it plans for "
        "--gpus simulated CPU devices (CPU compiler memory; docs/planning.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="model preset (gtp_jax.models)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="devices to plan for; default: the GPUs present, or 8 simulated "
                        "CPU devices (on a GPU host it must equal the GPU count)")
    parser.add_argument("--layers", type=int, default=None,
                        help="replace the preset's number of layers (as train's --layers)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=16, help="global batch in sequences")
    parser.add_argument("--steps", type=int, default=100,
                        help="optimizer steps of the run (as train's --steps: the LR schedule "
                             "is part of the compiled step, so with JAX's persistent "
                             "compilation cache on, the run reuses the plan's compile)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up steps of the run (as train's --warmup; default: a tenth "
                        "of --steps, at most the preset's maximum)")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="budget per device in GiB; default: the device's memory "
                        "(none on CPU)")
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        type=PathArg(*COMPILE_CACHE_OFF),
                        help=COMPILE_CACHE_HELP)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="compute dtype (auto: bfloat16 on GPUs, float32 on CPUs)")
    parser.add_argument("--gather-formats", default="",
                        help="also try these low-precision gather formats (comma-separated "
                        "fp8,mxfp8,nvfp4; they change the numerics)")
    parser.add_argument("--offload", choices=("auto", "both", "on", "off"), default="auto",
                        help="optimizer offload choices to try (auto: only when no layout "
                        "fits with the state on the device, since it costs step time in host "
                        "transfers; docs/planning.md)")
    parser.add_argument("--top", type=int, default=5,
                        help="compile until this many layouts fit (the rest stay uncompiled)")
    parser.add_argument("--limit", type=int, default=20, help="rows to print (0: all)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the rates again (GEMM, attention, collectives, host "
                        "copies) instead of using the cached ones")
    parser.add_argument("--json", default=None, metavar="PATH", type=PathArg(),
                        help="also write the ranked candidates as JSON")
    paper = parser.add_argument_group(
        "on paper", "plan for GPUs that are not here, compiling nothing: memory in closed "
        "form, step time from a calibration file (gtp_jax.plan.paper; docs/planning.md)")
    paper.add_argument("--on-paper", action="store_true",
                       help="rank the layouts on paper for --gpus GPUs of --memory-gib each, "
                       "the preset with its own vocabulary; needs --calibration")
    # Unset, they are absent from the namespace (no "default: None" in --help).
    paper.add_argument("--calibration", default=argparse.SUPPRESS, metavar="FILE",
                       help="the rates to predict with: a JSON file of "
                       "gtp_jax.plan.Calibration fields (and an optional \"origin\"), or a "
                       "plan --json file")
    paper.add_argument("--gpus-per-node", type=int, default=argparse.SUPPRESS, metavar="N",
                       help="GPUs per node (default 8); collectives over a mesh axis whose "
                       "groups span nodes move at --inter-node-gbps")
    paper.add_argument("--inter-node-gbps", type=float, default=argparse.SUPPRESS,
                       metavar="GBPS",
                       help="bus bandwidth per GPU between nodes, GB/s (default 50: one 400 "
                       "Gb/s InfiniBand link per GPU, an assumption)")
    paper.add_argument("--intra-node-gbps", type=float, default=argparse.SUPPRESS,
                       metavar="GBPS",
                       help="bus bandwidth per GPU within a node, GB/s (default: the "
                       "calibration's all-gather and reduce-scatter rates)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m gtp_jax plan [options]`` (`argv` without the ``plan`` word)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("gtp_jax plan: interrupted (Ctrl-C); nothing was written.", file=sys.stderr,
              flush=True)
        return 128 + 2  # SIGINT, as a shell reports a process it interrupted


def _main(argv: list[str] | None) -> int:
    from gtp_jax.train.cli.command import cli_message  # noqa: PLC0415
    from gtp_jax.train.outputs.observe import check_writable_file  # noqa: PLC0415

    args = _parser().parse_args(argv)
    for name in ("gpus", "seq", "batch", "top", "steps", "layers", "warmup"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            print(f"error: --{name} {value} must be >= {0 if name == 'warmup' else 1}.",
                  file=sys.stderr)
            return 2
    if args.on_paper:  # no devices, no compiles: gtp_jax.plan.paper
        from gtp_jax.plan.paper import main_on_paper  # noqa: PLC0415

        return main_on_paper(args)
    given = [f"--{name.replace('_', '-')}" for name in ("calibration", "gpus_per_node",
             "inter_node_gbps", "intra_node_gbps") if name in vars(args)]
    if given:
        print(f"error: {', '.join(given)} apply with --on-paper only: add --on-paper to plan "
              "on paper, or drop them to plan on this machine's devices.", file=sys.stderr)
        return 2
    if args.gpus is not None and args.gpus > MAX_SIMULATED_DEVICES:
        print(f"error: --gpus {args.gpus}: plan for at most {MAX_SIMULATED_DEVICES} devices "
              "(on a CPU host each is simulated in this process; on a GPU host --gpus must "
              "equal the GPUs present).", file=sys.stderr)
        return 2
    try:
        if args.json is not None:  # before minutes of planning, not after
            check_writable_file(args.json, "--json")
        cache = compile_cache_dir(args.compile_cache)
    except UsageError as err:
        print(f"error: {cli_message(err)}", file=sys.stderr)
        return 2
    simulate_cpu_devices(args.gpus or 8)
    use_compile_cache(cache)
    # XLA_FLAGS are set: JAX may start a backend from here on.
    try:
        return _plan(args)
    except UsageError as err:  # other exceptions are bugs: they keep their traceback
        print(f"error: {cli_message(err)}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    import jax  # noqa: PLC0415

    from gtp_jax.plan import (  # noqa: PLC0415
        PlanSpace,
        calibration,
        format_table,
        keep_what_fits,
        plan,
        plan_fitting,
    )
    from gtp_jax.train import TrainConfig  # noqa: PLC0415
    from gtp_jax.train.config import resolve_auto  # noqa: PLC0415

    if args.gpus is not None and args.gpus != jax.device_count():
        raise UsageError(
            f"--gpus {args.gpus}: this host has {jax.device_count()} "
            f"{jax.default_backend()} devices; plan on a host with {args.gpus} GPUs (the "
            f"memory figures come from compiling for them) or pass --gpus "
            f"{jax.device_count()}.")
    formats = tuple(f for f in args.gather_formats.split(",") if f)
    space = PlanSpace(gather_formats=(None, *formats),
                      offload={"both": (False, True), "on": (True,), "off": (False,),
                               "auto": (False,)}[args.offload])
    base = TrainConfig(preset=args.preset, layers=args.layers, batch_size=args.batch,
                       seq_len=args.seq, steps=args.steps, warmup=args.warmup,
                       dtype=args.dtype, dp=1, gtp=1)
    base.with_schedule()  # a warm-up the run would refuse, refused before planning
    t0 = time.perf_counter()
    parts: dict[str, float] = {}
    cal = calibration(resolve_auto(base).dtype, refresh=args.calibrate, timings=parts)
    t1 = time.perf_counter()
    if args.offload == "auto":
        result = plan_fitting(base, memory_gib=args.memory_gib, space=space, top=args.top,
                              cal=cal)
    else:  # offloaded layouts also keep what fits of their state on the device
        result = keep_what_fits(plan(base, memory_gib=args.memory_gib, space=space,
                                     top=args.top, cal=cal), args.top)
    t2 = time.perf_counter()
    if (result.best is None and result.candidates and jax.default_backend() == "cpu"
            and all((c.rejected or "").startswith(HOST_REJECTION) for c in result.candidates)):
        # Nothing was compiled: one line instead of a table of the same refusal.
        smallest = min(result.candidates, key=lambda c: c.bound_bytes)
        raise UsageError(
            f"no layout of --batch {args.batch} --seq {args.seq} fits in this host's memory "
            f"(the smallest, {smallest.layout.describe()}, needs "
            f"{smallest.rejected[len(HOST_REJECTION):].strip()}); lower --batch or --seq.")
    print(format_table(result, limit=args.limit or None), flush=True)
    compiled = sum(c.peak_bytes is not None for c in result.candidates)
    rates = (" (measured: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()) + ")"
             if parts else " (cached)")
    print(f"planned in {t2 - t0:.1f} s: rates {t1 - t0:.1f} s{rates}, {compiled} layouts "
          f"compiled in {t2 - t1:.1f} s")
    if result.best is not None:
        schedule = ("" if args.steps == 100 else f"--steps {args.steps} ") + (
            "" if args.warmup is None else f"--warmup {args.warmup} ")
        layers = "" if args.layers is None else f"--layers {args.layers} "
        # Every plan flag that changes the compiled step (or where it is cached) goes on.
        dtype = "" if args.dtype == "auto" else f"--dtype {args.dtype} "
        cache = ("" if args.compile_cache is None
                 else f"--compile-cache {shlex.quote(args.compile_cache)} ")
        print(f"best: python -m gtp_jax train --preset {args.preset} {layers}--batch "
              f"{args.batch} --seq {args.seq} {schedule}{dtype}{cache}"
              f"{result.best.layout.flags()}")
    else:
        tried = " (with or without optimizer offload)" if args.offload == "auto" else ""
        print(f"no layout fits{tried}: lower --batch or --seq, or raise --memory-gib")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan_json(result), f, indent=1)
    return 0 if result.best is not None else 1


def plan_json(result: Any) -> dict[str, Any]:
    """A `gtp_jax.plan.Plan` as JSON values."""
    return {
        "preset": result.base.preset, "layers": result.base.layers,
        "batch": result.base.batch_size, "seq": result.base.seq_len,
        "dtype": result.base.dtype, "devices": result.devices,
        "budget_bytes": result.budget_bytes, "calibration": result.calibration.to_json(),
        "offload_fallback": result.offload_fallback,
        "candidates": [{"layout": dataclasses.asdict(c.layout), "flags": c.layout.flags(),
                        "bound_bytes": c.bound_bytes, "peak_bytes": c.peak_bytes,
                        "step_seconds": c.step_seconds, "status": c.status}
                       for c in result.candidates],
    }


def auto_layout(base: Any, fixed: dict[str, Any], memory_gib: float | None) -> Any:
    """The `TrainConfig` `base` laid out as the top-ranked layout (``--plan auto``).

    Args:
      base: the run (its mesh sizes and layout fields are replaced).
      fixed: the layout fields the user set (`LAYOUT_FLAGS` keys -> values): only layouts
        with these values are considered. Without ``offload_optimizer``, offloaded layouts
        are planned only when none fits with the optimizer state on the device, and
        master-weight offload only when none fits offloaded either (`plan_fitting`).
      memory_gib: budget per device (None: the device's memory).

    Raises:
      UsageError: no layout fits (naming the flags to change), before anything is built.
    """
    from gtp_jax.plan import PlanSpace, keep_what_fits, plan, plan_fitting  # noqa: PLC0415
    from gtp_jax.plan.layout import LOOPS, REMATS  # noqa: PLC0415

    loops: tuple[str, ...] = LOOPS
    if fixed.get("unroll_layers") is True:
        loops = ("unrolled",)
    elif fixed.get("unroll_layers") is False or fixed.get("prefetch"):
        loops = ("prefetch",) if fixed.get("prefetch") else ("scanned", "prefetch")
    space = PlanSpace(
        mesh={a: fixed[a] for a in ("dp", "gtp", "tp", "cp", "ep") if a in fixed},
        remat=(fixed["remat"],) if "remat" in fixed else REMATS, loops=loops,
        gather_formats=(fixed.get("gather_format"),),
        offload=(fixed["offload_optimizer"],) if "offload_optimizer" in fixed else (False,))
    # Offload costs host transfers every step (docs/offload.md): unless the user chose,
    # it is planned only when nothing fits with the optimizer state on the device.
    if "offload_optimizer" in fixed:
        result = keep_what_fits(plan(base, memory_gib=memory_gib, space=space, top=1), 1)
    else:
        result = plan_fitting(base, memory_gib=memory_gib, space=space, top=1)
    best = result.best
    if best is None:
        smallest = min(result.candidates, key=lambda c: c.peak_bytes or c.bound_bytes,
                       default=None)
        given = " ".join(sorted(LAYOUT_FLAGS[k] for k in fixed))
        need = (f"; the smallest layout ({smallest.layout.describe()}) needs "
                f"{(smallest.peak_bytes or smallest.bound_bytes) / 2**30:.2f} GiB"
                if smallest is not None else "")
        budget = (f"{result.budget_bytes / 2**30:.2f} GiB per device"
                  if result.budget_bytes else "the devices")
        tried = ("" if "offload_optimizer" in fixed
                 else ", with or without optimizer (and master-weight) offload")
        raise UsageError(
            f"--plan auto: no layout fits in {budget}{tried}{need}; lower --batch or --seq, "
            "raise --memory-gib" + (f", or fix fewer of {given}" if given else "") + ".")
    why = ("; nothing fits with the optimizer state on the device"
           if result.offload_fallback else "")
    if result.offload_fallback and best.layout.master:
        why += ", nor with it offloaded alone"
    print(f"gtp_jax train: --plan auto chose {best.layout.describe()} (predicted "
          f"{best.peak_bytes / 2**30:.3f} GiB per device, {best.step_seconds * 1e3:.1f} ms per "
          f"step{why}; {best.layout.flags()})", flush=True)
    return best.layout.apply(base)
