"""``--served-model-name`` takes 1 to 256 printable characters (any script, emoji included);
control characters, bidi overrides, a blank or an over-long name are refused before anything
starts, with one line and exit code 2 (before: served as given, a newline or an escape sequence
in /v1/models, every response, the metrics' labels and the logs)."""

from __future__ import annotations

import pytest

from procs.cluster_setup import make_config
from procs.local_model import ModelError
from tests.test_startup_failures import assert_one_line_error, splitserve


@pytest.mark.parametrize(
    "name", ["evil\nname", "a\x1b[31mred", "tab\there", "\u202eevil", "   ", "x" * 257]
)
def test_a_hostile_served_name_is_refused(tiny_model_dir, name):
    with pytest.raises(ModelError, match="must be 1 to 256 printable characters"):
        make_config(tiny_model_dir, served_model_name=name)


@pytest.mark.parametrize("name", ["", "my-model", "mödel é 模型 😀", "org/name:v1.2", "x" * 256])
def test_an_ordinary_served_name_is_taken(tiny_model_dir, tmp_path, name):
    config, _ = make_config(tiny_model_dir, run_dir=str(tmp_path / "run"), served_model_name=name)
    assert config.engine.served_model_name == name


def test_the_command_refuses_it_with_one_line(tiny_model_dir, tmp_path):
    code, stderr, took = splitserve(
        "chat", "--model", str(tiny_model_dir), "--served-model-name", "a\nb", "hi", cache=tmp_path
    )
    assert code == 2
    assert_one_line_error(stderr, "--served-model-name 'a\\nb' must be 1 to 256 printable")
    assert took < 60
