"""Where a streamed answer's time goes between the engine and the HTTP client, on request.

A client that sends the header ``X-Splitserve-Path-Times: 1`` gets, in the SSE stream of a
streamed generation, a comment line before each piece that carries tokens (SSE clients, the
``openai`` package among them, skip comments)::

    : path {"t_step": ..., "t_detok_woke": ..., "t_detok_sent": ..., "t_http_in": ..., "t_sse": ...}

and one before the stream's ending with the request's own stages (the SDK's RequestTimings plus
``t_http_arrived``, when this frontend began reading the request)::

    : path-request {"t_http_arrived": ..., "t_submit": ..., "t_tokenized": ..., ...}

Times are ``time.monotonic()`` seconds of the machine the cluster runs on (system-wide on Linux,
so a client on the same host compares them with its own): the end of the engine step of the
piece's newest token, when the detokenizer woke up for it and sent it, when this frontend
received it, and when it handed the piece to the server to write. ``scripts.bench hops`` reads
them.
"""

from __future__ import annotations

import dataclasses
import json
import time

from starlette.requests import Request

from ipc.client import Delta

HEADER = "x-splitserve-path-times"


def wanted(request: Request) -> bool:
    return request.headers.get(HEADER, "") == "1"


def _comment(name: str, times: dict[str, float]) -> bytes:
    return f": {name} {json.dumps(times, separators=(',', ':'))}\n\n".encode()


def delta_comment(delta: Delta) -> bytes:
    """The comment before a piece with ``delta``'s tokens; empty for a delta without any."""
    if not (delta.text or delta.token_ids):
        return b""
    return _comment(
        "path",
        {
            "t_step": delta.t_step,
            "step_ms": delta.step_ms,
            "threads": delta.step_threads,
            "t_detok_woke": delta.t_detok_woke,
            "t_detok_sent": delta.t_detok_sent,
            "t_http_in": delta.t_received,
            "t_sse": time.monotonic(),
        },
    )


def request_comment(t_http_arrived: float, finals: list[Delta | None]) -> bytes:
    """The request's stages, from its first choice's terminal event (empty if it has none)."""
    final = next((f for f in finals if f is not None and f.timings is not None), None)
    if final is None or final.timings is None:
        return b""
    return _comment(
        "path-request", {"t_http_arrived": t_http_arrived, **dataclasses.asdict(final.timings)}
    )
