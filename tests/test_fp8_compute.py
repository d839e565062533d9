"""FP8 compute (`GTPConfig.fp8_compute`, `gtp_jax.pallas.fp8_matmul`, `gtp_jax.sharding.fp8`).

On CPUs FP8 is emulated exactly: e4m3 / e5m2 payloads are bfloat16-exact and their products
are accumulated in float32, so a sharded run and its unsharded reference differ only in
float32 reduction order, except where such a difference moves a value across an FP8
rounding boundary (one FP8 step is 2**-3 of the value in e4m3): the tolerances below allow
a few such flips in a sum, not a wrong scale or a missing quantization (those give errors of
whole percents, as the bf16 comparisons show).

Activation and gradient scales are per device (each device quantizes its own tokens, as in
torchao and TransformerEngine); weights are quantized whole after their gather. So the
reference of a sharded run is the unsharded module applied to each data shard's rows
(`jax.vmap` over the shards makes every amax per shard), averaged like the sharded loss.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import Mixed, assert_close, get_mesh, max_rel_err, mixed_tokens

import gtp_jax
from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.models import Transformer, lm_loss, preset
from gtp_jax.pallas.fp8_matmul import (
    FP8_MATMUL_DTYPES,
    fp8_matmul,
    fp8_matmul_grads_reference,
    fp8_matmul_reference,
    quantize_tensorwise,
)
from gtp_jax.sharding import fp8
from gtp_jax.train import replicate_stray_leaves

#: Float32 reduction order alone, including a few FP8 rounding flips in long sums.
RTOL_SAME_MATH = 2e-4
#: FP8 against the unquantized float32 module: e4m3 keeps 3 mantissa bits (relative
#: rounding 2**-4 per element), averaged over the contraction.
RTOL_FP8_VS_F32 = 0.1
ALL = gtp_jax.GTPConfig(fp8_compute="tensorwise", fp8_min_features=0, min_elements=0)


# --------------------------------------------------------------------------- the op


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_matmul_matches_its_reference(dtype, key):
    kx, kw, kg = jax.random.split(key, 3)
    x = jax.random.normal(kx, (37, 50), dtype)          # unaligned shapes
    w = (jax.random.normal(kw, (50, 29)) * 0.05).astype(dtype)
    dy = jax.random.normal(kg, (37, 29), dtype)
    y, vjp = jax.vjp(fp8_matmul, x, w)
    dx, dw = vjp(dy)
    rdx, rdw = fp8_matmul_grads_reference(x, w, dy)
    tol = 1e-6 if dtype == jnp.float32 else 2**-8  # float32 vs a bf16 output rounding
    assert y.dtype == dx.dtype == dw.dtype == dtype
    assert_close(y, fp8_matmul_reference(x, w), tol, "forward")
    assert_close(dx, rdx, tol, "dx")
    assert_close(dw, rdw, tol, "dw")
    # ... and it is a quantized product: far from exact, within FP8's rounding.
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert 1e-3 < max_rel_err(y, exact) < RTOL_FP8_VS_F32


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_kernels_give_the_bits_of_the_xla_path(dtype, key):
    # The GPU path (one-launch amax, fused cast-and-transpose kernels) in the interpreter
    # against XLA's fusions: the same payloads, so the same products, forward and backward.
    kx, kw, kg = jax.random.split(key, 3)
    x = (jax.random.normal(kx, (70, 100)) * 30).astype(dtype)   # unaligned, partial tiles
    w = (jax.random.normal(kw, (100, 45)) * 0.05).astype(dtype)
    dy = jax.random.normal(kg, (70, 45), dtype)
    out = {}
    for backend in ("pallas", "xla"):
        f = functools.partial(fp8_matmul, backend=backend, interpret=True)
        y, vjp = jax.vjp(f, x, w)
        out[backend] = (y, *vjp(dy))
    for name, a, b in zip(("y", "dx", "dw"), out["pallas"], out["xla"]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=name)
    with pytest.raises(UsageError, match="backend='cuda'"):
        fp8_matmul(x, w, backend="cuda")


def test_cast_transpose_kernel_matches_its_reference(key):
    from gtp_jax.pallas.cast_transpose import cast_transpose_pallas, cast_transpose_reference

    x = (jax.random.normal(key, (50, 130)) * 300).astype(jnp.bfloat16)
    x = x.at[0, 1].set(jnp.inf).at[3, 0].set(jnp.nan)  # non-finite elements -> NaN
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        for layout in ("rowwise", "columnwise", "both"):
            got = cast_transpose_pallas(x, jnp.float32(2.0), dtype, layout=layout,
                                        interpret=True, block=(32, 64))
            want = cast_transpose_reference(x, jnp.float32(2.0), dtype, layout)
            for g, r in zip(got, want):
                assert (g is None) == (r is None), layout
                if r is not None:
                    assert g.shape == r.shape and g.dtype == r.dtype
                    np.testing.assert_array_equal(np.asarray(g, np.float32),
                                                  np.asarray(r, np.float32))
    with pytest.raises(UsageError, match="layout="):
        cast_transpose_pallas(x, jnp.float32(1), jnp.float8_e4m3fn, layout="col",
                              interpret=True)
    with pytest.raises(UsageTypeError, match="dtype="):
        cast_transpose_pallas(x, jnp.float32(1), jnp.int8, interpret=True)


def test_cast_transpose_kernel_records_the_amax_of_what_it_reads(key):
    """``with_amax``: the payloads are unchanged and the amax equals the reference's on an
    unaligned shape (tiles cut by the mask), with an Inf, and with a NaN (never dropped)."""
    from gtp_jax.pallas.cast_transpose import (
        cast_transpose_amax_reference,
        cast_transpose_pallas,
        cast_transpose_reference,
    )

    x = (jax.random.normal(key, (50, 130)) * 3).astype(jnp.bfloat16)
    x = x.at[49, 129].set(-700.0)  # the largest element sits in the last, masked tile
    for bad, want_amax in ((None, 700.0), (jnp.inf, np.inf), (jnp.nan, np.nan)):
        xb = x if bad is None else x.at[7, 9].set(bad)
        *payloads, amax = cast_transpose_pallas(xb, jnp.float32(0.5), jnp.float8_e4m3fn,
                                                interpret=True, block=(32, 64),
                                                with_amax=True)
        want = cast_transpose_reference(xb, jnp.float32(0.5), jnp.float8_e4m3fn)
        for g, r in zip(payloads, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))
        assert amax.dtype == jnp.float32 and amax.shape == ()
        np.testing.assert_array_equal(np.asarray(amax), np.float32(want_amax))
        np.testing.assert_array_equal(np.asarray(cast_transpose_amax_reference(xb)),
                                      np.float32(want_amax))


def test_amax_keeps_a_nan_in_every_dtype():
    """The FP8 matmul's amax never drops a NaN (XLA's CPU float max reduction does, for
    some float32 shapes: this one)."""
    from gtp_jax.pallas.fp8_matmul import _amax

    for dtype in FP8_MATMUL_DTYPES:
        x = jnp.ones((50, 130), dtype).at[1, 1].set(jnp.nan).at[49, 129].set(-700.0)
        assert np.isnan(float(_amax(x))), dtype
        assert float(_amax(x.at[1, 1].set(jnp.inf))) == np.inf, dtype
        assert float(_amax(x.at[1, 1].set(3.0))) == 700.0, dtype


def test_quantize_is_saturating_and_exact_for_fp8_values():
    x = jnp.array([0.0, 1.0, -2.0, 448.0, 1e-3], jnp.float32)
    x8, s = quantize_tensorwise(x, jnp.float8_e4m3fn)
    assert float(s) == 1.0  # amax 448 is e4m3's largest value
    np.testing.assert_array_equal(np.asarray(x8.astype(jnp.float32))[:4], [0, 1, -2, 448])
    zeros8, s0 = quantize_tensorwise(jnp.zeros((3,)), jnp.float8_e5m2)
    assert float(s0) == 1.0 and not np.any(np.asarray(zeros8.astype(jnp.float32)))


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_a_non_finite_operand_makes_the_whole_product_nan(bad, key):
    # A documented, loud result: never a finite output computed from a broken scale.
    x = jax.random.normal(key, (8, 16)).at[3, 4].set(bad)
    y = fp8_matmul(x, jnp.ones((16, 4)))
    assert np.all(np.isnan(np.asarray(y)))


def test_fp8_matmul_refuses_bad_operands():
    with pytest.raises(UsageTypeError, match="x has dtype int32"):
        fp8_matmul(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 2)))
    with pytest.raises(UsageError, match=r"w has shape \(3,\)"):
        fp8_matmul(jnp.ones((2, 3)), jnp.ones((3,)))
    with pytest.raises(UsageError, match="do not contract"):
        fp8_matmul(jnp.ones((2, 3)), jnp.ones((4, 2)))
    with pytest.raises(UsageTypeError, match="cast both"):
        fp8_matmul(jnp.ones((2, 3)), jnp.ones((3, 2), jnp.bfloat16))


def test_fp8_dot_general_contracts_like_dot_general(key):
    a = jax.random.normal(key, (4, 6, 3, 5))
    b = jax.random.normal(jax.random.fold_in(key, 1), (5, 3, 7))
    dims = (((2, 3), (1, 0)), ((), ()))
    got = fp8.fp8_dot_general(a, b, dims)
    want = jax.lax.dot_general(a, b, dims)
    assert got.shape == want.shape
    assert 1e-4 < max_rel_err(got, want) < RTOL_FP8_VS_F32
    # batch dims are left to dot_general, exactly
    c = jax.random.normal(key, (2, 4, 3))
    batched = (((2,), (2,)), ((0,), (0,)))
    np.testing.assert_array_equal(fp8.fp8_dot_general(c, c, batched),
                                  jax.lax.dot_general(c, c, batched))


# --------------------------------------------------------------------------- modules


def _per_shard_reference(model: nnx.Module, loss_fn, batch: jax.Array, shards: int,
                         cfg: gtp_jax.GTPConfig):
    """(loss, grads) of the unsharded `model` with FP8 compute applied to each of `shards`
    equal row blocks of `batch` separately (per-device scales), averaged."""
    ref = nnx.clone(model)
    fp8.inject(ref, fp8.fp8_layers(ref, cfg))
    graphdef, params, rest = nnx.split(ref, nnx.Param, ...)
    value, grads = _mean_loss_and_grads(graphdef, loss_fn, shards, params, rest, batch)
    return float(value), grads


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _mean_loss_and_grads(graphdef, loss_fn, shards, params, rest, batch):
    def mean_loss(p):
        rows = batch.reshape(shards, batch.shape[0] // shards, *batch.shape[1:])
        per_shard = jax.vmap(lambda r: loss_fn(nnx.merge(graphdef, p, rest), r))(rows)
        return jnp.mean(per_shard)

    return jax.value_and_grad(mean_loss)(params)


def _flat(state: nnx.State) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(state)}


def _mse(model, tokens):
    return jnp.mean(model(tokens).astype(jnp.float32) ** 2)


def test_user_module_in_fp8_matches_unsharded_per_shard(key, seed):
    mesh = get_mesh("dp2_gtp4")
    model = Mixed(nnx.Rngs(seed))
    tokens = mixed_tokens(key)
    sharded = gtp_jax.shard(model, mesh, ALL)
    # Linear, Einsum and LinearGeneral all compute in FP8; the module's own are untouched.
    assert sorted(p for p, _, _ in sharded.fp8_layers) == ["ein", "gen", "lin"]
    assert model.lin.dot_general is jax.lax.dot_general
    # jitted: eagerly, every op of the sharded call would compile on its own
    loss, grads = nnx.jit(nnx.value_and_grad(_mse))(sharded, jax.device_put(
        tokens, gtp_jax.data_sharding(mesh)))
    ref_loss, ref_grads = _per_shard_reference(model, _mse, tokens, 8, ALL)
    assert abs(float(loss) - ref_loss) <= RTOL_SAME_MATH * abs(ref_loss)
    got = gtp_jax.unshard_values(sharded, grads)
    for path, g in _flat(ref_grads).items():
        assert_close(got[path], g, RTOL_SAME_MATH, path)
    # not the unquantized module's gradient
    plain = nnx.jit(nnx.grad(_mse))(model, tokens)
    lin = np.asarray(plain.lin.kernel.get_value())
    assert 1e-4 < max_rel_err(got["lin/kernel"], lin) < RTOL_FP8_VS_F32
    # unshard gives back the module's own matmuls
    assert gtp_jax.unshard(sharded).lin.dot_general is jax.lax.dot_general


def test_quant_backend_picks_the_fp8_matmuls_quantizers_with_the_same_bits(key, seed):
    """GTPConfig.quant_backend reaches the FP8 matmuls: "pallas" traces the kernels (run by
    the interpreter here), "reference" none; both give the same loss and gradients."""
    mesh = get_mesh("gtp8")
    tokens = jax.device_put(mixed_tokens(key), gtp_jax.data_sharding(mesh))
    out = {}
    for backend in ("pallas", "reference"):
        sharded = gtp_jax.shard(Mixed(nnx.Rngs(seed)), mesh,
                                dataclasses.replace(ALL, quant_backend=backend))
        step = nnx.value_and_grad(_mse)
        text = str(jax.make_jaxpr(lambda m, t, step=step: step(m, t)[0])(sharded, tokens))
        assert ("pallas_call" in text) == (backend == "pallas"), backend
        loss, grads = nnx.jit(step)(sharded, tokens)
        out[backend] = (float(loss), gtp_jax.unshard_values(sharded, grads))
    assert out["pallas"][0] == out["reference"][0]
    for path, g in out["reference"][1].items():
        np.testing.assert_array_equal(out["pallas"][1][path], g, err_msg=path)


@pytest.mark.parametrize(("unroll", "mesh_name"), [(True, "gtp8"), (False, "dp2_gtp4")],
                         ids=["unrolled", "scanned_prefetch"])
def test_decoder_in_fp8_trains_like_unsharded_per_shard(unroll, mesh_name, key, seed):
    mesh = get_mesh(mesh_name)
    cfg = preset("tiny", d_model=96, n_heads=4, d_ff=200, vocab_size=250, n_layers=2,
                 remat="dots", unroll_layers=unroll)
    config = gtp_jax.GTPConfig(fp8_compute="tensorwise", fp8_min_features=64,
                               prefetch=not unroll)
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    sharded = gtp_jax.shard(nnx.clone(model), mesh, config)
    assert sorted(p for p, _, _ in sharded.fp8_layers) == [
        "blocks/attn/out", "blocks/attn/qkv", "blocks/mlp/down", "blocks/mlp/gate_up"]
    # Each step is compared from the same state: FP8 rounding is discontinuous, so two runs
    # whose parameters differ in the last float32 bit (the update of a padded shard against
    # the full weight) quantize a few elements to neighbouring FP8 values one step later,
    # and the runs drift apart by FP8 rounding, as any two FP8 runs would.
    tx = optax.sgd(0.5)
    opt = nnx.Optimizer(sharded, tx, wrt=nnx.Param)
    replicate_stray_leaves(opt, mesh)  # the step compiles once, not twice

    @nnx.jit
    def step(m, o, batch):
        loss, grads = nnx.value_and_grad(lm_loss)(m, batch)
        o.update(m, grads)
        return loss, grads

    for i in range(2):
        batch = jax.random.randint(jax.random.fold_in(key, i), (8, 17), 0, 250)
        before = gtp_jax.unshard(sharded)
        ref_loss, ref_grads = _per_shard_reference(before, lm_loss, batch, 8, config)
        loss, grads = step(sharded, opt, jax.device_put(batch, gtp_jax.data_sharding(mesh)))
        assert abs(float(loss) - ref_loss) <= RTOL_SAME_MATH * abs(ref_loss), (i, loss, ref_loss)
        got = gtp_jax.unshard_values(sharded, grads)
        after = gtp_jax.unshard_values(sharded, sharded)
        for name, g in _flat(ref_grads).items():
            assert_close(got[name], g, RTOL_SAME_MATH, f"step {i} grad {name}")
        for name, p in _flat(nnx.state(before, nnx.Param)).items():
            assert_close(after[name], p - 0.5 * _flat(ref_grads)[name], RTOL_SAME_MATH,
                         f"step {i} param {name}")


@pytest.mark.parametrize("gather_format", [None, "fp8"])
def test_backward_keeps_no_gathered_weight_with_fp8_compute(gather_format, key, seed):
    # The FP8 matmul saves the activation payload, not a quantized copy of the gathered
    # weight: the weight is re-gathered (and quantized again, or its FP8 payload gathered
    # again) in the backward pass.
    import contextlib
    import dataclasses
    import io

    from jax.ad_checkpoint import print_saved_residuals

    mesh = get_mesh("dp2_gtp4")
    config = dataclasses.replace(ALL, gather_format=gather_format)
    sharded = gtp_jax.shard(Mixed(nnx.Rngs(seed)), mesh, config)
    assert any(p.spec.fp8_in_dims for p in sharded.plan) == (gather_format == "fp8")
    graphdef, state = nnx.split(sharded)
    tokens = jax.device_put(mixed_tokens(key), gtp_jax.data_sharding(mesh))
    full = {p.spec.logical_shape for p in sharded.plan} | {p.spec.padded_shape
                                                           for p in sharded.plan}
    # An FP8-gathered kernel's transposed payload too.
    full |= {(*s.logical_shape[s.fp8_in_dims:], *s.logical_shape[:s.fp8_in_dims])
             for s in (p.spec for p in sharded.plan) if s.fp8_in_dims}
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        print_saved_residuals(lambda s, t: _mse(nnx.merge(graphdef, s), t), state, tokens)
    saved = []
    for line in buffer.getvalue().splitlines():
        if "from the argument" in line:
            continue
        dims = line.split("[", 1)[1].split("]", 1)[0]
        shape = tuple(int(d) for d in dims.split(",") if d)
        per_device = (shape[0] // 8,) + shape[1:] if shape and shape[0] % 8 == 0 else shape
        if {shape, per_device} & full:
            saved.append(line)
    assert not saved, saved


# --------------------------------------------------------------------------- fp8 gathers


def test_prequantized_matmul_is_fp8_matmul_with_the_payload_given(key):
    # The payloads of `cast_weight` at `weight_scale` are what `fp8_matmul` computes from
    # the weight itself, so feeding them gives its bits, forward and backward, whichever
    # backend casts them.
    from gtp_jax.pallas.formats import amax_reference
    from gtp_jax.pallas.fp8_matmul import cast_weight, fp8_matmul_prequantized, weight_scale

    kx, kw, kg = jax.random.split(key, 3)
    x = jax.random.normal(kx, (37, 50), jnp.bfloat16)
    w = (jax.random.normal(kw, (50, 29)) * 0.05).astype(jnp.bfloat16)
    dy = jax.random.normal(kg, (37, 29), jnp.bfloat16)
    s = weight_scale(amax_reference(w))
    w8, w8t = cast_weight(w, s)
    p8, p8t = cast_weight(w, s, backend="pallas", interpret=True)
    np.testing.assert_array_equal(p8, w8)
    np.testing.assert_array_equal(p8t, w8t)
    y, vjp = jax.vjp(fp8_matmul, x, w)
    y2, vjp2 = jax.vjp(lambda a, b: fp8_matmul_prequantized(a, b, w8, w8t, s), x, w)
    for name, a, b in zip(("y", "dx", "dw"), (y, *vjp(dy)), (y2, *vjp2(dy))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=name)
    with pytest.raises(UsageError, match=r"w8t is uint8\[29, 50\].*\[29, 29\]"):
        fp8_matmul_prequantized(x[:, :29], w[:29, :29], w8[:29, :29], w8t, s)


def _fp8_gathered(config: gtp_jax.GTPConfig, kernels: str) -> tuple[gtp_jax.GTPConfig, ...]:
    """`config` with bf16 gathers and with fp8 gathers, only the `kernels` sharded (other
    weights would be quantized by the fp8 gather in one run only)."""
    import dataclasses

    return tuple(dataclasses.replace(config, gather_format=f, include=(kernels,))
                 for f in (None, "fp8"))


def test_fp8_gathered_kernels_feed_the_gemm_with_the_bits_of_bf16_gathers(key, seed):
    # Linear and LinearGeneral kernels (padded: no dim divides 8) are gathered as e4m3
    # payloads that their GEMMs read as is; the payload is what the FP8 matmul computes
    # from the whole weight, so the run is bit-identical to gathering it in bf16. The
    # Einsum reads the (exact) dequantized kernel, which it quantizes back to the same
    # payload: the same bits too.
    mesh = get_mesh("dp2_gtp4")
    tokens = jax.device_put(mixed_tokens(key), gtp_jax.data_sharding(mesh))
    out = {}
    for config in _fp8_gathered(ALL, "(lin|gen|ein)/kernel"):
        sharded = gtp_jax.shard(Mixed(nnx.Rngs(seed)), mesh, config)
        direct = {p.path: p.spec.fp8_in_dims for p in sharded.plan}
        loss, grads = nnx.jit(nnx.value_and_grad(_mse))(sharded, tokens)
        out[config.gather_format] = (direct, float(loss),
                                     gtp_jax.unshard_values(sharded, grads))
    assert out["fp8"][0] == {"lin/kernel": 1, "gen/kernel": 2, "ein/kernel": 1}
    assert out["fp8"][1] == out[None][1]
    for path, g in out[None][2].items():
        np.testing.assert_array_equal(out["fp8"][2][path], g, err_msg=path)


@pytest.mark.parametrize("keep", [False, True], ids=["regather", "keep_gathered"])
def test_fp8_gathered_decoder_trains_with_the_bits_of_bf16_gathers(keep, key, seed):
    # The scanned loop with prefetch (re-gathering in the backward pass, or keeping the
    # gathered payloads), three optimizer steps of the gathered kernels. The other weights
    # stay fixed: their gradients come out of two different XLA programs whose reductions
    # may be ordered differently (float32 ulps, which AdamW's normalization then amplifies),
    # a difference that is not the gather's.
    mesh = get_mesh("dp2_gtp4")
    cfg = preset("tiny", d_model=96, n_heads=4, d_ff=200, vocab_size=250, n_layers=2,
                 remat="dots", unroll_layers=False)
    base = gtp_jax.GTPConfig(fp8_compute="tensorwise", fp8_min_features=64, prefetch=True,
                             keep_gathered_layers=keep)
    kernels = nnx.All(nnx.Param, lambda path, _: re.search(
        r"blocks/(attn|mlp)/.*kernel", "/".join(map(str, path))) is not None)
    runs = {}
    for config in _fp8_gathered(base, r"blocks/(attn|mlp)/.*kernel"):
        sharded = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(seed)), mesh, config)
        opt = nnx.Optimizer(sharded, optax.adamw(1e-2), wrt=kernels)
        replicate_stray_leaves(opt, mesh)

        @nnx.jit
        def step(m, o, batch):
            loss, grads = nnx.value_and_grad(lm_loss, argnums=nnx.DiffState(0, kernels))(
                m, batch)
            o.update(m, grads)
            return loss

        losses = [float(step(sharded, opt, jax.device_put(
            jax.random.randint(jax.random.fold_in(key, i), (8, 17), 0, 250),
            gtp_jax.data_sharding(mesh)))) for i in range(3)]
        runs[config.gather_format] = (losses, gtp_jax.unshard_values(sharded, sharded),
                                      [p.spec.fp8_in_dims for p in sharded.plan])
    assert all(runs["fp8"][2]) and not any(runs[None][2])
    assert runs[None][0][0] != runs[None][0][-1]  # the kernels did train
    assert runs["fp8"][0] == runs[None][0]
    for path, v in runs[None][1].items():
        np.testing.assert_array_equal(runs["fp8"][1][path], v, err_msg=path)


def test_weights_outside_fp8_compute_keep_the_gather_dtype(key, seed):
    # With FP8 compute, gather_format="fp8" is for the kernels the FP8 GEMMs read: the
    # embedding, head and norms are gathered as without a format (not rounded to e4m3), so
    # the whole decoder computes what the run without a gather format computes.
    mesh = get_mesh("dp2_gtp4")
    cfg = preset("tiny", d_model=96, n_heads=4, d_ff=200, vocab_size=250, n_layers=2)
    batch = jax.device_put(jax.random.randint(key, (8, 17), 0, 250),
                           gtp_jax.data_sharding(mesh))
    losses, formats = {}, {}
    for fmt in (None, "fp8"):
        config = gtp_jax.GTPConfig(fp8_compute="tensorwise", fp8_min_features=64,
                                   gather_format=fmt)
        sharded = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(seed)), mesh, config)
        formats[fmt] = {p.path: (p.spec.gather_format, p.spec.fp8_in_dims)
                        for p in sharded.plan}
        losses[fmt] = float(nnx.jit(lm_loss)(sharded, batch))
    fp8_kernels = {p for p, (f, dims) in formats["fp8"].items() if f == "fp8"}
    assert fp8_kernels and all(re.search(r"blocks/(attn|mlp)/", p) for p in fp8_kernels)
    assert all(formats["fp8"][p][1] for p in fp8_kernels)  # read by the GEMMs as gathered
    for path in ("embed/embedding", "lm_head/kernel"):
        assert formats["fp8"][path] == (None, 0), (path, formats["fp8"][path])
    assert losses["fp8"] == pytest.approx(losses[None], rel=1e-6, abs=0)


# --------------------------------------------------------------------------- errors


def test_fp8_compute_settings_are_checked():
    with pytest.raises(UsageError, match="fp8_compute='rowwise' is unknown.*'delayed'"):
        gtp_jax.GTPConfig(fp8_compute="rowwise")
    with pytest.raises(UsageError, match="fp8_history_len=0 must be an int >= 1"):
        gtp_jax.GTPConfig(fp8_compute="delayed", fp8_history_len=0)
    with pytest.raises(UsageError, match="gather_format='nvfp4'.*gather formats only"):
        gtp_jax.GTPConfig(fp8_compute="tensorwise", gather_format="nvfp4")
    with pytest.raises(UsageError, match="fp8_min_features=-1"):
        gtp_jax.GTPConfig(fp8_compute="tensorwise", fp8_min_features=-1)
    with pytest.raises(UsageError, match="fp8_exclude has an invalid regular expression"):
        gtp_jax.GTPConfig(fp8_exclude=("(",))


def test_fp8_compute_with_nothing_eligible_or_tp_is_refused(seed):
    model = Mixed(nnx.Rngs(seed))
    with pytest.raises(UsageError, match=r"no layer .*fp8_min_features=2048"):
        gtp_jax.shard(model, get_mesh("gtp8"),
                      gtp_jax.GTPConfig(fp8_compute="tensorwise", min_elements=0))
    with pytest.raises(UsageError, match="tp=2: the tensor-parallel projections"):
        gtp_jax.shard(model, get_mesh("ep2_gtp2_tp2"), ALL)
    # fp8_include picks layers by path, whatever their size
    only = gtp_jax.GTPConfig(fp8_compute="tensorwise", fp8_include=("gen",), min_elements=0)
    sharded = gtp_jax.shard(model, get_mesh("gtp8"), only)
    assert [p for p, _, _ in sharded.fp8_layers] == ["gen"]
    assert any("gen: matmuls in fp8" in line for line in sharded.describe())


def test_fp8_bench_counts_gemms_and_quantize_launches_in_a_compiled_program():
    from gtp_jax.bench.fp8 import _gemm_counts, _launches

    hlo = "\n".join([
        '%a = f32[2] custom-call(bf16[8]{0} %p), custom_call_target="__gpu$xla.gpu.triton", '
        'backend_config={"name":"gtp_multi_amax","num_warps":4}',
        '%b = (f8e4m3fn[4,4], f8e4m3fn[4,4]) custom-call(bf16[4,4] %x), '
        'custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":'
        '"gtp_cast_transpose_fp8__3"}',
        '%c = (f8e4m3fn[4,4], f8e4m3fn[4,4]) custom-call(bf16[4,4] %y), '
        'custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":'
        '"gtp_cast_transpose_fp8"}',
        '%d = bf16[4,4] custom-call(%b, %c), custom_call_target="__cublas$lt$matmul$f8"',
        '%e = bf16[4,4] custom-call(%x, %y), custom_call_target="__cublas$gemm"',
        '%f = bf16[4,4] fusion(%x), kind=kLoop, calls=%gtp_not_a_call',
    ])
    counts = _gemm_counts(hlo)
    assert counts == {"fp8_gemms": 1, "other_gemms": 1,
                      "quantize_launches": {"gtp_cast_transpose_fp8": 2, "gtp_multi_amax": 1}}
    assert _launches(counts) == "cast_transpose_fp8 2, multi_amax 1"
