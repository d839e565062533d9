"""Multi-tensor amax: ``max|x|`` of many differently-shaped tensors in ONE kernel launch.

Design (no extra copy of the data): every tensor stays its own kernel operand (a free
1-D reshape of its buffer). The launch has a 1-D grid over all chunks of all tensors,
tensor ``i`` owning the contiguous program range ``[start_i, start_i + count_i)`` (a
static table). Each program runs one static branch (``pl.when``) that streams its chunk
(``steps`` masked loads of ``tile`` elements in a rolled loop, an elementwise running
max in registers), reduces it and writes one int32 partial. A tiny segment-max over the
partials (a few thousand int32) gives the per-tensor amax. Concatenating the tensors into
one buffer instead would read and write every byte once more before the amax pass even
starts. The loop is rolled on purpose: with one branch per tensor, straight-line code
per branch grows the kernel by N copies (64 experts: hundreds of KB of SASS), and CTAs
of different tensors then thrash the instruction cache.

Integer max over bit patterns, not a float max: Triton lowers float max to ``maxnum``,
which silently drops NaNs; on the bit patterns of ``|x|`` the integer order is the IEEE
order with NaN above +inf, so NaNs propagate, and it is exact for denormals.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gtp_jax.base.shapes import round_up
from gtp_jax.pallas import _util
from gtp_jax.pallas.formats import SUPPORTED_DTYPES

#: Bytes of one load (16 bytes per thread with 4 warps), loads per program (rolled loop)
#: and loads per loop iteration (unrolled, independent); tuned on H200 (see the bench).
LOAD_BYTES = 2048
STEPS = 16
UNROLL = 2
NUM_WARPS = 4


def multi_amax_pallas(
    tensors: Sequence[jax.Array],
    *,
    interpret: bool,
    tile: int | None = None,
    steps: int = STEPS,
    unroll: int = UNROLL,
    num_warps: int = NUM_WARPS,
) -> jax.Array:
    """``max|t|`` of every tensor in `tensors`, in one Pallas (Triton) launch.

    Args:
      tensors: N >= 1 arrays of any shapes, float32 / bfloat16 / float16 (may differ).
      interpret: run the kernel in the Pallas interpreter (CPU) instead of compiling it.
      tile: elements per load (power of two); default ``LOAD_BYTES / itemsize``.
      steps: loads per program (a rolled loop; fewer for small tensors).
      unroll: loop iterations unrolled (independent loads in flight per thread).
      num_warps: Triton warps per program.
    Returns:
      float32[N]: amax per tensor (0 for an empty tensor, NaN if it holds a NaN, inf if it
      holds an inf and no NaN).
    """
    if not tensors:
        raise ValueError("tensors is empty; pass at least one array.")
    if tile is not None:
        _util.check_pow2(tile, "tile")
    _util.check_pow2(num_warps, "num_warps")
    for name, value in (("steps", steps), ("unroll", unroll)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1.")
    for i, t in enumerate(tensors):
        if np.dtype(t.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"tensors[{i}] has dtype {t.dtype}; supported: "
                            f"{[str(d) for d in SUPPORTED_DTYPES]}. Cast it first.")
        _util.check_size(t.size, f"tensors[{i}] (shape {t.shape})")

    live = [i for i, t in enumerate(tensors) if t.size > 0]
    if not live:
        return jnp.zeros((len(tensors),), jnp.float32)
    flats = [tensors[i].reshape(-1) for i in live]

    # Static plan per live tensor:
    # (first program, programs, tile, loads per program, loads per loop trip, size).
    plan = []
    start = 0
    for f in flats:
        t = tile or LOAD_BYTES // jnp.dtype(f.dtype).itemsize
        t = min(t, _util.next_pow2(f.size))
        u = min(unroll, pl.cdiv(f.size, t))  # loads per loop iteration
        k = round_up(min(steps, pl.cdiv(f.size, t)), u)  # loads per program
        count = pl.cdiv(f.size, t * k)
        plan.append((start, count, t, k, u, f.size))
        start += count
    num_programs = start

    def kernel(*refs):
        *in_refs, out_ref = refs
        pid = pl.program_id(0)
        for ref, (first, count, t, k, u, n) in zip(in_refs, plan):

            @pl.when((pid >= first) & (pid < first + count))
            def _(ref=ref, first=first, t=t, k=k, u=u, n=n):
                base = (pid - first) * (k * t)

                # Triton's scan lowering has no `unroll`: unroll by hand, u loads per trip.
                def step(i, acc):
                    for j in range(u):
                        offset = base + (i * u + j) * t
                        idx = offset + jax.lax.broadcasted_iota(jnp.int32, (t,), 0)
                        x = plgpu.load(ref.at[pl.ds(offset, t)], mask=idx < n, other=0)
                        # Masked lanes load 0, the identity of the max of |x| bit patterns.
                        acc = jnp.maximum(acc, _util.abs_bits(x.astype(jnp.float32)))
                    return acc

                acc = jax.lax.fori_loop(0, k // u, step, jnp.zeros((t,), jnp.int32))
                out_ref[...] = jnp.max(acc).reshape(1)

    partials = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_programs,), jnp.int32),
        grid=(num_programs,),
        out_specs=pl.BlockSpec((1,), lambda p: (p,)),
        interpret=interpret,
        compiler_params=_util.compiler_params(num_warps),
        name="gtp_multi_amax",
    )(*flats)
    segment = np.repeat(np.arange(len(flats), dtype=np.int32), [p[1] for p in plan])
    bits = jax.ops.segment_max(partials, jnp.asarray(segment), num_segments=len(flats),
                               indices_are_sorted=True)
    amax_live = jax.lax.bitcast_convert_type(bits, jnp.float32)
    if len(live) == len(tensors):
        return amax_live
    return jnp.zeros((len(tensors),), jnp.float32).at[np.asarray(live)].set(amax_live)
