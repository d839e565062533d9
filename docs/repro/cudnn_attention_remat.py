"""Does XLA compile cuDNN attention under each remat policy, inside and outside shard_map?

Each case compiles ``jax.grad`` of a few decoder-like layers (a qkv matmul, cuDNN
``jax.nn.dot_product_attention``, an output matmul) in a fresh subprocess, so a compiler
crash (a segfault) is reported as a row instead of killing the script:

    python docs/repro/cudnn_attention_remat.py            # every case, a table
    python docs/repro/cudnn_attention_remat.py CASE       # one case, in this process

Cases are ``<policy>-<loop>-<wrap>``: policy ``none`` (no jax.checkpoint), ``dots``
(dots_with_no_batch_dims_saveable), ``names`` (save_only_these_names on the attention
output), ``dots_attn`` (dots plus the cuDNN forward's outputs, as gtp_jax's
``remat="dots"``); loop ``scan`` (lax.scan over stacked layers) or ``unrolled``; wrap
``shard_map`` (over all devices, batch split) or ``jit``. Needs a GPU with cuDNN.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

POLICIES = ("none", "dots", "names", "dots_attn")
LOOPS = ("scan", "unrolled")
WRAPS = ("jit", "shard_map")
B, S, H, D, L = 2, 1024, 8, 128, 4


def run_case(case: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name
    from jax.sharding import PartitionSpec as P

    policy, loop, wrap = case.split("-")
    d = H * D

    def save_dots_attn(prim, *avals, **params):
        if prim.name == "dot_product_attention_fwd_wrapper":
            return True
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params)

    policies = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                "names": jax.checkpoint_policies.save_only_these_names("attn"),
                "dots_attn": save_dots_attn}

    def layer(x, w):
        wqkv, wo = w
        b = x.shape[0]
        qkv = (x @ wqkv).reshape(b, S, 3, H, D)
        a = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                                         is_causal=True, implementation="cudnn")
        a = checkpoint_name(a.reshape(b, S, d), "attn")
        return x + a @ wo

    if policy != "none":
        layer = jax.checkpoint(layer, policy=policies[policy])

    def model(x, ws):
        if loop == "scan":
            x, _ = jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)
        else:
            for i in range(L):
                x = layer(x, (ws[0][i], ws[1][i]))
        return jnp.mean(x.astype(jnp.float32) ** 2)

    n = jax.device_count()
    grad_fn = jax.grad(model, argnums=1)
    if wrap == "shard_map":
        mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

        def per_device(x, ws):
            return jax.tree.map(lambda g: jax.lax.psum(g, "x"), grad_fn(x, ws))

        step = jax.shard_map(per_device, mesh=mesh, in_specs=(P("x"), P()), out_specs=P())
    else:
        step = grad_fn
    x = jnp.ones((B * n, S, d), jnp.bfloat16)
    ws = (jnp.full((L, d, 3 * d), 0.01, jnp.bfloat16), jnp.full((L, d, d), 0.01, jnp.bfloat16))
    if wrap == "shard_map":
        x = jax.device_put(x, jax.NamedSharding(mesh, P("x")))
        ws = jax.device_put(ws, jax.NamedSharding(mesh, P()))
    jax.block_until_ready(jax.jit(step)(x, ws))


def main() -> int:
    if len(sys.argv) > 1:
        run_case(sys.argv[1])
        return 0
    import jax

    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    print("| case | result |\n|---|---|")
    for policy, loop, wrap in itertools.product(POLICIES, LOOPS, WRAPS):
        case = f"{policy}-{loop}-{wrap}"
        p = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True,
                           timeout=600)
        if p.returncode == 0:
            result = "compiles and runs"
        else:
            tail = (p.stderr.strip().splitlines() or ["?"])[-1][:120]
            result = f"exit {p.returncode}: {tail}"
        print(f"| {case} | {result} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
