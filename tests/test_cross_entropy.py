"""The decoder's cross-entropy equals optax's, in value and gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gtp_jax.models.cross_entropy import cross_entropy


def _optax(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()


@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_matches_optax(dtype, rtol) -> None:
    # Same math; fp32 differs by summation order only. In bf16 both read the same bf16
    # logits, but the gradient is rounded to bf16 (8 mantissa bits): relative 2^-8 per
    # element, so 1e-2 of the largest gradient entry.
    k1, k2 = jax.random.split(jax.random.key(0))
    logits = (3 * jax.random.normal(k1, (2, 7, 50))).astype(dtype)
    labels = jax.random.randint(k2, (2, 7), 0, 50)
    value, grad = jax.value_and_grad(cross_entropy)(logits, labels)
    ref_value, ref_grad = jax.value_and_grad(_optax)(logits, labels)
    assert value.dtype == jnp.float32 and grad.dtype == dtype
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    scale = float(jnp.max(jnp.abs(ref_grad.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(ref_grad, np.float32),
                               atol=rtol * scale)


def test_backward_has_no_scatter() -> None:
    logits = jnp.zeros((2, 5, 11))
    labels = jnp.zeros((2, 5), jnp.int32)
    text = jax.jit(jax.grad(cross_entropy)).lower(logits, labels).as_text()
    assert "scatter" not in text
    assert "scatter" in jax.jit(jax.grad(_optax)).lower(logits, labels).as_text()
