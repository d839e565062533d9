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
  ``[..., f]`` gradients joined by a concatenate: one Pallas kernel on a GPU
  (`gtp_jax.pallas.swiglu_bwd`), one XLA fusion elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gtp_jax.pallas.swiglu import check_backend, swiglu_bwd


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


def swiglu(gate_up: jax.Array, *, backend: str | None = None) -> jax.Array:
    """``silu(gate) * up`` of a fused projection output ``gate_up = [gate | up]``.

    Args:
      gate_up: ``[..., 2 * f]``, any float dtype: the gate in the first ``f`` features, up
        in the last ``f``.
      backend: who computes the backward pass (`gtp_jax.pallas.swiglu_bwd`): "pallas" (one
        Triton kernel), "reference" (one XLA fusion), or None (the kernel on a GPU where
        the shape tiles, else the reference).

    Returns:
      ``[..., f]`` in the dtype of `gate_up` (computed in float32).
    """
    check_backend(backend, "swiglu")
    return _swiglu(gate_up, backend)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _swiglu(gate_up: jax.Array, backend: str | None) -> jax.Array:
    f = gate_up.shape[-1] // 2
    x = gate_up.astype(jnp.float32)
    return (jax.nn.silu(x[..., :f]) * x[..., f:]).astype(gate_up.dtype)


def _swiglu_fwd(gate_up: jax.Array, backend: str | None) -> tuple[jax.Array, jax.Array]:
    return _swiglu(gate_up, backend), gate_up


def _swiglu_bwd(backend: str | None, gate_up: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    # one pass that writes the whole [..., 2 * f] gradient: no concatenate of two halves
    return (swiglu_bwd(gate_up, g, backend=backend),)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
