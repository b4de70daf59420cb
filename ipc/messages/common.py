"""What every channel shares: finish reasons, error codes and the chat message."""

from __future__ import annotations

from dataclasses import dataclass

from ipc.structured import ToolCall

# Finish reasons (the field's vocabulary: OpenAI / vLLM / SGLang).
FINISH_STOP = "stop"  # eos, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or the context length
FINISH_ABORT = "abort"  # the client (or a shutdown) aborted it
FINISH_ERROR = "error"  # see StreamEvent.error / error_code
FINISH_TOOL_CALLS = "tool_calls"  # stopped after calling tools (the detokenizer's parser saw them)

# Error codes carried with FINISH_ERROR.
ERR_BAD_REQUEST = "bad_request"  # the request itself is wrong; retrying it will not help
ERR_OVERLOADED = "overloaded"  # a bounded queue is full; retry later
ERR_UNAVAILABLE = "unavailable"  # a worker died or the cluster is shutting down
ERR_INTERNAL = "internal"
# A copy of a request whose id is live (only a raw client bypassing the SDK sends one): the copy
# is refused with this code and the live request goes on; the event carries the live id, so this
# code is what tells its sender which of the two ended.
ERR_DUPLICATE_REQUEST = "duplicate_request_id"


@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None  # the speaker's name, which a chat template may show
    # Tool calling (OpenAI's shape): an assistant's calls, and on a "tool" message the call it
    # answers.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant's thinking in an earlier answer (chat's reasoning_content), for a template
    # that shows it (Qwen3's shows the thinking of the turns after the last user message).
    reasoning_content: str | None = None
