"""Mesh layer, sharding plan, explicit collectives and the NNX module wrapper."""

from gtp_jax.sharding.collectives import (
    GATHERED_WEIGHT,
    GatherSpec,
    all_gather_shard,
    gather_weight,
    reduce_scatter_grad,
)
from gtp_jax.sharding.lazy import GTPShard, materialize
from gtp_jax.sharding.mesh import (
    AXES,
    axis_groups,
    data_axes,
    data_sharding,
    data_size,
    describe_mesh,
    make_mesh,
    shard_key,
)
from gtp_jax.sharding.module import (
    REDUCE,
    OutputLayout,
    Replicated,
    ShardedModule,
    bytes_per_device,
    replicated,
    shard,
    unshard,
    unshard_values,
)
from gtp_jax.sharding.plan import (
    EP_DIM,
    SHARD_DIM,
    STACKED,
    TP_DIM,
    TP_PARTS,
    DimSplit,
    ParamPlan,
    SplitPlan,
)
from gtp_jax.sharding.scan import gathered_weight_policy, scan_layers

__all__ = [
    "AXES",
    "DimSplit",
    "EP_DIM",
    "OutputLayout",
    "REDUCE",
    "Replicated",
    "SHARD_DIM",
    "SplitPlan",
    "TP_DIM",
    "TP_PARTS",
    "GATHERED_WEIGHT",
    "GTPShard",
    "GatherSpec",
    "ParamPlan",
    "STACKED",
    "ShardedModule",
    "all_gather_shard",
    "axis_groups",
    "bytes_per_device",
    "data_axes",
    "data_sharding",
    "data_size",
    "describe_mesh",
    "gather_weight",
    "gathered_weight_policy",
    "make_mesh",
    "materialize",
    "reduce_scatter_grad",
    "replicated",
    "scan_layers",
    "shard",
    "shard_key",
    "unshard",
    "unshard_values",
]
