"""The decoder's elementwise pieces, written so that XLA keeps each one a single fusion.

Both functions compute in float32 and return the input dtype. Neither splits its input
and joins the halves again: a ``concatenate`` of two halves of a large activation is a
separate copy kernel in XLA's GPU backend (it is not fused into the producers), in the
forward pass for `apply_rope` and in the backward pass for `swiglu`.

- `apply_rope` views the head dim as ``[2, head_dim // 2]`` and rotates with a ``flip``
  of that axis and a sign, so its forward and its autodiff backward are one elementwise
  pass each.
- `swiglu` takes the fused ``[..., 2 * f]`` projection output and has a custom VJP whose
  backward writes the ``[..., 2 * f]`` gradient in one pass, instead of autodiff's two
  ``[..., f]`` gradients joined by a concatenate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding of ``x: [batch, seq, heads, head_dim]`` (split-half convention).

    The first half ``x1`` and second half ``x2`` of the head dim become
    ``[x1 * cos - x2 * sin, x2 * cos + x1 * sin]``.

    Args:
      x: ``[batch, seq, heads, head_dim]``, any float dtype; ``head_dim`` even.
      cos, sin: float32 ``[seq, head_dim // 2]``.

    Returns:
      The rotated ``x``, same shape and dtype.
    """
    b, s, h, hd = x.shape
    xf = x.astype(jnp.float32).reshape(b, s, h, 2, hd // 2)
    c = cos[None, :, None, None, :]
    sn = sin[None, :, None, None, :]
    # [x1, x2] -> [-x2, x1]: the flip and the sign are exact, so this is the concatenate
    # form's arithmetic (up to where XLA contracts a multiply-add).
    sign = jnp.asarray([-1.0, 1.0], jnp.float32)[:, None]
    out = xf * c + jnp.flip(xf, axis=-2) * sign * sn
    return out.reshape(x.shape).astype(x.dtype)


@jax.custom_vjp
def swiglu(gate_up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` of a fused projection output ``gate_up = [gate | up]``.

    Args:
      gate_up: ``[..., 2 * f]``, any float dtype: the gate in the first ``f`` features, up
        in the last ``f``.

    Returns:
      ``[..., f]`` in the dtype of `gate_up` (computed in float32).
    """
    gate, up = _halves(gate_up)
    return (jax.nn.silu(gate) * up).astype(gate_up.dtype)


def _halves(gate_up: jax.Array) -> tuple[jax.Array, jax.Array]:
    f = gate_up.shape[-1] // 2
    x = gate_up.astype(jnp.float32)
    return x[..., :f], x[..., f:]


def _swiglu_fwd(gate_up: jax.Array) -> tuple[jax.Array, jax.Array]:
    return swiglu(gate_up), gate_up


def _swiglu_bwd(gate_up: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    *lead, two_f = gate_up.shape
    f = two_f // 2
    x = gate_up.astype(jnp.float32).reshape(*lead, 2, f)
    # Every output element reads its own value and its partner in the other half (a flip
    # of the size-2 axis) and computes one sigmoid: no value is shared between elements,
    # so XLA emits one loop fusion, with no float32 intermediate and no concatenate.
    is_gate = jax.lax.broadcasted_iota(jnp.int32, (2, 1), 0) == 0
    partner = jnp.flip(x, axis=-2)
    gate = jnp.where(is_gate, x, partner)
    up = jnp.where(is_gate, partner, x)
    sig = jax.nn.sigmoid(gate)
    # d/d gate = g * up * silu'(gate); d/d up = g * silu(gate)
    local = jnp.where(is_gate, up * sig * (1.0 + gate * (1.0 - sig)), gate * sig)
    grad = g.astype(jnp.float32)[..., None, :] * local
    return (grad.reshape(gate_up.shape).astype(gate_up.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
