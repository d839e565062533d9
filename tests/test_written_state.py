"""State written in ``__call__`` of a sharded module: every kind gtp_jax names (batch means,
counts, sums, sums of squares, per-example caches, values identical on every shard) gives
the unsharded module's value on meshes with 8 data shards and with 2 x 4; state without a
declared rule is refused, naming the variable, before anything changes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_unchanged, get_mesh, snapshot

import gtp_jax
from gtp_jax.base.errors import UsageError

MESHES = ("gtp8", "dp2_gtp4", "dp8_gtp1")
BATCH = 16


class Stat(nnx.Variable):
    """A user's own variable type: says nothing about how shards combine."""


class Tracker(nnx.Module):
    """Every kind of written state, by type and by metadata."""

    def __init__(self):
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.avg = gtp_jax.BatchMean(jnp.zeros((8,)))               # EMA of batch means
        self.seen = gtp_jax.BatchSum(jnp.zeros(()))                 # float example counter
        self.total = Stat(jnp.zeros((8,)), gtp_reduce="sum")        # sum, by metadata
        self.sq = gtp_jax.BatchSum(jnp.zeros((8,)))                 # sum of squares
        self.count = gtp_jax.BatchSum(jnp.zeros((), jnp.int32))     # int counter
        self.calls = gtp_jax.SameOnEveryShard(jnp.zeros((), jnp.int32))
        self.last = gtp_jax.PerExample(jnp.zeros((BATCH, 8)))       # per-example cache
        self.mean_meta = Stat(jnp.zeros((8,)), gtp_reduce="mean")

    def __call__(self, x):
        y = self.lin(x)
        self.avg[...] = 0.9 * self.avg[...] + 0.1 * jnp.mean(y, axis=0)
        self.seen[...] += x.shape[0]
        self.total[...] += jnp.sum(y, axis=0)
        self.sq[...] += jnp.sum(y * y, axis=0)
        self.count[...] += x.shape[0]
        self.calls[...] += 1
        self.last[...] = y
        self.mean_meta[...] = jnp.mean(y, axis=0)
        return y


def _copy(module):
    return nnx.merge(*nnx.split(module))


@pytest.mark.parametrize("mesh_name", MESHES)
def test_every_kind_of_written_state_matches_the_unsharded_module(mesh_name, key) -> None:
    mesh = get_mesh(mesh_name)
    ref = Tracker()
    sm = gtp_jax.shard(_copy(ref), mesh, gtp_jax.GTPConfig(min_elements=0))
    step = nnx.jit(lambda m, x: m(x))
    for i in range(2):
        x = 3.0 + jax.random.normal(jax.random.fold_in(key, i), (BATCH, 4))
        ref(x)
        step(sm, jax.device_put(x, gtp_jax.data_sharding(mesh, 2)))
    got, want = sm.module, ref
    assert float(got.seen[...]) == float(want.seen[...]) == 2 * BATCH
    assert int(got.count[...]) == int(want.count[...]) == 2 * BATCH
    assert int(got.calls[...]) == int(want.calls[...]) == 2
    # float32 sums of 16 values of size ~10 (and their squares ~100): reordering the sum over
    # shards changes the result by a few ulp of the total, far below 1e-5 relative.
    for name in ("avg", "total", "sq", "last", "mean_meta"):
        w = np.asarray(getattr(want, name)[...])
        np.testing.assert_allclose(np.asarray(getattr(got, name)[...]), w, rtol=1e-5,
                                   atol=1e-5 * float(np.max(np.abs(w))), err_msg=name)
    assert float(np.max(np.abs(np.asarray(want.sq[...])))) > 1.0  # not trivially zero


@pytest.mark.parametrize("mesh_name", ("dp2_gtp4", "dp8_gtp1"))
def test_written_state_without_a_rule_is_refused_before_anything_changes(mesh_name) -> None:
    class Counted(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
            self.seen = Stat(jnp.zeros(()))

        def __call__(self, x):
            self.seen[...] += x.shape[0]
            return self.lin(x)

    mesh = get_mesh(mesh_name)
    sm = gtp_jax.shard(Counted(), mesh, gtp_jax.GTPConfig(min_elements=0))
    before = snapshot(sm)
    x = jax.device_put(jnp.ones((BATCH, 4)), gtp_jax.data_sharding(mesh, 2))
    with pytest.raises(UsageError) as err:
        sm(x)
    msg = str(err.value)
    assert "\n" not in msg and "'seen'" in msg
    for choice in ("BatchMean", "BatchSum", "SameOnEveryShard", "PerExample", "gtp_reduce"):
        assert choice in msg
    assert_unchanged(sm, before)


def test_conflicting_type_and_metadata_are_refused() -> None:
    class Both(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
            self.seen = gtp_jax.BatchSum(jnp.zeros(()), gtp_reduce="mean")

        def __call__(self, x):
            self.seen[...] += x.shape[0]
            return self.lin(x)

    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(Both(), mesh, gtp_jax.GTPConfig(min_elements=0))
    with pytest.raises(UsageError, match="'seen'.*BatchSum.*'sum'.*gtp_reduce='mean'"):
        sm(jax.device_put(jnp.ones((BATCH, 4)), gtp_jax.data_sharding(mesh, 2)))


def test_per_example_state_must_be_written_per_example() -> None:
    class Pooled(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
            self.last = gtp_jax.PerExample(jnp.zeros((8,)))

        def __call__(self, x):
            y = self.lin(x)
            self.last[...] = jnp.mean(y, axis=0)  # not one row per example
            return y

    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(Pooled(), mesh, gtp_jax.GTPConfig(min_elements=0))
    before = snapshot(sm)
    with pytest.raises(UsageError, match="'last'.*per-example.*shape \\(8,\\)"):
        sm(jax.device_put(jnp.ones((BATCH, 4)), gtp_jax.data_sharding(mesh, 2)))
    assert_unchanged(sm, before)


class Passed(nnx.Module):
    """A layer with a variable of no combining rule, run through nnx.remat, which hands the
    variable back as a new traced value; with `write`, the layer really writes it."""

    def __init__(self, write=False):
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.seen = Stat(jnp.zeros(()))
        self.write = write

    def __call__(self, x):
        def layer(m, x):
            if m.write:
                m.seen[...] += x.shape[0]
            return m.lin(x)

        return nnx.remat(layer)(self, x)


def test_state_a_lifted_transform_only_passes_on_is_not_written() -> None:
    mesh = get_mesh("dp2_gtp4")
    x = jnp.ones((BATCH, 4))
    ref = Passed()
    sm = gtp_jax.shard(_copy(ref), mesh, gtp_jax.GTPConfig(min_elements=0))
    out = nnx.jit(lambda m, x: m(x))(sm, jax.device_put(x, gtp_jax.data_sharding(mesh, 2)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref(x)), rtol=1e-6, atol=1e-6)
    assert float(sm.module.seen[...]) == 0.0
    writes = gtp_jax.shard(Passed(write=True), mesh, gtp_jax.GTPConfig(min_elements=0))
    before = snapshot(writes)
    with pytest.raises(UsageError, match="'seen'.*BatchSum") as err:
        writes(jax.device_put(x, gtp_jax.data_sharding(mesh, 2)))
    assert "\n" not in str(err.value)
    assert_unchanged(writes, before)
