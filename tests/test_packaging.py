"""Every third-party module the code imports is declared in pyproject.toml, where its users get
it: the processes' packages need it in the core dependencies (``pip install splitserve`` then
``splitserve launch --http-port`` must work), the benchmark scripts in core or the ``bench``
extra, the tests in core or the ``test`` extra. An import inside ``try: ... except
ImportError`` is optional and exempt."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
OWN = {
    "procs",
    "ipc",
    "runtime",
    "engine_worker",
    "tokenizer_worker",
    "detok_worker",
    "http_worker",
    "bench",
    "tests",
    "scripts",
}
OWN |= {p.stem for p in (ROOT / "scripts").glob("*.py")}
RAY_LAUNCHER = ROOT / "procs" / "serve_ray"  # splitserve serve-ray: the `ray` extra's
PACKAGES = (
    "procs",
    "ipc",
    "runtime",
    "engine_worker",
    "tokenizer_worker",
    "detok_worker",
    "http_worker",
)


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
            for h in node.handlers
        ):
            return True
    return False


def imported_modules(folders: list[Path], skip: Path | None = None) -> dict[str, str]:
    """Top-level third-party module -> a file importing it (unguarded imports only), in
    ``folders`` but not under ``skip``."""
    found: dict[str, str] = {}
    for folder in folders:
        for path in folder.rglob("*.py"):
            if skip is not None and path.is_relative_to(skip):
                continue
            tree = ast.parse(path.read_text(), str(path))
            parents = {
                child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in OWN or top in sys.stdlib_module_names or _guarded(node, parents):
                        continue
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(*groups: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for group in groups:
        specs += project["optional-dependencies"][group]
    return {_normalize(re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0]) for spec in specs}


def undeclared(folders: list[Path], allowed: set[str], skip: Path | None = None) -> list[str]:
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for module, where in sorted(imported_modules(folders, skip).items()):
        dists = {_normalize(d) for d in distributions.get(module, [module])}
        if not dists & allowed:
            missing.append(f"{module} (imported by {where}; distribution {sorted(dists)})")
    return missing


def test_the_processes_imports_are_core_dependencies():
    assert undeclared([ROOT / p for p in PACKAGES], declared(), skip=RAY_LAUNCHER) == []


def test_the_ray_launchers_imports_are_in_the_ray_extra():
    assert undeclared([RAY_LAUNCHER], declared("ray")) == []


def test_the_benchmarks_imports_are_declared():
    # The serve-ray workload drives the Ray launcher: it needs the ray extra too.
    assert undeclared([ROOT / "scripts"], declared("bench", "ray")) == []


def test_the_tests_imports_are_declared():
    assert undeclared([ROOT / "tests"], declared("test")) == []
