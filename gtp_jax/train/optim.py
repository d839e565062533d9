"""The trainer's optimizer: AdamW with global-norm clipping and a learning-rate schedule,
built from optax (`clip_by_global_norm`: optax's, with a float32 norm; `optax.inject_hyperparams`;
the schedules of `optax.schedules`), and the checks of its settings.

The learning rate is an injected hyperparameter: the optimizer state records the rate each
update used (`current_lr`), so a jitted step reports it without recomputing the schedule.

Schedules (`LR_SCHEDULES`), with ``lr`` the peak and every decay ending at `END_FRACTION`
of it, held there after the schedule's last step (what an extended run trains at):

  * ``constant``: linear warm-up from 0 over ``warmup`` steps, then ``lr``.
  * ``cosine``: linear warm-up, then cosine decay over ``decay_steps``
    (`optax.warmup_cosine_decay_schedule`; its warm-up lasts at least one step).
  * ``linear``: linear warm-up, then linear decay over ``decay_steps``.
  * ``wsd`` (warm-up, stable, decay): linear warm-up, ``lr`` until the last ``decay_steps``
    steps of the schedule, then linear decay over them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gtp_jax.base.errors import UsageError
from gtp_jax.sharding.offload import StreamableChain, streamable_chain

#: ``--lr-schedule`` choices.
LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")
#: The LR every decaying schedule ends at, as a fraction of the peak.
END_FRACTION = 0.1
#: The share of a wsd schedule's steps that decay when ``decay_steps`` is not given.
WSD_DECAY_FRACTION = 0.2


@functools.cache
def make_optimizer(lr: float, warmup: int, schedule_steps: int, weight_decay: float, *,
                   schedule: str = "cosine", decay_steps: int | None = None,
                   clip_grad_norm: float = 1.0, b1: float = 0.9, b2: float = 0.95,
                   eps: float = 1e-8) -> StreamableChain:
    """``clip_by_global_norm(clip_grad_norm)`` (0: no clipping), then AdamW (decoupled
    `weight_decay`, moments ``b1``/``b2``, ``eps``) at the learning rate of `lr_schedule`.

    Cached: equal settings return the same transformation object (static data of the
    ``nnx.Optimizer``, so an equal object lets a `gtp_jax.train.step.TrainStep` reuse its
    compiled program).
    """
    rate = lr_schedule(lr, warmup, schedule_steps, schedule=schedule, decay_steps=decay_steps)
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("b1", "b2", "eps",
                                                               "weight_decay"))(
        learning_rate=rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    # optax.chain(clip, adamw) with its two parts named, so that an offloaded step can
    # stream AdamW (leaf-wise) per layer group after clipping (whole-tree).
    clip = optax.identity() if clip_grad_norm == 0 else clip_by_global_norm(clip_grad_norm)
    return streamable_chain(clip, adamw)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm(max_norm)``, with the norm taken in float32
    (`global_norm`) when some gradient has a narrower float dtype.

    optax accumulates the squares in the gradients' own dtype: with bfloat16 gradients
    (master weights in host memory, `GTPConfig.offload_master_weights`) the norm of 300
    leaves came out 1896 against 1924.8 in float32, so the clip's threshold and scale
    disagreed with the ``grad_norm`` the trainer reports. Trees of float32 gradients are
    clipped by optax itself, bit for bit; the state is optax's (empty).

    Args:
      max_norm: the largest global L2 norm of the updates (a positive float).
    """
    inner = optax.clip_by_global_norm(max_norm)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if not any(narrower_than_float32(g.dtype) for g in jax.tree.leaves(updates)):
            return inner.update(updates, state, params)
        g_norm = global_norm(updates)
        keep = g_norm < max_norm
        return jax.tree.map(
            lambda t: jax.lax.select(keep, t, (t / g_norm.astype(t.dtype)) * max_norm),
            updates), state

    return optax.GradientTransformation(inner.init, update)


def narrower_than_float32(dtype: Any) -> bool:
    """Whether `dtype` is a float narrower than float32 (bfloat16, float16, fp8): its sums
    of many terms are kept in float32."""
    return bool(jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32)


def global_norm(tree: Any) -> jax.Array:
    """The float32 L2 norm over every leaf of `tree` (each leaf's squares summed in float32,
    whatever its dtype): the ``grad_norm`` the trainer reports, and what
    `clip_by_global_norm` clips by."""
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32)))


def lr_schedule(lr: float, warmup: int, schedule_steps: int, *, schedule: str = "cosine",
                decay_steps: int | None = None) -> optax.Schedule:
    """The learning rate per optimizer step (``count`` = updates done before it), an optax
    schedule (see the module docstring); ``decay_steps`` None: `default_decay_steps`."""
    decay = default_decay_steps(schedule, warmup, schedule_steps) if decay_steps is None \
        else decay_steps
    end = lr * END_FRACTION
    if schedule == "cosine":
        # As it always was: a resumed run of an older version sees the same rates.
        return optax.schedules.warmup_cosine_decay_schedule(
            0.0, lr, warmup_steps=max(1, warmup), decay_steps=max(warmup + decay, warmup + 1),
            end_value=end)
    parts: list[optax.Schedule] = []
    bounds: list[int] = []
    if warmup:
        parts.append(optax.schedules.linear_schedule(0.0, lr, warmup))
        bounds.append(warmup)
    if schedule == "constant":
        parts.append(optax.schedules.constant_schedule(lr))
    elif schedule == "linear":
        parts.append(optax.schedules.linear_schedule(lr, end, decay))
    else:  # wsd: stable until the final `decay` steps
        stable = max(0, schedule_steps - warmup - decay)
        if stable:
            parts.append(optax.schedules.constant_schedule(lr))
            bounds.append(bounds[-1] + stable if bounds else stable)
        parts.append(optax.schedules.linear_schedule(lr, end, decay))
    if len(parts) == 1:
        return parts[0]
    return optax.schedules.join_schedules(parts, bounds)


def default_decay_steps(schedule: str, warmup: int, schedule_steps: int) -> int:
    """``decay_steps`` when not given: the steps after the warm-up (cosine, linear), or the
    last `WSD_DECAY_FRACTION` of them (wsd; at least one); 0 for constant."""
    after = max(1, schedule_steps - warmup)
    if schedule == "constant":
        return 0
    if schedule == "wsd":
        return max(1, math.ceil(after * WSD_DECAY_FRACTION))
    return after


def check_optimizer_settings(*, lr_schedule: str, warmup: int, schedule_steps: int,
                             decay_steps: int | None, clip_grad_norm: Any, adam_b1: Any,
                             adam_b2: Any, adam_eps: Any, owner: str = "TrainConfig") -> None:
    """Raises UsageError / UsageTypeError naming ``<owner>.<field>`` for an optimizer setting
    out of range: an unknown schedule, ``decay_steps`` < 1 or with the constant schedule, a
    wsd decay longer than the steps after the warm-up, a negative or non-finite clipping
    norm, ``adam_b1``/``adam_b2`` outside [0, 1), ``adam_eps`` <= 0."""
    if lr_schedule not in LR_SCHEDULES:
        raise UsageError(f"{owner}.lr_schedule={lr_schedule!r}: use one of "
                         f"{list(LR_SCHEDULES)}.")
    for name, value, low, high, low_open in (
            ("clip_grad_norm", clip_grad_norm, 0.0, math.inf, False),
            ("adam_b1", adam_b1, 0.0, 1.0, False), ("adam_b2", adam_b2, 0.0, 1.0, False),
            ("adam_eps", adam_eps, 0.0, math.inf, True)):
        _check_number(f"{owner}.{name}", value, low, high, low_open=low_open)
    if decay_steps is None:
        return
    if isinstance(decay_steps, bool) or not isinstance(decay_steps, int) or decay_steps < 1:
        raise UsageError(f"{owner}.decay_steps={decay_steps!r} must be an int >= 1 (or None: "
                         "the steps after the warm-up).")
    if lr_schedule == "constant":
        raise UsageError(f"{owner}.decay_steps={decay_steps} with {owner}.lr_schedule="
                         "'constant': the constant schedule has no decay; drop decay_steps or "
                         "pick 'cosine', 'linear' or 'wsd'.")
    if lr_schedule == "wsd" and warmup + decay_steps > schedule_steps:
        raise UsageError(
            f"{owner}.decay_steps={decay_steps} with {owner}.warmup={warmup}: the wsd "
            f"schedule decays over the last decay_steps of its {schedule_steps} steps, after "
            f"the warm-up; use {owner}.decay_steps <= {max(1, schedule_steps - warmup)}.")


def _check_number(name: str, value: Any, low: float, high: float, *, low_open: bool) -> None:
    from gtp_jax.base.errors import UsageTypeError  # noqa: PLC0415

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageTypeError(f"{name}={value!r} must be a number.")
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and value < high
    if not ok:
        lower = f"> {low:g}" if low_open else f">= {low:g}"
        bound = f"{lower} and < {high:g}" if math.isfinite(high) else lower
        raise UsageError(f"{name}={value} must be finite, {bound}.")


def current_lr(opt_state: Any) -> jax.Array | None:
    """The learning rate the last update used, from the ``inject_hyperparams`` state inside
    `opt_state` (an optax state tree, or an ``nnx.Optimizer``'s ``opt_state``: the first
    found, through tuples and named tuples (``chain``, ``MultiSteps``, ``masked``) and dicts
    (``multi_transform``)); None when the optimizer has none (a fixed rate given to a plain
    optimizer is not in its state)."""
    found: list[Any] = []

    def visit(node: Any) -> None:
        if found:
            return
        hyper = getattr(node, "hyperparams", None)
        if isinstance(hyper, dict) and "learning_rate" in hyper:
            found.append(hyper["learning_rate"])
            return
        if isinstance(node, (tuple, list)):
            for child in node:
                visit(child)
        elif isinstance(node, dict):
            for child in node.values():
                visit(child)

    visit(opt_state)
    if not found:
        return None
    value = found[0]
    return value.get_value() if hasattr(value, "get_value") else value
