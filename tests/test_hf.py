"""Hugging Face Llama-family import and export (`gtp_jax.models.hf`), grouped-query attention.

The fixtures in tests/data/hf (written by tools/make_hf_fixtures.py with transformers and
torch, float32) hold tiny random Llama / Mistral checkpoints and the PyTorch model's logits
for fixed tokens: grouped-query and multi-head attention, tied and untied embeddings, rotary
scaling off / linear / llama3, an explicit head_dim, a checkpoint split over several files,
and a vocabulary (67) that divides no mesh axis.

Tolerances: imported logits agree with PyTorch's to `RTOL` = 1e-5 of max|logits| (float32:
the same products, summed in another order by another library; observed ~3e-7). Exports
and re-imports copy float32 values without arithmetic, so they are compared bit for bit.
GQA under tensor parallelism is compared with the unsharded model over training steps by
tests/test_tp.py's `run_case` (float32 tolerance justified there).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import get_mesh, path_str

import gtp_jax
from gtp_jax.base.errors import UsageError
from gtp_jax.models import PRESETS, Transformer, from_hf, preset, to_hf
from gtp_jax.models.hf import config_to_hf

DATA = os.path.join(os.path.dirname(__file__), "data", "hf")
FIXTURES = ("llama_gqa_llama3", "llama_mha_tied_linear", "mistral_gqa_sharded")
RTOL = 1e-5


def _fixture(name: str) -> tuple[str, np.ndarray, np.ndarray]:
    path = os.path.join(DATA, name)
    return path, np.load(os.path.join(path, "tokens.npy")), np.load(
        os.path.join(path, "logits.npy"))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _params(model) -> dict[str, np.ndarray]:
    if isinstance(model, gtp_jax.ShardedModule):
        return {k: np.asarray(v) for k, v in gtp_jax.unshard_values(model, model).items()}
    return {path_str(k): np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _tensors(directory: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


@nnx.jit
def _logits(model, tokens):
    return model(tokens).logits


@pytest.mark.parametrize("name", FIXTURES)
def test_import_matches_pytorch_logits(name) -> None:
    path, tokens, ref = _fixture(name)
    model = from_hf(path)
    assert _rel(_logits(model, jnp.asarray(tokens)), ref) < RTOL


@pytest.mark.parametrize("name,mesh_name", [
    ("llama_gqa_llama3", "dp2_gtp4"), ("llama_mha_tied_linear", "dp2_gtp2_tp2"),
    ("mistral_gqa_sharded", "gtp2_tp4"), ("llama_gqa_llama3", "cp2_gtp2_tp2")])
def test_sharded_import_matches_pytorch_logits(name, mesh_name) -> None:
    """Each device's shard is read from the files (tp splits, kv heads replicated on tp=4
    where 2 kv heads do not divide it, GTP padding of the 67-token vocabulary, ring
    attention over cp)."""
    path, tokens, ref = _fixture(name)
    model = from_hf(path, mesh=get_mesh(mesh_name),
                    gtp_config=gtp_jax.GTPConfig(min_elements=0))
    logits = _logits(model, jax.device_put(jnp.asarray(tokens),
                                           gtp_jax.data_sharding(model.mesh)))
    assert _rel(logits, ref) < RTOL
    # the stored arrays hold exactly the unsharded import's weights
    full = _params(from_hf(path))
    for k, v in _params(model).items():
        np.testing.assert_array_equal(v, full[k], err_msg=k)


@pytest.mark.parametrize("name,mesh_name", [*((n, None) for n in FIXTURES),
                                             ("mistral_gqa_sharded", "dp2_gtp2_tp2")])
def test_export_reimport_is_bit_exact(name, mesh_name, tmp_path) -> None:
    path, _, _ = _fixture(name)
    mesh = None if mesh_name is None else get_mesh(mesh_name)
    model = from_hf(path, mesh=mesh)
    to_hf(model, str(tmp_path), max_shard_bytes=20_000)
    theirs, ours = _tensors(path), _tensors(str(tmp_path))
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape, k
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(theirs)
    again = _params(from_hf(str(tmp_path), mesh=mesh))
    for k, v in _params(model).items():
        np.testing.assert_array_equal(again[k], v, err_msg=k)


def test_train_export_import_is_bit_exact(tmp_path) -> None:
    """Import -> 20 AdamW steps on dp2 x gtp2 x tp2 -> export -> import: the same weights."""
    from test_tp import lm_step, make_optimizer

    path, tokens, _ = _fixture("llama_gqa_llama3")
    mesh = get_mesh("dp2_gtp2_tp2")
    model = from_hf(path, mesh=mesh)
    before = _params(model)
    opt = make_optimizer(model, mesh)
    batch = jax.device_put(jnp.asarray(tokens), gtp_jax.data_sharding(mesh))
    losses = [float(lm_step(model, opt, batch)[0]) for _ in range(20)]
    assert losses[-1] < losses[0]
    trained = _params(model)
    assert all(np.any(trained[k] != before[k]) for k in before)
    to_hf(model, str(tmp_path))
    again = _params(from_hf(str(tmp_path), mesh=mesh))
    for k, v in trained.items():
        np.testing.assert_array_equal(again[k], v, err_msg=k)


def _copy(name: str, tmp_path) -> str:
    dst = str(tmp_path / name)
    shutil.copytree(os.path.join(DATA, name), dst)
    return dst


def _edit_config(directory: str, **changes) -> None:
    cfg_path = os.path.join(directory, "config.json")
    cfg = json.load(open(cfg_path))
    cfg.update(changes)
    json.dump(cfg, open(cfg_path, "w"))


@pytest.mark.parametrize("case,needle", [
    ("no_dir", "no such directory"),
    ("missing_shard", "model-00003-of-00007.safetensors"),
    ("shape", "'model.layers.0.mlp.gate_proj.weight' has shape [48, 32]"),
    ("architecture", "model_type='gpt2'"),
    ("sliding_window", "sliding_window=4096"),
    ("bias", "attention_bias=true"),
    ("act", "hidden_act='gelu'"),
    ("rope", "rope_scaling type 'yarn'"),
])
def test_bad_checkpoints_give_one_clear_line(case, needle, tmp_path) -> None:
    path = _copy("mistral_gqa_sharded", tmp_path)
    if case == "no_dir":
        path = str(tmp_path / "nowhere")
    elif case == "missing_shard":
        os.remove(os.path.join(path, "model-00003-of-00007.safetensors"))
    elif case == "shape":
        _edit_config(path, intermediate_size=64)
    elif case == "architecture":
        _edit_config(path, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    elif case == "sliding_window":
        _edit_config(path, sliding_window=4096)
    elif case == "bias":
        _edit_config(path, attention_bias=True)
    elif case == "act":
        _edit_config(path, hidden_act="gelu")
    elif case == "rope":
        _edit_config(path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UsageError) as err:
        from_hf(path)
    msg = str(err.value)
    assert "\n" not in msg and needle in msg, msg


def test_llama_presets_copy_the_published_shapes() -> None:
    """Parameter counts of Llama 3.2 1B / 3B and Llama 3 8B, and their config.json values."""
    counts = {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824,
              "llama3-8b": 8_030_261_248}
    for name, count in counts.items():
        assert PRESETS[name].num_params() == count, name
    hf = config_to_hf(PRESETS["llama3.2-1b"])
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"],
            hf["num_key_value_heads"], hf["head_dim"], hf["intermediate_size"],
            hf["vocab_size"], hf["rope_theta"], hf["rms_norm_eps"],
            hf["tie_word_embeddings"]) == (2048, 16, 32, 8, 64, 8192, 128256, 500000.0, 1e-5,
                                           True)
    assert hf["rope_scaling"]["factor"] == 32.0
    assert config_to_hf(PRESETS["llama3-8b"])["rope_scaling"] is None


def test_llama3_70b_preset_has_the_published_shape() -> None:
    """Llama 3 70B's config.json values and its 70.55B parameters, counted in closed form and
    from the abstract model (`nnx.eval_shape`: nothing of its 282 GB is allocated)."""
    cfg = PRESETS["llama3-70b"]
    hf = config_to_hf(cfg)
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"],
            hf["num_key_value_heads"], hf["head_dim"], hf["intermediate_size"],
            hf["vocab_size"], hf["rope_theta"], hf["rms_norm_eps"],
            hf["tie_word_embeddings"], hf["rope_scaling"]) == (
        8192, 80, 64, 8, 128, 28672, 128256, 500000.0, 1e-5, False, None)
    assert cfg.num_params() == 70_553_706_496
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    counted = sum(int(np.prod(v.get_value().shape))
                  for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert counted == cfg.num_params()


GQA_CFG = preset("tiny", d_model=32, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64,
                 vocab_size=67, n_layers=2, rope_scaling="llama3", rope_factor=8.0,
                 rope_original_max_len=8)


@pytest.mark.slow  # about a minute each on 2 cores, as tests/test_tp.py
@pytest.mark.parametrize("mesh_sizes", [{"dp": 2, "gtp": 2, "tp": 2}, {"gtp": 2, "tp": 4}],
                         ids=["kv_split_tp2", "kv_replicated_tp4"])
def test_gqa_tp_trains_like_unsharded(mesh_sizes, seed) -> None:
    """Grouped-query attention under tp: kv heads split (2 over tp=2) or replicated (2 on
    tp=4); loss, logits, gradients and parameters match the unsharded model over steps."""
    from test_tp import run_case

    run_case(mesh_sizes, GQA_CFG, 13, seed % 1000, gtp_jax.GTPConfig(min_elements=0))


def test_existing_presets_keep_their_layout() -> None:
    """Multi-head presets keep the fused qkv projection (old checkpoints restore)."""
    model = nnx.eval_shape(lambda: Transformer(preset("tiny"), rngs=nnx.Rngs(0)))
    assert model.blocks.attn.qkv.kernel.shape == (2, 128, 3, 4, 32)
    assert not hasattr(model.blocks.attn, "kv")


def test_live_export_loads_in_transformers(tmp_path) -> None:
    """Where torch and transformers are installed: a random built-in GQA model with llama3
    rotary scaling, exported, gives transformers' AutoModelForCausalLM the same logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = Transformer(GQA_CFG, rngs=nnx.Rngs(3))
    to_hf(model, str(tmp_path))
    net = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                            dtype=torch.float32)
    tokens = np.random.RandomState(1).randint(0, 67, (2, 16))
    with torch.no_grad():
        ref = net(torch.tensor(tokens)).logits.numpy()
    assert _rel(_logits(model, jnp.asarray(tokens)), ref) < RTOL


def test_checkpoint_without_new_model_fields_resumes() -> None:
    """A checkpoint written before n_kv_heads, head_dim and the rotary scaling fields
    existed resumes (missing fields compare as their defaults); a changed one is refused."""
    from test_reliability import _check_resume, _meta

    from gtp_jax.train import TrainConfig, model_config

    cfg = TrainConfig(steps=6, schedule_steps=6)
    meta = _meta(cfg)
    new = ("n_kv_heads", "head_dim", "rope_scaling", "rope_factor", "rope_low_freq_factor",
           "rope_high_freq_factor", "rope_original_max_len")
    for name in new:
        del meta["extra"]["model_config"][name]
    assert _check_resume(cfg, model_config(cfg), meta, "/ck").steps == 6
    meta["extra"]["model_config"]["rope_factor"] = 2.0
    with pytest.raises(UsageError, match="model rope_factor: checkpoint"):
        _check_resume(cfg, model_config(cfg), meta, "/ck")


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_share_the_configs_permissions(umask, tmp_path) -> None:
    # safetensors wrote owner-only files: a colleague could read config.json but not the
    # weights, and from_pretrained failed.
    model = Transformer(preset("tiny", n_kv_heads=2), rngs=nnx.Rngs(0))
    old = os.umask(umask)
    try:
        files = to_hf(model, str(tmp_path / "one"))
        files += to_hf(model, str(tmp_path / "many"), max_shard_bytes=400_000)
    finally:
        os.umask(old)
    for folder in ("one", "many"):
        mode = (tmp_path / folder / "config.json").stat().st_mode & 0o777
        assert mode == 0o666 & ~umask
        written = sorted(p.name for p in (tmp_path / folder).iterdir())
        assert {(name, (tmp_path / folder / name).stat().st_mode & 0o777)
                for name in written} == {(name, mode) for name in written}
    assert len(files) > 2


# ------------------------------------------------------------ what the import must not skip

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
           "rope_theta": 10000.0}


def _config(**changes) -> dict:
    cfg = json.load(open(os.path.join(DATA, "llama_gqa_llama3", "config.json")))
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("changes,needle", [
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "quantization_config="),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types="),
    ({"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping'"),
    ({"embedding_multiplier": 12.0}, "'embedding_multiplier'"),
    ({"auto_map": {"AutoModelForCausalLM": "custom.Model"}}, "'auto_map'"),
    ({"rope_parameters": {**_LLAMA3, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor=0.25"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "beta_fast": 32}},
     "beta_fast=32"),
    *(({"rope_parameters": {k: v for k, v in _LLAMA3.items() if k != field}},
       f"lacks '{field}'") for field in ("factor", "low_freq_factor", "high_freq_factor",
                                          "original_max_position_embeddings")),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear"}}, "lacks 'factor'"),
    ({"rope_parameters": {**_LLAMA3, "factor": "8"}}, "factor=\"8\" must be a number"),
    ({"rope_scaling": "llama3"}, "rope_scaling=\"llama3\" must be an object"),
    ({"num_hidden_layers": None}, "lacks 'num_hidden_layers'"),
    ({"hidden_size": "32"}, "hidden_size=\"32\" must be an integer"),
])
def test_config_keys_that_change_the_computation_are_refused(changes, needle) -> None:
    """transformers reads every key of config.json (unknown ones become attributes its
    generic code uses, e.g. a partial rotary factor); a key the importer does not implement,
    or a rotary field it needs and lacks, is one line naming it, never skipped."""
    with pytest.raises(UsageError) as err:
        gtp_jax.models.hf.config_from_hf(_config(**changes), "ckpt")
    msg = str(err.value)
    assert "\n" not in msg and needle in msg, msg


def test_config_keys_that_leave_the_computation_alone_are_accepted() -> None:
    """Names, versions, token ids, generation settings, off values and the neutral value of
    a computation key import the same model as the plain config."""
    plain = gtp_jax.models.hf.config_from_hf(_config(), "ckpt")
    same = gtp_jax.models.hf.config_from_hf(_config(
        _name_or_path="meta-llama/x", unsloth_version="2024.8", temperature=0.6, top_p=0.9,
        partial_rotary_factor=1.0, quantization_config=None, use_sliding_window=False,
        layer_types=["full_attention"] * 2, attention_dropout=0.1, pretraining_tp=2,
        torch_dtype="bfloat16", num_key_value_heads=2, head_dim=None), "ckpt")
    assert same == dataclasses.replace(plain, head_dim=32 // 4)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/ABS/outside.safetensors",
                                  "sub/../../outside.safetensors", ".", 7])
def test_index_files_outside_the_checkpoint_folder_are_refused(name, tmp_path) -> None:
    path = _copy("mistral_gqa_sharded", tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(os.path.join(path, "model-00001-of-00007.safetensors"), outside)
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = str(outside) if name == "/ABS/outside.safetensors" else name
    json.dump(index, open(index_path, "w"))
    with pytest.raises(UsageError) as err:
        from_hf(path)
    msg = str(err.value)
    assert "\n" not in msg and repr(first) in msg, msg


def test_an_index_file_in_a_subfolder_is_read(tmp_path) -> None:
    path = _copy("mistral_gqa_sharded", tmp_path)
    os.mkdir(os.path.join(path, "sub"))
    os.rename(os.path.join(path, "model-00001-of-00007.safetensors"),
              os.path.join(path, "sub", "model-00001-of-00007.safetensors"))
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    index["weight_map"] = {k: ("sub/" + v if v.startswith("model-00001") else v)
                           for k, v in index["weight_map"].items()}
    json.dump(index, open(index_path, "w"))
    got = _params(from_hf(path))
    want = _params(from_hf(os.path.join(DATA, "mistral_gqa_sharded")))
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_export_owns_the_weight_files_of_its_folder(tmp_path) -> None:
    """An export replaces every Hugging Face weight file and index of an older export in
    its folder (a single file beside new shards was loaded first by transformers; old
    shards beside a new single file were kept), and leaves every other file alone."""
    path, _, _ = _fixture("llama_gqa_llama3")
    model = from_hf(path)
    other = Transformer(GQA_CFG, rngs=nnx.Rngs(5))
    out = tmp_path / "export"
    to_hf(other, str(out))  # an older single-file export
    for stale in ("pytorch_model.bin", "pytorch_model-00001-of-00002.bin",
                  "pytorch_model.bin.index.json", "model-00009-of-00009.safetensors"):
        (out / stale).write_bytes(b"old")
    mine = {"README.md": b"card", "notes.txt": b"n", "model.safetensors.bak": b"b",
            "my_model.safetensors": b"m", "model-final.safetensors": b"f",
            "training_args.bin": b"t"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    (out / "model-00003-of-00003.safetensors.d").mkdir()
    sharded = to_hf(model, str(out), max_shard_bytes=20_000)
    assert len(sharded) > 1
    weights = {p.name for p in out.iterdir()} - set(mine) - {
        "config.json", "model-00003-of-00003.safetensors.d"}
    assert weights == {*sharded, "model.safetensors.index.json"}
    assert all((out / name).read_bytes() == data for name, data in mine.items())
    again = _params(from_hf(str(out)))
    for k, v in _params(model).items():
        np.testing.assert_array_equal(again[k], v, err_msg=k)
    assert to_hf(other, str(out)) == ["model.safetensors"]  # and back to one file
    weights = {p.name for p in out.iterdir()} - set(mine) - {
        "config.json", "model-00003-of-00003.safetensors.d"}
    assert weights == {"model.safetensors"}


def test_an_export_that_fails_leaves_its_folder_as_it_was(tmp_path, monkeypatch) -> None:
    """The files are written aside and moved in together: an export that fails midway (here
    at the second layer's tensors) leaves an older export and the user's files untouched and
    nothing of its own. A mixture of experts, which a Llama checkpoint cannot hold, is
    refused before anything is written, by to_hf and by the run's config."""
    import gtp_jax.models.hf as hf  # noqa: PLC0415
    from gtp_jax.train import TrainConfig  # noqa: PLC0415

    out = tmp_path / "export"
    to_hf(Transformer(GQA_CFG, rngs=nnx.Rngs(5)), str(out))
    (out / "notes.txt").write_bytes(b"n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = hf._hf_tensors

    def failing(module, cfg, layer):
        if layer == 1:
            raise OSError("No space left on device")
        yield from real(module, cfg, layer)

    monkeypatch.setattr(hf, "_hf_tensors", failing)
    with pytest.raises(OSError, match="No space left"):
        to_hf(Transformer(GQA_CFG, rngs=nnx.Rngs(6)), str(out), max_shard_bytes=20_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.setattr(hf, "_hf_tensors", real)
    moe = Transformer(dataclasses.replace(GQA_CFG, moe_experts=4), rngs=nnx.Rngs(0))
    with pytest.raises(UsageError, match=r"^to_hf\(model=...\): the model has 4 experts per "
                       r"MLP; .*Nothing was written"):
        to_hf(moe, str(tmp_path / "moe"))
    assert not (tmp_path / "moe").exists()
    with pytest.raises(UsageError, match=r"^TrainConfig.export_hf with moe_experts=4"):
        TrainConfig(moe_experts=4, export_hf=str(tmp_path / "moe"))


def test_an_export_path_that_cannot_be_written_is_refused_before_training(tmp_path) -> None:
    from gtp_jax.train import TrainConfig, train  # noqa: PLC0415

    (tmp_path / "a_file").write_text("x")
    for path, needle in ((tmp_path / "a_file", "is a file, not a directory"),
                         (tmp_path / "a_file" / "sub", "cannot be created")):
        with pytest.raises(UsageError, match=rf"^TrainConfig.export_hf=.*{needle}"):
            train(TrainConfig(steps=1, dp=2, gtp=4, export_hf=str(path)), progress=False)


def test_a_finished_run_relaunched_with_an_export_writes_it(tmp_path) -> None:
    """A finished run re-launched with an export asked for (the only way to redo a failed
    one) writes its final checkpoint's export, equal to the one written as it finished, and
    trains nothing; before, it said "nothing to train" and wrote nothing."""
    from safetensors.numpy import load_file  # noqa: PLC0415

    from gtp_jax.train import CheckpointConfig, RunFinished, TrainConfig, train  # noqa: PLC0415

    cfg = TrainConfig(steps=2, dp=2, gtp=4, export_hf=str(tmp_path / "end"))
    train(cfg, progress=False, checkpoint=CheckpointConfig(str(tmp_path / "ck"), resume="auto"))
    with pytest.raises(RunFinished, match=r"nothing to train; wrote its Hugging Face export "
                       rf"to '{tmp_path}/again'") as done:
        train(dataclasses.replace(cfg, export_hf=str(tmp_path / "again")), progress=False,
              checkpoint=CheckpointConfig(str(tmp_path / "ck"), resume="auto"))
    assert done.value.export_hf == str(tmp_path / "again")
    end, again = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("end", "again"))
    assert end.keys() == again.keys()
    for k in end:
        np.testing.assert_array_equal(again[k], end[k], err_msg=k)
    assert (tmp_path / "end" / "config.json").read_text() == (
        tmp_path / "again" / "config.json").read_text()


def test_a_warm_start_folder_is_the_same_however_it_is_spelled(tmp_path, monkeypatch) -> None:
    """On resume, --init-from / --init-from-hf name the same folder as the saved run's when
    they resolve to it (``./ck/`` for ``ck``, an absolute path); another folder is refused."""
    from test_reliability import _check_resume, _meta

    from gtp_jax.train import TrainConfig, model_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    (tmp_path / "other").mkdir()
    saved = TrainConfig(steps=6, schedule_steps=6, init_from="ck")
    meta = _meta(saved)
    for spelled in ("./ck/", str(tmp_path / "ck"), "ck"):
        cfg = dataclasses.replace(saved, init_from=spelled)
        assert _check_resume(cfg, model_config(cfg), meta, "/ck").steps == 6
    cfg = dataclasses.replace(saved, init_from="other")
    with pytest.raises(UsageError, match=r"TrainConfig.init_from: checkpoint 'ck' vs now "
                       r"'other'"):
        _check_resume(cfg, model_config(cfg), meta, "/ck")
