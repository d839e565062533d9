"""Optimizer state in host memory (`GTPConfig.offload_optimizer`).

The state keeps its mesh and partition spec; only its memory kind changes to
``"pinned_host"``. Inside the jitted step, `streamed_update` brings the moments to the
device one *unit* at a time (a group of layers of the layer-stacked weights, or one other
weight), updates that unit and copies its new moments back, so only a few units' moments
are in device memory at once. The update runs on the device with the on-device run's
arithmetic: training is bit-identical.

Streaming needs the optimizer split into a whole-tree part (global-norm clipping: it reads
every gradient) and a leaf-wise part (AdamW: each output element depends only on the same
element of the gradient, moments and parameter, and on scalar state such as the step count):
`streamable_chain` builds that split (``make_optimizer`` uses it). Other optimizers fall back
to `to_device` / `to_host` of whole leaves, which keeps the state in host memory between
steps but brings all of it to the device for the update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from gtp_jax.base.errors import UsageError

#: The memory kind offloaded state lives in (page-locked host memory: the device copies
#: from and to it directly).
HOST_MEMORY_KIND = "pinned_host"


def host_memory_supported(device: jax.Device | None = None) -> bool:
    """Whether `device` (default: the first device) can address `HOST_MEMORY_KIND`."""
    device = jax.devices()[0] if device is None else device
    return any(m.kind == HOST_MEMORY_KIND for m in device.addressable_memories())


def place_on_host(tree: Any) -> Any:
    """`tree` with every array placed in host memory, same mesh and partition spec (outside
    ``jit``; arrays must carry a ``NamedSharding``; other leaves are returned unchanged)."""

    def place(x: Any) -> Any:
        if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding):
            return jax.device_put(x, x.sharding.with_memory_kind(HOST_MEMORY_KIND))
        return x

    return jax.tree.map(place, tree)


def init_on_host(init: Callable[[Any], Any], params: Any) -> Any:
    """``init(params)`` (an optimizer's state) computed by one jitted program whose outputs
    are placed in host memory: no whole state is ever built in device memory first.

    Shardings of the outputs: a subtree with the structure of `params` (AdamW's moments) gets
    the parameters' shardings leaf for leaf; every other leaf (step counts, injected
    hyperparameters) is replicated on the parameters' mesh. All in `HOST_MEMORY_KIND`.

    Args:
      init: e.g. ``optax.GradientTransformation.init``.
      params: a tree of arrays with ``NamedSharding`` shardings on one mesh (in device
        memory, e.g. a `gtp_jax.shard`-ed model's parameters).

    Raises:
      UsageError: `params` holds no array with a ``NamedSharding``.
    """
    p_leaves, p_def = jax.tree.flatten(params)
    meshes = {x.sharding.mesh for x in p_leaves
              if isinstance(getattr(x, "sharding", None), NamedSharding)}
    if len(meshes) != 1:
        raise UsageError("init_on_host: params must be arrays sharded with a NamedSharding on "
                         f"one mesh (found {len(meshes)} meshes); shard the model first "
                         "(gtp_jax.shard).")
    (mesh,) = meshes
    host = lambda s: s.with_memory_kind(HOST_MEMORY_KIND)  # noqa: E731
    replicated = host(NamedSharding(mesh, jax.sharding.PartitionSpec()))
    p_shardings = p_def.unflatten([host(x.sharding) for x in p_leaves])

    def param_shaped(x: Any) -> bool:
        return x is not None and jax.tree.structure(x) == p_def

    abstract = jax.eval_shape(init, params)
    shardings = jax.tree.map(
        lambda x: p_shardings if param_shaped(x) else jax.tree.map(lambda _: replicated, x),
        abstract, is_leaf=param_shaped)
    return jax.jit(init, out_shardings=shardings)(params)


def host_shapes(tree: Any) -> Any:
    """`tree` of ``jax.ShapeDtypeStruct`` with ``NamedSharding`` shardings, moved to host
    memory (the abstract counterpart of `place_on_host`, for ahead-of-time lowering)."""

    def place(x: Any) -> Any:
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.ShapeDtypeStruct) and isinstance(sharding, NamedSharding):
            return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=sharding.with_memory_kind(HOST_MEMORY_KIND))
        return x

    return jax.tree.map(place, tree)


def to_device(tree: Any) -> Any:
    """Inside ``jit``: `tree`'s arrays copied to device memory (same sharding)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def to_host(tree: Any) -> Any:
    """Inside ``jit``: `tree`'s arrays copied to host memory (same sharding)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), tree)


class StreamableChain(NamedTuple):
    """``optax.chain(global_part, leafwise_part)`` (its `init` and `update`) that also names
    its two parts, so an offloaded step can stream the leaf-wise part per layer group.

    Attributes:
      init, update: those of ``optax.chain(global_part, leafwise_part)``.
      global_part: a transformation that needs the whole gradient tree (e.g.
        ``optax.clip_by_global_norm``); applied once, on the device, to the full trees.
      leafwise_part: a transformation whose every output element depends only on the same
        element of its inputs and on scalar state (AdamW, schedules, weight decay); applied
        per unit (a slice of layers of the stacked weights, or other whole weights).
    """

    init: Callable[..., Any]
    update: Callable[..., Any]
    global_part: optax.GradientTransformation
    leafwise_part: optax.GradientTransformation


def streamable_chain(global_part: optax.GradientTransformation,
                     leafwise_part: optax.GradientTransformation) -> StreamableChain:
    """``optax.chain(global_part, leafwise_part)`` that offloaded steps can stream per layer
    group (see `StreamableChain` for what each part may do). Same state, same updates."""
    chained = optax.chain(global_part, leafwise_part)
    return StreamableChain(chained.init, chained.update, global_part, leafwise_part)


def stream_units(params: Any, stacked: Any, group_layers: int | None
                 ) -> list[list[tuple[int, Any]]]:
    """The units `streamed_update` moves to the device one at a time, in order.

    Args:
      params: the parameter tree (arrays or ``jax.ShapeDtypeStruct``).
      stacked: bools with the structure of `params`: whether a leaf's leading dim is a
        layer stack (``gtp_stacked`` metadata).
      group_layers: layers per unit of the stacked leaves (>= 1; the last unit holds the
        remainder when the layer count is not a multiple), or None: every leaf is its own
        unit, whole (no slicing: each moment crosses once each way, in one transfer).

    Returns:
      A list of units, each a list of ``(leaf index, (start, stop) | None)``: leaf index in
      ``jax.tree.leaves(params)`` order; ``(start, stop)`` the layer slice of a stacked leaf,
      ``None`` a whole (not stacked) leaf. Every other leaf is its own unit, first; then the
      layer groups, each holding that slice of every stacked leaf.
    """
    if group_layers is None:
        return [[(i, None)] for i in range(len(jax.tree.leaves(params)))]
    if isinstance(group_layers, bool) or not isinstance(group_layers, int) or group_layers < 1:
        raise UsageError(f"offload group_layers={group_layers!r} must be an int >= 1 "
                         "(layers whose optimizer state is updated together).")
    leaves, treedef = jax.tree.flatten(params)
    flags = treedef.flatten_up_to(stacked)
    units: list[list[tuple[int, Any]]] = [[(i, None)] for i, f in enumerate(flags)
                                          if not (f and len(leaves[i].shape) >= 1)]
    layered = [i for i, f in enumerate(flags) if f and len(leaves[i].shape) >= 1]
    depth = max((leaves[i].shape[0] for i in layered), default=0)
    for start in range(0, depth, group_layers):
        unit = [(i, (start, min(start + group_layers, leaves[i].shape[0])))
                for i in layered if leaves[i].shape[0] > start]
        units.append(unit)
    return units


def streamed_update(tx: StreamableChain, grads: Any, opt_state: Any, params: Any,
                    stacked: Any, *, group_layers: int | None) -> tuple[Any, Any]:
    """Inside ``jit``: one step of `tx` with its state in host memory, streamed per unit.

    Returns what ``optax.apply_updates(params, tx.update(grads, opt_state, params)[0])`` and
    the new state would be, bit for bit, with the new state in host memory.

    How: ``tx.global_part`` runs on the full gradient tree (its state copied whole). Then
    for each unit of `stream_units` in turn: that unit's slice of every param-shaped state
    leaf (AdamW's two moments) is copied host -> device, ``tx.leafwise_part`` updates the
    unit's slice (the other leaves are ``None`` in the trees it sees), and the new moments
    are copied device -> host into their place in the output (a dynamic-update-slice into a
    host buffer), the new parameter slice into the parameter (in place). Double-buffered:
    the copy-in of unit k waits (``jax.lax.optimization_barrier``) for the update of unit
    k-2, so unit k+1's copy can run while unit k updates, and at most about three units'
    moments are in device memory at once; the first two units' copies wait only for their
    own gradients.

    Args:
      tx: the optimizer's transformation (`streamable_chain`).
      grads, params: trees of device arrays (equal structure); params may be sharded.
      opt_state: ``tx``'s state, its arrays in host memory.
      stacked: bools with the structure of `params` (see `stream_units`).
      group_layers: layers per unit, or None: one unit per leaf, whole (`stream_units`).
    """
    global_state, leaf_state = opt_state
    updates, new_global = tx.global_part.update(grads, to_device(global_state), params)
    new_global = to_host(new_global)

    p_cur, p_def = jax.tree.flatten(params)
    n_leaves = len(p_cur)
    g_leaves = p_def.flatten_up_to(grads)
    u_leaves = p_def.flatten_up_to(updates)

    def param_shaped(x: Any) -> bool:
        return x is not None and jax.tree.structure(x) == p_def

    parts, s_def = jax.tree.flatten(leaf_state, is_leaf=param_shaped)
    moments = {j: p_def.flatten_up_to(x) for j, x in enumerate(parts) if param_shaped(x)}
    others = {j: to_device(x) for j, x in enumerate(parts) if not param_shaped(x)}
    new_moments: dict[int, list[Any]] = {j: [None] * n_leaves for j in moments}
    new_others: dict[int, Any] = {}

    def cut(x: Any, span: Any) -> Any:
        return x if span is None else x[span[0]:span[1]]

    results: list[list[jax.Array]] = []
    for k, unit in enumerate(stream_units(params, stacked, group_layers)):
        # Copy-in gate: unit k-2's update (double buffering), or the unit's own gradients.
        gate = results[k - 2] if k >= 2 else [g_leaves[i] for i, _ in unit]
        host_in = {(j, i): moments[j][i] for j in moments for i, _ in unit}
        host_in, _ = jax.lax.optimization_barrier((host_in, gate))
        spans = dict(unit)
        dev_in = {key: jax.device_put(cut(x, spans[key[1]]), jax.memory.Space.Device)
                  for key, x in host_in.items()}
        g_tree = _masked(p_def, {i: cut(u_leaves[i], span) for i, span in unit})
        p_tree = _masked(p_def, {i: cut(p_cur[i], span) for i, span in unit})
        s_tree = s_def.unflatten([
            _masked(p_def, {i: dev_in[(j, i)] for i, _ in unit}) if j in moments else others[j]
            for j in range(len(parts))])
        out_u, out_s = tx.leafwise_part.update(g_tree, s_tree, p_tree)
        new_p = p_def.flatten_up_to(optax.apply_updates(p_tree, out_u))
        out_parts = s_def.flatten_up_to(out_s)

        produced = []
        for i, span in unit:
            p_cur[i] = (new_p[i] if span is None else
                        jax.lax.dynamic_update_slice_in_dim(p_cur[i], new_p[i], span[0], 0))
            produced.append(new_p[i])
            for j in moments:
                y = p_def.flatten_up_to(out_parts[j])[i]
                produced.append(y)
                y_host = jax.device_put(y, jax.memory.Space.Host)
                if span is None:
                    new_moments[j][i] = y_host
                    continue
                buf = new_moments[j][i]
                if buf is None:  # a host buffer the slices are written into (the
                    # gradient lends shape and sharding; its values are not read)
                    buf = jax.device_put(jnp.zeros_like(g_leaves[i], dtype=moments[j][i].dtype),
                                         jax.memory.Space.Host)
                new_moments[j][i] = jax.lax.dynamic_update_slice_in_dim(buf, y_host,
                                                                        span[0], 0)
        if k == 0:  # scalar state (step counts): every unit computes the same new value
            new_others = {j: out_parts[j] for j in others}
        results.append(produced)

    new_leaf_state = s_def.unflatten([
        p_def.unflatten(new_moments[j]) if j in moments else to_host(new_others[j])
        for j in range(len(parts))])
    return p_def.unflatten(p_cur), (new_global, new_leaf_state)


def _masked(treedef: Any, leaves: dict[int, Any]) -> Any:
    """A tree of `treedef` with ``leaves[i]`` at leaf i and ``None`` (optax: no parameter)
    elsewhere."""
    return treedef.unflatten([leaves.get(i) for i in range(treedef.num_leaves)])
