"""Every shell block of README.md and of the pages under docs/ runs as written, in order, in
a fresh folder, as a new user (and CI) would: CPU, the command line simulating 8 devices.

A page's ```bash blocks are examples that run on a CPU; commands for a GPU host are shown in
```text blocks, which are not run. Each page runs in its own folder, which stands for the
checkout: it holds a link to the checkout's ``docs/`` (an example may read a file under it).

Two kinds of lines are not run, because the test run itself already is them: installing the
package (``pip install ...``: CI installs it before the suite; here the command is replaced
by a check that Python finds ``gtp_jax``, this checkout's) and running the test suite
(``python -m pytest tests``: this test is part of it). Everything else runs verbatim with
``bash -e``; a block's background jobs (``&``) must end with status 0 as well.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
from pathlib import Path

import jax
import pytest
from helpers import cli_env

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

REPO_ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.M | re.S)
PYTHON = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
#: What the fixed README lines become (see the module docstring).
INSTALL = re.compile(r"^pip install [^&#]*")
SUITE = re.compile(r"python -m pytest tests\b[^#\n]*")
#: What an install line becomes: Python finds the package (the block's next commands import
#: it; importing it here too took 2 s of JAX's start-up per block).
FOUND = ("python -c \"import importlib.util, sys; "
         "sys.exit(importlib.util.find_spec('gtp_jax') is None)\" ")
#: What a successful run must not print (tracebacks, the coordination service's gRPC errors).
ERROR_TEXT = re.compile(r"Traceback|CANCELLED|UNAVAILABLE|Connection refused|^error:", re.M)
#: The README and the reference pages, as paths relative to the checkout.
PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in (REPO_ROOT / "docs").glob("*.md")))
#: Examples each page must keep (and so this test keeps running them).
EXPECTED = {
    "README.md": ("python -m gtp_jax train --steps 10",),
    "docs/cli.md": ("--checkpoint-dir ck --resume", "--processes 2", "--cp 2",
                    "--moe-experts 4", "--gather-format nvfp4"),
    "docs/data.md": ("--data runs/mydata --tokenizer runs/mytok",),
    "docs/fault_tolerance.md": ("--simulate-failure step=4,device=5",),
    "docs/models.md": ("--init-from-hf runs/tiny-llama", "--export-hf runs/tiny-llama-ft"),
    "docs/planning.md": ("python -m gtp_jax plan --preset tiny --gpus 8",),
}


def shell_blocks(page: str) -> list[str]:
    """The shell blocks of `page` (relative to the checkout), in order."""
    return FENCE.findall((REPO_ROOT / page).read_text())


def as_run(block: str) -> str:
    """`block` as this test runs it: install and test-suite lines replaced, and every
    background job waited for (its status counts)."""
    lines = []
    for line in block.splitlines():
        line = INSTALL.sub(FOUND, line)
        line = SUITE.sub("true  # the suite running this test", line)
        lines.append(line)
    return "\n".join(["set -e", *lines, "for job in $(jobs -p); do wait $job; done", ""])


def test_the_pages_have_the_blocks_this_test_expects() -> None:
    for page, needles in EXPECTED.items():
        text = "\n".join(shell_blocks(page))
        for needle in needles:
            assert needle in text, (page, needle)


@pytest.mark.parametrize("page", [p for p in PAGES if shell_blocks(p)])
def test_every_shell_block_runs_as_written(page: str, tmp_path: Path) -> None:
    env = cli_env(PYTHONPATH=str(REPO_ROOT))
    (tmp_path / "docs").symlink_to(REPO_ROOT / "docs")  # the checkout's pages and results
    for i, block in enumerate(shell_blocks(page), 1):
        proc = subprocess.run(["bash", "-c", as_run(block)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{page} block {i} failed:\n{block}\n---\n{output[-4000:]}"
        assert not ERROR_TEXT.search(output), f"{page} block {i} printed error text:\n{output}"
        if "--simulate-failure step=4,device=5" in block:  # training through a failure
            # (the command line's failure report; tests/test_ntp_train.py checks its numbers)
            for part in ("on 8 cpu devices", "simulated failure after step 4: devices [5] lost",
                         "layout before:", "DEGRADED, tp=2", "re-plan",
                         "ms, re-layout of the training", "loss around the failure",
                         "step time median"):
                assert part in output, (part, output[-3000:])
        if "--model examples.own_model:make_model" in block:  # your model, resumed
            assert "/runs/own/6 (step 6 of 9)" in output, output[-3000:]
        if "--checkpoint-dir ck --resume" in block:
            assert "is finished (checkpoint at step 6)" in output  # the re-launch
            assert "steps 7-9" in output  # the extension trained
    # A user following the page in the checkout leaves nothing git would pick up.
    made = sorted(p.name + ("/" if p.is_dir() else "") for p in tmp_path.iterdir()
                  if p.name != "docs")
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *made], cwd=REPO_ROOT,
                             capture_output=True, text=True).stdout.split()
    assert sorted(ignored) == made, f"not git-ignored: {set(made) - set(ignored)}"


def test_own_model_example_gives_the_unsharded_numbers() -> None:
    """The README promises the unsharded model's numbers for its example: its losses equal
    the same module's, unsharded, trained by the same step (float32 rounding; the example
    used to gather in bfloat16: 5e-5 away)."""
    import optax
    from flax import nnx

    from gtp_jax.train import TrainStep

    (code,) = [b for b in PYTHON.findall((REPO_ROOT / "README.md").read_text())
               if "class MLP" in b]
    shown = io.StringIO()
    scope: dict = {"__name__": "readme_example"}
    with contextlib.redirect_stdout(shown):
        exec(compile(code, "README.md", "exec"), scope)  # the README's own code
    sharded = [float(line.split()[1]) for line in shown.getvalue().splitlines()
               if re.fullmatch(r"\d \S+", line)]
    model = scope["MLP"](nnx.Rngs(0))
    step = TrainStep(model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param),
                     scope["loss_fn"])
    x = scope["x"]
    plain = [float(step((x, jax.numpy.sin(x)))["loss"]) for _ in range(len(sharded))]
    assert len(sharded) == 5
    for got, want in zip(sharded, plain):
        assert abs(got - want) <= 1e-6 * abs(want), (sharded, plain)


def test_readme_model_code_is_the_example_the_shell_block_trains() -> None:
    """The README's factory code is an excerpt of examples/own_model.py, verbatim: the
    shell block that trains that module runs it as written."""
    blocks = [b for b in PYTHON.findall((REPO_ROOT / "README.md").read_text())
              if "class MLP" not in b]
    example = (REPO_ROOT / "examples" / "own_model.py").read_text()
    assert blocks and all(block in example for block in blocks)
    assert "examples.own_model:make_model" in "\n".join(shell_blocks("README.md"))


def test_readme_names_the_tested_jax_version() -> None:
    text = (REPO_ROOT / "README.md").read_text()
    assert f"jax {jax.__version__}" in text, (
        f"this suite runs jax {jax.__version__}, which README.md does not name as tested")
