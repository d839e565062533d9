"""Do host -> device DMA transfers run beside compute in one program? (as run, tidied)"""
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

L, N, n, k = 16, 100_000_000, 70, 8192
mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
dev = NamedSharding(mesh, P())
host = dev.with_memory_kind("pinned_host")
x = jax.device_put(jnp.ones((k, k), jnp.bfloat16), dev)
w = jax.device_put(jax.random.normal(jax.random.key(2), (k, k), jnp.bfloat16) / 91.0, dev)
hs = [jax.device_put(np.ones(N, np.float32), host) for _ in range(L)]


def mm(x, w, n):
    for _ in range(n):
        x = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return x


def to_device(hs):
    return [jax.device_put(h, jax.memory.Space.Device) for h in hs]


def plain(hs, x, w):
    return to_device(hs), mm(x, w, n)


def chained(hs, x, w):
    # copy k starts with matmul k's input, and is needed before matmul k + 3 * per
    outs, pend, per = [], [], n // L
    for i in range(n):
        if i % per == 0 and i // per < L:
            pend.append((i, jax.device_put(hs[i // per], jax.memory.Space.Device)))
        x = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        while pend and pend[0][0] + 3 * per <= i:
            d, x = jax.lax.optimization_barrier((pend.pop(0)[1], x))
            outs.append(d)
    outs.extend(d for _, d in pend)
    return outs, x


CODES = {"copy-start": "S", "copy-done": "D", "custom-call": "m", "fusion": "f"}


def timeit(fn):
    txt = fn.lower(hs, x, w).compile().as_text()
    seq = []
    for line in txt.split("ENTRY")[-1].splitlines():
        m = re.search(r" (copy-start|copy-done|custom-call|fusion)\(", line)
        if m:
            seq.append(CODES[m.group(1)])
    print("  schedule:", "".join(seq)[:400])
    for _ in range(2):
        jax.block_until_ready(fn(hs, x, w))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(hs, x, w))
        ts.append(time.perf_counter() - t0)
    return np.median(ts) * 1e3


print("flags:", os.environ.get("XLA_FLAGS"))
out = [dev] * L
print("matmuls alone", timeit(jax.jit(lambda hs, x, w: mm(x, w, n))))
print("copies alone", timeit(jax.jit(lambda hs, x, w: to_device(hs), out_shardings=out)))
print("plain both", timeit(jax.jit(plain, out_shardings=(out, dev))))
print("chained both", timeit(jax.jit(chained, out_shardings=(out, dev))))
