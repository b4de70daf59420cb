"""The default CPU budget: the engine gets every core but the ones the bursty roles may keep
(at most a quarter of the machine); an explicit count is kept."""

from __future__ import annotations

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
