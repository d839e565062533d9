"""Where a compile's time goes: the host-side events of a ``jax.profiler`` trace, summed.

`traced_compile(fn, directory)` runs ``fn`` (a step's ``compile()``) under
``jax.profiler.trace`` and returns its result with the `top_events` of that trace: XLA's own
annotations of its compile (on a GPU: the HLO pass pipelines, autotuning, LLVM and PTX
compilation; on a CPU: code generation) and JAX's Python frames (tracing, lowering), each
with its total seconds and count. Nested events each count their whole span, so the
figures overlap: read them as "how long was spent inside X", not as a partition.
"""

from __future__ import annotations

import collections
import glob
import os
from collections.abc import Callable
from typing import Any, TypeVar

import jax

T = TypeVar("T")


def top_events(trace_directory: str, count: int = 80) -> list[dict[str, Any]]:
    """The `count` event names of the newest ``*.xplane.pb`` under `trace_directory` with
    the most total time, longest first: ``{"name", "seconds", "count"}`` each. Device
    planes count too (a compile runs none); [] when no trace was written."""
    paths = sorted(glob.glob(os.path.join(trace_directory, "**", "*.xplane.pb"),
                             recursive=True), key=os.path.getmtime)
    if not paths:
        return []
    data = jax.profiler.ProfileData.from_file(paths[-1])
    seconds: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                seconds[event.name] += event.duration_ns / 1e9
                counts[event.name] += 1
    return [{"name": name, "seconds": round(total, 4), "count": counts[name]}
            for name, total in seconds.most_common(count)]


def traced_compile(fn: Callable[[], T], trace_directory: str,
                   count: int = 80) -> tuple[T, list[dict[str, Any]]]:
    """``fn()`` run under ``jax.profiler.trace(trace_directory)``, and the `top_events` of
    that trace (tracing adds a little to the compile's own time)."""
    with jax.profiler.trace(trace_directory):
        result = fn()
    return result, top_events(trace_directory, count)
