"""The peer benchmark's chat requests: real English prose (the Python standard library's own
docstrings, present wherever Python is), a distinct passage per request, cut so the templated
prompt is a chosen number of tokens long."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

# Modules whose docstrings are mostly prose; a fixed list keeps the corpus the same in every run
# on one Python version (and close across versions).
CORPUS_MODULES = (
    "argparse asyncio collections concurrent.futures contextlib csv dataclasses datetime decimal "
    "email enum fractions functools heapq http.client inspect itertools json logging pathlib "
    "queue random re shutil socket sqlite3 statistics string subprocess tarfile threading "
    "textwrap unittest urllib.parse uuid zipfile"
).split()
INSTRUCTION = "Summarize the following passage in a few sentences.\n\n"


def prose_paragraphs() -> list[str]:
    """Paragraphs of plain prose (no code examples, mostly letters) from stdlib docstrings."""
    out: list[str] = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        docs = [module.__doc__ or ""]
        docs += [
            obj.__doc__ or ""
            for attr, obj in sorted(vars(module).items())
            if not attr.startswith("_")
            and (inspect.isfunction(obj) or inspect.isclass(obj))
            and getattr(obj, "__module__", "") == module.__name__
        ]
        for doc in docs:
            for para in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
                para = " ".join(para.split())
                if len(para) < 120 or ">>>" in para:
                    continue
                if sum(c.isalpha() or c in " .,;" for c in para) / len(para) >= 0.93:
                    out.append(para)
    return out


class PromptCounter:
    """Counts a chat's prompt tokens as the servers will: the model's own chat template rendered
    and encoded with its own tokenizer (splitserve's code for both); the default model's."""

    def __init__(self, model_dir: str | Path | None = None) -> None:
        from tokenizers import Tokenizer

        from procs.model_store import resolve_model
        from tokenizer_worker.chat_template import ChatTemplate

        model_dir = resolve_model(model_dir)

        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.template = ChatTemplate.from_model_dir(model_dir)
        if self.template is None:
            raise ValueError(f"{model_dir} has no chat template")

    def count(self, messages: list[dict[str, str]]) -> int:
        text = self.template.render(messages, add_generation_prompt=True)
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def cut(self, text: str, n_tokens: int) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.tokenizer.decode(ids[: max(0, n_tokens)]).strip()


def chat_messages(index: int, passage: str) -> list[dict[str, str]]:
    # The request number opens the prompt, so no two requests share more than the template's
    # first few tokens (no prefix-cache wins for either server).
    return [
        {"role": "system", "content": f"Request {index}. You are a helpful assistant."},
        {"role": "user", "content": INSTRUCTION + passage},
    ]


def build_chats(
    counter: PromptCounter, count: int, prompt_tokens: int, start: int = 0
) -> list[list[dict[str, str]]]:
    """``count`` chats of exactly ``prompt_tokens`` templated tokens where the text allows (the
    last token of a cut can merge with the template's next one: then one off), each passage
    starting at a different paragraph of the corpus; ``start`` numbers them (distinct runs)."""
    paragraphs = prose_paragraphs()
    if not paragraphs:
        raise RuntimeError("no prose found in the standard library's docstrings")
    chats = []
    for k in range(count):
        index = start + k
        first = (index * 7) % len(paragraphs)  # a stride, so neighbours differ more than by one
        passage, j = "", first
        while len(counter.tokenizer.encode(passage).ids) < prompt_tokens:
            passage = f"{passage} {paragraphs[j % len(paragraphs)]}".strip()
            j += 1
        overhead = counter.count(chat_messages(index, ""))
        if overhead >= prompt_tokens:
            raise ValueError(
                f"--prompt-tokens {prompt_tokens} leaves no room for text: the chat "
                f"template and instruction alone take {overhead} tokens"
            )
        want = prompt_tokens - overhead
        for _ in range(4):  # a cut can tokenize one longer or shorter in context: adjust
            messages = chat_messages(index, counter.cut(passage, want))
            got = counter.count(messages)
            if got == prompt_tokens:
                break
            want += prompt_tokens - got
        chats.append(messages)
    return chats
