"""How much memory this process's host can give it: Linux's ``/proc/meminfo``, narrowed by
the memory limit of the process's cgroup (a container's limit, which ``/proc/meminfo``
does not show: inside a container limited to 24 GiB on a 256 GiB host it still reports
the host's memory).

Read by the pinned host pool default (`gtp_jax.base.xla_flags`) and by the checks that
refuse a run before it allocates more than the host has (`gtp_jax.train.step.memory`).
"""

from __future__ import annotations

import os

#: cgroup v1 reports "no limit" as a huge number (the largest page-aligned int64).
_NO_LIMIT = 2**60


def meminfo_bytes(field: str, path: str = "/proc/meminfo") -> int | None:
    """Bytes of a ``/proc/meminfo`` field (``"MemTotal"``, ``"MemAvailable"``); None where
    the file or field is missing."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024  # the file says kB, meaning KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_memory(root: str = "/sys/fs/cgroup",
                  proc_cgroup: str = "/proc/self/cgroup") -> tuple[int | None, int | None]:
    """``(limit, usage)`` bytes of this process's memory cgroup (v2 ``memory.max`` /
    ``memory.current``, else v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``;
    usage less the inactive file cache of ``memory.stat``, which the kernel reclaims),
    looked up at the process's cgroup path under `root` and then at `root` itself (a
    container's namespace root); None for "no limit" or where unknown."""
    paths = {"v2": "", "v1": ""}
    try:
        with open(proc_cgroup, encoding="ascii") as f:
            for line in f:
                parts = line.strip().split(":", 2)
                if len(parts) != 3:
                    continue
                if parts[0] == "0" and parts[1] == "":
                    paths["v2"] = parts[2].lstrip("/")
                elif "memory" in parts[1].split(","):
                    paths["v1"] = parts[2].lstrip("/")
    except OSError:
        pass
    candidates = [
        (os.path.join(root, paths["v2"]), "memory.max", "memory.current"),
        (root, "memory.max", "memory.current"),
        (os.path.join(root, "memory", paths["v1"]), "memory.limit_in_bytes",
         "memory.usage_in_bytes"),
        (os.path.join(root, "memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ]
    for folder, limit_file, usage_file in candidates:
        limit = _read_int(os.path.join(folder, limit_file))
        if limit is None:
            continue
        usage = _read_int(os.path.join(folder, usage_file))
        if usage is not None:  # page cache the kernel can drop is not in use (as docker says)
            usage = max(usage - _inactive_file(os.path.join(folder, "memory.stat")), 0)
        return (None if limit == -1 or limit >= _NO_LIMIT else limit), usage
    return None, None


def _inactive_file(path: str) -> int:
    """Bytes of inactive file cache in a cgroup's ``memory.stat`` (v2 ``inactive_file``,
    v1 ``total_inactive_file``); 0 where unknown."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file"):
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _read_int(path: str) -> int | None:
    """The integer in a cgroup file; -1 for ``max`` (no limit); None where unreadable."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return -1
    try:
        return int(text)
    except ValueError:
        return None


def total_bytes(meminfo: str = "/proc/meminfo", root: str = "/sys/fs/cgroup",
                proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The host's memory as this process may use it: ``MemTotal``, or the cgroup's limit
    where that is lower; None where neither is known."""
    total = meminfo_bytes("MemTotal", meminfo)
    limit, _ = cgroup_memory(root, proc_cgroup)
    known = [x for x in (total, limit) if x is not None]
    return min(known) if known else None


def available_bytes(meminfo: str = "/proc/meminfo", root: str = "/sys/fs/cgroup",
                    proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes a new allocation can get without swapping or the cgroup's out-of-memory
    killer: ``MemAvailable`` (else the free pages ``os.sysconf`` reports), or the cgroup's
    limit less its usage where that is lower; None where nothing is known."""
    available = meminfo_bytes("MemAvailable", meminfo)
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = None
    limit, usage = cgroup_memory(root, proc_cgroup)
    room = None if limit is None else max(limit - (usage or 0), 0)
    known = [x for x in (available, room) if x is not None]
    return min(known) if known else None


def gpu_count(proc: str = "/proc/driver/nvidia/gpus",
              environ: dict[str, str] | None = None) -> int | None:
    """NVIDIA GPUs on this host, read without starting CUDA: the entries of `proc` (one per
    GPU the driver knows, whatever this process may see), else the devices
    ``CUDA_VISIBLE_DEVICES`` names; None where neither tells."""
    try:
        found = len(os.listdir(proc))
    except OSError:
        found = 0
    if found:
        return found
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])


def jax_gpu_count(proc: str = "/proc/driver/nvidia/gpus",
                  environ: dict[str, str] | None = None) -> int | None:
    """The GPUs JAX will run on here: `gpu_count`, but None where ``JAX_PLATFORMS`` names
    platforms without a GPU (``JAX_PLATFORMS=cpu`` on a GPU host runs on CPU devices)."""
    env = os.environ if environ is None else environ
    platforms = [p.strip().lower() for p in env.get("JAX_PLATFORMS", "").split(",")
                 if p.strip()]
    if platforms and not any(p in ("cuda", "gpu", "rocm") for p in platforms):
        return None
    return gpu_count(proc, env)
