"""The Serve application's knobs: what the deployments are and where they listen
(``ServeSettings``), and the cluster knobs each engine replica's own small cluster takes (the
same names as ``splitserve launch``'s). Plain data: both deployments get a copy through Ray."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ipc.config import API_KEY_HELP, DEFAULT_MAX_BODY_BYTES, HTTP_MAX_BODY_BYTES_HELP
from ipc.engine_roles import engine_mode_error
from ipc.knobs import check_knobs, knob
from ipc.replica_router import CACHE_AWARE, POLICIES, RoutingThresholds

APP_NAME = "splitserve"
# The request routers the engine deployment can be given: ours (the token-prefix score of
# ipc.replica_router), and Ray's two for comparison (the benchmark's modes).
SPLITSERVE_ROUTER = "splitserve"
PREFIX_CACHE_AFFINITY = "prefix_cache_affinity"  # Ray's: character prefixes of the prompt text
POWER_OF_TWO = "power_of_two"  # Ray's default
ROUTERS = (SPLITSERVE_ROUTER, PREFIX_CACHE_AFFINITY, POWER_OF_TWO)
NODE_ADDRESS = "node"  # kv_events_host: the replica's node address, as Ray reports it

# The launch knobs an engine replica's cluster does not take from the user: it has one engine
# (Serve makes the replicas), no HTTP frontend (the ingress is one) and publishes its KV events
# where the router can read them.
NOT_PER_REPLICA = (
    "engines",
    "devices",
    "pin_engine_cores",
    "http_port",
    "http_workers",
    "kv_events_config",
    "transport",
    "host",
    "base_port",
    "prefill_engines",
    "decode_engines",
    "kv_handover",
)


@dataclass(frozen=True, slots=True)
class ServeSettings:
    replicas: int = knob(2, "engine replicas (Serve places and restarts them)", minimum=1)
    prefill_engines: int = knob(
        0,
        "prefill/decode mode: replicas of the prefill deployment (they compute prompts and "
        "export their KV); give with --decode-engines, instead of --replicas",
        unit="N",
        minimum=0,
    )
    decode_engines: int = knob(
        0,
        "prefill/decode mode: replicas of the decode deployment (they import a prompt's KV "
        "and decode it)",
        unit="N",
        minimum=0,
    )
    ingress_replicas: int = knob(
        1, "HTTP ingress replicas (each tokenizes, hashes and routes)", unit="N", minimum=1
    )
    http_host: str = knob("127.0.0.1", "where Serve's HTTP proxy listens", unit="HOST")
    http_port: int = knob(8000, "the port of Serve's HTTP proxy", unit="PORT", minimum=0)
    model: str = knob(
        "",
        "a Hugging Face checkpoint directory present at this path on every node; empty: "
        "the default model, provisioned on each node",
        unit="PATH",
    )
    replica_cpus: float = knob(
        1.0, "CPUs Ray reserves for each engine replica", unit="CPUS", minimum=0.0
    )
    max_ongoing_requests: int = knob(
        1024,
        "requests Serve sends one engine replica at once (its engine queues the rest)",
        unit="REQUESTS",
        minimum=1,
    )
    request_router: str = knob(
        SPLITSERVE_ROUTER,
        "how the ingress picks an engine replica: splitserve (cached token-id prefix and "
        "load, the rule of --routing-policy), or Ray's prefix_cache_affinity or power_of_two",
        choices=ROUTERS,
    )
    routing_policy: str = knob(
        CACHE_AWARE, "the splitserve router's rule (ipc.replica_router)", choices=POLICIES
    )
    routing_stats_period_s: float = knob(
        1.0,
        "how often Serve asks each engine replica for its routing stats (load, KV events)",
        unit="SECONDS",
        minimum=0.05,
    )
    kv_events_host: str = knob(
        NODE_ADDRESS,
        "where engine replicas publish KV events: 'node' (the node's address; beyond "
        "loopback with CURVE) or an address such as 127.0.0.1 (one node)",
        unit="HOST",
    )
    api_key: str = knob("", API_KEY_HELP, unit="KEY")
    lenient_fields: bool = knob(
        False, "accept (and log) request fields the server does not implement"
    )
    http_max_body_bytes: int = knob(
        DEFAULT_MAX_BODY_BYTES, HTTP_MAX_BODY_BYTES_HELP, unit="BYTES", minimum=1024
    )
    # The rest of `splitserve launch`'s knobs, for each engine replica's cluster (engine,
    # tokenizer, fault and testing knobs; the routing thresholds, read by the router too).
    cluster: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_knobs(self)
        refused = sorted(set(self.cluster) & set(NOT_PER_REPLICA))
        if refused:
            raise ValueError(f"not a per-replica knob under Ray Serve: {refused}")
        self.thresholds  # noqa: B018 (fails fast on a bad threshold)
        error = engine_mode_error(1, self.prefill_engines, self.decode_engines)
        if error:
            raise ValueError(error)

    @property
    def disaggregated(self) -> bool:
        """Two engine deployments, prefill and decode, instead of one."""
        return bool(self.prefill_engines or self.decode_engines)

    @property
    def thresholds(self) -> RoutingThresholds:
        defaults = RoutingThresholds()
        return RoutingThresholds(
            self.cluster.get("routing_balance_abs_threshold", defaults.balance_abs_threshold),
            self.cluster.get("routing_balance_rel_threshold", defaults.balance_rel_threshold),
            self.cluster.get("routing_cache_threshold", defaults.cache_threshold),
        )

    def replace(self, **changes: Any) -> ServeSettings:
        return dataclasses.replace(self, **changes)
