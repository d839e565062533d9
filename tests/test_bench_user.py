"""The user-model rows of ``bench overlap`` run one step on CPU (no timing checked)."""

from __future__ import annotations

import math

import pytest

from gtp_jax.bench import overlap

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it


@pytest.mark.parametrize("variant", overlap.USER_VARIANTS)
def test_user_model_variant_runs_one_step(variant: str) -> None:
    args = overlap.build_parser().parse_args([
        "--worker", variant, "--seq", "16", "--per-device-batch", "1", "--steps", "1",
        "--warmup", "1", "--user-d", "64", "--user-blocks", "2", "--user-heads", "4",
        "--user-vocab", "128"])
    result = overlap.run_variant(args)
    assert result["variant"] == variant and result["devices"] == 8
    assert result["layers"] == 2
    assert math.isfinite(result["loss"]) and result["loss"] > 0
