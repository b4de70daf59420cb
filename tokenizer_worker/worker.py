"""The tokenizer process: pull SubmitRequests, batch-encode whatever is queued at once, push
TokenizedRequests to the engine and RequestErrors to the detokenizer. TokenizeRequests (the
/tokenize, /detokenize and /tokenizer_info queries) arrive on the same socket and are answered
through the detokenizer, which routes the TokenizeResult to the client."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import zmq

from ipc.codec import DecodeError, salvage_fields
from ipc.config import ClusterConfig
from ipc.messages import ERR_BAD_REQUEST, ERR_UNAVAILABLE, RequestError, SubmitRequest
from ipc.queries import TokenizeRequest
from ipc.sockets import PullQueue, PushQueue
from runtime.factories import load_factory
from runtime.memory import IdleTrim
from runtime.model_files import load_tokenizer
from runtime.worker import WorkerRuntime, run_on_context
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.prepare import Limits, RequestPreparer
from tokenizer_worker.queries import TokenizerQueries
from tokenizer_worker.structured import StructuredOutputs
from tokenizer_worker.vocabulary_sender import VocabularySender

logger = logging.getLogger("splitserve.tokenizer")


def model_limits(config: ClusterConfig) -> Limits:
    """The engine's resolved values when the supervisor filled them in, else the model's own."""
    model_config = json.loads((Path(config.model_path) / "config.json").read_text())
    max_len = config.engine.max_model_len or int(model_config.get("max_position_embeddings", 2048))
    vocab = config.vocab_size or int(model_config["vocab_size"])
    return Limits(max_model_len=max_len, vocab_size=vocab)


def make_preparer(config: ClusterConfig, index: int) -> RequestPreparer:
    if config.preparer_factory:  # a test seam: e.g. a deliberately slow preparer
        return load_factory(config.preparer_factory)(config, index)
    tokenizer = load_tokenizer(config.model_path)
    template = ChatTemplate.from_model_dir(config.model_path)
    limits = model_limits(config)
    structured = StructuredOutputs(tokenizer, limits.vocab_size, template, model_eos_ids(config))
    structured.start()  # the vocabulary is read in the background, ready for the first grammar
    return RequestPreparer(
        tokenizer, template, limits, tokenizer_index=index, structured=structured
    )


def model_eos_ids(config: ClusterConfig) -> list[int]:
    value = json.loads((Path(config.model_path) / "config.json").read_text()).get("eos_token_id")
    return [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]


class TokenizerWorker:
    def __init__(self, config: ClusterConfig, index: int, ctx: zmq.Context) -> None:
        self.config, self.index = config, index
        self.runtime = WorkerRuntime("tokenizer", index, config, ctx)
        self.preparer = make_preparer(config, index)
        self.queries = TokenizerQueries.from_preparer(self.preparer, config.model_path)
        # A small receive queue: when it fills, clients' round-robin skips this worker and, once
        # every worker is full, submit() raises OverloadedError instead of queueing without bound.
        self.inbox: PullQueue[SubmitRequest | TokenizeRequest] = PullQueue(
            ctx,
            config.tokenizer_addr(index),
            SubmitRequest,
            TokenizeRequest,
            hwm=config.tokenizer_queue_max,
            curve=config.curve,
        )
        self.to_engine = PushQueue(ctx, config.engine_addr, curve=config.curve)
        self.to_detok = PushQueue(ctx, config.detokenizer_addr, curve=config.curve)
        self.vocabulary = VocabularySender(self.to_engine, self.preparer.structured)
        self.served = 0
        self.rejected = 0
        self.answered = 0  # TokenizeRequests
        self.tokenize_s = 0.0
        self.trim = IdleTrim()

    def run(self) -> None:
        self.runtime.announce([self.inbox.address])
        while not self.runtime.stopping:
            self.runtime.maybe_heartbeat(self._stats())
            self.vocabulary.poll()
            if not self.inbox.wait(min(self.runtime.heartbeat_due_in_ms(), 100)):
                self.trim.idle()  # nothing came: hand back what the last batch freed
                continue
            self.handle(self.inbox.drain(self.config.tokenizer_batch_max, self._reject_frame))
            self.trim.busy()
        # Stopping: answer whatever is still queued, so no accepted request goes silent.
        self.runtime.draining = True
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            messages = self.inbox.drain(self.config.tokenizer_batch_max, self._reject_frame)
            if messages:
                self.handle(messages)
            else:
                time.sleep(0.01)
        self.close()

    def handle(self, messages: list[SubmitRequest | TokenizeRequest]) -> None:
        requests: list[SubmitRequest] = []
        queries: list[TokenizeRequest] = []
        for msg in messages:
            if isinstance(msg, TokenizeRequest):
                queries.append(msg)
            else:
                requests.append(msg)
        if queries:
            self.answer_queries(queries)
        if not requests:
            return
        if self.runtime.draining:
            for req in requests:
                self._send_error(
                    RequestError(
                        req.request_id,
                        req.client_id,
                        "unavailable: the cluster is shutting down",
                        ERR_UNAVAILABLE,
                        req.t_submit,
                    )
                )
            return
        t0 = time.monotonic()
        results = self.preparer.prepare_batch(requests)
        self.tokenize_s += time.monotonic() - t0
        for result in results:
            if isinstance(result, RequestError):
                self._send_error(result)
            else:
                if result.grammar:
                    self.vocabulary.before_constrained_request()
                self.to_engine.put(result)
                self.served += 1

    def answer_queries(self, queries: list[TokenizeRequest]) -> None:
        for query in queries:
            if self.runtime.draining:
                self._send_error(
                    RequestError(
                        query.request_id,
                        query.client_id,
                        "unavailable: the cluster is shutting down",
                        ERR_UNAVAILABLE,
                        query.t_submit,
                    )
                )
                continue
            answer = self.queries.answer(query)
            if isinstance(answer, RequestError):
                self._send_error(answer)
            else:
                self.to_detok.put(answer)
                self.answered += 1

    def _reject_frame(self, frame: bytes, exc: DecodeError) -> None:
        found = salvage_fields(frame, "request_id", "client_id")
        rid, cid = found.get("request_id"), found.get("client_id")
        if isinstance(rid, str) and rid and isinstance(cid, bytes) and cid:
            self._send_error(RequestError(rid, cid, f"malformed request: {exc}", ERR_BAD_REQUEST))
        else:
            logger.warning("dropped a malformed frame nobody can be told about: %s", exc)

    def _send_error(self, err: RequestError) -> None:
        self.rejected += 1
        self.to_detok.put(err)

    def _stats(self) -> dict[str, float]:
        return {
            "served": self.served,
            "rejected": self.rejected,
            "answered": self.answered,
            "tokenize_s": self.tokenize_s,
            "draining": float(self.runtime.draining),
            "memory_trims": self.trim.trims,
        }

    def close(self) -> None:
        self.vocabulary.close()
        for q in (self.inbox, self.to_engine, self.to_detok):
            q.close()
        self.runtime.close()


def main(config: ClusterConfig, index: int) -> None:
    run_on_context(lambda ctx: TokenizerWorker(config, index, ctx))
