"""Layer-stacked GTP shards' gradients summed over the data axes inside the layer loop
(`gtp_jax.sharding.data_view`): the same gradients, to the bit, as the sum ``shard_map``
makes where the sharded call ends. The schedule side (one all-reduce per layer, beside a
layer's matmuls): `tests/test_loop_schedule.py`; the memory side: `tests/test_loop_memory.py`.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import get_mesh

import gtp_jax
import gtp_jax.sharding.module as sharded_module
from gtp_jax.models import Transformer, lm_loss, preset
from gtp_jax.sharding.data_view import unmentioned_axes


def _grads(mesh_name: str, unroll: bool, tokens: jax.Array) -> list[np.ndarray]:
    cfg = preset("tiny", n_layers=3, d_model=96, n_heads=4, d_ff=200, vocab_size=250,
                 unroll_layers=unroll)
    mesh = get_mesh(mesh_name)
    model = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)), mesh,
                          gtp_jax.GTPConfig(prefetch=not unroll))
    graphdef, state = nnx.split(model)
    tokens = jax.device_put(tokens, gtp_jax.data_sharding(mesh))
    grads = jax.jit(jax.grad(lambda s, t: lm_loss(nnx.merge(graphdef, s), t)))(state, tokens)
    return [np.asarray(g) for g in jax.tree.leaves(grads)]


@pytest.mark.parametrize("mesh_name", ["dp2_gtp4", "dp2_gtp2_tp2", "dp8_gtp1"])
@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "scanned-prefetch"])
def test_gradients_summed_in_the_loop_equal_the_boundarys_sum_bit_for_bit(
        monkeypatch, key, mesh_name, unroll):
    tokens = jax.random.randint(key, (8, 17), 0, 250)
    in_loop = _grads(mesh_name, unroll, tokens)
    # The same model with every weight's data-axis sum left to shard_map's transpose.
    monkeypatch.setattr(sharded_module, "unmentioned_axes", lambda mesh, spec: ())
    at_boundary = _grads(mesh_name, unroll, tokens)
    assert len(in_loop) == len(at_boundary)
    for a, b in zip(in_loop, at_boundary):
        np.testing.assert_array_equal(a, b)


def test_the_axes_summed_are_those_the_spec_does_not_name():
    mesh = get_mesh("dp2_gtp2_tp2")
    P = jax.sharding.PartitionSpec
    assert unmentioned_axes(mesh, P(None, "gtp", "tp")) == ("dp",)
    assert unmentioned_axes(mesh, P(None, ("gtp", "tp"))) == ("dp",)
    assert unmentioned_axes(get_mesh("gtp8"), P(None, "gtp")) == ()
