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
