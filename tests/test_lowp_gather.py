"""Low-precision GTP gathers (`GTPConfig.gather_format`) against the unsharded model.

The reference is the unsharded model run on quantize -> dequantize of its *full* weights
(the `gtp_jax.pallas` reference backend, same format, block dim and per-weight scale).
Blocks never straddle the GTP shard dim and all shards of a weight agree on one amax, so
the gathered weight is exactly that reference weight: the forward pass matches to fp32
GEMM rounding, and so do the gradients, which are straight-through (taken with respect to
the dequantized weight and reduce-scattered onto the fp32 master shards).
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    Mixed,
    assert_close,
    assert_state_matches,
    flat_state,
    get_mesh,
    mixed_tokens,
    mse_loss,
    params_rtol,
    path_str,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gtp_jax
from gtp_jax import pallas
from gtp_jax.models import Transformer, lm_loss, preset
from gtp_jax.train import replicate_stray_leaves

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

FORMATS = ["fp8", "mxfp8", "nvfp4"]
# fp32 everywhere; only the order of the GEMM / gradient sums differs (as in
# test_equivalence.py, whose fp32 bound this reuses).
FP32_RTOL = 1e-5
STEPS = 2
# The Pallas kernels equal the reference bit for bit (tests/test_pallas_*.py); interpreted
# on CPU they are slow, so most tests here run the reference and one runs the kernels.
REF = "reference"


def _qdq(weight: jax.Array, spec, fmt: str, stacked: bool) -> jax.Array:
    """What every device holds after the low-precision gather of `weight` (full, logical)."""
    def one(w):
        q = pallas.quantize(w, fmt, dim=spec.block_axis, backend="reference")
        return pallas.dequantize(q, spec.compute_dtype, backend="reference")

    if stacked:  # one scale per layer's weight, as the layer loop gathers them
        return jnp.stack([one(w) for w in weight])
    return one(weight)


def _quantized_copy(ref: nnx.Module, sm: gtp_jax.ShardedModule, fmt: str) -> nnx.Module:
    plans = {p.path: p for p in sm.plan}
    qref = nnx.clone(ref)
    changed = 0
    for path, var in flat_state(qref).items():
        plan = plans.get(path_str(path))
        if plan is not None and plan.spec.quantized:
            var.set_value(_qdq(var.get_value(), plan.spec, fmt, plan.stacked))
            changed += 1
    assert changed, "no weight was quantized"
    return qref


def _grads(model, loss_fn, tokens):
    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, tokens)
    return loss, grads


@pytest.mark.parametrize("fmt", FORMATS)
def test_user_module_lowp_gather_matches_quantized_reference(fmt, key, seed) -> None:
    mesh = get_mesh("dp2_gtp4")
    ref = Mixed(nnx.Rngs(seed))
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(min_elements=0, gather_format=fmt,
                                                    quant_backend=REF))
    assert all(p.spec.gather_format == fmt for p in sm.plan)
    opt_ref = nnx.Optimizer(ref, optax.adamw(1e-2, eps=1e-3), wrt=nnx.Param)
    opt_sm = nnx.Optimizer(sm, optax.adamw(1e-2, eps=1e-3), wrt=nnx.Param)
    replicate_stray_leaves(opt_sm, mesh)  # the step compiles once, not twice
    data = NamedSharding(mesh, P(gtp_jax.data_axes(mesh)))
    for step in range(STEPS):
        tokens = mixed_tokens(jax.random.fold_in(key, step))
        qref = _quantized_copy(ref, sm, fmt)
        loss_ref, g_ref = _grads(qref, mse_loss, tokens)
        loss_sm, g_sm = _grads(sm, mse_loss, jax.device_put(tokens, data))
        assert_close(loss_sm, loss_ref, FP32_RTOL, f"{fmt} step {step} loss")
        assert_state_matches(g_sm, g_ref, sm.plan, rtol=FP32_RTOL, what=f"{fmt} step {step} grad")
        # Master weights stay fp32 and take the straight-through update.
        opt_ref.update(ref, g_ref)
        opt_sm.update(sm, g_sm)
        assert_state_matches(sm, ref, sm.plan, rtol=params_rtol(step + 1, FP32_RTOL),
                             what=f"{fmt} params after step {step + 1}")


def test_lowp_gather_differs_from_full_precision(key, seed) -> None:
    # Guards the test above: quantization visibly changes the forward pass (so matching the
    # quantized reference is not the same as matching the fp32 model).
    mesh = get_mesh("gtp8")
    ref = Mixed(nnx.Rngs(seed))
    tokens = jax.device_put(mixed_tokens(key), NamedSharding(mesh, P(gtp_jax.data_axes(mesh))))
    out = {}
    for fmt in (None, "nvfp4"):
        sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(min_elements=0, gather_format=fmt,
                                                        quant_backend=REF))
        out[fmt] = np.asarray(nnx.jit(lambda m, t: m(t))(sm, tokens))
    err = np.max(np.abs(out["nvfp4"] - out[None])) / np.max(np.abs(out[None]))
    assert 1e-3 < err < 0.5, err


def test_one_wide_axis_gathers_nothing_so_quantizes_nothing(key, seed) -> None:
    # gtp=1 (one GPU, or pure data parallelism): nothing crosses a link, so no gather format
    # applies: the model computes bit for bit as with the format off, FP8 compute included.
    mesh = get_mesh("dp8_gtp1")
    ref = Mixed(nnx.Rngs(seed))
    tokens = jax.device_put(mixed_tokens(key), NamedSharding(mesh, P(gtp_jax.data_axes(mesh))))
    out = {}
    for fmt in (None, *FORMATS):
        sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(min_elements=0, gather_format=fmt,
                                                        quant_backend=REF))
        assert sm.plan and not any(p.spec.quantized for p in sm.plan), fmt
        out[fmt] = _grads(sm, mse_loss, tokens)
    for fmt in FORMATS:
        chex.assert_trees_all_equal(out[fmt], out[None])
    fp8 = dict(min_elements=0, fp8_compute="tensorwise", fp8_min_features=0)
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(gather_format="fp8", **fp8))
    assert not any(p.spec.fp8_in_dims or p.spec.quantized for p in sm.plan)
    plain = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(**fp8))
    chex.assert_trees_all_equal(_grads(sm, mse_loss, tokens), _grads(plain, mse_loss, tokens))


@pytest.mark.parametrize(("prefetch", "backend"), [(False, REF), (True, "pallas")])
def test_transformer_lowp_gather_matches_quantized_reference(prefetch, backend, key,
                                                             seed) -> None:
    # prefetch: the scanned prefetching loop; else the default (unrolled) loop
    cfg = preset("tiny", d_model=64, n_heads=4, d_ff=96, vocab_size=120, n_layers=3,
                 max_seq_len=16, unroll_layers=not prefetch)
    mesh = get_mesh("dp2_gtp4")
    ref = Transformer(cfg, rngs=nnx.Rngs(seed))
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(gather_format="fp8", prefetch=prefetch,
                                                    quant_backend=backend))
    assert any(p.stacked for p in sm.plan)
    tokens = jax.random.randint(key, (8, 17), 0, cfg.vocab_size)
    loss_ref, g_ref = _grads(_quantized_copy(ref, sm, "fp8"), lm_loss, tokens)
    loss_sm, g_sm = _grads(sm, lm_loss,
                           jax.device_put(tokens, NamedSharding(mesh, P(gtp_jax.data_axes(mesh)))))
    assert_close(loss_sm, loss_ref, FP32_RTOL, "loss")
    assert_state_matches(g_sm, g_ref, sm.plan, rtol=FP32_RTOL, what="grad")


@pytest.mark.parametrize("unroll", [False, True])
def test_one_coalesced_amax_reduction_per_layer(unroll: bool) -> None:
    # fp8 needs one scale per weight agreed over gtp. The layer loop agrees on all of a
    # layer's scales with ONE all-reduce (an int32 pmax of the amax bit patterns); weights
    # outside the loop are gathered one by one, one all-reduce each. The scanned loop's
    # program holds one layer's body; the unrolled one, every layer.
    cfg = preset("tiny", d_model=64, n_heads=4, d_ff=96, vocab_size=120, n_layers=3,
                 max_seq_len=16, unroll_layers=unroll)
    mesh = get_mesh("gtp8")
    sm = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)), mesh,
                       gtp_jax.GTPConfig(gather_format="fp8", quant_backend=REF))
    stacked = [p for p in sm.plan if p.stacked and p.spec.quantized]
    single = [p for p in sm.plan if not p.stacked and p.spec.quantized]
    assert len(stacked) >= 4
    graphdef, state = nnx.split(sm)
    tokens = jax.device_put(np.zeros((8, 16), np.int32), gtp_jax.data_sharding(mesh))
    text = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(state, tokens).as_text()
    reduces = re.findall(r'"stablehlo\.all_reduce".*?\}\) : \(tensor<(\d+)xi32>\)', text, re.S)
    per_layer = [r for r in reduces if r == str(len(stacked))]  # int32[num stacked weights]
    assert len(per_layer) == (cfg.n_layers if unroll else 1), reduces
    assert len(reduces) == len(single) + len(per_layer), reduces


def test_backward_does_not_keep_dequantized_weights(key, seed) -> None:
    # remat_gathered=True with a low-precision gather: no full (dequantized) weight is
    # saved for the backward pass; it is re-gathered and re-dequantized instead.
    from test_equivalence import _full_weight_residuals

    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(Mixed(nnx.Rngs(seed)), mesh,
                       gtp_jax.GTPConfig(min_elements=0, gather_format="nvfp4",
                                         quant_backend=REF))
    graphdef, state = nnx.split(sm)
    tokens = jax.device_put(mixed_tokens(key), NamedSharding(mesh, P(gtp_jax.data_axes(mesh))))

    def loss(s, t):
        return mse_loss(nnx.merge(graphdef, s), t)

    found = _full_weight_residuals(loss, (state, tokens), mesh, sm.plan, None)
    # Local quantized shards (uint8 / float8 payload and scales, 1/N of a weight) may be
    # kept; a weight-shaped *float* residual would be a dequantized full weight.
    found = [line for line in found if re.match(r"(f32|bf16|f16)\[", line)]
    assert not found, "dequantized weights saved for the backward pass:\n" + "\n".join(found)


def test_unknown_gather_format_and_backend_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="gather_format='int4'"):
        gtp_jax.GTPConfig(gather_format="int4")
    with pytest.raises(ValueError, match="quant_backend='cuda'"):
        gtp_jax.GTPConfig(gather_format="fp8", quant_backend="cuda")


def test_default_quant_backend_is_the_kernels_on_gpus_and_the_reference_elsewhere(monkeypatch):
    from gtp_jax.sharding import collectives

    assert gtp_jax.GTPConfig(gather_format="nvfp4").quant_backend is None
    assert collectives.resolve_quant_backend(None) == "reference"  # CPU: no interpreter
    assert collectives.resolve_quant_backend("pallas") == "pallas"
    monkeypatch.setattr(collectives.jax, "default_backend", lambda: "gpu")
    assert collectives.resolve_quant_backend(None) == "pallas"
    assert collectives.resolve_quant_backend("reference") == "reference"
