"""One training step, shared by `gtp_jax.train.train` and the benchmarks.

`TrainStep` splits ``(model, optimizer)`` once with ``nnx.split`` and runs a plain
``jax.jit`` function over their state, donated, so a step costs one jit dispatch: ``nnx.jit``
instead walks the NNX object graph on every call, host time that shows as an idle gap
between steps on GPUs.

    step = TrainStep(model, optimizer, functools.partial(lm_loss, aux_weight=cfg.moe_aux_weight))
    for batch in batches:
        metrics = step(batch)          # {"loss", "grad_norm", "lr"}: float32 device scalars
    held_out = step.evaluate(batch)    # the loss of the current state, no update
    step.sync()                        # before reading or saving the model / optimizer

With ``has_aux=True`` the loss function returns ``(loss, aux)``, ``aux`` a dict of metrics
returned beside the step's own (``{"loss", "grad_norm", "lr", **aux}``).

Compiled programs are cached per (graph definition, loss function, its ``has_aux``): a second
`TrainStep` of an equal model and optimizer (a resumed run in the same process, a notebook
re-run) reuses the first one's program.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.base.fp8_history import Fp8History
from gtp_jax.base.metadata import STACKED
from gtp_jax.sharding.fp8_update import (
    check_fp8_uses,
    history_uses,
    layer_prefix,
    next_fp8_history,
)
from gtp_jax.sharding.module import ShardedModule, check_stored_layout, hold_params_in
from gtp_jax.sharding.offload import (
    DEFAULT_GROUP_LAYERS,
    MASTER_DEVICE_DTYPE,
    HostGroups,
    StreamableChain,
    group_moments,
    init_on_host,
    init_streamed_on_host,
    join_groups,
    place_on_host,
    stream_units,
    streamed_update,
    streaming_compiler_options,
    to_device,
    to_host,
    with_master_weights,
)
from gtp_jax.sharding.sharing import check_untied
from gtp_jax.train.step.optim import current_lr, global_norm, narrower_than_float32
from gtp_jax.train.step.padding_check import check_padded_updates
from gtp_jax.train.step.path_check import check_paths

#: The metric under which a delayed-FP8 step returns its layers' use counts (`history_uses`);
#: `TrainStep` removes it from what it returns.
USES_METRIC = "fp8_uses"

#: Programs kept (least recently used ones are dropped; a dropped one recompiles on reuse).
CACHE_SIZE = 16

#: The metrics a step returns itself; a loss function's auxiliary metrics may not reuse them.
STEP_METRICS = ("loss", "grad_norm", "lr", USES_METRIC)

@dataclasses.dataclass
class _Program:
    """A jitted step and how often JAX traced it (a retrace precedes every recompile)."""

    fn: Callable[..., Any] | None = None
    traces: int = 0
    evals: dict[Hashable, Callable[..., Any]] = dataclasses.field(default_factory=dict)


_programs: collections.OrderedDict[Hashable, _Program] = collections.OrderedDict()


class TrainStep:
    """``metrics = step(batch)``: one optimizer step of `model` on `batch`.

    The step owns the state of `model` and `optimizer` from construction on: it updates its
    own copy (`state`) and donates the previous one to each call, so the arrays the objects
    hold are invalid after the first call until `sync` writes the current state back. Set
    the objects' values (initialize, restore a checkpoint) before building the step.

    Arrays not placed on the model's mesh (``optax`` creates its step counters on one
    device) are put replicated on it first (see `replicate_stray_leaves`), so the first call
    sees the shardings of every later one and the step compiles once.

    Args:
      model: the module to train (a `gtp_jax.ShardedModule` or any ``nnx.Module``).
      optimizer: an ``nnx.Optimizer`` of `model`.
      loss_fn: ``loss_fn(model, batch) -> float scalar``; e.g. for the decoder
        ``functools.partial(lm_loss, aux_weight=model_cfg.moe_aux_weight)``. Equal
        functions (the same function, or partials of it with equal arguments) share one
        compiled program. With `has_aux`: ``loss_fn(model, batch) -> (loss, aux)``.
      has_aux: the loss function returns ``(loss, aux)``, ``aux`` a dict of metrics
        (``{"accuracy": ...}``: names other than the step's own ``loss``, ``grad_norm``
        and ``lr``, values arrays of any shape), returned by each step beside the step's
        metrics (with `grad_accum` > 1: their mean over the microbatches, as the loss).
        Computed by the same forward pass as the loss, so they cost nothing more.
      grad_norm: also return the gradients' global norm (one more pass over the
        gradients, unless the optimizer computes it anyway, e.g. to clip).
      offload_group_layers: with ``GTPConfig(offload_optimizer=True)``: the state is
        streamed to the device per unit (`gtp_jax.sharding.offload.streamed_update`):
        each not-stacked weight whole, and G layers of every layer-stacked weight at a
        time; None (default) is `gtp_jax.sharding.offload.DEFAULT_GROUP_LAYERS` (1).
        About four units' moments are in device memory at once. While the step trains,
        the stacked moments are held as one host array per layer group
        (`gtp_jax.sharding.offload.HostGroups`: each copy a DMA transfer); `sync` joins
        them back. Optimizers other than `gtp_jax.sharding.offload.streamable_chain` ones
        are copied to the device whole for the update.
      grad_accum: microbatches per step (`accumulate_grads`): the batch's leading axis is
        cut into `grad_accum` equal microbatches whose gradients are summed in a
        ``lax.scan`` before the one update; the loss is their mean.

    Attributes:
      graphdef: the static structure of ``(model, optimizer)``.
      state: their current state (an ``nnx.State``), replaced by each call; from the first
        call to the next `sync`, an offloaded streamable optimizer state holds its stacked
        moments grouped (`HostGroups`) here.
    """

    def __init__(self, model: nnx.Module, optimizer: nnx.Optimizer,
                 loss_fn: Callable[[nnx.Module, Any], Any], *, grad_norm: bool = True,
                 offload_group_layers: int | None = None, grad_accum: int = 1,
                 has_aux: bool = False):
        if not isinstance(optimizer, nnx.Optimizer):
            raise UsageTypeError(f"TrainStep: optimizer={type(optimizer).__name__} must be an "
                                 "nnx.Optimizer of the model.")
        if not callable(loss_fn):
            raise UsageTypeError(f"TrainStep: loss_fn={loss_fn!r} must be callable "
                                 "(loss_fn(model, batch) -> scalar).")
        if not isinstance(has_aux, bool):
            raise UsageTypeError(f"TrainStep: has_aux={has_aux!r} must be True or False.")
        check_optimizer_of(model, optimizer)
        check_paths(model, optimizer, "TrainStep")
        check_untied(model, "TrainStep")
        _check_master_weights(model, optimizer)
        check_stored_layout(model, "TrainStep")
        check_padded_updates(optimizer.tx, nnx.state(model, optimizer.wrt), "TrainStep")
        offload = offloads_optimizer(model)
        resident: frozenset[tuple[Any, ...]] = frozenset()
        if offload:  # validated before any placement
            stream_units({}, {}, _group_layers(offload_group_layers))
            resident = resident_paths(model, optimizer.wrt)
        self._objects = (model, optimizer)
        self.graphdef, state = nnx.split((model, optimizer))
        state = _replicate_strays(state)
        self.state = map_opt_state(state, place_on_host, keep=resident) if offload else state
        self._program = _program(self.graphdef, loss_fn, bool(grad_norm),
                                 _offload_mode(offload, offload_group_layers),
                                 int(grad_accum), has_aux)
        self._offload = offload
        # An offloaded streamable state trains grouped (one host array per layer group:
        # its copies are DMA transfers); `sync` joins it back into stacked arrays.
        self._groups = (_group_layers(offload_group_layers)
                        if offload and isinstance(optimizer.tx, StreamableChain) else 0)
        self._grouped = False
        self._loss_fn, self._grad_accum, self._has_aux = loss_fn, int(grad_accum), has_aux
        # Delayed FP8: the first call checks that no layer ran twice (`_first_fp8_step`).
        self._check_uses = _has_history(model)

    def __call__(self, batch: Any) -> dict[str, jax.Array]:
        """Runs one step; returns ``{"loss", "grad_norm", "lr"}`` as float32 device scalars:
        the loss before this step's update, the global norm of its gradients before
        clipping (with ``grad_norm=True``), the learning rate of the update; and with
        ``has_aux`` the loss function's metrics.

        ``"lr"`` is there whenever the optimizer's state holds its learning rate: an
        ``optax.inject_hyperparams`` optimizer anywhere in it (`gtp_jax.train.make_optimizer`
        builds one; inside ``optax.chain``, ``MultiSteps``, ``masked``,
        ``multi_transform``: the first one found). A fixed rate given to a plain optimizer
        (``optax.adamw(1e-3)``) is not in its state, and a step of it has no ``"lr"``.

        Does not wait for the device, except on the first call of a model with delayed FP8
        scaling: that one reads the layers' use counts and raises a `UsageError` where a
        layer ran more than once (`gtp_jax.sharding.fp8_update.check_fp8_uses`), leaving the
        model and optimizer as they were.

        Raises:
          UsageError: the loss function returned something else than a floating scalar
            (with `has_aux`: ``(scalar, dict of metrics)`` whose names are not the step's
            own), raised while the step is traced, before anything changes.
        """
        if self._check_uses:
            return self._first_fp8_step(batch)
        self._regroup()
        self.state, metrics = self._program.fn(self.state, batch)
        metrics.pop(USES_METRIC, None)
        return metrics

    def compile(self, batch: Any) -> None:
        """Compiles the step for batches like `batch` (shapes, dtypes, shardings) without
        running it, so that a caller can time the compile apart from the first step: the
        next call with such a batch runs the compiled program (jit keeps it; nothing is
        traced or compiled again). Reads and writes JAX's persistent compilation cache as
        a call would. Nothing is donated or changed.

        The first call of a model with delayed FP8 scaling and an offloaded optimizer state
        still compiles its use-count check (`_uses_program`), a forward and backward pass.

        Raises:
          UsageError: as `__call__` (the loss function is traced here).
        """
        self._regroup()
        self._program.fn.lower(self.state, batch).compile()

    def _first_fp8_step(self, batch: Any) -> dict[str, jax.Array]:
        """`__call__` with the use-count check: the step program returns the input state
        where a layer ran twice (`_refuse_reuse`). An offloaded optimizer state, which the
        step updates in place in host memory, is checked before it instead, by a program
        of the forward and backward passes alone (`_uses_program`): no copy of the state."""
        if self._offload:
            uses = _uses_program(self.graphdef, self._loss_fn, self._grad_accum,
                                 self._has_aux)(self.state, batch)
            check_fp8_uses(jax.device_get(uses))
            self._check_uses = False
            return self(batch)
        state, metrics = self._program.fn(self.state, batch)
        uses = metrics.pop(USES_METRIC)
        try:
            check_fp8_uses(jax.device_get(uses))
        except UsageError:
            # The objects' arrays were donated: give them the (unchanged) values back.
            self.state = state
            self.sync()
            raise
        self.state = state
        self._check_uses = False
        return metrics

    def evaluate(self, batch: Any, loss_fn: Callable[[nnx.Module, Any], Any] | None = None,
                 *, has_aux: bool | None = None) -> Any:
        """The loss of the current state on `batch`, without an update (e.g. a held-out
        loss): a float32 device scalar; ``(loss, aux)`` where the loss function has aux
        metrics, as ``jax.value_and_grad(..., has_aux=True)`` returns them.

        Does not wait for the device; compiled once per (step program, loss function,
        `has_aux`). Groups an offloaded state as a step does (one program for the layout
        the steps train on).

        Args:
          batch: a batch as the step takes it.
          loss_fn: ``loss_fn(model, batch)``; default: the step's own loss function (and
            its ``has_aux``).
          has_aux: `loss_fn` returns ``(loss, aux)``, aux a dict of metrics; default: the
            step's ``has_aux`` for its own loss function, False for another.

        Raises:
          UsageError: the loss function returned something else than a floating scalar
            (with `has_aux`: ``(scalar, dict)``).
        """
        if loss_fn is None:
            loss_fn, has_aux = self._loss_fn, self._has_aux if has_aux is None else has_aux
        elif not callable(loss_fn):
            raise UsageTypeError(f"TrainStep.evaluate: loss_fn={loss_fn!r} must be callable "
                                 "(loss_fn(model, batch) -> scalar) or None.")
        has_aux = bool(has_aux)
        self._regroup()
        key = (_loss_key(loss_fn), has_aux)
        fn = self._program.evals.get(key)
        if fn is None:
            graphdef = self.graphdef
            checked = with_aux(loss_fn, has_aux, "TrainStep.evaluate")

            def evaluate(state: nnx.State, batch: Any) -> Any:
                model, _ = nnx.merge(graphdef, state)
                loss, aux = checked(model, batch)
                return (loss, aux) if has_aux else loss

            fn = self._program.evals[key] = jax.jit(evaluate)
        return fn(self.state, batch)

    @property
    def objects(self) -> tuple[nnx.Module, nnx.Optimizer]:
        """The model and optimizer this step trains (current after `sync`)."""
        return self._objects

    @property
    def traces(self) -> int:
        """How often the shared program was traced (once per compile; tests check it)."""
        return self._program.traces

    def _regroup(self) -> None:
        """Groups an offloaded streamable state (`group_offloaded`) where it is not: before
        the first step (or `evaluate`), and before the first one after a `sync`. From then
        on the model and optimizer objects' offloaded arrays are deleted, as donated ones
        are, until the next `sync`."""
        if self._groups and not self._grouped:
            self.state = group_offloaded(self.graphdef, self.state, self._groups)
            self._grouped = True

    def sync(self) -> None:
        """Writes the current state into the model and optimizer objects (before reading
        them, e.g. saving a checkpoint or counting bytes per device)."""
        if self._grouped:
            self.state = join_offloaded(self.state)
            self._grouped = False
        nnx.update(self._objects, self.state)


def offloads_optimizer(model: nnx.Module) -> bool:
    """Whether `model` is sharded with ``GTPConfig(offload_optimizer=True)``: its training
    step then keeps the optimizer state in host memory (`gtp_jax.sharding.offload`)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "offload_optimizer", False))


def offloads_master_weights(model: nnx.Module) -> bool:
    """Whether `model` is sharded with ``GTPConfig(offload_master_weights=True)``: its
    float32 parameters live in host memory in the optimizer state, and the model holds
    them in bfloat16 (`gtp_jax.sharding.offload.with_master_weights`)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "offload_master_weights", False))


def _check_master_weights(model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    """Refuses a model and optimizer that disagree on master weights: one sharded with
    ``offload_master_weights`` needs the optimizer `make_nnx_optimizer` builds for it (a
    plain ``nnx.Optimizer`` would update the bfloat16 parameters themselves)."""
    tx = getattr(optimizer, "tx", None)
    keeps = isinstance(tx, StreamableChain) and tx.master
    if offloads_master_weights(model) and not keeps:
        raise UsageError(
            "TrainStep: the model is sharded with GTPConfig(offload_master_weights=True) but "
            "its optimizer keeps no master weights; build it with "
            "gtp_jax.train.make_nnx_optimizer(model, tx), tx from gtp_jax.train.make_optimizer.")
    if keeps and not offloads_master_weights(model):
        raise UsageError(
            "TrainStep: the optimizer keeps master weights but the model is not sharded with "
            "GTPConfig(offload_master_weights=True); build both from the same config.")


def resident_paths(model: nnx.Module, wrt: Any = nnx.Param) -> frozenset[tuple[Any, ...]]:
    """Paths (in ``nnx.state(model, wrt)``) of the parameters whose optimizer state stays in
    device memory when it is offloaded: those whose ``/``-joined path (below a
    `gtp_jax.ShardedModule`'s wrapper, as `GTPConfig.include` sees it) matches a
    ``GTPConfig.offload_exclude`` pattern (``re.search``).

    Raises:
      UsageError: a pattern matches no parameter (a typo would offload everything).
    """
    patterns = tuple(getattr(getattr(model, "config", None), "offload_exclude", ()) or ())
    if not patterns:
        return frozenset()
    paths = [tuple(p) for p, _ in nnx.to_flat_state(nnx.state(model, wrt))]

    def name(path: tuple[Any, ...]) -> str:
        inner = path[1:] if isinstance(model, ShardedModule) and path[:1] == ("module",) \
            else path
        return "/".join(str(k) for k in inner)

    for pattern in patterns:
        if not any(re.search(pattern, name(p)) for p in paths):
            raise UsageError(
                f"GTPConfig.offload_exclude pattern {pattern!r} matches no parameter of "
                f"{type(model).__name__}; parameter paths look like {name(paths[0])!r}. "
                "Fix the pattern or drop it.")
    return frozenset(p for p in paths if any(re.search(q, name(p)) for q in patterns))


def _resident_flags(param_state: nnx.State, resident: frozenset[tuple[Any, ...]]) -> Any:
    """Bools with the structure of ``nnx.as_pure(param_state)``: whether each parameter's
    path is in `resident` (`resident_paths`)."""
    flat = nnx.to_flat_state(param_state)
    return nnx.as_pure(nnx.from_flat_state(
        [(p, v.replace(value=tuple(p) in resident)) for p, v in flat]))


def make_nnx_optimizer(model: nnx.Module, tx: optax.GradientTransformation, *,
                       wrt: Any = nnx.Param) -> nnx.Optimizer:
    """``nnx.Optimizer(model, tx, wrt=wrt)``; for a model sharded with
    ``GTPConfig(offload_optimizer=True)`` (`offloads_optimizer`) its state is built directly
    in host memory: for a `gtp_jax.sharding.offload.streamable_chain` (what
    `gtp_jax.train.config.make_optimizer` builds) one unit at a time
    (`gtp_jax.sharding.offload.init_streamed_on_host`: a not-stacked weight's moments, or
    one layer's of the stacked weights, written into host buffers in place), so the device
    never holds more than one unit's moments and building the optimizer does not raise
    the device's peak; other optimizers by one program whose outputs are in host memory
    (`gtp_jax.sharding.offload.init_on_host`: the device may hold the whole state while it
    runs). The step count (a scalar) is replicated on the model's mesh in host memory too.
    Same values, same object (``optimizer.tx is tx``): a `TrainStep` of it shares programs
    with others.

    With ``GTPConfig(offload_master_weights=True)`` (`offloads_master_weights`) the
    optimizer is ``with_master_weights(tx)`` (``optimizer.tx``, the same object for the same
    `tx`): its state holds a float32 copy of every parameter, built in host memory with the
    moments, and then the model's parameters are cast to bfloat16 in place
    (`gtp_jax.sharding.module.hold_params_in`: the model is changed, its float32 values
    live on in the optimizer's state, and its gradients come back in bfloat16, reduced in
    float32).

    Raises:
      UsageError: master weights with a `tx` that is not a `streamable_chain`, or with a
        parameter that is not float32 (nothing to keep a master of).
    """
    if not offloads_optimizer(model):
        return nnx.Optimizer(model, tx, wrt=wrt)
    resident = resident_paths(model, wrt)
    master = offloads_master_weights(model)
    if master:  # validated before anything is built or cast
        if not isinstance(tx, StreamableChain):
            raise UsageError(
                "make_nnx_optimizer: GTPConfig(offload_master_weights=True) streams the master "
                f"weights with the optimizer state, which needs a streamable chain; tx is "
                f"{type(tx).__name__}. Build it with gtp_jax.train.make_optimizer (or "
                "gtp_jax.sharding.offload.streamable_chain(clip, adamw)).")
        for path, var in nnx.to_flat_state(nnx.state(model, wrt)):
            dtype = jnp.dtype(var.get_value().dtype)
            if dtype != jnp.float32:
                raise UsageError(
                    f"make_nnx_optimizer: GTPConfig(offload_master_weights=True) keeps float32 "
                    f"master weights, but parameter {'/'.join(map(str, path))} is {dtype}; use "
                    "float32 parameters (param_dtype) or drop offload_master_weights. With an "
                    "optimizer built for it before (which holds the parameters in "
                    f"{jnp.dtype(MASTER_DEVICE_DTYPE)} for its master weights), keep using that "
                    "optimizer or build the model again.")
        tx = with_master_weights(tx)

    def host_init(state: nnx.State) -> Any:
        # optax sees the same tree nnx.Optimizer would give it (Variables keep their
        # metadata, e.g. the sharding plan); only the values come from the host programs.
        template = jax.eval_shape(tx.init, state)
        keep = _resident_flags(state, resident)
        if isinstance(tx, StreamableChain):
            values = init_streamed_on_host(tx, nnx.as_pure(state), _stacked_flags(state),
                                           resident=keep)
        else:
            values = init_on_host(tx.init, nnx.as_pure(state), keep)
        return jax.tree.structure(template).unflatten(jax.tree.leaves(values))

    optimizer = nnx.Optimizer(model, optax.GradientTransformation(host_init, tx.update),
                              wrt=wrt)
    optimizer.tx = tx
    mesh = next(x.sharding.mesh for x in jax.tree.leaves(nnx.state(model, wrt))
                if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding))
    replicate_stray_leaves(optimizer, mesh)
    nnx.update(optimizer, map_opt_state(nnx.state(optimizer), place_on_host, keep=resident))
    if master:  # the float32 values are in the state now: the device keeps them rounded
        masters = jax.tree.leaves(nnx.as_pure(optimizer.opt_state)[1].master)
        hold_params_in(model, MASTER_DEVICE_DTYPE, wrt, sources=masters)
    return optimizer


def group_offloaded(graphdef: Any, state: nnx.State, group_layers: int) -> nnx.State:
    """`state` of ``(model, optimizer)`` (`graphdef`) with its offloaded optimizer state
    grouped for streaming `group_layers` layers at a time
    (`gtp_jax.sharding.offload.group_moments`: each layer-stacked moment becomes one host
    array per layer group); unchanged where the optimizer is not a streamable chain. Works
    on arrays (outside ``jit``) and on ``jax.ShapeDtypeStruct`` leaves (the abstract state a
    step is lowered with ahead of time)."""
    model, optimizer = nnx.merge(graphdef, state)
    if not isinstance(optimizer.tx, StreamableChain):
        return state
    graph = {"graph": optimizer.graph} if hasattr(optimizer, "graph") else {}
    param_state = nnx.state(model, optimizer.wrt, **graph)
    new = group_moments(
        nnx.as_pure(optimizer.opt_state), nnx.as_pure(param_state),
        _stacked_flags(param_state), group_layers,
        _resident_flags(param_state, resident_paths(model, optimizer.wrt)))
    _set_opt_state(optimizer, new)
    return nnx.state((model, optimizer))


def join_offloaded(state: nnx.State) -> nnx.State:
    """`state` with every grouped optimizer-state leaf (`group_offloaded`) joined back into
    its stacked host array (`gtp_jax.sharding.offload.join_groups`)."""
    return map_opt_state(state, join_groups)


def _set_opt_state(optimizer: nnx.Optimizer, values: Any) -> None:
    """Sets the values of ``optimizer.opt_state``'s variables from `values` (its pure
    tree), where a value may be a `HostGroups` in place of an array."""
    variables = jax.tree.leaves(optimizer.opt_state,
                                is_leaf=lambda x: isinstance(x, nnx.Variable))
    new = jax.tree.leaves(values, is_leaf=lambda x: isinstance(x, HostGroups))
    if len(variables) != len(new):
        raise UsageError(f"the optimizer state has {len(variables)} arrays but the update "
                         f"returned {len(new)}; its structure changed.")
    for var, value in zip(variables, new):
        var.set_value(value)


def map_opt_state(state: nnx.State, fn: Callable[[Any], Any], *,
                  keep: frozenset[tuple[Any, ...]] = frozenset()) -> nnx.State:
    """`state` (of ``(model, optimizer)`` or an optimizer) with ``fn(value)`` in place of
    the value of every ``nnx.OptState`` variable (the optimizer's moments and step), but
    the moments of the parameters whose paths are in `keep` (`resident_paths`: a moment's
    path ends with its parameter's), which are left as they are."""

    def kept(path: tuple[Any, ...]) -> bool:
        return any(len(path) > len(q) and path[-len(q):] == q for q in keep)

    flat = [(path, var.replace(value=fn(var.get_value()))
             if isinstance(var, nnx.OptState) and not kept(tuple(path)) else var)
            for path, var in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def step_program(graphdef: Any, loss_fn: Callable[..., Any], *, grad_norm: bool = True,
                 offload: bool = False,
                 offload_group_layers: int | None = None,
                 grad_accum: int = 1, has_aux: bool = False) -> Callable[..., Any]:
    """The jitted ``step(state, batch) -> (state, metrics)`` that `TrainStep` runs for a
    ``(model, optimizer)`` of `graphdef` (the same cached program): lower it with abstract
    arguments (``jax.ShapeDtypeStruct`` with shardings) to compile a step ahead of time
    without running it (`gtp_jax.plan` reads its memory analysis). With `offload`, give it
    the state as `TrainStep` trains it: grouped by `group_offloaded` (a stacked state
    compiles another program, with partial copies). For a model with delayed-FP8 histories
    its metrics also hold ``USES_METRIC`` (`_refuse_reuse`)."""
    if offload:
        stream_units({}, {}, _group_layers(offload_group_layers))
    return _program(graphdef, loss_fn, grad_norm,
                    _offload_mode(offload, offload_group_layers), grad_accum, has_aux).fn


def _group_layers(group_layers: int | None) -> int:
    """`group_layers`, or `DEFAULT_GROUP_LAYERS` for None."""
    return DEFAULT_GROUP_LAYERS if group_layers is None else group_layers


def _offload_mode(offload: bool, group_layers: int | None) -> int:
    """0: on-device optimizer state; > 0: offloaded, streamed with that many layers per
    unit (copied whole, all at once, for an optimizer that is not a `StreamableChain`)."""
    return _group_layers(group_layers) if offload else 0


def _program(graphdef: Any, loss_fn: Callable[..., Any], grad_norm: bool,
             offload: int = 0, grad_accum: int = 1, has_aux: bool = False) -> _Program:
    """`offload`: see `_offload_mode`."""
    key = (graphdef, _loss_key(loss_fn), grad_norm, offload, grad_accum, has_aux)
    program = _programs.get(key)
    if program is not None:
        _programs.move_to_end(key)
        return program
    program = _Program()
    checked = with_aux(loss_fn, has_aux, "TrainStep")

    def step(state: nnx.State, batch: Any) -> tuple[nnx.State, dict[str, jax.Array]]:
        program.traces += 1
        # The input values, taken before merging: a refused step returns them unchanged.
        state_before = jax.tree.leaves(state)
        uses = None
        model, optimizer = nnx.merge(graphdef, state)
        if not _has_history(model):
            if grad_accum == 1:
                (loss, aux), grads = nnx.value_and_grad(checked, has_aux=True)(model, batch)
            else:
                loss, aux, grads = _accumulate(model, checked, batch, grad_accum)
        else:
            # Delayed FP8 scaling: the backward pass returns each amax history's next value
            # as its "gradient"; it replaces the history and never reaches the optimizer
            # (no moments, clipping, weight decay, nor a share of the gradient norm).
            loss, aux, grads, history = _grads_aux_and_history(model, checked, batch,
                                                               grad_accum)
            uses = history_uses(history, layer_prefix(model))
            nnx.update(model, next_fp8_history(nnx.state(model, Fp8History), history))
        if offload and isinstance(optimizer.tx, StreamableChain):
            _streamed_optimizer_update(model, optimizer, grads, offload)
        elif offload:  # the whole state to the device and back (any optax optimizer)
            nnx.update(optimizer, to_device(nnx.state(optimizer, nnx.OptState)))
            optimizer.update(model, grads)
            nnx.update(optimizer, map_opt_state(nnx.state(optimizer, nnx.OptState), to_host,
                                                keep=resident_paths(model, optimizer.wrt)))
        else:
            optimizer.update(model, grads)
        metrics = {**aux, "loss": loss.astype(jnp.float32)}
        lr = current_lr(optimizer.opt_state)
        if lr is not None:
            lr = jnp.asarray(lr, jnp.float32)
            metrics["lr"] = to_device(lr) if offload else lr
        if grad_norm:
            metrics["grad_norm"] = global_norm(grads)
        new_state = nnx.state((model, optimizer))
        if uses is not None:
            new_state, metrics = _refuse_reuse(state_before, new_state, metrics, uses,
                                               on_host=bool(offload))
        return new_state, metrics

    # Offloaded: more host transfers in flight, so both directions and compute overlap.
    options = streaming_compiler_options() if offload else {}
    program.fn = jax.jit(step, donate_argnums=0, compiler_options=options or None)
    _programs[key] = program
    while len(_programs) > CACHE_SIZE:
        _programs.popitem(last=False)
    return program


@functools.lru_cache(maxsize=CACHE_SIZE)
def _uses_program(graphdef: Any, loss_fn: Callable[..., Any], grad_accum: int,
                  has_aux: bool = False) -> Callable[..., dict[str, jax.Array]]:
    """The jitted ``uses(state, batch)``: each delayed-FP8 layer's use count in the step
    `TrainStep` would run on `batch` (`history_uses`), from its forward and backward passes
    alone; nothing is donated or updated."""
    checked = with_aux(loss_fn, has_aux, "TrainStep")

    def uses(state: nnx.State, batch: Any) -> dict[str, jax.Array]:
        model, _ = nnx.merge(graphdef, state)
        _, _, _, history = _grads_aux_and_history(model, checked, batch, grad_accum)
        return history_uses(history, layer_prefix(model))

    return jax.jit(uses)


def _refuse_reuse(before: list[jax.Array], new_state: nnx.State,
                  metrics: dict[str, Any], uses: dict[str, jax.Array], *, on_host: bool
                  ) -> tuple[nnx.State, dict[str, Any]]:
    """Where some delayed-FP8 layer ran more than once (`history_uses` > 1): the input
    state unchanged (`before`, its leaves) and a NaN loss, so a refused step changes
    nothing and is never silent; `TrainStep` reads ``metrics[USES_METRIC]`` on its first
    call and raises (`check_fp8_uses`). With `on_host` (offloaded optimizer state) the
    ``nnx.OptState`` leaves, in host memory, are left as updated (`TrainStep` checks the
    use counts before the first offloaded step instead), the rest is selected here.

    The selects fuse into the update's elementwise passes, which read the old values
    anyway; the update waits for the backward pass's use counts, as it already does for
    the global norm when the gradients are clipped."""
    ok = functools.reduce(jnp.logical_and, [n <= 1 for n in uses.values()], jnp.bool_(True))
    on_device: list[bool] = []  # per array: a grouped variable (HostGroups) holds several
    for v in jax.tree.leaves(new_state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        keep = not (on_host and isinstance(v, nnx.OptState))
        on_device.extend([keep] * len(jax.tree.leaves(v)))
    leaves, treedef = jax.tree.flatten(new_state)
    kept = [jnp.where(ok, new, old) if dev else new
            for new, old, dev in zip(leaves, before, on_device)]
    metrics = {**metrics, "loss": jnp.where(ok, metrics["loss"], jnp.nan),
               USES_METRIC: uses}
    return treedef.unflatten(kept), metrics


def _streamed_optimizer_update(model: nnx.Module, optimizer: nnx.Optimizer, grads: Any,
                               group_layers: int) -> None:
    """``optimizer.update(model, grads)`` with the state in host memory, streamed per layer
    group (`gtp_jax.sharding.offload.streamed_update`): the same arithmetic as
    ``nnx.Optimizer.update``."""
    graph = {"graph": optimizer.graph} if hasattr(optimizer, "graph") else {}
    param_state = nnx.state(model, optimizer.wrt, **graph)
    params = nnx.as_pure(param_state)
    new_params, new_opt_state = streamed_update(
        optimizer.tx, nnx.as_pure(nnx.state(grads, optimizer.wrt, **graph)),
        nnx.as_pure(optimizer.opt_state), params, _stacked_flags(param_state),
        group_layers=group_layers,
        resident=_resident_flags(param_state, resident_paths(model, optimizer.wrt)))
    nnx.update(model, new_params)
    _set_opt_state(optimizer, new_opt_state)
    optimizer.step[...] = to_host(to_device(optimizer.step[...]) + 1)


def _stacked_flags(param_state: nnx.State) -> Any:
    """Bools with the structure of ``nnx.as_pure(param_state)``: whether each parameter is
    layer-stacked (``gtp_stacked`` metadata: its leading dim indexes the layers)."""
    stacked = jax.tree.map(lambda v: bool(v.get_metadata().get(STACKED, False))
                           if isinstance(v, nnx.Variable) else False, param_state,
                           is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.as_pure(stacked)


def accumulate_grads(model: nnx.Module, loss_fn: Callable[[nnx.Module, Any], jax.Array],
                     batch: Any, microbatches: int) -> tuple[jax.Array, nnx.State]:
    """(mean loss, mean gradient) of ``loss_fn(model, .)`` over `microbatches` equal slices of
    `batch` (every leaf's leading axis, e.g. ``int32[batch, seq + 1]`` tokens), computed one
    slice at a time in a ``lax.scan``: activations of one microbatch are live at a time, the
    gradient sum is carried in the parameters' own (GTP-sharded) layout, in float32 for
    parameters of a narrower float (the mean is rounded to their dtype once).

    Microbatch ``i`` takes rows ``i, i + microbatches, ...``: with the batch split over the
    data axes in contiguous blocks, each device then holds ``1/microbatches`` of its own
    rows of every microbatch (no data moves between devices). For a loss that is a mean
    over rows (`gtp_jax.models.lm_loss` of a dense model) the result is the whole batch's
    loss and gradient, up to float rounding of the sums. State the module writes in its
    call (dropout's RNG count, counters, running statistics) is carried from microbatch to
    microbatch, as consecutive calls would leave it: a new dropout mask per microbatch.

    Returns the gradients as ``nnx.value_and_grad`` does (an ``nnx.State`` of the
    ``nnx.Param`` variables), float32 loss.
    """
    loss, _, grads = _accumulate(model, with_aux(loss_fn, False, "accumulate_grads"), batch,
                                 microbatches)
    return loss, grads


def _accumulate(model: nnx.Module,
                loss_fn: Callable[[nnx.Module, Any], tuple[jax.Array, dict[str, Any]]],
                batch: Any, microbatches: int) -> tuple[jax.Array, dict[str, Any], nnx.State]:
    """`accumulate_grads` of a `with_aux` loss function: (mean loss, the mean of each aux
    metric over the microbatches, mean gradient)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def slices(x: jax.Array) -> jax.Array:
        return _microbatches(x, microbatches)

    def loss_of(params: nnx.State, rest: nnx.State, micro: Any
                ) -> tuple[jax.Array, tuple[dict[str, Any], nnx.State]]:
        # copy: Variables of this trace level, which the module may write (nnx refuses a
        # write to a Variable made outside the gradient's trace).
        module = nnx.merge(graphdef, params, rest, copy=True)
        loss, aux = loss_fn(module, micro)
        return loss, (aux, nnx.split(module, nnx.Param, ...)[2])

    def body(carry: tuple[jax.Array, nnx.State, nnx.State], micro: Any
             ) -> tuple[tuple[jax.Array, nnx.State, nnx.State], dict[str, Any]]:
        loss_sum, grad_sum, rest = carry
        (loss, (aux, rest)), grads = jax.value_and_grad(loss_of, has_aux=True)(
            params, rest, micro)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads), rest), aux

    # The state the module writes (RNG counts, counters, running statistics) is carried
    # from microbatch to microbatch, as consecutive calls of the module would see it.
    zero = (jnp.zeros((), jnp.float32), _grad_sum_zeros(params), rest)
    (loss, grads, rest), aux = jax.lax.scan(body, zero, jax.tree.map(slices, batch))
    nnx.update(model, rest)
    return (loss * (1.0 / microbatches), _mean_over_microbatches(aux),
            _grad_mean(grads, params, microbatches))


def _mean_over_microbatches(aux: dict[str, Any]) -> dict[str, Any]:
    """Each stacked ``[microbatches, ...]`` aux metric's mean over the microbatches."""
    return jax.tree.map(lambda x: jnp.mean(x, axis=0), aux)


def _grad_sum_zeros(params: nnx.State) -> nnx.State:
    """Zeros to sum microbatch gradients into: float32 for parameters of a narrower float
    (bfloat16 ones under `GTPConfig.offload_master_weights`: a sum of many bfloat16 terms
    would round at every add), else the parameter's dtype."""
    def zeros(p: jax.Array) -> jax.Array:
        return jnp.zeros_like(p, dtype=jnp.float32 if narrower_than_float32(p.dtype)
                              else p.dtype)

    return jax.tree.map(zeros, params)


def _grad_mean(grads: nnx.State, params: nnx.State, microbatches: int) -> nnx.State:
    """The summed `grads` over `microbatches`, in each parameter's dtype (one rounding)."""
    scale = 1.0 / microbatches
    return jax.tree.map(lambda g, p: (g * scale).astype(p.dtype), grads, params)


def _has_history(model: nnx.Module) -> bool:
    """Whether `model` holds delayed-FP8 amax histories (``fp8_compute="delayed"``)."""
    return bool(jax.tree.leaves(nnx.state(model, Fp8History)))


def _grads_and_history(model: nnx.Module, loss_fn: Callable[[nnx.Module, Any], jax.Array],
                       batch: Any, microbatches: int
                       ) -> tuple[jax.Array, nnx.State, nnx.State]:
    """(loss, ``nnx.Param`` gradients, next `Fp8History` values) of one step.

    With `microbatches` > 1 as `accumulate_grads` (mean loss and gradient); every
    microbatch is scaled from the same (this step's) history, and the next history is the
    elementwise maximum of the microbatches' ones: the history rolled once, with the
    step's largest amax (a NaN in any microbatch stays NaN).
    """
    loss, _, grads, history = _grads_aux_and_history(
        model, with_aux(loss_fn, False, "TrainStep"), batch, microbatches)
    return loss, grads, history


def _grads_aux_and_history(
        model: nnx.Module,
        loss_fn: Callable[[nnx.Module, Any], tuple[jax.Array, dict[str, Any]]],
        batch: Any, microbatches: int
) -> tuple[jax.Array, dict[str, Any], nnx.State, nnx.State]:
    """`_grads_and_history` of a `with_aux` loss function: (loss, aux metrics (their mean
    over the microbatches), gradients, next `Fp8History` values)."""
    graphdef, params, history, rest = nnx.split(model, nnx.Param, Fp8History, ...)

    def loss_of(p: nnx.State, h: nnx.State, rest: nnx.State, micro: Any
                ) -> tuple[jax.Array, tuple[dict[str, Any], nnx.State]]:
        module = nnx.merge(graphdef, p, h, rest, copy=True)  # see `_accumulate`
        loss, aux = loss_fn(module, micro)
        return loss, (aux, nnx.split(module, nnx.Param, Fp8History, ...)[3])

    grad = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)
    if microbatches == 1:
        (loss, (aux, rest)), (grads, new_history) = grad(params, history, rest, batch)
        nnx.update(model, rest)  # what the module wrote (RNG counts, counters)
        return loss, aux, grads, new_history

    def body(carry: tuple, micro: Any) -> tuple[tuple, dict[str, Any]]:
        loss_sum, grad_sum, hist_max, rest = carry
        (loss, (aux, rest)), (grads, new_history) = grad(params, history, rest, micro)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads),
                jax.tree.map(jnp.maximum, hist_max, new_history), rest), aux

    # Histories hold amaxes (>= 0 or NaN): zeros are the identity of their maximum. The
    # state the module writes is carried from microbatch to microbatch (see `_accumulate`).
    zero = (jnp.zeros((), jnp.float32), _grad_sum_zeros(params),
            jax.tree.map(jnp.zeros_like, history), rest)
    (loss, grads, new_history, rest), aux = jax.lax.scan(
        body, zero, jax.tree.map(lambda x: _microbatches(x, microbatches), batch))
    nnx.update(model, rest)
    return (loss * (1.0 / microbatches), _mean_over_microbatches(aux),
            _grad_mean(grads, params, microbatches), new_history)


def _microbatches(x: jax.Array, microbatches: int) -> jax.Array:
    """``[microbatches, rows / microbatches, ...]``: microbatch ``i`` takes rows ``i,
    i + microbatches, ...`` (see `accumulate_grads`)."""
    rows = x.shape[0]
    if rows % microbatches:
        raise UsageTypeError(f"accumulate_grads: the batch's {rows} rows do not split into "
                             f"{microbatches} equal microbatches.")
    x = x.reshape(rows // microbatches, microbatches, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def with_aux(loss_fn: Callable[[nnx.Module, Any], Any], has_aux: bool, where: str
             ) -> Callable[[nnx.Module, Any], tuple[jax.Array, dict[str, Any]]]:
    """``loss_fn`` as ``fn(model, batch) -> (float32 scalar loss, aux metrics dict)`` (an
    empty dict without `has_aux`), checking what it returns while it is traced.

    Raises:
      UsageError: (one line, naming `where`) a loss that is not a floating scalar, a tuple
        without `has_aux`, or with `has_aux` something else than ``(loss, dict)`` whose
        keys are strings other than the step's own metrics (`STEP_METRICS`) and whose
        values are arrays.
    """
    def fn(model: nnx.Module, batch: Any) -> tuple[jax.Array, dict[str, Any]]:
        out = loss_fn(model, batch)
        if has_aux:
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise UsageError(
                    f"{where}: has_aux=True, but loss_fn returned {_described(out)}; return "
                    "(loss, aux), aux a dict of metrics, e.g. (loss, {'accuracy': acc}).")
            loss, aux = out
            _check_aux(aux, where)
        else:
            if isinstance(out, (tuple, list)):
                raise UsageError(
                    f"{where}: loss_fn returned {_described(out)}, not a scalar loss; to "
                    "return metrics beside the loss, return (loss, aux) with aux a dict and "
                    "pass has_aux=True (TrainStep; the command line's --model takes a scalar "
                    "loss).")
            loss, aux = out, {}
        return _scalar_loss(loss, where), dict(aux)

    return fn


def _described(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    shape = getattr(x, "shape", None)
    return f"{type(x).__name__}" + ("" if shape is None else f" of shape {tuple(shape)}")


def _scalar_loss(loss: Any, where: str) -> jax.Array:
    """`loss` as a float32 scalar, or one line saying what it is instead."""
    if not hasattr(loss, "shape") and not isinstance(loss, (int, float)):
        raise UsageError(f"{where}: loss_fn returned {_described(loss)} as the loss; return "
                         "a floating scalar array (e.g. jnp.mean(per_example_losses)).")
    shape = tuple(jnp.shape(loss))
    if shape:
        raise UsageError(
            f"{where}: loss_fn returned a loss of shape {shape}, not a scalar; reduce it to "
            "one number (e.g. jnp.mean over the batch), and return per-example values as "
            "aux metrics (has_aux=True) if you need them.")
    dtype = jnp.result_type(loss)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise UsageError(f"{where}: loss_fn returned a loss of dtype {dtype}; gradients need "
                         "a floating loss (e.g. jnp.float32).")
    return jnp.asarray(loss).astype(jnp.float32)


def _check_aux(aux: Any, where: str) -> None:
    """Aux metrics: a dict of arrays whose keys are strings other than `STEP_METRICS`."""
    if not isinstance(aux, Mapping):
        raise UsageError(f"{where}: loss_fn's aux is {_described(aux)}; return a dict of "
                         "metrics, e.g. (loss, {'accuracy': acc}).")
    for name, value in aux.items():
        if not isinstance(name, str):
            raise UsageError(f"{where}: aux metric name {name!r} must be a string.")
        if name in STEP_METRICS:
            raise UsageError(f"{where}: aux metric {name!r} is one of the step's own metrics "
                             f"{list(STEP_METRICS[:3])}; rename it (e.g. 'aux_{name}').")
        for leaf in jax.tree.leaves(value):
            if not hasattr(leaf, "dtype") and not isinstance(leaf, (int, float, bool)):
                raise UsageError(f"{where}: aux metric {name!r} holds {_described(leaf)}; "
                                 "metrics must be arrays (or numbers).")


def _loss_key(loss_fn: Callable[..., Any]) -> Hashable:
    """Partials compare by identity; key them by function and arguments instead."""
    if isinstance(loss_fn, functools.partial):
        key = ("partial", _loss_key(loss_fn.func), loss_fn.args,
               tuple(sorted(loss_fn.keywords.items())))
        try:
            hash(key)
        except TypeError:  # unhashable arguments: this object only
            return loss_fn
        return key
    return loss_fn


def _replicate_strays(state: nnx.State) -> nnx.State:
    """`state` with arrays off the mesh of its sharded arrays put replicated on that mesh."""
    leaves = jax.tree.leaves(state)
    mesh = next((x.sharding.mesh for x in leaves if isinstance(x, jax.Array)
                 and isinstance(x.sharding, jax.sharding.NamedSharding)), None)
    if mesh is None:
        return state
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(x: Any) -> Any:
        if isinstance(x, jax.Array) and not isinstance(x.sharding, jax.sharding.NamedSharding):
            return jax.device_put(x, replicated)
        return x

    return jax.tree.map(place, state)


def replicate_stray_leaves(obj: nnx.Module | nnx.Optimizer, mesh: jax.sharding.Mesh) -> None:
    """Puts arrays of `obj` that are not on `mesh` (``optax`` creates its step counters on one
    device, uncommitted) replicated on it, where a jitted step leaves them after one update.

    Then step 1 sees the same input shardings as every later step (and as a restored
    checkpoint), and the step compiles once instead of twice. Values are unchanged; arrays
    already placed with a ``NamedSharding`` are left as they are. (`TrainStep` does this
    to its own state; this is for steps written with ``nnx.jit``.)
    """
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = nnx.state(obj)
    placed = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if isinstance(value, jax.Array) and not isinstance(value.sharding,
                                                           jax.sharding.NamedSharding):
            var = var.replace(value=jax.device_put(value, replicated))
        placed.append((path, var))
    nnx.update(obj, nnx.from_flat_state(placed))


def check_optimizer_of(model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    """Raises `UsageError` unless `optimizer`'s state fits `model`'s parameters: the same
    tree (paths) and shapes as ``optimizer.tx.init`` of them (``jax.eval_shape``: nothing is
    computed). An ``nnx.Optimizer`` built before `gtp_jax.shard` holds state for the
    unsharded module (other paths, unpadded shapes), and JAX would only fail later, inside
    the step, with a pytree structure error."""
    graph = getattr(optimizer, "graph", None)
    params = nnx.state(model, optimizer.wrt, **({} if graph is None else {"graph": graph}))
    expected = jax.eval_shape(optimizer.tx.init, nnx.as_pure(params))
    actual = jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v,
                          optimizer.opt_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    same = jax.tree.structure(expected) == jax.tree.structure(actual) and all(
        getattr(a, "shape", None) == getattr(b, "shape", None)
        for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(actual)))
    if not same:
        raise UsageError(
            f"TrainStep: the optimizer's state does not fit the parameters of the "
            f"{type(model).__name__} it is to train (other paths or shapes): it was built for "
            "another module, e.g. before gtp_jax.shard. Build it from the module you train: "
            "sharded = gtp_jax.shard(model, mesh); optimizer = nnx.Optimizer(sharded, tx, "
            "wrt=nnx.Param).")
