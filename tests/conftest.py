"""Shared fixtures: the real default model and a tiny random model with the same tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from procs.model_store import ensure_default_model
from scripts.bench.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    ensure_default_model()
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
