"""The one client of the peer benchmark: the ``openai`` package's async client, streamed chat
completions, a closed loop of ``concurrency`` requests in flight. A token's time is when its
chunk reaches this client, the same for every server."""

from __future__ import annotations

import asyncio
import time

from scripts.bench.metrics import RequestRecord


def _client(base_url: str):
    import httpx
    from openai import AsyncOpenAI

    # One fresh connection per request, for every server alike: llama-server sometimes closes
    # a kept-alive connection just as the next request goes out on it ("Server disconnected
    # without sending a response"; ~1 request in 8 at one stream). A new loopback connection
    # costs well under a millisecond. No retries: a failure must show.
    http = httpx.AsyncClient(
        timeout=httpx.Timeout(600.0, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
    )
    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)


async def _model_id(client) -> str:
    models = await client.models.list()
    return models.data[0].id


async def _one(
    client, model: str, rec: RequestRecord, messages, max_tokens: int, extra_body: dict
) -> None:
    rec.t_submit = rec.t_planned = time.monotonic()
    rec.t_submit_done = rec.t_submit
    chunks_with_text = 0
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra_body,
        )
        async for chunk in stream:
            now = time.monotonic()
            for choice in chunk.choices or ():
                if choice.delta is not None and choice.delta.content:
                    rec.delta_times.append(now)
                    chunks_with_text += 1
                if choice.finish_reason:
                    rec.finish_reason = choice.finish_reason
            if chunk.usage is not None:
                rec.prompt_tokens = chunk.usage.prompt_tokens or 0
                rec.output_tokens = chunk.usage.completion_tokens or 0
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                rec.cached_tokens = int(getattr(details, "cached_tokens", 0) or 0)
    except Exception as exc:  # noqa: BLE001 - any failure ends this request, and is reported
        # The openai SDK wraps transport failures ("Connection error."): keep what it wraps.
        cause = exc.__cause__ or exc.__context__
        detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        rec.error = f"{type(exc).__name__}: {exc}{detail}"[:300]
    rec.t_done = time.monotonic()
    if rec.error is None and rec.finish_reason is None:
        rec.error = "the stream ended without a finish_reason"
    if not rec.output_tokens:  # a server that sends no usage: one token per text chunk
        rec.output_tokens = chunks_with_text


async def _run(
    base_url: str, chats: list, concurrency: int, max_tokens: int, extra_body: dict, tag: str
) -> list[RequestRecord]:
    client = _client(base_url)
    try:
        model = await _model_id(client)
        records = [RequestRecord(index=i, request_id=f"{tag}-{i}") for i in range(len(chats))]
        next_index = iter(range(len(chats)))

        async def worker() -> None:  # closed loop: a new request as soon as one ends
            for i in next_index:
                await _one(client, model, records[i], chats[i], max_tokens, extra_body)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(chats)))))
        return records
    finally:
        await client.close()


def run_chats(
    base_url: str,
    chats: list,
    concurrency: int,
    max_tokens: int,
    extra_body: dict | None = None,
    tag: str = "peer",
) -> list[RequestRecord]:
    """Sends every chat, at most ``concurrency`` at a time; one record per chat, in order."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    return asyncio.run(
        _run(
            base_url,
            chats,
            concurrency,
            max_tokens,
            {"ignore_eos": True, **(extra_body or {})},
            tag,
        )
    )
