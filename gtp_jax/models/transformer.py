"""A decoder-only transformer in plain Flax NNX, with its layers stacked for ``lax.scan``.

RMSNorm, rotary attention, SwiGLU MLP, tied or untied embeddings. The blocks are created
with ``nnx.vmap`` (one stacked parameter per weight, leading dim = layer) and marked with
``gtp_stacked`` metadata, so `gtp_jax.shard` splits them on dim 1 and `gtp_jax.scan_layers`
gathers one layer at a time. Unsharded, the same module is an ordinary NNX model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gtp_jax.sharding.plan import STACKED
from gtp_jax.sharding.scan import scan_layers

REMAT_POLICIES = ("none", "dots", "full")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes and numerics of the decoder.

    Attributes:
      vocab_size, d_model, n_heads, n_layers, d_ff: model sizes (``d_ff`` is the SwiGLU
        hidden width; ``d_model`` must divide by ``n_heads``).
      max_seq_len: longest sequence (rotary tables are built per call, so this is a check).
      tie_embeddings: the output head reuses the input embedding.
      dtype: compute dtype (activations, gathered weights); params stay in `param_dtype`.
      param_dtype: dtype of the stored (master) parameters.
      rope_theta: rotary base.
      norm_eps: RMSNorm epsilon.
      remat: activation recompute inside each layer: "none" (keep what autodiff keeps),
        "dots" (save matmul outputs only), "full" (save layer inputs only). Gathered GTP
        weights are never saved in any mode.
      attention_impl: passed to ``jax.nn.dot_product_attention`` (None, "xla", "cudnn").
    """

    vocab_size: int = 256
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int = 352
    max_seq_len: int = 128
    tie_embeddings: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    remat: str = "none"
    attention_impl: str | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerConfig.{name}={value!r} must be a positive int.")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"TransformerConfig.d_model={self.d_model} must be divisible by "
                f"n_heads={self.n_heads}."
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"TransformerConfig: head dim {self.d_model // self.n_heads} must be even "
                "for rotary embeddings; change d_model or n_heads."
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"TransformerConfig.remat={self.remat!r}; choose one of {REMAT_POLICIES}."
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def num_params(self) -> int:
        """Parameter count (embeddings included)."""
        d, f = self.d_model, self.d_ff
        per_layer = 4 * d * d + 3 * d * f + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + emb + d

    def train_flops_per_token(self, seq_len: int) -> float:
        """Matmul FLOPs per trained token: 6*(block + head params) + 6*L*d*T (causal attn).

        The same formula as the peer baselines in the benchmarks (embedding lookup not
        counted, causal attention counted at half of 12*L*d*T).
        """
        d, f = self.d_model, self.d_ff
        block = self.n_layers * (4 * d * d + 3 * d * f)
        return 6.0 * (block + self.vocab_size * d) + 6.0 * self.n_layers * d * seq_len


PRESETS: dict[str, TransformerConfig] = {
    # ~0.8M params; trains in seconds on a simulated CPU mesh.
    "tiny": TransformerConfig(),
    # ~23M params.
    "small": TransformerConfig(vocab_size=32000, d_model=512, n_heads=8, n_layers=6,
                               d_ff=1408, max_seq_len=1024, tie_embeddings=True),
    # ~110M params.
    "100m": TransformerConfig(vocab_size=32000, d_model=768, n_heads=12, n_layers=12,
                              d_ff=2048, max_seq_len=1024, tie_embeddings=True),
    # 0.95B params: the GPU benchmark model (same as the PyTorch/XLA peer baselines).
    "1b": TransformerConfig(vocab_size=32000, d_model=2048, n_heads=16, n_layers=16,
                            d_ff=5632, max_seq_len=2048, tie_embeddings=False),
}


def preset(name: str, **overrides: Any) -> TransformerConfig:
    """A named preset (``tiny``, ``small``, ``100m``, ``1b``) with optional field overrides."""
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
    return dataclasses.replace(PRESETS[name], **overrides)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables, float32 ``[seq_len, head_dim // 2]``."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    angles = np.arange(seq_len, dtype=np.float32)[:, None] * inv_freq[None, :]
    return jnp.asarray(np.cos(angles)), jnp.asarray(np.sin(angles))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x: [batch, seq, heads, head_dim]`` (split-half convention)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _init(stddev: float):
    return nnx.initializers.normal(stddev)


class Attention(nnx.Module):
    """Causal multi-head self-attention with rotary embeddings (``nnx.LinearGeneral``)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        common = dict(use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.qkv = nnx.LinearGeneral(cfg.d_model, (3, cfg.n_heads, cfg.head_dim),
                                     kernel_init=_init(0.02), **common)
        self.out = nnx.LinearGeneral((cfg.n_heads, cfg.head_dim), cfg.d_model, axis=(-2, -1),
                                     kernel_init=_init(0.02 / np.sqrt(2 * cfg.n_layers)),
                                     **common)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """``x: [batch, seq, d_model]`` -> same shape."""
        qkv = self.qkv(x)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                            implementation=self.cfg.attention_impl)
        return self.out(attn)


class SwiGLU(nnx.Module):
    """``down(silu(x @ gate) * (x @ up))`` with gate and up fused in one ``nnx.Linear``."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        common = dict(use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.gate_up = nnx.Linear(cfg.d_model, 2 * cfg.d_ff, kernel_init=_init(0.02), **common)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model,
                               kernel_init=_init(0.02 / np.sqrt(2 * cfg.n_layers)), **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
        return self.down(jax.nn.silu(gate) * up)


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        norm = dict(epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    rngs=rngs)
        self.attn_norm = nnx.RMSNorm(cfg.d_model, **norm)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, **norm)
        self.mlp = SwiGLU(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def _stacked_blocks(cfg: TransformerConfig, rngs: nnx.Rngs) -> Block:
    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(r: nnx.Rngs) -> Block:
        return Block(cfg, rngs=r)

    blocks = make(rngs)
    for _, node in nnx.iter_graph(blocks):
        if isinstance(node, nnx.Variable):
            node.set_metadata(STACKED, True)
    return blocks


_REMAT = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


class Transformer(nnx.Module):
    """Decoder-only language model.

    Example:
      >>> model = Transformer(preset("tiny"), rngs=nnx.Rngs(0))      # doctest: +SKIP
      >>> logits = model(jnp.zeros((2, 16), jnp.int32))              # [2, 16, 256]
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype,
                               param_dtype=cfg.param_dtype, embedding_init=_init(0.02),
                               rngs=rngs)
        self.blocks = _stacked_blocks(cfg, rngs)
        self.final_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.dtype,
                                      param_dtype=cfg.param_dtype, rngs=rngs)
        self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
            cfg.d_model, cfg.vocab_size, use_bias=False, dtype=cfg.dtype,
            param_dtype=cfg.param_dtype, kernel_init=_init(0.02), rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """``tokens: int32[batch, seq]`` -> logits ``[batch, seq, vocab]`` in ``cfg.dtype``."""
        cfg = self.cfg
        seq_len = tokens.shape[1]
        if seq_len > cfg.max_seq_len:
            raise ValueError(
                f"Sequence length {seq_len} exceeds TransformerConfig.max_seq_len="
                f"{cfg.max_seq_len}; use shorter sequences or a larger max_seq_len."
            )
        cos, sin = rope_tables(seq_len, cfg.head_dim, cfg.rope_theta)
        x = self.embed(tokens)
        graphdef, stacked = nnx.split(self.blocks)

        def layer(h: jax.Array, params: Any) -> jax.Array:
            return nnx.merge(graphdef, params)(h, cos, sin)

        x = scan_layers(layer, x, stacked, remat_policy=_REMAT[cfg.remat])
        x = self.final_norm(x)
        if self.lm_head is None:
            return self.embed.attend(x)
        return self.lm_head(x)


def lm_loss(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (float32) of ``tokens: int32[batch, seq + 1]``."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
