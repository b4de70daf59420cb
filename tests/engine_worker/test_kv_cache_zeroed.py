"""The KV cache's zeros on a CPU (``kv_cache.zeroed``): zeros of the shape and dtype asked for,
whose memory comes into use as it is written, not when the cache is made."""

from __future__ import annotations

import psutil
import pytest
import torch

from engine_worker.attention.kv_cache import zeroed

MB = 1 << 20


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / MB


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_zeros_of_the_shape_and_dtype_asked_for(dtype):
    shape = (2, 3, 5, 16, 8)
    t = zeroed(shape, dtype, torch.device("cpu"))
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, torch.zeros(shape, dtype=dtype))
    t[1, 2].fill_(1.5)  # writable, and every view of it sees the write
    assert float(t.sum()) == 1.5 * 5 * 16 * 8 and float(t[0].abs().sum()) == 0.0
    assert zeroed((0, 4), dtype, torch.device("cpu")).shape == (0, 4)


def test_memory_comes_into_use_as_it_is_written():
    before = rss_mb()
    t = zeroed((256, MB // 2), torch.bfloat16, torch.device("cpu"))  # 256 MiB
    made = rss_mb()
    t[:128].fill_(1.0)
    half = rss_mb()
    assert made - before < 32, (before, made)
    assert half - made > 100, (made, half)
    del t
