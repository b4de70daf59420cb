"""No silent drops: what the frontend does with every request field its models do not declare.

The request models (protocol.py, chat_protocol.py, tokenize_routes.py) declare the fields this
server honours and refuse declared ones at values it cannot honour. They keep every other field
of a body as an extra (pydantic ``extra="allow"``), and ``check_fields`` judges each one here,
so a field that would change the output is never dropped without a word:

- known and not implemented: a 400 naming it, unless its value asks for nothing (``"tools": []``,
  ``"priority": 0``);
- known and harmless: accepted and ignored; each entry says why it cannot change the output;
- unknown: a 400 naming it, or, on a server started with ``--lenient-fields`` (for clients that
  send vendor extras), logged once per name and ignored.

Nested objects (``stream_options``, each message, each content part) are judged the same way.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from http_worker.protocol import APIError

logger = logging.getLogger("splitserve.http")

# Known fields we do not implement -> the values (besides null, [] and {}) that ask for nothing.
NOT_IMPLEMENTED_FIELDS: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "functions": (),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
    # vLLM / SGLang extensions
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "early_stopping": (False,),
    "bad_words": (),
    "allowed_token_ids": (),
    "truncate_prompt_tokens": (),
    "priority": (0,),
    "spaces_between_special_tokens": (True,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "chat_template": (),  # a template sent by the client: not rendered (untrusted code)
    "continue_final_message": (False,),
    "documents": (),
    "mm_processor_kwargs": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "logits_processors": (),
    "regex": (),
    "json_schema": (),
    "ebnf": (),
    "lora_path": (),
    "return_hidden_states": (False,),
}
CHAT_NOT_IMPLEMENTED_FIELDS = {**NOT_IMPLEMENTED_FIELDS, "add_special_tokens": (False,)}
COMPLETION_NOT_IMPLEMENTED_FIELDS = {**NOT_IMPLEMENTED_FIELDS, "add_special_tokens": (True,)}

# Known fields accepted and ignored, with the reason each cannot change the output.
NO_OP_FIELDS: dict[str, str] = {
    "metadata": "tags for OpenAI's stored completions; nothing is stored here",
    "store": "asks OpenAI to keep the completion; this server keeps none",
    "service_tier": "a processing tier for billing and latency; there is one tier here",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache; the prefix cache here finds "
    "shared prefixes by their token ids",
    "safety_identifier": "an end-user id for abuse monitoring, like user",
}

# Fields of a chat message (what clients replay of an earlier answer) and of its content parts.
MESSAGE_NOT_IMPLEMENTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "function_call": (),
    "audio": (),
    "refusal": ("",),
    "annotations": (),
    "reasoning": ("",),
}
STREAM_OPTIONS_NO_OP_FIELDS = {
    "include_obfuscation": "random padding OpenAI adds to stream chunks against side channels; "
    "none is added here, the content is the same"
}


class FieldPolicy:
    """What one model class does with the fields it does not declare."""

    def __init__(
        self,
        not_implemented: dict[str, tuple[Any, ...]] | None = None,
        no_op: dict[str, str] | None = None,
    ) -> None:
        self.not_implemented = not_implemented or {}
        self.no_op = no_op or {}


GENERATION_POLICIES = {
    "CompletionRequest": FieldPolicy(COMPLETION_NOT_IMPLEMENTED_FIELDS, NO_OP_FIELDS),
    "ChatCompletionRequest": FieldPolicy(CHAT_NOT_IMPLEMENTED_FIELDS, NO_OP_FIELDS),
    "StreamOptions": FieldPolicy(no_op=STREAM_OPTIONS_NO_OP_FIELDS),
    "ChatMessageIn": FieldPolicy(MESSAGE_NOT_IMPLEMENTED_FIELDS),
    "TextPart": FieldPolicy(),
}
_logged_unknown: set[str] = set()
MAX_LOGGED_NAMES = 1024  # a client inventing names cannot grow the set without bound


def asks_for_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    """True for null, an empty list/object/string, or one of the field's neutral values."""
    if value is None or (isinstance(value, (list, dict, str)) and not value):
        return True
    return any(_same(value, n) for n in neutral)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):  # true is not 1 here
        return a is b
    return bool(a == b)


def check_fields(
    model: BaseModel,
    lenient: bool,
    policies: dict[str, FieldPolicy] = GENERATION_POLICIES,
    path: str = "",
) -> None:
    """Raises APIError(400) for the first extra field of ``model`` (or of an object nested in
    it) that would change the output; see the module docstring."""
    policy = policies.get(type(model).__name__, FieldPolicy())
    for name, value in (model.model_extra or {}).items():
        where = f"{path}{name}"
        if name in policy.no_op:
            continue
        if name in policy.not_implemented:
            if asks_for_nothing(value, policy.not_implemented[name]):
                continue
            raise APIError(
                400,
                f"{where} is not supported by this server",
                "invalid_request_error",
                where,
                "unsupported_field",
            )
        if not lenient:
            raise APIError(
                400,
                f"unknown field {where!r}: this server does not know it, so it "
                "cannot honour it (a server started with --lenient-fields ignores "
                "unknown fields instead)",
                "invalid_request_error",
                where,
                "unknown_field",
            )
        _log_ignored(f"{type(model).__name__}.{name}", where)
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            check_fields(value, lenient, policies, f"{path}{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    check_fields(item, lenient, policies, f"{path}{name}[{i}].")


def _log_ignored(key: str, where: str) -> None:
    if key in _logged_unknown or len(_logged_unknown) >= MAX_LOGGED_NAMES:
        logger.debug("ignored unknown field %r (--lenient-fields)", where)
        return
    _logged_unknown.add(key)
    logger.warning("ignored unknown field %r (--lenient-fields; logged once per name)", where)
