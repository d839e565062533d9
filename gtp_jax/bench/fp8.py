"""``python -m gtp_jax.bench fp8``: FP8 compute against bf16 on Llama-3-8B-shaped blocks.

Rows (each in its own process, side by side in one call):

  blocks_bf16   L blocks (d 4096, ff 14336, 32 heads, 8 kv heads, SwiGLU, RMSNorm), one
                sequence of 8192 tokens, written as a user's NNX module (a Python loop of
                blocks, no remat), under `gtp_jax.shard` on the devices present; fwd + bwd
                + AdamW (bf16 weights and moments, as the PyTorch peer), cuDNN attention
  blocks_fp8    the same with ``GTPConfig(fp8_compute="tensorwise")``
  blocks_fp8_delayed  the same with ``GTPConfig(fp8_compute="delayed")`` (amax history)
  gemm_*        one linear ``[8192, k] @ [k, n]`` forward + backward, bf16 against FP8
                (the quantize passes included), over square sizes: where FP8 starts to pay

Each row prints step ms, peak GiB and, from the compiled program, how many GEMMs are
cuBLASLt FP8 GEMMs (``__cublas$lt$matmul$f8``) and how many are not; a blocks row also the
time to its first step (``first_step_s``: the compile, or its read from the persistent
compilation cache, ``compile_s`` / ``compile_cache``, then one step). The PyTorch peer is
``benchmarks/torch_fp8_blocks.py`` (torchao float8); ``benchmarks/fp8.sh`` runs both.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

ROWS = ("blocks_bf16", "blocks_fp8", "blocks_fp8_delayed")
#: The FP8 recipe of each blocks row.
BLOCK_RECIPES = {"blocks_bf16": None, "blocks_fp8": "tensorwise",
                 "blocks_fp8_delayed": "delayed"}
GEMM_SIZES = (1024, 2048, 4096, 8192)


def _gemm_counts(hlo: str) -> dict[str, int]:
    targets = re.findall(r'custom_call_target="(__cublas\$[^"]+)"', hlo)
    fp8 = sum(t.endswith("$f8") for t in targets)
    # gtp_jax's Pallas kernels (amax, casts) by name: the quantize launches per step.
    kernels = collections.Counter(
        m.group(1) for line in hlo.splitlines() if "custom-call(" in line
        for m in [re.search(r"\b(gtp_[a-z0-9_]+?)(?:__\d+)?\b", line)] if m)
    return {"fp8_gemms": fp8, "other_gemms": len(targets) - fp8,
            "quantize_launches": dict(sorted(kernels.items()))}


def _median_ms(fn, *args, steps: int, warmup: int) -> float:
    import jax

    for _ in range(warmup):
        out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - begin)
    times.sort()
    return 1e3 * times[len(times) // 2]


def _peak_gib() -> float | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def run_blocks(args: argparse.Namespace, row: str) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import gtp_jax
    from gtp_jax.base.compile_watch import measure_compile
    from gtp_jax.train import TrainStep
    from gtp_jax.train.step.train_step import step_program

    d, ff, heads, kv, seq = args.d_model, args.d_ff, args.heads, args.kv_heads, args.seq
    hd = d // heads
    bf16 = jnp.bfloat16
    on_gpu = jax.default_backend() == "gpu"

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            common = {"use_bias": False, "dtype": bf16, "param_dtype": bf16, "rngs": rngs}
            self.n1 = nnx.RMSNorm(d, dtype=bf16, param_dtype=bf16, rngs=rngs)
            self.q = nnx.Linear(d, d, **common)
            self.kv = nnx.Linear(d, 2 * kv * hd, **common)
            self.o = nnx.Linear(d, d, **common)
            self.n2 = nnx.RMSNorm(d, dtype=bf16, param_dtype=bf16, rngs=rngs)
            self.g = nnx.Linear(d, ff, **common)
            self.u = nnx.Linear(d, ff, **common)
            self.down = nnx.Linear(ff, d, **common)

        def __call__(self, x):
            b, t, _ = x.shape
            h = self.n1(x)
            q = self.q(h).reshape(b, t, heads, hd)
            k, v = jnp.split(self.kv(h).reshape(b, t, 2 * kv, hd), 2, axis=2)
            a = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                             implementation="cudnn" if on_gpu else None)
            x = x + self.o(a.reshape(b, t, d))
            h = self.n2(x)
            return x + self.down(jax.nn.silu(self.g(h)) * self.u(h))

    class Blocks(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(args.layers)])

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    mesh = gtp_jax.make_mesh(gtp=jax.device_count())
    config = gtp_jax.GTPConfig(fp8_compute=BLOCK_RECIPES[row],
                               fp8_min_features=args.fp8_min_features)
    model = gtp_jax.shard(Blocks(nnx.Rngs(0)), mesh, config)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-5), wrt=nnx.Param)

    def loss_fn(m, x):
        return jnp.mean(m(x).astype(jnp.float32) ** 2)

    step = TrainStep(model, optimizer, loss_fn, grad_norm=False)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (jax.device_count(), seq, d), bf16),
                       gtp_jax.data_sharding(mesh))
    # The step's own program, compiled once: its HLO is counted and the executable timed.
    start = time.perf_counter()
    compiled, compile_report = measure_compile(lambda: step_program(
        step.graphdef, loss_fn, grad_norm=False).lower(step.state, x).compile())
    counts = _gemm_counts(compiled.as_text())
    state = [step.state]

    def run(batch):
        state[0], metrics = compiled(state[0], batch)
        return metrics["loss"]

    jax.block_until_ready(run(x))  # the first step: the time to it is compile + run
    first_step_s = time.perf_counter() - start
    ms = _median_ms(run, x, steps=args.steps, warmup=args.warmup)
    if args.profile_dir:
        _profile(run, x, os.path.join(args.profile_dir, row),
                 compiled.as_text())
    flops = 6 * seq * args.layers * (2 * d * d + 2 * d * kv * hd + 3 * d * ff) \
        + 6 * args.layers * heads * seq * seq * hd  # causal attention: half of 4*s*s*hd, x3
    return {"row": row, "step_ms": ms,
            "tflops": flops / ms / 1e9, "peak_gib": _peak_gib(),
            "fp8_layers": len(model.fp8_layers), "first_step_s": first_step_s,
            **compile_report.to_json(), **counts}


def _profile(run: Any, x: Any, directory: str, hlo: str, steps: int = 3) -> None:
    """Traces `steps` steps into `directory` (read it with ``python -m gtp_jax.bench.kernels
    DIR --steps 3 --hlo DIR/step.hlo.txt``), with the step's optimized HLO beside it."""
    import jax

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "step.hlo.txt"), "w") as f:
        f.write(hlo)
    jax.block_until_ready(run(x))
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(steps):
            out = run(x)
        jax.block_until_ready(out)


def run_gemm(args: argparse.Namespace, size: int) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    from gtp_jax.pallas.fp8_matmul import fp8_matmul

    m = args.seq
    x = jax.random.normal(jax.random.key(0), (m, size), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (size, size)) * 0.02).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), (m, size), jnp.bfloat16)
    rows = []
    for name, mm in (("bf16", jnp.matmul), ("fp8", fp8_matmul)):
        def fwd_bwd(x_, w_, dy_, mm=mm):
            # forward, then both gradients for an output gradient that is data (a constant
            # one would let XLA fold the backward products away)
            y, vjp = jax.vjp(mm, x_, w_)
            return y, vjp(dy_)

        fn = jax.jit(fwd_bwd)
        counts = _gemm_counts(fn.lower(x, w, dy).compile().as_text())
        ms = _median_ms(fn, x, w, dy, steps=args.steps * 3, warmup=args.warmup)
        rows.append({"row": f"gemm_{size}_{name}", "step_ms": ms,
                     "tflops": 6 * m * size * size / ms / 1e9, **counts})
    return rows


def _spawn(row: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "gtp_jax.bench.fp8", "--row", row,
           "--layers", str(args.layers), "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--d-model", str(args.d_model),
           "--d-ff", str(args.d_ff), "--heads", str(args.heads),
           "--kv-heads", str(args.kv_heads), "--fp8-min-features", str(args.fp8_min_features)]
    if args.profile_dir:
        cmd += ["--profile-dir", args.profile_dir]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                             env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return [{"row": row, "error": f"timed out after {args.timeout} s"}]
    found = [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines()
             if line.startswith("RESULT ")]
    if out.returncode or not found:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        return [{"row": row, "error": " | ".join(tail)}]
    return found


def _launches(row: dict[str, Any]) -> str:
    """``amax 24, cast_transpose 60`` from a row's Pallas kernel counts (GEMM rows: -)."""
    counts = row.get("quantize_launches")
    if counts is None:
        return "-"
    return ", ".join(f"{k.removeprefix('gtp_')} {n}" for k, n in counts.items()) or "0"


def _table(results: list[dict[str, Any]]) -> str:
    lines = ["| row | step ms | TFLOP/s | peak GiB | FP8 GEMMs | other GEMMs | quantize "
             "launches | vs bf16 | first step s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = {r["row"]: r for r in results}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | error: {r['error'][:120]} | | | | | | | |")
            continue
        twin = by.get("blocks_bf16" if r["row"].startswith("blocks_")
                      else r["row"].replace("fp8", "bf16"))
        ratio = (f"{r['step_ms'] / twin['step_ms']:.3f}x" if twin and "step_ms" in twin
                 and twin is not r else "")
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        first = (f"{r['first_step_s']:.1f}" + (f" ({r['compile_cache']})"
                                                if r.get("compile_cache") else "")
                 if r.get("first_step_s") is not None else "-")
        lines.append(f"| {r['row']} | {r['step_ms']:.2f} | {r['tflops']:.0f} | {peak} | "
                     f"{r.get('fp8_gemms', '-')} | {r.get('other_gemms', '-')} | "
                     f"{_launches(r)} | {ratio} | {first} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gtp_jax.bench fp8", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--rows", default=",".join(ROWS) + ",gemm",
                        help="comma-separated: blocks_bf16, blocks_fp8, blocks_fp8_delayed, gemm "
                        "(the size sweep)")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192, help="tokens (one sequence)")
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--d-ff", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--fp8-min-features", type=int, default=2048,
                        help="GTPConfig.fp8_min_features of the blocks_fp8 rows")
    parser.add_argument("--steps", type=int, default=15, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per row")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--profile-dir", default=None,
                        help="trace 3 steps of each blocks row into DIR/<row> (with its HLO)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.row is not None:  # a child process: one row
        if args.row.startswith("gemm_"):
            rows = run_gemm(args, int(args.row.split("_")[1]))
        else:
            rows = [run_blocks(args, args.row)]
        for r in rows:
            print("RESULT " + json.dumps(r), flush=True)
        return 0
    wanted = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(wanted) - set(ROWS) - {"gemm"})
    if unknown:
        print(f"error: --rows has {unknown}; choose from {list(ROWS) + ['gemm']}",
              file=sys.stderr)
        return 2
    results = []
    for row in wanted:
        for child in ([f"gemm_{s}" for s in GEMM_SIZES] if row == "gemm" else [row]):
            results += _spawn(child, args)
            print(f"[{child}] " + json.dumps(results[-1]), flush=True)
    print(_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
