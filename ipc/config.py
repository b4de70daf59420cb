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

TRANSPORTS = ("ipc", "tcp")
ROLES = ("tokenizer", "engine", "detokenizer", "http")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    model_path: str
    run_dir: str
    transport: str = "ipc"
    host: str = "127.0.0.1"  # for tcp; anything but loopback needs CURVE keys
    base_port: int = 0  # for tcp: the client address; the others follow it
    tokenizer_workers: int = 1

    # CPU budget, decided by the supervisor so roles never oversubscribe the cores.
    engine_threads: int = 1
    tokenizer_threads: int = 1

    # engine
    device: str = "auto"  # auto, cpu, cuda
    dtype: str = "auto"  # auto, float32, bfloat16, float16
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

    # supervision
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0

    # security (CURVE, required when host is not loopback)
    curve_public_key: str = ""
    curve_secret_key: str = ""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.tokenizer_workers < 1:
            raise ValueError("tokenizer_workers must be at least 1")
        if self.transport == "tcp" and not (0 < self.base_port < 65536 - 64):
            raise ValueError("tcp transport needs a base_port in 1..65471")
        if self.transport == "tcp" and self.host not in LOOPBACK_HOSTS and not self.curve_secret_key:
            raise ValueError(f"listening on {self.host} (not loopback) requires CURVE keys")
        for name in ("max_batch_size", "prefill_max_batch_size", "prefill_max_tokens",
                     "prefill_chunk_tokens", "block_size", "engine_threads", "tokenizer_threads",
                     "stream_interval_tokens", "tokenizer_batch_max", "tokenizer_queue_max",
                     "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    # --- address plan -------------------------------------------------------------------------
    def _addr(self, name: str, port_offset: int) -> str:
        if self.transport == "ipc":
            return f"ipc://{Path(self.run_dir) / name}.sock"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.base_port + port_offset}"

    @property
    def client_addr(self) -> str:
        """The detokenizer's ROUTER: clients connect here first (handshake, events, aborts)."""
        return self._addr("client", 0)

    def tokenizer_addr(self, index: int) -> str:
        return self._addr(f"tokenizer-{index}", 16 + index)

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
