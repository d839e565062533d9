"""FP8 weight gathers that feed FP8 GEMMs as they are (``gather_format="fp8"`` with
``GTPConfig.fp8_compute``).

The kernel of each FP8-compute layer (`gtp_jax.sharding.fp8.fp8_layers`) is gathered as an
`Fp8GatheredWeight` instead of a dequantized array: every device casts its own shard to e4m3
with the scale `fp8_matmul` would give the whole weight (`weight_scale` of the amax, agreed
over the GTP axis by one ``pmax`` for all of a layer's kernels), in both layouts at once
(`cast_weight`), and the payloads are all-gathered as they are. The layer's injected
``dot_general`` hands them to `fp8_matmul_prequantized`: the forward GEMM reads the
transposed payload, the backward's ``dx`` the other, and nothing is dequantized or
quantized again. Because the scale and the cast are those of `fp8_matmul` on the whole
weight, the result is the same as gathering the weight in bf16 and quantizing it there.

Each layout is only gathered where it is read: the forward pass reads the transposed
payload, the backward pass (which re-gathers the weight) the other, and XLA drops the
unused all-gather of each. So one byte per element crosses the link per gather, as with
the dequantizing fp8 format.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gtp_jax.sharding.gather_spec import GatherSpec


@jax.tree_util.register_pytree_node_class
class Fp8GatheredWeight:
    """A gathered weight as an FP8 GEMM consumes it; stands in for the kernel array.

    Attributes:
      value: the weight's values, logical shape, compute dtype (``bits / scale``, exact).
        Nothing in an FP8 GEMM reads it, so XLA drops it; its cotangent is the weight's
        gradient (reduce-scattered by the gather's backward rule). Any other use of the
        weight (``jnp.asarray(w)``, ``w[idx]``, ``w.T``...) reads it: correct, not fast.
      bits: uint8 e4m3 bit patterns, logical shape.
      bits_t: the same payload with the `in_dims` leading dims moved last (``[N..., K...]``).
      scale: float32[], ``value == bits / scale``, a power of two.
      amax: float32[], the weight's ``max |w|`` (recorded by delayed scaling).
      in_dims: how many leading dims the layer contracts with its input (static).
    """

    __slots__ = ("value", "bits", "bits_t", "scale", "amax", "in_dims")

    def __init__(self, value: Any, bits: Any, bits_t: Any, scale: Any, amax: Any,
                 in_dims: int):
        self.value = value
        self.bits = bits
        self.bits_t = bits_t
        self.scale = scale
        self.amax = amax
        self.in_dims = in_dims

    def tree_flatten(self):
        return (self.value, self.bits, self.bits_t, self.scale, self.amax), self.in_dims

    @classmethod
    def tree_unflatten(cls, in_dims: int, children: tuple) -> Fp8GatheredWeight:
        return cls(*children, in_dims)

    def replace(self, **changes: Any) -> Fp8GatheredWeight:
        fields = {k: getattr(self, k) for k in self.__slots__}
        return Fp8GatheredWeight(**{**fields, **changes})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)

    @property
    def dtype(self) -> Any:
        return self.value.dtype

    @property
    def ndim(self) -> int:
        return len(self.bits.shape)

    @property
    def size(self) -> int:
        return math.prod(self.bits.shape)

    def matrices(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(value [K, N], bits [K, N], bits_t [N, K])``: the 2-D views an FP8 GEMM takes."""
        k = math.prod(self.shape[: self.in_dims])
        n = self.size // k
        return (self.value.reshape(k, n), self.bits.reshape(k, n),
                self.bits_t.reshape(n, k))

    def __getitem__(self, key: Any) -> Any:
        # ``variable[...]`` (how NNX layers read a kernel) keeps the payloads.
        return self if key is Ellipsis else self.value[key]

    def __jax_array__(self) -> jax.Array:
        return self.value

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight(shape={self.shape}, in_dims={self.in_dims})"


def is_fp8_gathered(x: Any) -> bool:
    return isinstance(x, Fp8GatheredWeight)


def gathered_like(spec: GatherSpec) -> Fp8GatheredWeight:
    """The `Fp8GatheredWeight` of `spec`, as ``jax.ShapeDtypeStruct`` leaves."""
    shape, k = spec.logical_shape, spec.fp8_in_dims
    u8 = np.dtype(np.uint8)
    f32 = np.dtype(np.float32)
    return Fp8GatheredWeight(
        jax.ShapeDtypeStruct(shape, spec.compute_dtype), jax.ShapeDtypeStruct(shape, u8),
        jax.ShapeDtypeStruct((*shape[k:], *shape[:k]), u8), jax.ShapeDtypeStruct((), f32),
        jax.ShapeDtypeStruct((), f32), k)


def gather_fp8(shards: list[jax.Array], specs: list[GatherSpec]) -> list[Fp8GatheredWeight]:
    """Gathers FP8-compute kernels (``spec.fp8_in_dims > 0``) as `Fp8GatheredWeight`s,
    inside ``jax.shard_map`` over ``spec.axis`` (or anywhere for a 1-wide axis).

    Args:
      shards: local shards, ``spec.shard_shape`` / ``spec.param_dtype`` each; all of one
        GTP axis.
      specs: their `GatherSpec`s.

    Returns:
      One `Fp8GatheredWeight` per shard (logical shape, ``spec.compute_dtype`` values).
    """
    from gtp_jax.pallas import fp8_matmul as fm  # deferred: kernels load when FP8 is used
    from gtp_jax.pallas.amax import multi_amax_pallas
    from gtp_jax.pallas.formats import amax_reference

    axis, wide = specs[0].axis, specs[0].axis_size > 1
    # The kernels on GPUs unless the reference is asked for; the XLA path elsewhere.
    kernels = jax.default_backend() == "gpu" and specs[0].quant_backend != "reference"
    if kernels:
        local = jnp.stack(multi_amax_pallas(shards, interpret=False))
    else:
        local = jnp.stack([amax_reference(s) for s in shards])
    # One all-reduce for all of a layer's kernels; padding is zeros and never the max.
    amax = jax.lax.pmax(local, axis) if wide else local
    backend = "pallas" if kernels else "xla"
    out = []
    for i, (shard, spec) in enumerate(zip(shards, specs)):
        s = fm.weight_scale(amax[i])
        k = spec.fp8_in_dims
        shape = spec.shard_shape
        kk = math.prod(shape[:k])
        w8, w8t = fm.cast_weight(shard.reshape(kk, -1), s, backend=backend)
        bits = w8.reshape(shape)
        bits_t = w8t.reshape(*shape[k:], *shape[:k])
        # The shard dim's place in the transposed layout.
        dim_t = spec.shard_dim - k if spec.shard_dim >= k else len(shape) - k + spec.shard_dim
        if wide:
            bits = jax.lax.all_gather(bits, axis, axis=spec.shard_dim, tiled=True)
            bits_t = jax.lax.all_gather(bits_t, axis, axis=dim_t, tiled=True)
        logical = spec.logical_shape[spec.shard_dim]
        if logical != bits.shape[spec.shard_dim]:
            bits = jax.lax.slice_in_dim(bits, 0, logical, axis=spec.shard_dim)
            bits_t = jax.lax.slice_in_dim(bits_t, 0, logical, axis=dim_t)
        out.append(Fp8GatheredWeight(dequantized(bits, s, spec.compute_dtype), bits, bits_t,
                                     s, amax[i], k))
    return out


def dequantized(bits: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``bits / scale`` in `dtype`: exact for a power-of-two scale (every e4m3 value times a
    power of two is a bfloat16 value, but for results below bfloat16's normal range)."""
    values = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)
    return (values * (1.0 / scale)).astype(dtype)


def without_value(w: Any) -> Any:
    """`w` with its value dropped (what a kept, stacked copy stores); `with_value` rebuilds
    it. Anything else is returned as is."""
    return w.replace(value=None) if is_fp8_gathered(w) else w


def with_value(w: Any, spec: GatherSpec) -> Any:
    """Undoes `without_value`."""
    if is_fp8_gathered(w) and w.value is None:
        return w.replace(value=dequantized(w.bits, w.scale, spec.compute_dtype))
    return w
