"""The decoder's elementwise pieces against their plain-JAX definitions."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
