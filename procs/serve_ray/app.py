"""The Serve application: ``build_app`` binds the ingress to the engine deployment, with the
request router the settings name. It is what ``splitserve serve-ray`` runs, and what a Serve
config file names (``import_path: procs.serve_ray.app:build_app``, its ``args`` the knobs)."""

from __future__ import annotations

import dataclasses
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from ipc.config import ClusterConfig
from ipc.engine_config import EngineConfig
from ipc.replica_router import LEAST_LOADED
from procs.serve_ray.engine import EngineReplica
from procs.serve_ray.ingress import Ingress
from procs.serve_ray.settings import (
    APP_NAME,
    POWER_OF_TWO,
    PREFIX_CACHE_AFFINITY,
    SPLITSERVE_ROUTER,
    ServeSettings,
)

ROUTER_CLASSES = {
    SPLITSERVE_ROUTER: "procs.serve_ray.router:TokenPrefixRouter",
    # Ray's ray.serve.llm.request_router re-exports it, but that module refuses to import
    # without vLLM or SGLang installed; the class itself needs neither.
    PREFIX_CACHE_AFFINITY: (
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
        "PrefixCacheAffinityRouter"
    ),
}
ENGINE, PREFILL, DECODE = "engine", "prefill", "decode"  # the engine deployments' names
INGRESS_MAX_ONGOING = 4096  # HTTP requests one ingress replica holds at once
GRACEFUL_SHUTDOWN_S = 30.0  # an engine replica's cluster ends its requests within this


def settings_from(knobs: dict[str, Any]) -> ServeSettings:
    """Flat knobs (a config file's ``args``, the command line's values) split between the
    application's and each engine replica's cluster's; an unknown name raises TypeError."""
    own = {f.name for f in dataclasses.fields(ServeSettings)} - {"cluster"}
    per_replica = {f.name for f in dataclasses.fields(ClusterConfig)} | {
        f.name for f in dataclasses.fields(EngineConfig)
    }
    unknown = set(knobs) - own - per_replica - {"cluster"}
    if unknown:
        raise TypeError(f"unknown knobs: {sorted(unknown)}")
    cluster = dict(knobs.get("cluster") or {})
    cluster.update({k: v for k, v in knobs.items() if k not in own and k != "cluster"})
    return ServeSettings(**{k: v for k, v in knobs.items() if k in own}, cluster=cluster)


def router_config(settings: ServeSettings, policy: str = "") -> RequestRouterConfig:
    """``policy``: the splitserve router's rule when not the settings' (the decode
    deployment's: least loaded)."""
    thresholds = settings.thresholds
    kwargs: dict[str, Any] = {}
    if settings.request_router == SPLITSERVE_ROUTER:
        kwargs = {
            "policy": policy or settings.routing_policy,
            "balance_abs_threshold": thresholds.balance_abs_threshold,
            "balance_rel_threshold": thresholds.balance_rel_threshold,
            "cache_threshold": thresholds.cache_threshold,
        }
    elif settings.request_router == PREFIX_CACHE_AFFINITY:
        # Its "imbalanced" is a queue-length gap, as our absolute threshold is.
        kwargs = {"imbalanced_threshold": thresholds.balance_abs_threshold}
    assert settings.request_router in (*ROUTER_CLASSES, POWER_OF_TWO)
    return RequestRouterConfig(
        **(
            {"request_router_class": ROUTER_CLASSES[settings.request_router]}
            if settings.request_router in ROUTER_CLASSES
            else {}
        ),
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=settings.routing_stats_period_s,
    )


def build_app(args: dict[str, Any]) -> Application:
    """The application from flat knobs: what a Serve config file's ``import_path`` names, its
    ``args`` the knobs (Serve calls a builder with exactly one argument, that dict)."""
    return application(settings_from(args))


def engine_deployment(
    settings: ServeSettings, name: str, replicas: int, policy: str = ""
) -> serve.Deployment:
    return serve.deployment(
        EngineReplica,
        name=name,
        num_replicas=replicas,
        max_ongoing_requests=settings.max_ongoing_requests,
        ray_actor_options={"num_cpus": settings.replica_cpus},
        request_router_config=router_config(settings, policy),
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
    )


def application(settings: ServeSettings) -> Application:
    """The ingress bound to the engine deployment, with the request router ``settings`` name;
    in the prefill/decode mode to two: ``prefill`` (routed by the cached prefix, as the engine
    deployment) and ``decode`` (routed by load)."""
    ingress = serve.deployment(
        Ingress,
        name="ingress",
        num_replicas=settings.ingress_replicas,
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},
    )
    if settings.disaggregated:
        prefill = engine_deployment(settings, PREFILL, settings.prefill_engines)
        decode = engine_deployment(settings, DECODE, settings.decode_engines, LEAST_LOADED)
        return ingress.bind(
            decode.bind(settings, DECODE), settings, prefill.bind(settings, PREFILL)
        )
    engine = engine_deployment(settings, ENGINE, settings.replicas)
    return ingress.bind(engine.bind(settings), settings)


def engine_replica_stats(
    app_name: str = APP_NAME, deployment: str = "engine"
) -> dict[int, dict[str, Any]]:
    """Rank -> the routing stats of each live replica of ``deployment`` (engine, or prefill
    and decode) in ``app_name`` (its load, the requests it served and aborted, its KV-event
    endpoint), asked of the replica actors directly (from a process connected to the Ray
    cluster): what an operator, a test or the benchmark sees of each replica. ``actor`` names
    the replica's actor."""
    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    out: dict[int, dict[str, Any]] = {}
    for named in ray.util.list_named_actors(all_namespaces=True):
        if named["namespace"] != "serve" or not named["name"].startswith(prefix):
            continue
        try:
            actor = ray.get_actor(named["name"], namespace="serve")
            stats = ray.get(actor.record_routing_stats.remote(), timeout=10)
        except Exception:  # dead, or not serving yet
            continue
        if stats:
            out[stats["rank"]] = {**stats, "actor": named["name"]}
    return out
