"""gtp_jax: Generalized Tensor Parallelism for JAX.

Weights (and their gradients and optimizer state) are stored 1/N along a mesh axis,
all-gathered just in time inside ``jax.shard_map`` and reduce-scattered in the backward pass.

    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    model = gtp_jax.shard(MyNNXModel(rngs=nnx.Rngs(0)), mesh, gtp_jax.GTPConfig())
"""

from gtp_jax.base.xla_flags import apply_default_xla_flags

# Before anything can start the XLA backend: compute/communication overlap on GPUs depends
# on these flags. Opt out with GTP_JAX_NO_DEFAULT_XLA_FLAGS=1; `describe_mesh` and the
# command line's summary show what was added (see `gtp_jax.base.xla_flags`).
apply_default_xla_flags()

from gtp_jax import parallel  # noqa: E402
from gtp_jax.base.axes import ParallelAxes, current_axes  # noqa: E402
from gtp_jax.base.config import GTPConfig  # noqa: E402
from gtp_jax.base.errors import UsageError, UsageTypeError  # noqa: E402
from gtp_jax.base.mesh import (  # noqa: E402
    data_axes,
    data_sharding,
    describe_mesh,
    make_mesh,
    seq_axes,
    seq_sharding,
    shard_key,
)
from gtp_jax.base.state import BatchMean, BatchSum, PerExample, SameOnEveryShard  # noqa: E402
from gtp_jax.sharding import (  # noqa: E402
    GTPShard,
    InputLayout,
    OutputLayout,
    ShardCheck,
    ShardedModule,
    Stack,
    apply_fp8_history,
    bytes_per_device,
    check_sharded,
    replicated,
    scan_layers,
    shard,
    shard_init,
    unshard,
    unshard_values,
)

__version__ = "0.1.0"

__all__ = [
    "BatchMean",
    "BatchSum",
    "GTPConfig",
    "GTPShard",
    "InputLayout",
    "OutputLayout",
    "ParallelAxes",
    "PerExample",
    "ShardCheck",
    "ShardedModule",
    "Stack",
    "apply_fp8_history",
    "bytes_per_device",
    "check_sharded",
    "current_axes",
    "data_axes",
    "data_sharding",
    "describe_mesh",
    "make_mesh",
    "parallel",
    "replicated",
    "SameOnEveryShard",
    "seq_axes",
    "seq_sharding",
    "scan_layers",
    "shard",
    "shard_init",
    "shard_key",
    "unshard",
    "unshard_values",
    "UsageError",
    "UsageTypeError",
]
