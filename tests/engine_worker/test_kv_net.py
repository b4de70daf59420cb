"""The cross-host KV transport (engine_worker/kv_net.py, ipc/messages/kv_net.py).

The piece arithmetic and the descriptors run everywhere. The transfers run between two hosts
made of network namespaces (kv_net_hosts.py, started once for the module inside ``unshare
-rn``: a veth pair, nothing else), on Mooncake's transfer engine, the ``kvnet`` extra: without
it they skip, saying so.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_worker.kv_net import (
    INSTALL_HINT,
    KVNetEndpoint,
    block_pieces,
    buffer_piece,
    gather_blocks,
    merge_pieces,
    pair_pieces,
    scatter_blocks,
    staged_bytes,
)
from ipc import codec
from ipc.messages.kv_net import KVNetDone, KVNetRegion
from tests.engine_worker.kv_net_hosts import TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# pieces


def test_adjacent_pieces_merge_and_others_stay_apart():
    assert merge_pieces([(100, 10), (110, 5), (200, 1), (201, 4), (300, 2)]) == [
        (100, 15),
        (200, 5),
        (300, 2),
    ]
    assert merge_pieces([(110, 5), (100, 10)]) == [(110, 5), (100, 10)]  # order is the data's
    with pytest.raises(ValueError):
        merge_pieces([(100, 0)])


def test_pairing_cuts_both_sides_wherever_either_is_cut():
    local = [(1000, 6), (2000, 4)]
    remote = [(50, 3), (60, 7)]
    assert pair_pieces(local, remote) == ([1000, 1003, 2000], [50, 60, 63], [3, 3, 4])
    with pytest.raises(ValueError, match="10 bytes here for 9 bytes there"):
        pair_pieces(local, [(50, 9)])


def test_pairing_moves_bytes_where_a_copy_through_both_layouts_would():
    """The pairs, applied as copies between two real buffers, put each byte where reading the
    source's pieces in order and writing the destination's in order puts it."""
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    sb, db = buffer_piece(src)[0], buffer_piece(dst)[0]
    remote = [(sb + 40, 10), (sb + 3, 7), (sb + 20, 13)]
    local = [(db + 1, 4), (db + 30, 20), (db + 10, 6)]
    for la, ra, n in zip(*pair_pieces(local, remote)):
        dst[la - db : la - db + n] = src[ra - sb : ra - sb + n]
    run = torch.cat([src[a - sb : a - sb + n] for a, n in remote])
    assert torch.equal(torch.cat([dst[a - db : a - db + n] for a, n in local]), run)


def test_block_pieces_follow_the_engines_layout_and_merge_neighbouring_blocks():
    cache = torch.zeros(2, 3, 10, 16, 8, dtype=torch.bfloat16)  # [L, KV, blocks, size, dim]
    base, block = cache.data_ptr(), 16 * 8 * 2
    pieces = block_pieces([cache], [4, 5, 1])
    # Per (layer, head) row: blocks 4 and 5 as one piece, then block 1.
    assert pieces[:2] == [(base + 4 * block, 2 * block), (base + 1 * block, block)]
    assert len(pieces) == 2 * 3 * 2 and sum(n for _, n in pieces) == 2 * 3 * 3 * block
    row = 10 * block
    assert pieces[2] == (base + row + 4 * block, 2 * block)
    with pytest.raises(ValueError, match="outside the cache's 10 blocks"):
        block_pieces([cache], [10])
    with pytest.raises(ValueError, match="contiguous"):
        block_pieces([cache.transpose(0, 1)], [0])


def test_gathered_blocks_are_the_bytes_of_block_pieces_and_scatter_back_elsewhere():
    gen = torch.Generator().manual_seed(0)
    shape = (2, 3, 12, 4, 8)
    source = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2)]
    target = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)]
    blocks, elsewhere = [7, 2, 3, 11], [0, 9, 4, 5]
    staging = torch.full((staged_bytes(source, len(blocks)),), 255, dtype=torch.uint8)
    assert gather_blocks(source, blocks, staging) == staging.numel() == 2 * 2 * 3 * 4 * 64
    # The staging buffer holds what reading block_pieces in order reads.
    pieces = b"".join(
        bytes((ctypes.c_ubyte * n).from_address(a)) for a, n in block_pieces(source, blocks)
    )
    assert staging.numpy().tobytes() == pieces
    scatter_blocks(staging, target, elsewhere)
    for s, t in zip(source, target):
        assert torch.equal(t[:, :, elsewhere].view(torch.int16), s[:, :, blocks].view(torch.int16))
        assert not t[:, :, [1, 6]].any()  # blocks nobody named stay as they were


# ---------------------------------------------------------------------------------------------
# descriptors


def test_region_and_answer_round_trip_through_the_codec():
    region = KVNetRegion("req-1", "mooncake-tcp", "192.0.2.1:15000", [4096, 9000], [100, 28])
    again = codec.decode_as(codec.encode(region), KVNetRegion)
    assert again == region and again.nbytes == 128 and again.pieces == [(4096, 100), (9000, 28)]
    done = KVNetDone("req-1", ok=False, error="peer gone")
    assert codec.decode_as(codec.encode(done), KVNetDone) == done


@pytest.mark.parametrize(
    "fields, fault",
    [
        ({"addresses": [1, 2], "lengths": [1]}, "one each"),
        ({"addresses": [], "lengths": []}, "1 to"),
        ({"addresses": [0], "lengths": [1]}, "positive 64-bit"),
        ({"addresses": [8], "lengths": [0]}, "lengths must be positive"),
        ({"session": "nohost"}, "host:port"),
        ({"transfer_id": ""}, "transfer_id"),
        ({"addresses": ["8"]}, "expected an integer"),
    ],
)
def test_a_malformed_region_is_refused_when_decoded(fields, fault):
    wire = {
        "kind": "kv_net_region",
        "transfer_id": "r",
        "backend": "mooncake-tcp",
        "session": "192.0.2.1:1",
        "addresses": [8],
        "lengths": [1],
        **fields,
    }
    import msgpack

    with pytest.raises(codec.DecodeError, match=fault):
        codec.decode_as(msgpack.packb(wire), KVNetRegion)


# ---------------------------------------------------------------------------------------------
# the extra


def test_without_the_extra_an_endpoint_says_which_extra_to_install():
    """In a process where the package cannot be imported (whether or not it is installed)."""
    code = (
        "import sys; sys.modules['mooncake'] = None\n"
        "from engine_worker.kv_net import KVNetEndpoint, KVNetUnavailable\n"
        "try:\n    KVNetEndpoint('127.0.0.1', trusted_network=True)\n"
        "except KVNetUnavailable as exc:\n    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert INSTALL_HINT in out.stdout and "splitserve[kvnet]" in out.stdout


# ---------------------------------------------------------------------------------------------
# two hosts


def test_an_endpoint_is_refused_unless_the_network_is_declared_private():
    with pytest.raises(ValueError, match="trusted_network=True"):
        KVNetEndpoint("127.0.0.1")


def transfer_engine_loads() -> str:
    """'' where Mooncake's engine imports here, else why not (in a process of its own: it loads
    large native libraries the test process does not need)."""
    code = "from engine_worker.kv_net import transfer_engine_class; transfer_engine_class()"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    return "" if out.returncode == 0 else out.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> dict[str, Any]:
    why_not = transfer_engine_loads()
    if why_not:
        pytest.skip(f"the kvnet extra cannot be used here: {why_not}")
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the transport tests need {missing} (util-linux, iproute2) for their hosts")
    out = tmp_path_factory.mktemp("kvnet") / "results.json"
    proc = subprocess.run(
        ["unshare", "-rn", sys.executable, "-m", "tests.engine_worker.kv_net_hosts", str(out)],
        cwd=ROOT,
        env={**os.environ, "GLOG_minloglevel": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    results = json.loads(out.read_text()) if out.exists() else {}
    if not results or "error" in results:
        pytest.fail(
            f"the two hosts did not run their scenarios (exit {proc.returncode}):\n"
            f"{results.get('error', '')}\n{proc.stderr[-4000:]}"
        )
    return results


def decoded(hosts: dict[str, Any], name: str) -> dict[str, Any]:
    seen = hosts["decode"].get(name)
    assert seen, f"the decode host saw no {name!r} transfer"
    return seen[0] if isinstance(seen, list) else seen


def test_a_staged_kv_of_2048_tokens_arrives_in_the_receivers_own_blocks(hosts):
    got = decoded(hosts, "staged")
    assert got["ok"] and got["same_bytes"]
    assert got["nbytes"] == 2 * 30 * 3 * 2048 * 64 * 2  # 47,185,920: the default model's KV
    assert got["pieces"] == 1
    assert hosts["staged"]["ok"]


def test_blocks_scattered_on_both_sides_land_in_the_receivers_own_blocks(hosts):
    got = decoded(hosts, "scattered")
    assert got["ok"] and got["same_bytes"]
    assert got["pieces"] > 2 * 30 * 3  # block by block, not one run per row
    assert hosts["scattered"]["ok"]


def test_the_sender_can_push_into_a_region_the_receiver_offered(hosts):
    got = decoded(hosts, "push")
    assert got["ok"] and got["same_bytes"], got


def test_a_pull_from_a_killed_owner_fails_at_once(hosts):
    seen = hosts["killed"]
    assert not seen["ok"] and "pulling from 192.0.2.1:" in seen["error"]
    assert seen["after_fault_s"] < 5
    assert not decoded(hosts, "killed")["ok"]


def test_a_pull_from_a_stalled_owner_fails_within_the_transfer_bound(hosts):
    """The owner is stopped (SIGSTOP): the kernel still accepts its connections, nothing
    answers; the pull gives up after the bound instead of waiting for ever."""
    seen = hosts["stalled"]
    assert not seen["ok"] and "pulling from 192.0.2.1:" in seen["error"], seen
    assert TIMEOUT_S - 1 < seen["after_fault_s"] < TIMEOUT_S + 10, seen
    # Until that transfer ends, its pieces are not lent to another one.
    again = decoded(hosts, "stalled")["again"]
    assert "timed out and has not ended yet" in again
