"""The pure-JAX reference formats against the numpy oracle (`gtp_jax.pallas.oracle`) and
ml_dtypes, round-trip error bounds derived from the formats, the NaN policy, the
QuantizedTensor pytree and argument validation. No Pallas kernels run here (see
test_pallas_kernels.py for kernel == reference)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import test_key

import gtp_jax.pallas as gp
from gtp_jax.pallas import formats, oracle
from gtp_jax.pallas.cast_nvfp4 import e2m1_magnitude_bits
from gtp_jax.pallas.tensor import to_block_rows

E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn
# Half a unit in the last place of e4m3, relative (3 mantissa bits) and, below the
# smallest normal 2**-6, absolute (subnormal spacing 2**-9).
E4M3_HALF_ULP_REL = 2.0 ** -(formats.E4M3_MANTISSA_BITS + 1)
E4M3_HALF_SUBNORMAL = 2.0 ** (formats.E4M3_MIN_NORMAL_EXP - formats.E4M3_MANTISSA_BITS - 1)
# Slack for the float32 RN steps around the format's own rounding (each <= 2**-24 rel).
F32_SLACK = 2.0**-20


# --------------------------------------------------------------------------- inputs


def rng_for(nodeid: str, salt: int = 0) -> np.random.Generator:
    """A numpy generator seeded from the test's fresh PRNG key (inputs are built in numpy:
    no per-shape XLA compiles just to make test data)."""
    return np.random.default_rng(np.asarray(jax.random.key_data(test_key(nodeid, salt))))


def weights(rng: np.random.Generator, shape: tuple[int, ...], dtype=jnp.float32,
            spread: float = 8.0) -> jax.Array:
    """Normal values with a per-row magnitude 2**U(-spread, spread): blocks of very
    different scales in one tensor. Rounded to `dtype` on the host (RN, like XLA)."""
    rows = shape[:-1] + (1,)
    if np.dtype(dtype) == np.float16:
        spread = min(spread, 10.0)  # stay finite in float16
    mag = np.exp2(rng.uniform(-spread, spread, rows))
    x = (rng.standard_normal(shape) * mag).astype(np.float32)
    return jnp.asarray(x.astype(jnp.dtype(dtype)))


def special_blocks(block: int, dtype) -> np.ndarray:
    """[k, block] float32 rows of edge cases (zeros, -0, subnormals, near-overflow,
    +-inf, NaN, e4m3 ties, saturating values), representable in `dtype`."""
    big = 6.0e4 if np.dtype(dtype) == np.float16 else 3.0e38
    tiny = 3.0e-7 if np.dtype(dtype) == np.float16 else 2.0e-39  # subnormal in dtype
    base = np.linspace(-1.0, 1.0, block, dtype=np.float32)
    cases = [
        np.zeros(block),
        np.where(np.arange(block) % 2, -0.0, -tiny),
        base * tiny,
        base * big,
        np.where(np.arange(block) == 3, np.inf, base),
        np.where(np.arange(block) == 5, -np.inf, base),
        np.where(np.arange(block) == 1, np.nan, base),
        # amax 256 -> MX exponent 0: e4m3 ties 17 -> 16, 19 -> 20, 500 saturates.
        np.resize(np.array([256.0, 17.0, 19.0, -17.0, 500.0, -500.0, 0.5, 1.0]), block),
        np.resize(np.array([1.0, 1.75, 1.99, -1.9]), block),  # amax mantissa >= 1.75
    ]
    with np.errstate(over="ignore"):
        return np.stack(cases).astype(np.float32).astype(jnp.dtype(dtype)).astype(np.float32)


def bytes_of(a) -> np.ndarray:
    return np.ascontiguousarray(np.atleast_1d(np.asarray(a))).view(np.uint8).ravel()


def assert_bits_equal(actual, expected, what: str = "") -> None:
    a, e = bytes_of(actual), bytes_of(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    bad = np.flatnonzero(a != e)
    assert bad.size == 0, (f"{what}: {bad.size} of {a.size} bytes differ, first at {bad[0]}: "
                           f"{a[bad[0]]:#04x} != {e[bad[0]]:#04x}")


def assert_same_float(actual, expected, what: str = "") -> None:
    """Equal values, NaN == NaN (NaN payload bits may differ between algorithms)."""
    np.testing.assert_array_equal(np.asarray(actual, np.float32),
                                  np.asarray(expected, np.float32), err_msg=what)


# --------------------------------------------------------------------------- helpers


def finite_normal(block: int, dtype) -> np.ndarray:
    """Indices of special_blocks rows with only finite, non-denormal values (XLA:CPU
    flushes denormals, numpy does not)."""
    rows = special_blocks(block, dtype)
    tiny = np.finfo(np.float32).tiny
    ok = [i for i, r in enumerate(rows)
          if np.all(np.isfinite(r)) and not np.any((r != 0) & (np.abs(r) < tiny))]
    return rows[ok]


# --------------------------------------------------------------------------- reference == oracle


def test_amax_reference_matches_oracle(request):
    rng = rng_for(request.node.nodeid)
    xs = [weights(rng, (33, 17)), jnp.asarray(special_blocks(16, jnp.float32)[1]),
          jnp.asarray(special_blocks(16, jnp.float32)[6]), jnp.zeros((0, 3)),
          weights(rng, (5,), jnp.bfloat16)]
    got = gp.multi_amax(xs, backend="reference")
    chex.assert_shape(got, (len(xs),))
    chex.assert_type(got, jnp.float32)
    assert_same_float(got, [oracle.amax(x) for x in xs], "amax (denormals exact, NaN wins)")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_reference_matches_oracle(request, dtype):
    x = weights(rng_for(request.node.nodeid), (37, 29), dtype)
    amax = oracle.amax(x)
    for given in (amax, amax / 4):  # current scaling, and delayed with saturation
        q = gp.quantize(x, "fp8", amax=given, backend="reference")
        scale = np.float32(448) / np.float32(given)
        assert_bits_equal(q.global_scale, np.float32(scale), "fp8 scale")
        assert_bits_equal(q.payload, oracle.fp8_cast(np.asarray(x, np.float32), scale),
                          "fp8 payload")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_mxfp8_reference_matches_oracle(request, dtype):
    rows = np.concatenate([np.asarray(weights(rng_for(request.node.nodeid), (40, 32), dtype),
                                      np.float32),
                           finite_normal(32, dtype)])
    payload, scales = jax.jit(formats.mxfp8_cast_reference)(jnp.asarray(rows).astype(dtype))
    exp_payload, exp_scales = oracle.mxfp8_cast(rows)
    assert_bits_equal(scales, exp_scales, "e8m0 scales")
    assert_bits_equal(payload, exp_payload, "mxfp8 payload")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nvfp4_reference_matches_oracle(request, dtype):
    rows = np.concatenate([np.asarray(weights(rng_for(request.node.nodeid), (60, 16), dtype),
                                      np.float32),
                           finite_normal(16, dtype)])
    g = np.float32(formats.NVFP4_GLOBAL_MAX) / oracle.amax(rows)
    payload, scales = jax.jit(formats.nvfp4_cast_reference)(jnp.asarray(rows).astype(dtype), g)
    exp_payload, exp_scales = oracle.nvfp4_cast(rows, g)
    assert_bits_equal(scales, exp_scales, "e4m3 block scales")
    assert_bits_equal(payload, exp_payload, "packed e2m1")


def test_e2m1_rounding_matches_ml_dtypes(request):
    """The kernels' integer e2m1 rounding == the reference's midpoint comparisons ==
    ml_dtypes (RN ties to even) on every tie point (+-2 ulps) and random values of [0, 6]."""
    rng = rng_for(request.node.nodeid)
    points = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6],
                      np.float32)
    near = [np.nextafter(np.nextafter(points, np.float32(7)), np.float32(7)),
            np.nextafter(points, np.float32(7)), points,
            np.nextafter(points, np.float32(-1)),
            np.nextafter(np.nextafter(points, np.float32(-1)), np.float32(-1))]
    rand = rng.uniform(0.0, 6.0, 100_000).astype(np.float32)
    q = np.clip(np.concatenate(near + [rand]), 0, 6).astype(np.float32)
    expected = np.searchsorted(np.array(formats.E2M1_VALUES), q.astype(E2M1).astype(np.float64))
    got_bits = np.asarray(jax.jit(e2m1_magnitude_bits)(jnp.asarray(q)))
    got_xla = np.asarray(jax.jit(formats.e2m1_magnitude_reference)(jnp.asarray(q)))
    np.testing.assert_array_equal(got_bits, expected, "bit rounding vs ml_dtypes")
    np.testing.assert_array_equal(got_xla, expected, "midpoint reference vs ml_dtypes")
    np.testing.assert_array_equal(_xla_e2m1_cast_bits(q), expected,
                                  "XLA float4_e2m1fn vs ml_dtypes")


def _xla_e2m1_cast_bits(q: np.ndarray) -> np.ndarray:
    """XLA's own float32 -> float4_e2m1fn cast of `q` (its magnitude bits), compiled with the
    CPU backend's default emitters in a fresh process: the suite's faster loop emitters
    (tests/conftest.py) round float4 ties differently and cannot bitcast float4 to uint4."""
    code = ("import sys, numpy as np, jax, jax.numpy as jnp\n"
            "q = np.load(sys.argv[1])\n"
            "f = jax.jit(lambda v: jax.lax.bitcast_convert_type(v.astype(jnp.float4_e2m1fn),"
            " jnp.uint4).astype(jnp.int32))\n"
            "np.save(sys.argv[1], np.asarray(f(jnp.asarray(q))))\n")
    flags = re.sub(r"--xla_cpu_use_fusion_emitters=\S+", "", os.environ.get("XLA_FLAGS", ""))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "q.npy")
        np.save(path, q)
        subprocess.run([sys.executable, "-c", code, path], check=True,
                       env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"))
        return np.load(path)


def test_e4m3_bit_decoding_matches_ml_dtypes():
    bits = np.arange(256, dtype=np.uint8)
    got = np.asarray(jax.jit(formats.e4m3_bits_to_f32)(jnp.asarray(bits)))
    expected = bits.view(E4M3).astype(np.float32)
    assert_bits_equal(got[~np.isnan(expected)], expected[~np.isnan(expected)], "e4m3 decode")
    assert np.all(np.isnan(got[np.isnan(expected)]))


def test_nvfp4_packing_even_element_low_nibble():
    # One block: values chosen so that q = x * g / bs hits exact e2m1 values.
    x = jnp.asarray([[6.0, -0.5, 1.0, 3.0] + [0.0] * 12], jnp.float32)
    q = gp.quantize(x, "nvfp4", amax=6.0, backend="reference")
    # g = 448, bs = e4m3(6 * 448 / 6) = 448 -> q = |x|: codes 7, 8|1, 2, 5.
    assert float(q.global_scale) == 448.0
    assert float(q.block_scales.astype(jnp.float32)[0, 0]) == 448.0
    assert_bits_equal(q.payload[0, :2], np.array([0x97, 0x52], np.uint8), "nibble order")


# --------------------------------------------------------------------------- round trip


def e2m1_half_spacing(q: np.ndarray) -> np.ndarray:
    """Half the gap between neighbouring e2m1 values around q (0.5 / 1 / 2 spacing)."""
    return np.where(q < 2, 0.25, np.where(q < 4, 0.5, 1.0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_round_trip_bound(request, dtype):
    x = weights(rng_for(request.node.nodeid), (64, 48), dtype, spread=4)
    q = gp.quantize(x, "fp8", backend="reference")
    xr = np.asarray(gp.dequantize(q, jnp.float32, backend="reference"), np.float64)
    xs = np.asarray(x, np.float64)
    s = float(q.global_scale)
    # |v| <= 448 for |x| <= amax: e4m3 RN error is half an ulp (relative) or half the
    # subnormal spacing (absolute), in units of v = x * s; plus the float32 RN steps.
    bound = np.maximum(E4M3_HALF_ULP_REL * np.abs(xs), E4M3_HALF_SUBNORMAL / s)
    bound += F32_SLACK * np.abs(xs)
    err = np.abs(xr - xs)
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3f}"
    assert np.max(err / np.maximum(np.abs(xs), 1e-30)) > E4M3_HALF_ULP_REL / 4  # not vacuous


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mxfp8_round_trip_bound(request, dtype):
    x = weights(rng_for(request.node.nodeid), (24, 96), dtype)
    q = gp.quantize(x, "mxfp8", backend="reference")
    xr = np.asarray(gp.dequantize(q, jnp.float32, backend="reference"), np.float64)
    blocks = np.asarray(x, np.float64).reshape(-1, 32)
    bmax = np.max(np.abs(blocks), axis=1, keepdims=True)
    e = np.maximum(np.floor(np.log2(np.where(bmax > 0, bmax, 1))) - formats.E4M3_EMAX, -127)
    v = np.abs(blocks) / np.exp2(e)  # exact
    # RN half ulp / half subnormal spacing, or the saturation |v| - 448 (OCP's rule
    # admits block maxima up to 512 * 2**E).
    bound_v = np.maximum(np.maximum(E4M3_HALF_ULP_REL * v, E4M3_HALF_SUBNORMAL),
                         v - formats.E4M3_MAX)
    err = np.abs(xr.reshape(-1, 32) - blocks)
    assert np.all(err <= bound_v * np.exp2(e)), "mxfp8 round trip out of bound"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nvfp4_round_trip_bound(request, dtype):
    x = weights(rng_for(request.node.nodeid), (24, 80), dtype, spread=6)
    q = gp.quantize(x, "nvfp4", backend="reference")
    xr = np.asarray(gp.dequantize(q, jnp.float32, backend="reference"), np.float64)
    blocks = np.asarray(x, np.float64).reshape(-1, 16)
    g = float(q.global_scale)
    bs = np.asarray(q.block_scales.astype(jnp.float32), np.float64).reshape(-1, 1)
    err = np.abs(xr.reshape(-1, 16) - blocks)
    zero = bs[:, 0] == 0
    # A zero block scale: block_amax * g / 6 rounded below e4m3's half subnormal step.
    assert np.all(xr.reshape(-1, 16)[zero] == 0)
    assert np.all(np.abs(blocks[zero]) <= 6 * E4M3_HALF_SUBNORMAL / g * (1 + F32_SLACK))
    qv = np.abs(blocks[~zero]) * g / bs[~zero]  # exact e2m1-domain value
    bound_q = (e2m1_half_spacing(qv * (1 + F32_SLACK)) + np.maximum(qv - formats.E2M1_MAX, 0)
               + F32_SLACK * qv)
    assert np.all(err[~zero] <= bound_q * bs[~zero] / g + F32_SLACK * np.abs(blocks[~zero]))
    # And the block scale really is e4m3(block_amax * g / 6) (two-level scaling).
    bmax = np.max(np.abs(blocks), axis=1)
    exp_bs = np.minimum(bmax * (g / 6), 448).astype(np.float32).astype(E4M3).astype(np.float64)
    np.testing.assert_allclose(bs[:, 0], exp_bs, rtol=2.0**-3)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_padding_never_leaks(request, fmt):
    """A block dim of 21 is zero padded: the stored leaves equal those of the explicitly
    zero-padded tensor, and dequantize returns exactly the logical part of its decode."""
    x = np.asarray(weights(rng_for(request.node.nodeid), (3, 21, 5)))
    q = gp.quantize(jnp.asarray(x), fmt, dim=1, backend="reference")
    kp = -(-21 // q.block) * q.block
    xp = np.pad(x, [(0, 0), (0, kp - 21), (0, 0)])
    qp = gp.quantize(jnp.asarray(xp), fmt, dim=1, backend="reference")
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(qp)):
        assert_bits_equal(a, b, "leaf")
    out = gp.dequantize(q, jnp.float32)
    chex.assert_shape(out, x.shape)
    assert_bits_equal(out, np.asarray(gp.dequantize(qp, jnp.float32))[:, :21], "values")


# --------------------------------------------------------------------------- NaN / Inf


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_nonfinite_amax_gives_nan_scale_never_finite(fmt):
    for bad in (np.nan, np.inf):
        x = jnp.asarray([[1.0, bad] + [0.5] * 30], jnp.float32)
        q = jax.jit(lambda v, f=fmt: gp.quantize(v, f, backend="reference"))(x)
        assert np.isnan(float(q.global_scale)), f"{fmt} scale for amax={bad} is finite"
        assert np.all(np.isnan(np.asarray(gp.dequantize(q, jnp.float32))))
        with pytest.raises(ValueError, match=r"x has a non-finite amax.*Under jax.jit"):
            gp.quantize(x, fmt, backend="reference")


def test_nonfinite_block_is_nan_only_in_its_block():
    x = np.ones((2, 64), np.float32)
    x[0, 40] = np.inf  # second MX block of row 0; fourth NVFP4 block of row 0
    x[1, 3] = np.nan
    for fmt in ("mxfp8", "nvfp4"):
        amax = None if fmt == "mxfp8" else 1.0  # delayed scaling: per-tensor scale finite
        q = jax.jit(lambda v, f=fmt, a=amax: gp.quantize(v, f, amax=a,
                                                         backend="reference"))(x)
        out = np.asarray(gp.dequantize(q, jnp.float32))
        b = q.block
        nan_expected = np.zeros_like(x, bool)
        nan_expected[0, (40 // b) * b:(40 // b + 1) * b] = True
        nan_expected[1, :b] = True
        np.testing.assert_array_equal(np.isnan(out), nan_expected, err_msg=fmt)
        np.testing.assert_array_equal(out[~nan_expected], 1.0, err_msg=fmt)
    with pytest.raises(ValueError, match="non-finite"):
        gp.quantize(jnp.asarray(x), "mxfp8", backend="reference")


def test_fp8_delayed_nan_element_stays_nan():
    x = jnp.asarray([1.0, np.nan, -np.inf, 900.0, -2.0], jnp.float32)
    q = gp.quantize(x, "fp8", amax=2.0, backend="reference")  # finite scale: no error
    out = np.asarray(gp.dequantize(q, jnp.float32))
    np.testing.assert_array_equal(np.isnan(out), [False, True, True, False, False])
    assert out[3] == 2.0  # saturated at 448 / s


# --------------------------------------------------------------------------- pytree / API


def test_quantized_tensor_is_a_pytree(request):
    x = weights(rng_for(request.node.nodeid), (6, 40), jnp.bfloat16)
    q = gp.quantize(x, "nvfp4", backend="reference")
    leaves, treedef = jax.tree.flatten(q)
    assert len(leaves) == 3
    chex.assert_shape(q.payload, (6, 24))
    chex.assert_type(q.payload, jnp.uint8)
    chex.assert_shape(q.block_scales, (6, 3))
    chex.assert_type(q.block_scales, jnp.float8_e4m3fn)
    chex.assert_shape(q.global_scale, ())
    assert (q.shape, q.format, q.dim) == ((6, 40), "nvfp4", 1)
    q2 = jax.jit(lambda t: t)(q)
    assert jax.tree.structure(q2) == treedef
    assert q.nbytes == 6 * 24 + 6 * 3 + 4
    mx = gp.quantize(x, "mxfp8", backend="reference")
    assert mx.global_scale is None and len(jax.tree.leaves(mx)) == 2
    chex.assert_type(mx.block_scales, jnp.uint8)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda x: gp.quantize(x, "fp16"), ValueError, r"format='fp16' is unknown"),
        (lambda x: gp.quantize(x, "fp8", backend="cuda"), ValueError, r"backend='cuda'"),
        (lambda x: gp.quantize(x.astype(jnp.int32), "fp8"), TypeError, r"x has dtype int32"),
        (lambda x: gp.quantize(x.astype(jnp.float8_e5m2), "fp8"), TypeError, "float8_e5m2"),
        (lambda x: gp.quantize(x, "mxfp8", dim=2), ValueError, r"dim=2 is out of range"),
        (lambda x: gp.quantize(x, "mxfp8", amax=1.0), ValueError, r"amax must be None"),
        (lambda x: gp.quantize(x, "fp8", amax=jnp.ones(2)), ValueError, "must be a scalar"),
        (lambda x: gp.quantize(x[0, 0], "fp8"), ValueError, "is a scalar"),
        (lambda x: gp.quantize(x[:0], "fp8"), ValueError, "no elements"),
        (lambda x: gp.quantize(x, "fp8", interpret="yes"), TypeError, "interpret='yes'"),
        (lambda x: gp.cast_only(x, "nvfp4"), ValueError, r"amax is required"),
        (lambda x: gp.multi_amax([]), ValueError, "tensors is empty"),
        (lambda x: gp.multi_amax(x), TypeError, r"pass \[x\]"),
        (lambda x: gp.multi_amax([x, x.astype(jnp.int8)]), TypeError, r"tensors\[1\]"),
        (lambda x: gp.dequantize(x), TypeError, "QuantizedTensor"),
        (lambda x: gp.dequantize(gp.quantize(x, "fp8", backend="reference"), jnp.int8),
         TypeError, "floating dtype"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, exc, match):
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(exc, match=match):
        call(x)


def test_block_rows_layout():
    x = jnp.arange(2 * 3 * 5, dtype=jnp.float32).reshape(2, 3, 5)
    rows = to_block_rows(x, 1, 4)  # blocks along dim 1 (padded 3 -> 4)
    chex.assert_shape(rows, (10, 4))
    np.testing.assert_array_equal(rows[0], [0, 5, 10, 0])
    np.testing.assert_array_equal(rows[1], [1, 6, 11, 0])
