"""The decoder layer of every family, written once (``DecoderLayer``): what a layer computes,
with how its linear layers and its attention run left to two methods a subclass gives.

* ``layers.EagerLayer``: Python, every step that is not the hot decode case (prompts, mixed
  steps, other devices): the linears' ``apply`` and the attention backend;
* ``scripted_layers.ScriptedLayer``: the hot decode step (decode rows only, on a kept decode
  workspace), compiled with TorchScript and frozen: the linears' tensors and the CPU backend's
  decode attention on the workspace as graph ops.

How a family differs (``ModelConfig.features``, the layer's ``LayerAttention``, its weights)
is read once into constants (``Final``): compiled, TorchScript folds the branches a layer does
not take, so a plain Llama layer runs only its own ops.

The same aten ops in the same order on the same values whichever subclass runs it, so a row
gets the same bits either way (DESIGN property 9; tests/engine_worker/test_scripted_decode.py).
Written in the subset of Python TorchScript compiles: no ``from __future__ import
annotations`` here (TorchScript reads the annotations at run time), only types it knows.

The residual stream below float32 is kept beside its negation, [T, 2 * hidden] (``stream``):
RMS norm runs as layer norm of [x, -x] (``rms_norm.RmsNorm``), and so the stream's norms take
no cat and no neg; each residual add also subtracts from the negated half (-h - y is -(h + y)
exactly: rounding to nearest is symmetric).
"""

from typing import TYPE_CHECKING, Final

import torch
from torch import Tensor

if TYPE_CHECKING:
    from engine_worker.model_config import ModelConfig

LINEARS = ("qkv", "o_proj", "gate_up", "down")  # a layer's, as ``DecoderLayer.linear`` names them


def residual_stream(hidden: Tensor, negated: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(stream, residual, negated) of the embedded rows ``hidden`` [T, hidden]: with
    ``negated``, the stream [T, 2 * hidden] holds [hidden, -hidden] and the other two are its
    halves; without, all three are ``hidden``."""
    if not negated:
        return hidden, hidden, hidden
    width = hidden.shape[1]
    stream = torch.cat([hidden, hidden.neg()], dim=-1)
    return stream, stream.narrow(1, 0, width), stream.narrow(1, width, width)


class DecoderLayer(torch.nn.Module):
    """One decoder layer. ``linear`` (x through the layer's linear named in ``LINEARS``) and
    ``attend`` (q [T, H, D], the new k/v [T, KV, D] -> [T, H * D]) are the subclass's."""

    # Constants (Final): what the compiled layer folds its branches on. The layer's index is
    # not one (an attribute, folded when the compiled stack is frozen): layers whose constants
    # are equal share one compiled type, so a model's layers compile once, not once each
    heads: Final[int]
    kv_heads: Final[int]
    head_dim: Final[int]
    width: Final[int]  # hidden size
    inner: Final[int]  # the MLP's intermediate size
    eps: Final[float]
    fused_norms: Final[bool]  # RMS norm as layer norm of [x, -x] (below float32)
    negated_stream: Final[bool]  # the stream carries its negation (``residual_stream``)
    has_input_norm: Final[bool]  # before attention
    has_pre_mlp_norm: Final[bool]
    has_attn_out_norm: Final[bool]  # on attention's output before the residual add
    has_mlp_out_norm: Final[bool]
    qk_norm: Final[str]  # "" none, "head" per head, "projection" over the projection
    activation: Final[str]  # of the gated MLP: silu, gelu_tanh or gelu
    residual_scale: Final[float]
    rope: Final[int]  # which rope rotates q and k: 0 the first, -1 none
    # attention: sliding window (0 none), score soft-cap (0 none), softmax scale (None: the
    # kernel's head_dim ** -0.5)
    window: Final[int]
    softcap: Final[float]
    scale: Final[float | None]

    def __init__(self, config: "ModelConfig", weights, index: int) -> None:
        """Layer ``index`` of a model of ``config``, from its ``layers.LayerWeights``."""
        super().__init__()
        features, attention = config.features, config.attention_of(index)
        self.index, self.heads, self.kv_heads = index, config.num_heads, config.num_kv_heads
        self.head_dim, self.width = config.head_dim, config.hidden_size
        self.inner, self.eps = config.intermediate_size, config.rms_norm_eps
        norms = [weights.input_norm, weights.post_attention_norm, weights.attn_out_norm]
        norms += [weights.mlp_out_norm, weights.q_norm, weights.k_norm]
        present = [n for n in norms if n is not None]
        self.fused_norms = bool(present) and present[0].fused
        self.negated_stream = self.fused_norms and norms[0] is not None
        self.has_input_norm, self.has_pre_mlp_norm = norms[0] is not None, norms[1] is not None
        self.has_attn_out_norm, self.has_mlp_out_norm = norms[2] is not None, norms[3] is not None
        qk_norm = weights.q_norm is not None and weights.k_norm is not None
        over_projection = features.qk_norm_over_projection
        self.qk_norm = "" if not qk_norm else "projection" if over_projection else "head"
        # the norms' weights as the kernel takes them (empty where the layer has none)
        self.input_norm, self.pre_mlp_norm, self.attn_out_norm, self.mlp_out_norm, q, k = [
            torch.empty(0) if n is None else n.doubled_weight if n.fused else n.weight
            for n in norms
        ]
        self.q_norm, self.k_norm = q, k
        self.activation, self.residual_scale = features.activation, features.residual_scale
        self.rope = weights.rope
        self.window, self.softcap, self.scale = attention.window, attention.softcap, attention.scale

    def forward(
        self,
        stream: Tensor,
        residual: Tensor,
        negated: Tensor,
        cos: Tensor,
        signed_sin: Tensor,
        more_ropes: list[Tensor],
        step_tensors: list[Tensor],
        step_ints: list[int],
    ) -> tuple[Tensor, Tensor]:
        """The layer on the residual stream (``residual_stream``; updated in place); ``cos`` /
        ``signed_sin`` [T, 1, D] the first rope's rows, ``more_ropes`` the others' (cos, sin,
        ...); ``step_tensors``/``step_ints`` what ``attend`` reads this step. Returns the
        layer's new keys and values [T, KV, D]."""
        x = residual
        if self.has_input_norm:
            x = self.stream_norm(stream, residual, self.input_norm)
        q, k, v = self.attention_inputs(self.linear(x, "qkv"), cos, signed_sin, more_ropes)
        y = self.linear(self.attend(q, k, v, step_tensors, step_ints), "o_proj")
        if self.has_attn_out_norm:
            y = self.norm(y, self.attn_out_norm)
        self.add_branch(residual, negated, y)
        x = residual
        if self.has_pre_mlp_norm:
            x = self.stream_norm(stream, residual, self.pre_mlp_norm)
        y = self.mlp(x)
        if self.has_mlp_out_norm:
            y = self.norm(y, self.mlp_out_norm)
        self.add_branch(residual, negated, y)
        return k, v

    def linear(self, x: Tensor, which: str) -> Tensor:
        raise NotImplementedError

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, step_tensors: list[Tensor], step_ints: list[int]
    ) -> Tensor:
        raise NotImplementedError

    def norm(self, x: Tensor, weight: Tensor) -> Tensor:
        """RMS norm over x's last dimension (``rms_norm.RmsNorm``)."""
        n = x.shape[-1]
        if self.fused_norms:
            both = torch.cat([x, x.neg()], dim=-1)
            return torch.layer_norm(both, [2 * n], weight, None, self.eps).narrow(-1, 0, n)
        return torch.rms_norm(x, [n], weight, self.eps)

    def stream_norm(self, stream: Tensor, residual: Tensor, weight: Tensor) -> Tensor:
        """``norm`` of the residual, from the stream where it carries its negation."""
        if self.negated_stream:
            both = torch.layer_norm(stream, [2 * self.width], weight, None, self.eps)
            return both.narrow(1, 0, self.width)
        return self.norm(residual, weight)

    def add_branch(self, residual: Tensor, negated: Tensor, y: Tensor) -> None:
        if self.residual_scale != 1.0:  # Granite
            y = y * self.residual_scale
        residual += y
        if self.negated_stream:
            negated -= y

    def rotate(self, x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        """Rotary embedding, half-split layout: x * cos + (-x2, x1) * sin, rounded as written
        (an addcmul rounds once less, which in bf16 moved 4 of 32 greedy continuations off
        float32's); the sine carries the rotation's sign (``layers.rope_tables``)."""
        return x * cos + x.roll(self.head_dim // 2, -1) * signed_sin

    def attention_inputs(
        self, qkv: Tensor, cos: Tensor, signed_sin: Tensor, more_ropes: list[Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q [T, H, D], k and v [T, KV, D] of the stacked projection: q/k normed (per head,
        or over the projection) and rotated where the layer does."""
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        if self.rope > 0:
            cos, signed_sin = more_ropes[2 * self.rope - 2], more_ropes[2 * self.rope - 1]
        v = qkv.narrow(1, q_size + kv_size, kv_size).view(-1, kv_heads, head_dim)
        if self.qk_norm == "":
            qk = qkv.narrow(1, 0, q_size + kv_size).view(-1, heads + kv_heads, head_dim)
            if self.rope >= 0:  # q and k heads side by side: one rotation for both
                qk = self.rotate(qk, cos, signed_sin)
            return qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads), v
        q, k = qkv.narrow(1, 0, q_size), qkv.narrow(1, q_size, kv_size)
        if self.qk_norm == "projection":
            q, k = self.norm(q, self.q_norm), self.norm(k, self.k_norm)
        q, k = q.reshape(-1, heads, head_dim), k.reshape(-1, kv_heads, head_dim)
        if self.qk_norm == "head":
            q, k = self.norm(q, self.q_norm), self.norm(k, self.k_norm)
        if self.rope >= 0:
            q, k = self.rotate(q, cos, signed_sin), self.rotate(k, cos, signed_sin)
        return q, k, v

    def mlp(self, x: Tensor) -> Tensor:
        """The gated MLP: down(activation(gate) * up), gate and up one stacked linear."""
        gate_up = self.linear(x, "gate_up")
        gate, up = gate_up.narrow(1, 0, self.inner), gate_up.narrow(1, self.inner, self.inner)
        return self.linear(self.activate(gate) * up, "down")

    def activate(self, gate: Tensor) -> Tensor:
        """The gated MLP's activation (a mixture of experts' experts take it too)."""
        if self.activation == "gelu_tanh":
            return torch.ops.aten.gelu(gate, approximate="tanh")
        if self.activation == "gelu":
            return torch.ops.aten.gelu(gate)
        return torch.ops.aten.silu(gate)
