"""The mixture-of-experts families against ``transformers`` (float32) on tiny random configs of
their own: prompt logprobs and 16 greedy tokens through the paged KV cache, chunked prefill and
the prefix cache, and every row's router choices equal transformers', from the Hugging Face
directory, from a GGUF written as llama.cpp's converter writes it (config.json beside it) and
from a GGUF alone (config from its metadata)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_worker.engine import Engine
from engine_worker.model_config import SUPPORTED_MODEL_TYPES, ModelConfig
from engine_worker.moe import Router
from tests.engine_worker.helpers import collect, greedy
from tests.engine_worker.moe_files import GGUF_OVERRIDES, MOE_FAMILIES, tiny_moe, write_moe_gguf
from tests.engine_worker.test_families import TOLERANCE, TOP, compare, float32_engine


def prompts_of(seed: int = 1) -> list[list[int]]:
    generator = np.random.default_rng(seed)
    first = [1, *generator.integers(3, 256, 21).tolist()]
    return [first, first[:16] + generator.integers(3, 256, 5).tolist()]


def run_traced(engine: Engine, prompts: list[list[int]]) -> tuple[dict, dict[int, list]]:
    """Each prompt in turn (the first with prompt logprobs; the second finds its blocks in the
    prefix cache); the first's router choices per MoE layer, its rows in position order."""
    traces: dict[int, list] = {}
    for i, layer in enumerate(engine.runner.model.layers):
        if layer.moe is not None:
            layer.moe.trace = traces.setdefault(i, [])
    results, totals = {}, {}
    for i, prompt in enumerate(prompts):
        params = greedy(16, logprobs=TOP, prompt_logprobs=TOP if i == 0 else None, ignore_eos=True)
        engine.add(f"r{i}", prompt, params)
        results.update(collect(engine, totals=totals))
        for layer in engine.runner.model.layers:
            if layer.moe is not None:
                layer.moe.trace = None
    assert totals["cached_tokens"] > 0, "the second prompt found no cached blocks"
    return results, traces


def reference_choices(reference, sequence: list[int]) -> dict[int, torch.Tensor]:
    """Each MoE layer's top-k experts per position of ``sequence`` (sorted), by transformers."""
    found: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(reference.model.layers):
        if hasattr(layer.mlp, "experts"):
            hooks.append(
                layer.mlp.gate.register_forward_hook(
                    lambda module, args, out, i=i: found.__setitem__(i, out[2])
                )
            )
    with torch.inference_mode():
        reference(torch.tensor([sequence]))
    for hook in hooks:
        hook.remove()
    return {i: chosen.sort(dim=-1).values for i, chosen in found.items()}


def check_against(reference, model_dir) -> float:
    prompts = prompts_of()
    results, traces = run_traced(float32_engine(model_dir), prompts)
    worst = max(compare(reference, p, results[f"r{i}"]) for i, p in enumerate(prompts))
    sequence = prompts[0] + results["r0"]["tokens"]
    expected = reference_choices(reference, sequence)
    assert sorted(traces) == sorted(expected) and expected
    for layer, calls in traces.items():
        chosen = torch.cat(calls).sort(dim=-1).values
        assert len(chosen) == len(sequence) - 1  # every row but the last token's
        assert torch.equal(chosen, expected[layer][: len(chosen)]), f"layer {layer}"
    return worst


@pytest.mark.parametrize(
    ("family", "source"), [(f, s) for f in MOE_FAMILIES for s in ("hf", "gguf")]
)
def test_moe_family_matches_transformers(tmp_path, family, source):
    overrides = GGUF_OVERRIDES.get(family, {}) if source == "gguf" else {}
    reference = tiny_moe(family, tmp_path / "hf", **overrides)
    model_dir = tmp_path / "hf"
    if source == "gguf":
        write_moe_gguf(model_dir, tmp_path / "gguf" / "model.gguf", MOE_FAMILIES[family][1])
        model_dir = tmp_path / "gguf"
    worst = check_against(reference, model_dir)
    print(f"{family} from {source}: max abs logprob difference {worst:.2e}")
    assert worst < TOLERANCE


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_moe_gguf_alone_reads_its_experts_from_metadata(tmp_path, family, default_model_dir):
    """A GGUF with nothing beside it: the experts' sizes (and Mixtral's type, a "llama" file with
    experts) come from its metadata, which transformers' own reading leaves out."""
    from procs.local_model import resolve_local

    reference = tiny_moe(family, tmp_path / "hf", **GGUF_OVERRIDES.get(family, {}))
    write_moe_gguf(
        tmp_path / "hf",
        tmp_path / "alone" / "tiny.gguf",
        MOE_FAMILIES[family][1],
        metadata=default_model_dir,
    )
    served = resolve_local(tmp_path / "alone" / "tiny.gguf", tmp_path / "cache")
    config = ModelConfig.from_dir(served)
    assert config.model_type == MOE_FAMILIES[family][0]
    assert config.features.moe is not None
    assert (
        config.features.moe.expert_size
        == ModelConfig.from_dir(tmp_path / "hf").features.moe.expert_size
    )
    assert check_against(reference, served) < TOLERANCE


def test_moe_types_are_supported_and_their_options_checked(tmp_path):
    assert {"qwen2_moe", "qwen3_moe", "olmoe", "mixtral"} <= set(SUPPORTED_MODEL_TYPES)
    tiny_moe("olmoe", tmp_path / "olmoe")
    config = ModelConfig.from_dir(tmp_path / "olmoe")
    assert config.features.moe is not None and config.features.qk_norm_over_projection
    import json

    path = tmp_path / "olmoe" / "config.json"
    raw = json.loads(path.read_text())
    for key, value, message in (
        ("num_experts_per_tok", 9, "exceeds the number of experts"),
        ("num_experts", 0, "num_experts must be a positive integer"),
        ("clip_qkv", 8.0, "clip_qkv"),
    ):
        path.write_text(json.dumps({**raw, key: value}))
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dir(tmp_path / "olmoe")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_gives_a_row_its_own_bits_whatever_shares_the_call(dtype):
    """A 48 x 2048 router (the speed model's shape): every row's logits the same bits alone as
    among 2 to 64 or 158 rows, at any place in the call, at 1 or 2 threads; within float32's
    rounding of the float64 product (transformers' reference is float32's F.linear)."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 2048, generator=generator) * 0.02
    router = Router(weight)
    x = torch.randn(200, 2048, generator=generator).to(dtype)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            alone = torch.cat([router.logits(x[i : i + 1].clone()) for i in range(len(x))])
            for rows in [*range(1, 65), 158]:
                for start in (0, 5, 200 - rows):
                    logits = router.logits(x[start : start + rows])
                    assert torch.equal(logits, alone[start : start + rows]), (count, rows, start)
            if count == 1:
                one_thread = alone
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, alone)
    exact = x.double() @ weight.double().T
    assert (alone.double() - exact).abs().max() < 1e-5
    assert (alone - torch.nn.functional.linear(x.float(), weight)).abs().max() < 1e-5
