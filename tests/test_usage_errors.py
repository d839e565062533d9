"""Caller mistakes in the mesh, config and kernel APIs give one clear `UsageError`.

Each case names the argument in the message; none of them may pass silently or surface as
an unrelated exception (AttributeError, a tuple-multiplication TypeError) from deep inside.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import gtp_jax
from gtp_jax import pallas as gp
from gtp_jax.base.errors import UsageError, UsageTypeError


@pytest.mark.parametrize("call, match", [
    (lambda: gtp_jax.make_mesh(devices=[]), "devices= is empty"),
    (lambda: gtp_jax.make_mesh(gtp=2, devices=[jax.devices()[0]] * 2), r"device ids \[0\]"),
    (lambda: gtp_jax.make_mesh(gtp=2, devices=[0, 1]), "jax.Device"),
    (lambda: gtp_jax.describe_mesh(3), "describe_mesh: mesh must be"),
    (lambda: gtp_jax.data_sharding("mesh"), "data_sharding: mesh must be"),
    (lambda: gtp_jax.data_sharding(gtp_jax.make_mesh(gtp=8), 1.5), "ndim=1.5"),
    (lambda: gtp_jax.data_sharding(gtp_jax.make_mesh(gtp=8), 0), "ndim=0"),
    (lambda: gtp_jax.GTPConfig(gather_dtype=jnp.float8_e4m3fn), "gather_format"),
    (lambda: gtp_jax.GTPConfig(reduce_dtype=jnp.int8), "reduce_dtype"),
    (lambda: gtp_jax.GTPConfig(remat_gathered="yes"), "remat_gathered"),
    (lambda: gtp_jax.GTPConfig(keep_gathered_layers=1), "keep_gathered_layers"),
    (lambda: gtp_jax.GTPConfig(prefetch=1), "prefetch"),
    (lambda: gtp_jax.GTPConfig(pad_for_alignment=True), "pad_for_alignment"),
    (lambda: gtp_jax.GTPConfig(include=[3]), "include"),
    (lambda: gtp_jax.GTPConfig(exclude=5), "exclude"),
    (lambda: gp.quantize(jnp.ones((32, 32)), "fp8", amax=-1.0), "amax=-1.0"),
    (lambda: gp.quantize(jnp.ones((32, 32)), "fp9"), "fp9"),
])
def test_usage_error(call, match) -> None:
    with pytest.raises(UsageError, match=match):
        call()


def test_type_errors_are_also_type_errors() -> None:
    # Code written against the builtin types keeps working.
    with pytest.raises(TypeError):
        gtp_jax.describe_mesh(3)
    assert issubclass(UsageTypeError, UsageError) and issubclass(UsageError, ValueError)


def test_include_none_means_no_patterns() -> None:
    assert gtp_jax.GTPConfig(include=None) == gtp_jax.GTPConfig()
