"""The training job: the command line end to end, and `gtp_jax.train.train` in process."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import cli_env, train_until

from gtp_jax.data import VOCAB_SIZE
from gtp_jax.models import Transformer, preset
from gtp_jax.train import TrainConfig, train
from gtp_jax.train.cli.command import main as cli_main
from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig, Checkpointer

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

REPO_ROOT = Path(__file__).resolve().parents[1]


def _run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gtp_jax", *args], cwd=REPO_ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_cli_train_runs_and_loss_decreases(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # In process (the README runs the main job as a process).
    code = cli_main(["train", "--steps", "20", "--seq", "32", "--batch", "8",
                     "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "8",
                     "--keep-checkpoints", "2", "--profile-dir", str(tmp_path / "prof"),
                     "--profile-steps", "3:4", "--metrics-json", str(tmp_path / "m.json")])
    out, err = capsys.readouterr()
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "gtp_jax train: preset=tiny steps=20 batch=8 seq=32 mesh dp=2 ep=1 gtp=4 tp=1" in out
    assert "on 8 cpu devices" in out
    assert "summary (cpu, mesh dp=2 ep=1 gtp=4 tp=1" in out
    match = re.search(r"loss: first ([0-9.]+) -> last ([0-9.]+)", out)
    assert match, out
    first, last = float(match.group(1)), float(match.group(2))
    assert math.isfinite(first) and math.isfinite(last)
    assert first > 5.0  # ~ln(256) for an untrained byte model
    assert last < first - 1.0, f"loss did not decrease: {first} -> {last}"
    ratio = re.search(r"params per device: [0-9.]+ MiB \(replicated: [0-9.]+ MiB, ([0-9.]+)x\)",
                      out)
    assert ratio, out
    assert 0.25 <= float(ratio.group(1)) <= 0.26  # 1/gtp, plus norms and a little padding
    assert "step 20/20" in err  # progress bar

    # Observability: MFU and device memory are n/a on CPU (no peak rate, no allocator stats).
    assert "MFU: n/a (no peak FLOP/s known for cpu; 2.65 MFLOP/token)" in out
    assert "memory per device: n/a on cpu" in out
    metrics = json.loads((tmp_path / "m.json").read_text())
    steps = metrics["steps"]
    assert [s["step"] for s in steps] == list(range(1, 21))
    assert f"{steps[0]['loss']:.4f}" == match.group(1)
    assert all(s["step_time_s"] > 0 and s["tokens_per_s"] > 0 for s in steps)
    summary = metrics["summary"]
    assert summary["mfu"] is None and summary["memory_per_device"] is None
    assert summary["tokens_per_step"] == 8 * 32 and summary["tokens_per_s"] > 0
    assert summary["flops_per_token"] == preset("tiny", vocab_size=VOCAB_SIZE
                                                ).train_flops_per_token(32)
    assert metrics["config"]["steps"] == 20 and summary["mesh"]["gtp"] == 4
    # Profile of steps 3-4: a Perfetto trace with this program's XLA ops.
    traces = list((tmp_path / "prof").glob("plugins/profile/*/perfetto_trace.json.gz"))
    assert len(traces) == 1, list((tmp_path / "prof").rglob("*"))
    assert f"profile: steps 3-4 -> {traces[0]}" in out
    with gzip.open(traces[0], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert any("train" in str(e.get("name", "")) for e in events)
    # Checkpoints every 8 steps and after the last; the newest 2 kept (and only those that
    # are kept are listed). The lock file is removed at the end.
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["16", "20"]
    assert f"checkpoints: steps [16, 20] in {tmp_path / 'ck'}" in out


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    # In process (the README runs the command line as a process): `--help` exits with 0.
    with pytest.raises(SystemExit) as exit_:
        cli_main(["train", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--gtp", "--dp", "--steps", "--pad-for-alignment", "--gather-dtype"):
        assert flag in out
    top = _run_cli("--help", timeout=60)  # the `python -m gtp_jax` entry point itself
    assert top.returncode == 0 and "train" in top.stdout


def test_cli_rejects_tp_that_does_not_divide_the_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    # The tiny preset's d_ff (352) does not split over tp=3: a clear error, exit code 2.
    assert cli_main(["train", "--steps", "1", "--tp", "3", "--gtp", "4", "--dp", "1"]) == 2
    err = capsys.readouterr().err
    assert "tp=3" in err and "d_ff" in err


def test_train_with_tensor_parallelism_and_moe() -> None:
    # The main job on a dp x gtp x tp mesh with ring-overlapped TP GEMMs and MoE experts:
    # it runs and learns (equivalence with the unsharded model is tests/test_tp.py's job).
    from gtp_jax.train import TrainConfig, train

    result = train(TrainConfig(steps=6, batch_size=8, seq_len=16, dp=2, gtp=2, tp=2,
                               overlap=True, moe_experts=4, moe_top_k=2, lr=1e-2))
    assert result.mesh_shape["tp"] == 2
    assert all(np.isfinite(result.losses))
    assert result.losses[-1] < result.losses[0]


def test_cli_rejects_bad_checkpoint_and_profile_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # In process: these flags fail validation before JAX starts or a process joins a run.
    cases = [
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--resume", "--checkpoint-dir", str(tmp_path / "nope")], "does not exist"),
        (["--profile-steps", "4:2", "--profile-dir", str(tmp_path)],
         "--profile-steps=(4, 2) must be (first, last) with 1 <= first <= last"),
        (["--profile-steps", "x", "--profile-dir", str(tmp_path)], "use FIRST:LAST"),
        (["--profile-steps", "2:3"], "--profile-steps needs --profile-dir"),
        (["--metrics-json", str(tmp_path)], "is a directory"),
        (["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "-1"], "--checkpoint-every"),
        (["--num-processes", "2", "--process-id", "0"], "coordinator not set"),
    ]
    for flags, message in cases:
        assert cli_main(["train", "--steps", "3", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (flags, err)
    assert not (tmp_path / "nope").exists()


#: The run the resume tests use; test_checkpoint.py and test_multiprocess.py train the same
#: config, so the suite compiles this train step once (`TrainStep` programs are cached by
#: model structure).
RUN = TrainConfig(steps=6, batch_size=8, seq_len=32, warmup=2, dp=2, gtp=4, pad_for_alignment=8)


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path: Path) -> None:
    full = train(RUN, progress=False, checkpoint=CheckpointConfig(tmp_path / "full"))
    assert full.checkpoint_steps == [6]

    first = train_until(RUN, tmp_path / "run", stop_after=3)
    assert first == full.losses[:3]
    shutil.copytree(tmp_path / "run", tmp_path / "run_gtp8")  # holds step 3 only

    resumed = train(RUN, progress=False,
                    checkpoint=CheckpointConfig(tmp_path / "run", every=3, resume=True))
    assert resumed.first_step == 4 and resumed.checkpoint_steps == [6]
    assert resumed.losses == full.losses[3:]  # bit-exact: same data, state and LR position
    assert "steps 4-6" in resumed.summary()
    # The summary lists every checkpoint the directory holds, and which this run saved.
    assert resumed.checkpoints_kept == [3, 6]
    assert (f"checkpoints: steps [3, 6] in {tmp_path / 'run'} (this run saved [6])"
            in resumed.summary())
    final_full = Checkpointer(CheckpointConfig(tmp_path / "full")).read_arrays(6)
    final_resumed = Checkpointer(CheckpointConfig(tmp_path / "run")).read_arrays(6)
    assert final_full.keys() == final_resumed.keys()
    assert any(k.endswith("/mu/module/blocks/mlp/down/kernel") for k in final_full)
    for key, value in final_full.items():
        np.testing.assert_array_equal(final_resumed[key], value, err_msg=key)

    # The same checkpoint resumed on another mesh (dp=1 x gtp=8): the restored state
    # is bit-exact (test_checkpoint.py), the steps after it differ only by the order of the
    # gradient reductions, i.e. float32 rounding (about 1e-7 relative per step).
    # (gtp=8 with pad_for_alignment=8 pads to multiples of 64 instead of 32.)
    moved = train(dataclasses.replace(RUN, dp=1, gtp=8), progress=False,
                  checkpoint=CheckpointConfig(tmp_path / "run_gtp8", resume=True))
    assert moved.first_step == 4 and moved.mesh_shape["gtp"] == 8
    np.testing.assert_allclose(moved.losses, full.losses[3:], rtol=1e-5)


def _expected_param_bytes(pad: int, gtp: int) -> tuple[int, int]:
    """(bytes per device, replicated bytes) of the tiny preset sharded with min_elements=1024,
    computed from the parameter shapes and the documented padding rule alone."""
    cfg = preset("tiny", vocab_size=VOCAB_SIZE)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    align = gtp * max(1, pad)
    per_device = replicated = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = tuple(var.get_value().shape)
        itemsize = np.dtype(var.get_value().dtype).itemsize
        replicated += math.prod(shape) * itemsize
        stacked = path[0] == "blocks"
        lead, layer = (shape[:1], shape[1:]) if stacked else ((), shape)
        if len(layer) >= 2 and math.prod(layer) >= 1024:
            # The documented dim rule: the leading dim unless its padding adds more than
            # 1/32 of the weight, else the dim with the fewest padded elements.
            def padded(d: int, layer: tuple[int, ...] = layer) -> int:
                return math.prod(layer) // layer[d] * (-(-layer[d] // align) * align)

            dim = 0 if padded(0) <= math.prod(layer) * (1 + 1 / 32) else min(
                range(len(layer)), key=lambda d: (padded(d), d))
            per_device += math.prod(lead) * padded(dim) // gtp * itemsize
        else:
            per_device += math.prod(shape) * itemsize
    return per_device, replicated


def test_train_in_process_gtp8_padded() -> None:
    steps: list[tuple[int, float]] = []
    cfg = dataclasses.replace(RUN, dp=1, gtp=8)  # 6 steps, batch 8, seq 32, padding 8
    assert cfg.pad_for_alignment == 8
    result = train(cfg, on_step=lambda s, loss, t: steps.append((s, loss)), progress=False)
    assert [s for s, _ in steps] == list(range(1, 7))
    assert len(result.losses) == 6 and len(result.step_times) == 6
    assert all(math.isfinite(x) for x in result.losses)
    assert [loss for _, loss in steps] == result.losses
    assert result.losses[-1] < result.losses[0]
    assert result.mesh_shape == {"dp": 1, "ep": 1, "gtp": 8, "tp": 1}
    assert result.backend == jax.default_backend() == "cpu"
    assert result.tokens_per_step == 8 * 32

    per_device, replicated = _expected_param_bytes(pad=8, gtp=8)
    assert result.replicated_param_bytes == replicated
    assert result.param_bytes_per_device == per_device
    # 1/8 of the replicated bytes plus padding: pad_for_alignment=8 pads dim 0 to multiples
    # of 64 (the attention output kernel's 4 heads become 64 rows, 352 -> 384 for mlp/down).
    assert replicated / 8 < result.param_bytes_per_device < replicated / 3
    # AdamW keeps mu and nu shaped like the params (plus scalar counters).
    extra = result.state_bytes_per_device - 3 * result.param_bytes_per_device
    assert 0 <= extra <= 64
    assert "loss: first" in result.summary()


def test_a_step_is_timed_when_its_outputs_are_ready_not_when_its_loss_reaches_the_host():
    """The loss's copy to the host can wait behind the next step's transfers to host memory
    (offloaded optimizer state): the step's time must be taken before that copy."""
    from gtp_jax.train.loop import wait_for_step

    events = []

    class Loss:  # a device scalar whose copy to the host comes late
        def block_until_ready(self):
            events.append("ready")
            return self

        def __float__(self):
            events.append("copied")
            return 2.5

    def clock():
        events.append("clock")
        return 7.0

    loss, done = wait_for_step({"loss": Loss()}, clock=clock)
    assert (loss, done) == (2.5, 7.0)
    assert events == ["ready", "clock", "copied"]
