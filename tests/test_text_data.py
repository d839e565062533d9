"""Training on a user's own text: tokenization into a token file (checked against the
tokenizer's own encode), its cache, packing, per-process row reads, exact resume, the
held-out loss and the errors a user can meet. A tiny tokenizer is built here with the
`tokenizers` library (no network)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import cli_env
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

import gtp_jax
from gtp_jax.data import (
    PackedBatcher,
    PackedRows,
    RowBatch,
    TextData,
    data_files,
    fingerprint,
    load_tokenizer,
    token_file,
)
from gtp_jax.models import lm_loss
from gtp_jax.train import TrainConfig, train
from gtp_jax.train.cli.command import cli_message
from gtp_jax.train.cli.command import main as cli_main
from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig, Checkpointer
from gtp_jax.train.loop import _global_batch, build_model_and_optimizer

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a lazy dog sleeps in the sun all day long",
    "brown bears eat fish from the cold river",
    "the sun rises over the river every morning",
]
#: A small run on the default CPU mesh (dp=2 x gtp=4), rows of 17 tokens.
RUN = TrainConfig(steps=4, batch_size=8, seq_len=16, warmup=1, dp=2, gtp=4, layers=2)


def make_tokenizer(folder: Path, *, eos: str | None = "</s>", bos: bool = True) -> Path:
    """A word-level tokenizer trained on `SENTENCES`, saved as ``folder/tokenizer.json``;
    with `bos`, its post-processor prepends ``<s>`` (as Llama's does)."""
    special = ["[UNK]", "<s>"] + ([eos] if eos else [])
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=special))
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def write_corpus(folder: Path, repeats: int = 40) -> list[str]:
    """A text file and a JSONL file (one document per line) in `folder`; returns the
    documents in token order (files sorted by name: a.jsonl, then b.txt)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [SENTENCES[i % 4] + f" {SENTENCES[(i + 1) % 4]}" * (i % 3) for i in range(repeats)]
    with open(folder / "a.jsonl", "w") as f:
        for i, text in enumerate(lines):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
        f.write("\n")  # blank lines are skipped
    text = " ".join(SENTENCES * 5)
    (folder / "b.txt").write_text(text)
    return [*lines, text]


def reference_tokens(tokenizer_dir: Path, docs: list[str], eos: str = "</s>") -> np.ndarray:
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos_id = tok.token_to_id(eos)
    return np.concatenate([tok.encode(d).ids + [eos_id] for d in docs])


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    return tmp_path / "data", make_tokenizer(tmp_path / "tok"), write_corpus(tmp_path / "data")


def test_tokens_are_the_tokenizers_encoding_joined_with_eos(corpus) -> None:
    data, tok_dir, docs = corpus
    tokenizer = load_tokenizer(str(tok_dir))
    out = token_file(data_files((str(data),)), tokenizer, home=data)
    expected = reference_tokens(tok_dir, docs)
    assert expected[0] == Tokenizer.from_file(str(tok_dir / "tokenizer.json")).token_to_id("<s>")
    assert out.tokens.dtype == np.uint16 and isinstance(out.tokens, np.memmap)
    np.testing.assert_array_equal(out.tokens, expected)
    assert out.documents == len(docs) and out.eos_id == tokenizer.eos_id
    assert Path(out.path).parent == data / ".gtp_jax_tokens"


def test_token_file_is_reused_and_rebuilt_when_data_or_tokenizer_change(
        corpus, tmp_path: Path) -> None:
    data, tok_dir, docs = corpus
    files = data_files((str(data),))
    first = token_file(files, load_tokenizer(str(tok_dir)), home=data)
    again = token_file(files, load_tokenizer(str(tok_dir)), home=data)
    assert first.built and not again.built
    assert again.path == first.path and again.fingerprint == first.fingerprint
    np.testing.assert_array_equal(again.tokens, first.tokens)

    (data / "b.txt").write_text("the dog")  # a changed file: new key, new tokens
    changed = token_file(files, load_tokenizer(str(tok_dir)), home=data)
    assert changed.built and changed.fingerprint != first.fingerprint
    np.testing.assert_array_equal(changed.tokens,
                                  reference_tokens(tok_dir, [*docs[:-1], "the dog"]))

    # Another tokenizer (EOS named in tokenizer_config.json) also re-tokenizes.
    other = make_tokenizer(tmp_path / "tok2", eos="<end>", bos=False)
    (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<end>"}))
    retok = token_file(files, load_tokenizer(str(other)), home=data)
    assert retok.built and retok.fingerprint != changed.fingerprint
    np.testing.assert_array_equal(
        retok.tokens, reference_tokens(other, [*docs[:-1], "the dog"], eos="<end>"))

    # A folder that cannot be written (here: a file in its place) -> the cache folder.
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    cached = token_file(files, load_tokenizer(str(tok_dir)), home=blocked,
                        cache_dir=tmp_path / "cache")
    assert Path(cached.path).parent == tmp_path / "cache" and cached.built


def test_a_file_that_changes_under_tokenization_stores_nothing(
        corpus, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A token file must hold exactly what its key (the data's fingerprint) says: else a
    # later run or resume on the original file trains on the other text unnoticed.
    data, tok_dir, docs = corpus
    files = data_files((str(data),))
    tokenizer = load_tokenizer(str(tok_dir))
    original = (data / "b.txt").read_text()
    folder = data / ".gtp_jax_tokens"

    def stored() -> list[Path]:
        return sorted(folder.glob("*.tokens")) if folder.exists() else []

    # Changed between the key (a run fingerprints its data when it checks it) and reading.
    key = fingerprint(files, tokenizer, "text")
    (data / "b.txt").write_text("the dog")
    with pytest.raises(gtp_jax.UsageError, match=r"TextData\.paths: .*changed since their "
                                                 r"fingerprint.*run again"):
        token_file(files, tokenizer, home=data, key=key)
    assert not stored()

    # Rewritten while it is tokenized: after a.jsonl's documents, before b.txt is read.
    (data / "b.txt").write_text(original)

    def rewrite(done: int, total: int) -> None:
        (data / "b.txt").write_text("the lazy dog")

    with pytest.raises(gtp_jax.UsageError, match=r"TextData\.paths: .*changed"):
        token_file(files, tokenizer, home=data, progress=rewrite)
    assert not stored()

    # Back to the original: its tokens are the original text's (not the rewritten one's).
    (data / "b.txt").write_text(original)
    out = token_file(files, tokenizer, home=data)
    np.testing.assert_array_equal(out.tokens, reference_tokens(tok_dir, docs))

    # The command line: one line naming --data; nothing stored for the changed text.
    (data / "b.txt").write_text("the sun")
    encode = type(tokenizer).encode

    def encode_then_rewrite(self, texts):
        (data / "b.txt").write_text("the river")
        return encode(self, texts)

    monkeypatch.setattr(type(tokenizer), "encode", encode_then_rewrite)
    line = _cli_error(capsys, "--data", str(data), "--tokenizer", str(tok_dir))
    assert "--data" in line and "changed" in line, line
    assert stored() == [Path(out.path)]


def test_packing_order_and_per_process_rows() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    rows = PackedRows(tokens, seq_len=9)  # rows of 10 tokens; 100 rows
    assert rows.num_rows == 100
    np.testing.assert_array_equal(rows.rows([3, 0]), [np.arange(30, 40), np.arange(0, 10)])

    batcher = PackedBatcher(rows, batch_size=8, seed=3)
    seen = np.concatenate([batcher.row_ids(p) for p in range(25)])  # 2 epochs of 100 rows
    assert sorted(seen[:100]) == list(range(100)) and sorted(seen[100:]) == list(range(100))
    assert not np.array_equal(seen[:100], seen[100:])  # a fresh order each epoch
    first = [np.asarray(batcher.next_batch()) for _ in range(5)]
    resumed = PackedBatcher.from_state(rows, {**batcher.state_dict(), "position": 2})
    np.testing.assert_array_equal(np.asarray(resumed.next_batch()), first[2])
    for p, batch in enumerate(first):
        np.testing.assert_array_equal(batch, rows.rows(batcher.row_ids(p)))

    # Placed on dp=2 x gtp=4, each device gets its own row of the batch; a process reads
    # only the rows of its devices (here: pretend the first four devices are one process).
    class Recording(PackedRows):
        read: list[int] = []

        def rows(self, ids):
            self.read.extend(int(i) for i in np.asarray(ids))
            return super().rows(ids)

    recording = Recording(tokens, seq_len=9)
    batch = RowBatch(recording, batcher.row_ids(7))
    sharding = gtp_jax.data_sharding(gtp_jax.make_mesh(dp=2, gtp=4))
    placed = _global_batch(batch, sharding)
    for shard in placed.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data),
                                      rows.rows(batch.ids[shard.index[0]]))
    recording.read.clear()
    indices = sharding.addressable_devices_indices_map(batch.shape)
    process = list(indices.items())[:4]
    for _, index in process:
        batch[index]
    assert sorted(recording.read) == sorted(
        int(i) for _, index in process for i in batch.ids[index[0]])
    assert len(recording.read) == 4  # 8 rows over 8 devices: one row each


def test_resume_and_held_out_loss(corpus, tmp_path: Path) -> None:
    data, tok_dir, docs = corpus
    text = TextData(paths=(str(data),), tokenizer=str(tok_dir), val_fraction=0.3)
    cfg = TrainConfig(**{**RUN.__dict__, "eval_every": 2, "eval_batches": 2})
    full = train(cfg, data=text, progress=False,
                 checkpoint=CheckpointConfig(str(tmp_path / "full"), every=2))
    assert sorted(full.val_losses) == [2, 4]
    assert full.to_json()["val_losses"] == {"2": full.val_losses[2], "4": full.val_losses[4]}

    class Preempted(Exception):
        pass

    def die_after_step_2(step: int, loss: float, seconds: float) -> None:
        if step == 2:
            raise Preempted

    with pytest.raises(Preempted):
        train(cfg, data=text, progress=False, on_step=die_after_step_2,
              checkpoint=CheckpointConfig(str(tmp_path / "run"), every=2))
    resumed = train(cfg, data=text, progress=False,
                    checkpoint=CheckpointConfig(str(tmp_path / "run"), every=2, resume=True))
    assert resumed.first_step == 3
    assert resumed.losses == full.losses[2:]  # bit-exact: the same batches and state
    assert resumed.val_losses == {4: full.val_losses[4]}

    # The held-out loss equals lm_loss of the checkpointed model on the held-out rows: the
    # first eval_batches * batch_size rows of 17 tokens of the last 30% of the tokens.
    tokens = reference_tokens(tok_dir, docs)
    held = tokens[-round(len(tokens) * 0.3):]
    rows = held[:2 * 8 * 17].reshape(2, 8, 17).astype(np.int32)
    run_cfg = TrainConfig(**{**cfg.__dict__, "vocab_size": load_tokenizer(str(tok_dir))
                             .vocab_size})
    model, optimizer = build_model_and_optimizer(run_cfg)
    Checkpointer(CheckpointConfig(str(tmp_path / "full"))).restore(model, optimizer, step=2)
    placement = gtp_jax.data_sharding(model.mesh)
    direct = np.mean([float(lm_loss(model, jax.device_put(r, placement))) for r in rows])
    # float32; the same math in another compiled program: reduction order only.
    np.testing.assert_allclose(full.val_losses[2], direct, rtol=1e-5)

    # The command line with --val-data: the held-out loss is printed and in the metrics.
    val = tmp_path / "val.txt"
    val.write_text(" ".join(SENTENCES[::-1] * 4))
    metrics = tmp_path / "metrics.json"
    assert cli_main(["train", "--data", str(data), "--tokenizer", str(tok_dir), "--val-data",
                     str(val), "--steps", "4", "--batch", "8", "--seq", "16", "--warmup", "1",
                     "--layers", "2", "--eval-every", "2", "--eval-batches", "2", "--metrics-json",
                     str(metrics)]) == 0
    report = json.loads(metrics.read_text())
    assert [s.get("val_loss") is not None for s in report["steps"]] == [False, True, False, True]
    assert report["config"]["vocab_size"] == load_tokenizer(str(tok_dir)).vocab_size

    # Other data (or another tokenizer) than the checkpoint's: refused, naming the flags.
    (data / "b.txt").write_text("the river")
    with pytest.raises(gtp_jax.UsageError) as err:
        train(TrainConfig(**{**cfg.__dict__, "steps": 6}), data=text, progress=False,
              checkpoint=CheckpointConfig(str(tmp_path / "run"), resume=True))
    line = cli_message(err.value)
    assert "--data" in line and "--tokenizer" in line and "fingerprint" in line
    with pytest.raises(gtp_jax.UsageError, match="bundled byte corpus"):
        train(TrainConfig(**{**RUN.__dict__, "steps": 6}), progress=False,
              checkpoint=CheckpointConfig(str(tmp_path / "run"), resume=True))


def _cli_error(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert cli_main(["train", "--steps", "1", "--batch", "8", "--seq", "8", *flags]) == 2
    # stderr: at most a tokenizing progress bar, then the error on one line.
    lines = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("[") and "tokenizing" in line for line in lines[:-1]), lines
    assert lines[-1].startswith("error: "), lines
    return lines[-1]


def test_errors_are_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = str(make_tokenizer(tmp_path / "tok"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("")
    (tmp_path / "nofield.jsonl").write_text('{"text": "the dog"}\n{"body": "the sun"}\n')
    (tmp_path / "ok.txt").write_text(" ".join(SENTENCES))
    no_eos = str(make_tokenizer(tmp_path / "no_eos", eos=None))
    (tmp_path / "no_json").mkdir()

    assert "--data" in _cli_error(capsys, "--data", str(tmp_path / "missing.txt"),
                                  "--tokenizer", tok)
    assert "--tokenizer" in _cli_error(capsys, "--data", str(tmp_path / "ok.txt"))
    assert "--data" in _cli_error(capsys, "--tokenizer", tok)
    err = _cli_error(capsys, "--data", str(tmp_path / "ok.txt"), "--tokenizer",
                     str(tmp_path / "no_json"))
    assert "--tokenizer" in err and "tokenizer.json" in err
    err = _cli_error(capsys, "--data", str(tmp_path / "ok.txt"), "--tokenizer", no_eos)
    assert "--tokenizer" in err and "end-of-sequence" in err
    err = _cli_error(capsys, "--data", str(tmp_path / "empty"), "--tokenizer", tok)
    assert "--data" in err and "no text" in err
    err = _cli_error(capsys, "--data", str(tmp_path / "nofield.jsonl"), "--tokenizer", tok)
    assert "--data-field" in err and "line 2" in err and "'body'" in err
    err = _cli_error(capsys, "--data", str(tmp_path / "ok.txt"), "--tokenizer", tok,
                     "--eval-every", "1", "--val-fraction", "0.01")
    assert "--val-fraction" in err and "--batch" in err
    assert not (tmp_path / "empty" / ".gtp_jax_tokens").exists() or not any(
        p.suffix == ".tokens" for p in (tmp_path / "empty" / ".gtp_jax_tokens").iterdir())
    shutil.rmtree(tmp_path / "empty")
    assert os.path.exists(tok)


#: The CLI in a child process whose tokenizer takes ten minutes: a stop must not wait for it.
SLOW_TOKENIZER = """
import sys, time
from gtp_jax.data import text
def slow(self, texts):
    print("tokenizing", file=sys.stderr, flush=True)
    time.sleep(600)
text.Tokenizer.encode = slow
from gtp_jax.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_tokenizing_stops_at_once(corpus, tmp_path: Path) -> None:
    # The signal used to be honoured only after step 1: a minute on 30 MB of text.
    data, tok_dir, _ = corpus
    env = cli_env(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", SLOW_TOKENIZER, "train", "--data", str(data),
                             "--tokenizer", str(tok_dir), "--steps", "2", "--batch", "8",
                             "--seq", "16"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if line.startswith("tokenizing"):
                break
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert time.monotonic() - started < 10
    assert proc.returncode == 75, err
    assert out.strip() == ("gtp_jax train: stopped by SIGTERM while tokenizing the data, "
                           "before step 1: nothing was trained; run the same command to start "
                           "it (exit status 75: unfinished).")
    assert "Traceback" not in err
    assert not list(data.glob(".gtp_jax_tokens/*.tokens*"))  # nothing half-written kept


def test_tokenizer_may_be_the_tokenizer_json_file(corpus) -> None:
    data, tok_dir, docs = corpus
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    as_file = load_tokenizer(str(tok_dir / "tokenizer.json"))
    assert as_file.digest == load_tokenizer(str(tok_dir)).digest  # the same key either way
    text = TextData(paths=(str(data),), tokenizer=str(tok_dir / "tokenizer.json"))
    tokens = token_file(data_files(text.paths), as_file, home=data).tokens
    np.testing.assert_array_equal(tokens, reference_tokens(tok_dir, docs))
    with pytest.raises(gtp_jax.UsageError, match="is neither a tokenizer.json file nor a folder"):
        TextData(paths=(str(data),), tokenizer=str(data / "b.txt.missing"))
