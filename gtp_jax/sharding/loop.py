"""The layer loop over GTP shards: one ``custom_vjp`` whose schedule picks the gather order.

`layer_loop` runs ``carry = layer(carry, params[i])`` over a stack of layers whose weights
are `GTPShard`s. It is one ``jax.custom_vjp`` (`_loop`, rules `_loop_fwd` / `_loop_bwd`)
over a static `LoopSpec`; the spec's schedule picks the forward and backward bodies:

``"plain"``
  each iteration gathers its own layer just before use; the backward loop re-gathers it
  and reduce-scatters its weight gradient right after computing it.
``"prefetch"``
  double buffering: the forward iteration ``i`` issues layer ``i + 1``'s gather before
  running layer ``i`` (no data dependence between the two, so at most two gathered layers
  are alive); the backward iteration ``i`` gathers layer ``i - 1`` and reduce-scatters layer
  ``i + 1``'s gradient (one step late) while layer ``i``'s backward runs.
``"unrolled"``
  no ``lax.scan``: a Python loop over the layers, so each layer's residuals stay in their
  own buffers (a scanned loop copies every saved residual into a stack and back out of it)
  at the price of a program, and a compile time, that grow with the number of layers. The
  prefetch order is kept by optimization barriers: layer ``i + 1``'s gather (backward:
  ``i - 1``'s) cannot start before layer ``i``'s input exists, and layer ``i + 1``'s
  gradient reduce-scatter must finish before layer ``i - 1``'s backward starts; without
  them XLA may gather layers early and merge a backward re-gather with the identical
  forward gather, keeping gathered layers alive from the forward to the backward pass.

Residuals. Each layer's autodiff residuals (under the layer's own remat policy) are split
by what they depend on, read off the layer's jaxpr (`_ResidualSplit`): a residual computed
from the layer's input activations is saved; a residual computed from the weights, the
per-layer replicated parameters and constants alone is not, and the backward pass
recomputes it from the re-gathered weights. So no gathered weight, and no cast, transpose
or reshape of one, is kept from the forward pass, whatever the layer does with it.

Gradient stacks. The scanned schedules write each layer's weight gradients into full-size
stacks, allocated when they first need them (`_stacks_after`); the unrolled schedule keeps
each layer's gradients in buffers of their own and stacks them at the end, where no data
axis sums the stacks after the loop (`_LayerGrads`). Unsharded, a replicated
weight whose only use in the layer is one cast to a narrower float is cast before the
layer instead (`_only_cast`), so its gradient stack is kept in that dtype and widened once
at the end: the same values.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from gtp_jax.base.axes import current_axes
from gtp_jax.sharding.collectives import (
    GatherSpec,
    all_gather_shards,
    gradient_of,
    reduce_scatter_grads,
)
from gtp_jax.sharding.fp8_gather import gathered_like, with_value, without_value
from gtp_jax.sharding.lazy import is_shard

#: Loop schedules: see the module docstring.
SCHEDULES = ("plain", "prefetch", "unrolled")


class _ResidualSplit:
    """Which of one layer's vjp residuals are saved, and how the others are recomputed.

    Filled when the forward pass is traced (once per trace site: the scanned layers and a
    peeled last layer have different traced backward functions), read when the backward
    pass is traced. The layer is linearized once per split: its jaxpr (`jaxpr`: the
    layer's output and its vjp residuals) is then evaluated for every layer that shares
    the split (the unrolled layers with the same argument types, each scan iteration), not
    traced and linearized again.
    """

    def __init__(self) -> None:
        self.treedef: Any = None  # of the layer's vjp function (its leaves: the residuals)
        self.saved: tuple[bool, ...] = ()
        # closed jaxpr: (h, weights, plain, consts) -> (output leaves, residuals)
        self.jaxpr: Any = None
        self.num_h = 0  # leaves of the activations argument
        self.num_out = 0  # leaves of the layer's output
        self.out_tree: Any = None
        self.signature: Any = None  # `_signature` of the arguments the jaxpr was traced for

    def saved_shapes(self, layer: Callable, args: tuple) -> list[jax.ShapeDtypeStruct]:
        """Shapes of the residuals `forward` saves (traces the layer abstractly once;
        `args` may be ``jax.ShapeDtypeStruct``s)."""
        if self.jaxpr is None:
            trees: list[Any] = []

            def linearized(*a: Any) -> tuple[list, list]:
                out, pullback = jax.vjp(layer, *a)
                out_leaves, out_tree = jax.tree.flatten(out)
                leaves, treedef = jax.tree.flatten(pullback)
                trees[:] = [out_tree, treedef]
                return out_leaves, leaves

            closed = jax.make_jaxpr(linearized)(*args)
            self.out_tree, self.treedef = trees
            self.num_out = self.out_tree.num_leaves
            self.jaxpr = closed
            self.num_h = len(jax.tree.leaves(args[0]))
            self.saved = _activation_dependent(closed.jaxpr, self.num_h)[self.num_out:]
            self.signature = _signature(args)
        return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v, keep in zip(
            self.jaxpr.jaxpr.outvars[self.num_out:], self.saved) if keep]

    def forward(self, layer: Callable, args: tuple) -> tuple[Any, list[jax.Array]]:
        """Runs the layer; returns its output and the residuals that must be saved."""
        self.saved_shapes(layer, args)
        if _signature(args) == self.signature:
            flat = jax.core.eval_jaxpr(self.jaxpr.jaxpr, self.jaxpr.consts,
                                       *jax.tree.leaves(args))
            out = jax.tree.unflatten(self.out_tree, flat[:self.num_out])
            leaves = flat[self.num_out:]
        else:  # arguments of other types than traced (e.g. weak types): linearize these
            out, pullback = jax.vjp(layer, *args)
            leaves, treedef = jax.tree.flatten(pullback)
            if treedef != self.treedef or len(leaves) != len(self.saved):
                raise RuntimeError(
                    "gtp_jax layer loop: the layer's residual structure differs between "
                    "two traces of the same layer; the layer function must be "
                    "deterministic in structure.")
        return out, [x for x, keep in zip(leaves, self.saved) if keep]

    def pullback(self, saved: list[jax.Array], args_but_h: tuple) -> Callable:
        """The layer's vjp function from the saved residuals and the re-gathered weights.

        `args_but_h` are the layer's arguments after the activations (weights, per-layer
        parameters, constants); the recomputed residuals never read the activations.
        """
        flat = [None] * self.num_h + jax.tree.leaves(args_but_h)
        missing = [i for i, keep in enumerate(self.saved) if not keep]
        recomputed = iter(_eval_outputs(self.jaxpr, flat,
                                        [self.num_out + i for i in missing]))
        kept = iter(saved)
        leaves = [next(kept) if keep else next(recomputed) for keep in self.saved]
        return jax.tree.unflatten(self.treedef, leaves)


def _activation_dependent(jaxpr: Any, num_h: int) -> tuple[bool, ...]:
    """Per output of `jaxpr`: True if it depends on one of the first `num_h` inputs, or on an
    equation with effects (which must not run twice); such residuals are saved."""
    tainted = set(jaxpr.invars[:num_h])
    for eqn in jaxpr.eqns:
        if eqn.effects or any(not isinstance(v, Literal) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    return tuple(not isinstance(v, Literal) and v in tainted for v in jaxpr.outvars)


def _eval_outputs(closed: Any, args: list[Any], index: list[int]) -> list[Any]:
    """Evaluates only outputs `index` of a closed jaxpr, running only the equations they
    need (inputs they do not read may be None)."""
    if not index:
        return []
    jaxpr = closed.jaxpr
    outvars = [jaxpr.outvars[i] for i in index]
    needed = {v for v in outvars if not isinstance(v, Literal)}
    live = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            live.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, Literal))
    pruned = jaxpr.replace(eqns=live[::-1], outvars=outvars)
    return jax.core.eval_jaxpr(pruned, closed.consts, *args)


@dataclasses.dataclass(frozen=True, eq=False)
class LoopSpec:
    """Static description of one layer loop (hashed by identity).

    Attributes:
      layer: ``(h, weights, plain, consts) -> h`` with `weights` the gathered weights of one
        layer (list, in `gather_specs` order), `plain` that layer's slices of the
        replicated stacked parameters and `consts` the closure-converted constants.
      gather_specs: one `GatherSpec` per GTP-sharded stacked weight.
      n_layers: length of the stack.
      schedule: one of `SCHEDULES`.
      keep_gathered: the forward pass stacks the gathered weights for the backward pass.
      plain_casts: per replicated stacked parameter, the narrower float dtype the layer
        casts it to where that cast is its only use (`_only_cast`), else None (always None
        with shards); the loop casts those parameters before each layer and keeps their
        gradient stacks in that dtype.
      mid, last: residual splits of the scanned layers and of the peeled last layer.
      unrolled: the unrolled schedule's residual split of each layer (each layer is its own
        trace there), filled as the layers are traced. Layers whose arguments have the same
        structure, shapes and dtypes share the abstract trace of the first such layer (its
        residuals' jaxpr, as the scanned layers share `mid`'s): the layer is traced
        abstractly once, not once per layer.
    """

    layer: Callable
    gather_specs: tuple[GatherSpec, ...]
    n_layers: int
    schedule: str
    keep_gathered: bool = False
    plain_casts: tuple[Any, ...] = ()
    mid: _ResidualSplit = dataclasses.field(default_factory=_ResidualSplit)
    last: _ResidualSplit = dataclasses.field(default_factory=_ResidualSplit)
    unrolled: dict[int, _ResidualSplit] = dataclasses.field(default_factory=dict)
    by_signature: dict[Any, _ResidualSplit] = dataclasses.field(default_factory=dict)

    def split_at(self, i: int, args: tuple | None = None) -> _ResidualSplit:
        """The unrolled schedule's residual split of layer `i`; the forward pass passes the
        layer's arguments (`args`) to choose it, the backward pass finds it by `i`."""
        if args is None or i in self.unrolled:
            return self.unrolled[i]
        # Layers whose arguments have the same types share one split (one trace).
        split = self.by_signature.setdefault(_signature(args), _ResidualSplit())
        self.unrolled[i] = split
        return split

    def gather(self, layer_shards: list[jax.Array]) -> list[jax.Array]:
        # One call per layer: low-precision formats agree on all of a layer's scales with
        # a single all-reduce.
        return all_gather_shards(layer_shards, self.gather_specs)

    def reduce_scatter(self, grads: list[Any]) -> list[jax.Array]:
        # One call per layer: coalescing specs share one reduce-scatter.
        return reduce_scatter_grads([gradient_of(g) for g in grads], self.gather_specs)

    def kept_like(self, keep: bool) -> list[Any] | None:
        """One layer's gathered weights as kept (`kept`), when a forward pass that saves
        residuals (`keep`) also keeps them for the backward pass (else None)."""
        if not (keep and self.keep_gathered):
            return None
        return self.kept(_gathered_like(self.gather_specs))

    def kept(self, weights: list[Any]) -> list[Any]:
        """What the forward pass keeps of one layer's gathered weights: an FP8-gathered
        kernel without its dequantized value (the GEMMs read the payloads; `unkept`
        rebuilds it)."""
        return [without_value(w) for w in weights]

    def unkept(self, weights: list[Any]) -> list[Any]:
        return [with_value(w, s) for w, s in zip(weights, self.gather_specs)]


def layer_loop(layer_fn: Callable[[Any, Any], Any], carry: Any, stacked_params: Any, *,
               remat_policy: Callable[..., bool] | None = None,
               schedule: str = "plain", keep_gathered: bool = False) -> Any:
    """Runs ``carry = layer_fn(carry, params[i])`` over GTP-sharded stacked parameters.

    With `GTPShard` leaves it must run inside ``jax.shard_map`` over a mesh with the shards'
    GTP axis (without any, e.g. the unrolled schedule of an unsharded model, anywhere).

    Args:
      layer_fn: ``(carry, layer_params) -> carry``.
      carry: initial carry (a pytree of arrays, e.g. activations ``[batch, seq, d]``).
      stacked_params: pytree with a leading layer dim ``L``; `GTPShard` leaves (local
        shards ``[L, *spec.shard_shape]``) are gathered one layer at a time, other leaves
        (replicated stacked parameters) are sliced per layer.
      remat_policy: optional ``jax.checkpoint`` policy applied to each layer.
      schedule: one of `SCHEDULES` (see the module docstring).
      keep_gathered: keep every layer's gathered weights from the forward pass (stacked,
        ``[L, *logical_shape]`` in the compute dtype: the whole model's weights) and use
        them in the backward pass, which then gathers nothing: one all-gather per weight
        less, for that memory.

    Returns:
      The final carry. Gradients flow to the shards (reduce-scattered, ``spec.param_dtype``),
      the replicated parameters, the carry and anything `layer_fn` closes over.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"layer_loop: schedule={schedule!r}; choose one of {SCHEDULES}.")
    leaves, treedef = jax.tree.flatten(stacked_params, is_leaf=is_shard)
    shard_pos = [i for i, x in enumerate(leaves) if is_shard(x)]
    plain_pos = [i for i, x in enumerate(leaves) if not is_shard(x)]
    specs = tuple(leaves[i].spec for i in shard_pos)
    shards = [leaves[i].shard for i in shard_pos]
    plain = [leaves[i] for i in plain_pos]
    fn = layer_fn if remat_policy is None else jax.checkpoint(layer_fn, policy=remat_policy)

    def apply(h: Any, weights: list[jax.Array], plain_i: list[jax.Array]) -> Any:
        merged: list[Any] = [None] * len(leaves)
        for pos, w in zip(shard_pos, weights):
            merged[pos] = w
        for pos, p in zip(plain_pos, plain_i):
            merged[pos] = p
        return fn(h, jax.tree.unflatten(treedef, merged))

    converted, consts = jax.closure_convert(apply, carry, _gathered_like(specs),
                                            _layer_like(plain))
    layer = functools.partial(_call_converted, converted, ())
    casts: tuple[Any, ...] = (None,) * len(plain)
    if plain and not shards:
        casts = _plain_casts(layer, carry, _layer_like(plain), list(consts))
        if any(c is not None for c in casts):
            # The loop hands such parameters over cast (`_cast`); the layer's program, traced
            # for the parameters' own dtypes, gets them widened back, exactly, and its own
            # cast narrows them again (XLA folds the pair). The widening's transpose narrows
            # the gradient back to the dtype the layer computed it in.
            layer = functools.partial(_call_converted, converted,
                                      tuple(x.dtype for x in plain))
    spec = LoopSpec(layer=layer, gather_specs=specs,
                    n_layers=(shards or plain)[0].shape[0], schedule=schedule,
                    keep_gathered=bool(keep_gathered and specs), plain_casts=casts)
    return _loop(spec, carry, shards, plain, list(consts))


def _call_converted(converted: Callable, widen: tuple[Any, ...], h: Any, w: list, p: list,
                    c: list) -> Any:
    """``converted(h, w, p, *c)``, with ``p[k]`` first cast to ``widen[k]`` (no entry: as
    it is)."""
    return converted(h, w, [x.astype(widen[k]) if k < len(widen) else x
                            for k, x in enumerate(p)], *c)


#: Primitives that call a jaxpr with their own operands as its inputs, one for one: a
#: parameter's uses are followed into them (`_only_cast`).
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "remat2",
                    "checkpoint"})


def _plain_casts(layer: Callable, h: Any, plain_like: list, consts: list) -> tuple[Any, ...]:
    """Per replicated stacked parameter of `layer` (``(h, weights, plain, consts) -> h``,
    no weights), the narrower float dtype it is cast to where one such cast is its only use
    in the layer (`_only_cast`), else None. Read from the layer's jaxpr, never run with
    other dtypes than those it was traced for (`_call_converted` widens them back)."""
    closed = jax.make_jaxpr(layer)(h, [], plain_like, consts)
    first = len(jax.tree.leaves(h))
    invars = closed.jaxpr.invars[first:first + len(plain_like)]
    return tuple(_only_cast(closed.jaxpr, v) for v in invars)


def _only_cast(jaxpr: Any, var: Any) -> Any:
    """The float dtype narrower than `var`'s that `var` (an input of `jaxpr`) is cast to,
    where that one cast is its only use (followed into calls and checkpoints); else None.

    Such a parameter can be cast before the layer runs, with the same values: the layer's
    own cast then does nothing, and its gradient comes out in the narrower dtype, which
    widens exactly (the layer's backward pass computed it there and widened it). With two
    uses the widened gradients would be summed in the wider dtype, so one use only."""
    casts: list[Any] = []

    def only_casts(jaxpr: Any, var: Any) -> bool:
        if any(v is var for v in jaxpr.outvars):
            return False
        for eqn in jaxpr.eqns:
            for k, x in enumerate(eqn.invars):
                if x is not var:
                    continue
                name = eqn.primitive.name
                if name == "convert_element_type" and _narrower(eqn.outvars[0].aval.dtype,
                                                                var.aval.dtype):
                    casts.append(eqn.outvars[0].aval.dtype)
                    continue
                inner = eqn.params.get("jaxpr")
                inner = getattr(inner, "jaxpr", inner)
                if (name not in _CALLS or inner is None
                        or len(inner.invars) != len(eqn.invars)
                        or not only_casts(inner, inner.invars[k])):
                    return False
        return True

    if isinstance(var, Literal) or not only_casts(jaxpr, var) or len(casts) != 1:
        return None
    return casts[0]


def _narrower(dtype: Any, than: Any) -> bool:
    """Whether `dtype` is a float with fewer bits than the float `than`."""
    return bool(jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(than, jnp.floating)
                and jnp.finfo(dtype).bits < jnp.finfo(than).bits)


def _cast(values: list[jax.Array], dtypes: tuple[Any, ...]) -> list[jax.Array]:
    """`values`, each cast to its dtype in `dtypes` (None: as it is)."""
    return [v if d is None else v.astype(d) for v, d in zip(values, dtypes, strict=True)]


def _plain_at(spec: LoopSpec, plain: list[jax.Array], i: Any) -> list[jax.Array]:
    """Layer `i`'s slices of the replicated stacks, as the layer gets them (`_cast`)."""
    return _cast(_at(plain, i), spec.plain_casts)


def _plain_like(spec: LoopSpec, plain: list[jax.Array]) -> list[jax.ShapeDtypeStruct]:
    """One layer's slice of each replicated stack as the layer gets it, the dtype of its
    gradient stack (`_cast`)."""
    return [x if d is None else jax.ShapeDtypeStruct(x.shape, d)
            for x, d in zip(_layer_like(plain), spec.plain_casts, strict=True)]


def _widened(grads: list[jax.Array], plain: list[jax.Array]) -> list[jax.Array]:
    """Gradient stacks in their parameters' dtypes (exact: they were only narrowed where
    the layer computed them narrower)."""
    return [g.astype(p.dtype) for g, p in zip(grads, plain)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loop(spec: LoopSpec, h: Any, shards: list, plain: list, consts: list) -> Any:
    return _FORWARD[spec.schedule](spec, h, shards, plain, consts, keep=False)[0]


def _loop_fwd(spec: LoopSpec, h: Any, shards: list, plain: list, consts: list):
    out, residuals = _FORWARD[spec.schedule](spec, h, shards, plain, consts, keep=True)
    # The loop chooses its own residuals; an enclosing remat (`gtp_jax.shard`'s checkpoint
    # that re-gathers unstacked weights) must not choose again. Differentiated under it,
    # this rule is inlined and partially evaluated with the enclosing policy, and a scan is
    # split into a saving scan plus a staged copy that rebuilds every output: the residual
    # stacks, carried through the scan, would each be saved once per layer ([L, L, ...]:
    # memory quadratic in depth) and refused weights re-gathered. Behind the barrier the
    # staged copy has no user and is dropped; the barrier's outputs are saved as they are.
    out, residuals = jax.lax.optimization_barrier((out, residuals))
    return out, (residuals, shards, plain, consts)


def _loop_bwd(spec: LoopSpec, saved: tuple, ct: Any):
    return _BACKWARD[spec.schedule](spec, saved, ct)


_loop.defvjp(_loop_fwd, _loop_bwd)


# --------------------------------------------------------------------------- helpers
# Every per-layer access is a dynamic index into the *whole* stacked array, which the loop
# reads in place. Slicing a stack first (``s[1:]``) or concatenating per-layer results
# afterwards makes XLA materialize a copy of every stacked shard, residual and gradient.


def _at(arrays: Sequence[jax.Array], i: Any) -> list[jax.Array]:
    return [jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for a in arrays]


def _tree_at(tree: Any, i: Any) -> Any:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _put(buffers: list[jax.Array], values: list[jax.Array], i: Any) -> list[jax.Array]:
    return [jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), i, 0)
            for b, v in zip(buffers, values)]


def _stacks_after(token: Any, n: int, like: Any) -> tuple[Any, Any]:
    """(`token`, stacks ``[n, *x.shape]`` for every leaf of `like`) where the stacks are
    allocated no earlier than `token` exists; use the returned `token` from then on (an
    operand of a barrier that is read again elsewhere is copied first).

    The loop writes every slot of these stacks (the backward pass's gradients), so what
    matters is not their first value (zeros) but when they are allocated: a buffer made
    from nothing can be scheduled anywhere, and XLA's GPU scheduler allocated the gradient
    stacks before the forward pass, holding every layer's float32 gradient through it (8
    llama3-8b layers on one GPU, 2048 tokens: a 31.3 GiB peak instead of 25.3). Made from a
    zero that passes an optimization barrier beside `token`, they wait for it.
    """
    zero, token = jax.lax.optimization_barrier((jnp.zeros((), jnp.float32), token))
    return token, jax.tree.map(
        lambda x: jnp.broadcast_to(zero.astype(x.dtype), (n, *x.shape)), like)


def _put_new(buffers: list[Any], values: list[jax.Array], i: int, n: int,
             like: list[jax.ShapeDtypeStruct]) -> list[jax.Array]:
    """`_put`, where None buffers are first made, ``[n, *x.shape]`` for each slot `like`,
    once `values` exist (`_stacks_after`)."""
    if buffers and buffers[0] is None:
        values, buffers = _stacks_after(values, n, like)
    return _put(buffers, values, i)


def _unfilled(n: int, like: Any) -> Any:
    """Stacks ``[n, *x.shape]`` for every leaf of `like` whose every slot the loop writes.

    ``lax.empty`` is uninitialized memory on GPU; ``lax.scan``'s own stacked outputs (and
    ``jnp.zeros``) are filled with zeros first, a full extra write of every residual and
    gradient stack per step.
    """
    return jax.tree.map(lambda x: jax.lax.empty((n, *x.shape), x.dtype), like)


def _scan_stacked(body: Callable, carry: Any, n: int, ys_like: Any, *,
                  reverse: bool = False, xs: Any = None, after: bool = False) -> tuple:
    """``lax.scan(body, carry, jnp.arange(n), reverse=reverse)`` whose per-iteration outputs
    (shaped like `ys_like`, cast to its dtypes) go into `_unfilled` stacks: slot ``i`` holds
    iteration ``i``'s output. With `xs` (stacks of length `n`), ``body(carry, i, xs[i])``:
    the scan slices them as its inputs, which XLA reads in place where a dynamic index
    into a closed-over stack is copied out first. With `after`, the stacks are allocated
    no earlier than `carry` exists (`_stacks_after`)."""
    def step(c: Any, ix: Any) -> tuple:
        i, x = ix
        c, bufs = c
        c, ys = body(c, i) if xs is None else body(c, i, x)
        bufs = jax.tree.map(
            lambda b, y: jax.lax.dynamic_update_index_in_dim(b, y.astype(b.dtype), i, 0),
            bufs, ys)
        return (c, bufs), None

    if after:
        carry, bufs = _stacks_after(carry, n, ys_like)
    else:
        bufs = _unfilled(n, ys_like)
    (carry, bufs), _ = jax.lax.scan(step, (carry, bufs), (jnp.arange(n), xs),
                                    reverse=reverse)
    return carry, bufs


def _saved_like(spec: LoopSpec, split: _ResidualSplit, h: Any, plain: list, consts: list,
                keep: bool) -> list[jax.ShapeDtypeStruct] | None:
    """Shapes of one layer's saved residuals (None when the pass saves none)."""
    if not keep:
        return None
    return split.saved_shapes(spec.layer, (h, _gathered_like(spec.gather_specs),
                                           _plain_like(spec, plain), consts))


def _gathered_like(specs: Sequence[GatherSpec]) -> list[Any]:
    """One layer's gathered weights: logical shape, compute dtype (FP8-gathered kernels:
    `Fp8GatheredWeight`s of such leaves)."""
    return [gathered_like(s) if s.fp8_in_dims else
            jax.ShapeDtypeStruct(s.logical_shape, s.compute_dtype) for s in specs]


def _layer_like(stacks: list[jax.Array]) -> list[jax.ShapeDtypeStruct]:
    """One layer's slice of each stack (a weak-typed stack's slices are weak-typed: the
    layer's trace, and so its residuals, depend on it)."""
    return [jax.ShapeDtypeStruct(x.shape[1:], x.dtype,
                                 weak_type=getattr(jax.typeof(x), "weak_type", False))
            for x in stacks]


def _signature(args: tuple) -> Any:
    """Structure, shapes, dtypes and weak types of `args`: what the trace of a layer depends
    on besides the layer function itself."""
    leaves, treedef = jax.tree.flatten(args)
    avals = [jax.typeof(x) for x in leaves]
    return treedef, tuple((a.shape, a.dtype, getattr(a, "weak_type", False)) for a in avals)


def _run_layer(spec: LoopSpec, split: _ResidualSplit | None, h: Any, w: list, p: list,
               consts: list) -> tuple[Any, list | None]:
    if split is None:
        return spec.layer(h, w, p, consts), None
    return split.forward(spec.layer, (h, w, p, consts))


def _layer_vjp(split: _ResidualSplit, saved: list, w: list, p: list, consts: list,
               dh: Any, float_consts: list[bool]) -> tuple[Any, list, list, list]:
    dh, dw, dp, dc = split.pullback(saved, (w, p, consts))(dh)
    return dh, dw, dp, [d if f else None for d, f in zip(dc, float_consts)]


def _is_float(consts: list) -> list[bool]:
    return [jnp.issubdtype(c.dtype, jnp.inexact) for c in consts]


def _zero_cts(consts: list, float_consts: list[bool]) -> list:
    """Zero accumulators for the float constants' cotangents (None for the others)."""
    return [jnp.zeros(c.shape, c.dtype) if f else None for c, f in zip(consts, float_consts)]


def _add(acc: list, new: list) -> list:
    return [a if n is None else a + n for a, n in zip(acc, new)]


def _const_cts(dconsts: list[Any], consts: list[jax.Array]) -> list[Any]:
    return [d if d is not None else np.zeros(c.shape, jax.dtypes.float0)
            for d, c in zip(dconsts, consts)]


# --------------------------------------------------------------------------- plain


def _plain_forward(spec, h, shards, plain, consts, keep):
    kept = spec.kept_like(keep)

    def body(h_, i):
        w = spec.gather(_at(shards, i))
        h_, res = _run_layer(spec, spec.mid if keep else None, h_, w, _plain_at(spec, plain, i),
                             consts)
        return h_, (res, None if kept is None else spec.kept(w))

    # residuals: (stacked saved residuals, stacked kept weights or None)
    return _scan_stacked(body, h, spec.n_layers,
                         (_saved_like(spec, spec.mid, h, plain, consts, keep), kept))


def _plain_backward(spec, saved, ct):
    (stacked_res, stacked_w), shards, plain, consts = saved
    float_consts = _is_float(consts)
    zero = _zero_cts(consts, float_consts)

    def body(c, i, xs):
        dh, dconsts = c
        res_i, w_i = xs
        w = spec.gather(_at(shards, i)) if w_i is None else spec.unkept(w_i)
        dh, dw, dp, dc = _layer_vjp(spec.mid, res_i, w, _plain_at(spec, plain, i), consts,
                                    dh, float_consts)
        return (dh, _add(dconsts, dc)), (spec.reduce_scatter(dw), dp)

    (dh, dconsts), (shard_grads, plain_grads) = _scan_stacked(
        body, (ct, zero), spec.n_layers, (_layer_like(shards), _plain_like(spec, plain)),
        reverse=True, xs=(stacked_res, stacked_w), after=True)
    return dh, shard_grads, _widened(plain_grads, plain), _const_cts(dconsts, consts)


# --------------------------------------------------------------------------- prefetch


def _prefetch_forward(spec, h, shards, plain, consts, keep):
    last = spec.n_layers - 1
    kept = spec.kept_like(keep)
    w = spec.gather(_at(shards, 0))
    stacked_res = stacked_w = None
    if last > 0:
        def body(c, i):
            h_, w_cur = c
            w_next = spec.gather(_at(shards, i + 1))  # independent of this layer's compute
            h_, res = _run_layer(spec, spec.mid if keep else None, h_, w_cur,
                                 _plain_at(spec, plain, i), consts)
            return (h_, w_next), (res, None if kept is None else spec.kept(w_cur))

        (h, w), (stacked_res, stacked_w) = _scan_stacked(
            body, (h, w), last, (_saved_like(spec, spec.mid, h, plain, consts, keep), kept))
    h, last_res = _run_layer(spec, spec.last if keep else None, h, w,
                             _plain_at(spec, plain, last), consts)
    return h, (stacked_res, last_res, stacked_w, None if kept is None else spec.kept(w))


def _prefetch_backward(spec, saved, ct):
    (stacked_res, last_res, stacked_w, last_w), shards, plain, consts = saved
    float_consts = _is_float(consts)
    last = spec.n_layers - 1

    def weights(i: Any) -> list[jax.Array]:
        """Layer i's weights (i < last): kept from the forward pass, or gathered again."""
        if stacked_w is None:
            return spec.gather(_at(shards, i))
        return spec.unkept(_tree_at(stacked_w, i))

    # Gradients are written into full-size stacked buffers as they arrive (in place in the
    # loop carry) instead of being concatenated at the end, allocated when the backward
    # pass starts (`_stacks_after`).
    ct, (shard_buf, plain_buf) = _stacks_after(
        ct, spec.n_layers, (_layer_like(shards), _plain_like(spec, plain)))

    w = spec.gather(_at(shards, last)) if last_w is None else spec.unkept(last_w)
    w_prev = weights(last - 1) if last > 0 else None
    dh, pending, dp_last, dc = _layer_vjp(spec.last, last_res, w,
                                          _plain_at(spec, plain, last), consts, ct,
                                          float_consts)
    plain_buf = _put(plain_buf, dp_last, last)
    dconsts = [d if d is not None else jnp.zeros(c.shape, c.dtype) if f else None
               for d, c, f in zip(dc, consts, float_consts)]
    if last == 0:
        shard_buf = _put(shard_buf, spec.reduce_scatter(pending), 0)
        return dh, shard_buf, _widened(plain_buf, plain), _const_cts(dconsts, consts)

    if last > 1:
        def body(c, i):
            dh_, w_cur, pending_, dconsts_, sbuf, pbuf = c
            w_next = weights(i - 1)  # prefetch layer i - 1
            sbuf = _put(sbuf, spec.reduce_scatter(pending_), i + 1)  # beside layer i
            dh_, dw, dp, dc_ = _layer_vjp(spec.mid, _tree_at(stacked_res, i), w_cur,
                                          _plain_at(spec, plain, i), consts, dh_,
                                          float_consts)
            pbuf = _put(pbuf, dp, i)
            return (dh_, w_next, dw, _add(dconsts_, dc_), sbuf, pbuf), None

        carry = (dh, w_prev, pending, dconsts, shard_buf, plain_buf)
        (dh, w_prev, pending, dconsts, shard_buf, plain_buf), _ = jax.lax.scan(
            body, carry, jnp.arange(1, last), reverse=True)
    shard_buf = _put(shard_buf, spec.reduce_scatter(pending), 1)
    dh, dw0, dp0, dc = _layer_vjp(spec.mid, _tree_at(stacked_res, 0), w_prev,
                                  _plain_at(spec, plain, 0), consts, dh, float_consts)
    dconsts = _add(dconsts, dc)
    shard_buf = _put(shard_buf, spec.reduce_scatter(dw0), 0)
    plain_buf = _put(plain_buf, dp0, 0)
    return dh, shard_buf, _widened(plain_buf, plain), _const_cts(dconsts, consts)


# --------------------------------------------------------------------------- unrolled


def _static_at(arrays: Sequence[jax.Array], i: int) -> list[jax.Array]:
    return [jax.lax.index_in_dim(a, i, keepdims=False) for a in arrays]


def _tied(spec: LoopSpec, x: Any, y: Any) -> tuple[Any, Any]:
    """`x` and `y` unchanged, but neither available before both are computed: a collective
    issued on (a slice of) the returned `y` cannot be scheduled before `x` exists. No
    barrier where the loop communicates nothing (no shards, or a GTP axis of size 1).

    Tie whole buffers (the stacked shards, a collective's output), never a slice: the
    barrier passes its operands through in place, but a slice would first be copied out."""
    if not jax.tree.leaves(y) or not any(s.axis_size > 1 for s in spec.gather_specs):
        return x, y
    return jax.lax.optimization_barrier((x, y))


def _tied_plain(x: Any, plain: list[jax.Array]) -> tuple[Any, list[jax.Array]]:
    """`x` and the stacked replicated parameters `plain` unchanged, but a slice of the
    returned `plain` is a new value, cut no earlier than `x` exists (whole buffers pass the
    barrier in place)."""
    if not plain:
        return x, plain
    return jax.lax.optimization_barrier((x, plain))


def _unrolled_forward(spec, h, shards, plain, consts, keep):
    kept = spec.kept_like(keep) is not None
    res, ws = [], []
    w = spec.gather(_static_at(shards, 0))
    for i in range(spec.n_layers):
        w_next = None
        if i + 1 < spec.n_layers:
            # Layer i + 1's gather waits for layer i's input, so it runs beside layer i and
            # no earlier (left alone, XLA may issue it anywhere before its use).
            h, shards = _tied(spec, h, shards)
            w_next = spec.gather(_static_at(shards, i + 1))
        p_i = _cast(_static_at(plain, i), spec.plain_casts)
        h, r = _run_layer(spec, spec.split_at(i, (h, w, p_i, consts)) if keep else None, h, w,
                          p_i, consts)
        res.append(r)
        ws.append(spec.kept(w) if kept else None)
        w = w_next
    # residuals: (per-layer saved residuals, per-layer kept weights or None)
    return h, (res, ws)


class _LayerGrads:
    """Where the unrolled backward pass keeps each layer's gradients of one kind of stacked
    input (the GTP shards, or the replicated per-layer parameters) until the loop returns
    their stacks ``[n, ...]``.

    ``by_layer``: each layer's gradients stay in buffers of their own and are stacked at the
    end. Else each goes into its slot of a full-size stack, allocated when the first
    layer's gradients exist (`_stacks_after`), as the scanned schedules do. A slot-by-slot
    stack is allocated whole at the backward pass's start, beside every saved activation;
    per-layer buffers grow as the activations are freed. The trainer's llama3-8b step
    compiled for 2 GPUs (its optimizer reads the stacks whole; XLA's GPU compiler reads
    the layers' buffers through the concatenation and allocates no stack): peak 58.1 ->
    53.8 GiB at 2048 tokens per GPU. But a stack summed over a data axis after the loop
    (the gradient all-reduce at the ``shard_map`` boundary: the replicated per-layer
    parameters', and the shards' when `GatherSpec.data_axes` does not sum them in the
    loop) is first made whole: there the slots are cheaper (`_gradients_by_layer`).
    """

    def __init__(self, n: int, like: list[jax.ShapeDtypeStruct], dtypes: list[Any],
                 tie: Callable[[Any, Any], tuple[Any, Any]], by_layer: bool) -> None:
        self.n, self.like, self.dtypes, self.tie, self.by_layer = n, like, dtypes, tie, by_layer
        self.layers: list[list[jax.Array] | None] = [None] * n
        self.stacks: list[Any] = [None] * len(like)

    def put(self, dh: Any, i: int, values: list[jax.Array]) -> Any:
        """Keeps layer `i`'s `values`, written before anything that waits for the returned
        `dh` (else a scheduler may write every layer's slot, or keep every layer's
        reduce-scattered gradient, until the backward pass ends: a second copy)."""
        if self.by_layer:
            dh, values = self.tie(dh, values)
            self.layers[i] = values
            return dh
        self.stacks = _put_new(self.stacks, values, i, self.n, self.like)
        dh, self.stacks = self.tie(dh, self.stacks)
        return dh

    def stacked(self) -> list[jax.Array]:
        """The ``[n, ...]`` stacks, in `dtypes`."""
        if not self.by_layer:
            return [x.astype(d) for x, d in zip(self.stacks, self.dtypes)]
        # Each layer cast before stacking: a layer's slice of the stack is then exactly its
        # buffer (a cast of the whole stack would stand between the two).
        return [jnp.stack([layer[k].astype(dtype) for layer in self.layers])
                for k, dtype in enumerate(self.dtypes)]


def _gradients_by_layer(spec: LoopSpec, shards: bool) -> bool:
    """Whether the unrolled backward pass keeps each layer's gradients of the GTP shards
    (`shards`) or of the replicated per-layer parameters in buffers of their own
    (`_LayerGrads`): unless the mesh the loop is traced on (inside ``shard_map``) has an
    axis of size > 1 that is neither a GTP axis nor tp or ep, a data axis over which the
    weights are replicated, whose gradient sum after the loop reads whole stacks. The
    shards' data axes summed in the loop (`GatherSpec.data_axes`) do not count."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = current_axes()
    own = {s.axis for s in spec.gather_specs} | {axes.tp, axes.ep}
    if shards:
        own |= {a for s in spec.gather_specs for a in s.data_axes}
    return all(size == 1 or name in own
               for name, size in zip(mesh.axis_names, mesh.axis_sizes))


def _unrolled_backward(spec, saved, ct):
    (res, ws), shards, plain, consts = saved
    float_consts = _is_float(consts)
    dconsts = _zero_cts(consts, float_consts)
    n = spec.n_layers
    plain_like = _plain_like(spec, plain)
    # In the dtype the layer computes the gradient in (`_only_cast`), widened at the end.
    shard_grads = _LayerGrads(n, _layer_like(shards), [x.dtype for x in shards],
                              functools.partial(_tied, spec), _gradients_by_layer(spec, True))
    plain_grads = _LayerGrads(n, plain_like, [x.dtype for x in plain_like], _tied_plain,
                              _gradients_by_layer(spec, False))

    def weights(i: int, dh: Any, stack: list) -> tuple[Any, list, list[jax.Array]]:
        """Layer i's weights: kept, or gathered no earlier than `dh` exists."""
        if ws[i] is not None:
            return dh, stack, spec.unkept(ws[i])
        dh, stack = _tied(spec, dh, stack)
        return dh, stack, spec.gather(_static_at(stack, i))

    dh, shards, w = weights(n - 1, ct, shards)
    pending = None  # the previous layer's reduce-scattered gradient, still in flight
    for i in reversed(range(n)):
        w_prev = None
        if i > 0:  # layer i - 1's gather runs beside layer i's backward
            dh, shards, w_prev = weights(i - 1, dh, shards)
        # Layer i's replicated slices, cut no earlier than its gradient input exists: else
        # XLA merges each with the identical slice the forward pass cut and keeps every
        # layer's slice alive from the forward to the backward pass (a copy of the stack).
        dh, plain = _tied_plain(dh, plain)
        dh, dw, dp, dc = _layer_vjp(spec.split_at(i), res[i], w,
                                    _cast(_static_at(plain, i), spec.plain_casts), consts,
                                    dh, float_consts)
        if pending is not None:
            # Layer i + 1's reduce-scatter, issued before layer i's backward, must finish
            # before layer i - 1's starts: it runs beside layer i's, and the full-size
            # gradient it reads is not kept alive until the end of the backward pass.
            dh = shard_grads.put(dh, i + 1, pending)
        pending = spec.reduce_scatter(dw)
        dh = plain_grads.put(dh, i, [d.astype(like.dtype) for d, like in zip(dp, plain_like)])
        dconsts = _add(dconsts, dc)
        w = w_prev
    # The returned `dh` passes the barrier with the last gradients (a barrier's operand that
    # is read again elsewhere is copied first).
    dh = shard_grads.put(dh, 0, pending)
    return (dh, shard_grads.stacked(), _widened(plain_grads.stacked(), plain),
            _const_cts(dconsts, consts))


_FORWARD = {"plain": _plain_forward, "prefetch": _prefetch_forward,
            "unrolled": _unrolled_forward}
_BACKWARD = {"plain": _plain_backward, "prefetch": _prefetch_backward,
             "unrolled": _unrolled_backward}
