"""Megatron tensor parallelism with sequence parallelism, as functions for ``shard_map`` bodies.

Layout (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"):
between blocks the activations ``[batch, seq, d_model]`` are split along the sequence over
the ``tp`` axis; norms and residual adds run on the local chunk with replicated weights.
A block's first GEMM is *column-parallel* (weight split on its output features): the
sequence is all-gathered and multiplied by the local column shard, giving the full
sequence with this rank's features (heads, or a slice of the MLP hidden width). Its last
GEMM is *row-parallel* (weight split on its input features): the local product is a
partial sum over ranks, reduce-scattered along the sequence back to the local chunk.

Autodiff under ``shard_map(check_vma=False)``: only ``all_gather`` / ``psum_scatter`` /
``ppermute`` move activations (their transposes are exact), inside ``custom_vjp`` rules
(`gtp_jax.parallel.collective_matmul`); no raw ``psum`` is used, whose transpose would
count the cotangent once per rank. Weights that are replicated over ``tp`` (norms,
embeddings) get per-rank partial gradients (each rank sees other tokens), which
``shard_map``'s transpose sums over ``tp`` because their in-spec does not mention it.

All functions run inside ``jax.shard_map`` where `axis_name` (``"tp"``) is manual; with
``axis_name=None`` they do the plain single-device math, so model code has one path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gtp_jax.base.shapes import round_up
from gtp_jax.parallel.collective_matmul import (
    _as_2d,
    _mm,
    _x3,
    all_gather_matmul,
    matmul_reduce_scatter,
)


def pad_seq(x: jax.Array, multiple: int, *, value: int | float = 0) -> jax.Array:
    """Pads dim 1 (the sequence) of ``x: [batch, seq, ...]`` at the end to a multiple.

    Trailing padding is harmless to a causal model: no real position attends to a later
    one, so real positions compute exactly what they compute unpadded, and the padded
    positions receive exactly zero cotangent when the caller drops their outputs.
    """
    pad = round_up(x.shape[1], multiple) - x.shape[1]
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def seq_chunk(x: jax.Array, axis_name: str | None) -> jax.Array:
    """This rank's sequence chunk of a value that is identical on every rank of `axis_name`.

    Args:
      x: ``[batch, seq, ...]``, replicated over `axis_name`; ``seq`` divisible by its size.

    Returns:
      ``[batch, seq / n, ...]``: chunk ``axis_index`` (rank order, like ``all_gather``).
    """
    if axis_name is None:
        return x
    n = lax.axis_size(axis_name)
    if x.shape[1] % n:
        raise ValueError(
            f"seq_chunk: sequence length {x.shape[1]} is not divisible by the {n} ranks of "
            f"{axis_name!r}; pad it first with pad_seq(x, {n}).")
    size = x.shape[1] // n
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis_name) * size, size, axis=1)


def seq_all_gather(x: jax.Array, axis_name: str | None) -> jax.Array:
    """``[batch, seq / n, ...]`` chunks -> the full ``[batch, seq, ...]`` on every rank."""
    if axis_name is None:
        return x
    return lax.all_gather(x, axis_name, axis=1, tiled=True)


def seq_reduce_scatter(x: jax.Array, axis_name: str | None) -> jax.Array:
    """Per-rank partial sums ``[batch, seq, ...]`` -> this rank's chunk of the sum."""
    if axis_name is None:
        return x
    return lax.psum_scatter(x, axis_name, scatter_dimension=1, tiled=True)


def column_parallel(x: jax.Array, w: jax.Array, axis_name: str | None, *,
                    overlap: bool = False, n_contract: int = 1) -> jax.Array:
    """Column-parallel GEMM on a sequence-sharded input.

    Args:
      x: ``[batch, seq / n, *k]``, this rank's sequence chunk (``[batch, seq, *k]`` when
        `axis_name` is None).
      w: ``[*k, *out_local]``, this rank's columns (output features) of the weight; same
        dtype as `x`.
      axis_name: the ``tp`` axis, or None for the single-device GEMM.
      overlap: ring collective matmul instead of all-gather then GEMM.
      n_contract: number of contracted dims (``len(k)``).

    Returns:
      ``[batch, seq, *out_local]``: the full sequence times this rank's columns.
    """
    if axis_name is None:
        y = _mm(_x3(x, n_contract), _as_2d(w, n_contract))
        return y.reshape(*x.shape[:2], *w.shape[n_contract:])
    return all_gather_matmul(x, w, axis_name, overlap=overlap, n_contract=n_contract)


def row_parallel(h: jax.Array, w: jax.Array, axis_name: str | None, *,
                 overlap: bool = False, n_contract: int = 1) -> jax.Array:
    """Row-parallel GEMM whose partial sums leave reduce-scattered along the sequence.

    Args:
      h: ``[batch, seq, *k_local]``, this rank's slice of the contracted features.
      w: ``[*k_local, *out]``, this rank's rows of the weight; same dtype as `h`.
      axis_name: the ``tp`` axis, or None for the single-device GEMM.
      overlap: ring collective matmul instead of GEMM then reduce-scatter.
      n_contract: number of contracted dims (``len(k_local)``).

    Returns:
      ``[batch, seq / n, *out]``: this rank's sequence chunk of ``sum_ranks h @ w``.
    """
    if axis_name is None:
        y = _mm(_x3(h, n_contract), _as_2d(w, n_contract))
        return y.reshape(*h.shape[:2], *w.shape[n_contract:])
    return matmul_reduce_scatter(h, w, axis_name, overlap=overlap, n_contract=n_contract)
