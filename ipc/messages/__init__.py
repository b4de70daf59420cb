"""Every message that crosses a process boundary, defined once, one module per channel (this
package re-exports them all but the queries'; import from ``ipc.messages``):

    common        : finish reasons, error codes, ChatMessage
    submit        : client -> tokenizer -> engine (and a request's error before the engine)
    engine_step   : engine <-> detokenizer
    client_stream : client <-> detokenizer
    control       : workers <-> supervisor, cluster notices
    replica_load  : engine replicas -> tokenizer workers, their load (beside the KV events)
    queries       : the one-answer queries (import them from ``ipc.messages.queries``)
    kv_net        : engine <-> engine across hosts, where a request's KV bytes lie
    kv_handoff    : prefill engine <-> decode engine (prefill/decode disaggregation)

Channels (who sends what to whom):

    client      -> tokenizer i : SubmitRequest
    client      -> detokenizer : ClientHello, ClientAbort, ClientBye
    detokenizer -> client      : ClientWelcome, ClientEvents (one message per step per client)
    tokenizer i -> engine r    : TokenizedRequest (engine r: the replica its router chose)
    tokenizer i -> detokenizer : RequestError (the request never reaches the engine)
    tokenizer i -> engine      : GrammarVocabulary (ipc.structured; ahead of any constrained
                                 request: the vocabulary as data, so the engine never tokenizes)
    detokenizer -> engine      : AbortRequests (client aborts, stop strings, gone clients)
    engine      -> detokenizer : StepOutput (one message per engine step, columnar)
    engine r    -> tokenizers  : KV events (ipc.kv_events) and ReplicaLoad, on its event stream
    prefill p   -> decode d    : PrefilledRequest (its KV blocks described, not carried)
    decode d    -> prefill p   : KVRelease (the transfer's buffer may be reused)
    supervisor  -> prefill p   : ClusterNotice about decode engines (disaggregated only)
    Ray replica -> its engine  : KVExportAsk / KVImportAsk (a prompt's KV between two clusters)
    engine      -> Ray replica : KVHandoverReply
    any worker  -> supervisor  : WorkerReady, Heartbeat, WorkerFailed (its last words)
    supervisor  -> detokenizer : ClusterNotice (a worker died / is back), forwarded to clients
    supervisor  -> tokenizer i : ClusterNotice about engine replicas (several engines only)
    engine      -> engine      : KVNetRegion (bytes to pull, or room to push into) and KVNetDone
                                 (engine_worker.kv_net moves the bytes themselves)
    one-answer queries (tokenize, detokenize, tokenizer info, engine stats): queries.py

Timestamps are ``time.monotonic()`` seconds; on Linux that clock is system-wide, so values from
different processes on one host compare directly.
"""

from ipc.messages.client_stream import (
    ClientAbort,
    ClientBye,
    ClientEvents,
    ClientHello,
    ClientWelcome,
    LogprobEntry,
    RequestTimings,
    StreamEvent,
    TopLogprob,
    Usage,
)
from ipc.messages.common import (
    ERR_BAD_REQUEST,
    ERR_DUPLICATE_REQUEST,
    ERR_INTERNAL,
    ERR_OVERLOADED,
    ERR_UNAVAILABLE,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_TOOL_CALLS,
    ChatMessage,
)
from ipc.messages.control import (
    EXIT_STARTUP_REFUSED,
    NOTICE_DIED,
    NOTICE_READY,
    ClusterNotice,
    Heartbeat,
    WorkerFailed,
    WorkerReady,
)
from ipc.messages.engine_step import (
    EXPERT_ROWS_BUCKETS,
    AbortRequests,
    EngineStats,
    FinishRecord,
    PromptLogprobs,
    RequestStart,
    StepOutput,
    TokenLogprobs,
)
from ipc.messages.kv_handoff import (
    TRANSPORT_NET,
    TRANSPORT_SHARED_MEMORY,
    KVArrival,
    KVDescriptor,
    KVExportAsk,
    KVHandoverReply,
    KVImportAsk,
    KVRelease,
    PrefilledRequest,
)
from ipc.messages.kv_net import KVNetDone, KVNetRegion
from ipc.messages.replica_load import LOAD_TOPIC, ReplicaLoad
from ipc.messages.submit import RequestError, RequestMeta, SubmitRequest, TokenizedRequest
from ipc.sampling import SamplingParams  # a request's sampling settings travel inside its messages

__all__ = [
    "AbortRequests",
    "ChatMessage",
    "ClientAbort",
    "ClientBye",
    "ClientEvents",
    "ClientHello",
    "ClientWelcome",
    "ClusterNotice",
    "ERR_BAD_REQUEST",
    "EXIT_STARTUP_REFUSED",
    "ERR_DUPLICATE_REQUEST",
    "ERR_INTERNAL",
    "ERR_OVERLOADED",
    "ERR_UNAVAILABLE",
    "EngineStats",
    "EXPERT_ROWS_BUCKETS",
    "FINISH_ABORT",
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "FINISH_TOOL_CALLS",
    "FinishRecord",
    "KVNetDone",
    "KVNetRegion",
    "KVArrival",
    "KVDescriptor",
    "KVExportAsk",
    "KVHandoverReply",
    "KVImportAsk",
    "KVRelease",
    "PrefilledRequest",
    "TRANSPORT_NET",
    "TRANSPORT_SHARED_MEMORY",
    "Heartbeat",
    "LOAD_TOPIC",
    "LogprobEntry",
    "NOTICE_DIED",
    "NOTICE_READY",
    "PromptLogprobs",
    "ReplicaLoad",
    "RequestError",
    "RequestMeta",
    "RequestStart",
    "RequestTimings",
    "SamplingParams",
    "StepOutput",
    "StreamEvent",
    "SubmitRequest",
    "TokenLogprobs",
    "TokenizedRequest",
    "TopLogprob",
    "Usage",
    "WorkerFailed",
    "WorkerReady",
]
