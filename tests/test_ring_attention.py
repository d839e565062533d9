"""Context parallelism (`gtp_jax.parallel.context`): ring attention over a ``cp`` mesh axis.

Every result is compared with plain causal attention over the whole (unsharded) sequence,
``jax.nn.dot_product_attention(is_causal=True)``, forward and gradients w.r.t. q, k, v.

Tolerances (max |error| / max |reference|):

* float32: ``FP32_TOL = 2e-5``. The ring computes the same float32 sums as the reference,
  only grouped per block and merged by log-sum-exp (different summation order, one extra
  exp/log rescale per block); observed errors are ~3e-7, i.e. a few float32 ulps (2^-24 ~
  6e-8) times the number of merged terms, so 2e-5 leaves ample room and still catches any
  masking/position bug (those give O(1) errors).
* bfloat16 inputs: the reference is computed in float32 from the same bf16 values; ours
  rounds the probabilities and dS to bf16 before the p@v / dS@k / dS^T@q matmuls (as fused
  kernels do) and the outputs/gradients to bf16 (unit roundoff 2^-9 ~ 2e-3, ~10 terms
  summed). ``BF16_TOL = 1.5e-2``; the test also checks we are within 3x of the error of
  ``jax.nn.dot_product_attention`` run in bf16 on the same inputs (plus 1e-2 slack), so
  the ring is no worse than the library's own bf16 attention.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_rel_err
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.parallel import context as cpmod
from gtp_jax.parallel.context import (
    allgather_attention,
    attention_block,
    padded_seq_len,
    position_ids,
    ring_attention,
    zigzag_merge,
    zigzag_split,
)

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

FP32_TOL = 2e-5
BF16_TOL = 1.5e-2
B, H, D = 2, 2, 8


def cp_mesh(n: int, dp: int = 1) -> Mesh:
    devs = np.array(jax.devices()[: n * dp])
    if dp == 1:
        return Mesh(devs, ("cp",))
    return Mesh(devs.reshape(dp, n), ("dp", "cp"))


def inputs(key, seq, dtype=jnp.float32, h=H, h_kv=H, d=D):
    kq, kk, kv, kc = jax.random.split(key, 4)
    q = jax.random.normal(kq, (B, seq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, seq, h_kv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, seq, h_kv, d), jnp.float32).astype(dtype)
    ct = jax.random.normal(kc, (B, seq, h, d), jnp.float32)
    return q, k, v, ct


def reference(q, k, v, valid_len=None):
    lens = None if valid_len is None else jnp.full((q.shape[0],), valid_len, jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lens)


def sharded(fn, mesh, layout, **kw):
    """Natural-order global ``(q, k, v) -> out`` running `fn` under shard_map over cp."""
    n = mesh.shape["cp"]
    split = (lambda x: zigzag_split(x, n)) if layout == "zigzag" else (lambda x: x)
    merge = (lambda x: zigzag_merge(x, n)) if layout == "zigzag" else (lambda x: x)
    batch = "dp" if "dp" in mesh.axis_names else None
    spec = P(batch, "cp")
    f = jax.shard_map(lambda q, k, v: fn(q, k, v, axis="cp", layout=layout, **kw),
                      mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    return lambda q, k, v: merge(f(split(q), split(k), split(v)))


def out_and_grads(f, q, k, v, ct, rows=None):
    """f's output and d(sum(out * ct))/d(q, k, v), jitted; `rows` restricts the loss."""
    def loss(q, k, v):
        out = f(q, k, v)
        w = ct if rows is None else ct[:, :rows]
        return jnp.sum(out[:, : w.shape[1]].astype(jnp.float32) * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def assert_matches(got, want, tol, what, rows=None):
    out, grads = got
    rout, rgrads = want
    if rows is not None:
        out, rout = out[:, :rows], rout[:, :rows]
    assert max_rel_err(out, rout) <= tol, f"{what} out: {max_rel_err(out, rout):.2e}"
    for name, g, r in zip("qkv", grads, rgrads):
        err = max_rel_err(g, r)
        assert err <= tol, f"{what} d{name}: {err:.2e} > {tol:.1e}"


# --------------------------------------------------------------------------- layout helpers


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_zigzag_split_merge_roundtrip(n):
    s = 2 * n * 3
    x = jnp.arange(2 * s * 3).reshape(2, s, 3)
    z = zigzag_split(x, n, axis=1)
    np.testing.assert_array_equal(zigzag_merge(z, n, axis=1), x)
    # slice i of n holds natural chunks i and 2n-1-i (chunk = 3 tokens)
    c, el = 3, s // n
    for i in range(n):
        want = np.concatenate([np.arange(i * c, (i + 1) * c),
                               np.arange((2 * n - 1 - i) * c, (2 * n - i) * c)])
        np.testing.assert_array_equal(z[0, i * el:(i + 1) * el, 0], x[0, want, 0])
    np.testing.assert_array_equal(zigzag_merge(zigzag_split(x, n, axis=-2), n, axis=-2), x)


def test_padded_seq_len():
    assert padded_seq_len(27, 4) == 32
    assert padded_seq_len(32, 4) == 32
    assert padded_seq_len(27, 4, "contiguous") == 28
    assert padded_seq_len(1, 8) == 16


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [2, 8])
def test_position_ids(n, layout):
    el = 6
    mesh = cp_mesh(n)
    f = jax.shard_map(lambda: position_ids(el, "cp", layout), mesh=mesh, in_specs=(),
                      out_specs=P("cp"))
    got = np.asarray(jax.jit(f)())
    natural = np.arange(n * el)
    want = np.asarray(zigzag_split(natural, n, axis=0)) if layout == "zigzag" else natural
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_schedule_covers_causal_mask_exactly_and_balances_zigzag(n, layout):
    """For every device i and block owner j, the tasks run (own / lower / higher) compute
    exactly the visible (query, key) pairs -- no hidden block is computed, none visible is
    missed, none twice -- and under zigzag every device computes the same number of
    scores."""
    el = 4
    own, lower, higher = cpmod._schedule(layout, el)
    work = []
    for i in range(n):
        qpos = np.asarray(cpmod._positions(i, n, el, layout))
        done = 0
        for j in range(n):
            kpos = np.asarray(cpmod._positions(j, n, el, layout))
            tasks = own if j == i else lower if j < i else higher
            seen = np.zeros((el, el), int)
            for t in tasks:
                blk = np.ones((t.r1 - t.r0, t.c1 - t.c0), int)
                if t.causal:
                    assert t.r1 - t.r0 == t.c1 - t.c0
                    blk = np.tril(blk)
                seen[t.r0:t.r1, t.c0:t.c1] += blk
                done += (t.r1 - t.r0) * (t.c1 - t.c0)
            visible = (qpos[:, None] >= kpos[None, :]).astype(int)
            np.testing.assert_array_equal(seen, visible, err_msg=f"i={i} j={j}")
        work.append(done)
    if layout == "zigzag":
        assert len(set(work)) == 1, work


# --------------------------------------------------------------------------- ring vs reference


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_matches_full_attention(n, layout, dtype, key):
    seq = 32 if n < 8 else 48
    q, k, v, ct = inputs(key, seq, jnp.dtype(dtype))
    got = out_and_grads(sharded(ring_attention, cp_mesh(n), layout), q, k, v, ct)
    assert got[0].dtype == q.dtype and all(g.dtype == q.dtype for g in got[1])
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = out_and_grads(reference, *f32, ct)
    if dtype == "float32":
        assert_matches(got, want, FP32_TOL, f"ring n={n} {layout}")
        return
    lib = out_and_grads(reference, q, k, v, ct)  # the library's own bf16 attention
    errs = [max_rel_err(a, b) for a, b in zip((got[0], *got[1]), (want[0], *want[1]))]
    lib_errs = [max_rel_err(a, b) for a, b in zip((lib[0], *lib[1]), (want[0], *want[1]))]
    for name, e, le in zip(("out", "dq", "dk", "dv"), errs, lib_errs):
        assert e <= BF16_TOL, f"bf16 {name}: {e:.2e}"
        assert e <= 2 * le + 5e-3, f"bf16 {name}: {e:.2e} vs dot_product_attention {le:.2e}"


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_gqa(layout, key):
    n = 4
    q, k, v, ct = inputs(key, 16, h=4, h_kv=2)
    got = out_and_grads(sharded(ring_attention, cp_mesh(n), layout), q, k, v, ct)
    assert_matches(got, out_and_grads(reference, q, k, v, ct), FP32_TOL, f"gqa {layout}")


@pytest.mark.parametrize("fn", [ring_attention, allgather_attention])
@pytest.mark.parametrize(("n", "layout", "seq"), [
    (4, "zigzag", 27), (4, "contiguous", 27), (8, "zigzag", 37), (2, "zigzag", 1)])
def test_padding_valid_len(fn, n, layout, seq, key):
    """Sequences that do not divide 2*cp: pad at the end, pass valid_len; the real rows
    (and gradients from a loss over the real rows only) match unpadded attention."""
    padded = padded_seq_len(seq, n, layout)
    assert padded > seq
    q, k, v, ct = inputs(key, seq)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, padded - seq), (0, 0), (0, 0)),
                            constant_values=7.0)  # garbage in the padding must not leak
    f = sharded(fn, cp_mesh(n), layout, valid_len=seq)
    out, grads = out_and_grads(f, pad(q), pad(k), pad(v), ct, rows=seq)
    assert bool(jnp.all(jnp.isfinite(out))), "padded rows must stay finite"
    for g in grads:
        assert bool(jnp.all(g[:, seq:] == 0)), "padding gets no gradient from real rows"
    got = (out, tuple(g[:, :seq] for g in grads))
    assert_matches(got, out_and_grads(reference, q, k, v, ct), FP32_TOL,
                   f"{fn.__name__} padded", rows=seq)


def test_zigzag_equals_contiguous(key):
    n = 4
    q, k, v, ct = inputs(key, 24)
    z = out_and_grads(sharded(ring_attention, cp_mesh(n), "zigzag"), q, k, v, ct)
    c = out_and_grads(sharded(ring_attention, cp_mesh(n), "contiguous"), q, k, v, ct)
    assert_matches(z, c, FP32_TOL, "zigzag vs contiguous")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [2, 8])
def test_allgather_matches_full_attention(n, layout, key):
    q, k, v, ct = inputs(key, 32)
    got = out_and_grads(sharded(allgather_attention, cp_mesh(n), layout), q, k, v, ct)
    assert_matches(got, out_and_grads(reference, q, k, v, ct), FP32_TOL, f"allgather {layout}")


def test_ring_with_batch_over_dp(key):
    """Composes with a data axis: batch over dp, sequence over cp (2 x 4 devices)."""
    q, k, v, ct = inputs(key, 16)
    got = out_and_grads(sharded(ring_attention, cp_mesh(4, dp=2), "zigzag"), q, k, v, ct)
    assert_matches(got, out_and_grads(reference, q, k, v, ct), FP32_TOL, "dp x cp")


def test_block_fn_injection(key):
    """A different block kernel -- here jax.nn.dot_product_attention with its log-sum-exp
    residual, a stand-in for a fused GPU kernel -- plugs in through block_fn."""
    calls = []

    def dpa_block(q, k, v, *, causal, kv_len, scale):
        calls.append(causal)
        out, lse = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                                return_residual=True)
        return out, lse.astype(jnp.float32)

    q, k, v, ct = inputs(key, 16)
    f = sharded(ring_attention, cp_mesh(4), "zigzag", block_fn=dpa_block)
    assert_matches(out_and_grads(f, q, k, v, ct), out_and_grads(reference, q, k, v, ct),
                   FP32_TOL, "dpa block_fn")
    assert set(calls) == {True, False}, calls  # causal (diagonal) and full blocks both ran


def test_attention_block_empty_rows():
    """A row that sees no key: out 0 and lse -inf (finite out), as the contract says."""
    q = jnp.ones((1, 3, 2, 4))
    k = v = jnp.ones((1, 5, 1, 4))
    out, lse = attention_block(q, k, v, causal=False, kv_len=jnp.int32(0), scale=0.5)
    assert bool(jnp.all(out == 0)) and bool(jnp.all(jnp.isneginf(lse)))
    assert out.shape == (1, 3, 2, 4) and lse.shape == (1, 3, 2) and lse.dtype == jnp.float32


# --------------------------------------------------------------------------- program checks


def _shapes(hlo: str) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in m.split(",") if x)
            for m in re.findall(r"\b(?:f32|bf16|f16|s32|pred)\[([0-9,]*)\]", hlo)]


def test_ring_program_uses_collective_permute_and_no_full_scores(key):
    n, seq = 4, 48
    el = seq // n
    q, k, v, ct = inputs(key, seq)
    mesh = cp_mesh(n)
    spec = P(None, "cp")

    def program(fn):
        f = jax.shard_map(lambda q, k, v: fn(q, k, v, axis="cp", layout="zigzag"),
                          mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        return jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) * ct), (0, 1, 2))

    ring = program(ring_attention)
    jaxpr = str(jax.make_jaxpr(ring)(q, k, v))
    assert "ppermute" in jaxpr and "all_gather" not in jaxpr
    hlo = jax.jit(ring).lower(q, k, v).compile().as_text()
    assert "collective-permute" in hlo
    assert "all-gather" not in hlo
    shapes = _shapes(hlo)
    assert shapes, "no shapes parsed from HLO"
    # no [.., S, S] scores, and nothing as large as a local-rows x S slab either
    assert not [s for s in shapes if s.count(seq) >= 2], "full S x S array in ring program"
    assert not [s for s in shapes if len(s) >= 2 and s[-2:] in ((el, seq), (seq, el))]
    # positive controls: the same parser does see such arrays where they exist
    ag = jax.jit(program(allgather_attention)).lower(q, k, v).compile().as_text()
    assert "all-gather" in ag and any(s[-2:] == (el, seq) for s in _shapes(ag) if len(s) >= 2)
    full = jax.jit(lambda q, k, v: reference(q, k, v)).lower(q, k, v).compile().as_text()
    assert any(s.count(seq) >= 2 for s in _shapes(full))


@pytest.mark.parametrize("n", [2, 4])
def test_backward_hops_carry_gradients_behind_kv(n):
    """bf16 inputs: K/V hops are bf16, dK/dV hops float32, and each hop is ONE ppermute
    (K and V, or dK and dV, flattened into one buffer: XLA's GPU scheduler keeps one
    collective in flight, so two per hop left one of them synchronous). Forward n-1 K/V
    hops; backward n-1 K/V hops (the first without any gradient) and n-1 dK/dV hops (n-2 to
    the next visitor, the last one home) -- one gradient hop fewer than a ring whose
    accumulators travel with every K/V block and then go home."""
    mesh = cp_mesh(n)
    q = jnp.ones((1, 4 * n, 2, 8), jnp.bfloat16)
    f = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis="cp"), mesh=mesh,
                      in_specs=(P(None, "cp"),) * 3, out_specs=P(None, "cp"))
    grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), (0, 1, 2))
    hops = re.findall(r"(\w+)\[([\d,]*)\]\S* = ppermute", str(jax.make_jaxpr(grad)(q, q, q)))
    block = 1 * 4 * 2 * 8  # one device's K (or V): [1, 4, 2, 8]
    assert hops.count(("bf16", str(2 * block))) == 2 * (n - 1), hops  # K+V, fwd + bwd
    assert hops.count(("f32", str(2 * block))) == n - 1, hops  # dK+dV
    assert len(hops) == 3 * (n - 1), hops
    first_backward = (n - 1) + 1  # the forward's hops, then the backward's first
    assert [t for t, _ in hops[:first_backward]] == ["bf16"] * first_backward, hops


# --------------------------------------------------------------------------- errors


def _call(fn, q, k, v, n=2, **kw):
    spec = P(None, "cp")
    axis = kw.pop("axis", "cp")
    f = jax.shard_map(lambda q, k, v: fn(q, k, v, axis=axis, **kw),
                      mesh=cp_mesh(n), in_specs=(spec,) * 3, out_specs=spec)
    return jax.eval_shape(f, q, k, v)


@pytest.mark.parametrize("fn", [ring_attention, allgather_attention])
def test_usage_errors(fn):
    q = jnp.zeros((2, 8, 2, 8))
    kv = jnp.zeros((2, 8, 2, 8))
    with pytest.raises(UsageError, match="must be \\[batch"):
        _call(fn, q[0], kv[0], kv[0])
    with pytest.raises(UsageError, match="head_dim mismatch"):
        _call(fn, q, kv[..., :4], kv[..., :4])
    with pytest.raises(UsageError, match="kv_heads"):
        _call(fn, jnp.zeros((2, 8, 3, 8)), kv, kv)
    with pytest.raises(UsageError, match="differ in shape"):
        _call(fn, q, kv, kv[:, :, :1])
    with pytest.raises(UsageError, match="layout"):
        _call(fn, q, kv, kv, layout="striped")
    with pytest.raises(UsageError, match="not bound"):
        _call(fn, q, kv, kv, axis="sp")
    with pytest.raises(UsageError, match="even local length"):
        _call(fn, jnp.zeros((2, 6, 2, 8)), jnp.zeros((2, 6, 2, 8)), jnp.zeros((2, 6, 2, 8)),
              n=2, layout="zigzag")  # local length 3
    with pytest.raises(UsageError, match="valid_len"):
        _call(fn, q, kv, kv, valid_len=17)
    with pytest.raises(UsageTypeError, match="valid_len"):
        _call(fn, q, kv, kv, valid_len=3.5)
    with pytest.raises(UsageTypeError, match="float"):
        _call(fn, q.astype(jnp.int32), kv, kv)
    # outside shard_map: the axis is not bound
    with pytest.raises(UsageError, match="not bound"):
        fn(q, kv, kv, axis="cp")


def test_usage_errors_misc():
    q = jnp.zeros((2, 8, 2, 8))
    with pytest.raises(UsageError, match="backend='triton'"):
        _call(ring_attention, q, q, q, backend="triton")
    # explicit kernels on shapes they do not take: refused with the reason, not run
    with pytest.raises(UsageError, match="float32"):
        _call(ring_attention, q, q, q, backend="pallas")
    with pytest.raises(UsageTypeError, match="block_fn"):
        _call(ring_attention, q, q, q, block_fn=3)
    with pytest.raises(UsageError, match="multiple of 2\\*n"):
        zigzag_split(jnp.zeros((2, 10)), 4)
    with pytest.raises(UsageError, match="positive int"):
        zigzag_merge(jnp.zeros((2, 8)), 0)
    with pytest.raises(UsageError, match="layout"):
        padded_seq_len(10, 2, "ring")
    with pytest.raises(UsageError, match="not bound"):
        position_ids(4, "cp")
    with pytest.raises(UsageTypeError, match="axis"):
        _call(ring_attention, q, q, q, axis=0)
