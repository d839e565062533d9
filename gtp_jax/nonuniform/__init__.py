"""Nonuniform tensor parallelism: keep training when devices fail, with a reduced
``tp``/``gtp`` degree on the affected data-parallel replicas (see docs/fault_tolerance.md).

`config` (`NonuniformConfig`, the model dims a degree must split), `planner` (core and spare
devices, per-replica layouts, row/column maps, `plan`, `describe`), `relayout` (bit-exact
in-memory re-layout of a training state between layouts, the gradient re-layout of healthy
replicas onto their core devices, the replica average over the core mesh).
"""

from gtp_jax.nonuniform.config import DimRule, NonuniformConfig, transformer_dims
from gtp_jax.nonuniform.planner import (
    NonuniformPlan,
    ReplicaLayout,
    choose_spares,
    describe,
    dim_map,
    plan,
)
from gtp_jax.nonuniform.relayout import (
    LeafSplit,
    average_replicas,
    from_core,
    from_logical,
    leaf_split,
    relayout,
    survivor_mesh,
    take_survivors,
    to_core,
    to_logical,
)

__all__ = [
    "DimRule", "LeafSplit", "NonuniformConfig", "NonuniformPlan", "ReplicaLayout",
    "average_replicas", "choose_spares", "describe", "dim_map", "from_core", "from_logical",
    "leaf_split", "plan", "relayout", "survivor_mesh", "take_survivors", "to_core",
    "to_logical", "transformer_dims",
]
