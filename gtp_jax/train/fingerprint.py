"""Checksums of logical arrays that are the same on every mesh: what a checkpoint records
per array at save time and verifies on restore (`gtp_jax.train.checkpoint`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gtp_jax.sharding.offload import to_device
from gtp_jax.train.layout import split_layout, to_logical


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's finalizer: a bijection of uint32, so two different inputs never mix to
    the same output."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _bits(x: jax.Array) -> jax.Array:
    """The raw bits of `x` as uint32 (one word per element; 8-byte types add a dim of 2)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize
    if size >= 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32)


def fingerprint(x: jax.Array, extent: tuple[int, ...] | None = None) -> jax.Array:
    """uint32[2] hash of the bits and positions of the logical array ``x[:extent]``.

    Each element's bits are combined with its flat index in the logical array and mixed by
    a bijection, then summed mod 2**32 (integer sums do not depend on the reduction order,
    so the result is the same on every mesh). Changing one element (e.g. one flipped bit)
    changes exactly one summand and hence the sum; a multi-element change goes unnoticed
    with probability about 2**-64 over the two lanes. Elements past `extent` (GTP padding)
    are masked out instead of sliced off, so a sharded array is hashed where it lies, with
    no re-layout and no extra copy.
    """
    b = _bits(x)
    shape = b.shape
    logical = tuple(extent) + shape[len(extent):] if extent is not None else shape
    index = jnp.zeros(shape, jnp.uint32)
    inside = jnp.ones(shape, bool)
    stride = 1
    for dim in reversed(range(b.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, dim)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= logical[dim]
        if logical[dim] != shape[dim]:
            inside &= iota < logical[dim]
    zero = jnp.uint32(0)
    lane1 = jnp.where(inside, _fmix32(b ^ _fmix32(index)), zero)
    lane2 = jnp.where(inside, _fmix32(b + index * jnp.uint32(0x9E3779B9)
                                      + jnp.uint32(0x7F4A7C15)), zero)
    return jnp.stack([jnp.sum(lane1, dtype=jnp.uint32), jnp.sum(lane2, dtype=jnp.uint32)])


def digest(values: Mapping[str, Any], infos: Mapping[str, Mapping[str, Any]],
            mesh: Mesh | None) -> tuple[dict[str, str], list[str]]:
    """(checksum per array as 16 hex digits, arrays holding NaN/inf).

    Both are computed over the logical array (padding dropped, tp/ep split layout undone),
    so a checkpoint saved on one mesh verifies after a restore onto any other. The result
    is replicated, so every process of a multi-process run gets the same answer. One small
    jitted program per distinct array layout (a weight, its gradient-shaped optimizer
    moments and every layer-stacked twin share one), not one program for the whole state:
    a model's first save compiles a few small programs instead of one as large as the model.
    """
    keys = sorted(values)
    replicated = NamedSharding(mesh, P()) if mesh is not None else None
    results = []
    for k in keys:
        v = values[k]
        if mesh is not None and not isinstance(getattr(v, "sharding", None), NamedSharding):
            v = jax.device_put(v, replicated)
        results.append(_jit_digest(json.dumps(infos[k], sort_keys=True), replicated)(v))
    checksums, nonfinite = {}, []
    for k, (fp, finite) in zip(keys, results):
        a, b = (int(x) for x in _local(fp))
        checksums[k] = f"{a:08x}{b:08x}"
        if not bool(_local(finite)):
            nonfinite.append(k)
    return checksums, nonfinite


def _local(x: Any) -> np.ndarray:
    """A replicated result as a NumPy array (its first addressable copy)."""
    return np.asarray(x.addressable_data(0)) if hasattr(x, "addressable_data") else np.asarray(x)


@functools.cache
def _jit_digest(frozen: str, sharding: Any):
    info = json.loads(frozen)

    def digest(x):
        # Host-memory arrays (an offloaded optimizer state) are hashed on the device:
        # compute ops take device-memory operands.
        x = to_device(x)
        if split_layout(info):  # tp/ep split: undo the permutation first
            x, extent = to_logical(x, info), None
        else:  # at most GTP padding: hash in place, padding masked
            extent = tuple(int(n) for n in info["logical_shape"])
        finite = (jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
                  else jnp.bool_(True))
        return fingerprint(x, extent), finite

    return jax.jit(digest, out_shardings=sharding) if sharding is not None else jax.jit(digest)
