"""Configuration fields that carry their own documentation and bounds.

Every knob of the cluster and the engine is a dataclass field made with ``knob()``: its help
text, unit, bounds and choices live next to its default, once. The dataclasses validate
themselves with ``check_knobs``; the command lines (``splitserve launch``, ``splitserve bench``)
build their flags from the same fields (``procs.config_flags``), so a default or a help text is
never written twice.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any


def knob(
    default: Any,
    help: str,
    *,
    unit: str = "",
    minimum: float | None = None,
    maximum: float | None = None,
    choices: tuple[str, ...] = (),
    flag: str = "",
    cli: bool = True,
) -> Any:
    """A dataclass field with its documentation. ``flag``: the command-line name when it is not
    ``--`` + the field name with dashes (for a boolean that defaults to True, the flag that
    turns it off); ``cli=False``: not a command-line flag (derived, or set by the supervisor)."""
    return dataclasses.field(
        default=default,
        metadata={
            "help": help,
            "unit": unit,
            "minimum": minimum,
            "maximum": maximum,
            "choices": choices,
            "flag": flag,
            "cli": cli,
        },
    )


def knob_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def base_type(cls: type, f: dataclasses.Field) -> type:
    """The field's type without ``| None`` (annotations are strings under __future__)."""
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def check_knobs(obj: Any) -> None:
    """Raises ValueError naming the first field whose value has the wrong type or is out of its
    bounds or choices."""
    cls = type(obj)
    for f in knob_fields(cls):
        value = getattr(obj, f.name)
        if value is None and f.default is None:
            continue
        kind = base_type(cls, f)
        meta = f.metadata
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            )
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise ValueError(f"{f.name} must be {_article(kind)}, got {value!r}")
        if meta["choices"] and value not in meta["choices"]:
            raise ValueError(f"{f.name} must be one of {meta['choices']}, got {value!r}")
        if meta["minimum"] is not None and value < meta["minimum"]:
            raise ValueError(f"{f.name} must be at least {meta['minimum']:g}, got {value!r}")
        if meta["maximum"] is not None and value > meta["maximum"]:
            raise ValueError(f"{f.name} must be at most {meta['maximum']:g}, got {value!r}")


def _article(kind: type) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a finite number", str: "a string"}
    return names.get(kind, kind.__name__)
