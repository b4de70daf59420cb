"""The default CPU budget: the engine gets every core but the ones the bursty roles may keep
(at most a quarter of the machine); an explicit count is kept."""

from __future__ import annotations

import pytest

from procs.thread_budget import thread_budget


def test_small_machines_give_the_engine_every_core():
    assert thread_budget(1, http_workers=1, cpus=2) == (2, 1)
    assert thread_budget(1, cpus=1) == (1, 1)
    assert thread_budget(2, http_workers=1, cpus=4) == (3, 1)


def test_large_machines_reserve_a_core_per_bursty_role():
    # one tokenizer, one HTTP frontend and the detokenizer
    assert thread_budget(1, http_workers=1, cpus=16) == (13, 1)
    assert thread_budget(8, tokenizer_threads=2, cpus=16) == (12, 2)


def test_explicit_engine_threads_are_kept():
    assert thread_budget(1, engine_threads=1, cpus=2) == (1, 1)


def test_engine_replicas_split_the_engine_budget_and_get_their_own_cores_and_device(tmp_path):
    import os

    from ipc.config import ClusterConfig
    from procs.thread_budget import child_env, engine_cores

    assert thread_budget(1, engine_threads=8, engines=2, cpus=16) == (4, 1)
    assert thread_budget(1, engine_threads=3, engines=2, cpus=16) == (1, 1)  # the floor
    assert thread_budget(1, engines=4, cpus=2) == (1, 1)  # at least one each
    config = ClusterConfig.build(
        "m", str(tmp_path), engines=2, engine_threads=1, devices="3,5", pin_engine_cores=True
    )
    assert child_env("engine", config, {}, 1)["CUDA_VISIBLE_DEVICES"] == "5"
    assert "CUDA_VISIBLE_DEVICES" not in child_env("tokenizer", config, {}, 1)
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        assert engine_cores(config, 0) == [cpus[0]]
        assert engine_cores(config, 1) == [cpus[1 % len(cpus)]]
    unpinned = ClusterConfig.build("m", str(tmp_path), engines=2)
    assert engine_cores(unpinned, 0) is None
    with pytest.raises(ValueError, match="one per replica"):
        ClusterConfig.build("m", str(tmp_path), engines=2, devices="0")
    with pytest.raises(ValueError, match="device ids"):
        ClusterConfig.build("m", str(tmp_path), devices="cuda:0")


def test_the_tcp_port_plan_never_collides_and_bounds_the_base_port(tmp_path):
    from ipc.config import ClusterConfig

    for engines, tokenizers in ((1, 1), (2, 3), (8, 40)):
        config = ClusterConfig.build(
            "m",
            str(tmp_path),
            transport="tcp",
            base_port=20000,
            engines=engines,
            tokenizer_workers=tokenizers,
        )
        addresses = [config.client_addr, config.detokenizer_addr, config.supervisor_addr]
        addresses += config.tokenizer_addrs + config.engine_addrs
        addresses += [config.engine_events_addr(r) for r in range(engines)]
        addresses += [config.engine_events_replay_addr(r) for r in range(engines)]
        ports = sorted(int(a.rsplit(":", 1)[1]) for a in addresses)
        assert ports == list(range(20000, 20000 + config.port_span))
    with pytest.raises(ValueError, match="base_port"):
        ClusterConfig.build("m", str(tmp_path), transport="tcp", base_port=65530, engines=2)
