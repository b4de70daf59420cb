"""Our own forward for the Llama family (Llama/SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with
q/k norm), loaded from safetensors or from a GGUF at its own precision. It runs on a flat batch
of tokens from many sequences and reads/writes the paged KV cache through an
``engine_worker.attention`` backend. Linear layers are ``LinearWeight``s
(``engine_worker.linear``): the forward calls ``apply`` whatever format ``WeightFormat`` gave
them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from engine_worker.attention import AttentionBackend, AttentionMetadata
from engine_worker.gguf_tensors import read_gguf
from engine_worker.linear import LinearWeight, WeightSource, refine_top_logits
from engine_worker.model_config import ModelConfig, rope_inverse_frequencies
from engine_worker.rms_norm import RmsNorm
from engine_worker.scripted_decode import ScriptedDecode
from engine_worker.weight_format import WeightFormat
from runtime.model_files import gguf_weights

logger = logging.getLogger("splitserve.engine.model")


@dataclass(slots=True)
class LayerWeights:
    input_norm: RmsNorm
    qkv: LinearWeight  # q, k and v projections stacked: one matmul instead of three
    q_norm: RmsNorm | None
    k_norm: RmsNorm | None
    o_proj: LinearWeight
    post_attention_norm: RmsNorm
    gate_up: LinearWeight  # gate and up projections stacked
    down: LinearWeight


class LlamaFamilyModel:
    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, WeightSource],
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        weight_format: WeightFormat | None = None,
    ) -> None:
        self.config = config
        self.device, self.dtype = device, dtype
        fmt = weight_format or WeightFormat("auto", dtype, device)
        self.weight_format = fmt

        def take(name: str) -> torch.Tensor:
            return fmt.dense(tensors.pop(name))

        def norm(name: str) -> RmsNorm:
            return RmsNorm(take(name), config.rms_norm_eps)

        def norm_optional(name: str) -> RmsNorm | None:
            return norm(name) if name in tensors else None

        def linear(*names: str, bias: bool = False):
            biases = None
            if bias and names[0].replace(".weight", ".bias") in tensors:
                biases = torch.cat([take(n.replace(".weight", ".bias")) for n in names])
            return fmt.linear([tensors.pop(n) for n in names], biases)

        embed_source = tensors["model.embed_tokens.weight"]
        self.embed = take("model.embed_tokens.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                LayerWeights(
                    input_norm=norm(p + "input_layernorm.weight"),
                    qkv=linear(*(p + f"self_attn.{n}_proj.weight" for n in "qkv"), bias=True),
                    q_norm=norm_optional(p + "self_attn.q_norm.weight"),
                    k_norm=norm_optional(p + "self_attn.k_norm.weight"),
                    o_proj=linear(p + "self_attn.o_proj.weight"),
                    post_attention_norm=norm(p + "post_attention_layernorm.weight"),
                    gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=linear(p + "mlp.down_proj.weight"),
                )
            )
        self.norm = norm("model.norm.weight")
        if "lm_head.weight" in tensors and not config.tie_word_embeddings:
            head_source = tensors.pop("lm_head.weight")
            self.lm_head = fmt.linear([head_source], None, head=True)
        else:
            # Tied: a quantized head is built from the checkpoint's own embedding tensor (its
            # blocks, for a GGUF); the dense head is the embedding table itself.
            tensors.pop("lm_head.weight", None)
            head_source = embed_source
            self.lm_head = fmt.linear([head_source], None, dense=self.embed, head=True)
        # Below float32 the head's output is rounded: each row's top logits are recomputed in
        # float32 from the checkpoint's own head rows (blocks: small, kept on the CPU) or the
        # dense head's (linear.refine_top_logits).
        self.exact_head: WeightSource | None = None
        if dtype != torch.float32:
            self.exact_head = _exact_head_rows(head_source, self.lm_head, device)
        self.cos, self.signed_sin = _rope_tables(config, max_positions, device, dtype)
        # The hot decode step's layers in one TorchScript call (``use_scripted_decode``).
        self.scripted_decode: ScriptedDecode | None = None
        self.head_inputs: torch.Tensor | None = None  # the last head call's (``head``)

    def use_scripted_decode(self, enabled: bool = True) -> bool:
        """Runs decode-only steps on a kept workspace through ``ScriptedDecode`` where it applies
        to these layers (scripted once, here); returns whether it does."""
        self.scripted_decode = ScriptedDecode.build(self) if enabled else None
        return self.scripted_decode is not None

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        weight_format: WeightFormat | None = None,
    ) -> LlamaFamilyModel:
        """A checkpoint directory: config.json plus either *.safetensors or one GGUF checkpoint
        (a file, or the parts of a split one)."""
        model_dir = Path(model_dir)
        config = ModelConfig.from_dir(model_dir)
        tensors = load_tensors(model_dir, config)
        model = cls(config, tensors, device, dtype, max_positions, weight_format)
        leftover = [n for n in tensors if "rotary_emb" not in n]
        if leftover:
            logger.warning("ignored %d unexpected weights, e.g. %s", len(leftover), leftover[:3])
        return model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        metadata: AttentionMetadata,
        logit_rows: torch.Tensor | None,
        decode_rows: int = 0,
        sampling_rows: int = 0,
        batches: tuple[int, int] | None = None,
        kept: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids/positions [T]; ``metadata`` from ``attention.prepare`` for this step; the
        first ``decode_rows`` rows are decoded tokens', the first ``sampling_rows`` logit rows
        sample a token (the others are prompt logprobs). ``batches``: the decoding and the
        sampling requests those rows belong to, when a request verifying drafts has several
        (the kernel choice is by requests: ``LinearWeight.apply``). ``kept`` [K, hidden]: final
        hidden states of rows computed in earlier steps (prompt ends: prefix_tails.py), sampled
        after this step's sampling rows, in the same head call. Returns logits
        [len(logit_rows) + K, vocab] (float32): the sampling rows, the kept ones, the others;
        ``head_inputs`` holds the head's input rows in that order."""
        num_tokens = input_ids.shape[0]
        # index_select: the same rows as indexing, without its general path (~4 µs a call)
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.signed_sin.index_select(0, positions).unsqueeze(1)
        decode_batch, sampling_batch = batches or (None, None)
        hidden = self.embed.index_select(0, input_ids)
        scripted = self.scripted_decode
        if scripted is not None and scripted.applies(
            attention, metadata, num_tokens, decode_rows, batches
        ):
            hidden = scripted.run(hidden, cos, sin, metadata)
        else:
            self._layers(hidden, cos, sin, attention, metadata, decode_rows, decode_batch)
        attention.finish(metadata)
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        hidden = self.norm(hidden)
        if kept is not None:
            hidden = torch.cat([hidden[:sampling_rows], kept, hidden[sampling_rows:]])
            sampling_rows += kept.shape[0]
            sampling_batch = None if sampling_batch is None else sampling_batch + kept.shape[0]
        return self.head(hidden, sampling_rows, sampling_batch)

    def head(
        self, hidden: torch.Tensor, sampling_rows: int, sampling_batch: int | None = None
    ) -> torch.Tensor:
        """Logits (float32) of final hidden states; the first ``sampling_rows`` sample a token
        (of ``sampling_batch`` requests), which picks the head's copy as for decode rows."""
        self.head_inputs = hidden
        logits = self.lm_head.apply(hidden, sampling_rows, sampling_batch).float()
        if self.exact_head is not None:
            refine_top_logits(logits, hidden, self.exact_head)
        return logits

    def _layers(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBackend,
        metadata: AttentionMetadata,
        decode_rows: int,
        decode_batch: int | None,
    ) -> None:
        """Every decoder layer, eagerly: ``hidden`` [T, hidden] is updated in place."""
        cfg = self.config
        num_tokens = hidden.shape[0]
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        for i, layer in enumerate(self.layers):
            x = layer.input_norm(hidden)
            qkv = layer.qkv.apply(x, decode_rows, decode_batch)
            v = qkv[:, q_size + kv_size :].view(num_tokens, kv_heads, head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = layer.q_norm(qkv[:, :q_size].view(num_tokens, heads, head_dim))
                k = layer.k_norm(
                    qkv[:, q_size : q_size + kv_size].view(num_tokens, kv_heads, head_dim)
                )
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            else:  # q and k heads side by side: one rotation for both
                qk = _rotate(
                    qkv[:, : q_size + kv_size].view(num_tokens, heads + kv_heads, head_dim),
                    cos,
                    sin,
                )
                q, k = qk[:, :heads], qk[:, heads:]
            attn = attention.forward(q, k, v, i, metadata)
            hidden += layer.o_proj.apply(
                attn.reshape(num_tokens, q_size), decode_rows, decode_batch
            )
            x = layer.post_attention_norm(hidden)
            gate, up = layer.gate_up.apply(x, decode_rows, decode_batch).chunk(2, dim=-1)
            hidden += layer.down.apply(F.silu(gate) * up, decode_rows, decode_batch)


def _exact_head_rows(
    source: WeightSource, head: LinearWeight, device: torch.device
) -> WeightSource | None:
    if not isinstance(source, torch.Tensor) and device.type == "cpu":
        return source
    dense = getattr(head, "dense", head)
    return getattr(dense, "weight", None)


def load_tensors(model_dir: Path, config: ModelConfig) -> dict[str, WeightSource]:
    """Every weight of the checkpoint under its Hugging Face name, at the file's precision."""
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        tensors: dict[str, WeightSource] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        return tensors
    ggufs = gguf_weights(model_dir)  # one file, or the parts of a split one
    if ggufs:
        return read_gguf(ggufs, config.num_heads, config.num_kv_heads)
    raise FileNotFoundError(f"{model_dir} has no *.safetensors or *.gguf weights")


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split layout: x * cos + (-x2, x1) * sin, rounded as written (an
    addcmul rounds once less, which in bf16 moved 4 of 32 greedy continuations off float32's)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _rope_tables(
    config: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables for every position: the cosine, and the sine with the rotation's sign
    folded in (negative on the first half): rotating is then x * cos + roll(x, half) *
    signed_sin, four ops instead of five plus two slices."""
    inv_freq, attention_scaling = rope_inverse_frequencies(config.rope, config.head_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    cos = (angles.cos() * attention_scaling).to(device=device, dtype=dtype)
    sign = torch.ones(config.head_dim)
    sign[: config.head_dim // 2] = -1
    signed_sin = (angles.sin() * attention_scaling * sign).to(device=device, dtype=dtype)
    return cos, signed_sin
