"""The training application: `train` a preset transformer with GTP on the bundled corpus.

Modules: `config` (`TrainConfig`, the optimizer and model it implies), `step` (`TrainStep`:
the one jitted training step, also used by the benchmarks), `loop` (`train`), `resume`,
`memory` (the lower bound of a run's memory per device, and the refusals that use it),
`report` (`TrainResult`), `checkpoint`, `distributed`, `observe`, `progress`, and `cli`
(``python -m gtp_jax train``).
"""

from gtp_jax.train.config import (
    MODEL_MAY_DIFFER,
    RESUME_MAY_DIFFER,
    TrainConfig,
    make_optimizer,
    model_config,
)
from gtp_jax.train.lifecycle.checkpoint import (
    CheckpointConfig,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointWriteError,
    NonFiniteStateError,
)
from gtp_jax.train.lifecycle.preempt import RESUMABLE_EXIT, RunStopped
from gtp_jax.train.lifecycle.resume import RunFinished
from gtp_jax.train.loop import build_model_and_optimizer, replicated_bytes, train
from gtp_jax.train.outputs.observe import DeviceMemoryError, ObserveConfig
from gtp_jax.train.outputs.report import TrainResult
from gtp_jax.train.processes.distributed import DistributedConfig
from gtp_jax.train.step.memory import check_memory_fits, memory_bound
from gtp_jax.train.step.train_step import TrainStep, replicate_stray_leaves

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
    "NonFiniteStateError",
    "ObserveConfig",
    "RunFinished",
    "RunStopped",
    "TrainConfig",
    "TrainResult",
    "TrainStep",
    "build_model_and_optimizer",
    "check_memory_fits",
    "memory_bound",
    "make_optimizer",
    "model_config",
    "replicate_stray_leaves",
    "replicated_bytes",
    "train",
]
