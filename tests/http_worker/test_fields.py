"""The field policy's pieces without a server: what "asks for nothing" means, and the
--lenient-fields switch from the command line to the cluster config (the end-to-end behaviour is
in tests/test_http_api_parity.py)."""

from __future__ import annotations

import pytest

from http_worker.fields import NO_OP_FIELDS, NOT_IMPLEMENTED_FIELDS, asks_for_nothing
from http_worker.frontend import FrontendSettings
from ipc.config import ClusterConfig
from procs.cli import build_parser, cluster_kwargs


@pytest.mark.parametrize(
    "value, neutral, expected",
    [
        (None, (), True),
        ([], (), True),
        ({}, (), True),
        ("", (), True),
        (0, (0,), True),
        (0.0, (0,), True),
        (1, (1, 1.0), True),
        (["text"], (["text"],), True),
        (False, (False,), True),
        (True, (True,), True),
        (False, (0,), False),  # false is not 0 here, nor true 1
        (1, (True,), False),
        (0, (False,), False),
        (2, (0,), False),
        (["text", "audio"], (["text"],), False),
        ({"a": 1}, (), False),
        ("auto", (), False),
    ],
)
def test_what_asks_for_nothing(value, neutral, expected):
    assert asks_for_nothing(value, neutral) is expected


def test_the_tables_do_not_overlap_nor_name_a_declared_field():
    from http_worker.chat_protocol import ChatCompletionRequest
    from http_worker.protocol import CompletionRequest

    declared = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert not set(NO_OP_FIELDS) & set(NOT_IMPLEMENTED_FIELDS)
    assert not declared & (set(NO_OP_FIELDS) | set(NOT_IMPLEMENTED_FIELDS))


def test_lenient_fields_goes_from_the_command_line_to_the_config(tmp_path):
    assert FrontendSettings(client_addr="x").lenient_fields is False
    for argv, expected in (
        (["launch", "--http-port", "0"], False),
        (["launch", "--http-port", "0", "--lenient-fields"], True),
    ):
        kwargs = cluster_kwargs(build_parser().parse_args(argv))
        config = ClusterConfig.build("m", str(tmp_path), **kwargs)
        assert config.lenient_fields is expected
        assert ClusterConfig.from_json(config.to_json()).lenient_fields is expected
