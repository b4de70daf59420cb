"""GGUF checkpoints served at their own precision: block parsing and the int4 kernel against the
``gguf`` package's own dequantize (bit for bit), name mapping and q/k row order through the whole
forward, and refusal of types we cannot serve."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from safetensors import safe_open
from safetensors.torch import save_file

from engine_worker.engine import Engine
from engine_worker.gguf_tensors import (
    UnsupportedGGUFType,
    _index_reader_class,
    _parse,
    _reader_class,
    read_gguf,
)
from engine_worker.linear import Int4Groups, Int4Linear, Int8Blocks, dequantize
from engine_worker.weight_format import WeightFormat
from ipc.engine_config import EngineConfig
from procs.model_store import gguf_file
from tests.engine_worker.helpers import compute_logits, give_blocks, manual_request
from tests.gguf_files import gguf_name, permute_rows

T = GGMLQuantizationType
to_gguf_name = gguf_name  # the Hugging Face name's GGUF name, as llama.cpp's converter writes it
# One tensor kind per served type: what the tiny file holds.
TINY_TYPES = {
    "token_embd": T.Q8_0,
    "attn_q": T.Q4_1,
    "attn_k": T.Q4_1,
    "attn_v": T.Q4_1,
    "attn_output": T.Q4_0,
    "ffn_gate": T.Q4_1,
    "ffn_up": T.Q4_0,
    "ffn_down": T.F16,
}


def write_gguf(model_dir, out_dir, types: dict) -> dict[str, torch.Tensor]:
    """A GGUF copy of a safetensors checkpoint (tensor kinds quantized as ``types`` says, the
    rest F32), beside the same config and tokenizer. Returns the ``gguf`` package's own
    dequantization of every tensor, in Hugging Face row order."""

    def encode(w: np.ndarray, kind: str, layer: int, seed: int):
        qtype = types.get(kind, T.F32) if w.ndim == 2 else T.F32
        if qtype == T.IQ4_NL:  # no quantizer in gguf; refused before its bytes are read
            return np.zeros((w.shape[0], w.shape[1] // 32 * 18), np.uint8), qtype
        if qtype in (T.F32, T.F16):
            return (w if qtype == T.F32 else w.astype(np.float16)), qtype
        return quants.quantize(w, qtype), qtype

    return write_encoded_gguf(model_dir, out_dir, encode)


def write_encoded_gguf(model_dir, out_dir, encode) -> dict[str, torch.Tensor]:
    """A GGUF of a safetensors checkpoint, beside its config and tokenizer: each tensor, in
    llama.cpp's q/k row order, written as ``encode(w, kind, layer, index)`` returns it (its data
    and GGUF type; ``index`` counts the tensors in name order). Returns the ``gguf`` package's
    own dequantization of every tensor, in Hugging Face row order."""
    config = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out_dir.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out_dir / f.name)
    writer = GGUFWriter(str(out_dir / "model.gguf"), "llama")
    reference = {}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for index, hf in enumerate(sorted(f.keys())):
            w = f.get_tensor(hf).float().numpy()
            name = to_gguf_name(hf)
            layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
            kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
            heads_of = heads if kind == "attn_q" else kv_heads if kind == "attn_k" else 0
            if heads_of:
                w = permute_rows(w, heads_of)
            data, qtype = encode(w, kind, layer, index)
            writer.add_tensor(name, data, raw_dtype=qtype)
            if qtype == T.IQ4_NL:  # nothing to compare: the file is refused
                continue
            exact = quants.dequantize(data, qtype) if qtype not in (T.F32, T.F16) else data
            exact = np.asarray(exact, dtype=np.float32).reshape(w.shape)
            reference[hf] = torch.from_numpy(
                np.ascontiguousarray(permute_back(exact, heads_of) if heads_of else exact)
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def permute_back(w: np.ndarray, heads: int) -> np.ndarray:
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def last_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    request = manual_request(engine, prompt)
    give_blocks(engine, request, request.num_tokens)
    logits, _ = compute_logits(engine, [request], [request.num_tokens])
    return logits[0]


PROMPT = [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 504, 3458, 282, 4649, 314]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    """(GGUF directory, directory of the same weights as the gguf package dequantizes them)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    reference = write_gguf(tiny_model_dir, root / "gguf", TINY_TYPES)
    dense = root / "dense"
    shutil.copytree(root / "gguf", dense, ignore=shutil.ignore_patterns("*.gguf"))
    save_file(reference, str(dense / "model.safetensors"))
    return root / "gguf", dense


def test_blocks_parse_exactly_and_int4_kernel_reproduces_gguf_dequantize(tiny_gguf):
    reader = GGUFReader(str(tiny_gguf[0] / "model.gguf"))
    seen = set()
    for t in reader.tensors:
        expected = torch.from_numpy(
            np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
                t.data.shape[0], -1
            )
        )
        source = _parse(t.tensor_type.name, np.asarray(t.data), [int(d) for d in t.shape])
        assert torch.equal(dequantize(source).reshape(expected.shape), expected), t.name
        seen.add(t.tensor_type.name)
        if isinstance(source, Int4Groups):
            assert source.exact_in(torch.float32)
            layer = Int4Linear(source, torch.float32)
            k = source.q.shape[1]
            assert torch.equal(layer.apply(torch.eye(k)).t(), expected), t.name
    assert seen == {"Q4_0", "Q4_1", "Q8_0", "F16", "F32"}


def test_gguf_checkpoint_matches_its_dequantized_weights(tiny_gguf):
    gguf_dir, dense_dir = tiny_gguf
    config = dict(kv_cache_tokens=256, block_size=4, dtype="float32")
    reference = last_logits(Engine(EngineConfig(model_path=str(dense_dir), **config)), PROMPT)
    # fp32 dense from the GGUF: the very same weights (mapping, row order, every block type);
    # only the GEMMs' rounding may differ (their blocking depends on the buffers' alignment).
    served = last_logits(
        Engine(EngineConfig(model_path=str(gguf_dir), weights="fp32", **config)), PROMPT
    )
    assert (served - reference).abs().max() < 1e-6 * reference.abs().max()
    # --weights int4, no dense copy: Q4_x layers run on the int4 kernel with the file's exact
    # weights (float32 holds their scales), the file's dense layers are quantized to int4, and
    # Q8_0 (the tied head) runs as two planes of nibbles on the same kernel, exact too.
    quantized = Engine(
        EngineConfig(model_path=str(gguf_dir), weights="int4", **config),
        weight_format=WeightFormat("int4", torch.float32, torch.device("cpu"), dense_copy=False),
    )
    kinds = quantized.runner.model.weight_format.counts
    assert kinds == {"int4": 8, "int4x2": 1}, kinds  # 2 layers x (qkv, o, gate_up, down), head
    exact_weights = Engine(
        EngineConfig(model_path=str(gguf_dir), **config),
        weight_format=WeightFormat(
            "int4", torch.float32, torch.device("cpu"), reference_for=torch.float32
        ),
    )
    expected = last_logits(exact_weights, PROMPT)
    diff = (last_logits(quantized, PROMPT) - expected).abs().max().item()
    assert diff < 1e-4 * expected.abs().max().item(), diff


def test_unsupported_gguf_type_is_refused_by_name(tiny_model_dir, tmp_path):
    write_gguf(tiny_model_dir, tmp_path / "iq4", {"ffn_up": T.IQ4_NL, "attn_q": T.Q5_0})
    message = (
        r"tensor 'blk\.0\.ffn_up\.weight' has GGUF type IQ4_NL, which splitserve cannot "
        r"serve \(2 such tensors; supported types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, "
        r"Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K\)"
    )
    with pytest.raises(UnsupportedGGUFType, match=message) as refused:
        read_gguf(tmp_path / "iq4" / "model.gguf", 4, 2)
    assert "\n" not in str(refused.value)
    with pytest.raises(UnsupportedGGUFType, match="IQ4_NL"):
        Engine(EngineConfig(model_path=str(tmp_path / "iq4"), kv_cache_tokens=64))


def test_default_model_q4_1_blocks_map_exactly_in_fp32_not_bf16(default_model_dir):
    """The shipped file: every Q4_1 block's m + 8d is a float32, so fp32 activations compute
    the file's own weights; bf16 cannot hold the fp16 scales (most blocks change), two bf16
    parts (int4-exact) hold every one."""
    path = gguf_file(default_model_dir)
    assert path is not None, "the default model is served from its GGUF"
    reader = _reader_class()(str(path))
    types = {t.tensor_type.name for t in reader.tensors}
    assert types == {"Q4_1", "Q8_0", "F32"}, types
    exact_bf16 = total = 0
    for t in reader.tensors:
        if t.tensor_type.name != "Q4_1":
            continue
        source = _parse("Q4_1", np.asarray(t.data), [int(d) for d in t.shape])
        assert source.exact_in(torch.float32), t.name
        assert source.exact_in(torch.bfloat16, parts=2), t.name
        rounded = source.rounded(torch.bfloat16)
        exact_bf16 += int(((rounded.scale == source.scale) & (rounded.zero == source.zero)).sum())
        total += source.scale.numel()
        if t.name.startswith("blk.0."):  # the kernel itself on a 64-row slice of each kind
            rows = Int4Groups(source.q[:64], source.scale[:64], source.zero[:64])
            expected = quants.dequantize(t.data[:64], t.tensor_type).reshape(64, -1)
            k = rows.q.shape[1]
            got = Int4Linear(rows, torch.float32).apply(torch.eye(k)).t()
            assert torch.equal(got, torch.from_numpy(np.array(expected, np.float32))), t.name
    assert exact_bf16 < total / 10, (exact_bf16, total)
    # Under Hugging Face names, q/k rows in HF order.
    tensors = read_gguf(path, 9, 3)
    assert isinstance(tensors["model.embed_tokens.weight"], Int8Blocks)
    assert isinstance(tensors["model.layers.29.mlp.down_proj.weight"], Int4Groups)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].q.shape == (192, 576)
    assert len(tensors) == 2 + 30 * 9


def test_index_reader_steps_over_arrays_and_reads_the_same_tensors(default_model_dir):
    """read_gguf's reader: the same tensors (names, types, shapes, bytes) and scalar metadata as
    the gguf package's own reader; array values (the vocabulary) stepped over as raw bytes."""
    path = str(gguf_file(default_model_dir))
    full, index = _reader_class()(path), _index_reader_class()(path)
    assert [t.name for t in index.tensors] == [t.name for t in full.tensors]
    for a, b in zip(full.tensors, index.tensors):
        assert (a.tensor_type, list(a.shape), a.data_offset) == (
            b.tensor_type,
            list(b.shape),
            b.data_offset,
        )
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))
    assert list(index.fields) == list(full.fields)
    arrays = 0
    for key, field in full.fields.items():
        if field.types and field.types[0].name == "ARRAY":
            arrays += 1
            # after the key and the value type: the item type, the count and the items
            raw = index.fields[key].parts[3]
            start = field.parts[3].ctypes.data - full.data.ctypes.data
            assert raw.nbytes == sum(p.nbytes for p in field.parts[3:]), key
            assert bytes(raw) == bytes(full.data[start : start + raw.nbytes]), key
        else:
            assert field.contents() == index.fields[key].contents(), key
    assert arrays >= 2  # the tokens and merges, at least


def test_engine_on_a_gguf_imports_no_tokenizer_code(tiny_gguf):
    import subprocess
    import sys

    code = (
        "import sys; from engine_worker.engine import Engine; "
        "from ipc.engine_config import EngineConfig; "
        f"Engine(EngineConfig(model_path={str(tiny_gguf[0])!r}, kv_cache_tokens=256)); "
        "bad = [m for m in sys.modules if m.startswith(('tokenizers', 'transformers'))]; "
        "print('LOADED', bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "LOADED []" in out.stdout, out.stdout + out.stderr


def test_layers_built_on_threads_hold_the_same_bytes(tiny_gguf):
    """``load_workers`` threads build the layers and the head (``LlamaFamilyModel.load`` passes
    the engine's thread count): every linear's tensors are the bytes one thread builds."""
    from engine_worker.linear import BatchSizeSwitch
    from engine_worker.model import LlamaFamilyModel, load_tensors
    from engine_worker.model_config import ModelConfig

    config = ModelConfig.from_dir(tiny_gguf[0])
    cpu, bf16 = torch.device("cpu"), torch.bfloat16

    def tensors_of(workers: int) -> list[torch.Tensor]:
        fmt = WeightFormat("auto", bf16, cpu, int4_kernel="own")
        tensors = load_tensors(tiny_gguf[0], config)
        model = LlamaFamilyModel(config, tensors, cpu, bf16, 64, fmt, load_workers=workers)
        linears = [
            getattr(x, n) for x in model.layers for n in ("qkv", "o_proj", "gate_up", "down")
        ]
        out = []
        for linear in [*linears, model.lm_head]:
            parts = (
                [linear.quantized, linear.dense]
                if isinstance(linear, BatchSizeSwitch)
                else [linear]
            )
            for part in parts:
                out += [
                    getattr(part, a, None) for a in ("packed", "weight", "scale_zero", "q", "scale")
                ]
        return [t for t in out if isinstance(t, torch.Tensor)]

    one, two = tensors_of(1), tensors_of(3)
    assert len(one) == len(two) > 4 * config.num_layers
    for a, b in zip(one, two):
        if a.is_mkldnn:  # oneDNN's packed copy: compared as the values it holds
            a, b = a.to_dense(), b.to_dense()
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        )
