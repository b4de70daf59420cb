"""An engine replica of the Serve application: one splitserve engine with its own scheduler, KV
cache and prefix cache, on the node Serve placed it.

The replica runs a small splitserve cluster of its own (the supervisor and its processes: one
engine, its detokenizer, one tokenizer worker that only checks the token ids it receives) and is
that cluster's client. Requests arrive from the ingress as token ids (``calls.EngineCall``); the
deltas go back as a stream of ipc ClientEvents frames. A caller that goes away (the HTTP client
disconnected) cancels the stream, and the request is aborted in the engine.

The cluster publishes its KV events in vLLM's format on a TCP endpoint of the node; the replica
advertises it through Serve's routing stats under ``kv_event_metadata`` (endpoint, block_size,
replay_endpoint, dp_rank: the shape Ray's KV-aware router reads) with its load, so the ingress's
request router (router.py) follows every replica's cache. Beyond loopback the endpoint needs
CURVE (DESIGN property 7): the cluster then runs with CURVE keys, and the routing stats carry
its public key for the router.

In the prefill/decode mode (docs/ray.md) a replica of the ``prefill`` deployment computes a
prompt and has its engine export the prompt's cached blocks (``prefill``); one of the
``decode`` deployment has its engine import them into its prefix cache before it serves the
request (``generate`` with ``EngineCall.kv``). The engines do the copying
(engine_worker/kv_handover.py); the replica asks them through ``handover.HandoverChannel``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from ipc import codec
from ipc.client import AsyncClient, AsyncRequestHandle, Delta, SplitserveError
from ipc.codec import unpack_id_list
from ipc.config import LOOPBACK_HOSTS
from ipc.messages import KVDescriptor, SamplingParams, SubmitRequest
from procs.cluster_setup import free_tcp_port, make_config
from procs.launch_cluster import Cluster
from procs.serve_ray.calls import EngineCall, PrefillResult, delta_event, encode_events
from procs.serve_ray.handover import HandoverChannel
from procs.serve_ray.settings import NODE_ADDRESS, ServeSettings

logger = logging.getLogger("splitserve.serve_ray")
# vLLM's name for a step's prompt-token budget, which Ray's KV-aware router reads; ours resolves
# 0 to this on CPU (ipc.engine_config).
CPU_PREFILL_TOKENS = 512
HANDOVER = {"prefill": "export", "decode": "import"}  # a role's engine (kv_handover)
HANDOVER_SLACK_S = 5.0  # an ask waits for the transfer's bound and this


def event_endpoints(host: str) -> tuple[str, str, str, str, bool]:
    """Where this replica's KV events are bound and advertised: (endpoint, replay endpoint,
    advertised endpoint, advertised replay endpoint, whether CURVE is needed). A wildcard bind
    stays on loopback without CURVE (ipc.kv_events.plan_endpoint), so only a loopback host
    goes without it."""
    loopback = host in LOOPBACK_HOSTS
    port, replay_port = (free_tcp_port("127.0.0.1" if loopback else "0.0.0.0") for _ in "ab")
    return (
        f"tcp://*:{port}",
        f"tcp://*:{replay_port}",
        f"tcp://{host}:{port}",
        f"tcp://{host}:{replay_port}",
        not loopback,
    )


class EngineReplica:
    # Serve awaits an async constructor (the client needs the replica's event loop).
    async def __init__(self, settings: ServeSettings, role: str = "") -> None:  # type: ignore[misc]
        """``role``: "" (colocated), "prefill" or "decode" (the two deployments of the
        prefill/decode mode: this replica's engine exports or imports prompt KV)."""
        self.rank = serve.get_replica_context().rank.rank
        self.role = role
        host = settings.kv_events_host
        if host == NODE_ADDRESS:
            host = ray.util.get_node_ip_address()
        bind, bind_replay, self.endpoint, self.replay_endpoint, curve = event_endpoints(host)
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": bind,
            "replay_endpoint": bind_replay,
        }
        knobs: dict[str, Any] = {"tokenizer_workers": 1, **settings.cluster}
        if role:
            knobs["kv_handover"] = HANDOVER[role]
            if knobs.get("kv_net_host") == NODE_ADDRESS:
                knobs["kv_net_host"] = ray.util.get_node_ip_address()
        config, owns = make_config(
            settings.model or None,
            None,
            kv_events_config=json.dumps(kv_events),
            require_curve=curve or bool(knobs.pop("require_curve", False)),
            **knobs,
        )
        # Started from the replica's constructor thread, which lives as long as the replica:
        # the processes die with it (runtime.process.die_with_parent).
        self.cluster = Cluster.start(config, owns_run_dir=owns)
        self.client = await AsyncClient(
            self.cluster.client_addr, server_public_key=self.cluster.curve_public_key
        ).start()
        self.handover = HandoverChannel(self.cluster.config) if role else None
        self.handover_timeout_s = self.cluster.config.kv_transfer_timeout_s + HANDOVER_SLACK_S
        self.open = 0  # requests in this replica that have not ended
        self.served = self.aborted = 0
        self.kv_moved = self.kv_failed = 0  # prompts exported or imported, and those not
        engine = self.cluster.config.engine
        self.block_size = engine.block_size
        self.prefill_tokens = engine.prefill_max_tokens or CPU_PREFILL_TOKENS
        logger.info(
            "engine replica %d: %s; KV events at %s", self.rank, self.cluster.describe(), host
        )

    def info(self) -> dict[str, Any]:
        """What the ingress prepares requests against: the model and its resolved limits."""
        welcome = self.client.welcome
        assert welcome is not None
        return {
            "model": welcome.model,
            "max_model_len": welcome.max_model_len,
            "vocab_size": welcome.vocab_size,
            "block_size": self.block_size,
        }

    async def generate(self, call: EngineCall) -> AsyncIterator[bytes]:
        """The request's events as ClientEvents frames, the terminal one included (an error is
        an event too, never an exception)."""
        request = codec.decode_as(call.payload, SubmitRequest)
        wire_id = request.request_id
        if call.kv is not None and self.handover is not None:
            await self._import(request, call.kv)
        handle = self.client.submit(
            prompt_token_ids=unpack_id_list(request.prompt_token_ids or b""),
            sampling=request.sampling,
            request_id=wire_id,
            continuous_usage_stats=request.continuous_usage_stats,
            response_format=request.structured,
            tools=json.loads(request.tools) if request.tools else None,
            tool_choice=json.loads(request.tool_choice) if request.tool_choice else None,
            parallel_tool_calls=request.parallel_tool_calls,
            cache_salt=request.cache_salt,
        )
        self.open += 1
        self.served += 1
        try:
            async for deltas in batches(handle):
                yield encode_events([delta_event(d, wire_id, self.rank) for d in deltas])
        finally:
            self.open -= 1
            if not handle.done:  # the caller went away (Serve cancelled this generator)
                handle.abort()
                self.aborted += 1

    async def prefill(self, call: EngineCall) -> PrefillResult:
        """A prefill replica's part: the prompt computed (a first token sampled and dropped),
        then its cached full blocks exported for a decode replica."""
        request = codec.decode_as(call.payload, SubmitRequest)
        handle = self.client.submit(
            prompt_token_ids=unpack_id_list(request.prompt_token_ids or b""),
            sampling=SamplingParams(max_tokens=1, temperature=0),  # the token is dropped
            request_id=request.request_id,
            cache_salt=request.cache_salt,
        )
        self.open += 1
        self.served += 1
        try:
            async for _ in handle.stream():
                pass
        except SplitserveError as exc:
            self.kv_failed += 1
            return PrefillResult(error=f"the prefill failed: {exc}")
        finally:
            self.open -= 1
            if not handle.done:  # the caller went away
                handle.abort()
                self.aborted += 1
        assert self.handover is not None
        reply = await asyncio.to_thread(
            self.handover.export,
            request.request_id,
            request.prompt_token_ids or b"",
            request.cache_salt,
            self.handover_timeout_s,
        )
        if reply.kv is None:
            self.kv_failed += 1
            return PrefillResult(error=reply.error)
        self.kv_moved += 1
        return PrefillResult(reply.kv, reply.blocks, seconds=reply.seconds)

    async def _import(self, request: SubmitRequest, kv: KVDescriptor) -> None:
        """A decode replica's part before it serves ``request``: the KV a prefill replica
        exported, into this engine's prefix cache (on failure the engine computes it)."""
        assert self.handover is not None
        reply = await asyncio.to_thread(
            self.handover.import_,
            request.request_id,
            request.prompt_token_ids or b"",
            kv,
            request.cache_salt,
            self.handover_timeout_s,
        )
        if reply.error:
            self.kv_failed += 1
            logger.warning(
                "%s: KV not imported (%s); computed here", request.request_id, reply.error
            )
        else:
            self.kv_moved += 1

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve hands the request routers: this replica's load (its requests not yet
        ended) and where its KV events are, in the shape Ray's KV-aware router reads."""
        return {
            "load": self.open,
            "served": self.served,
            "aborted": self.aborted,
            "rank": self.rank,
            "role": self.role,
            "kv_moved": self.kv_moved,
            "kv_failed": self.kv_failed,
            "curve_public_key": self.cluster.curve_public_key or "",
            "kv_event_metadata": {
                "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint,
                "block_size": self.block_size,
                "dp_rank": 0,
                "max_num_batched_tokens": self.prefill_tokens,
            },
        }

    def check_health(self) -> None:
        """Serve replaces a replica whose cluster stopped (a process out of restarts)."""
        if self.cluster.failure is not None:
            raise RuntimeError(f"the replica's cluster stopped: {self.cluster.failure}")

    def __del__(self) -> None:
        # Serve's graceful stop: every open request gets its terminal event from the cluster.
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            cluster.shutdown()
        handover = getattr(self, "handover", None)
        if handover is not None:
            handover.close()


async def batches(handle: AsyncRequestHandle) -> AsyncIterator[list[Delta]]:
    """The handle's deltas, each batch what arrived while the previous one was being sent: a
    Serve stream item costs the same for one delta as for many, so when the caller reads slower
    than tokens come (a loaded ingress) it gets fewer, larger items instead of a growing lag."""
    queue: asyncio.Queue[Delta] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for delta in handle.stream():
                queue.put_nowait(delta)
        except SplitserveError:  # the handle's terminal event was an error: pass it on
            assert handle.record.final is not None
            queue.put_nowait(handle.record.final)

    task = asyncio.get_running_loop().create_task(pump())
    try:
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            yield batch
            if batch[-1].finished:
                return
    finally:
        task.cancel()
