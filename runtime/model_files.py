"""Reading a model directory's files, for the processes that need more than the weights: the
tokenizer (tokenizer workers and the detokenizer; never the engine)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    """The HF ``tokenizers`` Tokenizer of a model directory (never transformers)."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
    return Tokenizer.from_file(str(path))
