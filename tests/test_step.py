"""`gtp_jax.train.TrainStep`: the one training step (``jax.jit`` over the split state,
donated) computes what an ``nnx.jit`` step computes, compiles once, shares its program
between equal steps, writes back on `sync`, and applies the loss function it is given."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, flat_values

import gtp_jax
from gtp_jax.models import lm_loss
from gtp_jax.train import TrainConfig, TrainStep, build_model_and_optimizer, model_config

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

#: float32, the suite's dp=2 x gtp=4 mesh, small enough to compile quickly.
CFG = TrainConfig(steps=3, batch_size=8, seq_len=32, warmup=1, dp=2, gtp=4)


def _batches(cfg: TrainConfig, mesh: jax.sharding.Mesh, count: int = 3) -> list[jax.Array]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (count, cfg.batch_size, cfg.seq_len + 1)).astype(np.int32)
    return [jax.device_put(t, gtp_jax.data_sharding(mesh)) for t in tokens]


def _loss(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """A loss function of this module only, so its program's trace count starts at 0."""
    return lm_loss(model, tokens)


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict]:
    """Losses and final parameters of 3 steps of an ``nnx.jit`` step (the old train step)."""
    model, optimizer = build_model_and_optimizer(CFG)

    @nnx.jit
    def step(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(_loss)(model, tokens)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, b)) for b in _batches(CFG, model.mesh)]
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
                      moe_top_k=2)
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
