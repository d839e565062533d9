"""The training job: the command line end to end, and `gtp_jax.train.train` in process."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from gtp_jax.data import VOCAB_SIZE
from gtp_jax.models import Transformer, preset
from gtp_jax.train import TrainConfig, train

REPO_ROOT = Path(__file__).resolve().parents[1]


def _run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the CLI sets the simulated device count itself
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-m", "gtp_jax", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_train_runs_and_loss_decreases() -> None:
    proc = _run_cli("train", "--steps", "20", "--seq", "32", "--batch", "8")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out = proc.stdout
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
    assert "step 20/20" in proc.stderr  # progress bar


def test_cli_help() -> None:
    proc = _run_cli("train", "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--gtp", "--dp", "--steps", "--pad-for-alignment", "--gather-dtype"):
        assert flag in proc.stdout
    top = _run_cli("--help", timeout=60)
    assert top.returncode == 0 and "train" in top.stdout


def test_cli_rejects_tp_and_bad_mesh() -> None:
    proc = _run_cli("train", "--steps", "1", "--tp", "2", "--gtp", "4", "--dp", "1", timeout=120)
    assert proc.returncode == 2
    assert "--tp" in proc.stderr


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
            padded = -(-layer[0] // align) * align
            per_device += math.prod(lead + (padded // gtp,) + layer[1:]) * itemsize
        else:
            per_device += math.prod(shape) * itemsize
    return per_device, replicated


def test_train_in_process_gtp8_padded() -> None:
    steps: list[tuple[int, float]] = []
    cfg = TrainConfig(steps=8, batch_size=8, seq_len=32, dp=1, gtp=8, pad_for_alignment=8,
                      warmup=2)
    result = train(cfg, on_step=lambda s, loss, t: steps.append((s, loss)), progress=False)
    assert [s for s, _ in steps] == list(range(1, 9))
    assert len(result.losses) == 8 and len(result.step_times) == 8
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
