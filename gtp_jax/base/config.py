"""`GTPConfig`: what to shard, over which mesh axis, and how to move it.

One frozen dataclass, validated on construction, so that a bad setting fails where it
is written rather than deep inside a traced training step.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from gtp_jax.base.errors import UsageError, UsageTypeError

#: Low-precision gather formats. None gathers in the parameter dtype (or `gather_dtype`).
GATHER_FORMATS = (None, "fp8", "mxfp8", "nvfp4")
#: Implementations of the quantize / dequantize kernels (`gtp_jax.pallas`).
QUANT_BACKENDS = ("pallas", "reference")
#: FP8 compute recipes (`GTPConfig.fp8_compute`). None computes in the compute dtype.
FP8_COMPUTE_RECIPES = (None, "tensorwise", "delayed")
#: Layers kept out of FP8 compute by default: the output head, whose logits feed the loss.
DEFAULT_FP8_EXCLUDE = (r"(^|/)(lm_head|head|output|unembed)(/|$)",)
#: Gather formats that compose with FP8 compute (the others' block scales would be
#: dequantized and quantized again per tensor: two roundings of every weight).
FP8_COMPUTE_GATHER_FORMATS = (None, "fp8")


#: Dtypes weights can be gathered and gradients reduced in (the arithmetic dtypes of a
#: matmul). 8- and 4-bit gathers need scales and are chosen with `gather_format` instead.
WIDE_FLOAT_DTYPES = tuple(np.dtype(jnp.dtype(d)) for d in ("float32", "bfloat16", "float16"))


def _as_float_dtype(value: Any, field: str) -> np.dtype | None:
    if value is None:
        return None
    try:
        dtype = np.dtype(jnp.dtype(value))
    except TypeError as err:
        raise UsageTypeError(
            f"GTPConfig.{field}={value!r} is not a dtype; use e.g. 'bfloat16'.") from err
    if dtype not in WIDE_FLOAT_DTYPES:
        hint = (" For 8- or 4-bit gathers set gather_format='fp8', 'mxfp8' or 'nvfp4' "
                "(scaled formats) instead." if jnp.issubdtype(dtype, jnp.floating) else "")
        raise UsageTypeError(
            f"GTPConfig.{field}={dtype} must be float32, bfloat16 or float16.{hint}")
    return dtype


def check_patterns(name: str, patterns: Any) -> tuple[str, ...]:
    """`patterns` (None, one regular expression or a sequence of them) as a tuple, each
    compiled once so that a bad one is refused where it is written (naming `name`), not as
    ``re.error`` from whatever first matches it.

    Raises:
      UsageTypeError: not strings.
      UsageError: an invalid regular expression.
    """
    if patterns is None:
        patterns = ()  # no patterns: the same as the default
    elif isinstance(patterns, str):
        patterns = (patterns,)
    try:
        patterns = tuple(patterns)
    except TypeError as err:
        raise UsageTypeError(f"{name}={patterns!r} must be a regular expression or a sequence "
                             "of them, e.g. ('mlp/.*kernel',).") from err
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise UsageTypeError(f"{name} holds {pattern!r}; each entry must be a regular "
                                 "expression string.")
        try:
            re.compile(pattern)
        except re.error as err:
            raise UsageError(
                f"{name} has an invalid regular expression {pattern!r} ({err}); fix it, or "
                "escape the characters meant literally (a backslash before ( [ . * + ?)."
            ) from None
    return patterns


@dataclasses.dataclass(frozen=True)
class GTPConfig:
    """How `gtp_jax.shard` stores and moves weights.

    Attributes:
      axis: mesh axis the weights are sharded 1/N over (must be in the mesh).
      pad_for_alignment: dim 0 of each sharded weight (dim 1 for layer-stacked weights) is
        zero-padded to a multiple of ``axis_size * pad_for_alignment``; 0 or 1 pads only to
        divisibility by the axis size. The padding is never visible to the module's math.
      min_elements: weights with fewer elements stay replicated (small norms, biases).
      include: regular expressions matched (``re.search``) against the ``/``-joined
        parameter path (e.g. ``"blocks/mlp/down/kernel"``). When given, only matching
        parameters are sharded (the rank and size rules still apply to the defaults only:
        an explicitly included parameter is sharded whatever its size, if it has rank >= 1).
      exclude: regular expressions; matching parameters stay replicated.
      gather_dtype: cast each shard to this dtype *before* the all-gather (halves the bytes
        for an fp32 master and bf16 compute). None gathers in the parameter dtype.
      reduce_dtype: dtype the weight gradient is reduce-scattered in.
      remat_gathered: recompute (re-gather) full weights in the backward pass instead of
        keeping them alive from the forward pass. This is the memory saving; switch off only
        to trade memory for one all-gather per weight. Applies to weights outside a layer
        stack; for a stack see `keep_gathered_layers`.
      gather_format: low-precision gather: None (gather in the parameter dtype or
        `gather_dtype`), "fp8" (e4m3, one fp32 scale per weight), "mxfp8" (e4m3, one
        power-of-two scale per 32 elements) or "nvfp4" (packed e2m1, one e4m3 scale per 16
        elements and one fp32 scale per weight). Each device quantizes its own shard (the
        per-weight scales of one layer agreed with ONE all-reduce), the all-gather moves the
        payload and scales, and the gathered weight is dequantized to the compute dtype
        (`gather_dtype`, else the parameter dtype). Master weights and reduce-scattered
        gradients stay in high precision (straight-through gradient). Weights of per-layer
        rank 1 are gathered unquantized. Over a 1-wide `axis` nothing is gathered, so no
        format applies (weights are not rounded; FP8 GEMMs quantize theirs themselves).
        With `fp8_compute`, "fp8" applies to the kernels of the FP8 layers only (their
        GEMMs read the gathered payload, nothing is dequantized); the other weights
        (embedding, output head, norms) are gathered in `gather_dtype`, not rounded.
      quant_backend: None (default: the `gtp_jax.pallas` kernels when the default JAX
        backend is a GPU, else the pure-JAX reference, which gives the kernels' bits),
        "pallas" (the kernels; run by the Pallas interpreter off GPUs, slowly: for tests)
        or "reference" (the pure-JAX reference implementation of the same formats). It
        applies to the FP8 matmuls of `fp8_compute` as well (their amax and casts:
        "reference" leaves them to XLA's fusions).
      prefetch: double-buffered prefetch in `gtp_jax.scan_layers`: layer ``i + 1``'s
        weights are gathered while layer ``i`` computes, and in the backward loop layer
        ``i - 1``'s weights are gathered and layer ``i + 1``'s gradient reduce-scattered
        while layer ``i``'s backward runs.
      keep_gathered_layers: `gtp_jax.scan_layers` keeps every layer's gathered weights
        from the forward pass for the backward pass, which then gathers nothing (one
        all-gather per weight and layer less) and re-casts nothing. The cost is memory: the
        whole stack, unsharded, in the compute dtype, from the forward pass to the backward
        pass. Off (the default), the backward loop gathers each layer again.
      fp8_compute: None (matmuls in the compute dtype) or "tensorwise": the matmuls of the
        eligible ``nnx.Linear`` / ``nnx.LinearGeneral`` / ``nnx.Einsum`` layers run on e4m3
        activations and weights with e5m2 gradients, one scale per tensor from its current
        amax (`gtp_jax.sharding.fp8`). Needs FP8 GEMMs on GPUs (Ada/Hopper or later); on
        CPUs it is emulated exactly. Composes with gather_format None or "fp8".
        "delayed": the same layers and formats, each tensor scaled from an amax history
        of earlier steps (TransformerEngine's delayed scaling): every FP8 layer gets an
        `gtp_jax.base.fp8_history.Fp8History` variable, replicated, which the training step
        (`gtp_jax.train.TrainStep`) replaces with the value its backward pass returns
        (docs/fp8.md).
      fp8_history_len: with ``fp8_compute="delayed"``: steps of amax history each FP8
        tensor's scale is the maximum over (>= 1; TransformerEngine's default 16).
      fp8_min_features: a layer computes in FP8 only if its kernel has at least this many
        input features and as many output features (smaller GEMMs gain less than their
        quantize passes cost; see docs/fp8.md).
      fp8_include: regular expressions on layer paths (e.g. ``"blocks/mlp"``); when given,
        exactly the matching layers compute in FP8, whatever their size.
      fp8_exclude: regular expressions on layer paths kept out of FP8 compute (default:
        the output head, `DEFAULT_FP8_EXCLUDE`).
      offload_optimizer: keep the optimizer state (AdamW's moments and step count) in host
        memory (JAX memory kind ``"pinned_host"``), on the same mesh and sharding: the
        training step (`gtp_jax.train.TrainStep`) copies each state leaf to the device for
        the update and the new value back, and XLA schedules those copies around the
        computation. The arithmetic is unchanged (bit-identical training); device memory
        drops by the state's bytes on backends whose host memory is separate (GPUs; on
        the CPU backend host and device memory are the same RAM).
      offload_master_weights: with ``offload_optimizer``: the float32 parameters (the
        master weights) move to host memory with the moments, and the device keeps the
        parameters and their gradients in bfloat16 (gradients reduce-scattered in
        ``reduce_dtype`` first): 4 bytes less of device memory per parameter, 4 more each
        way over the host link per step. The optimizer updates the float32 master as it
        would the float32 parameters; the forward and backward passes see it rounded to
        bfloat16 (the usual mixed-precision recipe: other losses than a float32 run).
        Needs float32 parameters, and an optimizer built by
        `gtp_jax.train.make_nnx_optimizer`, trained by `gtp_jax.train.TrainStep`.
      offload_exclude: with ``offload_optimizer``: regular expressions on parameter paths
        (as `include`) whose optimizer state stays in device memory (partial offload):
        their moments are updated in place with no copy, so each step moves only the
        others' (`python -m gtp_jax plan` picks what spare device memory can keep).
      coalesce_layer_collectives: the layer loop gathers all of one layer's weights that
        share a gather dtype with ONE all-gather (their shards flattened into one buffer,
        the gathered buffer cut back into the weights), and reduce-scatters all of the
        layer's gradients with ONE reduce-scatter, instead of one collective per weight.
        The same values (gathers move bits; a gradient's sum over the axis may add its
        shards in another order). XLA's GPU scheduler keeps one collective in flight at
        a time by default, so a layer's seven weight gathers queue behind each other and
        some run with no GEMM beside them; one gather per layer can run beside the whole
        layer. The cost: the cut copies the gathered layer once (one layer of weights in
        the compute dtype, written and read). Low-precision (`gather_format`) and FP8
        kernels keep their own collectives. On by default: on 2 H200s it took llama3-8b's
        step from 302.9 to 287.9 ms at 2048 tokens per GPU, 883.4 to 864.7 at 8192, for
        0.5 GiB more at the peak (docs/overlap.md); False gives one collective per weight.
    """

    axis: str = "gtp"
    pad_for_alignment: int = 0
    min_elements: int = 1024
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    gather_dtype: Any = None
    reduce_dtype: Any = jnp.float32
    remat_gathered: bool = True
    gather_format: str | None = None
    prefetch: bool = False
    quant_backend: str | None = None
    keep_gathered_layers: bool = False
    fp8_compute: str | None = None
    fp8_min_features: int = 2048
    fp8_history_len: int = 16
    fp8_include: tuple[str, ...] = ()
    fp8_exclude: tuple[str, ...] = DEFAULT_FP8_EXCLUDE
    offload_optimizer: bool = False
    offload_exclude: tuple[str, ...] = ()
    offload_master_weights: bool = False
    coalesce_layer_collectives: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str) or not self.axis:
            raise UsageTypeError(
                f"GTPConfig.axis={self.axis!r} must be a mesh axis name such as 'gtp'.")
        if (isinstance(self.pad_for_alignment, bool) or not isinstance(self.pad_for_alignment, int)
                or self.pad_for_alignment < 0):
            raise UsageError(
                f"GTPConfig.pad_for_alignment={self.pad_for_alignment!r} must be an int >= 0 "
                "(0 or 1: pad only to divisibility by the axis size)."
            )
        if (isinstance(self.min_elements, bool) or not isinstance(self.min_elements, int)
                or self.min_elements < 0):
            raise UsageError(f"GTPConfig.min_elements={self.min_elements!r} must be an int >= 0.")
        for field in ("include", "exclude", "fp8_include", "fp8_exclude", "offload_exclude"):
            object.__setattr__(self, field, check_patterns(f"GTPConfig.{field}",
                                                           getattr(self, field)))
        object.__setattr__(self, "gather_dtype", _as_float_dtype(self.gather_dtype, "gather_dtype"))
        reduce_dtype = _as_float_dtype(self.reduce_dtype, "reduce_dtype")
        if reduce_dtype is None:
            raise UsageTypeError("GTPConfig.reduce_dtype must be a floating dtype, not None.")
        object.__setattr__(self, "reduce_dtype", reduce_dtype)
        if self.gather_format not in GATHER_FORMATS:
            raise UsageError(
                f"GTPConfig.gather_format={self.gather_format!r} is unknown; "
                f"choose one of {GATHER_FORMATS}."
            )
        if self.quant_backend is not None and self.quant_backend not in QUANT_BACKENDS:
            raise UsageError(
                f"GTPConfig.quant_backend={self.quant_backend!r} is unknown; "
                f"choose one of {QUANT_BACKENDS} or None (the kernels on a GPU)."
            )
        if self.fp8_compute not in FP8_COMPUTE_RECIPES:
            raise UsageError(
                f"GTPConfig.fp8_compute={self.fp8_compute!r} is unknown; choose one of "
                f"{FP8_COMPUTE_RECIPES}.")
        if self.fp8_compute is not None and self.gather_format not in FP8_COMPUTE_GATHER_FORMATS:
            raise UsageError(
                f"GTPConfig.fp8_compute={self.fp8_compute!r} with gather_format="
                f"{self.gather_format!r}: block-scaled formats (mxfp8, nvfp4) are gather "
                "formats only (their GEMMs need Blackwell GPUs); use gather_format='fp8' or "
                "None with FP8 compute.")
        if (isinstance(self.fp8_min_features, bool) or not isinstance(self.fp8_min_features, int)
                or self.fp8_min_features < 0):
            raise UsageError(
                f"GTPConfig.fp8_min_features={self.fp8_min_features!r} must be an int >= 0.")
        if (isinstance(self.fp8_history_len, bool) or not isinstance(self.fp8_history_len, int)
                or self.fp8_history_len < 1):
            raise UsageError(
                f"GTPConfig.fp8_history_len={self.fp8_history_len!r} must be an int >= 1 "
                "(steps of amax history of the delayed recipe; 16 is TransformerEngine's "
                "default).")
        for field in ("prefetch", "remat_gathered", "keep_gathered_layers",
                      "offload_optimizer", "offload_master_weights",
                      "coalesce_layer_collectives"):
            if not isinstance(getattr(self, field), bool):
                raise UsageTypeError(
                    f"GTPConfig.{field}={getattr(self, field)!r} must be True or False.")
        if self.offload_exclude and not self.offload_optimizer:
            raise UsageError(
                f"GTPConfig.offload_exclude={self.offload_exclude!r} keeps some optimizer state "
                "in device memory out of an offloaded one, but offload_optimizer is False "
                "(all of it is on the device); set offload_optimizer=True or drop "
                "offload_exclude.")
        if self.offload_master_weights and not self.offload_optimizer:
            raise UsageError(
                "GTPConfig.offload_master_weights=True moves the float32 parameters to host "
                "memory with the optimizer state, but offload_optimizer is False; set "
                "offload_optimizer=True too, or drop offload_master_weights.")

    def alignment(self, axis_size: int) -> int:
        """The multiple that a sharded dimension is padded to on a mesh axis of `axis_size`."""
        return axis_size * max(1, self.pad_for_alignment)
