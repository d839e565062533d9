"""Multi-process runs (`gtp_jax.train.processes.distributed`): 2 CPU processes x 4 devices (gloo
collectives) train like 1 process x 8 devices; configuration errors."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
from helpers import cli_env, max_rel_err

from gtp_jax.base.errors import UsageError, UsageTypeError
from gtp_jax.train import TrainConfig, train
from gtp_jax.train.cli.command import main as cli_main
from gtp_jax.train.lifecycle.checkpoint import CheckpointConfig, Checkpointer
from gtp_jax.train.processes import distributed
from gtp_jax.train.processes.distributed import DistributedConfig, initialize, parse_address

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

REPO_ROOT = Path(__file__).resolve().parents[1]

#: Same run as test_train.RUN (one compiled train step for the suite), as CLI flags.
RUN = TrainConfig(steps=6, batch_size=8, seq_len=32, warmup=2, dp=2, gtp=4, pad_for_alignment=8)
RUN_FLAGS = ["--steps", "6", "--batch", "8", "--seq", "32", "--warmup", "2", "--dp", "2",
             "--gtp", "4", "--pad-for-alignment", "8"]

#: Per-step losses of the 2-process run vs the 1-process run. Both compute the same math on
#: the same batches and mesh, but the cross-process all-reduces (gloo) add the 8 per-device
#: partial sums in another order than the in-process CPU collectives, so float32 results
#: can differ by an ulp (about 6e-8 relative) per reduction; over 6 AdamW steps we measured
#: at most 1.7e-7. 1e-6 allows that and nothing more (a wrong batch split, a missing gradient
#: reduction or a lost process would change the loss in the 3rd or 2nd decimal). Both
#: reduction orders are fixed, so the difference is deterministic, not flaky.
LOSS_RTOL = 1e-6
#: What the coordination service prints when a process leaves under a pending call.
ERROR_TEXT = re.compile(r"CANCELLED|UNAVAILABLE|Connection refused|Traceback|DEADLINE_EXCEEDED")
#: The saved parameters and AdamW moments after 6 steps, per array: max |diff| / max |ref|.
#: Adam divides by sqrt(nu), so entries whose gradients are tiny (rounding noise) amplify
#: the reductions' ulp differences, most in the first update (about +-lr for every entry):
#: measured 8.0e-5 (the MLP's down projection) now that step 1 trains (at lr / 2 with this
#: warm-up), 2.4e-6 when it trained at rate 0; 6.4e-4 since the vocabulary-parallel head
#: (each token's log-sum-exp is one more float32 sum across devices). 2e-3 bounds that; a
#: wrong or missing reduction changes a moment by O(1) of itself. Deterministic (both
#: orders are fixed).
STATE_RTOL = 2e-3


def _free_ompi_port() -> int:
    """A free port that Open MPI's job-id rule maps to (JAX uses 61440 + id % 4096)."""
    for port in range(62000, 65536):
        with socket.socket() as s:
            try:
                s.bind(("localhost", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 62000..65535")


def _launch_env(process_id: int, port: int) -> tuple[dict[str, str], list[str]]:
    """How each process joins: process 0 by the JAX_* environment variables, process 1 as
    `mpirun` would start it (Open MPI's variables) with --distributed-auto, so both launch
    paths of `gtp_jax.train.processes.distributed` join one real run."""
    env = cli_env()  # the CLI gives each process 8 / 2 = 4 simulated devices
    if process_id == 0:
        env.update(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                   JAX_PROCESS_ID="0")
        return env, []
    env.update(OMPI_MCA_orte_hnp_uri=f"{(port - 61440) * 4096}.0;tcp://127.0.0.1:1",
               OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK=str(process_id),
               OMPI_COMM_WORLD_LOCAL_RANK=str(process_id))
    return env, ["--distributed-auto"]


def test_two_processes_match_one_process(tmp_path: Path) -> None:
    port = _free_ompi_port()
    procs = []
    for i in range(2):
        env, flags = _launch_env(i, port)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gtp_jax", "train", *RUN_FLAGS, *flags,
             "--metrics-json", str(tmp_path / f"metrics{i}.json"),
             "--checkpoint-dir", str(tmp_path / "ck2")],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        # The 1-process reference (8 devices, this pytest process) while they run.
        reference = train(RUN, progress=False, checkpoint=CheckpointConfig(tmp_path / "ck1"))
        outputs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i}\nstdout:\n{out}\nstderr:\n{err}"
        # A successful run ends cleanly: the distributed runtime is shut down in order
        # (barrier, clients, coordinator last), so no gRPC error text reaches the user.
        found = ERROR_TEXT.findall(out + err)
        assert not found, f"process {i} printed {found}:\n{err[-2000:]}"
        # gloo's connection reports (23 lines for this mesh) are not the user's business.
        assert "[Gloo]" not in out + err, out
    # Process 0 alone prints the summary, shows progress and writes metrics.
    assert "on 8 cpu devices in 2 processes" in outputs[0][0]
    assert "summary (cpu, mesh dp=2 ep=1 gtp=4 tp=1, 2 processes" in outputs[0][0]
    assert "step 6/6" in outputs[0][1]
    assert "summary" not in outputs[1][0] and "step 6/6" not in outputs[1][1]
    assert not (tmp_path / "metrics1.json").exists()

    metrics = json.loads((tmp_path / "metrics0.json").read_text())
    assert metrics["summary"]["process_count"] == 2
    assert metrics["summary"]["num_devices"] == 8
    losses = [s["loss"] for s in metrics["steps"]]
    assert len(losses) == len(reference.losses) == 6
    np.testing.assert_allclose(losses, reference.losses, rtol=LOSS_RTOL, atol=0)

    # Both processes wrote their own shards of one checkpoint; together they are the state.
    two = Checkpointer(CheckpointConfig(tmp_path / "ck2")).read_arrays(6)
    one = Checkpointer(CheckpointConfig(tmp_path / "ck1")).read_arrays(6)
    assert two.keys() == one.keys()
    for key, value in one.items():
        assert two[key].shape == value.shape and two[key].dtype == value.dtype, key
        assert max_rel_err(two[key], value) <= STATE_RTOL, key


class _Reader:
    """Collects a pipe's lines in a thread (the test waits for a line while the process
    runs, then reads the rest)."""

    def __init__(self, pipe) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)


#: What a survivor must not print: an abort stack, a Python traceback, the runtime's log
#: lines (``F1128 12:11:06.254683 24922 client.h:80] ...``), gloo's connection reports and
#: its abort (``terminate called after throwing an instance of 'gloo::...'``).
NOISE = re.compile(r"Check failure|Traceback|^[IWEF]\d{4} \d\d:\d\d|\[Gloo\]|^terminate called",
                   re.M)


#: The heartbeat timeout of the kill tests: a lost process is noticed within it (a short one
#: keeps the test from waiting out the default 30 s; `test_the_default_heartbeat_...`).
HEARTBEAT_S = 6
#: What the survivor takes beyond the heartbeat timeout to notice the loss and exit, at most.
NOTICE_S = 25


def test_the_default_heartbeat_timeout_ends_a_survivor_within_a_minute() -> None:
    """With the defaults, a survivor ends within 60 s of the loss: the heartbeat timeout
    the command line uses, plus what `test_a_process_killed_ends_the_other_with_one_line`
    allows beyond it."""
    from gtp_jax.train.cli.command import _parser

    args = _parser().parse_args(["train"])
    assert args.heartbeat_timeout == distributed.DEFAULT_HEARTBEAT_TIMEOUT
    assert distributed.DistributedConfig().heartbeat_timeout == args.heartbeat_timeout
    assert args.heartbeat_timeout + NOTICE_S <= 60


@pytest.mark.parametrize("victim", [0, 1], ids=["coordinator-lost", "peer-lost"])
def test_a_process_killed_ends_the_other_with_one_line(victim: int) -> None:
    # Started one by one, as a cluster scheduler does (no --processes launcher): the
    # survivor ends within the heartbeat timeout and a little, non-zero, with one line.
    with socket.socket() as s:  # a port of the system's choice: no other test's
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs, out, err = [], [], []
    for i in range(2):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gtp_jax", "train", "--steps", "500", "--batch", "8",
             "--seq", "16", "--layers", "1", "--dp", "2", "--gtp", "4", "--log-every", "1",
             "--coordinator", f"localhost:{port}", "--num-processes", "2",
             "--process-id", str(i), "--heartbeat-timeout", str(HEARTBEAT_S)],
            cwd=REPO_ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
        out.append(_Reader(procs[i].stdout))
        err.append(_Reader(procs[i].stderr))
    survivor = procs[1 - victim]
    try:
        deadline = time.monotonic() + 300
        while "step 2/" not in err[0].text():  # both train: every step has collectives
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                err[0].text() + err[1].text()
            time.sleep(0.2)
        os.kill(procs[victim].pid, signal.SIGKILL)
        killed = time.monotonic()
        survivor.wait(timeout=120)
        waited = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for reader in (out[1 - victim], err[1 - victim]):
        reader.thread.join(timeout=30)  # the last line is written as the process ends
    stderr, stdout = err[1 - victim].text(), out[1 - victim].text()
    assert waited < HEARTBEAT_S + NOTICE_S, (waited, stderr)
    assert survivor.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    assert errors[0].startswith(f"error: lost process {victim} of 2"), errors
    assert f"process {1 - victim} stops too" in errors[0]
    assert not NOISE.search(stderr + stdout), stderr + stdout


# ---------------------------------------------------------------------- errors


def test_distributed_config_validation() -> None:
    assert not DistributedConfig().enabled
    cfg = DistributedConfig(coordinator="node0:1234", num_processes=4, process_id=3,
                            local_device_ids=[2])
    assert cfg.enabled and cfg.local_device_ids == (2,)
    assert parse_address("[::1]:80") == ("::1", 80)
    bad = [
        ({"coordinator": "localhost", "num_processes": 2, "process_id": 0}, "HOST:PORT"),
        ({"coordinator": "localhost:99999", "num_processes": 2, "process_id": 0}, "1..65535"),
        ({"coordinator": "localhost:x", "num_processes": 2, "process_id": 0}, "1..65535"),
        ({"coordinator": "localhost:1234", "num_processes": 2, "process_id": 2},
         r"DistributedConfig\.process_id=2 must be in 0\.\.1"),
        ({"coordinator": "localhost:1234", "num_processes": 2, "process_id": -1},
         r"DistributedConfig\.process_id=-1 must be an int >= 0"),
        ({"coordinator": "localhost:1234", "num_processes": 0, "process_id": 0},
         r"DistributedConfig\.num_processes=0"),
        ({"coordinator": "localhost:1234", "process_id": 0}, "num_processes not set"),
        ({"coordinator": "a:1", "num_processes": 1, "process_id": 0, "local_device_ids": (1, 1)},
         "distinct"),
    ]
    for kwargs, message in bad:
        with pytest.raises(UsageError, match=message):
            DistributedConfig(**kwargs)
    with pytest.raises(UsageTypeError, match="DistributedConfig"):
        initialize({"coordinator": "localhost:1234"})  # type: ignore[arg-type]


def test_distributed_config_from_env() -> None:
    assert DistributedConfig.from_env({}) == DistributedConfig()
    env = {"JAX_COORDINATOR_ADDRESS": "h:5", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert DistributedConfig.from_env(env) == DistributedConfig("h:5", 2, 1)
    with pytest.raises(ValueError, match="JAX_PROCESS_ID not set"):
        DistributedConfig.from_env({k: v for k, v in env.items() if k != "JAX_PROCESS_ID"})
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' must be an integer"):
        DistributedConfig.from_env({**env, "JAX_NUM_PROCESSES": "two"})
    with pytest.raises(UsageError, match=r"process_id=5 must be in 0\.\.1"):
        DistributedConfig.from_env({**env, "JAX_PROCESS_ID": "5"})


def test_cli_rejects_bad_process_flags(capsys: pytest.CaptureFixture[str]) -> None:
    # In process: each of these fails before JAX starts or any process joins a run.
    cases = [
        (["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"],
         "--process-id=2 must be in 0..1 (--num-processes=2)"),
        (["--coordinator", "localhost:0", "--num-processes", "2", "--process-id", "0"],
         "1..65535"),
        (["--coordinator", "localhost:1", "--num-processes", "3", "--process-id", "0"],
         "--num-processes 3 does not divide the 8 devices"),
        (["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "0",
          "--local-device-ids", "0,a"], "--local-device-ids '0,a'"),
    ]
    for flags, message in cases:
        assert cli_main(["train", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert message in err, (flags, err)


class _FakeClient:
    def __init__(self, calls: list[str], fail: str | None = None):
        self.calls, self.fail = calls, fail

    def wait_at_barrier(self, name: str, timeout_ms: int) -> None:
        self.calls.append("barrier")
        if self.fail:
            raise RuntimeError(self.fail)

    def shutdown(self) -> None:
        self.calls.append("client")


class _FakeService:
    def __init__(self, calls: list[str]):
        self.calls = calls

    def shutdown(self) -> None:
        self.calls.append("service")


def _fake_run(monkeypatch: pytest.MonkeyPatch, state: object) -> None:
    monkeypatch.setattr(distributed.jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed, "_global_state", lambda: state)
    monkeypatch.setattr(distributed, "_SERVICE_GRACE_S", 0.0)


def test_shutdown_is_ordered_coordinator_last(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    state = types.SimpleNamespace(client=_FakeClient(calls), service=_FakeService(calls),
                                  preemption_sync_manager=None)
    _fake_run(monkeypatch, state)
    distributed.shutdown(timeout=5)
    assert calls == ["barrier", "client", "service"]
    assert state.client is None and state.service is None


def test_shutdown_names_the_peer_that_never_reached_the_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    state = types.SimpleNamespace(
        client=_FakeClient(calls, "DEADLINE_EXCEEDED: Barrier timed out. Tasks that did not "
                                  "arrive: /job:jax_worker/replica:0/task:1"),
        service=_FakeService(calls), preemption_sync_manager=None)
    _fake_run(monkeypatch, state)
    with pytest.raises(distributed.DistributedPeerError) as err:
        distributed.shutdown(timeout=5)
    msg = str(err.value)
    assert msg.startswith("process 0 finished the run, but process 1 did not reach its end")
    assert "\n" not in msg
    assert calls == ["barrier"]  # nothing shut down under a failed peer: JAX ends the run


def test_a_runtime_error_waits_for_the_report_of_a_lost_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A collective whose peer was killed fails before JAX's report names the lost process:
    # the process waits (at most the heartbeat timeout) for that report, which ends it.
    slept: list[float] = []
    monkeypatch.setattr(distributed.time, "sleep", slept.append)
    cfg = DistributedConfig("localhost:1234", 2, 1, heartbeat_timeout=7)
    distributed.wait_for_lost_peer(distributed.jax.errors.JaxRuntimeError("gloo: closed"), cfg)
    assert slept == [7 + distributed._LOSS_REPORT_MARGIN_S]
    distributed.wait_for_lost_peer(ValueError("a bug"), cfg)  # other errors: at once
    distributed.wait_for_lost_peer(distributed.jax.errors.JaxRuntimeError("x"),
                                   DistributedConfig())  # one process: at once
    assert len(slept) == 1
