"""The one msgpack codec for every message that crosses a process boundary.

A message is a ``@message``-registered dataclass. On the wire it is a msgpack map whose key
``"kind"`` names the message type and whose other keys are the dataclass fields. Decoding is strict:
unknown kinds, unknown fields, missing required fields and wrong types raise ``DecodeError`` with a
message that says what was wrong. msgpack itself is given size limits so a hostile frame cannot
make a process allocate without bound. Nothing is ever pickled.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

from ipc.json_values import json_leaves, lone_surrogate
from ipc.token_ids import pack_ids as pack_ids
from ipc.token_ids import unpack_id_list as unpack_id_list
from ipc.token_ids import unpack_ids as unpack_ids
from ipc.wire_errors import DecodeError, EncodeError

# Hard limits on anything decoded from a socket. Sockets also cap whole frames (MAXMSGSIZE).
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_STR_BYTES = 16 * 1024 * 1024
MAX_BIN_BYTES = 32 * 1024 * 1024
MAX_ARRAY_LEN = 1_000_000
MAX_MAP_LEN = 10_000

_T = TypeVar("_T")
_REGISTRY: dict[str, type] = {}
_FIELDS: dict[type, tuple[tuple[str, Any, bool], ...]] = {}
_DECODERS: dict[Any, Callable[[Any, str], Any]] = {}


def message(cls: type[_T]) -> type[_T]:
    """Registers a dataclass as a wire message; its ``KIND`` class attribute names it."""
    kind = getattr(cls, "KIND", None)
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{cls.__name__} needs a KIND string to be a message")
    if kind in _REGISTRY:
        raise TypeError(f"message kind {kind!r} registered twice")
    _REGISTRY[kind] = cls
    return cls


def _field_specs(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    specs = _FIELDS.get(cls)
    if specs is None:
        module = sys.modules[cls.__module__]
        hints = typing.get_type_hints(cls, vars(module))
        specs = tuple(
            (
                f.name,
                hints[f.name],
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
        )
        _FIELDS[cls] = specs
    return specs


_PLAIN_TYPES = (str, int, float, bool, bytes, type(None))
_ENCODERS: dict[type, Callable[[Any], dict]] = {}


def _may_hold_dataclass(hint: Any) -> bool:
    """Whether a field of this type can hold a dataclass (then it is walked when encoded)."""
    if hint in _PLAIN_TYPES:
        return False
    args = typing.get_args(hint)
    if typing.get_origin(hint) is None or not args:
        return hint is Any or dataclasses.is_dataclass(hint) or not isinstance(hint, type)
    return any(_may_hold_dataclass(a) for a in args if a is not Ellipsis)


def _encoder(cls: type) -> Callable[[Any], dict]:
    """The field map of a ``cls`` instance: fields that cannot hold a dataclass are taken as
    they are, in one ``attrgetter`` call; the others are walked. A field at its default (of
    the default's own type; an empty list or map where the default is one) is left out: the
    decoder gives it that default again, and a per-token message is mostly defaults, which
    cost every process on its way to pack, unpack and decode."""
    encoder = _ENCODERS.get(cls)
    if encoder is None:
        specs = _field_specs(cls)
        plain = [name for name, hint, _ in specs if not _may_hold_dataclass(hint)]
        deep = [name for name, hint, _ in specs if _may_hold_dataclass(hint)]
        get_plain = operator.attrgetter(*plain) if len(plain) > 1 else None
        fields = dataclasses.fields(cls)
        defaults = [(f.name, f.default) for f in fields if f.default is not dataclasses.MISSING]
        empties = [f.name for f in fields if f.default_factory in (list, dict)]

        def encoder(value: Any) -> dict:
            if get_plain is not None:
                wire = dict(zip(plain, get_plain(value)))
            else:
                wire = {name: getattr(value, name) for name in plain}
            for name in deep:
                # An empty or absent value (most of them, per token) is written as it is.
                item = getattr(value, name)
                wire[name] = _to_wire(item) if item else item
            for name, default in defaults:
                item = wire[name]
                if item is default or (type(item) is type(default) and item == default):
                    del wire[name]
            for name in empties:
                if not wire[name] and type(wire[name]) in (list, dict):
                    del wire[name]
            return wire

        _ENCODERS[cls] = encoder
    return encoder


def _to_wire(value: Any) -> Any:
    if isinstance(value, _PLAIN_TYPES):
        return value
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encoder(type(value))(value)
    return value


def to_wire(msg: Any) -> dict:
    kind = getattr(type(msg), "KIND", None)
    if kind is None or _REGISTRY.get(kind) is not type(msg):
        raise TypeError(f"{type(msg).__name__} is not a registered message")
    wire = _to_wire(msg)
    wire["kind"] = kind
    return wire


def encode(msg: Any) -> bytes:
    wire = to_wire(msg)
    try:
        return msgpack.packb(wire, use_bin_type=True)
    except (UnicodeEncodeError, OverflowError):
        # Only a failed message is walked: the common case costs nothing more.
        found = _unencodable(wire)
        raise (found or EncodeError("", "the message cannot be encoded")) from None


def _unencodable(wire: dict) -> EncodeError | None:
    """The first value of a message that msgpack cannot carry, as an EncodeError."""
    for path, value in json_leaves(wire):
        if isinstance(value, str) and (problem := lone_surrogate(value)) is not None:
            return EncodeError(path, problem)
        if isinstance(value, int) and not -(2**63) <= value < 2**64:
            return EncodeError(path, f"the integer {value} does not fit in 64 bits")
    return None


def unpack_frame(frame: bytes) -> Any:
    """msgpack with size limits; raises DecodeError on anything malformed."""
    if len(frame) > MAX_FRAME_BYTES:
        raise DecodeError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            # Integer keys are allowed (logit_bias maps token ids); every map is then decoded
            # against its field's type, which checks each key's type (dec_dict below). Map
            # lengths are capped, and int and float hashes cannot be made to collide more than
            # a few times within msgpack's 64-bit range.
            strict_map_key=False,
            max_str_len=MAX_STR_BYTES,
            max_bin_len=MAX_BIN_BYTES,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
        )
    except UnicodeDecodeError as exc:
        raise DecodeError(f"invalid UTF-8 in a string: {exc.reason}") from None
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise DecodeError(f"malformed msgpack frame: {type(exc).__name__}: {exc}") from None


def decode(frame: bytes) -> Any:
    return from_wire(unpack_frame(frame))


def decode_as(frame: bytes, *kinds: type[_T]) -> _T:
    """Decodes and checks that the message is one of ``kinds``."""
    msg = decode(frame)
    if kinds and not isinstance(msg, kinds):
        allowed = ", ".join(k.KIND for k in kinds)  # type: ignore[attr-defined]
        raise DecodeError(
            f"message kind {type(msg).KIND!r} is not accepted here (expected {allowed})"
        )
    return msg


def from_wire(obj: Any) -> Any:
    if not isinstance(obj, dict):
        raise DecodeError(f"a message must be a map, got {_type_name(obj)}")
    kind = obj.get("kind")
    if not isinstance(kind, str):
        raise DecodeError("message has no 'kind' string")
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise DecodeError(f"unknown message kind {kind!r}")
    return _decode_dataclass(cls, obj, kind, skip="kind")


# Per dataclass, its fields by name: (the value types taken as they are, or None for any value;
# the field's decoder), and its required fields. A value whose type is exactly one of the first
# needs no decoder call (it would return it unchanged): most fields of the per-token messages.
_PLANS: dict[type, tuple[dict[str, tuple[frozenset | None, Any]], frozenset[str]]] = {}
_NONE = type(None)


def _taken_as_is(hint: Any) -> frozenset | None:
    if hint is Any:
        return None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [_taken_as_is(a) for a in typing.get_args(hint) if a is not _NONE]
        if len(inner) != 1:
            return frozenset()  # not a type the codec decodes: _make_decoder says so
        return None if inner[0] is None else inner[0] | {_NONE}
    return frozenset({hint}) if hint in (str, bytes, bool, int, float) else frozenset()


def _plan(cls: type) -> tuple[dict[str, tuple[frozenset | None, Any]], frozenset[str]]:
    plan = _PLANS.get(cls)
    if plan is None:
        specs = _field_specs(cls)
        fields = {name: (_taken_as_is(hint), hint) for name, hint, _ in specs}
        plan = _PLANS[cls] = (fields, frozenset(name for name, _, required in specs if required))
    return plan


def _decode_dataclass(cls: type, obj: Any, where: str, skip: str = "") -> Any:
    """The fast way: a value of a type taken as it is is not walked; a message with anything
    wrong (an unknown or missing field, a bad value) is decoded again the strict way, which
    names the first fault in field order."""
    if not isinstance(obj, dict):
        raise DecodeError(f"{where}: expected a map, got {_type_name(obj)}")
    fields, required = _plan(cls)
    kwargs = {}
    try:
        for name, value in obj.items():
            if skip and name == skip:
                continue
            as_is, hint = fields[name]
            if as_is is None or type(value) in as_is:
                kwargs[name] = value
            else:
                kwargs[name] = _decode_value(hint, value, where)
    except (KeyError, DecodeError):
        kwargs = {}
    if not kwargs.keys() >= required or len(kwargs) + bool(skip) < len(obj):
        body = {k: v for k, v in obj.items() if not (skip and k == skip)}
        return _decode_strictly(cls, body, where)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"{where}: {exc}") from None


def _decode_strictly(cls: type, obj: dict, where: str) -> Any:
    specs = _field_specs(cls)
    known = {name for name, _, _ in specs}
    unknown = [k for k in obj if k not in known]
    if unknown:
        raise DecodeError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")
    kwargs = {}
    for name, hint, required in specs:
        if name in obj:
            kwargs[name] = _decode_value(hint, obj[name], f"{where}.{name}")
        elif required:
            raise DecodeError(f"{where}: missing field {name!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"{where}: {exc}") from None


def _decode_value(hint: Any, value: Any, where: str) -> Any:
    fn = _DECODERS.get(hint)
    if fn is None:
        fn = _make_decoder(hint)
        _DECODERS[hint] = fn
    return fn(value, where)


def _make_decoder(hint: Any) -> Callable[[Any, str], Any]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return lambda v, w: v
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        allows_none = len(non_none) != len(args)
        if len(non_none) != 1:
            raise TypeError(f"unsupported union {hint}")
        inner = non_none[0]

        def dec_optional(v: Any, w: str) -> Any:
            if v is None:
                if allows_none:
                    return None
                raise DecodeError(f"{w}: must not be null")
            return _decode_value(inner, v, w)

        return dec_optional
    if origin is list:
        (item,) = args
        item_as_is = _taken_as_is(item)

        def dec_list(v: Any, w: str) -> Any:
            if not isinstance(v, list):
                raise DecodeError(f"{w}: expected a list, got {_type_name(v)}")
            if item_as_is is None or all(type(x) in item_as_is for x in v):
                return list(v)
            return [_decode_value(item, x, f"{w}[{i}]") for i, x in enumerate(v)]

        return dec_list
    if origin is dict:
        key_t, val_t = args

        def dec_dict(v: Any, w: str) -> Any:
            if not isinstance(v, dict):
                raise DecodeError(f"{w}: expected a map, got {_type_name(v)}")
            return {
                _decode_value(key_t, k, f"{w} key"): _decode_value(val_t, x, f"{w}[{k!r}]")
                for k, x in v.items()
            }

        return dec_dict
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return lambda v, w: _decode_dataclass(hint, v, w)
    return _scalar_decoder(hint)


def _scalar_decoder(hint: Any) -> Callable[[Any, str], Any]:
    """A number, a string, bytes or a bool, strictly: no bool for an int, no int for a str."""
    if hint is float:

        def dec_float(v: Any, w: str) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise DecodeError(f"{w}: expected a number, got {_type_name(v)}")
            return float(v)

        return dec_float
    if hint is int:

        def dec_int(v: Any, w: str) -> int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise DecodeError(f"{w}: expected an integer, got {_type_name(v)}")
            return v

        return dec_int
    if hint in (str, bytes, bool):

        def dec_exact(v: Any, w: str) -> Any:
            if type(v) is not hint:
                raise DecodeError(f"{w}: expected {hint.__name__}, got {_type_name(v)}")
            return v

        return dec_exact
    raise TypeError(f"unsupported field type {hint!r}")


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__
