"""What a training run is: `TrainConfig` and its field checks, the model and optimizer it
implies (`model_config`, `make_optimizer`), which fields a resumed run may change, and the
checks of a run against the machine (`check_devices`; memory: `gtp_jax.train.step.memory`)
done before anything is built."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gtp_jax.base.config import FP8_COMPUTE_RECIPES, GTPConfig, check_patterns
from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.data import VOCAB_SIZE
from gtp_jax.models import TransformerConfig, preset
from gtp_jax.models.attention import cudnn_unsupported, resolve_attention_impl
from gtp_jax.models.hf import read_config
from gtp_jax.sharding.offload import StreamableChain
from gtp_jax.train.step import optim
from gtp_jax.train.step.lr_defaults import (
    LrDefaults,
    default_warmup,
    describe_warmup,
    lr_defaults,
)
from gtp_jax.train.step.optim import check_optimizer_settings
from gtp_jax.train.user_model import UserModel, check_spec

#: TrainConfig fields that only change the layout or the schedule of the computation, not
#: its math: a resumed run may change them. Every other field (including fields added
#: later) must equal the checkpoint's. ``steps`` may grow: that extends a run (see
#: `TrainConfig.schedule_steps`).
RESUME_MAY_DIFFER = frozenset({"steps", "dp", "gtp", "tp", "ep", "cp", "pad_for_alignment",
                               "gather_dtype", "reduce_dtype", "gather_format", "prefetch",
                               "keep_gathered_layers", "coalesce_layer_collectives",
                               "remat", "overlap",
                               "attention", "unroll_layers", "export_hf", "eval_every",
                               "eval_batches", "offload_optimizer", "offload_exclude",
                               "fp8_compute", "fp8_min_features", "grad_accum"})
#: TrainConfig fields that only spell the bundled decoder's shape: a resumed run compares the
#: model they resolve to (`model_differences`), not the fields. A run of a preset's depth
#: saved with ``layers=None`` resumes with ``layers`` set to that depth, e.g. after the
#: preset's own depth changed.
COMPARED_AS_MODEL = frozenset({"layers"})
#: Fields whose default, "auto", is resolved for the backend (`resolve_auto`): the fast path
#: on GPUs, exact float32 on CPUs. A resumed run keeps the saved run's values for those left
#: on "auto" (`adopt_saved`).
AUTO_FIELDS = ("dtype", "gather_dtype", "remat")
#: TransformerConfig fields that only change how the model is computed, not its math.
#: Model options that change how the step computes, not what: a run may resume with others.
MODEL_MAY_DIFFER = frozenset({"remat", "tp_overlap", "attention_impl", "unroll_layers",
                              "swiglu_backend", "cp_attention_backend"})
#: Tokens of one step's batch the loss can count (`gtp_jax.models.cross_entropy`: int32).
MAX_TOKENS_PER_STEP = 2**31 - 1
_GATHER_FORMATS = (None, "fp8", "mxfp8", "nvfp4")
_REMAT = ("auto", "none", "dots", "full")
_ATTENTION = ("auto", "cudnn", "xla")
#: `TrainConfig` fields that describe the bundled decoder: with `TrainConfig.model` each must
#: keep its default (the value, and why it does not apply to a user's module).
PRESET_ONLY = {
    "preset": ("tiny", "a preset is the bundled decoder's size"),
    "layers": (None, "it sets the bundled decoder's depth"),
    "moe_experts": (0, "it sets the bundled decoder's experts"),
    "moe_top_k": (2, "it sets the bundled decoder's routing"),
    "moe_capacity_factor": (1.25, "it sets the bundled decoder's expert capacity"),
    "attention": ("auto", "it picks the bundled decoder's attention kernel"),
    "unroll_layers": (None, "it picks the bundled decoder's layer loop (for your blocks: "
                      "gtp_jax.Stack(..., unroll=False) in the factory)"),
    "overlap": (False, "it rings the bundled decoder's tensor-parallel matmuls"),
    "init_from_hf": (None, "a Hugging Face checkpoint loads into the bundled Llama-shaped "
                     "decoder only"),
    "export_hf": (None, "the Hugging Face export writes the bundled Llama-shaped decoder "
                  "only"),
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
      preset: model preset name (`gtp_jax.models.PRESETS`); its vocabulary is replaced by
        `vocab_size`.
      model: your own model instead of a preset: ``"package.module:factory"``, a function
        ``factory(rngs, sizes)`` returning an ``nnx.Module`` (and optionally a loss;
        `gtp_jax.train.user_model`, docs/your_model.md). The fields that describe the
        bundled decoder (`PRESET_ONLY`) must keep their defaults; None: the preset.
      layers: the preset's number of layers replaced (a deeper or shallower model of the
        same width); None: the preset's.
      steps: optimizer steps (the whole run; a resumed run continues up to it).
      batch_size: global batch (sequences), split over the mesh's data axes; a multiple of
        ``dp * ep * gtp``.
      seq_len: tokens per sequence.
      dp, gtp, tp, ep: mesh sizes (their product, times `cp`, must equal the device count).
      cp: context-parallel size: each sequence is split over ``cp`` devices and attention
        runs as ring attention (`gtp_jax.parallel.context`); 1: off.
      lr: peak AdamW learning rate (of the `lr_schedule`); None: the preset's own
        (`gtp_jax.train.step.lr_defaults`: 3e-3 for tiny down to 5e-6 for llama3-70b; 3e-3
        for an `init_from_hf` model or a user's `model`), fixed when the run starts and
        recorded in its
        checkpoints (`peak_lr`; a resumed run keeps its checkpoint's).
      warmup: warm-up steps: step k <= warmup trains at ``lr * k / warmup``; None: the
        preset's share of the schedule's steps (a tenth to a half), at most its maximum (10
        for tiny, small and 100m,
        up to 400 for llama3-70b; `gtp_jax.train.step.lr_defaults`), fixed when the run
        starts and recorded in its checkpoints. Must leave at least one step of the
        schedule to decay in (the constant schedule: at most its steps).
      weight_decay: AdamW decoupled weight decay.
      lr_schedule: "cosine" (warm-up, cosine decay to 10% of `lr`), "linear" (warm-up,
        linear decay to 10%), "wsd" (warm-up, stable, linear decay to 10% over the last
        `decay_steps`) or "constant" (warm-up, then `lr`); `gtp_jax.train.step.optim`.
      decay_steps: steps of the decay; None: the steps after the warm-up (cosine, linear),
        the last 20% of them (wsd).
      clip_grad_norm: clip the gradients to this global L2 norm before the update; 0: off.
      adam_b1, adam_b2, adam_eps: AdamW's moment decay rates and epsilon.
      grad_accum: microbatches per optimizer step: the step scans over `grad_accum` slices
        of the batch, sums their gradients and updates once (activations of one microbatch
        live at a time; the same losses as one step on the whole batch, to float
        rounding, for dense models; MoE capacity and load-balancing loss are per
        microbatch). `batch_size` must be a multiple of ``grad_accum * dp * ep * gtp``.
      seed: parameter init and data-order seed.
      dtype: compute dtype ("float32", "bfloat16", or "auto": bfloat16 on GPUs, float32
        elsewhere); master weights stay float32.
      gather_dtype: dtype weights are all-gathered in ("float32", "bfloat16", None: the
        parameter dtype, or "auto": the compute dtype when it is bfloat16 (the same values,
        half the bytes), else the parameter dtype).
      reduce_dtype: `GTPConfig.reduce_dtype`: the dtype weight gradients are reduce-scattered
        (summed over the GTP axis) in: "float32" (the default, as torchtitan and
        Megatron-LM) or "bfloat16" (half the bytes; the sum is rounded to bfloat16 at each
        hop, so it drifts from the unsharded model's gradients).
      pad_for_alignment: `GTPConfig.pad_for_alignment`.
      remat: `TransformerConfig.remat`, or "auto": "dots" on GPUs, "none" elsewhere.
      attention: `TransformerConfig.attention_impl` ("auto": cuDNN's fused attention on a
        GPU where it applies, else XLA's; "cudnn"; "xla").
      unroll_layers: `TransformerConfig.unroll_layers` (None: unrolled unless remat "full"
        or FP8 compute, whose unrolled program compiles 10x longer: `layer_loop_unrolled`).
      gather_format: `GTPConfig.gather_format` (None, "fp8", "mxfp8" or "nvfp4").
      fp8_compute: `GTPConfig.fp8_compute` (None, "tensorwise" or "delayed": the decoder's
        projections compute in FP8; emulated exactly on CPUs).
      fp8_min_features: `GTPConfig.fp8_min_features` (None: its default).
      prefetch: `GTPConfig.prefetch` (the scanned loop's double buffering; the unrolled loop
        always gathers one layer ahead).
      keep_gathered_layers: `GTPConfig.keep_gathered_layers`: the backward pass reuses the
        forward pass's gathered weights instead of gathering each layer again (every
        layer's gathered weights held through the step; same numbers).
      coalesce_layer_collectives: `GTPConfig.coalesce_layer_collectives`: one all-gather
        and one reduce-scatter per layer instead of one per weight (default; False: one
        per weight).
      offload_optimizer: `GTPConfig.offload_optimizer` (optimizer state in host memory).
      offload_exclude: `GTPConfig.offload_exclude` (regular expressions on parameter paths,
        e.g. ``"blocks/mlp/down"``, whose optimizer state stays on the device).
      offload_master_weights: `GTPConfig.offload_master_weights` (with
        ``offload_optimizer``: the float32 parameters in host memory too, bfloat16 ones on
        the device).
      overlap: ring collective matmuls for the tp GEMMs (`TransformerConfig.tp_overlap`).
      moe_experts: experts per MoE layer (0: dense MLP); `moe_top_k`, `moe_capacity_factor`
        (None: dropless) as in `TransformerConfig`.
      schedule_steps: length of the LR schedule (warm-up + decay to 10% of `lr` on its last
        step); None: `steps`. Steps past it train at the final LR (10% of `lr`; `lr` with
        the constant schedule). A run that is extended (resumed with a larger `steps`) keeps
        the schedule_steps (and warm-up) recorded in its checkpoint, so an extended run
        equals an uninterrupted run with ``steps=<new steps>, schedule_steps=<original
        steps>``.
      schedule_version: how the schedule maps steps to rates
        (`gtp_jax.train.step.optim.SCHEDULE_VERSION`); None: the current one, 2. A resumed run
        keeps its checkpoint's, and a checkpoint without one was written by version 1
        (step 1 at rate 0; see `gtp_jax.train.step.optim`).
      init_from_hf: a Hugging Face Llama-family checkpoint directory
        (`gtp_jax.models.from_hf`): the model's shape comes from its config.json (`preset`
        is not used) and its weights replace the random init; None: a random `preset`.
      init_from: a `train` checkpoint directory whose newest intact checkpoint's weights
        replace the random init of a new run (a warm start, `gtp_jax.train.lifecycle.warm_start`):
        any mesh, the model shape must match, the optimizer starts fresh and every other
        field is this run's. Ignored when the run resumes from its own checkpoint.
      export_hf: write the trained model there as a Hugging Face checkpoint
        (`gtp_jax.models.to_hf`) at the end of the run; None: no export.
      vocab_size: the model's vocabulary; None: the data's (256 byte tokens for the bundled
        corpus; `train` sets the tokenizer's for `gtp_jax.data.TextData`).
      eval_every: report the loss on held-out data after every `eval_every` steps and after
        the last one; 0: never.
      eval_batches: held-out batches (of `batch_size` sequences) per evaluation, the same
        ones every time.

    Raises:
      UsageError / UsageTypeError: a field of the wrong type or out of range (non-positive
        or non-finite LR, negative warm-up or weight decay, unknown preset, ...).
    """

    preset: str = "tiny"
    model: str | None = None
    layers: int | None = None
    steps: int = 100
    batch_size: int = 16
    seq_len: int = 128
    dp: int = 2
    gtp: int = 4
    tp: int = 1
    ep: int = 1
    cp: int = 1
    lr: float | None = None
    warmup: int | None = None
    weight_decay: float = 0.1
    seed: int = 0
    dtype: str = "auto"
    gather_dtype: str | None = "auto"
    reduce_dtype: str = "float32"
    pad_for_alignment: int = 0
    remat: str = "auto"
    attention: str = "auto"
    unroll_layers: bool | None = None
    gather_format: str | None = None
    fp8_compute: str | None = None
    fp8_min_features: int | None = None
    prefetch: bool = False
    keep_gathered_layers: bool = False
    coalesce_layer_collectives: bool = True
    offload_optimizer: bool = False
    offload_exclude: tuple[str, ...] = ()
    offload_master_weights: bool = False
    overlap: bool = False
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float | None = 1.25
    schedule_steps: int | None = None
    schedule_version: int | None = None
    init_from_hf: str | None = None
    init_from: str | None = None
    export_hf: str | None = None
    vocab_size: int | None = None
    eval_every: int = 0
    eval_batches: int = 4
    lr_schedule: str = "cosine"
    decay_steps: int | None = None
    clip_grad_norm: float = 1.0
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    grad_accum: int = 1

    def __post_init__(self) -> None:
        # Every field is checked for type and range, so nothing silently trains wrong.
        for name, minimum in (("steps", 1), ("batch_size", 1), ("seq_len", 1), ("dp", 1),
                              ("gtp", 1), ("tp", 1), ("ep", 1), ("cp", 1),
                              ("seed", 0), ("pad_for_alignment", 0), ("moe_experts", 0),
                              ("moe_top_k", 1), ("eval_every", 0), ("eval_batches", 1),
                              ("grad_accum", 1)):
            _check_int(name, getattr(self, name), minimum)
        for name, minimum in (("schedule_steps", 1), ("warmup", 0), ("schedule_version", 1)):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum)
        for name in ("vocab_size", "layers"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if self.lr is not None:
            _check_float("lr", self.lr, positive=True)
        _check_float("weight_decay", self.weight_decay, positive=False)
        if self.moe_capacity_factor is not None:
            _check_float("moe_capacity_factor", self.moe_capacity_factor, positive=True)
        from gtp_jax.models import PRESETS  # noqa: PLC0415

        if self.preset not in PRESETS:
            raise UsageError(f"TrainConfig.preset={self.preset!r}: use one of {sorted(PRESETS)}.")
        for name, allowed in (("dtype", ("auto", "float32", "bfloat16")),
                              ("gather_dtype", ("auto", None, "float32", "bfloat16")),
                              ("reduce_dtype", ("float32", "bfloat16")),
                              ("gather_format", _GATHER_FORMATS), ("remat", _REMAT),
                              ("fp8_compute", FP8_COMPUTE_RECIPES),
                              ("attention", _ATTENTION)):
            if getattr(self, name) not in allowed:
                raise UsageError(f"TrainConfig.{name}={getattr(self, name)!r}: use one of "
                                 f"{list(allowed)}.")
        for name in ("prefetch", "keep_gathered_layers", "coalesce_layer_collectives",
                     "overlap", "offload_optimizer", "offload_master_weights"):
            if not isinstance(getattr(self, name), bool):
                raise UsageTypeError(f"TrainConfig.{name}={getattr(self, name)!r} must be a bool.")
        exclude = self.offload_exclude
        exclude = (exclude,) if isinstance(exclude, str) else exclude
        if not isinstance(exclude, (tuple, list)) or not all(isinstance(p, str) for p in exclude):
            raise UsageTypeError(f"TrainConfig.offload_exclude={self.offload_exclude!r} must be "
                                 "a sequence of regular expressions, e.g. ('blocks/mlp/down',).")
        object.__setattr__(self, "offload_exclude",
                           check_patterns("TrainConfig.offload_exclude", exclude))
        if self.offload_exclude and not self.offload_optimizer:
            raise UsageError(f"TrainConfig.offload_exclude={self.offload_exclude!r} needs "
                             "TrainConfig.offload_optimizer (it keeps some of an offloaded "
                             "optimizer state on the device); set it or drop "
                             "TrainConfig.offload_exclude.")
        if self.offload_master_weights and not self.offload_optimizer:
            raise UsageError("TrainConfig.offload_master_weights moves the float32 parameters "
                             "to host memory with the optimizer state; it needs "
                             "TrainConfig.offload_optimizer: set it or drop "
                             "TrainConfig.offload_master_weights.")
        if self.unroll_layers is not None and not isinstance(self.unroll_layers, bool):
            raise UsageTypeError(f"TrainConfig.unroll_layers={self.unroll_layers!r} must be "
                                 "True, False or None (unrolled unless remat 'full').")
        if self.moe_experts and self.moe_top_k > self.moe_experts:
            raise UsageError(
                f"TrainConfig.moe_top_k={self.moe_top_k} must be <= TrainConfig.moe_experts="
                f"{self.moe_experts} (each token is routed to top_k distinct experts)."
            )
        for name in ("init_from_hf", "init_from", "export_hf"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise UsageTypeError(f"TrainConfig.{name}={getattr(self, name)!r} must be a "
                                     "directory path (str) or None.")
        if self.init_from_hf is not None and self.init_from is not None:
            raise UsageError("TrainConfig.init_from and TrainConfig.init_from_hf both set the "
                             "initial weights; pass one of them.")
        if self.init_from is not None and self.offload_master_weights:
            # The weights are loaded into the built model, after its optimizer took the
            # float32 master from the initial values: the master would stay those.
            raise UsageError("TrainConfig.init_from with TrainConfig.offload_master_weights: "
                             "starting from another run's weights is not supported with "
                             "master weights in host memory; drop one of them.")
        if self.init_from_hf is not None and self.preset != PRESET_ONLY["preset"][0]:
            raise UsageError(
                f"TrainConfig.init_from_hf with preset={self.preset!r}: the checkpoint's "
                "config.json gives the model; drop preset.")
        if self.init_from_hf is not None and self.layers is not None:
            raise UsageError(
                f"TrainConfig.init_from_hf with layers={self.layers}: the checkpoint's "
                "config.json gives the number of layers; drop layers.")
        if self.export_hf is not None and self.moe_experts:
            raise UsageError(
                f"TrainConfig.export_hf with moe_experts={self.moe_experts}: the Hugging Face "
                "export writes a Llama checkpoint, whose MLP is dense; drop one of them.")
        if self.init_from_hf is not None and self.moe_experts:
            raise UsageError(
                f"TrainConfig.init_from_hf with moe_experts={self.moe_experts}: a Hugging Face "
                "Llama checkpoint has a dense MLP; drop moe_experts.")
        if self.model is not None:
            check_spec(self.model)  # its form; the module is imported when the run resolves
            for name, (default, why) in PRESET_ONLY.items():
                if getattr(self, name) != default:
                    raise UsageError(
                        f"TrainConfig.{name}={getattr(self, name)!r} with TrainConfig.model: "
                        f"{why}; drop TrainConfig.{name} (your factory builds the model).")
        check_optimizer_settings(lr_schedule=self.lr_schedule, warmup=self.lr_warmup,
                                 schedule_steps=self.lr_schedule_steps,
                                 decay_steps=self.decay_steps,
                                 clip_grad_norm=self.clip_grad_norm, adam_b1=self.adam_b1,
                                 adam_b2=self.adam_b2, adam_eps=self.adam_eps,
                                 version=self.lr_schedule_version,
                                 check_warmup=self.schedule_steps is not None)
        if self.batch_size * self.seq_len > MAX_TOKENS_PER_STEP:
            raise UsageError(
                f"TrainConfig.batch_size={self.batch_size} x TrainConfig.seq_len={self.seq_len}"
                f" = {self.batch_size * self.seq_len} tokens per step: at most "
                f"{MAX_TOKENS_PER_STEP} (the loss counts them in int32); lower "
                "TrainConfig.batch_size or TrainConfig.seq_len.")
        shards = self.dp * self.ep * self.gtp
        fit = max(shards, self.batch_size // shards * shards)
        if self.batch_size % shards:
            raise UsageError(
                f"TrainConfig.batch_size={self.batch_size} must be a multiple of dp*ep*gtp = "
                f"{self.dp}*{self.ep}*{self.gtp} = {shards} (the batch is split over those "
                f"axes); e.g. TrainConfig.batch_size={fit}."
            )
        if self.batch_size % (shards * self.grad_accum):
            fit = max(shards * self.grad_accum,
                      self.batch_size // (shards * self.grad_accum) * shards * self.grad_accum)
            raise UsageError(
                f"TrainConfig.batch_size={self.batch_size} with TrainConfig.grad_accum="
                f"{self.grad_accum} must be a multiple of grad_accum*dp*ep*gtp = "
                f"{self.grad_accum}*{shards} (each microbatch is split over the data axes); "
                f"e.g. TrainConfig.batch_size={fit}, or a grad_accum that divides "
                f"{self.batch_size // shards}."
            )

    @property
    def auto_fields(self) -> frozenset[str]:
        """The `AUTO_FIELDS` left on "auto"."""
        return frozenset(f for f in AUTO_FIELDS if getattr(self, f) == "auto")

    @property
    def lr_schedule_steps(self) -> int:
        """The LR schedule's length: `schedule_steps`, or `steps` when it is None."""
        return self.schedule_steps if self.schedule_steps is not None else self.steps

    @property
    def lr_defaults(self) -> LrDefaults:
        """The schedule defaults of this run's model: its preset's, or the generic ones for
        an `init_from_hf` model or a user's (`model`; `gtp_jax.train.step.lr_defaults`)."""
        other = self.init_from_hf is not None or self.model is not None
        return lr_defaults(None if other else self.preset)

    @property
    def peak_lr(self) -> float:
        """The peak learning rate: `lr`, or the model's default (`lr_defaults`) when None."""
        return self.lr if self.lr is not None else self.lr_defaults.lr

    @property
    def lr_warmup(self) -> int:
        """The warm-up: `warmup`, or the model's default for the schedule's length when it is
        None (the preset's share of it, at most the preset's maximum: `lr_defaults`)."""
        return self.warmup if self.warmup is not None else default_warmup(
            self.lr_schedule_steps, self.lr_defaults)

    @property
    def lr_schedule_version(self) -> int:
        """`schedule_version`, or the current `gtp_jax.train.step.optim.SCHEDULE_VERSION`."""
        return (self.schedule_version if self.schedule_version is not None
                else optim.SCHEDULE_VERSION)

    def with_schedule(self) -> TrainConfig:
        """This config with its schedule fixed: `lr`, `schedule_steps`, `warmup` and
        `schedule_version` set to what None stands for now, as a run records them (so a
        later extension, or a later default, does not change the run's schedule).

        Raises:
          UsageError: a warm-up that leaves no step of the schedule to decay in (checked
            here, once the schedule's length is known: a resumed run keeps its own).
        """
        return dataclasses.replace(self, lr=self.peak_lr,
                                   schedule_steps=self.lr_schedule_steps,
                                   warmup=self.lr_warmup,
                                   schedule_version=self.lr_schedule_version)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise UsageTypeError(f"TrainConfig.{name}={value!r} must be an int.")
    if value < minimum:
        raise UsageError(f"TrainConfig.{name}={value} must be >= {minimum}.")


def _check_float(name: str, value: Any, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise UsageTypeError(f"TrainConfig.{name}={value!r} must be a number.")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise UsageError(f"TrainConfig.{name}={value} must be finite and {bound}.")


def make_optimizer(cfg: TrainConfig) -> StreamableChain:
    """AdamW with the run's LR schedule and global-norm clipping
    (`gtp_jax.train.step.optim.make_optimizer`).

    The schedule spans `TrainConfig.lr_schedule_steps`; it holds its end value after that,
    which is what extended steps train at.

    The same settings return the same transformation object: it is static data of the
    ``nnx.Optimizer``, so an equal object lets a `TrainStep` reuse its compiled program.
    """
    return optim.make_optimizer(
        float(cfg.peak_lr), int(cfg.lr_warmup), int(cfg.lr_schedule_steps),
        float(cfg.weight_decay),
        schedule=cfg.lr_schedule, decay_steps=cfg.decay_steps,
        clip_grad_norm=float(cfg.clip_grad_norm), b1=float(cfg.adam_b1),
        b2=float(cfg.adam_b2), eps=float(cfg.adam_eps), version=int(cfg.lr_schedule_version))


def resolve_auto(cfg: TrainConfig, backend: str | None = None) -> TrainConfig:
    """`cfg` with its "auto" fields (`AUTO_FIELDS`) set for `backend` (None: JAX's default).

    On GPUs: bfloat16 compute, bfloat16 gathers and remat "dots" (the benchmark's fast
    path); elsewhere float32 compute, gathers in the parameter dtype and no remat (CPU runs
    are for checking, and exact). ``gather_dtype="auto"`` follows the resolved compute dtype:
    bfloat16 gathers move the same values as bfloat16 compute reads, in half the bytes.
    """
    if not cfg.auto_fields:
        return cfg
    gpu = (jax.default_backend() if backend is None else backend) == "gpu"
    dtype = cfg.dtype if cfg.dtype != "auto" else "bfloat16" if gpu else "float32"
    gather = cfg.gather_dtype
    if gather == "auto":
        gather = "bfloat16" if dtype == "bfloat16" else None
    remat = cfg.remat if cfg.remat != "auto" else "dots" if gpu else "none"
    return dataclasses.replace(cfg, dtype=dtype, gather_dtype=gather, remat=remat)


def adopt_saved(cfg: TrainConfig, saved: dict[str, Any], auto: frozenset[str]) -> TrainConfig:
    """`cfg` with the fields in `auto` (left on "auto" by the caller) taken from a saved
    run's config `saved` (a checkpoint's ``train_config``): a resumed run continues with
    the settings it was started with unless told otherwise."""
    changes = {f: saved[f] for f in auto if f in saved and saved[f] != getattr(cfg, f)}
    if not changes:
        return cfg
    try:
        return dataclasses.replace(cfg, **changes)
    except (UsageError, UsageTypeError):
        return cfg  # a value this version does not accept: the resume check names it


@dataclasses.dataclass(frozen=True)
class Run:
    """A training run resolved once: what every stage after the command line reads.

    `resolve` builds it from a `TrainConfig` and the backend; the memory checks, the step,
    the planner and the command line's header read its fields, and a function given a
    `Run` resolves nothing again (given a `TrainConfig`, it resolves that first).

    Attributes:
      config: the `TrainConfig` with its "auto" fields set for `backend` (`resolve_auto`).
      model: the `TransformerConfig` the run trains (`model_config`), or with
        `TrainConfig.model` the `UserModel` (the factory and its sizes).
      gtp: the `GTPConfig` the model is sharded with (`gtp_config`).
      backend: the JAX backend it was resolved for ("gpu", "cpu", ...).
    """

    config: TrainConfig
    model: TransformerConfig | UserModel
    gtp: GTPConfig
    backend: str


def resolve(cfg: TrainConfig | Run, backend: str | None = None) -> Run:
    """`cfg` resolved for `backend` (None: JAX's default): its "auto" fields set, and the
    model and sharding configs it implies. A `Run` is returned as it is.

    Raises:
      UsageError: the model config cannot be built (e.g. an unreadable ``init_from_hf``, a
        `TrainConfig.model` that cannot be imported).
    """
    if isinstance(cfg, Run):
        return cfg
    backend = jax.default_backend() if backend is None else backend
    config = resolve_auto(cfg, backend)
    return Run(config, _model_config(config), _gtp_config(config), backend)


def model_config(cfg: TrainConfig | Run) -> TransformerConfig | UserModel:
    """The `TransformerConfig` that `train` builds for `cfg` (a `TrainConfig` is resolved
    for JAX's default backend first; a `Run` carries it); with `TrainConfig.model`, the
    `UserModel`."""
    return resolve(cfg).model


def layer_loop_unrolled(unroll_layers: bool | None, fp8_compute: str | None) -> bool | None:
    """`TransformerConfig.unroll_layers` for a run: as given, or with FP8 compute the
    scanned loop when none is given. Unrolled, FP8's program compiles in 84 s instead of
    7 s on llama3-8b (2x H200, 2026-11-28) for a 4% faster step; None leaves the choice to
    the model (unrolled unless remat "full")."""
    if unroll_layers is None and fp8_compute is not None:
        return False
    return unroll_layers


def _model_config(cfg: TrainConfig) -> TransformerConfig | UserModel:
    """`model_config` of an already resolved `cfg`."""
    dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
    if cfg.model is not None:
        user = UserModel(cfg.model, vocab_size=cfg.vocab_size or VOCAB_SIZE,
                         seq_len=cfg.seq_len, dtype=dtype, remat=cfg.remat)
        user.abstract()  # imports and calls the factory once: its errors name TrainConfig.model
        return user
    options = dict(dtype=dtype, remat=cfg.remat, tp_overlap=cfg.overlap,
                   attention_impl=cfg.attention,
                   unroll_layers=layer_loop_unrolled(cfg.unroll_layers, cfg.fp8_compute))
    vocab_size = cfg.vocab_size if cfg.vocab_size is not None else VOCAB_SIZE
    if cfg.init_from_hf is not None:
        return _hf_model_config(cfg, options, vocab_size)
    if cfg.layers is not None:
        options["n_layers"] = cfg.layers
    return preset(cfg.preset, vocab_size=vocab_size, max_seq_len=cfg.seq_len,
                  moe_experts=cfg.moe_experts, moe_top_k=cfg.moe_top_k,
                  moe_capacity_factor=cfg.moe_capacity_factor, **options)


def _hf_model_config(cfg: TrainConfig, options: dict[str, Any],
                     data_vocab: int) -> TransformerConfig:
    """The model of `TrainConfig.init_from_hf`: its config.json's shape, `cfg`'s options."""
    model_cfg = read_config(cfg.init_from_hf, **options)
    if cfg.seq_len > model_cfg.max_seq_len:
        raise UsageError(
            f"TrainConfig.seq_len={cfg.seq_len} exceeds the checkpoint's "
            f"max_position_embeddings={model_cfg.max_seq_len} ({cfg.init_from_hf!r}); use "
            "shorter sequences.")
    if model_cfg.vocab_size < data_vocab:
        raise UsageError(
            f"TrainConfig.init_from_hf={cfg.init_from_hf!r}: its vocabulary "
            f"({model_cfg.vocab_size}) is smaller than the data's {data_vocab} tokens; use "
            "the checkpoint's own tokenizer (--tokenizer).")
    return model_cfg


def gtp_config(cfg: TrainConfig | Run) -> GTPConfig:
    """The `GTPConfig` that `train` shards the model with for `cfg` (a `TrainConfig` is
    resolved for JAX's default backend first; a `Run` carries it)."""
    return resolve(cfg).gtp


def _gtp_config(cfg: TrainConfig) -> GTPConfig:
    """`gtp_config` of an already resolved `cfg`."""
    return GTPConfig(gather_dtype=cfg.gather_dtype, reduce_dtype=cfg.reduce_dtype,
                     pad_for_alignment=cfg.pad_for_alignment,
                     gather_format=cfg.gather_format, prefetch=cfg.prefetch,
                     keep_gathered_layers=cfg.keep_gathered_layers,
                     coalesce_layer_collectives=cfg.coalesce_layer_collectives,
                     offload_optimizer=cfg.offload_optimizer,
                     offload_exclude=cfg.offload_exclude,
                     offload_master_weights=cfg.offload_master_weights,
                     fp8_compute=cfg.fp8_compute,
                     **({} if cfg.fp8_min_features is None
                        else {"fp8_min_features": cfg.fp8_min_features}))


def describe_choices(cfg: TrainConfig, model_cfg: TransformerConfig | UserModel) -> str:
    """One line naming how the run computes: compute and gather dtypes, remat, attention,
    layer loop (and whether `TrainConfig.prefetch` applies), e.g. ``compute bfloat16,
    gathers bfloat16, remat dots, attention cudnn, layers unrolled (gathered one ahead)``;
    for a `UserModel`, the remat policy its factory gets, its parameters and its loss
    instead of the decoder's attention and layer loop."""
    own = ("in the parameters' own dtype" if isinstance(model_cfg, UserModel)
           else "float32 (the parameter dtype)")  # a factory builds its own dtypes
    gather = cfg.gather_format or cfg.gather_dtype or own
    if cfg.gather_format and cfg.gtp == 1:
        gather = f"none at gtp=1 (--gather-format {cfg.gather_format} has no effect)"
    offload = ", optimizer state in host memory" if cfg.offload_optimizer else ""
    if cfg.offload_exclude:
        offload += f" (but {', '.join(cfg.offload_exclude)})"
    if cfg.offload_master_weights:
        offload += ", float32 master weights too (bfloat16 on the device)"
    fp8 = ""
    if cfg.fp8_compute is not None:
        emulated = "" if jax.default_backend() == "gpu" else ", emulated on this backend"
        fp8 = f", projections in fp8 ({cfg.fp8_compute}{emulated})"
    reduce = ""
    if cfg.reduce_dtype == "bfloat16":
        # At gtp=1 nothing is reduce-scattered: the layer loop only rounds the gradients.
        reduce = (", gradients reduce-scattered in bfloat16" if cfg.gtp > 1 else
                  ", layer gradients rounded to bfloat16 (nothing is reduce-scattered at "
                  "gtp=1)")
    if isinstance(model_cfg, UserModel):
        loss = ("the next-token loss on its logits" if model_cfg.default_loss
                else "the factory's loss")
        return (f"compute {cfg.dtype}, gathers {gather}{reduce}, remat {model_cfg.remat} "
                f"(handed to the factory), {model_cfg.num_params() / 1e6:.2f}M parameters, "
                f"{loss}{offload}{fp8}")
    if cfg.cp > 1:
        attention = f"ring over cp={cfg.cp}"
    else:
        attention = resolve_attention_impl(model_cfg.attention_impl, model_cfg.dtype,
                                           model_cfg.head_size)
    if model_cfg.unrolled:
        loop = "layers unrolled (gathered one layer ahead)"
        if cfg.prefetch:
            loop += "; prefetch has no further effect there (the scanned loop's option)"
    else:
        loop = "layers scanned"
        if cfg.prefetch:
            loop += (" with prefetch (double-buffered gathers)" if cfg.gtp > 1 else
                     "; prefetch has no effect at gtp=1 (nothing is gathered)")
    if cfg.keep_gathered_layers:
        loop += "; the backward pass reuses the forward pass's gathered weights"
    if cfg.overlap and cfg.tp == 1:
        loop += "; --overlap has no effect at tp=1 (no tensor-parallel matmul to ring)"
    if cfg.gtp > 1:  # at gtp=1 nothing is gathered or reduce-scattered
        loop += ("; one gather and one reduce-scatter per layer" if
                 cfg.coalesce_layer_collectives else "; one gather and reduce-scatter per weight")
    return (f"compute {cfg.dtype}, gathers {gather}{reduce}, remat {model_cfg.remat}, "
            f"attention {attention}, {loop}{offload}{fp8}{describe_moe(model_cfg)}")


def describe_moe(model_cfg: TransformerConfig) -> str:
    """``", MoE 8 experts, top-2, capacity 1.25 ..."``: how a mixture of experts routes,
    and what the progress line's ``dropped`` share is; "" for a dense model."""
    if not model_cfg.moe_experts:
        return ""
    head = f", MoE {model_cfg.moe_experts} experts, top-{model_cfg.moe_top_k}"
    if model_cfg.moe_capacity_factor is None:
        return f"{head}, dropless (every routing choice computed)"
    return (f"{head}, capacity {model_cfg.moe_capacity_factor:g}x an even share per expert: "
            "routing choices beyond it are dropped (the progress line's 'dropped' share; "
            "--moe-capacity 0 is dropless)")


def describe_schedule(cfg: TrainConfig, given: TrainConfig | None = None) -> str:
    """One line naming the run's learning-rate schedule and where its peak LR and warm-up
    come from, e.g. ``lr 0.0003 (the llama3-8b preset's default), warm-up 5 steps (a tenth
    of the steps, at most 100), cosine schedule over 50 steps``.

    Args:
      cfg: the run's config with its schedule fixed (`TrainConfig.with_schedule`; a resumed
        run's with its checkpoint's schedule).
      given: the config the caller passed, whose None `lr` / `warmup` asked for the
        defaults; None: not known (a value equal to the default is named as the default).
    """
    defaults = cfg.lr_defaults
    lr, warmup = cfg.peak_lr, cfg.lr_warmup
    lr_text, warmup_text = f"lr {lr:g}", f"warm-up {warmup} steps"
    if given is None or given.lr is None:
        if lr == defaults.lr:
            lr_text += f" ({defaults.origin})"
        elif given is not None:  # a default that is not today's: the resumed run's
            lr_text += " (kept from the checkpoint)"
    if given is None or given.warmup is None:
        if warmup == default_warmup(cfg.lr_schedule_steps, defaults):
            warmup_text += f" ({describe_warmup(defaults)})"
        elif given is not None:
            warmup_text += " (kept from the checkpoint)"
    return (f"{lr_text}, {warmup_text}, {cfg.lr_schedule} schedule over "
            f"{cfg.lr_schedule_steps} steps")


def model_json(model_cfg: TransformerConfig | UserModel) -> dict[str, Any]:
    """`model_cfg` as JSON values (dtypes by name): what checkpoints and metrics record."""
    out = {}
    for field in dataclasses.fields(model_cfg):
        value = getattr(model_cfg, field.name)
        out[field.name] = (value if isinstance(value, (int, float, str, bool, type(None)))
                           else str(np.dtype(value)))
    return out


def model_differences(model_cfg: TransformerConfig | UserModel, saved: dict[str, Any],
                      may_differ: frozenset[str]) -> list[str]:
    """``"model <field>: checkpoint <saved> vs now <value>"`` for each field of `model_cfg`
    (`model_json`) that differs from a checkpoint's recorded model `saved` and is not in
    `may_differ`. A field the checkpoint lacks was added later: its default is what that run
    used. A checkpoint of the other kind (a preset's decoder against a `UserModel`, or the
    reverse) differs in one line that says so."""
    now = model_json(model_cfg)
    user_now, user_saved = isinstance(model_cfg, UserModel), "factory" in saved
    if user_now != user_saved:
        what = {True: f"TrainConfig.model {saved.get('factory')!r}",
                False: "the bundled decoder"}
        return [f"model: checkpoint {what[user_saved]} vs now "
                f"{what[user_now] if not user_now else repr(model_cfg.factory)}"]
    defaults = model_json(dataclasses.replace(
        model_cfg, **{f.name: f.default for f in dataclasses.fields(model_cfg)
                      if f.name not in saved and f.default is not dataclasses.MISSING}))
    saved = {**defaults, **saved}
    return [f"model {k}: checkpoint {saved.get(k)!r} vs now {now[k]!r}" for k in now
            if k not in may_differ and saved.get(k) != now[k]]


def check_devices(run: TrainConfig | Run, devices: int | None = None) -> None:
    """The mesh fits the devices and the model splits over tp and ep (checked here, before
    anything is built, so the error names the configuration rather than a weight).

    `devices`: the device count the run will see (None: ``jax.device_count()``); given with
    a resolved `Run`, nothing here starts a JAX backend (a launcher checks its processes'
    run before starting them)."""
    run = resolve(run)
    cfg, model_cfg = run.config, run.model
    if isinstance(model_cfg, UserModel):
        _check_user_devices(cfg, model_cfg, devices)
        return
    widths = {"n_heads": model_cfg.n_heads, "d_ff": model_cfg.d_ff}
    if model_cfg.moe_experts:
        widths["moe_d_ff"] = model_cfg.moe_d_ff or model_cfg.d_ff
    bad = [f"{name}={width}" for name, width in widths.items()
           if cfg.tp > 1 and width % cfg.tp]
    if bad:
        raise UsageError(
            f"TrainConfig.tp={cfg.tp} does not divide the {cfg.preset} preset's "
            f"{', '.join(bad)}; choose a TrainConfig.tp that divides them (tp={cfg.tp} splits "
            "the heads and the MLP width)."
        )
    if cfg.ep > 1 and model_cfg.moe_experts % cfg.ep:
        raise UsageError(
            f"TrainConfig.ep={cfg.ep} does not divide TrainConfig.moe_experts="
            f"{model_cfg.moe_experts}; choose an ep that divides the expert count."
        )
    if cfg.cp > 1 and model_cfg.moe_experts:
        raise UsageError(
            f"TrainConfig.cp={cfg.cp} with TrainConfig.moe_experts={model_cfg.moe_experts}: "
            "context parallelism does not support MoE layers yet (expert capacity is per "
            "sequence); use cp=1 or a dense model.")
    if cfg.cp > 1 and cfg.attention == "cudnn":
        # Ring attention computes each block itself: cuDNN would be silently unused.
        raise UsageError(
            f"TrainConfig.attention='cudnn' does not apply with TrainConfig.cp={cfg.cp}: "
            "attention runs as ring attention over cp (with its own block kernels); use "
            "'auto' or 'xla'.")
    if cfg.cp == 1 and cfg.attention == "cudnn":
        reason = cudnn_unsupported(model_cfg.dtype, model_cfg.head_size, run.backend)
        if reason is not None:
            raise UsageError(f"TrainConfig.attention='cudnn' does not apply here: {reason}; "
                             "use 'auto' (cuDNN where it applies) or 'xla'.")
    _check_device_count(cfg, devices)


def _check_user_devices(cfg: TrainConfig, user: UserModel, devices: int | None) -> None:
    """`check_devices` of a run of a `UserModel`: the mesh, and cp only for a module that
    splits its inputs over it."""
    if cfg.cp > 1 and not user.has_input_layout():
        name = type(user.abstract()).__name__
        raise UsageError(
            f"TrainConfig.cp={cfg.cp} with TrainConfig.model: {name} has no "
            "gtp_input_layout, so every cp rank would compute the whole sequence; give it "
            "one (docs/context_parallel.md) or use cp=1.")
    _check_device_count(cfg, devices)


def _check_device_count(cfg: TrainConfig, devices: int | None) -> None:
    total = cfg.dp * cfg.ep * cfg.gtp * cfg.cp * cfg.tp
    devices = jax.device_count() if devices is None else devices
    if total != devices:
        raise UsageError(
            f"the mesh dp*ep*gtp*cp*tp = {cfg.dp}*{cfg.ep}*{cfg.gtp}*{cfg.cp}*{cfg.tp} = "
            f"{total} must equal the {devices} devices; choose TrainConfig.dp/ep/gtp/cp/tp "
            f"whose product is {devices}."
        )
