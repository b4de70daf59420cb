"""Every third-party module the code imports is declared in pyproject.toml, where its users get
it: the processes' packages need it in the core dependencies (``pip install splitserve`` then
``splitserve launch --http-port`` must work), the benchmark scripts in core or the ``bench``
extra, the tests in core or the ``test`` extra. An import inside ``try: ... except
ImportError`` is optional and exempt.

The package built the ordinary way (``pip wheel .``, then a non-editable install) carries our int4
kernel's C++ sources, and its first launch builds the kernel and serves on it."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
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
    assert undeclared([ROOT / "scripts"], declared("bench")) == []


def test_the_tests_imports_are_declared():
    assert undeclared([ROOT / "tests"], declared("test")) == []


KERNEL_SOURCES = {"engine_worker/int4_decode.cpp", "engine_worker/int4_decode_op.cpp"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel .`` of a copy of the sources (a build in the checkout would leave build/ and
    egg-info there, and race a concurrent run)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    done = subprocess.run(
        ["nice", "-n", "10", *pip, str(source), "-w", str(tmp / "dist")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (built,) = (tmp / "dist").glob("splitserve-*.whl")
    return built


def test_the_wheel_carries_the_int4_kernels_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert KERNEL_SOURCES <= names
    assert "engine_worker/int4_decode.py" in names


def wait_for_line(log: Path, popen: subprocess.Popen, text: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if text in line:
                return line
        assert popen.poll() is None, log.read_text()
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} after {timeout_s} s:\n{log.read_text()}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_non_editable_install_builds_our_kernel_at_its_first_launch(
    wheel, tiny_model_dir, tmp_path
):
    """The wheel installed into a fresh venv (its dependencies from this one's site-packages,
    not reinstalled: a path, not an install of this checkout), a fresh cache: the first launch
    builds the kernel from the installed sources, logs it, and its engine serves on it."""
    if shutil.which("g++") is None or not int4_decode_cpu_supported():
        pytest.skip("no g++ / AVX-512 BF16: the kernel cannot be built here")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps"]
    subprocess.run([*install, "-q", str(wheel)], check=True, timeout=300)
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPLITSERVE_NO_KERNEL_BUILD")
    }
    env.update(SPLITSERVE_CACHE=str(tmp_path / "cache"), SPLITSERVE_LOG_LEVEL="INFO")
    where = subprocess.run(
        [python, "-c", "import engine_worker; print(engine_worker.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(purelib), where  # the installed copy, not this checkout
    log = tmp_path / "launch.log"
    args = ["--model", str(tiny_model_dir), "--weights", "int4", "--dtype", "bfloat16"]
    args += ["--int4-kernel", "own", "--tokenizer-workers", "1", "--kv-cache-tokens", "2048"]
    # the build is part of the engine's start (~30 s of g++ on a quiet machine, minutes on a
    # loaded one), under the default --start-timeout-s: the engine heartbeats while it builds
    with open(log, "w") as out:
        popen = subprocess.Popen(
            ["nice", "-n", "10", venv / "bin" / "splitserve", "launch", *args],
            env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        ready = wait_for_line(log, popen, "engine ready", 500)
    finally:
        popen.send_signal(signal.SIGINT)
        popen.wait(timeout=60)
    text = log.read_text()
    assert "int4 on our kernel" in ready, ready
    assert text.count("building our int4 decode kernel (once for this torch)") == 1, text
    assert "built our int4 decode kernel in" in text and "unavailable" not in text
    assert list((tmp_path / "cache").glob("kernels/*/int4_decode_op.so"))


def int4_decode_cpu_supported() -> bool:
    from engine_worker import int4_decode

    return int4_decode.cpu_supported()
