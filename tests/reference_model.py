"""The checkpoint as a ``transformers`` model: the reference the engine's numbers are checked
against."""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM

from procs.model_store import gguf_file


def load_reference_model(model_dir: str | os.PathLike, dtype=None):
    """A GGUF directory is dequantized to float32 on the way in, as transformers does."""
    gguf = gguf_file(model_dir)
    extra = {"gguf_file": gguf.name} if gguf else {}
    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype or torch.float32, **extra
    ).eval()
