"""Turns a scheduled batch into the flat tensors the forward reads, runs it and samples.

All per-token index work (positions, cache slots, block tables) is done with a handful of numpy
ops per step, never a Python loop over tokens."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from engine_worker.attention import AttentionBatch, PrefillSegment
from engine_worker.model import LlamaFamilyModel
from engine_worker.request import EngineRequest
from engine_worker.sampler import sample


class ModelRunner:
    def __init__(self, model: LlamaFamilyModel, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_kv_heads = cfg.num_kv_heads
        shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        # Zeroed, not empty: padded attention reads unused slots with weight 0, and 0 * NaN
        # garbage would still poison the output.
        self.k_cache = torch.zeros(shape, dtype=model.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=model.dtype, device=self.device)

    @staticmethod
    def bytes_per_token(model_config, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * element

    def run(self, requests: list[EngineRequest], counts: list[int]) -> list[int | None]:
        """Computes the scheduled tokens; returns the sampled token per request (None where the
        request's step did not reach the end of its tokens)."""
        logits, emitting = self.compute_logits(requests, counts)
        result: list[int | None] = [None] * len(requests)
        if emitting:
            tokens = sample(logits, [requests[i].sampler for i in emitting]).tolist()
            for index, token in zip(emitting, tokens):
                result[index] = token
        return result

    @torch.inference_mode()
    def compute_logits(self, requests: list[EngineRequest],
                       counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Writes the scheduled tokens' KV; returns logits of the requests whose step reaches
        the end of their tokens, and those requests' indices."""
        (input_ids, positions, batch, logit_rows), emitting = self._prepare(requests, counts)
        logits = self.model.forward(input_ids, positions, batch, self.k_cache, self.v_cache,
                                    logit_rows)
        return logits, emitting

    def _prepare(self, requests: list[EngineRequest], counts: list[int]):
        size = self.block_size
        num_seqs = len(requests)
        starts = np.fromiter((r.num_computed for r in requests), dtype=np.int64, count=num_seqs)
        lengths = np.asarray(counts, dtype=np.int64)
        ends = starts + lengths
        seq_ends = np.cumsum(lengths)
        seq_starts = seq_ends - lengths
        total = int(seq_ends[-1])
        emitting = [i for i, r in enumerate(requests) if r.num_computed + counts[i] == r.num_tokens]
        input_ids = np.fromiter(
            itertools.chain.from_iterable(r.token_ids[r.num_computed:r.num_computed + n]
                                          for r, n in zip(requests, counts)),
            dtype=np.int64, count=total)
        width = max(len(r.block_ids) for r in requests)
        tables = np.zeros((num_seqs, width), dtype=np.int64)
        for i, r in enumerate(requests):
            tables[i, :len(r.block_ids)] = r.block_ids
        seq_of_row = np.repeat(np.arange(num_seqs), lengths)
        positions = np.arange(total) - seq_starts[seq_of_row] + starts[seq_of_row]
        slots = tables[seq_of_row, positions // size] * size + positions % size

        to_device = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)  # noqa: E731
        batch = AttentionBatch(slot_mapping=to_device(slots))
        single = lengths == 1
        if single.all():
            batch.decode_is_whole_batch = True
        if single.any():
            decode_seqs = np.nonzero(single)[0]
            context = ends[decode_seqs]
            blocks = -(-int(context.max()) // size)
            batch.decode_rows = to_device(seq_starts[decode_seqs])
            batch.decode_block_tables = to_device(np.ascontiguousarray(tables[decode_seqs, :blocks]))
            padding = np.arange(blocks * size)[None, None, :] >= context[:, None, None]
            mask = torch.zeros(padding.shape, dtype=self.model.dtype)
            mask.masked_fill_(torch.from_numpy(padding), float("-inf"))
            # One copy per kv head, built once per step rather than in every layer.
            batch.decode_mask = mask.repeat(self.num_kv_heads, 1, 1).to(self.device)
        for i in np.nonzero(~single)[0]:
            start, n = int(starts[i]), int(lengths[i])
            seg = PrefillSegment(row_start=int(seq_starts[i]), num_tokens=n, start_position=start)
            if start > 0:
                blocks = -(-(start + n) // size)
                seg.block_table = to_device(tables[i, :blocks].copy())
                query_pos = np.arange(start, start + n)[:, None]
                seg.mask = to_device(np.arange(start + n)[None, :] <= query_pos)
            batch.prefills.append(seg)
        logit_rows = None
        if len(emitting) != total:
            logit_rows = to_device(seq_ends[emitting] - 1)
        return (to_device(input_ids), to_device(positions), batch, logit_rows), emitting
