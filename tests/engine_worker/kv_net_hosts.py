"""Two hosts for the cross-host KV transport (engine_worker/kv_net.py), made of network
namespaces: test_kv_net.py starts this once inside ``unshare -rn`` and asserts on what it writes.

    python -m tests.engine_worker.kv_net_hosts RESULTS_JSON [--bench]

This process (the prefill host, 192.0.2.1 on veth kv0) makes a veth pair and a child in a
network namespace of its own (the decode host, 192.0.2.2 on kv1); the two namespaces hold
nothing but their loopback and the pair, and the addresses are TEST-NET-1's (RFC 5737: never
on any real network), so nothing here can reach anything the test did not make. The prefill
host owns KV caches in the engine's layout (the default model's: 30 layers, 3 KV heads, blocks
of 16 tokens of 64 bf16 values) filled from a seed; the decode host rebuilds the same contents
from the seed and checks every byte it receives. Regions and answers travel over ZeroMQ with
the project's codec, as the engines will send them.

Scenarios, each under its name in RESULTS_JSON: ``staged`` (a 2,048-token KV, 47 MB, gathered
from blocks scattered through the prefill host's cache into one staging buffer, pulled whole
into the decode host's, scattered into its own blocks), ``scattered`` (the same blocks pulled
piece by piece, straight from cache to cache), ``push`` (the prefill host writes its blocks
into a region the decode host offered), ``killed`` (the owner of a region is killed before the
pull: the pull fails, it does not hang), ``stalled`` (the owner is stopped, SIGSTOP: the pull
fails within the transfer bound). ``--bench`` adds repeated timings
of both beside the gather's and memcpy's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import zmq

from engine_worker.kv_net import (
    KVNetEndpoint,
    KVNetError,
    block_pieces,
    buffer_piece,
    gather_blocks,
    scatter_blocks,
    staged_bytes,
)
from ipc import codec
from ipc.messages.kv_net import KVNetDone, KVNetRegion
from ipc.sockets import PullQueue, PushQueue

PREFILL_IP, DECODE_IP = "192.0.2.1", "192.0.2.2"
TO_DECODE = f"tcp://{DECODE_IP}:7002"
TO_PREFILL = f"tcp://{PREFILL_IP}:7001"
LAYERS, HEADS, BLOCK, HEAD_DIM = 30, 3, 16, 64  # SmolLM2-135M's KV, in the engine's layout
TOKENS = 2048
REQUEST_BLOCKS = TOKENS // BLOCK
PREFILL_CACHE_BLOCKS, DECODE_CACHE_BLOCKS = 160, 200
TIMEOUT_S = 10.0  # the transfer bound: twice the slowest block-by-block pull seen at load 12
WAIT_MS = 60_000


def caches(blocks: int, seed: int | None) -> list[torch.Tensor]:
    """Keys and values as the engine holds them; random bf16 from ``seed`` (zeros for None)."""
    shape = (LAYERS, HEADS, blocks, BLOCK, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)]
    gen = torch.Generator().manual_seed(seed)
    # Random bit patterns, NaNs included: the check compares bytes, not values.
    return [
        torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)
        for _ in range(2)
    ]


def request_blocks(cache_blocks: int, seed: int) -> list[int]:
    """A request's blocks, scattered through a cache as a long-running engine leaves them."""
    order = torch.randperm(cache_blocks, generator=torch.Generator().manual_seed(seed))
    return order[:REQUEST_BLOCKS].tolist()


PREFILL_SEED = 1234
PREFILL_BLOCKS = request_blocks(PREFILL_CACHE_BLOCKS, 1)
DECODE_BLOCKS = request_blocks(DECODE_CACHE_BLOCKS, 2)
PUSH_BLOCKS = request_blocks(DECODE_CACHE_BLOCKS, 3)[: REQUEST_BLOCKS // 2]


def expected_blocks(blocks: list[int]) -> list[torch.Tensor]:
    return [c[:, :, blocks] for c in caches(PREFILL_CACHE_BLOCKS, PREFILL_SEED)]


def same_bytes(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want))


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


# ---------------------------------------------------------------------------------------------
# the decode host (the child namespace)


def decode_host(results_path: str) -> None:
    deadline = time.monotonic() + 20
    while subprocess.run(["ip", "link", "show", "kv1"], capture_output=True).returncode:
        if time.monotonic() > deadline:
            raise RuntimeError("the veth end never arrived in this namespace")
        time.sleep(0.05)
    ip("link", "set", "lo", "up")
    ip("addr", "add", f"{DECODE_IP}/24", "dev", "kv1")
    ip("link", "set", "kv1", "up")
    results: dict[str, Any] = {}
    ctx = zmq.Context()
    inbox: PullQueue[Any] = PullQueue(ctx, TO_DECODE, KVNetRegion, KVNetDone, bind=True)
    outbox = PushQueue(ctx, TO_PREFILL)
    endpoint = KVNetEndpoint(DECODE_IP, trusted_network=True, timeout_s=TIMEOUT_S)
    cache = caches(DECODE_CACHE_BLOCKS, None)
    flat = torch.zeros(staged_bytes(cache, REQUEST_BLOCKS), dtype=torch.uint8)
    for buffer in (*cache, flat):
        endpoint.register(*buffer_piece(buffer))
    outbox.put(endpoint.region("push", block_pieces(cache, PUSH_BLOCKS)))
    try:
        serve_decode(inbox, outbox, endpoint, cache, flat, results)
    finally:
        Path(results_path).write_text(json.dumps(results))
        endpoint.close()
        inbox.close()
        outbox.close()
        ctx.term()


def serve_decode(
    inbox: PullQueue[Any],
    outbox: PushQueue,
    endpoint: KVNetEndpoint,
    cache: list[torch.Tensor],
    flat: torch.Tensor,
    results: dict[str, Any],
) -> None:
    while inbox.wait(WAIT_MS):
        msg = inbox.get()
        name = msg.transfer_id.split("#")[0]
        if isinstance(msg, KVNetDone):
            if name == "stop":
                return
            got = [c[:, :, PUSH_BLOCKS] for c in cache]
            results["push"] = {
                "same_bytes": same_bytes(got, expected_blocks(PREFILL_BLOCKS[: len(PUSH_BLOCKS)])),
                "ok": msg.ok,
                "seconds": msg.seconds,
                "error": msg.error,
            }
            continue
        if name == "scattered":
            into = block_pieces(cache, DECODE_BLOCKS)
        else:
            into = [(buffer_piece(flat)[0], msg.nbytes)]
        flat.zero_()
        for c in cache:
            c.zero_()
        try:
            seconds = endpoint.pull(msg, into)
            t0 = time.perf_counter()
            if name == "staged":
                scatter_blocks(flat, cache, DECODE_BLOCKS)
            scatter_s = time.perf_counter() - t0
        except (KVNetError, ValueError) as exc:
            entry = {"ok": False, "error": str(exc)}
            if name == "stalled":  # its owner is still stopped: so is the given-up transfer
                entry["again"] = pull_error(endpoint, msg, into)
            outbox.put(KVNetDone(msg.transfer_id, ok=False, error=str(exc)))
            results.setdefault(name, []).append(entry)
            continue
        outbox.put(KVNetDone(msg.transfer_id, ok=True, nbytes=msg.nbytes, seconds=seconds))
        entry: dict[str, Any] = {
            "ok": True,
            "seconds": seconds,
            "scatter_s": scatter_s,
            "nbytes": msg.nbytes,
            "pieces": len(msg.lengths),
        }
        if "#" not in msg.transfer_id:  # a benchmark's repeats are not checked each time
            got = [c[:, :, DECODE_BLOCKS] for c in cache]
            entry["same_bytes"] = same_bytes(got, expected_blocks(PREFILL_BLOCKS))
        results.setdefault(name, []).append(entry)


def pull_error(endpoint: KVNetEndpoint, region: KVNetRegion, into: list[tuple[int, int]]) -> str:
    try:
        endpoint.pull(region, into)
    except KVNetError as exc:
        return str(exc)
    return ""


# ---------------------------------------------------------------------------------------------
# a short-lived owner of a region (the "killed" and "stalled" scenarios), in the prefill host's
# namespace


def doomed_owner(name: str) -> None:
    """Registers a buffer, prints its region (codec bytes, hex) and waits for its fate."""
    endpoint = KVNetEndpoint(PREFILL_IP, trusted_network=True, timeout_s=TIMEOUT_S)
    buffer = torch.ones(TOKENS * 1024, dtype=torch.uint8)
    endpoint.register(*buffer_piece(buffer))
    print(codec.encode(endpoint.region(name, [buffer_piece(buffer)])).hex(), flush=True)
    time.sleep(120)


# ---------------------------------------------------------------------------------------------
# the prefill host (this namespace), which runs the scenarios


def make_hosts() -> subprocess.Popen:
    """The veth pair, the decode host in a namespace of its own holding one end of it."""
    ip("link", "set", "lo", "up")
    ip("link", "add", "kv0", "type", "veth", "peer", "name", "kv1")
    child = subprocess.Popen(
        [
            "unshare",
            "-n",
            sys.executable,
            "-m",
            "tests.engine_worker.kv_net_hosts",
            "--decode",
            sys.argv[1] + ".decode",
        ]
    )
    own = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + 20
    while os.readlink(f"/proc/{child.pid}/ns/net") == own:  # until unshare has made its own
        if time.monotonic() > deadline:
            raise RuntimeError("the decode host's namespace never appeared")
        time.sleep(0.01)
    ip("link", "set", "kv1", "netns", str(child.pid))
    ip("addr", "add", f"{PREFILL_IP}/24", "dev", "kv0")
    ip("link", "set", "kv0", "up")
    return child


DECODE_HOST: subprocess.Popen | None = None


def answer(inbox: PullQueue[Any], transfer_id: str) -> KVNetDone:
    deadline = time.monotonic() + WAIT_MS / 1000
    while time.monotonic() < deadline:
        if DECODE_HOST is not None and DECODE_HOST.poll() is not None:
            raise RuntimeError(f"the decode host exited ({DECODE_HOST.returncode})")
        if inbox.wait(500):
            msg = inbox.get()
            if isinstance(msg, KVNetDone) and msg.transfer_id == transfer_id:
                return msg
    raise TimeoutError(f"no answer to {transfer_id!r}")


def pull_from_a_failed_owner(
    outbox: PushQueue, inbox: PullQueue[Any], name: str, fate: signal.Signals
) -> dict[str, Any]:
    """The decode host pulls a region whose owner got ``fate`` (SIGKILL: gone; SIGSTOP: alive
    to the kernel, answering nothing) after describing it: what it answered, and when."""
    owner = subprocess.Popen(
        [sys.executable, "-m", "tests.engine_worker.kv_net_hosts", "--doomed-owner", name],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        region = codec.decode_as(bytes.fromhex(owner.stdout.readline().strip()), KVNetRegion)
        owner.send_signal(fate)
        if fate == signal.SIGKILL:
            owner.wait(10)
        t0 = time.monotonic()
        done = answer_to(outbox, inbox, region)
        return {"ok": done.ok, "error": done.error, "after_fault_s": time.monotonic() - t0}
    finally:
        owner.kill()
        owner.wait(10)


def run_scenarios(results: dict[str, Any], bench: bool) -> None:
    ctx = zmq.Context()
    inbox: PullQueue[Any] = PullQueue(ctx, TO_PREFILL, KVNetRegion, KVNetDone, bind=True)
    outbox = PushQueue(ctx, TO_DECODE)
    endpoint = KVNetEndpoint(PREFILL_IP, trusted_network=True, timeout_s=TIMEOUT_S)
    cache = caches(PREFILL_CACHE_BLOCKS, PREFILL_SEED)
    staging = torch.empty(staged_bytes(cache, REQUEST_BLOCKS), dtype=torch.uint8)
    for buffer in (*cache, staging):
        endpoint.register(*buffer_piece(buffer))
    gather_blocks(cache, PREFILL_BLOCKS, staging)
    staged = endpoint.region("staged", [buffer_piece(staging)])
    scattered = endpoint.region("scattered", block_pieces(cache, PREFILL_BLOCKS))
    try:
        if not inbox.wait(WAIT_MS):
            raise TimeoutError("the decode host never offered its region to push into")
        push_region = inbox.get()  # the decode host offers it first thing
        assert isinstance(push_region, KVNetRegion) and push_region.transfer_id == "push"
        for region in (staged, scattered):
            done = answer_to(outbox, inbox, region)
            results[region.transfer_id] = {
                "ok": done.ok,
                "seconds": done.seconds,
                "error": done.error,
            }
        mine = block_pieces(cache, PREFILL_BLOCKS[: len(PUSH_BLOCKS)])
        seconds = endpoint.push(mine, push_region)
        outbox.put(KVNetDone("push", ok=True, nbytes=push_region.nbytes, seconds=seconds))
        for name, fate in (("killed", signal.SIGKILL), ("stalled", signal.SIGSTOP)):
            results[name] = pull_from_a_failed_owner(outbox, inbox, name, fate)
        if bench:
            results["bench"] = run_bench(outbox, inbox, staged, scattered, cache, staging)
    finally:
        outbox.put(KVNetDone("stop", ok=True))
        endpoint.close()
        inbox.close()
        outbox.close()
        ctx.term()


def answer_to(outbox: PushQueue, inbox: PullQueue[Any], region: KVNetRegion) -> KVNetDone:
    outbox.put(region)
    return answer(inbox, region.transfer_id)


def run_bench(
    outbox: PushQueue,
    inbox: PullQueue[Any],
    staged: KVNetRegion,
    scattered: KVNetRegion,
    cache: list[torch.Tensor],
    staging: torch.Tensor,
) -> dict[str, Any]:
    """Pull times of both layouts (the decode host's clock; its scatter times are in its own
    results), interleaved with this host's gather into the staging buffer and a memcpy of the
    same bytes."""
    times: dict[str, list[float]] = {"staged": [], "scattered": [], "gather": [], "memcpy": []}
    copy = torch.empty_like(staging)
    for i in range(5):
        for region in (staged, scattered):
            again = KVNetRegion(
                f"{region.transfer_id}#{i}",
                region.backend,
                region.session,
                region.addresses,
                region.lengths,
            )
            done = answer_to(outbox, inbox, again)
            times[region.transfer_id].append(done.seconds if done.ok else float("nan"))
        t0 = time.perf_counter()
        gather_blocks(cache, PREFILL_BLOCKS, staging)
        times["gather"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        copy.copy_(staging)
        times["memcpy"].append(time.perf_counter() - t0)
    loadavg = Path("/proc/loadavg").read_text().split()[:3]
    return {"nbytes": staging.numel(), "seconds": times, "loadavg": loadavg}


def main() -> None:
    torch.set_num_threads(1)  # one core per host, as an engine role gets on 2 cores
    if sys.argv[1] == "--decode":
        decode_host(sys.argv[2])
        return
    if sys.argv[1] == "--doomed-owner":
        doomed_owner(sys.argv[2])
        return
    results_path = Path(sys.argv[1])
    results: dict[str, Any] = {}
    global DECODE_HOST
    child = None
    try:
        child = DECODE_HOST = make_hosts()
        run_scenarios(results, bench="--bench" in sys.argv)
    except Exception:
        results["error"] = traceback.format_exc()
    finally:
        if child is not None:
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        decode_file = Path(sys.argv[1] + ".decode")
        if decode_file.exists():
            results["decode"] = json.loads(decode_file.read_text())
        results_path.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
