"""The engines' roles: data-parallel replicas that each compute prompts and decode them, or
prefill engines that hand requests to decode engines (docs/disaggregation.md).

``ClusterConfig`` inherits ``EngineRoles``, as it does the address plan: the knobs it reads are
that dataclass's fields.
"""

from __future__ import annotations


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
