"""The choices that put a user on the fast path: attention kernel, the main job's "auto"
settings (and what a resumed run keeps), and the performance matrix's bookkeeping."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from gtp_jax.base.errors import UsageError
from gtp_jax.bench import matrix
from gtp_jax.models import preset
from gtp_jax.models.attention import causal_attention, cudnn_unsupported, resolve_attention_impl
from gtp_jax.train import TrainConfig
from gtp_jax.train.config import (
    adopt_saved,
    check_devices,
    describe_choices,
    gtp_config,
    model_config,
    resolve_auto,
)
from gtp_jax.train.lifecycle.resume import check_resume

BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize(("impl", "dtype", "head_dim", "backend", "expected"), [
    ("auto", BF16, 64, "gpu", "cudnn"),
    (None, jnp.float16, 128, "gpu", "cudnn"),
    ("auto", F32, 64, "gpu", "xla"),      # cuDNN takes 16-bit inputs only
    ("auto", BF16, 256, "gpu", "xla"),    # beyond the head dim every GPU generation takes
    ("auto", BF16, 36, "gpu", "xla"),     # not a multiple of 8
    ("auto", BF16, 64, "cpu", "xla"),
    ("xla", BF16, 64, "gpu", "xla"),
    ("cudnn", BF16, 64, "gpu", "cudnn"),
])
def test_attention_resolution(impl, dtype, head_dim, backend, expected):
    assert resolve_attention_impl(impl, dtype, head_dim, backend) == expected


def test_explicit_cudnn_where_it_does_not_apply_is_refused():
    with pytest.raises(UsageError, match=r"attention_impl='cudnn' does not apply.*cpu backend"):
        resolve_attention_impl("cudnn", BF16, 64, "cpu")
    with pytest.raises(UsageError, match=r"attention_impl='flash'.*choose one of"):
        resolve_attention_impl("flash", BF16, 64, "gpu")
    assert "float32" in cudnn_unsupported(F32, 64, "gpu")
    with pytest.raises(UsageError, match=r"TrainConfig.attention='cudnn' does not apply"):
        check_devices(TrainConfig(attention="cudnn", steps=1))
    with pytest.raises(UsageError, match=r"TrainConfig.attention='fast'"):
        TrainConfig(attention="fast")


def test_auto_attention_equals_xla_off_gpu():
    q, k, v = (jnp.linspace(-1, 1, 2 * 8 * 2 * 16, dtype=F32).reshape(2, 8, 2, 16) * s
               for s in (1.0, 0.5, 2.0))
    assert jnp.array_equal(causal_attention(q, k, v, impl="auto"),
                           causal_attention(q, k, v, impl="xla"))


def test_auto_settings_follow_the_backend():
    cfg = TrainConfig()
    assert cfg.auto_fields == {"dtype", "gather_dtype", "remat"}
    gpu = resolve_auto(cfg, "gpu")
    assert (gpu.dtype, gpu.gather_dtype, gpu.remat) == ("bfloat16", "bfloat16", "dots")
    cpu = resolve_auto(cfg, "cpu")
    assert (cpu.dtype, cpu.gather_dtype, cpu.remat) == ("float32", None, "none")
    assert not cpu.auto_fields and resolve_auto(cpu, "gpu") is cpu
    # gather_dtype="auto" follows the compute dtype the user chose.
    assert resolve_auto(TrainConfig(dtype="bfloat16"), "cpu").gather_dtype == "bfloat16"
    assert resolve_auto(TrainConfig(dtype="float32"), "gpu").gather_dtype is None
    # An explicit choice is kept.
    explicit = resolve_auto(TrainConfig(remat="full", gather_dtype=None), "gpu")
    assert (explicit.remat, explicit.gather_dtype) == ("full", None)
    # The model and the GTP config the run builds see the resolved values (this is CPU).
    assert model_config(cfg).dtype == F32 and model_config(cfg).remat == "none"
    assert gtp_config(TrainConfig(dtype="bfloat16")).gather_dtype == BF16


def test_header_says_what_was_chosen():
    cfg = resolve_auto(TrainConfig(prefetch=True), "cpu")
    line = describe_choices(cfg, model_config(cfg))
    assert line.startswith("compute float32, gathers float32 (the parameter dtype), remat none,"
                           " attention xla, layers unrolled")
    assert "prefetch has no further effect" in line
    scanned = dataclasses.replace(cfg, unroll_layers=False)
    assert "layers scanned with prefetch" in describe_choices(scanned, model_config(scanned))
    whole = dataclasses.replace(scanned, dp=8, gtp=1)
    assert "prefetch has no effect at gtp=1" in describe_choices(whole, model_config(whole))
    ring = dataclasses.replace(cfg, cp=2, gtp=2)
    assert "attention ring over cp=2" in describe_choices(ring, model_config(ring))


def _meta(saved: TrainConfig) -> dict:
    from gtp_jax.train.config import model_json

    return {"step": 2, "extra": {"train_config": dataclasses.asdict(saved),
                                 "model_config": model_json(model_config(saved)),
                                 "data": {"position": 2}}}


def test_a_resumed_run_keeps_the_saved_choices_unless_told_otherwise():
    saved = TrainConfig(steps=6, dtype="float32", gather_dtype="bfloat16", remat="dots")
    cfg = TrainConfig(steps=6)  # all on "auto"
    adopted = adopt_saved(cfg, dataclasses.asdict(saved), cfg.auto_fields)
    assert (adopted.dtype, adopted.gather_dtype, adopted.remat) == ("float32", "bfloat16",
                                                                    "dots")
    resumed = check_resume(cfg, model_config(cfg), _meta(saved), "/ck")
    assert (resumed.gather_dtype, resumed.remat) == ("bfloat16", "dots")
    # An explicit value of a field that may change wins; one that may not is refused.
    told = check_resume(TrainConfig(steps=6, remat="full"), model_config(cfg), _meta(saved),
                        "/ck")
    assert told.remat == "full"
    with pytest.raises(UsageError, match=r"dtype: checkpoint 'float32' vs now 'bfloat16'"):
        check_resume(TrainConfig(steps=6, dtype="bfloat16"), model_config(cfg), _meta(saved),
                     "/ck")


def test_matrix_cells_and_flags():
    cells = matrix.cells()
    names = [c.name for c in cells]
    assert len(names) == len(set(names))
    grid = [c for c in cells if c.kind == "grid" and c.remat_gathered]
    assert {(c.loop, c.prefetch, c.remat, c.gather) for c in grid} == {
        (loop, p, r, g) for loop in ("unrolled", "scanned") for p in ("off", "on")
        for r in ("dots", "full") for g in ("bf16", "fp8")}
    # The unrolled loop's prefetch cells run the same program: measured once.
    assert all(c.same_as == c.name.replace("prefetch_", "") for c in grid
               if c.loop == "unrolled" and c.prefetch == "on")
    ref = next(c for c in cells if not c.remat_gathered)
    argv = matrix._overlap_argv(ref, matrix.build_parser().parse_args([]))
    assert "--no-remat-gathered" in argv and "--no-unroll-layers" in argv
    # The FP8-compute column: both loops and gather formats, the 1b's 2048-wide projections.
    fp8 = [c for c in cells if c.compute == "fp8"]
    assert {(c.loop, c.gather) for c in fp8} == {
        (loop, g) for loop in ("unrolled", "scanned") for g in ("bf16", "fp8")}
    for c in fp8:
        argv = matrix._overlap_argv(c, matrix.build_parser().parse_args([]))
        assert argv[argv.index("--fp8-compute") + 1] == "tensorwise"
        assert argv[argv.index("--fp8-min-features") + 1] == str(matrix.FP8_MIN_FEATURES)
    assert all("--fp8-compute" not in matrix._overlap_argv(c, matrix.build_parser().parse_args(
        [])) for c in cells if c.kind == "grid" and c.compute == "bf16")

    def row(name, group, ms, gib, peer=False):
        return {"name": name, "group": group, "loop": "-", "prefetch": "-", "remat": "-",
                "gather": "-", "peer": peer, "step_ms": ms, "peak_mem_gib": gib}

    rows = matrix.flag_rows([row("a", "g", 100.0, 10.0), row("b", "g", 116.0, 10.0),
                             row("c", "g", 100.0, 13.5), row("p", "g", 200.0, 50.0, peer=True),
                             row("d", "h", None, None)])
    assert [r["flag"] for r in rows] == ["", "time > 1.15x", "memory > 1.3x", "", "failed"]
    assert rows[1]["time_ratio"] == pytest.approx(1.16)
    table = matrix.format_table(rows)
    assert "| p (peer) | g |" in table and "| d | h |" in table


def test_preset_head_dims_take_cudnn():
    # The presets a GPU user trains (bf16) get cuDNN's kernel under "auto".
    for name in ("100m", "1b"):
        cfg = preset(name, dtype=BF16)
        assert resolve_attention_impl(None, BF16, cfg.head_size, "gpu") == "cudnn", name
