"""The hostile inputs of issue 23 that tests/test_http_edge.py sends through the real server:
(path, body, the param its 400 must name[, words its message must hold])."""

from __future__ import annotations

CHAT = [{"role": "user", "content": "hi"}]
COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"

# Raw JSON text: "\ud800" is a valid JSON escape that is not Unicode text.
SURROGATES = [
    (COMPLETIONS, '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    (
        CHAT_COMPLETIONS,
        '{"messages": [{"role": "user", "content": "\\udc00"}]}',
        "messages[0].content",
    ),
    (COMPLETIONS, '{"prompt": "hi", "stop": ["ok", "\\ud83d"]}', "stop[1]"),
    (
        COMPLETIONS,
        '{"prompt": "hi", "structured_outputs": {"choice": ["\\udfff"]}}',
        "structured_outputs.choice[0]",
    ),
    (
        CHAT_COMPLETIONS,
        '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
        '"function": {"name": "f", "description": "x\\ud800", "parameters": {}}}]}',
        "tools[0].function.description",
    ),
    (
        CHAT_COMPLETIONS,
        '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"\\ud800": 1}}',
        "chat_template_kwargs.'\\ud800'",
    ),
    (COMPLETIONS, '{"prompt": "hi", "cache_salt": "tenant-\\ud800"}', "cache_salt"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
]


INTEGERS = [
    (
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 2**64},
        "max_tokens",
        "less than or equal to 2147483647",
    ),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**30}, "max_tokens", "less than or equal"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**12}, "max_tokens", "less than or equal"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {str(10**30): 1}}, "logit_bias", "token ids"),
    (COMPLETIONS, {"prompt": [1, 10**20]}, "prompt", "[0, 2147483647]"),
    (COMPLETIONS, {"prompt": "hi", "seed": 2**64}, "seed", "less than or equal"),
    (
        CHAT_COMPLETIONS,
        {"messages": CHAT, "max_completion_tokens": 2**64},
        "max_completion_tokens",
        "less than",
    ),
    # Past the vocabulary: the tokenizer worker's 400, named as the request names the field.
    (COMPLETIONS, {"prompt": [1, 49152]}, "prompt", "must be in [0, 49152)"),
    (
        COMPLETIONS,
        {"prompt": "hi", "logit_bias": {"49152": 1}},
        "logit_bias",
        "outside the vocabulary",
    ),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [49152]}, "stop_token_ids", "outside"),
    ("/detokenize", {"tokens": [10**20]}, "tokens[0]", "less than or equal to 2147483647"),
    ("/detokenize", {"tokens": [2**31]}, "tokens[0]", "less than or equal to 2147483647"),
]


LAX = [
    (COMPLETIONS, {"max_tokens": "10"}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": 10.0}, "max_tokens"),
    (COMPLETIONS, {"stream": "yes"}, "stream"),
    (COMPLETIONS, {"n": "2"}, "n"),
    (COMPLETIONS, {"logprobs": True}, "logprobs"),
    (COMPLETIONS, {"prompt_logprobs": False}, "prompt_logprobs"),
    (COMPLETIONS, {"seed": 2**64}, "seed"),
    (COMPLETIONS, {"logit_bias": {"1_000": 1}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {" 7": 1}}, "logit_bias"),
    (COMPLETIONS, {"temperature": "0"}, "temperature"),
    (COMPLETIONS, {"echo": 1}, "echo"),
    (CHAT_COMPLETIONS, {"messages": [{"role": "user"}]}, "messages[0].content"),
    (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    (
        CHAT_COMPLETIONS,
        {"messages": CHAT + [{"role": "tool", "tool_call_id": "c"}]},
        "messages[1].content",
    ),
    (
        CHAT_COMPLETIONS,
        {"messages": CHAT + [{"role": "tool", "content": "r"}]},
        "messages[1].tool_call_id",
    ),
    (CHAT_COMPLETIONS, {"messages": CHAT, "logprobs": 1}, "logprobs"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    (COMPLETIONS, {"cache_salt": 7}, "cache_salt"),
    (COMPLETIONS, {"speculative": "no"}, "speculative"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "speculative": 0}, "speculative"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "cache_salt": ["a"]}, "cache_salt"),
    ("/detokenize", {"tokens": [False]}, "tokens[0]"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "true"}, "add_special_tokens"),
]


def hostile_bodies() -> dict[str, tuple[str, dict]]:
    """Issue 23 item 1's bodies that stalled every stream of a frontend (refused with a 400 on
    the default model; on the tiny one the tool is accepted): (path, body) by name."""
    one_turn = {"messages": CHAT, "max_tokens": 4}
    enum = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}}
    enum["json_schema"]["schema"]["enum"] = [f"v{i}" for i in range(100_000)]
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "string", "pattern": "(a+)+$"}},
            },
        },
    }
    return {
        "enum of 100,000": (CHAT_COMPLETIONS, {**one_turn, "response_format": enum}),
        "choice of 100,000": (
            COMPLETIONS,
            {
                "prompt": "hi",
                "max_tokens": 4,
                "structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]},
            },
        ),
        "tool pattern (a+)+$": (CHAT_COMPLETIONS, {**one_turn, "tools": [tool]}),
    }
