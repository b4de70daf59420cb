"""Turns a scheduled batch into the flat tensors the forward reads, runs it and samples.

All per-token index work (positions, cache slots, block tables) is done with a handful of numpy
ops per step, never a Python loop over tokens."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from engine_worker.attention import (
    AttentionBatch,
    ContinuationBatch,
    DecodeWorkspace,
    PrefillSegment,
)
from engine_worker.model import LlamaFamilyModel
from engine_worker.request import EngineRequest
from engine_worker.sampler import sample


class ModelRunner:
    # Spare columns a new decode workspace gets, so it serves this many steps before a rebuild.
    WORKSPACE_HEADROOM = 32
    # Attend all prefill continuations of a step together (False: one segment at a time). The
    # shared-prefix part uses PyTorch's fused CPU flash kernel (a private op, for its log-sum-exp):
    # elsewhere (CUDA, a torch without it) each segment goes through SDPA on its own.
    batch_continuations: bool | None = None  # None: decide from the device and the torch build

    def __init__(self, model: LlamaFamilyModel, num_blocks: int, block_size: int,
                 decode_workspace_max_bytes: int = 1 << 30) -> None:
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
        if self.batch_continuations is None:
            self.batch_continuations = self.device.type == "cpu" and hasattr(
                torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
        self.workspace_max_bytes = decode_workspace_max_bytes
        self.workspace_bytes_per_token = self.bytes_per_token(cfg, model.dtype)
        # The last step's decode workspace, the requests it holds (in order) and their contexts.
        self._workspace: DecodeWorkspace | None = None
        self._workspace_requests: list[EngineRequest] = []
        self._workspace_context: np.ndarray | None = None

    @staticmethod
    def bytes_per_token(model_config, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return (2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim
                * element)

    def run(self, requests: list[EngineRequest], counts: list[int]) -> list[int | None]:
        """Computes the scheduled tokens; returns the sampled token per request (None where the
        request's step did not reach the end of its tokens)."""
        logits, emitting = self.compute_logits(requests, counts)
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
        (input_ids, positions, batch, logit_rows), emitting = self._prepare(requests, counts)
        try:
            logits = self.model.forward(input_ids, positions, batch, self.k_cache, self.v_cache,
                                        logit_rows)
        except BaseException:
            self.reset()  # it may hold only some layers' copies
            raise
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
            batch.decode_rows = to_device(seq_starts[decode_seqs])
            ws = self._decode_workspace([requests[i] for i in decode_seqs], context)
            if ws is None or ws.fresh:
                blocks = (ws.capacity // size) if ws is not None else -(-int(context.max()) // size)
                # Rows with fewer blocks read block 0 past their end; the mask zeroes those.
                table = np.zeros((len(decode_seqs), blocks), dtype=np.int64)
                width = min(blocks, tables.shape[1])
                table[:, :width] = tables[decode_seqs, :width]
                batch.decode_block_tables = to_device(table)
            if ws is not None:
                ws.new_positions = to_device(context - 1)
                batch.decode_workspace = ws
                columns = ws.capacity
            else:
                columns = batch.decode_block_tables.shape[1] * size
            padding = np.arange(columns)[None, None, :] >= context[:, None, None]
            mask = torch.zeros(padding.shape, dtype=self.model.dtype)
            mask.masked_fill_(torch.from_numpy(padding), float("-inf"))
            # One copy per kv head, built once per step rather than in every layer.
            batch.decode_mask = mask.repeat(self.num_kv_heads, 1, 1).to(self.device)
        else:
            self.reset()
        prefilling = np.nonzero(~single)[0]
        if self.batch_continuations:
            continuing = prefilling[starts[prefilling] > 0]
            if len(continuing):
                batch.continuations = self._continuations(
                    continuing, starts, lengths, seq_starts, tables, to_device)
                prefilling = prefilling[starts[prefilling] == 0]
        for i in prefilling:
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

    def _continuations(self, seqs: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                       seq_starts: np.ndarray, tables: np.ndarray, to_device) -> ContinuationBatch:
        """The padded batch of the continuation sequences ``seqs``; sequences whose tables
        begin with the same blocks (all before any of their new tokens) share those."""
        size = self.block_size
        # Segments with the same first block are adjacent; each such run is a candidate group.
        seqs = seqs[np.argsort(tables[seqs, 0], kind="stable")]
        count = len(seqs)
        seg_starts, seg_lengths = starts[seqs], lengths[seqs]
        blocks = -(-(seg_starts + seg_lengths) // size)
        shared = np.zeros(count, dtype=np.int64)  # prefix blocks of each segment
        groups = []
        first = 0
        while first < count:
            end = first + 1
            while end < count and tables[seqs[end], 0] == tables[seqs[first], 0]:
                end += 1
            if end - first > 1:
                limit = int(seg_starts[first:end].min()) // size  # blocks before every query
                rows = tables[seqs[first:end], :limit]
                same = (rows == rows[0]).all(axis=0)
                common = int(limit if same.all() else np.argmin(same))
                if common:
                    shared[first:end] = common
                    groups.append((first, end, to_device(rows[0, :common].copy())))
            first = end
        rest_blocks = int((blocks - shared).max())
        rest = np.zeros((count, rest_blocks), dtype=np.int64)  # pads read block 0, masked
        for j, i in enumerate(seqs):
            rest[j, :blocks[j] - shared[j]] = tables[i, shared[j]:blocks[j]]
        max_tokens = int(seg_lengths.max())
        # Query j of segment s sits at position start + j; rest column c holds position
        # shared * size + c. Pad queries (j >= length) see every real key, so no row is empty.
        query_pos = seg_starts[:, None] + np.arange(max_tokens)[None, :]
        key_pos = shared[:, None] * size + np.arange(rest_blocks * size)[None, :]
        hidden = ((key_pos[:, None, :] > query_pos[:, :, None])
                  | (key_pos >= (seg_starts + seg_lengths)[:, None])[:, None, :])
        mask = torch.zeros(hidden.shape, dtype=self.model.dtype)
        mask.masked_fill_(torch.from_numpy(hidden), float("-inf"))
        within = np.arange(max_tokens)[None, :]
        real = within < seg_lengths[:, None]
        gather_rows = seq_starts[seqs][:, None] + np.minimum(within, seg_lengths[:, None] - 1)
        return ContinuationBatch(
            max_tokens=max_tokens, gather_rows=to_device(gather_rows.reshape(-1)),
            padded_index=to_device(np.nonzero(real.reshape(-1))[0]),
            out_rows=to_device(gather_rows[real]),
            rest_table=to_device(rest.reshape(-1)),
            rest_mask=mask[:, :, None, :].to(self.device), groups=groups)

    def _decode_workspace(self, decoding: list[EngineRequest],
                          context: np.ndarray) -> DecodeWorkspace | None:
        """The workspace for this step's decode rows: last step's when the same requests (same
        order) each grew by exactly one token and still fit, else a fresh one (None: too big)."""
        ws = self._workspace
        longest = int(context.max())
        if (ws is not None and longest <= ws.capacity
                and len(decoding) == len(self._workspace_requests)
                and all(a is b for a, b in zip(decoding, self._workspace_requests))
                and np.array_equal(self._workspace_context + 1, context)):
            ws.fresh = False
        else:
            self.reset()
            size = self.block_size
            capacity = -(-(longest + self.WORKSPACE_HEADROOM) // size) * size
            if capacity * len(decoding) * self.workspace_bytes_per_token > self.workspace_max_bytes:
                return None
            ws = DecodeWorkspace(capacity=capacity, keys=[], values=[])
            self._workspace, self._workspace_requests = ws, decoding
        self._workspace_context = context
        return ws

    def reset(self) -> None:
        """Frees the decode workspace (the engine calls this when nothing is running)."""
        self._workspace, self._workspace_requests, self._workspace_context = None, [], None
