"""Engine-alone peer figures: llama.cpp (through llama-cpp-python) on the GGUF our default model
comes from, at our thread count, on the same prompts; the machine's read bandwidth; and the
bandwidth bound of batch-1 decode (every weight is read once per token)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from scripts.bench.peer_servers import default_gguf  # noqa: F401 - the peer's GGUF, re-exported


# --- memory bandwidth ---------------------------------------------------------------------------
def read_bandwidth_gbs(threads: int, size_mib: int = 512, repeats: int = 7) -> float:
    """Best-of-``repeats`` read bandwidth (GB/s, 1e9 bytes) of a sum over a buffer far larger
    than any cache, with ``threads`` torch threads: what streaming weights through a matmul can
    at best reach on this machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(size_mib * (1 << 20) // 4, dtype=torch.float32)
        buf.sum()  # faults the pages in and wakes the thread pool
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
        return buf.numel() * buf.element_size() / best / 1e9
    finally:
        torch.set_num_threads(previous)


def weight_bytes_per_token(model) -> int:
    """Bytes a batch-1 decode step must read: each linear layer's decode copy (the quantized one
    where a layer keeps a dense copy for large steps too), the norms and the lm_head (a tied
    dense head is the embedding table); the embedding alone is only indexed, one row a token."""

    def nbytes(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    total = nbytes(model.norm) + model.lm_head.nbytes
    for layer in model.layers:
        total += sum(
            linear.nbytes for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        )
        total += sum(
            nbytes(t)
            for t in (layer.input_norm, layer.post_attention_norm, layer.q_norm, layer.k_norm)
        )
    return total


def bound_line(name: str, weight_bytes: int, bandwidth_gbs: float, rate: float | None) -> str:
    bound = bandwidth_gbs * 1e9 / weight_bytes
    share = "" if rate is None else f"; measured {rate:.1f} tok/s = {100 * rate / bound:.0f}% of it"
    return (
        f"  {name}: {weight_bytes / 1e6:.1f} MB of weights per token / {bandwidth_gbs:.1f} "
        f"GB/s = {bound:.0f} tok/s bound{share}"
    )


# --- llama.cpp through llama-cpp-python ---------------------------------------------------------
NEEDS_PEER_EXTRA = (
    "the llama.cpp peer needs llama-cpp-python: pip install 'splitserve[peer]' "
    "(it builds llama.cpp from source, ~5 minutes)"
)


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCppPeer:
    """llama.cpp's own forward on the GGUF, ``threads`` threads for decode and prompt batches;
    greedy (argmax of the last logits), as our engine's figures are."""

    def __init__(self, gguf: str | Path, threads: int, n_ctx: int) -> None:
        try:
            import llama_cpp  # the optional `peer` extra
        except ImportError:
            raise RuntimeError(NEEDS_PEER_EXTRA) from None

        self.version = llama_cpp.__version__
        self.llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            n_batch=512,
            verbose=False,
        )

    def prefill_rate(self, prompt: list[int], repeats: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            self.llm.reset()
            start = time.perf_counter()
            self.llm.eval(prompt)
            best = min(best, time.perf_counter() - start)
        return len(prompt) / best

    def decode_rate(self, prompt: list[int], new_tokens: int) -> float:
        """Tokens/s of ``new_tokens`` single-token steps after the prompt's prefill."""
        self.llm.reset()
        self.llm.eval(prompt)
        token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
        start = time.perf_counter()
        for _ in range(new_tokens):
            self.llm.eval([token])
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
        return new_tokens / (time.perf_counter() - start)

    def close(self) -> None:
        self.llm.close()


def llama_bench(
    binary: str, gguf: str | Path, threads: int, prompt_tokens: list[int], new_tokens: int
) -> list[tuple[str, float]]:
    """llama.cpp's own benchmark tool: (test name, tokens/s) for pp<N> and tg<M>."""
    cmd = [
        binary,
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-p",
        ",".join(map(str, prompt_tokens)),
        "-n",
        str(new_tokens),
        "-o",
        "json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    rows = []
    for test in json.loads(out):
        name = f"pp{test['n_prompt']}" if test["n_prompt"] else f"tg{test['n_gen']}"
        rows.append((name, float(test["avg_ts"])))
    return rows


def gguf_weight_bytes_per_token(gguf: str | Path) -> int:
    """The same count for llama.cpp on a GGUF: every tensor at its stored size, the token
    embedding only when it is also the output matrix (no separate output.weight)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())
