"""Public quantize / dequantize / amax API: argument checks, backend dispatch, layout."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.pallas import _util, formats
from gtp_jax.pallas.amax import multi_amax_pallas
from gtp_jax.pallas.cast_fp8 import cast_fp8_pallas
from gtp_jax.pallas.cast_mxfp8 import quantize_mxfp8_pallas
from gtp_jax.pallas.cast_nvfp4 import cast_nvfp4_pallas
from gtp_jax.pallas.formats import BACKENDS, FORMATS, SPECS, SUPPORTED_DTYPES
from gtp_jax.pallas.tensor import (
    QuantizedTensor,
    from_block_rows,
    leaf_rows,
    slice_logical,
    to_block_rows,
)

# --------------------------------------------------------------------------- validation


def check_format(format: Any) -> str:
    if format not in FORMATS:
        raise UsageError(f"format={format!r} is unknown; use one of {FORMATS}.")
    return format


def check_backend(backend: Any) -> str:
    if backend not in BACKENDS:
        raise UsageError(f"backend={backend!r} is unknown; use one of {BACKENDS} "
                         "('reference' is the pure-JAX reference implementation).")
    return backend


def check_array(x: Any, name: str) -> None:
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise UsageTypeError(
            f"{name} must be a jax.Array (or numpy array), got {type(x).__name__}.")
    if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
        kind = ("a float dtype the quantizers do not take"
                if jnp.issubdtype(x.dtype, jnp.floating) else "not a float dtype")
        raise UsageTypeError(f"{name} has dtype {x.dtype} ({kind}); cast it to one of "
                        f"{[str(d) for d in SUPPORTED_DTYPES]} first.")


def check_quantizable(x: Any, name: str, dim: Any) -> int:
    """Checks `x` and `dim`; returns the normalised dim."""
    check_array(x, name)
    if x.ndim == 0:
        raise UsageError(f"{name} is a scalar; quantize arrays of rank >= 1 "
                         "(e.g. x.reshape(1)).")
    if x.size == 0:
        raise UsageError(f"{name} has shape {x.shape} (no elements); nothing to quantize.")
    _util.check_size(x.size, f"{name} (shape {x.shape})")
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise UsageTypeError(f"dim={dim!r} must be an int (the block / contraction dim).")
    if not -x.ndim <= dim < x.ndim:
        raise UsageError(f"dim={dim} is out of range for {name} of rank {x.ndim}.")
    return int(dim) % x.ndim


def check_amax(format: str, amax: Any, required: bool) -> jax.Array | None:
    if format == "mxfp8":
        if amax is not None:
            raise UsageError("amax must be None for format='mxfp8': MXFP8 has only per-block "
                             "power-of-two scales, there is no per-tensor scale to agree on.")
        return None
    if amax is None:
        if required:
            raise UsageError(f"amax is required for cast_only(format={format!r}); compute it with "
                             "multi_amax (and reduce it across devices) first.")
        return None
    if jnp.shape(amax) != ():
        raise UsageError(f"amax must be a scalar (the tensor's max |x|), got shape "
                         f"{jnp.shape(amax)}.")
    if is_concrete(amax):
        value = float(np.asarray(amax, np.float32))
        if np.isfinite(value) and value < 0:
            # A negative max |x| would flip every element's sign through the scale.
            raise UsageError(f"amax={value} is negative; amax is the tensor's max |x| (>= 0), "
                             "e.g. from multi_amax.")
    return jnp.asarray(amax, jnp.float32)


def is_concrete(value: Any) -> bool:
    return not isinstance(value, jax.core.Tracer)


def raise_if_nonfinite(amax: jax.Array, what: str, indexed: bool = False) -> None:
    """Eager-only NaN/Inf check of concrete amaxes (under tracing the NaN propagates).

    `what` names the tensor; with ``indexed=True`` `amax` is a vector and the message
    names ``what[i]`` of the first non-finite entry."""
    if not is_concrete(amax):
        return
    values = np.atleast_1d(np.asarray(amax, np.float32))
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        i = int(bad[0])
        where = f"{what}[{i}]" if indexed else what
        raise UsageError(
            f"{where} has a non-finite amax ({values[i]}): it contains NaN or Inf, so its "
            "scale would be NaN and every element would dequantize to NaN. Fix the values "
            "(e.g. skip the step or lower the learning rate) or pass a finite amax= for "
            "delayed scaling. Under jax.jit this is not raised; the NaN propagates.")


# --------------------------------------------------------------------------- amax


@functools.partial(jax.jit, static_argnames=("backend", "interpret"))
def _multi_amax(tensors: tuple[jax.Array, ...], backend: str, interpret: bool) -> jax.Array:
    if backend == "pallas":
        return multi_amax_pallas(tensors, interpret=interpret)
    return jnp.stack([formats.amax_reference(t) for t in tensors])


def multi_amax(
    tensors: Sequence[jax.Array],
    *,
    backend: str = "pallas",
    interpret: bool | None = None,
) -> jax.Array:
    """``max|x|`` of each tensor; the Pallas backend uses ONE kernel launch for all.

    Also phase 1 of the split-phase quantize: phase 2 reduces the local amaxes with ONE
    collective (`reduce_amax`), phase 3 casts each tensor with `cast_only(t, format, amax[i])`;
    `quantize_coalesced` does all three.

    Args:
      tensors: non-empty sequence of arrays of any (possibly different) shapes and
        float32 / bfloat16 / float16 dtypes. Local values: no mesh axis is involved.
      backend: "pallas" (kernel) or "reference" (pure JAX).
      interpret: Pallas interpreter; None = True unless the default backend is a GPU.
    Returns:
      float32[len(tensors)]; 0 for empty tensors; NaN for a tensor holding a NaN, inf for
      one holding an inf (no error: this is a measurement, the quantizers check it).
    """
    check_backend(backend)
    interpret = _util.resolve_interpret(interpret)
    if isinstance(tensors, (jax.Array, np.ndarray)) or not isinstance(tensors, Sequence):
        raise UsageTypeError("tensors must be a list or tuple of arrays (for one array x, pass "
                        f"[x]); got {type(tensors).__name__}.")
    if len(tensors) == 0:
        raise UsageError("tensors is empty; pass at least one array.")
    for i, t in enumerate(tensors):
        check_array(t, f"tensors[{i}]")
        _util.check_size(t.size, f"tensors[{i}] (shape {t.shape})")
    return _multi_amax(tuple(tensors), backend, interpret)


# --------------------------------------------------------------------------- cast


@functools.partial(jax.jit, static_argnames=("format", "dim", "backend", "interpret"))
def cast_impl(x: jax.Array, amax: jax.Array | None, format: str, dim: int, backend: str,
              interpret: bool) -> QuantizedTensor:
    """Jitted cast of already validated arguments (shared by quantize / cast_only /
    quantize_coalesced); `amax` is None only for mxfp8."""
    shape = tuple(x.shape)
    pallas = backend == "pallas"
    if format == "fp8":
        scale = formats.fp8_scale(amax)
        if pallas:
            payload = cast_fp8_pallas(x, scale, interpret=interpret)
        else:
            payload = formats.fp8_cast_reference(x, scale)
        return QuantizedTensor(payload, None, scale, shape, format, dim)
    rows = to_block_rows(x, dim, SPECS[format].block)
    if format == "mxfp8":
        if pallas:
            payload_rows, scale_rows = quantize_mxfp8_pallas(rows, interpret=interpret)
        else:
            payload_rows, scale_rows = formats.mxfp8_cast_reference(rows)
        global_scale = None
    else:
        global_scale = formats.nvfp4_global_scale(amax)
        if pallas:
            payload_rows, scale_rows = cast_nvfp4_pallas(rows, global_scale,
                                                         interpret=interpret)
        else:
            payload_rows, scale_rows = formats.nvfp4_cast_reference(rows, global_scale)
    payload = from_block_rows(payload_rows, shape, dim)
    scales = from_block_rows(scale_rows, shape, dim)
    return QuantizedTensor(payload, scales, global_scale, shape, format, dim)


def cast_only(
    x: jax.Array,
    format: str,
    amax: jax.Array | float | None = None,
    *,
    dim: int = -1,
    backend: str = "pallas",
    interpret: bool | None = None,
) -> QuantizedTensor:
    """Phase 3 of the split-phase quantize: cast `x` with an already agreed amax.

    Args:
      x: array of rank >= 1, float32 / bfloat16 / float16 (e.g. a local weight shard
        inside ``shard_map``).
      format: "fp8", "mxfp8" or "nvfp4".
      amax: float32 scalar, required for fp8 / nvfp4 (the tensor amax, typically
        ``reduce_amax(multi_amax(...))[i]``); must be None for mxfp8.
      dim: block / contraction dim (mxfp8 / nvfp4), default the last.
      backend: "pallas" or "reference".
      interpret: Pallas interpreter; None = True unless the default backend is a GPU.
    Returns:
      `QuantizedTensor` (leaf layout in `gtp_jax.pallas.tensor`).
    Raises:
      ValueError: (eager calls only) if `amax` is not finite.
    """
    check_format(format)
    check_backend(backend)
    interpret = _util.resolve_interpret(interpret)
    dim = check_quantizable(x, "x", dim)
    amax = check_amax(format, amax, required=True)
    return _checked_cast(x, amax, format, dim, backend, interpret)


def _checked_cast(x: jax.Array, amax: jax.Array | None, format: str, dim: int, backend: str,
                  interpret: bool) -> QuantizedTensor:
    """Casts with `amax`; eager calls raise on a non-finite amax (or NaN mxfp8 block)."""
    if amax is not None:
        raise_if_nonfinite(amax, "x")
    out = cast_impl(x, amax, format, dim, backend, interpret)
    if format == "mxfp8":
        _raise_if_nan_blocks(out)
    return out


def _raise_if_nan_blocks(q: QuantizedTensor) -> None:
    scales = q.block_scales
    if is_concrete(scales) and bool(jnp.any(scales == formats.E8M0_NAN)):
        raise_if_nonfinite(jnp.float32(jnp.nan), "x")


def quantize(
    x: jax.Array,
    format: str,
    *,
    dim: int = -1,
    amax: jax.Array | float | None = None,
    backend: str = "pallas",
    interpret: bool | None = None,
) -> QuantizedTensor:
    """Quantizes `x` to `format` (fused amax + cast).

    Args:
      x: array of rank >= 1, float32 / bfloat16 / float16.
      format: "fp8" (e4m3 + per-tensor scale), "mxfp8" (e4m3 + e8m0 per 32 along `dim`) or
        "nvfp4" (packed e2m1 + e4m3 per 16 along `dim` + per-tensor scale); the exact
        rules are in `gtp_jax.pallas.formats`.
      dim: block / contraction dim (ignored by fp8's layout), default the last.
      amax: None for current scaling (amax of `x`, one kernel pass); a float32 scalar
        for delayed scaling (fp8 / nvfp4 only; values beyond it saturate).
      backend: "pallas" (Triton kernels) or "reference" (pure-JAX reference).
      interpret: Pallas interpreter; None = True unless the default backend is a GPU.
    Returns:
      `QuantizedTensor` with the logical shape of `x`.
    Raises:
      ValueError / TypeError: bad arguments (checked before any work); in eager calls
        also a non-finite amax (NaN / Inf in `x`), which under jit propagates as NaN.
    """
    check_format(format)
    check_backend(backend)
    interpret = _util.resolve_interpret(interpret)
    dim = check_quantizable(x, "x", dim)
    amax = check_amax(format, amax, required=False)
    if format != "mxfp8" and amax is None:
        amax = _multi_amax((x,), backend, interpret)[0]
    return _checked_cast(x, amax, format, dim, backend, interpret)


# --------------------------------------------------------------------------- dequantize


def dequantize(
    q: QuantizedTensor,
    dtype: Any = jnp.bfloat16,
    *,
    backend: str = "pallas",
    interpret: bool | None = None,
) -> jax.Array:
    """Decodes a `QuantizedTensor` to `dtype` with its logical shape (padding dropped).

    Decoding is plain elementwise JAX for both backends on purpose: inside a jitted step
    XLA fuses it into the consumer (e.g. the GEMM's operand), whereas a Pallas kernel
    would have to write the full-precision weight to memory and read it back.
    `backend` / `interpret` are validated and accepted for symmetry with `quantize`.

    Args:
      q: the tensor to decode (payload / scales possibly gathered, see `gather_quantized`).
      dtype: output floating dtype.
    Returns:
      array of ``q.shape`` and `dtype` (NaN wherever a scale is NaN).
    """
    check_backend(backend)
    _util.resolve_interpret(interpret)
    if not isinstance(q, QuantizedTensor):
        raise UsageTypeError(
            f"q must be a QuantizedTensor (from quantize), got {type(q).__name__}.")
    check_format(q.format)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise UsageTypeError(f"dtype={dtype!r} must be a floating dtype such as jnp.bfloat16.")
    if q.format != "fp8":
        expected = tuple(q.shape[:q.dim]) + tuple(q.shape[q.dim + 1:])
        got = tuple(q.payload.shape[:q.dim]) + tuple(q.payload.shape[q.dim + 1:])
        if got != expected:
            raise UsageError(f"q.payload has shape {q.payload.shape}, inconsistent with the "
                             f"logical shape {q.shape} (dim {q.dim}).")
    return _dequantize(q, np.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("dtype",))
def _dequantize(q: QuantizedTensor, dtype: np.dtype) -> jax.Array:
    spec = SPECS[q.format]
    if q.format == "fp8":
        return formats.fp8_decode(q.payload, q.global_scale).astype(dtype)
    width = spec.block // spec.elems_per_byte
    payload_rows = leaf_rows(q.payload, q.dim, width)
    scale_rows = leaf_rows(q.block_scales, q.dim, 1)
    if q.format == "mxfp8":
        values = formats.mxfp8_decode(payload_rows, scale_rows)
    else:
        values = formats.nvfp4_decode(payload_rows, scale_rows, q.global_scale)
    padded = tuple(q.shape[:q.dim]) + (q.payload.shape[q.dim] * spec.elems_per_byte,) \
        + tuple(q.shape[q.dim + 1:])
    full = from_block_rows(values, padded, q.dim)
    return slice_logical(full, q.shape, q.dim).astype(dtype)
