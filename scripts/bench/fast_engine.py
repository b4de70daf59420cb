"""The fast-engine scenario: the default model's real tokenizer and the real engine code on a small
random-weight Llama model whose steps cost milliseconds here, so that tokenizing a prompt is about
as large a share of its time to first token as it is in front of a GPU engine.

``calibrate`` measures that share for the workload at hand: the time to prepare one prompt as a
tokenizer worker does (chat template, encoding, validation) against the time the engine alone
takes to prefill it to its first token, both per prompt, one prompt at a time. The README sets the
ratio beside the one published figures give for a 7-8B model on one H100.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass

from ipc.codec import unpack_id_list
from ipc.messages import RequestError, SamplingParams
from scripts.bench.workloads import BenchRequest, salt_requests

# Two decoder layers, hidden size 64 (4 heads, 2 KV heads), the default model's 49,152-token
# vocabulary: a 256-token prefill takes ~5 ms and a 2,048-token one ~40 ms of one core here.
FAST_ENGINE_LAYERS = 2
FAST_ENGINE_HIDDEN_SIZE = 64
FAST_ENGINE_CONTEXT_TOKENS = 8192  # room for 2,048-token prompts, the template and run tags


def fast_engine_model(
    stack: contextlib.ExitStack,
    num_layers: int = FAST_ENGINE_LAYERS,
    hidden_size: int = FAST_ENGINE_HIDDEN_SIZE,
) -> str:
    """Writes the model to a temporary directory that ``stack`` removes; returns its path."""
    from scripts.bench.tiny_model import make_tiny_model

    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="splitserve-fast-engine-"))
    return str(
        make_tiny_model(
            directory,
            num_layers=num_layers,
            hidden_size=hidden_size,
            max_position_embeddings=FAST_ENGINE_CONTEXT_TOKENS,
        )
    )


@dataclass(frozen=True, slots=True)
class Calibration:
    """Medians per prompt, in milliseconds; CPU is the process's CPU time over the same span."""

    prompts: int
    prompt_tokens: float
    tokenize_cpu_ms: float
    tokenize_wall_ms: float
    prefill_cpu_ms: float
    prefill_wall_ms: float

    @property
    def ratio_cpu(self) -> float:
        """Tokenize time / prefill time per prompt, from CPU times (steadier on a shared
        machine than wall times)."""
        return self.tokenize_cpu_ms / self.prefill_cpu_ms

    @property
    def ratio_wall(self) -> float:
        return self.tokenize_wall_ms / self.prefill_wall_ms

    @property
    def tokenizer_tokens_per_cpu_s(self) -> float:
        return self.prompt_tokens / self.tokenize_cpu_ms * 1e3

    def describe(self) -> str:
        return (
            f"{self.prompts} prompts of {self.prompt_tokens:.0f} tokens (medians): tokenize "
            f"{self.tokenize_cpu_ms:.2f} ms CPU ({self.tokenize_wall_ms:.2f} ms wall), "
            f"engine prefill to first token {self.prefill_cpu_ms:.2f} ms CPU "
            f"({self.prefill_wall_ms:.2f} ms wall); tokenize/prefill "
            f"{self.ratio_cpu:.3f} (CPU), {self.ratio_wall:.3f} (wall); one tokenizer core "
            f"encodes {self.tokenizer_tokens_per_cpu_s / 1e3:.0f}k tokens/s"
        )


def calibrate(
    engine_config, requests: list[BenchRequest], samples: int = 8, warmup: int = 2
) -> Calibration:
    """Prepares and prefills ``warmup + samples`` of the workload's prompts one at a time, on an
    engine of its own built from ``engine_config`` (freed afterwards)."""
    from engine_worker.engine import Engine
    from scripts.bench.inproc import make_preparer, prepare_request

    engine = Engine(engine_config)
    preparer = make_preparer(engine_config.model_path, engine)
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    chosen = salt_requests(requests[: warmup + samples], "calibration")
    tokenize, prefill, lengths = [], [], []
    for i, request in enumerate(chosen):
        cpu, wall = time.process_time(), time.perf_counter()
        prepared = prepare_request(
            preparer, f"calibrate-{i}", sampling, time.monotonic(), request.prompt, request.messages
        )
        tokenized = (time.process_time() - cpu, time.perf_counter() - wall)
        if isinstance(prepared, RequestError):
            raise ValueError(f"a calibration prompt was refused: {prepared.message}")
        ids = unpack_id_list(prepared.token_ids)
        cpu, wall = time.process_time(), time.perf_counter()
        engine.add(prepared.request_id, ids, sampling)
        while engine.has_work():
            engine.step()
        prefilled = (time.process_time() - cpu, time.perf_counter() - wall)
        if i >= warmup:
            tokenize.append(tokenized)
            prefill.append(prefilled)
            lengths.append(len(ids))
    del engine

    def median_ms(pairs: list[tuple[float, float]], index: int) -> float:
        return statistics.median(p[index] for p in pairs) * 1e3

    return Calibration(
        prompts=len(lengths),
        prompt_tokens=statistics.median(lengths),
        tokenize_cpu_ms=median_ms(tokenize, 0),
        tokenize_wall_ms=median_ms(tokenize, 1),
        prefill_cpu_ms=median_ms(prefill, 0),
        prefill_wall_ms=median_ms(prefill, 1),
    )
