"""The SDK's errors: one class per error code the cluster sends, so callers catch by kind."""

from __future__ import annotations

from ipc.messages import ERR_BAD_REQUEST, ERR_INTERNAL, ERR_OVERLOADED, ERR_UNAVAILABLE

ERR_TIMEOUT = "timeout"


class SplitserveError(Exception):
    code = ERR_INTERNAL

    def __init__(
        self, message: str, request_id: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.param = param  # the request field the error is about, when it is about one


class BadRequestError(SplitserveError, ValueError):
    code = ERR_BAD_REQUEST


class OverloadedError(SplitserveError):
    code = ERR_OVERLOADED


class UnavailableError(SplitserveError):
    code = ERR_UNAVAILABLE


class RequestTimeoutError(SplitserveError, TimeoutError):
    """The client-side deadline passed with no terminal event (a last resort against hangs)."""

    code = ERR_TIMEOUT


_ERRORS = {
    cls.code: cls
    for cls in (BadRequestError, OverloadedError, UnavailableError, RequestTimeoutError)
}


def error_for(
    code: str | None, message: str, request_id: str | None = None, param: str | None = None
) -> SplitserveError:
    return _ERRORS.get(code or "", SplitserveError)(message, request_id, param)
