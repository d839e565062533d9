"""A model of your own for the trainer:

    python -m gtp_jax train --model examples.own_model:make_model --steps 100

A small causal decoder in plain Flax NNX whose blocks sit in a `gtp_jax.Stack`, so that,
sharded, they run on the library's layer loop (the next layer's weights gathered while
this one computes). The contract of ``make_model`` is in docs/your_model.md.
"""

import jax
from flax import nnx

import gtp_jax


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, dtype, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, dtype=dtype, decode=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x, mask):                     # [batch, seq, d] -> the same
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Decoder(nnx.Module):
    def __init__(self, sizes, rngs: nnx.Rngs, d: int = 64, heads: int = 4, layers: int = 4):
        self.embed = nnx.Embed(sizes.vocab_size, d, dtype=sizes.dtype, rngs=rngs)
        self.blocks = gtp_jax.Stack(lambda r: Block(d, heads, sizes.dtype, r), layers,
                                    rngs=rngs, remat=sizes.remat_policy)
        self.norm = nnx.RMSNorm(d, dtype=sizes.dtype, rngs=rngs)
        self.head = nnx.Linear(d, sizes.vocab_size, dtype=sizes.dtype, rngs=rngs)

    def __call__(self, tokens):                      # int32[batch, seq] -> logits
        mask = nnx.make_causal_mask(tokens)
        return self.head(self.norm(self.blocks(self.embed(tokens), mask)))


def make_model(rngs: nnx.Rngs, sizes: gtp_jax.train.ModelSizes) -> nnx.Module:
    return Decoder(sizes, rngs)                      # the loss: next-token, on the logits
