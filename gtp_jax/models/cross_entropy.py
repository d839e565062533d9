"""Next-token cross-entropy whose backward pass is one elementwise pass over the logits.

Autodiff of ``take_along_axis(log_softmax(logits), labels)`` scatter-adds the label term
into a zero tensor the size of the logits and adds the softmax term in a second pass; here
the gradient ``(softmax(logits) - onehot(labels)) * g / n`` is formed in one fusion from the
saved logits and the per-token log-sum-exp, with the one-hot term written as a comparison
against an iota (no scatter). The logits are read in their own dtype and upcast inside the
reductions, so no float32 copy of the ``[tokens, vocab]`` tensor is kept for the backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy over all positions, float32.

    Args:
      logits: ``[..., vocab]`` in any floating dtype (e.g. bfloat16).
      labels: int ``[...]`` (the leading shape of `logits`), values in ``[0, vocab)``.

    Returns:
      float32 scalar: ``mean(logsumexp(logits) - logits[label])``; equal to
      ``optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()`` up to
      float32 rounding.
    """
    return _cross_entropy(logits, labels)


def _lse(logits: jax.Array) -> jax.Array:
    x = logits.astype(jnp.float32)
    top = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return (top + jnp.log(jnp.sum(jnp.exp(x - top), axis=-1, keepdims=True)))[..., 0]


def _picked(logits: jax.Array, labels: jax.Array) -> jax.Array:
    # A masked sum (one nonzero term: exact) rather than take_along_axis, so that logits
    # split over the vocabulary (a vocabulary-parallel head) reduce where they live.
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = vocab == labels[..., None].astype(jnp.int32)
    return jnp.sum(jnp.where(hit, logits.astype(jnp.float32), 0.0), axis=-1)


@jax.custom_vjp
def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(_lse(logits) - _picked(logits, labels))


def _cross_entropy_fwd(logits: jax.Array, labels: jax.Array):
    lse = _lse(logits)
    return jnp.mean(lse - _picked(logits, labels)), (logits, labels, lse)


def _cross_entropy_bwd(res, g):
    logits, labels, lse = res
    scale = g / lse.size
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    probs = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    onehot = (vocab == labels[..., None].astype(jnp.int32)).astype(jnp.float32)
    dlogits = ((probs - onehot) * scale).astype(logits.dtype)
    return dlogits, None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)
