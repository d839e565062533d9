"""`python -m gtp_jax train --processes N`: the launcher's supervision, with stand-in child
processes (no training: the multi-process training itself is tests/test_multiprocess.py)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from gtp_jax.train.launch import child_commands, describe_end, supervise

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
    out = supervise([WAITS, WAITS, STUCK], grace=1.0, poll=0.05, print_fn=lines.append,
                    popen=popen)
    assert time.monotonic() - start < 20
    assert out.code == 1
    assert out.lost is not None and out.lost[0] == 1 and out.lost[2] == -signal.SIGKILL
    assert len(lines) == 1
    assert "process 1 of 3" in lines[0] and "SIGKILL" in lines[0] and "--resume auto" in lines[0]
    assert all(p.poll() is not None for p in procs)  # the stuck one was killed after grace


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
