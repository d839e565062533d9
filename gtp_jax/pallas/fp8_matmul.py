"""FP8 matmul with per-tensor current scaling: ``x [M, K] @ w [K, N]`` on e4m3 operands,
e5m2 gradients, beside its reference (`fp8_matmul_reference`).

Recipe ("tensorwise", as TransformerEngine's current scaling and torchao's float8
tensorwise): every operand is quantized with one float32 scale per tensor computed from
its own amax in the same step (`gtp_jax.pallas.formats`: ``s = fmax / amax``, saturating
cast, the fp8 format's NaN/Inf policy). The forward multiplies e4m3 ``x`` and ``w``; the
backward quantizes the output gradient to e5m2 (wider range, for gradients) and computes
``dx = dy @ w^T`` and ``dw = x^T @ dy`` from e5m2 x e4m3 operands.

Each product is written as XLA's cuBLASLt FP8 pattern: both payloads converted exactly to
bfloat16 (every e4m3 and e5m2 value is a bfloat16 value), one ``dot_general`` accumulating
in float32, and the two inverse scales applied to its float32 output. On Hopper GPUs XLA
rewrites this into one ``__cublas$lt$matmul$f8`` call; elsewhere (CPUs) it is an exact
emulation: the products of bfloat16-exact values accumulated in float32.

Residuals: the e4m3 payload of ``x`` (1 byte per element, half of bf16) and its scale,
and ``w`` itself, re-quantized in the backward pass: ``w`` is usually a gathered GTP weight,
which the layer loop and `gtp_jax.shard` never keep alive from the forward pass, and
quantizing it again costs one pass over the weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.pallas.formats import E4M3_MAX, F32_MAX, amax_reference

#: Largest finite float8_e5m2 (the gradients' format).
E5M2_MAX = float(jnp.finfo(jnp.float8_e5m2).max)
#: Input dtypes `fp8_matmul` takes (its output has the input dtype).
FP8_MATMUL_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


def _scale(amax: jax.Array, fmax: float) -> jax.Array:
    """``fmax / amax`` (float32[]; 1 for amax 0; capped at the largest finite float32;
    NaN for a non-finite amax: every element it governs becomes NaN, never a finite value)."""
    positive = amax > 0
    s = jnp.where(positive, fmax / jnp.where(positive, amax, 1.0), 1.0)
    s = jnp.minimum(s, F32_MAX)
    return jnp.where(jnp.isfinite(amax), s, jnp.nan).astype(jnp.float32)


def quantize_tensorwise(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """(payload of `dtype` (float8_e4m3fn or float8_e5m2), float32 scale ``s``) with
    ``x ~= payload / s``: per-tensor current scaling, saturating, NaN for non-finite
    elements (and for every element of a tensor whose amax is not finite)."""
    fmax = E4M3_MAX if jnp.dtype(dtype) == jnp.float8_e4m3fn else E5M2_MAX
    s = _scale(amax_reference(x), fmax)
    xf = x.astype(jnp.float32)
    v = jnp.clip(xf * s, -fmax, fmax)
    return jnp.where(jnp.isfinite(xf), v, jnp.nan).astype(dtype), s


def _product(a8: jax.Array, b8: jax.Array, dims: tuple, sa: jax.Array, sb: jax.Array,
             out_dtype: jnp.dtype) -> jax.Array:
    """``(a8 / sa) . (b8 / sb)`` over `dims` (contracting dims), in the cuBLASLt FP8 form."""
    y = jax.lax.dot_general(a8.astype(jnp.bfloat16), b8.astype(jnp.bfloat16), (dims, ((), ())),
                            preferred_element_type=jnp.float32)
    return (y * ((1.0 / sa) * (1.0 / sb))).astype(out_dtype)


def _check(x: jax.Array, w: jax.Array) -> None:
    for name, a in (("x", x), ("w", w)):
        if not hasattr(a, "dtype") or np.dtype(a.dtype) not in FP8_MATMUL_DTYPES:
            raise UsageTypeError(
                f"fp8_matmul: {name} has dtype {getattr(a, 'dtype', type(a).__name__)}; use "
                f"one of {[str(d) for d in FP8_MATMUL_DTYPES]}.")
        if a.ndim != 2:
            raise UsageError(f"fp8_matmul: {name} has shape {a.shape}; it takes 2-D operands "
                             "(reshape to [M, K] and [K, N]).")
    if x.shape[1] != w.shape[0]:
        raise UsageError(f"fp8_matmul: x {x.shape} and w {w.shape} do not contract "
                         f"(x.shape[1]={x.shape[1]} != w.shape[0]={w.shape[0]}).")


@jax.custom_vjp
def _fp8_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return _fwd(x, w)[0]


def _fwd(x, w):
    x8, sx = quantize_tensorwise(x, jnp.float8_e4m3fn)
    w8, sw = quantize_tensorwise(w, jnp.float8_e4m3fn)
    y = _product(x8, w8, ((1,), (0,)), sx, sw, x.dtype)
    # The payload is saved as its bytes: under `jax.checkpoint`, JAX rounds float residuals
    # with reduce_precision(finfo(dtype)), whose IEEE reading of e4m3fn's top exponent turns
    # every value in [256, 448] into NaN.
    return y, (jax.lax.bitcast_convert_type(x8, jnp.uint8), sx, w)


def _bwd(res, dy):
    x8, sx, w = res
    x8 = jax.lax.bitcast_convert_type(x8, jnp.float8_e4m3fn)
    w8, sw = quantize_tensorwise(w, jnp.float8_e4m3fn)
    g8, sg = quantize_tensorwise(dy, jnp.float8_e5m2)
    dx = _product(g8, w8, ((1,), (1,)), sg, sw, dy.dtype)
    dw = _product(x8, g8, ((0,), (0,)), sx, sg, w.dtype)
    return dx, dw


_fp8_matmul.defvjp(_fwd, _bwd)


def fp8_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` with e4m3 operands (e5m2 output gradient), per-tensor current scaling.

    Args:
      x: ``[M, K]`` float32 / bfloat16 / float16 (the activations).
      w: ``[K, N]``, same dtype choices (the weight; its gradient has w's dtype).

    Returns:
      ``[M, N]`` in x's dtype (accumulated in float32).

    Differentiable (`jax.custom_vjp`): ``dx`` and ``dw`` are FP8 products too. Any NaN or
    Inf in an operand makes every element of the result NaN (see `quantize_tensorwise`),
    so a non-finite value is never hidden behind a finite output.
    """
    _check(x, w)
    if x.dtype != w.dtype:
        raise UsageTypeError(f"fp8_matmul: x is {x.dtype} but w is {w.dtype}; cast both to "
                             "the compute dtype first.")
    return _fp8_matmul(x, w)


def fp8_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """The reference of `fp8_matmul`'s forward: quantize both operands, dequantize in
    float32, multiply at the highest precision, cast to x's dtype."""
    x8, sx = quantize_tensorwise(x, jnp.float8_e4m3fn)
    w8, sw = quantize_tensorwise(w, jnp.float8_e4m3fn)
    y = jnp.dot(x8.astype(jnp.float32) / sx, w8.astype(jnp.float32) / sw,
                precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def fp8_matmul_grads_reference(x: jax.Array, w: jax.Array, dy: jax.Array
                               ) -> tuple[jax.Array, jax.Array]:
    """The reference of `fp8_matmul`'s backward: ``(dx, dw)`` from the e5m2-quantized `dy`
    and the e4m3-quantized operands, dequantized and multiplied in float32."""
    x8, sx = quantize_tensorwise(x, jnp.float8_e4m3fn)
    w8, sw = quantize_tensorwise(w, jnp.float8_e4m3fn)
    g8, sg = quantize_tensorwise(dy, jnp.float8_e5m2)
    hi = jax.lax.Precision.HIGHEST
    xd, wd, gd = (a.astype(jnp.float32) / s for a, s in ((x8, sx), (w8, sw), (g8, sg)))
    return (jnp.dot(gd, wd.T, precision=hi).astype(dy.dtype),
            jnp.dot(xd.T, gd, precision=hi).astype(w.dtype))
