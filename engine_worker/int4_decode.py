"""Our own int4 decode kernel (int4_decode.cpp), beside ``aten._weight_int4pack_mm_for_cpu``.

A few bf16 rows against int4 groups, the products (q - 8) * x exact and summed in float32
(AVX-512 BF16 dot products), tiles of 16 outputs split over torch's OpenMP threads; a row's bits
do not depend on the call's other rows nor on the thread count.

The torch op ``splitserve::int4_decode_mm`` (int4_decode_op.cpp around int4_decode.cpp), what
``Int4Linear`` and the scripted decode layers call under ``EngineConfig.int4_kernel = "own"``
(and ``int4_decode_grouped_mm``: several weights of one layout in one call, each over its own
rows, a mixture's chosen experts: engine_worker/moe.py),
compiled once by g++ into ``~/.cache/splitserve/kernels/<hash>`` (a hash of the sources, the
flags and torch's version: a restart loads it, an edited source builds anew). ``load_op`` (the
engine's start, before its weights) builds it where this torch has no build yet, once: under a
lock in the cache directory, so two launches at once build once (the second waits, then loads).
Meanwhile the engine heartbeats (``runtime.start_progress``): its start timeout counts silence,
not g++. Where it cannot (no g++, no AVX-512 BF16, a compile error, g++ past BUILD_LIMIT_S, or
SPLITSERVE_NO_KERNEL_BUILD=1) aten's kernel serves, logged once. ``scripts/setup_env.sh`` builds
it ahead (``python -m engine_worker.int4_decode``). The tests build int4_decode.cpp alone too, as
a ctypes library (tests/engine_worker/int4_ctypes.py): the reference the op is checked against.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import IO

import numpy as np
import torch

from engine_worker.linear import Int4Groups
from engine_worker.weight_sources import SUPER_BLOCK
from runtime import start_progress

logger = logging.getLogger("splitserve.engine.int4_decode")

SOURCE = Path(__file__).with_name("int4_decode.cpp")
OP_SOURCE = Path(__file__).with_name("int4_decode_op.cpp")
FLAGS = ["-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off"]
FLAGS += [
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mavx512vnni",
    "-mfma",
    "-mbmi2",
]
CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "bmi2"}
TILE, GROUP, WEIGHT_BYTES, PLANE_BYTES = 16, 32, 256, 64
SUPER = SUPER_BLOCK // GROUP  # blocks a coded layout's header serves: kSuper
# by code (0 bf16 pairs, 1 codes with a min, 2 without): a run's scale bytes, a header's bytes
RUN_BYTES, HEADER_BYTES = (PLANE_BYTES, 32, 16), (0, 64, 32)
# (sub, high) of the coded layouts the kernel has (int4_decode.cpp, ByLayout): with a min
# (Q4_K, Q5_K, Q2_K), without (Q3_K, Q6_K)
CODED = {True: {(1, 0), (1, 1), (2, 0)}, False: {(2, 0), (2, 1), (2, 2)}}
GROUPS = (16, 32)  # scale/zero groups the kernel takes (two or one (scale, zero) runs a block)
MAX_BITS = 6  # q of 4 bits, or 5 or 6 (one or two high-bit planes a block)
MAX_GROUPS = 2048  # blocks of 32 along K (all planes) the kernel takes: kMaxGroups
CACHE_DIR = Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))
NO_BUILD = "SPLITSERVE_NO_KERNEL_BUILD"  # set (not 0): a start-up loads a built op, never builds
BUILD_LIMIT_S = 1200.0  # past it g++ is killed and aten's kernel serves (logged)
SLICE_S = 0.5  # how often a build (or a wait for another's) calls its progress callback
# What a starting engine's heartbeats say meanwhile (the supervisor shows it once)
BUILDING = "building our int4 decode kernel (once for this torch; minutes on a loaded machine)"
WAITING = "waiting for another process building our int4 decode kernel"


def block_bytes(sub: int, high: int, code: int = 0) -> int:
    """A block's bytes (int4_decode.cpp's block_bytes): its nibble words, high-bit planes and
    ``sub`` runs of scales (bf16 pairs, or codes)."""
    return WEIGHT_BYTES + PLANE_BYTES * high + sub * RUN_BYTES[code]


class BuildTimeout(RuntimeError):
    pass


def _op_flags(paths: bool = True) -> list[str]:
    """g++'s flags for the op; without ``paths`` what names the build (not where this torch is
    installed: every checkout with the same torch shares one build)."""
    flags = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *FLAGS]
    if not paths:
        return flags
    from torch.utils import cpp_extension  # ~0.1 s (setuptools): only where it compiles

    flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    return flags + [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu"]


def build_path(name: str, sources: list[Path], flags: list[str]) -> Path:
    text = b"".join(s.read_bytes() for s in sources) + " ".join(flags).encode()
    digest = hashlib.sha256(text + torch.__version__.encode()).hexdigest()[:16]
    return CACHE_DIR / "kernels" / digest / f"{name}.so"


def op_path() -> Path:
    return build_path("int4_decode_op", [SOURCE, OP_SOURCE], _op_flags(paths=False))


def build(
    path: Path,
    source: Path,
    flags: list[str],
    progress: Callable[[], None] = lambda: None,
    deadline: float = math.inf,
) -> None:
    """Compiles ``source`` into ``path`` (a temporary name first, then renamed: a concurrent
    process never loads half a file). Other builds stay: checkouts of other sources or another
    torch share the cache and each loads its own. While g++ runs, ``progress`` is called every
    SLICE_S; past ``deadline`` (monotonic) g++ is killed and BuildTimeout raised."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise FileNotFoundError("no g++ on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        command = [compiler, str(source), "-o", str(out), *flags]
        gxx = subprocess.Popen(command)
        try:
            while (code := _wait(gxx)) is None:
                if time.monotonic() > deadline:
                    raise BuildTimeout("g++ ran past the build limit: killed")
                progress()
        finally:
            if gxx.poll() is None:
                gxx.kill()
                gxx.wait()
        if code:
            raise subprocess.CalledProcessError(code, command)
        out.replace(path)


def _wait(popen: subprocess.Popen) -> int | None:
    try:
        return popen.wait(timeout=SLICE_S)
    except subprocess.TimeoutExpired:
        return None


def _lock(lock: IO[str], progress: Callable[[], None], deadline: float) -> None:
    """The build lock, waited for in slices (``progress`` between them) until ``deadline``."""
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # freed on close, or if we die
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise BuildTimeout(f"another build held {lock.name} past the limit") from None
            progress()
            time.sleep(SLICE_S)


def cpu_supported() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return CPU_FLAGS <= set(flags.partition(":")[2].split())


def build_op(
    progress: Callable[[str], None] = lambda doing: None, limit_s: float = BUILD_LIMIT_S
) -> Path:
    """The op built for this torch (a minute or more of g++ where none is): under a lock in its
    cache directory, so concurrent callers build once (the others wait, then find it built).
    ``progress(doing)`` is called every SLICE_S while it waits or builds; waiting and building
    end within ``limit_s`` (BuildTimeout, g++ killed). Raises where it cannot."""
    if not cpu_supported():
        raise RuntimeError("this CPU lacks AVX-512 BF16/VNNI")
    path = op_path()
    if path.exists():
        return path
    deadline = time.monotonic() + limit_s
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "build.lock", "w") as lock:
        try:
            _lock(lock, lambda: progress(WAITING), deadline)
            if not path.exists():
                logger.info("building our int4 decode kernel (once for this torch) into %s", path)
                start = time.monotonic()
                build(path, OP_SOURCE, _op_flags(), lambda: progress(BUILDING), deadline)
                logger.info("built our int4 decode kernel in %.0f s", time.monotonic() - start)
        except BuildTimeout as exc:
            raise BuildTimeout(f"{exc} ({limit_s:.0f} s)") from None
    return path


@cache
def load_op() -> bool:
    """Whether ``torch.ops.splitserve.int4_decode_mm`` can run here: the op built for this torch
    (``build_op``, where SPLITSERVE_NO_KERNEL_BUILD is unset) and loaded. Logged once, with why,
    where it cannot."""
    try:
        path = op_path()
        if not path.exists() and os.environ.get(NO_BUILD, "") not in ("", "0"):
            raise RuntimeError(
                f"not built ({path}) and {NO_BUILD} is set; "
                "`python -m engine_worker.int4_decode` builds it"
            )
        torch.ops.load_library(str(build_op(start_progress.alive)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        reason = str(exc)
        if isinstance(exc, subprocess.CalledProcessError):
            reason = f"g++ failed with exit status {exc.returncode}"
        logger.warning(
            "int4_kernel=own: our int4 kernel is unavailable (%s): torch's kernel serves, "
            "~30%% slower per token",
            reason,
        )
        return False
    return True


def takes(planes: list[Int4Groups]) -> bool:
    """Whether the kernel takes these planes (one group size of 16 or 32 and one width of q,
    blocks of 32 along K, at most MAX_GROUPS of them over all planes; N a multiple of 16)."""
    n, k = planes[0].q.shape
    return (
        len({(p.group, p.bits) for p in planes}) == 1
        and planes[0].group in GROUPS
        and 4 <= planes[0].bits <= MAX_BITS
        and n % TILE == 0
        and k % GROUP == 0
        and len(planes) * k // GROUP <= MAX_GROUPS
    )


def pack(planes: list[Int4Groups]) -> torch.Tensor:
    """The kernel's blocks [N / 16, parts * K / 32, bytes] uint8 (groups of 16:
    [N / 16, parts * K / 32, 2, bytes / 2]) from planes (q [N, K], scale/zero [N, K / group],
    rounded to bf16 here, as ``Int4Linear`` holds them), side by side along K as ``Int4Linear``
    lays them; layout in int4_decode.cpp. One plane with a K-quant's own codes (``coded``) packs
    as coded scales instead: [N / 16, K / 256, header + 8 blocks' bytes], the scales exact.
    Straight from the checkpoint's groups: nothing is read back through another kernel.
    Whole-array numpy on the bytes, one thread (each plane written into its place: no
    concatenated copy)."""
    if coded(planes):
        return _pack_coded(planes[0])
    n, k = planes[0].q.shape
    tiles, blocks, sub, high = n // TILE, k // GROUP, GROUP // planes[0].group, planes[0].bits - 4
    out = np.empty((tiles, len(planes) * blocks, block_bytes(sub, high)), dtype=np.uint8)
    for i, plane in enumerate(planes):
        block = out[:, i * blocks : (i + 1) * blocks]
        _pack_q(plane, block)
        pairs = torch.stack([plane.scale, plane.zero], dim=-1).to(torch.bfloat16)
        # [N, K / group] pairs of bf16 as one 32-bit word each: [t, i, g, sub] -> [t, g, sub, i]
        words = pairs.view(torch.int32).numpy().view(np.uint32).reshape(tiles, TILE, blocks, sub)
        at = WEIGHT_BYTES + PLANE_BYTES * high
        target = block[..., at:].view(np.uint32).reshape(tiles, blocks, sub, TILE)
        np.copyto(target, words.transpose(0, 2, 3, 1))
    packed = torch.from_numpy(out)
    return packed if sub == 1 else packed.view(tiles, len(planes) * blocks, sub, -1)


def layout_of(blocks: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(N, K, sub, high, code) of packed blocks, as the op reads them from their shape."""
    tiles, along = blocks.shape[:2]
    nbytes = math.prod(blocks.shape[2:])
    for code, sub, high in itertools.product(range(3), (1, 2), range(3)):
        unit = block_bytes(sub, high, code)
        if code:
            unit = HEADER_BYTES[code] + SUPER * unit
        if unit == nbytes and (blocks.dim() == 4) == (code == 0 and sub == 2):
            return tiles * TILE, along * GROUP * (SUPER if code else 1), sub, high, code
    raise ValueError(f"blocks of shape {tuple(blocks.shape)} are no layout of the kernel")


def coded(planes: list[Int4Groups]) -> bool:
    """Whether ``pack`` lays these planes out with coded scales: one plane with a K-quant's
    codes in a layout the kernel has (``CODED``), K a multiple of 256, every d and dmin an
    fp16 value (the header's)."""
    codes, plane = planes[0].codes, planes[0]
    if len(planes) != 1 or codes is None or plane.q.shape[1] % SUPER_BLOCK:
        return False
    if (GROUP // plane.group, plane.bits - 4) not in CODED[codes.dmin is not None]:
        return False
    halves = [codes.d] if codes.dmin is None else [codes.d, codes.dmin]
    return all(torch.equal(h.half().float(), h) for h in halves)


def _pack_q(plane: Int4Groups, block: np.ndarray) -> None:
    """Every block's nibble words and high-bit planes (block [N / 16, ..., bytes], a view whose
    middle dimensions run over the blocks along K in order)."""
    n, k = plane.q.shape
    tiles, high = n // TILE, plane.bits - 4
    q_all = np.ascontiguousarray(plane.q.numpy())
    step = max(1, PACK_CHUNK // (TILE * k))  # tiles at a time: their temporaries stay in cache
    for t in range(0, tiles, step):
        q, to = q_all[t * TILE : (t + step) * TILE], block[t : t + step]
        _pack_words(q, to[..., :WEIGHT_BYTES])
        for h in range(high):
            at = WEIGHT_BYTES + PLANE_BYTES * h
            _pack_high_bits(q, 4 + h, to[..., at : at + PLANE_BYTES])


def _pack_coded(plane: Int4Groups) -> torch.Tensor:
    """One plane with coded scales: per tile and super-block of 256 k a header (16 fp16 d, then
    with a min 16 fp16 dmin), then its 8 blocks, each its words, high-bit planes and per run 16
    int8 codes sc (then with a min 16 int8 m); layout in int4_decode.cpp."""
    codes = plane.codes
    assert codes is not None
    n, k = plane.q.shape
    tiles, supers, high = n // TILE, k // SUPER_BLOCK, plane.bits - 4
    sub, with_min = GROUP // plane.group, codes.dmin is not None
    code = 1 if with_min else 2
    header, run = HEADER_BYTES[code], RUN_BYTES[code]
    nbytes = block_bytes(sub, high, code)
    out = np.empty((tiles, supers, header + SUPER * nbytes), dtype=np.uint8)
    block = out[..., header:].reshape(tiles, supers, SUPER, nbytes)
    _pack_q(plane, block)
    at = WEIGHT_BYTES + PLANE_BYTES * high
    runs = block[..., at:].reshape(tiles, supers, SUPER, sub, run)
    halves = out[..., :header].view(np.float16).reshape(tiles, supers, -1, TILE)
    pairs = [(codes.d, codes.sc)] + ([(codes.dmin, codes.m)] if with_min else [])
    for i, (d, sc) in enumerate(pairs):
        assert d is not None and sc is not None
        values = d.half().numpy().reshape(tiles, TILE, supers).transpose(0, 2, 1)
        np.copyto(halves[:, :, i], values)
        ints = sc.numpy().view(np.uint8).reshape(tiles, TILE, supers, SUPER, sub)
        np.copyto(runs[..., 16 * i : 16 * (i + 1)], ints.transpose(0, 2, 3, 4, 1))
    return torch.from_numpy(out)


PACK_CHUNK = 1 << 18  # weights ``pack`` turns at a time
# Bytes of a uint64 that hold the low nibble alone
_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)


def _pack_words(q: np.ndarray, out: np.ndarray) -> None:
    """The 16-bit words of every block (out: [N / 16, K / 32, 256] uint8, a view).
    Word i of chunk c, nibble s, holds q[n = 16 t + i // 2, k = 32 g + 2 (4 c + s) + i % 2]:
    with s = 2 b + h and i = 2 r + p, q's 8 bytes at k = 32 g + 8 c + (4 b + 2 h + p) are one
    uint64 x. x | x >> 12 puts q[b, h = 1, p] beside q[b, 0, p] as its high nibble (in byte
    4 b + p), and the four bytes (p, b) = (0, 0), (0, 1), (1, 0), (1, 1) are gathered into a
    uint32: words 2 r and 2 r + 1, little-endian. Then [t, r, g, c] -> [t, g, c, r]."""
    tiles, blocks = out.shape[0], math.prod(out.shape[1:-1])
    x = q.view(np.uint64).reshape(tiles, TILE, blocks, 4) & _LOW_NIBBLES
    x |= x >> np.uint64(12)
    word = x & np.uint64(0xFF)
    word |= (x >> np.uint64(24)) & np.uint64(0xFF00)
    word |= (x << np.uint64(8)) & np.uint64(0xFF0000)
    word |= (x >> np.uint64(16)) & np.uint64(0xFF000000)
    target: np.ndarray = out.view(np.uint32).reshape(*out.shape[:-1], 4, TILE)
    np.copyto(target, word.transpose(0, 2, 3, 1).reshape(target.shape), casting="unsafe")


def _pack_high_bits(q: np.ndarray, bit: int, out: np.ndarray) -> None:
    """Bit ``bit`` of every q as 16 32-bit masks a block (out: [N / 16, K / 32, 64], a view):
    mask 4 c + s has bit i = 2 r + p set from q[16 t + r, 32 g + 8 c + 2 s + p]. Per uint64 x
    of q (bytes j = 2 s + p at [t, r, g, c]): the bit of each byte moved to bit 8 j, then byte
    2 s + 1's beside byte 2 s's (bits 16 s, 16 s + 1); the 16 rows' pairs are or-ed in at
    bit 2 r of each 16-bit slot, rows 0-7 giving the masks' low halves, rows 8-15 the high."""
    tiles, blocks = out.shape[0], math.prod(out.shape[1:-1])
    x: np.ndarray = q.view(np.uint64).reshape(tiles, TILE, blocks, 4)
    y = (x >> np.uint64(bit)) & np.uint64(0x0101010101010101)
    y |= y >> np.uint64(7)
    y &= np.uint64(0x0003000300030003)
    halves: np.ndarray = out.view(np.uint16).reshape(*out.shape[:-1], 4, 4, 2)  # [t, g, c, s, half]
    for half in range(2):
        rows = y[:, 8 * half : 8 * half + 8]
        mask = rows[:, 0].copy()
        for r in range(1, 8):
            mask |= rows[:, r] << np.uint64(2 * r)
        halves[..., half] = mask.view(np.uint16).reshape(halves.shape[:-1])


if __name__ == "__main__":  # scripts/setup_env.sh: build the op once
    logging.basicConfig(level=logging.INFO)
    try:
        print(f"int4 decode op: {build_op()}")
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        print(f"int4 decode op not built ({exc}): int4_kernel=own serves on aten's kernel")
        sys.exit(0)
