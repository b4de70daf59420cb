"""What data-parallel routing costs: hashing a 2k-token prompt into external block ids (cold,
and warm through BlockHasher's memo) plus the prefix-index lookup, as a tokenizer worker pays
per request; and what recording KV events costs the engine's step (decode at batch 32, a
2k-token prefill), events on against off, alternating in one run.

The data-parallel workload prints them (``python -m scripts.bench data-parallel routing-cost``,
``... event-cost``): medians, never asserted (the machine is shared, figures are noisy).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from ipc.block_hash import BlockHasher, block_hashes
from ipc.codec import pack_ids
from ipc.kv_events import BlockStored
from ipc.replica_router import PrefixIndex

PROMPT_TOKENS, BLOCK = 2048, 16


def _median_us(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def routing_cost(repeats: int = 200) -> dict[str, float]:
    """Microseconds per request for a 2k-token prompt (block size 16)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(49152) for _ in range(PROMPT_TOKENS)] for _ in range(20)]
    packed = pack_ids(prompts[0])
    cold = iter(prompts * (repeats // len(prompts) + 1))
    hasher = BlockHasher(BLOCK)
    index = PrefixIndex()
    for i, prompt in enumerate(prompts):  # two replicas holding ten chats each
        ids = block_hashes(prompt, BLOCK)
        index.apply(i % 2, [BlockStored(ids, None, prompt[: len(ids) * BLOCK], BLOCK)])
    hashes = hasher.hashes(packed)
    return {
        "hash_cold_us": _median_us(lambda: block_hashes(next(cold), BLOCK), repeats // 10),
        "hash_warm_us": _median_us(lambda: hasher.hashes(packed), repeats),
        "lookup_us": _median_us(lambda: index.longest_prefix(hashes), repeats),
        "hash_warm_and_lookup_us": _median_us(
            lambda: index.longest_prefix(hasher.hashes(packed)), repeats
        ),
    }


class _Timer:
    """Wraps the functions that recording adds to a step (hashing a stored block, building
    the events), so their time is measured inside real steps rather than guessed from a step
    time that the shared machine's noise swamps."""

    def __init__(self) -> None:
        import engine_worker.prefix_cache as prefix_cache
        from engine_worker.cache_events import CacheEventRecorder

        self.seconds = 0.0
        prefix_cache.next_block_digest = self._timed(prefix_cache.next_block_digest)
        for name in ("stored", "removed"):
            setattr(CacheEventRecorder, name, self._timed(getattr(CacheEventRecorder, name)))

    def _timed(self, fn: Callable) -> Callable:
        def timed(*args: object) -> object:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def take_us(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds * 1e6


def engine_step_cost(model_dir: str, rounds: int = 5) -> dict[str, float]:
    """Median step milliseconds with KV events recorded and without, alternating rounds, and
    the microseconds recording took inside the recorded steps."""
    from engine_worker.engine import Engine
    from ipc.engine_config import EngineConfig
    from ipc.messages import SamplingParams

    timer = _Timer()

    config = EngineConfig(
        model_path=model_dir,
        kv_cache_tokens=32 * 256 + 4 * PROMPT_TOKENS,
        max_model_len=PROMPT_TOKENS + 64,
        prefill_max_tokens=PROMPT_TOKENS,
        prefill_chunk_tokens=PROMPT_TOKENS,
        adaptive_threads=False,
    )
    engines = {on: Engine(config, cache_events=on) for on in (True, False)}
    rng = random.Random(1)
    steps: dict[str, list[float]] = {}  # seconds
    recording: dict[str, list[float]] = {}  # microseconds per step
    for _ in range(rounds):
        for on, engine in engines.items():
            label = "on" if on else "off"
            decode = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
            for i in range(32):
                engine.add(f"d{i}", [rng.randrange(49152) for _ in range(64)], decode)
            engine.step()  # the batch's prefill
            timer.take_us()
            for _ in range(63):
                start = time.perf_counter()
                engine.step()
                steps.setdefault(f"decode32_{label}_ms", []).append(time.perf_counter() - start)
            if on:
                recording.setdefault("decode32_recording_us", []).append(timer.take_us() / 63)
            prompt = [rng.randrange(49152) for _ in range(PROMPT_TOKENS)]
            engine.add("p", prompt, SamplingParams(max_tokens=1, temperature=0))
            start = time.perf_counter()
            engine.step()
            steps.setdefault(f"prefill2k_{label}_ms", []).append(time.perf_counter() - start)
            if on:
                recording.setdefault("prefill2k_recording_us", []).append(timer.take_us())
            while engine.has_work():
                engine.step()
            engine.take_cache_events()
    medians = {name: statistics.median(times) * 1e3 for name, times in steps.items()}
    return medians | {name: statistics.median(us) for name, us in recording.items()}
