"""Small helpers shared by the kernel modules (no kernels here)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from gtp_jax.base.errors import UsageError
from gtp_jax.pallas.formats import MAX_ELEMENTS


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (Triton block dims must be powers of two)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def resolve_interpret(interpret: bool | None) -> bool:
    """``interpret=None`` -> True unless the default JAX backend is a GPU."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret={interpret!r} must be True, False or None (auto: "
                        "interpret unless the default backend is a GPU).")
    return interpret


def compiler_params(num_warps: int) -> Any:
    """Triton compiler parameters (ignored in interpret mode)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def check_pow2(value: int, name: str) -> None:
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise UsageError(f"{name}={value!r} must be a power of two >= 1 (Triton block dims "
                         "are powers of two).")


def check_size(n: int, what: str) -> None:
    if n > MAX_ELEMENTS:
        raise UsageError(f"{what} has {n} elements; the kernels index with int32, so at "
                         f"most {MAX_ELEMENTS}. Split the tensor (e.g. per layer/expert).")


def abs_bits(xf: jax.Array) -> jax.Array:
    """int32 bit patterns of ``|xf|`` (float32): integer order = IEEE magnitude order with
    NaN above inf. Used in-kernel because Triton's float max drops NaNs (maxnum)."""
    return jax.lax.bitcast_convert_type(xf, jnp.int32) & jnp.int32(0x7FFFFFFF)


def saturate(v: jax.Array, limit: float) -> jax.Array:
    """Clamps to [-limit, limit] with selects, so a NaN stays NaN (Triton's float
    min/max are NaN-dropping minnum/maxnum; XLA's propagate: selects agree on both)."""
    v = jnp.where(v > limit, jnp.float32(limit), v)
    return jnp.where(v < -limit, jnp.float32(-limit), v)



def varying_axes(x: Any) -> frozenset:
    """Manual mesh axes `x` is typed as varying over: non-empty only inside
    ``shard_map(check_vma=True)`` (jax names it ``aval.mat.varying`` or, in older
    releases, ``aval.vma``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())


def check_backend_choice(backend: object, choices: tuple[str, ...], caller: str) -> None:
    """A `UsageError` naming `caller` unless `backend` is one of `choices` or None (None:
    the kernel on a GPU where the shapes suit it, else the pure-JAX reference)."""
    if backend not in (None, *choices):
        raise UsageError(f"{caller}: backend={backend!r}; use one of {choices} or None (the "
                         "kernel on a GPU where the shapes suit it, else the reference).")
