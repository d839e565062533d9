"""Mixture-of-experts feed-forward block: top-k routing, capacity dispatch, expert parallelism.

Routing (per sequence; a sequence is the routing group):
  * router: ``logits = x @ W_r`` in float32, ``probs = softmax(logits)`` over the experts;
    each token picks its ``top_k`` experts; gates are the chosen probabilities, renormalised
    to sum to 1 when ``top_k > 1`` (Switch uses the raw probability for ``top_k = 1``).
  * capacity: each expert takes at most ``C = min(T, ceil(capacity_factor * T * top_k / E))``
    tokens of a sequence of ``T`` tokens. Slots are given in GShard priority: every token's
    first choice before any second choice, and within one choice rank in sequence order. A
    (token, choice) that finds its expert full is dropped: it contributes nothing, and a
    token whose choices are all dropped leaves the block as zero, i.e. the residual stream
    passes it through unchanged. ``capacity_factor=None`` is *dropless*: ``C = T``, which no
    expert can overflow (a token picks distinct experts), at the price of buffers of
    ``E * T`` slots per sequence.
  * load-balancing loss (Switch Transformer, eq. 4, with top-k assignment fractions):
    ``aux = E * sum_e f_e * P_e`` per sequence, ``f_e`` = fraction of the sequence's
    ``T * top_k`` (token, choice) assignments that chose expert ``e`` (before dropping; no
    gradient), ``P_e`` = mean router probability of ``e``. It is 1 for perfectly uniform
    routing. Returned per sequence (``[batch]``) so a sharded batch gives exactly the
    unsharded value.

Because the group is a whole sequence, routing and dropping do not depend on how the batch
or the sequence is sharded: the sharded model drops exactly the tokens the unsharded one
drops.

Parallelism (inside ``jax.shard_map``; `gtp_jax.parallel.current_axes` names the axes):
  * ``ep``: experts are split over ``ep`` (stored ``[E, d, 2f]`` with ``P("ep", ...)``).
    Dispatched buffers ``[E, B, C, d]`` go through ``all_to_all`` (experts split, batch
    concatenated) to the rank holding each expert, and back after the expert FFN.
  * ``tp`` (with sequence parallelism): like the dense Megatron MLP, the sequence-sharded
    input is all-gathered over ``tp``, every ``tp`` rank routes the full sequence (same
    result on each), computes its slice of every expert's hidden width (expert weights
    column/row split on ``f``), and the partial outputs are reduce-scattered back along the
    sequence. The ring collective matmul is not used here: the first GEMM after the gather
    is the router, and the expert GEMMs sit between the two all-to-alls.
  * GTP: each layer's expert weights are *one* stacked tensor per projection, so all of a
    layer's (local) experts are all-gathered in one collective and their gradients
    reduce-scattered in one, on the ``d_model`` dim (never the expert dim).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from gtp_jax.base.axes import current_axes
from gtp_jax.base.metadata import EP_DIM, SHARD_DIM, TP_DIM, TP_PARTS
from gtp_jax.parallel.tp import seq_all_gather, seq_reduce_scatter


def expert_capacity(seq_len: int, num_experts: int, top_k: int,
                    capacity_factor: float | None) -> int:
    """Slots per expert per sequence: ``min(T, ceil(cf * T * k / E))`` (``T`` if dropless)."""
    if capacity_factor is None:
        return seq_len
    return max(1, min(seq_len, math.ceil(capacity_factor * seq_len * top_k / num_experts)))


class Routing(NamedTuple):
    """Where each (token, choice) goes.

    Attributes:
      expert: int32 ``[B, T, k]`` chosen experts (descending probability).
      gate: float32 ``[B, T, k]`` combine weights (0 for dropped choices and padding).
      slot: int32 ``[B, T, k]`` index into the flattened ``[E * C]`` expert buffer of the
        sequence; ``E * C`` (one past the end) for dropped choices and padding.
      aux: float32 ``[B]`` load-balancing loss per sequence.
      dropped: float32 ``[B]``: the (token, choice) assignments of real tokens that found
        their expert full, per sequence (0 when dropless).
    """

    expert: jax.Array
    gate: jax.Array
    slot: jax.Array
    aux: jax.Array
    dropped: jax.Array


def route(logits: jax.Array, top_k: int, capacity: int,
          valid: jax.Array | None = None) -> Routing:
    """Top-k routing with per-sequence capacity (see the module docstring).

    Args:
      logits: float32 ``[B, T, E]`` router logits.
      top_k: experts per token.
      capacity: slots per expert per sequence.
      valid: bool ``[T]``: positions that are real tokens (padding is never routed and does
        not count in the loss statistics); None: all.

    Returns:
      A `Routing`.
    """
    b, t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"route: top_k={top_k} must be in [1, num_experts={e}].")
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_p, expert = lax.top_k(probs, top_k)
    gate = top_p / jnp.sum(top_p, axis=-1, keepdims=True) if top_k > 1 else top_p
    valid = jnp.ones((t,), bool) if valid is None else valid
    onehot = jax.nn.one_hot(expert, e, dtype=jnp.int32) * valid[None, :, None, None]
    # GShard priority: all first choices (in sequence order), then all second choices, ...
    order = jnp.swapaxes(onehot, 1, 2).reshape(b, top_k * t, e)
    position = jnp.sum((jnp.cumsum(order, axis=1) - 1) * order, axis=-1)
    position = jnp.swapaxes(position.reshape(b, top_k, t), 1, 2)
    keep = (position < capacity) & valid[None, :, None]
    slot = jnp.where(keep, expert * capacity + position, e * capacity).astype(jnp.int32)
    # Switch load-balancing loss over the sequence's real tokens.
    n_valid = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
    frac = lax.stop_gradient(jnp.sum(onehot, axis=(1, 2)).astype(jnp.float32)) / (
        n_valid * top_k)
    mean_prob = jnp.sum(probs * valid[None, :, None], axis=1) / n_valid
    aux = e * jnp.sum(frac * mean_prob, axis=-1)
    dropped = jnp.sum((~keep) & valid[None, :, None], axis=(1, 2)).astype(jnp.float32)
    return Routing(expert=expert, gate=jnp.where(keep, gate, 0.0), slot=slot, aux=aux,
                   dropped=dropped)


def dispatch(x: jax.Array, slot: jax.Array, num_experts: int, capacity: int) -> jax.Array:
    """Gathers tokens into per-expert buffers.

    Args:
      x: ``[B, T, d]`` tokens.
      slot: int32 ``[B, T, k]`` from `route`.

    Returns:
      ``[E, B, C, d]``: buffer ``[e, b, c]`` holds the token of sequence ``b`` in slot ``c``
      of expert ``e`` (zeros in unused slots). Its gradient scatter-adds back into `x`.
    """
    b, t, d = x.shape
    size = num_experts * capacity
    tokens = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :, None], slot.shape)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], slot.shape)
    # Which token fills each slot (t: the zero row appended below). Slots are unique, and
    # dropped choices point one past the end, which mode="drop" discards.
    source = jnp.full((b, size), t, jnp.int32).at[rows, slot].set(tokens, mode="drop")
    padded = jnp.concatenate([x, jnp.zeros((b, 1, d), x.dtype)], axis=1)
    buf = padded[jnp.arange(b)[:, None], source]
    return jnp.swapaxes(buf.reshape(b, num_experts, capacity, d), 0, 1)


def combine(y: jax.Array, gate: jax.Array, slot: jax.Array) -> jax.Array:
    """Weighted sum of each token's expert outputs.

    Args:
      y: ``[E, B, C, d]`` expert outputs in the `dispatch` layout.
      gate: ``[B, T, k]`` combine weights (0 for dropped choices).
      slot: int32 ``[B, T, k]``.

    Returns:
      ``[B, T, d]`` in `y`'s dtype.
    """
    e, b, c, d = y.shape
    flat = jnp.swapaxes(y, 0, 1).reshape(b, e * c, d)
    flat = jnp.concatenate([flat, jnp.zeros((b, 1, d), y.dtype)], axis=1)
    picked = flat[jnp.arange(b)[:, None, None], slot]
    return jnp.einsum("btkd,btk->btd", picked, gate.astype(y.dtype))


def expert_ffn(buf: jax.Array, w_in: jax.Array, w_out: jax.Array) -> jax.Array:
    """SwiGLU of every local expert on its buffer.

    Args:
      buf: ``[E_local, N, C, d]``.
      w_in: ``[E_local, d, 2 f_local]`` fused ``[gate | up]`` (this rank's hidden slice).
      w_out: ``[E_local, f_local, d]``.

    Returns:
      ``[E_local, N, C, d]`` (a partial sum over ``tp`` when the hidden width is split).
    """
    h = jnp.einsum("encd,edf->encf", buf, w_in)
    gate, up = jnp.split(h, 2, axis=-1)
    return jnp.einsum("encf,efd->encd", jax.nn.silu(gate) * up, w_out)


def moe_ffn(x: jax.Array, router: jax.Array, w_in: jax.Array, w_out: jax.Array, *,
            top_k: int, capacity_factor: float | None, valid_len: int | None = None,
            tp: str | None = None, ep: str | None = None, with_dropped: bool = False
            ) -> tuple[jax.Array, ...]:
    """The MoE feed-forward: route, dispatch, (all-to-all), experts, (all-to-all), combine.

    Args:
      x: ``[B, S, d]``: the sequence chunk of this ``tp`` rank (the full sequence when
        `tp` is None); compute dtype.
      router: ``[d, E]`` router kernel (all experts; replicated over ``tp``/``ep``).
      w_in: ``[E / ep, d, 2 f / tp]`` local experts' fused ``[gate | up]`` kernels.
      w_out: ``[E / ep, f / tp, d]`` local experts' down kernels.
      top_k, capacity_factor: see `route` / `expert_capacity`.
      valid_len: number of real positions of the (padded) full sequence; None: all.
      tp: tensor/sequence-parallel axis name or None.
      ep: expert-parallel axis name or None.
      with_dropped: also return the per-sequence count of dropped (token, choice)
        assignments (`Routing.dropped`).

    Returns:
      ``(y, aux)``: ``y`` like `x`; ``aux`` float32 ``[B]`` per-sequence balance loss; with
      `with_dropped`, ``(y, aux, dropped)``.
    """
    num_experts = router.shape[-1]
    ep_size = lax.axis_size(ep) if ep is not None else 1
    if w_in.shape[0] * ep_size != num_experts or w_out.shape[0] != w_in.shape[0]:
        raise ValueError(
            f"moe_ffn: the router has {num_experts} experts but the local expert weights "
            f"{w_in.shape} / {w_out.shape} hold {w_in.shape[0]} on each of {ep_size} ep ranks.")
    full = seq_all_gather(x, tp)
    seq_len = full.shape[1]
    valid_len = seq_len if valid_len is None else valid_len
    capacity = expert_capacity(valid_len, num_experts, top_k, capacity_factor)
    logits = jnp.einsum("btd,de->bte", full.astype(jnp.float32), router.astype(jnp.float32))
    valid = jnp.arange(seq_len) < valid_len
    routing = route(logits, top_k, capacity, valid)
    buf = dispatch(full, routing.slot, num_experts, capacity)
    if ep is not None:
        buf = lax.all_to_all(buf, ep, split_axis=0, concat_axis=1, tiled=True)
    out = expert_ffn(buf, w_in.astype(buf.dtype), w_out.astype(buf.dtype))
    if ep is not None:
        out = lax.all_to_all(out, ep, split_axis=1, concat_axis=0, tiled=True)
    y = seq_reduce_scatter(combine(out, routing.gate, routing.slot), tp)
    return (y, routing.aux, routing.dropped) if with_dropped else (y, routing.aux)




class MoE(nnx.Module):
    """SwiGLU mixture-of-experts FFN with a linear router (see the module docstring).

    Parameters: ``router.kernel [d, E]``, ``w_in [E, d, 2 f]`` (fused ``[gate | up]`` of
    every expert) and ``w_out [E, f, d]``. Their metadata splits experts over ``ep`` and the
    hidden width over ``tp``, and makes GTP shard the ``d_model`` dim.

    Call: ``moe(x, valid_len=None) -> (y, aux, dropped)`` with ``x: [B, S, d]``
    (sequence-sharded over ``tp`` under tensor parallelism), ``y`` like `x`, ``aux: float32
    [B]`` (the balance loss) and ``dropped: float32 [B]`` (`Routing.dropped`).
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, *, top_k: int = 2,
                 capacity_factor: float | None = 1.25, dtype: Any = None,
                 param_dtype: Any = jnp.float32, init_std: float = 0.02,
                 out_std: float = 0.02, rngs: nnx.Rngs):
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(
                f"MoE: top_k={top_k} must be in [1, num_experts={num_experts}].")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(
                f"MoE: capacity_factor={capacity_factor} must be > 0 (or None: dropless).")
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.dtype = dtype
        self.router = nnx.Linear(d_model, num_experts, use_bias=False, dtype=jnp.float32,
                                 param_dtype=param_dtype,
                                 kernel_init=nnx.initializers.normal(init_std), rngs=rngs)
        init_in = nnx.initializers.normal(init_std)
        init_out = nnx.initializers.normal(out_std)
        self.w_in = nnx.Param(
            init_in(rngs.params(), (num_experts, d_model, 2 * d_ff), param_dtype),
            **{EP_DIM: 0, TP_DIM: 2, TP_PARTS: 2, SHARD_DIM: 1})
        self.w_out = nnx.Param(
            init_out(rngs.params(), (num_experts, d_ff, d_model), param_dtype),
            **{EP_DIM: 0, TP_DIM: 1, SHARD_DIM: 2})

    def __call__(self, x: jax.Array, valid_len: int | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        axes = current_axes()
        dtype = self.dtype or x.dtype
        return moe_ffn(x.astype(dtype), self.router.kernel[...], self.w_in[...],
                       self.w_out[...], top_k=self.top_k,
                       capacity_factor=self.capacity_factor, valid_len=valid_len,
                       tp=axes.tp, ep=axes.ep, with_dropped=True)

