"""Disaggregation in the detokenizer: the order of a request's two engines' outputs.

A request's meta and first token come from its prefill engine; its later tokens from its decode
engine, whose output reports the request's arrival first (``StepOutput.kv_arrivals``). The
prefill engine sends its step before it hands the request over, but the two outputs reach the
detokenizer on different connections, so the decode engine's could be read first. Such an output
waits here (with that engine's later ones, whose order must hold) until every request it reports
arriving is known (its meta read) or ended here, or until outputs ``HOLD_S`` seconds younger
have arrived (from any engine): then it goes on, and what it names that is still unknown is
aborted on the decode engine (its meta was lost with a dead prefill engine).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ipc.messages import RequestMeta, StepOutput

if TYPE_CHECKING:
    from detok_worker.request_state import RequestState

HOLD_S = 0.5
HOLD_MAX = 256  # outputs held per engine at most


class HandoverOrder:
    def __init__(self) -> None:
        self.held: dict[int, deque[StepOutput]] = {}
        self.latest_t = 0.0
        self.waits = 0  # outputs that had to wait, since start

    def hold(self, out: StepOutput, known: Callable[[str], bool]) -> bool:
        """Whether ``out`` must wait (it is kept here then)."""
        self.latest_t = max(self.latest_t, out.t_step)
        queue = self.held.get(out.engine_index)
        if not queue and all(known(a.request_id) for a in out.kv_arrivals):
            return False
        self.held.setdefault(out.engine_index, deque()).append(out)
        self.waits += 1
        return True

    def release(self, known: Callable[[str], bool]) -> list[StepOutput]:
        """The held outputs that may go on now, in each engine's order."""
        ready = []
        for queue in self.held.values():
            while queue and (
                all(known(a.request_id) for a in queue[0].kv_arrivals)
                or self.latest_t - queue[0].t_step > HOLD_S
                or len(queue) > HOLD_MAX
            ):
                ready.append(queue.popleft())
        return ready

    @staticmethod
    def arrive(
        out: StepOutput,
        states: Mapping[str, RequestState],
        abort: Callable[[str, RequestMeta | None, int], None],
    ) -> None:
        """Requests a decode engine took over run there from now on (aborts go there), and
        their timings gain the transfer's. One ended here meanwhile is aborted there."""
        for arrival in out.kv_arrivals:
            state = states.get(arrival.request_id)
            if state is not None:
                state.meta.engine_index = out.engine_index
                state.timings.kv_transfer_s = arrival.kv_transfer_s
                state.timings.kv_transfer_bytes = arrival.kv_bytes
            else:
                abort(arrival.request_id, None, out.engine_index)
