"""The decoder layers' weights, loaded from Hugging Face names for every family, their rope
tables, and the layers run eagerly (``EagerLayer``: the one definition,
``decoder_layer.DecoderLayer``, with Python linears and the attention backend). Each optional
part (norm layout, q/k norm, rope per layer, activation, residual scale) is decided by
``ModelConfig.features`` at load; a plain Llama layer runs exactly its own ops.

Norms by role: ``input_norm`` before attention and ``post_attention_norm`` before the MLP (the
names Llama's checkpoint gives them: ``input_layernorm``, ``post_attention_layernorm``);
``attn_out_norm`` and ``mlp_out_norm`` on each branch's output before the residual add (Gemma's
``post_attention_layernorm``/``post_feedforward_layernorm``, OLMo 2's). Each is None where the
family has no such norm.

The MLP: a gated one (``gate_up``, ``down``), or where ``features.moe`` makes the layer sparse a
mixture of experts (``moe``: engine_worker.moe)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_worker.attention import AttentionBackend, AttentionMetadata
from engine_worker.decoder_layer import LINEARS, DecoderLayer, residual_stream
from engine_worker.linear import LinearWeight, WeightSource, dequantize
from engine_worker.model_config import ModelConfig, rope_inverse_frequencies
from engine_worker.moe import ExpertLoad, MoeBlock, load_moe
from engine_worker.rms_norm import RmsNorm
from engine_worker.weight_format import WeightFormat
from engine_worker.weight_sources import map_rows


@dataclass(slots=True)
class LayerWeights:
    input_norm: RmsNorm | None
    qkv: LinearWeight  # q, k and v projections stacked: one matmul instead of three
    q_norm: RmsNorm | None  # per head, or over the whole projection (OLMo 2)
    k_norm: RmsNorm | None
    o_proj: LinearWeight
    post_attention_norm: RmsNorm | None  # before the MLP
    gate_up: LinearWeight | None  # gate and up projections stacked (None: a MoE layer)
    down: LinearWeight | None
    attn_out_norm: RmsNorm | None = None
    mlp_out_norm: RmsNorm | None = None
    rope: int = 0  # which rope table (-1: none)
    moe: MoeBlock | None = None  # the MLP is this mixture of experts


class LayerLoader:
    """Takes one layer's weights out of ``tensors`` (Hugging Face names) in ``fmt``."""

    def __init__(
        self, config: ModelConfig, tensors: dict[str, WeightSource], fmt: WeightFormat
    ) -> None:
        self.config, self.tensors, self.fmt = config, tensors, fmt
        self.rotary_rows = rotary_row_order(config)
        # the rows each expert takes, shared by the MoE layers (None: a dense model)
        self.expert_load = ExpertLoad() if config.features.moe else None

    def norm(self, name: str | None, rows: torch.Tensor | None = None) -> RmsNorm | None:
        """The RMSNorm ``name`` (None where absent), Gemma's 1 + w folded in (in float32)."""
        if name is None or name not in self.tensors:
            return None
        weight = dequantize(self.tensors.pop(name))
        if rows is not None:
            weight = weight[rows]
        offset = self.config.features.norm_offset
        if offset:
            weight = weight.float() + offset
        return RmsNorm(self.fmt.dense(weight), self.config.rms_norm_eps)

    def linear(self, *names: str) -> LinearWeight:
        """One layer of ``names`` stacked, with their biases where the checkpoint has them."""
        tensors = self.tensors
        bias_names = [n.replace(".weight", ".bias") for n in names]
        biases = None
        if all(b in tensors for b in bias_names):
            biases = torch.cat([self.fmt.dense(tensors.pop(b)) for b in bias_names])
        return self.fmt.linear([tensors.pop(n) for n in names], biases)

    def qkv(self, prefix: str) -> LinearWeight:
        """q, k and v stacked (Phi-3's fused ``qkv_proj`` as it is), with q/k rows reordered
        for a partial rotary (``rotary_row_order``)."""
        fused = prefix + "qkv_proj.weight"
        names = [fused] if fused in self.tensors else [prefix + f"{n}_proj.weight" for n in "qkv"]
        if self.rotary_rows is not None:
            for name in names:
                rows = self._rows_of(name)
                for tensor in (name, name.replace(".weight", ".bias")):
                    if tensor in self.tensors:
                        self.tensors[tensor] = take_rows(self.tensors[tensor], rows)
        return self.linear(*names)

    def _rows_of(self, name: str) -> torch.Tensor:
        """The row order of projection ``name`` for a partial rotary."""
        cfg, rows = self.config, self.rotary_rows
        assert rows is not None
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if name.endswith("qkv_proj.weight"):  # Phi-3's fused projection
            return torch.cat([rows, torch.arange(q_size + kv_size, q_size + 2 * kv_size)])
        if name.endswith("q_proj.weight"):
            return rows[:q_size]
        if name.endswith("k_proj.weight"):
            return rows[q_size:] - q_size
        return torch.arange(kv_size)  # v

    def _qk_norm_rows(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The row order of the q and k norm weights for a partial rotary: one head's, or the
        whole projection's (OLMo 2)."""
        cfg, rows = self.config, self.rotary_rows
        if rows is None:
            return None, None
        if not cfg.features.qk_norm_over_projection:
            return rows[: cfg.head_dim], rows[: cfg.head_dim]
        q_size = cfg.num_heads * cfg.head_dim
        return rows[:q_size], rows[q_size:] - q_size

    def layer(self, i: int) -> LayerWeights:
        """Layer ``i``'s weights; which checkpoint norm plays which role is the layout's."""
        cfg, p = self.config, f"model.layers.{i}."
        layout = cfg.features.norm_layout
        pre_mlp = {"pre": "post_attention_layernorm", "sandwich": "pre_feedforward_layernorm"}
        q_rows, k_rows = self._qk_norm_rows()
        moe = None
        if self.expert_load is not None and cfg.features.moe and cfg.features.moe.sparse(i):
            moe = load_moe(self.tensors, self.fmt, cfg, i, self.expert_load)
        return LayerWeights(
            input_norm=self.norm(None if layout == "post" else p + "input_layernorm.weight"),
            qkv=self.qkv(p + "self_attn."),
            q_norm=self.norm(p + "self_attn.q_norm.weight", q_rows),
            k_norm=self.norm(p + "self_attn.k_norm.weight", k_rows),
            o_proj=self.linear(p + "self_attn.o_proj.weight"),
            post_attention_norm=self.norm(
                p + pre_mlp[layout] + ".weight" if layout in pre_mlp else None
            ),
            gate_up=None if moe else self._gate_up(p + "mlp."),
            down=None if moe else self.linear(p + "mlp.down_proj.weight"),
            attn_out_norm=self.norm(
                None if layout == "pre" else p + "post_attention_layernorm.weight"
            ),
            mlp_out_norm=self.norm(p + "post_feedforward_layernorm.weight"),
            rope=cfg.features.layer_rope[i] if cfg.features.layer_rope else 0,
            moe=moe,
        )

    def _gate_up(self, prefix: str) -> LinearWeight:
        fused = prefix + "gate_up_proj.weight"  # Phi-3: gate rows, then up rows
        if fused in self.tensors:
            return self.linear(fused)
        return self.linear(prefix + "gate_proj.weight", prefix + "up_proj.weight")


def rotary_row_order(config: ModelConfig) -> torch.Tensor | None:
    """For a partial rotary (Phi-4-mini: the first R of each head's D dimensions rotate, in two
    halves of R/2), the order of q's then k's rows that puts each head's rotating pairs D/2 apart:
    [first rotating half, first half of the rest, second rotating half, second half of the rest].
    q . k is the same in any order common to both, and the rotation is then the full one's
    (``DecoderLayer.rotate``) with cos 1 and sin 0 on the dimensions that do not rotate: no
    other op. None where every dimension rotates."""
    head_dim = config.head_dim
    rotary = int(head_dim * config.rope.get("partial_rotary_factor", 1.0))
    if rotary >= head_dim:
        return None
    if rotary % 2 or head_dim % 2:
        raise ValueError(f"a partial rotary of {rotary} of {head_dim} dimensions is not supported")
    half, rest = rotary // 2, (head_dim - rotary) // 2
    one = torch.cat(
        [
            torch.arange(half),
            torch.arange(rotary, rotary + rest),
            torch.arange(half, rotary),
            torch.arange(rotary + rest, head_dim),
        ]
    )
    heads = config.num_heads + config.num_kv_heads
    return (one[None, :] + head_dim * torch.arange(heads)[:, None]).reshape(-1)


def take_rows(source: WeightSource, rows: torch.Tensor) -> WeightSource:
    """``source``'s rows in the order ``rows`` (whole rows: quantized blocks move as they are)."""
    return map_rows(source, lambda t: t[rows])


def rope_tables(
    config: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per rope of the model (``ModelConfig.ropes``, else ``rope``): the cosine and the sine
    with the rotation's sign folded in (negative on the first half) for every position:
    rotating is x * cos + roll(x, half) * signed_sin, four ops instead of five plus two slices.
    Dimensions that do not rotate (a partial rotary, ``rotary_row_order``) get cos 1, sin 0."""
    tables = []
    half = config.head_dim // 2
    for rope in config.ropes or (config.rope,):
        inv_freq, scaling = rope_inverse_frequencies(rope, config.head_dim, max_positions)
        inv_freq = torch.cat([inv_freq, torch.zeros(half - inv_freq.shape[0])])
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        rotating = torch.cat([inv_freq != 0, inv_freq != 0]) if scaling != 1.0 else None
        cos, sin = angles.cos(), angles.sin()
        if rotating is not None:  # the attention factor scales the rotating dimensions only
            cos = torch.where(rotating, cos * scaling, cos)
            sin = sin * scaling
        sign = torch.ones(config.head_dim)
        sign[:half] = -1
        tables.append(
            (cos.to(device=device, dtype=dtype), (sin * sign).to(device=device, dtype=dtype))
        )
    return tables


@dataclass(slots=True)
class EagerStep:
    """What the eager layers read of the step they run (``EagerLayers.run`` sets it)."""

    attention: AttentionBackend | None = None
    metadata: AttentionMetadata | None = None
    decode_rows: int = 0
    decode_batch: int | None = None


class EagerLayer(DecoderLayer):
    """The decoder layer in Python: its linears' ``apply`` (whatever format ``WeightFormat``
    gave them) and the attention backend's ``forward``."""

    def __init__(
        self, config: ModelConfig, weights: LayerWeights, index: int, step: EagerStep
    ) -> None:
        super().__init__(config, weights, index)
        self.linears = {name: getattr(weights, name) for name in LINEARS}
        self.weights_moe = weights.moe
        self.step = step

    def linear(self, x: torch.Tensor, which: str) -> torch.Tensor:
        return self.linears[which].apply(x, self.step.decode_rows, self.step.decode_batch)

    def attend(self, q, k, v, step_tensors, step_ints) -> torch.Tensor:
        attention, metadata = self.step.attention, self.step.metadata
        assert attention is not None and metadata is not None
        out = attention.forward(q, k, v, self.index, metadata)
        return out.reshape(-1, self.heads * self.head_dim)


class MoeLayer(EagerLayer):
    """A decoder layer whose MLP is a mixture of experts (``moe.MoeBlock``): run eagerly only
    (the scripted decode takes plain ``EagerLayer``s)."""

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.weights_moe
        assert moe is not None
        return moe.apply(x, self.activate, self.step.decode_rows, self.step.decode_batch)


class EagerLayers:
    """Every decoder layer of a model, run eagerly."""

    def __init__(self, config: ModelConfig, layers: list[LayerWeights]) -> None:
        self.step = EagerStep()
        self.layers = [
            (EagerLayer if w.moe is None else MoeLayer)(config, w, i, self.step)
            for i, w in enumerate(layers)
        ]
        self.negated_stream = self.layers[0].negated_stream
        assert all(x.negated_stream == self.negated_stream for x in self.layers)

    def run(
        self,
        hidden: torch.Tensor,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        attention: AttentionBackend,
        metadata: AttentionMetadata,
        decode_rows: int,
        decode_batch: int | None,
    ) -> torch.Tensor:
        """The embedded rows ``hidden`` [T, hidden] through every layer -> the last layer's
        output [T, hidden] (a view); ``ropes`` each rope's (cos, signed_sin) rows for this
        step's positions."""
        step = self.step
        step.attention, step.metadata = attention, metadata
        step.decode_rows, step.decode_batch = decode_rows, decode_batch
        stream, residual, negated = residual_stream(hidden, self.negated_stream)
        more_ropes = [t for rope in ropes[1:] for t in rope]
        try:
            for layer in self.layers:
                layer.forward(stream, residual, negated, *ropes[0], more_ropes, [], [])
        finally:
            step.attention = step.metadata = None
        return residual
