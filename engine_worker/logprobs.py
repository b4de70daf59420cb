"""Logprobs for the requests that asked, from the raw logits of the step (before penalties,
logit_bias, temperature and any filtering: the model's own distribution, as vLLM's default).

* Sampled tokens: ``SampledLogprobs`` takes the log-softmax of the asking rows in one batched
  call before the sampler runs (so nothing the sampler or a mask does to the logits can leak in)
  and, once the tokens are drawn, reads each row's own logprob and its top-k.
* Prompt tokens: the model runner asks the forward for the logits of every prompt position of a
  request that wants them (``prompt_spans`` lays them out after the sampling rows); position q's
  logprob is read from the row of position q - 1. A prefill chunk yields the positions it
  computed; positions a request already sent (a recompute after preemption) are not sent again.

Rows that did not ask cost nothing: no log-softmax, no copy, no transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_worker.request import EngineRequest
from ipc.messages import PromptLogprobs, TokenLogprobs

_F32 = np.dtype("<f4")
_I32 = np.dtype("<i4")


class SampledLogprobs:
    """Logprobs of the sampled tokens of the rows (of the sampling logits) that asked."""

    __slots__ = ("rows", "top_ks", "logprobs", "top_values", "top_ids")

    def __init__(self, logits: torch.Tensor, rows: list[int], top_ks: list[int]) -> None:
        self.rows, self.top_ks = rows, top_ks
        index = torch.tensor(rows, device=logits.device)
        self.logprobs = logits.index_select(0, index).log_softmax(dim=-1)
        self.top_values = self.top_ids = None
        k = max(top_ks)
        if k:
            self.top_values, self.top_ids = self.logprobs.topk(k, dim=-1)

    def finish(self, tokens: torch.Tensor) -> list[TokenLogprobs]:
        """``tokens``: the step's sampled ids, one per sampling row. Each TokenLogprobs' ``row``
        is the sampling row here; the engine turns it into the StepOutput row."""
        index = torch.tensor(self.rows, device=tokens.device)
        chosen = self.logprobs.gather(1, tokens.index_select(0, index).unsqueeze(1))
        values = chosen.squeeze(1).cpu().tolist()
        top_values = top_ids = None
        if self.top_values is not None and self.top_ids is not None:
            top_values = self.top_values.cpu().numpy().astype(_F32, copy=False)
            top_ids = self.top_ids.cpu().numpy().astype(_I32)
        out = []
        for j, (row, k) in enumerate(zip(self.rows, self.top_ks)):
            entry = TokenLogprobs(row=row, logprob=values[j])
            if k and top_values is not None and top_ids is not None:
                entry.top_ids = top_ids[j, :k].tobytes()
                entry.top_logprobs = top_values[j, :k].tobytes()
            out.append(entry)
        return out


@dataclass(slots=True)
class PromptSpan:
    """Prompt positions ``first .. first + count - 1`` of the request at ``index`` in the step,
    predicted by ``count`` consecutive flat rows from ``row``."""

    index: int
    first: int
    count: int
    row: int


def prompt_spans(
    requests: list[EngineRequest], counts: list[int], starts: np.ndarray, row_starts: np.ndarray
) -> list[PromptSpan]:
    """The prompt positions whose logprobs this step can give: those predicted by the rows it
    computes (the row at position p predicts position p + 1), not sent before, and inside the
    prompt (the row of the last prompt position predicts the first generated token)."""
    spans = []
    for i, request in enumerate(requests):
        if not request.wants_prompt_logprobs:
            continue
        start = int(starts[i])
        first = max(start + 1, request.prompt_logprobs_from)
        stop = min(start + counts[i], request.prompt_len - 1) + 1
        if stop > first:
            spans.append(PromptSpan(i, first, stop - first, int(row_starts[i]) + first - 1 - start))
    return spans


def span_rows(spans: list[PromptSpan]) -> np.ndarray:
    return np.concatenate([np.arange(s.row, s.row + s.count) for s in spans])


def prompt_logprobs(
    logits: torch.Tensor, spans: list[PromptSpan], requests: list[EngineRequest]
) -> list[PromptLogprobs]:
    """``logits``: the spans' rows in order (overwritten with their log-softmax, in place: the
    prompt rows can be many, and nothing else reads them). One PromptLogprobs per span."""
    logits -= torch.logsumexp(logits, dim=-1, keepdim=True)
    targets = torch.tensor(
        np.concatenate([requests[s.index].token_ids[s.first : s.first + s.count] for s in spans]),
        device=logits.device,
    )
    chosen = logits.gather(1, targets.unsqueeze(1)).squeeze(1).cpu().numpy().astype(_F32)
    top_ks = [requests[s.index].params.prompt_logprobs or 0 for s in spans]
    top_values = top_ids = None
    if max(top_ks):
        values, ids = logits.topk(max(top_ks), dim=-1)
        top_values = values.cpu().numpy().astype(_F32, copy=False)
        top_ids = ids.cpu().numpy().astype(_I32)
    out, offset = [], 0
    for span, k in zip(spans, top_ks):
        end = offset + span.count
        request = requests[span.index]
        entry = PromptLogprobs(request.request_id, span.first, chosen[offset:end].tobytes(), k)
        if k and top_values is not None and top_ids is not None:
            entry.top_ids = np.ascontiguousarray(top_ids[offset:end, :k]).tobytes()
            entry.top_logprobs = np.ascontiguousarray(top_values[offset:end, :k]).tobytes()
        out.append(entry)
        offset = end
    return out
