"""KV block bookkeeping: which blocks are free, who holds each one (reference counts), and which
unheld blocks still carry cached prefixes (LRU, evicted only when a fresh block is needed).

Invariants (tests check them):
* a block is in exactly one of: held (ref_count > 0), cached-evictable (ref_count == 0 and in the
  prefix cache), free (ref_count == 0, not cached);
* ``num_available == free + evictable``; when every request has finished, every block is
  available and every ref_count is 0.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from engine_worker.prefix_cache import PrefixCache


class KVBlockManager:
    """``prefix_cache`` (optional) is told which blocks are evicted and asked which released
    blocks it holds; without one, a released block is free at once."""

    def __init__(
        self, num_blocks: int, block_size: int, prefix_cache: PrefixCache | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self.prefix_cache = prefix_cache

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, count: int, sharing: Sequence[int] = ()) -> bool:
        """Whether ``count`` fresh blocks can be allocated once the cached blocks ``sharing`` are
        acquired: a cached block nobody holds counts as available until it is taken."""
        reclaimed = sum(1 for block in sharing if self.ref_counts[block] == 0)
        return count + reclaimed <= self.num_available

    def allocate(self, count: int) -> list[int]:
        """Takes ``count`` fresh blocks (ref_count 1); the caller checked num_available."""
        if count > self.num_available:
            raise RuntimeError(f"asked for {count} KV blocks, {self.num_available} available")
        blocks = []
        for _ in range(count):
            if self.free:
                block = self.free.popleft()
            else:
                block, _ = self.evictable.popitem(last=False)
                assert self.prefix_cache is not None  # only it makes a block evictable
                self.prefix_cache.forget(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def acquire(self, block: int) -> None:
        """Takes one more reference on a cached block (a prefix-cache hit)."""
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        # Released in reverse so that a sequence's tail blocks are evicted before its head
        # blocks: a later hit on the head still finds it.
        for block in reversed(blocks):
            count = self.ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"KV block {block} released more often than taken")
            self.ref_counts[block] = count
            if count == 0:
                if self.prefix_cache is not None and self.prefix_cache.holds(block):
                    self.evictable[block] = None
                else:
                    self.free.append(block)
