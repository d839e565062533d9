"""Where a training run's tokens come from: the bundled byte corpus (the default) or a user's
text tokenized into a token file (`gtp_jax.data.TextData`); the held-out rows of each.

`DataSource` is opened in two stages so that nothing is written before the run is checked:
`DataSource.check` (cheap: the tokenizer, the file list, the data's fingerprint, what the
checkpoint records) and `DataSource.open` (tokenizes, or reuses the token file).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from gtp_jax.base.errors import UsageError
from gtp_jax.data import (
    VOCAB_SIZE,
    ByteBatcher,
    PackedBatcher,
    PackedRows,
    RowBatch,
    TextData,
    Tokenizer,
    data_files,
    eval_batches,
    fingerprint,
    load_corpus,
    load_tokenizer,
    split_train_eval,
    token_file,
)
from gtp_jax.data.token_file import Interrupt
from gtp_jax.train.outputs.progress import ProgressBar

#: What a checkpoint of a run on the bundled corpus records as its data source (and what a
#: checkpoint without a record, written before data sources were recorded, stands for).
BYTES_SOURCE = {"kind": "bytes", "fingerprint": "bundled byte corpus"}


@dataclasses.dataclass
class DataSource:
    """The run's data: `record` (saved in checkpoints), the vocabulary size, and after
    `open` the training and held-out token streams."""

    data: TextData | None
    record: dict[str, Any]
    vocab_size: int
    tokenizer: Tokenizer | None = None
    files: list[Path] = dataclasses.field(default_factory=list)
    val_files: list[Path] = dataclasses.field(default_factory=list)
    train_tokens: np.ndarray | None = None
    val_tokens: np.ndarray | None = None

    @classmethod
    def check(cls, data: TextData | None) -> DataSource:
        """Reads the tokenizer and lists the files (fast), without tokenizing.

        Raises:
          UsageError: a tokenizer folder that cannot be read or has no EOS, a folder without
            text files (each naming its `TextData` field).
        """
        if data is None:
            return cls(None, dict(BYTES_SOURCE), VOCAB_SIZE)
        tokenizer = load_tokenizer(data.tokenizer)
        files = data_files(data.paths)
        val_files = data_files(data.val_paths, "TextData.val_paths") if data.val_paths else []
        return cls(data, {}, tokenizer.vocab_size, tokenizer, files, val_files)

    def fingerprint(self) -> dict[str, Any]:
        """Hashes the data files (reads them once) into `record`; returns it."""
        if self.data is not None and not self.record:
            self.record = {"kind": "text",
                           "fingerprint": fingerprint(self.files, self.tokenizer,
                                                      self.data.field),
                           "paths": list(self.data.paths), "tokenizer": self.data.tokenizer,
                           "field": self.data.field}
        return self.record

    def open(self, *, progress: bool, interrupt: Interrupt | None = None) -> None:
        """Sets `train_tokens` and `val_tokens`: the bundled corpus split 95/5, or the token
        file of `TextData.paths` (tokenized now unless an up-to-date one exists; a progress
        bar on process 0 when `progress`) split by `TextData.val_fraction` or, with
        `TextData.val_paths`, those files' tokens.

        `interrupt` is called every fraction of a second while tokenizing (in a run of one
        process: elsewhere process 0 tokenizes while the others wait for it); what it
        raises stops the tokenization, publishing nothing."""
        if self.data is None:
            self.train_tokens, self.val_tokens = split_train_eval(load_corpus())
            return
        if jax.process_count() > 1:
            interrupt = None
        tokens = self._tokens(self.files, self.data.paths, self.fingerprint()["fingerprint"],
                              progress, interrupt)
        if self.val_files:
            self.train_tokens = tokens
            self.val_tokens = self._tokens(self.val_files, self.data.val_paths, None, progress,
                                           interrupt)
        elif self.data.val_fraction > 0:
            held = max(1, round(len(tokens) * self.data.val_fraction))
            self.train_tokens, self.val_tokens = tokens[:-held], tokens[-held:]
        else:
            self.train_tokens, self.val_tokens = tokens, tokens[:0]

    def batcher(self, batch_size: int, seq_len: int, seed: int,
                state: dict[str, Any] | None) -> ByteBatcher | PackedBatcher:
        """The training batcher, fresh or from a checkpoint's data `state`."""
        if self.data is None:
            if state is not None:
                return ByteBatcher.from_state(self.train_tokens, state)
            return ByteBatcher(self.train_tokens, batch_size=batch_size, seq_len=seq_len,
                               seed=seed)
        rows = PackedRows(self.train_tokens, seq_len)
        if state is not None:
            return PackedBatcher.from_state(rows, state)
        return PackedBatcher(rows, batch_size=batch_size, seed=seed)

    def eval_batches(self, batch_size: int, seq_len: int, count: int) -> list[RowBatch]:
        """The first `count` (or all, if fewer) batches of consecutive held-out rows.

        Raises:
          UsageError: no held-out tokens, or fewer than one batch of rows.
        """
        if self.val_tokens is None or len(self.val_tokens) == 0:
            raise UsageError("TrainConfig.eval_every needs held-out text: pass "
                             "TextData.val_paths or a TextData.val_fraction > 0.")
        return eval_batches(PackedRows(self.val_tokens, seq_len), batch_size, count)

    def _tokens(self, files: list[Path], paths: tuple[str, ...], key: str | None,
                progress: bool, interrupt: Interrupt | None = None) -> np.ndarray:
        home = Path(paths[0]) if Path(paths[0]).is_dir() else Path(paths[0]).parent
        kwargs = dict(field=self.data.field, home=home, cache_dir=self.data.cache_dir, key=key)
        report = _progress() if progress and jax.process_index() == 0 else None
        if jax.process_count() == 1:
            return token_file(files, self.tokenizer, progress=report, interrupt=interrupt,
                              **kwargs).tokens
        # Process 0 tokenizes; the others then find its file (a shared file system) or,
        # where the folder is local to each host, tokenize their own copy.
        from jax.experimental import multihost_utils  # noqa: PLC0415

        if jax.process_index() == 0:
            token_file(files, self.tokenizer, progress=report, **kwargs)
        multihost_utils.sync_global_devices("gtp_jax token file")
        return token_file(files, self.tokenizer, **kwargs).tokens


def _progress():
    """A ``progress(done, total)`` callback drawing a bar in whole percent."""
    bar = ProgressBar(100, label="tokenizing", unit="%", every=10)
    last = -1

    def report(done: int, total: int) -> None:
        nonlocal last
        percent = 100 * done // max(1, total)
        if percent != last:
            last = percent
            bar.update(percent, MiB=done / 2**20)

    return report


def check_source(saved: dict[str, Any] | None, now: dict[str, Any], directory: str) -> None:
    """Raises UsageError unless a checkpoint's data source `saved` (None: the bundled
    corpus) is the run's `now`."""
    saved = saved if isinstance(saved, dict) else BYTES_SOURCE
    if saved.get("fingerprint") == now.get("fingerprint"):
        return
    raise UsageError(
        f"CheckpointConfig.resume: the checkpoint in {directory!r} was trained on "
        f"{_describe(saved)}, but this run's data is {_describe(now)}; resume with the saving "
        "run's TextData.paths, TextData.tokenizer and TextData.field (the same file contents "
        "and tokenizer), or start a new run in another CheckpointConfig.directory.")


def _describe(record: dict[str, Any]) -> str:
    if record.get("kind") != "text":
        return "the bundled byte corpus (no TextData.paths)"
    return (f"TextData.paths {record.get('paths')} with TextData.tokenizer "
            f"{record.get('tokenizer')!r} (fingerprint {record.get('fingerprint')})")
