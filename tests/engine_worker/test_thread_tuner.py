"""The engine's per-step thread choice: probes pair adjacent steps of one kind and size, and the
faster setting wins."""

from __future__ import annotations

import os

import pytest
import torch

from engine_worker.thread_tuner import (
    FIRST_PROBE_AFTER,
    IDLE_OTHERS,
    PROBE_MAX_STEPS,
    PROBE_PAIRS,
    OtherWork,
    ThreadTuner,
)

# The other processes' CPU not known (another OS): every probe runs, whatever this machine does
UNKNOWN = lambda: None  # noqa: E731


def drive(
    tuner: ThreadTuner,
    steps: int,
    seconds_for,
    kind: str = "decode",
    size=lambda i: 4,
    leader: str | None = None,
):
    used = []
    for i in range(steps):
        threads = tuner.threads_for(kind, size(i), leader)
        used.append(threads)
        tuner.record(seconds_for(threads))
    return used


def test_a_busy_machine_moves_decode_to_one_thread_and_back_when_it_clears():
    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(2, others=UNKNOWN)
        busy = drive(tuner, FIRST_PROBE_AFTER + 5, lambda t: 0.05 if t == 2 else 0.01)
        assert busy[:FIRST_PROBE_AFTER] == [2] * FIRST_PROBE_AFTER  # all cores until measured
        # 5x slower is decisive: two pairs end the probe.
        assert sorted(busy[FIRST_PROBE_AFTER : FIRST_PROBE_AFTER + 4]) == [1, 1, 2, 2]
        assert busy[-1] == 1
        assert tuner.describe() == {"decode": 1} and tuner.switches == 1
        assert torch.get_num_threads() == 1
        # The machine gets quiet: the next probe finds all threads faster again.
        quiet = drive(tuner, FIRST_PROBE_AFTER + 5, lambda t: 0.006 if t == 2 else 0.01)
        assert quiet[: FIRST_PROBE_AFTER - 1] == [1] * (FIRST_PROBE_AFTER - 1)
        assert quiet[-1] == 2
        assert tuner.describe() == {"decode": 2} and tuner.switches == 2
    finally:
        torch.set_num_threads(before)


def test_one_thread_takes_over_only_when_clearly_faster():
    before = torch.get_num_threads()
    try:
        # All threads 15% slower: noise beside one stream's step, not a busy machine; it stays.
        tuner = ThreadTuner(2, others=UNKNOWN)
        drive(tuner, 500, lambda t: 0.0115 if t == 2 else 0.01)
        assert tuner.describe() == {"decode": 2} and tuner.switches == 0
        # 40% slower is past the margin: one thread takes over.
        drive(tuner, 500, lambda t: 0.014 if t == 2 else 0.01)
        assert tuner.describe() == {"decode": 1} and tuner.switches == 1
    finally:
        torch.set_num_threads(before)


def test_a_choice_that_keeps_winning_is_probed_less_often():
    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(2, others=UNKNOWN)
        used = drive(tuner, 2000, lambda t: 0.006 if t == 2 else 0.01)
        assert tuner.describe() == {"decode": 2} and tuner.switches == 0
        # 0.6 is decisive: probes of 2 pairs after 4, 16, 64, 256 and 1024 more steps, each
        # costing 2 steps on the slower setting.
        assert used.count(1) == 5 * 2
        close = drive(ThreadTuner(2, others=UNKNOWN), 2000, lambda t: 0.009 if t == 2 else 0.01)
        # 0.9: all 4 pairs, intervals doubling: 4, 8, ..., 512 (8 probes; the next falls past 2000).
        assert close.count(1) == 8 * PROBE_PAIRS
    finally:
        torch.set_num_threads(before)


def test_steps_of_different_sizes_or_kinds_are_never_compared():
    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(2, others=UNKNOWN)
        # Every step a different batch size: no pair ever completes, the choice stays, and the
        # probes' unpaired steps (on one thread) give up after PROBE_PAIRS steps each, their
        # intervals growing 4x: probes after 4, 16 and 64 more steps in 200.
        used = drive(tuner, 200, lambda t: 0.05 if t == 2 else 0.01, size=lambda i: i)
        assert tuner.describe() == {"decode": 2} and tuner.switches == 0
        assert used.count(1) == 3 * PROBE_PAIRS
        # Prefill steps are their own kind: decode's probe leaves them alone.
        tuner = ThreadTuner(2, others=UNKNOWN)
        drive(tuner, FIRST_PROBE_AFTER + 2 * PROBE_PAIRS, lambda t: 0.05 if t == 2 else 0.01)
        drive(tuner, 3, lambda t: 0.01, kind="prefill")
        assert tuner.describe() == {"decode": 1, "prefill": 2}
    finally:
        torch.set_num_threads(before)


def test_a_probe_whose_sizes_keep_changing_ends_within_its_step_limit():
    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(2, others=UNKNOWN)
        # Sizes repeat in runs of three: a pair forms now and then, not PROBE_PAIRS of them soon.
        used = drive(
            tuner, 200, lambda t: 0.009 if t == 2 else 0.01, size=lambda i: (i // 3) % 7 + 10
        )
        state = tuner.kinds["decode"]
        assert not state.probing or state.probe_steps < PROBE_MAX_STEPS
        assert used.count(1) < 200 // 4  # most steps stay on the choice, all threads
    finally:
        torch.set_num_threads(before)


def test_one_core_or_disabled_never_changes_the_thread_count():
    for tuner in (ThreadTuner(1), ThreadTuner(2, enabled=False)):
        used = drive(tuner, 100, lambda t: 0.05 if t == 2 else 0.01)
        assert set(used) == {tuner.max_threads}


def test_prefill_follows_decode_while_decode_keeps_all_threads():
    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(2, others=UNKNOWN)
        drive(tuner, 200, lambda t: 0.006 if t == 2 else 0.01)  # decode keeps both threads
        # Prefill steps that one thread would win: never probed while decode keeps all threads
        # (at one stream a probe's steps are requests' first tokens).
        one_wins = lambda t: 0.5 if t == 2 else 0.1  # noqa: E731
        prefill = drive(tuner, 50, one_wins, "prefill", lambda i: i % 3, leader="decode")
        assert prefill == [2] * 50 and "prefill" not in tuner.describe()
        # Between decode steps (as when requests arrive), likewise; decode's choice holds.
        mixed = []
        for _ in range(100):
            drive(tuner, 1, lambda t: 0.006 if t == 2 else 0.01)
            mixed += drive(tuner, 1, one_wins, "prefill", leader="decode")
        assert mixed == [2] * 100 and tuner.describe() == {"decode": 2}
        # The machine gets busy: decode moves to one thread, and prefill is measured again.
        drive(tuner, 3000, lambda t: 0.05 if t == 2 else 0.01)
        assert tuner.describe() == {"decode": 1}
        drive(tuner, FIRST_PROBE_AFTER + PROBE_MAX_STEPS, one_wins, "prefill", leader="decode")
        assert tuner.describe() == {"decode": 1, "prefill": 1}
    finally:
        torch.set_num_threads(before)


def test_upcoming_answers_what_the_next_step_gets_and_work_makes_sizes_comparable():
    """``upcoming`` (what the step pace sizes a prompt step for) is what ``threads_for`` then
    gives, through a probe; steps of drifting sizes compared per unit of work pair and decide:
    paced prompt steps run on all threads when those are 1.7x faster per token-key."""
    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(2, others=UNKNOWN)
        for i in range(60):
            expected = tuner.upcoming("prefill", 0)
            threads = tuner.threads_for("prefill", 0)
            assert threads == expected, i
            keys = 200_000 + 7_000 * (i % 5) if threads == 2 else 100_000 + 3_000 * (i % 3)
            tuner.record(keys * (1e-6 if threads == 2 else 1.7e-6), work=keys)
        assert tuner.describe() == {"prefill": 2} and tuner.switches == 0
        assert tuner.kinds["prefill"].interval > FIRST_PROBE_AFTER  # probes decided, less often
    finally:
        torch.set_num_threads(before)


def test_an_idle_machine_skips_the_probes_of_a_kind_on_all_threads():
    """Other processes idle (under IDLE_OTHERS of a core): a probe has nothing to find, so a
    kind on all threads never runs a step on one thread, each skipped probe waiting four times
    longer; others busy, the probes run as before; and a kind already on one thread still
    probes on an idle machine, to come back."""
    before = torch.get_num_threads()
    try:
        idle = ThreadTuner(2, others=lambda: IDLE_OTHERS / 2)
        used = drive(idle, 400, lambda t: 0.01 if t == 2 else 0.016)
        assert set(used) == {2} and idle.skipped == 4  # at steps 4, 20, 84, 340
        busy = ThreadTuner(2, others=lambda: 0.5)
        assert 1 in drive(busy, 400, lambda t: 0.01 if t == 2 else 0.016) and busy.skipped == 0
        looks = iter([0.5] * 3 + [0.0] * 1000)  # busy at first: one thread wins, then idle
        back = ThreadTuner(2, others=lambda: next(looks))
        drive(back, FIRST_PROBE_AFTER + 5, lambda t: 0.05 if t == 2 else 0.01)
        assert back.describe() == {"decode": 1}
        drive(back, 40, lambda t: 0.006 if t == 2 else 0.01)
        assert back.describe() == {"decode": 2}  # (its next probes: skipped, idle)
    finally:
        torch.set_num_threads(before)


def test_other_work_counts_another_process_cpu():
    """A child spinning a core for a second is other work (at least 0.3 of a core even beside
    a parallel test worker); our own spin before it is not counted as more than the machine's
    other processes can have used (two cores: under 2)."""
    import subprocess
    import sys
    import time

    others = OtherWork()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.3:
        sum(range(1000))
    ours = others()
    code = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1: pass"
    subprocess.run([sys.executable, "-c", code], check=True)
    theirs = others()
    if ours is None or theirs is None:
        pytest.skip("no /proc here")
    assert 0 <= ours < (os.cpu_count() or 2) and theirs >= 0.3, (ours, theirs)
