"""How each model family writes its tool calls, on the prompt side: which format a chat template
uses (read from its text, or named by the ``tool_call_parser`` knob), the grammar that forces
calls in that format (tool_choice "required" or a named function), and a call written in it
(for the history and the generic prompt of a template that does not render tools itself).
The detokenizer's parser of the same name (detok_worker.tool_parsers) reads the calls back.

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one per line
  (Qwen2.5 and Qwen3, Hermes; and a template that knows no tools: SmolLM2's).
- ``llama3_json``: the answer is one object ``{"name": ..., "parameters": {...}}`` (Llama
  3.1-3.3; their templates take one call per turn, so a forced call is one call).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects, or, for a
  vocabulary or template with the ``[ARGS]`` token (v11 tokenizers on),
  ``[TOOL_CALLS]name[ARGS]{...}`` per call. The markers are the vocabulary's special tokens
  where it has them (the grammar names them by id), else plain text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ipc.structured import (
    TOOL_CALL_FORMATS,
    TOOL_FORMAT_HERMES,
    TOOL_FORMAT_LLAMA3_JSON,
    TOOL_FORMAT_MISTRAL,
)
from tokenizer_worker.grammar_compiler import COMPACT_JSON

AUTO = "auto"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_TAG = "<|python_tag|>"


def detect_format(template_source: str | None) -> str:
    """The call format a chat template's text shows (hermes when it shows none)."""
    source = template_source or ""
    if MISTRAL_CALLS in source:
        return TOOL_FORMAT_MISTRAL
    if HERMES_OPEN in source:
        return TOOL_FORMAT_HERMES
    if PYTHON_TAG in source or ("<|start_header_id|>" in source and "ipython" in source):
        return TOOL_FORMAT_LLAMA3_JSON
    return TOOL_FORMAT_HERMES


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str  # one of ipc.structured.TOOL_CALL_FORMATS: the detokenizer's parser
    mistral_names: bool = False  # mistral: [TOOL_CALLS]name[ARGS]{...} rather than a list
    # Marker text -> its token id in this vocabulary (a grammar names special tokens by id).
    token_ids: dict[str, int] = field(default_factory=dict)

    @classmethod
    def for_model(cls, template_source: str | None, knob: str, tokenizer: Any) -> ToolFormat:
        """``knob``: "auto" (from the template) or a format's name."""
        if knob != AUTO and knob not in TOOL_CALL_FORMATS:
            raise ValueError(
                f"tool_call_parser must be {AUTO!r} or one of {', '.join(TOOL_CALL_FORMATS)}, "
                f"got {knob!r}"
            )
        name = detect_format(template_source) if knob == AUTO else knob
        token_to_id = getattr(tokenizer, "token_to_id", None)
        ids = {}
        for marker in (MISTRAL_CALLS, MISTRAL_ARGS) if name == TOOL_FORMAT_MISTRAL else ():
            token = token_to_id(marker) if token_to_id is not None else None
            if token is not None:
                ids[marker] = token
        names = MISTRAL_ARGS in ids or MISTRAL_ARGS in (template_source or "")
        return cls(name, mistral_names=name == TOOL_FORMAT_MISTRAL and names, token_ids=ids)

    @property
    def arguments_key(self) -> str:
        return "parameters" if self.name == TOOL_FORMAT_LLAMA3_JSON else "arguments"

    @property
    def single_call(self) -> bool:
        """A forced call is one call, whatever parallel_tool_calls says."""
        return self.name == TOOL_FORMAT_LLAMA3_JSON

    # --- text -------------------------------------------------------------------------------
    def calls_text(self, calls: list[tuple[str, Any]]) -> str:
        """(name, arguments) calls as the model writes them, in one assistant turn."""
        if self.name == TOOL_FORMAT_MISTRAL and not self.mistral_names:
            objects = [{"name": n, "arguments": a} for n, a in calls]
            return MISTRAL_CALLS + json.dumps(objects, ensure_ascii=False)
        texts = [self._call_text(n, a) for n, a in calls]
        return {TOOL_FORMAT_HERMES: "\n", TOOL_FORMAT_LLAMA3_JSON: "; "}.get(self.name, "").join(
            texts
        )

    def _call_text(self, name: str, arguments: Any) -> str:
        if self.name == TOOL_FORMAT_MISTRAL:
            return f"{MISTRAL_CALLS}{name}{MISTRAL_ARGS}{json.dumps(arguments, ensure_ascii=False)}"
        body = json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
        if self.name == TOOL_FORMAT_HERMES:
            return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"
        return body

    def how_to_call(self) -> str:
        """The generic prompt's sentence on how to call, with an example."""
        example = self.calls_text([("function_name", {"argument": "value"})])
        if self.name == TOOL_FORMAT_HERMES:
            return (
                "To call a function, write its name and arguments as a JSON object between "
                f"<tool_call> and </tool_call> lines, like this:\n{example}"
            )
        if self.name == TOOL_FORMAT_LLAMA3_JSON:
            return (
                "To call a function, answer with only a JSON object of its name and "
                f"parameters, like this:\n{example}"
            )
        return f"To call a function, write {MISTRAL_CALLS} and the call, like this:\n{example}"

    # --- the grammar that forces calls --------------------------------------------------------
    def grammar(self, functions: list[dict[str, Any]], several: bool) -> str:
        """Lark text: one call of one of ``functions`` (OpenAI function objects), or with
        ``several`` one or more; arguments follow each function's parameters schema."""
        several = several and not self.single_call
        if self.name == TOOL_FORMAT_MISTRAL and self.mistral_names:
            return self._named_calls_grammar(functions, several)
        call = "%json " + json.dumps(self._call_schema(functions))
        if self.name == TOOL_FORMAT_HERMES:
            repeat = ' ("\\n" call)*' if several else ""
            return f'start: call{repeat}\ncall: "{HERMES_OPEN}\\n" {call} "\\n{HERMES_CLOSE}"\n'
        if self.name == TOOL_FORMAT_LLAMA3_JSON:
            return f"start: {call}\n"
        repeat = ' (", " call)*' if several else ""
        return f'start: {self._marker(MISTRAL_CALLS)} "[" call{repeat} "]"\ncall: {call}\n'

    def _named_calls_grammar(self, functions: list[dict[str, Any]], several: bool) -> str:
        args = self._marker(MISTRAL_ARGS)
        branches = " | ".join(
            f"{json.dumps(f['name'])} {args} %json {json.dumps(_layout(_parameters(f)))}"
            for f in functions
        )
        calls = self._marker(MISTRAL_CALLS)
        return f"start: call{'+' if several else ''}\ncall: {calls} ({branches})\n"

    def _marker(self, text: str) -> str:
        token = self.token_ids.get(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    def _call_schema(self, functions: list[dict[str, Any]]) -> dict[str, Any]:
        key = self.arguments_key
        # Where each function's parameters sit in the schema below: their own references
        # ("#/$defs/Loc", pydantic's shape) are rebased there, so they resolve inside them.
        where = (
            [f"#/properties/{key}"]
            if len(functions) == 1
            else [f"#/anyOf/{i}/properties/{key}" for i in range(len(functions))]
        )
        objects = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    key: rebase_refs(_parameters(f), pointer),
                },
                "required": ["name", key],
                "additionalProperties": False,
            }
            for f, pointer in zip(functions, where)
        ]
        return _layout(objects[0] if len(objects) == 1 else {"anyOf": objects})


_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def rebase_refs(schema: Any, pointer: str) -> Any:
    """A copy of ``schema`` whose document-local references ("#", "#/...") point to the same
    places once the schema sits at ``pointer`` (a "#/..." JSON pointer) of a larger one. Values
    that are data, not schemas (enum, const, default, examples), are left as they are."""
    if isinstance(schema, list):
        return [rebase_refs(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = pointer + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = rebase_refs(value, pointer)
    return out


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters", {"type": "object", "properties": {}})


def _layout(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": COMPACT_JSON}
