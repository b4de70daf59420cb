"""The multi-turn chat workload of the data-parallel benchmark, driven through the asyncio SDK.

Conversations arrive as a Poisson process. Each one opens with a system prompt every
conversation shares, and each turn resends its whole history as token ids: the system prompt,
every earlier user message and reply, and a new user message; the next turn follows when the
reply has ended (after an optional think time). Token ids rather than chat text: the history is
then exactly what the engine saw, as with clients that keep token ids, and no re-tokenization of
a reply can move a block boundary.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    conversations: int = 32
    turns: int = 6
    system_tokens: int = 256
    user_tokens: int = 160
    reply_tokens: int = 96
    conversation_rate: float = 4.0  # conversations starting per second (Poisson)
    think_time_ms: float = 0.0  # between a reply's end and the next turn (exponential mean)
    seed: int = 0

    @property
    def longest_prompt(self) -> int:
        return (
            self.system_tokens
            + self.turns * self.user_tokens
            + (self.turns - 1) * (self.reply_tokens)
        )

    def describe(self) -> str:
        return (
            f"{self.conversations} conversations x {self.turns} turns arriving at "
            f"{self.conversation_rate:g}/s (Poisson), a shared {self.system_tokens}-token system "
            f"prompt, {self.user_tokens}-token user turns, {self.reply_tokens}-token replies "
            f"(histories up to {self.longest_prompt} tokens)"
        )


def add_workload_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per ChatWorkload field (``--conversation-rate``...), its default the field's."""
    defaults = ChatWorkload()
    for name in ChatWorkload.__dataclass_fields__:
        default = getattr(defaults, name)
        group.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)


def workload_of(args: argparse.Namespace) -> ChatWorkload:
    return ChatWorkload(**{name: getattr(args, name) for name in ChatWorkload.__dataclass_fields__})


@dataclass(slots=True)
class TurnRecord:
    conversation: int
    turn: int
    prompt_tokens: int
    t_submit: float
    ttft_s: float | None = None
    t_done: float = 0.0
    output_tokens: int = 0
    cached_tokens: int = 0
    engine_index: int = -1
    error: str | None = None


@dataclass(slots=True)
class RunRecord:
    turns: list[TurnRecord] = field(default_factory=list)
    t_start: float = 0.0
    t_end: float = 0.0


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40_000) for _ in range(n)]


async def run_conversations(client, workload: ChatWorkload, timeout_s: float = 600) -> RunRecord:
    """Drives every conversation to its end on ``client`` (an AsyncClient)."""
    rng = random.Random(workload.seed)
    system = _ids(rng, workload.system_tokens)
    gap = random.Random(workload.seed + 1)
    starts, t = [], 0.0
    for _ in range(workload.conversations):
        starts.append(t)
        t += gap.expovariate(workload.conversation_rate)
    record = RunRecord(t_start=time.monotonic())

    async def converse(index: int, delay: float) -> None:
        await asyncio.sleep(delay)
        talk = random.Random(workload.seed * 7919 + index)
        history = list(system)
        for turn in range(workload.turns):
            history += _ids(talk, workload.user_tokens)
            handle = client.submit(
                prompt_token_ids=history,
                max_tokens=workload.reply_tokens,
                ignore_eos=True,
                temperature=0.0,
            )
            result = await handle.result(timeout=timeout_s, check=False)
            turn_record = TurnRecord(index, turn, len(history), result.t_submit)
            turn_record.ttft_s, turn_record.t_done = result.ttft_s, time.monotonic()
            turn_record.error = result.error
            turn_record.engine_index = result.engine_index
            if result.usage is not None:
                turn_record.output_tokens = result.usage.completion_tokens
                turn_record.cached_tokens = result.usage.cached_tokens
            record.turns.append(turn_record)
            if result.error:
                return
            history += result.token_ids
            if workload.think_time_ms:
                await asyncio.sleep(talk.expovariate(1e3 / workload.think_time_ms))

    await asyncio.gather(*(converse(i, s) for i, s in enumerate(starts)))
    record.t_end = time.monotonic()
    return record
