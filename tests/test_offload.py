"""Optimizer state in host memory (`GTPConfig.offload_optimizer`): the same training.

The CPU backend has a ``pinned_host`` memory kind, so the offloaded step runs the same code
path as on GPUs (state placed in host memory, copied to the device for the update and
back); there host and device memory are the same RAM, so only the placement and the
numbers are checked here, not a memory saving.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from gtp_jax.models import lm_loss
from gtp_jax.sharding.offload import HOST_MEMORY_KIND, host_memory_supported
from gtp_jax.train import TrainConfig
from gtp_jax.train.loop import build_model_and_optimizer
from gtp_jax.train.step import TrainStep

CFG = TrainConfig(preset="tiny", batch_size=8, seq_len=32, dp=2, gtp=4, steps=3, warmup=1)


def _run(offload: bool) -> tuple[list[np.ndarray], list[np.ndarray], TrainStep]:
    cfg = dataclasses.replace(CFG, offload_optimizer=offload)
    model, optimizer = build_model_and_optimizer(cfg)
    step = TrainStep(model, optimizer, functools.partial(lm_loss, aux_weight=0.0))
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(cfg.steps):
        tokens = rng.integers(0, 256, (cfg.batch_size, cfg.seq_len + 1), dtype=np.int32)
        losses.append(np.asarray(step(tokens)["loss"]))
    step.sync()
    leaves = [np.asarray(x) for x in jax.tree.leaves(nnx.state(step.objects))]
    return losses, leaves, step


def test_offloaded_optimizer_state_trains_bit_identically():
    assert host_memory_supported()
    ref_losses, ref_state, _ = _run(False)
    losses, state, step = _run(True)
    # Same arithmetic on the device; the moments only travel: bit-identical, no tolerance.
    assert [float(x) for x in losses] == [float(x) for x in ref_losses]
    assert len(state) == len(ref_state)
    for a, b in zip(state, ref_state):
        np.testing.assert_array_equal(a, b)
    # The optimizer state stays in host memory across steps; the parameters do not.
    opt = nnx.state(step.objects[1], nnx.OptState)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(opt)}
    assert kinds == {HOST_MEMORY_KIND}
    params = nnx.state(step.objects[0], nnx.Param)
    assert HOST_MEMORY_KIND not in {x.sharding.memory_kind for x in jax.tree.leaves(params)}
