"""XLA flags gtp_jax sets by default, because compute/communication overlap depends on them.

``import gtp_jax`` calls `apply_default_xla_flags` before anything can start the XLA backend
(which reads ``XLA_FLAGS`` once). A flag the user already set, to either value, is left
alone. Set ``GTP_JAX_NO_DEFAULT_XLA_FLAGS=1`` to add none. `added_xla_flags` tells what was
added; `gtp_jax.describe_mesh` and the command line's run header print it. Why each flag is
there, with measurements: ``docs/overlap.md``.
"""

from __future__ import annotations

import os

#: Environment variable that switches the defaults off.
OPT_OUT = "GTP_JAX_NO_DEFAULT_XLA_FLAGS"
#: flag -> value added to XLA_FLAGS unless the user set that flag already.
DEFAULT_XLA_FLAGS: dict[str, str] = {
    "--xla_gpu_enable_latency_hiding_scheduler": "true",
}

_ADDED: list[str] = []


def apply_default_xla_flags(environ: dict[str, str] | None = None) -> list[str]:
    """Appends `DEFAULT_XLA_FLAGS` to ``XLA_FLAGS`` in `environ` (default: ``os.environ``).

    Returns the flags added (empty when `OPT_OUT` is set or the user set them all).
    """
    env = os.environ if environ is None else environ
    if env.get(OPT_OUT):
        return []
    current = env.get("XLA_FLAGS", "")
    added = [f"{flag}={value}" for flag, value in DEFAULT_XLA_FLAGS.items()
             if flag not in current]
    if added:
        env["XLA_FLAGS"] = " ".join([current, *added]).strip()
    if environ is None:
        _ADDED[:] = added
    return added


def simulate_cpu_devices(count: int, environ: dict[str, str] | None = None) -> None:
    """Asks XLA for `count` CPU devices (``--xla_force_host_platform_device_count``) unless
    ``XLA_FLAGS`` already sets a count. Effective only before JAX starts its CPU backend;
    harmless on GPUs."""
    env = os.environ if environ is None else environ
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def added_xla_flags() -> list[str]:
    """The flags ``import gtp_jax`` added to this process's ``XLA_FLAGS``."""
    return list(_ADDED)


def describe_xla_flags() -> str:
    """One line saying which XLA flags gtp_jax added and how to opt out."""
    if os.environ.get(OPT_OUT):
        return f"XLA flags: gtp_jax added none ({OPT_OUT} is set)"
    if not _ADDED:
        return "XLA flags: gtp_jax added none (set by the user already)"
    return f"XLA flags added by gtp_jax: {' '.join(_ADDED)} (opt out: {OPT_OUT}=1)"
