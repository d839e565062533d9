"""`gtp_jax.bench.compile_events`: a compile traced with jax.profiler, its events summed."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gtp_jax.bench.compile_events import top_events, traced_compile


def test_a_traced_compile_returns_its_program_and_the_compiles_events(tmp_path) -> None:
    def f(x):
        return jnp.tanh(x @ x.T).sum()

    x = jnp.ones((8, 4))
    compiled, events = traced_compile(lambda: jax.jit(f).lower(x).compile(), str(tmp_path))
    assert float(compiled(x)) == float(f(x))
    names = [e["name"] for e in events]
    # JAX's compile (or its read from the persistent compilation cache) is among them
    assert any("compile" in name for name in names), names[:20]
    seconds = [e["seconds"] for e in events]
    assert seconds == sorted(seconds, reverse=True) and all(e["count"] >= 1 for e in events)


def test_no_trace_gives_no_events(tmp_path) -> None:
    assert top_events(str(tmp_path)) == []
