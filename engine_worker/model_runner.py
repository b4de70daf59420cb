"""Turns a scheduled batch into the flat tensors the forward reads, runs it and samples.

A step: inputs (token ids, positions, the flat layout) -> ``attention.prepare`` -> the model's
forward -> sample. All per-token index work (positions, cache slots, block tables) is done with a
handful of numpy ops per step, never a Python loop over tokens."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from engine_worker.attention import PagedKVCache, StepBatch, select_backend
from engine_worker.attention.batch import to_device
from engine_worker.grammar_mask import GrammarMasker
from engine_worker.model import LlamaFamilyModel
from engine_worker.request import EngineRequest
from engine_worker.sampler import sample


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    logit_rows: torch.Tensor | None  # rows whose logits are wanted (None: every row)
    emitting: list[int]  # the requests (indices) whose step reaches the end of their tokens
    step: StepBatch


class ModelRunner:
    def __init__(self, model: LlamaFamilyModel, num_blocks: int, block_size: int,
                 decode_workspace_max_bytes: int = 1 << 30) -> None:
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.kv_cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype,
                                     model.device)
        self.attention = select_backend(self.kv_cache, decode_workspace_max_bytes)
        self.grammar_masker: GrammarMasker | None = None  # made for the first constrained row

    def run(self, requests: list[EngineRequest], counts: list[int]) -> list[int | None]:
        """Computes the scheduled tokens; returns the sampled token per request (None where the
        request's step did not reach the end of its tokens)."""
        inputs = self._inputs(requests, counts)
        emitting = inputs.emitting
        masker = self._grammar_masker([requests[i].grammar for i in emitting])
        try:
            logits = self._forward(inputs)
        except BaseException:
            if masker is not None:
                masker.cancel()
            raise
        if masker is not None:
            masker.finish(logits)  # the rows with a grammar: only the tokens it allows
        result: list[int | None] = [None] * len(requests)
        if emitting:
            samplers = [requests[i].sampler for i in emitting]
            histories = None
            if any(s.penalized for s in samplers):
                histories = [(requests[i].token_ids, requests[i].prompt_len) for i in emitting]
            tokens = sample(logits, samplers, histories).tolist()
            for index, token in zip(emitting, tokens):
                result[index] = token
        return result

    @torch.inference_mode()
    def compute_logits(self, requests: list[EngineRequest],
                       counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Writes the scheduled tokens' KV; returns logits of the requests whose step reaches
        the end of their tokens, and those requests' indices."""
        inputs = self._inputs(requests, counts)
        return self._forward(inputs), inputs.emitting

    @torch.inference_mode()
    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        metadata = self.attention.prepare(inputs.step)
        try:
            return self.model.forward(inputs.input_ids, inputs.positions, self.attention,
                                      metadata, inputs.logit_rows)
        except BaseException:
            self.attention.reset()  # what it keeps may hold only some layers' copies
            raise

    def _grammar_masker(self, grammars: list) -> GrammarMasker | None:
        """None when no row of the step has a grammar (unconstrained steps pay nothing);
        otherwise the masker, with the rows' masks already being filled while the forward
        runs (they need the matchers only, not the logits)."""
        if not any(g is not None for g in grammars):
            return None
        if self.grammar_masker is None:
            self.grammar_masker = GrammarMasker(self.model.config.vocab_size)
        self.grammar_masker.begin(grammars)
        return self.grammar_masker

    def reset(self) -> None:
        """Frees what attention keeps between steps (the engine calls this when idle)."""
        self.attention.reset()

    def close(self) -> None:
        if self.grammar_masker is not None:
            self.grammar_masker.close()

    def _inputs(self, requests: list[EngineRequest], counts: list[int]) -> ModelInputs:
        num_seqs = len(requests)
        starts = np.fromiter((r.num_computed for r in requests), dtype=np.int64, count=num_seqs)
        lengths = np.asarray(counts, dtype=np.int64)
        row_ends = np.cumsum(lengths)
        row_starts = row_ends - lengths
        total = int(row_ends[-1])
        emitting = [i for i, r in enumerate(requests) if r.num_computed + counts[i] == r.num_tokens]
        input_ids = np.fromiter(
            itertools.chain.from_iterable(r.token_ids[r.num_computed:r.num_computed + n]
                                          for r, n in zip(requests, counts)),
            dtype=np.int64, count=total)
        width = max(len(r.block_ids) for r in requests)
        tables: np.ndarray = np.zeros((num_seqs, width), dtype=np.int64)
        for i, r in enumerate(requests):
            tables[i, :len(r.block_ids)] = r.block_ids
        size = self.block_size
        seq_of_row: np.ndarray = np.repeat(np.arange(num_seqs), lengths)
        positions = np.arange(total) - row_starts[seq_of_row] + starts[seq_of_row]
        slots = tables[seq_of_row, positions // size] * size + positions % size
        step = StepBatch(sequences=requests, starts=starts, lengths=lengths,
                         row_starts=row_starts, block_tables=tables, slots=slots,
                         block_size=size)
        logit_rows = None
        if len(emitting) != total:
            logit_rows = to_device(row_ends[emitting] - 1, self.device)
        return ModelInputs(to_device(input_ids, self.device), to_device(positions, self.device),
                           logit_rows, emitting, step)
