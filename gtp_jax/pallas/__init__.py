"""Pallas kernels (Triton GPU backend): low-precision quantization for weight gathering,
the SwiGLU backward pass (`swiglu_bwd`, beside its reference `swiglu_bwd_reference`) and
the flash-attention block kernels of ring attention (`attention_block` /
`attention_block_bwd`, beside `attention_block_reference` / `attention_block_bwd_reference`).

Formats: ``"fp8"`` (e4m3 + per-tensor fp32 scale), ``"mxfp8"`` (e4m3 + one e8m0 scale per
32 elements along the contraction dim, OCP MX v1.0) and ``"nvfp4"`` (packed e2m1 + one
e4m3 scale per 16 elements + per-tensor fp32 scale). Exact rules, rounding, packing and
the NaN / Inf policy: `gtp_jax.pallas.formats`; leaf layout: `gtp_jax.pallas.tensor`.

Names: the *reference* is the pure-JAX implementation of the formats in `formats`
(``backend="reference"``), which the kernels match bit for bit; the *oracle* is the
independent host-side numpy statement of the same rules in `oracle`, which the
reference (and, in ``python -m gtp_jax.bench quant --check``, the kernels) must equal.

API (every function takes ``backend="pallas" | "reference"`` and ``interpret=``):
  * `quantize` / `dequantize` / `multi_amax` (one launch for many tensors);
  * split phase: `multi_amax` -> `reduce_amax` (ONE all-reduce for N tensors) ->
    `cast_only`; `quantize_coalesced` runs the three inside ``shard_map``;
  * `gather_quantized`: all-gather a quantized shard (payload + block scales).

Wiring a low-precision GTP gather (inside ``shard_map`` over axis "gtp", shard dim 0)::

    qs = quantize_coalesced(local_shards, "nvfp4", "gtp")      # dim=-1 blocks
    full = [dequantize(gather_quantized(q, "gtp", dim=0), jnp.bfloat16) for q in qs]

Caveat for the reference backend on GPU: with the default
``--xla_allow_excess_precision=true``, XLA:GPU may drop a float32 -> fp8 -> float32 round
trip inside one fusion, so a jitted ``dequantize(quantize(x, backend="reference"))`` with
nothing opaque in between can return x unquantized there (a Pallas kernel or a collective
in between prevents it; so does running the reference on CPU). The reference's own code
never relies on such a round trip, and the numpy oracle is immune to it.

Why the Triton backend of Pallas (not Mosaic GPU): these kernels are elementwise /
small-reduction streams whose only job is to run at memory bandwidth. Triton's pointer
loads with masks give ragged tails and many differently-shaped operands in one launch
for free, it compiles for any CUDA GPU the project targets (A100, H100/H200) and it runs
under ``interpret=True`` on CPU, which is how the test suite checks the kernels bit for bit
against the reference. Mosaic GPU targets Hopper+ only, its value (TMA, warpgroup MMA)
is in GEMM-like kernels, not here. Known Triton pitfalls are handled explicitly: float
max drops NaNs (amax is an integer max over bit patterns), f32 division is approximate
(the kernels never divide: nvfp4's per-block reciprocal comes from an exact table), no
fp32->e2m1 instruction on Hopper (integer rounding on float bits). Kernel bodies are the
same code in interpret and compiled mode, so the CPU tests cover what runs on the GPU.

Kernel speeds against the device's copy bandwidth and XLA: docs/benchmarks.md, "Low-precision
gathers".
"""

from gtp_jax.pallas.api import (
    cast_only,
    dequantize,
    multi_amax,
    quantize,
)
from gtp_jax.pallas.coalesced import gather_quantized, quantize_coalesced, reduce_amax
from gtp_jax.pallas.flash_block import (
    ATTENTION_BLOCK_BACKENDS,
    BlockTiles,
    attention_block,
    attention_block_bwd,
    attention_block_bwd_reference,
    attention_block_reference,
)
from gtp_jax.pallas.formats import (
    BACKENDS,
    E2M1_MAX,
    E4M3_MAX,
    FORMATS,
    MXFP8_BLOCK,
    NVFP4_BLOCK,
    SPECS,
    SUPPORTED_DTYPES,
    FormatSpec,
)
from gtp_jax.pallas.swiglu import SWIGLU_BACKENDS, swiglu_bwd, swiglu_bwd_reference
from gtp_jax.pallas.tensor import QuantizedTensor

__all__ = [
    "ATTENTION_BLOCK_BACKENDS",
    "BlockTiles",
    "attention_block",
    "attention_block_bwd",
    "attention_block_bwd_reference",
    "attention_block_reference",
    "BACKENDS",
    "E2M1_MAX",
    "E4M3_MAX",
    "FORMATS",
    "MXFP8_BLOCK",
    "NVFP4_BLOCK",
    "SPECS",
    "SUPPORTED_DTYPES",
    "SWIGLU_BACKENDS",
    "FormatSpec",
    "QuantizedTensor",
    "cast_only",
    "dequantize",
    "gather_quantized",
    "multi_amax",
    "quantize",
    "quantize_coalesced",
    "reduce_amax",
    "swiglu_bwd",
    "swiglu_bwd_reference",
]
