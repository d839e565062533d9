"""GTPConfig validation happens at construction, with errors that name the field."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from gtp_jax import GTPConfig


def test_defaults() -> None:
    cfg = GTPConfig()
    assert cfg.axis == "gtp"
    assert cfg.pad_for_alignment == 0
    assert cfg.min_elements == 1024
    assert cfg.include == () and cfg.exclude == ()
    assert cfg.gather_dtype is None
    assert cfg.reduce_dtype == np.dtype("float32")
    assert cfg.remat_gathered is True
    assert cfg.gather_format is None
    assert cfg.prefetch is False


def test_frozen_and_hashable() -> None:
    cfg = GTPConfig(include=("a",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.axis = "dp"  # type: ignore[misc]
    assert hash(cfg) == hash(GTPConfig(include=["a"]))
    assert cfg == GTPConfig(include="a")


@pytest.mark.parametrize("axis", [None, 3, "", ("gtp",)])
def test_bad_axis_type(axis) -> None:
    with pytest.raises(TypeError, match="axis"):
        GTPConfig(axis=axis)


@pytest.mark.parametrize("pad", [-1, -64, 1.5, "8", None])
def test_bad_pad_for_alignment(pad) -> None:
    with pytest.raises(ValueError, match="pad_for_alignment"):
        GTPConfig(pad_for_alignment=pad)


@pytest.mark.parametrize("value", [-1, 2.5])
def test_bad_min_elements(value) -> None:
    with pytest.raises(ValueError, match="min_elements"):
        GTPConfig(min_elements=value)


@pytest.mark.parametrize("field", ["include", "exclude"])
@pytest.mark.parametrize("pattern", ["(", "[a-", "*kernel"])
def test_bad_regex(field: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=field) as err:
        GTPConfig(**{field: (pattern,)})
    assert repr(pattern) in str(err.value)


@pytest.mark.parametrize("field", ["include", "exclude"])
def test_single_string_pattern_becomes_tuple(field: str) -> None:
    cfg = GTPConfig(**{field: "mlp/.*kernel"})
    assert getattr(cfg, field) == ("mlp/.*kernel",)
    cfg = GTPConfig(**{field: ["a", "b"]})
    assert getattr(cfg, field) == ("a", "b")


@pytest.mark.parametrize("dtype", ["int32", jnp.int8, "bool", np.uint16, "complex64"])
def test_non_float_gather_dtype(dtype) -> None:
    with pytest.raises(TypeError, match="gather_dtype"):
        GTPConfig(gather_dtype=dtype)


def test_not_a_dtype() -> None:
    with pytest.raises(TypeError, match="gather_dtype"):
        GTPConfig(gather_dtype="not-a-dtype")


@pytest.mark.parametrize("dtype", ["int32", None])
def test_bad_reduce_dtype(dtype) -> None:
    with pytest.raises(TypeError, match="reduce_dtype"):
        GTPConfig(reduce_dtype=dtype)


@pytest.mark.parametrize("dtype,expected", [("bfloat16", jnp.bfloat16), (jnp.float16, jnp.float16),
                                            (np.float32, jnp.float32)])
def test_float_dtypes_are_normalized(dtype, expected) -> None:
    cfg = GTPConfig(gather_dtype=dtype, reduce_dtype=dtype)
    assert cfg.gather_dtype == np.dtype(expected)
    assert cfg.reduce_dtype == np.dtype(expected)
    assert isinstance(cfg.gather_dtype, np.dtype)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "nvfp4"])
def test_low_precision_gather_formats_are_accepted(fmt: str) -> None:
    cfg = GTPConfig(gather_format=fmt, quant_backend="reference")
    assert cfg.gather_format == fmt and cfg.quant_backend == "reference"


@pytest.mark.parametrize("fmt", ["int4", "FP8", "bf16"])
def test_unknown_gather_format(fmt: str) -> None:
    with pytest.raises(ValueError, match="unknown") as err:
        GTPConfig(gather_format=fmt)
    assert "fp8" in str(err.value)


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_prefetch_must_be_bool(value) -> None:
    with pytest.raises(TypeError, match="prefetch"):
        GTPConfig(prefetch=value)


@pytest.mark.parametrize("value", [True, False])
def test_prefetch_bool_accepted(value: bool) -> None:
    assert GTPConfig(prefetch=value).prefetch is value


@pytest.mark.parametrize("pad,axis_size,expected", [
    (0, 4, 4), (1, 4, 4), (8, 4, 32),
    (0, 8, 8), (1, 8, 8), (8, 8, 64),
    (0, 1, 1), (1, 1, 1), (8, 1, 8), (64, 2, 128),
])
def test_alignment(pad: int, axis_size: int, expected: int) -> None:
    assert GTPConfig(pad_for_alignment=pad).alignment(axis_size) == expected
