"""`GTPShard`: a weight shard not yet gathered, carried through a module as a pytree.

Inside a sharded module's forward pass, ordinary weights are gathered on entry. A weight
stored with a leading layer-stack dimension (scanned layers) instead reaches the module as
a `GTPShard`, so that `gtp_jax.scan_layers` can gather it one layer at a time.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from gtp_jax.base.errors import UsageError
from gtp_jax.sharding.collectives import gather_weight
from gtp_jax.sharding.gather_spec import GatherSpec


def _refuse_item_write(shape: tuple[int, ...]) -> None:
    """``variable[...] = x`` on a sharded weight inside ``__call__`` (the written value
    would have one version per data shard and never reach the stored shards)."""
    raise UsageError(
        f"A parameter of shape {shape} of a sharded module was written in __call__; its "
        "shards are stored 1/N over the mesh and only read in the call (a write would be "
        "lost). Keep state the call updates in a variable that says how the data shards "
        "combine (gtp_jax.BatchMean, BatchSum, SameOnEveryShard, PerExample), and change "
        "parameters outside the call (e.g. with the optimizer).")


@jax.tree_util.register_pytree_node_class
class GTPShard:
    """A local shard plus the static `GatherSpec` that says how to materialize it.

    `prefetch` asks `gtp_jax.scan_layers` to gather layer ``i + 1`` while layer ``i`` runs;
    `keep_gathered` asks it to keep every layer's gathered weight from the forward pass for
    the backward pass instead of gathering it again (``GTPConfig.keep_gathered_layers``).

    For a layer-stacked weight the array has one extra leading (layer) dimension; slicing
    it (as ``jax.lax.scan`` does) leaves the spec, which describes one layer, unchanged.
    """

    __slots__ = ("shard", "spec", "prefetch", "keep_gathered")

    def __init__(self, shard: jax.Array, spec: GatherSpec, prefetch: bool = False,
                 keep_gathered: bool = False):
        self.shard = shard
        self.spec = spec
        self.prefetch = prefetch
        self.keep_gathered = keep_gathered

    def tree_flatten(self):
        return (self.shard,), (self.spec, self.prefetch, self.keep_gathered)

    @classmethod
    def tree_unflatten(cls, aux: tuple[GatherSpec, bool, bool],
                       children: tuple[Any, ...]) -> GTPShard:
        return cls(children[0], *aux)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape (with the layer dim, if the shard still has it)."""
        lead = tuple(self.shard.shape[: self.shard.ndim - len(self.spec.shard_shape)])
        return lead + self.spec.logical_shape

    def __getitem__(self, key: Any) -> GTPShard:
        """``w[...]`` (how Flax reads a Variable, ``self.w[...]``) is the weight itself, for
        `gtp_jax.scan_layers`; any other index would read one layer's shard before it is
        gathered."""
        if key is Ellipsis or key == (Ellipsis,):
            return self
        raise TypeError(
            f"A layer-stacked GTP weight of shape {self.shape} was indexed with {key!r} "
            "before it was gathered. Pass the whole weight (self.w[...] or self.w.value) to "
            "gtp_jax.scan_layers, which gathers one layer at a time, or drop the "
            "'gtp_stacked' metadata so the weight is gathered whole.")

    def __setitem__(self, key: Any, value: Any) -> None:
        _refuse_item_write(self.shape)

    def __jax_array__(self):
        raise TypeError(
            "A layer-stacked GTP weight reached an array operation before it was gathered. "
            "Run layer-stacked modules through gtp_jax.scan_layers, which gathers one layer "
            "at a time, or drop the 'gtp_stacked' metadata so the weight is gathered whole."
        )

    def __repr__(self) -> str:
        return (f"GTPShard(shape={self.shape}, shard={tuple(self.shard.shape)}, "
                f"axis={self.spec.axis!r})")


def is_shard(x: Any) -> bool:
    return isinstance(x, GTPShard)


@jax.tree_util.register_pytree_node_class
class LazyWeight:
    """A weight shard gathered where the module reads it (``variable[...]`` or array use).

    Inside a sharded module whose code has its own ``jax.checkpoint`` / ``nnx.remat``
    regions, weights reach the module in this form, so each weight is gathered inside the
    region that uses it: the region's own remat policy then decides what is saved, and a
    region that saves only its inputs saves the shard, not the gathered weight (it is
    re-gathered in the backward pass). Each read gathers again; XLA merges repeated
    gathers of one weight in the same region.
    """

    __slots__ = ("shard", "spec")

    def __init__(self, shard: jax.Array, spec: GatherSpec):
        self.shard = shard
        self.spec = spec

    def tree_flatten(self):
        return (self.shard,), self.spec

    @classmethod
    def tree_unflatten(cls, spec: GatherSpec, children: tuple[Any, ...]) -> LazyWeight:
        return cls(children[0], spec)

    def gather(self) -> jax.Array:
        """The full logical weight (``spec.logical_shape``, ``spec.compute_dtype``)."""
        if self.spec.axis_size == 1:
            return whole_weight(self.shard, self.spec)
        return gather_weight(self.shard, self.spec)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.logical_shape

    @property
    def dtype(self):
        return self.spec.compute_dtype

    @property
    def ndim(self) -> int:
        return len(self.spec.logical_shape)

    @property
    def size(self) -> int:
        return math.prod(self.spec.logical_shape)

    def __getitem__(self, key: Any) -> jax.Array:
        return self.gather()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        _refuse_item_write(self.shape)

    def __jax_array__(self) -> jax.Array:
        return self.gather()

    def __repr__(self) -> str:
        return f"LazyWeight(shape={self.shape}, shard={tuple(self.shard.shape)})"


def whole_weight(shard: jax.Array, spec: GatherSpec) -> jax.Array:
    """The weight of a 1-wide GTP axis, where the one shard is the whole (padded) weight.

    Nothing is gathered or reduce-scattered: only the padding is dropped and the cast to
    ``spec.gather_dtype`` applied, so the module computes as if it were not wrapped.
    Low-precision formats still quantize (they change the values), through `gather_weight`.
    """
    if spec.quantized:
        return gather_weight(shard, spec)
    if spec.padding:
        shard = jax.lax.slice_in_dim(shard, 0, spec.logical_shape[spec.shard_dim],
                                     axis=spec.shard_dim)
    return shard if spec.gather_dtype is None else shard.astype(spec.gather_dtype)
