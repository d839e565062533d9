"""Reference models written in plain Flax NNX."""

from gtp_jax.models.hf import from_hf, to_hf
from gtp_jax.models.transformer import (
    PRESETS,
    LMOutput,
    Transformer,
    TransformerConfig,
    lm_loss,
    lm_loss_and_metrics,
    preset,
)

__all__ = ["LMOutput", "PRESETS", "Transformer", "TransformerConfig", "from_hf", "lm_loss",
           "lm_loss_and_metrics", "preset", "to_hf"]
