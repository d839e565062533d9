"""`GTPShard`: a weight shard not yet gathered, carried through a module as a pytree.

Inside a sharded module's forward pass, ordinary weights are gathered on entry. A weight
stored with a leading layer-stack dimension (scanned layers) instead reaches the module as
a `GTPShard`, so that `gtp_jax.scan_layers` can gather it one layer at a time.
"""

from __future__ import annotations

from typing import Any

import jax

from gtp_jax.sharding.collectives import GatherSpec


@jax.tree_util.register_pytree_node_class
class GTPShard:
    """A local shard plus the static `GatherSpec` that says how to materialize it.

    `prefetch` asks `gtp_jax.scan_layers` to gather layer ``i + 1`` while layer ``i`` runs.

    For a layer-stacked weight the array has one extra leading (layer) dimension; slicing
    it (as ``jax.lax.scan`` does) leaves the spec, which describes one layer, unchanged.
    """

    __slots__ = ("shard", "spec", "prefetch")

    def __init__(self, shard: jax.Array, spec: GatherSpec, prefetch: bool = False):
        self.shard = shard
        self.spec = spec
        self.prefetch = prefetch

    def tree_flatten(self):
        return (self.shard,), (self.spec, self.prefetch)

    @classmethod
    def tree_unflatten(cls, aux: tuple[GatherSpec, bool], children: tuple[Any, ...]) -> GTPShard:
        return cls(children[0], *aux)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape (with the layer dim, if the shard still has it)."""
        lead = tuple(self.shard.shape[: self.shard.ndim - len(self.spec.shard_shape)])
        return lead + self.spec.logical_shape

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
