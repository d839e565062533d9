"""The FP8 cast-and-transpose kernel's tile and warp count on one GPU, per shape and layout.

`gtp_jax.pallas.cast_transpose_pallas` was tuned on one H200 (`BLOCK`, `NUM_WARPS`); this
times every (tile, warps) pair of a small grid for the shapes the FP8 blocks quantize
(activations and gradients ``[8192, 4096]`` and ``[8192, 14336]``, weights ``[4096,
14336]``) and layouts, and prints one table row per pair: median time and the effective
bandwidth (bf16 read, one byte written per payload). The kernels are queued back to back and
waited for once, so dispatch does not count. Usage:
python docs/results/2026-11-27_1xH100/cast_tiles/cast_transpose_tiles.py [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from gtp_jax.pallas.cast_transpose import BLOCK, NUM_WARPS, cast_transpose_pallas

SHAPES = ((8192, 4096), (8192, 14336), (4096, 14336))
LAYOUTS = ("both", "rowwise", "columnwise")
BLOCKS = ((32, 128), (64, 64), (64, 128), (128, 64), (128, 128), (64, 256))
WARPS = (4, 8)


def _time(fn, x, reps: int = 40, rounds: int = 5) -> float:
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        outs = [fn(x) for _ in range(reps)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t) / reps)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--with-amax", action="store_true", help="also record the amax")
    args = ap.parse_args()
    s = jnp.float32(0.5)
    rows = []
    print(f"device: {jax.devices()[0].device_kind}; default tile {BLOCK}, {NUM_WARPS} warps")
    print("| shape | layout | tile | warps | ms | TB/s |")
    print("|---|---|---|---|---|---|")
    for shape, layout in itertools.product(SHAPES, LAYOUTS):
        x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)
        moved = x.size * 2 + x.size * (2 if layout == "both" else 1)
        best = None
        for block, warps in itertools.product(BLOCKS, WARPS):
            fn = jax.jit(lambda v, b=block, w=warps, lay=layout: cast_transpose_pallas(
                v, s, jnp.float8_e4m3fn, layout=lay, interpret=False, block=b, num_warps=w,
                with_amax=args.with_amax))
            try:
                sec = _time(fn, x)
            except Exception as err:  # noqa: BLE001  (a tile the compiler refuses)
                print(f"| {shape} | {layout} | {block} | {warps} | failed: "
                      f"{type(err).__name__} | |")
                continue
            row = {"shape": shape, "layout": layout, "block": block, "warps": warps,
                   "ms": sec * 1e3, "tbps": moved / sec / 1e12}
            rows.append(row)
            best = row if best is None or row["ms"] < best["ms"] else best
            mark = " (default)" if (block, warps) == (tuple(BLOCK), NUM_WARPS) else ""
            print(f"| {shape} | {layout} | {block}{mark} | {warps} | {sec * 1e3:.3f} | "
                  f"{moved / sec / 1e12:.2f} |", flush=True)
        if best is not None:
            print(f"best for {shape} {layout}: {best['block']} x {best['warps']} warps, "
                  f"{best['ms']:.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
