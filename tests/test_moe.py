"""Mixture of experts: routing/drop rule, a dense reference, sharded == unsharded, batched gathers.

Tolerances: float32 `FP32_RTOL` relative to max|reference|. The MoE block computes the same
per-token products as the dense reference (each token's expert FFN on its own row); only
the order of the final weighted sum over the chosen experts and, in the sharded model, the
order of the cross-device gradient sums differ (a few float32 ulps).
"""

from __future__ import annotations

import dataclasses
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close
from test_tp import run_case

import gtp_jax
from gtp_jax.models import Transformer, TransformerConfig, lm_loss, preset
from gtp_jax.parallel import MoE, expert_capacity, moe_ffn, route

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

FP32_RTOL = 1e-5
E, D, F = 4, 12, 10


def _params(key):
    k = jax.random.split(key, 4)
    router = jax.random.normal(k[0], (D, E))
    w_in = jax.random.normal(k[1], (E, D, 2 * F)) / np.sqrt(D)
    w_out = jax.random.normal(k[2], (E, F, D)) / np.sqrt(F)
    return router, w_in, w_out


def dense_reference(x, router, w_in, w_out, top_k, keep=None):
    """Every token through each of its chosen experts, densely: ``sum_j gate_j * ffn_{e_j}(x)``.

    Independent of the dispatch code: experts are picked with ``argsort``, every expert runs
    on every token, and a token/expert weight selects the result. `keep` (bool
    ``[B, T, k]``) zeroes dropped choices.
    """
    probs = jax.nn.softmax(x @ router, axis=-1)
    idx = jnp.argsort(-probs, axis=-1, stable=True)[..., :top_k]
    top = jnp.take_along_axis(probs, idx, axis=-1)
    gates = top / top.sum(-1, keepdims=True) if top_k > 1 else top
    if keep is not None:
        gates = gates * keep
    out = 0.0
    for e in range(w_in.shape[0]):
        gate, up = jnp.split(x @ w_in[e], 2, axis=-1)
        ffn = (jax.nn.silu(gate) * up) @ w_out[e]
        weight = jnp.sum(gates * (idx == e), axis=-1)
        out = out + weight[..., None] * ffn
    return out


def drop_rule_reference(expert: np.ndarray, capacity: int) -> np.ndarray:
    """GShard priority with plain loops: all first choices in sequence order, then all
    second choices...; a choice is kept while its expert has a free slot. Returns the slot
    ``e * C + position`` or ``E * C`` for dropped choices."""
    b, t, k = expert.shape
    slot = np.full(expert.shape, E * capacity)
    for i in range(b):
        used = np.zeros(E, int)
        for j in range(k):
            for pos in range(t):
                e = expert[i, pos, j]
                if used[e] < capacity:
                    slot[i, pos, j] = e * capacity + used[e]
                    used[e] += 1
    return slot


@pytest.mark.parametrize("top_k,capacity_factor", [(1, None), (2, None), (2, 2.0)])
def test_moe_block_matches_dense_reference(top_k, capacity_factor, key) -> None:
    """No token is dropped (dropless, or a capacity of T): forward and all gradients match."""
    router, w_in, w_out = _params(key)
    x = jax.random.normal(jax.random.fold_in(key, 1), (3, 16, D))
    ct = jax.random.normal(jax.random.fold_in(key, 2), x.shape)
    assert expert_capacity(16, E, top_k, capacity_factor) == 16  # room for every token

    def moe_loss(x, router, w_in, w_out):
        y, _ = moe_ffn(x, router, w_in, w_out, top_k=top_k, capacity_factor=capacity_factor)
        return jnp.sum(y * ct), y

    def ref_loss(x, router, w_in, w_out):
        y = dense_reference(x, router, w_in, w_out, top_k)
        return jnp.sum(y * ct), y

    args = (x, router, w_in, w_out)
    grad = jax.value_and_grad
    (_, y), grads = jax.jit(grad(moe_loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    (_, y_ref), g_ref = jax.jit(grad(ref_loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    assert_close(y, y_ref, FP32_RTOL, "output")
    for name, g, r in zip(("x", "router", "w_in", "w_out"), grads, g_ref):
        assert_close(g, r, FP32_RTOL, f"grad {name}")


def test_capacity_drop_rule_and_pass_through(key) -> None:
    """With capacity 4 (cf=0.5, T=16, k=2, E=4) choices overflow: the slots follow GShard
    priority, dropped choices contribute nothing, and a token whose choices are all dropped
    comes out exactly zero (the residual passes it through)."""
    top_k, cf, t = 2, 0.5, 16
    capacity = expert_capacity(t, E, top_k, cf)
    assert capacity == math.ceil(cf * t * top_k / E) == 4
    router, w_in, w_out = _params(key)
    # Bias every token towards expert 0 so it overflows and some tokens lose both choices.
    x = jax.random.normal(jax.random.fold_in(key, 1), (4, t, D)) + 2.0 * router[:, 0]
    routing = jax.jit(route, static_argnums=(1, 2))(x @ router, top_k, capacity)
    expected = drop_rule_reference(np.asarray(routing.expert), capacity)
    np.testing.assert_array_equal(np.asarray(routing.slot), expected)
    keep = expected < E * capacity
    assert (~keep).any(), "the test needs dropped choices"
    assert (~keep).all(axis=-1).any(), "the test needs a token with every choice dropped"
    assert not np.asarray(routing.gate)[~keep].any()

    y, _ = jax.jit(lambda *a: moe_ffn(*a, top_k=top_k, capacity_factor=cf))(x, router, w_in,
                                                                              w_out)
    y_ref = jax.jit(dense_reference, static_argnums=4)(x, router, w_in, w_out, top_k,
                                                        jnp.asarray(keep))
    assert_close(y, y_ref, FP32_RTOL, "output with drops")
    all_dropped = (~keep).all(axis=-1)
    assert not np.asarray(y)[all_dropped].any()


def test_dropped_assignments_are_counted_per_sequence(key) -> None:
    """`Routing.dropped`: the real tokens' (token, choice) pairs whose expert was full; none
    when dropless, padding never counted; the decoder sums it over layers (`LMOutput`)."""
    b, t, k = 2, 12, 2
    route_jit = jax.jit(route, static_argnums=(1, 2))
    logits = jax.random.normal(key, (b, t, E))
    tight = route_jit(logits, k, 2)  # 2 slots per expert: most of 24 assignments drop
    expected = (np.asarray(tight.slot) == E * 2).sum(axis=(1, 2))
    np.testing.assert_array_equal(np.asarray(tight.dropped), expected)
    assert expected.min() > 0
    np.testing.assert_array_equal(np.asarray(route_jit(logits, k, t).dropped), 0)
    padded = jnp.concatenate([logits, jax.random.normal(key, (b, 4, E))], axis=1)
    masked = route_jit(padded, k, 2, jnp.arange(t + 4) < t)
    np.testing.assert_array_equal(np.asarray(masked.dropped), expected)
    cfg = TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=3, d_ff=32,
                            max_seq_len=16, moe_experts=4, moe_top_k=2,
                            moe_capacity_factor=0.5)
    out = Transformer(cfg, rngs=nnx.Rngs(0))(jnp.ones((2, 16), jnp.int32))
    assert out.dropped.shape == (2,) and float(out.dropped.min()) > 0
    assert float(out.dropped.max()) <= 16 * 2 * 3


def test_balance_loss(key) -> None:
    """Switch form E * sum_e f_e P_e per sequence: 1 for uniform routing; padding excluded."""
    b, t = 2, 12
    route_jit = jax.jit(route, static_argnums=(1, 2))
    uniform = route_jit(jnp.zeros((b, t, E)), 2, t)
    chex.assert_trees_all_close(uniform.aux, jnp.ones(b), rtol=1e-6)

    logits = jax.random.normal(key, (b, t, E))
    routing = route_jit(logits, 2, t)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    counts = np.stack([np.bincount(np.asarray(routing.expert)[i].ravel(), minlength=E)
                       for i in range(b)])
    expected = E * np.sum(counts / (t * 2) * probs.mean(axis=1), axis=-1)
    chex.assert_trees_all_close(routing.aux, expected, rtol=1e-6)
    # Trailing padding (masked invalid) changes neither the loss nor real tokens' slots.
    padded = jnp.concatenate([logits, jax.random.normal(key, (b, 4, E))], axis=1)
    masked = route_jit(padded, 2, t, jnp.arange(t + 4) < t)
    chex.assert_trees_all_close(masked.aux, routing.aux, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(masked.slot[:, :t]), np.asarray(routing.slot))
    assert (np.asarray(masked.slot[:, t:]) == E * t).all()


def test_moe_module_validates_arguments() -> None:
    with pytest.raises(ValueError, match="top_k=3"):
        MoE(8, 8, 2, top_k=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(8, 8, 2, capacity_factor=0.0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="moe_top_k"):
        preset("tiny", moe_experts=2, moe_top_k=3)
    mesh = gtp_jax.make_mesh(ep=4, gtp=2)
    cfg = preset("tiny", d_model=48, n_heads=3, d_ff=64, n_layers=1, moe_experts=6)
    with pytest.raises(ValueError, match=r"w_in.*6 experts, not divisible by ep=4"):
        gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)), mesh)


# --------------------------------------------------------------------------- sharded model

MOE = preset("tiny", d_model=48, n_heads=3, d_ff=64, vocab_size=61, n_layers=2,
             moe_experts=4, moe_d_ff=32, moe_aux_weight=0.1, moe_top_k=2,
             moe_capacity_factor=0.5)
# 2 of 4 experts per token and capacity 5 of 17 tokens: many choices are dropped, so the
# sharded model must drop exactly the tokens the unsharded one drops (dropless and top-1
# routing are covered against the dense reference above). Both cases share one reference.
MOE_CASES = [
    ({"ep": 2, "gtp": 2, "tp": 2}, True),  # ep x gtp x tp, ring overlap on the dense parts
    ({"ep": 4, "gtp": 2}, False),  # ep x gtp
]


@pytest.mark.parametrize("mesh_sizes,overlap", MOE_CASES, ids=["ep2_gtp2_tp2", "ep4_gtp2"])
def test_moe_transformer_matches_unsharded_over_steps(mesh_sizes, overlap, seed) -> None:
    cfg = preset("tiny", **{**MOE.__dict__, "tp_overlap": overlap})
    assert expert_capacity(17, 4, 2, 0.5) == 5
    run_case(mesh_sizes, cfg, 17, seed % 1000)


def test_expert_weights_gathered_and_reduce_scattered_once_per_layer() -> None:
    """One all-gather moves all of a layer's local experts of a projection (not one per
    expert), on the d_model dim; one reduce-scatter returns their gradient.

    Lowered StableHLO of loss + grad with the plain layer loop: the scanned forward body
    and the scanned backward body each hold one gather per stacked weight (the unrolled
    loop, one per layer in each pass: checked in test_unrolled_loop.py).
    """
    mesh = gtp_jax.make_mesh(ep=2, gtp=2, tp=2)
    cfg = dataclasses.replace(MOE, unroll_layers=False)
    # One collective per weight, so that each projection's gather can be read by its shape
    # (one per layer, the default, flattens every weight into one buffer: no per-expert
    # collective can exist there; tests/test_coalesce.py checks that form).
    sm = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)), mesh,
                       gtp_jax.GTPConfig(min_elements=0, coalesce_layer_collectives=False))
    plans = {p.path: p for p in sm.plan}
    w_in = plans["blocks/mlp/w_in"].spec
    w_out = plans["blocks/mlp/w_out"].spec
    local = MOE.moe_experts // 2
    assert w_in.logical_shape == (local, 48, 32) and w_in.shard_dim == 1
    assert w_out.logical_shape == (local, 16, 48) and w_out.shard_dim == 2
    graphdef, state = nnx.split(sm)
    tokens = jax.device_put(jnp.zeros((4, 17), jnp.int32), gtp_jax.data_sharding(mesh))
    text = jax.jit(jax.grad(lambda s, t: lm_loss(nnx.merge(graphdef, s), t))).lower(
        state, tokens).as_text()

    def ops(name: str) -> list[tuple[str, str]]:
        # (operand type, result type); reduce_scatter spans lines (its reduction region).
        pattern = rf'"stablehlo\.{name}"\(.*?:\s*\((tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)'
        return re.findall(pattern, text, flags=re.S)

    def t(shape) -> str:
        return "tensor<" + "x".join(map(str, shape)) + "xf32>"

    gathers, scatters = ops("all_gather"), ops("reduce_scatter")
    for spec in (w_in, w_out):
        assert gathers.count((t(spec.shard_shape), t(spec.logical_shape))) == 2, gathers
        assert scatters.count((t(spec.logical_shape), t(spec.shard_shape))) == 1, scatters
        # nothing of one expert's shape is gathered
        assert not any(out == t(spec.logical_shape[1:]) for _, out in gathers)


def test_the_progress_line_shows_the_routing_dropped(capsys) -> None:
    from gtp_jax.train.cli.command import main as cli_main

    run = ["train", "--steps", "2", "--batch", "8", "--seq", "32", "--layers", "2",
           "--moe-experts", "4", "--log-every", "1"]
    assert cli_main([*run, "--moe-capacity", "0.5"]) == 0
    err = capsys.readouterr().err
    shown = [float(line.split("dropped ")[1].split("%")[0]) for line in err.splitlines()
             if "dropped " in line]
    assert shown and all(0 < x < 100 for x in shown), err
    assert cli_main([*run, "--moe-capacity", "0"]) == 0  # dropless
    assert "dropped 0.0%" in capsys.readouterr().err
