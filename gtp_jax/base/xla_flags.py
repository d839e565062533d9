"""XLA settings gtp_jax makes by default: flags that compute/communication overlap and
compile time depend on, a CPU scheduler for scanned loops, and a pinned host memory pool
per GPU sized from the host's memory.

``import gtp_jax`` calls `apply_default_xla_flags` before anything can start the XLA backend
(which reads ``XLA_FLAGS`` and ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` once). A setting the
user already made, to any value, is left alone. Set ``GTP_JAX_NO_DEFAULT_XLA_FLAGS=1`` to add
none. `added_xla_flags` tells what was added; `gtp_jax.describe_mesh` and the command line's
run header print it. Why each flag is there, with measurements: ``docs/overlap.md``; why the
pool: `PINNED_POOL_ENV`.
"""

from __future__ import annotations

import os

from gtp_jax.base.host import gpu_count, total_bytes

#: Environment variable that switches the defaults off.
OPT_OUT = "GTP_JAX_NO_DEFAULT_XLA_FLAGS"
#: flag -> value added to XLA_FLAGS unless the user set that flag already.
#:
#: * the latency-hiding scheduler: XLA on one process driving several GPUs otherwise runs
#:   collectives almost back to back with the GEMMs beside them (docs/overlap.md);
#: * no Triton GEMMs: XLA's GPU compiler autotunes a Triton kernel for every GEMM it may
#:   emit, which is almost all of an FP8 step's compile time (1x H200, jax 0.11.2: the 1b
#:   preset's FP8 step compiled in 117 s, 19 s without; 8 llama3-8b layers 168 s, 14 s;
#:   bf16 12.4 s, 4.1 s) and bought no step time (the cuBLAS / cuBLASLt GEMMs it then uses
#:   were as fast or faster: 75.7 vs 76.6 ms, 183.6 vs 186.1 ms). Set
#:   ``--xla_gpu_enable_triton_gemm=true`` in ``XLA_FLAGS`` to have them back;
#: * no fusion autotuning: XLA otherwise compiles each elementwise / reduction fusion with
#:   more than one emitter to pick one, a cost that grows with the program's distinct
#:   fusions (jax 0.11.2, H100: llama3-8b's step for 2 GPUs, 32 layers unrolled, compiled in
#:   20.3 / 21.5 s, 13.3 / 11.5 s without; on one GPU, 16 layers 5.0 -> 4.2 s, FP8 8 layers
#:   5.5 -> 4.0 s) and bought no step time (95.1-97.2 ms both ways on 8 layers, 194.5 /
#:   195.0 ms on 16, FP8 162.6 / 163.1 ms, the 1b preset 93.2 / 93.1 ms). Set
#:   ``--xla_gpu_experimental_enable_fusion_autotuner=true`` to have it back;
#: * on CPUs, XLA's memory-ordered (depth-first) scheduler instead of its
#:   concurrency-ordered one: a training step with a scanned layer loop (``jax.lax.scan``,
#:   the trainer's ``--no-unroll-layers``) ran 1.3x slower with the latter on 8 simulated
#:   devices over 2 cores (the tiny preset, jax 0.10.2: 116-143 ms, 88-103 ms with this
#:   flag; unrolled the same within the noise; docs/overlap.md). Set
#:   ``--xla_cpu_enable_concurrency_optimized_scheduler=true`` to have it back.
DEFAULT_XLA_FLAGS: dict[str, str] = {
    "--xla_gpu_enable_latency_hiding_scheduler": "true",
    "--xla_gpu_enable_triton_gemm": "false",
    "--xla_gpu_experimental_enable_fusion_autotuner": "false",
    "--xla_cpu_enable_concurrency_optimized_scheduler": "false",
}

#: XLA's cap on the pinned host memory a GPU process allocates for each device (GiB; memory
#: kind ``"pinned_host"``, where an offloaded optimizer state lives). XLA's default is
#: `XLA_PINNED_POOL_GIB`: on a 2x H200 host with 256 GiB of memory an offloaded state of
#: 70 GB per GPU failed with "Out of host memory" at that cap
#: (docs/results/2026-11-26_2xH200/README.md). The pool grows on demand (nothing is
#: reserved), but in regions of doubling size up to its cap (XLA's BFC allocator), so it can
#: hold far more than its arrays: the caps of all of a host's GPUs together must stay within
#: the host's memory, or the pools can grow past it and the kernel ends the process. gtp_jax
#: sets the cap to `PINNED_POOL_HOST_SHARE` of the host's memory divided by its GPUs.
PINNED_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_PINNED_POOL_GIB = 64
#: The share of the host's memory the pinned pools of all its GPUs may take together; the
#: rest is for the process itself (Python, compilation, arrays being built).
PINNED_POOL_HOST_SHARE = 0.9

_ADDED: list[str] = []


def pinned_pool_bytes(environ: dict[str, str] | None = None) -> int:
    """The pinned host pool per device that XLA's GPU client uses: `PINNED_POOL_ENV` of
    `environ` (default ``os.environ``) in GiB, else XLA's default (`XLA_PINNED_POOL_GIB`);
    an unreadable value counts as the default, as XLA reads it."""
    env = os.environ if environ is None else environ
    try:
        gib = int(env.get(PINNED_POOL_ENV, XLA_PINNED_POOL_GIB))
    except ValueError:
        gib = XLA_PINNED_POOL_GIB
    return gib * 2**30


def pinned_pool_problem(need_bytes: int, pool_bytes: int | None = None) -> str | None:
    """Why `need_bytes` of pinned host memory per device do not fit XLA's pool
    (`pool_bytes`, default `pinned_pool_bytes`), naming the setting and the value that
    would fit; None if they fit."""
    pool_bytes = pinned_pool_bytes() if pool_bytes is None else pool_bytes
    if need_bytes <= pool_bytes:
        return None
    gib = 2**30
    return (f"the offloaded optimizer state needs at least {need_bytes / gib:.2f} GiB of "
            f"pinned host memory per device but XLA's pinned host pool is "
            f"{pool_bytes / gib:.2f} GiB per device; set {PINNED_POOL_ENV}="
            f"{-(-need_bytes // gib)} (or more) before the process starts JAX")


def default_pinned_pool_gib(host_bytes: int, gpus: int | None) -> int:
    """The pinned host pool per device gtp_jax sets (GiB): `PINNED_POOL_HOST_SHARE` of
    `host_bytes` over `gpus` (the host's GPUs; None: 1), so that the pools of all of them
    cannot grow past the host's memory together."""
    return int(host_bytes * PINNED_POOL_HOST_SHARE) // max(gpus or 1, 1) // 2**30


def apply_default_xla_flags(environ: dict[str, str] | None = None,
                            host_bytes: int | None = None,
                            gpus: int | None = None) -> list[str]:
    """Appends `DEFAULT_XLA_FLAGS` to ``XLA_FLAGS`` in `environ` (default: ``os.environ``),
    and sets `PINNED_POOL_ENV`, when it is unset, to `default_pinned_pool_gib` of
    `host_bytes` (default `gtp_jax.base.host.total_bytes`: ``MemTotal`` or the cgroup's
    limit) and `gpus` (default `gtp_jax.base.host.gpu_count`, the GPUs on this host).

    Returns the settings added (empty when `OPT_OUT` is set or the user made them all).
    """
    env = os.environ if environ is None else environ
    if env.get(OPT_OUT):
        return []
    current = env.get("XLA_FLAGS", "")
    added = [f"{flag}={value}" for flag, value in DEFAULT_XLA_FLAGS.items()
             if flag not in current]
    if added:
        env["XLA_FLAGS"] = " ".join([current, *added]).strip()
    host_bytes = total_bytes() if host_bytes is None else host_bytes
    if PINNED_POOL_ENV not in env and host_bytes:
        gpus = gpu_count() if gpus is None else gpus
        env[PINNED_POOL_ENV] = str(max(default_pinned_pool_gib(host_bytes, gpus), 1))
        added.append(f"{PINNED_POOL_ENV}={env[PINNED_POOL_ENV]}")
    if environ is None:
        _ADDED[:] = added
    return added


#: The most CPU devices the command lines simulate in one process (JAX starts 1024 in about
#: a second; a count in the millions runs for minutes and out of memory before any message).
MAX_SIMULATED_DEVICES = 1024


def simulate_cpu_devices(count: int, environ: dict[str, str] | None = None) -> None:
    """Asks XLA for `count` CPU devices (``--xla_force_host_platform_device_count``) unless
    ``XLA_FLAGS`` already sets a count. Effective only before JAX starts its CPU backend;
    harmless on GPUs."""
    env = os.environ if environ is None else environ
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


#: The XLA flag that makes GPU programs bit-reproducible run to run: deterministic kernels for
#: scatter-add (the embedding's gradient), attention's backward and GEMMs, and no autotuning
#: (which can pick another kernel in each compilation). Slower; for comparing runs.
DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops"


def request_deterministic(environ: dict[str, str] | None = None) -> None:
    """Adds `DETERMINISTIC_FLAG` ``=true`` to ``XLA_FLAGS`` unless the user set it. Effective
    only before JAX starts its GPU backend; CPU programs are reproducible already."""
    env = os.environ if environ is None else environ
    flags = env.get("XLA_FLAGS", "")
    if DETERMINISTIC_FLAG not in flags:
        env["XLA_FLAGS"] = f"{flags} {DETERMINISTIC_FLAG}=true".strip()
        if environ is None:
            _ADDED.append(f"{DETERMINISTIC_FLAG}=true")


def added_xla_flags() -> list[str]:
    """The settings ``import gtp_jax`` added to this process's environment (``XLA_FLAGS``
    flags, `PINNED_POOL_ENV`)."""
    return list(_ADDED)


def applies_on(setting: str, platform: str) -> bool:
    """Whether an added setting (an `added_xla_flags` entry) affects a `platform` backend
    (``"cpu"``, ``"gpu"``, ...): the ``--xla_gpu_*`` flags and ``XLA_PJRT_GPU_*`` variables
    affect GPUs only, the ``--xla_cpu_*`` flags CPUs only."""
    if setting.startswith(("--xla_gpu_", "XLA_PJRT_GPU_")):
        return platform == "gpu"
    if setting.startswith("--xla_cpu_"):
        return platform == "cpu"
    return True


def describe_xla_flags(platform: str | None = None) -> str:
    """One line saying which XLA settings gtp_jax added and how to opt out; with `platform`
    (a backend name, e.g. a mesh's devices' ``"cpu"``), only those that apply there."""
    if os.environ.get(OPT_OUT):
        return f"XLA settings: gtp_jax added none ({OPT_OUT} is set)"
    if not _ADDED:
        return "XLA settings: gtp_jax added none (set by the user already)"
    added = _ADDED if platform is None else [s for s in _ADDED if applies_on(s, platform)]
    if not added:
        return f"XLA settings: none of gtp_jax's apply on {platform} (they are for GPUs)"
    return f"XLA settings added by gtp_jax: {' '.join(added)} (opt out: {OPT_OUT}=1)"
