"""Cluster configuration and the address plan, computed in one place.

The supervisor builds one ``ClusterConfig``, writes it as JSON into the run directory and hands
every child the path; each process derives every address it binds or connects from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ipc.sockets import CurveKeys

TRANSPORTS = ("ipc", "tcp")
RESTART_POLICIES = ("restart", "shutdown")
ROLES = ("tokenizer", "engine", "detokenizer", "http")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WEIGHTS = ("auto", "bf16", "fp32", "int8", "int4")  # the engine's weight formats


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    model_path: str
    run_dir: str
    transport: str = "ipc"
    host: str = "127.0.0.1"  # tcp: where client-facing sockets bind; beyond loopback: CURVE
    base_port: int = 0  # for tcp: the client address; the others follow it
    tokenizer_workers: int = 1

    # CPU budget, decided by the supervisor so roles never oversubscribe the cores.
    engine_threads: int = 1
    tokenizer_threads: int = 1

    # engine
    device: str = "auto"  # auto, cpu, cuda
    dtype: str = "auto"  # auto, float32, bfloat16, float16
    weights: str = "auto"  # auto, bf16, fp32, int8, int4 (engine_worker/weight_format.py)
    max_batch_size: int = 32
    prefill_max_batch_size: int = 32
    prefill_max_tokens: int = 4096
    prefill_chunk_tokens: int = 2048
    block_size: int = 16
    kv_cache_tokens: int = 0  # 0: derive from memory
    max_model_len: int = 0  # 0: the model's own limit (the supervisor fills in the engine's value)
    enable_prefix_cache: bool = True
    max_waiting_requests: int = 4096

    # what the engine resolved; 0/"" until the engine reported ready (the supervisor fills them in)
    vocab_size: int = 0
    model_name: str = ""

    # tokenizer workers
    tokenizer_batch_max: int = 64
    tokenizer_queue_max: int = 1024

    # detokenizer
    stream_interval_tokens: int = 1

    # OpenAI-compatible HTTP frontends (procs/http_server.py); None: no frontend
    http_port: int | None = None  # 0: any free port (one frontend) or one picked up front
    http_host: str = "127.0.0.1"  # anything but loopback needs http_api_key
    http_workers: int = 1  # frontend processes sharing the port (SO_REUSEPORT)
    http_api_key: str = ""

    # supervision
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0  # silent this long: a warning (and see hang_timeout_s)
    # A child that exits unexpectedly: "restart" it (same role, index and addresses; clients are
    # told, the requests it held end with an error) or "shutdown" the whole cluster in order.
    restart_policy: str = "restart"
    max_restarts: int = 5  # per child slot over the cluster's life; past it: shutdown
    # Silent this long (no heartbeat): treated as dead (SIGKILL, then the policy). 0: never. The
    # engine heartbeats between steps, so keep it well above the longest prefill step.
    hang_timeout_s: float = 0.0

    # security: ZeroMQ CURVE on every socket, required when host is not loopback (and forced on
    # by require_curve). The supervisor generates the server key pair; clients need the public key.
    require_curve: bool = False
    curve_public_key: str = ""
    curve_secret_key: str = ""

    def __post_init__(self) -> None:
        if self.restart_policy not in RESTART_POLICIES:
            raise ValueError(f"restart_policy must be one of {RESTART_POLICIES}, "
                             f"got {self.restart_policy!r}")
        if self.max_restarts < 0 or self.hang_timeout_s < 0:
            raise ValueError("max_restarts and hang_timeout_s must not be negative")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.tokenizer_workers < 1:
            raise ValueError("tokenizer_workers must be at least 1")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.transport == "tcp" and not (0 < self.base_port < 65536 - 64):
            raise ValueError("tcp transport needs a base_port in 1..65471")
        if self.transport == "tcp" and self.host not in LOOPBACK_HOSTS and not self.curve_secret_key:
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
                raise ValueError(f"an HTTP frontend on {self.http_host} (not loopback) requires "
                                 "an API key")
        for name in ("max_batch_size", "prefill_max_batch_size", "prefill_max_tokens",
                     "prefill_chunk_tokens", "block_size", "engine_threads", "tokenizer_threads",
                     "stream_interval_tokens", "tokenizer_batch_max", "tokenizer_queue_max",
                     "max_waiting_requests", "http_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def curve(self) -> "CurveKeys | None":
        """The server key pair when CURVE is on (every socket of the cluster uses it)."""
        if not self.curve_secret_key:
            return None
        from ipc.sockets import CurveKeys

        return CurveKeys(self.curve_public_key, self.curve_secret_key)

    # --- address plan -------------------------------------------------------------------------
    def _addr(self, name: str, port_offset: int, *, public: bool = False) -> str:
        """Client-facing sockets bind on ``host``; internal ones (engine, detokenizer inbox,
        supervisor) stay on loopback whatever ``host`` is: only this machine's processes use them."""
        if self.transport == "ipc":
            return f"ipc://{Path(self.run_dir) / name}.sock"
        host = self.host if public or self.host in LOOPBACK_HOSTS else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{self.base_port + port_offset}"

    @property
    def client_addr(self) -> str:
        """The detokenizer's ROUTER: clients connect here first (handshake, events, aborts)."""
        return self._addr("client", 0, public=True)

    def tokenizer_addr(self, index: int) -> str:
        return self._addr(f"tokenizer-{index}", 16 + index, public=True)

    @property
    def tokenizer_addrs(self) -> list[str]:
        return [self.tokenizer_addr(i) for i in range(self.tokenizer_workers)]

    @property
    def engine_addr(self) -> str:
        """The engine's PULL: tokenized requests from tokenizers, aborts from the detokenizer."""
        return self._addr("engine", 1)

    @property
    def detokenizer_addr(self) -> str:
        """The detokenizer's PULL: step outputs from the engine, errors from tokenizers."""
        return self._addr("detokenizer", 2)

    @property
    def supervisor_addr(self) -> str:
        return self._addr("supervisor", 3)

    @property
    def config_path(self) -> Path:
        return Path(self.run_dir) / "cluster.json"

    # --- (de)serialisation -------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ClusterConfig":
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown cluster config keys: {sorted(unknown)}")
        return cls(**data)

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
    def read(cls, path: str | os.PathLike) -> "ClusterConfig":
        return cls.from_json(Path(path).read_text())
