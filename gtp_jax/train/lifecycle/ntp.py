"""Nonuniform tensor parallelism in training: keep training after a (simulated) device
failure, with a reduced ``tp``/``gtp`` degree on the data-parallel replicas that lost a
device (see docs/fault_tolerance.md).

`SimulatedFailure` says which devices fail after which step; `check_failure` validates it
against the run (before anything is built) and returns the `NonuniformPlan`; after that
step `NonuniformStep.recover` re-plans, rebuilds the state from the surviving devices onto
the core mesh (bit-exact, the failed devices are never read) and returns a drop-in for
`TrainStep`:

* each replica runs its forward/backward as its own SPMD program on its devices at its
  degree (healthy: ``tp_base``, degraded: ``tp_base - tp_spares``), on its rows of the
  global batch;
* the gradients are averaged over all replicas, weighted by their examples, on the core
  mesh (`gtp_jax.nonuniform.average_replicas`);
* the optimizer steps on the core mesh (parameters and optimizer state live there, at the
  core degree: what checkpoints save);
* the new parameters are re-laid out onto every replica (`gtp_jax.nonuniform.from_core`).

This module imports `gtp_jax.nonuniform`; `gtp_jax.nonuniform` never imports `train`.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import gtp_jax
from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.models import Transformer
from gtp_jax.nonuniform import (
    DimRule,
    LeafSplit,
    NonuniformConfig,
    NonuniformPlan,
    average_replicas,
    describe,
    from_core,
    leaf_split,
    plan,
    relayout,
    survivor_mesh,
    take_survivors,
)
from gtp_jax.nonuniform.config import AXES
from gtp_jax.sharding.module import plan_placement
from gtp_jax.sharding.plan import ParamPlan
from gtp_jax.train.config import Run, TrainConfig, make_optimizer, resolve
from gtp_jax.train.step.optim import current_lr, global_norm
from gtp_jax.train.step.train_step import replicate_stray_leaves


@dataclasses.dataclass(frozen=True)
class SimulatedFailure:
    """Devices that fail after a training step (simulated: their shards are overwritten
    with NaN, and the run continues on the survivors with nonuniform tensor parallelism).

    Attributes:
      step: the failure happens after this optimizer step (``1 <= step < TrainConfig.steps``).
      devices: the failed device ids (``jax.Device.id`` of mesh devices).
      tp_spares: devices per group a degraded replica leaves idle (its degree is the mesh's
        size on `axis` minus this); None: the fewest that cover the failures (the largest
        number of failures in one group, the parity rule), raised further until the
        degraded degree divides the model's heads and MLP width (``tp``).
      axis: the reduced axis, ``"tp"`` or ``"gtp"``.
    """

    step: int
    devices: tuple[int, ...]
    tp_spares: int | None = None
    axis: str = "tp"

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, (int, np.integer)) \
                or self.step < 1:
            raise UsageError(f"SimulatedFailure.step={self.step!r} must be an int >= 1 (the "
                             "failure happens after that step).")
        devices = self.devices
        if isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
            devices = (devices,)
        if not isinstance(devices, (tuple, list)) or not devices or any(
                isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0
                for d in devices):
            raise UsageError(f"SimulatedFailure.devices={self.devices!r} must be one or more "
                             "device ids (ints >= 0).")
        if len(set(devices)) != len(devices):
            raise UsageError(f"SimulatedFailure.devices={self.devices!r} names a device "
                             "twice; list each failed device once.")
        if self.tp_spares is not None and (isinstance(self.tp_spares, bool) or not isinstance(
                self.tp_spares, (int, np.integer)) or self.tp_spares < 1):
            raise UsageError(f"SimulatedFailure.tp_spares={self.tp_spares!r} must be an int "
                             ">= 1 (or None: what the failures need).")
        if self.axis not in AXES:
            raise UsageError(f"SimulatedFailure.axis={self.axis!r}: use one of {list(AXES)}.")
        object.__setattr__(self, "step", int(self.step))
        object.__setattr__(self, "devices", tuple(int(d) for d in devices))


def parse_failure(text: str, *, tp_spares: int | None = None, axis: str = "tp",
                  name: str = "parse_failure") -> SimulatedFailure:
    """``"step=30,device=5"`` (``device=`` may repeat) -> `SimulatedFailure` (`name`: what
    errors call the text, e.g. the flag)."""
    step, devices = None, []
    usage = (f"{name} {text!r}: use step=S,device=D (device may repeat), "
             "e.g. step=30,device=5")
    for part in str(text).split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("step", "device", "devices"):
            raise UsageError(f"{usage}.")
        try:
            values = [int(v) for v in value.split("+")]
        except ValueError:
            raise UsageError(f"{usage} ({key}={value!r} is not an int).") from None
        if key == "step":
            if step is not None or len(values) != 1:
                raise UsageError(f"{usage} (one step).")
            step = values[0]
        else:
            devices += values
    if step is None or not devices:
        raise UsageError(f"{usage} (both step= and device= are needed).")
    return SimulatedFailure(step=step, devices=tuple(devices), tp_spares=tp_spares, axis=axis)


def model_dims(run: TrainConfig | Run) -> dict[str, DimRule]:
    """The dims the reduced ``tp`` degree must divide: as `check_devices` asks of ``tp``
    (heads and the fused SwiGLU width, unpadded). Under ``gtp`` every weight pads: none."""
    model_cfg = resolve(run).model
    dims = {"n_heads": DimRule(model_cfg.n_heads, pad=False)}
    if model_cfg.moe_experts:
        dims["moe_d_ff"] = DimRule(model_cfg.moe_d_ff or model_cfg.d_ff, fused=2, pad=False)
    else:
        dims["d_ff"] = DimRule(model_cfg.d_ff, fused=2, pad=False)
    return dims


def _mesh(cfg: TrainConfig) -> jax.sharding.Mesh:
    return gtp_jax.make_mesh(dp=cfg.dp, gtp=cfg.gtp, tp=cfg.tp, ep=cfg.ep)


def _named(err: UsageError, failure: SimulatedFailure) -> UsageError:
    """A planner error, with the failure spec and the argument names of `SimulatedFailure`."""
    text = re.sub(r"\btp_spares\b", "SimulatedFailure.tp_spares", str(err))
    text = text.replace("NonuniformConfig.failed", "SimulatedFailure.devices")
    text = text.replace("NonuniformConfig.axis", "SimulatedFailure.axis")
    return UsageError(f"SimulatedFailure(step={failure.step}, devices="
                      f"{list(failure.devices)}): {text}")


def check_failure(run: TrainConfig | Run, failure: SimulatedFailure | None, *,
                  start: int = 0) -> NonuniformPlan | None:
    """Validates `failure` against the run `cfg` (resumed at step `start`) and returns its
    plan; nothing is built or changed. None: no failure.

    Raises:
      UsageError: the step is not inside the run, an unknown device, more failures in a
        group than spares, a degree a model dim cannot use (named), a replica batch the
        degraded replica cannot split, a replica without replicated state to recover from.
    """
    if failure is None:
        return None
    run = resolve(run)
    cfg = run.config
    if not isinstance(failure, SimulatedFailure):
        raise UsageTypeError(f"train: failure must be a SimulatedFailure, got "
                             f"{type(failure).__name__}.")
    if not start < failure.step < cfg.steps:
        where = f"after the resumed step {start} and " if start else ""
        past = (", or drop it to continue on the whole mesh (a run stopped after its "
                "failure resumes there)" if 0 < failure.step <= start else "")
        raise UsageError(
            f"SimulatedFailure.step={failure.step} must be {where}before the last step "
            f"(TrainConfig.steps={cfg.steps}): choose a step in {start + 1}..{cfg.steps - 1}"
            f"{past}.")
    if jax.process_count() > 1:
        raise UsageError("SimulatedFailure runs in one process only: its re-layout moves "
                         "arrays between devices with jax.device_put (see "
                         "docs/fault_tolerance.md, multi-process).")
    # Checked before anything trains: the re-layout after the failure step handles neither
    # (it would stop the run there, after training the steps before it).
    for name, size, what in (("cp", cfg.cp, "context parallelism"),
                             ("ep", cfg.ep, "expert parallelism")):
        if size > 1:
            raise UsageError(
                f"SimulatedFailure.devices: a simulated failure does not run with {what} "
                f"(TrainConfig.{name}={size}); the nonuniform replicas are re-laid out over "
                f"dp, gtp and tp only. Use TrainConfig.{name}=1 (docs/fault_tolerance.md).")
    mesh = _mesh(cfg)
    axis = failure.axis
    base = mesh.shape[axis]
    if base < 2:
        flag = "TrainConfig.tp" if axis == "tp" else "TrainConfig.gtp"
        raise UsageError(f"SimulatedFailure.axis={axis!r}: the mesh's {axis}={base} cannot be "
                         f"reduced; use {flag} >= 2 or the other axis.")
    if mesh.shape["dp"] < 2:
        raise UsageError("SimulatedFailure needs TrainConfig.dp >= 2: the failed device's "
                         "state is recovered from another data-parallel replica.")
    ids = {d.id for d in mesh.devices.flat}
    unknown = [d for d in failure.devices if d not in ids]
    if unknown:
        raise UsageError(f"SimulatedFailure.devices: device {unknown[0]} is not in the mesh "
                         f"(device ids {min(ids)}..{max(ids)}); name a mesh device.")
    spares = failure.tp_spares
    moves = _gtp_dim_moves(run, mesh, axis)  # built once: an abstract model and its plans
    if spares is None:
        # The fewest spares that cover every group: the most failures in one group.
        names = mesh.axis_names
        where = np.moveaxis(np.vectorize(lambda d: d.id)(mesh.devices),
                            names.index(axis), -1).reshape(-1, base)
        spares = max(sum(int(i) in failure.devices for i in line) for line in where)
        spares = min(spares, base - 1)  # every device of a group failed: plan says so
        # Then the fewest at least that many whose degraded degree the model dims and the
        # replica's batch allow (4 heads: tp 4 -> 2, not 3); if none does, the error below
        # names the dim.
        dims = model_dims(run) if axis == "tp" else {}
        for more in range(spares, base):
            try:
                for name, rule in dims.items():
                    rule.check(name, axis, base - more, "")
            except UsageError:
                continue
            if (cfg.batch_size // cfg.dp) % (cfg.ep * (base - more if axis == "gtp"
                                                       else cfg.gtp)):
                continue
            if moves(base - more) is not None:
                continue
            spares = more
            break
    if spares >= base:
        raise UsageError(f"SimulatedFailure.tp_spares={spares} leaves no device of a {axis} "
                         f"group of {base}; the degraded degree must be >= 1.")
    dims = model_dims(run) if axis == "tp" else {}
    try:
        p = plan(mesh, NonuniformConfig(base, spares, axis, failure.devices), dims)
    except UsageError as err:
        raise _named(err, failure) from None
    try:
        survivor_mesh(p)  # every shard must survive on some replica
    except UsageError as err:
        raise _named(err, failure) from None
    _check_gtp_dims_kept(moves, mesh, axis, {r.degree for r in p.replicas}, spares)
    rows = cfg.batch_size // cfg.dp
    for r in p.replicas:
        shards = cfg.ep * (r.degree if axis == "gtp" else cfg.gtp)
        if rows % shards:
            raise UsageError(
                f"SimulatedFailure: replica dp={r.replica}'s {rows} rows of the batch do not "
                f"split over its {shards} data shards at {axis}={r.degree}; choose a "
                "TrainConfig.batch_size whose per-replica rows divide them.")
    return p


def _gtp_dim_moves(run: Run, mesh: jax.sharding.Mesh,
                   axis: str) -> Callable[[int], tuple[str, int, int] | None]:
    """``moves(degree)``: the first weight GTP would shard on another dim with `axis` at
    `degree` than on the full mesh, as ``(path, dim then, dim now)``, or None. GTP shards
    the first dim that tp leaves free and the gtp degree divides (else pads), so a degraded
    replica can move a weight's shard dim; the re-layout after a failure changes each
    weight's split along the dim it has, never the dim."""
    cfg = run.config
    if cfg.gtp == 1:  # nothing GTP-sharded
        return lambda degree: None
    abstract = nnx.eval_shape(lambda: Transformer(run.model, rngs=nnx.Rngs(cfg.seed)))
    devices = list(mesh.devices.flat)

    def dims(degree: int) -> dict[str, int]:
        sizes = {"gtp": cfg.gtp, "tp": cfg.tp, axis: degree}
        sub = gtp_jax.make_mesh(dp=1, gtp=sizes["gtp"], tp=sizes["tp"],
                                devices=devices[:sizes["gtp"] * sizes["tp"]])
        placement = plan_placement(abstract, sub, run.gtp)
        return {path: plan.spec.shard_dim for path, plan in zip(placement.paths, placement.plans)
                if isinstance(plan, ParamPlan)}

    full = dims(mesh.shape[axis])

    def moves(degree: int) -> tuple[str, int, int] | None:
        for path, dim in dims(degree).items():
            if full.get(path, dim) != dim:
                return path, dim, full[path]
        return None

    return moves


def _check_gtp_dims_kept(moves: Callable[[int], tuple[str, int, int] | None],
                         mesh: jax.sharding.Mesh, axis: str, degrees: set[int],
                         spares: int) -> None:
    """Refuses a failure whose degraded replicas would shard some weight over ``gtp`` on
    another dim than the full-degree mesh does (`moves`: `_gtp_dim_moves`).

    Raises:
      UsageError: naming the weight, the two dims and what to run instead.
    """
    base = mesh.shape[axis]
    for degree in sorted(degrees):
        moved = moves(degree)
        if moved is None:
            continue
        path, dim, was = moved
        fits = [base - more for more in range(spares + 1, base) if moves(base - more) is None]
        other = ("" if axis == "gtp" else " Use TrainConfig.gtp=1, or reduce the gtp axis "
                 "instead: SimulatedFailure.axis='gtp'.")
        more = (f" SimulatedFailure.tp_spares={base - fits[0]} (degraded {axis}={fits[0]}) "
                "keeps every dim." if fits else "")
        raise UsageError(
            f"SimulatedFailure: at {axis}={degree} GTP would shard {path} on dim {dim}, "
            f"at {axis}={base} on dim {was}; a failure re-lays out each weight along the "
            f"dim it is sharded on.{more}{other}")


def _split_map(model: gtp_jax.ShardedModule, axis: str) -> dict[str, LeafSplit | None]:
    """Parameter path (inside the sharded module) -> its `LeafSplit` on `axis`."""
    pad = model.config.pad_for_alignment
    return {path: leaf_split(p, axis, pad) for path, p in model.placements().items()}


def _splits(tree: Any, by_path: dict[str, LeafSplit | None]) -> Any:
    """A `LeafSplit`/None per leaf of a model or optimizer state: the split of the parameter
    named after the last ``module`` key of the leaf's path (moments share their parameter's)."""

    def split(path: tuple, _: Any) -> LeafSplit | None:
        names = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                 for k in path]
        if "module" not in names:
            return None
        last = len(names) - 1 - names[::-1].index("module")
        rest = [n for n in names[last + 1:] if n != "value"]
        return by_path.get("/".join(rest))

    return jax.tree_util.tree_map_with_path(split, tree)


def _build(run: Run, mesh: jax.sharding.Mesh) -> gtp_jax.ShardedModule:
    cfg, model_cfg = run.config, run.model
    return gtp_jax.shard_init(lambda: Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed)), mesh,
                              run.gtp)


def _with_values(template: Any, values: Any) -> Any:
    """`template` (a state with the right Variables and metadata) holding `values`."""
    # By leaves: the Variables' metadata (the split layout) is part of the tree structure.
    return jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(values))


def poison(p: NonuniformPlan, tree: Any) -> Any:
    """`tree` with every shard on a failed device replaced by NaN (what a simulated failure
    leaves: any read of a failed device shows up as a NaN loss)."""
    failed = set(p.failed_devices)

    def one(x: Any) -> Any:
        if not isinstance(x, jax.Array) or not any(s.device.id in failed
                                                   for s in x.addressable_shards):
            return x
        bad = np.nan if np.issubdtype(x.dtype, np.floating) else np.iinfo(x.dtype).max
        shards = [jax.device_put(np.full(s.data.shape, bad, x.dtype), s.device)
                  if s.device.id in failed else s.data for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)

    return jax.tree.map(one, tree)


@dataclasses.dataclass
class Recovery:
    """What the switch to nonuniform TP cost and looked like (`TrainResult.failure`)."""

    step: int
    devices: tuple[int, ...]
    layout_before: str
    layout_after: str
    replan_s: float
    relayout_s: float
    rebuild_s: float


class NonuniformStep:
    """``metrics = step(batch)`` after a failure: the drop-in for `TrainStep` (`batch` is the
    global ``int32[batch, seq + 1]`` NumPy batch; each replica takes its rows).

    Build it with `recover`. `objects` are the core-mesh model and optimizer (current after
    `sync`): what checkpoints save and what a uniform run restores.
    """

    #: A call returns when its step is done (it reads each replica's loss): the training
    #: loop finishes the previous step before calling it, not after (its step times).
    synchronous = True

    def __init__(self, cfg: TrainConfig, p: NonuniformPlan, loss_fn: Callable[..., Any],
                 core: tuple[gtp_jax.ShardedModule, nnx.Optimizer], core_state: nnx.State,
                 replicas: list[gtp_jax.ShardedModule], by_path: dict[str, LeafSplit | None]):
        self.plan = p
        self._objects = core
        nnx.update(core, core_state)
        # params: the model's parameters (the state's [0]); rest: the optimizer's state.
        self.graphdef, self.params, self._rest = nnx.split(core, nnx.Param, ...)
        self._param_splits = _splits(self.params[0], by_path)
        self._replicas = []
        for model in replicas:
            graphdef, _, rest = nnx.split(model, nnx.Param, ...)
            self._replicas.append((graphdef, rest, gtp_jax.data_sharding(model.mesh),
                                   _grad_program(graphdef, loss_fn)))
        self._update = _update_program(self.graphdef)
        self.rows = [cfg.batch_size // cfg.dp] * cfg.dp

    @classmethod
    def recover(cls, run: TrainConfig | Run, p: NonuniformPlan, state: nnx.State,
                loss_fn: Callable[..., Any], *, failure: SimulatedFailure,
                original: gtp_jax.ShardedModule) -> tuple[NonuniformStep, Recovery]:
        """The step after `failure`: `state` (of ``(model, optimizer)`` on the uniform mesh,
        as `TrainStep.state` holds it) loses the failed devices' shards, is re-planned and
        rebuilt from the survivors onto the core mesh (bit-exact), and the replica models
        are built."""
        run = resolve(run)
        cfg = run.config
        state = poison(p, state)  # the simulated failure: from here on nothing may read them
        begin = time.perf_counter()
        base = NonuniformConfig(p.config.tp_base, p.config.tp_spares, p.axis)
        before = describe(plan(p.mesh, base, p.dims))
        replanned = plan(p.mesh, p.config, p.dims)
        after = describe(replanned)
        replan_s = time.perf_counter() - begin

        begin = time.perf_counter()
        by_path = _split_map(original, p.axis)
        splits = _splits(state, by_path)
        smesh, survivors = take_survivors(replanned, state)
        core_state = relayout(survivors, splits, smesh, replanned.core_mesh(), p.axis)
        jax.block_until_ready(core_state)
        relayout_s = time.perf_counter() - begin

        begin = time.perf_counter()
        core_model = _build(run, replanned.core_mesh())
        core_opt = nnx.Optimizer(core_model, make_optimizer(cfg), wrt=nnx.Param)
        replicate_stray_leaves(core_opt, replanned.core_mesh())
        template = nnx.state((core_model, core_opt))
        core_state = _with_values(template, core_state)
        replicas = [_build(run, replanned.replica_mesh(r.replica)) for r in replanned.replicas]
        step = cls(cfg, replanned, loss_fn, (core_model, core_opt), core_state, replicas,
                   by_path)
        rebuild_s = time.perf_counter() - begin
        return step, Recovery(step=failure.step, devices=failure.devices, layout_before=before,
                              layout_after=after, replan_s=replan_s, relayout_s=relayout_s,
                              rebuild_s=rebuild_s)

    def __call__(self, batch: np.ndarray) -> dict[str, Any]:
        """One optimizer step: per-replica forward/backward at each replica's degree, the
        example-weighted gradient average on the core mesh, the optimizer step there."""
        batch = np.asarray(batch)
        grads, losses, start = [], [], 0
        for r, (_, rest, placement, program) in enumerate(self._replicas):
            rows = batch[start:start + self.rows[r]]
            start += self.rows[r]
            tokens = jax.make_array_from_callback(rows.shape, placement,
                                                  lambda index, rows=rows: rows[index])
            params = from_core(self.plan, self.params[0], self._param_splits, r)
            loss, g = program(params, rest, tokens)
            losses.append(loss)
            grads.append(g)
        weights = np.asarray(self.rows, np.float64)
        mean = average_replicas(self.plan, grads, self._param_splits, weights=weights)
        self.params, self._rest, metrics = self._update(self.params, self._rest, mean)
        w = weights / weights.sum()
        # The metrics `TrainStep` reports, so a run's log keeps its fields past the failure.
        return {"loss": np.float32(sum(float(x) * wi for x, wi in zip(losses, w))), **metrics}

    @property
    def objects(self) -> tuple[gtp_jax.ShardedModule, nnx.Optimizer]:
        """The core-mesh model and optimizer (current after `sync`)."""
        return self._objects

    def sync(self) -> None:
        """Writes the current state into the core model and optimizer."""
        nnx.update(self._objects, self.params, self._rest)


def _grad_program(graphdef: Any, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    def grads(params: nnx.State, rest: nnx.State, batch: jax.Array):
        model = nnx.merge(graphdef, params, rest)
        return nnx.value_and_grad(loss_fn)(model, batch)

    return jax.jit(grads)


def _update_program(graphdef: Any) -> Callable[..., Any]:
    def update(params: nnx.State, rest: nnx.State, grads: nnx.State):
        model, optimizer = nnx.merge(graphdef, params, rest)
        optimizer.update(model, grads)
        # As `TrainStep`: the global norm of the (averaged) gradients before clipping, and
        # the learning rate of this update when the optimizer's state holds it.
        metrics = {"grad_norm": global_norm(grads)}
        lr = current_lr(optimizer.opt_state)
        if lr is not None:
            metrics["lr"] = jnp.asarray(lr, jnp.float32)
        _, params, rest = nnx.split((model, optimizer), nnx.Param, ...)
        return params, rest, metrics

    return jax.jit(update)


__all__ = ["NonuniformStep", "Recovery", "SimulatedFailure", "check_failure", "model_dims",
           "parse_failure", "poison"]
