"""The profiler-trace reader behind the 'hidden communication' numbers of the benchmarks."""

from __future__ import annotations

import gzip
import json

import pytest

from gtp_jax.bench.trace import (
    analyze_events,
    exposed_spans,
    find_trace,
    host_transfers,
    intersect,
    load_events,
    trim,
    union,
)


def _meta(pid, name, tid=None, thread=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}}


def _kernel(pid, tid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def _gpu_trace():
    # Device 0: compute on stream 7 over [0, 100) and [150, 200) us; an all-gather on stream
    # 13 over [80, 160) us: 20 us + 10 us of it overlap compute, 50 us are exposed. A summary
    # thread ("XLA Ops") repeats the ops and must not count twice. Host events are ignored.
    return [
        _meta(1, "/device:GPU:0"), _meta(1, "/device:GPU:0", 7, "Stream #7(Compute)"),
        _meta(1, "/device:GPU:0", 13, "Stream #13(Nccl)"),
        _meta(1, "/device:GPU:0", 99, "XLA Ops"), _meta(2, "/host:CPU"),
        _meta(2, "/host:CPU", 1, "python"),
        _kernel(1, 7, "nvjet_tst_gemm", 0, 60), _kernel(1, 7, "loop_fusion_3", 60, 40),
        _kernel(1, 7, "input_reduce_fusion", 150, 50),
        _kernel(1, 13, "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage)", 80, 80),
        _kernel(1, 99, "all-gather-start.1", 0, 500),
        _kernel(2, 1, "PjitFunction(step)", 0, 1000),
    ]


def test_interval_union_and_intersection():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert intersect([(0, 3), (5, 8)], [(2, 6)]) == [(2, 3), (5, 6)]
    assert intersect([(0, 1)], [(1, 2)]) == []


def test_hidden_and_exposed_communication_per_device():
    (r,) = analyze_events(_gpu_trace())
    assert r.device == "/device:GPU:0"
    assert r.comm_ms == pytest.approx(0.080)
    assert r.compute_ms == pytest.approx(0.150)
    assert r.hidden_ms == pytest.approx(0.030)
    assert r.exposed_ms == pytest.approx(0.050)
    assert r.hidden_fraction == pytest.approx(0.375)
    assert r.top_comm[0][0] == "ncclDevKernel_AllGather_RING_LL"


def test_host_only_trace_has_no_devices():
    events = [e for e in _gpu_trace() if e["pid"] == 2]
    assert analyze_events(events) == []


def test_trim_keeps_device_kernels_in_window_and_reads_back(tmp_path):
    kept = trim(_gpu_trace(), max_ms=0.1)
    names = {e["name"] for e in kept if e["ph"] == "X"}
    assert names == {"nvjet_tst_gemm", "loop_fusion_3",
                     "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage)"}
    path = tmp_path / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir()
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": kept}, f)
    assert find_trace(tmp_path) == path
    assert len(analyze_events(load_events(path))) == 1


def test_missing_trace_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="create_perfetto_trace=True"):
        find_trace(tmp_path)


def test_cli_each_summarizes_every_variant_and_writes_excerpts(tmp_path, capsys):
    from gtp_jax.bench.trace import main

    profiles = tmp_path / "prof"
    for variant in ("tp", "tp_overlap"):
        path = profiles / variant / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
        path.parent.mkdir(parents=True)
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": _gpu_trace()}, f)
    (profiles / "empty").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    assert main([str(profiles), "--each", "--excerpt-dir", str(out), "--excerpt-ms", "0.1"]) == 0
    text = capsys.readouterr().out
    assert "## tp (1 steps)" in text and "## tp_overlap (1 steps)" in text
    assert "| /device:GPU:0 | 0.08 | 37.5% | 0.05 |" in text
    assert "empty" in text  # reported, not fatal
    excerpt = load_events(out / "trace_tp_excerpt.json.gz")
    assert {e["name"] for e in excerpt if e["ph"] == "X"} == {
        "nvjet_tst_gemm", "loop_fusion_3",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage)"}


def test_exposed_spans_name_the_collectives_running_alone():
    # Communication alone on the device only over [100, 150) us: one span, 0.05 ms long,
    # starting 0.1 ms after the first kernel, naming the all-gather.
    ((start, length, names),) = exposed_spans(_gpu_trace(), device=0)
    assert start == pytest.approx(0.1) and length == pytest.approx(0.05)
    assert "AllGather" in names
    assert exposed_spans([e for e in _gpu_trace() if e["pid"] == 2]) == []


def test_host_transfers_time_each_direction_duplex_and_hiding():
    # Compute over [0, 100) us; host->device copies [50, 150), device->host [120, 180): 30 us
    # in both directions at once, 50 us of copies under compute, 130 us of copies in all, 80
    # exposed. A collective and a device-to-device copy count as neither; a stream's name
    # (which lists all the work it ran) does not make its kernels copies.
    events = [
        _meta(1, "/device:GPU:0"),
        _meta(1, "/device:GPU:0", 7, "Stream #7(Kernel,MemcpyH2D,MemcpyD2H)"),
        _meta(1, "/device:GPU:0", 8, "Stream #8(MemcpyH2D,MemcpyD2D)"),
        _kernel(1, 7, "nvjet_tst_gemm", 0, 100),
        _kernel(1, 8, "MemcpyH2D", 50, 100), _kernel(1, 8, "MemcpyD2D", 150, 200),
        _kernel(1, 8, "MemcpyD2H", 120, 60), _kernel(1, 7, "ncclDevKernel_AllGather", 300, 50),
    ]
    (r,) = host_transfers(events)
    assert (r.h2d_ms, r.d2h_ms, r.both_ms) == (0.1, 0.06, 0.03)
    assert (r.hidden_ms, r.busy_ms, r.compute_ms) == (0.05, 0.13, 0.1)
    assert r.exposed_ms == pytest.approx(0.08)
