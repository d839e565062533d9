"""The trainer's optimizer: AdamW with global-norm clipping and a learning-rate schedule,
built from optax (`clip_by_global_norm`: optax's, with a float32 norm; `optax.inject_hyperparams`;
the schedules of `optax.schedules`), and the checks of its settings.

The learning rate is an injected hyperparameter: the optimizer state records the rate each
update used (`current_lr`), so a jitted step reports it without recomputing the schedule.

Schedules (`LR_SCHEDULES`) over ``schedule_steps`` steps, with ``lr`` the peak and every
decay ending at `END_FRACTION` of it on the schedule's last step and held there after it
(what the steps of an extended run train at). Step ``k`` (1, 2, ...) trains at:

  * warm-up, ``k <= warmup``: ``lr * k / warmup`` (step 1 at ``lr / warmup``, never 0;
    ``warmup`` 0: none);
  * then ``constant``: ``lr``; ``cosine`` / ``linear``: cosine or linear decay from ``lr``
    after the warm-up to the end rate ``decay_steps`` later (default: the schedule's last
    step); ``wsd`` (warm-up, stable, decay): ``lr`` until the last ``decay_steps`` steps of
    the schedule (default: the last 20% after the warm-up), then linear decay over them.

`default_warmup` is a tenth of the schedule, at most `MAX_DEFAULT_WARMUP` steps (a
preset's own maximum: `gtp_jax.train.step.lr_defaults`), so a short run is not all
warm-up. That is schedule version 2 (`SCHEDULE_VERSION`). Runs started before it
(checkpoints without ``schedule_version``) keep version 1 when resumed: update ``n`` (0, 1,
...) at optax's rate for count ``n``, so step 1 trained at 0 and the cosine
warm-up lasted ``max(1, warmup)`` steps, whatever the schedule's length (a 6-step run with
the old default 10-step warm-up, extended, warmed up to the peak after its 6th step and
then dropped to the end rate).
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
#: The longest default warm-up (`default_warmup`), and the share of the schedule it takes
#: in shorter runs.
MAX_DEFAULT_WARMUP = 10
DEFAULT_WARMUP_FRACTION = 0.1
#: How schedules map steps to rates (see the module docstring): 2, or 1 for runs started
#: before version 2 (kept when they resume).
SCHEDULE_VERSION = 2
SCHEDULE_VERSIONS = (1, 2)


def default_warmup(schedule_steps: int, longest: int = MAX_DEFAULT_WARMUP,
                   fraction: float = DEFAULT_WARMUP_FRACTION) -> int:
    """The warm-up when none is given: `fraction` of the schedule's steps (rounded down; a
    tenth by default), at most `longest` (`MAX_DEFAULT_WARMUP`; a preset's own:
    `gtp_jax.train.step.lr_defaults`); 0 below 10 steps at a tenth."""
    return min(longest, int(schedule_steps * fraction))


@functools.cache
def make_optimizer(lr: float, warmup: int, schedule_steps: int, weight_decay: float, *,
                   schedule: str = "cosine", decay_steps: int | None = None,
                   clip_grad_norm: float = 1.0, b1: float = 0.9, b2: float = 0.95,
                   eps: float = 1e-8, version: int = SCHEDULE_VERSION) -> StreamableChain:
    """``clip_by_global_norm(clip_grad_norm)`` (0: no clipping), then AdamW (decoupled
    `weight_decay`, moments ``b1``/``b2``, ``eps``) at the learning rate of `lr_schedule`.

    Cached: equal settings return the same transformation object (static data of the
    ``nnx.Optimizer``, so an equal object lets a `gtp_jax.train.step.train_step.TrainStep` reuse its
    compiled program).
    """
    rate = lr_schedule(lr, warmup, schedule_steps, schedule=schedule, decay_steps=decay_steps,
                       version=version)
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
                decay_steps: int | None = None,
                version: int = SCHEDULE_VERSION) -> optax.Schedule:
    """The learning rate per optimizer step as an optax schedule of ``count``, the updates
    done before it (see the module docstring): ``rate(k - 1)`` is step ``k``'s.
    ``decay_steps`` None: `default_decay_steps`; `version` 1: the schedules of runs started
    before version 2."""
    decay = default_decay_steps(schedule, warmup, schedule_steps) if decay_steps is None \
        else decay_steps
    end = lr * END_FRACTION
    if version == 1:
        return _lr_schedule_v1(lr, warmup, schedule_steps, schedule, decay, end)
    stable_until = schedule_steps - decay if schedule == "wsd" else warmup
    setting = (lr, warmup, stable_until, decay, end, schedule)
    try:
        return _cached_rate(*setting)
    except TypeError:  # an unhashable setting (a JAX scalar as the rate): not cached
        return _rate(*setting)


def _rate(lr: float, warmup: int, stable_until: int, decay: int, end: float, schedule: str
          ) -> optax.Schedule:
    """Version 2's schedule as one jitted program, one per setting: the optimizer's init
    evaluates the rate outside any jit, where each jnp operation would compile a program of
    its own (eleven, about 0.4 s on a CPU); an optimizer built again with the same setting
    reuses the compiled one."""

    def rate(count: Any) -> jax.Array:
        step = jnp.asarray(count, jnp.float32) + 1.0  # the step this update trains
        warm = lr * step / warmup if warmup else jnp.full_like(step, lr)
        if schedule == "constant":
            after = jnp.full_like(step, lr)
        else:
            progress = jnp.clip((step - stable_until) / decay, 0.0, 1.0)
            if schedule == "cosine":
                after = end + (lr - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
            else:  # linear, wsd
                after = lr + (end - lr) * progress
        return jnp.where(step <= warmup, warm, after)

    return jax.jit(rate)


_cached_rate = functools.lru_cache(maxsize=64)(_rate)


def _lr_schedule_v1(lr: float, warmup: int, schedule_steps: int, schedule: str, decay: int,
                    end: float) -> optax.Schedule:
    """Schedule version 1: optax's schedules of the update count (step 1 at rate 0)."""
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
                             adam_b2: Any, adam_eps: Any, owner: str = "TrainConfig",
                             version: int = SCHEDULE_VERSION,
                             check_warmup: bool = True) -> None:
    """Raises UsageError / UsageTypeError naming ``<owner>.<field>`` for an optimizer setting
    out of range: an unknown schedule, ``decay_steps`` < 1 or with the constant schedule, a
    wsd decay longer than the steps after the warm-up, a warm-up that leaves no step to
    decay in (schedule version 2; constant: longer than the schedule), a negative or
    non-finite clipping norm, ``adam_b1``/``adam_b2`` outside [0, 1), ``adam_eps`` <= 0.
    `check_warmup` False: the schedule's length is not known yet (a run that may resume
    keeps its checkpoint's), so the warm-up is not compared with it."""
    if lr_schedule not in LR_SCHEDULES:
        raise UsageError(f"{owner}.lr_schedule={lr_schedule!r}: use one of "
                         f"{list(LR_SCHEDULES)}.")
    if version not in SCHEDULE_VERSIONS:
        raise UsageError(f"{owner}.schedule_version={version!r}: use one of "
                         f"{list(SCHEDULE_VERSIONS)} (None: {SCHEDULE_VERSION}).")
    decays = lr_schedule != "constant"
    if check_warmup and version >= 2 and (warmup >= schedule_steps if decays
                                          else warmup > schedule_steps):
        # The rate would still be warming up when the schedule ends: steps added to the run
        # later would climb to the peak, then drop to the end rate in one step.
        longest = schedule_steps - 1 if decays else schedule_steps
        raise UsageError(
            f"{owner}.warmup={warmup} leaves no step of the {schedule_steps}-step schedule "
            f"({owner}.steps) to {'decay in' if decays else 'train at the peak'}; use "
            f"{owner}.warmup <= {longest}, or leave it unset (a tenth of the steps).")
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
