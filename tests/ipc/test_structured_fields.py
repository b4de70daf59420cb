"""OpenAI's response_format and vLLM's structured_outputs map to one spec; bad shapes name the
field they are in."""

from __future__ import annotations

import json

import pytest

from ipc.structured import StructuredOutputError, StructuredOutputSpec, spec_from_request

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize("kwargs, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputSpec("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA, "strict": True}}},
     StructuredOutputSpec("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": '{"type": "string"}'}},
     StructuredOutputSpec("json_schema", '{"type": "string"}')),
    ({"structured_outputs": {"regex": r"\d+", "choice": None}},
     StructuredOutputSpec("regex", r"\d+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     StructuredOutputSpec("choice", choices=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     StructuredOutputSpec("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputSpec("json_object")),
])
def test_mapping(kwargs, expected):
    assert spec_from_request(**kwargs) == expected


@pytest.mark.parametrize("kwargs, param, fragment", [
    ({"response_format": "json"}, "response_format", 'must be an object with a "type"'),
    ({"response_format": {"type": "xml"}}, "response_format", "got 'xml'"),
    ({"response_format": {"type": "json_schema"}}, "response_format", 'needs a "json_schema"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format", "name must be a string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "must be a JSON schema object"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "got regex, choice"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one choice"),
    ({"structured_outputs": {"choice": [1]}}, "structured_outputs.choice", "list of strings"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty regex"),
    ({"structured_outputs": {"grammar": 5}}, "structured_outputs.grammar", "must be a string"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not both"),
])
def test_bad_shapes_name_the_field(kwargs, param, fragment):
    with pytest.raises(StructuredOutputError, match=fragment) as caught:
        spec_from_request(**kwargs)
    assert caught.value.param == param
