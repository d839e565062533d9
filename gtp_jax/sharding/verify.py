"""`check_sharded`: one forward and backward pass of a sharded module against the unsharded
module, on the caller's own batch, naming the first output, written state or gradient that
differs beyond what the arithmetic's precision explains.

`gtp_jax.shard` refuses what it can see (arguments, written parameters and state, shared
weights), but not what the module computes: an operation across examples in the forward
pass (``h - h.mean(0)``, a softmax over the batch, a batch-wide top-k) runs on each data
shard's examples alone and gives another answer without any error. This check is the net
for that class: opt in, once, on a real batch.

Tolerance. Each leaf is compared by its largest difference relative to the unsharded leaf's
largest magnitude (``max|sharded - unsharded| / max|unsharded|``), which rounding cannot
inflate where values cancel. The sharded pass differs from the unsharded one by the order
of its sums (per-shard partial sums, the gradients' reduce-scatter) and by the rounding of
what it gathers. Every floating dtype a value of either pass has bounds the difference by a
number of its ``finfo(dtype).eps``: 64 for 32-bit floats (many reordered roundings, each
tiny), 8 for 16-bit floats (one rounding of a weight or an output dominates), 1 for 8- and
4-bit elements. The dtypes are read from the two programs (the parameters', the compute
dtype, ``GTPConfig.gather_dtype``, ``reduce_dtype``) and from the config (the elements of
``gather_format`` and of FP8 compute); float32 matmuls add their own precision (TF32 on
GPUs, bounded like a 16-bit float, unless ``jax_default_matmul_precision`` asks for
float32; bfloat16 passes on TPUs). The tolerance is the largest bound. A float32 module on
CPU: 64 x 2^-23 = 7.6e-6; with bfloat16 gathers or compute: 8 x 2^-7 = 0.0625; fp8 gathers:
0.125; nvfp4 gathers: 0.5, as large as many mistakes. The class of mistake this check finds
does not depend on the precision, so a module sharded in float32 gives the sharpest test.
Integer and boolean leaves must be equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.sharding.contract import is_key_array, key_name
from gtp_jax.sharding.module import ShardedModule, unshard, unshard_values
from gtp_jax.sharding.plan import path_str
from gtp_jax.sharding.replicated import Replicated, is_replicated
from gtp_jax.sharding.sharing import check_untied

#: Tolerance, in units of ``finfo(dtype).eps``, of a value that went through `dtype`, by its
#: width in bits (see the module docstring). Measured on 8 simulated CPU devices (dp2 x
#: gtp4; the README's MLP, the tiny decoder, convolutions): float32 differs by at most 5.6
#: eps (many reordered sums), bfloat16 gathers or compute by 1.7 eps (the rounding of the
#: gathered weight or of an output), fp8 / mxfp8 / nvfp4 gathers by 0.36 eps of their
#: elements; the MLP with ``h - h.mean(0)`` differs by 0.38 to 0.98 relative in every one
#: of those settings.
_ULPS = ((32, 64.0), (16, 8.0), (0, 1.0))
#: TF32 (10 mantissa bits), what float32 matmuls run in on GPUs by default: a rounding of
#: the inputs, bounded like a 16-bit value.
TF32_BOUND = 8.0 * 2.0 ** -10
#: The elements of each `GTPConfig.gather_format`.
_FORMAT_ELEMENTS = {"fp8": jnp.float8_e4m3fn, "mxfp8": jnp.float8_e4m3fn,
                    "nvfp4": jnp.float4_e2m1fn}

@dataclasses.dataclass(frozen=True)
class LeafCheck:
    """One compared leaf.

    Attributes:
      kind: ``"output"``, ``"state"`` (a variable written in ``__call__``) or
        ``"gradient"`` (of a parameter).
      path: the leaf's path: ``output[0]``, ``output.logits``, ``blocks/mlp/up/kernel``.
      dtype: the unsharded leaf's dtype.
      error: ``max|sharded - unsharded| / max|unsharded|`` (float leaves; ``inf`` where
        shapes or NaN positions differ), or the largest absolute difference (integer and
        boolean leaves).
      tolerance: the largest `error` accepted.
    """

    kind: str
    path: str
    dtype: str
    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    def __str__(self) -> str:
        return (f"{self.kind} {self.path!r} ({self.dtype}): error {self.error:.3g}, "
                f"tolerance {self.tolerance:.3g}")


@dataclasses.dataclass(frozen=True)
class ShardCheck:
    """What `check_sharded` compared, in order: outputs, written state, gradients.

    Attributes:
      leaves: one `LeafCheck` per compared leaf.
      holds_rngs: whether the module holds ``nnx.Rngs`` streams (their draws differ from
        the unsharded module's by design: keys are folded per data shard).
    """

    leaves: tuple[LeafCheck, ...]
    holds_rngs: bool = False

    @property
    def ok(self) -> bool:
        """Every leaf within its tolerance."""
        return all(leaf.ok for leaf in self.leaves)

    @property
    def first(self) -> LeafCheck | None:
        """The first leaf beyond its tolerance (None when `ok`)."""
        return next((leaf for leaf in self.leaves if not leaf.ok), None)

    def message(self) -> str:
        """One line: what differs and the likely causes, or a summary when `ok`."""
        first = self.first
        if first is None:
            worst = max(self.leaves, key=lambda x: x.error / x.tolerance if x.tolerance
                        else x.error, default=None)
            return (f"check_sharded: {len(self.leaves)} leaves (outputs, written state, "
                    "gradients) match the unsharded module's" + (
                        f" (closest to its tolerance: {worst})" if worst is not None else "")
                    + ".")
        causes = []
        if self.holds_rngs:
            causes.append("the module draws random numbers from nnx.Rngs it holds, whose keys "
                          "a sharded call folds per data shard (check with randomness off, "
                          "e.g. model.eval())")
        if first.kind == "state":
            causes.append("the variable's type or gtp_reduce metadata does not say how the "
                          "data shards' values combine (e.g. SameOnEveryShard for a value "
                          "each shard computes from its own examples)")
        causes.append("an operation across examples in __call__ (e.g. h - h.mean(0), a "
                      "softmax or top-k over the batch), which each data shard computes over "
                      "its own examples: move it out of the module (onto its outputs) or "
                      "make it per example")
        return (f"check_sharded: {first.kind} {first.path!r} ({first.dtype}) of the sharded "
                f"module differs from the unsharded module's by {first.error:.3g} (relative "
                f"to its largest value; tolerance {first.tolerance:.3g}); likely "
                f"{'; or '.join(causes)}.")

    def __str__(self) -> str:
        return self.message()


def check_sharded(model: ShardedModule, *args: Any,
                  loss_fn: Callable[[Any], jax.Array] | None = None,
                  rtol: float | None = None, raise_on_mismatch: bool = True,
                  **kwargs: Any) -> ShardCheck:
    """Runs ``model(*args, **kwargs)`` forward and backward, sharded and unsharded
    (`gtp_jax.unshard`), and compares every output, written state and parameter gradient.

    The safety net for what `gtp_jax.shard` cannot refuse by looking: an operation across
    examples in ``__call__`` (``h - h.mean(0)``), which each data shard computes over its
    own examples. Use the batch you train on (global arrays, placed or not, with
    `gtp_jax.replicated` where the call needs it). Neither module is changed: both passes
    run on copies, so written state, RNG counts and parameters stay as they were.

    Args:
      model: a `gtp_jax.ShardedModule`.
      *args: the call's positional arguments.
      loss_fn: ``loss_fn(outputs) -> scalar`` the gradients are taken of (e.g.
        ``lambda out: jnp.mean((out - y) ** 2)``); default: a fixed random projection of
        every floating output, which weighs every output element.
      rtol: the tolerance of every leaf, instead of the one its dtypes imply (see
        `gtp_jax.sharding.verify`).
      raise_on_mismatch: raise on a leaf beyond its tolerance (default), else return the
        report.
      **kwargs: the call's keyword arguments (those named ``loss_fn``, ``rtol`` and
        ``raise_on_mismatch`` are this function's).

    Returns:
      A `ShardCheck`: every compared leaf with its error and tolerance.

    Raises:
      UsageError: a leaf differs beyond its tolerance (one line naming it and the likely
        causes), with `raise_on_mismatch`; or the call itself is refused (as by the module).
      UsageTypeError: `model` is not a `ShardedModule`, or `loss_fn` is not callable.
    """
    if not isinstance(model, ShardedModule):
        raise UsageTypeError(f"check_sharded: model must be a gtp_jax.ShardedModule (from "
                             f"gtp_jax.shard), got {type(model).__name__}.")
    if loss_fn is not None and not callable(loss_fn):
        raise UsageTypeError(f"check_sharded: loss_fn={loss_fn!r} must be callable "
                             "(loss_fn(outputs) -> scalar) or None.")
    if rtol is not None and not (isinstance(rtol, (int, float)) and rtol >= 0):
        raise UsageError(f"check_sharded: rtol={rtol!r} must be a number >= 0 or None.")
    check_untied(model, "check_sharded")
    sharded = nnx.merge(*nnx.split(model))  # a copy: the passes write to it, not to model
    reference = unshard(model)
    whole = NamedSharding(model.mesh, P())
    ref_args = jax.tree.map(
        lambda x: jax.device_put(x, whole) if isinstance(x, (jax.Array, np.ndarray)) else x,
        jax.tree.map(lambda x: x.value if is_replicated(x) else x, (args, kwargs),
                     is_leaf=is_replicated))
    out, state, grads, dtypes = _forward_backward(sharded, (args, kwargs), loss_fn)
    ref_out, ref_state, ref_grads, ref_dtypes = _forward_backward(reference, ref_args, loss_fn)
    grads = unshard_values(model, grads)
    bound = (_tolerance(dtypes | ref_dtypes | _format_dtypes(model.config)) if rtol is None
             else float(rtol))
    leaves: list[LeafCheck] = []
    got = dict(jax.tree_util.tree_flatten_with_path(out)[0])
    want = jax.tree_util.tree_flatten_with_path(ref_out)[0]
    if jax.tree.structure(out) != jax.tree.structure(ref_out):
        leaves.append(LeafCheck("output", "(structure)", "-", float("inf"), 0.0))
    else:
        for keys, value in want:
            leaves.append(_compare("output", "output" + jax.tree_util.keystr(keys),
                                   got[keys], value, bound))
    got_state = dict(_flat(state))
    for path, value in _flat(ref_state):
        if path in got_state:
            leaves.append(_compare("state", path, got_state[path], value, bound))
    for path, value in _flat(ref_grads):
        leaves.append(_compare("gradient", path, grads.get(path), value, bound))
    holds_rngs = bool(jax.tree.leaves(nnx.state(model, nnx.RngKey)))
    report = ShardCheck(tuple(leaves), holds_rngs=holds_rngs)
    if raise_on_mismatch and not report.ok:
        raise UsageError(report.message())
    return report


def _flat(state: Any) -> list[tuple[str, Any]]:
    """``[(path, value)]`` of an ``nnx.State``, paths relative to a sharded module's
    wrapped module (a leading ``module`` key dropped)."""
    out = []
    for keys, var in nnx.to_flat_state(state):
        keys = tuple(keys)
        if keys[:1] == ("module",):
            keys = keys[1:]
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        for sub, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            out.append((path_str(key_name(k) for k in keys) + jax.tree_util.keystr(sub),
                        leaf))
    return out


def _forward_backward(module: nnx.Module, call: tuple[tuple, dict],
                      loss_fn: Callable[[Any], jax.Array] | None
                      ) -> tuple[Any, nnx.State, nnx.State, set]:
    """(outputs, state other than parameters after the call, parameter gradients, the
    floating dtypes of every value the program computes) of one jitted forward and backward
    pass of `module` on ``call = (args, kwargs)``."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    leaves, tree = jax.tree.flatten(call, is_leaf=lambda x: isinstance(x, Replicated))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))
              or isinstance(x, Replicated)]

    def loss_of(params: nnx.State, rest: nnx.State, dynamic: list) -> tuple[jax.Array, Any]:
        full = list(leaves)
        for i, x in zip(arrays, dynamic):
            full[i] = x
        args, kwargs = jax.tree.unflatten(tree, full)
        # New variables at this trace level: the call writes its state to them.
        m = nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rest))
        out = m(*args, **kwargs)
        loss = _projection(out) if loss_fn is None else loss_fn(out)
        if jnp.ndim(loss) != 0:
            raise UsageError(f"check_sharded: loss_fn returned shape {jnp.shape(loss)}; it "
                             "must return a scalar (e.g. reduce with jnp.mean).")
        return jnp.asarray(loss, jnp.float32), (out, nnx.state(m, nnx.Not(nnx.Param)))

    dynamic = [leaves[i] for i in arrays]
    traced = jax.jit(jax.grad(loss_of, has_aux=True)).trace(params, rest, dynamic)
    grads, (out, state) = traced.lower().compile()(params, rest, dynamic)
    return out, state, grads, _float_dtypes(traced.jaxpr.jaxpr)


def _float_dtypes(jaxpr: Any) -> set:
    """The floating dtypes of the values of `jaxpr` and of the jaxprs inside it."""
    out = set()
    for eqn in jaxpr.eqns:
        for var in (*eqn.invars, *eqn.outvars):
            dtype = getattr(getattr(var, "aval", None), "dtype", None)
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
                out.add(jnp.dtype(dtype))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out |= _float_dtypes(sub)
    return out


def _projection(out: Any) -> jax.Array:
    """A fixed random projection of every floating output (a loss that weighs every output
    element, with signs no module arranges to cancel)."""
    total = jnp.zeros((), jnp.float32)
    for i, x in enumerate(jax.tree.leaves(out)):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating) or not jnp.size(x):
            continue
        r = jax.random.normal(jax.random.fold_in(jax.random.key(0), i), jnp.shape(x))
        total = total + jnp.sum(x.astype(jnp.float32) * r) / jnp.size(x)
    return total


def _bound(dtype: Any) -> float:
    """`_ULPS` units of `dtype`'s spacing at 1 (``finfo(dtype).eps``)."""
    info = jnp.finfo(dtype)
    ulps = next(u for bits, u in _ULPS if info.bits >= bits)
    return ulps * float(info.eps)


def _format_dtypes(config: Any) -> set:
    """The element dtypes of ``config``'s gather format and FP8 compute (a packed format's
    elements are not a dtype of the program: nvfp4 moves e2m1 pairs as uint8)."""
    out = set()
    if config.gather_format is not None:
        out.add(jnp.dtype(_FORMAT_ELEMENTS[config.gather_format]))
    if config.fp8_compute is not None:
        out |= {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)}
    return out


def _tolerance(dtypes: set) -> float:
    """The tolerance of a pass whose values have `dtypes` (see the module docstring)."""
    return max([_bound(d) for d in dtypes] + [_matmul_bound()])


def _matmul_bound() -> float:
    """The bound for the precision float32 matmuls run in by default on this backend."""
    precision = str(jax.config.jax_default_matmul_precision or "").lower()
    if precision in ("highest", "float32", "fp32"):
        return _bound(jnp.float32)
    backend = jax.default_backend()
    if backend == "gpu" and precision not in ("bfloat16", "bfloat16_3x"):
        return TF32_BOUND
    if backend == "tpu" or precision == "bfloat16":
        return _bound(jnp.bfloat16)
    return _bound(jnp.float32)


def _compare(kind: str, path: str, got: Any, want: Any, tolerance: float) -> LeafCheck:
    if is_key_array(want):  # RNG keys: their bits must be equal
        want = jax.random.key_data(want)
        got = None if got is None or not is_key_array(got) else jax.random.key_data(got)
    want = np.asarray(jax.device_get(want))
    dtype = str(want.dtype)
    if got is None:
        return LeafCheck(kind, path, dtype, float("inf"), tolerance)
    got = np.asarray(jax.device_get(got))
    if got.shape != want.shape:
        return LeafCheck(kind, path, dtype, float("inf"), tolerance)
    if not jnp.issubdtype(want.dtype, jnp.inexact):
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        return LeafCheck(kind, path, dtype, float(diff.max(initial=0.0)), 0.0)
    got, want = got.astype(np.float64), want.astype(np.float64)
    nan = np.isnan(want)
    if not np.array_equal(nan, np.isnan(got)):
        return LeafCheck(kind, path, dtype, float("inf"), tolerance)
    got, want = np.where(nan, 0.0, got), np.where(nan, 0.0, want)
    scale = float(np.max(np.abs(want), initial=0.0))
    diff = float(np.max(np.abs(got - want), initial=0.0))
    if not np.isfinite(diff):  # infinities in different places
        same = np.array_equal(got, want)
        return LeafCheck(kind, path, dtype, 0.0 if same else float("inf"), tolerance)
    error = diff / scale if scale > 0 else diff
    return LeafCheck(kind, path, dtype, error, tolerance)


__all__ = ["LeafCheck", "ShardCheck", "check_sharded"]
