"""``splitserve serve MODEL [flags]``: the flag names of ``vllm serve`` (and llama-server's short
forms where they do not clash), translated to splitserve's knobs (docs/migrating.md).

A flag is translated when splitserve has the setting, accepted with a logged note when it
honestly has no effect here (``--trust-remote-code``: no checkpoint code is ever run), and
refused, naming the flag and what to use instead, when splitserve cannot do what it asks: never
silently ignored. A refusal is one line and exit code 2 (``ServeFlagError``)."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any, NoReturn

from ipc.kv_events import parse_kv_events_config
from ipc.reasoning import REASONING_PARSER_CHOICES
from ipc.structured import TOOL_CALL_FORMATS

DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16"}
DTYPES.update({"float": "float32", "float32": "float32"})
SPECULATIVE_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
MAX_PORT = 65535


class ServeFlagError(ValueError):
    """A flag value refused; its message is the one line the command prints."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + line
        if message.startswith("unrecognized arguments"):
            message += " (docs/migrating.md lists the flags splitserve serve takes)"
        raise ServeFlagError(message)


def count(minimum: int) -> Any:
    """An argparse type: an integer of at least ``minimum``; vLLM's 1k (1000) / 1K (1024)."""

    def parse(text: str) -> int:
        m = re.fullmatch(r"\s*(\d{1,12})\s*([kKmMgG]?)\s*", text)
        if not m:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
        base = 1024 if m[2].isupper() else 1000
        value = int(m[1]) * base ** " kmg".index(m[2].lower() or " ")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is below {minimum}")
        return value

    return parse


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text!r} is not in (0, 1]")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="splitserve serve",
        description="Serve MODEL over the OpenAI API with vLLM's (and llama-server's) flag "
        "names; docs/migrating.md maps each flag.",
    )
    p.add_argument("model", nargs="?", help="a GGUF file, a directory with one, or a HF dir")
    p.add_argument("-m", "--model", dest="model_flag", metavar="PATH", help="llama-server's -m")
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (vLLM: all)")
    p.add_argument("--port", type=count(0), default=8000, help="HTTP port (default 8000)")
    p.add_argument("--served-model-name", "-a", "--alias", nargs="+", metavar="NAME")
    p.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY") or None)
    p.add_argument("--max-model-len", type=count(1), metavar="TOKENS")
    p.add_argument("-c", "--ctx-size", type=count(1), metavar="TOKENS", help="llama-server's")
    p.add_argument("--max-num-seqs", "--parallel", "-np", type=count(1), metavar="N")
    p.add_argument("--max-num-batched-tokens", type=count(1), metavar="TOKENS")
    p.add_argument("-t", "--threads", type=count(1), metavar="N", help="engine threads")
    p.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE")
    p.add_argument("--chat-template-file", metavar="FILE", help="llama-server's")
    p.add_argument("--jinja", action="store_true", help="llama-server's; always on here")
    p.add_argument("--metrics", action="store_true", help="llama-server's; always on here")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    p.add_argument("--data-parallel-size", "-dp", type=count(1), metavar="N")
    p.add_argument("--kv-events-config", metavar="JSON")
    p.add_argument("--gpu-memory-utilization", type=fraction, metavar="FRACTION")
    p.add_argument("--seed", type=count(0))
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--block-size", type=count(1), metavar="TOKENS")
    p.add_argument("--generation-config", metavar="auto|vllm|FOLDER")
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--tool-call-parser", metavar="NAME")
    p.add_argument("--reasoning-parser", metavar="NAME")
    p.add_argument("--speculative-config", metavar="JSON")
    p.add_argument("--tensor-parallel-size", "-tp", type=count(1), default=1, metavar="N")
    p.add_argument("--pipeline-parallel-size", "-pp", type=count(1), default=1, metavar="N")
    p.add_argument("--quantization", "-q", metavar="METHOD")
    p.add_argument("--kv-cache-dtype", metavar="DTYPE")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--disable-log-requests", action="store_true")
    ours = p.add_argument_group("splitserve's own (as `splitserve launch` names them)")
    ours.add_argument("--tokenizer-workers", type=count(1), metavar="N")
    ours.add_argument("--http-workers", type=count(1), metavar="N")
    ours.add_argument("--kv-cache-tokens", type=count(1), metavar="TOKENS")
    ours.add_argument("--weights", metavar="FORMAT", help="see splitserve launch --help")
    ours.add_argument("--start-timeout-s", type=float, default=180.0, metavar="SECONDS")
    return p


def refuse(message: str) -> NoReturn:
    raise ServeFlagError(message)


def translate(args: argparse.Namespace) -> tuple[str | None, dict[str, Any], list[str]]:
    """(the model, the knobs for ``make_config``, notes to log): ServeFlagError on a refusal."""
    _refuse_unsupported(args)
    notes: list[str] = []
    knobs: dict[str, Any] = {"http_port": args.port, "http_host": args.host}
    knobs["http_api_key"] = args.api_key or os.environ.get("VLLM_API_KEY", "")
    _direct(args, knobs)
    if args.served_model_name:
        if len(args.served_model_name) > 1:
            refuse("--served-model-name: splitserve serves one name; give one")
        knobs["served_model_name"] = args.served_model_name[0]
    if args.ctx_size is not None:  # llama-server: the whole (unified) KV cache
        knobs["kv_cache_tokens"] = args.ctx_size
        knobs.setdefault("max_model_len", args.ctx_size)
    if args.enable_prefix_caching is not None:
        knobs["enable_prefix_cache"] = args.enable_prefix_caching
    template = chat_template_source(args.chat_template, args.chat_template_file)
    if template:
        knobs["chat_template"] = template
    if args.kv_events_config is not None:
        try:
            parse_kv_events_config(args.kv_events_config)
        except ValueError as exc:
            refuse(f"--kv-events-config: {exc}")
        knobs["kv_events_config"] = args.kv_events_config
    if args.speculative_config is not None:
        knobs.update(speculative_knobs(args.speculative_config))
    notes += _accepted(args, knobs)
    model = args.model_flag or args.model
    if model is not None and not Path(model).expanduser().exists():
        refuse(
            f"MODEL {model!r}: no such file or directory (splitserve serves local files and "
            "downloads nothing: give a GGUF file, a directory with one, or a checkpoint "
            "directory)"
        )
    return model, knobs, notes


def _direct(args: argparse.Namespace, knobs: dict[str, Any]) -> None:
    """The flags that are one of our knobs under another name, value for value."""
    pairs = {
        "max_model_len": "max_model_len",
        "max_num_seqs": "max_batch_size",
        "max_num_batched_tokens": "prefill_max_tokens",
        "threads": "engine_threads",
        "data_parallel_size": "engines",
        "seed": "seed",
        "device": "device",
        "block_size": "block_size",
        "tokenizer_workers": "tokenizer_workers",
        "http_workers": "http_workers",
        "kv_cache_tokens": "kv_cache_tokens",
        "weights": "weights",
        "gpu_memory_utilization": "kv_cache_memory_fraction",
    }
    for flag, knob in pairs.items():
        if getattr(args, flag) is not None:
            knobs[knob] = getattr(args, flag)
    if args.dtype is not None:
        knobs["dtype"] = DTYPES[args.dtype]
    if args.tool_call_parser is not None:
        knobs["tool_call_parser"] = args.tool_call_parser
    if args.reasoning_parser is not None:
        knobs["reasoning_parser"] = args.reasoning_parser


def _refuse_unsupported(args: argparse.Namespace) -> None:
    if args.model and args.model_flag and args.model != args.model_flag:
        refuse(f"two models given ({args.model!r} and -m {args.model_flag!r}): give one")
    if args.tensor_parallel_size > 1:
        refuse(
            f"--tensor-parallel-size {args.tensor_parallel_size}: splitserve does not split a "
            "model across devices; use --data-parallel-size N (whole replicas, "
            "docs/data-parallel.md)"
        )
    if args.pipeline_parallel_size > 1:
        refuse(
            f"--pipeline-parallel-size {args.pipeline_parallel_size}: splitserve does not "
            "split a model across devices; use --data-parallel-size N (docs/data-parallel.md)"
        )
    if args.quantization not in (None, "gguf"):
        refuse(
            f"--quantization {args.quantization}: splitserve does not load {args.quantization} "
            "checkpoints; serve a GGUF file (its Q4_0/Q8_0... blocks are read as they are) or "
            "quantize a checkpoint at load with --weights int8|int4"
        )
    if args.kv_cache_dtype not in (None, "auto"):
        refuse(
            f"--kv-cache-dtype {args.kv_cache_dtype}: the KV cache is held in the activation "
            "dtype; set that with --dtype"
        )
    if args.reasoning_parser not in (None, *REASONING_PARSER_CHOICES):
        refuse(
            f"--reasoning-parser {args.reasoning_parser}: not a parser splitserve has; use one "
            f"of {', '.join(REASONING_PARSER_CHOICES)}"
        )
    if args.generation_config not in (None, "vllm"):
        refuse(
            f"--generation-config {args.generation_config}: splitserve does not apply a "
            "generation_config.json's sampling defaults (a request's own parameters or the "
            "API's defaults apply, as vLLM's --generation-config vllm does): pass that or "
            "leave the flag out"
        )
    if args.tool_call_parser not in (None, "auto", *TOOL_CALL_FORMATS):
        refuse(
            f"--tool-call-parser {args.tool_call_parser}: not a format splitserve parses; "
            f"use one of auto, {', '.join(TOOL_CALL_FORMATS)}"
        )


def _accepted(args: argparse.Namespace, knobs: dict[str, Any]) -> list[str]:
    """Flags taken with no effect, or with an effect that differs from vLLM's: one note each."""
    notes = []
    if args.enforce_eager:
        knobs["scripted_decode"] = False
        notes.append("--enforce-eager: decode steps run eagerly (--no-scripted-decode)")
    if args.trust_remote_code:
        notes.append("--trust-remote-code: no effect; splitserve never runs a checkpoint's code")
    if args.enable_auto_tool_choice:
        notes.append(
            "--enable-auto-tool-choice: no effect; tool_choice auto is always honoured when "
            "a request gives tools"
        )
    if args.disable_log_requests:
        notes.append("--disable-log-requests: no effect; requests are never logged one by one")
    if args.jinja:
        notes.append("--jinja: no effect; chat templates are always rendered with jinja2")
    if args.metrics:
        notes.append("--metrics: no effect; GET /metrics is always served")
    if args.quantization == "gguf":
        notes.append("--quantization gguf: no effect; a GGUF model is recognised by its file")
    if args.gpu_memory_utilization is not None:
        notes.append(
            "--gpu-memory-utilization: on CUDA, the share of the memory free after the weights "
            "that the KV cache takes; on a CPU no effect (the KV cache holds max-num-seqs full "
            "contexts within a quarter of available memory and 2 GiB; set --kv-cache-tokens)"
        )
    return notes


def chat_template_source(template: str | None, template_file: str | None) -> str:
    """vLLM's --chat-template: a file's path, or the template itself (anything with a jinja
    tag or a newline); llama-server's --chat-template-file: a path. Returns the text."""
    if template and template_file:
        refuse("--chat-template and --chat-template-file: give one")
    value = template or template_file
    if not value:
        return ""
    inline = template_file is None and any(c in value for c in "{}\n")
    if not inline:
        try:
            value = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            name = "--chat-template-file" if template_file else "--chat-template"
            refuse(f"{name} {value!r}: not a template, nor a readable file ({exc})")
    from tokenizer_worker.chat_template import ChatTemplate, ChatTemplateError

    try:
        ChatTemplate(value, {})
    except ChatTemplateError as exc:
        refuse(f"--chat-template: {' '.join(str(exc).split())}")
    return value


def speculative_knobs(text: str) -> dict[str, Any]:
    """vLLM's --speculative-config JSON, for the one method splitserve has (ngram)."""
    try:
        spec = json.loads(text)
    except ValueError as exc:
        refuse(f"--speculative-config is not JSON: {exc}")
    if not isinstance(spec, dict):
        refuse("--speculative-config must be a JSON object")
    if spec.get("method") not in ("ngram", "[ngram]"):
        refuse(
            f"--speculative-config method {spec.get('method')!r}: splitserve has ngram (prompt "
            'lookup) only: {"method": "ngram", "num_speculative_tokens": N, ...}'
        )
    extra = sorted(set(spec) - SPECULATIVE_KEYS)
    if extra:
        refuse(
            f"--speculative-config: {extra[0]!r} is not supported "
            f"(keys: {', '.join(sorted(SPECULATIVE_KEYS))})"
        )
    for key in SPECULATIVE_KEYS - {"method"}:
        value = spec.get(key)
        if value is not None and (type(value) is not int or not 1 <= value <= 64):
            refuse(f"--speculative-config {key} must be an integer in 1..64, got {value!r}")
    knobs: dict[str, Any] = {"speculative": "ngram"}
    if spec.get("num_speculative_tokens") is not None:
        knobs["num_speculative_tokens"] = spec["num_speculative_tokens"]
    low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    if low is not None or high is not None:  # as vLLM: one given stands for both
        knobs["prompt_lookup_min"] = low if low is not None else high
        knobs["prompt_lookup_max"] = high if high is not None else low
    return knobs
