"""``--log-dir``: per-step metrics streamed while the run trains
(`gtp_jax.train.outputs.metrics_log`), readable while it is alive and kept when it crashes;
TensorBoard event files."""

from __future__ import annotations

import io
import json
import socket
import struct
import subprocess
import sys

import pytest
from helpers import HAS_TENSORBOARD

from gtp_jax.base.errors import UsageError
from gtp_jax.train import ObserveConfig, TrainConfig, train
from gtp_jax.train.cli.command import main as cli_main
from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig
from gtp_jax.train.outputs.metrics_log import METRICS_FILE, NO_TENSORBOARD, MetricsLog

KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_ms"}


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """The scalar summaries of the TensorBoard event files (TFRecord framing: u64 length,
    u32 crc, payload, u32 crc)."""
    from tensorboardX.proto import event_pb2  # noqa: PLC0415

    found: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


class Crash(RuntimeError):
    pass


def test_metrics_stream_while_alive_and_survive_a_crash(tmp_path) -> None:
    log_dir = tmp_path / "logs"
    seen: dict[int, list[dict]] = {}

    def on_step(step: int, loss: float, seconds: float) -> None:
        # The run is alive: the file already holds this step's line.
        seen[step] = _lines(log_dir / METRICS_FILE)
        assert seen[step][-1]["loss"] == pytest.approx(loss)
        if step == 3:
            raise Crash("simulated crash after step 3")

    cfg = TrainConfig(steps=5, batch_size=8, seq_len=16, warmup=2, dp=2, gtp=4, layers=2)
    with pytest.raises(Crash):
        train(cfg, on_step=on_step, progress=False,
              observe=ObserveConfig(log_dir=str(log_dir), log_every=1))
    assert [len(seen[s]) for s in (1, 2, 3)] == [1, 2, 3]
    lines = _lines(log_dir / METRICS_FILE)  # kept after the crash
    assert [r["step"] for r in lines] == [1, 2, 3]
    for record in lines:
        assert KEYS <= set(record), record
        assert "mfu" not in record and "peak_bytes" not in record  # CPUs report neither
        assert record["grad_norm"] > 0 and record["tokens_per_s"] > 0
    # The LR each update used: warm-up over 2 steps (step k at k/2 of the peak), then the
    # cosine decay's first step (a third of the way to 10% over steps 3-5).
    assert [r["lr"] for r in lines] == [pytest.approx(cfg.peak_lr / 2), pytest.approx(cfg.peak_lr),
                                        pytest.approx(cfg.peak_lr * (0.1 + 0.9 * 0.75))]
    if not HAS_TENSORBOARD:  # the run said so in one line (test_log_every_and_missing_...)
        assert not list(log_dir.glob("events.out.tfevents.*"))
        return
    scalars = _scalars(log_dir)
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in lines])
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(scalars)


def test_log_every_and_missing_tensorboard(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails
    note = io.StringIO()
    log = MetricsLog(str(tmp_path), log_every=3, last_step=7, stream=note)
    assert [s for s in range(1, 8) if log.should_log(s)] == [3, 6, 7]
    record = log.write(3, loss=2.5, step_s=0.5, tokens=100, lr=1e-3, grad_norm=0.7)
    log.close()
    assert note.getvalue().strip() == NO_TENSORBOARD
    assert record == {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.7,
                      "tokens_per_s": 200.0, "step_ms": 500.0}
    assert _lines(tmp_path / METRICS_FILE) == [record]
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    # A resumed run appends.
    log = MetricsLog(str(tmp_path), log_every=1, last_step=9, stream=note)
    log.write(4, loss=2.0, step_s=1.0, tokens=10)
    log.close()
    assert [r["step"] for r in _lines(tmp_path / METRICS_FILE)] == [3, 4]


def test_bad_log_settings() -> None:
    with pytest.raises(UsageError, match="ObserveConfig.log_every=0 must be an int >= 1"):
        ObserveConfig(log_every=0)
    with pytest.raises(UsageError, match="ObserveConfig.log_dir must be a non-empty path"):
        ObserveConfig(log_dir="")


def _strict_lines(path) -> list[dict]:
    """The file's records, parsed as strict JSON (NaN / Infinity are not JSON)."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_non_finite_numbers_are_written_as_null_and_named(tmp_path) -> None:
    note = io.StringIO()
    log = MetricsLog(str(tmp_path), log_every=1, last_step=9, tensorboard=False, stream=note)
    record = log.write(2, loss=2.5, step_s=0.0, tokens=100, lr=1e-3,
                       grad_norm=float("nan"), val_loss=float("inf"))
    log.close()
    assert record == {"step": 2, "loss": 2.5, "lr": 1e-3, "grad_norm": None,
                      "tokens_per_s": None, "step_ms": 0.0, "val_loss": None,
                      "nonfinite": ["grad_norm", "tokens_per_s", "val_loss"]}
    assert _strict_lines(tmp_path / METRICS_FILE) == [record]
    # A file of an older version (NaN written, a line cut short by a crash), continued by a
    # run that starts after step 2: strict JSON, steps 1-2 kept, the rest dropped.
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "loss": NaN}\n{"step": 2, "loss": 1.0}\n'
                                         '{"step": 3, "loss": 0.9}\n{"step": 4, "lo')
    log = MetricsLog(str(tmp_path), log_every=1, last_step=9, tensorboard=False, stream=note,
                     start=2)
    log.write(3, loss=0.5, step_s=1.0, tokens=10)
    log.close()
    assert [(r["step"], r["loss"]) for r in _strict_lines(tmp_path / METRICS_FILE)] == [
        (1, None), (2, 1.0), (3, 0.5)]
    assert "dropped 2 record(s) after step 2" in note.getvalue()


def test_a_resumed_run_logs_each_step_once(tmp_path, capsys) -> None:
    log_dir, ck = tmp_path / "logs", str(tmp_path / "ck")
    cfg = TrainConfig(steps=4, batch_size=8, seq_len=16, warmup=2, dp=2, gtp=4, layers=2)
    observe = ObserveConfig(log_dir=str(log_dir), log_every=1)

    def crash_after_step_3(step: int, loss: float, seconds: float) -> None:
        if step == 3:
            raise Crash("simulated crash after step 3")

    with pytest.raises(Crash):  # steps 1-3 logged, checkpoint at step 2
        train(cfg, on_step=crash_after_step_3, progress=False, observe=observe,
              checkpoint=CheckpointConfig(ck, every=2))
    first = _strict_lines(log_dir / METRICS_FILE)
    assert [r["step"] for r in first] == [1, 2, 3]
    capsys.readouterr()
    resumed = train(cfg, progress=False, observe=observe,
                    checkpoint=CheckpointConfig(ck, every=2, resume="auto"))
    assert resumed.first_step == 3
    lines = _strict_lines(log_dir / METRICS_FILE)
    assert [r["step"] for r in lines] == [1, 2, 3, 4]  # step 3 once: the resumed run's
    assert lines[:2] == first[:2]
    assert lines[2]["loss"] == pytest.approx(resumed.losses[0])
    assert "dropped 1 record(s) after step 2" in capsys.readouterr().err
    assert not (log_dir / ".gtp_jax.lock").exists()  # released with the run


def test_a_log_dir_has_one_owner(tmp_path, capsys) -> None:
    log_dir = tmp_path / "logs"
    cfg = TrainConfig(steps=2, batch_size=8, seq_len=16, warmup=1, dp=2, gtp=4, layers=2)
    train(cfg, progress=False, observe=ObserveConfig(log_dir=str(log_dir), log_every=1),
          checkpoint=CheckpointConfig(str(tmp_path / "ck")))
    before = (log_dir / METRICS_FILE).read_text()
    assert len(before.splitlines()) == 2
    # Another run (no checkpoints, or other ones) on the same --log-dir: refused in one
    # line, before anything is built; the file is untouched.
    for checkpoint in ([], ["--checkpoint-dir", str(tmp_path / "other")]):
        capsys.readouterr()
        assert cli_main(["train", "--steps", "2", "--batch", "8", "--seq", "16", "--log-dir",
                         str(log_dir), *checkpoint]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: --log-dir") and (
            "metrics of the run of checkpoint directory" in err and "empty --log-dir" in err)
    assert (log_dir / METRICS_FILE).read_text() == before
    assert not (tmp_path / "other").exists() or not any((tmp_path / "other").iterdir())
    # A run logging there now (a live process holds the lock) is named.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / "busy"
        busy.mkdir()
        (busy / ".gtp_jax.lock").write_text(json.dumps({"pid": holder.pid,
                                                        "host": socket.gethostname()}))
        with pytest.raises(UsageError, match=rf"ObserveConfig\.log_dir .*in use by pid "
                                             rf"{holder.pid}"):
            train(cfg, progress=False, observe=ObserveConfig(log_dir=str(busy)))
    finally:
        holder.kill()
        holder.wait()
