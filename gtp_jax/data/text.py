"""A user's own text: which files (`TextData`), their documents, and the tokenizer.

Text files (any name but ``*.jsonl``) are one document each; JSONL files hold one document
per line, the string under `TextData.field`. A folder stands for the ``*.txt``, ``*.text``,
``*.md`` and ``*.jsonl`` files below it (sorted by path; hidden files and folders skipped).
The tokenizer is a Hugging Face ``tokenizers`` folder (``tokenizer.json``, and optionally
``tokenizer_config.json`` / ``special_tokens_map.json`` naming the EOS token), read locally.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from gtp_jax.base.errors import UsageError, UsageTypeError

__all__ = ["TextData", "Tokenizer", "data_files", "documents", "load_tokenizer"]

#: Suffixes a folder is searched for.
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl",)
#: EOS tokens recognised in the vocabulary when no config file names one (GPT-2, Llama 2 /
#: Mistral, Llama 3 base, Gemma and common custom spellings).
KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|eos|>")


@dataclasses.dataclass(frozen=True)
class TextData:
    """Training text and its tokenizer.

    Attributes:
      paths: text or JSONL files, or folders of them (tokens follow this order; a folder's
        files are sorted by path).
      tokenizer: a folder holding a Hugging Face ``tokenizer.json``, or that file (any
        name); the EOS configuration files are read from its folder.
      field: the JSONL key whose string is a document.
      val_paths: held-out files (same forms as `paths`) for the validation loss; empty: the
        last `val_fraction` of the tokens of `paths` is held out instead.
      val_fraction: share of the tokens held out when `val_paths` is empty, in [0, 1); 0
        holds out nothing (no validation loss).
      cache_dir: where token files go when the data's folder is not writable (None:
        ``$XDG_CACHE_HOME/gtp_jax/tokens`` or ``~/.cache/gtp_jax/tokens``).

    Raises:
      UsageError / UsageTypeError: a missing path, a tokenizer folder without
        ``tokenizer.json``, an empty field, a fraction out of range.
    """

    paths: tuple[str, ...]
    tokenizer: str
    field: str = "text"
    val_paths: tuple[str, ...] = ()
    val_fraction: float = 0.05
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("paths", "val_paths"):
            value = getattr(self, name)
            if isinstance(value, (str, os.PathLike)):
                value = (value,)
            if not isinstance(value, (tuple, list)):
                raise UsageTypeError(f"TextData.{name}={value!r} must be a list of paths.")
            object.__setattr__(self, name, tuple(os.fspath(p) for p in value))
        if not self.paths:
            raise UsageError("TextData.paths is empty; pass at least one text or JSONL file "
                             "or a folder of them.")
        for name in ("paths", "val_paths"):
            for path in getattr(self, name):
                if not os.path.exists(path):
                    raise UsageError(f"TextData.{name}: {path!r} does not exist; pass text or "
                                     "JSONL files or a folder of them.")
        object.__setattr__(self, "tokenizer", os.fspath(self.tokenizer))
        if tokenizer_file(self.tokenizer) is None:
            raise UsageError(f"TextData.tokenizer: {self.tokenizer!r} is neither a tokenizer.json "
                             "file nor a folder holding one; pass a Hugging Face tokenizer "
                             "folder (one that tokenizer.save_pretrained wrote) or the file "
                             "Tokenizer.save wrote.")
        if not isinstance(self.field, str) or not self.field:
            raise UsageError(f"TextData.field={self.field!r} must be a non-empty JSONL key, "
                             "e.g. 'text'.")
        if (isinstance(self.val_fraction, bool)
                or not isinstance(self.val_fraction, (int, float))
                or not math.isfinite(self.val_fraction) or not 0 <= self.val_fraction < 1):
            raise UsageError(f"TextData.val_fraction={self.val_fraction!r} must lie in [0, 1), "
                             "e.g. 0.05.")
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))


def data_files(paths: tuple[str, ...], name: str = "TextData.paths") -> list[Path]:
    """The files `paths` stands for, in token order: files as given, folders expanded to
    their text and JSONL files sorted by path (hidden entries skipped).

    Raises:
      UsageError: a folder without such files, or no files at all (named after `name`).
    """
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*")
                if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES
                and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise UsageError(f"{name}: folder {str(path)!r} holds no "
                                 f"{'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files.")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"{name}: {str(path)!r} does not exist; pass text or JSONL files "
                             "or a folder of them.")
    return files


def documents(path: Path, field: str, stream: BinaryIO | None = None) -> Iterator[str]:
    """The documents of one file: the whole text of a text file; the `field` string of each
    non-blank line of a ``.jsonl`` file.

    Args:
      path: the file (its suffix picks the format; it names the file in errors).
      field: the JSONL key of the document text.
      stream: the file's bytes, opened by the caller (e.g. to hash exactly the bytes that
        are read); None: `path` is opened here. Read to its end once the iterator is.

    Raises:
      UsageError: invalid UTF-8, a JSONL line that is not a JSON object with a string under
        `field` (naming the file, line and ``TextData.field``).
    """
    opened = open(path, "rb") if stream is None else stream  # noqa: SIM115
    # Decoded as `open(path, encoding="utf-8")` would (universal newlines).
    text_stream = io.TextIOWrapper(opened, encoding="utf-8")
    try:
        if path.suffix.lower() not in JSONL_SUFFIXES:
            yield _read_text(path, text_stream)
            return
        yield from _jsonl_documents(path, field, text_stream)
    finally:
        text_stream.detach()
        if stream is None:
            opened.close()


def _jsonl_documents(path: Path, field: str, f: io.TextIOWrapper) -> Iterator[str]:
    try:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"TextData.paths: {str(path)!r} line {number} is not JSON "
                                 f"({err.msg}); JSONL files hold one JSON object per "
                                 "line.") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = sorted(record) if isinstance(record, dict) else []
                raise UsageError(f"TextData.field: {str(path)!r} line {number} has no "
                                 f"string field {field!r} (keys: {keys}); pass the key "
                                 "holding the text as TextData.field.")
            yield text
    except UnicodeDecodeError as err:
        raise UsageError(f"TextData.paths: {str(path)!r} is not UTF-8 text ({err.reason} "
                         f"at byte {err.start}).") from None


def _read_text(path: Path, f: io.TextIOWrapper) -> str:
    try:
        return f.read()
    except UnicodeDecodeError as err:
        raise UsageError(f"TextData.paths: {str(path)!r} is not UTF-8 text ({err.reason} at "
                         f"byte {err.start}).") from None


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A loaded Hugging Face tokenizer and what token files need of it.

    Attributes:
      tokenizer: the ``tokenizers.Tokenizer``.
      eos_id: the id joining documents.
      vocab_size: ids are in ``[0, vocab_size)`` (added tokens included).
      digest: sha256 of ``tokenizer.json`` and the EOS choice (part of token-file keys).
    """

    tokenizer: Any
    eos_id: int
    vocab_size: int
    digest: str

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids as the tokenizer encodes it (its post-processor's special tokens
        included, e.g. a BOS), followed by EOS unless the encoding already ends with it."""
        out = []
        for encoding in self.tokenizer.encode_batch(texts):
            ids = list(encoding.ids)
            if not ids or ids[-1] != self.eos_id:
                ids.append(self.eos_id)
            out.append(ids)
        return out


def tokenizer_file(path: str) -> Path | None:
    """The ``tokenizer.json`` that `path` names: the file itself, or the one in the folder;
    None when there is none."""
    given = Path(path)
    found = given if given.is_file() else given / "tokenizer.json"
    return found if found.is_file() else None


def load_tokenizer(directory: str) -> Tokenizer:
    """Reads the tokenizer folder `directory`, or the ``tokenizer.json`` file it names (no
    network).

    The EOS token is the ``eos_token`` of ``tokenizer_config.json`` or
    ``special_tokens_map.json`` when present, else the first of `KNOWN_EOS` in the
    vocabulary.

    Raises:
      UsageError: no ``tokenizer.json``, one the ``tokenizers`` library cannot read, or no
        EOS token (naming ``TextData.tokenizer``).
    """
    from tokenizers import Tokenizer as HFTokenizer  # noqa: PLC0415 (import cost)

    path = tokenizer_file(directory)
    if path is None:
        raise UsageError(f"TextData.tokenizer: {directory!r} is neither a tokenizer.json file "
                         "nor a folder holding one; pass a Hugging Face tokenizer folder or "
                         "its tokenizer.json.")
    raw = path.read_bytes()
    try:
        tokenizer = HFTokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # the library raises plain Exception subclasses
        raise UsageError(f"TextData.tokenizer: {str(path)!r} cannot be read by the tokenizers "
                         f"library ({' '.join(str(err).split())}).") from None
    eos = _configured_eos(path.parent)
    if eos is None:
        eos = next((t for t in KNOWN_EOS if tokenizer.token_to_id(t) is not None), None)
    eos_id = tokenizer.token_to_id(eos) if eos is not None else None
    if eos_id is None:
        named = f"its EOS token {eos!r} is not in the vocabulary" if eos else "it names no EOS"
        raise UsageError(
            f"TextData.tokenizer: {directory!r} has no end-of-sequence token ({named}); "
            "documents are joined with EOS. Add \"eos_token\" to its tokenizer_config.json, "
            f"or a special token such as one of {list(KNOWN_EOS)}.")
    digest = hashlib.sha256(raw + b"\0eos=" + eos.encode()).hexdigest()
    return Tokenizer(tokenizer, int(eos_id), int(tokenizer.get_vocab_size(True)), digest)


def _configured_eos(directory: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = directory / name
        if not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise UsageError(f"TextData.tokenizer: {str(path)!r} is not a JSON object.") \
                from None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            return eos
    return None
