"""Runs a scheduled batch and samples.

A step: inputs (token ids, positions, the flat layout: ``engine_worker.step_inputs``) ->
``attention.prepare`` -> the model's forward -> logprobs of the rows that asked
(``engine_worker.logprobs``) -> sample."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_worker.attention import PagedKVCache, select_backend
from engine_worker.grammar_mask import GrammarMasker
from engine_worker.logprobs import PromptSpan, SampledLogprobs, prompt_logprobs
from engine_worker.model import ForwardOutput, LlamaFamilyModel
from engine_worker.request import EngineRequest
from engine_worker.sampler import sample
from engine_worker.speculative import VerifierDraws, accepted_tokens, rows_of
from engine_worker.step_inputs import ModelInputs, StepLayout
from ipc.messages import PromptLogprobs, TokenLogprobs


@dataclass(slots=True)
class StepLogits:
    """A step's logits: each emitting request's ``widths`` sampling rows, in request order, then
    the prompt-logprob rows of ``spans`` (indices into ``span_requests``)."""

    logits: torch.Tensor
    emitting: list[int]
    widths: list[int]
    spans: list[PromptSpan]
    span_requests: list[EngineRequest]
    prompt_ends: dict[int, torch.Tensor]  # StepResult's


@dataclass(slots=True)
class StepResult:
    """The sampled token per scheduled request (None where its step did not reach the end of
    its tokens, or where it was deferred), and the logprobs of the requests that asked."""

    tokens: list[int | None]
    logprobs: dict[int, TokenLogprobs]  # by request index in the step
    prompt_logprobs: list[PromptLogprobs]
    # Requests that verified drafts: the tokens they emit after ``tokens[index]`` (accepted
    # drafts, then the correction or bonus token but the last of them; engine_worker/
    # speculative.py), and those tokens' logprobs where asked.
    accepted: dict[int, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests whose prompt ended in this step: the final hidden state of that row (what a
    # prompt tail keeps, engine_worker/prefix_tails.py).
    prompt_ends: dict[int, torch.Tensor] = field(default_factory=dict)
    # Requests (indices) that reached the end of their tokens but whose grammar mask was not
    # ready: nothing was drawn for them; their last token is computed again at a later step.
    deferred: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: LlamaFamilyModel,
        num_blocks: int,
        block_size: int,
        decode_workspace_max_bytes: int = 1 << 30,
        whole_key_blocks: bool = False,
    ) -> None:
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.layout = StepLayout(block_size, model.device)
        self.kv_cache = PagedKVCache(
            model.config, num_blocks, block_size, model.dtype, model.device
        )
        self.attention = select_backend(
            self.kv_cache,
            decode_workspace_max_bytes,
            whole_key_blocks,
            model.config.layer_attention,
        )
        self.grammar_masker: GrammarMasker | None = None  # made for the first constrained row

    @torch.inference_mode()
    def run(
        self,
        requests: list[EngineRequest],
        counts: list[int],
        kept_ends: dict[int, torch.Tensor] | None = None,
    ) -> StepResult:
        """Computes the scheduled tokens, samples, and reads the logprobs that were asked for
        (``kept_ends``: see ``forward``). A row with a grammar samples only a token the grammar
        allows (its logprobs stay the model's own); one whose mask is not ready yet draws
        nothing (``deferred``)."""
        step = self.forward(requests, counts, kept_ends)
        logits, emitting, widths = step.logits, step.emitting, step.widths
        result = StepResult([None] * len(requests), {}, [], prompt_ends=step.prompt_ends)
        sampling_rows = sum(widths)
        if step.spans:
            result.prompt_logprobs = prompt_logprobs(
                logits[sampling_rows:], step.spans, step.span_requests
            )
        logits = logits[:sampling_rows]
        grammars = [requests[i].grammar for i in emitting]
        if any(g is not None for g in grammars):
            # Decided once, here: a mask that arrives later waits for the row's next step.
            keep = [j for j, g in enumerate(grammars) if g is None or g.mask_ready()]
            if len(keep) < len(emitting):
                kept = set(keep)
                result.deferred = [i for j, i in enumerate(emitting) if j not in kept]
                logits = logits[rows_of(widths, keep)]
                emitting, widths = [emitting[j] for j in keep], [widths[j] for j in keep]
                grammars = [grammars[j] for j in keep]
        if emitting:
            self._sample(logits, requests, emitting, widths, grammars, result)
        return result

    def _sample(
        self,
        logits: torch.Tensor,
        requests: list[EngineRequest],
        emitting: list[int],
        widths: list[int],
        grammars: list,
        result: StepResult,
    ) -> None:
        """Draws a token for each row of ``logits``: ``widths[j]`` rows for ``emitting[j]``
        (more than one when it verifies drafts)."""
        verifying = any(w > 1 for w in widths)
        owners = [i for i, w in zip(emitting, widths) for _ in range(w)] if verifying else emitting
        if verifying:
            grammars = [g for g, w in zip(grammars, widths) for _ in range(w)]
        samplers = [requests[i].sampler for i in owners]
        asking = [j for j, s in enumerate(samplers) if s.logprobs is not None]
        # Taken before sampling: whatever the sampler does to the logits, these stay raw.
        raw = (
            SampledLogprobs(logits, asking, [samplers[j].logprobs or 0 for j in asking])
            if asking
            else None
        )
        if any(g is not None for g in grammars):
            if self.grammar_masker is None:
                self.grammar_masker = GrammarMasker(self.model.config.vocab_size)
            self.grammar_masker.apply(logits, grammars)  # only the tokens the grammar allows
        histories = None
        if any(s.needs_history for s in samplers):
            histories = [(requests[i].token_ids, requests[i].prompt_len) for i in owners]
        if not verifying:
            chosen = sample(logits, samplers, histories)
            if raw is not None:
                result.logprobs = {emitting[e.row]: e for e in raw.finish(chosen)}
            for index, token in zip(emitting, chosen.tolist()):
                result.tokens[index] = token
            return
        draws = VerifierDraws([requests[i].sampler for i in emitting], widths, logits.device)
        chosen = sample(logits, samplers, histories, draws.uniforms)
        by_row = {e.row: e for e in raw.finish(chosen)} if raw is not None else {}
        tokens, first = chosen.tolist(), 0
        for j, (index, width) in enumerate(zip(emitting, widths)):
            run = tokens[first : first + width]
            if width > 1:
                run = accepted_tokens(run, requests[index].draft_ids)
                draws.advance(j, len(run))
                result.accepted[index] = run[1:]
            result.tokens[index] = run[0]
            entries = [by_row[r] for r in range(first, first + len(run)) if r in by_row]
            if entries:
                result.logprobs[index] = entries[0]
                result.accepted_logprobs[index] = entries[1:]
            first += width

    @torch.inference_mode()
    def forward(
        self,
        requests: list[EngineRequest],
        counts: list[int],
        kept_ends: dict[int, torch.Tensor] | None = None,
    ) -> StepLogits:
        """The forward of the scheduled tokens (their KV written), and the logits of the step.
        ``kept_ends``: by request index, the kept final hidden state of a request scheduled with
        no token (its prompt's end was kept with a prompt tail): it samples from that row, in
        the same head call as the computed ones (the head's copy is picked by the step's
        sampling rows, as if it had computed that row here)."""
        if not kept_ends:
            inputs = self.layout.inputs(requests, counts)
            out = self._forward(inputs)
            ends = self._prompt_ends(requests, inputs, range(len(requests)), out.final_hidden)
            return StepLogits(
                out.logits, inputs.emitting, inputs.widths, inputs.prompt_spans, requests, ends
            )
        kept = sorted(kept_ends)
        ends_in = torch.stack([kept_ends[i] for i in kept])
        computed = [i for i, count in enumerate(counts) if count > 0]
        if not computed:
            logits = self.model.head(ends_in, len(kept))
            return StepLogits(logits, kept, [1] * len(kept), [], [], {})
        subset = [requests[i] for i in computed]
        inputs = self.layout.inputs(subset, [counts[i] for i in computed])
        out = self._forward(inputs, ends_in)
        ends = self._prompt_ends(subset, inputs, computed, out.final_hidden)
        # Back to the step's request order (the sampling rows were the computed requests', then
        # the kept ones).
        owners = [computed[j] for j in inputs.emitting] + kept
        widths = inputs.widths + [1] * len(kept)
        starts = np.cumsum([0, *widths[:-1]])
        order = sorted(range(len(owners)), key=owners.__getitem__)
        rows = [r for k in order for r in range(starts[k], starts[k] + widths[k])]
        sampling = sum(widths)
        index = torch.tensor(rows, device=out.logits.device)
        logits = torch.cat([out.logits[:sampling].index_select(0, index), out.logits[sampling:]])
        emitting, widths = [owners[k] for k in order], [widths[k] for k in order]
        return StepLogits(logits, emitting, widths, inputs.prompt_spans, subset, ends)

    @staticmethod
    def _prompt_ends(
        requests: list[EngineRequest],
        inputs: ModelInputs,
        indices: Sequence[int],
        final_hidden: torch.Tensor,
    ) -> dict[int, torch.Tensor]:
        """The final hidden state of each request whose prompt ended in this step (by
        ``indices[i]`` for ``requests[i]``), copied out of the step's buffers."""
        ends: dict[int, torch.Tensor] = {}
        if inputs.decode_rows == len(inputs.input_ids):  # no prompt rows
            return ends
        row = 0
        for j, width in zip(inputs.emitting, inputs.widths):
            if requests[j].num_generated == 0:
                ends[indices[j]] = final_hidden[row].clone()
            row += width
        return ends

    def _forward(self, inputs: ModelInputs, kept: torch.Tensor | None = None) -> ForwardOutput:
        metadata = self.attention.prepare(inputs.step)
        try:
            return self.model.forward(
                inputs.input_ids,
                inputs.positions,
                self.attention,
                metadata,
                inputs.logit_rows,
                inputs.decode_rows,
                sum(inputs.widths),
                inputs.batches,
                kept,
            )
        except BaseException:
            self.attention.reset()  # what it keeps may hold only some layers' copies
            raise

    def reset(self) -> None:
        """Frees what attention keeps between steps (the engine calls this when idle)."""
        self.attention.reset()

    def expert_stats(self) -> dict:
        """A mixture of experts' load since start, as ``EngineStats`` fields ({} if dense)."""
        return self.model.expert_stats()
