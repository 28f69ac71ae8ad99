"""A router (``kvstore.routing.http``, served as ``kvstore route`` serves it) on 127.0.0.1 in front
of small real HTTP replicas: aiohttp apps that say who served a request, what salt and key they
were given, and whether a caller's departure reached them. The router is the part under test;
the engine in front of real vLLM servers is ``tests/test_vllm_route.py``'s."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from aiohttp import web

from kvstore.keys import Fingerprint
from kvstore.routing import BoundedRendezvous, Router
from kvstore.routing.http import HEALTH, FrontSettings, build_app, runner

FP = Fingerprint(b"\x07" * 32)
NAMES = ["r0", "r1", "r2"]
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b", "key-ops": "ops"}
SALT_SECRET = b"router-fleet-salt-secret"
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
OPS = {"Authorization": "Bearer key-ops"}
SETTINGS = FrontSettings(
    keys=KEYS,
    ops_tenants=frozenset({"ops"}),
    backend_key="engine-secret",
    salt_secret=SALT_SECRET,
    header_timeout_s=1.0,
    body_timeout_s=1.0,
    connect_timeout_s=1.0,
    upstream_timeout_s=30.0,
    probe_interval_s=0.2,
)


def tokenize(path: str, body: dict[str, Any]) -> list[int]:
    text = body.get("prompt") if path == "/v1/completions" else json.dumps(body.get("messages"))
    return [ord(c) for c in str(text)]


@dataclass
class Seen:
    """What the replicas saw."""

    cancelled: list[str] = field(default_factory=list)  # prompts whose caller's departure reached them
    running: int = 0


def replica(name: str, seen: Seen) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("prompt") == "slow":
            seen.running += 1
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                seen.cancelled.append(name)
                raise
            finally:
                seen.running -= 1
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i in range(3):
                await response.write(f"data: {json.dumps({'served_by': name, 'i': i})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            return response
        return web.json_response(
            {
                "served_by": name,
                "prompt": body.get("prompt"),
                "auth": request.headers.get("Authorization"),
                "cache_salt": body.get("cache_salt"),
            }
        )

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": f"model-of-{name}"}]})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def serve_replica(app: web.Application, port: int) -> web.AppRunner:
    # as vLLM's server does: a request whose caller left is cancelled
    r = web.AppRunner(app, handler_cancellation=True)
    await r.setup()
    await web.TCPSite(r, "127.0.0.1", port).start()
    return r


@dataclass
class Fleet:
    session: aiohttp.ClientSession
    url: str
    port: int
    router: Router
    seen: Seen
    ports: list[int]
    replicas: dict[int, web.AppRunner]
    app: web.Application

    def router_down(self) -> frozenset[int]:
        return self.app[HEALTH].down()

    async def start_replica(self, i: int) -> None:
        self.replicas[i] = await serve_replica(replica(NAMES[i], self.seen), self.ports[i])

    async def stop_replica(self, i: int) -> None:
        await self.replicas.pop(i).cleanup()

    async def post(
        self, body: dict[str, Any], headers: dict[str, str] | None = None, path: str = "/v1/completions"
    ) -> tuple[int, dict[str, Any]]:
        async with self.session.post(
            self.url + path, json=body, headers=A if headers is None else headers
        ) as r:
            return r.status, await r.json()

    async def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        async with self.session.get(self.url + path, headers=headers or {}) as r:
            return r.status, await r.text()


async def wait_for(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return True
        await asyncio.sleep(0.05)
    return check()


def with_fleet(
    test: Callable[[Fleet], Awaitable[None]],
    dead: tuple[int, ...] = (),
    settings: FrontSettings = SETTINGS,
    tls: ssl.SSLContext | None = None,
    **changes: Any,
) -> None:
    """Run ``test`` against a router over three replicas; those in ``dead`` are not started."""
    settings = replace(settings, **changes)

    async def main() -> None:
        ports = [free_port() for _ in NAMES]
        router = Router(NAMES, BoundedRendezvous(NAMES, slack=1.25), FP, tokens_per_block=4, prefix_tokens=16)
        app = build_app([f"http://127.0.0.1:{p}" for p in ports], router, tokenize, settings)
        front = runner(app, settings)
        port = free_port()
        scheme = "https" if tls else "http"
        async with aiohttp.ClientSession() as session:
            fleet = Fleet(session, f"{scheme}://127.0.0.1:{port}", port, router, Seen(), ports, {}, app)
            try:
                for i in range(len(NAMES)):
                    if i not in dead:
                        await fleet.start_replica(i)
                await front.setup()
                await web.TCPSite(front, "127.0.0.1", port, ssl_context=tls).start()
                await test(fleet)
            finally:
                await front.cleanup()
                for r in fleet.replicas.values():
                    await r.cleanup()

    asyncio.run(main())
