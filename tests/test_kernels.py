"""The kernel breakdown reads JAX (perfetto) and PyTorch (chrome) traces the same way."""

from __future__ import annotations

import gzip
import json

import pytest

from gtp_jax.bench.kernels import breakdown, category, main, read_hlo


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


_HLO = """HloModule jit_step

%fused_add (p0: f32[8]) -> f32[8] {
  ROOT %add.1 = f32[8]{0} add(%p0, %p0)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %loop_add_fusion.5 = f32[16,2048]{1,0} fusion(%a), kind=kLoop, calls=%fused_add, \
metadata={op_name="jit(step)/transpose(jvp())/while/body/add" source_file="/x/model.py" \
source_line=42}
  ROOT %copy.3 = bf16[4,8]{1,0} copy(%loop_add_fusion.5)
}
"""


def test_kernels_are_attributed_to_their_hlo_instructions(tmp_path, capsys) -> None:
    meta = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "Stream #1"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 2,
             "args": {"name": "XLA Ops"}}]
    ops = [("while.1", 0, 1000), ("loop_add_fusion.5", 10, 300), ("copy.3", 400, 100)]
    kernels = [("loop_add_fusion_5", 20, 100), ("loop_add_fusion_5", 150, 60),
               ("memcpy128", 410, 80), ("nvjet_gemm", 600, 200)]
    events = meta + [{"ph": "X", "pid": 7, "tid": 2, "ts": ts, "dur": d, "name": n}
                     for n, ts, d in ops] + [
        {"ph": "X", "pid": 7, "tid": 1, "ts": ts, "dur": d, "name": n} for n, ts, d in kernels]
    hlo = tmp_path / "module_0001.jit_step.sm_9.0a_gpu_after_optimizations.txt"
    hlo.write_text(_HLO)
    (tmp_path / "module_0002.small_after_optimizations.txt").write_text("HloModule x\n")
    b = breakdown(events, steps=2, hlo=read_hlo(tmp_path))
    by_op = {o.op: o for o in b.ops}
    assert by_op["loop_add_fusion.5"].ms == pytest.approx(0.08)    # 160 us over 2 steps
    assert by_op["loop_add_fusion.5"].shape == "f32[16,2048]"
    assert by_op["loop_add_fusion.5"].source == "fusion transpose(jvp())/while/body/add model.py:42"
    assert by_op["copy.3"].category == "copies" and by_op["copy.3"].shape == "bf16[4,8]"
    assert by_op["while.1"].ms == pytest.approx(0.1)                # the GEMM inside the loop
    assert [o.op for o in b.ops] == ["while.1", "loop_add_fusion.5", "copy.3"]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert main([str(path), "--hlo", str(hlo)]) == 0
    assert "| `copy.3` | 0.08 | copies | `bf16[4,8]` | copy |" in capsys.readouterr().out


def test_hlo_folder_without_optimized_dump_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="xla_dump_to"):
        read_hlo(tmp_path)


def test_kernels_without_op_rows_are_matched_to_instructions_by_name(tmp_path) -> None:
    meta = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1,
             "args": {"name": "Stream #14(Compute,Memset)"}}]
    kernels = [("loop_add_fusion_5", 0, 100), ("loop_add_fusion_5", 200, 50),
               ("memcpy128", 300, 30), ("copy_3", 400, 20)]
    events = meta + [{"ph": "X", "pid": 7, "tid": 1, "ts": ts, "dur": d, "name": n}
                     for n, ts, d in kernels]
    path = tmp_path / "hlo.txt"
    path.write_text(_HLO)
    b = breakdown(events, hlo=read_hlo(path))
    by_op = {o.op: o for o in b.ops}
    assert by_op["loop_add_fusion.5"].ms == pytest.approx(0.15)
    assert by_op["loop_add_fusion.5"].shape == "f32[16,2048]"
    assert by_op["copy.3"].shape == "bf16[4,8]"
    assert by_op["memcpy128"].shape == "" and by_op["memcpy128"].category == "copies"
    assert breakdown(events).ops == ()          # nothing to match without HLO text
