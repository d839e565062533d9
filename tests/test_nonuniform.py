"""Nonuniform tensor parallelism core (gtp_jax.nonuniform): the spares rule, per-replica
layouts and row/column maps, clear errors for bad specs, the bit-exact in-memory re-layout
of a training state, and the gradient of a degraded replica against a uniform run."""

from __future__ import annotations

import collections
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.base.mesh import make_mesh
from gtp_jax.models.transformer import TransformerConfig
from gtp_jax.nonuniform import (
    DimRule,
    LeafSplit,
    NonuniformConfig,
    average_replicas,
    choose_spares,
    describe,
    dim_map,
    from_logical,
    plan,
    relayout,
    to_logical,
    transformer_dims,
)
from gtp_jax.sharding.plan import DimSplit

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it


def ids(mesh) -> list[int]:
    return [d.id for d in mesh.devices.flat]


@pytest.fixture(scope="module")
def mesh_dp2_tp4():
    return make_mesh(dp=2, tp=4)


# --------------------------------------------------------------------------- spares rule


def test_choose_spares_no_failures():
    assert choose_spares({}, 8) == (0, {})
    assert choose_spares({0: [], 1: []}, 8, 2) == (2, {0: (6, 7), 1: (6, 7)})


def test_choose_spares_uniform_count_with_parity():
    # The fewest spares that cover every group; groups with fewer failures are padded with
    # default spares (the last positions), so all degraded groups share one degree.
    assert choose_spares({0: [2, 5], 1: [1]}, 8) == (2, {0: (2, 5), 1: (1, 7)})
    assert choose_spares({0: [2, 5], 1: [1, 3]}, 8) == (2, {0: (2, 5), 1: (1, 3)})
    # A failure on a default spare keeps the other default spare.
    assert choose_spares({0: [7], 1: []}, 8, 2) == (2, {0: (6, 7), 1: (6, 7)})
    assert choose_spares({0: [0], 1: []}, 4, 2) == (2, {0: (0, 3), 1: (2, 3)})


def test_choose_spares_errors():
    with pytest.raises(UsageError, match="more than tp_spares=1; raise tp_spares to 2"):
        choose_spares({0: [1, 2]}, 4, 1)
    with pytest.raises(UsageError, match=r"outside \[0, tp_base=4\)"):
        choose_spares({0: [4]}, 4, 1)


# --------------------------------------------------------------------------- row/col maps


@pytest.mark.parametrize("size,degree,fused", [(8, 4, 1), (6, 4, 1), (5, 2, 1), (16, 2, 2),
                                               (12, 3, 2), (3, 1, 1)])
def test_dim_map_matches_dimsplit(size, degree, fused):
    """`dim_map` names exactly the logical rows gtp_jax's DimSplit stores on each rank."""
    ds = DimSplit(axis="tp", axis_size=degree, dim=0, size=size, parts=fused)
    stored = np.asarray(ds.to_stored(jnp.arange(1, size + 1), 0))  # 0 marks padding
    local = stored.reshape(degree, -1)
    for r, ranges in enumerate(dim_map(size, degree, fused)):
        want = [i + 1 for a, b in ranges for i in range(a, b)]
        got = local[r]
        assert list(got[got > 0]) == want
        assert np.all(got[len(want):] == 0)  # padding only at the end of a rank's block


def test_dim_map_uneven():
    assert dim_map(6, 4) == (((0, 2),), ((2, 4),), ((4, 6),), ())
    assert dim_map(8, 2, 2) == (((0, 2), (4, 6)), ((2, 4), (6, 8)))


# --------------------------------------------------------------------------- plans


def test_plan_no_failures(mesh_dp2_tp4):
    p = plan(mesh_dp2_tp4, NonuniformConfig(4, 2))
    assert p.uniform and p.failed_devices == ()
    assert [r.degree for r in p.replicas] == [4, 4]
    assert ids(p.replica_mesh(1)) == [4, 5, 6, 7]
    assert ids(p.core_mesh()) == [0, 1, 4, 5]
    assert dict(p.core_mesh().shape) == {"dp": 2, "ep": 1, "gtp": 1, "tp": 2}
    # No spares at all: core == all devices, the plan is the uniform mesh.
    p0 = plan(mesh_dp2_tp4, NonuniformConfig(4, 0))
    assert ids(p0.core_mesh()) == ids(mesh_dp2_tp4)


def test_plan_healthy_and_degraded(mesh_dp2_tp4):
    by_coord = plan(mesh_dp2_tp4, NonuniformConfig(4, 2, "tp", ({"dp": 1, "tp": 1},)))
    by_id = plan(mesh_dp2_tp4, NonuniformConfig(4, 2, "tp", (5,)))
    for p in (by_coord, by_id):
        h, d = p.replicas
        assert h.healthy and h.degree == 4 and not d.healthy and d.degree == 2
        (g,) = d.groups
        assert g.failed == (1,) and g.spares == (1, 3) and g.core_devices == (4, 6)
        assert ids(p.replica_mesh(0)) == [0, 1, 2, 3]
        assert ids(p.replica_mesh(1)) == [4, 6]
        assert ids(p.core_replica_mesh(0)) == [0, 1]
        assert ids(p.core_mesh()) == [0, 1, 4, 6]
        assert p.failed_devices == (5,)


def test_plan_gtp_axis_degrades_every_group_of_the_replica():
    mesh = make_mesh(dp=2, gtp=2, tp=2)
    p = plan(mesh, NonuniformConfig(2, 1, "gtp", ({"dp": 1, "gtp": 0, "tp": 1},)))
    h, d = p.replicas
    assert h.healthy and not d.healthy and d.degree == 1
    # Replica 1 = devices 4..7 as gtp groups [4, 6] (tp=0) and [5, 7] (tp=1); device 5
    # (gtp=0, tp=1) failed, so group tp=1 keeps 7 and group tp=0 keeps its core 4.
    assert [g.active_devices for g in d.groups] == [(4,), (7,)]
    assert ids(p.replica_mesh(1)) == [4, 7]
    assert dict(p.core_mesh().shape) == {"dp": 2, "ep": 1, "gtp": 1, "tp": 2}
    assert ids(p.core_mesh()) == [0, 1, 4, 7]


def test_row_column_maps(mesh_dp2_tp4):
    heads, ff = DimRule(6), DimRule(8, fused=2, pad=False)
    p = plan(mesh_dp2_tp4, NonuniformConfig(4, 2, "tp", ({"dp": 1, "tp": 2},)),
             {"n_heads": heads, "d_ff": ff})
    # healthy replica: 6 heads over 4 devices (padded to 8), [gate | up] 8+8 over 4
    assert p.device_ranges(0, heads) == {0: ((0, 2),), 1: ((2, 4),), 2: ((4, 6),), 3: ()}
    assert p.device_ranges(0, ff)[1] == ((2, 4), (10, 12))
    # degraded replica: device 6 failed, runs on 4 and 5 (core positions 0, 1)
    assert p.device_ranges(1, heads) == {4: ((0, 3),), 5: ((3, 6),)}
    assert p.device_ranges(1, ff) == {4: ((0, 4), (8, 12)), 5: ((4, 8), (12, 16))}
    # no spares: the uniform map
    p0 = plan(mesh_dp2_tp4, NonuniformConfig(4, 0), {"n_heads": heads})
    assert p0.device_ranges(1, heads) == {4: ((0, 2),), 5: ((2, 4),), 6: ((4, 6),), 7: ()}
    text = describe(p)
    assert "replica dp=1: DEGRADED, tp=2" in text and "dev4[0:3]" in text
    assert "core mesh: {'dp': 2, 'ep': 1, 'gtp': 1, 'tp': 2}, devices [0, 1, 4, 5]" in text


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(tp_base=0, tp_spares=0), UsageError, "tp_base=0 must be a positive int"),
    (dict(tp_base=4, tp_spares=4), UsageError, r"tp_spares=4 must be an int in \[0, tp_base"),
    (dict(tp_base=4, tp_spares=1, axis="ep"), UsageError, "axis='ep'; choose one of"),
    (dict(tp_base=4, tp_spares=1, failed={"dp": 1}), UsageTypeError, "must be a tuple"),
    (dict(tp_base=4, tp_spares=1, failed=("x",)), UsageTypeError, "failed entry 'x'"),
    (dict(tp_base=4, tp_spares=1, failed=({"tp": -1},)), UsageError, "indices"),
    (dict(tp_base=4, tp_spares=1, failed=(3, 3)), UsageError, "names a device twice"),
])
def test_config_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        NonuniformConfig(**kwargs)


@pytest.mark.parametrize("cfg,dims,match", [
    (NonuniformConfig(4, 1, "tp", ({"pp": 0},)), None, "names axis 'pp', not an axis"),
    (NonuniformConfig(4, 1, "tp", ({"dp": 2},)), None, r"has dp=2, out of range .* 0\.\.\.1"),
    (NonuniformConfig(4, 1, "tp", ({"tp": 4},)), None, "has tp=4, out of range"),
    (NonuniformConfig(4, 1, "tp", (99,)), None, "device id 99 is not in the mesh"),
    (NonuniformConfig(4, 1, "tp", ({"dp": 1, "tp": 0}, {"dp": 1, "tp": 3})), None,
     r"lost 2 devices \(positions \[0, 3\]\), more than tp_spares=1 absorbs; raise"),
    (NonuniformConfig(4, 3, "tp", tuple({"dp": 0, "tp": i} for i in range(4))), None,
     "every device of replica dp=0 failed; restart with that replica dropped"),
    (NonuniformConfig(8, 1), None, "tp_base=8 differs from the mesh's tp=4"),
    (NonuniformConfig(4, 2, "tp", ({"dp": 1, "tp": 1}, 5)), None, "names one device twice"),
    (NonuniformConfig(4, 1, "gtp"), None, "tp_base=4 differs from the mesh's gtp=1"),
    (NonuniformConfig(4, 0, "tp", (1,)), None, "more than tp_spares=0"),
    (NonuniformConfig(4, 1), transformer_dims(TransformerConfig(d_model=64, n_heads=4,
                                                                d_ff=8)),
     r"d_ff=8 cannot be split over tp=3 with its 2 fused parts unpadded \(degraded"),
    (NonuniformConfig(4, 1), {"n_heads": DimRule(2)},
     r"n_heads=2 cannot be split over tp=4 \(healthy replicas\): 2 of the 4 ranks"),
    (NonuniformConfig(4, 2), {"n_heads": DimRule(6, pad=False)},
     r"n_heads=6 cannot be split over tp=4 with no padding \(healthy"),
])
def test_plan_errors(mesh_dp2_tp4, cfg, dims, match):
    with pytest.raises(UsageError, match=match):
        plan(mesh_dp2_tp4, cfg, dims)


def test_plan_type_errors(mesh_dp2_tp4):
    with pytest.raises(UsageTypeError, match="mesh must be a jax.sharding.Mesh"):
        plan("mesh", NonuniformConfig(4, 1))
    with pytest.raises(UsageTypeError, match="config must be a NonuniformConfig"):
        plan(mesh_dp2_tp4, {"tp_base": 4})
    with pytest.raises(UsageTypeError, match="dims must map dim names to DimRule"):
        plan(mesh_dp2_tp4, NonuniformConfig(4, 1), {"d_ff": 8})
    with pytest.raises(UsageError, match=r"replica=2 must be a dp index in \[0, 2\)"):
        plan(mesh_dp2_tp4, NonuniformConfig(4, 1)).replica_mesh(2)


def test_transformer_dims():
    cfg = TransformerConfig(d_model=64, n_heads=4, d_ff=12)
    assert transformer_dims(cfg) == {"n_heads": DimRule(4), "d_ff": DimRule(12, 2, False)}
    assert transformer_dims(cfg, "gtp") == {}
    with pytest.raises(UsageTypeError, match="cfg must be a TransformerConfig"):
        transformer_dims(object())


# --------------------------------------------------------------------------- re-layout

D, F = 5, 6  # model width, hidden width (6 does not divide by 4: padded)


def _splits():
    w = {"w1": LeafSplit(dim=1, size=F), "w2": LeafSplit(dim=0, size=F),
         "gate_up": LeafSplit(dim=1, size=2 * 4, fused=2), "wg": LeafSplit(0, 7, align=2),
         "b": None}
    return {"params": w, "mu": dict(w), "nu": dict(w), "step": None, "key": None,
            "data_pos": None}


_SPECS = {"w1": P(None, "tp"), "w2": P("tp", None), "gate_up": P(None, "tp"),
          "wg": P("tp", None), "b": P()}
_SHAPES = {"w1": (D, F), "w2": (F, D), "gate_up": (D, 8), "wg": (7, 3), "b": (D,)}


def _logical_state(key):
    ks = jax.random.split(key, 16)
    out = {}
    for j, name in enumerate(("params", "mu", "nu")):
        out[name] = {k: np.asarray(jax.random.normal(ks[5 * j + i], s, jnp.float32))
                     for i, (k, s) in enumerate(_SHAPES.items())}
    return out


def _stored_state(logical, mesh, degree, key):
    splits = _splits()
    state = {}
    for name in ("params", "mu", "nu"):
        state[name] = {}
        for k, v in logical[name].items():
            s = splits[name][k]
            x = v if s is None else from_logical(jnp.asarray(v), s, degree)
            state[name][k] = jax.device_put(x, NamedSharding(mesh, _SPECS[k]))
    rep = NamedSharding(mesh, P())
    state["step"] = jax.device_put(jnp.asarray(30, jnp.int32), rep)
    state["key"] = jax.device_put(key, rep)
    state["data_pos"] = jax.device_put(jnp.asarray([30, 7], jnp.int64
                                                   if jax.config.x64_enabled else jnp.int32),
                                       rep)
    return state


def _bits(x) -> np.ndarray:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.atleast_1d(np.asarray(x)).view(np.uint8)


def _assert_state_exact(state, logical, degree, mesh, ref):
    splits = _splits()
    for name in ("params", "mu", "nu"):
        for k, v in state[name].items():
            assert set(v.sharding.device_set) == set(mesh.devices.flat), (name, k)
            assert v.sharding.spec == _SPECS[k]
            s = splits[name][k]
            got = v if s is None else to_logical(v, s, degree)
            np.testing.assert_array_equal(_bits(got), _bits(logical[name][k]), err_msg=k)
            if s is not None:  # padding stays exactly zero
                assert float(jnp.abs(v).sum()) == pytest.approx(
                    float(np.abs(logical[name][k]).sum()), rel=1e-6)
    for k in ("step", "key", "data_pos"):
        np.testing.assert_array_equal(_bits(state[k]), _bits(ref[k]))
        assert set(state[k].sharding.device_set) == set(mesh.devices.flat)


@pytest.mark.parametrize("dst_ids,degree", [((4, 6), 2), ((0, 1, 2), 3), ((7,), 1)])
def test_relayout_bit_exact(key, dst_ids, degree):
    devs = jax.devices()
    src = make_mesh(tp=4, devices=devs[:4])
    dst = make_mesh(tp=degree, devices=[devs[i] for i in dst_ids])
    logical = _logical_state(key)
    state = _stored_state(logical, src, 4, jax.random.key(3))
    before = jax.tree.map(_bits, state)
    moved = relayout(state, _splits(), src, dst, "tp")
    _assert_state_exact(moved, logical, degree, dst, state)
    back = relayout(moved, _splits(), dst, src, "tp")  # and back: the same stored bits
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        np.testing.assert_array_equal(_bits(a), _bits(b))
        assert a.sharding == b.sharding
    # the source state is untouched (nothing donated or deleted)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(before)):
        np.testing.assert_array_equal(_bits(a), b)


def _bad_splits_dim():
    s = _splits()
    s["params"]["w1"] = LeafSplit(dim=0, size=F)
    return s


def _bad_splits_size():
    s = _splits()
    s["mu"]["w2"] = LeafSplit(dim=0, size=3)
    return s


def _bad_splits_missing():
    s = _splits()
    s["nu"]["w1"] = None
    return s


def _bad_splits_structure():
    s = _splits()
    del s["data_pos"]
    return s


@pytest.mark.parametrize("make,exc,match", [
    (_bad_splits_dim, UsageError, r"spec P\(None, 'tp'\) but LeafSplit.dim=0"),
    (_bad_splits_size, UsageError, r"not the stored size 4 of LeafSplit\(size=3"),
    (_bad_splits_missing, UsageError, "is split over 'tp' on dim 1 but its split is None"),
    (_bad_splits_structure, UsageError, "splits must have the structure of the state"),
])
def test_relayout_errors_leave_state_untouched(key, make, exc, match):
    devs = jax.devices()
    src, dst = make_mesh(tp=4, devices=devs[:4]), make_mesh(tp=2, devices=devs[4:6])
    state = _stored_state(_logical_state(key), src, 4, jax.random.key(1))
    before = jax.tree.map(_bits, state)
    with pytest.raises(exc, match=match):
        relayout(state, make(), src, dst, "tp")
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(before)):
        np.testing.assert_array_equal(_bits(a), b)


def test_relayout_mesh_errors(key):
    devs = jax.devices()
    src = make_mesh(tp=4, devices=devs[:4])
    state = _stored_state(_logical_state(key), src, 4, jax.random.key(1))
    with pytest.raises(UsageError, match="is not placed on src"):
        relayout(state, _splits(), make_mesh(tp=4, devices=devs[4:]), src, "tp")
    with pytest.raises(UsageError, match="must be equal and contain axis='pp'"):
        relayout(state, _splits(), src, src, "pp")
    with pytest.raises(UsageError, match=r"spec P\(None, 'tp'\) but .* name 'gtp' alone"):
        relayout(state, _splits(), src, src, "gtp")
    with pytest.raises(UsageTypeError, match="dst must be a jax.sharding.Mesh"):
        relayout(state, _splits(), src, None, "tp")
    with pytest.raises(UsageError, match="fused=2 does not divide size=5"):
        LeafSplit(0, 5, fused=2)


# --------------------------------------------------------------------------- gradients


def _mlp_grads(mesh, w1, w2, x, t):
    """Gradients of a column- then row-parallel MLP over `mesh`'s tp (and dp) axes."""

    def local(w1, w2, x, t):
        h = jnp.tanh(x @ w1)                              # column-parallel: local columns
        y = jax.lax.psum(h @ w2, "tp")                    # row-parallel: partial sums
        return jax.lax.pmean(jnp.mean((y - t) ** 2), "dp")

    def loss(w1, w2):
        return jax.shard_map(local, mesh=mesh,
                             in_specs=(P(None, "tp"), P("tp", None), P("dp"), P("dp")),
                             out_specs=P())(w1, w2, x, t)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(w1, w2)


def _place(mesh, w1, w2, degree, x, t):
    s1, s2 = LeafSplit(1, F), LeafSplit(0, F)
    return (jax.device_put(from_logical(w1, s1, degree), NamedSharding(mesh, P(None, "tp"))),
            jax.device_put(from_logical(w2, s2, degree), NamedSharding(mesh, P("tp", None))),
            jax.device_put(x, NamedSharding(mesh, P("dp"))),
            jax.device_put(t, NamedSharding(mesh, P("dp"))))


#: Tolerance of gradients computed at different degrees: the row-parallel psum adds 4 vs 2
#: partial sums of the hidden contraction (and XLA may block the local GEMMs differently),
#: so float32 results differ by a few ulps of the largest partial sum; the gradients here are
#: O(1), so 1e-5 absolute and relative is ~100 ulps, far below any layout bug (which moves
#: whole rows: O(1) errors).
TOL = dict(rtol=1e-5, atol=1e-5)


def test_degraded_gradient_matches_uniform(key, mesh_dp2_tp4):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    w1 = jax.random.normal(k1, (D, F), jnp.float32)
    w2 = jax.random.normal(k2, (F, D), jnp.float32) / 3
    x = jax.random.normal(k3, (6, D), jnp.float32)  # replica 0: rows 0..2, replica 1: 3..5
    t = jax.random.normal(k4, (6, D), jnp.float32)
    s1, s2 = LeafSplit(1, F), LeafSplit(0, F)
    splits = (s1, s2)
    p = plan(mesh_dp2_tp4, NonuniformConfig(4, 2, "tp", ({"dp": 1, "tp": 1},)),
             {"d_ff": DimRule(F)})
    devs = jax.devices()

    # 1. the degraded replica (tp=2 on devices 4, 6) vs the same replica at tp=4
    deg = _mlp_grads(p.replica_mesh(1), *_place(p.replica_mesh(1), w1, w2, 2, x[3:], t[3:]))
    full_mesh = make_mesh(tp=4, devices=devs[4:])
    full = _mlp_grads(full_mesh, *_place(full_mesh, w1, w2, 4, x[3:], t[3:]))
    # padded rows/columns of the tp=4 layout (6 -> 8) get exactly zero gradient
    np.testing.assert_array_equal(np.asarray(full[0]).reshape(D, 4, 2)[:, 3], 0)
    np.testing.assert_array_equal(np.asarray(full[1]).reshape(4, 2, D)[3], 0)
    moved = relayout(full, splits, full_mesh, p.replica_mesh(1), "tp")
    for a, b, s in zip(deg, moved, splits):
        assert a.sharding == b.sharding
        np.testing.assert_allclose(to_logical(a, s, 2), to_logical(b, s, 2), **TOL)

    # 2. healthy (tp=4) + degraded (tp=2) averaged on the core mesh == the uniform run
    healthy = _mlp_grads(p.replica_mesh(0), *_place(p.replica_mesh(0), w1, w2, 4, x[:3],
                                                    t[:3]))
    avg = average_replicas(p, [healthy, deg], splits)
    core = p.core_mesh()
    for a in avg:
        assert set(a.sharding.device_set) == set(core.devices.flat)
        assert a.sharding.mesh.shape["tp"] == 2
    uniform = _mlp_grads(mesh_dp2_tp4, *_place(mesh_dp2_tp4, w1, w2, 4, x, t))
    for a, u, s in zip(avg, uniform, splits):
        np.testing.assert_allclose(to_logical(a, s, 2), to_logical(u, s, 4), **TOL)
    # and against the unsharded reference gradient
    ref = jax.grad(lambda a, b: jnp.mean((jnp.tanh(x @ a) @ b - t) ** 2), argnums=(0, 1))(
        w1, w2)
    for a, r, s in zip(avg, ref, splits):
        np.testing.assert_allclose(to_logical(a, s, 2), r, **TOL)


def test_average_replicas_errors(mesh_dp2_tp4):
    p = plan(mesh_dp2_tp4, NonuniformConfig(4, 2, "tp", (5,)))
    with pytest.raises(UsageError, match=r"one tree per replica \(2\)"):
        average_replicas(p, [{}], {})
    with pytest.raises(UsageError, match="weights=.* must be 2 positive numbers"):
        average_replicas(p, [{}, {}], {}, weights=[1, 0])
    rep = NamedSharding(p.replica_mesh(0), P())
    step = jax.device_put(jnp.int32(1), rep)
    with pytest.raises(UsageTypeError, match="floating-point jax.Array"):
        average_replicas(p, [step, step], None)


def test_average_and_weight_broadcast_dispatch_per_tree_not_per_leaf(key, mesh_dp2_tp4,
                                                                    monkeypatch):
    """The degraded step's re-layouts (gradients to the core mesh and their average, new
    weights back to each replica) run the same programs and `device_put` calls for 2 leaves
    as for 12: per-leaf dispatches and transfers cost milliseconds each on GPUs. The
    average stays the exact float32 weighted sum of the replicas' gradients."""
    relayout_module = importlib.import_module("gtp_jax.nonuniform.relayout")
    p = plan(mesh_dp2_tp4, NonuniformConfig(4, 2, "tp", ({"dp": 1, "tp": 1},)),
             {"d_ff": DimRule(F)})
    calls = collections.Counter()

    def counting(name, make):
        def factory(*args):
            program = make(*args)

            def run(*xs):
                calls[name] += 1
                return program(*xs)
            return run
        return factory

    for name in ("_resplit_fn", "_place_fn", "_mean_fn"):
        monkeypatch.setattr(relayout_module, name,
                            counting(name, getattr(relayout_module, name)))
    device_put = jax.device_put

    def counted_put(*args, **kwargs):
        calls["device_put"] += 1
        return device_put(*args, **kwargs)

    def count(n):
        s = LeafSplit(1, F)
        splits = [s, None] * n
        logical = [jax.random.normal(jax.random.fold_in(key, i), (2, D, F)) for i in range(n)]
        bias = jnp.arange(D, dtype=jnp.float32)

        def tree(mesh, degree, scale):
            return [leaf for x in logical for leaf in (
                jax.device_put(from_logical(x[scale], s, degree),
                               NamedSharding(mesh, P(None, "tp"))),
                jax.device_put(bias * (scale + 1), NamedSharding(mesh, P())))]

        grads = [tree(p.replica_mesh(r), d, r) for r, d in ((0, 4), (1, 2))]
        params = tree(p.core_mesh(), 2, 0)
        calls.clear()
        with monkeypatch.context() as m:
            m.setattr(jax, "device_put", counted_put)
            avg = average_replicas(p, grads, splits, weights=[1.0, 3.0])
            back = [relayout_module.from_core(p, params, splits, r) for r in (0, 1)]
        w = np.float32([0.25, 0.75])
        for i, x in enumerate(logical):
            want = w[0] * np.asarray(x[0]) + w[1] * np.asarray(x[1])
            np.testing.assert_array_equal(_bits(to_logical(avg[2 * i], s, 2)), _bits(want))
            for b, degree in zip(back, (4, 2)):
                np.testing.assert_array_equal(_bits(to_logical(b[2 * i], s, degree)),
                                              _bits(x[0]))
        return dict(calls)

    few = count(2)
    assert few == count(12)
    assert sum(few.values()) <= 12, few


def test_relayout_gtp_axis_keeps_tp_split(key):
    """A weight split over tp on one dim and over gtp (with alignment padding) on another:
    reducing gtp 4 -> 2 re-splits the gtp dim and leaves the tp split as it was."""
    devs = jax.devices()
    src = make_mesh(gtp=4, tp=2)
    dst = make_mesh(gtp=2, tp=2, devices=[devs[i] for i in (0, 1, 4, 5)])
    w = jax.random.normal(key, (8, 7), jnp.float32)
    s = LeafSplit(dim=1, size=7, align=2)
    x = jax.device_put(from_logical(w, s, 4), NamedSharding(src, P("tp", "gtp")))
    assert x.shape == (8, 8)
    y = relayout({"w": x, "step": jnp.int32(3)}, {"w": s, "step": None}, src, dst, "gtp")
    assert y["w"].shape == (8, 8) and y["w"].sharding.spec == P("tp", "gtp")
    assert y["step"].sharding.mesh.shape == dst.shape
    np.testing.assert_array_equal(_bits(to_logical(y["w"], s, 2)), _bits(w))
    with pytest.raises(UsageError, match="split over 'tp' .* only 'gtp' may change"):
        relayout({"w": x}, {"w": s}, src, make_mesh(gtp=2, tp=1, devices=devs[:2]), "gtp")


def _lost(mesh, logical, split, spec, failed):
    """`logical` stored at the mesh's tp on `mesh`, with NaN on the failed devices' shards
    (the data a failure loses)."""
    x = from_logical(jnp.asarray(logical), split, mesh.shape["tp"])
    sh = NamedSharding(mesh, spec)
    arrays = []
    for d, idx in sh.addressable_devices_indices_map(x.shape).items():
        piece = np.asarray(x[idx])
        arrays.append(jax.device_put(np.full_like(piece, np.nan) if d.id in failed else piece,
                                     d))
    return jax.make_array_from_single_device_arrays(x.shape, sh, arrays)


def test_failure_recovery_reads_no_failed_device(key, mesh_dp2_tp4):
    """Step 30, devices 1 (dp0, tp1) and 6 (dp1, tp2) fail: the dp-replicated state is
    rebuilt from surviving shards (0, 5, 2, 3), laid out on the core mesh (optimizer) and
    on each replica, bit-exactly, although the failed devices' shards are garbage."""
    from gtp_jax.nonuniform import from_core, survivor_mesh, take_survivors
    p = plan(mesh_dp2_tp4, NonuniformConfig(4, 1, "tp", (1, 6)))
    assert ids(survivor_mesh(p)) == [0, 5, 2, 3]
    w = np.asarray(jax.random.normal(key, (F, D), jnp.float32))
    s = LeafSplit(0, F)
    state = {"w": _lost(mesh_dp2_tp4, w, s, P("tp", None), {1, 6}),
             "step": jax.device_put(jnp.int32(30), NamedSharding(mesh_dp2_tp4, P()))}
    splits = {"w": s, "step": None}
    smesh, surv = take_survivors(p, state)
    core = relayout(surv, splits, smesh, p.core_mesh(), "tp")
    assert ids(p.core_mesh()) == [0, 2, 3, 4, 5, 7] and core["w"].shape == (F, D)
    np.testing.assert_array_equal(_bits(to_logical(core["w"], s, 3)), _bits(w))
    for r in (0, 1):
        rep = from_core(p, core, splits, r)
        lost = {1, 6} & set(ids(p.replica_mesh(r)))
        assert not lost, f"replica {r}'s mesh holds failed devices {lost}"
        np.testing.assert_array_equal(_bits(to_logical(rep["w"], s, 3)), _bits(w))
        assert int(rep["step"]) == 30
    with pytest.raises(UsageError, match=r"devices \[1, 5\] hold the same shard and all"):
        survivor_mesh(plan(mesh_dp2_tp4, NonuniformConfig(4, 1, "tp", (1, 5))))


def test_leaf_split_from_gtp_plans():
    """LeafSplits derived from gtp_jax's own plans reproduce their stored layouts."""
    import dataclasses as dc

    from gtp_jax.nonuniform import leaf_split
    from gtp_jax.sharding.plan import ParamPlan, SplitPlan

    tp = DimSplit(axis="tp", axis_size=4, dim=1, size=12, parts=2)
    sp = SplitPlan(path="mlp/gate_up", stacked=True, splits=(tp,))
    s = leaf_split(sp, "tp")
    assert s == LeafSplit(dim=2, size=12, fused=2)
    x = jnp.arange(3 * 5 * 12.0).reshape(3, 5, 12)
    np.testing.assert_array_equal(from_logical(x, s, 4), sp.to_stored(x))
    assert leaf_split(sp, "gtp") is None

    @dc.dataclass(frozen=True)
    class Spec:  # the GatherSpec fields leaf_split reads
        shard_dim: int
        logical_shape: tuple

    pp = ParamPlan(path="w", spec=Spec(0, (7, 3)), stacked=True)
    assert leaf_split(pp, "gtp", pad_for_alignment=2) == LeafSplit(dim=1, size=7, align=2)
    assert LeafSplit(1, 7, align=2).stored_size(4) == 8
    assert leaf_split(pp, "tp") is None


def test_simulated_failure_continues_training(key, mesh_dp2_tp4):
    """The `--simulate-failure step=3,device=5` flow on the MLP with Adam: 3 uniform steps
    (dp=2, tp=4), then device 5 fails: re-plan, recover params + Adam state from survivors
    onto the core mesh (tp=2), and continue with a healthy tp=4 replica and a degraded tp=2
    one (per-replica programs, core-mesh average and optimizer step). The weights track a
    uniform run on the same data within the gradient tolerance."""
    import optax

    from gtp_jax.nonuniform import from_core, take_survivors

    k1, k2, k3, k4 = jax.random.split(key, 4)
    w1 = jax.random.normal(k1, (D, F), jnp.float32)
    w2 = jax.random.normal(k2, (F, D), jnp.float32) / 3
    xs = jax.random.normal(k3, (6, 6, D), jnp.float32)  # 6 steps x (2 replicas x 3) rows
    ts = jax.random.normal(k4, (6, 6, D), jnp.float32)
    s1, s2 = LeafSplit(1, F), LeafSplit(0, F)
    psplits = (s1, s2)
    tx = optax.adam(1e-2)
    step_fn = jax.jit(lambda g, o, w: (lambda u, o2: (optax.apply_updates(w, u), o2))(
        *tx.update(g, o, w)))

    def uniform_run(n_steps):
        w = _place(mesh_dp2_tp4, w1, w2, 4, xs[0], ts[0])[:2]
        opt = tx.init(w)
        for i in range(n_steps):
            g = _mlp_grads(mesh_dp2_tp4, *w, *_place(mesh_dp2_tp4, w1, w2, 4, xs[i],
                                                     ts[i])[2:])
            w, opt = step_fn(g, opt, w)
        return w, opt

    ref, _ = uniform_run(6)
    w, opt = uniform_run(3)

    # failure at step 3: detect -> re-plan -> recover -> re-layout
    p = plan(mesh_dp2_tp4, NonuniformConfig(4, 2, "tp", (5,)), {"d_ff": DimRule(F)})
    opt_splits = jax.tree.map(lambda _: None, opt)
    opt_splits = (opt_splits[0]._replace(mu=psplits, nu=psplits), opt_splits[1])
    splits = {"w": psplits, "opt": opt_splits}
    smesh, surv = take_survivors(p, {"w": w, "opt": opt})
    core = relayout(surv, splits, smesh, p.core_mesh(), "tp")
    w, opt = core["w"], core["opt"]
    for i in range(3, 6):
        grads = []
        for r in (0, 1):
            wr = from_core(p, w, psplits, r)
            m = p.replica_mesh(r)
            data = _place(m, w1, w2, m.shape["tp"], xs[i, 3 * r:3 * r + 3],
                          ts[i, 3 * r:3 * r + 3])[2:]
            grads.append(_mlp_grads(m, *wr, *data))
        g = average_replicas(p, grads, psplits)
        w, opt = step_fn(g, opt, w)
    assert w[0].sharding.mesh.shape["tp"] == 2
    assert int(opt[0].count) == 6
    assert float(jnp.abs(to_logical(ref[0], s1, 4) - w1).max()) > 1e-2  # training moved w
    for a, b, s in zip(w, ref, psplits):
        np.testing.assert_allclose(to_logical(a, s, 2), to_logical(b, s, 4), **TOL)


def test_relayout_nnx_state():
    """An ``nnx.State`` (Variables as pytree nodes) re-lays out like any pytree; splits are
    built with ``jax.tree.map`` over it."""
    from flax import nnx

    devs = jax.devices()
    src, dst = make_mesh(tp=4, devices=devs[:4]), make_mesh(tp=2, devices=devs[4:6])
    _, state = nnx.split(nnx.Linear(5, 8, rngs=nnx.Rngs(0)))
    state = jax.tree.map(lambda x: jax.device_put(
        x, NamedSharding(src, P("tp") if x.ndim == 1 else P(None, "tp"))), state)
    splits = jax.tree.map(lambda x: LeafSplit(x.ndim - 1, 8), state)
    out = relayout(state, splits, src, dst, "tp")
    assert type(out) is type(state)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(state)):
        assert {d.id for d in a.sharding.device_set} == {4, 5}
        np.testing.assert_array_equal(_bits(a), _bits(b))
