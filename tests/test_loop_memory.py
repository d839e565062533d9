"""Compiled memory of the scanned layer loop under `gtp_jax.shard`'s default config.

`GTPConfig.remat_gathered=True` (the default) wraps the sharded call in a checkpoint that
re-gathers the unstacked weights (embedding, head) in the backward pass; that checkpoint must
not reach into the layer loop, whose custom VJP chooses its own residuals. When it did, the
loop's residual stacks were saved once per layer and the step's temporary memory grew with
the square of the depth. These tests read XLA's compiled memory analysis (no step runs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import get_mesh

import gtp_jax
from gtp_jax.models import Transformer, lm_loss, preset

#: Temporary memory of the default config may exceed ``remat_gathered=False``'s by this
#: factor: the only difference is re-gathering the embedding and head in the backward pass.
REMAT_GATHERED_SLACK = 1.1


def _temp_bytes(layers: int, *, remat: str, prefetch: bool, remat_gathered: bool) -> int:
    """Temporary bytes per device of the compiled gradient of the scanned decoder (tiny
    preset, bf16) on dp2 x gtp4."""
    cfg = preset("tiny", n_layers=layers, dtype=jnp.bfloat16, remat=remat,
                 unroll_layers=False)
    model = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)), get_mesh("dp2_gtp4"),
                          gtp_jax.GTPConfig(prefetch=prefetch, remat_gathered=remat_gathered))
    graphdef, state = nnx.split(model)

    def loss(state: nnx.State, tokens: jax.Array) -> jax.Array:
        return lm_loss(nnx.merge(graphdef, state), tokens)

    tokens = jax.ShapeDtypeStruct((8, 65), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(state, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_scanned_loop_memory_is_linear_in_depth_with_default_config(remat, prefetch):
    shallow = _temp_bytes(4, remat=remat, prefetch=prefetch, remat_gathered=True)
    deep = _temp_bytes(8, remat=remat, prefetch=prefetch, remat_gathered=True)
    without = _temp_bytes(8, remat=remat, prefetch=prefetch, remat_gathered=False)
    # Linear growth a + b * L doubles at most when L doubles (a >= 0); quadratic growth
    # (the residual stacks saved per layer) is about 3-4x here.
    assert deep <= 2 * shallow, (remat, prefetch, shallow, deep)
    assert deep <= REMAT_GATHERED_SLACK * without, (remat, prefetch, deep, without)
