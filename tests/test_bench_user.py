"""The user-model rows of ``bench overlap`` run one step on CPU (no timing checked)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gtp_jax.bench import overlap

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it


@pytest.mark.parametrize(("variant", "loop"), [
    *((v, "stack") for v in overlap.USER_VARIANTS), ("user_gtp", "python")])
def test_user_model_variant_runs_one_step(variant: str, loop: str) -> None:
    args = overlap.build_parser().parse_args([
        "--worker", variant, "--seq", "16", "--per-device-batch", "1", "--steps", "1",
        "--warmup", "1", "--user-d", "64", "--user-blocks", "2", "--user-heads", "4",
        "--user-vocab", "128", "--user-loop", loop])
    result = overlap.run_variant(args)
    assert result["variant"] == variant and result["devices"] == 8
    assert result["layers"] == 2 and result["user_loop"] == loop
    if loop == "stack":  # its default: scanned under the user's remat (nothing saved)
        assert result["unroll_layers"] is False
    assert math.isfinite(result["loss"]) and result["loss"] > 0
    # The time to the first step: the compile, then the first run.
    assert 0 < result["compile_s"] < result["first_step_s"]
    assert "first step" in overlap.first_step_text(result)


def test_user_model_on_the_stack_is_the_python_loop_model() -> None:
    # The same blocks, built from the same Rngs as Flax's stacked-layer idiom builds them:
    # the stack's layer i holds what the Python loop's block i would hold after stacking,
    # and both compute the same function of it.
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from gtp_jax.bench.user_model import UserDecoder, UserDecoderConfig

    cfg = UserDecoderConfig(vocab=50, d_model=16, n_blocks=2, n_heads=2, d_ff=24,
                            dtype=jnp.float32)
    stack = UserDecoder(cfg, rngs=nnx.Rngs(0))
    loop = UserDecoder(dataclasses.replace(cfg, loop="python"), rngs=nnx.Rngs(0))
    layers = nnx.state(stack.blocks.layers)
    for i, block in enumerate(loop.blocks):  # give the loop the stack's layer i
        nnx.update(block, jax.tree.map(lambda x, i=i: x[i], layers))
    nnx.update(loop, nnx.state(stack, nnx.Not(nnx.PathContains("blocks"))))
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, cfg.vocab)
    np.testing.assert_allclose(stack(tokens), loop(tokens), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("given", [
    [],  # every default
    ["--preset", "small", "--layers", "3", "--seq", "64", "--per-device-batch", "2",
     "--steps", "4", "--warmup", "1", "--remat", "full", "--attention", "xla", "--vocab", "300",
     "--optimizer", "train", "--reduce-dtype", "bfloat16", "--gather-format", "fp8",
     "--fp8-compute", "delayed", "--fp8-min-features", "64", "--no-remat-gathered",
     "--quant-backend", "reference",
     "--keep-gathered-layers", "--no-unroll-layers", "--swiglu-backend", "reference",
     "--user-d", "32", "--user-blocks", "1", "--user-heads", "2", "--user-vocab", "64",
     "--user-remat", "dots", "--user-loop", "python", "--gtp", "2", "--profile-dir", "/tmp/p",
     "--profile-variants", "gtp"],
])
def test_worker_gets_every_option_of_the_parent(given: list[str]) -> None:
    """A variant's worker process parses back every option the parent was given (a dropped
    one would silently benchmark the default, e.g. bf16 instead of FP8 compute)."""
    parser = overlap.build_parser()
    parent = parser.parse_args([*given, "--variants", "gtp", "--timeout", "9"])
    cmd = overlap.worker_command("gtp", parent)
    worker = parser.parse_args(cmd[cmd.index("--worker"):])
    assert worker.worker == "gtp"
    for name, value in vars(parent).items():
        if name not in overlap.PARENT_ONLY:
            assert getattr(worker, name) == value, name


@pytest.mark.parametrize(("variants", "user"), [("user_gtp,user_xla_fsdp", True),
                                                ("gtp,user_gtp", False)])
def test_the_pytorch_peer_of_a_user_decoder_run_is_that_decoder(monkeypatch, variants, user
                                                                ) -> None:
    """With only user_* variants, the FSDP2 peer builds the user decoder's blocks at the
    run's --user-* sizes (MODEL=user), not the preset's."""
    envs = []
    monkeypatch.setattr(overlap.shutil, "which", lambda name: "/bin/torchrun")
    monkeypatch.setattr(overlap, "run_for_result",
                        lambda name, cmd, timeout, env: envs.append(env))
    args = overlap.build_parser().parse_args(
        ["--variants", variants, "--user-d", "96", "--user-blocks", "3", "--user-heads", "4",
         "--user-vocab", "500"])
    assert overlap._torch_peers(args, 2, 9.0) == []
    assert len(envs) == 2  # compiled and eager
    for env in envs:
        if user:
            assert (env["MODEL"], env["USER_D"], env["USER_BLOCKS"], env["USER_HEADS"],
                    env["USER_FF"], env["USER_VOCAB"]) == ("user", "96", "3", "4", "384", "500")
        else:
            assert env.get("MODEL", "preset") != "user"
