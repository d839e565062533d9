"""Executes every notebook in `notebooks/` top to bottom on CPU and fails on any cell error.

The notebooks are committed with their outputs; `python tools/run_notebooks.py` re-executes
them in place.

The kernel is this interpreter (`sys.executable`): a kernelspec pointing at it is written to a
temporary `JUPYTER_PATH`, so the test needs no globally installed kernel. Each notebook sets
its own `XLA_FLAGS` (8 simulated CPU devices) in its first cell, before importing jax.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes on 2 cores: `pytest -m "not slow"` skips it

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "gtp-jax-test-python"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory: pytest.TempPathFactory) -> str:
    spec_dir = tmp_path_factory.mktemp("jupyter") / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "gtp_jax test", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    mp = pytest.MonkeyPatch()
    mp.setenv("JUPYTER_PATH", str(spec_dir.parents[1]))
    mp.setenv("MPLBACKEND", "Agg")
    yield KERNEL
    mp.undo()


def test_notebooks_exist():
    names = {p.stem for p in NOTEBOOKS}
    assert {"01_quickstart", "02_overlap", "03_scaling", "04_your_model"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, kernel_name: str):
    nb = nbformat.read(path, as_version=4)
    # Stored with its outputs (shown on the repository page): every code cell was executed,
    # in order, and none stored an error.
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), (path.name, counts)
    stored_errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
                     if o.get("output_type") == "error"]
    assert not stored_errors, path.name
    client = nbclient.NotebookClient(
        nb, kernel_name=kernel_name, timeout=120, allow_errors=False,
        resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.get("output_type") == "error"]
    assert not errors, errors
