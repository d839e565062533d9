"""Command line: ``python -m gtp_jax train [options]``.

On a machine without accelerators the mesh is simulated with
``--xla_force_host_platform_device_count`` (set here, before JAX starts a backend); on a GPU
host the same command uses the GPUs. With ``--coordinator/--num-processes/--process-id``
the same command runs as one of several JAX processes (`gtp_jax.train.processes.distributed`).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from gtp_jax.base.compile_cache import HELP as COMPILE_CACHE_HELP
from gtp_jax.base.compile_cache import OFF as COMPILE_CACHE_OFF
from gtp_jax.base.compile_cache import compile_cache_dir, use_compile_cache
from gtp_jax.base.errors import UsageError
from gtp_jax.base.xla_flags import (
    MAX_SIMULATED_DEVICES,
    request_deterministic,
    simulate_cpu_devices,
)
from gtp_jax.train.cli.job_file import PathArg, expand_job_file
from gtp_jax.train.step.optim import LR_SCHEDULES

#: ``planner(cfg, fixed layout fields, memory GiB or None) -> laid-out cfg`` (``--plan auto``).
Planner = Callable[[Any, dict[str, Any], "float | None"], Any]

DEFAULT_CPU_MESH = {"dp": 2, "gtp": 4, "tp": 1, "ep": 1, "cp": 1}

#: Library argument names -> the flags that set them. The library's errors name arguments
#: (it is used without this CLI too); the CLI reports them as the flags the user typed.
FLAGS = {
    "TrainConfig.preset": "--preset", "TrainConfig.model": "--model",
    "TrainConfig.steps": "--steps",
    "TrainConfig.batch_size": "--batch", "TrainConfig.seq_len": "--seq",
    "TrainConfig.dp": "--dp", "TrainConfig.gtp": "--gtp", "TrainConfig.tp": "--tp",
    "TrainConfig.ep": "--ep", "TrainConfig.cp": "--cp", "TrainConfig.lr": "--lr",
    "TrainConfig.warmup": "--warmup",
    "TrainConfig.seed": "--seed", "TrainConfig.dtype": "--dtype",
    "TrainConfig.gather_dtype": "--gather-dtype", "TrainConfig.reduce_dtype": "--reduce-dtype",
    "TrainConfig.gather_format": "--gather-format",
    "TrainConfig.fp8_compute": "--fp8-compute", "GTPConfig.fp8_compute": "--fp8-compute",
    "GTPConfig.fp8_min_features": "--fp8-min-features",
    "GTPConfig.gather_format": "--gather-format", "GTPConfig.prefetch": "--prefetch",
    "GTPConfig.keep_gathered_layers": "--keep-gathered-layers",
    "TrainConfig.keep_gathered_layers": "--keep-gathered-layers",
    "GTPConfig.coalesce_layer_collectives": "--[no-]coalesce-layer-collectives",
    "TrainConfig.coalesce_layer_collectives": "--[no-]coalesce-layer-collectives",
    "GTPConfig.pad_for_alignment": "--pad-for-alignment",
    "GTPConfig.offload_optimizer": "--[no-]offload-optimizer",
    "GTPConfig.offload_exclude": "--offload-exclude",
    "GTPConfig.offload_master_weights": "--offload-master-weights",
    "GTPConfig.fp8_include": "fp8_include (no flag)",
    "GTPConfig.fp8_exclude": "fp8_exclude (no flag)",
    "GTPConfig.fp8_history_len": "fp8_history_len (no flag; 16)",
    "TrainConfig.fp8_min_features": "--fp8-min-features",
    "TrainConfig.overlap": "--overlap", "TrainConfig.moe_experts": "--moe-experts",
    "TrainConfig.moe_top_k": "--moe-top-k", "TrainConfig.moe_capacity_factor": "--moe-capacity",
    "TrainConfig.prefetch": "--prefetch", "TrainConfig.pad_for_alignment": "--pad-for-alignment",
    "TrainConfig.remat": "--remat", "TrainConfig.weight_decay": "--weight-decay",
    "TrainConfig.lr_schedule": "--lr-schedule", "TrainConfig.decay_steps": "--decay-steps",
    "TrainConfig.clip_grad_norm": "--clip-grad-norm", "TrainConfig.adam_b1": "--adam-b1",
    "TrainConfig.adam_b2": "--adam-b2", "TrainConfig.adam_eps": "--adam-eps",
    "TrainConfig.grad_accum": "--grad-accum", "TrainConfig.layers": "--layers",
    "ObserveConfig.log_dir": "--log-dir", "ObserveConfig.log_every": "--log-every",
    "TrainConfig.attention": "--attention",
    "TrainConfig.offload_optimizer": "--[no-]offload-optimizer",
    "TrainConfig.offload_exclude": "--offload-exclude",
    "TrainConfig.offload_master_weights": "--offload-master-weights",
    "TrainConfig.unroll_layers": "--[no-]unroll-layers",
    "TrainConfig.schedule_steps": "schedule_steps (no flag; kept from the checkpoint)",
    "TrainConfig.schedule_version": "schedule_version (no flag; kept from the checkpoint)",
    "TrainConfig.init_from_hf": "--init-from-hf", "TrainConfig.export_hf": "--export-hf",
    "TrainConfig.init_from": "--init-from",
    "CheckpointConfig.directory": "--checkpoint-dir",
    "CheckpointConfig.every": "--checkpoint-every",
    "CheckpointConfig.keep": "--keep-checkpoints", "CheckpointConfig.resume": "--resume",
    "ObserveConfig.profile_dir": "--profile-dir", "ObserveConfig.profile_steps": "--profile-steps",
    "ObserveConfig.metrics_json": "--metrics-json",
    "DistributedConfig.coordinator": "--coordinator",
    "DistributedConfig.num_processes": "--num-processes",
    "DistributedConfig.process_id": "--process-id",
    "DistributedConfig.local_device_ids": "--local-device-ids",
    "DistributedConfig.auto": "--distributed-auto", "DistributedConfig.timeout":
    "--distributed-timeout", "DistributedConfig.heartbeat_timeout": "--heartbeat-timeout",
    "SimulatedFailure.step": "--simulate-failure step",
    "SimulatedFailure.devices": "--simulate-failure device",
    "SimulatedFailure.tp_spares": "--tp-spares", "SimulatedFailure.axis": "--ntp-axis",
    "TextData.paths": "--data", "TextData.tokenizer": "--tokenizer",
    "TextData.field": "--data-field", "TextData.val_paths": "--val-data",
    "TextData.val_fraction": "--val-fraction", "TextData.cache_dir": "--data-cache",
    "TrainConfig.eval_every": "--eval-every", "TrainConfig.eval_batches": "--eval-batches",
    "TrainConfig.vocab_size": "vocab_size (no flag; the tokenizer's)",
}
_ARGUMENT = re.compile(r"\b(?:TrainConfig|CheckpointConfig|ObserveConfig|DistributedConfig"
                       r"|SimulatedFailure|TextData|GTPConfig)\.\w+")
#: ``SimulatedFailure(step=30, devices=[5, 6])`` (the spec an error is about) -> its flag.
_SPEC = re.compile(r"\bSimulatedFailure\(step=(\d+), devices=\[([\d, ]*)\]\)")
#: Simulated CPU devices when a mesh size is left out (see `_cpu_mesh`).
CPU_DEVICES = 8


#: A flag's library value None, as the command line spells it (else: "not given").
_NONE_AS = {"--moe-capacity": "0 (dropless)"}
#: ``--flag: checkpoint <value> vs now <value>`` (a resumed run's differences).
_DIFFERS = re.compile(r"(--[\w\[\]-]+): checkpoint (.+?) vs now (.+?)(?=; |\)\. |$)")
_WORD = re.compile(r"'([\w.+-]+)'")


def _as_typed(flag: str, value: str) -> str:
    """A library value as the command line spells it for `flag`: None as its flag's meaning
    (`_NONE_AS`) or "not given", a quoted word bare."""
    if value == "None":
        return _NONE_AS.get(flag, "not given")
    return _WORD.fullmatch(value).group(1) if _WORD.fullmatch(value) else value


def cli_message(err: BaseException) -> str:
    """`err`'s message on one line, with library argument names replaced by their flags
    and the values a resumed run compares spelled as typed."""
    text = " ".join(str(err).split()).replace("CheckpointConfig.resume='auto'",
                                              "--resume auto")
    text = _SPEC.sub(lambda m: "--simulate-failure step=" + m.group(1) + "".join(
        f",device={d.strip()}" for d in m.group(2).split(",")), text)
    text = _ARGUMENT.sub(lambda m: FLAGS.get(m.group(0), m.group(0)), text)
    return _DIFFERS.sub(lambda m: f"{m.group(1)}: checkpoint {_as_typed(m.group(1), m.group(2))}"
                        f" vs now {_as_typed(m.group(1), m.group(3))}", text)


def _fail(err: BaseException, code: int) -> int:
    print(f"error: {cli_message(err)}", file=sys.stderr)
    return code


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes (an unknown flag, ``--lr abc``) are one line, ``error: ...``
    naming the flag, with exit status 2, instead of the whole usage text.

    Flags are matched only as spelled in full: argparse's abbreviations (``--conf`` for
    ``--config``) are off, since parts of the command line read the flags as typed (the job
    file's ``--config``, the launcher's ``--processes``), and an abbreviation they miss would
    be silently ignored. Subcommand parsers inherit this (``add_parser`` builds them with
    this class)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split()).rstrip(".")
        hint = _full_flag_hint(self, text)
        self.exit(2, f"error: {text}{hint} ({self.prog} --help lists the options).\n")


def _full_flag_hint(parser: argparse.ArgumentParser, message: str) -> str:
    """``; flags are spelled in full: did you mean --config?`` for an unrecognized flag that
    is the start of one flag (or close to one), else ``""``."""
    if not message.startswith("unrecognized arguments:"):
        return ""
    flags = sorted(_long_flags(parser))
    for word in message.split(":", 1)[1].split():
        word = word.split("=", 1)[0]
        if not word.startswith("--"):
            continue
        starts = [f for f in flags if f.startswith(word)]
        near = starts if len(starts) == 1 else difflib.get_close_matches(word, flags, n=1)
        if near:
            return f"; flags are spelled in full: did you mean {near[0]}?"
    return ""


def _long_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every ``--flag`` of `parser` and of its subcommands."""
    out = set()
    for action in parser._actions:  # noqa: SLF001
        out.update(opt for opt in action.option_strings if opt.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in action.choices.values():
                out |= _long_flags(sub)
    return out


#: The ``type`` of path flags (see `PathArg`): relative to a job file's folder when set there.
PATH = PathArg()
#: Checkpoint directories: also the object stores orbax writes to (gs://, ...).
STORAGE_PATH = PathArg(urls=True)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (their help says what an unset flag means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m gtp_jax",
        description="gtp_jax: Generalized Tensor Parallelism for JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plan", add_help=False,
                   help="rank the layouts of a run by predicted step time among those that "
                   "fit (python -m gtp_jax plan --help)")
    train = sub.add_parser(
        "train",
        help="train a preset transformer (or your own model) with GTP on the bundled byte "
        "corpus or your text",
        description=(
            "Train a preset decoder on the bundled ~300 KB text corpus (byte tokens; or on "
            "your own text with --data and --tokenizer) with "
            "every weight, gradient and optimizer state sharded 1/gtp over the 'gtp' mesh "
            "axis. Without GPUs the mesh is simulated on CPU (default dp=2 x gtp=4 = 8 "
            "devices; without --gtp, gtp fills 8 devices: --tp 4 --dp 2 gives gtp=1); with GPUs "
            "the default is gtp = number of GPUs (of all processes), "
            "and with only --dp given, gtp takes the remaining GPUs."),
        formatter_class=_HelpFormatter)
    train.add_argument("--config", default=None, metavar="JOB.toml",
                       help="read flags from a TOML file: one key per flag, named as the "
                       "flag without its dashes (grad-accum = 4); flags on the command line "
                       "override the file (docs/training_options.md)")
    train.add_argument("--preset", default="tiny",
                       help="model size (parameters with the corpus's 256-byte vocabulary; "
                            "--data's tokenizer sets a larger one): tiny (0.47M), small "
                            "(19.4M), 100m (85M), 1b (823M), and the Llama shapes "
                            "llama3.2-1b (974M), llama3.2-3b (2.8B), llama3-8b (7.0B), "
                            "llama3-70b (68.5B)")
    train.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                       help="train your own Flax NNX model instead of a preset: "
                       "factory(rngs, sizes) in an importable module returns the module "
                       "(and optionally its loss; default: next-token cross-entropy on its "
                       "logits); docs/your_model.md")
    train.add_argument("--steps", type=int, default=100, help="optimizer steps")
    train.add_argument("--batch", type=int, default=16,
                       help="global batch size in sequences (divisible by dp*ep*gtp)")
    train.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    train.add_argument("--layers", type=int, default=None,
                       help="replace the preset's number of layers (default: the preset's)")
    train.add_argument("--dp", type=int, default=None, help="data-parallel size")
    train.add_argument("--gtp", type=int, default=None, help="GTP (weight-sharding) size")
    train.add_argument("--tp", type=int, default=None, help="tensor(+sequence)-parallel size")
    train.add_argument("--ep", type=int, default=None, help="expert-parallel size")
    train.add_argument("--cp", type=int, default=None,
                       help="context-parallel size: sequences split over cp devices, ring "
                       "attention (default 1)")
    train.add_argument("--lr", type=float, default=None,
                       help="peak learning rate (default: the preset's own, from 3e-3 for "
                       "tiny to 5e-6 for llama3-70b, docs/training_options.md; 3e-3 with "
                       "--init-from-hf; a resumed run keeps its own)")
    train.add_argument("--warmup", type=int, default=None,
                       help="warm-up steps: step k of them trains at k/warmup of --lr "
                       "(default: a tenth of --steps, at most the preset's maximum, 10 for "
                       "the small presets up to 200 for llama3-70b; a resumed run keeps its "
                       "own)")
    opt = train.add_argument_group("optimizer (AdamW; docs/training_options.md)")
    opt.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="cosine",
                     help="after the linear warm-up: cosine or linear decay to 10%% of --lr, "
                     "wsd (stable, then linear decay to 10%% over the last --decay-steps), or "
                     "constant")
    opt.add_argument("--decay-steps", type=int, default=None, metavar="N",
                     help="steps of the decay (default: the steps after the warm-up; wsd: "
                     "the last 20%% of them)")
    opt.add_argument("--weight-decay", type=float, default=0.1,
                     help="AdamW decoupled weight decay")
    opt.add_argument("--clip-grad-norm", type=float, default=1.0, metavar="NORM",
                     help="clip gradients to this global L2 norm (0: off)")
    opt.add_argument("--adam-b1", type=float, default=0.9, help="AdamW first-moment decay")
    opt.add_argument("--adam-b2", type=float, default=0.95, help="AdamW second-moment decay")
    opt.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    opt.add_argument("--grad-accum", type=int, default=1, metavar="N",
                     help="microbatches per optimizer step: --batch is split into N, their "
                     "gradients summed before one update (activation memory of one "
                     "microbatch; --batch must be a multiple of N*dp*ep*gtp)")
    train.add_argument("--seed", type=int, default=0, help="init and data-order seed")
    train.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                       help="bit-reproducible GPU runs (XLA's deterministic kernels, no "
                       "autotuning; slower; on GPUs with --dtype float32): the same command "
                       "gives the same losses run to run, so a resumed or re-laid-out run "
                       "can be compared step by step with an uninterrupted one")
    train.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                       help="compute dtype (master weights stay float32); auto: bfloat16 on "
                       "GPUs, float32 on CPUs")
    train.add_argument("--gather-dtype", choices=("auto", "float32", "bfloat16"),
                       default="auto",
                       help="dtype weights are all-gathered in; auto: bfloat16 with bfloat16 "
                       "compute (the same values in half the bytes), else the parameter dtype")
    train.add_argument("--reduce-dtype", choices=("float32", "bfloat16"), default="float32",
                       help="dtype weight gradients are reduce-scattered in: bfloat16 moves "
                       "half the bytes (llama3-8b on 4 GPUs at 2048 tokens each: 279 "
                       "instead of 302 ms a step) and sums in bfloat16")
    train.add_argument("--gather-format", choices=("fp8", "mxfp8", "nvfp4"), default=None,
                       help="low-precision weight all-gather (Pallas quantize kernels)")
    train.add_argument("--fp8-compute", choices=("tensorwise", "delayed"), default=None,
                       help="the projections' matmuls on FP8 operands (e4m3, e5m2 "
                       "gradients, per-tensor scales; FP8 GEMMs on Hopper, emulated on "
                       "CPUs); the output head stays in the compute dtype. tensorwise: "
                       "scales from each tensor's current amax; delayed: from an amax "
                       "history of the last 16 steps (TransformerEngine's delayed scaling)")
    train.add_argument("--fp8-min-features", type=int, default=None, metavar="N",
                       help="with --fp8-compute: projections with fewer input or output "
                       "features stay in the compute dtype (default 2048: smaller GEMMs "
                       "gain less than their quantize passes cost)")
    train.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                       help="ring-overlapped collective matmuls for the tp GEMMs")
    train.add_argument("--moe-experts", type=int, default=0, help="experts per layer (0: dense)")
    train.add_argument("--moe-top-k", type=int, default=2, help="experts per token")
    train.add_argument("--moe-capacity", type=float, default=1.25,
                       help="MoE capacity factor: each expert takes this multiple of an even "
                       "share of a sequence's routing choices; those beyond are dropped (the "
                       "progress line's 'dropped' share); 0: dropless, none dropped")
    train.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=False,
                       help="double-buffered prefetch of the next layer's weights in the "
                       "scanned layer loop (unrolled layers always gather one layer ahead)")
    train.add_argument("--keep-gathered-layers", action=argparse.BooleanOptionalAction,
                       default=False,
                       help="gather each layer's weights once per step: the backward pass "
                       "reuses the forward pass's (faster where the backward pass waits on "
                       "gathers, e.g. few tokens per GPU; every layer's gathered weights are "
                       "held through the step; same numbers)")
    train.add_argument("--coalesce-layer-collectives", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="one all-gather and one reduce-scatter per layer (the default) or, "
                       "with --no-coalesce-layer-collectives, one per weight (same numbers; "
                       "docs/overlap.md)")
    train.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=None,
                       help="run the layers as a Python loop (fastest) or, with "
                       "--no-unroll-layers, under lax.scan (smaller program, faster compile); "
                       "default: unrolled unless --remat full or --fp8-compute")
    train.add_argument("--attention", choices=("auto", "cudnn", "xla"), default="auto",
                       help="attention kernel; auto: cuDNN's fused attention on GPUs where "
                       "it applies (bfloat16, head dim a multiple of 8 up to 128), else XLA")
    train.add_argument("--pad-for-alignment", type=int, default=0,
                       help="pad sharded dims to a multiple of gtp * this (0: divisibility)")
    train.add_argument("--remat", choices=("auto", "none", "dots", "full"), default="auto",
                       help="activation recompute inside each layer; auto: dots on GPUs "
                       "(save matmul outputs), none on CPUs")
    train.add_argument("--offload-optimizer", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="keep the optimizer state in host memory (pinned_host), copied "
                       "to the devices for the update (default: off; with --plan auto the "
                       "planner chooses)")
    train.add_argument("--offload-exclude", nargs="+", default=(), metavar="REGEX",
                       help="with --offload-optimizer: parameters (regular expressions on "
                       "paths such as blocks/mlp/down/kernel) whose optimizer state stays "
                       "on the device, so fewer bytes cross each step")
    train.add_argument("--offload-master-weights", action=argparse.BooleanOptionalAction,
                       default=False,
                       help="with --offload-optimizer: the float32 parameters in host memory "
                       "too, bfloat16 parameters and gradients on the devices (4 bytes less "
                       "device memory per parameter, 4 more each way over the host link per "
                       "step)")
    train.add_argument("--plan", choices=("off", "auto"), default="off",
                       help="auto: plan the layout (mesh sizes, remat, layer loop, offload; "
                       "the ones given as flags stay fixed), print it and train with the "
                       "top one; a run that fits no layout is refused before compiling")
    train.add_argument("--memory-gib", type=float, default=None,
                       help="with --plan auto: the budget per device in GiB (default: the "
                       "device's memory)")
    train.add_argument("--compile-cache", default=None, metavar="DIR",
                       type=PathArg(*COMPILE_CACHE_OFF),
                       help=COMPILE_CACHE_HELP)

    hf = train.add_argument_group("Hugging Face checkpoints (Llama family; docs/models.md)")
    hf.add_argument("--init-from-hf", default=None, metavar="DIR", type=PATH,
                    help="start from this checkpoint's weights; its config.json sets the "
                         "model shape (--preset is refused with it)")
    hf.add_argument("--export-hf", default=None, metavar="DIR", type=PATH,
                    help="write the trained model there as a Hugging Face checkpoint")
    data = train.add_argument_group(
        "data (default: the bundled byte corpus; docs/data.md)")
    data.add_argument("--data", nargs="+", default=None, metavar="PATH", type=PATH,
                      help="text or JSONL files, or folders of them (*.txt, *.md, *.jsonl), "
                           "tokenized once into a token file beside them and reused")
    data.add_argument("--tokenizer", default=None, metavar="DIR", type=PATH,
                      help="Hugging Face tokenizer folder (holding tokenizer.json), or the "
                           "tokenizer.json file itself, for --data; the model's vocabulary "
                           "is its size")
    data.add_argument("--data-field", default="text", metavar="KEY",
                      help="the JSONL key holding each document's text")
    data.add_argument("--val-data", nargs="+", default=None, metavar="PATH", type=PATH,
                      help="held-out files for the validation loss (instead of "
                           "--val-fraction)")
    data.add_argument("--val-fraction", type=float, default=None,
                      help="share of --data's tokens held out for the validation loss "
                           "(default 0.05)")
    data.add_argument("--data-cache", default=None, metavar="DIR", type=PATH,
                      help="where token files go when the data's folder is not writable "
                           "(default ~/.cache/gtp_jax/tokens)")
    data.add_argument("--eval-every", type=int, default=0, metavar="N",
                      help="held-out loss after every N steps and the last (0: never)")
    data.add_argument("--eval-batches", type=int, default=4, metavar="K",
                      help="held-out batches per evaluation (the same ones each time)")

    ntp = train.add_argument_group(
        "fault tolerance (nonuniform tensor parallelism, docs/fault_tolerance.md)")
    ntp.add_argument("--simulate-failure", default=None, metavar="step=S,device=D",
                     help="lose device D (repeat device= for more) after step S and keep "
                          "training: the replicas that lost a device continue at a reduced "
                          "tp/gtp degree, the state is re-laid out in memory")
    ntp.add_argument("--tp-spares", type=int, default=None, metavar="N",
                     help="devices per group a degraded replica leaves idle (degree = tp - N); "
                          "default: the fewest the failure needs (parity rule) whose degree "
                          "divides the heads and MLP width")
    ntp.add_argument("--ntp-axis", choices=("tp", "gtp"), default="tp",
                     help="the axis whose degree a degraded replica reduces")

    ckpt = train.add_argument_group("checkpoints (orbax; sharded, each process writes its own "
                                    "shards)")
    ckpt.add_argument("--checkpoint-dir", default=None, type=STORAGE_PATH,
                      help="save checkpoints here (shared by all processes)")
    ckpt.add_argument("--checkpoint-every", type=int, default=0,
                      help="save every K steps (0: only after the last step)")
    ckpt.add_argument("--keep-checkpoints", type=int, default=3,
                      help="keep the N newest checkpoints")
    ckpt.add_argument("--resume", nargs="?", const=True, default=False, type=_resume_mode,
                      metavar="auto",
                      help="continue from the newest intact checkpoint in --checkpoint-dir "
                           "(the mesh may differ from the saving run's); --resume auto: the "
                           "same, or start a new run if nothing was saved there yet (one "
                           "command to start a job and to requeue it)")
    ckpt.add_argument("--init-from", default=None, metavar="DIR", type=STORAGE_PATH,
                      help="start a new run from the weights of the newest intact checkpoint "
                           "in DIR (any mesh; same model shape), with a fresh optimizer and "
                           "this run's hyperparameters")

    dist = train.add_argument_group(
        "multi-process (one process per host or per GPU; same command on every process)")
    dist.add_argument("--processes", type=int, default=None, metavar="N",
                      help="start the run as N processes on this host and supervise them "
                           "(each with its block of the GPUs; a lost process stops the "
                           "others with one line naming it)")
    dist.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                      help="address of process 0's coordination service "
                           "(env: JAX_COORDINATOR_ADDRESS)")
    dist.add_argument("--num-processes", type=int, default=None,
                      help="number of processes (env: JAX_NUM_PROCESSES)")
    dist.add_argument("--process-id", type=int, default=None,
                      help="this process's index 0..N-1 (env: JAX_PROCESS_ID)")
    dist.add_argument("--local-device-ids", default=None, metavar="IDS",
                      help="comma-separated local devices of this process, e.g. 3 for one "
                           "process per GPU; unset: all visible devices")
    dist.add_argument("--distributed-auto", action="store_true",
                      help="let JAX detect the cluster (SLURM, Open MPI, Kubernetes)")
    dist.add_argument("--distributed-timeout", type=int, default=300, metavar="SECONDS",
                      help="how long to wait for every process to join the run")
    # distributed.DEFAULT_HEARTBEAT_TIMEOUT (not imported here: it imports JAX)
    dist.add_argument("--heartbeat-timeout", type=int, default=30, metavar="SECONDS",
                      help="a process silent this long counts as lost: every other process "
                           "stops, with one line naming it")

    obs = train.add_argument_group("observability")
    obs.add_argument("--profile-dir", default=None, type=PATH,
                     help="write a jax.profiler trace (incl. perfetto_trace.json.gz) here")
    obs.add_argument("--profile-steps", default=None, metavar="A:B",
                     help="steps to trace, inclusive; unset: the 3 steps after the first")
    obs.add_argument("--metrics-json", default=None, metavar="PATH", type=PATH,
                     help="write per-step metrics and the summary as JSON at the end")
    obs.add_argument("--log-dir", default=None, metavar="DIR", type=PATH,
                     help="stream metrics while training: DIR/metrics.jsonl (flushed per "
                     "logged step) and TensorBoard event files (pip install "
                     "'gtp-jax[tensorboard]')")
    obs.add_argument("--log-every", type=int, default=5, metavar="K",
                     help="log every K steps (the progress line off a terminal, --log-dir) "
                     "and the last step")
    return parser


def _resume_mode(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"{text!r}: --resume takes no value, or 'auto'")
    return text


def _mesh_sizes(args: argparse.Namespace) -> dict[str, int | None]:
    return {"dp": args.dp, "gtp": args.gtp, "tp": args.tp, "ep": args.ep, "cp": args.cp}


def _device_ids(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise UsageError(
            f"--local-device-ids {text!r}: use comma-separated ints, e.g. 0 or 0,1.") from None


def _failure(args: argparse.Namespace) -> object | None:
    """The `SimulatedFailure` of ``--simulate-failure`` / ``--tp-spares`` / ``--ntp-axis``."""
    from gtp_jax.train.lifecycle.ntp import parse_failure  # noqa: PLC0415

    if args.simulate_failure is None:
        if args.tp_spares is not None or args.ntp_axis != "tp":
            raise UsageError("--tp-spares and --ntp-axis need --simulate-failure "
                             "step=S,device=D (the failure they configure).")
        return None
    return parse_failure(args.simulate_failure, tp_spares=args.tp_spares, axis=args.ntp_axis,
                         name="--simulate-failure")


def _text_data(args: argparse.Namespace) -> object | None:
    """The `TextData` of ``--data`` / ``--tokenizer`` / ..., or None (the bundled corpus)."""
    from gtp_jax.data import TextData  # noqa: PLC0415

    if args.data is None:
        given = [flag for flag, value in (("--tokenizer", args.tokenizer),
                                          ("--val-data", args.val_data),
                                          ("--val-fraction", args.val_fraction),
                                          ("--data-cache", args.data_cache)) if value is not None]
        if args.data_field != "text":
            given.append("--data-field")
        if given:
            raise UsageError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} "
                             "--data PATH (the text to train on); without --data the bundled "
                             "byte corpus is used.")
        return None
    for flag, paths in (("--data", args.data), ("--val-data", args.val_data or ())):
        for path in paths:  # the files first: a missing one is the mistake to name
            if not os.path.exists(path):
                raise UsageError(f"{flag}: {path!r} does not exist; pass text or JSONL files "
                                 "or a folder of them.")
    if args.tokenizer is None:
        raise UsageError("--data needs --tokenizer DIR (a Hugging Face tokenizer folder with "
                         "tokenizer.json, or that file).")
    if args.val_data is not None and args.val_fraction is not None:
        raise UsageError("--val-data and --val-fraction both choose the held-out text; pass "
                         "one of them.")
    fraction = args.val_fraction if args.val_fraction is not None else (
        0.0 if args.val_data else 0.05)
    return TextData(paths=tuple(args.data), tokenizer=args.tokenizer, field=args.data_field,
                    val_paths=tuple(args.val_data or ()), val_fraction=fraction,
                    cache_dir=args.data_cache)


def _configs(args: argparse.Namespace) -> tuple[object, object | None, object]:
    """Distributed, checkpoint and observe configs from the flags, validated before JAX
    starts (so that bad flags fail fast, on every process, before joining a run)."""
    from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig  # noqa: PLC0415
    from gtp_jax.train.outputs.observe import ObserveConfig, parse_steps  # noqa: PLC0415
    from gtp_jax.train.processes.distributed import DistributedConfig  # noqa: PLC0415

    flags = (args.coordinator, args.num_processes, args.process_id)
    if args.distributed_auto or any(v is not None for v in flags):
        dist = DistributedConfig(coordinator=args.coordinator, num_processes=args.num_processes,
                                 process_id=args.process_id,
                                 local_device_ids=_device_ids(args.local_device_ids),
                                 auto=args.distributed_auto, timeout=args.distributed_timeout,
                                 heartbeat_timeout=args.heartbeat_timeout)
    else:
        env = DistributedConfig.from_env()
        dist = DistributedConfig(coordinator=env.coordinator, num_processes=env.num_processes,
                                 process_id=env.process_id,
                                 local_device_ids=_device_ids(args.local_device_ids),
                                 timeout=args.distributed_timeout,
                                 heartbeat_timeout=args.heartbeat_timeout)
    checkpoint = None
    if args.checkpoint_dir is not None:
        checkpoint = CheckpointConfig(args.checkpoint_dir, every=args.checkpoint_every,
                                      keep=args.keep_checkpoints, resume=args.resume)
    elif args.resume:
        raise UsageError("--resume needs --checkpoint-dir DIR (the directory of the run to "
                         "continue).")
    observe = ObserveConfig(
        profile_dir=args.profile_dir,
        profile_steps=parse_steps(args.profile_steps) if args.profile_steps else None,
        metrics_json=args.metrics_json, log_dir=args.log_dir, log_every=args.log_every)
    return dist, checkpoint, observe


def main(argv: list[str] | None = None, *, planner: Planner | None = None) -> int:
    """``python -m gtp_jax train [options]``; `planner` is the ``--plan auto`` layout choice
    (`gtp_jax.plan.cli.auto_layout`, a higher layer, passed in by ``python -m gtp_jax``)."""
    try:
        return _main(argv, planner)
    except KeyboardInterrupt:
        # Only reached outside the training loop's signal handlers (which stop after the
        # step in flight and save): checks, planning and building, before anything is
        # written.
        print("gtp_jax train: interrupted (Ctrl-C) before training started; nothing was "
              "trained or saved.", file=sys.stderr, flush=True)
        return 128 + 2  # SIGINT, as a shell reports a process it interrupted


def _launch_flags_problem(args: argparse.Namespace) -> str | None:
    """Why ``--processes`` cannot start a run with the other flags given (before anything
    else is checked: the flags that join a run by hand conflict with it)."""
    joined = [flag for flag, value in (("--coordinator", args.coordinator),
                                       ("--num-processes", args.num_processes),
                                       ("--process-id", args.process_id),
                                       ("--local-device-ids", args.local_device_ids))
              if value is not None] + (["--distributed-auto"] if args.distributed_auto else [])
    if joined:
        return (f"--processes starts the processes itself; drop {', '.join(joined)} (or drop "
                "--processes to join a run started another way).")
    if args.processes < 2:
        return (f"--processes {args.processes} must be >= 2 (one process needs no launcher: "
                "drop --processes).")
    return None


def _launch(argv: list[str], args: argparse.Namespace, sizes: dict[str, int | None],
            cpu_sizes: dict[str, int], checkpoint: object | None, observe: object) -> int:
    """``--processes N``: this process starts and supervises the run's N processes
    (`gtp_jax.train.processes.launch`) instead of training itself.

    What every process would refuse is refused here, once and before any process starts,
    in the flags the user typed: the process count against the devices, and the run's
    configuration on the mesh the processes will build."""
    from gtp_jax.base.host import jax_gpu_count  # noqa: PLC0415
    from gtp_jax.train.processes.launch import launch, without_flag  # noqa: PLC0415

    processes, gpus = args.processes, jax_gpu_count()
    if gpus:
        if gpus % processes:
            return _fail(UsageError(
                f"--processes {processes} does not divide this host's {gpus} GPUs into equal "
                "blocks; use a divisor of the GPU count."), 2)
        mesh, devices = _accelerator_mesh(sizes, gpus), gpus
    else:
        mesh, devices = cpu_sizes, math.prod(cpu_sizes.values())
        if devices % processes:
            given = " ".join(f"{k}={v}" for k, v in cpu_sizes.items())
            return _fail(UsageError(
                f"--processes {processes} does not divide the {devices} devices of the mesh "
                f"({given}); each process simulates the same number of CPU devices: choose "
                f"--processes dividing {devices}, or other mesh sizes."), 2)
    backend = "gpu" if gpus else "cpu"
    problem = deterministic_problem(args.deterministic, backend, args.dtype)
    if problem:
        return _fail(UsageError(problem), 2)
    if args.simulate_failure is not None:
        return _fail(UsageError(
            f"--simulate-failure with --processes {processes}: a simulated failure runs in one "
            "process only (its re-layout moves arrays between the devices of one process); "
            "drop one of them (docs/fault_tolerance.md)."), 2)
    try:
        from gtp_jax.train.loop import check_output_paths  # noqa: PLC0415

        check_output_paths(checkpoint, observe, args.export_hf)  # as each process would
        cfg = _train_config(args, _PLANNED_MESH if args.plan == "auto" else mesh)
        if args.plan != "auto":
            from gtp_jax.train.config import check_devices, resolve  # noqa: PLC0415

            check_devices(resolve(cfg, backend), devices=devices)
    except UsageError as err:
        return _fail(_mesh_defaults_hint(err, sizes, cpu_sizes, backend), 2)
    rest = argv[1:] if argv[:1] == ["train"] else argv  # child_commands adds "train"
    return launch(without_flag(rest, "--processes"), processes, gpus)


def _main(argv: list[str] | None, planner: Planner | None) -> int:
    try:
        argv = expand_job_file(_parser(), sys.argv[1:] if argv is None else list(argv))
    except UsageError as err:
        return _fail(err, 2)
    args = _parser().parse_args(argv)
    if args.command == "plan":
        print("error: run python -m gtp_jax plan (with the plan options).", file=sys.stderr)
        return 2
    if args.processes is not None:
        problem = _launch_flags_problem(args)
        if problem:
            return _fail(UsageError(problem), 2)
    if args.memory_gib is not None and args.plan != "auto":
        print("error: --memory-gib needs --plan auto (the planner checks the budget).",
              file=sys.stderr)
        return 2
    if args.model is not None and args.plan == "auto":
        print("error: --plan auto with --model: the planner compiles the bundled decoder's "
              "step to rank layouts; choose the mesh yourself (--dp/--gtp/--tp) or drop "
              "--model.", file=sys.stderr)
        return 2
    if args.offload_exclude and args.plan == "auto":
        print("error: --offload-exclude with --plan auto: the planner chooses which optimizer "
              "state stays on the device; drop one of them.", file=sys.stderr)
        return 2
    if args.offload_master_weights and args.plan == "auto":
        print("error: --offload-master-weights with --plan auto: the planner offloads the "
              "master weights itself when nothing fits without; drop one of them.",
              file=sys.stderr)
        return 2
    sizes = _mesh_sizes(args)
    for name, size in sizes.items():  # before any default is derived from them
        if size is not None and size < 1:
            return _fail(UsageError(f"--{name}={size} must be >= 1 (the size of the "
                                    f"'{name}' mesh axis; 1 turns it off)."), 2)
    cpu_sizes = _cpu_mesh(sizes)
    try:
        dist, checkpoint, observe = _configs(args)
        failure = _failure(args)
        data = _text_data(args)
        cache = compile_cache_dir(args.compile_cache)
    except UsageError as err:  # other exceptions are bugs: they keep their traceback
        return _fail(err, 2)
    total = math.prod(cpu_sizes.values())
    if total > MAX_SIMULATED_DEVICES * (args.processes or dist.num_processes or 1):
        # On a CPU host each process simulates its share of the mesh; so many devices only
        # make sense on accelerators, where this count is never simulated (a CPU backend
        # asked for a million devices would take minutes and gigabytes before any message).
        given = " ".join(f"--{k} {v}" for k, v in sizes.items() if v is not None)
        flag = "--processes" if args.processes is not None else "--num-processes"
        return _fail(UsageError(
            f"the mesh {given} has {total} devices: more than the "
            f"{MAX_SIMULATED_DEVICES} CPU devices one process simulates; choose mesh "
            "sizes whose product fits (dp*ep*gtp*cp*tp) or run on accelerators with "
            f"several processes ({flag})."), 2)
    if args.processes is not None:
        return _launch(argv, args, sizes, cpu_sizes, checkpoint, observe)
    if dist.num_processes and total % dist.num_processes:  # fail before joining a run
        return _processes_error(dist.num_processes, total)

    from gtp_jax.train.processes.distributed import (  # noqa: PLC0415
        DistributedJoinError,
        DistributedPeerError,
        initialize,
        joined_process_count,
        shutdown,
        wait_for_lost_peer,
    )

    guard = None
    if dist.enabled:
        from gtp_jax.train.processes.output_guard import guard_output  # noqa: PLC0415

        # Before joining: gloo's connection lines and the runtime's report of a lost
        # process (an abort that Python cannot intercept) become one line.
        guard = guard_output(dist.process_id, dist.num_processes, dist.heartbeat_timeout)
    # Joining starts no backend, and with --distributed-auto it is what tells us the
    # process count the simulated CPU devices are divided by.
    try:
        initialize(dist)
    except DistributedJoinError as err:
        return _fail(err, 1)
    processes = joined_process_count(dist)
    if total % processes:
        return _processes_error(processes, total)
    simulate_cpu_devices(total // processes)
    if args.deterministic:
        request_deterministic()
    use_compile_cache(cache)
    # XLA_FLAGS are set: JAX may start a backend from here on.
    try:
        code = _run(args, sizes, cpu_sizes, checkpoint, observe, failure, data, planner)
    except Exception as err:
        # A collective whose peer was lost fails at once, before JAX says which process
        # was lost (its report ends this process, and the output guard names the lost one).
        wait_for_lost_peer(err, dist)
        raise
    # Not in a `finally`: after an exception the shutdown barrier would wait for processes
    # that may never arrive; JAX's failure detection ends the others instead.
    try:
        shutdown(dist.timeout)
    except DistributedPeerError as err:
        return _fail(err, 1)
    if guard is not None:
        # The run ended in order: everything printed is out before this process exits.
        # (Not after an error: the runtime's report of a lost process may still come, and
        # must reach the guard.)
        guard.close()
    return code


def _processes_error(processes: int, total: int) -> int:
    print(f"error: --num-processes {processes} does not divide the {total} devices of the "
          "mesh; each process must get the same number of (simulated CPU) devices.",
          file=sys.stderr)
    return 2


def _cpu_mesh(sizes: dict[str, int | None]) -> dict[str, int]:
    """Mesh sizes on the simulated CPU mesh: the sizes given, dp/tp/ep defaulting to
    `DEFAULT_CPU_MESH`, and gtp (unless given) filling `CPU_DEVICES` devices when the others
    divide them (``--tp 4 --dp 2``: gtp=1), else its default 4."""
    mesh = {k: (v if v is not None else DEFAULT_CPU_MESH[k]) for k, v in sizes.items()}
    if sizes["gtp"] is None:
        rest = mesh["dp"] * mesh["tp"] * mesh["ep"] * mesh["cp"]
        if CPU_DEVICES % rest == 0:
            mesh["gtp"] = CPU_DEVICES // rest
    return mesh


def deterministic_problem(deterministic: bool, backend: str, dtype: str) -> str | None:
    """Why ``--deterministic`` cannot run with `dtype` (``--dtype``) on `backend`; None if it
    can. On GPUs XLA's deterministic mode aborted (the process, exit 134) while running the
    bfloat16 training step (jax 0.11.2, 4x H200, 2026-11-28), and ran the float32 one."""
    if deterministic and backend != "cpu" and dtype != "float32":
        return (f"--deterministic with --dtype {dtype} (bfloat16 compute on GPUs): XLA's "
                "deterministic mode aborts the bfloat16 step on GPUs; add --dtype float32.")
    return None


def _run(args: argparse.Namespace, sizes: dict[str, int | None], cpu_sizes: dict[str, int],
         checkpoint: object | None, observe: object, failure: object | None = None,
         data: object | None = None, planner: Planner | None = None) -> int:
    import jax  # noqa: PLC0415

    from gtp_jax.train import CheckpointWriteError, train  # noqa: PLC0415
    from gtp_jax.train.lifecycle.preempt import RESUMABLE_EXIT, RunStopped, stop_on_signals  # noqa: PLC0415
    from gtp_jax.train.lifecycle.resume import RunFinished  # noqa: PLC0415

    primary = jax.process_index() == 0
    problem = deterministic_problem(args.deterministic, jax.default_backend(), args.dtype)
    if problem:
        return _fail(UsageError(problem), 2)
    if jax.default_backend() == "cpu":
        mesh = cpu_sizes
    else:
        mesh = _accelerator_mesh(sizes, jax.device_count())
    try:
        cfg = _train_config(args, _PLANNED_MESH if args.plan == "auto" else mesh)
        if args.plan == "auto":
            cfg = _planned(args, sizes, cfg, planner)
        # Printed once the run is validated and will train (a finished run's re-launch
        # prints only that it is finished).
        with stop_on_signals(saves=checkpoint is not None) as stop:
            result = train(cfg, checkpoint=checkpoint, observe=observe, failure=failure,
                           on_start=functools.partial(_print_header, given=cfg)
                           if primary else None, data=data, stop=stop)
    except UsageError as err:  # other exceptions are bugs: they keep their traceback
        return _fail(_mesh_defaults_hint(err, sizes, cpu_sizes, jax.default_backend()), 2)
    except FloatingPointError as err:  # NaN/inf loss or state: not a bug, not a usage error
        return _fail(err, 1)
    except CheckpointWriteError as err:  # a full disk: the older checkpoints are kept
        return _fail(err, 1)
    except RunFinished as done:  # a re-launch of a completed run: nothing to do, no error
        if primary:
            print(f"gtp_jax train: {cli_message(done)}", flush=True)
        return 0
    except RunStopped as early:  # a signal before the first step: nothing to save
        if primary:
            kept = (f"; its checkpoint of step {early.step} is kept" if early.step else "")
            print(f"gtp_jax train: {early}{kept}; run the same command to "
                  f"{'continue' if early.step else 'start'} it (exit status "
                  f"{RESUMABLE_EXIT}: unfinished).", flush=True)
        return RESUMABLE_EXIT
    if result.stopped_by is not None:
        return _stopped(result, primary, args.steps, args.export_hf, failure)
    if primary:
        print(result.summary(), flush=True)
    return 0


def _train_config(args: argparse.Namespace, mesh: dict[str, int]) -> object:
    """The `TrainConfig` of the flags on `mesh` (validated: a `UsageError` names the
    field)."""
    from gtp_jax.train import TrainConfig  # noqa: PLC0415

    return TrainConfig(preset=args.preset, model=args.model, layers=args.layers,
                       steps=args.steps,
                       batch_size=args.batch,
                       seq_len=args.seq, lr=args.lr, warmup=args.warmup, seed=args.seed,
                       dtype=args.dtype, gather_dtype=args.gather_dtype,
                       reduce_dtype=args.reduce_dtype,
                       pad_for_alignment=args.pad_for_alignment, remat=args.remat,
                       attention=args.attention, unroll_layers=args.unroll_layers,
                       gather_format=args.gather_format, prefetch=args.prefetch,
                       keep_gathered_layers=args.keep_gathered_layers,
                       coalesce_layer_collectives=args.coalesce_layer_collectives,
                       fp8_compute=args.fp8_compute,
                       fp8_min_features=args.fp8_min_features,
                       overlap=args.overlap, moe_experts=args.moe_experts,
                       moe_top_k=args.moe_top_k,
                       moe_capacity_factor=args.moe_capacity or None,
                       init_from_hf=args.init_from_hf, export_hf=args.export_hf,
                       init_from=args.init_from,
                       eval_every=args.eval_every, eval_batches=args.eval_batches,
                       offload_optimizer=bool(args.offload_optimizer),
                       offload_exclude=tuple(args.offload_exclude),
                       offload_master_weights=bool(args.offload_master_weights),
                       weight_decay=args.weight_decay, lr_schedule=args.lr_schedule,
                       decay_steps=args.decay_steps, clip_grad_norm=args.clip_grad_norm,
                       adam_b1=args.adam_b1, adam_b2=args.adam_b2, adam_eps=args.adam_eps,
                       grad_accum=args.grad_accum, **mesh)


def _mesh_defaults_hint(err: UsageError, sizes: dict[str, int | None],
                        cpu_sizes: dict[str, int], backend: str) -> UsageError:
    """`err`, naming the default mesh sizes on the CPU when a size the user left out is
    what does not fit."""
    if backend == "cpu" and any(v is None for v in sizes.values()) and (
            type(err).__name__ != "DeviceMemoryError") and (
            "must be a multiple of dp" in str(err) or "grad_accum*dp" in str(err)
            or "the mesh dp*ep*gtp*cp*tp" in str(err)):
        given = {k: v for k, v in cpu_sizes.items() if sizes[k] is None}
        return UsageError(f"{err} (with defaults {given} for the mesh sizes not given; "
                          "pass --dp/--gtp/--tp/--ep/--cp explicitly)")
    return err


def _stopped(result: object, primary: bool, steps: int, export_hf: str | None,
             failure: object | None = None) -> int:
    """One line for a run stopped by a signal. Never status 0, which would let ``train &&
    upload`` publish a partial run: `RESUMABLE_EXIT` when its checkpoint was saved (a
    requeued job continues from it), else 128 + the signal's number (the steps are lost)."""
    import signal  # noqa: PLC0415

    from gtp_jax.train.lifecycle.preempt import RESUMABLE_EXIT  # noqa: PLC0415

    step = result.first_step + len(result.losses) - 1
    saved = result.checkpoint_dir is not None and step in result.checkpoint_steps
    number = getattr(signal, result.stopped_by.split()[0], 0)  # "SIGTERM on process 1"
    code = RESUMABLE_EXIT if saved else 128 + int(number)
    if primary:
        # Past its simulated failure the run continues on the whole mesh, without the flag.
        same = ("the same command without --simulate-failure"
                if failure is not None and step >= failure.step else "the same command")
        where = (f"checkpoint saved in {result.checkpoint_dir!r}; run {same} with "
                 "--resume auto to continue" if saved else
                 "no --checkpoint-dir, nothing was saved")
        unexported = (f"; --export-hf {export_hf!r} is written only when the run finishes"
                      if export_hf is not None else "")
        print(f"gtp_jax train: stopped by {result.stopped_by} after step {step} of {steps}: "
              f"{where} (exit status {code}: unfinished){unexported}.", flush=True)
    return code


#: The placeholder mesh of a run whose layout the planner chooses.
_PLANNED_MESH = {"dp": 1, "gtp": 1, "tp": 1, "ep": 1, "cp": 1}


def _planned(args: argparse.Namespace, sizes: dict[str, int | None], cfg: object,
             planner: Planner | None) -> object:
    """`cfg` laid out by `planner` (``--plan auto``), keeping the layout flags given."""
    if args.keep_gathered_layers:
        raise UsageError("--keep-gathered-layers: the planner (--plan auto) does not model "
                         "the kept weights' memory; give the layout flags instead of "
                         "--plan auto, or drop --keep-gathered-layers.")
    if planner is None:
        raise UsageError("--plan auto needs the planner: run python -m gtp_jax train.")
    fixed: dict[str, object] = {k: v for k, v in sizes.items() if v is not None}
    if args.remat != "auto":
        fixed["remat"] = args.remat
    if args.unroll_layers is not None:
        fixed["unroll_layers"] = args.unroll_layers
    if args.prefetch:
        fixed["prefetch"] = True
    if args.gather_format is not None:
        fixed["gather_format"] = args.gather_format
    if args.offload_optimizer is not None:
        fixed["offload_optimizer"] = args.offload_optimizer
    return planner(cfg, fixed, args.memory_gib)


def _print_header(cfg: object, model_cfg: object, given: object | None = None) -> None:
    """The run's header (`given`: the config the command line built, whose None LR and
    warm-up asked for the defaults)."""
    import jax  # noqa: PLC0415

    from gtp_jax.train.config import describe_choices, describe_schedule  # noqa: PLC0415

    procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    model = (f"init-from-hf={cfg.init_from_hf}" if cfg.init_from_hf
             else f"model={cfg.model}" if cfg.model else f"preset={cfg.preset}")
    print(f"gtp_jax train: {model} steps={cfg.steps} batch={cfg.batch_size} "
          f"seq={cfg.seq_len} mesh dp={cfg.dp} ep={cfg.ep} gtp={cfg.gtp} "
          f"{f'cp={cfg.cp} ' if cfg.cp > 1 else ''}tp={cfg.tp} on "
          f"{jax.device_count()} {jax.default_backend()} devices{procs}", flush=True)
    print(f"gtp_jax train: {describe_choices(cfg, model_cfg)}", flush=True)
    print(f"gtp_jax train: {describe_schedule(cfg, given)}", flush=True)


def _accelerator_mesh(sizes: dict[str, int | None], devices: int) -> dict[str, int]:
    """Mesh sizes on GPUs/TPUs: given sizes, tp = ep = 1 by default, and gtp (or dp, when
    gtp is given) takes the remaining devices; no sizes: gtp = all devices."""
    mesh = {"tp": sizes["tp"] or 1, "ep": sizes["ep"] or 1, "cp": sizes["cp"] or 1,
            "dp": sizes["dp"], "gtp": sizes["gtp"]}
    fixed = mesh["tp"] * mesh["ep"] * mesh["cp"]
    if mesh["gtp"] is None:
        mesh["dp"] = mesh["dp"] or 1
        mesh["gtp"] = max(1, devices // (mesh["dp"] * fixed))
    elif mesh["dp"] is None:
        mesh["dp"] = max(1, devices // (mesh["gtp"] * fixed))
    return mesh
