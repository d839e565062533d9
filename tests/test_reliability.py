"""Reliability of training runs and their checkpoints: input validation before training,
checksummed checkpoints with fallback to the newest intact one, no non-finite saves, the
directory lock, extending a finished run, memory checks and one-line CLI errors."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_unchanged, snapshot
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gtp_jax
import gtp_jax.train as train_module
import gtp_jax.train.loop as loop_module
import gtp_jax.train.outputs.observe as observe_module
from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.sharding.plan import DimSplit
from gtp_jax.train import (
    MODEL_MAY_DIFFER,
    RESUME_MAY_DIFFER,
    RunFinished,
    TrainConfig,
    TrainResult,
    check_memory_fits,
    memory_bound,
    model_config,
    train,
)
from gtp_jax.train.cli.command import cli_message
from gtp_jax.train.cli.command import main as cli_main
from gtp_jax.train.config import COMPARED_AS_MODEL, resolve_auto
from gtp_jax.train.config import model_json as _model_json
from gtp_jax.train.lifecycle.checkpoint import (
    CheckpointConfig,
    CheckpointCorruptError,
    Checkpointer,
    NonFiniteStateError,
)
from gtp_jax.train.lifecycle.fingerprint import digest
from gtp_jax.train.lifecycle.fingerprint import fingerprint as _fingerprint
from gtp_jax.train.lifecycle.lock import GUARD_FILE, LOCK_FILE, CheckpointLockedError, DirectoryLock
from gtp_jax.train.lifecycle.resume import check_resume as _check_resume
from gtp_jax.train.outputs.observe import (
    DeviceMemoryError,
    check_writable_dir,
    check_writable_file,
)
from gtp_jax.train.step.memory import memory_advice

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

REPO_ROOT = Path(__file__).resolve().parents[1]

#: The suite's shared run (test_train.py, test_checkpoint.py): its train step compiles once.
RUN = TrainConfig(steps=6, batch_size=8, seq_len=32, warmup=2, dp=2, gtp=4, pad_for_alignment=8)


def _linear(mesh: jax.sharding.Mesh, seed: int = 0) -> gtp_jax.ShardedModule:
    return gtp_jax.shard(nnx.Linear(64, 48, rngs=nnx.Rngs(seed)), mesh,
                         gtp_jax.GTPConfig(min_elements=1))


# ---------------------------------------------------------------------- TrainConfig


@pytest.mark.parametrize("field, value", [
    ("lr", -1.0), ("lr", 0.0), ("lr", math.nan), ("lr", math.inf),
    ("warmup", -1), ("weight_decay", -0.1), ("weight_decay", math.nan),
    ("moe_capacity_factor", 0.0), ("moe_capacity_factor", math.inf), ("moe_top_k", 0),
    ("moe_experts", -1), ("steps", 0), ("seed", -1), ("pad_for_alignment", -8),
    ("schedule_steps", 0), ("preset", "huge"), ("remat", "some"), ("gather_format", "int4"),
    ("dtype", "float16"), ("layers", 0),
])
def test_train_config_rejects_out_of_range_values(field: str, value: object) -> None:
    with pytest.raises(UsageError, match=rf"TrainConfig\.{field}="):
        TrainConfig(**{field: value})


@pytest.mark.parametrize("field, value", [("steps", True), ("steps", 2.5), ("lr", "0.1"),
                                          ("prefetch", 1), ("layers", 2.0)])
def test_train_config_rejects_wrong_types(field: str, value: object) -> None:
    with pytest.raises(UsageTypeError, match=rf"TrainConfig\.{field}="):
        TrainConfig(**{field: value})


def test_layers_replace_the_presets_and_exclude_a_checkpoints_shape() -> None:
    cfg = TrainConfig(preset="1b", layers=3, batch_size=8)
    assert model_config(cfg).n_layers == 3
    assert model_config(dataclasses.replace(cfg, layers=None)).n_layers == 16
    with pytest.raises(UsageError, match=r"init_from_hf with layers=3.*drop layers"):
        TrainConfig(layers=3, init_from_hf="/some/checkpoint")


def test_train_config_rejects_top_k_above_experts() -> None:
    with pytest.raises(UsageError, match=r"moe_top_k=3 must be <= TrainConfig\.moe_experts=2"):
        TrainConfig(moe_experts=2, moe_top_k=3)


# ---------------------------------------------------------------------- checksums


def test_fingerprint_changes_with_every_single_bit_flip() -> None:
    # Every bit of every element of a small array (float32 and bfloat16), one at a time.
    for dtype, word in ((jnp.float32, np.uint32), (jnp.bfloat16, np.uint16)):
        x = jax.random.normal(jax.random.key(0), (3, 5), dtype)
        bits = np.asarray(jax.lax.bitcast_convert_type(x, word)).reshape(-1)
        base = np.asarray(_fingerprint(x))
        flips = []
        for i in range(bits.size):
            for b in range(8 * bits.itemsize):
                flipped = bits.copy()
                flipped[i] ^= word(1 << b)
                flips.append(flipped.reshape(x.shape))
        as_dtype = functools.partial(jax.lax.bitcast_convert_type, new_dtype=dtype)
        prints = jax.vmap(lambda y, f=as_dtype: _fingerprint(f(y)))(jnp.asarray(np.stack(flips)))
        assert not np.any(np.all(np.asarray(prints) == base, axis=1)), dtype
    # Swapping two elements (same multiset of values) changes it too.
    x = jnp.arange(8.0)
    assert np.any(np.asarray(_fingerprint(x)) != np.asarray(_fingerprint(x[::-1])))
    # Padding is masked in place: the same as hashing the sliced logical array, whatever
    # the padding holds.
    logical = jax.random.normal(jax.random.key(1), (5, 3, 7))
    padded = jnp.full((8, 3, 9), 7.0).at[:5, :, :7].set(logical)
    np.testing.assert_array_equal(np.asarray(_fingerprint(padded, (5, 3, 7))),
                                  np.asarray(_fingerprint(logical)))


def test_digest_of_a_sharded_array_is_the_fingerprint_of_its_logical_array() -> None:
    # The checksum a checkpoint stores is computed per device (no collective) and summed
    # on the host: it must equal the fingerprint of the logical array (padding dropped,
    # tp split undone) whatever the sharding, replication and dtype, so checkpoints of
    # every mesh (and of earlier versions) verify.
    mesh = jax.make_mesh((2, 2, 2), ("dp", "gtp", "tp"))
    split = DimSplit(axis="tp", axis_size=2, dim=1, size=9, parts=3)  # fused, padded parts
    logical = jax.random.normal(jax.random.key(3), (5, 9), jnp.float32)
    stored = jnp.pad(split.to_stored(logical, 1), ((0, 3), (0, 0)))  # GTP rows 5 -> 8
    cases = {
        "split_padded": (stored, P("gtp", "tp"), {
            "shape": [8, 12], "logical_shape": [5, 9], "padded": True,
            "split_layout": [["tp", 2, 1, 3]], "dtype": "float32"}, logical),
        "padded_rows_dp_replicated": (jnp.pad(logical, ((0, 3), (0, 0))),
                                      P(("gtp", "tp")), {
            "shape": [8, 9], "logical_shape": [5, 9], "padded": True, "split_layout": [],
            "dtype": "float32"}, logical),
        "replicated_bf16": (logical.astype(jnp.bfloat16), P(), {
            "shape": [5, 9], "logical_shape": [5, 9], "padded": False, "split_layout": [],
            "dtype": "bfloat16"}, logical.astype(jnp.bfloat16)),
        "int32_by_dp": (jnp.arange(16, dtype=jnp.int32).reshape(4, 4), P("dp"), {
            "shape": [4, 4], "logical_shape": [4, 4], "padded": False, "split_layout": [],
            "dtype": "int32"}, jnp.arange(16, dtype=jnp.int32).reshape(4, 4)),
    }
    values = {k: jax.device_put(x, NamedSharding(mesh, spec))
              for k, (x, spec, _, _) in cases.items()}
    got, nonfinite = digest(values, {k: c[2] for k, c in cases.items()}, mesh)
    assert nonfinite == []
    for k, (_, _, _, want) in cases.items():
        a, b = (int(v) for v in np.asarray(_fingerprint(want)))
        assert got[k] == f"{a:08x}{b:08x}", k
    # NaN in the logical array is reported; in the padding it is not part of the state.
    bad = stored.at[1, 2].set(jnp.nan)
    pad_nan = stored.at[6, 0].set(jnp.nan)
    info = cases["split_padded"][2]
    _, nonfinite = digest({"bad": jax.device_put(bad, NamedSharding(mesh, P("gtp", "tp"))),
                           "pad": jax.device_put(pad_nan, NamedSharding(mesh, P("gtp", "tp")))},
                          {"bad": info, "pad": info}, mesh)
    assert nonfinite == ["bad"]


def _data_files(step_dir: Path) -> list[Path]:
    """The array data files of a step's model item, largest first."""
    files = [p for p in (step_dir / "model").rglob("*") if p.is_file() and "/d/" in str(p)]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _array_bytes(data: bytes) -> int:
    """Length of the first compressed frame of an OCDBT data file: chunk data of the
    arrays (b-tree nodes follow as later frames)."""
    end = data.find(_ZSTD_MAGIC, 4)
    return end if end > 0 else len(data)


def _flip_bit(path: Path, fraction: float, *, array_data: bool = True) -> None:
    data = bytearray(path.read_bytes())
    size = _array_bytes(bytes(data)) if array_data else len(data)
    data[int(size * fraction)] ^= 0x10
    path.write_bytes(bytes(data))


def _garbage(path: Path, fraction: float) -> None:
    data = bytearray(path.read_bytes())
    at = min(int(len(data) * fraction), len(data) - 64)
    data[at:at + 64] = bytes((i * 37 + 11) % 256 for i in range(64))
    path.write_bytes(bytes(data))


#: Damage to step 2's files -> whether the damaged step is still listed as a candidate
#: (its metadata reads) and only its arrays fail to restore.
CORRUPTIONS = {
    "bit_flip_start": (lambda d: _flip_bit(_data_files(d)[0], 0.1), True),
    "bit_flip_middle": (lambda d: _flip_bit(_data_files(d)[0], 0.5), True),
    "bit_flip_end": (lambda d: _flip_bit(_data_files(d)[0], 0.98), True),
    "garbage_64_bytes": (lambda d: _garbage(_data_files(d)[0], 0.4), True),
    "truncated_data_file": (lambda d: os.truncate(_data_files(d)[0],
                                                  _data_files(d)[0].stat().st_size // 2), True),
    "deleted_item_dir": (lambda d: shutil.rmtree(d / "model"), False),
    "garbled_meta_json": (lambda d: (d / "meta" / "metadata").write_text('{"step": 2, "arr'),
                          False),
    "missing_meta": (lambda d: shutil.rmtree(d / "meta"), False),
}


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory, mesh_dp2_gtp4) -> tuple[Path, dict]:
    """A directory with steps 1 and 2 of a sharded linear layer (different weights), and
    the logical weights of step 1."""
    directory = tmp_path_factory.mktemp("two") / "ck"
    model = _linear(mesh_dp2_gtp4)
    with Checkpointer(CheckpointConfig(directory, async_save=False)) as ckpt:
        ckpt.save(1, model)
        step1 = ckpt.read_arrays(1)
        model.module.kernel.set_value(model.module.kernel.get_value() * 2.0 + 0.5)
        ckpt.save(2, model)
    return directory, step1


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_damaged_checkpoint_is_detected_and_skipped(two_steps, case: str, tmp_path: Path,
                                                     mesh_dp2_gtp4) -> None:
    source, step1 = two_steps
    directory = tmp_path / "ck"
    shutil.copytree(source, directory)
    damage, still_listed = CORRUPTIONS[case]
    damage(directory / "2")
    model = _linear(mesh_dp2_gtp4, seed=5)
    before = snapshot(model)
    notes: list[str] = []
    with Checkpointer(CheckpointConfig(directory, resume=True)) as ckpt:
        candidates = ckpt.resume_candidates(report=notes.append)
        assert [s for s, _ in candidates] == ([2, 1] if still_listed else [1]), notes
        if still_listed:
            assert not notes
            with pytest.raises(CheckpointCorruptError, match=r"ck/2\b.*(checksum|cannot be read)"):
                ckpt.restore(model, step=2)
            assert_unchanged(model, before)  # nothing is changed by a failed restore
            with pytest.raises(CheckpointCorruptError):
                ckpt.read_arrays(2)
        else:
            assert len(notes) == 1 and "ck/2" in notes[0] and "skipping" in notes[0], notes
            assert ckpt.all_steps() == ([1, 2] if "meta_json" in case else [1])
        ckpt.restore(model, step=1)
        np.testing.assert_array_equal(np.asarray(gtp_jax.unshard(model).kernel.get_value()),
                                      step1["model/module/kernel"])
    assert (directory / "2").exists()  # nothing was deleted


def test_a_bit_flip_anywhere_never_restores_other_values(two_steps, tmp_path: Path,
                                                         mesh_dp2_gtp4) -> None:
    # Anywhere in the file (also in b-tree nodes, which may be harmless): either the restore
    # fails, or it restores exactly the saved values.
    source, _ = two_steps
    saved = Checkpointer(CheckpointConfig(source)).read_arrays(2)
    size = _data_files(source / "2")[0].stat().st_size
    for i, fraction in enumerate((0.02, 0.25, 0.5, 0.75, 0.9, 0.99, (size - 1) / size)):
        directory = tmp_path / f"ck{i}"
        shutil.copytree(source, directory)
        _flip_bit(_data_files(directory / "2")[0], fraction, array_data=False)
        model = _linear(mesh_dp2_gtp4, seed=5)
        with Checkpointer(CheckpointConfig(directory)) as ckpt:
            try:
                ckpt.restore(model, step=2)
            except CheckpointCorruptError:
                continue
        np.testing.assert_array_equal(np.asarray(gtp_jax.unshard(model).kernel.get_value()),
                                      saved["model/module/kernel"], err_msg=str(fraction))


def _edit_meta(step_dir: Path, edit: Callable[[dict], None]) -> None:
    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


#: Damage to a checkpoint's recorded checksums: each would turn verification off if a
#: missing entry meant "nothing to verify".
CHECKSUM_DAMAGE = {
    "deleted": lambda meta: meta.pop("checksums"),
    "null": lambda meta: meta.update(checksums=None),
    "not_a_dict": lambda meta: meta.update(checksums="0123"),
    "one_array_missing": lambda meta: meta["checksums"].pop(sorted(meta["checksums"])[0]),
}


@pytest.mark.parametrize("damage", list(CHECKSUM_DAMAGE))
def test_a_checkpoint_without_checksums_is_never_restored(two_steps, damage: str,
                                                          tmp_path: Path,
                                                          mesh_dp2_gtp4) -> None:
    source, step1 = two_steps
    directory = tmp_path / "ck"
    shutil.copytree(source, directory)
    _flip_bit(_data_files(directory / "2")[0], 0.5)  # a damaged byte, then no checksums
    _edit_meta(directory / "2", CHECKSUM_DAMAGE[damage])
    model = _linear(mesh_dp2_gtp4, seed=5)
    before = snapshot(model)
    notes: list[str] = []
    with Checkpointer(CheckpointConfig(directory, resume=True)) as ckpt:
        assert [s for s, _ in ckpt.resume_candidates(report=notes.append)] == [1]
        assert len(notes) == 1 and "ck/2" in notes[0] and "checksums" in notes[0], notes
        for read in (lambda: ckpt.restore(model, step=2), lambda: ckpt.read_arrays(2),
                     lambda: ckpt.verify(2)):
            with pytest.raises(CheckpointCorruptError,
                               match=r"ck/2: .*lacks the checksums.*another checkpoint"):
                read()
        assert_unchanged(model, before)
        ckpt.restore(model, step=1)
    np.testing.assert_array_equal(np.asarray(gtp_jax.unshard(model).kernel.get_value()),
                                  step1["model/module/kernel"])


def test_incomplete_step_is_not_listed(two_steps, tmp_path: Path) -> None:
    directory = tmp_path / "ck"
    shutil.copytree(two_steps[0], directory)
    shutil.rmtree(directory / "1" / "model")  # an old step half deleted by hand
    with Checkpointer(CheckpointConfig(directory)) as ckpt:
        assert ckpt.all_steps() == [2] and ckpt.latest_step() == 2


def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    full = train(RUN, progress=False, checkpoint=CheckpointConfig(tmp_path / "run", every=3))
    assert full.checkpoint_steps == [3, 6]
    _flip_bit(_data_files(tmp_path / "run" / "6")[0], 0.5)
    capsys.readouterr()
    # The damaged step 6 is skipped, training resumes at step 3 and reproduces steps 4-6
    # exactly; the damaged directory is renamed, not deleted.
    resumed = train(RUN, progress=False,
                    checkpoint=CheckpointConfig(tmp_path / "run", every=3, resume=True))
    err = capsys.readouterr().err
    assert resumed.first_step == 4 and resumed.losses == full.losses[3:]
    assert "skipping checkpoint" in err and "run/6" in err, err
    assert (tmp_path / "run" / "broken-6-0").is_dir()
    assert Checkpointer(CheckpointConfig(tmp_path / "run")).all_steps() == [3, 6]


def test_resume_with_no_intact_checkpoint_is_one_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match=r"no intact checkpoint in .*empty"):
        train(RUN, progress=False, checkpoint=CheckpointConfig(empty, resume=True))
    # A run killed during its very first save leaves only orbax's temporary directory.
    killed = tmp_path / "killed"
    (killed / "1.orbax-checkpoint-tmp-123" / "model").mkdir(parents=True)
    with pytest.raises(UsageError, match=r"no intact checkpoint in .*killed"):
        train(RUN, progress=False, checkpoint=CheckpointConfig(killed, resume=True))


# ---------------------------------------------------------------------- saves


def test_save_refuses_existing_and_older_steps(tmp_path: Path, mesh_dp2_gtp4) -> None:
    model = _linear(mesh_dp2_gtp4)
    with Checkpointer(CheckpointConfig(tmp_path / "ck", async_save=False)) as ckpt:
        ckpt.save(2, model)
        with pytest.raises(UsageError, match="step 2 .* already exists.*overwrite=True"):
            ckpt.save(2, model)
        with pytest.raises(UsageError, match=r"step 1 .* older than the newest \(2\)"):
            ckpt.save(1, model)
        model.module.kernel.set_value(model.module.kernel.get_value() + 1.0)
        ckpt.save(2, model, overwrite=True)
        assert ckpt.all_steps() == [2]
        np.testing.assert_array_equal(ckpt.read_arrays(2)["model/module/kernel"],
                                      np.asarray(gtp_jax.unshard(model).kernel.get_value()))


def test_non_finite_state_is_never_saved(tmp_path: Path, mesh_dp2_gtp4) -> None:
    model = _linear(mesh_dp2_gtp4)
    with Checkpointer(CheckpointConfig(tmp_path / "ck", keep=1, async_save=False)) as ckpt:
        ckpt.save(1, model)
        good = ckpt.read_arrays(1)
        kernel = model.module.kernel.get_value()
        model.module.kernel.set_value(kernel.at[0, 0].set(jnp.nan))
        with pytest.raises(NonFiniteStateError, match=r"step 2 .*1 of 2 arrays.*step 1\) is kept"):
            ckpt.save(2, model)
        assert ckpt.all_steps() == [1]  # keep=1 did not rotate the good one out
        np.testing.assert_array_equal(ckpt.read_arrays(1)["model/module/kernel"],
                                      good["model/module/kernel"])


def test_train_stops_before_saving_a_non_finite_state(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The loss of step 2 is finite (computed before the update); the update makes the
    # weights NaN. The save of step 2 must refuse and keep step 1.
    calls = []

    def poison(path, value):
        return value * jnp.nan if "embedding" in jax.tree_util.keystr(path) else value

    class PoisoningStep(loop_module.TrainStep):
        def __call__(self, batch):
            metrics = super().__call__(batch)
            calls.append(1)
            if len(calls) == 2:
                self.state = jax.tree_util.tree_map_with_path(poison, self.state)
            return metrics

    monkeypatch.setattr(loop_module, "TrainStep", PoisoningStep)
    directory = tmp_path / "ck"
    with pytest.raises(FloatingPointError, match=r"step 2 .*not saved.*step 1\) is kept"):
        train(RUN, progress=False, checkpoint=CheckpointConfig(directory, every=1, keep=1))
    ckpt = Checkpointer(CheckpointConfig(directory))
    assert ckpt.all_steps() == [1]
    assert all(np.all(np.isfinite(v)) for v in ckpt.read_arrays().values()
               if np.issubdtype(v.dtype, np.floating))
    assert not (directory / LOCK_FILE).exists()  # released after the failure


def test_full_disk_is_one_line_and_keeps_the_older_checkpoints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # The disk fills after two saves: the third does not fit. orbax used to fail part way
    # in its writer threads (179 tracebacks); the save is refused before it writes.
    import gtp_jax.train.lifecycle.checkpoint as checkpoint_module

    real = shutil.disk_usage
    saves = []

    def filling(path):
        usage = real(path)
        saves.append(path)
        return usage._replace(free=usage.free if len(saves) < 3 else 1 << 20)

    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", filling)
    directory = tmp_path / "ck"
    flags = ["train", "--steps", "4", "--batch", "8", "--seq", "32", "--warmup", "1",
             "--checkpoint-dir", str(directory), "--checkpoint-every", "1"]
    assert cli_main(flags) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"error: no room to save checkpoint step 3 in --checkpoint-dir={str(directory)!r} "
        "(it needs about "), err
    assert ("MiB are free); the older checkpoints (steps [1, 2]) are kept, so the run can "
            "continue from step 2. Free disk space, lower --keep-checkpoints or choose another "
            "--checkpoint-dir, then run the same command with --resume auto.") in err
    ckpt = Checkpointer(CheckpointConfig(directory))
    assert ckpt.all_steps() == [1, 2]
    ckpt.verify(2)
    ckpt.close()
    assert not (directory / LOCK_FILE).exists()
    # Space freed: the same command with --resume auto continues from step 2.
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", real)
    assert cli_main([*flags, "--resume", "auto"]) == 0
    assert "resumed from" in capsys.readouterr().out


def test_disk_full_while_writing_is_reported_once(tmp_path: Path, mesh_dp2_gtp4,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Space taken by someone else between the check and the write: orbax's error (text
    # from tensorstore) becomes the same one error, and closing does not raise it again.
    from gtp_jax.train.lifecycle.checkpoint import CheckpointWriteError

    model = _linear(mesh_dp2_gtp4)
    ckpt = Checkpointer(CheckpointConfig(tmp_path / "ck"))
    ckpt.save(1, model)
    ckpt.wait()

    errors = [ValueError('RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database: Failed '
                         "to write 1276773 bytes to file 4: No space left on device "
                         "[os_error_code='28']"), ValueError("unrelated")]
    wait = ckpt._manager.wait_until_finished

    def failing() -> None:  # as orbax: a background write's error is raised once
        if errors:
            raise errors.pop(0)
        wait()

    monkeypatch.setattr(ckpt._manager, "wait_until_finished", failing)
    with pytest.raises(CheckpointWriteError, match=r"no room to save checkpoint step 1 .*"
                                                   r"the file system is full\); the older "
                                                   r"checkpoints \(steps \[1\]\) are kept"):
        ckpt.save(2, model)
    with pytest.raises(ValueError, match="unrelated"):  # other errors pass unchanged
        ckpt.wait()
    ckpt.close()


# ---------------------------------------------------------------------- resume checks


def _meta(cfg: TrainConfig, **saved_changes: object) -> dict:
    saved = dataclasses.replace(cfg, **saved_changes) if saved_changes else cfg
    saved = resolve_auto(saved)  # a run saves the choices it made, never "auto"
    return {"step": 2, "extra": {"train_config": dataclasses.asdict(saved),
                                 "model_config": _model_json(model_config(saved)),
                                 "data": {"position": 2}}}


def _other_value(value: object) -> object:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return f"{value}-other"


def test_resume_compares_every_field_that_is_not_layout_only() -> None:
    # The schedule set explicitly (None would adopt the checkpoint's, by design).
    cfg = TrainConfig(steps=6, schedule_steps=6, warmup=1, schedule_version=2, lr=3e-3,
                      moe_experts=4, moe_top_k=2)
    assert RESUME_MAY_DIFFER <= {f.name for f in dataclasses.fields(TrainConfig)}
    # `layers` is compared through the model it builds (the next test).
    compared = [f.name for f in dataclasses.fields(TrainConfig)
                if f.name not in RESUME_MAY_DIFFER | COMPARED_AS_MODEL]
    assert {"moe_top_k", "moe_capacity_factor", "lr", "dtype", "schedule_steps", "warmup",
            "schedule_version"} <= set(compared)
    for name in compared:
        meta = _meta(cfg)
        # Change the saved value directly (some changed values would not validate).
        meta["extra"]["train_config"][name] = _other_value(getattr(cfg, name) or 1)
        with pytest.raises(UsageError, match=rf"different run \(.*\b{name}: checkpoint"):
            _check_resume(cfg, model_config(cfg), meta, "/ck")
    model_json = _model_json(model_config(cfg))
    for name in (k for k in model_json if k not in MODEL_MAY_DIFFER):
        meta = _meta(cfg)
        meta["extra"]["model_config"][name] = _other_value(model_json[name] or 1)
        with pytest.raises(UsageError, match=rf"model {name}: checkpoint"):
            _check_resume(cfg, model_config(cfg), meta, "/ck")
    # Layout-only fields may change.
    moved = dataclasses.replace(cfg, dp=1, gtp=8, remat="dots", prefetch=True)
    assert _check_resume(moved, model_config(moved), _meta(cfg), "/ck").schedule_steps == 6
    # So may the model's schedule and kernel choices, e.g. a checkpoint written when the
    # layers were scanned by default (unroll_layers=False) resumes under today's None.
    meta = _meta(cfg)
    meta["extra"]["model_config"].update(unroll_layers=False, swiglu_backend="reference",
                                         cp_attention_backend="reference")
    assert _check_resume(cfg, model_config(cfg), meta, "/ck").schedule_steps == 6


def test_a_presets_depth_resumes_however_it_is_spelled() -> None:
    # A run of the tiny preset saved when its default depth was 4 (layers=None): the same
    # depth spelled layers=4 resumes it; the preset's depth now (2) is refused, and the
    # error names the flag that builds the checkpoint's depth.
    cfg = TrainConfig(steps=6, schedule_steps=6, warmup=1, schedule_version=2, lr=3e-3)
    four = dataclasses.replace(cfg, layers=4)
    meta = _meta(cfg)
    meta["extra"]["model_config"] = _model_json(model_config(four))
    assert _check_resume(four, model_config(four), meta, "/ck").layers == 4
    with pytest.raises(UsageError, match=r"model n_layers: checkpoint 4 vs now 2; "
                                         r"TrainConfig.layers=4 builds the checkpoint's depth"):
        _check_resume(cfg, model_config(cfg), meta, "/ck")
    # A different depth either way is a different run.
    with pytest.raises(UsageError, match=r"model n_layers: checkpoint 4 vs now 3"):
        three = dataclasses.replace(cfg, layers=3)
        _check_resume(three, model_config(three), meta, "/ck")


def test_resume_rejects_changed_moe_fields() -> None:
    cfg = TrainConfig(steps=6, moe_experts=4, moe_top_k=2, moe_capacity_factor=1.25)
    for change in ({"moe_top_k": 1}, {"moe_capacity_factor": 2.0}):
        with pytest.raises(UsageError, match=f"{next(iter(change))}: checkpoint") as err:
            _check_resume(cfg, model_config(cfg), _meta(cfg, **change), "/ck")
        # Named once (not again as the model's field of the same name).
        assert str(err.value).count(f"{next(iter(change))}: checkpoint") == 1
    # The command line names the flag and spells its values as typed: None is
    # `--moe-capacity 0` (dropless), a field left unset "not given", words unquoted.
    dropless = dataclasses.replace(cfg, moe_capacity_factor=None, init_from="/ck0")
    with pytest.raises(UsageError) as err:
        _check_resume(dropless, model_config(dropless),
                      _meta(cfg, lr_schedule="linear"), "/ck")
    assert ("different run (--moe-capacity: checkpoint 1.25 vs now 0 (dropless); "
            "--init-from: checkpoint not given vs now '/ck0'; --lr-schedule: checkpoint "
            "linear vs now cosine). Pass") in cli_message(err.value)


def test_extending_a_finished_run_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    short = dataclasses.replace(RUN, steps=4)
    first = train(short, progress=False, checkpoint=CheckpointConfig(tmp_path / "ck"))
    with pytest.raises(RunFinished, match=r"finished .*step 4.*nothing to train.*"
                                          r"larger TrainConfig\.steps") as done:
        train(short, progress=False, checkpoint=CheckpointConfig(tmp_path / "ck", resume=True))
    assert done.value.step == 4 and not isinstance(done.value, UsageError)
    extended = train(RUN, progress=False,
                     checkpoint=CheckpointConfig(tmp_path / "ck", resume=True))
    assert extended.first_step == 5 and len(extended.losses) == 2
    # The same definition without interruption: the schedule spans the original 4 steps,
    # the added steps train at its final LR.
    whole = train(dataclasses.replace(RUN, schedule_steps=4), progress=False)
    assert first.losses + extended.losses == whole.losses
    meta = Checkpointer(CheckpointConfig(tmp_path / "ck")).read_meta()
    assert meta["extra"]["train_config"]["schedule_steps"] == 4
    # A second extension keeps the recorded schedule length.
    again = dataclasses.replace(RUN, steps=8)
    assert _check_resume(again, model_config(again), meta, "/ck").schedule_steps == 4
    schedule = train_module.make_optimizer(dataclasses.replace(RUN, schedule_steps=4))
    assert schedule is train_module.make_optimizer(
        _check_resume(again, model_config(again), meta, "/ck"))


def test_an_extended_run_trains_its_added_steps_at_the_final_rate(tmp_path: Path) -> None:
    """docs/cli.md's promise with the defaults, end to end: a 6-step run extended to 12.
    It used to warm up over 10 steps (step 1 at rate 0), keep warming up to the peak in the
    added steps, then drop 10x in one step."""
    common = ["train", "--batch", "8", "--seq", "32", "--checkpoint-dir", str(tmp_path / "ck"),
              "--resume", "auto", "--log-every", "1"]
    lrs = {}
    for steps in (6, 12):
        logs = tmp_path / f"logs{steps}"
        assert cli_main([*common, "--steps", str(steps), "--log-dir", str(logs)]) == 0
        lrs.update({r["step"]: r["lr"] for r in map(
            json.loads, (logs / "metrics.jsonl").read_text().splitlines())})
    peak = 3e-3  # --lr's default
    assert sorted(lrs) == list(range(1, 13))
    assert peak / 2 < lrs[1] < peak  # no warm-up in 6 steps: the decay's first step
    assert all(lrs[k] > lrs[k + 1] for k in range(1, 6))
    np.testing.assert_allclose([lrs[k] for k in range(6, 13)], peak / 10, rtol=1e-5)


def test_cli_relaunch_of_a_finished_run_is_one_line_and_status_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["train", "--steps", "2", "--batch", "8", "--seq", "32", "--warmup", "1",
             "--checkpoint-dir", str(tmp_path / "ck")]
    assert cli_main(flags) == 0
    capsys.readouterr()
    # What a scheduler re-queueing the completed job runs (also on another mesh).
    for mesh in ([], ["--gtp", "8", "--dp", "1"]):
        assert cli_main([*flags, "--resume", *mesh]) == 0
        out, err = capsys.readouterr()
        lines = out.splitlines()
        assert len(lines) == 1 and "finished" in lines[0] and "step 2" in lines[0]
        assert str(tmp_path / "ck") in lines[0] and "--steps=3" in lines[0]
        assert not err.strip()
    # Fewer steps than the run already trained is a real conflict.
    assert cli_main([*flags[:2], "1", *flags[3:], "--resume"]) == 2
    assert "past --steps=1" in capsys.readouterr().err
    assert Checkpointer(CheckpointConfig(tmp_path / "ck")).all_steps() == [2]


# ---------------------------------------------------------------------- paths and lock


def test_unwritable_paths_fail_before_training(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(UsageError, match=r"CheckpointConfig\.directory=.* is a file"):
        check_writable_dir(str(a_file), "CheckpointConfig.directory")
    with pytest.raises(UsageError, match="lies in /proc"):
        check_writable_dir("/proc/gtp_jax_ck", "CheckpointConfig.directory")
    with pytest.raises(UsageError, match=r"ObserveConfig\.metrics_json=.* is a file"):
        check_writable_file(str(a_file / "metrics.json"), "ObserveConfig.metrics_json")
    with pytest.raises(UsageError, match="lies in /proc"):
        check_writable_file("/proc/self/metrics.json", "ObserveConfig.metrics_json")
    check_writable_dir(str(tmp_path / "new" / "dir"), "CheckpointConfig.directory")
    assert not (tmp_path / "new").exists()  # the check creates nothing
    assert sorted(os.listdir(tmp_path)) == ["file"]  # and leaves no probe behind
    with pytest.raises(UsageError, match=r"CheckpointConfig\.directory=.* is a file"):
        train(RUN, progress=False, checkpoint=CheckpointConfig(a_file))


def test_cli_rejects_unwritable_paths_in_one_line(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [(["--checkpoint-dir", str(a_file)], "--checkpoint-dir="),
             (["--checkpoint-dir", "/proc/ck"], "--checkpoint-dir='/proc/ck' lies in /proc"),
             (["--profile-dir", str(a_file / "trace")], "--profile-dir="),
             (["--metrics-json", str(a_file / "m.json")], "--metrics-json="),
             (["--lr", "-1"], "--lr=-1.0 must be finite and > 0"),
             (["--checkpoint-dir", str(tmp_path / "c"), "--keep-checkpoints", "0"],
              "--keep-checkpoints=0 must be an int >= 1")]
    for flags, message in cases:
        assert cli_main(["train", "--steps", "2", "--batch", "8", "--seq", "32", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_directory_lock(tmp_path: Path) -> None:
    directory = tmp_path / "ck"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        directory.mkdir()
        (directory / LOCK_FILE).write_text(json.dumps(
            {"pid": holder.pid, "host": socket.gethostname()}))
        with pytest.raises(CheckpointLockedError, match=rf"in use by pid {holder.pid} on host "):
            DirectoryLock(str(directory)).acquire()
        with pytest.raises(UsageError, match=rf"pid {holder.pid}"):
            train(RUN, progress=False, checkpoint=CheckpointConfig(directory))
    finally:
        holder.kill()
        holder.wait()
    # The holder is gone: its lock is stale and is taken over.
    lock = DirectoryLock(str(directory))
    lock.acquire()
    assert json.loads((directory / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (directory / LOCK_FILE).exists() and not (directory / GUARD_FILE).exists()


@pytest.mark.parametrize("content", ["", "not json", "[1, 2]"])
def test_unreadable_lock_is_never_taken_over(tmp_path: Path, content: str) -> None:
    # An empty lock is what another run holds between creating and writing it.
    directory = tmp_path / "ck"
    directory.mkdir()
    (directory / LOCK_FILE).write_text(content)
    with pytest.raises(CheckpointLockedError, match="unreadable .*delete the lock file"):
        DirectoryLock(str(directory)).acquire()
    assert (directory / LOCK_FILE).read_text() == content


def test_lock_written_while_waiting_is_honoured(tmp_path: Path) -> None:
    directory = tmp_path / "ck"
    directory.mkdir()
    (directory / LOCK_FILE).write_text("")
    holder = {"pid": os.getppid(), "host": socket.gethostname()}  # alive: pytest's parent
    timer = threading.Timer(0.1, lambda: (directory / LOCK_FILE).write_text(json.dumps(holder)))
    timer.start()
    try:
        with pytest.raises(CheckpointLockedError, match=rf"in use by pid {holder['pid']}"):
            DirectoryLock(str(directory)).acquire()
    finally:
        timer.join()


def _race_for_the_lock(directory: str, start, results, done) -> None:
    """One of several runs starting together: takes the lock or is refused; a holder keeps
    it until `done`. The holder check is slowed (as on a loaded machine) to widen the
    window between finding a dead holder and taking its lock over."""
    import gtp_jax.train.lifecycle.lock as lock_module  # noqa: PLC0415

    check = lock_module.lock_is_stale

    def slow_check(holder):
        time.sleep(0.02)
        return check(holder)

    lock_module.lock_is_stale = slow_check
    start.wait()
    try:
        DirectoryLock(directory).acquire()
    except CheckpointLockedError:
        results.put(("refused", os.getpid()))
        return
    results.put(("held", os.getpid()))
    done.wait(30)


# The forked children run only the lock's Python code, never JAX's threads' code.
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_runs_starting_together_on_a_dead_holders_lock_get_one_holder(tmp_path: Path) -> None:
    # Each of six starters finds the same dead holder; exactly one may take the lock over.
    ctx = multiprocessing.get_context("fork")  # no re-import of JAX per starter
    dead = {"pid": 2**22 + 12345, "host": socket.gethostname()}  # past pid_max: never alive
    for trial in range(12):
        directory = tmp_path / f"ck{trial}"
        directory.mkdir()
        (directory / LOCK_FILE).write_text(json.dumps(dead))
        start, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
        starters = [ctx.Process(target=_race_for_the_lock,
                                args=(str(directory), start, results, done))
                    for _ in range(6)]
        for p in starters:
            p.start()
        start.set()
        try:
            outcomes = [results.get(timeout=60) for _ in starters]
        finally:
            done.set()
            for p in starters:
                p.join(30)
        holders = [pid for what, pid in outcomes if what == "held"]
        assert len(holders) == 1, f"trial {trial}: {len(holders)} holders"
        assert json.loads((directory / LOCK_FILE).read_text())["pid"] == holders[0]


def test_without_file_locking_a_dead_holders_lock_is_not_taken_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gtp_jax.train.lifecycle.lock as lock_module  # noqa: PLC0415

    monkeypatch.setattr(lock_module, "_flock", lambda fd, path: False)
    free = DirectoryLock(str(tmp_path / "free"))
    free.acquire()  # a free directory: created atomically (O_EXCL)
    free.release()
    directory = tmp_path / "ck"
    directory.mkdir()
    (directory / LOCK_FILE).write_text(json.dumps({"pid": 2**22 + 12345,
                                                   "host": socket.gethostname()}))
    with pytest.raises(CheckpointLockedError, match=r"no file locking.*delete the lock file"):
        DirectoryLock(str(directory)).acquire()


# ---------------------------------------------------------------------- memory


def test_memory_bound_and_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    base = memory_bound(RUN)
    # Parameters: num_params * 4 bytes / gtp (embeddings and layers all sharded).
    assert base["params"] == model_config(RUN).num_params() * 4 // RUN.gtp
    assert base["optimizer"] == 2 * base["params"]
    assert base["total"] == base["params"] + base["optimizer"] + max(base["grads"],
                                                                     base["activations"])
    bigger = memory_bound(dataclasses.replace(RUN, batch_size=8 * RUN.batch_size))
    assert bigger["activations"] == 8 * base["activations"]
    # Accumulation: the activations of one microbatch.
    accum = memory_bound(dataclasses.replace(RUN, batch_size=2 * RUN.batch_size, grad_accum=2))
    assert accum["activations"] == base["activations"]

    assert check_memory_fits(RUN, bytes_limit=2**40)["total"] == base["total"]
    with pytest.raises(DeviceMemoryError, match=r"needs at least .* GiB per device .* but a "
                                                r"device has 0\.00 GiB; .*remat"):
        check_memory_fits(RUN, bytes_limit=1000)
    # train() refuses before building anything when the device reports a small limit.
    monkeypatch.setattr(observe_module, "device_memory_limit", lambda: 1000)
    monkeypatch.setattr(loop_module, "build_model_and_optimizer",
                        lambda cfg: pytest.fail("built a model"))
    with pytest.raises(DeviceMemoryError):
        train(RUN, progress=False)


def test_memory_advice_names_only_the_changes_that_apply() -> None:
    # A run at remat "full" is not told to recompute more; one with its moments already in
    # host memory is not told to offload them; one without a replicating axis is told to
    # use more devices instead of sharding more.
    cases = {
        "none": (dataclasses.replace(RUN, remat="none"), ["'dots' or 'full'", "offload",
                                                          "larger TrainConfig.gtp"]),
        "dots": (dataclasses.replace(RUN, remat="dots"), ["remat to 'full'", "offload"]),
        "full": (dataclasses.replace(RUN, remat="full", dp=1, gtp=8),
                 ["offload_optimizer", "more devices"]),
        "offloaded": (dataclasses.replace(RUN, remat="full", offload_optimizer=True), []),
    }
    for name, (cfg, wanted) in cases.items():
        advice = memory_advice(cfg, memory_bound(cfg))
        assert advice.startswith("lower TrainConfig.batch_size"), advice
        assert advice.endswith("`python -m gtp_jax plan` ranks the layouts that fit."), advice
        for text in wanted:
            assert text in advice, (name, advice)
    assert "remat" not in memory_advice(cases["full"][0], memory_bound(cases["full"][0]))
    offloaded = cases["offloaded"][0]
    assert "offload" not in memory_advice(offloaded, memory_bound(offloaded))


def test_xla_out_of_memory_becomes_one_line(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    class OutOfMemoryStep(loop_module.TrainStep):
        def __call__(self, batch):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                               "1.2GiB")

    monkeypatch.setattr(loop_module, "TrainStep", OutOfMemoryStep)
    with pytest.raises(DeviceMemoryError, match=r"out of device memory at step 1 .*remat"):
        train(RUN, progress=False)
    assert cli_main(["train", "--steps", "2", "--batch", "8", "--seq", "32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out of device memory") and "--remat" in err, err

    class BuggyStep(loop_module.TrainStep):
        def __call__(self, batch):
            raise RuntimeError("INTERNAL: something else")

    # Any other failure is a bug: it keeps its type and traceback, also through the CLI.
    monkeypatch.setattr(loop_module, "TrainStep", BuggyStep)
    with pytest.raises(RuntimeError, match="INTERNAL"):
        cli_main(["train", "--steps", "2", "--batch", "8", "--seq", "32"])


def test_cli_does_not_hide_bugs(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):
        raise ValueError("an internal invariant failed")  # a plain ValueError is a bug

    monkeypatch.setattr(train_module, "train", broken)
    with pytest.raises(ValueError, match="internal invariant"):
        cli_main(["train", "--steps", "2", "--batch", "8", "--seq", "32"])


# ---------------------------------------------------------------------- summary and CLI


def test_summary_names_the_real_window_and_existing_checkpoints(tmp_path: Path) -> None:
    result = TrainResult(losses=[3.0, 2.0], step_times=[1.0, 0.5], tokens_per_step=10,
                         param_bytes_per_device=1, state_bytes_per_device=1,
                         replicated_param_bytes=1, replicated_state_bytes=1, num_params=1,
                         mesh_shape={"dp": 1}, backend="cpu")
    assert "(mean of last 2 steps)" in result.summary()
    kept = train(RUN, progress=False,
                 checkpoint=CheckpointConfig(tmp_path / "ck", every=2, keep=1))
    assert kept.checkpoint_steps == [6] and "checkpoints: steps [6]" in kept.summary()


def test_cli_mesh_that_does_not_fit_names_the_cause(capsys: pytest.CaptureFixture[str]) -> None:
    # In this process JAX already has 8 CPU devices: --gtp 3 with the default dp=2 is a
    # 6-device mesh (and batch 16 does not split over 6).
    assert cli_main(["train", "--steps", "1", "--gtp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--batch=16 must be a multiple of dp*ep*gtp = 2*1*3 = 6" in err, err
    assert "defaults {'dp': 2" in err, err
    assert cli_main(["train", "--steps", "1", "--gtp", "3", "--batch", "12"]) == 2
    err = capsys.readouterr().err
    assert "dp*ep*gtp*cp*tp = 2*1*3*1*1 = 6 must equal the 8 devices" in err, err


@pytest.mark.parametrize("flag,value", [("--cp", "0"), ("--cp", "-2"), ("--dp", "0"),
                                        ("--tp", "-1"), ("--ep", "0"), ("--gtp", "0")])
def test_cli_mesh_size_below_one_names_its_flag(flag: str, value: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # --cp 0 divided by zero deriving gtp's default; --cp -2 blamed --gtp.
    assert cli_main(["train", "--steps", "1", flag, value]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {flag}={value} must be >= 1 (the size of the '{flag[2:]}' mesh axis; " \
        "1 turns it off).\n", err


def test_cli_cudnn_attention_with_cp_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # Ring attention computes its blocks itself; --attention cudnn was silently unused.
    assert cli_main(["train", "--steps", "1", "--cp", "2", "--seq", "64", "--attention",
                     "cudnn"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --attention='cudnn' does not apply with --cp=2") \
        and err.count("\n") == 1, err


def test_distributed_join_timeout_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "gtp_jax", "train", "--steps", "1", "--coordinator",
         f"localhost:{port}", "--num-processes", "2", "--process-id", "0",
         "--distributed-timeout", "2"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr
    assert (f"process 0 could not join the run of 2 processes at coordinator localhost:{port} "
            "within 2 s") in lines[0] and "[1]" in lines[0]
