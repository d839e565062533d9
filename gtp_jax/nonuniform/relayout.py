"""Bit-exact, in-memory re-layout of a training state between degrees and device sets.

A leaf split over the reduced axis ``A`` on stored dim ``d`` is held in gtp_jax's
`DimSplit` layout for its degree ``n`` (each fused part zero-padded to a multiple of ``n``
and rank-interleaved; optionally padded further to ``n * align`` as GTP's
``pad_for_alignment`` does). Moving it to degree ``n'`` on other devices is: stored(n) ->
logical -> stored(n'), then ``jax.device_put`` onto the new mesh with the same
`PartitionSpec`. Only pads, reshapes, transposes and gathers touch the values, so every
element is copied, never recomputed: the result is bit-identical. Leaves not split over
``A`` (replicated weights, optimizer step, RNG keys, data position) are copied to the new
devices with their spec unchanged.

`average_replicas` is the gradient side of nonuniform TP: each replica's gradients are
moved onto its core devices (a no-op for degraded replicas, a gather-then-re-split for
healthy ones: the pieces held by spares go to core devices), stacked without a copy into one
array over the uniform core mesh, and averaged there by one SPMD reduction over ``dp``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.nonuniform.planner import REPLICA_AXIS, NonuniformPlan
from gtp_jax.sharding.plan import DimSplit


@dataclasses.dataclass(frozen=True)
class LeafSplit:
    """How one state leaf is split over the reduced axis.

    Attributes:
      dim: dim of the stored array the axis splits (its `PartitionSpec` entry names the axis).
      size: logical (unpadded) size of that dim, all fused parts together.
      fused: fused parts along it (``[gate | up]``: 2), each split separately.
      align: the stored dim is padded to a multiple of ``degree * align`` (GTP
        ``pad_for_alignment``; only with ``fused == 1``).
    """

    dim: int
    size: int
    fused: int = 1
    align: int = 1

    def __post_init__(self) -> None:
        for name in ("dim", "size", "fused", "align"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or \
                    v < (0 if name == "dim" else 1):
                raise UsageError(f"LeafSplit: {name}={v!r} must be an int >= "
                                 f"{0 if name == 'dim' else 1}.")
        if self.size % self.fused:
            raise UsageError(f"LeafSplit: fused={self.fused} does not divide size={self.size}.")
        if self.fused > 1 and self.align > 1:
            raise UsageError("LeafSplit: align > 1 needs fused=1 (a fused dim is never "
                             "padded beyond its parts).")

    def _dim_split(self, degree: int) -> DimSplit:
        return DimSplit(axis="_", axis_size=int(degree), dim=self.dim, size=self.size,
                        parts=self.fused)

    def stored_size(self, degree: int) -> int:
        """Size of the stored dim at `degree`."""
        n = self._dim_split(degree).stored_size
        m = degree * self.align
        return -(-n // m) * m


def leaf_split(param_plan: Any, axis: str, pad_for_alignment: int = 1) -> LeafSplit | None:
    """The `LeafSplit` of a gtp_jax parameter plan (`ParamPlan`/`SplitPlan`) on `axis`.

    ``tp``: its `DimSplit` on ``tp`` (stacked layers shift the dim by one). ``gtp``: the
    GTP-sharded dim of a `ParamPlan`, padded like ``GTPConfig.alignment``. None: the
    parameter is not split over `axis` (optimizer moments share their parameter's split).
    """
    stacked = int(getattr(param_plan, "stacked", False))
    if axis == "gtp":
        spec = getattr(param_plan, "spec", None)
        if spec is None:
            return None
        return LeafSplit(dim=spec.shard_dim + stacked,
                         size=int(spec.logical_shape[spec.shard_dim]),
                         align=max(1, int(pad_for_alignment)))
    for sp in getattr(param_plan, "splits", ()):
        if sp.axis == axis:
            return LeafSplit(dim=sp.dim + stacked, size=sp.size, fused=sp.parts)
    return None


def to_logical(x: Any, split: LeafSplit, degree: int) -> Any:
    """Stored array at `degree` -> logical array (drops padding, undoes the interleave)."""
    ds = split._dim_split(degree)
    x = jax.lax.slice_in_dim(x, 0, ds.stored_size, axis=split.dim)
    return ds.from_stored(x, split.dim)


def from_logical(x: Any, split: LeafSplit, degree: int) -> Any:
    """Logical array -> stored array at `degree` (exact inverse of `to_logical`)."""
    x = split._dim_split(degree).to_stored(x, split.dim)
    extra = split.stored_size(degree) - x.shape[split.dim]
    if extra:
        widths = [(0, 0)] * x.ndim
        widths[split.dim] = (0, extra)
        x = jnp.pad(x, widths)
    return x


def _spec_entries(spec: P, ndim: int) -> list:
    return list(spec) + [None] * (ndim - len(spec))


def _names(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _flat(state: Any, splits: Any, where: str):
    is_split = lambda s: s is None or isinstance(s, LeafSplit)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    s_leaves, s_def = jax.tree.flatten(splits, is_leaf=is_split)
    if jax.tree.structure(state) != jax.tree.structure(splits, is_leaf=is_split):
        raise UsageError(f"{where}: splits must have the structure of the state (a LeafSplit "
                         "or None per leaf); build it with jax.tree.map over the state.")
    bad = [s for s in s_leaves if not is_split(s)]
    if bad:
        raise UsageTypeError(f"{where}: splits leaves must be LeafSplit or None, got "
                             f"{type(bad[0]).__name__}.")
    return leaves, treedef, s_leaves


def relayout(state: Any, splits: Any, src: Mesh, dst: Mesh, axis: str = "tp") -> Any:
    """Moves `state` from `src` to `dst`, re-splitting the leaves split over `axis`.

    Args:
      state: a pytree of ``jax.Array`` (params, optimizer moments, step, RNG keys, ...); an
        unsplit leaf without a `NamedSharding` (a Python or NumPy scalar, a single-device
        array) is placed replicated on `dst`.
      splits: same structure as `state`: a `LeafSplit` per leaf split over `axis`, None
        for the others.
      src, dst: meshes with the same axis names; their sizes may differ on `axis` (the old
        and new degrees) and on ``dp``; every other axis a leaf's spec uses must match.
      axis: the reduced axis.

    Returns:
      The state on `dst`, each leaf with its old `PartitionSpec`, bit-identical in logical
      content. Nothing is done before every leaf is checked; `state` is never modified.

    Raises:
      UsageError: meshes of different axes, a leaf not on `src`, a spec that disagrees with
        its split (wrong dim, shape not the stored size at the old degree), a split leaf
        whose spec also uses ``dp``.
    """
    treedef, jobs, n_old, n_new = _check(state, splits, src, dst, axis, "relayout")
    return jax.tree_util.tree_unflatten(treedef, _move(jobs, src, dst, n_old, n_new))


def _check(state: Any, splits: Any, src: Mesh, dst: Mesh, axis: str, where: str):
    """`relayout`'s checks: ``(treedef, jobs, n_old, n_new)``, a job ``(kind, x, spec,
    split)`` per leaf (kind ``"host"``: not on `src`, placed replicated; spec: the leaf's
    `PartitionSpec` on `dst`)."""
    for name, m in (("src", src), ("dst", dst)):
        if not isinstance(m, Mesh):
            raise UsageTypeError(f"{where}: {name} must be a jax.sharding.Mesh, got "
                                 f"{type(m).__name__}.")
    if src.axis_names != dst.axis_names or axis not in src.axis_names:
        raise UsageError(f"{where}: src axes {src.axis_names} and dst axes {dst.axis_names} "
                         f"must be equal and contain axis={axis!r}.")
    leaves, treedef, s_leaves = _flat(state, splits, where)
    n_old, n_new = src.shape[axis], dst.shape[axis]
    src_ids = {d.id for d in src.devices.flat}
    jobs = []
    for (path, x), split in zip(leaves, s_leaves):
        name = jax.tree_util.keystr(path)
        if not isinstance(x, jax.Array) or (split is None
                                            and not isinstance(x.sharding, NamedSharding)):
            if split is not None:
                raise UsageError(f"{where}: leaf {name} has a LeafSplit but is not a "
                                 "jax.Array; split leaves must live on src.")
            jobs.append(("host", x, P(), split))
            continue
        sh = x.sharding
        if not isinstance(sh, NamedSharding) or {d.id for d in sh.device_set} - src_ids:
            raise UsageError(f"{where}: leaf {name} is not placed on src (sharding {sh}); "
                             "pass the mesh the state lives on as src.")
        entries = _spec_entries(sh.spec, x.ndim)
        for d, e in enumerate(entries):
            for a in _names(e):
                if a != axis and src.shape[a] != dst.shape[a]:
                    raise UsageError(f"{where}: leaf {name} is split over {a!r} (dim {d}), "
                                     f"whose size differs between src ({src.shape[a]}) and "
                                     f"dst ({dst.shape[a]}); only {axis!r} may change.")
        on_axis = [d for d, e in enumerate(entries) if axis in _names(e)]
        if split is None:
            if on_axis:
                raise UsageError(f"{where}: leaf {name} is split over {axis!r} on dim "
                                 f"{on_axis[0]} but its split is None; give it a LeafSplit.")
        else:
            # XLA drops a 1-wide axis from the specs it returns (a leaf a program computed on
            # a degree-1 mesh is P() there); such a leaf is whole on that axis already.
            whole = n_old == 1 and not on_axis and split.dim < x.ndim \
                and not _names(entries[split.dim])
            if not whole and (split.dim >= x.ndim or on_axis != [split.dim]
                              or _names(entries[split.dim]) != (axis,)):
                raise UsageError(f"{where}: leaf {name} has spec {sh.spec} but LeafSplit.dim="
                                 f"{split.dim}; the spec must name {axis!r} alone on that dim.")
            if whole:  # put the axis back where the split says (trailing Nones trimmed)
                entries[split.dim] = axis
                while entries and entries[-1] is None:
                    entries.pop()
            if x.shape[split.dim] != split.stored_size(n_old):
                raise UsageError(
                    f"{where}: leaf {name} has {x.shape[split.dim]} rows on dim {split.dim}, "
                    f"not the stored size {split.stored_size(n_old)} of LeafSplit(size="
                    f"{split.size}, fused={split.fused}) at {axis}={n_old}; fix its split.")
        jobs.append(("array", x, P(*entries) if split is not None and whole else sh.spec,
                     split))
    return treedef, jobs, n_old, n_new


def _move(jobs: list, src: Mesh, dst: Mesh, n_old: int, n_new: int,
          lead: bool = False) -> list[jax.Array]:
    """The checked leaves of `relayout` (``(kind, x, spec, split)``) on `dst`, in a fixed
    handful of dispatches whatever the number of leaves.

    1. One program on `src` re-splits every leaf whose degree changes, its output gathered
       along the axis (every `src` device holds the whole dim).
    2. One `jax.device_put` for all leaves. A re-split leaf goes to `dst` still gathered
       along the axis: each `dst` device then finds its exact index on some `src` device
       and gets a device-to-device copy (a split target would have no matching source
       shard, and `device_put` would assemble the whole array on the host).
    3. One program on `dst` cuts each gathered leaf to its piece (a local slice, no
       communication). With `lead`, it covers every leaf and gives each a leading 1-wide
       dim (``P(None, *spec)``), whose per-device shards stack without a copy into a
       ``dp``-stacked array (`average_replicas`).

    Every step copies values, never computes them: bit-exact.
    """
    moves = [i for i, (kind, _, _, split) in enumerate(jobs)
             if kind == "array" and split is not None and n_old != n_new]
    staged = [x for _, x, _, _ in jobs]
    put = [NamedSharding(dst, spec) for _, _, spec, _ in jobs]
    if moves:
        gathered = []
        for i in moves:
            _, x, spec, split = jobs[i]
            entries = _spec_entries(spec, x.ndim)
            entries[split.dim] = None
            gathered.append(P(*entries))
            put[i] = NamedSharding(dst, P(*entries))
        fn = _resplit_fn(tuple(jobs[i][3] for i in moves), n_old, n_new,
                         tuple(NamedSharding(src, g) for g in gathered))
        for i, y in zip(moves, fn(tuple(jobs[i][1] for i in moves))):
            staged[i] = y
    out = jax.device_put(staged, put)
    last = range(len(jobs)) if lead else moves
    if last:
        specs = tuple(P(None, *spec) if lead else spec
                      for spec in (jobs[i][2] for i in last))
        fn = _place_fn(lead, tuple(NamedSharding(dst, s) for s in specs))
        for i, y in zip(last, fn(tuple(out[i] for i in last))):
            out[i] = y
    return out


@functools.lru_cache(maxsize=256)
def _resplit_fn(splits: tuple[LeafSplit, ...], n_old: int, n_new: int,
                outs: tuple[NamedSharding, ...]):
    """Stored(n_old) -> stored(n_new) of several leaves in one program on the source mesh,
    outputs gathered along the axis (`outs`)."""
    # Cached so that re-laying out the same state again (every step, for parameters and
    # gradients) reuses the compiled program instead of tracing a fresh function.
    def resplit(xs):
        return tuple(from_logical(to_logical(v, s, n_old), s, n_new)
                     for v, s in zip(xs, splits))

    return jax.jit(resplit, out_shardings=outs)


@functools.lru_cache(maxsize=256)
def _place_fn(lead: bool, outs: tuple[NamedSharding, ...]):
    """Leaves -> `outs` on the destination mesh (gathered -> split is a local slice), with a
    leading 1-wide dim if `lead`."""
    return jax.jit(lambda xs: tuple(x[None] if lead else x for x in xs), out_shardings=outs)


@functools.lru_cache(maxsize=256)
def _mean_fn(outs: tuple[NamedSharding, ...]):
    """Weighted means over the leading ``dp`` dim of several stacked leaves, one program."""
    return jax.jit(lambda ws, stacked: tuple(jnp.tensordot(w, s, axes=1)
                                             for w, s in zip(ws, stacked)),
                   out_shardings=outs)


def survivor_mesh(p: NonuniformPlan) -> Mesh:
    """A full-degree mesh (``dp`` size 1) of surviving devices, one per mesh position.

    Position ``(ep, gtp, tp)`` takes the device of the lowest ``dp`` replica whose device at
    that position did not fail. A state replicated over ``dp`` on the original mesh holds
    every shard on each of these devices, so `take_survivors` recovers it without reading
    a failed device.

    Raises:
      UsageError: some position failed in every replica (its shard is lost: restore the
        last checkpoint instead).
    """
    mesh, failed = p.mesh, set(p.failed_devices)
    names = mesh.axis_names
    if REPLICA_AXIS not in names:
        grid = mesh.devices[None]
    else:
        grid = np.moveaxis(mesh.devices, names.index(REPLICA_AXIS), 0)
    out = np.empty(grid.shape[1:], dtype=object)
    for idx in np.ndindex(out.shape):
        alive = [grid[(r,) + idx] for r in range(grid.shape[0])
                 if grid[(r,) + idx].id not in failed]
        if not alive:
            lost = [int(grid[(r,) + idx].id) for r in range(grid.shape[0])]
            raise UsageError(f"survivor_mesh: devices {lost} hold the same shard and all "
                             "failed; no replica has it, restore the last checkpoint.")
        out[idx] = alive[0]
    out = out[None]
    if REPLICA_AXIS in names:
        out = np.moveaxis(out, 0, names.index(REPLICA_AXIS))
    return Mesh(out, names, axis_types=mesh.axis_types)


def take_survivors(p: NonuniformPlan, tree: Any) -> tuple[Mesh, Any]:
    """A state on the original mesh (replicated over ``dp``) -> the same state on
    `survivor_mesh`, built from the survivors' shards (no copy, no failed device read).

    Returns:
      ``(survivor_mesh, tree)``; relayout from there onto the core mesh and the replicas.

    Raises:
      UsageError: a leaf not on the original mesh, or split over ``dp`` (per-replica data
        such as a data position is not recoverable from a replica: keep it on the host).
    """
    mesh = survivor_mesh(p)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    orig = {d.id for d in p.mesh.devices.flat}
    for path, x in leaves:
        name = jax.tree_util.keystr(path)
        sh = getattr(x, "sharding", None)
        if not isinstance(sh, NamedSharding) or {d.id for d in sh.device_set} != orig:
            raise UsageError(f"take_survivors: leaf {name} is not on the plan's mesh; pass "
                             "the state as it was before the failure.")
        if any(REPLICA_AXIS in _names(e) for e in _spec_entries(sh.spec, x.ndim)):
            raise UsageError(f"take_survivors: leaf {name} is split over {REPLICA_AXIS!r}; "
                             "only dp-replicated state can be recovered from a replica.")
    keep = {d.id for d in mesh.devices.flat}
    out = []
    for _, x in leaves:
        target = NamedSharding(mesh, x.sharding.spec)
        by_dev = {s.device: s.data for s in x.addressable_shards if s.device.id in keep}
        arrays = [by_dev[d] for d in target.addressable_devices_indices_map(x.shape)]
        out.append(jax.make_array_from_single_device_arrays(x.shape, target, arrays))
    return mesh, jax.tree_util.tree_unflatten(treedef, out)


def to_core(p: NonuniformPlan, replica: int, tree: Any, splits: Any) -> Any:
    """One replica's tree (on `NonuniformPlan.replica_mesh`) -> its core devices at the core
    degree (a healthy replica's spare pieces move to its core devices)."""
    return relayout(tree, splits, p.replica_mesh(replica), p.core_replica_mesh(replica),
                    p.axis)


def from_core(p: NonuniformPlan, tree: Any, splits: Any, replica: int) -> Any:
    """A tree on the core mesh (replicated over ``dp``) -> one replica's layout."""
    return relayout(tree, splits, p.core_mesh(), p.replica_mesh(replica), p.axis)


def average_replicas(p: NonuniformPlan, trees: Sequence[Any], splits: Any,
                     weights: Sequence[float] | None = None) -> Any:
    """Averages per-replica trees (gradients) over ``dp`` on the uniform core mesh.

    Args:
      p: the plan.
      trees: one tree per replica, each on its `NonuniformPlan.replica_mesh` layout.
      splits: `LeafSplit`/None per leaf (see `relayout`).
      weights: per-replica weights (e.g. examples); default equal. Normalised to sum 1.

    Returns:
      The weighted mean, on `NonuniformPlan.core_mesh` at the core degree, replicated
      over ``dp`` (each leaf with its spec).
    """
    if not isinstance(p, NonuniformPlan):
        raise UsageTypeError(f"average_replicas: p must be a NonuniformPlan, got "
                             f"{type(p).__name__}.")
    if not isinstance(trees, (list, tuple)) or len(trees) != len(p.replicas):
        raise UsageError(f"average_replicas: trees must hold one tree per replica "
                         f"({len(p.replicas)}), got {type(trees).__name__}"
                         f"{' of ' + str(len(trees)) if isinstance(trees, (list, tuple)) else ''}.")
    if weights is None:
        weights = [1.0] * len(trees)
    w = np.asarray(weights, np.float64)
    if w.shape != (len(trees),) or not np.all(w > 0):
        raise UsageError(f"average_replicas: weights={weights!r} must be {len(trees)} "
                         "positive numbers, one per replica.")
    w = w / w.sum()
    for leaf in jax.tree.leaves(trees):
        if not isinstance(leaf, jax.Array) or not jnp.issubdtype(leaf.dtype, jnp.floating):
            got = getattr(leaf, "dtype", type(leaf).__name__)
            raise UsageTypeError(f"average_replicas: every leaf must be a floating-point "
                                 f"jax.Array (gradients), got {got}.")
    # Each replica's tree onto its core devices (`to_core`), each leaf with a leading 1-wide
    # dim: the devices' shards are then the per-replica rows of one dp-stacked array.
    checked = []
    for r, tree in enumerate(trees):
        src, dst = p.replica_mesh(r), p.core_replica_mesh(r)
        checked.append((src, dst, _check(tree, splits, src, dst, p.axis, "average_replicas")))
    treedef, jobs, _, _ = checked[0][2]
    specs = [_spec_entries(spec, x.ndim) for _, x, spec, _ in jobs]
    for i, entries in enumerate(specs):
        if any(REPLICA_AXIS in _names(e) for e in entries):
            raise UsageError(f"average_replicas: leaf {i} is split over {REPLICA_AXIS!r}; "
                             "per-replica trees must be replicated over dp.")
    core = [_move(jobs, src, dst, n_old, n_new, lead=True)
            for src, dst, (_, jobs, n_old, n_new) in checked]
    mesh = p.core_mesh()
    stacked, outs, ws, by_dtype = [], [], [], {}
    for i, entries in enumerate(specs):
        first = core[0][i]
        shape = (len(core),) + first.shape[1:]
        target = NamedSharding(mesh, P(REPLICA_AXIS, *entries))
        by_dev = {s.device: s.data for leaves in core for s in leaves[i].addressable_shards}
        arrays = [by_dev[d] for d in target.addressable_devices_indices_map(shape)]
        stacked.append(jax.make_array_from_single_device_arrays(shape, target, arrays))
        outs.append(NamedSharding(mesh, P(*entries)))
        if first.dtype not in by_dtype:
            by_dtype[first.dtype] = w.astype(first.dtype)
        ws.append(by_dtype[first.dtype])
    ws = jax.device_put(ws, NamedSharding(mesh, P()))  # one transfer, no implicit one
    out = _mean_fn(tuple(outs))(tuple(ws), tuple(stacked))
    return jax.tree.unflatten(treedef, list(out))


__all__ = ["LeafSplit", "average_replicas", "from_core", "from_logical", "leaf_split",
           "relayout",
           "survivor_mesh", "take_survivors", "to_core", "to_logical"]
