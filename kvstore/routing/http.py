"""``kvstore route``: an OpenAI-compatible router in front of engine replicas (aiohttp), the
fleet's front door.

    POST /v1/completions, /v1/chat/completions   a caller's key checked (``callers.py``), the
                                                  body checked (``bodies.py``, 400 otherwise),
                                                  its ``cache_salt`` set from the tenant, routed,
                                                  the response (streamed or not) passed through
    GET  /v1/models                               the first replica up's answer (a caller's key)
    GET  /health                                  operators only: replicas up and down by name
                                                  (never their URLs); 503 when none is up
    GET  /metrics                                 operators only: kvstore_router_requests_total
                                                  {replica}, kvstore_router_first_choice_total,
                                                  kvstore_router_in_flight{replica},
                                                  kvstore_router_cached_tokens_total,
                                                  kvstore_router_retried_total,
                                                  kvstore_router_replicas_down

A prompt is tokenized with the model's own tokenizer from its local folder, as the engine does:
a completion's ``prompt`` (text, or token ids as they are), a chat's ``messages`` through the
tokenizer's chat template with the generation prompt (a tokenizer without one: the messages'
text, which keys the prefix consistently but will not match the engine's blocks). The request's
``cache_salt`` (the tenant's, ``callers.tenant_salt``, keyed by ``salt_secret``) is part of its keys, as in the connector,
so the sidecars are asked about that tenant's blocks only. The sidecar probe runs in a worker
thread, so the event loop never waits on a sidecar.

Failures (``replicas.py``): a replica that refuses the connection or does not accept it within
``connect_timeout_s`` is marked down and the request goes to another (nothing was sent yet); one
that fails after the request went out (no answer within ``upstream_timeout_s``, cut, a 5xx) is
marked down and the caller gets its answer or a 502/504: a request may not be idempotent.

Time limits (``FrontSettings``): a connection must deliver a request's head within
``header_timeout_s`` of opening or of its previous answer (aiohttp's keep-alive timer, which runs
from the connection's start: a slowloris is closed), the body within ``body_timeout_s`` (408), no
larger than ``max_body_bytes`` (413). A caller that leaves cancels its handler
(``handler_cancellation``), which closes the upstream connection, so the replica stops work on it
and it leaves the in-flight count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvstore.errors import Unavailable
from kvstore.routing.bodies import BadBody, parse_body
from kvstore.routing.callers import Callers, Refused, tenant_salt
from kvstore.routing.replicas import ReplicaHealth
from kvstore.routing.router import Router

log = logging.getLogger(__name__)

Tokenize = Callable[[str, dict[str, Any]], list[int]]
_ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
MiB = 1 << 20
# a body refused before its end is read this long more, so that its caller gets the answer rather
# than a reset; then the connection closes (aiohttp's default, 10 s, is a trickler's gift)
LINGER_S = 1.0
HEALTH = web.AppKey("health", ReplicaHealth)  # app[HEALTH]: which replicas answer
SALT_SECRET_VARIABLE = "KVSTORE_ROUTE_SALT_SECRET"  # or --salt-secret-file: FrontSettings.salt_secret


@dataclass(frozen=True)
class FrontSettings:
    # API key -> tenant; empty: one anonymous tenant. Secrets (here, backend_key, salt_secret) stay
    # out of the repr, which error messages and logs may print.
    keys: Mapping[str, str] = field(default_factory=dict, repr=False)
    ops_tenants: frozenset[str] = frozenset()  # tenants whose keys open /metrics and /health
    ops_loopback: bool = False  # /metrics and /health open to loopback addresses without a key
    backend_key: str = field(default="", repr=False)  # with keys: the Authorization the engines get
    # keys every tenant's cache salt; required with keys (else a salt follows from a tenant's name),
    # the same on every router of a fleet (else each router's tenants start cold on the engines)
    salt_secret: bytes = field(default=b"", repr=False)
    header_timeout_s: float = 15.0  # a request's head, from connect or the previous answer
    body_timeout_s: float = 30.0
    max_body_bytes: int = 16 * MiB
    connect_timeout_s: float = 5.0  # to a replica; past it the request goes to another
    upstream_timeout_s: float = 600.0  # a replica's whole answer
    probe_interval_s: float = 2.0  # each replica's /health asked this often

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "connect_timeout_s", "upstream_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not self.probe_interval_s > 0 or self.max_body_bytes <= 0:
            raise ValueError("--probe-interval-s and --max-body-bytes must be positive")
        if self.keys and not self.salt_secret:
            raise ValueError(
                f"--keys-file needs a salt secret: --salt-secret-file FILE (mode 0600) or ${SALT_SECRET_VARIABLE}, "
                "the same on every router of the fleet (e.g. `openssl rand -hex 32`)"
            )
        if self.ops_tenants - set(self.keys.values()):
            missing = ", ".join(sorted(self.ops_tenants - set(self.keys.values())))
            raise ValueError(f"--ops-tenant {missing}: no key of the keys file belongs to it")


def tokenizer_for(model_dir: Path) -> Tokenize:
    """The model's tokenizer, from its folder only (nothing is downloaded). Bodies reach it
    checked by ``parse_body``."""
    from jinja2 import TemplateError  # transformers renders chat templates with it
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    def tokenize(path: str, body: dict[str, Any]) -> list[int]:
        if path == "/v1/chat/completions":
            messages = body.get("messages") or []
            if getattr(tokenizer, "chat_template", None):
                try:
                    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                except TemplateError as exc:  # the template refused these messages: the body's fault
                    raise ValueError(f"the chat template refused the messages: {exc}") from None
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
            "requests routed to the policy's first choice (no load bound or dead replica in the way)",
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
        self.retried = Counter(
            "kvstore_router_retried_total",
            "requests sent to another replica after theirs refused the connection",
            registry=self.registry,
        )
        self.down = Gauge("kvstore_router_replicas_down", "replicas not answering", registry=self.registry)
        for name in replicas:
            self.requests.labels(name)
            self.in_flight.labels(name)


class _NotSent(Exception):
    """The replica could not be reached: nothing of the request went out."""


def build_app(
    backends: Sequence[str], router: Router, tokenize: Tokenize, settings: FrontSettings | None = None
) -> web.Application:
    """The router's application; ``backends[i]`` is the base URL of ``router.replicas[i]``.
    Serve it with ``runner`` or ``run`` (they set the header timeout and handler cancellation)."""
    if len(backends) != len(router.replicas):
        raise ValueError(f"{len(backends)} backends for {len(router.replicas)} replicas")
    front = settings or FrontSettings()
    callers = Callers(front.keys, front.ops_tenants, front.ops_loopback)
    if not callers.keyed:
        log.warning("no API keys: every caller is one tenant, and shares its cache")
    health = ReplicaHealth(router.replicas, backends, front.probe_interval_s)
    metrics = _Metrics(router.replicas)
    app = web.Application(client_max_size=front.max_body_bytes)
    app[HEALTH] = health
    state: dict[str, aiohttp.ClientSession] = {}

    async def start(_app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=front.upstream_timeout_s, connect=front.connect_timeout_s)
        state["session"] = aiohttp.ClientSession(timeout=timeout)
        health.start(state["session"])

    async def stop(_app: web.Application) -> None:
        await health.stop()
        await state["session"].close()

    def upstream_headers(request: web.Request) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if not callers.keyed:  # the engines' own keys are the check: the caller's goes through
            if "Authorization" in request.headers:
                headers["Authorization"] = request.headers["Authorization"]
        elif front.backend_key:
            headers["Authorization"] = f"Bearer {front.backend_key}"
        return headers

    async def routed(request: web.Request) -> web.StreamResponse:
        try:
            tenant = callers.tenant(request.headers.get("Authorization"))
        except Refused as exc:
            return _error(401, str(exc))
        try:
            async with asyncio.timeout(front.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            slow = _error(408, f"the body did not arrive within {front.body_timeout_s:g} s")
            slow.force_close()
            return slow
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the body is larger than {front.max_body_bytes} bytes")
        try:
            body = parse_body(raw, request.path)
        except BadBody as exc:
            return _error(400, str(exc))
        body["cache_salt"] = tenant_salt(front.salt_secret, tenant, body.get("cache_salt") or "")
        loop = asyncio.get_running_loop()
        try:
            tokens = await loop.run_in_executor(None, tokenize, request.path, body)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
            return _error(400, f"cannot tokenize the prompt: {type(exc).__name__}: {exc}")
        route_request, _ = await loop.run_in_executor(None, router.request_for, tokens, body["cache_salt"])
        data = json.dumps(body).encode()
        headers = upstream_headers(request)
        tried: set[int] = set()
        while True:
            try:
                choice = router.admit(route_request, health.down() | tried)
            except Unavailable:
                return _error(503, "no replica is up")
            metrics.requests.labels(choice.name).inc()
            metrics.first_choice.inc(choice.first_choice)
            metrics.cached_tokens.inc(choice.cached_tokens)
            metrics.in_flight.labels(choice.name).inc()
            try:
                response, failure = await _forward(
                    request, state["session"], backends[choice.replica], data, headers, choice.name
                )
            except _NotSent as exc:
                health.failed(choice.replica, str(exc))
                tried.add(choice.replica)
                metrics.retried.inc()
                continue
            finally:
                metrics.in_flight.labels(choice.name).dec()
                router.finish(choice)
            if failure:
                health.failed(choice.replica, failure)
            return response

    async def models(request: web.Request) -> web.StreamResponse:
        try:
            callers.tenant(request.headers.get("Authorization"))
        except Refused as exc:
            return _error(401, str(exc))
        up = [i for i in range(len(backends)) if i not in health.down()]
        if not up:
            return _error(503, "no replica is up")
        try:
            response, _ = await _forward(
                request,
                state["session"],
                backends[up[0]],
                b"",
                upstream_headers(request),
                router.replicas[up[0]],
            )
        except _NotSent as exc:
            health.failed(up[0], str(exc))
            return _error(502, f"replica {router.replicas[up[0]]} cannot be reached")
        return response

    def operator(request: web.Request) -> bool:
        return callers.may_operate(request.headers.get("Authorization"), request.remote)

    async def health_answer(request: web.Request) -> web.Response:
        if not operator(request):
            return _error(403, "/health is for operators: an operator's key, or loopback where allowed")
        down = health.down()
        n = len(router.replicas)
        status = "ok" if not down else "down" if len(down) == n else "degraded"
        replicas = [{"name": name, "up": i not in down} for i, name in enumerate(router.replicas)]
        return web.json_response(
            {"status": status, "up": n - len(down), "down": len(down), "replicas": replicas},
            status=503 if len(down) == n else 200,
        )

    async def prometheus(request: web.Request) -> web.Response:
        if not operator(request):
            return _error(403, "/metrics is for operators: an operator's key, or loopback where allowed")
        metrics.down.set(len(health.down()))
        return web.Response(body=generate_latest(metrics.registry), content_type="text/plain")

    for path in _ROUTED_PATHS:
        app.router.add_post(path, routed)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health_answer)
    app.router.add_get("/metrics", prometheus)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def runner(app: web.Application, settings: FrontSettings) -> web.AppRunner:
    """An ``AppRunner`` for ``app`` with the front door's connection limits (see ``run``)."""
    return web.AppRunner(
        app,
        handler_cancellation=True,
        keepalive_timeout=settings.header_timeout_s,
        lingering_time=LINGER_S,
        access_log=None,
    )


def run(
    app: web.Application, settings: FrontSettings, host: str, port: int, tls: ssl.SSLContext | None
) -> None:
    """Serve ``app`` on ``host:port`` (TLS with ``tls``) through ``runner`` until SIGINT or
    SIGTERM. Raises ``OSError`` when it cannot listen there."""

    async def serve() -> None:
        front = runner(app, settings)
        await front.setup()
        try:
            await web.TCPSite(front, host, port, ssl_context=tls).start()
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
        finally:
            await front.cleanup()

    asyncio.run(serve())


async def _forward(
    request: web.Request,
    session: aiohttp.ClientSession,
    base: str,
    data: bytes,
    headers: dict[str, str],
    name: str,
) -> tuple[web.StreamResponse, str]:
    """The caller's response, and why the replica failed ("" when it did not). Raises
    ``_NotSent`` when the replica could not be reached."""
    url = base.rstrip("/") + request.path
    try:
        upstream = await session.request(request.method, url, data=data or None, headers=headers)
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        raise _NotSent(f"{type(exc).__name__}: {exc}") from None
    except TimeoutError:
        return _error(504, f"replica {name} did not answer in time"), "no answer in time"
    except aiohttp.ClientError as exc:
        return _error(502, f"replica {name} failed: {type(exc).__name__}"), type(exc).__name__
    try:
        failure = f"answered {upstream.status}" if upstream.status >= 500 else ""
        response = web.StreamResponse(status=upstream.status)
        response.content_type = upstream.content_type
        await response.prepare(request)
        while True:
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:  # the status is sent: the caller sees it cut
                upstream.close()
                return response, f"cut mid-answer: {type(exc).__name__}"
            if not chunk:
                break
            await response.write(chunk)
        await response.write_eof()
        upstream.release()
        return response, failure
    except BaseException:
        upstream.close()  # the caller left or broke off: the replica's connection goes, and its work
        raise


def _error(status: int, message: str) -> web.Response:
    kind = {401: "authentication_error", 403: "permission_error"}.get(
        status, "invalid_request_error" if status < 500 else "upstream_error"
    )
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
