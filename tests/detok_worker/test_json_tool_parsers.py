"""Every family's parser (Hermes, Llama 3.x JSON, Mistral's two forms): streamed text split at
every position gives what the whole text gives; the name goes out once the arguments begin and
they stream in fragments; hostile text (malformed JSON, unknown names, brackets and markers
inside strings) neither crashes nor swallows content; a call cut by max_tokens is a call with
its partial arguments once they began, and is dropped before that (never text)."""

from __future__ import annotations

import itertools

import pytest

from detok_worker.json_tool_parsers import mistral_call_id
from detok_worker.tool_parsers import TOOL_PARSERS, ParsedDelta
from tests.detok_worker.whole_text import parse_complete


def parser(kind: str):
    ids = (f"c{i}" for i in itertools.count())
    return TOOL_PARSERS[kind](new_id=lambda: next(ids))


def whole(kind: str, text: str, cut: bool = False):
    content, calls = parse_complete(parser(kind), text, cut)
    return content, [(c.id, c.name, c.arguments) for c in calls]


def streamed(kind: str, pieces: list[str], cut: bool = False):
    p = parser(kind)
    deltas: list[ParsedDelta] = [p.feed(piece) for piece in pieces] + [p.finish(cut)]
    content, calls = "", []
    for delta in deltas:
        content += delta.content
        for d in delta.tool_calls:
            if d.id is not None:
                assert d.index == len(calls) and d.name
                calls.append([d.id, d.name, d.arguments])
            else:
                assert d.index == len(calls) - 1  # fragments of the newest call only
                calls[d.index][2] += d.arguments
    return content, [tuple(c) for c in calls], deltas


CITY = '{"city": "Paris", "days": 3}'
TRICKY_ARGS = '{"text": "a \\"}\\" {[ ]", "n": [1, {"x": "]"}], "m": "[TOOL_CALLS]"}'
CASES = {
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {CITY}}}', "", [("get_weather", CITY)]),
        (
            f'<|python_tag|>{{"name": "f", "parameters": {CITY}}}; '
            '{"name": "g", "arguments": {}}',
            "",
            [("f", CITY), ("g", "{}")],
        ),
        (f' {{"name": "say", "parameters": {TRICKY_ARGS}}}', "", [("say", TRICKY_ARGS)]),
        ('{"parameters": {"a": 1}, "name": "f"}', "", [("f", '{"a": 1}')]),  # read whole
        ("The capital is Paris.", "The capital is Paris.", []),
        ('{"answer": {"n": 42}} is the JSON', '{"answer": {"n": 42}} is the JSON', []),
        ("  spaced  ", "  spaced  ", []),
        ('{"name": "nosuchtool", "parameters": {}}', "", [("nosuchtool", "{}")]),  # passed on
        # Malformed arguments: written as they came (they streamed), the call still ends.
        ('{"name": "f", "parameters": {"a": }} then', "then", [("f", '{"a": }')]),
        ('{"name": 3, "parameters": {}}', '{"name": 3, "parameters": {}}', []),
    ],
    "mistral": [
        (
            f'[TOOL_CALLS] [{{"name": "f", "arguments": {CITY}}}, '
            '{"name": "g", "arguments": {}}]',
            "",
            [("f", CITY), ("g", "{}")],
        ),
        (
            f"Sure.[TOOL_CALLS]f[ARGS]{CITY}[TOOL_CALLS]g[ARGS]{{}}",
            "Sure.",
            [("f", CITY), ("g", "{}")],
        ),
        (f"[TOOL_CALLS]say[CALL_ID]a1B2c3D4e[ARGS]{TRICKY_ARGS}", "", [("say", TRICKY_ARGS)]),
        ('[TOOL_CALLS]{"arguments": {}, "name": "h"}', "", [("h", "{}")]),
        ("no calls [TOOL here", "no calls [TOOL here", []),
        ("[TOOL_CALLS]not a name![ARGS]{}", "[TOOL_CALLS]not a name![ARGS]{}", []),
        ('[TOOL_CALLS] ["oops"] after', '"oops"] after', []),
        ("[TOOL_CALLS]nosuchtool[ARGS]{}", "", [("nosuchtool", "{}")]),
    ],
    "hermes": [
        (
            f'Let me see.\n<tool_call>\n{{"name": "f", "arguments": {CITY}}}\n</tool_call>',
            "Let me see.",
            [("f", CITY)],
        ),
        (
            f'<tool_call>{{"name": "say", "arguments": {TRICKY_ARGS}}}</tool_call>',
            "",
            [("say", TRICKY_ARGS)],
        ),
        ("<tool_call>{bad json}</tool_call> ok", "<tool_call>{bad json}</tool_call> ok", []),
    ],
}
ALL = [(kind, *case) for kind, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("kind, text, content, calls", ALL)
def test_whole_text(kind, text, content, calls):
    got_content, got_calls = whole(kind, text)
    assert (got_content, [(n, a) for _, n, a in got_calls]) == (content, calls)
    assert [i for i, _, _ in got_calls] == [f"c{i}" for i in range(len(calls))]


@pytest.mark.parametrize("kind, text, content, calls", ALL)
def test_split_at_every_position_equals_whole(kind, text, content, calls):
    expected = whole(kind, text)
    for k in range(1, len(text)):
        assert streamed(kind, [text[:k], text[k:]])[:2] == expected, (k, text[:k])
    assert streamed(kind, list(text))[:2] == expected


@pytest.mark.parametrize(
    "kind, text, begun",
    [
        ("llama3_json", f'{{"name": "get_weather", "parameters": {CITY}}}', '"parameters": {'),
        ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{CITY}", "[ARGS]"),
        ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {CITY}}}]', ": {"),
    ],
)
def test_the_name_goes_out_when_the_arguments_begin(kind, text, begun):
    _, _, deltas = streamed(kind, list(text))
    first = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert text[: first + 1].endswith(begun)
    assert deltas[first].tool_calls[0].name == "get_weather"
    fragments = [d for d in deltas[first + 1 :] if d.tool_calls]
    assert len(fragments) > 10 and all(not d.content for d in deltas)


@pytest.mark.parametrize(
    "kind, text, cut, content, calls",
    [
        # Cut before the arguments began: dropped.
        ("hermes", 'ok\n<tool_call>\n{"name": "get_weather",', True, "ok", []),
        ("hermes", "ok <tool_ca", True, "ok", []),
        ("hermes", "ok <tool_ca", False, "ok <tool_ca", []),  # the model ended there
        ("llama3_json", '{"name": "get_weather", "param', True, "", []),
        ("llama3_json", "<|python", True, "", []),
        ("llama3_json", '{"answer": 4', True, '{"answer": 4', []),  # no call begins so
        ("mistral", "ok[TOOL_CALLS]get_wea", True, "ok", []),
        ("mistral", "ok [TOOL_CA", True, "ok", []),
        ("mistral", '[TOOL_CALLS][{"name": "f", "argum', True, "", []),
        # Cut inside the arguments: a call, with the arguments written so far.
        (
            "hermes",
            '<tool_call>\n{"name": "f", "arguments": {"city": "Pa',
            True,
            "",
            [("f", '{"city": "Pa')],
        ),
        (
            "llama3_json",
            '{"name": "f", "parameters": {"city": "Pa',
            True,
            "",
            [("f", '{"city": "Pa')],
        ),
        ("mistral", '[TOOL_CALLS]f[ARGS]{"city": "Pa', True, "", [("f", '{"city": "Pa')]),
    ],
)
def test_a_cut_call_is_never_text(kind, text, cut, content, calls):
    got_content, got_calls = whole(kind, text, cut)
    assert (got_content, [(n, a) for _, n, a in got_calls]) == (content, calls)
    for k in range(1, len(text)):
        assert streamed(kind, [text[:k], text[k:]], cut)[:2] == (got_content, got_calls)


def test_mistral_ids_are_what_its_templates_accept():
    assert all(len(i) == 9 and i.isalnum() for i in (mistral_call_id() for _ in range(50)))
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    assert TOOL_PARSERS["mistral"]().markers == ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
