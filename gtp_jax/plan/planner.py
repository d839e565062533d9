"""`plan`: the layouts of a run, ranked by predicted step time among those that fit."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import numpy as np

from gtp_jax.base.errors import UsageError
from gtp_jax.base.host import available_bytes as available_host_bytes
from gtp_jax.base.xla_flags import pinned_pool_bytes
from gtp_jax.plan.layout import Layout, PlanSpace, enumerate_layouts
from gtp_jax.plan.memory import CONCURRENT_COMPILES, compiled_memories
from gtp_jax.plan.timing import Calibration, calibration, step_seconds
from gtp_jax.train.config import TrainConfig, model_config, resolve_auto
from gtp_jax.train.outputs.observe import device_memory_limit
from gtp_jax.train.step.memory import memory_bound, param_sizes, pinned_host_problem

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout and what the planner predicts for it.

    Attributes:
      layout: the `Layout`.
      bound_bytes: the closed-form lower bound of the peak bytes per device
        (`gtp_jax.train.step.memory.memory_bound`).
      peak_bytes: the compiled training step's peak bytes per device
        (`gtp_jax.plan.memory.compiled_memory`); None where it was not compiled.
      step_seconds: predicted seconds per step (`gtp_jax.plan.timing.step_seconds`).
      rejected: why the layout cannot run (over the budget, by bound or compiled; or the
        compiler refused it); None if it fits or was not compiled.
    """

    layout: Layout
    bound_bytes: int
    peak_bytes: int | None
    step_seconds: float
    rejected: str | None = None

    @property
    def fits(self) -> bool:
        """Compiled and within the budget."""
        return self.peak_bytes is not None and self.rejected is None

    @property
    def status(self) -> str:
        if self.fits:
            return "fits"
        return f"rejected: {self.rejected}" if self.rejected else "not compiled"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The ranked candidates of one planning: those that fit by predicted step time, then
    those not compiled, then the rejected ones (each group in a fixed order).
    `offload_fallback`: no layout fitted with the optimizer state on the device, and these
    are the same layouts with it offloaded, then the on-device ones (`plan_fitting`)."""

    base: TrainConfig
    devices: int
    budget_bytes: int | None
    calibration: Calibration
    candidates: tuple[Candidate, ...]
    skipped: int
    offload_fallback: bool = False

    @property
    def best(self) -> Candidate | None:
        """The top candidate that fits, or None."""
        return self.candidates[0] if self.candidates and self.candidates[0].fits else None


def budget_bytes(memory_gib: float | None) -> int | None:
    """Bytes per device for `memory_gib` (None: the device's limit; None on CPU)."""
    if memory_gib is None:
        return device_memory_limit()
    if isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float)) or \
            not math.isfinite(memory_gib) or memory_gib <= 0:
        raise UsageError(f"memory_gib={memory_gib!r} must be a positive number of GiB.")
    return int(memory_gib * GIB)


def plan(base: TrainConfig, *, memory_gib: float | None = None,
         space: PlanSpace | None = None, top: int = 5,
         cal: Calibration | None = None) -> Plan:
    """Plans `base` (its preset, batch, sequence and dtypes) on the present devices.

    Every layout of `space` valid for the model and devices is bounded in closed form;
    those whose bound exceeds the budget are rejected without compiling, and so (on a GPU
    host) are offloaded layouts whose optimizer state cannot fit in pinned host memory
    (`gtp_jax.train.step.memory.pinned_host_problem`). The rest are
    compiled (`compiled_memories`, cached) in order of predicted step time, in batches of as
    many as are still needed (on a GPU host at least the 3 that compile at once), until
    `top` of them fit; the slower ones are left uncompiled.

    Args:
      base: the run to plan (its mesh and layout fields are replaced by each layout's).
      memory_gib: budget per device in GiB; None: the device's memory (no budget on CPU).
      space: the layouts to consider (default `PlanSpace()`).
      top: how many fitting layouts to find (compile).
      cal: the rates to predict with; None: `calibration` of the present devices.

    Returns:
      A `Plan` whose candidates are ranked (deterministic for the same calibration).

    Raises:
      UsageError: bad `memory_gib` or `top`.
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise UsageError(f"top={top!r} must be an int >= 1.")
    budget = budget_bytes(memory_gib)
    space = PlanSpace() if space is None else space
    base = resolve_auto(base)
    cal = calibration(base.dtype) if cal is None else cal
    devices = jax.device_count()
    layouts, skipped = enumerate_layouts(base, devices, space)
    # The CPU backend's pinned host memory is its ordinary memory: no pool to fit, but every
    # simulated device lives in this process, and tracing a layout that cannot fit there
    # (--seq 1e8) runs for minutes before the compiler refuses it: such a layout is
    # rejected by its bound, as `train` refuses it (`check_host_memory`).
    if jax.default_backend() == "cpu":
        host_problem_of = functools.partial(_simulated_host_problem,
                                            available=available_host_bytes(),
                                            devices=jax.local_device_count())
    else:
        host_problem_of = functools.partial(pinned_host_problem, pool_bytes=pinned_pool_bytes(),
                                            available_bytes=available_host_bytes(),
                                            local_devices=jax.local_device_count())
    pending, rejected = [], []
    for layout in layouts:
        cfg = layout.apply(base)
        bound = memory_bound(cfg)["total"]
        seconds = step_seconds(cfg, cal)["total"]
        host_problem = host_problem_of(cfg)
        if budget is not None and bound > budget:
            rejected.append(Candidate(layout, bound, None, seconds,
                                      f"bound {bound / GIB:.2f} GiB > {budget / GIB:.2f} GiB"))
        elif host_problem:
            rejected.append(Candidate(layout, bound, None, seconds, f"host: {host_problem}"))
        else:
            pending.append(Candidate(layout, bound, None, seconds))
    pending.sort(key=lambda c: (c.step_seconds, c.bound_bytes, c.layout.sort_key))
    fitting: list[Candidate] = []
    uncompiled = list(pending)
    # On a GPU host a batch is as wide as the compiles that run at once, so a tight budget
    # (most of the fastest layouts over it) does not compile them one after another; the
    # CPU backend's compiles do not overlap on a small host, so there only what is needed.
    parallel = 1 if jax.default_backend() == "cpu" else CONCURRENT_COMPILES
    while uncompiled and len(fitting) < top:
        # The next few by predicted time, compiled together; more only if some do not fit.
        # (Wider batches did not compile faster: on a 32-core GPU host, 8 at a time took
        # 6.7 s per layout against 6.2 s for 3 at a time, and changed the compiled peaks;
        # docs/results/2026-11-26_2xH100/README.md.)
        width = max(top - len(fitting), parallel)
        batch, uncompiled = uncompiled[:width], uncompiled[width:]
        figures = compiled_memories([cand.layout.apply(base) for cand in batch])
        for cand, figure in zip(batch, figures):
            if isinstance(figure, Exception):
                rejected.append(dataclasses.replace(cand, rejected=f"invalid: {figure}"))
                continue
            cand = dataclasses.replace(cand, peak_bytes=figure.peak)
            if budget is not None and figure.peak > budget:
                rejected.append(dataclasses.replace(
                    cand, rejected=f"compiled {figure.peak / GIB:.2f} GiB > "
                                   f"{budget / GIB:.2f} GiB"))
            else:
                fitting.append(cand)
    fitting.sort(key=lambda c: (c.step_seconds, c.peak_bytes, c.layout.sort_key))
    rejected.sort(key=lambda c: (c.peak_bytes or c.bound_bytes, c.layout.sort_key))
    return Plan(base=base, devices=devices, budget_bytes=budget, calibration=cal,
                candidates=(*fitting, *uncompiled, *rejected), skipped=skipped)


def _simulated_host_problem(cfg: TrainConfig, *, available: int | None,
                            devices: int) -> str | None:
    """Why `cfg` cannot run on `devices` simulated CPU devices in `available` host bytes
    (its memory bound on each), or None."""
    if available is None:
        return None
    need = memory_bound(cfg)["total"] * devices
    if need <= available:
        return None
    return (f"{need / GIB:.2f} GiB for {devices} simulated devices > {available / GIB:.2f} "
            "GiB available")


def plan_fitting(base: TrainConfig, *, memory_gib: float | None = None,
                 space: PlanSpace | None = None, top: int = 5,
                 cal: Calibration | None = None) -> Plan:
    """`plan` with the optimizer state on the device, and, when no layout fits there, the
    same layouts with it in host memory (`TrainConfig.offload_optimizer`): offload costs
    host transfers every step (docs/offload.md), so it is planned only for a run that
    does not fit without it. When none fits offloaded either, the same layouts with the
    float32 master weights offloaded too (`TrainConfig.offload_master_weights`: bfloat16
    parameters and gradients on the device, more host transfers).

    Args:
      base, memory_gib, top, cal: as in `plan`.
      space: the layouts (default `PlanSpace()`); its ``offload`` must be ``(False,)``,
        the on-device choice the fallback widens.

    Returns:
      The on-device `Plan` when one of its layouts fits (or none fits offloaded, with or
      without master weights); else the offloaded plan's candidates (the master-weight
      plan's, then the offloaded one's, when only those fit) followed by the on-device
      ones, with ``offload_fallback`` set.

    Raises:
      UsageError: `space` already chooses offload; bad `memory_gib` or `top`.
    """
    space = PlanSpace() if space is None else space
    if space.offload != (False,) or space.master != (False,):
        raise UsageError(f"plan_fitting: PlanSpace.offload={space.offload!r}, "
                         f"master={space.master!r}; it plans offload itself: pass (False,) "
                         "for both, or call plan with the offload choices to try.")
    on_device = plan(base, memory_gib=memory_gib, space=space, top=top, cal=cal)
    if on_device.best is not None:
        return on_device
    offloaded = plan(base, memory_gib=memory_gib,
                     space=dataclasses.replace(space, offload=(True,)), top=top,
                     cal=on_device.calibration)
    if offloaded.best is None:
        master = plan(base, memory_gib=memory_gib,
                      space=dataclasses.replace(space, offload=(True,), master=(True,)),
                      top=top, cal=on_device.calibration)
        if master.best is None:
            return on_device
        return dataclasses.replace(
            master, offload_fallback=True,
            candidates=master.candidates + offloaded.candidates + on_device.candidates)
    offloaded = keep_what_fits(offloaded, top)
    return dataclasses.replace(offloaded, offload_fallback=True,
                               candidates=offloaded.candidates + on_device.candidates)


def keep_what_fits(result: Plan, top: int = 5) -> Plan:
    """`result` with partial offload added: for each of its `top` fitting offloaded
    candidates, the same layout with as many of its moments kept on the device
    (`Layout.offload_exclude`, `keep_on_device`) as its spare memory (budget minus compiled
    peak) holds, compiled and ranked among the others where it fits (it moves fewer bytes
    each step, so it ranks above its fully offloaded layout). A choice that compiles over
    the budget is tried once more, with its kept bytes less what it was over. Unchanged
    without a budget."""
    found = _kept_candidates(result, top)
    fitting = sorted((*found, *(c for c in result.candidates if c.fits)),
                     key=lambda c: (c.step_seconds, c.peak_bytes, c.layout.sort_key))
    rest = tuple(c for c in result.candidates if not c.fits)
    return dataclasses.replace(result, candidates=(*fitting, *rest))


def _kept_candidates(result: Plan, top: int) -> list[Candidate]:
    """The partially offloaded candidates of `keep_what_fits` that fit."""
    budget = result.budget_bytes
    if budget is None:
        return []
    todo = {c.layout: budget - c.peak_bytes for c in result.candidates
            if c.fits and c.layout.offload and not c.layout.offload_exclude}
    todo = dict(list(todo.items())[:top])
    found: list[Candidate] = []
    for _ in range(2):
        tries, used = {}, {}
        for layout, spare in todo.items():
            keep, used[layout] = _choose(layout.apply(result.base), spare)
            if keep:
                tries[layout] = dataclasses.replace(layout, offload_exclude=keep)
        figures = compiled_memories([t.apply(result.base) for t in tries.values()])
        retry = {}
        for (layout, tried), figure in zip(tries.items(), figures):
            if isinstance(figure, Exception):
                continue
            if figure.peak <= budget:
                cfg = tried.apply(result.base)
                found.append(Candidate(tried, memory_bound(cfg)["total"], figure.peak,
                                       step_seconds(cfg, result.calibration)["total"]))
            else:
                # The compiler needed more than the moments' bytes: keep that much less.
                retry[layout] = used[layout] - (figure.peak - budget)
        todo = retry
    return found


def keep_on_device(cfg: TrainConfig, spare: int) -> tuple[str, ...]:
    """The parameters of `cfg`'s model whose optimizer state (AdamW's two moments, in the
    parameter dtype, split like the parameters over ``gtp * tp * ep``) fills at most
    `spare` bytes per device the most, as ``offload_exclude`` patterns (``^path$``);
    ``()`` when none fits.

    The largest parameters are tried exhaustively (an exact subset sum over the 16
    largest; the rest, norms and biases, are too small to matter)."""
    return _choose(cfg, spare)[0]


def _choose(cfg: TrainConfig, spare: int) -> tuple[tuple[str, ...], int]:
    """`keep_on_device`'s patterns and the bytes per device their moments take."""
    cfg = resolve_auto(cfg)
    mc = model_config(cfg)
    per = 2 * np.dtype(mc.param_dtype).itemsize / (cfg.gtp * cfg.tp * cfg.ep)
    sizes = sorted(((math.ceil(n * per), path) for path, n in param_sizes(mc)), reverse=True)
    best: dict[int, tuple[str, ...]] = {0: ()}
    for nbytes, path in sizes[:16]:
        for total, chosen in list(best.items()):
            if total + nbytes <= spare and total + nbytes not in best:
                best[total + nbytes] = (*chosen, path)
    total = max(best)
    return tuple(f"^{re.escape(p)}$" for p in sorted(best[total])), total


def format_table(result: Plan, limit: int | None = 20) -> str:
    """The ranked table: rank, layout, bound and compiled peak GiB, predicted step ms,
    status (fits / not compiled / rejected: why)."""
    budget = (f"{result.budget_bytes / GIB:.2f} GiB per device" if result.budget_bytes
              else "none (the backend reports no device memory; pass --memory-gib)")
    cal = result.calibration
    lines = [
        f"plan: preset={result.base.preset} devices={result.devices} "
        f"({jax.default_backend()}, {cal.device_kind}) batch={result.base.batch_size} "
        f"seq={result.base.seq_len} dtype={result.base.dtype} budget {budget}",
        f"rates: GEMM {cal.gemm_flops / 1e12:.3g} TFLOP/s, attention "
        f"{cal.attention_flops(result.base.seq_len) / 1e12:.3g} TFLOP/s at seq "
        f"{result.base.seq_len}, all-gather {cal.all_gather_bandwidth / 1e9:.3g}"
        f" GB/s + {cal.all_gather_latency * 1e6:.0f} us, reduce-scatter "
        f"{cal.reduce_scatter_bandwidth / 1e9:.3g} GB/s + {cal.reduce_scatter_latency * 1e6:.0f}"
        f" us, memory {cal.memory_bandwidth / 1e12:.3g} TB/s, optimizer "
        f"{cal.optimizer_rate / 1e9:.3g} G parameters/s, host <-> device "
        f"{cal.host_bandwidth / 1e9:.3g} GB/s, overlapped collectives "
        f"{cal.overlap_exposed:.0%} exposed",
    ]
    shown = result.candidates if limit is None else result.candidates[:limit]
    width = max([44, *(len(c.layout.describe()) for c in shown)])
    lines.append(f"{'#':>3}  {'layout':<{width}} {'bound GiB':>9} {'peak GiB':>9} "
                 f"{'step ms':>9}  status")
    if result.offload_fallback and result.best is not None and result.best.layout.master:
        lines.insert(2, "no layout fits with the optimizer state on the device, nor offloaded: "
                        "the first layouts keep it and the float32 master weights in host "
                        "memory (--offload-optimizer --offload-master-weights: bfloat16 "
                        "parameters on the device), at the cost of more host transfers")
    elif result.offload_fallback:
        lines.insert(2, "no layout fits with the optimizer state on the device: the first "
                        "layouts keep it in host memory (--offload-optimizer), at the cost of "
                        "host transfers every step")
    for i, c in enumerate(shown, 1):
        peak = f"{c.peak_bytes / GIB:9.3f}" if c.peak_bytes is not None else f"{'-':>9}"
        lines.append(f"{i:>3}  {c.layout.describe():<{width}} {c.bound_bytes / GIB:9.3f} {peak} "
                     f"{c.step_seconds * 1e3:9.2f}  {c.status}")
    return "\n".join(lines + table_tail(len(result.candidates) - len(shown), result.skipped))


def table_tail(more: int, skipped: int) -> list[str]:
    """The lines under a plan's table: how many layouts it did not show, and how many were
    skipped as invalid."""
    lines = []
    if more > 0:
        lines.append(f"     ... {more} more (--limit 0 shows all)")
    if skipped:
        lines.append(f"     {skipped} layouts skipped: invalid for this model, batch or "
                     "sequence (batch not divisible by dp*gtp*ep, tp not dividing the heads...)")
    return lines
