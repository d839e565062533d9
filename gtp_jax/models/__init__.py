"""Reference models written in plain Flax NNX."""

from gtp_jax.models.transformer import (
    PRESETS,
    Transformer,
    TransformerConfig,
    lm_loss,
    preset,
)

__all__ = ["PRESETS", "Transformer", "TransformerConfig", "lm_loss", "preset"]
