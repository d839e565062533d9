"""The planner on paper (`gtp_jax.plan.paper`, ``plan --on-paper``) and the time model's
inter-node term (`gtp_jax.plan.timing.Topology`): no device is used, nothing is compiled."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from gtp_jax.base.errors import UsageError
from gtp_jax.plan import (
    Calibration,
    Layout,
    Topology,
    load_calibration,
    memory_bound,
    memory_estimate,
    plan_on_paper,
    step_seconds,
)
from gtp_jax.plan.cli import main
from gtp_jax.plan.layout import PlanSpace
from gtp_jax.plan.timing import spans_nodes
from gtp_jax.train.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The measured H200 calibration the docs' on-paper tables use.
H200 = os.path.join(ROOT, "docs", "results", "2026-11-27_2xH200", "plan_top5",
                    "calibration.json")
#: Rates of a GPU-like machine, fixed so the tests do not depend on the file.
RATES = Calibration(device_kind="NVIDIA H200", platform="gpu", devices=8, dtype="bfloat16",
                    gemm_flops=7e14, attention_rates=((2048, 2.6e14), (8192, 4e14)),
                    all_gather_bandwidth=2e11, all_gather_latency=2e-5,
                    reduce_scatter_bandwidth=2e11, reduce_scatter_latency=2e-5,
                    host_bandwidth=4.7e10, memory_bandwidth=3e12, overlap_exposed=0.5,
                    optimizer_rate=1e11)


def _base(preset: str, batch: int, seq: int = 8192) -> TrainConfig:
    from gtp_jax.models import PRESETS  # noqa: PLC0415

    return TrainConfig(preset=preset, batch_size=batch, seq_len=seq, dtype="bfloat16", dp=1,
                       gtp=1, vocab_size=PRESETS[preset].vocab_size)


def test_on_paper_ranks_the_fitting_layouts_by_predicted_time_and_offloads_only_if_needed():
    """llama3-70b on 64 H200s: every fitting layout before every rejected one, the fitting
    ones by predicted step, each within the budget by its estimate, which is never below
    the trainer's bound; on 8 GPUs nothing fits with the optimizer state on the device, so
    the offloaded layouts come first."""
    result = plan_on_paper(_base("llama3-70b", 64), gpus=64, memory_gib=139, cal=RATES)
    fits = [c for c in result.candidates if c.fits]
    assert fits and result.best is fits[0] and result.offload == ""
    assert result.candidates[:len(fits)] == tuple(fits)
    assert [c.step_seconds for c in fits] == sorted(c.step_seconds for c in fits)
    assert all(c.estimate_bytes <= result.budget_bytes for c in fits)
    assert all(c.bound_bytes <= c.estimate_bytes for c in result.candidates)
    rejected = result.candidates[len(fits):]
    assert rejected and all(c.estimate_bytes > result.budget_bytes for c in rejected)
    assert all(c.layout.devices == 64 for c in result.candidates)
    mfu = result.mfu(result.best.step_seconds)
    assert mfu is not None and 0 < mfu < 1

    eight = plan_on_paper(_base("llama3-70b", 8), gpus=8, memory_gib=139, cal=RATES)
    assert eight.offload == "optimizer" and eight.best.layout.offload
    assert not any(c.fits for c in eight.candidates if not c.layout.offload)


def test_estimate_is_at_least_the_bound_and_grows_with_what_remat_saves():
    cfg = Layout(gtp=16, tp=4).apply(_base("llama3-70b", 64))
    by_remat = {r: memory_estimate(dataclasses.replace(cfg, remat=r))["total"]
                for r in ("none", "dots", "full")}
    assert by_remat["full"] < by_remat["dots"] < by_remat["none"]
    for remat, total in by_remat.items():
        assert memory_bound(dataclasses.replace(cfg, remat=remat))["total"] <= total
    offloaded = dataclasses.replace(cfg, remat="full", offload_optimizer=True)
    assert memory_bound(offloaded)["total"] <= memory_estimate(offloaded)["total"] \
        < by_remat["full"]
    # Moments kept on the device count once, beside the units in flight.
    kept = dataclasses.replace(offloaded, offload_exclude=("blocks/mlp",))
    on_device = memory_estimate(dataclasses.replace(cfg, remat="full"))["state"]
    assert memory_estimate(offloaded)["state"] < memory_estimate(kept)["state"] < on_device


def test_axes_span_nodes_by_the_mesh_order():
    """The mesh is (dp, ep, gtp, cp, tp) from outermost to innermost: dp2 x gtp8 keeps each
    gtp group in a node of 8 and sends dp across; gtp8 x tp2 spreads each gtp group over
    16 devices."""
    cfg = TrainConfig(dp=2, gtp=8)
    assert not spans_nodes(cfg, ("gtp",), 8) and spans_nodes(cfg, ("dp",), 8)
    cfg = TrainConfig(dp=1, gtp=8, tp=2)
    assert spans_nodes(cfg, ("gtp",), 8) and not spans_nodes(cfg, ("tp",), 8)
    assert not spans_nodes(cfg, ("gtp",), 16) and not spans_nodes(cfg, ("dp",), 8)


def test_a_gtp_axis_across_nodes_is_slower_and_the_planner_keeps_it_in_a_node():
    base = _base("llama3-8b", 16)
    gtp16 = Layout(gtp=16, remat="dots").apply(base)
    one_node = step_seconds(gtp16, RATES, Topology(16, 25e9))
    two_nodes = step_seconds(gtp16, RATES, Topology(8, 25e9))
    assert two_nodes["gtp"] > one_node["gtp"] == step_seconds(gtp16, RATES)["gtp"]
    assert two_nodes["total"] > one_node["total"]
    # dp across nodes, gtp inside one: the gtp collectives keep the node's rate.
    hybrid = Layout(dp=2, gtp=8, remat="dots").apply(base)
    assert step_seconds(hybrid, RATES, Topology(8, 25e9))["gtp"] == \
        step_seconds(hybrid, RATES)["gtp"]
    space = PlanSpace(mesh={"tp": 1, "cp": 1}, remat=("dots",), loops=("unrolled",))
    slow = plan_on_paper(base, gpus=16, memory_gib=139, cal=RATES, space=space,
                         topology=Topology(8, 5e9))
    fast = plan_on_paper(base, gpus=16, memory_gib=139, cal=RATES, space=space,
                         topology=Topology(16, 5e9))
    assert "gtp" not in slow.best.across_nodes and slow.best.layout.gtp <= 8
    assert fast.best.layout.gtp == 16 and fast.best.across_nodes == ()


def test_calibration_files_load_from_both_forms(tmp_path):
    cal, origin = load_calibration(H200)
    assert cal.device_kind == "NVIDIA H200" and cal.gemm_flops > 5e14 and "H200" in origin
    plan_json = tmp_path / "plan.json"
    plan_json.write_text(json.dumps({"preset": "1b", "calibration": RATES.to_json()}))
    assert load_calibration(str(plan_json)) == (RATES, "measured on 8x NVIDIA H200 (gpu)")


def _cli(capsys, *flags: str) -> tuple[int, str]:
    code = main(["--preset", "llama3-70b", *flags])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(("flags", "needle"), [
    (["--on-paper", "--gpus", "64", "--memory-gib", "139"], "--calibration FILE"),
    (["--on-paper", "--calibration", H200, "--memory-gib", "139"], "--gpus N"),
    (["--on-paper", "--gpus", "64", "--calibration", H200], "--memory-gib GIB"),
    (["--on-paper", "--gpus", "12", "--memory-gib", "139", "--calibration", H200],
     "--gpus-per-node 8"),
    (["--on-paper", "--gpus", "16", "--memory-gib", "139", "--calibration", H200,
      "--gpus-per-node", "0"], "--gpus-per-node 0"),
    (["--on-paper", "--gpus", "16", "--memory-gib", "139", "--calibration", H200,
      "--inter-node-gbps", "-1"], "--inter-node-gbps -1"),
    (["--on-paper", "--gpus", "16", "--memory-gib", "139", "--calibration", "/nonexistent"],
     "--calibration '/nonexistent'"),
    (["--on-paper", "--gpus", "16", "--memory-gib", "139", "--calibration", H200,
      "--calibrate"], "--calibrate"),
    (["--calibration", H200, "--gpus-per-node", "8"], "--on-paper"),
])
def test_on_paper_refuses_bad_input_in_one_line_naming_the_flag(capsys, flags, needle):
    code, err = _cli(capsys, *flags)
    assert code == 2 and err.startswith("error: ") and "\n" not in err and needle in err, err


def test_a_calibration_file_with_a_wrong_field_is_named(capsys, tmp_path):
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({**RATES.to_json(), "gemm_tflops": 1.0}))
    code, err = _cli(capsys, "--on-paper", "--gpus", "8", "--memory-gib", "139",
                     "--calibration", str(bad))
    assert code == 2 and "\n" not in err and "--calibration" in err and "gemm_tflops" in err


def test_on_paper_prints_the_table_and_the_best_command(capsys, tmp_path):
    out_json = tmp_path / "paper.json"
    code = main(["--on-paper", "--preset", "llama3-70b", "--gpus", "16", "--memory-gib", "139",
                 "--seq", "8192", "--batch", "16", "--calibration", H200, "--limit", "3",
                 "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0
    assert "ON PAPER" in out and "calibration: NVIDIA H200" in out and "2 nodes of 8" in out
    assert "best (predicted): python -m gtp_jax train --preset llama3-70b" in out
    data = json.loads(out_json.read_text())
    assert data["on_paper"] and data["vocab"] == 128256 and data["gpus"] == 16
    assert data["candidates"][0]["status"].startswith(("fits", "tight"))


@pytest.mark.parametrize(("call", "needle"), [
    (lambda: plan_on_paper(_base("llama3-8b", 8), gpus=0, memory_gib=139, cal=RATES), "gpus=0"),
    (lambda: plan_on_paper(_base("llama3-8b", 8), gpus=8, memory_gib=-1, cal=RATES),
     "memory_gib=-1"),
    (lambda: plan_on_paper(_base("llama3-8b", 12), gpus=12, memory_gib=139, cal=RATES),
     "gpus_per_node=8"),
    (lambda: Topology(0, 5e10), "Topology.gpus_per_node=0"),
    (lambda: Topology(8, float("nan")), "Topology.inter_node_bandwidth=nan"),
])
def test_library_refusals_name_the_argument(call, needle):
    with pytest.raises(UsageError) as err:
        call()
    assert needle in str(err.value) and "\n" not in str(err.value)
