"""The main job: train a preset transformer with GTP on the bundled byte corpus."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import gtp_jax
from gtp_jax.data import VOCAB_SIZE, ByteBatcher, load_corpus, split_train_eval
from gtp_jax.models import Transformer, lm_loss, preset
from gtp_jax.progress import ProgressBar


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
      preset: model preset name (`gtp_jax.models.PRESETS`); the vocabulary is set to 256
        byte tokens for the bundled corpus.
      steps: optimizer steps.
      batch_size: global batch (sequences), split over the mesh's data axes.
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

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be >= 1.")
        if self.warmup < 0:
            raise ValueError(f"TrainConfig.warmup={self.warmup} must be >= 0.")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"TrainConfig.dtype={self.dtype!r}: use 'float32' or 'bfloat16'.")


@dataclasses.dataclass
class TrainResult:
    """What a run measured."""

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

    @property
    def median_step_time(self) -> float:
        """Median step time in seconds, excluding the first (compiling) step."""
        times = self.step_times[1:] or self.step_times
        return statistics.median(times)

    def summary(self) -> str:
        first = self.losses[0]
        last = float(np.mean(self.losses[-5:]))
        mib = 2.0**20
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        return "\n".join([
            f"summary ({self.backend}, mesh {mesh}, {self.num_params / 1e6:.2f}M params)",
            f"  loss: first {first:.4f} -> last {last:.4f} (mean of last 5 steps)",
            f"  step time: {self.median_step_time * 1e3:.1f} ms median "
            f"({self.tokens_per_step / self.median_step_time:,.0f} tokens/s)",
            f"  params per device: {self.param_bytes_per_device / mib:.2f} MiB "
            f"(replicated: {self.replicated_param_bytes / mib:.2f} MiB, "
            f"{self.param_bytes_per_device / self.replicated_param_bytes:.3f}x)",
            f"  params + optimizer state per device: {self.state_bytes_per_device / mib:.2f} MiB "
            f"(replicated: {self.replicated_state_bytes / mib:.2f} MiB, "
            f"{self.state_bytes_per_device / self.replicated_state_bytes:.3f}x)",
        ])


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with warm-up + cosine decay and global-norm clipping at 1.0."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup_steps=max(1, cfg.warmup), decay_steps=max(cfg.steps, cfg.warmup + 1),
        end_value=cfg.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b2=0.95, weight_decay=cfg.weight_decay))


def train(cfg: TrainConfig, *, on_step: Callable[[int, float, float], None] | None = None,
          progress: bool = True) -> TrainResult:
    """Trains `cfg.preset` with GTP on the mesh ``(dp, ep, gtp, tp)`` over all devices.

    Returns:
      A `TrainResult` with per-step losses (float32 scalars) and timings.
    """
    mesh = gtp_jax.make_mesh(dp=cfg.dp, gtp=cfg.gtp, tp=cfg.tp, ep=cfg.ep)
    dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
    model_cfg = preset(cfg.preset, vocab_size=VOCAB_SIZE, max_seq_len=cfg.seq_len, dtype=dtype,
                       remat=cfg.remat)
    model = Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed))
    tx = make_optimizer(cfg)
    replicated_params = _tree_bytes(nnx.state(model, nnx.Param))
    replicated_state = replicated_params + _tree_bytes(jax.eval_shape(
        tx.init, nnx.state(model, nnx.Param)))
    model = gtp_jax.shard(model, mesh, gtp_jax.GTPConfig(
        gather_dtype=cfg.gather_dtype, pad_for_alignment=cfg.pad_for_alignment))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model: nnx.Module, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(lm_loss)(model, tokens)
        optimizer.update(model, grads)
        return loss

    train_data, _ = split_train_eval(load_corpus())
    batcher = ByteBatcher(train_data, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                          seed=cfg.seed)
    placement = gtp_jax.data_sharding(mesh)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    bar = ProgressBar(cfg.steps) if progress else None
    losses, times = [], []
    for step in range(1, cfg.steps + 1):
        tokens = jax.device_put(jnp.asarray(batcher.next_batch()), placement)
        start = time.perf_counter()
        loss = float(train_step(model, optimizer, tokens))
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if not np.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {step}; lower --lr.")
        if bar is not None:
            bar.update(step, loss=loss, tok_s=tokens_per_step / times[-1])
        if on_step is not None:
            on_step(step, loss, times[-1])
    return TrainResult(
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
    )


def _tree_bytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "shape"))
