"""Caller mistakes in the mesh, config and kernel APIs give one clear `UsageError`.

Each case names the argument in the message; none of them may pass silently or surface as
an unrelated exception (AttributeError, a tuple-multiplication TypeError) from deep inside.
"""

from __future__ import annotations

import argparse
import importlib
import os

import jax
import jax.numpy as jnp
import pytest

import gtp_jax
from gtp_jax import pallas as gp
from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.train import CheckpointConfig, TrainConfig
from gtp_jax.train.cli.command import main as cli_main


@pytest.mark.parametrize("call, match", [
    (lambda: gtp_jax.make_mesh(devices=[]), "devices= is empty"),
    (lambda: gtp_jax.make_mesh(gtp=2, devices=[jax.devices()[0]] * 2), r"device ids \[0\]"),
    (lambda: gtp_jax.make_mesh(gtp=2, devices=[0, 1]), "jax.Device"),
    (lambda: gtp_jax.describe_mesh(3), "describe_mesh: mesh must be"),
    (lambda: gtp_jax.data_sharding("mesh"), "data_sharding: mesh must be"),
    (lambda: gtp_jax.data_sharding(gtp_jax.make_mesh(gtp=8), 1.5), "ndim=1.5"),
    (lambda: gtp_jax.data_sharding(gtp_jax.make_mesh(gtp=8), 0), "ndim=0"),
    (lambda: gtp_jax.GTPConfig(gather_dtype=jnp.float8_e4m3fn), "gather_format"),
    (lambda: gtp_jax.GTPConfig(reduce_dtype=jnp.int8), "reduce_dtype"),
    (lambda: gtp_jax.GTPConfig(remat_gathered="yes"), "remat_gathered"),
    (lambda: gtp_jax.GTPConfig(keep_gathered_layers=1), "keep_gathered_layers"),
    (lambda: gtp_jax.GTPConfig(prefetch=1), "prefetch"),
    (lambda: gtp_jax.GTPConfig(pad_for_alignment=True), "pad_for_alignment"),
    (lambda: gtp_jax.GTPConfig(include=[3]), "include"),
    (lambda: gtp_jax.GTPConfig(exclude=5), "exclude"),
    (lambda: gp.quantize(jnp.ones((32, 32)), "fp8", amax=-1.0), "amax=-1.0"),
    (lambda: gp.quantize(jnp.ones((32, 32)), "fp9"), "fp9"),
])
def test_usage_error(call, match) -> None:
    with pytest.raises(UsageError, match=match):
        call()


def test_type_errors_are_also_type_errors() -> None:
    # Code written against the builtin types keeps working.
    with pytest.raises(TypeError):
        gtp_jax.describe_mesh(3)
    assert issubclass(UsageTypeError, UsageError) and issubclass(UsageError, ValueError)


def test_include_none_means_no_patterns() -> None:
    assert gtp_jax.GTPConfig(include=None) == gtp_jax.GTPConfig()


# --------------------------------------------------------------------------- command line

ONE_STEP = ["train", "--steps", "1", "--batch", "8", "--seq", "32"]


@pytest.mark.parametrize("argv, needle", [
    (["--lr", "abc"], "error: argument --lr: invalid float value: 'abc'"),
    (["--stpes", "2"], "error: unrecognized arguments: --stpes 2"),
    (["--checkpoint-dir", "http://host/ck"],
     "error: argument --checkpoint-dir: 'http://host/ck': http:// is not supported here"),
    (["--log-dir", "gs://bucket/logs"],
     "error: argument --log-dir: 'gs://bucket/logs': gs:// is not supported here"),
    (["--export-hf", "file://otherhost/x"],
     "error: argument --export-hf: 'file://otherhost/x': a file:// URL names a local path"),
])
def test_command_line_mistakes_are_one_line(argv, needle, capsys) -> None:
    # argparse's own refusal printed its 47-line usage before the one line that mattered.
    with pytest.raises(SystemExit) as exit_:
        cli_main(["train", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(needle) and "--help lists" in err, err


def test_bad_regular_expression_is_one_line_naming_the_flag(capsys) -> None:
    assert cli_main([*ONE_STEP, "--offload-optimizer", "--offload-exclude", "("]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "error: --offload-exclude has an invalid regular expression '('"), err
    with pytest.raises(UsageError, match=r"TrainConfig\.offload_exclude has an invalid"):
        TrainConfig(offload_optimizer=True, offload_exclude=("blocks/[",))
    with pytest.raises(UsageError, match=r"GTPConfig\.fp8_include has an invalid"):
        gtp_jax.GTPConfig(fp8_include=("*",))


def test_file_url_checkpoint_directory_is_the_local_path(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli_main([*ONE_STEP, "--checkpoint-dir", f"file://{tmp_path}/ck"]) == 0
    assert (tmp_path / "ck" / "1").is_dir() and sorted(os.listdir(tmp_path)) == ["ck"]
    assert CheckpointConfig("file:///tmp/ck").directory == "/tmp/ck"
    with pytest.raises(UsageError, match=r"CheckpointConfig\.directory='ftp://h/ck'"):
        CheckpointConfig("ftp://h/ck")


def test_absurd_sizes_are_refused_before_jax_starts(capsys) -> None:
    # A million simulated CPU devices ran for minutes, then out of memory, with no output.
    assert cli_main(["train", "--gtp", "1000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gtp 1000000 has 2000000 devices" in err, err
    with pytest.raises(UsageError, match="tokens per step"):
        TrainConfig(batch_size=2**20, seq_len=2**12, dp=1, gtp=1)


# --------------------------------------------------------------------------- flags in full


def _every_parser() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser of the command lines (train and its subcommands, plan, each bench
    command and the bench dispatcher), as each entry point builds it: `parse_args` is
    stopped at its first call and the parser kept."""
    from gtp_jax.__main__ import main as top_main
    from gtp_jax.bench.__main__ import COMMANDS
    from gtp_jax.bench.__main__ import _parser as bench_parser

    class Caught(Exception):
        pass

    found: list[tuple[str, argparse.ArgumentParser]] = [("bench", bench_parser())]
    original = argparse.ArgumentParser.parse_known_args

    def catch(self, args=None, namespace=None):
        found.append((self.prog, self))
        raise Caught

    entries = [("train", lambda: top_main(["train"])), ("plan", lambda: top_main(["plan"]))]
    for name, (module, _) in COMMANDS.items():
        entries.append((name, lambda m=module: importlib.import_module(
            f"gtp_jax.bench.{m}").main([])))
    argparse.ArgumentParser.parse_known_args = catch
    try:
        for _, run in entries:
            with pytest.raises(Caught):
                run()
    finally:
        argparse.ArgumentParser.parse_known_args = original
    out, todo = [], list(found)
    while todo:  # subcommands' parsers too
        prog, parser = todo.pop()
        out.append((prog, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(sub.prog, sub) for sub in action.choices.values()]
    return out


def test_every_flag_is_matched_only_as_spelled_in_full() -> None:
    """argparse took `--conf job.toml` for `--config`, but the job file is expanded only for
    the exact spelling: 100 steps trained with the defaults, exit 0. No parser of the
    command lines accepts an abbreviation: the prefix of every long flag that is not itself
    a flag is refused."""
    parsers = _every_parser()
    assert {"python -m gtp_jax train", "python -m gtp_jax plan",
            "python -m gtp_jax.bench memory"} <= {prog for prog, _ in parsers}
    checked = 0
    for prog, parser in parsers:
        assert parser.allow_abbrev is False, prog
        flags = {opt for a in parser._actions for opt in a.option_strings
                 if opt.startswith("--")}
        for flag in flags:
            prefix = flag[:-1]
            if prefix in flags or len(prefix) < 3:
                continue
            parser.exit = lambda status=0, message=None: (_ for _ in ()).throw(SystemExit)
            try:
                _, rest = parser.parse_known_args([prefix, "1"])
            except SystemExit:
                continue  # refused (a required argument missing counts too: not taken)
            assert prefix in rest, (prog, flag)
            checked += 1
    assert checked > 100


def test_a_flag_read_as_typed_is_refused_when_abbreviated(tmp_path, capsys) -> None:
    (tmp_path / "job.toml").write_text("steps = 1\nseed = 7\n")
    for argv, full in ((["--conf", str(tmp_path / "job.toml")], "--config"),
                       (["--processe", "2"], "--processes")):
        with pytest.raises(SystemExit) as exit_:
            cli_main([*ONE_STEP, *argv])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"did you mean {full}?" in err, err


# --------------------------------------------------------------------------- the first mistake


def test_a_missing_data_file_is_named_before_the_tokenizer(tmp_path, capsys) -> None:
    missing = str(tmp_path / "missing.txt")
    for argv in (["--data", missing], ["--data", missing, "--tokenizer", str(tmp_path)]):
        assert cli_main([*ONE_STEP, *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--data: '{missing}' does not exist" in err, err
    assert cli_main([*ONE_STEP, "--tokenizer", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: --tokenizer needs --data PATH" in err, err
    assert cli_main([*ONE_STEP, "--tokenizer", "x", "--val-fraction", "0.1"]) == 2
    assert "--tokenizer, --val-fraction need --data PATH" in capsys.readouterr().err


def test_a_refusal_of_the_mesh_comes_before_the_run_header(capsys) -> None:
    """Building the sharded model refuses what the mesh cannot run (FP8 compute with tp > 1)
    before the run is announced: the header said it would train in fp8, then an error."""
    assert cli_main([*ONE_STEP, "--fp8-compute", "tensorwise", "--fp8-min-features", "16",
                     "--tp", "2", "--dp", "2", "--gtp", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--fp8-compute" in err, (out, err)


def test_reduce_dtype_at_gtp1_is_described_as_it_is() -> None:
    from gtp_jax.train import model_config
    from gtp_jax.train.config import describe_choices

    one = TrainConfig(reduce_dtype="bfloat16", dp=8, gtp=1)
    line = describe_choices(one, model_config(one))
    assert "reduce-scattered in" not in line and "nothing is reduce-scattered at gtp=1" in line


def test_flags_a_run_cannot_use_are_said_or_refused() -> None:
    """--overlap at tp=1 is named in the header as having no effect; --preset beside
    --init-from-hf (whose config.json gives the model) is refused, as --layers is."""
    from gtp_jax.train import model_config
    from gtp_jax.train.config import describe_choices

    cfg = TrainConfig(overlap=True, dp=2, gtp=4)
    assert "--overlap has no effect at tp=1" in describe_choices(cfg, model_config(cfg))
    cfg = TrainConfig(overlap=True, dp=2, gtp=2, tp=2)
    assert "--overlap" not in describe_choices(cfg, model_config(cfg))
    with pytest.raises(UsageError, match=r"^TrainConfig.init_from_hf with preset='small': the "
                       r"checkpoint's config.json gives the model; drop preset"):
        TrainConfig(preset="small", init_from_hf="/some/checkpoint")
