"""A training job's lifecycle: stopped by a signal, requeued with the same command, warm
started from another run's weights; and the usage errors around them.

One uninterrupted reference run (6 steps, its checkpoint kept) is shared by the tests; every
interrupted, resumed or warm-started run is compared with it loss by loss, exactly (same
devices, same float32 programs).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import optax
import pytest
from flax import nnx
from helpers import held_child, wait_for_step_2

import gtp_jax
from gtp_jax.base.errors import UsageError
from gtp_jax.models import Transformer, lm_loss, preset
from gtp_jax.train import (
    RESUMABLE_EXIT,
    CheckpointConfig,
    Checkpointer,
    RunStopped,
    TrainConfig,
    TrainStep,
    train,
)
from gtp_jax.train.cli.command import main as cli_main
from gtp_jax.train.data_source import DataSource
from gtp_jax.train.lifecycle.preempt import StopRequest
from gtp_jax.train.loop import _global_batch, build_model_and_optimizer

ROOT = Path(__file__).resolve().parents[1]
#: Two layers instead of the tiny preset's four: these tests are about the run around the
#: model (signals, checkpoints, warm starts), and each run compiles its programs afresh.
RUN = ["train", "--steps", "6", "--batch", "8", "--seq", "32", "--warmup", "1", "--layers", "2"]


def _losses(path: Path) -> list[float]:
    return [s["loss"] for s in json.loads(path.read_text())["steps"]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """The uninterrupted run (started with the requeue-safe command on a directory that
    does not exist yet): its checkpoint directory and per-step losses."""
    root = tmp_path_factory.mktemp("reference")
    flags = [*RUN, "--checkpoint-dir", str(root / "ck"), "--resume", "auto"]
    assert cli_main([*flags, "--metrics-json", str(root / "m.json")]) == 0
    return root / "ck", _losses(root / "m.json")


def _child(flags: list[str], tmp_path: Path) -> subprocess.Popen:
    return held_child(flags, tmp_path, ROOT)


def test_sigterm_saves_and_the_same_command_resumes_exactly(
        reference: tuple[Path, list[float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    _, expected = reference
    export = tmp_path / "hf"
    flags = [*RUN, "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "auto",
             "--export-hf", str(export)]
    proc = _child([*flags, "--metrics-json", str(tmp_path / "first.json")], tmp_path)
    wait_for_step_2(proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    # Unfinished: not status 0 (`train && upload` must not ship it), nothing exported.
    assert proc.returncode == RESUMABLE_EXIT == 75, err
    assert "Traceback" not in err and "error" not in err.lower()
    # The host dispatched step 3 before printing step 2, so the run stops after step 3: at
    # most two steps run after the signal (here only one, the signal came before step 3's
    # stop check), as its message says.
    assert "finishing at most two more steps" in err, err
    lines = out.strip().splitlines()
    assert lines[-1] == (
        f"gtp_jax train: stopped by SIGTERM after step 3 of 6: checkpoint saved in "
        f"{str(tmp_path / 'ck')!r}; run the same command with --resume auto to continue "
        f"(exit status 75: unfinished); --export-hf {str(export)!r} is written only when the "
        "run finishes."), out
    assert not export.exists()
    assert Checkpointer(CheckpointConfig(tmp_path / "ck")).all_steps() == [3]
    first = _losses(tmp_path / "first.json")
    assert first == expected[:3]
    capsys.readouterr()
    # The requeued job: the same command continues with the uninterrupted run's losses,
    # says where it resumed from, and exports the finished model.
    assert cli_main([*flags, "--metrics-json", str(tmp_path / "second.json"),
                     "--log-dir", str(tmp_path / "logs")]) == 0
    assert first + _losses(tmp_path / "second.json") == expected
    out = capsys.readouterr().out
    assert f"gtp_jax train: resumed from {tmp_path / 'ck' / '3'} (step 3 of 6)\n" in out
    assert f"  Hugging Face export: {export}\n" in out
    assert f"  metrics log: {tmp_path / 'logs' / 'metrics.jsonl'}\n" in out + "\n"
    assert sorted(os.listdir(export)) == ["config.json", "model.safetensors"]
    # Requeued once more after it finished: one line, status 0, nothing trained.
    assert cli_main(flags) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 1 and "is finished (checkpoint at step 6)" in out
    assert not err.strip()


def test_second_signal_exits_at_once_and_keeps_an_intact_checkpoint(
        reference: tuple[Path, list[float]], tmp_path: Path) -> None:
    _, expected = reference
    flags = [*RUN, "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "auto",
             "--checkpoint-every", "1"]
    proc = _child(flags, tmp_path)
    wait_for_step_2(proc)
    # Both pending at once: SIGINT (the lower number) is handled first and asks to stop,
    # SIGTERM is the second signal.
    os.kill(proc.pid, signal.SIGINT)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "second signal (SIGTERM): exiting now" in err
    ckpt = Checkpointer(CheckpointConfig(tmp_path / "ck"))
    steps = ckpt.all_steps()
    ckpt.verify(steps[-1])  # the newest listed checkpoint is complete and intact
    ckpt.close()
    assert steps and set(steps) <= {1, 2, 3, 4}
    result = tmp_path / "rest.json"
    assert cli_main([*flags, "--metrics-json", str(result)]) == 0
    assert _losses(result) == expected[steps[-1]:]


def test_resume_errors_name_flags_and_strict_resume_is_one_line(
        reference: tuple[Path, list[float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    directory, _ = reference
    capsys.readouterr()
    assert cli_main([*RUN, "--checkpoint-dir", str(directory), "--resume", "--lr", "1e-3"]) == 2
    err = capsys.readouterr().err
    assert "different run (--lr: checkpoint 0.003 vs now 0.001)" in err
    assert "--init-from" in err and "TrainConfig" not in err
    (tmp_path / "empty").mkdir()
    assert cli_main([*RUN, "--checkpoint-dir", str(tmp_path / "empty"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--resume auto" in err and "=False" not in err
    assert cli_main([*RUN, "--checkpoint-dir", str(directory)]) == 2
    assert "--resume auto" in capsys.readouterr().err


def test_close_waits_for_the_clean_up_of_unfinished_saves(tmp_path: Path) -> None:
    # orbax removes leftovers of unfinished saves in a background thread; a process that
    # exited right after closing (a refused resume) raced it into a thread traceback.
    for i in range(200):
        (tmp_path / f"{i}.orbax-checkpoint-tmp-{1000 + i}" / "model").mkdir(parents=True)
    Checkpointer(CheckpointConfig(tmp_path)).close()
    assert os.listdir(tmp_path) == []


def test_init_from_loads_the_weights_only(reference: tuple[Path, list[float]],
                                          tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    directory, _ = reference
    flags = ["train", "--steps", "2", "--batch", "8", "--seq", "32", "--warmup", "1",
             "--layers", "2", "--lr", "1e-3", "--gtp", "8", "--dp", "1",
             "--init-from", str(directory),
             "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "auto"]
    assert cli_main([*flags, "--metrics-json", str(tmp_path / "m.json")]) == 0
    losses = _losses(tmp_path / "m.json")
    # Step 1's loss is the source's final weights' loss on the new run's first batch
    # (computed here on the same gtp=8 mesh, outside the training step: float32 rounding
    # of another program, hence 1e-6).
    cfg = TrainConfig(steps=2, batch_size=8, seq_len=32, warmup=1, lr=1e-3, dp=1, gtp=8,
                      layers=2)
    model, _ = build_model_and_optimizer(cfg)
    source = Checkpointer(CheckpointConfig(directory))
    source.restore(model, None)
    source.close()
    data = DataSource.check(None)
    data.open(progress=False)
    batch = data.batcher(8, 32, 0, None).next_batch()
    want = float(lm_loss(model, _global_batch(batch, gtp_jax.data_sharding(model.mesh))))
    np.testing.assert_allclose(losses[0], want, rtol=1e-6)
    meta = Checkpointer(CheckpointConfig(tmp_path / "ck")).read_meta()
    assert meta["step"] == 2 and meta["extra"]["train_config"]["lr"] == 1e-3
    arrays = Checkpointer(CheckpointConfig(tmp_path / "ck")).read_arrays()
    counts = [v for k, v in arrays.items() if k.endswith("count")]
    assert counts and all(int(c) == 2 for c in counts)  # a fresh optimizer: 2 updates
    capsys.readouterr()
    # Another model shape is refused in one line naming the saving run's flags.
    assert cli_main([*flags[:-4], "--preset", "small", "--checkpoint-dir",
                     str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--init-from=" in err and "--preset='tiny'" in err


def test_optimizer_of_the_unsharded_module_is_refused_at_train_step(mesh_dp2_gtp4) -> None:
    model = Transformer(preset("tiny", vocab_size=256, max_seq_len=32), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    sharded = gtp_jax.shard(model, mesh_dp2_gtp4)
    with pytest.raises(UsageError, match=r"built for another module, e\.g\. before "
                                         r"gtp_jax\.shard.*nnx\.Optimizer\(sharded"):
        TrainStep(sharded, optimizer, lm_loss)
    TrainStep(sharded, nnx.Optimizer(sharded, optax.adamw(1e-3), wrt=nnx.Param), lm_loss)


def _damage_arrays(step_dir: Path) -> None:
    """Garbles 16 bytes in the middle of the largest array data file of a step."""
    files = [p for p in (step_dir / "model").rglob("*") if p.is_file() and "/d/" in str(p)]
    path = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xA5
    path.write_bytes(bytes(data))


def _drop_checksums(step_dir: Path) -> None:
    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    del meta["checksums"]
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, steps", [
    ("arrays", 6),       # the finished run's only checkpoint fails its checksums
    ("metadata", 6),     # its metadata lost its checksums: not a resume candidate
    ("arrays", 8),       # an extension: the restore itself finds the damage
])
def test_requeue_with_only_damaged_checkpoints_starts_over(
        reference: tuple[Path, list[float]], tmp_path: Path, damage: str, steps: int,
        capsys: pytest.CaptureFixture[str]) -> None:
    # The requeue command never dead-ends: with --resume auto, a directory whose every
    # checkpoint is damaged has them renamed aside (kept) and starts a new run.
    source, expected = reference
    directory = tmp_path / "ck"
    shutil.copytree(source, directory)
    (directory / ".gtp_jax.lock").unlink(missing_ok=True)
    (_damage_arrays if damage == "arrays" else _drop_checksums)(directory / "6")
    flags = [*RUN, "--steps", str(steps), "--checkpoint-dir", str(directory)]
    capsys.readouterr()
    assert cli_main([*flags, "--resume"]) == 2  # a strict resume still refuses it
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "no intact" in errors[0] and "--resume auto" in errors[0], errors
    assert cli_main([*flags, "--resume", "auto", "--metrics-json",
                     str(tmp_path / "m.json")]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "starting a new run from step 0" in line]
    assert len(said) == 1 and "broken-6-0" in said[0] and "no intact checkpoint" in said[0], err
    assert (directory / "broken-6-0").is_dir()  # renamed, not deleted
    losses = _losses(tmp_path / "m.json")
    assert len(losses) == steps
    if steps == 6:
        assert losses == expected  # a new run: the uninterrupted run's losses exactly
    meta = Checkpointer(CheckpointConfig(directory)).read_meta()
    # A new run's schedule: its own steps, not the damaged checkpoint's.
    assert meta["step"] == steps and meta["extra"]["train_config"]["schedule_steps"] == steps


def test_fp8_compute_may_change_on_resume_and_for_a_warm_start(
        reference: tuple[Path, list[float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--fp8-compute` is documented as changeable on resume: delayed scaling's amax
    histories are started fresh where the checkpoint has none, and left unread where the
    run has none (the restore refused both, and a resume then set the newest checkpoint
    aside as damaged and silently went back to an older one)."""
    directory, _ = reference
    ck = tmp_path / "ck"
    shutil.copytree(directory, ck)
    fp8 = ["--fp8-compute", "delayed", "--fp8-min-features", "16"]
    steps = RUN.index("--steps") + 1

    def run(n: int, *flags: str) -> str:
        argv = list(RUN)
        argv[steps] = str(n)
        assert cli_main([*argv, *flags]) == 0
        out, err = capsys.readouterr()
        assert "skipping" not in err and "Traceback" not in err, err
        return out

    capsys.readouterr()
    assert f"resumed from {ck / '6'} (step 6 of 8)" in run(8, "--checkpoint-dir", str(ck),
                                                           "--resume", *fp8)
    assert f"resumed from {ck / '8'} (step 8 of 10)" in run(10, "--checkpoint-dir", str(ck),
                                                            "--resume")
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("broken")) == []
    run(2, "--init-from", str(ck), *fp8, "--checkpoint-dir", str(tmp_path / "warm"))
    run(2, "--init-from", str(tmp_path / "warm"))  # histories saved, none wanted


def test_a_stop_before_the_first_step_trains_and_saves_nothing(tmp_path: Path) -> None:
    # A signal while the run is prepared (here: requested before it starts) is honoured
    # before step 1 instead of after it.
    stop = StopRequest()
    stop.request(signal.SIGTERM)
    with pytest.raises(RunStopped, match=r"stopped by SIGTERM while preparing the run, "
                                         r"before step 1: nothing was trained"):
        train(TrainConfig(steps=2, batch_size=8, seq_len=32, dp=2, gtp=4), progress=False,
              checkpoint=CheckpointConfig(tmp_path / "ck"), stop=stop)
    assert not Checkpointer(CheckpointConfig(tmp_path / "ck")).all_steps()


def test_folders_of_the_user_in_the_checkpoint_directory_are_left_alone(
        reference: tuple[Path, list[float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A folder named by a step number that no save wrote (notes, an evaluation's output;
    empty or not, below or above the checkpoints' steps) is never listed, read, renamed
    aside as damaged, nor deleted by the rotation of old checkpoints; the run says so once,
    and refuses, before training, to save a step where such a folder is."""
    source, expected = reference
    directory = tmp_path / "ck"
    shutil.copytree(source, directory)
    (directory / ".gtp_jax.lock").unlink(missing_ok=True)
    mine = {"3": "eval of step 3", "100": "notes", "7": None}
    for name, text in mine.items():
        (directory / name).mkdir()
        if text is not None:
            (directory / name / "notes.txt").write_text(text)
    assert Checkpointer(CheckpointConfig(directory)).all_steps() == [6]
    flags = [*RUN, "--checkpoint-dir", str(directory), "--resume", "--checkpoint-every", "2",
             "--keep-checkpoints", "1"]
    capsys.readouterr()
    assert cli_main([*flags, "--steps", "10", "--metrics-json", str(tmp_path / "m.json")]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "alone" in line]
    assert len(said) == 1 and all(str(directory / n) in said[0] for n in mine), err
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == [
        "10", "100", "3", "7"]  # checkpoint 6 and 8 rotated out, the folders kept
    for name, text in mine.items():
        assert (directory / name / "notes.txt").read_text() == text if text else not any(
            (directory / name).iterdir())
    assert len(_losses(tmp_path / "m.json")) == 4
    # A new run that would save step 2 where a folder of the user's is: refused before
    # anything is built or trained.
    other = tmp_path / "other"
    other.mkdir()
    (other / "2").mkdir()
    (other / "2" / "notes.txt").write_text("mine")
    assert cli_main([*RUN, "--steps", "4", "--checkpoint-dir", str(other),
                     "--checkpoint-every", "2", "--resume", "auto"]) == 2
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(other / "2") in errors[0] and "--checkpoint-dir" in \
        errors[0], err
    assert "gtp_jax train: preset" not in out
    assert sorted(p.name for p in other.iterdir() if not p.name.startswith(".")) == ["2"]
