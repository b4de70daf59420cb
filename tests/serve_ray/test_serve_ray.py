"""splitserve on Ray Serve (issue 26), on real Ray, real processes and the tiny model; the answer
on the real model too when the slow test is selected.

Ray binds to the host's routable address even when asked for loopback, and tests must send
nothing off this machine, so the scenarios run in a network namespace of their own (``unshare
-rn``, loopback only), started once for the module: in_namespace.py starts one local Ray there,
runs every scenario and writes what it saw; each test here asserts on its part. A Ray that cannot
start fails every test with the reason; nothing is skipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
REAL_TEST = "test_the_real_model_answers_through_serve"
IN_NAMESPACE = 'ip link set lo up && exec "$0" -m tests.serve_ray.in_namespace "$@"'


@pytest.fixture(scope="module")
def scenarios(request, tiny_model_dir, tmp_path_factory) -> dict[str, Any]:
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the Ray tests need {missing} (util-linux, iproute2) for their namespace")
    out = tmp_path_factory.mktemp("ray") / "results.json"
    # Ray's own temp dir holds unix sockets, whose paths may not pass 107 bytes: pytest's tmp
    # paths (longer under pytest-xdist, popen-gwN) leave Ray too little, so it is short, in /tmp.
    ray_tmp = Path(tempfile.mkdtemp(prefix="ssray-"))
    request.addfinalizer(lambda: shutil.rmtree(ray_tmp, ignore_errors=True))
    args = [str(out), str(ray_tmp), str(tiny_model_dir)]
    if any(item.name == REAL_TEST for item in request.session.items):
        from procs.model_store import ensure_default_model

        args.append(str(ensure_default_model()))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    t_start = time.monotonic()
    proc = subprocess.run(
        ["unshare", "-rn", "sh", "-c", IN_NAMESPACE, sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    results = json.loads(out.read_text()) if out.exists() else {}
    print(f"Ray scenarios: {time.monotonic() - t_start:.0f} s", file=sys.stderr)
    start = results.get("start", {})
    if not start.get("ok"):
        pytest.fail(
            f"Ray Serve did not start in the test's namespace (exit {proc.returncode}):\n"
            f"{start.get('error', '')}\n{proc.stderr[-4000:]}"
        )
    return results


def part(scenarios: dict[str, Any], name: str) -> dict[str, Any]:
    found = scenarios.get(name)
    assert found is not None, f"the scenario {name!r} did not run"
    assert found["ok"], found["error"]
    return found


def test_a_shared_prefix_sticks_to_one_replica_and_a_new_one_goes_to_the_other(scenarios):
    seen = part(scenarios, "routing")
    (a1, first), (a2, again), (b1, _), (b2, b_again) = (seen[k] for k in ("a1", "a2", "b1", "b2"))
    assert a1 == a2, "A's second request left the replica holding A's prefix"
    assert b1 != a1, "B arrived while A's replica was busy and found no cache: the other one"
    assert b2 == b1
    # The replica that got each repeat had the prefix cached (3 of the prompt's 4 blocks).
    assert first["cached"] == 0 and again["cached"] == 48 and b_again["cached"] == 48


def test_a_client_disconnect_aborts_the_request_in_its_engine_replica(scenarios):
    seen = part(scenarios, "routing")
    assert seen["aborted_after_disconnect"] == 1
    assert set(seen["load_after_disconnect"].values()) == {0}


def test_replicas_advertise_their_kv_events_as_rays_kv_aware_router_reads_them(scenarios):
    """On a TCP address beyond ipc.config's loopback hosts, so with CURVE, whose public key
    travels with the routing stats (the routing test shows the router read the events)."""
    seen = part(scenarios, "routing")
    metadata = seen["kv_event_metadata"]
    assert len(metadata) == 2 and all(seen["curve"].values())
    for meta in metadata.values():
        assert meta["endpoint"].startswith("tcp://127.0.0.2:")
        assert meta["replay_endpoint"].startswith("tcp://127.0.0.2:")
        assert meta["block_size"] == 16 and meta["dp_rank"] == 0
    assert len({m["endpoint"] for m in metadata.values()}) == 2


def test_the_openai_client_streams_chat_and_completions_through_the_ingress(scenarios):
    seen = part(scenarios, "openai")
    # In pieces as they are made (SSE through Serve), not one buffered answer.
    assert seen["chat_deltas"] >= 2 and seen["chat_finish"] in ("length", "stop")
    assert seen["chat_usage"] is not None and seen["chat_usage"] >= 1
    assert seen["text_deltas"] >= 2 and seen["text_finish"] in ("length", "stop")
    # Bad input is a 400 naming its field, caught by the ingress before any engine.
    assert seen["bad_request"] == {"status": 400, "param": "max_tokens"}


def test_a_killed_engine_replica_loses_no_request_and_serve_brings_it_back(scenarios):
    seen = part(scenarios, "kill")
    assert seen["victim_load"] >= 1, "the killed replica held requests"
    for stream in seen["streams"]:
        assert stream["done"], stream
        assert len(stream["terminals"]) == 1, stream  # exactly one terminal event
        assert stream["terminals"][0] in ("length", "error:unavailable"), stream
    assert seen["replicas_after"] == [True, True], "two replicas again, the dead one replaced"
    assert all(a["text"] is not None for a in seen["afterwards"])


def test_prefill_and_decode_deployments_answer_as_the_colocated_replicas(scenarios):
    """The prompt computed by the prefill replica, its KV imported by the decode replica
    (found there as cached blocks), the answer the colocated replicas gave, once each."""
    seen = part(scenarios, "pd")
    assert [a["text"] for a in seen["answers"]] == [a["text"] for a in seen["colocated"]]
    for answer, prompt_len in zip(seen["answers"], (40, 70, 129, 20, 90, 33)):
        assert answer["cached"] == (prompt_len - 1) // 16 * 16, answer
    for stream in seen["streams"]:
        assert stream["done"] and stream["terminals"] == ["length"], stream
    assert seen["openai"]["chat_finish"] in ("length", "stop")
    assert seen["openai"]["bad_request"] == {"status": 400, "param": "max_tokens"}
    (prefill,), (decode,) = seen["prefill"], seen["decode"]
    assert prefill["role"] == "prefill" and decode["role"] == "decode"
    assert prefill["kv_moved"] >= 12 and decode["kv_moved"] >= 12
    assert prefill["kv_failed"] == 0 and decode["kv_failed"] == 0


def test_a_killed_prefill_replica_costs_time_not_answers(scenarios):
    """Its prompts are computed by the decode replica instead: each stream ends once, whole."""
    seen = part(scenarios, "pd")["prefill_killed"]
    assert seen["victim_load"] >= 1, "the killed prefill replica held requests"
    for stream in seen["streams"]:
        assert stream["done"] and stream["terminals"] == ["length"], stream
    assert seen["replaced"], "Serve did not replace the prefill replica"
    assert seen["afterwards"]["text"] is not None


@pytest.mark.slow
def test_the_real_model_answers_through_serve(scenarios):
    seen = part(scenarios, "real")
    assert "Paris" in seen["text"]


# --- without a Ray cluster: how the application is described --------------------------------------
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's schemas, on pydantic 2
def test_the_documented_serve_config_file_builds_the_application():
    """docs/ray.md's config file, through Serve's own schema and application builder call."""
    import yaml
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    block = re.search(r"```yaml\n(.*?)```", (ROOT / "docs/ray.md").read_text(), re.S)
    assert block is not None
    config = ServeDeploySchema.model_validate(yaml.safe_load(block.group(1))).applications[0]
    builder = import_attr(config.import_path)
    ingress = call_user_app_builder_with_args_if_necessary(builder, config.args)._bound_deployment
    engine, settings = ingress.init_args
    deployment = engine._bound_deployment
    assert (deployment.name, deployment.num_replicas) == ("engine", 4)
    router = deployment._deployment_config.request_router_config
    assert router.request_router_class == "procs.serve_ray.router:TokenPrefixRouter"
    assert router.request_router_kwargs["balance_abs_threshold"] == 16
    assert settings.api_key == "KEY" and settings.cluster["kv_cache_tokens"] == 65536
    with pytest.raises(TypeError, match="replicaz"):
        call_user_app_builder_with_args_if_necessary(builder, {"replicaz": 3})


def test_the_command_line_splits_the_application_knobs_from_each_replicas():
    from procs.serve_ray.command import build_parser, settings_of

    argv = ["--replicas", "3", "--request-router", "power_of_two", "--max-batch-size", "8"]
    settings = settings_of(build_parser().parse_args([*argv, "--routing-cache-threshold", "0.5"]))
    assert (settings.replicas, settings.request_router) == (3, "power_of_two")
    assert settings.cluster["max_batch_size"] == 8 and settings.thresholds.cache_threshold == 0.5
    with pytest.raises(SystemExit):  # Serve makes the replicas: no --engines
        build_parser().parse_args(["--engines", "2"])
    argv = ["--prefill-engines", "1", "--decode-engines", "2", "--kv-transport", "net"]
    pd = settings_of(build_parser().parse_args([*argv, "--kv-net-host", "node"]))
    assert (pd.prefill_engines, pd.decode_engines, pd.disaggregated) == (1, 2, True)
    assert (pd.cluster["kv_transport"], pd.cluster["kv_net_host"]) == ("net", "node")
    with pytest.raises(ValueError, match="both --prefill-engines and --decode-engines"):
        settings_of(build_parser().parse_args(["--prefill-engines", "1"]))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's schemas, on pydantic 2
def test_the_prefill_decode_mode_builds_two_engine_deployments():
    from procs.serve_ray.app import build_app

    ingress = build_app({"prefill_engines": 2, "decode_engines": 3})._bound_deployment
    decode, settings, prefill = (getattr(a, "_bound_deployment", a) for a in ingress.init_args)
    deployments = {d.name: d for d in (prefill, decode)}
    assert {n: d.num_replicas for n, d in deployments.items()} == {"prefill": 2, "decode": 3}
    assert prefill.init_args[1] == "prefill" and decode.init_args[1] == "decode"
    routers = {n: d._deployment_config.request_router_config for n, d in deployments.items()}
    assert routers["prefill"].request_router_kwargs["policy"] == "cache_aware"
    assert routers["decode"].request_router_kwargs["policy"] == "least_loaded"
    assert settings.disaggregated
