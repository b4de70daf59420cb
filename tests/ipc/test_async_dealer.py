"""The asyncio client's DEALER (ipc.client.dealer_watch) against a detokenizer's ROUTER and a
tokenizer's PULL made here: frames reach their handles, a lost connection ends what is open, an
abort goes out, nobody answering is UnavailableError. Real sockets, no cluster (milliseconds)."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from ipc import codec
from ipc.client import AsyncClient, UnavailableError
from ipc.messages import (
    ClientAbort,
    ClientEvents,
    ClientHello,
    ClientWelcome,
    StreamEvent,
    SubmitRequest,
    Usage,
)


class Detokenizer:
    """Just enough of one: a ROUTER clients say hello to, and a PULL standing in for the one
    tokenizer worker it names in its welcome."""

    def __init__(self, tmp_path) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.address = f"ipc://{tmp_path}/client.sock"
        self.router.bind(self.address)
        self.tokenizer = self.ctx.socket(zmq.PULL)
        self.tokenizer_addr = f"ipc://{tmp_path}/tokenizer.sock"
        self.tokenizer.bind(self.tokenizer_addr)
        self.client_id = b""

    def receive(self, kind: type, timeout_ms: int = 5000):
        assert self.router.poll(timeout_ms), f"no {kind.__name__} from the client"
        self.client_id, frame = self.router.recv_multipart()
        return codec.decode_as(frame, kind)

    def welcome(self) -> None:
        self.receive(ClientHello)
        welcome = ClientWelcome([self.tokenizer_addr], "m", 64, 100, max_waiting_requests=8)
        self.router.send_multipart([self.client_id, codec.encode(welcome)])

    def submitted(self) -> str:
        assert self.tokenizer.poll(5000), "no request reached the tokenizer"
        return codec.decode_as(self.tokenizer.recv(), SubmitRequest).request_id

    def send(self, *events: StreamEvent) -> None:
        frame = codec.encode(ClientEvents(events=list(events)))
        self.router.send_multipart([self.client_id, frame])

    def close(self) -> None:
        self.router.close(linger=0)
        self.tokenizer.close(linger=0)
        self.ctx.term()


@pytest.fixture
def detokenizer(tmp_path):
    d = Detokenizer(tmp_path)
    yield d
    d.close()


async def _started(detokenizer: Detokenizer) -> AsyncClient:
    client = AsyncClient(detokenizer.address, connect_timeout_s=5)
    starting = asyncio.ensure_future(client.start())
    await asyncio.to_thread(detokenizer.welcome)
    return await starting


def test_frames_reach_their_handles_and_an_abort_goes_out(detokenizer):
    async def run() -> None:
        client = await _started(detokenizer)
        handle = client.submit(prompt_token_ids=[1, 2], max_tokens=2)
        wire_id = await asyncio.to_thread(detokenizer.submitted)
        detokenizer.send(StreamEvent(wire_id, text="a", token_ids=codec.pack_ids([5])))
        detokenizer.send(
            StreamEvent(wire_id, text="b", finished=True, finish_reason="length"),
            StreamEvent("not-ours", text="x"),  # dropped: no such open request
        )
        texts = [delta.text async for delta in handle]
        assert texts == ["a", "b"]
        other = client.submit(prompt_token_ids=[3], max_tokens=2)
        other_id = await asyncio.to_thread(detokenizer.submitted)
        other.abort()
        abort = await asyncio.to_thread(detokenizer.receive, ClientAbort)
        assert abort.request_ids == [other_id]
        await client.close()

    asyncio.run(run())


def test_a_lost_connection_ends_what_is_open(detokenizer):
    async def run() -> None:
        client = await _started(detokenizer)
        handle = client.submit(prompt_token_ids=[1], max_tokens=4)
        wire_id = await asyncio.to_thread(detokenizer.submitted)
        detokenizer.send(StreamEvent(wire_id, text="a"))
        detokenizer.router.close(linger=0)  # the detokenizer dies mid-stream
        result = await asyncio.wait_for(handle.result(check=False), 5)
        assert result.text == "a" and result.finish_reason == "error"
        assert "connection to the detokenizer was lost" in (result.error or "")
        await client.close()

    asyncio.run(run())


def test_nobody_answering_is_unavailable(tmp_path):
    async def run() -> None:
        client = AsyncClient(f"ipc://{tmp_path}/nobody.sock", connect_timeout_s=0.2)
        with pytest.raises(UnavailableError, match="no splitserve cluster answered"):
            await client.start()

    asyncio.run(run())


def test_usage_of_a_finished_request(detokenizer):
    async def run() -> None:
        client = await _started(detokenizer)
        handle = client.submit(prompt_token_ids=[1, 2, 3], max_tokens=1)
        wire_id = await asyncio.to_thread(detokenizer.submitted)
        usage = Usage(prompt_tokens=3, completion_tokens=1)
        detokenizer.send(
            StreamEvent(wire_id, text="z", finished=True, finish_reason="stop", usage=usage)
        )
        result = await asyncio.wait_for(handle.result(), 5)
        assert (result.text, result.usage.prompt_tokens) == ("z", 3)
        await client.close()

    asyncio.run(run())
