"""Shared set-up for the gtp_jax test suite.

The simulated 8-device CPU mesh must be configured before JAX is imported anywhere, so this
module sets ``XLA_FLAGS`` / ``JAX_PLATFORMS`` at import time (pytest imports conftest.py
before any test module).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

NUM_DEVICES = 8

_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                os.environ.get("XLA_FLAGS", ""))
# The tests' programs are tiny and compile-bound. LLVM's cheap pipeline, one codegen thread
# per program (the runner's cores already run two tests at once) and the CPU backend's
# classic loop emitters instead of its fusion emitters compile them in about half the CPU
# time (test_tp + test_ring_attention: 175 -> 80 CPU-seconds). Every comparison is between
# programs compiled with the same flags.
COMPILE_FAST_CANDIDATES = (
    "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_parallel_codegen_split_count=1", "--xla_cpu_use_fusion_emitters=false")


def _known_xla_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    """The `flags` this jaxlib's XLA knows. XLA aborts the process on a flag it does not know
    (jaxlib 0.11 dropped ``--xla_cpu_use_fusion_emitters``), so they are tried in a child
    process first: once per run (the pytest-xdist workers and the tests' subprocesses read
    the answer from the environment)."""
    known = os.environ.get("GTP_JAX_TESTS_XLA_FLAGS")
    if known is not None:
        return tuple(known.split())

    def accepted(candidate: tuple[str, ...]) -> bool:
        env = {**os.environ, "XLA_FLAGS": " ".join(candidate), "JAX_PLATFORMS": "cpu"}
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                              capture_output=True).returncode == 0

    known = flags if accepted(flags) else tuple(f for f in flags if accepted((f,)))
    os.environ["GTP_JAX_TESTS_XLA_FLAGS"] = " ".join(known)
    return known


COMPILE_FAST = " ".join(_known_xla_flags(COMPILE_FAST_CANDIDATES))
os.environ["XLA_FLAGS"] = (f"{_flags} {COMPILE_FAST} "
                           f"--xla_force_host_platform_device_count={NUM_DEVICES}").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# No Python source locations in the lowered programs (the tests' own process and their
# command-line subprocesses): building them for every operation of every lowered program
# took about a tenth of a test file's time (tests/test_stack.py: 37.6 -> 33.5 s, -n 0).
# The programs are the same; only their metadata lacks the source file and line.
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
# Many tests compile the same programs (the same small models, built in different closures,
# which jit's in-memory cache does not match). A persistent compilation cache, fresh for each
# run and shared with the test's subprocesses, compiles each distinct program once: about
# 15% less wall time on 2 cores.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="gtp_jax_tests_xla_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402
from helpers import get_mesh, test_key, test_seed  # noqa: E402

# --------------------------------------------------------------------------- scheduling

#: The files that take longest (CPU seconds with -n 0 on 2 cores: README.md's commands about
#: 170, the others 20-75), longest first. Each file runs whole on one pytest-xdist worker
#: (`pytest_xdist_make_scheduler`), and the workers take the files in this order, then the
#: others in file order, so that no long file starts last while the other worker idles. A
#: file missing here costs only balance, never a test.
LONGEST_FIRST = (
    "test_readme.py", "test_reliability.py", "test_context_parallel.py", "test_lifecycle.py",
    "test_fp8_delayed.py", "test_ntp_train.py", "test_offload.py", "test_fp8_compute.py",
    "test_plan.py", "test_master_weights.py", "test_train.py", "test_checkpoint.py",
    "test_moe.py", "test_flash_block.py", "test_ring_attention.py", "test_equivalence.py",
    "test_prefetch.py", "test_multiprocess.py", "test_lowp_gather.py", "test_loop_memory.py",
    "test_notebooks.py", "test_unrolled_loop.py", "test_step.py", "test_launch.py",
    "test_shard_contract.py", "test_hf.py", "test_tp.py")

#: Files whose tests share expensive module- or session-scoped fixtures: kept on one worker
#: even when a run of a few files schedules the other files' tests one by one.
SHARED_FIXTURE_FILES = frozenset({
    "test_checkpoint.py", "test_collective_matmul.py", "test_context_parallel.py",
    "test_data.py", "test_equivalence.py", "test_lifecycle.py", "test_nonuniform.py",
    "test_notebooks.py", "test_ntp_train.py", "test_reliability.py", "test_step.py",
    "test_tp.py"})

#: Files whose tests are independent and long (each of test_readme.py's pages runs its own
#: commands, 10-80 s): scheduled test by test even in a whole-suite run, so that the longest
#: page does not hold the other pages on one worker.
PER_TEST_FILES = frozenset({"test_readme.py"})

#: `pytest -m smoke`: the quick first run (about a minute on 2 cores): configuration and
#: usage errors, meshes, the layering rule, the kernels' references, and the core promise,
#: a sharded model that computes what the unsharded one does (tests/test_equivalence.py,
#: tests/test_shard_init.py).
SMOKE_FILES = frozenset({
    "test_config.py", "test_data.py", "test_errors.py", "test_usage_errors.py",
    "test_mesh.py", "test_layering.py", "test_paths.py", "test_schedule.py",
    "test_kernels.py", "test_trace.py", "test_host_memory.py", "test_plan_paper.py",
    "test_written_state.py", "test_collective_matmul.py", "test_cross_entropy.py",
    "test_elementwise.py", "test_equivalence.py", "test_shard_init.py"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: it reads the smoke marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the `SMOKE_FILES` tests ``smoke``; orders the files as `LONGEST_FIRST` says
    (the rest after them, in file order; tests keep their order within a file)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    for item in items:
        if item.path.name in SMOKE_FILES:
            item.add_marker(pytest.mark.smoke)
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """pytest-xdist's scope scheduling with one scope per file, taken in collection order:
    a file's tests share their module fixtures and compiled programs on one worker (split
    over two, each worker traced and compiled them again: about a tenth more CPU time),
    but for the `PER_TEST_FILES`, whose tests are scheduled one by one.
    A run of fewer files than 4 per worker (say one file with ``-n 2``) schedules each test
    on its own instead, but for the `SHARED_FIXTURE_FILES`. (The ``xdist_group`` marks do
    not group with current pytest: the node-id suffix they rely on is no longer read.)"""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep `pytest_collection_modifyitems`' order

    class FileScheduling(LoadScopeScheduling):
        per_file = True

        def schedule(self) -> None:
            if self.collection is None:  # the first call: the collection is complete
                nodeids = next(iter(self.registered_collections.values()))
                files = {nodeid.split("::", 1)[0] for nodeid in nodeids}
                self.per_file = len(files) >= 4 * len(self.nodes)
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            name = path.rsplit("/", 1)[-1]
            if name in PER_TEST_FILES:
                return nodeid
            return path if self.per_file or name in SHARED_FIXTURE_FILES else nodeid

    return FileScheduling(config, log)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def key(request: pytest.FixtureRequest) -> jax.Array:
    """A PRNG key unique to the requesting test."""
    return test_key(request.node.nodeid)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    return test_seed(request.node.nodeid)


@pytest.fixture(scope="session")
def mesh_gtp8() -> jax.sharding.Mesh:
    return get_mesh("gtp8")


@pytest.fixture(scope="session")
def mesh_dp2_gtp4() -> jax.sharding.Mesh:
    return get_mesh("dp2_gtp4")


@pytest.fixture(scope="session")
def mesh_dp8() -> jax.sharding.Mesh:
    return get_mesh("dp8_gtp1")


@pytest.fixture(scope="session", autouse=True)
def _eight_devices() -> None:
    assert jax.device_count() == NUM_DEVICES, (
        f"expected {NUM_DEVICES} simulated devices, got {jax.devices()}; XLA_FLAGS must be "
        "set before JAX is imported")
