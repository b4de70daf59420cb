"""``splitserve serve`` started the way a vLLM user starts ``vllm serve`` for a single-node CPU
deployment (the program name changed, nothing else), in a real process on the tiny model, and
spoken to with the openai client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from procs.children import REPO_ROOT
from procs.cluster_setup import free_tcp_port

TEMPLATE = (
    "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>{% endif %}"
)
API_KEY = "sk-test-serve"


def wait_until_serving(popen: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "OpenAI API: " in log.read_text():
            return
        assert popen.poll() is None, log.read_text()
        time.sleep(0.5)
    raise AssertionError(f"not serving after {timeout_s} s: {log.read_text()}")


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def vllm_style_server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "template.jinja").write_text(TEMPLATE)
    port, events_port = free_tcp_port("127.0.0.1"), free_tcp_port("127.0.0.1")
    # What `vllm serve` takes, with `vllm` replaced by `splitserve` (and nothing else changed).
    argv = [
        "serve", str(tiny_model_dir),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", "tiny-vllm",
        "--max-model-len", "1K",
        "--max-num-seqs", "4",
        "--max-num-batched-tokens", "256",
        "--api-key", API_KEY,
        "--chat-template", str(tmp / "template.jinja"),
        "--enable-prefix-caching",
        "--data-parallel-size", "1",
        "--kv-events-config",
        json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                    "endpoint": f"tcp://127.0.0.1:{events_port}", "topic": "kv"}),
        "--gpu-memory-utilization", "0.9",
        "--seed", "0",
        "--dtype", "float",
        "--generation-config", "vllm",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 4}',
        "--tensor-parallel-size", "1",
        "--trust-remote-code",
        "--enforce-eager",
    ]  # fmt: skip
    env = dict(os.environ, SPLITSERVE_CACHE=str(tmp / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    log = tmp / "serve.log"
    with open(log, "w") as out:
        popen = subprocess.Popen(
            ["nice", "-n", "10", sys.executable, "-m", "procs.cli", *argv],
            env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until_serving(popen, log)
        yield f"http://127.0.0.1:{port}", log
    finally:
        popen.send_signal(signal.SIGINT)
        code = popen.wait(timeout=60)
    assert code == 0, log.read_text()


def test_the_openai_client_is_served_under_the_vllm_flags(vllm_style_server):
    base, log = vllm_style_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-vllm"]
    chat = client.chat.completions.create(
        model="tiny-vllm",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=4,
        temperature=0,
    )
    assert chat.model == "tiny-vllm" and chat.usage.completion_tokens == 4
    stream = client.completions.create(
        model="tiny-vllm", prompt="Once upon a time", max_tokens=3, temperature=0, stream=True
    )
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text) >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    notes = log.read_text()
    assert "--trust-remote-code: no effect" in notes and "--enforce-eager" in notes


def test_the_chat_template_flag_replaces_the_models_template(vllm_style_server):
    base, _ = vllm_style_server
    tokens = post(f"{base}/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    text = post(f"{base}/detokenize", {"tokens": tokens["tokens"]})["prompt"]
    assert text == "<<user>>hi\n<<assistant>>"
    request = urllib.request.Request(
        f"{base}/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.loads(response.read())["chat_template"] == TEMPLATE


def test_max_model_len_reaches_the_models_list(vllm_style_server):
    base, _ = vllm_style_server
    request = urllib.request.Request(
        f"{base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        (model,) = json.loads(response.read())["data"]
    assert model["max_model_len"] == 1024  # --max-model-len 1K, as vLLM reads it
