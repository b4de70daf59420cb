"""Reasoning parsers: the names the ``reasoning_parser`` knob takes and the tags they read.

A reasoning model writes its thinking between ``<think>`` and ``</think>`` before the answer.
The tokenizer worker picks the parser (the knob, or "auto": read from the chat template) and
says per request whether the output starts inside the thinking (RequestMeta.reasoning_open); the
detokenizer (detok_worker.reasoning) splits the thinking out of the text (StreamEvent.reasoning).

``qwen3`` (Qwen3, SmolLM3): the output starts inside the thinking only when the prompt opened
``<think>``; a ``<think>`` the model writes first opens it. ``deepseek_r1`` (the R1 distills,
QwQ): the template opens ``<think>`` in the prompt, so the output starts in the thinking. Either
way the thinking ends at ``</think>``; an output that never writes it is thinking throughout.
A request with ``enable_thinking: false`` in its chat_template_kwargs splits nothing.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_QWEN3 = "qwen3"
REASONING_DEEPSEEK_R1 = "deepseek_r1"
REASONING_PARSERS = (REASONING_QWEN3, REASONING_DEEPSEEK_R1)
REASONING_AUTO, REASONING_NONE = "auto", "none"
REASONING_PARSER_CHOICES = (REASONING_AUTO, REASONING_NONE, *REASONING_PARSERS)
REASONING_PARSER_HELP = (
    "split the model's <think>...</think> thinking out of the answer (chat reasoning_content, "
    "a Responses reasoning item, Messages thinking blocks): qwen3 (thinking only when opened), "
    "deepseek_r1 (the output starts in thinking), none; auto reads it from the chat template "
    "(deepseek_r1 when its prompt ends inside <think>, qwen3 when it otherwise writes <think> "
    "and </think>, none else)"
)


def thinking_disabled(chat_template_kwargs: dict) -> bool:
    """The request turned thinking off (Qwen3's template variable)."""
    return chat_template_kwargs.get("enable_thinking", True) is False


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a ``<think>`` block (its last tag is an open one)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)
