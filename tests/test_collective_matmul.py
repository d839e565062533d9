"""Ring collective matmuls == plain all-gather/reduce-scatter GEMMs == the single-device GEMM.

Tolerance: float32, `FP32_RTOL` relative to max|reference|. The sharded GEMMs add the same
products as the reference but split the contraction (row-parallel: per-rank partial sums,
then the reduce-scatter / ring) or the weight-gradient batch sum (per-chunk partial sums),
so results differ only in summation order: a few float32 ulps.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import pytest
from helpers import assert_close
from jax.sharding import PartitionSpec as P

import gtp_jax
from gtp_jax.parallel import (
    all_gather_matmul,
    all_gather_matmul_chunks,
    column_parallel,
    matmul_reduce_scatter,
    matmul_reduce_scatter_chunks,
    row_parallel,
)

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

FP32_RTOL = 1e-5


def _mlp_ref(x, w1, w2):
    """Column-parallel then row-parallel GEMM pair, unsharded: ``[B, S, d] -> [B, S, o]``."""
    h = jnp.tanh(jnp.einsum("bsd,dhf->bshf", x, w1))
    return jnp.einsum("bshf,hfo->bso", h, w2)


@functools.cache
def _sharded_mlp(tp: int, overlap: bool | str):
    """`_mlp_ref` under (dp=8/tp, tp): x sequence-sharded, w1/w2 split on their head dim.

    ``overlap="chunks"``: the ring-ordered pair (`all_gather_matmul_chunks` ->
    elementwise per chunk -> `matmul_reduce_scatter_chunks`).
    """
    mesh = gtp_jax.make_mesh(dp=8 // tp, tp=tp)

    def body(x, w1, w2):
        if overlap == "chunks":
            hs = [jnp.tanh(c) for c in all_gather_matmul_chunks(x, w1, "tp")]
            return matmul_reduce_scatter_chunks(hs, w2, "tp", n_contract=2)
        h = jnp.tanh(column_parallel(x, w1, "tp", overlap=overlap))
        return row_parallel(h, w2, "tp", overlap=overlap, n_contract=2)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("dp", "tp"), P(None, "tp"), P("tp")),
                       out_specs=P("dp", "tp"), check_vma=False)

    def loss(x, w1, w2, ct):
        y = fn(x, w1, w2)
        return jnp.sum(y * ct), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _inputs(key, tp: int):
    k = jax.random.split(key, 4)
    # seq 4 * tp, 2 * tp heads of width 3: the contraction is split over tp ranks.
    x = jax.random.normal(k[0], (8 // tp * 2, 4 * tp, 5))
    w1 = jax.random.normal(k[1], (5, 2 * tp, 3))
    w2 = jax.random.normal(k[2], (2 * tp, 3, 7))
    ct = jax.random.normal(k[3], (x.shape[0], x.shape[1], 7))
    return x, w1, w2, ct


@pytest.mark.parametrize("tp", [2, 4])
def test_column_row_parallel_match_reference_and_each_other(tp, key) -> None:
    x, w1, w2, ct = _inputs(key, tp)

    def ref_loss(x, w1, w2):
        y = _mlp_ref(x, w1, w2)
        return jnp.sum(y * ct), y

    (_, y_ref), g_ref = jax.value_and_grad(ref_loss, argnums=(0, 1, 2), has_aux=True)(x, w1, w2)
    results = {}
    for overlap in (False, True, "chunks"):
        (_, y), grads = _sharded_mlp(tp, overlap)(x, w1, w2, ct)
        chex.assert_trees_all_equal_shapes((y, grads), (y_ref, g_ref))
        assert_close(y, y_ref, FP32_RTOL, f"overlap={overlap} output")
        for name, g, r in zip(("x", "w1", "w2"), grads, g_ref):
            assert_close(g, r, FP32_RTOL, f"overlap={overlap} grad {name}")
        results[overlap] = (y, grads)
    # Ring and plain collectives: same products, only the order of the partial sums differs.
    for mode in (True, "chunks"):
        for a, b in zip(jax.tree.leaves(results[mode]), jax.tree.leaves(results[False])):
            assert_close(a, b, FP32_RTOL, f"overlap={mode} vs plain")


def _lowered(tp: int, overlap: bool) -> str:
    x, w1, w2, ct = _inputs(jax.random.key(0), tp)
    return _sharded_mlp(tp, overlap).lower(x, w1, w2, ct).as_text()


@pytest.mark.parametrize("tp", [2, 4])
def test_ring_uses_ppermutes_not_gathers(tp) -> None:
    """Forward + backward of one column + one row GEMM, as lowered StableHLO.

    Ring: the forward all-gather-matmul and matmul-reduce-scatter take tp - 1 hops each, and
    the row GEMM's backward gathers dy around the ring (tp - 1 hops). The column GEMM's
    backward is the bulk-overlapped pair in both modes: one all-gather of x (re-gathered,
    not saved gathered) and one reduce-scatter of dx. Plain: one collective each.
    """
    ring = _lowered(tp, True)
    assert ring.count("stablehlo.collective_permute") == 3 * (tp - 1)
    # One barrier per hop keeps the chunk GEMMs apart: on GPUs XLA otherwise merges them into
    # one GEMM that waits for the last hop (seen in the optimized HLO on H200; XLA:CPU does
    # not merge them, so only their presence can be checked here).
    assert ring.count("stablehlo.optimization_barrier") == 3 * (tp - 1)
    assert ring.count("stablehlo.all_gather") == 1
    assert ring.count("stablehlo.reduce_scatter") == 1
    # The ring-ordered pair: forward 2 rings, backward 2 for the column GEMM (dx ring, x
    # re-gather) and 1 for the row GEMM (dy), and no slicing or rank reordering at all.
    chunks = _lowered(tp, "chunks")
    assert chunks.count("stablehlo.collective_permute") == 5 * (tp - 1)
    assert chunks.count("stablehlo.optimization_barrier") == 5 * (tp - 1)
    assert "stablehlo.all_gather" not in chunks and "stablehlo.reduce_scatter" not in chunks
    assert "stablehlo.dynamic_slice" not in chunks
    assert "stablehlo.dynamic_update_slice" not in chunks
    plain = _lowered(tp, False)
    assert "stablehlo.collective_permute" not in plain
    # fwd: AG(x); bwd: AG(x) again for dw (not saved gathered) and AG(dy) of the row GEMM.
    assert plain.count("stablehlo.all_gather") == 3
    # fwd: RS(out); bwd: RS(dx) of the column GEMM.
    assert plain.count("stablehlo.reduce_scatter") == 2


def test_collective_matmul_argument_errors() -> None:
    mesh = gtp_jax.make_mesh(dp=2, tp=4)

    def run(fn, x, w):
        return jax.shard_map(lambda a, b: fn(a, b, "tp"), mesh=mesh, in_specs=(P(), P()),
                             out_specs=P(), check_vma=False)(x, w)

    with pytest.raises(ValueError, match="not divisible by the 4 ranks"):
        run(matmul_reduce_scatter, jnp.zeros((2, 6, 3)), jnp.zeros((3, 5)))
    with pytest.raises(ValueError, match="contracted dims"):
        run(all_gather_matmul, jnp.zeros((2, 4, 3)), jnp.zeros((4, 5)))
    with pytest.raises(ValueError, match="hs must be a list of 4 ring-ordered chunks"):
        run(lambda h, w, ax: matmul_reduce_scatter_chunks([h, h], w, ax),
            jnp.zeros((2, 4, 3)), jnp.zeros((3, 5)))
