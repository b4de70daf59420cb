"""What the sync and asyncio clients share: the I/O-free core, the cluster's welcome, submit()
and abort. Each client brings its sockets, its way of waiting and ``_make_handle``."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Generic, TypeVar

from ipc.client.core import ClientCore
from ipc.client.errors import UnavailableError
from ipc.client.queries import QueryMethods
from ipc.client.records import HandleBase, RequestRecord
from ipc.messages import ClientWelcome, SamplingParams

H = TypeVar("H", bound=HandleBase)


class ClientBase(QueryMethods, Generic[H]):
    """Abstract: a client brings ``_make_handle``, ``_send_control`` and ``_ask``
    (QueryMethods); a client class that lacks one cannot be made (TypeError naming it)."""

    def __init__(self, deadline_s: float | None, tokenizer_retries: int) -> None:
        self._core = ClientCore(deadline_s, tokenizer_retries)
        self.client_id = self._core.client_id

    @abstractmethod
    def _make_handle(self, record: RequestRecord) -> H:
        """The client's own handle around ``record`` (its way of waiting)."""

    @abstractmethod
    def _send_control(self, frame: bytes) -> None:
        """Sends ``frame`` on the detokenizer connection (from any thread, without waiting)."""

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
