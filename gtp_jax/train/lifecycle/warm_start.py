"""Warm start (`TrainConfig.init_from`): a new run that starts from another run's weights.

Only the model's arrays are read (from the newest intact checkpoint of the source
directory); the optimizer state, step count, LR schedule and data position are the new
run's own, and so is every hyperparameter. The source may have been written on any mesh:
`Checkpointer.restore` reads each shard straight into the new mesh's layout and verifies
every array's checksum. The source directory is opened read-only (no lock, no clean-up of
its temporary files), so a run still writing there is not disturbed.

The model's *shape* must match the saving run's: `check_init_from` compares every
`TransformerConfig` field except those that only change how the model computes or what it
may be applied to (`WARM_START_MAY_DIFFER`), before anything is built.
"""

from __future__ import annotations

import os

from flax import nnx

from gtp_jax.base.errors import UsageError
from gtp_jax.models import TransformerConfig
from gtp_jax.train.config import MODEL_MAY_DIFFER, TrainConfig, model_differences
from gtp_jax.train.lifecycle.checkpoint import (
    CheckpointConfig,
    CheckpointCorruptError,
    Checkpointer,
)
from gtp_jax.train.lifecycle.resume import Candidate, note
from gtp_jax.train.user_model import UserModel

#: `TransformerConfig` fields a warm-started run may set differently from the saving run's:
#: they do not change which arrays the model holds or their shapes (compute dtype, sequence
#: length limit, MoE routing knobs, the layout-only `MODEL_MAY_DIFFER`; a `UserModel`'s
#: ``seq_len``). Every other field, including any added later, must be equal (a `UserModel`:
#: the same factory and vocabulary; `Checkpointer.restore` checks its arrays' shapes).
WARM_START_MAY_DIFFER = MODEL_MAY_DIFFER | frozenset({
    "dtype", "max_seq_len", "moe_top_k", "moe_capacity_factor", "moe_aux_weight",
    "cp_attention", "cp_layout", "seq_len"})

#: The flags (and `TrainConfig` fields) that choose the model's shape, for the error message.
_SHAPE_FIELDS = ("preset", "model", "moe_experts", "vocab_size", "init_from_hf")


def check_init_from(cfg: TrainConfig, model_cfg: TransformerConfig | UserModel
                    ) -> list[Candidate]:
    """The intact checkpoints of ``cfg.init_from``, newest first, after checking (from their
    metadata, reading no array) that the newest holds a model of `model_cfg`'s shape.

    Raises:
      UsageError: the directory holds no intact `train` checkpoint, or its model's shape
        differs (naming the differing fields and the saving run's values).
    """
    directory = cfg.init_from
    source = open_source(directory)
    try:
        candidates = source.resume_candidates(report=note)
    finally:
        source.close()
    if not candidates:
        raise UsageError(f"TrainConfig.init_from={directory!r} holds no intact checkpoint to "
                         "load weights from; pass the CheckpointConfig.directory of a "
                         "training run.")
    _check_shape(model_cfg, candidates[0], directory)
    return candidates


def load_weights(cfg: TrainConfig, candidates: list[Candidate], model: nnx.Module) -> int:
    """Restores the model arrays of the newest intact candidate of ``cfg.init_from`` into
    `model` (any mesh; the optimizer is not touched); returns the step it was saved at.
    A checkpoint that fails its checksums is skipped (one line on stderr) for the next
    older one; `model` changes only by a restore that verified.

    Raises:
      UsageError: every candidate was damaged.
    """
    source = open_source(cfg.init_from)
    try:
        for step, _ in candidates:
            try:
                source.restore(model, None, step=step)
            except CheckpointCorruptError as err:
                note(f"skipping {err}")
                continue
            return step
    finally:
        source.close()
    raise UsageError(f"TrainConfig.init_from={cfg.init_from!r}: no intact checkpoint to load "
                     "weights from (each was skipped, see above).")


def open_source(directory: str) -> Checkpointer:
    """A read-only `Checkpointer` of `directory` (which must exist)."""
    if "://" not in directory and not os.path.isdir(directory):
        raise UsageError(f"TrainConfig.init_from={directory!r} is not a directory; pass "
                         "the CheckpointConfig.directory of a training run.")
    return Checkpointer(CheckpointConfig(directory), read_only=True)


def _check_shape(model_cfg: TransformerConfig | UserModel, candidate: Candidate,
                 directory: str) -> None:
    step, meta = candidate
    extra = meta.get("extra", {})
    saved_model, saved_cfg = extra.get("model_config"), extra.get("train_config")
    if not isinstance(saved_model, dict) or not isinstance(saved_cfg, dict):
        raise UsageError(f"TrainConfig.init_from={directory!r} (step {step}) was not written "
                         "by `python -m gtp_jax train`; pass a training run's checkpoint "
                         "directory.")
    differ = [d.removeprefix("model ") for d in
              model_differences(model_cfg, saved_model, WARM_START_MAY_DIFFER)]
    if differ:
        given = ", ".join(f"TrainConfig.{k}={saved_cfg.get(k)!r}" for k in _SHAPE_FIELDS
                          if saved_cfg.get(k) is not None or k == "preset")
        raise UsageError(
            f"TrainConfig.init_from={directory!r}: its model has another shape ("
            + "; ".join(differ) + f"). The saving run had {given}; pass the same model "
            "(the learning rate, steps, mesh and other training options may differ).")


__all__ = ["WARM_START_MAY_DIFFER", "check_init_from", "load_weights"]
