"""Cluster configuration, computed in one place (the address plan it derives: ipc/addresses.py).

The supervisor builds one ``ClusterConfig`` (the engine's knobs nested in it as an
``EngineConfig``), writes it as JSON into the run directory and hands every child the path; each
process derives every address it binds or connects from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ipc.addresses import LOOPBACK_HOSTS, AddressPlan
from ipc.engine_config import EngineConfig
from ipc.engine_roles import (
    DECODE_ENGINES_HELP,
    KV_BUFFER_HELP,
    KV_TIMEOUT_HELP,
    KV_TRANSPORT_HELP,
    PD_SKIP_PREFILL_HELP,
    PREFILL_ENGINES_HELP,
    EngineRoles,
    engine_mode_error,
)
from ipc.knobs import check_knobs, knob
from ipc.reasoning import REASONING_PARSER_CHOICES, REASONING_PARSER_HELP
from ipc.replica_router import CACHE_AWARE, POLICIES, RoutingThresholds
from ipc.sampling import DEFAULT_MAX_DEFAULT_TOKENS, MAX_DEFAULT_TOKENS_HELP
from ipc.structured import TOOL_CALL_FORMATS

if TYPE_CHECKING:
    from ipc.sockets import CurveKeys

TRANSPORTS = ("ipc", "tcp")
KV_TRANSPORTS = ("shm", "net")
KV_HANDOVERS = ("", "export", "import")
RESTART_POLICIES = ("restart", "shutdown")
ROLES = ("tokenizer", "engine", "detokenizer", "http")
MAX_ENGINES = 64
# 8 MiB: the longest prompt a tokenizer worker takes (8M characters) fits in one body.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
HTTP_MAX_BODY_BYTES_HELP = (
    "an HTTP request body larger than this is refused with a 413 before it is read or parsed"
)
LONG_PROMPT_HELP = "tokenizer workers encode a longer prompt (characters) on a thread of its own"
NICENESS_HELP = "tokenizer and HTTP workers run background work this much nicer (0: not)"
API_KEY_HELP = "require 'Authorization: Bearer KEY' on /v1/* and the tokenizer endpoints"
LENIENT_FIELDS_HELP = (
    "HTTP: log and ignore request fields the server does not know (for clients "
    "that send vendor extras) instead of answering 400; fields it knows and "
    "does not implement are refused either way"
)


@dataclass(frozen=True, slots=True)
class ClusterConfig(AddressPlan, EngineRoles):
    engine: EngineConfig  # the engine's knobs (and the model directory every process reads)
    run_dir: str = knob("", "where sockets and cluster.json live", cli=False)
    transport: str = knob(
        "ipc",
        "ipc: unix sockets in the run dir; tcp: loopback ports from base_port",
        choices=TRANSPORTS,
        cli=False,
    )
    host: str = knob(
        "127.0.0.1",
        "tcp: where client-facing sockets bind; beyond loopback, CURVE is required",
        cli=False,
    )
    base_port: int = knob(
        0, "tcp: the client port; the internal ports follow it", cli=False, minimum=0
    )

    tokenizer_workers: int = knob(
        1, "tokenizer processes; clients spread submits over them", unit="N", minimum=1
    )
    # Data-parallel engine replicas (docs/data-parallel.md): each its own process, scheduler,
    # KV cache and prefix cache; the tokenizer workers choose the replica of each request.
    engines: int = knob(
        1,
        "engine replicas, each with its own scheduler, KV cache and prefix cache; the "
        "tokenizer workers route each request to one (the engine thread budget is split "
        "between them)",
        unit="N",
        minimum=1,
        maximum=MAX_ENGINES,
    )
    # Prefill/decode disaggregation (docs/disaggregation.md): engines 0..P-1 compute prompts,
    # engines P..P+D-1 decode; ``engines`` is then P + D (the supervisor sets it).
    prefill_engines: int = knob(0, PREFILL_ENGINES_HELP, unit="N", minimum=0, maximum=MAX_ENGINES)
    decode_engines: int = knob(0, DECODE_ENGINES_HELP, unit="N", minimum=0, maximum=MAX_ENGINES)
    kv_transfer_buffer_tokens: int = knob(8192, KV_BUFFER_HELP, unit="TOKENS", minimum=16)
    kv_transfer_timeout_s: float = knob(30.0, KV_TIMEOUT_HELP, unit="SECONDS", minimum=0.01)
    kv_transport: str = knob("shm", KV_TRANSPORT_HELP, choices=KV_TRANSPORTS)
    kv_net_host: str = knob("127.0.0.1", "kv_transport net: this host's address", unit="HOST")
    # Set by serve-ray on its prefill and decode replicas' clusters (docs/ray.md), not by users.
    kv_handover: str = knob("", "export or import prompt KV", choices=KV_HANDOVERS, cli=False)
    pd_skip_prefill_tokens: int = knob(32, PD_SKIP_PREFILL_HELP, unit="TOKENS", minimum=0)
    routing_policy: str = knob(
        CACHE_AWARE,
        "how tokenizer workers pick a replica: cache_aware (the longest cached prefix unless "
        "the load is imbalanced), least_loaded or round_robin",
        choices=POLICIES,
    )
    routing_balance_abs_threshold: int = knob(
        64,
        "cache_aware: the load is imbalanced when the busiest replica has more than this many "
        "requests over the least busy...",
        unit="REQUESTS",
        minimum=0,
    )
    routing_balance_rel_threshold: float = knob(
        1.5,
        "...and more than this times its load; an imbalanced cluster routes to the least loaded",
        unit="RATIO",
        minimum=1.0,
    )
    routing_cache_threshold: float = knob(
        0.3,
        "cache_aware: a replica's cached prefix counts when it is more than this share of the "
        "prompt's full blocks (else the least loaded replica)",
        unit="FRACTION",
        minimum=0.0,
        maximum=1.0,
    )
    devices: str = knob(
        "",
        "CUDA: comma-separated device ids, replica r on the r-th (e.g. 0,1); default: every "
        "replica sees every device",
        unit="IDS",
    )
    pin_engine_cores: bool = knob(
        False, "CPU: pin each engine replica to its own share of the cores (where the OS allows)"
    )
    # CPU budget: the supervisor decides what is 0 so roles never oversubscribe the cores.
    tokenizer_threads: int = knob(
        0, "threads of the tokenizers library per tokenizer worker; 0 = 1", unit="N", minimum=0
    )
    tokenizer_batch_max: int = knob(
        64,
        "a tokenizer worker encodes at most this many queued requests in one batch",
        unit="REQUESTS",
        minimum=1,
    )
    tokenizer_long_prompt_chars: int = knob(16384, LONG_PROMPT_HELP, unit="CHARS", minimum=1)
    background_niceness: int = knob(10, NICENESS_HELP, unit="N", minimum=0, maximum=19)
    tokenizer_queue_max: int = knob(
        1024,
        "requests a tokenizer worker queues before clients skip it",
        unit="REQUESTS",
        minimum=1,
    )
    max_default_tokens: int = knob(
        DEFAULT_MAX_DEFAULT_TOKENS, MAX_DEFAULT_TOKENS_HELP, unit="TOKENS", minimum=0
    )
    stream_interval_tokens: int = knob(
        1,
        "the detokenizer sends a text delta every this many tokens (the first at once)",
        unit="TOKENS",
        minimum=1,
    )
    tool_call_parser: str = knob(
        "auto",
        "the model family's tool-call format, prompted, enforced and parsed: auto reads it "
        "from the chat template (Mistral's [TOOL_CALLS], Hermes/Qwen <tool_call>, Llama 3.x "
        "JSON; hermes when it shows none)",
        choices=("auto", *TOOL_CALL_FORMATS),
    )
    chat_template: str = knob(
        "",
        "a chat template's text, used instead of the model's own (empty: the model's)",
        cli=False,
    )
    reasoning_parser: str = knob("auto", REASONING_PARSER_HELP, choices=REASONING_PARSER_CHOICES)

    # What the engine resolved; 0/"" until the engine reported ready (the supervisor fills them
    # in, with the engine's max_model_len, for the processes started after it).
    vocab_size: int = knob(0, "the model's vocabulary size", cli=False, minimum=0)
    model_name: str = knob("", "the served model's name", cli=False)
    # True once they are filled in: the processes started beside the engines wait for it.
    engines_ready: bool = knob(False, "the engines' limits above are filled in", cli=False)

    # OpenAI-compatible HTTP frontends (http_worker/); None: no frontend.
    http_port: int | None = knob(
        None,
        "serve the OpenAI API on this port (0: any free port); default: no HTTP frontend",
        unit="PORT",
        cli=False,
    )
    http_host: str = knob(
        "127.0.0.1",
        "address the frontend listens on; anything but loopback needs an API key",
        cli=False,
    )
    http_workers: int = knob(1, "frontend processes sharing the port", unit="N", minimum=1)
    http_api_key: str = knob("", API_KEY_HELP, cli=False)
    lenient_fields: bool = knob(False, LENIENT_FIELDS_HELP)
    http_max_body_bytes: int = knob(
        DEFAULT_MAX_BODY_BYTES, HTTP_MAX_BODY_BYTES_HELP, unit="BYTES", minimum=1024
    )

    heartbeat_interval_s: float = knob(
        0.5,
        "how often every worker reports to the supervisor",
        unit="SECONDS",
        minimum=0.01,
        cli=False,
    )
    heartbeat_timeout_s: float = knob(
        10.0, "a worker silent this long is logged", minimum=0.0, unit="SECONDS", cli=False
    )
    restart_policy: str = knob(
        "restart",
        "when a worker process dies: restart it (its "
        "in-flight requests end with an 'unavailable' error) or shut the "
        "cluster down",
        choices=RESTART_POLICIES,
    )
    max_restarts: int = knob(
        5, "restarts per worker before the cluster shuts down instead", unit="N", minimum=0
    )
    hang_timeout_s: float = knob(
        0.0,
        "kill and handle as dead a worker silent this long; keep "
        "it above the longest prefill step (0: never)",
        unit="SECONDS",
        minimum=0.0,
    )

    # Security: ZeroMQ CURVE on every socket, required when host is not loopback (and forced on
    # by require_curve). The supervisor generates the server key pair; clients need the public key.
    require_curve: bool = knob(
        False, "use CURVE even on loopback/ipc (the public key is printed the same way)"
    )
    curve_public_key: str = knob("", "the cluster's CURVE public key", cli=False)
    curve_secret_key: str = knob("", "the cluster's CURVE secret key", cli=False)

    # Test seams: "module:callable" building a stand-in for a role's core from this config
    # (an engine without a model; a slow request preparer). Empty in production.
    engine_factory: str = knob("", "builds the engine object", cli=False)
    preparer_factory: str = knob("", "builds the tokenizer workers' request preparer", cli=False)

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        if not self.run_dir:
            raise ValueError("run_dir is required")
        check_knobs(self)
        if self.disaggregated:
            error = engine_mode_error(1, self.prefill_engines, self.decode_engines)
            if error:
                raise ValueError(error)
            if self.engines != self.pd_engines:
                raise ValueError(
                    f"disaggregated: engines must be prefill_engines + decode_engines "
                    f"({self.pd_engines}), got {self.engines}"
                )
        if self.transport == "tcp" and not (0 < self.base_port <= 65536 - self.port_span):
            raise ValueError(
                f"tcp transport needs a base_port in 1..{65536 - self.port_span} (the cluster "
                f"uses {self.port_span} ports from it)"
            )
        if self.devices and len(self.device_list) < self.engines:
            raise ValueError(
                f"devices names {len(self.device_list)} device(s) for {self.engines} engine "
                "replicas: give one per replica"
            )
        if (
            self.transport == "tcp"
            and self.host not in LOOPBACK_HOSTS
            and not self.curve_secret_key
        ):
            raise ValueError(f"listening on {self.host} (not loopback) requires CURVE keys")
        if self.require_curve and not self.curve_secret_key:
            raise ValueError("require_curve is set but no CURVE keys were given")
        if bool(self.curve_public_key) != bool(self.curve_secret_key):
            raise ValueError("give both CURVE keys (public and secret) or neither")
        if self.curve_secret_key:
            from ipc.sockets import CurveKeys

            CurveKeys(self.curve_public_key, self.curve_secret_key)  # checks their form
        if self.http_port is not None:
            if not 0 <= self.http_port < 65536:
                raise ValueError(f"http_port must be in 0..65535, got {self.http_port}")
            if self.http_host not in LOOPBACK_HOSTS and not self.http_api_key:
                raise ValueError(
                    f"an HTTP frontend on {self.http_host} (not loopback) requires an API key"
                )

    @classmethod
    def build(cls, model_path: str, run_dir: str, **knobs: Any) -> ClusterConfig:
        """One flat set of knobs (what ``launch_cluster`` and the command lines take), split
        between the engine's and the cluster's; an unknown name raises TypeError."""
        engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
        cluster_names = {f.name for f in dataclasses.fields(cls)} - {"engine"}
        unknown = set(knobs) - engine_names - cluster_names
        if unknown:
            raise TypeError(
                f"unknown knobs: {sorted(unknown)} (engine: {sorted(engine_names)}; "
                f"cluster: {sorted(cluster_names)})"
            )
        engine = EngineConfig(
            model_path=model_path, **{k: v for k, v in knobs.items() if k in engine_names}
        )
        return cls(
            engine=engine, run_dir=run_dir, **{k: v for k, v in knobs.items() if k in cluster_names}
        )

    def with_engine(self, **changes: Any) -> ClusterConfig:
        return dataclasses.replace(self, engine=dataclasses.replace(self.engine, **changes))

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    # --- data-parallel engines ----------------------------------------------------------------
    @property
    def routes(self) -> bool:
        """Whether tokenizer workers choose a replica (several engines); with one they send
        every request to it and neither hash nor follow events."""
        return self.engines > 1

    @property
    def routing_thresholds(self) -> RoutingThresholds:
        return RoutingThresholds(
            self.routing_balance_abs_threshold,
            self.routing_balance_rel_threshold,
            self.routing_cache_threshold,
        )

    @property
    def device_list(self) -> list[str]:
        """The ``devices`` knob as a list ("0,1" -> ["0", "1"]); ValueError on a bad entry."""
        ids = [d.strip() for d in self.devices.split(",")] if self.devices else []
        if any(not d.isdigit() for d in ids):
            raise ValueError(f"devices must be comma-separated device ids, got {self.devices!r}")
        return ids

    @property
    def curve(self) -> CurveKeys | None:
        """The server key pair when CURVE is on (every socket of the cluster uses it)."""
        if not self.curve_secret_key:
            return None
        from ipc.sockets import CurveKeys

        return CurveKeys(self.curve_public_key, self.curve_secret_key)

    # --- (de)serialisation -------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClusterConfig:
        data = json.loads(text)
        engine = data.pop("engine", None)
        if not isinstance(engine, dict):
            raise ValueError("the cluster config needs an 'engine' object")
        for kind, given in ((cls, data), (EngineConfig, engine)):
            unknown = set(given) - {f.name for f in dataclasses.fields(kind)}
            if unknown:
                raise ValueError(f"unknown {kind.__name__} keys: {sorted(unknown)}")
        return cls(engine=EngineConfig(**engine), **data)

    def write(self) -> Path:
        path = self.config_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: str | os.PathLike) -> ClusterConfig:
        return cls.from_json(Path(path).read_text())
