"""Observability for training runs: profiler traces, MFU, device memory, JSON metrics.

MFU (model FLOPs utilization) = achieved model FLOP/s over the devices' peak:

    MFU = flops_per_token * tokens_per_second / (num_devices * peak_flops_per_device)

with ``flops_per_token = TransformerConfig.train_flops_per_token(seq_len)`` =
``6 * (block params + head params) + 6 * n_layers * d_model * seq_len`` (forward + backward
matmuls; causal attention at half the dense cost; embedding lookup, norms and recompute not
counted). The peak is the dense tensor-core rate of the device kind (`PEAK_FLOPS`) for the
compute dtype: bfloat16, or for float32 compute the TF32 rate, which XLA's default matmul
precision uses for float32 dots on NVIDIA GPUs since Ampere. Devices without an entry
(CPU, unknown kinds) report MFU as n/a.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import jax

from gtp_jax.base.errors import UsageError

#: Dense peak FLOP/s per device by device-kind substring and compute dtype (datasheets:
#: NVIDIA SXM parts without sparsity; TPU bf16 MXU rates, also used for float32 dots,
#: which run as bf16 passes at default precision). Longer keys are matched first.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bfloat16": 756e12, "float32": 378e12},
    "H100": {"bfloat16": 989e12, "float32": 494e12},
    "H200": {"bfloat16": 989e12, "float32": 494e12},
    "GH200": {"bfloat16": 989e12, "float32": 494e12},
    "B200": {"bfloat16": 2250e12, "float32": 1100e12},
    "A100": {"bfloat16": 312e12, "float32": 156e12},
    "TPU v4": {"bfloat16": 275e12, "float32": 275e12},
    "TPU v5 lite": {"bfloat16": 197e12, "float32": 197e12},
    "TPU v5p": {"bfloat16": 459e12, "float32": 459e12},
    "TPU v6 lite": {"bfloat16": 918e12, "float32": 918e12},
}


def peak_flops(device_kind: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of one device of `device_kind` computing in `dtype`, or None."""
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in device_kind:
            return PEAK_FLOPS[key].get(dtype)
    return None


def memory_per_device(devices: Sequence[jax.Device] | None = None) -> dict[str, int] | None:
    """Largest ``bytes_in_use`` / ``peak_bytes_in_use`` / ``bytes_limit`` over `devices`.

    `devices` defaults to this process's devices. Returns None when the backend keeps no
    allocator statistics (``Device.memory_stats()`` is None on CPU).
    """
    devices = jax.local_devices() if devices is None else devices
    stats = [d.memory_stats() for d in devices]
    if not stats or any(s is None for s in stats):
        return None
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return {k: max(int(s.get(k, 0)) for s in stats) for k in keys}


@dataclasses.dataclass(frozen=True)
class ObserveConfig:
    """What a training run records besides its progress bar and summary.

    Attributes:
      profile_dir: write a `jax.profiler` trace here (TensorBoard/XProf ``.xplane.pb`` and a
        Perfetto ``perfetto_trace.json.gz`` under ``plugins/profile/<run>/``; in a
        multi-process run each process writes under ``process_<i>/``). None: no trace.
      profile_steps: (first, last) optimizer steps to trace, 1-based and inclusive; None:
        the default window, steps 2..4 of the run (step 1 compiles), clipped to the run.
      metrics_json: write per-step metrics and the summary to this JSON file (process 0)
        at the end of the run.
      log_dir: stream per-step metrics while training (process 0): ``metrics.jsonl`` and
        TensorBoard event files (`gtp_jax.train.outputs.metrics_log`). None: none.
      log_every: log (the progress line on a non-terminal, `log_dir`'s records) every
        `log_every` steps, and the last step.
    """

    profile_dir: str | None = None
    profile_steps: tuple[int, int] | None = None
    metrics_json: str | None = None
    log_dir: str | None = None
    log_every: int = 5

    def __post_init__(self) -> None:
        if self.profile_steps is not None:
            if self.profile_dir is None:
                raise UsageError("ObserveConfig.profile_steps needs ObserveConfig.profile_dir "
                                 "(where the trace goes).")
            steps = tuple(self.profile_steps)
            if (len(steps) != 2 or any(isinstance(s, bool) or not isinstance(s, int)
                                       for s in steps) or not 1 <= steps[0] <= steps[1]):
                raise UsageError(
                    f"ObserveConfig.profile_steps={self.profile_steps!r} must be (first, last) "
                    "with 1 <= first <= last, e.g. (3, 5)."
                )
            object.__setattr__(self, "profile_steps", steps)
        if (isinstance(self.log_every, bool) or not isinstance(self.log_every, int)
                or self.log_every < 1):
            raise UsageError(f"ObserveConfig.log_every={self.log_every!r} must be an int >= 1.")
        for name in ("profile_dir", "metrics_json", "log_dir"):
            value = getattr(self, name)
            if value is not None:
                value = os.fspath(value)
                if not value:
                    raise UsageError(f"ObserveConfig.{name} must be a non-empty path.")
                object.__setattr__(self, name, value)
        if self.metrics_json is not None and os.path.isdir(self.metrics_json):
            raise UsageError(
                f"ObserveConfig.metrics_json={self.metrics_json!r} is a directory; pass a file "
                "path such as metrics.json."
            )

    def profile_window(self, first_step: int, last_step: int) -> tuple[int, int] | None:
        """The steps to trace in a run of steps `first_step`..`last_step`, or None.

        Raises:
          UsageError: `profile_steps` lies outside the run.
        """
        if self.profile_dir is None:
            return None
        if self.profile_steps is None:
            start = min(first_step + 1, last_step)
            return start, min(start + 2, last_step)
        lo, hi = self.profile_steps
        if lo < first_step or hi > last_step:
            raise UsageError(
                f"ObserveConfig.profile_steps=({lo}, {hi}) lies outside this run's steps "
                f"{first_step}..{last_step}; choose a range inside it."
            )
        return lo, hi


def parse_steps(text: str) -> tuple[int, int]:
    """``"3:5"`` -> (3, 5); ``"4"`` -> (4, 4). UsageError naming the expected format."""
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        values = values * 2
    if len(values) != 2:
        raise UsageError(f"ObserveConfig.profile_steps {text!r}: use FIRST:LAST, e.g. 3:5.")
    return values[0], values[1]


class StepProfiler:
    """Starts a `jax.profiler` trace before step `first` and stops it after step `last`."""

    def __init__(self, directory: str, window: tuple[int, int]):
        if jax.process_count() > 1:
            # Traces are named after the host; local processes would overwrite each other.
            directory = os.path.join(directory, f"process_{jax.process_index()}")
        self.directory = directory
        self.window = window
        self.active = False
        self.trace_path: str | None = None

    def before(self, step: int) -> None:
        if step == self.window[0] and not self.active:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True

    def after(self, step: int) -> None:
        if step == self.window[1]:
            self.stop()

    def stop(self) -> None:
        if not self.active:
            return
        jax.profiler.stop_trace()
        self.active = False
        found = sorted(glob.glob(os.path.join(self.directory, "plugins", "profile", "*",
                                              "perfetto_trace.json.gz")), key=os.path.getmtime)
        self.trace_path = found[-1] if found else None


class DeviceMemoryError(UsageError):
    """The run does not fit in device memory (its lower bound, before compiling, or XLA's
    ``RESOURCE_EXHAUSTED`` during a step)."""


def device_memory_limit(device: jax.Device | None = None) -> int | None:
    """``memory_stats()["bytes_limit"]`` of `device` (default: this process's first device;
    other processes' devices report no statistics), or None where the backend reports no
    limit (CPU)."""
    device = jax.local_devices()[0] if device is None else device
    stats = device.memory_stats()
    limit = stats.get("bytes_limit") if stats else None
    return int(limit) if limit else None


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _probe(directory: str, name: str, target: str) -> None:
    try:
        fd, probe = tempfile.mkstemp(prefix=".gtp_jax_probe_", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise UsageError(f"{name}={target!r} cannot be written ({err.strerror or err}); "
                         "choose a writable location.") from None


def _check_special(path: str, name: str) -> None:
    real = os.path.realpath(path)
    for root in ("/proc", "/sys", "/dev"):
        if real == root or real.startswith(root + "/"):
            raise UsageError(f"{name}={path!r} lies in {root}, which holds no regular files; "
                             "choose a directory on a real file system.")


def check_writable_dir(path: str, name: str) -> None:
    """Raises UsageError (naming the argument `name`) unless directory `path` exists and
    can be written, or can be created. URLs (``gs://...``) are not checked.

    Called before training, so that a run never trains and then fails to write its
    checkpoints or trace. Writes and removes one temporary probe file; creates nothing."""
    if "://" in path:
        return
    _check_special(path, name)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UsageError(f"{name}={path!r} is a file, not a directory; choose a directory.")
    base = _nearest_existing(path)
    if not os.path.isdir(base):
        raise UsageError(f"{name}={path!r} cannot be created: {base!r} is a file.")
    _probe(base, name, path)


def check_writable_file(path: str, name: str) -> None:
    """Raises UsageError unless file `path` can be written (its directory exists and is
    writable, or can be created); `path` itself must not be a directory."""
    _check_special(path, name)
    if os.path.isdir(path):
        raise UsageError(f"{name}={path!r} is a directory; pass a file path.")
    if os.path.lexists(path) and not os.access(path, os.W_OK):
        raise UsageError(f"{name}={path!r} exists and is not writable.")
    check_writable_dir(os.path.dirname(os.path.abspath(path)), name)


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Writes `payload` to `path` atomically (temporary file + rename)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


__all__ = ["PEAK_FLOPS", "DeviceMemoryError", "ObserveConfig",
           "check_writable_dir", "check_writable_file", "device_memory_limit",
           "StepProfiler", "memory_per_device", "parse_steps",
           "peak_flops", "write_json"]
