"""Host-side numpy oracle of the formats (float32 numpy arithmetic + ml_dtypes casts).

A second, independent statement of the rules that the pure-JAX reference (the
``backend="reference"`` of `gtp_jax.pallas.formats`) implements; not a backend. Used by the
tests and by ``python -m gtp_jax.bench quant --check`` to tell a wrong kernel from a wrong
reference on a real device. numpy never flushes denormals and never skips a rounding step
(XLA may: ``--xla_allow_excess_precision``, on by default, lets XLA:GPU drop a
float32 -> fp8 -> float32 round trip inside one fusion), so it is the arbiter.

All functions take and return numpy arrays; float inputs are float32 values (convert
bf16 / f16 inputs with ``np.asarray(x, np.float32)``, which is exact).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from gtp_jax.pallas.formats import (
    E2M1_VALUES,
    E4M3_EMAX,
    E4M3_MAX,
    F32_MAX,
    NVFP4_C6,
    NVFP4_GLOBAL_MAX,
    NVFP4_GLOBAL_SCALE_CAP,
)

E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn


def amax(x: np.ndarray) -> np.float32:
    """max |x| (NaN if any NaN; 0 for an empty array)."""
    a = np.abs(np.asarray(x, np.float32).astype(np.float64))
    return np.float32(a.max()) if a.size else np.float32(0)


def _per_tensor_scale(amax_value: np.floating, target: float, cap: float) -> np.float32:
    """``min(target / amax, cap)``; 1 for amax 0, NaN for a non-finite amax."""
    a = np.float32(amax_value)
    if not np.isfinite(a):
        return np.float32(np.nan)
    if a <= 0:
        return np.float32(1)
    with np.errstate(over="ignore", divide="ignore"):
        return np.float32(min(np.float32(target) / a, np.float32(cap)))


def fp8_scale(amax_value: np.floating) -> np.float32:
    return _per_tensor_scale(amax_value, E4M3_MAX, F32_MAX)


def nvfp4_global_scale(amax_value: np.floating) -> np.float32:
    return _per_tensor_scale(amax_value, NVFP4_GLOBAL_MAX, NVFP4_GLOBAL_SCALE_CAP)


def fp8_cast(x: np.ndarray, scale: np.floating) -> np.ndarray:
    """e4m3fn payload of float32 `x` (any shape)."""
    xf = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        v = np.clip(xf * np.float32(scale), -E4M3_MAX, E4M3_MAX)
    return np.where(np.isfinite(xf), v, np.nan).astype(E4M3)


def mxfp8_cast(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3fn payload [nb, 32], e8m0 bytes [nb]) of float32 block rows [nb, 32]."""
    r = np.asarray(rows, np.float32).astype(np.float64)
    bmax = np.max(np.abs(r), axis=1)
    finite = np.isfinite(bmax)
    positive = finite & (bmax > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.floor(np.log2(np.where(positive, bmax, 1.0))) - E4M3_EMAX
    e = np.where(positive, np.maximum(e, -127), -127)
    byte = np.where(finite, e + 127, 255).astype(np.uint8)
    v = np.clip(r * np.exp2(-e)[:, None], -E4M3_MAX, E4M3_MAX)
    return np.where(finite[:, None], v, np.nan).astype(E4M3), byte


def nvfp4_cast(rows: np.ndarray, g: np.floating) -> tuple[np.ndarray, np.ndarray]:
    """(packed uint8 [nb, 8], e4m3fn block scales [nb]) of float32 block rows [nb, 16]."""
    g = np.float32(g)
    xf = np.asarray(rows, np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        bmax = np.max(np.abs(xf), axis=1)
        bsf = np.where(np.isfinite(bmax),
                       np.minimum((bmax * g) * np.float32(NVFP4_C6), np.float32(E4M3_MAX)),
                       np.nan)
        bs8 = bsf.astype(np.float32).astype(E4M3)
        bs = bs8.astype(np.float32)
        inv = np.where(bs > 0, np.float32(1) / np.where(bs > 0, bs, 1), 0).astype(np.float32)
        r = (g * inv).astype(np.float32)
        q = np.minimum(np.abs(xf) * r[:, None], np.float32(6))
    mag = np.searchsorted(np.array(E2M1_VALUES), np.nan_to_num(q).astype(E2M1).astype(np.float64))
    code = np.where(np.isnan(bs)[:, None], 0, mag + 8 * np.signbit(xf))
    return (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8), bs8
