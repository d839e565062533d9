"""FP8 compute with delayed scaling (``GTPConfig(fp8_compute="delayed")``).

On CPUs FP8 is emulated exactly (see tests/test_fp8_compute.py). With delayed scaling
every scale comes from the amax history, which the sharded call keeps identical on every
device (the recorded amax is the maximum over the mesh), so a sharded step equals the
unsharded module's step on the whole batch with the same history, up to float32
reduction order (activations that differ in their last bits, rarely moved across an FP8
rounding boundary); the histories then agree to that rounding too (an amax is the largest
of those activations, computed exactly).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import Mixed, assert_close, get_mesh, mixed_tokens, train_until

import gtp_jax
from gtp_jax.base.errors import UsageError
from gtp_jax.base.fp8_history import Fp8History
from gtp_jax.models import Transformer, lm_loss, preset
from gtp_jax.pallas.fp8_matmul import (
    fp8_matmul_delayed,
    fp8_matmul_delayed_reference,
    history_scales,
    roll_history,
)
from gtp_jax.sharding import fp8
from gtp_jax.sharding.fp8_update import check_fp8_uses
from gtp_jax.train import CheckpointConfig, Checkpointer, TrainConfig, TrainStep, train
from gtp_jax.train.cli.command import main as cli_main

#: float32 reduction order in the sharded run's sums (the loss, the activations whose
#: amax is recorded), including an occasional FP8 rounding flip of an element in a sum:
#: a wrong scale or a missing reduction over devices gives errors of whole percents
#: (a power of two in a scale, or a device's own amax instead of the maximum).
RTOL_SAME_MATH = 2e-4
DELAYED = gtp_jax.GTPConfig(fp8_compute="delayed", fp8_min_features=0, min_elements=0,
                            fp8_history_len=4)


# --------------------------------------------------------------------------- the op


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_delayed_matmul_matches_its_reference_and_rolls_the_history(dtype, key):
    kx, kw, kg = jax.random.split(key, 3)
    x = jax.random.normal(kx, (37, 50), dtype)            # unaligned shapes
    w = (jax.random.normal(kw, (50, 29)) * 0.05).astype(dtype)
    dy = (jax.random.normal(kg, (37, 29)) * 1e-3).astype(dtype)
    # Earlier steps' amaxes (newest first), unlike this step's: the scales come from them.
    history = jnp.array([[2.5, 0.3, 4e-3], [0.0, 0.0, 0.0], [3.5, 0.1, 1e-3]], jnp.float32)
    y, vjp = jax.vjp(fp8_matmul_delayed, x, w, history)
    dx, dw, new = vjp(dy)
    ry, rdx, rdw, rnew = fp8_matmul_delayed_reference(x, w, dy, history)
    tol = 1e-6 if dtype == jnp.float32 else 2**-8  # float32 vs a bf16 output rounding
    assert y.dtype == dx.dtype == dw.dtype == dtype and new.dtype == jnp.float32
    assert_close(y, ry, tol, "forward")
    assert_close(dx, rdx, tol, "dx")
    assert_close(dw, rdw, tol, "dw")
    # The returned history: this step's amaxes first, the rest shifted by one, exactly.
    current = [float(jnp.max(jnp.abs(a.astype(jnp.float32)))) for a in (x, w, dy)]
    np.testing.assert_array_equal(np.asarray(new), np.asarray(rnew))
    np.testing.assert_array_equal(np.asarray(new[0]), np.float32(current))
    np.testing.assert_array_equal(np.asarray(new[1:]), np.asarray(history[:-1]))
    # ... and the scales really are the history's: one whose x amax is far below this
    # step's saturates x (a power-of-two change of a scale alone moves no e4m3 value).
    low = history.at[:, 0].set(jnp.array([0.25, 0.0, 0.0]))
    assert not np.array_equal(np.asarray(fp8_matmul_delayed(x, w, low), np.float32),
                              np.asarray(y, np.float32))
    assert_close(fp8_matmul_delayed(x, w, low), fp8_matmul_delayed_reference(
        x, w, dy, low)[0], tol, "saturated forward")


def test_delayed_matmul_pallas_path_gives_the_xla_bits(key):
    kx, kw, kg = jax.random.split(key, 3)
    x = (jax.random.normal(kx, (70, 100)) * 30).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (100, 45)) * 0.05).astype(jnp.bfloat16)
    dy = jax.random.normal(kg, (70, 45), jnp.bfloat16)
    history = roll_history(jnp.zeros((2, 3)), jnp.array([100.0, 0.2, 3.0]))
    out = {}
    for backend in ("pallas", "xla"):
        def f(x, w, h, backend=backend):
            return fp8_matmul_delayed(x, w, h, backend=backend, interpret=True)

        y, vjp = jax.vjp(f, x, w, history)
        out[backend] = (y, *vjp(dy))
    for name, a, b in zip(("y", "dx", "dw", "history"), out["pallas"], out["xla"]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=name)


def test_first_step_uses_scale_one_and_inf_is_never_hidden(key):
    x = jax.random.normal(key, (8, 16))
    w = jnp.full((16, 4), 0.25)
    zero = jnp.zeros((3, 3))
    # An empty history scales by 1: e4m3 holds these values to 3 mantissa bits.
    y = fp8_matmul_delayed(x, w, zero)
    want = (x.astype(jnp.float8_e4m3fn).astype(jnp.float32) @ w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6)
    # An Inf in the activation: the rows it reaches are NaN (never finite), and the history
    # records it, so every scale computed from it is NaN until it ages out.
    bad = x.at[3, 4].set(jnp.inf)
    y, vjp = jax.vjp(fp8_matmul_delayed, bad, w, zero)
    assert np.all(np.isnan(np.asarray(y[3]))) and np.all(np.isfinite(np.asarray(y[:3])))
    _, _, new = vjp(jnp.ones_like(y))
    assert np.isinf(float(new[0, 0]))
    assert np.all(np.isnan(np.asarray(fp8_matmul_delayed(x, w, new))))
    with pytest.raises(UsageError, match=r"history has shape \(3,\)"):
        fp8_matmul_delayed(x, w, jnp.zeros((3,)))


def test_a_given_x_scale_replaces_the_historys_and_is_not_differentiated(key):
    kx, kw, kg = jax.random.split(key, 3)
    x = jax.random.normal(kx, (16, 24))
    w = jax.random.normal(kw, (24, 8)) * 0.05
    dy = jax.random.normal(kg, (16, 8)) * 1e-3
    own = jnp.array([[0.25, 0.3, 4e-3], [0.0, 0.0, 0.0]], jnp.float32)  # saturates x
    other = own.at[:, 0].set(jnp.array([3.5, 0.0]))
    sx = history_scales(other)[0]
    y, vjp = jax.vjp(lambda a, b, h, s: fp8_matmul_delayed(a, b, h, x_scale=s), x, w, own, sx)
    dx, dw, new, dsx = vjp(dy)
    # The same as the history whose x column gave that scale: x's scale only was replaced.
    ry, rdx, rdw, _ = fp8_matmul_delayed_reference(x, w, dy, other)
    assert_close(y, ry, 1e-6, "forward")
    assert_close(dx, rdx, 1e-6, "dx")
    assert_close(dw, rdw, 1e-6, "dw")
    # The layer's own history still records this step's amaxes; the scale gets no gradient.
    np.testing.assert_array_equal(np.asarray(new),
                                  np.asarray(fp8_matmul_delayed_reference(x, w, dy, own)[3]))
    assert float(dsx) == 0.0


class _TwoReaders(nnx.Module):
    """Two FP8 layers reading one input (as q and k/v read the normed input)."""

    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(16, 12, use_bias=False, rngs=rngs)
        self.b = nnx.Linear(16, 20, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.a(x), self.b(x)


@pytest.mark.parametrize("gather_format", [None, "fp8"])
def test_an_input_two_layers_read_is_quantized_once_with_the_first_layers_scale(
        key, gather_format):
    # Each layer's history records the same x amax, so their x scales are equal in value;
    # the second layer takes the first's, so XLA quantizes x once. Pinned here with
    # histories that differ (they never do in training): b's own x column has no effect
    # on b, a's does. Also when the kernels are gathered in FP8 (their payloads feed the
    # GEMMs).
    x = jax.random.normal(key, (8, 16))
    mesh = gtp_jax.make_mesh(gtp=8)
    config = dataclasses.replace(DELAYED, gather_format=gather_format)

    def outputs(a_x: float, b_x: float) -> tuple[np.ndarray, np.ndarray]:
        model = gtp_jax.shard(_TwoReaders(nnx.Rngs(0)), mesh, config)
        for name, amax in (("a", a_x), ("b", b_x)):
            var = getattr(model.module, name).dot_general.amax_history
            var[...] = var[...].at[0, 0].set(amax)
        ya, yb = model(x)
        return np.asarray(ya), np.asarray(yb)

    base = outputs(4.0, 4.0)
    low_b = outputs(4.0, 0.25)
    low_a = outputs(0.25, 4.0)
    np.testing.assert_array_equal(low_b[1], base[1])  # b used a's scale, not its own
    assert not np.array_equal(low_a[0], base[0])      # a's saturating scale ...
    assert not np.array_equal(low_a[1], base[1])      # ... quantized b's input too


# --------------------------------------------------------------------------- modules


def _histories(module: nnx.Module) -> dict[str, np.ndarray]:
    """``{path: history}`` without a leading ``module`` key; checks every device holds the
    same bits of each history (replicated state that kept one shard's value would differ)."""
    out = {}
    for keys, var in nnx.to_flat_state(nnx.state(module, Fp8History)):
        value = var.get_value()
        shards = [np.asarray(s.data) for s in value.addressable_shards]
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0], err_msg="/".join(map(str, keys)))
        keys = keys[1:] if keys[0] == "module" else keys
        out["/".join(map(str, keys))] = shards[0]
    return out


def test_grad_accumulation_rolls_the_history_once_with_the_largest_amax(key, seed):
    from gtp_jax.train.step.train_step import _grads_and_history

    model = Mixed(nnx.Rngs(seed))
    fp8.inject(model, fp8.fp8_layers(model, DELAYED), DELAYED)
    nnx.update(model, jax.tree.map(lambda h: h + 0.5, nnx.state(model, Fp8History)))
    tokens = mixed_tokens(key)

    def mse(m, t):
        return jnp.mean(m(t).astype(jnp.float32) ** 2)

    loss, grads, history = jax.jit(_grads_and_history, static_argnums=(1, 3))(
        model, mse, tokens, 2)
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8History))
    # accumulate_grads' microbatch i takes rows i, i + 2, ...
    part = nnx.jit(nnx.value_and_grad(mse, argnums=wrt))
    parts = [part(model, tokens[i::2]) for i in range(2)]
    assert_close(loss, (parts[0][0] + parts[1][0]) / 2, 1e-6, "loss")
    got_h = _histories(history)
    for path, h0 in _histories(parts[0][1]).items():
        want = np.maximum(h0, _histories(parts[1][1])[path])
        np.testing.assert_array_equal(got_h[path], want, err_msg=path)
        assert np.all(want[1:] == 0.5), path  # rolled once, not once per microbatch
    got_p = dict(nnx.to_flat_state(grads))
    for keys, var in nnx.to_flat_state(nnx.state(parts[0][1], nnx.Param)):
        other = dict(nnx.to_flat_state(parts[1][1]))[keys].get_value()
        assert_close(got_p[keys].get_value(), (var.get_value() + other) / 2, 1e-6, str(keys))


def test_sharded_decoder_trains_like_unsharded_with_delayed_scaling(key, seed):
    # The scanned loop with prefetch here; the unrolled loop in the resume test, the scanned
    # loop without prefetch in the command-line test.
    mesh = get_mesh("dp2_gtp4")
    cfg = preset("tiny", d_model=64, n_heads=2, d_ff=128, vocab_size=128, n_layers=2,
                 remat="dots", unroll_layers=False)
    config = dataclasses.replace(DELAYED, fp8_min_features=64, prefetch=True,
                                 min_elements=1024)
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    sharded = gtp_jax.shard(nnx.clone(model), mesh, config)
    assert {k: v.shape for k, v in _histories(sharded).items()} == {
        f"blocks/{p}/dot_general/amax_history": (2, 4, 4)
        for p in ("attn/out", "attn/qkv", "mlp/down", "mlp/gate_up")}
    ref = Transformer(cfg, rngs=nnx.Rngs(seed))  # the same init; its own (donated) arrays
    fp8.inject(ref, fp8.fp8_layers(ref, config), config)
    tx = optax.adamw(3e-3)
    steps = {"sharded": TrainStep(sharded, nnx.Optimizer(sharded, tx, wrt=nnx.Param),
                                  lm_loss),
             "unsharded": TrainStep(ref, nnx.Optimizer(ref, tx, wrt=nnx.Param), lm_loss)}
    losses: dict[str, list[float]] = {"sharded": [], "unsharded": []}
    for i in range(2):
        batch = jax.random.randint(jax.random.fold_in(key, i), (8, 9), 0, 128)
        for name, step in steps.items():
            b = jax.device_put(batch, gtp_jax.data_sharding(mesh)) if name == "sharded" \
                else batch
            losses[name].append(float(step(b)["loss"]))
    for step in steps.values():
        step.sync()
    got, want = _histories(sharded), _histories(ref)
    for path, h in want.items():
        # [layers, steps, (x, w, dy, uses)]: two steps recorded, newest first, one use each
        assert np.all(h[:, :2] > 0) and not np.any(h[:, 2:]), path
        np.testing.assert_array_equal(h[:, :2, 3], 1.0, err_msg=path)
        assert_close(got[path], h, RTOL_SAME_MATH, path)
    # An AdamW step apart: the runs' parameters differ by float32 rounding, which can
    # move a few elements across FP8 rounding boundaries; the loss stays within 1e-3.
    np.testing.assert_allclose(losses["sharded"], losses["unsharded"], rtol=1e-3)
    # The history is not a parameter: the optimizer holds moments for parameters only.
    opt_paths = {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(
        nnx.state(steps["sharded"].objects[1], nnx.OptState))}
    assert not any("amax_history" in p for p in opt_paths)


def test_fp8_gathers_with_delayed_scaling_train_like_one_device(key, seed):
    # Under fp8 gathers a kernel's GEMM reads its gathered payload, scaled by the weight's
    # current amax (agreed over the GTP axis); activations and gradients keep the history.
    # The reference is the same recipe over 2 shards on 2 devices (on one device nothing is
    # gathered, so the weights keep delayed scaling there): the agreed amax makes the
    # payloads the same for any number of shards.
    cfg = preset("tiny", d_model=64, n_heads=2, d_ff=128, vocab_size=128, n_layers=2,
                 remat="dots", unroll_layers=False)
    config = dataclasses.replace(DELAYED, fp8_min_features=64, prefetch=True,
                                 gather_format="fp8", include=(r"blocks/(attn|mlp)/.*kernel",))
    meshes = {"sharded": get_mesh("dp2_gtp4"),
              "gtp2": gtp_jax.make_mesh(gtp=2, dp=1, devices=jax.devices()[:2])}
    losses, histories = {}, {}
    for name, mesh in meshes.items():
        sharded = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(seed)), mesh, config)
        assert all(p.spec.fp8_in_dims for p in sharded.plan)
        step = TrainStep(sharded, nnx.Optimizer(sharded, optax.adamw(3e-3), wrt=nnx.Param),
                         lm_loss)
        losses[name] = [float(step(jax.device_put(
            jax.random.randint(jax.random.fold_in(key, i), (8, 9), 0, 128),
            gtp_jax.data_sharding(mesh)))["loss"]) for i in range(3)]
        step.sync()
        histories[name] = _histories(sharded)
    for path, h in histories["gtp2"].items():
        assert np.all(h[:, :3, :3] > 0), path
        assert_close(histories["sharded"][path], h, RTOL_SAME_MATH, path)
    np.testing.assert_allclose(losses["sharded"], losses["gtp2"], rtol=1e-3)


class _Reuse(nnx.Module):
    """A user's module with one FP8 layer of each kind (Linear, Einsum, LinearGeneral), one
    applied twice per call (`tied`) and one never applied (`spare`)."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(37, 24, rngs=rngs)
        self.lin = nnx.Linear(24, 24, rngs=rngs)
        self.tied = nnx.Einsum("bsd,dk->bsk", (24, 24), (24,), rngs=rngs)
        self.spare = nnx.Linear(24, 24, rngs=rngs)
        self.gen = nnx.LinearGeneral(24, (2, 3), rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = jnp.tanh(self.lin(self.embed(tokens)))
        return self.gen(self.tied(jnp.tanh(self.tied(h))))


def _mse(m: nnx.Module, t: jax.Array) -> jax.Array:
    return jnp.mean(m(t).astype(jnp.float32) ** 2)


def _values(tree: object) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(nnx.state(tree))}


def test_a_layer_used_twice_is_refused_and_an_unused_layer_keeps_its_history(key, seed):
    mesh = get_mesh("dp2_gtp4")
    model = _Reuse(nnx.Rngs(seed))
    tokens = jax.random.randint(key, (8, 5), 0, 37)
    sharded = gtp_jax.shard(nnx.clone(model), mesh, DELAYED)
    assert sorted(_histories(sharded)) == [
        f"{p}/amax_history" for p in ("gen/dot_general", "lin/dot_general",
                                      "spare/dot_general", "tied/einsum_op")]
    assert not nnx.state(model, Fp8History)  # the user's module is untouched
    assert "tied: matmuls in fp8 (delayed, amax history of 4 steps)" in sharded.describe()
    step = TrainStep(sharded, nnx.Optimizer(sharded, optax.adamw(1e-2), wrt=nnx.Param), _mse)
    before = _values(step.objects)
    refused = r"layer 'tied' ran 2 times in one step.*fp8_exclude=\(\.\.\., '\^tied\$'\)"
    batch = jax.device_put(tokens, gtp_jax.data_sharding(mesh))
    for _ in range(2):  # refused before anything changed, and again
        with pytest.raises(UsageError, match=refused):
            step(batch)
        after = _values(step.objects)  # params, histories, optimizer state: valid, unchanged
        assert after.keys() == before.keys()
        for path, value in before.items():
            np.testing.assert_array_equal(after[path], value, err_msg=path)

    # A loop of one's own: outside jit the helper refuses before touching the model; inside
    # jit it returns the counts and keeps the history of a layer used twice.
    ref = nnx.clone(model)
    fp8.inject(ref, fp8.fp8_layers(ref, DELAYED), DELAYED)
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8History))

    @nnx.jit
    def own_step(m: nnx.Module, t: jax.Array) -> dict[str, jax.Array]:
        return gtp_jax.apply_fp8_history(m, nnx.grad(_mse, argnums=wrt)(m, t))

    grads = nnx.jit(nnx.grad(_mse, argnums=wrt))(ref, tokens)
    with pytest.raises(UsageError, match=refused):
        gtp_jax.apply_fp8_history(ref, grads)
    assert not any(np.any(h) for h in _histories(ref).values())
    uses = jax.device_get(own_step(ref, tokens))
    assert uses == {"lin": 1, "tied": 2, "spare": 0, "gen": 1}
    with pytest.raises(UsageError, match=refused):
        check_fp8_uses(uses)
    got = _histories(ref)
    assert not np.any(got["tied/einsum_op/amax_history"])  # kept, not the sum
    assert not np.any(got["spare/dot_general/amax_history"])
    assert np.all(got["lin/dot_general/amax_history"][0] > 0)

    # The fix the message names: the tied layer out of FP8. The unused layer keeps its
    # history (not zeros) while the others roll.
    config = dataclasses.replace(DELAYED, fp8_exclude=("^tied$",))
    sharded = gtp_jax.shard(nnx.clone(model), mesh, config)
    assert "tied/einsum_op/amax_history" not in _histories(sharded)
    old = np.array([[0.5, 0.25, 1e-3, 1.0], [2.0, 0.5, 1e-3, 1.0], [0.0] * 4, [0.0] * 4],
                   np.float32)
    nnx.update(sharded, jax.tree.map(lambda h: jnp.asarray(old).astype(h.dtype) + 0 * h,
                                     nnx.state(sharded, Fp8History)))
    # Sharded, the recorded amaxes and the parameter gradients are the unsharded module's on
    # the whole batch (not one device's amax, nor a sum over devices).
    ref = nnx.clone(model)
    fp8.inject(ref, fp8.fp8_layers(ref, config), config)
    nnx.update(ref, jax.tree.map(lambda h: jnp.asarray(old) + 0 * h, nnx.state(ref, Fp8History)))
    grads = nnx.jit(nnx.grad(_mse, argnums=wrt))(sharded, batch)
    ref_grads = nnx.jit(nnx.grad(_mse, argnums=wrt))(ref, tokens)
    got, want = _histories(grads), _histories(ref_grads)
    assert got.keys() == want.keys()
    for path, h in want.items():
        assert_close(got[path], h, RTOL_SAME_MATH, path)
    got_p = gtp_jax.unshard_values(sharded, grads)
    for keys, var in nnx.to_flat_state(nnx.state(ref_grads, nnx.Param)):
        path = "/".join(map(str, keys))
        assert_close(got_p[path], var.get_value(), RTOL_SAME_MATH, path)
    step = TrainStep(sharded, nnx.Optimizer(sharded, optax.adamw(1e-2), wrt=nnx.Param), _mse)
    losses = [float(step(batch)["loss"]) for _ in range(2)]
    step.sync()
    assert np.all(np.isfinite(losses))
    got = _histories(sharded)
    np.testing.assert_array_equal(got["spare/dot_general/amax_history"], old)
    for path in ("lin/dot_general/amax_history", "gen/dot_general/amax_history"):
        h = got[path]
        assert np.all(h[:2, :3] > 0) and np.all(h[:2, 3] == 1), path  # two steps recorded
        np.testing.assert_array_equal(h[2:], old[:2], err_msg=path)  # then the old rows


# --------------------------------------------------------------------------- training


def test_offloaded_optimizer_state_with_delayed_scaling_is_checked_before_the_first_step(
        key, seed, monkeypatch):
    """With the optimizer state in host memory (updated in place by the step), a layer used
    twice is found by a program of the forward and backward passes before the first step:
    refused with nothing changed, and no copy of the state kept for it. Without the reused
    layer in FP8 the offloaded steps equal the on-device ones."""
    from gtp_jax.train.step.train_step import make_nnx_optimizer

    mesh = get_mesh("dp2_gtp4")
    model = _Reuse(nnx.Rngs(seed))
    batch = jax.device_put(jax.random.randint(key, (8, 5), 0, 37), gtp_jax.data_sharding(mesh))
    offloaded = dataclasses.replace(DELAYED, offload_optimizer=True)
    sharded = gtp_jax.shard(nnx.clone(model), mesh, offloaded)
    step = TrainStep(sharded, make_nnx_optimizer(sharded, optax.adamw(1e-2), wrt=nnx.Param),
                     _mse)
    before = _values(step.objects)
    copies = []  # copies of arrays made to keep them (the state's size again, pinned)
    put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: (
        copies.append(1) if k.get("may_alias") is False else None, put(x, *a, **k))[1])
    for _ in range(2):  # refused before anything changed, and again
        with pytest.raises(UsageError, match=r"layer 'tied' ran 2 times in one step"):
            step(batch)
        after = _values(step.objects)
        for path, value in before.items():
            np.testing.assert_array_equal(after[path], value, err_msg=path)
    monkeypatch.undo()
    assert not copies

    def run(config: gtp_jax.GTPConfig) -> tuple[list[float], dict[str, np.ndarray]]:
        m = gtp_jax.shard(nnx.clone(model), mesh, config)
        s = TrainStep(m, make_nnx_optimizer(m, optax.adamw(1e-2), wrt=nnx.Param), _mse)
        losses = [float(s(batch)["loss"]) for _ in range(2)]
        s.sync()
        return losses, _values(m)

    on_device = run(dataclasses.replace(DELAYED, fp8_exclude=("^tied$",)))
    streamed = run(dataclasses.replace(offloaded, fp8_exclude=("^tied$",)))
    assert streamed[0] == on_device[0] and np.all(np.isfinite(streamed[0]))
    for path, value in on_device[1].items():
        np.testing.assert_array_equal(streamed[1][path], value, err_msg=path)


def test_resume_continues_delayed_scaling_exactly(tmp_path: Path) -> None:
    # The tiny preset on 2 layers, unrolled (the CPU default), every projection in FP8.
    run = TrainConfig(steps=2, batch_size=8, seq_len=16, warmup=1, dp=2, gtp=4, layers=2,
                      fp8_compute="delayed", fp8_min_features=128)
    full = train(run, progress=False, checkpoint=CheckpointConfig(tmp_path / "full"))
    first = train_until(run, tmp_path / "run", stop_after=1)
    assert first == full.losses[:1]
    saved = Checkpointer(CheckpointConfig(tmp_path / "run")).read_arrays(1)
    histories = {k: v for k, v in saved.items() if k.endswith("amax_history")}
    # One stacked history per projection: [2 layers, 16 steps, (x, w, dy, uses)], 1 recorded.
    assert len(histories) == 4 and all(h.shape == (2, 16, 4) for h in histories.values())
    assert all(np.all(h[:, :1] > 0) and not np.any(h[:, 1:]) for h in histories.values())
    resumed = train(run, progress=False,
                    checkpoint=CheckpointConfig(tmp_path / "run", every=1, resume=True))
    assert resumed.first_step == 2
    # Bit-exact: step 2 is scaled from the restored history (an empty one scales by 1).
    assert resumed.losses == full.losses[1:]
    final_full = Checkpointer(CheckpointConfig(tmp_path / "full")).read_arrays(2)
    final_resumed = Checkpointer(CheckpointConfig(tmp_path / "run")).read_arrays(2)
    for key, value in final_full.items():
        np.testing.assert_array_equal(final_resumed[key], value, err_msg=key)
    assert all(np.all(np.isfinite(v)) for v in final_full.values())


def test_cli_trains_with_delayed_scaling(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    # The scanned loop without prefetch; the CLI's own validation of the recipe name.
    assert cli_main(["train", "--steps", "2", "--batch", "8", "--seq", "16", "--warmup", "1",
                     "--fp8-compute", "delayed", "--fp8-min-features", "128",
                     "--no-unroll-layers", "--metrics-json", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "projections in fp8 (delayed" in out
    losses = [s["loss"] for s in json.loads((tmp_path / "m.json").read_text())["steps"]]
    assert len(losses) == 2 and all(np.isfinite(losses))
    with pytest.raises(SystemExit):
        cli_main(["train", "--fp8-compute", "rowwise"])
    assert "--fp8-compute: invalid choice: 'rowwise'" in capsys.readouterr().err
