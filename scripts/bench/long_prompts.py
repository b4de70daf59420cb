"""long-prompts: an unrelated stream's TTFT alone and beside 7.2 MB prompts (issue 38).

Short requests go one at a time for --seconds; then again for --seconds while another client
submits a 7.2 MB text prompt after each answer of the last one (every --pace seconds at most).
Such a prompt cannot fit the context: it is refused (400) from its length before any tokenizer
reads it, where before it was encoded in full (~10 s on a quiet machine, ~21 s here at load 13)
in the tokenizer worker's one queue. The tiny random model with an 8,192-token context, one
tokenizer worker, through the SDK (the HTTP frontend's part is `http-body`'s).

    python -m scripts.bench long-prompts [--seconds 30] [--pace 0.5]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time

from scripts.bench.stats import describe_ms

PROMPT_CHARS = 7_200_000
WORDS = "the quick brown fox jumps over a lazy dog and then some 12345".split()


def huge_prompt() -> str:
    rng = random.Random(0)
    return " ".join(rng.choice(WORDS) for _ in range(1_800_000))[:PROMPT_CHARS]


def shorts(client, seconds: float) -> list[float]:
    """TTFTs (s) of short requests sent one after another for ``seconds``."""
    out, end, i = [], time.monotonic() + seconds, 0
    while time.monotonic() < end:
        i += 1
        result = client.submit(f"Tell me about the number {i}", max_tokens=2).result(timeout=300)
        out.append(result.ttft_s)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.bench long-prompts", description=__doc__)
    p.add_argument("--seconds", type=float, default=30.0, help="each phase's length")
    p.add_argument("--pace", type=float, default=0.0, help="wait between huge prompts (s)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from ipc.client import Client
    from procs.launch_cluster import launch_cluster
    from scripts.bench.tiny_model import make_tiny_model

    huge = huge_prompt()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(tmp, max_position_embeddings=8192)
        with launch_cluster(str(model), tokenizer_workers=1, max_model_len=8192) as cluster:
            with Client(cluster.client_addr) as client, Client(cluster.client_addr) as other:
                shorts(client, 2)
                load = os.getloadavg()[0]
                alone = shorts(client, args.seconds)
                stop, refused = threading.Event(), []

                def flood() -> None:
                    while not stop.is_set():
                        t_start = time.monotonic()
                        result = other.submit(huge, max_tokens=1).result(timeout=300, check=False)
                        refused.append((time.monotonic() - t_start, result.error_code))
                        time.sleep(args.pace)

                thread = threading.Thread(target=flood)
                thread.start()
                beside = shorts(client, args.seconds)
                stop.set()
                thread.join()
    print(f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    for what, ttfts in (("alone", alone), ("beside 7.2 MB prompts", beside)):
        line = f"{describe_ms(ttfts)}, max {max(ttfts) * 1e3:.0f} ms"
        print(f"  TTFT {what:22s} ({len(ttfts)}) {line}")
    waits = [s for s, _ in refused]
    codes = sorted({str(c) for _, c in refused})
    print(f"  7.2 MB prompts: {len(refused)}, answered {codes}, {describe_ms(waits)} each")


if __name__ == "__main__":
    main()
