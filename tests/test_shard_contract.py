"""What `gtp_jax.shard` guarantees beyond equal outputs: written state, argument and output
layout, nesting, shard-dim choice and the user's remat, each checked against the same module
run unsharded."""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_unchanged, get_mesh, snapshot
from jax.ad_checkpoint import print_saved_residuals

import gtp_jax
from gtp_jax.base.errors import UsageError

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it


def _place(mesh, x):
    return jax.device_put(x, gtp_jax.data_sharding(mesh, x.ndim))


def _assert_grads_equal(sm, grads, grads_ref, rtol: float) -> None:
    full = gtp_jax.unshard_values(sm, grads)
    want = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(grads_ref)}
    assert set(full) == set(want)
    for path, value in want.items():
        np.testing.assert_allclose(np.asarray(full[path]), np.asarray(value), rtol=rtol,
                                   atol=rtol * float(np.max(np.abs(value))), err_msg=path)


def _copy(module):
    return nnx.merge(*nnx.split(module))


# --------------------------------------------------------------------------- written state


class RunningMean(gtp_jax.BatchMean):
    """An EMA of batch means: combined by the mean over the data shards."""


class Count(nnx.Variable):
    pass


class Stateful(nnx.Module):
    """A running mean (float), an example counter (int) and a sown per-example value."""

    def __init__(self, rngs, count_rule=None, sow=False):
        self.lin = nnx.Linear(16, 64, rngs=rngs)
        self.mean = RunningMean(jnp.zeros((64,)))
        meta = {} if count_rule is None else {"gtp_reduce": count_rule}
        self.count = Count(jnp.zeros((), jnp.int32), **meta)
        self.sow_it = sow

    def __call__(self, x):
        y = self.lin(x)
        self.mean[...] = 0.5 * self.mean[...] + 0.5 * jnp.mean(y, axis=0)
        self.count[...] = self.count[...] + x.shape[0]
        if self.sow_it:
            self.sow(nnx.Intermediate, "hidden", y)
        return y


def _xs(key, n=8):
    return 10.0 + jax.random.normal(key, (n, 16))


def test_batch_mean_state_is_mean_over_data_shards_and_int_state_sums(key) -> None:
    mesh = get_mesh("dp2_gtp4")
    ref = Stateful(nnx.Rngs(0), count_rule="sum")
    sm = gtp_jax.shard(_copy(ref), mesh, gtp_jax.GTPConfig(min_elements=0))
    step = nnx.jit(lambda m, x: m(x))
    for i in range(2):
        x = _xs(jax.random.fold_in(key, i))
        out_ref = ref(x)
        out = step(sm, _place(mesh, x))
        np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=1e-5, atol=1e-5)
    inner = sm.module
    np.testing.assert_allclose(np.asarray(inner.mean[...]), np.asarray(ref.mean[...]),
                               rtol=1e-5, atol=1e-5)
    assert abs(float(np.mean(ref.mean[...]))) > 1.0  # not trivially zero
    assert int(inner.count[...]) == int(ref.count[...]) == 16


def test_int_state_without_rule_is_refused_and_nothing_changes(key) -> None:
    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(Stateful(nnx.Rngs(0)), mesh, gtp_jax.GTPConfig(min_elements=0))
    before = snapshot(sm)
    with pytest.raises(UsageError, match="'count'.*gtp_reduce"):
        sm(_place(mesh, _xs(key)))
    assert_unchanged(sm, before)


def test_same_rule_keeps_identical_state(key) -> None:
    class Steps(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(16, 64, rngs=nnx.Rngs(0))
            self.steps = Count(jnp.zeros((), jnp.int32), gtp_reduce="same")

        def __call__(self, x):
            self.steps[...] = self.steps[...] + 1  # identical on every shard
            return self.lin(x)

    mesh = get_mesh("dp2_gtp4")
    ref = Steps()
    sm = gtp_jax.shard(_copy(ref), mesh, gtp_jax.GTPConfig(min_elements=0))
    for _ in range(3):
        ref(_xs(key))
        sm(_place(mesh, _xs(key)))
    assert int(sm.module.steps[...]) == int(ref.steps[...]) == 3


def test_sow_per_example_is_concatenated(key) -> None:
    mesh = get_mesh("dp2_gtp4")
    ref = Stateful(nnx.Rngs(0), count_rule="sum", sow=True)
    sm = gtp_jax.shard(_copy(ref), mesh, gtp_jax.GTPConfig(min_elements=0))
    x = _xs(key)
    ref(x)
    nnx.jit(lambda m, x: m(x))(sm, _place(mesh, x))
    got, want = sm.module.hidden.get_value(), ref.hidden.get_value()
    assert len(got) == len(want) == 1
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)


def test_sow_not_per_example_is_refused(key) -> None:
    class SowMean(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(16, 64, rngs=nnx.Rngs(0))

        def __call__(self, x):
            y = self.lin(x)
            self.sow(nnx.Intermediate, "avg", jnp.mean(y, axis=0))
            return y

    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(SowMean(), mesh, gtp_jax.GTPConfig(min_elements=0))
    before = snapshot(sm)
    with pytest.raises(UsageError, match="'avg'.*per-example"):
        sm(_place(mesh, _xs(key)))
    assert_unchanged(sm, before)


# --------------------------------------------------------------------------- args / outputs


class WithTable(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(16, 64, rngs=nnx.Rngs(0))

    def __call__(self, x, table):
        return self.lin(x) + jnp.sum(table, axis=0)


class BatchSum(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(16, 64, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return jnp.sum(self.lin(x), axis=0)


def test_output_not_per_example_is_refused(key) -> None:
    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(BatchSum(), mesh, gtp_jax.GTPConfig(min_elements=0))
    with pytest.raises(UsageError, match=r"shape \(64,\).*per-example"):
        sm(_place(mesh, _xs(key)))


class KeptDims(nnx.Module):
    """Outputs whose leading dim is 1 whatever the batch: a sum kept as a row, a column
    transposed, beside a per-example output."""

    def __init__(self):
        self.lin = nnx.Linear(16, 64, rngs=nnx.Rngs(0))

    def __call__(self, x):
        h = self.lin(x)
        return h, h.sum(0, keepdims=True), h[:, :1].T


class TwoSummaries(nnx.Module):
    """An output of two rows whatever the batch (a sum and a max over it)."""

    def __init__(self):
        self.lin = nnx.Linear(16, 64, rngs=nnx.Rngs(0))

    def __call__(self, x):
        h = self.lin(x)
        return h, jnp.stack([h.sum(0), h.max(0)])


def test_an_output_as_long_as_the_shards_batch_by_chance_is_refused(key) -> None:
    """An output whose leading dim equals the examples per data shard by chance looks
    per-example (at one example per shard, a row kept by a sum or a transposed column; at
    two, two summaries stacked): the sharded call compares the outputs' shapes over the whole
    batch with the unsharded module's (an abstract trace) and refuses those that differ,
    before anything runs; at other batches the usual check refuses them; per-example outputs
    pass."""
    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(KeptDims(), mesh, gtp_jax.GTPConfig(min_elements=0))
    x = _place(mesh, _xs(key))  # 8 examples over 8 data shards
    with pytest.raises(UsageError, match=r"^gtp_jax.ShardedModule: output 1 has 1 row\(s\) "
                       r"on each data shard, as many as its examples, so \(8, 64\) over the "
                       r"batch of 8, but the unsharded module returns \(1, 64\)"):
        sm(x)
    with pytest.raises(UsageError, match=r"output 1 has 1 row"):
        nnx.jit(lambda m, x: m(x))(sm, x)
    with pytest.raises(UsageError, match=r"per-example"):
        sm(_place(mesh, _xs(key, 16)))
    two = gtp_jax.shard(TwoSummaries(), mesh, gtp_jax.GTPConfig(min_elements=0))
    with pytest.raises(UsageError, match=r"output 1 has 2 row\(s\) on each data shard.*"
                       r"\(16, 64\) over the batch of 16, but the unsharded module returns "
                       r"\(2, 64\)"):
        nnx.jit(lambda m, x: m(x))(two, _place(mesh, _xs(key, 16)))
    with pytest.raises(UsageError, match=r"per-example"):
        two(x)
    ref, plain = WithTable(), gtp_jax.shard(WithTable(), mesh, gtp_jax.GTPConfig(min_elements=0))
    table = gtp_jax.replicated(jnp.ones((3, 64)))
    np.testing.assert_allclose(np.asarray(plain(x, table)), np.asarray(ref(_xs(key), table)),
                               rtol=1e-5, atol=1e-5)


def test_replicated_argument_reaches_every_shard_whole(key) -> None:
    mesh = get_mesh("dp2_gtp4")
    ref = WithTable()
    sm = gtp_jax.shard(_copy(ref), mesh, gtp_jax.GTPConfig(min_elements=0))
    x = _xs(key)
    # the same leading size as the batch: only the wrapper can tell them apart
    table = jax.random.normal(jax.random.fold_in(key, 1), (8, 64))
    out = nnx.jit(lambda m, x, t: m(x, gtp_jax.replicated(t)))(sm, _place(mesh, x), table)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref(x, table)), rtol=1e-5, atol=1e-5)
    # also when the wrapper itself crosses jit
    out = nnx.jit(lambda m, x, t: m(x, t))(sm, _place(mesh, x), gtp_jax.replicated(table))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref(x, table)), rtol=1e-5, atol=1e-5)


class TableUses(nnx.Module):
    """Reads a table argument in each way a plain module may: a ``jnp`` function, operators
    on either side, indexing, its attributes and methods."""

    def __init__(self):
        self.lin = nnx.Linear(16, 64, rngs=nnx.Rngs(0))

    def __call__(self, x, table):
        y = self.lin(x)
        rows = jnp.take(table, jnp.array([1, 3]), axis=0)  # jnp function: [2, 64]
        y = y + rows.sum(0) - table[0] * 2.0 + (table.T @ jnp.ones(table.shape[0]))
        y = y / (1.0 + abs(table).max()) + (-table[2]) ** 2 + table.astype(jnp.float32)[4]
        return jnp.where(table[5] > 0, y, 0.5 * y) + len(table) + table.ndim


def test_the_unsharded_module_takes_the_same_call_with_replicated(key) -> None:
    """Code written for the sharded call (``gtp_jax.replicated(table)``) runs unchanged on the
    unsharded module, eagerly and under jit, with the numbers of the unwrapped call; a copy
    of the wrapper stays one."""
    import copy  # noqa: PLC0415

    mesh = get_mesh("dp2_gtp4")
    ref = TableUses()
    x, table = _xs(key), jax.random.normal(jax.random.fold_in(key, 1), (8, 64))
    want = np.asarray(ref(x, table))
    wrapped = gtp_jax.replicated(table)
    np.testing.assert_array_equal(np.asarray(ref(x, wrapped)), want)
    jitted = nnx.jit(lambda m, x, t: m(x, t))  # compiled: XLA may reassociate, so compared
    np.testing.assert_array_equal(np.asarray(jitted(ref, x, wrapped)),  # with itself unwrapped
                                  np.asarray(jitted(ref, x, table)))
    np.testing.assert_array_equal(np.asarray(wrapped), np.asarray(table))
    np.testing.assert_array_equal(np.asarray(np.sum(wrapped, axis=0)),
                                  np.asarray(jnp.sum(table, axis=0)))
    assert isinstance(copy.deepcopy(wrapped), gtp_jax.sharding.Replicated)
    assert isinstance(copy.copy(wrapped), gtp_jax.sharding.Replicated)
    sm = gtp_jax.shard(_copy(ref), mesh, gtp_jax.GTPConfig(min_elements=0))
    np.testing.assert_allclose(np.asarray(sm(_place(mesh, x), wrapped)), want,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gtp_jax.unshard(sm)(x, wrapped)), want,
                               rtol=1e-5, atol=1e-5)


def test_another_method_and_an_unsharded_state_are_named_in_one_line() -> None:
    """A method of the wrapped module asked of the wrapper says where it is and how to run
    it; nnx.update with an unsharded module's state names its key and the way to load
    weights, before anything is written."""
    class WithEncode(WithTable):
        def encode(self, x):
            return self.lin(x)

    sm = gtp_jax.shard(WithEncode(), get_mesh("dp2_gtp4"), gtp_jax.GTPConfig(min_elements=0))
    with pytest.raises(AttributeError, match=r"^gtp_jax.ShardedModule has no attribute "
                       r"'encode'; the wrapped WithEncode has it.*gtp_jax.unshard\(sharded\)"):
        sm.encode(jnp.ones((8, 16)))
    assert not hasattr(sm, "missing") and isinstance(nnx.clone(sm), gtp_jax.ShardedModule)
    before = jax.tree.map(np.asarray, nnx.state(sm))
    with pytest.raises(UsageError, match=r"^gtp_jax.ShardedModule: the state written in "
                       r"\(nnx.update\) has 'lin' where the sharded module's state has "
                       r"'module'.*Load weights into the plain module and shard it then"):
        nnx.update(sm, nnx.state(WithEncode()))
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, nnx.state(sm)))


def test_batch_arguments_must_share_leading_dim(key) -> None:
    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(WithTable(), mesh, gtp_jax.GTPConfig(min_elements=0))
    with pytest.raises(UsageError, match=r"Argument 1 \(args\[1\]\).*gtp_jax.replicated"):
        sm(_place(mesh, _xs(key)), jnp.ones((16, 64)))
    with pytest.raises(UsageError, match=r"kwargs\['table'\]"):
        sm(_place(mesh, _xs(key)), table=jnp.ones((16, 64)))


def test_nested_sharded_module_is_refused(mesh_gtp8) -> None:
    class Outer(nnx.Module):
        def __init__(self, inner):
            self.head = nnx.Linear(64, 64, rngs=nnx.Rngs(1))
            self.blocks = nnx.List([inner])

    inner = gtp_jax.shard(nnx.Linear(16, 64, rngs=nnx.Rngs(0)), mesh_gtp8,
                          gtp_jax.GTPConfig(min_elements=0))
    outer = Outer(inner)
    before = snapshot(outer)
    with pytest.raises(UsageError, match="already sharded module at 'blocks/0'"):
        gtp_jax.shard(outer, mesh_gtp8, gtp_jax.GTPConfig(min_elements=0))
    assert_unchanged(outer, before)


# --------------------------------------------------------------------------- shard dim


class Convs(nnx.Module):
    def __init__(self, rngs):
        self.c1 = nnx.Conv(64, 64, (3, 3), rngs=rngs)
        self.c2 = nnx.Conv(64, 64, (3, 3), rngs=rngs)

    def __call__(self, x):
        return self.c2(jax.nn.relu(self.c1(x)))


def test_conv_kernel_is_one_over_n_per_device(key) -> None:
    mesh = get_mesh("gtp8")
    ref = Convs(nnx.Rngs(0))
    cfg = gtp_jax.GTPConfig(pad_for_alignment=8)
    sm = gtp_jax.shard(_copy(ref), mesh, cfg)
    assert {p.path: p.spec.shard_dim for p in sm.plan} == {"c1/kernel": 2, "c2/kernel": 2}
    kernels = 2 * 3 * 3 * 64 * 64 * 4
    per_device = gtp_jax.bytes_per_device(nnx.state(sm, nnx.Param))
    biases = 2 * 64 * 4
    assert per_device - biases <= kernels / 8 * 1.03, sm.describe()
    assert len(sm.describe()) == 2 and "dim 2" in sm.describe()[0]
    x = jax.random.normal(key, (8, 6, 6, 64))

    def loss(m, x):
        return jnp.mean(m(x) ** 2)

    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, x: m(x))(sm, _place(mesh, x))),
                               np.asarray(ref(x)), rtol=1e-5, atol=1e-5)
    g_ref = nnx.jit(nnx.grad(loss))(ref, x)
    g = nnx.jit(nnx.grad(loss))(sm, _place(mesh, x))
    _assert_grads_equal(sm, g, g_ref, rtol=1e-4)


def test_shard_dim_metadata_still_overrides() -> None:
    mesh = get_mesh("gtp8")
    conv = nnx.Conv(64, 64, (3, 3), rngs=nnx.Rngs(0), kernel_metadata={"gtp_shard_dim": 3})
    sm = gtp_jax.shard(conv, mesh, gtp_jax.GTPConfig(pad_for_alignment=8))
    assert sm.plan[0].spec.shard_dim == 3


# --------------------------------------------------------------------------- user remat


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.up = nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class RematStack(nnx.Module):
    """A user's model: python loop of blocks, each under nnx.remat (nothing from gtp_jax)."""

    def __init__(self, d=32, n=4, rngs=None):
        self.blocks = nnx.List([Block(d, rngs) for _ in range(n)])

    def __call__(self, x):
        for block in self.blocks:
            x = nnx.remat(lambda b, h: b(h))(block, x)
        return x


def _loss(m, x):
    return jnp.mean(m(x) ** 2)


def _residuals(model, x) -> list[str]:
    graphdef, state = nnx.split(model)

    def f(s, x):
        return _loss(nnx.merge(graphdef, s), x)

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(f, state, x)
    return sorted(line.split(" ")[0] for line in buf.getvalue().splitlines()
                  if "from the argument" not in line)


def test_gtp1_keeps_user_remat_and_adds_nothing(key) -> None:
    mesh = gtp_jax.make_mesh(gtp=1, devices=jax.devices()[:1])
    ref = RematStack(rngs=nnx.Rngs(0))
    x = jax.random.normal(key, (4, 32))
    # gather_dtype only casts, inside the user's remat: the bf16 copies are not saved either
    bf16 = gtp_jax.shard(_copy(ref), mesh, gtp_jax.GTPConfig(min_elements=0,
                                                             gather_dtype=jnp.bfloat16))
    assert _residuals(bf16, x) == _residuals(ref, x) == ["f32[4,32]"] * 4
    sm = gtp_jax.shard(_copy(ref), mesh, gtp_jax.GTPConfig(min_elements=0))
    assert _residuals(sm, x) == _residuals(ref, x)

    def temp(model):
        graphdef, state = nnx.split(model)
        fn = jax.jit(jax.grad(lambda s, x: _loss(nnx.merge(graphdef, s), x)))
        return fn.lower(state, x).compile().memory_analysis().temp_size_in_bytes

    assert temp(sm) <= temp(ref)
    g_ref, g = nnx.jit(nnx.grad(_loss))(ref, x), nnx.jit(nnx.grad(_loss))(sm, x)
    _assert_grads_equal(sm, g, g_ref, rtol=1e-5)


def test_user_remat_is_honoured_with_gtp4(key) -> None:
    """gtp>1: each block under the user's remat saves only its input; no gathered weight."""
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    ref = RematStack(rngs=nnx.Rngs(0))
    sm = gtp_jax.shard(_copy(ref), mesh, gtp_jax.GTPConfig(min_elements=0))
    x = jax.random.normal(key, (8, 32))
    ref_res = _residuals(ref, x)
    assert ref_res == ["f32[8,32]"] * 4  # the four block inputs
    # shard_map stacks each device's residual on dim 0: 8 devices x 1 example = 8 rows.
    assert _residuals(sm, _place(mesh, x)) == ref_res
    g_ref = nnx.jit(nnx.grad(_loss))(ref, x)
    g = nnx.jit(nnx.grad(_loss))(sm, _place(mesh, x))
    _assert_grads_equal(sm, g, g_ref, rtol=1e-5)
    # The backward pass re-gathers each weight inside its block.
    graphdef, state = nnx.split(sm)
    lowered = jax.jit(jax.grad(lambda s, x: _loss(nnx.merge(graphdef, s), x))).lower(
        state, _place(mesh, x)).as_text()
    assert lowered.count('"stablehlo.all_gather"') >= 2 * len(sm.plan)


def test_without_user_remat_gathered_weights_are_still_not_saved(key) -> None:
    class Plain(RematStack):
        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    x = _place(mesh, jax.random.normal(key, (8, 32)))
    # a gathered kernel, as one device's or as 8 devices' residuals stacked on dim 0
    kernels = {"f32[32,128]", "f32[128,32]", "f32[256,128]", "f32[1024,32]"}
    for remat in (True, False):
        sm = gtp_jax.shard(Plain(rngs=nnx.Rngs(0)), mesh,
                           gtp_jax.GTPConfig(min_elements=0, remat_gathered=remat))
        saved = kernels & set(_residuals(sm, x))
        assert bool(saved) == (not remat), saved


@pytest.mark.parametrize("name,mesh_name", [
    ("1b", "gtp8"), ("1b", "dp2_gtp4"), ("1b", "ep2_gtp2_tp2"),
    ("tiny", "dp2_gtp4"), ("tiny", "ep2_gtp2_tp2")])
def test_transformer_shard_dims_unchanged(name, mesh_name) -> None:
    """Where its dims divide, the built-in transformer keeps its layout: the metadata's dim,
    else the first free one. (The toy's 4 heads on gtp=8 would pad to 8, twice the bytes:
    there the out kernel moves to its head dim of 24, as intended.)"""
    from gtp_jax.base.metadata import SHARD_DIM, STACKED
    from gtp_jax.models import Transformer, preset
    from gtp_jax.sharding.plan import choose_shard_dim, model_splits

    sizes = ({"d_model": 96, "n_heads": 4, "d_ff": 200, "vocab_size": 250, "n_layers": 3,
              "max_seq_len": 16} if name == "tiny" else {})
    cfg = preset(name, **sizes)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    mesh = get_mesh(mesh_name)
    align = gtp_jax.GTPConfig().alignment(mesh.shape["gtp"])
    checked = 0
    for keys, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        path, meta = "/".join(map(str, keys)), var.get_metadata()
        shape = tuple(var.get_value().shape)
        per_layer = shape[1:] if meta.get(STACKED) else shape
        if len(per_layer) < 2:
            continue
        splits = model_splits(path, per_layer, meta, mesh, "gtp")
        local = list(per_layer)
        for sp in splits:
            local[sp.dim] = sp.local_size
        taken = {sp.dim for sp in splits}
        first = next((d for d in range(len(local)) if d not in taken), None)
        got = choose_shard_dim(path, tuple(local), meta, splits, align=align)
        assert got == meta.get(SHARD_DIM, first), path
        checked += 1
    assert checked >= 5


# --------------------------------------------------------------------------- exact or refused
#
# Each class below once gave another answer than the unsharded module without an error: a
# parameter written in __call__ (dropped), randomness handed to the call (the same mask on
# every data shard), a weight shared with the rest of the model (untied by the copy), and an
# operation across examples (per shard; no static check can see it: `check_sharded`).

CFG0 = gtp_jax.GTPConfig(min_elements=0)


def _one_line_error(call, *names: str) -> str:
    with pytest.raises(UsageError) as err:
        call()
    msg = str(err.value)
    assert "\n" not in msg, msg
    for name in names:
        assert name in msg, msg
    return msg


class Layer(nnx.Module):
    """A linear layer that may write its own kernel in __call__ (weight decay in the
    forward pass)."""

    def __init__(self, rngs, write=False):
        self.lin = nnx.Linear(16, 16, rngs=rngs)
        self.write = write

    def __call__(self, x):
        if self.write:
            self.lin.kernel[...] = self.lin.kernel[...] * 0.5
        return x + self.lin(x)


class Counted(nnx.Module):
    """A call counter kept as a parameter."""

    def __init__(self):
        self.lin = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
        self.calls = nnx.Param(jnp.zeros(()))

    def __call__(self, x):
        self.calls[...] += 1
        return self.lin(x)


class SetValue(Counted):
    def __call__(self, x):
        self.lin.bias.set_value(self.lin.bias.get_value() + jnp.mean(x))
        return self.lin(x)


class Lifted(nnx.Module):
    """The layer run through one of NNX's lifted transforms (each hands every variable back
    as a new traced value)."""

    def __init__(self, how, write=False):
        self.how = how
        self.layer = Layer(nnx.Rngs(0), write)

    def __call__(self, x):
        if self.how == "remat":
            return nnx.remat(lambda b, h: b(h))(self.layer, x)
        if self.how == "jit":
            return nnx.jit(lambda b, h: b(h))(self.layer, x)
        if self.how == "cond":
            return nnx.cond(jnp.sum(x) > -1e9, lambda b, h: b(h), lambda b, h: h, self.layer, x)
        return nnx.vmap(lambda b, h: b(h), in_axes=(None, 0))(self.layer, x)


class Scanned(nnx.Module):
    """Three layers stacked by nnx.vmap and run by nnx.scan."""

    def __init__(self, write=False):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Layer(rngs, write)

        self.layers = make(nnx.Rngs(0))

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(layer, h):
            return layer(h)

        return run(self.layers, x)


def _x(mesh, key=None, rows=8):
    x = jnp.ones((rows, 16)) if key is None else jax.random.normal(key, (rows, 16))
    return _place(mesh, x)


@pytest.mark.parametrize("make, path", [
    (Counted, "'calls'"),
    (SetValue, "'lin/bias'"),
    (lambda: Lifted("jit", write=True), "'layer/lin/kernel'"),
    (lambda: Lifted("cond", write=True), "'layer/lin/kernel'"),
    (lambda: Scanned(write=True), "'layers/lin/kernel'"),
    (lambda: Lifted("remat", write=True), "shape (16, 16)"),  # weights gathered where read
])
@pytest.mark.parametrize("jit", [False, True])
def test_parameter_written_in_call_is_refused_before_anything_changes(make, path, jit) -> None:
    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(make(), mesh, CFG0)
    before = snapshot(sm)
    call = nnx.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    _one_line_error(lambda: call(sm, _x(mesh)), path, "__call__", "BatchSum", "optimizer")
    assert_unchanged(sm, before)


def test_rng_key_written_in_call_is_refused() -> None:
    class Reseeds(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
            self.rngs = nnx.Rngs(1)

        def __call__(self, x):
            self.rngs.default.key[...] = jax.random.key(5)
            return self.lin(x)

    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(Reseeds(), mesh, CFG0)
    key = np.asarray(jax.random.key_data(sm.module.rngs.default.key[...]))
    _one_line_error(lambda: sm(_x(mesh)), "'rngs/default/key'", "nnx.reseed")
    np.testing.assert_array_equal(jax.random.key_data(sm.module.rngs.default.key[...]), key)


@pytest.mark.parametrize("make", [lambda: Lifted("remat"), lambda: Lifted("jit"),
                                  lambda: Lifted("cond"), lambda: Lifted("vmap"), Scanned])
def test_parameters_passed_on_by_lifted_transforms_are_not_writes(make, key) -> None:
    mesh = get_mesh("dp2_gtp4")
    ref = make()
    sm = gtp_jax.shard(_copy(ref), mesh, CFG0)
    x = jax.random.normal(key, (8, 16))
    out = nnx.jit(lambda m, x: m(x))(sm, _place(mesh, x))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref(x)), rtol=1e-5, atol=1e-5)
    g = nnx.jit(nnx.grad(lambda m, x: jnp.mean(m(x) ** 2)))(sm, _place(mesh, x))
    _assert_grads_equal(sm, g, nnx.grad(lambda m, x: jnp.mean(m(x) ** 2))(ref, x), rtol=1e-4)


class Dropped(nnx.Module):
    """Dropout with randomness handed to the call."""

    def __init__(self):
        self.lin = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None, key=None):
        h = self.lin(x)
        if key is not None:
            return h * jax.random.bernoulli(key, 0.5, h.shape)
        return self.drop(h, rngs=rngs)


@pytest.mark.parametrize("args, kwargs, name", [
    (lambda: (nnx.Rngs(dropout=1),), {}, "args[1]"),
    (lambda: (), lambda: {"rngs": nnx.Rngs(dropout=1)}, "kwargs['rngs']"),
    (lambda: (nnx.Rngs(dropout=1).dropout,), {}, "args[1]"),
    (lambda: (), lambda: {"key": jax.random.key(1)}, "kwargs['key']"),
    (lambda: (), lambda: {"key": gtp_jax.replicated(jax.random.split(jax.random.key(1), 8))},
     "kwargs['key']"),
])
@pytest.mark.parametrize("jit", [False, True])
def test_randomness_handed_to_the_call_is_refused(args, kwargs, name, jit) -> None:
    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(Dropped(), mesh, CFG0)
    before = snapshot(sm)
    a, k = args(), (kwargs() if callable(kwargs) else kwargs)
    call = nnx.jit(lambda m, x, a, k: m(x, *a, **k)) if jit else (
        lambda m, x, a, k: m(x, *a, **k))
    _one_line_error(lambda: call(sm, _x(mesh), a, k), name, "same random bits",
                    "jax.random.split(key, batch)")
    assert_unchanged(sm, before)


def test_one_key_per_example_is_a_batch_and_exact(key) -> None:
    class PerExampleNoise(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(16, 16, rngs=nnx.Rngs(0))

        def __call__(self, x, keys):
            mask = jax.vmap(lambda k: jax.random.bernoulli(k, 0.5, (16,)))(keys)
            return self.lin(x) * mask

    mesh = get_mesh("dp2_gtp4")
    ref = PerExampleNoise()
    sm = gtp_jax.shard(_copy(ref), mesh, CFG0)
    x = jax.random.normal(key, (8, 16))
    keys = jax.random.split(jax.random.key(3), 8)
    out = nnx.jit(lambda m, x, k: m(x, k))(sm, _place(mesh, x), keys)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref(x, keys)), rtol=1e-5,
                               atol=1e-5)
    assert len({tuple(row) for row in np.asarray(out != 0)}) > 1  # masks differ per example


@pytest.mark.parametrize("arg", [lambda: nnx.Linear(16, 16, rngs=nnx.Rngs(2)),
                                 lambda: nnx.Param(jnp.ones((8, 16)))])
def test_module_or_variable_handed_to_the_call_is_refused(arg) -> None:
    class Takes(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(16, 16, rngs=nnx.Rngs(0))

        def __call__(self, x, other):
            return self.lin(x) + (other(x) if callable(other) else other[...])

    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(Takes(), mesh, CFG0)
    _one_line_error(lambda: sm(_x(mesh), arg()), "args[1]", "part of the sharded module")


class TiedHead(nnx.Module):
    def __init__(self, embed):
        self.embed = embed
        self.proj = nnx.Linear(16, 16, rngs=nnx.Rngs(1))

    def __call__(self, h):
        return self.proj(h) @ self.embed.embedding[...].T


class TiedLM(nnx.Module):
    """Input embedding and output head share one table (a tied embedding)."""

    def __init__(self):
        self.embed = nnx.Embed(32, 16, rngs=nnx.Rngs(0))
        self.head = TiedHead(self.embed)

    def __call__(self, tokens):
        return self.head(self.embed(tokens))


class SharedKernel(nnx.Module):
    """Two layers of a block list share one kernel variable."""

    def __init__(self):
        self.blocks = nnx.List([nnx.Linear(16, 16, rngs=nnx.Rngs(i)) for i in range(2)])
        self.blocks[1].kernel = self.blocks[0].kernel

    def __call__(self, x):
        return self.blocks[1](self.blocks[0](x))


class TwiceUsed(nnx.Module):
    """One block used at two places."""

    def __init__(self):
        block = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
        self.first, self.second = block, block

    def __call__(self, x):
        return self.second(self.first(x))


@pytest.mark.parametrize("make, part, names", [
    (TiedLM, "head", ("'embed'", "'embed' of the TiedLM")),
    (SharedKernel, lambda m: m.blocks[1], ("'kernel'", "'blocks/0/kernel'")),
    (TwiceUsed, "first", ("2 places", "'first'", "'second'")),
])
def test_weight_shared_with_the_rest_of_the_model_is_refused(make, part, names) -> None:
    mesh = get_mesh("dp2_gtp4")
    model = make()
    sub = part(model) if callable(part) else getattr(model, part)
    before = snapshot(model)
    _one_line_error(lambda: gtp_jax.shard(sub, mesh, CFG0), *names,
                    "shard the module that holds every use of it")
    assert_unchanged(model, before)
    # Sharding the whole model keeps the shared weight one weight: exact.
    ref = make()
    sm = gtp_jax.shard(_copy(ref), mesh, CFG0)
    x = (jax.random.randint(jax.random.key(0), (8, 5), 0, 32) if make is TiedLM
         else jax.random.normal(jax.random.key(0), (8, 16)))

    def loss(m, x):
        return jnp.mean(m(x) ** 2)

    np.testing.assert_allclose(float(nnx.jit(loss)(sm, _place(mesh, x))), float(loss(ref, x)),
                               rtol=1e-5)
    g = nnx.jit(nnx.grad(loss))(sm, _place(mesh, x))
    _assert_grads_equal(sm, g, nnx.grad(loss)(ref, x), rtol=1e-4)


class _Trainer:
    """A plain object holding the model (as a training script's trainer does)."""

    def __init__(self, model):
        self.model = model


@pytest.mark.parametrize("hold", ["trainer", "list", "dict"])
def test_a_shared_weight_is_refused_whatever_plain_object_holds_the_model(hold) -> None:
    # The models around a sharded part are found among the callers' variables, also
    # inside a plain object's attributes and a list or dict.
    mesh = get_mesh("dp2_gtp4")
    holder = {"trainer": lambda m: _Trainer(m), "list": lambda m: [m],
              "dict": lambda m: {"lm": m}}[hold](TiedLM())

    def shard_head(held):  # no variable holds the model itself, only `held`
        return gtp_jax.shard((held.model if hold == "trainer" else held[0] if hold == "list"
                              else held["lm"]).head, mesh, CFG0)

    _one_line_error(lambda: shard_head(holder), "'embed' of the TiedLM",
                    "shard the module that holds every use of it")


def test_model_assembled_from_a_sharded_part_and_its_originals_is_refused_by_the_step() -> None:
    import optax

    from gtp_jax.train import TrainStep

    class Assembled(nnx.Module):
        def __init__(self, embed, head):
            self.embed, self.head = embed, head

        def __call__(self, tokens):
            return self.head(self.embed(tokens))

    mesh = get_mesh("dp2_gtp4")
    embed = nnx.Embed(32, 16, rngs=nnx.Rngs(0))
    head = gtp_jax.shard(TiedHead(embed), mesh, CFG0)  # nothing holds embed twice yet
    model = Assembled(embed, head)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    _one_line_error(lambda: TrainStep(model, optimizer, lambda m, t: jnp.mean(m(t) ** 2)),
                    "TrainStep", "'embed'", "'head'")


# --------------------------------------------------------------------------- check_sharded


class Centered(nnx.Module):
    """An MLP that subtracts the batch mean of its hidden layer: a cross-example operation,
    which each data shard computes over its own examples."""

    def __init__(self, center=True):
        self.up = nnx.Linear(16, 64, rngs=nnx.Rngs(0))
        self.down = nnx.Linear(64, 16, rngs=nnx.Rngs(1))
        self.center = center

    def __call__(self, x):
        h = jax.nn.gelu(self.up(x))
        if self.center:
            h = h - h.mean(0)
        return self.down(h)


def test_check_sharded_passes_an_exact_module_and_changes_nothing(key) -> None:
    from test_written_state import Tracker

    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(Tracker(), mesh, CFG0)
    before = snapshot(sm)
    report = gtp_jax.check_sharded(sm, 3.0 + jax.random.normal(key, (16, 4)))
    assert isinstance(report, gtp_jax.ShardCheck) and report.ok and report.first is None
    kinds = {leaf.kind for leaf in report.leaves}
    assert kinds == {"output", "state", "gradient"}
    assert {leaf.path for leaf in report.leaves if leaf.kind == "gradient"} == {
        "lin/kernel", "lin/bias"}
    # float32 on CPU: 64 x float32's eps; integer state must be equal
    f32 = [leaf.tolerance for leaf in report.leaves if leaf.dtype == "float32"]
    assert f32 and all(t == pytest.approx(64 * 2.0 ** -23) for t in f32)
    assert all(leaf.tolerance == 0 and leaf.error == 0 for leaf in report.leaves
               if leaf.dtype == "int32")
    assert_unchanged(sm, before)


@pytest.mark.parametrize("config, tolerance", [
    (gtp_jax.GTPConfig(min_elements=0), 64 * 2.0 ** -23),
    (gtp_jax.GTPConfig(min_elements=0, gather_dtype=jnp.bfloat16), 8 * 2.0 ** -7),
])
def test_check_sharded_names_an_operation_across_examples(config, tolerance, key) -> None:
    mesh = get_mesh("dp2_gtp4")
    x = jax.random.normal(key, (16, 16))
    good = gtp_jax.check_sharded(gtp_jax.shard(Centered(center=False), mesh, config), x)
    assert good.ok and max(leaf.tolerance for leaf in good.leaves) == pytest.approx(tolerance)
    sm = gtp_jax.shard(Centered(), mesh, config)
    msg = _one_line_error(lambda: gtp_jax.check_sharded(sm, x), "output 'output'",
                          "across examples", "h - h.mean(0)")
    assert "nnx.Rngs" not in msg
    report = gtp_jax.check_sharded(sm, x, raise_on_mismatch=False)
    assert not report.ok and report.first.kind == "output"
    assert report.first.error > 10 * report.first.tolerance
    # with the caller's loss, on their own labels
    y = jnp.sin(x)
    with pytest.raises(UsageError, match="output 'output'"):
        gtp_jax.check_sharded(sm, x, loss_fn=lambda out: jnp.mean((out - y) ** 2))


def test_check_sharded_names_state_whose_rule_does_not_hold(key) -> None:
    class WrongRule(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
            self.last_mean = gtp_jax.SameOnEveryShard(jnp.zeros((16,)))

        def __call__(self, x):
            y = self.lin(x)
            self.last_mean[...] = y.mean(0)  # not the same on every shard
            return y

    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(WrongRule(), mesh, CFG0)
    _one_line_error(lambda: gtp_jax.check_sharded(sm, jax.random.normal(key, (16, 16))),
                    "state 'last_mean'", "SameOnEveryShard")


def test_check_sharded_says_held_randomness_differs_by_design(key) -> None:
    class Drop(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.drop(self.lin(x))

    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(Drop(), mesh, CFG0)
    x = jax.random.normal(key, (16, 16))
    _one_line_error(lambda: gtp_jax.check_sharded(sm, x), "nnx.Rngs", "model.eval()")
    sm.eval()
    assert gtp_jax.check_sharded(sm, x).ok


def test_check_sharded_refuses_what_it_cannot_check() -> None:
    with pytest.raises(gtp_jax.UsageTypeError, match="ShardedModule"):
        gtp_jax.check_sharded(Centered(), jnp.ones((8, 16)))
    sm = gtp_jax.shard(Centered(), get_mesh("gtp8"), CFG0)
    with pytest.raises(gtp_jax.UsageTypeError, match="loss_fn"):
        gtp_jax.check_sharded(sm, jnp.ones((8, 16)), loss_fn=3)
    with pytest.raises(UsageError, match="scalar"):
        gtp_jax.check_sharded(sm, jnp.ones((8, 16)), loss_fn=lambda out: out)


def test_weights_stored_as_they_are_are_copies_never_the_same_buffer() -> None:
    """A weight whose stored layout is its logical one (no padding, no fused parts) moves
    into its sharding by a copy rather than a program of its own; `shard` and `unshard`
    never hand out a buffer of the module they read, so deleting (or donating, as a
    training step does) one side's arrays leaves the other's intact."""
    mesh = get_mesh("dp2_gtp4")
    model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    want = np.asarray(model.kernel.get_value())
    first = gtp_jax.shard(model, mesh, CFG0)
    assert first.plan and all(p.stored_as_is for p in first.plan)
    # The original now holds its kernel already in the stored sharding.
    model.kernel.set_value(first.module.kernel.get_value())
    sharded = gtp_jax.shard(model, mesh, CFG0)
    sharded.module.kernel.get_value().delete()
    np.testing.assert_array_equal(np.asarray(model.kernel.get_value()), want)
    full = gtp_jax.unshard(first)
    first.module.kernel.get_value().delete()
    np.testing.assert_array_equal(np.asarray(full.kernel.get_value()), want)
