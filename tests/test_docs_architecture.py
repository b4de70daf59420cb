"""docs/architecture.md names every module of the production packages, each in the section of
its own package (``### `engine_worker/` ``), and names no module that does not exist there: a new
module, a rename or a removal that the page does not follow fails here, naming the modules."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGES = (
    "ipc",
    "runtime",
    "tokenizer_worker",
    "engine_worker",
    "detok_worker",
    "http_worker",
    "procs",
)


def package_dirs() -> list[Path]:
    """Every production package and subpackage (a directory with an __init__.py)."""
    found = []
    for top in PACKAGES:
        found += sorted(p.parent for p in (ROOT / top).rglob("__init__.py"))
    return found


def sections(text: str) -> dict[str, str]:
    """The page's ``### `dir/` `` sections by directory ("engine_worker/attention"), each its
    text up to the next heading of any level."""
    found: dict[str, str] = {}
    parts = re.split(r"^(#{1,6} .*)$", text, flags=re.M)
    for heading, body in zip(parts[1::2], parts[2::2]):
        if m := re.fullmatch(r"### `([\w/]+)/`", heading.strip()):
            found[m.group(1)] = body
    return found


def named_modules(body: str) -> set[str]:
    """The ``name.py`` a section names in backticks (a path with a slash is another
    directory's, checked for existence separately)."""
    return {m for m in re.findall(r"`([\w/]+\.py)`", body) if "/" not in m}


def test_every_production_package_has_a_section():
    page = sections(PAGE.read_text())
    missing = [
        f"{d.relative_to(ROOT)}/" for d in package_dirs() if str(d.relative_to(ROOT)) not in page
    ]
    assert not missing, (
        f"docs/architecture.md has no '### `dir/`' section for: {', '.join(missing)}"
    )


def test_every_module_is_named_in_its_packages_section():
    page = sections(PAGE.read_text())
    missing = []
    for d in package_dirs():
        named = named_modules(page.get(str(d.relative_to(ROOT)), ""))
        modules = sorted(p.name for p in d.glob("*.py") if p.name != "__init__.py")
        missing += [f"{d.relative_to(ROOT)}/{m}" for m in modules if m not in named]
    assert not missing, (
        "docs/architecture.md does not name these modules (add each, with what it holds, to "
        "its package's '### `dir/`' section): " + ", ".join(missing)
    )


def test_every_module_the_page_names_exists():
    text = PAGE.read_text()
    stale = []
    for directory, body in sections(text).items():
        stale += [
            f"{directory}/{m}" for m in named_modules(body) if not (ROOT / directory / m).exists()
        ]
    for path in set(re.findall(r"`((?:[\w]+/)+[\w]+\.py)`", text)):
        if path.split("/")[0] in PACKAGES and not (ROOT / path).exists():
            stale.append(path)
    assert not stale, "docs/architecture.md names modules that do not exist: " + ", ".join(
        sorted(stale)
    )
