"""A step's flat batch: the token ids, positions, cache slots and block tables the forward reads,
and which rows sample, laid out with a handful of numpy ops per step (never a Python loop over
tokens)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from engine_worker.attention import StepBatch
from engine_worker.attention.batch import to_device
from engine_worker.logprobs import PromptSpan, prompt_spans, span_rows
from engine_worker.request import EngineRequest
from engine_worker.speculative import row_offsets


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    logit_rows: torch.Tensor | None  # rows whose logits are wanted (None: every row)
    emitting: list[int]  # the requests (indices) that sample a token in this step
    widths: list[int]  # logit rows each of them samples from (1 + its drafts)
    step: StepBatch
    prompt_spans: list[PromptSpan]  # prompt logprobs: their rows follow the emitting ones
    decode_rows: int  # the first rows are the decoding requests' (one decoded token each)
    # (decoding requests, sampling requests) when some verify drafts (several rows each)
    batches: tuple[int, int] | None = None


class StepLayout:
    """Lays out steps over a paged cache of ``block_size``-token blocks on ``device``."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size, self.device = block_size, device

    def _logit_rows(
        self, sampling: np.ndarray, spans: list[PromptSpan], total: int, order: np.ndarray
    ) -> torch.Tensor | None:
        """The rows whose logits the step needs: the sampling rows, then the prompt-logprob
        spans' (None: every row, in order)."""
        if spans:
            return to_device(np.concatenate([sampling, span_rows(spans)]), self.device)
        if len(sampling) != total or not np.array_equal(order, np.arange(len(order))):
            return to_device(sampling, self.device)
        return None

    def inputs(self, requests: list[EngineRequest], counts: list[int]) -> ModelInputs:
        """The step's flat batch. Its rows are laid out decoding requests first: a layer with
        a quantized and a dense copy gives the decode rows one and the prompt rows the other,
        so a prompt token is computed alike whatever else the step holds. A request verifying
        drafts is a decoding request with 1 + drafts rows, all of them sampling rows."""
        if all(
            count == 1
            and r.num_computed >= r.prompt_len
            and not r.draft_ids
            and not r.wants_prompt_logprobs
            for r, count in zip(requests, counts)
        ):
            return self.decode_inputs(requests)
        return self.layout_inputs(requests, counts)

    def layout_inputs(self, requests: list[EngineRequest], counts: list[int]) -> ModelInputs:
        """``inputs`` of any step."""
        num_seqs = len(requests)
        decoding = np.fromiter(
            (r.num_computed >= r.prompt_len for r in requests), dtype=bool, count=num_seqs
        )
        order, starts, lengths, row_starts, row_ends = _rows(requests, counts, decoding)
        total = int(lengths.sum())
        drafts = np.fromiter((len(r.draft_ids) for r in requests), dtype=np.int64, count=num_seqs)
        emitting = [
            i
            for i, r in enumerate(requests)
            if r.num_computed + counts[i] == r.num_tokens + drafts[i] and r.samples
        ]
        input_ids = np.fromiter(
            itertools.chain.from_iterable(
                requests[i].step_tokens(starts[i], counts[i]) for i in order
            ),
            dtype=np.int64,
            count=total,
        )
        tables = _block_tables(requests)
        size = self.block_size
        seq_of_row: np.ndarray = np.repeat(order, lengths[order])
        positions = np.arange(total) - row_starts[seq_of_row] + starts[seq_of_row]
        slots = tables[seq_of_row, positions // size] * size + positions % size
        step = StepBatch(
            sequences=requests,
            starts=starts,
            lengths=lengths,
            row_starts=row_starts,
            block_tables=tables,
            slots=slots,
            block_size=size,
            decoded=decoding,
        )
        spans = []
        if any(r.wants_prompt_logprobs for r in requests):
            spans = prompt_spans(requests, counts, starts, row_starts)
        widths = drafts[emitting] + 1
        sampling = np.repeat(row_ends[emitting] - widths, widths) + row_offsets(widths)
        logit_rows = self._logit_rows(sampling, spans, total, order)
        decode_rows = int(lengths[decoding].sum())
        batches = None
        if drafts.any():
            batches = (decode_rows - int(drafts.sum()), len(emitting))
        return ModelInputs(
            to_device(input_ids, self.device),
            to_device(positions, self.device),
            logit_rows,
            emitting,
            widths.tolist(),
            step,
            spans,
            decode_rows,
            batches,
        )

    def decode_inputs(self, requests: list[EngineRequest]) -> ModelInputs:
        """``inputs`` of a step in which every request decodes one token of its own (no drafts,
        no prompt rows): one row each, in request order, without the general layout's sort
        and cumulative sums (the hot step; a few numpy calls cost µs each there)."""
        num_seqs = len(requests)
        positions = np.fromiter((r.num_computed for r in requests), dtype=np.int64, count=num_seqs)
        input_ids = np.fromiter(
            (r.token_ids[r.num_computed] for r in requests), dtype=np.int64, count=num_seqs
        )
        tables = _block_tables(requests)
        rows, size = np.arange(num_seqs), self.block_size
        emitting = [
            i for i, r in enumerate(requests) if r.num_computed + 1 == r.num_tokens and r.samples
        ]
        step = StepBatch(
            sequences=requests,
            starts=positions,
            lengths=np.ones(num_seqs, dtype=np.int64),
            row_starts=rows,
            block_tables=tables,
            slots=tables[rows, positions // size] * size + positions % size,
            block_size=size,
            decoded=np.ones(num_seqs, dtype=bool),
        )
        logit_rows = None
        if len(emitting) < num_seqs:
            logit_rows = to_device(np.asarray(emitting, dtype=np.int64), self.device)
        return ModelInputs(
            to_device(input_ids, self.device),
            to_device(positions, self.device),
            logit_rows,
            emitting,
            [1] * len(emitting),
            step,
            [],
            num_seqs,
        )


class RowOrder(NamedTuple):
    """Where each sequence's tokens sit among a step's flat rows."""

    order: np.ndarray  # the sequences in row order: decoding ones first, each group as given
    starts: np.ndarray  # each sequence's first position computed in the step
    lengths: np.ndarray  # its rows (tokens computed)
    row_starts: np.ndarray  # its first row
    row_ends: np.ndarray  # one past its last row


def _rows(requests: list[EngineRequest], counts: list[int], decoding: np.ndarray) -> RowOrder:
    num_seqs = len(requests)
    starts = np.fromiter((r.num_computed for r in requests), dtype=np.int64, count=num_seqs)
    lengths = np.asarray(counts, dtype=np.int64)
    order = np.argsort(~decoding, kind="stable")
    row_ends: np.ndarray = np.empty(num_seqs, dtype=np.int64)
    row_ends[order] = np.cumsum(lengths[order])
    return RowOrder(order, starts, lengths, row_ends - lengths, row_ends)


def _block_tables(requests: list[EngineRequest]) -> np.ndarray:
    """[S, widest table] each request's cache blocks, padded with block 0."""
    tables: np.ndarray = np.zeros(
        (len(requests), max(len(r.block_ids) for r in requests)), dtype=np.int64
    )
    for i, r in enumerate(requests):
        tables[i, : len(r.block_ids)] = r.block_ids
    return tables
