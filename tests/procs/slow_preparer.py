"""A request preparer that takes DELAY_S per batch, for tests proving that submit() never
waits for tokenization (the cluster's preparer_factory: tests.procs.slow_preparer:make)."""

from __future__ import annotations

import dataclasses
import time

from tokenizer_worker.prepare import RequestPreparer
from tokenizer_worker.worker import make_preparer

DELAY_S = 0.4


class SlowPreparer(RequestPreparer):
    def prepare_batch(self, requests):
        time.sleep(DELAY_S)
        return super().prepare_batch(requests)


def make(config, index: int) -> SlowPreparer:
    base = make_preparer(dataclasses.replace(config, preparer_factory=""), index)
    return SlowPreparer(
        base.tokenizer, base.chat_template, base.limits, base.tokenizer_index, base.structured
    )
