"""Tiny random mixture-of-experts models of each family (transformers' own classes, float32) and
their GGUF files written the way llama.cpp's converter writes them: each layer's experts stacked
into one [experts, rows, columns] tensor per projection (``ffn_gate_exps``, ``ffn_up_exps``,
``ffn_down_exps``), the router as ``ffn_gate_inp``, Qwen2-MoE's shared expert as ``ffn_*_shexp``,
Mixtral as a "llama" file (q/k rows in its rope order)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from safetensors import safe_open

from tests.engine_worker.test_families import COMMON
from tests.gguf_files import copy_tokenizer_fields, permute_rows

T = GGMLQuantizationType
# name: (model_type, GGUF architecture, config overrides): top-k of 2 or 3 of 4 to 8 experts,
# norm_topk_prob both ways, Qwen2-MoE with a shared expert and one dense layer
MOE_FAMILIES = {
    "qwen2_moe": (
        "qwen2_moe",
        "qwen2moe",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        "qwen3moe",
        dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "olmoe": ("olmoe", "olmoe", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    "mixtral": (
        "mixtral",
        "llama",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    ),
}
# llama.cpp's Qwen2-MoE has no dense layers (its architecture lists no ffn_gate/ffn_up/ffn_down)
GGUF_OVERRIDES = {"qwen2_moe": dict(mlp_only_layers=[])}
_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\."
)
_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def tiny_moe(name: str, out_dir: Path, **overrides):
    """The family's tiny random model (norms and routers randomized too), saved to ``out_dir``;
    returns the transformers model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, _, family = MOE_FAMILIES[name]
    config = AutoConfig.for_model(model_type, **{**COMMON, **family, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(0.3 * torch.randn_like(param))
            elif param_name.endswith("gate.weight") and "experts" not in param_name:
                param.normal_(0, 0.3)  # routers (and the shared expert's gate): clear choices
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return model


def stacked_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """The checkpoint's float32 tensors with each layer's experts stacked as llama.cpp's converter
    stacks them: ``model.layers.L.mlp.experts.{gate,up,down}_proj.weight`` [experts, rows,
    columns],
    whatever layout the checkpoint saved (per expert, or transformers' fused gate_up)."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for hf in f.keys():
            w = f.get_tensor(hf).float().numpy()
            found = _PER_EXPERT.match(hf)
            if found:
                layer, expert, part = found.groups()
                experts.setdefault((int(layer), _PARTS.get(part, part)), {})[int(expert)] = w
            elif hf.endswith("experts.gate_up_proj"):
                gate, up = np.split(w, 2, axis=1)
                out[hf.replace("gate_up_proj", "gate_proj.weight")] = gate
                out[hf.replace("gate_up_proj", "up_proj.weight")] = up
            elif hf.endswith("experts.down_proj"):
                out[hf + ".weight"] = w
            else:
                out[hf.replace(".block_sparse_moe.", ".mlp.")] = w
    for (layer, part), by_expert in experts.items():
        stack = np.stack([by_expert[e] for e in range(len(by_expert))])
        out[f"model.layers.{layer}.mlp.experts.{part}.weight"] = stack
    return out


def write_moe_gguf(
    model_dir: Path, out: Path, architecture: str, encode=None, metadata: Path | None = None
) -> dict[str, np.ndarray]:
    """The checkpoint as a GGUF file ``out`` (config.json beside it unless ``metadata``, the
    default model's directory: then its tokenizer and the architecture's keys are in the file,
    as llama.cpp writes them, and nothing is beside it). ``encode(w, name)`` -> (data, type)
    where given (F32 else). Returns each GGUF tensor as the ``gguf`` package dequantizes it."""
    from gguf import quants

    config = json.loads((model_dir / "config.json").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    arch = {v: k for k, v in MODEL_ARCH_NAMES.items()}[architecture]
    names = get_tensor_name_map(arch, config["num_hidden_layers"])
    writer = GGUFWriter(str(out), architecture)
    if metadata is None:
        shutil.copy(model_dir / "config.json", out.parent / "config.json")
    else:
        _write_metadata(writer, config, metadata)
    written = {}
    for hf, w in stacked_tensors(model_dir).items():
        gguf_name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf
        if architecture == "llama" and ("self_attn.q_proj" in hf or "self_attn.k_proj" in hf):
            heads = config["num_attention_heads" if "q_proj" in hf else "num_key_value_heads"]
            w = permute_rows(w, heads)
        data, qtype = encode(w, gguf_name) if encode else (np.ascontiguousarray(w), T.F32)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        exact = data if qtype == T.F32 else quants.dequantize(data, qtype)
        written[gguf_name] = np.asarray(exact, np.float32).reshape(w.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _write_metadata(writer: GGUFWriter, config: dict, tokenizer_from: Path) -> None:
    """The keys llama.cpp's converter writes for these families, and a tokenizer."""
    from procs.model_store import gguf_file

    experts = config.get("num_experts") or config["num_local_experts"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(config.get("rope_theta") or rope.get("rope_theta", 1e4)))
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    copy_tokenizer_fields(writer, gguf_file(tokenizer_from))


def per_expert_checkpoint(written: dict[str, np.ndarray], config: dict, out_dir: Path) -> None:
    """A safetensors checkpoint of GGUF tensors ``written`` (``write_moe_gguf``'s, of a
    non-llama architecture), each expert under its own Hugging Face name, config beside."""
    from safetensors.torch import save_file

    parts = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
    tensors = {}
    for name, w in written.items():
        kind = name.split(".")[-2] if name.startswith("blk.") else ""
        if kind in parts:
            layer = name.split(".")[1]
            for e in range(w.shape[0]):
                hf = f"model.layers.{layer}.mlp.experts.{e}.{parts[kind]}.weight"
                tensors[hf] = torch.from_numpy(np.ascontiguousarray(w[e]))
        else:
            tensors[_hf_name(name)] = torch.from_numpy(np.ascontiguousarray(w))
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config))


def _hf_name(gguf_name: str) -> str:
    from engine_worker.gguf_tensors import hf_name

    found = hf_name(gguf_name, "qwen3moe")
    assert found is not None, gguf_name
    return found
