"""Which parts of ring attention does this jax's XLA compile? One case per process.

    python docs/repro/ring_attention_compile.py            # every case, a table (CPU)
    python docs/repro/ring_attention_compile.py CASE       # one case, in this process

Runs on the CPU backend with 8 simulated devices (a crash of the compiler, e.g. a
segmentation fault, becomes a row instead of ending the script). Cases:
``scatter_rows_n2`` (the smallest program found to crash jax 0.11.2's CPU compiler: two
attention blocks written into an accumulator with ``x.at[:, a:b].set``, a scatter, inside
a 2-device ``shard_map``), ``dus_rows_n2`` (the same with ``lax.dynamic_update_slice``, as
`ring_attention` now writes its rows), ``block`` (one
attention block forward and backward, no collectives), ``fwd``/``grad`` of
`gtp_jax.parallel.context.ring_attention` under ``shard_map`` with ``contig``/``zigzag``
layout over ``n2``/``n4`` devices, ``valid`` (with a padding mask), and
``allgather_grad_n2`` (the all-gather baseline), ``model_grad_cp2`` (the tiny decoder
sharded with ``cp=2``).
"""

from __future__ import annotations

import os
import subprocess
import sys

CASES = ("scatter_rows_n2", "dus_rows_n2", "block", "fwd_contig_n2", "fwd_zigzag_n2",
         "grad_contig_n2", "grad_zigzag_n2", "grad_zigzag_n2_valid", "grad_contig_n4",
         "allgather_grad_n2", "model_grad_cp2")


def run_case(case: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from gtp_jax.parallel import context as cp

    b, s, h, d = 2, 32, 2, 8
    q = jnp.ones((b, s, h, d), jnp.float32)
    if case in ("scatter_rows_n2", "dus_rows_n2"):
        from jax import lax

        def rows(q, k, v):
            o = jnp.zeros(q.shape, jnp.float32)
            for causal in (True, False):
                ob, _ = cp.attention_block(q, k, v, causal=causal, kv_len=None, scale=0.3)
                new = o + ob
                o = (o.at[:, 0:q.shape[1]].set(new) if case == "scatter_rows_n2"
                     else lax.dynamic_update_slice_in_dim(o, new, 0, axis=1))
            return o

        mesh = Mesh(np.array(jax.devices()[:2]), ("cp",))
        jax.block_until_ready(jax.jit(jax.shard_map(
            rows, mesh=mesh, in_specs=(P(None, "cp"),) * 3, out_specs=P(None, "cp")))(q, q, q))
        return
    if case == "model_grad_cp2":
        from flax import nnx

        import gtp_jax
        from gtp_jax.models import Transformer, lm_loss, preset

        mesh = gtp_jax.make_mesh(dp=1, gtp=1, tp=1, ep=1, cp=2, devices=jax.devices()[:2])
        model = gtp_jax.shard(Transformer(preset("tiny"), rngs=nnx.Rngs(0)), mesh,
                              gtp_jax.GTPConfig())
        graphdef, state = nnx.split(model)
        tokens = jnp.zeros((2, 33), jnp.int32)
        jax.block_until_ready(jax.jit(jax.grad(
            lambda st: lm_loss(nnx.merge(graphdef, st), tokens)))(state))
        return
    if case == "block":
        out, lse = jax.jit(lambda q: cp.attention_block(q, q, q, causal=True, kv_len=None,
                                                        scale=0.3))(q)
        jax.block_until_ready(jax.jit(jax.grad(
            lambda q: cp.attention_block(q, q, q, causal=True, kv_len=None,
                                         scale=0.3)[0].sum()))(q))
        return
    kind, *rest = case.split("_")
    fn = cp.allgather_attention if kind == "allgather" else cp.ring_attention
    if kind == "allgather":
        kind, rest = rest[0], rest[1:]
    layout = {"contig": "contiguous", "zigzag": "zigzag"}.get(rest[0], "contiguous")
    n = int(next(r for r in rest if r.startswith("n"))[1:])
    valid = s - 5 if "valid" in rest else None
    mesh = Mesh(np.array(jax.devices()[:n]), ("cp",))
    f = jax.shard_map(lambda q, k, v: fn(q, k, v, axis="cp", layout=layout, valid_len=valid),
                      mesh=mesh, in_specs=(P(None, "cp"),) * 3, out_specs=P(None, "cp"))
    if kind == "fwd":
        jax.block_until_ready(jax.jit(f)(q, q, q))
    else:
        jax.block_until_ready(jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(),
                                               argnums=(0, 1, 2)))(q, q, q))


def main() -> int:
    if len(sys.argv) > 1:
        run_case(sys.argv[1])
        return 0
    import jax

    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    print(f"jax {jax.__version__}, CPU backend, 8 simulated devices")
    print("| case | result |\n|---|---|")
    for case in CASES:
        p = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True,
                           timeout=300, env=env)
        tail = (p.stderr.strip().splitlines() or ["?"])[-1][:120]
        result = "compiles and runs" if p.returncode == 0 else f"exit {p.returncode}: {tail}"
        print(f"| {case} | {result} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
