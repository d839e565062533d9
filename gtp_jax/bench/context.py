"""Context-parallelism benchmark: a decoder at long sequence lengths, cp=1 vs cp=N.

For each mesh (``--mesh gtp=8 --mesh cp=8 --mesh gtp=2,cp=4``; default ``gtp=N`` and
``cp=N`` over the N devices) and each sequence length (``--seqs``), a subprocess builds the
preset (bf16 compute, fp32 master weights, ``--remat``, ``max_seq_len`` = the sequence),
shards it with `gtp_jax.shard` (GTP over ``gtp``, the sequence over ``cp``: ring attention,
`gtp_jax.parallel.context`) and trains AdamW steps on random tokens. Each ``cp`` group
trains ``--batch`` sequences of the full length; the data axes (dp x gtp) hold different
sequences, so a ``cp=1`` mesh trains one whole sequence per device and ``cp=N`` one
sequence over N devices.

Columns: median step time, tokens/s (all devices), peak device memory, and, with
``--profile-dir``, the fraction of the ring's communication (collective-permute / NCCL
send-recv kernels) that ran while a compute kernel was running on the device
(`gtp_jax.bench.trace`; device 0 over 3 traced steps), next to the same fraction for all
communication. ``--search`` finds the longest trainable sequence per mesh: starting at
``--search-start`` the length doubles, one subprocess per try (one step), until a try fails
(out of memory, or any error: its reason is kept) or ``--search-max`` is reached.

Run with ``python -m gtp_jax.bench.context --help`` (not yet a ``python -m gtp_jax.bench``
subcommand).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

from gtp_jax.bench.overlap import profile_steps

PROFILE_STEPS = 3
#: Kernel / op names of the ring's point-to-point transfers (XLA collective-permute).
RING_PATTERN = re.compile(r"collective-?permute|ppermute|sendrecv|send|recv", re.IGNORECASE)
_OOM = re.compile(r"RESOURCE_EXHAUSTED|out of memory|OOM", re.IGNORECASE)


def parse_mesh(text: str) -> dict[str, int]:
    """``"gtp=2,cp=4"`` -> ``{"gtp": 2, "cp": 4}`` (axes of `gtp_jax.make_mesh`)."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in ("dp", "gtp", "tp", "ep", "cp") or not value.isdigit():
            raise argparse.ArgumentTypeError(
                f"--mesh {text!r}: expected comma-separated axis=size with axes dp, gtp, cp, "
                "tp, ep (e.g. gtp=2,cp=4)")
        sizes[name] = int(value)
    return sizes


def mesh_label(sizes: dict[str, int]) -> str:
    return "x".join(f"{k}{v}" for k, v in sizes.items() if v > 1) or "1"


def ring_overlap(directory: Path, steps: int) -> dict | None:
    """Ring communication of device 0 in the trace under `directory`: ms per step and the
    fraction hidden under compute kernels (None without device kernels, e.g. on CPU)."""
    from gtp_jax.bench.trace import (
        COMM_PATTERN,
        device_kernels,
        find_trace,
        intersect,
        length,
        load_events,
        union,
    )

    kernels = device_kernels(load_events(find_trace(directory)))
    if not kernels:
        return None
    _, events = sorted(kernels.items())[0]
    ring, compute = [], []
    for e in events:
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        name = e.get("name", "")
        if RING_PATTERN.search(name):
            ring.append(span)
        elif not COMM_PATTERN.search(name):
            compute.append(span)
    ring_u = union(ring)
    ring_ms = length(ring_u) / 1e3
    hidden = length(intersect(ring_u, union(compute))) / 1e3
    return {"ring_ms": ring_ms / steps, "ring_hidden_ms": hidden / steps,
            "ring_hidden_fraction": hidden / ring_ms if ring_ms else None}


def run_worker(args: argparse.Namespace) -> dict:
    """Builds and runs one (mesh, sequence) configuration in this process."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import gtp_jax
    from gtp_jax.base.compile_watch import measure_compile
    from gtp_jax.base.mesh import cp_size, data_size
    from gtp_jax.models import Transformer, lm_loss, preset
    from gtp_jax.train import TrainStep
    from gtp_jax.train.outputs.observe import memory_per_device, peak_flops

    sizes = parse_mesh(args.worker_mesh)
    n = math.prod(sizes.values())
    devices = jax.devices()[:n]
    if len(devices) < n:
        raise SystemExit(f"mesh {sizes} needs {n} devices, have {len(jax.devices())}")
    mesh = gtp_jax.make_mesh(**sizes, devices=devices)
    on_gpu = jax.default_backend() == "gpu"
    overrides = {"n_layers": args.layers} if args.layers else {}
    seq = args.worker_seq
    cfg = preset(args.preset, dtype=jnp.bfloat16 if on_gpu else jnp.float32, remat=args.remat,
                 max_seq_len=seq, attention_impl=args.attention if on_gpu else None,
                 cp_attention=args.cp_attention,
                 cp_attention_backend=None if args.cp_backend == "auto" else args.cp_backend,
                 **overrides)
    model = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)), mesh, gtp_jax.GTPConfig(
        gather_dtype=jnp.bfloat16 if on_gpu else None, prefetch=args.prefetch,
        min_elements=0 if not on_gpu else 2**16))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    # The training step of `gtp_jax.train` (jax.jit over the split state, donated).
    step = TrainStep(model, optimizer, lm_loss, grad_norm=False)
    batch = args.batch * data_size(mesh)
    data = jax.random.randint(jax.random.key(1), (2, batch, seq + 1), 0, cfg.vocab_size)
    batches = [jax.device_put(data[i], gtp_jax.data_sharding(mesh)) for i in range(2)]

    def run_step(i: int) -> jax.Array:
        return step(batches[i % 2])["loss"]

    # The time to the first step: the compile (or the persistent cache's read), its run.
    start = time.perf_counter()
    _, compiled = measure_compile(lambda: step.compile(batches[0]))
    loss = jax.block_until_ready(run_step(0))
    first_s = time.perf_counter() - start
    for i in range(1, args.warmup):
        jax.block_until_ready(run_step(i))
    times = []
    for i in range(args.steps):
        start = time.perf_counter()
        loss = jax.block_until_ready(run_step(i))
        times.append(time.perf_counter() - start)
    trace = ring = None
    if args.profile_dir and args.steps:
        directory = Path(args.profile_dir) / f"{mesh_label(sizes)}_s{seq}"
        trace = profile_steps(run_step, directory, PROFILE_STEPS)
        ring = ring_overlap(directory, PROFILE_STEPS)
    memory = memory_per_device(devices)
    med = statistics.median(times) if times else None
    rate = peak_flops(devices[0].device_kind, "bfloat16")
    # model FLOPs of the tokens one device trains (a cp group shares its sequences)
    flops = cfg.train_flops_per_token(seq) * batch * seq / n
    return {
        "mesh": sizes, "label": mesh_label(sizes), "cp": cp_size(mesh), "devices": n,
        "device_kind": devices[0].device_kind, "preset": args.preset, "layers": cfg.n_layers,
        "seq": seq, "batch": batch, "remat": args.remat, "cp_attention": args.cp_attention,
        "cp_backend": args.cp_backend,
        "loss": float(loss), "first_step_s": first_s, **compiled.to_json(),
        "step_ms": med * 1e3 if med else None,
        "tokens_per_s": batch * seq / med if med else None,
        "peak_mem_gib": (memory["peak_bytes_in_use"] if memory else 0) / 2**30,
        "mfu": flops / med / rate if med and rate else None,
        "trace": trace, "ring": ring, "jax": jax.__version__,
    }


def _spawn(args: argparse.Namespace, sizes: dict[str, int], seq: int, steps: int,
           warmup: int) -> tuple[dict | None, str]:
    """Runs one configuration in a subprocess: (result or None, failure reason)."""
    import subprocess

    cmd = [sys.executable, "-X", "faulthandler", "-m", "gtp_jax.bench.context",
           "--worker-mesh", ",".join(f"{k}={v}" for k, v in sizes.items()),
           "--worker-seq", str(seq), "--preset", args.preset, "--layers", str(args.layers),
           "--batch", str(args.batch), "--steps", str(steps), "--warmup", str(warmup),
           "--remat", args.remat, "--attention", args.attention,
           "--cp-attention", args.cp_attention, "--cp-backend", args.cp_backend]
    if not args.prefetch:
        cmd.append("--no-prefetch")
    if args.profile_dir and steps:
        cmd += ["--profile-dir", args.profile_dir]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None, f"timeout after {args.timeout:.0f} s"
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), ""
    tail = proc.stderr[-2000:]
    reason = "oom" if _OOM.search(proc.stderr) else f"error (rc {proc.returncode})"
    return None, f"{reason}: {tail.strip().splitlines()[-1] if tail.strip() else ''}"


def longest_sequence(args: argparse.Namespace, sizes: dict[str, int], start: int) -> dict:
    """Doubles the sequence from `start` until one training step fails."""
    best, seq, tries = None, start, []
    while seq <= args.search_max:
        result, why = _spawn(args, sizes, seq, steps=0, warmup=1)
        tries.append({"seq": seq, "ok": result is not None, "why": why,
                      "peak_mem_gib": result and result["peak_mem_gib"]})
        print(f"[search {mesh_label(sizes)}] seq {seq}: "
              f"{'ok' if result else 'failed: ' + why}", flush=True)
        if result is None:
            break
        best = seq
        seq *= 2
    return {"mesh": sizes, "label": mesh_label(sizes), "longest_seq": best, "tries": tries}


def format_table(rows: list[dict]) -> str:
    lines = ["| mesh | seq | batch | step ms | tokens/s | peak GiB | ring ms / hidden | "
             "all comm ms / hidden |", "|" + "---|" * 8]
    for r in rows:
        ring, tr = r.get("ring"), r.get("trace")
        ring_s = (f"{ring['ring_ms']:.1f} / {ring['ring_hidden_fraction'] * 100:.0f}%"
                  if ring and ring.get("ring_hidden_fraction") is not None else "-")
        tr_s = f"{tr['comm_ms']:.1f} / {tr['hidden_fraction'] * 100:.0f}%" if tr else "-"
        step = f"{r['step_ms']:.1f}" if r.get("step_ms") else "-"
        tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "-"
        lines.append(f"| {r['label']} | {r['seq']} | {r['batch']} | {step} | {tps} | "
                     f"{r['peak_mem_gib']:.2f} | {ring_s} | {tr_s} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gtp_jax.bench.context", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    parser.add_argument("--mesh", action="append", type=parse_mesh, default=None,
                        help="a mesh as axis=size,... (repeatable); default gtp=N and cp=N "
                             "over all N devices")
    parser.add_argument("--seqs", default="8192,16384,32768",
                        help="comma-separated sequence lengths to time ('' for none)")
    parser.add_argument("--batch", type=int, default=1,
                        help="sequences per cp group (per data shard)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--remat", default="full", choices=("none", "dots", "full"))
    parser.add_argument("--attention", default="cudnn", choices=("cudnn", "xla"),
                        help="attention implementation on GPU where cp=1")
    parser.add_argument("--cp-attention", default="ring", choices=("ring", "allgather"))
    parser.add_argument("--cp-backend", default="auto", choices=("auto", "pallas", "reference"),
                        help="the ring's block kernels (TransformerConfig.cp_attention_backend; "
                             "auto: the Pallas kernels on GPUs where the blocks tile)")
    parser.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                        help="GTPConfig(prefetch=False)")
    parser.add_argument("--search", action="store_true",
                        help="also find the longest trainable sequence per mesh")
    parser.add_argument("--search-start", type=int, default=8192)
    parser.add_argument("--search-max", type=int, default=1 << 20)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per subprocess")
    parser.add_argument("--profile-dir", default=None,
                        help="trace 3 steps per timed configuration here (after timing)")
    parser.add_argument("--json", default=None, help="write all results to this file")
    parser.add_argument("--worker-mesh", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-seq", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker_mesh:
        print("RESULT " + json.dumps(run_worker(args)), flush=True)
        return 0
    if args.mesh is None:
        import jax

        n = jax.device_count()
        args.mesh = [{"gtp": n}, {"cp": n}]
    seqs = [int(s) for s in args.seqs.split(",") if s.strip()]
    rows, searches = [], []
    for sizes in args.mesh:
        for seq in seqs:
            result, why = _spawn(args, sizes, seq, args.steps, args.warmup)
            if result is None:
                print(f"[{mesh_label(sizes)} seq {seq}] failed: {why}", flush=True)
                continue
            print(f"[{mesh_label(sizes)} seq {seq}] {result['step_ms']:.1f} ms, "
                  f"{result['tokens_per_s']:.0f} tokens/s, peak "
                  f"{result['peak_mem_gib']:.2f} GiB, loss {result['loss']:.3f}", flush=True)
            rows.append(result)
        if args.search:
            found = [s["longest_seq"] for s in searches if s["longest_seq"]]
            searches.append(longest_sequence(args, sizes, max([args.search_start, *found])))
    if rows:
        print(f"device: {rows[-1]['device_kind']}, preset {args.preset}, remat {args.remat}, "
              f"{args.batch} sequence(s) per cp group")
        print(format_table(rows))
    for s in searches:
        print(f"longest trainable sequence, {s['label']}: {s['longest_seq']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "longest": searches}, indent=1))
    return 0 if rows or any(s["longest_seq"] for s in searches) else 1


if __name__ == "__main__":
    sys.exit(main())
