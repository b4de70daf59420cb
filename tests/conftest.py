"""Shared fixtures: the real default model and a tiny random model with the same tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from procs.model_store import ensure_default_model
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    ensure_default_model()
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with end-to-end tests on the real model first, each file's tests kept together and
    in order: scripts/test hands whole files to two workers (pytest-xdist, --dist loadfile), and
    a long file handed out last would leave one worker idle while the other finishes it."""
    heavy = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in heavy)
