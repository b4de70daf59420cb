"""Prompt tails in the prefix cache: the prompt tokens of a request's last, partial block.

The prefix cache shares whole blocks only, so a prompt asked again would compute its last,
partial block again (up to 15 rows, 16 for a prompt that is a multiple of the block size: the
last token must be computed for its logits). A tail entry names the block holding a prompt's
last ``len(tokens)`` prompt tokens after the full blocks of node ``node``; a later request
whose prompt is those full blocks and then exactly these tokens gets a fresh block, the slots
of all but its last token are copied into it (``PagedKVCache.copy_slots``), and it computes
its last token alone (the scheduler's ``_admit``).

Why the copied slots are what a cold prefill computes: a tail holds prompt tokens only, each
computed as a prompt row (the dense copy; docs/determinism.md), and a slot's keys and values
depend only on the tokens up to it, which the key fixes (the node names the exact prefix, as
for full blocks; a first block's tail carries its ``cache_salt``, so salts never share one).
The owner may go on decoding into the block: it writes the slots after its prompt, never
these.

Lifetime: a tail's block is held by the prefix cache like a full cached block (``holds``), so
when its owner releases it, it waits among the evictable blocks (LRU) instead of being freed,
and its entry is dropped when the block is evicted (``forget``): an entry never names a block
that was reused. An entry is registered in the scheduling step that computes the prompt's end
and read only from the next one (``step``), when its slots are written.

The prompt's end: the step that computes a tail's last token also samples from it, and the final
hidden state of that row (the head's input, one vector) is kept with the entry (``end``). A
later prompt of exactly these tokens then computes nothing: all the tail's slots are copied,
last token's included, and it samples from the kept row, through the same head as a row computed
in its step (bit for bit the cold prefill's first token). An entry whose end was not kept (its
prompt end was recomputed after preemption, or sampled nothing) is taken as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TailKey = tuple[int, "str | None", tuple[int, ...]]  # (node before it, first block's salt, tokens)


@dataclass(slots=True)
class Tail:
    key: TailKey
    block: int
    step: int  # the scheduling step that computes it: readable from the next one
    end: torch.Tensor | None = None  # the final hidden state of its last token's row, once known


class TailIndex:
    def __init__(self) -> None:
        self.by_key: dict[TailKey, Tail] = {}
        self.by_block: dict[int, Tail] = {}

    def register(
        self, node: int, salt: str | None, tokens: tuple[int, ...], block: int, step: int
    ) -> None:
        """Records that ``block`` holds ``tokens`` after ``node``'s prefix (computed in ``step``);
        an existing entry for the same tokens is kept (it is older, so as good)."""
        key = (node, salt, tokens)
        if key in self.by_key or block in self.by_block:
            return
        tail = Tail(key, block, step)
        self.by_key[key] = tail
        self.by_block[block] = tail

    def find(self, node: int, salt: str | None, tokens: tuple[int, ...], step: int) -> int | None:
        """The block holding ``tokens`` after ``node``'s prefix, if it was computed before
        ``step``."""
        tail = self.by_key.get((node, salt, tokens))
        return tail.block if tail is not None and tail.step < step else None

    def keep_end(self, block: int, hidden: torch.Tensor) -> None:
        """Keeps the final hidden state of the row of ``block``'s tail's last token."""
        tail = self.by_block.get(block)
        if tail is not None and tail.end is None:
            tail.end = hidden

    def end(self, block: int) -> torch.Tensor | None:
        tail = self.by_block.get(block)
        return tail.end if tail is not None else None

    def holds(self, block: int) -> bool:
        return block in self.by_block

    def forget(self, block: int) -> None:
        tail = self.by_block.pop(block, None)
        if tail is not None:
            del self.by_key[tail.key]

    def __len__(self) -> int:
        return len(self.by_key)
