"""Coalesced (split-phase) quantization of many shards and the quantized all-gather.

Inside ``jax.shard_map`` every device holds 1/N of each weight. For formats with a
per-tensor scale (fp8, nvfp4) all shards of a weight must share ONE scale, otherwise the
gathered payloads would not decode consistently. `quantize_coalesced` agrees on them
for all tensors at once:

  1. local amax of every shard: `multi_amax` (one kernel launch for all tensors);
  2. ONE ``pmax`` of the float32[N] vector over the mesh axis (a single all-reduce,
     whatever N is), done on the int32 bit patterns so NaN wins on every backend (NCCL's
     float max would drop it);
  3. `cast_only` of every shard with its agreed amax.

MXFP8 has no per-tensor scale: its shards are quantized locally, no collective at all.
`gather_quantized` then all-gathers payload and block scales along the shard dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gtp_jax.pallas import _util, api
from gtp_jax.pallas.tensor import QuantizedTensor

AxisName = Any  # a mesh axis name or a tuple of names


def reduce_amax(amax: jax.Array, axis_name: AxisName) -> jax.Array:
    """Phase 2: max over the mesh axis of a float32[N] amax vector, ONE all-reduce.

    Args:
      amax: float32[N] local amaxes (>= 0 or NaN), inside ``shard_map``.
      axis_name: mesh axis (or tuple of axes) the tensors are sharded over, e.g. "gtp".
    Returns:
      float32[N], identical on every device of the axis (NaN if any device saw a NaN).
    """
    bits = jax.lax.bitcast_convert_type(jnp.asarray(amax, jnp.float32), jnp.int32)
    bits = jax.lax.pmax(bits & jnp.int32(0x7FFFFFFF), axis_name)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def quantize_coalesced(
    tensors: Sequence[jax.Array],
    format: str,
    axis_name: AxisName,
    *,
    dim: int | Sequence[int] = -1,
    backend: str = "pallas",
    interpret: bool | None = None,
) -> list[QuantizedTensor]:
    """Quantizes local shards of N tensors with scales agreed over `axis_name`.

    Call inside ``jax.shard_map`` (or any context binding `axis_name`). Issues one amax
    kernel launch and exactly one cross-device all-reduce (float32[N]) for fp8 / nvfp4,
    none for mxfp8. With ``axis_name=None`` the amaxes stay local (no collective): a
    one-launch multi-tensor quantize, which in eager mode names the first tensor with a
    non-finite amax in its ValueError.

    Args:
      tensors: N >= 1 local shards (rank >= 1, float32 / bfloat16 / float16).
      format: "fp8", "mxfp8" or "nvfp4".
      axis_name: mesh axis the shards are split over (e.g. "gtp"); None: no reduction.
      dim: block / contraction dim, one int for all tensors or one per tensor.
      backend: "pallas" or "reference".
      interpret: Pallas interpreter; None = True unless the default backend is a GPU.
    Returns:
      list of N `QuantizedTensor` of the local shards; for fp8 / nvfp4 their
      ``global_scale`` is identical on every device of `axis_name`.
    """
    api.check_format(format)
    api.check_backend(backend)
    interpret = _util.resolve_interpret(interpret)
    if isinstance(tensors, jax.Array) or not isinstance(tensors, Sequence):
        raise TypeError("tensors must be a list or tuple of arrays (for one array x, pass "
                        f"[x]); got {type(tensors).__name__}.")
    if len(tensors) == 0:
        raise ValueError("tensors is empty; pass at least one array.")
    dims = [dim] * len(tensors) if isinstance(dim, int) else list(dim)
    if len(dims) != len(tensors):
        raise ValueError(f"dim has {len(dims)} entries for {len(tensors)} tensors; pass one "
                         "int or one per tensor.")
    dims = [api.check_quantizable(t, f"tensors[{i}]", d)
            for i, (t, d) in enumerate(zip(tensors, dims))]
    if format == "mxfp8":
        return [api.cast_only(t, format, None, dim=d, backend=backend, interpret=interpret)
                for t, d in zip(tensors, dims)]
    local = api.multi_amax(tensors, backend=backend, interpret=interpret)
    agreed = local if axis_name is None else reduce_amax(local, axis_name)
    api.raise_if_nonfinite(agreed, "tensors", indexed=True)
    return [api.cast_impl(t, agreed[i], format, d, backend, interpret)
            for i, (t, d) in enumerate(zip(tensors, dims))]


def gather_quantized(q: QuantizedTensor, axis_name: AxisName, *, dim: int = 0,
                     fused: bool = False) -> QuantizedTensor:
    """All-gathers a quantized shard along `dim` (tiled): the low-precision gather.

    Payload and block scales are gathered; the global scale is not (it must already be
    identical on all devices, as `quantize_coalesced` guarantees). By default each leaf
    is its own all-gather (two collectives for mxfp8 / nvfp4). ``fused=True`` (``dim == 0``
    only) sends payload and scale bytes in ONE all-gather of a uint8 buffer instead (not
    the default: the local concatenation and the slicing of the gathered buffer can cost
    more than the saved collective latency).
    Gathering along the block dim (``dim == q.dim``, e.g. a rank-1 weight) needs shards
    whose length along it is a multiple of the block size (16 / 32), so that no block
    straddles two shards.

    Args:
      q: `QuantizedTensor` of the local shard, inside ``shard_map``.
      axis_name: mesh axis (or tuple) to gather over, e.g. "gtp".
      dim: the shard dim of the logical tensor (GTP shards dim 0).
      fused: one collective for payload + scales (dim 0 only; see above).
    Returns:
      `QuantizedTensor` of the full tensor (logical ``shape[dim]`` times the axis size).
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor, got {type(q).__name__}.")
    api.check_format(q.format)
    ndim = len(q.shape)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"dim={dim!r} must be an int in [-{ndim}, {ndim}) for a tensor of "
                         f"shape {q.shape}.")
    dim %= ndim
    if q.block and dim == q.dim and q.shape[dim] % q.block:
        raise ValueError(
            f"cannot gather a {q.format} shard of shape {q.shape} along its block dim {dim}: "
            f"its length {q.shape[dim]} is not a multiple of the block size {q.block}, so "
            "the zero padding would land inside the gathered tensor. Pad the shard dim to a "
            f"multiple of {q.block} (e.g. GTPConfig.pad_for_alignment) or quantize along "
            "another dim.")
    leaves = [leaf for leaf in (q.payload, q.block_scales) if leaf is not None]
    if fused and dim == 0 and len(leaves) > 1:
        gathered = _gather_fused(leaves, axis_name)
    else:
        gathered = [jax.lax.all_gather(leaf, axis_name, axis=dim, tiled=True)
                    for leaf in leaves]
    payload = gathered[0]
    scales = gathered[1] if q.block_scales is not None else None
    factor = payload.shape[dim] // q.payload.shape[dim]
    shape = q.shape[:dim] + (q.shape[dim] * factor,) + q.shape[dim + 1:]
    return QuantizedTensor(payload, scales, q.global_scale, shape, q.format, q.dim)


def _gather_fused(leaves: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
    """Tiled dim-0 all-gather of several 1-byte-element arrays as ONE uint8 collective."""
    flat = [jax.lax.bitcast_convert_type(leaf, jnp.uint8).reshape(-1)
            if leaf.dtype != jnp.uint8 else leaf.reshape(-1) for leaf in leaves]
    buf = jax.lax.all_gather(jnp.concatenate(flat), axis_name, axis=0, tiled=False)
    n = buf.shape[0]
    out = []
    offset = 0
    for leaf, f in zip(leaves, flat):
        part = buf[:, offset:offset + f.size].reshape((n * leaf.shape[0],) + leaf.shape[1:])
        offset += f.size
        if leaf.dtype != jnp.uint8:
            part = jax.lax.bitcast_convert_type(part, leaf.dtype)
        out.append(part)
    return out
