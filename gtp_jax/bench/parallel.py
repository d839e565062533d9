"""``python -m gtp_jax.bench parallel``: TP, sequence parallel, ring overlap, GTP, MoE side by side.

Model variants (each in its own subprocess, so peak memory is per variant), on ``n`` devices
with ``--tp T`` and ``--gtp G`` (defaults: ``T = n / 2`` for ``n >= 4`` else ``n``,
``G = n / T``):

  no_tp            data parallel over all n devices (the baseline)
  tp               Megatron TP + sequence parallelism on T devices, dp = n / T
  tp_overlap       the same with ring collective matmuls (``tp_overlap=True``)
  tp_gtp           TP on T devices, weights GTP-sharded over G, dp = n / (T G)
  tp_gtp_overlap   the same with ring collective matmuls
  *_moe            any of the above with a mixture-of-experts FFN in every layer
                   (``--moe-experts``, top-k, capacity); the data-parallel factor left
                   over becomes expert parallelism (``ep``)

Every variant trains the same model from the same initialisation on the same global batch,
so the loss and gradient norm of step 1 must agree across dense variants (to bf16 rounding
in bf16) -- a cheap end-to-end correctness check next to the timing. Columns: step-1 loss
and gradient norm, loss after the timed steps, median step time, ratio to ``no_tp``
(``tp*`` rows) or to ``no_tp_moe`` (MoE rows), peak device memory, and parameter +
optimizer bytes per device.

``--micro`` instead times one collective matmul at the model's sizes on T devices: the
local GEMM alone (no communication: the budget), all-gather + GEMM, the ppermute ring, and
XLA's own windowed-einsum collective matmul (``jit`` with sharded operands and
``--xla_gpu_threshold_for_windowed_einsum_mib=0``), and the same for GEMM + reduce-scatter.
"GEMM / ring" >= 0.9 means the communication is >= 90% hidden.

Works on CPU (simulated devices, ``--preset tiny``) and on GPUs (default ``--preset 100m``,
``--seq 2048``, bf16 compute).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

from gtp_jax.base.xla_flags import simulate_cpu_devices
from gtp_jax.bench.overlap import first_step_text, profile_steps, run_for_result

MODEL_VARIANTS = ("no_tp", "tp", "tp_overlap", "tp_gtp", "tp_gtp_overlap",
                  "no_tp_moe", "tp_overlap_moe", "tp_gtp_overlap_moe")
MICRO_VARIANTS = ("gemm_only", "ag_gemm", "ag_gemm_ring", "ag_gemm_xla",
                  "gemm_rs", "gemm_rs_ring", "gemm_rs_xla")
#: XLA flags that turn on XLA's windowed-einsum collective matmul (present in jaxlib 0.10.x).
XLA_WINDOWED_EINSUM_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0 "
                             "--xla_gpu_multi_streamed_windowed_einsum=true")


def _sizes(args: argparse.Namespace, n: int) -> tuple[int, int]:
    tp = args.tp or (n // 2 if n >= 4 else n)
    gtp = args.gtp or max(1, n // tp)
    if n % tp or n % (tp * gtp):
        raise ValueError(f"--tp {tp} x --gtp {gtp} must divide the {n} devices.")
    return tp, gtp


def mesh_sizes(variant: str, n: int, tp: int, gtp: int) -> dict[str, int]:
    """Mesh of a model variant on n devices (leftover data parallelism is ep for MoE)."""
    base = variant.removesuffix("_moe")
    sizes = {"no_tp": {}, "tp": {"tp": tp}, "tp_overlap": {"tp": tp},
             "tp_gtp": {"tp": tp, "gtp": gtp}, "tp_gtp_overlap": {"tp": tp, "gtp": gtp}}[base]
    rest = n // (sizes.get("tp", 1) * sizes.get("gtp", 1))
    return {**sizes, ("ep" if variant.endswith("_moe") else "dp"): rest}


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def _model_config(args: argparse.Namespace, variant: str):
    import jax.numpy as jnp

    from gtp_jax.models import preset

    on_gpu = _on_gpu()
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[
        args.dtype or ("bfloat16" if on_gpu else "float32")]
    overrides = {"n_layers": args.layers} if args.layers else {}
    if variant.endswith("_moe"):
        overrides.update(moe_experts=args.moe_experts, moe_top_k=args.moe_top_k,
                         moe_capacity_factor=args.moe_capacity or None)
    return preset(args.preset, dtype=dtype, max_seq_len=args.seq, remat=args.remat,
                  attention_impl=args.attention if on_gpu else None,
                  tp_overlap="overlap" in variant, **overrides)


def run_model_variant(args: argparse.Namespace) -> dict:
    """Builds, checks and times one model variant in this process."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import gtp_jax
    from gtp_jax.base.compile_watch import measure_compile
    from gtp_jax.models import Transformer, lm_loss
    from gtp_jax.train import TrainStep
    from gtp_jax.train.outputs.observe import memory_per_device

    variant = args.worker
    devices = jax.devices()
    n = len(devices)
    tp, gtp = _sizes(args, n)
    sizes = mesh_sizes(variant, n, tp, gtp)
    mesh = gtp_jax.make_mesh(**sizes, devices=devices)
    cfg = _model_config(args, variant)
    # Built where it lives (shard_init: the same values as shard(Transformer(...)) bit for
    # bit): a whole model on device 0 first would not fit for 70b-shaped layers, and would
    # count in that device's allocator peak.
    model = gtp_jax.shard_init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh,
                               gtp_jax.GTPConfig(gather_dtype=cfg.dtype, prefetch=args.prefetch))
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
    step = TrainStep(model, optimizer, functools.partial(lm_loss, aux_weight=cfg.moe_aux_weight))

    batch = args.batch or 2 * n
    data = jax.random.randint(jax.random.key(1), (4, batch, args.seq + 1), 0, cfg.vocab_size)
    batches = [jax.device_put(data[i], gtp_jax.data_sharding(mesh)) for i in range(4)]
    # The time to the first step: the compile (or the persistent cache's read), its run.
    start = time.perf_counter()
    _, compiled = measure_compile(lambda: step.compile(batches[0]))
    first = step(batches[0])
    first_loss, first_norm = float(first["loss"]), float(first["grad_norm"])
    first_step_s = time.perf_counter() - start
    for i in range(1, args.warmup):
        jax.block_until_ready(step(batches[i % 4]))
    times, loss = [], None
    for i in range(args.steps):
        start = time.perf_counter()
        loss = step(batches[i % 4])["loss"]
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)
    trace = None
    if args.profile_dir and variant in args.profile_variants.split(","):
        trace = profile_steps(lambda i: step(batches[i % 4])["loss"],
                              Path(args.profile_dir) / variant, 3)
    step.sync()
    memory = memory_per_device(devices)
    peak = memory["peak_bytes_in_use"] if memory else 0
    state = (gtp_jax.bytes_per_device(nnx.state(model, nnx.Param))
             + gtp_jax.bytes_per_device(nnx.state(optimizer, nnx.OptState)))
    return {
        "variant": variant, "mesh": sizes, "devices": n, "device_kind": devices[0].device_kind,
        "preset": args.preset, "layers": cfg.n_layers, "seq": args.seq, "batch": batch,
        "dtype": str(jnp.dtype(cfg.dtype)), "moe_experts": cfg.moe_experts,
        "loss_step1": first_loss, "grad_norm_step1": first_norm, "loss_last": float(loss),
        "step_ms": statistics.median(times) * 1e3, "step_ms_min": min(times) * 1e3,
        "peak_mem_gib": peak / 2**30 if peak else None,
        "param_opt_gib": state / 2**30, "trace": trace,
        "first_step_s": first_step_s, **compiled.to_json(),
        "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def run_micro_variant(args: argparse.Namespace) -> dict:
    """Times one collective-matmul implementation on ``tp`` devices at the model's sizes.

    Forward alone and forward + backward (gradients of ``x`` and ``w`` for a fixed
    cotangent), each a separate ``jit``; with ``--profile-dir`` the forward + backward is
    traced afterwards and its hidden / exposed communication measured.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import gtp_jax
    from gtp_jax.parallel import all_gather_matmul, matmul_reduce_scatter

    variant = args.worker.removeprefix("micro:")
    devices = jax.devices()
    tp, _ = _sizes(args, len(devices))
    devices = devices[:tp]
    mesh = gtp_jax.make_mesh(tp=tp, devices=devices)
    cfg = _model_config(args, "tp")
    dtype = cfg.dtype
    b, s = args.batch or 4, args.seq
    d, f = cfg.d_model, 2 * cfg.d_ff  # the gate_up projection: the largest column GEMM
    key = jax.random.split(jax.random.key(0), 3)
    ag = variant.startswith(("ag", "gemm_only"))
    if ag:  # x [b, s, d] sequence-sharded, w [d, f] column-sharded
        x = jax.random.normal(key[0], (b, s, d), dtype)
        w = jax.random.normal(key[1], (d, f), dtype) * d ** -0.5
        x_spec, w_spec, out_spec = P(None, "tp", None), P(None, "tp"), P(None, None, "tp")
        out_shape = (b, s, f)
    else:  # h [b, s, f] feature-sharded, w [f, d] row-sharded -> out sequence-sharded
        x = jax.random.normal(key[0], (b, s, f), dtype)
        w = jax.random.normal(key[1], (f, d), dtype) * f ** -0.5
        x_spec, w_spec, out_spec = P(None, None, "tp"), P("tp", None), P(None, "tp", None)
        out_shape = (b, s, d)
    shape = f"[{b},{s},{x.shape[-1]}]x{list(w.shape)}"
    if variant == "gemm_only":
        shape = f"[{b},{s},{d}]x[{d}, {f // tp}] per rank"
        # Each rank's local GEMM of the column-parallel layer on the full sequence (the same
        # FLOPs as the row-parallel one), with nothing replicated, so neither direction
        # communicates: a leading rank dim sharded over tp.
        x = jnp.broadcast_to(x, (tp, *x.shape))
        w = w.reshape(d, tp, f // tp).transpose(1, 0, 2)
        x_spec = w_spec = out_spec = P("tp")
        out_shape = (tp, b, s, f // tp)
    ct = jax.random.normal(key[2], out_shape, dtype)

    def body(xl, wl):
        if variant == "gemm_only":
            return jnp.einsum("rbsk,rkn->rbsn", xl, wl)
        if ag:
            return all_gather_matmul(xl, wl, "tp", overlap=variant == "ag_gemm_ring")
        return matmul_reduce_scatter(xl, wl, "tp", overlap=variant == "gemm_rs_ring")

    out_sharding = NamedSharding(mesh, out_spec)
    if variant.endswith("_xla"):  # XLA partitions the einsum itself (windowed einsum flags)
        def forward(a, c):
            return jax.lax.with_sharding_constraint(jnp.einsum("bsk,kn->bsn", a, c),
                                                    out_sharding)
    else:
        forward = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec),
                                out_specs=out_spec, check_vma=False)

    def forward_backward(a, c, t):
        # The output is returned too, so the forward GEMM is not dead code.
        y, vjp = jax.vjp(forward, a, c)
        return y, vjp(t)

    fwd = jax.jit(forward)
    fwd_bwd = jax.jit(forward_backward)
    x = jax.device_put(x, NamedSharding(mesh, x_spec))
    w = jax.device_put(w, NamedSharding(mesh, w_spec))
    ct = jax.device_put(ct, out_sharding)

    def timed(fn, *a) -> float:
        # Calls are dispatched back to back and synchronised once per round, so the host's
        # per-call dispatch latency (comparable to these sub-millisecond kernels) overlaps
        # device work instead of being added to it; the median round is reported.
        for _ in range(args.warmup):
            jax.block_until_ready(fn(*a))
        rounds, per_round = [], 10
        for _ in range(max(args.steps // per_round, 5)):
            start = time.perf_counter()
            for _ in range(per_round):
                out = fn(*a)
            jax.block_until_ready(out)
            rounds.append((time.perf_counter() - start) / per_round)
        return statistics.median(rounds) * 1e3

    ms_fwd = timed(fwd, x, w)
    ms_fwd_bwd = timed(fwd_bwd, x, w, ct)
    trace = None
    if args.profile_dir and variant in args.profile_variants.split(","):
        trace = profile_steps(lambda i: fwd_bwd(x, w, ct)[0], Path(args.profile_dir) / variant, 5)
    return {"variant": variant, "tp": tp, "device_kind": devices[0].device_kind,
            "shape": shape, "dtype": str(dtype),
            "ms": ms_fwd, "ms_fwd_bwd": ms_fwd_bwd, "trace": trace,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _spawn(worker: str, args: argparse.Namespace, env: dict | None = None) -> dict | None:
    cmd = [sys.executable, "-X", "faulthandler", "-m", "gtp_jax.bench", "parallel",
           "--worker", worker, *args.passthrough]
    return run_for_result(worker, cmd, args.timeout, env)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _traced(row: dict) -> str:
    tr = row.get("trace")
    return f"{tr['comm_ms']:.3f} / {tr['hidden_fraction'] * 100:.0f}%" if tr else "-"


def format_model_table(rows: list[dict]) -> str:
    """Markdown table of model variants (ratios against ``no_tp`` / ``no_tp_moe``)."""
    def base(row: dict) -> dict | None:
        name = "no_tp_moe" if row["variant"].endswith("_moe") else "no_tp"
        return next((r for r in rows if r["variant"] == name), None)

    lines = ["| variant | mesh | loss@1 | grad norm@1 | loss@last | step ms | vs no_tp | "
             "peak GiB | param+opt GiB | comm ms / hidden (trace) |", "|" + "---|" * 10]
    for r in rows:
        ref = base(r)
        mesh = " ".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
        ratio = f"{r['step_ms'] / ref['step_ms']:.3f}x" if ref else "-"
        lines.append(
            f"| {r['variant']} | {mesh} | {r['loss_step1']:.5f} | {r['grad_norm_step1']:.5f} | "
            f"{r['loss_last']:.5f} | {r['step_ms']:.1f} | {ratio} | "
            f"{_fmt(r['peak_mem_gib'], '.2f')} | {r['param_opt_gib']:.3f} | {_traced(r)} |")
    return "\n".join(lines)


def format_micro_table(rows: list[dict]) -> str:
    """Markdown table of the collective-matmul timings, with the GEMM budget ratio."""
    gemm = next((r for r in rows if r["variant"] == "gemm_only"), None)
    lines = ["| variant | shape | fwd ms | GEMM / this | fwd+bwd ms | GEMM / this | "
             "comm ms / hidden (trace, fwd+bwd) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        fb = r.get("ms_fwd_bwd")
        ratio = f"{gemm['ms'] / r['ms']:.2f}" if gemm else "-"
        ratio_fb = f"{gemm['ms_fwd_bwd'] / fb:.2f}" if gemm and fb and gemm.get(
            "ms_fwd_bwd") else "-"
        lines.append(f"| {r['variant']} | {r['shape']} | {r['ms']:.3f} | {ratio} | "
                     f"{_fmt(fb, '.3f')} | {ratio_fb} | {_traced(r)} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gtp_jax.bench parallel",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--preset", default=None, help="model preset (GPU: 100m, CPU: tiny)")
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (GPU: 2048)")
    parser.add_argument("--batch", type=int, default=0,
                        help="global batch in sequences (default 2 x devices)")
    parser.add_argument("--tp", type=int, default=0, help="tensor-parallel size (0: auto)")
    parser.add_argument("--gtp", type=int, default=0, help="GTP size of tp_gtp* (0: auto)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="compute dtype (GPU: bfloat16, CPU: float32)")
    parser.add_argument("--remat", default="none", choices=("none", "dots", "full"),
                        help="activation recompute in the layer loop")
    parser.add_argument("--attention", default="cudnn", choices=("cudnn", "xla"),
                        help="attention implementation on GPU")
    parser.add_argument("--prefetch", action="store_true", help="GTPConfig(prefetch=True)")
    parser.add_argument("--moe-experts", type=int, default=8,
                        help="experts of the *_moe variants")
    parser.add_argument("--moe-top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--moe-capacity", type=float, default=1.25,
                        help="capacity factor (0: dropless)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps")
    parser.add_argument("--variants", default=None,
                        help=f"comma list (default: {','.join(MODEL_VARIANTS)}; with --micro: "
                        f"{','.join(MICRO_VARIANTS)})")
    parser.add_argument("--micro", action="store_true",
                        help="time the collective matmuls instead of training steps")
    parser.add_argument("--profile-dir", default=None,
                        help="trace the --profile-variants after timing (jax.profiler) and "
                        "report their hidden / exposed communication")
    parser.add_argument("--profile-variants", default="tp,tp_overlap,ag_gemm,ag_gemm_ring,"
                        "gemm_rs,gemm_rs_ring", help="variants to trace, comma-separated")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per variant")
    parser.add_argument("--json", default=None, help="also write all results to this file")
    parser.add_argument("--cpu-devices", type=int, default=8,
                        help="simulated devices when there is no accelerator")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser


def _worker(args: argparse.Namespace) -> int:
    # Without accelerators the devices are simulated; the flag must precede JAX's start and
    # does nothing on GPUs. Only workers start JAX: a parent holding the GPUs would starve
    # the variants of memory.
    simulate_cpu_devices(args.cpu_devices)
    on_gpu = _on_gpu()
    if args.preset is None:
        args.preset = "100m" if on_gpu else "tiny"
    if args.seq is None:
        args.seq = 2048 if on_gpu else 64
    run = run_micro_variant if args.worker.startswith("micro:") else run_model_variant
    print("RESULT " + json.dumps(run(args)), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.worker:
        return _worker(args)
    # What the workers need to rebuild the same configuration.
    args.passthrough = _strip([a for a in argv if a != "--micro"],
                              ("--variants", "--json", "--timeout"))
    variants = (args.variants.split(",") if args.variants
                else list(MICRO_VARIANTS if args.micro else MODEL_VARIANTS))
    known = MICRO_VARIANTS if args.micro else MODEL_VARIANTS
    unknown = [v for v in variants if v not in known]
    if unknown:
        print(f"unknown variants {unknown}; choose from {known}", file=sys.stderr)
        return 2
    rows = []
    for variant in variants:
        env = None
        if args.micro and variant.endswith("_xla"):
            env = dict(os.environ)
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {XLA_WINDOWED_EINSUM_FLAGS}".strip()
        worker = f"micro:{variant}" if args.micro else variant
        result = _spawn(worker, args, env)
        if result:
            what = f"{result['ms']:.3f} ms" if args.micro else (
                f"{result['step_ms']:.1f} ms, loss@1 {result['loss_step1']:.5f}"
                f"{first_step_text(result)}")
            print(f"[{variant}] {what}", flush=True)
            rows.append(result)
    if rows:
        head = rows[-1]
        what = (f"tp={head['tp']}" if args.micro else
                f"preset {head['preset']}, seq {head['seq']}, batch {head['batch']}, "
                f"{head['dtype']}")
        print(f"device: {head['device_kind']} x{head.get('devices', head.get('tp'))}, {what}")
        print(format_micro_table(rows) if args.micro else format_model_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if len(rows) == len(variants) else 1


def _strip(argv: list[str], options: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in options:
            skip = True
            continue
        if any(a.startswith(o + "=") for o in options):
            continue
        out.append(a)
    return out
