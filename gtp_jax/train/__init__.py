"""The training application: `train` a preset transformer (or your own model,
`TrainConfig.model`) with GTP on the bundled corpus or your text; `fit` a model built in
code on your batches.

`config` (`TrainConfig`, resolved once into a `Run` that every later stage reads), `loop`
(`train`: the run, top to bottom), `user_model` (your model's factory: ``--model``),
`fitter` (`fit`), `data_source`, and one folder per concern: `step`
(`TrainStep`, the optimizer, the memory bound), `lifecycle` (checkpoints, resume, warm
starts, preemption, the lock, training through a failure), `outputs` (progress, the
summary, the metrics log, traces), `cli` (``python -m gtp_jax train``), `processes`
(several processes: joining and launching).
"""

from gtp_jax.train.config import (
    MODEL_MAY_DIFFER,
    RESUME_MAY_DIFFER,
    Run,
    TrainConfig,
    make_optimizer,
    model_config,
    resolve,
)
from gtp_jax.train.fitter import fit
from gtp_jax.train.lifecycle.checkpoint import (
    CheckpointConfig,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointWriteError,
    NonFiniteStateError,
    Restored,
)
from gtp_jax.train.lifecycle.preempt import RESUMABLE_EXIT, RunStopped
from gtp_jax.train.lifecycle.resume import RunFinished
from gtp_jax.train.loop import build_model_and_optimizer, replicated_bytes, train
from gtp_jax.train.outputs.observe import DeviceMemoryError, ObserveConfig
from gtp_jax.train.outputs.report import TrainResult
from gtp_jax.train.processes.distributed import DistributedConfig
from gtp_jax.train.step.memory import check_memory_fits, memory_bound
from gtp_jax.train.step.padding_check import check_optimizer
from gtp_jax.train.step.train_step import TrainStep, replicate_stray_leaves
from gtp_jax.train.user_model import ModelSizes, next_token_loss

__all__ = [
    "MODEL_MAY_DIFFER",
    "RESUMABLE_EXIT",
    "RESUME_MAY_DIFFER",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointWriteError",
    "Checkpointer",
    "DeviceMemoryError",
    "DistributedConfig",
    "ModelSizes",
    "NonFiniteStateError",
    "ObserveConfig",
    "Restored",
    "Run",
    "RunFinished",
    "RunStopped",
    "TrainConfig",
    "TrainResult",
    "TrainStep",
    "build_model_and_optimizer",
    "check_memory_fits",
    "check_optimizer",
    "fit",
    "memory_bound",
    "make_optimizer",
    "model_config",
    "next_token_loss",
    "replicate_stray_leaves",
    "replicated_bytes",
    "resolve",
    "train",
]
