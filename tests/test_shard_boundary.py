"""What crosses the boundary of a sharded call without being seen: a variable the model
holds outside the sharded part, randomness made inside the call, a plain attribute the call
sets, a raw PRNG key argument, batch statistics. Each is exact or refused in one line naming
it, before any state changes, however the model is called (eagerly, under ``nnx.jit``,
``nnx.value_and_grad`` and ``nnx.Optimizer`` as the README trains, or `TrainStep`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_unchanged, get_mesh, snapshot

import gtp_jax
from gtp_jax.base.errors import UsageError

CFG = gtp_jax.GTPConfig(min_elements=0)


def _mesh():
    return get_mesh("dp2_gtp4")


def _x(rows=16, seed=0):
    x = jax.random.normal(jax.random.key(seed), (rows, 4))
    return jax.device_put(x, gtp_jax.data_sharding(_mesh(), 2))


def _one_line(call, *names: str) -> str:
    with pytest.raises(UsageError) as err:
        call()
    msg = str(err.value)
    assert "\n" not in msg, msg
    for name in names:
        assert name in msg, msg
    return msg


def _loss(m, x):
    return jnp.mean(m(x) ** 2)


# --------------------------------------------------------------------- a variable held twice


class Inner(nnx.Module):
    def __init__(self, proj):
        self.proj = proj
        self.up = nnx.Linear(8, 8, rngs=nnx.Rngs(2))

    def __call__(self, h):
        return self.up(self.proj(h))


class PassesItsLayer(nnx.Module):
    """The model hands its own layer to the part it shards, and calls it itself too."""

    def __init__(self, shard=True):
        self.proj = nnx.Linear(4, 8, rngs=nnx.Rngs(1))
        inner = Inner(self.proj)
        self.inner = gtp_jax.shard(inner, _mesh(), CFG) if shard else inner

    def __call__(self, x):
        return self.inner(x) + self.proj(x)


class Trunk(nnx.Module):
    def __init__(self):
        self.embed = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.body = nnx.Linear(8, 8, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.body(self.embed(x))


class KeepsAPart(nnx.Module):
    """The model shards a trunk, then keeps the trunk's (original) embedding."""

    def __init__(self, shard=True):
        trunk = Trunk()
        self.trunk = gtp_jax.shard(trunk, _mesh(), CFG) if shard else trunk
        self.emb = trunk.embed

    def __call__(self, x):
        return self.trunk(x) + self.emb(x)


class TwoParts(nnx.Module):
    """Two sharded parts built around one layer."""

    def __init__(self, shard=True):
        proj = nnx.Linear(4, 8, rngs=nnx.Rngs(1))
        wrap = (lambda m: gtp_jax.shard(m, _mesh(), CFG)) if shard else (lambda m: m)
        self.a, self.b = wrap(Inner(proj)), wrap(Inner(proj))

    def __call__(self, x):
        return self.a(x) + self.b(x)


def _readme_training(model, steps=3):
    """Plain nnx.jit + nnx.Optimizer, as the README trains a model."""
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(_loss)(model, x)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer, _x())) for _ in range(steps)]


@pytest.mark.parametrize("make, names", [
    (PassesItsLayer, ("'proj'", "'inner'")),
    (KeepsAPart, ("'emb'", "'trunk'")),
    (TwoParts, ("'a'", "'b'")),
])
@pytest.mark.parametrize("how", ["readme", "eager", "train_step"])
def test_a_variable_the_model_holds_beside_its_sharded_part_is_refused(make, names,
                                                                       how) -> None:
    """Trained as the README shows, the unsharded model keeps one variable where the sharded
    one had two drifting copies (losses 2% apart by step 3); now every call refuses it."""
    model = make()
    before = snapshot(model)
    if how == "readme":
        call = lambda: _readme_training(model)  # noqa: E731
    elif how == "eager":
        call = lambda: nnx.grad(_loss)(model, _x())  # noqa: E731
    else:
        from gtp_jax.train import TrainStep

        call = lambda: TrainStep(  # noqa: E731
            model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), _loss)(_x())
    _one_line(call, *names, "shard the module that holds every use of it")
    assert_unchanged(model, before)


def test_the_same_model_sharded_whole_trains_like_the_unsharded_one() -> None:
    """The fix the refusal names: shard the whole model; shared variables stay one."""
    for make in (PassesItsLayer, KeepsAPart, TwoParts):
        ref = _readme_training(make(shard=False))
        got = _readme_training(gtp_jax.shard(make(shard=False), _mesh(), CFG))
        np.testing.assert_allclose(got, ref, rtol=1e-5, err_msg=make.__name__)


def test_sharded_copies_of_one_module_held_apart_are_accepted() -> None:
    """Two sharded copies of one module, each its own model (e.g. compared on two meshes),
    and an unsharded reference sharing its variables: nothing is held twice in one model."""
    ref = Trunk()
    a = gtp_jax.shard(nnx.merge(*nnx.split(ref)), _mesh(), CFG)
    b = gtp_jax.shard(ref, get_mesh("gtp8"), CFG)
    want = np.asarray(ref(np.asarray(_x())))
    for sm in (a, b):
        np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, x: m(x))(sm, _x())), want,
                                   rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------- randomness in the call


class Draws(nnx.Module):
    """Noise made inside __call__ from a key built there."""

    def __init__(self, how):
        self.lin = nnx.Linear(4, 64, rngs=nnx.Rngs(0))
        self.how = how

    def __call__(self, x, seed=3):
        h = self.lin(x)
        how = self.how
        if how == "python int":
            key = jax.random.key(seed)
        elif how == "raw constant":
            key = jax.random.PRNGKey(0)
        elif how == "split":
            key = jax.random.split(jax.random.key(0))[1]
        elif how == "fold_in":
            key = jax.random.fold_in(jax.random.key(0), 7)
        elif how == "inside jit":
            return jax.jit(lambda h: h * jax.random.bernoulli(jax.random.key(1), 0.5,
                                                              h.shape))(h)
        elif how == "inside remat":
            return jax.checkpoint(lambda h: h + jax.random.normal(jax.random.key(1),
                                                                  h.shape))(h)
        elif how == "inside scan":
            def row(c, r):
                return jax.random.fold_in(c, 1), r * jax.random.bernoulli(c, 0.5, r.shape)

            return jax.lax.scan(row, jax.random.key(2), h)[1]
        else:  # constant
            key = jax.random.key(0)
        return h * jax.random.bernoulli(key, 0.5, h.shape)


@pytest.mark.parametrize("how", ["constant", "python int", "raw constant", "split",
                                 "fold_in", "inside jit", "inside remat", "inside scan"])
@pytest.mark.parametrize("jit", [False, True])
def test_randomness_from_a_key_built_in_the_call_is_refused(how, jit) -> None:
    """Every data shard would build the same key and draw the same bits: 2 distinct masks
    over 16 rows instead of 16."""
    sm = gtp_jax.shard(Draws(how), _mesh(), CFG)
    before = snapshot(sm)
    call = nnx.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    _one_line(lambda: call(sm, _x()), "same on every data shard", "jax.random.key(seed)",
              "nnx.Rngs", "jax.random.split(key, batch)")
    assert_unchanged(sm, before)


class KeyedByData(nnx.Module):
    def __init__(self, how):
        self.lin = nnx.Linear(4, 64, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1)) if how == "held" else None
        self.how = how

    def __call__(self, x, keys=None):
        h = self.lin(x)
        if self.how == "held":
            return self.drop(h)
        if self.how == "per example":
            return h * jax.vmap(lambda k: jax.random.bernoulli(k, 0.5, (64,)))(keys)
        # a key made from each example's data: different on every shard
        seeds = jax.lax.bitcast_convert_type(x[:, 0], jnp.uint32)
        return h * jax.vmap(lambda s: jax.random.bernoulli(jax.random.key(s), 0.5, (64,)))(
            seeds)


@pytest.mark.parametrize("how", ["held", "per example", "from the data"])
def test_randomness_that_differs_per_shard_is_accepted(how) -> None:
    sm = gtp_jax.shard(KeyedByData(how), _mesh(), CFG)
    keys = jax.random.split(jax.random.key(4), 16)
    out = np.asarray(nnx.jit(lambda m, x, k: m(x, k))(sm, _x(), keys if how == "per example"
                                                       else None))
    assert len({tuple(r) for r in (out != 0)}) > 8  # not one mask repeated per shard
    if how != "held":  # the unsharded module's bits exactly
        np.testing.assert_allclose(out, np.asarray(KeyedByData(how)(np.asarray(_x()), keys)),
                                   rtol=1e-5, atol=1e-6)


def test_a_raw_key_argument_is_refused_naming_typed_keys_and_replicated() -> None:
    class TakesKey(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))

        def __call__(self, x, key):
            return self.lin(x) * jax.random.bernoulli(key, 0.5, (8,))

    sm = gtp_jax.shard(TakesKey(), _mesh(), CFG)
    for call in (lambda: sm(_x(), jax.random.PRNGKey(0)),
                 lambda: nnx.jit(lambda m, x, k: m(x, k))(sm, _x(), jax.random.PRNGKey(1))):
        _one_line(call, "args[1]", "raw PRNG key", "typed key", "gtp_jax.replicated",
                  "jax.random.split")


# --------------------------------------------------------------------- plain attributes


class SetsAttributes(nnx.Module):
    def __init__(self, how):
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.how, self.calls, self.seen, self.history = how, 0, 0, []
        self.label = "plain"

    def __call__(self, x):
        if self.how == "counter":
            self.calls += 1
        elif self.how == "examples seen":
            self.seen += x.shape[0]  # the shard's 2 rows, not the batch's 16
        elif self.how == "list append":
            self.history.append(1)
        elif self.how == "new attribute":
            self.last_shape = x.shape
        elif self.how == "array":
            self.last_mean = jnp.mean(x)
        elif self.how == "nested":
            self.lin.extra = 1
        elif self.how == "same value":
            self.label = "plain"  # set, but unchanged: nothing is lost
        return self.lin(x)


@pytest.mark.parametrize("how, name", [
    ("counter", "'calls'"), ("examples seen", "'seen'"), ("list append", "'history'"),
    ("new attribute", "'last_shape'"), ("array", "'last_mean'"), ("nested", "'lin/extra'")])
@pytest.mark.parametrize("jit", [False, True])
def test_a_plain_attribute_set_in_the_call_is_refused(how, name, jit) -> None:
    """The call runs a copy of the module; the unsharded module keeps the new value (also
    under nnx.jit), so losing it was silent; carrying it back would be one shard's value."""
    sm = gtp_jax.shard(SetsAttributes(how), _mesh(), CFG)
    call = nnx.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    _one_line(lambda: call(sm, _x()), name, "__call__", "BatchSum")
    # (A list changed in place is the module's own object: the call's code changed it.)
    assert (sm.module.calls, sm.module.seen) == (0, 0)
    assert not hasattr(sm.module, "last_shape") and not hasattr(sm.module, "last_mean")


def test_an_attribute_set_to_its_own_value_is_no_write() -> None:
    ref = SetsAttributes("same value")
    sm = gtp_jax.shard(SetsAttributes("same value"), _mesh(), CFG)
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, x: m(x))(sm, _x())),
                               np.asarray(ref(np.asarray(_x()))), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------- batch statistics


class Normalized(nnx.Module):
    def __init__(self, running):
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(8, use_running_average=running, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.bn(self.lin(x))


def _with_statistics(running):
    m = Normalized(running)
    m.bn.mean[...] = jnp.linspace(-1, 1, 8)  # statistics a trained model would hold
    m.bn.var[...] = jnp.linspace(0.5, 2, 8)
    return m


def test_batch_norm_in_inference_mode_is_exact() -> None:
    """use_running_average=True (or model.eval()) only reads the statistics."""
    ref = _with_statistics(True)
    want = np.asarray(ref(np.asarray(_x())))
    sm = gtp_jax.shard(_with_statistics(True), _mesh(), CFG)
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, x: m(x))(sm, _x())), want,
                               rtol=1e-5, atol=1e-6)
    g = nnx.jit(nnx.grad(_loss))(sm, _x())
    g_ref = nnx.grad(_loss)(ref, np.asarray(_x()))
    full = gtp_jax.unshard_values(sm, g)
    np.testing.assert_allclose(np.asarray(full["lin/kernel"]),
                               np.asarray(g_ref.lin.kernel[...]), rtol=1e-4, atol=1e-6)
    trained = gtp_jax.shard(_with_statistics(False), _mesh(), CFG)
    trained.eval()  # a model trained elsewhere, evaluated sharded
    np.testing.assert_allclose(np.asarray(trained(_x())), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_batch_norm_in_training_mode_is_refused_before_anything_changes(jit) -> None:
    sm = gtp_jax.shard(_with_statistics(False), _mesh(), CFG)
    before = snapshot(sm)
    call = nnx.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    _one_line(lambda: call(sm, _x()), "'bn/", "batch statistics", "use_running_average=True")
    assert_unchanged(sm, before)


def test_scan_equations_are_read_in_every_jax_form() -> None:
    """The randomness check reads a scan's consts and carry from the installed jax's
    equation (``num_consts``/``num_carry``, or jax 0.11's ``ft_in`` flat trees), and an
    unknown form is reported as unknown, not an error."""
    from gtp_jax.sharding.contract import scan_counts

    def f(k, c, xs):  # one const, two carries that change every step, one xs
        return jax.lax.scan(lambda c, x: ((c[0] * k + x, c[1] + c[0]), x), c, xs)

    jaxpr = jax.make_jaxpr(f)(2.0, (1.0, 2.0), jnp.ones(3)).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert scan_counts(eqn.params) == (1, 2)
    assert scan_counts({"jaxpr": None, "length": 3}) is None
