"""The main job: train a preset transformer, or a user's model (`TrainConfig.model`,
`gtp_jax.train.user_model`), with GTP on the bundled byte corpus or a user's tokenized text
(`gtp_jax.train.data_source`). `step_loop` is the step loop `gtp_jax.train.fit` shares.

`train` checks its input, then runs a short sequence of steps: pick the checkpoint to resume
from, build the model and optimizer once (and restore into them), run the step loop
(checkpointing as it goes), and report. Optional extras, each off by default: sharded
checkpoints with exact resume (`gtp_jax.train.lifecycle.checkpoint`), multi-process runs
(`gtp_jax.train.processes.distributed`; the batch placement below works for any process count),
profiler traces, MFU/memory reporting and JSON metrics (`gtp_jax.train.outputs.observe`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import gtp_jax
from gtp_jax.base.compile_watch import CompileReport, measure_compile
from gtp_jax.base.errors import UsageError
from gtp_jax.base.mesh import data_size
from gtp_jax.base.metadata import LOGICAL_SHAPE
from gtp_jax.data import RowBatch, TextData
from gtp_jax.models import (
    Transformer,
    TransformerConfig,
    from_hf,
    lm_loss,
    lm_loss_and_metrics,
    to_hf,
)
from gtp_jax.train.config import (
    Run,
    TrainConfig,
    check_devices,
    make_optimizer,
    model_json,
    resolve,
)
from gtp_jax.train.data_source import DataSource
from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig, Checkpointer, DirectoryLock
from gtp_jax.train.lifecycle.ntp import NonuniformStep, Recovery, SimulatedFailure, check_failure
from gtp_jax.train.lifecycle.preempt import RunStopped, StopRequest
from gtp_jax.train.lifecycle.resume import (
    RunFinished,
    StartOver,
    check_resume,
    note,
    restore_newest,
    select_candidates,
)
from gtp_jax.train.lifecycle.warm_start import check_init_from, load_weights
from gtp_jax.train.outputs.metrics_log import (
    MetricsLog,
    aux_metrics,
    claim_log_dir,
    open_metrics_log,
    step_extras,
)
from gtp_jax.train.outputs.observe import (
    DeviceMemoryError,
    ObserveConfig,
    StepProfiler,
    check_writable_dir,
    check_writable_file,
    memory_per_device,
    peak_flops,
    write_json,
)
from gtp_jax.train.outputs.progress import ProgressBar
from gtp_jax.train.outputs.report import TrainResult
from gtp_jax.train.step.memory import check_memory_fits, memory_advice, memory_bound, memory_parts
from gtp_jax.train.step.train_step import TrainStep, make_nnx_optimizer, replicate_stray_leaves
from gtp_jax.train.user_model import UserModel

OnStep = Callable[[int, float, float], None]
OnStart = Callable[[TrainConfig, TransformerConfig], None]


def train(cfg: TrainConfig, *, on_step: OnStep | None = None,
          progress: bool = True, checkpoint: CheckpointConfig | None = None,
          observe: ObserveConfig | None = None,
          failure: SimulatedFailure | None = None,
          on_start: OnStart | None = None, data: TextData | None = None,
          stop: StopRequest | None = None) -> TrainResult:
    """Trains `cfg.preset` (or the module of `cfg.model`'s factory) with GTP on the mesh
    ``(dp, ep, gtp, tp)`` over all devices.

    Everything that depends on the caller's input is checked before the model is built:
    the mesh against the device count, the memory bound per device against the
    device's limit, that the checkpoint / profile / metrics paths can be written, the
    checkpoint and log directories' locks (a log directory holding another run's metrics
    is refused), and on resume that the checkpoint belongs to this run.

    Args:
      cfg: the run.
      on_step: called after each step with (step, loss, step seconds); on every process.
        Steps are dispatched one ahead of the host (see `step_loop`), so it runs while
        the next step computes.
      on_start: called once with the run's resolved config (its "auto" fields set, and a
        resumed run's saved values adopted) and model config, once the model is built
        (before it is restored or trained).
      progress: show a progress bar (process 0 only).
      checkpoint: save checkpoints (and with ``resume=True`` continue from the newest
        intact one: same parameters, optimizer state and LR-schedule position, data order
        and step count, so the loss curve continues exactly as the uninterrupted run's; the
        mesh may differ from the saving run's). A larger `cfg.steps` than the saved run's
        extends it (see `TrainConfig.schedule_steps`). Damaged checkpoints are skipped with
        a one-line note on stderr and renamed ``broken-<step>-<n>`` when newer than the
        one resumed from (so their steps can be saved again); nothing is deleted. With
        ``resume="auto"`` and no intact checkpoint, every one is renamed so and the run
        starts over from step 0 (one line on stderr says so).
      observe: profiler trace window and JSON metrics file.
      failure: simulate losing devices after a step and keep training with nonuniform
        tensor parallelism (`gtp_jax.train.lifecycle.ntp`); validated before anything is built.
      data: train on this text (tokenized once into a token file beside it, packed into
        rows of ``seq_len + 1`` tokens, each process reading only its own rows); the model's
        vocabulary is the tokenizer's (unless `cfg.vocab_size` is set, at least as large).
        None: the bundled byte corpus. A resumed run must use the same data and tokenizer.
      stop: checked after each step is dispatched, once the step before it is done
        (`gtp_jax.train.lifecycle.preempt`; the command line sets it on SIGTERM / SIGINT):
        once requested (on any process), the run finishes the step just dispatched (at most
        two steps after the request), checkpoints it (with `checkpoint`) and returns a
        result whose ``stopped_by`` names the cause; ``cfg.export_hf`` is not written (the
        model is not the run's result). Requested before the first step (while the data is
        tokenized or the model built), the run raises `RunStopped` at once.

    Returns:
      A `TrainResult` with per-step losses (float32 scalars), timings and, with
      ``cfg.eval_every``, held-out losses.

    Raises:
      RunFinished: on resume, the run already trained ``cfg.steps`` steps (nothing was
        built or changed; not an error).
      UsageError: bad mesh, memory bound over the device limit, unwritable paths, a
        locked directory, a log directory holding another run's metrics, no intact
        checkpoint or a checkpoint of another run (all raised
        before any model is built), a profile window outside the run; out of device memory.
      FloatingPointError: the loss or the state to save became NaN/inf (the last finite
        checkpoint is kept).
      RunStopped: `stop` was requested before the first step; nothing was trained.
    """
    observe = ObserveConfig() if observe is None else observe
    auto = cfg.auto_fields  # a resumed run keeps its saved values for these
    source = DataSource.check(data)
    if cfg.vocab_size is None and data is not None:
        cfg = dataclasses.replace(cfg, vocab_size=source.vocab_size)
    elif cfg.vocab_size is not None and cfg.vocab_size < source.vocab_size:
        raise UsageError(f"TrainConfig.vocab_size={cfg.vocab_size} is smaller than the data's "
                         f"{source.vocab_size} token ids; leave it None (the data's) or raise "
                         "it.")
    if cfg.grad_accum > 1 and failure is not None:
        raise UsageError("TrainConfig.grad_accum with a SimulatedFailure: the nonuniform step "
                         "does not accumulate microbatches; use grad_accum=1.")
    if cfg.offload_optimizer and failure is not None:
        # The nonuniform step updates a device-resident state with its own program.
        raise UsageError("TrainConfig.offload_optimizer with a SimulatedFailure: the "
                         "nonuniform step keeps the optimizer state in device memory; drop "
                         "one of them.")
    if cfg.model is not None and failure is not None:
        raise UsageError("TrainConfig.model with a SimulatedFailure: training on through a "
                         "device failure re-lays out the bundled decoder only; drop one of "
                         "them.")
    if cfg.eval_every and failure is not None:
        raise UsageError("TrainConfig.eval_every with a SimulatedFailure: the held-out loss is "
                         "not computed on the nonuniform layout; drop one of them.")
    # Resolved once: everything below reads this run (a resume adopting a saved run's
    # settings resolves the adopted config once more, in _train).
    resolved = resolve(cfg)
    check_devices(resolved)
    check_failure(resolved, failure)
    check_memory_fits(resolved)
    # Checked before training (by every process, which then agree): a run never trains and
    # then fails to write its export.
    check_output_paths(None, None, cfg.export_hf)
    with open_run_dirs(checkpoint, observe) as ckpt:
        run = functools.partial(_train, resolved, on_step=on_step, progress=progress, ckpt=ckpt,
                                observe=observe, failure=failure, auto=auto,
                                on_start=on_start, source=source, stop=stop)
        try:
            return run()
        except StartOver:
            pass  # every checkpoint was damaged and is renamed aside: a new run
        gc.collect()  # the first attempt's model and optimizer, before the next ones
        return run()


def check_output_paths(checkpoint: CheckpointConfig | None, observe: ObserveConfig | None,
                       export_hf: str | None = None) -> None:
    """Raises `UsageError` (naming the setting) unless every folder and file the run writes
    can be written: the checkpoint directory (every process), the export (every process,
    which must agree; process 0 writes it) and, on process 0, the profile and log
    directories and the metrics file. Creates nothing."""
    if checkpoint is not None:
        check_writable_dir(checkpoint.directory, "CheckpointConfig.directory")
    if export_hf is not None:
        check_writable_dir(export_hf, "TrainConfig.export_hf")
    if observe is not None and jax.process_index() == 0:
        if observe.profile_dir is not None:
            check_writable_dir(observe.profile_dir, "ObserveConfig.profile_dir")
        if observe.metrics_json is not None:
            check_writable_file(observe.metrics_json, "ObserveConfig.metrics_json")
        if observe.log_dir is not None:
            check_writable_dir(observe.log_dir, "ObserveConfig.log_dir")


@contextlib.contextmanager
def open_run_dirs(checkpoint: CheckpointConfig | None,
                  observe: ObserveConfig) -> Iterator[Checkpointer | None]:
    """The run's `Checkpointer` (None without `checkpoint`), once its directories are
    checked and claimed: the checkpoint, profile and log directories and the metrics file
    writable, the checkpoint directory locked (`DirectoryLock`) and the log directory
    claimed for this run (`claim_log_dir`). On exit, pending saves are finished (also when
    training failed) and the locks released.

    Raises:
      UsageError: an unwritable path, a locked directory, a log directory of another run.
    """
    primary = jax.process_index() == 0
    check_output_paths(checkpoint, observe)
    lock = log_lock = None
    if checkpoint is not None and primary and "://" not in checkpoint.directory:
        lock = DirectoryLock(checkpoint.directory)
        lock.acquire()
    try:
        if observe.log_dir is not None and primary:
            log_lock = claim_log_dir(
                observe.log_dir, checkpoint.directory if checkpoint is not None else None,
                resume=checkpoint.resume if checkpoint is not None else False)
        ckpt = Checkpointer(checkpoint) if checkpoint is not None else None
        if ckpt is not None and ckpt.foreign_folders():  # said once, not per attempt
            note(f"left {', '.join(ckpt.foreign_folders())} alone in the checkpoint "
                 "directory: folders that hold no checkpoint (no save wrote them)")
        try:
            yield ckpt
        finally:
            if ckpt is not None:
                # Finishes (finalizes) a pending asynchronous save, also when training failed.
                ckpt.close()
    finally:
        if log_lock is not None:
            log_lock.release()
        if lock is not None:
            lock.release()


def check_save_folders(ckpt: Checkpointer, start: int, steps: int) -> None:
    """Refuses a run that would save a checkpoint where a folder of the user's is (a step
    folder no save wrote, which the checkpointer leaves alone), before it trains."""
    every = ckpt.config.every
    for folder in ckpt.foreign_folders():
        step = int(os.path.basename(folder))
        if start < step <= steps and (step == steps or (every and step % every == 0)):
            raise UsageError(
                f"CheckpointConfig.directory: {folder} is a folder that holds no checkpoint "
                f"(not written by gtp_jax, left alone), and this run saves step {step} "
                "there; move or rename that folder, or choose another "
                "CheckpointConfig.directory.")


def build_model_and_optimizer(run: TrainConfig | Run
                              ) -> tuple[gtp_jax.ShardedModule, nnx.Optimizer]:
    """The GTP-sharded model (initialized from ``cfg.seed``: the preset's decoder, or with
    `TrainConfig.model` the module of the user's factory) and its AdamW optimizer, on the
    mesh ``make_mesh(dp, gtp, tp, ep)`` over all devices: what `train` starts from (and
    what a checkpoint is restored into: an offloaded optimizer's state is built, and so
    restored, in host memory). A `TrainConfig` is resolved first (`resolve`)."""
    run = resolve(run)
    cfg = run.config
    mesh = gtp_jax.make_mesh(dp=cfg.dp, gtp=cfg.gtp, tp=cfg.tp, ep=cfg.ep, cp=cfg.cp)
    if cfg.init_from_hf is not None:  # each device's shard read from the files
        model = from_hf(cfg.init_from_hf, mesh=mesh, gtp_config=run.gtp, config=run.model)
    elif isinstance(run.model, UserModel):  # the user's factory, built in place as well
        user = run.model
        model = gtp_jax.shard_init(lambda: user.build(nnx.Rngs(cfg.seed)), mesh, run.gtp)
    else:
        # Built in place: each device creates only its own shards (no whole-model peak).
        model = gtp_jax.shard_init(lambda: Transformer(run.model, rngs=nnx.Rngs(cfg.seed)),
                                   mesh, run.gtp)
    # Offloaded (cfg.offload_optimizer): the state is built in host memory directly.
    optimizer = make_nnx_optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
    replicate_stray_leaves(optimizer, mesh)
    return model, optimizer


def replicated_bytes(model: nnx.Module, cfg: TrainConfig) -> tuple[int, int]:
    """Bytes of the parameters, and of parameters plus optimizer state, without sharding:
    from the logical (unpadded, unsplit) shapes `gtp_jax.shard` records on the sharded
    weights, and the optimizer's state for those shapes (``jax.eval_shape``: nothing is
    allocated). With `TrainConfig.offload_master_weights` the parameters count as the
    float32 ones a run without it holds."""
    return optimizer_bytes(model, make_optimizer(cfg), float32=cfg.offload_master_weights)


def optimizer_bytes(model: nnx.Module, tx: Any, *, float32: bool = False) -> tuple[int, int]:
    """`replicated_bytes` for the optax transformation `tx` (`float32`: count the parameters
    as float32)."""
    params = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        shape = var.get_metadata().get(LOGICAL_SHAPE, value.shape)
        dtype = jnp.float32 if float32 else value.dtype
        params[path] = jax.ShapeDtypeStruct(tuple(shape), dtype)
    param_bytes = _tree_bytes(params)
    return param_bytes, param_bytes + _tree_bytes(jax.eval_shape(tx.init, params))


def _train(run: Run, *, on_step: OnStep | None, progress: bool,
           ckpt: Checkpointer | None, observe: ObserveConfig,
           failure: SimulatedFailure | None = None,
           auto: frozenset[str] = frozenset(),
           on_start: OnStart | None = None, source: DataSource | None = None,
           stop: StopRequest | None = None) -> TrainResult:
    source = DataSource.check(None) if source is None else source
    run, candidates = select_candidates(run, ckpt, auto=auto,
                                        source=source.fingerprint() if ckpt else None,
                                        keep_finished=run.config.export_hf is not None)
    if candidates and candidates[0][0] == run.config.steps:
        # A finished run re-launched with an export asked for: its final checkpoint (verified
        # and checked above) is written out; nothing is trained.
        model, optimizer = build_model_and_optimizer(run)
        _, step = restore_newest(ckpt, candidates, model, optimizer)
        if step != run.config.steps:  # the final one failed its checksums on restore
            raise UsageError(f"the final checkpoint in {ckpt.config.directory!r} could not be "
                             f"restored to export it (restored step {step}); see above.")
        to_hf(model, run.config.export_hf)
        raise RunFinished(ckpt.config.directory, step, os.path.abspath(run.config.export_hf))
    # Recorded explicitly in checkpoints, so extending the run keeps this schedule (its
    # length and warm-up change nothing that was resolved).
    run = dataclasses.replace(run, config=run.config.with_schedule())
    cfg, model_cfg = run.config, run.model
    if ckpt is not None:
        check_save_folders(ckpt, candidates[0][0] if candidates else 0, cfg.steps)
    # A warm start applies to a new run only; a resumed one continues its own weights.
    warm = check_init_from(cfg, model_cfg) if cfg.init_from and not candidates else None
    failure_plan = check_failure(run, failure, start=candidates[0][0] if candidates else 0)

    def interrupt(during: str, step: int) -> None:
        if stop is not None and stop.requested:
            raise RunStopped(stop.name, during, step)

    source.open(progress=progress, interrupt=functools.partial(
        interrupt, "tokenizing the data", candidates[0][0] if candidates else 0))
    held_out = (source.eval_batches(cfg.batch_size, cfg.seq_len, cfg.eval_batches)
                if cfg.eval_every else None)
    window = observe.profile_window((candidates[0][0] if candidates else 0) + 1, cfg.steps)
    # Building shards the model, which refuses what the mesh cannot run (e.g. FP8 compute
    # with tp > 1): the run is announced only once that passed.
    model, optimizer = build_model_and_optimizer(run)
    # Validation: nothing below this line fails on user input before training starts.
    if on_start is not None:
        on_start(cfg, model_cfg)
    meta, start = restore_newest(
        ckpt, candidates, model, optimizer,
        check=lambda meta: check_resume(cfg, model_cfg, meta, ckpt.config.directory,
                                        source=source.record))
    if warm is not None:
        load_weights(cfg, warm, model)
    if meta is not None and jax.process_index() == 0:
        print(f"gtp_jax train: resumed from {os.path.join(ckpt.config.directory, str(start))} "
              f"(step {start} of {cfg.steps})", flush=True)
        _note_other_draws(meta, model)
    if stop is not None and stop.agreed(start):  # no step started: nothing to save
        raise RunStopped(stop.name, "preparing the run", start)
    batcher = source.batcher(cfg.batch_size, cfg.seq_len, cfg.seed,
                             meta["extra"]["data"] if meta is not None else None)
    user = isinstance(model_cfg, UserModel)
    loss_fn = (model_cfg.loss_fn if user
               else functools.partial(lm_loss, aux_weight=model_cfg.moe_aux_weight))
    # A mixture of experts reports the routing its capacity dropped beside the loss (the
    # nonuniform step after a failure takes the plain loss).
    moe_metrics = not user and bool(model_cfg.moe_experts) and failure_plan is None
    step_fn = TrainStep(model, optimizer,
                        functools.partial(lm_loss_and_metrics,
                                          aux_weight=model_cfg.moe_aux_weight)
                        if moe_metrics else loss_fn, grad_accum=cfg.grad_accum,
                        has_aux=moe_metrics)
    _print_init_memory()
    profiler = StepProfiler(observe.profile_dir, window) if window is not None else None
    log = (open_metrics_log(observe, cfg, model_cfg, start=start,
                            checkpoint_dir=ckpt.config.directory if ckpt is not None else None)
           if jax.process_index() == 0 else None)
    switch = None
    if failure_plan is not None:
        def switch(state: Any, original: gtp_jax.ShardedModule = model
                   ) -> tuple[NonuniformStep, Recovery]:
            return NonuniformStep.recover(run, failure_plan, state, loss_fn, failure=failure,
                                          original=original)
    placement = gtp_jax.data_sharding(model.mesh)
    loop = LoopSpec(
        steps=cfg.steps, tokens_per_step=cfg.batch_size * cfg.seq_len,
        extra={"train_config": dataclasses.asdict(cfg), "model_config": model_json(model_cfg),
               "data_source": source.record},
        place=functools.partial(_global_batch, sharding=placement),
        eval_every=cfg.eval_every, eval_loss=loss_fn if user else lm_loss,
        nan_advice=f"lower TrainConfig.lr (now {cfg.lr})", run=run)
    try:
        losses, times, saved, recovery, step_fn, val_losses, compiled = step_loop(
            loop, step_fn, batcher, start=start, ckpt=ckpt, profiler=profiler,
            on_step=on_step, progress=progress, failure_step=failure.step if switch else None,
            switch=switch, held_out=held_out, stop=stop, log=log,
            log_every=observe.log_every)
    finally:
        if profiler is not None:
            profiler.stop()
        if log is not None:
            log.close()
    step_fn.sync()
    model, optimizer = step_fn.objects
    finished = start + len(losses) == cfg.steps
    if cfg.export_hf is not None and finished:  # a stopped run's model is not the result
        to_hf(model, cfg.export_hf)
    result = train_result(
        model, optimizer, replicated=replicated_bytes(model, cfg),
        num_params=model_cfg.num_params(),
        flops_per_token=model_cfg.train_flops_per_token(cfg.seq_len),
        tokens_per_step=cfg.batch_size * cfg.seq_len, compute_dtype=cfg.dtype,
        losses=losses, times=times, first_step=start + 1, saved=saved, ckpt=ckpt,
        window=window, trace=profiler.trace_path if profiler is not None else None,
        recovery=recovery, val_losses=val_losses, compiled=compiled)
    if not finished:  # the loop returned early: a stop request
        result.stopped_by = stop.name
    elif cfg.export_hf is not None:
        result.export_hf = os.path.abspath(cfg.export_hf)
    if observe.log_dir is not None and jax.process_index() == 0:
        result.log_dir = os.path.abspath(observe.log_dir)
    if observe.metrics_json is not None and jax.process_index() == 0:
        _write_metrics(observe.metrics_json, cfg, model_cfg, result)
    return result


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """What `step_loop` needs to know of a run (`train`'s, or `gtp_jax.train.fit`'s).

    Attributes:
      steps: the last step to train.
      tokens_per_step: tokens (or examples) of one step, for tokens/s.
      extra: what each checkpoint records beside the data position (``"data"``) and the
        step's loss (``"loss"``), JSON values.
      place: the host batch (what the batcher returns) -> the step's input on the devices.
      eval_every: the held-out loss after every `eval_every` steps and the last; 0: never.
      eval_loss: the loss of a held-out batch (``loss_fn(model, batch)``).
      nan_advice: what the error of a NaN/inf loss advises.
      run: the resolved run (`train`): its memory bound for the out-of-memory error and its
        model for the MoE routing metric; None for `fit`.
    """

    steps: int
    tokens_per_step: int
    extra: dict[str, Any]
    place: Callable[[Any], Any]
    eval_every: int = 0
    eval_loss: Callable[..., Any] | None = None
    nan_advice: str = "lower the learning rate"
    run: Run | None = None


def step_loop(loop: LoopSpec, step_fn: TrainStep, batcher: Any, *, start: int,
              ckpt: Checkpointer | None, profiler: StepProfiler | None, on_step: OnStep | None,
              progress: bool, failure_step: int | None = None,
              switch: Callable[[Any], tuple[NonuniformStep, Recovery]] | None = None,
              held_out: list[Any] | None = None, stop: StopRequest | None = None,
              log: MetricsLog | None = None, log_every: int = 5, aux: bool = False,
              ) -> tuple[list[float], list[float], list[int], Recovery | None, Any,
                         dict[int, float], CompileReport | None]:
    """Steps ``start + 1 .. loop.steps``: (losses, step seconds, checkpointed steps, the
    recovery from a simulated failure or None, the step function in use at the end, the
    held-out loss after each evaluated step, the step's compile).

    The step is compiled before its first run (`_compile_step`; with `progress`, process 0
    says so before and after), so the first step's time is its run alone.

    `batcher` gives each step's host batch (``next_batch()``) and the data position after
    it (``state_dict()``, saved in checkpoints as ``extra["data"]``).

    With `held_out` batches and ``loop.eval_every``, the model's mean ``loop.eval_loss``
    over them is computed after every ``loop.eval_every``-th step and the last one (the host
    waits for those steps, as for a checkpoint).

    The host stays one step ahead of the devices: it dispatches step ``s``, waits for step
    ``s - 1``'s loss (for the NaN check, the progress bar and `on_step`), checks for a stop
    request, and builds step ``s + 1``'s batch and copies it to the devices while step ``s``
    runs. So the devices never wait for the host between steps. The host waits for the step
    in flight only where it must: at a checkpoint (the state is donated to the next step),
    at the simulated failure, at the ends of the profiler window and after the last step.
    A step's time is the interval between the completions of consecutive steps (the first
    one's includes compiling).

    With `aux` (a loss function's own metrics, `TrainStep(has_aux=True)`), each logged step's
    scalar metrics besides the loss, ``grad_norm`` and ``lr`` go to the progress line and
    the metrics log too.

    Every `log_every`-th step, the last one and evaluated ones are logged: the progress line
    on a non-terminal (with grad norm and LR) and a record in `log`, flushed at once; the
    first step run here is logged too, with the compile's time and the time to that step.

    After step `failure_step`, ``switch(step_fn.state)`` re-plans and re-lays out the state
    (see `gtp_jax.train.lifecycle.ntp`) and the loop continues with the nonuniform step it returns.

    Once ``stop.agreed(step)`` (asked after step ``step`` is dispatched, on every process),
    the loop finishes that step like a checkpoint step (waits, saves with `ckpt`) and
    returns early."""
    run, model_cfg = loop.run, loop.run.model if loop.run is not None else None
    tokens_per_step = loop.tokens_per_step
    bar = (ProgressBar(loop.steps, every=log_every) if progress and jax.process_index() == 0
           else None)
    losses: list[float] = []
    val_losses: dict[int, float] = {}
    placed_held_out: list[jax.Array] = []
    times: list[float] = []
    saved: list[int] = []
    recovery: Recovery | None = None
    last_done = time.perf_counter()

    def next_batch() -> tuple[Any, dict[str, int]]:
        """The next step's tokens on the devices, and the data position after them."""
        batch = batcher.next_batch()
        # The nonuniform step splits the host batch over its replicas itself.
        tokens = np.asarray(batch) if recovery is not None else loop.place(batch)
        return tokens, batcher.state_dict()

    def evaluate() -> float:
        """Mean held-out cross-entropy of the current state (the batches are equal-sized,
        so this is the mean over all their tokens)."""
        if not placed_held_out:
            placed_held_out.extend(loop.place(b) for b in held_out)
        values = [step_fn.evaluate(b, loop.eval_loss, has_aux=False) for b in placed_held_out]
        return float(np.mean([float(v) for v in values]))

    def finish(step: int, metrics: dict[str, jax.Array], *, save: bool = False) -> None:
        """Waits for `step`'s loss; records it and its time, saves the checkpoint of `step`
        when `save`, then reports the step (so a checkpoint exists before `on_step` sees
        its step)."""
        nonlocal last_done
        with _device_memory_errors(run, step):
            loss, now = wait_for_step(metrics)
        times.append(now - last_done)
        last_done = now
        losses.append(loss)
        if not np.isfinite(loss):
            raise FloatingPointError(
                f"loss became {loss} at step {step}; {loop.nan_advice}"
                + (f"; the last checkpoint is step {saved[-1]}" if saved else "") + ".")
        if save:
            # Refuses (NonFiniteStateError) a state with NaN/inf: the loss above was
            # computed before this step's update, the checked state is the one saved.
            step_fn.sync()
            model, optimizer = step_fn.objects
            ckpt.save(step, model, optimizer,
                      extra={**loop.extra, "data": data_state, "loss": loss})
            saved.append(step)
        shown = {}
        if held_out and (step % loop.eval_every == 0 or step == loop.steps):
            val_losses[step] = shown["val_loss"] = evaluate()
        first = compiled is not None and step == start + 1
        logged = bool(shown) or step % log_every == 0 or step == loop.steps or first
        if logged or (bar is not None and bar.tty):
            # Computed by the step that produced the loss: no further wait.
            shown.update(step_extras(metrics, model_cfg))
            if aux:
                shown.update(aux_metrics(metrics))
        if log is not None and logged:
            log.write(step, loss=loss, step_s=times[-1], tokens=tokens_per_step,
                      lr=shown.get("lr"), grad_norm=shown.get("grad_norm"),
                      val_loss=shown.get("val_loss"), moe_dropped=shown.get("dropped"),
                      aux=aux_metrics(metrics) if aux else None,
                      **({"compile_s": compiled.seconds, "compile_cache": compiled.cache,
                          "first_step_s": compiled.seconds + times[-1]} if first else {}))
        if bar is not None:
            bar.update(step, keep="val_loss" in shown, loss=loss, **shown,
                       tok_s=tokens_per_step / times[-1])
        if on_step is not None:
            on_step(step, loss, times[-1])

    pending: tuple[int, dict[str, jax.Array]] | None = None
    ahead = next_batch() if start < loop.steps else None
    compiled: CompileReport | None = None
    if ahead is not None:
        compiled = _compile_step(loop.run, step_fn, ahead[0], start + 1,
                                 say=progress and jax.process_index() == 0)
        last_done = time.perf_counter()  # the first step's time is its run alone
    for step in range(start + 1, loop.steps + 1):
        if profiler is not None and step == profiler.window[0] and pending is not None:
            finish(*pending)  # the trace starts with the device idle
            pending = None
        if profiler is not None:
            profiler.before(step)
        (tokens, data_state), ahead = ahead, None
        if pending is not None and getattr(step_fn, "synchronous", False):
            # A step that returns only when done (the nonuniform step after a failure):
            # the previous step is finished first, so each step's time is its own.
            finish(*pending)
            pending = None
        with jax.profiler.StepTraceAnnotation("train", step_num=step), \
                _device_memory_errors(run, step):
            metrics = step_fn(tokens)
        if pending is not None:
            finish(*pending)  # the previous step, while this one runs
        # The host is one step ahead: a stop requested until now ends the run after this
        # step, so at most two steps run after the request (the one running and this one).
        stopping = stop is not None and step < loop.steps and stop.agreed(step)
        checkpoint = ckpt is not None and (
            step == loop.steps or stopping
            or (ckpt.config.every and step % ckpt.config.every == 0))
        wait = (checkpoint or stopping or step == loop.steps or step == failure_step
                or (profiler is not None and step == profiler.window[1])
                or (held_out is not None and step % loop.eval_every == 0))
        if not wait:
            ahead = next_batch()  # copied while this step runs
        pending = (step, metrics)
        if not wait:
            continue
        finish(*pending, save=checkpoint)
        pending = None
        if profiler is not None:
            profiler.after(step)
        if stopping:
            break
        if step == failure_step:
            step_fn.sync()  # the state in its stored layout (an offloaded one joined)
            step_fn, recovery = switch(step_fn.state)
        if step < loop.steps:
            ahead = next_batch()
    return losses, times, saved, recovery, step_fn, val_losses, compiled


def _compile_step(run: Run | None, step_fn: TrainStep, tokens: Any, step: int, *, say: bool
                  ) -> CompileReport:
    """Compiles the training step for `tokens` before its first run (`TrainStep.compile`),
    timed, with the persistent compilation cache's hit or miss where JAX tells
    (`gtp_jax.base.compile_watch`); with `say`, one line before and one after."""
    if say:
        print("gtp_jax train: compiling the training step ...", flush=True)
    with _device_memory_errors(run, step):
        _, report = measure_compile(lambda: step_fn.compile(tokens))
    if say:
        print(f"gtp_jax train: {report.describe()}", flush=True)
    return report


def _note_other_draws(meta: dict[str, Any], model: nnx.Module) -> None:
    """Says when a resumed run splits its batch over another number of data shards than the
    saved run did and its model draws random numbers (dropout): each data shard draws from
    its own stream, so the draws, and the losses, differ from an uninterrupted run's
    (statistically the same training); everything else continues exactly."""
    saved = meta.get("mesh") or {}
    mesh = getattr(model, "mesh", None)
    if mesh is None or not saved or not nnx.state(model, nnx.RngState):
        return
    before, now = data_size(saved), data_size(mesh)
    if before != now:
        note(f"the batch is split over {now} data shards, the saved run's over {before}: "
             "the model's random draws (dropout) are made per data shard, so from here they "
             "differ from an uninterrupted run's (resume on a mesh with as many data shards "
             "to continue it exactly)")


def wait_for_step(metrics: dict[str, jax.Array],
                  clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """Waits for a dispatched step; returns its loss and the `clock` time its outputs were
    ready.

    The time is taken before the loss is copied to the host: that copy can be queued behind
    the next step's transfers to host memory (an offloaded optimizer state's, dispatched
    while this step ran), so a time taken after it would count each step as done one step
    late, and the last step as taking almost no time (on GPUs a 3-step run's median was
    half the step).

    Args:
      metrics: the step's outputs (`TrainStep.__call__`); ``metrics["loss"]`` a float32
        device scalar.
      clock: seconds (default ``time.perf_counter``).
    """
    jax.block_until_ready(metrics["loss"])
    done = clock()
    return float(metrics["loss"]), done


def _print_init_memory() -> None:
    """Prints the devices' peak and current memory before the first step (what building,
    restoring and placing the model and optimizer took), where the backend keeps allocator
    statistics (GPUs; not the CPU backend). Process 0 only."""
    memory = memory_per_device()
    if memory is None or jax.process_index() != 0:
        return
    gib = 1024 ** 3
    print(f"memory per device after init: peak {memory['peak_bytes_in_use'] / gib:.2f} GiB, "
          f"in use {memory['bytes_in_use'] / gib:.2f} GiB", flush=True)


@contextlib.contextmanager
def _device_memory_errors(run: Run | None, step: int) -> Iterator[None]:
    """Turns XLA's out-of-memory error (when a step is compiled, dispatched or waited for)
    into a `DeviceMemoryError` naming the memory bound of `run` and what to change (without
    a run, `fit`'s: the batch)."""
    try:
        yield
    except Exception as err:  # XlaRuntimeError has no stable import path; match its status
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        if run is None:
            raise DeviceMemoryError(
                f"out of device memory at step {step}; use smaller batches, a remat policy "
                "in the model, shard it over more devices or keep the optimizer state in "
                "host memory (GTPConfig.offload_optimizer).") from err
        bound = memory_bound(run)
        raise DeviceMemoryError(
            f"out of device memory at step {step} (the run needs at least "
            f"{bound['total'] / 2**30:.2f} GiB per device: {memory_parts(bound)}); "
            + memory_advice(run, bound)
        ) from err


def train_result(model: nnx.Module, optimizer: nnx.Optimizer, *, replicated: tuple[int, int],
                 num_params: int, flops_per_token: float, tokens_per_step: int,
                 compute_dtype: str, losses: list[float], times: list[float],
                 first_step: int, saved: list[int], ckpt: Checkpointer | None,
                 window: tuple[int, int] | None = None, trace: str | None = None,
                 recovery: Recovery | None = None,
                 val_losses: dict[int, float] | None = None,
                 compiled: CompileReport | None = None) -> TrainResult:
    """The `TrainResult` of a finished loop (`model` and `optimizer` synced; `replicated`:
    `replicated_bytes`; `saved`: the steps this loop checkpointed)."""
    device = jax.devices()[0]
    kept: list[int] = []
    if ckpt is not None:
        # Only the checkpoints still on disk (CheckpointConfig.keep deletes older ones);
        # those of earlier runs of the directory too (a resumed run's).
        ckpt.wait()
        kept = sorted(ckpt.all_steps())
        saved = [s for s in saved if s in kept]
    param_bytes = gtp_jax.bytes_per_device(nnx.state(model, nnx.Param))
    mesh = getattr(model, "mesh", None)
    return TrainResult(
        losses=losses,
        step_times=times,
        tokens_per_step=tokens_per_step,
        param_bytes_per_device=param_bytes,
        state_bytes_per_device=param_bytes
        + gtp_jax.bytes_per_device(nnx.state(optimizer, nnx.OptState)),
        replicated_param_bytes=replicated[0],
        replicated_state_bytes=replicated[1],
        num_params=num_params,
        mesh_shape=dict(mesh.shape) if mesh is not None else {},
        backend=jax.default_backend(),
        first_step=first_step,
        flops_per_token=flops_per_token,
        device_kind=device.device_kind,
        num_devices=mesh.devices.size if mesh is not None else 1,
        compute_dtype=compute_dtype,
        peak_flops_per_device=peak_flops(device.device_kind, compute_dtype)
        if jax.default_backend() != "cpu" else None,
        memory=memory_per_device(),
        process_count=jax.process_count(),
        checkpoint_dir=ckpt.config.directory if ckpt is not None else None,
        checkpoint_steps=saved,
        checkpoints_kept=kept,
        profile_steps=window,
        profile_trace=trace,
        failure=dataclasses.asdict(recovery) if recovery is not None else None,
        val_losses=dict(val_losses or {}),
        compile_s=compiled.seconds if compiled is not None else None,
        compile_cache=compiled.cache if compiled is not None else None,
    )


def _write_metrics(path: str, cfg: TrainConfig, model_cfg: TransformerConfig,
                   result: TrainResult) -> None:
    write_json(path, {
        "config": dataclasses.asdict(cfg),
        "model_config": model_json(model_cfg),
        "steps": [{"step": result.first_step + i, "loss": loss, "step_time_s": t,
                   "tokens_per_s": result.tokens_per_step / t,
                   **({"val_loss": result.val_losses[result.first_step + i]}
                      if result.first_step + i in result.val_losses else {})}
                  for i, (loss, t) in enumerate(zip(result.losses, result.step_times))],
        "summary": result.to_json(),
    })


def _global_batch(batch: np.ndarray | RowBatch, sharding: jax.sharding.NamedSharding
                  ) -> jax.Array:
    """The global batch ``int32[batch, seq + 1]`` as one array split over the data axes.

    Every process builds the same global batch (the batcher is deterministic in (seed,
    position)) and hands each of its devices the rows of that device's shard, so a
    multi-process run sees exactly the batches of a single-process run. Only the local rows
    are copied to devices; from a token file (`gtp_jax.data.RowBatch`) only the local rows
    are read.
    """
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])


def _tree_bytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "shape"))
