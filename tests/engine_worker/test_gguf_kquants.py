"""A tiny model written as a K-quant GGUF from random blocks (any bytes are a valid block; CI has
no llama.cpp to quantize with): every served block type loads, the float32 forward equals the
``gguf`` package's own dequantization of the file, and with bf16 activations each layer runs on
our int4 kernel in its own width (no layer dense) close to those weights."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import save_file

from engine_worker import int4_decode
from engine_worker.engine import Engine
from engine_worker.weight_format import WeightFormat
from ipc.engine_config import EngineConfig
from tests.engine_worker.test_gguf import PROMPT, last_logits, write_encoded_gguf
from tests.engine_worker.test_gguf_blocks import random_blocks
from tests.tiny_model import make_tiny_model

T = GGMLQuantizationType
# Per tensor kind and layer: every served block type, groups of 16 and 32, q of 2 to 8 bits,
# and stacked layers of mixed types (q/k Q4_K with v Q6_K; gate Q3_K with up Q2_K).
KQUANT_TYPES = [
    {
        "token_embd": "Q6_K",
        "attn_q": "Q4_K",
        "attn_k": "Q4_K",
        "attn_v": "Q6_K",
        "attn_output": "Q5_K",
        "ffn_gate": "Q3_K",
        "ffn_up": "Q2_K",
        "ffn_down": "Q5_0",
    },
    {
        "attn_q": "Q5_1",
        "attn_k": "Q5_1",
        "attn_v": "Q5_1",
        "attn_output": "Q8_0",
        "ffn_gate": "Q4_1",
        "ffn_up": "Q4_1",
        "ffn_down": "Q4_0",
    },
]
# Random fp16 scales of about this size: weights of ~0.02 from each type's sub-block scales and q.
D_SIZE = {"Q4_0": 3e-3, "Q4_1": 3e-3, "Q5_0": 1.5e-3, "Q5_1": 1e-3, "Q8_0": 2e-4}
D_SIZE |= {"Q2_K": 5e-4, "Q3_K": 1.5e-4, "Q4_K": 3e-5, "Q5_K": 1.5e-5, "Q6_K": 6e-6}


def write_kquant_gguf(model_dir, out_dir) -> dict[str, torch.Tensor]:
    """A GGUF of the tiny model's config whose matrices are random blocks of KQUANT_TYPES (its
    vectors the model's, F32). Returns the gguf package's dequantization in HF row order."""

    def encode(w: np.ndarray, kind: str, layer: int, seed: int):
        type_name = KQUANT_TYPES[layer].get(kind) if w.ndim == 2 else None
        if type_name is None:
            return w, T.F32
        rows, cols = w.shape
        blocks = random_blocks(type_name, rows, cols, seed, wide=False, d_size=D_SIZE[type_name])
        return blocks, T[type_name]

    return write_encoded_gguf(model_dir, out_dir, encode)


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """(GGUF directory, directory of its weights as the gguf package dequantizes them)."""
    root = tmp_path_factory.mktemp("kquant-gguf")
    model = make_tiny_model(root / "model", hidden_size=256)  # K-quant rows: 256 weights
    reference = write_kquant_gguf(model, root / "gguf")
    dense = root / "dense"
    shutil.copytree(root / "gguf", dense, ignore=shutil.ignore_patterns("*.gguf"))
    save_file(reference, str(dense / "model.safetensors"))
    return root / "gguf", dense


def test_kquant_gguf_forward_equals_its_dequantized_weights(kquant_gguf):
    gguf_dir, dense_dir = kquant_gguf
    config = dict(kv_cache_tokens=256, block_size=4, dtype="float32")
    reference = last_logits(Engine(EngineConfig(model_path=str(dense_dir), **config)), PROMPT)
    served = last_logits(
        Engine(EngineConfig(model_path=str(gguf_dir), weights="fp32", **config)), PROMPT
    )
    assert (served - reference).abs().max() < 1e-6 * reference.abs().max()


@pytest.mark.skipif(not int4_decode.load_op(), reason="int4 decode op not built")
def test_kquant_gguf_runs_every_layer_on_our_kernel_in_its_own_width(kquant_gguf):
    gguf_dir, dense_dir = kquant_gguf
    config = dict(kv_cache_tokens=256, block_size=4, dtype="float32")
    reference = last_logits(Engine(EngineConfig(model_path=str(dense_dir), **config)), PROMPT)
    bf16 = dict(config, dtype="bfloat16")
    served = Engine(
        EngineConfig(model_path=str(gguf_dir), **bf16),
        weight_format=WeightFormat(
            "auto", torch.bfloat16, torch.device("cpu"), dense_copy=False, int4_kernel="own"
        ),
    )
    kinds = served.runner.model.weight_format.counts
    # layer 0: qkv Q4_K + Q6_K as 6-bit groups of 16, o Q5_K 5-bit, gate_up Q3_K + Q2_K
    # 4-bit groups of 16, down Q5_0 5-bit; layer 1: qkv Q5_1 5-bit, o Q8_0 two nibble planes,
    # gate_up Q4_1, down Q4_0; the tied Q6_K head 6-bit
    assert kinds == {"int6": 2, "int5": 3, "int4": 3, "int4x2": 1}, kinds
    logits = last_logits(served, PROMPT)
    error = ((logits - reference).norm() / reference.norm()).item()
    assert error < 0.03, error  # bf16 activations and scales


@pytest.mark.skipif(not int4_decode.load_op(), reason="int4 decode op not built")
def test_kquant_gguf_decodes_scripted_as_eager(kquant_gguf):
    """Layers of several widths and group sizes on our kernel: the scripted decode layers take
    them (each block carries its layout) and give eager's bits."""
    from tests.engine_worker.helpers import greedy
    from tests.engine_worker.scripted_helpers import assert_same, make_engine

    engine = make_engine(kquant_gguf[0], int4_kernel="own", enable_prefix_cache=False)
    assert engine.runner.model.scripted_decode is not None
    prompts = [[1, 5, 9, 300], [1, 17, 4000, 5, 6, 7, 8]]
    assert_same(engine, prompts, greedy(6, ignore_eos=True), "kquant")
