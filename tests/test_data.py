"""Tests for the bundled corpus, its generator and the byte-level batcher (NumPy only)."""

from __future__ import annotations

import runpy
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from gtp_jax.data import VOCAB_SIZE, ByteBatcher, load_corpus, split_train_eval

REPO_ROOT = Path(__file__).resolve().parents[1]


def load_generate_corpus() -> Callable[[], str]:
    # runpy rather than importlib: the script is not a package module, and its dataclass
    # needs a module registered while it executes, which runpy provides.
    script = REPO_ROOT / "tools" / "make_corpus.py"
    return runpy.run_path(str(script), run_name="make_corpus")["generate_corpus"]


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    return load_corpus()


def small_batcher(corpus: np.ndarray, **overrides: int) -> ByteBatcher:
    settings = {"batch_size": 4, "seq_len": 32, "seed": 0} | overrides
    return ByteBatcher(corpus, **settings)


# --------------------------------------------------------------------------- corpus


def test_corpus_is_uint8_ascii_of_expected_size(corpus: np.ndarray) -> None:
    assert corpus.dtype == np.uint8
    assert corpus.ndim == 1
    assert 250_000 <= corpus.size <= 400_000
    assert corpus.max() < 128
    assert b"\r" not in corpus.tobytes()
    assert VOCAB_SIZE == 256


def test_generator_reproduces_bundled_file_byte_for_byte(corpus: np.ndarray) -> None:
    generated = load_generate_corpus()().encode("ascii")
    assert generated == corpus.tobytes()


# --------------------------------------------------------------------------- batches


def test_batch_shape_and_dtype(corpus: np.ndarray) -> None:
    batch = small_batcher(corpus, batch_size=3, seq_len=16).next_batch()
    assert batch.shape == (3, 17)
    assert batch.dtype == np.int32


def test_windows_are_slices_of_the_data(corpus: np.ndarray) -> None:
    text = corpus.tobytes()
    batcher = small_batcher(corpus, batch_size=8, seq_len=24)
    for _ in range(3):
        for row in batcher.next_batch():
            assert row.min() >= 0 and row.max() < VOCAB_SIZE
            assert row.astype(np.uint8).tobytes() in text


def test_windows_reach_the_end_of_short_data() -> None:
    data = np.arange(10, dtype=np.uint8)
    batch = ByteBatcher(data, batch_size=64, seq_len=9).next_batch()
    np.testing.assert_array_equal(batch, np.tile(np.arange(10), (64, 1)))


def test_position_counts_batches(corpus: np.ndarray) -> None:
    batcher = small_batcher(corpus)
    assert batcher.position == 0
    batcher.next_batch()
    batcher.next_batch()
    assert batcher.position == 2
    with pytest.raises(AttributeError):
        batcher.position = 0  # type: ignore[misc]


def test_starting_at_position_k_equals_k_calls(corpus: np.ndarray) -> None:
    fresh = small_batcher(corpus, seed=7)
    for _ in range(5):
        fresh.next_batch()
    resumed = small_batcher(corpus, seed=7, position=5)
    for _ in range(3):
        np.testing.assert_array_equal(fresh.next_batch(), resumed.next_batch())


def test_state_dict_round_trip(corpus: np.ndarray) -> None:
    batcher = small_batcher(corpus, seed=3)
    batcher.next_batch()
    state = batcher.state_dict()
    assert state == {"seed": 3, "position": 1, "batch_size": 4, "seq_len": 32}
    restored = ByteBatcher.from_state(corpus, state)
    np.testing.assert_array_equal(batcher.next_batch(), restored.next_batch())
    assert restored.position == batcher.position == 2


def test_different_seeds_give_different_batches(corpus: np.ndarray) -> None:
    first = small_batcher(corpus, seed=0).next_batch()
    second = small_batcher(corpus, seed=1).next_batch()
    assert not np.array_equal(first, second)


def test_consecutive_batches_differ(corpus: np.ndarray) -> None:
    batcher = small_batcher(corpus)
    assert not np.array_equal(batcher.next_batch(), batcher.next_batch())


# --------------------------------------------------------------------------- split


def test_split_is_a_contiguous_tail(corpus: np.ndarray) -> None:
    train, evaluation = split_train_eval(corpus, eval_fraction=0.1)
    assert train.dtype == evaluation.dtype == np.uint8
    assert len(evaluation) == round(len(corpus) * 0.1)
    np.testing.assert_array_equal(np.concatenate([train, evaluation]), corpus)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"seq_len": 0}, "seq_len"),
        ({"seed": -1}, "seed"),
        ({"position": -1}, "position"),
    ],
)
def test_batcher_rejects_out_of_range_settings(
    corpus: np.ndarray, overrides: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        small_batcher(corpus, **overrides)


def test_batcher_rejects_seq_len_longer_than_data() -> None:
    data = np.arange(10, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"seq_len=10 .* use seq_len <= 9"):
        ByteBatcher(data, batch_size=1, seq_len=10)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (np.zeros((4, 8), dtype=np.uint8), "data must be 1-D"),
        (np.zeros(16, dtype=np.float32), "data must have an integer dtype"),
        (np.array([0, 1, 300, 2], dtype=np.int32), r"data values must lie in \[0, 256\)"),
    ],
)
def test_batcher_rejects_bad_data(data: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ByteBatcher(data, batch_size=1, seq_len=2)


def test_from_state_rejects_incomplete_state(corpus: np.ndarray) -> None:
    with pytest.raises(ValueError, match="state is missing"):
        ByteBatcher.from_state(corpus, {"seed": 0, "position": 0})


@pytest.mark.parametrize("eval_fraction", [0.0, 1.0, -0.5, 1.5])
def test_split_rejects_fraction_outside_open_unit_interval(eval_fraction: float) -> None:
    with pytest.raises(ValueError, match="eval_fraction"):
        split_train_eval(np.arange(100, dtype=np.uint8), eval_fraction=eval_fraction)


def test_split_rejects_data_too_short_for_both_parts() -> None:
    with pytest.raises(ValueError, match="no training tokens"):
        split_train_eval(np.arange(1, dtype=np.uint8), eval_fraction=0.5)
