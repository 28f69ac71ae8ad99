"""``kvstore route``'s HTTP side (``kvstore/routing/http.py``): routing, streaming passed through,
metrics, a dead replica, a bad body. The replicas here are small aiohttp apps that say who
served a request; the router in front of real vLLM OpenAI servers is the fleet end-to-end test's
business."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from benchmarks.tiny_model import build_tiny_llama
from kvstore.keys import Fingerprint
from kvstore.routing import BoundedRendezvous, Router
from kvstore.routing.http import build_app, tokenizer_for

FP = Fingerprint(b"\x07" * 32)


def tokenize(path: str, body: dict[str, Any]) -> list[int]:
    text = body.get("prompt") if path == "/v1/completions" else json.dumps(body.get("messages"))
    return [ord(c) for c in str(text)]


def replica(name: str) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i in range(3):
                await response.write(f"data: {json.dumps({'served_by': name, 'i': i})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            return response
        return web.json_response(
            {"served_by": name, "prompt": body.get("prompt"), "auth": request.headers.get("Authorization")}
        )

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": f"model-of-{name}"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def serving(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def with_fleet(
    test: Callable[[aiohttp.ClientSession, str, Router, list[str]], Awaitable[None]], dead: bool = False
) -> None:
    async def main() -> None:
        runners, urls = [], []
        for name in ("a", "b", "c"):
            runner, url = await serving(replica(name))
            runners.append(runner)
            urls.append(url)
        if dead:
            urls[2] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        names = ["a", "b", "c"]
        router = Router(names, BoundedRendezvous(names, slack=1.25), FP, tokens_per_block=4, prefix_tokens=16)
        front, front_url = await serving(build_app(urls, router, tokenize))
        try:
            async with aiohttp.ClientSession() as session:
                await test(session, front_url, router, names)
        finally:
            await front.cleanup()
            for runner in runners:
                await runner.cleanup()

    asyncio.run(main())


def test_a_shared_prefix_goes_to_one_replica_and_prefixes_spread() -> None:
    async def test(session: aiohttp.ClientSession, url: str, router: Router, names: list[str]) -> None:
        served = set()
        for turn in range(5):  # one conversation's turns share their first 16 tokens
            body = {"prompt": "system prompt 16" + f" turn {turn}", "max_tokens": 1}
            async with session.post(
                url + "/v1/completions", json=body, headers={"Authorization": "Bearer t"}
            ) as r:
                assert r.status == 200
                answer = await r.json()
                assert answer["prompt"] == body["prompt"] and answer["auth"] == "Bearer t"  # passed through
                served.add(answer["served_by"])
        assert len(served) == 1
        spread = set()
        for doc in range(30):
            async with session.post(
                url + "/v1/completions", json={"prompt": f"document {doc:04d} ........"}
            ) as r:
                spread.add((await r.json())["served_by"])
        assert spread == set(names)
        stats = router.stats()
        assert stats.routed == 35 and stats.first_choice == 35 and stats.in_flight == (0, 0, 0)

    with_fleet(test)


def test_streams_pass_through_in_order_and_metrics_count_them() -> None:
    async def test(session: aiohttp.ClientSession, url: str, router: Router, names: list[str]) -> None:
        body = {"messages": [{"role": "user", "content": "hello"}], "stream": True}
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            text = (await r.read()).decode()
        events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
        assert events[-1] == "[DONE]" and [json.loads(e)["i"] for e in events[:-1]] == [0, 1, 2]
        async with session.get(url + "/metrics") as r:
            metrics = await r.text()
        served_by = json.loads(events[0])["served_by"]
        assert f'kvstore_router_requests_total{{replica="{served_by}"}} 1.0' in metrics
        assert "kvstore_router_first_choice_total 1.0" in metrics
        assert f'kvstore_router_in_flight{{replica="{served_by}"}} 0.0' in metrics
        async with session.get(url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "model-of-a"
        async with session.get(url + "/health") as r:
            assert (await r.json())["replicas"] == names

    with_fleet(test)


def test_a_dead_replica_is_a_502_and_the_others_keep_serving() -> None:
    async def test(session: aiohttp.ClientSession, url: str, router: Router, names: list[str]) -> None:
        statuses = []
        for doc in range(30):
            async with session.post(
                url + "/v1/completions", json={"prompt": f"document {doc:04d} ........"}
            ) as r:
                statuses.append(r.status)
                if r.status == 502:
                    error = (await r.json())["error"]
                    assert error["type"] == "upstream_error" and "failed" in error["message"]
        assert 502 in statuses and 200 in statuses
        assert router.stats().in_flight == (0, 0, 0)  # failures release their place too

    with_fleet(test, dead=True)


def test_a_body_that_is_not_json_is_a_400() -> None:
    async def test(session: aiohttp.ClientSession, url: str, router: Router, names: list[str]) -> None:
        async with session.post(url + "/v1/completions", data=b"{not json") as r:
            assert r.status == 400 and "invalid JSON" in (await r.json())["error"]["message"]
        assert router.stats().routed == 0

    with_fleet(test)


def test_prompts_are_tokenized_as_the_engine_tokenizes_them(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = build_tiny_llama(tmp_path / "tiny", seed=0)
    tokenize_model = tokenizer_for(model)
    reference = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    text = "word1 token2 text3 word4"
    assert tokenize_model("/v1/completions", {"prompt": text}) == reference.encode(text)
    assert tokenize_model("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]  # token ids as they are
    chat = tokenize_model("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})
    assert chat and all(isinstance(t, int) for t in chat)
