"""The decoder's vocabulary-parallel embedding and head (`gtp_jax.parallel.vocab`).

Where the mesh allows it (GTP over several ranks, the innermost data axis, no tp or cp) the
embedding and the output head read their own vocabulary slice and move activations: the
logits and the loss equal the unsharded model's (float32: a few ulps, the vocabulary sums
are split), on vocabularies that divide the axis and that do not, tied and untied, and no
vocabulary-sized weight is all-gathered in the training step. Elsewhere the model keeps
gathering them. Forward, gradients and optimizer steps against the unsharded model on the
same path: tests/test_equivalence.py (dp2 x gtp4, vocabulary 250).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gtp_jax
from gtp_jax.base.axes import vocab_axis
from gtp_jax.models import Transformer, lm_loss, preset
from gtp_jax.sharding.contract import OutputLayout

FP32_RTOL = 1e-5


def _models(vocab: int, tie: bool, **mesh_sizes):
    cfg = preset("tiny", vocab_size=vocab, tie_embeddings=tie, n_layers=2)
    mesh = gtp_jax.make_mesh(**mesh_sizes)
    return (Transformer(cfg, rngs=nnx.Rngs(3)),
            gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(3)), mesh), mesh)


@pytest.mark.parametrize("vocab,tie", [(256, False), (250, True)], ids=["256", "250-tied"])
def test_logits_and_loss_equal_the_unsharded_model(vocab: int, tie: bool) -> None:
    ref, sm, mesh = _models(vocab, tie, dp=2, gtp=4)
    assert vocab_axis(mesh) == "gtp"
    toks = jax.random.randint(jax.random.key(vocab), (8, 13), 0, vocab)
    out, want = sm(toks[:, :-1]).logits, ref(toks[:, :-1]).logits
    assert out.shape == want.shape
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=FP32_RTOL * scale)
    np.testing.assert_allclose(float(lm_loss(sm, toks)), float(lm_loss(ref, toks)),
                               rtol=FP32_RTOL)


def test_the_training_step_gathers_no_vocabulary_sized_weight() -> None:
    _, sm, _ = _models(256, False, dp=2, gtp=4)
    toks = jax.random.randint(jax.random.key(0), (8, 9), 0, 256)
    graphdef, state = nnx.split(sm)

    def grads(state, t):
        return nnx.grad(lm_loss)(nnx.merge(graphdef, state), t)

    hlo = jax.jit(grads).lower(state, toks).compile().as_text()
    gathered = re.findall(r"= (\w+\[[\d,]*\])[^=]*? all-gather\(", hlo)
    sizes = [tuple(int(d) for d in re.findall(r"\d+", s.split("[")[1])) for s in gathered]
    assert sizes, "the step gathers the layers' weights"
    assert not [s for s in sizes if 256 in s], sizes  # no [256, d] or [d, 256] gather


@pytest.mark.parametrize("sizes", [dict(dp=1, gtp=4, tp=2), dict(gtp=8, dp=1, ep=1)],
                         ids=["tp2", "gtp8"])
def test_the_split_applies_only_where_the_mesh_allows_it(sizes: dict) -> None:
    ref, sm, mesh = _models(256, False, **sizes)
    toks = jax.random.randint(jax.random.key(1), (8, 9), 0, 256)
    out, want = sm(toks).logits, ref(toks).logits
    np.testing.assert_allclose(np.asarray(out), np.asarray(want),
                               atol=FP32_RTOL * float(jnp.max(jnp.abs(want))))
    layout = sm.module.gtp_output_layout(mesh, toks)
    if sizes.get("tp", 1) > 1:
        assert vocab_axis(mesh) is None and (layout is None or layout.vocab is None)
    else:
        assert layout.vocab == "gtp"


def test_a_vocabulary_split_the_mesh_cannot_have_is_refused() -> None:
    class Wrong(nnx.Module):
        def __init__(self):
            self.w = nnx.Linear(16, 16, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.w(x)

        def gtp_output_layout(self, mesh, x):
            return OutputLayout(jax.sharding.PartitionSpec(("dp", "gtp")), vocab="dp")

    sm = gtp_jax.shard(Wrong(), gtp_jax.make_mesh(dp=2, gtp=4),
                       gtp_jax.GTPConfig(min_elements=1))
    with pytest.raises(gtp_jax.UsageError, match="vocabulary split over 'dp'"):
        sm(jnp.ones((8, 16)))
