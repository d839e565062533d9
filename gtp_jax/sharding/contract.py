"""The call contract of a `gtp_jax.ShardedModule`: how arguments enter ``shard_map``, what
outputs and written state must look like, and how they leave.

- `InputLayout` / `OutputLayout`: a module's optional hooks (``gtp_input_layout``,
  ``gtp_output_layout``) for inputs split over the sequence and outputs that are not
  batch-split.
- `check_outputs`: default-layout outputs must be per-example.
- `side_rules` / `reduce_side_state`: state written in ``__call__`` is combined over the data
  shards by the rule its type implies (`gtp_jax.base.state`) or its ``gtp_reduce`` metadata
  (`gtp_jax.base.metadata.REDUCE`), never taken from one shard and never guessed.
- `check_call_arguments`: arguments a sharded call refuses because every data shard would
  see them differently from the unsharded module (randomness, modules and variables).
- `replaced_read_only` / `same_values` / `refuse_write`: parameters (and RNG keys) written
  in ``__call__`` are refused, never dropped; values NNX's lifted transforms only pass on
  are not writes (for state without a combining rule either: `refuse_unruled`).
- `body_jaxpr` / `has_user_remat`: whether the module's own code has remat regions (then
  weights are gathered where they are read, so the module's policy applies to them).
- `python_attributes` / `refuse_attribute_writes`: a plain attribute set in ``__call__``
  is refused, never lost.
- `refuse_shard_identical_draws`: randomness made in ``__call__`` from a key that is the
  same on every data shard is refused.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jcore

from gtp_jax.base.errors import UsageError
from gtp_jax.base.metadata import REDUCE
from gtp_jax.base.state import RULES, type_rule
from gtp_jax.sharding.collectives import GATHERED_POLICY, regather_policy
from gtp_jax.sharding.plan import path_str
from gtp_jax.sharding.replicated import Replicated

#: Variables written back after a call: everything but parameters and RNG keys (keys are
#: folded per shard inside the call and must not be written back folded).
SIDE_STATE = nnx.Not(nnx.Any(nnx.Param, nnx.RngKey))

#: Variables a sharded call must not write (`refuse_write`): the complement of `SIDE_STATE`.
READ_ONLY = nnx.Any(nnx.Param, nnx.RngKey)

#: Graph nodes and variables of NNX's random number generation (``RngState``: keys and
#: counts).
_RNG_TYPES = (nnx.Rngs, nnx.RngStream, nnx.RngState)


def key_name(key: Any) -> Any:
    """The name of one key of a pytree path (a dict key, attribute name or index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


@dataclasses.dataclass(frozen=True)
class OutputLayout:
    """How a module's outputs leave ``shard_map`` (see `ShardedModule`).

    Attributes:
      specs: ``PartitionSpec`` (or a pytree prefix of them) of the module's outputs, e.g.
        ``(P(("dp", "ep", "gtp"), "tp"), P(("dp", "ep", "gtp")))`` for sequence-parallel
        logits plus a per-example value.
      finalize: applied to the global outputs after ``shard_map`` (e.g. drop sequence
        padding), or None.
      vocab: the mesh axis the module splits its vocabulary over (from
        `gtp_jax.base.axes.vocab_axis`), or None: while it is traced the module sees it as
        ``current_axes().vocab`` and runs its embedding and output head vocabulary-parallel
        (`gtp_jax.parallel.vocab`); `specs` must then put the logits' vocabulary dim on this
        axis and their batch dim on the other data axes.
    """

    specs: Any
    finalize: Callable[[Any], Any] | None = None
    vocab: str | None = None


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """How a module's batch arguments enter ``shard_map`` under context parallelism.

    Returned by the wrapped module's optional hook ``gtp_input_layout(mesh, *args,
    **kwargs) -> InputLayout | None`` (same arguments as ``__call__``). It is the module's
    opt-in to the sequence split: on a mesh with ``cp > 1`` (`gtp_jax.make_mesh`), the batch
    arguments it names are split on dim 1 (the sequence) over ``cp`` as well as on dim 0
    over the data axes, and `gtp_jax.base.axes.current_axes` publishes ``cp`` while the
    module is traced. Without the hook (or when it returns None) nothing is split over
    ``cp``: every ``cp`` rank computes the same thing, as every ``tp`` rank does for a
    module that does not use ``tp``. The hook is not consulted when the mesh has no ``cp``
    axis (or ``cp == 1``).

    A module that splits its inputs must also define ``gtp_output_layout`` (its outputs
    differ between ``cp`` ranks: the default per-example layout would keep one rank's).

    Attributes:
      prepare: applied to the global ``(args, kwargs)`` before ``shard_map``, returning the
        ``(args, kwargs)`` the module is called with (e.g. pad the sequence to a multiple of
        the split and put it in the load-balanced zigzag order, and add a static keyword
        with the real length). None: unchanged.
      split_seq: which (prepared) batch arguments of rank >= 2 are split on dim 1: True
        (all of them) or a tuple of argument names as errors spell them (``"args[0]"``,
        ``"kwargs['mask']"``). Dim 1 of each must be a multiple of ``cp``.
    """

    prepare: Callable[[tuple, dict], tuple[tuple, dict]] | None = None
    split_seq: bool | tuple[str, ...] = True

    def splits(self, name: str, ndim: int) -> bool:
        """Whether the batch argument called `name` of rank `ndim` is split over ``cp``."""
        if ndim < 2:
            return False
        return self.split_seq if isinstance(self.split_seq, bool) else name in self.split_seq


_REDUCE_RULES = tuple(RULES)


def arg_name(keys: tuple) -> str:
    """``args[1]`` / ``kwargs['mask']`` from a path into ``(args, kwargs)``."""
    head, rest = keys[0], keys[1:]
    return ("args" if getattr(head, "idx", 0) == 0 else "kwargs") + jax.tree_util.keystr(rest)


def is_key_array(x: Any) -> bool:
    """Whether `x` is a typed PRNG key array (``jax.random.key``, not a raw ``uint32`` key)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_raw_key(x: Any) -> bool:
    """Whether `x` has the shape and dtype of one raw ``uint32`` PRNG key of the default
    implementation (``jax.random.PRNGKey(0)``: ``uint32[2]`` for threefry)."""
    if getattr(x, "dtype", None) != jnp.uint32 or jnp.ndim(x) != 1:
        return False
    return tuple(jnp.shape(x)) == _raw_key_shape()


@functools.cache
def _raw_key_shape() -> tuple[int, ...]:
    return tuple(jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape)


def _is_node(x: Any) -> bool:
    return isinstance(x, (nnx.Variable, Replicated)) or nnx.graph.is_graph_node(x)


_RNG_FIX = ("hold the nnx.Rngs in the module instead (e.g. nnx.Dropout(rate, rngs=rngs), "
            "whose keys are folded per data shard), or pass one key per example, "
            "jax.random.split(key, batch), as a batch argument")


def check_call_arguments(args: tuple, kwargs: dict) -> None:
    """Refuses an argument whose use inside the sharded call would silently differ from the
    unsharded module's (raised before anything is traced or changed).

    - randomness handed to the call: an ``nnx.Rngs``, an ``nnx.RngStream``, RNG state, or a
      typed PRNG key array that every shard receives whole (a scalar key, or one wrapped in
      `replicated`): every data shard would draw the same random bits from it (the same
      dropout mask on every shard), and a draw shaped by the shard's batch differs from the
      unsharded module's. A key array with one key per example is a batch like any other.
    - a module or variable: its arrays would be split over the batch like arguments and what
      the call writes to it would be lost; a shared weight belongs in the sharded module.

    - a raw ``uint32`` key (``jax.random.PRNGKey``: one key, ``uint32[2]``) would be split
      over the data shards as a batch: refused, naming a typed key or `replicated`.
    """
    with_path = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=_is_node)[0]
    for keys, x in with_path:
        name = arg_name(keys)
        inner = x.value if isinstance(x, Replicated) else x
        if isinstance(inner, _RNG_TYPES):
            raise UsageError(
                f"{name}: an nnx.{type(inner).__name__} passed to a sharded module: every data "
                "shard would draw the same random bits from it (the same dropout mask on "
                f"each shard), unlike the unsharded module; {_RNG_FIX}.")
        if isinstance(inner, nnx.Variable) or nnx.graph.is_graph_node(inner):
            raise UsageError(
                f"{name}: a {type(inner).__name__} (an NNX module or variable) passed to a "
                "sharded module: its arrays would be split over the batch like arguments, "
                "and what the call writes to it would be lost; make it part of the sharded "
                "module (shard the module that holds every use of it), or pass its value as "
                "gtp_jax.replicated(x).")
        if not isinstance(x, Replicated) and is_raw_key(inner):
            raise UsageError(
                f"{name}: a uint32 array of shape {tuple(jnp.shape(inner))}, a raw PRNG key "
                "(jax.random.PRNGKey), passed to a sharded module, which would split it over "
                "the data shards as a batch; use a typed key, one per example "
                "(jax.random.split(jax.random.key(seed), batch)), or, if it is not a key, "
                "pass it as gtp_jax.replicated(x).")
        if is_key_array(inner) and (isinstance(x, Replicated) or jnp.ndim(inner) == 0):
            how = "gtp_jax.replicated" if isinstance(x, Replicated) else "a scalar"
            raise UsageError(
                f"{name}: a PRNG key passed to a sharded module as {how} reaches every data "
                "shard whole, so every shard would draw the same random bits (the same "
                f"dropout mask on each shard), unlike the unsharded module; {_RNG_FIX}.")


def _same_leaves(value: Any, old: Any) -> bool:
    """Whether `value` holds the very arrays of `old` (a pytree value, e.g. a layer stack's
    `GTPShard`, is rebuilt by an ``nnx.split`` / ``nnx.merge`` in the module's own code)."""
    if value is old:
        return True
    new_leaves, new_tree = jax.tree.flatten(value)
    old_leaves, old_tree = jax.tree.flatten(old)
    return new_tree == old_tree and all(a is b for a, b in zip(new_leaves, old_leaves))


def replaced_read_only(module: nnx.Module, before: dict[str, Any]) -> list[str]:
    """Paths of the parameters and RNG keys whose value the call replaced (inside the body).

    A replaced value is not necessarily a write: NNX's lifted transforms (``nnx.remat``,
    ``nnx.scan``, ``nnx.jit``...) hand every variable back as a new traced value, equal to
    the old one. `same_values` tells them apart.
    """
    out = []
    for keys, var in nnx.to_flat_state(nnx.state(module, READ_ONLY)):
        path = path_str(key_name(k) for k in keys)
        if path in before and not _same_leaves(var.get_value(), before[path]):
            out.append(path)
    return out


def refuse_write(path: str, var: nnx.Variable) -> None:
    """Raises the `UsageError` for a parameter or RNG key written in ``__call__``.

    A sharded module's parameters are stored 1/N and gathered on use: a value written in
    ``__call__`` has one version per data shard and would never reach the stored shards
    (before, the write was dropped: a counter kept as an ``nnx.Param`` read 0). RNG keys are
    folded per shard for the call and are not written back either.
    """
    kind = type(var).__name__
    if isinstance(var, nnx.RngKey):
        raise UsageError(
            f"{path!r}: an {kind} was written in __call__; a sharded module folds its RNG keys "
            "per data shard for the call and does not write them back. Reseed outside the "
            "call (e.g. nnx.reseed on the sharded module).")
    raise UsageError(
        f"{path!r}: {'an' if kind[:1] in 'AEIOU' else 'a'} {kind} was written in __call__; a "
        "sharded module's parameters are stored 1/N over the mesh and only read in the call "
        "(a write would be lost). Keep state the call updates in a variable that says how "
        f"the data shards combine ({rule_choices('nnx.Variable')}), and change parameters "
        "outside the call (e.g. with the optimizer).")


# --------------------------------------------------------------------------- value identity


def _call_jaxpr(eqn: Any) -> Any:
    """The jaxpr of a call-like equation (``jit``, ``remat``, ``shard_map``, custom
    derivatives...), whose inputs and outputs are the equation's one to one; None for
    others."""
    subs = [v for v in eqn.params.values() if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))]
    if len(subs) != 1:
        return None
    sub = subs[0].jaxpr if isinstance(subs[0], jcore.ClosedJaxpr) else subs[0]
    if len(sub.invars) != len(eqn.invars) or len(sub.outvars) != len(eqn.outvars):
        return None
    return sub


class _Origins:
    """Where each value of a jaxpr comes from, looking through the equations that only pass
    a value on: an output of a call-like equation, ``scan``, ``while`` or ``cond`` that is
    one of its inputs unchanged is that input."""

    def __init__(self, jaxpr: Any):
        self.invars = {v: i for i, v in enumerate(jaxpr.invars)}
        self.producer = {v: (eqn, i) for eqn in jaxpr.eqns for i, v in enumerate(eqn.outvars)}

    def of(self, var: Any) -> Any:
        """A token equal for two values exactly when they are the same value."""
        while True:
            if isinstance(var, jcore.Literal):
                return ("literal", id(var))
            if var in self.invars:
                return ("in", self.invars[var])
            if var not in self.producer:
                return ("var", id(var))
            eqn, i = self.producer[var]
            passed = _passed_input(eqn, i)
            if not isinstance(passed, int):
                return passed
            var = eqn.invars[passed]


def _passed_input(eqn: Any, i: int) -> Any:
    """The index of the input that output `i` of `eqn` is, unchanged; else a token for the
    output (`_Origins.of`)."""
    name = eqn.primitive.name
    own = ("out", id(eqn), i)
    counts = scan_counts(eqn.params) if name == "scan" else None
    if name == "scan" and counts is None:
        return own
    if name == "scan":
        body = eqn.params["jaxpr"].jaxpr
        consts, carry = counts
        got = _Origins(body).of(body.outvars[i])
        if i < carry:  # a carry that every iteration passes on is its initial value
            return consts + i if got == ("in", consts + i) else own
        # a stacked output that is a stacked input, row for row
        ok = got[0] == "in" and got[1] >= consts + carry
        return got[1] if ok else own
    if name == "while":
        body = eqn.params["body_jaxpr"].jaxpr
        cond_n, body_n = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        got = _Origins(body).of(body.outvars[i])
        return cond_n + body_n + i if got == ("in", body_n + i) else own
    if name == "cond":
        # every branch passes on the same operand (the first input is the branch index)
        found = {_Origins(b.jaxpr).of(b.jaxpr.outvars[i]) for b in eqn.params["branches"]}
        got = found.pop() if len(found) == 1 else None
        return 1 + got[1] if got is not None and got[0] == "in" else own
    sub = _call_jaxpr(eqn)
    if sub is None:
        return own
    got = _Origins(sub).of(sub.outvars[i])
    return got[1] if got[0] == "in" else ("call", id(eqn), got)


def same_values(jaxpr: Any, pairs: list[tuple[int, int]]) -> list[bool]:
    """For each ``(a, b)`` of output indices of `jaxpr`: whether both outputs are the same
    value, passed on unchanged by every equation between them and where it was made
    (`_Origins`)."""
    origins = _Origins(jaxpr)
    return [origins.of(jaxpr.outvars[a]) == origins.of(jaxpr.outvars[b]) for a, b in pairs]


def check_outputs(out: Any, local_batch: int | None) -> None:
    """Outputs of the default layout are concatenated over the data shards: per-example only."""
    if local_batch is None:
        return
    for keys, x in jax.tree_util.tree_flatten_with_path(out)[0]:
        shape = tuple(jnp.shape(x))
        if not shape:
            raise UsageError(
                "A gtp_jax-sharded module must return arrays with a leading batch "
                f"dimension, got an output{jax.tree_util.keystr(keys)} of shape {shape}. Return "
                "per-example values and reduce them (e.g. jnp.mean) outside the module.")
        if shape[0] != local_batch:
            raise UsageError(
                f"Output{jax.tree_util.keystr(keys) or ''} has shape {shape} but each data shard "
                f"holds {local_batch} examples: outputs are concatenated over the data shards, "
                "so each must be per-example (leading dim = batch). Return per-example values "
                "and reduce outside the module, or define gtp_output_layout on the module.")


def side_rules(paths: list[str], variables: list[nnx.Variable]) -> dict[str, str | None]:
    """The reduction rule of each non-parameter variable (None: refused if written).

    The rule is the ``gtp_reduce`` metadata or the one the variable's type implies
    (`gtp_jax.base.state.type_rule`); nothing is guessed from the dtype.
    """
    rules = {}
    for path, var in zip(paths, variables):
        if isinstance(var, (nnx.Param, nnx.RngKey)):
            continue
        rule = var.get_metadata().get(REDUCE)
        if rule is not None and rule not in _REDUCE_RULES:
            raise UsageError(
                f"{path!r}: metadata {REDUCE}={rule!r} is not one of {_REDUCE_RULES}.")
        implied = type_rule(var)
        if rule is not None and implied is not None and rule != implied \
                and not isinstance(var, nnx.RngCount):
            raise UsageError(
                f"{path!r}: a {type(var).__name__} is combined by {implied!r}, but its metadata "
                f"says {REDUCE}={rule!r}; drop the metadata or use a variable type that "
                "matches it.")
        rules[path] = rule if rule is not None else implied
    return rules


def rule_choices(kind: str) -> str:
    """The ways to declare how state is combined, for an error about a `kind` variable."""
    return ("declare what it holds with a gtp_jax variable type: BatchMean (mean over the "
            "data shards), BatchSum (counts, sums: old value + every shard's change), "
            "SameOnEveryShard (identical on every shard), PerExample (rows concatenated); "
            f"or metadata, e.g. {kind}(value, {REDUCE}='sum') with one of {_REDUCE_RULES}")


def refuse_unruled(path: str, var: nnx.Variable) -> None:
    """Raises the `UsageError` for state without a combining rule written in ``__call__``
    (and for batch statistics, whatever their rule)."""
    kind = type(var).__name__
    if isinstance(var, nnx.BatchStat):
        raise UsageError(
            f"{path!r}: batch statistics ({kind}, e.g. BatchNorm in training mode) are "
            "written in __call__: each data shard would normalize with its own examples' "
            "statistics, unlike the unsharded module; call the module in inference mode "
            "(BatchNorm(use_running_average=True), or model.eval()), which reads them only, "
            "or use a normalization without batch statistics (LayerNorm, RMSNorm).")
    dtypes = sorted({str(jnp.result_type(x)) for x in jax.tree.leaves(var.get_value())})
    raise UsageError(
        f"{path!r}: {kind} state of dtype {'/'.join(dtypes)} is written in __call__ and each "
        "data shard computes its own value, which gtp_jax does not guess how to combine; "
        f"{rule_choices(kind)}.")


def reduce_side_state(module: nnx.Module, before: dict[str, Any], rules: dict[str, str | None],
                       local_batch: int | None, axes: tuple[str, ...],
                       seq_split: bool = False, split_rows: frozenset[str] = frozenset(),
                       unruled: list[str] | None = None) -> list:
    """``[(keys, variable, combined value)]`` of the state the call wrote (inside the body).

    Rules (one value for the whole mesh, never one shard's): existing variables follow
    `side_rules` (``mean``: mean over the data shards; ``sum``: the old value plus the sum
    of every shard's change; ``same``: identical on every shard, kept as is; ``concat``:
    per-example rows concatenated over the shards); written variables without a rule are
    refused (raised while tracing, before any state changes), or, with `unruled`, appended
    to it and left out (their value may only have been passed on by an NNX lifted transform:
    the caller decides, `same_values`). ``concat`` variables named in
    `split_rows` entered the call split on dim 0 like a batch (`per_example_specs`). New
    variables
    (``sow``) must be per-example (leading dim = local batch) and are concatenated over the
    data shards like outputs.
    """
    out = []
    for keys, var in nnx.to_flat_state(nnx.state(module, SIDE_STATE)):
        path = path_str(key_name(k) for k in keys)
        value = var.get_value()
        old = before.get(path)
        if path in before and value is old:
            continue  # not written
        kind = type(var).__name__
        if isinstance(var, nnx.Intermediate) or path not in before:
            kept = {id(x) for x in jax.tree.leaves(old)}

            def concat(x, path=path, kind=kind, kept=kept):
                if id(x) in kept:
                    return x
                if seq_split:
                    raise UsageError(
                        f"{path!r}: a {kind} value was stored in __call__ while the inputs are "
                        "split over the sequence (cp); each cp rank holds a different piece, "
                        "which a per-example value cannot represent. Return it as an output "
                        "(with gtp_output_layout) instead.")
                if local_batch is None or jnp.ndim(x) < 1 or jnp.shape(x)[0] != local_batch:
                    raise UsageError(
                        f"{path!r}: a {kind} value of shape {jnp.shape(x)} was stored in "
                        "__call__; a sharded module can only keep per-example values (leading "
                        f"dim = the {local_batch} examples of a data shard), which are "
                        "concatenated over the shards. Sow per-example values, or return the "
                        "value as an output.")
                return jax.lax.all_gather(x, axes, axis=0, tiled=True) if axes else x

            out.append((keys, var, jax.tree.map(concat, value)))
            continue
        # Batch statistics were computed over one shard's examples: no rule combines them.
        rule = None if isinstance(var, nnx.BatchStat) else rules.get(path)
        if rule is None:
            if unruled is None:
                refuse_unruled(path, var)
            unruled.append(path)  # refused by the caller unless it is only passed on
            continue
        if rule == "mean":  # checked on one device too: the same code must run on many
            for x in jax.tree.leaves(value):
                if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
                    raise UsageError(
                        f"{path!r}: {REDUCE}='mean' (BatchMean) needs floating state, got "
                        f"{jnp.result_type(x)}; use 'sum' (BatchSum) or 'same' "
                        "(SameOnEveryShard).")
        if rule == "concat":
            value = _concat_rows(path, kind, value, None if path in split_rows else old,
                                 local_batch, axes, seq_split)
        elif not axes:
            pass  # one data shard: its value is the value
        elif rule == "mean":
            value = jax.tree.map(lambda x: jax.lax.pmean(x, axes), value)
        elif rule == "sum":
            value = jax.tree.map(lambda x, o: o + jax.lax.psum(x - o, axes), value, old)
        out.append((keys, var, value))
    return out


def _concat_rows(path: str, kind: str, value: Any, old: Any, local_batch: int | None,
                 axes: tuple[str, ...], seq_split: bool) -> Any:
    """A ``concat`` (`PerExample`) variable's rows from every data shard, in batch order."""
    def concat(x, o):
        if x is o:
            return x
        if seq_split:
            raise UsageError(
                f"{path!r}: a per-example {kind} was written in __call__ while the inputs are "
                "split over the sequence (cp); each cp rank holds a different piece of each "
                "example. Return it as an output (with gtp_output_layout) instead.")
        if local_batch is None or jnp.ndim(x) < 1 or jnp.shape(x)[0] != local_batch:
            raise UsageError(
                f"{path!r}: a per-example {kind} ({REDUCE}='concat') was written with shape "
                f"{jnp.shape(x)}, but each data shard holds {local_batch} examples; write "
                "one row per example of the call (leading dim = the shard's batch).")
        return jax.lax.all_gather(x, axes, axis=0, tiled=True) if axes else x

    leaves, tree = jax.tree.flatten(value)
    olds = jax.tree.leaves(old) if old is not None else []
    if len(olds) != len(leaves):  # entered split (or restructured): every leaf is rows
        olds = [None] * len(leaves)
    return jax.tree.unflatten(tree, [concat(x, o) for x, o in zip(leaves, olds)])


def per_example_rows(paths: list[str], values: list, rules: dict[str, str | None],
                     batch: int | None) -> frozenset[str]:
    """The ``concat`` (`PerExample`) variables whose leading dim is the call's batch: they
    enter the call split on dim 0 over the data axes, like the batch arguments, so the
    module reads and writes its own examples' rows."""
    if batch is None:
        return frozenset()
    return frozenset(
        p for p, x in zip(paths, values)
        if rules.get(p) == "concat" and all(
            jnp.ndim(leaf) >= 1 and jnp.shape(leaf)[0] == batch for leaf in jax.tree.leaves(x)))


def _own_policy(policy: Any) -> bool:
    """Whether a remat `policy` is gtp_jax's: a gather's, or the body's (`GATHERED_POLICY`)."""
    return policy is regather_policy or getattr(policy, GATHERED_POLICY, False)


# Name of the ``jax.checkpoint`` primitive across JAX versions.
_REMAT_NAMES = ("checkpoint", "remat", "remat2")


def body_jaxpr(program: Any) -> Any:
    """The jaxpr of the sharded call's body as each device runs it, from the jaxpr of the
    whole call (`program`: its ``shard_map``, or on one device the body itself): its inputs
    are the leaves of the body's ``(values, args)``."""
    found = [e for e in program.jaxpr.eqns if e.primitive.name == "shard_map"]
    inner = list(jcore.jaxprs_in_params(found[0].params)) if len(found) == 1 else []
    # (Were the body not found, the outer program holds it, with the same inputs one to
    # one: both checks read it there.)
    return inner[0] if len(inner) == 1 else program.jaxpr


def has_user_remat(jaxpr: Any) -> bool:
    """Whether the module's own code (not gtp_jax's gathers, nor the checkpoint of the
    gathered weights around the body) uses ``jax.checkpoint``, in the body's jaxpr
    (`body_jaxpr`)."""

    def walk(j) -> bool:
        for eqn in j.eqns:
            if eqn.primitive.name in _REMAT_NAMES and not _own_policy(eqn.params.get("policy")):
                return True
            if eqn.primitive.name.startswith("custom_"):
                continue  # opaque to an outer checkpoint's policy (e.g. gtp_jax.scan_layers)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                if walk(sub):
                    return True
        return False

    return walk(jaxpr)


# --------------------------------------------------------------------------- attributes


def python_attributes(module: nnx.Module) -> dict[tuple[str, str], Any]:
    """``{(node path, name): value}`` of the plain attributes of every module (graph node)
    in `module`: what is neither a variable nor a graph node (ints, strings, lists, arrays
    held as plain attributes); lists, dicts and sets are copied so that a change in place
    shows."""
    out = {}
    for keys, node in nnx.graph.iter_graph(module):
        if isinstance(node, nnx.Variable) or not nnx.graph.is_graph_node(node):
            continue
        where = path_str(key_name(k) for k in keys)
        for name, value in vars(node).items():
            if str(name).startswith("_pytree__") or isinstance(value, nnx.Variable) or \
                    nnx.graph.is_graph_node(value):
                continue
            out[(where, str(name))] = (type(value)(value) if isinstance(value, (list, dict, set))
                                       else value)
    return out


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, (jax.Array, np.ndarray)) or isinstance(b, (jax.Array, np.ndarray)):
        return False  # a new array, traced or not
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are different values
        return False


def refuse_attribute_writes(before: dict[tuple[str, str], Any],
                            after: dict[tuple[str, str], Any]) -> None:
    """Refuses a plain Python attribute set or changed in ``__call__`` (`python_attributes`
    before and after the traced call): the sharded call runs a copy of the module, so the
    change would be lost, and a value computed from the call's shapes or values would be one
    data shard's, so carrying it back could be wrong too."""
    for key in sorted(set(before) | set(after)):
        if key in before and key in after and _same(before[key], after[key]):
            continue
        where, name = key
        path = f"{where}/{name}" if where else name
        value = after.get(key)
        what = ("deleted" if key not in after else "set to an array"
                if isinstance(value, (jax.Array, np.ndarray)) else f"set to {value!r:.40}")
        raise UsageError(
            f"{path!r}: a plain Python attribute {what} in __call__ of a sharded module; the "
            "call runs a copy of the module on each data shard's examples, so the change "
            "would be lost (and a value computed in the call is one shard's). Keep state the "
            "call updates in a variable that says how the shards combine "
            f"({rule_choices('nnx.Variable')}), or change the attribute outside the call.")


# --------------------------------------------------------------------------- randomness

#: Primitives that turn a key into random bits (typed keys; raw threefry keys).
_DRAWS = ("random_bits", "threefry2x32")


def _axis_names(names: Any) -> tuple:
    return tuple(names) if isinstance(names, (tuple, list)) else (names,)


def shard_identical_draws(jaxpr: Any, varying: list[bool], axes: frozenset[str]) -> list[Any]:
    """The random draws of `jaxpr` (a ``shard_map`` body) whose key is the same on every
    data shard: computed from no input in `varying` (the inputs split over the data axes)
    and no ``axis_index`` over `axes`, e.g. ``jax.random.key(seed)`` from a constant or a
    Python int. Each shard then draws the same bits. Looks inside nested jaxprs (``jit``,
    ``remat``, custom derivatives, ``scan``, ``while``, ``cond``)."""
    found: list[Any] = []
    _varying_outputs(jaxpr, list(varying), axes, found)
    return found


def _varying_outputs(jaxpr: Any, varying: list[bool], axes: frozenset[str],
                     found: list[Any]) -> list[bool]:
    """Whether each output of `jaxpr` can differ between data shards, given its inputs';
    appends the draws from shard-identical keys to `found`."""
    env = dict(zip(jaxpr.invars, varying))

    def read(v: Any) -> bool:
        return False if isinstance(v, jcore.Literal) else env.get(v, False)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _DRAWS and ins and not ins[0]:
            found.append(eqn)
        if name == "axis_index":
            outs = [bool(set(_axis_names(eqn.params["axis_name"])) & axes)] * len(eqn.outvars)
        else:
            outs = _nested_outputs(eqn, ins, axes, found)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _fixpoint(body: Any, head: list[bool], carry: list[bool], tail: list[bool],
              axes: frozenset[str]) -> list[bool]:
    """The carry of a loop whose body maps ``head + carry + tail`` to ``carry + ...``: varying
    once any iteration can make it vary."""
    for _ in range(len(carry) + 1):
        outs = _varying_outputs(body, head + carry + tail, axes, [])
        new = [a or b for a, b in zip(carry, outs[:len(carry)])]
        if new == carry:
            break
        carry = new
    return carry


def scan_counts(params: dict) -> tuple[int, int] | None:
    """(consts, carry) input counts of a ``scan`` equation: ``num_consts`` / ``num_carry``
    up to jax 0.10; from jax 0.11 the flat trees ``ft_in`` (consts, carry, xs). None when
    neither reads (a newer form)."""
    if "num_consts" in params and "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    try:
        consts, carry, _ = params["ft_in"].unpack()
        return len(list(consts.vals)), len(list(carry.vals))
    except (KeyError, AttributeError, TypeError, ValueError):
        return None


def _nested_outputs(eqn: Any, ins: list[bool], axes: frozenset[str],
                    found: list[Any]) -> list[bool]:
    name, n_out, any_in = eqn.primitive.name, len(eqn.outvars), any(ins)
    params = eqn.params
    counts = scan_counts(params) if name == "scan" else None
    if name == "scan" and counts is None:
        # An unknown form: every input may reach every carry (a draw inside is only
        # reported where nothing that varies reaches the loop).
        ins = [any_in] * len(ins)
        counts = (0, 0)
    if name == "scan":
        body = params["jaxpr"].jaxpr
        c, k = counts
        carry = _fixpoint(body, ins[:c], ins[c:c + k], ins[c + k:], axes)
        return _varying_outputs(body, ins[:c] + carry + ins[c + k:], axes, found)
    if name == "while":
        cond, body = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        carry = _fixpoint(body, ins[cn:cn + bn], ins[cn + bn:], [], axes)
        if _varying_outputs(cond, ins[:cn] + carry, axes, found)[0]:
            carry = [True] * len(carry)  # a shard-dependent trip count
        _varying_outputs(body, ins[cn:cn + bn] + carry, axes, found)
        return carry
    if name == "cond":
        outs = [False] * n_out
        for branch in params["branches"]:
            got = _varying_outputs(branch.jaxpr, ins[1:], axes, found)
            outs = [a or b for a, b in zip(outs, got)]
        return [True] * n_out if ins[0] else outs
    subs = list(jcore.jaxprs_in_params(params))
    if not subs:
        return [any_in] * n_out
    outs = [any_in] * n_out
    for sub in subs:
        if len(sub.invars) == len(ins):  # call-like: inputs one to one
            got = _varying_outputs(sub, ins, axes, found)
            if len(subs) == 1 and len(got) == n_out:
                outs = got
        else:
            _varying_outputs(sub, [any_in] * len(sub.invars), axes, found)
    return outs


def refuse_shard_identical_draws(jaxpr: Any, varying: list[bool], axes: frozenset[str]
                                 ) -> None:
    """Raises the `UsageError` for randomness made inside ``__call__`` from a key that is
    the same on every data shard (`shard_identical_draws`)."""
    draws = shard_identical_draws(jaxpr, varying, axes)
    if not draws:
        return
    shape = tuple(getattr(draws[0].outvars[0].aval, "shape", ()))
    raise UsageError(
        f"random bits of shape {shape} are drawn in __call__ of a sharded module from a key "
        "that is the same on every data shard (built from a constant or a Python int, e.g. "
        "jax.random.key(seed)): every shard would draw the same bits (the same dropout mask "
        f"on each shard), unlike the unsharded module; {_RNG_FIX}; a draw that does not "
        "depend on the batch belongs in __init__ (a variable).")
