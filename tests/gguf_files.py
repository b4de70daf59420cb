"""GGUF files for tests, written as llama.cpp's converter writes them: the tiny random model's
weights (float32, or an unserved type where asked), its architecture's config keys, and the
default model's tokenizer and chat template copied from its own GGUF's metadata. Nothing else
sits beside the file: whoever serves it must read everything from it."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from safetensors import safe_open

from engine_worker.gguf_tensors import open_reader
from procs.model_store import gguf_file

T = GGMLQuantizationType
_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Our model types as llama.cpp writes them: Mistral's dense models are "llama" files, which
# transformers tells apart by the general.name "mistral".
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def gguf_name(hf: str) -> str:
    if hf in _NAMES:
        return _NAMES[hf]
    _, _, index, rest = hf.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{_LAYER[part]}.{kind}"


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q and k of "llama" files (adjacent rope pairs)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def copy_tokenizer_fields(writer: GGUFWriter, source: Path) -> None:
    """Every tokenizer.* key of ``source`` (vocabulary, merges, special ids, chat template)."""
    for key, value, main, sub in tokenizer_fields(source, source.stat().st_mtime_ns):
        writer.add_key_value(key, copy.copy(value), main, sub)


@functools.cache
def tokenizer_fields(source: Path, mtime_ns: int) -> tuple[tuple, ...]:
    """``(key, value, type, element type)`` of every tokenizer.* key of ``source``: read once
    per process (seconds for the default model's 49,152 tokens and merges), as every tiny GGUF
    written copies them."""
    fields = []
    for key, field in open_reader(source).fields.items():
        if key.startswith("tokenizer."):
            main = field.types[0]
            sub = field.types[-1] if main == GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), main, sub))
    return tuple(fields)


def write_tiny_gguf(
    model_dir: Path,
    out: Path,
    *,
    default_model_dir: Path,
    unserved: str = "",
    split_max_tensors: int = 0,
    eot_token_id: int | None = None,
) -> list[Path]:
    """The HF checkpoint ``model_dir`` as a GGUF file ``out`` (its parts, when
    ``split_max_tensors`` splits it). ``unserved``: a tensor (GGUF name) written as IQ4_NL, a
    type the engine does not serve (its bytes are random: nobody may read them).
    ``eot_token_id``: an end-of-turn token besides the end-of-sequence one. Returns the files
    written."""
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    arch = GGUF_ARCH[model_type]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    writer.add_name("mistral" if model_type == "mistral" else out.stem)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(config.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    copy_tokenizer_fields(writer, gguf_file(default_model_dir))
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    rng = np.random.default_rng(0)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for hf in f.keys():
            w = f.get_tensor(hf).float().numpy()
            name = gguf_name(hf)
            if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
                w = permute_rows(w, heads if ".attn_q." in name else kv_heads)
            if name == unserved:
                rows, cols = w.shape
                raw = rng.integers(0, 256, (rows, cols // 32 * 18), dtype=np.uint8)
                writer.add_tensor(name, raw, raw_dtype=T.IQ4_NL)
            else:
                writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(out.parent.glob(f"{out.stem}*.gguf"))
