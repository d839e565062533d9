"""Your own model in the trainer: ``python -m gtp_jax train --model module:factory`` (and
``model = "..."`` in a job file) and `gtp_jax.train.fit` for a model built in code, with
what a preset run gets: checkpoints, the SIGTERM save and ``--resume auto``, metrics and
TensorBoard, the memory check, several processes; and what a user model cannot have,
refused in one line.

The model is `own_models.Decoder` (tests/own_models.py, plain Flax NNX). One uninterrupted
command-line run is the reference: an interrupted and resumed run, and `fit` on the same
model, optimizer and batches, reproduce its losses exactly (same devices, same float32
programs); two processes reproduce them to the cross-process reductions' rounding.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import HAS_TENSORBOARD, cli_env, held_child, wait_for_step_2

import gtp_jax
from gtp_jax.train import (
    RESUMABLE_EXIT,
    CheckpointConfig,
    Checkpointer,
    DeviceMemoryError,
    ModelSizes,
    ObserveConfig,
    RunFinished,
    TrainConfig,
    fit,
    memory_bound,
    resolve,
)
from gtp_jax.train.cli.command import main as cli_main
from gtp_jax.train.config import describe_choices
from gtp_jax.train.data_source import DataSource
from gtp_jax.train.loop import build_model_and_optimizer
from gtp_jax.train.step.memory import check_memory_fits

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
MODEL = "own_models:make_decoder"
SIZES = ["--steps", "6", "--batch", "8", "--seq", "16", "--warmup", "1"]
RUN = ["train", "--model", MODEL, *SIZES]
#: Losses of two processes against one: the same math, the cross-process reductions add in
#: another order (tests/test_multiprocess.py::LOSS_RTOL measures and explains it).
LOSS_RTOL = 1e-6


def _losses(path: Path) -> list[float]:
    return [s["loss"] for s in json.loads(path.read_text())["steps"]]


def _decoder_params(vocab: int = 256, d: int = 40, n: int = 2) -> int:
    """`own_models.Decoder`'s parameter count, by hand."""
    block = d + (d * 3 * d + 3 * d) + (3 * d * d + d)  # norm scale, up, down
    return vocab * d + n * block + (d * vocab + vocab)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """The uninterrupted run of the decoder from the command line: its folder (checkpoints
    in ck/, metrics in m.json and logs/) and its per-step losses."""
    root = tmp_path_factory.mktemp("own_model")
    assert cli_main([*RUN, "--checkpoint-dir", str(root / "ck"), "--resume", "auto",
                     "--metrics-json", str(root / "m.json"), "--log-dir",
                     str(root / "logs")]) == 0
    return root, _losses(root / "m.json")


def test_the_command_line_trains_your_model_with_checkpoints_and_metrics(reference) -> None:
    root, losses = reference
    assert len(losses) == 6 and losses[-1] < losses[0]
    metrics = json.loads((root / "m.json").read_text())
    assert metrics["summary"]["num_params"] == _decoder_params()
    assert metrics["model_config"]["factory"] == MODEL
    logged = [json.loads(line) for line in (root / "logs" / "metrics.jsonl").open()]
    assert [r["step"] for r in logged if "loss" in r] == [1, 5, 6]  # 1: time to the first step
    assert any(name.startswith("events.out.tfevents")
               for name in os.listdir(root / "logs")) == HAS_TENSORBOARD
    with Checkpointer(CheckpointConfig(root / "ck"), read_only=True) as ckpt:
        assert ckpt.all_steps() == [6]
        extra = ckpt.read_meta()["extra"]
    assert extra["train_config"]["model"] == MODEL
    assert extra["model_config"] == {"factory": MODEL, "vocab_size": 256, "seq_len": 16,
                                     "dtype": "float32", "remat": "none"}


def test_sigterm_saves_and_the_same_command_resumes_exactly(
        reference, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, expected = reference
    flags = [*RUN, "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "auto"]
    proc = held_child([*flags, "--metrics-json", str(tmp_path / "first.json")], tmp_path,
                      TESTS, ROOT)
    wait_for_step_2(proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == RESUMABLE_EXIT, err
    assert "Traceback" not in err
    # The host dispatched step 3 before seeing step 2's end: the run stops after step 3.
    assert "stopped by SIGTERM after step 3 of 6: checkpoint saved" in out, out
    first = _losses(tmp_path / "first.json")
    assert first == expected[:3]
    capsys.readouterr()
    assert cli_main([*flags, "--metrics-json", str(tmp_path / "second.json")]) == 0
    assert first + _losses(tmp_path / "second.json") == expected
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'ck' / '3'} (step 3 of 6)" in out
    assert "gtp_jax train: model=own_models:make_decoder steps=6" in out
    assert "the next-token loss on its logits" in out
    # A warm start from the finished run's weights: its first loss is the trained model's.
    assert cli_main(["train", "--model", MODEL, "--steps", "1", "--batch", "8", "--seq", "16",
                     "--init-from", str(root / "ck"), "--metrics-json",
                     str(tmp_path / "warm.json")]) == 0
    assert _losses(tmp_path / "warm.json")[0] < expected[0] - 0.1


def test_a_job_file_runs_your_model_in_two_processes(reference, tmp_path: Path) -> None:
    _, expected = reference
    (tmp_path / "job.toml").write_text(
        f'model = "{MODEL}"\nsteps = 6\nbatch = 8\nseq = 16\nwarmup = 1\nprocesses = 2\n'
        'metrics-json = "m.json"\n')
    env = cli_env(PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "gtp_jax", "train", "--config", "job.toml"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on 8 cpu devices in 2 processes" in proc.stdout
    np.testing.assert_allclose(_losses(tmp_path / "m.json"), expected, rtol=LOSS_RTOL, atol=0)


def _batches(steps: int):
    """The command line's batches of the bundled corpus (batch 8, seq 16, seed 0)."""
    source = DataSource.check(None)
    source.open(progress=False)
    batcher = source.batcher(8, 16, 0, None)
    return (batcher.next_batch() for _ in range(steps))


def test_fit_trains_a_model_built_in_code_as_the_command_line_does(
        reference, tmp_path: Path) -> None:
    _, expected = reference
    cfg = TrainConfig(model=MODEL, steps=6, batch_size=8, seq_len=16, warmup=1)
    checkpoint = CheckpointConfig(tmp_path / "ck", resume="auto")

    def sigterm_at_step_2(step: int, loss: float, seconds: float) -> None:
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # fit's handler: stop after the step in flight

    model, optimizer = build_model_and_optimizer(cfg)
    handler = signal.getsignal(signal.SIGTERM)
    first = fit(model, optimizer, _batches(6), steps=6, checkpoint=checkpoint,
                on_step=sigterm_at_step_2, progress=False,
                observe=ObserveConfig(log_dir=str(tmp_path / "logs"), log_every=1))
    assert first.stopped_by == "SIGTERM" and first.checkpoint_steps == [3]
    assert first.losses == expected[:3]
    assert signal.getsignal(signal.SIGTERM) is handler  # fit's own handler is gone
    # The same call again continues from the checkpoint: the model and optimizer are
    # restored in place, the first 3 batches skipped.
    model, optimizer = build_model_and_optimizer(cfg)
    rest = fit(model, optimizer, _batches(6), steps=6, checkpoint=checkpoint, progress=False,
               observe=ObserveConfig(log_dir=str(tmp_path / "logs"), log_every=1))
    assert rest.first_step == 4 and rest.stopped_by is None
    assert rest.losses == expected[3:]
    assert rest.tokens_per_step == 8 * 16 and rest.num_params == _decoder_params()
    assert [json.loads(line)["step"] for line in (tmp_path / "logs" / "metrics.jsonl").open()
            if "loss" in line] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(RunFinished):
        fit(model, optimizer, _batches(6), steps=6, checkpoint=checkpoint, progress=False)


def test_fit_an_unsharded_module_on_pairs_with_its_own_loss() -> None:
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (16, 4))
    batches = [(x, x[:, :2] * 2.0)] * 5

    def mse(m: nnx.Module, batch) -> jax.Array:
        return jnp.mean((m(batch[0]) - batch[1]) ** 2)

    result = fit(model, optax.sgd(0.1), batches, steps=5, loss_fn=mse, progress=False,
                 handle_signals=False)
    assert len(result.losses) == 5 and result.losses[-1] < result.losses[0] / 2
    assert result.mesh_shape == {} and result.tokens_per_step == 16
    assert float(mse(model, batches[0])) < result.losses[-1]  # the module itself is trained


def test_fit_logs_the_loss_functions_own_metrics(tmp_path: Path, capsys) -> None:
    # With has_aux, the loss function's metrics reach the metrics log and the progress line
    # (a name the record uses already, "step", is logged as "aux_step").
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (16, 4))
    batches = [(x, x[:, :2] * 2.0)] * 3

    def mse(m: nnx.Module, batch):
        err = m(batch[0]) - batch[1]
        return jnp.mean(err ** 2), {"mae": jnp.mean(jnp.abs(err)), "step": jnp.float32(7)}

    fit(model, optax.sgd(0.1), batches, steps=3, loss_fn=mse, has_aux=True,
        handle_signals=False, observe=ObserveConfig(log_dir=str(tmp_path), log_every=1))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()
               if '"loss"' in line]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["aux_step"] == 7.0 and r["mae"] > 0 for r in records)
    assert records[2]["mae"] < records[0]["mae"]
    assert "mae " in capsys.readouterr().err


def test_fit_refuses_bad_arguments_in_one_line(tmp_path: Path) -> None:
    model = gtp_jax.shard(nnx.Linear(64, 48, rngs=nnx.Rngs(0)), gtp_jax.make_mesh(gtp=8))
    tx = optax.sgd(0.1)
    for kwargs, message in (
            (dict(steps=0), r"fit: steps=0 must be an int >= 1"),
            (dict(steps=3, batches=[1, 2]), r"batches holds 2 batches, fewer than steps=3"),
            (dict(steps=1, optimizer="adam"), r"optimizer=str must be an nnx.Optimizer"),
            (dict(steps=1, checkpoint="ck"), r"checkpoint='ck' must be a CheckpointConfig"),
            (dict(steps=1, loss_fn=3), r"loss_fn=3 must be callable")):
        args = {"optimizer": tx, "batches": [np.zeros((8, 64))] * 3, **kwargs}
        with pytest.raises((ValueError, TypeError), match=message) as err:
            fit(model, args.pop("optimizer"), args.pop("batches"), progress=False, **args)
        assert "\n" not in str(err.value)
    # A checkpoint no training loop wrote (no data position) is not continued.
    with Checkpointer(CheckpointConfig(tmp_path / "other")) as ckpt:
        ckpt.save(1, model)
    with pytest.raises(ValueError, match="records no data position"):
        fit(model, tx, [np.zeros((8, 64))] * 3, steps=3, progress=False,
            checkpoint=CheckpointConfig(tmp_path / "other", resume="auto"))


def test_the_memory_check_counts_your_models_parameters_and_sizes_reach_it() -> None:
    run = resolve(TrainConfig(model=MODEL, batch_size=8, seq_len=16))  # dp=2 x gtp=4
    bound = memory_bound(run)
    params = _decoder_params() * 4 // 4  # float32, split over gtp=4
    assert bound["params"] == bound["grads"] == params
    assert bound["optimizer"] == 2 * params and bound["activations"] == 0
    assert bound["total"] == 4 * params
    check_memory_fits(run, bytes_limit=bound["total"])
    with pytest.raises(DeviceMemoryError, match=r"the run needs at least .* GiB per device"):
        check_memory_fits(run, bytes_limit=bound["total"] - 1)
    # Its own loss, and what the header says.
    own = resolve(TrainConfig(model="own_models:make_with_loss", batch_size=8, seq_len=16))
    from own_models import twice_the_loss  # noqa: PLC0415

    assert own.model.loss_fn is twice_the_loss
    full = resolve(TrainConfig(model=MODEL, remat="full", dtype="bfloat16", batch_size=8))
    assert full.model.sizes == ModelSizes(vocab_size=256, seq_len=128, dtype=jnp.bfloat16,
                                          remat="full")
    assert full.model.sizes.remat_policy is jax.checkpoint_policies.nothing_saveable
    assert describe_choices(own.config, own.model).endswith(
        "0.04M parameters, the factory's loss")
    # A factory builds its own parameter dtypes: the header does not claim float32.
    assert "gathers in the parameters' own dtype," in describe_choices(own.config, own.model)


@pytest.mark.parametrize("flags,message", [
    (["--layers", "3"], "--layers=3 with --model: it sets the bundled decoder's depth; drop "
                        "--layers"),
    (["--preset", "small"], "--preset='small' with --model"),
    (["--export-hf", "hf"], "--export-hf='hf' with --model: the Hugging Face export writes"),
    (["--moe-experts", "4"], "--moe-experts=4 with --model"),
    (["--attention", "xla"], "--attention='xla' with --model"),
    (["--no-unroll-layers"], "for your blocks: gtp_jax.Stack(..., unroll=False) in the factory"),
    (["--overlap"], "--overlap=True with --model"),
    (["--plan", "auto"], "--plan auto with --model: the planner compiles the bundled decoder"),
    (["--cp", "2"], "--cp=2 with --model: Decoder has no gtp_input_layout"),
    (["--simulate-failure", "step=2,device=1"], "--model with a SimulatedFailure"),
    (["--model", "own_models"], "--model='own_models': use 'package.module:factory'"),
    (["--model", "no_such_module:make"], "cannot import 'no_such_module'"),
    (["--model", "own_models:missing"], "'own_models' has no 'missing' (it defines"),
    (["--model", "own_models:not_callable"], "'not_callable' is a int, not a function"),
    (["--model", "own_models:returns_a_number"], "returned int; a factory returns a "
                                                 "flax.nnx.Module, or (module, loss_fn)"),
    (["--model", "own_models:returns_a_bad_loss"], "returned a loss str, not a function"),
])
def test_what_your_model_cannot_have_is_refused_in_one_line(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main([*RUN, *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_logits_the_default_loss_cannot_use_are_refused_when_traced(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["train", "--model", "own_models:make_features", "--steps", "1",
                     "--batch", "8", "--seq", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "next_token_loss: the model returned (8, 16, 40) " \
        "float32 for tokens (8, 17)" in err and "vocab >= 256" in err, err


class _WithDropout(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.drop(self.lin(x))


def test_a_resume_on_other_data_shards_says_the_draws_differ(capsys) -> None:
    # Each data shard draws its own dropout masks: resumed over another number of data
    # shards, the losses differ from the uninterrupted run's, and the run says so (over as
    # many, or with a model that draws nothing, it says nothing).
    from gtp_jax.train.loop import _note_other_draws  # noqa: PLC0415

    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    drawing = gtp_jax.shard(_WithDropout(), mesh, gtp_jax.GTPConfig(min_elements=1))
    plain = gtp_jax.shard(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), mesh,
                          gtp_jax.GTPConfig(min_elements=1))
    other = {"mesh": {"dp": 1, "ep": 1, "gtp": 2, "tp": 4}}
    _note_other_draws(other, drawing)
    assert ("the batch is split over 8 data shards, the saved run's over 2: the model's "
            "random draws (dropout) are made per data shard") in capsys.readouterr().err
    _note_other_draws({"mesh": {"dp": 4, "ep": 1, "gtp": 2, "tp": 1}}, drawing)
    _note_other_draws(other, plain)
    assert capsys.readouterr().err == ""
