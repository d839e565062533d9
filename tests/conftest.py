"""Shared set-up for the gtp_jax test suite.

The simulated 8-device CPU mesh must be configured before JAX is imported anywhere, so this
module sets ``XLA_FLAGS`` / ``JAX_PLATFORMS`` at import time (pytest imports conftest.py
before any test module).
"""

from __future__ import annotations

import os
import re
import tempfile

NUM_DEVICES = 8

_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                os.environ.get("XLA_FLAGS", ""))
# The tests' programs are tiny and compile-bound. LLVM's cheap pipeline, one codegen thread
# per program (the runner's cores already run two tests at once) and the CPU backend's
# classic loop emitters instead of its fusion emitters compile them in about half the CPU
# time (test_tp + test_ring_attention: 175 -> 80 CPU-seconds). Every comparison is between
# programs compiled with the same flags.
COMPILE_FAST = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_parallel_codegen_split_count=1 --xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = (f"{_flags} {COMPILE_FAST} "
                           f"--xla_force_host_platform_device_count={NUM_DEVICES}").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
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

#: Files whose tests share expensive module- or session-scoped fixtures: their tests stay on
#: one pytest-xdist worker (`pytest_xdist_make_scheduler`); every other test is scheduled on
#: its own.
SHARED_FIXTURE_FILES = frozenset({
    "test_checkpoint.py", "test_collective_matmul.py", "test_context_parallel.py",
    "test_data.py", "test_equivalence.py", "test_lifecycle.py", "test_nonuniform.py",
    "test_notebooks.py", "test_ntp_train.py", "test_reliability.py", "test_step.py",
    "test_tp.py"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The README test (the longest) and the slow-marked tests first (started last, they
    would leave the other worker idle at the end), the rest in file order."""
    items.sort(key=lambda item: (item.path.name != "test_readme.py",  # the longest test
                                 not item.get_closest_marker("slow")))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """pytest-xdist's scope scheduling with one scope per file of `SHARED_FIXTURE_FILES`
    and one per test elsewhere. (Its ``xdist_group`` marks do not group with current pytest:
    the node-id suffix they rely on is no longer read, so a module fixture was built once
    on each worker.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.rsplit("/", 1)[-1] in SHARED_FIXTURE_FILES else nodeid

    return SharedFixtureScheduling(config, log)


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
