"""What the sync and asyncio clients share: the I/O-free core, the cluster's welcome, submit()
and abort. Each client brings its sockets, its way of waiting and ``_make_handle``."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Generic, TypeVar

import zmq

from ipc.client.core import ClientCore
from ipc.client.errors import UnavailableError
from ipc.client.queries import Builder, QueryMethods
from ipc.client.records import HandleBase, RequestRecord
from ipc.client.transport import curve_keys
from ipc.messages import ClientWelcome, SamplingParams

H = TypeVar("H", bound=HandleBase)


class ClientBase(QueryMethods, Generic[H]):
    """Abstract: a client brings ``_setup``, ``_make_handle``, ``_send_control`` and ``_ask``
    (QueryMethods); a client class that lacks one cannot be made (TypeError naming it)."""

    def __init__(
        self,
        address: str,
        *,
        connect_timeout_s: float = 30.0,
        deadline_s: float | None = None,
        submit_hwm: int | None = None,
        server_public_key: str | bytes | None = None,
        tokenizer_retries: int = 1,
    ) -> None:
        """The sync client connects and does the handshake here (raising UnavailableError when
        nobody answers within ``connect_timeout_s``), the asyncio client in ``start()``.

        deadline_s: a client-side limit per request; past it the request ends with a timeout
        error and is aborted in the cluster (a last resort against a hang, off by default).
        server_public_key: the cluster's CURVE public key (the supervisor prints it and writes
        it to curve_public.key in its run dir); needed when the cluster uses CURVE (--listen).
        tokenizer_retries: how many times a request still queued in a tokenizer worker that
        died is sent again to a live one before it ends with an "unavailable" error.
        submit_hwm: requests each tokenizer pipe holds before submit() raises OverloadedError;
        default: the cluster's admission bound (max_waiting_requests) over its tokenizers.
        """
        self._curve = curve_keys(server_public_key)
        self._core = ClientCore(deadline_s, tokenizer_retries)
        self.client_id = self._core.client_id
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.submit_hwm = submit_hwm
        self._ctx = zmq.Context()
        self._setup()

    @abstractmethod
    def _setup(self) -> None:
        """The client's own part of construction (the sync client connects here)."""

    @abstractmethod
    def _make_handle(self, record: RequestRecord) -> H:
        """The client's own handle around ``record`` (its way of waiting)."""

    @abstractmethod
    def _send_control(self, frame: bytes) -> None:
        """Sends ``frame`` on the detokenizer connection (from any thread, without waiting)."""

    def _send_query(self, build: Builder, timeout: float | None, to_detokenizer: bool) -> H:
        """Sends one query (see QueryMethods._ask) and returns the handle its reply ends."""
        if not to_detokenizer:
            return self._core.send(self._make_handle, None, timeout, build)
        handle, frame = self._core.open_query(self._make_handle, timeout, build)
        self._send_control(frame)
        return handle

    @property
    def welcome(self) -> ClientWelcome | None:
        """The cluster's handshake answer (a restarted detokenizer's latest); None before it."""
        return self._core.welcome

    def _require_welcome(self) -> ClientWelcome:
        if self._core.welcome is None:
            raise UnavailableError("the client is not started (await start()) or is closed")
        return self._core.welcome

    @property
    def model(self) -> str:
        return self._require_welcome().model

    @property
    def max_model_len(self) -> int:
        return self._require_welcome().max_model_len

    def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[Any] | None = None,
        prompt_token_ids: Any = None,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        add_generation_prompt: bool = True,
        deadline_s: float | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continuous_usage_stats: bool = False,
        **sampling_kwargs: Any,
    ) -> H:
        """Sends one request without waiting (no round trip, no tokenization) and returns its
        handle. Sampling keywords are SamplingParams' fields (max_completion_tokens is accepted
        as max_tokens' other name). chat_template_kwargs: extra chat template variables (with
        messages), e.g. {"enable_thinking": False}. continuous_usage_stats: every delta carries
        the usage so far, not only the last. Raises BadRequestError for invalid arguments,
        OverloadedError when every tokenizer's pipe is full, UnavailableError while not
        connected."""
        return self._core.submit(
            self._make_handle,
            request_id,
            deadline_s,
            prompt=prompt,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            sampling_kwargs=sampling_kwargs,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            continuous_usage_stats=continuous_usage_stats,
        )

    def _abort(self, record: RequestRecord) -> None:
        """Asks the cluster to stop one request; its terminal event (reason "abort") follows."""
        if (frame := self._core.abort_frame(record)) is not None:
            self._send_control(frame)
