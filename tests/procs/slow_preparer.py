"""A request preparer that takes DELAY_S per batch, for tests proving that submit() never
waits for tokenization (the cluster's preparer_factory: tests.procs.slow_preparer:make)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from tokenizer_worker.prepare import RequestPreparer
from tokenizer_worker.worker import make_preparer

DELAY_S = 0.4


class SlowPreparer(RequestPreparer):
    def encode(self, batch, t_start=None):  # the worker encodes what it screened
        time.sleep(DELAY_S)
        return super().encode(batch, t_start)


def make(config, index: int) -> SlowPreparer:
    base = make_preparer(dataclasses.replace(config, preparer_factory=""), index)
    return SlowPreparer(
        base.tokenizer, base.chat_template, base.limits, base.tokenizer_index, base.structured
    )


GATE_FILE = "release-long-prompts"  # in the run directory: once it exists, long prompts encode


class GatedPreparer(RequestPreparer):
    """Encodes a batch holding a text longer than the cluster's tokenizer_long_prompt_chars
    only once the test has created GATE_FILE (at most 60 s): a long prompt that stays in
    tokenization for as long as the test needs, with the real tokenizer underneath."""

    def __init__(self, *args, gate: Path, long_chars: int) -> None:
        super().__init__(*args)
        self.gate, self.long_chars = gate, long_chars

    def encode(self, batch, t_start=None):
        if any(s.chars > self.long_chars for s in batch):
            deadline = time.monotonic() + 60
            while not self.gate.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().encode(batch, t_start)


def make_gated(config, index: int) -> GatedPreparer:
    base = make_preparer(dataclasses.replace(config, preparer_factory=""), index)
    return GatedPreparer(
        base.tokenizer,
        base.chat_template,
        base.limits,
        base.tokenizer_index,
        base.structured,
        gate=Path(config.run_dir) / GATE_FILE,
        long_chars=config.tokenizer_long_prompt_chars,
    )
