"""The library's own error types.

A `UsageError` is a caller's mistake that the library detected before doing any work (a bad
argument, a checkpoint that does not fit, a directory that cannot be written). The command
line prints it as one line and exits with status 2; any other exception is a bug and keeps
its traceback.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A bad value supplied by the caller; the message names the argument and the fix."""


class UsageTypeError(UsageError, TypeError):
    """A caller's argument of the wrong type (also a `TypeError`)."""


__all__ = ["UsageError", "UsageTypeError"]
