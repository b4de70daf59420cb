"""The engine workload for real on the tiny model (every part of it but llama.cpp's, which needs
a llama-bench binary), and the weight bytes its bandwidth bound counts. Timings are not a test."""

from __future__ import annotations

import re

import pytest
import torch

from scripts.bench import engine
from scripts.bench.engine_formats import weight_bytes_per_token


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The workload sets this process's torch threads (--threads): later tests keep theirs."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_every_engine_workload_runs_and_prints_its_figures(tiny_model_dir, capsys):
    engine.main(
        ["core", "sampling", "prefix", "mixed", "kernels", "formats", "bandwidth", "logprobs"]
        + ["--model", str(tiny_model_dir), "--threads", "1", "--repeats", "1"]
        + ["--prefill-tokens", "24", "--decode-batch", "1,2", "--decode-tokens", "3"]
        + ["--decode-prompt-tokens", "16", "--kv-cache-tokens", "4096"]
        + ["--num-requests", "3", "--shared-prefix-tokens", "64", "--new-tokens", "2"]
        + ["--long-prompts", "1", "--long-prompt-tokens", "96", "--chunk-tokens", "32"]
        + ["--formats", "fp32,int8", "--kernel-rows", "1,4", "--kernel-repeats", "1"]
    )
    out = capsys.readouterr().out
    rates = re.findall(
        r"^(prefill 24 tokens|decode batch [12]) +([\d.]+) +([\d.]+) +([\d.]+)x", out, re.M
    )
    assert len(rates) == 3 and all(float(ours) > 0 and float(hf) > 0 for _, ours, hf, _ in rates)
    for line in (
        "temperature 0.7",
        "repetition 1.2",
        "prefix cache on : prompt tokens computed",
        "chunked prefill   32 tokens: ITL p50",
        "int8: faster than bf16 at rows",
        "\nformats (threads=1",
        "MB of weights per token",
        "1 request asks top 20",
        "prompt_logprobs 20",
    ):
        assert line in out, line
    computed = [int(n) for n in re.findall(r"prompt tokens computed +(\d+)", out)]
    assert computed[1] < computed[0]  # the shared prefix is computed once with the cache on


def test_peer_needs_llama_bench(tiny_model_dir):
    with pytest.raises(SystemExit, match="--llama-bench PATH"):
        engine.main(["peer", "--model", str(tiny_model_dir)])


def test_weight_bytes_count_a_tied_lm_head_once_and_quantized_layers_as_stored(tiny_model_dir):
    from engine_worker.model import LlamaFamilyModel
    from engine_worker.weight_format import WeightFormat

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    model = LlamaFamilyModel.load(tiny_model_dir, cpu, bf16, 64, WeightFormat("bf16", bf16, cpu))
    assert model.lm_head.weight is model.embed
    # a norm reads its weight twice over (engine_worker/rms_norm.py); a dense layer's matrix is
    # counted from its shape (packed for oneDNN, it keeps no plain copy)
    expected = sum(
        2 * (t.numel() if isinstance(t, torch.Tensor) else t.out_features * t.in_features)
        for layer in model.layers
        for t in (
            layer.input_norm.weight,
            layer.input_norm.weight,
            layer.qkv,
            layer.o_proj,
            layer.post_attention_norm.weight,
            layer.post_attention_norm.weight,
            layer.gate_up,
            layer.down,
        )
    ) + 2 * (2 * model.norm.weight.numel() + model.embed.numel())
    assert weight_bytes_per_token(model) == expected
    # int8 layers read one byte a weight (plus scales), though each keeps a dense copy too
    int8 = LlamaFamilyModel.load(tiny_model_dir, cpu, bf16, 64, WeightFormat("int8", bf16, cpu))
    assert expected / 2 < weight_bytes_per_token(int8) < expected * 0.6
