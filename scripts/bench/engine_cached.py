"""The 'cached' workload of the engine benchmark (scripts/bench/engine.py): the step that
computes a fully cached prompt's first token, in the default launch (--dtype/--weights auto).

Each trial asks a fresh random prompt (16 tokens decoded, then 50 ms idle, as between a chat's
requests), then the same prompt again, and times the step that answers the second: with the
prompt's tail from the prefix cache (engine_worker/prefix_tails.py: its last token computed
alone) and without it (its last block computed again: whole blocks only), one engine, the two
alternating. A 158-token prompt (hops' and peer's length) and a 160-token one (whole blocks).
The batch-1 decode step of the same runs is printed beside them.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from engine_worker.engine import Engine
from scripts.bench.engine_runs import default_launch_knobs, make_engine, params, random_prompt

PROMPT_LENGTHS = (158, 160)
DECODED_TOKENS = 16


def run_cached(args) -> None:
    engine = make_engine(args, **default_launch_knobs(args))
    copy_slots = engine.scheduler.copy_slots
    rng = np.random.default_rng(4)
    steps: dict[tuple[int, str], list[float]] = {}
    decode: list[float] = []
    for trial in range(1 + 4 * args.repeats):  # the first warms up
        for length in PROMPT_LENGTHS:
            for mode in ("tail", "blocks") if trial % 2 else ("blocks", "tail"):
                engine.scheduler.copy_slots = copy_slots if mode == "tail" else None
                prompt = random_prompt(rng, length)
                decode += _ask(engine, prompt, f"cold{trial}-{length}-{mode}", DECODED_TOKENS)[1:]
                time.sleep(0.05)
                (first, *_) = _ask(engine, prompt, f"warm{trial}-{length}-{mode}", 1)
                if trial:
                    steps.setdefault((length, mode), []).append(first)
    engine.scheduler.copy_slots = copy_slots
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\ncached (threads={args.threads}, load {load}): a prompt asked again, first step ms")
    print(f"  batch-1 decode step: median {statistics.median(decode):.2f}")
    for length in PROMPT_LENGTHS:
        blocks, tail = (statistics.median(steps[length, m]) for m in ("blocks", "tail"))
        print(
            f"  {length} tokens: last block again {blocks:.2f}, last token alone (tail) "
            f"{tail:.2f} = {tail / blocks:.2f}x"
        )


def _ask(engine: Engine, prompt: list[int], name: str, tokens: int) -> list[float]:
    """Runs one request to its end (no grammar: every step is work); each step's time (ms)."""
    engine.add(name, prompt, params(tokens))
    times = []
    while engine.requests:
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times
