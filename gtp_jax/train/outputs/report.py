"""What a training run measured: `TrainResult`, its one-screen summary and its JSON."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import numpy as np


@dataclasses.dataclass
class TrainResult:
    """What a run measured (this invocation's steps only, when resumed).

    Attributes:
      losses: loss of each step run here (steps `first_step`, `first_step` + 1, ...).
      step_times: wall seconds of each of those steps (the first one's is its run: the step
        is compiled before it, `compile_s`).
      tokens_per_step: global tokens per optimizer step.
      param_bytes_per_device, state_bytes_per_device: bytes of parameters, and of parameters
        plus optimizer state, on one device; replicated_*: the same without sharding.
      num_params: model parameter count.
      mesh_shape: mesh axis sizes.
      backend: JAX backend ("cpu", "gpu", "tpu").
      first_step: the first step run here (1, or the resumed checkpoint's step + 1).
      flops_per_token: model FLOPs per trained token (see `gtp_jax.train.outputs.observe`).
      device_kind: ``jax.devices()[0].device_kind``.
      num_devices: devices in the mesh (all processes).
      compute_dtype: "float32" or "bfloat16".
      peak_flops_per_device: the peak FLOP/s used for MFU, or None when unknown.
      memory: `gtp_jax.train.outputs.observe.memory_per_device` of this process's devices, or None.
      process_count: JAX processes in the run.
      checkpoint_dir, checkpoint_steps: where checkpoints went, and the steps this run saved
        that are still there.
      checkpoints_kept: every step `checkpoint_dir` holds at the end (earlier runs' too).
      profile_steps, profile_trace: traced steps and the Perfetto trace file, if any.
      failure: a simulated device failure and the switch to nonuniform tensor parallelism
        (`gtp_jax.train.lifecycle.ntp.Recovery` as a dict: step, devices, layout_before/after,
        replan_s, relayout_s, rebuild_s), or None.
      val_losses: held-out loss after each evaluated step (`TrainConfig.eval_every`).
      stopped_by: the signal that stopped the run early (``"SIGTERM"``), or None (the run
        trained every step; see `gtp_jax.train.lifecycle.preempt`).
      export_hf: the folder the Hugging Face export was written to (absolute), or None
        (none asked for, or the run stopped early: a partial run is not exported).
      log_dir: the folder of the streamed metrics (``metrics.jsonl``, absolute), or None.
      compile_s: seconds the training step took to compile (or to be read from JAX's
        persistent compilation cache) before the first step; None: not measured.
      compile_cache: ``"hit"`` / ``"miss"`` (/ ``"partial"``) of the persistent compilation
        cache for that compile, or None where unknown (`gtp_jax.base.compile_watch`).
    """

    losses: list[float]
    step_times: list[float]
    tokens_per_step: int
    param_bytes_per_device: int
    state_bytes_per_device: int
    replicated_param_bytes: int
    replicated_state_bytes: int
    num_params: int
    mesh_shape: dict[str, int]
    backend: str
    first_step: int = 1
    flops_per_token: float = 0.0
    device_kind: str = ""
    num_devices: int = 1
    compute_dtype: str = "float32"
    peak_flops_per_device: float | None = None
    memory: dict[str, int] | None = None
    process_count: int = 1
    checkpoint_dir: str | None = None
    checkpoint_steps: list[int] = dataclasses.field(default_factory=list)
    checkpoints_kept: list[int] = dataclasses.field(default_factory=list)
    profile_steps: tuple[int, int] | None = None
    profile_trace: str | None = None
    failure: dict[str, Any] | None = None
    val_losses: dict[int, float] = dataclasses.field(default_factory=dict)
    stopped_by: str | None = None
    export_hf: str | None = None
    log_dir: str | None = None
    compile_s: float | None = None
    compile_cache: str | None = None

    @property
    def first_step_s(self) -> float | None:
        """Seconds from the start of the step's compile to the end of the first step run
        here (`compile_s` plus that step's run): the time to the first step. None when the
        compile was not measured."""
        if self.compile_s is None or not self.step_times:
            return None
        return self.compile_s + self.step_times[0]

    @property
    def median_step_time(self) -> float:
        """Median step time in seconds, excluding the first step (its run warms up: buffers
        allocated, executables loaded)."""
        times = self.step_times[1:] or self.step_times
        return statistics.median(times)

    @property
    def tokens_per_second(self) -> float:
        """Global tokens per second at the median step time."""
        return self.tokens_per_step / self.median_step_time

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilization (0..1) at the median step time, or None (unknown peak)."""
        if not self.peak_flops_per_device:
            return None
        return (self.flops_per_token * self.tokens_per_second
                / (self.num_devices * self.peak_flops_per_device))

    def summary(self) -> str:
        first = self.losses[0]
        window = min(5, len(self.losses))
        last = float(np.mean(self.losses[-window:]))
        mib, gib = 2.0**20, 2.0**30
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        procs = f", {self.process_count} processes" if self.process_count > 1 else ""
        last_step = self.first_step + len(self.losses) - 1
        steps = f"; steps {self.first_step}-{last_step}" if self.first_step > 1 else ""
        if self.mfu is None:
            mfu = (f"  MFU: n/a (no peak FLOP/s known for {self.device_kind or self.backend}; "
                   f"{self.flops_per_token / 1e6:.2f} MFLOP/token)")
        else:
            mfu = (f"  MFU: {self.mfu * 100:.1f}% ({self.flops_per_token / 1e6:.2f} MFLOP/token "
                   f"x {self.tokens_per_second:,.0f} tokens/s over {self.num_devices} x "
                   f"{self.peak_flops_per_device / 1e12:.0f} TFLOP/s {self.compute_dtype})")
        if self.memory is None:
            memory = (f"  memory per device: n/a on {self.backend} (no allocator statistics); "
                      "see params + optimizer state below")
        else:
            memory = (f"  memory per device: peak {self.memory['peak_bytes_in_use'] / gib:.2f} "
                      f"GiB, in use {self.memory['bytes_in_use'] / gib:.2f} GiB "
                      f"(limit {self.memory['bytes_limit'] / gib:.1f} GiB)")
        lines = [
            f"summary ({self.backend}, mesh {mesh}{procs}, {self.num_params / 1e6:.2f}M params)",
            f"  loss: first {first:.4f} -> last {last:.4f} (mean of last {window} steps{steps})",
            f"  step time: {self.median_step_time * 1e3:.1f} ms median "
            f"({self.tokens_per_second:,.0f} tokens/s)",
            *self._first_step_lines(),
            mfu,
            memory,
            f"  params per device: {self.param_bytes_per_device / mib:.2f} MiB "
            f"(replicated: {self.replicated_param_bytes / mib:.2f} MiB, "
            f"{self.param_bytes_per_device / self.replicated_param_bytes:.3f}x)",
            f"  params + optimizer state per device: {self.state_bytes_per_device / mib:.2f} MiB "
            f"(replicated: {self.replicated_state_bytes / mib:.2f} MiB, "
            f"{self.state_bytes_per_device / self.replicated_state_bytes:.3f}x)",
        ]
        if self.val_losses:
            lines.append("  held-out loss: " + ", ".join(
                f"step {step} {loss:.4f}" for step, loss in sorted(self.val_losses.items())))
        kept = self.checkpoints_kept or self.checkpoint_steps
        if kept:
            mine = ("" if kept == self.checkpoint_steps else
                    f" (this run saved {self.checkpoint_steps})" if self.checkpoint_steps
                    else " (none saved by this run)")
            lines.append(f"  checkpoints: steps {kept} in {self.checkpoint_dir}{mine}")
        if self.export_hf is not None:
            lines.append(f"  Hugging Face export: {self.export_hf}")
        if self.log_dir is not None:
            lines.append(f"  metrics log: {self.log_dir}/metrics.jsonl")
        if self.profile_steps is not None:
            lines.append(f"  profile: steps {self.profile_steps[0]}-{self.profile_steps[1]} -> "
                         f"{self.profile_trace or '(no perfetto trace written)'}")
        if self.failure is not None:
            lines += self._failure_lines()
        return "\n".join(lines)

    def _first_step_lines(self) -> list[str]:
        if self.first_step_s is None:
            return []
        cache = f", cache {self.compile_cache}" if self.compile_cache else ""
        return [f"  time to the first step: {self.first_step_s:.1f} s (compile "
                f"{self.compile_s:.1f} s{cache}; first step {self.step_times[0]:.2f} s)"]

    def _failure_lines(self) -> list[str]:
        f = self.failure
        at = f["step"] - self.first_step + 1  # losses[:at] ran before the failure
        before, after = self.losses[max(0, at - 3):at], self.losses[at:at + 3]
        t_before = self.step_times[1:at] or self.step_times[:at]
        t_after = self.step_times[at + 1:] or self.step_times[at:]
        fmt = lambda xs: ", ".join(f"{x:.4f}" for x in xs)  # noqa: E731
        return [
            f"  simulated failure after step {f['step']}: devices {list(f['devices'])} lost; "
            "from there on the mesh and bytes above are the core mesh's (parameters and "
            "optimizer state)",
            "  layout before:", *(f"    {line}" for line in f["layout_before"].splitlines()),
            "  layout after:", *(f"    {line}" for line in f["layout_after"].splitlines()),
            f"  re-plan {f['replan_s'] * 1e3:.1f} ms, re-layout of the training state "
            f"{f['relayout_s'] * 1e3:.1f} ms (bit-exact, from survivors), rebuilding the "
            f"replica and core models {f['rebuild_s'] * 1e3:.1f} ms",
            f"  loss around the failure: steps {f['step'] - len(before) + 1}-{f['step']}: "
            f"{fmt(before)} | steps {f['step'] + 1}-{f['step'] + len(after)}: {fmt(after)}",
            f"  step time median: {statistics.median(t_before) * 1e3:.1f} ms before, "
            f"{statistics.median(t_after) * 1e3:.1f} ms after (first step after the failure "
            f"compiles: {self.step_times[at] * 1e3:.0f} ms)" if at < len(self.step_times)
            else "",
        ]

    def to_json(self) -> dict[str, Any]:
        """The summary as JSON-serializable values (times in seconds, sizes in bytes)."""
        return {
            "backend": self.backend,
            "device_kind": self.device_kind,
            "num_devices": self.num_devices,
            "process_count": self.process_count,
            "mesh": dict(self.mesh_shape),
            "num_params": self.num_params,
            "first_step": self.first_step,
            "last_step": self.first_step + len(self.losses) - 1,
            "stopped_by": self.stopped_by,
            "export_hf": self.export_hf,
            "log_dir": self.log_dir,
            "first_loss": self.losses[0],
            "last_loss_mean5": float(np.mean(self.losses[-5:])),
            "median_step_time_s": self.median_step_time,
            "compile_s": self.compile_s,
            "compile_cache": self.compile_cache,
            "first_step_s": self.first_step_s,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_second,
            "flops_per_token": self.flops_per_token,
            "compute_dtype": self.compute_dtype,
            "peak_flops_per_device": self.peak_flops_per_device,
            "mfu": self.mfu,
            "memory_per_device": self.memory,
            "param_bytes_per_device": self.param_bytes_per_device,
            "state_bytes_per_device": self.state_bytes_per_device,
            "replicated_param_bytes": self.replicated_param_bytes,
            "replicated_state_bytes": self.replicated_state_bytes,
            "checkpoint_dir": self.checkpoint_dir,
            "checkpoint_steps": list(self.checkpoint_steps),
            "checkpoints_kept": list(self.checkpoints_kept),
            "profile_steps": list(self.profile_steps) if self.profile_steps else None,
            "profile_trace": self.profile_trace,
            "failure": self.failure,
            "val_losses": {str(step): loss for step, loss in sorted(self.val_losses.items())},
        }

