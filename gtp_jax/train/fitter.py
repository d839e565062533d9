"""`fit`: the trainer for a model built in code: a model, an optimizer and batches.

The command line's run (`gtp_jax.train.train`) without its data and configs: the same step
(`TrainStep`), step loop (`gtp_jax.train.loop.step_loop`: the host one step ahead, NaN
checks, progress, metrics log and TensorBoard, profiler window), checkpoints (sharded,
atomic, verified; ``resume="auto"`` continues from the newest intact one, the model and
optimizer restored in place) and SIGTERM / SIGINT handling (the step in flight finishes,
is saved, and the run returns; `gtp_jax.train.lifecycle.preempt`)::

    model = gtp_jax.shard(MyModel(rngs=nnx.Rngs(0)), mesh)
    result = gtp_jax.train.fit(model, optax.adamw(1e-3), batches, steps=1000,
                               checkpoint=CheckpointConfig("ck", every=100, resume="auto"))

A resumed `fit` continues from the checkpoint's step: it draws and discards that many
batches from `batches` first, so `batches` must yield the same batches in the same order
each time it is iterated (a seeded loader, a list).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import gtp_jax
from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.base.metadata import LOGICAL_SHAPE
from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig, Checkpointer
from gtp_jax.train.lifecycle.preempt import RunStopped, StopRequest, stop_on_signals
from gtp_jax.train.lifecycle.resume import (
    StartOver,
    drop_finished,
    intact_candidates,
    restore_newest,
)
from gtp_jax.train.loop import (
    LoopSpec,
    OnStep,
    _global_batch,
    open_run_dirs,
    optimizer_bytes,
    step_loop,
    train_result,
)
from gtp_jax.train.outputs.metrics_log import MetricsLog
from gtp_jax.train.outputs.observe import ObserveConfig, StepProfiler, write_json
from gtp_jax.train.outputs.report import TrainResult
from gtp_jax.train.step.train_step import TrainStep, make_nnx_optimizer, replicate_stray_leaves
from gtp_jax.train.user_model import LossFn, next_token_loss


def fit(model: nnx.Module, optimizer: nnx.Optimizer | optax.GradientTransformation,
        batches: Iterable[Any], *, steps: int, loss_fn: LossFn | None = None,
        checkpoint: CheckpointConfig | None = None, observe: ObserveConfig | None = None,
        on_step: OnStep | None = None, progress: bool = True, grad_accum: int = 1,
        has_aux: bool = False, handle_signals: bool = True) -> TrainResult:
    """Trains `model` for `steps` optimizer steps on `batches`, with the trainer's
    checkpoints, resume, SIGTERM handling and metrics.

    Args:
      model: the module to train: a `gtp_jax.ShardedModule` (``gtp_jax.shard``) or any
        ``nnx.Module``; trained in place (it holds the trained state when `fit` returns).
      optimizer: an ``nnx.Optimizer`` of `model` (``wrt=nnx.Param``), or an optax
        transformation, from which one is built (its state sharded like the weights).
      batches: one batch per step, in order: an array or a pytree of arrays whose leading
        dim is the batch (e.g. tokens ``int32[batch, seq + 1]``, or ``(x, y)``), placed
        split over the model's data axes (host arrays are copied; in a run of several
        processes every process passes the same global batches). It must hold at least
        `steps` batches, and yield the same ones each time it is iterated (a resumed run
        skips the ones trained).
      steps: the last step (a resumed run trains the steps after its checkpoint's).
      loss_fn: ``loss_fn(model, batch) -> float scalar``; None: `next_token_loss` (the
        model's logits for ``batch[:, :-1]`` against ``batch[:, 1:]``). With `has_aux`:
        ``(loss, {name: metric})``.
      checkpoint: where and how often to save (`CheckpointConfig`; ``resume="auto"``
        continues from the newest intact checkpoint there, or starts); the last step is
        always saved. None: no checkpoints.
      observe: metrics log and TensorBoard (``log_dir``), a profiler trace, a metrics JSON
        file (`ObserveConfig`); None: none.
      on_step: called after each step with (step, loss, step seconds).
      progress: show a progress bar (process 0).
      grad_accum: microbatches per step (`TrainStep`).
      has_aux: `loss_fn` returns ``(loss, aux)`` (`TrainStep`).
      handle_signals: while `fit` runs, SIGTERM / SIGINT stop the run after the step in
        flight, which is checkpointed (the result's ``stopped_by`` names the signal); a
        second signal exits at once (`gtp_jax.train.lifecycle.preempt.stop_on_signals`).

    Returns:
      A `TrainResult` of the steps run here: losses, step times, the checkpoints written,
      ``stopped_by`` when a signal stopped it. Its ``tokens_per_step`` is ``batch *
      (seq - 1)`` for integer token batches ``[batch, seq]``, else the leading dim (examples).

    Raises:
      RunFinished: the newest checkpoint is at `steps` already (nothing trained).
      RunStopped: a signal arrived before the first step (nothing trained).
      UsageError: bad arguments, a checkpoint that does not fit `model` / `optimizer` or was
        not written by a training loop, `batches` that run out before `steps` (all before
        anything changes, except running out, found when it happens).
    """
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise UsageError(f"fit: steps={steps!r} must be an int >= 1.")
    if not isinstance(model, nnx.Module):
        raise UsageTypeError(f"fit: model={type(model).__name__} must be a flax.nnx.Module.")
    if not isinstance(batches, Iterable) or isinstance(batches, (str, bytes)):
        raise UsageTypeError(f"fit: batches={type(batches).__name__} must be an iterable of "
                             "batches (a list, a generator, a data loader).")
    if hasattr(batches, "__len__") and len(batches) < steps:
        raise UsageError(f"fit: batches holds {len(batches)} batches, fewer than steps="
                         f"{steps}; pass at least one batch per step.")
    if loss_fn is not None and not callable(loss_fn):
        raise UsageTypeError(f"fit: loss_fn={loss_fn!r} must be callable "
                             "(loss_fn(model, batch) -> scalar).")
    if checkpoint is not None and not isinstance(checkpoint, CheckpointConfig):
        raise UsageTypeError(f"fit: checkpoint={checkpoint!r} must be a CheckpointConfig, "
                             "e.g. CheckpointConfig('ck', every=100, resume='auto').")
    observe = ObserveConfig() if observe is None else observe
    if not isinstance(observe, ObserveConfig):
        raise UsageTypeError(f"fit: observe={observe!r} must be an ObserveConfig.")
    if not isinstance(optimizer, (nnx.Optimizer, optax.GradientTransformation)):
        raise UsageTypeError(f"fit: optimizer={type(optimizer).__name__} must be an "
                             "nnx.Optimizer of the model or an optax transformation "
                             "(e.g. optax.adamw(1e-3)).")
    with contextlib.ExitStack() as stack:
        stop = stack.enter_context(stop_on_signals()) if handle_signals else None
        ckpt = stack.enter_context(open_run_dirs(checkpoint, observe))
        return _fit(model, optimizer, batches, steps=int(steps),
                    loss_fn=next_token_loss if loss_fn is None else loss_fn, ckpt=ckpt,
                    observe=observe, on_step=on_step, progress=progress,
                    grad_accum=grad_accum, has_aux=has_aux, stop=stop)


def _fit(model: nnx.Module, optimizer: nnx.Optimizer | optax.GradientTransformation,
         batches: Iterable[Any], *, steps: int,
         loss_fn: LossFn, ckpt: Checkpointer | None, observe: ObserveConfig,
         on_step: OnStep | None, progress: bool, grad_accum: int, has_aux: bool,
         stop: StopRequest | None) -> TrainResult:
    start = 0
    if ckpt is not None:
        directory = ckpt.config.directory

        def past_the_end(meta: dict[str, Any], steps_left: bool) -> None:
            if steps_left:
                raise UsageError(
                    f"fit: the checkpoint in {directory!r} is at step {meta['step']}, past "
                    f"steps={steps}; pass a larger steps to continue it.")

        candidates = intact_candidates(ckpt)
        candidates = drop_finished(ckpt, candidates, steps, past_the_end) if candidates else []
        if candidates:  # before the optimizer is built (with master weights it casts the model)
            _check_position(candidates[0][1], directory)
        optimizer = _as_optimizer(model, optimizer)
        try:
            _, start = restore_newest(ckpt, candidates, model, optimizer,
                                      check=lambda meta: _check_position(meta, directory))
        except StartOver:  # every checkpoint was damaged and is renamed aside: a new run
            start = 0
        if start and jax.process_index() == 0:
            print(f"gtp_jax fit: resumed from step {start} in {directory} (of {steps})",
                  flush=True)
    else:
        optimizer = _as_optimizer(model, optimizer)
    window = observe.profile_window(start + 1, steps)
    if stop is not None and stop.agreed(start):  # no step started: nothing to save
        raise RunStopped(stop.name, "preparing the run", start)
    source = _Batches(batches, start, steps)
    mesh = getattr(model, "mesh", None)
    step_fn = TrainStep(model, optimizer, loss_fn, grad_accum=grad_accum, has_aux=has_aux)
    profiler = StepProfiler(observe.profile_dir, window) if window is not None else None
    num_params = _num_params(model)
    log = None
    if observe.log_dir is not None and jax.process_index() == 0:
        log = MetricsLog(observe.log_dir, log_every=observe.log_every, last_step=steps,
                         start=start, checkpoint_dir=ckpt.config.directory if ckpt else None)
    loop = LoopSpec(steps=steps, tokens_per_step=source.tokens_per_step, extra={},
                    place=_placer(mesh))
    try:
        losses, times, saved, _, step_fn, _, compiled = step_loop(
            loop, step_fn, source, start=start, ckpt=ckpt, profiler=profiler,
            on_step=on_step, progress=progress, stop=stop, log=log,
            log_every=observe.log_every, aux=has_aux)
    finally:
        if profiler is not None:
            profiler.stop()
        if log is not None:
            log.close()
    step_fn.sync()
    result = train_result(
        model, optimizer, replicated=optimizer_bytes(model, optimizer.tx),
        num_params=num_params, flops_per_token=6.0 * num_params,
        tokens_per_step=source.tokens_per_step, compute_dtype="", losses=losses,
        times=times, first_step=start + 1, saved=saved, ckpt=ckpt, window=window,
        trace=profiler.trace_path if profiler is not None else None, compiled=compiled)
    if start + len(losses) < steps:  # the loop returned early: a stop request
        result.stopped_by = stop.name
    if observe.log_dir is not None and jax.process_index() == 0:
        result.log_dir = os.path.abspath(observe.log_dir)
    if observe.metrics_json is not None and jax.process_index() == 0:
        write_json(observe.metrics_json, {
            "steps": [{"step": result.first_step + i, "loss": loss, "step_time_s": t}
                      for i, (loss, t) in enumerate(zip(result.losses, result.step_times))],
            "summary": result.to_json()})
    return result


class _Batches:
    """The step loop's batcher over a user's iterable: ``next_batch()`` and the position
    (batches drawn) that checkpoints record; the first `start` batches are skipped."""

    def __init__(self, batches: Iterable[Any], start: int, steps: int):
        self._it: Iterator[Any] = iter(batches)
        self._steps = steps
        self.position = 0
        self._first = None
        for _ in range(start):
            self._draw()
        if start < steps:
            self._first = self._draw()
        self.tokens_per_step = _tokens(self._first)

    def _draw(self) -> Any:
        try:
            batch = next(self._it)
        except StopIteration:
            raise UsageError(f"fit: batches ran out after {self.position} batches, before "
                             f"steps={self._steps}; pass at least one batch per step.") from None
        self.position += 1
        return batch

    def next_batch(self) -> Any:
        if self._first is not None:
            batch, self._first = self._first, None
            return batch
        return self._draw()

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}


def _tokens(batch: Any) -> int:
    """Tokens a step trains on: ``batch * (seq - 1)`` for integer tokens ``[batch, seq]``
    (the next-token loss), else the leading dim of the first array (examples); 1 if none."""
    leaves = [x for x in jax.tree.leaves(batch) if np.ndim(x) > 0]
    if not leaves:
        return 1
    first = leaves[0]
    if len(leaves) == 1 and np.ndim(first) == 2 and np.issubdtype(first.dtype, np.integer):
        return int(first.shape[0]) * max(1, int(first.shape[1]) - 1)
    return int(np.shape(first)[0])


def _check_position(meta: dict[str, Any], directory: str) -> None:
    """A checkpoint `fit` can continue: one written by a training loop, whose data position
    is its step."""
    data = (meta.get("extra") or {}).get("data")
    if not isinstance(data, dict) or data.get("position") != meta.get("step"):
        raise UsageError(
            f"fit: the checkpoint in {directory!r} (step {meta.get('step')}) records no data "
            "position at its step, so the batches to continue with are unknown; it was not "
            "written by fit or python -m gtp_jax train. Use another CheckpointConfig.directory.")


def _as_optimizer(model: nnx.Module,
                  optimizer: nnx.Optimizer | optax.GradientTransformation) -> nnx.Optimizer:
    if isinstance(optimizer, nnx.Optimizer):
        return optimizer
    built = make_nnx_optimizer(model, optimizer, wrt=nnx.Param)
    mesh = getattr(model, "mesh", None)
    if mesh is not None:
        replicate_stray_leaves(built, mesh)
    return built


def _placer(mesh: jax.sharding.Mesh | None) -> Callable[[Any], Any]:
    """Host batch -> the step's input: on a sharded model's mesh, each array split on its
    leading dim over the data axes (arrays already placed there are left as they are)."""
    if mesh is None:
        return lambda batch: batch

    def leaf(x: Any) -> Any:
        if np.ndim(x) == 0:
            return x
        if isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.NamedSharding) \
                and x.sharding.mesh == mesh:
            return x
        return _global_batch(x if isinstance(x, jax.Array) else np.asarray(x),
                             gtp_jax.data_sharding(mesh, np.ndim(x)))

    return lambda batch: jax.tree.map(leaf, batch)


def _num_params(model: nnx.Module) -> int:
    """Parameter elements of `model`, unsharded (the logical shapes `gtp_jax.shard`
    records)."""
    total = 0
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var.get_metadata().get(LOGICAL_SHAPE, var.get_value().shape)
        total += int(np.prod(shape))
    return total


__all__ = ["fit"]
