"""Which parameters of a module are GTP-sharded, and how (the static "plan").

A plan is computed once, at `gtp_jax.shard` time, from the module's parameters, the mesh
and the `GTPConfig`; everything in it is static and hashable.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from gtp_jax.config import GTPConfig
from gtp_jax.sharding.collectives import GatherSpec

#: Variable metadata key marking a parameter whose leading dim is a layer stack (scanned
#: layers). Such weights are split along dim 1 and gathered one layer at a time.
STACKED = "gtp_stacked"


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """How one parameter is stored.

    Attributes:
      path: ``/``-joined parameter path inside the module.
      spec: per-layer `GatherSpec` (for a stacked weight, one layer's slice).
      stacked: the leading dim is a layer stack (split happens on dim 1 of the stored array).
    """

    path: str
    spec: GatherSpec
    stacked: bool

    @property
    def stored_dim(self) -> int:
        """Dimension of the stored (global) array that is split over the GTP axis."""
        return self.spec.shard_dim + int(self.stacked)

    def logical_shape(self, num_layers: int | None = None) -> tuple[int, ...]:
        lead = (num_layers,) if self.stacked else ()
        return lead + self.spec.logical_shape

    def partition_spec(self, ndim: int) -> P:
        """`PartitionSpec` of the stored array: the GTP axis on `stored_dim`."""
        entries: list[str | None] = [None] * ndim
        entries[self.stored_dim] = self.spec.axis
        return P(*entries)


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
) -> ParamPlan | None:
    """Decides whether one parameter is sharded; returns its plan or None (replicated).

    Raises:
      TypeError: an `include` pattern explicitly selects a non-floating parameter.
    """
    explicit = bool(config.include) and any(re.search(p, path) for p in config.include)
    if config.include and not explicit:
        return None
    if any(re.search(p, path) for p in config.exclude):
        return None
    is_float = jnp.issubdtype(dtype, jnp.floating)
    per_layer = shape[1:] if stacked else shape
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
    axis_size = mesh.shape[config.axis]
    align = config.alignment(axis_size)
    padded = -(-per_layer[0] // align) * align
    spec = GatherSpec(
        axis=config.axis,
        axis_size=axis_size,
        shard_dim=0,
        logical_shape=tuple(int(d) for d in per_layer),
        padded_size=int(padded),
        param_dtype=np.dtype(dtype),
        gather_dtype=config.gather_dtype,
        reduce_dtype=config.reduce_dtype,
    )
    return ParamPlan(path=path, spec=spec, stacked=stacked)
