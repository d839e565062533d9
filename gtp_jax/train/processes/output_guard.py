"""What a process of a multi-process run prints: its own output, without the runtime's noise.

Two kinds of text reach a multi-process run's output that no person should have to read:

- gloo, the CPU collectives between processes, prints ``[Gloo] Rank 3 is connected to 7
  peer ranks. Expected number of connected peer ranks is : 7`` on stdout, unconditionally,
  for every group of devices a collective first runs on (23 lines for a 2 x 4 mesh,
  interleaved with the progress bar). Those lines are dropped; gloo's line naming the
  ranks it could NOT connect to is kept.
- When another process of the run is lost (``kill -9``, a crash, a lost host), JAX's
  coordination service ends every other process from C++: a fatal log line, the status of
  the lost task and a stack trace, then ``abort()``, with Python unable to catch it or say
  anything first (when the coordinator's process is lost, within milliseconds). The guard
  replaces that with one line naming the lost process::

      error: lost process 1 of 2 (it stopped sending heartbeats: killed, crashed or
      unreachable); process 0 stops too. Resume with the same command and --resume auto ...

  The process still ends with the runtime's own status (SIGABRT: non-zero).
- gloo may notice the loss first, in the middle of a collective with the lost process, and
  end this process by an exception nobody catches (``terminate called after throwing an
  instance of 'gloo::EnforceNotMet'`` and its ``what()``, then ``abort()``), before any
  heartbeat is missed. That becomes the same one line; gloo's report names no process, so
  the line names the other one where the run has two, and "another process" otherwise.

Since only another process can still write once a process aborts, `guard_output` starts a
small one (this file run as a script: the standard library only, no JAX) and points this
process's stdout and stderr at it through pipes (pseudo-terminals where the original was a
terminal, so the progress bar still redraws in place). It copies everything through except
the lines above, and holds back text that may be the start of a loss report (a Python
traceback, the coordination service's error lines) until it knows: that text is printed
unchanged if the process goes on or ends without a loss report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable

#: Environment variable that `gtp_jax.train.processes.launch` sets for the processes it
#: starts: it names a lost process itself, so theirs only drop the runtime's text.
LAUNCHED_ENV = "GTP_JAX_LAUNCHED"
#: Seconds a trailing partial line waits for the rest of its line before it is copied.
PARTIAL_S = 0.1
#: Seconds the coordination service's error lines are held back waiting for the fatal
#: report that usually follows them within milliseconds.
COORDINATION_HOLD_S = 5.0
#: Seconds past the heartbeat timeout that a Python traceback is held back: one raised by
#: a lost peer (a failed collective or barrier) is followed by the runtime's fatal report
#: once the heartbeat timeout has passed.
TRACEBACK_MARGIN_S = 15.0

#: The constant pieces of gloo's connection report ``[Gloo] Rank R is connected to N peer
#: ranks. Expected number of connected peer ranks is : N``. gloo writes it piece by piece
#: to ``std::cout`` from several threads at once, so the reports of different groups arrive
#: interleaved (``[Gloo] Rank 6 is connected to 7[Gloo] Rank 5 is ...``): a line is a
#: connection report when nothing but these pieces, numbers and blanks is in it.
GLOO_PIECES = re.compile(rb"\[Gloo\] Rank | is connected to | peer ranks\. "
                         rb"|Expected number of connected peer ranks is : ")
GLOO_START = b"[Gloo] Rank "
_NUMBERS = re.compile(rb"[\d\s]*")
#: Text that may begin a loss report: a Python traceback, an error line of the coordination
#: service or its client, a fatal log line, an uncaught C++ exception.
HOLD_START = re.compile(
    rb"^(?:Traceback \(most recent call last\):|terminate called after throwing|F\d{4} "
    rb"|[EW]\d{4} [\d:.]+\s+\d+ (?:coordination_service\w*|preemption_\w+|client|service|"
    rb"distributed\w*)\.(?:cc|h):\d+\])")
#: The fatal log line with which JAX ends a process whose run lost a process (the wording
#: of jax 0.10 and 0.11; some builds say "detected failure").
FATAL_REPORT = re.compile(rb"JAX distributed service detected (?:fatal errors|failure)")
#: What reports a lost process: the fatal line, or the coordination service's own words.
FATAL = re.compile(FATAL_REPORT.pattern + rb"|heartbeat timeout|stopped sending heartbeats"
                   rb"|leader task was preempted/died|Failed to send RPC to coordination "
                   rb"service")
_COORDINATOR_LOST = re.compile(rb"leader task was preempted/died|Failed to send RPC to "
                               rb"coordination service")
#: The unhealthy tasks, as ``1`` lines or as ``/job:jax_worker/replica:0/task:1`` names.
_UNHEALTHY = re.compile(rb"stopped sending heartbeats\)?:?\s*((?:(?:/job:\w+/replica:\d+"
                        rb"/task:)?\d+[ \t,]*\r?\n?)+)")
_TASK_TIMEOUT = re.compile(rb"[Tt]ask:? ?(\d+) heartbeat timeout")
#: gloo's exception that nobody caught: a collective between processes broke (a peer
#: killed or unreachable mid-transfer), and the C++ runtime aborts the process.
GLOO_ABORT = re.compile(rb"^terminate called after throwing an instance of 'gloo::\w+'", re.M)


def lost_processes(text: bytes) -> tuple[list[int], bool] | None:
    """``(process ids, the coordinator was lost)`` when `text` reports a lost process,
    else None; the ids may be empty when the report names none (gloo's abort never does)."""
    if not FATAL.search(text):
        return ([], False) if GLOO_ABORT.search(text) else None
    coordinator = bool(_COORDINATOR_LOST.search(text))
    ids = set()
    for found in _UNHEALTHY.finditer(text):
        names = found.group(1)
        ids |= {int(i) for i in re.findall(rb"/task:(\d+)" if b"/task:" in names else rb"\d+",
                                           names)}
    ids |= {int(i) for i in _TASK_TIMEOUT.findall(text)}
    if coordinator:
        ids.add(0)
    if not ids and not FATAL_REPORT.search(text):
        return None  # a heartbeat word alone is no report of a lost process
    return sorted(ids), coordinator


def loss_line(ids: list[int], coordinator: bool, me: int | None, count: int | None, *,
              in_collective: bool = False) -> str:
    """The one line that replaces the runtime's report of lost processes `ids`; where the
    report names none and the run has two processes, the lost one is the other.
    `in_collective`: gloo noticed the loss in a collective (no heartbeat was missed yet)."""
    if not ids and count == 2 and me in (0, 1):
        ids = [1 - me]
    of = f" of {count}" if count else ""
    how = "a collective with it broke" if in_collective else "no heartbeats"
    if coordinator and ids == [0]:
        who = (f"lost process 0{of}, the coordinator (its coordination service stopped "
               "answering: killed, crashed or unreachable)")
    elif ids:
        names = (f"process {ids[0]}" if len(ids) == 1 else
                 "processes " + ", ".join(str(i) for i in ids))
        who = f"lost {names}{of} ({how}: killed, crashed or unreachable)"
    else:
        who = f"lost another process of the run{of} (killed, crashed or unreachable)"
    this = f"process {me}" if me is not None else "this process"
    return (f"error: {who}; {this} stops too. Resume with the same command and "
            "--resume auto (the newest intact checkpoint).")


class StreamFilter:
    """One output stream's filter: `feed` bytes as they come, `tick` now and then, `close`
    at the end; what passes goes to `write`.

    Args:
      write: where the copied bytes go.
      on_loss: called with the held text when the stream ends and that text reports a lost
        process (the text is then dropped); None: nothing is held, only gloo's lines are
        dropped.
      hold_traceback_s: how long a Python traceback is held back waiting for a loss report.
      clock: seconds (monotonic).
    """

    def __init__(self, write: Callable[[bytes], None],
                 on_loss: Callable[[bytes], None] | None = None, *,
                 hold_traceback_s: float = 30.0 + TRACEBACK_MARGIN_S,
                 clock: Callable[[], float] = time.monotonic):
        self.write, self.on_loss = write, on_loss
        self.hold_traceback_s = hold_traceback_s
        self.clock = clock
        self.partial = b""
        self.partial_since = 0.0
        self.held: list[bytes] | None = None
        self.hold_until = 0.0
        self.lost = False
        self.gloo_owed = 0  # line ends of gloo reports whose text was already dropped

    def feed(self, data: bytes) -> None:
        """Takes the next bytes of the stream."""
        if self.lost:
            return
        if not self.partial:
            self.partial_since = self.clock()
        self.partial += data
        while True:
            cut = min((i for i in (self.partial.find(b"\n"), self.partial.find(b"\r"))
                       if i >= 0), default=-1)
            if cut < 0:
                break
            line, self.partial = self.partial[:cut + 1], self.partial[cut + 1:]
            self._line(line)
            if self.lost:
                return

    def tick(self) -> None:
        """Copies a partial line that waited `PARTIAL_S` (a progress bar redrawn in place)
        and releases held text whose wait is over."""
        if self.lost:
            return
        now = self.clock()
        if self.held is not None and now >= self.hold_until and not self._dying():
            self._release()
        if self.partial and now - self.partial_since >= PARTIAL_S and self.held is None \
                and not self._maybe_gloo(self.partial):
            self.write(self.partial)
            self.partial = b""

    def close(self) -> None:
        """The stream ended: held text that reports a lost process becomes one line
        (`on_loss`); anything else is copied."""
        if self.lost:
            return
        if self.partial:
            self._line(self.partial)
            self.partial = b""
        if self.held is not None and not self._check():
            self._release()

    def _line(self, line: bytes) -> None:
        if self.held is not None:
            self.held.append(line)
            return
        if self._gloo(line):
            return
        if self.on_loss is not None and HOLD_START.match(line):
            self.held = [line]
            wait = (self.hold_traceback_s if line.startswith((b"Traceback", b"F"))
                    else COORDINATION_HOLD_S)
            self.hold_until = self.clock() + wait
            return
        self.write(line)

    def _gloo(self, line: bytes) -> bool:
        """Whether `line` is gloo's connection reports, or the rest of reports begun on an
        earlier line; a report that names ranks it is NOT connected to is kept."""
        starts = line.count(GLOO_START)
        if (starts or self.gloo_owed > 0) and _NUMBERS.fullmatch(GLOO_PIECES.sub(b"", line)):
            self.gloo_owed = max(0, self.gloo_owed + starts - line.count(b"\n"))
            return True
        return False

    def _maybe_gloo(self, partial: bytes) -> bool:
        """Whether a partial line may be (part of) a gloo report, to be judged once whole."""
        return b"[Gloo" in partial or (
            self.gloo_owed > 0 and bool(_NUMBERS.fullmatch(GLOO_PIECES.sub(b"", partial))))

    def _dying(self) -> bool:
        """Whether the held text has JAX's fatal report or gloo's abort: the process is
        ending (the rest of the report, which names the lost process, follows it)."""
        return any(FATAL_REPORT.search(line) or GLOO_ABORT.match(line)
                   for line in self.held or ())

    def _check(self) -> bool:
        """Ends the stream with `on_loss` when the held text reports a lost process."""
        text = b"".join(self.held or ())
        if lost_processes(text) is None:
            return False
        self.lost = True
        self.held = None
        if self.on_loss is not None:
            self.on_loss(text)
        return True

    def _release(self) -> None:
        held, self.held = self.held or [], None
        for line in held:
            self.write(line)


@dataclasses.dataclass
class OutputGuard:
    """The copying process and this process's original stdout/stderr (see `guard_output`).

    Attributes:
      process: the copying process.
      saved: this process's fd (1, 2) -> a duplicate of the original it pointed at.
    """

    process: subprocess.Popen
    saved: dict[int, int]

    def close(self, timeout: float = 5.0) -> None:
        """Points stdout/stderr back at the originals and waits (at most `timeout` s) until
        everything written before is copied."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, original in self.saved.items():
            with contextlib.suppress(OSError):
                os.dup2(original, fd)
                os.close(original)
        self.saved = {}
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)


def guard_output(process_id: int | None, num_processes: int | None,
                 heartbeat_timeout: float) -> OutputGuard | None:
    """Points this process's stdout and stderr through a copying process that drops gloo's
    connection lines and turns the runtime's report of a lost process into one line (see
    the module docstring). Call once, before joining the run. `OutputGuard.close` undoes
    it when the run ended in order; otherwise the copying process ends after this one, once
    it has copied (or replaced) the last output.

    Args:
      process_id: this process's index (in the line), None if not known yet.
      num_processes: the run's process count (in the line), None if not known yet.
      heartbeat_timeout: the run's heartbeat timeout (seconds): how long a Python traceback
        may precede the runtime's report.

    Returns:
      The guard, or None where it cannot be set up (no ``os.pipe``/``fork``, stdout or
      stderr closed); output then goes out unfiltered.
    """
    fds = (1, 2)
    try:
        for fd in fds:
            os.fstat(fd)
    except OSError:
        return None
    ends = {fd: _channel(fd) for fd in fds}
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    launched = os.environ.get(LAUNCHED_ENV) == "1"
    cmd = [sys.executable, "-I", os.path.abspath(__file__), str(ends[1][0]), str(ends[2][0]),
           str(float(heartbeat_timeout)), "-" if process_id is None else str(process_id),
           "-" if num_processes is None else str(num_processes), "0" if launched else "1"]
    try:
        process = subprocess.Popen(cmd, pass_fds=[r for r, _ in ends.values()],
                                   stdin=subprocess.DEVNULL)
    except OSError:
        for r, w in ends.values():
            os.close(r)
            os.close(w)
        return None
    saved = {}
    for fd, (r, w) in ends.items():
        saved[fd] = os.dup(fd)
        os.dup2(w, fd)
        os.close(w)
        os.close(r)
    return OutputGuard(process, saved)


def _channel(fd: int) -> tuple[int, int]:
    """(read end, write end) that stands in for `fd`: a pseudo-terminal when `fd` is a
    terminal (so that the progress bar still sees one), else a pipe."""
    if os.isatty(fd) and hasattr(os, "openpty"):
        try:
            import termios  # noqa: PLC0415 - POSIX only

            master, slave = os.openpty()
            attrs = termios.tcgetattr(slave)
            attrs[1] &= ~termios.OPOST  # "\n" stays "\n" (no "\r\n")
            termios.tcsetattr(slave, termios.TCSANOW, attrs)
            return master, slave
        except (ImportError, OSError):
            pass
    return os.pipe()


def _copy(out_fd: int, err_fd: int, hold_traceback_s: float, me: int | None,
          count: int | None, report: bool) -> None:
    """The copying process: reads `out_fd` and `err_fd` until both end."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # the run's process decides when it ends

    def writer(fd: int) -> Callable[[bytes], None]:
        def write(data: bytes) -> None:
            with contextlib.suppress(OSError):
                while data:
                    data = data[os.write(fd, data):]
        return write

    said = []

    def on_loss(text: bytes) -> None:
        found = lost_processes(text)
        if report and found is not None and not said:
            said.append(True)
            in_collective = not FATAL.search(text)  # only gloo's abort reported it
            writer(2)((loss_line(found[0], found[1], me, count, in_collective=in_collective)
                       + "\n").encode())

    filters = {out_fd: StreamFilter(writer(1), on_loss, hold_traceback_s=hold_traceback_s),
               err_fd: StreamFilter(writer(2), on_loss, hold_traceback_s=hold_traceback_s)}
    selector = selectors.DefaultSelector()
    for fd in filters:
        selector.register(fd, selectors.EVENT_READ)
    while filters:
        for key, _ in selector.select(PARTIAL_S):
            try:
                data = os.read(key.fd, 65536)
            except OSError:  # EIO: a pseudo-terminal whose other side is closed
                data = b""
            if data:
                filters[key.fd].feed(data)
            else:
                selector.unregister(key.fd)
                filters.pop(key.fd).close()
        for f in filters.values():
            f.tick()


def _copy_raw(fds: dict[int, int]) -> None:
    """Copies `fds` (read end -> where to) unchanged until each ends."""
    selector = selectors.DefaultSelector()
    for fd in fds:
        selector.register(fd, selectors.EVENT_READ)
    while fds:
        for key, _ in selector.select():
            try:
                data = os.read(key.fd, 65536)
            except OSError:
                data = b""
            if not data:
                selector.unregister(key.fd)
                fds.pop(key.fd)
                continue
            with contextlib.suppress(OSError):
                while data:
                    data = data[os.write(fds[key.fd], data):]


def _main(argv: list[str]) -> None:
    out_fd, err_fd, timeout, me, count, report = argv
    try:
        _copy(int(out_fd), int(err_fd), float(timeout) + TRACEBACK_MARGIN_S,
              None if me == "-" else int(me), None if count == "-" else int(count),
              report == "1")
    except Exception:  # noqa: BLE001 - never leave the run without its output
        _copy_raw({int(out_fd): 1, int(err_fd): 2})


if __name__ == "__main__":
    _main(sys.argv[1:])


__all__ = ["LAUNCHED_ENV", "OutputGuard", "StreamFilter", "guard_output", "loss_line",
           "lost_processes"]
