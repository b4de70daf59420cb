"""Our own int4 decode kernel (int4_decode.cpp), a prototype beside ``aten._weight_int4pack_mm``.

A few bf16 rows against ``Int4Linear``'s weights, the products (q - 8) * x exact and summed in
float32 (AVX-512 BF16 dot products), tiles of 16 outputs split over torch's OpenMP threads.

The library is compiled once per source and flags into ``~/.cache/splitserve/kernels`` (g++,
named by a hash of both, so a restart loads it and an edited source builds anew) and loaded with
ctypes after torch: its ``libgomp.so.1`` is then torch's own, one thread team for both.
``library()`` is None where there is no compiler or the CPU lacks AVX-512 BF16: callers keep the
aten kernel there.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from engine_worker.device import cpu_has_native_bf16
from engine_worker.linear import Int4Groups, Int4Linear

SOURCE = Path(__file__).with_name("int4_decode.cpp")
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off"]
FLAGS += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"]
TILE, GROUP, BLOCK_BYTES = 16, 32, 320
CACHE_DIR = Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return CACHE_DIR / "kernels" / f"int4_decode-{digest}.so"


def build(path: Path) -> None:
    """Compiles the source into ``path`` (a temporary name first, then renamed: a concurrent
    process never loads half a file)."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise FileNotFoundError("g++")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(out)], check=True)
        out.replace(path)


@cache
def library() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None where it cannot run here."""
    if not cpu_has_native_bf16() or shutil.which("g++") is None and not library_path().exists():
        return None
    path = library_path()
    if not path.exists():
        build(path)
    lib = ctypes.CDLL(str(path))
    lib.int4_decode.restype = ctypes.c_int
    lib.int4_decode.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 2, ctypes.c_void_p]
    lib.int4_decode.argtypes += [*[ctypes.c_int64] * 2, ctypes.c_void_p, ctypes.c_int64]
    lib.int4_decode.argtypes += [ctypes.c_int]
    return lib


def pack(groups: Int4Groups) -> torch.Tensor:
    """The kernel's blocks [N / 16, K / 32, 320] uint8 from q [N, K] and scale/zero [N, K / 32]
    (rounded to bf16, as ``Int4Linear`` holds them); layout in int4_decode.cpp."""
    n, k = groups.q.shape
    tiles, blocks = n // TILE, k // GROUP
    # q[n = 16 t + i // 2, k = 32 g + 2 (4 c + s) + i % 2] -> [t, g, c, i, s]
    q = groups.q.to(torch.int32).view(tiles, TILE, blocks, 4, 4, 2)
    q = q.permute(0, 2, 3, 1, 5, 4).reshape(tiles, blocks, 4, 2 * TILE, 4)
    shifts = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    words = (q << shifts).sum(-1).to(torch.int16)  # bits past 16 are never set: 4 nibbles
    weights = words.view(torch.uint8).reshape(tiles, blocks, 256)
    pairs = torch.stack([groups.scale, groups.zero], dim=-1).to(torch.bfloat16)  # [N, K/32, 2]
    pairs = pairs.view(tiles, TILE, blocks, 2).transpose(1, 2).contiguous()
    return torch.cat([weights, pairs.view(torch.uint8).reshape(tiles, blocks, 64)], -1)


def groups_of(layer: Int4Linear) -> Int4Groups:
    """The q, scale and zero an ``Int4Linear`` computes with (its planes side by side along K):
    q read back through the aten kernel itself, with scale 1 and zero 8 on identity rows."""
    scale_zero = layer.scale_zero  # [K / group, N, 2]
    k, n = scale_zero.shape[0] * layer.group, scale_zero.shape[1]
    unit = torch.empty_like(scale_zero)
    unit[..., 0], unit[..., 1] = 1, 8
    eye = torch.eye(k, dtype=scale_zero.dtype)
    q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.packed, layer.group, unit)
    scale, zero = scale_zero.float().permute(2, 1, 0)
    return Int4Groups(q.t().to(torch.uint8).contiguous(), scale.contiguous(), zero.contiguous())


class Int4DecodeLinear:
    """An ``Int4Linear``'s weights repacked for the kernel; ``apply`` as the layer's."""

    def __init__(self, layer: Int4Linear) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("the int4 decode kernel cannot run here (no g++ or AVX-512 BF16)")
        self.lib, self.parts, self.bias = lib, layer.parts, layer.bias
        self.out_features = layer.out_features
        self.blocks = pack(groups_of(layer))
        self.in_features = self.blocks.shape[1] * GROUP

    def apply(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        x = x.contiguous() if self.parts == 1 else x.repeat(1, self.parts)
        if x.dtype != torch.bfloat16 or x.shape[1] != self.in_features:
            raise ValueError(f"needs bf16 rows of {self.in_features}, got {x.dtype} {x.shape}")
        y = torch.empty(x.shape[0], self.out_features, dtype=out_dtype)
        n, k, m = self.out_features, self.in_features, x.shape[0]
        f32 = int(out_dtype == torch.float32)
        args = (self.blocks.data_ptr(), n, k, x.data_ptr(), m, k, y.data_ptr(), n, f32)
        if self.lib.int4_decode(*args):
            raise ValueError(f"shape {n} x {k} not taken by the kernel")
        return y if self.bias is None else y + self.bias
