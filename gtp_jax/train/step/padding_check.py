"""Whether an optimizer gives the unsharded update on zero-padded stored weights.

A weight whose sharded dim the mesh axis does not divide is stored zero-padded (a 37 x 61
kernel over gtp = 8: 37 x 64), and an optimizer updates the stored array. Elementwise
optimizers (SGD, Adam, AdamW, Lion) and global norms are exact on it: the padding's
gradient is zero, so it stays zero and adds nothing to a norm. An optimizer that reads a
weight's shape or averages over its elements (Adafactor's factored moments and parameter
scale, Muon's orthogonalization scale) updates the padded array differently from the
logical one: a silent difference from the unsharded model that grows every step.

`check_padded_updates` runs the optimizer's first two updates once on stand-in values (the
padded weights at their real shapes; every other weight as a 1-element array of its rank,
so that masks and labels keyed by the parameter tree still apply) both ways, padded and
logical, and refuses the optimizer in one line where the two differ. A
`gtp_jax.sharding.offload.StreamableChain` (`gtp_jax.train.make_optimizer`'s AdamW) is
elementwise by its contract and not run. Results are kept per
optimizer object and weight layout, so equal steps check once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.base.metadata import LOGICAL_SHAPE
from gtp_jax.sharding.offload import StreamableChain
from gtp_jax.train.lifecycle.layout import array_info, from_logical, to_logical
from gtp_jax.train.step.path_check import check_paths

#: Largest relative difference (to the update's largest element) taken as float rounding:
#: sums over a different number of zeros round differently, by about 1e-7 in float32; the
#: shape-dependent optimizers differ by 1e-4 to 1e-2 at the first step.
RTOL = 1e-4

#: (tx id, layout) -> (tx, the refusal or None)
_checked: OrderedDict[Any, tuple[Any, str | None]] = OrderedDict()
_MAX_CHECKED = 64


def padded_weights(params: nnx.State) -> dict[tuple[Any, ...], dict[str, Any]]:
    """``{path: array_info}`` of the weights of `params` (an ``nnx.State`` of the trained
    variables) whose stored shape is not their logical shape (GTP or tp/ep padding)."""
    out = {}
    for path, var in nnx.to_flat_state(params):
        if not isinstance(var, nnx.Variable) or var.get_metadata().get(LOGICAL_SHAPE) is None:
            continue
        info = array_info(var, var.get_value())
        if info["shape"] != info["logical_shape"]:
            out[tuple(path)] = info
    return out


def check_optimizer(model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    """Refuses `optimizer` where it would train `model` (sharded, or holding sharded parts)
    away from the unsharded model: an optimizer whose update of a zero-padded stored weight
    differs from its update of the unpadded weight (Adafactor, Muon), or whose ``wrt``
    filter, masks or labels pick weights by where their path starts
    (`gtp_jax.train.step.path_check`: paths in a sharded module have ``module`` first).
    `TrainStep` checks this itself; call it once for a training loop of your own::

        optimizer = nnx.Optimizer(model, optax.adafactor(1e-2), wrt=nnx.Param)
        gtp_jax.train.check_optimizer(model, optimizer)  # UsageError if weights are padded

    Nothing is changed; a model without padded weights passes at once.

    Raises:
      UsageError: one line naming the first such weight and the fixes.
      UsageTypeError: `optimizer` is not an ``nnx.Optimizer``.
    """
    if not isinstance(optimizer, nnx.Optimizer):
        raise UsageTypeError(f"check_optimizer: optimizer={type(optimizer).__name__} must be "
                             "an nnx.Optimizer of the model.")
    check_paths(model, optimizer, "check_optimizer")
    check_padded_updates(optimizer.tx, nnx.state(model, optimizer.wrt), "check_optimizer")


def check_padded_updates(tx: Any, params: nnx.State, where: str) -> None:
    """Refuses `tx` (an optax ``GradientTransformation``) if its first or second update of
    a padded weight of `params` differs from its update of the logical weight beyond `RTOL`.

    Raises:
      UsageError: one line naming the optimizer's first differing weight, its stored and
        logical shapes and the fixes (sizes the mesh axis divides, an elementwise
        optimizer). Nothing is changed before it is raised.
    """
    if isinstance(tx, StreamableChain):
        # Elementwise by its contract (its leaf-wise part; the global part takes norms of
        # whole trees, which zero padding leaves as they are): `make_optimizer`'s AdamW.
        return
    padded = padded_weights(params)
    if not padded:
        return
    flat = [(tuple(path), var) for path, var in nnx.to_flat_state(params)]
    layout = tuple((path, tuple(np.shape(var.get_value())), str(var.get_value().dtype),
                    repr(padded.get(path))) for path, var in flat)
    key = (id(tx), layout)
    if key not in _checked:
        # The entry holds `tx` itself, so that its id names no other object while it is kept.
        _checked[key] = (tx, _refusal(tx, flat, padded))
        while len(_checked) > _MAX_CHECKED:
            _checked.popitem(last=False)
    _checked.move_to_end(key)
    refusal = _checked[key][1]
    if refusal is not None:
        raise UsageError(f"{where}: {refusal}")


def _refusal(tx: Any, flat: list[tuple[tuple[Any, ...], nnx.Variable]],
             padded: Mapping[tuple[Any, ...], dict[str, Any]]) -> str | None:
    """What `check_padded_updates` says about `tx` (after its ``where: ``), or None."""
    names = [path for path, _ in flat if path in padded]
    errors = _compare(tx, flat, names, padded)
    for path, err in zip(names, jax.device_get(errors)):
        info = padded[path]
        if not float(err) <= RTOL:  # NaN included
            name = "/".join(str(k) for k in path)
            return (f"the optimizer updates the zero-padded stored weight {name} "
                    f"({tuple(info['shape'])}, logically {tuple(info['logical_shape'])}) "
                    f"differently from the unpadded one ({float(err):.1e} relative in the "
                    "first two steps): it depends on a weight's shape or averages over its "
                    "elements (Adafactor, Muon). Use sizes the mesh axis divides (no "
                    "padding), or an elementwise optimizer (SGD, Adam, AdamW).")
    return None


def _compare(tx: Any, flat: list[tuple[tuple[Any, ...], nnx.Variable]], names: list,
             info_of: Mapping[tuple[Any, ...], dict[str, Any]]
             ) -> list[jax.Array]:
    """Per padded weight in `names`: max |stored update, unpadded - logical update| / max
    |logical update| over the first two updates of stand-in values. What an optimizer
    writes into the padding (Yogi's initial moments do) only counts where a later update
    of the weight reads it: the gathers drop the padding, so the model never does."""
    ranks = {path: np.ndim(var.get_value()) for path, var in flat}
    dtypes = {path: var.get_value().dtype for path, var in flat}
    shardings = {path: getattr(var.get_value(), "sharding", None) for path, var in flat}

    def stand_ins(key: jax.Array) -> tuple[nnx.State, nnx.State]:
        stored, logical = [], []
        for i, (path, var) in enumerate(flat):
            dtype = dtypes[path]
            if path in info_of:
                info = info_of[path]
                x = jax.random.normal(jax.random.fold_in(key, i),
                                      tuple(info["logical_shape"]), jnp.float32).astype(dtype)
                s = from_logical(x, info)
                if shardings[path] is not None:
                    s = jax.lax.with_sharding_constraint(s, shardings[path])
                stored.append((path, var.replace(s)))
                logical.append((path, var.replace(x)))
            else:
                x = jax.random.normal(jax.random.fold_in(key, i), (1,) * ranks[path],
                                      jnp.float32).astype(dtype)
                stored.append((path, var.replace(x)))
                logical.append((path, var.replace(x)))
        return nnx.from_flat_state(stored), nnx.from_flat_state(logical)

    def padding_zeroed(tree: nnx.State) -> nnx.State:
        # A gradient of the stored weights: zero in the padding (the gathers drop it).
        flat_tree = [(tuple(path), v) for path, v in nnx.to_flat_state(tree)]
        return nnx.from_flat_state([
            (path, v.replace(from_logical(to_logical(v.get_value(), info_of[path]),
                                          info_of[path])) if path in info_of else v)
            for path, v in flat_tree])

    def two_steps(params: nnx.State, zeroed: Any) -> list[dict]:
        # The stand-ins serve as their own gradients; the second step's are the updated
        # weights (with the padding zeroed, as real gradients have it).
        updates, state = tx.update(zeroed(params), tx.init(params), params)
        params = optax.apply_updates(params, updates)
        second, _ = tx.update(zeroed(params), state, params)
        return [dict(nnx.to_flat_state(u)) for u in (updates, second)]

    @jax.jit
    def run(key: jax.Array) -> list[jax.Array]:
        stored, logical = stand_ins(key)
        steps_s = two_steps(stored, padding_zeroed)
        steps_l = two_steps(logical, lambda tree: tree)
        out = []
        for path in names:
            info, errs = info_of[path], []
            for up_s, up_l in zip(steps_s, steps_l):
                u_s = _value(up_s[path]).astype(jnp.float32)
                u_l = _value(up_l[path]).astype(jnp.float32)
                scale = jnp.maximum(jnp.max(jnp.abs(u_l)), jnp.finfo(jnp.float32).tiny)
                errs.append(jnp.max(jnp.abs(to_logical(u_s, info) - u_l)) / scale)
            out.append(jnp.max(jnp.stack(errs)))
        return out

    return run(jax.random.key(0))


def _value(x: Any) -> jax.Array:
    return x.get_value() if isinstance(x, nnx.Variable) else x

