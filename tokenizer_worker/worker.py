"""The tokenizer process: pull SubmitRequests, batch-encode whatever is queued at once, push
TokenizedRequests to the engine and RequestErrors to the detokenizer. TokenizeRequests (the
/tokenize, /detokenize and /tokenizer_info queries) arrive on the same socket and are answered
through the detokenizer, which routes the TokenizeResult to the client.

A prompt longer than ``tokenizer_long_prompt_chars`` is encoded on the long-prompt lane's thread
(long_prompts.py) while the loop goes on with the others; its result comes back to the loop,
which routes and sends it like any other. One that no tokenization could fit is refused before
that, unread (prompt_bound.py).

With several engine replicas each request goes to the one ``ReplicaRouting`` (routing.py)
picks; the supervisor's ClusterNotices about replicas arrive on the same socket. With one engine
nothing of that runs: no hashing, no event subscription."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import zmq

from ipc.codec import DecodeError
from ipc.config import ClusterConfig
from ipc.messages import (
    ERR_BAD_REQUEST,
    ERR_OVERLOADED,
    ERR_UNAVAILABLE,
    ClusterNotice,
    RequestError,
    SubmitRequest,
    TokenizedRequest,
)
from ipc.messages.queries import TokenizeRequest
from ipc.salvage import salvage_fields
from ipc.sockets import PullQueue, PushQueue
from runtime.factories import load_factory
from runtime.memory import IdleTrim
from runtime.model_files import load_tokenizer
from runtime.worker import WorkerRuntime, run_on_context
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.long_prompts import LongPromptLane
from tokenizer_worker.prepare import Limits, RequestPreparer
from tokenizer_worker.query_answers import TokenizerQueries
from tokenizer_worker.reasoning import choose_reasoning_parser
from tokenizer_worker.routing import ReplicaRouting
from tokenizer_worker.structured import StructuredOutputs
from tokenizer_worker.vocabulary_sender import VocabularySender

logger = logging.getLogger("splitserve.tokenizer")


def model_limits(config: ClusterConfig) -> Limits:
    """The engine's resolved values when the supervisor filled them in, else the model's own."""
    model_config = json.loads((Path(config.model_path) / "config.json").read_text())
    max_len = config.engine.max_model_len or int(model_config.get("max_position_embeddings", 2048))
    vocab = config.vocab_size or int(model_config["vocab_size"])
    return Limits(
        max_model_len=max_len, vocab_size=vocab, max_default_tokens=config.max_default_tokens
    )


def make_preparer(config: ClusterConfig, index: int) -> RequestPreparer:
    if config.preparer_factory:  # a test seam: e.g. a deliberately slow preparer
        return load_factory(config.preparer_factory)(config, index)
    return build_preparer(
        config.model_path,
        model_limits(config),
        index,
        tool_call_parser=config.tool_call_parser,
        chat_template=config.chat_template,
        reasoning_parser=config.reasoning_parser,
    )


def build_preparer(
    model_path: str,
    limits: Limits,
    index: int = 0,
    *,
    tool_call_parser: str = "auto",
    chat_template: str = "",
    reasoning_parser: str = "auto",
) -> RequestPreparer:
    """The model's tokenizer, chat template and structured outputs, as a tokenizer worker
    prepares requests with them (so does an ingress replica of the Ray Serve application)."""
    tokenizer = load_tokenizer(model_path)
    template = ChatTemplate.from_model_dir(model_path, chat_template)
    eos_ids = model_eos_ids(model_path)
    structured = StructuredOutputs(
        tokenizer, limits.vocab_size, template, eos_ids, tool_call_parser=tool_call_parser
    )
    return RequestPreparer(
        tokenizer,
        template,
        limits,
        tokenizer_index=index,
        structured=structured,
        reasoning_parser=choose_reasoning_parser(template, reasoning_parser),
    )


def model_eos_ids(model_path: str) -> list[int]:
    value = json.loads((Path(model_path) / "config.json").read_text()).get("eos_token_id")
    return [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]


class TokenizerWorker:
    def __init__(self, config: ClusterConfig, index: int, ctx: zmq.Context) -> None:
        self.config, self.index = config, index
        self.runtime = WorkerRuntime("tokenizer", index, config, ctx)
        self.preparer = make_preparer(config, index)
        self.queries = TokenizerQueries.from_preparer(self.preparer, config.model_path)
        # A small receive queue: when it fills, clients' round-robin skips this worker and, once
        # every worker is full, submit() raises OverloadedError instead of queueing without bound.
        self.inbox: PullQueue[SubmitRequest | TokenizeRequest | ClusterNotice] = PullQueue(
            ctx,
            config.tokenizer_addr(index),
            SubmitRequest,
            TokenizeRequest,
            ClusterNotice,
            hwm=config.tokenizer_queue_max,
            curve=config.curve,
        )
        self.to_engines = [PushQueue(ctx, a, curve=config.curve) for a in config.engine_addrs]
        self.to_detok = PushQueue(ctx, config.detokenizer_addr, curve=config.curve)
        # Each replica gets the grammar vocabulary on its own socket (engine_worker builds
        # grammars against it).
        self.vocabularies = [VocabularySender(q, self.preparer.structured) for q in self.to_engines]
        self.routing = ReplicaRouting(config, index, ctx) if config.routes else None
        # Long prompts are encoded beside the loop (tokenizer_worker.long_prompts).
        self.lane = LongPromptLane(self.preparer.encode, config.background_niceness)
        self.poller = zmq.Poller()
        self.polled: list[zmq.Socket | int] = []
        self.served = 0
        self.rejected = 0
        self.answered = 0  # TokenizeRequests
        self.tokenize_s = 0.0
        self.trim = IdleTrim()

    def run(self) -> None:
        self.runtime.announce([self.inbox.address])
        # The grammar vocabulary is read in the background, ready for the first grammar; once
        # ready is said (on the same core, its thread would slow this worker's own start).
        self.preparer.structured.start()
        while not self.runtime.stopping:
            self.runtime.maybe_heartbeat(self._stats)
            for vocabulary in self.vocabularies:
                vocabulary.poll()
            inbox = self.wait(min(self.runtime.heartbeat_due_in_ms(), 100))
            self.deliver(self.lane.take())
            if not inbox:
                if not self.lane.queued:
                    self.trim.idle()  # nothing came: hand back what the last batch freed
                continue
            self.handle(self.inbox.drain(self.config.tokenizer_batch_max, self._reject_frame))
            self.trim.busy()
        # Stopping: answer whatever is still queued, so no accepted request goes silent.
        self.runtime.draining = True
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            self.deliver(self.lane.take())
            messages = self.inbox.drain(self.config.tokenizer_batch_max, self._reject_frame)
            if messages:
                self.handle(messages)
            else:
                time.sleep(0.01)
        self.deliver(self.lane.take())
        for screened in self.lane.close():  # still encoding: ends unanswered, so say so
            self._send_error(self._unavailable(screened.request))
        self.close()

    def wait(self, timeout_ms: int) -> bool:
        """Whether the inbox has something (or, returning early, the long-prompt lane). With
        routing, replicas' events that arrive meanwhile are applied as they come (off the path
        of the next request)."""
        sockets: list[zmq.Socket | int] = [self.inbox.socket, self.lane.fd]
        if self.routing is not None:
            self.routing.receive()
            sockets += self.routing.sockets
        if sockets != self.polled:  # a subscriber opened a replay socket, or closed one
            self.poller = zmq.Poller()
            for sock in sockets:
                self.poller.register(sock, zmq.POLLIN)
            self.polled = sockets
        return self.inbox.socket in dict(self.poller.poll(timeout_ms))

    def handle(self, messages: list[SubmitRequest | TokenizeRequest | ClusterNotice]) -> None:
        requests: list[SubmitRequest] = []
        queries: list[TokenizeRequest] = []
        for msg in messages:
            if isinstance(msg, TokenizeRequest):
                queries.append(msg)
            elif isinstance(msg, ClusterNotice):
                if self.routing is not None:
                    self.routing.on_notice(msg)
            else:
                requests.append(msg)
        if queries:
            self.answer_queries(queries)
        if not requests:
            return
        if self.runtime.draining:
            for req in requests:
                self._send_error(self._unavailable(req))
            return
        t0 = time.monotonic()
        now = []
        for screened in map(self.preparer.screen, requests):
            if screened.chars <= self.config.tokenizer_long_prompt_chars:
                now.append(screened)
            elif not self.lane.submit(screened):
                req = screened.request
                self._send_error(
                    RequestError(
                        req.request_id,
                        req.client_id,
                        "overloaded: too many long prompts are being tokenized; retry later",
                        ERR_OVERLOADED,
                        req.t_submit,
                    )
                )
        results = self.preparer.encode(now, t0) if now else []
        self.tokenize_s += time.monotonic() - t0
        self.deliver(results)

    def deliver(self, results: list[TokenizedRequest | RequestError]) -> None:
        if not results:
            return
        if self.routing is not None:
            self.routing.receive()  # the replicas' latest view, for this batch's choices
        for result in results:
            if isinstance(result, RequestError):
                self._send_error(result)
            else:
                self.send(result)

    def send(self, request: TokenizedRequest) -> None:
        replica = 0 if self.routing is None else self.routing.route(request)
        if request.grammar:
            self.vocabularies[replica].before_constrained_request()
        self.to_engines[replica].put(request)
        self.served += 1

    def answer_queries(self, queries: list[TokenizeRequest]) -> None:
        for query in queries:
            if self.runtime.draining:
                self._send_error(self._unavailable(query))
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

    @staticmethod
    def _unavailable(req: SubmitRequest | TokenizeRequest) -> RequestError:
        return RequestError(
            req.request_id,
            req.client_id,
            "unavailable: the cluster is shutting down",
            ERR_UNAVAILABLE,
            req.t_submit,
        )

    def _send_error(self, err: RequestError) -> None:
        self.rejected += 1
        self.to_detok.put(err)

    def _stats(self) -> dict[str, float]:
        return {
            "served": self.served,
            "rejected": self.rejected,
            "answered": self.answered,
            "tokenize_s": self.tokenize_s,
            "long_prompts": self.lane.encoded,
            "draining": float(self.runtime.draining),
            "memory_trims": self.trim.trims,
            **(self.routing.stats() if self.routing is not None else {}),
        }

    def close(self) -> None:
        for vocabulary in self.vocabularies:
            vocabulary.close()
        if self.routing is not None:
            self.routing.close()
        self.inbox.close()
        for q in (*self.to_engines, self.to_detok):
            q.close()
        self.runtime.close()


def main(config: ClusterConfig, index: int) -> None:
    run_on_context(lambda ctx: TokenizerWorker(config, index, ctx))
