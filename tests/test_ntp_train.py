"""Nonuniform tensor parallelism in training (gtp_jax.train.lifecycle.ntp): a simulated device
failure in the middle of a run, the switch to a healthy tp=4 and a degraded tp=2 replica, against a
uniform run and a reduced-layout reference; checkpoints after the failure restored onto
uniform meshes; the CLI run; and the errors of bad failure specs.

Tolerance after the failure: the nonuniform step computes the same math as a uniform run
on the core mesh (dp=2, tp=2) from the same state, but the healthy replica sums its
row-parallel matmuls over 4 partial sums instead of 2, and the replica average is a
weighted sum instead of a psum-mean; in float32 both change results by a few ulps
(measured: parameters differ by at most 1.2e-7 = 1 ulp of a norm scale ~1 after 4 steps,
losses agree to all float32 digits). We allow losses rtol 1e-5 and parameters atol 1e-6:
10-100x that, while a layout bug (rows on the wrong device, a wrong fused interleave)
moves whole rows and shows up as O(1e-2) errors.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import gtp_jax
from gtp_jax.base.errors import UsageError
from gtp_jax.data import ByteBatcher, load_corpus, split_train_eval
from gtp_jax.models import Transformer, lm_loss
from gtp_jax.train import (
    CheckpointConfig,
    Checkpointer,
    ObserveConfig,
    TrainConfig,
    TrainStep,
    build_model_and_optimizer,
    make_optimizer,
    model_config,
    replicate_stray_leaves,
    train,
)
from gtp_jax.train.cli.command import main as cli_main
from gtp_jax.train.lifecycle.ntp import SimulatedFailure, check_failure, parse_failure

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Two layers (the tiny preset has four): the re-layout moves every layer alike, and each
#: run compiles the uniform, healthy and degraded programs afresh.
CFG = TrainConfig(steps=8, batch_size=8, seq_len=32, warmup=2, dp=2, gtp=1, tp=4, layers=2)
K = 4  # the failure happens after this step
FAILURE = SimulatedFailure(step=K, devices=(5,), tp_spares=2)
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(uniform run of the first K steps, failure run, its checkpoint directory: steps K
    (before) and 8 (after))."""
    root = tmp_path_factory.mktemp("ntp")
    directory = str(root / "ck")
    # Only its steps before the failure are compared: the same LR schedule (schedule_steps),
    # so the same first K steps as the full uniform run, without training the other 4.
    uniform = train(dataclasses.replace(CFG, steps=K, schedule_steps=CFG.steps), progress=False)
    failed = train(CFG, progress=False, failure=FAILURE,
                   checkpoint=CheckpointConfig(directory, every=K, keep=5),
                   observe=ObserveConfig(log_dir=str(root / "log"), log_every=1))
    failed.log = [json.loads(line) for line in (root / "log" / "metrics.jsonl").open()]
    return uniform, failed, directory


def _core_reference(directory: str) -> tuple[list[dict[str, float]], nnx.Module]:
    """A uniform run with the reduced layout (dp=2, tp=2 on the core devices 0, 1, 4, 6)
    from the state at step K, on the same batches: the metrics (loss, grad_norm, lr) of
    steps K+1.. and its model."""
    devs = jax.devices()
    mesh = gtp_jax.make_mesh(dp=2, tp=2, devices=[devs[i] for i in (0, 1, 4, 6)])
    model = gtp_jax.shard(Transformer(model_config(CFG), rngs=nnx.Rngs(0)), mesh)
    optimizer = nnx.Optimizer(model, make_optimizer(CFG), wrt=nnx.Param)
    replicate_stray_leaves(optimizer, mesh)
    restored = Checkpointer(CheckpointConfig(directory, resume=True)).restore(model, optimizer,
                                                                               step=K)
    assert restored.step == K
    batcher = ByteBatcher.from_state(split_train_eval(load_corpus())[0], restored.extra["data"])
    step = TrainStep(model, optimizer, functools.partial(lm_loss, aux_weight=0.01))
    placement = gtp_jax.data_sharding(mesh)
    losses = []
    for _ in range(K, CFG.steps):
        batch = batcher.next_batch()
        tokens = jax.make_array_from_callback(batch.shape, placement,
                                              lambda i, b=batch: b[i])
        losses.append({k: float(v) for k, v in step(tokens).items()})
    step.sync()
    return losses, model


def _params(model: nnx.Module) -> dict[str, np.ndarray]:
    return {"model/module/" + "/".join(map(str, path)): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(nnx.state(gtp_jax.unshard(model), nnx.Param))}


def test_before_the_failure_bit_identical_to_a_uniform_run(runs):
    uniform, failed, _ = runs
    assert failed.losses[:K] == uniform.losses[:K]
    assert len(failed.losses) == CFG.steps and all(np.isfinite(failed.losses))


def test_after_the_failure_matches_the_reduced_layout_reference(runs):
    _, failed, directory = runs
    metrics, model = _core_reference(directory)
    np.testing.assert_allclose(failed.losses[K:], [m["loss"] for m in metrics], rtol=LOSS_RTOL)
    # The metrics log keeps its fields past the failure, with the reference's values.
    after = [r for r in failed.log if r.get("step", 0) > K and "loss" in r]
    assert [r["step"] for r in after] == list(range(K + 1, CFG.steps + 1))
    for key in ("grad_norm", "lr"):
        np.testing.assert_allclose([r[key] for r in after], [m[key] for m in metrics],
                                   rtol=LOSS_RTOL, err_msg=key)
    saved = Checkpointer(CheckpointConfig(directory, resume=True)).read_arrays(CFG.steps)
    ref = _params(model)
    assert set(ref) <= set(saved)
    for key, value in ref.items():
        np.testing.assert_allclose(saved[key], value, rtol=0, atol=PARAM_ATOL, err_msg=key)
    # Training moved the weights after the failure (the comparison is not vacuous).
    before = Checkpointer(CheckpointConfig(directory, resume=True)).read_arrays(K)
    assert max(float(np.abs(saved[k] - before[k]).max()) for k in ref) > 1e-3


def test_failure_report(runs):
    _, failed, _ = runs
    f = failed.failure
    assert f["step"] == K and f["devices"] == (5,)
    assert "replica dp=1: healthy, tp=4" in f["layout_before"]
    assert "replica dp=1: DEGRADED, tp=2" in f["layout_after"]
    assert "core mesh: {'dp': 2, 'ep': 1, 'gtp': 1, 'tp': 2}, devices [0, 1, 4, 6]" \
        in f["layout_after"]
    assert 0 < f["replan_s"] < 1 and 0 < f["relayout_s"] < 60
    text = failed.summary()
    for part in ("layout before:", "layout after:", "re-plan", "re-layout",
                 "loss around the failure", "step time median"):
        assert part in text
    assert failed.to_json()["failure"]["step"] == K


def test_checkpoint_after_the_failure_restores_onto_uniform_meshes(runs, tmp_path):
    _, failed, directory = runs
    ckpt = Checkpointer(CheckpointConfig(directory, resume=True))
    assert ckpt.read_meta(CFG.steps)["mesh"]["tp"] == 2  # saved from the core mesh
    saved = ckpt.read_arrays(CFG.steps)
    for mesh in ({"dp": 2, "tp": 4}, {"dp": 4, "tp": 2}):
        cfg = TrainConfig(**{**CFG.__dict__, "gtp": 1, **mesh})
        model, optimizer = build_model_and_optimizer(cfg)
        ckpt.restore(model, optimizer, step=CFG.steps)
        for key, value in _params(model).items():
            np.testing.assert_array_equal(value, saved[key], err_msg=f"{mesh} {key}")
    # And a resumed run continues on a uniform mesh (no failure): tp=2 x dp=4.
    copy = str(tmp_path / "ck")
    shutil.copytree(directory, copy)
    resumed = train(TrainConfig(**{**CFG.__dict__, "steps": CFG.steps + 2, "dp": 4, "tp": 2,
                                   "schedule_steps": None}),
                    progress=False, checkpoint=CheckpointConfig(copy, resume=True))
    assert resumed.first_step == CFG.steps + 1 and len(resumed.losses) == 2
    assert all(np.isfinite(resumed.losses)) and resumed.losses[-1] < failed.losses[0]


def test_gtp_axis_with_alignment_padding_tracks_the_uniform_run():
    # The reduced axis is gtp (4 -> 2 on the degraded replica), weights padded to multiples
    # of gtp * 8 (LeafSplit.align): GTP only changes where weights are stored, so the run
    # equals the uniform one before the failure and within the tolerance after it.
    cfg = TrainConfig(steps=6, batch_size=8, seq_len=32, warmup=2, dp=2, gtp=4,
                      pad_for_alignment=8, layers=2)
    uniform = train(cfg, progress=False)
    failed = train(cfg, progress=False, failure=SimulatedFailure(step=3, devices=(5,),
                                                                 axis="gtp"))
    assert "replica dp=1: DEGRADED, gtp=2" in failed.failure["layout_after"]
    assert failed.losses[:3] == uniform.losses[:3]
    np.testing.assert_allclose(failed.losses[3:], uniform.losses[3:], rtol=LOSS_RTOL)


def test_tp2_degraded_to_one_device_tracks_the_uniform_run():
    # dp4 x tp2: the degraded replica runs at tp=1, where XLA returns its arrays' specs with
    # the 1-wide tp axis dropped (P() for a weight split over tp at tp=2): the re-layout
    # must still put them back split over tp on the core mesh.
    cfg = TrainConfig(steps=6, batch_size=8, seq_len=32, warmup=2, dp=4, tp=2, gtp=1, layers=2)
    uniform = train(cfg, progress=False)
    failed = train(cfg, progress=False, failure=SimulatedFailure(step=3, devices=(3,)))
    assert "replica dp=1: DEGRADED, tp=1" in failed.failure["layout_after"]
    assert failed.losses[:3] == uniform.losses[:3]
    np.testing.assert_allclose(failed.losses[3:], uniform.losses[3:], rtol=LOSS_RTOL)


def test_a_tp_failure_that_would_move_a_gtp_shard_dim_is_refused_before_training():
    # At tp=1 GTP shards the attention output's heads dim, which tp splits at tp=2.
    cfg = TrainConfig(steps=6, batch_size=8, seq_len=32, warmup=2, dp=2, tp=2, gtp=2)
    with pytest.raises(UsageError, match=r"GTP would shard blocks/attn/out/kernel on dim 0.*"
                                         r"SimulatedFailure.axis='gtp'"):
        check_failure(cfg, SimulatedFailure(step=3, devices=(3,)))


def test_a_gtp_failure_that_would_move_a_shard_dim_is_refused_before_training():
    # gtp 4 -> 3 moves the attention output's GTP dim (heads, 4, to another): refused with
    # the spares that keep every dim; left to choose, the run takes those spares.
    cfg = TrainConfig(steps=6, batch_size=24, seq_len=16, dp=2, gtp=4)
    with pytest.raises(UsageError, match=r"at gtp=3 GTP would shard blocks/attn/out/kernel "
                       r"on dim 2, at gtp=4 on dim 0.*tp_spares=2 \(degraded gtp=2\)"):
        check_failure(cfg, SimulatedFailure(step=3, devices=(5,), tp_spares=1, axis="gtp"))
    chosen = check_failure(cfg, SimulatedFailure(step=3, devices=(5,), axis="gtp"))
    assert {r.degree for r in chosen.replicas} == {4, 2}


BASE = ["train", "--tp", "4", "--dp", "2", "--steps", "8", "--batch", "8", "--seq", "32"]


@pytest.mark.parametrize("flags,message", [
    (["--simulate-failure", "step=4,device=gpu5"],
     "--simulate-failure 'step=4,device=gpu5': use step=S,device=D"),
    (["--simulate-failure", "step=4"], "both step= and device= are needed"),
    (["--simulate-failure", "step=4,device=99"],
     "--simulate-failure device: device 99 is not in the mesh (device ids 0..7)"),
    (["--simulate-failure", "step=8,device=5"],
     "--simulate-failure step=8 must be before the last step (--steps=8)"),
    (["--simulate-failure", "step=12,device=5"], "choose a step in 1..7"),
    (["--simulate-failure", "step=4,device=5,device=6,device=7", "--tp-spares", "2"],
     "lost 3 devices (positions [1, 2, 3]), more than --tp-spares=2 absorbs; raise "
     "--tp-spares to 3"),
    (["--simulate-failure", "step=4,device=5", "--tp-spares", "1"],
     "n_heads=4 cannot be split over tp=3 with no padding (degraded replicas: tp_base=4 - "
     "--tp-spares=1)"),
    (["--simulate-failure", "step=4,device=1,device=5", "--tp-spares", "3"],
     "devices [1, 5] hold the same shard and all failed"),
    (["--simulate-failure", "step=4,device=5", "--ntp-axis", "gtp"],
     "--ntp-axis='gtp': the mesh's gtp=1 cannot be reduced"),
    (["--tp-spares", "2"], "--tp-spares and --ntp-axis need --simulate-failure"),
    (["--tp", "2", "--cp", "2", "--simulate-failure", "step=4,device=5"],
     "--simulate-failure device: a simulated failure does not run with context parallelism "
     "(--cp=2)"),
    (["--tp", "2", "--ep", "2", "--moe-experts", "4", "--simulate-failure", "step=4,device=5"],
     "--simulate-failure device: a simulated failure does not run with expert parallelism "
     "(--ep=2)"),
])
def test_cli_failure_spec_errors(flags, message, tmp_path, capsys):
    directory = tmp_path / "ck"
    assert cli_main([*BASE, *flags, "--checkpoint-dir", str(directory)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not directory.exists() or not any(directory.iterdir())  # nothing written


def test_library_errors_name_arguments():
    with pytest.raises(UsageError, match=r"SimulatedFailure.step=0 must be an int >= 1"):
        SimulatedFailure(step=0, devices=(5,))
    with pytest.raises(UsageError, match=r"SimulatedFailure.devices=\(\) must be one or more"):
        SimulatedFailure(step=1, devices=())
    with pytest.raises(UsageError, match="SimulatedFailure.tp_spares"):
        check_failure(CFG, SimulatedFailure(step=2, devices=(5,), tp_spares=1))
    with pytest.raises(UsageError, match="after the resumed step 4.*or drop it to continue on "
                       "the whole mesh"):
        check_failure(CFG, SimulatedFailure(step=3, devices=(5,)), start=4)
    assert parse_failure("step=3,device=5,device=6").devices == (5, 6)
    # Default spares: the parity rule asks for 1, tp=3 cannot split 4 heads: 2.
    assert check_failure(CFG, SimulatedFailure(step=2, devices=(5,))).core_degree == 2


def test_the_stop_message_after_the_failure_says_to_drop_it(capsys):
    """Stopped after its simulated failure, a run continues on the whole mesh: the stop
    line says to run the command without --simulate-failure (the same command is refused,
    the failure step being before the resumed one); stopped before it, the same command."""
    from types import SimpleNamespace  # noqa: PLC0415

    from gtp_jax.train.cli.command import _stopped  # noqa: PLC0415

    def stopped_after(step: int) -> str:
        result = SimpleNamespace(first_step=1, losses=[1.0] * step, checkpoint_dir="ck",
                                 checkpoint_steps=[step], stopped_by="SIGTERM")
        assert _stopped(result, True, 8, None, SimulatedFailure(step=4, devices=(5,))) == 75
        return capsys.readouterr().out

    assert "run the same command without --simulate-failure with --resume auto" in \
        stopped_after(6)
    assert "run the same command with --resume auto" in stopped_after(3)
