"""Per-step metrics streamed while a run trains (``--log-dir``): a JSON-lines file
``metrics.jsonl`` (one object per logged step, flushed as it is written, so a crash keeps
every line logged before it) and TensorBoard event files (through ``tensorboardX``, the
optional ``tensorboard`` extra; without it only ``metrics.jsonl`` is written, and the run
says so once).

A line holds ``step``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``step_ms``, and
where known ``peak_bytes`` (the largest ``peak_bytes_in_use`` of this process's devices;
GPUs and TPUs report it, CPUs do not), ``mfu`` (GPUs and TPUs with a known peak,
`gtp_jax.train.outputs.observe.peak_flops`) and ``val_loss`` (a step with a held-out evaluation).
The first step a run (or a resumed run) trains is always logged, with ``compile_s`` (the
training step's compile, or its read from the persistent compilation cache),
``compile_cache`` (``"hit"`` / ``"miss"``, or null where JAX does not tell) and
``first_step_s`` (the compile plus the first step's run: the time to the first step).
A number that is not finite (NaN, inf) is written as ``null`` and its key listed under
``nonfinite``, so every line is strict JSON.

One run owns a log directory. `claim_log_dir` locks it for the run (`DirectoryLock`) and
refuses one holding another run's records; the run with the same checkpoint directory
(a resume, or a new start after its checkpoints were set aside) continues the file: records
after the step it starts from are dropped first, so no step is logged twice.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, TextIO

import jax
import numpy as np

from gtp_jax.base.errors import UsageError
from gtp_jax.train.lifecycle.lock import DirectoryLock
from gtp_jax.train.outputs.observe import memory_per_device, peak_flops

#: The JSON-lines file in the log directory.
METRICS_FILE = "metrics.jsonl"
#: Beside it: the checkpoint directory of the run that owns the log directory (JSON).
OWNER_FILE = ".gtp_jax.owner"
#: TensorBoard event files of a log directory.
EVENTS_GLOB = "events.out.tfevents."
#: Printed once when the TensorBoard writer is not installed.
NO_TENSORBOARD = ("gtp_jax train: --log-dir writes metrics.jsonl only; TensorBoard event "
                  "files need tensorboardX (pip install 'gtp-jax[tensorboard]').")


class MetricsLog:
    """Appends one record per logged step to ``<directory>/metrics.jsonl`` and TensorBoard.

    Args:
      directory: the log directory (created).
      log_every: log every `log_every`-th step; `should_log` also says yes for the run's
        last step and for steps with a held-out loss.
      last_step: the run's last step.
      flops_per_token: model FLOPs per trained token (for MFU), None: no MFU.
      peak_flops: the run's peak FLOP/s over all devices, None: no MFU (CPUs).
      tensorboard: write TensorBoard event files (when tensorboardX imports).
      stream: where one-line notes go (a missing TensorBoard writer, dropped records;
        None: stderr).
      start: the step the run starts after (0: a new run; a resumed run's checkpoint
        step): records of later steps already in the file are dropped (with a note), as
        are lines a crash left incomplete, and TensorBoard hides its events of those
        steps. None: append to the file as it is.
      checkpoint_dir: the run's checkpoint directory, recorded as the log directory's owner
        (`claim_log_dir`); None: a run that cannot be resumed.
    """

    def __init__(self, directory: str, *, log_every: int, last_step: int,
                 flops_per_token: float | None = None, peak_flops: float | None = None,
                 tensorboard: bool = True, stream: TextIO | None = None,
                 start: int | None = None, checkpoint_dir: str | None = None):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, METRICS_FILE)
        self.log_every = max(1, int(log_every))
        self.last_step = last_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        if start is not None:
            _write_owner(directory, checkpoint_dir)
            dropped = _keep_records_through(self.path, start)
            if dropped:
                print(f"gtp_jax train: {self.path}: dropped {dropped} record(s) after step "
                      f"{start}, where this run starts (it logs those steps again).",
                      file=sys.stderr if stream is None else stream, flush=True)
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._writer = (_tensorboard_writer(directory, stream, purge_step=start)
                        if tensorboard else None)

    def should_log(self, step: int) -> bool:
        """Whether `step` is logged (every `log_every`-th and the last)."""
        return step % self.log_every == 0 or step == self.last_step

    def write(self, step: int, *, loss: float, step_s: float, tokens: int,
              lr: float | None = None, grad_norm: float | None = None,
              val_loss: float | None = None, moe_dropped: float | None = None,
              compile_s: float | None = None, compile_cache: str | None = None,
              first_step_s: float | None = None,
              aux: dict[str, float] | None = None) -> dict[str, Any]:
        """Writes and flushes the record of `step` (`tokens` trained in `step_s` seconds);
        returns it. `moe_dropped`: a mixture of experts' share of routing dropped at
        capacity (`step_extras`). `aux`: a loss function's own metrics (`aux_metrics`),
        under their names. `compile_s`, `compile_cache`, `first_step_s`: the first
        step's (see the module docstring); `compile_cache` is written (null included)
        whenever `compile_s` is."""
        tokens_per_s = tokens / step_s if step_s > 0 else math.inf
        record: dict[str, Any] = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                  "tokens_per_s": tokens_per_s, "step_ms": step_s * 1e3}
        memory = memory_per_device()
        if memory is not None:
            record["peak_bytes"] = memory["peak_bytes_in_use"]
        if self.flops_per_token and self.peak_flops:
            record["mfu"] = self.flops_per_token * tokens_per_s / self.peak_flops
        if val_loss is not None:
            record["val_loss"] = val_loss
        if moe_dropped is not None:
            record["moe_dropped"] = moe_dropped
        record.update(aux or {})
        if compile_s is not None:
            record.update(compile_s=compile_s, first_step_s=first_step_s)
        record = {k: v for k, v in record.items() if v is not None}
        if compile_s is not None:
            record["compile_cache"] = compile_cache
        if self._writer is not None:  # TensorBoard shows NaN and inf as they are
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._writer.add_scalar(f"train/{key}", value, step)
            self._writer.flush()
        record = _strict(record)
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        return record

    def close(self) -> None:
        """Closes the file and the TensorBoard writer (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _tensorboard_writer(directory: str, stream: TextIO | None,
                        purge_step: int | None = None) -> Any:
    try:
        from tensorboardX import SummaryWriter  # noqa: PLC0415
    except ImportError:
        print(NO_TENSORBOARD, file=sys.stderr if stream is None else stream, flush=True)
        return None
    if purge_step is None:
        return SummaryWriter(logdir=directory)
    # TensorBoard hides the earlier files' events from this step on (logged again).
    return SummaryWriter(logdir=directory, purge_step=purge_step + 1)


def _strict(record: dict[str, Any]) -> dict[str, Any]:
    """`record` as strict JSON: non-finite numbers become None, their keys listed under
    ``nonfinite``."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: None if k in bad else v for k, v in record.items()}, "nonfinite": bad}


def _keep_records_through(path: str, start: int) -> int:
    """Drops the records of steps after `start` from the JSON-lines file `path` (and any
    line that is not a complete record, e.g. cut short by a crash); returns how many.
    Kept records are rewritten as strict JSON (older versions wrote NaN)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0
    kept, dropped, changed = [], 0, False
    for line in lines:
        if not line.strip():
            changed = True
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or step > start:
            dropped += 1
            continue
        text = json.dumps(_strict(record), allow_nan=False)
        changed |= text != line
        kept.append(text)
    if dropped or changed:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in kept)
        os.replace(tmp, path)
    return dropped


def _write_owner(directory: str, checkpoint_dir: str | None) -> None:
    tmp = os.path.join(directory, f"{OWNER_FILE}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"checkpoint_dir": _normalized(checkpoint_dir)}, f)
    os.replace(tmp, os.path.join(directory, OWNER_FILE))


def _normalized(checkpoint_dir: str | None) -> str | None:
    if checkpoint_dir is None or "://" in checkpoint_dir:
        return checkpoint_dir
    return os.path.realpath(os.path.expanduser(checkpoint_dir))


def claim_log_dir(directory: str, checkpoint_dir: str | None, *,
                  resume: bool | str = False) -> DirectoryLock | None:
    """Locks the log `directory` for this run, after checking that it holds no other run's
    records. Returns the lock to release at the end (None: `directory` is the checkpoint
    directory, whose lock the run holds already).

    A directory with a ``metrics.jsonl`` (or TensorBoard event files) belongs to the run
    whose checkpoint directory it records: only that run (`checkpoint_dir`, resumed or
    started again) may continue it. A directory written before owners were recorded goes
    to a run that resumes (`resume`, `CheckpointConfig.resume`).

    Raises:
      UsageError: another live run logs there, or it holds another run's records (naming
        ``ObserveConfig.log_dir`` and what to do).
    """
    mine = _normalized(checkpoint_dir)
    if mine is not None and "://" not in mine and (
            os.path.realpath(os.path.expanduser(directory)) == mine):
        return None
    lock = DirectoryLock(directory, what="ObserveConfig.log_dir")
    lock.acquire()
    try:
        _check_owner(directory, mine, resume)
    except BaseException:
        lock.release()
        raise
    return lock


def _check_owner(directory: str, mine: str | None, resume: bool | str) -> None:
    metrics = os.path.join(directory, METRICS_FILE)
    used = (os.path.isfile(metrics) and os.path.getsize(metrics) > 0) or any(
        name.startswith(EVENTS_GLOB) for name in os.listdir(directory))
    if not used:
        return
    try:
        with open(os.path.join(directory, OWNER_FILE), encoding="utf-8") as f:
            owner = json.load(f)
        owner = owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        owner = None
    if owner is None:  # written before owners were recorded
        if mine is not None and resume:
            return
        who = "a run that recorded no checkpoint directory"
    elif mine is not None and owner.get("checkpoint_dir") == mine:
        return
    elif owner.get("checkpoint_dir") is None:
        who = "a run without a checkpoint directory, which cannot be continued"
    else:
        who = f"the run of checkpoint directory {owner.get('checkpoint_dir')!r}"
    raise UsageError(
        f"ObserveConfig.log_dir {directory!r} already holds the metrics of {who}; pass an "
        "empty ObserveConfig.log_dir for this run (or move that run's metrics.jsonl and "
        "event files away to reuse the directory).")


def open_metrics_log(observe: Any, cfg: Any, model_cfg: Any, *, start: int = 0,
                     checkpoint_dir: str | None = None) -> MetricsLog | None:
    """The `MetricsLog` of a run (`observe` an `ObserveConfig`, `cfg` its resolved
    `TrainConfig`, `model_cfg` its `TransformerConfig` or `UserModel`: anything with
    ``train_flops_per_token(seq_len)``) that starts after step `start`,
    with checkpoints in `checkpoint_dir`; or None without ``log_dir``."""
    if observe.log_dir is None:
        return None
    device = jax.devices()[0]
    peak = (peak_flops(device.device_kind, cfg.dtype)
            if jax.default_backend() != "cpu" else None)
    return MetricsLog(observe.log_dir, log_every=observe.log_every, last_step=cfg.steps,
                      flops_per_token=model_cfg.train_flops_per_token(cfg.seq_len),
                      peak_flops=peak * jax.device_count() if peak else None,
                      start=start, checkpoint_dir=checkpoint_dir)


#: The metrics every step reports (`TrainStep`); a loss function's own are the others.
STEP_METRICS = ("loss", "grad_norm", "lr", "moe_dropped")


def aux_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """A step's metrics from its loss function (``TrainStep(has_aux=True)``) as floats: the
    scalar ones other than `STEP_METRICS`, named ``aux_<name>`` where a name is a field of
    the metrics record already (``step``, ``tokens_per_s``, ...)."""
    taken = {"step", "tokens_per_s", "step_ms", "peak_bytes", "mfu", "val_loss",
             "compile_s", "compile_cache", "first_step_s"}
    return {(f"aux_{k}" if k in taken else k): float(v) for k, v in metrics.items()
            if k not in STEP_METRICS and np.ndim(v) == 0}


def step_extras(metrics: dict[str, Any], model_cfg: Any = None) -> dict[str, float]:
    """``grad_norm`` and ``lr`` of a step's metrics (`gtp_jax.train.step.train_step.TrainStep`) as
    floats, those present; for a mixture of experts (`model_cfg`) also ``dropped``, the
    share of (token, choice) assignments its capacity dropped
    (`gtp_jax.models.lm_loss_and_metrics`)."""
    out = {k: float(metrics[k]) for k in ("grad_norm", "lr") if k in metrics}
    if "moe_dropped" in metrics and getattr(model_cfg, "moe_experts", 0):
        per_token = float(metrics["moe_dropped"])
        out["dropped"] = per_token / (model_cfg.moe_top_k * model_cfg.n_layers)
    return out
