"""`scan_layers`: the scanned layer loop that gathers each layer's weights just in time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax

from gtp_jax.sharding.collectives import GATHERED_WEIGHT
from gtp_jax.sharding.lazy import has_shards, is_shard, materialize
from gtp_jax.sharding.prefetch import prefetch_scan

Carry = TypeVar("Carry")

#: Default remat policy for a GTP layer: keep every activation the unsharded model would
#: keep, but not the gathered weights (they are re-gathered in the backward pass).
GTP_REMAT_POLICY = jax.checkpoint_policies.save_anything_except_these_names(GATHERED_WEIGHT)


def scan_layers(
    layer_fn: Callable[[Carry, Any], Carry],
    carry: Carry,
    stacked_params: Any,
    *,
    remat_policy: Callable[..., bool] | None = None,
    prefetch: bool | None = None,
    unroll: int = 1,
) -> Carry:
    """Runs ``carry = layer_fn(carry, params[i])`` for every layer ``i`` with ``lax.scan``.

    Works on plain stacked arrays (the unsharded model) and on stacked `GTPShard` leaves
    (inside a `gtp_jax.shard`-ed module), which are all-gathered one layer at a time inside
    the loop body, so at most one layer's full weights are materialized per iteration.

    Args:
      layer_fn: ``(carry, layer_params) -> carry``; `layer_params` has the structure of
        `stacked_params` with the leading layer dimension removed.
      carry: loop state (e.g. activations ``[batch, seq, d_model]``).
      stacked_params: pytree whose leaves have a leading layer dimension ``L`` (arrays, or
        `GTPShard` for GTP-sharded weights).
      remat_policy: a ``jax.checkpoint`` policy for the layer body. None uses
        `GTP_REMAT_POLICY` when the params hold shards (re-gather weights in the backward
        pass) and no remat otherwise. A custom policy must not save `GATHERED_WEIGHT`
        names, or the full weights of every layer stay alive for the backward pass.
      prefetch: double-buffered prefetch (`gtp_jax.sharding.prefetch.prefetch_scan`): the
        all-gather of layer ``i + 1`` is issued before layer ``i`` computes, and the backward
        loop gathers layer ``i - 1`` and reduce-scatters layer ``i + 1``'s gradient while
        layer ``i``'s backward runs. None follows the shards (``GTPConfig.prefetch``).
      unroll: passed to ``jax.lax.scan`` (no-prefetch path only).

    Returns:
      The final carry.
    """

    shards = [x for x in jax.tree.leaves(stacked_params, is_leaf=is_shard) if is_shard(x)]
    if prefetch is None:
        prefetch = any(x.prefetch for x in shards)
    if prefetch and shards:
        return prefetch_scan(layer_fn, carry, stacked_params, remat_policy=remat_policy)

    def body(c, layer_params):
        return layer_fn(c, materialize(layer_params)), None

    policy = remat_policy
    if policy is None and has_shards(stacked_params):
        policy = GTP_REMAT_POLICY
    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    carry, _ = jax.lax.scan(body, carry, stacked_params, unroll=unroll)
    return carry
