"""Packed sequences of a token stream and a resumable batcher over them.

The stream (documents joined with EOS) is cut into consecutive, non-overlapping rows of
``seq_len + 1`` tokens (the tail shorter than a row is dropped). Training visits the rows in
a random order that is a fresh permutation each epoch; a batch is a list of row ids, and
its tokens are read only where asked (`RowBatch`), so with a memory-mapped token file each
process reads just the rows of its own devices.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gtp_jax.base.errors import UsageError

__all__ = ["PackedBatcher", "PackedRows", "RowBatch", "eval_batches"]

_STATE_KEYS = ("seed", "position", "batch_size", "seq_len", "rows")


class PackedRows:
    """Row ``r`` of a token stream is ``tokens[r * (seq_len + 1) : (r + 1) * (seq_len + 1)]``.

    Args:
      tokens: integer[N] tokens (e.g. a ``np.memmap``; only the rows asked for are read).
      seq_len: model sequence length, >= 1.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.width = self.seq_len + 1
        self.num_rows = len(tokens) // self.width

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """int32[len(ids), seq_len + 1]: the rows `ids`, in that order."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            return np.zeros((0, self.width), np.int32)
        return np.stack([self.tokens[r * self.width:(r + 1) * self.width]
                         for r in ids]).astype(np.int32)


class RowBatch:
    """A batch of rows ``int32[len(ids), seq_len + 1]`` read lazily: ``batch[index]``
    reads only the rows in ``index`` (what ``jax.make_array_from_callback`` asks for each
    of this process's devices); ``np.asarray(batch)`` reads all of them."""

    def __init__(self, rows: PackedRows, ids: np.ndarray) -> None:
        self.source = rows
        self.ids = np.asarray(ids, dtype=np.int64)
        self.shape = (len(self.ids), rows.width)
        self.dtype = np.dtype(np.int32)
        self.ndim = 2

    def __getitem__(self, index: Any) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        rows = self.source.rows(self.ids[index[0]])
        return rows[(slice(None),) + tuple(index[1:])]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.source.rows(self.ids)
        return out if dtype is None else out.astype(dtype)

    def __len__(self) -> int:
        return len(self.ids)


class PackedBatcher:
    """Batches of rows of `rows` in a reproducible, resumable order.

    Global row slot ``k = position * batch_size + i`` is row ``perm_e[k % R]`` of epoch
    ``e = k // R`` (R rows), where ``perm_e`` is ``np.random.default_rng([seed, e])``'s
    permutation: each epoch visits every row once, and the batch at a position depends only
    on (seed, position), so `state_dict` / `from_state` resume the exact order.

    Args:
      rows: the packed training rows (at least one).
      batch_size: rows per batch, >= 1.
      seed: selects the order, >= 0.
      position: batches already produced, >= 0.
    """

    def __init__(self, rows: PackedRows, *, batch_size: int, seed: int = 0,
                 position: int = 0) -> None:
        if rows.num_rows < 1:
            raise UsageError(
                f"the training tokens ({len(rows.tokens)}) are fewer than one sequence of "
                f"TrainConfig.seq_len + 1 = {rows.width}; use a smaller TrainConfig.seq_len, "
                "more TextData.paths or a smaller TextData.val_fraction.")
        self._rows = rows
        self._batch_size = int(batch_size)
        self._seed = int(seed)
        self._position = int(position)
        self._perms: dict[int, np.ndarray] = {}

    @property
    def position(self) -> int:
        """Batches produced so far."""
        return self._position

    def next_batch(self) -> RowBatch:
        """The next batch (`RowBatch` of ``batch_size`` rows), advancing `position`."""
        batch = RowBatch(self._rows, self.row_ids(self._position))
        self._position += 1
        return batch

    def row_ids(self, position: int) -> np.ndarray:
        """int64[batch_size]: the row ids of batch `position`."""
        slots = position * self._batch_size + np.arange(self._batch_size, dtype=np.int64)
        epochs, offsets = np.divmod(slots, self._rows.num_rows)
        out = np.empty_like(slots)
        for epoch in np.unique(epochs):
            where = epochs == epoch
            out[where] = self._permutation(int(epoch))[offsets[where]]
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most two epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self._seed, epoch]).permutation(
                self._rows.num_rows)
        return self._perms[epoch]

    def state_dict(self) -> dict[str, int]:
        """{"seed", "position", "batch_size", "seq_len", "rows"}: Python ints."""
        return {"seed": self._seed, "position": self._position,
                "batch_size": self._batch_size, "seq_len": self._rows.seq_len,
                "rows": self._rows.num_rows}

    @classmethod
    def from_state(cls, rows: PackedRows, state: dict[str, Any]) -> PackedBatcher:
        """Rebuilds a batcher from `state_dict()` output and the same rows.

        Raises:
          UsageError: a state of other rows (count or sequence length).
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise UsageError(f"state is missing {missing}; pass the dict returned by "
                             "PackedBatcher.state_dict().")
        if state["rows"] != rows.num_rows or state["seq_len"] != rows.seq_len:
            raise UsageError(
                f"the saved data order is over {state['rows']} rows of "
                f"{state['seq_len'] + 1} tokens but these rows are {rows.num_rows} of "
                f"{rows.width}; resume with the saving run's TextData.val_fraction / "
                "TextData.val_paths and TrainConfig.seq_len.")
        return cls(rows, batch_size=state["batch_size"], seed=state["seed"],
                   position=state["position"])


def eval_batches(rows: PackedRows, batch_size: int, count: int) -> list[RowBatch]:
    """The first ``min(count, rows.num_rows // batch_size)`` consecutive batches of `rows`
    (rows ``0 .. batch_size - 1``, then the next ``batch_size``, ...), in order.

    Raises:
      UsageError: fewer rows than one batch.
    """
    available = rows.num_rows // batch_size
    if available < 1:
        raise UsageError(
            f"the held-out tokens ({len(rows.tokens)}) make {rows.num_rows} sequences of "
            f"{rows.width} tokens, fewer than one batch of TrainConfig.batch_size="
            f"{batch_size}; raise TextData.val_fraction, pass more TextData.val_paths or "
            "lower TrainConfig.batch_size / seq_len.")
    return [RowBatch(rows, np.arange(j * batch_size, (j + 1) * batch_size))
            for j in range(min(count, available))]
