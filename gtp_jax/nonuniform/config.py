"""`NonuniformConfig`: the base degree, the spares, the axis, the failed devices; and the
model dims (`DimRule`) a reduced degree must still be able to split.

The config is checked on its own at construction (types, ranges, coordinate syntax); what
depends on a mesh or a model (axis names, coordinate ranges, failures per group, dims) is
checked by `gtp_jax.nonuniform.plan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from gtp_jax.base.errors import UsageError, UsageTypeError

#: Axes whose degree may be reduced.
AXES = ("tp", "gtp")


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class NonuniformConfig:
    """Nonuniform tensor parallelism settings.

    Attributes:
      tp_base: degree of a healthy replica (the mesh's size on `axis`).
      tp_spares: devices per group that a degraded replica leaves idle; its degree is
        ``tp_base - tp_spares``. Every group of a degraded replica drops exactly this many
        (failed ones first), so all degraded groups have one degree.
      axis: the reduced axis, ``"tp"`` (Megatron TP) or ``"gtp"``.
      failed: the failed devices, each a mesh coordinate (``{"dp": 1, "tp": 3}``; axes
        left out are 0) or a device id (int). Stored normalised: coordinates as sorted
        ``((axis, index), ...)`` tuples, so the config is hashable.
    """

    tp_base: int
    tp_spares: int
    axis: str = "tp"
    failed: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.tp_base) or self.tp_base < 1:
            raise UsageError(f"NonuniformConfig: tp_base={self.tp_base!r} must be a positive "
                             "int (the degree of a healthy replica).")
        if not _is_int(self.tp_spares) or not 0 <= self.tp_spares < self.tp_base:
            raise UsageError(
                f"NonuniformConfig: tp_spares={self.tp_spares!r} must be an int in [0, "
                f"tp_base={self.tp_base}); a degraded replica needs at least one device.")
        if not isinstance(self.axis, str) or self.axis not in AXES:
            raise UsageError(f"NonuniformConfig: axis={self.axis!r}; choose one of {AXES}.")
        if isinstance(self.failed, (Mapping, str)) or not isinstance(self.failed,
                                                                     (tuple, list)):
            raise UsageTypeError(
                f"NonuniformConfig: failed={self.failed!r} must be a tuple of mesh "
                "coordinates (dicts such as {'dp': 1, 'tp': 3}) or device ids.")
        norm = []
        for item in self.failed:
            if _is_int(item):
                if item < 0:
                    raise UsageError(f"NonuniformConfig: failed device id {item} must be >= 0.")
                norm.append(int(item))
                continue
            if isinstance(item, tuple) and all(isinstance(p, tuple) and len(p) == 2
                                               for p in item):
                item = dict(item)
            if not isinstance(item, Mapping) or not item:
                raise UsageTypeError(
                    f"NonuniformConfig: failed entry {item!r} must be a device id (int) or a "
                    "non-empty mesh coordinate dict such as {'dp': 1, 'tp': 3}.")
            for k, v in item.items():
                if not isinstance(k, str) or not _is_int(v) or v < 0:
                    raise UsageError(
                        f"NonuniformConfig: failed coordinate {dict(item)!r} must map axis "
                        "names (str) to indices (int >= 0).")
            norm.append(tuple(sorted((k, int(v)) for k, v in item.items())))
        if len(set(norm)) != len(norm):
            raise UsageError(f"NonuniformConfig: failed={self.failed!r} names a device twice; "
                             "list each failed device once.")
        object.__setattr__(self, "tp_base", int(self.tp_base))
        object.__setattr__(self, "tp_spares", int(self.tp_spares))
        object.__setattr__(self, "failed", tuple(norm))

    @property
    def degraded_degree(self) -> int:
        """Degree of a replica with failures: ``tp_base - tp_spares``."""
        return self.tp_base - self.tp_spares


@dataclasses.dataclass(frozen=True)
class DimRule:
    """A model dim that the reduced axis splits, and how.

    Attributes:
      size: its logical size (e.g. ``n_heads``, ``d_ff``).
      fused: how many fused copies of it one weight holds (SwiGLU ``[gate | up]``: 2); each
        copy is split separately.
      pad: a degree that does not divide may zero-pad it (attention heads: True). Fused
        dims never pad (gtp_jax's `DimSplit` keeps a fused stored dim a pure permutation).
    """

    size: int
    fused: int = 1
    pad: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.size) or self.size < 1 or not _is_int(self.fused) \
                or self.fused < 1:
            raise UsageError(f"DimRule: size={self.size!r} and fused={self.fused!r} must be "
                             "positive ints.")

    def check(self, name: str, axis: str, degree: int, why: str) -> None:
        """Raises `UsageError` when `degree` cannot split this dim (`why`: which replicas)."""
        if (not self.pad or self.fused > 1) and self.size % degree:
            how = (f"its {self.fused} fused parts unpadded" if self.fused > 1
                   else "no padding")
            raise UsageError(
                f"{name}={self.size} cannot be split over {axis}={degree} with {how} ({why}); "
                f"choose tp_spares so that the degree divides {self.size}, or change {name}.")
        if self.size < degree:
            raise UsageError(
                f"{name}={self.size} cannot be split over {axis}={degree} ({why}): "
                f"{degree - self.size} of the {degree} ranks would hold only padding; use "
                f"fewer ranks (a larger tp_spares or smaller tp_base) or a larger {name}.")


def transformer_dims(cfg: Any, axis: str = "tp") -> dict[str, DimRule]:
    """The dims of a `gtp_jax.models.TransformerConfig` that `axis` splits.

    Under ``tp``: attention heads (zero-padded when the degree does not divide), the SwiGLU
    hidden width (``[gate | up]`` fused, must divide) and the expert hidden width. Under
    ``gtp`` every weight is padded, so no dim constrains the degree: returns ``{}``.
    """
    if axis == "gtp":
        return {}
    for name in ("n_heads", "d_ff"):
        if not _is_int(getattr(cfg, name, None)):
            raise UsageTypeError(f"transformer_dims: cfg must be a TransformerConfig (with int "
                                 f"{name}), got {type(cfg).__name__}.")
    dims = {"n_heads": DimRule(cfg.n_heads)}
    if getattr(cfg, "moe_experts", 0):
        f = cfg.moe_d_ff or cfg.d_ff
        dims["moe_d_ff"] = DimRule(f, fused=2, pad=False)
    else:
        dims["d_ff"] = DimRule(cfg.d_ff, fused=2, pad=False)
    return dims


__all__ = ["AXES", "DimRule", "NonuniformConfig", "transformer_dims"]
