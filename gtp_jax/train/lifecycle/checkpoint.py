"""Sharded training checkpoints with orbax: save on one mesh, restore on any other.

What a checkpoint holds (one orbax step directory ``<directory>/<step>/``, three items):

- ``model`` (orbax ``StandardSave``, tensorstore/OCDBT): every array of the model
  (``nnx.state(model)``: parameters and any other variables, e.g. RNG keys and counters),
  as a nested dict keyed by the NNX paths.
- ``optimizer`` (same format): ``nnx.state(optimizer)``: AdamW ``mu``/``nu``, the schedule
  counts, the step. A separate item, so a model can be restored without it.
- ``meta`` (JSON, written by process 0): format version, step, the saving mesh, and per
  array its stored shape, logical shape, tp/ep split layout and dtype, plus caller data
  (`save`'s ``extra``: the training config, model config, data-loader position).

Each process writes only the shards its own devices hold (orbax writes every addressable
shard with replica id 0), so nothing is gathered to one host and no device allocates a
second copy of a weight.

Why GTP-sharded arrays are stored *padded*, exactly as they live on the devices:
  `gtp_jax.shard` zero-pads a sharded dim to a multiple of ``gtp * pad_for_alignment``, so
  the stored shape depends on the saving mesh. Storing the logical (unpadded) shape instead
  would need an unevenly sharded array (JAX rejects a NamedSharding that does not divide
  the dim) or a re-layout (a collective and a second device copy of every weight) at every
  save. Keeping the padded array makes a save a pure per-device write. The logical shape is
  in ``meta`` (and in the arrays' ``gtp_logical_shape`` metadata), so any reader can slice
  the padding off, and padding rows are zero (gradients and AdamW moments of padding rows
  are exactly zero, so they stay zero through training).

How restoring onto a different mesh works (different gtp/dp/ep sizes, another
``pad_for_alignment``, another process count):
  The caller builds the model and optimizer on the new mesh (e.g. `gtp_jax.shard` of a
  fresh model); their arrays give the target shapes and shardings. Every array is restored
  straight into its target sharding: each process reads from tensorstore only the index
  ranges of its own devices' shards. A padded dim of a different padded size is restored
  with orbax's ``strict=False``: rows past the stored extent are filled with zeros and rows
  past the target extent are dropped. Because both sizes are >= the logical size, every
  logical row is copied exactly, and padding rows are zero; a local (communication-free)
  mask then zeroes every row past the unpadded size, so the result does not depend on the
  saved padding being zero. Values are bit-exact: nothing is cast or recomputed. Only dims that
  carry the ``gtp_logical_shape`` metadata may differ in size; any other difference (model
  config, parameter set, dtype) is a UsageError raised before anything is modified.

  Weights split over ``tp``/``ep`` are stored in a split layout (``gtp_split_layout``
  metadata: per split dim, padded and, for fused dims, part-interleaved; see
  `gtp_jax.sharding.plan.DimSplit`), which depends on the tp/ep sizes. ``meta`` records each
  array's layout. When the target's layout equals the saved one, the array is restored as
  above. When it differs (another tp/ep size), the saved array is read whole, replicated on
  the target mesh (one array at a time, so the extra device memory is one full array),
  converted on device to the logical array and from there to the target layout, and
  placed in the target sharding; this is exact too (a permutation plus zero padding).

Atomicity: orbax writes a step into a temporary directory (``<step>.orbax-checkpoint-tmp``,
each item into its own temporary sub-directory) and renames it to ``<step>`` only after
every process has finished writing every item (`finalize`). A save interrupted before
that rename (crash, kill, preemption) leaves the previous checkpoints untouched and is never
listed as a step; ``cleanup_tmp_directories`` removes its leftovers (in the background
after the directory is opened, before the next save).
Only the `CheckpointConfig.keep` newest finalized steps are kept. A step directory missing
one of its items is not listed.

Integrity: `save` computes, in one jitted pass, a 64-bit fingerprint of every array's
logical values (padding dropped, split layouts undone; the same on any mesh) and checks that
every floating-point value is finite. A non-finite state is refused (`NonFiniteStateError`)
before orbax sees it, so it can neither replace nor rotate out the last finite checkpoint.
The fingerprints go into ``meta`` (``"checksums"``); `restore` / `read_arrays` / `verify`
recompute them over the restored logical values and raise `CheckpointCorruptError` (before
any variable changes) on a mismatch or on files that cannot be read. `resume_candidates`
lists the steps whose items and metadata are intact, reporting the others. See
docs/reliability.md.

orbax is imported lazily (when a `Checkpointer` is created), so training without
checkpoints does not need it installed.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.base.fp8_history import Fp8History
from gtp_jax.base.paths import local_path
from gtp_jax.sharding.fp8 import FP8_HISTORY_NAME
from gtp_jax.train.lifecycle.fingerprint import digest
from gtp_jax.train.lifecycle.layout import (
    array_info,
    is_key,
    numpy_dtype,
    relayout,
    savable,
    savable_shape,
    split_layout,
    stored_extent,
    to_logical,
    unsavable,
    zero_padding,
)
from gtp_jax.train.lifecycle.lock import CheckpointLockedError, DirectoryLock
from gtp_jax.train.lifecycle.step_dirs import OwnStepFolders, foreign_step_folders
from gtp_jax.train.step.optim import narrower_than_float32
from gtp_jax.train.step.train_step import offloads_master_weights

#: Bumped when the layout below changes incompatibly.
FORMAT_VERSION = 1

#: Array items: one per saved object, so that a model can be restored without its optimizer.
_ARRAY_ITEMS = ("model", "optimizer")
_META_ITEM = "meta"
#: File in the checkpoint directory naming the run that writes there (`DirectoryLock`).
class CheckpointCorruptError(UsageError):
    """A checkpoint's files are missing, unreadable or fail their checksums."""


class NonFiniteStateError(FloatingPointError):
    """The state to save holds NaN or inf; nothing was written."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written: its file system is full (or over its quota). The
    checkpoint being saved is not listed (orbax publishes a save only once it is complete)
    and the older ones are kept, so a run resumes from the newest of them."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpointer.restore` returns: what a training loop needs to continue.

    Attributes:
      step: the step of the restored checkpoint (its `Checkpointer.save` step): continue
        with ``step + 1``.
      extra: the ``extra`` given to `Checkpointer.save` (JSON values: e.g. the data
        position); ``{}`` when none was.
      metadata: the checkpoint's whole metadata with ``restore(..., with_metadata=True)``
        (``"step"``, ``"extra"``, ``"mesh"``, ``"arrays"``, ``"checksums"``, ...), else None.
    """

    step: int
    extra: dict[str, Any]
    metadata: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often training checkpoints are written.

    Attributes:
      directory: checkpoint root (one sub-directory per saved step); stored absolute.
        In a multi-process run every process must see the same directory (a shared
        file system or an object store that orbax supports, e.g. ``gs://``).
      every: save every `every` optimizer steps; 0 saves only at the end of the run (the last
        step is always saved).
      keep: how many of the newest checkpoints to keep (older ones are deleted).
      resume: True: continue from the newest intact checkpoint in `directory` (which must
        exist and hold one); ``"auto"``: continue from it if there is one, else start a new
        run (the same command starts a job and resumes it after a requeue); False:
        `directory` must not hold checkpoints yet.
      async_save: write in a background thread after copying the arrays to host memory, so
        training continues during the write (orbax async checkpointing).
    """

    directory: str
    every: int = 0
    keep: int = 3
    resume: bool | str = False
    async_save: bool = True

    def __post_init__(self) -> None:
        directory = os.fspath(self.directory) if self.directory is not None else ""
        if not isinstance(directory, str) or not directory:
            raise UsageError(
                f"CheckpointConfig.directory={self.directory!r} must be a non-empty path."
            )
        try:
            directory = local_path(directory, storage=True)
        except UsageError as err:
            raise UsageError(f"CheckpointConfig.directory={err}.") from None
        if "://" not in directory:  # keep gs:// and other object stores as given
            directory = os.path.abspath(directory)
        object.__setattr__(self, "directory", directory)
        for name, minimum in (("every", 0), ("keep", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise UsageError(f"CheckpointConfig.{name}={value!r} must be an int >= {minimum}.")
        if not (isinstance(self.resume, bool) or self.resume == "auto"):
            raise UsageError(f"CheckpointConfig.resume={self.resume!r} must be True, False or "
                             "'auto'.")
        if self.resume is True and "://" not in directory and not os.path.isdir(directory):
            raise UsageError(
                f"CheckpointConfig.resume: checkpoint directory {directory!r} does not exist; "
                "pass the CheckpointConfig.directory of an earlier run, drop "
                "CheckpointConfig.resume to start a new run, or use CheckpointConfig.resume="
                "'auto' to do either."
            )


class Checkpointer:
    """Saves and restores (model, optimizer) state with orbax; see the module docstring.

    Every process of a multi-process run must create it and call `save` / `restore` with
    the same arguments (orbax synchronizes the processes inside these calls).

    Args:
      config: a `CheckpointConfig`.
      read_only: only read (`restore`, `read_meta`, ...): the directory is not created and
        leftovers of unfinished saves are not removed (another run may be writing them).

    Raises:
      ImportError: orbax-checkpoint is not installed (``pip install orbax-checkpoint``).
    """

    def __init__(self, config: CheckpointConfig, *, read_only: bool = False):
        if not isinstance(config, CheckpointConfig):
            raise UsageTypeError(
                f"Checkpointer expects a CheckpointConfig, got {type(config).__name__}.")
        try:
            import orbax.checkpoint as ocp  # noqa: PLC0415  (optional dependency)
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "Checkpoints need orbax-checkpoint: pip install orbax-checkpoint "
                "(it is a dependency of gtp-jax; reinstall with pip install -e .)."
            ) from err
        self._ocp = ocp
        self.config = config
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep,
            create=not read_only,
            enable_async_checkpointing=config.async_save,
            # Leftovers of a save that died before finalization are deleted on open.
            cleanup_tmp_directories=not read_only,
            # Folders named by a step number that no save wrote (a user's) are not listed,
            # so orbax never reads, rotates out or deletes them.
            step_name_format=OwnStepFolders(ocp.step.standard_name_format()),
        )
        self._closed = False
        if not any(isinstance(f, _QuietDiskFull) for f in logging.getLogger("absl").filters):
            logging.getLogger("absl").addFilter(_QuietDiskFull())
        self._pending_step: int | None = None  # the newest save started
        self._write_failed = False  # a CheckpointWriteError was raised already
        # (orbax's own read_only option logs three warnings per open; never saving
        # through this manager and leaving its leftovers alone is what read-only needs.)
        self._manager = ocp.CheckpointManager(
            config.directory, options=options, item_names=(*_ARRAY_ITEMS, _META_ITEM))
        # The checkpoints an earlier run left (CheckpointConfig.resume=False saves into an
        # empty directory only: `save`).
        self._found = () if read_only else tuple(self._raw_steps())
        _finalize_at_exit(self)

    # ------------------------------------------------------------------ queries

    def all_steps(self) -> list[int]:
        """Steps of the finalized, complete checkpoints, oldest first.

        A step directory that lacks one of its items (e.g. half deleted by hand) is not
        listed; `resume_candidates` reports it.
        """
        return [s for s in self._raw_steps() if self._missing_items(s) is None]

    def latest_step(self) -> int | None:
        """The newest finalized, complete step, or None if the directory holds none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def foreign_folders(self) -> list[str]:
        """Folders of the directory named by a step number that hold no checkpoint (a
        user's own): never listed, read, renamed or deleted (`step_dirs`)."""
        return foreign_step_folders(self.config.directory)

    def holds_saves(self) -> bool:
        """Whether any save was finalized here (intact or not); a save that never finished
        does not count."""
        return bool(self._raw_steps())

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata of `step` (default: the newest), without reading any array.

        Raises:
          UsageError: there is no such checkpoint.
          CheckpointCorruptError: its metadata is missing or unreadable.
        """
        step = self._checked_step(step)
        return self._read_meta(step)

    def resume_candidates(self, report: Callable[[str], None] | None = None
                          ) -> list[tuple[int, dict[str, Any]]]:
        """``(step, meta)`` of every checkpoint whose items and metadata are intact, newest
        first. Each step that is skipped (missing item, missing or garbled metadata) is
        passed to `report` as one line naming it and why. Array data is verified by
        `restore` (checksums)."""
        out = []
        for step in reversed(self._raw_steps()):
            try:
                missing = self._missing_items(step)
                if missing is not None:
                    raise CheckpointCorruptError(
                        f"checkpoint {self._step_path(step)}: item {missing!r} is missing")
                out.append((step, self._read_meta(step)))
            except CheckpointCorruptError as err:
                if report is not None:
                    report(f"skipping {err}")
        return out

    def set_aside(self, step: int) -> str | None:
        """Renames the (broken) checkpoint `step` to ``broken-<step>-<n>`` in the same
        directory, so that a resumed run can save that step again without deleting what the
        user may still want to inspect. Only process 0 renames; every process calls it.
        Returns the new path (process 0), else None."""
        new = None
        if jax.process_index() == 0 and "://" not in self.config.directory:
            n = 0
            while os.path.exists(os.path.join(self.config.directory, f"broken-{step}-{n}")):
                n += 1
            new = os.path.join(self.config.directory, f"broken-{step}-{n}")
            os.rename(self._step_path(step), new)
        _sync_processes(f"gtp_jax_set_aside_{step}")
        self._manager.reload()
        return new

    def set_aside_newer(self, step: int) -> list[str]:
        """`set_aside` of every finalized step directory newer than `step` (those a run
        resumed from `step` would save again); returns the new paths (process 0)."""
        return [p for s in self._raw_steps() if s > step
                for p in [self.set_aside(s)] if p is not None]

    # ------------------------------------------------------------------ save / restore

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer | None = None, *,
             extra: Mapping[str, Any] | None = None, overwrite: bool = False) -> None:
        """Writes the arrays of `model` (and `optimizer`) as checkpoint `step`.

        Each process writes the shards of its own devices. With `CheckpointConfig.async_save`
        this returns once the arrays are copied to host memory; the write finishes in the
        background (`wait` / `close` block until it is finalized).

        Before anything is written, one jitted pass over the state computes a checksum of
        every array (stored in the metadata and verified by `restore`) and checks that every
        floating-point value is finite: a state holding NaN/inf is never saved, so it cannot
        replace (or, through `CheckpointConfig.keep`, delete) the last finite checkpoint.

        Args:
          step: optimizer step the state belongs to (>= 0); the directory's step name.
          model: usually a `gtp_jax.ShardedModule`; every variable is saved.
          optimizer: an ``nnx.Optimizer`` of `model`, or None.
          extra: JSON-serializable data stored with the checkpoint (e.g. configs and the
            data-loader position), returned by `restore` / `read_meta` under ``"extra"``.
          overwrite: replace an existing checkpoint `step` (and allow a step older than the
            newest); without it such a save is a UsageError.

        Raises:
          UsageError: bad `step`, or `step` exists / is older than the newest and not
            `overwrite`.
          NonFiniteStateError: some array holds NaN or inf; nothing was written.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise UsageError(f"Checkpointer.save: step={step!r} must be an int >= 0.")
        step = int(step)
        if self._step_path(step) in self.foreign_folders():
            raise UsageError(
                f"Checkpointer.save: {self._step_path(step)} is a folder that holds no "
                f"checkpoint (not written by gtp_jax, left alone), so step {step} cannot be "
                "saved there; move or rename that folder.")
        steps = self._raw_steps()
        if not overwrite and steps and step <= steps[-1]:
            what = "already exists" if step in steps else f"is older than the newest ({steps[-1]})"
            raise UsageError(
                f"Checkpointer.save: step {step} in {self.config.directory!r} {what}; pass "
                "overwrite=True to replace it, or save a newer step."
            )
        if self.config.resume is False and self._found:
            raise UsageError(
                f"Checkpointer.save: CheckpointConfig.directory={self.config.directory!r} "
                f"held checkpoints of an earlier run (steps {list(self._found)}) and "
                "CheckpointConfig.resume is False (a new run); set CheckpointConfig.resume="
                "True (or 'auto') to continue that run, or use an empty directory.")
        flat = _flat_arrays(model, optimizer)
        donated = [path for path, (_, value) in flat.items()
                   if isinstance(value, jax.Array) and value.is_deleted()]
        if donated:
            raise UsageError(
                f"Checkpointer.save: {donated[0]} (and {len(donated) - 1} more) holds an array "
                "a jitted step consumed (donated); the current state is the step's: call "
                "TrainStep.sync() before saving (or save the arrays the step returned).")
        infos = {path: array_info(var, value) for path, (var, value) in flat.items()}
        arrays = {path: savable(value) for path, (_, value) in flat.items()}
        # The previous save's background writes finish first: that makes it visible to
        # `latest_step` below (named by the NaN refusal), and saves are many steps apart,
        # so this rarely waits.
        self.wait()
        checksums, nonfinite = digest(arrays, infos, _mesh_of_model(model))
        if nonfinite:
            last = self.latest_step()
            kept = (f"the last checkpoint (step {last}) is kept" if last is not None
                    else "no checkpoint was written")
            raise NonFiniteStateError(
                f"the state at step {step} holds NaN/inf in {len(nonfinite)} of {len(flat)} "
                f"arrays (e.g. {nonfinite[0]}); it was not saved and {kept}."
            )
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "mesh": _mesh_of(model, flat),
            "process_count": jax.process_count(),
            "arrays": infos,
            "checksums": checksums,
            "extra": dict(extra or {}),
        }
        if overwrite and step in steps:
            self._manager.wait_until_finished()
            self._manager.delete(step)
        self._check_room(step, arrays)
        ocp = self._ocp
        tree = _nest(arrays)
        with self._disk_full(step):
            started = self._manager.save(step, force=overwrite, args=ocp.args.Composite(
                **{name: ocp.args.StandardSave(sub) for name, sub in tree.items()},
                **{_META_ITEM: ocp.args.JsonSave(meta)}))
        if not started:  # orbax declined (e.g. a step written concurrently by another run)
            raise UsageError(
                f"Checkpointer.save: orbax did not save step {step} in "
                f"{self.config.directory!r} (steps there: {self._raw_steps()})."
            )

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer | None = None,
                step: int | None = None, *, with_metadata: bool = False) -> Restored:
        """Loads checkpoint `step` (default: newest) into `model` and `optimizer` in place.

        `model` / `optimizer` may live on a different mesh than the one that saved (see the
        module docstring); their current arrays define the target shapes and shardings.
        Everything is validated against the checkpoint's metadata before any array is read,
        and every restored array is verified against its checksum before any variable is
        changed.

        A hand-written loop continues from what it returns::

            restored = ckpt.restore(model, optimizer)    # the newest checkpoint
            for step in range(restored.step + 1, steps + 1):
                ...
            position = restored.extra["data"]            # what `save(extra=...)` stored

        Args:
          model, optimizer: the objects to fill (the optimizer may be left out: the model
            alone is restored, e.g. for evaluation).
          step: the checkpoint to restore; None: the newest.
          with_metadata: also return the checkpoint's whole metadata (`Restored.metadata`:
            per array its stored and logical shape, layout, dtype and checksum, the saving
            mesh; about 20 KB for the tiny preset); `read_meta` reads it without restoring.

        Returns:
          A `Restored`: the step and the ``extra`` given to `save` (and the metadata when
          asked for).

        Raises:
          UsageError: no such step, or the checkpoint does not match `model` / `optimizer`
            (missing or extra variables, other logical shapes or dtypes), or `model`'s
            master weights are held by an optimizer that is not restored with it.
          CheckpointCorruptError: unreadable files or a checksum mismatch.
        """
        if not isinstance(with_metadata, bool):
            raise UsageTypeError(f"Checkpointer.restore: with_metadata={with_metadata!r} must "
                                 "be True or False.")
        step = self._checked_step(step)
        if optimizer is None:
            _check_model_alone(model)
        meta = saved = self._read_meta(step)
        flat = _flat_arrays(model, optimizer)
        # FP8 amax histories (delayed scaling) may be switched on or off across a restore
        # (`TrainConfig.fp8_compute` may change on resume): a history the checkpoint lacks
        # keeps its fresh start, as a new delayed run's; a saved one the target lacks is
        # not read.
        fresh = {k for k, (var, _) in flat.items()
                 if isinstance(var, Fp8History) and k not in meta["arrays"]}
        flat = {k: v for k, v in flat.items() if k not in fresh}
        unread = {k: v for k, v in meta["arrays"].items()
                  if k not in flat and _is_fp8_history(k)}
        meta = {**meta, "arrays": {k: v for k, v in meta["arrays"].items() if k not in unread}}
        _check_compatible(meta, flat, self.config.directory, step)
        stored = meta["arrays"]
        mesh = _mesh_of_model(model)
        replicated = NamedSharding(mesh, P()) if mesh is not None else None
        target, relaid = {}, set()
        for path, (var, value) in flat.items():
            if split_layout(stored[path]) == split_layout(array_info(var, value)):
                target[path] = _abstract(value, mesh)
            else:
                # Another tp/ep split: read the saved layout whole on every device (one array
                # at a time), then permute it into the target layout on device.
                relaid.add(path)
                target[path] = jax.ShapeDtypeStruct(tuple(stored[path]["shape"]),
                                                    numpy_dtype(stored[path]["dtype"]),
                                                    sharding=replicated)
        ocp = self._ocp
        # orbax restores whole items: the histories the target lacks are read (small,
        # replicated) and dropped.
        whole = replicated or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        dropped = {k: jax.ShapeDtypeStruct(tuple(info["shape"]), numpy_dtype(info["dtype"]),
                                           sharding=whole) for k, info in unread.items()}
        tree = _nest({**target, **dropped})
        restored = self._read_items(step, ocp.args.Composite(**{
            # strict=False: padded dims may be restored into another padded size (re-padding).
            name: ocp.args.StandardRestore(sub, strict=False) for name, sub in tree.items()}))
        values = {k: v for k, v in _flatten_nested({name: restored[name] for name in tree}).items()
                  if k in target}
        new_values, infos = {}, {}
        for key, (var, old) in flat.items():
            new, info = values[key], array_info(var, old)
            if key in relaid:
                new = relayout(new, stored[key], info, old.sharding)
            else:
                # Also on the same mesh: padding is outside the (logical) checksum, so it is
                # re-zeroed rather than trusted.
                new = zero_padding(new, info)
            new_values[key], infos[key] = new, info
        self._verify(step, meta, new_values, infos, mesh)
        for obj, prefix in ((model, "model"), (optimizer, "optimizer")):
            if obj is None:
                continue
            new_vars = []
            for path, var in nnx.to_flat_state(nnx.state(obj)):
                key = _join((prefix, *path))
                if key in fresh:
                    continue
                new_vars.append((path, var.replace(value=unsavable(new_values[key],
                                                                    flat[key][1]))))
            nnx.update(obj, nnx.from_flat_state(new_vars))
        return Restored(step=step, extra=dict(saved.get("extra") or {}),
                        metadata=saved if with_metadata else None)

    def read_arrays(self, step: int | None = None) -> dict[str, np.ndarray]:
        """Every array of checkpoint `step` (default: newest) as host NumPy, unpadded.

        For inspection, export and tests: each array is read whole into this process's
        memory, so use it for models that fit in host RAM. Arrays come back in their logical
        shapes and order (GTP padding sliced off, tp/ep split layouts undone), independent
        of the saving mesh; PRNG keys come back as their raw ``uint32`` key data.

        Returns:
          ``{"model/<path>" | "optimizer/<path>": array}`` with the saved dtypes.
        """
        step = self._checked_step(step)
        meta = self._read_meta(step)
        stored = meta["arrays"]
        target = {path: np.empty(info["shape"], numpy_dtype(info["dtype"]))
                  for path, info in stored.items()}
        ocp = self._ocp
        tree = _nest(target)
        restored = self._read_items(step, ocp.args.Composite(**{
            name: ocp.args.StandardRestore(sub) for name, sub in tree.items()}))
        values = {k: np.asarray(v)
                  for k, v in _flatten_nested({name: restored[name] for name in tree}).items()}
        self._verify(step, meta, values, stored, None)
        return {path: np.asarray(to_logical(values[path], info))
                for path, info in stored.items()}

    def verify(self, step: int | None = None) -> None:
        """Reads every array of `step` (default: newest) and checks its checksum, without a
        model (through host memory, like `read_arrays`).

        Raises:
          CheckpointCorruptError: missing, unreadable or modified files.
        """
        self.read_arrays(step)

    def wait(self) -> None:
        """Blocks until every started save is finalized (renamed into place).

        Raises:
          CheckpointWriteError: a save's background writes ran out of disk space.
        """
        with self._disk_full(self._pending_step):
            self._manager.wait_until_finished()

    def _check_room(self, step: int, arrays: Mapping[str, Any]) -> None:
        """Refuses a save that cannot fit in its file system's free space, before orbax
        writes anything: a save that fills the disk part way fails in orbax's background
        threads, each printing its own traceback (179 for one save), and leaves its partial
        files taking the space until the next start. A local directory of a one-process
        run only: processes must all save or none (they would wait for each other), and
        each sees the free space at another moment."""
        if jax.process_count() > 1 or "://" in self.config.directory:
            self._pending_step = step
            return
        need = sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize
                   for a in arrays.values()) + SAVE_HEADROOM
        free = shutil.disk_usage(self.config.directory).free
        if need > free:
            raise CheckpointWriteError(self._full_message(
                step, f"it needs about {need / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are "
                "free"))
        self._pending_step = step

    def _full_message(self, step: int | None, why: str) -> str:
        kept = self.all_steps()
        older = (f"the older checkpoints (steps {kept}) are kept, so the run can continue "
                 f"from step {kept[-1]}" if kept else "no older checkpoint exists")
        return (f"no room to save checkpoint step {step} in "
                f"CheckpointConfig.directory={self.config.directory!r} ({why}); {older}. "
                "Free disk space, lower CheckpointConfig.keep or choose another "
                "CheckpointConfig.directory, then run the same command with "
                "CheckpointConfig.resume='auto'.")

    @contextlib.contextmanager
    def _disk_full(self, step: int | None) -> Iterator[None]:
        """Turns orbax's error for a full file system (whatever type it arrives as) into a
        `CheckpointWriteError`; other errors pass."""
        try:
            yield
        except Exception as err:
            if not _is_disk_full(err):
                raise
            self._write_failed = True
            raise CheckpointWriteError(
                self._full_message(step, "the file system is full")) from None

    def close(self) -> None:
        """Waits for pending saves and for the clean-up of unfinished saves' leftovers, then
        releases orbax's resources. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        # orbax removes leftovers of unfinished saves in a background thread started when
        # the directory is opened, and its `close` does not wait for it: a process exiting
        # right after (a refused resume) raced the interpreter's executor shutdown and
        # printed a "cannot schedule new futures after shutdown" traceback.
        await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
        try:
            if await_cleanup is not None:
                await_cleanup()
        finally:
            try:
                self.wait()
            except CheckpointWriteError:
                if not self._write_failed:  # reported here, not by an earlier save
                    raise
            finally:
                self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _step_path(self, step: int) -> str:
        return os.path.join(self.config.directory, str(step))

    def _raw_steps(self) -> list[int]:
        """Every finalized step directory orbax lists, complete or not, oldest first."""
        return sorted(self._manager.all_steps())

    def _missing_items(self, step: int) -> str | None:
        """The first required item absent from step `step`'s directory, or None. (Only
        local paths are checked; object stores list no empty directories.)"""
        if "://" in self.config.directory:
            return None
        for item in ("model", _META_ITEM):
            if not os.path.isdir(os.path.join(self._step_path(step), item)):
                return item
        return None

    def _read_meta(self, step: int) -> dict[str, Any]:
        try:
            restored = self._manager.restore(step, args=self._ocp.args.Composite(
                **{_META_ITEM: self._ocp.args.JsonRestore()}))
            meta = restored[_META_ITEM]
        except Exception as err:  # orbax/json errors differ by cause; all mean "unreadable"
            raise CheckpointCorruptError(
                f"checkpoint {self._step_path(step)}: its metadata cannot be read "
                f"({_first_line(err)})") from err
        if (not isinstance(meta, Mapping) or not isinstance(meta.get("arrays"), Mapping)
                or meta.get("step") != step):
            raise CheckpointCorruptError(f"checkpoint {self._step_path(step)}: its metadata is "
                                         "incomplete or names another step")
        checksums = meta.get("checksums")
        # Every checkpoint this format names was saved with checksums: metadata without them
        # is damaged, and restoring it unverified would train on whatever the files hold.
        if (not isinstance(checksums, Mapping)
                or any(not isinstance(checksums.get(k), str) for k in meta["arrays"])):
            raise CheckpointCorruptError(
                f"checkpoint {self._step_path(step)}: its metadata lacks the checksums of its "
                "arrays (damaged), so they cannot be verified; use another checkpoint")
        return dict(meta)

    def _read_items(self, step: int, args: Any) -> Any:
        """orbax restore of array items; any read failure (missing, truncated or garbled
        files) becomes a CheckpointCorruptError naming the step."""
        try:
            return self._manager.restore(step, args=args)
        except Exception as err:  # tensorstore/orbax raise many types for damaged files
            raise CheckpointCorruptError(
                f"checkpoint {self._step_path(step)} cannot be read ({_first_line(err)})"
            ) from err

    def _verify(self, step: int, meta: Mapping[str, Any], values: Mapping[str, Any],
                infos: Mapping[str, Any], mesh: Mesh | None) -> None:
        """Compares the checksums of restored `values` with those recorded at save time."""
        expected = meta["checksums"]  # present for every array (`_read_meta`)
        got, _ = digest(values, infos, mesh)
        bad = sorted(k for k in values if expected.get(k) != got[k])
        if bad:
            raise CheckpointCorruptError(
                f"checkpoint {self._step_path(step)}: {len(bad)} array(s) fail their checksum "
                f"(e.g. {bad[0]}); the files were modified or damaged after the save"
            )

    def _checked_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise UsageError(
                    f"checkpoint directory {self.config.directory!r} holds no finalized "
                    "checkpoint; pass the CheckpointConfig.directory of an earlier run."
                )
            return steps[-1]
        if step not in steps:
            raise UsageError(
                f"checkpoint step {step} is not in {self.config.directory!r} (steps: {steps}); "
                "pick one of those."
            )
        return int(step)


# ---------------------------------------------------------------------- helpers


def _finalize_at_exit(ckpt: Checkpointer) -> None:
    """Finalizes `ckpt`'s pending save when the interpreter exits without `close` (a script
    whose loop ends with a save): else the last asynchronous save is left unfinished (an
    ``N.orbax-checkpoint-tmp`` folder the next open deletes) and orbax's threads print
    tracebacks. It runs at the threading module's shutdown, before the thread pools orbax
    writes with stop taking work (a plain ``atexit`` hook runs after them)."""
    ref = weakref.ref(ckpt)

    def finalize() -> None:
        alive = ref()
        if alive is None or alive._closed:
            return
        try:
            alive.close()
        except Exception as err:  # noqa: BLE001 - the process is exiting: one line
            print(f"gtp_jax: the last checkpoint save in {alive.config.directory!r} did not "
                  f"finish: {_first_line(err)}", file=sys.stderr)

    register = getattr(threading, "_register_atexit", None)
    try:
        (register or atexit.register)(finalize)
    except RuntimeError:  # already shutting down: nothing left to register for
        pass


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def _sync_processes(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # noqa: PLC0415

        multihost_utils.sync_global_devices(name)


def _join(path: Any) -> str:
    return "/".join(str(p) for p in path)


def _flat_arrays(model: nnx.Module,
                 optimizer: nnx.Optimizer | None) -> dict[str, tuple[nnx.Variable, Any]]:
    """``{"model/<path>": (variable, value), "optimizer/<path>": ...}`` for array leaves."""
    if not isinstance(model, nnx.Module):
        raise UsageTypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}.")
    out: dict[str, tuple[nnx.Variable, Any]] = {}
    for obj, prefix in ((model, "model"), (optimizer, "optimizer")):
        if obj is None:
            continue
        for path, var in nnx.to_flat_state(nnx.state(obj)):
            value = var.get_value()
            if not hasattr(value, "shape") or not hasattr(value, "dtype"):
                raise UsageTypeError(
                    f"{prefix}/{_join(path)} holds a {type(value).__name__}, not an array; "
                    "only array state can be checkpointed."
                )
            out[_join((prefix, *path))] = (var, value)
    return out


#: Bytes a save needs beyond its arrays' (the metadata and orbax's files), for the free space
#: check: the tiny preset's 10.4 MB of arrays took 9.6 MB on disk, OCDBT adds little.
SAVE_HEADROOM = 1 << 20
#: errno values of a file system that has no room left.
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _is_fp8_history(path: str) -> bool:
    """Whether a stored array is an FP8 layer's `Fp8History` (the attribute
    `gtp_jax.sharding.fp8` gives it)."""
    return path.rsplit("/", 1)[-1] == FP8_HISTORY_NAME


class _QuietDiskFull(logging.Filter):
    """Drops orbax's log records of writes that failed for a full disk: each of its writer
    threads logs its own traceback, and `CheckpointWriteError` says it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (_is_disk_full(error) or _is_disk_full(Exception(record.getMessage())))


def _is_disk_full(err: BaseException | None) -> bool:
    """Whether `err` (or an exception it was raised from) says the file system is full:
    tensorstore's errors reach Python as ValueError text ("No space left on device
    [os_error_code='28']"), Python's own as OSError."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno in _DISK_FULL_ERRNOS:
            return True
        text = str(err)
        if any(f"os_error_code='{code}'" in text for code in _DISK_FULL_ERRNOS) or \
                "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def _mesh_of_model(model: nnx.Module) -> Mesh | None:
    mesh = getattr(model, "mesh", None)
    return mesh if isinstance(mesh, Mesh) else None


def _mesh_of(model: nnx.Module, flat: Mapping[str, tuple[nnx.Variable, Any]]) -> dict[str, int]:
    mesh = _mesh_of_model(model)
    if mesh is None:
        for _, value in flat.values():
            sharding = getattr(value, "sharding", None)
            if isinstance(sharding, NamedSharding):
                mesh = sharding.mesh
                break
    return {str(k): int(v) for k, v in mesh.shape.items()} if mesh is not None else {}


def _abstract(value: Any, mesh: Mesh | None) -> jax.ShapeDtypeStruct:
    """The restore target of one leaf: shape, dtype and the sharding it should land in.

    Arrays not on a mesh (e.g. optimizer counters still on one device before the first
    step) are restored replicated on the model's mesh, so every process gets a copy.
    """
    shape, dtype = savable_shape(value), (jnp.uint32 if is_key(value) else value.dtype)
    # (For PRNG keys, key_data adds trailing dims; the key's spec still fits its leading dims.)
    sharding = getattr(value, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        if mesh is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        else:
            sharding = NamedSharding(mesh, P())
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _check_compatible(meta: Mapping[str, Any], flat: Mapping[str, tuple[nnx.Variable, Any]],
                      directory: str, step: int) -> None:
    """Raises UsageError unless every target array can be filled from the checkpoint."""
    where = f"checkpoint {directory!r} step {step}"
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise UsageError(
            f"{where} has format_version={version!r}; this gtp_jax reads version "
            f"{FORMAT_VERSION}. Restore it with the gtp_jax version that wrote it."
        )
    stored = meta["arrays"]
    saved_master = _keeps_master(stored)
    if (any(path.startswith("optimizer/") for path in flat)
            and saved_master != _keeps_master(flat)):
        # Restoring across this setting would read bfloat16 parameters as the model and
        # drop the float32 master (or find none to fill).
        raise UsageError(
            f"{where} was saved {'with' if saved_master else 'without'} float32 master weights "
            f"in the optimizer state (GTPConfig.offload_master_weights={saved_master}), but the "
            f"target optimizer {'keeps none' if saved_master else 'keeps them'}; restore it "
            f"with offload_master_weights={saved_master} ("
            f"{'add' if saved_master else 'drop'} --offload-master-weights).")
    if not any(path.startswith("optimizer/") for path in flat):
        # Restoring a model alone (e.g. for evaluation) skips the saved optimizer state.
        stored = {k: v for k, v in stored.items() if not k.startswith("optimizer/")}
    missing = sorted(set(flat) - set(stored))
    unexpected = sorted(set(stored) - set(flat))
    if missing or unexpected:
        raise UsageError(
            f"{where} does not match the model/optimizer: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''}. Build the same model and optimizer "
            "(model config and optax chain) as the run that saved it."
        )
    for path, (var, value) in flat.items():
        info = array_info(var, value)
        saved = stored[path]
        if saved["dtype"] != info["dtype"]:
            hint = (" (the run saved its float32 master weights in the optimizer state, "
                    "GTPConfig.offload_master_weights: restore the model with them)"
                    if saved_master else "")
            raise UsageError(
                f"{where}: {path} was saved as {saved['dtype']} but the target is "
                f"{info['dtype']}; use the same parameter dtype as the saved run{hint}."
            )
        if list(saved["logical_shape"]) != info["logical_shape"]:
            raise UsageError(
                f"{where}: {path} has logical shape {tuple(saved['logical_shape'])} but the "
                f"target has {tuple(info['logical_shape'])}; the model config differs from "
                "the saved run's."
            )
        if split_layout(saved) != split_layout(info):
            continue  # re-laid out through the logical array (`relayout`)
        old, new, extent = saved["shape"], info["shape"], stored_extent(info)
        if len(old) != len(new) or any(
                a != b and not (info["padded"] and min(a, b) >= n)
                for a, b, n in zip(old, new, extent)):
            raise UsageError(
                f"{where}: {path} is stored as {tuple(old)} and cannot be restored into "
                f"{tuple(new)} (only GTP padding may differ); the model config differs."
            )


def _check_model_alone(model: nnx.Module) -> None:
    """Refuses restoring `model` without its optimizer when an optimizer holds its float32
    master weights (``GTPConfig.offload_master_weights``, parameters already held in a
    narrower dtype): each step sets the parameters from that master, so the restored
    values would be undone by the next step."""
    if offloads_master_weights(model) and any(
            narrower_than_float32(x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.Param))):
        raise UsageError(
            "Checkpointer.restore: this model's float32 master weights live in its "
            "optimizer's state (GTPConfig.offload_master_weights=True) and every step sets "
            "the parameters from them, so a model restored alone would be undone by the next "
            "step; restore it with its optimizer (restore(model, optimizer)).")


def _keeps_master(paths: Any) -> bool:
    """Whether checkpoint array `paths` hold a `gtp_jax.sharding.offload.MasterState`'s
    float32 master weights (its ``master`` field in the optimizer state)."""
    return any(p.startswith("optimizer/") and "/master/" in p for p in paths)


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return tree


def _flatten_nested(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in tree.items():
        path = f"{prefix}/{name}" if prefix else str(name)
        if isinstance(value, Mapping):
            out.update(_flatten_nested(value, path))
        else:
            out[path] = value
    return out


__all__ = ["FORMAT_VERSION", "CheckpointConfig", "CheckpointCorruptError", "CheckpointLockedError",
           "Checkpointer", "DirectoryLock", "NonFiniteStateError", "Restored"]
