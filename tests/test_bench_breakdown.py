# ruff: noqa: E501  (HLO and live-range texts keep XLA's own long lines)
"""`python -m gtp_jax.bench memory` and `breakdown`: the readers of XLA's buffer assignment and of
a profiler trace, on small texts whose answers are known."""

from __future__ import annotations

import pytest

from gtp_jax.bench.breakdown import step_breakdown, update_instructions
from gtp_jax.bench.memory import allocated_bytes, classify, peak_breakdown, read_instructions

HLO = """\
HloModule jit_step

%fused_computation.1 (param_0: f32[8,4]) -> f32[8,4] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  ROOT %negate.1 = f32[8,4]{1,0} negate(%param_0), metadata={op_name="jit(step)/transpose(jvp())/shard_map/neg"}
}

ENTRY %main (p0: f32[2,4], p1: s32[4,9]) -> f32[2,4] {
  %param.1 = f32[2,4]{1,0} parameter(0), metadata={op_name="state[0]['module']['w'].value"}
  %param.2 = s32[4,9]{1,0} parameter(1), metadata={op_name="batch"}
  %all-gather.3 = f32[8,4]{1,0} all-gather(%param.1), dimensions={0}, metadata={op_name="jit(step)/jvp()/shard_map/all_gather"}
  %fusion.4 = f32[4,8,50]{2,1,0} fusion(%all-gather.3), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(step)/jvp()/shard_map/dot_general"}
  %fusion.5 = f32[4,8,16]{2,1,0} fusion(%all-gather.3), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(step)/jvp()/shard_map/mul"}
  %fusion.6 = f32[8,4]{1,0} fusion(%all-gather.3), kind=kLoop, calls=%fused_computation.1
  %reduce-scatter.7 = f32[2,4]{1,0} reduce-scatter(%fusion.6), dimensions={0}, metadata={op_name="jit(step)/transpose(jvp())/shard_map/psum_scatter"}
  ROOT %add.8 = f32[2,4]{1,0} add(%param.1, %reduce-scatter.7), metadata={op_name="jit(step)/add"}
}
"""

LIVE = """\
HloLiveRange (max 8):
  InstructionSequence:
    0:param.1
    1:param.2
    2:all-gather.3
    3:fusion.4
    4:fusion.5
    5:fusion.6
    6:reduce-scatter.7
    7:add.8
  BufferLiveRange:
    param.1{}:0-8
  Live ranges at 6 (peak):
    param.1{}: 32 bytes (cumulative: 32 bytes)
    param.2{}: 144 bytes (cumulative: 176 bytes)
    all-gather.3{}: 128 bytes (cumulative: 304 bytes)
    fusion.4{}: 6400 bytes (cumulative: 6704 bytes)
    fusion.5{}: 2048 bytes (cumulative: 8752 bytes)
    fusion.6{}: 128 bytes (cumulative: 8880 bytes)
    reduce-scatter.7{}: 32 bytes (cumulative: 8912 bytes)
"""


def test_peak_buffers_land_in_their_categories():
    result = peak_breakdown(LIVE, HLO, weight_elements=frozenset({32}),
                            vocab=frozenset({50}))
    assert result.peak_bytes == 8912
    assert result.phase == "backward"
    assert result.by_category["sharded state"] == 32
    assert result.by_category["batch"] == 144
    assert result.by_category["gathered weights"] == 128
    assert result.by_category["logits and loss"] == 6400
    # made in the forward pass, live at a backward peak: kept for the backward pass
    assert result.by_category["saved activations"] == 2048
    # a nameless fusion takes its body's op name (backward); the reduce-scatter's output too
    assert result.by_category["weight gradients"] == 128 + 32
    assert sum(result.by_category.values()) == result.peak_bytes
    assert result.largest[0][0] == 6400


def test_a_fusion_without_an_op_name_takes_its_body_s():
    inst = read_instructions(HLO)
    assert inst["fusion.6"].op_name == "jit(step)/transpose(jvp())/shard_map/neg"
    assert classify(inst["add.8"], 32, peak_phase="update", weight_elements=frozenset(),
                    vocab=frozenset()) == "optimizer"


def test_a_forward_matmul_result_of_a_weight_s_size_is_an_activation():
    """A GEMM's output kept for the backward pass whose element count equals a weight's
    (tokens x features = rows x columns) is a saved activation, not a gathered weight."""
    gemm = read_instructions(HLO)["fusion.5"].__class__(
        "custom-call", "(bf16[8,4], s8[16])", "jit(step)/jvp()/shard_map/jvp()/dot_general")
    kwargs = dict(weight_elements=frozenset({32}), vocab=frozenset({50}))
    assert classify(gemm, 64, peak_phase="backward", **kwargs) == "saved activations"
    cast = gemm.__class__("fusion", "bf16[8,4]", "jit(step)/jvp()/shard_map/convert_element_type")
    assert classify(cast, 64, peak_phase="backward", **kwargs) == "gathered weights"
    wgrad = gemm.__class__("custom-call", "(f32[8,4], s8[16])",
                           "jit(step)/transpose(jvp())/shard_map/dot_general")
    assert classify(wgrad, 128, peak_phase="backward", **kwargs) == "weight gradients"


def test_update_instructions_are_those_outside_the_passes():
    assert update_instructions(HLO) == frozenset({"add.8"})


def test_a_live_range_text_without_a_peak_is_refused():
    with pytest.raises(ValueError, match="peak"):
        peak_breakdown("HloLiveRange (max 1):\n", HLO)


def test_the_allocated_total_is_read_from_the_usage_report():
    report = "Memory Space: default (color=0)\nTotal bytes: 23859226566 (22.22GiB)\n"
    assert allocated_bytes(report) == 23859226566
    assert allocated_bytes("nothing here") == 0


def _kernel(name, ts, dur, tid=1):
    return {"ph": "X", "pid": 7, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_step_time_splits_into_compute_exposed_collectives_and_idle():
    meta = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "s1"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 2, "args": {"name": "s2"}}]
    events = meta + [
        _kernel("nvjet_sm90_gemm", 0, 1000),                 # GEMM 0-1 ms
        _kernel("ncclDevKernel_AllGather", 500, 1000, 2),   # 0.5-1.5 ms: 0.5 ms exposed
        _kernel("loop_add_fusion_3", 2000, 500),             # the update's kernel, by name
        _kernel("loop_multiply_fusion", 2500, 500),          # elementwise
    ]
    r = step_breakdown(events, steps=1, update_ops=frozenset({"loop_add_fusion.3"}))
    assert r.wall_ms == pytest.approx(3.0)
    assert r.kernel_ms["gemm"] == pytest.approx(1.0)
    assert r.kernel_ms["optimizer"] == pytest.approx(0.5)
    assert r.kernel_ms["elementwise"] == pytest.approx(0.5)
    assert r.collective_ms == pytest.approx(1.0)
    assert r.exposed_ms == pytest.approx(0.5)
    assert r.compute_ms == pytest.approx(2.0)
    assert r.idle_ms == pytest.approx(0.5)  # 1.5-2.0 ms: nothing runs
    assert r.compute_ms + r.exposed_ms + r.idle_ms == pytest.approx(r.wall_ms)


def test_a_trace_without_kernels_is_refused():
    with pytest.raises(ValueError, match="no GPU kernels"):
        step_breakdown([], steps=1)


def test_memory_command_compiles_the_training_step_and_reads_its_peak(tmp_path):
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = tmp_path / "memory.json"
    proc = subprocess.run(
        [sys.executable, "-m", "gtp_jax.bench", "memory", "--preset", "tiny", "--seq", "32",
         "--dp", "2", "--gtp", "4", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["peak_bytes"] > 0
    assert result["by_category"]["sharded state"] > 0
    assert result["allocated_bytes"] >= result["peak_bytes"]
    assert "compiled:" in proc.stdout
