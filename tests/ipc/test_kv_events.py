"""The KV event payload codec, the --kv-events-config knob and where a replica publishes."""

from __future__ import annotations

import msgpack
import pytest

from ipc.codec import DecodeError
from ipc.engine_config import EngineConfig
from ipc.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    parse_kv_events_config,
    plan_endpoint,
)


def test_round_trip_and_the_wire_shape():
    batch = EventBatch(
        [
            AllBlocksCleared(),
            BlockStored([2**64 - 1, 5], None, list(range(8)), 4, "GPU"),
            BlockRemoved([2**64 - 1], "GPU"),
        ],
        ts=12.5,
        data_parallel_rank=2,
    )
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (12.5, 2) and events[0] == {"type": "AllBlocksCleared"}
    # The keys of each event are checked by the raw subscriber (tests/runtime/test_kv_events).
    assert events[1]["type"] == "BlockStored" and events[1]["block_hashes"][0] == 2**64 - 1


def test_decoder_ignores_keys_it_does_not_use_and_refuses_wrong_ones():
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": 0,
        "token_ids": [1, 2],
        "block_size": 2,
        "extra_keys": [None],
        "group_idx": 0,
    }
    assert decode_batch(msgpack.packb([1.0, [event]])).events[0].block_hashes == [1]
    bad = [
        b"\xc1",
        msgpack.packb({"ts": 1.0}),
        msgpack.packb([1.0, [{"type": "Bogus"}], 0]),
        msgpack.packb([1.0, [dict(event, block_hashes=[-1])], 0]),
        msgpack.packb([1.0, [dict(event, block_hashes=[1.5])], 0]),
        msgpack.packb([1.0, [dict(event, token_ids=[1])], 0]),
        msgpack.packb([1.0, [dict(event, parent_block_hash="x")], 0]),
        msgpack.packb([True, [], 0]),
        msgpack.packb([1.0, [], "rank"]),
    ]
    for payload in bad:
        with pytest.raises(DecodeError):
            decode_batch(payload)


def test_kv_events_config_takes_vllm_keys_and_names_what_is_wrong():
    assert parse_kv_events_config("") is None
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert config is not None and config.publishes and config.endpoint == "tcp://*:5557"
    assert not parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "null"}'
    ).publishes
    for text, field in [
        ("[1]", "JSON object"),
        ("{", "not JSON"),
        ('{"endpoint": "http://x"}', "endpoint"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"hwm": "1"}', "hwm"),
        ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events"),
        ('{"surprise": 1}', "surprise"),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(model_path="m", kv_events_config=text)


def test_replica_endpoints_follow_vllm_and_stay_on_loopback_without_curve():
    plan = plan_endpoint("tcp://*:5557", 2, curve=False)
    assert (plan.address, plan.bind, plan.narrowed_from) == (
        "tcp://127.0.0.1:5559",
        True,
        "tcp://*:5559",
    )
    assert plan_endpoint("tcp://*:5557", 1, curve=True).address == "tcp://*:5558"
    assert plan_endpoint("tcp://[::]:5557", 0, curve=False).address == "tcp://[::1]:5557"
    collector = plan_endpoint("tcp://10.0.0.5:5557", 1, curve=False)  # vLLM connects there
    assert (collector.address, collector.bind) == ("tcp://10.0.0.5:5558", False)
    assert plan_endpoint("ipc:///run/kv.sock", 1, curve=False).address == "ipc:///run/kv.sock_dp1"
    assert plan_endpoint("tcp://127.0.0.1:5560", 0, curve=False, replay=True).bind
    with pytest.raises(ValueError, match="beyond loopback"):
        plan_endpoint("tcp://10.0.0.5:5558", 0, curve=False, replay=True)
    with pytest.raises(ValueError, match="port"):
        plan_endpoint("tcp://*:65535", 1, curve=False)
