"""Where an identical request can get other numbers (docs/determinism.md), measured on the model.

  ops     whether each op's result for a row is bitwise independent of the other rows of the
          call (M), of padding and of the thread count: the dense bf16 linear layers, the int4
          kernel, Q8_0 planes, rms_norm, the top-logit refinement, attention
  paths   per weight mode (--formats), the first-token logits of 32 chat prompts computed along
          each path (cold prefill alone and 32 in a step, after cached blocks, after a cached
          prompt tail (the last token alone, a prompt row), in chunks of 7,
          as a decode row alone and in a batch of 32): distance from float32's cold prefill (KL,
          |logprob| of float32's top token), rows bitwise equal to the mode's cold prefill, and
          rows bitwise equal on 1 and 2 threads
  forced  per weight mode, teacher-forced over float32's 16 greedy tokens after each prompt (a
          decode row each, batch 32): mean KL and mean |logprob| of the forced token against
          float32
  mc      multiple-choice loglikelihoods (--mc-jsonl, lm-eval's scoring) per weight mode:
          accuracy and distance from float32
  attention  decode attention alone, the bf16 matmuls decode rows had against the flash rows
  cost    the default launch's decode tokens/s at each --decode-batch, prefill tokens/s at each
          --prefill-tokens, a 37-token prompt after 32 cached tokens, 31 prompts after a cached
          --shared-prefix-tokens prefix; then the same with --deterministic

The model is driven step by step through ``engine.runner``, so the path of each step is chosen
here, not by the scheduler. fp32 and bf16 are dense in their dtype, the other modes bf16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_worker.engine import Engine
from engine_worker.request import EngineRequest
from engine_worker.sampler import RequestSampler
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams
from scripts.bench.chat_prompts import chat_prompt_ids

MODES = {
    "fp32": {"dtype": "float32", "weights": "fp32"},
    "bf16": {"dtype": "bfloat16", "weights": "bf16"},
    "auto": {"dtype": "bfloat16", "weights": "auto"},
    "int4": {"dtype": "bfloat16", "weights": "int4"},
    "int4-exact": {"dtype": "bfloat16", "weights": "int4-exact"},
    "int8": {"dtype": "bfloat16", "weights": "int8"},
}
FORCED_TOKENS = 16


def make(args, mode: str) -> Engine:
    knobs: dict[str, Any] = {**MODES[mode], "adaptive_threads": False, "max_batch_size": 64}
    return Engine(EngineConfig(model_path=str(args.model), kv_cache_tokens=16384, **knobs))


Plan = list[tuple[list[int], list[int], int]]  # per request: tokens, chunk sizes, prompt length


def run_plan(engine: Engine, plan: Plan) -> list[torch.Tensor]:
    """Step s computes chunk s of every request that has one; per request, the logits after
    each of its chunks [chunks, vocab] (float32). Tokens past the prompt length are decoded
    tokens to the engine (what it would have sampled, forced)."""
    requests = []
    for i, (ids, _, prompt_len) in enumerate(plan):
        params = SamplingParams(max_tokens=len(ids), temperature=0.0)
        r = EngineRequest(
            f"r{i}", list(ids[:prompt_len]), params, RequestSampler(params, engine.device),
            frozenset(), engine.max_model_len, 0.0,
        )  # fmt: skip
        r.block_ids = engine.blocks.allocate(engine.blocks.blocks_for(len(ids)))
        requests.append(r)
    out: list[list[torch.Tensor]] = [[] for _ in plan]
    for s in range(max(len(chunks) for _, chunks, _ in plan)):
        batch = [(i, chunks[s]) for i, (_, chunks, _) in enumerate(plan) if s < len(chunks)]
        stepping = [requests[i] for i, _ in batch]
        for (i, count), r in zip(batch, stepping):
            r.token_ids = plan[i][0][: r.num_computed + count]  # the step emits at its end
            r.num_generated = max(0, len(r.token_ids) - r.prompt_len)
        step = engine.runner.forward(stepping, [n for _, n in batch])
        logits, emitting = step.logits[: sum(step.widths)], step.emitting
        for row, index in zip(logits, emitting):
            out[batch[index][0]].append(row.float().clone())
        for (_, count), r in zip(batch, stepping):
            r.num_computed += count
    for r in requests:
        engine.blocks.release(r.block_ids)
    return [torch.stack(o) for o in out]


def first_token_paths(engine: Engine, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """[prompts, vocab] logits after each whole prompt, per path."""

    def one_by_one(chunks_of) -> torch.Tensor:
        return torch.cat([run_plan(engine, [(p, chunks_of(p), len(p))])[0][-1:] for p in prompts])

    def cached(p: list[int]) -> list[int]:
        whole = (len(p) - 1) // 16 * 16  # the full blocks a prefix-cache hit leaves computed
        return [whole, len(p) - whole]

    def sevens(p: list[int]) -> list[int]:
        return [7] * ((len(p) - 1) // 7) + [len(p) - (len(p) - 1) // 7 * 7]

    together = run_plan(engine, [(p, [len(p)], len(p)) for p in prompts])
    decoded = run_plan(engine, [(p, [len(p) - 1, 1], len(p) - 1) for p in prompts])
    return {
        "cold prefill": one_by_one(lambda p: [len(p)]),
        "cold, all in one step": torch.stack([o[-1] for o in together]),
        "after cached blocks": one_by_one(cached),
        "after a cached tail": one_by_one(lambda p: [len(p) - 1, 1]),
        "in chunks of 7": one_by_one(sevens),
        "decode row alone": torch.cat(
            [run_plan(engine, [(p, [len(p) - 1, 1], len(p) - 1)])[0][-1:] for p in prompts]
        ),
        "decode row, all in one step": torch.stack([o[-1] for o in decoded]),
    }


def distance(reference: torch.Tensor, got: torch.Tensor) -> tuple[float, float, int]:
    """Mean KL(reference || got), mean |logprob| difference of reference's top token, and how
    many rows agree on the top token."""
    ref, new = reference.log_softmax(-1), got.log_softmax(-1)
    kl = (ref.exp() * (ref - new)).sum(-1).mean().item()
    top = ref.argmax(-1, keepdim=True)
    gap = (ref.gather(1, top) - new.gather(1, top)).abs().mean().item()
    return kl, gap, int((new.argmax(-1, keepdim=True) == top).sum())


def run_paths(args) -> None:
    _, prompts = chat_prompt_ids(args.model)
    torch.set_num_threads(args.threads)
    reference = first_token_paths(make(args, "fp32"), prompts)["cold prefill"]
    for mode in args.formats:
        engine = make(args, mode)
        torch.set_num_threads(1)
        one_thread = first_token_paths(engine, prompts)
        torch.set_num_threads(args.threads)
        paths = first_token_paths(engine, prompts)
        print(f"\n{mode}: distance from float32's cold prefill over {len(prompts)} prompts")
        print(f"{'path':24s}{'KL':>10s}{'|dlogp|':>9s}{'top-1':>7s}{'=cold':>7s}{'=1 thread':>11s}")
        for path, logits in paths.items():
            kl, gap, agree = distance(reference, logits)
            cold = sum(torch.equal(a, b) for a, b in zip(logits, paths["cold prefill"]))
            threads = sum(torch.equal(a, b) for a, b in zip(logits, one_thread[path]))
            print(f"{path:24s}{kl:10.2e}{gap:9.4f}{agree:7d}{cold:7d}{threads:11d}")


def forced_logits(engine: Engine, prompts, continuations) -> torch.Tensor:
    """[prompts * tokens, vocab]: after each prompt and each forced token but the last, every
    one a decode row of a batch of all prompts."""
    plan = [
        (p + c[:-1], [len(p)] + [1] * (len(c) - 1), len(p)) for p, c in zip(prompts, continuations)
    ]
    return torch.cat(run_plan(engine, plan))


def run_forced(args) -> None:
    _, prompts = chat_prompt_ids(args.model)
    torch.set_num_threads(args.threads)
    reference_engine = make(args, "fp32")
    greedy = run_plan(reference_engine, [(p, [len(p)], len(p)) for p in prompts])
    continuations = [[int(g[-1].argmax())] for g in greedy]
    for _ in range(FORCED_TOKENS - 1):
        plan = [(p + c, [len(p) + len(c)], len(p)) for p, c in zip(prompts, continuations)]
        for c, logits in zip(continuations, run_plan(reference_engine, plan)):
            c.append(int(logits[-1].argmax()))
    reference = forced_logits(reference_engine, prompts, continuations).log_softmax(-1)
    tokens = torch.tensor([t for c in continuations for t in c])[:, None]
    print(f"\nteacher-forced over {len(prompts)} prompts x {FORCED_TOKENS} float32 greedy tokens")
    print(f"{'mode':12s}{'mean KL':>10s}{'mean |dlogp|':>14s}{'max |dlogp|':>13s}")
    for mode in args.formats:
        got = forced_logits(make(args, mode), prompts, continuations).log_softmax(-1)
        kl = (reference.exp() * (reference - got)).sum(-1).mean().item()
        gap = (reference.gather(1, tokens) - got.gather(1, tokens)).abs()
        print(f"{mode:12s}{kl:10.2e}{gap.mean().item():14.4f}{gap.max().item():13.4f}")


# --- ops: is a row's result independent of the rest of the call? -------------------------------
OP_ROWS = (1, 2, 3, 4, 5, 8, 16, 17, 32, 100, 300)


def row_checks(apply, x: torch.Tensor) -> tuple[bool, bool, bool]:
    """(a row alone = the same row among others, rows the same bits for every M >= 2, 1 thread =
    2 threads) for a row-wise op ``apply`` on the rows of ``x``."""
    results = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        full = apply(x)
        results[threads] = full
        alone = torch.cat([apply(x[i : i + 1]) for i in range(0, len(x), 7)])
        single = torch.equal(alone, full[::7])
        batched = all(torch.equal(apply(x[:m]), full[:m]) for m in OP_ROWS if m > 1)
    return single, batched, torch.equal(results[1], results[2])


def attention_checks(attend, dtype: torch.dtype, rows_per_head: int, pad: bool):
    """The same checks for query positions attended alone (in a call of ``rows_per_head`` rows a
    kv head, over the keys up to their own position) and among the 40 positions before them (a
    prefill chunk, over the keys up to its last), at contexts of 100, 601 and 1,100 keys, key
    columns padded to a multiple of 16 or not, on 1 and 2 threads."""
    gen = torch.Generator().manual_seed(0)
    kv, group, dim = 3, 3, 64
    keys, values = (torch.randn(1, kv, 1120, dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(40, kv * group, dim, generator=gen).to(dtype)
    results: dict[int, list] = {1: [], 2: []}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for context in (100, 601, 1100):
            at = list(range(context - 40, context))
            columns = -(-context // 16) * 16 if pad else context
            chunk = attend(q, at, keys[..., :columns, :], values[..., :columns, :], 4)
            for j in (0, 17, 38):
                own = -(-(at[j] + 1) // 16) * 16 if pad else at[j] + 1
                alone = attend(q[j : j + 1], [at[j]], keys[..., :own, :], values[..., :own, :],
                               rows_per_head)  # fmt: skip
                results[threads].append((alone, chunk[j : j + 1]))
    single = all(torch.equal(a, c) for a, c in results[1] + results[2])
    threads_same = all(torch.equal(a[0], b[0]) for a, b in zip(results[1], results[2]))
    return single, None, threads_same


def flash_attend(q, positions, keys, values, rows_per_head):
    """Queries q [n, H, D] at ``positions`` through the flash kernel, grouped by kv head, with
    their rows padded to ``rows_per_head`` (copies of the last)."""
    from engine_worker.attention.flash_rows import flash

    count, heads, dim = q.shape
    kv = keys.shape[1]
    group = heads // kv
    rows = q.view(count, kv, group, dim).transpose(0, 1).reshape(kv, count * group, dim)
    at = torch.tensor(positions).repeat_interleave(group)
    short = rows_per_head - rows.shape[1]
    if short > 0:
        rows = torch.cat([rows, rows[:, -1:].expand(kv, short, dim)], dim=1)
        at = torch.cat([at, at[-1:].expand(short)])
    columns = keys.shape[2]
    mask = torch.zeros(len(at), columns, dtype=keys.dtype)
    mask.masked_fill_(torch.arange(columns)[None, :] > at[:, None], float("-inf"))
    o = flash(rows[None], keys, values, mask)[0][:, : count * group]
    return o.view(kv, count, group, dim).transpose(0, 1).reshape(count, heads, dim)


def run_ops(args) -> None:
    from engine_worker.linear import refine_top_logits

    engine = make(args, "auto")
    model = engine.runner.model
    layer: Any = model.layers[0]  # auto weights: BatchSizeSwitch layers, a dense and an int4 copy
    head: Any = model.lm_head
    gen = torch.Generator().manual_seed(0)
    x576 = torch.randn(300, 576, generator=gen).bfloat16()
    x1536 = torch.randn(300, 1536, generator=gen).bfloat16()
    hidden = torch.randn(300, 576, generator=gen).bfloat16()
    ops = {
        "dense bf16, 960 x 576 (qkv)": (layer.qkv.dense.apply, x576),
        "dense bf16, 576 x 1536 (down)": (layer.down.dense.apply, x1536),
        "dense bf16, lm_head": (head.dense.apply, x576[:40]),
        "int4 kernel (qkv, Q4_1)": (layer.qkv.quantized.apply, x576),
        "int4 kernel (down, Q4_1)": (layer.down.quantized.apply, x1536),
        "Q8_0 planes (lm_head)": (head.quantized.apply, x576[:40]),
        "rms_norm bf16": (model.norm, x576),
    }

    def refined(h: torch.Tensor) -> torch.Tensor:
        logits = head.dense.apply(h).float()
        refine_top_logits(logits, h, model.exact_head)
        return logits

    ops["refine_top_logits"] = (refined, hidden[:40])
    print("\nop (row results bitwise)          alone=in batch  any M>=2 same  1=2 threads")
    for name, (apply, x) in ops.items():
        print(f"{name:36s}" + "".join(f"{str(c):>14s}" for c in row_checks(apply, x)))
    for name, dtype, rows, pad in (
        ("flash, bf16, >=4 rows, padded keys", torch.bfloat16, 4, True),
        ("flash, bf16, 3 rows, padded keys", torch.bfloat16, 3, True),
        ("flash, bf16, >=4 rows, unpadded keys", torch.bfloat16, 4, False),
        ("flash, float32, >=4 rows, padded", torch.float32, 4, True),
    ):
        checks = attention_checks(flash_attend, dtype, rows, pad)
        print(f"{name:36s}" + "".join(f"{'-' if c is None else str(c):>14s}" for c in checks))


# --- mc: multiple-choice loglikelihoods, as lm-eval scores them ---------------------------------
def run_mc(args) -> None:
    """Each --mc-jsonl item's choices scored by the summed logprob of their tokens after the
    question (prompt logprobs, one request per choice, all in one batch), per weight mode:
    accuracy, and the mean |loglikelihood| difference from float32 (tests/evals/facts_mc.yaml's
    prompt format)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    items = [json.loads(line) for line in Path(args.mc_jsonl).open()]
    header = "The following are multiple choice questions about general knowledge.\n\n"
    requests = []  # (item, choice, token ids, continuation length)
    for n, item in enumerate(items):
        context = tokenizer.encode(f"{header}Question: {item['question']}\nAnswer:")
        for c, choice in enumerate(item["choices"]):
            continuation = tokenizer.encode(f" {choice}")
            requests.append((n, c, context + continuation, len(continuation)))
    scores = {}
    for mode in ["fp32", *[m for m in args.formats if m != "fp32"]]:
        engine = make(args, mode)
        for i, (_, _, ids, _) in enumerate(requests):
            engine.add(f"mc{i}", ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
        results = collect_prompt_logprobs(engine)
        scores[mode] = [
            float(results[f"mc{i}"][-count:].sum()) for i, (_, _, _, count) in enumerate(requests)
        ]
    print(f"\nmultiple choice, {len(items)} items of {args.mc_jsonl}")
    for mode, got in scores.items():
        best: dict[int, tuple[float, int]] = {}
        for (n, c, _, _), score in zip(requests, got):
            best[n] = max(best.get(n, (float("-inf"), -1)), (score, c))
        accuracy = np.mean([best[n][1] == item["answer"] for n, item in enumerate(items)])
        gap = np.abs(np.array(got) - np.array(scores["fp32"]))
        print(
            f"{mode:12s} acc {accuracy:.3f}  |loglikelihood - fp32| mean {gap.mean():.4f} "
            f"max {gap.max():.4f}"
        )


def collect_prompt_logprobs(engine: Engine) -> dict[str, np.ndarray]:
    """Steps until idle; every request's prompt logprobs (positions 1..), in order."""
    out: dict[str, list[np.ndarray]] = {}
    while engine.has_work():
        for chunk in engine.step().prompt_logprobs:
            out.setdefault(chunk.request_id, []).append(np.frombuffer(chunk.logprobs, np.float32))
    return {name: np.concatenate(parts) for name, parts in out.items()}
