"""FP8 compute for a module's linear layers (``GTPConfig.fp8_compute``).

`gtp_jax.shard` routes the matmuls of eligible ``nnx.Linear``, ``nnx.LinearGeneral`` and
``nnx.Einsum`` layers through `fp8_dot_general` (`gtp_jax.pallas.fp8_matmul`: e4m3
activations and weights, e5m2 gradients, per-tensor current scaling), through the layers'
own injection points (``dot_general`` / ``einsum_op``). Nothing else changes: master
weights, optimizer state, the weight gathers and the gradients' reduce-scatters stay as
configured. The built-in decoder's projections are such layers; a user's module gets the
same treatment.

Which layers (`fp8_layers`): those whose per-layer kernel has at least
``GTPConfig.fp8_min_features`` input features and as many output features (smaller GEMMs
gain less than their quantize passes cost), whose path matches no ``GTPConfig.fp8_exclude``
pattern (by default the output head: its logits feed the loss directly) and, when
``GTPConfig.fp8_include`` is given, matches one of those patterns. ``describe()`` of the
sharded module lists them.

Delayed scaling (``fp8_compute="delayed"``): each FP8 layer's injection point gets a small
module instead of a function, `Fp8DelayedMatmul`, holding the layer's amax history (an
`Fp8History`, replicated; stacked layers get a leading layer dim like their kernels), so
the history is part of the module's state (split, scanned, checkpointed with it) and its
"gradient", the next history, reaches the training step (`gtp_jax.sharding.fp8_update`
writes it back, refusing a layer used twice per step). Inside the sharded call the
recorded amax is reduced over every mesh axis (`amax_axes`), so the history stays the same
on every device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gtp_jax.base.config import GTPConfig
from gtp_jax.base.errors import UsageError
from gtp_jax.base.fp8_history import HISTORY_COLUMNS, Fp8History
from gtp_jax.base.metadata import STACKED
from gtp_jax.pallas.fp8_matmul import (
    FP8_MATMUL_DTYPES,
    fp8_matmul,
    fp8_matmul_delayed,
    fp8_matmul_prequantized,
    history_scales,
)
from gtp_jax.sharding.contract import key_name
from gtp_jax.sharding.fp8_gather import is_fp8_gathered
from gtp_jax.sharding.plan import path_str

#: Smallest CUDA compute capability with FP8 GEMMs (Ada / Hopper).
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)

#: Mesh axes the delayed recipe reduces its recorded amaxes over (set by the sharded call).
_AMAX_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "gtp_jax_fp8_amax_axes", default=())


#: The inputs delayed-scaling matmuls have quantized in the sharded call being traced, with
#: the x scale each was quantized with (`_shared_x_scale`).
_X_SCALES: contextvars.ContextVar[list[tuple[Any, jax.Array]] | None] = contextvars.ContextVar(
    "gtp_jax_fp8_x_scales", default=None)


#: How the FP8 matmuls traced in a sharded call quantize (`amax_axes`' ``quant_backend``):
#: None (the Pallas kernels on GPUs), "pallas" or "reference" (XLA's own fusions).
_QUANT_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "gtp_jax_fp8_quant_backend", default=None)


@contextlib.contextmanager
def amax_axes(axes: Sequence[str], quant_backend: str | None = None) -> Iterator[None]:
    """While tracing inside ``jax.shard_map``: the mesh axes over which a replicated
    variable's cotangent is summed (every axis of the mesh for ``P()``). Delayed-scaling
    matmuls traced meanwhile take their recorded amax's maximum over them and return the
    next history from the first device only (`fp8_matmul_delayed`), and share the scale of
    an input several of them read (`_shared_x_scale`). FP8 matmuls traced meanwhile
    quantize with `quant_backend` (`GTPConfig.quant_backend`: None or "pallas", the Pallas
    kernels on GPUs; "reference", XLA's fusions of the same arithmetic)."""
    token = _AMAX_AXES.set(tuple(axes))
    scales = _X_SCALES.set([])
    backend = _QUANT_BACKEND.set(quant_backend)
    try:
        yield
    finally:
        _QUANT_BACKEND.reset(backend)
        _X_SCALES.reset(scales)
        _AMAX_AXES.reset(token)


def _matmul_backend() -> str | None:
    """The ``backend`` of the FP8 matmuls being traced (`gtp_jax.pallas.fp8_matmul`):
    "xla" where the sharded call asked for the reference quantizer, "pallas" for the
    kernels, None (the kernels on GPUs, XLA elsewhere) by default."""
    return {"reference": "xla", "pallas": "pallas"}.get(_QUANT_BACKEND.get())


def _shared_x_scale(lhs: Any, history: jax.Array) -> jax.Array | None:
    """The x scale of the first delayed-scaling matmul of this trace that read `lhs` (the
    same array: q and k/v projections of one normed input, an MLP's gate and up); the first
    one's is its own history's, recorded here for the next ones. None outside `amax_axes`
    (each matmul then takes its own history's).

    Why: each layer's history records the amax of the same x, so their x scales are equal
    in value; but XLA cannot know it, and with two scales it quantizes x twice (two cast
    passes, and two GEMMs where one with the concatenated weights would do). One scale lets
    it merge them, as the tensorwise recipe's equal amaxes do. Each layer still records x's
    amax in its own history."""
    seen = _X_SCALES.get()
    if seen is None:
        return None
    for obj, scale in seen:
        if obj is lhs:
            return scale
    scale = history_scales(history.astype(jnp.float32))[0]
    seen.append((lhs, scale))
    return scale


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                    precision: Any = None, preferred_element_type: Any = None,
                    out_sharding: Any = None, *, history: jax.Array | None = None
                    ) -> jax.Array:
    """``jax.lax.dot_general`` computed as an FP8 matmul (`fp8_matmul`, or
    `fp8_matmul_delayed` with an amax `history`, float32 ``[H, 3]`` or ``[H, 4]``).

    Same arguments and result shape as ``jax.lax.dot_general`` (``precision`` is ignored:
    the operands are FP8). Contractions without batch dims of two operands of one float
    dtype (float32, bfloat16, float16) are computed as ``[M, K] @ [K, N]`` in FP8; any other
    contraction (batch dims, mixed or integer dtypes) runs ``jax.lax.dot_general`` as given
    (and records nothing: a history's cotangent is then zero).

    `rhs` may be a kernel gathered in FP8 (`Fp8GatheredWeight`): contracted on its leading
    dims, its payloads feed the GEMMs as they are (`fp8_matmul_prequantized`); any other
    contraction of it reads its (exact) dequantized value.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    if is_fp8_gathered(rhs):
        rc_norm = tuple(int(d) % rhs.ndim for d in rc)
        if (not lb and not rb and rc_norm == tuple(range(rhs.in_dims))
                and lhs.dtype == rhs.dtype and np.dtype(lhs.dtype) in FP8_MATMUL_DTYPES):
            return _gathered_dot(lhs, rhs, lc, preferred_element_type, history)
        rhs = rhs.value
    plain = (lb or rb or lhs.dtype != rhs.dtype
             or np.dtype(lhs.dtype) not in FP8_MATMUL_DTYPES or not lc)
    if plain:
        extra = {} if out_sharding is None else {"out_sharding": out_sharding}
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **extra)
    lc, rc = tuple(int(d) % lhs.ndim for d in lc), tuple(int(d) % rhs.ndim for d in rc)
    lfree = [d for d in range(lhs.ndim) if d not in lc]
    rfree = [d for d in range(rhs.ndim) if d not in rc]
    k = int(np.prod([lhs.shape[d] for d in lc]))
    x = jnp.transpose(lhs, (*lfree, *lc)).reshape(-1, k)
    w = jnp.transpose(rhs, (*rc, *rfree)).reshape(k, -1)
    backend = _matmul_backend()
    y = (fp8_matmul(x, w, backend=backend) if history is None
         else fp8_matmul_delayed(x, w, history, axes=_AMAX_AXES.get(), backend=backend,
                                 x_scale=_shared_x_scale(lhs, history)))
    y = y.reshape(*(lhs.shape[d] for d in lfree),
                                 *(rhs.shape[d] for d in rfree))
    return y if preferred_element_type is None else y.astype(preferred_element_type)


def _gathered_dot(lhs: jax.Array, rhs: Any, lc: Sequence[int], preferred_element_type: Any,
                  history: jax.Array | None) -> jax.Array:
    """`fp8_dot_general` of `lhs` with an `Fp8GatheredWeight` contracted on its leading
    ``rhs.in_dims`` dims by `lhs`'s dims `lc`."""
    lc = tuple(int(d) % lhs.ndim for d in lc)
    lfree = [d for d in range(lhs.ndim) if d not in lc]
    w, w8, w8t = rhs.matrices()
    x = jnp.transpose(lhs, (*lfree, *lc)).reshape(-1, w.shape[0])
    y = fp8_matmul_prequantized(
        x, w, w8, w8t, rhs.scale, amax_w=rhs.amax, history=history,
        axes=_AMAX_AXES.get() if history is not None else (),
        x_scale=None if history is None else _shared_x_scale(lhs, history),
        backend=_matmul_backend())
    y = y.reshape(*(lhs.shape[d] for d in lfree), *rhs.shape[rhs.in_dims:])
    return y if preferred_element_type is None else y.astype(preferred_element_type)


@dataclasses.dataclass(frozen=True)
class Fp8Promote:
    """A layer's ``promote_dtype`` under FP8 compute: the layer's own promotion, except that
    a kernel gathered in FP8 (`Fp8GatheredWeight`) reaches the layer's ``dot_general``
    whole, so its GEMM reads the payloads (its value is promoted like any kernel)."""

    original: Callable

    def __call__(self, args: tuple, /, *, dtype: Any = None, **kwargs: Any) -> tuple:
        inputs, kernel, *rest = args
        if not is_fp8_gathered(kernel):
            return self.original(args, dtype=dtype, **kwargs)
        inputs, value, *rest = self.original((inputs, kernel.value, *rest), dtype=dtype,
                                             **kwargs)
        return (inputs, kernel.replace(value=value), *rest)


def direct_kernels(module: nnx.Module, layers: Sequence[tuple[tuple, str, str]]
                   ) -> dict[str, int]:
    """The kernels of FP8 `layers` (from `fp8_layers`) that an fp8 gather delivers as an
    `Fp8GatheredWeight`: ``{kernel path: number of leading dims the layer contracts}``.
    ``nnx.Linear`` and ``nnx.LinearGeneral`` GEMMs read its payloads; an ``nnx.Einsum``
    (whose contraction is only known when it runs) reads its dequantized value, which the
    FP8 matmul quantizes back to the same payload (1 stands in for its dims)."""
    out = {}
    for keys, path, attr in layers:
        node = _node_at(module, keys)
        if attr == "einsum_op":
            out[f"{path}/kernel"] = 1
            continue
        if not hasattr(node, "promote_dtype"):
            continue
        if isinstance(node, nnx.LinearGeneral):
            if node.batch_axis:
                continue
            out[f"{path}/kernel"] = len(node.in_features)
        elif isinstance(node, nnx.Linear):
            out[f"{path}/kernel"] = 1
    return out


def fp8_einsum(subscripts: str, *operands: Any, **kwargs: Any) -> jax.Array:
    """``jnp.einsum`` whose contractions run through `fp8_dot_general` (an
    ``nnx.Einsum(einsum_op=...)``)."""
    # A new partial per call: ``jnp.einsum`` is jitted with ``_dot_general`` static, so the
    # same function object would reuse the first trace, with the amax axes and quantizer
    # backend of the sharded call that traced it first (read at trace time).
    return jnp.einsum(subscripts, *operands, _dot_general=functools.partial(fp8_dot_general),
                      **kwargs)


#: The attribute of `Fp8DelayedMatmul` holding its history: the last name of its path in a
#: checkpoint (where `gtp_jax.train.lifecycle.checkpoint` recognizes a history as optional).
FP8_HISTORY_NAME = "amax_history"
#: The layer types FP8 compute applies to, and the attribute each injects its matmul by.
_INJECTION = ((nnx.LinearGeneral, "dot_general"), (nnx.Linear, "dot_general"),
              (nnx.Einsum, "einsum_op"))
_FP8_OP = {"dot_general": fp8_dot_general, "einsum_op": fp8_einsum}


class Fp8DelayedMatmul(nnx.Module):
    """A layer's matmul under delayed scaling, injected as its ``dot_general`` (or
    ``einsum_op``): calls `fp8_dot_general` (`fp8_einsum`) with the layer's amax history.

    Attributes:
      amax_history: `Fp8History`, float32 ``[history_len, 4]`` (``[L, history_len, 4]``
        on a layer stack, ``gtp_stacked`` metadata), replicated.
      op: ``"dot_general"`` or ``"einsum_op"``: the injection point it replaces.
    """

    def __init__(self, history: Fp8History, op: str):
        self.amax_history = history
        self.op = op

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        """The layer's ``dot_general(lhs, rhs, dims, ...)`` or ``einsum_op(subscripts,
        *operands, ...)`` call, in FP8 with this layer's history."""
        dot = functools.partial(fp8_dot_general, history=self.amax_history[...])
        if self.op == "einsum_op":
            subscripts, *operands = args
            return jnp.einsum(subscripts, *operands, _dot_general=dot, **kwargs)
        return dot(*args, **kwargs)


def _features(node: nnx.Module, kernel: tuple[int, ...]) -> tuple[int, int] | None:
    """(input, output) features of a layer's per-layer kernel; None where it is not a
    plain projection (batched ``LinearGeneral``, an ``Einsum`` without a 2-way split)."""
    if isinstance(node, nnx.LinearGeneral):
        if node.batch_axis:
            return None
        n_in = len(node.in_features)
        return int(np.prod(kernel[:n_in])), int(np.prod(kernel[n_in:]))
    if isinstance(node, nnx.Linear):
        return int(kernel[0]), int(kernel[1])
    # Einsum: the kernel's dims contracted with the input are not known without parsing
    # the subscripts; the smallest split of its dims stands for both sides.
    if len(kernel) < 2:
        return None
    return int(min(kernel[0], np.prod(kernel[1:]))), int(np.prod(kernel[1:]))


def fp8_layers(module: nnx.Module, config: GTPConfig) -> list[tuple[tuple, str, str]]:
    """The layers of `module` that FP8 compute applies to under `config`: a list of
    ``(graph path keys, "/"-joined path, injection attribute)``."""
    if config.fp8_compute is None:
        return []
    found = []
    for keys, node in nnx.graph.iter_graph(module):
        attr = next((a for t, a in _INJECTION if isinstance(node, t)), None)
        if attr is None or getattr(node, "kernel", None) is None:
            continue
        path = path_str(key_name(k) for k in keys)
        kernel = node.kernel
        shape = tuple(int(d) for d in kernel.get_value().shape)
        if kernel.get_metadata().get(STACKED, False):
            shape = shape[1:]
        feats = _features(node, shape)
        if feats is None:
            continue
        if any(re.search(p, path) for p in config.fp8_exclude):
            continue
        if config.fp8_include:
            if not any(re.search(p, path) for p in config.fp8_include):
                continue
        elif min(feats) < config.fp8_min_features:
            continue
        found.append((tuple(keys), path, attr))
    return found


def check_fp8_compute(config: GTPConfig, mesh: jax.sharding.Mesh) -> None:
    """Raises a `UsageError` where ``config.fp8_compute`` cannot run on `mesh`'s devices:
    a GPU without FP8 GEMMs (compute capability below 8.9), or a mesh with ``tp > 1`` (the
    tensor-parallel projections run their own collective matmuls, in bf16)."""
    if config.fp8_compute is None:
        return
    if mesh.shape.get("tp", 1) > 1:
        raise UsageError(
            f"GTPConfig.fp8_compute={config.fp8_compute!r} with tp={mesh.shape['tp']}: the "
            "tensor-parallel projections do not compute in FP8 yet; use a mesh with tp=1 "
            "(gtp, dp, cp and ep compose with FP8 compute), or fp8_compute=None.")
    device = mesh.devices.flat[0]
    if device.platform == "gpu":
        cc = getattr(device, "compute_capability", None)
        try:
            major, minor = (int(v) for v in str(cc).split(".")[:2])
        except ValueError:
            return  # unknown: let XLA decide
        if (major, minor) < FP8_MIN_COMPUTE_CAPABILITY:
            raise UsageError(
                f"GTPConfig.fp8_compute={config.fp8_compute!r}: this GPU "
                f"({device.device_kind}, compute capability {cc}) has no FP8 matrix units "
                "(Ada or Hopper and later do); use fp8_compute=None (bf16 compute).")


def inject(module: nnx.Module, layers: Sequence[tuple[tuple, str, str]],
           config: GTPConfig | None = None, mesh: jax.sharding.Mesh | None = None
           ) -> tuple[tuple[str, str, Callable], ...]:
    """Routes the matmuls of `layers` (from `fp8_layers`) in `module` through FP8, in
    place; returns ``(path, attribute, original)`` for each, for `restore`.

    With ``config.fp8_compute == "delayed"`` each layer gets a `Fp8DelayedMatmul` holding a
    zero `Fp8History` of ``config.fp8_history_len`` steps (placed replicated on `mesh` when
    given), else the stateless `fp8_dot_general` / `fp8_einsum`."""
    delayed = config is not None and config.fp8_compute == "delayed"
    originals = []
    for keys, path, attr in layers:
        node = _node_at(module, keys)
        originals.append((path, attr, getattr(node, attr)))
        if attr == "dot_general" and hasattr(node, "promote_dtype"):
            node.promote_dtype = Fp8Promote(node.promote_dtype)  # `restore` unwraps it
        if not delayed:
            setattr(node, attr, _FP8_OP[attr])
            continue
        stacked = bool(node.kernel.get_metadata().get(STACKED, False))
        shape = (config.fp8_history_len, len(HISTORY_COLUMNS))
        if stacked:
            shape = (int(node.kernel.get_value().shape[0]), *shape)
        value = jnp.zeros(shape, jnp.float32)
        if mesh is not None:
            value = jax.device_put(value, jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec()))
        history = Fp8History(value, **({STACKED: True} if stacked else {}))
        setattr(node, attr, nnx.data(Fp8DelayedMatmul(history, attr)))
    return tuple(originals)


def restore(module: nnx.Module, originals: Sequence[tuple[str, str, Callable]]) -> None:
    """Undoes `inject` on a module with the same graph (in place)."""
    by_path = {path: (attr, fn) for path, attr, fn in originals}
    for keys, node in nnx.graph.iter_graph(module):
        path = path_str(key_name(k) for k in keys)
        if path in by_path and isinstance(node, nnx.Module):
            attr, fn = by_path[path]
            # A delayed recipe's matmul module made the attribute a data attribute.
            setattr(node, attr, nnx.static(fn) if isinstance(getattr(node, attr), nnx.Module)
                    else fn)
            if isinstance(getattr(node, "promote_dtype", None), Fp8Promote):
                node.promote_dtype = node.promote_dtype.original


def _node_at(module: nnx.Module, keys: tuple) -> Any:
    for path, node in nnx.graph.iter_graph(module):
        if tuple(path) == keys:
            return node
    raise KeyError(keys)  # unreachable: keys come from the same graph
