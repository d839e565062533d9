"""How a sharded array is stored, and the conversions between stored and logical arrays.

An array's *info* (`array_info`, JSON-ready, kept in a checkpoint's metadata) holds its
stored shape, its logical shape, whether GTP padded it, its tp/ep split layout
(`gtp_jax.base.metadata.SPLIT_LAYOUT`) and its dtype. `to_logical` / `from_logical` undo /
apply the padding and the split permutation; `relayout` moves an array between two infos.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gtp_jax.base.metadata import LOGICAL_SHAPE, SPLIT_LAYOUT
from gtp_jax.sharding.offload import to_device


def is_key(value: Any) -> bool:
    return jnp.issubdtype(value.dtype, jax.dtypes.prng_key)


def savable(value: Any) -> Any:
    # Typed PRNG keys are stored as their raw uint32 data (orbax stores numeric arrays).
    return jax.random.key_data(value) if is_key(value) else value


def unsavable(value: Any, like: Any) -> Any:
    if is_key(like):
        return jax.random.wrap_key_data(value, impl=jax.random.key_impl(like))
    return value


def array_info(var: nnx.Variable, value: Any) -> dict[str, Any]:
    """Stored shape, logical shape, dtype and tp/ep split layout of one array (JSON-ready).

    ``split_layout`` lists ``[axis, axis_size, dim, parts]`` per model-parallel split
    (`gtp_jax.sharding.module.SPLIT_LAYOUT`), empty for a weight that is only GTP-padded.
    """
    shape = tuple(int(d) for d in savable_shape(value))
    meta = var.get_metadata()
    logical = meta.get(LOGICAL_SHAPE)
    layout = meta.get(SPLIT_LAYOUT) or ()
    return {
        "shape": list(shape),
        "logical_shape": list(logical) if logical is not None else list(shape),
        "padded": logical is not None,
        "split_layout": [[str(a), int(n), int(d), int(k)] for a, n, d, k in layout],
        "dtype": str(jax.random.key_impl(value)) if is_key(value) else str(np.dtype(value.dtype)),
    }


def split_layout(info: Mapping[str, Any]) -> tuple[tuple[str, int, int, int], ...]:
    return tuple(tuple(s) for s in info.get("split_layout", ()))


def dim_splits(info: Mapping[str, Any]) -> list[tuple[Any, int]]:
    """(DimSplit, array dim) of each tp/ep split of an array, in `to_stored` order."""
    if not split_layout(info):
        return []
    from gtp_jax.sharding.plan import DimSplit  # noqa: PLC0415

    logical = info["logical_shape"]
    return [(DimSplit(axis=a, axis_size=n, dim=d, size=int(logical[d]), parts=k), d)
            for a, n, d, k in split_layout(info)]


def stored_extent(info: Mapping[str, Any]) -> tuple[int, ...]:
    """Shape of the array in its split layout before GTP padding: the logical shape, except
    that a tp/ep-split dim holds its padded, interleaved parts."""
    extent = [int(n) for n in info["logical_shape"]]
    for split, dim in dim_splits(info):
        extent[dim] = split.stored_size
    return tuple(extent)


def to_logical(x: Any, info: Mapping[str, Any]) -> Any:
    """A stored array (saved layout) -> its logical array: GTP padding dropped, tp/ep
    splits undone (`DimSplit.from_stored`)."""
    x = x[tuple(slice(0, n) for n in stored_extent(info))]
    for split, dim in reversed(dim_splits(info)):
        x = split.from_stored(x, dim)
    return x


def from_logical(x: Any, info: Mapping[str, Any]) -> Any:
    """Logical array -> stored layout of `info`: tp/ep splits, then GTP zero padding."""
    for split, dim in dim_splits(info):
        x = split.to_stored(x, dim)
    widths = [(0, int(s) - int(e)) for s, e in zip(info["shape"], x.shape)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x


def numpy_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(jnp.dtype(name))
    except TypeError:  # a PRNG key implementation name: stored as uint32 key data
        return np.dtype(np.uint32)


def savable_shape(value: Any) -> tuple[int, ...]:
    return tuple(jax.random.key_data(value).shape) if is_key(value) else tuple(value.shape)


def zero_padding(value: jax.Array, info: Mapping[str, Any]) -> jax.Array:
    """Zeroes every element past the unpadded extent (a purely local, elementwise op)."""
    if not info["padded"] or tuple(value.shape) == stored_extent(info):
        return value
    return _jit_mask(tuple(value.shape), stored_extent(info), value.sharding)(value)


@functools.cache
def _jit_mask(shape: tuple[int, ...], extent: tuple[int, ...], sharding: Any):
    def mask(x: jax.Array) -> jax.Array:
        x = to_device(x)  # a host-memory array (offloaded state): masked on the device
        keep = jnp.ones(shape, dtype=bool)
        for dim, (size, n) in enumerate(zip(shape, extent)):
            if size != n:
                keep &= jax.lax.broadcasted_iota(jnp.int32, shape, dim) < n
        return jnp.where(keep, x, jnp.zeros((), x.dtype))

    return jax.jit(mask, out_shardings=sharding)


def relayout(value: jax.Array, saved: Mapping[str, Any], target: Mapping[str, Any],
              sharding: Any) -> jax.Array:
    """A replicated array in the `saved` layout -> the `target` layout and sharding."""
    freeze = lambda info: json.dumps(info, sort_keys=True)  # hashable cache key
    return _jit_relayout(freeze(saved), freeze(target), sharding)(value)


@functools.cache
def _jit_relayout(saved: str, target: str, sharding: Any):
    saved_info, target_info = json.loads(saved), json.loads(target)
    return jax.jit(lambda x: from_logical(to_logical(to_device(x), saved_info), target_info),
                   out_shardings=sharding)
