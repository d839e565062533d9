"""``--log-dir``: per-step metrics streamed while the run trains (`gtp_jax.train.metrics_log`),
readable while it is alive and kept when it crashes; TensorBoard event files."""

from __future__ import annotations

import io
import json
import struct
import sys

import pytest

from gtp_jax.train import ObserveConfig, TrainConfig, train
from gtp_jax.train.metrics_log import METRICS_FILE, NO_TENSORBOARD, MetricsLog

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

    cfg = TrainConfig(steps=5, batch_size=8, seq_len=16, warmup=2, dp=2, gtp=4)
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
    assert [r["lr"] for r in lines] == [pytest.approx(cfg.lr / 2), pytest.approx(cfg.lr),
                                        pytest.approx(cfg.lr * (0.1 + 0.9 * 0.75))]
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
    from gtp_jax.base.errors import UsageError  # noqa: PLC0415

    with pytest.raises(UsageError, match="ObserveConfig.log_every=0 must be an int >= 1"):
        ObserveConfig(log_every=0)
    with pytest.raises(UsageError, match="ObserveConfig.log_dir must be a non-empty path"):
        ObserveConfig(log_dir="")
