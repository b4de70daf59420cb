"""A config that asks for more layers than the checkpoint holds is refused at load with one line
naming the missing tensor (a ValueError, which the engine process reports as its start-up
failure: one line and exit code 2), not a KeyError traceback from deep in the layer loader."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine_worker.model import LlamaFamilyModel


def test_a_config_with_more_layers_than_the_weights_is_refused_at_load(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "lying"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] += 3
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has no tensor 'model.layers.2.") as info:
        LlamaFamilyModel.load(model_dir, torch.device("cpu"), torch.float32, 64)
    assert "5 layers" in str(info.value)
    LlamaFamilyModel.load(tiny_model_dir, torch.device("cpu"), torch.float32, 64)
