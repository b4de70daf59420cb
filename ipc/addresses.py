"""The address plan: every socket address of a cluster, derived from a few of its knobs.

``ClusterConfig`` inherits it, so each process derives every address it binds or connects from
the one config it was handed.
"""

from __future__ import annotations

from pathlib import Path

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# Where prefill engines keep KV blocks on their way to decode engines (tmpfs: memory, no disk).
KV_SEGMENT_DIR = "/dev/shm"
# tcp: the fixed ports after base_port (client, detokenizer, supervisor); then three per engine
# replica (inbox, event stream, its replay), then one per tokenizer worker.
FIXED_PORTS = 3
PORTS_PER_ENGINE = 3


class AddressPlan:
    """A mixin of ``ClusterConfig``: the knobs it reads are that dataclass's fields."""

    __slots__ = ()
    run_dir: str
    transport: str
    host: str
    base_port: int
    engines: int
    tokenizer_workers: int

    def _addr(self, name: str, port_offset: int, *, public: bool = False) -> str:
        """Client-facing sockets bind on ``host``; internal ones (engines, detokenizer inbox,
        supervisor) stay on loopback whatever ``host`` is: only this machine's processes use
        them. tcp ports from base_port: client, detokenizer, supervisor; then per engine
        replica its inbox, event stream and replay socket; then one per tokenizer worker
        (``port_span`` in all)."""
        if self.transport == "ipc":
            return f"ipc://{Path(self.run_dir) / name}.sock"
        host = self.host if public or self.host in LOOPBACK_HOSTS else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{self.base_port + port_offset}"

    @property
    def port_span(self) -> int:
        """tcp: how many consecutive ports from base_port the cluster uses (see ``_addr``)."""
        return FIXED_PORTS + PORTS_PER_ENGINE * self.engines + self.tokenizer_workers

    @property
    def client_addr(self) -> str:
        """The detokenizer's ROUTER: clients connect here first (handshake, events, aborts)."""
        return self._addr("client", 0, public=True)

    @property
    def detokenizer_addr(self) -> str:
        """The detokenizer's PULL: step outputs from the engines, errors from tokenizers."""
        return self._addr("detokenizer", 1)

    @property
    def supervisor_addr(self) -> str:
        return self._addr("supervisor", 2)

    def engine_addr(self, index: int) -> str:
        """Engine replica ``index``'s PULL: tokenized requests from tokenizers, aborts from the
        detokenizer."""
        return self._addr(f"engine-{index}", self._engine_port(index))

    @property
    def engine_addrs(self) -> list[str]:
        return [self.engine_addr(r) for r in range(self.engines)]

    def engine_events_addr(self, index: int) -> str:
        """Engine replica ``index``'s KV-event PUB (ipc.kv_events): tokenizer workers follow it."""
        return self._addr(f"engine-events-{index}", self._engine_port(index) + 1)

    def engine_events_replay_addr(self, index: int) -> str:
        """...and its replay ROUTER, from which a (re)started follower rebuilds its view."""
        return self._addr(f"engine-events-replay-{index}", self._engine_port(index) + 2)

    def tokenizer_addr(self, index: int) -> str:
        port = FIXED_PORTS + PORTS_PER_ENGINE * self.engines + index
        return self._addr(f"tokenizer-{index}", port, public=True)

    @property
    def tokenizer_addrs(self) -> list[str]:
        return [self.tokenizer_addr(i) for i in range(self.tokenizer_workers)]

    def _engine_port(self, index: int) -> int:
        return FIXED_PORTS + PORTS_PER_ENGINE * index

    @property
    def kv_segment_prefix(self) -> str:
        """Disaggregation: the start of every KV transfer segment's path of this cluster (the
        supervisor removes what a killed engine left behind)."""
        base = KV_SEGMENT_DIR if Path(KV_SEGMENT_DIR).is_dir() else self.run_dir
        return str(Path(base) / f"splitserve-kv-{Path(self.run_dir).name}-")

    def kv_segment_path(self, index: int, pid: int) -> str:
        """Prefill engine ``index``'s KV transfer segment (process ``pid``: a restarted engine
        makes a new one, while a decode engine may still read the old)."""
        return f"{self.kv_segment_prefix}{index}-{pid}"

    @property
    def config_path(self) -> Path:
        return Path(self.run_dir) / "cluster.json"
