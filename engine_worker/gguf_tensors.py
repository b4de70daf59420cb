"""Reads a GGUF checkpoint's tensors at their own precision, under Hugging Face names.

The ``gguf`` package's reader gives each tensor's raw block bytes (a memory map); we parse the
blocks ourselves instead of dequantizing to float32 (gguf_blocks.py: Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 and the K-quants Q2_K to Q6_K become ``Int4Groups`` or ``Int8Blocks`` holding the file's
own weights); F32, F16 and BF16 stay dense tensors in their own dtype. Any other type is refused
with an error that names the tensor, its type and the served types.

Names: each architecture's GGUF names are the ``gguf`` package's own map (``TensorNameMap``)
of the Hugging Face names our layers read, inverted; a block with ``ffn_up`` but no ``ffn_gate``
holds Phi-3's fused gate and up rows (``mlp.gate_up_proj``). A mixture's stacked experts
(``ffn_gate_exps`` ..., [E, N, K]) are read as their E N rows, under engine_worker.moe's names.

What llama.cpp's converter changed is undone here, so the tensors are the checkpoint's own:
it reorders the rows of q and k for the architectures that derive from its Llama converter
(its rope pairs adjacent dimensions, ours the two halves), which moves whole blocks only, and
stores Gemma's norm weights as ``w + 1`` (F32: taken back here, added again at load).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np
import torch

from engine_worker.gguf_blocks import BLOCK_TYPES, INEXACT_ZEROS, parse_blocks
from engine_worker.linear import WeightSource
from engine_worker.weight_sources import map_rows

logger = logging.getLogger("splitserve.engine.gguf")

SERVED_TYPES = ("F32", "F16", "BF16", *BLOCK_TYPES)
# Architectures whose converter permutes q/k rows for an interleaved rope.
PERMUTED_QK_ARCHITECTURES = ("llama", "smollm3", "granite")
# (its Llama converter's subclasses that keep the permutation; Mistral files are "llama" too)
# Architectures whose converter stores norm weights as w + 1 (Gemma's RMSNorm scales by 1 + w).
NORM_SHIFT_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# The per-layer Hugging Face names our layers read (engine_worker.layers); ``up_proj`` last, so
# that where two map to ``ffn_up`` it wins (a fused gate_up is told by its missing ffn_gate).
_HF_LAYER_PARTS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.down_proj",
    "mlp.gate_up_proj",
    "mlp.up_proj",
    # a mixture of experts (engine_worker.moe's names): router, stacked experts, shared expert
    "mlp.gate",
    "mlp.experts.gate_proj",
    "mlp.experts.up_proj",
    "mlp.experts.down_proj",
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate",
)
_layer_names_cache: dict[str, dict[str, str]] = {}


class UnsupportedGGUFType(ValueError):
    pass


class GGUFFileError(ValueError):
    pass


def layer_names(architecture: str) -> dict[str, str]:
    """GGUF layer tensor kind -> Hugging Face name part, for ``architecture`` (the ``gguf``
    package's map; an architecture it does not know gets Llama's)."""
    names = _layer_names_cache.get(architecture)
    if names is None:
        import gguf

        by_name = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
        name_map = gguf.get_tensor_name_map(by_name.get(architecture, gguf.MODEL_ARCH.LLAMA), 1)
        names = {}
        for part in _HF_LAYER_PARTS:
            mapped = name_map.get_name(f"model.layers.0.{part}")
            if mapped is not None:
                names[mapped.split(".", 2)[2]] = part
        _layer_names_cache[architecture] = names
    return names


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None: unknown)."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        mapped = layer_names(architecture).get(part)
        return f"model.layers.{index}.{mapped}.{kind}" if mapped else None
    mapped = _TOP_LEVEL_NAMES.get(stem)
    return f"{mapped}.{kind}" if mapped else None


def read_gguf(
    path: str | Path | Sequence[str | Path], num_heads: int, num_kv_heads: int
) -> dict[str, WeightSource]:
    """Every tensor of the checkpoint, keyed by its Hugging Face name (unknown names are skipped
    with a warning). ``path``: one file, or the parts of a split checkpoint in order (llama.cpp's
    layout: the metadata in the first part, the tensors spread over all). Raises
    ``UnsupportedGGUFType`` naming the first tensor of a type we cannot serve, ``GGUFFileError``
    for a file that is not a readable GGUF (or not the part it should be)."""
    # Resolved: a cached model directory links to the user's files, which errors should name.
    paths = [Path(p).resolve() for p in ([path] if isinstance(path, (str, Path)) else path)]
    readers = _open_parts(paths)
    field = readers[0].fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field else ""
    all_tensors = [t for reader in readers for t in reader.tensors]
    unsupported = [t for t in all_tensors if t.tensor_type.name not in SERVED_TYPES]
    if unsupported:
        t = unsupported[0]
        raise UnsupportedGGUFType(
            f"{paths[0]}: tensor {t.name!r} has GGUF type {t.tensor_type.name}, which splitserve "
            f"cannot serve ({len(unsupported)} such tensors; supported types: "
            f"{', '.join(SERVED_TYPES)}). Requantize the file to one of those types."
        )
    tensors: dict[str, WeightSource] = {}
    skipped = []
    INEXACT_ZEROS[:] = [0, 0]
    for t in all_tensors:
        name = hf_name(t.name, architecture)
        if name is None:
            skipped.append(t.name)
            continue
        source = _parse(t.tensor_type.name, np.asarray(t.data), [int(d) for d in t.shape])
        if architecture in PERMUTED_QK_ARCHITECTURES:
            if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
                source = _unpermute_rows(source, num_heads)
            elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
                source = _unpermute_rows(source, num_kv_heads)
        if architecture in NORM_SHIFT_ARCHITECTURES and name.endswith("norm.weight"):
            if not isinstance(source, torch.Tensor):
                raise UnsupportedGGUFType(f"{path}: norm {t.name!r} is not stored as floats")
            source = source.float() - 1
        tensors[name] = source
    for name in [n for n in tensors if n.endswith("mlp.up_proj.weight")]:
        if name.replace("up_proj", "gate_proj") not in tensors:  # Phi-3: gate and up fused
            tensors[name.replace("up_proj", "gate_up_proj")] = tensors.pop(name)
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


def open_reader(path: str | Path):
    """The ``gguf`` package's reader of one file, over a plain buffer (see _reader_class)."""
    return _reader_class()(str(path))


def _open_parts(paths: list[Path]) -> list:
    """A reader per file; with several, each must be the part of one split checkpoint that its
    place says (``split.no``, ``split.count``) and together hold ``split.tensors.count``."""
    readers = []
    for path in paths:
        try:
            readers.append(_index_reader_class()(str(path)))
        except (ValueError, IndexError, OSError, EOFError) as exc:
            raise GGUFFileError(
                f"{path} is not a readable GGUF file, truncated or corrupt ({exc})"
            ) from exc
    if len(paths) == 1:
        return readers
    for no, (path, reader) in enumerate(zip(paths, readers)):
        found = (_int_field(reader, "split.no"), _int_field(reader, "split.count"))
        if found != (no, len(paths)):
            raise GGUFFileError(
                f"{path} says it is part (split.no, split.count) = {found}, expected "
                f"{(no, len(paths))}: the parts are not one split checkpoint"
            )
    expected = _int_field(readers[0], "split.tensors.count")
    total = sum(len(r.tensors) for r in readers)
    if expected != total:
        raise GGUFFileError(
            f"{paths[0]}: the parts hold {total} tensors, split.tensors.count says {expected}"
        )
    return readers


def _int_field(reader, key: str) -> int | None:
    field = reader.fields.get(key)
    return int(field.parts[field.data[0]][0]) if field is not None else None


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


@cache
def _index_reader_class():
    from gguf import GGUFValueType

    widths = {t: np.dtype(d).itemsize for t, d in _reader_class().gguf_scalar_to_np.items()}

    base: type = _reader_class()

    class IndexReader(base):
        """The reader ``read_gguf`` takes the tensor index and the scalar metadata from: an array
        value (the vocabulary, its merges and token types: ~10^5 strings and numbers, each a
        part of its own in the gguf package's reader, 1.5 s of a 1.1B model's start) is stepped
        over and kept as one part of raw bytes, its values unparsed."""

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple:
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            item_type, count = struct.unpack_from("<IQ", self._buffer, orig_offs)
            offs = orig_offs + 12
            if item_type == GGUFValueType.STRING:
                for _ in range(count):
                    offs += 8 + struct.unpack_from("<Q", self._buffer, offs)[0]
            elif item_type in widths:
                offs += count * widths[item_type]
            else:  # arrays of arrays: the package's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            raw = self._get(orig_offs, np.uint8, offs - orig_offs)
            return offs - orig_offs, [raw], [], [GGUFValueType.ARRAY]

    return IndexReader


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
    # a stack of matrices (a mixture's experts, [E, N, K]) as its E N rows
    rows, cols = int(np.prod(dims[:-1])), dims[-1]
    return parse_blocks(type_name, raw, rows, cols)


def _unpermute_rows(source: WeightSource, heads: int) -> WeightSource:
    def rows(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0]
        return t.reshape(heads, n // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    return map_rows(source, rows)
