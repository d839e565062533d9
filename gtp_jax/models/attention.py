"""Causal self-attention of the decoder: cuDNN's fused kernel where it applies, else XLA.

``jax.nn.dot_product_attention(implementation=None)`` always runs XLA's attention (the
``seq x seq`` scores materialized), far slower on GPUs than cuDNN's flash-attention kernel
(docs/performance.md). `causal_attention` with ``impl="auto"`` picks the kernel wherever it
applies, so the default is the fast path.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp

from gtp_jax.base.errors import UsageError

#: `TransformerConfig.attention_impl` values (None is "auto").
ATTENTION_IMPLS = ("auto", "cudnn", "xla")
#: Compute dtypes cuDNN's fused attention takes.
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
#: Largest head dim every supported GPU generation takes (Hopper takes 256).
CUDNN_MAX_HEAD_DIM = 128


def cudnn_unsupported(dtype: Any, head_dim: int, backend: str | None = None) -> str | None:
    """Why cuDNN's fused attention does not apply (None: it does).

    Args:
      dtype: the compute dtype of q, k, v.
      head_dim: the per-head width.
      backend: a JAX backend name; None: ``jax.default_backend()``.
    """
    backend = jax.default_backend() if backend is None else backend
    if backend != "gpu":
        return f"the {backend} backend has no cuDNN"
    if jnp.dtype(dtype) not in CUDNN_DTYPES:
        return f"compute dtype {jnp.dtype(dtype)} (cuDNN takes bfloat16 or float16)"
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return (f"head dim {head_dim} (cuDNN takes multiples of 8 up to "
                f"{CUDNN_MAX_HEAD_DIM})")
    return None


def resolve_attention_impl(impl: str | None, dtype: Any, head_dim: int,
                           backend: str | None = None) -> str:
    """The implementation ``impl`` runs: "cudnn" or "xla".

    ``"auto"`` (or None) is "cudnn" where `cudnn_unsupported` finds no reason against it,
    else "xla". An explicit ``"cudnn"`` where it does not apply raises a `UsageError`.
    """
    impl = "auto" if impl is None else impl
    if impl not in ATTENTION_IMPLS:
        raise UsageError(f"TransformerConfig.attention_impl={impl!r}; choose one of "
                         f"{ATTENTION_IMPLS} (None: auto).")
    reason = cudnn_unsupported(dtype, head_dim, backend)
    if impl == "cudnn" and reason is not None:
        raise UsageError(f"TransformerConfig.attention_impl='cudnn' does not apply here: "
                         f"{reason}; use 'auto' or 'xla'.")
    if impl == "auto":
        return "xla" if reason is not None else "cudnn"
    return impl


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     impl: str | None = "auto") -> jax.Array:
    """Causal attention of ``q, k, v: [batch, seq, heads, head_dim]`` (same dtype) ->
    ``[batch, seq, heads, head_dim]``, by `resolve_attention_impl`'s choice.

    With ``"auto"``, a shape cuDNN still refuses when traced (its own checks go further
    than `cudnn_unsupported`'s) falls back to XLA with a warning.
    """
    chosen = resolve_attention_impl(impl, q.dtype, q.shape[-1])
    if chosen == "cudnn" and impl in (None, "auto"):
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                implementation="cudnn")
        except (NotImplementedError, RuntimeError, ValueError) as err:
            warnings.warn(f"cuDNN attention refused q {q.shape} {q.dtype} ({err}); "
                          "running XLA's attention instead.", stacklevel=2)
            chosen = "xla"
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=chosen)
