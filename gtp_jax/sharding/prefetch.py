"""Double-buffered prefetch over a scanned layer stack, with a hand-written backward loop.

Forward: the loop carry holds layer ``i``'s gathered weights; iteration ``i`` issues the
all-gather of layer ``i + 1`` before running layer ``i``, with no data dependence between
the two, so at most two gathered layers are alive.

Backward (``custom_vjp`` over the whole stack): the loop runs from the last layer down;
iteration ``i`` gathers layer ``i - 1``'s weights and reduce-scatters layer ``i + 1``'s weight
gradient (one-step delay) while layer ``i``'s dgrad/wgrad compute.

Activations: the forward pass keeps each layer's autodiff residuals (what the unsharded
model keeps, under the layer's own remat policy) *except the gathered weights*, which are
recognised among the residuals and re-inserted from the prefetched buffer in the backward
loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gtp_jax.sharding.collectives import all_gather_shards, reduce_scatter_grad
from gtp_jax.sharding.lazy import is_shard


class _ResidualLayout:
    """How one layer's vjp residuals are rebuilt: which leaves are the gathered weights."""

    def __init__(self) -> None:
        self.treedef: Any = None
        self.slots: tuple[int | None, ...] = ()

    def record(self, treedef: Any, slots: tuple[int | None, ...]) -> None:
        if self.treedef is None:
            self.treedef, self.slots = treedef, slots
        elif (treedef, slots) != (self.treedef, self.slots):
            raise RuntimeError(
                "prefetch_scan: the layer's residual structure differs between traces; "
                "the layer function must be deterministic in structure."
            )

    def strip(self, vjp_fn: Any, weights: list[jax.Array]) -> list[jax.Array]:
        leaves, treedef = jax.tree.flatten(vjp_fn)
        slots: list[int | None] = []
        kept = []
        for leaf in leaves:
            slot = next((j for j, w in enumerate(weights) if leaf is w), None)
            slots.append(slot)
            if slot is None:
                kept.append(leaf)
        _warn_weight_sized(kept, weights)
        self.record(treedef, tuple(slots))
        return kept

    def rebuild(self, kept: list[jax.Array], weights: list[jax.Array]) -> Callable:
        it = iter(kept)
        leaves = [weights[s] if s is not None else next(it) for s in self.slots]
        return jax.tree.unflatten(self.treedef, leaves)


def _warn_weight_sized(kept: list[jax.Array], weights: list[jax.Array]) -> None:
    sizes = {(tuple(w.shape), w.dtype) for w in weights if w.ndim >= 2}
    if any((tuple(r.shape), r.dtype) in sizes for r in kept):
        warnings.warn(
            "gtp_jax prefetch: a layer keeps a weight-sized value for its backward pass "
            "(often a dtype cast of a gathered weight). Set GTPConfig.gather_dtype to the "
            "module's compute dtype so the gathered weight is used as is.",
            stacklevel=3,
        )


def prefetch_scan(
    layer_fn: Callable[[Any, Any], Any],
    carry: Any,
    stacked_params: Any,
    *,
    remat_policy: Callable[..., bool] | None = None,
    prefetch: bool = True,
) -> Any:
    """`scan_layers` over GTP shards with a hand-written backward loop.

    With ``prefetch=True``: double-buffered prefetch (see the module docstring). With
    ``prefetch=False``: each iteration gathers its own layer just before use, and the
    backward loop reduce-scatters each layer's gradient right after computing it; the
    residual handling (weights never saved) is the same, so the two differ only in
    scheduling.

    Args:
      layer_fn: ``(carry, layer_params) -> carry``.
      carry: initial carry (a pytree of arrays).
      stacked_params: pytree with a leading layer dim; `GTPShard` leaves are prefetched,
        other leaves (replicated stacked params) are sliced per layer.
      remat_policy: optional ``jax.checkpoint`` policy applied to each layer.
      prefetch: issue the next layer's all-gather (and the previous layer's reduce-scatter)
        one iteration early.

    Returns:
      The final carry.
    """
    leaves, treedef = jax.tree.flatten(stacked_params, is_leaf=is_shard)
    shard_pos = [i for i, x in enumerate(leaves) if is_shard(x)]
    plain_pos = [i for i, x in enumerate(leaves) if not is_shard(x)]
    specs = [leaves[i].spec for i in shard_pos]
    shards = [leaves[i].shard for i in shard_pos]
    plain = [leaves[i] for i in plain_pos]
    num_layers = (shards or plain)[0].shape[0]
    fn = layer_fn if remat_policy is None else jax.checkpoint(layer_fn, policy=remat_policy)

    def apply(h: Any, weights: list[jax.Array], plain_i: list[jax.Array]) -> Any:
        merged = [None] * len(leaves)
        for pos, w in zip(shard_pos, weights):
            merged[pos] = w
        for pos, p in zip(plain_pos, plain_i):
            merged[pos] = p
        return fn(h, jax.tree.unflatten(treedef, merged))

    example_w = [jax.ShapeDtypeStruct(s.logical_shape, s.compute_dtype) for s in specs]
    example_p = [jax.ShapeDtypeStruct(p.shape[1:], p.dtype) for p in plain]
    converted, consts = jax.closure_convert(apply, carry, example_w, example_p)
    # One layout per trace site: a vjp's treedef holds the traced backward function, so the
    # scanned layers and the peeled last layer each rebuild from their own.
    mid_layout, last_layout = _ResidualLayout(), _ResidualLayout()

    def gather(layer_shards: list[jax.Array]) -> list[jax.Array]:
        # One call per layer: low-precision formats agree on all scales of the layer with a
        # single all-reduce.
        return all_gather_shards(layer_shards, specs)

    # Every per-layer access is a dynamic index into the *whole* stacked array, which the
    # loop reads in place. Slicing a stack first (``s[1:]``) or concatenating per-layer
    # results afterwards would make XLA materialize a copy of every stacked shard, residual
    # and gradient (measured: +5 GiB and ~9 ms per step on the 1B preset).
    def at(arrays: list[jax.Array], i: Any) -> list[jax.Array]:
        return [jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for a in arrays]

    def tree_at(tree: Any, i: Any) -> Any:
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)

    def put(buffers: list[jax.Array], values: list[jax.Array], i: Any) -> list[jax.Array]:
        return [jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), i, 0)
                for b, v in zip(buffers, values)]

    def step(h, w, plain_i, consts_, layout):
        if layout is None:
            return converted(h, w, plain_i, *consts_), None
        out, vjp_fn = jax.vjp(lambda h_, w_, p_, c_: converted(h_, w_, p_, *c_),
                              h, w, plain_i, list(consts_))
        return out, layout.strip(vjp_fn, w)

    last = num_layers - 1

    def forward(h, shards_, plain_, consts_, keep):
        w = gather(at(shards_, 0))
        stacked_res = None
        if num_layers > 1:
            def body(c, i):
                h_, w_cur = c
                w_next = gather(at(shards_, i + 1))  # independent of this layer's compute
                h_, res = step(h_, w_cur, at(plain_, i), consts_,
                               mid_layout if keep else None)
                return (h_, w_next), res

            (h, w), stacked_res = jax.lax.scan(body, (h, w), jnp.arange(last))
        h, last_res = step(h, w, at(plain_, last), consts_, last_layout if keep else None)
        return h, (stacked_res, last_res)

    def backward(saved, ct):
        (stacked_res, last_res), shards_, plain_, consts_ = saved
        float_consts = [jnp.issubdtype(c.dtype, jnp.inexact) for c in consts_]

        def vjp_at(layout, res, w, dh):
            dh, dw, dp, dc = layout.rebuild(res, w)(dh)
            return dh, dw, dp, [d if f else None for d, f in zip(dc, float_consts)]

        def add(acc, new):
            return [a if n is None else a + n for a, n in zip(acc, new)]

        def rs(dw):
            return [reduce_scatter_grad(g, spec) for g, spec in zip(dw, specs)]

        # Gradients are written into full-size stacked buffers as they arrive (in place in
        # the loop carry) instead of being concatenated at the end.
        shard_buf = [jnp.zeros(s.shape, s.dtype) for s in shards_]
        plain_buf = [jnp.zeros(p.shape, p.dtype) for p in plain_]

        w = gather(at(shards_, last))
        w_prev = gather(at(shards_, last - 1)) if num_layers > 1 else None
        dh, pending, dp_last, dc = vjp_at(last_layout, last_res, w, ct)
        plain_buf = put(plain_buf, dp_last, last)
        dconsts = [d if d is not None else jnp.zeros(c.shape, c.dtype) if f else None
                   for d, c, f in zip(dc, consts_, float_consts)]
        if num_layers == 1:
            shard_buf = put(shard_buf, rs(pending), 0)
            return dh, shard_buf, plain_buf, _const_cts(dconsts, consts_)

        if num_layers > 2:
            def body(c, i):
                dh_, w_cur, pending_, dconsts_, sbuf, pbuf = c
                w_next = gather(at(shards_, i - 1))  # prefetch layer i - 1
                sbuf = put(sbuf, rs(pending_), i + 1)  # in flight while layer i computes
                dh_, dw, dp, dc_ = vjp_at(mid_layout, tree_at(stacked_res, i), w_cur, dh_)
                pbuf = put(pbuf, dp, i)
                return (dh_, w_next, dw, add(dconsts_, dc_), sbuf, pbuf), None

            carry = (dh, w_prev, pending, dconsts, shard_buf, plain_buf)
            (dh, w_prev, pending, dconsts, shard_buf, plain_buf), _ = jax.lax.scan(
                body, carry, jnp.arange(1, last), reverse=True)
        shard_buf = put(shard_buf, rs(pending), 1)
        dh, dw0, dp0, dc = vjp_at(mid_layout, tree_at(stacked_res, 0), w_prev, dh)
        dconsts = add(dconsts, dc)
        shard_buf = put(shard_buf, rs(dw0), 0)
        plain_buf = put(plain_buf, dp0, 0)
        return dh, shard_buf, plain_buf, _const_cts(dconsts, consts_)

    def forward_in_place(h, shards_, plain_, consts_, keep):
        def body(h_, xs):
            layer_shards, plain_i = xs
            return step(h_, gather(layer_shards), plain_i, consts_, mid_layout if keep else None)

        return jax.lax.scan(body, h, (shards_, plain_))

    def backward_in_place(saved, ct):
        stacked_res, shards_, plain_, consts_ = saved
        float_consts = [jnp.issubdtype(c.dtype, jnp.inexact) for c in consts_]
        zero = [jnp.zeros(c.shape, c.dtype) if f else None
                for c, f in zip(consts_, float_consts)]

        def body(c, xs):
            dh, dconsts = c
            res_i, layer_shards = xs
            w = gather(layer_shards)
            dh, dw, dp, dc = mid_layout.rebuild(res_i, w)(dh)
            dconsts = [a if not f else a + d for a, d, f in zip(dconsts, dc, float_consts)]
            grads = [reduce_scatter_grad(g, spec) for g, spec in zip(dw, specs)]
            return (dh, dconsts), (grads, dp)

        (dh, dconsts), (shard_grads, plain_grads) = jax.lax.scan(
            body, (ct, zero), (stacked_res, shards_), reverse=True)
        return dh, shard_grads, plain_grads, _const_cts(dconsts, consts_)

    if not prefetch:
        forward, backward = forward_in_place, backward_in_place

    @jax.custom_vjp
    def run(h, shards_, plain_, consts_):
        return forward(h, shards_, plain_, consts_, keep=False)[0]

    def run_fwd(h, shards_, plain_, consts_):
        out, res = forward(h, shards_, plain_, consts_, keep=True)
        return out, (res, shards_, plain_, consts_)

    run.defvjp(run_fwd, backward)
    return run(carry, shards, plain, list(consts))


def _const_cts(dconsts: list[Any], consts: list[jax.Array]) -> list[Any]:
    return [d if d is not None else np.zeros(c.shape, jax.dtypes.float0)
            for d, c in zip(dconsts, consts)]
