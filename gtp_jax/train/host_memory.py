"""The host's available memory: what a run on simulated CPU devices, whose every device
lives in this process's memory, is checked against before compiling
(`gtp_jax.train.memory.check_host_memory`)."""

from __future__ import annotations

import os

from gtp_jax.base.xla_flags import meminfo_bytes


def available_host_bytes() -> int | None:
    """Bytes of memory the host can give a new allocation without swapping: Linux's
    ``MemAvailable`` (/proc/meminfo), else free pages (``os.sysconf``); None where neither
    is known."""
    available = meminfo_bytes("MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
