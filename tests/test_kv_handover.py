"""KV handed between engines with no shared transfer segment (issue 40 parts 3 and 6), on the
tiny model, real processes and sockets: serve-ray's prefill/decode hand-over between two
clusters (over shared memory and over the net transport), and a prefill/decode cluster whose KV
moves over the net transport (``--kv-transport net``). The scenarios run once per transport in
kv_transport_scenarios.py; the net ones inside a network namespace of their own, and they skip,
saying why, where the ``kvnet`` extra cannot load (as tests/engine_worker/test_kv_net.py's do).
No timed assertion."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.engine_worker.test_kv_net import transfer_engine_loads
from tests.kv_transport_scenarios import TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]
IN_NAMESPACE = 'ip link set lo up && exec "$0" -m tests.kv_transport_scenarios "$@"'
pytestmark = pytest.mark.timeout(600)


def run_scenarios(tmp: Path, tiny: Path, transport: str) -> dict[str, Any]:
    out = tmp / f"{transport}.json"
    args = [sys.executable, str(out), str(tiny), transport]
    if transport == "net":
        why_not = transfer_engine_loads()
        if why_not:
            pytest.skip(f"the kvnet extra cannot be used here: {why_not}")
        missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
        if missing:
            pytest.fail(f"the net transport's tests need {missing} for their namespace")
        command = ["unshare", "-rn", "sh", "-c", IN_NAMESPACE, *args]
    else:
        command = [args[0], "-m", "tests.kv_transport_scenarios", *args[1:]]
    env = {**os.environ, "GLOG_minloglevel": "1"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    results = json.loads(out.read_text()) if out.exists() else {}
    if not results:
        pytest.fail(f"the scenarios did not run (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


@pytest.fixture(scope="module", params=["shm", "net"])
def scenarios(request, tmp_path_factory, tiny_model_dir) -> tuple[str, dict[str, Any]]:
    transport = request.param
    return transport, run_scenarios(tmp_path_factory.mktemp("kv"), tiny_model_dir, transport)


def part(results: dict[str, Any], name: str) -> dict[str, Any]:
    found = results.get(name)
    assert found is not None, f"the scenario {name!r} did not run"
    assert found["ok"], found["error"]
    return found


def test_a_prompt_computed_by_one_cluster_is_decoded_from_its_kv_by_another(scenarios):
    transport, results = scenarios
    seen = part(results, "handover")
    assert seen["transport"] == transport
    assert seen["exported_blocks"] == 4 and seen["export_error"] == ""
    assert seen["imported_blocks"] == 4 and seen["import_error"] == ""
    # The decode side found the imported blocks as its prefix cache and computed the rest.
    assert seen["decode"]["cached"] == 64
    assert seen["decode"]["tokens"] == seen["prefill"]["tokens"]
    assert seen["decode"]["finish"] == "length"
    assert seen["held_after"], "the exporter's run was not freed once taken"
    assert seen["decode_stats"]["kv_handover_imported_blocks"] == 4


def test_a_transfer_not_taken_in_its_bound_is_given_back_and_computed_instead(scenarios):
    _, results = scenarios
    seen = part(results, "handover")
    assert "given back" in seen["late_import_error"], seen["late_import_error"]
    assert seen["late_decode"]["cached"] == 0  # computed there
    assert seen["late_decode"]["tokens"] == seen["late_reference"]["tokens"]
    assert seen["prefill_stats"]["kv_transfers_aborted"] == 1
    assert seen["prefill_stats"]["kv_transfer_blocks_held"] == 0


def test_a_pd_cluster_moves_kv_over_the_net_transport_without_dev_shm(scenarios):
    transport, results = scenarios
    if transport != "net":
        pytest.skip("the shm transport's PD cluster is tests/test_disaggregation.py's")
    seen = part(results, "pd")
    assert [a["tokens"] for a in seen["pd"]] == [a["tokens"] for a in seen["colocated"]]
    assert seen["pd_seeded"]["tokens"] == seen["colocated_seeded"]["tokens"]
    assert seen["segments"] == [], "a transfer segment under /dev/shm"
    assert seen["prefill_stats"]["kv_transfers"] >= 5
    assert (
        seen["decode_stats"]["kv_imports"] >= 5 and seen["decode_stats"]["kv_imports_refused"] == 0
    )
    assert seen["clean"], "KV blocks still held at idle"


def test_a_pull_from_a_stalled_prefill_engine_ends_its_request_once_at_the_bound(scenarios):
    transport, results = scenarios
    if transport != "net":
        pytest.skip("over shm the decode engine reads memory, it does not wait on a peer")
    seen = part(results, "pd_stalled_prefill")
    assert seen["a_running"] and seen["b_waiting"], seen
    assert seen["terminals"] == [1, 1] and seen["a"] == "abort"
    assert seen["b"]["code"] == "unavailable", seen["b"]
    assert (
        "the KV transfer failed" in seen["b"]["error"]
        and "did not end within" in seen["b"]["error"]
    )
    assert len(seen["b"]["tokens"]) == 1  # the prefill engine's first token, then the end
    assert TIMEOUT_S - 0.5 < seen["b_after_s"] < TIMEOUT_S + 10
    assert seen["decode_stats"]["kv_imports_refused"] == 1
    assert seen["clean"], "KV blocks still held at idle"
    assert seen["after"]["finish"] == "length"
