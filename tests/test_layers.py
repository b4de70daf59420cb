"""The layers point one way. From the bottom: ``ipc`` (messages, codec, sockets, config, client
SDK) <- ``runtime`` (what every process shares) <- the roles (``tokenizer_worker``,
``engine_worker``, ``detok_worker``, ``http_worker``) <- ``procs`` (supervisor, CLI, model
store) <- ``scripts`` (benchmarks). A module imports only from its own layer or below; a role
never imports another role; and no module imports itself back through a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("tokenizer_worker", "engine_worker", "detok_worker", "http_worker")
LAYER = {"ipc": 0, "runtime": 1, **{role: 2 for role in ROLES}, "procs": 3, "scripts": 4}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in it, deferred imports included)."""
    modules = {module_name(p): p for top in LAYER for p in (ROOT / top).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            targets |= {f for f in found if f in modules}
        graph[name] = targets - {name}
    return graph


def test_every_import_points_down_or_sideways_within_a_package():
    wrong = []
    for module, targets in import_graph().items():
        top = module.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other == top:
                continue
            if LAYER[other] > LAYER[top] or (LAYER[other] == LAYER[top] == 2):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_no_import_cycles():
    graph = import_graph()
    # Package __init__ modules re-export their children: an edge child -> package is normal
    # for Python but not a cycle of logic; drop it so real cycles stand out.
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not module.startswith(t + ".")}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def imported_names(path: Path) -> set[str]:
    """Every module name ``path`` imports, third-party ones included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_only_the_ray_launcher_imports_ray():
    """Ray is an optional extra: only procs.serve_ray imports it, and only the CLI's serve-ray
    command (deferred) imports the launcher."""
    launcher = ("procs/serve_ray/",)
    users = (*launcher, "procs/cli.py")
    wrong = []
    for top in LAYER:
        for path in (ROOT / top).rglob("*.py"):
            where = path.relative_to(ROOT).as_posix()
            names = imported_names(path)
            if not where.startswith(launcher) and any(n.split(".")[0] == "ray" for n in names):
                wrong.append(f"{where} imports ray")
            if not where.startswith(users) and any(n.startswith("procs.serve_ray") for n in names):
                wrong.append(f"{where} imports procs.serve_ray")
    assert wrong == []
