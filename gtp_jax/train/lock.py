"""An exclusive lock on a checkpoint directory, so that two runs never write into one."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from gtp_jax.base.errors import UsageError

#: The lock file's name inside the checkpoint directory.
LOCK_FILE = ".gtp_jax.lock"


class CheckpointLockedError(UsageError):
    """Another live run holds the checkpoint directory's lock."""


class DirectoryLock:
    """An exclusive lock on a checkpoint directory: the file ``<directory>/.gtp_jax.lock``
    holding the owner's pid and host, created with ``O_EXCL`` (atomic on POSIX file
    systems). A lock left by a process that is no longer alive on this host is taken over;
    a live holder (or one on another host, whose liveness cannot be checked) makes
    `acquire` raise `CheckpointLockedError` naming it.

    Two runs writing one directory would delete each other's in-progress saves (orbax
    removes temporary directories it finds on open) and interleave steps.
    """

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_FILE)
        self.held = False

    def acquire(self) -> None:
        """Takes the lock (creating the directory if needed)."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None and os.path.exists(self.path):
                    # Empty or garbled: a run may be between creating and writing it. Taking
                    # it over would let two runs share the directory; a moment later it is
                    # complete, or it was left by a crash and the user says so.
                    time.sleep(_UNREADABLE_WAIT_S)
                    holder = self._holder()
                    if holder is None and os.path.exists(self.path):
                        raise CheckpointLockedError(
                            f"checkpoint directory {os.path.dirname(self.path)!r}: its lock file "
                            f"{self.path} is unreadable (empty or not JSON), so another run may "
                            "be starting in it; if no run uses this directory, delete the lock "
                            "file.") from None
                if holder is not None and not lock_is_stale(holder):
                    raise CheckpointLockedError(
                        f"checkpoint directory {os.path.dirname(self.path)!r} is in use by pid "
                        f"{holder.get('pid')} on host {holder.get('host')} (lock file "
                        f"{self.path}); wait for that run to end, or delete the lock file if "
                        "that process is gone."
                    ) from None
                # Stale (dead pid on this host) or just removed: remove and retry atomically.
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise CheckpointLockedError(f"could not take the lock {self.path}; another run races "
                                    "for it.")

    def release(self) -> None:
        """Removes the lock file if this process holds it."""
        if self.held:
            holder = self._holder()
            if holder is not None and holder.get("pid") == os.getpid():
                os.remove(self.path)
            self.held = False

    def _holder(self) -> dict[str, Any] | None:
        try:
            with open(self.path) as f:
                holder = json.load(f)
            return holder if isinstance(holder, dict) else None
        except (OSError, ValueError):
            return None


#: Seconds an unreadable lock file is given to become readable (a run writes it right after
#: creating it) before it is reported.
_UNREADABLE_WAIT_S = 0.5


def lock_is_stale(holder: Mapping[str, Any]) -> bool:
    """Whether a lock's holder is a process that no longer runs on this host."""
    if holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    if pid == os.getpid():
        return False  # this process: a lock it holds itself is never stale
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by another user
        return False
    return False
