"""Attack matrix: tries the command line and the library the way users (and mistakes) do, and
classifies each outcome.

    python tools/attack_matrix.py [--only AREA] [--markdown]

Outcomes:
  OK         the documented result: a run that trains right (compared with a reference run
             where one exists), or one line ``error: ...`` naming the flag/argument (exit 2),
             or the documented non-error line (exit 0).
  confusing  right in substance, but the user is left guessing: an error that does not name
             what to change, several lines, an unexpected exit status, error text on success,
             a library error that is not a `gtp_jax.UsageError`.
  wrong      a silent wrong answer (accepted input that should be refused, a result that
             differs from the reference) or a traceback reaching a command-line user.

Runs on CPU with 8 simulated devices (set below, before JAX starts); about 20 minutes on 2
cores. Not part of the test suite: each defect it found is a regular test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                                 os.environ.get("XLA_FLAGS", "")) + \
    " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="attack_xla_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import gtp_jax  # noqa: E402
from gtp_jax.train.cli.command import main as cli_main  # noqa: E402

OK, CONFUSING, WRONG = "OK", "confusing", "wrong"
SMALL = ["--batch", "8", "--seq", "32", "--warmup", "1"]
WORK = Path(tempfile.mkdtemp(prefix="attack_"))
BAD_TEXT = re.compile(r"CANCELLED|UNAVAILABLE|Connection refused|Traceback")


class Run:
    """One in-process CLI call: exit code, stdout, stderr, and an escaped exception."""

    def __init__(self, argv: list[str]):
        out, err = io.StringIO(), io.StringIO()
        self.exc = None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                self.code = cli_main(argv)
            except SystemExit as e:  # argparse
                self.code = e.code if isinstance(e.code, int) else 2
            except BaseException as e:  # noqa: BLE001 - a traceback reaching the user
                self.code = None
                self.exc = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
        self.out, self.err = out.getvalue(), err.getvalue()

    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("error:")]


def cli(*argv: str) -> Run:
    return Run(["train", *argv])


def losses(path: Path) -> dict[int, float]:
    return {s["step"]: s["loss"] for s in json.loads(path.read_text())["steps"]}


def expect_error(run: Run, *names: str, code: int = 2) -> tuple[str, str]:
    """A refusal: one ``error:`` line naming one of `names`, exit `code`."""
    if run.exc:
        return WRONG, f"traceback {run.exc}"
    if run.code == 0:
        return WRONG, "accepted (exit 0)"
    lines = run.error_lines()
    if len(lines) != 1:
        return CONFUSING, f"exit {run.code}, {len(lines)} error lines: {run.err.strip()[-160:]}"
    if names and not any(n in lines[0] for n in names):
        return CONFUSING, f"does not name {names}: {lines[0][:160]}"
    if run.code != code:
        return CONFUSING, f"exit {run.code} (expected {code}): {lines[0][:120]}"
    return OK, lines[0][:140]


def expect_ok(run: Run, check: Callable[[], str | None] | None = None) -> tuple[str, str]:
    """A run that should succeed; `check` returns None or what differs."""
    if run.exc:
        return WRONG, f"traceback {run.exc}"
    if run.code != 0:
        lines = run.error_lines()
        return CONFUSING, f"refused (exit {run.code}): {(lines or [run.err[-160:]])[0][:160]}"
    if check is not None:
        why = check()
        if why:
            return WRONG, why
    return OK, (run.out.strip().splitlines() or [""])[-1][:100]


def same_losses(got: dict[int, float], want: dict[int, float], rtol: float) -> str | None:
    common = sorted(set(got) & set(want))
    if not common:
        return f"no common steps (got {sorted(got)}, reference {sorted(want)})"
    for s in common:
        if abs(got[s] - want[s]) > rtol * abs(want[s]):
            return f"step {s}: loss {got[s]:.6f} vs reference {want[s]:.6f}"
    return None


# --------------------------------------------------------------------------- base runs

BASE = WORK / "base"           # 4 steps, checkpoints at 2 and 4, dp2 x gtp4
REF6: dict[int, float] = {}    # the same run extended to 6 steps (steps 1-6)


def make_base() -> None:
    run = cli("--steps", "4", *SMALL, "--checkpoint-dir", str(BASE), "--checkpoint-every", "2",
              "--metrics-json", str(WORK / "base.json"))
    assert run.code == 0, run.err
    ext = WORK / "ext"
    shutil.copytree(BASE, ext)
    run = cli("--steps", "6", *SMALL, "--checkpoint-dir", str(ext), "--resume",
              "--metrics-json", str(WORK / "ext.json"))
    assert run.code == 0, run.err
    REF6.update(losses(WORK / "base.json"))
    REF6.update(losses(WORK / "ext.json"))


def fresh_copy(name: str) -> Path:
    dst = WORK / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(BASE, dst)
    return dst


# --------------------------------------------------------------------------- the cases

CASES: list[tuple[str, str, Callable[[], tuple[str, str]]]] = []


def case(area: str, name: str):
    def deco(fn):
        CASES.append((area, name, fn))
        return fn
    return deco


def add(area: str, name: str, fn: Callable[[], tuple[str, str]]) -> None:
    CASES.append((area, name, fn))


# ---- general flags
for flags, names in [
        (["--steps", "0"], ("--steps",)), (["--steps", "-3"], ("--steps",)),
        (["--batch", "0"], ("--batch",)), (["--batch", "12"], ("--batch",)),
        (["--seq", "0"], ("--seq",)), (["--seq", "100000"], ("--seq",)),
        (["--lr", "nan"], ("--lr",)), (["--lr", "-1"], ("--lr",)), (["--lr", "inf"], ("--lr",)),
        (["--warmup", "-1"], ("--warmup",)), (["--preset", "huge"], ("--preset",)),
        (["--gtp", "3"], ("--gtp", "mesh")), (["--tp", "3", "--dp", "1", "--gtp", "1"],
                                              ("--tp", "mesh")),
        (["--tp", "8", "--dp", "1", "--gtp", "1"], ("--tp",)),
        (["--ep", "2", "--gtp", "4"], ("--ep", "--moe-experts")),
        (["--moe-experts", "4", "--moe-top-k", "5"], ("--moe-top-k",)),
        (["--moe-experts", "4", "--moe-capacity", "-1"], ("--moe-capacity",)),
        (["--keep-checkpoints", "0", "--checkpoint-dir", "KDIR"], ("--keep-checkpoints",)),
        (["--checkpoint-every", "-2", "--checkpoint-dir", "KDIR"], ("--checkpoint-every",)),
        (["--profile-steps", "9:3"], ("--profile-steps",)),
        (["--profile-steps", "x"], ("--profile-steps",)),
        (["--metrics-json", "/proc/x.json"], ("--metrics-json",)),
        (["--checkpoint-dir", "/proc/ck"], ("--checkpoint-dir",)),
        (["--pad-for-alignment", "-8"], ("--pad-for-alignment",)),
        (["--resume"], ("--checkpoint-dir",)),
        (["--local-device-ids", "a,b"], ("--local-device-ids",)),
        (["--seed", "-1"], ("--seed",)),
        (["--dp", "0"], ("--dp",)), (["--tp", "-1"], ("--tp",)), (["--ep", "0"], ("--ep",)),
        (["--gtp", "0"], ("--gtp",)),
]:
    def _run(flags=flags, names=names):
        d = WORK / f"k{time.monotonic_ns()}"
        argv = [str(d) if f == "KDIR" else f for f in flags]
        return expect_error(cli("--steps", "2", *SMALL, *argv) if "--steps" not in flags
                            else cli(*[a for a in SMALL], *argv), *names)
    add("flags", " ".join(flags).replace("KDIR", "DIR"), _run)

# ---- nonuniform TP / --simulate-failure
NTP = ["--tp", "4", "--dp", "2", "--steps", "4", *SMALL]
for spec, extra, names in [
        ("step=x,device=5", [], ("--simulate-failure",)),
        ("device=5", [], ("--simulate-failure",)),
        ("step=2", [], ("--simulate-failure",)),
        ("", [], ("--simulate-failure",)),
        ("step=2,device=5,foo=1", [], ("--simulate-failure",)),
        ("step=2,step=3,device=5", [], ("--simulate-failure",)),
        ("step=9,device=5", [], ("--simulate-failure", "--steps")),
        ("step=0,device=5", [], ("--simulate-failure",)),
        ("step=-1,device=5", [], ("--simulate-failure",)),
        ("step=2,device=8", [], ("--simulate-failure", "device")),
        ("step=2,device=-1", [], ("--simulate-failure", "device")),
        ("step=2,device=5,device=5", [], ("--simulate-failure", "device")),
        ("step=2,device=4+5+6+7", [], ("--simulate-failure", "device")),
        ("step=2,device=0+1+2+3+4+5+6+7", [], ("--simulate-failure", "device")),
        ("step=2,device=5", ["--tp-spares", "4"], ("--tp-spares",)),
        ("step=2,device=5", ["--tp-spares", "-1"], ("--tp-spares",)),
]:
    add("ntp", f"--simulate-failure {spec!r} {' '.join(extra)}".strip(),
        lambda spec=spec, extra=extra, names=names:
        expect_error(cli(*NTP, "--simulate-failure", spec, *extra), *names))
add("ntp", "--tp-spares without --simulate-failure",
    lambda: expect_error(cli(*NTP, "--tp-spares", "1"), "--simulate-failure"))
add("ntp", "--ntp-axis gtp without --simulate-failure",
    lambda: expect_error(cli(*NTP, "--ntp-axis", "gtp"), "--simulate-failure"))
add("ntp", "failure with tp=1 (dp2 gtp4), axis tp",
    lambda: expect_error(cli("--steps", "4", *SMALL, "--simulate-failure", "step=2,device=5"),
                         "--simulate-failure", "--tp", "--ntp-axis"))


def _ntp_ok(extra: list[str]) -> tuple[str, str]:
    m = WORK / f"ntp{time.monotonic_ns()}.json"
    run = cli(*NTP, "--metrics-json", str(m), *extra)

    def check():
        got = losses(m)
        if sorted(got) != [1, 2, 3, 4]:
            return f"steps {sorted(got)}"
        if not all(np.isfinite(list(got.values()))):
            return "non-finite loss"
        return None
    return expect_ok(run, check)


add("ntp", "step=2,device=5 (tp4 dp2) trains through",
    lambda: _ntp_ok(["--simulate-failure", "step=2,device=5"]))
add("ntp", "step=2,device=1+6 (one per replica)",
    lambda: _ntp_ok(["--simulate-failure", "step=2,device=1,device=6"]))
add("ntp", "step=2,device=5 --tp-spares 2",
    lambda: _ntp_ok(["--simulate-failure", "step=2,device=5", "--tp-spares", "2"]))
add("ntp", "failure at the last step (step=4)",
    lambda: expect_error(cli(*NTP, "--simulate-failure", "step=4,device=5"),
                         "--simulate-failure step=4"))


def _ntp_with_checkpoint() -> tuple[str, str]:
    d = WORK / "ntp_ck"
    shutil.rmtree(d, ignore_errors=True)
    run = cli(*NTP, "--simulate-failure", "step=2,device=5", "--checkpoint-dir", str(d),
              "--checkpoint-every", "1")
    return expect_ok(run) if run.code == 0 or run.exc else expect_error(run, "--checkpoint")


add("ntp", "failure with --checkpoint-every 1", _ntp_with_checkpoint)
add("ntp", "failure with --cp 2", lambda: expect_error(
    cli("--tp", "2", "--cp", "2", "--dp", "2", "--gtp", "1", "--steps", "4", *SMALL,
        "--simulate-failure", "step=2,device=5"), "--simulate-failure", "--cp"))
add("ntp", "failure with --moe-experts 4 --ep 2", lambda: expect_error(
    cli("--tp", "2", "--ep", "2", "--dp", "2", "--gtp", "1", "--moe-experts", "4", "--steps",
        "4", *SMALL, "--simulate-failure", "step=2,device=5"), "--simulate-failure", "--ep",
        "--moe"))
add("ntp", "failure with --moe-experts 4 (ep=1)",
    lambda: _ntp_ok(["--simulate-failure", "step=2,device=5", "--moe-experts", "4"]))
add("ntp", "failure with --gather-format fp8",
    lambda: _ntp_ok(["--simulate-failure", "step=2,device=5", "--gather-format", "fp8"]))

# ---- context parallelism
CP = ["--steps", "3", "--batch", "8", "--warmup", "1"]
for flags, names in [
        (["--cp", "3", "--seq", "96"], ("--cp", "mesh")),
        (["--cp", "0", "--seq", "64"], ("--cp",)),
        (["--cp", "-2", "--seq", "64"], ("--cp",)),
        (["--cp", "16", "--seq", "64"], ("--cp", "mesh")),
        (["--cp", "2", "--seq", "64", "--batch", "6"], ("--batch",)),
]:
    add("cp", " ".join(flags), lambda flags=flags, names=names: expect_error(
        cli(*CP, *[f for f in flags]), *names))


def _cp_matches(flags: list[str], rtol: float = 2e-4) -> tuple[str, str]:
    """A cp run's losses against the same run without cp (same data, same math)."""
    seq = flags[flags.index("--seq") + 1] if "--seq" in flags else "64"
    ref_m, m = WORK / f"cpref{seq}.json", WORK / f"cp{time.monotonic_ns()}.json"
    if not ref_m.exists():
        r = cli(*CP, "--seq", seq, "--dp", "2", "--gtp", "4", "--metrics-json", str(ref_m))
        if r.code != 0:
            return CONFUSING, f"reference failed: {r.err[-120:]}"
    rest = [f for i, f in enumerate(flags) if f != "--seq" and (i == 0 or flags[i - 1] != "--seq")]
    run = cli(*CP, "--seq", seq, *rest, "--metrics-json", str(m))
    return expect_ok(run, lambda: same_losses(losses(m), losses(ref_m), rtol))


add("cp", "--cp 2 --dp 2 --gtp 2 --seq 64 vs no cp", lambda: _cp_matches(
    ["--cp", "2", "--dp", "2", "--gtp", "2", "--seq", "64"]))
add("cp", "--cp 4 --dp 2 --gtp 1 --seq 64 vs no cp", lambda: _cp_matches(
    ["--cp", "4", "--dp", "2", "--gtp", "1", "--seq", "64"]))
add("cp", "--cp 2 --tp 2 --dp 2 --gtp 1 --seq 64 vs no cp", lambda: _cp_matches(
    ["--cp", "2", "--tp", "2", "--dp", "2", "--gtp", "1", "--seq", "64"]))
add("cp", "--cp 2 --seq 33 (padded to the split) vs no cp", lambda: _cp_matches(
    ["--cp", "2", "--dp", "2", "--gtp", "2", "--seq", "33"]))
add("cp", "--cp 2 --seq 48 (padded blocks) vs no cp", lambda: _cp_matches(
    ["--cp", "2", "--dp", "2", "--gtp", "2", "--seq", "48"]))
add("cp", "--cp 2 --no-unroll-layers vs no cp", lambda: _cp_matches(
    ["--cp", "2", "--dp", "2", "--gtp", "2", "--seq", "64", "--no-unroll-layers"]))
add("cp", "--cp 2 --attention cudnn on CPU", lambda: expect_error(
    cli(*CP, "--cp", "2", "--seq", "64", "--attention", "cudnn"), "--attention"))
add("cp", "--cp 2 --moe-experts 4 (documented: not supported)", lambda: expect_error(
    cli(*CP, "--cp", "2", "--dp", "2", "--gtp", "2", "--seq", "64", "--moe-experts", "4"),
    "--cp", "--moe-experts"))


# ---- flash block kernel guards (library)
def _lib(fn: Callable[[], object], *names: str, should_fail: bool = True) -> tuple[str, str]:
    try:
        fn()
    except gtp_jax.UsageError as e:
        if not should_fail:
            return CONFUSING, f"refused: {e}"
        msg = " ".join(str(e).split())
        if names and not any(n in msg for n in names):
            return CONFUSING, f"UsageError not naming {names}: {msg[:120]}"
        return OK, msg[:120]
    except Exception as e:  # noqa: BLE001
        return CONFUSING, f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
    return (WRONG, "accepted") if should_fail else (OK, "ran")


def _fb():
    from gtp_jax.pallas import flash_block as fb  # noqa: PLC0415
    return fb


def _q(shape, dtype=jnp.bfloat16):
    return jnp.ones(shape, dtype)


for name, fn, names in [
        ("backend='triton'", lambda: _fb().attention_block(
            _q((1, 128, 2, 64)), _q((1, 128, 2, 64)), _q((1, 128, 2, 64)), causal=True,
            kv_len=None, scale=0.125, backend="triton"), ("backend",)),
        ("pallas with float32", lambda: _fb().attention_block(
            _q((1, 128, 2, 64), jnp.float32), _q((1, 128, 2, 64), jnp.float32),
            _q((1, 128, 2, 64), jnp.float32), causal=True, kv_len=None, scale=0.125,
            backend="pallas"), ("dtype",)),
        ("pallas head_dim 48", lambda: _fb().attention_block(
            _q((1, 128, 2, 48)), _q((1, 128, 2, 48)), _q((1, 128, 2, 48)), causal=True,
            kv_len=None, scale=0.125, backend="pallas"), ("head_dim",)),
        ("pallas sq=100", lambda: _fb().attention_block(
            _q((1, 100, 2, 64)), _q((1, 128, 2, 64)), _q((1, 128, 2, 64)), causal=True,
            kv_len=None, scale=0.125, backend="pallas"), ("sq",)),
        ("tiles not a BlockTiles", lambda: _fb().attention_block(
            _q((1, 128, 2, 64)), _q((1, 128, 2, 64)), _q((1, 128, 2, 64)), causal=True,
            kv_len=None, scale=0.125, tiles=(64, 64)), ("tiles",)),
        ("BlockTiles(fwd_q=48)", lambda: _fb().BlockTiles(fwd_q=48), ("fwd_q",)),
        ("BlockTiles(num_stages=0)", lambda: _fb().BlockTiles(num_stages=0), ("num_stages",)),
        ("q of rank 3", lambda: _fb().attention_block(
            _q((128, 2, 64)), _q((128, 2, 64)), _q((128, 2, 64)), causal=True, kv_len=None,
            scale=0.125), ("q",)),
        ("k head_dim != q head_dim", lambda: _fb().attention_block(
            _q((1, 128, 2, 64)), _q((1, 128, 2, 32)), _q((1, 128, 2, 32)), causal=True,
            kv_len=None, scale=0.125), ("head", "k")),
        ("kv heads not dividing q heads", lambda: _fb().attention_block(
            _q((1, 128, 3, 64)), _q((1, 128, 2, 64)), _q((1, 128, 2, 64)), causal=True,
            kv_len=None, scale=0.125), ("head",)),
        ("v length != k length", lambda: _fb().attention_block(
            _q((1, 128, 2, 64)), _q((1, 128, 2, 64)), _q((1, 64, 2, 64)), causal=True,
            kv_len=None, scale=0.125), ("v",)),
        ("TransformerConfig(cp_attention_backend='x')", lambda: gtp_jax.models.TransformerConfig(
            cp_attention_backend="x"), ("cp_attention_backend",)),
]:
    add("flash", name, lambda fn=fn, names=names: _lib(fn, *names))
add("flash", "pallas interpret on CPU equals reference", lambda: _flash_equal())


def _flash_equal() -> tuple[str, str]:
    fb = _fb()
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k1, (1, 128, 2, 64), jnp.bfloat16)
    k = jax.random.normal(k2, (1, 128, 2, 64), jnp.bfloat16)
    v = jax.random.normal(k3, (1, 128, 2, 64), jnp.bfloat16)
    out, lse = fb.attention_block(q, k, v, causal=True, kv_len=None, scale=0.125,
                                  backend="pallas", interpret=True)
    ref, ref_lse = fb.attention_block_reference(q, k, v, causal=True, kv_len=None, scale=0.125)
    err = float(jnp.max(jnp.abs(out - ref)))
    return (OK, f"max |diff| {err:.2e}") if err < 2e-2 else (WRONG, f"max |diff| {err:.2e}")


# ---- extended runs and resume
def _resume(steps: str, *extra: str, name: str = "res") -> tuple[Run, Path]:
    d = fresh_copy(name)
    m = WORK / f"{name}.json"
    m.unlink(missing_ok=True)
    return cli("--steps", steps, *SMALL, "--checkpoint-dir", str(d), "--resume",
               "--metrics-json", str(m), *extra), m


def _finished_relaunch(*extra: str) -> tuple[str, str]:
    run, _ = _resume("4", *extra)
    if run.exc:
        return WRONG, f"traceback {run.exc}"
    lines = [x for x in (run.out + run.err).splitlines() if x.strip()]
    if run.code != 0:
        return CONFUSING, f"exit {run.code}: {(run.error_lines() or lines)[0][:140]}"
    if len(lines) != 1 or "finished" not in lines[0]:
        return CONFUSING, f"{len(lines)} lines: {lines[:2]}"
    return OK, lines[0][:140]


add("extend", "re-launch finished run, same --steps", lambda: _finished_relaunch())
add("extend", "re-launch finished run, same --steps, other mesh",
    lambda: _finished_relaunch("--gtp", "8", "--dp", "1"))
add("extend", "resume with fewer --steps than trained",
    lambda: expect_error(_resume("3")[0], "--steps"))


def _extend(steps: str, *extra: str, rtol: float = 0.0) -> tuple[str, str]:
    run, m = _resume(steps, *extra)
    return expect_ok(run, lambda: same_losses(losses(m), REF6, rtol) if m.exists()
                     else "no metrics")


add("extend", "extend 4 -> 6 equals reference", lambda: _extend("6"))
add("extend", "extend 4 -> 6 then 6 -> 8", lambda: _extend_twice())


def _extend_twice() -> tuple[str, str]:
    run, m = _resume("6", name="twice")
    if run.code != 0:
        return expect_ok(run)
    run2 = cli("--steps", "8", *SMALL, "--checkpoint-dir", str(WORK / "twice"), "--resume")
    return expect_ok(run2)


for flag, value in [("--lr", "1e-3"), ("--seed", "1"), ("--batch", "16"), ("--seq", "64"),
                    ("--preset", "small"), ("--moe-experts", "4"), ("--warmup", "2"),
                    ("--dtype", "bfloat16")]:
    def _conflict(flag=flag, value=value):
        argv = ["--steps", "6", *SMALL]
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
        d = fresh_copy("conflict")
        return expect_error(cli(*argv, "--checkpoint-dir", str(d), "--resume"),
                            flag.lstrip("-").replace("-", "_"), flag)
    add("extend", f"resume with changed {flag} {value}", _conflict)
add("extend", "resume from an empty directory", lambda: expect_error(
    cli("--steps", "6", *SMALL, "--checkpoint-dir", str(WORK / "empty_dir"), "--resume"),
    "--checkpoint-dir", "--resume"))
add("extend", "new run into a directory with checkpoints", lambda: expect_error(
    cli("--steps", "6", *SMALL, "--checkpoint-dir", str(fresh_copy("nonempty"))), "--resume"))
add("extend", "resume from a file path", lambda: expect_error(
    cli("--steps", "6", *SMALL, "--checkpoint-dir", str(WORK / "base.json"), "--resume"),
    "--checkpoint-dir"))


# ---- stored layouts: resume onto other meshes / padding / gather settings, vs reference
for extra, rtol in [(["--gtp", "8", "--dp", "1"], 1e-4), (["--dp", "8", "--gtp", "1"], 1e-4),
                    (["--tp", "2", "--dp", "2", "--gtp", "2"], 1e-4),
                    (["--pad-for-alignment", "8"], 1e-4),
                    (["--gather-dtype", "bfloat16"], 2e-2),
                    (["--no-unroll-layers"], 1e-4), (["--remat", "full"], 1e-4),
                    (["--prefetch", "--no-unroll-layers"], 1e-4),
                    (["--tp", "4", "--dp", "2", "--gtp", "1"], 1e-4)]:
    add("layout", "resume onto " + " ".join(extra),
        lambda extra=extra, rtol=rtol: _extend("6", *extra, rtol=rtol))
add("layout", "resume onto --cp 2 --seq 32", lambda: _extend("6", "--cp", "2", "--dp", "2",
                                                           "--gtp", "2", rtol=2e-4))


# ---- checkpoint integrity: damage each file kind of the newest checkpoint (step 4)
def _damage(path: Path, how: str) -> None:
    if how == "delete":
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    elif how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "garble":
        data = bytearray(path.read_bytes())
        if not data:
            data = bytearray(b"x")
        mid = len(data) // 2
        for i in range(mid, min(len(data), mid + 16)):
            data[i] ^= 0xA5
        path.write_bytes(bytes(data))
    elif how == "empty":
        path.write_bytes(b"")


def _integrity(rel: str, how: str) -> tuple[str, str]:
    d = fresh_copy("dmg")
    matches = sorted((d / "4").glob(rel))
    if not matches:
        return CONFUSING, f"no file {rel}"
    _damage(matches[0], how)
    return _resume_damaged(d, "--checkpoint-dir", "checkpoint")


def _resume_damaged(d: Path, *names: str) -> tuple[str, str]:
    """Resumes the damaged copy `d`: a refusal naming one of `names`, or the reference's
    exact losses."""
    m = WORK / f"{d.name}.json"
    m.unlink(missing_ok=True)
    run = cli("--steps", "6", *SMALL, "--checkpoint-dir", str(d), "--resume",
              "--metrics-json", str(m))
    if run.code == 2 and not run.exc:
        return expect_error(run, *names)
    return expect_ok(run, lambda: same_losses(losses(m), REF6, 0.0))


FILES = ["model/ocdbt.process_0/d/*", "model/ocdbt.process_0/manifest.ocdbt",
         "model/manifest.ocdbt", "model/_METADATA", "model/_sharding",
         "model/array_metadatas/process_0", "model/d/*", "optimizer/ocdbt.process_0/d/*",
         "optimizer/_METADATA", "meta/metadata", "_CHECKPOINT_METADATA"]
for rel in FILES:
    for how in ("garble", "truncate", "delete"):
        add("integrity", f"{how} {rel}", lambda rel=rel, how=how: _integrity(rel, how))
for rel in ("commit_success.txt", "model/commit_success.txt", "model", "meta"):
    add("integrity", f"delete {rel}", lambda rel=rel: _integrity(rel, "delete"))
add("integrity", "empty model/_METADATA", lambda: _integrity("model/_METADATA", "empty"))


def _both_damaged() -> tuple[str, str]:
    # The largest data file of each checkpoint: it holds array bytes that a restore reads
    # (the files are named by content hash, so the first by name may be a small index node
    # that a restore never reads). Refused, or resumed with the reference's exact losses.
    d = fresh_copy("dmg2")
    for step in ("2", "4"):
        files = (d / step).glob("model/ocdbt.process_0/d/*")
        _damage(max(files, key=lambda f: f.stat().st_size), "garble")
    return _resume_damaged(d, "intact", "--checkpoint-dir")


add("integrity", "garble data of every checkpoint", _both_damaged)


# ---- the lock
def _lock_case(content: str | None, expect: str) -> tuple[str, str]:
    d = fresh_copy("lock")
    if content is not None:
        (d / ".gtp_jax.lock").write_text(content)
    run = cli("--steps", "6", *SMALL, "--checkpoint-dir", str(d), "--resume")
    if expect == "error":
        return expect_error(run, "lock", ".gtp_jax.lock")
    return expect_ok(run, lambda: None if not (d / ".gtp_jax.lock").exists()
                     else "lock left behind")


host = socket.gethostname()
add("lock", "held by a live process on this host", lambda: _lock_case(
    json.dumps({"pid": os.getpid(), "host": host, "time": time.time()}), "error"))
add("lock", "held by a dead pid on this host (stale)", lambda: _lock_case(
    json.dumps({"pid": 2**22 + 12345, "host": host, "time": time.time()}), "ok"))
add("lock", "held by a process on another host", lambda: _lock_case(
    json.dumps({"pid": 1, "host": "elsewhere", "time": time.time()}), "error"))
add("lock", "lock file with garbage", lambda: _lock_case("not json", "error"))
add("lock", "empty lock file", lambda: _lock_case("", "error"))
add("lock", "released after a run", lambda: _lock_case(None, "ok"))


# ---- safety: inputs that change under a run, one owner per directory, verification that
# damage cannot switch off, a requeue command that never dead-ends
def _tokenizer_dir() -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: PLC0415

    folder = WORK / "tok"
    if not (folder / "tokenizer.json").exists():
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4,
                                trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
        folder.mkdir(parents=True, exist_ok=True)
        tok.save(str(folder / "tokenizer.json"))
    return folder


def _data_rewritten_while_tokenized() -> tuple[str, str]:
    from gtp_jax.data.text import Tokenizer  # noqa: PLC0415

    data = WORK / "changing"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir()
    for name in ("a.txt", "b.txt"):
        (data / name).write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 99))
    encode = Tokenizer.encode

    def rewrite_then_encode(self, texts):  # after a.txt is read, before b.txt is
        (data / "b.txt").write_text("the lazy dog " * 300)
        return encode(self, texts)

    Tokenizer.encode = rewrite_then_encode
    try:
        run = cli("--steps", "2", *SMALL, "--data", str(data), "--tokenizer",
                  str(_tokenizer_dir()))
    finally:
        Tokenizer.encode = encode
    stored = list((data / ".gtp_jax_tokens").glob("*.tokens"))
    if run.code == 0 or stored:
        return WRONG, f"exit {run.code}, token files stored: {[p.name for p in stored]}"
    return expect_error(run, "--data")


def _race(directory: str, start, results, done) -> None:
    import gtp_jax.train.lifecycle.lock as lock_module  # noqa: PLC0415

    check = lock_module.lock_is_stale
    lock_module.lock_is_stale = lambda holder: (time.sleep(0.02), check(holder))[1]
    start.wait()
    try:
        lock_module.DirectoryLock(directory).acquire()
    except lock_module.CheckpointLockedError:
        results.put("refused")
        return
    results.put("held")
    done.wait(30)


def _lock_race() -> tuple[str, str]:
    import multiprocessing  # noqa: PLC0415

    ctx = multiprocessing.get_context("fork")  # the starters run only the lock's code
    for trial in range(10):
        d = WORK / f"race{trial}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        (d / ".gtp_jax.lock").write_text(json.dumps({"pid": 2**22 + 12345, "host": host}))
        start, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
        ps = [ctx.Process(target=_race, args=(str(d), start, results, done)) for _ in range(6)]
        for p in ps:
            p.start()
        start.set()
        try:
            held = sum(results.get(timeout=60) == "held" for _ in ps)
        finally:
            done.set()
            for p in ps:
                p.join(30)
        if held != 1:
            return WRONG, f"trial {trial}: {held} holders of the lock (6 starters)"
    return OK, "10 trials of 6 starters on a dead holder's lock: one holder each"


def _used_log_dir(*extra: str) -> tuple[str, str]:
    logs = WORK / f"logs{time.monotonic_ns()}"
    first = cli("--steps", "2", *SMALL, "--log-dir", str(logs), "--log-every", "1")
    if first.code != 0:
        return expect_ok(first)
    before = (logs / "metrics.jsonl").read_text()
    run = cli("--steps", "2", *SMALL, "--log-dir", str(logs), *extra)
    if run.code == 0 or (logs / "metrics.jsonl").read_text() != before:
        return WRONG, "a second run appended to the first run's metrics.jsonl"
    return expect_error(run, "--log-dir")


def _strict_json(path: Path) -> list[dict]:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} in {path.name}")
    return [json.loads(x, parse_constant=refuse) for x in path.read_text().splitlines()]


def _log_after_resume() -> tuple[str, str]:
    d, logs = fresh_copy("logres"), WORK / "logres_logs"
    shutil.rmtree(logs, ignore_errors=True)
    flags = ["--steps", "6", *SMALL, "--checkpoint-dir", str(d), "--resume", "--log-dir",
             str(logs), "--log-every", "1"]
    run = cli(*flags)
    if run.code != 0:
        return expect_ok(run)
    shutil.rmtree(d / "6")  # killed after logging steps 5-6, before step 6 was saved
    run = cli(*flags)
    try:
        steps = [r["step"] for r in _strict_json(logs / "metrics.jsonl")]
    except ValueError as e:
        return WRONG, f"metrics.jsonl is not JSON: {e}"
    return expect_ok(run, lambda: None if steps == [5, 6] else f"logged steps {steps}")


def _nan_in_metrics() -> tuple[str, str]:
    from gtp_jax.train.outputs.metrics_log import MetricsLog  # noqa: PLC0415

    logs = WORK / "nanlog"
    shutil.rmtree(logs, ignore_errors=True)
    log = MetricsLog(str(logs), log_every=1, last_step=2, tensorboard=False)
    log.write(1, loss=1.0, step_s=0.1, tokens=8, grad_norm=float("nan"))
    log.close()
    try:
        (record,) = _strict_json(logs / "metrics.jsonl")
    except ValueError as e:
        return WRONG, f"metrics.jsonl is not JSON: {e}"
    return OK, json.dumps(record)[:120]


def _no_checksums() -> tuple[str, str]:
    d = fresh_copy("nosum")
    meta_path = d / "4" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    del meta["checksums"]
    meta_path.write_text(json.dumps(meta))
    m = WORK / "nosum.json"
    m.unlink(missing_ok=True)
    run = cli("--steps", "6", *SMALL, "--checkpoint-dir", str(d), "--resume",
              "--metrics-json", str(m))
    if run.code == 0 and "checksums" not in run.err:
        return WRONG, "restored step 4 without verifying it (its checksums were gone)"
    return expect_ok(run, lambda: same_losses(losses(m), REF6, 0.0))


def _requeue_only_damaged() -> tuple[str, str]:
    d = fresh_copy("onlydmg")
    shutil.rmtree(d / "2")
    meta_path = d / "4" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["checksums"] = {k: "0" * 16 for k in meta["checksums"]}  # every array fails
    meta_path.write_text(json.dumps(meta))
    m = WORK / "onlydmg.json"
    m.unlink(missing_ok=True)
    run = cli("--steps", "4", *SMALL, "--checkpoint-dir", str(d), "--resume", "auto",
              "--metrics-json", str(m))
    said = [x for x in run.err.splitlines() if "starting a new run from step 0" in x]
    if run.code == 0 and len(said) != 1:
        return CONFUSING, "started over without saying so in one line"
    return expect_ok(run, lambda: same_losses(losses(m), REF6, 0.0)
                     or (None if (d / "broken-4-0").is_dir() else "damaged step not kept"))


add("safety", "data file rewritten while it is tokenized", _data_rewritten_while_tokenized)
add("safety", "6 runs start together on a dead holder's lock", _lock_race)
add("safety", "new run on a used --log-dir", lambda: _used_log_dir())
add("safety", "run with other checkpoints on a used --log-dir", lambda: _used_log_dir(
    "--checkpoint-dir", str(WORK / f"k{time.monotonic_ns()}")))
add("safety", "resume after a crash past the checkpoint: each step logged once",
    _log_after_resume)
add("safety", "NaN grad norm in metrics.jsonl is valid JSON", _nan_in_metrics)
add("safety", "checkpoint metadata without checksums", _no_checksums)
add("safety", "--resume auto, the only checkpoint damaged", _requeue_only_damaged)


# ---- multi-process
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _procs(flags_per_proc: list[list[str]], timeout: float = 240) -> list[tuple[int, str]]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    ps = [subprocess.Popen([sys.executable, "-m", "gtp_jax", "train", *f], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          for f in flags_per_proc]
    out = []
    for p in ps:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            text += "\n<timed out>"
        out.append((p.returncode, text))
    return out


def _mp_clean() -> tuple[str, str]:
    port = _free_port()
    res = _procs([["--steps", "3", *SMALL, "--coordinator", f"localhost:{port}",
                   "--num-processes", "2", "--process-id", str(i)] for i in range(2)])
    if any(code != 0 for code, _ in res):
        return WRONG, f"exit codes {[c for c, _ in res]}: {res[0][1][-200:]}"
    bad = [BAD_TEXT.search(text) for _, text in res]
    if any(bad):
        return CONFUSING, "error text on success: " + ", ".join(b.group(0) for b in bad if b)
    gloo = sum(text.count("[Gloo]") for _, text in res)
    if gloo:
        return CONFUSING, f"{gloo} gloo connection lines in the output"
    return OK, "both exit 0, no error text, no gloo lines"


def _mp_missing_peer() -> tuple[str, str]:
    port = _free_port()
    (code, text), = _procs([["--steps", "2", *SMALL, "--coordinator", f"localhost:{port}",
                             "--num-processes", "2", "--process-id", "0",
                             "--distributed-timeout", "5"]], timeout=90)
    lines = [x for x in text.splitlines() if x.startswith("error:")]
    if code == 0:
        return WRONG, "exit 0 without its peer"
    if len(lines) == 1 and "1" in lines[0] and "Traceback" not in text:
        return OK, lines[0][:140]
    return CONFUSING, f"exit {code}: {text.strip()[-160:]}"


#: What the survivor of a lost process must not print: an abort stack, a traceback, the
#: runtime's log lines (``F1128 12:11:06.254683 24922 client.h:80] ...``), gloo's lines.
_NOISE = re.compile(r"Check failure|Traceback|^[IWEF]\d{4} \d\d:\d\d|\[Gloo\]|^terminate called",
                    re.M)


def _mp_killed(victim: int) -> tuple[str, str]:
    """Two processes started one by one (as a cluster scheduler does, no --processes), one
    killed by SIGKILL mid-run: the other must end within 60 s, non-zero, with one line
    naming the lost process and nothing of the runtime's abort."""
    port = _free_port()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    base = ["--steps", "400", *SMALL, "--log-every", "1", "--coordinator", f"localhost:{port}",
            "--num-processes", "2"]
    files = [(WORK / f"mp_kill{victim}_{i}.out", WORK / f"mp_kill{victim}_{i}.err")
             for i in range(2)]
    ps = []
    for i, (out, err) in enumerate(files):
        with open(out, "w") as o, open(err, "w") as e:
            ps.append(subprocess.Popen([sys.executable, "-m", "gtp_jax", "train", *base,
                                        "--process-id", str(i)], env=env, stdout=o, stderr=e))
    survivor = ps[1 - victim]
    try:
        deadline = time.time() + 300
        while " step 2/" not in files[0][1].read_text():
            if time.time() > deadline or any(p.poll() is not None for p in ps):
                return CONFUSING, f"harness: no step 2: {files[0][1].read_text()[-160:]}"
            time.sleep(0.5)
        ps[victim].kill()
        killed = time.time()
        try:
            survivor.wait(timeout=120)
        except subprocess.TimeoutExpired:
            return CONFUSING, f"process {1 - victim} still running 120 s after its peer died"
        took = time.time() - killed
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
            p.wait()
    time.sleep(1)  # the survivor's last line is written as it ends
    text = files[1 - victim][0].read_text() + files[1 - victim][1].read_text()
    lines = [x for x in text.splitlines() if x.startswith("error:")]
    if survivor.returncode == 0:
        return CONFUSING, f"process {1 - victim} finished although its peer died"
    if took > 60:
        return CONFUSING, f"process {1 - victim} ended {took:.0f} s after its peer died"
    noise = _NOISE.findall(text)
    if noise:
        return CONFUSING, f"printed {sorted(set(noise))}"
    if len(lines) == 1 and f"lost process {victim}" in lines[0]:
        return OK, f"{took:.0f} s: {lines[0][:120]}"
    return CONFUSING, f"exit {survivor.returncode}: {text.strip()[-200:]}"


def _gloo_abort_replayed() -> tuple[str, str]:
    """gloo may notice a lost peer first, mid-collective, and abort the survivor from C++
    (a race of the kill cases above): that text, replayed by process 1 of 2 under the
    command line's output guard, must become the one line naming process 0."""
    from gtp_jax.train.processes import output_guard

    child = (
        "import importlib.util, os, sys\n"
        f"spec = importlib.util.spec_from_file_location('guard', {output_guard.__file__!r})\n"
        "guard = sys.modules['guard'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(guard)\n"
        "guard.guard_output(1, 2, heartbeat_timeout=1.0)\n"
        "os.write(2, b\"terminate called after throwing an instance of 'gloo::EnforceNotMet'\\n"
        "  what():  [enforce fail at pair.cc:459] Received data size doesn't match\\n\")\n"
        "os.abort()\n")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=60)
    lines = done.stderr.splitlines()
    if done.returncode != 0 and len(lines) == 1 and lines[0].startswith(
            "error: lost process 0 of 2"):
        return OK, lines[0][:120]
    return CONFUSING, f"exit {done.returncode}: {done.stderr.strip()[-200:]}"


def _launch_refusal(flags: list[str], *names: str) -> tuple[str, str]:
    """A --processes refusal: one line before any process starts, in the user's flags."""
    run = cli("--steps", "2", *flags)
    outcome, detail = expect_error(run, *names)
    typed = set(flags)
    foreign = [f for f in ("--num-processes", "--coordinator", "--process-id")
               if f not in typed and f in run.err]
    if outcome == OK and foreign:
        return CONFUSING, f"names {foreign}, which the user never typed: {detail}"
    return outcome, detail


add("multiprocess", "two processes, clean exit", _mp_clean)
add("multiprocess", "process 0 alone (peer never joins)", _mp_missing_peer)
add("multiprocess", "peer killed (-9) mid-run, processes started by hand",
    lambda: _mp_killed(1))
add("multiprocess", "coordinator killed (-9) mid-run, processes started by hand",
    lambda: _mp_killed(0))
add("multiprocess", "gloo aborts the survivor mid-collective (its text replayed)",
    _gloo_abort_replayed)
add("multiprocess", "--processe 2 --batch 7", lambda: _launch_refusal(
    ["--processe", "2", "--batch", "7"], "--batch", "--processe"))
add("multiprocess", "--processes 3", lambda: _launch_refusal(["--processes", "3"],
                                                             "--processes"))
add("multiprocess", "--processes 2 --batch 7", lambda: _launch_refusal(
    ["--processes", "2", "--batch", "7"], "--batch"))
add("multiprocess", "--processes 2 --tp 3", lambda: _launch_refusal(
    ["--processes", "2", "--tp", "3"], "--tp"))
for flags, names in [
        (["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"],
         ("--process-id",)),
        (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
         ("--coordinator",)),
        (["--coordinator", "localhost:12", "--num-processes", "2"], ("--process-id",)),
        (["--coordinator", "localhost:12", "--num-processes", "3", "--process-id", "0"],
         ("--num-processes",)),
        (["--num-processes", "0", "--coordinator", "localhost:12", "--process-id", "0"],
         ("--num-processes",)),
        (["--distributed-timeout", "0", "--coordinator", "localhost:12", "--num-processes", "2",
          "--process-id", "0"], ("--distributed-timeout",)),
]:
    add("multiprocess", " ".join(flags), lambda flags=flags, names=names: expect_error(
        cli("--steps", "2", *SMALL, *flags), *names))


# ---- the README's guarantees about shard()
class _Lin(nnx.Module):
    def __init__(self, state=None):
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        if state is not None:
            self.st = state

    def __call__(self, x, *rest):
        y = self.lin(x)
        if hasattr(self, "st"):
            self.st[...] += x.shape[0]
        return y


class _Stat(nnx.Variable):
    pass


def _shard_state(var_factory, want: float) -> tuple[str, str]:
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    ref = _Lin(var_factory())
    sm = gtp_jax.shard(_Lin(var_factory()), mesh, gtp_jax.GTPConfig(min_elements=0))
    x = jnp.ones((16, 4))
    ref(x)
    try:
        sm(jax.device_put(x, gtp_jax.data_sharding(mesh, 2)))
    except gtp_jax.UsageError as e:
        msg = " ".join(str(e).split())
        return (OK, msg[:120]) if "'st'" in msg else (CONFUSING, msg[:120])
    got = float(sm.module.st[...])
    if got != float(ref.st[...]):
        return WRONG, f"sharded {got} vs unsharded {float(ref.st[...])}"
    return OK, f"{got} == unsharded"


add("readme", "float counter of a user type (issue example)",
    lambda: _shard_state(lambda: _Stat(jnp.zeros(())), 16.0))
add("readme", "int counter without rule", lambda: _shard_state(
    lambda: _Stat(jnp.zeros((), jnp.int32)), 16.0))
add("readme", "counter with gtp_reduce='sum'", lambda: _shard_state(
    lambda: _Stat(jnp.zeros(()), gtp_reduce="sum"), 16.0))
add("readme", "BatchSum counter (if the type exists)", lambda: _shard_state(
    lambda: getattr(gtp_jax, "BatchSum", _Stat)(jnp.zeros(())), 16.0))


def _shard_call(fn) -> tuple[str, str]:
    mesh = gtp_jax.make_mesh(dp=2, gtp=4)
    return _lib(lambda: fn(mesh, gtp_jax.shard(_Lin(), mesh, gtp_jax.GTPConfig(min_elements=0))))


add("readme", "batch args with different leading dims", lambda: _shard_call(
    lambda mesh, sm: sm(jnp.ones((16, 4)), jnp.ones((8, 4)))))
add("readme", "batch not divisible by data shards", lambda: _shard_call(
    lambda mesh, sm: sm(jnp.ones((12, 4)))))
add("readme", "replicated() of a non-array", lambda: _lib(lambda: gtp_jax.replicated([1, 2])))
add("readme", "nested sharded module", lambda: _lib(lambda: gtp_jax.shard(
    _Nest(gtp_jax.make_mesh(gtp=8)), gtp_jax.make_mesh(gtp=8))))
add("readme", "BatchNorm statistics written in the call", lambda: _lib(lambda: gtp_jax.shard(
    _BN(), gtp_jax.make_mesh(gtp=8), gtp_jax.GTPConfig(min_elements=0))(jnp.ones((8, 4))),
    "batch statistics"))
add("readme", "scalar output", lambda: _lib(lambda: gtp_jax.shard(
    _Scalar(), gtp_jax.make_mesh(gtp=8), gtp_jax.GTPConfig(min_elements=0))(jnp.ones((8, 4)))))
add("readme", "make_mesh with too many devices", lambda: _lib(
    lambda: gtp_jax.make_mesh(dp=4, gtp=4)))
add("readme", "GTPConfig(min_elements=-1)", lambda: _lib(
    lambda: gtp_jax.GTPConfig(min_elements=-1)))


class _Nest(nnx.Module):
    def __init__(self, mesh):
        self.inner = gtp_jax.shard(_Lin(), mesh, gtp_jax.GTPConfig(min_elements=0))


class _BN(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(8, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.bn(self.lin(x))


class _Scalar(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return jnp.mean(self.lin(x))


# ---- exact or refused: what a sharded module does in __call__, and TrainStep's metrics
# Each case of this block was a silent wrong answer or a raw JAX error before: a parameter
# written in __call__, randomness handed to the call, a weight shared with the rest of the
# model, an operation across examples (found by gtp_jax.check_sharded), and TrainStep's aux
# metrics, "lr", evaluation and non-scalar losses.
_EX_CFG = gtp_jax.GTPConfig(min_elements=0)


def _ex_mesh():
    return gtp_jax.make_mesh(dp=2, gtp=4)


def _ex_x(mesh, rows=16, seed=0):
    x = jax.random.normal(jax.random.key(seed), (rows, 4))
    return jax.device_put(x, gtp_jax.data_sharding(mesh, 2))


class _ExCounter(nnx.Module):
    def __init__(self, where="plain"):
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.calls = nnx.Param(jnp.zeros(()))
        self.where = where

    def __call__(self, x):
        if self.where == "jit":
            def count(m):
                m.calls[...] += 1

            nnx.jit(count)(self)
        elif self.where == "kernel":
            self.lin.kernel[...] = self.lin.kernel[...] * 0.5
        else:
            self.calls[...] += 1
        return self.lin(x)


def _ex_param_write(where: str) -> tuple[str, str]:
    mesh = _ex_mesh()
    ref = _ExCounter(where)
    sm = gtp_jax.shard(_ExCounter(where), mesh, _EX_CFG)
    x = _ex_x(mesh)
    try:
        for _ in range(2):
            nnx.jit(lambda m, x: m(x))(sm, x)
    except gtp_jax.UsageError as e:
        msg = " ".join(str(e).split())
        return (OK, msg[:120]) if "__call__" in msg else (CONFUSING, msg[:120])
    for _ in range(2):
        ref(np.asarray(x))
    got, want = float(sm.module.calls[...]), float(ref.calls[...])
    if got != want:
        return WRONG, f"accepted: calls {got} vs unsharded {want}"
    kernel = np.asarray(gtp_jax.unshard(sm).lin.kernel[...])
    if not np.allclose(kernel, np.asarray(ref.lin.kernel[...])):
        return WRONG, "accepted: the kernel written in __call__ kept its old value"
    return OK, "same as unsharded"


add("exact", "nnx.Param counter written in __call__", lambda: _ex_param_write("plain"))
add("exact", "nnx.Param written inside nnx.jit in __call__", lambda: _ex_param_write("jit"))
add("exact", "kernel scaled in __call__ (weight decay in the forward)",
    lambda: _ex_param_write("kernel"))


class _ExDrop(nnx.Module):
    def __init__(self, held=False):
        self.lin = nnx.Linear(4, 64, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1) if held else None)

    def __call__(self, x, rngs=None, key=None):
        h = jnp.ones_like(self.lin(x))
        if key is not None:
            return h * jax.random.bernoulli(key, 0.5, h.shape)
        return self.drop(h, rngs=rngs)


def _ex_randomness(make_kwargs) -> tuple[str, str]:
    mesh = _ex_mesh()
    sm = gtp_jax.shard(_ExDrop(), mesh, _EX_CFG)
    try:
        out = np.asarray(sm(_ex_x(mesh), **make_kwargs()))
    except gtp_jax.UsageError as e:
        msg = " ".join(str(e).split())
        return (OK, msg[:120]) if "random bits" in msg else (CONFUSING, msg[:120])
    masks = {tuple(row.tolist()) for row in (out[::2] != 0)}  # one row per data shard
    return WRONG, f"accepted: {len(masks)} distinct masks over 8 data shards"


add("exact", "nnx.Rngs handed to __call__ (dropout)", lambda: _ex_randomness(
    lambda: {"rngs": nnx.Rngs(dropout=1)}))
add("exact", "nnx.RngStream handed to __call__", lambda: _ex_randomness(
    lambda: {"rngs": nnx.Rngs(dropout=1).dropout}))
add("exact", "scalar jax.random.key handed to __call__", lambda: _ex_randomness(
    lambda: {"key": jax.random.key(1)}))
add("exact", "replicated keys handed to __call__", lambda: _ex_randomness(
    lambda: {"key": gtp_jax.replicated(jax.random.split(jax.random.key(1), 16))}))


def _ex_held_rngs() -> tuple[str, str]:
    mesh = _ex_mesh()
    out = np.asarray(gtp_jax.shard(_ExDrop(held=True), mesh, _EX_CFG)(_ex_x(mesh)))
    masks = {tuple(row.tolist()) for row in (out[::2] != 0)}
    return (OK, "a mask per data shard") if len(masks) == 8 else (
        WRONG, f"{len(masks)} distinct masks over 8 data shards")


add("exact", "nnx.Rngs held by the module (dropout)", _ex_held_rngs)


class _ExHead(nnx.Module):
    def __init__(self, embed):
        self.embed = embed
        self.proj = nnx.Linear(8, 8, rngs=nnx.Rngs(1))

    def __call__(self, h):
        return self.proj(h) @ self.embed.embedding[...].T


class _ExTied(nnx.Module):
    def __init__(self, embed=None, head=None):
        self.embed = nnx.Embed(16, 8, rngs=nnx.Rngs(0)) if embed is None else embed
        self.head = _ExHead(self.embed) if head is None else head

    def __call__(self, tokens):
        return self.head(self.embed(tokens))


def _ex_tied_losses(model, mesh, sharded_input: bool) -> list[float]:
    import optax  # noqa: PLC0415

    from gtp_jax.train import TrainStep  # noqa: PLC0415

    tokens = jax.random.randint(jax.random.key(0), (16, 5), 0, 16)
    if sharded_input:
        tokens = jax.device_put(tokens, gtp_jax.data_sharding(mesh, 2))
    step = TrainStep(model, nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param),
                     lambda m, t: jnp.mean(m(t) ** 2))
    return [float(step(tokens)["loss"]) for _ in range(3)]


def _ex_tie(how: str) -> tuple[str, str]:
    mesh = _ex_mesh()
    want = _ex_tied_losses(_ExTied(), mesh, False)
    try:
        if how == "part":
            model = _ExTied()
            model.head = gtp_jax.shard(model.head, mesh, _EX_CFG)
        elif how == "assembled":
            embed = nnx.Embed(16, 8, rngs=nnx.Rngs(0))
            model = _ExTied(embed, gtp_jax.shard(_ExHead(embed), mesh, _EX_CFG))
        else:
            model = gtp_jax.shard(_ExTied(), mesh, _EX_CFG)
        got = _ex_tied_losses(model, mesh, how == "whole")
    except gtp_jax.UsageError as e:
        msg = " ".join(str(e).split())
        if how == "whole":
            return CONFUSING, f"refused: {msg[:110]}"
        return (OK, msg[:120]) if "shard the module" in msg else (CONFUSING, msg[:120])
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    return (OK, f"losses within {worst:.1e}") if worst < 1e-5 else (
        WRONG, f"accepted: losses {got} vs unsharded {want}")


add("exact", "tied embedding: shard the head only", lambda: _ex_tie("part"))
add("exact", "tied embedding: model assembled after shard", lambda: _ex_tie("assembled"))
add("exact", "tied embedding: shard the whole model (exact)", lambda: _ex_tie("whole"))


class _ExCentered(nnx.Module):
    def __init__(self, center):
        self.up = nnx.Linear(4, 32, rngs=nnx.Rngs(0))
        self.down = nnx.Linear(32, 4, rngs=nnx.Rngs(1))
        self.center = center

    def __call__(self, x):
        h = jax.nn.gelu(self.up(x))
        return self.down(h - h.mean(0) if self.center else h)


def _ex_check(center: bool, gather_dtype=None) -> tuple[str, str]:
    mesh = _ex_mesh()
    cfg = gtp_jax.GTPConfig(min_elements=0, gather_dtype=gather_dtype)
    sm = gtp_jax.shard(_ExCentered(center), mesh, cfg)
    check = getattr(gtp_jax, "check_sharded", None)
    if check is None:
        return (WRONG, "no check: the cross-example op runs per data shard silently") if center \
            else (CONFUSING, "no check to run")
    try:
        report = check(sm, _ex_x(mesh))
    except gtp_jax.UsageError as e:
        msg = " ".join(str(e).split())
        if not center:
            return WRONG, f"false alarm: {msg[:110]}"
        return (OK, msg[:120]) if "across examples" in msg else (CONFUSING, msg[:120])
    return (WRONG, "passed a cross-example op") if center else (OK, str(report)[:120])


add("exact", "h - h.mean(0) found by check_sharded", lambda: _ex_check(True))
add("exact", "h - h.mean(0) found by check_sharded (bf16 gathers)",
    lambda: _ex_check(True, jnp.bfloat16))
add("exact", "exact module passes check_sharded (bf16 gathers)",
    lambda: _ex_check(False, jnp.bfloat16))


def _ex_step(has_aux: bool, loss_fn, tx=None):
    import optax  # noqa: PLC0415

    from gtp_jax.train import TrainStep  # noqa: PLC0415

    mesh = _ex_mesh()
    model = gtp_jax.shard(_ExCentered(False), mesh, _EX_CFG)
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=0.01) if tx is None else tx
    kwargs = {"has_aux": True} if has_aux else {}
    step = TrainStep(model, nnx.Optimizer(model, tx, wrt=nnx.Param), loss_fn, **kwargs)
    return step, _ex_x(mesh)


def _ex_aux() -> tuple[str, str]:
    try:
        step, x = _ex_step(True, lambda m, x: (jnp.mean(m(x) ** 2), {"peak": jnp.max(m(x))}))
        metrics = step(x)
    except TypeError as e:
        return CONFUSING, f"{type(e).__name__}: {' '.join(str(e).split())[:110]}"
    want = {"loss", "grad_norm", "lr", "peak"}
    return (OK, str(sorted(metrics))) if set(metrics) == want else (
        CONFUSING, f"metrics {sorted(metrics)}")


def _ex_lr(tx_name: str) -> tuple[str, str]:
    import optax  # noqa: PLC0415

    tx = optax.multi_transform({"a": optax.inject_hyperparams(optax.adamw)(learning_rate=0.01)},
                               lambda p: jax.tree.map(lambda _: "a", p))
    step, x = _ex_step(False, lambda m, x: jnp.mean(m(x) ** 2), tx)
    metrics = step(x)
    return (OK, f"lr {float(metrics['lr']):g}") if "lr" in metrics else (
        CONFUSING, f"no 'lr' for {tx_name} with an injected learning rate")


def _ex_evaluate() -> tuple[str, str]:
    step, x = _ex_step(False, lambda m, x: jnp.mean(m(x) ** 2))
    try:
        loss = step.evaluate(x)
    except TypeError as e:
        return CONFUSING, f"{type(e).__name__}: {' '.join(str(e).split())[:110]}"
    return (OK, f"held-out loss {float(loss):.4g}") if np.ndim(loss) == 0 else (
        CONFUSING, f"evaluate returned {loss!r}")


def _ex_not_scalar() -> tuple[str, str]:
    step, x = _ex_step(False, lambda m, x: jnp.mean(m(x) ** 2, axis=1))
    return _lib(lambda: step(x), "not a scalar")


def _ex_padded_tx(name: str) -> tuple[str, str]:
    """A 37 x 61 kernel over gtp = 4 is stored 37 x 64: Adafactor / Muon read its shape."""
    import optax  # noqa: PLC0415

    from gtp_jax.train import TrainStep  # noqa: PLC0415

    tx = {"adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=8),
          "muon": optax.contrib.muon(1e-2)}[name]
    model = gtp_jax.shard(nnx.Linear(37, 61, rngs=nnx.Rngs(0)), _ex_mesh(),
                          gtp_jax.GTPConfig(min_elements=0))
    return _lib(lambda: TrainStep(model, nnx.Optimizer(model, tx, wrt=nnx.Param),
                                  lambda m, x: jnp.mean(m(x) ** 2)), "zero-padded", "divides")


class _ExDropout(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))
        self.rows = gtp_jax.BatchSum(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.rows[...] = self.rows[...] + x.shape[0]
        return self.drop(self.lin(x))


def _ex_accum_dropout() -> tuple[str, str]:
    import optax  # noqa: PLC0415

    from gtp_jax.train import TrainStep  # noqa: PLC0415

    mesh = _ex_mesh()
    model = gtp_jax.shard(_ExDropout(), mesh, gtp_jax.GTPConfig(min_elements=0))
    x = jax.device_put(jnp.ones((16, 16)), gtp_jax.data_sharding(mesh, 2))
    try:
        step = TrainStep(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
                         lambda m, x: jnp.mean(m(x) ** 2), grad_accum=2)
        step(x)
        step(x)
        step.sync()
    except Exception as e:  # noqa: BLE001
        return CONFUSING, f"{type(e).__name__}: {' '.join(str(e).split())[:110]}"
    rows = int(model.module.rows.get_value())
    return (OK, f"rows counted {rows}") if rows == 32 else (WRONG, f"rows counted {rows}, not 32")


add("exact", "TrainStep with Adafactor on a zero-padded weight", lambda: _ex_padded_tx(
    "adafactor"))
add("exact", "TrainStep with Muon on a zero-padded weight", lambda: _ex_padded_tx("muon"))
add("exact", "TrainStep grad_accum=2 with dropout and a BatchSum counter", _ex_accum_dropout)
add("exact", "TrainStep has_aux metrics", _ex_aux)
add("exact", "TrainStep 'lr' with multi_transform(inject_hyperparams)", lambda: _ex_lr(
    "multi_transform"))
add("exact", "TrainStep.evaluate with the step's own loss", _ex_evaluate)
add("exact", "TrainStep with a per-example (non-scalar) loss", _ex_not_scalar)


# ---- first hour: stopping, one-line refusals, what a run says, the LR schedule
# (area "first-hour": a stopped run is not published; what printed a traceback, hung or
# flooded the screen is one line; resumes, exports and logs name where; the schedule does
# what the docs say)
FIRST = "first-hour"
#: A child CLI whose tokenizer takes ten minutes (a stop must not wait for it).
_SLOW_TOKENIZER = """
import sys, time
from gtp_jax.data import text
def slow(self, texts):
    print("tokenizing", file=sys.stderr, flush=True)
    time.sleep(600)
text.Tokenizer.encode = slow
from gtp_jax.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def _child(argv: list[str], *, code: str | None = None,
           cwd: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    head = [sys.executable, "-c", code] if code else [sys.executable, "-m", "gtp_jax"]
    return subprocess.Popen([*head, *argv], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _tokenizer(folder: Path) -> Path:
    """A small word-level tokenizer (with an EOS) saved as ``folder/tokenizer.json``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = (WORK / "words.txt")
    words.write_text("the quick brown fox jumps over the lazy dog " * 400)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([words.read_text()],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def _sigterm_mid_run() -> tuple[str, str]:
    d, export = WORK / "fh_stop", WORK / "fh_stop_hf"
    proc = _child(["train", "--steps", "400", *SMALL, "--checkpoint-dir", str(d), "--resume",
                   "auto", "--export-hf", str(export)])
    for line in proc.stderr:
        if " step 5/" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    if proc.returncode == 0:
        return WRONG, "exit 0: `train && upload` would publish the partial run"
    if export.exists():
        return WRONG, "--export-hf written by a stopped run"
    last = (out.strip().splitlines() or [""])[-1]
    if proc.returncode != 75 or "stopped by SIGTERM" not in last:
        return CONFUSING, f"exit {proc.returncode}: {last[:140]}"
    return OK, last[:140]


def _sigterm_while_tokenizing() -> tuple[str, str]:
    data = WORK / "fh_text"
    data.mkdir(exist_ok=True)
    (data / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 200)
    tok = _tokenizer(WORK / "fh_tok")
    proc = _child(["train", "--data", str(data), "--tokenizer", str(tok.parent), "--steps", "2",
                   "--batch", "8", "--seq", "16"], code=_SLOW_TOKENIZER)
    for line in proc.stderr:
        if line.startswith("tokenizing"):
            break
    started = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return WRONG, "still tokenizing 60 s after SIGTERM"
    took = time.time() - started
    if proc.returncode != 75 or "while tokenizing" not in out:
        return CONFUSING, f"exit {proc.returncode} after {took:.0f} s: {out.strip()[-140:]}"
    return OK, f"{took:.1f} s: {out.strip()[:120]}"


def _job_file(text: bytes | str, *flags: str) -> Run:
    jobs = WORK / f"fh_job{time.monotonic_ns()}"
    jobs.mkdir()
    (jobs / "job.toml").write_bytes(text if isinstance(text, bytes) else text.encode())
    return Run(["train", "--config", str(jobs / "job.toml"), *flags])


def _job_paths_from_elsewhere() -> tuple[str, str]:
    jobs, elsewhere = WORK / "fh_jobs", WORK / "fh_elsewhere"
    jobs.mkdir(exist_ok=True)
    elsewhere.mkdir(exist_ok=True)
    (jobs / "job.toml").write_text('steps = 2\nbatch = 8\nseq = 32\nwarmup = 1\n'
                                   'checkpoint-dir = "ck"\nresume = "auto"\n')
    here = os.getcwd()
    try:
        os.chdir(jobs)
        first = Run(["train", "--config", "job.toml"])
        os.chdir(elsewhere)
        again = Run(["train", "--config", str(jobs / "job.toml")])
    finally:
        os.chdir(here)
    if first.code != 0:
        return expect_ok(first)
    if "is finished" not in again.out:
        return WRONG, f"the requeue from another folder did not find the run: {again.out[-140:]}"
    return OK, again.out.strip()[:140]


def _ctrl_c_while_planning() -> tuple[str, str]:
    from gtp_jax.train.cli.command import main as train_main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = train_main(["train", "--plan", "auto", "--steps", "2", *SMALL],
                              planner=interrupted)
        except KeyboardInterrupt:
            return WRONG, "traceback KeyboardInterrupt"
    lines = err.getvalue().strip().splitlines()
    if code == 130 and len(lines) == 1:
        return OK, lines[0][:140]
    return CONFUSING, f"exit {code}: {err.getvalue()[-140:]}"


def _plan(*argv: str) -> Run:
    from gtp_jax.__main__ import main as top_main

    run = Run.__new__(Run)
    out, err = io.StringIO(), io.StringIO()
    run.exc = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run.code = top_main(["plan", *argv])
        except SystemExit as e:
            run.code = e.code if isinstance(e.code, int) else 2
        except BaseException as e:  # noqa: BLE001 - a traceback reaching the user
            run.code, run.exc = None, f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    run.out, run.err = out.getvalue(), err.getvalue()
    return run


def _timed(fn: Callable[[], tuple[str, str]], limit: float) -> tuple[str, str]:
    started = time.time()
    outcome, detail = fn()
    took = time.time() - started
    if outcome == OK and took > limit:
        return CONFUSING, f"took {took:.0f} s: {detail}"
    return outcome, detail


def _full_disk() -> tuple[str, str]:
    import gtp_jax.train.lifecycle.checkpoint as checkpoint_module

    real, calls = shutil.disk_usage, []

    def filling(path):
        calls.append(path)
        usage = real(path)
        return usage._replace(free=usage.free if len(calls) < 3 else 1 << 20)

    d = WORK / "fh_full"
    checkpoint_module.shutil.disk_usage = filling
    try:
        run = cli("--steps", "4", *SMALL, "--checkpoint-dir", str(d), "--checkpoint-every", "1")
    finally:
        checkpoint_module.shutil.disk_usage = real
    kept = sorted(p.name for p in d.iterdir() if p.name.isdigit()) if d.exists() else []
    outcome, detail = expect_error(run, "--checkpoint-dir", code=1)
    if outcome == OK and kept != ["1", "2"]:
        return WRONG, f"older checkpoints not kept: {kept}"
    return outcome, detail


def _fp8_toggle(*flags: str) -> tuple[str, str]:
    d = fresh_copy("fh_fp8")
    fp8 = ["--fp8-compute", "delayed", "--fp8-min-features", "16"]
    run = cli("--steps", "6", *SMALL, "--checkpoint-dir", str(d), "--resume", *fp8, *flags)
    if run.code == 0 and ("skipping" in run.err or any(p.name.startswith("broken")
                                                       for p in d.iterdir())):
        return WRONG, "the newest checkpoint was set aside as damaged"
    if run.code == 0 and "resumed from" not in run.out:
        return CONFUSING, "did not say where it resumed from"
    return expect_ok(run)


def _fp8_warm_start() -> tuple[str, str]:
    return expect_ok(cli("--steps", "2", *SMALL, "--init-from", str(BASE), "--fp8-compute",
                         "delayed", "--fp8-min-features", "16"))


def _says_where() -> tuple[str, str]:
    d, export, logs = fresh_copy("fh_where"), WORK / "fh_where_hf", WORK / "fh_where_logs"
    run = cli("--steps", "6", *SMALL, "--checkpoint-dir", str(d), "--resume", "--export-hf",
              str(export), "--log-dir", str(logs))
    if run.code != 0:
        return expect_ok(run)
    missing = [what for what, text in (
        ("resumed from", f"resumed from {d / '4'} (step 4 of 6)"),
        ("export", f"Hugging Face export: {export}"),
        ("log", f"metrics log: {logs / 'metrics.jsonl'}")) if text not in run.out]
    if missing:
        return CONFUSING, f"does not name: {missing}"
    modes = {p.name: p.stat().st_mode & 0o777 for p in export.iterdir()}
    if len(set(modes.values())) != 1:
        return WRONG, f"exported files' permissions differ: {modes}"
    return OK, f"named where it resumed, exported and logged; files {oct(modes['config.json'])}"


def _tokenizer_file() -> tuple[str, str]:
    data = WORK / "fh_text2"
    data.mkdir(exist_ok=True)
    (data / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 200)
    tok = _tokenizer(WORK / "fh_tok2")
    return expect_ok(cli("--data", str(data), "--tokenizer", str(tok), "--steps", "2",
                         "--batch", "8", "--seq", "16"))


def _schedule_extension() -> tuple[str, str]:
    d = WORK / "fh_sched"
    lrs: dict[int, float] = {}
    for steps in (6, 12):
        logs = WORK / f"fh_sched_logs{steps}"
        run = cli("--steps", str(steps), "--batch", "8", "--seq", "32", "--checkpoint-dir",
                  str(d), "--resume", "auto", "--log-dir", str(logs), "--log-every", "1")
        if run.code != 0:
            return expect_ok(run)
        lrs.update({r["step"]: r["lr"] for r in map(
            json.loads, (logs / "metrics.jsonl").read_text().splitlines())})
    if lrs.get(1, 0) <= 0:
        return WRONG, "step 1 trained at lr 0"
    added = [lrs[k] for k in range(7, 13)]
    if any(abs(v - 3e-4) > 1e-9 for v in added):
        return WRONG, f"added steps 7-12 not at 10% of --lr: {[f'{v:.2e}' for v in added]}"
    return OK, f"step 1 at {lrs[1]:.2e}, steps 6-12 at {lrs[6]:.1e}"


add(FIRST, "SIGTERM at step 5 of 400 with --export-hf", _sigterm_mid_run)
add(FIRST, "SIGTERM while tokenizing", _sigterm_while_tokenizing)
add(FIRST, "job file not UTF-8", lambda: expect_error(_job_file(b"steps = 2\n# caf\xe9\n"),
                                                      "--config"))
add(FIRST, "job file: relative checkpoint-dir, requeued from another folder",
    _job_paths_from_elsewhere)
add(FIRST, "job file: resume = true", lambda: expect_ok(_job_file(
    f'steps = 6\nbatch = 8\nseq = 32\nwarmup = 1\ncheckpoint-dir = "{fresh_copy("fh_rt")}"\n'
    "resume = true\n")))
add(FIRST, "--offload-exclude '('", lambda: expect_error(
    cli("--steps", "2", *SMALL, "--offload-optimizer", "--offload-exclude", "("),
    "--offload-exclude"))
add(FIRST, "--checkpoint-dir file:///...", lambda: expect_ok(
    cli("--steps", "2", *SMALL, "--checkpoint-dir", f"file://{WORK}/fh_url_ck"),
    lambda: None if (WORK / "fh_url_ck" / "2").is_dir() else "not saved at the local path"))
add(FIRST, "--checkpoint-dir http://...", lambda: expect_error(
    cli("--steps", "2", *SMALL, "--checkpoint-dir", "http://host/ck"), "--checkpoint-dir"))
add(FIRST, "--log-dir gs://...", lambda: expect_error(
    cli("--steps", "2", *SMALL, "--log-dir", "gs://bucket/logs"), "--log-dir"))
add(FIRST, "Ctrl-C during --plan auto", _ctrl_c_while_planning)
add(FIRST, "full disk at the third save", _full_disk)
add(FIRST, "plan --gpus 1000000000", lambda: _timed(
    lambda: expect_error(_plan("--gpus", "1000000000"), "--gpus"), 10))
add(FIRST, "plan --seq 100000000", lambda: _timed(
    lambda: expect_error(_plan("--seq", "100000000"), "--seq"), 30))
add(FIRST, "plan --batch 1000000000", lambda: _timed(
    lambda: expect_error(_plan("--batch", "1000000000"), "--batch"), 30))
add(FIRST, "plan --json DIR", lambda: _timed(
    lambda: expect_error(_plan("--json", str(WORK)), "--json"), 10))
add(FIRST, "train --gtp 1000000", lambda: _timed(
    lambda: expect_error(cli("--gtp", "1000000"), "--gtp"), 10))
add(FIRST, "--lr abc", lambda: expect_error(cli("--lr", "abc"), "--lr"))
add(FIRST, "resume toggling --fp8-compute delayed", lambda: _fp8_toggle())
add(FIRST, "--init-from with --fp8-compute delayed", _fp8_warm_start)
add(FIRST, "resume names where; export and log dir named; export permissions", _says_where)
add(FIRST, "--tokenizer given the tokenizer.json file", _tokenizer_file)
add(FIRST, "6-step run extended to 12: lr of step 1 and of the added steps",
    _schedule_extension)
add(FIRST, "--steps 6 --warmup 10", lambda: expect_error(
    cli("--steps", "6", "--batch", "8", "--seq", "32", "--warmup", "10"), "--warmup"))


# ---- inputs read as given: flags spelled in full, Hugging Face checkpoints whose every
# config key is understood and whose files lie in their folder, an export that owns its
# weight files, one line that names the real mistake (area "inputs")
INPUTS = "inputs"
HF_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "hf"


def _abbreviated(*argv: str) -> tuple[str, str]:
    """A flag typed as a prefix of a real one that part of the command line reads as typed
    (the job file's --config, the launcher's --processes): refused, naming the full flag
    (argparse took it for the flag, and the part that reads it never saw it)."""
    jobs = WORK / f"in_job{time.monotonic_ns()}"
    jobs.mkdir()
    (jobs / "job.toml").write_text("seed = 7\nlr = 0.01\n")
    argv = tuple(str(jobs / "job.toml") if a == "JOB" else a for a in argv)
    full = {"--conf": "--config", "--processe": "--processes"}
    return expect_error(cli("--steps", "2", *SMALL, *argv),
                        *(full[a] for a in argv if a in full))


add(INPUTS, "train --conf job.toml (the job file unread)",
    lambda: _abbreviated("--conf", "JOB"))
add(INPUTS, "train --processe 2", lambda: _abbreviated("--processe", "2"))


def _hf_copy(name: str = "llama_gqa_llama3") -> Path:
    dst = WORK / f"in_hf{time.monotonic_ns()}"
    shutil.copytree(HF_DATA / name, dst)
    return dst


def _hf_config(**changes) -> tuple[str, str]:
    """`from_hf` of a checkpoint whose config.json has `changes`: one line naming the key
    (a raw KeyError, or a silent import of another model, before). The tiny fixture's
    vocabulary is below the bundled corpus's, so the command line refuses it for that."""
    folder = _hf_copy()
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return _lib(lambda: gtp_jax.models.from_hf(str(folder)),
                *[k for k in changes if k != "rope_parameters"], "low_freq_factor")


add(INPUTS, "HF config partial_rotary_factor=0.5",
    lambda: _hf_config(partial_rotary_factor=0.5))
add(INPUTS, "HF config quantization_config (bitsandbytes)",
    lambda: _hf_config(quantization_config={"quant_method": "bitsandbytes",
                                            "load_in_4bit": True}))
add(INPUTS, "HF rope_scaling llama3 without low_freq_factor", lambda: _hf_config(
    rope_parameters={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 16, "rope_theta": 10000.0}))


def _hf_index_outside(name: str) -> tuple[str, str]:
    folder = _hf_copy("mistral_gqa_sharded")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(index["weight_map"])[0]
    outside = WORK / "in_outside.safetensors"
    shutil.copy(folder / index["weight_map"][first], outside)
    index["weight_map"][first] = str(outside) if name == "ABS" else name
    index_path.write_text(json.dumps(index))
    return _lib(lambda: gtp_jax.models.from_hf(str(folder)), repr(first), "outside")


add(INPUTS, "HF index naming ../x.safetensors",
    lambda: _hf_index_outside("../in_outside.safetensors"))
add(INPUTS, "HF index naming an absolute path", lambda: _hf_index_outside("ABS"))


def _hf_export_over_older() -> tuple[str, str]:
    """A sharded export into a folder holding an older single-file export: transformers
    reads model.safetensors before the index, so it must not be left there."""
    from gtp_jax.models import Transformer, from_hf, preset, to_hf

    folder = WORK / "in_export"
    shutil.rmtree(folder, ignore_errors=True)
    to_hf(Transformer(preset("tiny", n_kv_heads=2), rngs=nnx.Rngs(9)), str(folder))
    model = from_hf(str(HF_DATA / "llama_gqa_llama3"))
    (folder / "notes.txt").write_text("mine")
    to_hf(model, str(folder), max_shard_bytes=20_000)
    names = sorted(p.name for p in folder.iterdir())
    if "model.safetensors" in names:
        return WRONG, "the older model.safetensors is left beside the new shards and index"
    if "notes.txt" not in names:
        return WRONG, "a file of the user's was removed"
    return OK, f"{len(names)} files: the new shards, index, config.json, notes.txt"


add(INPUTS, "sharded HF export over an older model.safetensors", _hf_export_over_older)


def _missing_data_first() -> tuple[str, str]:
    return expect_error(cli("--steps", "2", *SMALL, "--data", str(WORK / "missing.txt")),
                        "missing.txt")


def _one_flag_needs_data() -> tuple[str, str]:
    outcome, detail = expect_error(cli("--steps", "2", *SMALL, "--tokenizer", "x"), "--data")
    if outcome == OK and "--tokenizer needs --data" not in detail:
        return CONFUSING, detail
    return outcome, detail


add(INPUTS, "--data missing.txt without --tokenizer", _missing_data_first)
add(INPUTS, "--tokenizer without --data (the message's grammar)", _one_flag_needs_data)


def _no_header_before_refusal() -> tuple[str, str]:
    run = cli("--steps", "2", *SMALL, "--fp8-compute", "tensorwise", "--fp8-min-features",
              "16", "--tp", "2", "--dp", "2", "--gtp", "2")
    outcome, detail = expect_error(run, "--fp8-compute", "tp")
    if outcome == OK and run.out.strip():
        return CONFUSING, f"printed before the refusal: {run.out.strip().splitlines()[0][:100]}"
    return outcome, detail


add(INPUTS, "--fp8-compute with --tp 2: refusal without a header first",
    _no_header_before_refusal)


def _folder_of_the_user() -> tuple[str, str]:
    d = fresh_copy("in_userdir")
    for name in ("100", "3"):
        (d / name).mkdir()
        (d / name / "notes.txt").write_text("mine")
    run = cli("--steps", "6", *SMALL, "--checkpoint-dir", str(d), "--resume",
              "--checkpoint-every", "1", "--keep-checkpoints", "1")
    if run.code != 0:
        return expect_ok(run)
    kept = [n for n in ("100", "3") if (d / n / "notes.txt").is_file()]
    if len(kept) != 2:
        return WRONG, f"the user's folders {sorted({'100', '3'} - set(kept))} were renamed " \
                      "or deleted"
    said = [x for x in run.err.splitlines() if "alone" in x]
    if len(said) != 1:
        return CONFUSING, "left alone without saying so once"
    return OK, said[0][:140]


add(INPUTS, "a folder of the user's inside --checkpoint-dir (ck/100/notes.txt)",
    _folder_of_the_user)


def _reduce_dtype_at_gtp1() -> tuple[str, str]:
    run = cli("--steps", "2", *SMALL, "--reduce-dtype", "bfloat16", "--dp", "8", "--gtp", "1")
    outcome, detail = expect_ok(run)
    if outcome == OK and "reduce-scattered in" in run.out:
        return CONFUSING, "the header says gradients are reduce-scattered at gtp=1"
    return outcome, detail


add(INPUTS, "--reduce-dtype bfloat16 at gtp=1: what the header says", _reduce_dtype_at_gtp1)


def _export_moe() -> tuple[str, str]:
    """A mixture of experts with --export-hf: refused before training (it trained, then
    failed after rewriting config.json over an older export)."""
    folder = WORK / "in_export_moe"
    shutil.rmtree(folder, ignore_errors=True)
    run = cli("--steps", "2", *SMALL, "--moe-experts", "4", "--dp", "1", "--ep", "2",
              "--gtp", "4", "--export-hf", str(folder))
    outcome, detail = expect_error(run, "--export-hf", "moe")
    if outcome == OK and (folder.exists() or "step" in run.out):
        return WRONG, "trained or wrote before refusing"
    return outcome, detail


def _export_finished() -> tuple[str, str]:
    """A finished run launched again with --export-hf writes its export (it exited 0 and
    wrote nothing)."""
    d = fresh_copy("in_export_finished")
    folder = WORK / "in_export_finished_hf"
    shutil.rmtree(folder, ignore_errors=True)
    run = cli("--steps", "4", *SMALL, "--checkpoint-dir", str(d), "--resume", "auto",
              "--export-hf", str(folder))
    return expect_ok(run, lambda: None if (folder / "model.safetensors").is_file() else
                     "exit 0, but no export was written")


add(INPUTS, "--export-hf with --moe-experts 4", _export_moe)
add(INPUTS, "a finished run launched again with --export-hf", _export_finished)


# ---- what crosses a sharded call unseen: a variable the model holds beside its sharded
# part, randomness made in the call, plain attributes, a raw key, batch statistics
# (area "boundary"; each case trains or calls the way the README shows)
BOUNDARY = "boundary"


class _BdInner(nnx.Module):
    def __init__(self, proj):
        self.proj = proj
        self.up = nnx.Linear(8, 8, rngs=nnx.Rngs(2))

    def __call__(self, h):
        return self.up(self.proj(h))


class _BdPasses(nnx.Module):
    def __init__(self, shard):
        self.proj = nnx.Linear(4, 8, rngs=nnx.Rngs(1))
        inner = _BdInner(self.proj)
        self.inner = gtp_jax.shard(inner, _ex_mesh(), _EX_CFG) if shard else inner

    def __call__(self, x):
        return self.inner(x) + self.proj(x)


class _BdTrunk(nnx.Module):
    def __init__(self):
        self.embed = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.body = nnx.Linear(8, 8, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.body(self.embed(x))


class _BdKeeps(nnx.Module):
    def __init__(self, shard):
        trunk = _BdTrunk()
        self.trunk = gtp_jax.shard(trunk, _ex_mesh(), _EX_CFG) if shard else trunk
        self.emb = trunk.embed

    def __call__(self, x):
        return self.trunk(x) + self.emb(x)


def _bd_readme_losses(model) -> list[float]:
    import optax  # noqa: PLC0415

    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    x = _ex_x(_ex_mesh())
    return [float(step(model, optimizer, x)) for _ in range(3)]


def _bd_shared(make) -> tuple[str, str]:
    want = _bd_readme_losses(make(False))
    try:
        got = _bd_readme_losses(make(True))
    except gtp_jax.UsageError as e:
        msg = " ".join(str(e).split())
        return (OK, msg[:120]) if "shard the module" in msg else (CONFUSING, msg[:120])
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    return (OK, f"losses within {worst:.1e}") if worst < 1e-5 else (
        WRONG, f"accepted: losses {[f'{v:.5f}' for v in got]} vs unsharded "
               f"{[f'{v:.5f}' for v in want]}")


add(BOUNDARY, "Inner(self.proj) sharded, the model also calls self.proj (nnx.jit)",
    lambda: _bd_shared(_BdPasses))
add(BOUNDARY, "self.trunk = shard(t); self.emb = t.embed (nnx.jit)",
    lambda: _bd_shared(_BdKeeps))


class _BdDraw(nnx.Module):
    def __init__(self, how):
        self.lin = nnx.Linear(4, 64, rngs=nnx.Rngs(0))
        self.how = how

    def __call__(self, x, seed=3):
        h = jnp.ones_like(self.lin(x))
        key = {"int": lambda: jax.random.key(seed), "constant": lambda: jax.random.key(0),
               "raw": lambda: jax.random.PRNGKey(0)}[self.how]()
        return h * jax.random.bernoulli(key, 0.5, h.shape)


def _bd_draw(how: str) -> tuple[str, str]:
    mesh = _ex_mesh()
    try:
        out = np.asarray(nnx.jit(lambda m, x: m(x))(
            gtp_jax.shard(_BdDraw(how), mesh, _EX_CFG), _ex_x(mesh)))
    except gtp_jax.UsageError as e:
        msg = " ".join(str(e).split())
        return (OK, msg[:120]) if "same on every data shard" in msg else (CONFUSING, msg[:120])
    masks = {tuple(row.tolist()) for row in (out != 0)}
    return WRONG, f"accepted: {len(masks)} distinct masks over 16 rows (16 unsharded)"


add(BOUNDARY, "jax.random.key(seed) from a Python int in __call__", lambda: _bd_draw("int"))
add(BOUNDARY, "jax.random.key(0) in __call__", lambda: _bd_draw("constant"))
add(BOUNDARY, "jax.random.PRNGKey(0) in __call__", lambda: _bd_draw("raw"))


class _BdCalls(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return self.lin(x)


def _bd_attribute() -> tuple[str, str]:
    mesh = _ex_mesh()
    sm = gtp_jax.shard(_BdCalls(), mesh, _EX_CFG)
    try:
        for _ in range(2):
            nnx.jit(lambda m, x: m(x))(sm, _ex_x(mesh))
    except gtp_jax.UsageError as e:
        msg = " ".join(str(e).split())
        return (OK, msg[:120]) if "'calls'" in msg else (CONFUSING, msg[:120])
    return (OK, "carried: 2 calls") if sm.module.calls == 2 else (
        CONFUSING, f"self.calls += 1 lost without a word: {sm.module.calls} after 2 calls "
                   "(2 unsharded)")


add(BOUNDARY, "self.calls += 1 in __call__ (nnx.jit)", _bd_attribute)


def _bd_raw_key_argument() -> tuple[str, str]:
    mesh = _ex_mesh()
    sm = gtp_jax.shard(_ExDrop(), mesh, _EX_CFG)
    try:
        sm(_ex_x(mesh), key=jax.random.PRNGKey(1))
    except gtp_jax.UsageError as e:
        msg = " ".join(str(e).split())
        return (OK, msg[:120]) if "typed key" in msg else (CONFUSING, msg[:120])
    return WRONG, "accepted"


add(BOUNDARY, "raw uint32 key argument", _bd_raw_key_argument)


class _BdNorm(nnx.Module):
    def __init__(self, running):
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(8, use_running_average=running, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.bn(self.lin(x))


def _bd_batch_norm(running: bool) -> tuple[str, str]:
    mesh = _ex_mesh()
    x = _ex_x(mesh)
    try:
        sm = gtp_jax.shard(_BdNorm(running), mesh, _EX_CFG)
        got = np.asarray(sm(x))
    except gtp_jax.UsageError as e:
        msg = " ".join(str(e).split())
        if running:
            return CONFUSING, f"refused, though it writes nothing: {msg[:100]}"
        return (OK, msg[:120]) if "batch statistics" in msg else (CONFUSING, msg[:120])
    if not running:
        return WRONG, "accepted: batch statistics computed per data shard"
    err = float(np.max(np.abs(got - np.asarray(_BdNorm(True)(np.asarray(x))))))
    return (OK, f"max |diff| {err:.1e}") if err < 1e-5 else (WRONG, f"max |diff| {err:.1e}")


add(BOUNDARY, "BatchNorm(use_running_average=True)", lambda: _bd_batch_norm(True))
add(BOUNDARY, "BatchNorm in training mode", lambda: _bd_batch_norm(False))


def _bd_explicit_mesh() -> tuple[str, str]:
    explicit = jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((2, 4), ("dp", "gtp"), axis_types=(explicit, explicit))
    x = jax.random.normal(jax.random.key(0), (16, 37))
    sm = gtp_jax.shard(nnx.Linear(37, 61, rngs=nnx.Rngs(0)), mesh,
                       gtp_jax.GTPConfig(min_elements=0))
    try:
        err = float(jnp.max(jnp.abs(sm(x) - nnx.Linear(37, 61, rngs=nnx.Rngs(0))(x))))
    except Exception as e:  # noqa: BLE001
        return CONFUSING, f"{type(e).__name__}: {' '.join(str(e).split())[:110]}"
    return (OK, f"max difference {err:.1e}") if err < 1e-5 else (WRONG, f"differs by {err}")


def _bd_update_unsharded() -> tuple[str, str]:
    sm = gtp_jax.shard(nnx.Linear(37, 61, rngs=nnx.Rngs(0)), _ex_mesh(),
                       gtp_jax.GTPConfig(min_elements=0))
    nnx.update(sm.module, nnx.state(nnx.Linear(37, 61, rngs=nnx.Rngs(7))))
    return _lib(lambda: sm(jnp.ones((16, 37))), "nnx.update", "unshard")


def _bd_update_unsharded_jitted() -> tuple[str, str]:
    sm = gtp_jax.shard(nnx.Linear(40, 64, rngs=nnx.Rngs(0)), _ex_mesh(),
                       gtp_jax.GTPConfig(min_elements=0))
    nnx.update(sm.module, nnx.state(nnx.Linear(40, 64, rngs=nnx.Rngs(7))))
    return _lib(lambda: nnx.jit(lambda m, x: m(x))(sm, jnp.ones((16, 40))), "nnx.update")


def _bd_decode_cache() -> tuple[str, str]:
    mha = nnx.MultiHeadAttention(num_heads=2, in_features=40, qkv_features=64, decode=True,
                                 rngs=nnx.Rngs(0))
    mha.init_cache((16, 4, 40))
    sm = gtp_jax.shard(mha, _ex_mesh())
    return _lib(lambda: sm(jnp.ones((16, 1, 40))), "nnx.Cache")


class _BdTable(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(37, 61, rngs=nnx.Rngs(0))

    def __call__(self, x, table):
        return self.lin(x) + jnp.take(table, jnp.array([0, 2]), axis=0).sum(0) * table[1]


def _bd_replicated_unsharded() -> tuple[str, str]:
    """The same call, `gtp_jax.replicated(table)`, on the sharded and the unsharded module."""
    x = jax.random.normal(jax.random.key(0), (16, 37))
    table = jax.random.normal(jax.random.key(3), (4, 61))
    sm = gtp_jax.shard(_BdTable(), _ex_mesh(), _EX_CFG)
    try:
        got = [np.asarray(f(x, gtp_jax.replicated(table)))
               for f in (sm, gtp_jax.unshard(sm), _BdTable())]
    except Exception as e:  # noqa: BLE001
        return CONFUSING, f"{type(e).__name__}: {' '.join(str(e).split())[:110]}"
    want = np.asarray(_BdTable()(x, table))
    err = max(float(np.max(np.abs(g - want))) for g in got)
    return (OK, f"max |diff| {err:.1e}") if err < 1e-4 else (WRONG, f"differs by {err}")


def _bd_wrt_first_key() -> tuple[str, str]:
    """A wrt filter that freezes by the first key of the path ('module' comes first inside a
    sharded module): TrainStep must refuse it rather than train the frozen weights."""
    import optax  # noqa: PLC0415

    from gtp_jax.train import TrainStep  # noqa: PLC0415

    sm = gtp_jax.shard(_BdTrunk(), _ex_mesh(), _EX_CFG)
    wrt = nnx.All(nnx.Param, lambda path, v: path[0] != "embed")
    return _lib(lambda: TrainStep(sm, nnx.Optimizer(sm, optax.adamw(1e-2), wrt=wrt),
                                  lambda m, x: jnp.mean(m(x) ** 2)), "wrt filter", "module")


class _BdKeptRow(nnx.Module):
    def __init__(self, rows=1):
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.rows = rows

    def __call__(self, x):
        h = self.lin(x)
        if self.rows == 1:
            return h[:, :1].T  # (1, batch): one row whatever the batch
        return jnp.stack([h.sum(0), h.max(0)])  # (2, 8) whatever the batch


def _bd_kept_row(rows: int = 1) -> tuple[str, str]:
    """An output as long as the examples per data shard by chance (a (1, n) output at one
    example per shard, two stacked summaries at two): refused, not concatenated."""
    sm = gtp_jax.shard(_BdKeptRow(rows), _ex_mesh(), _EX_CFG)
    x = _ex_x(_ex_mesh(), rows=8 * rows)
    try:
        got = sm(x)
    except gtp_jax.UsageError as e:
        return OK, " ".join(str(e).split())[:120]
    except Exception as e:  # noqa: BLE001
        return CONFUSING, f"{type(e).__name__}: {' '.join(str(e).split())[:110]}"
    return WRONG, f"sharded {tuple(got.shape)}, unsharded {tuple(_BdKeptRow(rows)(x).shape)}"


add(BOUNDARY, "jax.make_mesh (Explicit axes), an unplaced batch", _bd_explicit_mesh)
add(BOUNDARY, "a (1, batch) output at one example per data shard", _bd_kept_row)
add(BOUNDARY, "a (2, n) output at two examples per data shard", lambda: _bd_kept_row(2))
add(BOUNDARY, "an optimizer's wrt filter on the path's first key (TrainStep)",
    _bd_wrt_first_key)
add(BOUNDARY, "gtp_jax.replicated(x) passed to the unsharded module too",
    _bd_replicated_unsharded)
add(BOUNDARY, "unsharded weights written in with nnx.update", _bd_update_unsharded)
add(BOUNDARY, "unsharded weights (divisible) written in with nnx.update, called under jit",
    _bd_update_unsharded_jitted)
add(BOUNDARY, "Flax's decode cache (MultiHeadAttention(decode=True))", _bd_decode_cache)


# ---- a loop of one's own around Checkpointer, and the planner's command (area "own-loop")
OWN_LOOP = "own-loop"

_ENDS_AFTER_SAVE = """
import sys
from flax import nnx
import gtp_jax
from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig, Checkpointer
model = gtp_jax.shard(nnx.Linear(64, 48, rngs=nnx.Rngs(0)), gtp_jax.make_mesh(dp=2, gtp=4),
                      gtp_jax.GTPConfig(min_elements=1))
ckpt = Checkpointer(CheckpointConfig(sys.argv[1]))
for step in (1, 2):
    ckpt.save(step, model)
"""


def _own_ends_after_save() -> tuple[str, str]:
    """A script whose last line is an asynchronous save, never closed: the save kept."""
    folder = WORK / f"own_end{time.monotonic_ns()}"
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    try:
        proc = subprocess.run([sys.executable, "-c", _ENDS_AFTER_SAVE, str(folder)], env=env,
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return WRONG, "the process hung at exit"
    kept = sorted(os.listdir(folder)) if folder.is_dir() else []
    if proc.returncode == 0 and kept != ["1", "2"]:
        return WRONG, f"exit 0, the folder holds {kept}"
    if proc.returncode != 0 or "Traceback" in proc.stderr:
        return CONFUSING, f"exit {proc.returncode}: {proc.stderr.strip()[-140:]}"
    return OK, "steps [1, 2] finalized"


def _own_new_run_into_old() -> tuple[str, str]:
    """CheckpointConfig(resume=False) saving into an earlier run's checkpoints."""
    from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig, Checkpointer

    folder = WORK / f"own_old{time.monotonic_ns()}"
    model = gtp_jax.shard(nnx.Linear(64, 48, rngs=nnx.Rngs(0)), _ex_mesh(),
                          gtp_jax.GTPConfig(min_elements=1))
    with Checkpointer(CheckpointConfig(str(folder), keep=2)) as ckpt:
        ckpt.save(1, model)
        ckpt.save(2, model)
    with Checkpointer(CheckpointConfig(str(folder), keep=2)) as ckpt:
        try:
            ckpt.save(5, model)
        except gtp_jax.UsageError as e:
            return OK, " ".join(str(e).split())[:120]
        ckpt.wait()
        return WRONG, f"saved; the directory now holds {ckpt.all_steps()}"


def _own_plan_dtype() -> tuple[str, str]:
    """`plan --dtype bfloat16`: the printed train command trains the planned program."""
    from gtp_jax.__main__ import main as package_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = package_main(["plan", "--preset", "tiny", "--gpus", "8", "--seq", "32",
                             "--batch", "8", "--top", "1", "--limit", "2", "--dtype",
                             "bfloat16", "--compile-cache", "off"])
    best = [line for line in out.getvalue().splitlines() if line.startswith("best: ")]
    if code != 0 or not best:
        return CONFUSING, f"exit {code}: {err.getvalue().strip()[-140:]}"
    if "--dtype bfloat16" not in best[0]:
        return WRONG, f"no --dtype in: {best[0][:140]}"
    return OK, best[0][:120]


add(OWN_LOOP, "a script that ends right after an asynchronous save", _own_ends_after_save)
add(OWN_LOOP, "CheckpointConfig(resume=False) saving into an earlier run's checkpoints",
    _own_new_run_into_old)
add(OWN_LOOP, "plan --dtype bfloat16: the printed train command", _own_plan_dtype)


# ---- output a person can read (gloo's lines: "two processes, clean exit" above)
def _ctrl_c_steps() -> tuple[str, str]:
    """Ctrl-C mid-run: how many steps still run, and whether the message said so."""
    proc = _child(["train", "--steps", "400", *SMALL, "--log-every", "1"])
    last = 0
    for line in proc.stderr:
        found = re.search(r" step (\d+)/", line)
        last = int(found.group(1)) if found else last
        if last >= 3:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    said = [x for x in err.splitlines() if "SIGINT received" in x]
    stopped = re.search(r"stopped by SIGINT after step (\d+)", out)
    if stopped is None:
        return CONFUSING, f"exit {proc.returncode}: {out.strip()[-140:]}"
    more = int(stopped.group(1)) - last
    if not said or "at most two more steps" not in said[0]:
        return CONFUSING, f"ran {more} more steps; the message: {(said or [''])[0][:120]}"
    if more > 2:
        return CONFUSING, f"ran {more} more steps after the last one shown; says at most two"
    return OK, f"{more} more step(s): {said[0][:110]}"


def _moe_header() -> tuple[str, str]:
    run = cli("--steps", "2", *SMALL, "--moe-experts", "4")
    if run.code != 0:
        return expect_ok(run)
    if "'dropped' share" not in run.out or "--moe-capacity 0 is dropless" not in run.out:
        return CONFUSING, "the dropped share and --moe-capacity 0 are not explained"
    return OK, next(x for x in run.out.splitlines() if "MoE" in x)[-110:]


def _describe_cpu_mesh() -> tuple[str, str]:
    lines: list[str] = []
    gtp_jax.describe_mesh(gtp_jax.make_mesh(dp=2, gtp=4), print_fn=lines.append)
    gpu = [x for x in lines if "--xla_gpu" in x or "XLA_PJRT_GPU" in x]
    if gpu:
        return CONFUSING, f"lists GPU settings on a CPU mesh: {gpu[0].strip()[:120]}"
    return OK, lines[-1].strip()[:120]


add("output", "Ctrl-C mid-run: steps after it, and the message", _ctrl_c_steps)
add("output", "--moe-experts 4: the dropped share explained", _moe_header)
add("output", "describe_mesh on a CPU mesh", _describe_cpu_mesh)


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--only", default=None, help="run only this area")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    started = time.time()
    make_base()
    rows = []
    for area, name, fn in CASES:
        if args.only and area != args.only:
            continue
        t0 = time.time()
        try:
            outcome, detail = fn()
        except Exception:  # noqa: BLE001 - a harness failure is reported, not hidden
            outcome, detail = CONFUSING, "harness: " + traceback.format_exc(limit=1)[-160:]
        detail = " ".join(detail.split()).replace("|", "/")
        rows.append((area, name, outcome, detail))
        print(f"{outcome:9s} {area:12s} {name}  [{time.time() - t0:.0f}s] {detail[:110]}",
              file=sys.stderr, flush=True)
    counts = {k: sum(r[2] == k for r in rows) for k in (OK, CONFUSING, WRONG)}
    if args.markdown:
        print("| # | area | case | outcome | detail |\n|---|---|---|---|---|")
        for i, (area, name, outcome, detail) in enumerate(rows, 1):
            print(f"| {i} | {area} | `{name}` | {outcome} | {detail[:140]} |")
    else:
        for i, (area, name, outcome, detail) in enumerate(rows, 1):
            print(f"{i:3d} {area:12s} {outcome:9s} {name} :: {detail[:140]}")
    print(f"\n{len(rows)} cases: {counts[OK]} OK, {counts[CONFUSING]} confusing, "
          f"{counts[WRONG]} wrong ({time.time() - started:.0f} s)")
    shutil.rmtree(WORK, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
