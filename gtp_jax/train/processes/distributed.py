"""Multi-process runs: one JAX process per host (or per GPU), joined by `jax.distributed`.

Every process runs the same program on its local devices; `jax.devices()` then lists the
devices of all processes and the mesh (`gtp_jax.make_mesh`) spans them. Process 0 runs the
coordination service at ``coordinator`` (``HOST:PORT``, reachable from every process).
Across processes, CPU collectives go through gloo and GPU collectives through NCCL.

Launch (the same command on every process, only ``--process-id`` differs)::

    # CPU, 2 local processes x 4 simulated devices each (mesh dp=2 x gtp=4)
    python -m gtp_jax train --coordinator localhost:12355 --num-processes 2 --process-id 0 &
    python -m gtp_jax train --coordinator localhost:12355 --num-processes 2 --process-id 1

    # GPUs, one process per host (all local GPUs), e.g. 2 hosts x 8 GPUs
    python -m gtp_jax train --coordinator host0:12355 --num-processes 2 --process-id $RANK \\
        --dp 2 --gtp 8

    # GPUs, one process per GPU on one 8-GPU host
    for i in $(seq 0 7); do python -m gtp_jax train --coordinator localhost:12355 \\
        --num-processes 8 --process-id $i --local-device-ids $i --gtp 8 & done

Instead of the flags, ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID`` may be set (all three), or ``--distributed-auto`` lets JAX detect a
SLURM, Open MPI, Kubernetes or Cloud TPU job (`jax.distributed.initialize` with no args).

A process that is lost (killed, crashed, its host gone) ends the others: JAX does it, at
once when the coordinator's process is lost, else once the coordination service has missed
its heartbeats for `DistributedConfig.heartbeat_timeout` seconds. The command line prints
that as one line naming the lost process (`gtp_jax.train.processes.output_guard`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import jax

from gtp_jax.base.errors import UsageError, UsageTypeError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
#: `jax.distributed.initialize`'s default ``initialization_timeout`` (seconds).
DEFAULT_TIMEOUT = 300
#: Seconds without heartbeats after which the coordination service counts a process as lost
#: and ends the others (JAX's default, 100 s, left survivors waiting 50 to 90 s after a
#: ``kill -9``). The heartbeats come from a thread of the runtime, not from Python, so a
#: long compilation or a busy host does not delay them.
DEFAULT_HEARTBEAT_TIMEOUT = 30


class DistributedJoinError(RuntimeError):
    """This process could not join the multi-process run (a peer or the coordinator never
    came); the message names the coordinator, the expected processes and this process."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run.

    Attributes:
      coordinator: ``HOST:PORT`` of process 0's coordination service (``[v6addr]:PORT``
        for IPv6). None together with `num_processes` and `process_id`: a single process.
      num_processes: number of processes in the run, >= 1.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      local_device_ids: the local devices this process uses (e.g. ``(3,)`` for one process
        per GPU); None: all visible devices.
      auto: let JAX detect the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU); the three
        fields above may then stay None.
      timeout: seconds to wait for every process to join (``initialization_timeout`` of
        `jax.distributed.initialize`), >= 1.
      heartbeat_timeout: seconds without heartbeats after which a process counts as lost
        and every other process ends (``heartbeat_timeout_seconds`` of
        `jax.distributed.initialize`), >= 2; the command line then prints one line naming
        the lost process (`gtp_jax.train.processes.output_guard`).
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    auto: bool = False
    timeout: int = DEFAULT_TIMEOUT
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT

    def __post_init__(self) -> None:
        given = {"coordinator": self.coordinator, "num_processes": self.num_processes,
                 "process_id": self.process_id}
        if not self.auto and any(v is not None for v in given.values()):
            missing = [k for k, v in given.items() if v is None]
            if missing:
                names = ", ".join(f"DistributedConfig.{k}" for k in missing)
                raise UsageError(
                    f"{names} not set; a multi-process run needs DistributedConfig.coordinator "
                    "(HOST:PORT), DistributedConfig.num_processes and DistributedConfig.process_id"
                    " on every process (or DistributedConfig.auto under SLURM/Open MPI)."
                )
        if self.coordinator is not None:
            parse_address(self.coordinator)
        if self.num_processes is not None:
            _check_int("num_processes", self.num_processes, 1)
        if self.process_id is not None:
            _check_int("process_id", self.process_id, 0)
            if self.num_processes is not None and self.process_id >= self.num_processes:
                raise UsageError(
                    f"DistributedConfig.process_id={self.process_id} must be in "
                    f"0..{self.num_processes - 1} (DistributedConfig.num_processes="
                    f"{self.num_processes})."
                )
        if self.local_device_ids is not None:
            ids = tuple(self.local_device_ids)
            for i in ids:
                _check_int("local_device_ids", i, 0)
            if not ids or len(set(ids)) != len(ids):
                raise UsageError(
                    f"DistributedConfig.local_device_ids={ids} must be distinct device ids, "
                    "e.g. (0,) or (0, 1)."
                )
            object.__setattr__(self, "local_device_ids", ids)
        if not isinstance(self.auto, bool):
            raise UsageTypeError(f"DistributedConfig.auto={self.auto!r} must be a bool.")
        _check_int("timeout", self.timeout, 1)
        _check_int("heartbeat_timeout", self.heartbeat_timeout, 2)

    @property
    def enabled(self) -> bool:
        """Whether `initialize` calls `jax.distributed.initialize`."""
        return self.auto or self.coordinator is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistributedConfig:
        """Reads ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``.

        Returns a single-process config when none is set.

        Raises:
          UsageError: only some are set, or a value is not an int.
        """
        env = os.environ if env is None else env
        names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
        values = {n: env.get(n) for n in names}
        if all(v is None for v in values.values()):
            return cls()
        missing = [n for n, v in values.items() if v is None]
        if missing:
            present = [n for n in names if n not in missing]
            raise UsageError(
                f"{', '.join(missing)} not set while {', '.join(present)} is; set all three "
                "environment variables or none."
            )
        ints = {}
        for name in (ENV_NUM_PROCESSES, ENV_PROCESS_ID):
            try:
                ints[name] = int(values[name])
            except ValueError as err:
                raise UsageError(f"{name}={values[name]!r} must be an integer.") from err
        return cls(coordinator=values[ENV_COORDINATOR], num_processes=ints[ENV_NUM_PROCESSES],
                   process_id=ints[ENV_PROCESS_ID])


def parse_address(address: str) -> tuple[str, int]:
    """``"host:1234"`` / ``"[::1]:1234"`` -> (host, port); UsageError naming the fix."""
    if not isinstance(address, str) or ":" not in address:
        raise UsageError(
            f"DistributedConfig.coordinator={address!r} must be HOST:PORT, e.g. "
            "localhost:12355."
        )
    host, _, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not host or not 1 <= port <= 65535:
        raise UsageError(
            f"DistributedConfig.coordinator={address!r}: need a host and a port in 1..65535, "
            "e.g. localhost:12355."
        )
    return host, port


def initialize(config: DistributedConfig) -> None:
    """Joins the run described by `config` (no-op for a single process).

    Call before anything touches a JAX backend (device queries, arrays). Blocks until all
    `num_processes` processes have joined, at most `DistributedConfig.timeout` seconds.

    JAX terminates the process (a C++ fatal error that Python cannot catch) when the join
    times out, so a watchdog thread reports first: at the deadline it writes one line to
    stderr naming the coordinator, the expected process count and this process's id, and
    exits with status 1. (JAX's own timeout is set a little later, as a backstop.)

    Raises:
      DistributedJoinError: joining failed with an exception (names the coordinator, the
        expected process count and this process's id).
    """
    if not isinstance(config, DistributedConfig):
        raise UsageTypeError(
            f"initialize expects a DistributedConfig, got {type(config).__name__}.")
    if not config.enabled or jax.distributed.is_initialized():
        return
    try:
        # Cross-process collectives on CPU; this is already the default on current JAX, set
        # explicitly because older versions defaulted to none (single-process CPU only).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):  # pragma: no cover - option renamed or removed
        pass
    done = threading.Event()
    watchdog = threading.Thread(target=_join_watchdog, args=(config, done), daemon=True,
                                name="gtp_jax-join-watchdog")
    watchdog.start()
    try:
        if config.auto and config.coordinator is None:
            jax.distributed.initialize(local_device_ids=config.local_device_ids,
                                       initialization_timeout=config.timeout + _JAX_MARGIN_S,
                                       heartbeat_timeout_seconds=config.heartbeat_timeout)
            return
        jax.distributed.initialize(
            coordinator_address=config.coordinator,
            num_processes=config.num_processes,
            process_id=config.process_id,
            local_device_ids=list(config.local_device_ids) if config.local_device_ids else None,
            initialization_timeout=config.timeout + _JAX_MARGIN_S,
            heartbeat_timeout_seconds=config.heartbeat_timeout,
        )
    except Exception as err:  # XlaRuntimeError (DEADLINE_EXCEEDED, UNAVAILABLE, ...)
        if isinstance(err, UsageError):
            raise
        detail = " ".join(str(err).split())[:300]
        raise DistributedJoinError(f"{_join_failure(config)}: {_missing_peers(detail)}{detail}") \
            from err
    finally:
        done.set()


#: Seconds JAX's own initialization timeout runs past `DistributedConfig.timeout`.
_JAX_MARGIN_S = 10


def _join_failure(config: DistributedConfig) -> str:
    return (f"process {config.process_id} could not join the run of {config.num_processes} "
            f"processes at coordinator {config.coordinator} within {config.timeout} s "
            "(DistributedConfig.timeout)")


def _join_watchdog(config: DistributedConfig, done: threading.Event) -> None:
    if done.wait(config.timeout):
        return
    if config.process_id == 0:
        n = config.num_processes or 2
        peers = list(range(1, n)) if n <= 9 else f"1..{n - 1}"
        why = (f"some of the processes {peers} never registered with this process's "
               "coordination service; check that they were started with the same coordinator "
               "address and process count")
    else:
        why = "the coordinator (process 0) did not answer; check that it runs and is reachable"
    # Written here, not by the caller: the main thread never returns from JAX.
    sys.stderr.write(f"error: {_join_failure(config).replace(' (DistributedConfig.timeout)', '')}"
                     f": {why}.\n")
    sys.stderr.flush()
    os._exit(1)  # the main thread is blocked inside JAX; only a hard exit ends it cleanly


def _missing_peers(detail: str) -> str:
    """``"missing process ids [..]; "`` when JAX's error lists the tasks that never joined."""
    ids = _task_ids(detail)
    return f"processes {ids} did not join; " if ids else ""


def _task_ids(detail: str) -> list[int]:
    """The process ids of the ``/task:N`` names in a coordination-service error."""
    import re  # noqa: PLC0415

    return sorted({int(m) for m in re.findall(r"/task:(\d+)", detail)})


#: Environment variables that hold the process count, by launcher: JAX's own, Open MPI,
#: MPICH / PMI, SLURM.
_PROCESS_COUNT_VARS = ("JAX_NUM_PROCESSES", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS",
                       "SLURM_NPROCS")


def joined_process_count(config: DistributedConfig) -> int:
    """Number of processes in the run, readable after `initialize` and before any backend.

    With ``auto`` the count comes from the detected cluster (JAX's distributed state), so a
    launcher may set up simulated CPU devices per process before the CPU backend starts.
    """
    if config.num_processes is not None:
        return config.num_processes
    if not config.enabled:
        return 1
    # The launchers JAX detects announce the process count in their environment; reading it
    # here needs no backend (and no private JAX state).
    for name in _PROCESS_COUNT_VARS:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


class DistributedPeerError(RuntimeError):
    """A peer process did not reach the end of the run (it failed or was killed); the
    message names this process and the ones that did not arrive."""


#: Seconds the coordinator keeps its coordination service up after every process has
#: disconnected its client: their last calls (the shutdown barrier's answer, the error
#: poll) finish against a live service instead of seeing it vanish.
_SERVICE_GRACE_S = 0.5


def shutdown(timeout: int = DEFAULT_TIMEOUT) -> None:
    """Leaves the run in order (all processes call it at the end); no-op for one process.

    1. A barrier: every process has reached the end of the run (at most `timeout` s).
    2. Every process disconnects its client from the coordination service (JAX's own
       shutdown barrier).
    3. The coordinator (process 0) stops the service last, after a short grace, so no
       process sees the service vanish under a pending call (gRPC ``CANCELLED`` /
       ``UNAVAILABLE ... Connection refused`` lines at the end of a successful run).

    Raises:
      DistributedPeerError: a process did not reach the end (one line naming this process
        and, when JAX says, the missing ones).
    """
    if not jax.distributed.is_initialized():
        return
    state = _global_state()
    me = jax.process_index()
    client = getattr(state, "client", None)
    if client is not None and hasattr(client, "wait_at_barrier"):
        try:
            client.wait_at_barrier("gtp_jax_run_end", int(timeout * 1000))
        except Exception as err:  # XlaRuntimeError: DEADLINE_EXCEEDED, a task failed, ...
            detail = " ".join(str(err).split())[:200]
            ids = _task_ids(detail)
            who = f"process {ids[0]}" if len(ids) == 1 else (
                f"processes {ids}" if ids else "another process")
            raise DistributedPeerError(
                f"process {me} finished the run, but {who} did not reach its end within "
                f"{timeout} s (failed or stopped; see its output): {detail}") from err
    service = getattr(state, "service", None)
    if service is None or client is None:
        jax.distributed.shutdown()
        return
    # The coordinator: disconnect the client (waits for every process's), then the service.
    if getattr(state, "preemption_sync_manager", None) is not None:
        state.preemption_sync_manager.shutdown()
        state.preemption_sync_manager = None
    client.shutdown()
    state.client = None
    time.sleep(_SERVICE_GRACE_S)
    service.shutdown()
    state.service = None


#: Seconds past the heartbeat timeout that a process whose run failed inside the runtime
#: waits for JAX's report of a lost process (see `wait_for_lost_peer`).
_LOSS_REPORT_MARGIN_S = 5


def wait_for_lost_peer(err: BaseException, config: DistributedConfig) -> None:
    """Called with the exception that ended this process's part of a multi-process run:
    when it came from the runtime (a collective or barrier whose peer is gone), waits until
    JAX's report of the lost process ends this process, at most the heartbeat timeout and
    a margin; returns at once for any other exception, or once the wait is over.

    A peer killed mid-collective fails this process's collective at once (gloo: "connection
    closed by peer"), before the coordination service says which process was lost: the
    command line's output guard names it only from that report
    (`gtp_jax.train.processes.output_guard`)."""
    if not config.enabled or not _is_runtime_error(err):
        return
    time.sleep(config.heartbeat_timeout + _LOSS_REPORT_MARGIN_S)


def _is_runtime_error(err: BaseException) -> bool:
    """Whether `err` is XLA's runtime error (``JaxRuntimeError``, ``XlaRuntimeError``)."""
    runtime = getattr(jax.errors, "JaxRuntimeError", None)
    if runtime is not None and isinstance(err, runtime):
        return True
    return type(err).__name__ in ("JaxRuntimeError", "XlaRuntimeError")


def coordination_client() -> object:
    """The coordination service's client of this process (``key_value_set``,
    ``key_value_dir_get``, ``wait_at_barrier``); for host-side agreement between processes
    that must not wait for the devices.

    Raises:
      RuntimeError: this process did not join a multi-process run.
    """
    client = getattr(_global_state(), "client", None)
    if client is None:
        raise RuntimeError("no coordination service client: jax.distributed is not "
                           "initialized in this process.")
    return client


def _global_state() -> object:
    """JAX's distributed state (client and, on process 0, the coordination service); an
    empty object where a JAX version keeps it elsewhere (then `jax.distributed.shutdown`
    alone ends the run)."""
    try:
        from jax._src import distributed as jax_distributed  # noqa: PLC0415
    except ImportError:  # pragma: no cover - moved in a later JAX
        return object()
    return getattr(jax_distributed, "global_state", object())


def is_primary() -> bool:
    """True on the process that prints and writes run-level files (process 0)."""
    return jax.process_index() == 0


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"DistributedConfig.{name}={value!r} must be an int >= {minimum}.")


__all__: Sequence[str] = ("DEFAULT_HEARTBEAT_TIMEOUT", "DEFAULT_TIMEOUT", "DistributedConfig",
                          "DistributedJoinError", "DistributedPeerError",
                          "initialize", "is_primary", "parse_address", "shutdown",
                          "wait_for_lost_peer")
