"""Which parameters of a module are GTP-sharded, and how (the static "plan").

A plan is computed once, at `gtp_jax.shard` time, from the module's parameters, their
Variable metadata, the mesh and the `GTPConfig`; everything in it is static and hashable.

Two kinds of splitting compose on one weight:

* model-parallel splits (`DimSplit`): Megatron tensor parallelism on the ``tp`` axis and
  expert parallelism on the ``ep`` axis. The module's math runs on the *local* piece (this
  rank's heads, hidden columns or experts). The dims are named by Variable metadata that the
  model author sets: `TP_DIM` (with `TP_PARTS` for fused projections such as ``[gate | up]``)
  and `EP_DIM`.
* the GTP split (`GatherSpec`) over ``GTPConfig.axis``: the local piece is itself stored
  1/N and all-gathered just in time. Its dim (`SHARD_DIM`, default: the first dim that no
  model-parallel axis splits) must differ from the model-parallel dims.

The stored global array therefore has e.g. ``P(None, "gtp", None, "tp", None)`` for a
stacked ``[L, d, 3, H, hd]`` qkv kernel, and the `GatherSpec` describes the TP-local weight
``[d, 3, H/tp, hd]`` that the gather produces.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from gtp_jax.base.config import GTPConfig
from gtp_jax.base.metadata import EP_DIM, SHARD_DIM, SPLIT_AXES, TP_DIM, TP_PARTS, TP_UNEVEN
from gtp_jax.base.shapes import round_up
from gtp_jax.sharding.gather_spec import GatherSpec


@dataclasses.dataclass(frozen=True)
class DimSplit:
    """One per-layer dim split over a model-parallel mesh axis (``tp`` or ``ep``).

    The dim holds `parts` equal fused pieces (1: none), each split into `axis_size` chunks;
    rank ``r`` stores ``[piece_0 chunk r, piece_1 chunk r, ...]``, so the local block is
    again a fused ``[piece_0 | piece_1 | ...]`` of the local sizes (for ``parts > 1`` the
    stored array is a column permutation of the logical one). An unfused dim (``parts=1``)
    that does not divide is zero-padded at its end (e.g. attention heads); the model must
    keep padded entries at exactly zero (zero weights that get zero gradients).

    Attributes:
      axis: mesh axis name.
      axis_size: its size (> 1).
      dim: per-layer dimension index.
      size: logical (unpadded) size of the dim, all parts together.
      parts: number of fused pieces along the dim.
    """

    axis: str
    axis_size: int
    dim: int
    size: int
    parts: int = 1

    @property
    def part_size(self) -> int:
        return self.size // self.parts

    @property
    def padded_part(self) -> int:
        return round_up(self.part_size, self.axis_size)

    @property
    def stored_size(self) -> int:
        """Size of the dim in the stored (global, padded) array."""
        return self.parts * self.padded_part

    @property
    def local_size(self) -> int:
        """Size of the dim on one rank (what the module's math sees)."""
        return self.stored_size // self.axis_size

    def to_stored(self, x, dim: int):
        """Logical array -> padded, part-interleaved layout on `dim` (jnp or np arrays)."""
        lead, tail = x.shape[:dim], x.shape[dim + 1:]
        x = x.reshape(*lead, self.parts, self.part_size, *tail)
        widths = [(0, 0)] * x.ndim
        widths[dim + 1] = (0, self.padded_part - self.part_size)
        x = jnp.pad(x, widths)
        n, local = self.axis_size, self.padded_part // self.axis_size
        x = x.reshape(*lead, self.parts, n, local, *tail)
        x = jnp.swapaxes(x, dim, dim + 1)
        return x.reshape(*lead, self.stored_size, *tail)

    def from_stored(self, x, dim: int):
        """Inverse of `to_stored`: drops the padding and restores the parts' order."""
        lead, tail = x.shape[:dim], x.shape[dim + 1:]
        n, local = self.axis_size, self.padded_part // self.axis_size
        x = x.reshape(*lead, n, self.parts, local, *tail)
        x = jnp.swapaxes(x, dim, dim + 1)
        x = x.reshape(*lead, self.parts, self.padded_part, *tail)
        x = jnp.take(x, jnp.arange(self.part_size), axis=dim + 1)
        return x.reshape(*lead, self.size, *tail)


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """How a parameter that is model-parallel split but *not* GTP-sharded is stored.

    Attributes:
      path: ``/``-joined parameter path inside the module.
      stacked: the leading dim is a layer stack.
      splits: the model-parallel splits (per-layer dims).
    """

    path: str
    stacked: bool
    splits: tuple[DimSplit, ...]

    @property
    def spec(self) -> None:
        return None

    def partition_spec(self, ndim: int) -> P:
        """`PartitionSpec` of the stored array: each split's axis on its dim."""
        entries: list[str | None] = [None] * ndim
        for s in self.splits:
            entries[s.dim + int(self.stacked)] = s.axis
        return P(*entries)

    def to_stored(self, value):
        """Full logical array -> stored layout (padding and part interleave)."""
        for s in self.splits:
            value = s.to_stored(value, s.dim + int(self.stacked))
        return value

    def from_stored(self, value):
        """Stored layout -> full logical array (exact inverse of `to_stored`)."""
        for s in reversed(self.splits):
            value = s.from_stored(value, s.dim + int(self.stacked))
        return value

    @property
    def stored_as_is(self) -> bool:
        """The stored array is the logical one (no fused parts, no padding): only its
        sharding differs."""
        return all(s.parts == 1 and s.padded_part == s.part_size for s in self.splits)


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """How one GTP-sharded parameter is stored.

    Attributes:
      path: ``/``-joined parameter path inside the module.
      spec: per-layer `GatherSpec` of the model-parallel-local weight (for a stacked
        weight, one layer's slice; with ``tp``/``ep`` splits, this rank's piece).
      stacked: the leading dim is a layer stack (split happens on dim 1 of the stored array).
      splits: model-parallel splits applied before GTP (empty without ``tp``/``ep``).
      local: the module may read the shard itself (`gtp_jax.base.metadata.LOCAL`): it
        reaches the call as a `gtp_jax.sharding.lazy.LazyWeight`, gathered only where read.
    """

    path: str
    spec: GatherSpec
    stacked: bool
    splits: tuple[DimSplit, ...] = ()
    local: bool = False

    @property
    def stored_dim(self) -> int:
        """Dimension of the stored (global) array that is split over the GTP axis."""
        return self.spec.shard_dim + int(self.stacked)

    def logical_shape(self, n_layers: int | None = None) -> tuple[int, ...]:
        """Shape the module's math sees on one rank (model-parallel local, unpadded)."""
        lead = (n_layers,) if self.stacked else ()
        return lead + self.spec.logical_shape

    def partition_spec(self, ndim: int) -> P:
        """`PartitionSpec` of the stored array: the GTP axis on `stored_dim`, model-parallel
        axes on their dims."""
        entries = list(SplitPlan(self.path, self.stacked, self.splits).partition_spec(ndim))
        entries[self.stored_dim] = self.spec.axis
        return P(*entries)

    def to_stored(self, value):
        """Full logical array -> stored layout: model-parallel splits, then GTP padding."""
        value = SplitPlan(self.path, self.stacked, self.splits).to_stored(value)
        widths = [(0, 0)] * value.ndim
        widths[self.stored_dim] = (0, self.spec.padded_size - value.shape[self.stored_dim])
        return jnp.pad(value, widths)

    def from_stored(self, value):
        """Stored layout -> full logical array (exact inverse of `to_stored`)."""
        logical = self.spec.logical_shape[self.spec.shard_dim]
        value = jnp.take(value, jnp.arange(logical), axis=self.stored_dim)
        return SplitPlan(self.path, self.stacked, self.splits).from_stored(value)

    @property
    def stored_as_is(self) -> bool:
        """The stored array is the logical one (no model-parallel split, no GTP padding):
        only its sharding differs."""
        return not self.splits and not self.spec.padding


def model_splits(path: str, per_layer: tuple[int, ...], metadata: dict, mesh: Mesh,
                 gtp_axis: str) -> tuple[DimSplit, ...]:
    """The model-parallel splits a parameter's metadata asks for on `mesh`.

    Axes of size 1 (or missing from the mesh) split nothing.

    Raises:
      ValueError: a dim is out of range or named twice, `TP_PARTS` does not divide the dim,
        the expert dim does not divide by ``ep``, or a split uses the GTP axis.
    """
    splits = []
    used: dict[int, str] = {}
    for key, axis in SPLIT_AXES.items():
        dim = metadata.get(key)
        if dim is None:
            continue
        if not isinstance(dim, (int, np.integer)) or not -len(per_layer) <= dim < len(per_layer):
            raise ValueError(
                f"Parameter {path!r}: metadata {key}={dim!r} is not a dim of its per-layer "
                f"shape {per_layer}; set it to a dim index in [0, {len(per_layer)}).")
        dim = int(dim) % len(per_layer)
        if dim in used:
            raise ValueError(
                f"Parameter {path!r}: dim {dim} is named by both {used[dim]} and {key}; a "
                "dim can be split over one mesh axis only.")
        used[dim] = key
        size = int(mesh.shape.get(axis, 1))
        if size == 1:
            continue
        if axis == gtp_axis:
            raise ValueError(
                f"Parameter {path!r}: GTPConfig.axis={gtp_axis!r} is also its {key} axis; "
                "use distinct mesh axes for GTP and tensor/expert parallelism.")
        if key == TP_DIM and metadata.get(TP_UNEVEN) == "replicate" and per_layer[dim] % size:
            continue  # replicated over tp: every rank holds (and uses) the whole dim
        parts = int(metadata.get(TP_PARTS, 1)) if key == TP_DIM else 1
        if parts < 1 or per_layer[dim] % parts:
            raise ValueError(
                f"Parameter {path!r}: {TP_PARTS}={parts} does not divide dim {dim} of size "
                f"{per_layer[dim]}.")
        if parts > 1 and (per_layer[dim] // parts) % size:
            # Padding inside a fused dim would put zeros between real columns of the stored
            # array, which no "logical shape + trailing padding" reader (unshard excepted)
            # could undo; an even split keeps the stored layout a pure permutation.
            raise ValueError(
                f"Parameter {path!r}: its {parts} fused parts of {per_layer[dim] // parts} "
                f"columns each (dim {dim}) do not divide over {axis}={size}; choose a hidden "
                f"width (e.g. d_ff) that is a multiple of {size}.")
        if key == EP_DIM and per_layer[dim] % size:
            raise ValueError(
                f"Parameter {path!r}: its expert dim {dim} has {per_layer[dim]} experts, not "
                f"divisible by ep={size}; choose a number of experts that is a multiple of "
                "ep, or a smaller ep.")
        splits.append(DimSplit(axis=axis, axis_size=size, dim=dim, size=int(per_layer[dim]),
                               parts=parts))
    return tuple(splits)


#: The leading free dim is kept unless padding it adds more than this fraction of the weight
#: (per device); then the free dim with the least padding is chosen.
PAD_TOLERANCE = 1 / 32


def choose_shard_dim(path: str, per_layer: tuple[int, ...], metadata: dict,
                     splits: tuple[DimSplit, ...], align: int = 1) -> int | None:
    """The per-layer dim GTP shards (None when every dim is split over a model-parallel axis).

    `SHARD_DIM` metadata wins. Otherwise the first dim no model-parallel split uses (it
    gathers contiguously), unless padding it to a multiple of `align` (the GTP axis size
    times ``GTPConfig.pad_for_alignment``) would add more than `PAD_TOLERANCE` of the
    weight: then the free dim with the fewest padded elements (ties: the lowest index). A
    ``[3, 3, 64, 64]`` conv kernel with ``align=64`` is thus split on its input channels
    (dim 2) instead of its height, which would pad 3 rows to 64.

    Args:
      per_layer: the model-parallel-local per-layer shape (what is gathered).
      align: the multiple each candidate dim is padded to.

    Raises:
      ValueError: `SHARD_DIM` is out of range or names a model-parallel dim.
    """
    taken = {s.dim for s in splits}
    dim = metadata.get(SHARD_DIM)
    if dim is None:
        free = [d for d in range(len(per_layer)) if d not in taken]
        if not free:
            return None
        align = max(int(align), 1)

        def padded(d: int) -> int:
            return -(-per_layer[d] // align) * align * int(np.prod(per_layer)) // max(
                per_layer[d], 1)

        first, best = free[0], min(free, key=lambda d: (padded(d), d))
        logical = max(int(np.prod(per_layer)), 1)
        return first if padded(first) <= logical * (1 + PAD_TOLERANCE) else best
    if not isinstance(dim, (int, np.integer)) or not -len(per_layer) <= dim < len(per_layer):
        raise ValueError(
            f"Parameter {path!r}: metadata {SHARD_DIM}={dim!r} is not a dim of its per-layer "
            f"shape {per_layer}.")
    dim = int(dim) % len(per_layer)
    if dim in taken:
        raise ValueError(
            f"Parameter {path!r}: {SHARD_DIM}={dim} is also split over a model-parallel axis "
            f"({[s.axis for s in splits if s.dim == dim][0]!r}); GTP must shard another dim.")
    return dim


def path_str(path: Iterable[object]) -> str:
    """``("blocks", 0, "kernel")`` -> ``"blocks/0/kernel"``."""
    return "/".join(str(p) for p in path)


def plan_param(
    path: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    *,
    stacked: bool,
    mesh: Mesh,
    config: GTPConfig,
    splits: tuple[DimSplit, ...] = (),
    shard_dim: int | None = 0,
) -> ParamPlan | None:
    """Decides whether one parameter is GTP-sharded; returns its plan or None.

    Eligibility (rank, size) is judged on the model-parallel-local shape, which is what the
    all-gather moves. None means "not GTP-sharded"; the caller still applies `splits`.

    Args:
      splits: model-parallel splits (`model_splits`); the `GatherSpec` describes the local
        piece they leave on one rank.
      shard_dim: per-layer dim to GTP-shard (`choose_shard_dim`); None: no dim is free.

    Raises:
      TypeError: an `include` pattern explicitly selects a non-floating parameter.
    """
    explicit = bool(config.include) and any(re.search(p, path) for p in config.include)
    if config.include and not explicit:
        return None
    if any(re.search(p, path) for p in config.exclude):
        return None
    is_float = jnp.issubdtype(dtype, jnp.floating)
    per_layer = list(shape[1:] if stacked else shape)
    for s in splits:
        per_layer[s.dim] = s.local_size
    per_layer = tuple(per_layer)
    if explicit:
        if not is_float:
            raise TypeError(
                f"GTPConfig.include selects parameter {path!r} of dtype {dtype}, but only "
                "floating-point weights can be sharded; narrow the include pattern."
            )
        if len(per_layer) < 1:
            raise ValueError(
                f"GTPConfig.include selects parameter {path!r} of per-layer shape {per_layer}; "
                "a scalar cannot be sharded. Narrow the include pattern."
            )
    else:
        if not is_float or len(per_layer) < 2 or int(np.prod(per_layer)) < config.min_elements:
            return None
    if shard_dim is None:
        return None
    axis_size = mesh.shape[config.axis]
    align = config.alignment(axis_size)
    padded = round_up(per_layer[shard_dim], align)
    spec = GatherSpec(
        axis=config.axis,
        axis_size=axis_size,
        shard_dim=shard_dim,
        logical_shape=tuple(int(d) for d in per_layer),
        padded_size=int(padded),
        param_dtype=np.dtype(dtype),
        gather_dtype=config.gather_dtype,
        reduce_dtype=config.reduce_dtype,
        gather_format=config.gather_format,
        quant_backend=config.quant_backend,
        coalesce=config.coalesce_layer_collectives,
    )
    return ParamPlan(path=path, spec=spec, stacked=stacked, splits=tuple(splits))
