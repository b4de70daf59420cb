"""lm-evaluation-harness against a real cluster, offline: `lm-eval run --model local-completions`
(which finds the server's /tokenizer_info and /tokenize and uses them instead of downloading a
tokenizer) and `--model local-chat-completions --apply_chat_template`, on a generate_until task
defined here over a local JSONL (capitals.yaml). Every answer the harness records must be the
answer the SDK gets for the same request, and its score must be the score of those answers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ipc.client import Client
from procs.children import REPO_ROOT
from procs.launch_cluster import launch_cluster

pytestmark = pytest.mark.slow  # two harness runs on the real model: about a minute each here
TASK = "splitserve_capitals"
DOCS = [json.loads(line) for line in (Path(__file__).parent / "capitals.jsonl").open()]
MAX_GEN_TOKS = 12  # capitals.yaml's generation_kwargs


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    with launch_cluster(str(default_model_dir), tokenizer_workers=1, max_model_len=2048,
                        http_port=0) as c:
        yield c


def run_harness(cluster, model: str, endpoint: str, tmp_path: Path, *extra: str
                ) -> tuple[list[dict], dict, str]:
    """One offline harness run; returns its samples (in doc order), results and log."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    model_args = (f"model={cluster.config.model_name},base_url={cluster.http_url}/v1/{endpoint},"
                  "num_concurrent=1,max_retries=1")
    done = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
         "--tasks", TASK, "--include_path", "tests/evals", "--output_path", str(tmp_path),
         "--log_samples", *extra],
        cwd=str(REPO_ROOT), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (samples_file,) = tmp_path.rglob(f"samples_{TASK}_*.jsonl")
    (results_file,) = tmp_path.rglob("results_*.json")
    samples = sorted((json.loads(line) for line in samples_file.open()),
                     key=lambda s: s["doc_id"])
    results = json.loads(results_file.read_text())["results"][TASK]
    return samples, results, done.stderr


def last_word(text: str) -> str:
    found = re.findall(r"(\w+)\W*$", text)  # capitals.yaml's filter
    return found[0] if found else "[invalid]"


def check_scores(samples: list[dict], results: dict, answers: list[str]) -> None:
    assert [s["resps"][0][0] for s in samples] == answers
    assert [s["filtered_resps"][0] for s in samples] == [last_word(a) for a in answers]
    right = [last_word(a).lower() == doc["capital"].lower() for a, doc in zip(answers, DOCS)]
    assert results["exact_match,last_word"] == pytest.approx(sum(right) / len(DOCS))
    print(f"\nlm-eval exact_match {results['exact_match,last_word']:.3f} over {len(DOCS)} docs")
    assert right[0], answers[0]  # the real model knows the capital of France


def test_generate_until_through_local_completions(cluster, tmp_path):
    samples, results, log = run_harness(cluster, "local-completions", "completions", tmp_path)
    assert "Auto-detected remote tokenizer support" in log  # our /tokenizer_info, /tokenize
    assert len(samples) == len(DOCS)
    with Client(cluster.client_addr) as client:
        eos = client.tokenizer_info()["eos_token"]
        # The harness stops at its `until` and the tokenizer's eos string, as it told us.
        answers = [client.submit(s["arguments"]["gen_args_0"]["arg_0"], temperature=0,
                                 max_tokens=MAX_GEN_TOKS, stop=["\n", eos]).result(120).text
                   for s in samples]
    check_scores(samples, results, answers)


def test_generate_until_through_local_chat_completions(cluster, tmp_path):
    samples, results, _ = run_harness(cluster, "local-chat-completions", "chat/completions",
                                      tmp_path, "--apply_chat_template")
    assert len(samples) == len(DOCS)
    with Client(cluster.client_addr) as client:
        answers = []
        for s in samples:
            (chat,) = s["arguments"]["gen_args_0"]["arg_0"]  # the messages, as JSON
            answers.append(client.submit(messages=json.loads(chat), temperature=0,
                                         max_tokens=MAX_GEN_TOKS, stop=["\n"]).result(120).text)
    check_scores(samples, results, answers)
