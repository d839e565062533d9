"""Which devices of each replica compute, at which degree, holding which weight rows.

Vocabulary (mesh axes ``(dp, ep, gtp, tp)``, reduced axis ``A`` = ``tp`` or ``gtp``):

* a *group* is one line of ``tp_base`` devices along ``A`` (fixed coordinates on the other
  axes); a *replica* is one ``dp`` index: all its groups run one SPMD program.
* each group has ``tp_spares`` *spare* positions and ``tp_base - tp_spares`` *core*
  positions (`choose_spares`). A replica with a failed device is *degraded*: every group of
  it runs on its core devices only, at degree ``tp_base - tp_spares``. A *healthy* replica
  runs on all ``tp_base`` devices of each group.
* the *core mesh* has the shape of the original mesh with ``A`` shrunk to the core degree,
  and holds each group's core devices in rank order. It is the one uniform layout on which
  the replicas' gradients are averaged and the optimizer steps.

The spares rule (the seed's "uniform spares with parity"): every group drops exactly
``tp_spares`` devices, its failed ones first, so all degraded groups share one degree; the
rest are taken from the default spare positions (the last ``tp_spares``), so core positions
agree across groups wherever the failures allow it (groups without failures all use the
default). A group whose failures exceed ``tp_spares`` cannot be covered (`plan` raises).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from jax.sharding import Mesh

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.nonuniform.config import DimRule, NonuniformConfig

#: Mesh axis that indexes replicas.
REPLICA_AXIS = "dp"


def choose_spares(failed: Mapping[Any, Iterable[int]], tp_base: int,
                  tp_spares: int | None = None) -> tuple[int, dict[Any, tuple[int, ...]]]:
    """Spare positions of each group: its failed positions, then default spares.

    Args:
      failed: group key -> failed positions along the axis (in ``[0, tp_base)``).
      tp_base: group size.
      tp_spares: spares per group; None: the fewest that cover every group (the largest
        number of failures in one group).

    Returns:
      ``(tp_spares, {key: sorted spare positions})``, exactly `tp_spares` per group.

    Raises:
      UsageError: a position is out of range, or a group has more failures than spares.
    """
    failed = {k: sorted(set(int(p) for p in v)) for k, v in failed.items()}
    for k, v in failed.items():
        if v and not 0 <= v[0] <= v[-1] < tp_base:
            raise UsageError(f"choose_spares: group {k!r} has failed positions {v} outside "
                             f"[0, tp_base={tp_base}).")
    worst = max((len(v) for v in failed.values()), default=0)
    if tp_spares is None:
        tp_spares = worst
    if worst > tp_spares:
        k = next(k for k, v in failed.items() if len(v) == worst)
        raise UsageError(f"choose_spares: group {k!r} has {worst} failed devices, more than "
                         f"tp_spares={tp_spares}; raise tp_spares to {worst}.")
    default = list(range(tp_base - tp_spares, tp_base))
    out = {}
    for k, v in failed.items():
        fill = [p for p in reversed(default) if p not in v][:tp_spares - len(v)]
        out[k] = tuple(sorted(v + fill))
    return tp_spares, out


def dim_map(size: int, degree: int, fused: int = 1) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Logical index ranges of a split dim that each rank holds (gtp_jax `DimSplit` layout).

    The dim holds `fused` equal parts; each part is zero-padded to a multiple of `degree`
    and split in `degree` contiguous chunks; rank ``r`` stores chunk ``r`` of every part.

    Returns:
      per rank, the half-open logical ranges ``(start, stop)`` it stores, in stored order;
      the rest of its ``local`` rows are padding (``local = fused * ceil(size/fused/degree)``).
    """
    part = size // fused
    lp = -(-part // degree)
    return tuple(
        tuple((p * part + lo, p * part + hi) for p in range(fused)
              for lo, hi in [(min(r * lp, part), min((r + 1) * lp, part))] if hi > lo)
        for r in range(degree))


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """One group of ``tp_base`` devices along the reduced axis.

    Attributes:
      coords: its coordinates on the other mesh axes, ``((axis, index), ...)``.
      devices: device ids by position along the axis.
      failed: failed positions.
      spares: spare positions (failed ones included).
      active: positions that compute, in rank order (all for a healthy replica, the core
        positions for a degraded one).
    """

    coords: tuple[tuple[str, int], ...]
    devices: tuple[int, ...]
    failed: tuple[int, ...]
    spares: tuple[int, ...]
    active: tuple[int, ...]

    @property
    def core(self) -> tuple[int, ...]:
        return tuple(p for p in range(len(self.devices)) if p not in self.spares)

    @property
    def core_devices(self) -> tuple[int, ...]:
        return tuple(self.devices[p] for p in self.core)

    @property
    def active_devices(self) -> tuple[int, ...]:
        return tuple(self.devices[p] for p in self.active)


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """One data-parallel replica: its degree and its groups.

    Attributes:
      replica: its ``dp`` index.
      healthy: no device of it failed (runs at ``tp_base``).
      degree: its degree on the reduced axis.
      groups: its groups, in mesh order of the other axes.
    """

    replica: int
    healthy: bool
    degree: int
    groups: tuple[GroupLayout, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class NonuniformPlan:
    """The layouts of every replica and the uniform core mesh (from `plan`).

    Attributes:
      config: the `NonuniformConfig` (``failed`` as given).
      mesh: the original (uniform, ``tp_base``) mesh.
      replicas: one `ReplicaLayout` per ``dp`` index.
      dims: the model dims checked (name -> `DimRule`), shown by `describe`.
    """

    config: NonuniformConfig
    mesh: Mesh
    replicas: tuple[ReplicaLayout, ...]
    dims: Mapping[str, DimRule]

    @property
    def axis(self) -> str:
        return self.config.axis

    @property
    def core_degree(self) -> int:
        return self.config.degraded_degree

    @property
    def uniform(self) -> bool:
        """No replica is degraded: the original mesh and program still apply."""
        return all(r.healthy for r in self.replicas)

    @property
    def failed_devices(self) -> tuple[int, ...]:
        return tuple(sorted(g.devices[p] for r in self.replicas for g in r.groups
                            for p in g.failed))

    def _grid(self, replica: int | None, which: str) -> Mesh:
        """Mesh of the (core or active) devices of one replica (dp size 1) or all."""
        names = self.mesh.axis_names
        ax = names.index(self.axis)
        by_id = {d.id: d for d in self.mesh.devices.flat}
        reps = self.replicas if replica is None else (self.replicas[replica],)
        lines = [[by_id[i] for i in (g.core_devices if which == "core" else g.active_devices)]
                 for r in reps for g in r.groups]
        n = len(lines[0])
        shape = [self.mesh.shape[a] for a in names if a != self.axis]
        if replica is not None and REPLICA_AXIS in names:
            shape[[a for a in names if a != self.axis].index(REPLICA_AXIS)] = 1
        grid = np.empty((len(lines), n), dtype=object)
        for i, line in enumerate(lines):
            grid[i, :] = line
        grid = np.moveaxis(grid.reshape(*shape, n), -1, ax)
        return Mesh(grid, names, axis_types=self.mesh.axis_types)

    def replica_mesh(self, replica: int) -> Mesh:
        """Mesh one replica's program runs on (dp size 1, the axis at its degree)."""
        self._check_replica(replica)
        return self._grid(replica, "active")

    def core_replica_mesh(self, replica: int) -> Mesh:
        """One replica's core devices (dp size 1, the axis at the core degree)."""
        self._check_replica(replica)
        return self._grid(replica, "core")

    def core_mesh(self) -> Mesh:
        """The uniform mesh of every replica's core devices (the axis at the core degree)."""
        return self._grid(None, "core")

    def device_ranges(self, replica: int, rule: DimRule) -> dict[int, tuple[tuple[int, int],
                                                                         ...]]:
        """Device id -> logical ranges of a dim that replica's device holds (every group)."""
        self._check_replica(replica)
        rep = self.replicas[replica]
        ranks = dim_map(rule.size * rule.fused, rep.degree, rule.fused)
        return {g.devices[p]: ranks[r] for g in rep.groups for r, p in enumerate(g.active)}

    def _check_replica(self, replica: int) -> None:
        if isinstance(replica, bool) or not isinstance(replica, (int, np.integer)) \
                or not 0 <= replica < len(self.replicas):
            raise UsageError(f"replica={replica!r} must be a dp index in [0, "
                             f"{len(self.replicas)}).")


def _coords_of(mesh: Mesh) -> dict[int, dict[str, int]]:
    out = {}
    for idx in np.ndindex(mesh.devices.shape):
        out[mesh.devices[idx].id] = dict(zip(mesh.axis_names, (int(i) for i in idx)))
    return out


def plan(mesh: Mesh, config: NonuniformConfig,
         dims: Mapping[str, DimRule] | None = None) -> NonuniformPlan:
    """Validates `config` against `mesh` and the model `dims`, and lays out every replica.

    Args:
      mesh: the uniform mesh (``gtp_jax.make_mesh``); its size on ``config.axis`` must be
        ``config.tp_base``.
      config: the `NonuniformConfig`.
      dims: dims the axis splits (`transformer_dims`); checked at ``tp_base`` and, when
        ``tp_spares > 0``, at the reduced degree.

    Raises:
      UsageError: a wrong mesh or axis size, an unknown axis or out-of-range coordinate in
        ``failed``, an unknown device id, a replica or group with every device failed, more
        failures in a group than ``tp_spares``, a dim the degree cannot split.
    """
    if not isinstance(mesh, Mesh):
        raise UsageTypeError(f"plan: mesh must be a jax.sharding.Mesh (gtp_jax.make_mesh), "
                             f"got {type(mesh).__name__}.")
    if not isinstance(config, NonuniformConfig):
        raise UsageTypeError(f"plan: config must be a NonuniformConfig, got "
                             f"{type(config).__name__}.")
    dims = {} if dims is None else dims
    if not isinstance(dims, Mapping) or not all(isinstance(v, DimRule) for v in dims.values()):
        raise UsageTypeError("plan: dims must map dim names to DimRule (see "
                             "gtp_jax.nonuniform.transformer_dims).")
    axis = config.axis
    if axis not in mesh.axis_names:
        raise UsageError(f"NonuniformConfig.axis={axis!r} is not an axis of the mesh "
                         f"{mesh.axis_names}; use one of them.")
    if mesh.shape[axis] != config.tp_base:
        raise UsageError(f"NonuniformConfig.tp_base={config.tp_base} differs from the mesh's "
                         f"{axis}={mesh.shape[axis]}; set tp_base to {mesh.shape[axis]}.")
    for name, rule in dims.items():
        rule.check(name, axis, config.tp_base, "healthy replicas")
        if config.tp_spares:
            rule.check(name, axis, config.degraded_degree,
                       f"degraded replicas: tp_base={config.tp_base} - "
                       f"tp_spares={config.tp_spares}")
    coords = _coords_of(mesh)
    at = {tuple(sorted(c.items())): i for i, c in coords.items()}
    failed_ids = []
    for item in config.failed:
        if isinstance(item, int):
            if item not in coords:
                raise UsageError(f"NonuniformConfig.failed: device id {item} is not in the "
                                 f"mesh (ids {sorted(coords)}); name a mesh device.")
            failed_ids.append(item)
            continue
        c = dict(item)
        for a, v in c.items():
            if a not in mesh.axis_names:
                raise UsageError(f"NonuniformConfig.failed: coordinate {c} names axis {a!r}, "
                                 f"not an axis of the mesh {mesh.axis_names}.")
            if v >= mesh.shape[a]:
                raise UsageError(f"NonuniformConfig.failed: coordinate {c} has {a}={v}, out "
                                 f"of range for mesh {a}={mesh.shape[a]}; use 0..."
                                 f"{mesh.shape[a] - 1}.")
        full = {a: c.get(a, 0) for a in mesh.axis_names}
        failed_ids.append(at[tuple(sorted(full.items()))])
    if len(set(failed_ids)) != len(failed_ids):
        raise UsageError("NonuniformConfig.failed names one device twice (by coordinate and "
                         "id, or with default-0 axes); list each failed device once.")
    failed_ids = set(failed_ids)

    others = [a for a in mesh.axis_names if a != axis]
    ax = mesh.axis_names.index(axis)
    grid = np.moveaxis(np.vectorize(lambda d: d.id)(mesh.devices), ax, -1)
    groups: dict[tuple, tuple[int, ...]] = {}
    for idx in np.ndindex(grid.shape[:-1]):
        groups[tuple(zip(others, (int(i) for i in idx)))] = tuple(int(i) for i in grid[idx])
    failed_pos = {k: [p for p, d in enumerate(devs) if d in failed_ids]
                  for k, devs in groups.items()}
    n_rep = mesh.shape.get(REPLICA_AXIS, 1)

    def rep_of(key) -> int:
        return dict(key).get(REPLICA_AXIS, 0)

    for r in range(n_rep):
        keys = [k for k in groups if rep_of(k) == r]
        if all(len(failed_pos[k]) == config.tp_base for k in keys):
            raise UsageError(f"NonuniformConfig.failed: every device of replica "
                             f"{REPLICA_AXIS}={r} failed; restart with that replica dropped "
                             f"({REPLICA_AXIS}={n_rep - 1}) instead.")
    for k, v in failed_pos.items():
        if len(v) == config.tp_base:
            raise UsageError(f"NonuniformConfig.failed: every device of the {axis} group at "
                             f"{dict(k)} failed; no degree can run it, drop its replica.")
        if len(v) > config.tp_spares:
            raise UsageError(
                f"NonuniformConfig.failed: the {axis} group at {dict(k)} lost {len(v)} "
                f"devices (positions {v}), more than tp_spares={config.tp_spares} absorbs; "
                f"raise tp_spares to {len(v)} (degree {config.tp_base - len(v)}).")
    _, spares = choose_spares(failed_pos, config.tp_base, config.tp_spares)
    replicas = []
    for r in range(n_rep):
        keys = [k for k in groups if rep_of(k) == r]
        healthy = not any(failed_pos[k] for k in keys)
        out = []
        for k in keys:
            core = tuple(p for p in range(config.tp_base) if p not in spares[k])
            out.append(GroupLayout(coords=k, devices=groups[k],
                                   failed=tuple(failed_pos[k]), spares=spares[k],
                                   active=tuple(range(config.tp_base)) if healthy else core))
        replicas.append(ReplicaLayout(replica=r, healthy=healthy,
                                      degree=config.tp_base if healthy else
                                      config.degraded_degree, groups=tuple(out)))
    return NonuniformPlan(config=config, mesh=mesh, replicas=tuple(replicas), dims=dict(dims))


def _ranges(rs: tuple[tuple[int, int], ...]) -> str:
    return "+".join(f"{a}:{b}" for a, b in rs) or "-"


def describe(p: NonuniformPlan) -> str:
    """Human-readable per-replica layouts and the row/column map of every dim."""
    if not isinstance(p, NonuniformPlan):
        raise UsageTypeError(f"describe: expected a NonuniformPlan (from plan), got "
                             f"{type(p).__name__}.")
    c = p.config
    lines = [f"nonuniform {p.axis}: tp_base={c.tp_base} tp_spares={c.tp_spares} "
             f"(degraded degree {c.degraded_degree}); failed devices: "
             f"{list(p.failed_devices) or 'none'}"]
    for r in p.replicas:
        lines.append(f"replica {REPLICA_AXIS}={r.replica}: "
                     f"{'healthy' if r.healthy else 'DEGRADED'}, {p.axis}={r.degree}")
        for g in r.groups:
            where = ",".join(f"{a}={i}" for a, i in g.coords if a != REPLICA_AXIS) or "-"
            lines.append(f"  group {where}: devices {list(g.devices)} failed "
                         f"{[g.devices[i] for i in g.failed]} spares "
                         f"{[g.devices[i] for i in g.spares]} core {list(g.core_devices)} "
                         f"active {list(g.active_devices)}")
        for name, rule in p.dims.items():
            m = p.device_ranges(r.replica, rule)
            g = r.groups[0]
            lines.append(f"  {name}={rule.size}" + (f" x{rule.fused} fused" if rule.fused > 1
                                                     else "")
                         + ": " + "  ".join(f"dev{d}[{_ranges(m[d])}]"
                                            for d in g.active_devices))
    lines.append(f"core mesh: {dict(p.core_mesh().shape)}, devices "
                 f"{np.vectorize(lambda d: d.id)(p.core_mesh().devices).reshape(-1).tolist()}")
    return "\n".join(lines)


__all__ = ["GroupLayout", "NonuniformPlan", "ReplicaLayout", "choose_spares", "describe",
           "dim_map", "plan"]
