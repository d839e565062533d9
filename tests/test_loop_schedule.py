"""Every weight gather and gradient reduce-scatter of the layer loop has a layer's matmuls
beside it, by construction.

Read from the training step as gtp_jax builds it (`gtp_jax.bench.schedule.traced_windows`:
the traced program, optimization barriers included, before XLA's passes): the matmuls that
are neither among a collective's inputs' producers nor among its result's consumers are
what any scheduler may run while it is in flight. The loop bounds each window (a gather
waits for the layer before it to start, a gradient's reduce-scatter must end before the
layer after it); this checks that the window still holds a whole layer's matmuls.
Exceptions: the first layer of the forward and of the backward pass, whose gathers have
nothing earlier to hide behind.

On GPUs the compiled program's async pairs show what XLA actually placed inside
(`collective_windows`, read here from the stored optimized HLO of the 2x H200 probe,
`benchmarks/sched_probe.py`). A CPU program's collectives are synchronous and XLA's CPU
pipeline drops optimization barriers early, so its compiled text says nothing of this.
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import gtp_jax
from gtp_jax.bench.schedule import collective_windows, traced_windows
from gtp_jax.models import Transformer, lm_loss, preset

GPU_PROBE = (Path(__file__).resolve().parents[1] / "docs" / "results" / "2026-11-28_2xH200"
             / "variants" / "hlo_plain.txt.gz")
#: Matmuls of one layer of the tiny decoder: qkv, scores, values, out, gate_up, down.
LAYER_GEMMS = 6


def _layer_windows(unroll: bool, prefetch: bool, coalesce: bool,
                   kinds: tuple[str, ...] = ("all-gather", "reduce-scatter")):
    cfg = preset("tiny", n_layers=4, unroll_layers=unroll)
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    sm = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(0)), mesh,
                       gtp_jax.GTPConfig(prefetch=prefetch,
                                         coalesce_layer_collectives=coalesce))
    graphdef, state = nnx.split(sm)

    def grads(state, tokens):
        return nnx.grad(lm_loss)(nnx.merge(graphdef, state), tokens)

    traced = jax.make_jaxpr(grads)(state, jnp.zeros((8, 17), jnp.int32))
    stacked = [p for p in sm.plan if p.stacked]
    gathered = [math.prod(p.spec.padded_shape) for p in stacked]
    shards = [math.prod(p.spec.shard_shape) for p in stacked]
    if coalesce:  # one collective per layer: all of a layer's (float32) weights at once
        gathered, shards = [sum(gathered)], [sum(shards)]
    windows = [w for w in traced_windows(traced) if w.kind in kinds and (
        (w.kind == "all-gather" and w.elements in gathered)
        or (w.kind != "all-gather" and w.elements in shards))]
    return windows, len(gathered)


@pytest.mark.parametrize("unroll,prefetch,coalesce",
                         [(True, False, True), (False, True, True), (True, False, False),
                          (False, True, False)],
                         ids=["unrolled", "scanned-prefetch", "unrolled-per-weight",
                              "scanned-prefetch-per-weight"])
def test_each_layer_collective_has_a_layers_matmuls_beside_it(unroll: bool, prefetch: bool,
                                                              coalesce: bool) -> None:
    windows, weights = _layer_windows(unroll, prefetch, coalesce)
    gathers = [w for w in windows if w.kind == "all-gather"]
    scatters = [w for w in windows if w.kind == "reduce-scatter"]
    assert gathers and scatters, windows
    assert all(w.beside > 0 for w in scatters), [w for w in scatters if not w.beside]
    short = [w for w in gathers if w.beside < LAYER_GEMMS]
    # at most the first layer's gathers of the forward and of the backward pass
    assert len(short) <= 2 * weights, (len(short), [w.beside for w in gathers])


@pytest.mark.parametrize("unroll", [True, False], ids=["unrolled", "scanned-prefetch"])
def test_each_layers_data_parallel_all_reduce_runs_in_the_loop_beside_matmuls(unroll: bool
                                                                             ) -> None:
    # Under dp the stacked weights' gradient shards are summed over dp layer by layer in
    # the backward loop (`gtp_jax.sharding.data_view`), not once over whole stacks after
    # it: one all-reduce of a layer's shard per layer (unrolled), or one in the scanned
    # backward loop's body and one for each of the two layers it peels; each with matmuls
    # beside it but the last one's.
    windows, _ = _layer_windows(unroll, prefetch=not unroll, coalesce=True,
                                kinds=("all-reduce",))
    assert len(windows) == (4 if unroll else 3), windows
    assert sum(w.beside > 0 for w in windows) >= len(windows) - 1, windows
    if not unroll:
        assert any(w.computation.endswith("/scan") for w in windows), windows


def test_the_reader_finds_a_collective_with_nothing_beside_it() -> None:
    """A program whose one GEMM reads the gathered weight and feeds the reduce-scatter: no
    window holds a GEMM (what the test above would fail on)."""
    mesh = jax.make_mesh((8,), ("g",))

    def body(x, w):
        full = jax.lax.all_gather(w, "g", axis=0, tiled=True)
        return jax.lax.psum_scatter(x @ full, "g", scatter_dimension=0, tiled=True)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("g")), out_specs=P("g"),
                              check_vma=False))
    w = jax.device_put(jnp.ones((64, 64)), jax.sharding.NamedSharding(mesh, P("g")))
    text = f.lower(jnp.ones((16, 64)), w).compile().as_text()
    windows = collective_windows(text)
    assert {w.kind for w in windows} == {"all-gather", "reduce-scatter"}
    assert all(w.beside == 0 for w in windows), windows
    traced = traced_windows(jax.make_jaxpr(f)(jnp.ones((16, 64)), w))
    assert len(traced) == 2 and all(t.beside == 0 for t in traced), traced


def test_on_the_gpu_probe_the_scheduled_windows_are_read() -> None:
    """The GPU program of the probe's XLA placement (16 layers: per layer a gather and a
    reduce-scatter, two GEMMs): its asynchronous pairs and the GEMMs scheduled inside them,
    as measured on 2x H200 (15 of 16 pairs with a GEMM inside)."""
    windows = collective_windows(gzip.decompress(GPU_PROBE.read_bytes()).decode())
    pairs = [w for w in windows if w.between is not None]
    assert len(pairs) == 16
    assert sum(w.between > 0 for w in pairs) == 15
