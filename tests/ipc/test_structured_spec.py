"""StructuredOutputSpec: shape checks at construction, and a strict round trip through msgpack."""

from __future__ import annotations

import msgpack
import pytest

from ipc import codec
from ipc.codec import DecodeError
from ipc.structured import MAX_STRUCTURED_TEXT_CHARS, StructuredOutputSpec

S = StructuredOutputSpec


def round_trip(value):
    # The spec is a field type, not a message of its own: the codec's field path carries it.
    frame = msgpack.packb(codec._to_wire(value), use_bin_type=True)
    return codec._decode_value(StructuredOutputSpec, codec.unpack_frame(frame), "spec")


@pytest.mark.parametrize(
    "spec",
    [
        S.json_schema({"type": "object", "properties": {"zé": {"enum": ["✓", 1]}}}),
        S("json_object"),
        S("regex", r"^\d+$"),
        S("choice", choices=["a", "b c"]),
        S("grammar", 'root ::= "x"'),
    ],
)
def test_round_trip(spec):
    assert round_trip(spec) == spec


def test_json_schema_keeps_property_order_and_drops_spaces():
    spec = S.json_schema({"b": 1, "a": {"c": [1, 2]}})
    assert spec.text == '{"b":1,"a":{"c":[1,2]}}'
    assert spec.cache_key() == S.json_schema({"b": 1, "a": {"c": [1, 2]}}).cache_key()


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"kind": "xml"}, "kind must be one of"),
        ({"kind": "regex"}, "needs a non-empty regex"),
        ({"kind": "json_object", "text": "{}"}, "takes no text"),
        ({"kind": "choice"}, "at least one choice"),
        ({"kind": "choice", "choices": ["a", ""]}, "non-empty strings"),
        ({"kind": "regex", "text": "a", "choices": ["a"]}, "takes no choices"),
        ({"kind": "grammar", "text": "x" * (MAX_STRUCTURED_TEXT_CHARS + 1)}, "longer than"),
    ],
)
def test_bad_shapes_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        S(**kwargs)


@pytest.mark.parametrize(
    "wire, fragment",
    [
        ({"kind": "regex", "text": 5}, "expected str"),
        ({"kind": "choice", "choices": "ab"}, "expected a list"),
        ({"kind": "regex", "text": "a", "extra": 1}, "unknown field"),
        ({"text": "a"}, "missing field 'kind'"),
        ({"kind": "choice", "choices": []}, "at least one choice"),
    ],
)
def test_malformed_wire_values_are_decode_errors(wire, fragment):
    with pytest.raises(DecodeError, match=fragment):
        codec._decode_value(StructuredOutputSpec, wire, "spec")
