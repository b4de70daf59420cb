"""Command-line flags made from the config dataclasses' fields (see ipc.knobs): the name, type,
choices, unit and help of every flag come from the field, so ``splitserve launch`` and
``splitserve bench`` can never disagree with the config on a default or a meaning."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from typing import Any

from ipc.config import ClusterConfig
from ipc.engine_config import EngineConfig
from ipc.knobs import base_type, knob_fields

# The knobs `splitserve launch` offers, by group; the rest of each class is not a flag there
# (derived, set by the supervisor, or a custom flag such as --listen).
ENGINE_KNOBS = tuple(f.name for f in knob_fields(EngineConfig) if f.metadata["cli"])
TOKENIZER_KNOBS = (
    "tokenizer_workers",
    "tokenizer_threads",
    "tokenizer_batch_max",
    "tokenizer_queue_max",
    "stream_interval_tokens",
)
FAULT_KNOBS = ("restart_policy", "max_restarts", "hang_timeout_s")
DATA_PARALLEL_KNOBS = (
    "engines",
    "routing_policy",
    "routing_balance_abs_threshold",
    "routing_balance_rel_threshold",
    "routing_cache_threshold",
    "devices",
    "pin_engine_cores",
)
TESTING_KNOBS = ("engine_factory", "preparer_factory")


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


def add_engine_flags(group: Any, **kwargs: Any) -> None:
    add_knob_flags(group, EngineConfig, ENGINE_KNOBS, **kwargs)


def add_cluster_flags(group: Any, names: Iterable[str], **kwargs: Any) -> None:
    add_knob_flags(group, ClusterConfig, names, **kwargs)
