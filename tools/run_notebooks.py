"""Re-executes the notebooks in place, saving their outputs (run from the repository root).

``python tools/run_notebooks.py [notebooks/02_overlap.ipynb ...]`` (default: every
``notebooks/*.ipynb``). Uses the ``python3`` Jupyter kernel, or ``--kernel NAME``.
The notebooks are committed with their outputs so that their plots show on the repository
page; `tests/test_notebooks.py` checks that they were executed and that they still run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0], allow_abbrev=False)
    parser.add_argument("paths", nargs="*", help="notebooks to run (default: notebooks/*.ipynb)")
    parser.add_argument("--kernel", default="python3", help="Jupyter kernel name")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.paths] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        nbclient.NotebookClient(nb, kernel_name=args.kernel, timeout=args.timeout,
                                resources={"metadata": {"path": str(path.parent)}}).execute()
        nbformat.write(nb, path)
        print(f"executed {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
