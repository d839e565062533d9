"""A layout's memory per device: the exact figure of the compiled training step
(`compiled_memory`); the closed-form lower bound that prunes without compiling is the
trainer's own refusal check (`gtp_jax.train.step.memory.memory_bound`).

`compiled_memory` lowers and compiles the very program `gtp_jax.train.train` runs (the
`gtp_jax.train.step.train_step.step_program` of the model and optimizer `build_model_and_optimizer`
builds), with abstract arguments: the model and optimizer are built under
``nnx.eval_shape`` (no weight is materialized) and given the shardings `gtp_jax.shard` and
`gtp_jax.train.TrainStep` place them with. No step runs. The peak is read from XLA's
compiled memory analysis:

    peak = argument + output - alias + temp + generated code        (bytes per device)

(the donated state's outputs alias its arguments and are counted once). On a GPU host these
are the GPU compiler's buffers; on a CPU host, the CPU compiler's for the simulated mesh.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gtp_jax
from gtp_jax.base.errors import UsageError
from gtp_jax.models import Transformer, lm_loss
from gtp_jax.sharding.module import hold_params_in
from gtp_jax.sharding.offload import (
    DEFAULT_GROUP_LAYERS,
    MASTER_DEVICE_DTYPE,
    host_shapes,
    with_master_weights,
)
from gtp_jax.train.config import (
    Run,
    TrainConfig,
    check_devices,
    make_optimizer,
    resolve,
    resolve_auto,
)
from gtp_jax.train.step.train_step import (
    group_offloaded,
    map_opt_state,
    resident_paths,
    step_program,
)

#: Programs compiled at a time on a GPU host (`compiled_memories`).
CONCURRENT_COMPILES = 3

#: Compiled figures by resolved `TrainConfig` (and backend): planning again (another
#: budget, the `--plan auto` of a planned run) compiles nothing twice.
_CACHE: dict[tuple[Any, ...], MemoryFigure] = {}


@dataclasses.dataclass(frozen=True)
class MemoryFigure:
    """XLA's compiled memory analysis of one training step, bytes per device."""

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int

    @property
    def peak(self) -> int:
        """argument + output - alias + temp + generated code."""
        return self.argument + self.output - self.alias + self.temp + self.generated_code

    @classmethod
    def of(cls, compiled: Any) -> MemoryFigure:
        """The figure of a ``jax.stages.Compiled``."""
        ma = compiled.memory_analysis()
        return cls(argument=int(ma.argument_size_in_bytes), output=int(ma.output_size_in_bytes),
                   alias=int(ma.alias_size_in_bytes), temp=int(ma.temp_size_in_bytes),
                   generated_code=int(ma.generated_code_size_in_bytes))


def abstract_train_state(cfg: TrainConfig | Run
                         ) -> tuple[Any, nnx.State, jax.ShapeDtypeStruct]:
    """``(graphdef, state, batch)`` of `gtp_jax.train.train`'s step for `cfg`, abstract:
    ``jax.ShapeDtypeStruct`` leaves with the shardings the trainer places them with (the
    parameters' and moments' from `gtp_jax.shard`'s plan, host memory for an offloaded
    optimizer state, replicated scalars), and the batch ``int32[batch, seq + 1]`` split over
    the data axes. Nothing is allocated on the devices."""
    run = resolve(cfg)
    cfg, model_cfg = run.config, run.model
    mesh = gtp_jax.make_mesh(dp=cfg.dp, gtp=cfg.gtp, tp=cfg.tp, ep=cfg.ep, cp=cfg.cp)

    def build() -> tuple[gtp_jax.ShardedModule, nnx.Optimizer]:
        model = gtp_jax.shard(Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed)), mesh,
                              run.gtp)
        tx = make_optimizer(cfg)
        if cfg.offload_master_weights:  # as make_nnx_optimizer builds it
            tx = with_master_weights(tx)
            hold_params_in(model, MASTER_DEVICE_DTYPE)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(build)
    graphdef, state = nnx.split((model, optimizer))
    specs = {path: NamedSharding(mesh, plan.partition_spec(len(plan_shape)))
             for path, plan, plan_shape in _placed(model, state)}
    replicated = NamedSharding(mesh, P())
    flat = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        sharding = specs.get(_param_path(path), replicated)
        flat.append((path, var.replace(value=jax.ShapeDtypeStruct(
            value.shape, value.dtype, sharding=sharding))))
    state = nnx.from_flat_state(flat)
    if cfg.offload_optimizer:  # in host memory, grouped as the trainer's step holds it
        state = map_opt_state(state, host_shapes, keep=resident_paths(model))
        state = group_offloaded(graphdef, state, DEFAULT_GROUP_LAYERS)
    batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), np.int32,
                                 sharding=gtp_jax.data_sharding(mesh))
    return graphdef, state, batch


def _param_path(path: tuple[Any, ...]) -> str | None:
    """``(0, 'module', 'blocks', 'mlp', ...)`` or an optimizer moment's
    ``(1, 'opt_state', 1, 0, 'mu', 'module', 'blocks', ...)`` -> ``"blocks/mlp/..."``."""
    keys = [str(k) for k in path]
    if "module" not in keys:
        return None
    return "/".join(keys[keys.index("module") + 1:])


def _placed(model: gtp_jax.ShardedModule, state: nnx.State) -> list[tuple[str, Any, tuple]]:
    shapes = {_param_path(p): v.get_value().shape for p, v in nnx.to_flat_state(state)}
    return [(path, plan, shapes[path]) for path, plan in model.placements().items()
            if path in shapes]


def compiled_memory(cfg: TrainConfig) -> MemoryFigure:
    """The compiled memory of `gtp_jax.train.train`'s training step for `cfg` on the
    present devices (see the module docstring); cached per resolved config.

    Raises:
      UsageError: `cfg`'s mesh does not match the devices or the model (`check_devices`).
    """
    result = compiled_memories([cfg])[0]
    if isinstance(result, Exception):
        raise result
    return result


def compiled_memories(cfgs: Sequence[TrainConfig]) -> list[MemoryFigure | Exception]:
    """`compiled_memory` of each of `cfgs`, in order; a config that cannot be built gives
    its error (``UsageError``, ``ValueError``, ``TypeError``) in its place.

    The programs are traced one after the other (tracing holds Python's lock) and compiled
    concurrently, one thread per program and at most `CONCURRENT_COMPILES` (3) at a time:
    XLA's compiler releases the lock, so the compilations overlap. At most 3 because on a
    GPU host the compiler autotunes its kernels on the device while it compiles: 3 at a time
    gave the peaks of compiling alone, 8 at a time gave 1b layouts 0.6-1.5 GiB larger ones
    (docs/planning.md), and the peak predicted must be the one a run compiles to.
    """
    keys = [_key(cfg) for cfg in cfgs]
    todo: dict[tuple[Any, ...], Any] = {}
    results: dict[tuple[Any, ...], MemoryFigure | Exception] = {}
    for key in keys:
        if key in _CACHE or key in todo or key in results:
            continue
        try:
            todo[key] = _lowered_step(key[0])
        except (UsageError, ValueError, TypeError) as err:
            results[key] = err
    if todo:
        workers = min(len(todo), CONCURRENT_COMPILES)
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            figures = pool.map(lambda lowered: MemoryFigure.of(lowered.compile()),
                               todo.values())
            for key, figure in zip(todo, figures):
                _CACHE[key] = figure
    return [_CACHE.get(key) or results[key] for key in keys]


def _key(cfg: TrainConfig) -> tuple[Any, ...]:
    return (resolve_auto(cfg), jax.default_backend(), jax.device_count())


def _lowered_step(cfg: TrainConfig | Run) -> Any:
    """The lowered (not compiled) training step of a resolved `cfg`."""
    run = resolve(cfg)
    check_devices(run)
    graphdef, state, batch = abstract_train_state(run)
    loss_fn = functools.partial(lm_loss, aux_weight=run.model.moe_aux_weight)
    program = step_program(graphdef, loss_fn, offload=cfg.offload_optimizer,
                           grad_accum=cfg.grad_accum)
    return program.lower(state, batch)
