"""Which XLA mechanism pins a weight gather and a gradient reduce-scatter behind a layer's
GEMMs on GPUs: a GTP-shaped toy, timed, with its compiled schedule read back.

L layers of width D, a batch of B rows per device. Layer i gathers w[i + 1] (bf16, dim 0
sharded over every GPU), computes ``y = tanh(x @ w[i])`` and a weight-gradient-like
``x^T y`` (float32), and reduce-scatters layer i - 1's float32 gradient: per layer one
all-gather and one reduce-scatter beside two GEMMs, as the layer loop's backward pass has.

Modes (``MODES``, comma-separated):
  compute   no collectives (the floor);
  plain     XLA's own placement;
  groups    each collective in a scheduling group of its own with one GEMM
            (``_scheduling_group_id``): the gather with the forward GEMM, the
            reduce-scatter with the gradient GEMM; the collectives' producers and
            consumers, and the elementwise tanh, outside every group;
  streams   as groups, with each GEMM a call on a second compute stream
            (``compute_on("gpu_stream:1")``): an asynchronous call keeps its group id
            whatever kernel XLA picks for the GEMM inside;
  bw        each collective alone at a Llama-3-8B layer's size (``BW_MIB``, default 416 MiB of
            bf16 gathered, the float32 gradient twice that reduce-scattered): the bus
            bandwidth NCCL reaches through XLA;
  chained   no groups: each collective's result tied to the output of the GEMM it must
            hide behind and its operand to that GEMM's input (``optimization_barrier``),
            so it cannot start before or finish after the window.

Per mode: ms per step (median of 10 after 2 warm-ups), and from the optimized HLO: async
collective pairs, how many have a GEMM (or a streamed call) between their start and done,
how many XLA made synchronous (``is_sync``), and how many GEMMs kept a group id.

Usage: ``B=2048 D=8192 python benchmarks/sched_probe.py 16`` on a host with 2+ GPUs
(``NCCL_NVLS_ENABLE=0``); ``OUT=dir`` writes each mode's optimized HLO there.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

try:
    from jax.experimental.xla_metadata import set_xla_metadata
except ImportError:  # older layout
    from jax._src.xla_metadata import set_xla_metadata
try:  # jax 0.11: compute_on(f, *, compute_type, out_memory_spaces); before, compute_on2
    from jax.experimental.compute_on import compute_on2 as _stream_call
except ImportError:
    from jax.experimental.compute_on import compute_on as _stream_call

L = int(sys.argv[1]) if len(sys.argv) > 1 else 16
D, B = int(os.environ.get("D", 8192)), int(os.environ.get("B", 2048))
MODES = os.environ.get("MODES", "compute,plain,groups,streams,chained").split(",")
mesh = jax.make_mesh((jax.device_count(),), ("g",))
n = jax.device_count()


def _fwd(x, w):
    return x @ w


def _wgrad(x, y):
    return jnp.einsum("bd,be->de", x, y, preferred_element_type=jnp.float32)


def make(mode: str):
    streamed = mode == "streams"
    fwd = jax.jit(_fwd) if streamed else _fwd
    wgrad = jax.jit(_wgrad) if streamed else _wgrad

    def gemm(f, *a):
        if streamed:
            return _stream_call(f, compute_type="gpu_stream:1",
                                out_memory_spaces=jax.memory.Space.Device)(*a)
        return f(*a)

    def body(x, ws):
        def gather(i):
            if mode == "compute":
                return jnp.tile(ws[i], (n, 1))
            return jax.lax.all_gather(ws[i], "g", axis=0, tiled=True)

        def rs(g):
            if mode == "compute":
                return g[: D // n]
            return jax.lax.psum_scatter(g, "g", scatter_dimension=0, tiled=True)

        w = gather(0)
        g_prev, acc = None, jnp.zeros((D // n, D), jnp.float32)
        for i in range(L):
            grouped = mode in ("groups", "streams")
            nxt = None
            if grouped:
                with set_xla_metadata(_scheduling_group_id=2 * i):
                    nxt = gather(i + 1) if i + 1 < L else None
                    h = gemm(fwd, x, w)
            elif mode == "chained" and i + 1 < L:
                # the gather may start once this layer's input exists and must be done
                # when its GEMM is: its window is that GEMM
                (x, shard), _ = jax.lax.optimization_barrier(((x, ws), w))
                nxt = jax.lax.all_gather(shard[i + 1], "g", axis=0, tiled=True)
                h = gemm(fwd, x, w)
                h, nxt = jax.lax.optimization_barrier((h, nxt))
            else:
                nxt = gather(i + 1) if i + 1 < L else None
                h = gemm(fwd, x, w)
            y = jnp.tanh(h)
            if grouped:
                with set_xla_metadata(_scheduling_group_id=2 * i + 1):
                    r = rs(g_prev) if g_prev is not None else None
                    g_new = gemm(wgrad, x, y)
            elif mode == "chained" and g_prev is not None:
                (x, y, g_prev), _ = jax.lax.optimization_barrier(((x, y, g_prev), h))
                r = rs(g_prev)
                g_new = gemm(wgrad, x, y)
                g_new, r = jax.lax.optimization_barrier((g_new, r))
            else:
                r = rs(g_prev) if g_prev is not None else None
                g_new = gemm(wgrad, x, y)
            if r is not None:
                acc = acc + r
            g_prev, x, w = g_new, y, nxt
        return x, acc + rs(g_prev)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("g", None), P(None, "g", None)),
                      out_specs=(P("g", None), P("g", None)), check_vma=False)
    return jax.jit(f)


_START = re.compile(r"%?([\w.\-]+) = .*? (all-gather-start|reduce-scatter-start|"
                    r"all-reduce-start|collective-permute-start|async-start|call-start)\(")
_DONE = re.compile(r"(all-gather-done|reduce-scatter-done|all-reduce-done|"
                   r"collective-permute-done|async-done|call-done)\(.*?%?([\w.\-]+)\)")


def schedule_stats(hlo: str) -> dict[str, int]:
    """Async collective pairs of the entry schedule and how many have compute inside."""
    lines = hlo.split("\n")
    pairs = covered = 0
    open_ops: dict[str, bool] = {}
    calls: set[str] = set()
    for ln in lines:
        m = _START.search(ln)
        if m:
            name, kind = m.group(1), m.group(2)
            if kind == "call-start" or ("async-start" in kind and "calls=" in ln
                                        and "reduce-scatter" not in ln
                                        and "all-gather" not in ln):
                calls.add(name)
                for k in open_ops:
                    open_ops[k] = True
                continue
            open_ops[name] = False
            pairs += 1
            continue
        gemm = ("custom-call" in ln and ("gemm" in ln.lower() or "cublas" in ln.lower())) \
            or re.search(r"= .*fusion\(.*kind=kCustom", ln)
        if gemm:
            for k in open_ops:
                open_ops[k] = True
        m = _DONE.search(ln)
        if m and m.group(2) in open_ops:
            covered += open_ops.pop(m.group(2))
    gemm_lines = [ln for ln in lines if "custom-call" in ln and "gemm" in ln.lower()]
    return {"pairs": pairs, "covered": covered,
            "sync": sum('"is_sync":true' in ln for ln in lines),
            "gemms": len(gemm_lines),
            "gemms_grouped": sum("_scheduling_group_id" in ln for ln in gemm_lines),
            "streamed_calls": len(calls)}


def bandwidth() -> None:
    """Times an all-gather (bf16) and a reduce-scatter (float32) of one layer's size alone."""
    full = int(os.environ.get("BW_MIB", 416)) * 2**20 // 2 // n * n  # bf16 elements
    rows = full // 4096
    for name, dtype, op in (
            ("all-gather bf16", jnp.bfloat16,
             lambda s: jax.lax.all_gather(s, "g", axis=0, tiled=True)),
            ("reduce-scatter f32", jnp.float32,
             lambda s: jax.lax.psum_scatter(s, "g", scatter_dimension=0, tiled=True))):
        shape = (rows // n, 4096) if "gather" in name else (rows, 4096)
        spec = P("g", None)
        x = jax.device_put(jnp.ones((shape[0] * n, 4096), dtype), NamedSharding(mesh, spec))
        f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=spec, out_specs=spec,
                                  check_vma=False))
        for _ in range(3):
            jax.block_until_ready(f(x))
        times = []
        for _ in range(10):
            t = time.perf_counter()
            jax.block_until_ready(f(x))
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
        moved = rows * 4096 * jnp.dtype(dtype).itemsize * (n - 1) / n  # bytes per device
        print(f"bw: {name} of {rows * 4096 * jnp.dtype(dtype).itemsize / 2**20:.0f} MiB: "
              f"{ms:.2f} ms, bus bandwidth {moved / ms / 1e6:.1f} GB/s")


def main() -> None:
    x = jax.device_put(jax.random.normal(jax.random.key(0), (B * n, D), jnp.bfloat16) * 0.01,
                       NamedSharding(mesh, P("g", None)))
    ws = jax.device_put(jax.random.normal(jax.random.key(1), (L, D, D), jnp.bfloat16) * 0.01,
                        NamedSharding(mesh, P(None, "g", None)))
    print(f"devices {n} x {jax.devices()[0].device_kind}, L={L} D={D} B={B}, jax {jax.__version__}")
    for mode in MODES:
        if mode == "bw":
            bandwidth()
            continue
        f = make(mode)
        try:
            compiled = f.lower(x, ws).compile()
        except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
            print(f"{mode}: compile failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        hlo = compiled.as_text()
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], f"hlo_{mode}.txt"), "w") as fh:
                fh.write(hlo)
        stats = schedule_stats(hlo)
        try:
            for _ in range(2):
                jax.block_until_ready(compiled(x, ws))
            times = []
            for _ in range(10):
                t = time.perf_counter()
                jax.block_until_ready(compiled(x, ws))
                times.append((time.perf_counter() - t) * 1e3)
        except Exception as e:  # noqa: BLE001
            print(f"{mode}: run failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        print(f"{mode}: {statistics.median(times):.2f} ms/step; {stats}")


if __name__ == "__main__":
    main()
