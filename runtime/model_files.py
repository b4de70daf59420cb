"""Reading a model directory's files: the tokenizer (tokenizer workers and the detokenizer; never
the engine), and which GGUF files hold the weights (the engine and the supervisor)."""

from __future__ import annotations

import re
import sys
from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    """The HF ``tokenizers`` Tokenizer of a model directory (never transformers)."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
    return Tokenizer.from_file(str(path))


def tokenizer_modules_loaded() -> list[str]:
    """Tokenization modules this process has imported (the engine's must stay empty)."""
    return sorted(
        m
        for m in sys.modules
        if m == "tokenizers"
        or m.startswith("tokenizers.")
        or m.startswith("transformers.tokenization")
    )


# llama.cpp's split layout (gguf-split, and the gguf package's writer): NAME-00001-of-00003.gguf
# and so on, the metadata in the first part, the tensors spread over all of them.
SPLIT_GGUF_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def gguf_parts(path: str | Path) -> list[Path]:
    """The files of the GGUF checkpoint ``path`` begins: [path] for a whole file, every part in
    order for a split one. ValueError for a later part or a missing one."""
    path = Path(path)
    m = SPLIT_GGUF_NAME.match(path.name)
    if m is None:
        return [path]
    no, count = int(m["no"]), int(m["count"])
    parts = [
        path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    ]
    if no != 1:
        raise ValueError(
            f"{path} is part {no} of {count} of a split GGUF: give its first part "
            f"({parts[0].name}) or its directory"
        )
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ValueError(f"{path} is split in {count} parts, but {', '.join(missing)} is missing")
    return parts


def gguf_stem(path: str | Path) -> str:
    """A GGUF checkpoint's name: the file's stem, without a split file's -00001-of-0000N."""
    m = SPLIT_GGUF_NAME.match(Path(path).name)
    return m["stem"] if m else Path(path).stem


def gguf_weights(model_dir: str | Path) -> list[Path]:
    """The GGUF files of a directory's checkpoint: none, one, or the parts of one split file in
    order. ValueError when the directory holds several that are not one checkpoint's parts."""
    found = sorted(Path(model_dir).glob("*.gguf"))
    if len(found) <= 1:
        return found
    firsts = [p for p in found if (m := SPLIT_GGUF_NAME.match(p.name)) and int(m["no"]) == 1]
    if len(firsts) == 1 and sorted(parts := gguf_parts(firsts[0])) == found:
        return parts
    raise ValueError(
        f"{model_dir} holds {len(found)} GGUF files that are not the parts of one checkpoint "
        f"({', '.join(p.name for p in found)}): give the one to serve as --model"
    )
