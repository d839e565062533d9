"""``python -m gtp_jax train --processes N ...``: start the N processes of a multi-process run
on this host, and supervise them.

Each process is ``python -m gtp_jax train <the same flags> --coordinator localhost:PORT
--num-processes N --process-id i`` (a free port), with ``--local-device-ids`` naming its own
block of this host's GPUs (none on a CPU host: each process then simulates its share of the
mesh's devices). The launcher:

- forwards SIGTERM and SIGINT to every process, which then stop after the same step (their
  stop vote, `gtp_jax.train.lifecycle.preempt`) and write one checkpoint;
- when a process ends with an error or is killed while the others run (a lost GPU, an
  out-of-memory kill, ``kill -9``), prints one line naming it and how it ended, kills the
  others once they have not ended on their own within `SETTLE_S` (`_stop`: they wait in a
  collective that will never complete) and exits with status 1, instead of leaving them to
  wait for JAX's heartbeat timeout; when they all end at once (the coordinator's process
  lost: JAX ends the others within milliseconds), it names the one that was killed rather
  than the ones JAX aborted (SIGABRT);
- when a process ends in order (finished, status 0, or stopped resumably, status 75) it
  waits up to `ORDERLY_S` for the others, which end after the same step (saving a checkpoint
  together can take that long); one still running after that is stopped and named;
- otherwise exits with the processes' own status (75 if any stopped resumably).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from gtp_jax.train.processes.output_guard import LAUNCHED_ENV

#: How often (seconds) the launcher looks at its processes.
POLL_S = 0.2
#: Seconds the others get to end on their own after one ended with an error.
SETTLE_S = 3.0
#: Seconds the others get to end after one ended in order (finished or stopped resumably):
#: they stop after the same step, but may still be writing their part of the checkpoint.
ORDERLY_S = 120.0
#: The statuses of a process that ended in order: finished, and stopped resumably
#: (`gtp_jax.train.lifecycle.preempt.RESUMABLE_EXIT`, written out: the launcher does not
#: import JAX, which that module does).
ORDERLY = (0, 75)
_RESUME = "Resume with the same command and --resume auto (the newest intact checkpoint)."


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a supervised run ended.

    Attributes:
      code: the launcher's exit status.
      lost: the first process that ended badly while others still ran, as
        ``(index, pid, returncode)``; None if none did.
    """

    code: int
    lost: tuple[int, int, int] | None = None


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def child_commands(argv: Sequence[str], processes: int, gpus: int | None, port: int,
                   python: str = sys.executable) -> list[list[str]]:
    """The command of each process: `argv` (the ``train`` flags without ``--processes``)
    plus the flags that join process ``i`` to the run, and its GPUs.

    Raises:
      ValueError: `gpus` does not divide into `processes` equal blocks.
    """
    per = None
    if gpus:
        if gpus % processes:
            raise ValueError(f"--processes={processes} does not divide this host's {gpus} "
                             "GPUs into equal blocks; use a divisor of the GPU count.")
        per = gpus // processes
    out = []
    for i in range(processes):
        cmd = [python, "-m", "gtp_jax", "train", *argv, "--coordinator", f"localhost:{port}",
               "--num-processes", str(processes), "--process-id", str(i)]
        if per:
            cmd += ["--local-device-ids", ",".join(str(i * per + k) for k in range(per))]
        out.append(cmd)
    return out


def describe_end(returncode: int) -> str:
    """``exit status 3`` or ``killed by SIGKILL`` for a `subprocess` return code."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def supervise(commands: Sequence[Sequence[str]], *, poll: float = POLL_S,
              orderly_wait: float = ORDERLY_S,
              print_fn: Callable[[str], None] | None = None,
              popen: Callable[..., subprocess.Popen] = subprocess.Popen) -> Outcome:
    """Runs `commands` as child processes until all have ended (see the module docstring).

    Returns the `Outcome`; the one line about a lost process goes to `print_fn` (default:
    stderr)."""
    say = print_fn or (lambda line: print(line, file=sys.stderr, flush=True))
    children = [popen(list(cmd)) for cmd in commands]
    previous = {}

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, forward)
    lost: tuple[int, int, int] | None = None
    orderly_since: float | None = None
    try:
        while True:
            codes = [c.poll() for c in children]
            if all(code is not None for code in codes):
                break
            bad = [(i, c.pid, code) for i, (c, code) in enumerate(zip(children, codes))
                   if code not in (None, *ORDERLY)]
            if bad and lost is None:
                # Processes that stop together (the same error everywhere) end within a
                # moment of each other: only one still running after that was left behind.
                settle = time.monotonic() + SETTLE_S
                while time.monotonic() < settle and any(c.poll() is None for c in children):
                    time.sleep(poll)
                if all(c.poll() is not None for c in children):
                    lost = _lost_among([c.returncode for c in children], children)
                    if lost is not None:
                        index, pid, code = lost
                        say(f"error: process {index} of {len(children)} (pid {pid}) ended: "
                            f"{describe_end(code)}; the others ended with it. {_RESUME}")
                    break
                lost = bad[0]
                index, pid, code = lost
                others = sum(code is None for code in codes)
                say(f"error: process {index} of {len(children)} (pid {pid}) ended: "
                    f"{describe_end(code)}; stopping the other {others}. {_RESUME}")
                _stop(children)
                continue
            if any(code is not None for code in codes) and orderly_since is None:
                orderly_since = time.monotonic()
            if orderly_since is not None and time.monotonic() - orderly_since > orderly_wait:
                # One ended in order but another did not follow: it is stuck (in a collective
                # whose peer has left, say); name it rather than wait forever.
                index = next(i for i, code in enumerate(codes) if code is None)
                ended = next(code for code in codes if code is not None)
                lost = (index, children[index].pid, ended)
                say(f"error: process {index} of {len(children)} (pid {lost[1]}) was still "
                    f"running {orderly_wait:.0f} s after another ended ({describe_end(ended)}); "
                    f"stopping it. {_RESUME}")
                _stop(children)
                continue
            time.sleep(poll)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    codes = [c.returncode for c in children]
    if lost is not None:
        return Outcome(1, lost)
    first_bad = next((code for code in codes if code not in ORDERLY), None)
    if first_bad is not None:
        return Outcome(128 - first_bad if first_bad < 0 else first_bad)
    return Outcome(max(codes))


def _lost_among(codes: Sequence[int], children: Sequence[subprocess.Popen]
                ) -> tuple[int, int, int] | None:
    """The process whose loss ended the others, when all ended within the settling time
    and some were killed by a signal; None when none was (each process that failed printed
    its own error).

    A process aborted by SIGABRT is JAX's runtime ending a process whose peer was lost
    (within milliseconds when the coordinator's process is), so another one is named."""
    killed = [(i, child.pid, code) for i, (child, code) in enumerate(zip(children, codes))
              if code < 0]
    first = [k for k in killed if k[2] != -signal.SIGABRT] or killed
    return first[0] if first else None


def _stop(children: Sequence[subprocess.Popen]) -> None:
    """SIGKILL to every child still running, once one was lost or is stuck.

    Not SIGTERM first: a process whose peer is gone waits in a collective that will never
    complete, spinning a core, and its orderly stop (a vote of all processes, then a
    checkpoint written by all) needs the lost one too; on SIGTERM it only announced a
    checkpoint it could not write, and was killed 10 s later. A save killed midway leaves
    the previous checkpoint the newest intact one (docs/reliability.md)."""
    for child in children:
        if child.poll() is None:
            child.kill()
    for child in children:
        child.wait()


def without_flag(argv: Sequence[str], flag: str) -> list[str]:
    """`argv` without `flag` and its value (``--flag V`` or ``--flag=V``), also where it is
    spelled as the abbreviation argparse took for it (``--processe 2``)."""
    out, skip = [], False
    for arg in argv:
        name = arg.split("=", 1)[0]
        spelled = name.startswith("--") and len(name) > 2 and flag.startswith(name)
        if skip:
            skip = False
        elif spelled and "=" not in arg:
            skip = True
        elif not spelled:
            out.append(arg)
    return out


def launch(argv: Sequence[str], processes: int, gpus: int | None) -> int:
    """Starts and supervises the `processes` processes of ``train argv`` on this host
    (`gpus`: this host's GPU count, None on a CPU host); returns the exit status.

    On a CPU host each process simulates its share of the mesh's devices: a device count
    in this process's ``XLA_FLAGS`` is not passed on."""
    commands = child_commands(argv, processes, gpus, free_port())
    print(f"launching {processes} processes on this host"
          + (f", {gpus // processes} GPUs each" if gpus else ""), flush=True)
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                              env.get("XLA_FLAGS", "")).strip()
    env[LAUNCHED_ENV] = "1"  # this process names a lost one; theirs only drop the stacks
    return supervise(commands, popen=lambda cmd: subprocess.Popen(cmd, env=env)).code
