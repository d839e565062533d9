"""What a process of a multi-process run prints (`gtp_jax.train.processes.output_guard`): gloo's
connection lines dropped, the runtime's abort report of a lost process replaced by one line,
everything else copied unchanged. The texts are the runtime's own (jax 0.10.2, 2 CPU
processes); the processes themselves are in tests/test_multiprocess.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from gtp_jax.train.processes import output_guard
from gtp_jax.train.processes.output_guard import (
    COORDINATION_HOLD_S,
    PARTIAL_S,
    StreamFilter,
    loss_line,
    lost_processes,
)

#: gloo's reports from 4 threads at once, as a 2 x 4 CPU run's stdout had them.
GLOO = (b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer "
        b"ranks is : 1\n"
        b"[Gloo] Rank 6 is connected to 7[Gloo] Rank 5 is connected to 7 peer ranks. Expected "
        b"number of connected peer ranks is :  peer ranks. Expected number of connected peer "
        b"ranks is : [Gloo] Rank 7 is connected to 7 peer ranks. Expected number of "
        b"connected peer ranks is : 777\n\n\n"
        # one report's first piece ends another's line, its rest comes on the next line
        b"[Gloo] Rank 4 is connected to 7 peer ranks. Expected number of connected peer ranks "
        b"is : 7[Gloo] Rank \n"
        b"5 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n")
#: Process 0's stderr when process 1 was killed: the service's error line, the barrier's
#: Python traceback and the fatal report with its stack (shortened).
PEER_LOST = (
    b"E1128 12:11:06.254059   24911 coordination_service.cc:1549] [1113] Use error polling to "
    b"propagate the following error to all tasks: UNAVAILABLE: The following tasks are "
    b"unhealthy (stopped sending heartbeats):\n1\nThe tasks have crashed.\n"
    b"E1128 12:11:06.254596   24922 coordination_service_agent.cc:289] Polled an error from "
    b"coordination service (this can be an error from this or another task).\n"
    b"F1128 12:11:06.254683   24922 client.h:80] Terminating process because the JAX "
    b"distributed service detected fatal errors. This most likely indicates that another "
    b"task died; absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped "
    b"sending heartbeats):\n1\nThe tasks have crashed.\n"
    b"Traceback (most recent call last):\n  File \"<frozen runpy>\", line 198\n"
    b"jax.errors.JaxRuntimeError: INTERNAL: Barrier failed because: task is set to ERROR: "
    b"UNAVAILABLE: Task 1 heartbeat timeout.\n"
    b"*** Check failure stack trace: ***\n"
    b"    @     0x7f152c440634  absl::log_internal::LogMessage::SendToLog()\n"
    b"    @     0x7f1533aa71f5  (unknown)\n")
#: Process 1's stderr when process 0, the coordinator, was killed (shortened).
COORDINATOR_LOST = (
    b"W1128 12:13:31.900256   31185 preemption_sync_manager.cc:147] Failed to retrieve "
    b"preemption notice from coordination service: UNAVAILABLE: Socket closed\n"
    b"E1128 12:13:31.900357   31185 coordination_service_agent.cc:289] Polled an error from "
    b"coordination service (this can be an error from this or another task).\n"
    b"F1128 12:13:31.900363   31185 client.h:80] Terminating process because the JAX "
    b"distributed service detected fatal errors. absl::Status: UNAVAILABLE: Failed to send "
    b"RPC to coordination service. Either the leader task was preempted/died/restarted "
    b"unexpectedly or this task is experiencing network issues.\n"
    b"*** Check failure stack trace: ***\n    @     0x7f6a95840634  (unknown)\n")

#: Process 1's stderr when process 0 was killed in the middle of a collective: gloo's
#: exception ends it before any heartbeat is missed (jax 0.10.2, 2 x 4 CPU devices).
GLOO_BROKE = (
    b"terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
    b"  what():  [enforce fail at external/gloo/gloo/transport/tcp/pair.cc:459] "
    b"op.preamble.length <= op.nbytes. 32 vs 4. Received data size doesn't match expected "
    b"size. Is there a distributed collective mismatch in your code?\n")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _filter(report: bool = True, clock: Clock | None = None,
            hold_traceback_s: float = 45.0) -> tuple[StreamFilter, list[bytes], list[bytes]]:
    out: list[bytes] = []
    losses: list[bytes] = []
    f = StreamFilter(out.append, losses.append if report else None,
                     hold_traceback_s=hold_traceback_s, clock=clock or Clock())
    return f, out, losses


def test_gloo_connection_reports_are_dropped_even_interleaved():
    f, out, _ = _filter()
    f.feed(b"gtp_jax train: preset=tiny\n")
    for i in range(0, len(GLOO), 7):  # in arbitrary pieces, as reads return them
        f.feed(GLOO[i:i + 7])
    f.feed(b"[Gloo] Rank 3 is NOT connected to: [1, 2]\nsummary\n")
    f.close()
    assert b"".join(out) == (b"gtp_jax train: preset=tiny\n"
                             b"[Gloo] Rank 3 is NOT connected to: [1, 2]\nsummary\n")


@pytest.mark.parametrize("text,ids,coordinator", [(PEER_LOST, [1], False),
                                                  (COORDINATOR_LOST, [0], True)])
def test_the_runtime_report_of_a_lost_process_becomes_one_line(text, ids, coordinator):
    f, out, losses = _filter()
    f.feed(b"[----] step 3/100 loss 4.97\n")
    for i in range(0, len(text), 50):
        f.feed(text[i:i + 50])
        f.tick()
    f.close()
    assert out == [b"[----] step 3/100 loss 4.97\n"]  # nothing of the report is copied
    assert len(losses) == 1 and lost_processes(losses[0]) == (ids, coordinator)
    line = loss_line(ids, coordinator, me=1 - ids[0], count=2)
    assert "\n" not in line and line.startswith(f"error: lost process {ids[0]} of 2")
    assert f"process {1 - ids[0]} stops too" in line and "--resume auto" in line
    if coordinator:
        assert "the coordinator" in line


def test_a_launched_process_drops_the_report_and_says_nothing():
    # Under --processes the launcher names the lost process; the processes stay quiet.
    out: list[bytes] = []
    f = StreamFilter(out.append, lambda text: None)
    f.feed(COORDINATOR_LOST)
    f.close()
    assert out == []


def test_a_traceback_without_a_lost_process_is_copied_unchanged():
    f, out, losses = _filter()
    trace = (b"Traceback (most recent call last):\n  File \"x.py\", line 1\n"
             b"ValueError: a bug\n")
    f.feed(trace)
    assert out == []  # held: a lost peer's report may follow
    f.close()
    assert b"".join(out) == trace and losses == []


def test_held_text_is_released_when_no_report_follows_in_time():
    clock = Clock()
    f, out, losses = _filter(clock=clock, hold_traceback_s=10.0)
    warning = (b"W1128 12:13:31.900256   31185 preemption_sync_manager.cc:147] Failed to "
               b"retrieve preemption notice\n")
    f.feed(warning + b"[#---] step 4/9\n")
    clock.now += COORDINATION_HOLD_S + 0.1
    f.tick()
    assert b"".join(out) == warning + b"[#---] step 4/9\n"
    f.feed(b"Traceback (most recent call last):\nRuntimeError: in a thread\nstep 5\n")
    clock.now += 9.0
    f.tick()
    assert out[-1] == b"[#---] step 4/9\n"  # still held
    clock.now += 1.1
    f.tick()
    assert out[-1] == b"step 5\n" and losses == []


def test_a_progress_bar_redrawn_in_place_passes_at_once():
    clock = Clock()
    f, out, _ = _filter(clock=clock)
    f.feed(b"\r[#---] step 1/4 loss 5.5")
    clock.now += PARTIAL_S
    f.tick()
    f.feed(b"\r[##--] step 2/4 loss 5.2")
    clock.now += PARTIAL_S
    f.tick()
    assert b"".join(out) == b"\r[#---] step 1/4 loss 5.5\r[##--] step 2/4 loss 5.2"


def test_the_task_names_of_other_jax_builds_are_read_too():
    # Some builds name the unhealthy tasks by their full name and say "detected failure".
    text = (b"E0101 00:00:00.000000 1 coordination_service.cc:1] Use error polling to "
            b"propagate the following error to all tasks: UNAVAILABLE: The following tasks "
            b"are unhealthy (stopped sending heartbeats): /job:jax_worker/replica:0/task:3\n"
            b"F0101 00:00:00.000001 1 client.h:82] Terminating process because the JAX "
            b"distributed service detected failure\n")
    assert lost_processes(text) == ([3], False)
    f, out, losses = _filter()
    f.feed(text)
    f.close()
    assert out == [] and len(losses) == 1


def test_a_stack_without_the_runtime_report_is_no_lost_process():
    assert lost_processes(b"*** Check failure stack trace: ***\n    @ 0x0 (unknown)\n") is None
    assert lost_processes(b"the word heartbeat timeout in a log line\n") is None
    assert lost_processes(COORDINATOR_LOST) == ([0], True)


def test_gloo_aborting_in_a_collective_is_a_lost_process_too():
    # gloo may notice the loss before the runtime does: its abort names no process.
    clock = Clock()
    f, out, losses = _filter(clock=clock)
    f.feed(b"[----] step 2/500 loss 5.48\n")
    for i in range(0, len(GLOO_BROKE), 40):
        f.feed(GLOO_BROKE[i:i + 40])
        f.tick()
    clock.now += COORDINATION_HOLD_S + 1  # the process is ending: nothing is released
    f.tick()
    assert out == [b"[----] step 2/500 loss 5.48\n"]
    f.close()
    assert out == [b"[----] step 2/500 loss 5.48\n"] and len(losses) == 1
    assert lost_processes(losses[0]) == ([], False)
    line = loss_line([], False, me=1, count=2, in_collective=True)
    assert line.startswith("error: lost process 0 of 2 (a collective with it broke: killed")
    assert "process 1 stops too" in line
    # with more than two processes gloo's report cannot say which one
    assert loss_line([], False, me=2, count=4, in_collective=True).startswith(
        "error: lost another process of the run of 4")


def test_another_uncaught_exception_is_copied_unchanged():
    f, out, losses = _filter()
    text = (b"terminate called after throwing an instance of 'std::bad_alloc'\n"
            b"  what():  std::bad_alloc\n")
    f.feed(text)
    f.close()
    assert b"".join(out) == text and losses == []


def test_the_copying_process_replaces_an_abort_by_one_line(tmp_path):
    # The whole path: a process under `guard_output` (2 processes, this one process 1)
    # writes gloo's report and aborts; what reaches its stderr is the one line.
    child = textwrap.dedent(f"""
        import importlib.util, os, sys
        spec = importlib.util.spec_from_file_location("guard", {output_guard.__file__!r})
        guard = sys.modules["guard"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(guard)  # the module alone: no JAX in this process
        guard.guard_output(1, 2, heartbeat_timeout=1.0)
        print("step 2/500", flush=True)
        os.write(2, {GLOO_BROKE!r})
        os.abort()
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert done.stdout == "step 2/500\n"
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: lost process 0 of 2 (a collective with it broke"), done.stderr
