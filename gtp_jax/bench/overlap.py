"""``python -m gtp_jax.bench overlap``: training-step benchmark, side by side in one run.

Variants (each in its own subprocess, so peak memory is per variant):
  compute_only   one device, the per-device batch, no collectives (the compute floor)
  replicated     pure data parallelism: weights replicated, gradients all-reduced by XLA
  xla_fsdp       XLA's automatic FSDP: the same weights annotated P(..., 'gtp') + jit
  gtp            gtp_jax.shard, no prefetch
  gtp_prefetch   gtp_jax.shard with GTPConfig(prefetch=True)
  *_dots         the same variant with remat="dots" (save matmul outputs only)
  torch_fsdp2_*  PyTorch FSDP2 peer (benchmarks/torch_fsdp2.py via torchrun, --torch), blocks
                 torch.compile'd and eager; HSDP (replicas x shards) with --gtp
  user_*         a user's own decoder (gtp_jax.bench.user_model: blocks on gtp_jax.Stack,
                 or --user-loop python: a Python loop of blocks, each under nnx.remat;
                 attention by --attention, remat by --user-remat;
                 --user-d, --user-blocks): user_unwrapped (data parallel, weights
                 replicated), user_gtp (gtp_jax.shard, gtp = all devices), user_gtp_prefetch
                 (with GTPConfig(prefetch=True)), user_xla_fsdp (XLA's automatic FSDP of the
                 same model)

Columns: median step time (>= 20 steps after warm-up), ratio to replicated, exposed
communication (step minus compute_only, over step), peak device memory, parameter + gradient
+ optimizer bytes per device, MFU (matmul FLOPs from `TransformerConfig.train_flops_per_token`
over the device's peak bf16 rate).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: The environment variable through which the parent passes a worker's launch time
#: (``time.time()`` just before it starts the process), for ``launch_to_first_step_s``.
LAUNCH_ENV = "GTP_JAX_BENCH_LAUNCH"
VARIANTS = ("compute_only", "replicated", "xla_fsdp", "gtp", "gtp_prefetch")
USER_VARIANTS = ("user_unwrapped", "user_gtp", "user_gtp_prefetch", "user_xla_fsdp")
PROFILE_STEPS = 3


def run_variant(args: argparse.Namespace) -> dict:
    """Builds and times one variant in this process; returns its metrics."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import gtp_jax
    from gtp_jax.base.compile_watch import measure_compile
    from gtp_jax.models import Transformer, lm_loss, preset
    from gtp_jax.train import TrainStep
    from gtp_jax.train.config import layer_loop_unrolled
    from gtp_jax.train.outputs.observe import memory_per_device, peak_flops

    variant = args.worker
    remat = "dots" if variant.endswith("_dots") else args.remat
    user = variant.startswith("user_")
    # The user model's variants map onto the built-in ones' placements.
    variant_kind = {"user_unwrapped": "replicated", "user_gtp": "gtp",
                    "user_gtp_prefetch": "gtp_prefetch", "user_xla_fsdp": "xla_fsdp"}.get(
        variant, variant.removesuffix("_dots"))
    devices = jax.devices()[:1] if variant_kind == "compute_only" else jax.devices()
    n = len(devices)
    on_gpu = jax.default_backend() == "gpu"
    overrides = {"n_layers": args.layers} if args.layers else {}
    if args.vocab:
        overrides["vocab_size"] = args.vocab
    attention = args.attention if on_gpu else None
    if user:
        from gtp_jax.bench.user_model import UserDecoder, UserDecoderConfig, user_loss
        from gtp_jax.models.attention import resolve_attention_impl

        # The user's blocks call jax.nn.dot_product_attention with the implementation the
        # bundled decoder would run (`attention`): cuDNN's flash kernel where it applies.
        cfg = UserDecoderConfig(d_model=args.user_d, n_blocks=args.user_blocks,
                                n_heads=args.user_heads, d_ff=4 * args.user_d,
                                vocab=args.user_vocab, remat=args.user_remat,
                                attention=resolve_attention_impl(
                                    attention, jnp.bfloat16, args.user_d // args.user_heads),
                                loop=args.user_loop, unroll=args.unroll_layers)
        loss_fn, vocab = user_loss, cfg.vocab
    else:
        cfg = preset(args.preset, dtype=jnp.bfloat16, remat=remat, max_seq_len=args.seq,
                     attention_impl=attention,
                     unroll_layers=layer_loop_unrolled(
                         args.unroll_layers, None if args.fp8_compute == "none" else "fp8"),
                     swiglu_backend=args.swiglu_backend, **overrides)
        loss_fn = functools.partial(lm_loss, aux_weight=cfg.moe_aux_weight)
        vocab = cfg.vocab_size
    if variant_kind in ("gtp", "gtp_prefetch", "xla_fsdp"):
        # --gtp G < n: the remaining devices are data parallel (dp = n / G), batch over both.
        gtp = args.gtp or n
        if n % gtp:
            raise SystemExit(f"--gtp {gtp} does not divide the {n} devices")
        mesh = gtp_jax.make_mesh(dp=n // gtp, gtp=gtp, devices=devices)
    else:
        mesh = gtp_jax.make_mesh(dp=n, devices=devices)
    def make_model():
        return UserDecoder(cfg, rngs=nnx.Rngs(0)) if user else Transformer(cfg, rngs=nnx.Rngs(0))

    # Every variant is built where it lives (never whole on one device first): a whole model
    # on device 0 would set that device's allocator peak above the step's own.
    if variant_kind.startswith("gtp"):
        model = gtp_jax.shard_init(make_model, mesh, gtp_jax.GTPConfig(
            gather_dtype=jnp.bfloat16, prefetch=variant_kind == "gtp_prefetch",
            reduce_dtype=args.reduce_dtype, remat_gathered=not args.no_remat_gathered,
            keep_gathered_layers=args.keep_gathered_layers,
            coalesce_layer_collectives=args.coalesce_layer_collectives,
            gather_format=None if args.gather_format == "none" else args.gather_format,
            fp8_compute=None if args.fp8_compute == "none" else args.fp8_compute,
            fp8_min_features=args.fp8_min_features,
            quant_backend=None if args.quant_backend == "auto" else args.quant_backend))
    else:
        def spec(var):
            # a layer stack (gtp_stacked metadata: the bundled blocks, a user's Stack) is
            # split on its first per-layer dim, as gtp_jax.shard splits it
            stacked = int(bool(var.get_metadata().get("gtp_stacked", False)))
            if variant_kind == "xla_fsdp" and var.get_value().ndim >= 2 + stacked:
                return var.replace(value=NamedSharding(mesh, P(*([None] * stacked), "gtp")))
            return var.replace(value=NamedSharding(mesh, P()))

        graphdef, abstract = nnx.split(nnx.eval_shape(make_model))
        shardings = jax.tree.map(spec, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
        state = jax.jit(lambda: nnx.split(make_model())[1], out_shardings=shardings)()
        model = nnx.merge(graphdef, state)
    if args.optimizer == "train":  # what `python -m gtp_jax train` steps with
        from gtp_jax.train import TrainConfig
        from gtp_jax.train.config import make_optimizer

        # The CLI's optimizer for this preset (its default peak LR and warm-up).
        tx, grad_norm = make_optimizer(TrainConfig(preset=args.preset,
                                                   steps=args.warmup + args.steps)), True
    else:
        tx, grad_norm = optax.adamw(1e-4), False  # as the peers: loss only
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    # The training step of `gtp_jax.train` (jax.jit over the split state, donated): plain
    # jit dispatch, so the host-side cost of walking the NNX object graph every step
    # (measured: a 6-9 ms idle gap between steps in the GPU trace with nnx.jit) is not
    # charged to any variant.
    step = TrainStep(model, optimizer, loss_fn, grad_norm=grad_norm)

    batch = args.per_device_batch * n
    data = jax.random.randint(jax.random.key(1), (4, batch, args.seq + 1), 0, vocab)
    placement = gtp_jax.data_sharding(mesh)
    batches = [jax.device_put(data[i], placement) for i in range(4)]

    def run_step(i: int) -> jax.Array:
        return step(batches[i % 4])["loss"]

    # The time to the first step: the step's compile (or its read from the persistent
    # compilation cache), then its first run.
    first = time.perf_counter()
    compile_events = None
    if args.compile_profile_dir:  # XLA's and JAX's time inside the compile, by event
        from gtp_jax.bench.compile_events import traced_compile

        (_, compiled), compile_events = traced_compile(
            lambda: measure_compile(lambda: step.compile(batches[0])),
            str(Path(args.compile_profile_dir) / variant))
        first = time.perf_counter() - compiled.seconds  # not the trace's writing and reading
    else:
        _, compiled = measure_compile(lambda: step.compile(batches[0]))
    jax.block_until_ready(run_step(0))
    first_step_s = time.perf_counter() - first
    launched = os.environ.get(LAUNCH_ENV)
    launch_to_first_step = time.time() - float(launched) if launched else None
    for i in range(1, args.warmup):
        jax.block_until_ready(run_step(i))
    times = []
    loss = None
    for i in range(args.steps):
        start = time.perf_counter()
        loss = jax.block_until_ready(run_step(i))
        times.append(time.perf_counter() - start)
    trace = None
    if args.profile_dir and variant in args.profile_variants.split(","):
        trace = profile_steps(run_step, Path(args.profile_dir) / variant, PROFILE_STEPS)
    compiled_peak = None
    if args.compiled_memory:  # XLA's figure of the step program (a cache hit where the
        # persistent compilation cache is on)
        from gtp_jax.plan.memory import MemoryFigure

        lowered = step._program.fn.lower(step.state, batches[0])
        compiled_peak = MemoryFigure.of(lowered.compile()).peak / 2**30
    step.sync()
    blocks = getattr(getattr(model, "module", model), "blocks", None)  # the user's Stack
    med = statistics.median(times)
    memory = memory_per_device(devices)
    peak = memory["peak_bytes_in_use"] if memory else 0
    param_bytes = gtp_jax.bytes_per_device(nnx.state(model, nnx.Param))
    opt_bytes = gtp_jax.bytes_per_device(nnx.state(optimizer, nnx.OptState))
    tokens_per_device = args.per_device_batch * args.seq
    flops = cfg.train_flops_per_token(args.seq) * tokens_per_device
    kind = devices[0].device_kind
    peak_rate = peak_flops(kind, "bfloat16")
    return {
        "variant": variant, "gather_format": args.gather_format,
        "fp8_compute": args.fp8_compute, "fp8_min_features": args.fp8_min_features,
        "quant_backend": args.quant_backend,
        "fp8_layers": len(getattr(model, "fp8_layers", ())), "devices": n,
        "mesh": {k: v for k, v in mesh.shape.items() if v > 1},
        "device_kind": kind, "preset": args.preset,
        "layers": cfg.n_blocks if user else cfg.n_layers, "seq": args.seq,
        "per_device_batch": args.per_device_batch,
        "unroll_layers": bool(getattr(blocks, "unroll", False)) if user
        else bool(getattr(cfg, "unrolled", False)),
        "user_loop": cfg.loop if user else None,
        "user_remat": cfg.remat if user else None,
        "attention": cfg.attention if user else getattr(cfg, "attention_impl", None),
        "swiglu_backend": getattr(cfg, "swiglu_backend", None),
        "step_ms": med * 1e3, "step_ms_min": min(times) * 1e3, "loss": float(loss),
        "peak_mem_gib": peak / 2**30, "compiled_peak_gib": compiled_peak,
        "state_gib": (2 * param_bytes + opt_bytes) / 2**30,
        "tflops_per_device": flops / med / 1e12,
        "mfu": flops / med / peak_rate if peak_rate else None,
        "first_step_s": first_step_s, "launch_to_first_step_s": launch_to_first_step,
        **compiled.to_json(),
        "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "trace": trace, "compile_events": compile_events,
    }


def profile_steps(run_step, directory: Path, steps: int) -> dict | None:
    """Traces ``run_step(i)`` for ``i < steps`` and returns device 0's per-step overlap numbers.

    `run_step` returns an array to block on. The trace (``perfetto_trace.json.gz``) is left
    in `directory`; the result holds communication, hidden, exposed and compute ms per step
    (see `gtp_jax.bench.trace`), or None when the trace has no device kernels (CPU).
    """
    import jax

    from gtp_jax.bench.trace import analyze_events, find_trace, load_events

    with jax.profiler.trace(str(directory), create_perfetto_trace=True):
        for i in range(steps):
            jax.block_until_ready(run_step(i))
    results = analyze_events(load_events(find_trace(directory)))
    if not results:
        return None
    r = results[0]
    return {"device": r.device, "comm_ms": r.comm_ms / steps, "hidden_ms": r.hidden_ms / steps,
            "exposed_ms": r.exposed_ms / steps, "compute_ms": r.compute_ms / steps,
            "hidden_fraction": r.hidden_fraction,
            "top_comm": [(n, t / steps) for n, t in r.top_comm]}


#: Options of the parent process only (which variants, where results go, time limits); every
#: other option is forwarded to each variant's worker process (`worker_command`).
PARENT_ONLY = frozenset({"variants", "json", "torch", "timeout", "worker", "help"})


def worker_command(variant: str, args: argparse.Namespace) -> list[str]:
    """The command that runs `variant` in a process of its own: every option of
    `build_parser` but `PARENT_ONLY`, as given (so no option can be dropped on the way)."""
    cmd = [sys.executable, "-X", "faulthandler", "-m", "gtp_jax.bench", "overlap",
           "--worker", variant]
    for action in build_parser()._actions:
        if action.dest in PARENT_ONLY or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            if value is not None:
                cmd.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if value != action.default:
                cmd.append(flag)
        elif value is not None:
            cmd += [flag, str(value)]
    return cmd


def _spawn(variant: str, args: argparse.Namespace, timeout: float) -> dict | None:
    env = dict(os.environ, **{LAUNCH_ENV: repr(time.time())})
    return run_for_result(variant, worker_command(variant, args), timeout, env)


def run_for_result(label: str, cmd: list[str], timeout: float,
                   env: dict[str, str] | None = None) -> dict | None:
    """Runs `cmd` and returns the JSON of its ``RESULT {...}`` stdout line (None on failure)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        print(f"[{label}] timed out after {timeout:.0f} s", flush=True)
        return None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"[{label}] failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
    return None


def _torch_peers(args: argparse.Namespace, ndev: int, timeout: float) -> list[dict]:
    """The PyTorch FSDP2 peer, blocks compiled and eager (and HSDP with ``--gtp`` < ndev)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "torch_fsdp2.py"
    torchrun = shutil.which("torchrun")
    if not script.exists() or torchrun is None:
        print("[torch] skipped: benchmarks/torch_fsdp2.py or torchrun not found", flush=True)
        return []
    replicate = ndev // args.gtp if args.gtp and ndev % args.gtp == 0 else 1
    # Only a user's decoder in the run: the peer is its blocks in PyTorch (MODEL=user).
    variants = [v for v in args.variants.split(",") if v]
    user = bool(variants) and all(v.startswith("user_") for v in variants)
    model = ({"MODEL": "user", "USER_D": str(args.user_d), "USER_BLOCKS": str(args.user_blocks),
              "USER_HEADS": str(args.user_heads), "USER_VOCAB": str(args.user_vocab),
              "USER_FF": str(4 * args.user_d)} if user else {})
    rows = []
    for compiled in ("1", "0"):
        env = dict(os.environ, PRESET=args.preset, SEQ=str(args.seq),
                   MB=str(args.per_device_batch), STEPS=str(args.steps),
                   LAYERS=str(args.layers or 0), COMPILE=compiled, REPLICATE=str(replicate),
                   **model)
        row = run_for_result(f"torch compile={compiled}",
                             [torchrun, f"--nproc_per_node={ndev}", str(script)], timeout, env)
        if row:
            print(f"[{row['variant']}] {row['step_ms']:.1f} ms, "
                  f"peak {row['peak_mem_gib']:.1f} GiB{first_step_text(row)}", flush=True)
            rows.append(row)
    return rows


def first_step_text(row: dict) -> str:
    """``, first step 12.3 s (compile 11.0 s, cache miss)`` of a row with ``first_step_s``
    (and, for gtp_jax's rows, ``compile_s`` / ``compile_cache``); "" without."""
    if row.get("first_step_s") is None:
        return ""
    parts = []
    if row.get("compile_s") is not None:
        parts.append(f"compile {row['compile_s']:.1f} s")
    if row.get("compile_cache"):
        parts.append(f"cache {row['compile_cache']}")
    detail = f" ({', '.join(parts)})" if parts else ""
    return f", first step {row['first_step_s']:.1f} s{detail}"


def format_table(rows: list[dict]) -> str:
    def find(name: str) -> dict | None:
        return next((r for r in rows if r["variant"] == name), None)

    head = ("| variant | step ms | vs replicated | exposed (step - compute) | "
            "comm ms / hidden (trace) | peak GiB | param+grad+opt GiB | MFU |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        suffix = "_dots" if r["variant"].endswith("_dots") else ""
        base = (find("user_unwrapped") if r["variant"].startswith("user_")
                else find("replicated" + suffix) or find("replicated"))
        floor = find("compute_only" + suffix)
        ratio = f"{r['step_ms'] / base['step_ms']:.3f}x" if base else "-"
        exposed = "-"
        if floor and not r["variant"].startswith("compute_only"):
            exposed = f"{max(0.0, r['step_ms'] - floor['step_ms']) / r['step_ms'] * 100:.1f}%"
        mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") else "-"
        state = f"{r['state_gib']:.2f}" if r.get("state_gib") is not None else "-"
        tr = r.get("trace")
        traced = f"{tr['comm_ms']:.1f} / {tr['hidden_fraction'] * 100:.0f}%" if tr else "-"
        lines.append(f"| {r['variant']} | {r['step_ms']:.1f} | {ratio} | {exposed} | {traced} | "
                     f"{r['peak_mem_gib']:.1f} | {state} | {mfu} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m gtp_jax.bench overlap``."""
    parser = argparse.ArgumentParser(prog="python -m gtp_jax.bench overlap",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--preset", default="1b",
                        help="model preset (gtp_jax.models.PRESETS: tiny, small, 100m, 1b, "
                             "llama3-8b, ...; the PyTorch peer knows tiny..1b, llama3-8b and "
                             "llama3-70b)")
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length")
    parser.add_argument("--per-device-batch", type=int, default=4, help="sequences per device")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps")
    parser.add_argument("--remat", default="none", choices=("none", "dots", "full"),
                        help="activation recompute in the layer loop (*_dots variants: dots)")
    parser.add_argument("--attention", default="auto", choices=("auto", "cudnn", "xla"),
                        help="attention implementation on GPU (TransformerConfig."
                        "attention_impl; auto: cuDNN where it applies)")
    parser.add_argument("--vocab", type=int, default=0,
                        help="override the preset's vocabulary (256: the byte vocabulary of "
                        "python -m gtp_jax train)")
    parser.add_argument("--optimizer", default="bench", choices=("bench", "train"),
                        help="bench: AdamW, loss only (as the peers); train: the optimizer "
                        "of python -m gtp_jax train (clipped AdamW with its schedule) and "
                        "the gradient norm it reports")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated variants (see the module docstring)")
    parser.add_argument("--reduce-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="GTPConfig.reduce_dtype of the gtp variants")
    parser.add_argument("--gather-format", default="none",
                        choices=("none", "fp8", "mxfp8", "nvfp4"),
                        help="GTPConfig.gather_format of the gtp variants")
    parser.add_argument("--quant-backend", default="auto",
                        choices=("auto", "pallas", "reference"),
                        help="GTPConfig.quant_backend of the gtp variants: how FP8 gathers and "
                             "FP8 matmuls quantize (auto: the Pallas kernels on GPUs; "
                             "reference: XLA's fusions of the same arithmetic)")
    parser.add_argument("--fp8-compute", default="none",
                        choices=("none", "tensorwise", "delayed"),
                        help="GTPConfig.fp8_compute of the gtp variants")
    parser.add_argument("--fp8-min-features", type=int, default=2048,  # GTPConfig's default
                        help="GTPConfig.fp8_min_features of the gtp variants")
    parser.add_argument("--no-remat-gathered", action="store_true",
                        help="GTPConfig(remat_gathered=False) for the gtp variants")
    parser.add_argument("--coalesce-layer-collectives", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="GTPConfig.coalesce_layer_collectives of the gtp variants: one "
                        "all-gather and one reduce-scatter per layer (default), or one per "
                        "weight (--no-coalesce-layer-collectives)")
    parser.add_argument("--keep-gathered-layers", action="store_true",
                        help="GTPConfig(keep_gathered_layers=True) for the gtp variants: the "
                        "backward loop reuses the forward pass's gathered weights")
    parser.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=None,
                        help="TransformerConfig.unroll_layers for every Transformer variant "
                        "and the user model's Stack (default: the trainer's, unrolled "
                        "unless remat full or --fp8-compute / the user's remat; "
                        "--no-unroll-layers: the blocks run under lax.scan, where the "
                        "prefetch variants differ)")
    parser.add_argument("--swiglu-backend", default=None, choices=("pallas", "reference"),
                        help="TransformerConfig.swiglu_backend (default: the Pallas kernel "
                        "on a GPU)")
    parser.add_argument("--user-d", type=int, default=2048, help="user_* model width")
    parser.add_argument("--user-blocks", type=int, default=16, help="user_* model blocks")
    parser.add_argument("--user-heads", type=int, default=16, help="user_* attention heads")
    parser.add_argument("--user-vocab", type=int, default=32000, help="user_* vocabulary")
    parser.add_argument("--user-remat", default="full", choices=("none", "dots", "full"),
                        help="user_* model's per-block remat (full: nnx.remat's default, "
                        "recompute each block; dots: save matmul outputs and the fused "
                        "attention's, the bundled default)")
    parser.add_argument("--user-loop", default="stack", choices=("stack", "python"),
                        help="user_* model's blocks: on gtp_jax.Stack (the layer loop; "
                        "--unroll-layers applies), or a Python loop, nnx.remat per block")
    parser.add_argument("--gtp", type=int, default=0,
                        help="GTP size of the gtp/xla_fsdp variants (0: all devices); the "
                        "other devices are data parallel, e.g. 8 GPUs with --gtp 4: dp2 x gtp4")
    parser.add_argument("--torch", action="store_true",
                        help="also run the PyTorch FSDP2 peer, blocks compiled and eager "
                        "(HSDP replicas x shards when --gtp is below the device count)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per variant")
    parser.add_argument("--json", default=None, help="write all results to this file")
    parser.add_argument("--profile-dir", default=None,
                        help="write a jax.profiler trace per traced variant here")
    parser.add_argument("--profile-variants",
                        default="gtp,gtp_prefetch,gtp_dots,gtp_prefetch_dots",
                        help="variants to trace (3 steps after timing, so timing is unaffected)")
    parser.add_argument("--compile-profile-dir", default=None,
                        help="trace each variant's compile with jax.profiler here and add "
                        "its longest host events (XLA's passes, autotuning, codegen) to its "
                        "result as compile_events")
    parser.add_argument("--compiled-memory", action="store_true",
                        help="also report the step program's compiled peak (XLA's memory "
                        "analysis; compiles the step a second time unless the persistent "
                        "compilation cache holds it)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
        return 0
    rows = []
    for variant in args.variants.split(","):
        result = _spawn(variant, args, args.timeout)
        if result:
            print(f"[{variant}] {result['step_ms']:.1f} ms, "
                  f"peak {result['peak_mem_gib']:.1f} GiB{first_step_text(result)}", flush=True)
            rows.append(result)
    if args.torch and rows:
        rows += _torch_peers(args, max(r["devices"] for r in rows), args.timeout)
    if rows:
        print(f"device: {rows[-1]['device_kind']} x{rows[-1]['devices']}, preset {args.preset}, "
              f"seq {args.seq}, {args.per_device_batch} sequences per device")
        print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if rows else 1
