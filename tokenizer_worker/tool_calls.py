"""OpenAI tool calling on the prompt side: checking ``tools`` and ``tool_choice``, putting them
into the conversation the chat template renders, and the grammar that enforces a call.

The call format is the model family's (tokenizer_worker.tool_formats: Hermes tags, Llama 3.x
JSON, Mistral's [TOOL_CALLS]; detok_worker.tool_parsers reads it back). A chat template that
knows tools (it reads a ``tools`` variable) gets them as Hugging Face templates expect; for one
that does not (SmolLM2's) they go into the system message in the generic prompt below, which
says how to call in the format, and the history's tool calls are written in it.

``required`` and a named function are enforced by a grammar: the output is one call (for
``required`` with ``parallel_tool_calls``, one or more, where the family allows several), each
naming an allowed function with arguments that match its ``parameters`` schema. A named
function is called once: small models, offered another call of the same function, tend to
repeat the first one until max_tokens. ``auto`` is left to the model and parsed afterwards;
``none`` leaves the tools out of the prompt, so the model is not invited to call what it may
not.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ipc.structured import STRUCTURED_GRAMMAR, StructuredOutputSpec
from tokenizer_worker.grammar_compiler import GrammarSpecError, check_schema, json_depth
from tokenizer_worker.tool_formats import ToolFormat

HERMES = ToolFormat("hermes")

MAX_TOOLS = 128
# As deep as an HTTP body may nest (http_worker.body); far below what exhausts the stack.
MAX_ARGUMENTS_DEPTH = 200
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

GENERIC_TOOL_PROMPT = """You can call functions to help with the request. Their signatures, one \
JSON object per line, are between <tools> and </tools>:
<tools>
{signatures}
</tools>
{how_to_call}
Results come back between <tool_response> and </tool_response>."""
CHOICE_HINTS = {
    "required": "You must call at least one function.",
    "named": "You must call the function {name}.",
}


class ToolSpecError(ValueError):
    """Bad ``tools`` / ``tool_choice`` / tool messages; the message names the problem (a 400)."""


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "named"
    name: str = ""  # the function, for "named"


def check_tools(tools: Any) -> list[dict]:
    """OpenAI ``tools``, checked: function tools with unique valid names and object schemas."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolSpecError(f"tools must be a list of at most {MAX_TOOLS} tools")
    seen = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
        ):
            raise ToolSpecError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolSpecError(
                f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}"
            )
        if name in seen:
            raise ToolSpecError(f"tools[{i}]: function {name!r} is defined twice")
        seen.add(name)
        if not isinstance(function.get("description", ""), str):
            raise ToolSpecError(f"tools[{i}].function.description must be a string")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolSpecError(f"tools[{i}].function.parameters must be a JSON schema object")
        try:
            check_schema(parameters)
        except GrammarSpecError as exc:
            raise ToolSpecError(f"tools[{i}].function.parameters: {exc}") from None
    return tools


def resolve_tool_choice(tools: list[dict], tool_choice: Any) -> ToolChoice:
    """OpenAI's ``tool_choice`` (default: "auto" with tools, "none" without)."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not tools:
            raise ToolSpecError('tool_choice "required" needs at least one tool')
        return ToolChoice(tool_choice if tools else "none")
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
    ):
        raise ToolSpecError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )
    if function["name"] not in names:
        raise ToolSpecError(
            f"tool_choice names the function {function['name']!r}, which is not "
            f"among the tools ({', '.join(names) or 'none given'})"
        )
    return ToolChoice("named", function["name"])


def template_supports_tools(template_source: str) -> bool:
    """Whether a chat template renders tools itself (it reads the ``tools`` variable)."""
    env = ImmutableSandboxedEnvironment()
    return "tools" in meta.find_undeclared_variables(env.parse(template_source))


def conversation_for_template(
    messages: list[dict],
    tools: list[dict],
    choice: ToolChoice,
    supports_tools: bool,
    fmt: ToolFormat = HERMES,
) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to render. ``messages`` are OpenAI chat messages (assistant ones may
    carry ``tool_calls``, ``role: "tool"`` ones answer them); ``fmt``: the call format a
    template without tools is told of and sees its history in."""
    offered = tools if choice.mode != "none" else []
    if supports_tools:
        return [_with_parsed_arguments(m) for m in messages], offered or None
    out = _history_as_text(messages, fmt)
    if offered:
        prompt = tool_system_prompt(offered, choice, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _with_parsed_arguments(message: dict) -> dict:
    """A message for a template that renders tools itself: its calls' arguments as objects."""
    m = dict(message)
    if m.get("tool_calls"):
        m["tool_calls"] = [
            {
                **c,
                "function": {
                    **c["function"],
                    "arguments": _arguments(c["function"].get("arguments")),
                },
            }
            for c in _checked_calls(m["tool_calls"])
        ]
    return m


def _history_as_text(messages: list[dict], fmt: ToolFormat) -> list[dict]:
    """The conversation for a template without tools: calls written in ``fmt``, each turn's tool
    results in one user message."""
    out: list[dict] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = fmt.calls_text(
                [
                    (c["function"]["name"], _arguments(c["function"].get("arguments")))
                    for c in _checked_calls(m["tool_calls"])
                ]
            )
            out.append(
                {
                    "role": "assistant",
                    "content": "\n".join(([content] if content else []) + [calls]),
                }
            )
        elif role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # results of one turn share a user message
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_results", None)
    return out


def tool_system_prompt(tools: list[dict], choice: ToolChoice, fmt: ToolFormat = HERMES) -> str:
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    prompt = GENERIC_TOOL_PROMPT.format(signatures=signatures, how_to_call=fmt.how_to_call())
    hint = CHOICE_HINTS.get(choice.mode)
    return f"{prompt}\n{hint.format(name=choice.name)}" if hint else prompt


def forced_tool_call_spec(
    tools: list[dict],
    choice: ToolChoice,
    parallel_tool_calls: bool = True,
    fmt: ToolFormat = HERMES,
) -> StructuredOutputSpec | None:
    """The grammar that makes the output valid calls in ``fmt``, for "required" and a named
    function; None for "auto" and "none" (nothing is forced)."""
    if choice.mode not in ("required", "named"):
        return None
    allowed = [
        t["function"]
        for t in tools
        if choice.mode == "required" or t["function"]["name"] == choice.name
    ]
    several = parallel_tool_calls and choice.mode == "required"
    return StructuredOutputSpec(STRUCTURED_GRAMMAR, fmt.grammar(allowed, several))


def _checked_calls(calls: Any) -> list[dict]:
    if not isinstance(calls, list):
        raise ToolSpecError("an assistant message's tool_calls must be a list")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolSpecError("each tool call needs a function with a name")
    return calls


def _arguments(arguments: Any) -> Any:
    """History arguments arrive as a JSON string (OpenAI); templates want the object. Text that
    is no JSON stays text. The string hid its nesting from the HTTP body's depth bound: deeper
    than MAX_ARGUMENTS_DEPTH is refused, since parsing or rendering it exhausts the stack."""
    if not isinstance(arguments, str):
        return _not_too_deep({} if arguments is None else arguments)
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments
    except RecursionError:
        raise _too_deep("far deeper") from None
    return _not_too_deep(value)


def _not_too_deep(arguments: Any) -> Any:
    depth = json_depth(arguments)
    if depth > MAX_ARGUMENTS_DEPTH:
        raise _too_deep(f"{depth} levels deep")
    return arguments


def _too_deep(how: str) -> ToolSpecError:
    return ToolSpecError(
        f"a tool call's arguments in the history nest {how}; at most {MAX_ARGUMENTS_DEPTH} "
        "levels are accepted"
    )
