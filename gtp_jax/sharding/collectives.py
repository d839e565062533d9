"""Explicit weight collectives: all-gather a shard just in time, reduce-scatter its gradient.

All functions here run *inside* ``jax.shard_map`` over a mesh that has the GTP axis; the
array they receive is the local shard.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from gtp_jax.sharding.fp8_gather import gather_fp8
from gtp_jax.sharding.gather_spec import GatherSpec

__all__ = ["GATHERED_POLICY", "GATHERED_WEIGHT", "GatherSpec", "all_gather_shard",
           "all_gather_shards", "gather_weight", "gradient_of", "reduce_scatter_grad",
           "reduce_scatter_grads", "regather_policy",
           "resolve_quant_backend"]

#: `checkpoint_name` of every gathered weight. Remat policies that do not save this name
#: make the backward pass re-gather the weight instead of keeping it from the forward pass.
GATHERED_WEIGHT = "gtp_gathered_weight"


def all_gather_shard(shard: jax.Array, spec: GatherSpec) -> jax.Array:
    """Gathers a local shard into the full logical weight (no gradient rule of its own).

    Args:
      shard: local shard, shape ``spec.shard_shape``, dtype ``spec.param_dtype``.
      spec: the weight's `GatherSpec`; ``spec.axis`` must be a manual mesh axis here.

    Returns:
      ``spec.logical_shape`` array in ``spec.compute_dtype``; padding rows are dropped.
    """
    return all_gather_shards([shard], [spec])[0]


def all_gather_shards(shards: Sequence[jax.Array], specs: Sequence[GatherSpec]
                      ) -> list[jax.Array]:
    """Gathers several weights at once (e.g. one layer's), inside ``shard_map``.

    Weights with a low-precision ``gather_format`` are quantized from their local
    (high-precision) shard with scales agreed over ``spec.axis`` by ONE all-reduce for all of
    them (`gtp_jax.pallas.quantize_coalesced`); payload and block scales are all-gathered
    and dequantized to ``spec.compute_dtype``. Other weights are cast to ``gather_dtype``
    (if set) and all-gathered as they are.

    Args:
      shards: local shards, ``spec.shard_shape`` / ``spec.param_dtype`` each.
      specs: one `GatherSpec` per shard.

    Returns:
      The logical weights (``spec.logical_shape`` / ``spec.compute_dtype``), in order.
    """
    for shard, spec in zip(shards, specs):
        _check_shard(shard, spec)
    out: list[Any] = [None] * len(shards)
    groups: dict[tuple[str, str, str], list[int]] = {}
    direct: dict[str, list[int]] = {}
    coalesced: dict[tuple[str, Any], list[int]] = {}
    for i, spec in enumerate(specs):
        if spec.fp8_in_dims:
            direct.setdefault(spec.axis, []).append(i)
            continue
        if spec.quantized:
            groups.setdefault((spec.gather_format, resolve_quant_backend(spec.quant_backend),
                               spec.axis), []).append(i)
            continue
        shard = shards[i]
        if spec.gather_dtype is not None:
            shard = shard.astype(spec.gather_dtype)
        if spec.coalesce and spec.axis_size > 1:
            coalesced.setdefault((spec.axis, np.dtype(shard.dtype)), []).append(i)
            out[i] = shard  # gathered below, with the others of its dtype
            continue
        if spec.axis_size > 1:
            shard = jax.lax.all_gather(shard, spec.axis, axis=spec.shard_dim, tiled=True)
        out[i] = _unpad(shard, spec)
    for idx in coalesced.values():
        for i, w in zip(idx, _gather_coalesced([out[i] for i in idx], [specs[i] for i in idx])):
            out[i] = w
    for (gather_format, backend, axis), idx in groups.items():
        from gtp_jax import pallas  # deferred: the kernels load only when a format is used

        # A 1-wide axis needs no collective, and may not even be bound (one device runs
        # without shard_map): scales stay local and nothing is gathered.
        wide = specs[idx[0]].axis_size > 1
        qs = pallas.quantize_coalesced([shards[i] for i in idx], gather_format,
                                       axis if wide else None,
                                       dim=[specs[i].block_axis for i in idx],
                                       backend=backend)
        for i, q in zip(idx, qs):
            spec = specs[i]
            full = pallas.gather_quantized(q, axis, dim=spec.shard_dim) if wide else q
            out[i] = _unpad(pallas.dequantize(full, spec.compute_dtype, backend=backend), spec)
    for idx in direct.values():
        for i, w in zip(idx, gather_fp8([shards[i] for i in idx], [specs[i] for i in idx])):
            out[i] = w
    return out


def _gather_coalesced(shards: Sequence[jax.Array], specs: Sequence[GatherSpec]
                      ) -> list[jax.Array]:
    """All-gathers `shards` (one dtype, one axis) with ONE all-gather: each shard, its shard
    dim moved first, is flattened into one buffer; the ``[axis_size, total]`` result is cut
    back, each piece's rows put in rank order along its shard dim (what a tiled all-gather
    of that shard gives), unpadded."""
    if len(shards) == 1:
        spec = specs[0]
        return [_unpad(jax.lax.all_gather(shards[0], spec.axis, axis=spec.shard_dim,
                                          tiled=True), spec)]
    n = specs[0].axis_size
    moved = [jnp.moveaxis(s, spec.shard_dim, 0) for s, spec in zip(shards, specs)]
    full = jax.lax.all_gather(jnp.concatenate([m.reshape(-1) for m in moved]), specs[0].axis,
                              axis=0, tiled=False)
    out, start = [], 0
    for m, spec in zip(moved, specs):  # m: (rows per rank, *other dims)
        piece = full[:, start:start + m.size].reshape((n * m.shape[0], *m.shape[1:]))
        out.append(_unpad(jnp.moveaxis(piece, 0, spec.shard_dim), spec))
        start += m.size
    return out


def resolve_quant_backend(backend: str | None) -> str:
    """`backend`, with None resolved: "pallas" where the default JAX backend is a GPU, else
    "reference" (the same bits without the Pallas interpreter's cost)."""
    if backend is None:
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return backend


def _unpad(full: jax.Array, spec: GatherSpec) -> jax.Array:
    logical = spec.logical_shape[spec.shard_dim]
    if logical != full.shape[spec.shard_dim]:
        full = jax.lax.slice_in_dim(full, 0, logical, axis=spec.shard_dim)
    return full


def reduce_scatter_grad(grad: jax.Array, spec: GatherSpec) -> jax.Array:
    """Sums a full-weight gradient over the GTP axis and keeps this device's shard (then
    sums the shard over ``spec.data_axes``, if any).

    Args:
      grad: this device's partial gradient of the full weight, shape ``spec.logical_shape``.
      spec: the weight's `GatherSpec`.

    Returns:
      The gradient shard, shape ``spec.shard_shape``, dtype ``spec.param_dtype``; rows that
      are padding get exactly zero, so padded parameters never move.
    """
    grad = _padded(grad.astype(spec.reduce_dtype), spec)
    if spec.axis_size > 1:
        grad = jax.lax.psum_scatter(grad, spec.axis, scatter_dimension=spec.shard_dim,
                                    tiled=True)
    if spec.data_axes:
        grad = jax.lax.psum(grad, spec.data_axes)
    return grad.astype(spec.param_dtype)


def reduce_scatter_grads(grads: Sequence[jax.Array], specs: Sequence[GatherSpec]
                        ) -> list[jax.Array]:
    """`reduce_scatter_grad` of each gradient; those whose spec coalesces
    (`GatherSpec.coalesce`, over the same axis, in the same reduce dtype) with ONE
    reduce-scatter: each padded gradient, its shard dim moved first, as ``[axis_size,
    rows per rank * rest]`` (row ``r``: rank ``r``'s shard, flattened), joined along dim 1
    and reduce-scattered over dim 0; each rank's ``[total]`` result cut back into its
    shards."""
    out: list[Any] = [None] * len(grads)
    coalesced: dict[tuple[str, Any], list[int]] = {}
    for i, (g, spec) in enumerate(zip(grads, specs)):
        if spec.coalesce and spec.axis_size > 1:
            coalesced.setdefault((spec.axis, np.dtype(spec.reduce_dtype), spec.data_axes),
                                 []).append(i)
        else:
            out[i] = reduce_scatter_grad(g, spec)
    for (axis, _, summed), idx in coalesced.items():
        if len(idx) == 1:
            out[idx[0]] = reduce_scatter_grad(grads[idx[0]], specs[idx[0]])
            continue
        rows, moved = [], []
        for i in idx:
            spec = specs[i]
            m = jnp.moveaxis(_padded(grads[i].astype(spec.reduce_dtype), spec),
                             spec.shard_dim, 0)
            moved.append(m.shape)
            rows.append(m.reshape(spec.axis_size, -1))
        mine = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), axis, scatter_dimension=0,
                                    tiled=False)
        if summed:
            mine = jax.lax.psum(mine, summed)
        start = 0
        for i, r, shape in zip(idx, rows, moved):
            spec, size = specs[i], r.shape[1]
            shard = mine[start:start + size].reshape((shape[0] // spec.axis_size, *shape[1:]))
            out[i] = jnp.moveaxis(shard, 0, spec.shard_dim).astype(spec.param_dtype)
            start += size
    return out


def _padded(grad: jax.Array, spec: GatherSpec) -> jax.Array:
    """`grad` zero-padded along the shard dim to ``spec.padded_size``."""
    pad = spec.padding
    if not pad:
        return grad
    widths = [(0, 0)] * grad.ndim
    widths[spec.shard_dim] = (0, pad)
    return jnp.pad(grad, widths)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(shard: jax.Array, spec: GatherSpec) -> jax.Array:
    return all_gather_shard(shard, spec)


def _gather_fwd(shard: jax.Array, spec: GatherSpec) -> tuple[jax.Array, None]:
    # No residuals: the backward rule needs only the cotangent, so the full weight is not
    # kept alive by this op (whether the *consumer* keeps it is up to the remat policy).
    return all_gather_shard(shard, spec), None


def _gather_bwd(spec: GatherSpec, _: None, ct: Any) -> tuple[jax.Array]:
    return (reduce_scatter_grad(gradient_of(ct), spec),)


def gradient_of(ct: Any) -> jax.Array:
    """The full-weight gradient in a gathered weight's cotangent (for an
    `Fp8GatheredWeight`, its value's: the payloads have none)."""
    return ct.value if hasattr(ct, "bits_t") else ct


_gather.defvjp(_gather_fwd, _gather_bwd)


def gather_weight(shard: jax.Array, spec: GatherSpec) -> jax.Array:
    """All-gathers a weight shard just before use; its gradient is reduce-scattered.

    Forward: cast (optional) + ``all_gather(tiled=True)`` over ``spec.axis`` + unpad.
    Backward (``custom_vjp``): pad + ``psum_scatter(tiled=True)`` in ``spec.reduce_dtype``,
    so the gradient leaves already sharded and no full-size gradient is summed anywhere.
    The output is tagged with `GATHERED_WEIGHT` so remat policies can drop and re-gather it.

    Args:
      shard: local shard, ``spec.shard_shape`` / ``spec.param_dtype``.
      spec: static `GatherSpec`.

    Returns:
      The logical weight, ``spec.logical_shape`` / ``spec.compute_dtype`` (an
      `Fp8GatheredWeight` standing for it where ``spec.fp8_in_dims`` is set).
    """
    if spec.quantized:
        # The dequantize chain (decode, scale, cast, unpad) is several ordinary ops that a
        # remat policy could save one by one; a nested checkpoint makes the whole gather one
        # equation that `gathered_weight_policy` refuses to save (recognised by this policy).
        gathered = jax.checkpoint(functools.partial(_gather, spec=spec),
                                  policy=regather_policy)(shard)
    else:
        gathered = _gather(shard, spec)
    return checkpoint_name(gathered, GATHERED_WEIGHT)


def regather_policy(*_: Any, **__: Any) -> bool:
    """Remat policy of a low-precision gather: save nothing (it is re-gathered whole)."""
    return False


#: Attribute (True) of the remat policy that `gtp_jax.shard` wraps a module's body in to
#: re-gather its weights in the backward pass (`gtp_jax.sharding.scan.gathered_weight_policy`):
#: the library's own checkpoint, which the check for the module's own remat regions skips.
GATHERED_POLICY = "gtp_jax_gathered_weights"


def _check_shard(shard: Any, spec: GatherSpec) -> None:
    if tuple(shard.shape) != spec.shard_shape:
        raise ValueError(
            f"gather_weight: shard shape {tuple(shard.shape)} does not match the spec's "
            f"{spec.shard_shape} (logical {spec.logical_shape}, split on dim {spec.shard_dim} "
            f"over {spec.axis_size} devices); was the weight sharded for another mesh?"
        )
