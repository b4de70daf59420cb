"""Between a prefill engine and a decode engine (prefill/decode disaggregation,
docs/disaggregation.md): the request that computed its prompt and sampled its first token goes to
its decode engine with its sampler state and a descriptor of its KV blocks (the bytes themselves
never cross a socket: they wait in a transport's buffer, engine_worker/kv_transfer.py); the
decode engine answers with a release once it copied them (or could not), and the prefill engine
frees the buffer."""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.codec import message
from ipc.messages.submit import RequestMeta
from ipc.sampling import SamplingParams

TRANSPORT_SHARED_MEMORY = "shm"
TRANSPORT_NET = "net"  # engine_worker/kv_transports.py, over engine_worker/kv_net.py


@dataclass(slots=True)
class KVDescriptor:
    """Where a request's KV blocks wait and how they are laid out: ``num_blocks`` blocks as
    [2 (keys, values), layers, kv_heads, num_blocks, block_size, head_dim] elements of ``dtype``
    from byte ``offset`` of ``location`` (shm: a file under /dev/shm). ``transfer_id`` also
    stamps the region: a reader that finds another stamp there reads a region given back."""

    transfer_id: int
    transport: str
    location: str
    offset: int
    nbytes: int
    num_blocks: int
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str  # torch's name without "torch.", e.g. "bfloat16"
    stamp_index: int = 0  # the stamp's slot in the location's stamp table
    # net: ``location`` is the exporter's transfer engine (host:port), ``address`` where its
    # buffer starts in the exporter's memory and ``units`` how many block units it holds.
    address: int = 0
    units: int = 0


@message
@dataclass(slots=True)
class PrefilledRequest:
    """prefill engine -> decode engine: a request whose prompt is computed and whose first token
    is sampled (and already sent to the detokenizer). ``token_ids`` is the prompt and that first
    token, packed int32; the KV of the prompt's ``prompt_len`` tokens is in ``kv``."""

    KIND = "prefilled"
    request_id: str
    token_ids: bytes
    prompt_len: int
    sampling: SamplingParams
    meta: RequestMeta
    kv: KVDescriptor
    prefill_index: int
    # The request's random stream where the prefill left it (torch.Generator.get_state());
    # b"" for greedy requests. Penalties' counts are rebuilt from token_ids.
    generator_state: bytes = b""
    cache_salt: str | None = None
    t_arrived: float = 0.0  # at the prefill engine
    t_scheduled: float = 0.0
    cached_tokens: int = 0
    t_export_start: float = 0.0  # the prefill engine began copying the blocks out


@message
@dataclass(slots=True)
class KVRelease:
    """decode engine -> prefill engine: these transfers' buffers may be reused. ``imported``
    says which of them the decode engine copied (the others it refused or found given back)."""

    KIND = "kv_release"
    transfer_ids: list[int]
    imported: list[bool] = field(default_factory=list)
    decode_index: int = 0


@dataclass(slots=True)
class KVArrival:
    """In a decode engine's StepOutput: a request it took over from a prefill engine (its later
    tokens come from this engine) and what the transfer cost."""

    request_id: str
    prefill_index: int
    kv_transfer_s: float  # from the prefill's export start to the decode's import end
    kv_bytes: int


# ---------------------------------------------------------------------------------------------
# Prompt KV handed between two clusters (the Ray Serve prefill and decode deployments,
# docs/ray.md): the replica that owns a cluster asks its own engine, which answers it.


@message
@dataclass(slots=True)
class KVExportAsk:
    """replica -> its prefill engine: copy the cached full blocks of ``token_ids`` (packed int32;
    a prompt this engine just computed) into the transfer buffer, and answer ``reply_to``."""

    KIND = "kv_export_ask"
    ask_id: str
    token_ids: bytes
    reply_to: str
    cache_salt: str | None = None


@message
@dataclass(slots=True)
class KVImportAsk:
    """replica -> its decode engine: copy the blocks ``kv`` describes into this engine's prefix
    cache as the leading full blocks of ``token_ids``, and answer ``reply_to``."""

    KIND = "kv_import_ask"
    ask_id: str
    token_ids: bytes
    kv: KVDescriptor
    reply_to: str
    cache_salt: str | None = None


@message
@dataclass(slots=True)
class KVHandoverReply:
    """The engine's answer to an ask: the exported blocks (``kv``), or how many blocks it
    imported; ``error`` says why nothing was (the caller then computes the prompt itself)."""

    KIND = "kv_handover_reply"
    ask_id: str
    blocks: int = 0
    kv: KVDescriptor | None = None
    error: str = ""
    seconds: float = 0.0
