"""gtp_jax: Generalized Tensor Parallelism for JAX.

Weights (and their gradients and optimizer state) are stored 1/N along a mesh axis,
all-gathered just in time inside ``jax.shard_map`` and reduce-scattered in the backward pass.

    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    model = gtp_jax.shard(MyNNXModel(rngs=nnx.Rngs(0)), mesh, gtp_jax.GTPConfig())
"""

from gtp_jax.xla_flags import apply_default_xla_flags

# Before anything starts the XLA backend: overlap depends on these flags (see xla_flags.py).
apply_default_xla_flags()

from gtp_jax import parallel  # noqa: E402
from gtp_jax.config import GTPConfig  # noqa: E402
from gtp_jax.parallel import ParallelAxes, current_axes  # noqa: E402
from gtp_jax.sharding import (  # noqa: E402
    GTPShard,
    OutputLayout,
    ShardedModule,
    bytes_per_device,
    data_axes,
    data_sharding,
    describe_mesh,
    make_mesh,
    replicated,
    scan_layers,
    shard,
    shard_key,
    unshard,
    unshard_values,
)

__version__ = "0.1.0"

__all__ = [
    "GTPConfig",
    "GTPShard",
    "OutputLayout",
    "ParallelAxes",
    "ShardedModule",
    "bytes_per_device",
    "current_axes",
    "data_axes",
    "data_sharding",
    "describe_mesh",
    "make_mesh",
    "parallel",
    "replicated",
    "scan_layers",
    "shard",
    "shard_key",
    "unshard",
    "unshard_values",
]
