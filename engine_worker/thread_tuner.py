"""How many torch threads each engine step runs with, chosen by measuring.

Every thread of a torch op waits for the slowest at the op's end. On a machine whose cores are
also busy with other work (another server, a build, the cluster's own tokenizers in a burst),
one preempted thread holds up every op of the step: a batch-1 decode step of ~600 small ops then
takes several times longer on 2 threads than on 1. On an idle machine the extra threads win. No
setting is right for both, so the engine measures: now and then it runs a few steps alternately
with one thread and with all of them, and keeps whichever was faster. A probe is skipped while
the other processes on the machine use under a tenth of a core (``OtherWork``, from /proc): on
an idle machine all threads win every probe, and its one-thread steps were pure cost.

Steps are compared only with steps of the same kind and size (decode-only steps of one batch
size; steps that prefill, bucketed by their token count), and only adjacent ones, so a batch
that grows or a machine that gets busier affects both sides alike. A choice that keeps winning
is probed less and less often (the loser's steps are the probe's cost).

A kind may follow a leader: the kind that gains least from threads and runs most often. While
the leader keeps all threads, the follower runs on all of them too and is not probed. Prefill
steps follow decode: a prompt's matrix products gain more from a second thread than a decode
step's small ops (158 tokens 1.69x, a decode step 1.46x, measured at load 2.6), and at one
stream a prefill probe is a request's first token on one thread, where probes pair rarely
(prefill steps of one size are seldom adjacent) and cached prompts' TTFT p50 paid for them.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PROBE_PAIRS = 4  # adjacent (one thread, all threads) step pairs per probe, at most
# Steps a probe may take. A step whose size differs from the one before it cannot complete a
# pair, and a probe's unpaired steps run on one thread: while batch sizes keep changing (a
# closed loop of many streams, requests finishing and arriving) an unbounded probe kept decode
# on one thread for as long as they changed. A probe that has paired nothing after PROBE_PAIRS
# steps gives up (the next waits four times longer); one that pairs stops at PROBE_MAX_STEPS.
PROBE_MAX_STEPS = 4 * PROBE_PAIRS
FIRST_PROBE_AFTER = 4  # steps of a kind before its first probe: settled in the first requests
MAX_PROBE_INTERVAL = 4096  # steps between probes once a choice has kept winning
MARGIN = 0.05  # the other setting must be this much faster (median ratio) to take over
# ... but one thread must be this much faster to take over from all of them. At one stream the
# detokenizer, the frontend and the client run beside every step, so pairs are noisy, and a
# 5% margin flipped decode to one thread and back (10 times in 35 s): with two fixed threads
# one stream's ITL p50 was 10.77 ms against the adaptive default's 12.44 (idle machine). A busy
# machine's all-threads steps take 2-6x, far past this.
MARGIN_TO_ONE = 0.25
# Other processes' CPU, in cores, under which the machine counts as idle: a probe then has
# nothing to find (on an idle 2-core machine all threads won every probe, and the probes' one-
# thread steps cost ~4% of the 1.1B's output at 8 streams), so a kind on all threads skips it
# (and waits four times longer for the next). A cluster's own tokenizer, detokenizer and HTTP
# processes used under 0.05 of a core there.
IDLE_OTHERS = 0.1
# Steps between looks at the other processes' CPU (two /proc reads)
LOOK_EVERY = 8
# A ratio beyond this either way is decisive: two such pairs end the probe, and the next probe
# waits four times longer instead of twice (the loser's steps are then expensive: on a busy
# machine the all-threads steps took 2-6x the one-thread ones).
DECISIVE = 1.5


@dataclass(slots=True)
class _Kind:
    threads: int
    interval: int = FIRST_PROBE_AFTER
    countdown: int = FIRST_PROBE_AFTER
    probing: bool = False
    pending: tuple[int, int, float] | None = None  # (size, threads, seconds) of a probe step
    probe_steps: int = 0  # steps the current probe has taken
    ratios: list[float] = field(default_factory=list)  # all-threads time / one-thread time


class ThreadTuner:
    """``threads_for(kind, size)`` before a step, ``record(seconds)`` after it."""

    def __init__(
        self,
        max_threads: int,
        enabled: bool = True,
        others: Callable[[], float | None] | None = None,
    ) -> None:
        """``others``: the CPU other processes used since its last call, in cores (None:
        unknown; default ``OtherWork``)."""
        self.max_threads = max_threads
        self.enabled = enabled and max_threads > 1
        self.kinds: dict[str, _Kind] = {}
        self._current: tuple[_Kind, int, int] | None = None
        self.switches = 0  # times a probe changed a kind's choice
        self.skipped = 0  # probes skipped on an idle machine
        self._others = others or (OtherWork() if self.enabled else (lambda: None))
        self._others_cores: float | None = None  # the newest look
        self._until_look = 0

    def threads_for(self, kind: str, size: int, leader: str | None = None) -> int:
        """The threads a step of ``kind`` and ``size`` runs on (set now); ``leader``: the kind
        this one follows while that keeps all threads."""
        state, threads = self._choice(kind, size, leader)
        if (
            state is not None
            and state.probing
            and (state.pending is None or state.pending[0] != size)
        ):
            state.pending = None
        self._current = None if state is None else (state, size, threads)
        if self.enabled and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def upcoming(self, kind: str, size: int, leader: str | None = None) -> int:
        """What ``threads_for`` would answer now, changing nothing (the step pace sizes a
        step's prompt work for the threads it will run on)."""
        return self._choice(kind, size, leader)[1]

    def _choice(self, kind: str, size: int, leader: str | None) -> tuple[_Kind | None, int]:
        """The kind's state (None: not measured, it follows its leader or tuning is off) and
        the threads its next step of ``size`` runs on."""
        if not self.enabled:
            return None, self.max_threads
        if (lead := self.kinds.get(leader or "")) is not None and lead.threads == self.max_threads:
            return None, self.max_threads  # not measured: nothing to compare it with
        state = self.kinds.get(kind)
        if state is None:
            state = self.kinds[kind] = _Kind(threads=self.max_threads)
        threads = state.threads
        if state.probing:
            # Alternate: the second step of a pair runs the setting the first did not.
            if state.pending is not None and state.pending[0] == size:
                threads = 1 if state.pending[1] == self.max_threads else self.max_threads
            else:
                threads = self.max_threads if len(state.ratios) % 2 else 1
        return state, threads

    def record(self, seconds: float, work: float = 1.0) -> None:
        """The step's seconds, per unit of ``work`` where steps of one kind differ in size and
        are compared by their rate (paced prompt steps: per token-key)."""
        if self._current is None:
            return
        seconds /= max(work, 1e-9)
        state, size, threads = self._current
        self._current = None
        self._look()
        if not state.probing:
            state.countdown -= 1
            if state.countdown <= 0 and self._idle() and state.threads == self.max_threads:
                self.skipped += 1
                state.interval = min(state.interval * 4, MAX_PROBE_INTERVAL)
                state.countdown = state.interval
            elif state.countdown <= 0:
                state.probing, state.pending, state.ratios = True, None, []
                state.probe_steps = 0
            return
        state.probe_steps += 1
        if state.pending is None or state.pending[0] != size:
            state.pending = (size, threads, seconds)
            unpaired = not state.ratios and state.probe_steps >= PROBE_PAIRS
            if unpaired or state.probe_steps >= PROBE_MAX_STEPS:
                self._decide(state)  # on the pairs it has (none: the choice stays)
            return
        _, first_threads, first_seconds = state.pending
        state.pending = None
        one, many = (first_seconds, seconds) if first_threads == 1 else (seconds, first_seconds)
        state.ratios.append(many / max(one, 1e-9))
        decisive = len(state.ratios) == 2 and (
            min(state.ratios) > DECISIVE or max(state.ratios) < 1 / DECISIVE
        )
        if decisive or len(state.ratios) >= PROBE_PAIRS or state.probe_steps >= PROBE_MAX_STEPS:
            self._decide(state)

    def _look(self) -> None:
        self._until_look -= 1
        if self._until_look <= 0:
            self._until_look = LOOK_EVERY
            self._others_cores = self._others()

    def _idle(self) -> bool:
        return self._others_cores is not None and self._others_cores < IDLE_OTHERS

    def _decide(self, state: _Kind) -> None:
        ratio = statistics.median(state.ratios) if state.ratios else 1.0
        growth = 4 if not state.ratios or not 1 / DECISIVE <= ratio <= DECISIVE else 2
        if ratio < 1 - MARGIN:
            best = self.max_threads
        elif ratio > 1 + (MARGIN_TO_ONE if state.threads == self.max_threads else MARGIN):
            best = 1
        else:
            best = state.threads
        if best != state.threads:
            self.switches += 1
            state.threads, state.interval = best, FIRST_PROBE_AFTER
        else:
            state.interval = min(state.interval * growth, MAX_PROBE_INTERVAL)
        state.probing, state.countdown, state.ratios = False, state.interval, []

    def describe(self) -> dict[str, int]:
        return {kind: state.threads for kind, state in self.kinds.items()}


class OtherWork:
    """The CPU other processes used since the last call, in cores: the machine's busy time
    (/proc/stat) less this process's own (/proc/self/stat, all its threads). None where /proc
    cannot tell (another OS)."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last = self._sample()

    def __call__(self) -> float | None:
        now, last = self._sample(), self.last
        self.last = now
        if now is None or last is None or now[2] <= last[2]:
            return None
        busy, own = now[0] - last[0], now[1] - last[1]
        return max(0.0, (busy - own) / self.tick / (now[2] - last[2]))

    @staticmethod
    def _sample() -> tuple[int, int, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:9]]
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        # user nice system (idle iowait) irq softirq steal; this process's utime + stime
        busy = sum(fields[:3]) + sum(fields[5:8])
        return busy, int(own[11]) + int(own[12]), time.monotonic()
