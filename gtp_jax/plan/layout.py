"""What the planner chooses: a `Layout` (mesh sizes, remat, layer loop, gather format,
optimizer offload), the search space (`PlanSpace`) and the layouts valid for a run."""

from __future__ import annotations

import dataclasses
import itertools
import shlex
from typing import Any

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.train.config import TrainConfig, model_config

#: Mesh axes the planner factorizes the device count over (ep only for MoE models).
MESH_AXES = ("dp", "gtp", "tp", "cp", "ep")
#: Layer loops: Python-unrolled, scanned, scanned with double-buffered prefetch.
LOOPS = ("unrolled", "scanned", "prefetch")
REMATS = ("none", "dots", "full")
GATHER_FORMATS = (None, "fp8", "mxfp8", "nvfp4")


@dataclasses.dataclass(frozen=True, order=True)
class Layout:
    """One way to lay out a training run on the devices.

    Attributes:
      dp, gtp, tp, cp, ep: mesh sizes (their product is the device count).
      remat: `TrainConfig.remat` ("none", "dots", "full").
      loop: "unrolled", "scanned" or "prefetch" (scanned with `TrainConfig.prefetch`).
      gather_format: `TrainConfig.gather_format` (None: gathers in the gather dtype).
      offload: `TrainConfig.offload_optimizer`.
      offload_exclude: `TrainConfig.offload_exclude` (with `offload`: the parameters whose
        optimizer state stays on the device).
      master: `TrainConfig.offload_master_weights` (with `offload`: the float32 parameters
        in host memory too, bfloat16 ones on the device).
    """

    dp: int = 1
    gtp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    remat: str = "none"
    loop: str = "unrolled"
    gather_format: str | None = None
    offload: bool = False
    offload_exclude: tuple[str, ...] = ()
    master: bool = False

    def __post_init__(self) -> None:
        for axis in MESH_AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageTypeError(f"Layout.{axis}={value!r} must be an int >= 1.")
        for name, allowed in (("remat", REMATS), ("loop", LOOPS),
                              ("gather_format", GATHER_FORMATS), ("offload", (False, True)),
                              ("master", (False, True))):
            if getattr(self, name) not in allowed:
                raise UsageError(f"Layout.{name}={getattr(self, name)!r}: use one of "
                                 f"{list(allowed)}.")
        if not isinstance(self.offload_exclude, (tuple, list)) or not all(
                isinstance(p, str) for p in self.offload_exclude):
            raise UsageTypeError(f"Layout.offload_exclude={self.offload_exclude!r} must be a "
                                 "tuple of regular expressions.")
        object.__setattr__(self, "offload_exclude", tuple(self.offload_exclude))
        if self.offload_exclude and not self.offload:
            raise UsageError("Layout.offload_exclude needs offload=True.")
        if self.master and not self.offload:
            raise UsageError("Layout.master needs offload=True.")

    @property
    def devices(self) -> int:
        return self.dp * self.gtp * self.tp * self.cp * self.ep

    @property
    def sort_key(self) -> tuple[Any, ...]:
        """A total order (None gather format first) for deterministic tie-breaks."""
        return (self.dp, self.gtp, self.tp, self.cp, self.ep, self.remat, self.loop,
                self.gather_format or "", self.offload, self.offload_exclude, self.master)

    def apply(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` laid out this way (its model, batch, dtypes and schedule unchanged)."""
        return dataclasses.replace(
            cfg, dp=self.dp, gtp=self.gtp, tp=self.tp, cp=self.cp, ep=self.ep,
            remat=self.remat, unroll_layers=self.loop == "unrolled",
            prefetch=self.loop == "prefetch", gather_format=self.gather_format,
            offload_optimizer=self.offload, offload_exclude=self.offload_exclude,
            offload_master_weights=self.master)

    def describe(self) -> str:
        """``dp2 gtp4 tp1 cp1 remat=dots unrolled`` (+ gather format, offload)."""
        mesh = " ".join(f"{a}{getattr(self, a)}" for a in MESH_AXES
                        if a != "ep" or self.ep > 1)
        extra = (f" {self.gather_format}" if self.gather_format else "") + (
            " offload" if self.offload else "") + (
            f" but {len(self.offload_exclude)} weights" if self.offload_exclude else "") + (
            " +master" if self.master else "")
        return f"{mesh} remat={self.remat} {self.loop}{extra}"

    def flags(self) -> str:
        """The `python -m gtp_jax train` flags of this layout."""
        out = [f"--{a} {getattr(self, a)}" for a in MESH_AXES if a != "ep" or self.ep > 1]
        out.append(f"--remat {self.remat}")
        out.append("--unroll-layers" if self.loop == "unrolled" else "--no-unroll-layers")
        if self.loop == "prefetch":
            out.append("--prefetch")
        if self.gather_format:
            out.append(f"--gather-format {self.gather_format}")
        if self.offload:
            out.append("--offload-optimizer")
        if self.offload_exclude:
            out.append("--offload-exclude " + " ".join(shlex.quote(p)
                                                      for p in self.offload_exclude))
        if self.master:
            out.append("--offload-master-weights")
        return " ".join(out)


@dataclasses.dataclass(frozen=True)
class PlanSpace:
    """The layouts the planner considers.

    Attributes:
      mesh: fixed mesh sizes (axis -> size, e.g. ``{"tp": 1}``); the axes left out range
        over every factorization of the device count.
      remat, loops, gather_formats, offload: the choices tried. Low-precision gather
        formats change the numerics (lossy weight gathers): not tried unless listed.
      master: master-weight offload choices tried with offloaded layouts (`Layout.master`;
        bfloat16 parameters change the numerics: not tried unless listed).
    """

    mesh: tuple[tuple[str, int], ...] = ()
    remat: tuple[str, ...] = REMATS
    loops: tuple[str, ...] = LOOPS
    gather_formats: tuple[str | None, ...] = (None,)
    offload: tuple[bool, ...] = (False,)
    master: tuple[bool, ...] = (False,)

    def __post_init__(self) -> None:
        mesh = self.mesh.items() if isinstance(self.mesh, dict) else self.mesh
        mesh = tuple(sorted((str(a), v) for a, v in mesh))
        for axis, size in mesh:
            if axis not in MESH_AXES:
                raise UsageError(f"PlanSpace.mesh names {axis!r}; use axes of {MESH_AXES}.")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise UsageError(f"PlanSpace.mesh[{axis!r}]={size!r} must be an int >= 1.")
        object.__setattr__(self, "mesh", mesh)
        for name, allowed in (("remat", REMATS), ("loops", LOOPS),
                              ("gather_formats", GATHER_FORMATS), ("offload", (False, True)),
                              ("master", (False, True))):
            values = tuple(getattr(self, name))
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise UsageError(f"PlanSpace.{name}={values!r}: use a non-empty tuple of "
                                 f"{list(allowed)}.")
            object.__setattr__(self, name, values)


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0
            for rest in _factorizations(n // d, parts - 1)]


def enumerate_layouts(base: TrainConfig, devices: int, space: PlanSpace) -> tuple[
        list[Layout], int]:
    """The layouts of `space` on `devices` that are valid for `base` (batch divisible by
    ``dp * ep * gtp``, tp dividing the heads and MLP width, ep the experts, the sequence
    splittable over cp), in `Layout.sort_key` order, and how many were skipped as invalid."""
    model_cfg = model_config(base)
    fixed = dict(space.mesh)
    axes = [a for a in MESH_AXES if a not in fixed and (a != "ep" or model_cfg.moe_experts)]
    rest = devices
    for size in fixed.values():
        if rest % size:
            return [], 0
        rest //= size
    out, skipped = [], 0
    for sizes in _factorizations(rest, len(axes)):
        mesh = {"ep": 1, **fixed, **dict(zip(axes, sizes))}
        reason = _invalid(base, model_cfg, mesh)
        # Over a 1-wide gtp axis no gather format applies (the trainer gathers nothing), so
        # every format there is the same program as None: one candidate, not several.
        formats = (space.gather_formats if mesh["gtp"] > 1
                   else tuple(dict.fromkeys(None for _ in space.gather_formats)))
        # Nor does prefetch (`gtp_jax.sharding.scan.scan_layers`): there it is the scanned
        # loop's program, planned once as "scanned" when that is a choice.
        loops = (space.loops if mesh["gtp"] > 1 or "scanned" not in space.loops
                 else tuple(loop for loop in space.loops if loop != "prefetch"))
        combos = [c for c in itertools.product(space.remat, loops, formats,
                                               space.offload, space.master)
                  if c[3] or not c[4]]  # master weights only with offload
        if reason is not None:
            skipped += len(combos)
            continue
        out += [Layout(**mesh, remat=r, loop=loop, gather_format=g, offload=o, master=m)
                for r, loop, g, o, m in combos]
    return sorted(out, key=lambda layout: layout.sort_key), skipped


def _invalid(base: TrainConfig, model_cfg: Any, mesh: dict[str, int]) -> str | None:
    """Why the mesh cannot run `base` (None: it can)."""
    shards = mesh["dp"] * mesh["ep"] * mesh["gtp"]
    if base.batch_size % shards:
        return "batch"
    if mesh["tp"] > 1 and (model_cfg.n_heads % mesh["tp"] or model_cfg.d_ff % mesh["tp"]):
        return "tp"
    if mesh["ep"] > 1 and model_cfg.moe_experts % mesh["ep"]:
        return "ep"
    if mesh["cp"] > 1 and (model_cfg.moe_experts or base.seq_len % (2 * mesh["cp"])):
        return "cp"
    return None
