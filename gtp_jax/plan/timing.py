"""A layout's step time: a roofline-style model whose rates are measured on the machine.

    compute  = matmul FLOPs / GEMM rate + attention FLOPs / attention rate at the sequence
    gtp      = weight all-gathers (forward and backward) + gradient reduce-scatters
    other    = gradient all-reduce over dp and cp + tp activation collectives (those the
               remat policy recomputes included) + cp ring K/V passes + the optimizer update
    offload  = optimizer state to the device and back / host bandwidth
    loop     = the scanned loop's residual stacks: written in the forward, read in the
               backward / memory bandwidth (0 for the unrolled loop)
    step     = max(compute, gtp) + exposed * min(compute, gtp) + other + offload + loop
               (unrolled / prefetching loops: the gathers run a layer ahead, beside the
               compute, which hides all but the measured fraction `exposed` of them)
             = compute + gtp + other + offload + loop     (plain scanned loop)

Each collective costs ``latency + bytes moved per device / bandwidth``, with the bandwidth
of an all-gather / reduce-scatter over all devices and its latency inside a program
(`Calibration`). Given a `Topology` (devices in nodes, a slower network between them), a
collective over a mesh axis whose groups span nodes moves its bytes at the network's
bandwidth instead (`spans_nodes`: the mesh is ``(dp, ep, gtp, cp, tp)`` from outermost to
innermost over consecutive devices, so tp is the last axis to leave a node and dp the
first). Matmul
FLOPs are ``6 * (block + head parameters)`` per token divided over ``tp``; remat "full"
adds one more forward pass (8 instead of 6), "dots" recomputes no matmul. Attention FLOPs
are ``6 * n_layers * n_heads * head_dim * seq`` per token (causal), again with a forward
more under "full": the model's own `train_flops_per_token` (block parameters as the model
has them: grouped-query attention's k and v projections are smaller), at the attention
rate measured nearest the run's sequence length (`Calibration.attention_flops`). Not
modelled: elementwise work, the embedding, GEMM efficiency at other shapes than the
calibration's.
The optimizer update costs the parameters of a device's shards over the measured rate of the
trainer's optimizer (clipping and AdamW). The model ranks layouts; its absolute accuracy is
what `benchmarks/plan_accuracy.sh` measures.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gtp_jax.base.errors import UsageError
from gtp_jax.models.attention import resolve_attention_impl
from gtp_jax.sharding.offload import (
    DEFAULT_GROUP_LAYERS,
    group_moments,
    host_memory_supported,
    init_streamed_on_host,
    streamable_chain,
    streamed_update,
    streaming_compiler_options,
)
from gtp_jax.train.config import TrainConfig, make_optimizer, model_config, resolve_auto
from gtp_jax.train.step.memory import pinned_host_bound

#: Environment variable naming the calibration cache directory (default
#: ``~/.cache/gtp_jax``).
CACHE_ENV = "GTP_JAX_CACHE_DIR"


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured rates of the present devices (per device).

    Attributes:
      device_kind, platform, devices: what was measured (``jax.devices()[0].device_kind``,
        the backend, the device count).
      dtype: the compute dtype of the GEMM / attention measurements.
      gemm_flops: dense matmul FLOP/s.
      attention_rates: ``((seq, FLOP/s), ...)`` by increasing sequence length: causal
        attention FLOP/s of a forward + backward pass at that sequence length (same tokens
        per call), counted as ``6 * seq * tokens * heads * head_dim`` (what `step_seconds`
        charges). Attention kernels run far faster at long sequences (on one H100, 175
        TFLOP/s at 2048 tokens), so one rate would misprice every other length;
        `attention_flops` interpolates.
      all_gather_bandwidth, reduce_scatter_bandwidth: bytes moved per device per second.
      all_gather_latency, reduce_scatter_latency: seconds per collective.
      host_bandwidth: bytes per second per device, both ways together, that the trainer's
        offloaded update moves between pinned host memory and the device (`_host_rate`;
        0: no pinned host memory).
      memory_bandwidth: bytes read and written per second by an elementwise pass (inside a
        program: its dispatch is not counted).
      overlap_exposed: the fraction of collectives running beside compute that the compute
        does not hide (`_exposed_overlap`; 0 on one device).
      optimizer_rate: float32 parameters per second that the trainer's optimizer
        (`gtp_jax.train.config.make_optimizer`: global-norm clipping and AdamW) updates;
        0: not measured (`step_seconds` then charges 28 bytes per parameter at
        `memory_bandwidth`).
    """

    device_kind: str
    platform: str
    devices: int
    dtype: str
    gemm_flops: float
    attention_rates: tuple[tuple[int, float], ...]
    all_gather_bandwidth: float
    all_gather_latency: float
    reduce_scatter_bandwidth: float
    reduce_scatter_latency: float
    host_bandwidth: float
    memory_bandwidth: float = 0.0
    overlap_exposed: float = 0.0
    optimizer_rate: float = 0.0

    def __post_init__(self) -> None:
        rates = tuple((int(s), float(r)) for s, r in self.attention_rates)  # JSON: lists
        if not rates or any(b[0] <= a[0] for a, b in zip(rates, rates[1:])):
            raise UsageError(f"Calibration.attention_rates={self.attention_rates!r} must be "
                             "(seq, FLOP/s) pairs by increasing seq, at least one.")
        object.__setattr__(self, "attention_rates", rates)

    def attention_flops(self, seq: int) -> float:
        """Causal attention FLOP/s at sequence length `seq`: `attention_rates` interpolated
        linearly in log(seq) (the rate of the nearest measured length outside them)."""
        rates = self.attention_rates
        if seq <= rates[0][0]:
            return rates[0][1]
        for (s0, r0), (s1, r1) in zip(rates, rates[1:]):
            if seq <= s1:
                t = (np.log(seq) - np.log(s0)) / (np.log(s1) - np.log(s0))
                return float(r0 + t * (r1 - r0))
        return rates[-1][1]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def cache_path() -> str:
    """The calibration cache file (``$GTP_JAX_CACHE_DIR/calibration.json``)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache",
                                                     "gtp_jax")
    return os.path.join(root, "calibration.json")


#: Sequence lengths the attention rate is measured at on a GPU (16384 tokens per call each).
ATTENTION_SEQS = (1024, 2048, 4096, 8192)

#: Bumped when what `measure` measures changes, so older cached rates are measured again.
CALIBRATION_VERSION = 8


def _cache_key(dtype: str) -> str:
    device = jax.devices()[0]
    return (f"{jax.default_backend()}|{device.device_kind}|{jax.device_count()}|{dtype}"
            f"|v{CALIBRATION_VERSION}")


def calibration(dtype: str, *, refresh: bool = False,
                timings: dict[str, float] | None = None) -> Calibration:
    """The cached `Calibration` of the present devices for compute `dtype`, measured (and
    cached) on first use or when `refresh` (seconds to a minute; `timings` receives the
    parts' seconds when it is measured, see `measure`)."""
    path = cache_path()
    cached: dict[str, Any] = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                cached = json.load(f)
        except (OSError, json.JSONDecodeError):
            cached = {}  # a damaged cache is measured again
    key = _cache_key(dtype)
    if not refresh and key in cached:
        try:
            return Calibration(**cached[key])
        except TypeError:
            pass  # an older format: measure again
    measured = measure(dtype, timings=timings)
    cached[key] = measured.to_json()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(cached, f, indent=1)
    os.replace(tmp, path)
    return measured


def _seconds(fn: Callable[..., Any], *args: Any, repeats: int = 5,
             fastest: bool = False, warm_s: float = 0.0) -> float:
    """Median (or with `fastest`, the least) wall seconds of `fn(*args)` after one warm-up
    call (compiles), or after as many calls as take `warm_s` seconds. The least is for
    differences of short programs and for compute rates: the host's noise (about 0.1 ms
    per call on a GPU host) and a GPU's clocks still ramping up only ever add time."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    while time.perf_counter() - start < warm_s:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times) if fastest else statistics.median(times)


def measure(dtype: str, *, timings: dict[str, float] | None = None) -> Calibration:
    """Measures the rates with small timed programs on the present devices: a square GEMM,
    causal attention, an elementwise pass, the trainer's optimizer, all-gather and
    reduce-scatter over all devices (bandwidth from chains of large against small ones,
    latency from a chain of small ones against a single one, inside one program, so that
    the dispatch of a program is not counted), how much of an all-gather chain a concurrent
    GEMM chain leaves exposed, the trainer's offloaded update streaming its moments between
    pinned host memory and the device. `timings`, when given, receives the
    seconds each part took (compiles included)."""
    gpu = jax.default_backend() != "cpu"
    dt = jnp.dtype(dtype)
    # Shapes of a real layer and random data (zeros and ones run faster than data), several
    # products per call so that dispatch is not timed.
    n, chain = (8192, 4) if gpu else (512, 2)
    a = jax.random.normal(jax.random.key(0), (n, n), dt)

    # Every operand is an argument: an array a traced function closes over becomes a
    # constant of the program, which XLA folds at compile time (a 64M-element optimizer
    # calibration took 103 s to compile that way on a GPU host).
    def chained(x: jax.Array, a: jax.Array) -> jax.Array:
        for _ in range(chain):
            x = jnp.matmul(x, a) * 0.01
        return x

    laps = _Laps()
    # The GEMMs are the first work the devices see: half a second of them first, so that an
    # idle GPU's clocks have ramped up (one such calibration measured 617 TFLOP/s where
    # other machines of the kind gave 740-746), then the fastest of 9 calls.
    gemm = chain * 2 * n**3 / _seconds(jax.jit(chained), a, a, repeats=9, fastest=True,
                                       warm_s=0.5 if gpu else 0.0)
    laps("gemm")

    tokens, h, d = (16384, 16, 128) if gpu else (512, 4, 64)
    impl = resolve_attention_impl("auto", dt, d)

    def attend(q: jax.Array) -> jax.Array:
        def loss(q):
            out = jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation=impl)
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss)(q)

    attention = []
    for s in ATTENTION_SEQS if gpu else (128, 256):
        q = jax.random.normal(jax.random.key(1), (tokens // s, s, h, d), dt)
        attention.append((s, 6 * s * tokens * h * d / _seconds(jax.jit(attend), q, repeats=9,
                                                               fastest=True)))
    laps("attention")

    x = jax.random.normal(jax.random.key(2), ((64 << 20) if gpu else (4 << 20),), jnp.float32)
    memory = 2 * x.nbytes / _in_program(_elementwise_passes, x)  # read + write
    laps("memory")
    optimizer = _optimizer_rate((64 << 20) if gpu else (1 << 20))
    laps("optimizer")

    devices = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devices, ("x",))
    count = devices.size
    sharded = NamedSharding(mesh, P("x"))

    def collectives(kind: str, elems: int, links: int, fastest: bool = False) -> float:
        """Seconds of a program of `links` dependent collectives of `elems` float32 per
        device (all-gather: [elems] -> [count * elems], reduce-scatter: the reverse)."""
        body = (functools.partial(_all_gather_chain, links=links) if kind == "ag" else
                functools.partial(_reduce_scatter_chain, links=links, count=count))
        per_device = elems if kind == "ag" else count * elems
        x = jax.device_put(jnp.ones((count * per_device,), jnp.float32), sharded)
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        return _seconds(fn, x, repeats=9 if fastest else 5, fastest=fastest)

    # A chain of 33 against 1: single programs vary by about 0.1 ms on a GPU host, which
    # over 8 links (the earlier chain) was 12 us of error per collective.
    # On a CPU host the simulated devices' collectives are copies within one process: 1 MB
    # per device measures them as well as 4 MB, which took half of a CPU calibration's 11 s.
    small, large, links = 1024, (16 << 20 if gpu else 1 << 18), 33
    rates = {}
    for kind in ("ag", "rs"):
        if count == 1:
            rates[kind] = (float("inf"), 0.0)
            continue
        # Bandwidth from chains of 4 large against 4 small collectives (dispatch and
        # latency cancel out; one 64 MB collective alone takes about 0.4 ms, within the
        # host's noise); latency from a chain of small ones inside one program against a
        # single one, i.e. what a collective costs inside a step, not a program's dispatch.
        t_small4 = collectives(kind, small, 4, fastest=True)
        t_large4 = collectives(kind, large, 4, fastest=True)
        moved = 4 * (large - small) * 4 * (count - 1)  # bytes received per device
        latency = max(collectives(kind, small, links, fastest=True)
                      - collectives(kind, small, 1, fastest=True), 0.0) / (links - 1)
        rates[kind] = (moved / max(t_large4 - t_small4, 1e-9), latency)
        laps(kind)
    exposed = (_exposed_overlap(mesh, n, dt, rates["ag"][0], links=8 if gpu else 4)
               if count > 1 else 0.0)
    laps("exposed")
    host = _host_rate(mesh, units=4, elems=(16 << 20) if gpu else (1 << 14)) \
        if host_memory_supported() else 0.0
    laps("host")
    if timings is not None:
        timings.update(laps.seconds)
    return Calibration(
        device_kind=jax.devices()[0].device_kind, platform=jax.default_backend(),
        devices=count, dtype=str(dt), gemm_flops=gemm, attention_rates=tuple(attention),
        all_gather_bandwidth=rates["ag"][0], all_gather_latency=rates["ag"][1],
        reduce_scatter_bandwidth=rates["rs"][0], reduce_scatter_latency=rates["rs"][1],
        host_bandwidth=host, memory_bandwidth=memory, overlap_exposed=exposed,
        optimizer_rate=optimizer)


class _Laps:
    """Seconds since the previous call, by name (what each part of `measure` took)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now


def _in_program(repeated: Callable[[int], Callable[..., Any]], *args: Any,
                counts: tuple[int, int] = (1, 5)) -> float:
    """Seconds of one repetition inside a program: `repeated(k)` is a function doing the
    work `k` times in a row; the difference of two counts cancels the program's dispatch
    and synchronization (tens of microseconds, as much as a pass over 256 MB)."""
    lo, hi = counts
    t_lo = _seconds(jax.jit(repeated(lo)), *args)
    t_hi = _seconds(jax.jit(repeated(hi)), *args)
    return max(t_hi - t_lo, 1e-9) / (hi - lo)


def _elementwise_passes(k: int) -> Callable[[jax.Array], jax.Array]:
    """`k` dependent elementwise passes (each reads and writes the whole array; the barrier
    keeps XLA from unrolling the loop and fusing the passes into one)."""
    return lambda x: jax.lax.fori_loop(
        0, k, lambda _, x: jax.lax.optimization_barrier(x * 1.5 + 1.0), x)


def _host_rate(mesh: jax.sharding.Mesh, *, units: int, elems: int) -> float:
    """Bytes per second per device that an offloaded step moves between pinned host memory
    and the device, both ways together: `streamed_update` (the trainer's offloaded update)
    of a layer-stacked float32 weight of `units` layers of `elems` elements per device,
    AdamW's moments in host memory grouped one array per layer as the trainer holds them
    (`group_moments`), compiled with the trainer's `streaming_compiler_options`, timed
    inside its program (the fastest of 5 steps, the
    state donated from one to the next as the trainer does). A round trip of one array
    outside a program measured 23-28 GB/s on two GPUs, half the rate the trainer's copies
    reach: its dispatch and small transfers were what it timed."""
    count = mesh.devices.size
    sharding = NamedSharding(mesh, P(None, "x"))
    params = jax.device_put(jnp.ones((units, count * elems), jnp.float32), sharding)
    grads = jax.device_put(jnp.full((units, count * elems), 1e-3, jnp.float32), sharding)
    tx = streamable_chain(optax.identity(), optax.adam(1e-3))
    # Grouped per layer as `TrainStep` holds it, compiled with the trainer's options.
    state = group_moments(init_streamed_on_host(tx, {"w": params}, {"w": True}),
                          {"w": params}, {"w": True}, DEFAULT_GROUP_LAYERS)

    def update(p: jax.Array, state: Any, g: jax.Array) -> tuple[jax.Array, Any]:
        new_p, new_state = streamed_update(tx, {"w": g}, state, {"w": p}, {"w": True})
        return new_p["w"], new_state

    step = jax.jit(update, donate_argnums=(0, 1),
                   compiler_options=streaming_compiler_options() or None)
    args = (params, state)
    for _ in range(2):
        args = step(*args, grads)
    jax.block_until_ready(args)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        args = jax.block_until_ready(step(*args, grads))
        times.append(time.perf_counter() - start)
    moved = 2 * 2 * units * elems * 4  # two moments, in and out, per device
    return moved / min(times)


def _optimizer_rate(n: int) -> float:
    """Parameters per second of the trainer's optimizer update on `n` float32 parameters
    (one leaf: the per-leaf work of the real tree, without its count of leaves)."""
    tx = make_optimizer(TrainConfig())
    params = jax.random.normal(jax.random.key(4), (n,), jnp.float32)
    grads = jax.random.normal(jax.random.key(5), (n,), jnp.float32) * 1e-3
    return n / _in_program(functools.partial(_optimizer_updates, tx), params,
                           tx.init(params), grads)


def _optimizer_updates(tx: optax.GradientTransformation, k: int) -> Callable[..., Any]:
    """``(params, state, grads) -> (params, state)`` after `k` dependent updates of `tx`
    (the gradients an argument, not a constant XLA would fold while compiling)."""
    def run(p: Any, s: Any, g: jax.Array) -> tuple[Any, Any]:
        def body(_: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
            p, s = carry
            u, s = tx.update(g, s, p)
            return jax.lax.optimization_barrier((optax.apply_updates(p, u), s))
        return jax.lax.fori_loop(0, k, body, (p, s))
    return run


def _all_gather_chain(x: jax.Array, links: int) -> jax.Array:
    """`links` dependent all-gathers over mesh axis "x" of the per-device `x` (each result
    cut back to its first shard to feed the next; the last one whole)."""
    elems = x.shape[0]
    for i in range(links):
        x = jax.lax.all_gather(x, "x", tiled=True)
        x = x[:elems] if i < links - 1 else x
    return x


def _reduce_scatter_chain(x: jax.Array, links: int, count: int) -> jax.Array:
    """`links` dependent reduce-scatters over mesh axis "x" (of `count` devices) of the
    per-device `x` (each result tiled back to `x`'s size to feed the next; the last one
    scattered)."""
    for i in range(links):
        x = jax.lax.psum_scatter(x, "x", tiled=True)
        x = jnp.tile(x, count) if i < links - 1 else x
    return x


def _exposed_overlap(mesh: jax.sharding.Mesh, n: int, dtype: Any, bandwidth: float,
                     links: int = 4) -> float:
    """The fraction of the shorter of a GEMM chain and an all-gather chain that running them
    side by side in one program does not hide: ``(both - max) / min`` (0: fully hidden, 1:
    back to back). Collectives slow the GEMMs they overlap (they share SMs and memory
    bandwidth), so a step whose gathers run beside its compute pays this fraction of them.

    Shaped like a layer loop's prefetch: as many gathers as GEMMs (`links` of each), each
    gather sized (from the all-gather `bandwidth`) to take about half a GEMM, so that each
    can hide behind one. (Twice as many gathers as GEMMs, as before, left half of them
    nothing to hide behind whatever the hardware does: 84% exposed on 2x H100.)"""
    count = mesh.devices.size
    sharded = NamedSharding(mesh, P("x"))
    a = jax.device_put(jax.random.normal(jax.random.key(3), (count * n, n), dtype), sharded)

    def gemms(a: jax.Array) -> jax.Array:
        for _ in range(links):
            a = jnp.matmul(a, a) * 0.01
        return a

    def program(fn: Callable[..., Any], n_in: int) -> Callable[..., Any]:
        specs = (P("x"),) * n_in
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs,
                                     out_specs=specs if n_in > 1 else specs[0]))

    # The least of 9 calls: the fraction divides a difference of milliseconds by the
    # shorter chain.
    timed = functools.partial(_seconds, repeats=9, fastest=True)
    t_gemm = timed(program(gemms, 1), a)
    received = 0.5 * t_gemm / links * bandwidth  # bytes per gather and device
    elems = int(min(max(received / (4 * (count - 1)), 1024), 1 << 26))
    x = jax.device_put(jnp.ones((count * elems,), jnp.float32), sharded)
    gathers = functools.partial(_all_gather_chain, links=links)
    t_gather = timed(program(gathers, 1), x)
    t_both = timed(program(lambda a, x: (gemms(a), gathers(x)), 2), a, x)
    shorter = min(t_gemm, t_gather)
    if shorter <= 0:
        return 0.0
    return float(min(max((t_both - max(t_gemm, t_gather)) / shorter, 0.0), 1.0))


#: Bytes per gathered element of each low-precision format (payload + scales).
_FORMAT_BYTES = {"fp8": 1 + 4 / 4096, "mxfp8": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
#: Weight matrices gathered per layer (qkv, out, gate_up, down): one collective each.
_WEIGHTS_PER_LAYER = 4


@dataclasses.dataclass(frozen=True)
class Topology:
    """Devices in nodes: collectives within a node at the calibration's rates, those whose
    groups span nodes at the network's (`step_seconds`).

    Attributes:
      gpus_per_node: devices per node (consecutive device ids, as a multi-process run
        orders them); a mesh axis spans nodes when its groups do (`spans_nodes`).
      inter_node_bandwidth: bytes per second per device that an all-gather or a
        reduce-scatter spanning nodes moves (bus bandwidth: bytes each device receives over
        seconds), e.g. 50e9 for one 400 Gb/s InfiniBand link per GPU.
      intra_node_bandwidth: the same within a node; None: the calibration's all-gather and
        reduce-scatter bandwidths.

    Raises:
      UsageError: a count below 1, a bandwidth that is not a positive number.
    """

    gpus_per_node: int
    inter_node_bandwidth: float
    intra_node_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) \
                or self.gpus_per_node < 1:
            raise UsageError(f"Topology.gpus_per_node={self.gpus_per_node!r} must be an int "
                             ">= 1.")
        for name in ("inter_node_bandwidth", "intra_node_bandwidth"):
            value = getattr(self, name)
            if value is None and name == "intra_node_bandwidth":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not np.isfinite(value) or value <= 0:
                raise UsageError(f"Topology.{name}={value!r} must be a positive number of "
                                 "bytes per second.")


#: Mesh axes from outermost to innermost (`gtp_jax.make_mesh`'s order; cp sits between gtp
#: and tp when it is used).
MESH_ORDER = ("dp", "ep", "gtp", "cp", "tp")


def spans_nodes(cfg: TrainConfig, axes: tuple[str, ...], gpus_per_node: int) -> bool:
    """Whether a collective over the mesh axes `axes` of `cfg` (its groups: devices that
    differ only in those axes) leaves a node of `gpus_per_node` consecutive devices: a
    group spans as many consecutive devices as the outermost of its axes (of size > 1) and
    every axis inside it have together, e.g. dp2 x gtp8: each dp group is 8 devices apart
    (16 consecutive), each gtp group 8 consecutive devices."""
    sizes = {a: getattr(cfg, a) for a in MESH_ORDER}
    moving = [a for a in axes if sizes[a] > 1]
    if not moving:
        return False
    inner = min(MESH_ORDER.index(a) for a in moving)
    return int(np.prod([sizes[a] for a in MESH_ORDER[inner:]])) > gpus_per_node


def step_seconds(cfg: TrainConfig, cal: Calibration,
                 topology: Topology | None = None) -> dict[str, float]:
    """Predicted seconds of one training step of `cfg` (see the module docstring).

    Args:
      cfg: the run, laid out.
      cal: the rates.
      topology: devices in nodes (collectives spanning them at the network's bandwidth);
        None: every collective at `cal`'s rates (one host).

    Returns:
      ``{"compute", "gtp", "other", "offload", "loop", "total"}``.
    """
    cfg = resolve_auto(cfg)
    mc = model_config(cfg)
    d, layers = mc.d_model, mc.n_layers
    a_item = np.dtype(mc.dtype).itemsize
    p_item = np.dtype(mc.param_dtype).itemsize
    tokens = cfg.batch_size * cfg.seq_len / (cfg.dp * cfg.ep * cfg.gtp * cfg.cp)
    # The model's own count (`TransformerConfig.train_flops_per_token`), with a forward
    # pass more under remat "full".
    width = mc.n_heads * mc.head_size
    passes = 8.0 if mc.remat == "full" else 6.0
    matmul = passes * mc.matmul_params() * tokens / cfg.tp
    attention = passes * layers * width * cfg.seq_len * tokens / cfg.tp
    compute = matmul / cal.gemm_flops + attention / cal.attention_flops(cfg.seq_len)

    def bandwidth(axes: tuple[str, ...], measured: float) -> float:
        if topology is None:
            return measured
        if spans_nodes(cfg, axes, topology.gpus_per_node):
            return topology.inter_node_bandwidth
        return topology.intra_node_bandwidth or measured

    def ag(nbytes: float, axes: tuple[str, ...], count: int = 1) -> float:
        size = int(np.prod([getattr(cfg, a) for a in axes]))
        if size == 1:
            return 0.0
        return count * cal.all_gather_latency + nbytes * (size - 1) / size / \
            bandwidth(axes, cal.all_gather_bandwidth)

    def rs(nbytes: float, axes: tuple[str, ...], count: int = 1) -> float:
        size = int(np.prod([getattr(cfg, a) for a in axes]))
        if size == 1:
            return 0.0
        return count * cal.reduce_scatter_latency + nbytes * (size - 1) / size / \
            bandwidth(axes, cal.reduce_scatter_bandwidth)

    weights = mc.num_params() / (cfg.tp * cfg.ep)  # what one gtp group gathers
    gather_item = _FORMAT_BYTES.get(cfg.gather_format) or np.dtype(
        cfg.gather_dtype or mc.param_dtype).itemsize
    collectives = layers * _WEIGHTS_PER_LAYER + 2
    gtp = (ag(2 * weights * gather_item, ("gtp",), 2 * collectives)
           + rs(weights * 4, ("gtp",), collectives))
    shard = mc.num_params() / (cfg.gtp * cfg.tp * cfg.ep)  # parameters on this device
    grads = shard * p_item
    # Every replica of a weight saw other tokens: an all-reduce over dp and cp (context
    # parallelism splits the sequence, not the weights).
    replicas = ("dp", "cp")
    other = ag(grads, replicas, collectives) + rs(grads, replicas, collectives)
    act = tokens * d * a_item
    gathers, scatters = tp_collectives_per_layer(mc.remat)
    other += (ag(act * gathers * layers, ("tp",), gathers * layers)
              + rs(act * scatters * layers, ("tp",), scatters * layers))
    if cfg.cp > 1:  # K and V around the ring: forward, and K, V, dK, dV backward
        kv = 2 * tokens * d * a_item / cfg.tp
        other += 3 * layers * (cfg.cp - 1) * (
            cal.all_gather_latency + kv / bandwidth(("cp",), cal.all_gather_bandwidth))
    # The optimizer on this device's shards, once per step: the measured rate, else AdamW's
    # bytes (read param, grad, 2 moments; write param, 2 moments; float32) at memory speed.
    if cal.optimizer_rate > 0:
        other += shard / cal.optimizer_rate
    elif cal.memory_bandwidth > 0:
        other += 28 * shard / cal.memory_bandwidth
    offload = 0.0
    if cfg.offload_optimizer:  # moments in and out, streamed one unit (a layer of the stacked
        # weights, or another weight) at a time after the backward: double buffering hides
        # the transfers behind the update except for the first unit's copy-in and the last
        # one's copy-out, but the update itself is short
        # next to the transfers, so the step pays about the transfer time. Moments kept
        # on the device (offload_exclude) do not travel.
        state = pinned_host_bound(cfg) + 4
        offload = 2 * state / cal.host_bandwidth if cal.host_bandwidth else float("inf")
    loop = 0.0
    if not mc.unrolled and cal.memory_bandwidth > 0:
        # The scanned loop stacks each layer's residuals (written in the forward, read back
        # in the backward): copies the unrolled loop does not make.
        loop = 2 * tokens * layers * _saved_per_token(mc) * a_item / cfg.tp \
            / cal.memory_bandwidth
    overlapped = mc.unrolled or cfg.prefetch
    if overlapped:  # gathers beside the compute, which hides all but a measured fraction
        total = max(compute, gtp) + cal.overlap_exposed * min(compute, gtp)
    else:
        total = compute + gtp
    total += other + offload + loop
    return {"compute": compute, "gtp": gtp, "other": other, "offload": offload,
            "loop": loop, "total": total}


def tp_collectives_per_layer(remat: str) -> tuple[int, int]:
    """Activation all-gathers and reduce-scatters over ``tp`` per layer and training step,
    by remat policy: ``(all-gathers, reduce-scatters)``.

    Sequence parallelism gathers the normed sequence before the attention's and the MLP's
    input projections and scatters their output projections' sums: 2 + 2 in the forward,
    and as many transposed in the backward. The backward pass gathers both normed inputs
    again for the weight gradients (the forward saves only this device's chunk), under
    every policy; under "dots" and "full" that gather also serves the recomputed forward,
    which recomputes the attention's scatter too (the MLP's input is built on it); the
    MLP's scatter feeds only the next layer, so nothing recomputes it. The compiled
    bfloat16 step has exactly these counts (`tests/test_plan.py`; jaxlib before 0.11 merges
    the backward's gathers with the forward's under "none", 2 fewer; in float32 XLA keeps
    the attention's scatter under "dots": one fewer).
    """
    return (6, 4) if remat == "none" else (6, 5)


def _saved_per_token(mc: Any) -> int:
    """Activation values a layer saves per token for its backward pass, by remat policy:
    "full" its input; "dots" every matmul output (q, k, v, the attention output and its
    projection, the MLP's gate/up and down) and the residual stream; "none" also the norm
    outputs and the MLP's activation products."""
    d, width = mc.d_model, mc.n_heads * mc.head_size
    kv = mc.kv_heads * mc.head_size
    ff = mc.moe_top_k * mc.expert_d_ff if mc.moe_experts else mc.d_ff
    dots = (width + 2 * kv) + width + d + 2 * ff + d
    return {"full": d, "dots": dots, "none": dots + 4 * d + 2 * ff}[mc.remat]
