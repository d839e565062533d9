"""`GatherSpec`: how one GTP-sharded weight is stored on a device and gathered back.

The static description every collective, the layer loop and the plan share (its own module
so that the gather paths, plain and FP8, import it without importing each other).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class GatherSpec:
    """Static description of one sharded weight, as one device sees it.

    Attributes:
      axis: GTP mesh axis name.
      axis_size: number of shards.
      shard_dim: dimension of the *per-layer* weight that is split (and padded).
      logical_shape: per-layer weight shape the module's math sees (no padding).
      padded_size: size of `shard_dim` after padding (a multiple of `axis_size`).
      param_dtype: dtype of the stored shard (and of its gradient).
      gather_dtype: dtype the shard is cast to before the all-gather, or None.
      reduce_dtype: dtype the gradient is reduce-scattered in.
      gather_format: low-precision gather format ("fp8", "mxfp8", "nvfp4") or None.
      quant_backend: "pallas" or "reference" implementation of the quantizer, or None:
        the kernels when the default backend is a GPU, else the reference.
      fp8_in_dims: > 0 for the kernel of an FP8-compute layer gathered in fp8: it is
        gathered as a `gtp_jax.sharding.fp8_gather.Fp8GatheredWeight` whose payload the
        layer's FP8 GEMM reads as is; the layer contracts its first `fp8_in_dims` dims.
      coalesce: gathered (and its gradient reduce-scattered) in one collective with the
        other coalescing weights of the same call (`GTPConfig.coalesce_layer_collectives`).
      data_axes: mesh axes the gradient shard is summed over right after its reduce-scatter
        (a layer-stacked weight under data parallelism: each layer's all-reduce then runs
        in the backward pass, beside the next layer's compute, instead of once over the
        whole stacks after it; `gtp_jax.sharding.module`). Empty: summed, if at all, where
        the sharded call's ``shard_map`` ends.
    """

    axis: str
    axis_size: int
    shard_dim: int
    logical_shape: tuple[int, ...]
    padded_size: int
    param_dtype: np.dtype
    gather_dtype: np.dtype | None
    reduce_dtype: np.dtype
    gather_format: str | None = None
    quant_backend: str | None = None
    fp8_in_dims: int = 0
    coalesce: bool = False
    data_axes: tuple[str, ...] = ()

    @property
    def padding(self) -> int:
        """Zero entries appended to `shard_dim` so that `axis_size` divides it (0: none)."""
        return self.padded_size - self.logical_shape[self.shard_dim]

    @property
    def padded_shape(self) -> tuple[int, ...]:
        shape = list(self.logical_shape)
        shape[self.shard_dim] = self.padded_size
        return tuple(shape)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        shape = list(self.logical_shape)
        shape[self.shard_dim] = self.padded_size // self.axis_size
        return tuple(shape)

    @property
    def compute_dtype(self) -> np.dtype:
        return self.gather_dtype if self.gather_dtype is not None else self.param_dtype

    @property
    def quantized(self) -> bool:
        """Gathered in a low-precision format (rank-1 weights never are)."""
        return self.gather_format is not None and len(self.logical_shape) >= 2

    @property
    def block_axis(self) -> int:
        """Axis of the format's scaling blocks: the last one that is not the shard dim.

        Blocks never straddle two shards this way, so shards need no block alignment. The
        gathered weight is dequantized before its GEMM, so the block axis only sets which
        elements share a scale, not the GEMM's layout.
        """
        last = len(self.logical_shape) - 1
        return last if self.shard_dim != last else last - 1
