"""Per-step metrics streamed while a run trains (``--log-dir``): a JSON-lines file
``metrics.jsonl`` (one object per logged step, flushed as it is written, so a crash keeps
every line logged before it) and TensorBoard event files (through ``tensorboardX``, the
optional ``tensorboard`` extra; without it only ``metrics.jsonl`` is written, and the run
says so once).

A line holds ``step``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``step_ms``, and
where known ``peak_bytes`` (the largest ``peak_bytes_in_use`` of this process's devices;
GPUs and TPUs report it, CPUs do not), ``mfu`` (GPUs and TPUs with a known peak,
`gtp_jax.train.observe.peak_flops`) and ``val_loss`` (a step with a held-out evaluation).
A resumed run appends to the same file.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, TextIO

import jax

from gtp_jax.train.observe import memory_per_device, peak_flops

#: The JSON-lines file in the log directory.
METRICS_FILE = "metrics.jsonl"
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
      stream: where the one-line note about a missing TensorBoard writer goes.
    """

    def __init__(self, directory: str, *, log_every: int, last_step: int,
                 flops_per_token: float | None = None, peak_flops: float | None = None,
                 tensorboard: bool = True, stream: TextIO | None = None):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, METRICS_FILE)
        self.log_every = max(1, int(log_every))
        self.last_step = last_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._writer = _tensorboard_writer(directory, stream) if tensorboard else None

    def should_log(self, step: int) -> bool:
        """Whether `step` is logged (every `log_every`-th and the last)."""
        return step % self.log_every == 0 or step == self.last_step

    def write(self, step: int, *, loss: float, step_s: float, tokens: int,
              lr: float | None = None, grad_norm: float | None = None,
              val_loss: float | None = None) -> dict[str, Any]:
        """Writes and flushes the record of `step` (`tokens` trained in `step_s` seconds);
        returns it."""
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
        record = {k: v for k, v in record.items() if v is not None}
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=True) + "\n")
            self._file.flush()
        if self._writer is not None:
            for key, value in record.items():
                if key != "step":
                    self._writer.add_scalar(f"train/{key}", value, step)
            self._writer.flush()
        return record

    def close(self) -> None:
        """Closes the file and the TensorBoard writer (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _tensorboard_writer(directory: str, stream: TextIO | None) -> Any:
    try:
        from tensorboardX import SummaryWriter  # noqa: PLC0415
    except ImportError:
        print(NO_TENSORBOARD, file=sys.stderr if stream is None else stream, flush=True)
        return None
    return SummaryWriter(logdir=directory)


def open_metrics_log(observe: Any, cfg: Any, model_cfg: Any) -> MetricsLog | None:
    """The `MetricsLog` of a run (`observe` an `ObserveConfig`, `cfg` its resolved
    `TrainConfig`, `model_cfg` its `TransformerConfig`), or None without ``log_dir``."""
    if observe.log_dir is None:
        return None
    device = jax.devices()[0]
    peak = (peak_flops(device.device_kind, cfg.dtype)
            if jax.default_backend() != "cpu" else None)
    return MetricsLog(observe.log_dir, log_every=observe.log_every, last_step=cfg.steps,
                      flops_per_token=model_cfg.train_flops_per_token(cfg.seq_len),
                      peak_flops=peak * jax.device_count() if peak else None)


def step_extras(metrics: dict[str, Any]) -> dict[str, float]:
    """``grad_norm`` and ``lr`` of a step's metrics (`gtp_jax.train.step.TrainStep`) as
    floats, those present."""
    return {k: float(metrics[k]) for k in ("grad_norm", "lr") if k in metrics}
