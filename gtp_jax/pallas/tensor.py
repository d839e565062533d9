"""`QuantizedTensor` (the pytree a quantizer returns) and the block-row layout helpers.

Leaf layout for a logical tensor ``x`` of shape ``S`` quantized along ``dim`` (K =
``S[dim]``, ``Kp`` = K rounded up to the block size B, all other dims unchanged and in
their original order):

============  ==========================  ===========================  =================
format        payload                     block_scales                 global_scale
============  ==========================  ===========================  =================
``fp8``       e4m3fn, shape S             None                         float32[] ``s``
``mxfp8``     e4m3fn, S with K -> Kp      uint8 e8m0, S with K -> Kp/32  None
``nvfp4``     uint8, S with K -> Kp/2     e4m3fn, S with K -> Kp/16    float32[] ``g``
============  ==========================  ===========================  =================

The static (non-leaf) fields are the logical shape, the format name and ``dim``
(normalised to ``0 <= dim < ndim``). Because blocks only run along ``dim``,
concatenating the payloads and block scales of shards along any other dim gives the
QuantizedTensor of the concatenated tensor, provided every shard used the same global
scale (see `gtp_jax.pallas.quantize_coalesced` and `gtp_jax.pallas.gather_quantized`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gtp_jax.base.shapes import round_up
from gtp_jax.pallas.formats import SPECS


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """A low-precision tensor: payload, block scales, global scale + static metadata.

    Attributes:
      payload: e4m3fn (fp8, mxfp8) or packed-e2m1 uint8 (nvfp4); layout in the module doc.
      block_scales: per-block scales (uint8 e8m0 for mxfp8, e4m3fn for nvfp4; None for fp8).
      global_scale: float32[] per-tensor scale (fp8 ``448/amax``, nvfp4 ``2688/amax``;
        None for mxfp8). Replicated: never gather it.
      shape: logical (unpadded) shape of the tensor (static).
      format: "fp8", "mxfp8" or "nvfp4" (static).
      dim: block / contraction dim, ``0 <= dim < len(shape)`` (static).
    """

    payload: jax.Array
    block_scales: jax.Array | None
    global_scale: jax.Array | None
    shape: tuple[int, ...]
    format: str
    dim: int

    @property
    def nbytes(self) -> int:
        """Bytes of payload + block scales + global scale (what a gather moves, plus 4)."""
        leaves = (self.payload, self.block_scales, self.global_scale)
        return sum(int(leaf.size) * jnp.dtype(leaf.dtype).itemsize
                   for leaf in leaves if leaf is not None)

    @property
    def block(self) -> int:
        """Elements per block scale (0 for per-tensor fp8)."""
        return SPECS[self.format].block


jax.tree_util.register_dataclass(
    QuantizedTensor,
    data_fields=["payload", "block_scales", "global_scale"],
    meta_fields=["shape", "format", "dim"],
)


def to_block_rows(x: jax.Array, dim: int, block: int) -> jax.Array:
    """``x`` as ``[num_blocks, block]`` rows of consecutive elements along `dim`.

    Free (a reshape) when `dim` is the last dim and ``x.shape[dim] % block == 0``;
    otherwise XLA copies once (transpose and / or zero padding of the block dim).
    """
    xm = jnp.moveaxis(x, dim, -1)
    k = xm.shape[-1]
    kp = round_up(k, block)
    if kp != k:
        xm = jnp.pad(xm, [(0, 0)] * (xm.ndim - 1) + [(0, kp - k)])
    return xm.reshape(-1, block)


def from_block_rows(rows: jax.Array, shape: tuple[int, ...], dim: int) -> jax.Array:
    """Inverse layout of `to_block_rows` for a per-row result: ``rows`` is
    ``[num_blocks, w]`` (w = payload bytes per block) or ``[num_blocks]`` (one scale per
    block); returns it in `shape`'s dim order with `dim` of size blocks * w."""
    moved = shape[:dim] + shape[dim + 1:]
    out = rows.reshape(moved + (-1,))
    return jnp.moveaxis(out, -1, dim)


def leaf_rows(leaf: jax.Array, dim: int, width: int) -> jax.Array:
    """A stored leaf (payload or scales) back as ``[num_blocks, width]`` rows
    (``width=1`` gives ``[num_blocks]``)."""
    moved = jnp.moveaxis(leaf, dim, -1)
    return moved.reshape(-1) if width == 1 else moved.reshape(-1, width)


def slice_logical(values: jax.Array, shape: tuple[int, ...], dim: int) -> jax.Array:
    """Drops the block padding: ``values`` has `shape` except a padded `dim`."""
    if values.shape[dim] == shape[dim]:
        return values
    return jax.lax.slice_in_dim(values, 0, shape[dim], axis=dim)
