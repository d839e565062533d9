"""How fast optimizer moments stream between pinned host memory and one GPU, by layout.

An AdamW step over `--layers` layer groups of `--elements` float32 parameters each, with
both moments in host memory, in six forms (each one jitted program; the state donated,
except in ``mixed``):

* ``stacked``: `gtp_jax.sharding.offload.streamed_update`, moments as one ``[layers, n]``
  host buffer each, copied per group with dynamic slices (the trainer's layout);
* ``trainer``: what `gtp_jax.train.TrainStep` runs: the same update on the moments grouped
  by `gtp_jax.sharding.offload.group_moments` (one host array per layer group, each copy a
  DMA transfer);
* ``static``: the same layout and order with static slice bounds;
* ``grouped``: moments as one host array per layer group, each copied whole (a DMA
  transfer each way), same double-buffered order;
* ``mixed``: moments read from the stacked host buffers by dynamic-slice kernels (compute
  stream) and written back as one new host array per group (DMA on the copy stream): whether
  the two directions overlap on different engines (they did not: docs/planning.md);
* ``padded``: the same with one host array per group, ``PAD`` elements longer than its
  moments, so the layout after the step is the layout before it;
* ``looped``: the trainer's layout updated group by group inside ``lax.fori_loop``, each
  copy a slice at the loop index: XLA's GPU backend can turn a slice whose offset depends
  only on a loop's induction variable into a memcpy (``DynamicMemcpyThunk``), a DMA transfer
  instead of a kernel, with no double buffering across iterations;
* ``in`` / ``out`` / ``both``: the copies alone (whole arrays host -> device,
  device -> host, or both at once), the link's rates for comparison;
* ``overlap``: whether whole-array transfers run beside compute in one program: a chain of
  bf16 matmuls alone, the transfers of ``in`` (then ``out``) alone, and both in one
  program with no dependence between them (``max`` of the two when they overlap, their
  sum when they do not).

Prints one table: ms per step, and GB/s of moment bytes moved (both moments, both ways for
the updates). Usage (one GPU):

    python docs/results/2026-11-27_1xH100/host_copies/host_copies.py [--layers 16]
        [--elements 50000000]

On a CPU it runs with small sizes to check itself (`--elements 1000`).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gtp_jax.sharding.offload import (
    HOST_MEMORY_KIND,
    group_moments,
    init_streamed_on_host,
    streamable_chain,
    streamed_update,
)

B1, B2, LR, EPS = 0.9, 0.95, 1e-3, 1e-8


def _time(fn, args, steps: int, *fixed, feed: bool = True) -> float:
    """Median seconds per call of ``fn(*args, *fixed)``, which returns the next call's
    `args` (donated; with ``feed=False`` every call gets the same `args`, nothing donated).
    Nothing donated is returned as a non-donated input: JAX pairs donated buffers with
    outputs by shape, and a host buffer must not meet a device output."""
    hlo = fn.lower(*args, *fixed).compile().as_text()
    ops = {op: hlo.count(f" {op}(") for op in ("copy-start", "dynamic-slice",
                                                  "dynamic-update-slice")}
    ops["memcpy"] = hlo.count("memcpy")
    print(f"  compiled: {ops}", flush=True)
    def call(args):
        out = fn(*args, *fixed)
        return out if feed else (jax.block_until_ready(out), args)[1]

    for _ in range(2):
        args = call(args)
    jax.block_until_ready(args)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        args = call(args)
        jax.block_until_ready(args)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _adam(p, g, m, v, count):
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g * g
    mh = m / (1 - B1 ** count)
    vh = v / (1 - B2 ** count)
    return p - LR * mh / (jnp.sqrt(vh) + EPS), m, v


def _per_group(params, grads, read, write):
    """The double-buffered update of one group at a time: group k's moments come in
    (``read(k, gate) -> (m, v)`` on the device, once `gate` exists) while group k-1 updates;
    its new moments go out as ``write(m, v) -> (host m, host v)``, one new array each."""
    out_p, out_m, out_v, done = [], [], [], []
    for k in range(len(params)):
        m, v = read(k, done[k - 2] if k >= 2 else [grads[k]])
        p, m, v = _adam(params[k], grads[k], m, v, 2.0)
        done.append([p, m, v])
        out_p.append(p)
        m, v = write(m, v)
        out_m.append(m)
        out_v.append(v)
    return jnp.stack(out_p), out_m, out_v


def _to_host(m, v):
    return jax.device_put(m, jax.memory.Space.Host), jax.device_put(v, jax.memory.Space.Host)


def grouped_step(params, ms, vs, grads):
    """One host array per group, each copied whole both ways (DMA transfers)."""
    def read(k, gate):
        (m, v), _ = jax.lax.optimization_barrier(((ms[k], vs[k]), gate))
        return (jax.device_put(m, jax.memory.Space.Device),
                jax.device_put(v, jax.memory.Space.Device))

    return _per_group(params, grads, read, _to_host)


def stacked_static_step(params, ms, vs, grads, *, group: int):
    """The trainer's order on one ``[layers, n]`` host buffer per moment, but with static
    slice bounds (no index through a barrier): XLA may copy a contiguous static slice with
    a memcpy instead of a kernel."""
    L = params.shape[0]
    out_p, done, pending = [], [], None
    for k, s in enumerate(range(0, L, group)):
        gate = done[k - 2] if k >= 2 else [grads]
        (ms, vs), _ = jax.lax.optimization_barrier(((ms, vs), gate))
        m = jax.device_put(ms[s:s + group], jax.memory.Space.Device)
        v = jax.device_put(vs[s:s + group], jax.memory.Space.Device)
        if pending is not None:  # the previous group's write-back, after this read
            ps, pm, pv = pending
            (ms, vs), _ = jax.lax.optimization_barrier(((ms, vs), (m, v)))
            ms = ms.at[ps:ps + group].set(jax.device_put(pm, jax.memory.Space.Host))
            vs = vs.at[ps:ps + group].set(jax.device_put(pv, jax.memory.Space.Host))
        p, m, v = _adam(params[s:s + group], grads[s:s + group], m, v, 2.0)
        done.append([p, m, v])
        out_p.append(p)
        pending = (s, m, v)
    ps, pm, pv = pending
    ms = ms.at[ps:ps + group].set(jax.device_put(pm, jax.memory.Space.Host))
    vs = vs.at[ps:ps + group].set(jax.device_put(pv, jax.memory.Space.Host))
    return jnp.concatenate(out_p), ms, vs


def looped_step(params, ms, vs, grads):
    """One ``[layers, n]`` host buffer per moment, one group per iteration of a
    ``fori_loop``: its moments in, its update, its moments written back in place."""
    def body(k, carry):
        p, ms, vs = carry
        m = jax.device_put(jax.lax.dynamic_index_in_dim(ms, k, 0, keepdims=False),
                           jax.memory.Space.Device)
        v = jax.device_put(jax.lax.dynamic_index_in_dim(vs, k, 0, keepdims=False),
                           jax.memory.Space.Device)
        new_p, m, v = _adam(jax.lax.dynamic_index_in_dim(p, k, 0, keepdims=False),
                            jax.lax.dynamic_index_in_dim(grads, k, 0, keepdims=False),
                            m, v, 2.0)
        p = jax.lax.dynamic_update_index_in_dim(p, new_p, k, 0)
        ms = jax.lax.dynamic_update_index_in_dim(ms, jax.device_put(m, jax.memory.Space.Host),
                                                 k, 0)
        vs = jax.lax.dynamic_update_index_in_dim(vs, jax.device_put(v, jax.memory.Space.Host),
                                                 k, 0)
        return p, ms, vs

    return jax.lax.fori_loop(0, params.shape[0], body, (params, ms, vs))


PAD = 128  # elements beyond a group's moments in its padded host array


def _read_kernel(h, start, size):
    """Host -> device of ``h[start:start + size]`` with `start` known only at run time:
    XLA reads the host buffer with a dynamic-slice kernel on the compute stream."""
    return jax.device_put(jax.lax.dynamic_slice_in_dim(h, start, size, 0),
                          jax.memory.Space.Device)


def mixed_step(params, ms, vs, grads, start):
    """Moments read from one ``[layers, n]`` host buffer each by dynamic-slice kernels
    (compute stream), written back as one new host array per group (DMA on the copy
    stream): the two directions on different engines."""
    def read(k, gate):
        (m, v, st), _ = jax.lax.optimization_barrier(((ms, vs, start + k), gate))
        return _read_kernel(m, st, 1)[0], _read_kernel(v, st, 1)[0]

    return _per_group(params, grads, read, _to_host)


def padded_step(params, ms, vs, grads, start):
    """One host array per group, ``PAD`` elements longer than its moments: read by a
    dynamic-slice kernel of the first n elements (start 0 through a barrier), written back
    whole (padded, DMA). The layout is the same after the step (the state can be donated)."""
    n = params.shape[1]
    pad = jnp.zeros((PAD,), jnp.float32)

    def read(k, gate):
        (m, v, st), _ = jax.lax.optimization_barrier(((ms[k], vs[k], start), gate))
        return _read_kernel(m, st, n), _read_kernel(v, st, n)

    def write(m, v):
        return _to_host(jnp.concatenate([m, pad]), jnp.concatenate([v, pad]))

    return _per_group(params, grads, read, write)


def _matmuls(x, w, n: int):
    """`n` dependent ``[k, k] @ [k, k]`` bf16 matmuls (the compute the copies may hide
    behind)."""
    for _ in range(n):
        x = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return x


def _overlap_rows(L: int, N: int, dev, host, steps: int, gb: float) -> list:
    """The ``overlap`` form's rows: matmuls alone, each direction's transfers alone, and
    each direction beside the matmuls in one program."""
    k = 8192
    x = jax.device_put(jnp.ones((k, k), jnp.bfloat16), dev)
    w = jax.device_put(jax.random.normal(jax.random.key(2), (k, k), jnp.bfloat16) / 91.0, dev)
    # about as long as one direction's transfers: 1.1 ms a matmul on an H100/H200
    n = max(1, int(gb / 55.0 / 1.1e-3))
    rows = []
    mm = jax.jit(lambda x, w: _matmuls(x, w, n))
    rows.append((f"overlap: {n} bf16 matmuls {k}^3 alone",
                 _time(mm, (x,), steps, w, feed=False), 0.0))

    def copy_in(hs, x, w):
        return [jax.device_put(h, jax.memory.Space.Device) for h in hs]

    def copy_out(ds, x, w):
        return [jax.device_put(d, jax.memory.Space.Host) for d in ds]

    def with_mm(f):
        return lambda a, x, w: (f(a, x, w), _matmuls(x, w, n))

    hs = [jax.device_put(np.ones(N, np.float32), host) for _ in range(L)]
    ds = [jax.device_put(jnp.ones(N, jnp.float32), dev) for _ in range(L)]
    for name, f, a, out in (("in", copy_in, hs, [dev] * L), ("out", copy_out, ds, [host] * L)):
        alone = jax.jit(f, out_shardings=out)
        both = jax.jit(with_mm(f), out_shardings=(out, dev))
        rows.append((f"overlap: copies {name} alone", _time(alone, (a,), steps, x, w,
                                                            feed=False), gb))
        rows.append((f"overlap: copies {name} + the matmuls, one program",
                     _time(both, (a,), steps, x, w, feed=False), gb))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--elements", type=int, default=50_000_000,
                        help="float32 parameters per layer group")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--forms", default="stacked,trainer,grouped,in,out,both")
    args = parser.parse_args()
    L, N = args.layers, args.elements
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    dev = NamedSharding(mesh, PartitionSpec())
    host = dev.with_memory_kind(HOST_MEMORY_KIND)
    moment_gb = 2 * L * N * 4 / 1e9  # both moments
    rows = []
    forms = args.forms.split(",")

    def params_and_grads():
        key = jax.random.key(0)
        p = jax.device_put(jax.random.normal(key, (L, N), jnp.float32), dev)
        g = jax.device_put(jax.random.normal(jax.random.key(1), (L, N), jnp.float32), dev)
        return p, g

    # The streamed update as the library runs it: on the stored (stacked) layout, and on
    # the layout the trainer holds (grouped by group_moments).
    for form, name in (("stacked", "stacked (one host buffer per moment)"),
                       ("trainer", "trainer (grouped by group_moments)")):
        if form not in forms:
            continue
        tx = streamable_chain(optax.identity(), optax.adam(LR, b1=B1, b2=B2, eps=EPS))
        p, g = params_and_grads()
        state = init_streamed_on_host(tx, {"w": p}, {"w": True})
        if form == "trainer":
            state = group_moments(state, {"w": p}, {"w": True}, 1)

        def update(p, state, g, tx=tx):
            new_p, new_state = streamed_update(tx, {"w": g}, state, {"w": p}, {"w": True})
            return new_p["w"], new_state

        fn = jax.jit(update, donate_argnums=(0, 1))
        rows.append((name, _time(fn, (p, state), args.steps, g), 2 * moment_gb))
        del p, g, state, fn

    if "static" in forms:
        p, g = params_and_grads()
        ms = jax.device_put(np.zeros((L, N), np.float32), host)
        vs = jax.device_put(np.zeros((L, N), np.float32), host)
        fn = jax.jit(lambda p, m, v, g: stacked_static_step(p, m, v, g, group=1),
                     donate_argnums=(0, 1, 2), out_shardings=(dev, host, host))
        rows.append(("stacked, static slices",
                     _time(fn, (p, ms, vs), args.steps, g), 2 * moment_gb))
        del p, g, ms, vs, fn

    if "looped" in forms:
        p, g = params_and_grads()
        ms = jax.device_put(np.zeros((L, N), np.float32), host)
        vs = jax.device_put(np.zeros((L, N), np.float32), host)
        fn = jax.jit(lambda p, m, v, g: looped_step(p, m, v, g),
                     donate_argnums=(0, 1, 2), out_shardings=(dev, host, host))
        rows.append(("stacked, one group per loop iteration",
                     _time(fn, (p, ms, vs), args.steps, g), 2 * moment_gb))
        del p, g, ms, vs, fn

    if "grouped" in forms:
        p, g = params_and_grads()
        ms = [jax.device_put(np.zeros(N, np.float32), host) for _ in range(L)]
        vs = [jax.device_put(np.zeros(N, np.float32), host) for _ in range(L)]
        out_shardings = (dev, [host] * L, [host] * L)
        fn = jax.jit(lambda p, m, v, g: grouped_step(list(p), m, v, list(g)),
                     donate_argnums=(0, 1, 2), out_shardings=out_shardings)
        rows.append(("grouped (one host array per group)",
                     _time(fn, (p, ms, vs), args.steps, g), 2 * moment_gb))
        del p, g, ms, vs, fn

    if "mixed" in forms:
        p, g = params_and_grads()
        ms = jax.device_put(np.zeros((L, N), np.float32), host)
        vs = jax.device_put(np.zeros((L, N), np.float32), host)
        fn = jax.jit(mixed_step, out_shardings=(dev, [host] * L, [host] * L))
        rows.append(("mixed: kernel reads, DMA writes",
                     _time(fn, (p, ms, vs, g, jnp.int32(0)), args.steps, feed=False),
                     2 * moment_gb))
        del p, g, ms, vs, fn

    if "padded" in forms:
        p, g = params_and_grads()
        ms = [jax.device_put(np.zeros(N + PAD, np.float32), host) for _ in range(L)]
        vs = [jax.device_put(np.zeros(N + PAD, np.float32), host) for _ in range(L)]
        fn = jax.jit(lambda p, m, v, g, st: padded_step(p, m, v, list(g), st),
                     donate_argnums=(0, 1, 2), out_shardings=(dev, [host] * L, [host] * L))
        rows.append(("padded groups: kernel reads, DMA writes",
                     _time(fn, (p, ms, vs), args.steps, g, jnp.int32(0)), 2 * moment_gb))
        del p, g, ms, vs, fn

    if {"in", "out", "both"} & set(forms):
        def copy_in(hs, ds):
            return hs, [jax.device_put(h, jax.memory.Space.Device) for h in hs]

        def copy_out(hs, ds):
            return [jax.device_put(d, jax.memory.Space.Host) for d in ds], ds

        def copy_both(hs, ds):
            return ([jax.device_put(d, jax.memory.Space.Host) for d in ds],
                    [jax.device_put(h, jax.memory.Space.Device) for h in hs])

        shard = ([host] * (2 * L), [dev] * (2 * L))
        for name, f, gb in (("in", copy_in, moment_gb), ("out", copy_out, moment_gb),
                            ("both", copy_both, 2 * moment_gb)):
            if name in forms:
                hs = [jax.device_put(np.ones(N, np.float32), host) for _ in range(2 * L)]
                ds = [jax.device_put(jnp.ones(N, jnp.float32), dev) for _ in range(2 * L)]
                fn = jax.jit(f, donate_argnums=(0, 1), out_shardings=shard)
                rows.append((f"copies only: {name}", _time(fn, (hs, ds), args.steps), gb))
                del hs, ds, fn

    if "overlap" in forms:
        rows.extend(_overlap_rows(L, N, dev, host, args.steps, moment_gb / 2))

    print(f"| form | ms per step | GB moved | GB/s |  ({L} groups x {N} float32, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__})")
    print("| --- | --- | --- | --- |")
    for name, sec, gb in rows:
        print(f"| {name} | {sec * 1e3:.1f} | {gb:.2f} | {gb / sec:.1f} |")


if __name__ == "__main__":
    main()
