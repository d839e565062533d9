"""A GTP-sharded module computes exactly what the unsharded module computes.

Every test draws fresh random inputs from a key unique to the test (see the `key` fixture).

Tolerances (relative to max|reference| of each compared array):
  * float32: `FP32_RTOL`. Sharded and unsharded runs do the same arithmetic per example; only
    the summation order of the batch reduction (per-shard partial sums, then the
    reduce-scatter / all-reduce) differs, which moves results by a few float32 ulps.
  * bfloat16 compute: `BF16_RTOL`. bf16 keeps 8 mantissa bits (relative spacing 2**-8 ~ 4e-3);
    per-shard partial sums are rounded to bf16 before the cross-device sum, so results may
    differ by a few bf16 ulps.
  * The AdamW runs use ``eps=1e-3`` (see `adamw`) so that the update is a Lipschitz function
    of the gradient: each step moves the parameters by an update within the float32
    tolerance, and those differences add up over the steps (`helpers.params_rtol`).
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from typing import Any

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
    assert_unchanged,
    flat_state,
    flat_values,
    get_mesh,
    jax_events,
    mixed_tokens,
    mse_loss,
    params_rtol,
    path_str,
    plan_by_path,
    snapshot,
    test_key,
    test_seed,
)
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gtp_jax
from gtp_jax.models import Transformer, lm_loss, preset
from gtp_jax.train import replicate_stray_leaves

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

# float32: only the summation order of cross-device reductions differs (a few ulps of 2**-23).
FP32_RTOL = 1e-5

# bfloat16 compute: 8 mantissa bits, partial sums rounded to bf16 per shard (a few 2**-8 ulps).
BF16_RTOL = 2e-2
# Bias grads in bf16 are plain batch sums of 80 bf16 cotangents with cancellation: the
# reference rounds one long bf16 reduction, the sharded run 8 short ones then sums in f32, so
# they differ by up to ~sqrt(80) half-ulps of the largest term (observed <= 4.2e-2 over 32 draws).
BF16_BIAS_RTOL = 8e-2
ADAM_STEPS = 5
LR = 1e-2

MIXED_SHARDED = {"embed/embedding", "lin/kernel", "ein/kernel", "ein/bias", "gen/kernel"}
MIXED_CASES = [(m, pad) for m in ("gtp8", "dp2_gtp4", "dp8_gtp1") for pad in (0, 1, 8, 64)]
# tp ranks share data and hold replicated weights; ep is a data axis like dp.
MIXED_CASES.append(("ep2_gtp2_tp2", 8))


@nnx.jit
def train_step(model: nnx.Module, optimizer: nnx.Optimizer, tokens: jax.Array):
    """One AdamW step; returns the loss, the model output and the gradients *before* it."""

    def loss_fn(m):
        out = m(tokens)
        return jnp.mean(out.astype(jnp.float32) ** 2), out

    (loss, out), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, out, grads


@nnx.jit
def loss_out_grads(model: nnx.Module, tokens: jax.Array):
    def loss_fn(m):
        out = m(tokens)
        return jnp.mean(out.astype(jnp.float32) ** 2), out

    (loss, out), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    return loss, out, grads


@nnx.jit
def lm_train_step(model: nnx.Module, optimizer: nnx.Optimizer, tokens: jax.Array):
    loss, grads = nnx.value_and_grad(lm_loss)(model, tokens)
    optimizer.update(model, grads)
    return loss, grads


def make_optimizer(model: nnx.Module, mesh=None) -> nnx.Optimizer:
    """AdamW over the params; with `mesh`, scalar state (step counts) is put on the mesh.

    nnx.Optimizer creates its step counters on one device; after the first jitted update they
    come back replicated on the mesh, which changes the jit cache key and costs a second
    compilation. Placing them up front keeps the suite fast; it changes no values.
    """
    opt = nnx.Optimizer(model, adamw(), wrt=nnx.Param)
    if mesh is not None:
        replicate_stray_leaves(opt, mesh)
    return opt


def place(mesh, x: jax.Array) -> jax.Array:
    return jax.device_put(x, gtp_jax.data_sharding(mesh, x.ndim))


def adamw() -> optax.GradientTransformation:
    # Adam divides each update by sqrt(nu) + eps. With optax's default eps=1e-8, an entry whose
    # gradient is ~0 turns float32 roundoff (~1e-6 * max|g|, far above 1e-8) into an O(lr)
    # step, and sharded/unsharded trajectories drift apart by ~1e-3 within 5 steps although
    # both are correct. eps=1e-3 keeps the update Lipschitz in the gradient, so parameters must
    # agree to float32 tolerance; a misplaced or missing update still shows as an O(lr) error.
    return optax.adamw(LR, eps=1e-3, weight_decay=1e-2)


# --------------------------------------------------------------------------- user module


@pytest.mark.parametrize("mesh_name,pad", MIXED_CASES)
def test_user_module_matches_unsharded(mesh_name: str, pad: int, key, seed) -> None:
    mesh = get_mesh(mesh_name)
    ref = Mixed(nnx.Rngs(seed))
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(min_elements=0, pad_for_alignment=pad))

    # Plan: every rank >= 2 float param is sharded, padded to the alignment multiple, on
    # dim 0 unless padding dim 0 costs over 1/32 more than another dim (then the cheapest).
    assert set(sm.sharded_paths()) == MIXED_SHARDED
    gtp = mesh.shape["gtp"]
    align = gtp * max(1, pad)
    ref_params = flat_values(ref)
    for plan in sm.plan:
        logical = ref_params[tuple(plan.path.split("/"))].shape
        assert plan.spec.logical_shape == logical
        padded = [math.prod(logical) // n * math.ceil(n / align) * align for n in logical]
        dim = 0 if padded[0] <= math.prod(logical) * (1 + 1 / 32) else int(np.argmin(padded))
        assert not plan.stacked and plan.spec.shard_dim == dim
        assert plan.spec.padded_size == math.ceil(logical[dim] / align) * align
        shard = list(logical)
        shard[dim] = plan.spec.padded_size // gtp
        assert plan.spec.shard_shape == tuple(shard)
    for path, var in flat_state(sm).items():
        name = path_str(path[1:])
        if name in MIXED_SHARDED:
            assert var.get_metadata()["gtp_logical_shape"] == ref_params[path[1:]].shape

    # The stored weights are the reference weights, bit for bit, plus zero padding.
    assert_state_matches(sm, ref, sm.plan, rtol=0.0, what="initial params")

    opt_ref = make_optimizer(ref)
    opt_sm = make_optimizer(sm, mesh)
    losses_ref, losses_sm = [], []
    for step in range(ADAM_STEPS):
        tokens = mixed_tokens(jax.random.fold_in(key, step))
        loss_ref, out_ref, g_ref = train_step(ref, opt_ref, tokens)
        loss_sm, out_sm, g_sm = train_step(sm, opt_sm, place(mesh, tokens))
        assert out_sm.shape == out_ref.shape == (16, 5, 7)
        assert_close(out_sm, out_ref, FP32_RTOL, f"step {step} output")
        assert_close(loss_sm, loss_ref, FP32_RTOL, f"step {step} loss")
        assert_state_matches(g_sm, g_ref, sm.plan, rtol=FP32_RTOL, what=f"step {step} grad")
        assert_state_matches(sm, ref, sm.plan, rtol=params_rtol(step + 1, FP32_RTOL),
                             what=f"params after step {step + 1}")
        losses_ref.append(float(loss_ref))
        losses_sm.append(float(loss_sm))
    np.testing.assert_allclose(losses_sm, losses_ref, rtol=FP32_RTOL)
    # The optimizer did move the weights (otherwise the comparison above proves little).
    moved = flat_values(ref)
    assert all(not np.array_equal(moved[k], v) for k, v in ref_params.items())


# --------------------------------------------------------------------------- transformer

TRANSFORMER_SIZES = {"d_model": 96, "n_heads": 4, "d_ff": 200, "vocab_size": 250,
                     "n_layers": 3, "max_seq_len": 16}


class TransformerRun:
    """Reference and sharded transformers trained side by side for `ADAM_STEPS` steps."""

    def __init__(self, tie: bool, prefetch: bool):
        name = f"transformer-run-tie={tie}-prefetch={prefetch}"
        self.mesh = get_mesh("dp2_gtp4")
        # prefetch: the scanned prefetching loop; else the default (unrolled) loop
        cfg = preset("tiny", tie_embeddings=tie, unroll_layers=not prefetch,
                     **TRANSFORMER_SIZES)
        self.ref = Transformer(cfg, rngs=nnx.Rngs(test_seed(name)))
        self.initial = flat_values(self.ref)
        self.sm = gtp_jax.shard(self.ref, self.mesh,
                                gtp_jax.GTPConfig(pad_for_alignment=0, prefetch=prefetch))
        self.opt_ref = make_optimizer(self.ref)
        self.opt_sm = make_optimizer(self.sm, self.mesh)
        self.steps: list[dict[str, Any]] = []
        for step in range(ADAM_STEPS):
            tokens = jax.random.randint(test_key(name, step), (8, 17), 0, cfg.vocab_size)
            loss_ref, g_ref = lm_train_step(self.ref, self.opt_ref, tokens)
            loss_sm, g_sm = lm_train_step(self.sm, self.opt_sm, place(self.mesh, tokens))
            self.steps.append({
                "loss": (float(loss_ref), float(loss_sm)),
                "grads": (flat_values(g_ref), flat_values(g_sm)),
                "params": (flat_values(self.ref), flat_values(self.sm)),
            })
        self.last_grads = g_sm


@pytest.fixture(scope="module", params=[(False, False), (True, False), (False, True)],
                ids=["untied", "tied", "untied-prefetch"])
def transformer_run(request) -> TransformerRun:
    """3 layers, so the scanned loop has a first, a middle and a last layer."""
    return TransformerRun(*request.param)


def test_transformer_matches_unsharded(transformer_run: TransformerRun) -> None:
    run = transformer_run
    plans = plan_by_path(run.sm)
    expected = {"blocks/attn/qkv/kernel", "blocks/attn/out/kernel", "blocks/mlp/gate_up/kernel",
                "blocks/mlp/down/kernel", "embed/embedding"}
    if not run.ref.cfg.tie_embeddings:
        expected.add("lm_head/kernel")
    assert set(plans) == expected
    for name, plan in plans.items():
        assert plan.stacked == name.startswith("blocks/"), name
        # the embedding and head are split on the vocabulary (read as slices: local)
        assert plan.stored_dim == (1 if plan.stacked or name == "lm_head/kernel" else 0)
        assert plan.local == (not plan.stacked), name
    assert plans["embed/embedding"].spec.padded_size == 252  # 250 rows -> multiple of 4

    losses_ref = [s["loss"][0] for s in run.steps]
    losses_sm = [s["loss"][1] for s in run.steps]
    np.testing.assert_allclose(losses_sm, losses_ref, rtol=FP32_RTOL)
    for step, rec in enumerate(run.steps):
        g_ref, g_sm = rec["grads"]
        assert_state_matches(g_sm, g_ref, run.sm.plan, rtol=FP32_RTOL, what=f"step {step} grad")
        p_ref, p_sm = rec["params"]
        assert_state_matches(p_sm, p_ref, run.sm.plan, rtol=params_rtol(step + 1, FP32_RTOL),
                             what=f"params after step {step + 1}")
    final = run.steps[-1]["params"][0]
    assert all(not np.array_equal(final[k], v) for k, v in run.initial.items())


def _spec_entry(spec: P, dim: int) -> Any:
    return spec[dim] if dim < len(spec) else None


def _assert_layout(what: str, arr: jax.Array, plan: Any, n_devices: int) -> None:
    """`arr` is 1/N on the GTP axis if `plan` is given, fully replicated otherwise."""
    shards = arr.addressable_shards
    assert len(shards) == n_devices, what
    spec = arr.sharding.spec
    if plan is None:
        assert all(s.data.shape == arr.shape for s in shards), f"{what} is split"
        assert all(e is None for e in spec), f"{what}: spec {spec}"
        return
    lead = (arr.shape[0],) if plan.stacked else ()
    local = lead + plan.spec.shard_shape
    assert arr.shape[plan.stored_dim] == plan.spec.padded_size, what
    assert local[plan.stored_dim] * plan.spec.axis_size == plan.spec.padded_size
    for s in shards:
        assert s.data.shape == local, f"{what}: local shard {s.data.shape}, expected {local}"
    for dim in range(arr.ndim):
        entry = _spec_entry(spec, dim)
        names = entry if isinstance(entry, tuple) else (entry,)
        if dim == plan.stored_dim:
            assert names == ("gtp",), f"{what}: spec {spec} does not put 'gtp' on dim {dim}"
        else:
            assert entry is None, f"{what}: spec {spec} splits dim {dim}"


def test_per_device_memory_is_one_over_n(transformer_run: TransformerRun) -> None:
    run = transformer_run
    n_dev = run.mesh.devices.size
    gtp = run.mesh.shape["gtp"]
    plans = plan_by_path(run.sm)
    params = flat_values(run.sm)
    grads = flat_values(run.last_grads)
    moments: dict[tuple[str, tuple], jax.Array] = {}
    for path, value in flat_values(run.opt_sm, nnx.OptState).items():
        for kind in ("mu", "nu"):
            if kind in path:
                moments[(kind, path[path.index(kind) + 1:])] = value
    assert set(grads) == set(params)
    assert {k for _, k in moments} == set(params)
    for path, value in params.items():
        plan = plans.get(path_str(path[1:]))
        _assert_layout(f"param {path}", value, plan, n_dev)
        _assert_layout(f"grad {path}", grads[path], plan, n_dev)
        _assert_layout(f"adam mu {path}", moments[("mu", path)], plan, n_dev)
        _assert_layout(f"adam nu {path}", moments[("nu", path)], plan, n_dev)

    sharded = {k: v for k, v in params.items() if path_str(k[1:]) in plans}
    replicated = {k: v for k, v in params.items() if path_str(k[1:]) not in plans}
    assert replicated, "norm scales should stay replicated"
    local_bytes = sum(
        math.prod(((v.shape[0],) if plans[path_str(k[1:])].stacked else ())
                  + plans[path_str(k[1:])].spec.shard_shape) * v.dtype.itemsize
        for k, v in sharded.items())
    full_bytes = sum(run.initial[k[1:]].nbytes for k in sharded)
    assert gtp_jax.bytes_per_device(sharded) == local_bytes
    # 1/N of the full weights, plus at most ~1% of padding (250 -> 252 embedding rows).
    assert full_bytes / gtp <= local_bytes <= 1.01 * full_bytes / gtp
    rep_bytes = sum(v.nbytes for v in replicated.values())
    assert gtp_jax.bytes_per_device(replicated) == rep_bytes
    assert gtp_jax.bytes_per_device(run.sm) == local_bytes + rep_bytes
    for device in run.mesh.devices.flat:
        assert gtp_jax.bytes_per_device(sharded, device) == local_bytes
    moment_bytes = gtp_jax.bytes_per_device(list(moments.values()))
    assert moment_bytes == 2 * (local_bytes + rep_bytes)


# --------------------------------------------------------------------------- bfloat16


def _all_gather_dtypes(lowered_text: str) -> list[str]:
    lines = [ln for ln in lowered_text.splitlines() if '"stablehlo.all_gather"' in ln]
    return [re.search(r"->\s*tensor<(?:\d+x)*(\w+)>", ln).group(1) for ln in lines]


def test_an_eager_call_and_its_gradient_run_as_compiled_programs(key, seed) -> None:
    """Called outside jit (a notebook cell, ``nnx.grad`` without ``nnx.jit``), a sharded call
    runs as one jitted program, not operation by operation with each operation compiled on
    its own (an eager gradient of this two-layer decoder then lowered about 580 programs and
    took 38 s on 2 CPU cores). Its values are the unsharded module's."""
    cfg = preset("tiny", **{**TRANSFORMER_SIZES, "n_layers": 2})
    ref = Transformer(cfg, rngs=nnx.Rngs(seed))
    mesh = get_mesh("dp2_gtp4")
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(pad_for_alignment=0))
    tokens = jax.random.randint(key, (8, 14), 0, cfg.vocab_size)  # a length no other test has
    with jax_events("/jax/core/compile/jaxpr_to_mlir_module_duration") as lowered:
        logits = sm(place(mesh, tokens[:, :-1])).logits
        loss, grads = nnx.value_and_grad(lm_loss)(sm, place(mesh, tokens))
    # The forward call, and the gradient's forward and backward: one program each. The loss
    # around the call runs eagerly, operation by operation (about 40 small programs); the
    # sharded body's operations, compiled one by one, were about 540 more.
    assert lowered.count("jit(body)") <= 3, lowered
    assert len(lowered) <= 80, lowered
    ref_logits = nnx.jit(lambda m, t: m(t).logits)(ref, tokens[:, :-1])
    assert_close(logits, ref_logits, FP32_RTOL, "eager logits")
    ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(lm_loss))(ref, tokens)
    assert_close(loss, ref_loss, FP32_RTOL, "eager loss")
    assert_state_matches(grads, ref_grads, sm.plan, rtol=FP32_RTOL, what="eager gradient")


def test_a_sharded_call_traces_the_module_once(monkeypatch) -> None:
    """The checks of a sharded call (randomness from shard-identical keys, the module's own
    remat regions) read the program's own trace, which the call then reuses: the module's
    Python runs once per traced call, not once for the checks and again for the program."""
    calls = []
    forward = Transformer._forward

    def counting(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "_forward", counting)
    cfg = preset("tiny", **{**TRANSFORMER_SIZES, "n_layers": 2})
    mesh = get_mesh("dp2_gtp4")  # data shards: the randomness check runs
    sm = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    graphdef, state = nnx.split(sm)
    tokens = jax.ShapeDtypeStruct((8, 17), jnp.int32)
    jax.jit(jax.grad(lambda s, t: lm_loss(nnx.merge(graphdef, s), t))).trace(state, tokens)
    assert len(calls) == 1, len(calls)


@pytest.mark.parametrize("gather_dtype", [None, "bfloat16"])
def test_bf16_compute_matches_unsharded_bf16(gather_dtype, key, seed) -> None:
    mesh = get_mesh("dp2_gtp4")
    ref = Mixed(nnx.Rngs(seed), dtype=jnp.bfloat16, param_dtype=jnp.float32)
    cfg = gtp_jax.GTPConfig(min_elements=0, pad_for_alignment=8, gather_dtype=gather_dtype)
    sm = gtp_jax.shard(ref, mesh, cfg)
    tokens = mixed_tokens(key)
    loss_ref, out_ref, g_ref = loss_out_grads(ref, tokens)
    loss_sm, out_sm, g_sm = loss_out_grads(sm, place(mesh, tokens))
    assert out_ref.dtype == out_sm.dtype == jnp.bfloat16
    assert_close(out_sm, out_ref, BF16_RTOL, "output")
    assert_close(loss_sm, loss_ref, BF16_RTOL, "loss")
    # Gradients come back in the (float32) parameter dtype, padded and sharded.
    assert all(v.dtype == jnp.float32 for v in flat_values(g_sm).values())
    assert_state_matches(g_sm, g_ref, sm.plan, rtol=BF16_RTOL, what="grad",
                         rtol_for=dict.fromkeys(("lin/bias", "gen/bias"), BF16_BIAS_RTOL))

    graphdef, state = nnx.split(sm)
    text = jax.jit(lambda s, t: mse_loss(nnx.merge(graphdef, s), t)).lower(
        state, place(mesh, tokens)).as_text()
    dtypes = _all_gather_dtypes(text)
    assert len(dtypes) >= len(sm.plan)
    # gather_dtype casts the shard before the all-gather (half the bytes on the wire).
    assert set(dtypes) == ({"bf16"} if gather_dtype else {"f32"})


# --------------------------------------------------------------------------- microbatching


def test_microbatch_accumulation_matches_big_batch(key, seed) -> None:
    k = 4
    mesh = get_mesh("dp2_gtp4")
    ref = Mixed(nnx.Rngs(seed))
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(min_elements=0, pad_for_alignment=8))
    tokens = mixed_tokens(key, batch=8 * k)
    micro = tokens.reshape(k, 8, tokens.shape[1])
    micro = jax.device_put(micro, NamedSharding(mesh, P(None, gtp_jax.data_axes(mesh), None)))

    graphdef, params, rest = nnx.split(sm, nnx.Param, ...)

    @jax.jit
    def accumulate(params, rest, micro):
        def body(acc, x):
            g = jax.grad(lambda p: mse_loss(nnx.merge(graphdef, p, rest), x))(params)
            return jax.tree.map(jnp.add, acc, g), None

        acc, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)
        return jax.tree.map(lambda a: a / k, acc)

    mean_grads = accumulate(params, rest, micro)
    _, _, big_ref = loss_out_grads(ref, tokens)
    _, _, big_sm = loss_out_grads(sm, place(mesh, tokens))
    # mean of k microbatch mean-losses' grads == grad of the big batch's mean loss
    assert_state_matches(mean_grads, big_ref, sm.plan, rtol=FP32_RTOL, what="accumulated grad")
    acc_flat, big_flat = flat_values(mean_grads), flat_values(big_sm)
    assert set(acc_flat) == set(big_flat)
    plans = plan_by_path(sm)
    for path, value in acc_flat.items():
        assert_close(value, big_flat[path], FP32_RTOL, f"accumulated vs sharded big {path}")
        plan = plans.get(path_str(path[1:]))
        # the accumulator itself stays 1/N per device
        _assert_layout(f"accumulated grad {path}", value, plan, mesh.devices.size)


# --------------------------------------------------------------------------- shard / unshard


def _transformer(seed: int) -> nnx.Module:
    return Transformer(preset("tiny", **TRANSFORMER_SIZES), rngs=nnx.Rngs(seed))


@pytest.mark.parametrize("model", ["mixed", "transformer"])
@pytest.mark.parametrize("mesh_name,pad", [("gtp8", 64), ("dp2_gtp4", 0)])
def test_shard_unshard_roundtrip_is_exact(model, mesh_name, pad, key, seed) -> None:
    mesh = get_mesh(mesh_name)
    ref = Mixed(nnx.Rngs(seed)) if model == "mixed" else _transformer(seed)
    before = snapshot(ref)
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(min_elements=0, pad_for_alignment=pad))
    assert_unchanged(ref, before)  # shard() copies; the input module is untouched
    sharded_before = snapshot(sm)

    full = gtp_jax.unshard(sm)
    assert type(full) is type(ref)
    assert_unchanged(sm, sharded_before)  # unshard() does not modify the sharded module
    ref_vars, full_vars = flat_state(ref, ...), flat_state(full, ...)
    assert set(ref_vars) == set(full_vars)
    for path, var in ref_vars.items():
        a, b = var.get_value(), full_vars[path].get_value()
        assert type(full_vars[path]) is type(var)
        assert b.shape == a.shape and b.dtype == a.dtype, path
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"{path} is not bit-exact"
        assert "gtp_logical_shape" not in full_vars[path].get_metadata()
        assert all(s.data.shape == b.shape for s in b.addressable_shards), path

    if model == "mixed":
        # Training the sharded copy leaves the original and the export untouched.
        full_before = snapshot(full)
        opt = make_optimizer(sm, mesh)
        train_step(sm, opt, place(mesh, mixed_tokens(key)))
        assert_unchanged(ref, before)
        assert_unchanged(full, full_before)
        # ...and the export of the trained copy equals its (unpadded) weights exactly.
        trained = flat_values(gtp_jax.unshard(sm))
        assert_state_matches(sm, trained, sm.plan, rtol=0.0, what="re-exported params")


# --------------------------------------------------------------------------- remat / HLO


def _collective_count(text: str, op: str) -> int:
    return len(re.findall(rf"\s{op}(?:-start)?\(", text))


def _all_reduce_operand_shapes(hlo: str) -> list[tuple[int, ...]]:
    shapes = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(\(?[^=]*?\)?)\s+all-reduce(?:-start)?\(", line)
        if not m:
            continue
        for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1)):
            shapes.append(tuple(int(d) for d in dims.split(",") if d))
    return shapes


def _mixed_grad_setup(seed: int, key, remat: bool = True):
    mesh = get_mesh("dp2_gtp4")
    ref = Mixed(nnx.Rngs(seed))
    sm = gtp_jax.shard(ref, mesh, gtp_jax.GTPConfig(min_elements=0, pad_for_alignment=8,
                                                    remat_gathered=remat))
    graphdef, state = nnx.split(sm)
    tokens = place(mesh, mixed_tokens(key))

    def loss(s, t):
        return mse_loss(nnx.merge(graphdef, s), t)

    return ref, sm, state, tokens, loss


def test_compiled_gradient_uses_reduce_scatter_not_full_all_reduce(key, seed) -> None:
    ref, sm, state, tokens, loss = _mixed_grad_setup(seed, key)
    hlo = jax.jit(jax.value_and_grad(loss)).lower(state, tokens).compile().as_text()
    assert _collective_count(hlo, "all-gather") >= len(sm.plan)
    assert _collective_count(hlo, "reduce-scatter") == len(sm.plan)

    plans = plan_by_path(sm)
    ref_params = flat_values(ref)
    full_shapes = set()
    shard_elems = rep_elems = 0
    for path, value in ref_params.items():
        plan = plans.get(path_str(path))
        if plan is None:
            rep_elems += value.size
            continue
        full_shapes |= {plan.spec.logical_shape, plan.spec.padded_shape}
        shard_elems += math.prod(plan.spec.shard_shape)
    reduced = _all_reduce_operand_shapes(hlo)
    assert reduced, "expected all-reduces (dp sum of shard grads, replicated biases, loss)"
    for shape in reduced:
        assert shape not in full_shapes, f"a full-weight-sized all-reduce {shape}"
    # all-reduced: shard-sized grads over dp, rank-1 biases, and the loss scalar.
    assert sum(math.prod(s) for s in reduced) <= shard_elems + rep_elems + 8


def test_backward_pass_regathers_weights(key, seed) -> None:
    """remat_gathered=True: the backward pass all-gathers the weights again.

    Checked on the lowered program (what JAX emits). XLA:CPU later drops the optimization
    barrier and CSEs the re-gather with the forward gather, so the CPU *compiled* text
    cannot show it.
    """
    _, sm, state, tokens, loss = _mixed_grad_setup(seed, key)
    fwd = jax.jit(loss).lower(state, tokens).as_text()
    bwd = jax.jit(jax.value_and_grad(loss)).lower(state, tokens).as_text()
    n_fwd = fwd.count('"stablehlo.all_gather"')
    n_bwd = bwd.count('"stablehlo.all_gather"')
    assert n_fwd == len(sm.plan)
    # lin, ein and gen kernels are needed by their matmul's backward: re-gathered.
    assert n_bwd >= n_fwd + 3, f"{n_bwd} all-gathers in fwd+bwd, {n_fwd} in the forward"


def test_no_remat_does_not_regather(key, seed) -> None:
    _, sm, state, tokens, loss = _mixed_grad_setup(seed, key, remat=False)
    fwd = jax.jit(loss).lower(state, tokens).as_text()
    bwd = jax.jit(jax.value_and_grad(loss)).lower(state, tokens).as_text()
    assert fwd.count('"stablehlo.all_gather"') == len(sm.plan)
    assert bwd.count('"stablehlo.all_gather"') == len(sm.plan)


def _full_weight_residuals(fn, args, mesh, plans, n_layers: int | None) -> list[str]:
    """Residuals saved for the backward pass that hold a whole (gathered) weight per device."""
    full = set()
    for plan in plans:
        for shape in (plan.spec.logical_shape, plan.spec.padded_shape):
            full.add((n_layers,) + shape if plan.stacked else shape)
    # print_saved_residuals is the public API: one "f32[400,29] <origin>" line per residual.
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        print_saved_residuals(fn, *args)
    lines = buffer.getvalue().splitlines()
    assert lines, "no residuals reported"
    found = []
    for line in lines:
        m = re.match(r"\w+\[([\d,]*)\]\s+(.*)$", line)
        assert m, f"unparsed residual line {line!r}"
        if m.group(2).startswith("from the argument"):
            continue  # the stored shards themselves
        shape = tuple(int(d) for d in m.group(1).split(",") if d)
        candidates = {shape}
        if shape and shape[0] % mesh.devices.size == 0:
            # a shard_map residual is stacked over all devices on dim 0
            candidates.add((shape[0] // mesh.devices.size,) + shape[1:])
        if candidates & full:
            found.append(line)
    return found


@pytest.mark.parametrize("model", ["mixed", "transformer"])
def test_backward_does_not_keep_gathered_weights(model, key, seed) -> None:
    """With remat_gathered=True no full weight is saved from the forward for the backward."""
    if model == "mixed":
        _, sm, state, tokens, loss = _mixed_grad_setup(seed, key)
        layers = None
    else:
        mesh = get_mesh("dp2_gtp4")
        sm = gtp_jax.shard(_transformer(seed), mesh, gtp_jax.GTPConfig())
        graphdef, state = nnx.split(sm)
        tokens = place(mesh, jax.random.randint(key, (8, 17), 0, 250))
        layers = TRANSFORMER_SIZES["n_layers"]

        def loss(s, t):
            return lm_loss(nnx.merge(graphdef, s), t)

    found = _full_weight_residuals(loss, (state, tokens), sm.mesh, sm.plan, layers)
    assert not found, "full gathered weights saved for the backward pass:\n" + "\n".join(found)


def test_a_mesh_of_explicit_axes_splits_unplaced_arguments(key) -> None:
    """`jax.make_mesh` types arrays by their sharding (Explicit axes, its default in new
    JAX): an argument not yet split over the data axes is moved there by the call, eagerly
    and under jit, and the numbers are the unsharded module's."""
    explicit = jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((2, 4), ("dp", "gtp"), axis_types=(explicit, explicit))
    x = jax.random.normal(key, (16, 40))
    ref = nnx.Linear(40, 61, rngs=nnx.Rngs(0))
    sm = gtp_jax.shard(nnx.Linear(40, 61, rngs=nnx.Rngs(0)), mesh,
                       gtp_jax.GTPConfig(min_elements=0))
    np.testing.assert_allclose(sm(x), ref(x), rtol=1e-6, atol=1e-6)

    def loss(m, x):
        return jnp.mean(m(x) ** 2)

    got = nnx.jit(nnx.grad(loss))(sm, x)
    want = nnx.grad(loss)(ref, x)
    np.testing.assert_allclose(gtp_jax.unshard_values(sm, got)["kernel"], want["kernel"][...],
                               rtol=1e-5, atol=1e-7)


def test_unsharded_weights_written_into_a_sharded_module_are_refused_in_one_line() -> None:
    """``nnx.update`` of a plain module's weights into the sharded one writes logical shapes
    where the stored layout is padded (61 over gtp = 4 is stored as 64): the next call names
    the weight and the way to load weights, before anything runs."""
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    sm = gtp_jax.shard(nnx.Linear(37, 61, rngs=nnx.Rngs(0)), mesh,
                       gtp_jax.GTPConfig(min_elements=0))
    nnx.update(sm.module, nnx.state(nnx.Linear(37, 61, rngs=nnx.Rngs(7))))
    with pytest.raises(gtp_jax.UsageError, match=r"^gtp_jax.ShardedModule: the weight 'kernel' "
                       r"has shape \(37, 61\), but its dim 1 is split over gtp \(4 devices\).*"
                       r"Load weights into the plain module and shard it then"):
        sm(jnp.ones((16, 37)))
    # A shape the mesh divides: the numbers would be right, but the weight is no longer
    # split (a tp-split weight's parts would be read in the wrong order): refused by an
    # eager call and by TrainStep, which see concrete arrays.
    even = gtp_jax.shard(nnx.Linear(40, 64, rngs=nnx.Rngs(0)), mesh,
                         gtp_jax.GTPConfig(min_elements=0))
    nnx.update(even.module, nnx.state(nnx.Linear(40, 64, rngs=nnx.Rngs(7))))
    with pytest.raises(gtp_jax.UsageError, match=r"^gtp_jax.ShardedModule: the weight 'kernel' "
                       r"is not stored split as .* on the mesh"):
        even(jnp.ones((16, 40)))
    from gtp_jax.train import TrainStep  # noqa: PLC0415

    with pytest.raises(gtp_jax.UsageError, match=r"^TrainStep: the weight 'kernel' is not"):
        TrainStep(even, nnx.Optimizer(even, optax.sgd(0.1), wrt=nnx.Param),
                  lambda m, x: jnp.mean(m(x) ** 2))
    # Called only under nnx.jit (no concrete array in sight): the Variables nnx.update
    # wrote in carry the plain module's metadata, without the layout shard() recorded.
    jitted = gtp_jax.shard(nnx.Linear(40, 64, rngs=nnx.Rngs(0)), mesh,
                           gtp_jax.GTPConfig(min_elements=0))
    nnx.update(jitted.module, nnx.state(nnx.Linear(40, 64, rngs=nnx.Rngs(7))))
    with pytest.raises(gtp_jax.UsageError, match=r"^gtp_jax.ShardedModule: the weight 'kernel' "
                       r"lost the layout metadata gtp_jax.shard gave it: .*nnx.update"):
        nnx.jit(lambda m, x: m(x))(jitted, jnp.ones((16, 40)))


def test_flax_decode_cache_is_refused_in_one_line_before_the_call() -> None:
    """Flax's decode cache (``nnx.Cache``) holds whole-batch rows the data shards would each
    read with their own rows: refused up front, naming the way out."""
    mha = nnx.MultiHeadAttention(num_heads=2, in_features=40, qkv_features=64, decode=True,
                                 rngs=nnx.Rngs(0))
    mha.init_cache((16, 4, 40))
    sm = gtp_jax.shard(mha, gtp_jax.make_mesh(dp=2, gtp=4))
    before = jax.tree.map(np.asarray, nnx.state(sm))
    with pytest.raises(gtp_jax.UsageError, match=r"Flax's decode cache \(nnx.Cache\).*"
                       r"decode with the unsharded module \(gtp_jax.unshard\)"):
        sm(jnp.ones((16, 1, 40)))
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, nnx.state(sm)))
