"""Writes the tiny Hugging Face checkpoints and reference logits of tests/test_hf.py.

Needs torch and transformers (not needed by the tests themselves, which read the files
this writes). Run from the repository root:

    python tools/make_hf_fixtures.py            # -> tests/data/hf/<name>/

Each fixture is a random float32 model saved with ``save_pretrained`` plus ``tokens.npy``
(int32 ``[8, 12]``) and ``logits.npy`` (float32 ``[8, 12, vocab]``: the PyTorch model's
logits for those tokens). The set covers grouped-query and multi-head attention, tied and
untied embeddings, rotary scaling off / linear / llama3, an explicit head_dim, and a
checkpoint split into several files with an index.
"""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import torch
import transformers

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "hf")
VOCAB = 67
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

FIXTURES = {
    # grouped-query (4 query heads, 2 kv heads), untied, Llama 3 rotary scaling
    "llama_gqa_llama3": (transformers.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_scaling=LLAMA3), None),
    # multi-head, tied embeddings, linear rotary scaling
    "llama_mha_tied_linear": (transformers.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0}), None),
    # Mistral: grouped-query with head_dim 16 != hidden / heads, no scaling, saved in shards
    "mistral_gqa_sharded": (transformers.MistralConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None,
        tie_word_embeddings=False), "20KB"),
}


def main() -> None:
    torch.manual_seed(0)
    tokens = np.random.RandomState(0).randint(0, VOCAB, (8, 12)).astype(np.int32)
    for name, (cls, extra, shard_size) in FIXTURES.items():
        path = os.path.join(OUT, name)
        shutil.rmtree(path, ignore_errors=True)
        model = cls(**COMMON, **extra)
        net = transformers.AutoModelForCausalLM.from_config(model, dtype=torch.float32)
        net.eval()
        kwargs = {"max_shard_size": shard_size} if shard_size else {}
        net.save_pretrained(path, **kwargs)
        for extra_file in ("generation_config.json",):
            if os.path.exists(os.path.join(path, extra_file)):
                os.remove(os.path.join(path, extra_file))
        with torch.no_grad():
            logits = net(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
        np.save(os.path.join(path, "tokens.npy"), tokens)
        np.save(os.path.join(path, "logits.npy"), logits.astype(np.float32))
        print(name, sorted(os.listdir(path)), file=sys.stderr)


if __name__ == "__main__":
    main()
