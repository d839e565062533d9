"""`gtp_jax.train.TrainStep`: the one training step (``jax.jit`` over the split state,
donated) computes what an ``nnx.jit`` step computes, compiles once, shares its program
between equal steps, writes back on `sync`, and applies the loss function it is given."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, flat_values

import gtp_jax
from gtp_jax.models import lm_loss
from gtp_jax.train import TrainConfig, TrainStep, build_model_and_optimizer, model_config
from gtp_jax.train.step.train_step import step_program

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

#: float32, the suite's dp=2 x gtp=4 mesh, small enough to compile quickly (2 layers).
CFG = TrainConfig(steps=3, batch_size=8, seq_len=32, warmup=1, dp=2, gtp=4, layers=2)


def _batches(cfg: TrainConfig, mesh: jax.sharding.Mesh, count: int = 3) -> list[jax.Array]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (count, cfg.batch_size, cfg.seq_len + 1)).astype(np.int32)
    return [jax.device_put(t, gtp_jax.data_sharding(mesh)) for t in tokens]


def _loss(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """A loss function of this module only, so its program's trace count starts at 0."""
    return lm_loss(model, tokens)


@nnx.jit
def _nnx_jit_step(model: nnx.Module, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    """The old train step: ``nnx.jit`` over the objects, the whole-tree optimizer update."""
    loss, grads = nnx.value_and_grad(_loss)(model, tokens)
    optimizer.update(model, grads)
    return loss


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict]:
    """Losses and final parameters of 3 steps of an ``nnx.jit`` step (the old train step)."""
    model, optimizer = build_model_and_optimizer(CFG)
    losses = [float(_nnx_jit_step(model, optimizer, b)) for b in _batches(CFG, model.mesh)]
    return losses, flat_values(gtp_jax.unshard(model))


def test_matches_nnx_jit_step_compiles_once_and_syncs(reference) -> None:
    ref_losses, ref_params = reference
    model, optimizer = build_model_and_optimizer(CFG)
    step = TrainStep(model, optimizer, _loss)
    assert step.traces == 0
    losses, norms = [], []
    for batch in _batches(CFG, model.mesh):
        metrics = step(batch)
        assert set(metrics) == {"loss", "grad_norm", "lr"}
        assert all(m.dtype == np.float32 and m.shape == () for m in metrics.values())
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    assert step.traces == 1  # three calls, one trace (and so one compile)
    assert_close(losses, ref_losses, 1e-6, "losses")
    assert all(np.isfinite(norms)) and min(norms) > 0

    # The donated arrays the objects held are gone until sync writes the state back.
    kernel = model.module.embed.embedding
    assert kernel.get_value().is_deleted()
    step.sync()
    assert not kernel.get_value().is_deleted()
    assert int(optimizer.step.get_value()) == 3
    params = flat_values(gtp_jax.unshard(model))
    assert params.keys() == ref_params.keys()
    for key, value in params.items():
        assert_close(value, ref_params[key], 1e-6, str(key))

    # An equal model and optimizer with the same loss function reuse the program.
    model2, optimizer2 = build_model_and_optimizer(CFG)
    again = TrainStep(model2, optimizer2, _loss)
    again(_batches(CFG, model2.mesh)[0])
    assert again.traces == 1 and step.traces == 1


def test_equal_partials_share_a_program(mesh_dp2_gtp4) -> None:
    model, optimizer = build_model_and_optimizer(CFG)
    first = TrainStep(model, optimizer, functools.partial(lm_loss, aux_weight=0.25))
    second = TrainStep(model, optimizer, functools.partial(lm_loss, aux_weight=0.25))
    other = TrainStep(model, optimizer, functools.partial(lm_loss, aux_weight=0.5))
    assert first._program is second._program
    assert other._program is not first._program


def test_moe_aux_weight_is_applied() -> None:
    cfg = TrainConfig(steps=1, batch_size=8, seq_len=32, dp=2, gtp=4, moe_experts=4,
                      moe_top_k=2, layers=2)
    weight = 10.0 * model_config(cfg).moe_aux_weight
    model, optimizer = build_model_and_optimizer(cfg)
    batch = _batches(cfg, model.mesh, 1)[0]
    aux, plain = (float(x) for x in nnx.jit(  # one program for both
        lambda m, t: (m(t[:, :-1]).aux.mean(), lm_loss(m, t)))(model, batch))
    assert aux > 0
    step = TrainStep(model, optimizer, functools.partial(lm_loss, aux_weight=weight))
    loss = float(step(batch)["loss"])
    assert loss == pytest.approx(plain + weight * aux, rel=1e-5)
    assert loss - plain == pytest.approx(weight * aux, rel=1e-3)


# --------------------------------------------------------------------------- beyond the loss


class MLP(nnx.Module):
    def __init__(self):
        self.up = nnx.Linear(16, 64, rngs=nnx.Rngs(0))
        self.down = nnx.Linear(64, 4, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


@functools.cache
def _adamw():
    """One optimizer object: steps of equal models with it share their programs."""
    import optax

    return optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)


def _mlp(tx=None):
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    model = gtp_jax.shard(MLP(), mesh, gtp_jax.GTPConfig(min_elements=0))
    return model, nnx.Optimizer(model, _adamw() if tx is None else tx, wrt=nnx.Param), mesh


def _xy(mesh, seed=0, rows=16):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 16)).astype(np.float32)
    y = rng.integers(0, 4, rows).astype(np.int32)
    return (jax.device_put(x, gtp_jax.data_sharding(mesh, 2)),
            jax.device_put(y, gtp_jax.data_sharding(mesh, 1)))


def _ce(model, batch):
    import optax

    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _ce_aux(model, batch):
    import optax

    x, y = batch
    logits = model(x)
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    correct = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
    return per_example.mean(), {"accuracy": correct.mean(),
                                "per_class": jnp.bincount(y, correct, length=4)}


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_aux_metrics_are_returned_beside_the_step_metrics(grad_accum) -> None:
    model, optimizer, mesh = _mlp()
    plain_model, plain_optimizer, _ = _mlp()
    step = TrainStep(model, optimizer, _ce_aux, has_aux=True, grad_accum=grad_accum)
    plain = TrainStep(plain_model, plain_optimizer, _ce, grad_accum=grad_accum)
    assert step._program is not plain._program
    for seed in range(2):
        batch = _xy(mesh, seed)
        metrics, ref = step(batch), plain(batch)
        assert set(metrics) == {"loss", "grad_norm", "lr", "accuracy", "per_class"}
        assert set(ref) == {"loss", "grad_norm", "lr"}
        for name in ref:  # the same step: the metrics cost no other numbers
            assert_close(float(metrics[name]), float(ref[name]), 1e-6, name)
        assert metrics["per_class"].shape == (4,)
        assert 0.0 <= float(metrics["accuracy"]) <= 1.0
    assert step.traces == 1
    # The aux values are those of the model before the update (mean over microbatches).
    step.sync()
    x, y = (np.asarray(a) for a in _xy(mesh, 5))
    before = gtp_jax.unshard(model)
    # microbatch i: rows i, i + grad_accum, ... (computed before the step donates the state)
    parts = [jax.device_get(_ce_aux(before, (x[i::grad_accum], y[i::grad_accum]))[1])
             for i in range(grad_accum)]
    got = step(_xy(mesh, 5))
    for name in ("accuracy", "per_class"):
        assert_close(np.asarray(got[name]), np.mean([p[name] for p in parts], axis=0), 1e-6,
                     name)
    # An equal step with has_aux reuses the program.
    again = TrainStep(*_mlp()[:2], _ce_aux, has_aux=True, grad_accum=grad_accum)
    assert again._program is step._program


class _Noisy(nnx.Module):
    """Writes state in its call: dropout's RNG count and a `BatchSum` row counter."""

    def __init__(self):
        self.up = nnx.Linear(16, 24, rngs=nnx.Rngs(0))
        self.down = nnx.Linear(24, 4, rngs=nnx.Rngs(1))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=2))
        self.rows = gtp_jax.BatchSum(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.rows[...] = self.rows[...] + x.shape[0]
        return self.down(self.drop(jax.nn.gelu(self.up(x))))


def _rng_count(model) -> int:
    (count,) = [int(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(model, nnx.RngCount))]
    return count


@pytest.mark.parametrize("sharded", [False, True])
def test_grad_accum_carries_the_state_the_module_writes(sharded) -> None:
    """Dropout and counters under gradient accumulation: each microbatch sees the state the
    one before wrote (a new dropout mask, the rows counted), as consecutive calls would;
    unsharded, the step equals two calls of ``nnx.value_and_grad`` and one SGD update."""
    import optax

    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    model = gtp_jax.shard(_Noisy(), mesh, gtp_jax.GTPConfig(min_elements=0)) if sharded \
        else _Noisy()
    ref = _Noisy()
    step = TrainStep(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), _ce,
                     grad_accum=2)
    for seed in range(2):
        batch = _xy(mesh, seed)
        loss = float(step(batch)["loss"])
        x, y = (np.asarray(a) for a in batch)
        parts = [nnx.value_and_grad(_ce)(ref, (x[i::2], y[i::2])) for i in range(2)]
        grads = jax.tree.map(lambda a, b: (a + b) / 2, parts[0][1], parts[1][1])
        nnx.update(ref, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(ref, nnx.Param),
                                     grads))
        if not sharded:
            assert_close(loss, (float(parts[0][0]) + float(parts[1][0])) / 2, 1e-6, "loss")
    step.sync()
    inner = model.module if sharded else model
    assert int(inner.rows.get_value()) == 32  # 2 steps x 16 rows, counted once each
    assert _rng_count(inner) == _rng_count(ref) == 4  # one mask per microbatch
    if not sharded:
        for path, want in flat_values(ref).items():
            assert_close(flat_values(model)[path], want, 1e-6, path)


class _Odd(nnx.Module):
    """A 37 x 61 kernel: over gtp = 4 (or 8) it is stored zero-padded to 37 x 64."""

    def __init__(self, d_out: int = 61):
        self.up = nnx.Linear(37, d_out, rngs=nnx.Rngs(0))
        self.down = nnx.Linear(d_out, 4, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


@pytest.mark.parametrize("name", ["adafactor", "muon"])
def test_an_optimizer_that_reads_a_padded_weights_shape_is_refused(name) -> None:
    """Adafactor and Muon update a zero-padded stored weight differently from the logical
    one (shape-dependent factoring and scales): refused in one line before the step
    exists, unless the mesh pads nothing; elementwise optimizers train padded weights."""
    import optax

    make_tx = {"adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
               "muon": lambda: optax.contrib.muon(1e-2)}[name]
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    model = gtp_jax.shard(_Odd(), mesh, gtp_jax.GTPConfig(min_elements=0))
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    before = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    with pytest.raises(gtp_jax.UsageError,
                       match=r"^TrainStep: the optimizer updates the zero-padded stored weight "
                             r"module/up/kernel \(\(37, 64\), logically \(37, 61\)\).*"
                             r"Use sizes the mesh axis divides"):
        TrainStep(model, optimizer, _sq)
    jax.tree.map(np.testing.assert_array_equal, before,
                 jax.tree.map(np.asarray, nnx.state((model, optimizer))))
    # A loop of one's own checks the same way, once.
    from gtp_jax.train import check_optimizer  # noqa: PLC0415

    with pytest.raises(gtp_jax.UsageError, match=r"^check_optimizer: the optimizer updates "
                       r"the zero-padded stored weight module/up/kernel"):
        check_optimizer(model, optimizer)
    even = gtp_jax.shard(_Odd(64), mesh, gtp_jax.GTPConfig(min_elements=0))
    check_optimizer(even, nnx.Optimizer(even, make_tx(), wrt=nnx.Param))
    TrainStep(even, nnx.Optimizer(even, make_tx(), wrt=nnx.Param), _sq)  # nothing padded
    for tx in (optax.adamw(1e-2), optax.yogi(1e-2), optax.lamb(1e-2)):
        TrainStep(model, nnx.Optimizer(model, tx, wrt=nnx.Param), _sq)


def _sq(model, x):
    return jnp.mean(model(x) ** 2)


def test_weights_picked_by_where_their_path_starts_are_refused() -> None:
    """A sharded module's paths have 'module' first (the unsharded 'up/kernel' is
    'module/up/kernel'): a wrt filter, an optax mask or multi_transform labels that pick
    weights by their first key would freeze or decay other weights than unsharded. Refused
    in one line by TrainStep and check_optimizer; picking by a name anywhere passes."""
    import optax

    from gtp_jax.train import check_optimizer  # noqa: PLC0415

    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    model = gtp_jax.shard(_Odd(), mesh, gtp_jax.GTPConfig(min_elements=0))
    first_is_up = nnx.All(nnx.Param, lambda path, v: path[0] != "up")
    frozen = nnx.Optimizer(model, optax.adamw(1e-2), wrt=first_is_up)
    for run, where in ((lambda o: TrainStep(model, o, _sq), "TrainStep"),
                       (lambda o: check_optimizer(model, o), "check_optimizer")):
        with pytest.raises(gtp_jax.UsageError,
                           match=rf"^{where}: the optimizer's wrt filter selects "
                                 r"'module/up/bias' but would leave out 'up/bias', its path in "
                                 r"the unsharded model: paths inside a gtp_jax.ShardedModule"):
            run(frozen)

    def name(key):  # a key of an nnx.State path (a dict key or an attribute)
        return getattr(key, "key", getattr(key, "name", None))

    def by_first_key(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "frozen" if name(path[0]) == "up" else "train", params)

    labelled = nnx.Optimizer(model, optax.multi_transform(
        {"frozen": optax.set_to_zero(), "train": optax.adam(1e-2)}, by_first_key),
        wrt=nnx.Param)
    masked = nnx.Optimizer(model, optax.masked(optax.adam(1e-2), lambda p: jax.tree_util.
                           tree_map_with_path(lambda path, _: name(path[0]) != "up", p)),
                           wrt=nnx.Param)
    for optimizer in (labelled, masked):
        with pytest.raises(gtp_jax.UsageError, match=r"^TrainStep: the optimizer's masks or "
                           r"labels .* pick other weights on the sharded model .*"
                           r"'module/down/bias', the unsharded model's 'down/bias'"):
            TrainStep(model, optimizer, _sq)
    # By a name anywhere in the path, or by type: the same weights either way.
    for wrt in (nnx.All(nnx.Param, lambda path, v: "up" not in path),
                nnx.All(nnx.Param, nnx.Not(nnx.PathContains("up")))):
        TrainStep(model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=wrt), _sq)
    anywhere = nnx.Optimizer(model, optax.multi_transform(
        {"frozen": optax.set_to_zero(), "train": optax.adam(1e-2)},
        lambda p: jax.tree_util.tree_map_with_path(
            lambda path, _: "frozen" if "up" in [name(k) for k in path] else "train", p)),
        wrt=nnx.Param)
    check_optimizer(model, anywhere)
    plain = _Odd()  # unsharded: nothing to compare
    check_optimizer(plain, nnx.Optimizer(plain, optax.adamw(1e-2), wrt=first_is_up))


@pytest.mark.parametrize("name, make_tx, lr", [
    ("inject_hyperparams", lambda o: o.inject_hyperparams(o.adamw)(learning_rate=0.02), 0.02),
    ("chain", lambda o: o.chain(o.clip_by_global_norm(1.0),
                                o.inject_hyperparams(o.sgd)(learning_rate=0.03)), 0.03),
    ("multi_transform", lambda o: o.multi_transform(
        {"a": o.inject_hyperparams(o.adamw)(learning_rate=0.04)},
        lambda p: jax.tree.map(lambda _: "a", p)), 0.04),
    ("MultiSteps", lambda o: o.MultiSteps(o.inject_hyperparams(o.sgd)(learning_rate=0.05),
                                          1), 0.05),
    ("plain", lambda o: o.adamw(1e-3), None),
])
def test_lr_is_returned_wherever_the_optimizer_state_holds_it(name, make_tx, lr) -> None:
    import optax

    model, optimizer, mesh = _mlp(make_tx(optax))
    metrics = TrainStep(model, optimizer, _ce)(_xy(mesh))
    if lr is None:  # a fixed rate given to a plain optimizer is not in its state
        assert set(metrics) == {"loss", "grad_norm"}
    else:
        assert set(metrics) == {"loss", "grad_norm", "lr"}, name
        assert float(metrics["lr"]) == pytest.approx(lr) and metrics["lr"].dtype == np.float32


def test_evaluate_is_the_loss_of_the_current_state_without_an_update() -> None:
    model, optimizer, mesh = _mlp()
    step = TrainStep(model, optimizer, _ce_aux, has_aux=True)
    batch = _xy(mesh, 3)
    loss, aux = step.evaluate(batch)  # the step's own loss function and its has_aux
    assert set(aux) == {"accuracy", "per_class"} and loss.dtype == np.float32
    assert_close(float(step.evaluate(batch)[0]), float(loss), 0.0, "repeat")  # no update
    assert_close(float(step(batch)["loss"]), float(loss), 1e-6, "step loss")
    after = step.evaluate(batch, _ce)  # another loss function: a scalar
    assert after.shape == () and float(after) < float(loss)
    assert_close(float(step.evaluate(batch, _ce_aux, has_aux=True)[0]), float(after), 1e-6,
                 "has_aux")
    assert len(step._program.evals) == 2  # one program per (loss function, has_aux)


@pytest.mark.parametrize("loss_fn, has_aux, match", [
    (lambda m, b: (m(b[0]) ** 2).mean(axis=1), False, r"shape \(16,\), not a scalar"),
    (lambda m, b: jnp.sum(b[1]), False, "dtype int32"),
    (lambda m, b: (_ce(m, b), {"acc": 1.0}), False,
     r"has_aux=True \(TrainStep; the command line's --model takes a scalar loss\)"),
    (lambda m, b: _ce(m, b), True, "return \\(loss, aux\\)"),
    (lambda m, b: (_ce(m, b), [1.0]), True, "dict of metrics"),
    (lambda m, b: (_ce(m, b), {"lr": jnp.ones(())}), True, "'lr' is one of the step's own"),
    (lambda m, b: ((m(b[0]) ** 2).mean(axis=1), {}), True, "not a scalar"),
])
def test_a_loss_that_is_not_a_scalar_is_one_line(loss_fn, has_aux, match) -> None:
    model, optimizer, mesh = _mlp()
    before = flat_values(gtp_jax.unshard(model))
    step = TrainStep(model, optimizer, loss_fn, has_aux=has_aux)
    batch = _xy(mesh)
    for call in (lambda: step(batch), lambda: step.evaluate(batch)):
        with pytest.raises(gtp_jax.UsageError, match=match) as err:
            call()
        assert "\n" not in str(err.value) and "TrainStep" in str(err.value)
    step.sync()  # nothing was donated: the objects hold their values
    after = flat_values(gtp_jax.unshard(model))
    for path, value in before.items():
        np.testing.assert_array_equal(np.asarray(after[path]), np.asarray(value))


def test_without_a_data_axis_the_step_takes_each_layers_gradient_buffer() -> None:
    # On a mesh with no data axis the unrolled layer loop hands its gradient stacks over as
    # per-layer buffers stacked at the end (gtp_jax.sharding.loop._LayerGrads; XLA's GPU
    # compiler then makes no whole stack before the update): the same training as an
    # nnx.jit step of the same model, to float32 rounding.
    cfg = dataclasses.replace(CFG, dp=1, gtp=8)
    model, optimizer = build_model_and_optimizer(cfg)
    reference, ref_optimizer = build_model_and_optimizer(cfg)
    step = TrainStep(model, optimizer, _loss)
    batches = _batches(cfg, model.mesh)
    text = step_program(step.graphdef, _loss).lower(step.state, batches[0]).as_text()
    kernel = model.module.blocks.mlp.down.kernel.get_value()
    stack = "x".join(map(str, kernel.sharding.shard_shape(kernel.shape)))
    assert re.search(rf"stablehlo.concatenate .*-> tensor<{stack}xf32>", text), stack
    for batch in batches:
        assert_close(float(step(batch)["loss"]),
                     float(_nnx_jit_step(reference, ref_optimizer, batch)), 1e-6, "loss")
    step.sync()
    params, ref_params = flat_values(gtp_jax.unshard(model)), flat_values(
        gtp_jax.unshard(reference))
    for key, value in params.items():
        assert_close(value, ref_params[key], 1e-6, str(key))
