"""How long a compile took, and whether JAX's persistent compilation cache served it.

`measure_compile(fn)` runs ``fn`` (e.g. ``jitted.lower(...).compile()``) and returns its
result with a `CompileReport`: the seconds it took and, where JAX tells, ``"hit"`` (the
executable was read from the cache) or ``"miss"`` (it was compiled).

JAX says so through ``jax.monitoring`` events (``jax/_src/compiler.py``, the same names in
jax 0.10 and 0.11): every compile that may use the persistent cache records
`REQUEST_EVENT`, followed by `HIT_EVENT` when the cache held the executable; a compiled
executable written to the cache records `WRITE_EVENT` (JAX writes only programs that took
at least ``jax_persistent_cache_min_compile_time_secs`` to compile, 1 s by default).
The verdict is given only when it is certain: no cache directory set
(``jax_compilation_cache_dir``), no request recorded (this JAX records no such events, or
the backend cannot serialize executables), or no compile at all (the program was already
compiled in this process) give ``cache=None``, never a guess.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax

#: A compile that may read or write the persistent cache.
REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
#: The executable was read from the cache.
HIT_EVENT = "/jax/compilation_cache/cache_hits"
#: A compiled executable was written to the cache (JAX names it a miss).
WRITE_EVENT = "/jax/compilation_cache/cache_misses"

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """One compile, measured.

    Attributes:
      seconds: wall seconds of the compile (tracing, lowering, XLA's compile or the cache
        read).
      cache: ``"hit"`` (every program compiled was read from the persistent cache),
        ``"miss"`` (compiled, none read from it), ``"partial"`` (some of each), or None
        (unknown: no cache directory, no events from this JAX, or nothing compiled).
      written: programs written to the cache by this compile (on a miss: 0 when the
        compile was faster than JAX's minimum for caching).
    """

    seconds: float
    cache: str | None = None
    written: int = 0

    def describe(self) -> str:
        """``compiled in 12.3 s (cache miss)``; the cache part only where known."""
        text = f"compiled in {self.seconds:.1f} s"
        if self.cache is None:
            return text
        if self.cache == "partial":
            return f"{text} (cache: partly read from it)"
        if self.cache == "miss" and not self.written:
            minimum = float(jax.config.jax_persistent_cache_min_compile_time_secs)
            why = (f": JAX caches programs that take at least {minimum:g} s to compile"
                   if self.seconds < minimum else "")
            return f"{text} (cache miss; not written to the cache{why})"
        return f"{text} (cache {self.cache})"

    def to_json(self) -> dict[str, Any]:
        return {"compile_s": self.seconds, "compile_cache": self.cache}


class _Counter:
    """Counts the cache events of the calling thread (other threads may compile too)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.counts = {REQUEST_EVENT: 0, HIT_EVENT: 0, WRITE_EVENT: 0}

    def __call__(self, event: str, **_: Any) -> None:
        if event in self.counts and threading.get_ident() == self.thread:
            self.counts[event] += 1


def measure_compile(fn: Callable[[], T]) -> tuple[T, CompileReport]:
    """``fn()`` and the `CompileReport` of the compiles it ran (see the module docstring).

    Exceptions of `fn` propagate; the event listener is removed either way."""
    counter = _Counter()
    jax.monitoring.register_event_listener(counter)
    start = time.perf_counter()
    try:
        result = fn()
    finally:
        seconds = time.perf_counter() - start
        _unregister(counter)
    return result, CompileReport(seconds, _verdict(counter.counts),
                                 counter.counts[WRITE_EVENT])


def _verdict(counts: dict[str, int]) -> str | None:
    requests, hits = counts[REQUEST_EVENT], counts[HIT_EVENT]
    if not requests or jax.config.jax_compilation_cache_dir is None:
        return None
    if hits == requests:
        return "hit"
    return "miss" if hits == 0 else "partial"


def _unregister(listener: Callable[..., None]) -> None:
    unregister = getattr(jax.monitoring, "unregister_event_listener", None)
    if unregister is not None:
        unregister(listener)
    else:  # an older JAX: the listener stays, counting nothing of the caller's thread
        listener.thread = None  # type: ignore[attr-defined]
