"""Moving a request's KV blocks from a prefill engine to a decode engine (docs/disaggregation.md).

The interface is three calls, so another transport (a cross-host byte transport) can stand
behind it:

    exporter.export(transfer_id, keys, values, block_ids) -> KVDescriptor | None   (prefill)
    importer.import_blocks(descriptor, keys, values, block_ids) -> bool            (decode)
    exporter.release(transfer_id)                                                  (prefill)

``keys`` / ``values`` are an engine's paged cache, [layers, kv_heads, blocks, block_size,
head_dim] (engine_worker/attention/kv_cache.py). Only the descriptor crosses a socket (msgpack,
ipc/messages/kv_handoff.py); the bytes never do.

One host: shared memory. Each prefill engine owns one segment, a file under /dev/shm mapped by
both sides (allocated and populated up front by its owner: no page fault on an export's path):
a stamp table and a buffer of block-sized units. An export takes a contiguous run of units
(first fit), copies the request's blocks into it, and writes the transfer's id into the run's
stamp last; the decode engine copies the run into its own blocks and checks the stamp before and
after, so a run the prefill engine gave back meanwhile (a transfer that timed out) is refused
instead of read. The prefill engine frees the run when the decode engine releases it (or when it
gives up on it).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ipc.messages import TRANSPORT_SHARED_MEMORY, KVDescriptor

logger = logging.getLogger("splitserve.engine")

STAMP_BYTES = 8
ALIGN = 4096


RUNS_PER_GATHER = 4  # export: slices when the blocks form at most 1/4 as many runs, else a gather


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in ``block_ids``, first block, length) of each run of consecutive block ids."""
    runs, start = [], 0
    for position in range(1, len(block_ids) + 1):
        if position == len(block_ids) or block_ids[position] != block_ids[position - 1] + 1:
            runs.append((start, block_ids[start], position - start))
            start = position
    return runs


def copy_into_blocks(
    region: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_ids: list[int]
) -> None:
    """A transfer's run (``Segment.region``'s view) into ``block_ids`` of the cache: runs of
    consecutive blocks (a fresh allocation mostly is one) a slice copy each; index_copy_ over
    the block axis ran several times slower here."""
    for side, cache in enumerate((keys, values)):
        for position, first, length in block_runs(block_ids):
            cache[:, :, first : first + length].copy_(
                region[side, :, :, position : position + length]
            )


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The shape of one engine's paged cache, which both ends of a transfer must share."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, keys: torch.Tensor) -> KVGeometry:
        layers, kv_heads, _, block_size, head_dim = keys.shape
        return cls(layers, kv_heads, block_size, head_dim, keys.dtype)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def block_bytes(self) -> int:
        """Keys and values of one block, every layer."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * element

    def check(self, descriptor: KVDescriptor) -> None:
        """ValueError unless ``descriptor``'s blocks are laid out as this cache's."""
        theirs = (
            descriptor.num_layers,
            descriptor.num_kv_heads,
            descriptor.block_size,
            descriptor.head_dim,
            descriptor.dtype,
        )
        ours = (self.num_layers, self.num_kv_heads, self.block_size, self.head_dim)
        if theirs != (*ours, self.dtype_name):
            raise ValueError(
                f"the prefill engine's KV layout {theirs} differs from this engine's "
                f"{(*ours, self.dtype_name)}: prefill and decode engines must serve the same "
                "model in the same format"
            )


def data_offset(units: int) -> int:
    """Where a segment of ``units`` units has its first unit (after its stamp table)."""
    return -(-units * STAMP_BYTES // ALIGN) * ALIGN


class RegionAllocator:
    """Contiguous runs of ``units`` units, first fit; freed runs merge with their neighbours."""

    def __init__(self, units: int) -> None:
        self.units = units
        self.free_runs: list[tuple[int, int]] = [(0, units)]  # (start, length), by start

    def allocate(self, count: int) -> int | None:
        for position, (start, length) in enumerate(self.free_runs):
            if length >= count:
                if length == count:
                    del self.free_runs[position]
                else:
                    self.free_runs[position] = (start + count, length - count)
                return start
        return None

    def free(self, start: int, count: int) -> None:
        runs = self.free_runs
        position = next((i for i, (s, _) in enumerate(runs) if s > start), len(runs))
        runs.insert(position, (start, count))
        if position + 1 < len(runs) and start + count == runs[position + 1][0]:
            runs[position] = (start, count + runs[position + 1][1])
            del runs[position + 1]
        if position > 0 and runs[position - 1][0] + runs[position - 1][1] == start:
            runs[position - 1] = (runs[position - 1][0], runs[position - 1][1] + runs[position][1])
            del runs[position]

    @property
    def free_units(self) -> int:
        return sum(length for _, length in self.free_runs)


class Segment:
    """A mapped segment: ``units`` stamps (int64), then ``units`` block-sized units."""

    def __init__(self, path: str, units: int, unit_bytes: int, *, create: bool) -> None:
        self.path, self.units, self.unit_bytes = path, units, unit_bytes
        self.data_offset = data_offset(units)
        size = self.data_offset + units * unit_bytes
        if not path:  # anonymous memory of this process (the net transport's buffers)
            populate = getattr(mmap, "MAP_POPULATE", 0)
            self.map = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | populate)
            self._views()
            return
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # tmpfs: the memory is taken now, not mid-copy
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"KV segment {path} is smaller than its descriptor says")
            # The owner maps every page up front (its writes would fault page by page); a
            # reader maps lazily: its reads fault pages in around each one, and populating the
            # whole buffer held its first import ~0.8 s on a loaded machine.
            populate = getattr(mmap, "MAP_POPULATE", 0) if create else 0
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        finally:
            os.close(fd)
        self._views()

    def _views(self) -> None:
        self.stamps = torch.frombuffer(self.map, dtype=torch.int64, count=self.units)
        self.data = torch.frombuffer(
            self.map, dtype=torch.uint8, count=self.units * self.unit_bytes, offset=self.data_offset
        )

    @property
    def address(self) -> int:
        """Where the mapping starts in this process's memory."""
        return int(self.stamps.data_ptr())

    @property
    def size(self) -> int:
        return self.data_offset + self.units * self.unit_bytes

    def region(self, start: int, count: int, geometry: KVGeometry) -> torch.Tensor:
        """Units start..start+count as [2, layers, kv_heads, count, block_size, head_dim]."""
        raw = self.data[start * self.unit_bytes : (start + count) * self.unit_bytes]
        g = geometry
        return raw.view(g.dtype).view(
            2, g.num_layers, g.num_kv_heads, count, g.block_size, g.head_dim
        )

    def close(self) -> None:
        del self.stamps, self.data
        with contextlib.suppress(BufferError):  # a view still alive: the unmap waits for exit
            self.map.close()


@dataclass(slots=True)
class _Region:
    start: int
    count: int


class SharedMemoryExporter:
    """A prefill engine's side: its segment, and which runs each transfer holds."""

    def __init__(self, path: str, geometry: KVGeometry, buffer_blocks: int) -> None:
        self.geometry = geometry
        self.segment = Segment(path, buffer_blocks, geometry.block_bytes, create=True)
        self.allocator = RegionAllocator(buffer_blocks)
        self.regions: dict[int, _Region] = {}

    @property
    def held_blocks(self) -> int:
        return self.allocator.units - self.allocator.free_units

    def export(
        self, transfer_id: int, keys: torch.Tensor, values: torch.Tensor, block_ids: list[int]
    ) -> KVDescriptor | None:
        """Copies ``block_ids`` of the cache into the segment; None when it has no room now
        (ValueError when it could never hold them)."""
        count = len(block_ids)
        if count > self.allocator.units:
            raise ValueError(
                f"{count} KV blocks exceed the transfer buffer of {self.allocator.units}"
            )
        start = self.allocator.allocate(count)
        if start is None:
            return None
        region = self.segment.region(start, count, self.geometry)
        self.segment.stamps[start] = 0
        runs = block_runs(block_ids)
        index = torch.tensor(block_ids, dtype=torch.long, device=keys.device)
        for side, cache in enumerate((keys, values)):
            if len(runs) * RUNS_PER_GATHER <= count:  # mostly consecutive: slices, memcpy speed
                for position, first, length in runs:
                    region[side, :, :, position : position + length].copy_(
                        cache[:, :, first : first + length]
                    )
            elif cache.device.type == "cpu":
                torch.index_select(cache, 2, index, out=region[side])
            else:
                region[side].copy_(cache.index_select(2, index))
        self.segment.stamps[start] = transfer_id  # last: the bytes before it are complete
        self.regions[transfer_id] = _Region(start, count)
        return self.describe(transfer_id, start, count)

    def describe(self, transfer_id: int, start: int, count: int) -> KVDescriptor:
        g = self.geometry
        return KVDescriptor(
            transfer_id=transfer_id,
            transport=TRANSPORT_SHARED_MEMORY,
            location=self.segment.path,
            offset=start,
            nbytes=count * self.segment.unit_bytes,
            num_blocks=count,
            num_layers=g.num_layers,
            num_kv_heads=g.num_kv_heads,
            block_size=g.block_size,
            head_dim=g.head_dim,
            dtype=g.dtype_name,
            stamp_index=start,
        )

    def release(self, transfer_id: int) -> bool:
        """Frees the transfer's run (its stamp cleared first); False if it held none."""
        region = self.regions.pop(transfer_id, None)
        if region is None:
            return False
        self.segment.stamps[region.start] = 0
        self.allocator.free(region.start, region.count)
        return True

    def reclaim_taken(self) -> list[int]:
        """Frees the runs whose reader marked them taken (``mark_taken``: a reader with no
        socket back to this engine, the Ray Serve hand-over); the transfers freed."""
        stamps = self.segment.stamps
        taken = [t for t, r in self.regions.items() if int(stamps[r.start]) == -t]
        for transfer_id in taken:
            self.release(transfer_id)
        return taken

    def close(self) -> None:
        self.segment.close()
        if self.segment.path:
            Path(self.segment.path).unlink(missing_ok=True)


class SharedMemoryImporter:
    """A decode engine's side: the prefill engines' segments, mapped on first use."""

    def __init__(self, geometry: KVGeometry) -> None:
        self.geometry = geometry
        self.segments: dict[str, Segment] = {}

    def import_blocks(
        self,
        descriptor: KVDescriptor,
        keys: torch.Tensor,
        values: torch.Tensor,
        block_ids: list[int],
    ) -> bool:
        """Copies the transfer's blocks into ``block_ids`` of the cache. False: the prefill
        engine gave the run back (or its segment is gone); ValueError: a layout that is not
        this cache's."""
        self.geometry.check(descriptor)
        if descriptor.transport != TRANSPORT_SHARED_MEMORY:
            raise ValueError(f"unknown KV transport {descriptor.transport!r}")
        if len(block_ids) != descriptor.num_blocks:
            raise ValueError(f"{descriptor.num_blocks} KV blocks sent, {len(block_ids)} taken")
        segment = self._segment(descriptor)
        if segment is None or descriptor.offset + descriptor.num_blocks > segment.units:
            return False
        stamp = segment.stamps[descriptor.stamp_index]
        if int(stamp) != descriptor.transfer_id:
            return False
        region = segment.region(descriptor.offset, descriptor.num_blocks, self.geometry)
        copy_into_blocks(region, keys, values, block_ids)
        return int(segment.stamps[descriptor.stamp_index]) == descriptor.transfer_id

    def mark_taken(self, descriptor: KVDescriptor) -> None:
        """Tells the exporter the run may be reused (its ``reclaim_taken``), if it is still
        this transfer's."""
        segment = self.segments.get(descriptor.location)
        if segment is not None and int(segment.stamps[descriptor.stamp_index]) == (
            descriptor.transfer_id
        ):
            segment.stamps[descriptor.stamp_index] = -descriptor.transfer_id

    def _segment(self, descriptor: KVDescriptor) -> Segment | None:
        path = descriptor.location
        segment = self.segments.get(path)
        if segment is None:
            # A new segment of a prefill engine that restarted replaces its old one here.
            stem = path.rsplit("-", 1)[0]
            for old in [p for p in self.segments if p.rsplit("-", 1)[0] == stem]:
                self.segments.pop(old).close()
            try:
                units = self._units_of(path)
                segment = Segment(path, units, self.geometry.block_bytes, create=False)
            except (OSError, ValueError) as exc:
                logger.warning("KV segment %s cannot be read: %s", path, exc)
                return None
            self.segments[path] = segment
        return segment

    def _units_of(self, path: str) -> int:
        """How many units the segment at ``path`` holds (from its size)."""
        size, unit = os.stat(path).st_size, self.geometry.block_bytes
        units = size // (unit + STAMP_BYTES)
        while units and data_offset(units) + units * unit > size:
            units -= 1
        return units

    def close(self) -> None:
        for segment in self.segments.values():
            segment.close()
        self.segments.clear()
