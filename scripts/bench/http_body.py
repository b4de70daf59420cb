"""How long one HTTP frontend's event loop stalls while it reads a large body (issue 23 item 1).

The frontend app runs in this process (no cluster: every body is read, validated and planned
in full before the answer, a 400 for what the edge refuses, else a 503 "not connected"), over an
ASGI transport; a task on the same loop sleeping 1 ms at a time records its worst lateness while
one request is answered. Each body is measured with the parsing and validation on the loop
(``inline``) and in the frontend's worker thread (``thread``: bodies over 64 KiB), alternating,
and the median of the repeats is printed.

    python -m scripts.bench http-body [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx

import http_worker.body
from http_worker.app import build_app
from http_worker.frontend import FrontendSettings

CHAT = [{"role": "user", "content": "hi"}]


def bodies() -> dict[str, tuple[str, dict[str, Any]]]:
    """The issue's bodies, and two large valid-looking ones with much Python-level work."""
    enum = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}}
    enum["json_schema"]["schema"]["enum"] = [f"v{i}" for i in range(100_000)]
    parts = [{"type": "text", "text": "x"}]
    return {
        "enum of 100,000 (response_format)": (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": enum},
        ),
        "choice of 100,000 (structured_outputs)": (
            "/v1/completions",
            {"prompt": "hi", "structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}},
        ),
        "4,000 messages of a text part": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": parts} for _ in range(4000)]},
        ),
        "128 prompts of 1,000 token ids": ("/v1/completions", {"prompt": [[1] * 1000] * 128}),
    }


async def worst_lag(client: httpx.AsyncClient, path: str, raw: bytes) -> tuple[int, float]:
    lateness: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lateness.append(time.perf_counter() - t0 - 0.001)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    status = (await client.post(path, content=raw)).status_code
    done.set()
    await ticker
    return status, max(lateness)


async def measure(repeats: int) -> None:
    app = build_app(FrontendSettings(client_addr="ipc:///nonexistent", model_name="m"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://frontend") as client:
        for name, (path, body) in bodies().items():
            raw = json.dumps(body).encode()
            lags: dict[str, list[float]] = {"inline": [], "thread": []}
            for _ in range(repeats):
                for mode, inline_bytes in (("inline", 2**62), ("thread", 64 * 1024)):
                    http_worker.body.INLINE_BODY_BYTES = inline_bytes
                    status, lag = await worst_lag(client, path, raw)
                    lags[mode].append(lag)
            print(
                f"{name} ({len(raw) / 1e6:.2f} MB, answer {status}): worst loop lag, median "
                f"of {repeats}: inline {1e3 * statistics.median(lags['inline']):.1f} ms, "
                f"thread {1e3 * statistics.median(lags['thread']):.1f} ms"
            )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench http-body", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds (default 5)")
    return parser


def main(argv: list[str] | None = None) -> None:
    asyncio.run(measure(build_parser().parse_args(argv).repeats))
