"""Stopping a run on SIGTERM / SIGINT (a scheduler's preemption, Ctrl-C) without losing work.

`stop_on_signals` installs handlers for the duration of a run (the command line's `train`
entry; the previous handlers come back on exit). The first signal only sets a flag
(`StopRequest`); the step loop (`gtp_jax.train.loop`) checks it once the previous step is
done and the next one is dispatched (the host runs one step ahead of the devices), finishes
that step, writes a checkpoint (atomic, as every save) and returns: at most two steps run
after the signal, the one running and the one dispatched. The command line exits with
status `RESUMABLE_EXIT` (75): the run is unfinished, nothing is lost, and the same command
continues it. Not 0, so that ``train && upload`` never publishes a partial run; nor is
``--export-hf`` written. Before the first step (tokenizing the data, building the model)
the request is honoured at once: `RunStopped`, nothing trained. A second signal exits at
once (status 128 + signal number): orbax publishes a checkpoint by renaming its temporary
directory only when every item is written, so a save cut short is never listed, and the
newest intact checkpoint stays the newest one a resume finds.

In a multi-process run the processes must stop after the same step, or they would write
different checkpoints (or wait forever in each other's collectives). `StopRequest.agreed`
is therefore a vote of all processes through the coordination service (host to host, no
device work, so the devices keep running ahead): a process that got a signal publishes a
key for the step, all processes meet at a barrier named after the step, and each reads the
step's keys. Every process sees the same keys, so all stop after the same step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from types import FrameType

import jax

#: The signals a scheduler (SIGTERM) or a user (SIGINT, Ctrl-C) stops a run with.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: How long (ms) a process waits at a step's stop vote for the slowest one: processes run the
#: same steps in lockstep (every step has collectives), so this only bounds a hang.
VOTE_TIMEOUT_MS = 300_000
#: The exit status of a run stopped early by a signal when nothing is lost (its progress is
#: in a checkpoint, or nothing was trained yet): the same command continues it. sysexits.h's
#: EX_TEMPFAIL, "try again later", which schedulers and wrappers can requeue on.
RESUMABLE_EXIT = 75


class RunStopped(Exception):  # noqa: N818 - not an error: the run was asked to stop
    """A stop request arrived before the run's first step (while the data was tokenized or
    the model built): nothing was trained or saved, and the same command starts (or
    resumes) the run again.

    Attributes:
      cause: what stopped it (`StopRequest.name`, e.g. ``"SIGTERM"``).
      during: what the run was doing: ``"tokenizing the data"``, ``"preparing the run"``.
      step: the checkpoint step the run was resuming from (0: a new run).
    """

    def __init__(self, cause: str, during: str, step: int = 0):
        self.cause, self.during, self.step = cause, during, step
        super().__init__(f"stopped by {cause} while {during}, before step {step + 1}: "
                         "nothing was trained")


class StopRequest:
    """Whether this run was asked to stop (set by `stop_on_signals`'s handler, or `request`).

    Attributes:
      signum: the first signal received, or None.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.elsewhere: str | None = None  # what stopped another process, e.g. "SIGTERM"

    @property
    def requested(self) -> bool:
        """True once a stop was requested on this process."""
        return self.signum is not None

    @property
    def name(self) -> str:
        """The signal's name (``SIGTERM``; ``SIGTERM on process 1`` when another process
        got it), or ``"a stop request"``."""
        if self.signum is None:
            return self.elsewhere or "a stop request"
        return signal.Signals(self.signum).name if self.signum > 0 else "a stop request"

    def request(self, signum: int = 0) -> None:
        """Asks the run to stop after the step in flight (`signum`: the cause, 0 if none)."""
        if self.signum is None:
            self.signum = signum

    def agreed(self, step: int) -> bool:
        """Whether the run stops after `step`: this process's flag on one process; on
        several, True on all of them if any one was asked to stop (every process must call
        this for every step, in order)."""
        if jax.process_count() == 1:
            return self.requested
        votes = _vote(step, self.name if self.requested else None)
        if votes and not self.requested:
            key, cause = sorted(votes)[0]
            self.elsewhere = f"{cause} on process {key.rsplit('/', 1)[-1]}"
        return bool(votes)


def _vote(step: int, mine: str | None) -> list[tuple[str, str]]:
    """Every process's ``(key, cause)`` for `step` (the same list on all processes): this
    process adds one when `mine` (its stop cause) is set."""
    from gtp_jax.train.processes.distributed import coordination_client  # noqa: PLC0415

    client = coordination_client()
    prefix = f"gtp_jax_stop/{step}/"
    if mine is not None:
        client.key_value_set(f"{prefix}{jax.process_index()}", mine)
    client.wait_at_barrier(f"gtp_jax_stop_{step}", VOTE_TIMEOUT_MS)
    return list(client.key_value_dir_get(prefix))


@contextlib.contextmanager
def stop_on_signals(signals: Sequence[int] = STOP_SIGNALS, *,
                    saves: bool = True) -> Iterator[StopRequest]:
    """Handlers for `signals` while the block runs; yields the `StopRequest` they set
    (`saves`: the run has a checkpoint directory, which the first signal's line mentions).

    First signal: one line on stderr, the request is set (the run stops after the step in
    flight and saves). Second signal: one line, then the process exits at once with status
    128 + the signal number (no clean-up: a checkpoint being written is left unfinished and
    is never listed). Outside the main thread nothing is installed (Python allows signal
    handlers only there) and the request is never set. The previous handlers are restored
    when the block exits.
    """
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        del frame
        name = signal.Signals(signum).name
        if request.requested:
            _say(f"gtp_jax train: second signal ({name}): exiting now; the newest complete "
                 "checkpoint is kept, a save in progress is discarded.")
            os._exit(128 + signum)
        request.request(signum)
        then = ("then saving a checkpoint and exiting" if saves else
                "then exiting (no checkpoint directory: nothing is saved)")
        _say(f"gtp_jax train: {name} received: finishing at most two more steps (the host "
             f"runs one step ahead of the devices), {then}; before the first step, exiting "
             "at once (send it again to exit at once).")

    previous = {s: signal.signal(s, handle) for s in signals}
    try:
        yield request
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _say(line: str) -> None:
    # os.write: a handler may run while the main thread is inside a print to stderr. Every
    # process says it: each has its own log.
    os.write(2, (line + "\n").encode())


__all__ = ["RESUMABLE_EXIT", "STOP_SIGNALS", "RunStopped", "StopRequest", "stop_on_signals"]
