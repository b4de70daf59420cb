"""What the detokenizer knows of the engine replicas besides their requests: each one's latest
stats (every StepOutput carries them), which engine processes died (their late outputs are
dropped), and the routing decisions the tokenizer workers made (each request's meta says).

It answers the EngineStatsQuery that every client and HTTP frontend asks here, so all of them
read the same figures, and a restarted frontend reads them at once."""

from __future__ import annotations

import dataclasses
from collections import Counter

from ipc.messages import EngineStats, RequestMeta, StepOutput
from ipc.messages.queries import EngineStatsReport, ReplicaStats


class EngineBook:
    def __init__(
        self, engines: int = 1, routing_policy: str = "", roles: list[str] | None = None
    ) -> None:
        """``roles``: each replica's, disaggregated ("prefill", "decode")."""
        self.roles = roles or [""] * engines
        self.replicas = [ReplicaStats(index, role=self.roles[index]) for index in range(engines)]
        self.routing_policy = routing_policy
        self.dead_pids: set[int] = set()
        self.routing_decisions: Counter[str] = Counter()
        self.routing_s = 0.0
        self.latest_t, self.latest_pid = 0.0, 0  # the latest step of any replica

    def on_step(self, out: StepOutput) -> bool:
        """Takes the step's stats; False for a dead engine's late output (ignore it all)."""
        if out.engine_pid and out.engine_pid in self.dead_pids:
            return False
        if out.stats is not None and 0 <= out.engine_index < len(self.replicas):
            replica = self.replicas[out.engine_index]
            replica.stats, replica.t_step, replica.pid = out.stats, out.t_step, out.engine_pid
            self.latest_t, self.latest_pid = out.t_step, out.engine_pid
        return True

    def on_admit(self, meta: RequestMeta) -> None:
        if meta.routing_outcome:
            self.routing_decisions[meta.routing_outcome] += 1
            self.routing_s += meta.routing_s

    def on_death(self, index: int, pid: int, now: float) -> None:
        """Nothing runs or waits on the replica any more; its replacement's first step reports
        afresh (the KV cache's size is kept: the replacement has the same)."""
        if pid:
            self.dead_pids.add(pid)
        if 0 <= index < len(self.replicas):
            total = self.replicas[index].stats.kv_blocks_total
            self.replicas[index] = ReplicaStats(
                index, EngineStats(kv_blocks_total=total), now, role=self.roles[index]
            )
        if pid == self.latest_pid:
            self.latest_t, self.latest_pid = now, 0

    def report(self, request_id: str) -> EngineStatsReport:
        return EngineStatsReport(
            request_id,
            total_stats([r.stats for r in self.replicas]),
            self.latest_t,
            self.latest_pid,
            [dataclasses.replace(r) for r in self.replicas],
            self.routing_policy if self.routing_decisions else "",
            dict(self.routing_decisions),
            self.routing_s,
        )


def total_stats(parts: list[EngineStats]) -> EngineStats:
    """The cluster's figures: the replicas' summed (a step's duration and threads: the
    slowest's, the most)."""
    total = EngineStats()
    for stats in parts:
        for f in dataclasses.fields(EngineStats):
            value = getattr(stats, f.name)
            current = getattr(total, f.name)
            if f.name in ("step_ms", "threads"):
                value = max(current, value)
            elif isinstance(value, list):  # counts by position: summed position by position
                longer, shorter = (
                    (value, current) if len(value) >= len(current) else (current, value)
                )
                value = [a + (shorter[i] if i < len(shorter) else 0) for i, a in enumerate(longer)]
            else:
                value = current + value
            setattr(total, f.name, value)
    return total
