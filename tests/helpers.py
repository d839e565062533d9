"""Helpers shared by the test modules: meshes, a user module, state snapshots, tolerances.

Import with ``from helpers import ...``; ``conftest.py`` (loaded first by pytest) has already
set up the 8 simulated CPU devices these helpers rely on.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import subprocess
import sys
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import gtp_jax

#: Mesh layouts used across the suite (name -> make_mesh kwargs); all use 8 devices.
MESHES: dict[str, dict[str, int]] = {
    "gtp8": {"gtp": 8},
    "dp2_gtp4": {"dp": 2, "gtp": 4},
    "dp8_gtp1": {"dp": 8},
    "ep2_gtp2_tp2": {"ep": 2, "gtp": 2, "tp": 2},
    "dp2_gtp2_tp2": {"dp": 2, "gtp": 2, "tp": 2},
    "gtp2_tp4": {"gtp": 2, "tp": 4},
    "cp2_gtp2_tp2": {"cp": 2, "gtp": 2, "tp": 2},
}


#: Whether the `tensorboard` extra is installed (`.[test]` installs it): without it a
#: ``--log-dir`` run writes ``metrics.jsonl`` and says in one line that it writes no event
#: files, which the tests then check instead.
HAS_TENSORBOARD = importlib.util.find_spec("tensorboardX") is not None


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a ``python -m gtp_jax`` subprocess: this one's, on the CPU, with the
    suite's cheap-compile XLA flags (tests/conftest.py: a command-line run of 20 steps takes
    half the CPU time with them) but not its simulated device count, which the command line
    sets itself."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   os.environ.get("XLA_FLAGS", "")).strip()
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", **extra}


#: The CLI in a child process, holding after it printed step 2's line until a stop is
#: requested, so that the test's signal always lands in the middle of the run. Every step's
#: line is printed (the bar prints every 5th step when not on a terminal).
HELD_CHILD = """
import sys, threading
from gtp_jax.train.lifecycle import preempt
from gtp_jax.train.outputs import progress
asked = threading.Event()
request = preempt.StopRequest.request
def record(self, signum=0):
    request(self, signum)
    asked.set()
preempt.StopRequest.request = record
update = progress.ProgressBar.update
def update_and_hold(self, step, keep=False, **metrics):
    update(self, step, keep=True, **metrics)
    # Short waits: a signal may land on one of JAX's threads, and the handler then runs
    # only when the main thread is back in the interpreter loop.
    for _ in range(6000 if step == 2 else 0):
        if asked.wait(0.05):
            break
progress.ProgressBar.update = update_and_hold
from gtp_jax.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def held_child(flags: list[str], cwd: Any, *paths: Any) -> subprocess.Popen:
    """``python -m gtp_jax <flags>`` in a child process (`HELD_CHILD`: it holds after step
    2 until it is asked to stop), in `cwd`, with `paths` first on its PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*map(str, paths), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", HELD_CHILD, *flags], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step_2(proc: subprocess.Popen) -> list[str]:
    """The child's stderr lines up to its step 2 progress line (it holds there)."""
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if " step 2/" in line:
            return seen
    raise AssertionError("the run ended before step 2: " + "".join(seen))


def train_until(run: Any, directory: Any, stop_after: int) -> list[float]:
    """Runs `gtp_jax.train.train(run)` with a checkpoint every `stop_after` steps into
    `directory` and stops it (as a preempted job) right after step `stop_after`; returns the
    losses of the steps that ran."""
    from gtp_jax.train import CheckpointConfig, train

    class Preempted(Exception):
        pass

    losses: list[float] = []

    def stop(step: int, loss: float, seconds: float) -> None:
        losses.append(loss)
        if step == stop_after:
            raise Preempted

    try:
        train(run, progress=False, on_step=stop,
              checkpoint=CheckpointConfig(directory, every=stop_after))
    except Preempted:
        return losses
    raise AssertionError(f"the run ended before step {stop_after}")


@functools.cache
def get_mesh(name: str) -> jax.sharding.Mesh:
    """The (cached) mesh called `name` in `MESHES`."""
    return gtp_jax.make_mesh(**MESHES[name])


@contextlib.contextmanager
def jax_events(event: str) -> Iterator[list[str]]:
    """Within: the list of the ``fun_name`` of each JAX duration `event` recorded (e.g.
    ``"/jax/core/compile/backend_compile_duration"``: one per compiled program)."""
    names: list[str] = []

    def on_duration(name: str, seconds: float, **kwargs: object) -> None:
        if name == event:
            names.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)


def test_key(nodeid: str, salt: int = 0) -> jax.Array:
    """A PRNG key unique to one test (and `salt`), so every test draws fresh inputs."""
    return jax.random.fold_in(jax.random.key(zlib.crc32(nodeid.encode())), salt)


test_key.__test__ = False  # not a test, despite the name


def test_seed(nodeid: str) -> int:
    """An int seed unique to one test (for ``nnx.Rngs``)."""
    return zlib.crc32(nodeid.encode()) % (2**31)


test_seed.__test__ = False


# --------------------------------------------------------------------------- a user module


class Mixed(nnx.Module):
    """A user-defined module (not from gtp_jax) mixing the NNX layer types GTP must handle.

    Every dimension is prime or otherwise indivisible by the mesh axis sizes (2, 4, 8), so
    every sharded weight needs padding: embedding (37, 50), Linear (50, 29), Einsum kernel
    (29, 3, 13) and bias (3, 13), LinearGeneral kernel (3, 13, 7); the rank-1 biases stay
    replicated. Input: int tokens ``[batch, seq]`` < 37; output ``[batch, seq, 7]``.
    """

    VOCAB = 37

    def __init__(self, rngs: nnx.Rngs, dtype: Any = None, param_dtype: Any = jnp.float32):
        common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.embed = nnx.Embed(self.VOCAB, 50, **common)
        self.lin = nnx.Linear(50, 29, **common)
        self.ein = nnx.Einsum("bsd,dhk->bshk", (29, 3, 13), (3, 13), **common)
        self.gen = nnx.LinearGeneral((3, 13), 7, axis=(-2, -1), **common)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.embed(tokens)
        h = jnp.tanh(self.lin(h))
        h = jax.nn.gelu(self.ein(h))
        return self.gen(h)


def mixed_tokens(key: jax.Array, batch: int = 16, seq: int = 5) -> jax.Array:
    return jax.random.randint(key, (batch, seq), 0, Mixed.VOCAB)


def mse_loss(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    return jnp.mean(model(tokens).astype(jnp.float32) ** 2)


# --------------------------------------------------------------------------- state helpers


def flat_state(tree: Any, filt: Any = nnx.Param) -> dict[tuple, nnx.Variable]:
    """``{path: Variable}`` of a graph node such as a module or optimizer (filtered by `filt`)
    or of a `nnx.State` (unfiltered)."""
    state = tree if isinstance(tree, nnx.State) else nnx.state(tree, filt)
    return {tuple(k): v for k, v in nnx.to_flat_state(state)}


def flat_values(tree: Any, filt: Any = nnx.Param) -> dict[tuple, jax.Array]:
    """``{path: array}``; `tree` is a module, a `nnx.State`, or already such a dict."""
    if isinstance(tree, dict) and not isinstance(tree, nnx.State):
        return dict(tree)
    return {k: v.get_value() for k, v in flat_state(tree, filt).items()}


def path_str(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def plan_by_path(sharded: gtp_jax.ShardedModule) -> dict[str, Any]:
    return {p.path: p for p in sharded.plan}


def unpad(value: Any, plan: Any, logical_shape: tuple[int, ...]) -> np.ndarray:
    """Slices a padded global array of `plan` back to `logical_shape`, asserting that the
    padding region exists with the planned size and holds exactly zero."""
    arr = np.asarray(value)
    dim = plan.stored_dim
    expected = list(logical_shape)
    expected[dim] = plan.spec.padded_size
    assert arr.shape == tuple(expected), (
        f"{plan.path}: stored shape {arr.shape}, expected padded shape {tuple(expected)}")
    logical = logical_shape[dim]
    padding = np.take(arr, np.arange(logical, arr.shape[dim]), axis=dim)
    assert not np.any(padding), (
        f"{plan.path}: padding rows {logical}..{arr.shape[dim]} on dim {dim} are not zero "
        f"(max |pad| = {np.max(np.abs(padding.astype(np.float32)))})")
    return np.take(arr, np.arange(logical), axis=dim)


def max_rel_err(actual: Any, expected: Any) -> float:
    """max|actual - expected| / max|expected| (in float64; scale 1 when expected is all 0)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    return float(np.max(np.abs(a - e))) / (scale or 1.0) if e.size else 0.0


def assert_close(actual: Any, expected: Any, rtol: float, what: str = "") -> None:
    err = max_rel_err(actual, expected)
    assert err <= rtol, f"{what}: max rel error {err:.3e} > {rtol:.1e}"


def params_rtol(steps: int, rtol: float) -> float:
    """The tolerance of parameters after `steps` optimizer steps whose every gradient matched
    within `rtol`: `rtol` after the first, growing by half of it per step. With a Lipschitz
    update (AdamW with a large ``eps``) each step's update is within the gradients'
    tolerance, and those differences add up (float32, 8 devices against one: about 2e-6 per
    step; 1.06e-5 after 5 steps of the scanned prefetching loop on a CPU with AVX-512 FP16,
    whose kernels sum in another order than older CPUs')."""
    return rtol * (1 + steps) / 2


def assert_state_matches(
    sharded: Any,
    reference: Any,
    plan: tuple[Any, ...],
    *,
    rtol: float,
    what: str = "state",
    prefix: tuple = ("module",),
    check_dtype: bool = True,
    rtol_for: Mapping[str, float] | None = None,
) -> None:
    """Compares a sharded module's Param state (or grad `nnx.State`) with the reference.

    `sharded` / `reference` are modules or `nnx.State`s. Paths of the sharded state are
    the reference paths prefixed by `prefix`. Sharded (planned) entries are checked to have
    the padded shape, a padding region of exactly zero, and the reference values in the
    logical region; every other entry must have the reference's shape. Errors are measured
    relative to max|reference| of each entry; `rtol_for` overrides `rtol` per ``/``-path.
    """
    ref = flat_values(reference)
    got = flat_values(sharded)
    plans = {p.path: p for p in plan}
    assert set(got) == {prefix + k for k in ref}, (
        f"{what}: sharded paths {sorted(got)} do not match reference paths {sorted(ref)}")
    for key, ref_value in ref.items():
        name = path_str(key)
        value = got[prefix + key]
        if check_dtype:
            assert value.dtype == ref_value.dtype, (
                f"{what} {name}: dtype {value.dtype} != reference {ref_value.dtype}")
        ref_arr = np.asarray(ref_value)
        if name in plans:
            arr = unpad(value, plans[name], ref_arr.shape)
        else:
            arr = np.asarray(value)
            assert arr.shape == ref_arr.shape, f"{what} {name}: shape {arr.shape}"
        tol = rtol if rtol_for is None else rtol_for.get(name, rtol)
        assert_close(arr, ref_arr, tol, f"{what} {name}")


def snapshot(module: nnx.Module) -> dict[tuple, tuple[np.ndarray, Any, tuple]]:
    """Copies of every variable of `module`: (value, sharding, metadata keys)."""
    out = {}
    for key, var in flat_state(module, ...).items():
        value = var.get_value()
        out[key] = (np.array(value), getattr(value, "sharding", None),
                    tuple(sorted(var.get_metadata())))
    return out


def assert_unchanged(module: nnx.Module, before: Mapping[tuple, tuple]) -> None:
    after = snapshot(module)
    assert set(after) == set(before)
    for key, (value, sharding, meta) in before.items():
        new_value, new_sharding, new_meta = after[key]
        assert new_value.dtype == value.dtype and new_value.shape == value.shape, key
        assert np.array_equal(new_value, value), f"{key} was modified"
        assert new_sharding == sharding, f"{key}: sharding changed to {new_sharding}"
        assert new_meta == meta, f"{key}: metadata changed {meta} -> {new_meta}"


def assert_matches_reference_steps(sharded: Any, results: list, ref_steps: list,
                                   ref_final: Mapping[str, Any], rtol: float) -> None:
    """Each step's (loss, logits, grads) of a sharded run equals the unsharded reference's
    (`ref_steps`: (loss, logits, {path: grad})), and so do the parameters after the last
    step (`ref_final`: {path: value}); sharded grads and params are unsharded first."""
    for step, ((loss, logits, grads), (ref_loss, ref_logits, ref_grads)) in enumerate(
            zip(results, ref_steps, strict=True)):
        assert_close(loss, ref_loss, rtol, f"step {step} loss")
        assert logits.shape == ref_logits.shape, (step, logits.shape, ref_logits.shape)
        assert_close(logits, ref_logits, rtol, f"step {step} logits")
        got = gtp_jax.unshard_values(sharded, grads)
        assert set(got) == set(ref_grads)
        for path, ref_g in ref_grads.items():
            assert_close(got[path], ref_g, rtol, f"step {step} grad {path}")
    got = gtp_jax.unshard_values(sharded, sharded)
    for path, ref_p in ref_final.items():
        assert_close(got[path], ref_p, rtol, f"param {path} after {len(results)} steps")



def train_and_record(model: nnx.Module, batches: list[jax.Array],
                     mesh: jax.sharding.Mesh | None = None) -> tuple[list, Any]:
    """Trains a `Transformer` (sharded when `mesh` is given: batches are placed on its data
    axes) with AdamW for one step per batch; returns ``[(loss, grads), ...]`` and the final
    parameters, as numpy."""
    from gtp_jax.models import lm_loss

    opt = nnx.Optimizer(model, optax.adamw(1e-2, eps=1e-3), wrt=nnx.Param)
    if mesh is not None:  # step counters on the mesh: the step compiles once, not twice
        from gtp_jax.train import replicate_stray_leaves

        replicate_stray_leaves(opt, mesh)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
        opt.update(model, grads)
        return loss, grads

    out = []
    for batch in batches:
        if mesh is not None:
            batch = jax.device_put(batch, gtp_jax.data_sharding(mesh))
        loss, grads = step(model, opt, batch)
        out.append((float(loss), jax.tree.map(np.asarray, nnx.state(grads, nnx.Param))))
    return out, jax.tree.map(np.asarray, nnx.state(model, nnx.Param))


def assert_same_runs(run_a: tuple, run_b: tuple, rtol: float = 1e-5) -> None:
    """Two `train_and_record` results agree step by step (loss, every gradient) and in the
    final parameters, to `rtol` (fp32 runs of the same math: reduction order only)."""
    (steps_a, params_a), (steps_b, params_b) = run_a, run_b
    for (l0, g0), (l1, g1) in zip(steps_a, steps_b, strict=True):
        assert abs(l0 - l1) <= rtol * abs(l0)
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
            assert max_rel_err(b, a) < rtol
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        assert max_rel_err(b, a) < rtol


def sharded_logits_and_grads(cfg: Any, mesh: Any, tokens: jax.Array,
                             seed: int = 0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A `Transformer(cfg)` sharded on `mesh`: its logits for `tokens` and the gradient of
    ``sum(sin(logits))`` per weight, unsharded (`unshard_values`; float32 loss)."""
    from gtp_jax.models import Transformer
    from gtp_jax.sharding.module import unshard_values

    sm = gtp_jax.shard(Transformer(cfg, rngs=nnx.Rngs(seed)), mesh,
                       gtp_jax.GTPConfig(min_elements=0))

    @nnx.jit
    def fwd_bwd(m, t):
        def loss(m):
            logits = m(t).logits
            return jnp.sum(jnp.sin(logits.astype(jnp.float32))), logits
        return nnx.value_and_grad(loss, has_aux=True)(m)

    (_, logits), grads = fwd_bwd(sm, tokens)
    return logits, unshard_values(sm, grads)
