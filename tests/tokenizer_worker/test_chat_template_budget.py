"""A model's chat template is untrusted code: one that loops for ever or builds a huge string is
refused with one line (ChatTemplateError, a 400 for the request) within its budget, instead of
wedging the tokenizer process that renders it; ordinary templates render as before."""

from __future__ import annotations

import time

import pytest

from tokenizer_worker import chat_template
from tokenizer_worker.chat_template import ChatTemplate, ChatTemplateError

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        # 10**10 iterations, printing or not: was a tokenizer busy for hours
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}"
            "{% endfor %}",
            "budget",
        ),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "budget",
        ),
        # a string doubled 60 times: was gigabytes before any error
        (
            "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
            "{% endfor %}{{ ns.s }}",
            "over",
        ),
        ("{{ 'x' * 10**12 }}", "over"),
        ("{{ [1] * 10**10 }}", "over"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ],
)
def test_a_runaway_template_is_refused_within_its_budget(source, reason, monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_BUDGET_S", 1.0)
    monkeypatch.setattr(chat_template, "MAX_TEMPLATE_CHARS", 2**24)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=reason):
        ChatTemplate(source, {}).render(MESSAGES)
    assert time.monotonic() - t0 < 10


def test_an_ordinary_template_renders_after_a_refused_one():
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    chat_template.RENDER_BUDGET_S, saved = 0.2, chat_template.RENDER_BUDGET_S
    try:
        with pytest.raises(ChatTemplateError):
            ChatTemplate(loop, {}).render(MESSAGES)
    finally:
        chat_template.RENDER_BUDGET_S = saved
    source = (
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m['content'] * 2 }}{% endfor %}"
    )
    assert ChatTemplate(source, {"bos_token": "<s>"}).render(MESSAGES) == "<s>user: hihi"
