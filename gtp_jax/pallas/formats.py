"""Format definitions and the pure-JAX reference implementation (``backend="reference"``).

Every number format is defined here once, in plain `jax.numpy`; the Pallas kernels in
`amax.py`, `cast_fp8.py`, `cast_mxfp8.py` and `cast_nvfp4.py` must reproduce these
functions bit for bit on the same platform (the test suite checks it on fresh inputs).

Formats (``x`` is float32, bfloat16 or float16; all arithmetic below is float32 with
round-to-nearest-even (RN) unless stated otherwise):

``"fp8"`` (per-tensor scaling)
  * scale ``s = 448 / amax`` (float32; ``amax == 0 -> s = 1``; clamped to the largest
    finite float32 so a tiny amax cannot give ``s = inf``). This per-tensor division (and
    nvfp4's ``2688 / amax``) is XLA's, outside the kernels: on GPU it can differ from the
    correctly rounded quotient by an ulp; every kernel consumes the scale as given.
  * payload ``e4m3fn( clip(RN(x * s), -448, 448) )`` with RN (ties to even), i.e. a
    saturating cast. ``amax`` comes from ``x`` (current scaling) or from the caller
    (delayed scaling; values beyond it saturate to +-448).
  * decode ``x ~= payload * RN(1 / s)``.

``"mxfp8"`` (OCP Microscaling v1.0, MXFP8 E4M3)
  * blocks of 32 consecutive elements along ``dim`` (the contraction dim).
  * shared exponent ``E = max(floor(log2(block_amax)) - 8, -127)`` (8 = emax of e4m3);
    ``block_amax == 0`` or subnormal gives ``E = -127``.
  * scale stored as the e8m0 byte ``E + 127`` (uint8; 255 = NaN). View it as
    ``jnp.float8_e8m0fnu`` with ``jax.lax.bitcast_convert_type`` if a consumer needs it.
  * payload ``e4m3fn( clip(x * 2**-E, -448, 448) )`` (the power-of-two product is exact):
    OCP's rule may put a block's largest elements in [448, 512) * 2**E, which saturate to
    448 * 2**E (at most 12.5% relative error on those elements).
  * decode ``x ~= payload * 2**E``.

``"nvfp4"`` (two-level scaling as in NVIDIA's NVFP4)
  * global scale ``g = 2688 / amax`` (2688 = 448 * 6; ``amax == 0 -> g = 1``; clamped to
    ``2**100`` so every per-block factor below stays finite).
  * blocks of 16 consecutive elements along ``dim``; block scale
    ``bs = e4m3fn( min(RN(RN(block_amax * g) * C6), 448) )`` with ``C6 = RN(1/6)``
    (RN, saturating).
  * element factor ``r = RN(g * inv(bs))`` where ``inv(bs) = RN(1 / bs)`` is exact per
    e4m3 code (a 256-entry table; ``inv = 0`` when ``bs == 0``, i.e. the whole block is
    below e4m3's resolution and encodes as zeros). No division is evaluated at run time:
    XLA:GPU's float32 division is not always correctly rounded (nor is Triton's), and it
    may be rewritten differently in different programs; products are.
  * payload code = sign bit (bit 3) | e2m1 magnitude of ``min(RN(|x| * r), 6)`` rounded to
    nearest, ties to even, over {0, 0.5, 1, 1.5, 2, 3, 4, 6}; a negative zero or a negative
    value rounding to zero keeps its sign (code 8).
  * packed two codes per byte along ``dim``: the even element (index 2j) in the LOW
    nibble, the odd element (2j+1) in the HIGH nibble (the ml_dtypes / NVIDIA convention).
  * decode ``x ~= (e2m1(code) * bs) * RN(1 / g)``.

Padding: the block dim is zero-padded to a multiple of the block size (zeros never
change a block amax); the logical shape is kept and `dequantize` slices the padding off.

NaN / Inf policy (identical in the kernels and here):
  * amax is the IEEE maximum of ``|x|``: NaN if any element is NaN, else +inf if any
    element is infinite. It is computed on the float32 bit patterns, so it is exact even
    where the platform flushes denormals (XLA:CPU does, for arithmetic).
  * a non-finite amax (per tensor or per block) always yields a NaN scale (fp8 ``s``,
    nvfp4 ``g``, mxfp8 byte 255, nvfp4 e4m3 block scale NaN), never a finite one, so every
    element it governs dequantizes to NaN.
  * non-finite elements encode as NaN in e4m3 payloads (fp8, mxfp8: the whole block is
    NaN, as its scale is); e2m1 has no NaN, so nvfp4 carries the NaN in the block scale
    and stores code 0 for every element of a non-finite block.
  * the eager API (`gtp_jax.pallas.quantize` & co. called outside `jax.jit`) raises a
    ValueError when a scale would be non-finite; under tracing nothing raises and the NaN
    propagates to the dequantized weights.

Denormal inputs follow the platform: XLA:CPU (interpret mode) flushes float32 denormals to
zero in arithmetic, GPUs keep them; kernels and reference agree on each platform.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

FORMATS: tuple[str, ...] = ("fp8", "mxfp8", "nvfp4")
BACKENDS: tuple[str, ...] = ("pallas", "reference")
#: Input dtypes the quantizers accept.
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))

E4M3_MAX = 448.0
E4M3_EMAX = 8  # floor(log2(448))
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL_EXP = -6  # subnormal spacing 2**-9
E2M1_MAX = 6.0
#: The 8 non-negative e2m1 values, indexed by the 3-bit magnitude code.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
E8M0_NAN = 255
E8M0_MIN_EXP = -127
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
NVFP4_GLOBAL_MAX = E4M3_MAX * E2M1_MAX  # 2688
NVFP4_GLOBAL_SCALE_CAP = 2.0**100
#: float32 RN(1/6): nvfp4 block scales are RN(RN(block_amax * g) * C6).
NVFP4_C6 = float(np.float32(1.0) / np.float32(6.0))
F32_MAX = float(np.finfo(np.float32).max)
#: Largest tensor (elements) a kernel accepts: Triton offsets are int32.
MAX_ELEMENTS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """Static description of one format's storage.

    Attributes:
      name: "fp8", "mxfp8" or "nvfp4".
      block: elements per block scale along the block dim (0: one per-tensor scale).
      elems_per_byte: payload elements per stored byte (2 for packed e2m1).
      payload_dtype: dtype of `QuantizedTensor.payload`.
      block_scale_dtype: dtype of `QuantizedTensor.block_scales` (None: no block scales).
      has_global_scale: whether `QuantizedTensor.global_scale` is a float32 scalar.
    """

    name: str
    block: int
    elems_per_byte: int
    payload_dtype: np.dtype
    block_scale_dtype: np.dtype | None
    has_global_scale: bool


SPECS: dict[str, FormatSpec] = {
    "fp8": FormatSpec("fp8", 0, 1, np.dtype(jnp.float8_e4m3fn), None, True),
    "mxfp8": FormatSpec("mxfp8", MXFP8_BLOCK, 1, np.dtype(jnp.float8_e4m3fn),
                        np.dtype(jnp.uint8), False),
    "nvfp4": FormatSpec("nvfp4", NVFP4_BLOCK, 2, np.dtype(jnp.uint8),
                        np.dtype(jnp.float8_e4m3fn), True),
}


# --------------------------------------------------------------------------- scales


def _abs_bits(xf: jax.Array) -> jax.Array:
    """int32 bit patterns of ``|xf|``: their integer order is the IEEE order of the
    magnitudes, with NaN above +inf (so an integer max propagates NaN)."""
    return jax.lax.bitcast_convert_type(xf, jnp.int32) & jnp.int32(0x7FFFFFFF)


def amax_reference(x: jax.Array) -> jax.Array:
    """``max |x|`` as a float32 scalar (0 for an empty tensor; NaN if any NaN).

    Args:
      x: any shape, float32 / bfloat16 / float16.
    Returns:
      float32[] (exact: computed on bit patterns, immune to denormal flushing).
    """
    if x.size == 0:
        return jnp.zeros((), jnp.float32)
    bits = jnp.max(_abs_bits(x.astype(jnp.float32)))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def fp8_scale(amax: jax.Array) -> jax.Array:
    """fp8 per-tensor scale ``448 / amax`` (float32[]; 1 for amax 0; NaN for non-finite)."""
    amax = jnp.asarray(amax, jnp.float32)
    positive = amax > 0
    s = jnp.where(positive, E4M3_MAX / jnp.where(positive, amax, 1.0), 1.0)
    s = jnp.minimum(s, F32_MAX)
    return jnp.where(jnp.isfinite(amax), s, jnp.nan).astype(jnp.float32)


def nvfp4_global_scale(amax: jax.Array) -> jax.Array:
    """nvfp4 global scale ``2688 / amax`` (float32[]; 1 for amax 0; capped at 2**100;
    NaN for a non-finite amax)."""
    amax = jnp.asarray(amax, jnp.float32)
    positive = amax > 0
    g = jnp.where(positive, NVFP4_GLOBAL_MAX / jnp.where(positive, amax, 1.0), 1.0)
    g = jnp.minimum(g, NVFP4_GLOBAL_SCALE_CAP)
    return jnp.where(jnp.isfinite(amax), g, jnp.nan).astype(jnp.float32)


# --------------------------------------------------------------------------- casts


def fp8_cast_reference(x: jax.Array, scale: jax.Array) -> jax.Array:
    """fp8 payload of `x` (any shape) for the float32 scalar `scale`: e4m3fn, same shape."""
    xf = x.astype(jnp.float32)
    v = jnp.clip(xf * scale, -E4M3_MAX, E4M3_MAX)
    v = jnp.where(jnp.isfinite(xf), v, jnp.nan)
    return v.astype(jnp.float8_e4m3fn)


def mxfp8_cast_reference(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MXFP8 of block rows.

    Args:
      rows: [nb, 32] float; each row is one block (see `tensor.to_block_rows`).
    Returns:
      (payload e4m3fn [nb, 32], e8m0 scale bytes uint8 [nb]).
    """
    xf = rows.astype(jnp.float32)
    bmax_bits = jnp.max(_abs_bits(xf), axis=-1)
    finite = bmax_bits < 0x7F800000
    # floor(log2(m)) of a normal float32 m is its unbiased exponent field; subnormal and
    # zero block maxima clamp to the smallest e8m0 exponent anyway.
    shared = jnp.maximum((bmax_bits >> 23) - 127 - E4M3_EMAX, E8M0_MIN_EXP)
    scale_byte = jnp.where(finite, shared + E8M0_BIAS, E8M0_NAN).astype(jnp.uint8)
    inv = jnp.ldexp(jnp.ones_like(bmax_bits, jnp.float32), -shared)  # 2**-E, normal, exact
    v = jnp.clip(xf * inv[:, None], -E4M3_MAX, E4M3_MAX)
    v = jnp.where(finite[:, None], v, jnp.nan)
    return v.astype(jnp.float8_e4m3fn), scale_byte


#: Midpoints between neighbouring e2m1 values and whether a tie rounds up (to the
#: neighbour with an even code, i.e. a zero mantissa bit).
E2M1_MIDPOINTS: tuple[tuple[float, bool], ...] = (
    (0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
    (5.0, False))


def e2m1_magnitude_reference(q: jax.Array) -> jax.Array:
    """3-bit e2m1 magnitude code (int32) of float32 ``q`` in [0, 6]: RN ties-to-even, as
    the number of midpoints below ``q`` (pure float32 comparisons: no float4 round trip
    that XLA could elide, and independent of the kernels' bit arithmetic)."""
    return sum(((q >= m) if up else (q > m)).astype(jnp.int32) for m, up in E2M1_MIDPOINTS)


def _e4m3_inverse_table() -> np.ndarray:
    values = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(values == 0, np.float32(0), np.float32(1) / values)
    return inv.astype(np.float32)


#: float32 RN(1 / v) for every e4m3fn code v (0 for +-0, NaN for NaN), by numpy (IEEE).
E4M3_INVERSE = _e4m3_inverse_table()


def e4m3_bits_to_f32(bits: jax.Array) -> jax.Array:
    """float32 value of e4m3fn bit patterns (uint8), decoded with integer arithmetic.

    Used where a reference computes with a value it has just rounded to e4m3: reading
    the stored bits keeps XLA from eliding the float32 -> e4m3 -> float32 round trip
    (``--xla_allow_excess_precision``, default on, allows that inside a fusion on GPU).
    """
    b = bits.astype(jnp.int32)
    sign = jnp.where(b >= 128, -1.0, 1.0).astype(jnp.float32)
    exp = (b >> 3) & 15
    man = b & 7
    normal = jax.lax.bitcast_convert_type(((exp + 120) << 23) | (man << 20), jnp.float32)
    value = jnp.where(exp == 0, man.astype(jnp.float32) * 2.0**-9, normal)
    return jnp.where((exp == 15) & (man == 7), jnp.nan, sign * value)


def nvfp4_cast_reference(rows: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NVFP4 of block rows.

    Args:
      rows: [nb, 16] float; each row is one block.
      g: float32[] global scale (`nvfp4_global_scale`).
    Returns:
      (packed payload uint8 [nb, 8] (low nibble = even element), e4m3fn block scales [nb]).
    """
    g = jnp.asarray(g, jnp.float32)
    xf = rows.astype(jnp.float32)
    bmax = jax.lax.bitcast_convert_type(jnp.max(_abs_bits(xf), axis=-1), jnp.float32)
    bsf = jnp.minimum((bmax * g) * jnp.float32(NVFP4_C6), E4M3_MAX)
    bsf = jnp.where(jnp.isfinite(bmax), bsf, jnp.nan)
    bs8 = bsf.astype(jnp.float8_e4m3fn)
    # Read the stored bits back: no float32 -> e4m3 -> float32 round trip XLA could elide.
    bits = jax.lax.bitcast_convert_type(bs8, jnp.uint8)
    ok = ~jnp.isnan(e4m3_bits_to_f32(bits))
    r = g * jnp.take(jnp.asarray(E4M3_INVERSE), bits.astype(jnp.int32))
    q = jnp.minimum(jnp.abs(xf) * r[:, None], E2M1_MAX)
    mag = e2m1_magnitude_reference(q)
    code = jnp.where(ok[:, None], mag + 8 * jnp.signbit(xf).astype(jnp.int32), 0)
    pairs = code.reshape(code.shape[0], -1, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)
    return packed, bs8


# --------------------------------------------------------------------------- decoding


def e2m1_decode(codes: jax.Array) -> jax.Array:
    """float32 values of 4-bit e2m1 codes (int, bit 3 = sign)."""
    table = jnp.asarray(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), jnp.float32)
    return jnp.take(table, codes.astype(jnp.int32) & 15)


def e8m0_decode(scale_bytes: jax.Array) -> jax.Array:
    """float32 ``2**(b - 127)`` of e8m0 bytes (NaN for 255; 2**-127 is a denormal)."""
    b = scale_bytes.astype(jnp.int32)
    normal = jax.lax.bitcast_convert_type(jnp.maximum(b, 1) << 23, jnp.float32)
    value = jnp.where(b == 0, jnp.float32(2.0**-127), normal)
    return jnp.where(b == E8M0_NAN, jnp.nan, value)


def fp8_decode(payload: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 ``payload * (1 / scale)`` (any shape).

    Multiplying by the reciprocal (not dividing) on purpose: XLA may rewrite a division by
    a broadcast scalar into exactly this in some contexts and not others, which would make
    the same weights decode differently in and out of ``shard_map``.
    """
    return payload.astype(jnp.float32) * (1.0 / scale)


def mxfp8_decode(payload_rows: jax.Array, scale_bytes: jax.Array) -> jax.Array:
    """float32 values of MXFP8 block rows ([nb, 32] e4m3fn, [nb] uint8)."""
    return payload_rows.astype(jnp.float32) * e8m0_decode(scale_bytes)[:, None]


def nvfp4_decode(packed_rows: jax.Array, block_scales: jax.Array,
                 g: jax.Array) -> jax.Array:
    """float32 values of NVFP4 block rows ([nb, 8] uint8, [nb] e4m3fn, float32[]) -> [nb, 16]:
    ``(e2m1 * bs) * (1 / g)`` (the first product is exact; reciprocal as in `fp8_decode`)."""
    p = packed_rows.astype(jnp.int32)
    codes = jnp.stack([p & 15, p >> 4], axis=-1).reshape(p.shape[0], -1)
    bs = block_scales.astype(jnp.float32)
    return (e2m1_decode(codes) * bs[:, None]) * (1.0 / g)
