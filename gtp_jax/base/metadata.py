"""Variable metadata keys: how a model tells `gtp_jax.shard` about a parameter, and how the
sharding layer records what it did.

Set by model code (``nnx.Param(..., gtp_tp_dim=1)`` or ``var.set_metadata(KEY, value)``):

- `STACKED`: the parameter's leading dim is a layer stack (scanned layers); it is split
  along dim 1 and gathered one layer at a time.
- `TP_DIM`: per-layer dim split over the ``tp`` mesh axis (Megatron column/row parallel).
- `TP_PARTS`: the `TP_DIM` holds this many equal fused parts (``[gate | up]``: 2), each
  split over ``tp`` on its own so every rank holds a piece of every part.
- `TP_UNEVEN`: what to do when ``tp`` does not divide the `TP_DIM`: ``"pad"`` (default:
  zero-pad it at its end; the model keeps the padding at zero) or ``"replicate"`` (no tp
  split: every tp rank holds the whole weight, e.g. grouped-query kv heads fewer than tp).
- `EP_DIM`: per-layer dim split over the ``ep`` mesh axis (the expert dim).
- `SHARD_DIM`: per-layer dim to GTP-shard (default: chosen by `gtp_jax.shard`).
- `LOCAL`: the module may read this (not stacked) weight's own shard instead of the
  gathered weight: it reaches the call as a `gtp_jax.sharding.lazy.LazyWeight`, gathered
  only where the module reads it as an array, whose ``shard`` a vocabulary-parallel
  embedding or head (`gtp_jax.parallel.vocab`) uses as is.
- `REDUCE`: how non-parameter state written in ``__call__`` is combined over the data
  shards: ``"mean"``, ``"sum"`` (of the changes), ``"same"`` or ``"concat"`` (per-example
  rows); the variable types of `gtp_jax.base.state` imply these (see
  `gtp_jax.ShardedModule`). Written state with no rule is refused.

Written by `gtp_jax.shard` on the parameters it places:

- `LOGICAL_SHAPE`: a sharded weight's logical (unpadded) shape.
- `SPLIT_LAYOUT`: ``((axis, size, dim, parts), ...)`` of a weight split over ``tp``/``ep``.
  With ``parts > 1`` the stored array is a permutation of the logical one along ``dim``
  (see `gtp_jax.sharding.plan.DimSplit`), so readers of stored arrays (checkpoints) must
  compare this layout, not only the shape.
"""

from __future__ import annotations

STACKED = "gtp_stacked"
TP_DIM = "gtp_tp_dim"
TP_PARTS = "gtp_tp_parts"
TP_UNEVEN = "gtp_tp_uneven"
EP_DIM = "gtp_ep_dim"
SHARD_DIM = "gtp_shard_dim"
LOCAL = "gtp_local"
REDUCE = "gtp_reduce"
LOGICAL_SHAPE = "gtp_logical_shape"
SPLIT_LAYOUT = "gtp_split_layout"

#: Metadata key -> mesh axis of the model-parallel splits.
SPLIT_AXES: dict[str, str] = {TP_DIM: "tp", EP_DIM: "ep"}
