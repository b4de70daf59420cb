"""Clusters launched on a bare GGUF file, nothing beside it: the tiny model (served under the
name it is given), and the real default model's own file through ``splitserve launch`` (served
under the file's stem; it answers "Paris"). ``splitserve chat`` on the real model is
tests/test_cluster_real.py's; here it would start the same cluster from the same file again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ipc.client import Client
from procs import model_store
from procs.children import REPO_ROOT
from procs.launch_cluster import launch_cluster
from tests.gguf_files import write_tiny_gguf

QUESTION = "What is the capital of France?"


def get_json(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_a_tiny_gguf_alone_launches_from_the_bare_file(
    tiny_model_dir, default_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(model_store, "local_models_dir", lambda: tmp_path / "local")
    gguf = tmp_path / "files" / "tiny-alone.gguf"
    write_tiny_gguf(tiny_model_dir, gguf, default_model_dir=default_model_dir)
    assert sorted(p.name for p in gguf.parent.iterdir()) == ["tiny-alone.gguf"]
    with launch_cluster(
        str(gguf),
        tokenizer_workers=1,
        kv_cache_tokens=2048,
        http_port=0,
        served_model_name="tiny-served",
    ) as cluster:
        assert cluster.config.model_name == "tiny-served"
        models = get_json(f"{cluster.http_url}/v1/models")
        assert [m["id"] for m in models["data"]] == ["tiny-served"]
        body = {
            "model": "tiny-served",
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 4,
            "temperature": 0,
        }
        answer = get_json(f"{cluster.http_url}/v1/chat/completions", body)
        assert answer["model"] == "tiny-served" and answer["usage"]["completion_tokens"] == 4
        with Client(cluster.client_addr) as client:
            (result,) = client.generate(["Hello"], max_tokens=3, temperature=0)
            assert result.ok and len(result.token_ids) == 3


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory) -> dict[str, str]:
    """The command's environment: a model cache of its own, so the file's metadata is read
    (not found in the user's cache)."""
    cache = tmp_path_factory.mktemp("cache")
    # A cache of its own: aten's int4 kernel, not a minute of g++ building ours there
    env = dict(os.environ, SPLITSERVE_CACHE=str(cache), SPLITSERVE_NO_KERNEL_BUILD="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.slow
def test_launch_on_the_default_models_gguf_file_serves_it_under_its_stem(
    default_model_dir, cli_env, tmp_path
):
    gguf = model_store.gguf_file(default_model_dir)
    assert gguf is not None
    log = tmp_path / "launch.out"
    with open(log, "w") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "procs.cli", "launch", "--model", str(gguf), "--http-port", "0"],
            env=cli_env,
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.DEVNULL,
        )
    try:
        base = wait_for_api(log, popen)
        models = get_json(f"{base}/models")
        assert [m["id"] for m in models["data"]] == [gguf.stem]  # SmolLM2-135M-Instruct.Q4_1
        body = {
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 24,
            "temperature": 0,
        }
        answer = get_json(f"{base}/chat/completions", body)
        assert answer["model"] == gguf.stem
        assert "Paris" in answer["choices"][0]["message"]["content"]
    finally:
        popen.send_signal(signal.SIGINT)
        assert popen.wait(timeout=60) == 0


def wait_for_api(log: Path, popen: subprocess.Popen, timeout_s: float = 400) -> str:
    """The launch's "OpenAI API: URL/v1 ..." line, once it is printed."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("OpenAI API: "):
                return line.split()[2]
        assert popen.poll() is None, log.read_text()
        time.sleep(0.5)
    raise AssertionError(f"no API after {timeout_s} s: {log.read_text()}")
