"""Job files: ``python -m gtp_jax train --config job.toml`` reads flags from a TOML file.

Every key is a flag of ``train`` spelled as on the command line without its leading dashes
(``grad-accum = 4``, ``lr-schedule = "wsd"``, ``checkpoint-dir = "runs/a"``); only that
spelling is accepted, so a file reads like the command it replaces. Values: a boolean for
an on/off flag (``overlap = true``; ``unroll-layers = false`` for ``--no-unroll-layers``),
a list of strings for a flag taking several values (``data = ["a.txt", "b.txt"]``), else
a string or number; a flag whose value is optional takes ``true`` for the bare flag
(``resume = true`` is ``--resume``, ``resume = "auto"`` is ``--resume auto``). Flags given on
the command line override the file's: the file's flags are placed before them, and argparse
keeps the last value of a flag.

A relative path in the file (a value of a flag whose ``type`` is a `PathArg`:
``checkpoint-dir``, ``data``, ``log-dir``, ...) is relative to the file's folder, not to the
folder the command runs in: a job requeued from elsewhere finds its checkpoints, data and
logs again. Paths given on the command line stay relative to the working folder.

Python 3.11's ``tomllib`` reads the file; on Python 3.10 the ``tomli`` package (a
dependency there) does.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Any

from gtp_jax.base.errors import UsageError
from gtp_jax.base.paths import local_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: Keys a job file may not set: they are about the command line itself.
_NOT_IN_FILE = ("config", "help")


class PathArg:
    """The argparse ``type`` of a flag whose value is a path.

    It marks the flag for job files (a relative value is resolved against the file's folder,
    `file_flags`) and reads ``file://`` URLs as the local paths they name; other URLs are
    refused in one line, except, with `urls`, the object stores checkpoints may live in
    (`gtp_jax.base.paths.local_path`).

    Args:
      words: values that are not paths (``"off"`` for ``--compile-cache``), left as given.
      urls: accept `gtp_jax.base.paths.STORAGE_SCHEMES` URLs (checkpoint directories).
    """

    def __init__(self, *words: str, urls: bool = False):
        self.words = frozenset(words)
        self.urls = urls
        self.__name__ = "path"  # argparse names the type in its messages

    def __call__(self, text: str) -> str:
        if text in self.words or "://" not in text:
            return text
        return local_path(text, storage=self.urls, error=argparse.ArgumentTypeError)


def expand_job_file(parser: argparse.ArgumentParser, argv: list[str],
                    command: str = "train") -> list[str]:
    """`argv` with ``--config PATH`` replaced by the flags of the job file at PATH, placed
    right after the `command` word so that the command line's own flags override them.

    Args:
      parser: the top-level parser with a `command` subparser.
      argv: the command line (without the program name).
      command: the subcommand whose flags the file sets.

    Returns:
      `argv` unchanged when it has no ``--config`` (or is not `command`).

    Raises:
      UsageError: the file is missing, not UTF-8 or not valid TOML, or a key is not a
        flag (naming the closest flag), or a value has the wrong type for its flag.
    """
    if not argv or argv[0] != command:
        return argv
    path, rest = _take_config(argv[1:])
    if path is None:
        return argv
    sub = _subparser(parser, command)
    return [command, *file_flags(sub, path), *rest]


def file_flags(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The command-line tokens of the job file at `path` for `parser` (see the module
    docstring); UsageError naming the file and key for a bad one."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as err:
        raise UsageError(f"--config {path!r}: cannot read it ({err.strerror}).") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"--config {path!r} is not UTF-8 text (byte {err.object[err.start]:#04x} "
                         f"at offset {err.start}); save the job file as UTF-8.") from None
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"--config {path!r} is not valid TOML: {err}.") from None
    actions = {opt[2:]: action for action in parser._actions  # noqa: SLF001
               for opt in action.option_strings if opt.startswith("--")
               and not opt.startswith("--no-")}
    valid = sorted(k for k in actions if k not in _NOT_IN_FILE)
    folder = os.path.dirname(os.path.abspath(path))
    tokens: list[str] = []
    for key, value in table.items():
        if key not in valid:
            near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f"; did you mean {near[0]!r}?" if near else \
                " (keys are the train flags without their dashes, e.g. 'grad-accum')."
            raise UsageError(f"--config {path!r}: unknown key {key!r}{hint}")
        action = actions[key]
        if isinstance(action.type, PathArg):
            value = _resolved(value, folder, action.type)
        tokens += _tokens(action, key, value, path)
    return tokens


def _resolved(value: Any, folder: str, kind: PathArg) -> Any:
    """`value` (a path or a list of them; other types are left for `_tokens` to refuse)
    with relative paths joined to `folder`."""
    if isinstance(value, list):
        return [_resolved(v, folder, kind) for v in value]
    if not isinstance(value, str) or value in kind.words or "://" in value or not value:
        return value
    return os.path.join(folder, os.path.expanduser(value))


def _tokens(action: argparse.Action, key: str, value: Any, path: str) -> list[str]:
    flag = f"--{key}"
    where = f"--config {path!r}: key {key!r}"
    if isinstance(value, dict):
        raise UsageError(f"{where} is a table; job files are flat: put {key}'s flag value at "
                         "the top level.")
    if isinstance(action, argparse.BooleanOptionalAction):
        _need(isinstance(value, bool), where, "true or false")
        return [flag] if value else [f"--no-{key}"]
    if isinstance(action, (argparse._StoreTrueAction,  # noqa: SLF001
                           argparse._StoreFalseAction)):  # noqa: SLF001
        _need(isinstance(value, bool), where, "true or false")
        on = isinstance(action, argparse._StoreTrueAction)  # noqa: SLF001
        return [flag] if value == on else []
    if action.nargs in ("+", "*"):
        items = [value] if isinstance(value, str) else value
        _need(isinstance(items, list) and bool(items)
              and all(isinstance(v, str) for v in items), where,
              'a string or a list of strings, e.g. ["a.txt", "b.txt"]')
        return [flag, *items]
    if action.nargs == "?" and isinstance(value, bool):  # the bare flag, or nothing
        return [flag] if value else []
    _need(isinstance(value, (str, int, float)) and not isinstance(value, bool), where,
          "a string or a number")
    return [f"{flag}={value}"]


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise UsageError(f"{where} must be {what}.")


def _take_config(args: list[str]) -> tuple[str | None, list[str]]:
    """(the ``--config`` path, the other arguments)."""
    path, rest, i = None, [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--config":
            if i + 1 >= len(args):
                raise UsageError("--config needs a path: --config job.toml.")
            path, i = args[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return action.choices[command]
    raise UsageError(f"the parser has no {command!r} command.")
