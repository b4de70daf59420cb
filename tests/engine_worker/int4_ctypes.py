"""The int4 decode kernel (engine_worker/int4_decode.cpp) as a plain library loaded with ctypes:
the reference the torch op ``splitserve::int4_decode_mm`` is tested against, the same source
built without torch's dispatcher. Built on first use into the kernel cache beside the op."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

from engine_worker import int4_decode
from engine_worker.int4_decode import SOURCE


def library_path() -> Path:
    return int4_decode.build_path("int4_decode", [SOURCE], int4_decode.FLAGS)


@cache
def library() -> ctypes.CDLL | None:
    """The ctypes library, built on first use; None where it cannot run here."""
    path = library_path()
    if not int4_decode.cpu_supported() or shutil.which("g++") is None and not path.exists():
        return None
    try:
        if not path.exists():
            int4_decode.build(path, SOURCE, int4_decode.FLAGS)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError):
        return None
    lib.int4_decode.restype = ctypes.c_int
    lib.int4_decode.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 2, ctypes.c_void_p]
    lib.int4_decode.argtypes += [*[ctypes.c_int64] * 2, ctypes.c_void_p, ctypes.c_int64]
    lib.int4_decode.argtypes += [ctypes.c_int] * 4
    return lib


def apply_ctypes(blocks: torch.Tensor, x: torch.Tensor, parts: int = 1, f32: bool = False):
    """``int4_decode_mm`` through the ctypes library (None where it cannot run): bf16 rows x
    [M, K] -> [M, N] bf16, or float32 sums before their rounding (``f32``)."""
    lib = library()
    if lib is None:
        return None
    x = x.contiguous() if parts == 1 else x.repeat(1, parts)
    n, k, sub, high, code = int4_decode.layout_of(blocks)
    m = x.shape[0]
    if x.dtype != torch.bfloat16 or x.shape[1] != k:
        raise ValueError(f"needs bf16 rows of {k // parts}, got {x.dtype} {tuple(x.shape)}")
    y = torch.empty(m, n, dtype=torch.float32 if f32 else torch.bfloat16)
    args = (blocks.data_ptr(), n, k, x.data_ptr(), m, k, y.data_ptr(), n, int(f32), sub, high, code)
    if lib.int4_decode(*args):
        raise ValueError(f"shape {n} x {k} not taken by the kernel")
    return y
