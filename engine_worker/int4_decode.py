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
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from engine_worker.linear import Int4Groups, Int4Linear

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_decode.cpp")
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off"]
FLAGS += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma"]
CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
TILE, GROUP, BLOCK_BYTES = 16, 32, 320
CACHE_DIR = Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return CACHE_DIR / "kernels" / f"int4_decode-{digest}.so"


def build(path: Path) -> None:
    """Compiles the source into ``path`` (a temporary name first, then renamed: a concurrent
    process never loads half a file) and removes the builds of other sources."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise FileNotFoundError("g++")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(out)], check=True)
        out.replace(path)
    for stale in path.parent.glob("int4_decode-*.so"):  # builds of other sources
        if stale != path:
            stale.unlink(missing_ok=True)  # a process still holding one keeps its mapping


def cpu_supported() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return CPU_FLAGS <= set(flags.partition(":")[2].split())


@cache
def library() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None where it cannot run here."""
    if not cpu_supported() or shutil.which("g++") is None and not library_path().exists():
        return None
    path = library_path()
    try:
        if not path.exists():
            build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        logger.warning("int4 decode kernel unavailable (%s): aten's kernel stays", exc)
        return None
    lib.int4_decode.restype = ctypes.c_int
    lib.int4_decode.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 2, ctypes.c_void_p]
    lib.int4_decode.argtypes += [*[ctypes.c_int64] * 2, ctypes.c_void_p, ctypes.c_int64]
    lib.int4_decode.argtypes += [ctypes.c_int]
    lib.int4_decode_int8.restype = ctypes.c_int
    lib.int4_decode_int8.argtypes = [*lib.int4_decode.argtypes, ctypes.c_int]
    return lib


def pack(groups: Int4Groups, variant: str = "bf16") -> torch.Tensor:
    """The kernel's blocks [N / 16, K / 32, 320] uint8 from q [N, K] and scale/zero [N, K / 32]
    (rounded to bf16, as ``Int4Linear`` holds them); layouts in int4_decode.cpp."""
    n, k = groups.q.shape
    tiles, blocks = n // TILE, k // GROUP
    q = groups.q.to(torch.int32)
    if variant == "bf16":
        # q[n = 16 t + i // 2, k = 32 g + 2 (4 c + s) + i % 2] -> [t, g, c, i, s], 16-bit words
        q = q.view(tiles, TILE, blocks, 4, 4, 2).permute(0, 2, 3, 1, 5, 4)
        words = (q.reshape(tiles, blocks, 4, 2 * TILE, 4) << torch.tensor([0, 4, 8, 12])).sum(-1)
        weights = words.to(torch.int16).view(torch.uint8).reshape(tiles, blocks, 256)
    else:
        # q[n = 16 t + j, k = 32 g + 8 c + 4 h + b] -> [t, g, c, j, b, h], bytes
        q = q.view(tiles, TILE, blocks, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        weights = (q[..., 0] | q[..., 1] << 4).to(torch.uint8).reshape(tiles, blocks, 256)
    pairs = torch.stack([groups.scale, groups.zero], dim=-1).to(torch.bfloat16)  # [N, K/32, 2]
    pairs = pairs.view(tiles, TILE, blocks, 2).transpose(1, 2).contiguous()
    return torch.cat([weights, pairs.view(torch.uint8).reshape(tiles, blocks, 64)], -1)


def groups_of(layer: Int4Linear) -> Int4Groups:
    """The q, scale and zero an ``Int4Linear`` computes with (its planes side by side along K):
    q read back through the aten kernel itself, with scale 1 and zero 8 on identity rows."""
    scale_zero = layer.scale_zero  # [K / group, N, 2]
    k = scale_zero.shape[0] * layer.group
    unit = torch.empty_like(scale_zero)
    unit[..., 0], unit[..., 1] = 1, 8
    eye = torch.eye(k, dtype=scale_zero.dtype)
    q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.packed, layer.group, unit)
    scale, zero = scale_zero.float().permute(2, 1, 0)
    return Int4Groups(q.t().to(torch.uint8).contiguous(), scale.contiguous(), zero.contiguous())


# Variants: bf16 (exact products, float32 sums), int8 / int16 (the activation rows quantized per
# group of 32 to 8 or 16 bits, integer dot products): the number of byte planes of the row.
INT_PLANES = {"int8": 1, "int16": 2}
VARIANTS = ("bf16", *INT_PLANES)


class Int4DecodeLinear:
    """An ``Int4Linear``'s weights repacked for the kernel; ``apply`` as the layer's."""

    def __init__(self, layer: Int4Linear, variant: str = "bf16") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        lib = library()
        if lib is None:
            raise RuntimeError("the int4 decode kernel cannot run here (no g++ or AVX-512 BF16)")
        self.lib, self.parts, self.bias = lib, layer.parts, layer.bias
        self.out_features = layer.out_features
        self.planes = INT_PLANES.get(variant, 0)
        self.blocks = pack(groups_of(layer), variant)
        self.in_features = self.blocks.shape[1] * GROUP

    def apply(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        x = x.contiguous() if self.parts == 1 else x.repeat(1, self.parts)
        if x.dtype != torch.bfloat16 or x.shape[1] != self.in_features:
            raise ValueError(f"needs bf16 rows of {self.in_features}, got {x.dtype} {x.shape}")
        y = torch.empty(x.shape[0], self.out_features, dtype=out_dtype)
        n, k, m = self.out_features, self.in_features, x.shape[0]
        f32 = int(out_dtype == torch.float32)
        args = (self.blocks.data_ptr(), n, k, x.data_ptr(), m, k, y.data_ptr(), n, f32)
        failed = (
            self.lib.int4_decode_int8(*args, self.planes)
            if self.planes
            else self.lib.int4_decode(*args)
        )
        if failed:
            raise ValueError(f"shape {n} x {k} not taken by the kernel")
        return y if self.bias is None else y + self.bias
