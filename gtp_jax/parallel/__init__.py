"""Tensor, sequence and expert parallelism that composes with GTP (functions for shard_map).

* `axes`: which ``tp`` / ``ep`` axes the traced model runs under (`current_axes`).
* `tp`: Megatron column/row-parallel GEMMs with sequence parallelism.
* `collective_matmul`: all-gather+GEMM and GEMM+reduce-scatter, plain or as ppermute rings.
* `moe`: top-k routed mixture of experts with capacity, balance loss and ``ep`` all-to-all.
"""

from gtp_jax.base.axes import EP_AXIS, TP_AXIS, ParallelAxes, current_axes, use_axes
from gtp_jax.parallel.collective_matmul import (
    all_gather_matmul,
    all_gather_matmul_chunks,
    matmul_reduce_scatter,
    matmul_reduce_scatter_chunks,
)
from gtp_jax.parallel.moe import MoE, Routing, combine, dispatch, expert_capacity, moe_ffn, route
from gtp_jax.parallel.tp import (
    column_parallel,
    pad_seq,
    row_parallel,
    seq_all_gather,
    seq_chunk,
    seq_reduce_scatter,
)

__all__ = [
    "EP_AXIS",
    "MoE",
    "ParallelAxes",
    "Routing",
    "TP_AXIS",
    "all_gather_matmul",
    "all_gather_matmul_chunks",
    "column_parallel",
    "combine",
    "current_axes",
    "dispatch",
    "expert_capacity",
    "matmul_reduce_scatter",
    "matmul_reduce_scatter_chunks",
    "moe_ffn",
    "pad_seq",
    "route",
    "row_parallel",
    "seq_all_gather",
    "seq_chunk",
    "seq_reduce_scatter",
    "use_axes",
]
