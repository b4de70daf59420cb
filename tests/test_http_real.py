"""The HTTP frontend on the real default model (SmolLM2-135M-Instruct) with the openai client."""

from __future__ import annotations

import openai
import pytest

from procs.launch_cluster import launch_cluster
from tests.test_http_tiny import free_port, start_frontend, stop_frontend

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def oai(default_model_dir):
    with launch_cluster(str(default_model_dir), tokenizer_workers=1, max_model_len=2048) as c:
        port = free_port()
        popen = start_frontend(c, port, model_name="smollm2")
        try:
            yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                max_retries=0, timeout=120)
        finally:
            stop_frontend(popen)


def test_chat_answers_paris(oai):
    r = oai.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                    max_tokens=24)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # the model ends its turn by itself
    assert r.usage.completion_tokens < 24


def test_streamed_chat_answers_paris(oai):
    chunks = list(oai.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                              max_completion_tokens=24, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "Paris" in text and chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_on_the_answer(oai):
    r = oai.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0,
                                    max_tokens=24, stop=["Paris"])
    assert r.choices[0].finish_reason == "stop" and "Paris" not in r.choices[0].message.content
