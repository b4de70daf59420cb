"""Our own forward for the Llama family (Llama/SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with
q/k norm), loaded straight from safetensors. It runs on a flat batch of tokens from many sequences
and reads/writes the paged KV cache through an ``engine_worker.attention`` backend."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from engine_worker.attention import AttentionBackend, AttentionMetadata
from engine_worker.model_config import ModelConfig, rope_inverse_frequencies

logger = logging.getLogger("splitserve.engine.model")


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # q, k and v projections stacked: one matmul instead of three
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    post_attention_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up projections stacked
    down: torch.Tensor


class LlamaFamilyModel:
    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, max_positions: int) -> None:
        self.config = config
        self.device, self.dtype = device, dtype

        def take(name: str) -> torch.Tensor:
            return tensors.pop(name).to(device=device, dtype=dtype).contiguous()

        def take_optional(name: str) -> torch.Tensor | None:
            return take(name) if name in tensors else None

        self.embed = take("model.embed_tokens.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            bias = None
            if p + "self_attn.q_proj.bias" in tensors:
                bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=qkv, qkv_bias=bias,
                q_norm=take_optional(p + "self_attn.q_norm.weight"),
                k_norm=take_optional(p + "self_attn.k_norm.weight"),
                o_proj=take(p + "self_attn.o_proj.weight"),
                post_attention_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([take(p + "mlp.gate_proj.weight"),
                                   take(p + "mlp.up_proj.weight")]),
                down=take(p + "mlp.down_proj.weight"),
            ))
        self.norm = take("model.norm.weight")
        lm_head = take_optional("lm_head.weight")
        self.lm_head = self.embed if lm_head is None or config.tie_word_embeddings else lm_head
        inv_freq, attention_scaling = rope_inverse_frequencies(config.rope, config.head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        self.cos = (angles.cos() * attention_scaling).to(device=device, dtype=dtype)
        self.sin = (angles.sin() * attention_scaling).to(device=device, dtype=dtype)

    @classmethod
    def load(cls, model_dir: str | Path, device: torch.device, dtype: torch.dtype,
             max_positions: int) -> LlamaFamilyModel:
        model_dir = Path(model_dir)
        config = ModelConfig.from_dir(model_dir)
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        model = cls(config, tensors, device, dtype, max_positions)
        leftover = [n for n in tensors if "rotary_emb" not in n]
        if leftover:
            logger.warning("ignored %d unexpected weights, e.g. %s", len(leftover), leftover[:3])
        return model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: AttentionBackend, metadata: AttentionMetadata,
                logit_rows: torch.Tensor | None) -> torch.Tensor:
        """input_ids/positions [T]; ``metadata`` from ``attention.prepare`` for this step.
        Returns logits [len(logit_rows), vocab] (float32)."""
        cfg = self.config
        num_tokens = input_ids.shape[0]
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        eps = cfg.rms_norm_eps
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        hidden = self.embed[input_ids]
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(hidden, (cfg.hidden_size,), layer.input_norm, eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q = qkv[:, :q_size].view(num_tokens, heads, head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(num_tokens, kv_heads, head_dim)
            v = qkv[:, q_size + kv_size:].view(num_tokens, kv_heads, head_dim)
            if layer.q_norm is not None:
                q = F.rms_norm(q, (head_dim,), layer.q_norm, eps)
                k = F.rms_norm(k, (head_dim,), layer.k_norm, eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            attn = attention.forward(q, k, v, i, metadata)
            hidden = hidden + F.linear(attn.reshape(num_tokens, q_size), layer.o_proj)
            x = F.rms_norm(hidden, (cfg.hidden_size,), layer.post_attention_norm, eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down)
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        hidden = F.rms_norm(hidden, (cfg.hidden_size,), self.norm, eps)
        return F.linear(hidden, self.lm_head).float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
