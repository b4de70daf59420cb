"""Reads a GGUF checkpoint's tensors at their own precision, under Hugging Face names.

The ``gguf`` package's reader gives each tensor's raw block bytes (a memory map); we parse the
blocks ourselves instead of dequantizing to float32 (gguf_blocks.py: Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 and the K-quants Q2_K to Q6_K become ``Int4Groups`` or ``Int8Blocks`` holding the file's
own weights); F32, F16 and BF16 stay dense tensors in their own dtype. Any other type is refused
with an error that names the tensor, its type and the served types.

llama.cpp's converter reorders the rows of q and k for the ``llama`` architecture (its rope pairs
adjacent dimensions, ours the two halves); rows are undone here, which moves whole blocks only.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from engine_worker.gguf_blocks import BLOCK_TYPES, INEXACT_ZEROS, parse_blocks
from engine_worker.linear import Int4Groups, Int8Blocks, WeightSource

logger = logging.getLogger("splitserve.engine.gguf")

SERVED_TYPES = ("F32", "F16", "BF16", *BLOCK_TYPES)
# Architectures whose converter permutes q/k rows for an interleaved rope.
PERMUTED_QK_ARCHITECTURES = ("llama",)

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class UnsupportedGGUFType(ValueError):
    pass


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None: unknown)."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        mapped = _LAYER_NAMES.get(part)
        return f"model.layers.{index}.{mapped}.{kind}" if mapped else None
    mapped = _TOP_LEVEL_NAMES.get(stem)
    return f"{mapped}.{kind}" if mapped else None


def read_gguf(path: str | Path, num_heads: int, num_kv_heads: int) -> dict[str, WeightSource]:
    """Every tensor of the file, keyed by its Hugging Face name (unknown names are skipped with a
    warning). Raises ``UnsupportedGGUFType`` naming the first tensor of a type we cannot serve."""
    reader = _reader_class()(str(path))
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field else ""
    unsupported = [t for t in reader.tensors if t.tensor_type.name not in SERVED_TYPES]
    if unsupported:
        t = unsupported[0]
        raise UnsupportedGGUFType(
            f"{path}: tensor {t.name!r} has GGUF type {t.tensor_type.name}, which splitserve "
            f"cannot serve ({len(unsupported)} such tensors; supported types: "
            f"{', '.join(SERVED_TYPES)}). Requantize the file to one of those types."
        )
    tensors: dict[str, WeightSource] = {}
    skipped = []
    INEXACT_ZEROS[:] = [0, 0]
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            skipped.append(t.name)
            continue
        source = _parse(t.tensor_type.name, np.asarray(t.data), [int(d) for d in t.shape])
        if architecture in PERMUTED_QK_ARCHITECTURES:
            if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
                source = _unpermute_rows(source, num_heads)
            elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
                source = _unpermute_rows(source, num_kv_heads)
        tensors[name] = source
    inexact, folded = INEXACT_ZEROS
    if folded:
        logger.log(
            logging.WARNING if inexact else logging.INFO,
            "%d of %d group zeros (Q4_1 m + 8 d, Q4_K/Q2_K 8 d sc - dmin m) need a float32 "
            "rounding: those groups' weights differ from the file's by it",
            inexact,
            folded,
        )
    if skipped:
        logger.warning(
            "ignored %d GGUF tensors with no known role, e.g. %s", len(skipped), skipped[:3]
        )
    return tensors


def _reader_class():
    from gguf import GGUFReader

    class PlainBufferReader(GGUFReader):
        """The gguf reader over a plain ndarray view of its memory map: parsing the metadata
        takes ~10^6 small slices of the buffer, and on an ``np.memmap`` each one runs a Python
        ``__array_finalize__`` (3x slower for this model's 49k-token vocabulary)."""

        _buffer: np.ndarray

        @property
        def data(self) -> np.ndarray:
            return self._buffer

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._buffer = value.view(np.ndarray)

    return PlainBufferReader


def _parse(type_name: str, data: np.ndarray, shape: list[int]) -> WeightSource:
    """One tensor from its raw data. GGUF lists dimensions innermost first, so a matrix of
    N rows of K weights has shape [K, N]. Parsed with numpy: one thread, and no OpenMP start-up
    per small op (torch's, on a busy 2-core machine, was 50x slower)."""
    dims = list(reversed(shape))
    if type_name in ("F32", "F16"):
        return torch.from_numpy(np.array(data)).reshape(dims)
    raw = np.asarray(data, dtype=np.uint8)
    if type_name == "BF16":
        return torch.from_numpy(raw.copy()).view(torch.bfloat16).reshape(dims)
    rows, cols = (dims[0], dims[1]) if len(dims) == 2 else (1, dims[0])
    return parse_blocks(type_name, raw, rows, cols)


def _unpermute_rows(source: WeightSource, heads: int) -> WeightSource:
    def rows(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0]
        return t.reshape(heads, n // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    if isinstance(source, Int4Groups):
        return Int4Groups(rows(source.q), rows(source.scale), rows(source.zero))
    if isinstance(source, Int8Blocks):
        zero = None if source.zero is None else rows(source.zero)
        return Int8Blocks(rows(source.q), rows(source.scale), zero)
    return rows(source)
