"""`python -m gtp_jax train --processes N`: the launcher's supervision, with stand-in child
processes (no training: the multi-process training itself is tests/test_multiprocess.py)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from gtp_jax.train.processes import launch
from gtp_jax.train.processes.launch import child_commands, describe_end, supervise, without_flag

#: A child that runs until told to stop, and stops cleanly on SIGTERM.
WAITS = [sys.executable, "-c",
         "import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
         "time.sleep(120)\n"]
#: A child that ignores SIGTERM (stuck in a collective that will never complete).
STUCK = [sys.executable, "-c",
         "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(120)\n"]


def test_processes_that_all_finish_give_their_status():
    ok = [sys.executable, "-c", "pass"]
    assert supervise([ok, ok], poll=0.05).code == 0
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    assert supervise([failing, failing], poll=0.05).code == 3


def test_a_killed_process_stops_the_others_with_one_line_naming_it():
    lines: list[str] = []
    procs = []

    def popen(cmd):
        import subprocess

        p = subprocess.Popen(cmd)
        procs.append(p)
        return p

    def kill_second():
        time.sleep(1.0)
        os.kill(procs[1].pid, signal.SIGKILL)

    threading.Thread(target=kill_second, daemon=True).start()
    start = time.monotonic()
    out = supervise([WAITS, WAITS, STUCK], poll=0.05, print_fn=lines.append,
                    popen=popen)
    assert time.monotonic() - start < 20
    assert out.code == 1
    assert out.lost is not None and out.lost[0] == 1 and out.lost[2] == -signal.SIGKILL
    assert len(lines) == 1
    assert "process 1 of 3" in lines[0] and "SIGKILL" in lines[0] and "--resume auto" in lines[0]
    assert all(p.poll() is not None for p in procs)  # the others were killed


def test_a_resumable_stop_waits_for_the_slower_processes_and_gives_75(monkeypatch):
    # Every process stops after the same step with status 75, one of them later than an
    # error's settling time (still writing its part of the checkpoint): no process is lost.
    from gtp_jax.train.lifecycle.preempt import RESUMABLE_EXIT  # noqa: PLC0415

    # The launcher keeps the status as a literal (it does not import JAX); it must stay 75.
    assert launch.ORDERLY == (0, RESUMABLE_EXIT)
    monkeypatch.setattr(launch, "SETTLE_S", 0.3)
    fast = [sys.executable, "-c", "raise SystemExit(75)"]
    slow = [sys.executable, "-c", "import time; time.sleep(1.5); raise SystemExit(75)"]
    lines: list[str] = []
    out = supervise([fast, slow], poll=0.05, print_fn=lines.append)
    assert (out.code, out.lost, lines) == (75, None, [])
    finished = [sys.executable, "-c", "raise SystemExit(0)"]
    assert supervise([finished, slow], poll=0.05, print_fn=lines.append).code == 75


def test_a_process_that_does_not_follow_an_orderly_end_is_named_and_stopped():
    lines: list[str] = []
    stopped = [sys.executable, "-c", "raise SystemExit(75)"]
    start = time.monotonic()
    out = supervise([stopped, STUCK], poll=0.05, orderly_wait=1.0,
                    print_fn=lines.append)
    assert time.monotonic() - start < 20
    assert out.code == 1 and out.lost is not None and out.lost[0] == 1
    assert len(lines) == 1
    assert "process 1 of 2" in lines[0] and "exit status 75" in lines[0]


def test_sigterm_to_the_launcher_reaches_every_process():
    def term_self():
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=term_self, daemon=True).start()
    before = signal.getsignal(signal.SIGTERM)
    assert supervise([WAITS, WAITS], poll=0.05).code == 0
    assert signal.getsignal(signal.SIGTERM) is before  # the launcher's handler is removed


def test_each_process_gets_its_block_of_gpus():
    cmds = child_commands(["--steps", "3"], 2, 4, 1234, python="py")
    assert cmds[0][:6] == ["py", "-m", "gtp_jax", "train", "--steps", "3"]
    assert cmds[1][-8:] == ["--coordinator", "localhost:1234", "--num-processes", "2",
                            "--process-id", "1", "--local-device-ids", "2,3"]
    assert "--local-device-ids" not in child_commands([], 2, None, 1, python="py")[0]
    with pytest.raises(ValueError, match="--processes=3"):
        child_commands([], 3, 4, 1)


def test_how_a_process_ended_is_said_in_words():
    assert describe_end(-9) == "killed by SIGKILL"
    assert describe_end(2) == "exit status 2"


def _pids_of(marker: str, process_id: int) -> list[int]:
    """Processes whose command line holds `marker` and ``--process-id <process_id>``."""
    found = []
    for proc in os.listdir("/proc"):
        if not proc.isdigit():
            continue
        try:
            with open(f"/proc/{proc}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if marker in args and "--process-id" in args and \
                args[args.index("--process-id") + 1] == str(process_id):
            found.append(int(proc))
    return found


def test_the_command_line_launch_trains_and_a_killed_process_is_named(tmp_path):
    import subprocess

    from helpers import cli_env

    marker = str(tmp_path / "m.json")
    cmd = [sys.executable, "-m", "gtp_jax", "train", "--steps", "400", "--batch", "8",
           "--seq", "32", "--dp", "2", "--gtp", "4", "--processes", "2",
           "--metrics-json", marker, "--log-every", "1"]
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    while proc.poll() is None:
        seen.append(proc.stderr.readline())  # the progress line (process 0's)
        if "step 3/" in seen[-1]:  # both processes train (steps have collectives)
            break
    assert proc.poll() is None, "".join(seen)
    victims = _pids_of(marker, 1)
    assert len(victims) == 1
    killed = time.monotonic()
    os.kill(victims[0], signal.SIGKILL)
    _, rest = proc.communicate(timeout=120)
    assert time.monotonic() - killed < 60
    err = "".join(seen) + rest
    assert proc.returncode == 1
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "process 1 of 2" in lines[0] and "SIGKILL" in lines[0], err
    assert not _pids_of(marker, 0)  # the survivor was stopped too
    # Killed, not asked to stop: it could not write the checkpoint a SIGTERM announces.
    assert "SIGTERM" not in err, err


@pytest.mark.parametrize("flags,message", [
    (["--processes", "1"], "--processes 1 must be >= 2"),
    (["--processes", "2", "--process-id", "0"], "drop --process-id"),
])
def test_launch_flag_mistakes_are_one_line(flags, message, capsys):
    from gtp_jax.train.cli.command import main

    assert main(["train", "--steps", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_processes_that_end_together_name_the_killed_one_not_the_aborted_one(tmp_path):
    # The coordinator's process killed: JAX aborts the others within milliseconds, so all
    # have ended by the time the launcher looks; it names the killed one. (Both start
    # their end once both run, whatever their start-up times.)
    meet = ("import os, pathlib, resource, signal, sys, time\n"
            f"d = pathlib.Path({str(tmp_path)!r}); (d / sys.argv[1]).touch()\n"
            "while len(list(d.iterdir())) < 2: time.sleep(0.01)\n"
            "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n")
    killed = [sys.executable, "-c", meet + "os.kill(os.getpid(), signal.SIGKILL)", "a"]
    aborted = [sys.executable, "-c",
               meet + "time.sleep(0.1); os.kill(os.getpid(), signal.SIGABRT)", "b"]
    lines: list[str] = []
    out = supervise([killed, aborted], poll=0.05, print_fn=lines.append)
    assert out.code == 1 and out.lost is not None and out.lost[0] == 0
    assert len(lines) == 1 and "process 0 of 2" in lines[0] and "SIGKILL" in lines[0], lines
    # Processes that all fail alike printed their own errors: nothing to add.
    failing = [sys.executable, "-c", "raise SystemExit(2)"]
    lines.clear()
    assert supervise([failing, failing], poll=0.05, print_fn=lines.append).code == 2
    assert lines == []


def test_the_launcher_flag_is_dropped_however_argparse_took_it():
    assert without_flag(["--processe", "2", "--steps", "3"], "--processes") == ["--steps", "3"]
    assert without_flag(["--processes=2", "--seq", "8"], "--processes") == ["--seq", "8"]
    assert without_flag(["--steps", "3"], "--processes") == ["--steps", "3"]


@pytest.mark.parametrize("flags,message", [
    # What every process would refuse is refused once, before any starts, in the user's
    # flags (not the --num-processes / --coordinator the launcher adds).
    (["--processes", "3"], "--processes 3 does not divide the 8 devices of the mesh"),
    (["--processes", "2", "--batch", "7"], "--batch=7 must be a multiple of dp*ep*gtp"),
    (["--processes", "2", "--tp", "3"], "--tp=3 does not divide the tiny preset"),
    (["--processes", "2", "--cp", "2", "--moe-experts", "4"],
     "--cp=2 with --moe-experts=4"),
    (["--processe", "2", "--batch", "7"], None),
    (["--processes", "2", "--tp", "4", "--dp", "2", "--simulate-failure", "step=1,device=5"],
     "--simulate-failure with --processes 2: a simulated failure runs in one process only"),
    (["--processes", "2", "--export-hf", "/proc/gtp_jax_x"], "--export-hf='/proc/gtp_jax_x'"),
    (["--processes", "2", "--checkpoint-dir", "/proc/gtp_jax_x"], "--checkpoint-dir="),
    (["--processes", "2", "--metrics-json", "/proc/gtp_jax_x.json"], "--metrics-json="),
])
def test_launch_refusals_are_one_line_before_any_process_starts(flags, message, capsys,
                                                                 monkeypatch):
    from gtp_jax.train.cli.command import main

    def started(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(launch, "launch", started)
    try:
        code = main(["train", "--steps", "2", *flags])
    except SystemExit as stop:  # argparse's own refusal (a flag not spelled in full)
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "--num-processes" not in err and "--coordinator" not in err, err
    if message is not None:
        assert message in err, err
