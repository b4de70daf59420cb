"""The fast-engine scenario (docs/benchmarks.md): the default model's real tokenizer and the real
engine code on a small random-weight model whose steps cost milliseconds, so that tokenizing is as
large a share of TTFT as in front of a GPU engine; ``calibrate`` measures that share.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time

from ipc.codec import unpack_id_list
from ipc.messages import RequestError, SamplingParams
from scripts.bench.workloads import BenchRequest, salt_requests

# Two decoder layers, hidden size 64 (4 heads, 2 KV heads), the default model's 49,152-token
# vocabulary: a 256-token prefill takes ~5 ms and a 2,048-token one ~40 ms of one core here.
FAST_ENGINE_LAYERS = 2
FAST_ENGINE_HIDDEN_SIZE = 64
FAST_ENGINE_CONTEXT_TOKENS = 8192  # room for 2,048-token prompts, the template and run tags


def fast_engine_model(stack: contextlib.ExitStack) -> str:
    """Writes the model to a temporary directory that ``stack`` removes; returns its path."""
    from tests.tiny_model import make_tiny_model

    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="splitserve-fast-engine-"))
    return str(
        make_tiny_model(
            directory,
            num_layers=FAST_ENGINE_LAYERS,
            hidden_size=FAST_ENGINE_HIDDEN_SIZE,
            max_position_embeddings=FAST_ENGINE_CONTEXT_TOKENS,
        )
    )


def calibrate(
    engine_config, requests: list[BenchRequest], samples: int = 8, warmup: int = 2
) -> str:
    """Prepares and prefills ``warmup + samples`` of the workload's prompts one at a time, on an
    engine of its own built from ``engine_config`` (freed afterwards); says what each took per
    prompt (medians; CPU time, steadier on a shared machine than wall time, and wall time)."""
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
            preparer, f"calibrate-{i}", sampling, time.monotonic(), request.prompt, None
        )
        tokenized = (time.process_time() - cpu, time.perf_counter() - wall)
        if isinstance(prepared, RequestError):
            raise ValueError(f"a calibration prompt was refused: {prepared.message}")
        ids = unpack_id_list(prepared.token_ids)
        cpu, wall = time.process_time(), time.perf_counter()
        engine.add(prepared.request_id, ids, sampling)
        while engine.has_work():
            engine.step()
        if i >= warmup:
            tokenize.append(tokenized)
            prefill.append((time.process_time() - cpu, time.perf_counter() - wall))
            lengths.append(len(ids))
    del engine
    (tok_cpu, tok_wall), (pre_cpu, pre_wall) = (
        [statistics.median(p[k] for p in pairs) * 1e3 for k in (0, 1)]
        for pairs in (tokenize, prefill)
    )
    tokens = statistics.median(lengths)
    return (
        f"{len(lengths)} prompts of {tokens:.0f} tokens (medians): tokenize {tok_cpu:.2f} ms CPU "
        f"({tok_wall:.2f} ms wall), engine prefill to first token {pre_cpu:.2f} ms CPU "
        f"({pre_wall:.2f} ms wall); tokenize/prefill {tok_cpu / pre_cpu:.3f} (CPU), "
        f"{tok_wall / pre_wall:.3f} (wall); one tokenizer core encodes "
        f"{tokens / tok_cpu:.0f}k tokens/s"
    )
