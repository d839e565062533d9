"""The package import graph is layered and has no cycle (see docs/design.md).

Every module may import its own package and packages of lower layers only; the top-level
``gtp_jax`` facade (its ``__init__``) may be imported from the application layers only.
Imports inside functions count too: a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "gtp_jax"

#: package -> layer; a module may import packages of its own or a lower layer.
LAYERS = {
    "base": 0,
    "data": 1,  # raises base's UsageError
    "pallas": 1,
    "sharding": 2,
    "parallel": 3,
    "models": 4,
    "train": 5,
    "nonuniform": 5,
    "bench": 6,
    "plan": 6,  # the layout planner: compiles the training step (train) ahead of time
    "__main__": 6,
}
#: Top-level modules outside the packages: only the facade (``__init__``, not checked) and the
#: command-line entry point (``__main__``, in LAYERS).
TOP_LEVEL: dict[str, int] = {}


def _package(module: str) -> str | None:
    """``gtp_jax.sharding.loop`` -> ``sharding``; the facade ``gtp_jax`` -> None."""
    parts = module.split(".")
    if parts[0] != "gtp_jax" or len(parts) == 1:
        return None
    return parts[1]


def _layer(package: str) -> int:
    if package in LAYERS:
        return LAYERS[package]
    if package in TOP_LEVEL:
        return TOP_LEVEL[package]
    raise AssertionError(f"package {package!r} has no layer: add it to LAYERS")


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported gtp_jax module, line) of every import in a file, function-level ones too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("gtp_jax")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("gtp_jax"):
            if node.module == "gtp_jax":
                # ``from gtp_jax import pallas`` names a sub-package, else the facade.
                out += [(f"gtp_jax.{a.name}" if (ROOT / a.name).exists() or
                         (ROOT / f"{a.name}.py").exists() else "gtp_jax", node.lineno)
                        for a in node.names]
            else:
                out.append((node.module, node.lineno))
    return out


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_respect_layers(path: Path) -> None:
    rel = path.relative_to(ROOT)
    own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
    for module, line in _imports(path):
        package = _package(module)
        if package is None:
            assert _layer(own) >= 5, (
                f"{rel}:{line} imports the gtp_jax facade; import the defining module")
            continue
        if package == own:
            continue
        assert _layer(package) <= _layer(own), (
            f"{rel}:{line} imports {module} (layer {_layer(package)}) from layer "
            f"{_layer(own)}: a lower layer must not depend on a higher one")
        assert not (_layer(package) == _layer(own) and _layer(own) < 5), (
            f"{rel}:{line}: sibling packages {own!r} and {package!r} of one layer must not "
            "import each other")


def test_package_graph_has_no_cycle() -> None:
    edges: dict[str, set[str]] = {}
    for path in _modules():
        rel = path.relative_to(ROOT)
        own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for module, _ in _imports(path):
            package = _package(module)
            if package and package != own:
                edges.setdefault(own, set()).add(package)
    seen: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        if seen.get(node) == 1:
            raise AssertionError(f"import cycle: {' -> '.join([*stack, node])}")
        if seen.get(node) == 2:
            return
        seen[node] = 1
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, [*stack, node])
        seen[node] = 2

    for node in sorted(edges):
        visit(node, [])


def test_no_module_outside_the_packages() -> None:
    # Everything but the facade and the `python -m gtp_jax` entry point lives in a package.
    loose = sorted(p.name for p in ROOT.glob("*.py")
                   if p.stem not in ("__init__", "__main__") and p.stem not in TOP_LEVEL)
    assert not loose, f"modules outside the packages: {loose}; move them into one (LAYERS)"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: Path) -> list[tuple[str, str | None, int]]:
    """``(module, name or None, line)`` of every import in a file (relative ones resolved),
    function-level ones too."""
    own = _module_name(path)
    package = own if path.name == "__init__.py" else own.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            out += [(target, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
    return out


def test_module_graph_has_no_cycle() -> None:
    """No two modules import each other, directly or around a circle, at file level: inside
    a package as well as between packages. A name imported from a package (its
    ``__init__``) counts as an import of the module that defines it."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    packages = {m for m, p in paths.items() if p.name == "__init__.py"}
    exported: dict[tuple[str, str], str] = {}
    for pkg in packages:
        for target, name, _ in _module_imports(paths[pkg]):
            if name and f"{target}.{name}" in paths:
                exported[(pkg, name)] = f"{target}.{name}"
            elif name and target in paths and target not in packages:
                exported[(pkg, name)] = target

    def resolve(target: str, name: str | None) -> str | None:
        if name and f"{target}.{name}" in paths:
            return f"{target}.{name}"
        if target in packages and name:
            return exported.get((target, name))
        return target if target in paths and target not in packages else None

    edges: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        if module in packages:
            continue
        for target, name, line in _module_imports(path):
            dep = resolve(target, name)
            if dep and dep != module:
                edges.setdefault(module, {}).setdefault(dep, line)
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        if state.get(node) == 1:
            cycle = stack[stack.index(node):] + [node]
            hops = [f"{a} (line {edges[a][b]})" for a, b in zip(cycle, cycle[1:])]
            raise AssertionError("import cycle: " + " -> ".join(hops) + f" -> {node}")
        if state.get(node) == 2:
            return
        state[node] = 1
        for nxt in sorted(edges.get(node, {})):
            visit(nxt, [*stack, node])
        state[node] = 2

    for node in sorted(edges):
        visit(node, [])
