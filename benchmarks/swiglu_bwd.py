"""SwiGLU backward on one GPU: the Pallas kernel (per warp count) against the XLA fusion.

Prints one table row per implementation: median time, effective bandwidth (bytes each must
move: gate_up and the output gradient read once, the gradient written once) and the largest
difference from the XLA reference. Usage: python benchmarks/swiglu_bwd.py [--rows 8192]
[--f 5632] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from gtp_jax import pallas


def _time(fn, *args, reps: int = 50) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--rows", type=int, default=4 * 2048)
    ap.add_argument("--f", type=int, default=5632)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    k = jax.random.key(0)
    gu = (2 * jax.random.normal(k, (args.rows, 2 * args.f), jnp.float32)).astype(jnp.bfloat16)
    g = jax.random.normal(jax.random.fold_in(k, 1), (args.rows, args.f)).astype(jnp.bfloat16)
    moved = 2 * gu.size + g.size  # elements (bf16): read gate_up and g, write the grad
    ref_fn = jax.jit(pallas.swiglu_bwd_reference)
    ref = ref_fn(gu, g)
    rows = [("xla fusion", ref_fn)]
    for warps in (4, 8):
        rows.append((f"pallas, {warps} warps", jax.jit(
            lambda a, b, w=warps: pallas.swiglu_bwd(a, b, backend="pallas", num_warps=w))))
    out = []
    print(f"device: {jax.devices()[0].device_kind}; gate_up bf16[{args.rows}, {2 * args.f}]")
    print("| implementation | ms | GB/s | max abs diff vs xla |")
    print("|---|---|---|---|")
    for name, fn in rows:
        sec = _time(fn, gu, g)
        diff = float(jnp.max(jnp.abs(fn(gu, g).astype(jnp.float32) - ref.astype(jnp.float32))))
        out.append({"impl": name, "ms": sec * 1e3, "gbps": moved * 2 / sec / 1e9, "diff": diff})
        print(f"| {name} | {sec * 1e3:.3f} | {moved * 2 / sec / 1e9:.0f} | {diff:.3g} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "rows": args.rows, "f": args.f,
                       "results": out}, fh, indent=1)


if __name__ == "__main__":
    main()
