"""The GTP mechanism: sharding plan, explicit weight collectives, the layer loop, the module
wrapper.

Start with three files: `collectives` (a weight's all-gather and its gradient's
reduce-scatter), `loop` (the scanned layer loop that gathers one layer at a time, with or
without prefetch) and `module` (`shard` / `unshard`: where each weight is stored and how a
call runs inside ``jax.shard_map``). `stack` (`Stack`) puts any NNX block on that loop.
"""

from gtp_jax.sharding.collectives import gather_weight, reduce_scatter_grad
from gtp_jax.sharding.contract import InputLayout, OutputLayout
from gtp_jax.sharding.fp8_update import apply_fp8_history
from gtp_jax.sharding.gather_spec import GatherSpec
from gtp_jax.sharding.init import shard_init
from gtp_jax.sharding.lazy import GTPShard
from gtp_jax.sharding.module import (
    ShardedModule,
    bytes_per_device,
    shard,
    unshard,
    unshard_values,
)
from gtp_jax.sharding.replicated import Replicated, replicated
from gtp_jax.sharding.scan import scan_layers
from gtp_jax.sharding.stack import Stack
from gtp_jax.sharding.verify import LeafCheck, ShardCheck, check_sharded

__all__ = [
    "Replicated",
    "GTPShard",
    "apply_fp8_history",
    "GatherSpec",
    "InputLayout",
    "LeafCheck",
    "OutputLayout",
    "ShardCheck",
    "ShardedModule",
    "Stack",
    "bytes_per_device",
    "check_sharded",
    "gather_weight",
    "reduce_scatter_grad",
    "replicated",
    "scan_layers",
    "shard",
    "shard_init",
    "unshard",
    "unshard_values",
]
