"""Optimizer state in host memory (`GTPConfig.offload_optimizer`).

The state keeps its mesh and partition spec; only its memory kind changes to
``"pinned_host"``. Inside the jitted step, `streamed_update` brings the moments to the
device one *unit* at a time (a group of layers of the layer-stacked weights, or one other
weight), updates that unit and copies its new moments back, so only a few units' moments
are in device memory at once. A stacked state's copies are partial (dynamic slices of the
host buffers, written back in place); the trainer streams a grouped one instead
(`group_moments`: one host array per layer group, `HostGroups`), whose copies are whole-array
DMA transfers, compiled with `STREAMING_COMPILER_OPTIONS` so that many are in flight at once.
`init_streamed_on_host` builds the state in host memory the same way, one unit at a time.
The update runs on the device with the on-device run's arithmetic: training is
bit-identical.

Partial offload: the moments of *resident* parameters (`GTPConfig.offload_exclude`) stay
in device memory and are updated there with no copy; only the others cross, so the
transfers shrink by the resident share (what spare device memory buys back).

Master weights (`GTPConfig.offload_master_weights`): the float32 parameters move to host
memory too, as a parameter-shaped part of the streamed state (`with_master_weights`), and
the device keeps them (and their gradients) in bfloat16. Each unit's update runs the
optimizer on its float32 master slice, as it would on float32 parameters (weight decay
included), and writes the new master back to the host and ``bfloat16(new master)`` into
the device parameter.

Streaming needs the optimizer split into a whole-tree part (global-norm clipping: it reads
every gradient) and a leaf-wise part (AdamW: each output element depends only on the same
element of the gradient, moments and parameter, and on scalar state such as the step count):
`streamable_chain` builds that split (``make_optimizer`` uses it). Other optimizers fall back
to `to_device` / `to_host` of whole leaves, which keeps the state in host memory between
steps but brings all of it to the device for the update.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from gtp_jax.base.errors import UsageError
from gtp_jax.base.xla_flags import pinned_pool_problem

#: The memory kind offloaded state lives in (page-locked host memory: the device copies
#: from and to it directly).
HOST_MEMORY_KIND = "pinned_host"

#: Layers of the layer-stacked weights per streamed unit by default: one layer's moments
#: (of every stacked weight) in device memory at a time, a small fraction of the state.
DEFAULT_GROUP_LAYERS = 1


#: XLA options for a program that streams an offloaded state (`streaming_compiler_options`).
#: XLA's GPU scheduler keeps at most ``xla_gpu_experimental_parallel_async_compute_limit``
#: asynchronous copies (and other async computations) in flight, 2 by default, and puts
#: them on its extra streams in turn, so two copies in flight often share one stream and
#: the two directions seldom overlap. With 16 the offloaded step of the 1b preset took
#: 257.3 ms instead of 340.7, and llama3-8b's 1856.8 instead of 2514.2 at 8 (2 gave the
#: 1b 340.7; 64 gave 321.8 and a 1.7x larger peak for llama3-8b):
#: docs/results/2026-11-27_1xH200/README.md.
STREAMING_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_gpu_experimental_parallel_async_compute_limit": 16,
}


@functools.cache
def streaming_compiler_options() -> dict[str, Any]:
    """`STREAMING_COMPILER_OPTIONS` for ``jax.jit(..., compiler_options=...)`` of a program
    that streams an offloaded optimizer state: on GPUs, the options this XLA knows
    (`supported_compiler_options`); ``{}`` on other backends, which have no such scheduler."""
    if jax.default_backend() != "gpu":
        return {}
    return supported_compiler_options(STREAMING_COMPILER_OPTIONS)


def supported_compiler_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` if this XLA compiles an empty program with them, else ``{}``: an XLA that
    lacks one (a newer or older release) compiles the program as before."""
    try:
        jax.jit(lambda: jnp.zeros(()), compiler_options=options).lower().compile()
    except Exception:  # noqa: BLE001 - XLA refuses an option it does not know
        return {}
    return dict(options)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostGroups:
    """A layer-stacked optimizer-state leaf (an AdamW moment or master weight of a
    ``gtp_stacked`` parameter) kept in host memory as one array per layer group.

    Each group's copy to the device and back is then a whole-array transfer, which XLA makes
    a DMA transfer by the copy engines, beside compute; a slice of one stacked host buffer
    is instead copied by a kernel on the compute stream (docs/offload.md, "Grouped while
    training").
    `gtp_jax.train.TrainStep` keeps an offloaded state grouped while it trains and gives
    the optimizer object the stacked arrays back on ``sync()`` (`join_groups`), so
    checkpoints and every reader see the stacked layout.

    Attributes:
      groups: arrays ``[layers_g, *rest]`` (or ``jax.ShapeDtypeStruct``), the layer groups in
        order (`layer_spans`), each with the stacked leaf's sharding.
    """

    groups: tuple[Any, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The stacked leaf's shape ``[layers, *rest]``."""
        return (sum(g.shape[0] for g in self.groups), *self.groups[0].shape[1:])

    @property
    def dtype(self) -> Any:
        """The stacked leaf's dtype."""
        return self.groups[0].dtype


def layer_spans(layers: int, group_layers: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` layer spans of a stacked leaf of `layers` layers streamed
    `group_layers` at a time (`stream_units`): the last one holds the remainder."""
    return [(start, min(start + group_layers, layers))
            for start in range(0, layers, group_layers)]


def group_moments(opt_state: Any, params: Any, stacked: Any, group_layers: int,
                  resident: Any = None) -> Any:
    """`opt_state` (a `StreamableChain`'s: ``(global state, leaf-wise state)``) with every
    param-shaped leaf of the leaf-wise state that belongs to a stacked, offloaded parameter
    (AdamW's moments, the master weights) split into `HostGroups` of `layer_spans`. Outside
    ``jit``; arrays in host memory stay there (one program per leaf: the device holds one
    group at a time, the host one leaf twice while it is split) and each split array is
    deleted, as if donated; ``jax.ShapeDtypeStruct`` leaves give the abstract `HostGroups`
    (for lowering ahead of time).

    Args:
      opt_state: the state, its moments in `HOST_MEMORY_KIND`.
      params, stacked, resident: as for `streamed_update`.
      group_layers: layers per group, as the step's `streamed_update` will be called with.
    """
    global_state, leaf_state = opt_state
    p_leaves, p_def = jax.tree.flatten(params)
    flags = p_def.flatten_up_to(stacked)
    keep = _flags(p_def, resident)

    param_shaped = _param_shaped(p_def)

    def split(part: Any) -> Any:
        if not param_shaped(part):
            return part
        out = []
        for x, p, f, k in zip(p_def.flatten_up_to(part), p_leaves, flags, keep):
            grouped = (f and not k and len(p.shape) >= 1 and not isinstance(x, HostGroups)
                       and tuple(x.shape) == tuple(p.shape))
            out.append(_split(x, tuple(layer_spans(p.shape[0], group_layers)))
                       if grouped else x)
        return p_def.unflatten(out)

    parts, s_def = jax.tree.flatten(leaf_state, is_leaf=param_shaped)
    return global_state, s_def.unflatten([split(part) for part in parts])


def join_groups(tree: Any) -> Any:
    """`tree` with every `HostGroups` replaced by its stacked array, in host memory with the
    groups' sharding (outside ``jit``; the groups are deleted, as if donated: the device
    holds one group at a time, the host the leaf twice while it is joined). The inverse of
    `group_moments`; ``jax.ShapeDtypeStruct`` groups give the abstract stacked leaf."""
    def join(x: Any) -> Any:
        return _join(x) if isinstance(x, HostGroups) else x

    return jax.tree.map(join, tree, is_leaf=lambda x: isinstance(x, HostGroups))


def _split(x: Any, spans: tuple[tuple[int, int], ...]) -> HostGroups:
    """The layer `spans` of the stacked host array `x` as `HostGroups`; `x` is deleted."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return HostGroups(tuple(jax.ShapeDtypeStruct((stop - start, *x.shape[1:]), x.dtype,
                                                     sharding=x.sharding)
                                for start, stop in spans))
    groups = HostGroups(jax.block_until_ready(_split_program(spans, x.sharding)(x)))
    # Donated by hand (the groups cannot reuse its buffer), once split: the host holds the
    # leaf twice only while it is split, not the whole state.
    x.delete()
    return groups


@functools.lru_cache(maxsize=64)
def _split_program(spans: tuple[tuple[int, int], ...], sharding: Any) -> Callable[..., Any]:
    def split(x: jax.Array) -> tuple[jax.Array, ...]:
        # Each group through the device, one at a time: a slice of a host buffer is read by
        # the device, and only whole arrays are written back by a DMA transfer.
        return tuple(jax.device_put(jax.device_put(x[start:stop], jax.memory.Space.Device),
                                    jax.memory.Space.Host) for start, stop in spans)

    return jax.jit(split, out_shardings=tuple(sharding for _ in spans))


def _join(groups: HostGroups) -> Any:
    """`groups` as one stacked array in host memory; the groups are deleted."""
    first = groups.groups[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(groups.shape, groups.dtype, sharding=first.sharding)
    buf = _host_zeros(jax.ShapeDtypeStruct(groups.shape, groups.dtype), first.sharding)
    start = 0
    for g in groups.groups:
        buf = jax.block_until_ready(_join_program(first.sharding)(buf, g, jnp.int32(start)))
        start += g.shape[0]
        g.delete()  # donated by hand, as in `_split`, once written
    return buf


@functools.lru_cache(maxsize=64)
def _join_program(sharding: Any) -> Callable[..., Any]:
    def write(buf: jax.Array, group: jax.Array, start: jax.Array) -> jax.Array:
        y = jax.device_put(jax.device_put(group, jax.memory.Space.Device),
                           jax.memory.Space.Host)
        return jax.lax.dynamic_update_slice_in_dim(buf, y, start, 0,
                                                   allow_negative_indices=False)

    return jax.jit(write, out_shardings=sharding, donate_argnums=0)


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


def host_bytes_per_device(abstract: Any, shardings: Any) -> int:
    """The most bytes any one device's shards of `abstract` (``jax.ShapeDtypeStruct``
    leaves) take in `HOST_MEMORY_KIND` when placed with `shardings` (a tree of
    ``NamedSharding`` matching it; leaves placed in device memory count nothing)."""
    per_device: dict[Any, int] = {}
    for x, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        if sharding.memory_kind != HOST_MEMORY_KIND:
            continue
        nbytes = int(np.prod(sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
        for device in sharding.device_set:
            per_device[device] = per_device.get(device, 0) + nbytes
    return max(per_device.values(), default=0)


def check_pinned_pool(abstract: Any, shardings: Any, *, platform: str | None = None,
                      pool_bytes: int | None = None) -> None:
    """Refuses, before anything is allocated, an optimizer state for GPUs whose pinned host
    bytes per device (`host_bytes_per_device`) exceed XLA's pinned host pool: XLA would
    fail only part way through building it. Other platforms have no such pool.

    Args:
      abstract, shardings: the state's ``jax.ShapeDtypeStruct`` leaves and their
        ``NamedSharding`` placements (trees of one structure).
      platform: the devices' platform; None: the shardings' devices'.
      pool_bytes: the pool per device; None: `gtp_jax.base.xla_flags.pinned_pool_bytes`.

    Raises:
      UsageError: over the pool; names ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` and the value
        that fits.
    """
    leaves = jax.tree.leaves(shardings)
    if platform is None and leaves:
        platform = next(iter(leaves[0].device_set)).platform
    if platform != "gpu":
        return
    problem = pinned_pool_problem(host_bytes_per_device(abstract, shardings), pool_bytes)
    if problem:
        raise UsageError(f"{problem}, or shard the parameters over more devices.")


def init_on_host(init: Callable[[Any], Any], params: Any, resident: Any = None) -> Any:
    """``init(params)`` (an optimizer's state) computed by one jitted program whose outputs
    are placed in host memory: no whole state is ever built in device memory first.

    Shardings of the outputs: a subtree with the structure of `params` (AdamW's moments) gets
    the parameters' shardings leaf for leaf; every other leaf (step counts, injected
    hyperparameters) is replicated on the parameters' mesh. All in `HOST_MEMORY_KIND`, but
    the moments of `resident` parameters, which stay in device memory.

    Args:
      init: e.g. ``optax.GradientTransformation.init``.
      params: a tree of arrays with ``NamedSharding`` shardings on one mesh (in device
        memory, e.g. a `gtp_jax.shard`-ed model's parameters).
      resident: bools with the structure of `params` (None: none): parameters whose
        state stays in device memory (partial offload).

    Raises:
      UsageError: `params` holds no array with a ``NamedSharding``; the state does not fit
        the pinned host pool (`check_pinned_pool`).
    """
    p_leaves, p_def = jax.tree.flatten(params)
    replicated = _host_replicated(p_leaves)
    keep = _flags(p_def, resident)
    p_shardings = p_def.unflatten([x.sharding if k else
                                   x.sharding.with_memory_kind(HOST_MEMORY_KIND)
                                   for x, k in zip(p_leaves, keep)])

    param_shaped = _param_shaped(p_def)

    def placed(x: Any) -> Any:
        if not param_shaped(x):
            return jax.tree.map(lambda _: replicated, x)
        # One value per parameter: the parameter's sharding where it has the parameter's
        # shape (moments), replicated where not (a flag or a factored moment per parameter).
        return p_def.unflatten([
            sharding if tuple(y.shape) == tuple(p.shape) else replicated
            for y, p, sharding in zip(p_def.flatten_up_to(x), p_leaves,
                                      p_def.flatten_up_to(p_shardings))])

    abstract = jax.eval_shape(init, params)
    shardings = jax.tree.map(placed, abstract, is_leaf=param_shaped)
    check_pinned_pool(abstract, shardings)
    return jax.jit(init, out_shardings=shardings)(params)


def _host_replicated(p_leaves: list[Any]) -> NamedSharding:
    """Replicated on the one mesh of `p_leaves`' ``NamedSharding`` shardings, in host memory.

    Raises:
      UsageError: not exactly one mesh among them.
    """
    meshes = {x.sharding.mesh for x in p_leaves
              if isinstance(getattr(x, "sharding", None), NamedSharding)}
    if len(meshes) != 1:
        raise UsageError("init_on_host: params must be arrays sharded with a NamedSharding on "
                         f"one mesh (found {len(meshes)} meshes); shard the model first "
                         "(gtp_jax.shard).")
    (mesh,) = meshes
    return NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=HOST_MEMORY_KIND)


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
      master: the leaf-wise part keeps float32 master weights (`with_master_weights`): its
        state is a `MasterState`, and a parameter's new value is its new master cast to
        the parameter's dtype, not ``params + updates``.
    """

    init: Callable[..., Any]
    update: Callable[..., Any]
    global_part: optax.GradientTransformation
    leafwise_part: optax.GradientTransformation
    master: bool = False


class MasterState(NamedTuple):
    """The leaf-wise state of a `with_master_weights` optimizer.

    Attributes:
      master: float32 copies of the parameters (the tree of the parameters): the values
        the optimizer updates; the model holds them rounded to bfloat16.
      inner: the wrapped leaf-wise transformation's state, updated on `master`.
    """

    master: Any
    inner: Any


#: The dtype a `with_master_weights` model keeps its parameters in on the device.
MASTER_DEVICE_DTYPE = jnp.bfloat16


@functools.cache
def with_master_weights(tx: StreamableChain) -> StreamableChain:
    """`tx` keeping float32 master weights in its (offloaded) state: its leaf-wise part
    runs on ``MasterState.master`` instead of the model's parameters, which hold the master
    rounded to `MASTER_DEVICE_DTYPE`.

    Only an offloaded training step applies it (`streamed_update`, which sets each
    parameter to its new master cast to the parameter's dtype); the returned chain's
    ``update`` raises, since ``params + updates`` in bfloat16 would not be the rounded
    master. Cached: the same `tx` gives the same object (a step program's cache key).

    Raises:
      UsageError: `tx` keeps master weights already.
    """
    if tx.master:
        raise UsageError("with_master_weights: the optimizer keeps master weights already.")
    inner = tx.leafwise_part

    def init(params: Any) -> MasterState:
        master = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
        return MasterState(master, inner.init(master))

    def update(updates: Any, state: MasterState, params: Any = None) -> tuple[Any, Any]:
        del params  # the master is what is optimized (weight decay included)
        u, new_inner = inner.update(updates, state.inner, state.master)
        return u, MasterState(optax.apply_updates(state.master, u), new_inner)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UsageError(
            "optimizer.update with offloaded master weights "
            "(GTPConfig.offload_master_weights): the parameters are set from the float32 "
            "master in host memory by the training step; train with "
            "gtp_jax.train.TrainStep, or drop offload_master_weights for a loop of one's own.")

    leafwise = optax.GradientTransformation(init, update)
    chained = optax.chain(tx.global_part, leafwise)
    return StreamableChain(chained.init, refuse, tx.global_part, leafwise, master=True)


def streamable_chain(global_part: optax.GradientTransformation,
                     leafwise_part: optax.GradientTransformation) -> StreamableChain:
    """``optax.chain(global_part, leafwise_part)`` that offloaded steps can stream per layer
    group (see `StreamableChain` for what each part may do). Same state, same updates."""
    chained = optax.chain(global_part, leafwise_part)
    return StreamableChain(chained.init, chained.update, global_part, leafwise_part)


def stream_units(params: Any, stacked: Any, group_layers: int,
                 resident: Any = None) -> list[list[tuple[int, Any]]]:
    """The units `streamed_update` moves to the device one at a time, in order.

    Args:
      params: the parameter tree (arrays or ``jax.ShapeDtypeStruct``).
      stacked: bools with the structure of `params`: whether a leaf's leading dim is a
        layer stack (``gtp_stacked`` metadata; that dim must not be sharded).
      group_layers: layers per unit of the stacked leaves (>= 1; the last unit holds the
        remainder when the layer count is not a multiple).
      resident: bools with the structure of `params` (None: none): leaves whose state
        stays in device memory; they belong to no unit.

    Returns:
      A list of units, each a list of ``(leaf index, (start, stop) | None)``: leaf index in
      ``jax.tree.leaves(params)`` order; ``(start, stop)`` the layer slice of a stacked leaf,
      ``None`` a whole (not stacked) leaf. Every other leaf is its own unit, first; then the
      layer groups, each holding that slice of every stacked leaf.

    Raises:
      UsageError: `group_layers` is not an int >= 1.
    """
    if isinstance(group_layers, bool) or not isinstance(group_layers, int) or group_layers < 1:
        raise UsageError(f"offload_group_layers={group_layers!r} must be an int >= 1 "
                         "(layers whose optimizer state is updated together).")
    leaves, treedef = jax.tree.flatten(params)
    flags = treedef.flatten_up_to(stacked)
    keep = _flags(treedef, resident)
    units: list[list[tuple[int, Any]]] = [[(i, None)] for i, f in enumerate(flags)
                                          if not (f and len(leaves[i].shape) >= 1)
                                          and not keep[i]]
    layered = [i for i, f in enumerate(flags) if f and len(leaves[i].shape) >= 1
               and not keep[i]]
    depth = max((leaves[i].shape[0] for i in layered), default=0)
    for start in range(0, depth, group_layers):
        unit = [(i, (start, min(start + group_layers, leaves[i].shape[0])))
                for i in layered if leaves[i].shape[0] > start]
        units.append(unit)
    return units


def streamed_update(tx: StreamableChain, grads: Any, opt_state: Any, params: Any,
                    stacked: Any, *, group_layers: int = 1,
                    resident: Any = None) -> tuple[Any, Any]:
    """Inside ``jit``: one step of `tx` with its state in host memory, streamed per unit.

    Returns what ``optax.apply_updates(params, tx.update(grads, opt_state, params)[0])`` and
    the new state would be, bit for bit, with the new state in host memory.

    How: ``tx.global_part`` runs on the full gradient tree (its state copied whole). Then
    for each unit of `stream_units` in turn: that unit's slice of every param-shaped state
    leaf (AdamW's two moments) is copied host -> device, ``tx.leafwise_part`` updates the
    unit's slice (the other leaves are ``None`` in the trees it sees), the new parameter
    slice is written into the parameter (in place, on the device) and the new moments are
    copied device -> host.

    The copies of a layer group are partial: a ``dynamic_slice`` of the host buffer moved to
    the device, and a move to the host written with a ``dynamic_update_slice`` into the same
    (donated) host buffer, so no whole stacked moment ever crosses and no second host buffer
    is allocated. The start index passes through an optimization barrier, so XLA cannot
    fold the dynamic slice into a static one (XLA's host offloading turns dynamic slices of
    host buffers into partial DMA copies; a static slice may move the whole buffer first).
    Whole (not stacked) leaves cross whole, once each way.

    Order (double buffering, ``jax.lax.optimization_barrier``): the copy-in of unit k waits
    for the update of unit k-2 (the first two wait only for their own gradients), so unit
    k's moments come in while unit k-1 updates; unit k-1's write-back into a stacked host
    buffer waits for unit k's copy-in from that buffer (every read of a buffer version
    precedes the write that replaces it, so XLA can write in place), and unit k+1 reads the
    buffer after that write. About four units' moments are in device memory at once: those
    being updated, its new ones, the next unit's coming in and the last unit's going out.

    The `resident` parameters' moments are in device memory already: they are updated
    together, in place of a unit, with no copy.

    Args:
      tx: the optimizer's transformation (`streamable_chain`).
      grads, params: trees of device arrays (equal structure); params may be sharded, but
        not along a stacked leaf's layer dim.
      opt_state: ``tx``'s state, its arrays in host memory.
      stacked: bools with the structure of `params` (see `stream_units`).
      group_layers: layers per unit (`stream_units`).
      resident: bools with the structure of `params` (None: none): parameters whose
        moments in `opt_state` are in device memory (they stay there).
    """
    global_state, leaf_state = opt_state
    updates, new_global = tx.global_part.update(grads, to_device(global_state), params)
    new_global = to_host(new_global)

    p_cur, p_def = jax.tree.flatten(params)
    g_leaves = p_def.flatten_up_to(grads)
    u_leaves = p_def.flatten_up_to(updates)

    param_shaped = _param_shaped(p_def)

    parts, s_def = jax.tree.flatten(leaf_state, is_leaf=param_shaped)
    _check_streamable({(j, i): x for j, part in enumerate(parts) if param_shaped(part)
                       for i, x in enumerate(p_def.flatten_up_to(part))}, p_cur)
    keep = _flags(p_def, resident)
    # The current version of each moment buffer, by (state part, leaf): in host memory,
    # or in device memory for a resident leaf.
    host = {(j, i): x for j, part in enumerate(parts) if param_shaped(part)
            for i, x in enumerate(p_def.flatten_up_to(part))}
    moment_parts = sorted({j for j, _ in host})
    others = {j: to_device(x) for j, x in enumerate(parts) if not param_shaped(x)}
    new_others: dict[int, Any] | None = None

    def cut(x: Any, span: Any) -> Any:
        return x if span is None else x[span[0]:span[1]]

    def leafwise(unit_leaves: list[int], g: dict, p: dict, moments: dict
                 ) -> tuple[list[Any], dict, list[Any]]:
        """``tx.leafwise_part`` on the unit's leaves (the others ``None``): the new
        parameters (leaf order), new moments by key, and the new state's parts."""
        s_tree = s_def.unflatten([
            _masked(p_def, {i: moments[(j, i)] for i in unit_leaves}) if j in moment_parts
            else others[j] for j in range(len(parts))])
        p_tree = _masked(p_def, p)
        out_u, out_s = tx.leafwise_part.update(_masked(p_def, g), s_tree, p_tree)
        if tx.master:  # the parameter is its master, rounded
            new_p = [None if m is None else m.astype(p_leaf.dtype) for m, p_leaf in
                     zip(p_def.flatten_up_to(out_s.master), p_cur)]
        else:
            new_p = p_def.flatten_up_to(optax.apply_updates(p_tree, out_u))
        out_parts = s_def.flatten_up_to(out_s)
        return new_p, {(j, i): p_def.flatten_up_to(out_parts[j])[i] for j in moment_parts
                       for i in unit_leaves}, out_parts

    on_device = [i for i, k in enumerate(keep) if k]
    if on_device:  # no copies: updated where they are
        new_p, new_moments, out_parts = leafwise(
            on_device, {i: u_leaves[i] for i in on_device}, {i: p_cur[i] for i in on_device},
            host)
        for i in on_device:
            p_cur[i] = new_p[i]
        host.update(new_moments)
        new_others = {j: out_parts[j] for j in others}

    results: list[list[jax.Array]] = []
    pending: tuple[list[tuple[int, Any]], jax.Array, dict] | None = None
    for k, unit in enumerate(stream_units(params, stacked, group_layers, resident)):
        # Copy-in gate: unit k-2's update (double buffering), or the unit's own gradients.
        gate = results[k - 2] if k >= 2 else [g_leaves[i] for i, _ in unit]
        span0 = unit[0][1]
        start = jnp.int32(0 if span0 is None else span0[0])
        keys = [(j, i) for j in moment_parts for i, _ in unit]
        spans = dict(unit)
        # A grouped leaf's group is a whole host array: its copies are DMA transfers, and
        # its new value a new array (nothing to order against other reads).
        group_of = {key: _group_index(host[key], spans[key[1]]) for key in keys
                    if isinstance(host[key], HostGroups)}
        plain = [key for key in keys if key not in group_of]
        (bufs, groups, start), _ = jax.lax.optimization_barrier(
            (([host[key] for key in plain],
              [host[key].groups[g] for key, g in group_of.items()], start), gate))
        host.update(zip(plain, bufs))
        dev_in = {key: jax.device_put(group, jax.memory.Space.Device)
                  for key, group in zip(group_of, groups)}
        for key in plain:
            span = spans[key[1]]
            piece = host[key] if span is None else jax.lax.dynamic_slice_in_dim(
                host[key], start, span[1] - span[0], 0, allow_negative_indices=False)
            dev_in[key] = jax.device_put(piece, jax.memory.Space.Device)
        if pending is not None:
            _write_back(host, *pending, after=list(dev_in.values()))
        new_p, new_moments, out_parts = leafwise(
            [i for i, _ in unit], {i: cut(u_leaves[i], span) for i, span in unit},
            {i: cut(p_cur[i], span) for i, span in unit}, dev_in)

        for i, span in unit:
            p_cur[i] = (new_p[i] if span is None else
                        jax.lax.dynamic_update_slice_in_dim(p_cur[i], new_p[i], span[0], 0))
        for key, g in group_of.items():
            host[key] = _replace_group(host[key], g,
                                       jax.device_put(new_moments[key], jax.memory.Space.Host))
        if span0 is None:  # whole leaves: a new host array each, nothing to order
            host.update({key: jax.device_put(y, jax.memory.Space.Host)
                         for key, y in new_moments.items()})
            pending = None
        else:  # written after the next unit's copy-in from the same buffers
            stacked_moments = {key: y for key, y in new_moments.items() if key not in group_of}
            pending = (unit, start, stacked_moments) if stacked_moments else None
        if new_others is None:  # scalar state (step counts): every unit computes the same
            new_others = {j: out_parts[j] for j in others}
        results.append([new_p[i] for i, _ in unit] + list(new_moments.values()))
    if pending is not None:
        _write_back(host, *pending, after=[])

    new_leaf_state = s_def.unflatten([
        p_def.unflatten([host[(j, i)] for i in range(len(p_cur))]) if j in moment_parts
        else to_host((new_others or {})[j]) for j in range(len(parts))])
    return p_def.unflatten(p_cur), (new_global, new_leaf_state)


def _param_shaped(p_def: Any) -> Callable[[Any], bool]:
    """Whether a state subtree has the parameters' structure `p_def` (one value per
    parameter, e.g. an AdamW moment; a `HostGroups` counts as one value)."""
    return lambda x: x is not None and _structure(x) == p_def


def _structure(tree: Any) -> Any:
    """`tree`'s structure with each `HostGroups` one leaf (it stands for one array)."""
    return jax.tree.structure(tree, is_leaf=lambda x: isinstance(x, HostGroups))


def _group_index(groups: HostGroups, span: tuple[int, int] | None) -> int:
    """Which of `groups` holds exactly the layers of `span`.

    Raises:
      UsageError: none does (the state was grouped for another number of layers per
        group than the step streams).
    """
    start = 0
    for g, group in enumerate(groups.groups):
        if span is not None and (start, start + group.shape[0]) == tuple(span):
            return g
        start += group.shape[0]
    raise UsageError(
        f"an offloaded optimizer-state leaf is grouped as "
        f"{[int(x.shape[0]) for x in groups.groups]} layers, but the step streams layers "
        f"{span}: group it with the offload_group_layers the step uses "
        "(gtp_jax.sharding.offload.group_moments), or join it first (join_groups).")


def _replace_group(groups: HostGroups, g: int, value: Any) -> HostGroups:
    """`groups` with group `g` replaced by `value`."""
    return HostGroups(groups.groups[:g] + (value,) + groups.groups[g + 1:])


def _check_streamable(per_param: dict[tuple[int, int], Any], p_leaves: list[Any]) -> None:
    """Refuses leaf-wise optimizer state with one value per parameter that is not of that
    parameter's shape (``per_param``: ``(state part, leaf index) -> array``): a unit's layer
    slice of it would not be the unit's state.

    Raises:
      UsageError: such a value, named with its shape and the parameter's.
    """
    for (j, i), x in per_param.items():
        if tuple(x.shape) != tuple(p_leaves[i].shape):
            raise UsageError(
                f"the optimizer's leaf-wise state (part {j}) holds a {tuple(x.shape)} value "
                f"for the {tuple(p_leaves[i].shape)} parameter {i}: streaming per layer group "
                "(offload_optimizer with a streamable_chain) needs per-parameter state of the "
                "parameter's shape, as AdamW's moments. Put that transformation in the "
                "whole-tree part of streamable_chain, use a plain optax chain (its state is "
                "copied whole), or keep the state on the device (offload_optimizer=False).")


def _write_back(host: dict[tuple[int, int], Any], unit: list[tuple[int, Any]],
                start: jax.Array, moments: dict[tuple[int, int], jax.Array], *,
                after: list[jax.Array]) -> None:
    """Copies a layer group's new `moments` (device) into their host buffers ``host[key]``
    at layer `start`, in place, once `after` (the next unit's copies from those buffers)
    exist; updates `host` to the written versions."""
    keys = list(moments)
    (bufs, start), _ = jax.lax.optimization_barrier((([host[k] for k in keys], start), after))
    for key, buf in zip(keys, bufs):
        y = jax.device_put(moments[key], jax.memory.Space.Host)
        host[key] = jax.lax.dynamic_update_slice_in_dim(buf, y, start, 0,
                                                        allow_negative_indices=False)


def init_streamed_on_host(tx: StreamableChain, params: Any, stacked: Any, *,
                          group_layers: int = DEFAULT_GROUP_LAYERS,
                          resident: Any = None) -> Any:
    """``tx.init(params)`` built in host memory one unit at a time: the device never holds
    more than one unit's state (`stream_units`: one not-stacked leaf, or `group_layers`
    layers of every stacked leaf), and no host buffer is copied whole.

    How: ``tx.global_part``'s state is built by `init_on_host` (clipping has none). Each
    param-shaped leaf of ``tx.leafwise_part``'s state (AdamW's moments) of a stacked
    parameter starts as a host buffer filled on the host (zeros: nothing crosses); then per
    layer group, one jitted program slices the group's parameters, runs
    ``tx.leafwise_part.init`` on them (``None`` for the other leaves) and writes the result
    into the buffers in place (a ``dynamic_update_slice`` of the donated host buffers). A
    not-stacked leaf's state is built whole, straight into host memory. Scalar state (the
    step count) comes from the first unit's init. Same values as ``tx.init(params)``: the
    leaf-wise part treats every element alike (see `StreamableChain`).

    The `resident` parameters' moments are built by one program straight into device
    memory, where they stay (partial offload).

    Falls back to `init_on_host` (one program for the whole state) when a param-shaped
    state leaf does not have its parameter's shape.

    Args:
      tx: a `streamable_chain`.
      params: arrays with ``NamedSharding`` shardings on one mesh, in device memory; a
        stacked leaf's leading (layer) dim must not be sharded.
      stacked: bools with the structure of `params` (see `stream_units`).
      group_layers: layers per unit.
      resident: bools with the structure of `params` (None: none): parameters whose
        moments stay in device memory.

    Returns:
      ``tx.init(params)``'s tree, its arrays in `HOST_MEMORY_KIND` (the resident moments
      in device memory) with the shardings `init_on_host` gives them.

    Raises:
      UsageError: the moments do not fit the pinned host pool (`check_pinned_pool`).
    """
    units = stream_units(params, stacked, group_layers, resident)
    p_leaves, p_def = jax.tree.flatten(params)
    replicated = _host_replicated(p_leaves)
    keep = _flags(p_def, resident)
    on_device = [i for i, k in enumerate(keep) if k]

    param_shaped = _param_shaped(p_def)

    template = jax.eval_shape(tx.leafwise_part.init, params)
    parts, s_def = jax.tree.flatten(template, is_leaf=param_shaped)
    moment_parts = [j for j, x in enumerate(parts) if param_shaped(x)]
    shapes = {(j, i): x for j in moment_parts for i, x in enumerate(p_def.flatten_up_to(parts[j]))}
    _check_streamable(shapes, p_leaves)
    if not (units or on_device):
        return init_on_host(tx.init, params, resident)
    sharding = {key: p_leaves[key[1]].sharding if keep[key[1]] else
                p_leaves[key[1]].sharding.with_memory_kind(HOST_MEMORY_KIND)
                for key in shapes}
    check_pinned_pool(shapes, sharding)  # the moments: the rest is scalars
    global_state = init_on_host(tx.global_part.init, params)
    other_shardings = {j: jax.tree.map(lambda _: replicated, parts[j])
                       for j in range(len(parts)) if j not in moment_parts}

    def unit_state(p_slices: dict[int, Any]) -> tuple[dict, dict]:
        out = s_def.flatten_up_to(tx.leafwise_part.init(_masked(p_def, p_slices)))
        moments = {(j, i): p_def.flatten_up_to(out[j])[i] for j in moment_parts
                   for i in p_slices}
        return moments, {j: out[j] for j in other_shardings}

    def whole(p_leaf: jax.Array, *, i: int) -> tuple[dict, dict]:
        return unit_state({i: p_leaf})

    def group(bufs: dict, p_full: dict[int, Any], start: jax.Array, *, size: int
              ) -> tuple[dict, dict]:
        p_slices = {i: jax.lax.dynamic_slice_in_dim(x, start, size, 0,
                                                    allow_negative_indices=False)
                    for i, x in p_full.items()}
        moments, others = unit_state(p_slices)
        return {key: jax.lax.dynamic_update_slice_in_dim(
            bufs[key], jax.device_put(y, jax.memory.Space.Host), start, 0,
            allow_negative_indices=False) for key, y in moments.items()}, others

    values: dict[tuple[int, int], jax.Array] = {}
    others: dict[int, Any] | None = None
    if on_device:
        keys = [(j, i) for j in moment_parts for i in on_device]
        values, others = jax.jit(unit_state, out_shardings=(
            {key: sharding[key] for key in keys}, other_shardings))(
            {i: p_leaves[i] for i in on_device})
    programs: dict[tuple, Callable[..., Any]] = {}  # layer groups of one shape share one
    for unit in units:
        leaves = tuple(i for i, _ in unit)
        keys = [(j, i) for j in moment_parts for i in leaves]
        out_shardings = ({key: sharding[key] for key in keys}, other_shardings)
        span = unit[0][1]
        if span is None:
            fn = jax.jit(functools.partial(whole, i=leaves[0]), out_shardings=out_shardings)
            moments, unit_others = fn(p_leaves[leaves[0]])
        else:
            for key in keys:  # first group: host buffers filled on the host
                if key not in values:
                    values[key] = _host_zeros(shapes[key], sharding[key])
            size = span[1] - span[0]
            fn = programs.get((leaves, size))
            if fn is None:
                fn = programs[(leaves, size)] = jax.jit(
                    functools.partial(group, size=size), donate_argnums=0,
                    out_shardings=out_shardings)
            moments, unit_others = fn({key: values[key] for key in keys},
                                      {i: p_leaves[i] for i in leaves}, jnp.int32(span[0]))
        values.update(moments)  # in host memory: the device held only this unit's state
        others = unit_others if others is None else others
    leaf_state = s_def.unflatten([
        p_def.unflatten([values[(j, i)] for i in range(len(p_leaves))]) if j in moment_parts
        else others[j] for j in range(len(parts))])
    return (global_state, leaf_state)


def _host_zeros(shape: jax.ShapeDtypeStruct, sharding: NamedSharding) -> jax.Array:
    """Zeros of `shape` placed with `sharding` (host memory), each shard made on the host:
    nothing is computed on or copied from the device."""

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        dims = [len(range(*s.indices(d))) for s, d in zip(index, shape.shape)]
        return np.zeros(dims, shape.dtype)

    return jax.make_array_from_callback(shape.shape, sharding, shard)


def _flags(treedef: Any, tree: Any) -> list[bool]:
    """`tree` (bools with the structure of `treedef`, or None: all False) as a flat list in
    leaf order."""
    if tree is None:
        return [False] * treedef.num_leaves
    return [bool(f) for f in treedef.flatten_up_to(tree)]


def _masked(treedef: Any, leaves: dict[int, Any]) -> Any:
    """A tree of `treedef` with ``leaves[i]`` at leaf i and ``None`` (optax: no parameter)
    elsewhere."""
    return treedef.unflatten([leaves.get(i) for i in range(treedef.num_leaves)])
