"""KV moved between engines that share no transfer segment: test_kv_handover.py starts this once
per transport and asserts on what it writes.

    python -m tests.kv_transport_scenarios RESULTS_JSON TINY_MODEL_DIR shm|net

``net`` runs inside a network namespace of its own (``unshare -rn``, loopback only): Mooncake's
transfer engine listens on every interface. Scenarios, each under its name in RESULTS_JSON:

* ``handover``: two clusters of one engine each, as serve-ray's prefill and decode replicas run
  them (engine_worker/kv_handover.py): a prompt computed on the first, its cached blocks
  exported, imported into the second's prefix cache; the second then serves the prompt from
  that cache, and its greedy tokens are the first's. A transfer not taken within the bound is
  given back: its import is refused, and the decode side computes the prompt itself.
* ``pd`` (net only): a ``--prefill-engines 1 --decode-engines 1`` cluster whose KV moves over
  the net transport; its greedy and seeded tokens against a colocated engine's, and no
  transfer segment under /dev/shm.
* ``pd_stalled_prefill`` (net only): the decode engine's pull from a stopped prefill engine
  ends at the transfer bound; the request ends 'unavailable' once, nothing stays held.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from ipc.client import Client
from ipc.codec import pack_ids
from procs.launch_cluster import Cluster, launch_cluster
from procs.serve_ray.handover import HandoverChannel
from tests.test_disaggregation import KNOBS, PROMPTS, ids

TIMEOUT_S = 3.0  # the transfer bound of these clusters
SAMPLED = dict(temperature=0.9, top_k=40, seed=5, frequency_penalty=0.4)


def wait_for(check: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def answer(cluster: Cluster, prompt: list[int], **sampling: Any) -> dict[str, Any]:
    with Client(cluster.client_addr) as client:
        result = client.submit(
            prompt_token_ids=prompt, max_tokens=12, ignore_eos=True, **sampling
        ).result(timeout=120)
    usage = result.usage
    return {
        "tokens": result.token_ids,
        "finish": result.finish_reason,
        "cached": usage.cached_tokens if usage else None,
    }


def handover(tiny: str, transport: str) -> dict[str, Any]:
    knobs = dict(KNOBS, kv_transport=transport, kv_transfer_timeout_s=TIMEOUT_S)
    knobs.pop("tokenizer_workers")
    out: dict[str, Any] = {}
    with (
        launch_cluster(tiny, kv_handover="export", **knobs) as prefill,
        launch_cluster(tiny, kv_handover="import", **knobs) as decode,
    ):
        exporter, importer = HandoverChannel(prefill.config), HandoverChannel(decode.config)
        try:
            prompt = ids(7, 70)  # 4 full blocks and 6 tokens
            out["prefill"] = answer(prefill, prompt, temperature=0)  # computes and caches it
            exported = exporter.export("a", pack_ids(prompt), None, TIMEOUT_S + 5)
            out["exported_blocks"], out["export_error"] = exported.blocks, exported.error
            assert exported.kv is not None, exported.error
            out["transport"] = exported.kv.transport
            imported = importer.import_("a", pack_ids(prompt), exported.kv, None, TIMEOUT_S + 5)
            out["imported_blocks"], out["import_error"] = imported.blocks, imported.error
            out["decode"] = answer(decode, prompt, temperature=0)
            out["held_after"] = wait_for(
                lambda: prefill.worker_stats("engine").get("kv_transfer_blocks_held") == 0
            )
            # Given back at the bound: the import is refused and the prompt computed there.
            late = ids(8, 50)
            answer(prefill, late, temperature=0)
            stale = exporter.export("b", pack_ids(late), None, TIMEOUT_S + 5)
            assert stale.kv is not None, stale.error
            time.sleep(TIMEOUT_S + 1.5)
            refused = importer.import_("b", pack_ids(late), stale.kv, None, TIMEOUT_S + 5)
            out["late_import_error"] = refused.error
            out["late_decode"] = answer(decode, late, temperature=0)
            out["late_reference"] = answer(prefill, late, temperature=0)
            out["prefill_stats"] = prefill.worker_stats("engine")
            out["decode_stats"] = decode.worker_stats("engine")
        finally:
            exporter.close()
            importer.close()
    return out


def pd(tiny: str) -> dict[str, Any]:
    prompts = PROMPTS[:4]
    out: dict[str, Any] = {}
    with launch_cluster(tiny, **KNOBS) as colocated:
        out["colocated"] = [answer(colocated, p, temperature=0) for p in prompts]
        out["colocated_seeded"] = answer(colocated, prompts[2], **SAMPLED)
    pd_knobs = dict(KNOBS, prefill_engines=1, decode_engines=1, kv_transport="net")
    with launch_cluster(tiny, **pd_knobs) as cluster:
        out["pd"] = [answer(cluster, p, temperature=0) for p in prompts]
        out["pd_seeded"] = answer(cluster, prompts[2], **SAMPLED)
        prefix = Path(cluster.config.kv_segment_prefix)
        out["segments"] = [str(p) for p in prefix.parent.glob(f"{prefix.name}*")]
        out["clean"] = wait_for(
            lambda: (
                cluster.worker_stats("engine", 0).get("kv_transfer_blocks_held") == 0
                and cluster.worker_stats("engine", 0).get("kv_blocks_used") == 0
                and cluster.worker_stats("engine", 1).get("kv_blocks_used") == 0
            )
        )
        out["prefill_stats"] = cluster.worker_stats("engine", 0)
        out["decode_stats"] = cluster.worker_stats("engine", 1)
    return out


def pd_stalled_prefill(tiny: str) -> dict[str, Any]:
    """The decode engine's pull from a prefill engine that is alive and answers nothing
    (SIGSTOP) ends at the bound: that request ends 'unavailable' once, nothing stays held, and
    the cluster serves on. The decode engine's only batch slot is kept busy (A) while B's KV
    waits for it; the prefill engine is stopped, A is aborted, and the decode engine pulls."""
    knobs = dict(KNOBS, prefill_engines=1, decode_engines=1, kv_transport="net")
    knobs.update(max_batch_size=1, kv_transfer_timeout_s=TIMEOUT_S)
    out: dict[str, Any] = {}
    with launch_cluster(tiny, **knobs) as cluster, Client(cluster.client_addr) as client:
        decode = lambda: cluster.worker_stats("engine", 1)  # noqa: E731
        a = client.submit(prompt_token_ids=PROMPTS[1], max_tokens=1000, ignore_eos=True)
        out["a_running"] = wait_for(lambda: decode().get("running") == 1)
        b = client.submit(prompt_token_ids=PROMPTS[2], max_tokens=8, ignore_eos=True)
        out["b_waiting"] = wait_for(lambda: decode().get("kv_imports_waiting") == 1)
        prefill_pid = cluster.child("engine", 0).popen.pid
        os.kill(prefill_pid, signal.SIGSTOP)
        try:
            a.abort()
            t_abort = time.monotonic()
            result = b.result(timeout=60, check=False)
            out["b_after_s"] = time.monotonic() - t_abort
        finally:
            os.kill(prefill_pid, signal.SIGCONT)
        a_result = a.result(timeout=60, check=False)
        out["terminals"] = [sum(d.finished for d in h._deltas) for h in (a, b)]
        out["a"] = a_result.finish_reason
        out["b"] = {"code": result.error_code, "error": result.error, "tokens": result.token_ids}
        out["clean"] = wait_for(
            lambda: (
                cluster.worker_stats("engine", 0).get("kv_transfer_blocks_held") == 0
                and cluster.worker_stats("engine", 0).get("kv_blocks_used") == 0
                and decode().get("kv_blocks_used") == 0
            )
        )
        out["decode_stats"] = decode()
        out["after"] = answer(cluster, PROMPTS[3], temperature=0)
    return out


def main(out_path: str, tiny: str, transport: str) -> None:
    results: dict[str, Any] = {}
    scenarios = [("handover", lambda: handover(tiny, transport))]
    if transport == "net":
        scenarios.append(("pd", lambda: pd(tiny)))
        scenarios.append(("pd_stalled_prefill", lambda: pd_stalled_prefill(tiny)))
    for name, scenario in scenarios:
        try:
            results[name] = {"ok": True, **scenario()}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()[-4000:]}
        Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
