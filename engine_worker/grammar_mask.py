"""Applies the constrained rows' grammars to a step's logits, in one batched call.

For the rows whose request has a grammar, llguidance fills one bitmask row each (bit t of a row
set = token t allowed) in a single call that runs the matchers in parallel on its own threads,
without the GIL; the bits are unpacked and those rows' disallowed logits set to -inf. A step
with no constrained row returns at once, so unconstrained batches pay nothing.
"""

from __future__ import annotations

from typing import Sequence

import llguidance
import numpy as np
import torch

from engine_worker.grammar_builder import RequestGrammar


class GrammarMasker:
    def __init__(self, threads: int = 1) -> None:
        self.executor = llguidance.LLExecutor(threads)
        self._bitmask = np.empty((0, 0), dtype=np.int32)

    @torch.inference_mode()  # the step's logits are inference tensors
    def apply(self, logits: torch.Tensor,
              grammars: Sequence[RequestGrammar | None]) -> list[int]:
        """Masks ``logits`` [rows, vocab] in place where ``grammars[row]`` is set (each must be
        ready). Returns the rows whose grammar failed (its build, or its matcher is in an error
        state): those rows are left unmasked and the caller ends their requests with
        ``grammar.error``."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return []
        failed = []
        matchers = []
        for row in rows:
            grammar = grammars[row]
            if not grammar.ready():  # type: ignore[union-attr]
                raise RuntimeError(f"row {row}: the grammar is not built yet")
            if grammar.matcher is None:  # type: ignore[union-attr]
                failed.append(row)  # the build failed; ready() set grammar.error
            else:
                matchers.append((grammar.matcher, len(matchers)))  # type: ignore[union-attr]
        vocab = logits.shape[1]
        bitmask = self._rows(len(matchers), (vocab + 31) // 32)
        if matchers:
            self.executor.unsafe_compute_mask_ptr(matchers, bitmask.ctypes.data,
                                                  bitmask.shape[1] * 4, len(matchers))
        build_failed = set(failed)
        masked_rows = [row for row in rows if row not in build_failed]
        for slot, row in enumerate(masked_rows):
            grammar = grammars[row]
            if grammar.matcher.is_error():  # type: ignore[union-attr]
                grammar.error = grammar.error or grammar.matcher.get_error()  # type: ignore
                failed.append(row)
                bitmask[slot] = -1  # all bits set: leave the row as it was
        if not matchers:
            return failed
        allowed = unpack_bitmask(bitmask, vocab, logits.device)
        if len(masked_rows) == logits.shape[0]:
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            index = torch.tensor(masked_rows, device=logits.device)
            masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
            logits.index_copy_(0, index, masked)
        return sorted(failed)

    def _rows(self, count: int, words: int) -> np.ndarray:
        if self._bitmask.shape[0] < count or self._bitmask.shape[1] != words:
            self._bitmask = np.empty((max(count, self._bitmask.shape[0]), words), dtype=np.int32)
        return self._bitmask[:count]


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """int32 [rows, words] bitmask -> bool [rows, vocab] on ``device`` (bit t = token t)."""
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    # Elsewhere ship the packed words (32x smaller) and unpack on the device.
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = torch.from_numpy(bitmask).to(device, non_blocking=True)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab].bool()
