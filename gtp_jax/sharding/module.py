"""`shard` / `unshard`: turn an ordinary Flax NNX module into a GTP-sharded one and back."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gtp_jax.base.axes import ParallelAxes, use_axes
from gtp_jax.base.config import GTPConfig
from gtp_jax.base.mesh import _check_axis, data_axes, data_size, shard_key
from gtp_jax.base.metadata import LOGICAL_SHAPE, SPLIT_AXES, SPLIT_LAYOUT, STACKED
from gtp_jax.sharding.collectives import gather_weight
from gtp_jax.sharding.lazy import GTPShard
from gtp_jax.sharding.plan import (
    ParamPlan,
    SplitPlan,
    choose_shard_dim,
    model_splits,
    path_str,
    plan_param,
)
from gtp_jax.sharding.scan import gathered_weight_policy


@dataclasses.dataclass(frozen=True)
class OutputLayout:
    """How a module's outputs leave ``shard_map`` (see `ShardedModule`).

    Attributes:
      specs: ``PartitionSpec`` (or a pytree prefix of them) of the module's outputs, e.g.
        ``(P(("dp", "ep", "gtp"), "tp"), P(("dp", "ep", "gtp")))`` for sequence-parallel
        logits plus a per-example value.
      finalize: applied to the global outputs after ``shard_map`` (e.g. drop sequence
        padding), or None.
    """

    specs: Any
    finalize: Callable[[Any], Any] | None = None

# Variables written back after a call: everything but parameters and RNG keys (keys are
# folded per shard inside the call and must not be written back folded).
_SIDE_STATE = nnx.Not(nnx.Any(nnx.Param, nnx.RngKey))


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _key_name(key: Any) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def _flat_variables(state: Any) -> tuple[list[str], list[nnx.Variable], Any]:
    """(paths, variables, treedef) of a `nnx.State`, with Variables as leaves."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)
    paths = [path_str(_key_name(k) for k in keys) for keys, _ in with_path]
    return paths, [v for _, v in with_path], treedef


class ShardedModule(nnx.Module):
    """A Flax NNX module whose eligible weights are stored as 1/N shards on a mesh axis.

    Built by `gtp_jax.shard`. Calling it runs the wrapped module inside ``jax.shard_map``:
    every array argument is split along dim 0 (the batch) over the mesh's data axes
    (`gtp_jax.data_axes`: every axis but ``tp``), weights are all-gathered just before use
    and their gradients reduce-scattered back to shards. Weights split over ``tp``/``ep``
    (`gtp_jax.sharding.plan.TP_DIM` / ``EP_DIM`` metadata) arrive as this rank's piece.

    While the module is traced, `gtp_jax.parallel.current_axes` names the mesh's ``tp`` and
    ``ep`` axes (when larger than 1), so model code can run tensor/sequence/expert
    parallelism. Outputs keep their batch split (``P(data_axes)``) unless the wrapped module
    defines ``gtp_output_layout(mesh, *args, **kwargs) -> OutputLayout | None`` (same
    arguments as ``__call__``), e.g. to return sequence-sharded logits.

    Attributes:
      module: the wrapped module; its sharded parameters hold padded global arrays.
      mesh: the device mesh.
      config: the `GTPConfig` it was sharded with.
      plan: one `ParamPlan` per GTP-sharded parameter.
      split_plan: one `SplitPlan` per parameter split over ``tp``/``ep`` but not GTP-sharded.
    """

    def __init__(self, module: nnx.Module, *, mesh: Mesh, config: GTPConfig,
                 plan: tuple[ParamPlan, ...], split_plan: tuple[SplitPlan, ...] = ()):
        self.module = module
        self.mesh = mesh
        self.config = config
        self.plan = plan
        self.split_plan = split_plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mesh, axes = self.mesh, data_axes(self.mesh)
        plans = {p.path: p for p in self.plan}
        placed = {**{p.path: p for p in self.split_plan}, **plans}
        graphdef, state = nnx.split(self.module)
        paths, variables, var_tree = _flat_variables(state)
        values = [v.get_value() for v in variables]
        value_specs = [
            placed[p].partition_spec(jnp.ndim(x)) if p in placed else P()
            for p, x in zip(paths, values)
        ]
        layout = self._output_layout(args, kwargs)
        leaves, arg_tree = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]
        arg_specs = [self._arg_spec(leaves[i], i) for i in dynamic]
        side_tree = jax.tree.structure(nnx.state(self.module, _SIDE_STATE))

        def body(local_values, local_args):
            new_vars = []
            for path, var, x in zip(paths, variables, local_values):
                if path in plans:
                    plan = plans[path]
                    x = (GTPShard(x, plan.spec, self.config.prefetch) if plan.stacked
                         else gather_weight(x, plan.spec))
                elif isinstance(var, nnx.RngKey):
                    x = shard_key(x, axes)
                new_vars.append(var.replace(value=x))
            module = nnx.merge(graphdef, jax.tree.unflatten(var_tree, new_vars))
            call_leaves = list(leaves)
            for i, x in zip(dynamic, local_args):
                call_leaves[i] = x
            call_args, call_kwargs = jax.tree.unflatten(arg_tree, call_leaves)
            out = module(*call_args, **call_kwargs)
            for x in jax.tree.leaves(out):
                if jnp.ndim(x) < 1:
                    raise ValueError(
                        "A gtp_jax-sharded module must return arrays with a leading batch "
                        f"dimension, got an output of shape {jnp.shape(x)}. Return per-example "
                        "values and reduce them (e.g. jnp.mean) outside the module."
                    )
            return out, jax.tree.leaves(nnx.state(module, _SIDE_STATE))

        if self.config.remat_gathered:
            gathered = [p.spec for p in self.plan if not p.stacked]
            if gathered:
                body = jax.checkpoint(body, policy=gathered_weight_policy(gathered))
        run = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(value_specs, arg_specs),
            out_specs=(layout.specs, P()),
            check_vma=False,
        )
        # The body is traced inside this call (also under jit/grad), so model code sees the
        # axes; backward rules never read them (they get axis names as static arguments).
        with use_axes(ParallelAxes.from_mesh(mesh)):
            out, side = run(values, [leaves[i] for i in dynamic])
        if side:
            nnx.update(self.module, jax.tree.unflatten(side_tree, side))
        return out if layout.finalize is None else layout.finalize(out)

    def _output_layout(self, args: tuple, kwargs: dict) -> OutputLayout:
        hook = getattr(self.module, "gtp_output_layout", None)
        layout = hook(self.mesh, *args, **kwargs) if callable(hook) else None
        if layout is None:
            return OutputLayout(P(data_axes(self.mesh)))
        if not isinstance(layout, OutputLayout):
            raise TypeError(
                f"{type(self.module).__name__}.gtp_output_layout must return an OutputLayout "
                f"or None, got {type(layout).__name__}.")
        return layout

    def _arg_spec(self, x: Any, index: int) -> P:
        if np.ndim(x) == 0:
            return P()
        n = data_size(self.mesh)
        if np.shape(x)[0] % n:
            raise ValueError(
                f"Argument {index} has batch dimension {np.shape(x)[0]}, which does not divide "
                f"over the {n} data shards {data_axes(self.mesh)} of the mesh; use a batch "
                f"size that is a multiple of {n}."
            )
        return P(data_axes(self.mesh))

    def sharded_paths(self) -> list[str]:
        """Paths of the GTP-sharded parameters."""
        return [p.path for p in self.plan]

    def placements(self) -> dict[str, ParamPlan | SplitPlan]:
        """``{path: plan}`` of every parameter not simply replicated (GTP and/or tp/ep)."""
        return {**{p.path: p for p in self.split_plan}, **{p.path: p for p in self.plan}}


def shard(module: nnx.Module, mesh: Mesh, config: GTPConfig | None = None) -> ShardedModule:
    """Returns a copy of `module` whose eligible weights are stored 1/N on ``config.axis``.

    Each selected parameter (default: floating, rank >= 2, at least ``config.min_elements``
    elements; see `GTPConfig`) is zero-padded on dim 0 (dim 1 for layer-stacked weights
    marked with ``gtp_stacked=True`` metadata) to a multiple of the axis size and placed with
    ``NamedSharding(mesh, P(..., config.axis, ...))``; everything else is replicated on the
    mesh. The input module is not modified. Optimizer state built from the result (e.g.
    ``nnx.Optimizer(sharded, optax.adamw(1e-3), wrt=nnx.Param)``) is sharded the same way.

    Tensor/expert parallelism: a parameter whose metadata names a ``gtp_tp_dim`` (or
    ``gtp_ep_dim``) is split over the mesh's ``tp`` (``ep``) axis on that per-layer dim
    when the axis is larger than 1 (see `gtp_jax.sharding.plan`); GTP then shards the
    local piece on another dim (``gtp_shard_dim`` metadata, default the first free dim).

    Args:
      module: any Flax NNX module (``nnx.Linear``, ``nnx.Einsum``, ``nnx.Embed``,
        ``nnx.LinearGeneral``... inside arbitrary user modules).
      mesh: a mesh containing ``config.axis`` (see `gtp_jax.make_mesh`).
      config: a `GTPConfig`; default ``GTPConfig()``.

    Returns:
      A `ShardedModule` computing the same function.

    Raises:
      TypeError: `module`, `mesh` or `config` has the wrong type, or an include pattern
        selects a non-floating parameter.
      ValueError: the axis is not in the mesh, nothing is eligible to shard, or the module
        keeps batch statistics (not supported under data parallelism).

    Example:
      >>> mesh = gtp_jax.make_mesh(dp=2, gtp=4)                        # doctest: +SKIP
      >>> model = gtp_jax.shard(nnx.Linear(512, 512, rngs=nnx.Rngs(0)), mesh)  # doctest: +SKIP
    """
    config = GTPConfig() if config is None else config
    _validate_shard_args(module, mesh, config)
    graphdef, state = nnx.split(module)
    paths, variables, var_tree = _flat_variables(state)
    if any(isinstance(v, nnx.BatchStat) for v in variables):
        raise ValueError(
            "gtp_jax.shard: the module keeps batch statistics (nnx.BatchStat, e.g. BatchNorm), "
            "which would be computed per data shard; use a normalization without batch "
            "statistics (LayerNorm, RMSNorm)."
        )
    plans: list[ParamPlan | SplitPlan | None] = []
    for path, var in zip(paths, variables):
        value = var.get_value()
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            plans.append(None)
            continue
        meta = var.get_metadata()
        stacked = bool(meta.get(STACKED, False)) and np.ndim(value) >= 2
        plan = None
        if isinstance(var, nnx.Param):
            per_layer = tuple(int(d) for d in (value.shape[1:] if stacked else value.shape))
            splits = model_splits(path, per_layer, meta, mesh, config.axis)
            shard_dim = choose_shard_dim(path, per_layer, meta, splits)
            plan = plan_param(path, tuple(value.shape), np.dtype(value.dtype), stacked=stacked,
                              mesh=mesh, config=config, splits=splits, shard_dim=shard_dim)
            if plan is None and splits:
                plan = SplitPlan(path=path, stacked=stacked, splits=splits)
        elif any(k in meta for k in SPLIT_AXES) and any(
                mesh.shape.get(a, 1) > 1 for a in SPLIT_AXES.values()):
            raise TypeError(
                f"{path!r} is a {type(var).__name__} variable with tp/ep split metadata; only "
                "nnx.Param variables can be split. Remove the metadata.")
        elif config.include and any(re.search(p, path) for p in config.include):
            raise TypeError(
                f"GTPConfig.include selects {path!r}, a {type(var).__name__} variable; only "
                "nnx.Param variables can be sharded. Narrow the include pattern."
            )
        plans.append(plan)
    if not any(isinstance(p, (ParamPlan, SplitPlan)) for p in plans):
        raise ValueError(
            "gtp_jax.shard: no parameter of this module is eligible to shard (floating "
            f"nnx.Param of rank >= 2 with >= GTPConfig.min_elements={config.min_elements} "
            f"elements, include={config.include}, exclude={config.exclude}). Lower "
            "min_elements, widen include, or leave this module replicated."
        )
    # Validation is complete: from here on nothing can fail on user input.
    new_vars = []
    for var, plan in zip(variables, plans):
        value = var.get_value()
        if plan is None:
            placed = jax.device_put(value, NamedSharding(mesh, P())) if hasattr(value, "shape") \
                else value
            new_vars.append(var.replace(value=placed))
        else:
            placed = _place(value, plan, mesh)
            new_var = var.replace(value=placed)
            new_var.set_metadata(LOGICAL_SHAPE, tuple(value.shape))
            if plan.splits:
                new_var.set_metadata(SPLIT_LAYOUT, tuple(
                    (s.axis, s.axis_size, s.dim + int(plan.stacked), s.parts)
                    for s in plan.splits))
            new_vars.append(new_var)
    inner = nnx.merge(graphdef, jax.tree.unflatten(var_tree, new_vars))
    return ShardedModule(inner, mesh=mesh, config=config,
                         plan=tuple(p for p in plans if isinstance(p, ParamPlan)),
                         split_plan=tuple(p for p in plans if isinstance(p, SplitPlan)))


def unshard(module: ShardedModule) -> nnx.Module:
    """Returns the wrapped module with full (unpadded, replicated) weights.

    ``unshard(shard(m, mesh, cfg))`` has exactly the parameters of ``m``. Use it for export
    or to compare against an unsharded reference. The sharded module is not modified.
    """
    if not isinstance(module, ShardedModule):
        raise TypeError(
            f"gtp_jax.unshard expects a module returned by gtp_jax.shard, got "
            f"{type(module).__name__}."
        )
    placements = module.placements()
    graphdef, state = nnx.split(module.module)
    paths, variables, var_tree = _flat_variables(state)
    new_vars = []
    for path, var in zip(paths, variables):
        if path not in placements:
            new_vars.append(var.replace(value=var.get_value()))
            continue
        full = _from_stored(placements[path], NamedSharding(module.mesh, P()))(var.get_value())
        new_var = var.replace(value=full)
        new_var.del_metadata(LOGICAL_SHAPE)
        if SPLIT_LAYOUT in new_var.get_metadata():
            new_var.del_metadata(SPLIT_LAYOUT)
        new_vars.append(new_var)
    return nnx.merge(graphdef, jax.tree.unflatten(var_tree, new_vars))


def unshard_values(module: ShardedModule, tree: Any) -> dict[str, jax.Array]:
    """Full logical (unpadded, unpermuted, replicated) arrays of a state shaped like the params.

    Args:
      module: the `ShardedModule`.
      tree: its params, or a gradient / optimizer-moment state of the same structure (an
        ``nnx.State`` or the module itself); paths may carry the leading ``module`` key.

    Returns:
      ``{path: array}`` with paths relative to the wrapped module (``"blocks/attn/..."``).
    """
    if not isinstance(module, ShardedModule):
        raise TypeError(f"unshard_values expects a ShardedModule, got {type(module).__name__}.")
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, nnx.Param)
    placements = module.placements()
    replicated = NamedSharding(module.mesh, P())
    out = {}
    for keys, value in nnx.to_flat_state(tree):
        keys = tuple(keys)
        if keys and keys[0] == "module":
            keys = keys[1:]
        path = path_str(keys)
        value = value.get_value() if isinstance(value, nnx.Variable) else value
        plan = placements.get(path)
        out[path] = value if plan is None else _from_stored(plan, replicated)(value)
    return out


def _place(value: jax.Array, plan: ParamPlan | SplitPlan, mesh: Mesh) -> jax.Array:
    sharding = NamedSharding(mesh, plan.partition_spec(np.ndim(value)))
    return _to_stored(plan, sharding)(value)


@functools.cache
def _to_stored(plan: ParamPlan | SplitPlan, sharding: NamedSharding):
    # Jitted with an output sharding so each device only ever materializes its own shard.
    return jax.jit(plan.to_stored, out_shardings=sharding)


@functools.cache
def _from_stored(plan: ParamPlan | SplitPlan, sharding: NamedSharding):
    return jax.jit(plan.from_stored, out_shardings=sharding)


def _validate_shard_args(module: Any, mesh: Any, config: Any) -> None:
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"gtp_jax.shard: module must be a flax.nnx.Module, got {type(module).__name__}."
        )
    if isinstance(module, ShardedModule):
        raise ValueError("gtp_jax.shard: this module is already sharded; pass the original "
                         "module, or gtp_jax.unshard(module) first.")
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"gtp_jax.shard: mesh must be a jax.sharding.Mesh (see gtp_jax.make_mesh), got "
            f"{type(mesh).__name__}."
        )
    if not isinstance(config, GTPConfig):
        raise TypeError(
            f"gtp_jax.shard: config must be a gtp_jax.GTPConfig, got {type(config).__name__}."
        )
    _check_axis(mesh, config.axis, "GTPConfig.axis")


def bytes_per_device(tree: Any, device: jax.Device | None = None) -> int:
    """Bytes that `device` (default: the first addressable one) holds for the arrays in `tree`.

    Counts each array's addressable shard on that device, so a 1/N-sharded weight counts
    1/N (+ padding) and a replicated one counts in full. Accepts modules, states and pytrees.
    """
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    total = 0
    for x in jax.tree.leaves(tree):
        if not isinstance(x, jax.Array):
            continue
        shards = x.addressable_shards
        target = device if device is not None else shards[0].device
        total += sum(s.data.nbytes for s in shards if s.device == target)
    return total


__all__: Sequence[str] = ("OutputLayout", "ShardedModule", "shard", "unshard",
                          "unshard_values", "bytes_per_device")
