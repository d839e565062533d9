"""A decoder-only transformer in plain Flax NNX, with its layers stacked for ``lax.scan``.

RMSNorm, rotary attention (multi-head or grouped-query, with optional Llama 3 / linear rotary
scaling), SwiGLU MLP (or a mixture of experts), tied or untied embeddings: the shapes of the
Llama family (`gtp_jax.models.hf` reads and writes Hugging Face checkpoints).
The blocks are created with ``nnx.vmap`` (one stacked parameter per weight, leading dim =
layer) and marked with ``gtp_stacked`` metadata, so `gtp_jax.shard` splits them on dim 1
and `gtp_jax.scan_layers` gathers one layer at a time. Unsharded, the same module is an
ordinary NNX model.

Tensor + sequence parallelism: the projection weights carry ``gtp_tp_dim`` metadata (qkv
and gate_up split on their output features, out and down on their input features). On a
mesh with ``tp > 1`` the sharded model runs Megatron-style: tokens are padded to a multiple
of ``tp`` and each ``tp`` rank embeds its sequence chunk; every block all-gathers the
sequence before qkv / gate_up (column-parallel) and reduce-scatters it after out / down
(row-parallel), ring-overlapped when ``TransformerConfig.tp_overlap`` says so; norms and
residuals run on the local chunk; the LM head runs on the local chunk with the full
vocabulary, and the logits leave sequence-sharded over ``tp``. Heads that do not divide
over ``tp`` are zero-padded (padded heads stay exactly zero, see `Attention`).

Context parallelism (a mesh with ``cp > 1``, `gtp_jax.make_mesh`): `Transformer.gtp_input_layout`
opts in to the sequence split. Before ``shard_map`` the int tokens are padded at the end to
`gtp_jax.parallel.context.padded_seq_len` and put in the load-balanced zigzag order
(``TransformerConfig.cp_layout``); each ``cp`` rank embeds its piece, rotary embeddings use
the tokens' global positions (`position_ids`), attention runs as a ring over ``cp``
(`ring_attention`, or the all-gather baseline: ``TransformerConfig.cp_attention``) with the
padding masked (``valid_len``), and everything else (norms, MLP, LM head) is per token and
runs on the local piece. The logits are moved back to natural order inside ``shard_map``
(`zigzag_to_contiguous`: two half-size ppermutes, no gather of the vocabulary-sized array)
and leave it sequence-sharded over ``cp``; `Transformer.gtp_output_layout`'s finalize drops
the padding.
Composition: batch over the data axes (dp x ep x gtp), sequence over ``cp``, heads over
``tp``; GTP gathers are unchanged. With ``tp > 1`` too, the sequence is padded to a multiple
of ``2 * cp * tp`` (zigzag) so every cp piece divides over tp; Megatron sequence parallelism
runs inside each cp piece (each tp rank holds 1/tp of it between the blocks' gathers) and
ring attention runs over cp with each tp rank's heads; the logits leave sharded over
``("cp", "tp")`` (the zigzag-to-natural reorder gathers the cp piece's logits over tp
first: ``[batch, S / cp, vocab]`` per device). Not supported with ``cp > 1`` (a
`UsageError`): mixture-of-experts layers (``moe_experts``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from gtp_jax.base.axes import CP_AXIS, TP_AXIS, current_axes, vocab_axis
from gtp_jax.base.errors import UsageError
from gtp_jax.base.mesh import data_axes
from gtp_jax.base.metadata import LOCAL, SHARD_DIM, STACKED, TP_DIM, TP_PARTS, TP_UNEVEN
from gtp_jax.base.shapes import round_up
from gtp_jax.models.attention import ATTENTION_IMPLS, causal_attention
from gtp_jax.models.cross_entropy import cross_entropy
from gtp_jax.models.elementwise import apply_rope, swiglu
from gtp_jax.pallas.flash_block import ATTENTION_BLOCK_BACKENDS
from gtp_jax.pallas.swiglu import SWIGLU_BACKENDS
from gtp_jax.parallel.collective_matmul import (
    all_gather_matmul_chunks,
    matmul_reduce_scatter_chunks,
)
from gtp_jax.parallel.context import (
    LAYOUTS,
    allgather_attention,
    padded_seq_len,
    position_ids,
    ring_attention,
    zigzag_split,
    zigzag_to_contiguous,
)
from gtp_jax.parallel.moe import MoE
from gtp_jax.parallel.tp import column_parallel, pad_seq, row_parallel, seq_chunk
from gtp_jax.parallel.vocab import vocab_embed, vocab_logits
from gtp_jax.sharding.contract import InputLayout, OutputLayout
from gtp_jax.sharding.scan import scan_layers

REMAT_POLICIES = ("none", "dots", "full")
#: Rotary scalings (`TransformerConfig.rope_scaling`), Hugging Face's ``rope_type`` names.
ROPE_SCALINGS = (None, "linear", "llama3")
#: Attention implementations under context parallelism (`TransformerConfig.cp_attention`).
CP_ATTENTION = ("ring", "allgather")
#: Projections whose tensor-parallel collective can run as a ring (`TransformerConfig.tp_overlap`).
TP_PROJECTIONS = ("qkv", "out", "gate_up", "down")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes and numerics of the decoder.

    Attributes:
      vocab_size, d_model, n_heads, n_layers, d_ff: model sizes (``d_ff`` is the SwiGLU
        hidden width; ``d_model`` must divide by ``n_heads`` unless `head_dim` is set). Any
        vocabulary size works: sharded weights are padded invisibly (the model only ever
        sees ``vocab_size`` logits).
      n_kv_heads: key/value heads (grouped-query attention: each group of
        ``n_heads // n_kv_heads`` consecutive query heads shares one); None: ``n_heads``
        (multi-head attention, one fused ``qkv`` projection). Under tensor parallelism the
        kv heads are split over ``tp`` when they divide by it, else replicated on every
        ``tp`` rank (each rank picks the kv heads of its query heads).
      head_dim: width of one head; None: ``d_model // n_heads``.
      max_seq_len: longest sequence (rotary tables are built per call, so this is a check).
      tie_embeddings: the output head reuses the input embedding.
      dtype: compute dtype (activations, gathered weights); params stay in `param_dtype`.
      param_dtype: dtype of the stored (master) parameters.
      rope_theta: rotary base.
      rope_scaling: None (plain rotary), "linear" (every frequency divided by
        `rope_factor`) or "llama3" (Llama 3.1+ frequency-dependent scaling by `rope_factor`,
        `rope_low_freq_factor`, `rope_high_freq_factor`, `rope_original_max_len`), as
        Hugging Face's ``rope_scaling`` of the same ``rope_type``.
      norm_eps: RMSNorm epsilon.
      remat: activation recompute inside each layer: "none" (keep what autodiff keeps),
        "dots" (save matmul outputs and the attention's inputs and fused outputs,
        `save_dots_and_attention`), "full" (save layer inputs only). Gathered GTP weights
        are never saved in any mode.
      attention_impl: "auto" (or None): cuDNN's fused attention on a GPU where it applies
        (bf16/fp16, head dim a multiple of 8 up to 128), else XLA's; "cudnn" (an error where
        it does not apply) or "xla" (`gtp_jax.models.attention.causal_attention`). No effect
        under context parallelism (ring attention).
      tp_overlap: under tensor parallelism, run the all-gather / reduce-scatter of these
        projections as ring collective matmuls (`gtp_jax.parallel.collective_matmul`):
        True (all of `TP_PROJECTIONS`), False (none), or a tuple of their names. Same math
        either way; no effect without ``tp``.
      moe_experts: 0 for the dense SwiGLU MLP; else the number of experts of a
        mixture-of-experts FFN in every layer (`gtp_jax.parallel.moe`).
      moe_top_k: experts per token.
      moe_capacity_factor: expert capacity factor per sequence; None: dropless.
      moe_d_ff: hidden width of each expert (None: ``d_ff``).
      moe_aux_weight: weight of the load-balancing loss in `lm_loss` (summed over layers).
      cp_attention: attention under context parallelism (a mesh with ``cp > 1``): "ring"
        (`gtp_jax.parallel.context.ring_attention`: K/V travel around the ``cp`` ring, no
        ``S x S`` scores) or "allgather" (all-gather K/V, ``s_local x S`` scores: the
        baseline). No effect without ``cp``.
      cp_attention_backend: the ring's block kernels (`gtp_jax.pallas.attention_block`):
        "pallas" (flash-attention kernels), "reference" (pure JAX, a block's scores at
        once) or None (the kernels on a GPU where the block shapes tile, else the
        reference). No effect without ``cp`` or with ``cp_attention="allgather"``.
      cp_layout: which tokens each ``cp`` rank holds: "zigzag" (load-balanced under the
        causal mask) or "contiguous". No effect without ``cp``.
      unroll_layers: run the blocks as a Python loop instead of ``lax.scan``
        (`gtp_jax.scan_layers` ``unroll=True``): no copies of residuals into and out of
        stacks, a program (and compile time) that grows with ``n_layers``; GTP gathers run
        one layer ahead. None (default): unrolled unless ``remat="full"`` (see
        `unrolled`).
      swiglu_backend: the SwiGLU backward pass (`gtp_jax.pallas.swiglu_bwd`): "pallas",
        "reference" (one XLA fusion) or None (the Pallas kernel on a GPU where the shape
        tiles, else the reference).
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
    n_kv_heads: int | None = None
    head_dim: int | None = None
    rope_scaling: str | None = None
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    remat: str = "none"
    attention_impl: str | None = None
    tp_overlap: bool | tuple[str, ...] = False
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float | None = 1.25
    moe_d_ff: int | None = None
    moe_aux_weight: float = 0.01
    cp_attention: str = "ring"
    cp_attention_backend: str | None = None
    cp_layout: str = "zigzag"
    unroll_layers: bool | None = None
    swiglu_backend: str | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"TransformerConfig.{name}={value!r} must be a positive int.")
        for name in ("n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise UsageError(f"TransformerConfig.{name}={value!r} must be a positive int "
                                 "or None.")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise UsageError(
                f"TransformerConfig.d_model={self.d_model} must be divisible by "
                f"n_heads={self.n_heads} (or set head_dim)."
            )
        if self.head_size % 2:
            raise UsageError(
                f"TransformerConfig: head dim {self.head_size} must be even "
                "for rotary embeddings; change d_model, n_heads or head_dim."
            )
        if self.n_heads % self.kv_heads:
            raise UsageError(
                f"TransformerConfig.n_kv_heads={self.n_kv_heads} must divide "
                f"n_heads={self.n_heads} (each kv head serves a group of query heads).")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise UsageError(
                f"TransformerConfig.rope_scaling={self.rope_scaling!r}; choose one of "
                f"{ROPE_SCALINGS}.")
        if not (isinstance(self.rope_factor, (int, float)) and self.rope_factor > 0):
            raise UsageError(
                f"TransformerConfig.rope_factor={self.rope_factor!r} must be a number > 0.")
        if self.rope_scaling == "llama3" and not (
                0 < self.rope_low_freq_factor < self.rope_high_freq_factor
                and isinstance(self.rope_original_max_len, int)
                and self.rope_original_max_len > 0):
            raise UsageError(
                "TransformerConfig: llama3 rotary scaling needs 0 < rope_low_freq_factor "
                f"({self.rope_low_freq_factor}) < rope_high_freq_factor "
                f"({self.rope_high_freq_factor}) and a positive int rope_original_max_len "
                f"({self.rope_original_max_len!r}).")
        if not (isinstance(self.norm_eps, (int, float)) and self.norm_eps >= 0):
            raise UsageError(
                f"TransformerConfig.norm_eps={self.norm_eps!r} must be a number >= 0.")
        if self.remat not in REMAT_POLICIES:
            raise UsageError(
                f"TransformerConfig.remat={self.remat!r}; choose one of {REMAT_POLICIES}."
            )
        if self.attention_impl is not None and self.attention_impl not in ATTENTION_IMPLS:
            raise UsageError(
                f"TransformerConfig.attention_impl={self.attention_impl!r}; choose one of "
                f"{ATTENTION_IMPLS} or None (auto).")
        if self.cp_attention not in CP_ATTENTION:
            raise UsageError(
                f"TransformerConfig.cp_attention={self.cp_attention!r}; choose one of "
                f"{CP_ATTENTION}.")
        if self.cp_attention_backend not in (None, *ATTENTION_BLOCK_BACKENDS):
            raise UsageError(
                f"TransformerConfig.cp_attention_backend={self.cp_attention_backend!r}; "
                f"choose one of {ATTENTION_BLOCK_BACKENDS} or None (the Pallas kernels on a "
                "GPU where the block shapes tile, else the reference).")
        if self.cp_layout not in LAYOUTS:
            raise UsageError(
                f"TransformerConfig.cp_layout={self.cp_layout!r}; choose one of {LAYOUTS}.")
        if self.swiglu_backend not in (None, *SWIGLU_BACKENDS):
            raise UsageError(
                f"TransformerConfig.swiglu_backend={self.swiglu_backend!r}; choose one of "
                f"{SWIGLU_BACKENDS} or None (the Pallas kernel on a GPU, else the reference).")
        if self.unroll_layers is not None and not isinstance(self.unroll_layers, bool):
            raise TypeError(
                f"TransformerConfig.unroll_layers={self.unroll_layers!r} must be True, False "
                "or None (unrolled unless remat='full').")
        if not isinstance(self.tp_overlap, bool):
            names = tuple(self.tp_overlap) if isinstance(self.tp_overlap, (tuple, list)) \
                else None
            if names is None or not set(names) <= set(TP_PROJECTIONS):
                raise UsageError(
                    f"TransformerConfig.tp_overlap={self.tp_overlap!r}: use True, False or a "
                    f"tuple of projection names from {TP_PROJECTIONS}.")
            object.__setattr__(self, "tp_overlap", names)
        if not isinstance(self.moe_experts, int) or self.moe_experts < 0:
            raise UsageError(
                f"TransformerConfig.moe_experts={self.moe_experts!r} must be an int >= 0 "
                "(0: dense MLP).")
        if self.moe_experts:
            if not isinstance(self.moe_top_k, int) or not 1 <= self.moe_top_k <= self.moe_experts:
                raise UsageError(
                    f"TransformerConfig.moe_top_k={self.moe_top_k!r} must be an int in "
                    f"[1, moe_experts={self.moe_experts}].")
            if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
                raise UsageError(
                    f"TransformerConfig.moe_capacity_factor={self.moe_capacity_factor!r} "
                    "must be > 0, or None for dropless routing.")
            if self.moe_d_ff is not None and (not isinstance(self.moe_d_ff, int)
                                              or self.moe_d_ff < 1):
                raise UsageError(
                    f"TransformerConfig.moe_d_ff={self.moe_d_ff!r} must be a positive int or "
                    "None (use d_ff).")
            if not self.moe_aux_weight >= 0:
                raise UsageError(
                    f"TransformerConfig.moe_aux_weight={self.moe_aux_weight!r} must be >= 0.")

    @property
    def unrolled(self) -> bool:
        """Whether the blocks run unrolled: `unroll_layers`, or when it is None, unless
        ``remat="full"``. Unrolled, the step is faster and (with ``"dots"`` / ``"none"``)
        no larger; but XLA schedules an unrolled program's recomputation freely, so
        ``"full"`` no longer bounds memory to the layer inputs there -- the scanned loop
        keeps that promise (docs/performance.md, first section)."""
        if self.unroll_layers is None:
            return self.remat != "full"
        return self.unroll_layers

    def overlaps(self, projection: str) -> bool:
        """Whether `projection` (one of `TP_PROJECTIONS`) uses the ring collective matmul."""
        ov = self.tp_overlap
        return ov if isinstance(ov, bool) else projection in ov

    @property
    def expert_d_ff(self) -> int:
        return self.moe_d_ff or self.d_ff

    @property
    def head_size(self) -> int:
        """Width of one head: `head_dim`, or ``d_model // n_heads`` when it is None."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: `n_kv_heads`, or ``n_heads`` when it is None."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def grouped(self) -> bool:
        """Grouped-query attention (fewer kv heads than query heads): separate ``q`` and
        ``kv`` projections instead of the fused ``qkv``."""
        return self.kv_heads != self.n_heads

    def num_params(self) -> int:
        """Parameter count (embeddings included)."""
        d, f = self.d_model, self.d_ff
        mlp = 3 * d * f
        if self.moe_experts:
            mlp = self.moe_experts * 3 * d * self.expert_d_ff + d * self.moe_experts
        attn = 2 * d * self.head_size * (self.n_heads + self.kv_heads)
        per_layer = attn + mlp + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + emb + d

    def matmul_params(self) -> int:
        """Weights each trained token is multiplied by: the blocks' q/k/v/o projections as
        the model has them (grouped-query attention's k and v are smaller), the MLP (the
        active experts and the router for MoE) and the output head; not the embedding."""
        d, f = self.d_model, self.d_ff
        mlp = 3 * d * f
        if self.moe_experts:  # active experts per token, plus the router
            mlp = self.moe_top_k * 3 * d * self.expert_d_ff + d * self.moe_experts
        attn = 2 * d * self.head_size * (self.n_heads + self.kv_heads)
        return self.n_layers * (attn + mlp) + self.vocab_size * d

    def train_flops_per_token(self, seq_len: int) -> float:
        """Matmul FLOPs per trained token: 6*(block + head params) + 6*L*d*T (causal attn).

        The same formula as the peer baselines in the benchmarks (embedding lookup not
        counted, causal attention counted at half of 12*L*d*T).
        """
        width = self.n_heads * self.head_size  # d_model unless head_dim says otherwise
        return 6.0 * self.matmul_params() + 6.0 * self.n_layers * width * seq_len


PRESETS: dict[str, TransformerConfig] = {
    # ~0.47M params, 2 layers (the test model: the suite builds it hundreds of times);
    # trains in seconds on a simulated CPU mesh.
    "tiny": TransformerConfig(n_layers=2),
    # ~23M params.
    "small": TransformerConfig(vocab_size=32000, d_model=512, n_heads=8, n_layers=6,
                               d_ff=1408, max_seq_len=1024, tie_embeddings=True),
    # ~110M params.
    "100m": TransformerConfig(vocab_size=32000, d_model=768, n_heads=12, n_layers=12,
                              d_ff=2048, max_seq_len=1024, tie_embeddings=True),
    # 0.95B params: the GPU benchmark model (same as the PyTorch/XLA peer baselines).
    "1b": TransformerConfig(vocab_size=32000, d_model=2048, n_heads=16, n_layers=16,
                            d_ff=5632, max_seq_len=2048, tie_embeddings=False),
    # The shapes of Meta's Llama 3.2 1B / 3B and Llama 3 8B / 70B (their Hugging Face
    # config.json).
    "llama3.2-1b": TransformerConfig(
        vocab_size=128256, d_model=2048, n_heads=32, n_kv_heads=8, head_dim=64, n_layers=16,
        d_ff=8192, max_seq_len=131072, tie_embeddings=True, rope_theta=500000.0,
        norm_eps=1e-5, rope_scaling="llama3", rope_factor=32.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_len=8192),
    "llama3.2-3b": TransformerConfig(
        vocab_size=128256, d_model=3072, n_heads=24, n_kv_heads=8, head_dim=128, n_layers=28,
        d_ff=8192, max_seq_len=131072, tie_embeddings=True, rope_theta=500000.0,
        norm_eps=1e-5, rope_scaling="llama3", rope_factor=32.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_len=8192),
    "llama3-8b": TransformerConfig(
        vocab_size=128256, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, n_layers=32,
        d_ff=14336, max_seq_len=8192, tie_embeddings=False, rope_theta=500000.0,
        norm_eps=1e-5),
    # 70.6B parameters: planned on paper (`python -m gtp_jax plan --on-paper`); building it
    # takes 282 GB of float32 weights.
    "llama3-70b": TransformerConfig(
        vocab_size=128256, d_model=8192, n_heads=64, n_kv_heads=8, head_dim=128, n_layers=80,
        d_ff=28672, max_seq_len=8192, tie_embeddings=False, rope_theta=500000.0,
        norm_eps=1e-5),
}


def preset(name: str, **overrides: Any) -> TransformerConfig:
    """A named preset (``tiny``, ``small``, ``100m``, ``1b``, ``llama3.2-1b``,
    ``llama3.2-3b``, ``llama3-8b``, ``llama3-70b``) with optional field overrides."""
    if name not in PRESETS:
        raise UsageError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
    return dataclasses.replace(PRESETS[name], **overrides)


def rope_inv_freq(head_dim: int, theta: float,
                  cfg: TransformerConfig | None = None) -> np.ndarray:
    """Rotary inverse frequencies, float32 ``[head_dim // 2]``: ``theta ** (-2i / head_dim)``,
    scaled as ``cfg.rope_scaling`` says (None or no `cfg`: unscaled).

    "linear" divides every frequency by ``cfg.rope_factor``; "llama3" divides the low
    frequencies (wavelength above ``original / low_freq_factor``) by it, keeps the high ones
    (below ``original / high_freq_factor``) and interpolates smoothly between, as Hugging
    Face's ``_compute_llama3_parameters`` (float32, the same operations).
    """
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                             / np.float32(head_dim)))).astype(np.float32)
    scaling = None if cfg is None else cfg.rope_scaling
    if scaling == "linear":
        return (inv_freq / np.float32(cfg.rope_factor)).astype(np.float32)
    if scaling == "llama3":
        factor = np.float32(cfg.rope_factor)
        low, high = np.float32(cfg.rope_low_freq_factor), np.float32(cfg.rope_high_freq_factor)
        old = np.float32(cfg.rope_original_max_len)
        wavelen = np.float32(2 * np.pi) / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq).astype(np.float32)
        smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rope_tables(seq_len: int, head_dim: int, theta: float, *,
                inv_freq: np.ndarray | None = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables, float32 ``[seq_len, head_dim // 2]`` (`inv_freq`: `rope_inv_freq`'s,
    None: unscaled)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(head_dim, theta)
    angles = np.arange(seq_len, dtype=np.float32)[:, None] * inv_freq[None, :]
    return jnp.asarray(np.cos(angles)), jnp.asarray(np.sin(angles))


def rope_at(positions: jax.Array, head_dim: int, theta: float, *,
            inv_freq: np.ndarray | None = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables, float32 ``[len(positions), head_dim // 2]``, at the given (traced)
    int positions: `rope_tables` rows for tokens that are not in natural order (context
    parallelism: this rank's global positions)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(head_dim, theta)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def _init(stddev: float):
    return nnx.initializers.normal(stddev)


def _promote(x: jax.Array, w: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Casts input and kernel to the compute dtype, as ``nnx.Linear`` does."""
    dtype = dtype or jnp.result_type(x, w)
    return x.astype(dtype), w.astype(dtype)


class Attention(nnx.Module):
    """Causal self-attention with rotary embeddings (``nnx.LinearGeneral``): multi-head
    (one fused ``qkv`` projection) or grouped-query (``cfg.kv_heads < cfg.n_heads``:
    ``q [d, H, hd]`` and ``kv [d, 2, KV, hd]``).

    Tensor parallel (``tp`` in `current_axes`): ``qkv.kernel [d, 3, H, hd]`` is split on its
    heads (column-parallel, ``gtp_tp_dim=2``) and ``out.kernel [H, hd, d]`` on its heads
    (row-parallel, ``gtp_tp_dim=0``); each rank attends with its own heads over the full
    gathered sequence. When ``tp`` does not divide ``H``, both are zero-padded to a multiple
    of ``tp`` heads. A padded head stays exactly zero: its q, k, v are 0, so its attention
    output is 0 and contributes nothing through the zero rows of ``out``; and its gradients
    are 0 (``d out_pad = attn_pad^T dy = 0``; ``d attn_pad = dy out_pad^T = 0`` makes
    ``dv``, ``dq``, ``dk`` and so the qkv gradient of the padded columns 0), so neither Adam
    nor weight decay ever moves it. Grouped-query: ``q`` splits (or pads) its heads like
    ``qkv``; ``kv`` splits its heads when ``tp`` divides ``KV`` (rank ``r`` then holds the kv
    heads of its query heads), else it is replicated over ``tp`` (`TP_UNEVEN` "replicate":
    every rank projects all kv heads and keeps those of its query heads; a padded query
    head reads the last kv head, harmlessly: its q and ``out`` rows are zero). The kv heads
    are repeated to one per query head before attention (``jnp.repeat``, as Hugging Face's
    ``repeat_kv``), so the attention kernels, the ring of context parallelism and its
    flash block kernels see plain multi-head attention.
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        common = dict(use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        hd = cfg.head_size
        if cfg.grouped:
            self.q = nnx.LinearGeneral(cfg.d_model, (cfg.n_heads, hd),
                                       kernel_init=_init(0.02), **common)
            self.kv = nnx.LinearGeneral(cfg.d_model, (2, cfg.kv_heads, hd),
                                        kernel_init=_init(0.02), **common)
            self.q.kernel.set_metadata(TP_DIM, 1)
            self.kv.kernel.set_metadata(TP_DIM, 2)
            self.kv.kernel.set_metadata(TP_UNEVEN, "replicate")
        else:
            self.qkv = nnx.LinearGeneral(cfg.d_model, (3, cfg.n_heads, hd),
                                         kernel_init=_init(0.02), **common)
            self.qkv.kernel.set_metadata(TP_DIM, 2)
        self.out = nnx.LinearGeneral((cfg.n_heads, hd), cfg.d_model, axis=(-2, -1),
                                     kernel_init=_init(0.02 / np.sqrt(2 * cfg.n_layers)),
                                     **common)
        self.out.kernel.set_metadata(TP_DIM, 0)

    def _project(self, x: jax.Array, tp: str | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q ``[b, s, H_local, hd]`` and k, v ``[b, s, KV_local, hd]`` (this rank's heads)."""
        if not self.cfg.grouped:
            if tp is None:
                qkv = self.qkv(x)
            else:
                x, w = _promote(x, self.qkv.kernel[...], self.cfg.dtype)
                qkv = column_parallel(x, w, tp, overlap=self.cfg.overlaps("qkv"))
            return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if tp is None:
            kv = self.kv(x)
            return self.q(x), kv[:, :, 0], kv[:, :, 1]
        wq, wkv = self.q.kernel[...], self.kv.kernel[...]
        d, hl, hd = wq.shape
        kvl = wkv.shape[2]
        # one column-parallel GEMM (one sequence all-gather) for q and kv together
        w = jnp.concatenate([wq.reshape(d, hl * hd), wkv.reshape(d, 2 * kvl * hd)], axis=1)
        x, w = _promote(x, w, self.cfg.dtype)
        y = column_parallel(x, w, tp, overlap=self.cfg.overlaps("qkv"))
        b, s = y.shape[:2]
        q = y[..., :hl * hd].reshape(b, s, hl, hd)
        kv = y[..., hl * hd:].reshape(b, s, 2, kvl, hd)
        return q, kv[:, :, 0], kv[:, :, 1]

    def _group(self, t: jax.Array, q_heads: int, axes: Any) -> jax.Array:
        """k or v ``[b, s, KV_local, hd]`` -> one head per local query head."""
        cfg, tp = self.cfg, axes.tp
        if not cfg.grouped:
            return t
        if tp is not None and cfg.kv_heads % axes.tp_size:
            # kv replicated over tp: pick the kv head of each of this rank's query heads
            heads = jax.lax.axis_index(tp) * q_heads + jnp.arange(q_heads)
            group = jnp.minimum(heads, cfg.n_heads - 1) // (cfg.n_heads // cfg.kv_heads)
            return jnp.take(t, group, axis=2)
        return jnp.repeat(t, q_heads // t.shape[2], axis=2)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 valid_len: int | None = None) -> jax.Array:
        """``x: [batch, seq, d_model]`` -> same shape (``seq``: the local chunk under tp;
        `cos`/`sin` cover the full sequence). Under ``cp`` (`current_axes`), ``seq`` is this
        rank's piece in ``cfg.cp_layout`` order, `cos`/`sin` are its rows and `valid_len`
        is the global number of real (unpadded) tokens."""
        axes = current_axes()
        tp = axes.tp
        q, k, v = self._project(x, tp)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # named for `save_dots_and_attention`: saving the attention's inputs instead of the
        # qkv projection output (same bytes) spares the backward pass re-running rotary
        q, k, v = (checkpoint_name(t, n) for t, n in zip((q, k, v), ATTENTION_INPUTS))
        k, v = self._group(k, q.shape[2], axes), self._group(v, q.shape[2], axes)
        if axes.cp is not None:
            fn = ring_attention if self.cfg.cp_attention == "ring" else allgather_attention
            extra = {"backend": self.cfg.cp_attention_backend} if fn is ring_attention else {}
            attn = fn(q, k, v, axis=axes.cp, layout=self.cfg.cp_layout, valid_len=valid_len,
                      **extra)
        else:
            attn = causal_attention(q, k, v, impl=self.cfg.attention_impl)
        if tp is None:
            return self.out(attn)
        attn, w = _promote(attn, self.out.kernel[...], self.cfg.dtype)
        return row_parallel(attn, w, tp, overlap=self.cfg.overlaps("out"), n_contract=2)


class SwiGLU(nnx.Module):
    """``down(silu(x @ gate) * (x @ up))`` with gate and up fused in one ``nnx.Linear``.

    Tensor parallel: ``gate_up.kernel [d, 2 f]`` is column-split with its two fused parts
    split separately (``gtp_tp_parts=2``, so each rank holds ``[gate_r | up_r]``) and
    ``down.kernel [f, d]`` is row-split; ``tp`` must divide ``d_ff``.
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        common = dict(use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.gate_up = nnx.Linear(cfg.d_model, 2 * cfg.d_ff, kernel_init=_init(0.02), **common)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model,
                               kernel_init=_init(0.02 / np.sqrt(2 * cfg.n_layers)), **common)
        self.gate_up.kernel.set_metadata(TP_DIM, 1)
        self.gate_up.kernel.set_metadata(TP_PARTS, 2)
        self.down.kernel.set_metadata(TP_DIM, 0)

    def __call__(self, x: jax.Array) -> jax.Array:
        tp = current_axes().tp
        act = functools.partial(swiglu, backend=self.cfg.swiglu_backend)
        if tp is None:
            return self.down(act(self.gate_up(x)))
        x, w = _promote(x, self.gate_up.kernel[...], self.cfg.dtype)
        if self.cfg.overlaps("gate_up") and self.cfg.overlaps("down"):
            # Both rings: the sequence chunks stay in ring order through the elementwise
            # middle, so no pass puts them in rank order (all_gather_matmul_chunks).
            hs = [act(chunk) for chunk in all_gather_matmul_chunks(x, w, tp)]
            w = self.down.kernel[...]
            hs = [_promote(h, w, self.cfg.dtype)[0] for h in hs]
            return matmul_reduce_scatter_chunks(hs, _promote(hs[0], w, self.cfg.dtype)[1], tp)
        h = act(column_parallel(x, w, tp, overlap=self.cfg.overlaps("gate_up")))
        h, w = _promote(h, self.down.kernel[...], self.cfg.dtype)
        return row_parallel(h, w, tp, overlap=self.cfg.overlaps("down"))


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Returns ``(x, aux, dropped)``: float32 ``[batch]`` each, the load-balancing loss and the
    dropped (token, choice) assignments of a `gtp_jax.parallel.MoE` MLP
    (``cfg.moe_experts``), zeros for a dense MLP.
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        norm = dict(epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    rngs=rngs)
        self.attn_norm = nnx.RMSNorm(cfg.d_model, **norm)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, **norm)
        if cfg.moe_experts:
            self.mlp = MoE(cfg.d_model, cfg.expert_d_ff, cfg.moe_experts, top_k=cfg.moe_top_k,
                           capacity_factor=cfg.moe_capacity_factor, dtype=cfg.dtype,
                           param_dtype=cfg.param_dtype, init_std=0.02,
                           out_std=0.02 / np.sqrt(2 * cfg.n_layers), rngs=rngs)
        else:
            self.mlp = SwiGLU(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 valid_len: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        x = x + self.attn(self.attn_norm(x), cos, sin, valid_len)
        if isinstance(self.mlp, MoE):
            y, aux, dropped = self.mlp(self.mlp_norm(x), valid_len)
            return x + y, aux, dropped
        zeros = jnp.zeros((x.shape[0],), jnp.float32)
        return x + self.mlp(self.mlp_norm(x)), zeros, zeros


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


#: ``checkpoint_name``s of the attention's inputs (saved by `save_dots_and_attention`).
ATTENTION_INPUTS = ("attention_q", "attention_k", "attention_v")
#: The cuDNN attention forward's primitive (``jax.nn.dot_product_attention``,
#: ``implementation="cudnn"``, or None on a GPU where it applies).
_FUSED_ATTENTION_FWD = "dot_product_attention_fwd_wrapper"


def save_dots_and_attention(prim: Any, *avals: Any, **params: Any) -> bool:
    """Remat policy of ``remat="dots"``: save matmul outputs (no batch dims), the attention's
    inputs (q and k after rotary, v: `ATTENTION_INPUTS`) and the fused attention's output
    and softmax statistics; recompute everything else elementwise.

    Without the attention rule the cuDNN attention forward (batched, so not a "dot" here)
    runs twice per step: once in the forward pass and again to rebuild its residuals for the
    backward kernel. Saving it costs ``[batch, seq, heads, head_dim]`` plus float32
    ``[batch, heads, seq]`` per layer. With q, k, v saved, nothing in the backward pass
    reads the qkv projection output, so it is not saved instead: same bytes, and no rotary
    or slicing is re-run. The XLA attention (CPU, or ``attention_impl="xla"``) has no fused
    primitive, and its ``seq x seq`` scores are still recomputed.
    """
    name = getattr(prim, "name", None)
    if name == _FUSED_ATTENTION_FWD:
        return True
    if name == "name" and params.get("name") in ATTENTION_INPUTS:
        return True
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params)


_REMAT = {
    "none": None,
    "dots": save_dots_and_attention,
    "full": jax.checkpoint_policies.nothing_saveable,
}


class LMOutput(NamedTuple):
    """What `Transformer` returns.

    Attributes:
      logits: ``[batch, seq, vocab]`` in ``cfg.dtype``.
      aux: float32 ``[batch]``: each sequence's MoE load-balancing loss summed over layers
        (zeros for a dense model).
      dropped: float32 ``[batch]``: each sequence's (token, choice) assignments that found
        their expert full, summed over layers (zeros for a dense or dropless model); over
        ``tokens * moe_top_k * n_layers`` it is the share of routing the capacity dropped.
    """

    logits: jax.Array
    aux: jax.Array
    dropped: jax.Array


class Transformer(nnx.Module):
    """Decoder-only language model.

    Example:
      >>> model = Transformer(preset("tiny"), rngs=nnx.Rngs(0))      # doctest: +SKIP
      >>> out = model(jnp.zeros((2, 16), jnp.int32))                 # doctest: +SKIP
      >>> out.logits.shape                                           # doctest: +SKIP
      (2, 16, 256)
    """

    #: Its outputs are per-example by construction: a sharded call at one example per data
    #: shard need not trace the unsharded model to tell (`gtp_jax.ShardedModule`).
    gtp_outputs_per_example = True

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
        # Sharded on the vocabulary and read as this rank's slice where the mesh allows
        # (`gtp_output_layout`): activations move instead of the vocabulary-sized weights.
        self.embed.embedding.set_metadata(SHARD_DIM, 0)
        self.embed.embedding.set_metadata(LOCAL, True)
        if self.lm_head is not None:
            self.lm_head.kernel.set_metadata(SHARD_DIM, 1)
            self.lm_head.kernel.set_metadata(LOCAL, True)

    def __call__(self, tokens: jax.Array, *, seq_len: int | None = None) -> LMOutput:
        """``tokens: int32[batch, seq]`` -> `LMOutput` (logits ``[batch, seq, vocab]``, aux).

        Under tensor parallelism (inside a sharded call) the logits are this rank's chunk of
        the padded sequence; `gtp_output_layout` reassembles and unpads them. Under context
        parallelism (``cp`` in `current_axes`) `tokens` is this rank's piece of the padded
        sequence in ``cfg.cp_layout`` order and `seq_len` the global number of real tokens
        (both set by `gtp_input_layout`); the logits are this rank's piece, reassembled by
        `gtp_output_layout`.
        """
        cfg = self.cfg
        axes = current_axes()
        if axes.cp is not None:
            return self._call_cp(tokens, seq_len, axes)
        seq_len = tokens.shape[1]
        if seq_len > cfg.max_seq_len:
            raise UsageError(
                f"Sequence length {seq_len} exceeds TransformerConfig.max_seq_len="
                f"{cfg.max_seq_len}; use shorter sequences or a larger max_seq_len."
            )
        if axes.tp is not None:
            # Trailing pad to a multiple of tp: causal attention keeps real positions exact.
            tokens = seq_chunk(pad_seq(tokens, axes.tp_size), axes.tp)
        cos, sin = rope_tables(round_up(seq_len, axes.tp_size), cfg.head_size, cfg.rope_theta,
                               inv_freq=rope_inv_freq(cfg.head_size, cfg.rope_theta, cfg))
        return self._forward(tokens, cos, sin, seq_len)

    def _call_cp(self, tokens: jax.Array, seq_len: int | None, axes: Any) -> LMOutput:
        """The context-parallel forward: `tokens` is this rank's piece (see `__call__`)."""
        cfg = self.cfg
        _check_cp(cfg, axes.cp_size)
        local = tokens.shape[1]
        padded = local * axes.cp_size
        seq_len = padded if seq_len is None else int(seq_len)
        if seq_len > cfg.max_seq_len:
            raise UsageError(
                f"Sequence length {seq_len} exceeds TransformerConfig.max_seq_len="
                f"{cfg.max_seq_len}; use shorter sequences or a larger max_seq_len.")
        # rotary rows of the whole cp piece: under tp, attention sees it gathered over tp
        cos, sin = rope_at(position_ids(local, axes.cp, cfg.cp_layout), cfg.head_size,
                           cfg.rope_theta,
                           inv_freq=rope_inv_freq(cfg.head_size, cfg.rope_theta, cfg))
        if axes.tp is not None:  # the padded length is a multiple of cp * tp
            tokens = seq_chunk(tokens, axes.tp)
        out = self._forward(tokens, cos, sin, seq_len if seq_len < padded else None)
        if cfg.cp_layout == "zigzag":
            # Natural order across the cp ranks by two half-size ppermutes (never a gather of
            # the global vocabulary-sized logits), so they leave shard_map as contiguous
            # pieces. Under tp the cp piece is first gathered over tp (its two zigzag halves
            # are spread over the tp ranks) and each tp rank keeps its slice afterwards.
            logits = out.logits
            if axes.tp is not None:
                logits = jax.lax.all_gather(logits, axes.tp, axis=1, tiled=True)
            logits = zigzag_to_contiguous(logits, axes.cp)
            if axes.tp is not None:
                logits = seq_chunk(logits, axes.tp)
            out = out._replace(logits=logits)
        return out

    def _forward(self, tokens: jax.Array, cos: jax.Array, sin: jax.Array,
                 seq_len: int | None) -> LMOutput:
        cfg = self.cfg
        axes = current_axes()
        if axes.vocab is None:
            x = self.embed(tokens)
        else:
            x = vocab_embed(tokens, self.embed.embedding.get_value(), axis=axes.vocab,
                            axis_size=axes.vocab_size, dtype=cfg.dtype)
        graphdef, stacked = nnx.split(self.blocks)

        def layer(carry: Any, params: Any) -> Any:
            h, aux, dropped = carry
            h, layer_aux, layer_dropped = nnx.merge(graphdef, params)(h, cos, sin, seq_len)
            return h, aux + layer_aux, dropped + layer_dropped

        zeros = jnp.zeros((x.shape[0],), jnp.float32)
        carry = (x, zeros, zeros)
        x, aux, dropped = scan_layers(layer, carry, stacked, remat_policy=_REMAT[cfg.remat],
                             unroll=cfg.unrolled)
        x = self.final_norm(x)
        if axes.vocab is not None:
            return LMOutput(self._vocab_logits(x, axes), aux, dropped)
        logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
        return LMOutput(logits, aux, dropped)

    def _vocab_logits(self, x: jax.Array, axes: Any) -> jax.Array:
        """The vocabulary-parallel head (`gtp_jax.parallel.vocab.vocab_logits`): this rank's
        vocabulary slice of the logits of every rank's rows on ``axes.vocab``."""
        common = dict(axis=axes.vocab, axis_size=axes.vocab_size, dtype=self.cfg.dtype)
        if self.lm_head is None:
            return vocab_logits(x, self.embed.embedding.get_value(), transpose=True, **common)
        head = self.lm_head
        return vocab_logits(x, head.kernel.get_value(),
                            dot=functools.partial(head.dot_general, precision=head.precision),
                            **common)

    def _vocab_split(self, mesh: Any) -> str | None:
        """The axis the embedding and head split the vocabulary over on `mesh`, or None
        (`gtp_jax.base.axes.vocab_axis`; a head computing in FP8 keeps its gathered form,
        whose scales are the whole weight's)."""
        if self.lm_head is not None and self.lm_head.dot_general is not jax.lax.dot_general:
            return None
        return vocab_axis(mesh)

    def gtp_input_layout(self, mesh: Any, tokens: jax.Array, *,
                         seq_len: int | None = None) -> InputLayout:
        """Input placement under `gtp_jax.shard` on a mesh with ``cp > 1``: the tokens are
        padded at the end to `padded_seq_len` and put in ``cfg.cp_layout`` order (cheap: int
        tokens), then split over ``cp`` on dim 1; ``seq_len`` (the real length) is passed
        to `__call__` as a static keyword. Only consulted when the mesh has ``cp > 1``."""
        cp = int(mesh.shape.get(CP_AXIS, 1))
        tp = int(mesh.shape.get(TP_AXIS, 1))
        _check_cp(self.cfg, cp)
        if seq_len is not None:
            raise UsageError("Transformer: seq_len= is set by gtp_input_layout under context "
                             "parallelism; call the sharded model with tokens only.")
        layout = self.cfg.cp_layout

        def prepare(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            (toks,) = args
            toks = getattr(toks, "value", toks)  # gtp_jax.replicated would be a misuse anyway
            s = toks.shape[1]
            padded = padded_seq_len(s, cp * tp, layout)  # every cp piece divides over tp
            if padded != s:
                toks = jnp.pad(toks, ((0, 0), (0, padded - s)))
            if layout == "zigzag":
                toks = zigzag_split(toks, cp, axis=1)
            return (toks,), {**kwargs, "seq_len": s}

        return InputLayout(prepare=prepare)

    def gtp_output_layout(self, mesh: Any, tokens: jax.Array, *,
                          seq_len: int | None = None) -> OutputLayout | None:
        """Output placement under `gtp_jax.shard`: logits split over the vocabulary, or
        sequence-sharded over ``tp`` (or ``cp``).

        Where the mesh allows a vocabulary split (`gtp_jax.base.axes.vocab_axis`: GTP over
        more than one rank, no tp or cp; not with an FP8 head) the embedding and the head
        run vocabulary-parallel (`gtp_jax.parallel.vocab`) and the logits leave as
        ``[batch, seq, vocab]`` with ``P(other data axes, None, "gtp")``: no rank gathers
        the embedding or head weights or builds their whole gradients.

        The logits leave ``shard_map`` as ``[batch, padded_seq, vocab]`` with
        ``P(data_axes, "tp")`` (no all-gather of the vocabulary-sized tensor), and the
        sequence padding is sliced off afterwards. None (the default placement) without tp.
        Under context parallelism they leave with ``P(data_axes, "cp")`` (``("cp", "tp")``
        with tp), already in natural
        order (the model moves zigzag pieces back with `zigzag_to_contiguous` inside
        ``shard_map``: a gather of the global logits would materialise ``[batch, S, vocab]``
        on every rank), and the finalize step drops the padding.
        """
        cp = int(mesh.shape.get(CP_AXIS, 1))
        tp = int(mesh.shape.get(TP_AXIS, 1))
        data = data_axes(mesh)
        seq_len = tokens.shape[1]
        if cp > 1:
            seq = (CP_AXIS, TP_AXIS) if tp > 1 else CP_AXIS
            specs = LMOutput(P(data, seq), P(data), P(data))
            if padded_seq_len(seq_len, cp * tp, self.cfg.cp_layout) == seq_len:
                return OutputLayout(specs)
            return OutputLayout(
                specs, lambda out: out._replace(logits=out.logits[:, :seq_len]))
        tp = int(mesh.shape.get(TP_AXIS, 1))
        vocab = self._vocab_split(mesh)
        if vocab is not None:
            # every vocab rank's rows, this rank's slice of the vocabulary: the batch is
            # split over the other data axes, the vocabulary over `vocab`
            rows = tuple(a for a in data if a != vocab)
            specs = LMOutput(P(rows or None, None, vocab), P(data), P(data))
            size = self.cfg.vocab_size
            return OutputLayout(specs, lambda out: out if out.logits.shape[-1] == size else
                                out._replace(logits=out.logits[..., :size]), vocab=vocab)
        if tp == 1:
            return None
        specs = LMOutput(P(data, TP_AXIS), P(data), P(data))
        if round_up(seq_len, tp) == seq_len:
            return OutputLayout(specs)
        return OutputLayout(specs, lambda out: out._replace(logits=out.logits[:, :seq_len]))


def _check_cp(cfg: TransformerConfig, cp: int) -> None:
    """What context parallelism does not combine with (yet)."""
    if cp > 1 and cfg.moe_experts:
        raise UsageError(
            f"Transformer: context parallelism (cp={cp}) with a mixture of experts "
            f"(moe_experts={cfg.moe_experts}) is not supported (expert capacity is per "
            "sequence); use a dense MLP or cp=1.")


def lm_loss(model: nnx.Module, tokens: jax.Array, aux_weight: float = 0.0) -> jax.Array:
    """Mean next-token cross-entropy (float32) of ``tokens: int32[batch, seq + 1]``.

    Args:
      model: returns an `LMOutput` for ``tokens[:, :-1]`` (a `Transformer`, sharded or not).
      tokens: int32 ``[batch, seq + 1]``; position ``t + 1`` is the target of position ``t``.
      aux_weight: weight of the MoE load-balancing loss (mean over sequences), e.g.
        ``TransformerConfig.moe_aux_weight``; 0 ignores it.
    """
    return lm_loss_and_metrics(model, tokens, aux_weight)[0]


def lm_loss_and_metrics(model: nnx.Module, tokens: jax.Array, aux_weight: float = 0.0
                        ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`lm_loss` and what the step reports beside it: ``{"moe_dropped": float32 scalar}``,
    the (token, choice) assignments the experts' capacity dropped per token, summed over
    layers (divide by ``moe_top_k * n_layers`` for the share of routing dropped; 0 for a
    dense model). For ``TrainStep(..., has_aux=True)``."""
    out = model(tokens[:, :-1])
    ce = cross_entropy(out.logits, tokens[:, 1:])
    loss = ce + aux_weight * out.aux.mean() if aux_weight else ce
    return loss, {"moe_dropped": jnp.mean(out.dropped) / (tokens.shape[1] - 1)}
