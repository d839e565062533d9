"""Pallas kernels (interpret mode on CPU) == the reference, bit for bit; the coalesced
amax path under shard_map (one all-reduce for N tensors); quantized gathers."""

from __future__ import annotations

import json
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import get_mesh
from jax.sharding import PartitionSpec as P
from test_pallas_formats import (
    assert_bits_equal,
    assert_same_float,
    rng_for,
    special_blocks,
    weights,
)

import gtp_jax.pallas as gp
from gtp_jax.pallas import formats, oracle
from gtp_jax.pallas.amax import multi_amax_pallas
from gtp_jax.pallas.cast_fp8 import cast_fp8_pallas
from gtp_jax.pallas.cast_mxfp8 import quantize_mxfp8_pallas
from gtp_jax.pallas.cast_nvfp4 import cast_nvfp4_pallas

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def np_block_rows(x, dim: int, block: int) -> np.ndarray:
    """numpy twin of `tensor.to_block_rows` (blocks along `dim`, zero padded)."""
    xm = np.moveaxis(np.asarray(x), dim, -1)
    pad = -xm.shape[-1] % block
    xm = np.pad(xm, [(0, 0)] * (xm.ndim - 1) + [(0, pad)])
    return xm.reshape(-1, block)


def block_rows(rng, block: int, dtype) -> jax.Array:
    """Block rows from tensors of awkward shapes (non-multiples of the block, tiny,
    another dim) plus every special block; a row count that no tile divides."""
    parts = [
        np_block_rows(weights(rng, (7, 45), dtype), 1, block),
        np_block_rows(weights(rng, (1,), dtype), 0, block),
        np_block_rows(weights(rng, (3, 2 * block + 1, 4), dtype), 1, block),
        np_block_rows(weights(rng, (5, 3 * block), dtype, spread=30), 1, block),
        special_blocks(block, dtype).astype(jnp.dtype(dtype)),
    ]
    return jnp.asarray(np.concatenate(parts))


# --------------------------------------------------------------------------- amax


def test_multi_amax_kernel_matches_oracle(request):
    rng = rng_for(request.node.nodeid)
    special = special_blocks(32, jnp.float32)
    xs = [
        weights(rng, (37, 29)),
        weights(rng, (1,), jnp.bfloat16),
        weights(rng, (3, 5, 7), jnp.float16),
        jnp.zeros((0, 4)),
        jnp.asarray(special[1]),  # denormals only: exact on bit patterns
        jnp.asarray(special[4]),  # +inf
        jnp.asarray(special[6]),  # NaN
        jnp.asarray(np.concatenate([special[4], special[6]])),  # inf and NaN -> NaN
        jnp.zeros((130,), jnp.bfloat16),
        weights(rng, (300,), jnp.bfloat16, spread=20),
        jnp.asarray([0.5, -np.nextafter(np.float32(3), np.float32(4))]),  # odd last bit
    ]
    expected = [oracle.amax(x) for x in xs]
    # Small tiles: several programs per tensor, ragged tails, 11 branches in one launch.
    got = multi_amax_pallas(xs, interpret=True, tile=64, steps=1)
    chex.assert_shape(got, (len(xs),))
    chex.assert_type(got, jnp.float32)
    assert_same_float(got, expected, "multi_amax kernel (tile 64)")
    got = multi_amax_pallas(xs, interpret=True, tile=16, steps=5, unroll=2)  # looped loads
    assert_same_float(got, expected, "multi_amax kernel (tile 16, 5 loads per program)")
    assert_same_float(gp.multi_amax(xs, interpret=True), expected, "multi_amax (default tile)")
    assert_same_float(gp.multi_amax(xs, backend="reference"), expected, "reference")


def test_multi_amax_is_one_launch():
    xs = [jnp.ones((40, 3)), jnp.ones((7,), jnp.bfloat16), jnp.ones((5, 5, 5))]
    jaxpr = jax.make_jaxpr(lambda *t: gp.multi_amax(list(t), interpret=True))(*xs)
    assert str(jaxpr).count("pallas_call[") == 1


# --------------------------------------------------------------------------- casts


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_kernel_matches_reference(request, dtype):
    rng = rng_for(request.node.nodeid)
    x = jnp.asarray(np.concatenate([
        np.asarray(weights(rng, (61, 33), dtype)).reshape(-1),
        special_blocks(16, dtype).astype(jnp.dtype(dtype)).reshape(-1)]))
    finite = np.isfinite(np.asarray(x, np.float32))
    amax = oracle.amax(np.asarray(x, np.float32)[finite])
    kernel = jax.jit(lambda v, s: cast_fp8_pallas(v, s, interpret=True, tile=256))
    reference = jax.jit(formats.fp8_cast_reference)
    # current, delayed (saturating), tiny (scale at float32 max) and NaN scales
    for amax_used in (amax, amax / 64, np.float32(1e-38), np.float32(np.nan)):
        scale = formats.fp8_scale(amax_used)
        assert_bits_equal(kernel(x, scale), reference(x, scale), f"fp8 scale={scale}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_kernel_matches_reference(request, dtype):
    rows = block_rows(rng_for(request.node.nodeid), 32, dtype)
    assert rows.shape[0] % 8
    payload, scales = jax.jit(lambda v: quantize_mxfp8_pallas(v, interpret=True,
                                                              rows_per_program=8))(rows)
    exp_payload, exp_scales = jax.jit(formats.mxfp8_cast_reference)(rows)
    chex.assert_shape([payload, scales], [(rows.shape[0], 32), (rows.shape[0],)])
    chex.assert_type([payload, scales], [jnp.float8_e4m3fn, jnp.uint8])
    assert_bits_equal(scales, exp_scales, "e8m0 scales")
    assert_bits_equal(payload, exp_payload, "mxfp8 payload")
    assert set(np.asarray(scales)) >= {0, 255}  # the special blocks were exercised


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_kernel_matches_reference(request, dtype):
    rows = block_rows(rng_for(request.node.nodeid), 16, dtype)
    r32 = np.asarray(rows, np.float32)
    amax = oracle.amax(r32[np.isfinite(r32)])
    reference = jax.jit(formats.nvfp4_cast_reference)
    # bf16 rows are read as uint32 pairs by default; check the generic path as well.
    for pairs in (True, False) if dtype == jnp.bfloat16 else (True,):
        kernel = jax.jit(lambda v, g, p=pairs: cast_nvfp4_pallas(
            v, g, interpret=True, rows_per_program=8, bf16_pairs=p))
        for amax_used in (amax, amax / 64, np.float32(1e-30), np.float32(0),
                          np.float32(np.inf)):
            g = formats.nvfp4_global_scale(amax_used)
            payload, scales = kernel(rows, g)
            exp_payload, exp_scales = reference(rows, g)
            assert_bits_equal(scales, exp_scales, f"e4m3 block scales, g={g}")
            assert_bits_equal(payload, exp_payload, f"packed e2m1, g={g}, pairs={pairs}")
    chex.assert_shape([payload, scales], [(rows.shape[0], 8), (rows.shape[0],)])
    chex.assert_type([payload, scales], [jnp.uint8, jnp.float8_e4m3fn])


@pytest.mark.parametrize("fmt", gp.FORMATS)
def test_quantize_pallas_equals_reference(request, fmt):
    """The public API end to end (amax kernel, layout, cast kernel, padding, dim != -1)."""
    rng = rng_for(request.node.nodeid)
    cases = [(weights(rng, (3, 37, 5), jnp.bfloat16), 1), (jnp.asarray([-2.5]), -1)]
    for x, dim in cases:
        qp = gp.quantize(x, fmt, dim=dim, interpret=True)
        qr = gp.quantize(x, fmt, dim=dim, backend="reference")
        assert jax.tree.structure(qp) == jax.tree.structure(qr)
        for a, b in zip(jax.tree.leaves(qp), jax.tree.leaves(qr)):
            assert_bits_equal(a, b, f"{fmt} {x.shape} leaf")
        out = gp.dequantize(qp, jnp.float32)
        chex.assert_shape(out, x.shape)
        assert_bits_equal(out, gp.dequantize(qr, jnp.float32), "dequantized")


# --------------------------------------------------------------------------- NaN policy


def test_eager_nan_raises_naming_the_tensor_jit_propagates():
    good = jnp.ones((4, 32), jnp.float32)
    bad = good.at[2, 7].set(jnp.nan)
    with pytest.raises(ValueError, match=r"tensors\[1\] has a non-finite amax \(nan\)"):
        gp.quantize_coalesced([good, bad, good], "nvfp4", None, interpret=True)
    with pytest.raises(ValueError, match="x has a non-finite amax"):
        gp.quantize(bad, "fp8", interpret=True)
    qs = jax.jit(lambda a, b: gp.quantize_coalesced([a, b], "fp8", None, interpret=True))(
        good, bad)
    assert np.isfinite(float(qs[0].global_scale)) and np.isnan(float(qs[1].global_scale))
    assert np.all(np.isnan(np.asarray(gp.dequantize(qs[1], jnp.float32))))
    np.testing.assert_array_equal(gp.dequantize(qs[0], jnp.float32), good)


# --------------------------------------------------------------------------- coalesced


def count_ops(hlo_text: str, op: str) -> int:
    return len(re.findall(rf"\b{op}(?:-start)?\(", hlo_text))


@pytest.mark.parametrize("fmt, mesh_name, fused", [("fp8", "gtp8", True),
                                                   ("mxfp8", "gtp8", False),
                                                   ("nvfp4", "dp2_gtp4", True)])
def test_coalesced_gather_equals_full_quantize(request, fmt, mesh_name, fused):
    """N tensors quantized per shard with ONE all-reduce, gathered in low precision
    (payload + scales in one all-gather when fused), equal the full tensors quantized
    with the same global scales, bit for bit."""
    mesh = get_mesh(mesh_name)
    n = mesh.shape["gtp"]
    rng = rng_for(request.node.nodeid)
    full = [weights(rng, (3 * n, 40)), weights(rng, (2 * n, 5, 33), jnp.bfloat16)]

    def step(*shards):
        qs = gp.quantize_coalesced(list(shards), fmt, "gtp", interpret=True)
        gathered = [gp.gather_quantized(q, "gtp", dim=0, fused=fused) for q in qs]
        return gathered, [gp.dequantize(q, jnp.float32) for q in gathered]

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("gtp"),) * len(full),
                               out_specs=P(), check_vma=False))
    lowered = fn.lower(*full)
    expected_reduces = 0 if fmt == "mxfp8" else 1
    assert lowered.as_text().count("all_reduce") == expected_reduces, "lowered StableHLO"
    compiled = lowered.compile().as_text()
    assert count_ops(compiled, "all-reduce") == expected_reduces, "compiled HLO"
    gathers_per_tensor = 1 if fused or fmt == "fp8" else 2
    assert count_ops(compiled, "all-gather") == gathers_per_tensor * len(full)
    gathered, values = fn(*full)
    for i, x in enumerate(full):
        amax = None if fmt == "mxfp8" else oracle.amax(x)
        expected = gp.quantize(x, fmt, amax=amax, backend="reference")
        assert gathered[i].shape == x.shape
        for a, b in zip(jax.tree.leaves(gathered[i]), jax.tree.leaves(expected)):
            assert_bits_equal(a, b, f"tensor {i} gathered leaf")
        assert_bits_equal(values[i], gp.dequantize(expected, jnp.float32), f"tensor {i}")


def test_gather_along_block_dim_needs_whole_blocks():
    q = gp.quantize(jnp.ones((20,)), "nvfp4", backend="reference")
    with pytest.raises(ValueError, match=r"not a multiple of the block size 16"):
        gp.gather_quantized(q, "gtp", dim=0)
    with pytest.raises(ValueError, match=r"dim=2"):
        gp.gather_quantized(q, "gtp", dim=2)


def test_bench_quant_smoke(tmp_path):
    """``python -m gtp_jax.bench quant`` runs end to end on CPU (interpret, tiny sizes)."""
    from gtp_jax.bench import quant

    out = tmp_path / "quant.json"
    assert quant.main(["--small", "--iters", "1", "--experts", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert not report["errors"]
    names = [r["name"] for r in report["rows"]]
    assert any("amax" in n and "Pallas" in n for n in names)
    # amax; fp8 / nvfp4: kernel, cast_only, quantize; mxfp8: kernel, quantize
    assert sum("Pallas" in n and "copy" not in n for n in names) == 9
    ratios = {g["format"]: g["reduction_vs_bf16"] for g in report["gather_bytes"]}
    assert ratios["fp8"] > 1.99 and ratios["nvfp4"] > 3.0
    assert [g["format"].split()[0] for g in report["gather_time"]] == [
        "bf16", "fp8", "mxfp8", "mxfp8", "nvfp4", "nvfp4"]
