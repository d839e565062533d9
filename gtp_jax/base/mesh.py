"""The device mesh: axis names, order, device groups, data placement and per-shard RNG.

Axis order is ``("dp", "ep", "gtp", "tp")``, outermost first: device ``i`` of the flat
device list sits at ``np.unravel_index(i, (dp, ep, gtp, tp))``. ``tp`` is innermost so a
tensor-parallel group is made of consecutive devices (the closest NVLink neighbours, as in
Megatron/TE group set-up); ``gtp`` comes next, so that on one 8-GPU node ``gtp x tp`` spans
the node and ``dp`` crosses nodes.

All axes are ``AxisType.Auto``. gtp_jax's collectives run inside ``jax.shard_map`` with
explicit specs; everything outside (loss, optimizer) is ordinary global-view code that XLA's
sharding propagation places. Newer ``jax.make_mesh`` defaults to ``Explicit`` axes
(sharding-in-types), which would make that global-view code raise on ambiguous shardings,
so the choice is made here rather than inherited from the JAX version.

Context parallelism (``cp``, the sequence split of `gtp_jax.parallel.context`): with
``cp > 1`` the mesh has five axes ``("dp", "ep", "gtp", "cp", "tp")`` -- ``cp`` inside
``gtp`` and outside ``tp``, so a cp ring is made of devices ``tp`` apart (consecutive
devices when ``tp == 1``: the ring's ppermutes stay between NVLink neighbours, and ``tp``
keeps the closest ones). With ``cp == 1`` (the default) there is **no** ``cp`` axis: the
mesh is the four-axis ``("dp", "ep", "gtp", "tp")`` mesh it always was, so every existing
program, checkpoint metadata (``{"dp", "ep", "gtp", "tp"}``) and ``describe_mesh`` output is
unchanged. Code that needs the cp size reads ``mesh.shape.get("cp", 1)`` (as for ``tp`` on a
user-built mesh) or `seq_axes`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.base.xla_flags import describe_xla_flags

#: Mesh axis names, outermost first (a mesh with ``cp == 1``: no ``cp`` axis).
AXES: tuple[str, ...] = ("dp", "ep", "gtp", "tp")
#: Mesh axis names with context parallelism (``cp > 1``), outermost first.
AXES_CP: tuple[str, ...] = ("dp", "ep", "gtp", "cp", "tp")
#: The context-parallel (sequence-split) axis.
CP_AXIS = "cp"  # same name as gtp_jax.base.axes.CP_AXIS
#: Axes that never split the batch: tensor parallelism and the sequence split.
_NOT_DATA = ("tp", CP_AXIS)


def make_mesh(
    dp: int = 1,
    gtp: int = 1,
    tp: int = 1,
    ep: int = 1,
    cp: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds the ``(dp, ep, gtp, tp)`` mesh -- ``(dp, ep, gtp, cp, tp)`` when ``cp > 1`` --
    over `devices` (default: all devices).

    Args:
      dp: data-parallel replicas (weights replicated across them).
      gtp: generalized-tensor-parallel degree (weights stored 1/gtp, gathered just in time).
      tp: Megatron tensor-parallel degree (innermost: consecutive devices).
      ep: expert-parallel degree.
      cp: context-parallel degree: the sequence is split over ``cp`` ranks (ring attention;
        see `gtp_jax.parallel.context`). Inside ``gtp``, outside ``tp``. Only a module that
        asks for it (``gtp_input_layout``, e.g. `gtp_jax.models.Transformer`) gets its
        sequence split; for any other module ``cp`` ranks compute the same thing, like ``tp``.
      devices: the devices to use, in order; their count must equal ``dp*ep*gtp*cp*tp``.

    Returns:
      A `jax.sharding.Mesh` with axis names ``("dp", "ep", "gtp", "tp")`` (`AXES`), or
      ``("dp", "ep", "gtp", "cp", "tp")`` (`AXES_CP`) when ``cp > 1``; Auto axis types.

    Example:
      >>> mesh = make_mesh(dp=2, gtp=4)            # doctest: +SKIP
      >>> describe_mesh(mesh)["gtp"]               # doctest: +SKIP
      [[0, 1, 2, 3], [4, 5, 6, 7]]
      >>> describe_mesh(make_mesh(dp=2, cp=4))["cp"]  # doctest: +SKIP
      [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    sizes = {"dp": dp, "ep": ep, "gtp": gtp, "cp": cp, "tp": tp}
    for name, size in sizes.items():
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
            raise UsageError(f"make_mesh: {name}={size!r} must be a positive int.")
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise UsageError("make_mesh: devices= is empty; pass the devices to use (e.g. "
                         "jax.devices()), or leave devices=None for all devices.")
    bad = [d for d in devices if not isinstance(d, jax.Device)]
    if bad:
        raise UsageTypeError(f"make_mesh: devices= must hold jax.Device objects, got "
                             f"{type(bad[0]).__name__}; pass e.g. jax.devices()[:4].")
    ids = [d.id for d in devices]
    if len(set(ids)) != len(ids):
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        raise UsageError(f"make_mesh: devices= lists device ids {repeated} more than once; "
                         "each device can hold one mesh position.")
    product = math.prod(sizes.values())
    if product != len(devices):
        what = ("dp*ep*gtp*cp*tp", f"{dp}*{ep}*{gtp}*{cp}*{tp}") if cp > 1 else \
            ("dp*ep*gtp*tp", f"{dp}*{ep}*{gtp}*{tp}")
        raise UsageError(
            f"make_mesh: {what[0]} = {what[1]} = {product} does not equal the "
            f"number of devices ({len(devices)}); choose sizes whose product is {len(devices)}, "
            "or pass devices= with that many devices."
        )
    names = AXES_CP if cp > 1 else AXES
    shape = tuple(sizes[a] for a in names)
    grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def axis_groups(mesh: Mesh, axis: str) -> list[list[int]]:
    """The device-id groups that communicate over `axis` (one list per group, sorted)."""
    _check_mesh(mesh, "axis_groups")
    check_axis(mesh, axis, "axis")
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    moved = np.moveaxis(ids, mesh.axis_names.index(axis), -1)
    groups = moved.reshape(-1, mesh.shape[axis]).tolist()
    return sorted(groups)


def describe_mesh(mesh: Mesh, *, print_fn=None) -> dict[str, list[list[int]]]:
    """Device groups of every axis, e.g. ``{"tp": [[0,1,2,3],[4,5,6,7]], "dp": [[0,4],...]}``.

    With `print_fn` (e.g. ``print``) it also writes one line per axis, and the XLA settings
    gtp_jax added that apply to the mesh's devices (none of its GPU settings on a CPU mesh).
    """
    _check_mesh(mesh, "describe_mesh")
    groups = {axis: axis_groups(mesh, axis) for axis in mesh.axis_names}
    if print_fn is not None:
        shape = ", ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
        print_fn(f"mesh ({shape}) over {mesh.devices.size} devices")
        for axis, g in groups.items():
            print_fn(f"  {axis:>4} groups: {g}")
        print_fn(f"  {describe_xla_flags(mesh.devices.flat[0].platform)}")
    return groups


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes the batch is split over: every axis except ``tp`` and ``cp`` (ranks that
    see different examples)."""
    return tuple(a for a in mesh.axis_names if a not in _NOT_DATA)


def seq_axes(mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes the sequence (dim 1 of a batch-major input) is split over under context
    parallelism: ``("cp",)`` when the mesh has a ``cp`` axis, else ``()``."""
    return tuple(a for a in mesh.axis_names if a == CP_AXIS)


def cp_size(mesh: Mesh) -> int:
    """The context-parallel degree of `mesh` (1 without a ``cp`` axis)."""
    return int(mesh.shape.get(CP_AXIS, 1))


def seq_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Placement for a batch-major, sequence-second input of rank `ndim` under context
    parallelism: dim 0 over the data axes, dim 1 over `seq_axes` (the ``cp`` axis)."""
    _check_mesh(mesh, "seq_sharding")
    if isinstance(ndim, bool) or not isinstance(ndim, (int, np.integer)) or ndim < 2:
        raise UsageError(f"seq_sharding: ndim={ndim!r} must be an int >= 2 (batch, sequence).")
    seq = seq_axes(mesh)
    return NamedSharding(mesh, P(data_axes(mesh), seq or None, *([None] * (ndim - 2))))


def data_size(mesh: Mesh | Mapping[str, int]) -> int:
    """How many ways the batch is split (product of `data_axes` sizes); also of a mesh's
    ``{axis: size}`` shape (as a checkpoint records it)."""
    shape = mesh.shape if isinstance(mesh, Mesh) else mesh
    return math.prod(int(n) for a, n in shape.items() if a not in _NOT_DATA)


def data_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Placement for a batch-major input of rank `ndim`: dim 0 split over the data axes."""
    _check_mesh(mesh, "data_sharding")
    if isinstance(ndim, bool) or not isinstance(ndim, (int, np.integer)):
        raise UsageTypeError(f"data_sharding: ndim={ndim!r} must be an int (the input's rank).")
    if ndim < 1:
        raise UsageError(f"data_sharding: ndim={ndim} must be >= 1 (dim 0 is the batch).")
    return NamedSharding(mesh, P(data_axes(mesh), *([None] * (ndim - 1))))


def shard_key(key: jax.Array, axes: Sequence[str]) -> jax.Array:
    """Folds this shard's linear index over `axes` into `key` (call inside ``shard_map``).

    Ranks that differ along any of `axes` get different keys; ranks that differ only along
    other axes keep the same key. Use the data axes for dropout on per-shard data (each GTP
    or DP rank has its own examples), and leave ``tp`` out so that tensor-parallel ranks,
    which hold pieces of the same activations, drop the same elements.

    `key` may be an array of keys (e.g. one per layer of a stack, ``[layers]``): each is
    folded with the same index, so they stay distinct from each other.
    """
    index = jnp.zeros((), jnp.uint32)
    for axis in axes:
        index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis).astype(jnp.uint32)
    if jnp.ndim(key) == 0:
        return jax.random.fold_in(key, index)
    flat = jnp.reshape(key, (-1,))  # fold_in takes one key at a time
    return jnp.reshape(jax.vmap(lambda k: jax.random.fold_in(k, index))(flat), jnp.shape(key))


def _check_mesh(mesh: object, where: str) -> None:
    if not isinstance(mesh, Mesh):
        raise UsageTypeError(f"{where}: mesh must be a jax.sharding.Mesh (build one with "
                             f"gtp_jax.make_mesh), got {type(mesh).__name__}.")


def check_axis(mesh: Mesh, axis: str, what: str) -> None:
    """Raises `UsageError` naming `what` unless `axis` is an axis of `mesh`."""
    if axis not in mesh.axis_names:
        raise UsageError(
            f"{what}={axis!r} is not an axis of the mesh (axes: {mesh.axis_names}); "
            "build the mesh with gtp_jax.make_mesh or name an existing axis."
        )
