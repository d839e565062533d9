"""`shard` / `unshard`: turn an ordinary Flax NNX module into a GTP-sharded one and back."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gtp_jax.base.axes import ParallelAxes, use_axes, vocab_axis
from gtp_jax.base.config import GTPConfig
from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.base.mesh import check_axis, cp_size, data_axes, data_size, seq_axes, shard_key
from gtp_jax.base.metadata import (
    LOCAL,
    LOGICAL_SHAPE,
    REDUCE,
    SPLIT_AXES,
    SPLIT_LAYOUT,
    STACKED,
)
from gtp_jax.sharding import fp8
from gtp_jax.sharding.collectives import gather_weight
from gtp_jax.sharding.contract import (
    InputLayout,
    OutputLayout,
    arg_name,
    body_jaxpr,
    check_call_arguments,
    check_outputs,
    has_user_remat,
    key_name,
    per_example_rows,
    python_attributes,
    reduce_side_state,
    refuse_attribute_writes,
    refuse_shard_identical_draws,
    refuse_unruled,
    refuse_write,
    replaced_read_only,
    same_values,
    side_rules,
)
from gtp_jax.sharding.data_view import data_view, unmentioned_axes, viewed_spec
from gtp_jax.sharding.lazy import GTPShard, LazyWeight, whole_weight
from gtp_jax.sharding.plan import (
    ParamPlan,
    SplitPlan,
    choose_shard_dim,
    model_splits,
    path_str,
    plan_param,
)
from gtp_jax.sharding.replicated import Replicated, is_replicated, replicated, unwrap
from gtp_jax.sharding.scan import gathered_weight_policy
from gtp_jax.sharding.sharing import (
    HoldsShards,
    check_callers,
    check_not_shared,
    record_sources,
)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _flat_variables(state: Any) -> tuple[list[str], list[nnx.Variable], Any]:
    """(paths, variables, treedef) of a `nnx.State`, with Variables as leaves."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)
    paths = [path_str(key_name(k) for k in keys) for keys, _ in with_path]
    return paths, [v for _, v in with_path], treedef


class ShardedModule(nnx.Module, HoldsShards):
    """A Flax NNX module whose eligible weights are stored as 1/N shards on a mesh axis.

    Built by `gtp_jax.shard`. Calling it runs the wrapped module inside ``jax.shard_map``:
    every array argument is split along dim 0 (the batch) over the mesh's data axes
    (`gtp_jax.data_axes`: every axis but ``tp``), weights are all-gathered just before use
    and their gradients reduce-scattered back to shards. Weights split over ``tp``/``ep``
    (`gtp_jax.sharding.plan.TP_DIM` / ``EP_DIM`` metadata) arrive as this rank's piece.

    While the module is traced, `gtp_jax.parallel.current_axes` names the mesh's ``tp`` and
    ``ep`` axes (when larger than 1), so model code can run tensor/sequence/expert
    parallelism. Outputs keep their batch split (``P(data_axes)``) unless the wrapped module
    defines ``gtp_output_layout(mesh, *args, **kwargs) -> OutputLayout | None`` (same
    arguments as ``__call__``), e.g. to return sequence-sharded logits.

    Context parallelism (a mesh with ``cp > 1``): the data axes exclude ``cp``; a module that
    defines ``gtp_input_layout(mesh, *args, **kwargs) -> InputLayout | None`` gets the
    batch arguments it names split on dim 1 (the sequence) over ``cp`` and sees ``cp`` in
    `current_axes`; weights stay replicated over ``cp`` (GTP gathers are unchanged) and
    their gradients are summed over ``cp`` as over the data axes (``shard_map``'s transpose
    sums the cotangent of an input over every axis its spec does not name). Side state is
    reduced, and RNG keys folded, over ``cp`` too. Any other module runs unsplit: every
    ``cp`` rank computes the same thing.

    Call contract (each breach is a `gtp_jax.base.errors.UsageError` naming the argument, output
    or variable, raised before any state changes):

    * every array argument of rank >= 1 is a batch: split on dim 0, all with one leading
      dim (a multiple of `gtp_jax.data_size`). Pass anything else (a table, a shared mask)
      as `gtp_jax.replicated(x)`; the module receives it whole. An array whose leading dim
      happens to equal the batch cannot be told apart: wrap it.
    * with the default layout each output is per-example (leading dim = the shard's batch)
      and is concatenated over the data shards; with no batch argument, outputs are
      replicated.
    * state other than parameters written in ``__call__`` is combined over the data shards,
      never taken from one shard and never by a guess: by the rule its type implies
      (`gtp_jax.BatchMean`: mean over the shards; `gtp_jax.BatchSum`: the old value plus
      every shard's change, for counts and sums; `gtp_jax.SameOnEveryShard`: identical on
      every shard, as ``nnx.RngCount``; `gtp_jax.PerExample`: rows concatenated) or by its
      ``gtp_reduce`` metadata (`REDUCE`: ``"mean"``, ``"sum"``, ``"same"``, ``"concat"``).
      Written state with neither is refused, naming the variable. New values (``sow``) must
      be per-example and are concatenated like outputs.
    * parameters (and RNG keys) are only read: a write in ``__call__`` is refused, naming
      the variable (values NNX's lifted transforms only pass on are not writes).
    * randomness comes from ``nnx.Rngs`` held by the module; its keys are folded per data
      shard (each shard draws its own bits, not the unsharded module's). Randomness handed
      to the call (an ``nnx.Rngs``, a stream, RNG state, a typed PRNG key every shard would
      receive whole) is refused, as is any module or variable argument, and a raw
      ``uint32`` key (one ``jax.random.PRNGKey``); one key per example is a batch. A key
      built inside the call that every data shard builds alike (``jax.random.key(seed)``
      from a constant or a Python int) is refused too: the traced body names each draw
      whose key depends on no batch input and no shard index.
    * batch statistics written in ``__call__`` (BatchNorm in training mode) are refused;
      in inference mode they are only read. A plain Python attribute set in ``__call__``
      (``self.calls += 1``) is refused: the call runs a copy, the change would be lost.
    * a model holding, beside this module, an original it was copied from (a shared
      weight ``shard`` untied) is refused at the call (`gtp_jax.sharding.sharing`).
    * not checked: an operation across examples in ``__call__`` (``h - h.mean(0)``) runs
      over each data shard's examples. `gtp_jax.check_sharded` compares one forward and
      backward pass with the unsharded module's on a real batch.
    * memory policy: gathered weights are not saved for the backward pass
      (``GTPConfig.remat_gathered``) and the module's own ``nnx.remat`` /
      ``jax.checkpoint`` policies are kept: when the module has remat regions, each weight
      is gathered where it is read, inside them. On a 1-wide GTP axis nothing is gathered,
      and on one device no ``shard_map`` is added.

    Attributes:
      module: the wrapped module; its sharded parameters hold padded global arrays.
      mesh: the device mesh.
      config: the `GTPConfig` it was sharded with.
      plan: one `ParamPlan` per GTP-sharded parameter.
      split_plan: one `SplitPlan` per parameter split over ``tp``/``ep`` but not GTP-sharded.
      fp8_layers: ``(path, attribute, original matmul)`` of each layer whose matmuls run in
        FP8 (``GTPConfig.fp8_compute``; `gtp_jax.sharding.fp8`).
    """

    def __init__(self, module: nnx.Module, *, mesh: Mesh, config: GTPConfig,
                 plan: tuple[ParamPlan, ...], split_plan: tuple[SplitPlan, ...] = (),
                 fp8_layers: tuple[tuple[str, str, Any], ...] = ()):
        self.module = module
        self.mesh = mesh
        self.config = config
        self.plan = plan
        self.split_plan = split_plan
        self.fp8_layers = fp8_layers

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks: say where a method of the wrapped
        # module went, instead of a bare AttributeError.
        module = vars(self).get("module")
        if module is not None and not name.startswith("_") and hasattr(module, name):
            raise AttributeError(
                f"gtp_jax.ShardedModule has no attribute {name!r}; the wrapped "
                f"{type(module).__name__} has it. Only its __call__ runs sharded (weights "
                f"gathered); sharded.module.{name} would read the stored shards. Call it on "
                f"gtp_jax.unshard(sharded), or shard the part of the model it runs.")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _graph_node_set_key(self, key: Any, value: Any) -> None:
        # nnx.update of the sharded module with an unsharded module's state names keys the
        # wrapper does not have (its state is under 'module'): one line instead of Flax's
        # static-attribute error.
        if isinstance(key, str) and key not in vars(self) and not key.startswith("_"):
            raise UsageError(
                f"gtp_jax.ShardedModule: the state written in (nnx.update) has {key!r} where "
                "the sharded module's state has 'module' (an unsharded module's state?). Load "
                "weights into the plain module and shard it then (gtp_jax.shard), or read "
                "them out with gtp_jax.unshard.")
        super()._graph_node_set_key(key, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        check_call_arguments(args, kwargs)
        check_callers("gtp_jax.ShardedModule")  # a weight the shard() copy untied
        mesh, axes = self.mesh, data_axes(self.mesh)
        plans = {p.path: p for p in self.plan}
        placed = self.placements()
        graphdef, state = nnx.split(self.module)
        paths, variables, var_tree = _flat_variables(state)
        values = [v.get_value() for v in variables]
        value_specs = _stored_specs(placed, paths, values)
        _check_stored_layout(paths, variables, values, value_specs, mesh, frozenset(placed))
        plain_args, plain_kwargs = jax.tree.map(
            lambda x: x.value if is_replicated(x) else x, (args, kwargs), is_leaf=is_replicated)
        in_layout = self._input_layout(plain_args, plain_kwargs)
        layout = self._output_layout(plain_args, plain_kwargs)
        if in_layout is not None and in_layout.prepare is not None:
            args, kwargs = in_layout.prepare(args, kwargs)
        with_path, arg_tree = jax.tree_util.tree_flatten_with_path(
            (args, kwargs), is_leaf=is_replicated)
        leaves = [x for _, x in with_path]
        names = [arg_name(keys) for keys, _ in with_path]
        dynamic, arg_specs, batch, seq_split = self._arg_specs(leaves, names, in_layout)
        local_batch = None if batch is None else batch // data_size(mesh)
        default_layout = layout is None
        if seq_split and default_layout:
            raise UsageError(
                f"{type(self.module).__name__}.gtp_input_layout splits its inputs over the "
                f"sequence ({', '.join(seq_split)} over cp={cp_size(mesh)}), so each cp rank "
                "computes different outputs; define gtp_output_layout to say how they leave "
                "the sharded call (e.g. sequence-sharded over 'cp'), or return None from "
                "gtp_input_layout.")
        if default_layout:
            # Without batch arguments every shard computes the same outputs: replicated.
            layout = OutputLayout(P(axes) if batch is not None else P())
        rules = side_rules(paths, variables)
        if batch is not None and data_size(mesh) > 1:
            _refuse_decode_caches(paths, variables, rules)
        split_rows = per_example_rows(paths, values, rules, batch)
        if split_rows and not seq_split:
            value_specs = [P(axes) if p in split_rows else s
                           for p, s in zip(paths, value_specs)]
        else:
            split_rows = frozenset()
        # On one device there is nothing to split or reduce: the body runs as is, without
        # shard_map (whose transpose would add an all-reduce, and a buffer, per gradient).
        single = mesh.devices.size == 1
        # Ranks that see different tokens: the data axes, and cp when the sequence is split.
        reduce_axes = () if single else axes + (seq_axes(mesh) if seq_split else ())
        # Layer-stacked GTP shards whose gradients shard_map would sum over the data axes
        # after the backward pass: summed in the layer loop instead, layer by layer, beside
        # the next layer's backward (`gtp_jax.sharding.data_view`).
        viewed = {} if single else {
            i: a for i, (p, s) in enumerate(zip(paths, value_specs))
            if p in plans and plans[p].stacked and (a := unmentioned_axes(mesh, s))}
        plans = {**plans, **{paths[i]: dataclasses.replace(
            plans[paths[i]], spec=dataclasses.replace(plans[paths[i]].spec, data_axes=a))
            for i, a in viewed.items()}}
        side_keys: list[tuple[tuple, nnx.Variable]] = []
        # shard_map's transpose sums a replicated variable's cotangent over every mesh axis;
        # the delayed FP8 recipe's amax histories are reduced over the same axes.
        amax_axes = () if single else tuple(mesh.axis_names)

        # Parameters, RNG keys and state without a combining rule whose value the call
        # replaced (set while tracing the body; `_check_writes` tells writes from values
        # that NNX's lifted transforms only passed on).
        replaced: list[str] = []

        def body(local_values, local_args, lazy=False, probe=()):
            new_vars = []
            for path, var, x in zip(paths, variables, local_values):
                if path in plans:
                    x = self._local_weight(x, plans[path], lazy)
                elif isinstance(var, nnx.RngKey):
                    x = shard_key(x, reduce_axes)
                new_vars.append(var.replace(value=x))
            before = {path: v.get_value() for path, v in zip(paths, new_vars)}
            module = nnx.merge(graphdef, jax.tree.unflatten(var_tree, new_vars))
            call_leaves = list(leaves)
            for i, x in zip(dynamic, local_args):
                call_leaves[i] = x
            call_args, call_kwargs = jax.tree.unflatten(arg_tree, call_leaves)
            attributes = python_attributes(module)
            with fp8.amax_axes(amax_axes, self.config.quant_backend):
                out = module(*call_args, **call_kwargs)
            refuse_attribute_writes(attributes, python_attributes(module))
            if probe:  # `_check_writes`: the values before and after the call
                now = {path_str(key_name(k) for k in keys): v.get_value()
                       for keys, v in nnx.to_flat_state(nnx.state(module))}
                return [jax.tree.leaves(before[p]) for p in probe], [
                    jax.tree.leaves(now.get(p)) for p in probe]
            replaced[:] = replaced_read_only(module, before)
            if default_layout:
                check_outputs(out, local_batch)
            unruled: list[str] = []
            side = reduce_side_state(module, before, rules, local_batch, reduce_axes,
                                      bool(seq_split), split_rows, unruled)
            replaced.extend(unruled)
            side_keys[:] = [(k, v) for k, v, _ in side]
            return out, [x for _, _, x in side]

        # Weights the body builds (gathers, or casts to gather_dtype on a 1-wide axis).
        built = [p.spec for p in self.plan if not p.stacked and (
            p.spec.axis_size > 1 or p.spec.quantized or p.spec.gather_dtype is not None)]
        gathered = [s for s in built if s.axis_size > 1 or s.quantized]
        axes_in_use = ParallelAxes.from_mesh(mesh)
        if not seq_split:  # cp is published only to a module whose inputs are split over it
            axes_in_use = dataclasses.replace(axes_in_use, cp=None, cp_size=1)
        if layout.vocab is not None and not single:  # the module's opt-in (its layout)
            axes_in_use = dataclasses.replace(axes_in_use, vocab=layout.vocab,
                                              vocab_size=int(mesh.shape[layout.vocab]))
        call_body, lazy = body, False
        local_args = [unwrap(leaves[i]) for i in dynamic]
        if not single and _explicit(mesh):
            # A mesh of Explicit axes (`jax.make_mesh`'s default) types each array by its
            # sharding: an argument placed otherwise is moved to its split here, as
            # `shard_map` does by itself on an Auto mesh.
            local_args = [jax.sharding.reshard(x, NamedSharding(mesh, spec))
                          for x, spec in zip(local_args, arg_specs)]
        # Randomness is checked where shards see different examples (else every shard
        # computes what the unsharded module does).
        check_draws = batch is not None and not single and data_size(mesh) > 1

        def make_run(body: Callable) -> Callable:
            """`body` over the mesh: ``shard_map``, its layer-stacked shards seen per data
            rank (`data_view`); the body itself on one device."""
            if single:
                return body

            def viewed_body(local_values: list, local_args: list) -> Any:
                return body([x[0] if i in viewed else x for i, x in enumerate(local_values)],
                            local_args)

            sharded_run = jax.shard_map(
                viewed_body if viewed else body,
                mesh=mesh,
                in_specs=([viewed_spec(s, viewed[i]) if i in viewed else s
                           for i, s in enumerate(value_specs)], arg_specs),
                out_specs=(layout.specs, P()),
                check_vma=False,
            )
            if not viewed:
                return sharded_run

            def run(values: list, local_args: list) -> Any:
                views = dict(zip(viewed, data_view(
                    tuple(values[i] for i in viewed), mesh,
                    tuple(value_specs[i] for i in viewed), tuple(viewed.values()))))
                return sharded_run([views.get(i, x) for i, x in enumerate(values)],
                                   local_args)

            return run

        if self.config.remat_gathered and gathered:
            body = jax.checkpoint(body, policy=gathered_weight_policy(gathered))
        run = jax.jit(make_run(body))
        if (self.config.remat_gathered and built) or check_draws:
            # The checks read the program's own trace: jit reuses it for the call below.
            with use_axes(axes_in_use):
                traced = body_jaxpr(run.trace(values, local_args).jaxpr)
            if check_draws:
                varying = [flag for x, flag in zip(
                    [*values, *local_args],
                    [*(p in split_rows for p in paths), *(spec != P() for spec in arg_specs)])
                    for _ in jax.tree.leaves(x)]
                if len(varying) == len(traced.invars):
                    refuse_shard_identical_draws(traced, varying, frozenset(reduce_axes))
            if self.config.remat_gathered and built and has_user_remat(traced):
                lazy = True
                # An outer checkpoint would impose its policy inside the module's own remat
                # regions (JAX applies the outermost policy to nested ones). Instead each
                # weight is gathered where it is read, inside those regions, whose policy
                # then applies to it too.
                run = jax.jit(make_run(functools.partial(call_body, lazy=True)))
        # The body is traced inside this call (also under jit/grad), so model code sees the
        # axes; backward rules never read them (they get axis names as static arguments).
        # Under jit: `run` joins the caller's program. Called eagerly (a notebook cell,
        # `nnx.grad` without `nnx.jit`), shard_map alone would run the body operation by
        # operation, compiling each on its own (an eager gradient of a two-layer decoder:
        # about 540 programs, 38 s on 2 CPU cores); jitted, it is one program per call.
        if (default_layout and check_draws
                and not getattr(self.module, "gtp_outputs_per_example", False)):
            with use_axes(axes_in_use):
                sharded_out = run.trace(values, local_args).out_info[0]  # reused by the call
            _refuse_coincident_outputs(sharded_out, graphdef, variables, var_tree, values,
                                       plain_args, plain_kwargs, batch, local_batch)
        with use_axes(axes_in_use):
            out, side = run(values, local_args)
            if replaced:
                probe = functools.partial(call_body, lazy=lazy, probe=tuple(replaced))
                if not single:
                    probe = jax.shard_map(probe, mesh=mesh, in_specs=(value_specs, arg_specs),
                                          out_specs=P(), check_vma=False)
                self._check_writes(probe, values, local_args,
                                   tuple(replaced), dict(zip(paths, variables)))
        if side_keys:
            nnx.update(self.module, nnx.from_flat_state(
                [(k, v.replace(value=x)) for (k, v), x in zip(side_keys, side)]))
        return out if layout.finalize is None else layout.finalize(out)

    @staticmethod
    def _check_writes(probe: Any, values: list, args: list, replaced: tuple[str, ...],
                      by_path: dict[str, nnx.Variable]) -> None:
        """Refuses a parameter or RNG key the call wrote, and state without a combining rule
        (before any state changes).

        `replaced` holds those whose value the traced call replaced; `probe` is the call
        returning their values before and after. A value that NNX's lifted transforms
        (``nnx.remat``, ``nnx.scan``...) only passed on is the same value in the traced
        program (`same_values`); anything else is a write, which a sharded call cannot keep
        (`refuse_write`) or combine (`refuse_unruled`).
        """
        closed, (before, after) = jax.make_jaxpr(probe, return_shape=True)(values, args)
        n = sum(len(x) for x in before)
        start = 0
        for path, old, new in zip(replaced, before, after):
            pairs = [(start + i, n + start + i) for i in range(len(old))]
            if len(old) != len(new) or not all(same_values(closed.jaxpr, pairs)):
                var = by_path[path]
                if isinstance(var, (nnx.Param, nnx.RngKey)):
                    refuse_write(path, var)
                refuse_unruled(path, var)
            start += len(old)

    def _local_weight(self, x: jax.Array, plan: ParamPlan, lazy: bool = False) -> Any:
        """The weight the module's math sees, from this device's stored piece (in the body)."""
        spec = plan.spec
        if plan.stacked:
            return GTPShard(x, spec, self.config.prefetch,
                            keep_gathered=self.config.keep_gathered_layers)
        if lazy or plan.local:
            return LazyWeight(x, spec)
        return whole_weight(x, spec) if spec.axis_size == 1 else gather_weight(x, spec)

    def _input_layout(self, args: tuple, kwargs: dict) -> InputLayout | None:
        """The module's `InputLayout` on a mesh with ``cp > 1`` (None: no sequence split)."""
        if cp_size(self.mesh) == 1:
            return None
        hook = getattr(self.module, "gtp_input_layout", None)
        layout = hook(self.mesh, *args, **kwargs) if callable(hook) else None
        if layout is not None and not isinstance(layout, InputLayout):
            raise UsageTypeError(
                f"{type(self.module).__name__}.gtp_input_layout must return an InputLayout "
                f"or None, got {type(layout).__name__}.")
        return layout

    def _output_layout(self, args: tuple, kwargs: dict) -> OutputLayout | None:
        hook = getattr(self.module, "gtp_output_layout", None)
        layout = hook(self.mesh, *args, **kwargs) if callable(hook) else None
        if layout is not None and not isinstance(layout, OutputLayout):
            raise UsageTypeError(
                f"{type(self.module).__name__}.gtp_output_layout must return an OutputLayout "
                f"or None, got {type(layout).__name__}.")
        if layout is not None and layout.vocab is not None and \
                layout.vocab != vocab_axis(self.mesh):
            raise UsageError(
                f"{type(self.module).__name__}.gtp_output_layout asks for a vocabulary split "
                f"over {layout.vocab!r}, but on this mesh ({dict(self.mesh.shape)}) the "
                f"vocabulary can be split over {vocab_axis(self.mesh)!r} only "
                "(gtp_jax.base.axes.vocab_axis); set OutputLayout.vocab from vocab_axis(mesh).")
        return layout

    def _arg_specs(self, leaves: list, names: list[str], in_layout: InputLayout | None = None
                   ) -> tuple[list[int], list[P], int | None, list[str]]:
        """(indices of array leaves, their in_specs, the global batch or None, names of the
        arguments split over the sequence).

        Arrays of rank >= 1 are batch arguments, split on dim 0 over the data axes; they must
        all have the same leading dim. `Replicated` arrays and scalars reach every shard whole.
        With an `InputLayout` (cp > 1), the batch arguments it names are also split on dim 1
        over ``cp``.
        """
        n = data_size(self.mesh)
        cp = cp_size(self.mesh)
        seq_split: list[str] = []
        dynamic, specs, batch, first = [], [], None, None
        for i, (x, name) in enumerate(zip(leaves, names)):
            if is_replicated(x):
                dynamic.append(i)
                specs.append(P())
                continue
            if not isinstance(x, (jax.Array, np.ndarray)):
                continue
            dynamic.append(i)
            if np.ndim(x) == 0:
                specs.append(P())
                continue
            lead = int(np.shape(x)[0])
            if lead % n:
                raise UsageError(
                    f"Argument {i} ({name}) has batch dimension {lead}, which does not divide "
                    f"over the {n} data shards {data_axes(self.mesh)} of the mesh; use a batch "
                    f"size that is a multiple of {n}, or pass an array that is not batch-major "
                    "as gtp_jax.replicated(x).")
            if batch is None:
                batch, first = lead, name
            elif lead != batch:
                raise UsageError(
                    f"Argument {i} ({name}) has leading dim {lead} but {first} has {batch}: "
                    "every array argument of a sharded module is split on dim 0 as the batch, "
                    "so all must share it; pass arrays that are not batch-major (tables, "
                    "masks shared by all examples) as gtp_jax.replicated(x).")
            if in_layout is not None and in_layout.splits(name, np.ndim(x)):
                seq = int(np.shape(x)[1])
                if seq % cp:
                    raise UsageError(
                        f"Argument {i} ({name}) has sequence dimension (dim 1) {seq}, which "
                        f"does not divide over cp={cp}; the module's gtp_input_layout must "
                        f"pad it (e.g. to gtp_jax.parallel.context.padded_seq_len({seq}, {cp}))"
                        " in InputLayout.prepare.")
                seq_split.append(name)
                specs.append(P(data_axes(self.mesh), seq_axes(self.mesh)))
                continue
            specs.append(P(data_axes(self.mesh)))
        if in_layout is not None and not isinstance(in_layout.split_seq, bool):
            unknown = sorted(set(in_layout.split_seq) - set(seq_split))
            if unknown:
                raise UsageError(
                    f"{type(self.module).__name__}.gtp_input_layout names {unknown} in "
                    "split_seq, which are not batch arguments of rank >= 2 of this call "
                    f"(batch arguments: {[nm for nm in names]}).")
        return dynamic, specs, batch, seq_split

    def describe(self) -> list[str]:
        """One line per GTP-sharded parameter: path, logical (per-layer, model-parallel-local)
        shape, shard dim, padded size, and bytes per device vs replicated."""
        lines = []
        for p in self.plan:
            spec = p.spec
            layers = 1
            if p.stacked:
                value = nnx.to_flat_state(nnx.state(self.module))
                layers = next(int(v.get_value().shape[0]) for k, v in value
                              if path_str(key_name(x) for x in k) == p.path)
            item = np.dtype(spec.param_dtype).itemsize * layers
            per_device = int(np.prod(spec.shard_shape)) * item
            full = int(np.prod(spec.logical_shape)) * item
            stack = f" x {layers} layers" if p.stacked else ""
            lines.append(
                f"{p.path}: shape {spec.logical_shape}{stack} "
                f"dim {spec.shard_dim} padded {spec.logical_shape[spec.shard_dim]}->"
                f"{spec.padded_size} over {spec.axis}={spec.axis_size}: {per_device} B/device "
                f"vs {full} B replicated ({per_device / full:.3f}, ideal {1 / spec.axis_size:.3f})")
        recipe = self.config.fp8_compute
        if recipe == "delayed":
            recipe += f", amax history of {self.config.fp8_history_len} steps"
        lines += [f"{path}: matmuls in fp8 ({recipe})" for path, _, _ in self.fp8_layers]
        return lines

    def sharded_paths(self) -> list[str]:
        """Paths of the GTP-sharded parameters."""
        return [p.path for p in self.plan]

    def placements(self) -> dict[str, ParamPlan | SplitPlan]:
        """``{path: plan}`` of every parameter not simply replicated (GTP and/or tp/ep)."""
        return {**{p.path: p for p in self.split_plan}, **{p.path: p for p in self.plan}}


def shard(module: nnx.Module, mesh: Mesh, config: GTPConfig | None = None) -> ShardedModule:
    """Returns a copy of `module` whose eligible weights are stored 1/N on ``config.axis``.

    Each selected parameter (default: floating, rank >= 2, at least ``config.min_elements``
    elements; see `GTPConfig`) is zero-padded on dim 0 (dim 1 for layer-stacked weights
    marked with ``gtp_stacked=True`` metadata) to a multiple of the axis size and placed with
    ``NamedSharding(mesh, P(..., config.axis, ...))``; everything else is replicated on the
    mesh. The input module is not modified. Optimizer state built from the result (e.g.
    ``nnx.Optimizer(sharded, optax.adamw(1e-3), wrt=nnx.Param)``) is sharded the same way.

    Tensor/expert parallelism: a parameter whose metadata names a ``gtp_tp_dim`` (or
    ``gtp_ep_dim``) is split over the mesh's ``tp`` (``ep``) axis on that per-layer dim
    when the axis is larger than 1 (see `gtp_jax.sharding.plan`); GTP then shards the
    local piece on another dim (``gtp_shard_dim`` metadata, default the first free dim).

    Args:
      module: any Flax NNX module (``nnx.Linear``, ``nnx.Einsum``, ``nnx.Embed``,
        ``nnx.LinearGeneral``... inside arbitrary user modules).
      mesh: a mesh containing ``config.axis`` (see `gtp_jax.make_mesh`).
      config: a `GTPConfig`; default ``GTPConfig()``.

    Returns:
      A `ShardedModule` computing the same function, or refusing the call (see its call
      contract). A variable or submodule that `module` shares with the model around it (a
      tied embedding) is refused here: the copy would untie it; shard the whole model.

    Raises:
      TypeError: `module`, `mesh` or `config` has the wrong type, or an include pattern
        selects a non-floating parameter.
      ValueError: the axis is not in the mesh, nothing is eligible to shard, or a variable
        or submodule of `module` is also held by the model around it (a tied weight, which
        the copy would untie; `gtp_jax.sharding.sharing`).

    Example:
      >>> mesh = gtp_jax.make_mesh(dp=2, gtp=4)                        # doctest: +SKIP
      >>> model = gtp_jax.shard(nnx.Linear(512, 512, rngs=nnx.Rngs(0)), mesh)  # doctest: +SKIP
    """
    config = GTPConfig() if config is None else config
    _validate_shard_args(module, mesh, config)
    check_not_shared(module)
    placement = plan_placement(module, mesh, config)
    # Validation is complete: from here on nothing can fail on user input.
    values = []
    for var, plan in zip(placement.variables, placement.plans):
        value = var.get_value()
        if plan is not None:
            values.append(_place(value, plan, mesh))
        elif hasattr(value, "shape"):
            values.append(jax.device_put(value, NamedSharding(mesh, P())))
        else:
            values.append(value)
    sharded = assemble(placement, values)
    record_sources(sharded, module)
    return sharded


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each variable of a module goes: what `shard` decides before it moves any data.

    Built by `plan_placement` from the module's variables' shapes, dtypes and metadata only,
    so a module from ``nnx.eval_shape`` (``jax.ShapeDtypeStruct`` values) plans the same as
    the real one.

    Attributes:
      graphdef: the module's ``nnx.GraphDef``.
      paths: ``/``-joined path of each variable, in ``nnx.split`` order.
      variables: the module's variables, in that order (their values are not read).
      var_tree: the treedef that `variables` unflatten with into the module's state.
      plans: per variable, its `ParamPlan` (GTP-sharded), `SplitPlan` (tp/ep split only) or
        None (replicated on the mesh).
      fp8_layers: the layers whose matmuls run in FP8 (`gtp_jax.sharding.fp8.fp8_layers`).
      mesh: the device mesh.
      config: the `GTPConfig`.
    """

    graphdef: Any
    paths: tuple[str, ...]
    variables: tuple[nnx.Variable, ...]
    var_tree: Any
    plans: tuple[ParamPlan | SplitPlan | None, ...]
    fp8_layers: tuple
    mesh: Mesh
    config: GTPConfig

    def shardings(self) -> list[NamedSharding | None]:
        """Per variable, the `NamedSharding` its stored value is placed with (None: a value
        that is not an array, kept as it is)."""
        out = []
        for var, plan in zip(self.variables, self.plans):
            value = var.get_value()
            if not hasattr(value, "shape") or not hasattr(value, "dtype"):
                out.append(None)
            elif plan is None:
                out.append(NamedSharding(self.mesh, P()))
            else:
                out.append(NamedSharding(self.mesh, plan.partition_spec(len(value.shape))))
        return out


def plan_placement(module: nnx.Module, mesh: Mesh, config: GTPConfig) -> Placement:
    """`shard`'s placement plan for `module` (validated arguments), without moving any data.

    Reads only each variable's shape, dtype and metadata, so `module` may be abstract
    (from ``nnx.eval_shape``). Raises what `shard` documents for an unshardable module.
    """
    graphdef, state = nnx.split(module)
    paths, variables, var_tree = _flat_variables(state)
    fp8.check_fp8_compute(config, mesh)
    fp8_layers = fp8.fp8_layers(module, config)
    # Kernels of FP8-compute layers gathered in fp8 feed their GEMMs as gathered.
    # A 1-wide axis gathers nothing: no gather format applies there (a format would only
    # round the weights and cost a quantize pass; FP8 GEMMs quantize their weights as with
    # unquantized gathers, which measured faster on one GPU).
    one_wide = mesh.shape[config.axis] == 1
    fp8_direct = (fp8.direct_kernels(module, fp8_layers)
                  if config.gather_format == "fp8" and not one_wide else {})
    plans: list[ParamPlan | SplitPlan | None] = []
    for path, var in zip(paths, variables):
        value = var.get_value()
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            plans.append(None)
            continue
        meta = var.get_metadata()
        stacked = bool(meta.get(STACKED, False)) and len(value.shape) >= 2
        plan = None
        if isinstance(var, nnx.Param):
            per_layer = tuple(int(d) for d in (value.shape[1:] if stacked else value.shape))
            splits = model_splits(path, per_layer, meta, mesh, config.axis)
            local = list(per_layer)
            for s in splits:
                local[s.dim] = s.local_size
            shard_dim = choose_shard_dim(path, tuple(local), meta, splits,
                                         align=config.alignment(mesh.shape[config.axis]))
            plan = plan_param(path, tuple(value.shape), np.dtype(value.dtype), stacked=stacked,
                              mesh=mesh, config=config, splits=splits, shard_dim=shard_dim)
            if plan is not None and meta.get(LOCAL) and not stacked:
                # Read as its own slice where the module can (never gathered there, so no
                # gather format rounds it); where it cannot, gathered in the gather dtype.
                plan = dataclasses.replace(plan, local=True, spec=dataclasses.replace(
                    plan.spec, gather_format=None))
            if plan is None and splits:
                plan = SplitPlan(path=path, stacked=stacked, splits=splits)
            elif plan is not None and path in fp8_direct and plan.spec.quantized and not splits:
                plan = dataclasses.replace(plan, spec=dataclasses.replace(
                    plan.spec, fp8_in_dims=fp8_direct[path]))
            elif plan is not None and plan.spec.quantized and (
                    one_wide or (config.fp8_compute is not None and path not in fp8_direct)):
                # Under FP8 compute the fp8 format is for the kernels the FP8 GEMMs read
                # as gathered; another weight (embedding, head, norms) would only be
                # rounded to e4m3, so it is gathered in the gather dtype.
                plan = dataclasses.replace(plan, spec=dataclasses.replace(
                    plan.spec, gather_format=None))
        elif any(k in meta for k in SPLIT_AXES) and any(
                mesh.shape.get(a, 1) > 1 for a in SPLIT_AXES.values()):
            raise TypeError(
                f"{path!r} is a {type(var).__name__} variable with tp/ep split metadata; only "
                "nnx.Param variables can be split. Remove the metadata.")
        elif config.include and any(re.search(p, path) for p in config.include):
            raise TypeError(
                f"GTPConfig.include selects {path!r}, a {type(var).__name__} variable; only "
                "nnx.Param variables can be sharded. Narrow the include pattern."
            )
        plans.append(plan)
    if not any(isinstance(p, (ParamPlan, SplitPlan)) for p in plans):
        raise UsageError(
            "gtp_jax.shard: no parameter of this module is eligible to shard (floating "
            f"nnx.Param of rank >= 2 with >= GTPConfig.min_elements={config.min_elements} "
            f"elements, include={config.include}, exclude={config.exclude}). Lower "
            "min_elements, widen include, or leave this module replicated."
        )
    if config.fp8_compute is not None and not fp8_layers:
        where = (f"matches GTPConfig.fp8_include={config.fp8_include}" if config.fp8_include
                 else "has both input and output features >= GTPConfig.fp8_min_features="
                 f"{config.fp8_min_features}")
        raise UsageError(
            f"gtp_jax.shard: GTPConfig.fp8_compute={config.fp8_compute!r}, but no layer "
            f"(nnx.Linear, nnx.LinearGeneral, nnx.Einsum) {where} outside fp8_exclude="
            f"{config.fp8_exclude}; lower fp8_min_features, set fp8_include, or use "
            "fp8_compute=None.")
    return Placement(graphdef=graphdef, paths=tuple(paths), variables=tuple(variables),
                     var_tree=var_tree, plans=tuple(plans), fp8_layers=tuple(fp8_layers),
                     mesh=mesh, config=config)


def assemble(placement: Placement, values: Sequence[Any]) -> ShardedModule:
    """The `ShardedModule` whose variables hold `values` (one per ``placement.variables``,
    already in their stored layout and placed with ``placement.shardings()``), with the
    metadata `shard` records (logical shape, split layout) and FP8 injection."""
    new_vars = []
    for var, plan, placed in zip(placement.variables, placement.plans, values):
        new_var = var.replace(value=placed)
        if plan is not None:
            new_var.set_metadata(LOGICAL_SHAPE, tuple(int(d) for d in var.get_value().shape))
            if plan.splits:
                new_var.set_metadata(SPLIT_LAYOUT, tuple(
                    (s.axis, s.axis_size, s.dim + int(plan.stacked), s.parts)
                    for s in plan.splits))
        new_vars.append(new_var)
    inner = nnx.merge(placement.graphdef, jax.tree.unflatten(placement.var_tree, new_vars))
    plans = placement.plans
    return ShardedModule(inner, mesh=placement.mesh, config=placement.config,
                         plan=tuple(p for p in plans if isinstance(p, ParamPlan)),
                         split_plan=tuple(p for p in plans if isinstance(p, SplitPlan)),
                         fp8_layers=fp8.inject(inner, list(placement.fp8_layers),
                                               placement.config, placement.mesh))


def hold_params_in(model: ShardedModule, dtype: Any, wrt: Any = nnx.Param, *,
                   sources: Sequence[jax.Array] | None = None) -> None:
    """Casts `model`'s floating-point `wrt` variables to `dtype` in place and records `dtype`
    as the stored dtype of its GTP-sharded ones (``GatherSpec.param_dtype``), so their
    gradients come back reduce-scattered in ``reduce_dtype`` and then cast to `dtype`, like
    every other parameter's gradient. Used for master weights held elsewhere
    (`GTPConfig.offload_master_weights`).

    Without `sources` each variable is cast where it is, one at a time (the device holds
    at most one variable twice). With `sources` (arrays of the variables' shapes, in
    ``nnx.state(model, wrt)`` leaf order, e.g. float32 master copies in host memory) every
    variable's old value is released first and the new ones are then cast from the
    sources: the new arrays are allocated one after the other in memory the old ones
    freed, with nothing of the old left between them (casting in place leaves each new
    array between the old ones, and once those are freed the device's free memory is in
    pieces: on one H100 the llama3-8b step's 32.5 GiB of temporaries then found no
    contiguous block in 46 GiB free).

    Args:
      model: a `gtp_jax.shard`-ed module (its mesh and shardings are kept).
      dtype: a floating-point dtype, e.g. ``jnp.bfloat16``.
      wrt: an NNX filter of the variables to cast (default: the parameters).
      sources: optional values to cast from (see above); each is placed with its
        variable's sharding in device memory.

    Raises:
      UsageError: `sources` does not match the variables in number or shapes (checked
        before anything changes).
      RuntimeError: a cast from `sources` failed part way (e.g. out of device memory); the
        variables not cast yet hold empty arrays, and the message says so.
    """
    dtype = jnp.dtype(dtype)
    # The model's own Variables (to change in place), in nnx.state(model, wrt) leaf order.
    by_path = {tuple(path): node for path, node in nnx.iter_graph(model)
               if isinstance(node, nnx.Variable)}
    nodes = [by_path[tuple(path)] for path, _ in nnx.to_flat_state(nnx.state(model, wrt))]
    if sources is not None:
        sources = list(sources)
        if len(sources) != len(nodes) or any(
                tuple(src.shape) != tuple(node.get_value().shape)
                for src, node in zip(sources, nodes)):
            raise UsageError(f"hold_params_in: {len(sources)} sources for {len(nodes)} "
                             "variables, or shapes that differ; pass one array per variable "
                             "of nnx.state(model, wrt), in its leaf order.")
        targets = [(node, src, node.get_value().sharding) for node, src in zip(nodes, sources)
                   if jnp.issubdtype(node.get_value().dtype, jnp.floating)]
        for node, _, _ in targets:  # release every old value before the first new one
            node.set_value(jnp.zeros((0,), dtype))
        for done, (node, src, sharding) in enumerate(targets):
            device = sharding.with_memory_kind("device") \
                if isinstance(sharding, NamedSharding) else sharding
            try:
                node.set_value(jax.block_until_ready(_cast_program(dtype, device)(src)))
            except Exception as err:  # e.g. out of device memory part way
                first = (str(err).strip().splitlines() or [type(err).__name__])[0]
                raise RuntimeError(
                    f"hold_params_in: casting variable {done + 1} of {len(targets)} from its "
                    f"source failed ({first[:300]}). Every variable's old value had been "
                    f"released to make room, so the {len(targets) - done} not cast hold "
                    "empty arrays and the model cannot be used: build it again (the values "
                    "live on in the sources, e.g. the optimizer's master weights) with more "
                    "free device memory.") from err
    else:
        for node in nodes:
            if jnp.issubdtype(node.get_value().dtype, jnp.floating):
                node.set_value(node.get_value().astype(dtype))
    model.plan = tuple(dataclasses.replace(p, spec=dataclasses.replace(p.spec, param_dtype=dtype))
                       for p in model.plan)


def unshard(module: ShardedModule) -> nnx.Module:
    """Returns the wrapped module with full (unpadded, replicated) weights.

    ``unshard(shard(m, mesh, cfg))`` has exactly the parameters of ``m``. Use it for export
    or to compare against an unsharded reference. The sharded module is not modified.
    """
    if not isinstance(module, ShardedModule):
        raise TypeError(
            f"gtp_jax.unshard expects a module returned by gtp_jax.shard, got "
            f"{type(module).__name__}."
        )
    placements = module.placements()
    graphdef, state = nnx.split(module.module)
    paths, variables, var_tree = _flat_variables(state)
    new_vars = []
    for path, var in zip(paths, variables):
        if path not in placements:
            new_vars.append(var.replace(value=var.get_value()))
            continue
        full = _from_stored(placements[path], NamedSharding(module.mesh, P()))(var.get_value())
        new_var = var.replace(value=full)
        new_var.del_metadata(LOGICAL_SHAPE)
        if SPLIT_LAYOUT in new_var.get_metadata():
            new_var.del_metadata(SPLIT_LAYOUT)
        new_vars.append(new_var)
    full_module = nnx.merge(graphdef, jax.tree.unflatten(var_tree, new_vars))
    fp8.restore(full_module, module.fp8_layers)  # the module's own matmuls again
    return full_module


def unshard_values(module: ShardedModule, tree: Any) -> dict[str, jax.Array]:
    """Full logical (unpadded, unpermuted, replicated) arrays of a state shaped like the params.

    Args:
      module: the `ShardedModule`.
      tree: its params, or a gradient / optimizer-moment state of the same structure (an
        ``nnx.State`` or the module itself); paths may carry the leading ``module`` key.

    Returns:
      ``{path: array}`` with paths relative to the wrapped module (``"blocks/attn/..."``).
    """
    if not isinstance(module, ShardedModule):
        raise TypeError(f"unshard_values expects a ShardedModule, got {type(module).__name__}.")
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, nnx.Param)
    placements = module.placements()
    replicated = NamedSharding(module.mesh, P())
    out = {}
    for keys, value in nnx.to_flat_state(tree):
        keys = tuple(keys)
        if keys and keys[0] == "module":
            keys = keys[1:]
        path = path_str(keys)
        value = value.get_value() if isinstance(value, nnx.Variable) else value
        plan = placements.get(path)
        out[path] = value if plan is None else _from_stored(plan, replicated)(value)
    return out


def _refuse_coincident_outputs(sharded_out: Any, graphdef: Any, variables: list[nnx.Variable],
                               var_tree: Any, values: list[Any], args: tuple, kwargs: dict,
                               batch: int, local_batch: int) -> None:
    """An output whose leading dim equals the examples per data shard passes the shape check
    as per-example whatever it is (at one example per shard ``sum(0, keepdims=True)`` or a
    transposed column; at two, ``jnp.stack([h.sum(0), h.max(0)])``): refuses an output whose
    shape over the whole batch (the shards' rows concatenated) is not the unsharded module's
    on the same batch, traced abstractly on the weights' logical shapes. A module the
    unsharded trace cannot run (tensor-parallel collectives, FP8 amax reductions) is not
    checked here; `gtp_jax.check_sharded` compares it on a real batch."""
    def plain(vals: list, call_args: tuple, call_kwargs: dict) -> Any:
        module = nnx.merge(graphdef, jax.tree.unflatten(
            var_tree, [v.replace(value=x) for v, x in zip(variables, vals)]))
        return module(*call_args, **call_kwargs)

    logical = [jax.ShapeDtypeStruct(tuple(v.get_metadata().get(LOGICAL_SHAPE) or np.shape(x)),
                                    x.dtype) for v, x in zip(variables, values)]
    try:
        want = jax.eval_shape(plain, logical, args, kwargs)
    except Exception:  # noqa: BLE001 - not runnable unsharded: not checked here (docstring)
        return
    got_leaves, got_tree = jax.tree.flatten(sharded_out)
    want_leaves, want_tree = jax.tree.flatten(want)
    if got_tree != want_tree:
        return
    for i, (got, exp) in enumerate(zip(got_leaves, want_leaves)):
        if tuple(got.shape) != tuple(exp.shape):
            raise UsageError(
                f"gtp_jax.ShardedModule: output {i} has {local_batch} row(s) on each data shard, "
                f"as many as its examples, so {tuple(got.shape)} over the batch of {batch}, "
                f"but the unsharded module returns {tuple(exp.shape)}: it is not "
                "per-example (a reduction or transpose over the batch?). Return per-example "
                "rows and reduce them outside the module, or declare the output's layout "
                "(gtp_output_layout).")


def _refuse_decode_caches(paths: list[str], variables: list[nnx.Variable],
                          rules: dict[str, str | None]) -> None:
    """Refuses Flax's decode cache (``nnx.Cache``, e.g. ``MultiHeadAttention(decode=True)``)
    without a combining rule, before the call: it holds whole-batch rows that every data
    shard would read with its own rows (Flax's own shape error, or worse, otherwise)."""
    for path, var in zip(paths, variables):
        if isinstance(var, nnx.Cache) and rules.get(path) is None:
            raise UsageError(
                f"{path!r}: Flax's decode cache (nnx.Cache) holds the whole batch's rows, and "
                "a sharded call splits the batch over the data axes; decode with the "
                "unsharded module (gtp_jax.unshard), or keep the cache in gtp_jax variable "
                "types (PerExample for the keys and values, SameOnEveryShard for the index).")


def check_stored_layout(model: nnx.Module, where: str) -> None:
    """`_check_stored_layout` of every `ShardedModule` in `model` (itself included): for a
    step built on concrete values, before it splits them."""
    for _, node in nnx.graph.iter_graph(model):
        if isinstance(node, ShardedModule):
            placed = node.placements()
            paths, variables, _ = _flat_variables(nnx.state(node.module))
            values = [v.get_value() for v in variables]
            _check_stored_layout(paths, variables, values, _stored_specs(placed, paths, values),
                                 node.mesh, frozenset(placed), where)


def _stored_specs(placed: dict[str, ParamPlan | SplitPlan], paths: list[str],
                  values: list[Any]) -> list[P]:
    """The partition spec each variable is stored with: its plan's (`placed`, by path), or
    replicated."""
    return [placed[p].partition_spec(np.ndim(x)) if p in placed else P()
            for p, x in zip(paths, values)]


def _check_stored_layout(paths: list[str], variables: list[nnx.Variable], values: list[Any],
                         specs: list[P], mesh: Mesh, placed: frozenset[str],
                         where: str = "gtp_jax.ShardedModule") -> None:
    """Refuses a stored weight that is not in its sharded layout: a value written in after
    `shard` (say unsharded weights by ``nnx.update``). Its Variable: without the logical
    shape `shard` records (``nnx.update`` with another module's Variables replaces their
    metadata), seen under a trace too; its shape: a split dim its mesh axes do not divide (a
    padded dim holding the logical size); a concrete array (not a traced one): a sharding
    other than its split (its memory would be the unsharded one's, and a tp/ep-split
    weight's parts would be read in the wrong order)."""
    fix = ("a value of another layout was written in after gtp_jax.shard (nnx.update with "
           "unsharded weights?). Load weights into the plain module and shard it then, or "
           "read them out with gtp_jax.unshard.")
    for path, var, value, spec in zip(paths, variables, values, specs):
        if path not in placed:
            continue
        shape = np.shape(value)
        for dim, entry in enumerate(tuple(spec)[:len(shape)]):
            names = (entry,) if isinstance(entry, str) else tuple(entry or ())
            size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
            if size > 1 and shape[dim] % size:
                raise UsageError(
                    f"{where}: the weight {path!r} has shape {tuple(shape)}, but its dim "
                    f"{dim} is split over {'x'.join(names)} ({size} devices) in the sharded "
                    f"layout: {fix}")
        if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
            expected = NamedSharding(mesh, spec, memory_kind=value.sharding.memory_kind)
            if not value.sharding.is_equivalent_to(expected, len(shape)):
                raise UsageError(
                    f"{where}: the weight {path!r} is not stored split as {spec} on the "
                    f"mesh (its sharding: {type(value.sharding).__name__}): {fix}")
        if LOGICAL_SHAPE not in var.get_metadata():
            raise UsageError(
                f"{where}: the weight {path!r} lost the layout metadata gtp_jax.shard gave "
                f"it: {fix}")


def _explicit(mesh: Mesh) -> bool:
    """Whether `mesh` has an axis of type Explicit (sharding in types)."""
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ()) or ())


def _place(value: jax.Array, plan: ParamPlan | SplitPlan, mesh: Mesh) -> jax.Array:
    sharding = NamedSharding(mesh, plan.partition_spec(np.ndim(value)))
    return _to_stored(plan, sharding)(value)


@functools.lru_cache(maxsize=256)
def _cast_program(dtype: Any, sharding: Any):
    """``x.astype(dtype)`` jitted with an output sharding: one program per (dtype,
    sharding), shared by every variable of a shape (a fresh function per variable was traced
    and lowered again for each)."""
    return jax.jit(lambda x: x.astype(dtype), out_shardings=sharding)


def _to_stored(plan: ParamPlan | SplitPlan, sharding: NamedSharding):
    """`plan.to_stored` jitted with an output sharding, so each device only ever
    materializes its own shard."""
    return _layout_program("to_stored", _layout_of(plan), sharding)


def _from_stored(plan: ParamPlan | SplitPlan, sharding: NamedSharding):
    """`plan.from_stored` jitted with an output sharding."""
    return _layout_program("from_stored", _layout_of(plan), sharding)


def _layout_of(plan: ParamPlan | SplitPlan) -> ParamPlan | SplitPlan:
    """`plan` without its path: the layout change depends only on the shapes, splits and
    padding, so the weights of one shape (every block of a Python loop of blocks) share
    one traced and compiled program instead of one each."""
    return dataclasses.replace(plan, path="")


@functools.cache
def _layout_program(direction: str, layout: ParamPlan | SplitPlan, sharding: NamedSharding):
    if layout.stored_as_is:
        # Only the sharding changes: a copy into it, with no program of its own to compile
        # (one per weight shape and sharding otherwise). A copy, never the same buffer: a
        # step that donates the sharded weights must leave the module they came from intact.
        return functools.partial(jax.device_put, device=sharding, may_alias=False)
    convert = getattr(layout, direction)
    if direction == "from_stored" and _explicit(sharding.mesh):
        # On Explicit axes the unpadding slice of a split dim has no sharding of its own:
        # the stored array is gathered first (the result is the whole array anyway).
        def convert(x: jax.Array, layout_from_stored: Callable = convert) -> jax.Array:
            return layout_from_stored(jax.sharding.reshard(x, NamedSharding(sharding.mesh,
                                                                            P())))
    return jax.jit(convert, out_shardings=sharding)


def _validate_shard_args(module: Any, mesh: Any, config: Any) -> None:
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"gtp_jax.shard: module must be a flax.nnx.Module, got {type(module).__name__}."
        )
    if isinstance(module, ShardedModule):
        raise UsageError("gtp_jax.shard: this module is already sharded; pass the original "
                         "module, or gtp_jax.unshard(module) first.")
    for keys, node in nnx.graph.iter_graph(module):
        if isinstance(node, ShardedModule) and node is not module:
            path = path_str(k for k in keys if not str(k).startswith("_pytree__"))
            raise UsageError(
                f"gtp_jax.shard: the module contains an already sharded module at {path!r}; "
                "shard the outer module once, built from plain (unsharded) submodules, or "
                f"replace it with gtp_jax.unshard(...) first.")
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"gtp_jax.shard: mesh must be a jax.sharding.Mesh (see gtp_jax.make_mesh), got "
            f"{type(mesh).__name__}."
        )
    if not isinstance(config, GTPConfig):
        raise TypeError(
            f"gtp_jax.shard: config must be a gtp_jax.GTPConfig, got {type(config).__name__}."
        )
    check_axis(mesh, config.axis, "GTPConfig.axis")


def bytes_per_device(tree: Any, device: jax.Device | None = None) -> int:
    """Bytes that `device` (default: the first addressable one) holds for the arrays in `tree`.

    Counts each array's addressable shard on that device, so a 1/N-sharded weight counts
    1/N (+ padding) and a replicated one counts in full. Accepts modules, states and pytrees.
    """
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    total = 0
    for x in jax.tree.leaves(tree):
        if not isinstance(x, jax.Array):
            continue
        shards = x.addressable_shards
        target = device if device is not None else shards[0].device
        total += sum(s.data.nbytes for s in shards if s.device == target)
    return total


__all__: Sequence[str] = ("InputLayout", "OutputLayout", "REDUCE", "Replicated",
                          "ShardedModule", "replicated", "shard", "unshard",
                          "unshard_values", "bytes_per_device")
