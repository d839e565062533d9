"""MXFP8 quantize kernel: block amax + e8m0 scale + e4m3 cast fused in one pass.

MXFP8 has no per-tensor scale, so quantize and cast-only are the same single-pass kernel:
each program loads ``rows`` blocks of 32 (a contiguous ``[rows, 32]`` tile of the
block-row view), reduces each block's amax on float32 bit patterns (NaN-propagating, see
`amax.py`), derives the shared exponent from the amax's exponent field with integer
arithmetic, multiplies by the exact power of two ``2**-E`` and casts with Triton's
RN-saturating fp32->e4m3 conversion after an explicit clamp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gtp_jax.pallas import _util
from gtp_jax.pallas.formats import (
    E4M3_EMAX,
    E4M3_MAX,
    E8M0_NAN,
    MXFP8_BLOCK,
    SUPPORTED_DTYPES,
)

ROWS = 256  # 8192 elements per program; tuned on H200 (see the bench sweep)
NUM_WARPS = 8


def quantize_mxfp8_pallas(
    rows: jax.Array,
    *,
    interpret: bool,
    rows_per_program: int = ROWS,
    num_warps: int = NUM_WARPS,
) -> tuple[jax.Array, jax.Array]:
    """MXFP8 of block rows (see `formats.mxfp8_cast_reference`).

    Args:
      rows: [nb, 32] float32 / bfloat16 / float16, one block per row
        (`tensor.to_block_rows`).
      interpret: run in the Pallas interpreter instead of compiling for the GPU.
      rows_per_program: blocks per program (power of two).
      num_warps: Triton warps per program.
    Returns:
      (payload e4m3fn [nb, 32], e8m0 scale bytes uint8 [nb]).
    """
    if rows.ndim != 2 or rows.shape[1] != MXFP8_BLOCK or rows.shape[0] == 0:
        raise ValueError(f"rows must have shape [num_blocks >= 1, {MXFP8_BLOCK}], "
                         f"got {rows.shape}; build it with tensor.to_block_rows.")
    if np.dtype(rows.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"rows has dtype {rows.dtype}; supported: "
                        f"{[str(d) for d in SUPPORTED_DTYPES]}.")
    _util.check_pow2(rows_per_program, "rows_per_program")
    _util.check_size(rows.size, f"rows (shape {rows.shape})")
    nb = rows.shape[0]
    r = min(rows_per_program, _util.next_pow2(nb))
    shape2 = (r, MXFP8_BLOCK)

    def kernel(x_ref, p_ref, s_ref):
        row0 = pl.program_id(0) * r
        row_mask = row0 + jax.lax.broadcasted_iota(jnp.int32, (r,), 0) < nb
        mask2 = jnp.broadcast_to(row_mask[:, None], shape2)
        xf = plgpu.load(x_ref.at[pl.ds(row0, r), :], mask=mask2, other=0)
        xf = xf.astype(jnp.float32)
        bmax_bits = jnp.max(_util.abs_bits(xf), axis=1)
        exp_field = bmax_bits >> 23  # 255: the block holds an inf or a NaN
        finite = exp_field < 255
        # Biased e8m0 byte = (floor(log2 amax) - 8) + 127 = exp_field - 8, >= 0 (E >= -127).
        scale_byte = jnp.maximum(exp_field - E4M3_EMAX, 0)
        # 2**-E as float32 bits: biased exponent 127 - E = 254 - scale_byte (in [8, 254]).
        inv = jax.lax.bitcast_convert_type((254 - scale_byte) << 23, jnp.float32)
        v = _util.saturate(xf * inv[:, None], E4M3_MAX)
        v = jnp.where(jnp.broadcast_to(finite[:, None], shape2), v, jnp.nan)
        scale_byte = jnp.where(finite, scale_byte, E8M0_NAN)
        plgpu.store(p_ref.at[pl.ds(row0, r), :], v.astype(jnp.float8_e4m3fn), mask=mask2)
        plgpu.store(s_ref.at[pl.ds(row0, r)], scale_byte.astype(jnp.uint8), mask=row_mask)

    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((nb, MXFP8_BLOCK), jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct((nb,), jnp.uint8)),
        grid=(pl.cdiv(nb, r),),
        interpret=interpret,
        compiler_params=_util.compiler_params(num_warps),
        name="gtp_quantize_mxfp8",
    )(rows)
