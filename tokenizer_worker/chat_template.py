"""Renders a model's chat template with jinja2, the way Hugging Face tokenizers do, without
importing ``transformers`` (the tokenizer process loads only the ``tokenizers`` library).

The template comes from ``chat_template.jinja`` or the ``chat_template`` key of
``tokenizer_config.json``; the special-token strings it may reference (``bos_token`` ...) come from
``tokenizer_config.json``. Rendering runs in jinja2's immutable sandbox: templates ship with
checkpoints and are not trusted code. The sandbox bounds no work, so rendering also has a budget
(``RENDER_BUDGET_S`` of time, ``MAX_TEMPLATE_CHARS`` per string): a template that loops or
builds a huge string is refused (``ChatTemplateError``) rather than wedging its tokenizer.
"""

from __future__ import annotations

import contextvars
import json
import operator
import time
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


RENDER_BUDGET_S = 5.0
MAX_TEMPLATE_CHARS = 64 * 2**20  # far past any context; a 7 MB prompt renders
_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("deadline", default=float("inf"))


class ChatTemplateError(ValueError):
    """The template is missing or raised while rendering (e.g. an unsupported role order)."""


def _check_budget(value: Any = None) -> Any:
    if time.monotonic() > _deadline.get():
        raise ChatTemplateError(f"the chat template ran past its {RENDER_BUDGET_S:g} s budget")
    if isinstance(value, str | list | tuple):
        _check_length(len(value))
    return value


def _check_length(length: int) -> None:
    if length > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"the chat template built a value over {MAX_TEMPLATE_CHARS} long")


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    """Checks the render's budget at every call, attribute, item and arithmetic operator (a loop
    that never does one of these runs at most jinja's ``MAX_RANGE`` times); refuses ``*`` and
    ``**`` whose result would be over-long before computing it."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_budget()
        return _check_budget(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        return _check_budget(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return _check_budget(super().getitem(obj, argument))

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        _check_budget()
        if operator_ == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int):
                    _check_length(len(seq) * times)
        if operator_ == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right * abs(left).bit_length() > 4096:
                raise ChatTemplateError("the chat template computes an over-large number")
        return _check_budget(_BINOPS[operator_](left, right))


_BINOPS = {"*": operator.mul, "**": operator.pow, "+": operator.add}


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
        env = _BudgetedSandbox(
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
        token = _deadline.set(time.monotonic() + RENDER_BUDGET_S)
        try:
            out, size = [], 0
            for chunk in self._template.generate(**variables):
                size += len(_check_budget(chunk))
                _check_length(size)
                out.append(chunk)
            return "".join(out)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed to render: {exc}") from None
        except (OverflowError, MemoryError, RecursionError) as exc:
            raise ChatTemplateError(f"the chat template failed to render: {exc!r}") from None
        finally:
            _deadline.reset(token)
