"""The ingress deployment: the OpenAI-compatible HTTP API (http_worker's app, unchanged) whose
client is a ``ServeClient``: this replica tokenizes, validates and hashes every request, and
hands token ids to the engine deployment (client.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from http_worker.app import build_app
from http_worker.frontend import FrontendSettings
from ipc.messages import ClientWelcome
from ipc.sampling import DEFAULT_MAX_DEFAULT_TOKENS
from procs.model_store import resolve_model
from procs.serve_ray.client import PrepareQueue, ServeClient
from procs.serve_ray.settings import APP_NAME, PREFIX_CACHE_AFFINITY, ServeSettings
from tokenizer_worker.prepare import Limits
from tokenizer_worker.worker import build_preparer


@serve.ingress()
class Ingress:
    def __init__(
        self,
        engine: DeploymentHandle,
        settings: ServeSettings,
        prefill: DeploymentHandle | None = None,
    ) -> None:
        """``engine``: the deployment that streams answers (the decode deployment in the
        prefill/decode mode, where ``prefill`` computes the prompts first)."""
        self.engine = engine
        self.prefill = prefill
        self.settings = settings

    def __serve_build_asgi_app__(self) -> FastAPI:
        settings = self.settings
        frontend = FrontendSettings(
            client_addr=f"serve://{APP_NAME}/engine",  # for logs: the client is a ServeClient
            api_key=settings.api_key,
            lenient_fields=settings.lenient_fields,
            max_body_bytes=settings.http_max_body_bytes,
        )
        return build_app(frontend, connect=self._connect)

    async def _connect(self, _: Any) -> ServeClient:
        """Called by the frontend's start-up: the engines' limits (every replica serves the
        same model), then this replica's tokenizer for them."""
        info = await self.engine.info.remote()
        limits = Limits(
            max_model_len=info["max_model_len"],
            vocab_size=info["vocab_size"],
            # this replica prepares every request, so the tokenizer knob applies here
            max_default_tokens=self.settings.cluster.get(
                "max_default_tokens", DEFAULT_MAX_DEFAULT_TOKENS
            ),
        )
        model_path = str(resolve_model(self.settings.model or None))
        parser = self.settings.cluster.get("tool_call_parser", "auto")  # as the replicas'
        preparer = await asyncio.to_thread(
            build_preparer,
            model_path,
            limits,
            tool_call_parser=parser,
            reasoning_parser=self.settings.cluster.get("reasoning_parser", "auto"),
        )
        preparer.structured.start()  # the grammar vocabulary, read in the background
        welcome = ClientWelcome([], info["model"], limits.max_model_len, limits.vocab_size)
        return ServeClient(
            self.engine,
            PrepareQueue(
                preparer,
                info["block_size"],
                with_text=self.settings.request_router == PREFIX_CACHE_AFFINITY,
            ),
            welcome,
            prefill=self.prefill,
        )
