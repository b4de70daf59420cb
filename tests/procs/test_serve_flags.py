"""``splitserve serve``'s flags: vLLM's and llama-server's names translated to our knobs, flags
with no effect accepted with a note, the rest refused with one line and exit code 2; hostile
values refused the same way, before any process or run directory exists."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine_worker.sampler import RequestSampler, seed_unseeded_requests
from ipc.config import ClusterConfig
from ipc.messages import SamplingParams
from procs.children import REPO_ROOT
from procs.serve_command import main as serve_main
from procs.serve_flags import build_parser, translate


@pytest.fixture(autouse=True)
def _models_that_exist(tmp_path, monkeypatch):
    """The model paths these tests name, as empty files (the model is read at start-up only)."""
    monkeypatch.chdir(tmp_path)
    for name in ("x.gguf", "y.gguf", "m.gguf"):
        (tmp_path / name).touch()


def translated(*argv: str) -> tuple[str | None, dict, list[str]]:
    model, knobs, notes = translate(build_parser().parse_args(list(argv)))
    ClusterConfig.build("model", "run-dir", **knobs)  # the knobs are ones the config takes
    return model, knobs, notes


def refused(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    """The one line `splitserve serve ARGV` prints, checked to exit 2 with it alone."""
    assert serve_main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("splitserve serve: error: ")
    return err


def test_a_vllm_command_line_maps_to_our_knobs():
    model, knobs, notes = translated(
        "x.gguf", "--host", "127.0.0.1", "--port", "8001",
        "--served-model-name", "chat", "--max-model-len", "32K", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "1k", "--api-key", "K", "--no-enable-prefix-caching",
        "--data-parallel-size", "2", "--seed", "7", "--dtype", "half",
        "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice",
        "--gpu-memory-utilization", "0.5", "--generation-config", "vllm",
        "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1", "--quantization", "gguf",
        "--kv-cache-dtype", "auto", "--block-size", "32", "--device", "cpu",
    )  # fmt: skip
    assert model == "x.gguf"
    assert knobs == {
        "http_port": 8001, "http_host": "127.0.0.1", "http_api_key": "K",
        "served_model_name": "chat", "max_model_len": 32 * 1024, "max_batch_size": 8,
        "prefill_max_tokens": 1000, "enable_prefix_cache": False, "engines": 2, "seed": 7,
        "dtype": "float16", "tool_call_parser": "llama3_json", "kv_cache_memory_fraction": 0.5,
        "block_size": 32, "device": "cpu",
    }  # fmt: skip
    assert any(n.startswith("--enable-auto-tool-choice: no effect") for n in notes)
    assert any(n.startswith("--gpu-memory-utilization: on CUDA") for n in notes)
    assert any(n.startswith("--quantization gguf: no effect") for n in notes)


def test_defaults_serve_http_on_loopback_port_8000(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    model, knobs, notes = translated()
    assert model is None and notes == []  # the default model, as `splitserve launch`
    assert knobs == {"http_port": 8000, "http_host": "127.0.0.1", "http_api_key": "from-env"}


def test_a_llama_server_command_line_maps_to_our_knobs():
    model, knobs, notes = translated(
        "-m", "m.gguf", "-c", "4096", "--port", "8080", "-np", "4", "-t", "2", "-a", "local",
        "--jinja", "--metrics",
    )  # fmt: skip
    assert "--metrics: no effect; GET /metrics is always served" in notes
    assert model == "m.gguf"
    assert knobs["kv_cache_tokens"] == 4096 and knobs["max_model_len"] == 4096  # unified KV
    assert knobs["max_batch_size"] == 4 and knobs["engine_threads"] == 2
    assert knobs["served_model_name"] == "local" and knobs["http_port"] == 8080
    _, knobs, _ = translated("--ctx-size", "8192", "--max-model-len", "2048", "--parallel", "2")
    assert knobs["kv_cache_tokens"] == 8192 and knobs["max_model_len"] == 2048


def test_speculative_config_maps_to_the_ngram_knobs():
    _, knobs, _ = translated(
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}',
    )
    assert knobs["speculative"] == "ngram" and knobs["num_speculative_tokens"] == 5
    assert knobs["prompt_lookup_min"] == knobs["prompt_lookup_max"] == 3  # one stands for both


def test_enforce_eager_turns_the_scripted_decode_off():
    _, knobs, notes = translated("--enforce-eager", "--trust-remote-code", "--disable-log-requests")
    assert knobs["scripted_decode"] is False
    assert any(n.startswith("--disable-log-requests: no effect") for n in notes)
    assert "--trust-remote-code: no effect; splitserve never runs a checkpoint's code" in notes


def test_chat_template_inline_or_from_a_file(tmp_path):
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert translated("--chat-template", inline)[1]["chat_template"] == inline
    path = tmp_path / "t.jinja"
    path.write_text("[{{ messages[0].content }}]")
    assert translated("--chat-template", str(path))[1]["chat_template"] == path.read_text()
    assert translated("--chat-template-file", str(path))[1]["chat_template"] == path.read_text()


def test_reasoning_parser_sets_the_knob():
    _, knobs, _ = translated("--reasoning-parser", "deepseek_r1")
    assert knobs["reasoning_parser"] == "deepseek_r1"


def test_kv_events_config_passes_vllms_json_through():
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}
    _, knobs, _ = translated("--kv-events-config", json.dumps(config))
    assert json.loads(knobs["kv_events_config"]) == config


REFUSALS = [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2:", "--data-parallel-size"),
    (["-pp", "2"], "--pipeline-parallel-size 2:", "--data-parallel-size"),
    (["--quantization", "awq"], "--quantization awq:", "--weights int8|int4"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8:", "--dtype"),
    (["--reasoning-parser", "granite"], "--reasoning-parser granite:", "deepseek_r1"),
    (["--generation-config", "auto"], "--generation-config auto:", "vllm"),
    (["--generation-config", "/some/folder"], "--generation-config /some/folder:", "vllm"),
    (["--tool-call-parser", "pythonic"], "--tool-call-parser pythonic:", "hermes"),
    (["--served-model-name", "a", "b"], "--served-model-name:", "give one"),
    (["--speculative-config", '{"method": "eagle"}'], "method 'eagle'", "ngram"),
    (["--speculative-config", '{"model": "draft"}'], "method None", "ngram"),
    (["--speculative-config", '{"method": "ngram", "draft_tensor_parallel_size": 1}'],
     "'draft_tensor_parallel_size' is not supported", "num_speculative_tokens"),
    (["--swap-space", "4"], "unrecognized arguments: --swap-space", "docs/migrating.md"),
    (["x.gguf", "-m", "y.gguf"], "two models given", "give one"),
    (["Qwen/Qwen2.5-0.5B-Instruct"], "MODEL 'Qwen/Qwen2.5-0.5B-Instruct': no such file",
     "downloads nothing"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "names", "instead"), REFUSALS)
def test_what_we_cannot_do_is_refused_naming_the_flag(argv, names, instead, capsys):
    line = refused(*argv, capsys=capsys)
    assert names in line and instead in line


HOSTILE = [
    (["--port", "-1"], "--port"),
    (["--port", "65536"], "--port: http_port must be in 0..65535"),
    (["--port", "80a"], "--port"),
    (["--max-model-len", "1e9"], "--max-model-len"),
    (["--max-model-len", "9" * 13], "--max-model-len"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--data-parallel-size", "65"], "--data-parallel-size: engines must be at most 64"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--dtype", "int8"], "--dtype"),
    (["--host", "0.0.0.0"], "--host: an HTTP frontend on 0.0.0.0 (not loopback) requires"),
    (["--chat-template", "{% if %}"], "--chat-template: the chat template does not compile"),
    (["--chat-template", "/no/such/template.jinja"], "not a template, nor a readable file"),
    (["--chat-template", "a\x00b"], "--chat-template"),
    (["--speculative-config", "[1]"], "must be a JSON object"),
    (["--speculative-config", "{"], "is not JSON"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": true}'],
     "num_speculative_tokens must be an integer in 1..64"),
    (["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 10000}'],
     "prompt_lookup_max must be an integer in 1..64"),
    (["--speculative-config", '{"method": "ngram", "prompt_lookup_min": 5, '
      '"prompt_lookup_max": 2}'], "prompt_lookup_min (5) must not exceed"),
    (["--kv-events-config", "[]"], "--kv-events-config"),
    (["--kv-events-config", '{"publisher": "kafka"}'], "publisher must be one of"),
    (["--weights", "bogus"], "weights must be one of"),
    (["--seed", "-3"], "--seed"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "expected"), HOSTILE)
def test_hostile_values_get_one_line(argv, expected, capsys):
    assert expected in refused(*argv, capsys=capsys)


def test_a_binary_chat_template_file_is_refused(tmp_path, capsys):
    path = tmp_path / "t.jinja"
    path.write_bytes(b"\xff\xfe\x00{{")
    assert "not a template, nor a readable file" in refused(
        "--chat-template", str(path), capsys=capsys
    )


def test_the_installed_command_refuses_with_exit_code_2_and_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "procs.cli", "serve", "m.gguf", "--tensor-parallel-size", "4"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "splitserve serve: error: --tensor-parallel-size 4: splitserve does not split a model "
        "across devices; use --data-parallel-size N (whole replicas, docs/data-parallel.md)"
    ]


def test_seed_replays_unseeded_requests_seeds():
    params = SamplingParams(max_tokens=4, temperature=1.0)

    def seeds() -> list[int]:
        cpu = torch.device("cpu")
        return [RequestSampler(params, cpu).generator.initial_seed() for _ in range(3)]

    seed_unseeded_requests(11)
    first = seeds()
    seed_unseeded_requests(11)
    assert seeds() == first and len(set(first)) == 3
    seed_unseeded_requests(12)
    assert seeds() != first
