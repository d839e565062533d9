"""`GTPConfig(coalesce_layer_collectives=True)`: one all-gather and one reduce-scatter per
layer (and dtype) instead of one per weight, with the per-weight collectives' results.

The gathers move bits, so the gathered weights are the same bits as one all-gather per
weight; the reduce-scatters sum the same shards, so training matches the per-weight run to
float32 rounding (over gtp = 4 a sum may add its four shards in another order). Sizes do
not divide the axis (padded weights), and weights are sharded on different dims.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_same_runs, train_and_record
from jax.sharding import PartitionSpec as P

import gtp_jax
from gtp_jax.models import Transformer, lm_loss, preset
from gtp_jax.sharding.collectives import all_gather_shards, reduce_scatter_grads
from gtp_jax.sharding.gather_spec import GatherSpec

CFG = preset("tiny", d_model=54, n_heads=3, d_ff=70, vocab_size=61, n_layers=2)


def _spec(shape: tuple[int, ...], dim: int, n: int, coalesce: bool) -> GatherSpec:
    padded = -(-shape[dim] // n) * n
    return GatherSpec(axis="gtp", axis_size=n, shard_dim=dim, logical_shape=shape,
                      padded_size=padded, param_dtype=np.dtype("float32"), gather_dtype=None,
                      reduce_dtype=np.dtype("float32"), coalesce=coalesce)


@pytest.mark.parametrize("gather_dtype", [None, jnp.bfloat16])
def test_one_gather_and_one_reduce_scatter_give_the_per_weight_bits(key, gather_dtype):
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    shapes = [((10, 7), 0), ((6, 9), 1), ((3, 5, 8), 2), ((12,), 0)]
    specs = {c: [_spec(s, d, 4, c) for s, d in shapes] for c in (False, True)}
    if gather_dtype is not None:
        specs = {c: [s.__class__(**{**s.__dict__, "gather_dtype": np.dtype(gather_dtype)})
                     for s in v] for c, v in specs.items()}
    keys = jax.random.split(key, 2 * len(shapes))
    stored = [jax.random.normal(k, s.padded_shape) for k, s in zip(keys, specs[False])]
    grads = [jax.random.normal(k, s.logical_shape)
             for k, s in zip(keys[len(shapes):], specs[False])]
    in_specs = [P(*([None] * s.shard_dim + ["gtp"])) for s in specs[False]]

    def run(coalesce: bool):
        def body(shards, gs):
            return (all_gather_shards(shards, specs[coalesce]),
                    reduce_scatter_grads(gs, specs[coalesce]))
        f = jax.shard_map(body, mesh=mesh, in_specs=(in_specs, [P()] * len(shapes)),
                          out_specs=([P()] * len(shapes), in_specs), check_vma=False)
        return jax.jit(f)(stored, grads)

    (g0, r0), (g1, r1) = run(False), run(True)
    for a, b in zip(g0 + r0, g1 + r1):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))

    text = jax.jit(jax.shard_map(
        lambda s, g: (all_gather_shards(s, specs[True]), reduce_scatter_grads(g, specs[True])),
        mesh=mesh, in_specs=(in_specs, [P()] * len(shapes)),
        out_specs=([P()] * len(shapes), in_specs), check_vma=False)).lower(
            stored, grads).as_text()
    assert len(re.findall(r"stablehlo\.all_gather", text)) == 1  # one for the four weights
    assert len(re.findall(r"stablehlo\.reduce_scatter", text)) == 1


@pytest.mark.parametrize("axes,unroll,config", [
    ({"dp": 2, "gtp": 4}, True, {}),
    ({"dp": 2, "gtp": 4}, False, {"prefetch": True}),
    ({"dp": 2, "gtp": 2, "tp": 2}, True, {}),
    # fp8 gathers keep their own collectives; their gradients join the layer's one
    # reduce-scatter
    ({"dp": 2, "gtp": 4}, True, {"gather_format": "fp8", "keep_gathered_layers": True}),
], ids=["unrolled", "scanned_prefetch", "tp2_unrolled", "fp8_gathers_kept"])
def test_a_decoder_trains_as_with_one_collective_per_weight(key, seed, axes, unroll,
                                                            config):
    mesh = gtp_jax.make_mesh(**axes)
    tokens = [jax.random.randint(jax.random.fold_in(key, i), (8, 17), 0, CFG.vocab_size)
              for i in range(2)]

    def run(coalesce: bool):
        cfg = preset("tiny", **{**CFG.__dict__, "unroll_layers": unroll, "remat": "dots"})
        model = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(seed)), mesh,
                              gtp_jax.GTPConfig(**config, min_elements=0,
                                                coalesce_layer_collectives=coalesce))
        return train_and_record(model, tokens, mesh)

    assert_same_runs(run(False), run(True))


def test_the_layer_loop_gathers_and_reduce_scatters_once_per_layer(key):
    mesh = gtp_jax.make_mesh(gtp=8)
    tokens = jax.random.randint(key, (8, 16), 0, CFG.vocab_size)

    def counts(coalesce: bool) -> tuple[int, int]:
        cfg = preset("tiny", **{**CFG.__dict__, "unroll_layers": True})
        model = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)), mesh,
                              gtp_jax.GTPConfig(coalesce_layer_collectives=coalesce))

        @nnx.jit
        def grads(m, t):
            return nnx.grad(lambda m: lm_loss(m, t))(m)

        text = grads.lower(model, tokens).as_text()
        return (len(re.findall(r"stablehlo\.all_gather", text)),
                len(re.findall(r"stablehlo\.reduce_scatter", text)))

    (ag0, rs0), (ag1, rs1) = counts(False), counts(True)
    # Each layer has four sharded weights (qkv, out, gate_up, down), gathered in the forward
    # pass and again in the backward pass, their gradients reduce-scattered: 2 * 4 gathers
    # and 4 reduce-scatters per layer become 2 and 1. The embedding and the output head,
    # outside the loop, keep theirs.
    layers, weights = CFG.n_layers, 4
    assert ag0 - ag1 == 2 * layers * (weights - 1), (ag0, ag1)
    assert rs0 - rs1 == layers * (weights - 1), (rs0, rs1)


def test_the_setting_is_checked():
    with pytest.raises(gtp_jax.UsageTypeError, match="coalesce_layer_collectives"):
        gtp_jax.GTPConfig(coalesce_layer_collectives="yes")
