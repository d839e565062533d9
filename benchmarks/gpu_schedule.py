"""XLA's GPU schedule of the training step for N GPUs, compiled on a host with fewer.

JAX can compile for GPUs it does not have: ``jax.experimental.topologies`` describes N
compile-only H200s of the local GPU's kind (``topology="1x1xN"``), and a program lowered on
a mesh of them compiles (nothing runs). This builds the trainer's step for such a mesh
(abstract state: nothing is allocated), compiles it with gtp_jax's XLA flags, and reads
the schedule back (`gtp_jax.bench.schedule.collective_windows`): for each all-gather,
reduce-scatter and collective-permute (a ring's hop: ring attention with ``--cp``, tp's
ring matmuls with ``--tp --overlap``), whether XLA made it asynchronous and how many GEMMs
(or attention kernels) run between its start and its done. A collective with none is
exposed unless other work hides it (a fusion); this is the schedule's view, not a timing:
a run on N GPUs says what the overlap is worth.

Usage (on a host with at least one GPU):
  python benchmarks/gpu_schedule.py --gpus 2 --preset llama3-8b --layers 4 --seq 2048 \
      --batch 2 [--no-coalesce] [--no-unroll --prefetch] [--json out.json] [--memory] \
      [--fp8-compute delayed --gather-format fp8 [--unroll]]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

import jax
from jax.experimental import topologies

# Importing gtp_jax sets its XLA flags, before anything below starts the GPU backend.
from gtp_jax.bench.compile_events import traced_compile
from gtp_jax.bench.memory import dump_flags, read_compiled
from gtp_jax.bench.schedule import collective_windows
from gtp_jax.plan.memory import _lowered_step
from gtp_jax.train.config import TrainConfig, layer_loop_unrolled, resolve_auto


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=2,
                   help="GPUs to compile for (gtp = gpus / (tp * cp))")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1, help="context parallel: ring attention")
    p.add_argument("--overlap", action="store_true",
                   help="tp's ring collective matmuls (TrainConfig.overlap)")
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--layers", type=int, default=4, help="the preset's depth, smaller")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=None, help="global; default one per GPU")
    p.add_argument("--no-unroll", action="store_true", help="the scanned layer loop")
    p.add_argument("--prefetch", action="store_true")
    p.add_argument("--coalesce", action=argparse.BooleanOptionalAction, default=True,
                   help="GTPConfig.coalesce_layer_collectives (default on; --no-coalesce: "
                   "one collective per weight)")
    p.add_argument("--fp8-compute", default=None, choices=("tensorwise", "delayed"),
                   help="TrainConfig.fp8_compute (its layer loop scans unless --unroll)")
    p.add_argument("--gather-format", default=None, choices=("fp8", "mxfp8", "nvfp4"),
                   help="TrainConfig.gather_format")
    p.add_argument("--unroll", action="store_true",
                   help="the unrolled layer loop where the run would scan (FP8 compute)")
    p.add_argument("--json", default=None, help="write every collective's window here")
    p.add_argument("--compile-profile", default=None, metavar="DIR",
                   help="trace the compile into DIR and print where its time goes "
                   "(gtp_jax.bench.compile_events)")
    p.add_argument("--memory", action="store_true",
                   help="also print the compiled step's peak by category "
                   "(gtp_jax.bench.memory, from XLA's buffer assignment)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    dump = None
    if args.memory:  # before the GPU backend starts: XLA reads its flags then
        dump = tempfile.mkdtemp(prefix="gpu_schedule_dump_")
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {dump_flags(dump)}"
    if jax.default_backend() != "gpu":
        print("gpu_schedule: needs a GPU host (its compiler compiles for the topology)",
              file=sys.stderr)
        return 2
    devices = list(topologies.get_topology_desc(
        "gpu_schedule", "cuda", topology=f"1x1x{args.gpus}").devices)
    gtp = args.gpus // (args.tp * args.cp)
    # The trainer builds its mesh from jax.devices(): the compile-only devices stand in for
    # them while the step is built, lowered and compiled.
    jax.devices = lambda *a, **k: devices
    jax.device_count = lambda *a, **k: len(devices)
    cfg = resolve_auto(TrainConfig(
        preset=args.preset, layers=args.layers, seq_len=args.seq,
        batch_size=args.batch or gtp, dp=1, gtp=gtp, tp=args.tp, cp=args.cp,
        overlap=args.overlap,
        unroll_layers=(False if args.no_unroll else True if args.unroll
                       else None if args.fp8_compute else True),
        prefetch=args.prefetch, fp8_compute=args.fp8_compute,
        gather_format=args.gather_format,
        coalesce_layer_collectives=args.coalesce, steps=10, warmup=1))
    start = time.perf_counter()
    events = None
    if args.compile_profile:
        compiled, events = traced_compile(lambda: _lowered_step(cfg).compile(),
                                          args.compile_profile)
    else:
        compiled = _lowered_step(cfg).compile()
    text = compiled.as_text()
    scanned = layer_loop_unrolled(cfg.unroll_layers, cfg.fp8_compute) is False
    seconds = time.perf_counter() - start
    windows = collective_windows(text)
    rows: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for w in windows:
        state = "sync" if w.between is None else ("no GEMM" if w.between == 0 else "GEMMs")
        rows[(w.kind, state)][0] += 1
        rows[(w.kind, state)][1] += w.elements
    total = sum(w.elements for w in windows) or 1
    print(f"{args.preset}, {args.layers} layers, {args.seq} tokens x {cfg.batch_size} "
          f"(gtp {gtp}, tp {args.tp}, cp {args.cp}{', ring matmuls' if args.overlap else ''}),"
          f" {args.gpus}x {devices[0].device_kind}, "
          f"{'' if args.fp8_compute is None else f'FP8 {args.fp8_compute}, '}"
          f"{'' if args.gather_format is None else f'{args.gather_format} gathers, '}"
          f"{'scanned' if scanned else 'unrolled'}"
          f"{', prefetch' if args.prefetch else ''}"
          f"{'' if args.coalesce else ', one collective per weight'}"
          f" (compiled in {seconds:.1f} s)")
    print("| collective | between start and done | count | elements | share of elements |")
    print("|---|---|---|---|---|")
    for (kind, state), (count, elements) in sorted(rows.items()):
        print(f"| {kind} | {state} | {count} | {elements / 1e6:.0f}M | "
              f"{elements / total:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(w) for w in windows], f, indent=1)
    if events:
        print("\n| compile event | seconds | count |\n|---|---|---|")
        for e in events[:25]:
            print(f"| `{e['name']}` | {e['seconds']:.2f} | {e['count']} |")
    if dump:
        print()
        print(read_compiled(compiled, cfg, dump,
                            f"{args.gpus}x {devices[0].device_kind}").table())
        shutil.rmtree(dump, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
