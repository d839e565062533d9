"""fp8 (e4m3fn, per-tensor scale) cast-only kernel.

One program per tile of the flattened tensor; no padding (the payload has the tensor's
shape), bounds are masked. The per-tensor scale needs the global amax first, so the
"fused" fp8 quantize is this kernel after the one-launch amax kernel (`amax.py`): two
passes over ``x``, there is no grid-wide barrier in a Triton kernel to do it in one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gtp_jax.pallas import _util
from gtp_jax.pallas.formats import E4M3_MAX, SUPPORTED_DTYPES

TILE = 4096  # tuned on H200 (see the bench sweep)
NUM_WARPS = 8


def cast_fp8_pallas(
    x: jax.Array,
    scale: jax.Array,
    *,
    interpret: bool,
    tile: int = TILE,
    num_warps: int = NUM_WARPS,
) -> jax.Array:
    """e4m3fn payload ``sat(RN(x * scale))`` (see `formats.fp8_cast_reference`).

    Args:
      x: any shape (>= 1 element), float32 / bfloat16 / float16.
      scale: float32 scalar (``448 / amax``; NaN propagates to every element).
      interpret: run in the Pallas interpreter instead of compiling for the GPU.
      tile: elements per program (power of two).
      num_warps: Triton warps per program.
    Returns:
      e4m3fn array of ``x.shape``.
    """
    if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; supported: "
                        f"{[str(d) for d in SUPPORTED_DTYPES]}.")
    if x.size == 0:
        raise ValueError(f"x has shape {x.shape} (no elements); nothing to cast.")
    if jnp.shape(scale) != ():
        raise ValueError(f"scale must be a scalar, got shape {jnp.shape(scale)}.")
    _util.check_pow2(tile, "tile")
    _util.check_size(x.size, f"x (shape {x.shape})")
    flat = x.reshape(-1)
    n = flat.size
    t = min(tile, _util.next_pow2(n))

    def kernel(x_ref, s_ref, o_ref):
        offset = pl.program_id(0) * t
        mask = offset + jax.lax.broadcasted_iota(jnp.int32, (t,), 0) < n
        xf = plgpu.load(x_ref.at[pl.ds(offset, t)], mask=mask, other=0).astype(jnp.float32)
        v = _util.saturate(xf * s_ref[0], E4M3_MAX)
        v = jnp.where(_util.abs_bits(xf) < 0x7F800000, v, jnp.nan)  # inf/NaN -> NaN
        plgpu.store(o_ref.at[pl.ds(offset, t)], v.astype(jnp.float8_e4m3fn), mask=mask)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n,), jnp.float8_e4m3fn),
        grid=(pl.cdiv(n, t),),
        interpret=interpret,
        compiler_params=_util.compiler_params(num_warps),
        name="gtp_cast_fp8",
    )(flat, jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)))
    return out.reshape(x.shape)
