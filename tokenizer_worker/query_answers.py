"""Answers TokenizeRequests: tokenize text or a chat, decode ids, describe the tokenizer.

The HTTP frontend never loads a tokenizer; its /tokenize, /detokenize and /tokenizer_info are
answered here, with the same tokenizer and chat template that prepare every request, so what
/tokenize returns is exactly what the engine would see for the same input. Pure (no sockets).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ipc.codec import DecodeError, pack_ids, unpack_ids
from ipc.messages import ERR_BAD_REQUEST, RequestError
from ipc.messages.queries import TokenizeRequest, TokenizeResult
from tokenizer_worker.chat_template import SPECIAL_TOKEN_KEYS, ChatTemplate
from tokenizer_worker.prepare import Limits, RequestPreparer, RequestRejected, render_chat
from tokenizer_worker.structured import StructuredOutputs, offered_tools
from tokenizer_worker.tool_calls import ToolSpecError

# tokenizer_config.json entries that are about files on the server, not the tokenizer.
_PRIVATE_CONFIG_KEYS = (
    "vocab_file",
    "merges_file",
    "tokenizer_file",
    "name_or_path",
    "is_local",
    "local_files_only",
)
_INT64_MAX = 2**63 - 1
_ADDED_TOKEN_FIELDS = {
    "content",
    "lstrip",
    "rstrip",
    "normalized",
    "single_word",
    "special",
    "__type",
}


class TokenizerQueries:
    def __init__(
        self,
        tokenizer: Any,
        chat_template: ChatTemplate | None,
        limits: Limits,
        model_dir: str | Path | None = None,
        structured: StructuredOutputs | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.limits = limits
        self.info = tokenizer_info(model_dir, chat_template, limits)
        # Renders tools and tool histories as requests get them (reads no vocabulary for that).
        self.structured = structured or StructuredOutputs(
            tokenizer, limits.vocab_size, chat_template
        )

    @classmethod
    def from_preparer(cls, preparer: RequestPreparer, model_dir: str | Path) -> TokenizerQueries:
        return cls(
            preparer.tokenizer,
            preparer.chat_template,
            preparer.limits,
            model_dir,
            preparer.structured,
        )

    def answer(self, req: TokenizeRequest) -> TokenizeResult | RequestError:
        result = TokenizeResult(
            req.request_id, req.client_id, max_model_len=self.limits.max_model_len
        )
        try:
            if req.info:
                result.info = self.info
            elif req.detokenize_ids:
                result.text = self.tokenizer.decode(
                    self._check_ids(req.detokenize_ids), skip_special_tokens=False
                )
            else:
                ids = self._encode(req)
                result.token_ids = pack_ids(ids)
                if req.return_token_strs:
                    result.token_strs = [self.tokenizer.id_to_token(i) or "" for i in ids]
        except RequestRejected as exc:
            return RequestError(req.request_id, req.client_id, str(exc), exc.code, req.t_submit)
        return result

    def _encode(self, req: TokenizeRequest) -> list[int]:
        if req.messages is not None:
            try:
                tools, choice = offered_tools(req.tools, req.tool_choice, True)
                conversation, template_tools = self.structured.conversation(
                    req.messages, tools, choice
                )
            except ToolSpecError as exc:
                raise RequestRejected(str(exc)) from None
            text = render_chat(
                self.chat_template,
                req.messages,
                req.add_generation_prompt,
                req.chat_template_kwargs,
                conversation,
                template_tools,
            )
        else:
            text = req.prompt or ""
        return self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens).ids

    def _check_ids(self, packed: bytes) -> list[int]:
        try:
            ids = unpack_ids(packed)
        except DecodeError as exc:
            raise RequestRejected(str(exc)) from None
        if int(ids.min()) < 0 or int(ids.max()) >= self.limits.vocab_size:
            raise RequestRejected(
                f"token ids must be in [0, {self.limits.vocab_size}); got values in "
                f"[{int(ids.min())}, {int(ids.max())}]",
                ERR_BAD_REQUEST,
            )
        return ids.tolist()


def tokenizer_info(
    model_dir: str | Path | None, chat_template: ChatTemplate | None, limits: Limits
) -> dict[str, Any]:
    """The shape of vLLM's /tokenizer_info: the tokenizer's configuration (its
    tokenizer_config.json, special tokens as their strings), ``tokenizer_class`` and the chat
    template; plus what this server enforces (``max_model_len``, ``vocab_size``)."""
    config: dict[str, Any] = {}
    path = Path(model_dir) / "tokenizer_config.json" if model_dir is not None else None
    if path is not None and path.is_file():
        loaded = json.loads(path.read_text())
        config = loaded if isinstance(loaded, dict) else {}
    info = {k: _json_value(v) for k, v in config.items() if k not in _PRIVATE_CONFIG_KEYS}
    info.pop("chat_template", None)  # the one the server renders is added below
    for key in SPECIAL_TOKEN_KEYS:
        info.setdefault(key, None)
    info["tokenizer_class"] = str(config.get("tokenizer_class") or "PreTrainedTokenizerFast")
    # Hugging Face writes a huge sentinel when the checkpoint names no limit; the limit a client
    # must respect here is the server's context length.
    declared = config.get("model_max_length")
    info["model_max_length"] = (
        min(declared, limits.max_model_len)
        if isinstance(declared, int) and not isinstance(declared, bool)
        else limits.max_model_len
    )
    info["max_model_len"] = limits.max_model_len
    info["vocab_size"] = limits.vocab_size
    if chat_template is not None:
        info["chat_template"] = chat_template.source
    return info


def _json_value(value: Any) -> Any:
    """A tokenizer_config value as plain JSON that msgpack carries: an added token's map becomes
    its string (as Hugging Face's init_kwargs show it), integers past int64 become floats."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and set(value) <= _ADDED_TOKEN_FIELDS:
            return value["content"]
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _INT64_MAX:
        return float(value)
    return value
