"""Ring attention's block kernels on one GPU: the flash-attention Pallas kernels (per tile
choice) against the pure-JAX reference, with cuDNN's fused attention as a yardstick.

For each block length ``c`` (a diagonal causal block ``c x c`` and a full block ``c x 2c``,
the two shapes the zigzag ring runs; bf16, 16 heads of 128) prints forward and backward
milliseconds, TFLOP/s (causal blocks count half) and the largest difference from the
reference. cuDNN has no log-sum-exp output in jax's API, so it cannot serve the ring; its
row shows what a fused forward costs. Usage: python benchmarks/flash_block.py
[--lengths 2048,8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from gtp_jax.pallas import flash_block as ab

TILES = {
    "default": ab.BlockTiles(),
    "fwd 128x128": ab.BlockTiles(fwd_q=128, fwd_k=128),
    "fwd 64x64, 4 warps": ab.BlockTiles(fwd_q=64, fwd_k=64, num_warps=4),
    "bwd 64x64": ab.BlockTiles(dkv_k=64, dkv_q=64, dq_q=64, dq_k=64),
    "3 stages": ab.BlockTiles(num_stages=3),
}


def _time(fn, *args, reps: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    fin = np.isfinite(b)
    return float(np.max(np.abs(np.where(fin, a - b, 0))) / max(np.max(np.abs(b[fin])), 1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    h, d = args.heads, args.head_dim
    scale = d ** -0.5
    results = []
    print(f"device: {jax.devices()[0].device_kind}; bf16, {h} heads of {d}")
    print("| block | implementation | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | "
          "max rel diff (out, dq, dk, dv) |")
    print("|---|---|---|---|---|---|---|")
    for c in (int(x) for x in args.lengths.split(",")):
        for causal, sk in ((True, c), (False, 2 * c)):
            ks = jax.random.split(jax.random.key(c + sk), 4)
            q = jax.random.normal(ks[0], (1, c, h, d), jnp.bfloat16)
            k = jax.random.normal(ks[1], (1, sk, h, d), jnp.bfloat16)
            v = jax.random.normal(ks[2], (1, sk, h, d), jnp.bfloat16)
            do = jax.random.normal(ks[3], (1, c, h, d), jnp.bfloat16)
            flops = 4 * c * sk * h * d * (0.5 if causal else 1.0)
            kw = dict(causal=causal, kv_len=None, scale=scale)
            ref_f = jax.jit(functools.partial(ab.attention_block_reference, **kw))
            r_out, r_lse = ref_f(q, k, v)
            delta = jnp.sum(do.astype(jnp.float32) * r_out, -1)
            ref_b = jax.jit(functools.partial(ab.attention_block_bwd_reference, **kw))
            r_grads = ref_b(q, k, v, do, r_lse, delta)
            impls = [("reference (XLA)", ref_f, ref_b)]
            for name, tiles in TILES.items():
                impls.append((f"pallas, {name}",
                              jax.jit(functools.partial(ab.attention_block, backend="pallas",
                                                        tiles=tiles, **kw)),
                              jax.jit(functools.partial(ab.attention_block_bwd,
                                                        backend="pallas", tiles=tiles, **kw))))
            label = f"{c}x{sk}{' causal' if causal else ''}"
            for name, f, b in impls:
                try:
                    out, _ = f(q, k, v)
                    grads = b(q, k, v, do, r_lse, delta)
                    tf, tb = _time(f, q, k, v), _time(b, q, k, v, do, r_lse, delta)
                except Exception as e:  # a tile choice that does not compile: say so
                    print(f"| {label} | {name} | failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]} |||||")
                    continue
                errs = [_err(a, r) for a, r in zip((out, *grads), (r_out, *r_grads))]
                results.append({"block": label, "impl": name, "fwd_ms": tf * 1e3,
                                "bwd_ms": tb * 1e3, "fwd_tflops": flops / tf / 1e12,
                                "bwd_tflops": 2.5 * flops / tb / 1e12, "errs": errs})
                print(f"| {label} | {name} | {tf * 1e3:.3f} | {flops / tf / 1e12:.0f} | "
                      f"{tb * 1e3:.3f} | {2.5 * flops / tb / 1e12:.0f} | "
                      + ", ".join(f"{e:.1e}" for e in errs) + " |", flush=True)
            if causal:
                cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, implementation="cudnn"))
                try:
                    t = _time(cud, q, k, v)
                    print(f"| {label} | cuDNN forward (no lse) | {t * 1e3:.3f} | "
                          f"{flops / t / 1e12:.0f} | | | |")
                    results.append({"block": label, "impl": "cudnn fwd", "fwd_ms": t * 1e3})
                except Exception as e:
                    print(f"| {label} | cuDNN | failed: {type(e).__name__} |||||")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "results": results}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
