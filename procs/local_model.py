"""What ``--model`` may name, resolved to a directory every process reads.

* A Hugging Face checkpoint directory (config.json, tokenizer.json, *.safetensors or a GGUF):
  used as it is.
* A GGUF file (or the first part of a split one, NAME-00001-of-0000N.gguf): its config,
  tokenizer, chat template and end-of-sequence ids come from its metadata (read by
  ``transformers``, once), written into a directory under the model cache beside links to the
  file's parts. The weights are never copied or dequantized: the engine reads the parts through
  the links. The cache key is each part's path, size and modification time, so a changed file is
  read again.
* A directory holding one GGUF checkpoint: the same, and its own config.json and tokenizer
  files, where it has them, win over the metadata.

The served name is the file's stem (a directory's name for a directory): the last part of the
resolved directory's path. Anything else is refused with one line (``ModelError``).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from runtime.model_files import gguf_parts, gguf_stem, gguf_weights

logger = logging.getLogger("splitserve.model_store")

GGUF_MAGIC = b"GGUF"
_COMPLETE_MARKER = ".splitserve-complete"
_ONE_READER = threading.Lock()  # see _metadata_read_once
_LAYOUT_VERSION = 1  # part of the cache key: a change to what is written here reads files again
# A directory's own files that win over what a GGUF's metadata gives.
HF_METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
WHAT_MODEL_TAKES = (
    "--model takes a .gguf file, a directory holding one GGUF checkpoint, or a Hugging Face "
    "checkpoint directory"
)


class ModelError(ValueError):
    """A model the launch cannot serve; the message is one line for the user."""


def resolve_local(model: str | os.PathLike, cache_dir: Path) -> Path:
    """The directory the processes read for ``model``: the model itself for a Hugging Face
    directory, else one made under ``cache_dir`` (see the module's doc)."""
    # Absolute: the workers start in another working directory (a relative --model, or
    # $SPLITSERVE_CACHE, passed the supervisor's check and then was not found by the engine).
    path, cache_dir = Path(model).expanduser().absolute(), Path(cache_dir).expanduser().absolute()
    if not path.exists():
        raise ModelError(f"--model {str(model)!r}: no such file or directory")
    if path.is_dir():
        return _from_directory(path, cache_dir)
    _check_magic(path)
    return _from_gguf(path, cache_dir, overlay=None, name=gguf_stem(path))


def _from_directory(path: Path, cache_dir: Path) -> Path:
    try:
        ggufs = gguf_weights(path)
    except ValueError as exc:
        raise ModelError(str(exc)) from None
    has_config = (path / "config.json").is_file()
    if has_config and (path / "tokenizer.json").is_file():
        return path
    if ggufs:
        _check_magic(ggufs[0])
        return _from_gguf(ggufs[0], cache_dir, overlay=path, name=path.resolve().name)
    if has_config:
        raise ModelError(f"--model {str(path)!r} has a config.json but no tokenizer.json")
    raise ModelError(
        f"--model {str(path)!r} holds no model (no .gguf file, no config.json): {WHAT_MODEL_TAKES}"
    )


MAX_SERVED_NAME = 256


def check_served_name(name: str | None) -> None:
    """``--served-model-name``: empty (the default name), or up to ``MAX_SERVED_NAME``
    printable characters, not all blank: control and bidi-override characters would reach
    /v1/models, every response, the metrics' labels and the logs as they are."""
    if not name:
        return
    if len(name) > MAX_SERVED_NAME or not name.isprintable() or not name.strip():
        raise ModelError(
            f"--served-model-name {name[:40]!r}{'...' if len(name) > 40 else ''} must be 1 to "
            f"{MAX_SERVED_NAME} printable characters, not all blank"
        )


def _check_magic(path: Path) -> None:
    with open(path, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        raise ModelError(f"--model {str(path)!r} is not a GGUF file: {WHAT_MODEL_TAKES}")


def check_model(model_dir: str | os.PathLike) -> None:
    """What the supervisor checks before it starts an engine, from the files alone (no torch):
    the config (architecture supported, the fields the forward needs), a tokenizer, weights."""
    from engine_worker.model_config import ModelConfig

    model_dir = Path(model_dir)
    try:
        config = ModelConfig.from_dir(model_dir)
        ggufs = gguf_weights(model_dir)
    except (ValueError, OSError) as exc:
        raise ModelError(f"{model_dir}: {exc}") from None
    if not (model_dir / "tokenizer.json").is_file():
        raise ModelError(f"{model_dir} has no tokenizer.json")
    _check_vocabulary(model_dir, config.vocab_size)
    if not ggufs and not any(model_dir.glob("*.safetensors")):
        raise ModelError(f"{model_dir} has no weights (*.safetensors or *.gguf)")
    for part in ggufs:
        _check_magic(part)


def _check_vocabulary(model_dir: Path, vocab_size: int) -> None:
    """A tokenizer with ids past the model's vocab_size would have every request refused."""
    from tokenizers import Tokenizer

    try:
        tokens = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size(True)
    except Exception as exc:  # noqa: BLE001 - whatever the user's file made it raise
        raise ModelError(f"{model_dir}/tokenizer.json cannot be read ({exc})") from None
    if tokens > vocab_size:
        raise ModelError(
            f"{model_dir}: the tokenizer has {tokens} tokens, the model's vocab_size is only "
            f"{vocab_size}"
        )


def _cache_key(files: list[Path]) -> str:
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    blob = json.dumps([_LAYOUT_VERSION, stats]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _from_gguf(first: Path, cache_dir: Path, *, overlay: Path | None, name: str) -> Path:
    try:
        parts = gguf_parts(first)
    except ValueError as exc:
        raise ModelError(str(exc)) from None
    for part in parts[1:]:
        _check_magic(part)
    own = [overlay / f for f in HF_METADATA_FILES if overlay and (overlay / f).is_file()]
    entry = cache_dir / _cache_key(parts + own)
    target = entry / name
    if (target / _COMPLETE_MARKER).is_file():
        return target
    entry.mkdir(parents=True, exist_ok=True)
    with open(entry / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one reader of a file at a time
        if (target / _COMPLETE_MARKER).is_file():
            return target
        logger.warning("reading config, tokenizer and chat template from %s (once)", first)
        with tempfile.TemporaryDirectory(prefix="staging-", dir=entry) as tmp:
            staging = Path(tmp) / name
            try:
                write_hf_metadata(first, staging, name)
            except ModelError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever the user's file made it raise
                raise ModelError(f"{first}: cannot read its metadata ({exc})") from None
            for f in own:
                shutil.copy(f, staging / f.name)
            for part in parts:
                (staging / part.name).symlink_to(part.resolve())
            (staging / _COMPLETE_MARKER).write_text("ok\n")
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
    return target


def write_hf_metadata(gguf_path: Path, out_dir: Path, name: str) -> None:
    """config.json, tokenizer files, chat template and generation config of a GGUF checkpoint
    (the first file of a split one), from its metadata (no tensor is read)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    header = _read_header(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    # transformers also reads the files beside the GGUF (a tokenizer_config.json there hid the
    # file's chat template): it is given a directory holding nothing but a link to the file.
    with tempfile.TemporaryDirectory(prefix="splitserve-gguf-") as alone, _metadata_read_once():
        (Path(alone) / gguf_path.name).symlink_to(gguf_path.resolve())
        tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file=gguf_path.name)
        config = AutoConfig.from_pretrained(alone, gguf_file=gguf_path.name).to_dict()
    for key in ("quantization_config", "_name_or_path", "torch_dtype", "dtype"):
        config.pop(key, None)
    config["_name_or_path"] = name
    config.update(header["experts"])
    config["architectures"] = causal_lm_architectures(config.get("model_type", ""))
    # transformers looks for the untied head in the first file only; a split file may hold it
    # in any part.
    config["tie_word_embeddings"] = "output.weight" not in header["tensors"]
    # Older transformers read rope_theta at the top level, newer ones rope_parameters.
    rope = config.get("rope_parameters") or {}
    if config.get("rope_theta") is None and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    tokenizer.save_pretrained(str(out_dir))
    eos = config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    eos_ids += [i for i in header["end_ids"] if i not in eos_ids]
    gen = GenerationConfig(
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids or None,
        pad_token_id=config.get("pad_token_id"),
    )
    gen.save_pretrained(str(out_dir))


@contextlib.contextmanager
def _metadata_read_once() -> Iterator[None]:
    """AutoTokenizer and AutoConfig each parse the whole metadata (for most architectures
    through ``load_gguf_checkpoint``, which reads every field, the 49,152-entry vocabulary and
    merge table included: seconds each); inside this block the second call gets a copy of the
    first's result, and that one parses through our reader class (the gguf package's reader
    over a plain buffer: a third of its time). One block at a time in a process: each puts the
    functions it found back."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as readers

    from engine_worker.gguf_tensors import _reader_class

    read: dict[tuple, dict] = {}

    def load_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return load(path, return_tensors, **kwargs)
        key = (os.path.realpath(path), os.stat(path).st_mtime_ns)
        if key not in read:
            read[key] = load(path, return_tensors=False)
        return copy.deepcopy(read[key])

    with _ONE_READER:
        load, gguf_reader = readers.load_gguf_checkpoint, gguf.GGUFReader
        readers.load_gguf_checkpoint, gguf.GGUFReader = load_once, _reader_class()
        try:
            yield
        finally:
            readers.load_gguf_checkpoint, gguf.GGUFReader = load, gguf_reader


def causal_lm_architectures(model_type: str) -> list[str]:
    """The ``architectures`` entry transformers' own checkpoints of ``model_type`` carry."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return [found] if found else []


def _read_header(first: Path) -> dict:
    """What transformers does not take from a GGUF: every part's tensor names, the ids that
    also end a turn (llama.cpp's end-of-turn and end-of-message tokens), a mixture of experts'
    config keys (``_expert_keys``). The first part, which holds the vocabulary, is read by
    transformers' metadata reader (it steps over the string arrays without decoding them: 0.04 s
    for the default model, the gguf package's reader 2-3 s); the other parts hold only tensors
    and are read whole."""
    from transformers.integrations.gguf import read_gguf_metadata

    from engine_worker.gguf_tensors import open_reader

    parts = gguf_parts(first)
    try:
        metadata, names = read_gguf_metadata(str(first))
        readers = [open_reader(part) for part in parts[1:]]
    except (ValueError, IndexError, OSError, EOFError, struct.error) as exc:
        raise ModelError(
            f"{first} is not a readable GGUF file, truncated or corrupt ({exc})"
        ) from None
    keys = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    end_ids = [int(metadata[key]) for key in keys if key in metadata]
    tensors = set(names) | {t.name for r in readers for t in r.tensors}
    return {"tensors": tensors, "end_ids": end_ids, "experts": _expert_keys(metadata)}


def _expert_keys(metadata: dict) -> dict:
    """A mixture of experts' keys that transformers' reading of a GGUF leaves out: the experts'
    own sizes (``{arch}.expert_feed_forward_length``, Qwen2-MoE's shared expert's), and for a
    Mixtral file (llama.cpp writes it as a "llama" with experts) the model type itself."""

    def number(key: str) -> int:
        return int(metadata.get(key) or 0)

    arch = str(metadata.get("general.architecture", ""))
    count, used = number(f"{arch}.expert_count"), number(f"{arch}.expert_used_count")
    if not count:
        return {}
    if arch == "llama":
        return {"model_type": "mixtral", "num_local_experts": count, "num_experts_per_tok": used}
    keys = {"num_experts": count, "num_experts_per_tok": used}
    if number(f"{arch}.expert_feed_forward_length"):
        keys["moe_intermediate_size"] = number(f"{arch}.expert_feed_forward_length")
    if arch == "qwen2moe":
        keys["shared_expert_intermediate_size"] = number(
            f"{arch}.expert_shared_feed_forward_length"
        )
    return keys
