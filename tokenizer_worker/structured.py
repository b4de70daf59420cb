"""The tokenizer worker's part of structured outputs and tool calling, for one model.

Once per worker, off the request path (a background thread started with the worker): the grammar
backend's reading of the vocabulary, which the engine gets as data (GrammarVocabulary) and the
compiler checks grammars with. Per request (``plan``): its tools checked and put into the
conversation the chat template renders, the grammar its output must follow (its
response_format / structured_outputs, or the call format that tool_choice "required" or a named
function enforces) compiled and cached by spec, and the tool parser the detokenizer runs on its
text. Bad input raises GrammarSpecError or ToolSpecError naming the problem (a 400).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ipc.messages import ChatMessage, SubmitRequest
from ipc.structured import GrammarVocabulary
from runtime.priority import lower_this_thread
from tokenizer_worker import tool_calls
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.grammar_compiler import GrammarCompiler
from tokenizer_worker.tool_calls import ToolChoice, ToolSpecError
from tokenizer_worker.tool_formats import AUTO, ToolFormat
from tokenizer_worker.vocabulary import grammar_backend


@dataclass(slots=True)
class OutputPlan:
    """What structured outputs and tools change about one request."""

    conversation: list[dict[str, Any]] | None = None  # to render instead of its own messages
    template_tools: list[dict[str, Any]] | None = None  # for a template that renders tools
    grammar: str = ""
    tool_parser: str = ""


def needs_plan(req: SubmitRequest) -> bool:
    """Whether the request asks for anything here (cheap: most requests do not)."""
    return bool(req.structured is not None or req.tools or req.tool_choice or _has_tool_turns(req))


def _has_tool_turns(req: SubmitRequest) -> bool:
    """A history with tool calls or results: written in the call format for the template."""
    return bool(req.messages and any(m.tool_calls or m.role == "tool" for m in req.messages))


class StructuredOutputs:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        chat_template: ChatTemplate | None,
        eos_ids: list[int] | None = None,
        tool_call_parser: str = AUTO,
    ) -> None:
        """``tool_call_parser``: the model family's call format, "auto" to read it from the
        chat template (tokenizer_worker.tool_formats)."""
        self._tokenizer, self._vocab_size, self._eos_ids = tokenizer, vocab_size, eos_ids
        source = chat_template.source if chat_template is not None else None
        self.supports_tools = source is not None and tool_calls.template_supports_tools(source)
        self.tool_format = ToolFormat.for_model(source, tool_call_parser, tokenizer)
        self._backend: Future[tuple[GrammarCompiler, GrammarVocabulary]] = Future()
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> None:
        """Reads the vocabulary on a background thread (about a second on a busy CPU): the
        worker serves plain requests meanwhile, a constrained one waits for it."""
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._build, name="grammar-vocabulary", daemon=True).start()

    def _build(self) -> None:
        lower_this_thread()  # background work: the engine's step comes first
        try:
            backend, vocabulary = grammar_backend(self._tokenizer, self._vocab_size, self._eos_ids)
            self._backend.set_result((GrammarCompiler(backend), vocabulary))
        except BaseException as exc:  # a request that needs it reports it; the worker goes on
            self._backend.set_exception(exc)

    def vocabulary(self) -> GrammarVocabulary:
        """The vocabulary as data (waits for the background read)."""
        self.start()
        return self._backend.result()[1]

    def ready_vocabulary(self) -> GrammarVocabulary | None:
        """The vocabulary if it has been read already (never waits)."""
        if not self._backend.done() or self._backend.exception() is not None:
            return None
        return self._backend.result()[1]

    @property
    def compiler(self) -> GrammarCompiler:
        self.start()
        return self._backend.result()[0]

    def plan(self, req: SubmitRequest) -> OutputPlan:
        # Token ids with tools are taken as a chat already rendered with them (a Ray Serve
        # ingress renders and encodes, then hands the engine replica the ids); raw text is not.
        tools, choice = offered_tools(req.tools, req.tool_choice, req.prompt is None)
        spec = tool_calls.forced_tool_call_spec(
            tools, choice, req.parallel_tool_calls, self.tool_format
        )
        if spec is not None and req.structured is not None:
            raise ToolSpecError(
                'tool_choice "required" or a named function forces a tool call; '
                "it cannot be combined with response_format or "
                "structured_outputs"
            )
        spec = spec or req.structured
        plan = OutputPlan(
            grammar=self.compiler.compile(spec) if spec is not None else "",
            tool_parser=self.tool_format.name if choice.mode != "none" else "",
        )
        if req.messages is not None:
            plan.conversation, plan.template_tools = self.conversation(req.messages, tools, choice)
        return plan

    def conversation(
        self, messages: list[ChatMessage], tools: list[dict[str, Any]], choice: ToolChoice
    ) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
        """(conversation, tools) for the chat template when tools or a tool history change what
        it renders, else (None, None): what a request and a tokenize query of it both render."""
        if choice.mode == "none" and not any(m.tool_calls or m.role == "tool" for m in messages):
            return None, None
        return tool_calls.conversation_for_template(
            [openai_message(m) for m in messages],
            tools,
            choice,
            self.supports_tools,
            self.tool_format,
        )


def offered_tools(
    tools_json: str, tool_choice_json: str, is_chat: bool
) -> tuple[list[dict[str, Any]], ToolChoice]:
    """A request's tools and tool_choice (JSON text, as they travel), checked. ``is_chat``:
    chat messages, or the token ids of a chat rendered with the tools (not a text prompt)."""
    if not (tools_json or tool_choice_json):
        return [], ToolChoice("none")
    if not is_chat:
        raise ToolSpecError(
            "tools and tool_choice need chat messages (or the token ids of a chat rendered "
            "with them)"
        )
    tools = tool_calls.check_tools(_json(tools_json, "tools")) if tools_json else []
    choice = tool_calls.resolve_tool_choice(
        tools, _json(tool_choice_json, "tool_choice") if tool_choice_json else None
    )
    return tools, choice


def openai_message(m: ChatMessage) -> dict[str, Any]:
    """A history message as chat templates (and tool_calls) expect it: OpenAI's shape."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [c.as_openai() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    return out


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ToolSpecError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ToolSpecError(f"{what} nests too deeply") from None
