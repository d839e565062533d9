"""Whether an optimizer picks a sharded model's weights by path as it would the unsharded one's.

A `gtp_jax.ShardedModule` holds the module it wraps as its attribute ``module``, so every
path inside it has ``module`` before the wrapped module's own: the unsharded model's
``enc/kernel`` is the sharded model's ``module/enc/kernel`` (``trunk/module/...`` for a
sharded part ``trunk``). Code that picks weights by where their path starts (an
``nnx.Optimizer`` ``wrt`` filter such as ``lambda path, v: path[0] != "enc"``, an
``optax.masked`` mask or ``optax.multi_transform`` labels computed from the paths) would
then pick other weights on the sharded model: freeze nothing, decay everything, without an
error. `check_paths` finds such a difference before training and refuses it in one line.
Matching a name anywhere in the path (``nnx.PathContains("enc")``, ``"enc" in path``) or by
Variable type picks the same weights both ways.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from gtp_jax.base.errors import UsageError
from gtp_jax.sharding.module import ShardedModule

#: What the refusal tells the user to do.
FIX = ("paths inside a gtp_jax.ShardedModule have 'module' before the wrapped module's own. "
       "Match a name anywhere in the path instead (nnx.PathContains('enc'), 'enc' in path) or "
       "select by Variable type")


def wrapper_keys(model: nnx.Module) -> frozenset[tuple[Any, ...]]:
    """The graph paths of `model` that are a `ShardedModule`'s ``module`` attribute."""
    return frozenset(tuple(path) + ("module",) for path, node in nnx.graph.iter_graph(model)
                     if isinstance(node, ShardedModule))


def unsharded_path(path: tuple[Any, ...], wrappers: frozenset[tuple[Any, ...]]
                   ) -> tuple[Any, ...]:
    """`path` as the unsharded model names it: each ``module`` key of `wrappers` dropped."""
    out: list[Any] = []
    for i, key in enumerate(path):
        if tuple(path[:i + 1]) not in wrappers:
            out.append(key)
    return tuple(out)


def check_paths(model: nnx.Module, optimizer: nnx.Optimizer, where: str) -> None:
    """Refuses `optimizer` where its ``wrt`` filter, or masks and labels its transformation
    computes from the parameters' paths, pick other weights of `model` than of the unsharded
    model (see the module docstring). Nothing is computed: the filter is asked of each
    Variable under both paths, and ``tx.init`` is traced (``jax.eval_shape``) on both
    views of the parameters, whose masked leaves must fall alike. A model without a sharded
    part passes at once.

    Raises:
      UsageError: one line naming the first weight picked differently and the fix.
    """
    wrappers = wrapper_keys(model)
    if not wrappers:
        return
    predicate = nnx.filterlib.to_predicate(optimizer.wrt)
    for path, node in nnx.graph.iter_graph(model):
        if not isinstance(node, nnx.Variable):
            continue
        plain = unsharded_path(tuple(path), wrappers)
        picks = bool(predicate(tuple(path), node))
        if plain != tuple(path) and picks != bool(predicate(plain, node)):
            verbs = ("selects", "leave out") if picks else ("leaves out", "select")
            raise UsageError(
                f"{where}: the optimizer's wrt filter {verbs[0]} {_name(path)} but would "
                f"{verbs[1]} {_name(plain)}, its path in the unsharded model: {FIX}.")
    params = nnx.state(model, optimizer.wrt)
    flat = [(tuple(p), v) for p, v in nnx.to_flat_state(params)]
    plain_view = nnx.from_flat_state([(unsharded_path(p, wrappers), v) for p, v in flat])
    try:
        picked = _masked_leaves(optimizer.tx, params)
        picked_plain = _masked_leaves(optimizer.tx, plain_view)
    except Exception:  # noqa: BLE001
        # A transformation that cannot initialize on the other view (a mask tree written
        # for the sharded paths) is keyed by path: the unsharded model could not use it
        # either, and nothing here can tell what it picks. Left to the step.
        return
    if picked != picked_plain:
        first = flat[0][0]
        raise UsageError(
            f"{where}: the optimizer's masks or labels (optax.masked, multi_transform) pick "
            "other weights on the sharded model than on the unsharded one (its paths are "
            f"such as {_name(first)}, the unsharded model's "
            f"{_name(unsharded_path(first, wrappers))}): {FIX}.")


def _masked_leaves(tx: optax.GradientTransformation, params: nnx.State) -> list[Any]:
    """The leaves of ``tx.init(params)``'s shape, each masked-out place (``optax.MaskedNode``)
    a leaf of its own: the same sequence for two views of one tree picks alike (the views
    differ only in keys that keep their order)."""
    state = jax.eval_shape(tx.init, nnx.as_pure(params))
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    return [("masked",) if isinstance(x, optax.MaskedNode)
            else (tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__)))
            for x in leaves]


def _name(path: tuple[Any, ...]) -> str:
    return "'" + "/".join(str(k) for k in path) + "'"
