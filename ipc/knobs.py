"""Configuration fields that carry their own documentation and bounds.

Every knob of the cluster and the engine is a dataclass field made with ``knob()``: its help
text, unit, bounds and choices live next to its default, once. The dataclasses validate
themselves with ``check_knobs``; the command lines (``splitserve launch``, the benchmarks) build
their flags from the same fields (``add_knob_flags``; the launcher's groups of them are in
``procs.config_flags``, a standalone HTTP frontend's in ``http_worker.worker``), so a default or
a help text is never written twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Iterable
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


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def add_knob_flags(
    group: Any,
    cls: type,
    names: Iterable[str],
    *,
    help_overrides: dict[str, str] | None = None,
    defaults: dict[str, Any] | None = None,
) -> None:
    """One flag per named field of ``cls``; ``help_overrides`` replaces a field's help where a
    command gives the value another meaning (say, a benchmark's own default)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        f = fields[name]
        meta = f.metadata
        default = (defaults or {}).get(name, f.default)
        text = (help_overrides or {}).get(name, meta["help"])
        kind = base_type(cls, f)
        if kind is bool:
            action = "store_false" if f.default else "store_true"
            group.add_argument(flag_name(f), dest=name, action=action, default=default, help=text)
            continue
        shown = "%(default)s" if meta["choices"] or default != "" else "none"
        group.add_argument(
            flag_name(f),
            dest=name,
            type=kind,
            default=default,
            choices=meta["choices"] or None,
            metavar=meta["unit"] or None,
            help=f"{text} (default: {shown})",
        )


def knob_values(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    return {name: getattr(args, name) for name in names}
