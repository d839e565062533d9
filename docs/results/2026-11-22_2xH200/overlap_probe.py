"""Does an all-gather overlap an independent GEMM chain? Times each alone and both together.

One JAX program per case, inside ``jax.shard_map`` over all visible GPUs:
``gemm`` (x @ x @ x, bf16, 8192^2 per device), ``ag`` (all-gather of a 128 MiB shard per
device), ``both`` (the two, independent, in one program). hidden = (gemm + ag - both) / ag.

Run directly (single process, all local GPUs):
    python docs/results/2026-11-22_2xH200/overlap_probe.py
or as one process per GPU (``PROBE_NPROC=2 python docs/results/2026-11-22_2xH200/overlap_probe.py``
spawns them),
to compare the two launch modes. Prints one JSON line per process 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def _bench(f, *args, reps: int = 20) -> float:
    import jax
    import numpy as np

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def probe(label: str) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("g",), axis_types=(jax.sharding.AxisType.Auto,))
    h = int(os.environ.get("PROBE_H", "8192"))
    shard_rows = int(os.environ.get("PROBE_AG_ROWS", str(h)))  # 8192 x 8192 bf16 = 128 MiB
    x = jax.make_array_from_callback(
        (n * h, h), NamedSharding(mesh, P("g")),
        lambda idx: jax.random.normal(jax.random.key(0), (h, h), jnp.bfloat16))
    w = jax.make_array_from_callback(
        (n * shard_rows, h), NamedSharding(mesh, P("g")),
        lambda idx: jax.random.normal(jax.random.key(1), (shard_rows, h), jnp.bfloat16))

    def sm(f, out):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("g"), P("g")), out_specs=out,
                                     check_vma=False))

    gemm = sm(lambda x, w: x @ x @ x, P("g"))
    ag = sm(lambda x, w: jax.lax.all_gather(w, "g", tiled=True), P())
    both = sm(lambda x, w: (x @ x @ x, jax.lax.all_gather(w, "g", tiled=True)), (P("g"), P()))
    rs = sm(lambda x, w: jax.lax.psum_scatter(jnp.tile(w, (n, 1)), "g", tiled=True), P("g"))
    t_gemm, t_ag, t_both = _bench(gemm, x, w), _bench(ag, x, w), _bench(both, x, w)
    t_rs = _bench(rs, x, w)
    hidden = (t_gemm + t_ag - t_both) / t_ag
    return {"case": label, "processes": jax.process_count(), "devices": n,
            "gemm_ms": round(t_gemm, 3), "ag_ms": round(t_ag, 3), "both_ms": round(t_both, 3),
            "hidden_fraction": round(hidden, 3),
            "ag_busbw_GBs": round(shard_rows * h * 2 * (n - 1) / (t_ag * 1e-3) / 1e9, 1),
            "rs_ms": round(t_rs, 3),
            "rs_busbw_GBs": round(shard_rows * h * 2 * (n - 1) / (t_rs * 1e-3) / 1e9, 1),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__}


def main() -> None:
    label = os.environ.get("PROBE_LABEL", "default")
    nproc = int(os.environ.get("PROBE_NPROC", "0"))
    rank = os.environ.get("PROBE_RANK")
    if nproc and rank is None:
        procs = []
        for r in range(nproc):
            env = dict(os.environ, PROBE_RANK=str(r), CUDA_VISIBLE_DEVICES=str(r))
            procs.append(subprocess.Popen([sys.executable, __file__], env=env))
        sys.exit(max(p.wait() for p in procs))
    if rank is not None:
        import jax

        jax.distributed.initialize(coordinator_address="127.0.0.1:" +
                                   os.environ.get("PROBE_PORT", "23456"),
                                   num_processes=nproc, process_id=int(rank))
    result = probe(label)
    import jax

    if jax.process_index() == 0:
        print("PROBE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
