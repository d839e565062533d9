"""`shard_init`: build a GTP-sharded module where it lives, never whole on one device.

`gtp_jax.shard(make_module(), mesh)` first creates every weight in full on the default
device, then copies each into its padded 1/N layout: the peak is twice the parameters, and a
model larger than one device cannot be built at all. `shard_init` plans the placement from
the abstract module (``nnx.eval_shape``: shapes, dtypes, metadata, nothing allocated) and
then runs one jitted program that creates the module and stores each weight in its layout,
with ``out_shardings`` the planned shardings, so XLA's partitioner has each device compute
only its own shards.

The values are those of `shard(make_module(), ...)` bit for bit: each operation of
`make_module` is compiled on its own inside the program (`_op_by_op`), as eager execution
compiles it, so XLA cannot round differently by fusing them; and JAX's random bits do not
depend on how a computation is partitioned when ``jax_threefry_partitionable`` is on (the
default since jax 0.5, and nothing here changes it). With the flag off the values are still
the same bits, but the partitioner then has each device generate whole weights before
keeping its shard: the program's temporaries exceed the whole model, and the memory saving
is lost (both seen on a simulated 8-device CPU mesh).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.extend import core as jcore
from jax.sharding import Mesh

from gtp_jax.base.config import GTPConfig
from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.sharding.module import (
    Placement,
    ShardedModule,
    _flat_variables,
    _validate_shard_args,
    assemble,
    plan_placement,
)


def shard_init(make_module: Callable[[], nnx.Module], mesh: Mesh,
               config: GTPConfig | None = None) -> ShardedModule:
    """Builds ``make_module()`` directly in `gtp_jax.shard`'s sharded layout.

    Same result as ``gtp_jax.shard(make_module(), mesh, config)``, bit for bit (values,
    shardings, metadata, ``describe()``), but no device ever holds more than its own shards
    of a weight: the module is created inside one jitted program whose outputs are placed
    with the planned ``NamedSharding``s (padded, 1/N over ``config.axis``, split over
    ``tp``/``ep``), so each device computes only what it keeps.

    Args:
      make_module: a callable with no arguments returning a Flax NNX module, e.g.
        ``lambda: Transformer(cfg, rngs=nnx.Rngs(0))``. It is called twice (abstractly,
        then inside ``jax.jit``), so it must build the same module each time: derive every
        random value from an ``nnx.Rngs`` seeded inside it, read no array created outside.
      mesh: a mesh containing ``config.axis`` (see `gtp_jax.make_mesh`).
      config: a `GTPConfig`; default ``GTPConfig()``.

    Returns:
      A `ShardedModule`, as `gtp_jax.shard` returns.

    Raises:
      UsageTypeError: `make_module` is not callable or does not return an ``nnx.Module``.
      UsageError: `make_module` builds a different module structure when traced; or any
        error `gtp_jax.shard` raises for the module, mesh or config.

    Example:
      >>> model = gtp_jax.shard_init(lambda: MyModel(rngs=nnx.Rngs(0)), mesh)  # doctest: +SKIP
    """
    placement, program = _init_program(make_module, mesh, config)
    return assemble(placement, _fill(placement, program()))


def compiled_init(make_module: Callable[[], nnx.Module], mesh: Mesh,
                  config: GTPConfig | None = None) -> jax.stages.Compiled:
    """The program `shard_init` runs, compiled and not run: its ``memory_analysis()`` says
    what one device holds (outputs: its shards) and needs (temporaries) while building."""
    _, program = _init_program(make_module, mesh, config)
    return program


def _init_program(make_module: Any, mesh: Any, config: Any
                  ) -> tuple[Placement, jax.stages.Compiled]:
    """(the placement plan, the compiled program returning each array variable's stored
    value)."""
    if isinstance(make_module, nnx.Module):
        raise UsageTypeError(
            "gtp_jax.shard_init: make_module must be a callable with no arguments that builds "
            f"the module, got the module {type(make_module).__name__} itself; pass "
            "lambda: MyModel(...), or use gtp_jax.shard(module, mesh) for a built module.")
    if not callable(make_module):
        raise UsageTypeError(
            "gtp_jax.shard_init: make_module must be a callable with no arguments returning "
            f"an nnx.Module (e.g. lambda: MyModel(rngs=nnx.Rngs(0))), got "
            f"{type(make_module).__name__}; to shard a module you already built, use "
            "gtp_jax.shard(module, mesh).")
    config = GTPConfig() if config is None else config
    abstract = nnx.eval_shape(make_module)
    if not isinstance(abstract, nnx.Module):
        raise UsageTypeError(
            "gtp_jax.shard_init: make_module must return a flax.nnx.Module, returned "
            f"{type(abstract).__name__}.")
    _validate_shard_args(abstract, mesh, config)
    placement = plan_placement(abstract, mesh, config)
    shardings = placement.shardings()
    arrays = [i for i, s in enumerate(shardings) if s is not None]

    def create() -> list[jax.Array]:
        graphdef, state = nnx.split(make_module())
        if graphdef != placement.graphdef:
            raise UsageError(
                "gtp_jax.shard_init: make_module built a different module structure when "
                "traced; it must build the same module on every call.")
        values = [v.get_value() for v in _flat_variables(state)[1]]
        return [values[i] for i in arrays]

    created = jax.make_jaxpr(create)()

    def build() -> list[jax.Array]:
        values = _op_by_op(created)
        return [x if placement.plans[i] is None else placement.plans[i].to_stored(x)
                for i, x in zip(arrays, values)]

    return placement, _compiled(build, [shardings[i] for i in arrays])


#: Compiled build programs by what they compute (`_compiled`), newest last.
_PROGRAMS: OrderedDict[Hashable, jax.stages.Compiled] = OrderedDict()
#: How many `_PROGRAMS` are kept (each holds only a small executable).
_KEEP_PROGRAMS = 8


def _compiled(build: Callable[[], list[jax.Array]], out_shardings: list[Any]
              ) -> jax.stages.Compiled:
    """``jax.jit(build, out_shardings=...)``, compiled, or the program compiled for an
    earlier `build` that traced to the same program.

    A model built again with the same factory, mesh and config (a notebook cell run
    again, a fresh model to restore a checkpoint into, a test suite) traces to the same program
    from a new closure, which ``jax.jit``'s own cache (keyed on the function object)
    never matches; lowering and compiling it again took most of a repeated build. The
    key is the traced program itself: its printed jaxpr (every operation, shape, dtype,
    literal such as the seed, and nested jaxpr), its constants' bytes, the output
    shardings and JAX's tracing configuration, so two builds share a program only when
    they compute the same values into the same layout.
    """
    closed = jax.make_jaxpr(build)()
    consts = _consts_key(closed.consts)
    key = None if consts is None else (str(closed.jaxpr), consts, tuple(out_shardings),
                                       _trace_config())
    program = _PROGRAMS.pop(key, None) if key is not None else None
    if program is None:
        program = jax.jit(jcore.jaxpr_as_fun(closed),
                          out_shardings=list(out_shardings)).lower().compile()
    if key is None:  # a constant this cannot read back: compiled, not kept
        return program
    _PROGRAMS[key] = program
    while len(_PROGRAMS) > _KEEP_PROGRAMS:
        _PROGRAMS.popitem(last=False)
    return program


def _consts_key(consts: list[Any]) -> tuple | None:
    """The constants' shapes, dtypes and a digest of their bytes; None where one cannot be
    read back whole (a PRNG key made outside `make_module`, an array of other processes)."""
    key = []
    for c in consts:
        try:
            if jax.dtypes.issubdtype(getattr(c, "dtype", None), jax.dtypes.prng_key):
                c = jax.random.key_data(c)
            a = np.asarray(c)
        except (TypeError, ValueError, RuntimeError):
            return None
        key.append((a.shape, str(a.dtype), hashlib.sha256(a.tobytes()).hexdigest()))
    return tuple(key)


def _trace_config() -> Hashable:
    """JAX's configuration that tracing and lowering read (``jax.jit``'s own cache key
    part); None where this JAX has no such function (then only the jaxpr keys)."""
    try:
        from jax._src import config as jax_config  # noqa: PLC0415

        return jax_config.trace_context()
    except (ImportError, AttributeError):
        return None


def _op_by_op(closed: Any) -> list[jax.Array]:
    """Evaluates a closed jaxpr as JAX runs it outside ``jit``, one operation at a time.

    Inside one jitted program XLA would fuse and simplify across operations (e.g. fold
    ``normal(key) * stddev``'s two constant factors into one), changing the last bit of
    some initial values. An optimization barrier around each top-level operation's inputs
    and outputs keeps every operation (or nested jitted function, e.g. ``random.normal``)
    compiled on its own, as eager execution compiles it, so the values are the same bits.
    Sharding propagation crosses the barriers, so each device still computes only its
    shards.
    """
    env: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in closed.jaxpr.eqns:
        inputs = [read(v) for v in eqn.invars]
        if inputs:
            inputs = jax.lax.optimization_barrier(inputs)
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*inputs, **eqn.primitive.get_bind_params(eqn.params))
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, jax.lax.optimization_barrier(outs)))
    return [read(v) for v in closed.jaxpr.outvars]


def _fill(placement: Placement, arrays: list[jax.Array]) -> list[Any]:
    """Every variable's value: the program's arrays, in order, and non-array values as the
    abstract module holds them."""
    it = iter(arrays)
    return [next(it) if s is not None else v.get_value()
            for s, v in zip(placement.shardings(), placement.variables)]


__all__ = ["compiled_init", "shard_init"]
