"""``--model`` on what users have (procs.local_model): a bare GGUF file, a directory holding one
(its own files win), the parts of a split GGUF, and one-line refusals of everything else. Real
files throughout: GGUFs written from the tiny random model with the default model's tokenizer
in their metadata, read back by transformers and served by our engine."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from tokenizers import Tokenizer

from engine_worker.engine import Engine
from engine_worker.gguf_tensors import GGUFFileError, read_gguf
from engine_worker.model_config import ModelConfig
from ipc.engine_config import EngineConfig
from procs import model_store
from procs.local_model import causal_lm_architectures, check_model
from procs.model_store import ModelError, gguf_file, resolve_model
from tests.engine_worker.helpers import compute_logits, give_blocks, manual_request
from tests.gguf_files import write_tiny_gguf
from tests.tiny_model import make_tiny_model

PROMPT = [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 504, 3458, 282, 4649, 314]
CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Directories made for GGUF files go to a cache of the test's own."""
    monkeypatch.setattr(model_store, "local_models_dir", lambda: tmp_path / "local")
    return tmp_path / "local"


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, default_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "tiny-chat.gguf"
    write_tiny_gguf(tiny_model_dir, out, default_model_dir=default_model_dir)
    return out


def last_logits(model_dir: Path) -> torch.Tensor:
    config = EngineConfig(
        model_path=str(model_dir), dtype="float32", weights="fp32", kv_cache_tokens=256
    )
    engine = Engine(config)
    request = manual_request(engine, PROMPT)
    give_blocks(engine, request, request.num_tokens)
    logits, _ = compute_logits(engine, [request], [request.num_tokens])
    return logits[0]


@pytest.mark.parametrize("architecture", list(CLASSES))
def test_a_bare_gguf_is_served_from_its_metadata_alone(
    architecture, default_model_dir, tmp_path, tiny_model_dir
):
    """Config (model_type, architectures, every shape), tokenizer, chat template and end ids
    from the file's metadata; the same logits as the checkpoint the file was written from."""
    hf = (
        tiny_model_dir
        if architecture == "llama"
        else make_tiny_model(tmp_path / "hf", architecture=architecture)
    )
    gguf = tmp_path / "files" / f"tiny-{architecture}.Q0.gguf"
    write_tiny_gguf(hf, gguf, default_model_dir=default_model_dir, eot_token_id=0)
    # What lies beside a file given as --model is not read (transformers once took this
    # tokenizer_config.json, which has no chat template, over the file's own).
    (gguf.parent / "tokenizer_config.json").write_text('{"tokenizer_class": "Other"}')
    model_dir = resolve_model(gguf)
    assert model_dir.name == f"tiny-{architecture}.Q0"  # the served name: the file's stem
    assert model_dir.is_relative_to(model_store.local_models_dir())
    link = model_dir / gguf.name
    assert link.is_symlink() and link.resolve() == gguf.resolve()  # never copied
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == architecture
    assert config["architectures"] == [CLASSES[architecture]]
    assert (model_dir / "chat_template.jinja").read_text() == (
        default_model_dir / "chat_template.jinja"
    ).read_text()
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>"
    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    assert ours == Tokenizer.from_file(str(default_model_dir / "tokenizer.json")).encode(text).ids
    # End of sequence (2) and, from llama.cpp's tokenizer.ggml.eot_token_id, end of turn (0).
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    assert ModelConfig.from_dir(model_dir).eos_token_ids == {0, 2}  # the engine stops on both
    check_model(model_dir)
    assert torch.equal(last_logits(model_dir), last_logits(hf))


def test_the_metadata_is_read_once_and_again_when_the_file_changes(
    tiny_gguf, tmp_path, monkeypatch
):
    opened = []  # every whole-metadata parse (the gguf package's reader) of the file
    init = GGUFReader.__init__

    def counted(reader, path, *args, **kwargs):
        opened.append(Path(path).name)
        init(reader, path, *args, **kwargs)

    monkeypatch.setattr(GGUFReader, "__init__", counted)
    gguf = tmp_path / "copy.gguf"
    shutil.copy(tiny_gguf, gguf)
    first = resolve_model(gguf)
    # Once in all: the tokenizer and the config share one parse, the tensor names and end ids
    # come from transformers' header reader (each took seconds on a 49k-token vocabulary).
    assert opened == ["copy.gguf"]
    written = (first / "config.json").stat().st_mtime_ns
    assert resolve_model(str(gguf)) == first
    assert (first / "config.json").stat().st_mtime_ns == written  # not written again
    os.utime(gguf, ns=(written, written + 10**9))  # the file changed (its mtime says so)
    second = resolve_model(gguf)
    assert second != first and second.name == first.name == "copy"


def test_a_directory_holding_a_gguf_is_served_and_its_own_files_win(tiny_gguf, tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    os.symlink(tiny_gguf, folder / tiny_gguf.name)
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (folder / "chat_template.jinja").write_text(template)
    model_dir = resolve_model(folder)
    assert model_dir.name == "my-model"  # a directory is served under its name
    assert (model_dir / "chat_template.jinja").read_text() == template
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "llama"
    # A config of its own wins too (here: a shorter context), the tokenizer still from the file.
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 512
    (folder / "config.json").write_text(json.dumps(config))
    again = resolve_model(folder)
    assert json.loads((again / "config.json").read_text())["max_position_embeddings"] == 512
    assert (again / "tokenizer.json").is_file()
    # A directory with both config.json and tokenizer.json is a Hugging Face one, used as is.
    shutil.copy(again / "tokenizer.json", folder / "tokenizer.json")
    assert resolve_model(folder) == folder


def test_a_split_gguf_is_read_as_one(
    tiny_model_dir, default_model_dir, tiny_gguf, single_dir, tmp_path
):
    parts = write_tiny_gguf(
        tiny_model_dir,
        tmp_path / "split" / "tiny-chat.gguf",
        default_model_dir=default_model_dir,
        split_max_tensors=7,
    )
    assert [p.name for p in parts] == [f"tiny-chat-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    by_file, by_dir = resolve_model(parts[0]), resolve_model(parts[0].parent)
    assert by_file.name == "tiny-chat" and by_dir.name == "split"
    for model_dir in (by_file, by_dir):
        assert sorted(p.name for p in model_dir.glob("*.gguf")) == [p.name for p in parts]
        assert gguf_file(model_dir).name == parts[0].name
    whole = read_gguf(tiny_gguf, 4, 2)
    split = read_gguf(parts, 4, 2)
    assert split.keys() == whole.keys()
    assert all(torch.equal(split[name], whole[name]) for name in whole)
    assert torch.equal(last_logits(by_file), last_logits(single_dir))


@pytest.fixture(scope="module")
def single_dir(tiny_gguf, tiny_model_dir):
    """The single-file GGUF served as a Hugging Face directory (the tiny model's own files)."""
    folder = tiny_gguf.parent / "single"
    folder.mkdir(exist_ok=True)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    if not (folder / tiny_gguf.name).exists():
        os.symlink(tiny_gguf, folder / tiny_gguf.name)
    return folder


def test_the_parts_of_a_split_gguf_must_all_be_there_in_their_places(
    tiny_model_dir, default_model_dir, tmp_path
):
    parts = write_tiny_gguf(
        tiny_model_dir,
        tmp_path / "split" / "m.gguf",
        default_model_dir=default_model_dir,
        split_max_tensors=7,
    )
    with pytest.raises(ModelError, match=r"part 2 of 3 .* give its first part \(m-00001-of"):
        resolve_model(parts[1])
    swapped = [parts[0], parts[2], parts[1]]
    with pytest.raises(GGUFFileError, match=r"\(split.no, split.count\) = \(2, 3\), expected"):
        read_gguf(swapped, 4, 2)
    parts[2].unlink()
    with pytest.raises(ModelError, match="split in 3 parts, but m-00003-of-00003.gguf is missing"):
        resolve_model(parts[0])


def refused(model: object) -> str:
    with pytest.raises(ModelError) as info:
        resolve_model(model)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    return message


def test_what_is_not_a_model_is_refused_with_one_line(tiny_gguf, tmp_path):
    assert "no such file or directory" in refused(tmp_path / "missing.gguf")
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")
    assert "is not a GGUF file: --model takes a .gguf file" in refused(notes)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"\x00" * 4096)
    assert "is not a GGUF file" in refused(fake)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:100_000])
    assert "is not a readable GGUF file, truncated or corrupt" in refused(truncated)
    unknown = tmp_path / "unknown-arch.gguf"
    writer = GGUFWriter(str(unknown), "bogus")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "cannot read its metadata (GGUF model with architecture bogus" in refused(unknown)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no model (no .gguf file, no config.json)" in refused(empty)
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(tiny_gguf, two / "a.gguf")
    shutil.copy(tiny_gguf, two / "b.gguf")
    assert "holds 2 GGUF files that are not the parts of one checkpoint" in refused(two)


def test_the_supervisor_checks_a_model_directory_before_any_start(tiny_model_dir, tmp_path):
    check_model(tiny_model_dir)
    bogus = tmp_path / "bogus"
    shutil.copytree(tiny_model_dir, bogus)
    config = json.loads((bogus / "config.json").read_text())
    (bogus / "config.json").write_text(json.dumps({**config, "model_type": "bogus"}))
    with pytest.raises(ModelError, match="model_type 'bogus' is not supported"):
        check_model(bogus)
    del config["hidden_size"]
    (bogus / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="has no 'hidden_size'"):
        check_model(bogus)
    shutil.copy(tiny_model_dir / "config.json", bogus / "config.json")
    (bogus / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="has no weights"):
        check_model(bogus)


def test_architectures_come_from_transformers_own_mapping():
    """Every architecture transformers reads from a GGUF gets the class its own checkpoints name
    (the metadata writer once wrote LlamaForCausalLM for all)."""
    import transformers
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    for model_type in set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"}:
        for name in causal_lm_architectures(model_type):
            assert hasattr(transformers, name), (model_type, name)
    assert {t: causal_lm_architectures(t) for t in CLASSES} == {t: [c] for t, c in CLASSES.items()}
    assert causal_lm_architectures("gemma3_text") == ["Gemma3ForCausalLM"]
    assert causal_lm_architectures("bogus") == []
