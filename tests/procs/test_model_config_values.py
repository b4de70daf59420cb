"""A config.json whose values lie (wrong JSON types, sizes that are zero, negative or absurd, NaN,
a rope we do not compute, LongRoPE without its factors) is refused by the supervisor's check with
one line naming the key, before any engine starts (before: an engine traceback, or a supervisor
traceback with exit code 1, or a model that served NaNs)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from procs.local_model import ModelError, check_model
from tests.test_startup_failures import assert_one_line_error, splitserve

CASES = [
    ({"hidden_size": "64"}, "hidden_size must be a positive integer"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"hidden_size": 2**31}, "hidden_size must be a positive integer"),
    ({"hidden_size": True}, "hidden_size must be a positive integer"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"intermediate_size": 0}, "intermediate_size must be a positive integer"),
    ({"vocab_size": -1}, "vocab_size must be a positive integer"),
    ({"num_hidden_layers": "2"}, "wrong type"),
    ({"num_hidden_layers": None}, "wrong type"),
    ({"max_position_embeddings": -5}, "max_position_embeddings must be a positive integer"),
    ({"max_position_embeddings": 2**62}, "max_position_embeddings must be a positive integer"),
    ({"head_dim": 15}, "head_dim must be even"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number"),
    ({"rope_parameters": "x"}, "wrong type"),
    ({"rope_parameters": {"rope_theta": float("nan")}}, "rope_theta must be a finite positive"),
    ({"rope_parameters": {"rope_theta": 0}}, "rope_theta must be a finite positive"),
    ({"rope_parameters": {"rope_type": "zzz"}}, "rope type 'zzz' is not supported"),
    ({"rope_parameters": {"rope_type": "longrope"}}, "LongRoPE needs short_factor"),
    (
        {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8}},
        "LongRoPE needs long_factor: a list of 8 numbers",
    ),
    # Gemma 2's keys on the Llama checkpoint: a negative query_pre_attn_scalar gave a complex
    # softmax scale, a NaN soft-cap NaN scores
    ({"query_pre_attn_scalar": -4}, "the attention settings are not valid"),
    ({"attn_logit_softcapping": float("nan")}, "the attention settings are not valid"),
    ({"sliding_window": -5}, "the attention settings are not valid"),
]


def with_config(tiny_model_dir: Path, out: Path, change: dict) -> Path:
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config.update(change)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(("change", "reason"), CASES)
def test_a_config_that_lies_is_refused_with_the_key(tiny_model_dir, tmp_path, change, reason):
    model = with_config(tiny_model_dir, tmp_path / "m", change)
    with pytest.raises(ModelError, match=reason):
        check_model(model)


def test_the_tiny_model_still_passes(tiny_model_dir):
    check_model(tiny_model_dir)


def test_a_config_of_the_wrong_type_ends_the_launch_with_one_line(tiny_model_dir, tmp_path):
    """Before: a supervisor traceback and exit code 1 (num_hidden_layers), or the engine's
    traceback (hidden_size a string)."""
    for key, value in (("num_hidden_layers", "2"), ("hidden_size", "64")):
        model = with_config(tiny_model_dir, tmp_path / key, {key: value})
        code, stderr, took = splitserve("launch", "--model", str(model), cache=tmp_path)
        assert code == 2, stderr
        assert_one_line_error(stderr, key if key == "hidden_size" else "wrong type")
        assert took < 60, took


def test_a_tokenizer_past_the_models_vocab_size_is_refused(tiny_model_dir, tmp_path):
    """Before: served, and every request refused ('token ids must be in [0, 1000)')."""
    model = with_config(tiny_model_dir, tmp_path / "m", {"vocab_size": 1000})
    with pytest.raises(ModelError, match="the tokenizer has 49152 tokens, the model's vocab_size"):
        check_model(model)
    (model / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelError, match="tokenizer.json cannot be read"):
        check_model(model)
