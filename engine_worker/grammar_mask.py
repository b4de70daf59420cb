"""Applies the constrained rows' grammars to a step's logits, in one batched call.

For the rows whose request has a grammar, llguidance fills one bitmask row each (bit t of a row
set = token t allowed) in a single call that runs the matchers on its own threads, without the
GIL. The fill needs only the matchers, not the logits, so ``begin`` starts it on a helper thread
before the forward and ``finish`` waits for it after: its cost hides behind the model (a string
with a maxLength costs llguidance ~0.3 ms a row, ten times a plain one). On the CPU the bits
become an additive mask (0 allowed, -inf not) added to those rows in place with numpy; elsewhere
the packed words go to the device and are unpacked there. A step with no constrained row
returns at once: unconstrained batches pay nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from engine_worker.grammar_builder import RequestGrammar


@dataclass(slots=True)
class _Fill:
    grammars: list[RequestGrammar | None]
    rows: list[int]  # rows with a matcher, in bitmask order
    failed: list[int]  # rows whose grammar failed to build
    bitmask: np.ndarray
    done: Future | None  # None: filled already


class GrammarMasker:
    def __init__(self, vocab_size: int, threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.executor = llguidance.LLExecutor(threads)
        self._thread: ThreadPoolExecutor | None = None
        self._pending: _Fill | None = None
        self._bitmask: np.ndarray = np.empty((0, self.words), dtype=np.int32)
        self._buffer: np.ndarray = np.empty((0, self.words * 4, 8), dtype=np.float32)

    def apply(self, logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> list[int]:
        """``begin`` + ``finish`` without a helper thread (nothing to overlap with)."""
        self.begin(grammars, overlap=False)
        return self.finish(logits)

    def begin(self, grammars: Sequence[RequestGrammar | None], overlap: bool = True) -> None:
        """Starts filling the masks of the rows where ``grammars[row]`` is set (each must be
        ready); the step must not advance a matcher before ``finish``."""
        if self._pending is not None:  # the step that began it failed before finish()
            self.cancel()
        rows: list[int] = []
        failed: list[int] = []
        matchers: list[tuple[llguidance.LLMatcher, int]] = []
        for row, grammar in enumerate(grammars):
            if grammar is None:
                continue
            if not grammar.ready():
                raise RuntimeError(f"row {row}: the grammar is not built yet")
            if grammar.matcher is None:
                failed.append(row)  # the build failed; ready() set grammar.error
            else:
                matchers.append((grammar.matcher, len(rows)))
                rows.append(row)
        bitmask = self._rows(len(rows))
        done = None
        if matchers:
            args = (matchers, bitmask.ctypes.data, self.words * 4, len(rows))
            if overlap:
                if self._thread is None:
                    self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
                done = self._thread.submit(self.executor.unsafe_compute_mask_ptr, *args)
            else:
                self.executor.unsafe_compute_mask_ptr(*args)
        self._pending = _Fill(list(grammars), rows, failed, bitmask, done)

    @torch.inference_mode()  # the step's logits are inference tensors
    def finish(self, logits: torch.Tensor) -> list[int]:
        """Masks ``logits`` [rows, vocab] in place with what ``begin`` started. Returns the rows
        whose grammar failed (its build, or its matcher is in an error state): they are left
        unmasked, and the caller ends their requests with ``grammar.error``."""
        fill, self._pending = self._pending, None
        if fill is None:
            raise RuntimeError("finish() without begin()")
        if fill.done is not None:
            fill.done.result()
        failed = list(fill.failed)
        for slot, row in enumerate(fill.rows):
            grammar = fill.grammars[row]
            if grammar.matcher.is_error():  # type: ignore[union-attr]
                grammar.error = grammar.error or grammar.matcher.get_error()  # type: ignore
                failed.append(row)
                fill.bitmask[slot] = -1  # all bits set: the row stays as it was
        if fill.rows:
            if logits.shape[1] > self.vocab_size:
                raise ValueError(f"logits are {logits.shape[1]} wide, the masks {self.vocab_size}")
            self._mask(logits, fill.rows, fill.bitmask)
        return sorted(failed)

    def cancel(self) -> None:
        """Drops what ``begin`` started (the step failed), once the fill is done with it."""
        fill, self._pending = self._pending, None
        if fill is not None and fill.done is not None:
            fill.done.result()

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

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


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
