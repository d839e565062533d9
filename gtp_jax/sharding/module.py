"""`shard` / `unshard`: turn an ordinary Flax NNX module into a GTP-sharded one and back."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gtp_jax.config import GTPConfig
from gtp_jax.sharding.collectives import gather_weight
from gtp_jax.sharding.lazy import GTPShard
from gtp_jax.sharding.mesh import _check_axis, data_axes, data_size, shard_key
from gtp_jax.sharding.plan import STACKED, ParamPlan, path_str, plan_param
from gtp_jax.sharding.scan import gathered_weight_policy

#: Variable metadata holding a sharded weight's logical (unpadded) shape.
LOGICAL_SHAPE = "gtp_logical_shape"

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
    and their gradients reduce-scattered back to shards. Outputs keep their batch split.

    Attributes:
      module: the wrapped module; its sharded parameters hold padded global arrays.
      mesh: the device mesh.
      config: the `GTPConfig` it was sharded with.
      plan: one `ParamPlan` per sharded parameter.
    """

    def __init__(self, module: nnx.Module, *, mesh: Mesh, config: GTPConfig,
                 plan: tuple[ParamPlan, ...]):
        self.module = module
        self.mesh = mesh
        self.config = config
        self.plan = plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mesh, axes = self.mesh, data_axes(self.mesh)
        plans = {p.path: p for p in self.plan}
        graphdef, state = nnx.split(self.module)
        paths, variables, var_tree = _flat_variables(state)
        values = [v.get_value() for v in variables]
        value_specs = [
            plans[p].partition_spec(jnp.ndim(x)) if p in plans else P()
            for p, x in zip(paths, values)
        ]
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
            out_specs=(P(axes), P()),
            check_vma=False,
        )
        out, side = run(values, [leaves[i] for i in dynamic])
        if side:
            nnx.update(self.module, jax.tree.unflatten(side_tree, side))
        return out

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


def shard(module: nnx.Module, mesh: Mesh, config: GTPConfig | None = None) -> ShardedModule:
    """Returns a copy of `module` whose eligible weights are stored 1/N on ``config.axis``.

    Each selected parameter (default: floating, rank >= 2, at least ``config.min_elements``
    elements; see `GTPConfig`) is zero-padded on dim 0 (dim 1 for layer-stacked weights
    marked with ``gtp_stacked=True`` metadata) to a multiple of the axis size and placed with
    ``NamedSharding(mesh, P(..., config.axis, ...))``; everything else is replicated on the
    mesh. The input module is not modified. Optimizer state built from the result (e.g.
    ``nnx.Optimizer(sharded, optax.adamw(1e-3), wrt=nnx.Param)``) is sharded the same way.

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
    plans = []
    for path, var in zip(paths, variables):
        value = var.get_value()
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            plans.append(None)
            continue
        stacked = bool(var.get_metadata().get(STACKED, False)) and np.ndim(value) >= 2
        plan = None
        if isinstance(var, nnx.Param):
            plan = plan_param(path, tuple(value.shape), np.dtype(value.dtype), stacked=stacked,
                              mesh=mesh, config=config)
        elif config.include and any(re.search(p, path) for p in config.include):
            raise TypeError(
                f"GTPConfig.include selects {path!r}, a {type(var).__name__} variable; only "
                "nnx.Param variables can be sharded. Narrow the include pattern."
            )
        plans.append(plan)
    if not any(plans):
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
            placed = _pad_and_place(value, plan, mesh)
            new_var = var.replace(value=placed)
            new_var.set_metadata(LOGICAL_SHAPE, tuple(value.shape))
            new_vars.append(new_var)
    inner = nnx.merge(graphdef, jax.tree.unflatten(var_tree, new_vars))
    return ShardedModule(inner, mesh=mesh, config=config,
                         plan=tuple(p for p in plans if p is not None))


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
    plans = {p.path: p for p in module.plan}
    graphdef, state = nnx.split(module.module)
    paths, variables, var_tree = _flat_variables(state)
    new_vars = []
    for path, var in zip(paths, variables):
        if path not in plans:
            new_vars.append(var.replace(value=var.get_value()))
            continue
        plan = plans[path]
        logical = var.get_metadata()[LOGICAL_SHAPE]
        full = _unpad(var.get_value(), plan.stored_dim, logical[plan.stored_dim],
                      NamedSharding(module.mesh, P()))
        new_var = var.replace(value=full)
        new_var.del_metadata(LOGICAL_SHAPE)
        new_vars.append(new_var)
    return nnx.merge(graphdef, jax.tree.unflatten(var_tree, new_vars))


def _pad_and_place(value: jax.Array, plan: ParamPlan, mesh: Mesh) -> jax.Array:
    dim = plan.stored_dim
    widths = [(0, 0)] * np.ndim(value)
    widths[dim] = (0, plan.spec.padded_size - value.shape[dim])
    sharding = NamedSharding(mesh, plan.partition_spec(np.ndim(value)))
    return _jit_pad(tuple(widths), sharding)(value)


@functools.cache
def _jit_pad(widths: tuple[tuple[int, int], ...], sharding: NamedSharding):
    # Jitted with an output sharding so each device only ever materializes its own shard.
    return jax.jit(lambda x: jnp.pad(x, widths), out_shardings=sharding)


@functools.cache
def _jit_unpad(dim: int, size: int, sharding: NamedSharding):
    return jax.jit(lambda x: jax.lax.slice_in_dim(x, 0, size, axis=dim), out_shardings=sharding)


def _unpad(value: jax.Array, dim: int, size: int, sharding: NamedSharding) -> jax.Array:
    return _jit_unpad(dim, size, sharding)(value)


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


__all__: Sequence[str] = ("ShardedModule", "shard", "unshard", "bytes_per_device")
