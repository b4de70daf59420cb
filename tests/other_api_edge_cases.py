"""Hostile bodies for the Responses and Messages APIs that tests/test_http_other_apis.py sends
through the real server: each new field with a wrong type, a value out of bounds, a lone
surrogate, deep nesting or an unknown field beside it. Each case: (fields merged into a valid
body, the field its 400 must name: ``param`` on /v1/responses, the message on /v1/messages).
"""

from __future__ import annotations

SURROGATE = "\ud800"  # json.dumps writes it as the escape "\\ud800": valid JSON, no character
DEEP = {"type": "object", "properties": {}}
for _ in range(250):  # past the body's 200 levels of nesting
    DEEP = {"type": "object", "properties": {"a": DEEP}}
# A last assistant message: a prefill to continue, refused by /v1/messages (count_tokens counts it).
PREFILL = {"messages": [{"role": "assistant", "content": "Paris is"}]}
TOOL_SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}}
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "x"}
NOT_AN_OBJECT = 'input_schema must be a JSON schema of type "object"'

RESPONSES = [
    ({"model": 5}, "model"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": SURROGATE}]}, "input[0].content"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        "input[0].content[0].text",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0].type",
    ),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # nothing to answer
    ({"input": [{"type": "reasoning_summary", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
    (
        {"input": [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]},
        "input[0].call_id",
    ),
    ({"input": [{"role": "user", "content": "hi", "vendor": 1}]}, "input[0].vendor"),
    # Issue 38 items 7 and 9: an empty input, and outputs of calls the input does not hold.
    ({"input": ""}, "input"),
    ({"input": {"text": "hi"}}, "input"),
    ({"input": [["hi"]]}, "input[0]"),
    ({"input": [OUTPUT]}, "input[0].call_id"),
    ({"input": [OUTPUT, CALL]}, "input[0].call_id"),  # the call after its output
    ({"input": [CALL, {**OUTPUT, "call_id": "c2"}]}, "input[1].call_id"),
    ({"input": [{**OUTPUT, "call_id": 5}]}, "input[0].call_id"),
    ({"input": [{**OUTPUT, "call_id": ["c1"]}]}, "input[0].call_id"),
    ({"input": [{**OUTPUT, "call_id": "c" * 257}]}, "input[0].call_id"),
    ({"input": [{**OUTPUT, "call_id": ""}]}, "input[0].call_id"),
    ({"top_p": 0}, "top_p"),
    ({"input": [{"role": "user", "content": "x"}] * 5000}, "input"),
    ({"instructions": 5}, "instructions"),
    ({"instructions": SURROGATE}, "instructions"),
    ({"max_output_tokens": "8"}, "max_output_tokens"),
    ({"max_output_tokens": True}, "max_output_tokens"),
    ({"max_output_tokens": 8.0}, "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 2**64}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),  # past the context's room
    ({"temperature": "0"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"tools": {}}, "tools"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools[0].parameters"),
    (
        {"tools": [{"type": "function", "name": "f", "description": SURROGATE}]},
        "tools[0].description",
    ),
    ({"tools": [{"type": "function", "name": "f", "vendor": 1}]}, "tools[0].vendor"),
    ({"tools": [{"type": "function", "name": "f", "parameters": DEEP}]}, None),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format.schema"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"text": {"format": {"type": "text"}, "vendor": 1}}, "text.vendor"),
    ({"include": ["everything"]}, "include[0]"),
    ({"include": "message.output_text.logprobs"}, "include"),
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"top_logprobs": 2}, None),  # without the include that asks for logprobs
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"user": 5}, "user"),
    ({"store": "yes"}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True}, "background"),
    ({"stream_options": {"include_obfuscation": False}, "stream": False}, None),
    ({"temperature_x": 1}, "temperature_x"),
]

MESSAGES = [
    ({"model": 5}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    # Issue 38 item 9: Anthropic refuses empty content and empty text blocks.
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content: a message needs"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content: a message needs"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [[{"type": "text"}]]}]}, "messages[0].content[0]"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
        "messages[0].content[0].text",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [{"type": "text", "text": ""}],
                        }
                    ],
                }
            ]
        },
        "messages[0].content[0].content[0].text",
    ),
    ({"system": [{"type": "text", "text": ""}]}, "system[0].text"),
    ({"messages": [{"role": "user", "content": SURROGATE}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0].type",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
        "messages[0].content[0].text",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ]
        },
        "messages[0]",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}],
                },
                {"role": "user", "content": "x"},
            ]
        },
        "messages[0].content[0].input",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": ""}]}]},
        "messages[0].content[0].tool_use_id",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}
                    ],
                }
            ]
        },
        "messages[0].content[0].content[0].type",
    ),
    ({"messages": [{"role": "user", "content": "x", "vendor": 1}]}, "messages[0].vendor"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 5000}]},
        "messages",
    ),
    (PREFILL, "messages[0].role"),
    ({"system": 5}, "system"),
    ({"system": [{"type": "image"}]}, "system[0].type"),
    ({"system": SURROGATE}, "system"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),  # past the context's room
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"stop_sequences": [""]}, "stop_sequences[0]"),
    ({"stop_sequences": [SURROGATE]}, "stop_sequences[0]"),
    ({"stop_sequences": [str(i) for i in range(17)]}, "stop_sequences"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2**40}, "top_k"),
    ({"stream": "yes"}, "stream"),
    ({"metadata": {"user_id": 5}}, "metadata.user_id"),
    ({"metadata": {"session": "x"}}, "metadata.session"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "bad name", "input_schema": TOOL_SCHEMA}]}, "tools[0].name"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    (
        {"tools": [{"name": "f", "input_schema": TOOL_SCHEMA, "description": SURROGATE}]},
        "tools[0].description",
    ),
    (
        {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": 5}}]},
        "tools[0].input_schema",
    ),
    ({"tools": [{"name": "f", "input_schema": DEEP}]}, "nested deeper"),
    # Issue 38 item 9: a tool's input is an object, as Anthropic requires.
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, NOT_AN_OBJECT),
    ({"tools": [{"name": "f", "input_schema": {}}]}, NOT_AN_OBJECT),
    ({"tools": [{"name": "f", "input_schema": {"type": ["object"]}}]}, NOT_AN_OBJECT),
    ({"tools": [{"name": "f", "input_schema": {"type": 5}}]}, NOT_AN_OBJECT),
    ({"tools": [{"name": "f", "input_schema": "object"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": [TOOL_SCHEMA]}]}, "tools[0].input_schema"),
    ({"tools": [], "tool_choice": {"type": "any"}}, 'tool_choice {"type": "any"}'),
    ({"top_p": 0}, "top_p"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tool_choice": {"type": "auto", "name": "f"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, 'tool_choice {"type": "any"}'),  # and no tools
    (
        {
            "tools": [{"name": "f", "input_schema": TOOL_SCHEMA}],
            "tool_choice": {"type": "tool", "name": "g"},
        },
        "'g'",
    ),
    ({"thinking": {"type": "adaptive"}}, "thinking"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"container": "c"}, "container"),
    ({"unknown_field": 1}, "unknown_field"),
]
