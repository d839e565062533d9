"""The main job: train a preset transformer with GTP on the bundled byte corpus.

Optional extras, each off by default: sharded checkpoints with exact resume
(`gtp_jax.checkpoint`), multi-process runs (`gtp_jax.distributed`; the batch placement
below works for any process count), profiler traces, MFU/memory reporting and JSON metrics
(`gtp_jax.observe`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import gtp_jax
from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.checkpoint import (
    CheckpointConfig,
    CheckpointCorruptError,
    Checkpointer,
    DirectoryLock,
)
from gtp_jax.data import VOCAB_SIZE, ByteBatcher, load_corpus, split_train_eval
from gtp_jax.models import Transformer, TransformerConfig, lm_loss, preset
from gtp_jax.observe import (
    MEMORY_ADVICE,
    DeviceMemoryError,
    ObserveConfig,
    StepProfiler,
    check_writable_dir,
    check_writable_file,
    device_memory_limit,
    estimate_train_memory,
    memory_per_device,
    peak_flops,
    write_json,
)
from gtp_jax.progress import ProgressBar

#: TrainConfig fields that only change the layout or the schedule of the computation, not
#: its math: a resumed run may change them. Every other field (including fields added
#: later) must equal the checkpoint's. ``steps`` may grow: that extends a run (see
#: `TrainConfig.schedule_steps`).
RESUME_MAY_DIFFER = frozenset({"steps", "dp", "gtp", "tp", "ep", "pad_for_alignment",
                               "gather_dtype", "gather_format", "prefetch", "remat", "overlap"})
#: TransformerConfig fields that only change how the model is computed, not its math.
MODEL_MAY_DIFFER = frozenset({"remat", "tp_overlap", "attention_impl"})
_GATHER_FORMATS = (None, "fp8", "mxfp8", "nvfp4")
_REMAT = ("none", "dots", "full")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
      preset: model preset name (`gtp_jax.models.PRESETS`); the vocabulary is set to 256
        byte tokens for the bundled corpus.
      steps: optimizer steps (the whole run; a resumed run continues up to it).
      batch_size: global batch (sequences), split over the mesh's data axes; a multiple of
        ``dp * ep * gtp``.
      seq_len: tokens per sequence.
      dp, gtp, tp, ep: mesh sizes (their product must equal the device count).
      lr: peak AdamW learning rate (linear warm-up, cosine decay to 10%).
      warmup: warm-up steps.
      weight_decay: AdamW decoupled weight decay.
      seed: parameter init and data-order seed.
      dtype: compute dtype ("float32" or "bfloat16"); master weights stay float32.
      gather_dtype: dtype weights are all-gathered in (None: the parameter dtype).
      pad_for_alignment: `GTPConfig.pad_for_alignment`.
      remat: `TransformerConfig.remat`.
      gather_format: `GTPConfig.gather_format` (None, "fp8", "mxfp8" or "nvfp4").
      prefetch: `GTPConfig.prefetch`.
      overlap: ring collective matmuls for the tp GEMMs (`TransformerConfig.tp_overlap`).
      moe_experts: experts per MoE layer (0: dense MLP); `moe_top_k`, `moe_capacity_factor`
        (None: dropless) as in `TransformerConfig`.
      schedule_steps: length of the LR schedule (warm-up + cosine decay to 10% of `lr`);
        None: `steps`. Steps past it train at the final LR (10% of `lr`). A run that is
        extended (resumed with a larger `steps`) keeps the schedule_steps recorded in its
        checkpoint, so an extended run equals an uninterrupted run with
        ``steps=<new steps>, schedule_steps=<original steps>``.

    Raises:
      UsageError / UsageTypeError: a field of the wrong type or out of range (non-positive
        or non-finite LR, negative warm-up or weight decay, unknown preset, ...).
    """

    preset: str = "tiny"
    steps: int = 100
    batch_size: int = 16
    seq_len: int = 128
    dp: int = 2
    gtp: int = 4
    tp: int = 1
    ep: int = 1
    lr: float = 3e-3
    warmup: int = 10
    weight_decay: float = 0.1
    seed: int = 0
    dtype: str = "float32"
    gather_dtype: str | None = None
    pad_for_alignment: int = 0
    remat: str = "none"
    gather_format: str | None = None
    prefetch: bool = False
    overlap: bool = False
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float | None = 1.25
    schedule_steps: int | None = None

    def __post_init__(self) -> None:
        # Every field is checked for type and range, so nothing silently trains wrong.
        for name, minimum in (("steps", 1), ("batch_size", 1), ("seq_len", 1), ("dp", 1),
                              ("gtp", 1), ("tp", 1), ("ep", 1), ("warmup", 0), ("seed", 0),
                              ("pad_for_alignment", 0), ("moe_experts", 0), ("moe_top_k", 1)):
            _check_int(name, getattr(self, name), minimum)
        if self.schedule_steps is not None:
            _check_int("schedule_steps", self.schedule_steps, 1)
        _check_float("lr", self.lr, positive=True)
        _check_float("weight_decay", self.weight_decay, positive=False)
        if self.moe_capacity_factor is not None:
            _check_float("moe_capacity_factor", self.moe_capacity_factor, positive=True)
        from gtp_jax.models import PRESETS  # noqa: PLC0415

        if self.preset not in PRESETS:
            raise UsageError(f"TrainConfig.preset={self.preset!r}: use one of {sorted(PRESETS)}.")
        for name, allowed in (("dtype", ("float32", "bfloat16")),
                              ("gather_dtype", (None, "float32", "bfloat16")),
                              ("gather_format", _GATHER_FORMATS), ("remat", _REMAT)):
            if getattr(self, name) not in allowed:
                raise UsageError(f"TrainConfig.{name}={getattr(self, name)!r}: use one of "
                                 f"{list(allowed)}.")
        for name in ("prefetch", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise UsageTypeError(f"TrainConfig.{name}={getattr(self, name)!r} must be a bool.")
        if self.moe_experts and self.moe_top_k > self.moe_experts:
            raise UsageError(
                f"TrainConfig.moe_top_k={self.moe_top_k} must be <= TrainConfig.moe_experts="
                f"{self.moe_experts} (each token is routed to top_k distinct experts)."
            )
        shards = self.dp * self.ep * self.gtp
        fit = max(shards, self.batch_size // shards * shards)
        if self.batch_size % shards:
            raise UsageError(
                f"TrainConfig.batch_size={self.batch_size} must be a multiple of dp*ep*gtp = "
                f"{self.dp}*{self.ep}*{self.gtp} = {shards} (the batch is split over those "
                f"axes); e.g. TrainConfig.batch_size={fit}."
            )

    @property
    def lr_schedule_steps(self) -> int:
        """The LR schedule's length: `schedule_steps`, or `steps` when it is None."""
        return self.schedule_steps if self.schedule_steps is not None else self.steps


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise UsageTypeError(f"TrainConfig.{name}={value!r} must be an int.")
    if value < minimum:
        raise UsageError(f"TrainConfig.{name}={value} must be >= {minimum}.")


def _check_float(name: str, value: Any, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise UsageTypeError(f"TrainConfig.{name}={value!r} must be a number.")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise UsageError(f"TrainConfig.{name}={value} must be finite and {bound}.")


@dataclasses.dataclass
class TrainResult:
    """What a run measured (this invocation's steps only, when resumed).

    Attributes:
      losses: loss of each step run here (steps `first_step`, `first_step` + 1, ...).
      step_times: wall seconds of each of those steps (the first includes compilation).
      tokens_per_step: global tokens per optimizer step.
      param_bytes_per_device, state_bytes_per_device: bytes of parameters, and of parameters
        plus optimizer state, on one device; replicated_*: the same without sharding.
      num_params: model parameter count.
      mesh_shape: mesh axis sizes.
      backend: JAX backend ("cpu", "gpu", "tpu").
      first_step: the first step run here (1, or the resumed checkpoint's step + 1).
      flops_per_token: model FLOPs per trained token (see `gtp_jax.observe`).
      device_kind: ``jax.devices()[0].device_kind``.
      num_devices: devices in the mesh (all processes).
      compute_dtype: "float32" or "bfloat16".
      peak_flops_per_device: the peak FLOP/s used for MFU, or None when unknown.
      memory: `gtp_jax.observe.memory_per_device` of this process's devices, or None.
      process_count: JAX processes in the run.
      checkpoint_dir, checkpoint_steps: where checkpoints went, and their steps.
      profile_steps, profile_trace: traced steps and the Perfetto trace file, if any.
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
    profile_steps: tuple[int, int] | None = None
    profile_trace: str | None = None

    @property
    def median_step_time(self) -> float:
        """Median step time in seconds, excluding the first (compiling) step."""
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
            mfu,
            memory,
            f"  params per device: {self.param_bytes_per_device / mib:.2f} MiB "
            f"(replicated: {self.replicated_param_bytes / mib:.2f} MiB, "
            f"{self.param_bytes_per_device / self.replicated_param_bytes:.3f}x)",
            f"  params + optimizer state per device: {self.state_bytes_per_device / mib:.2f} MiB "
            f"(replicated: {self.replicated_state_bytes / mib:.2f} MiB, "
            f"{self.state_bytes_per_device / self.replicated_state_bytes:.3f}x)",
        ]
        if self.checkpoint_steps:
            lines.append(f"  checkpoints: steps {self.checkpoint_steps} in {self.checkpoint_dir}")
        if self.profile_steps is not None:
            lines.append(f"  profile: steps {self.profile_steps[0]}-{self.profile_steps[1]} -> "
                         f"{self.profile_trace or '(no perfetto trace written)'}")
        return "\n".join(lines)

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
            "first_loss": self.losses[0],
            "last_loss_mean5": float(np.mean(self.losses[-5:])),
            "median_step_time_s": self.median_step_time,
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
            "profile_steps": list(self.profile_steps) if self.profile_steps else None,
            "profile_trace": self.profile_trace,
        }


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with warm-up + cosine decay and global-norm clipping at 1.0.

    The schedule spans `TrainConfig.lr_schedule_steps`; optax's cosine decay holds its end
    value (10% of the peak) after that, which is what extended steps train at.

    The same settings return the same transformation object: it is static data of the
    ``nnx.Optimizer``, so an equal object lets `train_step` reuse its compiled program.
    """
    return _make_optimizer(float(cfg.lr), int(cfg.warmup), int(cfg.lr_schedule_steps),
                           float(cfg.weight_decay))


@functools.cache
def _make_optimizer(lr: float, warmup: int, steps: int,
                    weight_decay: float) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup_steps=max(1, warmup), decay_steps=max(steps, warmup + 1),
        end_value=lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b2=0.95, weight_decay=weight_decay))


def model_config(cfg: TrainConfig) -> TransformerConfig:
    """The `TransformerConfig` that `train` builds for `cfg`."""
    dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
    return preset(cfg.preset, vocab_size=VOCAB_SIZE, max_seq_len=cfg.seq_len, dtype=dtype,
                  remat=cfg.remat, tp_overlap=cfg.overlap, moe_experts=cfg.moe_experts,
                  moe_top_k=cfg.moe_top_k, moe_capacity_factor=cfg.moe_capacity_factor)


@nnx.jit
def train_step(model: nnx.Module, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    """One AdamW step on ``tokens: int32[batch, seq + 1]``; returns the float32 loss.

    Module-level so that repeated `train` calls with the same shapes and mesh (a resumed
    run in the same process, notebooks) reuse the compiled program.
    """
    aux_weight = model.module.cfg.moe_aux_weight
    loss, grads = nnx.value_and_grad(lm_loss)(model, tokens, aux_weight)
    optimizer.update(model, grads)
    return loss


def build_model_and_optimizer(cfg: TrainConfig) -> tuple[gtp_jax.ShardedModule, nnx.Optimizer]:
    """The GTP-sharded model (initialized from ``cfg.seed``) and its AdamW optimizer, on the
    mesh ``make_mesh(dp, gtp, tp, ep)`` over all devices: what `train` starts from (and
    what a checkpoint is restored into)."""
    mesh = gtp_jax.make_mesh(dp=cfg.dp, gtp=cfg.gtp, tp=cfg.tp, ep=cfg.ep)
    model = gtp_jax.shard(Transformer(model_config(cfg), rngs=nnx.Rngs(cfg.seed)), mesh,
                          gtp_jax.GTPConfig(gather_dtype=cfg.gather_dtype,
                                            pad_for_alignment=cfg.pad_for_alignment,
                                            gather_format=cfg.gather_format,
                                            prefetch=cfg.prefetch))
    optimizer = nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
    replicate_stray_leaves(optimizer, mesh)
    return model, optimizer


def replicate_stray_leaves(obj: nnx.Module | nnx.Optimizer, mesh: jax.sharding.Mesh) -> None:
    """Puts arrays of `obj` that are not on `mesh` (``optax`` creates its step counters on one
    device, uncommitted) replicated on it, where a jitted step leaves them after one update.

    Then step 1 sees the same input shardings as every later step (and as a restored
    checkpoint), and the step compiles once instead of twice. Values are unchanged; arrays
    already placed with a ``NamedSharding`` are left as they are.
    """
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = nnx.state(obj)
    placed = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if isinstance(value, jax.Array) and not isinstance(value.sharding,
                                                           jax.sharding.NamedSharding):
            var = var.replace(value=jax.device_put(value, replicated))
        placed.append((path, var))
    nnx.update(obj, nnx.from_flat_state(placed))


def train(cfg: TrainConfig, *, on_step: Callable[[int, float, float], None] | None = None,
          progress: bool = True, checkpoint: CheckpointConfig | None = None,
          observe: ObserveConfig | None = None) -> TrainResult:
    """Trains `cfg.preset` with GTP on the mesh ``(dp, ep, gtp, tp)`` over all devices.

    Everything that depends on the caller's input is checked before the model is built:
    the mesh against the device count, the estimated memory per device against the
    device's limit, that the checkpoint / profile / metrics paths can be written, the
    checkpoint directory's lock, and on resume that the checkpoint belongs to this run.

    Args:
      cfg: the run.
      on_step: called after each step with (step, loss, step seconds); on every process.
      progress: show a progress bar (process 0 only).
      checkpoint: save checkpoints (and with ``resume=True`` continue from the newest
        intact one: same parameters, optimizer state and LR-schedule position, data order
        and step count, so the loss curve continues exactly as the uninterrupted run's; the
        mesh may differ from the saving run's). A larger `cfg.steps` than the saved run's
        extends it (see `TrainConfig.schedule_steps`). Damaged checkpoints are skipped with
        a one-line note on stderr and renamed ``broken-<step>-<n>`` when newer than the
        one resumed from (so their steps can be saved again); nothing is deleted.
      observe: profiler trace window and JSON metrics file.

    Returns:
      A `TrainResult` with per-step losses (float32 scalars) and timings.

    Raises:
      UsageError: bad mesh, memory estimate over the device limit, unwritable paths, a
        locked directory, no intact checkpoint or a checkpoint of another run (all raised
        before any model is built), a profile window outside the run; out of device memory.
      FloatingPointError: the loss or the state to save became NaN/inf (the last finite
        checkpoint is kept).
    """
    observe = ObserveConfig() if observe is None else observe
    primary = jax.process_index() == 0
    _check_devices(cfg)
    check_memory_fits(cfg)
    if checkpoint is not None:
        check_writable_dir(checkpoint.directory, "CheckpointConfig.directory")
    if primary:
        if observe.profile_dir is not None:
            check_writable_dir(observe.profile_dir, "ObserveConfig.profile_dir")
        if observe.metrics_json is not None:
            check_writable_file(observe.metrics_json, "ObserveConfig.metrics_json")
    lock = None
    if checkpoint is not None and primary and "://" not in checkpoint.directory:
        lock = DirectoryLock(checkpoint.directory)
        lock.acquire()
    try:
        ckpt = Checkpointer(checkpoint) if checkpoint is not None else None
        try:
            return _train(cfg, on_step=on_step, progress=progress, ckpt=ckpt, observe=observe)
        finally:
            if ckpt is not None:
                # Finishes (finalizes) a pending asynchronous save, also when training failed.
                ckpt.close()
    finally:
        if lock is not None:
            lock.release()


def _note(line: str) -> None:
    """One line on stderr from process 0 (skipped checkpoints and the like)."""
    if jax.process_index() == 0:
        print(f"gtp_jax train: {line}", file=sys.stderr, flush=True)


def _check_devices(cfg: TrainConfig) -> None:
    """The mesh fits the devices and the model splits over tp and ep (checked here, before
    anything is built, so the error names the configuration rather than a weight)."""
    model_cfg = model_config(cfg)
    widths = {"n_heads": model_cfg.n_heads, "d_ff": model_cfg.d_ff}
    if model_cfg.moe_experts:
        widths["moe_d_ff"] = model_cfg.moe_d_ff or model_cfg.d_ff
    bad = [f"{name}={width}" for name, width in widths.items()
           if cfg.tp > 1 and width % cfg.tp]
    if bad:
        raise UsageError(
            f"TrainConfig.tp={cfg.tp} does not divide the {cfg.preset} preset's "
            f"{', '.join(bad)}; choose a TrainConfig.tp that divides them (tp={cfg.tp} splits "
            "the heads and the MLP width)."
        )
    if cfg.ep > 1 and model_cfg.moe_experts % cfg.ep:
        raise UsageError(
            f"TrainConfig.ep={cfg.ep} does not divide TrainConfig.moe_experts="
            f"{model_cfg.moe_experts}; choose an ep that divides the expert count."
        )
    total, devices = cfg.dp * cfg.ep * cfg.gtp * cfg.tp, jax.device_count()
    if total != devices:
        raise UsageError(
            f"the mesh dp*ep*gtp*tp = {cfg.dp}*{cfg.ep}*{cfg.gtp}*{cfg.tp} = {total} must equal "
            f"the {devices} devices; choose TrainConfig.dp/ep/gtp/tp whose product is {devices}."
        )


def check_memory_fits(cfg: TrainConfig, bytes_limit: int | None = None) -> dict[str, int]:
    """Refuses a run whose estimated memory per device exceeds the device's limit.

    Args:
      cfg: the run.
      bytes_limit: the per-device limit; None: ``memory_stats()["bytes_limit"]`` of the
        first device, and no check where the backend reports none (CPU).

    Returns:
      The estimate (`gtp_jax.observe.estimate_train_memory`).

    Raises:
      DeviceMemoryError: the estimate exceeds the limit.
    """
    estimate = estimate_train_memory(model_config(cfg), batch_size=cfg.batch_size,
                                     seq_len=cfg.seq_len, dp=cfg.dp, gtp=cfg.gtp, tp=cfg.tp,
                                     ep=cfg.ep)
    if bytes_limit is None:
        bytes_limit = device_memory_limit()
    if bytes_limit is not None and estimate["total"] > bytes_limit:
        raise DeviceMemoryError(
            f"the run needs an estimated {estimate['total'] / 2**30:.2f} GiB per device "
            f"({_memory_parts(estimate)}) but a device has {bytes_limit / 2**30:.2f} GiB; "
            + MEMORY_ADVICE
        )
    return estimate


def _memory_parts(estimate: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 2**30:.2f}" for k, v in estimate.items() if k != "total")


def _train(cfg: TrainConfig, *, on_step: Callable[[int, float, float], None] | None,
           progress: bool, ckpt: Checkpointer | None, observe: ObserveConfig) -> TrainResult:
    model_cfg = model_config(cfg)
    primary = jax.process_index() == 0
    # ---- validation: nothing below this block fails on user input before training starts.
    start, candidates = 0, []
    if ckpt is not None:
        if ckpt.config.resume:
            candidates = ckpt.resume_candidates(report=_note)
            if not candidates:
                raise UsageError(
                    f"no intact checkpoint in {ckpt.config.directory!r} to resume from; pass "
                    "the CheckpointConfig.directory of an earlier run, or drop "
                    "CheckpointConfig.resume to start a new run."
                )
            cfg = _check_resume(cfg, model_cfg, candidates[0][1], ckpt.config.directory,
                                steps_left=False)
            while candidates and candidates[0][0] >= cfg.steps:
                # Nothing left to train from this one, unless it is damaged: verify it
                # before saying so (an older intact checkpoint may still have steps left).
                try:
                    ckpt.verify(candidates[0][0])
                except CheckpointCorruptError as err:
                    _note(f"skipping {err}")
                    candidates.pop(0)
                    continue
                _check_resume(cfg, model_cfg, candidates[0][1], ckpt.config.directory)
            if not candidates:
                raise UsageError(f"no intact checkpoint in {ckpt.config.directory!r} to resume "
                                 "from (each was skipped, see above).")
        elif ckpt.latest_step() is not None:
            raise UsageError(
                f"CheckpointConfig.directory {ckpt.config.directory!r} already holds "
                f"checkpoints (steps {ckpt.all_steps()}); set CheckpointConfig.resume to "
                "continue that run, or use an empty directory for a new run."
            )
    if cfg.schedule_steps is None:
        # Recorded explicitly in checkpoints, so extending the run keeps this schedule.
        cfg = dataclasses.replace(cfg, schedule_steps=cfg.steps)
    window = observe.profile_window((candidates[0][0] if candidates else 0) + 1, cfg.steps)

    model, optimizer = build_model_and_optimizer(cfg)
    mesh = model.mesh
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed)))
    replicated_params = _tree_bytes(nnx.state(abstract, nnx.Param))
    replicated_state = replicated_params + _tree_bytes(jax.eval_shape(
        make_optimizer(cfg).init, nnx.state(abstract, nnx.Param)))

    train_data, _ = split_train_eval(load_corpus())
    meta = None
    for step, candidate in candidates:
        # Newest first; a checkpoint whose arrays fail their checksums (or cannot be read)
        # is skipped in favour of the next older one. The model is only changed by a
        # restore that verified.
        try:
            _check_resume(cfg, model_cfg, candidate, ckpt.config.directory)
            ckpt.restore(model, optimizer, step=step)
        except CheckpointCorruptError as err:
            _note(f"skipping {err}")
            continue
        meta, start = candidate, step
        break
    if candidates and meta is None:
        raise UsageError(f"no intact checkpoint in {ckpt.config.directory!r} to resume from "
                         "(each was skipped, see above).")
    if meta is not None:
        for moved in ckpt.set_aside_newer(start):
            _note(f"renamed the damaged checkpoint newer than step {start} to {moved} "
                  "(not deleted; this run saves those steps again)")
        batcher = ByteBatcher.from_state(train_data, meta["extra"]["data"])
    else:
        batcher = ByteBatcher(train_data, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                              seed=cfg.seed)

    placement = gtp_jax.data_sharding(mesh)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    bar = ProgressBar(cfg.steps) if progress and primary else None
    profiler = StepProfiler(observe.profile_dir, window) if window is not None else None
    extra = {"train_config": dataclasses.asdict(cfg), "model_config": _model_json(model_cfg)}
    losses, times, saved = [], [], []
    try:
        for step in range(start + 1, cfg.steps + 1):
            if profiler is not None:
                profiler.before(step)
            tokens = _global_batch(batcher.next_batch(), placement)
            with jax.profiler.StepTraceAnnotation("train", step_num=step):
                begin = time.perf_counter()
                loss = _run_step(cfg, model, optimizer, tokens, step)
                times.append(time.perf_counter() - begin)
            if profiler is not None:
                profiler.after(step)
            losses.append(loss)
            if not np.isfinite(loss):
                raise FloatingPointError(
                    f"loss became {loss} at step {step}; lower TrainConfig.lr (now {cfg.lr})"
                    + (f"; the last checkpoint is step {saved[-1]}" if saved else "") + ".")
            if ckpt is not None and (step == cfg.steps
                                     or (ckpt.config.every and step % ckpt.config.every == 0)):
                # Refuses (NonFiniteStateError) a state with NaN/inf: the loss above was
                # computed before this step's update, the checked state is the one saved.
                ckpt.save(step, model, optimizer,
                          extra={**extra, "data": batcher.state_dict(), "loss": loss})
                saved.append(step)
            if bar is not None:
                bar.update(step, loss=loss, tok_s=tokens_per_step / times[-1])
            if on_step is not None:
                on_step(step, loss, times[-1])
    finally:
        if profiler is not None:
            profiler.stop()
    if ckpt is not None:
        # Report only the checkpoints still on disk (CheckpointConfig.keep deletes older).
        ckpt.wait()
        present = set(ckpt.all_steps())
        saved = [s for s in saved if s in present]
    device = jax.devices()[0]
    result = TrainResult(
        losses=losses,
        step_times=times,
        tokens_per_step=tokens_per_step,
        param_bytes_per_device=gtp_jax.bytes_per_device(nnx.state(model, nnx.Param)),
        state_bytes_per_device=gtp_jax.bytes_per_device(nnx.state(model, nnx.Param))
        + gtp_jax.bytes_per_device(nnx.state(optimizer, nnx.OptState)),
        replicated_param_bytes=replicated_params,
        replicated_state_bytes=replicated_state,
        num_params=model_cfg.num_params(),
        mesh_shape=dict(mesh.shape),
        backend=jax.default_backend(),
        first_step=start + 1,
        flops_per_token=model_cfg.train_flops_per_token(cfg.seq_len),
        device_kind=device.device_kind,
        num_devices=mesh.devices.size,
        compute_dtype=cfg.dtype,
        peak_flops_per_device=peak_flops(device.device_kind, cfg.dtype)
        if jax.default_backend() != "cpu" else None,
        memory=memory_per_device(),
        process_count=jax.process_count(),
        checkpoint_dir=ckpt.config.directory if ckpt is not None else None,
        checkpoint_steps=saved,
        profile_steps=window,
        profile_trace=profiler.trace_path if profiler is not None else None,
    )
    if observe.metrics_json is not None and primary:
        write_json(observe.metrics_json, {
            "config": dataclasses.asdict(cfg),
            "model_config": _model_json(model_cfg),
            "steps": [{"step": start + 1 + i, "loss": loss, "step_time_s": t,
                       "tokens_per_s": tokens_per_step / t}
                      for i, (loss, t) in enumerate(zip(losses, times))],
            "summary": result.to_json(),
        })
    return result


def _global_batch(batch: np.ndarray, sharding: jax.sharding.NamedSharding) -> jax.Array:
    """The global batch ``int32[batch, seq + 1]`` as one array split over the data axes.

    Every process builds the same global batch (the batcher is deterministic in (seed,
    position)) and hands each of its devices the rows of that device's shard, so a
    multi-process run sees exactly the batches of a single-process run. Only the local rows
    are copied to devices.
    """
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])


def _model_json(model_cfg: TransformerConfig) -> dict[str, Any]:
    out = {}
    for field in dataclasses.fields(model_cfg):
        value = getattr(model_cfg, field.name)
        out[field.name] = (value if isinstance(value, (int, float, str, bool, type(None)))
                           else str(np.dtype(value)))
    return out


def _run_step(cfg: TrainConfig, model: nnx.Module, optimizer: nnx.Optimizer,
              tokens: jax.Array, step: int) -> float:
    """`train_step`, with XLA's out-of-memory error turned into a `DeviceMemoryError`."""
    try:
        return float(train_step(model, optimizer, tokens))
    except Exception as err:  # XlaRuntimeError has no stable import path; match its status
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        estimate = estimate_train_memory(model_config(cfg), batch_size=cfg.batch_size,
                                         seq_len=cfg.seq_len, dp=cfg.dp, gtp=cfg.gtp,
                                         tp=cfg.tp, ep=cfg.ep)
        raise DeviceMemoryError(
            f"out of device memory at step {step} (estimated {estimate['total'] / 2**30:.2f} "
            f"GiB per device: {_memory_parts(estimate)}); " + MEMORY_ADVICE
        ) from err


def _check_resume(cfg: TrainConfig, model_cfg: TransformerConfig, meta: dict[str, Any],
                  directory: str, *, steps_left: bool = True) -> TrainConfig:
    """Raises UsageError unless checkpoint `meta` belongs to a run `cfg` can continue (and,
    with `steps_left`, has steps left to train).

    Returns `cfg` with ``schedule_steps`` set to the saved run's schedule length, so that
    a run extended with a larger ``steps`` keeps its original LR schedule.
    """
    extra = meta.get("extra", {})
    saved_cfg, saved_model = extra.get("train_config"), extra.get("model_config")
    if (not isinstance(saved_cfg, dict) or not isinstance(saved_model, dict)
            or not isinstance(extra.get("data"), dict)):
        raise UsageError(
            f"checkpoint in {directory!r} (step {meta.get('step')}) was not written by "
            "`python -m gtp_jax train`; point CheckpointConfig.directory at a training run's "
            "checkpoints."
        )
    saved_schedule = saved_cfg.get("schedule_steps") or saved_cfg.get("steps")
    if cfg.schedule_steps is None:
        cfg = dataclasses.replace(cfg, schedule_steps=saved_schedule)
    saved_cfg = {**saved_cfg, "schedule_steps": saved_schedule}
    mine = dataclasses.asdict(cfg)
    differ = [f"{k}: checkpoint {saved_cfg.get(k)!r} vs now {mine[k]!r}"
              for k in mine if k not in RESUME_MAY_DIFFER and saved_cfg.get(k) != mine[k]]
    model_now = _model_json(model_cfg)
    differ += [f"model {k}: checkpoint {saved_model.get(k)!r} vs now {model_now[k]!r}"
               for k in model_now
               if k not in MODEL_MAY_DIFFER and saved_model.get(k) != model_now[k]]
    if differ:
        raise UsageError(
            f"CheckpointConfig.resume: the checkpoint in {directory!r} belongs to a different "
            "run (" + "; ".join(differ) + "). Pass the same TrainConfig as the saved run (only "
            f"{sorted(RESUME_MAY_DIFFER)} may change), or start a new run in another "
            "CheckpointConfig.directory."
        )
    step = int(meta["step"])
    if extra["data"].get("position") != step:
        raise UsageError(
            f"checkpoint in {directory!r}: data position {extra['data'].get('position')} does "
            f"not match step {step}; the checkpoint is inconsistent, resume from another step."
        )
    if steps_left and step >= cfg.steps:
        state = "finished" if step == cfg.steps else f"past TrainConfig.steps={cfg.steps}"
        raise UsageError(
            f"CheckpointConfig.resume: the run in {directory!r} is {state} (checkpoint at step "
            f"{step}); nothing is left to train. To extend it, pass a larger TrainConfig.steps "
            f"(e.g. TrainConfig.steps={step + max(1, step // 5)}): the added steps train at the "
            "schedule's final learning rate."
        )
    return cfg


def _tree_bytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "shape"))
