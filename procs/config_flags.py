"""Command-line flags made from the config dataclasses' fields (see ipc.knobs): the name, type,
choices, unit and help of every flag come from the field, so ``splitserve launch`` and
the benchmarks can never disagree with the config on a default or a meaning."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ipc.config import ClusterConfig
from ipc.engine_config import EngineConfig
from ipc.knobs import add_knob_flags, knob_fields, knob_values

__all__ = ["add_cluster_flags", "add_engine_flags", "add_knob_flags", "knob_values"]

# The knobs `splitserve launch` offers, by group; the rest of each class is not a flag there
# (derived, set by the supervisor, or a custom flag such as --listen).
ENGINE_KNOBS = tuple(f.name for f in knob_fields(EngineConfig) if f.metadata["cli"])
TOKENIZER_KNOBS = (
    "tokenizer_workers",
    "tokenizer_threads",
    "tokenizer_batch_max",
    "tokenizer_queue_max",
    "max_default_tokens",
    "stream_interval_tokens",
    "tool_call_parser",
    "reasoning_parser",
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
DISAGGREGATION_KNOBS = (
    "prefill_engines",
    "decode_engines",
    "kv_transfer_buffer_tokens",
    "kv_transfer_timeout_s",
    "kv_transport",
    "kv_net_host",
    "pd_skip_prefill_tokens",
)
TESTING_KNOBS = ("engine_factory", "preparer_factory")


def add_engine_flags(group: Any, **kwargs: Any) -> None:
    add_knob_flags(group, EngineConfig, ENGINE_KNOBS, **kwargs)


def add_cluster_flags(group: Any, names: Iterable[str], **kwargs: Any) -> None:
    add_knob_flags(group, ClusterConfig, names, **kwargs)
