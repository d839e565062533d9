"""Each preset trains at its own default peak LR and warm-up (`gtp_jax.train.step.lr_defaults`);
an explicit ``--lr`` / ``--warmup`` wins, and a resumed run keeps the schedule its
checkpoint recorded."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gtp_jax.base.errors import UsageError
from gtp_jax.models import PRESETS
from gtp_jax.train import CheckpointConfig, Checkpointer, ObserveConfig, TrainConfig, train
from gtp_jax.train.cli.command import _parser
from gtp_jax.train.config import describe_schedule, model_config, model_json, resolve_auto
from gtp_jax.train.lifecycle.resume import check_resume
from gtp_jax.train.outputs.metrics_log import METRICS_FILE
from gtp_jax.train.step.lr_defaults import GENERIC, PRESET_LR

#: preset -> (peak LR, default warm-up of a 50-step and of a 5000-step run): the table of
#: `gtp_jax.train.step.lr_defaults` (and docs/training_options.md).
EXPECTED = {
    "tiny": (3e-3, 5, 10), "small": (1e-3, 5, 10), "100m": (3e-4, 5, 10),
    "1b": (3e-5, 12, 50), "llama3.2-1b": (3e-5, 12, 50), "llama3.2-3b": (2e-5, 25, 100),
    "llama3-8b": (1e-5, 25, 200), "llama3-70b": (5e-6, 25, 400),
}


def test_every_preset_has_its_own_defaults() -> None:
    assert set(PRESET_LR) == set(PRESETS) == set(EXPECTED)
    for name, (lr, short, long) in EXPECTED.items():
        run = TrainConfig(preset=name, steps=50)
        assert run.lr is None and run.warmup is None  # resolved when the run starts
        fixed = run.with_schedule()
        assert (fixed.lr, fixed.warmup) == (lr, short), name
        assert TrainConfig(preset=name, steps=5000).with_schedule().warmup == long, name
    # Wider presets never train at a higher rate than narrower ones.
    widths = sorted((PRESETS[n].d_model, PRESET_LR[n].lr) for n in PRESETS)
    assert all(a[1] >= b[1] for a, b in zip(widths, widths[1:]))


def test_explicit_values_win_and_a_checkpoint_shape_model_takes_the_generic_ones() -> None:
    given = TrainConfig(preset="llama3-8b", steps=50, lr=1e-4, warmup=3)
    assert (given.with_schedule().lr, given.with_schedule().warmup) == (1e-4, 3)
    assert describe_schedule(given.with_schedule(), given) == (
        "lr 0.0001, warm-up 3 steps, cosine schedule over 50 steps")
    hf = TrainConfig(steps=50, init_from_hf="/some/checkpoint")
    assert hf.lr_defaults is GENERIC
    assert (hf.with_schedule().lr, hf.with_schedule().warmup) == (3e-3, 5)
    default = TrainConfig(preset="llama3-8b", steps=2000)
    assert describe_schedule(default.with_schedule(), default) == (
        "lr 1e-05 (the llama3-8b preset's default), warm-up 200 steps (half of the "
        "steps, at most 200), cosine schedule over 2000 steps")
    # The command line leaves both unset unless given; a job file sets them as flags do.
    args = _parser().parse_args(["train", "--preset", "llama3-8b"])
    assert (args.lr, args.warmup) == (None, None)
    args = _parser().parse_args(["train", "--lr", "2e-4", "--warmup", "7"])
    assert (args.lr, args.warmup) == (2e-4, 7)
    with pytest.raises(UsageError, match=r"TrainConfig\.lr=0 must be finite and > 0"):
        TrainConfig(lr=0)


def _meta(cfg: TrainConfig) -> dict:
    return {"step": 1, "extra": {"train_config": dataclasses.asdict(cfg),
                                 "model_config": model_json(model_config(cfg)),
                                 "data": {"position": 1}}}


def test_resume_keeps_the_recorded_schedule_whatever_the_defaults() -> None:
    """A small-preset run recorded at 3e-3 (the default every preset had before its own)
    with a 10-step warm-up continues so when resumed without --lr / --warmup; an explicit
    other LR is another run."""
    saved = resolve_auto(TrainConfig(preset="small", steps=200, lr=3e-3, batch_size=8,
                                     seq_len=16).with_schedule())
    assert saved.warmup == 10
    again = resolve_auto(TrainConfig(preset="small", steps=400, batch_size=8, seq_len=16))
    kept = check_resume(again, model_config(again), _meta(saved), "d")
    assert (kept.lr, kept.warmup, kept.schedule_steps) == (3e-3, 10, 200)
    assert describe_schedule(kept.with_schedule(), again) == (
        "lr 0.003 (kept from the checkpoint), warm-up 10 steps (a tenth of the steps, at "
        "most 10), cosine schedule over 200 steps")
    with pytest.raises(UsageError, match=r"different run \(TrainConfig\.lr: checkpoint 0\.003 "
                                         r"vs now 0\.001\)"):
        check_resume(dataclasses.replace(again, lr=1e-3), model_config(again), _meta(saved),
                     "d")
    # A checkpoint that recorded no warm-up keeps the default of its time (a tenth of the
    # steps, at most 10), not the preset's maximum now.
    big = resolve_auto(TrainConfig(preset="1b", layers=1, steps=2000, batch_size=8,
                                   seq_len=16))
    old = _meta(dataclasses.replace(big, lr=3e-3, schedule_steps=2000, schedule_version=2))
    assert old["extra"]["train_config"]["warmup"] is None
    kept = check_resume(big, model_config(big), old, "d")
    assert (kept.lr, kept.warmup) == (3e-3, 10)
    assert TrainConfig(preset="1b", steps=2000).with_schedule().warmup == 50


def test_a_resumed_run_trains_at_its_checkpoint_s_rate(tmp_path) -> None:
    """End to end: a run started at --lr 1e-3 (tiny's default is 3e-3) and resumed without
    --lr continues at 1e-3."""
    ck = str(tmp_path / "ck")
    first = TrainConfig(steps=2, batch_size=8, seq_len=16, lr=1e-3, warmup=0,
                        lr_schedule="constant")
    train(dataclasses.replace(first, steps=1), progress=False,
          checkpoint=CheckpointConfig(ck))
    logs = tmp_path / "logs"
    resumed = train(dataclasses.replace(first, lr=None, warmup=None), progress=False,
                    checkpoint=CheckpointConfig(ck, resume=True),
                    observe=ObserveConfig(log_dir=str(logs), log_every=1))
    assert resumed.first_step == 2
    records = [json.loads(x) for x in (logs / METRICS_FILE).read_text().splitlines()]
    assert [(r["step"], r["lr"]) for r in records] == [(2, pytest.approx(1e-3))]
    recorded = Checkpointer(CheckpointConfig(ck)).read_meta()["extra"]["train_config"]
    assert (recorded["lr"], recorded["warmup"]) == (1e-3, 0)
