"""Which folders of a checkpoint directory are checkpoints.

orbax counts every folder named by a step number (``<directory>/100``) as a checkpoint. A
folder of the user's with such a name (notes, an evaluation's output) would then be read,
renamed aside as a damaged checkpoint, or deleted when `CheckpointConfig.keep` rotates old
checkpoints out. `OwnStepFolders` is the orbax step-name format the `Checkpointer` uses: it
lists only the step folders that hold something a save writes (`CHECKPOINT_ENTRIES`), so
orbax never reads, renames or deletes any other folder; `foreign_step_folders` names those
others so that a run can say once that it leaves them alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

#: What a save writes into a step folder (orbax's step metadata, its commit marker on
#: object stores, and the checkpoint's items): a folder holding none of these is not one.
CHECKPOINT_ENTRIES = ("_CHECKPOINT_METADATA", "commit_success.txt", "model", "optimizer",
                      "meta")


def holds_a_checkpoint(path: Any) -> bool:
    """Whether the step folder `path` (a local path or an ``epath.Path``) holds any entry a
    save writes, intact or not: a damaged checkpoint is still one (it is reported and kept
    aside, not ignored)."""
    if isinstance(path, (str, os.PathLike)) and "://" not in os.fspath(path):
        return any(os.path.lexists(os.path.join(path, name)) for name in CHECKPOINT_ENTRIES)
    return any((path / name).exists() for name in CHECKPOINT_ENTRIES)


def foreign_step_folders(directory: str) -> list[str]:
    """The folders of local `directory` named by a step number that hold no checkpoint,
    sorted by step (object stores: none are looked for)."""
    if "://" in directory or not os.path.isdir(directory):
        return []
    names = [n for n in os.listdir(directory) if n.isdigit()
             and os.path.isdir(os.path.join(directory, n))]
    return [os.path.join(directory, n) for n in sorted(names, key=int)
            if not holds_a_checkpoint(os.path.join(directory, n))]


class OwnStepFolders:
    """An orbax ``NameFormat`` (``CheckpointManagerOptions.step_name_format``): orbax's
    standard step names, listing only the step folders that `holds_a_checkpoint`."""

    def __init__(self, standard: Any):
        self._standard = standard

    def build_name(self, step: int) -> str:
        return self._standard.build_name(step)

    def find_all(self, base_path: Any) -> Iterator[Any]:
        return (m for m in self._standard.find_all(base_path) if holds_a_checkpoint(m.path))

    def find_step(self, base_path: Any, step: int) -> Any:
        found = self._standard.find_step(base_path, step)
        if not holds_a_checkpoint(found.path):
            raise ValueError(f"{found.path} is not a checkpoint (it holds none of "
                             f"{', '.join(CHECKPOINT_ENTRIES)})")
        return found

    def __getattr__(self, name: str) -> Any:  # e.g. single_host_load_and_broadcast
        if name.startswith("__") or name == "_standard":
            raise AttributeError(name)
        return getattr(self._standard, name)
