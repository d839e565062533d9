"""XLA flags gtp_jax sets by default, because overlap depends on them.

Measured on 2x H200 (jax 0.11.2, single process; ``benchmarks/overlap_probe.py``, see
``docs/overlap.md``): an all-gather independent of a GEMM chain was 7% hidden with default
flags and 50% hidden with the latency-hiding scheduler switched on explicitly. The flags
are read when the XLA backend starts, so they are added to ``XLA_FLAGS`` on ``import
gtp_jax``; a flag the user already set (either value) is left alone. Set
``GTP_JAX_NO_DEFAULT_XLA_FLAGS=1`` to add none.
"""

from __future__ import annotations

import os

#: flag -> value added to XLA_FLAGS unless the user set that flag already.
DEFAULT_XLA_FLAGS: dict[str, str] = {
    "--xla_gpu_enable_latency_hiding_scheduler": "true",
}


def apply_default_xla_flags(environ: dict[str, str] | None = None) -> list[str]:
    """Appends `DEFAULT_XLA_FLAGS` to ``XLA_FLAGS`` in `environ`; returns the flags added."""
    env = os.environ if environ is None else environ
    if env.get("GTP_JAX_NO_DEFAULT_XLA_FLAGS"):
        return []
    current = env.get("XLA_FLAGS", "")
    added = [f"{flag}={value}" for flag, value in DEFAULT_XLA_FLAGS.items()
             if flag not in current]
    if added:
        env["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
