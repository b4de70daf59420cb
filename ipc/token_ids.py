"""Token ids on the wire (ipc.codec re-exports these)."""

from __future__ import annotations

import sys
from array import array
from typing import Any

import numpy as np

from ipc.wire_errors import DecodeError

# Token ids travel as packed little-endian int32, not a msgpack list of ints: one memcpy each way.
_ID_DTYPE = np.dtype("<i4")


def pack_ids(ids: Any) -> bytes:
    if isinstance(ids, np.ndarray):
        return ids.astype(_ID_DTYPE, copy=False).tobytes()
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple, array)):
        ids = ids.tolist()  # torch tensors
    return (
        array("i", ids).tobytes()
        if sys.byteorder == "little"
        else np.asarray(ids, dtype=_ID_DTYPE).tobytes()
    )


def unpack_ids(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise DecodeError(f"packed token ids have {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype=_ID_DTYPE)


def unpack_id_list(data: bytes) -> list[int]:
    return unpack_ids(data).tolist()
