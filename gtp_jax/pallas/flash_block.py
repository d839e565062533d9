"""Attention of one (query block, key block) pair, as flash-attention Pallas kernels that
return the log-sum-exp, beside their pure-JAX references: the block kernels of ring
attention (`gtp_jax.parallel.context`).

A ring step merges per-block results with an online softmax, so a block kernel must return
its rows' log-sum-exp, which ``jax.nn.dot_product_attention`` does not. The references
hold a block's ``[b, h, sq, sk]`` float32 scores at once; the kernels stream key tiles
through on-chip memory (flash attention: running max and sum per row), so a block costs
``O((sq + sk) * d)`` memory whatever its length.

Shapes: ``q [b, sq, h, d]``, ``k`` / ``v`` ``[b, sk, h_kv, d]`` with ``h % h_kv == 0``
(grouped-query attention). ``causal=True`` only for a diagonal block (``sq == sk``, q and k
hold the same positions: lower-triangular mask, diagonal included). ``kv_len`` is None or
an int32 scalar (traced or not): only keys ``< kv_len`` of the block are visible (padding
at the end of the sequence). ``out`` is the block's softmax-normalised output (float32),
``lse [b, sq, h]`` float32 the natural log-sum-exp of each row's visible scaled scores;
a row that sees no key gets ``out = 0`` and ``lse = -inf``.

Kernels: ``d`` a power of two (16..256), ``sq`` and ``sk`` multiples of the tiles
(`BlockTiles`), bfloat16 / float16 inputs (float32 inputs would run the tensor cores in
tf32; the reference serves them). ``backend=None`` picks the kernels on a GPU where they
apply, else the reference; `supported` says which shapes apply. In interpret mode (CPU)
the kernel bodies are the same code that runs on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.pallas import _util

#: ``backend`` values (None: the kernels on a GPU where `supported`, else the reference).
ATTENTION_BLOCK_BACKENDS = ("pallas", "reference")
_KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class BlockTiles:
    """Tile sizes (powers of two) of the three kernels.

    ``fwd_q`` x ``fwd_k``: the forward's query rows per program x key rows per loop step;
    ``dkv_k`` x ``dkv_q``: the dK/dV kernel's key rows per program x query rows per step;
    ``dq_q`` x ``dq_k``: the dQ kernel's query rows per program x key rows per step.
    """

    fwd_q: int = 128
    fwd_k: int = 64
    dkv_k: int = 128
    dkv_q: int = 32
    dq_q: int = 128
    dq_k: int = 32
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name not in ("num_warps", "num_stages"):
                _util.check_pow2(getattr(self, f.name), f"BlockTiles.{f.name}")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"BlockTiles.{name}={value!r} must be a positive int.")

    @property
    def q_multiple(self) -> int:
        return max(self.fwd_q, self.dkv_q, self.dq_q)

    @property
    def k_multiple(self) -> int:
        return max(self.fwd_k, self.dkv_k, self.dq_k)


# --------------------------------------------------------------------------- references


def _block_mask(sq: int, sk: int, causal: bool, kv_len: jax.Array | None) -> jax.Array | None:
    mask = None
    if causal:
        mask = jnp.arange(sq)[:, None] >= jnp.arange(sk)[None, :]
    if kv_len is not None:
        visible = jnp.broadcast_to(jnp.arange(sk)[None, :] < kv_len, (sq, sk))
        mask = visible if mask is None else mask & visible
    return mask


def _grouped(q: jax.Array, h_kv: int) -> jax.Array:
    b, s, h, d = q.shape
    return q.reshape(b, s, h_kv, h // h_kv, d)


def _masked_scores(q: jax.Array, k: jax.Array, mask: jax.Array | None, scale: float):
    """Scaled float32 scores ``[b, h_kv, g, sq, sk]`` with masked entries ``-inf``."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", _grouped(q, k.shape[2]), k,
                   preferred_element_type=jnp.float32) * scale
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    return s


def softmax_attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
                   scale: float) -> tuple[jax.Array, jax.Array]:
    """Masked softmax attention with all scores at once (pure JAX).

    ``q [b, sq, h, d]``, ``k``/``v`` ``[b, sk, h_kv, d]``, ``mask`` None or bool
    ``[sq, sk]`` (True: visible). Returns float32 ``out [b, sq, h, d]`` and ``lse [b, sq,
    h]``; a row with no visible key gives ``out = 0`` and ``lse = -inf``.
    """
    b, sq, h, d = q.shape
    s = _masked_scores(q, k, mask, scale)
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
    inv = jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)  # [b,hk,g,q,1]
    o = o * jnp.moveaxis(inv[..., 0], 3, 1)[..., None]
    lse = (m + jnp.log(denom))[..., 0]  # log(0) = -inf for rows that see nothing
    return o.reshape(b, sq, h, d), jnp.moveaxis(lse, 3, 1).reshape(b, sq, h)


def attention_block_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                              kv_len: jax.Array | None,
                              scale: float) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX block attention: float32 ``(out [b, sq, h, d], lse [b, sq, h])``.

    Scores and softmax are float32; ``p @ v`` takes ``p`` in ``v.dtype`` (as the kernels
    do) with float32 accumulation. Shapes and masks: the module docstring.
    """
    return softmax_attend(q, k, v, _block_mask(q.shape[1], k.shape[1], causal, kv_len), scale)


def attention_block_bwd_reference(q, k, v, do, lse, delta, *, causal: bool,
                                  kv_len: jax.Array | None,
                                  scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pure-JAX backward of one block from recomputed scores.

    ``do [b, sq, h, d]`` is the gradient of the *final* output rows (after all blocks were
    merged), ``lse [b, sq, h]`` their *final* float32 log-sum-exp and ``delta = sum(do *
    out, -1)`` ``[b, sq, h]`` float32. Returns this block's float32 contributions ``dq [b,
    sq, h, d]``, ``dk`` and ``dv`` ``[b, sk, h_kv, d]``.
    """
    b, sq, h, d = q.shape
    h_kv = k.shape[2]
    mask = _block_mask(sq, k.shape[1], causal, kv_len)
    s = _masked_scores(q, k, mask, scale)

    def heads_first(x):  # [b, sq, h] -> [b, h_kv, g, sq, 1]
        return jnp.moveaxis(x.reshape(b, sq, h_kv, h // h_kv), 1, 3)[..., None]

    lse = heads_first(lse)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0))  # masked: exp(-inf) = 0
    dog = _grouped(do, h_kv)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do.dtype), dog,
                    preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, v, preferred_element_type=jnp.float32)
    ds = p * (dp - heads_first(delta))
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(k.dtype), k,
                    preferred_element_type=jnp.float32) * scale
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), _grouped(q, h_kv),
                    preferred_element_type=jnp.float32) * scale
    return dq.reshape(b, sq, h, d), dk, dv


# --------------------------------------------------------------------------- kernels


def _dot(a: jax.Array, b: jax.Array, a_dim: int, b_dim: int) -> jax.Array:
    """float32 ``a @ b`` contracting ``a``'s dim `a_dim` with ``b``'s dim `b_dim` (2-D)."""
    return lax.dot_general(a, b, (((a_dim,), (b_dim,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _visible(q0, k0, bq: int, bk: int, causal: bool, kvl) -> jax.Array | None:
    """bool ``[bq, bk]`` mask of a (query tile at row q0, key tile at row k0), or None."""
    mask = None
    if causal:
        mask = (q0 + jnp.arange(bq))[:, None] >= (k0 + jnp.arange(bk))[None, :]
    if kvl is not None:
        keys = (k0 + jnp.arange(bk))[None, :] < kvl[None, :]
        mask = keys if mask is None else mask & keys
    return mask


def _scores(q, k, scale: float, mask) -> jax.Array:
    s = _dot(q, k, 1, 1) * scale
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _fwd_kernel(*refs, scale: float, causal: bool, has_kv_len: bool, bq: int, bk: int):
    if has_kv_len:
        q_ref, k_ref, v_ref, kvl_ref, o_ref, lse_ref = refs
        kvl = kvl_ref[...]  # [bk] copies of kv_len: a vector load, no scalar indexing
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref = refs
        kvl = None
    i = pl.program_id(0)
    q = q_ref[...]
    d = q.shape[-1]

    def body(j, carry):
        acc, m, total = carry
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        s = _scores(q, k, scale, _visible(i * bq, j * bk, bq, bk, causal, kvl))
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # a row that has seen no visible key yet keeps m = -inf: subtract 0 instead so
        # that exp(-inf - 0) = 0 rather than NaN
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_ref[:, None])
        corr = jnp.exp(m - m_ref)
        total = total * corr + jnp.sum(p, axis=1)
        acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v, 1, 0)
        return acc, m_new, total

    n_k = k_ref.shape[0] // bk
    hi = lax.div((i + 1) * bq + bk - 1, bk) if causal else n_k
    init = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, total = lax.fori_loop(0, hi, body, init)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / total[:, None], 0.0)
    lse_ref[...] = jnp.where(seen, m + jnp.log(total), -jnp.inf)


def _dkv_kernel(*refs, scale: float, causal: bool, has_kv_len: bool, bq: int, bk: int):
    if has_kv_len:
        q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, kvl_ref, dk_ref, dv_ref = refs
        kvl = kvl_ref[...]
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref = refs
        kvl = None
    j = pl.program_id(0)
    k = k_ref[...]
    v = v_ref[...]
    d = k.shape[-1]

    def body(i, carry):
        dk, dv = carry
        rows = pl.ds(i * bq, bq)
        q = q_ref[rows, :]
        do = do_ref[rows, :]
        lse = lse_ref[rows]
        s = _scores(q, k, scale, _visible(i * bq, j * bk, bq, bk, causal, kvl))
        p = jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse)[:, None])
        dv = dv + _dot(p.astype(do.dtype), do, 0, 0)
        ds = p * (_dot(do, v, 1, 1) - dl_ref[rows][:, None])
        dk = dk + _dot(ds.astype(q.dtype), q, 0, 0)
        return dk, dv

    n_q = q_ref.shape[0] // bq
    lo = lax.div(j * bk, bq) if causal else 0
    zeros = jnp.zeros((bk, d), jnp.float32)
    dk, dv = lax.fori_loop(lo, n_q, body, (zeros, zeros))
    dk_ref[...] = dk * scale
    dv_ref[...] = dv


def _dq_kernel(*refs, scale: float, causal: bool, has_kv_len: bool, bq: int, bk: int):
    if has_kv_len:
        q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, kvl_ref, dq_ref = refs
        kvl = kvl_ref[...]
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dq_ref = refs
        kvl = None
    i = pl.program_id(0)
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)
    delta = dl_ref[...]

    def body(j, dq):
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        s = _scores(q, k, scale, _visible(i * bq, j * bk, bq, bk, causal, kvl))
        p = jnp.exp(s - lse[:, None])
        ds = p * (_dot(do, v, 1, 1) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k, 1, 0)

    n_k = k_ref.shape[0] // bk
    hi = lax.div((i + 1) * bq + bk - 1, bk) if causal else n_k
    dq = lax.fori_loop(0, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq * scale


def _call(kernel, grid: tuple[int, int, int], ins: list, in_specs: list, out_shape: list,
          out_specs: list, tiles: BlockTiles, interpret: bool, name: str):
    """One launch over ``grid = (tiles, batch, heads)``; `name` names it in GPU traces."""
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
        out_specs=out_specs, interpret=interpret, name=name,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                             num_stages=tiles.num_stages),
    )(*ins)


def _row_spec(rows: int, d: int | None, group: int, tiled: bool):
    """BlockSpec of ``[b, s, heads, d]`` (or ``[b, s, heads]`` with ``d=None``) for grid
    ``(tile, batch, head)``: `rows` rows of one head (the head's kv head when `group` > 1),
    at the program's tile when `tiled`, else from row 0."""
    def index(t, bi, hi):
        head = hi // group if group > 1 else hi
        row = t if tiled else 0
        return (bi, row, head) if d is None else (bi, row, head, 0)
    shape = (None, rows, None) if d is None else (None, rows, None, d)
    return pl.BlockSpec(shape, index)


def _add_kv_len(ins: list, specs: list, kv_len, bk: int) -> None:
    """Appends kv_len (if any) to a launch's inputs as ``int32 [bk]``, one copy per key
    lane, so that the kernel reads it with a vector load."""
    if kv_len is not None:
        ins.append(jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (bk,)))
        specs.append(pl.BlockSpec((bk,), lambda t, bi, hi: (0,)))


def _fwd_pallas(q, k, v, causal, kv_len, scale, tiles: BlockTiles, interpret: bool):
    b, sq, h, d = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    g = h // h_kv
    bq, bk = tiles.fwd_q, tiles.fwd_k
    ins = [q, k, v]
    specs = [_row_spec(bq, d, 1, True), _row_spec(sk, d, g, False), _row_spec(sk, d, g, False)]
    _add_kv_len(ins, specs, kv_len, bk)
    kernel = functools.partial(_fwd_kernel, scale=scale, causal=causal,
                               has_kv_len=kv_len is not None, bq=bq, bk=bk)
    out, lse = _call(kernel, (sq // bq, b, h), ins, specs,
                     [jax.ShapeDtypeStruct((b, sq, h, d), jnp.float32),
                      jax.ShapeDtypeStruct((b, sq, h), jnp.float32)],
                     [_row_spec(bq, d, 1, True), _row_spec(bq, None, 1, True)],
                     tiles, interpret, "attention_block_fwd")
    return out, lse


def _bwd_pallas(q, k, v, do, lse, delta, causal, kv_len, scale, tiles: BlockTiles,
                interpret: bool):
    b, sq, h, d = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    g = h // h_kv
    do = do.astype(q.dtype)
    lse = lse.astype(jnp.float32)
    delta = delta.astype(jnp.float32)
    has_kv_len = kv_len is not None

    # dK, dV: one program per (key tile, batch, query head), looping over query tiles
    bq, bk = tiles.dkv_q, tiles.dkv_k
    ins = [q, k, v, do, lse, delta]
    specs = [_row_spec(sq, d, 1, False), _row_spec(bk, d, g, True), _row_spec(bk, d, g, True),
             _row_spec(sq, d, 1, False), _row_spec(sq, None, 1, False),
             _row_spec(sq, None, 1, False)]
    _add_kv_len(ins, specs, kv_len, bk)
    kernel = functools.partial(_dkv_kernel, scale=scale, causal=causal,
                               has_kv_len=has_kv_len, bq=bq, bk=bk)
    # per query head; a group's heads are summed below (grouped-query attention)
    dk, dv = _call(kernel, (sk // bk, b, h), ins, specs,
                   [jax.ShapeDtypeStruct((b, sk, h, d), jnp.float32)] * 2,
                   [_row_spec(bk, d, 1, True)] * 2, tiles, interpret, "attention_block_dkv")
    if g > 1:
        dk = dk.reshape(b, sk, h_kv, g, d).sum(axis=3)
        dv = dv.reshape(b, sk, h_kv, g, d).sum(axis=3)

    # dQ: one program per (query tile, batch, query head), looping over key tiles
    bq, bk = tiles.dq_q, tiles.dq_k
    ins = [q, k, v, do, lse, delta]
    specs = [_row_spec(bq, d, 1, True), _row_spec(sk, d, g, False), _row_spec(sk, d, g, False),
             _row_spec(bq, d, 1, True), _row_spec(bq, None, 1, True),
             _row_spec(bq, None, 1, True)]
    _add_kv_len(ins, specs, kv_len, bk)
    kernel = functools.partial(_dq_kernel, scale=scale, causal=causal,
                               has_kv_len=has_kv_len, bq=bq, bk=bk)
    (dq,) = _call(kernel, (sq // bq, b, h), ins, specs,
                  [jax.ShapeDtypeStruct((b, sq, h, d), jnp.float32)],
                  [_row_spec(bq, d, 1, True)], tiles, interpret, "attention_block_dq")
    return dq, dk, dv


# --------------------------------------------------------------------------- public API


def supported(q_shape: tuple[int, ...], k_shape: tuple[int, ...], dtype,
              tiles: BlockTiles = BlockTiles()) -> str | None:
    """None if the kernels take these shapes and dtype, else the reason they do not."""
    b, sq, h, d = q_shape
    sk = k_shape[1]
    if jnp.dtype(dtype) not in [jnp.dtype(t) for t in _KERNEL_DTYPES]:
        return f"dtype {jnp.dtype(dtype).name} (the kernels take bfloat16 / float16)"
    if d < 16 or d > 256 or d & (d - 1):
        return f"head_dim {d} (the kernels take a power of two in [16, 256])"
    if sq % tiles.q_multiple or sk % tiles.k_multiple:
        return (f"block lengths sq={sq}, sk={sk} (the kernels take multiples of "
                f"{tiles.q_multiple} and {tiles.k_multiple}: BlockTiles)")
    return None


def check_backend(backend: object, caller: str) -> None:
    """A `UsageError` naming `caller` unless `backend` is in `ATTENTION_BLOCK_BACKENDS` or
    None."""
    _util.check_backend_choice(backend, ATTENTION_BLOCK_BACKENDS, caller)


def check_shapes(q: jax.Array, k: jax.Array, v: jax.Array, caller: str) -> None:
    """A `UsageError` naming `caller` unless ``q [b, sq, h, d]``, ``k, v [b, sk, h_kv, d]``
    with ``h_kv`` dividing ``h`` (the block contract of ring attention)."""
    shapes = {"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape)}
    bad = [n for n, s in shapes.items() if len(s) != 4]
    if bad:
        raise UsageError(f"{caller}: {bad[0]} has shape {shapes[bad[0]]}; q, k and v are "
                         "[batch, length, heads, head_dim] (rank 4).")
    (b, _, h, d), (bk, _, hk, dk) = shapes["q"], shapes["k"]
    if shapes["v"] != shapes["k"] or (bk, dk) != (b, d) or h % hk:
        raise UsageError(
            f"{caller}: q {shapes['q']}, k {shapes['k']}, v {shapes['v']} do not fit: k and v "
            "must have one shape [b, sk, h_kv, d] with q's batch and head_dim, and h_kv must "
            "divide q's heads.")


def _pick(backend, q, k, tiles, caller: str) -> bool:
    """True to run the kernels (after checking an explicit ``backend='pallas'``)."""
    check_backend(backend, caller)
    if not isinstance(tiles, BlockTiles):
        raise UsageTypeError(f"{caller}: tiles must be a BlockTiles, got {type(tiles).__name__}")
    why = supported(tuple(q.shape), tuple(k.shape), q.dtype, tiles)
    if why is None and _util.varying_axes(q):
        # pallas_call's interpreter and output typing do not follow shard_map's varying-
        # axes checks (jax 0.10): the kernels run under check_vma=False, as gtp_jax.shard
        why = "a shard_map with check_vma=True (the kernels need check_vma=False)"
    if backend == "pallas" and why is not None:
        raise UsageError(f"{caller}: backend='pallas' does not take {why}; use backend=None "
                         "or 'reference'.")
    if backend is None:
        return why is None and jax.default_backend() == "gpu"
    return backend == "pallas"


def attention_block(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                    kv_len: jax.Array | None, scale: float, backend: str | None = None,
                    tiles: BlockTiles = BlockTiles(),
                    interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention of one block: float32 ``(out [b, sq, h, d], lse [b, sq, h])``.

    The `block_fn` contract of `gtp_jax.parallel.context.ring_attention` (module docstring
    for shapes and masks). Not differentiable by itself: ring attention's custom VJP calls
    `attention_block_bwd`.

    Args:
      backend: "pallas" (the flash kernel; a `UsageError` where `supported` says no),
        "reference" (`attention_block_reference`), or None: the kernel on a GPU where it
        applies, else the reference.
      tiles: the kernels' tile sizes.
      interpret: run the kernel in the Pallas interpreter (None: unless on a GPU).

    Example (CPU, the interpreter)::

        q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
        out, lse = attention_block(q, q, q, causal=True, kv_len=None, scale=0.125,
                                   backend="pallas")
    """
    check_shapes(q, k, v, "attention_block")
    if _pick(backend, q, k, tiles, "attention_block"):
        return _fwd_pallas(q, k, v, causal, kv_len, float(scale), tiles,
                           _util.resolve_interpret(interpret))
    return attention_block_reference(q, k, v, causal=causal, kv_len=kv_len, scale=scale)


def attention_block_bwd(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array,
                        lse: jax.Array, delta: jax.Array, *, causal: bool,
                        kv_len: jax.Array | None, scale: float, backend: str | None = None,
                        tiles: BlockTiles = BlockTiles(),
                        interpret: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Backward of one block: float32 ``(dq [b, sq, h, d], dk, dv [b, sk, h_kv, d])``.

    ``do`` is the gradient of the final (merged) output rows, ``lse [b, sq, h]`` their
    final log-sum-exp and ``delta = sum(do * out, -1)`` ``[b, sq, h]`` (float32). The
    `block_bwd_fn` contract of `gtp_jax.parallel.context.ring_attention`; `backend`,
    `tiles` and `interpret` as in `attention_block`. The kernels run two launches: dK/dV
    per key tile, dQ per query tile (no atomics).
    """
    check_shapes(q, k, v, "attention_block_bwd")
    if _pick(backend, q, k, tiles, "attention_block_bwd"):
        return _bwd_pallas(q, k, v, do, lse, delta, causal, kv_len, float(scale), tiles,
                           _util.resolve_interpret(interpret))
    return attention_block_bwd_reference(q, k, v, do, lse, delta, causal=causal,
                                         kv_len=kv_len, scale=scale)


__all__ = [
    "ATTENTION_BLOCK_BACKENDS",
    "BlockTiles",
    "attention_block",
    "attention_block_bwd",
    "attention_block_bwd_reference",
    "attention_block_reference",
    "check_backend",
    "check_shapes",
    "softmax_attend",
    "supported",
]
