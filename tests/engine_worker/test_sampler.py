"""The batched sampler draws from the distribution it promises: temperature, top-k and top-p
(also a nucleus wider than the first candidate pass), each request's draws independent of what
shares its batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_worker.sampler import CANDIDATES, RequestSampler, sample
from ipc.messages import SamplingParams

CPU = torch.device("cpu")


def expected_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The definition, written plainly: softmax at the temperature, rank tokens by probability
    (ties by id), keep the top_k first (renormalized), then drop each token whose predecessors
    already hold top_p."""
    probs = (logits / p.temperature).softmax(-1).double()
    values = probs.tolist()
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    keep = order[: p.top_k] if p.top_k > 0 else order
    total = sum(probs[i].item() for i in keep)
    out = torch.zeros_like(probs)
    before = 0.0
    for i in keep:
        if before >= p.top_p:
            break
        out[i] = probs[i] / total
        before += out[i].item()
    return out / out.sum()


def drawn_distribution(logits: torch.Tensor, p: SamplingParams, draws: int) -> torch.Tensor:
    """Frequencies of ``draws`` draws, made as one batch of seeded rows (each row's own stream)."""
    samplers = [RequestSampler(dataclasses.replace(p, seed=s), CPU) for s in range(draws)]
    tokens = sample(logits.expand(draws, -1).contiguous(), samplers)
    return torch.bincount(tokens, minlength=logits.shape[0]).double() / draws


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=0.8, top_k=12, top_p=0.6),
    ],
    ids=["t1", "t0.6", "top_k", "top_p", "top_k+top_p"],
)
def test_draws_follow_the_filtered_distribution(params):
    logits = torch.linspace(3.0, -3.0, 40) + torch.sin(torch.arange(40.0))  # peaked, uneven
    want = expected_distribution(logits, params)
    got = drawn_distribution(logits, params, 6000)
    assert bool((got[want == 0] == 0).all()), "a token outside the top-k/top-p set was drawn"
    total_variation = 0.5 * (got - want).abs().sum().item()
    assert total_variation < 0.04, total_variation


def test_a_nucleus_wider_than_the_candidates_is_still_exact():
    """A flat distribution over more than CANDIDATES tokens: the first pass cannot hold top_p,
    so those rows are drawn over the whole sorted vocabulary."""
    vocab = CANDIDATES * 4
    logits = torch.zeros(vocab)
    logits[: vocab // 2] = 1.0  # half the vocabulary is e times as likely as the other half
    params = SamplingParams(temperature=1.0, top_p=0.5)
    want = expected_distribution(logits, params)
    assert int((want > 0).sum()) > CANDIDATES
    got = drawn_distribution(logits, params, 4000)
    assert bool((got[want == 0] == 0).all())
    # Each kept token is (nearly) equally likely: compare the kept set's share, not each token.
    assert got[want > 0].sum().item() == pytest.approx(1.0)
    assert int((got > 0).sum()) > CANDIDATES  # the draws really reach past the candidates


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    torch.manual_seed(0)
    steps = [torch.randn(3, 500) * 3 for _ in range(10)]  # per step: our row, then two others
    mine = SamplingParams(temperature=0.9, top_p=0.8, seed=42)
    alone_sampler = RequestSampler(mine, CPU)
    alone = [int(sample(logits[:1], [alone_sampler])[0]) for logits in steps]
    batch = [
        RequestSampler(SamplingParams(temperature=0.0), CPU),
        RequestSampler(mine, CPU),
        RequestSampler(SamplingParams(temperature=2.0, top_k=300, seed=1), CPU),
    ]
    mixed = [
        int(sample(torch.stack([logits[1], logits[0], logits[2]]), batch)[1]) for logits in steps
    ]
    assert mixed == alone
    assert len(set(alone)) > 1  # it really sampled


@pytest.mark.parametrize(
    "mine",
    [
        SamplingParams(temperature=1.0, top_k=50, seed=123),
        SamplingParams(temperature=1.0, top_p=0.8, seed=123),
    ],
    ids=["top_k", "top_p"],
)
def test_ties_do_not_make_a_seeded_row_depend_on_the_candidate_width(mine):
    """bf16 logits are full of ties; a wide top_k elsewhere in the batch widens the candidate
    pass, and topk() orders ties differently at another width. The draw must not care."""
    torch.manual_seed(1)
    steps = [(torch.randn(4000) * 3).bfloat16().float() for _ in range(150)]
    alone_sampler = RequestSampler(mine, CPU)
    alone = [int(sample(logits.unsqueeze(0), [alone_sampler])[0]) for logits in steps]
    batch = [
        RequestSampler(mine, CPU),
        RequestSampler(SamplingParams(temperature=1.0, top_k=1000, seed=7), CPU),
    ]
    mixed = [int(sample(torch.stack([logits, logits.flip(0)]), batch)[0]) for logits in steps]
    assert mixed == alone


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(3, 100)
    samplers = [
        RequestSampler(SamplingParams(temperature=0.0), CPU),
        RequestSampler(SamplingParams(temperature=1.0, seed=3), CPU),
        RequestSampler(SamplingParams(temperature=0.7, top_k=1), CPU),
    ]
    out = sample(logits, samplers).tolist()
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert 0 <= out[1] < 100
