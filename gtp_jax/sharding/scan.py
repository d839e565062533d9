"""`scan_layers`: the scanned layer loop that gathers each layer's weights just in time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax

from gtp_jax.sharding.collectives import GATHERED_WEIGHT
from gtp_jax.sharding.lazy import is_shard
from gtp_jax.sharding.prefetch import prefetch_scan

Carry = TypeVar("Carry")

#: Remat policy for gathered weights outside the layer loop: keep every activation the
#: unsharded model would keep, but not the gathered weights (re-gathered in the backward).
GTP_REMAT_POLICY = jax.checkpoint_policies.save_anything_except_these_names(GATHERED_WEIGHT)


def scan_layers(
    layer_fn: Callable[[Carry, Any], Carry],
    carry: Carry,
    stacked_params: Any,
    *,
    remat_policy: Callable[..., bool] | None = None,
    prefetch: bool | None = None,
) -> Carry:
    """Runs ``carry = layer_fn(carry, params[i])`` for every layer ``i`` with ``lax.scan``.

    On plain stacked arrays (the unsharded model) this is an ordinary ``lax.scan``. On
    stacked `GTPShard` leaves (inside a `gtp_jax.shard`-ed module) it is a ``custom_vjp``
    loop (`gtp_jax.sharding.prefetch.prefetch_scan`) that all-gathers one layer at a time
    in the forward *and* the backward pass, reduce-scatters each layer's weight gradient,
    and never keeps a gathered weight from the forward pass for the backward pass.

    Args:
      layer_fn: ``(carry, layer_params) -> carry``; `layer_params` has the structure of
        `stacked_params` with the leading layer dimension removed.
      carry: loop state (e.g. activations ``[batch, seq, d_model]``).
      stacked_params: pytree whose leaves have a leading layer dimension ``L`` (arrays, or
        `GTPShard` for GTP-sharded weights).
      remat_policy: optional ``jax.checkpoint`` policy for each layer (activation recompute,
        e.g. ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``).
      prefetch: double buffering: layer ``i + 1``'s all-gather is issued before layer ``i``
        computes, and the backward loop gathers layer ``i - 1`` and reduce-scatters layer
        ``i + 1``'s gradient while layer ``i``'s backward runs. None follows the shards
        (``GTPConfig.prefetch``).

    Returns:
      The final carry.
    """
    shards = [x for x in jax.tree.leaves(stacked_params, is_leaf=is_shard) if is_shard(x)]
    if shards:
        if prefetch is None:
            prefetch = any(x.prefetch for x in shards)
        return prefetch_scan(layer_fn, carry, stacked_params, remat_policy=remat_policy,
                             prefetch=prefetch)

    def body(c, layer_params):
        return layer_fn(c, layer_params), None

    if remat_policy is not None:
        body = jax.checkpoint(body, policy=remat_policy, prevent_cse=False)
    carry, _ = jax.lax.scan(body, carry, stacked_params)
    return carry
