"""`Stack`: any Flax NNX block, ``n`` times, run by the library's layer loop.

Flax's own idiom for a stack of identical layers builds the blocks with ``nnx.vmap`` (one
parameter per weight, leading dim = layer) and applies them with ``nnx.scan``. A `Stack`
does both, and marks its variables ``gtp_stacked`` (`gtp_jax.base.metadata.STACKED`), so
that `gtp_jax.shard` splits each weight on its first per-layer dim and the call runs
`gtp_jax.scan_layers`: inside a sharded call, the layer loop of `gtp_jax.sharding.loop`
(one layer gathered at a time, the next one prefetched, gradients reduce-scattered behind
the backward pass); outside, an ordinary ``lax.scan`` (or a Python loop: `unroll`).

A block keeps what it holds across the loop: its parameters (read), its RNG streams (each
layer has its own key, and its draws advance its own count) and any other state it writes
in ``__call__`` (counters, running means), which comes back stacked and is written into
the stack's variables after the loop, so `gtp_jax.ShardedModule` combines it over the data
shards by its type's rule as for any module. What a stack refuses, each in one line naming
the variable: a block holding a module or variable made outside ``make_block`` (a tie to a
layer outside the stack: hand that layer to the call instead) or per-example state
(`gtp_jax.PerExample`); a block that writes a parameter, an RNG key or what the call hands
it, adds a variable (``sow``) or changes the shape or dtype of its state in ``__call__``;
and a carry that comes back with another structure, shape or dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.errors import TraceContextError

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.base.fp8_history import Fp8History
from gtp_jax.base.metadata import REDUCE, STACKED
from gtp_jax.base.state import type_rule
from gtp_jax.sharding.contract import key_name, same_values
from gtp_jax.sharding.fp8_gather import gathered_like
from gtp_jax.sharding.lazy import is_shard
from gtp_jax.sharding.plan import path_str
from gtp_jax.sharding.scan import scan_layers

#: What the layer loop hands each layer as its weights: the parameters and the delayed-FP8
#: amax histories (read-only; their cotangent is the next history), floating and per layer.
#: Everything else a block holds travels in the loop's carry.
WEIGHTS = nnx.Any(nnx.Param, Fp8History)

_TIE_FIX = ("each layer of a stack owns what it holds. Hand the shared layer to the call "
            "instead (stack(x, shared), with block.__call__(x, shared)), or build it inside "
            "make_block if it is not shared")


class Stack(nnx.Module):
    """`n` blocks from ``make_block(rngs)``, parameters stacked on a leading layer dim, applied
    in sequence: ``carry = block_i(carry, *args, **kwargs)`` for ``i = 0 .. n - 1``.

    Built as Flax builds a stack of layers (``nnx.split_rngs(splits=n)`` over
    ``nnx.vmap(make_block)``: the same parameter bits as that idiom from the same `rngs`),
    with every variable marked ``gtp_stacked``. Under `gtp_jax.shard` each stacked weight is
    stored 1/N on its first per-layer dim and the call runs the library's layer loop, with
    what the bundled decoder gets: prefetch (`prefetch`, or ``GTPConfig.prefetch``),
    unrolled or scanned (`unroll`), a remat policy per layer (`remat`), gathers in
    ``GTPConfig.gather_format``, ``GTPConfig.keep_gathered_layers``, and FP8 compute for the
    blocks' ``nnx.Linear`` / ``nnx.LinearGeneral`` / ``nnx.Einsum`` layers
    (``GTPConfig.fp8_compute``). Unsharded it is a plain loop over the blocks.

    From Flax's idiom::

        @nnx.split_rngs(splits=n)                       # before
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs): return Block(rngs=rngs)
        self.blocks = create_block(rngs)
        ...
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block): return block(x)
        x = forward(x, self.blocks)

        self.blocks = gtp_jax.Stack(lambda r: Block(rngs=r), n, rngs=rngs)   # after
        ...
        x = self.blocks(x)

    Args:
      make_block: ``rngs -> nnx.Module``, called once under ``nnx.vmap`` with one layer's
        `nnx.Rngs`; the block is called as ``block(carry, *args, **kwargs) -> carry``.
      n: number of layers (>= 1).
      rngs: the `nnx.Rngs` the layers are built from (split ``n`` ways, every stream).
      remat: a ``jax.checkpoint`` policy applied to each layer (e.g.
        ``jax.checkpoint_policies.nothing_saveable``: save the layer's input only, as
        ``nnx.remat`` does; ``dots_with_no_batch_dims_saveable``), or None. Sharded, a
        gathered weight is never saved, whatever the policy.
      unroll: True: a Python loop over the layers (no copies of residuals into and out of
        stacks; a program and a compile time that grow with `n`); False: ``lax.scan``; None
        (default): unrolled unless `remat` is ``nothing_saveable``, as the bundled decoder
        (unrolled, XLA may schedule recomputation freely, so only the scanned loop bounds
        memory to the layer inputs).
      prefetch: sharded and scanned, gather layer ``i + 1`` while layer ``i`` computes (the
        unrolled loop always does). None: ``GTPConfig.prefetch``.

    Attributes:
      layers: the stacked block (every variable ``[n, ...]``).
      n, remat, unroll, prefetch: as given (`unroll` resolved).

    Raises:
      UsageTypeError: `make_block` is not callable or returns something other than an
        ``nnx.Module``; `rngs` is not an ``nnx.Rngs``; `remat` is not callable.
      UsageError: `n` is not a positive int, `unroll` / `prefetch` not a bool or None, the
        block holds a module or variable made outside `make_block`, or per-example state
        (`gtp_jax.PerExample`).
    """

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], n: int, *,
                 rngs: nnx.Rngs, remat: Callable[..., bool] | None = None,
                 unroll: bool | None = None, prefetch: bool | None = None):
        if isinstance(make_block, nnx.Module) or not callable(make_block):
            raise UsageTypeError(
                f"gtp_jax.Stack: make_block must be a function rngs -> nnx.Module (e.g. "
                f"lambda rngs: Block(rngs=rngs)), got {type(make_block).__name__}.")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UsageError(f"gtp_jax.Stack: n={n!r} must be a positive int (the number "
                             "of layers).")
        if not isinstance(rngs, nnx.Rngs):
            raise UsageTypeError(f"gtp_jax.Stack: rngs must be an nnx.Rngs, got "
                                 f"{type(rngs).__name__}.")
        if remat is not None and not callable(remat):
            raise UsageTypeError(
                f"gtp_jax.Stack: remat={remat!r} must be a jax.checkpoint policy (e.g. "
                "jax.checkpoint_policies.nothing_saveable) or None.")
        for name, value in (("unroll", unroll), ("prefetch", prefetch)):
            if value is not None and not isinstance(value, bool):
                raise UsageError(f"gtp_jax.Stack: {name}={value!r} must be True, False or "
                                 "None.")
        self.layers = _build(make_block, n, rngs)
        self.n = n
        self.remat = remat
        self.unroll = (remat is not jax.checkpoint_policies.nothing_saveable
                       if unroll is None else unroll)
        self.prefetch = prefetch

    def __call__(self, carry: Any, *args: Any, **kwargs: Any) -> Any:
        """``carry = block_i(carry, *args, **kwargs)`` for every layer, in order.

        Args:
          carry: a pytree of arrays (e.g. activations ``[batch, seq, d_model]``); every
            block must return one of the same structure, shapes and dtypes.
          *args, **kwargs: the same for every layer (masks, rotary tables, a shared layer
            the blocks read: a module or array made outside the stack). Gradients reach
            them, summed over the layers; a block must not write to them.

        Returns:
          The last block's carry.
        """
        graphdef, weights, state = nnx.split(self.layers, WEIGHTS, ...)
        state_paths, state_vars, state_tree = _flat(state)
        state_in = [v.get_value() for v in state_vars]

        def run(h: Any, w: Any, st: list) -> tuple[Any, dict[str, Any], dict[str, Any]]:
            """One layer: (its carry out, its variables' values before and after)."""
            block = nnx.merge(graphdef, w, jax.tree.unflatten(
                state_tree, [v.replace(value=x) for v, x in zip(state_vars, st)]))
            before = _values(block)
            try:
                out = block(h, *args, **kwargs)
            except TraceContextError as err:  # Flax refuses the write itself
                raise UsageError(
                    "gtp_jax.Stack: a block wrote to a module or variable it was handed in "
                    "the call; what the call hands the blocks is only read. Keep state a "
                    f"block writes in the block itself ({str(err).splitlines()[0]}).") from None
            return out, before, _values(block)

        written = _written_state(run, carry, weights, state_in, state_paths)

        def layer(c: Any, w: Any) -> Any:
            h, st, i = c
            st_i = [jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for a in st]
            out, _, after = run(h, w, st_i)
            st = [jax.lax.dynamic_update_index_in_dim(a, after[path], i, 0) if j in written
                  else a for j, (a, path) in enumerate(zip(st, state_paths))]
            return out, st, i + 1

        out, state_out, _ = scan_layers(
            layer, (carry, state_in, jnp.zeros((), jnp.int32)), weights,
            remat_policy=self.remat, prefetch=self.prefetch, unroll=self.unroll)
        if written:
            # Only what a block wrote: a value passed through the loop unchanged is not a
            # write (the sharded call refuses writes it has no combining rule for).
            nnx.update(self.layers, jax.tree.unflatten(state_tree, [
                v.replace(value=state_out[j] if j in written else v.get_value())
                for j, v in enumerate(state_vars)]))
        return out


def _build(make_block: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs
           ) -> nnx.Module:
    """The stacked block: Flax's ``split_rngs`` + ``vmap`` idiom, every variable marked
    ``gtp_stacked``."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r: nnx.Rngs) -> nnx.Module:
        block = make_block(r)
        if not isinstance(block, nnx.Module):
            raise UsageTypeError(f"gtp_jax.Stack: make_block returned a "
                                 f"{type(block).__name__}, not an nnx.Module.")
        return block

    try:
        layers = build(rngs)
    except ValueError as err:
        # nnx.vmap refuses a graph node from outside the function in its output.
        if "different trace level" not in str(err) or isinstance(err, UsageError):
            raise
        raise UsageError(
            "gtp_jax.Stack: the block from make_block holds a module or variable made outside "
            f"make_block (a tie to a layer outside the stack); {_TIE_FIX}.") from None
    for path, node in nnx.iter_graph(layers):
        if not isinstance(node, nnx.Variable):
            continue
        if (node.get_metadata().get(REDUCE) or type_rule(node)) == "concat":
            # its rows would be [n, batch, ...]: not split over the data shards as a batch
            raise UsageError(
                f"gtp_jax.Stack: the block's {path_str(key_name(k) for k in path)!r} is "
                "per-example state (PerExample / gtp_reduce='concat'), which a stack's "
                "layers cannot keep; return the per-example values in the carry instead.")
        node.set_metadata(STACKED, True)
    return layers


def _flat(state: nnx.State) -> tuple[list[str], list[nnx.Variable], Any]:
    """(paths, variables, treedef) of `state`, variables as leaves."""
    with_path, tree = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    paths = [path_str(key_name(k) for k in keys) for keys, _ in with_path]
    return paths, [v for _, v in with_path], tree


def _values(block: nnx.Module) -> dict[str, Any]:
    """``{path: value}`` of every variable of one layer's block."""
    return {path_str(key_name(k) for k in keys): v.get_value()
            for keys, v in nnx.to_flat_state(nnx.state(block))}


def _layer_like(x: Any) -> Any:
    """What one layer sees of a stacked leaf: a slice of an array, a gathered `GTPShard`."""
    if is_shard(x):
        spec = x.spec
        return gathered_like(spec) if spec.fp8_in_dims else jax.ShapeDtypeStruct(
            spec.logical_shape, spec.compute_dtype)
    return jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x))


def _written_state(run: Callable, carry: Any, weights: Any, state_in: list,
                   state_paths: list[str]) -> set[int]:
    """Indices (into `state_paths`) of the state a layer writes in its call, from one
    abstract trace of a layer (`run`), refusing in one line naming the variable: a carry
    that comes back changed in structure, shape or dtype, a variable added or removed, a
    written parameter, RNG key or amax history, and written state of another shape or dtype.

    A value that NNX's lifted transforms (``nnx.remat`` inside a block...) only pass on is
    not a write: it is the same value in the traced program (`same_values`).
    """
    paths: list[str] = []
    avals: dict[str, tuple[Any, Any]] = {}

    def probe(h: Any, w: Any, st: list) -> tuple[list, list]:
        out, before, after = run(h, w, st)
        _check_carry(h, out)
        for path in sorted(set(after) ^ set(before)):
            raise UsageError(
                f"gtp_jax.Stack: a block {'added' if path in after else 'removed'} the "
                f"variable {path!r} in __call__ (sow, or a new attribute); a stack's layers "
                "keep the variables they were built with. Return the value in the carry "
                "instead.")
        paths[:] = sorted(before)
        avals.update({p: (before[p], after[p]) for p in paths})
        return [jax.tree.leaves(before[p]) for p in paths], [
            jax.tree.leaves(after[p]) for p in paths]

    h_like = jax.eval_shape(lambda c: c, carry)
    w_like = jax.tree.map(_layer_like, weights, is_leaf=is_shard)
    st_like = [jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)) for x in state_in]
    closed, (before, after) = jax.make_jaxpr(probe, return_shape=True)(h_like, w_like,
                                                                       st_like)
    n = sum(len(x) for x in before)
    changed, start = set(), 0
    for path, old, new in zip(paths, before, after):
        pairs = [(start + i, n + start + i) for i in range(len(old))]
        if len(old) != len(new) or not all(same_values(closed.jaxpr, pairs)):
            changed.add(path)
        start += len(old)
    read_only = set(paths) - set(state_paths)
    for path in sorted(changed & read_only):
        raise UsageError(
            f"gtp_jax.Stack: a block wrote its {path!r} in __call__; parameters, RNG keys and "
            "FP8 amax histories are only read in a call (change parameters outside it, e.g. "
            "with the optimizer; reseed outside it).")
    for path in sorted(changed):
        old, new = (jax.tree.leaves(v) for v in avals[path])
        if [_describe(x) for x in old] != [_describe(x) for x in new]:
            raise UsageError(
                f"gtp_jax.Stack: a block changed its {path!r} from "
                f"{', '.join(map(_describe, old))} to {', '.join(map(_describe, new))} in "
                "__call__; each layer's state keeps its shape and dtype (cast it back).")
    return {j for j, path in enumerate(state_paths) if path in changed}


def _check_carry(h: Any, out: Any) -> None:
    """The block returned a carry of the structure, shapes and dtypes it was given."""
    def sig(x: Any) -> str:
        return str(jax.tree.map(_describe, x))

    if jax.tree.structure(h) != jax.tree.structure(out) or sig(h) != sig(out):
        raise UsageError(
            f"gtp_jax.Stack: a block returned {sig(out)} for the carry {sig(h)} (shapes as "
            "the block sees them: in a sharded call, one data shard's examples); each block "
            "must return a carry of the same structure, shapes and dtypes (cast its output, "
            "or keep per-layer results in the carry, e.g. a running sum).")


def _describe(x: Any) -> str:
    """``float32[2,4]``."""
    return f"{jnp.result_type(x)}{list(jnp.shape(x))}".replace(" ", "")
