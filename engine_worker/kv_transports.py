"""The KV transfer's two transports behind kv_transfer.py's calls (docs/disaggregation.md):

* ``shm`` (one host): the prefill engine's buffer is a file under /dev/shm that the decode
  engine maps (``SharedMemoryExporter`` / ``SharedMemoryImporter``).
* ``net`` (engines that share no /dev/shm, on one host or two): the same buffer and stamps in
  the prefill engine's anonymous memory, registered with its transfer endpoint
  (engine_worker/kv_net.py, Mooncake's transfer engine over TCP); the decode engine pulls the
  run into a staging buffer of its own, then the run's stamp, and accepts the bytes only if the
  stamp is still the transfer's (the exporter clears it before it reuses a run, and never
  stamps a run with an id twice), then copies them into its blocks as the shm path does.

The bound and the fault policy are the shm path's: a run is held until its decode engine
releases it or ``kv_transfer_timeout_s`` passes; a pull that fails or outlasts that bound is a
failed import (the request ends 'unavailable', or, handed over between Ray replicas, is
computed by the decode side).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine_worker.kv_net import BACKEND, KVNetEndpoint, KVNetError
from engine_worker.kv_transfer import (
    STAMP_BYTES,
    KVGeometry,
    Segment,
    SharedMemoryExporter,
    SharedMemoryImporter,
    copy_into_blocks,
    data_offset,
)
from ipc.config import ClusterConfig
from ipc.messages import TRANSPORT_NET, KVDescriptor
from ipc.messages.kv_net import KVNetRegion

logger = logging.getLogger("splitserve.engine")


def open_endpoint(config: ClusterConfig) -> KVNetEndpoint:
    """This engine's transfer endpoint; choosing ``kv_transport net`` declares the engines'
    network private (docs/kv_transport.md: Mooncake's TCP transport authenticates no one)."""
    return KVNetEndpoint(
        config.kv_net_host, trusted_network=True, timeout_s=config.kv_transfer_timeout_s
    )


def make_exporter(
    config: ClusterConfig, index: int, pid: int, geometry: KVGeometry, buffer_blocks: int
) -> SharedMemoryExporter:
    if config.kv_transport == TRANSPORT_NET:
        return NetExporter(open_endpoint(config), geometry, buffer_blocks)
    prefix = Path(config.kv_segment_prefix)
    for stale in prefix.parent.glob(f"{prefix.name}{index}-*"):
        stale.unlink(missing_ok=True)  # a killed predecessor's: it could not remove it
    return SharedMemoryExporter(config.kv_segment_path(index, pid), geometry, buffer_blocks)


def make_importer(
    config: ClusterConfig, geometry: KVGeometry, max_blocks: int
) -> SharedMemoryImporter | NetImporter:
    if config.kv_transport == TRANSPORT_NET:
        return NetImporter(open_endpoint(config), geometry, max_blocks)
    return SharedMemoryImporter(geometry)


class NetExporter(SharedMemoryExporter):
    """The shared-memory exporter's buffer, in anonymous memory that peers pull from."""

    def __init__(self, endpoint: KVNetEndpoint, geometry: KVGeometry, buffer_blocks: int) -> None:
        super().__init__("", geometry, buffer_blocks)
        self.endpoint = endpoint
        endpoint.register(self.segment.address, self.segment.size)

    def describe(self, transfer_id: int, start: int, count: int) -> KVDescriptor:
        descriptor = super().describe(transfer_id, start, count)
        descriptor.transport = TRANSPORT_NET
        descriptor.location = self.endpoint.session
        descriptor.address = self.segment.address
        descriptor.units = self.segment.units
        return descriptor

    def close(self) -> None:
        self.endpoint.close()
        super().close()


class NetImporter:
    """A decode engine's side: pulls a run into its staging buffer, checks the stamp, copies."""

    def __init__(self, endpoint: KVNetEndpoint, geometry: KVGeometry, max_blocks: int) -> None:
        self.endpoint, self.geometry = endpoint, geometry
        self.max_blocks = max(2, max_blocks)
        self.staging = self._new_staging()
        self.abandoned: list[Segment] = []  # staging a timed-out pull may still write into
        self.failed = 0

    def _new_staging(self) -> Segment:
        staging = Segment("", self.max_blocks, self.geometry.block_bytes, create=True)
        self.endpoint.register(staging.address, staging.size)
        return staging

    def _regions(self, descriptor: KVDescriptor) -> tuple[KVNetRegion, KVNetRegion]:
        """The run's bytes and its stamp, in the exporter's memory."""
        data = descriptor.address + data_offset(descriptor.units)
        data += descriptor.offset * self.geometry.block_bytes
        stamp = descriptor.address + descriptor.stamp_index * STAMP_BYTES
        name = str(descriptor.transfer_id)
        session = descriptor.location
        return (
            KVNetRegion(name, BACKEND, session, [data], [descriptor.nbytes]),
            KVNetRegion(name, BACKEND, session, [stamp], [STAMP_BYTES]),
        )

    def import_blocks(
        self,
        descriptor: KVDescriptor,
        keys: torch.Tensor,
        values: torch.Tensor,
        block_ids: list[int],
    ) -> bool:
        """As ``SharedMemoryImporter.import_blocks``; KVNetError when a pull failed (the
        exporter is gone, or did not answer within the bound)."""
        self.geometry.check(descriptor)
        if descriptor.transport != TRANSPORT_NET:
            raise ValueError(f"a {descriptor.transport!r} transfer reached the net transport")
        count = descriptor.num_blocks
        if len(block_ids) != count or count > self.max_blocks:
            raise ValueError(f"{count} KV blocks sent, {len(block_ids)} taken")
        if descriptor.nbytes != count * self.geometry.block_bytes:
            raise ValueError(f"{descriptor.nbytes} bytes for {count} KV blocks")
        staging = self.staging
        data, stamp = self._regions(descriptor)
        try:
            self.endpoint.pull(data, [(int(staging.data.data_ptr()), descriptor.nbytes)])
            self.endpoint.pull(stamp, [(staging.address, STAMP_BYTES)])
        except KVNetError:
            self.failed += 1
            if any(t.is_alive() for t, _ in self.endpoint.in_doubt):  # given up at the bound:
                # that pull may still write into this staging buffer
                self.abandoned.append(staging)
                self.staging = self._new_staging()
            raise
        if int(staging.stamps[0]) != descriptor.transfer_id:
            return False  # given back (and maybe reused) by the exporter meanwhile
        copy_into_blocks(staging.region(0, count, self.geometry), keys, values, block_ids)
        return True

    def mark_taken(self, descriptor: KVDescriptor) -> None:
        """Writes the taken mark into the run's stamp if it still is the transfer's (a reader
        with no socket back to the exporter: the Ray Serve hand-over)."""
        _, stamp = self._regions(descriptor)
        slot = (self.staging.address + STAMP_BYTES, STAMP_BYTES)
        try:
            self.endpoint.pull(stamp, [slot])
            if int(self.staging.stamps[1]) != descriptor.transfer_id:
                return
            self.staging.stamps[1] = -descriptor.transfer_id
            self.endpoint.push([slot], stamp)
        except KVNetError as exc:  # the exporter frees the run at its bound instead
            logger.warning("KV transfer %d not marked taken: %s", descriptor.transfer_id, exc)

    def close(self) -> None:
        self.endpoint.close()
        for segment in [self.staging, *self.abandoned]:
            segment.close()
