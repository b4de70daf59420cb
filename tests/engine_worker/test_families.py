"""Every supported family against ``transformers`` (float32), on a tiny random config of its own:
prompt logprobs and 16 greedy tokens through the paged KV cache, chunked prefill (a small prefill
token budget) and the prefix cache (a second request sharing the first's prompt blocks), from
the Hugging Face directory and from a GGUF written the way llama.cpp's converter writes that
architecture."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map
from safetensors import safe_open

from engine_worker.engine import Engine
from ipc.engine_config import EngineConfig
from tests.engine_worker.helpers import collect, greedy
from tests.engine_worker.scripted_helpers import assert_same, make_engine

TOLERANCE = 1e-3
TOP = 5
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.1,  # scores and logits large enough for the soft-caps to bite
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# name: (model_type, GGUF architecture, config overrides). Sliding windows shorter than the
# sequences, softmax scales other than head_dim ** -0.5 and soft-caps that change the result.
FAMILIES = {
    "llama3-rope": (
        "llama",
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
    ),
    "qwen2.5": ("qwen2", "qwen2", dict(tie_word_embeddings=False)),
    "gemma2": (
        "gemma2",
        "gemma2",
        dict(
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=1.5,
            sliding_window=8,
        ),
    ),
    "gemma3": (
        "gemma3_text",
        "gemma3",
        dict(
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        ),
    ),
    # Gemma 3 4B and larger: the multimodal checkpoint, served as its language model (no GGUF:
    # llama.cpp writes that language model as a gemma3 file, above)
    "gemma3-multimodal": (
        "gemma3",
        None,
        dict(
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    "phi3": ("phi3", "phi3", dict(tie_word_embeddings=False, sliding_window=12)),
    "phi4-mini": (
        "phi3",
        "phi3",
        dict(
            partial_rotary_factor=0.75,
            original_max_position_embeddings=8,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
            ),
            tie_word_embeddings=True,
        ),
    ),
    "smollm3": ("smollm3", "smollm3", dict(num_hidden_layers=4)),
    "granite": (
        "granite",
        "granite",
        dict(
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.5,
        ),
    ),
    "olmo2": ("olmo2", "olmo2", dict(tie_word_embeddings=False)),
}
TINY_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)
PERMUTED_QK = ("llama", "smollm3", "granite")  # llama.cpp's Llama-derived converters
GEMMA_NORMS_PLUS_ONE = ("gemma2", "gemma3")


def tiny_family(name: str, out_dir):
    """The family's tiny random model (norm weights randomized too), saved to ``out_dir``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, _, overrides = FAMILIES[name]
    if model_type == "gemma3":
        config = AutoConfig.for_model(
            model_type, text_config={**COMMON, **overrides}, vision_config=TINY_VISION
        )
    else:
        config = AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return model


def write_family_gguf(model_dir, out_dir, architecture: str) -> None:
    """A float32 GGUF of the checkpoint as llama.cpp's converter writes ``architecture``: the
    ``gguf`` package's tensor names, q/k rows permuted for its Llama-derived converters,
    Gemma's norm weights stored as w + 1; config.json beside it."""
    config = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out_dir.mkdir(parents=True)
    shutil.copy(model_dir / "config.json", out_dir / "config.json")
    arch = {v: k for k, v in MODEL_ARCH_NAMES.items()}[architecture]
    names = get_tensor_name_map(arch, config["num_hidden_layers"])
    writer = GGUFWriter(str(out_dir / "model.gguf"), architecture)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for hf in f.keys():
            w = f.get_tensor(hf).float().numpy()
            gguf_name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, hf
            if architecture in PERMUTED_QK and "self_attn.q_proj" in hf:
                w = _permute(w, heads)
            elif architecture in PERMUTED_QK and "self_attn.k_proj" in hf:
                w = _permute(w, kv_heads)
            if architecture in GEMMA_NORMS_PLUS_ONE and hf.endswith("norm.weight"):
                w = w + 1
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def float32_engine(model_dir) -> Engine:
    """An engine as transformers runs the model (float32, dense), prefilling 8 tokens a step."""
    return Engine(
        EngineConfig(
            model_path=str(model_dir),
            dtype="float32",
            weights="fp32",
            kv_cache_tokens=512,
            block_size=4,
            prefill_max_tokens=8,
        )
    )


def engine_outputs(model_dir, prompts: list[list[int]]) -> dict[str, dict]:
    """Each prompt through the engine one after the other (so the later ones find the first's
    blocks in the prefix cache: only the first asks for prompt logprobs, which computes every
    prompt token), prompts prefilled 8 tokens a step."""
    engine = float32_engine(model_dir)
    results, totals = {}, {}
    for i, prompt in enumerate(prompts):
        params = greedy(16, logprobs=TOP, prompt_logprobs=TOP if i == 0 else None, ignore_eos=True)
        engine.add(f"r{i}", prompt, params)
        results.update(collect(engine, totals=totals))
    assert totals["cached_tokens"] > 0, "the second prompt found no cached blocks"
    return results


def compare(reference, prompt: list[int], result: dict) -> float:
    """The largest logprob difference of one request's prompt and output rows against the
    reference's log-softmax over the whole sequence; its greedy tokens must be the argmaxes."""
    tokens = result["tokens"]
    assert len(tokens) == 16 and result["reason"] == "length"
    sequence = prompt + tokens
    with torch.inference_mode():
        logits = reference(torch.tensor([sequence])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    worst = 0.0
    rows = []  # (position whose logits, token, its logprob, top ids, top logprobs)
    for chunk in result.get("prompt_logprobs", []):
        own = np.frombuffer(chunk.logprobs, np.float32)
        ids = np.frombuffer(chunk.top_ids, np.int32).reshape(len(own), -1)
        tops = np.frombuffer(chunk.top_logprobs, np.float32).reshape(len(own), -1)
        for j, position in enumerate(range(chunk.start, chunk.start + len(own))):
            if position > 0:
                rows.append((position - 1, prompt[position], own[j], ids[j], tops[j]))
    assert len(rows) in (0, len(prompt) - 1)
    for j, entry in enumerate(result["logprobs"]):
        ids = np.frombuffer(entry.top_ids, np.int32)
        tops = np.frombuffer(entry.top_logprobs, np.float32)
        rows.append((len(prompt) - 1 + j, tokens[j], entry.logprob, ids, tops))
        assert tokens[j] == int(logits[len(prompt) - 1 + j].argmax()), f"token {j}"
    for position, token, own, ids, tops in rows:
        row = expected[position]
        worst = max(worst, abs(float(row[token]) - float(own)))
        worst = max(
            worst,
            float((row[torch.from_numpy(ids.astype(np.int64))] - torch.tensor(tops)).abs().max()),
        )
    return worst


@pytest.mark.parametrize(
    ("family", "source"),
    [(f, s) for f in FAMILIES for s in ("safetensors", "gguf") if s != "gguf" or FAMILIES[f][1]],
)
def test_family_matches_transformers(tmp_path, family, source):
    reference = tiny_family(family, tmp_path / "hf")
    model_dir = tmp_path / "hf"
    if source == "gguf":
        write_family_gguf(model_dir, tmp_path / "gguf", FAMILIES[family][1])
        model_dir = tmp_path / "gguf"
    generator = np.random.default_rng(1)
    first = [1, *generator.integers(3, 256, 21).tolist()]
    prompts = [first, first[:16] + generator.integers(3, 256, 5).tolist()]
    results = engine_outputs(model_dir, prompts)
    worst = max(compare(reference, p, results[f"r{i}"]) for i, p in enumerate(prompts))
    print(f"{family} from {source}: max abs logprob difference {worst:.2e}")
    assert worst < TOLERANCE


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_decodes_scripted_as_eager(tmp_path, family):
    """Every family takes the compiled decode step (DESIGN property 9: the eager layers' bits),
    on its int4 copies (batch 1) and on its dense ones (past ``quantized_max_tokens``)."""
    tiny_family(family, tmp_path)
    engine = make_engine(
        tmp_path, weights="int4", enable_prefix_cache=False, quantized_max_tokens=2
    )
    assert engine.runner.model.scripted_decode is not None
    generator = np.random.default_rng(2)
    prompts = [[1, *generator.integers(3, 256, n).tolist()] for n in (21, 5, 13)]
    assert_same(engine, prompts[:1], greedy(16, ignore_eos=True), "one")
    assert_same(engine, prompts, greedy(16, ignore_eos=True), "three")


def test_rows_reordered_on_blocks_equal_rows_reordered_after_dequantizing():
    """A partial rotary's q/k row order applied to a GGUF's blocks (whole rows of blocks move)
    is the order applied to the dequantized weights."""
    from engine_worker.layers import take_rows
    from engine_worker.linear import Int4Groups, Int8Blocks, dequantize

    generator = torch.Generator().manual_seed(0)
    rows = torch.randperm(16, generator=generator)
    int4 = Int4Groups(
        torch.randint(0, 16, (16, 64), generator=generator, dtype=torch.uint8),
        torch.rand(16, 2, generator=generator),
        torch.rand(16, 2, generator=generator),
    )
    int8 = Int8Blocks(
        torch.randint(-128, 128, (16, 64), generator=generator, dtype=torch.int8),
        torch.rand(16, 2, generator=generator),
    )
    for source in (int4, int8):
        assert torch.equal(dequantize(take_rows(source, rows)), dequantize(source)[rows])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_in_bf16_stays_near_float32(tmp_path, family):
    """The bf16 paths (fused RmsNorm with Gemma's folded weights, the embedding scale in bf16,
    int8 weights): 16 greedy tokens' logprobs within 0.1 of the float32 reference (measured
    up to 0.05), the tokens its argmaxes but for near-ties (at least 14 of 16)."""
    reference = tiny_family(family, tmp_path)
    engine = Engine(
        EngineConfig(
            model_path=str(tmp_path), dtype="bfloat16", weights="int8", kv_cache_tokens=512
        )
    )
    prompt = [1, *np.random.default_rng(1).integers(3, 256, 21).tolist()]
    engine.add("a", prompt, greedy(16, logprobs=0, ignore_eos=True))
    result = collect(engine)["a"]
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + result["tokens"]])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    rows = range(len(prompt) - 1, len(prompt) + 15)
    same = sum(int(logits[r].argmax()) == t for r, t in zip(rows, result["tokens"]))
    worst = max(
        abs(float(expected[r, t]) - e.logprob)
        for r, t, e in zip(rows, result["tokens"], result["logprobs"])
    )
    assert same >= 14 and worst < 0.1, (same, worst)
