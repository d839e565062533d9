"""Hugging Face Llama-family checkpoints in and out of the built-in `Transformer`.

`from_hf` reads a checkpoint directory (``config.json`` plus ``model.safetensors`` or the
shards listed in ``model.safetensors.index.json``) into a `Transformer`, sharded on a mesh
or not; `to_hf` writes one that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Reading streams: on a mesh, every stored weight is built with
``jax.make_array_from_callback`` from the sharded module's own layout (tp/ep splits, GTP
padding), and each device's callback reads only the rows and columns of its shard with
``safetensors``' lazy ``get_slice``, so no process ever holds the whole model on the host
(docs/models.md gives the measured peak). Unsharded (no mesh), the model is built whole.

Name mapping (``N`` a layer; HF ``[out, in]`` weights are transposed into NNX kernels):

- ``model.embed_tokens.weight [V, d]`` -> ``embed.embedding``
- ``lm_head.weight [V, d]`` -> ``lm_head.kernel [d, V]`` (absent when tied)
- ``model.norm.weight`` -> ``final_norm.scale``
- ``model.layers.N.input_layernorm.weight`` -> ``blocks.attn_norm.scale[N]``
- ``model.layers.N.post_attention_layernorm.weight`` -> ``blocks.mlp_norm.scale[N]``
- ``self_attn.{q,k,v}_proj.weight`` -> ``blocks.attn.qkv.kernel[N] [d, 3, H, hd]``
  (multi-head), or ``q`` -> ``blocks.attn.q.kernel[N] [d, H, hd]`` and ``{k,v}`` ->
  ``blocks.attn.kv.kernel[N] [d, 2, KV, hd]`` (grouped-query)
- ``self_attn.o_proj.weight [d, H*hd]`` -> ``blocks.attn.out.kernel[N] [H, hd, d]``
- ``mlp.{gate,up}_proj.weight [f, d]`` -> ``blocks.mlp.gate_up.kernel[N] [d, 2f]``
- ``mlp.down_proj.weight [d, f]`` -> ``blocks.mlp.down.kernel[N] [f, d]``

Rotary layout: Hugging Face's Llama rotates "half-split" pairs (``rotate_half``: feature
``i`` with ``i + hd/2``) on the q/k weights as stored, which is exactly
`gtp_jax.models.elementwise.apply_rope`'s convention, so q and k rows are copied unpermuted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for safetensors' numpy reader)
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gtp_jax.base.config import GTPConfig
from gtp_jax.base.errors import UsageError
from gtp_jax.models.transformer import Transformer, TransformerConfig
from gtp_jax.sharding.module import ShardedModule, shard
from gtp_jax.sharding.plan import ParamPlan, SplitPlan, path_str

#: ``model_type`` values read (weights named as Llama's).
SUPPORTED_TYPES = ("llama", "mistral")
_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
#: Files written by `to_hf` hold at most this many bytes each (then an index is written).
MAX_SHARD_BYTES = 2 * 1024**3
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _fail(directory: str, msg: str) -> UsageError:
    return UsageError(f"Hugging Face checkpoint {directory!r}: {msg}")


#: ``config.json`` keys the importer reads; each is validated by `config_from_hf`.
UNDERSTOOD_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
    "hidden_act", "attention_bias", "mlp_bias", "sliding_window"})
#: Keys that never change the model's logits: names and versions, the stored dtype (the
#: import converts to its own), token ids and generation settings, initialization, caching,
#: dropout (the imported model trains without it), how PyTorch splits its matmuls.
NO_EFFECT_KEYS = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "bos_token_id",
    "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range", "use_cache", "attention_dropout", "pretraining_tp",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "chunk_size_feed_forward", "is_encoder_decoder",
    "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "tie_encoder_decoder", "finetuning_task", "id2label", "label2id", "num_labels",
    "task_specific_params", "problem_type", "tokenizer_class", "prefix", "max_length",
    "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "model_name", "name_or_path"})
#: Keys that change the computation (in transformers, for every model type), with the
#: values at which they do not. Any other key is refused unless it is off (null, false,
#: empty) or private (a leading underscore, or a tool's ``*_version`` stamp).
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "partial_rotary_factor": lambda v: v == 1,
    "layer_types": lambda v: isinstance(v, list) and all(t == "full_attention" for t in v),
    "pruned_heads": lambda v: not v,
}
_CHANGES_MATH = ("changes the computation in transformers, and this importer does not "
                 "implement it")
#: Rotary keys read per ``rope_type`` (with ``rope_theta`` and the type itself).
_ROPE_KEYS = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}


def _off(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (dict, list)) and not value)


def _check_keys(hf: dict[str, Any], directory: str) -> None:
    """Refuses a ``config.json`` key that changes the computation and is not read here (in
    one line naming it): the import must compute what transformers computes, or refuse."""
    for key, value in hf.items():
        if (key in UNDERSTOOD_KEYS or key in NO_EFFECT_KEYS or key.startswith("_")
                or key.endswith("_version") or _off(value)):
            continue
        if key in _NEUTRAL and _NEUTRAL[key](value):
            continue
        shown = json.dumps(value)[:60]
        if key in _NEUTRAL or key == "quantization_config":
            fix = {"quantization_config": "the unquantized checkpoint",
                   "partial_rotary_factor": "a fully rotary checkpoint (factor 1)"}.get(
                       key, "a checkpoint without it")
            raise _fail(directory, f"config.json {key}={shown} {_CHANGES_MATH}; use {fix}.")
        raise _fail(directory, f"config.json key {key!r}={shown} is not one this importer "
                    "knows, and it may change the computation (transformers reads every key "
                    "of config.json); remove it if it does not, or use a Llama or Mistral "
                    "checkpoint without it.")


def _rope_scaling(hf: dict[str, Any], directory: str) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, TransformerConfig rotary-scaling fields)`` of ``rope_parameters``
    (transformers 5, theta included) and ``rope_scaling`` (transformers 4)."""
    rope: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):
        part = hf.get(key)
        if part is not None and not isinstance(part, dict):
            raise _fail(directory, f"config.json {key}={json.dumps(part)[:60]} must be an "
                        "object (or null).")
        rope.update(part or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_KEYS:
        raise _fail(directory, f"config.json rope_scaling type {rope_type!r} is not "
                    "supported; supported: default, linear, llama3.")
    read = {"rope_type", "type", "rope_theta", *_ROPE_KEYS[rope_type]}
    for key, value in rope.items():
        if key in read or _off(value) or (key in _NEUTRAL and _NEUTRAL[key](value)):
            continue
        why = (_CHANGES_MATH if key in _NEUTRAL else
               f"is not read for rope type {rope_type!r}, and it may change the computation")
        raise _fail(directory, f"config.json rope_scaling {key}={json.dumps(value)[:60]} "
                    f"{why}; use a checkpoint without it.")
    values = {}
    for key in ("rope_theta", *_ROPE_KEYS[rope_type]):
        value = rope.get(key, hf.get(key, 10000.0) if key == "rope_theta" else None)
        if value is None:
            raise _fail(directory, f"config.json rope_scaling of type {rope_type!r} lacks "
                        f"{key!r}; add it (transformers needs it too).")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(directory, f"config.json rope_scaling {key}={json.dumps(value)[:60]} "
                        "must be a number.")
        values[key] = value
    scaling: dict[str, Any] = {}
    if rope_type == "linear":
        scaling = dict(rope_scaling="linear", rope_factor=float(values["factor"]))
    elif rope_type == "llama3":
        scaling = dict(rope_scaling="llama3", rope_factor=float(values["factor"]),
                       rope_low_freq_factor=float(values["low_freq_factor"]),
                       rope_high_freq_factor=float(values["high_freq_factor"]),
                       rope_original_max_len=int(values["original_max_position_embeddings"]))
    return float(values["rope_theta"]), scaling


def config_from_hf(hf: dict[str, Any], directory: str = "<config>",
                   **overrides: Any) -> TransformerConfig:
    """The `TransformerConfig` of a Hugging Face ``config.json`` (a dict).

    Args:
      hf: the parsed ``config.json`` (``model_type`` "llama" or "mistral").
      directory: named in errors.
      overrides: further `TransformerConfig` fields (compute dtype, remat, ...).

    Raises:
      UsageError: a field this model cannot express, named (another architecture, a sliding
        window, attention or MLP biases, an activation other than SiLU, an unknown rotary
        scaling or one missing a field), or any other key that changes the computation
        (``partial_rotary_factor``, ``quantization_config``, a key this importer does not
        know: `UNDERSTOOD_KEYS` are read, `NO_EFFECT_KEYS` never change the logits).
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise _fail(directory, f"config.json model_type={model_type!r} (architectures="
                    f"{hf.get('architectures')}) is not supported; supported: "
                    f"{list(SUPPORTED_TYPES)} (Llama-family decoders).")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise _fail(directory, f"config.json {key}=true is not supported (the built-in "
                        "model has no projection biases).")
    if hf.get("sliding_window") is not None:
        raise _fail(directory, f"config.json sliding_window={hf['sliding_window']} is not "
                    "supported (full causal attention only); use a checkpoint without it.")
    if hf.get("hidden_act", "silu") != "silu":
        raise _fail(directory, f"config.json hidden_act={hf.get('hidden_act')!r} is not "
                    "supported (SwiGLU with silu only).")
    _check_keys(hf, directory)
    theta, scaling = _rope_scaling(hf, directory)

    def number(key: str, default: Any = None, kind: type = int) -> Any:
        value = hf.get(key)
        value = default if value is None else value  # null: transformers' default too
        if value is None:
            raise _fail(directory, f"config.json lacks {key!r}.")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                kind is int and value != int(value)):
            raise _fail(directory, f"config.json {key}={json.dumps(value)[:60]} must be "
                        f"{'an integer' if kind is int else 'a number'}.")
        return kind(value)

    heads, width = number("num_attention_heads"), number("hidden_size")
    fields = dict(
        vocab_size=number("vocab_size"), d_model=width, n_heads=heads,
        n_kv_heads=number("num_key_value_heads", heads),
        head_dim=number("head_dim", width // max(heads, 1)),
        n_layers=number("num_hidden_layers"), d_ff=number("intermediate_size"),
        max_seq_len=number("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=theta, norm_eps=number("rms_norm_eps", 1e-6, float))
    try:
        return TransformerConfig(**fields, **scaling, **overrides)
    except (TypeError, ValueError) as err:
        raise _fail(directory, f"config.json describes no valid model: "
                    f"{' '.join(str(err).split())}") from None


def config_to_hf(cfg: TransformerConfig, dtype: str = "float32") -> dict[str, Any]:
    """The Hugging Face ``config.json`` (Llama) of `cfg`."""
    rope_scaling = None
    if cfg.rope_scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": cfg.rope_factor}
    elif cfg.rope_scaling == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": cfg.rope_factor,
                        "low_freq_factor": cfg.rope_low_freq_factor,
                        "high_freq_factor": cfg.rope_high_freq_factor,
                        "original_max_position_embeddings": cfg.rope_original_max_len}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "torch_dtype": dtype,
    }


# ----------------------------------------------------------------------------- reading


def _checked_weight_map(weight_map: Any, directory: str) -> dict[str, str]:
    """The index's ``weight_map``, each file name relative and inside `directory`: a name
    that leaves it (``../x.safetensors``, an absolute path) is refused, never read."""
    if not isinstance(weight_map, dict):
        raise _fail(directory, f"{_INDEX}: weight_map must be an object of tensor name to "
                    "file name.")
    root = os.path.normpath(os.path.abspath(directory))
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise _fail(directory, f"{_INDEX}: tensor {tensor!r} names the file "
                        f"{json.dumps(name)[:60]}, not a file name.")
        where = os.path.normpath(os.path.join(root, name))
        if os.path.isabs(name) or os.path.commonpath([root, where]) != root or where == root:
            raise _fail(directory, f"{_INDEX}: tensor {tensor!r} names the file {name!r}, "
                        "outside the checkpoint folder; a checkpoint's files must lie in "
                        "its folder (file names relative to it, no '..').")
    return weight_map


class _Reader:
    """Lazy access to a checkpoint's tensors by HF name (one open file per shard)."""

    def __init__(self, directory: str):
        from safetensors import safe_open  # noqa: PLC0415

        self.directory = directory
        index = os.path.join(directory, _INDEX)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as err:
                raise _fail(directory, f"{_INDEX} is unreadable ({err}).") from None
        elif os.path.exists(os.path.join(directory, _SINGLE)):
            weight_map = None
        else:
            raise _fail(directory, f"neither {_SINGLE} nor {_INDEX} is there; point it at a "
                        "directory written by save_pretrained (safetensors weights).")
        if weight_map is not None:
            weight_map = _checked_weight_map(weight_map, directory)
        files = sorted(set(weight_map.values())) if weight_map else [_SINGLE]
        missing = [f for f in files if not os.path.exists(os.path.join(directory, f))]
        if missing:
            raise _fail(directory, f"shard file {missing[0]!r} named in {_INDEX} is missing.")
        self.handles = {f: safe_open(os.path.join(directory, f), "numpy") for f in files}
        if weight_map is None:
            weight_map = {k: _SINGLE for k in self.handles[_SINGLE].keys()}
        self.weight_map = weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.weight_map:
            raise _fail(self.directory, f"tensor {name!r} is missing.")
        return tuple(self.handles[self.weight_map[name]].get_slice(name).get_shape())

    def rows_cols(self, name: str, rows: np.ndarray, cols: np.ndarray | None) -> np.ndarray:
        """``W[rows][:, cols]`` (1-D tensors: ``W[rows]``), reading only the bounding box."""
        sl = self.handles[self.weight_map[name]].get_slice(name)
        r0, r1 = int(rows.min()), int(rows.max()) + 1
        if cols is None:
            return np.asarray(sl[r0:r1])[rows - r0]
        c0, c1 = int(cols.min()), int(cols.max()) + 1
        return np.asarray(sl[r0:r1, c0:c1])[rows - r0][:, cols - c0]


def _hf_names(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of `cfg` with its shape."""
    d, hd, f = cfg.d_model, cfg.head_size, cfg.d_ff
    names = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = (cfg.vocab_size, d)
    for n in range(cfg.n_layers):
        pre = f"model.layers.{n}."
        names.update({
            pre + "input_layernorm.weight": (d,),
            pre + "post_attention_layernorm.weight": (d,),
            pre + "self_attn.q_proj.weight": (cfg.n_heads * hd, d),
            pre + "self_attn.k_proj.weight": (cfg.kv_heads * hd, d),
            pre + "self_attn.v_proj.weight": (cfg.kv_heads * hd, d),
            pre + "self_attn.o_proj.weight": (d, cfg.n_heads * hd),
            pre + "mlp.gate_proj.weight": (f, d),
            pre + "mlp.up_proj.weight": (f, d),
            pre + "mlp.down_proj.weight": (d, f),
        })
    return names


#: Our parameter path -> (HF name per layer and fused part, kind). ``kind``: how the HF
#: ``[out, in]`` matrix maps onto the per-layer kernel's dims (see `_block`).
def _sources(cfg: TransformerConfig) -> dict[str, tuple[Callable[[int], list[str]], str]]:
    lay = "model.layers.{}."
    out = {
        "embed/embedding": (lambda n: ["model.embed_tokens.weight"], "rows"),
        "final_norm/scale": (lambda n: ["model.norm.weight"], "vector"),
        "blocks/attn_norm/scale": (lambda n: [(lay + "input_layernorm.weight").format(n)],
                                   "vector"),
        "blocks/mlp_norm/scale": (
            lambda n: [(lay + "post_attention_layernorm.weight").format(n)], "vector"),
        "blocks/attn/out/kernel": (lambda n: [(lay + "self_attn.o_proj.weight").format(n)],
                                   "heads_in"),
        "blocks/mlp/gate_up/kernel": (
            lambda n: [(lay + f"mlp.{p}_proj.weight").format(n) for p in ("gate", "up")],
            "fused_out"),
        "blocks/mlp/down/kernel": (lambda n: [(lay + "mlp.down_proj.weight").format(n)], "in"),
    }
    if not cfg.tie_embeddings:
        out["lm_head/kernel"] = (lambda n: ["lm_head.weight"], "in")
    if cfg.grouped:
        out["blocks/attn/q/kernel"] = (lambda n: [(lay + "self_attn.q_proj.weight").format(n)],
                                       "heads_out")
        out["blocks/attn/kv/kernel"] = (
            lambda n: [(lay + f"self_attn.{p}_proj.weight").format(n) for p in "kv"],
            "parts_heads_out")
    else:
        out["blocks/attn/qkv/kernel"] = (
            lambda n: [(lay + f"self_attn.{p}_proj.weight").format(n) for p in "qkv"],
            "parts_heads_out")
    return out


def _block(reader: _Reader, names: list[str], kind: str, idx: list[np.ndarray],
           shape: tuple[int, ...]) -> np.ndarray:
    """One layer's kernel ``[...]`` of logical per-layer `shape`, at per-dim indices `idx`.

    HF matrices are ``W[out, in]``; an NNX kernel is ``[in..., out...]``.
    """
    if kind == "vector":
        return reader.rows_cols(names[0], idx[0], None)
    if kind == "rows":  # embedding [V, d] == W
        return reader.rows_cols(names[0], idx[0], idx[1])
    if kind == "in":  # [in, out] == W.T
        return reader.rows_cols(names[0], idx[1], idx[0]).T
    if kind == "heads_out":  # [d, H, hd]: out feature h * hd + e
        hd = shape[2]
        rows = (idx[1][:, None] * hd + idx[2][None, :]).ravel()
        return reader.rows_cols(names[0], rows, idx[0]).T.reshape(
            len(idx[0]), len(idx[1]), len(idx[2]))
    if kind == "parts_heads_out":  # [d, parts, H, hd]
        hd = shape[3]
        rows = (idx[2][:, None] * hd + idx[3][None, :]).ravel()
        parts = [reader.rows_cols(names[p], rows, idx[0]).T.reshape(
            len(idx[0]), len(idx[2]), len(idx[3])) for p in idx[1]]
        return np.stack(parts, axis=1)
    if kind == "heads_in":  # [H, hd, d]: in feature h * hd + e
        hd = shape[1]
        cols = (idx[0][:, None] * hd + idx[1][None, :]).ravel()
        return reader.rows_cols(names[0], idx[2], cols).T.reshape(
            len(idx[0]), len(idx[1]), len(idx[2]))
    if kind == "fused_out":  # [d, n * f]: [gate | up]
        f = shape[1] // len(names)
        out = None
        for p in range(len(names)):
            mask = idx[1] // f == p
            if not mask.any():
                continue
            part = reader.rows_cols(names[p], idx[1][mask] % f, idx[0]).T
            if out is None:
                out = np.zeros((len(idx[0]), len(idx[1])), part.dtype)
            out[:, mask] = part
        return out
    raise AssertionError(kind)


def _read_logical(reader: _Reader, source: tuple, idx: list[np.ndarray], stacked: bool,
                  shape: tuple[int, ...]) -> np.ndarray:
    names_of, kind = source
    if not stacked:
        return _block(reader, names_of(0), kind, idx, shape)
    return np.stack([_block(reader, names_of(int(n)), kind, idx[1:], shape[1:])
                     for n in idx[0]])


def _index_maps(plan: ParamPlan | SplitPlan | None, stored_shape: tuple[int, ...],
                logical_shape: tuple[int, ...]) -> list[np.ndarray]:
    """Per stored dim: the logical index each stored position holds (-1: padding)."""
    maps = []
    for dim, n in enumerate(logical_shape):
        m = np.arange(1, n + 1, dtype=np.int64)
        if plan is not None:
            for s in plan.splits:
                if s.dim + int(plan.stacked) == dim:
                    m = np.asarray(s.to_stored(jnp.asarray(m), 0))
            if isinstance(plan, ParamPlan) and dim == plan.stored_dim:
                m = np.pad(m, (0, plan.spec.padded_size - len(m)))
        assert len(m) == stored_shape[dim], (plan, dim, len(m), stored_shape)
        maps.append(m - 1)
    return maps


def _stored_array(reader: _Reader, source: tuple, plan: Any, sharding: NamedSharding,
                  stored_shape: tuple[int, ...], logical_shape: tuple[int, ...],
                  stacked: bool, dtype: Any) -> jax.Array:
    maps = _index_maps(plan, stored_shape, logical_shape)

    def shard_data(index: tuple[slice, ...]) -> np.ndarray:
        sub = [m[i] for m, i in zip(maps, index)]
        out = np.zeros(tuple(len(s) for s in sub), dtype)
        keep = [s >= 0 for s in sub]
        real = [s[k] for s, k in zip(sub, keep)]
        if all(len(r) for r in real):
            out[np.ix_(*keep)] = _read_logical(reader, source, real, stacked,
                                               logical_shape).astype(dtype)
        return out

    return jax.make_array_from_callback(stored_shape, sharding, shard_data)


def read_config(directory: str, **overrides: Any) -> TransformerConfig:
    """The `TransformerConfig` of the checkpoint in `directory` (its ``config.json``), with
    `overrides` (`config_from_hf`). Raises `UsageError` as `from_hf` does."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise _fail(directory, "no such directory.")
    try:
        with open(os.path.join(directory, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError) as err:
        raise _fail(directory, f"config.json is missing or unreadable ({err}).") from None
    if not isinstance(hf, dict):
        raise _fail(directory, "config.json is not a JSON object.")
    return config_from_hf(hf, directory, **overrides)


def from_hf(directory: str, *, mesh: Any = None, gtp_config: GTPConfig | None = None,
            dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
            config: TransformerConfig | None = None,
            **overrides: Any) -> Transformer | ShardedModule:
    """A `Transformer` with the weights of a Hugging Face Llama-family checkpoint.

    Args:
      directory: a ``save_pretrained`` directory: ``config.json`` and ``model.safetensors``
        (or shards listed in ``model.safetensors.index.json``).
      mesh: place the model on this mesh (`gtp_jax.shard` layout with `gtp_config`); each
        device's shard is read straight from the files. None: an unsharded model.
      gtp_config: the `GTPConfig` of the sharded model (default ``GTPConfig()``).
      dtype: compute dtype; param_dtype: stored dtype (weights are converted to it).
      config: the model's `TransformerConfig` instead of the one config.json implies
        (e.g. with other computation options); the tensors must have its shapes.
      overrides: further `TransformerConfig` fields (remat, attention_impl, ...).

    Returns:
      A `Transformer` (no mesh) or a `gtp_jax.ShardedModule` wrapping one.

    Raises:
      UsageError: a missing or unreadable directory, config or shard file, a tensor that
        is missing or of another shape than config.json implies, or an unsupported config
        (the field is named).
    """
    directory = os.fspath(directory)
    cfg = read_config(directory, dtype=dtype, param_dtype=param_dtype, **overrides)
    if config is not None:
        cfg = config
    reader = _Reader(directory)
    for name, shape in _hf_names(cfg).items():
        got = reader.shape(name)
        if got != shape:
            raise _fail(directory, f"tensor {name!r} has shape {list(got)}, but config.json "
                        f"implies {list(shape)}.")
    sources = _sources(cfg)
    np_dtype = np.dtype(cfg.param_dtype)

    def build() -> Any:
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        return model if mesh is None else shard(model, mesh, gtp_config)

    abstract = nnx.eval_shape(build)
    inner = abstract if mesh is None else abstract.module
    placements = {} if mesh is None else abstract.placements()
    graphdef, state = nnx.split(inner)
    for keys, var in nnx.to_flat_state(state):
        path = path_str(keys)
        value = var.get_value()
        if path not in sources:
            raise AssertionError(f"no Hugging Face source for parameter {path!r}")
        stacked = path.startswith("blocks/")
        plan = placements.get(path)
        logical = tuple(var.get_metadata().get("gtp_logical_shape", value.shape))
        if mesh is None:
            data = _read_logical(reader, sources[path],
                                 [np.arange(n) for n in value.shape], stacked,
                                 tuple(value.shape)).astype(np_dtype)
            var.set_value(jnp.asarray(data))
            continue
        spec = plan.partition_spec(len(value.shape)) if plan is not None else P()
        var.set_value(_stored_array(reader, sources[path], plan, NamedSharding(mesh, spec),
                                    tuple(value.shape), logical, stacked, np_dtype))
    model = nnx.merge(graphdef, state)
    if mesh is None:
        return model
    return ShardedModule(model, mesh=mesh, config=abstract.config, plan=abstract.plan,
                         split_plan=abstract.split_plan)


# ----------------------------------------------------------------------------- writing


def _layer_value(module: Any, path: str, layer: int | None) -> np.ndarray:
    """The full logical value of one parameter (one layer of a stacked one) on the host."""
    var = _find(module, path)
    value = var.get_value()
    if not isinstance(module, ShardedModule):
        return np.asarray(value if layer is None else value[layer])
    plan = module.placements().get(path)
    if plan is None:
        return np.asarray(jax.device_get(value if layer is None else value[layer]))
    if layer is not None:
        value = value[layer]
        plan = dataclasses.replace(plan, stacked=False)
    full = _gather_fn(plan, NamedSharding(module.mesh, P()))(value)
    return np.asarray(jax.device_get(full))


_GATHER_CACHE: dict = {}


def _gather_fn(plan: Any, sharding: NamedSharding) -> Callable:
    key = (plan, sharding)
    if key not in _GATHER_CACHE:
        _GATHER_CACHE[key] = jax.jit(plan.from_stored, out_shardings=sharding)
    return _GATHER_CACHE[key]


def _find(module: Any, path: str) -> nnx.Variable:
    node = module.module if isinstance(module, ShardedModule) else module
    for key in path.split("/"):
        node = getattr(node, key)
    return node


def _hf_tensors(module: Any, cfg: TransformerConfig, layer: int | None):
    """``(name, array)`` of one layer's HF tensors (or the non-layer ones for None)."""
    hd = cfg.head_size
    if layer is None:
        yield "model.embed_tokens.weight", _layer_value(module, "embed/embedding", None)
        yield "model.norm.weight", _layer_value(module, "final_norm/scale", None)
        if not cfg.tie_embeddings:
            yield "lm_head.weight", _layer_value(module, "lm_head/kernel", None).T
        return
    pre = f"model.layers.{layer}."

    def get(path: str) -> np.ndarray:
        return _layer_value(module, path, layer)

    yield pre + "input_layernorm.weight", get("blocks/attn_norm/scale")
    yield pre + "post_attention_layernorm.weight", get("blocks/mlp_norm/scale")
    if cfg.grouped:
        q = get("blocks/attn/q/kernel")
        kv = get("blocks/attn/kv/kernel")
        parts = {"q": q, "k": kv[:, 0], "v": kv[:, 1]}
    else:
        qkv = get("blocks/attn/qkv/kernel")
        parts = {"q": qkv[:, 0], "k": qkv[:, 1], "v": qkv[:, 2]}
    for p in "qkv":
        w = parts[p]  # [d, heads, hd]
        yield pre + f"self_attn.{p}_proj.weight", w.reshape(w.shape[0], -1).T
    o = get("blocks/attn/out/kernel")  # [H, hd, d]
    yield pre + "self_attn.o_proj.weight", o.reshape(cfg.n_heads * hd, -1).T
    gu = get("blocks/mlp/gate_up/kernel")  # [d, 2f]
    yield pre + "mlp.gate_proj.weight", gu[:, :cfg.d_ff].T
    yield pre + "mlp.up_proj.weight", gu[:, cfg.d_ff:].T
    yield pre + "mlp.down_proj.weight", get("blocks/mlp/down/kernel").T


def to_hf(model: Transformer | ShardedModule, directory: str, *,
          max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Writes `model` as a Hugging Face Llama checkpoint (``config.json``, safetensors).

    Tensors are gathered one layer at a time (a replicated copy of one weight per device,
    never the whole model) and written in the parameter dtype, into ``model.safetensors``
    or, beyond `max_shard_bytes`, numbered shards plus ``model.safetensors.index.json``;
    the host holds at most one file's tensors. Under several processes only process 0
    writes (every process must call it: the gathers are collective).

    Args:
      model: a `Transformer` or a `gtp_jax.ShardedModule` wrapping one.
      directory: created if absent; existing files of the same names are replaced, and the
        export owns the weight files there: older ``model*.safetensors``,
        ``pytorch_model*.bin`` and their index files that it did not write are removed (a
        reader would load them instead of, or mixed with, the new weights). Other files
        are left as they are. The files are written aside first and moved in together:
        an export that fails leaves the folder as it was.
      max_shard_bytes: the largest file written.

    Returns:
      The names of the weight files written.
    """
    inner = model.module if isinstance(model, ShardedModule) else model
    if not isinstance(inner, Transformer):
        raise UsageError(f"to_hf(model=...): expected a gtp_jax.models.Transformer (sharded or "
                         f"not), got {type(inner).__name__}.")
    cfg = inner.cfg
    if cfg.moe_experts:
        raise UsageError(f"to_hf(model=...): the model has {cfg.moe_experts} experts per MLP; "
                         "a Hugging Face Llama checkpoint has a dense MLP. Nothing was written.")
    writer = jax.process_index() == 0
    stage = None
    if writer:
        os.makedirs(directory, exist_ok=True)
        # Every file is written into a folder of its own inside `directory` and moved into
        # place only when all are written: a failed export leaves the folder as it was.
        stage = tempfile.mkdtemp(prefix=".gtp_jax-export-", dir=directory)
    try:
        files, many = _write_hf(model, cfg, stage, max_shard_bytes)
        if writer:
            for name in os.listdir(stage):
                os.replace(os.path.join(stage, name), os.path.join(directory, name))
            _remove_stale_weights(directory, {*files, *([_INDEX] if many else [])})
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
    return files


def _write_hf(model: Transformer | ShardedModule, cfg: TransformerConfig, directory: str | None,
              max_shard_bytes: int) -> tuple[list[str], bool]:
    """`to_hf`'s files, written into `directory` (process 0; None on the others, which only
    take part in the gathers): the weight file names and whether they are shards."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    dtype = np.dtype(cfg.param_dtype)
    writer = directory is not None
    mode = None
    if writer:
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config_to_hf(cfg, dtype.name), f, indent=2)
        # safetensors creates its files owner-only; the weights are read by whoever may
        # read the config beside them (a colleague's from_pretrained needs both).
        mode = stat.S_IMODE(os.stat(os.path.join(directory, "config.json")).st_mode)
    total = sum(math.prod(s) for s in _hf_names(cfg).values()) * dtype.itemsize
    many = total > max_shard_bytes
    files: list[str] = []
    weight_map: dict[str, str] = {}
    pending: dict[str, np.ndarray] = {}

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors" if many else _SINGLE
        if writer:
            save_file(pending, os.path.join(directory, name), metadata={"format": "pt"})
            os.chmod(os.path.join(directory, name), mode)
        files.append(name)
        weight_map.update({k: name for k in pending})
        pending.clear()

    size = 0
    for layer in [None, *range(cfg.n_layers)]:
        for name, value in _hf_tensors(model, cfg, layer):
            value = np.ascontiguousarray(value.astype(dtype))
            if pending and size + value.nbytes > max_shard_bytes:
                flush()
                size = 0
            pending[name] = value
            size += value.nbytes
    flush()
    if many:
        renamed = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                   for i in range(len(files))]
        if writer:
            for old, new in zip(files, renamed):
                os.replace(os.path.join(directory, old), os.path.join(directory, new))
        mapping = dict(zip(files, renamed))
        weight_map = {k: mapping[v] for k, v in weight_map.items()}
        files = renamed
        if writer:
            with open(os.path.join(directory, _INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                          indent=2)
    return files, many


#: The weight files and indexes ``from_pretrained`` reads (safetensors, then PyTorch's).
_HF_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)"
                             r"|(model\.safetensors|pytorch_model\.bin)\.index\.json")


def _remove_stale_weights(directory: str, written: set[str]) -> None:
    """Removes the Hugging Face weight files and indexes in `directory` that this export did
    not write: transformers reads ``model.safetensors`` before an index, so an older one left
    beside new shards (or old shards beside a new single file) would be loaded instead, or
    mixed in. Only those names are touched; every other file stays."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name not in written and _HF_WEIGHT_FILE.fullmatch(name) and (
                os.path.isfile(path) or os.path.islink(path)):
            os.remove(path)
