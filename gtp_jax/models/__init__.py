"""Reference models written in plain Flax NNX."""

from gtp_jax.models.transformer import (
    PRESETS,
    LMOutput,
    Transformer,
    TransformerConfig,
    lm_loss,
    preset,
)

__all__ = ["LMOutput", "PRESETS", "Transformer", "TransformerConfig", "lm_loss", "preset"]
