"""`scan_layers`: the scanned layer loop that gathers each layer's weights just in time."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax

from gtp_jax.sharding.collectives import GATHERED_POLICY, GATHERED_WEIGHT, regather_policy
from gtp_jax.sharding.gather_spec import GatherSpec
from gtp_jax.sharding.lazy import is_shard
from gtp_jax.sharding.loop import layer_loop

Carry = TypeVar("Carry")

def gathered_weight_policy(specs: Sequence[GatherSpec]) -> Callable[..., bool]:
    """A remat policy that saves everything except the gathered weights of `specs`.

    A name-based policy alone is not enough: it refuses to save the *named* value, but the
    value it names (the all-gather's output, or the slice that drops the padding) is still
    saveable, and JAX saves that instead. So this policy also refuses the outputs of
    ``all_gather`` and of a ``slice`` that turns a padded weight into its logical shape, and
    of the nested checkpoint that wraps a whole low-precision gather (`gather_weight`).
    """
    unpads = {(s.padded_shape, s.logical_shape) for s in specs if s.padding}
    # A low-precision gather rebuilds the weight with ordinary ops (decode, unpack, scale,
    # cast, reshape, unpad) that JAX inlines from the nested checkpoint, and any of them
    # could be saved instead. Those ops all work on arrays with the element count of the
    # gathered payload, block scales or weight, so nothing computed from such an operand is
    # saved, except the matmul outputs that consume the weight (activations). Over-matching
    # (an activation with the same element count) only costs a recompute, never correctness.
    gathered_sizes = set().union(*(_gathered_sizes(s) for s in specs if s.quantized))

    def gathered_operand(aval: Any) -> bool:
        shape = getattr(aval, "shape", None)
        return shape is not None and len(shape) >= 1 and math.prod(shape) in gathered_sizes

    def policy(prim: Any, *avals: Any, **params: Any) -> bool:
        if prim.name in ("all_gather", "all_gather_invariant"):
            return False
        if gathered_sizes and prim.name != "dot_general" and any(
                gathered_operand(a) for a in avals):
            return False
        # The checkpoint primitive is named "remat2" in current JAX, "checkpoint" before.
        if prim.name in ("checkpoint", "remat2") and params.get("policy") is regather_policy:
            return False  # a whole low-precision gather (`gather_weight`)
        if prim.name == "name" and params.get("name") == GATHERED_WEIGHT:
            return False
        if prim.name == "slice" and avals:
            key = (tuple(avals[0].shape), tuple(params.get("limit_indices", ())))
            if key in unpads and not any(params.get("start_indices", ())):
                return False
        return True

    setattr(policy, GATHERED_POLICY, True)
    return policy


def _gathered_sizes(spec: GatherSpec) -> set[int]:
    """Element counts of the arrays a low-precision gather of `spec` builds the weight from."""
    from gtp_jax import pallas  # deferred: only low-precision gathers need the kernels

    q = jax.eval_shape(lambda x: pallas.quantize(x, spec.gather_format, dim=spec.block_axis,
                                                 backend="reference"),
                       jax.ShapeDtypeStruct(spec.padded_shape, spec.param_dtype))
    sizes = {math.prod(spec.padded_shape), math.prod(spec.logical_shape),
             q.payload.size, 2 * q.payload.size}  # nvfp4 packs two values per byte
    if q.block_scales is not None:
        sizes.add(q.block_scales.size)
    return sizes


def scan_layers(
    layer_fn: Callable[[Carry, Any], Carry],
    carry: Carry,
    stacked_params: Any,
    *,
    remat_policy: Callable[..., bool] | None = None,
    prefetch: bool | None = None,
    unroll: bool = False,
) -> Carry:
    """Runs ``carry = layer_fn(carry, params[i])`` for every layer ``i`` with ``lax.scan``
    (or unrolled: `unroll`).

    On plain stacked arrays (the unsharded model) this is an ordinary ``lax.scan``. On
    stacked `GTPShard` leaves (inside a `gtp_jax.shard`-ed module) it is a ``custom_vjp``
    loop (`gtp_jax.sharding.loop.layer_loop`) that all-gathers one layer at a time
    in the forward *and* the backward pass, reduce-scatters each layer's weight gradient,
    and never keeps a gathered weight from the forward pass for the backward pass (unless
    the shards ask for it: ``GTPConfig.keep_gathered_layers`` keeps every layer's gathered
    weights and the backward pass gathers nothing).

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
        (``GTPConfig.prefetch``). No effect where every shard is whole (a GTP axis of
        size 1: nothing to gather).
      unroll: a Python loop over the layers instead of ``lax.scan`` (sharded or not; the
        ``"unrolled"`` schedule of `gtp_jax.sharding.loop`): each layer's saved residuals
        stay in their own buffers instead of being copied into and out of a stack, and the
        weight gradients are written in place into their stacks; the program and its compile
        time grow with the number of layers. It always gathers one layer ahead (as
        `prefetch` does; `prefetch` has no further effect). Same results as the scanned
        loop.

    Returns:
      The final carry.
    """
    if not isinstance(unroll, bool):
        raise TypeError(f"scan_layers: unroll={unroll!r} must be True or False (a partial "
                        "unroll, like lax.scan's unroll=k, is not offered).")
    shards = [x for x in jax.tree.leaves(stacked_params, is_leaf=is_shard) if is_shard(x)]
    if prefetch is None:
        prefetch = any(x.prefetch for x in shards)
    if prefetch and all(x.spec.axis_size == 1 for x in shards):
        # One shard per weight (gtp=1): nothing is gathered, so a double buffer would only
        # hold a second copy of the next layer's weights (llama3-8b: 0.9 GiB in bf16).
        prefetch = False
    if unroll or shards:
        schedule = "unrolled" if unroll else "prefetch" if prefetch else "plain"
        return layer_loop(layer_fn, carry, stacked_params, remat_policy=remat_policy,
                          schedule=schedule,
                          keep_gathered=any(x.keep_gathered for x in shards))

    def body(c, layer_params):
        return layer_fn(c, layer_params), None

    if remat_policy is not None:
        body = jax.checkpoint(body, policy=remat_policy, prevent_cse=False)
    carry, _ = jax.lax.scan(body, carry, stacked_params)
    return carry
