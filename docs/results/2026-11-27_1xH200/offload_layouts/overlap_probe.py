import os, sys, time, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
L, N, n, k = 16, 100_000_000, 70, 8192
mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
dev = NamedSharding(mesh, P()); host = dev.with_memory_kind("pinned_host")
x = jax.device_put(jnp.ones((k, k), jnp.bfloat16), dev)
w = jax.device_put(jax.random.normal(jax.random.key(2), (k, k), jnp.bfloat16) / 91.0, dev)
hs = [jax.device_put(np.ones(N, np.float32), host) for _ in range(L)]
def mm(x, w, n):
    for _ in range(n):
        x = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return x
def plain(hs, x, w):
    return [jax.device_put(h, jax.memory.Space.Device) for h in hs], mm(x, w, n)
def chained(hs, x, w):
    # copy k starts once matmul k has an input, and is needed before matmul k+3
    outs, pend = [], []
    per = n // L
    for i in range(n):
        if i % per == 0 and i // per < L:
            (h, x), _ = jax.lax.optimization_barrier(((hs[i // per], x), None)) if False else ((hs[i // per], x), None)
            pend.append((i, jax.device_put(h, jax.memory.Space.Device)))
        x = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        while pend and pend[0][0] + 3 * per <= i:
            d = pend.pop(0)[1]
            d, x = jax.lax.optimization_barrier((d, x))
            outs.append(d)
    for _, d in pend:
        outs.append(d)
    return outs, x
def timeit(fn):
    c = fn.lower(hs, x, w).compile()
    txt = c.as_text()
    seq = []
    for line in txt.split("ENTRY")[-1].splitlines():
        m = re.search(r" (copy-start|copy-done|custom-call|fusion)\(", line)
        if m: seq.append(m.group(1))
    s = "".join({"copy-start": "S", "copy-done": "D", "custom-call": "m", "fusion": "f"}[t] for t in seq)
    print("  schedule:", s[:400])
    for _ in range(2): jax.block_until_ready(fn(hs, x, w))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); jax.block_until_ready(fn(hs, x, w)); ts.append(time.perf_counter() - t0)
    return np.median(ts) * 1e3
print("flags:", os.environ.get("XLA_FLAGS"))
out = [dev] * L
print("matmuls alone", timeit(jax.jit(lambda hs, x, w: mm(x, w, n))))
print("copies alone", timeit(jax.jit(lambda hs, x, w: [jax.device_put(h, jax.memory.Space.Device) for h in hs], out_shardings=out)))
print("plain both", timeit(jax.jit(plain, out_shardings=(out, dev))))
print("chained both", timeit(jax.jit(chained, out_shardings=(out, dev))))
