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
  config, parameter set, dtype) is a ValueError raised before anything is modified.

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
Only the `CheckpointConfig.keep` newest finalized steps are kept.

orbax is imported lazily (when a `Checkpointer` is created), so training without
checkpoints does not need it installed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gtp_jax.base.metadata import LOGICAL_SHAPE, SPLIT_LAYOUT

#: Bumped when the layout below changes incompatibly.
FORMAT_VERSION = 1

#: Array items: one per saved object, so that a model can be restored without its optimizer.
_ARRAY_ITEMS = ("model", "optimizer")
_META_ITEM = "meta"


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
      resume: continue from the newest checkpoint in `directory` (which must exist and hold
        one); without it, `directory` must not hold checkpoints yet.
      async_save: write in a background thread after copying the arrays to host memory, so
        training continues during the write (orbax async checkpointing).
    """

    directory: str
    every: int = 0
    keep: int = 3
    resume: bool = False
    async_save: bool = True

    def __post_init__(self) -> None:
        directory = os.fspath(self.directory) if self.directory is not None else ""
        if not isinstance(directory, str) or not directory:
            raise ValueError(
                f"CheckpointConfig.directory={self.directory!r} must be a non-empty path; "
                "pass --checkpoint-dir DIR."
            )
        if "://" not in directory:  # keep gs:// and other URLs as given
            directory = os.path.abspath(directory)
        object.__setattr__(self, "directory", directory)
        for name, minimum in (("every", 0), ("keep", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(
                    f"CheckpointConfig.{name}={value!r} must be an int >= {minimum} "
                    f"(--checkpoint-{name})."
                )
        if self.resume and "://" not in directory and not os.path.isdir(directory):
            raise ValueError(
                f"--resume: checkpoint directory {directory!r} does not exist; pass the "
                "--checkpoint-dir of an earlier run, or drop --resume to start a new run."
            )


class Checkpointer:
    """Saves and restores (model, optimizer) state with orbax; see the module docstring.

    Every process of a multi-process run must create it and call `save` / `restore` with
    the same arguments (orbax synchronizes the processes inside these calls).

    Args:
      config: a `CheckpointConfig`.

    Raises:
      ImportError: orbax-checkpoint is not installed (``pip install orbax-checkpoint``).
    """

    def __init__(self, config: CheckpointConfig):
        if not isinstance(config, CheckpointConfig):
            raise TypeError(
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
            create=True,
            enable_async_checkpointing=config.async_save,
            # Leftovers of a save that died before finalization are deleted on open.
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            config.directory, options=options, item_names=(*_ARRAY_ITEMS, _META_ITEM))

    # ------------------------------------------------------------------ queries

    def all_steps(self) -> list[int]:
        """Steps of the finalized checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest finalized step, or None if the directory holds none."""
        return self._manager.latest_step()

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata of `step` (default: the newest), without reading any array.

        Raises:
          ValueError: there is no such checkpoint.
        """
        step = self._checked_step(step)
        restored = self._manager.restore(
            step, args=self._ocp.args.Composite(**{_META_ITEM: self._ocp.args.JsonRestore()}))
        return dict(restored[_META_ITEM])

    # ------------------------------------------------------------------ save / restore

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer | None = None, *,
             extra: Mapping[str, Any] | None = None) -> None:
        """Writes the arrays of `model` (and `optimizer`) as checkpoint `step`.

        Each process writes the shards of its own devices. With `CheckpointConfig.async_save`
        this returns once the arrays are copied to host memory; the write finishes in the
        background (`wait` / `close` block until it is finalized).

        Args:
          step: optimizer step the state belongs to (>= 0); the directory's step name.
          model: usually a `gtp_jax.ShardedModule`; every variable is saved.
          optimizer: an ``nnx.Optimizer`` of `model`, or None.
          extra: JSON-serializable data stored with the checkpoint (e.g. configs and the
            data-loader position), returned by `restore` / `read_meta` under ``"extra"``.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"Checkpointer.save: step={step!r} must be an int >= 0.")
        flat = _flat_arrays(model, optimizer)
        tree = _nest({path: _savable(value) for path, (_, value) in flat.items()})
        meta = {
            "format_version": FORMAT_VERSION,
            "step": int(step),
            "mesh": _mesh_of(model, flat),
            "process_count": jax.process_count(),
            "arrays": {path: _array_info(var, value) for path, (var, value) in flat.items()},
            "extra": dict(extra or {}),
        }
        ocp = self._ocp
        self._manager.save(int(step), args=ocp.args.Composite(
            **{name: ocp.args.StandardSave(sub) for name, sub in tree.items()},
            **{_META_ITEM: ocp.args.JsonSave(meta)}))

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer | None = None,
                step: int | None = None) -> dict[str, Any]:
        """Loads checkpoint `step` (default: newest) into `model` and `optimizer` in place.

        `model` / `optimizer` may live on a different mesh than the one that saved (see the
        module docstring); their current arrays define the target shapes and shardings.
        Everything is validated against the checkpoint's metadata before any array is read
        or any variable changed.

        Returns:
          The checkpoint's metadata (``"step"``, ``"extra"``, ``"mesh"``, ``"arrays"``).

        Raises:
          ValueError: no such step, or the checkpoint does not match `model` / `optimizer`
            (missing or extra variables, other logical shapes or dtypes).
        """
        step = self._checked_step(step)
        meta = self.read_meta(step)
        flat = _flat_arrays(model, optimizer)
        _check_compatible(meta, flat, self.config.directory, step)
        stored = meta["arrays"]
        mesh = _mesh_of_model(model)
        replicated = NamedSharding(mesh, P()) if mesh is not None else None
        target, relayout = {}, set()
        for path, (var, value) in flat.items():
            if _layout(stored[path]) == _layout(_array_info(var, value)):
                target[path] = _abstract(value, mesh)
            else:
                # Another tp/ep split: read the saved layout whole on every device (one array
                # at a time), then permute it into the target layout on device.
                relayout.add(path)
                target[path] = jax.ShapeDtypeStruct(tuple(stored[path]["shape"]),
                                                    _numpy_dtype(stored[path]["dtype"]),
                                                    sharding=replicated)
        ocp = self._ocp
        tree = _nest(target)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            # strict=False: padded dims may be restored into another padded size (re-padding).
            name: ocp.args.StandardRestore(sub, strict=False) for name, sub in tree.items()}))
        values = _flatten_nested({name: restored[name] for name in tree})
        for obj, prefix in ((model, "model"), (optimizer, "optimizer")):
            if obj is None:
                continue
            new_vars = []
            for path, var in nnx.to_flat_state(nnx.state(obj)):
                key = _join((prefix, *path))
                old = flat[key][1]
                new, info = values[key], _array_info(var, old)
                if key in relayout:
                    new = _relayout(new, stored[key], info, old.sharding)
                elif tuple(stored[key]["shape"]) != tuple(old.shape):
                    new = _zero_padding(new, info)
                new_vars.append((path, var.replace(value=_unsavable(new, old))))
            nnx.update(obj, nnx.from_flat_state(new_vars))
        return meta

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
        stored = self.read_meta(step)["arrays"]
        target = {path: np.empty(info["shape"], _numpy_dtype(info["dtype"]))
                  for path, info in stored.items()}
        ocp = self._ocp
        tree = _nest(target)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            name: ocp.args.StandardRestore(sub) for name, sub in tree.items()}))
        values = _flatten_nested({name: restored[name] for name in tree})
        return {path: np.asarray(_to_logical(np.asarray(values[path]), info))
                for path, info in stored.items()}

    def wait(self) -> None:
        """Blocks until every started save is finalized (renamed into place)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _checked_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise ValueError(
                    f"checkpoint directory {self.config.directory!r} holds no finalized "
                    "checkpoint; pass the --checkpoint-dir of an earlier run, or drop --resume."
                )
            return steps[-1]
        if step not in steps:
            raise ValueError(
                f"checkpoint step {step} is not in {self.config.directory!r} (steps: {steps}); "
                "pick one of those."
            )
        return int(step)


# ---------------------------------------------------------------------- helpers


def _join(path: Any) -> str:
    return "/".join(str(p) for p in path)


def _flat_arrays(model: nnx.Module,
                 optimizer: nnx.Optimizer | None) -> dict[str, tuple[nnx.Variable, Any]]:
    """``{"model/<path>": (variable, value), "optimizer/<path>": ...}`` for array leaves."""
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}.")
    out: dict[str, tuple[nnx.Variable, Any]] = {}
    for obj, prefix in ((model, "model"), (optimizer, "optimizer")):
        if obj is None:
            continue
        for path, var in nnx.to_flat_state(nnx.state(obj)):
            value = var.get_value()
            if not hasattr(value, "shape") or not hasattr(value, "dtype"):
                raise TypeError(
                    f"{prefix}/{_join(path)} holds a {type(value).__name__}, not an array; "
                    "only array state can be checkpointed."
                )
            out[_join((prefix, *path))] = (var, value)
    return out


def _is_key(value: Any) -> bool:
    return jnp.issubdtype(value.dtype, jax.dtypes.prng_key)


def _savable(value: Any) -> Any:
    # Typed PRNG keys are stored as their raw uint32 data (orbax stores numeric arrays).
    return jax.random.key_data(value) if _is_key(value) else value


def _unsavable(value: Any, like: Any) -> Any:
    if _is_key(like):
        return jax.random.wrap_key_data(value, impl=jax.random.key_impl(like))
    return value


def _array_info(var: nnx.Variable, value: Any) -> dict[str, Any]:
    """Stored shape, logical shape, dtype and tp/ep split layout of one array (JSON-ready).

    ``split_layout`` lists ``[axis, axis_size, dim, parts]`` per model-parallel split
    (`gtp_jax.sharding.module.SPLIT_LAYOUT`), empty for a weight that is only GTP-padded.
    """
    shape = tuple(int(d) for d in _savable_shape(value))
    meta = var.get_metadata()
    logical = meta.get(LOGICAL_SHAPE)
    layout = meta.get(SPLIT_LAYOUT) or ()
    return {
        "shape": list(shape),
        "logical_shape": list(logical) if logical is not None else list(shape),
        "padded": logical is not None,
        "split_layout": [[str(a), int(n), int(d), int(k)] for a, n, d, k in layout],
        "dtype": str(jax.random.key_impl(value)) if _is_key(value) else str(np.dtype(value.dtype)),
    }


def _layout(info: Mapping[str, Any]) -> tuple[tuple[str, int, int, int], ...]:
    return tuple(tuple(s) for s in info.get("split_layout", ()))


def _splits(info: Mapping[str, Any]) -> list[tuple[Any, int]]:
    """(DimSplit, array dim) of each tp/ep split of an array, in `to_stored` order."""
    if not _layout(info):
        return []
    from gtp_jax.sharding.plan import DimSplit  # noqa: PLC0415

    logical = info["logical_shape"]
    return [(DimSplit(axis=a, axis_size=n, dim=d, size=int(logical[d]), parts=k), d)
            for a, n, d, k in _layout(info)]


def _extent(info: Mapping[str, Any]) -> tuple[int, ...]:
    """Shape of the array in its split layout before GTP padding: the logical shape, except
    that a tp/ep-split dim holds its padded, interleaved parts."""
    extent = [int(n) for n in info["logical_shape"]]
    for split, dim in _splits(info):
        extent[dim] = split.stored_size
    return tuple(extent)


def _to_logical(x: Any, info: Mapping[str, Any]) -> Any:
    """A stored array (saved layout) -> its logical array: GTP padding dropped, tp/ep
    splits undone (`DimSplit.from_stored`)."""
    x = x[tuple(slice(0, n) for n in _extent(info))]
    for split, dim in reversed(_splits(info)):
        x = split.from_stored(x, dim)
    return x


def _from_logical(x: Any, info: Mapping[str, Any]) -> Any:
    """Logical array -> stored layout of `info`: tp/ep splits, then GTP zero padding."""
    for split, dim in _splits(info):
        x = split.to_stored(x, dim)
    widths = [(0, int(s) - int(e)) for s, e in zip(info["shape"], x.shape)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x


def _numpy_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(jnp.dtype(name))
    except TypeError:  # a PRNG key implementation name: stored as uint32 key data
        return np.dtype(np.uint32)


def _savable_shape(value: Any) -> tuple[int, ...]:
    return tuple(jax.random.key_data(value).shape) if _is_key(value) else tuple(value.shape)


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
    shape, dtype = _savable_shape(value), (jnp.uint32 if _is_key(value) else value.dtype)
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
    """Raises ValueError unless every target array can be filled from the checkpoint."""
    where = f"checkpoint {directory!r} step {step}"
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{where} has format_version={version!r}; this gtp_jax reads version "
            f"{FORMAT_VERSION}. Restore it with the gtp_jax version that wrote it."
        )
    stored = meta["arrays"]
    if not any(path.startswith("optimizer/") for path in flat):
        # Restoring a model alone (e.g. for evaluation) skips the saved optimizer state.
        stored = {k: v for k, v in stored.items() if not k.startswith("optimizer/")}
    missing = sorted(set(flat) - set(stored))
    unexpected = sorted(set(stored) - set(flat))
    if missing or unexpected:
        raise ValueError(
            f"{where} does not match the model/optimizer: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''}. Build the same model and optimizer "
            "(model config and optax chain) as the run that saved it."
        )
    for path, (var, value) in flat.items():
        info = _array_info(var, value)
        saved = stored[path]
        if saved["dtype"] != info["dtype"]:
            raise ValueError(
                f"{where}: {path} was saved as {saved['dtype']} but the target is "
                f"{info['dtype']}; use the same parameter dtype as the saved run."
            )
        if list(saved["logical_shape"]) != info["logical_shape"]:
            raise ValueError(
                f"{where}: {path} has logical shape {tuple(saved['logical_shape'])} but the "
                f"target has {tuple(info['logical_shape'])}; the model config differs from "
                "the saved run's."
            )
        if _layout(saved) != _layout(info):
            continue  # re-laid out through the logical array (`_relayout`)
        old, new, extent = saved["shape"], info["shape"], _extent(info)
        if len(old) != len(new) or any(
                a != b and not (info["padded"] and min(a, b) >= n)
                for a, b, n in zip(old, new, extent)):
            raise ValueError(
                f"{where}: {path} is stored as {tuple(old)} and cannot be restored into "
                f"{tuple(new)} (only GTP padding may differ); the model config differs."
            )


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


def _zero_padding(value: jax.Array, info: Mapping[str, Any]) -> jax.Array:
    """Zeroes every element past the unpadded extent (a purely local, elementwise op)."""
    if not info["padded"]:
        return value
    return _jit_mask(tuple(value.shape), _extent(info), value.sharding)(value)


@functools.cache
def _jit_mask(shape: tuple[int, ...], extent: tuple[int, ...], sharding: Any):
    def mask(x: jax.Array) -> jax.Array:
        keep = jnp.ones(shape, dtype=bool)
        for dim, (size, n) in enumerate(zip(shape, extent)):
            if size != n:
                keep &= jax.lax.broadcasted_iota(jnp.int32, shape, dim) < n
        return jnp.where(keep, x, jnp.zeros((), x.dtype))

    return jax.jit(mask, out_shardings=sharding)


def _relayout(value: jax.Array, saved: Mapping[str, Any], target: Mapping[str, Any],
              sharding: Any) -> jax.Array:
    """A replicated array in the `saved` layout -> the `target` layout and sharding."""
    freeze = lambda info: json.dumps(info, sort_keys=True)  # hashable cache key
    return _jit_relayout(freeze(saved), freeze(target), sharding)(value)


@functools.cache
def _jit_relayout(saved: str, target: str, sharding: Any):
    saved_info, target_info = json.loads(saved), json.loads(target)
    return jax.jit(lambda x: _from_logical(_to_logical(x, saved_info), target_info),
                   out_shardings=sharding)


__all__ = ["FORMAT_VERSION", "CheckpointConfig", "Checkpointer"]
