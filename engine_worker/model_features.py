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
* SmolLM3: some layers without rope (``no_rope_layers``).

Attention's own differences (softmax scale, soft-capped scores, sliding windows) are the
attention backend's, per layer; the rope's scaling and partial rotary are ``ModelConfig.rope``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GEMMA_TYPES = ("gemma2", "gemma3_text")
NORM_LAYOUTS = ("pre", "sandwich", "post")
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
}


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
        qk_norm_over_projection=model_type == "olmo2",
        activation=ACTIVATIONS[act_name],
        embedding_scale=embedding_scale,
        round_embedding_scale=gemma,
        residual_scale=float(cfg.get("residual_multiplier") or 1.0),
        logits_divisor=float(cfg.get("logits_scaling") or 1.0),
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
        layer_rope=_layer_rope(cfg, model_type, num_layers),
    )


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
    pattern = cfg.get("sliding_window_pattern") or 6
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
