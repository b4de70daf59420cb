"""Issue 39's code-shape targets, kept: no production file over 400 lines and no function over 60;
scripts/ at most 4,500 lines; the engine's step() at most 15 lines; and a request's scheduling
state assigned only inside engine_worker/scheduler/ (and by EngineRequest itself)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ipc", "runtime", "tokenizer_worker", "engine_worker", "detok_worker", "http_worker")
PACKAGES += ("procs",)
# EngineRequest's slots that are no scheduling state (fixed at construction, or the grammar the
# engine attaches on add), and token_ids, a name other messages share (StepOutput's column): a
# request's tokens grow through its append_token, called by the scheduler.
NOT_SCHEDULING = {"request_id", "prompt_len", "params", "sampler", "stop_ids", "max_total_len"}
NOT_SCHEDULING |= {"t_arrived", "cache_salt", "grammar", "token_ids"}
MUTATORS = {"append", "extend", "insert", "pop", "clear", "remove", "sort", "reverse"}


def production_files() -> list[Path]:
    return sorted(p for top in PACKAGES for p in (ROOT / top).rglob("*.py"))


def test_no_production_file_over_400_lines_and_no_function_over_60():
    too_long = []
    for path in production_files():
        text = path.read_text()
        if len(text.splitlines()) > 400:
            too_long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > 60:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    assert not too_long, too_long


def test_scripts_hold_at_most_4500_lines():
    files = [p for p in (ROOT / "scripts").rglob("*") if "__pycache__" not in p.parts]
    assert sum(len(p.read_text().splitlines()) for p in files if p.is_file()) <= 4500


def test_the_engine_step_is_at_most_15_lines():
    tree = ast.parse((ROOT / "engine_worker" / "engine.py").read_text())
    (engine,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    (step,) = [n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "step"]
    assert step.end_lineno - step.lineno + 1 <= 15  # type: ignore[operator]


def scheduling_fields() -> set[str]:
    tree = ast.parse((ROOT / "engine_worker" / "request.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__slots__":
            return set(ast.literal_eval(node.value)) - NOT_SCHEDULING
    raise AssertionError("EngineRequest has no __slots__")


def changed_attribute(node: ast.AST) -> ast.Attribute | None:
    """The attribute a statement or call changes: ``x.f = ...``, ``x.f += ...``, ``x.f[i] = ...``,
    ``del x.f[i:]``, ``x.f.append(...)``."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        node = node.func.value if node.func.attr in MUTATORS else node
    return node if isinstance(node, ast.Attribute) else None


def test_only_the_scheduler_changes_a_requests_scheduling_state():
    fields, found = scheduling_fields(), []
    assert {"num_computed", "block_ids", "draft_ids", "num_generated"} <= fields
    for path in sorted((ROOT / "engine_worker").rglob("*.py")):
        if "scheduler" in path.relative_to(ROOT).parts or path.name == "request.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign | ast.Delete):
                targets = list(node.targets)
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Call):
                targets = [node]
            for target in targets:
                attribute = changed_attribute(target)
                if attribute is not None and attribute.attr in fields:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{attribute.attr}")
    assert not found, found
