"""The decoder's elementwise pieces against their plain-JAX definitions."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gtp_jax import pallas
from gtp_jax.models.elementwise import apply_rope, swiglu
from gtp_jax.models.transformer import rope_tables


def _rope_concat(x, cos, sin):
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _swiglu_split(gate_up):
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(gate_up.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_equals_the_concatenate_form(dtype):
    x = jax.random.normal(jax.random.key(0), (2, 12, 3, 16)).astype(dtype)
    cos, sin = rope_tables(12, 16, 10000.0)
    got, want = apply_rope(x, cos, sin), _rope_concat(x, cos, sin)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    # the flip and sign are exact: only fused multiply-adds may round differently
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-6 if dtype == jnp.float32 else 1e-2, atol=1e-6)
    g = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
    dx = jax.grad(lambda x: jnp.sum(apply_rope(x, cos, sin).astype(jnp.float32) * g))(
        x.astype(jnp.float32))
    dx_ref = jax.grad(lambda x: jnp.sum(_rope_concat(x, cos, sin) * g))(x.astype(jnp.float32))
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_swiglu_value_and_gradient_equal_autodiff(dtype, rtol):
    # f = 24 (not a power of two) and three leading dims, as in [batch, seq, 2f]
    gu = (2.0 * jax.random.normal(jax.random.key(2), (2, 5, 48))).astype(dtype)
    g = jax.random.normal(jax.random.key(3), (2, 5, 24)).astype(dtype)
    out, vjp = jax.vjp(swiglu, gu)
    out_ref, vjp_ref = jax.vjp(_swiglu_split, gu)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, out_ref)
    (d,), (d_ref,) = vjp(g), vjp_ref(g)
    chex.assert_trees_all_equal_shapes_and_dtypes(d, d_ref)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_ref, np.float32),
                               rtol=rtol, atol=rtol)
    np.testing.assert_allclose(np.asarray(d, np.float32), np.asarray(d_ref, np.float32),
                               rtol=rtol, atol=rtol)


def test_swiglu_backward_and_rope_have_no_concatenate():
    def ops(fn, x):
        hlo = jax.jit(jax.grad(fn)).lower(x).as_text(dialect="hlo")
        return {line.split("=", 1)[1].split("(")[0].split()[-1]
                for line in hlo.splitlines() if " = " in line}

    gu = jnp.ones((4, 8, 64), jnp.bfloat16)
    assert "concatenate" not in ops(lambda x: swiglu(x).astype(jnp.float32).sum(), gu)
    cos, sin = rope_tables(8, 16, 10000.0)
    x = jnp.ones((2, 8, 3, 16), jnp.bfloat16)
    rope_ops = ops(lambda x: apply_rope(x, cos, sin).astype(jnp.float32).sum(), x)
    assert "concatenate" not in rope_ops and "multiply" in rope_ops


@pytest.mark.parametrize("shape,dtype,rtol", [
    ((2, 8, 2 * 192), jnp.bfloat16, 1e-2),   # f = 192: 64-wide column tiles
    ((3, 5, 2 * 128), jnp.float32, 1e-6),    # 15 rows: one-row tiles
    ((16, 2 * 1024), jnp.float16, 1e-3),     # f = 1024: 512-wide tiles, two per row
])
def test_swiglu_kernel_equals_reference_and_autodiff(shape, dtype, rtol):
    # The kernel (Pallas interpreter on CPU: the same body as on the GPU) against the
    # pure-JAX reference and against autodiff of the split form. Both compute in float32
    # from the same inputs, so they differ by float32 rounding only (then cast to dtype).
    gu = (3.0 * jax.random.normal(jax.random.key(4), shape)).astype(dtype)
    g = jax.random.normal(jax.random.key(5), (*shape[:-1], shape[-1] // 2)).astype(dtype)
    got = pallas.swiglu_bwd(gu, g, backend="pallas", interpret=True)
    ref = pallas.swiglu_bwd_reference(gu, g)
    (auto,) = jax.vjp(_swiglu_split, gu)[1](g)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, ref, auto)
    for want in (ref, auto):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=rtol, atol=rtol)


def test_swiglu_model_gradient_through_the_kernel():
    # A whole decoder's gradient with the kernel (interpreted) in every MLP equals the one
    # with the XLA reference: fp32, so up to float32 rounding.
    from flax import nnx

    from gtp_jax.models import Transformer, lm_loss, preset

    tokens = jax.random.randint(jax.random.key(6), (2, 9), 0, 250)

    def grads(backend):
        cfg = preset("tiny", d_model=64, n_heads=4, d_ff=128, vocab_size=250, n_layers=1,
                     swiglu_backend=backend)
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        return nnx.state(nnx.jit(nnx.grad(lm_loss))(model, tokens), nnx.Param)

    got = grads("pallas")  # interpreted off a GPU
    want = grads("reference")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_swiglu_bad_input_is_refused():
    gu = jnp.ones((4, 2 * 40), jnp.float32)
    with pytest.raises(ValueError, match="power-of-two divisor"):  # f = 40: no tile
        pallas.swiglu_bwd(gu, jnp.ones((4, 40)), backend="pallas", interpret=True)
    with pytest.raises(ValueError, match=r"g \(4, 41\)"):
        pallas.swiglu_bwd(gu, jnp.ones((4, 41)))
    with pytest.raises(TypeError, match="gate_up must be a float"):
        pallas.swiglu_bwd(jnp.ones((4, 80), jnp.int32), jnp.ones((4, 40)))
    with pytest.raises(ValueError, match="backend='cuda'"):
        swiglu(gu, backend="cuda")
    with pytest.raises(ValueError, match="swiglu_backend"):
        from gtp_jax.models import preset
        preset("tiny", swiglu_backend="triton")
    # f = 40 falls back to the reference when the backend is left to choose
    np.testing.assert_array_equal(pallas.swiglu_bwd(gu, jnp.ones((4, 40))),
                                  pallas.swiglu_bwd_reference(gu, jnp.ones((4, 40))))


def test_dots_policy_saves_attention_inputs_not_the_qkv_projection():
    # remat="dots" keeps q and k after rotary and v (the attention's inputs) for the
    # backward pass, and so not the [batch, seq, 3, heads, head_dim] projection output they
    # come from: same bytes, and rotary is not run again in the backward pass.
    import contextlib
    import io

    from flax import nnx

    from gtp_jax.models import Transformer, preset
    from gtp_jax.models.transformer import ATTENTION_INPUTS, save_dots_and_attention

    cfg = preset("tiny", d_model=64, n_heads=4, d_ff=128, n_layers=1, dtype=jnp.bfloat16)
    graphdef, stacked = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)).blocks)
    layer = jax.tree.map(lambda x: x[0], stacked)
    cos, sin = rope_tables(16, 16, 10000.0)

    def f(x, params):
        return nnx.merge(graphdef, params)(x, cos, sin, None)[0].astype(jnp.float32).sum()

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(
            jax.checkpoint(f, policy=save_dots_and_attention),
            jnp.ones((2, 16, 64), jnp.bfloat16), layer)
    lines = out.getvalue().splitlines()
    for name in ATTENTION_INPUTS:
        assert any(f"bf16[2,16,4,16] named '{name}'" in line for line in lines), lines
    assert not any(line.startswith("bf16[2,16,3,4,16]") for line in lines), lines
