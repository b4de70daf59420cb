"""The engine's per-step thread choice: probes pair adjacent steps of one kind and size, and the
faster setting wins."""

from __future__ import annotations

import torch

from engine_worker.thread_tuner import FIRST_PROBE_AFTER, PROBE_MAX_STEPS, PROBE_PAIRS, ThreadTuner


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
        tuner = ThreadTuner(2)
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
        tuner = ThreadTuner(2)
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
        tuner = ThreadTuner(2)
        used = drive(tuner, 2000, lambda t: 0.006 if t == 2 else 0.01)
        assert tuner.describe() == {"decode": 2} and tuner.switches == 0
        # 0.6 is decisive: probes of 2 pairs after 4, 16, 64, 256 and 1024 more steps, each
        # costing 2 steps on the slower setting.
        assert used.count(1) == 5 * 2
        close = drive(ThreadTuner(2), 2000, lambda t: 0.009 if t == 2 else 0.01)
        # 0.9: all 4 pairs, intervals doubling: 4, 8, ..., 512 (8 probes; the next falls past 2000).
        assert close.count(1) == 8 * PROBE_PAIRS
    finally:
        torch.set_num_threads(before)


def test_steps_of_different_sizes_or_kinds_are_never_compared():
    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(2)
        # Every step a different batch size: no pair ever completes, the choice stays, and the
        # probes' unpaired steps (on one thread) give up after PROBE_PAIRS steps each, their
        # intervals growing 4x: probes after 4, 16 and 64 more steps in 200.
        used = drive(tuner, 200, lambda t: 0.05 if t == 2 else 0.01, size=lambda i: i)
        assert tuner.describe() == {"decode": 2} and tuner.switches == 0
        assert used.count(1) == 3 * PROBE_PAIRS
        # Prefill steps are their own kind: decode's probe leaves them alone.
        tuner = ThreadTuner(2)
        drive(tuner, FIRST_PROBE_AFTER + 2 * PROBE_PAIRS, lambda t: 0.05 if t == 2 else 0.01)
        drive(tuner, 3, lambda t: 0.01, kind="prefill")
        assert tuner.describe() == {"decode": 1, "prefill": 2}
    finally:
        torch.set_num_threads(before)


def test_a_probe_whose_sizes_keep_changing_ends_within_its_step_limit():
    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner(2)
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
        tuner = ThreadTuner(2)
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
        tuner = ThreadTuner(2)
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
