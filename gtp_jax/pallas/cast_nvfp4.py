"""NVFP4 cast kernel: block amax + e4m3 block scale + e2m1 cast + nibble packing, one pass.

Given the per-tensor global scale ``g`` (from the tensor amax: computed by the one-launch
amax kernel for a fused quantize, or agreed across devices for the coalesced path), each
program loads ``rows`` blocks of 16 (a contiguous ``[rows, 16]`` tile), computes the block
scales, encodes every element and packs pairs into bytes (even element in the low nibble)
with a reshape to ``[rows, 8, 2]`` and a split of the last dim (Triton's ``tt.split``).

Exactness vs the reference (`formats.nvfp4_cast_reference`):
  * no division: Triton lowers an f32 division to the approximate ``div.full.f32``. The
    per-block factor is ``g * RN(1/bs)``, and ``RN(1/bs)`` of an e4m3 value
    ``2**(e-7) * (8+m)/8`` is ``2**(7-e) * RN(8/(8+m))`` (or ``2**9 * RN(1/m)`` for
    subnormals): an 8-entry constant table picked with 3 selects on the mantissa bits,
    scaled by an exact power of two built from the exponent bits (once per block).
  * Hopper has no fp32->e2m1 instruction; the rounding is integer arithmetic on the
    float32 bits: for q >= 1 round the mantissa to 1 bit (add ``0x1FFFFF`` + the kept
    LSB, shift by 22: ties to even, carries into the exponent), for q < 1 the code is
    ``RN(2q)`` via the ``+2**23`` trick (2q is exact, so FMA contraction cannot change
    it). The tests check this against XLA's float4_e2m1fn conversion.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gtp_jax.pallas import _util
from gtp_jax.pallas.formats import (
    E2M1_MAX,
    E4M3_MAX,
    NVFP4_BLOCK,
    NVFP4_C6,
    SUPPORTED_DTYPES,
)

ROWS = 128  # 2048 elements per program; tuned on H200 (see the bench sweep)
NUM_WARPS = 4


def e2m1_magnitude_bits(q: jax.Array) -> jax.Array:
    """int32 3-bit e2m1 magnitude code of float32 ``q`` in [0, 6] (RN, ties to even), by
    integer arithmetic on the float32 bits (usable inside a Triton kernel)."""
    qb = jax.lax.bitcast_convert_type(q, jnp.int32)
    # q >= 1: keep 1 mantissa bit with round-half-even; (bits >> 22) is then
    # (biased f32 exponent << 1 | mantissa bit) = e2m1 code + ((127 - 1) << 1), and the
    # 252 is subtracted before the shift (exact: a multiple of 2**22) to save an op.
    normal = (qb + (0x1FFFFF - (252 << 22)) + ((qb >> 22) & 1)) >> 22
    # q < 1: code = RN(2 q) in {0, 1, 2}; adding 2**23 rounds to an integer (ties even).
    sub = jax.lax.bitcast_convert_type(q * 2.0 + 8388608.0, jnp.int32) - 0x4B000000
    return jnp.where(q < 1.0, sub, normal)


#: RN(8 / (8 + m)): 1 / (1 + m/8) for normal e4m3 mantissas m = 0..7.
_INV_NORMAL = tuple(float(np.float32(8) / np.float32(8 + m)) for m in range(8))
#: RN(1 / m) for subnormal e4m3 mantissas (m = 0 encodes zero: factor 0).
_INV_SUBNORMAL = (0.0,) + tuple(float(np.float32(1) / np.float32(m)) for m in range(1, 8))


def e4m3_inverse_bits(bits: jax.Array) -> jax.Array:
    """float32 ``RN(1 / v)`` of e4m3fn codes (int32 bit patterns, non-negative values),
    0 for zero; garbage for NaN codes (the caller masks those blocks). Exact: no division.
    """
    e = (bits >> 3) & 15
    m = bits & 7

    def pick(table):  # a 3-level select tree on the mantissa bits
        b0, b1, b2 = (m & 1) != 0, (m & 2) != 0, (m & 4) != 0
        l0 = [jnp.where(b0, jnp.float32(table[2 * k + 1]), jnp.float32(table[2 * k]))
              for k in range(4)]
        l1 = [jnp.where(b1, l0[1], l0[0]), jnp.where(b1, l0[3], l0[2])]
        return jnp.where(b2, l1[1], l1[0])

    pow2 = jax.lax.bitcast_convert_type((134 - e) << 23, jnp.float32)  # 2**(7-e), e >= 1
    return jnp.where(e == 0, pick(_INV_SUBNORMAL) * jnp.float32(512.0),
                     pick(_INV_NORMAL) * pow2)


def cast_nvfp4_pallas(
    rows: jax.Array,
    global_scale: jax.Array,
    *,
    interpret: bool,
    rows_per_program: int = ROWS,
    num_warps: int = NUM_WARPS,
    bf16_pairs: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """NVFP4 of block rows for a given global scale (see `formats.nvfp4_cast_reference`).

    Args:
      rows: [nb, 16] float32 / bfloat16 / float16, one block per row.
      global_scale: float32 scalar ``g`` (`formats.nvfp4_global_scale`).
      interpret: run in the Pallas interpreter instead of compiling for the GPU.
      rows_per_program: blocks per program (power of two).
      num_warps: Triton warps per program.
      bf16_pairs: for bfloat16 rows, read each (even, odd) element pair as one uint32
        (a free bitcast outside the kernel) and widen both halves with a shift / mask:
        no in-kernel reshape + split is needed to pack the nibbles.
    Returns:
      (packed payload uint8 [nb, 8] (low nibble = even element), e4m3fn block scales [nb]).
    """
    if rows.ndim != 2 or rows.shape[1] != NVFP4_BLOCK or rows.shape[0] == 0:
        raise ValueError(f"rows must have shape [num_blocks >= 1, {NVFP4_BLOCK}], "
                         f"got {rows.shape}; build it with tensor.to_block_rows.")
    if np.dtype(rows.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"rows has dtype {rows.dtype}; supported: "
                        f"{[str(d) for d in SUPPORTED_DTYPES]}.")
    if jnp.shape(global_scale) != ():
        raise ValueError(f"global_scale must be a scalar, got shape {jnp.shape(global_scale)}.")
    _util.check_pow2(rows_per_program, "rows_per_program")
    _util.check_size(rows.size, f"rows (shape {rows.shape})")
    nb = rows.shape[0]
    r = min(rows_per_program, _util.next_pow2(nb))
    half = NVFP4_BLOCK // 2
    pairs = bf16_pairs and rows.dtype == jnp.bfloat16
    width = half if pairs else NVFP4_BLOCK

    def kernel(x_ref, g_ref, p_ref, s_ref):
        g = g_ref[0]
        row0 = pl.program_id(0) * r
        row_mask = row0 + jax.lax.broadcasted_iota(jnp.int32, (r,), 0) < nb
        x = plgpu.load(x_ref.at[pl.ds(row0, r), :], other=0,
                       mask=jnp.broadcast_to(row_mask[:, None], (r, width)))
        if pairs:  # bf16 -> f32 is a 16-bit shift: low half = even element
            parts = [jax.lax.bitcast_convert_type(x << 16, jnp.float32),
                     jax.lax.bitcast_convert_type(x & jnp.uint32(0xFFFF0000), jnp.float32)]
        else:
            parts = [x.astype(jnp.float32)]
        xbits = [jax.lax.bitcast_convert_type(p, jnp.int32) for p in parts]
        ab = [b & jnp.int32(0x7FFFFFFF) for b in xbits]
        bmax_bits = jnp.max(ab[0], axis=1)
        for a in ab[1:]:
            bmax_bits = jnp.maximum(bmax_bits, jnp.max(a, axis=1))
        bmax = jax.lax.bitcast_convert_type(bmax_bits, jnp.float32)
        bsf = (bmax * g) * jnp.float32(NVFP4_C6)
        bsf = jnp.where(bsf > E4M3_MAX, jnp.float32(E4M3_MAX), bsf)
        bsf = jnp.where(bmax_bits < 0x7F800000, bsf, jnp.nan)
        bs8 = bsf.astype(jnp.float8_e4m3fn)
        bs_bits = jax.lax.bitcast_convert_type(bs8, jnp.uint8).astype(jnp.int32)
        ok = (bs_bits & 0x7F) != 0x7F  # False for NaN: non-finite block or NaN g
        ratio = (g * e4m3_inverse_bits(bs_bits))[:, None]
        codes = []
        for a, b in zip(ab, xbits):
            q = jax.lax.bitcast_convert_type(a, jnp.float32) * ratio
            # min: NaN handling differs from XLA here (maxnum), but q is only NaN in
            # blocks whose codes are zeroed below.
            q = jnp.minimum(q, jnp.float32(E2M1_MAX))
            codes.append(e2m1_magnitude_bits(q) | ((b >> 28) & 8))  # sign bit -> bit 3
        if pairs:
            lo, hi = codes
        else:
            lo, hi = jnp.unstack(codes[0].reshape(r, half, 2), axis=-1)
        packed = jnp.where(jnp.broadcast_to(ok[:, None], (r, half)), lo | (hi << 4), 0)
        plgpu.store(p_ref.at[pl.ds(row0, r), :], packed.astype(jnp.uint8),
                    mask=jnp.broadcast_to(row_mask[:, None], (r, half)))
        plgpu.store(s_ref.at[pl.ds(row0, r)], bs8, mask=row_mask)

    scalars = jnp.reshape(jnp.asarray(global_scale, jnp.float32), (1,))
    if pairs:
        rows = jax.lax.bitcast_convert_type(rows.reshape(nb, half, 2), jnp.uint32)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((nb, half), jnp.uint8),
                   jax.ShapeDtypeStruct((nb,), jnp.float8_e4m3fn)),
        grid=(pl.cdiv(nb, r),),
        interpret=interpret,
        compiler_params=_util.compiler_params(num_warps),
        name="gtp_cast_nvfp4",
    )(rows, scalars)
