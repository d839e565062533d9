"""The layout planner (`gtp_jax.plan`): exact memory, the pruning bound, refusal before
compiling, deterministic ranking, ``train --plan auto``.

Memory figures here are the CPU compiler's for the simulated 8-device mesh: the claim
checked is that the planner compiles the very program the trainer runs (same bytes), not
a GPU figure.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import cli_env

import gtp_jax
import gtp_jax.plan.memory as plan_memory
import gtp_jax.plan.planner as planner
import gtp_jax.train.loop as train_loop
from gtp_jax.__main__ import main
from gtp_jax.base.errors import UsageError
from gtp_jax.models import lm_loss
from gtp_jax.plan import (
    Calibration,
    Layout,
    MemoryFigure,
    PlanSpace,
    abstract_train_state,
    compiled_memories,
    compiled_memory,
    format_table,
    keep_on_device,
    keep_what_fits,
    memory_bound,
    plan,
    plan_fitting,
    timing,
)
from gtp_jax.plan.cli import auto_layout
from gtp_jax.plan.layout import enumerate_layouts
from gtp_jax.train import TrainConfig
from gtp_jax.train.config import make_optimizer, model_config, resolve_auto
from gtp_jax.train.loop import build_model_and_optimizer
from gtp_jax.train.outputs.observe import DeviceMemoryError
from gtp_jax.train.step.memory import (
    check_memory_fits,
    param_sizes,
    pinned_host_bound,
    resident_params,
)
from gtp_jax.train.step.train_step import TrainStep, step_program

BASE = TrainConfig(preset="tiny", batch_size=8, seq_len=32, steps=2, warmup=1, dp=1, gtp=1)
#: The layout most tests share (its compiled figure is cached after the first test).
L1 = Layout(dp=2, gtp=4, remat="none", loop="unrolled")
#: Fixed rates, so rankings do not depend on this machine's timings.
FIXED = Calibration(device_kind="cpu", platform="cpu", devices=8, dtype="float32",
                    gemm_flops=5e10, attention_rates=((256, 1e10),), all_gather_bandwidth=1e9,
                    all_gather_latency=1e-4, reduce_scatter_bandwidth=1e9,
                    reduce_scatter_latency=1e-4, host_bandwidth=1e9)
TRAIN_FLAGS = ["--steps", "2", "--batch", "8", "--seq", "32", "--warmup", "1"]


@pytest.fixture
def fixed_rates(tmp_path, monkeypatch):
    """A calibration cache holding `FIXED` for this machine (nothing is measured)."""
    monkeypatch.setenv(timing.CACHE_ENV, str(tmp_path))
    with open(timing.cache_path(), "w") as f:
        json.dump({timing._cache_key("float32"): FIXED.to_json()}, f)


#: Partial offload: the MLP's down projection keeps its moments on the device.
PARTIAL = dataclasses.replace(L1, offload=True, offload_exclude=("mlp/down",))


@pytest.mark.parametrize("layout", [L1, PARTIAL], ids=["on-device", "partial-offload"])
def test_predicted_memory_equals_the_compiled_memory_of_the_trained_program(layout):
    cfg = layout.apply(BASE)
    predicted = compiled_memory(cfg)
    model, optimizer = build_model_and_optimizer(cfg)
    loss_fn = functools.partial(lm_loss, aux_weight=model_config(cfg).moe_aux_weight)
    step = TrainStep(model, optimizer, loss_fn)
    traced = step.traces  # the planner's lowering traced this very program
    tokens = np.random.default_rng(0).integers(0, 256, (8, 33), dtype=np.int32)
    # Placed as the trainer places its batches (`gtp_jax.train.loop`): the step's arguments
    # are then the planner's, so JAX reuses its trace, lowering and compiled executable
    # (`train --plan auto` does not compile the step twice, and runs the program planned).
    tokens = jax.device_put(tokens, gtp_jax.data_sharding(model.mesh))
    for _ in range(2):
        loss = float(step(tokens)["loss"])
    assert np.isfinite(loss)
    assert step.traces == traced
    trained = MemoryFigure.of(step_program(step.graphdef, loss_fn, offload=layout.offload).lower(
        step.state, tokens).compile())
    assert predicted == trained  # every field, in bytes
    assert predicted.peak == (trained.argument + trained.output - trained.alias
                              + trained.temp + trained.generated_code)


def test_concurrent_compiles_give_each_layout_its_own_figure_and_error():
    # Compiled together on threads: each figure is the one compiled alone, in the order
    # asked, a repeated layout is compiled once, and a layout the devices cannot hold gives
    # its error in its place instead of failing the others.
    other = Layout(gtp=8, remat="full", loop="scanned")
    bad = BASE  # one device of the eight
    plan_memory._CACHE.pop(plan_memory._key(other.apply(BASE)), None)
    results = compiled_memories([L1.apply(BASE), bad, other.apply(BASE), L1.apply(BASE)])
    assert isinstance(results[1], ValueError) and "devices" in str(results[1]), results[1]
    assert results[0] is results[3]
    assert results[0] == compiled_memory(L1.apply(BASE))
    plan_memory._CACHE.pop(plan_memory._key(other.apply(BASE)))
    assert results[2] == compiled_memory(other.apply(BASE))  # compiled again, alone
    assert results[0].peak != results[2].peak


@pytest.mark.parametrize("layout,accum", [(L1, 1), (Layout(gtp=8, remat="full", loop="scanned"), 1),
                                          (L1, 2), (PARTIAL, 1)],
                         ids=lambda v: v.describe() if isinstance(v, Layout) else f"accum{v}")
def test_bound_never_exceeds_the_compiled_peak(layout, accum):
    cfg = dataclasses.replace(layout.apply(BASE), grad_accum=accum, batch_size=8 * accum)
    bound = memory_bound(cfg)
    peak = compiled_memory(cfg).peak
    assert 0 < bound["total"] <= peak, (bound, peak)
    # Not vacuous: within 5x of the peak even for this tiny model, whose float32
    # temporaries (CPU compile) outweigh its 0.47M parameters' state. (The CPU backend's
    # figure also counts an offloaded state's host buffers, and depends on XLA's CPU
    # scheduler: the memory-ordered one gtp_jax sets for speed peaks 3.75 MB on the scanned
    # remat=full layout, the concurrency-ordered one 2.95 MB, against a bound of 0.94 MB.)
    assert bound["total"] + pinned_host_bound(cfg) >= peak / 5, (bound, peak)


@pytest.mark.parametrize("preset", ["llama3-8b", "llama3.2-1b", "1b"])
def test_bound_counts_the_state_the_trainer_builds(preset):
    # Parameters and moments as the model has them (grouped-query attention's smaller k/v
    # projections): never more than the sharded state the trainer places on a device
    # (built abstractly: nothing is allocated or compiled).
    cfg = TrainConfig(preset=preset, batch_size=8, seq_len=64, dp=1, gtp=8)
    _, state, _ = abstract_train_state(cfg)
    placed = 0
    for _, var in nnx.to_flat_state(state):
        value = var.get_value()
        if value.ndim:  # params and moments (float32); the step count is a scalar
            placed += int(np.prod(value.sharding.shard_shape(value.shape))) * 4
    bound = memory_bound(cfg)
    assert bound["params"] + bound["optimizer"] <= placed
    assert bound["params"] + bound["optimizer"] >= 0.95 * placed  # not vacuous


def test_the_trainer_refuses_no_layout_that_fits():
    # The trainer's pre-flight check is the planner's bound: a limit at the compiled peak
    # passes it, one under the bound does not.
    cfg = L1.apply(BASE)
    peak = compiled_memory(cfg).peak
    assert check_memory_fits(cfg, bytes_limit=peak)["total"] <= peak
    with pytest.raises(DeviceMemoryError, match=r"needs at least .* GiB per device"):
        check_memory_fits(cfg, bytes_limit=memory_bound(cfg)["total"] - 1)


def test_scanned_loop_pays_its_residual_copies():
    # One time term separates the loops: the scanned loop writes each layer's saved
    # activations into stacks and reads them back (2 x bytes / memory bandwidth).
    cal = dataclasses.replace(FIXED, memory_bandwidth=1e11)
    times = {}
    for remat in ("full", "dots", "none"):
        for loop in ("unrolled", "scanned"):
            cfg = Layout(dp=8, remat=remat, loop=loop).apply(BASE)
            times[remat, loop] = timing.step_seconds(cfg, cal)
    mc = model_config(Layout(dp=8, remat="dots").apply(BASE))
    tokens = BASE.batch_size * BASE.seq_len / 8
    want = 2 * tokens * mc.n_layers * timing._saved_per_token(mc) * 4 / 1e11  # float32 on CPU
    assert times["dots", "scanned"]["loop"] == pytest.approx(want, rel=1e-12)
    assert times["dots", "unrolled"]["loop"] == 0
    assert (times["dots", "scanned"]["total"] - times["dots", "unrolled"]["total"]
            == pytest.approx(want, rel=1e-9))
    assert 0 < times["full", "scanned"]["loop"] < want < times["none", "scanned"]["loop"]


def _tp_group_collectives(hlo: str, op: str, size: int) -> int:
    """How many `op` instructions of `hlo` run over replica groups of `size` devices (any
    of XLA's three ways to print the groups)."""
    count = 0
    for line in hlo.splitlines():
        if not re.search(rf"= \S+ {op}(-start)?\(", line):
            continue
        listed = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
        iota = re.search(r"replica_groups=\[\d+,(\d+)\]<=", line)
        mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
        if listed:
            width = len(listed.group(1).split(","))
        elif iota:
            width = int(iota.group(1))
        elif mesh:
            sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
            width = int(np.prod([int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh.group(2))]))
        else:
            raise AssertionError(f"replica groups not understood: {line[:200]}")
        count += width == size
    return count


@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_tp_collectives_are_those_the_compiled_step_runs(remat):
    # The time model charges tp's activation collectives per layer, the recomputed ones
    # included; the compiled bfloat16 program (what a GPU trains) of the layout (tp over 2
    # devices, dp over 4) has them. jaxlib before 0.11 merges the backward's gathers of the
    # saved chunks with the forward's under "none" (2 per layer fewer, the gathered
    # sequence kept from the forward to the backward pass).
    cfg = Layout(dp=4, tp=2, remat=remat, loop="unrolled").apply(
        dataclasses.replace(BASE, dtype="bfloat16", layers=2))
    hlo = plan_memory._lowered_step(cfg).compile().as_text()
    layers = model_config(cfg).n_layers
    gathers, scatters = timing.tp_collectives_per_layer(remat)
    merged = 2 if remat == "none" and jax.__version_info__ < (0, 11) else 0
    assert _tp_group_collectives(hlo, "all-gather", 2) == (gathers - merged) * layers
    assert _tp_group_collectives(hlo, "reduce-scatter", 2) == scatters * layers


def test_context_parallel_layouts_pay_the_gradient_all_reduce():
    # cp splits the sequence, not the weights: each cp replica's gradients are summed, as
    # over dp. Slower reductions must cost a cp layout as much as a dp layout of the same
    # replicas (the ring's K/V passes are all-gathers and stay the same).
    slow = dataclasses.replace(FIXED, all_gather_bandwidth=FIXED.all_gather_bandwidth / 2,
                               reduce_scatter_bandwidth=FIXED.reduce_scatter_bandwidth / 2)
    ring = dataclasses.replace(FIXED, reduce_scatter_bandwidth=FIXED.reduce_scatter_bandwidth / 2)
    cp = Layout(gtp=4, cp=2, remat="dots", loop="unrolled").apply(BASE)
    dp = Layout(gtp=4, dp=2, remat="dots", loop="unrolled").apply(BASE)
    cost = {name: timing.step_seconds(cfg, slow)["other"] - timing.step_seconds(cfg, FIXED)["other"]
            for name, cfg in (("cp", cp), ("dp", dp))}
    assert cost["dp"] > 0
    rs_cost = (timing.step_seconds(cp, ring)["other"] - timing.step_seconds(cp, FIXED)["other"])
    assert rs_cost == pytest.approx(timing.step_seconds(dp, ring)["other"]
                                    - timing.step_seconds(dp, FIXED)["other"], rel=1e-9)
    assert rs_cost > 0 and cost["cp"] > cost["dp"]  # and the ring's gathers on top


def test_optimizer_update_costs_the_shard_at_the_measured_rate():
    cfg = Layout(dp=2, gtp=4, remat="dots", loop="unrolled").apply(BASE)
    shard = model_config(cfg).num_params() / 4
    fast = timing.step_seconds(cfg, dataclasses.replace(FIXED, optimizer_rate=2e9))
    slow = timing.step_seconds(cfg, dataclasses.replace(FIXED, optimizer_rate=1e9))
    assert slow["other"] - fast["other"] == pytest.approx(shard / 2e9, rel=1e-9)


def test_overlapped_gathers_pay_the_measured_exposed_fraction():
    cfg = Layout(gtp=8, remat="dots", loop="prefetch").apply(BASE)
    hidden = timing.step_seconds(cfg, FIXED)
    half = timing.step_seconds(cfg, dataclasses.replace(FIXED, overlap_exposed=0.5))
    assert hidden["gtp"] > 0 and hidden["compute"] > 0
    assert half["total"] - hidden["total"] == pytest.approx(
        0.5 * min(hidden["compute"], hidden["gtp"]), rel=1e-9)
    plain = timing.step_seconds(Layout(gtp=8, remat="dots", loop="scanned").apply(BASE), FIXED)
    assert plain["total"] == pytest.approx(  # the plain scanned loop: back to back
        plain["compute"] + plain["gtp"] + plain["other"] + plain["loop"], rel=1e-12)


def test_calibration_times_collectives_inside_a_program():
    # In its own process: the calibration runs collectives beside GEMMs on the simulated
    # devices, which the other tests of this worker should not share a runtime with.
    code = ("import json, dataclasses; from gtp_jax.plan import timing; t = {}; "
            "c = dataclasses.asdict(timing.measure('float32', timings=t)); "
            "print(json.dumps(sorted(t))); print(json.dumps(c))")
    env = cli_env()
    env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    cal = Calibration(**json.loads(lines[-1]))
    # What each part took, for a calibration that takes long (printed by `plan`).
    assert json.loads(lines[-2]) == sorted(["gemm", "attention", "memory", "optimizer", "ag",
                                            "rs", "exposed", "host"])
    assert cal.devices == 8 and cal.platform == "cpu"
    for rate in (cal.gemm_flops, *dict(cal.attention_rates).values(), cal.memory_bandwidth,
                 cal.host_bandwidth, cal.all_gather_bandwidth, cal.reduce_scatter_bandwidth,
                 cal.optimizer_rate):
        assert 0 < rate < float("inf")
    assert cal.all_gather_latency >= 0 and cal.reduce_scatter_latency >= 0
    assert 0 <= cal.overlap_exposed <= 1


def test_ranking_is_deterministic_and_by_predicted_time():
    space = PlanSpace(mesh={"dp": 2, "gtp": 4}, remat=("none",),
                      loops=("unrolled", "scanned"), offload=(False, True))
    first = plan(BASE, space=space, top=1, cal=FIXED)
    second = plan(BASE, space=space, top=1, cal=FIXED)
    assert first.candidates == second.candidates
    assert first.best.layout == L1  # overlapped gathers, state on the device
    times = [c.step_seconds for c in first.candidates]
    assert times == sorted(times)
    assert [c.status for c in first.candidates] == ["fits"] + ["not compiled"] * 3


@pytest.mark.parametrize("backend,batches", [("cpu", [1, 1, 1, 1]), ("gpu", [3, 1])])
def test_compile_batches_are_as_wide_as_the_compiles_that_run_at_once(monkeypatch, backend,
                                                                       batches):
    # top=1 under a budget that the three fastest layouts exceed: on a GPU host the first
    # batch compiles 3 at once (CONCURRENT_COMPILES), not one after another; on the CPU
    # backend one at a time. The compiler is faked: the figures, not the compiles, matter.
    monkeypatch.setattr(planner.jax, "default_backend", lambda: backend)
    monkeypatch.setattr(planner, "pinned_pool_bytes", lambda: 2**60)
    monkeypatch.setattr(planner, "available_host_bytes", lambda: None)
    seen: list[int] = []

    def fake_compiled(cfgs):
        seen.append(len(cfgs))
        done = sum(seen) - len(cfgs)
        return [MemoryFigure(0, 0, 0, (2 if done + i < 3 else 0) * 2**30, 0)
                for i in range(len(cfgs))]

    monkeypatch.setattr(planner, "compiled_memories", fake_compiled)
    space = PlanSpace(mesh={"dp": 2, "gtp": 4}, remat=("none",),
                      loops=("unrolled", "scanned"), offload=(False, True))
    result = plan(BASE, space=space, top=1, cal=FIXED, memory_gib=1.0)
    assert seen == batches
    assert [c.status for c in result.candidates][0] == "fits"
    assert sum(c.status.startswith("rejected: compiled") for c in result.candidates) == 3


def _fake_compiles(monkeypatch, device_gib: float, offloaded_gib: float,
                   master_gib: float | None = None) -> list[bool]:
    """Fakes the compiler: a peak of `device_gib` with the optimizer state on the device,
    `offloaded_gib` offloaded, `master_gib` with the master weights offloaded too (None:
    as offloaded); returns the offload flags of the configs compiled."""
    compiled: list[bool] = []

    def gib(cfg) -> float:
        if cfg.offload_master_weights and master_gib is not None:
            return master_gib
        return offloaded_gib if cfg.offload_optimizer else device_gib

    def fake_compiled(cfgs):
        compiled.extend(cfg.offload_optimizer for cfg in cfgs)
        # Moments kept on the device add their bytes (float32, split over gtp).
        return [MemoryFigure(0, 0, 0, int(gib(cfg) * 2**30
                                          + 2 * 4 * resident_params(cfg) // cfg.gtp), 0)
                for cfg in cfgs]

    monkeypatch.setattr(planner, "compiled_memories", fake_compiled)
    return compiled


def test_offload_is_planned_only_when_nothing_fits_on_the_device(monkeypatch):
    space = PlanSpace(mesh={"dp": 2, "gtp": 4}, remat=("none",), loops=("unrolled",))
    compiled = _fake_compiles(monkeypatch, device_gib=2.0, offloaded_gib=0.5)
    roomy = plan_fitting(BASE, space=space, top=1, cal=FIXED, memory_gib=4.0)
    assert not roomy.best.layout.offload and not roomy.offload_fallback
    assert compiled == [False]  # nothing offloaded was even compiled

    tight = plan_fitting(BASE, space=space, top=1, cal=FIXED, memory_gib=1.0)
    assert tight.best.layout.offload and tight.offload_fallback
    # First the layout that keeps what fits of the state on the device (all of this tiny
    # model's), then the fully offloaded one: it moves more bytes per step.
    assert [c.layout.offload for c in tight.candidates] == [True, True, False]
    kept = tight.candidates[0]
    assert kept.layout.offload_exclude and not tight.candidates[1].layout.offload_exclude
    assert kept.step_seconds < tight.candidates[1].step_seconds
    assert kept.fits and kept.peak_bytes <= 2**30
    assert tight.candidates[2].status == "rejected: compiled 2.00 GiB > 1.00 GiB"
    assert "no layout fits with the optimizer state on the device" in format_table(tight)

    hopeless = plan_fitting(BASE, space=space, top=1, cal=FIXED, memory_gib=0.25)
    assert hopeless.best is None and not hopeless.offload_fallback
    with pytest.raises(UsageError, match="PlanSpace.offload"):
        plan_fitting(BASE, space=PlanSpace(offload=(True,)), cal=FIXED)


def test_master_weights_are_offloaded_only_when_nothing_fits_offloaded(monkeypatch):
    space = PlanSpace(mesh={"dp": 2, "gtp": 4}, remat=("none",), loops=("unrolled",))
    _fake_compiles(monkeypatch, device_gib=2.0, offloaded_gib=1.5, master_gib=0.5)
    # Room for the offloaded state: master weights stay on the device.
    offloaded = plan_fitting(BASE, space=space, top=1, cal=FIXED, memory_gib=1.75)
    assert offloaded.best.layout.offload and not offloaded.best.layout.master
    # Room only with the master weights offloaded too: those first, then the others.
    tight = plan_fitting(BASE, space=space, top=1, cal=FIXED, memory_gib=1.0)
    assert tight.offload_fallback
    assert [(c.layout.offload, c.layout.master) for c in tight.candidates] == [
        (True, True), (True, False), (False, False)]
    best = tight.best.layout
    assert best.apply(BASE).offload_master_weights
    assert "--offload-optimizer --offload-master-weights" in best.flags()
    assert "float32 master weights in host memory" in format_table(tight)
    # Master weights cost host transfers: predicted slower than the offloaded layout.
    assert tight.candidates[0].step_seconds > tight.candidates[1].step_seconds
    hopeless = plan_fitting(BASE, space=space, top=1, cal=FIXED, memory_gib=0.25)
    assert hopeless.best is None and not hopeless.offload_fallback
    with pytest.raises(UsageError, match="master"):
        plan_fitting(BASE, space=PlanSpace(master=(True,)), cal=FIXED)
    with pytest.raises(UsageError, match="Layout.master needs offload"):
        Layout(master=True)


def test_plan_auto_offloads_only_a_run_that_does_not_fit_otherwise(monkeypatch, capsys,
                                                                  fixed_rates):
    _fake_compiles(monkeypatch, device_gib=2.0, offloaded_gib=0.5)
    fixed = {"dp": 2, "gtp": 4, "remat": "none", "unroll_layers": True}
    cfg = auto_layout(BASE, fixed, 4.0)
    assert not cfg.offload_optimizer
    cfg = auto_layout(BASE, fixed, 1.0)
    assert cfg.offload_optimizer
    assert "nothing fits with the optimizer state on the device" in capsys.readouterr().out
    # The user's own choice is kept: no fallback.
    with pytest.raises(UsageError, match="no layout fits in 1.00 GiB per device;"):
        auto_layout(BASE, {**fixed, "offload_optimizer": False}, 1.0)


def test_partial_offload_keeps_the_most_state_that_fits_and_refits_an_overshoot(monkeypatch):
    cfg = dataclasses.replace(L1, offload=True).apply(BASE)
    sizes = dict(param_sizes(model_config(resolve_auto(cfg))))
    # Moments' bytes per device: float32, split like the weights over gtp (dp replicates).
    per = {p: 2 * 4 * n / cfg.gtp for p, n in sizes.items()}
    spare = int(0.6 * sum(per.values()))
    keep = keep_on_device(cfg, spare)
    chosen = [p for p in sizes if f"^{re.escape(p)}$" in keep]
    used = sum(per[p] for p in chosen)
    assert 0 < used <= spare
    # Nothing left out would still fit (the choice is a maximal subset under the spare).
    assert all(used + per[p] > spare for p in sizes if p not in chosen)
    # The patterns name exactly the chosen parameters, and the bound counts them.
    partial = dataclasses.replace(cfg, offload_exclude=keep)
    assert resident_params(partial) == sum(sizes[p] for p in chosen)
    assert pinned_host_bound(partial) == pinned_host_bound(cfg) - 2 * 4 * sum(
        sizes[p] for p in chosen) // cfg.gtp
    assert memory_bound(partial)["total"] > memory_bound(cfg)["total"]
    assert keep_on_device(cfg, 0) == ()

    # A choice that compiles over the budget (here: a tenth of the state's bytes more than
    # its moments) is tried again keeping that much less, and only a choice that fits is
    # offered.
    calls: list[tuple[str, ...]] = []
    extra = int(0.1 * sum(per.values()))

    def fake_compiled(cfgs):
        calls.extend(c.offload_exclude for c in cfgs)
        return [MemoryFigure(0, 0, 0, int(0.5 * 2**30) + 2 * 4 * resident_params(c) // c.gtp
                             + (extra if c.offload_exclude else 0), 0) for c in cfgs]

    monkeypatch.setattr(planner, "compiled_memories", fake_compiled)
    space = PlanSpace(mesh={"dp": 2, "gtp": 4}, remat=("none",), loops=("unrolled",),
                      offload=(True,))
    budget = (int(0.5 * 2**30) + spare) / 2**30
    result = keep_what_fits(plan(BASE, space=space, top=1, cal=FIXED, memory_gib=budget), 1)
    assert len(calls) == 3  # the offloaded layout, then its choice twice
    kept = [resident_params(dataclasses.replace(cfg, offload_exclude=c)) for c in calls]
    assert calls[0] == () and 0 < kept[2] < kept[1]
    assert result.best.layout.offload_exclude == calls[2]
    assert result.best.peak_bytes <= result.budget_bytes
    assert "--offload-exclude" in result.best.layout.flags()


def test_offloaded_layouts_over_the_pinned_host_pool_are_rejected_without_compiling(
        monkeypatch):
    # On a GPU host (the backend is faked: the CPU backend has no pinned pool) an offloaded
    # state larger than XLA's pinned host pool is rejected by its bound; the on-device
    # layouts are unaffected. (The fake reaches every module: the attention is set to XLA's,
    # which a faked GPU backend would otherwise resolve to cuDNN's on CPU devices.)
    monkeypatch.setattr(planner.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(planner, "pinned_pool_bytes", lambda: 1024)
    monkeypatch.setattr(planner, "available_host_bytes", lambda: None)
    space = PlanSpace(mesh={"dp": 2, "gtp": 4}, remat=("none",), loops=("unrolled",),
                      offload=(False, True))
    result = plan(dataclasses.replace(BASE, attention="xla"), space=space, top=1, cal=FIXED,
                  memory_gib=1000.0)
    status = {c.layout.offload: c.status for c in result.candidates}
    assert status[False] == "fits"
    assert status[True].startswith("rejected: host: the offloaded optimizer state needs")
    assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=1" in status[True]


def _refuse_training(monkeypatch):
    def no_step(*args, **kwargs):
        raise AssertionError("the training step was built")

    monkeypatch.setattr(train_loop, "TrainStep", no_step)
    monkeypatch.setattr(train_loop, "build_model_and_optimizer", no_step)


def test_layout_over_the_bound_is_refused_without_compiling(monkeypatch, capsys, fixed_rates):
    _refuse_training(monkeypatch)
    compiles = []
    monkeypatch.setattr(plan_memory, "step_program",
                        lambda *a, **k: compiles.append(a) or pytest.fail("compiled"))
    flags = ["--dp", "2", "--gtp", "4", "--remat", "none", "--unroll-layers",
             "--no-offload-optimizer", "--memory-gib", "0.0001"]
    assert main(["train", "--plan", "auto", *TRAIN_FLAGS, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --plan auto: no layout fits")
    for flag in ("--batch", "--seq", "--memory-gib", "--dp", "--remat"):
        assert flag in err
    assert not compiles


def test_layout_over_the_compiled_peak_is_refused_before_training(monkeypatch, capsys,
                                                                  fixed_rates):
    cfg = L1.apply(BASE)
    bound, peak = memory_bound(cfg)["total"], compiled_memory(cfg).peak
    _refuse_training(monkeypatch)
    budget = (bound + peak) / 2 / 2**30  # passes the bound, not the compiled figure
    flags = ["--dp", "2", "--gtp", "4", "--remat", "none", "--unroll-layers",
             "--no-offload-optimizer", "--memory-gib", repr(budget)]
    assert main(["train", "--plan", "auto", *TRAIN_FLAGS, *flags]) == 2
    assert "no layout fits" in capsys.readouterr().err


def test_plan_command_prints_the_ranked_table_and_the_command_to_train(capsys, tmp_path,
                                                                         fixed_rates):
    path = tmp_path / "plan.json"
    argv = ["plan", "--preset", "tiny", "--layers", "1", "--gpus", "8", "--seq", "32",
            "--batch", "8", "--top", "1", "--limit", "4", "--json", str(path),
            "--dtype", "float32", "--compile-cache", "off"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"planned in [\d.]+ s: rates [\d.]+ s .*, \d+ layouts compiled in", out)
    best = [line for line in out.splitlines() if line.startswith("best: ")]
    # Every flag that changes the planned step is in the command (a dtype left out would
    # train another program on another backend's default).
    assert best and best[0].startswith(
        "best: python -m gtp_jax train --preset tiny --layers 1 --batch 8 --seq 32 "
        "--dtype float32 --compile-cache off ")
    saved = json.loads(path.read_text())
    fits = [c for c in saved["candidates"] if c["status"] == "fits"]
    assert fits and best[0].endswith(fits[0]["flags"])
    # The layers replaced are the model planned: less memory than the preset's 2 layers.
    layout = Layout(**fits[0]["layout"])
    assert fits[0]["bound_bytes"] == memory_bound(
        dataclasses.replace(layout.apply(BASE), layers=1))["total"]
    assert fits[0]["bound_bytes"] < memory_bound(layout.apply(BASE))["total"]


def test_train_after_plan_reads_the_plans_compiled_step_from_the_compile_cache(tmp_path,
                                                                              fixed_rates):
    # Two processes, as a user runs them: `plan`, then the `train` command it printed. With
    # a compile cache the run's step is the planner's executable read back (a GPU compile
    # can autotune to other kernels, so a second compile may not have the planned peak):
    # the run adds no step program to the cache.
    cache = tmp_path / "cache"
    common = ["--preset", "tiny", *TRAIN_FLAGS, "--compile-cache", str(cache)]
    env = cli_env()

    def run(*args):
        proc = subprocess.run([sys.executable, "-m", "gtp_jax", *args, *common],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    out = run("plan", "--top", "1", "--memory-gib", "1")
    flags = re.search(r"^best: python -m gtp_jax train .*?(--dp .*)$", out, re.M).group(1)
    steps = sorted(p.name for p in cache.glob("jit_step-*-cache"))
    assert len(steps) == 1
    run("train", *flags.split())
    assert sorted(p.name for p in cache.glob("jit_step-*-cache")) == steps


def test_compile_cache_directory_precedence(tmp_path, monkeypatch):
    from gtp_jax.base import compile_cache

    monkeypatch.setattr(compile_cache, "DEFAULT_DIR", str(tmp_path / "default"))
    own, jax_dir = str(tmp_path / "own"), str(tmp_path / "jax")
    pick = compile_cache.compile_cache_dir
    assert pick(str(tmp_path / "flag"), {"GTP_JAX_COMPILE_CACHE": own}) == str(tmp_path / "flag")
    assert pick("off", {"GTP_JAX_COMPILE_CACHE": own}) is None
    # "none", as other flags spell nothing, is no cache too (not a folder named "none").
    monkeypatch.chdir(tmp_path)
    assert pick("none", {}) is None and pick("None", {}) is None
    assert not (tmp_path / "none").exists() and not (tmp_path / "None").exists()
    assert pick(None, {"GTP_JAX_COMPILE_CACHE": own, "JAX_COMPILATION_CACHE_DIR": jax_dir}) == own
    assert pick(None, {"GTP_JAX_COMPILE_CACHE": "OFF"}) is None
    assert pick(None, {"JAX_COMPILATION_CACHE_DIR": jax_dir}) is None  # JAX reads its own
    assert pick(None, {}) == str(tmp_path / "default")
    assert (tmp_path / "default").is_dir()
    # A default that cannot be made (a read-only home) means no cache, not a refused run;
    # a directory the user named must work.
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(compile_cache, "DEFAULT_DIR", str(tmp_path / "file" / "cache"))
    assert pick(None, {}) is None
    with pytest.raises(UsageError, match="GTP_JAX_COMPILE_CACHE"):
        pick(None, {"GTP_JAX_COMPILE_CACHE": str(tmp_path / "file" / "cache")})


def test_compile_cache_flag_is_checked_before_anything_runs(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["train", "--preset", "tiny", *TRAIN_FLAGS, "--compile-cache",
                 str(blocker / "cache")]) == 2
    err = capsys.readouterr().err
    assert "--compile-cache" in err and "cannot be created" in err


def test_plan_auto_trains_with_the_top_layout(capsys, fixed_rates):
    flags = ["--dp", "2", "--gtp", "4", "--remat", "none", "--unroll-layers"]
    assert main(["train", "--plan", "auto", *TRAIN_FLAGS, *flags]) == 0
    out = capsys.readouterr().out
    assert f"--plan auto chose {L1.describe()} (" in out
    assert "mesh dp=2 ep=1 gtp=4 tp=1 on 8" in out


def test_memory_gib_needs_plan_auto(capsys):
    assert main(["train", *TRAIN_FLAGS, "--memory-gib", "1"]) == 2
    assert "--memory-gib needs --plan auto" in capsys.readouterr().err


def test_offload_lowers_the_bound_by_the_optimizer_state():
    on = memory_bound(dataclasses.replace(L1, offload=True).apply(BASE))
    off = memory_bound(L1.apply(BASE))
    # Offloaded, the moments of one streamed unit (the largest: a weight that is not
    # layer-stacked, or one layer of the stacked ones) stay: less than all weights'.
    assert 0 < on["optimizer"] < off["optimizer"]
    # ... and only while their weight is updated (after the clipping, the forward's
    # activations freed): the bound drops by at least most of the moments.
    assert off["total"] - on["total"] >= off["optimizer"] - on["optimizer"] > 0


def test_one_wide_gtp_layouts_take_no_gather_format():
    # Over gtp=1 no gather format applies (the trainer gathers nothing): the formats collapse
    # into one candidate per remat and loop, where gtp > 1 keeps each.
    layouts, _ = enumerate_layouts(BASE, 2, PlanSpace(mesh={"tp": 1, "cp": 1, "ep": 1},
                                                      gather_formats=(None, "fp8", "nvfp4")))
    wide = [lay for lay in layouts if lay.gtp == 2]
    narrow = [lay for lay in layouts if lay.gtp == 1]
    assert narrow and all(lay.gather_format is None for lay in narrow)
    assert {lay.gather_format for lay in wide} == {None, "fp8", "nvfp4"}
    assert len(wide) == 3 * len({(lay.remat, lay.loop) for lay in wide})
    assert len(narrow) == len({(lay.remat, lay.loop) for lay in narrow})


def test_one_wide_gtp_layouts_plan_prefetch_as_the_scanned_loop():
    # Prefetch has nothing to gather over gtp=1: the same program as the scanned loop, so
    # one candidate, unless prefetch is the only loop asked for.
    space = PlanSpace(mesh={"tp": 1, "cp": 1, "ep": 1})
    layouts, _ = enumerate_layouts(BASE, 2, space)
    assert {lay.loop for lay in layouts if lay.gtp == 2} == {"unrolled", "scanned", "prefetch"}
    assert {lay.loop for lay in layouts if lay.gtp == 1} == {"unrolled", "scanned"}
    only, _ = enumerate_layouts(BASE, 2, dataclasses.replace(space, loops=("prefetch",)))
    assert {lay.loop for lay in only if lay.gtp == 1} == {"prefetch"}


@pytest.mark.parametrize("preset", ["llama3.2-3b", "llama3-8b", "tiny"])
def test_predicted_compute_counts_the_models_own_matmul_flops(preset):
    # With one rate for GEMMs and attention, the predicted compute of a step is the model's
    # own count of its training FLOPs over that rate: the q/k/v/o projections as the model
    # has them (grouped-query attention in the llama presets), not four d_model x d_model
    # matrices.
    rate = 1e12
    cal = dataclasses.replace(FIXED, gemm_flops=rate, attention_rates=((64, rate),), devices=1)
    cfg = TrainConfig(preset=preset, batch_size=2, seq_len=64, dp=1, gtp=1, remat="dots")
    want = model_config(cfg).train_flops_per_token(64) * 2 * 64 / rate
    assert timing.step_seconds(cfg, cal)["compute"] == pytest.approx(want, rel=1e-12)


def test_attention_rate_follows_the_sequence_length():
    # Attention kernels run far faster at long sequences: the rate at a run's sequence
    # length is the measured one, interpolated in log(seq) between lengths and held at
    # the nearest end outside them.
    cal = dataclasses.replace(FIXED, attention_rates=[[1024, 1e14], [4096, 3e14]])
    assert cal.attention_rates == ((1024, 1e14), (4096, 3e14))  # JSON lists read back
    assert cal.attention_flops(1024) == 1e14 and cal.attention_flops(4096) == 3e14
    assert cal.attention_flops(2048) == pytest.approx(2e14, rel=1e-12)
    assert cal.attention_flops(256) == 1e14 and cal.attention_flops(65536) == 3e14
    assert Calibration(**json.loads(json.dumps(cal.to_json()))) == cal
    for bad in ((), ((2048, 1e14), (1024, 2e14))):
        with pytest.raises(UsageError, match="attention_rates"):
            dataclasses.replace(FIXED, attention_rates=bad)
    # A step at seq 64 is charged the rate measured at 64, not the one at 32.
    cfg = TrainConfig(preset="tiny", batch_size=8, seq_len=64, dp=1, gtp=1, remat="dots")
    two = dataclasses.replace(FIXED, attention_rates=((32, 1e9), (64, 4e9)))
    one = dataclasses.replace(FIXED, attention_rates=((64, 4e9),))
    assert timing.step_seconds(cfg, two)["compute"] == timing.step_seconds(cfg, one)["compute"]
    slower = dataclasses.replace(FIXED, attention_rates=((64, 1e9),))
    assert timing.step_seconds(cfg, slower)["compute"] > timing.step_seconds(cfg, one)["compute"]


def test_the_optimizer_calibration_compiles_no_array_into_its_program():
    # An array closed over by a traced function becomes a constant that XLA folds while
    # compiling: the 64M-parameter optimizer calibration took 103 s to compile that way.
    n = 1 << 16
    tx = make_optimizer(TrainConfig())
    p = jnp.ones((n,), jnp.float32)
    text = jax.jit(timing._optimizer_updates(tx, 2)).lower(p, tx.init(p), p).as_text()
    big = [line for line in text.splitlines() if "constant" in line and f"{n}x" in line]
    assert big == [], big[:2]


def test_plan_replay_predicts_recorded_runs_again_with_other_rates(capsys):
    # benchmarks/plan_replay.py re-predicts a GPU accuracy run offline: every measured
    # layout of the committed run, from plans of the current and of an older calibration
    # format (one attention rate), and a slower GEMM rate predicts every step slower.
    root = Path(__file__).resolve().parents[1]
    replay = runpy.run_path(str(root / "benchmarks" / "plan_replay.py"),
                            run_name="plan_replay")
    results = root / "docs" / "results" / "2026-11-26_2xH100"
    rows = replay["replay"](str(results / "plan_calibration_v5"))
    assert [r["case"] for r in rows] == ["1b_s2048"] * 3 + ["1b_s4096"] * 3 + \
        ["llama3-8b_s4096"] * 3
    slow = replay["replay"](str(results / "plan_calibration_v5"), gemm_tflops=100.0)
    assert all(s["predicted_ms"] > r["predicted_ms"] for s, r in zip(slow, rows))
    assert len(replay["replay"](str(results / "plan_calibration_v3"))) == 9
    assert replay["main"]([str(results / "plan_calibration_v5"), "--attention",
                           "2048:175", "4096:210"]) == 0
    assert "of 9 replayed step times within 10%" in capsys.readouterr().out
    # A run planned by this time model replays to the predictions it recorded (a plan in
    # plan_accuracy/, beside the table), but for its tp layouts under remat none, slower
    # since tp's backward gathers are charged there too (2026-12-07), ...
    same = replay["replay"](str(root / "docs" / "results" / "2026-11-27_2xH100" /
                                "plan_top5_prospective" / "plan"))
    assert len(same) == 15
    tp_none = [" tp1 " not in r["layout"] and "remat=none" in r["layout"] for r in same]
    for r, slower in zip(same, tp_none):
        if slower:
            assert r["predicted_ms"] > r["recorded_ms"], r
        else:
            assert abs(r["predicted_ms"] - r["recorded_ms"]) < 1e-6 * r["recorded_ms"], r
    assert any(tp_none)
    # ... and one planned before tp paid the activation collectives remat recomputes does
    # too, except its tp layouts (under every policy now), which are slower for it.
    h200 = replay["replay"](str(root / "docs" / "results" / "2026-11-26_2xH200" /
                                "plan_calibration_v6"))
    assert len(h200) == 9
    for r in h200:
        if " tp1 " in r["layout"]:
            assert abs(r["predicted_ms"] - r["recorded_ms"]) < 1e-6 * r["recorded_ms"], r
        else:
            assert r["predicted_ms"] > r["recorded_ms"], r


@pytest.mark.parametrize("argv, needle", [
    (["--gpus", "1000000000"], "error: --gpus 1000000000: plan for at most 1024 devices"),
    (["--gpus", "1e9"], "error: argument --gpus: invalid int value: '1e9'"),
    (["--seq", "100000000"], "error: no layout of --batch 16 --seq 100000000 fits in this "
                             "host's memory"),
    (["--batch", "1000000000"], "error: --batch=1000000000 x --seq=128 = 128000000000 tokens"),
    (["--json", "."], "error: --json='.' is a directory"),
])
def test_plan_refuses_absurd_requests_in_one_line_at_once(argv, needle, capsys, fixed_rates):
    # Each of these ran for minutes (or was killed) with no output, or failed with a
    # traceback at the end of the planning (--json naming a folder).
    try:
        code = main(["plan", *argv])
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(needle), err


def test_ctrl_c_while_planning_is_one_line(monkeypatch, capsys):
    from gtp_jax.plan import cli as plan_cli
    from gtp_jax.train.cli.command import main as train_main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    assert train_main(["train", "--plan", "auto", *TRAIN_FLAGS], planner=interrupted) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted (Ctrl-C) before training started" in err
    monkeypatch.setattr(plan_cli, "_plan", interrupted)
    assert main(["plan", "--gpus", "8"]) == 130
    assert capsys.readouterr().err == "gtp_jax plan: interrupted (Ctrl-C); nothing was written.\n"
