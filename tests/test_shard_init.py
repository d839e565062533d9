"""`gtp_jax.shard_init` builds exactly what `gtp_jax.shard(make_module())` builds, in place.

Exact comparisons (no tolerance): the same random keys, the same operations compiled one at
a time as eager execution compiles them, and padding / placement moves bits without
arithmetic, so every stored value must be the same bits, with the same sharding, dtype and
metadata. Sizes are unaligned on purpose (54, 70, 61 and 3 heads over gtp=4 and tp=2), so
weights are padded. The memory test reads the compiled init program's per-device buffer sizes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gtp_jax
from gtp_jax.models import Transformer, preset
from gtp_jax.sharding.init import compiled_init

# No dim of the attention or embedding weights divides 4: gtp=4 pads them.
ODD = preset("tiny", d_model=54, n_heads=3, d_ff=70, vocab_size=61, n_layers=2)


def _bits(x: jax.Array) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def assert_same_sharded(a: gtp_jax.ShardedModule, b: gtp_jax.ShardedModule) -> None:
    """Same variables (paths, types, metadata), same bits, same shardings, same plan."""
    fa, fb = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
    assert [k for k, _ in fa] == [k for k, _ in fb]
    for (path, va), (_, vb) in zip(fa, fb):
        x, y = va.get_value(), vb.get_value()
        assert type(va) is type(vb), path
        assert va.get_metadata() == vb.get_metadata(), path
        assert (x.dtype, x.shape) == (y.dtype, y.shape), path
        assert getattr(x, "weak_type", None) == getattr(y, "weak_type", None), path
        assert x.sharding == y.sharding, path
        np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=str(path))
    assert a.plan == b.plan and a.split_plan == b.split_plan
    assert a.describe() == b.describe()
    assert nnx.graphdef(a) == nnx.graphdef(b)


@pytest.mark.parametrize("mesh_sizes, unroll", [
    (dict(dp=2, gtp=4), False),          # scanned layer loop
    (dict(gtp=2, tp=2, dp=2), True),     # unrolled, tp split (3 heads: one padded on tp=2)
])
def test_shard_init_is_shard_of_the_built_module(mesh_sizes, unroll):
    cfg = dataclasses.replace(ODD, unroll_layers=unroll)
    mesh = gtp_jax.make_mesh(**mesh_sizes)
    make = lambda: Transformer(cfg, rngs=nnx.Rngs(7))  # noqa: E731
    ref = gtp_jax.shard(make(), mesh)
    padded = [p for p in ref.plan if p.spec.padded_size != p.spec.logical_shape[p.spec.shard_dim]]
    assert padded or mesh_sizes["gtp"] < 4
    assert_same_sharded(gtp_jax.shard_init(make, mesh), ref)


def test_shard_init_expert_split_matches_shard():
    cfg = dataclasses.replace(ODD, moe_experts=4)
    mesh = gtp_jax.make_mesh(gtp=2, ep=2, dp=2)
    make = lambda: Transformer(cfg, rngs=nnx.Rngs(1))  # noqa: E731
    ref = gtp_jax.shard(make(), mesh)
    assert any(p.splits for p in ref.placements().values())
    assert_same_sharded(gtp_jax.shard_init(make, mesh), ref)


class UserModel(nnx.Module):
    """A user's module: Linear layers, a bare Param, a non-parameter variable and an
    ``nnx.Rngs`` held for dropout (its key and counter are state too)."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(36, 100, rngs=rngs)
        self.down = nnx.Linear(100, 36, use_bias=False, rngs=rngs)
        self.table = nnx.Param(jax.random.uniform(rngs.params(), (50, 12)) * 3.0 - 1.0)
        self.steps = nnx.Variable(jnp.zeros((), jnp.int32))
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.dropout(jax.nn.gelu(self.up(x))))


def test_shard_init_of_a_user_module_matches_shard():
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    config = gtp_jax.GTPConfig(min_elements=64)
    make = lambda: UserModel(nnx.Rngs(params=3, dropout=4))  # noqa: E731
    ref = gtp_jax.shard(make(), mesh, config)
    assert {"up/kernel", "down/kernel", "table"} <= set(ref.sharded_paths())
    got = gtp_jax.shard_init(make, mesh, config)
    assert_same_sharded(got, ref)
    x = jnp.ones((8, 36))
    np.testing.assert_array_equal(np.asarray(got(x)), np.asarray(ref(x)))


def test_shard_init_refuses_what_is_not_a_module_factory():
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    built = Transformer(ODD, rngs=nnx.Rngs(0))
    with pytest.raises(gtp_jax.UsageTypeError, match="make_module .* got the module Transformer"):
        gtp_jax.shard_init(built, mesh)
    with pytest.raises(gtp_jax.UsageTypeError, match="make_module must be a callable"):
        gtp_jax.shard_init("Transformer", mesh)
    with pytest.raises(gtp_jax.UsageTypeError, match="make_module must return a flax.nnx.Module"):
        gtp_jax.shard_init(lambda: jnp.zeros((4, 4)), mesh)
    with pytest.raises(gtp_jax.UsageError, match="GTPConfig.axis"):
        gtp_jax.shard_init(lambda: Transformer(ODD, rngs=nnx.Rngs(0)), mesh,
                           gtp_jax.GTPConfig(axis="nope"))


def test_init_program_holds_only_the_shards():
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    cfg = preset("tiny", d_model=96, n_heads=3, d_ff=260, vocab_size=250, n_layers=2)
    make = lambda: Transformer(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(lambda: nnx.state(make(), nnx.Param))))
    stats = compiled_init(make, mesh).memory_analysis()
    kept = gtp_jax.bytes_per_device(gtp_jax.shard_init(make, mesh))
    outputs = len(jax.tree.leaves(nnx.state(gtp_jax.shard_init(make, mesh))))
    # The output buffer is the device's shards plus the output tuple's pointer table.
    assert kept <= stats.output_size_in_bytes <= kept + 8 * outputs
    assert stats.output_size_in_bytes < 0.4 * whole
    # Generating a weight whole before slicing it would need at least the whole model.
    assert stats.temp_size_in_bytes < whole


class _Const(nnx.Module):
    """A module with a weight made from a constant array (a constant of the traced build)."""

    def __init__(self, fill: float):
        self.w = nnx.Param(jnp.asarray(np.full((6, 10), fill, np.float32)))


def test_a_build_again_reuses_its_program_and_only_an_identical_one():
    """Building the same module again (new closures) runs the program compiled the first
    time; a different seed, constant, mesh or config never gets another build's program
    (the values would be silently those of the other build)."""
    cfg = dataclasses.replace(ODD, n_layers=1)
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    make = lambda seed: lambda: Transformer(cfg, rngs=nnx.Rngs(seed))  # noqa: E731
    first = compiled_init(make(7), mesh)
    assert compiled_init(make(7), mesh) is first
    assert_same_sharded(gtp_jax.shard_init(make(7), mesh), gtp_jax.shard(make(7)(), mesh))
    others = [compiled_init(make(8), mesh),
              compiled_init(make(7), gtp_jax.make_mesh(gtp=8)),
              # the same layout on other devices: only the output shardings differ
              compiled_init(make(7), jax.sharding.Mesh(mesh.devices[::-1], mesh.axis_names)),
              compiled_init(make(7), mesh, gtp_jax.GTPConfig(pad_for_alignment=8)),
              compiled_init(lambda: Transformer(dataclasses.replace(cfg, d_ff=72),
                                                rngs=nnx.Rngs(7)), mesh)]
    assert len({id(p) for p in [first, *others]}) == 6
    # The seed is a literal and a constant array a constant of the traced program: builds
    # that differ only there get their own values.
    a = gtp_jax.shard_init(make(7), mesh)
    b = gtp_jax.shard_init(make(8), mesh)
    fa, fb = (dict(nnx.to_flat_state(nnx.state(m, nnx.Param))) for m in (a, b))
    random = [p for p in fa if p[-1] in ("embedding", "kernel")]  # norms start at one
    assert random and all(not np.array_equal(np.asarray(fa[p].get_value()),
                                             np.asarray(fb[p].get_value())) for p in random)
    small = gtp_jax.GTPConfig(min_elements=1)
    for fill in (1.0, 2.0):
        (w,) = jax.tree.leaves(nnx.state(gtp_jax.shard_init(lambda f=fill: _Const(f), mesh,
                                                            small), nnx.Param))
        assert np.asarray(w)[0, 0] == fill


class _FromKey(nnx.Module):
    def __init__(self, key: jax.Array):
        self.w = nnx.Param(jax.random.normal(key, (6, 10)))


def test_a_key_made_outside_the_factory_builds_its_own_values():
    # Against shard_init's advice the factory reads a key made outside it: a constant of the
    # traced build (a typed key). It still builds, and another key builds other values.
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    small = gtp_jax.GTPConfig(min_elements=1)
    got = []
    for seed in (1, 2, 1):
        key = jax.random.key(seed)
        (w,) = jax.tree.leaves(nnx.state(gtp_jax.shard_init(lambda k=key: _FromKey(k), mesh,
                                                            small), nnx.Param))
        got.append(np.asarray(w))
    want = np.asarray(jax.random.normal(jax.random.key(1), (6, 10)))
    np.testing.assert_array_equal(got[0][:, :10], want)  # stored padded to 12 columns
    assert not np.array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0], got[2])
