"""The one HTTP streaming client of the benchmarks: streamed OpenAI chat completions over httpx
(asyncio), each request's outcome filling a RequestRecord. A token's time is when its SSE chunk
reaches this client, the same for every server (splitserve's frontend, llama-server): the peer
workload's parts (serve, hops, startup) drive it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scripts.bench.stats import RequestRecord

if TYPE_CHECKING:
    import httpx


@dataclass(slots=True)
class StreamOutcome:
    """What one streamed request came to, as seen by this client."""

    t_sent: float = 0.0  # the request body was written to the connection (0: never)
    t_done: float = 0.0
    delta_times: list[float] = field(default_factory=list)  # chunks that carried text
    finish_reason: str | None = None
    error: str | None = None
    usage: dict | None = None
    # SSE comments (": text" lines, splitserve's path times): (how many text chunks came
    # before it, the text after ": ")
    comments: list[tuple[int, str]] = field(default_factory=list)

    def fill(self, rec: RequestRecord) -> None:
        rec.delta_times, rec.t_done = self.delta_times, self.t_done
        if self.t_sent:  # an HTTP request is submitted once its body is on the connection
            rec.t_submit_done = self.t_sent
        rec.finish_reason = "error" if self.error else self.finish_reason
        rec.error = self.error
        usage = self.usage or {}
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        # A server that sends no usage: one token per chunk with text.
        rec.output_tokens = int(usage.get("completion_tokens") or len(self.delta_times))
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)


def base_url(url: str) -> str:
    """The server's root: 'http://h:p/v1/' -> 'http://h:p'."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    """A streamed chat completion, greedy, ``max_tokens`` tokens out (ignore_eos), with usage."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def make_http() -> httpx.AsyncClient:
    """A fresh connection per request: llama-server sometimes closes a kept-alive connection just
    as the next request goes out on it ("Server disconnected without sending a response"; ~1
    request in 8 at one stream); a new loopback connection costs well under a millisecond. No
    retries: a failure must show."""
    import httpx  # the bench extra

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits)


async def model_id(http: httpx.AsyncClient, url: str) -> str:
    reply = await http.get(f"{base_url(url)}/v1/models")
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


async def stream(
    http: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None
) -> StreamOutcome:
    """Sends one streamed chat completion and reads it to its end; never raises for the
    request's own failure (it is the outcome's error)."""
    out = StreamOutcome()

    async def trace(event: str, info: dict) -> None:
        if event == "http11.send_request_body.complete":
            out.t_sent = time.monotonic()

    try:
        async with http.stream(
            "POST",
            base_url(url) + "/v1/chat/completions",
            json=body,
            headers=headers,
            extensions={"trace": trace},
        ) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                out.error = f"HTTP {reply.status_code}: {text[:300]}"
            else:
                async for line in reply.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        _take_chunk(out, json.loads(line[len("data: ") :]), time.monotonic())
                    elif line.startswith(": "):
                        out.comments.append((len(out.delta_times), line[2:]))
    except Exception as exc:  # noqa: BLE001 - any transport failure ends this request
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    out.t_done = time.monotonic()
    if out.error is None and out.finish_reason is None:
        out.error = "the stream ended without a finish_reason"
    return out


def _take_chunk(out: StreamOutcome, chunk: dict, now: float) -> None:
    if chunk.get("error"):
        out.error = str(chunk["error"].get("message", chunk["error"]))
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content"):
            out.delta_times.append(now)
        out.finish_reason = choice.get("finish_reason") or out.finish_reason
    if chunk.get("usage"):
        out.usage = chunk["usage"]
