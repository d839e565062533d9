"""Misuse fails early with a clear error, and a failed shard() leaves its input untouched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    Mixed,
    assert_state_matches,
    assert_unchanged,
    flat_values,
    get_mesh,
    mixed_tokens,
    mse_loss,
    snapshot,
)

import gtp_jax
from gtp_jax.base.errors import UsageError


class Counter(nnx.Variable):
    """A non-Param variable type."""


class WithIntParam(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 48, rngs=rngs)
        self.table = nnx.Param(jnp.arange(48 * 16, dtype=jnp.int32).reshape(48, 16))

    def __call__(self, x):
        return self.lin(x)


class WithCounter(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 48, rngs=rngs)
        self.hist = Counter(jnp.zeros((48, 16), jnp.float32))

    def __call__(self, x):
        return self.lin(x)


class WithBatchNorm(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 48, rngs=rngs)
        self.bn = nnx.BatchNorm(48, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


class ScalarOut(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 48, rngs=rngs)

    def __call__(self, x):
        return jnp.mean(self.lin(x))


def _lin(seed: int = 0) -> nnx.Linear:
    return nnx.Linear(16, 48, rngs=nnx.Rngs(seed))


def _shard_fails(module: nnx.Module, exc: type[Exception], match: str, *args, **kwargs):
    before = snapshot(module)
    with pytest.raises(exc, match=match) as err:
        gtp_jax.shard(module, *args, **kwargs)
    assert_unchanged(module, before)
    return err


@pytest.mark.parametrize("sizes", [{"dp": 3, "gtp": 2}, {"gtp": 7}])
def test_wrong_mesh_product(sizes) -> None:
    with pytest.raises(ValueError, match="does not equal the number of devices"):
        gtp_jax.make_mesh(**sizes)


def test_axis_not_in_mesh(mesh_gtp8) -> None:
    err = _shard_fails(_lin(), ValueError, "nope", mesh_gtp8, gtp_jax.GTPConfig(axis="nope"))
    assert "GTPConfig.axis" in str(err.value)
    assert "gtp" in str(err.value)  # lists the axes that do exist


def test_mesh_without_gtp_axis() -> None:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    _shard_fails(_lin(), ValueError, "'gtp'", mesh, gtp_jax.GTPConfig(min_elements=0))


def test_nothing_eligible(mesh_gtp8) -> None:
    small = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    err = _shard_fails(small, ValueError, "no parameter", mesh_gtp8,
                       gtp_jax.GTPConfig(min_elements=10_000))
    assert "min_elements=10000" in str(err.value)
    # everything excluded is also "nothing eligible"
    _shard_fails(_lin(), ValueError, "no parameter", mesh_gtp8,
                 gtp_jax.GTPConfig(min_elements=0, exclude=("kernel", "bias")))
    # an include pattern that matches nothing
    _shard_fails(_lin(), ValueError, "no parameter", mesh_gtp8,
                 gtp_jax.GTPConfig(include=("no_such_param",)))


def test_include_non_float_param(mesh_gtp8) -> None:
    err = _shard_fails(WithIntParam(nnx.Rngs(0)), TypeError, "table", mesh_gtp8,
                       gtp_jax.GTPConfig(min_elements=0, include=("table",)))
    assert "int32" in str(err.value)
    # Without include, the int param is silently left replicated.
    sm = gtp_jax.shard(WithIntParam(nnx.Rngs(0)), mesh_gtp8, gtp_jax.GTPConfig(min_elements=0))
    assert sm.sharded_paths() == ["lin/kernel"]


def test_include_non_param_variable(mesh_gtp8) -> None:
    err = _shard_fails(WithCounter(nnx.Rngs(0)), TypeError, "hist", mesh_gtp8,
                       gtp_jax.GTPConfig(min_elements=0, include=("hist", "kernel")))
    assert "Counter" in str(err.value)
    sm = gtp_jax.shard(WithCounter(nnx.Rngs(0)), mesh_gtp8, gtp_jax.GTPConfig(min_elements=0))
    assert sm.sharded_paths() == ["lin/kernel"]  # float Variables that are not Params: replicated


def test_include_scalar_param(mesh_gtp8) -> None:
    class WithScalar(nnx.Module):
        def __init__(self):
            self.lin = _lin()
            self.temperature = nnx.Param(jnp.asarray(1.0))

    _shard_fails(WithScalar(), ValueError, "temperature", mesh_gtp8,
                 gtp_jax.GTPConfig(include=("temperature",)))


def test_batch_norm_statistics_written_in_the_call_are_refused(mesh_gtp8) -> None:
    # Sharding is accepted (inference mode only reads the statistics:
    # test_shard_boundary.py); a call that writes them is refused, naming BatchNorm.
    sm = gtp_jax.shard(WithBatchNorm(nnx.Rngs(0)), mesh_gtp8, gtp_jax.GTPConfig(min_elements=0))
    with pytest.raises(UsageError, match="BatchNorm in training mode"):
        sm(jnp.ones((8, 16)))


def test_batch_not_divisible(mesh_dp2_gtp4) -> None:
    sm = gtp_jax.shard(_lin(), mesh_dp2_gtp4, gtp_jax.GTPConfig(min_elements=0))
    with pytest.raises(ValueError, match="batch dimension 12") as err:
        sm(jnp.ones((12, 16)))
    assert "multiple of 8" in str(err.value)
    with pytest.raises(ValueError, match="batch dimension 4"):
        nnx.jit(lambda m, x: m(x))(sm, jnp.ones((4, 16)))


def test_scalar_output_rejected(mesh_gtp8) -> None:
    sm = gtp_jax.shard(ScalarOut(nnx.Rngs(0)), mesh_gtp8, gtp_jax.GTPConfig(min_elements=0))
    with pytest.raises(ValueError, match="leading batch"):
        sm(jnp.ones((8, 16)))


def test_shard_twice(mesh_gtp8) -> None:
    sm = gtp_jax.shard(_lin(), mesh_gtp8, gtp_jax.GTPConfig(min_elements=0))
    before = snapshot(sm)
    with pytest.raises(ValueError, match="already sharded"):
        gtp_jax.shard(sm, mesh_gtp8, gtp_jax.GTPConfig(min_elements=0))
    assert_unchanged(sm, before)


def test_unshard_plain_module() -> None:
    with pytest.raises(TypeError, match="Linear"):
        gtp_jax.unshard(_lin())


@pytest.mark.parametrize("mesh", [None, "gtp", {"gtp": 8}, np.array(jax.devices())])
def test_mesh_must_be_a_mesh(mesh) -> None:
    _shard_fails(_lin(), TypeError, "jax.sharding.Mesh", mesh, gtp_jax.GTPConfig(min_elements=0))


def test_module_and_config_types(mesh_gtp8) -> None:
    with pytest.raises(TypeError, match="flax.nnx.Module"):
        gtp_jax.shard({"kernel": jnp.ones((16, 48))}, mesh_gtp8)
    _shard_fails(_lin(), TypeError, "GTPConfig", mesh_gtp8, {"min_elements": 0})


def test_gtp1_is_identity(key, seed) -> None:
    """On a gtp=1 axis (pure data parallel) shards are whole weights, computation unchanged."""
    mesh = get_mesh("dp8_gtp1")
    ref = Mixed(nnx.Rngs(seed))
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(min_elements=0))
    for plan in sm.plan:
        assert plan.spec.axis_size == 1
        assert plan.spec.padded_size == plan.spec.logical_shape[0]  # no padding
        assert plan.spec.shard_shape == plan.spec.logical_shape
    # Stored values are the reference values exactly, each device holding all of them.
    assert_state_matches(sm, ref, sm.plan, rtol=0.0, what="params")
    for value in flat_values(sm).values():
        assert all(s.data.shape == value.shape for s in value.addressable_shards)
    tokens = mixed_tokens(key)
    out_ref = ref(tokens)
    out = nnx.jit(lambda m, t: m(t))(sm, jax.device_put(tokens, gtp_jax.data_sharding(mesh)))
    # Each example sees the same weights and ops; only the batch split differs.
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=1e-6, atol=1e-6)
    grads_ref = nnx.jit(nnx.grad(mse_loss))(ref, tokens)
    grads = nnx.jit(nnx.grad(mse_loss))(sm, jax.device_put(tokens, gtp_jax.data_sharding(mesh)))
    # float32: only the cross-device summation order of the batch reduction differs.
    assert_state_matches(grads, grads_ref, sm.plan, rtol=1e-5, what="grad")
    full = gtp_jax.unshard(sm)
    assert_state_matches(sm, full, sm.plan, rtol=0.0, what="unshard")
