"""Structured outputs and tool calls as they cross the wire, and the client-facing fields that
ask for them.

``StructuredOutputSpec`` is what a request's output must match (OpenAI's ``response_format``,
vLLM's ``structured_outputs``); ``spec_from_request`` turns those fields into one, checking
shapes only and naming the field on a bad one (whether a schema or pattern is usable is the
tokenizer worker's compiler's call). ``ToolCall`` is a call in a chat history, ``ToolCallDelta``
a piece of one streaming out of the detokenizer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipc.codec import message

# Structured-output kinds: OpenAI's response_format and vLLM's structured_outputs fields.
STRUCTURED_JSON_SCHEMA = "json_schema"  # text: the schema as JSON text
STRUCTURED_JSON_OBJECT = "json_object"  # any JSON object; text unused
STRUCTURED_REGEX = "regex"  # text: a pattern the whole output matches
STRUCTURED_CHOICE = "choice"  # choices: the output is exactly one of them
STRUCTURED_GRAMMAR = "grammar"  # text: a context-free grammar (GBNF/EBNF or Lark syntax)
STRUCTURED_KINDS = (
    STRUCTURED_JSON_SCHEMA,
    STRUCTURED_JSON_OBJECT,
    STRUCTURED_REGEX,
    STRUCTURED_CHOICE,
    STRUCTURED_GRAMMAR,
)
MAX_STRUCTURED_TEXT_CHARS = 1024 * 1024

# Tool-call formats: how a model family writes its calls (the tokenizer worker prompts and
# enforces one, the detokenizer's parser of that name reads it back; RequestMeta.tool_parser).
TOOL_FORMAT_HERMES = "hermes"  # <tool_call>{...}</tool_call>: Qwen2.5/3, Hermes, the default
TOOL_FORMAT_LLAMA3_JSON = "llama3_json"  # {"name": ..., "parameters": {...}}: Llama 3.1-3.3
TOOL_FORMAT_MISTRAL = "mistral"  # [TOOL_CALLS]...: Mistral
TOOL_CALL_FORMATS = (TOOL_FORMAT_HERMES, TOOL_FORMAT_LLAMA3_JSON, TOOL_FORMAT_MISTRAL)
MAX_STRUCTURED_CHOICES = 1024
MAX_STRUCTURED_CHOICE_CHARS = 4096


@dataclass(slots=True)
class StructuredOutputSpec:
    """What a request's output must match. Plain text fields only: the tokenizer worker turns it
    into a grammar (tokenizer_worker.grammar_compiler), the engine never sees the spec itself.
    Shape errors raise ValueError at construction; whether a schema or pattern is acceptable is
    the compiler's call (it names the problem)."""

    kind: str
    text: str = ""
    choices: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"structured output kind must be one of "
                f"{', '.join(STRUCTURED_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.text, str):
            raise ValueError("structured output text must be a string")
        if len(self.text) > MAX_STRUCTURED_TEXT_CHARS:
            raise ValueError(
                f"the {self.kind} is longer than {MAX_STRUCTURED_TEXT_CHARS} characters"
            )
        needs_text = self.kind in (STRUCTURED_JSON_SCHEMA, STRUCTURED_REGEX, STRUCTURED_GRAMMAR)
        if needs_text and not self.text:
            raise ValueError(f"a {self.kind} structured output needs a non-empty {self.kind}")
        if not needs_text and self.text:
            raise ValueError(f"a {self.kind} structured output takes no text")
        if self.kind == STRUCTURED_CHOICE:
            if not self.choices:
                raise ValueError("a choice structured output needs at least one choice")
            if len(self.choices) > MAX_STRUCTURED_CHOICES:
                raise ValueError(f"at most {MAX_STRUCTURED_CHOICES} choices")
            for c in self.choices:
                if not isinstance(c, str) or not c or len(c) > MAX_STRUCTURED_CHOICE_CHARS:
                    raise ValueError(
                        f"choices must be non-empty strings of at most "
                        f"{MAX_STRUCTURED_CHOICE_CHARS} characters, got {c!r:.80}"
                    )
        elif self.choices:
            raise ValueError(f"a {self.kind} structured output takes no choices")

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredOutputSpec:
        """From a parsed schema, without spaces. Keys keep their order: the output follows the
        order of ``properties``, as clients expect."""
        return cls(
            STRUCTURED_JSON_SCHEMA, json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        )

    def cache_key(self) -> tuple[str, str, tuple[str, ...]]:
        return (self.kind, self.text, tuple(self.choices))


@dataclass(slots=True)
class ToolCall:
    """A function call an assistant made, as a chat history carries it (OpenAI's ``tool_calls``
    entries); ``arguments`` is the JSON text the model wrote."""

    id: str
    name: str
    arguments: str = "{}"

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of a streamed tool call: the first of each call carries its id and name, the
    following ones fragments of its ``arguments`` JSON (concatenated, they are the arguments)."""

    index: int  # the call's position among the request's calls
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        """One entry of a stream chunk's ``delta.tool_calls``."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def add_tool_call_deltas(calls: list[ToolCall], deltas: list[ToolCallDelta]) -> None:
    """Folds streamed deltas into whole calls (a call's first delta opens it, the others append
    to its arguments)."""
    for d in deltas:
        if d.id is not None:
            calls.append(ToolCall(d.id, d.name or "", d.arguments))
        elif 0 <= d.index < len(calls):
            calls[d.index].arguments += d.arguments


@message
@dataclass(slots=True)
class GrammarVocabulary:
    """The vocabulary as the grammar backend needs it: every token's bytes, which ids are special
    (never text) and which end a sequence. A tokenizer worker computes it from its tokenizer and
    sends it to the engine once, ahead of any request that needs it, so the engine builds its
    grammar matchers from data and never imports a tokenizer. Ids from the tokenizer's table
    size up to ``vocab_size`` (padding rows of the model's output) have no bytes.
    """

    KIND = "grammar_vocabulary"
    vocab_size: int  # the model's logits width
    token_bytes: bytes  # every token's bytes, concatenated in id order
    token_ends: bytes  # packed int32: where each token's bytes end in token_bytes
    special_ids: bytes  # packed int32, ascending
    eos_ids: list[int]
    fingerprint: str = ""  # a digest of the fields above (vocabulary.fingerprint)

    def __post_init__(self) -> None:
        if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {self.vocab_size!r}")
        if len(self.token_ends) % 4 or len(self.special_ids) % 4:
            raise ValueError("token_ends and special_ids must be packed int32")
        if len(self.token_ends) // 4 > self.vocab_size:
            raise ValueError(
                f"{len(self.token_ends) // 4} tokens do not fit a vocabulary of {self.vocab_size}"
            )
        if not self.eos_ids or any(not 0 <= t < self.vocab_size for t in self.eos_ids):
            raise ValueError(f"eos_ids must be non-empty ids below {self.vocab_size}")

    def token_table(self) -> list[bytes]:
        """Every token's bytes, indexed by id, ``vocab_size`` entries (padding ids get b"")."""
        ends = np.frombuffer(self.token_ends, dtype="<i4")
        if ends.size and (
            int(ends[-1]) != len(self.token_bytes) or bool((np.diff(ends, prepend=0) < 0).any())
        ):
            raise ValueError("token_ends do not describe token_bytes")
        data, ends_list = self.token_bytes, ends.tolist()
        table = [data[a:b] for a, b in zip([0] + ends_list[:-1], ends_list)]
        return table + [b""] * (self.vocab_size - len(table))

    def special_id_list(self) -> list[int]:
        return np.frombuffer(self.special_ids, dtype="<i4").tolist()

    def digest(self) -> str:
        """Equal for equal vocabularies: lets the engine check that every worker agrees."""
        h = hashlib.sha256()
        for part in (
            str(self.vocab_size).encode(),
            self.token_bytes,
            self.token_ends,
            self.special_ids,
            repr(self.eos_ids).encode(),
        ):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.hexdigest()


# vLLM's structured_outputs keys -> our kinds ("json" takes a schema, as an object or JSON text).
VLLM_KEYS = {
    "json": "json",
    "regex": STRUCTURED_REGEX,
    "choice": STRUCTURED_CHOICE,
    "grammar": STRUCTURED_GRAMMAR,
    "json_object": STRUCTURED_JSON_OBJECT,
}


class StructuredOutputError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def spec_from_request(
    response_format: Any = None, structured_outputs: Any = None
) -> StructuredOutputSpec | None:
    """The request's spec, or None when its output is free text. Both fields at once is an
    error: which one should win is not for the server to guess."""
    from_format = spec_from_response_format(response_format)
    from_vllm = spec_from_structured_outputs(structured_outputs)
    if from_format is not None and from_vllm is not None:
        raise StructuredOutputError(
            "give response_format or structured_outputs, not both", "structured_outputs"
        )
    return from_format or from_vllm


def spec_from_response_format(response_format: Any) -> StructuredOutputSpec | None:
    param = "response_format"
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise StructuredOutputError('response_format must be an object with a "type"', param)
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec(STRUCTURED_JSON_OBJECT)
    if kind != "json_schema":
        raise StructuredOutputError(
            f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}',
            param,
        )
    body = response_format.get("json_schema")
    if not isinstance(body, dict):
        raise StructuredOutputError(
            'response_format "json_schema" needs a "json_schema" object with "name" and "schema"',
            param,
        )
    name = body.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise StructuredOutputError(
            "response_format.json_schema.name must be a string of 1-64 characters", param
        )
    # The grammar is always enforced, so "strict" (OpenAI's opt-in to that) changes nothing.
    return _schema_spec(body.get("schema", {}), f"{param}.json_schema.schema")


def spec_from_structured_outputs(fields: Any) -> StructuredOutputSpec | None:
    param = "structured_outputs"
    if fields is None:
        return None
    if not isinstance(fields, dict):
        raise StructuredOutputError("structured_outputs must be an object", param)
    given = {k: v for k, v in fields.items() if k in VLLM_KEYS and v not in (None, False)}
    if len(given) != 1:
        raise StructuredOutputError(
            f"structured_outputs needs exactly one of {', '.join(VLLM_KEYS)}, got "
            f"{', '.join(given) or 'none'}",
            param,
        )
    ((key, value),) = given.items()
    where = f"{param}.{key}"
    if key == "json":
        if isinstance(value, str):
            try:
                return StructuredOutputSpec("json_schema", value)
            except ValueError as exc:
                raise StructuredOutputError(str(exc), where) from None
        return _schema_spec(value, where)
    if key == "json_object":
        if value is not True:
            raise StructuredOutputError(f"{where} must be true", where)
        return StructuredOutputSpec(STRUCTURED_JSON_OBJECT)
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise StructuredOutputError(f"{where} must be a list of strings", where)
        return _spec(STRUCTURED_CHOICE, where, choices=value)
    if not isinstance(value, str):
        raise StructuredOutputError(f"{where} must be a string", where)
    return _spec(VLLM_KEYS[key], where, text=value)


def _schema_spec(schema: Any, where: str) -> StructuredOutputSpec:
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError(f"{where} must be a JSON schema object", where)
    try:
        return StructuredOutputSpec.json_schema(schema)
    except (TypeError, ValueError) as exc:  # not JSON-serializable, or too long
        raise StructuredOutputError(f"{where}: {exc}", where) from None
    except RecursionError:
        raise StructuredOutputError(f"{where} nests too deeply", where) from None


def _spec(kind: str, where: str, **fields: Any) -> StructuredOutputSpec:
    try:
        return StructuredOutputSpec(kind, **fields)
    except ValueError as exc:
        raise StructuredOutputError(str(exc), where) from None
