"""Explicit weight collectives: all-gather a shard just in time, reduce-scatter its gradient.

All functions here run *inside* ``jax.shard_map`` over a mesh that has the GTP axis; the
array they receive is the local shard.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

#: `checkpoint_name` of every gathered weight. Remat policies that do not save this name
#: make the backward pass re-gather the weight instead of keeping it from the forward pass.
GATHERED_WEIGHT = "gtp_gathered_weight"


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


def all_gather_shard(shard: jax.Array, spec: GatherSpec) -> jax.Array:
    """Gathers a local shard into the full logical weight (no gradient rule of its own).

    Args:
      shard: local shard, shape ``spec.shard_shape``, dtype ``spec.param_dtype``.
      spec: the weight's `GatherSpec`; ``spec.axis`` must be a manual mesh axis here.

    Returns:
      ``spec.logical_shape`` array in ``spec.compute_dtype``; padding rows are dropped.
    """
    return all_gather_shards([shard], [spec])[0]


def all_gather_shards(shards: Sequence[jax.Array], specs: Sequence[GatherSpec]
                      ) -> list[jax.Array]:
    """Gathers several weights at once (e.g. one layer's), inside ``shard_map``.

    Weights with a low-precision ``gather_format`` are quantized from their local
    (high-precision) shard with scales agreed over ``spec.axis`` by ONE all-reduce for all of
    them (`gtp_jax.pallas.quantize_coalesced`); payload and block scales are all-gathered
    and dequantized to ``spec.compute_dtype``. Other weights are cast to ``gather_dtype``
    (if set) and all-gathered as they are.

    Args:
      shards: local shards, ``spec.shard_shape`` / ``spec.param_dtype`` each.
      specs: one `GatherSpec` per shard.

    Returns:
      The logical weights (``spec.logical_shape`` / ``spec.compute_dtype``), in order.
    """
    for shard, spec in zip(shards, specs):
        _check_shard(shard, spec)
    out: list[Any] = [None] * len(shards)
    groups: dict[tuple[str, str, str], list[int]] = {}
    direct: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        if spec.fp8_in_dims:
            direct.setdefault(spec.axis, []).append(i)
            continue
        if spec.quantized:
            groups.setdefault((spec.gather_format, resolve_quant_backend(spec.quant_backend),
                               spec.axis), []).append(i)
            continue
        shard = shards[i]
        if spec.gather_dtype is not None:
            shard = shard.astype(spec.gather_dtype)
        if spec.axis_size > 1:
            shard = jax.lax.all_gather(shard, spec.axis, axis=spec.shard_dim, tiled=True)
        out[i] = _unpad(shard, spec)
    for (gather_format, backend, axis), idx in groups.items():
        from gtp_jax import pallas  # deferred: the kernels load only when a format is used

        # A 1-wide axis needs no collective, and may not even be bound (one device runs
        # without shard_map): scales stay local and nothing is gathered.
        wide = specs[idx[0]].axis_size > 1
        qs = pallas.quantize_coalesced([shards[i] for i in idx], gather_format,
                                       axis if wide else None,
                                       dim=[specs[i].block_axis for i in idx],
                                       backend=backend)
        for i, q in zip(idx, qs):
            spec = specs[i]
            full = pallas.gather_quantized(q, axis, dim=spec.shard_dim) if wide else q
            out[i] = _unpad(pallas.dequantize(full, spec.compute_dtype, backend=backend), spec)
    for idx in direct.values():
        from gtp_jax.sharding.fp8_gather import gather_fp8  # deferred: it imports this module

        for i, w in zip(idx, gather_fp8([shards[i] for i in idx], [specs[i] for i in idx])):
            out[i] = w
    return out


def resolve_quant_backend(backend: str | None) -> str:
    """`backend`, with None resolved: "pallas" where the default JAX backend is a GPU, else
    "reference" (the same bits without the Pallas interpreter's cost)."""
    if backend is None:
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return backend


def _unpad(full: jax.Array, spec: GatherSpec) -> jax.Array:
    logical = spec.logical_shape[spec.shard_dim]
    if logical != full.shape[spec.shard_dim]:
        full = jax.lax.slice_in_dim(full, 0, logical, axis=spec.shard_dim)
    return full


def reduce_scatter_grad(grad: jax.Array, spec: GatherSpec) -> jax.Array:
    """Sums a full-weight gradient over the GTP axis and keeps this device's shard.

    Args:
      grad: this device's partial gradient of the full weight, shape ``spec.logical_shape``.
      spec: the weight's `GatherSpec`.

    Returns:
      The gradient shard, shape ``spec.shard_shape``, dtype ``spec.param_dtype``; rows that
      are padding get exactly zero, so padded parameters never move.
    """
    grad = grad.astype(spec.reduce_dtype)
    pad = spec.padded_size - spec.logical_shape[spec.shard_dim]
    if pad:
        widths = [(0, 0)] * grad.ndim
        widths[spec.shard_dim] = (0, pad)
        grad = jnp.pad(grad, widths)
    if spec.axis_size > 1:
        grad = jax.lax.psum_scatter(grad, spec.axis, scatter_dimension=spec.shard_dim,
                                    tiled=True)
    return grad.astype(spec.param_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(shard: jax.Array, spec: GatherSpec) -> jax.Array:
    return all_gather_shard(shard, spec)


def _gather_fwd(shard: jax.Array, spec: GatherSpec) -> tuple[jax.Array, None]:
    # No residuals: the backward rule needs only the cotangent, so the full weight is not
    # kept alive by this op (whether the *consumer* keeps it is up to the remat policy).
    return all_gather_shard(shard, spec), None


def _gather_bwd(spec: GatherSpec, _: None, ct: Any) -> tuple[jax.Array]:
    return (reduce_scatter_grad(gradient_of(ct), spec),)


def gradient_of(ct: Any) -> jax.Array:
    """The full-weight gradient in a gathered weight's cotangent (for an
    `Fp8GatheredWeight`, its value's: the payloads have none)."""
    return ct.value if hasattr(ct, "bits_t") else ct


_gather.defvjp(_gather_fwd, _gather_bwd)


def gather_weight(shard: jax.Array, spec: GatherSpec) -> jax.Array:
    """All-gathers a weight shard just before use; its gradient is reduce-scattered.

    Forward: cast (optional) + ``all_gather(tiled=True)`` over ``spec.axis`` + unpad.
    Backward (``custom_vjp``): pad + ``psum_scatter(tiled=True)`` in ``spec.reduce_dtype``,
    so the gradient leaves already sharded and no full-size gradient is summed anywhere.
    The output is tagged with `GATHERED_WEIGHT` so remat policies can drop and re-gather it.

    Args:
      shard: local shard, ``spec.shard_shape`` / ``spec.param_dtype``.
      spec: static `GatherSpec`.

    Returns:
      The logical weight, ``spec.logical_shape`` / ``spec.compute_dtype`` (an
      `Fp8GatheredWeight` standing for it where ``spec.fp8_in_dims`` is set).
    """
    if spec.quantized:
        # The dequantize chain (decode, scale, cast, unpad) is several ordinary ops that a
        # remat policy could save one by one; a nested checkpoint makes the whole gather one
        # equation that `gathered_weight_policy` refuses to save (recognised by this policy).
        gathered = jax.checkpoint(functools.partial(_gather, spec=spec),
                                  policy=regather_policy)(shard)
    else:
        gathered = _gather(shard, spec)
    return checkpoint_name(gathered, GATHERED_WEIGHT)


def regather_policy(*_: Any, **__: Any) -> bool:
    """Remat policy of a low-precision gather: save nothing (it is re-gathered whole)."""
    return False


def _check_shard(shard: Any, spec: GatherSpec) -> None:
    if tuple(shard.shape) != spec.shard_shape:
        raise ValueError(
            f"gather_weight: shard shape {tuple(shard.shape)} does not match the spec's "
            f"{spec.shard_shape} (logical {spec.logical_shape}, split on dim {spec.shard_dim} "
            f"over {spec.axis_size} devices); was the weight sharded for another mesh?"
        )
