"""The engine: owns the model, the paged KV cache, the prefix cache and the scheduler.

One ``step()`` = schedule (the scheduler), run (one forward over every scheduled token, and
sampling), update (the scheduler applies the result), emit (one columnar ``StepOutput`` for all
requests). The engine sees only token ids, never text."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from engine_worker.aborts import AbortBook
from engine_worker.block_manager import KVBlockManager
from engine_worker.cache_events import CacheEventRecorder
from engine_worker.device import resolve_device, resolve_prefill_budget
from engine_worker.grammar_requests import GrammarRequests
from engine_worker.idle_window import IdleBatchWindow
from engine_worker.interface import EngineLoad, EngineOverloaded
from engine_worker.model import LlamaFamilyModel
from engine_worker.model_config import ModelConfig
from engine_worker.model_runner import ModelRunner, StepResult
from engine_worker.prefix_cache import PrefixCache
from engine_worker.request import EngineRequest, checked_prompt
from engine_worker.sampler import RequestSampler
from engine_worker.scheduler import ScheduledBatch, Scheduler, StepUpdate
from engine_worker.sizing import (
    default_weight_format,
    fit_to_kv_cache,
    kv_cache_blocks,
    resolve_max_model_len,
)
from engine_worker.speculative import SpeculationCounters
from engine_worker.thread_tuner import ThreadTuner
from engine_worker.weight_format import WeightFormat
from ipc.block_hash import check_cache_salt
from ipc.codec import pack_ids
from ipc.engine_config import EngineConfig
from ipc.kv_events import MEDIUM_CPU, MEDIUM_GPU, KVCacheEvent
from ipc.messages import (
    FINISH_ABORT,
    EngineStats,
    FinishRecord,
    RequestStart,
    SamplingParams,
    StepOutput,
)
from ipc.structured import GrammarVocabulary

logger = logging.getLogger("splitserve.engine")

# Prompt logprobs need a row of logits per prompt position: a step computes at most this many
# logits for them (64 Mi floats, 256 MiB in float32), i.e. ~1,365 positions of a 49k vocabulary.
PROMPT_LOGITS_PER_STEP = 1 << 26


class Engine:
    """Satisfies ``engine_worker.interface.EngineLike``; the constructor only assembles: each
    decision it needs (device and dtype, context length, weight format, KV cache size) is a
    function below it."""

    def __init__(
        self,
        config: EngineConfig,
        weight_format: WeightFormat | None = None,
        *,
        cache_events: bool = False,
    ) -> None:
        """``weight_format`` overrides the one ``config.weights`` describes (tests build a
        dequantized reference with it). ``cache_events``: record what the prefix cache stores
        and evicts, for ``take_cache_events`` (the engine process publishes them)."""
        if config.engine_threads:
            torch.set_num_threads(config.engine_threads)
        self.device = resolve_device(config.device)
        self.config = config = resolve_prefill_budget(config, self.device)
        self.model_config = model_config = ModelConfig.from_dir(config.model_path)
        self.max_model_len = resolve_max_model_len(config, model_config)
        if weight_format is None:
            weight_format = default_weight_format(config, model_config, self.device)
        model = LlamaFamilyModel.load(
            config.model_path, self.device, weight_format.dtype, self.max_model_len, weight_format
        )
        model.use_scripted_decode(config.scripted_decode)
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = set(model_config.eos_token_ids)
        self.model_name = config.served_model_name or os.path.basename(
            os.path.normpath(config.model_path)
        )
        num_blocks = kv_cache_blocks(
            config, model_config, weight_format.dtype, self.device, self.max_model_len
        )
        self.max_model_len = fit_to_kv_cache(self.max_model_len, num_blocks * config.block_size)
        self._assemble(model, num_blocks, cache_events)
        self._log_ready(weight_format, num_blocks)

    def _assemble(self, model: LlamaFamilyModel, num_blocks: int, cache_events: bool) -> None:
        """The parts around the model: caches, runner, scheduler, and the loop's bookkeeping."""
        config = self.config
        medium = MEDIUM_GPU if self.device.type == "cuda" else MEDIUM_CPU
        self.cache_events = CacheEventRecorder(config.block_size, medium) if cache_events else None
        self.prefix_cache = (
            PrefixCache(config.block_size, self.cache_events)
            if config.enable_prefix_cache
            else None
        )
        self.blocks = KVBlockManager(num_blocks, config.block_size, self.prefix_cache)
        self.runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            config.decode_workspace_max_bytes,
            whole_key_blocks=config.deterministic,  # a row's key columns by itself alone
        )
        logprob_rows = max(config.block_size, PROMPT_LOGITS_PER_STEP // self.vocab_size)
        self.scheduler = Scheduler(
            config, self.blocks, self.prefix_cache, logprob_rows, self.runner.kv_cache.copy_slots
        )
        self.threads = ThreadTuner(
            torch.get_num_threads(), config.adaptive_threads and self.device.type == "cpu"
        )
        self._decode_kind: str | None = None  # the kind of the newest decode-only step
        self.requests: dict[str, EngineRequest] = {}
        self.grammars = GrammarRequests(sorted(self.eos_token_ids))  # constrained requests
        self.idle_window = IdleBatchWindow(
            config.idle_batch_window_ms / 1e3,
            config.idle_batch_window_step_fraction,
            config.prefill_max_batch_size,
        )
        self.aborts = AbortBook()
        self._step = 0
        # Counters since start, reported with every step's stats (Prometheus counters).
        self._prefix_queried_total = self._prefix_hit_total = self._preemptions_total = 0

    def _log_ready(self, weight_format: WeightFormat, num_blocks: int) -> None:
        config = self.config
        logger.info(
            "engine ready: model=%s device=%s dtype=%s %s threads=%d kv_blocks=%d x %d "
            "tokens max_model_len=%d prefill_max_tokens=%d prefill_max_token_keys=%d "
            "prefill_step_target_ms=%d prefix_cache=%s attention=%s",
            self.model_name,
            self.device,
            weight_format.dtype,
            weight_format.describe(),
            torch.get_num_threads(),
            num_blocks,
            config.block_size,
            self.max_model_len,
            config.prefill_max_tokens,
            config.prefill_max_token_keys,
            config.prefill_step_target_ms,
            config.enable_prefix_cache,
            self.runner.attention.name,
        )

    # --- public API -------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def speculation(self) -> SpeculationCounters:
        return self.scheduler.speculation

    def has_work(self) -> bool:
        """Whether a step would do anything (a request whose grammar is being built, or whose
        late grammar mask is being computed, is not work yet: see ``wakeup_fd``)."""
        self.grammars.settle()
        return bool(
            self.aborts.pending()
            or self.grammars.finished
            or self.scheduler.has_ready(unready_waiting=len(self.grammars.building))
        )

    @property
    def wakeup_fd(self) -> int:
        """Readable when a grammar build ended: poll it with the inbox while idle."""
        return self.grammars.wakeup_fd

    def set_grammar_vocabulary(self, vocabulary: GrammarVocabulary) -> bool:
        return self.grammars.set_vocabulary(vocabulary)

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        sampling: SamplingParams,
        arrival_time: float | None = None,
        grammar: str = "",
        cache_salt: str | None = None,
    ) -> None:
        """``grammar``: the Lark text the output must follow (see ipc.messages.TokenizedRequest);
        its matcher is built in the background and the request waits for it. ``cache_salt``:
        the request shares cached blocks only with requests of the same salt."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running or waiting")
        if self.aborts.arrived(request_id):  # aborted on its way here: it ends at once
            return
        ids = checked_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        check_cache_salt(cache_salt)
        if self.scheduler.num_waiting >= self.config.max_waiting_requests:
            raise EngineOverloaded(
                f"{self.scheduler.num_waiting} requests are already waiting "
                f"(max_waiting_requests={self.config.max_waiting_requests})"
            )
        stop_ids = frozenset(sampling.stop_token_ids) | (
            frozenset() if sampling.ignore_eos else frozenset(self.eos_token_ids)
        )
        request = EngineRequest(
            request_id,
            ids.tolist(),
            sampling,
            RequestSampler(sampling, self.device, stop_ids),
            stop_ids,
            self.max_model_len,
            time.monotonic() if arrival_time is None else arrival_time,
            cache_salt,
        )
        if grammar:
            self.grammars.attach(request, grammar)
        was_idle = self.scheduler.is_idle()
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.idle_window.on_arrival(
            time.monotonic(), was_idle, self.scheduler.first_step_tokens(request) if was_idle else 0
        )

    def step_delay_s(self) -> float:
        """How long the caller's loop should still wait for more arrivals before ``step()``
        (0: step now). Non-zero only in the idle batching window after a request reached an
        idle engine; the loop waits for input meanwhile and asks again."""
        return self.idle_window.remaining_s(time.monotonic(), self.scheduler.num_waiting)

    def abort(self, request_id: str) -> None:
        self.aborts.abort(request_id, live=request_id in self.requests)

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=self.num_running,
            waiting=self.num_waiting,
            kv_blocks_total=self.blocks.num_blocks,
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_available=self.blocks.num_available,
            grammar_rows_deferred=self.grammars.deferred_rows,
        )

    def take_cache_events(self) -> list[KVCacheEvent]:
        """What the prefix cache stored and evicted since the last call (AllBlocksCleared
        first, after start); empty unless built with ``cache_events``."""
        return self.cache_events.take() if self.cache_events is not None else []

    def step(self) -> StepOutput:
        """Schedule, run, update, emit (the order of a step: docs/architecture.md): one
        StepOutput for every request touched."""
        t_start = time.monotonic()
        out = self._open_step(t_start)
        batch = self.scheduler.schedule()
        result = self._run(batch) if batch.requests else None
        update = self.scheduler.update_from_output(batch, result)
        self._emit(out, update)
        self._close_step(out, batch, t_start)
        return out

    def close(self) -> None:
        """Stops the grammar threads (the engine process calls this on its way out)."""
        self.grammars.close()

    # --- internals --------------------------------------------------------------------------
    def _run(self, batch: ScheduledBatch) -> StepResult:
        """The forward and sampling, on the thread count the tuner picks for this kind of step
        (decode steps by their power-of-two batch-size bucket, compared at equal batch sizes:
        the other processes on the cores weigh differently on a batch-1 step than on a batch-32
        one; prefill steps by their power-of-two token bucket, all threads while the newest
        decode steps keep them: ThreadTuner's leader)."""
        leader, work = None, 1.0
        if batch.prefill_tokens or not batch.decode_tokens:  # (none: kept prompt ends only)
            kind, size = "prefill", self._prefill_size(batch.prefill_tokens + batch.decode_tokens)
            leader = self._decode_kind
            work = float(batch.token_keys) if self._paced else 1.0
        else:
            kind = self._decode_kind = f"decode{1 << (batch.decode_tokens.bit_length() - 1)}+"
            size = batch.decode_tokens
        switches = self.threads.switches
        self.threads.threads_for(kind, size, leader)
        t_start = time.perf_counter()
        result = self.runner.run(batch.requests, batch.num_new_tokens, batch.kept_ends)
        seconds = time.perf_counter() - t_start
        self.threads.record(seconds, work)
        pace = self.scheduler.pace
        pace.observe(batch.token_keys, batch.prefill_tokens, seconds, torch.get_num_threads())
        if self.threads.switches != switches:
            logger.info("torch threads per kind of step now %s (measured)", self.threads.describe())
        return result

    @property
    def _paced(self) -> bool:
        return self.scheduler.pace.target_s > 0

    def _prefill_size(self, tokens: int) -> int:
        """The size a prompt step is compared at by the thread tuner: its token bucket, or,
        paced, one size for all (their time per token-key is compared: paced steps' token
        counts drift as their prompts' contexts grow, and unpaired probes never decided)."""
        return 0 if self._paced else tokens.bit_length()

    def _open_step(self, t_start: float) -> StepOutput:
        """A new step's output, with the requests that end before it schedules: those aborted
        since the last step (and those aborted before they arrived), and those their grammar
        ended."""
        self.idle_window.close()
        # The threads a prompt step would run on now: the pace sizes its prompt work for them.
        self.scheduler.pace.threads = self.threads.upcoming(
            "prefill", self._prefill_size(0), self._decode_kind
        )
        self._step += 1
        out = StepOutput(step=self._step, t_step=t_start)
        arrived_aborted, live = self.aborts.take()
        out.finished.extend(FinishRecord(rid, FINISH_ABORT) for rid in arrived_aborted)
        for request_id in live:
            self._finish(out, self.requests[request_id], FINISH_ABORT)
        self.grammars.settle()
        for request, reason, error, code in self.grammars.take_finished():
            self._finish(out, request, reason, error, code)
        return out

    def _emit(self, out: StepOutput, update: StepUpdate) -> None:
        """What the scheduler's update says, into the step's output; the grammars hear of the
        requests deferred, ended, and of each constrained request's sampled token."""
        out.prompt_logprobs = update.prompt_logprobs  # always ahead of the request's tokens
        out.request_ids, out.logprobs = update.request_ids, update.logprobs
        out.token_ids = pack_ids(update.tokens)
        for request in update.deferred:
            self.grammars.defer(request)
        out.started.extend(
            RequestStart(r.request_id, r.t_arrived, r.t_scheduled, r.cached_tokens)
            for r in update.started
        )
        for request, reason, error, code in update.finished:
            self._forget(out, request, reason, error, code)
        self.grammars.advance(update.constrained)

    def _close_step(self, out: StepOutput, batch: ScheduledBatch, t_start: float) -> None:
        if self.scheduler.num_running == 0:
            self.runner.reset()  # idle: hold nothing kept between steps (the decode KV copy)
        out.t_step = time.monotonic()
        self.idle_window.observe_step(out.t_step - t_start, batch.prefill_tokens)
        out.stats = self._stats(batch, (out.t_step - t_start) * 1000.0)

    def _finish(
        self, out: StepOutput, request: EngineRequest, reason: str, error: str = "", code: str = ""
    ) -> None:
        """Ends a request the scheduler still holds (aborted, or ended by its grammar)."""
        self.scheduler.remove(request)
        self._forget(out, request, reason, error, code)

    def _forget(
        self, out: StepOutput, request: EngineRequest, reason: str, error: str, code: str
    ) -> None:
        self.grammars.forget(request)
        del self.requests[request.request_id]
        out.finished.append(FinishRecord(request.request_id, reason, error, code))

    def _stats(self, batch: ScheduledBatch, step_ms: float) -> EngineStats:
        self._prefix_queried_total += batch.queried_tokens
        self._prefix_hit_total += batch.cached_tokens
        self._preemptions_total += batch.preempted
        return EngineStats(
            running=self.num_running,
            waiting=self.num_waiting,
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_total=self.blocks.num_blocks,
            prefill_tokens=batch.prefill_tokens,
            cached_tokens=batch.cached_tokens,
            decode_tokens=batch.decode_tokens,
            preempted=batch.preempted,
            step_ms=step_ms,
            threads=torch.get_num_threads() if batch.requests else 0,  # the tuner set them
            prefix_queried_tokens_total=self._prefix_queried_total,
            prefix_hit_tokens_total=self._prefix_hit_total,
            preemptions_total=self._preemptions_total,
            spec_drafts_total=self.speculation.drafts,
            spec_draft_tokens_total=self.speculation.draft_tokens,
            spec_accepted_tokens_total=self.speculation.accepted_tokens,
            spec_accepted_per_position_total=list(self.speculation.accepted_per_position),
            **self.runner.expert_stats(),
        )
