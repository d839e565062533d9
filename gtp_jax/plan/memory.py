"""A layout's memory per device: a closed-form lower bound (`memory_bound`, to prune without
compiling) and the exact figure of the compiled training step (`compiled_memory`).

`compiled_memory` lowers and compiles the very program `gtp_jax.train.train` runs (the
`gtp_jax.train.step.step_program` of the model and optimizer `build_model_and_optimizer`
builds), with abstract arguments: the model and optimizer are built under
``nnx.eval_shape`` (no weight is materialized) and given the shardings `gtp_jax.shard` and
`gtp_jax.train.TrainStep` place them with. No step runs. The peak is read from XLA's
compiled memory analysis:

    peak = argument + output - alias + temp + generated code        (bytes per device)

(the donated state's outputs alias its arguments and are counted once). On a GPU host these
are the GPU compiler's buffers; on a CPU host, the CPU compiler's for the simulated mesh.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gtp_jax
from gtp_jax.base.metadata import STACKED
from gtp_jax.models import Transformer, lm_loss
from gtp_jax.sharding.offload import DEFAULT_GROUP_LAYERS, host_shapes, stream_units
from gtp_jax.train.config import (
    TrainConfig,
    check_devices,
    gtp_config,
    make_optimizer,
    model_config,
    resolve_auto,
)
from gtp_jax.train.step import map_opt_state, step_program

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


def memory_bound(cfg: TrainConfig) -> dict[str, int]:
    """A lower bound of the training step's peak bytes per device, without compiling.

    At the gradient clipping every gradient (float32 shards, like the parameters) is alive
    next to the parameters and optimizer state; at the end of the forward pass the saved
    per-layer activations (at least one ``d_model`` vector per token and layer) and the
    logits are. So the peak is at least

        state + max(grads, activations + logits)

    with state = parameters and AdamW's two moments divided over
    ``gtp * tp * ep`` (replicated small weights and padding only add), activations =
    ``n_layers * tokens * d_model`` and logits = ``tokens * vocab`` in the compute dtype,
    tokens = the device's ``batch * seq / (dp * ep * gtp * cp)``, split over tp as well.
    Offloaded, the moments are in device memory only while their unit is updated (the
    trainer's step streams them after the clipping one unit at a time: a not-stacked
    weight, or one layer of every layer-stacked weight, `gtp_jax.sharding.offload`), so the
    peak is at least ``parameters + max(grads, activations + logits, moments of the largest
    unit)``, and "optimizer" is those moments: the unit that must be in device memory while
    it is updated (the step holds up to about four units at once when its copies overlap
    the updates; the bound counts the one it cannot do without).

    Returns:
      ``{"params", "optimizer", "grads", "activations", "total"}`` in bytes.
    """
    cfg = resolve_auto(cfg)
    mc = model_config(cfg)
    p_item = np.dtype(mc.param_dtype).itemsize
    a_item = np.dtype(mc.dtype).itemsize
    shards = cfg.gtp * cfg.tp * cfg.ep
    params = mc.num_params() * p_item // shards
    optimizer = 2 * params
    if cfg.offload_optimizer:  # at least the unit being updated: its moments
        optimizer = 2 * _largest_unit(mc) * p_item // shards
    tokens = cfg.batch_size * cfg.seq_len // (cfg.dp * cfg.ep * cfg.gtp * cfg.cp)
    activations = tokens * (mc.n_layers * mc.d_model + mc.vocab_size) * a_item // cfg.tp
    if cfg.offload_optimizer:
        total = params + max(params, activations, optimizer)
    else:
        total = params + optimizer + max(params, activations)
    return {"params": params, "optimizer": optimizer, "grads": params,
            "activations": activations, "total": total}


@functools.cache
def _largest_unit(model_cfg: Any) -> int:
    """Parameter elements of the largest unit the offloaded step streams
    (`gtp_jax.sharding.offload.stream_units` with its default layers per unit: a weight that
    is not layer-stacked, or that many layers of every stacked weight), unsharded and
    unpadded, from ``nnx.eval_shape``: nothing is allocated."""
    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    values = [v.get_value() for _, v in flat]  # jax.ShapeDtypeStruct
    stacked = [bool(v.get_metadata().get(STACKED, False)) for _, v in flat]
    units = stream_units(values, stacked, DEFAULT_GROUP_LAYERS)

    def elements(i: int, span: tuple[int, int] | None) -> int:
        shape = values[i].shape
        return int(np.prod(shape)) if span is None else (
            (span[1] - span[0]) * int(np.prod(shape[1:])))

    return max(sum(elements(i, span) for i, span in unit) for unit in units)


def abstract_train_state(cfg: TrainConfig) -> tuple[Any, nnx.State, jax.ShapeDtypeStruct]:
    """``(graphdef, state, batch)`` of `gtp_jax.train.train`'s step for `cfg`, abstract:
    ``jax.ShapeDtypeStruct`` leaves with the shardings the trainer places them with (the
    parameters' and moments' from `gtp_jax.shard`'s plan, host memory for an offloaded
    optimizer state, replicated scalars), and the batch ``int32[batch, seq + 1]`` split over
    the data axes. Nothing is allocated on the devices."""
    cfg = resolve_auto(cfg)
    mesh = gtp_jax.make_mesh(dp=cfg.dp, gtp=cfg.gtp, tp=cfg.tp, ep=cfg.ep, cp=cfg.cp)
    model_cfg = model_config(cfg)

    def build() -> tuple[gtp_jax.ShardedModule, nnx.Optimizer]:
        model = gtp_jax.shard(Transformer(model_cfg, rngs=nnx.Rngs(cfg.seed)), mesh,
                              gtp_config(cfg))
        return model, nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)

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
    if cfg.offload_optimizer:
        state = map_opt_state(state, host_shapes)
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
    cfg = resolve_auto(cfg)
    key = (cfg, jax.default_backend(), jax.device_count())
    if key in _CACHE:
        return _CACHE[key]
    check_devices(cfg)
    graphdef, state, batch = abstract_train_state(cfg)
    loss_fn = functools.partial(lm_loss, aux_weight=model_config(cfg).moe_aux_weight)
    program = step_program(graphdef, loss_fn, offload=cfg.offload_optimizer,
                           grad_accum=cfg.grad_accum)
    figure = MemoryFigure.of(program.lower(state, batch).compile())
    _CACHE[key] = figure
    return figure
