"""A vocabulary-parallel embedding lookup and output head (functions for ``shard_map``).

A GTP-sharded embedding table ``[V, d]`` or output head ``[d, V]`` is otherwise gathered
whole on every rank before use, its float32 gradient ``[V, d]`` built whole and then
reduce-scattered: for Llama 3's 128256-token vocabulary that is 1 GB of bf16 per table
gathered and 2 GB of float32 per gradient, in each step, at the two ends of the step where
no layer's compute is beside them. Here each rank keeps its slice of the vocabulary (the
table split over the axis on its vocabulary dim) and moves activations instead, which are
far smaller (``[tokens, d]``: 32 MB at 2 x 2048 tokens of width 4096):

* `vocab_embed`: the ranks' token ids are gathered (int32), each rank looks up the rows its
  slice holds for every rank's tokens (zeros elsewhere) and a reduce-scatter over the axis
  sums the one nonzero contribution per token back to its rank (exact: the others are
  zeros). The backward pass gathers the cotangents and scatter-adds them into the slice.
* `vocab_logits`: the ranks' activations are gathered and each rank projects them onto its
  slice of the vocabulary: ``[axis_size * batch, seq, V / axis_size]`` logits, the rows of
  every rank on the axis and this rank's columns. They leave ``shard_map`` split over the
  axis on the vocabulary dim (the module's ``OutputLayout`` says so); a loss over them
  (`gtp_jax.models.cross_entropy`) reduces over the split dim with XLA's collectives.

Both take the weight as the sharding layer hands it over: a `LazyWeight` whose shard is
this rank's vocabulary slice (no gather), or any other value, whose slice is cut from the
whole weight (gathered first if it is a `LazyWeight` split on another dim). The results
are the same either way. The axis must be the innermost axis the batch is split over
(`gtp_jax.base.axes.vocab_axis`), so that gathering its ranks' rows keeps the global order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from gtp_jax.base.shapes import round_up
from gtp_jax.sharding.collectives import GATHERED_WEIGHT
from gtp_jax.sharding.lazy import LazyWeight


def _vocab_slice(weight: Any, vocab_dim: int, axis: str, axis_size: int,
                 dtype: Any) -> jax.Array:
    """This rank's slice of `weight` along `vocab_dim` (``round_up(V, axis_size) /
    axis_size`` entries, zero past ``V``), in `dtype`."""
    if (isinstance(weight, LazyWeight) and weight.spec.axis == axis
            and weight.spec.shard_dim == vocab_dim and weight.spec.axis_size == axis_size):
        local = weight.shard  # stored padded; the padding is zeros
    else:
        full = weight.gather() if isinstance(weight, LazyWeight) else jnp.asarray(weight)
        vocab = full.shape[vocab_dim]
        chunk = round_up(vocab, axis_size) // axis_size
        pad = [(0, 0)] * full.ndim
        pad[vocab_dim] = (0, chunk * axis_size - vocab)
        full = jnp.pad(full, pad)
        local = jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(axis) * chunk, chunk,
                                             vocab_dim)
    # Named like a gathered weight: the sharding layer's remat policy casts it again in
    # the backward pass instead of saving a second copy of the slice.
    return checkpoint_name(local.astype(dtype), GATHERED_WEIGHT)


def vocab_embed(tokens: jax.Array, table: Any, *, axis: str, axis_size: int,
                dtype: Any) -> jax.Array:
    """``take(table, tokens, axis=0)`` with the table's vocabulary split over `axis`.

    Args:
      tokens: int ``[batch, ...]`` this rank's token ids (< V).
      table: ``[V, d]`` embedding (see the module docstring for the forms it may take).
      axis, axis_size: the mesh axis the vocabulary is split over, and its ranks.
      dtype: the lookup's dtype (the table is cast first, as ``nnx.Embed`` does).

    Returns:
      ``[batch, ..., d]`` in `dtype`, this rank's rows: the unsharded lookup's values.
    """
    local = _vocab_slice(table, 0, axis, axis_size, dtype)
    chunk = local.shape[0]
    every = jax.lax.all_gather(tokens, axis, axis=0, tiled=True)
    rows = every - jax.lax.axis_index(axis) * chunk
    mine = (rows >= 0) & (rows < chunk)
    found = jnp.take(local, jnp.where(mine, rows, 0), axis=0)
    found = jnp.where(mine[..., None], found, jnp.zeros((), dtype))
    return jax.lax.psum_scatter(found, axis, scatter_dimension=0, tiled=True)


def vocab_logits(h: jax.Array, weight: Any, *, axis: str, axis_size: int, dtype: Any,
                 transpose: bool = False,
                 dot: Callable[..., jax.Array] | None = None) -> jax.Array:
    """This rank's vocabulary slice of the logits of every rank's rows on `axis`.

    Args:
      h: ``[batch, seq, d]`` this rank's activations.
      weight: ``[d, V]`` head kernel, or ``[V, d]`` with `transpose` (a tied embedding).
      axis, axis_size: the mesh axis the vocabulary is split over, and its ranks.
      dtype: the dtype both operands are promoted to (the head's compute dtype).
      transpose: `weight` is ``[V, d]`` (``nnx.Embed.attend``).
      dot: ``(lhs, rhs, dimension_numbers) -> out`` (default ``jax.lax.dot_general``), e.g.
        the head's own ``dot_general``.

    Returns:
      ``[axis_size * batch, seq, chunk]`` in `dtype`, ``chunk = round_up(V, axis_size) /
      axis_size`` (columns past V hold zeros): rows in the order of the ranks on `axis`.
    """
    vocab_dim = 0 if transpose else 1
    local = _vocab_slice(weight, vocab_dim, axis, axis_size, dtype)
    every = jax.lax.all_gather(h.astype(dtype), axis, axis=0, tiled=True)
    dot = jax.lax.dot_general if dot is None else dot
    contract = 1 if transpose else 0
    return dot(every, local, (((every.ndim - 1,), (contract,)), ((), ())))
