"""FP8 matmul with per-tensor current scaling: ``x [M, K] @ w [K, N]`` on e4m3 operands,
e5m2 gradients, beside its reference (`fp8_matmul_reference`).

Recipe ("tensorwise", as TransformerEngine's current scaling and torchao's float8
tensorwise, with power-of-two scales as their ``pow_2_scales`` options): every operand is
quantized with one float32 scale per tensor computed from its own amax in the same step
(``s`` the largest power of two ``<= fmax / amax``, saturating cast, the fp8 format's
NaN/Inf policy). The forward multiplies e4m3 ``x`` and ``w``; the
backward quantizes the output gradient to e5m2 (wider range, for gradients) and computes
``dx = dy @ w^T`` and ``dw = x^T @ dy`` from e5m2 x e4m3 operands.

Each product is written as XLA's cuBLASLt FP8 pattern: both payloads converted exactly to
bfloat16 (every e4m3 and e5m2 value is a bfloat16 value), one ``dot_general`` accumulating
in float32 and writing the output dtype, and the two (exact, power-of-two) inverse scales
applied to that output. On Hopper GPUs XLA
rewrites this into one ``__cublas$lt$matmul$f8`` call; elsewhere (CPUs) it is an exact
emulation: the products of bfloat16-exact values accumulated in float32.

Residuals: the e4m3 payload of ``x``, transposed (1 byte per element, half of bf16) and
its scale, the scale of ``w``,
and ``w`` itself, re-quantized in the backward pass: ``w`` is usually a gathered GTP weight,
which the layer loop and `gtp_jax.shard` never keep alive from the forward pass, and
quantizing it again costs one pass over the weight.

Delayed scaling ("delayed", TransformerEngine's recipe; `fp8_matmul_delayed`): the same
formats and products, but each tensor is quantized with the scale of an amax *history* of
earlier steps (`history_scales`: the maximum over the history, power-of-two scale as above;
an all-zero history gives the scale 1) and its current amax is only recorded
(`roll_history`), so nothing waits for it before the cast, and it is computed in the pass
that casts (the cast-and-transpose kernel records it on GPUs; XLA fuses it elsewhere): one
read of each tensor instead of two. The next history is returned as the history's cotangent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.pallas import _util
from gtp_jax.pallas.amax import multi_amax_pallas
from gtp_jax.pallas.cast_transpose import (
    E5M2_MAX,
    LIMITS,
    cast_transpose_pallas,
    cast_transpose_reference,
)
from gtp_jax.pallas.formats import E4M3_MAX, F32_MAX

#: Input dtypes `fp8_matmul` takes (its output has the input dtype).
FP8_MATMUL_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


def _scale(amax: jax.Array, fmax: float) -> jax.Array:
    """The largest power of two ``s <= fmax / amax`` (float32[]; 1 for amax 0; at most
    2**127; NaN for a non-finite amax: every element it governs becomes NaN, never a finite
    value). A power of two makes the inverse scales exact, so a product can be written in
    the compute dtype by the GEMM and rescaled there without a second rounding."""
    positive = amax > 0
    ratio = jnp.where(positive, fmax / jnp.where(positive, amax, 1.0), 1.0)
    ratio = jnp.minimum(ratio.astype(jnp.float32), F32_MAX)
    _, exponent = jnp.frexp(ratio)  # ratio = m * 2**exponent, m in [0.5, 1)
    s = jnp.ldexp(jnp.float32(1.0), jnp.minimum(exponent - 1, 127))
    return jnp.where(jnp.isfinite(amax), s, jnp.nan).astype(jnp.float32)


def _amax(x: jax.Array) -> jax.Array:
    """``max |x|`` (float32[]; NaN if any element is NaN, Inf if one is infinite and none
    NaN), reduced on x's bit patterns at its own width: the integer order of ``|x|``'s bits
    is the float order with NaN above Inf, so a NaN is never dropped (XLA's CPU float max
    reduction drops NaNs in some vectorized shapes), and the pass reads x once."""
    width = np.dtype(x.dtype).itemsize
    ints, sign_off = {2: (jnp.int16, 0x7FFF), 4: (jnp.int32, 0x7FFFFFFF)}[width]
    bits = jnp.max(jax.lax.bitcast_convert_type(x, ints) & jnp.asarray(sign_off, ints))
    return jax.lax.bitcast_convert_type(bits, x.dtype).astype(jnp.float32)


def quantize_tensorwise(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """(payload of `dtype` (float8_e4m3fn or float8_e5m2), float32 scale ``s``) with
    ``x ~= payload / s``: per-tensor current scaling, saturating, NaN for non-finite
    elements (and for every element of a tensor whose amax is not finite)."""
    s = _scale(_amax(x), LIMITS[np.dtype(dtype)])
    return quantize_with_scale(x, s, dtype), s


def _product(a8: jax.Array, b8: jax.Array, sa: jax.Array, sb: jax.Array,
             out_dtype: jnp.dtype) -> jax.Array:
    """``(a8 / sa) @ (b8 / sb)^T`` for ``a8 [M, K]`` and ``b8 [N, K]``, in the cuBLASLt FP8
    form.

    Both operands contract their last (contiguous) dim: the only layout Hopper's FP8 GEMMs
    take, so XLA inserts no transpose of its own (a transposed operand is cast from the
    16-bit tensor by one fused transpose-and-cast instead: an FP8 transpose afterwards ran
    at a tenth of the memory bandwidth on one H200). For a 16-bit `out_dtype` the GEMM
    writes that dtype itself (accumulating in float32) and the power-of-two inverse scales
    are applied to it exactly: the same values as a float32 output scaled and rounded,
    without writing and reading float32 (a float32 output cost the FP8 GEMM a fifth of its
    rate).
    """
    low = jnp.dtype(out_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    acc = out_dtype if low else jnp.float32
    # Both conversions are exact (every e4m3 / e5m2 value is a bfloat16 value); float32
    # operands for a float32 result, which every backend's dot takes.
    wide = jnp.bfloat16 if low else jnp.float32
    y = jax.lax.dot_general(a8.astype(wide), b8.astype(wide),
                            (((1,), (1,)), ((), ())), preferred_element_type=acc)
    return (y * ((1.0 / sa) * (1.0 / sb)).astype(acc)).astype(out_dtype)


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


def _amax_of(x: jax.Array, impl: tuple) -> jax.Array:
    if impl[0] == "pallas":
        return multi_amax_pallas([x], interpret=impl[1])[0]
    return _amax(x)


def _quantize(x: jax.Array, s: jax.Array, dtype: jnp.dtype, layout: str, impl: tuple
              ) -> tuple[jax.Array | None, jax.Array | None]:
    """(row-wise ``[M, N]``, column-wise ``[N, M]``) payloads of `x` (None where not asked)."""
    if impl[0] == "pallas":
        return cast_transpose_pallas(x, s, dtype, layout=layout, interpret=impl[1])
    return cast_transpose_reference(x, s, dtype, layout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_matmul(x: jax.Array, w: jax.Array, impl: tuple) -> jax.Array:
    return _fwd(x, w, impl)[0]


def _fwd(x, w, impl):
    e4 = jnp.float8_e4m3fn
    sx = _scale(_amax_of(x, impl), E4M3_MAX)
    sw = _scale(_amax_of(w, impl), E4M3_MAX)
    x8, xt8 = _quantize(x, sx, e4, "both", impl)
    _, wt8 = _quantize(w, sw, e4, "columnwise", impl)
    y = _product(x8, wt8, sx, sw, x.dtype)
    # The backward pass's dw = x^T dy contracts the tokens: x is saved transposed ([K, M],
    # one byte per element). The payload is saved as its bytes: under `jax.checkpoint`, JAX
    # rounds float residuals with reduce_precision(finfo(dtype)), whose IEEE reading of
    # e4m3fn's top exponent turns every value in [256, 448] into NaN.
    return y, (jax.lax.bitcast_convert_type(xt8, jnp.uint8), sx, w, sw)


def _bwd(impl, res, dy):
    xt8, sx, w, sw = res  # w's scale from the forward pass: the same w, no second amax
    xt8 = jax.lax.bitcast_convert_type(xt8, jnp.float8_e4m3fn)
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    sg = _scale(_amax_of(dy, impl), E5M2_MAX)
    w8, _ = _quantize(w, sw, e4, "rowwise", impl)
    g8, gt8 = _quantize(dy, sg, e5, "both", impl)
    dx = _product(g8, w8, sg, sw, dy.dtype)
    dw = _product(xt8, gt8, sx, sg, w.dtype)
    return dx, dw


_fp8_matmul.defvjp(_fwd, _bwd)


def fp8_matmul(x: jax.Array, w: jax.Array, *, backend: str | None = None,
               interpret: bool | None = None) -> jax.Array:
    """``x @ w`` with e4m3 operands (e5m2 output gradient), per-tensor current scaling.

    Args:
      x: ``[M, K]`` float32 / bfloat16 / float16 (the activations).
      w: ``[K, N]``, same dtype choices (the weight; its gradient has w's dtype).
      backend: how the amax and casts run: "pallas" (the one-launch amax kernel and the
        fused cast-and-transpose kernel, `gtp_jax.pallas.cast_transpose`), "xla" (XLA's
        fusions; XLA then transposes the one-byte payloads in kernels of their own), or
        None: "pallas" on a GPU, else "xla". Both give the same bits.
      interpret: run the Pallas kernels in the interpreter; None: unless on a GPU.

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
    return _fp8_matmul(x, w, _impl("fp8_matmul", backend, interpret))


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


# --------------------------------------------------------------------------- delayed


def history_scales(history: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(``sx``, ``sw``, ``sg``): float32 scales of ``x``, ``w`` (e4m3) and ``dy`` (e5m2) from
    an amax history float32 ``[H, 3]`` (columns x, w, dy; a fourth column, the use count,
    is ignored): `_scale` of each column's maximum over the ``H`` steps. An all-zero column
    (no step recorded yet) gives 1; a NaN or Inf recorded in the column gives NaN (every
    element it governs becomes NaN)."""
    amax = jnp.max(history[:, :3], axis=0)
    return _scale(amax[0], E4M3_MAX), _scale(amax[1], E4M3_MAX), _scale(amax[2], E5M2_MAX)


def roll_history(history: jax.Array, amax: jax.Array) -> jax.Array:
    """`history` (float32 ``[H, 3]``, newest first) with `amax` (float32 ``[3]``: this
    step's x, w, dy) as row 0 and the oldest row dropped. A history of ``[H, 4]`` also
    records one use in its fourth column (row 0 gets ``[*amax, 1]``): the cotangents of a
    history used n times sum to n there, which the training step checks."""
    row = amax.astype(jnp.float32)
    if history.shape[-1] == 4:
        row = jnp.concatenate([row, jnp.ones((1,), jnp.float32)])
    return jnp.concatenate([row[None], history[:-1]], axis=0)


def _quantize_amax(x: jax.Array, s: jax.Array, dtype: jnp.dtype, layout: str, impl: tuple
                   ) -> tuple[jax.Array | None, jax.Array | None, jax.Array]:
    """`_quantize` and x's amax (float32[]) from the same read of x on the Pallas path (the
    cast kernel records it); XLA's fusions on the other."""
    if impl[0] == "pallas":
        return cast_transpose_pallas(x, s, dtype, layout=layout, interpret=impl[1],
                                     with_amax=True)
    return (*cast_transpose_reference(x, s, dtype, layout), _amax(x))


def _first_device(axes: tuple[str, ...]) -> jax.Array:
    """Whether this device has index 0 on every axis of `axes` (bool[])."""
    return functools.reduce(jnp.logical_and,
                            [jax.lax.axis_index(a) == 0 for a in axes], jnp.bool_(True))


def _recorded(history: jax.Array, amax: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """The next history, as the history's cotangent: `history` rolled with this step's
    `amax` (float32 ``[3]``: x, w, dy)."""
    if axes:
        # x and dy are split over the data axes: the recorded amax is the maximum over every
        # device, so the history (and the next step's scales) are the same on all of them.
        amax = jax.lax.pmax(amax, axes)
    new = roll_history(history, amax)
    if axes:
        # shard_map's transpose sums a replicated input's cotangent over the mesh: one
        # device contributes the history, the others zeros (an exact sum).
        new = jnp.where(_first_device(axes), new, jnp.zeros_like(new))
    return new


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fp8_matmul_delayed(x, w, history, sx, impl, axes):
    return _delayed_fwd(x, w, history, sx, impl, axes)[0]


def _delayed_fwd(x, w, history, sx, impl, axes):
    e4 = jnp.float8_e4m3fn
    _, sw, sg = history_scales(history)
    # The amaxes are recorded only (no cast waits for them), read in the casts' own pass.
    x8, xt8, amax_x = _quantize_amax(x, sx, e4, "both", impl)
    _, wt8, amax_w = _quantize_amax(w, sw, e4, "columnwise", impl)
    amax_xw = jnp.stack([amax_x, amax_w])
    y = _product(x8, wt8, sx, sw, x.dtype)
    return y, (jax.lax.bitcast_convert_type(xt8, jnp.uint8), sx, w, sw, sg, amax_xw, history)


def _delayed_bwd(impl, axes, res, dy):
    xt8, sx, w, sw, sg, amax_xw, history = res
    xt8 = jax.lax.bitcast_convert_type(xt8, jnp.float8_e4m3fn)
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    w8, _ = _quantize(w, sw, e4, "rowwise", impl)
    g8, gt8, amax_g = _quantize_amax(dy, sg, e5, "both", impl)
    new = _recorded(history, jnp.concatenate([amax_xw, amax_g[None]]), axes)
    dx = _product(g8, w8, sg, sw, dy.dtype)
    dw = _product(xt8, gt8, sx, sg, w.dtype)
    return dx, dw, new, jnp.zeros_like(sx)


_fp8_matmul_delayed.defvjp(_delayed_fwd, _delayed_bwd)


def fp8_matmul_delayed(x: jax.Array, w: jax.Array, history: jax.Array, *,
                       axes: tuple[str, ...] = (), backend: str | None = None,
                       interpret: bool | None = None,
                       x_scale: jax.Array | None = None) -> jax.Array:
    """``x @ w`` as `fp8_matmul`, with delayed scaling from an amax history.

    Args:
      x: ``[M, K]`` float32 / bfloat16 / float16.
      w: ``[K, N]``, x's dtype.
      history: float32 ``[H, 3]``: amax of x, w and dy of the last H steps, or ``[H, 4]``
        with the uses per step in a fourth column (`Fp8History` of
        `gtp_jax.base.fp8_history`). Scales: `history_scales`.
      axes: mesh axes to take the recorded amax's maximum over (inside ``jax.shard_map``:
        every axis over which the replicated history's cotangent is summed; the history
        cotangent is then returned on the first device only). () outside ``shard_map``.
      backend, interpret: as in `fp8_matmul`.
      x_scale: float32[]: x's scale, in place of the history's (another layer's history
        of the same x: `gtp_jax.sharding.fp8` passes it so that an input two layers read
        is quantized once); None: the history's. Not differentiated (zero cotangent).

    Returns:
      ``[M, N]`` in x's dtype. Differentiable: ``dx``, ``dw`` are FP8 products with the
      history's ``dy`` scale, and the cotangent of `history` is the next history,
      ``roll_history(history, [amax(x), amax(w), amax(dy)])`` (with a use count of 1 in
      row 0 of a four-column history; not a gradient: the
      training step writes it into the variable). A NaN or Inf in an operand makes the
      outputs it reaches NaN and is recorded in the history, whose later scales are then
      NaN: never a finite value computed from a broken scale.
    """
    _check(x, w)
    if x.dtype != w.dtype:
        raise UsageTypeError(f"fp8_matmul_delayed: x is {x.dtype} but w is {w.dtype}; cast "
                             "both to the compute dtype first.")
    if (not hasattr(history, "shape") or history.ndim != 2 or history.shape[1] not in (3, 4)
            or history.shape[0] < 1):
        raise UsageError(f"fp8_matmul_delayed: history has shape "
                         f"{getattr(history, 'shape', None)}; it takes float32 [H, 3] with "
                         "H >= 1 (amax of x, w, dy per step), or [H, 4] with a use count.")
    if x_scale is not None and jnp.shape(x_scale) != ():
        raise UsageError(f"fp8_matmul_delayed: x_scale must be a scalar, got shape "
                         f"{jnp.shape(x_scale)}.")
    impl = _impl("fp8_matmul_delayed", backend, interpret)
    history = history.astype(jnp.float32)
    sx = history_scales(history)[0] if x_scale is None else x_scale
    return _fp8_matmul_delayed(x, w, history, jax.lax.stop_gradient(sx).astype(jnp.float32),
                               impl, tuple(axes))


def quantize_with_scale(x: jax.Array, s: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The payload of `dtype` with ``x ~= payload / s`` for a given scale (saturating,
    NaN for non-finite elements)."""
    return cast_transpose_reference(x, s, dtype, "rowwise")[0]


def fp8_matmul_delayed_reference(x: jax.Array, w: jax.Array, dy: jax.Array,
                                 history: jax.Array
                                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The reference of `fp8_matmul_delayed` on one device: ``(y, dx, dw, next history)``,
    every operand quantized with the scale of `history` (`history_scales`), dequantized and
    multiplied in float32 at the highest precision; the next history is `history` rolled
    with the operands' own amaxes."""
    sx, sw, sg = history_scales(history)
    hi = jax.lax.Precision.HIGHEST
    xd = quantize_with_scale(x, sx, jnp.float8_e4m3fn).astype(jnp.float32) / sx
    wd = quantize_with_scale(w, sw, jnp.float8_e4m3fn).astype(jnp.float32) / sw
    gd = quantize_with_scale(dy, sg, jnp.float8_e5m2).astype(jnp.float32) / sg
    amax = jnp.stack([_amax(a) for a in (x, w, dy)])
    return (jnp.dot(xd, wd, precision=hi).astype(x.dtype),
            jnp.dot(gd, wd.T, precision=hi).astype(dy.dtype),
            jnp.dot(xd.T, gd, precision=hi).astype(w.dtype),
            roll_history(history, amax))


# --------------------------------------------------------------------------- prequantized


def weight_scale(amax: jax.Array) -> jax.Array:
    """The e4m3 scale `fp8_matmul` gives a weight of this amax (float32[]: the largest power
    of two ``<= 448 / amax``; 1 for amax 0; NaN for a non-finite amax). A weight quantized
    with it from its shards (`gtp_jax.sharding` gathers it so) is the payload `fp8_matmul`
    would compute from the whole weight."""
    return _scale(jnp.asarray(amax, jnp.float32), E4M3_MAX)


def cast_weight(w: jax.Array, s: jax.Array, *, backend: str | None = None,
                interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """``(w8, w8t)``: `w` (``[K, N]``, float32 / bfloat16 / float16) cast to e4m3 with the
    scale `s` (float32[]) in both layouts, as uint8 bit patterns: ``[K, N]`` and its
    transpose ``[N, K]``, in one pass (the Pallas cast-and-transpose kernel on GPUs)."""
    impl = _impl("cast_weight", backend, interpret)
    w8, w8t = _quantize(w, s, jnp.float8_e4m3fn, "both", impl)
    return (jax.lax.bitcast_convert_type(w8, jnp.uint8),
            jax.lax.bitcast_convert_type(w8t, jnp.uint8))


def _quantize_operand(t: jax.Array, dtype: jnp.dtype, history: jax.Array | None,
                      column: int, impl: tuple, scale: jax.Array | None = None) -> tuple:
    """``(scale, row-wise payload, column-wise payload, amax or None)`` of `t` in both
    layouts: current scaling without a `history`, else the scale of the history's `column`
    or the given `scale` (its amax recorded in the same pass)."""
    if history is None:
        s = _scale(_amax_of(t, impl), LIMITS[np.dtype(dtype)])
        return (s, *_quantize(t, s, dtype, "both", impl), None)
    s = history_scales(history)[column] if scale is None else scale
    return (s, *_quantize_amax(t, s, dtype, "both", impl))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _fp8_matmul_prequantized(x, w, w8, w8t, sw, amax_w, history, sx, impl, axes):
    return _pre_fwd(x, w, w8, w8t, sw, amax_w, history, sx, impl, axes)[0]


def _pre_fwd(x, w, w8, w8t, sw, amax_w, history, sx, impl, axes):
    # `w` is not read: the GEMM takes the given payload; w only receives the gradient.
    e4 = jnp.float8_e4m3fn
    sx, x8, xt8, amax_x = _quantize_operand(x, e4, history, 0, impl, sx)
    y = _product(x8, jax.lax.bitcast_convert_type(w8t, e4), sx, sw, x.dtype)
    return y, (jax.lax.bitcast_convert_type(xt8, jnp.uint8), sx, w8, sw, amax_x, amax_w,
               history)


def _pre_bwd(impl, axes, res, dy):
    xt8, sx, w8, sw, amax_x, amax_w, history = res
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    sg, g8, gt8, amax_g = _quantize_operand(dy, e5, history, 2, impl)
    new = (None if history is None
           else _recorded(history, jnp.stack([amax_x, amax_w, amax_g]), axes))
    dx = _product(g8, jax.lax.bitcast_convert_type(w8, e4), sg, sw, dy.dtype)
    # w has x's dtype, which is y's and so dy's.
    dw = _product(jax.lax.bitcast_convert_type(xt8, e4), gt8, sx, sg, dy.dtype)
    return dx, dw, None, None, None, None, new, None


_fp8_matmul_prequantized.defvjp(_pre_fwd, _pre_bwd)


def fp8_matmul_prequantized(x: jax.Array, w: jax.Array, w8: jax.Array, w8t: jax.Array,
                            sw: jax.Array, *, amax_w: jax.Array | None = None,
                            history: jax.Array | None = None, axes: tuple[str, ...] = (),
                            backend: str | None = None, interpret: bool | None = None,
                            x_scale: jax.Array | None = None
                            ) -> jax.Array:
    """``x @ w`` as `fp8_matmul` (or `fp8_matmul_delayed` with a `history`), with the
    weight's e4m3 payload given instead of computed: the forward GEMM reads `w8t`, the
    backward's ``dx = dy @ w^T`` reads `w8`, and `w` itself is never read (only its
    gradient is produced), so nothing dequantizes or re-quantizes the weight.

    Args:
      x: ``[M, K]`` float32 / bfloat16 / float16.
      w: ``[K, N]``, x's dtype: the weight's value (``w8 / sw``); it receives ``dw``.
      w8: ``[K, N]`` uint8, the e4m3 bit patterns of the weight (``cast_weight``).
      w8t: ``[N, K]`` uint8, the same payload transposed.
      sw: float32[], the payload's scale (``w ~= w8 / sw``); a power of two
        (`weight_scale`) keeps the result equal to `fp8_matmul`'s.
      amax_w: float32[], the weight's amax, recorded in the history (delayed only).
      history: float32 ``[H, 3]`` or ``[H, 4]``: delayed scaling of x and dy as in
        `fp8_matmul_delayed`, whose cotangent is the next history; None: current scaling.
      axes, backend, interpret, x_scale: as in `fp8_matmul_delayed` (x_scale with a
        history only).

    Returns:
      ``[M, N]`` in x's dtype. With ``sw = weight_scale(amax(w))`` and ``w8`` the payload
      of that scale, the same values as `fp8_matmul(x, w)` (tensorwise) or, delayed, as
      `fp8_matmul_delayed` with the weight scaled by its current amax.
    """
    _check(x, w)
    if x.dtype != w.dtype:
        raise UsageTypeError(f"fp8_matmul_prequantized: x is {x.dtype} but w is {w.dtype}; "
                             "cast both to the compute dtype first.")
    k, n = w.shape
    for name, a, shape in (("w8", w8, (k, n)), ("w8t", w8t, (n, k))):
        if tuple(a.shape) != shape or np.dtype(a.dtype) != np.dtype(np.uint8):
            raise UsageError(f"fp8_matmul_prequantized: {name} is {a.dtype}{list(a.shape)}; "
                             f"it takes the uint8 e4m3 bits of shape {list(shape)} "
                             "(see cast_weight).")
    if history is not None and (history.ndim != 2 or history.shape[1] not in (3, 4)):
        raise UsageError(f"fp8_matmul_prequantized: history has shape {history.shape}; it "
                         "takes float32 [H, 3] or [H, 4].")
    if history is not None and amax_w is None:
        raise UsageError("fp8_matmul_prequantized: a history needs the weight's amax_w to "
                         "record.")
    impl = _impl("fp8_matmul_prequantized", backend, interpret)
    sw = jnp.asarray(sw, jnp.float32)
    amax_w = None if amax_w is None else jnp.asarray(amax_w, jnp.float32)
    history = None if history is None else history.astype(jnp.float32)
    if x_scale is not None and (history is None or jnp.shape(x_scale) != ()):
        raise UsageError("fp8_matmul_prequantized: x_scale (a float32 scalar) replaces the "
                         "history's x scale; pass it with a history only.")
    sx = None if x_scale is None else jax.lax.stop_gradient(x_scale).astype(jnp.float32)
    return _fp8_matmul_prequantized(x, w, w8, w8t, sw, amax_w, history, sx, impl,
                                    tuple(axes))


def _impl(name: str, backend: str | None, interpret: bool | None) -> tuple:
    if backend not in (None, "pallas", "xla"):
        raise UsageError(f"{name}: backend={backend!r}; use 'pallas', 'xla' or None (pallas "
                         "on a GPU, else xla).")
    if backend is None:
        backend = "pallas" if jax.default_backend() == "gpu" else "xla"
    return ("pallas", _util.resolve_interpret(interpret)) if backend == "pallas" else ("xla",)
