"""Test seams by injection: a config names a "module:callable" that builds a stand-in for a
role's core (an engine without a model, a deliberately slow request preparer). The module is
imported by name from the Python path, like any plugin; nothing is executed from a file path."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_factory(spec: str) -> Callable[..., Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"a factory is named 'module:callable', got {spec!r}")
    factory = getattr(importlib.import_module(module_name), attr, None)
    if not callable(factory):
        raise ValueError(f"{spec!r} does not name a callable")
    return factory
