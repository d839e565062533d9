"""Optimizer state in host memory (`GTPConfig.offload_optimizer`).

The state keeps its mesh and partition spec; only its memory kind changes to
``"pinned_host"``. Inside the jitted step, `to_device` copies each leaf to device memory
before the update and `to_host` copies the new value back: one transfer per state leaf
(a layer-stacked weight's moments are one leaf), which XLA's scheduler places around the
computation. The update itself runs on the device, so the arithmetic is the on-device run's.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding

#: The memory kind offloaded state lives in (page-locked host memory: the device copies
#: from and to it directly).
HOST_MEMORY_KIND = "pinned_host"


def host_memory_supported(device: jax.Device | None = None) -> bool:
    """Whether `device` (default: the first device) can address `HOST_MEMORY_KIND`."""
    device = jax.devices()[0] if device is None else device
    return any(m.kind == HOST_MEMORY_KIND for m in device.addressable_memories())


def place_on_host(tree: Any) -> Any:
    """`tree` with every array placed in host memory, same mesh and partition spec (outside
    ``jit``; arrays must carry a ``NamedSharding``; other leaves are returned unchanged)."""

    def place(x: Any) -> Any:
        if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding):
            return jax.device_put(x, x.sharding.with_memory_kind(HOST_MEMORY_KIND))
        return x

    return jax.tree.map(place, tree)


def host_shapes(tree: Any) -> Any:
    """`tree` of ``jax.ShapeDtypeStruct`` with ``NamedSharding`` shardings, moved to host
    memory (the abstract counterpart of `place_on_host`, for ahead-of-time lowering)."""

    def place(x: Any) -> Any:
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.ShapeDtypeStruct) and isinstance(sharding, NamedSharding):
            return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=sharding.with_memory_kind(HOST_MEMORY_KIND))
        return x

    return jax.tree.map(place, tree)


def to_device(tree: Any) -> Any:
    """Inside ``jit``: `tree`'s arrays copied to device memory (same sharding)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def to_host(tree: Any) -> Any:
    """Inside ``jit``: `tree`'s arrays copied to host memory (same sharding)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), tree)
