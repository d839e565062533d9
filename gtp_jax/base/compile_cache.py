"""JAX's persistent compilation cache for the command line (``python -m gtp_jax plan`` and
``train``).

A training step compiled once is read back from disk by the next process that compiles the
same program: ``train`` after ``plan`` (or after another ``train`` of the same run: a
resume, a restart after a failure) starts without compiling its step, and runs the very
executable whose memory the planner read. A GPU compiler autotunes kernels while it
compiles, and two compiles of one program can pick other kernels with other workspace: the
same offloaded layout compiled to 12.96 and 14.25 GiB in two processes on one H100
(docs/planning.md), so without the cache a plan's peak is one compile's, not necessarily
the run's.

Where: ``--compile-cache DIR`` (``off`` or ``none``: no cache); else
``$GTP_JAX_COMPILE_CACHE``; else JAX's own setting if the user made one
(``JAX_COMPILATION_CACHE_DIR``, left alone); else `DEFAULT_DIR` (none if that cannot be
written). Entries are capped at `MAX_BYTES` in all (JAX evicts the least recently used).
The library itself (``gtp_jax.shard``, `gtp_jax.train.train`, `gtp_jax.plan.plan`) changes
no JAX setting; this is the command line's choice, as a program's.
"""

from __future__ import annotations

import os

from gtp_jax.base.errors import UsageError

#: Environment variable naming the cache directory (or ``off``).
CACHE_ENV = "GTP_JAX_COMPILE_CACHE"
#: Values that turn the cache off (any case): ``off``, and ``none`` as other flags spell
#: "nothing" (``--remat none``); a folder of that name is ``./none``.
OFF = ("off", "none")
#: The directory used when nothing else is set.
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "gtp_jax", "compile")
#: Cap on the cache's size on disk (a 1b step's GPU executable is a few MB; llama3-8b's
#: a few tens).
MAX_BYTES = 8 * 2**30
_JAX_ENV = "JAX_COMPILATION_CACHE_DIR"
#: Help of the command line's ``--compile-cache DIR``.
HELP = (f"directory of JAX's persistent compilation cache, or off (default: ${CACHE_ENV}, "
        f"else {_JAX_ENV} if set, else ~/.cache/gtp_jax/compile): a later plan or train of "
        "the same program reads it back instead of compiling, so a run trains the "
        "executable its plan measured")


def compile_cache_dir(flag: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The directory the command line caches compiled programs in: `flag` (the
    ``--compile-cache`` value, None if not given), else `CACHE_ENV`, else `DEFAULT_DIR`;
    None for ``off``, or when only JAX's own ``JAX_COMPILATION_CACHE_DIR`` is set (JAX
    reads that itself).

    The default directory, when it cannot be created or written (a read-only home), gives
    None: the run compiles as without a cache.

    Raises:
      UsageError: a directory the user named (flag or `CACHE_ENV`) exists as a file or
        cannot be created or written.
    """
    env = os.environ if environ is None else environ
    value = flag if flag is not None else env.get(CACHE_ENV)
    if value is None and env.get(_JAX_ENV):
        return None
    chosen = value is not None
    value = DEFAULT_DIR if value is None else value
    if value.strip().lower() in OFF:
        return None
    where = "--compile-cache" if flag is not None else f"${CACHE_ENV}"
    path = os.path.abspath(os.path.expanduser(value))
    try:
        os.makedirs(path, exist_ok=True)
        problem = None if os.access(path, os.W_OK) else "is not writable"
    except OSError as err:
        problem = f"cannot be created ({err.strerror})"
    if problem is None:
        return path
    if not chosen:
        return None
    raise UsageError(f"{where}={value!r} {problem}; pass --compile-cache DIR with a writable "
                     "directory, or --compile-cache off.")


def use_compile_cache(directory: str | None) -> None:
    """Points JAX's persistent compilation cache at `directory` (None: changes nothing), at
    most `MAX_BYTES` in all. JAX caches the programs that took at least
    ``jax_persistent_cache_min_compile_time_secs`` (1 s) to compile: training steps, not
    the many small programs of eager array operations. Call before the first compile of
    the process."""
    if directory is None:
        return
    import jax  # noqa: PLC0415

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
