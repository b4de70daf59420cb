"""lm-evaluation-harness against a real cluster, offline: `lm-eval run --model local-completions`
(which finds the server's /tokenizer_info and /tokenize and uses them instead of downloading a
tokenizer) and `--model local-chat-completions --apply_chat_template`, on a generate_until task
defined here over a local JSONL (capitals.yaml). Every answer the harness records must be the
answer the SDK gets for the same request, and its score must be the score of those answers.

And a multiple-choice loglikelihood task (facts_mc.yaml) through `local-completions` and through
the harness's own `hf` backend on the same model directory: the same accuracy and the same
per-choice loglikelihoods up to float noise."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ipc.client import Client
from procs.children import REPO_ROOT
from procs.launch_cluster import launch_cluster
from procs.model_store import gguf_file
from tests.reference_model import load_reference_model

pytestmark = pytest.mark.slow  # harness runs on the real model: 20-60 s each here
TASK = "splitserve_capitals"
DOCS = [json.loads(line) for line in (Path(__file__).parent / "capitals.jsonl").open()]
MAX_GEN_TOKS = 12  # capitals.yaml's generation_kwargs
MC_TASK = "splitserve_facts_mc"
MC_DOCS = [json.loads(line) for line in (Path(__file__).parent / "facts_mc.jsonl").open()]
# Per-choice loglikelihoods (nats, summed over the choice's tokens) of our engine and of
# transformers differ only by float rounding (another attention kernel and summation order);
# measured here up to ~6e-5.
LOGLIKELIHOOD_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    # fp32 on the CPU pinned, the arithmetic the harness's hf run below does: dtype "auto" is
    # bf16/fp16 on CUDA, and bf16 rounding would not be float noise next to fp32 (nor would
    # quantized weights: dense fp32 weights pinned too).
    with launch_cluster(
        str(default_model_dir),
        tokenizer_workers=1,
        max_model_len=2048,
        http_port=0,
        device="cpu",
        dtype="float32",
        weights="fp32",
    ) as c:
        yield c


def hf_checkpoint(model_dir: Path, out: Path) -> Path:
    """A safetensors checkpoint of the model for the harness's hf backend. The default model
    ships as a GGUF beside its HF metadata; transformers dequantizes it to float32 (as the
    cluster's fp32 weights are), and the copy keeps the directory's own tokenizer files (the
    harness cannot use a tokenizer read from the GGUF)."""
    if gguf_file(model_dir) is None:
        return model_dir
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    # A model read from a GGUF refuses to save itself: its float32 weights go into a plain one.
    plain = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(model_dir), dtype=torch.float32
    )
    plain.load_state_dict(load_reference_model(model_dir).state_dict())
    plain.save_pretrained(out)
    for name in model_dir.iterdir():
        if name.suffix != ".gguf" and not (out / name.name).exists():
            shutil.copy(name, out / name.name)
    return out


def api_model_args(cluster, endpoint: str) -> str:
    return (
        f"model={cluster.config.model_name},base_url={cluster.http_url}/v1/{endpoint},"
        "num_concurrent=1,max_retries=1"
    )


def run_harness(
    task: str,
    model: str,
    model_args: str,
    tmp_path: Path,
    *extra: str,
    env: dict[str, str] | None = None,
) -> tuple[list[dict], dict, str]:
    """One offline harness run; returns its samples (in doc order), results and log."""
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        **(env or {}),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "run",
            "--model",
            model,
            "--model_args",
            model_args,
            "--tasks",
            task,
            "--include_path",
            "tests/evals",
            "--output_path",
            str(tmp_path),
            "--log_samples",
            *extra,
        ],
        cwd=str(REPO_ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (samples_file,) = tmp_path.rglob(f"samples_{task}_*.jsonl")
    (results_file,) = tmp_path.rglob("results_*.json")
    samples = sorted((json.loads(line) for line in samples_file.open()), key=lambda s: s["doc_id"])
    results = json.loads(results_file.read_text())["results"][task]
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
    samples, results, log = run_harness(
        TASK, "local-completions", api_model_args(cluster, "completions"), tmp_path
    )
    assert "Auto-detected remote tokenizer support" in log  # our /tokenizer_info, /tokenize
    assert len(samples) == len(DOCS)
    with Client(cluster.client_addr) as client:
        eos = client.tokenizer_info()["eos_token"]
        # The harness stops at its `until` and the tokenizer's eos string, as it told us.
        answers = [
            client.submit(
                s["arguments"]["gen_args_0"]["arg_0"],
                temperature=0,
                max_tokens=MAX_GEN_TOKS,
                stop=["\n", eos],
            )
            .result(120)
            .text
            for s in samples
        ]
    check_scores(samples, results, answers)


def test_generate_until_through_local_chat_completions(cluster, tmp_path):
    samples, results, _ = run_harness(
        TASK,
        "local-chat-completions",
        api_model_args(cluster, "chat/completions"),
        tmp_path,
        "--apply_chat_template",
    )
    assert len(samples) == len(DOCS)
    with Client(cluster.client_addr) as client:
        answers = []
        for s in samples:
            (chat,) = s["arguments"]["gen_args_0"]["arg_0"]  # the messages, as JSON
            answers.append(
                client.submit(
                    messages=json.loads(chat), temperature=0, max_tokens=MAX_GEN_TOKS, stop=["\n"]
                )
                .result(120)
                .text
            )
    check_scores(samples, results, answers)


def choice_scores(samples: list[dict]) -> list[list[tuple[float, bool]]]:
    """Each doc's (loglikelihood, is_greedy) per choice, as the harness logged them."""
    return [[(float(ll), greedy == "True") for ((ll, greedy),) in s["resps"]] for s in samples]


def greedy_flags(scores: list[list[tuple[float, bool]]]) -> list[list[bool]]:
    return [[greedy for _, greedy in doc] for doc in scores]


def test_multiple_choice_loglikelihoods_equal_the_harness_hf_backend(
    cluster, default_model_dir, tmp_path
):
    ours, our_results, log = run_harness(
        MC_TASK,
        "local-completions",
        api_model_args(cluster, "completions"),
        tmp_path / "ours",
        "--batch_size",
        "16",
    )
    assert "Auto-detected remote tokenizer support" in log  # contexts tokenized by our server
    # One torch thread: the idle cluster's processes and other work share these cores, and an
    # oversubscribed torch thread pool runs several times slower than one thread.
    ref, ref_results, _ = run_harness(
        MC_TASK,
        "hf",
        f"pretrained={hf_checkpoint(Path(default_model_dir), tmp_path / 'ckpt')},dtype=float32",
        tmp_path / "hf",
        "--device",
        "cpu",
        "--batch_size",
        "16",
        env={"OMP_NUM_THREADS": "1"},
    )
    assert len(ours) == len(ref) == len(MC_DOCS)
    assert [s["arguments"] for s in ours] == [s["arguments"] for s in ref]
    our_scores, ref_scores = choice_scores(ours), choice_scores(ref)
    gaps = [
        abs(a - b)
        for doc_a, doc_b in zip(our_scores, ref_scores)
        for (a, _), (b, _) in zip(doc_a, doc_b)
    ]
    assert len(gaps) == 4 * len(MC_DOCS) and max(gaps) < LOGLIKELIHOOD_TOLERANCE, max(gaps)
    assert greedy_flags(our_scores) == greedy_flags(ref_scores)
    for metric in ("acc", "acc_norm"):
        assert [s[metric] for s in ours] == [s[metric] for s in ref]
        assert our_results[f"{metric},none"] == ref_results[f"{metric},none"]
    # acc is the argmax of the loglikelihoods our server returned.
    right = [
        max(range(4), key=lambda i: doc[i][0]) == d["answer"] for doc, d in zip(our_scores, MC_DOCS)
    ]
    assert our_results["acc,none"] == pytest.approx(sum(right) / len(MC_DOCS))
    print(
        f"\nlm-eval acc {our_results['acc,none']:.3f} acc_norm {our_results['acc_norm,none']:.3f}"
        f" over {len(MC_DOCS)} docs on both backends; largest loglikelihood gap {max(gaps):.2e}"
    )


def test_the_harness_reads_a_greedy_continuation_as_greedy(cluster):
    """lm-eval's is_greedy compares each continuation token's logprob with the largest of its
    top_logprobs by float equality: the sampled token's logprob and its top-k entry must be the
    same number. The harness's own parser, on our answer to its request."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    with Client(cluster.client_addr) as client:
        context = client.tokenize("The capital of France is").token_ids
        greedy = (
            client.submit(prompt_token_ids=context, temperature=0, max_tokens=3, ignore_eos=True)
            .result(120)
            .token_ids
        )
    changed = greedy[:2] + [greedy[2] + 1]  # its last token is not the model's choice
    body = {
        "model": cluster.config.model_name,
        "prompt": [context + greedy, context + changed],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    done = httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=120)
    assert done.status_code == 200, done.text
    (greedy_ll, greedy_is_greedy), (changed_ll, changed_is_greedy) = (
        LocalCompletionsAPI.parse_logprobs(done.json(), ctxlens=[len(context)] * 2)
    )
    assert greedy_is_greedy and not changed_is_greedy
    assert changed_ll < greedy_ll < 0
