"""The README is a front door to the pages under docs/: short, listing every page, with
links that resolve and examples that write to a folder of the user's. (The examples
themselves run in tests/test_readme.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
SHELL = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
README_MAX_LINES = 300


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of `page`: lower case, punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_readme_is_short_and_lists_every_docs_page() -> None:
    text = (REPO_ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md: move detail to docs/"
    missing = [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in text]
    assert not missing, f"README.md's 'Where to read on' does not list {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{page.name}: links that lead nowhere: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_examples_write_to_a_folder_of_the_users(page: Path) -> None:
    """A fixed /tmp path is shared by every user of the machine and outlives the example:
    examples write under the folder they run in (``runs/``, ``ck``: git-ignored)."""
    fixed = [line for block in SHELL.findall(page.read_text()) for line in block.splitlines()
             if "/tmp" in line]
    assert not fixed, f"{page.name}: examples with fixed paths: {fixed}"
