"""The shared-memory KV transport (engine_worker/kv_transfer.py): blocks exported from one paged
cache land bit for bit in other blocks of another, a run given back is refused, the buffer's
runs are reused and merged, and a layout that differs is refused by name. Real files under
/dev/shm (or the test's directory), real mmaps, real tensors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine_worker.kv_transfer import (
    KVGeometry,
    RegionAllocator,
    SharedMemoryExporter,
    SharedMemoryImporter,
    block_runs,
)

SHAPE = (3, 2, 24, 4, 8)  # layers, kv heads, blocks, block size, head dim


@pytest.fixture
def segment_path(tmp_path):
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    path = base / f"splitserve-kv-test-{os.getpid()}-{tmp_path.name}"
    yield str(path)
    path.unlink(missing_ok=True)


def caches(dtype=torch.bfloat16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(SHAPE, generator=generator).to(dtype)
    values = torch.randn(SHAPE, generator=generator).to(dtype)
    return keys, values


def test_blocks_move_bit_for_bit_into_other_blocks(segment_path):
    keys, values = caches()
    exporter = SharedMemoryExporter(segment_path, KVGeometry.of(keys), buffer_blocks=10)
    try:
        sent = [5, 2, 17, 9]
        kv = exporter.export(7, keys, values, sent)
        assert kv is not None and kv.num_blocks == 4 and kv.dtype == "bfloat16"
        assert kv.nbytes == 4 * 2 * 3 * 2 * 4 * 8 * 2
        their_keys, their_values = caches(seed=1)
        importer = SharedMemoryImporter(KVGeometry.of(their_keys))
        into = [0, 11, 3, 20]
        assert importer.import_blocks(kv, their_keys, their_values, into)
        for src, dst in zip(sent, into):
            assert torch.equal(their_keys[:, :, dst], keys[:, :, src])
            assert torch.equal(their_values[:, :, dst], values[:, :, src])
        untouched = [b for b in range(SHAPE[2]) if b not in into]
        assert torch.equal(their_keys[:, :, untouched], caches(seed=1)[0][:, :, untouched])
        assert exporter.held_blocks == 4
        assert exporter.release(7) and not exporter.release(7)
        assert exporter.held_blocks == 0
        importer.close()
    finally:
        exporter.close()
    assert not Path(segment_path).exists()


def test_runs_of_consecutive_blocks_move_as_slices(segment_path):
    assert block_runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    keys, values = caches()
    exporter = SharedMemoryExporter(segment_path, KVGeometry.of(keys), buffer_blocks=12)
    try:
        sent = [3, 4, 5, 6, 7, 8, 9, 10, 20, 21]  # two runs: sliced out
        kv = exporter.export(3, keys, values, sent)
        their_keys, their_values = caches(seed=2)
        into = [12, 13, 14, 0, 1, 2, 3, 4, 5, 23]
        importer = SharedMemoryImporter(KVGeometry.of(their_keys))
        assert kv is not None and importer.import_blocks(kv, their_keys, their_values, into)
        assert torch.equal(their_keys[:, :, into], keys[:, :, sent])
        assert torch.equal(their_values[:, :, into], values[:, :, sent])
        importer.close()
    finally:
        exporter.close()


def test_a_run_given_back_is_refused_not_read(segment_path):
    keys, values = caches()
    exporter = SharedMemoryExporter(segment_path, KVGeometry.of(keys), buffer_blocks=4)
    try:
        kv = exporter.export(1, keys, values, [0, 1])
        assert kv is not None
        exporter.release(1)  # the prefill engine gave up on it (timed out)
        reused = exporter.export(2, keys, values, [3, 4])  # the same run, other blocks
        assert reused is not None and reused.offset == kv.offset
        their_keys, their_values = caches(seed=1)
        importer = SharedMemoryImporter(KVGeometry.of(their_keys))
        assert not importer.import_blocks(kv, their_keys, their_values, [5, 6])
        assert importer.import_blocks(reused, their_keys, their_values, [5, 6])
        assert torch.equal(their_keys[:, :, 5], keys[:, :, 3])
        importer.close()
    finally:
        exporter.close()


def test_a_full_buffer_says_wait_and_a_request_larger_than_it_is_refused(segment_path):
    keys, values = caches()
    exporter = SharedMemoryExporter(segment_path, KVGeometry.of(keys), buffer_blocks=4)
    try:
        assert exporter.export(1, keys, values, [0, 1, 2]) is not None
        assert exporter.export(2, keys, values, [3, 4]) is None  # wait for a release
        exporter.release(1)
        assert exporter.export(2, keys, values, [3, 4]) is not None
        with pytest.raises(ValueError, match="exceed the transfer buffer"):
            exporter.export(3, keys, values, [0, 1, 2, 3, 4])
    finally:
        exporter.close()


def test_a_different_layout_is_refused_by_name(segment_path):
    keys, values = caches()
    exporter = SharedMemoryExporter(segment_path, KVGeometry.of(keys), buffer_blocks=4)
    try:
        kv = exporter.export(1, keys, values, [0])
        their_keys, their_values = caches(dtype=torch.float32)
        importer = SharedMemoryImporter(KVGeometry.of(their_keys))
        with pytest.raises(ValueError, match="same model in the same format"):
            importer.import_blocks(kv, their_keys, their_values, [0])
    finally:
        exporter.close()


def test_freed_runs_merge_and_first_fit_reuses_them():
    runs = RegionAllocator(10)
    a, b, c = runs.allocate(3), runs.allocate(3), runs.allocate(3)
    assert (a, b, c) == (0, 3, 6) and runs.allocate(2) is None
    runs.free(a, 3)
    runs.free(c, 3)
    assert runs.allocate(4) == 6  # 6..9 (c's run and the last unit merged)
    runs.free(b, 3)
    assert runs.free_runs == [(0, 6)]
    runs.free(6, 4)
    assert runs.free_runs == [(0, 10)] and runs.free_units == 10


def test_a_run_marked_taken_by_its_reader_is_reclaimed_and_no_other(segment_path):
    """The Ray Serve hand-over has no socket back to the exporter: the importer marks the run
    taken in its stamp, the exporter frees exactly the runs so marked."""
    keys, values = caches()
    exporter = SharedMemoryExporter(segment_path, KVGeometry.of(keys), buffer_blocks=10)
    try:
        taken = exporter.export(7, keys, values, [1, 2, 3])
        kept = exporter.export(8, keys, values, [4, 5])
        assert taken is not None and kept is not None
        their_keys, their_values = caches(seed=1)
        importer = SharedMemoryImporter(KVGeometry.of(their_keys))
        assert importer.import_blocks(taken, their_keys, their_values, [0, 1, 2])
        importer.mark_taken(taken)
        assert exporter.reclaim_taken() == [7] and exporter.reclaim_taken() == []
        assert exporter.held_blocks == 2
        exporter.release(8)
        importer.mark_taken(kept)  # given back before: its stamp is not the transfer's
        assert exporter.reclaim_taken() == [] and exporter.held_blocks == 0
        importer.close()
    finally:
        exporter.close()


def test_a_buffer_in_anonymous_memory_exports_as_a_file_does():
    """The net transport's exporter keeps its buffer in memory of its own, no /dev/shm file."""
    keys, values = caches()
    exporter = SharedMemoryExporter("", KVGeometry.of(keys), buffer_blocks=6)
    try:
        kv = exporter.export(3, keys, values, [7, 8, 20])
        assert kv is not None and exporter.held_blocks == 3
        region = exporter.segment.region(kv.offset, 3, KVGeometry.of(keys))
        assert torch.equal(region[0, :, :, 2], keys[:, :, 20])
        assert torch.equal(region[1, :, :, 0], values[:, :, 7])
        assert int(exporter.segment.stamps[kv.stamp_index]) == 3
    finally:
        exporter.close()
