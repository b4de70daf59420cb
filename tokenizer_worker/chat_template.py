"""Renders a model's chat template with jinja2, the way Hugging Face tokenizers do, without
importing ``transformers`` (the tokenizer process loads only the ``tokenizers`` library).

The template comes from ``chat_template.jinja`` or the ``chat_template`` key of
``tokenizer_config.json``; the special-token strings it may reference (``bos_token`` ...) come from
``tokenizer_config.json``. Rendering runs in jinja2's immutable sandbox: templates ship with
checkpoints and are not trusted code.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The template is missing or raised while rendering (e.g. an unsupported role order)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Hugging Face templates expect non-ASCII kept as is (jinja's own tojson escapes HTML).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token_string(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        self.source = source
        self.special_tokens = special_tokens

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, override: str = "") -> ChatTemplate | None:
        """None when the model has no chat template (chat requests are then rejected).
        ``override``: a template's text that replaces the model's own (the special tokens
        still come from the model)."""
        model_dir = Path(model_dir)
        config = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        special = {k: s for k in SPECIAL_TOKEN_KEYS if (s := _token_string(config.get(k)))}
        source = override or None
        jinja_path = model_dir / "chat_template.jinja"
        if source is None and jinja_path.is_file():
            source = jinja_path.read_text()
        elif source is None:
            raw = config.get("chat_template")
            if isinstance(raw, list):  # named templates: take "default"
                named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
                raw = named.get("default")
            if isinstance(raw, str):
                source = raw
        return cls(source, special) if source else None

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """``extra``: the request's chat_template_kwargs (e.g. ``enable_thinking``); the
        variables the request states itself (messages, add_generation_prompt, tools) always win.
        ``tools``: for a template that renders them (tokenizer_worker.tool_calls)."""
        variables = {
            **self.special_tokens,
            **(extra or {}),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "documents": None,
        }
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed to render: {exc}") from None
