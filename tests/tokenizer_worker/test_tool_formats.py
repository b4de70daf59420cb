"""The model families' call formats on the prompt side: read from the chat template's text (or
named by the knob), the grammar that forces calls in each, followed by a sampler over random
logits and read back by that family's parser with arguments valid against the schema, and
calls written in each format reading back as the same calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from detok_worker.tool_parsers import TOOL_PARSERS
from engine_worker.grammar_builder import GrammarBuilder, backend_tokenizer
from ipc.config import ClusterConfig
from tests.chat_templates import LLAMA3_TOOLS_TEMPLATE, with_template
from tests.detok_worker.whole_text import parse_complete
from tests.engine_worker.grammar_helpers import sample_constrained, tiny_vocabulary, wait_ready
from tests.tokenizer_worker.test_tool_calls import TOOLS
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.grammar_compiler import GrammarCompiler
from tokenizer_worker.tool_calls import (
    ToolChoice,
    conversation_for_template,
    forced_tool_call_spec,
    template_supports_tools,
)
from tokenizer_worker.tool_formats import ToolFormat, detect_format

# The tool-call parts of each family's template, as they ship (abridged).
LLAMA31 = (
    "{{- bos_token }}{%- if tools is not none %}Environment: ipython\n{%- endif %}"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}'
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{%- endfor %}"
    "{%- if tool_call.name == 'brave_search' %}{{- '<|python_tag|>' }}{%- endif %}"
    '{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}'
)
LLAMA32 = (
    "<|start_header_id|>ipython<|end_header_id|>\\n\\n{%- if tools is not none %}"
    'Respond in the format {"name": function name, "parameters": dictionary}{%- endif %}'
)
QWEN25 = "<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools><tool_call>"
MISTRAL_V3 = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{%- endif %}" + (
    "{{- '[TOOL_CALLS][' }}{%- for tc in message.tool_calls %}{{ tc|tojson }}{%- endfor %}"
)
MISTRAL_V11 = "{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + arguments }}"
SMOLLM2 = "{% for message in messages %}<|im_start|>{{ message['role'] }}{% endfor %}"


@pytest.mark.parametrize(
    "source, name",
    [
        (LLAMA31, "llama3_json"),
        (LLAMA32, "llama3_json"),
        (QWEN25, "hermes"),
        (MISTRAL_V3, "mistral"),
        (MISTRAL_V11, "mistral"),
        (SMOLLM2, "hermes"),
        (None, "hermes"),
    ],
)
def test_the_format_is_read_from_the_template(source, name):
    assert detect_format(source) == name
    fmt = ToolFormat.for_model(source, "auto", None)
    assert fmt.name == name and fmt.mistral_names == (source is MISTRAL_V11)


def test_the_knob_overrides_and_is_checked():
    assert ToolFormat.for_model(QWEN25, "llama3_json", None).name == "llama3_json"
    with pytest.raises(ValueError, match="tool_call_parser must be 'auto' or one of"):
        ToolFormat.for_model(QWEN25, "pythonic", None)
    config = ClusterConfig.build("/m", "/tmp/run", tool_call_parser="mistral")
    assert config.tool_call_parser == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser"):
        ClusterConfig.build("/m", "/tmp/run", tool_call_parser="pythonic")


class Vocab:
    """token_to_id over the tiny vocabulary: its special token 1 stands for [TOOL_CALLS]."""

    @staticmethod
    def token_to_id(text: str) -> int | None:
        return 1 if text == "[TOOL_CALLS]" else None


FORMATS = {
    "hermes": ToolFormat.for_model(QWEN25, "auto", Vocab),
    "llama3_json": ToolFormat.for_model(LLAMA31, "auto", Vocab),
    "mistral-list": ToolFormat.for_model(MISTRAL_V3, "auto", Vocab),
    "mistral-names": ToolFormat.for_model(MISTRAL_V11, "auto", Vocab),
}


@pytest.mark.parametrize("calls", [[("get_weather", {"city": "Oslo"})], [("a", {}), ("b", [1])]])
@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_calls_written_in_a_format_read_back_as_the_same_calls(fmt, calls):
    _, parsed = parse_complete(TOOL_PARSERS[fmt.name](), fmt.calls_text(calls))
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(n, a) for n, a in calls]


def test_a_template_without_tools_is_told_the_family_format():
    ask = [{"role": "user", "content": "Weather?"}]
    messages, _ = conversation_for_template(
        ask, TOOLS, ToolChoice("auto"), False, FORMATS["llama3_json"]
    )
    assert (
        '{"name": "function_name", "parameters": {"argument": "value"}}' in (messages[0]["content"])
    )
    assert "<tool_call>" not in messages[0]["content"]


@pytest.fixture(scope="module")
def grammar_parts():
    vocabulary = tiny_vocabulary()
    builder = GrammarBuilder(vocabulary)
    yield vocabulary, GrammarCompiler(backend_tokenizer(vocabulary)), builder
    builder.close()


def text_with_markers(vocabulary, tokens: list[int]) -> str:
    table = vocabulary.token_table()
    pieces = [b"[TOOL_CALLS]" if t == 1 else table[t] for t in tokens if t not in (0,)]
    return b"".join(pieces).decode()


@pytest.mark.parametrize(
    "choice, parallel",
    [(ToolChoice("named", "get_weather"), True), (ToolChoice("required"), True)],
    ids=["named", "required"],
)
@pytest.mark.parametrize("key", FORMATS.keys())
def test_forced_calls_in_each_format_parse_and_match_the_schema(
    grammar_parts, key, choice, parallel
):
    vocabulary, compiler, builder = grammar_parts
    fmt = FORMATS[key]
    text = compiler.compile(forced_tool_call_spec(TOOLS, choice, parallel, fmt))
    grammars = [wait_ready(builder.request(text)) for _ in range(6)]
    outputs, ended = sample_constrained(grammars, vocabulary.vocab_size, steps=2000, seed=11)
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    counts = set()
    for tokens, how in zip(outputs, ended):
        assert how in ("stop", "eos")
        output = text_with_markers(vocabulary, tokens)
        if key.startswith("mistral"):
            assert output.startswith("[TOOL_CALLS]") and 1 in tokens  # the special token
        content, calls = parse_complete(TOOL_PARSERS[fmt.name](), output)
        assert content == "" and calls, output
        counts.add(len(calls))
        for call in calls:
            assert choice.mode == "required" or call.name == choice.name
            jsonschema.validate(json.loads(call.arguments), by_name[call.name])
    if choice.mode == "named" or key == "llama3_json":  # Llama's templates take one call
        assert counts == {1}


def test_a_llama3_template_with_tools_renders_as_transformers_renders_it(
    default_model_dir, tmp_path
):
    from transformers import AutoTokenizer

    model_dir = with_template(default_model_dir, tmp_path / "llama3", LLAMA3_TOOLS_TEMPLATE)
    arguments = '{"city": "Oslo", "unit": "c"}'
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    ]
    template = ChatTemplate.from_model_dir(model_dir)
    assert template is not None and template_supports_tools(template.source)
    messages, tools = conversation_for_template(history, TOOLS, ToolChoice("auto"), True)
    ours = template.render(messages, tools=tools)
    hf_history = json.loads(json.dumps(history))
    hf_history[2]["tool_calls"][0]["function"]["arguments"] = json.loads(arguments)
    theirs = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        hf_history, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs and '{"name": "get_weather", "parameters": {"city": "Oslo"' in ours
