"""OpenAI's ``response_format`` and vLLM's ``structured_outputs`` request fields, turned into the
StructuredOutputSpec the tokenizer workers compile. Shapes only: whether a schema or pattern is
usable is the compiler's call. Bad shapes raise StructuredOutputError naming the field (a 400).
"""

from __future__ import annotations

from typing import Any

from ipc.messages import (
    STRUCTURED_CHOICE,
    STRUCTURED_GRAMMAR,
    STRUCTURED_JSON_OBJECT,
    STRUCTURED_REGEX,
    StructuredOutputSpec,
)

# vLLM's structured_outputs keys -> our kinds ("json" takes a schema, as an object or JSON text).
VLLM_KEYS = {"json": "json", "regex": STRUCTURED_REGEX, "choice": STRUCTURED_CHOICE,
             "grammar": STRUCTURED_GRAMMAR, "json_object": STRUCTURED_JSON_OBJECT}


class StructuredOutputError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def spec_from_request(response_format: Any = None,
                      structured_outputs: Any = None) -> StructuredOutputSpec | None:
    """The request's spec, or None when its output is free text. Both fields at once is an
    error: which one should win is not for the server to guess."""
    from_format = spec_from_response_format(response_format)
    from_vllm = spec_from_structured_outputs(structured_outputs)
    if from_format is not None and from_vllm is not None:
        raise StructuredOutputError("give response_format or structured_outputs, not both",
                                    "structured_outputs")
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
        raise StructuredOutputError(f'response_format type must be "text", "json_object" or '
                                    f'"json_schema", got {kind!r}', param)
    body = response_format.get("json_schema")
    if not isinstance(body, dict):
        raise StructuredOutputError('response_format "json_schema" needs a "json_schema" object '
                                    'with "name" and "schema"', param)
    name = body.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise StructuredOutputError("response_format.json_schema.name must be a string of 1-64 "
                                    "characters", param)
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
            f"{', '.join(given) or 'none'}", param)
    (key, value), = given.items()
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


def _spec(kind: str, where: str, **fields: Any) -> StructuredOutputSpec:
    try:
        return StructuredOutputSpec(kind, **fields)
    except ValueError as exc:
        raise StructuredOutputError(str(exc), where) from None
