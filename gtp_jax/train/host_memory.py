"""The host's available memory: what a run on simulated CPU devices, whose every device
lives in this process's memory, and an offloaded optimizer state are checked against
before anything is built (`gtp_jax.train.memory`)."""

from __future__ import annotations

from gtp_jax.base import host


def available_host_bytes() -> int | None:
    """Bytes of memory the host can give a new allocation without swapping or the
    process's cgroup (container) limit: `gtp_jax.base.host.available_bytes`; None where it
    is not known."""
    return host.available_bytes()
