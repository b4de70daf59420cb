"""What the structured-output benchmarks constrain: a nested JSON schema (object in object, enum,
bounded array), a large one, a regex, a GBNF list and a choice."""

from __future__ import annotations

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "address", "color", "tags", "active"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)"
GBNF = 'root ::= item (", " item)*\nitem ::= [a-z]+ | [0-9]+'
CHOICES = ["positive", "negative", "neutral"]
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "paris", "tokyo", "lima", "oslo", "kyiv"]


def large_schema(fields: int = 120) -> dict:
    """An object of many typed properties with nested objects, enums and bounded arrays."""
    props = {}
    for i in range(fields):
        kind = i % 4
        if kind == 0:
            props[f"field_{i}"] = {"type": "string", "maxLength": 20}
        elif kind == 1:
            props[f"field_{i}"] = {"enum": [f"v{i}_{j}" for j in range(6)]}
        elif kind == 2:
            props[f"field_{i}"] = {"type": "array", "items": {"type": "integer"}, "maxItems": 4}
        else:
            props[f"field_{i}"] = {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "boolean"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }
