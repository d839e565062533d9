"""Context parallelism: causal self-attention over a sequence split across a mesh axis.

Every function here except `zigzag_split` / `zigzag_merge` / `padded_seq_len` runs
**inside** ``jax.shard_map`` with `axis` (conventionally ``"cp"``) a manual mesh axis; the
local ``q`` / ``k`` / ``v`` are this device's piece of the sequence. Shapes (dim 1 is the
local sequence, ``s_local = S / n`` with ``n = axis_size(axis)``):

* ``q``: ``[batch, s_local, heads, head_dim]``;
* ``k``, ``v``: ``[batch, s_local, kv_heads, head_dim]`` with ``heads % kv_heads == 0``
  (grouped-query attention; ``kv_heads == heads`` is plain multi-head attention);
* output: like ``q``, in ``q.dtype``.

Any float dtype works; scores, the softmax statistics and all accumulators are float32.

Layouts (which global tokens a device holds; positions from `position_ids`):

* ``"zigzag"`` (default): the global sequence is cut into ``2n`` chunks of ``c = S / 2n``
  tokens and device ``i`` holds chunks ``i`` and ``2n-1-i`` (in that order). Under the causal
  mask every device then has the same amount of work: the load-balanced layout of ring
  attention (Brandon et al. "Striped attention" / zhuzilin's ring-flash-attention / Megatron
  CP). `zigzag_split` puts a natural-order global array into this order so that an ordinary
  ``P(None, "cp")`` sharding gives each device its two chunks; `zigzag_merge` undoes it.
* ``"contiguous"``: device ``i`` holds chunk ``i`` of ``n`` -- device ``n-1`` does ``n``
  times the work of device 0; kept as a cross-check and for non-causal uses.

Two implementations with the same contract:

* `ring_attention`: K/V blocks travel around the ring with ``jax.lax.ppermute`` (``n-1``
  steps, each overlappable with the block in hand) while each device merges per-block
  results with an online softmax (running log-sum-exp in float32). Forward and backward are
  one ``jax.custom_vjp`` (`_fwd` / `_bwd`); the backward recomputes each block's scores from
  the saved ``q, k, v, out, lse``; K/V travel ahead as in the forward, and each visiting
  block's float32 dK/dV accumulator follows one step behind (``n-1`` hops, the last one
  home), so every hop has a block's computation to overlap. No array of all ``S x S``
  scores (nor of ``s_local x S``) ever exists; blocks that the causal mask hides entirely
  are skipped (``lax.cond``), diagonal blocks are masked.
* `allgather_attention`: the baseline -- ``all_gather`` K/V over `axis`, then one masked
  local attention of ``s_local x S`` scores; ordinary autodiff (the ``all_gather``
  transposes to a reduce-scatter of dK/dV).

Padding: when ``S`` is not a multiple of ``2n`` (zigzag) or ``n`` (contiguous) the caller
pads the sequence **at the end** to `padded_seq_len` and passes ``valid_len`` (the global
number of real tokens): keys at positions ``>= valid_len`` are masked. Padded query rows
still produce outputs (finite: they attend to all real keys -- or are 0 when ``valid_len``
is 0) that mean nothing; the caller drops them (and masks them out of the loss, which also
makes their gradient contribution zero).

Block kernel (`block_fn`, the injection point for a fused GPU kernel): ``block_fn(q, k, v,
*, causal, kv_len, scale) -> (out, lse)`` with ``q`` ``[b, sq, h, d]``, ``k``/``v``
``[b, sk, h_kv, d]``; ``causal=True`` only for diagonal blocks, where ``sq == sk`` and q and
k hold the same global positions (standard lower-triangular mask, diagonal included);
``kv_len`` is ``None`` or an int32 scalar array: only keys ``< kv_len`` of the block are
visible (padding; the visible keys of a local block are always a prefix). It must return
``out`` ``[b, sq, h, d]`` (the block's softmax-normalised output, any float dtype; it is
upcast to float32) and ``lse`` ``[b, sq, h]`` float32, the natural log-sum-exp of the
row's visible scaled scores -- ``-inf`` with ``out == 0`` (finite) for a row that sees no
key. The default is `gtp_jax.pallas.attention_block` (flash-attention Pallas kernels on a
GPU where the block shapes tile, the pure-JAX reference elsewhere; ``backend=`` picks);
the backward uses `attention_block_bwd` (``block_bwd_fn`` to replace it), which must return
float32 ``(dq, dk, dv)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.pallas.flash_block import (
    attention_block,
    attention_block_bwd,
    check_backend,
    softmax_attend,
)

#: Conventional name of the context-parallel mesh axis.
CP_AXIS = "cp"
LAYOUTS = ("zigzag", "contiguous")

BlockFn = Callable[..., tuple[jax.Array, jax.Array]]
BlockBwdFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


# --------------------------------------------------------------------------- layout helpers


def _check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise UsageError(f"layout={layout!r}: expected one of {LAYOUTS}")
    return layout


def _chunks_per_device(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def padded_seq_len(seq_len: int, n: int, layout: str = "zigzag") -> int:
    """The smallest length ``>= seq_len`` that `layout` can split over `n` devices
    (a multiple of ``2n`` for zigzag, of ``n`` for contiguous). Pad at the end to it and
    pass ``valid_len=seq_len``."""
    m = n * _chunks_per_device(_check_layout(layout))
    return -(-int(seq_len) // m) * m


def _zigzag_order(n: int) -> np.ndarray:
    """Chunk order of the zigzag layout: ``[0, 2n-1, 1, 2n-2, ...]``."""
    return np.array([c for i in range(n) for c in (i, 2 * n - 1 - i)])


def _permute_chunks(x: jax.Array, n: int, axis: int, order: np.ndarray, what: str) -> jax.Array:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise UsageError(f"{what}: n={n!r} must be a positive int (the cp axis size)")
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
        raise UsageError(f"{what}: axis={axis} out of range for an array of rank {x.ndim}")
    axis %= x.ndim
    size = x.shape[axis]
    if size % (2 * n):
        raise UsageError(
            f"{what}: length {size} on axis {axis} is not a multiple of 2*n = {2 * n}; pad the "
            f"sequence at the end to padded_seq_len({size}, {n}) and pass valid_len={size}")
    c = size // (2 * n)
    shape = x.shape
    x = x.reshape(shape[:axis] + (2 * n, c) + shape[axis + 1:])
    return jnp.take(x, jnp.asarray(order), axis=axis).reshape(shape)


def zigzag_split(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """Natural sequence order -> zigzag layout order along `axis` (any rank, any dtype).

    ``x.shape[axis] = S`` must be a multiple of ``2n``. Afterwards slice ``i`` of ``n``
    equal contiguous slices (what ``P(..., "cp")`` gives device ``i``) holds natural chunks
    ``i`` and ``2n-1-i`` of ``S/2n`` tokens. Works on global arrays (outside ``shard_map``).
    """
    return _permute_chunks(x, n, axis, _zigzag_order(n), "zigzag_split")


def zigzag_merge(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """Inverse of `zigzag_split`: zigzag layout order -> natural order along `axis`."""
    return _permute_chunks(x, n, axis, np.argsort(_zigzag_order(n)), "zigzag_merge")


def _positions(index: jax.Array, n: int, local_len: int, layout: str) -> jax.Array:
    """Global positions (int32 ``[local_len]``) of the tokens device `index` holds."""
    if layout == "contiguous":
        return index * local_len + jnp.arange(local_len, dtype=jnp.int32)
    c = local_len // 2
    r = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([index * c + r, (2 * n - 1 - index) * c + r])


def _axis_size(axis: Any, what: str) -> int:
    if not isinstance(axis, str):
        raise UsageTypeError(f"{what}: axis={axis!r} must be a mesh axis name (str)")
    try:
        return lax.axis_size(axis)
    except NameError as e:
        raise UsageError(
            f"{what}: mesh axis {axis!r} is not bound; call it inside jax.shard_map over a "
            f"mesh with a {axis!r} axis") from e


def position_ids(local_len: int, axis: str = CP_AXIS, layout: str = "zigzag") -> jax.Array:
    """Global token index (int32 ``[local_len]``) of each local token of this device, e.g.
    for rotary embeddings. Inside ``shard_map`` over `axis`; ``local_len = S / n`` (even for
    zigzag)."""
    _check_layout(layout)
    n = _axis_size(axis, "position_ids")
    if layout == "zigzag" and local_len % 2:
        raise UsageError(f"position_ids: zigzag needs an even local length, got {local_len}")
    return _positions(lax.axis_index(axis), n, int(local_len), layout)


def zigzag_to_contiguous(x: jax.Array, axis: str = CP_AXIS, seq_dim: int = 1) -> jax.Array:
    """Inside ``shard_map``: this device's zigzag piece -> its contiguous piece.

    With ``n = axis_size(axis)`` and ``c = x.shape[seq_dim] / 2``, device ``i`` holds natural
    chunks ``(i, 2n-1-i)`` of the zigzag layout on entry and chunks ``(2i, 2i+1)`` on exit,
    so the pieces concatenated over `axis` (``out_specs=P(..., axis)``) are in natural
    order: what `zigzag_merge` of the global array gives, without gathering it. Two
    ``ppermute`` rounds of half the local array each (the device-to-device traffic is the
    local array once); each round is a permutation: round 1 brings chunk ``2j`` to device
    ``j`` (even devices send their first chunk, odd devices their second), round 2 chunk
    ``2j+1`` (odd devices send their first, even devices their second). Differentiable
    (the transpose of a ``ppermute`` is the inverse ``ppermute``).
    """
    n = _axis_size(axis, "zigzag_to_contiguous")
    x = jnp.asarray(x)
    seq_dim %= x.ndim
    if x.shape[seq_dim] % 2:
        raise UsageError(f"zigzag_to_contiguous: local length {x.shape[seq_dim]} on dim "
                         f"{seq_dim} must be even (two zigzag chunks)")
    if n == 1:
        return x
    first, second = jnp.split(x, 2, axis=seq_dim)
    even = lax.axis_index(axis) % 2 == 0

    def holder(k: int) -> int:  # the device that holds natural chunk k in the zigzag layout
        return k if k < n else 2 * n - 1 - k

    lo = lax.ppermute(jnp.where(even, first, second), axis,
                      perm=[(holder(2 * j), j) for j in range(n)])
    hi = lax.ppermute(jnp.where(even, second, first), axis,
                      perm=[(holder(2 * j + 1), j) for j in range(n)])
    return jnp.concatenate([lo, hi], axis=seq_dim)


# --------------------------------------------------------------------------- ring schedule


@dataclasses.dataclass(frozen=True)
class _Task:
    """Query rows ``[r0, r1)`` attend to key rows ``[c0, c1)`` of the block in hand."""

    r0: int
    r1: int
    c0: int
    c1: int
    causal: bool


def _schedule(layout: str, local_len: int) -> tuple[tuple[_Task, ...], tuple[_Task, ...],
                                                     tuple[_Task, ...]]:
    """Tasks of (own block, block of a lower device j < i, block of a higher device j > i).

    Zigzag (c = local_len / 2; device i holds chunks (i, 2n-1-i)): own block = chunk i
    causal, chunk 2n-1-i sees chunk i fully and itself causally; j < i: both query chunks see
    key chunk j fully and key chunk 2n-1-j not at all; j > i: query chunk 2n-1-i sees both
    key chunks fully, query chunk i sees neither. Each non-own step is half a block.
    Contiguous: own block causal; j < i fully visible; j > i hidden (skipped).
    """
    el, c = local_len, local_len // 2
    if layout == "zigzag":
        own = (_Task(0, c, 0, c, True), _Task(c, el, 0, c, False), _Task(c, el, c, el, True))
        return own, (_Task(0, el, 0, c, False),), (_Task(c, el, 0, el, False),)
    return (_Task(0, el, 0, el, True),), (_Task(0, el, 0, el, False),), ()


@dataclasses.dataclass(frozen=True)
class _Spec:
    axis: str
    layout: str
    scale: float
    valid_len: int | None
    block_fn: BlockFn
    block_bwd_fn: BlockBwdFn


def _kv_len(spec: _Spec, kpos: jax.Array, t: _Task) -> jax.Array | None:
    if spec.valid_len is None:
        return None
    return jnp.sum(kpos[t.c0:t.c1] < spec.valid_len, dtype=jnp.int32)


def _merge(o_a, lse_a, o_b, lse_b):
    """Combines two normalised partial attentions of the same rows (float32)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    ref = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w_a = jnp.exp(lse_a - ref)[..., None]  # 0 where lse_a = -inf
    w_b = jnp.exp(lse_b - ref)[..., None]
    return o_a * w_a + o_b * w_b, lse


def _set_rows(x: jax.Array, rows: jax.Array, start: int) -> jax.Array:
    """``x`` with rows ``[start, start + len(rows))`` of dim 1 replaced by `rows`.

    A ``dynamic_update_slice`` at a static offset, not ``x.at[:, a:b].set`` (a scatter):
    jax 0.11.2's XLA CPU compiler crashes on that scatter inside a multi-device
    ``shard_map``.
    """
    return lax.dynamic_update_slice_in_dim(x, rows.astype(x.dtype), start, axis=1)


def _fwd_tasks(spec, tasks, q, k, v, kpos, acc):
    o, lse = acc
    for t in tasks:
        ob, lb = spec.block_fn(q[:, t.r0:t.r1], k[:, t.c0:t.c1], v[:, t.c0:t.c1],
                               causal=t.causal, kv_len=_kv_len(spec, kpos, t), scale=spec.scale)
        om, lm = _merge(o[:, t.r0:t.r1], lse[:, t.r0:t.r1], ob.astype(jnp.float32),
                        lb.astype(jnp.float32))
        o = _set_rows(o, om, t.r0)
        lse = _set_rows(lse, lm, t.r0)
    return o, lse


def _bwd_tasks(spec, tasks, q, k, v, do, lse, delta, kpos, acc):
    dq, dk, dv = acc
    for t in tasks:
        r, c = slice(t.r0, t.r1), slice(t.c0, t.c1)
        gq, gk, gv = spec.block_bwd_fn(
            q[:, r], k[:, c], v[:, c], do[:, r], lse[:, r], delta[:, r], causal=t.causal,
            kv_len=_kv_len(spec, kpos, t), scale=spec.scale)
        dq = _set_rows(dq, dq[:, r] + gq, t.r0)
        dk = _set_rows(dk, dk[:, c] + gk, t.c0)
        dv = _set_rows(dv, dv[:, c] + gv, t.c0)
    return dq, dk, dv


def _ring_step(run, own, lower, higher, i, j, step, acc):
    """Runs the tasks of one ring step; `j` is the (traced) owner of the block in hand."""
    if step == 0:
        return run(own, acc)
    if not higher:
        return lax.cond(j < i, lambda a: run(lower, a), lambda a: a, acc)
    return lax.cond(j < i, lambda a: run(lower, a), lambda a: run(higher, a), acc)


def _shift(x, axis: str, n: int):
    """`x` (a pytree of arrays) one step around the ring. The leaves of one dtype travel as
    ONE collective-permute (flattened into one buffer, cut back after): XLA's GPU scheduler
    keeps one collective in flight at a time, so K and V sent apart had one of the two made
    synchronous, with nothing beside it."""
    perm = [(a, (a + 1) % n) for a in range(n)]
    leaves, treedef = jax.tree.flatten(x)
    groups: dict[Any, list[int]] = {}
    for index, leaf in enumerate(leaves):
        groups.setdefault(jnp.dtype(leaf.dtype), []).append(index)
    out = list(leaves)
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = lax.ppermute(leaves[idx[0]], axis, perm=perm)
            continue
        moved = lax.ppermute(jnp.concatenate([leaves[i].reshape(-1) for i in idx]), axis,
                             perm=perm)
        start = 0
        for i in idx:
            size = leaves[i].size
            out[i] = moved[start:start + size].reshape(leaves[i].shape)
            start += size
    return jax.tree.unflatten(treedef, out)


def _ring_forward(spec: _Spec, q, k, v):
    n = lax.axis_size(spec.axis)
    i = lax.axis_index(spec.axis)
    b, el, h, d = q.shape
    own, lower, higher = _schedule(spec.layout, el)
    acc = (jnp.zeros((b, el, h, d), jnp.float32), jnp.full((b, el, h), -jnp.inf, jnp.float32))
    kv = (k, v)
    for step in range(n):
        nxt = _shift(kv, spec.axis, n) if step < n - 1 else None  # in flight during compute
        j = (i - step) % n
        kpos = _positions(j, n, el, spec.layout)
        ck, cv = kv
        acc = _ring_step(lambda ts, a, ck=ck, cv=cv, kpos=kpos: _fwd_tasks(
            spec, ts, q, ck, cv, kpos, a), own, lower, higher, i, j, step, acc)
        kv = nxt
    o, lse = acc
    return o.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(spec: _Spec, q, k, v):
    return _ring_forward(spec, q, k, v)[0]


def _fwd(spec, q, k, v):
    out, lse = _ring_forward(spec, q, k, v)
    return out, (q, k, v, out, lse)


def _split_own(own: tuple[_Task, ...]) -> tuple[tuple[_Task, ...], tuple[_Task, ...]]:
    """The own block's backward tasks before the ring steps and after them: the first part
    runs while the first K/V hop is in flight, the second while the dK/dV of the last
    block goes home. Zigzag: the two causal diagonal tasks, then the full one (equal work);
    contiguous (one task): all of it first."""
    if len(own) == 3:
        return (own[0], own[2]), (own[1],)
    return own, ()


def _bwd(spec, res, do):
    q, k, v, out, lse = res
    n = lax.axis_size(spec.axis)
    i = lax.axis_index(spec.axis)
    el = q.shape[1]
    own, lower, higher = _schedule(spec.layout, el)
    do = do.astype(q.dtype)
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

    def zeros_kv():  # like k and v: varying over the mesh axes as they do (check_vma)
        return jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)

    def run(tasks, acc, ck, cv, kpos):
        return _bwd_tasks(spec, tasks, q, ck, cv, do, lse, delta, kpos, acc)

    own_kpos = _positions(i, n, el, spec.layout)
    first, last = _split_own(own) if n > 1 else (own, ())
    # K/V travel ahead of the computation (each hop overlaps the block in hand); the dK/dV
    # of a visiting block travel one step behind: a device computes its contribution into
    # fresh zeros and adds the accumulator that arrived meanwhile only afterwards, so no
    # hop waits for the computation it is meant to overlap. The first hop carries no
    # gradient, and the last one -- a block's summed dK/dV going home -- overlaps the
    # second part of the own block.
    kv = _shift((k, v), spec.axis, n) if n > 1 else None
    dq, dk, dv = run(first, (jnp.zeros(q.shape, jnp.float32), *zeros_kv()), k, v, own_kpos)
    travelling = None  # the visiting block's dK/dV accumulated so far, in flight
    for step in range(1, n):
        ck, cv = kv
        kv = _shift(kv, spec.axis, n) if step < n - 1 else None
        j = (i - step) % n
        kpos = _positions(j, n, el, spec.layout)
        dq, *part = _ring_step(lambda ts, a, ck=ck, cv=cv, kpos=kpos: run(ts, a, ck, cv, kpos),
                               own, lower, higher, i, j, step, (dq, *zeros_kv()))
        if travelling is not None:
            part = [a + b for a, b in zip(travelling, part)]
        travelling = _shift(tuple(part), spec.axis, n)  # to the next visitor, or home
    if last:
        dq, dk, dv = run(last, (dq, dk, dv), k, v, own_kpos)
    if travelling is not None:
        dk, dv = dk + travelling[0], dv + travelling[1]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_fwd, _bwd)


# --------------------------------------------------------------------------- public API


def _validate(q, k, v, axis, layout, valid_len, scale, what):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise UsageTypeError(f"{what}: {name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise UsageError(f"{what}: {name} must be [batch, seq_local, heads, head_dim], "
                             f"got shape {tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise UsageTypeError(f"{what}: {name} must be a float array, got {x.dtype}")
    if k.shape != v.shape:
        raise UsageError(f"{what}: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    b, el, h, d = q.shape
    if (k.shape[0], k.shape[1]) != (b, el):
        raise UsageError(f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or "
                         "local sequence length (self-attention over the same tokens)")
    if k.shape[3] != d:
        raise UsageError(f"{what}: head_dim mismatch: q has {d}, k/v have {k.shape[3]}")
    if h % k.shape[2]:
        raise UsageError(f"{what}: heads={h} is not a multiple of kv_heads={k.shape[2]}")
    _check_layout(layout)
    n = _axis_size(axis, what)
    if layout == "zigzag" and el % 2:
        raise UsageError(f"{what}: zigzag needs an even local length, got {el}; pad the "
                         "sequence at the end to padded_seq_len(S, n) and pass valid_len=S")
    if valid_len is not None:
        if isinstance(valid_len, bool) or not isinstance(valid_len, (int, np.integer)):
            raise UsageTypeError(f"{what}: valid_len={valid_len!r} must be a Python int or None")
        if not 0 <= valid_len <= n * el:
            raise UsageError(f"{what}: valid_len={valid_len} outside [0, {n * el}] "
                             f"(global length = {n} x {el})")
        valid_len = int(valid_len)
        if valid_len == n * el:
            valid_len = None
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return n, valid_len, scale


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str = CP_AXIS,
                   layout: str = "zigzag", backend: str | None = None,
                   valid_len: int | None = None,
                   scale: float | None = None, block_fn: BlockFn | None = None,
                   block_bwd_fn: BlockBwdFn | None = None) -> jax.Array:
    """Causal self-attention of a sequence sharded over mesh axis `axis`, as a ring.

    Call inside ``jax.shard_map``; ``q [b, s_local, h, d]``, ``k``/``v`` ``[b, s_local,
    h_kv, d]`` are this device's tokens in `layout` (see the module docstring; global length
    ``S = n * s_local``). Returns ``[b, s_local, h, d]`` in ``q.dtype``, equal (to float
    rounding) to causal attention over the whole sequence, in the same layout.

    Args:
      axis: the context-parallel mesh axis (bound by the enclosing ``shard_map``).
      layout: ``"zigzag"`` (load-balanced; ``s_local`` even) or ``"contiguous"``.
      backend: the block kernels (`gtp_jax.pallas.attention_block` / `_bwd`): "pallas"
        (flash-attention kernels that stream key tiles, ``O(block)`` memory), "reference"
        (pure JAX, all of a block's scores at once), or None: the kernels on a GPU where
        the block shapes tile, else the reference. `block_fn` / `block_bwd_fn` replace
        them.
      valid_len: global number of real tokens when the sequence was padded at the end
        (keys at positions ``>= valid_len`` are masked); ``None``: no padding.
      scale: score scale, default ``1 / sqrt(d)``.

    Communication: forward ``n-1`` ppermutes of the local K/V; backward ``n-1`` of K/V plus
    ``n-1`` of float32 dK/dV accumulators. Gradients w.r.t. ``q, k, v`` are local (this
    device's tokens); nothing is reduced over `axis` here -- weight gradients of the
    projections feeding q/k/v must be summed over `axis` by the caller, as over a data axis.
    """
    n, valid_len, scale = _validate(q, k, v, axis, layout, valid_len, scale, "ring_attention")
    check_backend(backend, "ring_attention")
    if block_fn is not None and not callable(block_fn):
        raise UsageTypeError("ring_attention: block_fn must be callable")
    if block_bwd_fn is not None and not callable(block_bwd_fn):
        raise UsageTypeError("ring_attention: block_bwd_fn must be callable")
    spec = _Spec(axis=axis, layout=layout, scale=scale, valid_len=valid_len,
                 block_fn=block_fn or functools.partial(attention_block, backend=backend),
                 block_bwd_fn=block_bwd_fn or functools.partial(attention_block_bwd,
                                                                backend=backend))
    return _ring(spec, q, k, v)


def allgather_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str = CP_AXIS,
                        layout: str = "zigzag", valid_len: int | None = None,
                        scale: float | None = None) -> jax.Array:
    """Causal self-attention of a sharded sequence by all-gathering K/V: the baseline.

    Same contract as `ring_attention` (shapes, layouts, `valid_len`). Builds ``[s_local, S]``
    scores per head (memory ``O(s_local * S)``; no load balancing matters here since every
    device computes the full masked row block, skipping nothing). Plain autodiff: the
    transpose of ``all_gather`` reduce-scatters dK/dV over `axis`.
    """
    n, valid_len, scale = _validate(q, k, v, axis, layout, valid_len, scale,
                                    "allgather_attention")
    el = q.shape[1]
    k_all = lax.all_gather(k, axis, axis=1, tiled=True)
    v_all = lax.all_gather(v, axis, axis=1, tiled=True)
    kpos = jnp.concatenate([_positions(jnp.int32(j), n, el, layout) for j in range(n)])
    qpos = _positions(lax.axis_index(axis), n, el, layout)
    mask = qpos[:, None] >= kpos[None, :]
    if valid_len is not None:
        mask = mask & (kpos < valid_len)[None, :]
    return softmax_attend(q, k_all, v_all, mask, scale)[0].astype(q.dtype)


__all__ = [
    "CP_AXIS",
    "LAYOUTS",
    "allgather_attention",
    "attention_block",
    "attention_block_bwd",
    "padded_seq_len",
    "position_ids",
    "ring_attention",
    "zigzag_merge",
    "zigzag_split",
    "zigzag_to_contiguous",
]
