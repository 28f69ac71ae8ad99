"""``kvstore route``: an OpenAI-compatible router in front of engine replicas (aiohttp).

    POST /v1/completions, /v1/chat/completions   routed, the body forwarded unchanged and the
                                                  response (streamed or not) passed through
    GET  /v1/models                               the first replica's answer
    GET  /health                                  200 while the router runs
    GET  /metrics                                 Prometheus: kvstore_router_requests_total
                                                  {replica}, kvstore_router_first_choice_total,
                                                  kvstore_router_in_flight{replica},
                                                  kvstore_router_cached_tokens_total

A prompt is tokenized with the model's own tokenizer from its local folder, as the engine does:
a completion's ``prompt`` (text, or token ids as they are), a chat's ``messages`` through the
tokenizer's chat template with the generation prompt (a tokenizer without one: the messages'
text, which keys the prefix consistently but will not match the engine's blocks). The request's
``cache_salt`` is part of its keys, as in the connector. The sidecar probe runs in a worker
thread, so the event loop never waits on a sidecar.

A replica that cannot be reached answers 502 with an OpenAI-style error; nothing is retried on
another replica (a request may not be idempotent).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvstore.routing.router import Router

log = logging.getLogger(__name__)

Tokenize = Callable[[str, dict[str, Any]], list[int]]
_ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
_PASSED_HEADERS = ("Content-Type", "Authorization")


def tokenizer_for(model_dir: Path) -> Tokenize:
    """The model's tokenizer, from its folder only (nothing is downloaded)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    def tokenize(path: str, body: dict[str, Any]) -> list[int]:
        if path == "/v1/chat/completions":
            messages = body.get("messages") or []
            if getattr(tokenizer, "chat_template", None):
                out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
                return [int(t) for t in ids]
            text = "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
            return [int(t) for t in tokenizer.encode(text)]
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch: routed by its first prompt
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        return [int(t) for t in tokenizer.encode(str(prompt))]

    return tokenize


class _Metrics:
    def __init__(self, replicas: Sequence[str]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvstore_router_requests_total", "requests routed", ["replica"], registry=self.registry
        )
        self.first_choice = Counter(
            "kvstore_router_first_choice_total",
            "requests routed to the policy's first choice (no load bound in the way)",
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "kvstore_router_in_flight", "requests in flight", ["replica"], registry=self.registry
        )
        self.cached_tokens = Counter(
            "kvstore_router_cached_tokens_total",
            "prompt tokens the chosen replica's sidecar reported it can restore",
            registry=self.registry,
        )
        for name in replicas:
            self.requests.labels(name)
            self.in_flight.labels(name)


def build_app(
    backends: Sequence[str], router: Router, tokenize: Tokenize, timeout_s: float = 600.0
) -> web.Application:
    """The router's application; ``backends[i]`` is the base URL of ``router.replicas[i]``."""
    if len(backends) != len(router.replicas):
        raise ValueError(f"{len(backends)} backends for {len(router.replicas)} replicas")
    metrics = _Metrics(router.replicas)
    app = web.Application()
    state: dict[str, aiohttp.ClientSession] = {}

    async def start(_app: web.Application) -> None:
        state["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def stop(_app: web.Application) -> None:
        await state["session"].close()

    async def routed(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as exc:
            return _error(400, f"invalid JSON body: {exc}")
        loop = asyncio.get_running_loop()
        try:
            tokens = await loop.run_in_executor(None, tokenize, request.path, body)
        except (ValueError, TypeError, KeyError) as exc:
            return _error(400, f"cannot tokenize the prompt: {exc}")
        salt = str(body.get("cache_salt") or "")
        route_request, _ = await loop.run_in_executor(None, router.request_for, tokens, salt)
        choice = router.admit(route_request)
        metrics.requests.labels(choice.name).inc()
        metrics.first_choice.inc(choice.first_choice)
        metrics.cached_tokens.inc(choice.cached_tokens)
        metrics.in_flight.labels(choice.name).inc()
        try:
            return await _forward(request, state["session"], backends[choice.replica], raw)
        finally:
            metrics.in_flight.labels(choice.name).dec()
            router.finish(choice)

    async def models(request: web.Request) -> web.StreamResponse:
        return await _forward(request, state["session"], backends[0], b"")

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "replicas": list(router.replicas)})

    async def prometheus(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), content_type="text/plain")

    for path in _ROUTED_PATHS:
        app.router.add_post(path, routed)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", prometheus)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


async def _forward(
    request: web.Request, session: aiohttp.ClientSession, base: str, raw: bytes
) -> web.StreamResponse:
    headers = {h: request.headers[h] for h in _PASSED_HEADERS if h in request.headers}
    url = base.rstrip("/") + request.path
    response: web.StreamResponse | None = None
    try:
        async with session.request(request.method, url, data=raw or None, headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("replica %s failed: %s", base, exc)
        if response is not None:  # mid-stream: the status is sent; the client sees it cut
            return response
        return _error(502, f"the replica {base} failed: {type(exc).__name__}: {exc}")


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
