"""What a frame that failed to decode still tells: enough to attribute the error to a request
and its client instead of dropping the frame silently."""

from __future__ import annotations

from typing import Any

import msgpack

from ipc.codec import MAX_ARRAY_LEN, MAX_FRAME_BYTES, MAX_MAP_LEN


def salvage_fields(frame: bytes, *names: str) -> dict[str, Any]:
    """Best-effort read of a few top-level fields from a frame that failed to decode.

    ``names`` may be dotted paths into nested maps. Used to attribute an error to a request (and
    the client that sent it) instead of dropping the frame silently. Invalid UTF-8 elsewhere in
    the frame is tolerated, and so are strings and binaries over the decoding limits (a 20 MB
    prompt is still attributable: no value can be longer than the frame, which the sockets cap
    already); a field comes back only if it has a plain str/bytes value. Never raises.
    """
    if len(frame) > MAX_FRAME_BYTES:
        return {}
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            unicode_errors="surrogateescape",
            strict_map_key=False,
            max_str_len=len(frame),
            max_bin_len=len(frame),
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
        )
    except Exception:
        return {}
    if not isinstance(obj, dict):
        return {}
    found = {}
    for name in names:
        value: Any = obj
        for part in name.split("."):  # "meta.client_id" reaches into a nested map
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, bytes) or (
            isinstance(value, str) and value.isprintable() and _is_clean_utf8(value)
        ):
            found[name] = value
    return found


def _is_clean_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:  # surrogate-escaped bytes: the original was not valid UTF-8
        return False
