"""A decoder written the way a user would: blocks of ``nnx.Linear`` attention and MLP that
the library never saw, stacked with `gtp_jax.Stack`.

Used by ``python -m gtp_jax.bench overlap`` (the ``user_*`` variants) to measure what a
user's own model gets under `gtp_jax.shard`: on the stack (``loop="stack"``, the default)
the library's layer loop (the next layer gathered while this one computes, gradients
reduce-scattered behind the backward pass); as first written (``loop="python"``: a Python
loop over the blocks, each under the user's own ``nnx.remat``) weights gathered where they
are read, scheduled by XLA.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gtp_jax.models.transformer import save_dots_and_attention
from gtp_jax.sharding.stack import Stack

#: How `UserDecoder` runs its blocks: `gtp_jax.Stack`, or a Python loop over a list.
LOOPS = ("stack", "python")
#: `UserDecoderConfig.remat` values and their ``jax.checkpoint`` policies.
REMATS = {"none": None, "dots": save_dots_and_attention,
          "full": jax.checkpoint_policies.nothing_saveable}


@dataclasses.dataclass(frozen=True)
class UserDecoderConfig:
    """Sizes of `UserDecoder` (defaults: the benchmark's d 2048, 16 blocks).

    Attributes:
      remat: what each block saves for the backward pass, one of `REMATS`: "full"
        recomputes it from its input (``nnx.remat``'s default policy,
        ``jax.checkpoint_policies.nothing_saveable``); "dots" saves matmul outputs and the
        fused attention's output (the bundled decoder's default policy,
        `gtp_jax.models.transformer.save_dots_and_attention`); "none": no remat.
      attention: ``jax.nn.dot_product_attention``'s ``implementation``: "cudnn" (the fused
        flash kernel a GPU user picks), "xla", or None (jax's default, XLA's attention with
        the ``seq x seq`` scores materialized).
      loop: one of `LOOPS`.
      unroll: the stack's `gtp_jax.Stack` ``unroll`` (None: its default, unrolled unless
        `remat`); no effect on the Python loop.
    """

    vocab: int = 32000
    d_model: int = 2048
    n_blocks: int = 16
    n_heads: int = 16
    d_ff: int = 8192
    remat: str = "full"
    attention: str | None = None
    dtype: Any = jnp.bfloat16
    loop: str = "stack"
    unroll: bool | None = None

    def __post_init__(self) -> None:
        if self.loop not in LOOPS:
            raise ValueError(f"UserDecoderConfig.loop={self.loop!r}; choose one of {LOOPS}.")
        if self.remat not in REMATS:
            raise ValueError(f"UserDecoderConfig.remat={self.remat!r}; choose one of "
                             f"{tuple(REMATS)}.")

    @property
    def remat_policy(self) -> Any:
        """The ``jax.checkpoint`` policy of `remat` (None: no remat)."""
        return REMATS[self.remat]

    def train_flops_per_token(self, seq: int) -> float:
        """Matmul FLOPs of one training token (forward + backward, causal attention)."""
        d, f = self.d_model, self.d_ff
        per_block = 4 * d * d + 2 * d * f + seq * d  # projections, MLP, QK^T + AV (causal)
        return 6.0 * (self.n_blocks * per_block + d * self.vocab)


class _Block(nnx.Module):
    def __init__(self, cfg: UserDecoderConfig, rngs: nnx.Rngs):
        common = {"use_bias": False, "dtype": cfg.dtype, "rngs": rngs}
        self.heads = cfg.n_heads
        self.attention = cfg.attention
        self.norm1 = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.qkv = nnx.Linear(cfg.d_model, 3 * cfg.d_model, **common)
        self.out = nnx.Linear(cfg.d_model, cfg.d_model, **common)
        self.norm2 = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, **common)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads) for t in (q, k, v))
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                           implementation=self.attention)
        x = x + self.out(att.reshape(b, s, d))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class UserDecoder(nnx.Module):
    """Token ids ``[batch, seq]`` (int) -> logits ``[batch, seq, vocab]`` (float32)."""

    def __init__(self, cfg: UserDecoderConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        if cfg.loop == "stack":
            self.blocks = Stack(
                lambda r: _Block(cfg, r), cfg.n_blocks, rngs=rngs, unroll=cfg.unroll,
                remat=cfg.remat_policy)
        else:
            self.blocks = nnx.List([_Block(cfg, rngs) for _ in range(cfg.n_blocks)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=cfg.dtype,
                               rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        if isinstance(self.blocks, Stack):
            return self.head(self.norm(self.blocks(x))).astype(jnp.float32)
        for block in self.blocks:
            if self.cfg.remat_policy is not None:
                x = nnx.remat(lambda blk, h: blk(h), policy=self.cfg.remat_policy)(block, x)
            else:
                x = block(x)
        return self.head(self.norm(x)).astype(jnp.float32)


def user_loss(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """Next-token cross entropy of ``tokens [batch, seq + 1]`` (mean over all positions)."""
    logits = model(tokens[:, :-1])
    return jnp.mean(
        -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))
