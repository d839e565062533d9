"""The time to the first step: the training step is compiled before its first run and the
command line says so ("compiling the training step ...", "compiled in N s (cache hit)"); the
summary, ``metrics.jsonl``, the metrics JSON and the benchmarks report it
(`gtp_jax.base.compile_watch`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax
import pytest
from helpers import cli_env, jax_events

from gtp_jax.base.compile_watch import (
    HIT_EVENT,
    REQUEST_EVENT,
    WRITE_EVENT,
    CompileReport,
    measure_compile,
)
from gtp_jax.train import ObserveConfig, TrainConfig, train
from gtp_jax.train.outputs.metrics_log import METRICS_FILE

COMPILED = re.compile(r"^gtp_jax train: compiled in (\d+\.\d) s(?: \(cache (hit|miss)\b.*\))?$",
                      re.M)


def _events(*names: str) -> None:
    for name in names:
        jax.monitoring.record_event(name)


@pytest.mark.parametrize("events, cache_dir, verdict, written", [
    ((REQUEST_EVENT, HIT_EVENT), "/c", "hit", 0),
    ((REQUEST_EVENT, WRITE_EVENT), "/c", "miss", 1),
    ((REQUEST_EVENT,), "/c", "miss", 0),  # compiled under JAX's minimum time: not written
    ((REQUEST_EVENT, HIT_EVENT, REQUEST_EVENT), "/c", "partial", 0),
    ((), "/c", None, 0),  # no events (another JAX, or nothing compiled): no guess
    ((REQUEST_EVENT,), None, None, 0),  # no cache directory: JAX still records requests
])
def test_the_verdict_follows_jax_s_events(events, cache_dir, verdict, written) -> None:
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    try:
        result, report = measure_compile(lambda: _events(*events) or 7)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert result == 7 and report.seconds >= 0
    assert (report.cache, report.written) == (verdict, written)
    _events(REQUEST_EVENT)  # the listener is gone: later events change nothing
    assert report.to_json() == {"compile_s": report.seconds, "compile_cache": verdict}


def test_describe_names_the_cache_only_where_known() -> None:
    assert CompileReport(12.34).describe() == "compiled in 12.3 s"
    assert CompileReport(2.0, "hit").describe() == "compiled in 2.0 s (cache hit)"
    assert CompileReport(9.0, "miss", 1).describe() == "compiled in 9.0 s (cache miss)"
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    try:
        assert CompileReport(0.5, "miss").describe() == (
            "compiled in 0.5 s (cache miss; not written to the cache: JAX caches programs "
            "that take at least 1 s to compile)")
        assert CompileReport(5.0, "miss").describe() == (
            "compiled in 5.0 s (cache miss; not written to the cache)")
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def test_the_run_reports_its_compile_and_first_step(tmp_path, capsys) -> None:
    """One run: the lines before the loop, the step compiled once (the first call runs it),
    and the time in the result, its summary and JSON, metrics.jsonl and the metrics JSON."""
    with jax_events("/jax/core/compile/backend_compile_duration") as compiles:
        # A shape no other test compiles (jit's in-memory cache would have it).
        result = train(TrainConfig(steps=3, batch_size=8, seq_len=19, warmup=1),
                       observe=ObserveConfig(log_dir=str(tmp_path / "logs"), log_every=5,
                                             metrics_json=str(tmp_path / "m.json")))
    assert compiles.count("jit(step)") == 1  # compiled ahead, not again at the first call
    out = capsys.readouterr().out
    assert "gtp_jax train: compiling the training step ...\n" in out
    match = COMPILED.search(out)
    assert match, out
    assert out.index("compiling the training step") < match.start()
    assert result.compile_s > 0 and float(match.group(1)) == pytest.approx(
        result.compile_s, abs=0.05)
    assert result.first_step_s == pytest.approx(result.compile_s + result.step_times[0])
    summary = result.to_json()
    assert summary["compile_s"] == result.compile_s
    assert summary["first_step_s"] == result.first_step_s
    assert summary["compile_cache"] == result.compile_cache == match.group(2)
    assert f"time to the first step: {result.first_step_s:.1f} s (compile" in result.summary()
    # The first step is logged (log_every=5 would log only the last), with the times.
    lines = [json.loads(x) for x in (tmp_path / "logs" / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 3]
    first = lines[0]
    assert first["compile_s"] == result.compile_s
    assert first["first_step_s"] == pytest.approx(result.first_step_s)
    assert first["compile_cache"] == result.compile_cache
    assert "compile_s" not in lines[1]
    saved = json.loads((tmp_path / "m.json").read_text())["summary"]
    assert saved["first_step_s"] == pytest.approx(result.first_step_s)
    # The library is quiet without a progress display (the same program: nothing compiles).
    train(TrainConfig(steps=3, batch_size=8, seq_len=19, warmup=1), progress=False)
    assert "compil" not in capsys.readouterr().out


def test_a_second_run_reads_its_step_from_the_compile_cache(tmp_path) -> None:
    """Two processes on one --compile-cache directory: the first compiles (a miss, written:
    the minimum compile time is 0 here), the second reads the step back (a hit)."""
    cmd = [sys.executable, "-m", "gtp_jax", "train", "--steps", "2", "--batch", "8", "--seq",
           "18", "--compile-cache", str(tmp_path / "cache"), "--metrics-json"]
    env = cli_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    seen = []
    for run in ("miss", "hit"):
        metrics = tmp_path / f"{run}.json"
        proc = subprocess.run([*cmd, str(metrics)], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        match = COMPILED.search(proc.stdout)
        assert match, proc.stdout
        summary = json.loads(metrics.read_text())["summary"]
        seen.append((match.group(2), summary["compile_cache"]))
        assert 0 < summary["compile_s"] <= summary["first_step_s"] < 300
    assert seen == [("miss", "miss"), ("hit", "hit")]
