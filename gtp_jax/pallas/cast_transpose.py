"""FP8 cast of a matrix into its row-wise and/or column-wise (transposed) payload in one
pass, beside its reference (`cast_transpose_reference`).

Hopper's FP8 GEMMs take both operands with the contracted dim contiguous, so a matmul's
backward needs the transposed payload of its activations and output gradient
(``dw = x^T dy`` contracts the tokens). XLA casts, then transposes the one-byte payload in
a separate kernel, which on one H200 ran at about a tenth of the memory bandwidth. Here
each program loads one ``[bm, bn]`` tile of ``x`` once, scales and casts it, and stores the
tile and/or its transpose (Triton transposes the tile through shared memory): one read of
``x`` for both layouts. The scale comes first (the one-launch amax kernel, `amax.py`), or,
for delayed scaling, from earlier steps: then ``with_amax=True`` also records the tile's
amax in the same pass (`cast_transpose_amax_reference` is its reference), so the tensor is
read once instead of twice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.pallas import _util
from gtp_jax.pallas.formats import E4M3_MAX, SUPPORTED_DTYPES

#: Largest finite float8_e5m2.
E5M2_MAX = float(jnp.finfo(jnp.float8_e5m2).max)
#: Payload dtypes and their saturation limits.
LIMITS = {np.dtype(jnp.float8_e4m3fn): E4M3_MAX, np.dtype(jnp.float8_e5m2): E5M2_MAX}
#: Which payloads to write.
LAYOUTS = ("rowwise", "columnwise", "both")
#: Tile and warps, tuned on one H200 (``[8192, 14336]`` bfloat16: both payloads in
#: 0.143 ms, 3.3 TB/s of reads and writes; the column-wise one alone in 0.100 ms, 3.5 TB/s).
BLOCK = (64, 128)
NUM_WARPS = 8


def cast_transpose_reference(x: jax.Array, scale: jax.Array, dtype: jnp.dtype,
                             layout: str = "both") -> tuple[jax.Array | None, jax.Array | None]:
    """``(sat(RN(x * scale)), its transpose)`` in `dtype`, as XLA computes it (NaN and
    +-Inf elements become NaN); None for a layout not asked for."""
    fmax = LIMITS[np.dtype(dtype)]
    xf = x.astype(jnp.float32)
    v = jnp.clip(xf * scale, -fmax, fmax)
    q = jnp.where(jnp.isfinite(xf), v, jnp.nan).astype(dtype)
    return (q if layout in ("rowwise", "both") else None,
            q.T if layout in ("columnwise", "both") else None)


def cast_transpose_amax_reference(x: jax.Array) -> jax.Array:
    """``max |x|`` as float32[] (NaN if any element is NaN, Inf if one is infinite and none
    NaN): the amax `cast_transpose_pallas(..., with_amax=True)` records."""
    bits = jnp.max(_util.abs_bits(x.astype(jnp.float32)))  # an integer max keeps NaNs
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def cast_transpose_pallas(
    x: jax.Array,
    scale: jax.Array,
    dtype: jnp.dtype,
    *,
    layout: str = "both",
    interpret: bool,
    block: tuple[int, int] = BLOCK,
    num_warps: int = NUM_WARPS,
    with_amax: bool = False,
) -> tuple[jax.Array | None, ...]:
    """The payloads of `cast_transpose_reference`, in one Pallas (Triton) launch.

    Args:
      x: ``[M, N]``, float32 / bfloat16 / float16.
      scale: float32 scalar (NaN propagates to every element).
      dtype: float8_e4m3fn or float8_e5m2.
      layout: "rowwise" (``[M, N]``), "columnwise" (``[N, M]``) or "both".
      interpret: run in the Pallas interpreter instead of compiling for the GPU.
      block: tile ``(bm, bn)``, powers of two.
      num_warps: Triton warps per program.
      with_amax: also return ``max |x|`` (float32[], `cast_transpose_amax_reference`),
        computed from the tiles this launch reads anyway.
    Returns:
      ``(rowwise [M, N] or None, columnwise [N, M] or None)`` of `dtype`, and with
      `with_amax` a third element, the amax.
    """
    if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise UsageTypeError(f"cast_transpose_pallas: x has dtype {x.dtype}; use one of "
                             f"{[str(d) for d in SUPPORTED_DTYPES]}.")
    if x.ndim != 2 or x.size == 0:
        raise UsageError(f"cast_transpose_pallas: x has shape {x.shape}; it takes a non-empty "
                         "matrix (reshape to [M, N]).")
    if np.dtype(dtype) not in LIMITS:
        raise UsageTypeError(f"cast_transpose_pallas: dtype={dtype}; use float8_e4m3fn or "
                             "float8_e5m2.")
    if layout not in LAYOUTS:
        raise UsageError(f"cast_transpose_pallas: layout={layout!r}; use one of {LAYOUTS}.")
    if jnp.shape(scale) != ():
        raise UsageError(f"cast_transpose_pallas: scale must be a scalar, got shape "
                         f"{jnp.shape(scale)}.")
    for value, name in zip(block, ("block[0]", "block[1]")):
        _util.check_pow2(value, name)
    _util.check_size(x.size, f"x (shape {x.shape})")
    m, n = x.shape
    bm, bn = min(block[0], _util.next_pow2(m)), min(block[1], _util.next_pow2(n))
    fmax = LIMITS[np.dtype(dtype)]
    rows, cols = layout in ("rowwise", "both"), layout in ("columnwise", "both")

    grid = (pl.cdiv(m, bm), pl.cdiv(n, bn))

    def kernel(x_ref, s_ref, *out_refs):
        i, j = pl.program_id(0), pl.program_id(1)
        r = i * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
        c = j * bn + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 1)
        mask = (r < m) & (c < n)
        tile = (pl.ds(i * bm, bm), pl.ds(j * bn, bn))
        xf = plgpu.load(x_ref.at[tile], mask=mask, other=0).astype(jnp.float32)
        v = _util.saturate(xf * s_ref[0], fmax)
        q = jnp.where(_util.abs_bits(xf) < 0x7F800000, v, jnp.nan).astype(dtype)
        refs = list(out_refs)
        if rows:
            plgpu.store(refs.pop(0).at[tile], q, mask=mask)
        if cols:
            plgpu.store(refs.pop(0).at[pl.ds(j * bn, bn), pl.ds(i * bm, bm)], q.T,
                        mask=mask.T)
        if with_amax:
            # Bit patterns of |x|, integer max: NaN propagates (see `_util.abs_bits`); masked
            # lanes loaded 0, the identity.
            part = jnp.max(_util.abs_bits(xf)).reshape(1)
            plgpu.store(refs.pop(0).at[pl.ds(i * grid[1] + j, 1)], part)

    shapes = ([jax.ShapeDtypeStruct((m, n), dtype)] if rows else []) + \
        ([jax.ShapeDtypeStruct((n, m), dtype)] if cols else []) + \
        ([jax.ShapeDtypeStruct((grid[0] * grid[1],), jnp.int32)] if with_amax else [])
    outs = pl.pallas_call(
        kernel,
        out_shape=shapes,
        grid=grid,
        interpret=interpret,
        compiler_params=_util.compiler_params(num_warps),
        name="gtp_cast_transpose_fp8",
    )(x, jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)))
    outs = list(outs)
    payloads = (outs.pop(0) if rows else None, outs.pop(0) if cols else None)
    if not with_amax:
        return payloads
    # The reduction of the per-tile partials stays a small kernel of its own: fused into a
    # consumer (the amax history's concatenate) XLA ran it as a 0.25-0.5 ms loop on one H200.
    bits = jax.lax.optimization_barrier(jnp.max(outs.pop(0)))
    return (*payloads, jax.lax.bitcast_convert_type(bits, jnp.float32))
