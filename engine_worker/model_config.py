"""Reads a Hugging Face checkpoint's config.json (with json, not transformers) into what our
forward needs, and computes rotary inverse frequencies for the common rope scaling types.

Reading a config needs no torch (the supervisor checks a model with it before it starts any
engine); only the rope functions import it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from engine_worker.model_features import (
    MOE_TYPES,
    PLAIN_FEATURES,
    ModelFeatures,
    model_features,
    text_model_config,
)

SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3_text",
    "phi3",
    "smollm3",
    "granite",
    "olmo2",
    *MOE_TYPES,
)


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How one layer's attention differs from plain causal softmax(q.k / sqrt(head_dim)).

    ``window`` W > 0: a query at position p sees the keys at positions > p - W (W keys, its
    own included: transformers' sliding-window overlay), 0 = every earlier key; ``softcap`` C
    > 0: scores become C * tanh(scores / C) before the mask and the softmax (Gemma 2), 0 =
    none; ``scale``: what q.k is multiplied by (None: head_dim ** -0.5)."""

    window: int = 0
    softcap: float = 0.0
    scale: float | None = None

    @property
    def plain(self) -> bool:
        return self == PLAIN_ATTENTION


PLAIN_ATTENTION = LayerAttention()


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Qwen3)
    # One per layer (empty: every layer plain): sliding windows, soft-capping, softmax scale
    layer_attention: tuple[LayerAttention, ...] = ()
    rope: dict = field(default_factory=dict)  # rope_theta, rope_type and scaling parameters
    eos_token_ids: set[int] = field(default_factory=set)
    features: ModelFeatures = PLAIN_FEATURES  # how the decoder differs from Llama's
    # Every rope the layers use (features.layer_rope picks per layer); empty: ``rope`` alone
    ropes: tuple[dict, ...] = ()

    def __post_init__(self) -> None:
        _check_values(self)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    def attention_of(self, layer: int) -> LayerAttention:
        return self.layer_attention[layer] if self.layer_attention else PLAIN_ATTENTION

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        config_file = model_dir / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json")
        cfg = json.loads(config_file.read_text())
        if not isinstance(cfg, dict):
            raise ValueError(f"{config_file} is not a JSON object")
        cfg = text_model_config(cfg)
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        eos = _as_id_set(cfg.get("eos_token_id"))
        generation_file = model_dir / "generation_config.json"
        if generation_file.is_file():
            eos |= _as_id_set(json.loads(generation_file.read_text()).get("eos_token_id"))
        try:
            return cls._from_dict(cfg, model_type, eos)
        except KeyError as exc:
            raise ValueError(f"{config_file} has no {exc.args[0]!r}") from None
        except (TypeError, AttributeError) as exc:  # a field of the wrong JSON type
            raise ValueError(f"{config_file} has a field of the wrong type ({exc})") from None

    @classmethod
    def _from_dict(cls, cfg: dict, model_type: str, eos: set[int]) -> ModelConfig:
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=_attention_bias(cfg, model_type),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
            layer_attention=_layer_attention(cfg, cfg["num_hidden_layers"], model_type),
            rope=_rope_parameters(cfg),
            eos_token_ids=eos,
            features=model_features(cfg, model_type, cfg["num_hidden_layers"]),
            ropes=_layer_ropes(cfg, model_type),
        )


_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# ModelConfig's sizes and their config keys
_SIZES = dict(vocab_size="vocab_size", hidden_size="hidden_size", num_layers="num_hidden_layers")
_SIZES.update(intermediate_size="intermediate_size", num_heads="num_attention_heads")
_SIZES.update(num_kv_heads="num_key_value_heads", head_dim="head_dim")
_SIZES.update(max_position_embeddings="max_position_embeddings")


def _check_values(config: ModelConfig) -> None:
    """Refuses, with the config key's name, what no forward can run: sizes that are not positive
    integers, an odd head_dim (rope rotates pairs), a norm epsilon, soft-cap, softmax scale or
    rope base that is not a finite number of the right sign, a rope type we do not compute,
    LongRoPE without its factors."""
    for attr, key in _SIZES.items():
        value = getattr(config, attr)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
            raise ValueError(f"{key} must be a positive integer below 2**31, not {value!r}")
    if config.head_dim % 2:
        raise ValueError(f"head_dim must be even (rope rotates pairs), not {config.head_dim}")
    if not _finite(config.rms_norm_eps) or config.rms_norm_eps < 0:
        raise ValueError(f"rms_norm_eps must be a finite number >= 0, not {config.rms_norm_eps!r}")
    for a in config.layer_attention:  # sliding_window, soft-cap, query_pre_attn_scalar
        scale = 1.0 if a.scale is None else a.scale
        if a.window < 0 or not _finite(a.softcap) or a.softcap < 0 or not _positive(scale):
            raise ValueError(f"the attention settings are not valid: {a}")
    for rope in config.ropes or (config.rope,):
        if rope:  # empty: built in code, not read from a config
            _check_rope(rope, config.head_dim)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: object) -> bool:
    return _finite(value) and value > 0  # type: ignore[operator]


def _check_rope(rope: dict, head_dim: int) -> None:
    if rope["rope_type"] not in _ROPE_TYPES:
        raise ValueError(
            f"rope type {rope['rope_type']!r} is not supported "
            f"(supported: {', '.join(_ROPE_TYPES)})"
        )
    theta = rope["rope_theta"]
    if not _positive(theta):
        raise ValueError(f"rope_theta must be a finite positive number, not {theta!r}")
    factor = rope.get("partial_rotary_factor", 1.0)
    if not _positive(factor) or factor > 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], not {factor!r}")
    if rope["rope_type"] == "longrope":
        pairs = int(head_dim * factor) // 2
        for key in ("short_factor", "long_factor"):
            got = rope.get(key)
            if not isinstance(got, list) or len(got) != pairs:
                raise ValueError(
                    f"LongRoPE needs {key}: a list of {pairs} numbers (one per rotary pair)"
                )
            if not all(_positive(v) for v in got):
                raise ValueError(f"LongRoPE's {key} holds a value that is not a positive number")


def _layer_attention(cfg: dict, num_layers: int, model_type: str) -> tuple[LayerAttention, ...]:
    """Each layer's ``LayerAttention`` from the config's keys, as transformers reads them."""
    windows = _layer_windows(cfg, num_layers, model_type)
    softcap = float(cfg.get("attn_logit_softcapping") or 0.0)
    scale = None
    if cfg.get("query_pre_attn_scalar"):  # Gemma
        scale = float(cfg["query_pre_attn_scalar"]) ** -0.5
    elif cfg.get("attention_multiplier"):  # Granite
        scale = float(cfg["attention_multiplier"])
    layers = tuple(LayerAttention(w, softcap, scale) for w in windows)
    return () if all(layer.plain for layer in layers) else layers


def _layer_windows(cfg: dict, num_layers: int, model_type: str) -> list[int]:
    """Per layer: the sliding window, or 0. ``layer_types`` where the config lists them, else
    the defaults transformers gives each family."""
    window = int(cfg.get("sliding_window") or 0)
    # A window as long as the model's context hides nothing (the tiny test models' 4096)
    wider = window >= cfg.get("max_position_embeddings", 2048)
    if not window or wider or not cfg.get("use_sliding_window", True):
        return [0] * num_layers
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
        return [window if t == "sliding_attention" else 0 for t in types]
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        first = cfg.get("max_window_layers", num_layers)
        return [window if i >= first else 0 for i in range(num_layers)]
    if model_type == "gemma2":
        return [window if (i + 1) % 2 else 0 for i in range(num_layers)]
    if model_type in ("gemma3", "gemma3_text"):
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        return [window if (i + 1) % pattern else 0 for i in range(num_layers)]
    return [window] * num_layers  # mistral: every layer


def _attention_bias(cfg: dict, model_type: str) -> bool:
    """Whether q, k and v carry a bias: Qwen2's always, Qwen2-MoE's by ``qkv_bias``."""
    key = "qkv_bias" if model_type == "qwen2_moe" else "attention_bias"
    return bool(cfg.get(key, model_type in ("qwen2", "qwen2_moe")))


def _as_id_set(value) -> set[int]:
    values = [] if value is None else [value] if isinstance(value, int) else value
    return {int(v) for v in values}


def _layer_ropes(cfg: dict, model_type: str) -> tuple[dict, ...]:
    """Gemma 3: the global layers' rope, then the sliding layers' (``rope_parameters`` by layer
    type in transformers 5, ``rope_local_base_freq`` before); others: none beside ``rope``."""
    if model_type != "gemma3_text":
        return ()
    nested = cfg.get("rope_parameters") or {}
    local = nested.get("sliding_attention") or {
        "rope_type": "default",
        "rope_theta": cfg.get("rope_local_base_freq", 10000.0),
    }
    return _rope_parameters(cfg), _rope_parameters(cfg, dict(local))


def _rope_parameters(cfg: dict, params: dict | None = None) -> dict:
    """Merges transformers 5's ``rope_parameters`` (the global layers' where it is given per
    layer type) with the older ``rope_theta`` and ``rope_scaling``; ``params``: one layer
    type's own instead."""
    if params is None:
        nested = cfg.get("rope_parameters") or {}
        params = dict(cfg.get("rope_scaling") or {})
        params.update(nested.get("full_attention") or nested)
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = "longrope" if rope_type == "su" else rope_type
    if rope_type in ("longrope", "su") and cfg.get("original_max_position_embeddings"):
        # Phi-3 keeps it beside the rope settings, and there it wins (as in transformers)
        params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    params.setdefault(
        "original_max_position_embeddings",
        cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048),
    )
    params["max_position_embeddings"] = cfg.get("max_position_embeddings", 2048)
    params.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return params


def rope_inverse_frequencies(
    rope: dict, head_dim: int, max_positions: int = 0
) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [rotary dims / 2] float32, attention scaling applied to cos/sin).
    ``max_positions``: the context served, which picks longrope's factors."""
    import torch

    base = float(rope["rope_theta"])
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = rope["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(rope.get("factor", 1.0))
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "dynamic":
        # Dynamic NTK only changes the base once a sequence exceeds the original context; within
        # it the frequencies are the default ones. We apply the scaled base statically when the
        # configured context is longer, which is what a long-context deployment needs.
        original = rope["original_max_position_embeddings"]
        max_len = rope["max_position_embeddings"]
        if max_len > original:
            scaled = base * ((factor * max_len / original) - (factor - 1)) ** (dim / (dim - 2))
            inv_freq = 1.0 / (scaled**exponents)
        return inv_freq, 1.0
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, rope, factor), 1.0
    if rope_type == "yarn":
        return _yarn_frequencies(rope, base, dim, factor)
    if rope_type == "longrope":
        return _longrope_frequencies(rope, base, exponents, max_positions)
    raise ValueError(f"rope type {rope_type!r} is not supported")


def _llama3_frequencies(inv_freq: torch.Tensor, rope: dict, factor: float) -> torch.Tensor:
    import torch

    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    low_freq_factor = float(rope.get("low_freq_factor", 1.0))
    high_freq_factor = float(rope.get("high_freq_factor", 4.0))
    original = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def _longrope_frequencies(rope: dict, base: float, exponents: torch.Tensor, max_positions: int):
    """Phi-3's LongRoPE: per-frequency divisors, the long ones where the served context exceeds
    the original one (as llama.cpp decides, once: transformers switches per forward on the
    sequence's length, which would rotate one sequence's keys two ways), the short ones else;
    cos/sin scaled by sqrt(1 + ln(s) / ln(original)), s = context / original."""
    import torch

    original = int(rope["original_max_position_embeddings"])
    long = max_positions > original
    divisors = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
    factor = rope.get("factor") or rope["max_position_embeddings"] / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0
        if factor > 1.0:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0 / (divisors * base**exponents), float(attention_factor)


def _yarn_frequencies(rope: dict, base: float, dim: int, factor: float):
    import torch

    original = float(rope["original_max_position_embeddings"])
    beta_fast = float(rope.get("beta_fast") or 32.0)
    beta_slow = float(rope.get("beta_slow") or 1.0)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention_factor = mscale(factor, rope["mscale"]) / mscale(
                factor, rope["mscale_all_dim"]
            )
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep_extrapolated = 1 - ramp
    inv_freq = interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated
    return inv_freq, float(attention_factor)
