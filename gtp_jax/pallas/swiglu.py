"""The SwiGLU backward pass as one Pallas (Triton) kernel, beside its pure-JAX reference.

``h = silu(gate) * up`` with ``gate_up = [gate | up]`` (``[..., 2 * f]``). Its gradient
reads both halves and the output gradient and writes both halves of ``d gate_up``. XLA
fuses the reference into one loop fusion, but that fusion reads each input element twice
(once per output half) and runs well below the copy bandwidth; the kernel loads a tile of
each half and of the output gradient once and stores both gradient tiles.

Layout: ``gate_up`` is viewed as ``[M, 2, f]`` (a free reshape) and tiled ``[bm, 2, bn]``
with ``bn`` a power of two dividing ``f`` and ``bm`` one dividing ``M``; shapes with no
such tiles of useful size run the reference (`swiglu_bwd` with ``backend=None``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.pallas import _util

#: ``backend`` values of `swiglu_bwd` (None: the kernel on a GPU where the shape tiles).
SWIGLU_BACKENDS = ("pallas", "reference")
_MAX_COLS = 512  # widest column tile
_TILE_ELEMENTS = 16384  # elements of gate_up per program
_MIN_COLS = 64  # narrower column tiles waste the GPU: the reference runs instead


def check_backend(backend: object, caller: str) -> None:
    """A `UsageError` naming `caller` unless `backend` is in `SWIGLU_BACKENDS` or None."""
    _util.check_backend_choice(backend, SWIGLU_BACKENDS, caller)


def _grad_halves(gate: jax.Array, up: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 ``(d gate, d up)`` from float32 gate, up and output gradient ``g``."""
    sig = jax.nn.sigmoid(gate)
    # d/d gate = g * up * silu'(gate); d/d up = g * silu(gate)
    return g * up * sig * (1.0 + gate * (1.0 - sig)), g * gate * sig


def swiglu_bwd_reference(gate_up: jax.Array, g: jax.Array) -> jax.Array:
    """Pure-JAX gradient of ``silu(gate) * up`` w.r.t. ``gate_up`` (shapes: `swiglu_bwd`)."""
    *lead, two_f = gate_up.shape
    f = two_f // 2
    x = gate_up.astype(jnp.float32).reshape(*lead, 2, f)
    # Every output element reads its own value and its partner in the other half (a flip
    # of the size-2 axis): no value is shared between elements, so XLA emits one loop
    # fusion with no float32 intermediate and no concatenate.
    is_gate = jax.lax.broadcasted_iota(jnp.int32, (2, 1), 0) == 0
    partner = jnp.flip(x, axis=-2)
    gate = jnp.where(is_gate, x, partner)
    up = jnp.where(is_gate, partner, x)
    d_gate, d_up = _grad_halves(gate, up, g.astype(jnp.float32)[..., None, :])
    grad = jnp.where(is_gate, d_gate, d_up)
    return grad.reshape(gate_up.shape).astype(gate_up.dtype)


def tiles(gate_up_shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The kernel's ``(bm, bn)`` tile for a ``gate_up`` shape, or None if it has none of
    useful size (``f`` without a power-of-two divisor >= 64)."""
    *lead, two_f = gate_up_shape
    f = two_f // 2
    m = math.prod(lead)
    bn = min(_MAX_COLS, f & -f)  # largest power of two dividing f
    if bn < _MIN_COLS or m < 1:
        return None
    bm = min(m & -m, max(1, _TILE_ELEMENTS // (2 * bn)))
    return bm, bn


def swiglu_bwd(gate_up: jax.Array, g: jax.Array, *, backend: str | None = None,
               num_warps: int = 8, interpret: bool | None = None) -> jax.Array:
    """Gradient of ``silu(gate) * up`` with respect to ``gate_up = [gate | up]``.

    Computes in float32. Same math as `swiglu_bwd_reference` (the kernel body calls the
    same elementwise formula).

    Args:
      gate_up: ``[..., 2 * f]``, float32 / bfloat16 / float16.
      g: gradient of the output, ``[..., f]`` (same leading shape), any float dtype.
      backend: "pallas" (the kernel; a `UsageError` if the shape has no tile, see
        `tiles`), "reference", or None: the kernel when the default backend is a GPU and
        the shape has a tile, else the reference.
      num_warps: Triton warps per program (kernel only).
      interpret: run the kernel in the Pallas interpreter (None: unless on a GPU).

    Returns:
      ``[..., 2 * f]`` in the dtype of `gate_up`.
    """
    for name, x in (("gate_up", gate_up), ("g", g)):
        if not hasattr(x, "shape") or not jnp.issubdtype(x.dtype, jnp.floating):
            raise UsageTypeError(f"swiglu_bwd: {name} must be a float array, got "
                                 f"{getattr(x, 'dtype', type(x).__name__)}.")
    if gate_up.ndim < 1 or gate_up.shape[-1] % 2 or \
            tuple(g.shape) != (*gate_up.shape[:-1], gate_up.shape[-1] // 2):
        raise UsageError(f"swiglu_bwd: gate_up {tuple(gate_up.shape)} must be [..., 2 * f] "
                         f"and g {tuple(g.shape)} [..., f] with the same leading shape.")
    check_backend(backend, "swiglu_bwd")
    tile = tiles(tuple(gate_up.shape))
    if backend is None:
        backend = "pallas" if tile is not None and jax.default_backend() == "gpu" \
            else "reference"
    if backend == "reference":
        return swiglu_bwd_reference(gate_up, g)
    if tile is None:
        raise UsageError(
            f"swiglu_bwd: backend='pallas' needs f = {gate_up.shape[-1] // 2} to have a "
            f"power-of-two divisor >= {_MIN_COLS}; use backend=None or 'reference'.")
    return _swiglu_bwd_pallas(gate_up, g, tile, num_warps, _util.resolve_interpret(interpret))


def _swiglu_bwd_pallas(gate_up: jax.Array, g: jax.Array, tile: tuple[int, int],
                       num_warps: int, interpret: bool) -> jax.Array:
    *lead, two_f = gate_up.shape
    f = two_f // 2
    m = gate_up.size // two_f
    bm, bn = tile
    x = gate_up.reshape(m, 2, f)

    def kernel(x_ref, g_ref, o_ref):
        d_gate, d_up = _grad_halves(x_ref[:, 0, :].astype(jnp.float32),
                                    x_ref[:, 1, :].astype(jnp.float32),
                                    g_ref[...].astype(jnp.float32))
        o_ref[:, 0, :] = d_gate.astype(o_ref.dtype)
        o_ref[:, 1, :] = d_up.astype(o_ref.dtype)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, gate_up.dtype),
        grid=(m // bm, f // bn),
        in_specs=[pl.BlockSpec((bm, 2, bn), lambda i, j: (i, 0, j)),
                  pl.BlockSpec((bm, bn), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((bm, 2, bn), lambda i, j: (i, 0, j)),
        interpret=interpret,
        compiler_params=_util.compiler_params(num_warps),
        name="swiglu_bwd",  # the kernel's name in GPU traces
    )(x, g.reshape(m, f))
    return out.reshape(gate_up.shape)
