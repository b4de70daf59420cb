"""A small random-weight model with the default model's tokenizer, for fast tests and for
benchmarks that need an engine far faster than the real model (real tokenizer, real engine code,
a model whose step costs milliseconds).

    python -m tests.tiny_model OUT_DIR --num-layers 2 --hidden-size 64
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from procs.model_store import ensure_default_model

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


def make_tiny_model(
    out_dir: str | os.PathLike,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    seed: int = 0,
    architecture: str = "llama",
    max_position_embeddings: int = 2048,
    **config_overrides,
) -> Path:
    """Writes the model to ``out_dir`` (a Hugging Face directory) and returns its path;
    ``config_overrides``: more config fields (a ``sliding_window``, ...)."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = ensure_default_model()
    common = dict(
        vocab_size=49152,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[architecture]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common, **config_overrides)).to(torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m tests.tiny_model", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("out_dir", help="where to write the model directory")
    p.add_argument("--num-layers", type=int, default=2, help="decoder layers (default: 2)")
    p.add_argument(
        "--hidden-size",
        type=int,
        default=64,
        help="hidden size; 4 attention heads, 2 KV heads (default: 64)",
    )
    p.add_argument("--architecture", choices=ARCHITECTURES, default="llama")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--max-position-embeddings",
        type=int,
        default=2048,
        help="the context length the model declares, in tokens (default: 2048)",
    )
    args = p.parse_args(argv)
    print(
        make_tiny_model(
            args.out_dir,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            seed=args.seed,
            architecture=args.architecture,
            max_position_embeddings=args.max_position_embeddings,
        )
    )


if __name__ == "__main__":
    main()
