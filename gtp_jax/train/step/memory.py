"""The memory a run needs per device, before anything is built: a closed-form lower bound
(`memory_bound`) and the refusals that use it (`check_memory_fits` for device memory,
`check_host_memory` for simulated CPU devices, which all live in this process,
`check_pinned_host` for an offloaded optimizer state in a GPU process's pinned host memory).

A refusal must never turn away a run that fits, so both check the lower bound, not an
estimate: the bound is at most the compiled training step's peak
(`tests/test_plan.py::test_bound_never_exceeds_the_compiled_peak`), and the layout planner
(`gtp_jax.plan`) prunes with the same function. A run over the bound but under the device
limit is compiled; if XLA then runs out of memory, the trainer reports it in one line
(`gtp_jax.train.loop`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import numpy as np
from flax import nnx

from gtp_jax.base import host
from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.base.metadata import STACKED
from gtp_jax.base.xla_flags import (
    PINNED_POOL_ENV,
    default_pinned_pool_gib,
    pinned_pool_bytes,
    pinned_pool_problem,
)
from gtp_jax.models import Transformer
from gtp_jax.sharding.offload import DEFAULT_GROUP_LAYERS, MASTER_DEVICE_DTYPE, stream_units
from gtp_jax.train.config import Run, TrainConfig, resolve
from gtp_jax.train.outputs import observe
from gtp_jax.train.outputs.observe import DeviceMemoryError
from gtp_jax.train.user_model import UserModel


def memory_bound(run: TrainConfig | Run) -> dict[str, int]:
    """A lower bound of the training step's peak bytes per device, without compiling.

    At the gradient clipping every gradient (float32 shards, like the parameters) is alive
    next to the parameters and optimizer state; at the end of the forward pass the saved
    per-layer activations (at least one ``d_model`` vector per token and layer) and the
    logits are. So the peak is at least

        state + max(grads, activations + logits)

    with state = parameters and AdamW's two moments divided over
    ``gtp * tp * ep`` (replicated small weights and padding only add), activations =
    ``n_layers * tokens * d_model`` and logits = ``tokens * vocab`` in the compute dtype,
    tokens = the device's ``batch / grad_accum * seq / (dp * ep * gtp * cp)`` (one
    microbatch), split over tp as well. Parameters are counted as the model has them
    (`TransformerConfig.num_params`: grouped-query attention's smaller k and v
    projections, tied embeddings, experts).
    Offloaded, the moments are in device memory only while their unit is updated (the
    trainer's step streams them after the clipping one unit at a time: a not-stacked
    weight, or one layer of every layer-stacked weight, `gtp_jax.sharding.offload`), so the
    peak is at least ``parameters + max(grads, activations + logits, moments of the largest
    unit)``, and "optimizer" is those moments: the unit that must be in device memory while
    it is updated (the step holds up to about four units at once when its copies overlap
    the updates; the bound counts the one it cannot do without). Moments kept on the
    device (`TrainConfig.offload_exclude`, `resident_params`) count in full, beside the
    parameters, and belong to no unit. With `TrainConfig.offload_master_weights` the
    device's parameters and gradients are bfloat16 and every unit, and every resident
    parameter, carries its float32 master beside its moments.

    With `TrainConfig.keep_gathered_layers` every layer-stacked weight's gathered form is
    held beside the activations (`_kept_gathered_bytes`).

    For your own model (`TrainConfig.model`, a `UserModel`) the parameters are counted from
    the module its factory builds (``nnx.eval_shape``: nothing allocated), each in the
    narrowest parameter dtype; its activations are the model's own and not counted (0), so
    the bound is the state's (and the kept gathered weights of its `gtp_jax.Stack`s).

    Returns:
      ``{"params", "optimizer", "grads", "activations", "total"}`` in bytes.
    """
    run = resolve(run)
    cfg, mc = run.config, run.model
    p_item = np.dtype(mc.param_dtype).itemsize
    a_item = np.dtype(mc.dtype).itemsize
    shards = cfg.gtp * cfg.tp * cfg.ep
    grads = mc.num_params() * p_item // shards
    params = grads
    optimizer = 2 * params
    kept = 0
    if cfg.offload_optimizer:  # at least the unit being updated: its moments (and master)
        if cfg.offload_master_weights:
            params = grads = mc.num_params() * np.dtype(MASTER_DEVICE_DTYPE).itemsize // shards
        kept = _kept_bytes(run)
        unit = _state_parts(cfg) * _largest_unit(mc, cfg.offload_exclude) * p_item // shards
        optimizer = kept + unit
    tokens = (cfg.batch_size // cfg.grad_accum) * cfg.seq_len // (
        cfg.dp * cfg.ep * cfg.gtp * cfg.cp)
    activations = (0 if isinstance(mc, UserModel) else
                   tokens * (mc.n_layers * mc.d_model + mc.vocab_size) * a_item // cfg.tp)
    if cfg.keep_gathered_layers:
        # every layer's gathered weights (a user's Stack too), held from the forward pass
        # to the backward pass
        activations += _kept_gathered_bytes(run)
    if cfg.offload_optimizer:
        total = params + kept + max(grads, activations, unit)
    else:
        total = params + optimizer + max(params, activations)
    return {"params": params, "optimizer": optimizer, "grads": grads,
            "activations": activations, "total": total}


def pinned_host_bound(run: TrainConfig | Run) -> int:
    """A lower bound of the pinned host bytes per device the run holds: with
    ``offload_optimizer``, AdamW's two moments per device as the on-device `memory_bound`
    counts them (padding only adds), and the float32 parameters with
    ``offload_master_weights``; 0 without offload."""
    run = resolve(run)
    cfg = run.config
    if not cfg.offload_optimizer:
        return 0
    # The same model on the device: only the offload fields differ (no new resolution).
    on_device = dataclasses.replace(run, config=dataclasses.replace(
        cfg, offload_optimizer=False, offload_exclude=(), offload_master_weights=False))
    bound = memory_bound(on_device)
    moved = bound["optimizer"] * _state_parts(cfg) // 2
    return moved - _kept_bytes(run)


def pinned_host_peak(run: TrainConfig | Run) -> int:
    """`pinned_host_bound` and the largest layer-stacked state leaf once more: the trainer
    regroups the offloaded state one leaf at a time (`gtp_jax.train.TrainStep`: at its first
    step and after each ``sync``, e.g. before a checkpoint), holding that leaf twice."""
    run = resolve(run)
    cfg = run.config
    need = pinned_host_bound(run)
    if need == 0:
        return 0
    stacked = [int(np.prod(shape)) for path, shape, is_stacked in _param_shapes(run.model)
               if is_stacked and not (cfg.offload_exclude and _matches(path, cfg.offload_exclude))]
    item = np.dtype(run.model.param_dtype).itemsize
    return need + max(stacked, default=0) * item // (cfg.gtp * cfg.tp * cfg.ep)


def _kept_gathered_bytes(run: Run) -> int:
    """Bytes per device of every layer's gathered weights that
    `TrainConfig.keep_gathered_layers` holds from the forward pass to the backward pass: the
    layer-stacked parameters in their gathered form (the gather dtype, or about a byte per
    element for FP8 / MXFP8 and half a byte for NVFP4), split over tp (and, a lower bound,
    ep)."""
    cfg = run.config
    elements = sum(int(np.prod(shape)) for _, shape, stacked in _param_shapes(run.model)
                   if stacked)
    if cfg.gather_format == "nvfp4":
        nbytes = elements // 2
    elif cfg.gather_format is not None:
        nbytes = elements
    else:
        nbytes = elements * np.dtype(cfg.gather_dtype or run.model.param_dtype).itemsize
    return nbytes // (cfg.tp * cfg.ep)


def _state_parts(cfg: TrainConfig) -> int:
    """Parameter-shaped float32 arrays an offloaded step streams per parameter: AdamW's two
    moments, and the master weights with ``offload_master_weights``."""
    return 3 if cfg.offload_master_weights else 2


def _kept_bytes(run: Run) -> int:
    """Bytes per device of the moments (and masters) an offloaded run keeps on the device
    (`resident_params`, split like the parameters over ``gtp * tp * ep``)."""
    cfg = run.config
    p_item = np.dtype(run.model.param_dtype).itemsize
    return _state_parts(cfg) * resident_params(run) * p_item // (cfg.gtp * cfg.tp * cfg.ep)


def resident_params(run: TrainConfig | Run) -> int:
    """Parameter elements (unsharded, unpadded) whose optimizer state an offloaded run
    keeps in device memory: those whose path (e.g. ``blocks/mlp/down/kernel``) matches a
    `TrainConfig.offload_exclude` pattern; 0 without offload."""
    run = resolve(run)
    cfg = run.config
    if not cfg.offload_optimizer or not cfg.offload_exclude:
        return 0
    return sum(n for path, n in param_sizes(run.model) if _matches(path, cfg.offload_exclude))


@functools.cache
def param_sizes(model_cfg: Any) -> tuple[tuple[str, int], ...]:
    """``("blocks/mlp/down/kernel", elements)`` of every parameter of the decoder of
    `model_cfg` (a stacked weight counts all its layers), unsharded and unpadded, from
    ``nnx.eval_shape``: nothing is allocated."""
    return tuple((path, int(np.prod(shape))) for path, shape, _ in _param_shapes(model_cfg))


def _matches(path: str, patterns: tuple[str, ...]) -> bool:
    return any(re.search(p, path) for p in patterns)


#: How much larger than its arrays XLA's pinned host pool can grow, at most about: its BFC
#: allocator adds regions of doubling size, each at least the request it was added for, and
#: a large array that does not fit a region's free tail opens the next one (arrays of 33
#: GiB each: regions of 64, 64 and 128 GiB, 256 GiB for the 99 GiB held).
POOL_GROWTH = 3


def pinned_host_problem(cfg: TrainConfig | Run, *, pool_bytes: int, available_bytes: int | None,
                        local_devices: int) -> str | None:
    """Why `cfg`'s offloaded optimizer state (`pinned_host_peak`: the state and one leaf
    twice while it is regrouped) cannot fit in pinned host memory, or None:
    over XLA's pool per device; over the host's available memory for all of this process's
    devices; or pools whose caps together exceed that memory while the state is large
    enough (`POOL_GROWTH`) that their growth could reach it.

    Args:
      cfg: the run.
      pool_bytes: XLA's pinned host pool per device (`gtp_jax.base.xla_flags.pinned_pool_bytes`).
      available_bytes: the host's available memory (None: unknown, not checked).
      local_devices: this process's devices, whose state shares the host.
    """
    need = pinned_host_peak(cfg)
    if need == 0:
        return None
    gib = 2**30
    more = ("shard the state over more devices (a larger TrainConfig.gtp or tp) or keep it "
            "on the device (TrainConfig.offload_optimizer=False)")
    problem = pinned_pool_problem(need, pool_bytes)
    if problem:
        return f"{problem}, or {more}"
    if available_bytes is not None and need * local_devices > available_bytes:
        return (f"the offloaded optimizer state needs at least {need / gib:.2f} GiB of pinned "
                f"host memory per device x {local_devices} devices in this process = "
                f"{need * local_devices / gib:.2f} GiB but the host has "
                f"{available_bytes / gib:.2f} GiB available; {more}")
    if (available_bytes is not None and pool_bytes * local_devices > available_bytes
            and POOL_GROWTH * need * local_devices > available_bytes):
        fit = default_pinned_pool_gib(available_bytes, local_devices)
        fix = (f"set {PINNED_POOL_ENV}={fit} before the process starts JAX (it holds the "
               f"{need / gib:.2f} GiB), or {more}" if fit * gib >= need else more)
        return (f"XLA's pinned host pool grows in regions of doubling size up to its cap, "
                f"{pool_bytes / gib:.0f} GiB per device ({PINNED_POOL_ENV}): for an "
                f"offloaded state of {need / gib:.2f} GiB per device the pools of "
                f"{local_devices} devices may take up to "
                f"{pool_bytes * local_devices / gib:.0f} GiB, more than the host's "
                f"{available_bytes / gib:.2f} GiB available, and the kernel would end the "
                f"process while the state is built; {fix}")
    return None


def check_pinned_host(cfg: TrainConfig | Run, pool_bytes: int | None = None,
                      available: int | None = None) -> None:
    """Refuses an offloaded run on a GPU whose optimizer state cannot fit in pinned host
    memory (`pinned_host_problem`; defaults: this process's pool and the host's available
    memory), before anything is built: XLA would fail only while building the state, after
    minutes.

    Raises:
      DeviceMemoryError: it cannot fit.
    """
    run = resolve(cfg)
    if not run.config.offload_optimizer:  # nothing pinned: no host figures to read
        return
    problem = pinned_host_problem(
        run, pool_bytes=pinned_pool_bytes() if pool_bytes is None else pool_bytes,
        available_bytes=host.available_bytes() if available is None else available,
        local_devices=jax.local_device_count())
    if problem:
        raise DeviceMemoryError(problem)


@functools.cache
def _param_shapes(model_cfg: Any) -> tuple[tuple[str, tuple[int, ...], bool], ...]:
    """(``/``-joined path, shape, layer-stacked) of each parameter of the decoder of
    `model_cfg` (of the user's module for a `UserModel`)."""
    if isinstance(model_cfg, UserModel):
        return tuple((path, shape, stacked)
                     for path, shape, _, stacked in model_cfg.param_shapes())
    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    return tuple(("/".join(str(k) for k in path), tuple(v.get_value().shape),
                  bool(v.get_metadata().get(STACKED, False)))
                 for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


@functools.cache
def _largest_unit(model_cfg: Any, resident: tuple[str, ...] = ()) -> int:
    """Parameter elements of the largest unit the offloaded step streams
    (`gtp_jax.sharding.offload.stream_units` with its default layers per unit: a weight that
    is not layer-stacked, or that many layers of every stacked weight; the weights matching
    a `resident` pattern stay on the device and belong to none), unsharded and unpadded."""
    shapes = _param_shapes(model_cfg)
    values = [jax.ShapeDtypeStruct(s, np.float32) for _, s, _ in shapes]
    stacked = [st for _, _, st in shapes]
    keep = [_matches(p, resident) for p, _, _ in shapes]
    units = stream_units(values, stacked, DEFAULT_GROUP_LAYERS, keep)

    def elements(i: int, span: tuple[int, int] | None) -> int:
        shape = values[i].shape
        return int(np.prod(shape)) if span is None else (
            (span[1] - span[0]) * int(np.prod(shape[1:])))

    return max((sum(elements(i, span) for i, span in unit) for unit in units), default=0)


def memory_advice(cfg: TrainConfig | Run, bound: dict[str, int]) -> str:
    """What to change when `cfg` does not fit, given its `memory_bound`: only the changes
    that apply (a remat policy that recomputes more than `cfg.remat`; optimizer offload when
    the optimizer state is on the device and a large part of the bound; more sharding when
    some axis still replicates the weights), ending with the planner command that
    searches them all. Fields are named ``TrainConfig.<field>`` (the CLI names its flags)."""
    cfg = resolve(cfg).config
    changes = ["lower TrainConfig.batch_size or TrainConfig.seq_len"]
    more_remat = {"none": "'dots' or 'full'", "dots": "'full'"}.get(cfg.remat)
    if more_remat and cfg.model is None:  # a user's model applies (or not) its own remat
        changes.append(f"set TrainConfig.remat to {more_remat}")
    if not cfg.offload_optimizer and bound["optimizer"] >= bound["total"] // 4:
        changes.append(f"set TrainConfig.offload_optimizer (AdamW's moments, "
                       f"{bound['optimizer'] / 2**30:.2f} GiB per device, in host memory)")
    if cfg.dp > 1 or cfg.cp > 1:
        changes.append("shard the weights over more devices (a larger TrainConfig.gtp or "
                       "tp, a smaller dp or cp)")
    else:
        changes.append("run on more devices")
    return (", ".join(changes[:-1]) + f" or {changes[-1]}; `python -m gtp_jax plan` ranks the "
            "layouts that fit.")


def memory_parts(bound: dict[str, int]) -> str:
    """``params 0.01, optimizer 0.02, ...`` (GiB) of a `memory_bound`, for messages."""
    return ", ".join(f"{k} {v / 2**30:.2f}" for k, v in bound.items() if k != "total")


def check_memory_fits(run: TrainConfig | Run, bytes_limit: int | None = None
                      ) -> dict[str, int]:
    """Refuses a run whose memory per device cannot fit: its `memory_bound` exceeds the
    device's limit (so no run that fits is refused); on simulated CPU devices, the host's
    memory (`check_host_memory`); on GPUs, an offloaded optimizer state over the pinned
    host memory (`check_pinned_host`).

    Args:
      run: the run (a `TrainConfig` is resolved first).
      bytes_limit: the per-device limit; None: ``memory_stats()["bytes_limit"]`` of the
        first device, and no check where the backend reports none (CPU).

    Returns:
      The `memory_bound` of `cfg`.

    Raises:
      DeviceMemoryError: the bound exceeds a limit.
    """
    run = resolve(run)
    bound = memory_bound(run)
    if bytes_limit is None:
        bytes_limit = observe.device_memory_limit()
    if bytes_limit is not None and bound["total"] > bytes_limit:
        raise DeviceMemoryError(
            f"the run needs at least {bound['total'] / 2**30:.2f} GiB per device "
            f"({memory_parts(bound)}) but a device has {bytes_limit / 2**30:.2f} GiB; "
            + memory_advice(run, bound)
        )
    if jax.default_backend() == "cpu":
        check_host_memory(run, bound)
    else:  # the CPU backend's pinned host memory is its ordinary memory, checked above
        check_pinned_host(run)
    return bound


def check_host_memory(cfg: TrainConfig | Run, bound: dict[str, int] | None = None,
                      available: int | None = None) -> None:
    """Refuses a run on simulated CPU devices whose `memory_bound` times the device count
    exceeds the host's available memory (every simulated device lives in this process; such
    a run would grow until the kernel kills it, without a message).

    Args:
      cfg: the run.
      bound: `memory_bound` of `cfg` (None: computed).
      available: the host's available bytes; None: `gtp_jax.base.host.available_bytes`
        (no check where it is unknown).

    Raises:
      DeviceMemoryError: over the available memory; names a smaller preset that fits (if
        one does), and the batch and sequence flags.
    """
    available = host.available_bytes() if available is None else available
    if available is None:
        return
    run = resolve(cfg)
    bound = memory_bound(run) if bound is None else bound
    devices = jax.local_device_count()  # this process's share of the mesh
    need = bound["total"] * devices
    if need <= available:
        return
    advice = "lower TrainConfig.batch_size or TrainConfig.seq_len"
    smaller = _fitting_preset(run, available)
    if smaller is not None:
        advice = f"use a smaller TrainConfig.preset such as {smaller!r}, or " + advice
    raise DeviceMemoryError(
        f"the run needs at least {bound['total'] / 2**30:.2f} GiB per device x "
        f"{devices} simulated CPU devices in this process = {need / 2**30:.2f} GiB of host "
        f"memory, but {available / 2**30:.2f} GiB are available; {advice}.")


def _fitting_preset(run: Run, available: int) -> str | None:
    """The largest preset smaller than `run`'s whose run fits in `available` host bytes."""
    from gtp_jax.models import PRESETS  # noqa: PLC0415

    if run.config.init_from_hf is not None or run.config.model is not None:
        return None
    devices = jax.local_device_count()
    sizes = []
    for name in PRESETS:
        try:  # another run: resolved on its own
            other = resolve(dataclasses.replace(run.config, preset=name), run.backend)
            sizes.append((other.model.num_params(), memory_bound(other)["total"] * devices,
                          name))
        except (UsageError, UsageTypeError):
            continue
    mine = run.model.num_params()
    fits = [(params, name) for params, need, name in sizes if params < mine
            and need <= available]
    return max(fits)[1] if fits else None
