"""The engines' roles: data-parallel replicas that each compute prompts and decode them, or
prefill engines that hand requests to decode engines (docs/disaggregation.md).

``ClusterConfig`` inherits ``EngineRoles``, as it does the address plan: the knobs it reads are
that dataclass's fields.
"""

from __future__ import annotations

# What each of the disaggregated mode's knobs (ClusterConfig's) does.
PREFILL_ENGINES_HELP = (
    "disaggregated mode: engines that compute prompts (chunked, with their prefix caches) and "
    "sample the first token, then hand each request and its KV blocks to a decode engine; give "
    "with --decode-engines, instead of --engines"
)
DECODE_ENGINES_HELP = (
    "disaggregated mode: engines that take requests over from the prefill engines and decode "
    "them to the end"
)
KV_BUFFER_HELP = (
    "disaggregated mode: each prefill engine's shared-memory buffer for KV blocks on their way "
    "to a decode engine (at least the context length is taken)"
)
KV_TIMEOUT_HELP = (
    "disaggregated mode: a KV transfer its decode engine has not taken in this long (hung, or "
    "its batch full all that time) is aborted: the request ends 'unavailable', the prefill "
    "engine's buffer is freed"
)
KV_TRANSPORT_HELP = (
    "disaggregated mode: how KV blocks move: shm (/dev/shm, one host) or net (Mooncake's "
    "transfer engine over TCP, the kvnet extra; engines need not share /dev/shm)"
)
PD_SKIP_PREFILL_HELP = (
    "disaggregated mode, cache_aware routing: a prompt a decode engine caches all but at most "
    "this many tokens of goes straight to it (no prefill engine, no KV transfer); 0: never"
)


def engine_mode_error(engines: int, prefill_engines: int, decode_engines: int) -> str:
    """Why these engine counts do not make one mode ("" when they do): data-parallel replicas
    (--engines N) or prefill/decode disaggregation (--prefill-engines P --decode-engines D)."""
    if not (prefill_engines or decode_engines):
        return ""
    if prefill_engines < 1 or decode_engines < 1:
        return (
            "disaggregation needs both --prefill-engines and --decode-engines, each at least 1 "
            f"(got {prefill_engines} and {decode_engines})"
        )
    if engines != 1:
        return (
            f"--engines {engines} (colocated replicas) and --prefill-engines/--decode-engines "
            "(disaggregated) are exclusive: give one or the other"
        )
    return ""


class EngineRoles:
    """A mixin of ``ClusterConfig``: which engine does what."""

    __slots__ = ()
    engines: int
    prefill_engines: int
    decode_engines: int

    @property
    def disaggregated(self) -> bool:
        """Prefill/decode disaggregation: prefill engines hand requests to decode engines."""
        return bool(self.prefill_engines or self.decode_engines)

    @property
    def pd_engines(self) -> int:
        return self.prefill_engines + self.decode_engines

    def engine_role(self, index: int) -> str:
        """ "prefill", "decode", or "" (an engine that computes prompts and decodes them)."""
        if not self.disaggregated:
            return ""
        return "prefill" if index < self.prefill_engines else "decode"

    @property
    def prefill_indices(self) -> range:
        return range(self.prefill_engines) if self.disaggregated else range(self.engines)

    @property
    def decode_indices(self) -> range:
        return range(self.prefill_engines, self.pd_engines) if self.disaggregated else range(0)
