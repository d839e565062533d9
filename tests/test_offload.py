"""Optimizer state in host memory (`GTPConfig.offload_optimizer`): the same training, the
state built and restored in host memory, and streamed to the device one leaf (default) or
one layer group at a time.

The CPU backend has a ``pinned_host`` memory kind, so the offloaded step runs the same code
path as on GPUs (state placed in host memory, copied to the device per unit and back);
there host and device memory are the same RAM, and its memory analysis counts both, so the
memory bound is checked on the structure of the traced step instead: every copy to the
device is one layer group's slice, and the copies are ordered so that at most two units'
updates can be in flight at once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gtp_jax
from gtp_jax.base.errors import UsageError
from gtp_jax.base.metadata import STACKED
from gtp_jax.models import lm_loss
from gtp_jax.sharding.offload import (
    HOST_MEMORY_KIND,
    HostGroups,
    check_pinned_pool,
    group_moments,
    host_bytes_per_device,
    host_memory_supported,
    init_streamed_on_host,
    join_groups,
    stream_units,
    streamable_chain,
    streaming_compiler_options,
    supported_compiler_options,
)
from gtp_jax.train import TrainConfig
from gtp_jax.train.config import make_optimizer
from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig, Checkpointer
from gtp_jax.train.loop import build_model_and_optimizer
from gtp_jax.train.step.train_step import (
    TrainStep,
    group_offloaded,
    make_nnx_optimizer,
    step_program,
)

CFG = TrainConfig(preset="tiny", batch_size=8, seq_len=32, dp=2, gtp=4, steps=3, warmup=1)
LOSS = functools.partial(lm_loss, aux_weight=0.0)


#: Partial offload: these parameters' moments stay on the device (a layer-stacked weight
#: and a whole one), the others are streamed.
KEEP = ("mlp/down", "lm_head")


def _run(offload: bool, group: int | None = None, keep: tuple[str, ...] = (),
         sync_each: bool = False) -> tuple[list[np.ndarray], list[np.ndarray], TrainStep]:
    cfg = dataclasses.replace(CFG, offload_optimizer=offload, offload_exclude=keep)
    model, optimizer = build_model_and_optimizer(cfg)
    step = TrainStep(model, optimizer, LOSS, offload_group_layers=group)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(cfg.steps):
        tokens = rng.integers(0, 256, (cfg.batch_size, cfg.seq_len + 1), dtype=np.int32)
        losses.append(np.asarray(step(tokens)["loss"]))
        if sync_each:  # as before each checkpoint: joined, then grouped again to train on
            step.sync()
    step.sync()
    leaves = [np.asarray(x) for x in jax.tree.leaves(nnx.state(step.objects))]
    return losses, leaves, step


def test_offloaded_optimizer_state_trains_bit_identically():
    assert host_memory_supported()
    ref_losses, ref_state, _ = _run(False)
    # None: one layer per streamed unit (the default); 3 layers per unit of the tiny
    # preset's 4: a full group and a remainder of one layer.
    for group in (None, 3):
        _check_bit_identical(_run(True, group=group), ref_losses, ref_state)
    _check_bit_identical(_run(True, group=3, sync_each=True), ref_losses, ref_state)
    # Partial offload: the kept moments are updated on the device, the others streamed.
    _check_bit_identical(_run(True, keep=KEEP), ref_losses, ref_state, keep=KEEP)


def _check_bit_identical(run: tuple, ref_losses: list, ref_state: list,
                         keep: tuple[str, ...] = ()) -> None:
    losses, state, step = run
    # Same arithmetic on the device; the moments only travel: bit-identical, no tolerance.
    assert [float(x) for x in losses] == [float(x) for x in ref_losses]
    assert len(state) == len(ref_state)
    for a, b in zip(state, ref_state):
        np.testing.assert_array_equal(a, b)
    # The optimizer state stays in host memory across steps (but the moments of the kept
    # parameters, on the device); the parameters do not.
    _check_memory_kinds(step.objects[1], keep)
    params = nnx.state(step.objects[0], nnx.Param)
    assert HOST_MEMORY_KIND not in {x.sharding.memory_kind for x in jax.tree.leaves(params)}


def _check_memory_kinds(optimizer: nnx.Optimizer, keep: tuple[str, ...]) -> None:
    """Every optimizer state leaf in host memory but the moments of the parameters whose
    path matches `keep`, in device memory; `keep` matches some."""
    kinds = {"/".join(map(str, p)): v.get_value().sharding.memory_kind
             for p, v in nnx.to_flat_state(nnx.state(optimizer, nnx.OptState))}
    kept = {p for p in kinds if any(k in p for k in keep)}
    assert len(kept) == 2 * len(keep)  # AdamW's mu and nu of each
    assert {kinds[p] for p in kept} <= {"device"}
    assert {kinds[p] for p in kinds if p not in kept} == {HOST_MEMORY_KIND}


def _traced_step(group: int | None, layout: str = "grouped"
                 ) -> tuple[list, list[tuple[int, ...]], list]:
    """The traced offloaded step's equations (inside its jit), the shapes of the
    layer-stacked parameters, and the jaxpr's input variables. `layout`: ``"grouped"``, the
    state as `TrainStep` trains it (`group_offloaded`: one host array per layer group), or
    ``"stacked"``, as it is stored (one host buffer per stacked moment)."""
    # 4 layers: groups of 2 make more than one unit of layers.
    cfg = dataclasses.replace(CFG, offload_optimizer=True, layers=4)
    model, optimizer = build_model_and_optimizer(cfg)
    step = TrainStep(model, optimizer, LOSS, offload_group_layers=group)
    stacked = [tuple(v.get_value().shape) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
               if v.get_metadata().get(STACKED)]
    tokens = np.zeros((cfg.batch_size, cfg.seq_len + 1), np.int32)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                         step.state)  # stacked until the first step
    if layout == "grouped":  # as the first step groups it
        state = group_offloaded(step.graphdef, state, 1 if group is None else group)
    outer = jax.make_jaxpr(step_program(step.graphdef, LOSS, offload=True,
                                        offload_group_layers=group))(state, tokens)
    (call,) = [e for e in outer.jaxpr.eqns if "jaxpr" in e.params]
    inner = call.params["jaxpr"].jaxpr
    return inner.eqns, stacked, inner.invars


def _ancestors(eqns: list) -> tuple[dict, list[set[int]]]:
    """Each equation's producer map and ancestors in the data flow (nested calls opaque)."""
    producer = {v: n for n, e in enumerate(eqns) for v in e.outvars}
    ancestors: list[set[int]] = []
    for e in eqns:
        deps: set[int] = set()
        for v in e.invars:
            if not hasattr(v, "val") and v in producer:  # a variable, not a literal
                deps |= {producer[v]} | ancestors[producer[v]]
        ancestors.append(deps)
    return producer, ancestors


def _to(e: object, space: str) -> bool:
    return e.primitive.name == "device_put" and str(e.params["devices"][0]).endswith(space)


@pytest.mark.parametrize("group", [None, 2])
@pytest.mark.parametrize("layout", ["grouped", "stacked"])
def test_offloaded_step_copies_moments_per_layer_group_in_order(group, layout):
    eqns, stacked, invars = _traced_step(group, layout)
    producer, ancestors = _ancestors(eqns)
    size = 1 if group is None else group  # None: the default, one layer per unit
    ins = [n for n, e in enumerate(eqns) if _to(e, "Device") and e.outvars[0].aval.shape]
    shapes = [tuple(eqns[n].outvars[0].aval.shape) for n in ins]
    # No copy to the device holds a whole layer-stacked moment: a group's slice at a time.
    assert not set(stacked) & set(shapes)
    assert {(size, *s[1:]) for s in stacked} <= set(shapes)
    barriers = {n for n, e in enumerate(eqns) if e.primitive.name == "optimization_barrier"}
    units: dict[int, list[int]] = {}
    for n in ins:  # a copy's unit: the latest barrier it descends from (its own)
        units.setdefault(max(ancestors[n] & barriers, default=-1), []).append(n)
    # One unit per other weight (embedding, final norm, head), then one per group of the 4
    # layers: its 2 moments of each stacked weight.
    assert sorted(len(u) for u in units.values()) == (
        [2, 2, 2] + [2 * len(stacked)] * (4 // size))
    _assert_at_most_two_units_in_flight(list(units.values()), ancestors)
    group_shapes = {(size, *s[1:]) for s in stacked}
    if layout == "grouped":
        # Whole-array copies (DMA transfers): each group's moments come in as an input host
        # array through its unit's barrier, and go out as a new host array.
        for n in ins:
            if eqns[n].outvars[0].aval.shape in group_shapes:
                src = eqns[producer[eqns[n].invars[0]]]
                assert src.primitive.name == "optimization_barrier"
                assert src.invars[src.outvars.index(eqns[n].invars[0])] in invars
        outs = [n for n, e in enumerate(eqns) if _to(e, "Host")
                and e.outvars[0].aval.shape in group_shapes]
        assert len(outs) == 2 * len(stacked) * (4 // size)
        # and no slice of a host buffer is written in place.
        assert not [e for e in eqns if e.primitive.name == "dynamic_update_slice"
                    and e.invars[1] in producer and _to(eqns[producer[e.invars[1]]], "Host")]
        return

    # Partial copies: each stacked slice comes in as a dynamic slice of a host buffer whose
    # start index came through an optimization barrier (XLA cannot fold it into a static
    # slice, which may copy the whole buffer).
    for n in ins:
        if eqns[n].outvars[0].aval.shape in group_shapes:
            src = eqns[producer[eqns[n].invars[0]]]
            assert src.primitive.name == "dynamic_slice"
            buf, start = src.invars[:2]  # the layer index; the other dims' starts are 0
            assert all(eqns[producer[v]].primitive.name == "optimization_barrier"
                       for v in (buf, start))
    # Written back in place: each moment slice goes to the host with a dynamic update slice
    # into the donated input buffer (a chain through barriers and earlier writes, no new
    # buffer), and every other read of a buffer version precedes the write that replaces it.
    writes = [n for n, e in enumerate(eqns) if e.primitive.name == "dynamic_update_slice"
              and e.invars[1] in producer and _to(eqns[producer[e.invars[1]]], "Host")]
    assert len(writes) == 2 * len(stacked) * (4 // size)
    users: dict = {}
    for n, e in enumerate(eqns):
        for v in e.invars:
            if not hasattr(v, "val"):
                users.setdefault(v, []).append(n)
    for n in writes:
        v, replaced = eqns[n].invars[0], True
        while True:  # back through barriers (same buffer) and earlier writes to the input
            if replaced:  # this version's readers all come before the write
                assert all(u == n or u in ancestors[n] for u in users[v]), "read after write"
            if v not in producer:
                break
            e = eqns[producer[v]]
            assert e.primitive.name in {"optimization_barrier", "dynamic_update_slice"}
            if e.primitive.name == "dynamic_update_slice":
                v, replaced = e.invars[0], False
            else:
                v = e.invars[e.outvars.index(v)]
        assert v in invars


def _assert_at_most_two_units_in_flight(units: list[list[int]],
                                        ancestors: list[set[int]]) -> None:
    def ordered(a: list[int], b: list[int]) -> bool:  # one unit's copy waits for the other
        return any(x in ancestors[y] for x in a for y in b) or any(
            y in ancestors[x] for x in a for y in b)

    # Bounded residency, whatever the schedule: no three units are mutually unordered (each
    # copy waits for the update of the unit two back), so at most two units' moments are
    # being updated at once, not all of them.
    for i, a in enumerate(units):
        for j, b in enumerate(units[i + 1:], i + 1):
            for c in units[j + 1:]:
                assert ordered(a, b) or ordered(a, c) or ordered(b, c), (i, j)


def test_grouped_moments_split_and_join_exactly_in_host_memory():
    # One host array per layer group (3 + 1 layers of 4), the same values, the stacked
    # leaf's sharding; joined back, the stacked arrays bit for bit; a split or joined array
    # is deleted (the host holds one leaf twice at most); abstract leaves give abstract groups.
    mesh = jax.make_mesh((8,), ("gtp",))
    host = NamedSharding(mesh, P(None, "gtp"), memory_kind=HOST_MEMORY_KIND)
    values = np.random.default_rng(3).normal(size=(4, 16)).astype(np.float32)
    params = {"w": jax.device_put(values, host.with_memory_kind("device")),
              "b": jax.device_put(values[0], NamedSharding(mesh, P("gtp")))}
    mu = {"w": jax.device_put(values, host), "b": jax.device_put(values[0] * 2, NamedSharding(
        mesh, P("gtp"), memory_kind=HOST_MEMORY_KIND))}
    state = ((), ({"count": jnp.int32(1)}, mu))
    stacked = {"w": True, "b": False}
    mu_w = mu["w"]
    grouped = group_moments(state, params, stacked, 3)
    groups = grouped[1][1]["w"]
    assert isinstance(groups, HostGroups) and groups.shape == (4, 16)
    assert [g.shape for g in groups.groups] == [(3, 16), (1, 16)]
    assert {g.sharding.memory_kind for g in groups.groups} == {HOST_MEMORY_KIND}
    np.testing.assert_array_equal(np.concatenate([np.asarray(g) for g in groups.groups]),
                                  values)
    assert mu_w.is_deleted()
    assert grouped[1][1]["b"] is mu["b"]  # not stacked: untouched
    joined = join_groups(grouped)
    assert joined[1][1]["w"].sharding == host
    np.testing.assert_array_equal(np.asarray(joined[1][1]["w"]), values)
    assert all(g.is_deleted() for g in groups.groups)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), joined)
    groups = group_moments(abstract, params, stacked, 3)[1][1]["w"]
    assert [(g.shape, g.sharding) for g in groups.groups] == [((3, 16), host), ((1, 16), host)]
    assert join_groups(groups) == abstract[1][1]["w"]


def test_streaming_compiler_options_are_dropped_where_xla_does_not_know_them():
    # On a GPU the offloaded step asks XLA for more transfers in flight; an XLA without the
    # option compiles the step as before instead of failing, and other backends get none.
    assert supported_compiler_options({"xla_gtp_jax_no_such_option": 1}) == {}
    assert streaming_compiler_options() == {}  # the tests' CPU backend


@pytest.mark.parametrize("keep", [(), KEEP], ids=["all", "partial"])
def test_offloaded_optimizer_state_is_built_and_restored_in_host_memory(tmp_path, keep):
    cfg = dataclasses.replace(CFG, offload_optimizer=True, offload_exclude=keep)
    model, optimizer = build_model_and_optimizer(cfg)

    def opt_values(opt: nnx.Optimizer) -> list:
        return [v.get_value() for _, v in nnx.to_flat_state(nnx.state(opt, nnx.OptState))]

    # Built in host memory (no device copy of the moments first; the kept ones straight
    # into device memory), with the shardings and values nnx.Optimizer builds on the
    # device: the same zeros and counters.
    built = opt_values(optimizer)
    _check_memory_kinds(optimizer, keep)
    assert optimizer.tx is make_optimizer(cfg)
    reference = opt_values(nnx.Optimizer(model, optimizer.tx, wrt=nnx.Param))
    assert len(built) == len(reference)
    for a, b in zip(built, reference):
        if a.ndim:  # the moments: the parameters' shardings (scalars: replicated)
            assert a.sharding.with_memory_kind("device").is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    step = TrainStep(model, optimizer, LOSS)
    tokens = np.random.default_rng(0).integers(0, 256, (cfg.batch_size, cfg.seq_len + 1),
                                               dtype=np.int32)
    step(tokens)
    step.sync()
    trained = [np.asarray(x) for x in opt_values(optimizer)]
    # A resume may keep other moments on the device (offload_exclude only places them): it
    # restores into the new placement, the kept ones straight into device memory and the
    # others into host memory, bit for bit.
    other = () if keep else KEEP
    with Checkpointer(CheckpointConfig(str(tmp_path), async_save=False)) as ckpt:
        ckpt.save(1, model, optimizer)
        fresh_model, fresh_opt = build_model_and_optimizer(
            dataclasses.replace(cfg, offload_exclude=other))
        ckpt.restore(fresh_model, fresh_opt)
    restored = opt_values(fresh_opt)
    _check_memory_kinds(fresh_opt, other)
    for a, b in zip(restored, trained):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_a_state_over_the_pinned_host_pool_is_refused_before_it_is_built():
    mesh = gtp_jax.make_mesh(gtp=8)
    abstract = {"mu": jax.ShapeDtypeStruct((8, 16), np.float32),
                "count": jax.ShapeDtypeStruct((), np.int32)}
    shardings = {"mu": NamedSharding(mesh, P("gtp", None), memory_kind=HOST_MEMORY_KIND),
                 "count": NamedSharding(mesh, P(), memory_kind=HOST_MEMORY_KIND)}
    need = 16 * 4 + 4  # one row of mu per device, and the replicated count
    assert host_bytes_per_device(abstract, shardings) == need
    check_pinned_pool(abstract, shardings, platform="gpu", pool_bytes=need)
    with pytest.raises(UsageError, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=1 "):
        check_pinned_pool(abstract, shardings, platform="gpu", pool_bytes=need - 1)
    check_pinned_pool(abstract, shardings, pool_bytes=0)  # CPU devices: no pool to fit


def test_offload_group_layers_is_validated():
    with pytest.raises(UsageError, match="group_layers"):
        stream_units({}, {}, 0)
    units = stream_units({"a": np.zeros((5, 2)), "b": np.zeros(3)},
                         {"a": True, "b": False}, 2)
    assert units == [[(1, None)], [(0, (0, 2))], [(0, (2, 4))], [(0, (4, 5))]]
    # Leaves whose state stays on the device belong to no unit.
    assert stream_units({"a": np.zeros((5, 2)), "b": np.zeros(3)}, {"a": True, "b": False},
                        2, {"a": False, "b": True}) == [[(0, (0, 2))], [(0, (2, 4))],
                                                        [(0, (4, 5))]]
    assert stream_units({"a": np.zeros((5, 2)), "b": np.zeros(3)}, {"a": True, "b": False},
                        2, {"a": True, "b": False}) == [[(1, None)]]


def test_partial_offload_of_any_optax_optimizer_trains_like_the_device():
    # An optimizer that is not a streamable_chain is copied whole to the device for the
    # update; with offload_exclude the kept moments stay there and only the others go back.
    def run(offload: bool) -> tuple[list[float], list[np.ndarray], nnx.Optimizer]:
        cfg = dataclasses.replace(CFG, offload_optimizer=offload,
                                  offload_exclude=KEEP if offload else ())
        model, _ = build_model_and_optimizer(cfg)
        optimizer = make_nnx_optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        step = TrainStep(model, optimizer, LOSS)
        rng = np.random.default_rng(0)
        losses = [float(step(rng.integers(0, 256, (cfg.batch_size, cfg.seq_len + 1),
                                         dtype=np.int32))["loss"]) for _ in range(2)]
        step.sync()
        return losses, [np.asarray(x) for x in jax.tree.leaves(nnx.state(step.objects))], \
            optimizer

    ref_losses, ref_state, _ = run(False)
    losses, state, optimizer = run(True)
    assert losses == ref_losses
    for a, b in zip(state, ref_state):
        np.testing.assert_array_equal(a, b)
    _check_memory_kinds(optimizer, KEEP)


def test_per_parameter_state_not_of_the_parameters_shape_is_placed_whole_or_refused():
    """``optax.zero_nans`` keeps one flag per parameter: a plain chain's state is copied
    whole and trains as on the device; a streamable chain cannot cut it into layer groups
    and is refused by name before anything is built."""
    plain = optax.chain(optax.zero_nans(), optax.adamw(1e-3))

    def run(offload: bool) -> tuple[float, list[np.ndarray]]:
        model, _ = build_model_and_optimizer(dataclasses.replace(CFG, offload_optimizer=offload))
        step = TrainStep(model, make_nnx_optimizer(model, plain, wrt=nnx.Param), LOSS)
        tokens = np.random.default_rng(0).integers(0, 256, (CFG.batch_size, CFG.seq_len + 1),
                                                   dtype=np.int32)
        loss = float(step(tokens)["loss"])
        step.sync()
        return loss, [np.asarray(x) for x in jax.tree.leaves(nnx.state(step.objects))]

    (ref_loss, ref_state), (loss, state) = run(False), run(True)
    assert loss == ref_loss
    for a, b in zip(state, ref_state):
        np.testing.assert_array_equal(a, b)

    model, _ = build_model_and_optimizer(dataclasses.replace(CFG, offload_optimizer=True))
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]
    streamed = streamable_chain(optax.clip_by_global_norm(1.0), plain)
    with pytest.raises(UsageError, match="holds a \\(\\) value for the .* parameter"):
        make_nnx_optimizer(model, streamed, wrt=nnx.Param)
    for a, b in zip(before, jax.tree.leaves(nnx.state(model))):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_partial_offload_is_validated_before_anything_is_placed():
    with pytest.raises(UsageError, match="offload_exclude.*offload_optimizer"):
        gtp_jax.GTPConfig(offload_exclude=("mlp",))
    with pytest.raises(UsageError, match="offload_exclude.*TrainConfig.offload_optimizer"):
        dataclasses.replace(CFG, offload_exclude=("mlp",))
    with pytest.raises(UsageError, match="invalid regular expression"):
        gtp_jax.GTPConfig(offload_optimizer=True, offload_exclude=("(",))
    # A pattern that matches no parameter would silently offload everything: refused, with
    # the path form to use, before the optimizer state is built.
    cfg = dataclasses.replace(CFG, offload_optimizer=True, offload_exclude=("mlp/dwon",))
    with pytest.raises(UsageError, match="'mlp/dwon' matches no parameter.*blocks/"):
        build_model_and_optimizer(cfg)


def test_streamed_init_builds_each_unit_alone_with_the_values_of_tx_init():
    # Auto axes, as gtp_jax.make_mesh builds (jax.make_mesh defaults to Explicit from 0.11)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    rng = np.random.default_rng(0)
    params = {"stack": put(rng.normal(size=(5, 8, 3)).astype(np.float32), (None, "x")),
              "head": put(rng.normal(size=(8, 4)).astype(np.float32), ("x",))}
    stacked = {"stack": True, "head": False}
    seen: list[tuple[tuple[int, ...], ...]] = []

    def init(p):  # param-dependent state (not zeros), and the shapes each init sees
        seen.append(tuple(sorted(x.shape for x in jax.tree.leaves(p))))
        return optax.TraceState(trace=jax.tree.map(lambda x: 2.0 * x + 1.0, p))

    leafwise = optax.chain(optax.GradientTransformation(init, None),
                           optax.adamw(1e-3, mu_dtype=jnp.bfloat16))
    tx = streamable_chain(optax.clip_by_global_norm(1.0), leafwise)
    built = init_streamed_on_host(tx, params, stacked, group_layers=2)
    # Abstractly once for the whole tree (jax.eval_shape: the state's shapes), then computed
    # one unit at a time: the head whole, the stack's 2-layer groups (one program for both)
    # and its last layer.
    assert sorted(seen) == sorted([((5, 8, 3), (8, 4)), ((8, 4),), ((2, 8, 3),), ((1, 8, 3),)])
    expected = tx.init(params)
    assert jax.tree.structure(built) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(built), jax.tree.leaves(expected)):
        assert a.sharding.memory_kind == HOST_MEMORY_KIND
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.ndim:  # moments and the traced state: their parameter's sharding
            assert a.sharding.with_memory_kind("device").is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The head's state kept on the device: built there by its own program, same values.
    partial = init_streamed_on_host(tx, params, stacked, group_layers=2,
                                    resident={"stack": False, "head": True})
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(partial),
                            jax.tree.leaves(built)):
        on_device = a.ndim == 2 and "head" in jax.tree_util.keystr(path)
        assert a.sharding.memory_kind == ("device" if on_device else HOST_MEMORY_KIND), path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_offload_with_a_simulated_failure_is_refused_before_training():
    # The nonuniform step after a failure updates a device-resident optimizer state: an
    # offloaded one is refused up front, not mid-run.
    from gtp_jax.train import train
    from gtp_jax.train.lifecycle.ntp import SimulatedFailure

    cfg = dataclasses.replace(CFG, offload_optimizer=True, dp=2, gtp=1, tp=4, steps=4)
    for master in (False, True):
        with pytest.raises(UsageError, match="offload_optimizer with a SimulatedFailure"):
            train(dataclasses.replace(cfg, offload_master_weights=master), progress=False,
                  failure=SimulatedFailure(step=2, devices=(5,)))


def test_a_refused_step_selects_every_array_of_a_grouped_offloaded_state():
    # A delayed-FP8 step that must be refused keeps the device arrays' old values and the
    # offloaded state's new ones, array by array: a grouped moment (HostGroups) is one
    # variable of several arrays, and must not shift the arrays after it.
    from gtp_jax.train.step.train_step import _refuse_reuse

    def state(scale: float) -> nnx.State:
        return nnx.from_flat_state([
            (("a",), nnx.Param(jnp.full((4, 2), scale))),
            (("b",), nnx.OptState(HostGroups((jnp.full((3, 2), scale),
                                              jnp.full((1, 2), scale))))),
            (("c",), nnx.Param(jnp.full((3,), scale)))])

    before = jax.tree.leaves(state(1.0))
    kept, metrics = _refuse_reuse(before, state(2.0), {"loss": jnp.float32(0.5)},
                                  {"layer": jnp.int32(2)}, on_host=True)
    flat = dict(nnx.to_flat_state(kept))
    np.testing.assert_array_equal(flat[("a",)].get_value(), np.full((4, 2), 1.0))
    np.testing.assert_array_equal(flat[("c",)].get_value(), np.full((3,), 1.0))
    assert [float(g[0, 0]) for g in flat[("b",)].get_value().groups] == [2.0, 2.0]
    assert np.isnan(float(metrics["loss"]))


def test_building_a_train_step_leaves_the_optimizer_readable_until_the_first_step():
    # The state is grouped at the first step (the objects' arrays then count as donated,
    # until sync), not when the step is built: a second step object, a checkpoint or a
    # refused first step still finds the optimizer's arrays.
    cfg = dataclasses.replace(CFG, offload_optimizer=True)
    model, optimizer = build_model_and_optimizer(cfg)
    step = TrainStep(model, optimizer, LOSS)
    arrays = jax.tree.leaves(nnx.state(optimizer, nnx.OptState))
    assert not any(x.is_deleted() for x in arrays)
    TrainStep(model, optimizer, LOSS)
    step(np.zeros((cfg.batch_size, cfg.seq_len + 1), np.int32))
    assert any(isinstance(v.get_value(), HostGroups)
               for _, v in nnx.to_flat_state(step.state) if isinstance(v, nnx.OptState))
    step.sync()
    assert not any(isinstance(x, HostGroups) for x in jax.tree.leaves(
        nnx.state(optimizer, nnx.OptState), is_leaf=lambda x: isinstance(x, HostGroups)))
    assert not any(x.is_deleted() for x in jax.tree.leaves(nnx.state(optimizer, nnx.OptState)))
