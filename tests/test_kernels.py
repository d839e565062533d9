"""The kernel breakdown reads JAX (perfetto) and PyTorch (chrome) traces the same way."""

from __future__ import annotations

import gzip
import json

import pytest

from gtp_jax.bench.kernels import breakdown, category, main


def _jax_trace() -> list[dict]:
    meta = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "Stream #1"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 2,
             "args": {"name": "XLA Ops"}}]
    kernels = [("sm90_xmma_gemm_bf16", 4000), ("cudnn_fmha_fwd", 1000),
               ("loop_add_fusion", 500), ("wrapped_concatenate", 300),
               ("ncclDevKernel_AllGather_RING_LL", 800), ("fusion_something", 200),
               ("weird_thing", 100)]
    events = [{"ph": "X", "pid": 7, "tid": 1, "ts": 10.0 * i, "dur": dur, "name": name}
              for i, (name, dur) in enumerate(kernels)]
    # A summary row of the same work must not be counted twice.
    events.append({"ph": "X", "pid": 7, "tid": 2, "ts": 0.0, "dur": 9999.0, "name": "dot.1"})
    return meta + events


def _torch_trace() -> list[dict]:
    return [{"ph": "X", "cat": "kernel", "pid": 0, "tid": 7, "ts": 0.0, "dur": dur,
             "name": name, "args": {"device": 0}}
            for name, dur in (("nvjet_tst_gemm", 3000), ("triton_poi_fused_add_0", 600),
                              ("multi_tensor_apply_kernel_adam", 400),
                              ("flash_fwd_kernel", 900))] + [
            {"ph": "X", "cat": "cpu_op", "pid": 1, "tid": 1, "ts": 0.0, "dur": 5e4,
             "name": "aten::mm"}]


def test_categories() -> None:
    assert category("ncclDevKernel_ReduceScatter") == "collectives"
    assert category("sm90_xmma_gemm_bf16bf16") == "gemm"
    assert category("cudnn_generated_fort_native_sdpa") == "attention"
    assert category("memcpy128") == "copies"
    assert category("loop_multiply_fusion") == "fusions/elementwise"
    assert category("zzz") == "other"


def test_jax_trace_per_step_and_gemm_rate() -> None:
    b = breakdown(_jax_trace(), steps=2, gemm_flop_per_step=4e12)
    assert b.per_category_ms["gemm"] == pytest.approx(2.0)          # 4000 us / 2 steps
    assert b.per_category_ms["collectives"] == pytest.approx(0.4)
    assert b.per_category_ms["copies"] == pytest.approx(0.15)
    assert b.per_category_ms["fusions/elementwise"] == pytest.approx(0.35)
    assert b.total_ms == pytest.approx(6900 / 2 / 1e3)              # the summary row is skipped
    assert b.gemm_tflops == pytest.approx(4e12 / 2e-3 / 1e12)
    assert b.top[0] == ("sm90_xmma_gemm_bf16", pytest.approx(2.0), "gemm")


def test_torch_trace(tmp_path, capsys) -> None:
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _torch_trace()}, f)
    assert main([str(path), "--steps", "1"]) == 0
    text = capsys.readouterr().out
    assert "| optimizer | 0.40 |" in text and "| gemm | 3.00 |" in text
    b = breakdown(_torch_trace())
    assert b.total_ms == pytest.approx(4.9)  # cpu ops are not kernels


def test_errors() -> None:
    with pytest.raises(ValueError, match="no GPU kernel"):
        breakdown([{"ph": "X", "pid": 1, "name": "cpu"}])
    with pytest.raises(ValueError, match="device=3"):
        breakdown(_jax_trace(), device=3)
    with pytest.raises(ValueError, match="steps"):
        breakdown(_jax_trace(), steps=0)
