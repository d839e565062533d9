"""Checksums of logical arrays that are the same on every mesh: what a checkpoint records
per array at save time and verifies on restore (`gtp_jax.train.lifecycle.checkpoint`)."""

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
from gtp_jax.train.lifecycle.layout import dim_splits


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
    logical = tuple(extent) if extent is not None else tuple(x.shape)
    lanes, _ = _block_sums(b, x, [0] * b.ndim, logical, [])
    return lanes


def _block_sums(b: jax.Array, x: jax.Array, offsets: list[Any], logical: tuple[int, ...],
                tables: list[np.ndarray | None]) -> tuple[jax.Array, jax.Array]:
    """(uint32[2] lane sums, all finite) of one block `b` (the bits of block `x`) of a
    stored array whose block starts at `offsets` (one per dim of `b`).

    Dim ``d < len(logical)`` of the stored array maps position ``p`` to logical index
    ``tables[d][p]`` (-1: padding, not hashed), or with no table to ``p`` itself when
    ``p < logical[d]`` (padding past it); the dims `_bits` adds are taken whole. The sums
    over all blocks of an array, mod 2**32, are `fingerprint` of its logical array."""
    shape = b.shape
    full = tuple(logical) + shape[len(logical):]
    index = jnp.zeros(shape, jnp.uint32)
    inside = jnp.ones(shape, bool)
    stride = 1
    for dim in reversed(range(b.ndim)):
        pos = jnp.arange(shape[dim], dtype=jnp.int32) + jnp.int32(offsets[dim])
        table = tables[dim] if dim < len(tables) else None
        if table is not None:
            mapped = jnp.take(jnp.asarray(table, jnp.int32), pos)
        elif dim < len(logical):  # padding past the logical size, if any
            mapped = jnp.where(pos < full[dim], pos, -1)
        else:  # a dim `_bits` added: whole
            mapped = pos
        along = functools.partial(jax.lax.broadcast_in_dim, shape=shape,
                                  broadcast_dimensions=(dim,))
        index = index + along(mapped.astype(jnp.uint32) * jnp.uint32(stride % 2**32))
        inside &= along(mapped >= 0)
        stride *= full[dim]
    zero = jnp.uint32(0)
    lane1 = jnp.where(inside, _fmix32(b ^ _fmix32(index)), zero)
    lane2 = jnp.where(inside, _fmix32(b + index * jnp.uint32(0x9E3779B9)
                                      + jnp.uint32(0x7F4A7C15)), zero)
    lanes = jnp.stack([jnp.sum(lane1, dtype=jnp.uint32), jnp.sum(lane2, dtype=jnp.uint32)])
    if jnp.issubdtype(x.dtype, jnp.inexact):
        inside_x = inside if b.ndim == x.ndim else jnp.all(inside, axis=-1)
        finite = jnp.all(jnp.isfinite(x) | ~inside_x)
    else:
        finite = jnp.bool_(True)
    return lanes, finite


def digest(values: Mapping[str, Any], infos: Mapping[str, Mapping[str, Any]],
           mesh: Mesh | None) -> tuple[dict[str, str], list[str]]:
    """(checksum per array as 16 hex digits, arrays holding NaN/inf).

    Both are computed over the logical array (padding dropped, tp/ep split layout undone),
    so a checkpoint saved on one mesh verifies after a restore onto any other, and every
    process of a multi-process run gets the same answer. One small jitted program per
    distinct array layout (a weight, its gradient-shaped optimizer moments and every
    layer-stacked twin share one), not one program for the whole state: a model's first
    save compiles a few small programs instead of one as large as the model.

    The programs run no collective: each device sums its own block, hashing every element
    with its logical index (the split layout is undone in the index, not by moving data),
    and the host adds the blocks of one replica of each.
    """
    keys = sorted(values)
    # The programs that produced the arrays (a training step, a re-layout) finish first:
    # compiling these programs while a collective program still ran on simulated CPU
    # devices is when the XLA runtime stalled that program's collectives past its 40 s
    # rendezvous limit and aborted the process (every time so far).
    jax.block_until_ready([v for v in values.values() if isinstance(v, jax.Array)])
    replicated = NamedSharding(mesh, P()) if mesh is not None else None
    results = []
    for k in keys:
        v = values[k]
        if mesh is not None and not isinstance(getattr(v, "sharding", None), NamedSharding):
            v = jax.device_put(v, replicated)
        sharding = v.sharding if isinstance(getattr(v, "sharding", None), NamedSharding) \
            else None
        program = _jit_digest(json.dumps(infos[k], sort_keys=True), sharding, v.ndim)
        results.append((v, program(v)))
    checksums, nonfinite = {}, []
    for k, (v, blocks) in zip(keys, results):
        rows = _rows(blocks)
        keep = _first_replicas(v, blocks)
        a, b = (int(s) % 2**32 for s in rows[keep, :2].astype(np.uint64).sum(axis=0))
        checksums[k] = f"{a:08x}{b:08x}"
        if not bool(np.all(rows[:, 2])):
            nonfinite.append(k)
    return checksums, nonfinite


def _rows(blocks: jax.Array) -> np.ndarray:
    """Every device's ``[lane1, lane2, finite]`` row, on every process."""
    if getattr(blocks, "is_fully_addressable", True):
        return np.asarray(blocks)
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.process_allgather(blocks, tiled=True))


def _first_replicas(v: Any, blocks: jax.Array) -> np.ndarray:
    """Which rows of `blocks` to add: one device per distinct block of `v` (a replicated
    block is hashed by every device holding it)."""
    rows = blocks.shape[0]
    if rows == 1:
        return np.ones(1, bool)
    held = {d: tuple((s.start, s.stop) for s in idx)
            for d, idx in v.sharding.devices_indices_map(tuple(v.shape)).items()}
    row_of = {d: idx[0].start or 0
              for d, idx in blocks.sharding.devices_indices_map(tuple(blocks.shape)).items()}
    keep = np.zeros(rows, bool)
    seen: set[tuple] = set()
    for device in sorted(row_of, key=row_of.get):
        if held[device] not in seen:
            seen.add(held[device])
            keep[row_of[device]] = True
    return keep


def _tables(info: Mapping[str, Any]) -> list[np.ndarray | None]:
    """Per stored dim, the logical index of each stored position (-1: padding), for the
    dims a tp/ep split permutes; None where the position is the index."""
    shape = [int(n) for n in info["shape"]]
    tables: list[np.ndarray | None] = [None] * len(info["logical_shape"])
    for split, dim in dim_splits(info):
        if tables[dim] is not None:
            raise ValueError(f"digest: two splits on dim {dim} of {info}")
        stored = np.asarray(split.to_stored(np.arange(split.size) + 1, 0)) - 1
        table = np.full(shape[dim], -1, np.int64)
        table[:stored.size] = stored
        tables[dim] = table
    return tables


@functools.cache
def _jit_digest(frozen: str, sharding: NamedSharding | None, ndim: int):
    info = json.loads(frozen)
    logical = tuple(int(n) for n in info["logical_shape"])
    tables = _tables(info)

    def block(x: jax.Array, offsets: list[Any]) -> jax.Array:
        b = _bits(x)
        lanes, finite = _block_sums(b, x, offsets + [0] * (b.ndim - x.ndim), logical,
                                    tables)
        return jnp.concatenate([lanes, finite.astype(jnp.uint32)[None]])[None]

    if sharding is None:
        # Host-memory arrays (an offloaded optimizer state) are hashed on the device:
        # compute ops take device-memory operands.
        return jax.jit(lambda x: block(to_device(x), [0] * ndim))

    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))

    def local(x: jax.Array) -> jax.Array:
        offsets = []
        for d, entry in enumerate(spec):
            names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            offsets.append(jax.lax.axis_index(names) * x.shape[d] if names else 0)
        return block(x, offsets)

    per_device = jax.shard_map(local, mesh=mesh, in_specs=P(*spec),
                               out_specs=P(tuple(mesh.axis_names)))
    return jax.jit(lambda x: per_device(to_device(x)))
