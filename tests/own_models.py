"""Model factories for ``python -m gtp_jax train --model own_models:<factory>`` in the tests
(tests/test_own_model.py): a small decoder in plain Flax NNX, and factories that break the
contract."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gtp_jax.train import ModelSizes, next_token_loss


class Block(nnx.Module):
    """Pre-norm residual MLP block: ``[batch, seq, d] -> [batch, seq, d]``."""

    def __init__(self, d: int, dtype, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d, 3 * d, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(3 * d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Decoder(nnx.Module):
    """Tokens ``int32[batch, seq]`` -> logits ``[batch, seq, vocab]`` (causal only in that
    each position sees its own token: enough to learn bigrams)."""

    def __init__(self, sizes: ModelSizes, rngs: nnx.Rngs, d: int = 40, n: int = 2):
        self.embed = nnx.Embed(sizes.vocab_size, d, dtype=sizes.dtype, rngs=rngs)
        self.blocks = nnx.List([Block(d, sizes.dtype, rngs) for _ in range(n)])
        self.head = nnx.Linear(d, sizes.vocab_size, dtype=sizes.dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_decoder(rngs: nnx.Rngs, sizes: ModelSizes) -> nnx.Module:
    """The default loss: next-token cross-entropy on the decoder's logits."""
    return Decoder(sizes, rngs)


def twice_the_loss(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    return 2.0 * next_token_loss(model, tokens)


def make_with_loss(rngs: nnx.Rngs, sizes: ModelSizes):
    """The decoder and its own loss."""
    return Decoder(sizes, rngs), twice_the_loss


def returns_a_number(rngs: nnx.Rngs, sizes: ModelSizes):
    return 3


def returns_a_bad_loss(rngs: nnx.Rngs, sizes: ModelSizes):
    return Decoder(sizes, rngs), "cross-entropy"


class Features(nnx.Module):
    """Returns features ``[batch, seq, 40]``, not logits over the vocabulary."""

    def __init__(self, sizes: ModelSizes, rngs: nnx.Rngs):
        self.embed = nnx.Embed(sizes.vocab_size, 40, rngs=rngs)
        self.proj = nnx.Linear(40, 40, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.proj(self.embed(tokens)).astype(jnp.float32)


def make_features(rngs: nnx.Rngs, sizes: ModelSizes) -> nnx.Module:
    return Features(sizes, rngs)


not_callable = 42
