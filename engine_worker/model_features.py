"""How a family's decoder differs from the plain Llama one, read once from config.json into a
small record (``ModelFeatures``) that the one decoder layer (``engine_worker.layers``) and the
head branch on at load; a model whose features are all the defaults is the plain case.

What each family sets (transformers' reading of its config):

* Gemma 2 / Gemma 3: RMSNorm scales by ``1 + w`` (folded into the weights at load), the
  embedding times sqrt(hidden) rounded to the activation dtype, GeGLU (gelu tanh), norms around
  both halves of the layer (``sandwich``), final logit soft-capping (Gemma 2); Gemma 3 gives its
  sliding layers their own rope (``rope_parameters["sliding_attention"]`` or
  ``rope_local_base_freq``);
* Granite: the embedding, each residual branch and the logits scaled by its multipliers;
* OLMo 2: norms after attention and after the MLP instead of before (``post``), q/k norm over
  the whole projection rather than per head;
* SmolLM3: some layers without rope (``no_rope_layers``);
* the mixtures of experts (Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral): the MLP of every sparse layer
  is a routed mixture of experts (``MoeSpec``; engine_worker.moe computes it), OLMoE's q/k norm
  over the whole projection as OLMo 2's.

Attention's own differences (softmax scale, soft-capped scores, sliding windows) are the
attention backend's, per layer; the rope's scaling and partial rotary are ``ModelConfig.rope``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GEMMA_TYPES = ("gemma2", "gemma3_text")
# Gemma3TextConfig's defaults, which a multimodal Gemma 3 checkpoint's text_config leaves out
GEMMA3_TEXT_DEFAULTS = {
    "model_type": "gemma3_text",
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
# A multimodal checkpoint's language model weights, under these prefixes (transformers 5 saves
# the first), and the prefixes of the rest (vision tower, projector), which a text model skips
TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model."}
TEXT_PREFIXES |= {"language_model.lm_head.": "lm_head."}
NON_TEXT_PREFIXES: tuple[str, ...] = ("vision_tower.", "model.vision_tower.")
NON_TEXT_PREFIXES += ("multi_modal_projector.", "model.multi_modal_projector.")
NORM_LAYOUTS = ("pre", "sandwich", "post")
MOE_TYPES = ("qwen2_moe", "qwen3_moe", "olmoe", "mixtral")
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
}


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A mixture-of-experts MLP, as the families above define it (transformers' reading): the
    router's softmax over ``num_experts`` logits, the ``top_k`` largest kept (renormalized to sum
    1 where ``normalize``), each chosen expert a gated MLP of ``expert_size`` whose output is
    weighted by its probability; plus, where ``shared_size`` > 0, a shared gated MLP every row
    runs, its output times sigmoid(x . shared gate) (Qwen2-MoE). ``dense_layers``: the layers
    whose MLP is a plain one of ``intermediate_size`` instead (Qwen's ``mlp_only_layers`` and
    ``decoder_sparse_step``)."""

    num_experts: int
    top_k: int
    expert_size: int
    normalize: bool
    shared_size: int = 0
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
                raise ValueError(f"the experts' {name} must be a positive integer, not {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) exceeds the number of experts "
                f"({self.num_experts})"
            )
        if not isinstance(self.shared_size, int) or self.shared_size < 0:
            raise ValueError(
                f"shared_expert_intermediate_size must be >= 0, not {self.shared_size!r}"
            )

    def sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture (else a plain MLP)."""
        return layer not in self.dense_layers


@dataclass(frozen=True, slots=True)
class ModelFeatures:
    # pre: a norm before attention and before the MLP (Llama); sandwich: also one after each
    # (Gemma); post: only the ones after (OLMo 2)
    norm_layout: str = "pre"
    norm_offset: float = 0.0  # added to every RMSNorm weight at load (Gemma's 1 + w)
    qk_norm_over_projection: bool = False  # OLMo 2: q/k norm over all heads at once
    activation: str = "silu"  # of the gated MLP: silu, gelu_tanh or gelu
    embedding_scale: float = 1.0  # the embedding's output times this
    round_embedding_scale: bool = False  # Gemma: the scale rounded to the activation dtype first
    residual_scale: float = 1.0  # each branch's output times this before the residual add
    logits_divisor: float = 1.0  # Granite's logits_scaling
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap) (Gemma 2); 0 = none
    # Per layer, which of ``ModelConfig.ropes`` it rotates with (-1: none); empty: the first,
    # for every layer
    layer_rope: tuple[int, ...] = ()
    moe: MoeSpec | None = None  # the sparse layers' MLP is a mixture of experts

    def __post_init__(self) -> None:
        if self.norm_layout not in NORM_LAYOUTS:
            raise ValueError(f"norm_layout must be one of {NORM_LAYOUTS}")
        if self.activation not in set(ACTIVATIONS.values()):
            raise ValueError(f"unknown activation {self.activation!r}")

    @property
    def plain(self) -> bool:
        return self == PLAIN_FEATURES

    def describe(self) -> str:
        """The fields that differ from the plain case, for logs."""
        return ", ".join(
            f"{name}={getattr(self, name)}"
            for name in self.__dataclass_fields__
            if getattr(self, name) != getattr(PLAIN_FEATURES, name)
        )


PLAIN_FEATURES = ModelFeatures()


def text_model_config(cfg: dict) -> dict:
    """A multimodal Gemma 3 checkpoint (``gemma3``: Gemma3ForConditionalGeneration) as its
    language model: ``text_config`` over Gemma3TextConfig's defaults; any other config as it
    is."""
    if cfg.get("model_type") != "gemma3" or "text_config" not in cfg:
        return cfg
    text = {**GEMMA3_TEXT_DEFAULTS, **cfg["text_config"], "model_type": "gemma3_text"}
    for key in ("eos_token_id", "tie_word_embeddings"):
        if key in cfg:
            text[key] = cfg[key]
    return text


def text_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name in a text model (a multimodal one's language model
    renamed), or None for the other parts of a multimodal checkpoint."""
    if name.startswith(NON_TEXT_PREFIXES):
        return None
    for prefix, replacement in TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name


def model_features(cfg: dict, model_type: str, num_layers: int) -> ModelFeatures:
    """The features of a config.json's model (``cfg``)."""
    gemma = model_type in GEMMA_TYPES
    act_name = cfg.get("hidden_activation") if gemma else None
    act_name = act_name or cfg.get("hidden_act") or "silu"
    if act_name not in ACTIVATIONS:
        raise ValueError(f"activation {act_name!r} is not supported ({', '.join(ACTIVATIONS)})")
    layout = "sandwich" if gemma else "post" if model_type == "olmo2" else "pre"
    embedding_scale = math.sqrt(cfg["hidden_size"]) if gemma else 1.0
    if model_type == "granite":
        embedding_scale = float(cfg.get("embedding_multiplier") or 1.0)
    return ModelFeatures(
        norm_layout=layout,
        norm_offset=1.0 if gemma else 0.0,
        qk_norm_over_projection=model_type in ("olmo2", "olmoe"),
        activation=ACTIVATIONS[act_name],
        embedding_scale=embedding_scale,
        round_embedding_scale=gemma,
        residual_scale=float(cfg.get("residual_multiplier") or 1.0),
        logits_divisor=float(cfg.get("logits_scaling") or 1.0),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
        layer_rope=_layer_rope(cfg, model_type, num_layers),
        moe=moe_spec(cfg, model_type, num_layers),
    )


def moe_spec(cfg: dict, model_type: str, num_layers: int) -> MoeSpec | None:
    """The mixture of a MoE family's config (None for a dense family, or a Qwen MoE config with
    no experts), with its config class's defaults for the keys it leaves out."""
    if model_type not in MOE_TYPES:
        return None
    if cfg.get("clip_qkv") is not None:  # OLMoE's option, off in its released checkpoints
        raise ValueError("clip_qkv (clamping q, k and v) is not supported")
    if model_type == "mixtral":
        return MoeSpec(
            num_experts=_expert_count(cfg, 8),
            top_k=cfg.get("num_experts_per_tok", 2),
            expert_size=cfg["intermediate_size"],
            normalize=True,
        )
    if model_type == "olmoe":
        return MoeSpec(
            num_experts=_expert_count(cfg, 64),
            top_k=cfg.get("num_experts_per_tok", 8),
            expert_size=cfg["intermediate_size"],
            normalize=bool(cfg.get("norm_topk_prob", False)),
        )
    qwen2 = model_type == "qwen2_moe"
    num_experts = _expert_count(cfg, 60 if qwen2 else 128)
    if not num_experts:
        return None
    step = cfg.get("decoder_sparse_step") or 1
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(num_layers) if i in only_mlp or (i + 1) % step)
    return MoeSpec(
        num_experts=num_experts,
        top_k=cfg.get("num_experts_per_tok", 4 if qwen2 else 8),
        expert_size=cfg.get("moe_intermediate_size", 1408 if qwen2 else 768),
        normalize=bool(cfg.get("norm_topk_prob", False)),
        shared_size=cfg.get("shared_expert_intermediate_size", 5632) if qwen2 else 0,
        dense_layers=dense,
    )


def _expert_count(cfg: dict, default: int) -> int:
    """``num_experts`` or ``num_local_experts`` (transformers 5 saves every family's count under
    the second, older checkpoints of Qwen-MoE and OLMoE under the first)."""
    for key in ("num_experts", "num_local_experts"):
        if key in cfg:
            return cfg[key]
    return default


def _layer_rope(cfg: dict, model_type: str, num_layers: int) -> tuple[int, ...]:
    """Per layer, its rope (0: ``ModelConfig.ropes[0]``, 1: the sliding layers' of Gemma 3;
    -1: none); empty where every layer has the first."""
    if model_type == "smollm3":
        flags = cfg.get("no_rope_layers")
        if flags is None:  # transformers' default: every ``no_rope_layer_interval``-th has none
            interval = cfg.get("no_rope_layer_interval") or 4
            flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
        ropes = tuple(0 if flag else -1 for flag in flags)
    elif model_type == "gemma3_text":
        ropes = tuple(1 if kind == "sliding_attention" else 0 for kind in layer_types(cfg))
    else:
        return ()
    if len(ropes) != num_layers:
        raise ValueError(f"per-layer rope settings list {len(ropes)} layers, not {num_layers}")
    return () if all(r == 0 for r in ropes) else ropes


def layer_types(cfg: dict) -> list[str]:
    """``layer_types`` as listed, else Gemma 3's default pattern (every
    ``sliding_window_pattern``-th layer global)."""
    types = cfg.get("layer_types")
    if types is not None:
        return list(types)
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
