"""The flash-attention block kernels of ring attention (`gtp_jax.pallas.attention_block`)
against their pure-JAX references, in the Pallas interpreter on CPU (the kernel bodies are
the code that runs on GPUs), alone, inside the ring and inside the decoder.

Tolerances: the kernels and the references both take float32 scores and a float32
softmax, and round the probabilities to the input dtype before ``p @ v``; the kernels do it
relative to a running row maximum (per key tile) instead of the row's final maximum, so
the rounded probabilities differ by up to one bf16 ulp (2^-8 relative): outputs and
gradients agree to ~1% of their largest value in bf16 (``BF16_TOL``), the log-sum-exp
(float32 throughout) to float32 rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import max_rel_err, sharded_logits_and_grads
from jax.sharding import PartitionSpec as P

import gtp_jax
from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.models import Transformer, TransformerConfig, lm_loss
from gtp_jax.pallas.flash_block import (
    BlockTiles,
    attention_block,
    attention_block_bwd,
    attention_block_bwd_reference,
    attention_block_reference,
    supported,
)
from gtp_jax.parallel.context import ring_attention, zigzag_merge, zigzag_split
from gtp_jax.train import replicate_stray_leaves

BF16_TOL = 1.5e-2
LSE_TOL = 1e-5
#: small tiles so that the interpreter runs several tiles per block quickly
TILES = BlockTiles(fwd_q=16, fwd_k=8, dkv_k=16, dkv_q=8, dq_q=16, dq_k=8)


def _inputs(key, b, sq, sk, h, h_kv, d, dtype):
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (b, sq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, sk, h_kv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, sk, h_kv, d), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, sq, h, d), jnp.float32).astype(dtype)
    return q, k, v, do


CASES = [
    # (b, sq, sk, h, h_kv, d, causal, kv_len)
    (2, 32, 32, 4, 4, 16, True, None),      # diagonal block
    (1, 32, 64, 4, 2, 32, False, None),     # sq != sk, grouped-query attention
    (2, 64, 32, 2, 1, 16, False, 21),       # padding: keys >= 21 hidden, mid-tile
    (1, 32, 32, 2, 2, 16, True, 13),        # causal and padding
    (1, 32, 32, 2, 2, 16, False, 0),        # no visible key: out 0, lse -inf
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_q{}_k{}_h{}/{}_d{}_c{}_len{}".format(*c))
def test_kernels_match_reference(case, dtype):
    b, sq, sk, h, h_kv, d, causal, kv_len = case
    q, k, v, do = _inputs(jax.random.key(sq + sk + h), b, sq, sk, h, h_kv, d, jnp.dtype(dtype))
    kw = dict(causal=causal, scale=d ** -0.5)

    # kv_len traced (as in the ring, where it comes from the block's positions)
    @jax.jit
    def both(q, k, v, do, kv_len):
        out, lse = attention_block(q, k, v, kv_len=kv_len, backend="pallas", tiles=TILES,
                                   interpret=True, **kw)
        r_out, r_lse = attention_block_reference(q, k, v, kv_len=kv_len, **kw)
        delta = jnp.sum(do.astype(jnp.float32) * r_out, -1)
        grads = attention_block_bwd(q, k, v, do, r_lse, delta, kv_len=kv_len,
                                    backend="pallas", tiles=TILES, interpret=True, **kw)
        r_grads = attention_block_bwd_reference(q, k, v, do, r_lse, delta, kv_len=kv_len, **kw)
        return (out, lse, *grads), (r_out, r_lse, *r_grads)

    got, want = both(q, k, v, do, None if kv_len is None else jnp.int32(kv_len))
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_shape(got[0], (b, sq, h, d))
    chex.assert_shape(got[1], (b, sq, h))
    chex.assert_shape(got[3], (b, sk, h_kv, d))
    out, lse = got[:2]
    r_out, r_lse = want[:2]
    # rows that see nothing: exactly 0 and -inf, as the block_fn contract says
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
    assert bool(jnp.all(jnp.isfinite(out)))
    finite = jnp.isfinite(r_lse)
    assert float(jnp.max(jnp.abs(jnp.where(finite, lse - r_lse, 0.0)))) <= LSE_TOL * (
        1 + float(jnp.max(jnp.where(finite, jnp.abs(r_lse), 0.0))))
    for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *got[2:]), (r_out, *want[2:])):
        assert bool(jnp.all(jnp.isfinite(g))), name
        assert max_rel_err(g, r) <= BF16_TOL, f"{name}: {max_rel_err(g, r):.2e}"
    if kv_len == 0:
        assert bool(jnp.all(out == 0)) and all(bool(jnp.all(g == 0)) for g in got[2:])


def test_supported_and_backend_choice():
    q, k = (1, 256, 2, 64), (1, 128, 2, 64)
    assert supported(q, k, jnp.bfloat16) is None
    assert "float32" in supported(q, k, jnp.float32)
    assert "head_dim 48" in supported((1, 256, 2, 48), (1, 128, 2, 48), jnp.bfloat16)
    assert "sk=96" in supported(q, (1, 96, 2, 64), jnp.bfloat16)
    assert supported((1, 32, 2, 16), (1, 32, 2, 16), jnp.bfloat16, TILES) is None
    # None on a CPU: the reference, whatever the shape
    x = jnp.ones((1, 32, 2, 16), jnp.float32)
    out, _ = attention_block(x, x, x, causal=True, kv_len=None, scale=0.25)
    ref, _ = attention_block_reference(x, x, x, causal=True, kv_len=None, scale=0.25)
    np.testing.assert_array_equal(out, ref)


def test_bad_input_is_refused():
    x = jnp.ones((1, 32, 2, 16), jnp.float32)
    kw = dict(causal=True, kv_len=None, scale=0.25)
    with pytest.raises(UsageError, match="backend='cuda'"):
        attention_block(x, x, x, backend="cuda", **kw)
    with pytest.raises(UsageError, match="float32.*use backend=None"):
        attention_block(x, x, x, backend="pallas", **kw)
    with pytest.raises(UsageError, match="sq=32"):
        attention_block_bwd(*(x.astype(jnp.bfloat16),) * 4, x[..., 0], x[..., 0],
                            backend="pallas", **kw)
    with pytest.raises(UsageTypeError, match="tiles must be a BlockTiles"):
        attention_block(x, x, x, tiles=(16, 16), **kw)
    with pytest.raises(ValueError, match="BlockTiles.fwd_q=24"):
        BlockTiles(fwd_q=24)
    with pytest.raises(ValueError, match="num_warps"):
        BlockTiles(num_warps=0)
    with pytest.raises(ValueError, match="cp_attention_backend='triton'"):
        TransformerConfig(cp_attention_backend="triton")


# --------------------------------------------------------------------------- in the ring


@pytest.mark.parametrize(("n", "seq", "valid_len"), [(2, 128, None), (4, 128, 117)])
def test_ring_with_kernels_matches_ring_with_reference(n, seq, valid_len):
    """The ring's result does not depend on which block kernels it runs (bf16, zigzag,
    causal and padded blocks, grouped-query attention), forward and gradients."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("cp",))
    q, k, v, ct = _inputs(jax.random.key(n), 2, seq, seq, 4, 2, 16, jnp.bfloat16)
    kernels = dict(
        block_fn=functools.partial(attention_block, backend="pallas", tiles=TILES,
                                   interpret=True),
        block_bwd_fn=functools.partial(attention_block_bwd, backend="pallas", tiles=TILES,
                                       interpret=True))

    def run(**kw):
        f = jax.shard_map(
            lambda q, k, v: ring_attention(q, k, v, axis="cp", valid_len=valid_len, **kw),
            mesh=mesh, in_specs=(P(None, "cp"),) * 3, out_specs=P(None, "cp"),
            check_vma=False)

        def loss(q, k, v):
            out = zigzag_merge(f(*(zigzag_split(x, n) for x in (q, k, v))), n)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

        return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)

    (_, out), grads = run(**kernels)
    (_, r_out), r_grads = run(backend="reference")
    rows = seq if valid_len is None else valid_len
    for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (r_out, *r_grads)):
        g, r = g[:, :rows], r[:, :rows]
        assert max_rel_err(g, r) <= BF16_TOL, f"{name}: {max_rel_err(g, r):.2e}"


def test_kernels_refused_under_check_vma():
    """Inside ``shard_map(check_vma=True)`` the kernels are refused by name when asked for,
    and backend=None runs the reference (the kernels' typing does not follow the check)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("cp",))
    q = jnp.ones((1, 64, 2, 16), jnp.bfloat16)

    def call(backend):
        f = jax.shard_map(lambda q: attention_block(q, q, q, causal=True, kv_len=None,
                                                    scale=0.25, backend=backend,
                                                    tiles=TILES)[0],
                          mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))
        return f(q)

    with pytest.raises(UsageError, match="check_vma=False"):
        call("pallas")
    np.testing.assert_array_equal(call(None), call("reference"))


# --------------------------------------------------------------------------- in the decoder


def test_decoder_with_kernels_matches_reference_kernels_and_trains():
    """A bf16 decoder over cp=2 (interpreted kernels, default tiles: each zigzag chunk is
    128 tokens): logits and every weight gradient match the same sharded model with the
    reference block kernels (itself checked against the unsharded model in
    test_context_parallel.py), and AdamW steps on one batch track the unsharded model."""
    base = TransformerConfig(vocab_size=64, d_model=64, n_heads=4, n_layers=1, d_ff=128,
                             max_seq_len=512, dtype=jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(3), (2, 513), 0, base.vocab_size)
    mesh = gtp_jax.make_mesh(cp=2, devices=jax.devices()[:2])

    def logits_and_grads(backend):
        cfg = dataclasses.replace(base, cp_attention_backend=backend)
        return sharded_logits_and_grads(cfg, mesh, tokens[:, :-1])

    logits, grads = logits_and_grads("pallas")
    r_logits, r_grads = logits_and_grads("reference")
    assert max_rel_err(logits, r_logits) <= BF16_TOL
    assert set(grads) == set(r_grads)
    for name in grads:
        err = max_rel_err(grads[name], r_grads[name])
        assert err <= 2 * BF16_TOL, f"{name}: {err:.2e}"

    def train(mesh, backend):
        cfg = dataclasses.replace(base, cp_attention_backend=backend)
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        if mesh is not None:
            model = gtp_jax.shard(model, mesh, gtp_jax.GTPConfig(min_elements=0))
        opt = nnx.Optimizer(model, optax.adamw(3e-2), wrt=nnx.Param)
        if mesh is not None:  # the step compiles once, not twice
            replicate_stray_leaves(opt, mesh)

        @nnx.jit
        def step(model, opt, t):
            loss, grads = nnx.value_and_grad(lm_loss)(model, t)
            opt.update(model, grads)
            return loss

        return [float(step(model, opt, tokens[None, 0])) for _ in range(2)]

    sharded, unsharded = train(mesh, "pallas"), train(None, None)
    # the first update lowers the loss by ~0.13; the bf16 runs agree to ~2e-3 (one bf16
    # ulp of the logits), so a lost or wrong update would show
    np.testing.assert_allclose(sharded, unsharded, atol=5e-3)
    assert sharded[1] < sharded[0] - 0.05


def test_decoder_kernel_choice_is_explicit_on_unsupported_shapes():
    """``cp_attention_backend="pallas"`` with blocks that do not tile is refused with the
    reason, not silently run on the reference."""
    cfg = dataclasses.replace(TransformerConfig(vocab_size=64, d_model=64, n_heads=4,
                                                n_layers=1, d_ff=128, max_seq_len=64,
                                                dtype=jnp.bfloat16),
                              cp_attention_backend="pallas")
    model = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)),
                          gtp_jax.make_mesh(cp=2, devices=jax.devices()[:2]),
                          gtp_jax.GTPConfig(min_elements=0))
    with pytest.raises(UsageError, match="block lengths"):
        model(jnp.zeros((1, 64), jnp.int32))


@pytest.mark.parametrize("q_shape,k_shape,v_shape,message", [
    ((128, 2, 64), (128, 2, 64), (128, 2, 64), r"q has shape \(128, 2, 64\).*rank 4"),
    ((1, 128, 2, 64), (1, 128, 2, 32), (1, 128, 2, 32), "do not fit"),
    ((1, 128, 3, 64), (1, 128, 2, 64), (1, 128, 2, 64), "must divide q's heads"),
    ((1, 128, 2, 64), (1, 128, 2, 64), (1, 64, 2, 64), "do not fit"),
])
def test_block_shapes_that_do_not_fit_are_refused(q_shape, k_shape, v_shape, message) -> None:
    q, k, v = (jnp.ones(s, jnp.bfloat16) for s in (q_shape, k_shape, v_shape))
    with pytest.raises(UsageError, match=f"attention_block: .*{message}"):
        attention_block(q, k, v, causal=True, kv_len=None, scale=0.125)


def test_config_errors_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="BlockTiles.fwd_q=48 must be a power of two"):
        BlockTiles(fwd_q=48)
    with pytest.raises(UsageError, match="TransformerConfig.cp_attention_backend='x'"):
        TransformerConfig(cp_attention_backend="x")
