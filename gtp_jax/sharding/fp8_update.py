"""Writing delayed-FP8 amax histories back after a step, refusing a layer used twice.

Under ``GTPConfig(fp8_compute="delayed")`` the backward pass returns each layer's next
amax history as the history's cotangent (`gtp_jax.pallas.fp8_matmul.fp8_matmul_delayed`).
JAX sums the cotangents of a value used more than once, so a layer whose matmul runs twice
in one step (weight tying, a layer reused in a loop, a module called twice) would get the
sum of its calls' histories: amaxes that grow by that factor every step and scales that
collapse, silently. Each use also adds 1 to the history's use column
(`gtp_jax.base.fp8_history.USES_COLUMN`), so the summed cotangent counts the uses:

- `history_uses` reads that count per layer (the largest over a stack's layers);
- `check_fp8_uses` raises a `UsageError` naming each layer used more than once, and the fix;
- `next_fp8_history` keeps the old history of a layer that did not run (count 0: its
  cotangent is all zeros) instead of writing zeros;
- `apply_fp8_history` does these for a training loop of one's own (``nnx.grad``);
  `gtp_jax.train.TrainStep` does the same inside its step program.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gtp_jax.base.errors import UsageError
from gtp_jax.base.fp8_history import USES_COLUMN, Fp8History
from gtp_jax.sharding.contract import key_name
from gtp_jax.sharding.plan import path_str


def layer_prefix(model: nnx.Module) -> tuple[str, ...]:
    """Graph keys in front of the user's layer paths in `model`'s state: ``("module",)``
    for a `gtp_jax.ShardedModule` (its user module is ``.module``), else ``()``."""
    from gtp_jax.sharding.module import ShardedModule  # module.py imports this package

    return ("module",) if isinstance(model, ShardedModule) else ()


def _layer_path(keys: tuple, prefix: tuple[str, ...]) -> str:
    """``("module", "blocks", "mlp", "down", "dot_general", "amax_history")`` ->
    ``"blocks/mlp/down"``: the layer's path as `GTPConfig.fp8_exclude` patterns see it."""
    names = [key_name(k) for k in keys]
    if tuple(names[:len(prefix)]) == prefix:
        names = names[len(prefix):]
    return path_str(names[:-2])  # drop the injection point and "amax_history"


def _has_uses(value: Any) -> bool:
    return value.shape[-1] > USES_COLUMN


def history_uses(history: nnx.State, prefix: tuple[str, ...] = ()) -> dict[str, jax.Array]:
    """``{layer path: float32[]}``: how often each layer's matmul ran in the step whose
    next histories `history` holds (an ``nnx.State`` of `Fp8History` cotangents): row 0 of
    the use column, the largest over a stacked layer's layers. `prefix`: keys to drop in
    front of the paths (`layer_prefix`). Histories without a use column are left out."""
    out = {}
    for keys, var in nnx.to_flat_state(history):
        value = var.get_value()
        if _has_uses(value):
            out[_layer_path(tuple(keys), prefix)] = jnp.max(value[..., 0, USES_COLUMN])
    return out


def check_fp8_uses(uses: Mapping[str, Any]) -> None:
    """Raises a `UsageError` naming every layer of `uses` (`history_uses`, host values or
    concrete arrays) whose matmul ran more than once in a step, with the fix."""
    twice = {path: int(np.asarray(n)) for path, n in uses.items() if np.asarray(n) > 1}
    if not twice:
        return
    listed = ", ".join(f"{path!r} ran {n} times" for path, n in sorted(twice.items()))
    patterns = ", ".join(repr(f"^{path}$") for path in sorted(twice))
    raise UsageError(
        f"GTPConfig.fp8_compute='delayed': the matmul of layer {listed} in one step (weight "
        "tying, a layer reused in a loop or called twice). Delayed scaling keeps one amax "
        "history per layer and cannot combine several uses: the history would get their sum "
        "and the scales would collapse. Keep the layer out of FP8 "
        f"(GTPConfig(fp8_exclude=(..., {patterns}))), give each use its own layer, or use "
        "fp8_compute='tensorwise'. Nothing was updated by this step.")


def next_fp8_history(old: nnx.State, new: nnx.State) -> nnx.State:
    """`new` (the histories' cotangents), except that a layer whose matmul did not run
    (use count 0 in row 0; per layer of a stack) keeps its `old` history, rather than the
    all-zero cotangent that would reset its scales to 1, and so does a layer that ran more
    than once (never the sum of its uses' histories; `check_fp8_uses` refuses it). Both
    are States of `Fp8History` with the same paths."""
    before = dict(nnx.to_flat_state(old))
    out = []
    for keys, var in nnx.to_flat_state(new):
        value = var.get_value()
        if _has_uses(value):
            once = value[..., 0, USES_COLUMN] == 1
            value = jnp.where(once[..., None, None], value, before[keys].get_value())
        out.append((keys, var.replace(value=value)))
    return nnx.from_flat_state(out)


def apply_fp8_history(model: nnx.Module, grads: nnx.State) -> dict[str, jax.Array]:
    """Writes the next amax histories of a delayed-FP8 `model` from `grads` into it, for a
    training loop of one's own (`gtp_jax.train.TrainStep` does this itself); returns the
    use counts (`history_uses`: ``{layer path: float32[]}``).

    `grads`: the ``nnx.State`` of ``nnx.grad(loss, argnums=nnx.DiffState(0,
    nnx.Any(nnx.Param, Fp8History)))(model, ...)`` (its `Fp8History` part is used; give
    the optimizer the ``nnx.Param`` part only). A layer whose matmul did not run keeps its
    history; so does one that ran more than once (`next_fp8_history`). Outside ``jit``
    a layer that ran more than once raises a `UsageError` (`check_fp8_uses`, one small
    device-to-host read) before the model is touched. Inside ``jit`` / ``nnx.jit`` nothing
    can raise: return the counts from the jitted step and pass them to `check_fp8_uses`
    after its first call (a host callback that raised would leave the other devices
    waiting in their collectives); until then such a layer's history stays as it was.
    """
    history = nnx.state(grads, Fp8History)
    uses = history_uses(history, layer_prefix(model))
    if not any(isinstance(n, jax.core.Tracer) for n in uses.values()):
        check_fp8_uses(jax.device_get(uses))
    nnx.update(model, next_fp8_history(nnx.state(model, Fp8History), history))
    return uses
