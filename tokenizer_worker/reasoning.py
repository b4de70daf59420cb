"""Which reasoning parser a model gets (the ``reasoning_parser`` knob, or read from its chat
template) and what it means for one request (ipc.reasoning has the rules)."""

from __future__ import annotations

from ipc.messages import SubmitRequest
from ipc.reasoning import (
    REASONING_AUTO,
    REASONING_DEEPSEEK_R1,
    REASONING_NONE,
    REASONING_PARSER_CHOICES,
    REASONING_QWEN3,
    THINK_CLOSE,
    THINK_OPEN,
    prompt_opens_thinking,
    thinking_disabled,
)
from tokenizer_worker.chat_template import ChatTemplate, ChatTemplateError

PROBE = [{"role": "user", "content": "Which is larger, 9.11 or 9.8?"}]


def choose_reasoning_parser(template: ChatTemplate | None, knob: str = REASONING_AUTO) -> str:
    """The parser's name, "" for none. "auto": deepseek_r1 when the template's generation
    prompt ends inside <think>, qwen3 when the template otherwise writes both tags (it opens
    the thinking only on request, or the model does), none when it shows no thinking."""
    if knob not in REASONING_PARSER_CHOICES:
        raise ValueError(
            f"reasoning_parser must be one of {', '.join(REASONING_PARSER_CHOICES)}, got {knob!r}"
        )
    if knob != REASONING_AUTO:
        return "" if knob == REASONING_NONE else knob
    if template is None or THINK_OPEN not in template.source:
        return ""
    try:
        probe = template.render(PROBE, add_generation_prompt=True)
    except ChatTemplateError:
        probe = ""
    if prompt_opens_thinking(probe):
        return REASONING_DEEPSEEK_R1
    return REASONING_QWEN3 if THINK_CLOSE in template.source else ""


def request_reasoning(parser: str, req: SubmitRequest, prompt: str | None) -> tuple[str, bool]:
    """(parser, the output starts inside the thinking) for one request: chat requests only (a
    raw prompt is the caller's own text), none with enable_thinking false."""
    if not parser or req.messages is None or prompt is None:
        return "", False
    if thinking_disabled(req.chat_template_kwargs):
        return "", False
    return parser, parser == REASONING_DEEPSEEK_R1 or prompt_opens_thinking(prompt)
