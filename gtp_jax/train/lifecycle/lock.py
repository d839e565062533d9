"""An exclusive lock on a directory (a checkpoint or log directory), so that two runs never
write into one."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from typing import Any

from gtp_jax.base.errors import UsageError

#: The lock file's name inside the directory.
LOCK_FILE = ".gtp_jax.lock"
#: Beside it: the file every run holds an OS file lock on while it looks at the lock file
#: and takes or releases it (removed with the lock file).
GUARD_FILE = ".gtp_jax.lock.guard"


class CheckpointLockedError(UsageError):
    """Another live run holds the directory's lock."""


class DirectoryLock:
    """An exclusive lock on a directory: the file ``<directory>/.gtp_jax.lock`` holding the
    owner's pid and host. A lock left by a process that is no longer alive on this host is
    taken over; a live holder (or one on another host, whose liveness cannot be checked)
    makes `acquire` raise `CheckpointLockedError` naming it.

    Runs take the lock one at a time: each holds an OS lock (``flock``) on
    ``<directory>/.gtp_jax.lock.guard`` while it reads the lock file, checks its holder and
    writes its own, so that of several runs finding the same dead holder exactly one takes
    the lock over (the others then find a live holder). The OS releases that lock when a
    process dies, so it can never be left stale itself; `release` removes the guard file
    with the lock file. Where the file system offers no ``flock``, a free directory is
    still taken atomically (``O_EXCL``), but a dead holder's lock is not taken over: one
    line says to delete it.

    Two runs writing one checkpoint directory would delete each other's in-progress saves
    (orbax removes temporary directories it finds on open) and interleave steps; two runs
    logging to one directory would interleave their records.

    Args:
      directory: the directory (created by `acquire` if needed).
      what: how errors name the directory (e.g. "checkpoint directory").
    """

    def __init__(self, directory: str, what: str = "checkpoint directory"):
        self.path = os.path.join(directory, LOCK_FILE)
        self.what = what
        self.held = False

    def acquire(self) -> None:
        """Takes the lock (creating the directory if needed).

        Raises:
          CheckpointLockedError: a live run (or one on another host) holds it, its lock
            file is unreadable, or a dead holder's lock cannot be taken over safely.
        """
        directory = os.path.dirname(self.path)
        os.makedirs(directory, exist_ok=True)
        waited = False
        for _ in range(3):
            with _guard(os.path.join(directory, GUARD_FILE)) as guarded:
                holder = self._holder()
                exists = holder is not None or os.path.exists(self.path)
                if not exists:
                    if self._create():
                        return
                    continue  # unguarded: another run created it first; look at it again
                if holder is not None:
                    if not lock_is_stale(holder):
                        raise CheckpointLockedError(
                            f"{self.what} {directory!r} is in use by pid {holder.get('pid')} "
                            f"on host {holder.get('host')} (lock file {self.path}); wait for "
                            "that run to end, or delete the lock file if that process is "
                            "gone.")
                    if guarded:
                        self._replace()
                        return
                    raise CheckpointLockedError(
                        f"{self.what} {directory!r}: its lock file {self.path} names pid "
                        f"{holder.get('pid')}, which is gone, but this file system offers no "
                        "file locking to take it over safely; if no run uses this directory, "
                        "delete the lock file.")
            # Empty or garbled: a run (of an older version) may be between creating and
            # writing it. Taking it over could let two runs share the directory; a moment
            # later it is complete, or it was left by a crash and the user says so.
            if not waited:
                waited = True
                time.sleep(_UNREADABLE_WAIT_S)
                continue
            raise CheckpointLockedError(
                f"{self.what} {directory!r}: its lock file {self.path} is unreadable (empty "
                "or not JSON), so another run may be starting in it; if no run uses this "
                "directory, delete the lock file.")
        raise CheckpointLockedError(f"could not take the lock {self.path}; another run races "
                                    "for it.")

    def release(self) -> None:
        """Removes the lock file (and its guard file) if this process holds it."""
        if self.held:
            guard = os.path.join(os.path.dirname(self.path), GUARD_FILE)
            with _guard(guard):
                holder = self._holder()
                if holder is not None and holder.get("pid") == os.getpid():
                    os.remove(self.path)
                    # Still under its flock: a run waiting on this file finds it gone once
                    # it gets the flock, and opens the path again (`_guard`).
                    os.remove(guard)
            self.held = False

    def _record(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "time": time.time()}).encode()

    def _create(self) -> bool:
        """Creates the lock file with this process as holder, unless it exists."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(self._record())
        self.held = True
        return True

    def _replace(self) -> None:
        """Replaces a dead holder's lock file with one naming this process, in one rename
        (the lock file never goes missing, so no run finds the directory free)."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(self._record())
        os.replace(tmp, self.path)
        self.held = True

    def _holder(self) -> dict[str, Any] | None:
        try:
            with open(self.path) as f:
                holder = json.load(f)
            return holder if isinstance(holder, dict) else None
        except (OSError, ValueError):
            return None


#: Seconds an unreadable lock file is given to become readable (a run of an older version
#: wrote it right after creating it) before it is reported.
_UNREADABLE_WAIT_S = 0.5
#: Seconds to wait for another run's look at the lock file (milliseconds, normally).
_GUARD_TIMEOUT_S = 30.0


@contextlib.contextmanager
def _guard(path: str) -> Iterator[bool]:
    """Holds an exclusive ``flock`` on `path` (created if missing); yields whether it is
    held (False where the file system has no file locking)."""
    import fcntl  # noqa: PLC0415 (POSIX only)

    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            held = _flock(fd, path)
            if held and not _is_path(fd, path):
                # Removed (a release) while this run waited: the flock is on a file no other
                # run can open any more; lock the one at the path now.
                fcntl.flock(fd, fcntl.LOCK_UN)
                continue
            try:
                yield held
            finally:
                if held:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            return
        finally:
            os.close(fd)


def _is_path(fd: int, path: str) -> bool:
    """Whether the open file `fd` is (still) the file at `path`."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)


def _flock(fd: int, path: str) -> bool:
    """Takes an exclusive ``flock`` on `fd`, waiting up to `_GUARD_TIMEOUT_S`; False where
    the file system offers none."""
    import fcntl  # noqa: PLC0415 (POSIX only)

    deadline = time.monotonic() + _GUARD_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise CheckpointLockedError(
                    f"another run has held {path} for {_GUARD_TIMEOUT_S:.0f} s while taking "
                    "this directory's lock; if no run is starting there, try again.") from None
            time.sleep(0.01)
        except OSError as err:
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return False
            raise


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
