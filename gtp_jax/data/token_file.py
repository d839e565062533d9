"""Tokenize text once into a memory-mapped token file, reused while data and tokenizer stay
the same.

The file is keyed by `fingerprint`: a hash of the data files' contents (in order), the
tokenizer and the JSONL field. It is written beside the data, in a ``.gtp_jax_tokens``
folder of the first path's folder, or, where that is not writable, in the cache folder. A
changed file, tokenizer or field gives another key, hence a fresh tokenization; a file is
published (renamed into place) only once complete, so an interrupted run leaves no
half-written token file behind.

The bytes tokenized are hashed as they are read, and the file is published only if that
hash is its key: a data file that changes between the key and the tokenization, or while it
is read, stops the run (`UsageError`) instead of storing other text under the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from gtp_jax.base.errors import UsageError
from gtp_jax.data.text import Tokenizer, documents

__all__ = ["TokenFile", "default_cache_dir", "fingerprint", "token_file"]

#: Folder created beside the data for its token files.
CACHE_NAME = ".gtp_jax_tokens"
#: Part of every key (so keys, and the data fingerprints checkpoints record, stay stable).
_FORMAT = "gtp_jax tokens 1"
#: The token file's own format. Version 1 files were written without checking the bytes
#: tokenized against the key, so a file rewritten while it was read may have stored other
#: text under it: they are not trusted, and are tokenized again.
_FILE_FORMAT = "gtp_jax tokens 2"
#: Characters of text handed to the tokenizer per batch (bounds memory on large JSONL).
_BATCH_CHARS = 1 << 22

Progress = Callable[[int, int], None]
#: Called while tokenizing; raises to stop it (e.g. on a stop request).
Interrupt = Callable[[], None]
#: Seconds between an interruptible tokenization's checks.
_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """A token file: every document's ids followed by EOS, concatenated.

    Attributes:
      path: the ``<fingerprint>.tokens`` file (raw little-endian ``dtype``).
      tokens: ``uint16[N]`` (vocabularies up to 65536) or ``uint32[N]``, a read-only
        ``np.memmap`` of `path`.
      fingerprint: the key (data contents, tokenizer and field).
      vocab_size, eos_id: the tokenizer's.
      documents: number of documents.
      built: True when this call tokenized (False: an existing file was reused).
    """

    path: str
    tokens: np.ndarray
    fingerprint: str
    vocab_size: int
    eos_id: int
    documents: int
    built: bool


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/gtp_jax/tokens`` (``~/.cache`` when unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "gtp_jax" / "tokens"


def fingerprint(files: list[Path], tokenizer: Tokenizer, field: str) -> str:
    """32 hex digits keying the tokens of `files` (their contents, in order) under
    `tokenizer` and the JSONL `field`; reads every file once."""
    h = _key_hash(tokenizer, field)
    for path in files:
        h.update(_file_header(path, path.stat().st_size))
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:32]


def _key_hash(tokenizer: Tokenizer, field: str) -> Any:
    h = hashlib.sha256()
    h.update(f"{_FORMAT}\0{tokenizer.digest}\0{field}\0".encode())
    return h


def _file_header(path: Path, size: int) -> bytes:
    return f"{path.suffix.lower()}\0{size}\0".encode()


class _HashedReader(io.RawIOBase):
    """A binary file whose bytes are added to `digest` as they are read, in order."""

    def __init__(self, raw: BinaryIO, digest: Any):
        self._raw, self._digest, self.count = raw, digest, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._raw.readinto(buffer)
        if n:
            self._digest.update(memoryview(buffer)[:n])
            self.count += n
        return n

    def drain(self) -> None:
        """Hashes what is left to read (a decoder that stopped early leaves nothing, but
        the key covers every byte)."""
        for chunk in iter(lambda: self._raw.read(1 << 20), b""):
            self._digest.update(chunk)
            self.count += len(chunk)


def token_file(files: list[Path], tokenizer: Tokenizer, *, field: str = "text",
               home: Path | None = None, cache_dir: str | Path | None = None,
               key: str | None = None, progress: Progress | None = None,
               interrupt: Interrupt | None = None) -> TokenFile:
    """The token file of `files`: reused when one with their fingerprint exists, else
    tokenized now (``progress(bytes_done, bytes_total)`` is called as it goes).

    Args:
      files: text / JSONL files (`gtp_jax.data.text.data_files`), in token order.
      tokenizer: `gtp_jax.data.text.load_tokenizer` output.
      field: the JSONL key of the document text.
      home: the folder beside which to keep the file (None: the first file's folder).
      cache_dir: where to look and write when `home` is not writable (None:
        `default_cache_dir`).
      key: `fingerprint(files, tokenizer, field)` when the caller has it already.
      interrupt: called every `_POLL_S` seconds while tokenizing, also in the middle of one
        large document; what it raises ends the tokenization (nothing is published).

    Raises:
      UsageError: the files hold no document, a document a JSONL line lacks, invalid UTF-8,
        or neither folder is writable.
    """
    key = key or fingerprint(files, tokenizer, field)
    home = Path(home) if home is not None else files[0].parent
    folders = [home / CACHE_NAME, Path(cache_dir) if cache_dir else default_cache_dir()]
    for folder in folders:
        found = _load(folder, key)
        if found is not None:
            return found
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError:
            continue
        count, docs = _write(folder, key, files, tokenizer, field, dtype, progress, interrupt)
        meta = {"format": _FILE_FORMAT, "fingerprint": key, "dtype": np.dtype(dtype).name,
                "num_tokens": count, "documents": docs, "vocab_size": tokenizer.vocab_size,
                "eos_id": tokenizer.eos_id, "files": [str(p) for p in files]}
        _publish(folder / f"{key}.json", json.dumps(meta, indent=1).encode())
        loaded = _load(folder, key)
        return dataclasses.replace(loaded, built=True)
    raise UsageError(f"TextData.cache_dir: neither {str(folders[0])!r} nor {str(folders[1])!r} "
                     "can be written; pass a writable TextData.cache_dir for the token file.")


def _load(folder: Path, key: str) -> TokenFile | None:
    meta_path, path = folder / f"{key}.json", folder / f"{key}.tokens"
    try:
        meta = json.loads(meta_path.read_text())
        size = path.stat().st_size
    except (OSError, json.JSONDecodeError):
        return None
    dtype = np.dtype(meta.get("dtype", "uint32"))
    if meta.get("format") != _FILE_FORMAT or size != meta["num_tokens"] * dtype.itemsize:
        return None  # another version's or a truncated file: tokenize again
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(meta["num_tokens"],))
    return TokenFile(str(path), tokens, key, int(meta["vocab_size"]), int(meta["eos_id"]),
                     int(meta["documents"]), built=False)


def _write(folder: Path, key: str, files: list[Path], tokenizer: Tokenizer, field: str,
           dtype: type, progress: Progress | None,
           interrupt: Interrupt | None = None) -> tuple[int, int]:
    """Tokenizes `files` into ``<key>.tokens`` in `folder`; returns (tokens, documents).

    Raises:
      UsageError: the bytes tokenized do not hash to `key` (a file changed since the key
        was taken, or while it was read); nothing is published.
    """
    total = sum(p.stat().st_size for p in files)
    done = count = docs = 0
    tmp = folder / f"{key}.tokens.tmp-{os.getpid()}"
    read = _key_hash(tokenizer, field)
    moved: list[Path] = []  # files seen changing while they were read
    try:
        with open(tmp, "wb") as out:
            for path in files:
                batch: list[str] = []
                chars = 0

                def flush() -> None:
                    nonlocal count, docs, done, batch, chars
                    for ids in _encode(tokenizer, batch, interrupt):
                        out.write(np.asarray(ids, dtype=dtype).tobytes())
                        count += len(ids)
                    docs += len(batch)
                    done = min(total, done + chars)
                    batch, chars = [], 0
                    if progress is not None:
                        progress(done, total)

                start = done
                with open(path, "rb", buffering=0) as raw:
                    before = os.fstat(raw.fileno())
                    read.update(_file_header(path, before.st_size))
                    reader = _HashedReader(raw, read)
                    for text in documents(path, field, io.BufferedReader(reader, 1 << 20)):
                        if not text:
                            continue  # an empty document would add a lone EOS
                        batch.append(text)
                        chars += len(text)
                        if chars >= _BATCH_CHARS:
                            flush()
                    reader.drain()
                    after = os.stat(path)
                if batch:
                    flush()
                if (reader.count != before.st_size or after.st_size != before.st_size
                        or after.st_mtime_ns != before.st_mtime_ns
                        or after.st_ino != before.st_ino):
                    moved.append(path)
                done = start + before.st_size
                if progress is not None:
                    progress(done, total)
        if docs == 0:
            raise UsageError(f"TextData.paths: {[str(p) for p in files]} hold no text; pass "
                             "files with at least one non-empty document.")
        if moved or read.hexdigest()[:32] != key:
            named = [str(p) for p in (moved or files)]
            named = named if len(named) <= 5 else [*named[:5], "..."]
            when = "while they were tokenized" if moved else "since their fingerprint was taken"
            raise UsageError(
                f"TextData.paths: {named} changed {when}, so no tokens were stored under "
                "the old contents' key; run again once nothing writes to them (or train on a "
                "copy that nothing writes to).")
        os.replace(tmp, folder / f"{key}.tokens")
    finally:
        if tmp.exists():
            tmp.unlink()
    return count, docs


def _encode(tokenizer: Tokenizer, texts: list[str],
            interrupt: Interrupt | None) -> list[list[int]]:
    """``tokenizer.encode(texts)``; with `interrupt`, on a worker thread while this one calls
    `interrupt` every `_POLL_S` seconds. One text file is one document, and one call on 30 MB
    takes a minute, during which a signal's Python handler cannot run on the calling thread
    (the tokenizers library releases the GIL while it works, so the handler runs here). An
    interrupted call's thread is abandoned (a daemon: it cannot hold up the process's exit)."""
    if interrupt is None:
        return tokenizer.encode(texts)
    interrupt()
    done: list[list[list[int]]] = []
    failed: list[BaseException] = []

    def work() -> None:
        try:
            done.append(tokenizer.encode(texts))
        except BaseException as err:  # noqa: BLE001 - re-raised on the calling thread
            failed.append(err)

    worker = threading.Thread(target=work, name="gtp_jax tokenize", daemon=True)
    worker.start()
    while worker.is_alive():
        interrupt()
        worker.join(_POLL_S)
    if failed:
        raise failed[0]
    return done[0]


def _publish(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
