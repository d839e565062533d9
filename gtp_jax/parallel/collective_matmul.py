"""Collective matmuls on the sequence dimension: all-gather + GEMM and GEMM + reduce-scatter.

These are the two communication patterns of Megatron sequence parallelism (see `tp`):

* `all_gather_matmul`: ``all_gather(x, seq) @ w`` -- the column-parallel layer's input is
  sequence-sharded and must be gathered before its GEMM;
* `matmul_reduce_scatter`: ``psum_scatter(h @ w, seq)`` -- the row-parallel layer's output
  is a partial sum and leaves sequence-sharded.

Each has two implementations behind one ``custom_vjp``, chosen with ``overlap``:

* ``overlap=False``: one ``all_gather`` / ``psum_scatter`` and one GEMM (XLA may or may not
  overlap them with neighbouring work);
* ``overlap=True``: a ring of ``jax.lax.ppermute`` steps ("collective matmul", as in
  Wang et al., ASPLOS'23 and the TE/Megatron userbuffer overlap): with ``n`` ranks the GEMM
  is cut into ``n`` sequence chunks, and each step multiplies the chunk in hand while the
  next chunk (all-gather) or the running partial sum (reduce-scatter) travels to the
  neighbour. Nothing in a step depends on that step's transfer, so the latency-hiding
  scheduler can run them concurrently. The ring is unrolled (``n`` is small and static),
  which leaves the scheduler free to move every transfer. Gathered chunks are processed in
  ring order and put in rank order once at the end (`unrotate`), so no GEMM output is
  written into a zero-filled buffer chunk by chunk.

Backward passes (the split TransformerEngine's userbuffer overlap also uses):

* all-gather-matmul (column-parallel): "bulk" overlap -- the re-gather of the input is
  independent of the input-gradient GEMM ``dy @ w^T``, and the reduce-scatter of that
  gradient is independent of the weight-gradient GEMM ``x^T dy``, so each collective has a
  full-size GEMM to hide behind and no GEMM is cut into chunks. With ``overlap=True`` and
  ``False`` this is the same program; it is written so the latency-hiding scheduler can
  overlap the pairs.
* matmul-reduce-scatter (row-parallel): the output gradient must be all-gathered before
  either GEMM can start, so with ``overlap=True`` it travels around the ring while the
  input-gradient GEMM of the chunk in hand runs, and the weight gradient is accumulated
  chunk by chunk.

Both save only the *local* (sequence-sharded) activation for the backward pass and
re-gather it there -- the sequence-parallel memory saving -- so the two implementations
differ only in scheduling and agree to float rounding.

XLA's own collective matmul ("windowed einsum", flags ``--xla_gpu_threshold_for_windowed_
einsum_mib``, ``--xla_gpu_multi_streamed_windowed_einsum``, ``--xla_gpu_operand_bytes_
threshold_for_windowed_einsum``, ``--xla_gpu_experimental_enable_alltoall_windowed_einsum``,
present in jaxlib 0.10.2) is a rewrite of the SPMD partitioner: it applies to einsums that
XLA partitions itself under ``jit`` with sharded operands, not to explicit collectives
inside ``shard_map``, so it cannot replace these functions here; ``python -m gtp_jax.bench
parallel --micro`` times both on the same GEMM.

Every function runs inside ``jax.shard_map`` with `axis_name` a manual mesh axis. Shapes:
activations are ``[batch, seq, *features]`` with the sequence on dim 1.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32


def _ring_perm(n: int) -> list[tuple[int, int]]:
    """Every rank sends to its right neighbour."""
    return [(j, (j + 1) % n) for j in range(n)]


def _as_2d(w: jax.Array, n_contract: int) -> jax.Array:
    return w.reshape(math.prod(w.shape[:n_contract]), -1)


def _x3(x: jax.Array, n_contract: int) -> jax.Array:
    """``[B, S, *k]`` -> ``[B, S, prod(k)]``."""
    return x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[x.ndim - n_contract:]))


def _mm(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """``[B, S, K] @ [K, N] -> [B, S, N]``."""
    return jnp.einsum("bsk,kn->bsn", x, w, preferred_element_type=out_dtype)


def _wgrad(x: jax.Array, dy: jax.Array, out_dtype=None) -> jax.Array:
    """``sum_{b,s} x[b,s,:]^T dy[b,s,:]`` -> ``[K, N]``."""
    return jnp.einsum("bsk,bsn->kn", x, dy, preferred_element_type=out_dtype)


def _chunk(x: jax.Array, index: jax.Array, size: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=1)


# ------------------------------------------------------------------------ ring building blocks


def _left_perm(n: int) -> list[tuple[int, int]]:
    """Every rank sends to its left neighbour: step i of a ring holds rank ``me + i``'s chunk."""
    return [(j, (j - 1) % n) for j in range(n)]


def ring_gather_map(x, axis_name: str, fn) -> list:
    """Passes every rank's `x` around the ring once and applies `fn` to each chunk in hand.

    Step ``i`` (of ``n``) holds the chunk of rank ``(me + i) mod n``; the hop that brings
    the next chunk is issued before `fn` runs on the current one and does not depend on it,
    so transfer and compute can overlap. The results stay in this ring order (no
    rank-dependent indexing inside the loop); `unrotate` puts them in rank order once.

    Args:
      x: this rank's chunk (any shape).
      axis_name: manual mesh axis of the ring.
      fn: ``(i, chunk) -> pytree``, ``i`` the (static) step.

    Returns:
      ``[fn(i, chunk of rank (me + i) mod n) for i in range(n)]``.
    """
    n = lax.axis_size(axis_name)
    send = compute = x
    outs = []
    for i in range(n):
        incoming = lax.ppermute(send, axis_name, _left_perm(n)) if i < n - 1 else None
        out = fn(i, compute)
        if incoming is not None:
            # The next chunk's compute waits for this chunk's result. Without the barrier XLA
            # merges the chunk GEMMs (they share the weight) into one GEMM over the
            # concatenated chunks, which must wait for the last transfer: no overlap left.
            out, compute = lax.optimization_barrier((out, incoming))
            send = incoming
        outs.append(out)
    return outs


def unrotate(chunks: list[jax.Array], axis_name: str, axis: int = 1) -> jax.Array:
    """Concatenates ring-ordered chunks (`ring_gather_map`) in rank order along `axis`.

    Chunk ``i`` came from rank ``(me + i) mod n``, so rank order is the ring order rotated
    by ``me``: one dynamic slice of the doubled concatenation, which XLA emits as a single
    pass over the output (instead of zero-filling it and updating one chunk at a time).
    """
    n = len(chunks)
    if n == 1:
        return chunks[0]
    size = chunks[0].shape[axis]
    me = lax.axis_index(axis_name)
    doubled = jnp.concatenate(chunks + chunks, axis=axis)
    return lax.dynamic_slice_in_dim(doubled, ((n - me) % n) * size, n * size, axis=axis)


def ring_reduce_scatter(operand, partial_fn, axis_name: str, dtype) -> jax.Array:
    """Reduce-scatter of per-chunk partial results, accumulated around the ring.

    Step ``i`` computes ``partial_fn(operand, i)``, this rank's contribution to the chunk of
    rank ``(me - i - 1) mod n``, and adds it to the accumulator received from the left
    neighbour, which has been summing the same chunk; after ``n`` steps each rank holds the
    full sum of its own chunk. The hop of the accumulator and the partial GEMM of a step are
    independent.

    Args:
      operand: what the partials are computed from (any pytree), threaded through an
        optimization barrier so that partial ``i + 1`` is computed after partial ``i``, not
        merged with it into one GEMM that would have to finish before the first hop.
      partial_fn: ``(operand, i: static step) -> array`` (every call the same shape).
      axis_name: manual mesh axis of the ring.
      dtype: dtype the accumulator travels in (the partials are added in float32).

    Returns:
      This rank's chunk of the sum, in `dtype`.
    """
    n = lax.axis_size(axis_name)
    acc = partial_fn(operand, 0).astype(dtype)
    for i in range(1, n):
        acc, operand = lax.optimization_barrier((acc, operand))
        part = partial_fn(operand, i)
        acc = lax.ppermute(acc, axis_name, _ring_perm(n))
        acc = (acc.astype(_F32) + part.astype(_F32)).astype(dtype)
    return acc


def _ring_ag_mm(x3: jax.Array, w2: jax.Array, axis_name: str) -> jax.Array:
    """``all_gather(x3, seq) @ w2`` as a ring: ``[B, S_l, K] -> [B, n * S_l, N]``."""
    return unrotate(ring_gather_map(x3, axis_name, lambda _, chunk: _mm(chunk, w2)), axis_name)


def _ring_mm_rs(h3: jax.Array, w2: jax.Array, axis_name: str) -> jax.Array:
    """``psum_scatter(h3 @ w2, seq)`` as a ring: ``[B, S, K] -> [B, S / n, N]``."""
    n = lax.axis_size(axis_name)
    s = h3.shape[1] // n
    me = lax.axis_index(axis_name)

    def partial(h, i):
        return _mm(_chunk(h, (me - i - 1) % n, s), w2)

    # Partials leave the GEMM in the activation dtype (as a psum_scatter's operand would);
    # the ring adds each one to the travelling sum in float32.
    return ring_reduce_scatter(h3, partial, axis_name, h3.dtype)


# ------------------------------------------------------------------------ all-gather + matmul


def _check(x: jax.Array, w: jax.Array, n_contract: int, what: str) -> None:
    if x.ndim < 2 + n_contract or w.ndim <= n_contract:
        raise ValueError(
            f"{what}: x {x.shape} must be [batch, seq, *k] and w {w.shape} [*k, *out] with "
            f"n_contract={n_contract} contracted dims.")
    if tuple(x.shape[x.ndim - n_contract:]) != tuple(w.shape[:n_contract]):
        raise ValueError(
            f"{what}: contracted dims of x {x.shape} and w {w.shape} differ "
            f"(n_contract={n_contract}).")


def all_gather_matmul(x: jax.Array, w: jax.Array, axis_name: str, *, overlap: bool = True,
                      n_contract: int = 1) -> jax.Array:
    """``all_gather(x, axis_name, seq dim) @ w`` (column-parallel input projection).

    Args:
      x: ``[B, S_local, *k]`` this rank's sequence chunk (chunks in rank order).
      w: ``[*k, *out]`` this rank's weight (any float dtype equal to `x`'s).
      axis_name: manual mesh axis the sequence is sharded over (``"tp"``).
      overlap: ring of ppermutes overlapped with chunk GEMMs (True) or one all-gather (False).
      n_contract: how many trailing dims of `x` / leading dims of `w` are contracted.

    Returns:
      ``[B, n * S_local, *out]`` in `x`'s dtype: the full-sequence GEMM with this rank's `w`.
      Gradients: ``dx`` is a reduce-scatter of ``dy @ w^T`` overlapped with the ``dw``
      GEMM, and ``dw = all_gather(x)^T dy`` re-gathers `x` (not saved gathered) beside the
      ``dx`` GEMM ("bulk" overlap, in both modes).
    """
    _check(x, w, n_contract, "all_gather_matmul")
    return _ag_mm(x, w, axis_name, bool(overlap), int(n_contract))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _ag_mm(x, w, axis_name, overlap, n_contract):
    return _ag_mm_fwd(x, w, axis_name, overlap, n_contract)[0]


def _ag_mm_fwd(x, w, axis_name, overlap, n_contract):
    x3, w2 = _x3(x, n_contract), _as_2d(w, n_contract)
    if overlap:
        y = _ring_ag_mm(x3, w2, axis_name)
    else:
        y = _mm(lax.all_gather(x3, axis_name, axis=1, tiled=True), w2)
    out_shape = (y.shape[0], y.shape[1], *w.shape[n_contract:])
    # Residuals: the local chunk, not the gathered sequence.
    return y.reshape(out_shape), (x, w)


def _ag_mm_bwd(axis_name, overlap, n_contract, res, dy):
    del overlap  # bulk overlap in both modes (module docstring)
    x, w = res
    x3, w2 = _x3(x, n_contract), _as_2d(w, n_contract)
    dy3 = dy.reshape(dy.shape[0], dy.shape[1], -1)
    # all_gather(x) runs beside the dgrad GEMM, psum_scatter(dgrad) beside the wgrad GEMM.
    x_full = lax.all_gather(x3, axis_name, axis=1, tiled=True)
    dx3 = lax.psum_scatter(_mm(dy3, w2.T), axis_name, scatter_dimension=1, tiled=True)
    dw2 = _wgrad(x_full, dy3)
    return dx3.reshape(x.shape).astype(x.dtype), dw2.reshape(w.shape).astype(w.dtype)


_ag_mm.defvjp(_ag_mm_fwd, _ag_mm_bwd)


# ------------------------------------------------------------------------ matmul + reduce-scatter


def matmul_reduce_scatter(h: jax.Array, w: jax.Array, axis_name: str, *, overlap: bool = True,
                          n_contract: int = 1) -> jax.Array:
    """``psum_scatter(h @ w, axis_name, seq dim)`` (row-parallel output projection).

    Args:
      h: ``[B, S, *k]`` full sequence, this rank's slice of the contracted features.
      w: ``[*k, *out]`` this rank's rows of the weight.
      axis_name: manual mesh axis; ``S`` must be divisible by its size.
      overlap: ring of ppermuted partial sums (True) or one ``psum_scatter`` (False).
      n_contract: how many trailing dims of `h` / leading dims of `w` are contracted.

    Returns:
      ``[B, S / n, *out]`` in `h`'s dtype: this rank's sequence chunk of the sum over ranks.
      Gradients: ``dy`` is all-gathered (ring) once and used for both ``dh = dy_full @ w^T``
      and ``dw = h^T dy_full``.
    """
    _check(h, w, n_contract, "matmul_reduce_scatter")
    n = lax.axis_size(axis_name)
    if h.shape[1] % n:
        raise ValueError(
            f"matmul_reduce_scatter: sequence length {h.shape[1]} is not divisible by the "
            f"{n} ranks of axis {axis_name!r}; pad the sequence (gtp_jax.parallel.tp.pad_seq).")
    return _mm_rs(h, w, axis_name, bool(overlap), int(n_contract))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _mm_rs(h, w, axis_name, overlap, n_contract):
    return _mm_rs_fwd(h, w, axis_name, overlap, n_contract)[0]


def _mm_rs_fwd(h, w, axis_name, overlap, n_contract):
    h3, w2 = _x3(h, n_contract), _as_2d(w, n_contract)
    if overlap:
        y = _ring_mm_rs(h3, w2, axis_name)
    else:
        y = lax.psum_scatter(_mm(h3, w2), axis_name, scatter_dimension=1, tiled=True)
    return y.reshape(y.shape[0], y.shape[1], *w.shape[n_contract:]), (h, w)


def _mm_rs_bwd(axis_name, overlap, n_contract, res, dy):
    h, w = res
    h3, w2 = _x3(h, n_contract), _as_2d(w, n_contract)
    dy3 = dy.reshape(dy.shape[0], dy.shape[1], -1)
    if overlap:
        # dy travels around the ring while the dgrad GEMM of the chunk in hand runs; the
        # wgrad is one full-size GEMM on the reassembled dy (no slicing of h, no float32
        # accumulator passes), free to overlap the next layer's backward transfers.
        pairs = ring_gather_map(dy3, axis_name, lambda _, chunk: (chunk, _mm(chunk, w2.T)))
        dh3 = unrotate([dh for _, dh in pairs], axis_name)
        dw2 = _wgrad(h3, unrotate([c for c, _ in pairs], axis_name))
    else:
        dy_full = lax.all_gather(dy3, axis_name, axis=1, tiled=True)
        dh3, dw2 = _mm(dy_full, w2.T), _wgrad(h3, dy_full)
    return dh3.reshape(h.shape).astype(h.dtype), dw2.reshape(w.shape).astype(w.dtype)


_mm_rs.defvjp(_mm_rs_fwd, _mm_rs_bwd)


# ------------------------------------------------------------------------ ring-ordered pair


def all_gather_matmul_chunks(x: jax.Array, w: jax.Array, axis_name: str, *,
                             n_contract: int = 1) -> list[jax.Array]:
    """Ring all-gather + GEMM whose output stays in *ring order*, as a list of chunks.

    For a column-parallel GEMM followed only by position-independent (elementwise) work and
    `matmul_reduce_scatter_chunks` -- the MLP. Chunk ``i`` is rank ``(me + i) mod n``'s
    sequence chunk times `w`; the reduce-scatter ring then finds every chunk it needs at a
    static list position, so neither the forward nor the backward of the pair copies a
    slice or puts chunks in rank order (`unrotate`).

    Args:
      x: ``[B, S_local, *k]`` this rank's sequence chunk.
      w: ``[*k, *out]`` this rank's columns of the weight (same dtype as `x`).
      axis_name: manual mesh axis the sequence is sharded over (``"tp"``).
      n_contract: how many trailing dims of `x` / leading dims of `w` are contracted.

    Returns:
      ``n`` arrays ``[B, S_local, *out]`` in `x`'s dtype, in ring order. Gradients: ``dx``
      by a reduce-scatter ring over the chunk cotangents, ``dw`` accumulated chunk by chunk
      while `x` is re-gathered around the ring.
    """
    _check(x, w, n_contract, "all_gather_matmul_chunks")
    return _ag_mm_chunks(x, w, axis_name, int(n_contract))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _ag_mm_chunks(x, w, axis_name, n_contract):
    return _ag_mm_chunks_fwd(x, w, axis_name, n_contract)[0]


def _ag_mm_chunks_fwd(x, w, axis_name, n_contract):
    x3, w2 = _x3(x, n_contract), _as_2d(w, n_contract)
    out_shape = (x.shape[0], x.shape[1], *w.shape[n_contract:])
    ys = ring_gather_map(x3, axis_name, lambda _, chunk: _mm(chunk, w2).reshape(out_shape))
    return ys, (x, w)


def _ag_mm_chunks_bwd(axis_name, n_contract, res, dys):
    x, w = res
    x3, w2 = _x3(x, n_contract), _as_2d(w, n_contract)
    dy3 = [dy.reshape(dy.shape[0], dy.shape[1], -1) for dy in dys]
    n = len(dy3)
    # Step i of the reduce-scatter ring needs rank (me - i - 1)'s chunk: list entry n - 1 - i.
    dx3 = ring_reduce_scatter(dy3, lambda d, i: _mm(d[n - 1 - i], w2.T), axis_name, x3.dtype)
    dws = ring_gather_map(x3, axis_name, lambda i, chunk: _wgrad(chunk, dy3[i], _F32))
    return dx3.reshape(x.shape).astype(x.dtype), sum(dws).reshape(w.shape).astype(w.dtype)


_ag_mm_chunks.defvjp(_ag_mm_chunks_fwd, _ag_mm_chunks_bwd)


def matmul_reduce_scatter_chunks(hs: list[jax.Array], w: jax.Array, axis_name: str, *,
                                 n_contract: int = 1) -> jax.Array:
    """`matmul_reduce_scatter` of a ring-ordered list (from `all_gather_matmul_chunks`).

    Args:
      hs: ``n`` arrays ``[B, S_local, *k]`` in ring order (entry ``i``: rank
        ``(me + i) mod n``'s sequence chunk), this rank's slice of the contracted features.
      w: ``[*k, *out]`` this rank's rows of the weight.
      axis_name: manual mesh axis (``"tp"``); ``len(hs)`` must equal its size.
      n_contract: how many trailing dims of each `hs` entry / leading dims of `w` contract.

    Returns:
      ``[B, S_local, *out]`` in the dtype of `hs`: this rank's sequence chunk of the sum over
      ranks. Gradients: ``dy`` travels around the ring once; each step's chunk gives that
      chunk's ``dh`` (returned in ring order) and its share of ``dw``.
    """
    n = lax.axis_size(axis_name)
    if not isinstance(hs, (list, tuple)) or len(hs) != n:
        raise ValueError(
            f"matmul_reduce_scatter_chunks: hs must be a list of {n} ring-ordered chunks "
            f"(one per rank of {axis_name!r}, as all_gather_matmul_chunks returns), got "
            f"{type(hs).__name__} of length {len(hs) if isinstance(hs, (list, tuple)) else '-'}.")
    for h in hs:
        _check(h, w, n_contract, "matmul_reduce_scatter_chunks")
    return _mm_rs_chunks(list(hs), w, axis_name, int(n_contract))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mm_rs_chunks(hs, w, axis_name, n_contract):
    return _mm_rs_chunks_fwd(hs, w, axis_name, n_contract)[0]


def _mm_rs_chunks_fwd(hs, w, axis_name, n_contract):
    h3 = [_x3(h, n_contract) for h in hs]
    w2 = _as_2d(w, n_contract)
    n = len(h3)
    y = ring_reduce_scatter(h3, lambda hl, i: _mm(hl[n - 1 - i], w2), axis_name, h3[0].dtype)
    return y.reshape(y.shape[0], y.shape[1], *w.shape[n_contract:]), (hs, w)


def _mm_rs_chunks_bwd(axis_name, n_contract, res, dy):
    hs, w = res
    h3 = [_x3(h, n_contract) for h in hs]
    w2 = _as_2d(w, n_contract)
    dy3 = dy.reshape(dy.shape[0], dy.shape[1], -1)
    pairs = ring_gather_map(
        dy3, axis_name,
        lambda i, chunk: (_mm(chunk, w2.T), _wgrad(h3[i], chunk, _F32)))
    dhs = [dh.reshape(h.shape).astype(h.dtype) for (dh, _), h in zip(pairs, hs)]
    dw = sum(g for _, g in pairs)
    return dhs, dw.reshape(w.shape).astype(w.dtype)


_mm_rs_chunks.defvjp(_mm_rs_chunks_fwd, _mm_rs_chunks_bwd)
