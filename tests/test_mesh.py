"""The (dp, ep, gtp, tp) mesh: names, order, device groups, data placement, per-shard keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gtp_jax
from gtp_jax.base.host import gpu_count, jax_gpu_count
from gtp_jax.base.mesh import AXES, axis_groups, data_size
from gtp_jax.base.xla_flags import (
    DEFAULT_XLA_FLAGS,
    DETERMINISTIC_FLAG,
    OPT_OUT,
    PINNED_POOL_ENV,
    XLA_PINNED_POOL_GIB,
    apply_default_xla_flags,
    default_pinned_pool_gib,
    pinned_pool_bytes,
    request_deterministic,
)


@pytest.mark.parametrize("sizes", [
    {"gtp": 8},
    {"dp": 2, "gtp": 4},
    {"dp": 2, "gtp": 2, "tp": 2},
    {"dp": 2, "ep": 2, "gtp": 2},
    {"tp": 8},
])
def test_make_mesh_axes_order_sizes_and_types(sizes: dict[str, int]) -> None:
    mesh = gtp_jax.make_mesh(**sizes)
    assert mesh.axis_names == ("dp", "ep", "gtp", "tp") == AXES
    assert dict(mesh.shape) == {a: sizes.get(a, 1) for a in AXES}
    assert mesh.devices.shape == tuple(sizes.get(a, 1) for a in AXES)
    assert mesh.axis_types == (AxisType.Auto,) * 4
    # device i of the flat device list sits at unravel_index(i, (dp, ep, gtp, tp))
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert ids.ravel().tolist() == [d.id for d in jax.devices()]


def test_make_mesh_uses_given_devices_in_order() -> None:
    devices = list(reversed(jax.devices()))
    mesh = gtp_jax.make_mesh(dp=2, gtp=4, devices=devices)
    assert [d.id for d in mesh.devices.ravel()] == [7, 6, 5, 4, 3, 2, 1, 0]
    assert gtp_jax.describe_mesh(mesh)["gtp"] == [[3, 2, 1, 0], [7, 6, 5, 4]]


def test_describe_mesh_tp4() -> None:
    mesh = gtp_jax.make_mesh(dp=2, tp=4)
    groups = gtp_jax.describe_mesh(mesh)
    assert set(groups) == set(AXES)
    assert groups["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["gtp"] == [[i] for i in range(8)]
    assert groups["ep"] == [[i] for i in range(8)]


def test_describe_mesh_dp2_gtp4_and_printing() -> None:
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    lines: list[str] = []
    groups = gtp_jax.describe_mesh(mesh, print_fn=lines.append)
    assert groups["gtp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["tp"] == [[i] for i in range(8)]
    assert groups == {a: axis_groups(mesh, a) for a in AXES}
    assert lines[0] == "mesh (dp=2, ep=1, gtp=4, tp=1) over 8 devices"
    assert len(lines) == 2 + len(AXES)  # header, one line per axis, the XLA flags line
    assert any("gtp groups: [[0, 1, 2, 3], [4, 5, 6, 7]]" in ln for ln in lines)


def test_describe_mesh_mixed_axes() -> None:
    mesh = gtp_jax.make_mesh(dp=2, gtp=2, tp=2)
    groups = gtp_jax.describe_mesh(mesh)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["gtp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("sizes", [{"dp": 3}, {"dp": 2, "gtp": 2}, {"gtp": 16},
                                   {"gtp": 4, "tp": 4}])
def test_make_mesh_wrong_product(sizes: dict[str, int]) -> None:
    product = int(np.prod(list(sizes.values())))
    with pytest.raises(ValueError) as err:
        gtp_jax.make_mesh(**sizes)
    msg = str(err.value)
    assert f"= {product} " in msg
    assert "(8)" in msg
    for value in sizes.values():
        assert str(value) in msg


@pytest.mark.parametrize("name,value", [("dp", 0), ("gtp", -4), ("tp", 0), ("ep", -1),
                                        ("gtp", 2.0), ("dp", True)])
def test_make_mesh_rejects_non_positive_or_non_int(name: str, value) -> None:
    with pytest.raises(ValueError, match=f"{name}="):
        gtp_jax.make_mesh(**{name: value})


@pytest.mark.parametrize("sizes,ndim", [({"dp": 2, "gtp": 4}, 2), ({"gtp": 2, "tp": 4}, 3),
                                        ({"ep": 2, "gtp": 4}, 1)])
def test_data_sharding(sizes, ndim) -> None:
    mesh = gtp_jax.make_mesh(**sizes)
    sharding = gtp_jax.data_sharding(mesh, ndim)
    assert isinstance(sharding, NamedSharding) and sharding.mesh is mesh
    assert gtp_jax.data_axes(mesh) == ("dp", "ep", "gtp")
    assert sharding.spec == P(("dp", "ep", "gtp"), *([None] * (ndim - 1)))
    split = 8 // sizes.get("tp", 1)
    assert data_size(mesh) == split
    x = jax.device_put(jnp.arange(16 * 3 ** (ndim - 1)).reshape((16,) + (3,) * (ndim - 1)),
                       sharding)
    shapes = {s.data.shape for s in x.addressable_shards}
    assert shapes == {(16 // split,) + (3,) * (ndim - 1)}
    with pytest.raises(ValueError, match="ndim"):
        gtp_jax.data_sharding(mesh, 0)


def test_data_sharding_default_is_rank_2() -> None:
    mesh = gtp_jax.make_mesh(gtp=8)
    assert gtp_jax.data_sharding(mesh).spec == P(("dp", "ep", "gtp"), None)


def test_shard_key_inside_shard_map(key) -> None:
    mesh = gtp_jax.make_mesh(dp=2, gtp=2, tp=2)
    axes = gtp_jax.data_axes(mesh)
    raw = jax.random.key_data(key)

    def per_device(raw_key):
        k = gtp_jax.shard_key(jax.random.wrap_key_data(raw_key), axes)
        return jax.random.key_data(k)[None]

    out = jax.shard_map(per_device, mesh=mesh, in_specs=P(), out_specs=P(AXES),
                        check_vma=False)(raw)
    # row r belongs to mesh position unravel_index(r, (dp, ep, gtp, tp))
    data = np.asarray(out).reshape(2, 1, 2, 2, -1)
    for dp in range(2):
        for gtp in range(2):
            # tp ranks share data, so they must drop the same elements: equal keys
            np.testing.assert_array_equal(data[dp, 0, gtp, 0], data[dp, 0, gtp, 1])
            expected = jax.random.key_data(jax.random.fold_in(key, dp * 2 + gtp))
            np.testing.assert_array_equal(data[dp, 0, gtp, 0], np.asarray(expected))
    distinct = {tuple(data[dp, 0, gtp, 0].tolist()) for dp in range(2) for gtp in range(2)}
    assert len(distinct) == 4  # every (dp, gtp) rank gets its own key
    assert tuple(np.asarray(raw).tolist()) not in distinct


def test_shard_key_reaches_modules_inside_sharded_call(key) -> None:
    """nnx.Dropout inside a sharded module: different masks on different data shards."""

    class Drop(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 64, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(jnp.ones_like(self.lin(x)))

    mesh = gtp_jax.make_mesh(gtp=8)
    model = Drop(nnx.Rngs(0, dropout=1))
    sm = gtp_jax.shard(model, mesh, gtp_jax.GTPConfig(min_elements=0))
    x = jax.device_put(jnp.ones((8, 8)), gtp_jax.data_sharding(mesh))
    keys_before = {k: np.asarray(jax.random.key_data(v.get_value()))
                   for k, v in nnx.to_flat_state(nnx.state(sm, nnx.RngKey))}
    call = nnx.jit(lambda m, x: m(x))
    y = np.asarray(call(sm, x))
    masks = {tuple((row != 0).tolist()) for row in y}
    # every row is on a different data shard; identical keys would give identical masks
    assert len(masks) == 8
    # The stream's counter is written back (next call draws new masks); the per-shard folded
    # key is not written back (the stored key is unchanged).
    y2 = np.asarray(call(sm, x))
    assert not np.array_equal(y, y2)
    counts = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(sm, nnx.RngCount))]
    assert [int(c) for c in counts] == [2]
    keys_after = {k: np.asarray(jax.random.key_data(v.get_value()))
                  for k, v in nnx.to_flat_state(nnx.state(sm, nnx.RngKey))}
    assert keys_after.keys() == keys_before.keys() and len(keys_after) == 1
    for k, v in keys_before.items():
        np.testing.assert_array_equal(keys_after[k], v)


def test_default_xla_flags_are_explicit_and_escapable() -> None:
    defaults = [f"{f}={v}" for f, v in DEFAULT_XLA_FLAGS.items()]
    # Compile time (docs/overlap.md):
    assert "--xla_gpu_enable_triton_gemm=false" in defaults
    assert "--xla_gpu_experimental_enable_fusion_autotuner=false" in defaults
    # CPUs: the memory-ordered scheduler (a scanned layer loop's step, docs/performance.md)
    assert "--xla_cpu_enable_concurrency_optimized_scheduler=false" in defaults
    env: dict[str, str] = {}
    assert apply_default_xla_flags(env, host_bytes=16 * 2**30, gpus=1) == [
        *defaults, f"{PINNED_POOL_ENV}=14"]
    assert env["XLA_FLAGS"].split() == defaults
    # The user's values win, flag by flag: the way back to Triton GEMMs is to set it.
    first, second, *rest = DEFAULT_XLA_FLAGS
    user = {"XLA_FLAGS": f"{second}=true", PINNED_POOL_ENV: "20"}
    kept = [f"{f}={DEFAULT_XLA_FLAGS[f]}" for f in (first, *rest)]
    assert apply_default_xla_flags(user, host_bytes=16 * 2**30) == kept
    assert user[PINNED_POOL_ENV] == "20"
    assert user["XLA_FLAGS"].split() == [f"{second}=true", *kept]
    mine = {"XLA_FLAGS": " ".join(f"{f}=false" for f in DEFAULT_XLA_FLAGS), PINNED_POOL_ENV: "1"}
    assert apply_default_xla_flags(mine, host_bytes=16 * 2**30) == []
    assert apply_default_xla_flags({OPT_OUT: "1"}, host_bytes=512 * 2**30) == []
    lines: list[str] = []
    gtp_jax.describe_mesh(gtp_jax.make_mesh(gtp=8), print_fn=lines.append)
    assert "XLA settings" in lines[-1]


def test_deterministic_runs_ask_xla_for_deterministic_kernels_unless_the_user_chose() -> None:
    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true"}
    request_deterministic(env)
    assert env["XLA_FLAGS"].split() == ["--xla_gpu_enable_latency_hiding_scheduler=true",
                                        f"{DETERMINISTIC_FLAG}=true"]
    request_deterministic(env)  # once only
    assert env["XLA_FLAGS"].count(DETERMINISTIC_FLAG) == 1
    user = {"XLA_FLAGS": f"{DETERMINISTIC_FLAG}=false"}
    request_deterministic(user)
    assert user["XLA_FLAGS"] == f"{DETERMINISTIC_FLAG}=false"
    # On GPUs only the float32 step ran deterministically: bfloat16 is refused in one line.
    from gtp_jax.train.cli.command import deterministic_problem  # noqa: PLC0415

    for dtype in ("auto", "bfloat16"):
        assert "add --dtype float32" in deterministic_problem(True, "gpu", dtype)
    assert deterministic_problem(True, "gpu", "float32") is None
    assert deterministic_problem(True, "cpu", "auto") is None
    assert deterministic_problem(False, "gpu", "auto") is None


def test_the_pinned_host_pools_of_a_hosts_gpus_share_its_memory_unless_the_user_set_them(
        tmp_path) -> None:
    env = {"XLA_FLAGS": " ".join(f"{f}={v}" for f, v in DEFAULT_XLA_FLAGS.items())}
    assert pinned_pool_bytes(env) == XLA_PINNED_POOL_GIB * 2**30  # XLA's default
    # 90% of 251 GiB over 2 GPUs: the two pools together cannot outgrow the host
    assert apply_default_xla_flags(env, host_bytes=251 * 2**30 + 5, gpus=2) == [
        f"{PINNED_POOL_ENV}=112"]
    assert pinned_pool_bytes(env) == 112 * 2**30
    assert default_pinned_pool_gib(251 * 2**30, None) == 225  # GPUs unknown: one
    assert default_pinned_pool_gib(512 * 2**30, 8) == 57  # below XLA's 64: set all the same
    # The host's GPUs, read without starting CUDA: the driver's list, else the visible ones
    (tmp_path / "gpus").mkdir()
    for bus in ("0000:19:00.0", "0000:3b:00.0"):
        (tmp_path / "gpus" / bus).mkdir()
    assert gpu_count(str(tmp_path / "gpus"), environ={"CUDA_VISIBLE_DEVICES": "0"}) == 2
    missing = str(tmp_path / "none")
    assert gpu_count(missing, environ={"CUDA_VISIBLE_DEVICES": "0,1,2"}) == 3
    assert gpu_count(missing, environ={"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert gpu_count(missing, environ={}) is None
    # What JAX runs on: the host's GPUs, unless JAX_PLATFORMS leaves them out
    gpus = str(tmp_path / "gpus")
    assert jax_gpu_count(gpus, environ={}) == 2
    assert jax_gpu_count(gpus, environ={"JAX_PLATFORMS": "cuda,cpu"}) == 2
    assert jax_gpu_count(gpus, environ={"JAX_PLATFORMS": "cpu"}) is None
    user = {PINNED_POOL_ENV: "100"}
    apply_default_xla_flags(user, host_bytes=251 * 2**30)
    assert user[PINNED_POOL_ENV] == "100" and pinned_pool_bytes(user) == 100 * 2**30
    assert pinned_pool_bytes({PINNED_POOL_ENV: "lots"}) == XLA_PINNED_POOL_GIB * 2**30
