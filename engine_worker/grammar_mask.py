"""Applies the constrained rows' grammars to a step's logits.

Each row's mask (int32 words, bit t set = token t allowed) was computed off the step by the grammar
builder's mask thread, right after the row's previous token was sampled (see
engine_worker.grammar_builder), so a step only reads masks that are ready: a row whose mask is
still being computed is not here (the model runner defers it). On the CPU the bits become an
additive mask (0 allowed, -inf not) added to those rows in place with numpy; elsewhere the packed
words go to the device and are unpacked there. A step with no constrained row pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine_worker.grammar_builder import RequestGrammar


class GrammarMasker:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._bitmask: np.ndarray = np.empty((0, self.words), dtype=np.int32)
        self._buffer: np.ndarray = np.empty((0, self.words * 4, 8), dtype=np.float32)

    @torch.inference_mode()  # the step's logits are inference tensors
    def apply(self, logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
        """Masks ``logits`` [rows, vocab] in place: row r keeps only the tokens
        ``grammars[r]`` allows (each given grammar's mask must be ready); None rows are left as
        they are."""
        rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
        if not rows:
            return
        if logits.shape[1] > self.vocab_size:
            raise ValueError(f"logits are {logits.shape[1]} wide, the masks {self.vocab_size}")
        bitmask = self._rows(len(rows))
        for slot, row in enumerate(rows):
            grammar = grammars[row]
            assert grammar is not None
            if not grammar.mask_ready() or grammar.mask is None:
                raise RuntimeError(f"row {row}: the grammar's mask is not ready")
            if grammar.mask.shape[0] != self.words:
                raise ValueError(f"row {row}: a mask of {grammar.mask.shape[0]} words")
            bitmask[slot] = grammar.mask
        self._mask(logits, rows, bitmask)

    def _mask(self, logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
        vocab = logits.shape[1]
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
            additive = self._additive(bitmask, vocab)
            values = logits.numpy()
            if len(rows) == logits.shape[0]:
                np.add(values, additive, out=values)
            else:
                for slot, row in enumerate(rows):
                    np.add(values[row], additive[slot], out=values[row])
            return
        allowed = unpack_bitmask(bitmask, vocab, logits.device)
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            index = torch.tensor(rows, device=logits.device)
            masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
            logits.index_copy_(0, index, masked)

    def _additive(self, bitmask: np.ndarray, vocab: int) -> np.ndarray:
        """[rows, vocab] float32: 0 where allowed, -inf elsewhere, looked up a byte (8 tokens)
        at a time into a buffer kept across steps: a step allocates nothing (fresh pages for
        6 MB a step cost more than the arithmetic) and needs no torch threads."""
        rows = bitmask.shape[0]
        if self._buffer.shape[0] < rows:
            self._buffer = np.empty((rows, self.words * 4, 8), dtype=np.float32)
        out = self._buffer[:rows]
        np.take(_BYTE_TO_ADDITIVE, bitmask.view(np.uint8), axis=0, out=out)
        return out.reshape(rows, self.words * 32)[:, :vocab]

    def _rows(self, count: int) -> np.ndarray:
        if self._bitmask.shape[0] < count:
            self._bitmask = np.empty((count, self.words), dtype=np.int32)
        return self._bitmask[:count]


# Row b: the 8 additive mask values of a bitmask byte b (bit i set = token allowed -> 0.0).
_BYTE_TO_ADDITIVE = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
    0.0,
    -np.inf,
).astype(np.float32)
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """int32 [rows, words] bitmask -> bool [rows, vocab] on ``device`` (bit t = token t)."""
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    return unpack_bitmask_on(bitmask, vocab, device)


def unpack_bitmask_on(bitmask: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """The same, shipping the packed words (32x smaller than the bits) and unpacking there."""
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = torch.from_numpy(bitmask).to(device, non_blocking=True)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab].bool()
