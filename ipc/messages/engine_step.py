"""Between the engine and the detokenizer: aborts one way, one columnar StepOutput per engine
step the other."""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.codec import message
from ipc.messages.common import ERR_INTERNAL, FINISH_ERROR
from ipc.messages.kv_handoff import KVArrival
from ipc.messages.submit import RequestMeta

# ---------------------------------------------------------------------------------------------
# detokenizer -> engine


@message
@dataclass(slots=True)
class AbortRequests:
    """Frees these requests in the engine. Ids the engine has not seen yet are remembered for a
    while, since a tokenized request may still be on its way."""

    KIND = "abort"
    request_ids: list[str]


# ---------------------------------------------------------------------------------------------
# engine -> detokenizer

# Upper bounds (inclusive) of the buckets of a mixture-of-experts model's expert load: how many
# rows an expert took in one step's MoE layer (0: none chose it); a last bucket takes the rest.
EXPERT_ROWS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(slots=True)
class RequestStart:
    """Sent once per request, in the step that produced its first token."""

    request_id: str
    t_arrived: float  # the engine received it
    t_scheduled: float  # its first prefill chunk was scheduled
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefill_tokens: int = 0  # prompt tokens computed in this step
    cached_tokens: int = 0  # prompt tokens served from the prefix cache in this step
    decode_tokens: int = 0
    preempted: int = 0
    step_ms: float = 0.0
    threads: int = 0  # torch threads the step's forward ran on (0: not known)
    # Since the engine started (a restarted engine counts from 0 again): prompt tokens looked up
    # in the prefix cache when a request was admitted, those found there, and preemptions.
    prefix_queried_tokens_total: int = 0
    prefix_hit_tokens_total: int = 0
    preemptions_total: int = 0
    # Speculative decoding, since the engine started (vLLM's spec_decode counters): steps in
    # which a request verified drafts, its draft tokens, those accepted, and accepted by
    # position in the draft.
    spec_drafts_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_accepted_per_position_total: list[int] = field(default_factory=list)
    # A mixture-of-experts model's expert load since the engine started (empty for a dense
    # model): per EXPERT_ROWS_BUCKETS bucket (then one above them all), how many times an expert
    # of a MoE layer took that many rows in a step; and the rows routed in all (each row counts
    # once per expert it chose).
    expert_rows_buckets_total: list[int] = field(default_factory=list)
    expert_rows_total: int = 0
    # The experts whose weights the MoE layers read (a chosen expert once per layer and step:
    # then the histogram's observations above 0 rows) and those weights' bytes.
    expert_reads_total: int = 0
    expert_bytes_total: int = 0


@dataclass(slots=True)
class FinishRecord:
    """A request that ended in this step (or before it reached the engine) and why."""

    request_id: str
    reason: str  # a FINISH_* value
    error: str = ""  # what went wrong, when the reason is FINISH_ERROR
    code: str = ""  # an ERR_* code, when the reason is FINISH_ERROR

    def __post_init__(self) -> None:
        # Every error reaches the client with a code; one its sender left out is ours.
        if self.reason == FINISH_ERROR and not self.code:
            self.code = ERR_INTERNAL


@dataclass(slots=True)
class TokenLogprobs:
    """The logprobs of the token at ``row`` of StepOutput.request_ids (only for requests that
    asked): its own, and the ``top`` most likely ones of the step that sampled it."""

    row: int
    logprob: float
    top_ids: bytes = b""  # packed int32, most likely first
    top_logprobs: bytes = b""  # packed float32, one per top id


@dataclass(slots=True)
class PromptLogprobs:
    """Prompt logprobs of one request for the prompt positions ``start ..`` that this step
    computed (chunked prefill sends several, always before the request's first token). Position p
    holds the logprob of prompt token p given the tokens before it; position 0 has none."""

    request_id: str
    start: int
    logprobs: bytes  # packed float32, one per position
    top_k: int = 0
    top_ids: bytes = b""  # packed int32, top_k per position, most likely first
    top_logprobs: bytes = b""  # packed float32, likewise


@message
@dataclass(slots=True)
class StepOutput:
    """Everything one engine step produced, for all requests at once (columnar)."""

    KIND = "step"
    step: int
    t_step: float  # when this step's tokens were ready
    new_requests: list[RequestMeta] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    token_ids: bytes = b""  # packed int32, one new token per entry of request_ids
    started: list[RequestStart] = field(default_factory=list)
    finished: list[FinishRecord] = field(default_factory=list)
    stats: EngineStats | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # rows that asked only
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # The engine process that sent it: after the supervisor reports that engine dead, the
    # detokenizer drops its late outputs (their requests already ended with an error).
    engine_pid: int = 0
    engine_index: int = 0  # the replica that sent it (ClusterConfig.engines)
    # A decode engine's: requests it took over from a prefill engine since its last output.
    kv_arrivals: list[KVArrival] = field(default_factory=list)
