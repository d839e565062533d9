"""Sharded checkpoints (`gtp_jax.train.lifecycle.checkpoint`): bit-exact restore onto other
meshes, keeping the newest N, a save killed before finalization, and every bad-input error."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_unchanged, flat_state, snapshot
from jax.sharding import NamedSharding

import gtp_jax
from gtp_jax.base.errors import UsageError
from gtp_jax.base.metadata import LOGICAL_SHAPE
from gtp_jax.models import lm_loss
from gtp_jax.train import (
    RunFinished,
    TrainConfig,
    TrainStep,
    build_model_and_optimizer,
    model_config,
    train,
)
from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig, Checkpointer

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

REPO_ROOT = Path(__file__).resolve().parents[1]

#: The saving run: dp=2 x gtp=4 with pad_for_alignment=8 (sharded dims padded to multiples of
#: 32, e.g. the attention output kernel's 4 heads are stored as 32 rows). The same config as
#: in test_train.py and test_multiprocess.py, so the suite compiles its train step once.
SOURCE = TrainConfig(steps=6, batch_size=8, seq_len=32, warmup=2, dp=2, gtp=4,
                     pad_for_alignment=8)


def _logical(var: nnx.Variable) -> np.ndarray:
    """A variable's value with any GTP padding sliced off, after checking the padding is 0."""
    value = np.asarray(var.get_value())
    logical = var.get_metadata().get(LOGICAL_SHAPE)
    if logical is None:
        return value
    inside = tuple(slice(0, n) for n in logical)
    outside = value.copy()
    outside[inside] = 0
    assert not np.any(outside), "GTP padding is not zero"
    return value[inside]


def _logical_state(obj: nnx.Module | nnx.Optimizer) -> dict[tuple, np.ndarray]:
    return {k: _logical(v) for k, v in flat_state(obj, ...).items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict, dict]:
    """Two AdamW steps on the SOURCE mesh, saved as step 2: (dir, params, opt state, batch)."""
    directory = tmp_path_factory.mktemp("ckpt") / "run"
    model, optimizer = build_model_and_optimizer(SOURCE)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (SOURCE.batch_size, SOURCE.seq_len + 1)).astype(np.int32)
    tokens = jax.device_put(tokens, gtp_jax.data_sharding(model.mesh))
    # The loss of `train`: the suite's runs of SOURCE share one compiled step.
    step = TrainStep(model, optimizer, functools.partial(
        lm_loss, aux_weight=model_config(SOURCE).moe_aux_weight))
    for _ in range(2):
        step(tokens)
    step.sync()
    with Checkpointer(CheckpointConfig(directory)) as ckpt:
        ckpt.save(2, model, optimizer, extra={"note": "two steps"})
    params = {k: np.asarray(v.get_value())
              for k, v in flat_state(gtp_jax.unshard(model), ...).items()}
    return directory, params, _logical_state(optimizer), _logical_state(model)


TARGETS = {
    "same_mesh": {},
    "gtp8": {"dp": 1, "gtp": 8, "pad_for_alignment": 0},  # 32 padded rows -> 8 (truncate)
    "dp8": {"dp": 8, "gtp": 1, "pad_for_alignment": 0},  # no padding at all
    "gtp8_pad64": {"dp": 1, "gtp": 8, "pad_for_alignment": 64},  # 32 rows -> 512 (zero fill)
    # tp=2 splits (heads, SwiGLU width: gate|up interleaved per rank) and moves GTP to
    # other dims: every split weight is re-laid out through its logical array.
    "tp2": {"dp": 1, "gtp": 4, "tp": 2},
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_restore_onto_other_mesh_is_bit_exact(saved, target: str, tmp_path: Path) -> None:
    directory, params, opt_state, _ = saved
    cfg = dataclasses.replace(SOURCE, seed=SOURCE.seed + 1, **TARGETS[target])
    model, optimizer = build_model_and_optimizer(cfg)  # other initial weights
    fresh = {k: v.get_value().sharding for k, v in flat_state(model, ...).items()}
    fresh_opt = {k: v.get_value().sharding for k, v in flat_state(optimizer, ...).items()}
    with Checkpointer(CheckpointConfig(directory, resume=True)) as ckpt:
        restored = ckpt.restore(model, optimizer, with_metadata=True)
        saved_arrays = ckpt.read_arrays()
    # What a loop needs: the step and the extras it saved; the metadata only on request.
    assert restored.step == 2 and restored.extra == {"note": "two steps"}
    assert restored.metadata["mesh"] == {"dp": 2, "ep": 1, "gtp": 4, "tp": 1}
    assert restored.metadata["step"] == 2
    assert set(restored.metadata["arrays"]) == set(saved_arrays)

    # Parameters, unsharded by gtp_jax itself, equal the saved run's bit for bit.
    restored = {k: np.asarray(v.get_value())
                for k, v in flat_state(gtp_jax.unshard(model), ...).items()}
    assert restored.keys() == params.keys()
    for key, value in params.items():
        assert restored[key].dtype == value.dtype
        np.testing.assert_array_equal(restored[key], value, err_msg=f"param {key}")
    # Every array is laid out and placed as a fresh shard() on this mesh.
    for obj, shardings in ((model, fresh), (optimizer, fresh_opt)):
        for key, var in flat_state(obj, ...).items():
            sharding = var.get_value().sharding
            if isinstance(shardings[key], NamedSharding):
                assert sharding == shardings[key], f"{key}: sharding changed"
            if not var.get_metadata().get("gtp_split_layout"):
                _logical(var)  # asserts that GTP padding is zero
    # Optimizer moments and counters too: save the restored state again and compare the
    # logical arrays with the original checkpoint's (and those with the live source state).
    with Checkpointer(CheckpointConfig(tmp_path / "again")) as again:
        again.save(2, model, optimizer)
    resaved = Checkpointer(CheckpointConfig(tmp_path / "again")).read_arrays()
    assert resaved.keys() == saved_arrays.keys()
    for key, value in saved_arrays.items():
        np.testing.assert_array_equal(resaved[key], value, err_msg=key)
    for key, value in opt_state.items():
        np.testing.assert_array_equal(resaved["optimizer/" + "/".join(map(str, key))], value)
    # The step counter and the schedule counts (which fix the LR) came back too.
    assert int(optimizer.step.get_value()) == 2

    if target == "tp2":  # and back from the split layout onto a mesh without tp
        back, _ = build_model_and_optimizer(dataclasses.replace(SOURCE, dp=1, gtp=8))
        with Checkpointer(CheckpointConfig(tmp_path / "again")) as again:
            again.restore(back)  # (model only: the optimizer is optional)
        for key, var in flat_state(gtp_jax.unshard(back), ...).items():
            np.testing.assert_array_equal(np.asarray(var.get_value()), params[key])


def test_read_arrays_are_logical(saved) -> None:
    directory, params, opt_state, _ = saved
    arrays = Checkpointer(CheckpointConfig(directory)).read_arrays()
    for key, value in params.items():
        np.testing.assert_array_equal(arrays["model/module/" + "/".join(map(str, key))], value)
    for key, value in opt_state.items():
        np.testing.assert_array_equal(arrays["optimizer/" + "/".join(map(str, key))], value)
    assert arrays["model/module/blocks/attn/out/kernel"].shape == (2, 4, 32, 128)


def _linear(mesh: jax.sharding.Mesh, out: int = 48, seed: int = 0) -> gtp_jax.ShardedModule:
    return gtp_jax.shard(nnx.Linear(64, out, rngs=nnx.Rngs(seed)), mesh,
                         gtp_jax.GTPConfig(min_elements=1))


def test_keeps_newest_n(tmp_path: Path, mesh_dp2_gtp4) -> None:
    model = _linear(mesh_dp2_gtp4)
    with Checkpointer(CheckpointConfig(tmp_path / "ck", keep=2, async_save=False)) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, model)
        assert ckpt.all_steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["3", "4"]


_KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from flax import nnx
    import gtp_jax
    from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig, Checkpointer

    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    model = gtp_jax.shard(nnx.Linear(64, 48, rngs=nnx.Rngs(0)), mesh,
                          gtp_jax.GTPConfig(min_elements=1))
    ckpt = Checkpointer(CheckpointConfig(sys.argv[1]))
    ckpt.save(1, model)
    ckpt.wait()
    model.module.kernel.set_value(model.module.kernel.get_value() + 1.0)
    real_rename = os.rename

    def die_before_commit(src, dst, *args, **kwargs):
        # orbax finalizes each item of a step (its arrays, its JSON) by renaming the item's
        # temporary directory, then the step by renaming the step's: die right before the
        # first item rename ("item") or right before the step rename ("step"), when every
        # array of step 2 has been written.
        if "tmp" in os.fspath(src) and (sys.argv[2] == "item"
                                        or os.path.basename(os.fspath(dst)) == "2"):
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rename(src, dst, *args, **kwargs)

    os.rename = die_before_commit
    print("saving step 2", flush=True)
    ckpt.save(2, model)
    ckpt.wait()
    print("step 2 finalized")
""")


@pytest.mark.parametrize("kill_at", ["item", "step"])
def test_save_killed_before_finalize_keeps_previous(tmp_path: Path, mesh_dp2_gtp4,
                                                    kill_at: str) -> None:
    directory = tmp_path / "ck"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(directory), kill_at],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "saving step 2" in proc.stdout and "finalized" not in proc.stdout
    leftovers = [p for p in directory.iterdir() if p.name.startswith("2.")]
    assert "2" not in os.listdir(directory) and len(leftovers) == 1, os.listdir(directory)
    written = sorted(p.name for p in leftovers[0].iterdir())
    if kill_at == "step":  # both items were complete: only the step rename was missing
        assert {"meta", "model"} <= set(written), written
    else:
        assert any("tmp" in name for name in written), written

    model = _linear(mesh_dp2_gtp4, seed=1)
    with Checkpointer(CheckpointConfig(directory, resume=True)) as ckpt:
        assert ckpt.all_steps() == [1]
        restored = ckpt.restore(model)
        assert (restored.step, restored.extra, restored.metadata) == (1, {}, None)
        expected = np.asarray(nnx.Linear(64, 48, rngs=nnx.Rngs(0)).kernel.get_value())
        np.testing.assert_array_equal(np.asarray(gtp_jax.unshard(model).kernel.get_value()),
                                      expected)
        # A new save of step 2 succeeds; the interrupted save's leftovers were removed (orbax
        # cleans temporary directories in the background after opening, before any save).
        ckpt.save(2, model)
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
    assert sorted(os.listdir(directory)) == ["1", "2"]


_ENDS_AFTER_SAVE = textwrap.dedent("""
    import sys
    from flax import nnx
    import gtp_jax
    from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig, Checkpointer

    model = gtp_jax.shard(nnx.Linear(64, 48, rngs=nnx.Rngs(0)), gtp_jax.make_mesh(dp=2, gtp=4),
                          gtp_jax.GTPConfig(min_elements=1))
    ckpt = Checkpointer(CheckpointConfig(sys.argv[1]))  # asynchronous saves, never closed
    for step in (1, 2):
        ckpt.save(step, model)
""")


def test_a_script_that_ends_after_its_last_save_keeps_it(tmp_path: Path) -> None:
    # A loop of one's own that ends with an asynchronous save and no close(): the save is
    # finalized as the interpreter exits (before orbax's thread pools stop), not left as an
    # unfinished folder beside tracebacks.
    directory = tmp_path / "ck"
    proc = subprocess.run([sys.executable, "-c", _ENDS_AFTER_SAVE, str(directory)],
                          cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=120)  # it hung before
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(os.listdir(directory)) == ["1", "2"]


def test_a_new_run_does_not_save_into_an_earlier_runs_checkpoints(tmp_path: Path,
                                                                  mesh_dp2_gtp4) -> None:
    model = _linear(mesh_dp2_gtp4)
    with Checkpointer(CheckpointConfig(tmp_path / "ck", keep=2, async_save=False)) as ckpt:
        ckpt.save(1, model)
        ckpt.save(2, model)  # its own saves: fine
    # CheckpointConfig.resume=False (the default) is a new run: refused before anything is
    # written or rotated out, in one line naming the way on.
    with Checkpointer(CheckpointConfig(tmp_path / "ck", keep=2)) as ckpt:
        with pytest.raises(UsageError, match=r"held checkpoints of an earlier run \(steps "
                           r"\[1, 2\]\) and CheckpointConfig.resume is False.*resume=True"):
            ckpt.save(5, model)
        assert ckpt.all_steps() == [1, 2]
    with Checkpointer(CheckpointConfig(tmp_path / "ck", keep=2, resume="auto")) as ckpt:
        ckpt.save(5, model)
        ckpt.wait()
        assert ckpt.all_steps() == [2, 5]


def test_saving_a_donated_state_names_the_sync(tmp_path: Path, mesh_dp2_gtp4) -> None:
    # A jitted step that donated the model's arrays (TrainStep keeps the state until
    # sync()): one line naming the call, not XLA's "deleted or donated buffer".
    model = _linear(mesh_dp2_gtp4)
    jax.jit(lambda x: x + 1, donate_argnums=0)(model.module.kernel.get_value())
    with Checkpointer(CheckpointConfig(tmp_path / "ck")) as ckpt:
        with pytest.raises(UsageError, match=r"model/module/kernel .*consumed \(donated\).*"
                           r"TrainStep.sync\(\) before saving"):
            ckpt.save(1, model)
        assert ckpt.all_steps() == []


# ---------------------------------------------------------------------- errors


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist.*CheckpointConfig.directory"):
        CheckpointConfig(tmp_path / "missing", resume=True)
    with pytest.raises(UsageError, match=r"CheckpointConfig\.every=-1"):
        CheckpointConfig(tmp_path, every=-1)
    with pytest.raises(UsageError, match=r"CheckpointConfig\.keep=0"):
        CheckpointConfig(tmp_path, keep=0)
    with pytest.raises(UsageError, match="non-empty path"):
        CheckpointConfig("")
    assert CheckpointConfig("rel").directory == os.path.abspath("rel")


def test_restore_errors_leave_model_unchanged(tmp_path: Path, mesh_dp2_gtp4) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    model = _linear(mesh_dp2_gtp4)
    with Checkpointer(CheckpointConfig(empty, resume=True)) as ckpt:
        with pytest.raises(ValueError, match="holds no finalized checkpoint"):
            ckpt.restore(model)
        ckpt.save(1, model)
        ckpt.wait()
        with pytest.raises(ValueError, match=r"step 5 is not in .*\[1\]"):
            ckpt.restore(model, step=5)
        other = _linear(mesh_dp2_gtp4, out=40)
        before = snapshot(other)
        with pytest.raises(ValueError, match=r"module/(kernel|bias) has logical shape .* target"):
            ckpt.restore(other)
        assert_unchanged(other, before)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        with pytest.raises(ValueError, match="unexpected|missing"):
            ckpt.restore(model, optimizer)
        with pytest.raises(TypeError, match="with_metadata='yes' must be True or False"):
            ckpt.restore(model, with_metadata="yes")


def _fake_run(directory: Path, mesh, **train_config) -> None:
    """A checkpoint whose metadata claims to come from a `train` run with `train_config`."""
    from gtp_jax.train.config import model_json, resolve_auto  # noqa: PLC0415

    cfg = resolve_auto(dataclasses.replace(SOURCE, **train_config))  # as a run records it

    with Checkpointer(CheckpointConfig(directory)) as ckpt:
        ckpt.save(2, _linear(mesh), extra={
            "train_config": dataclasses.asdict(cfg), "model_config": model_json(
                model_config(cfg)), "data": {"seed": 0, "position": 2, "batch_size": 8,
                                             "seq_len": 32}})


def test_train_resume_errors_before_building_anything(tmp_path: Path, mesh_dp2_gtp4) -> None:
    other_seed, done = tmp_path / "seed", tmp_path / "done"
    _fake_run(other_seed, mesh_dp2_gtp4, seed=7)
    with pytest.raises(ValueError,
                       match=r"different run \(TrainConfig.seed: checkpoint 7 vs now 0\)"):
        train(SOURCE, progress=False, checkpoint=CheckpointConfig(other_seed, resume=True))
    with pytest.raises(UsageError, match="already holds checkpoints.*CheckpointConfig.resume"):
        train(SOURCE, progress=False, checkpoint=CheckpointConfig(other_seed))
    _fake_run(done, mesh_dp2_gtp4, steps=2)
    with pytest.raises(RunFinished, match="finished .checkpoint at step 2.; nothing to train"):
        train(dataclasses.replace(SOURCE, steps=2), progress=False,
              checkpoint=CheckpointConfig(done, resume=True))
    with pytest.raises(UsageError, match="past TrainConfig.steps=1.*nothing is left to train"):
        train(dataclasses.replace(SOURCE, steps=1), progress=False,
              checkpoint=CheckpointConfig(done, resume=True))
    foreign = tmp_path / "foreign"
    with Checkpointer(CheckpointConfig(foreign)) as ckpt:
        ckpt.save(1, _linear(mesh_dp2_gtp4))
    with pytest.raises(ValueError, match="not written by `python -m gtp_jax train`"):
        train(SOURCE, progress=False, checkpoint=CheckpointConfig(foreign, resume=True))
