"""``kvstore route``'s HTTP side (``kvstore/routing/http.py``) on 127.0.0.1 in front of real HTTP
replicas (``tests/router_fleet.py``): routing, streaming passed through, callers' keys and
tenants' salts, operators' /metrics and /health, a dead replica and its return. The attacks on
the front door (bodies, slow callers, callers that leave, TLS) are ``test_router_attacks.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.tiny_model import build_tiny_llama
from kvstore.cli.route import read_keys_file
from kvstore.errors import FailedPrecondition
from kvstore.routing.callers import tenant_salt
from kvstore.routing.http import tokenizer_for
from tests.router_fleet import NAMES, OPS, SALT_SECRET, B, Fleet, wait_for, with_fleet


def test_a_shared_prefix_goes_to_one_replica_and_prefixes_spread() -> None:
    async def test(fleet: Fleet) -> None:
        served = set()
        for turn in range(5):  # one conversation's turns share their first 16 tokens
            body = {"prompt": "system prompt 16" + f" turn {turn}", "max_tokens": 1}
            status, answer = await fleet.post(body)
            assert status == 200 and answer["prompt"] == body["prompt"]
            assert answer["auth"] == "Bearer engine-secret"  # the caller's key stays at the router
            served.add(answer["served_by"])
        assert len(served) == 1
        spread = set()
        for doc in range(30):
            spread.add((await fleet.post({"prompt": f"document {doc:04d} ........"}))[1]["served_by"])
        assert spread == set(NAMES)
        stats = fleet.router.stats()
        assert stats.routed == 35 and stats.first_choice == 35 and stats.in_flight == (0, 0, 0)

    with_fleet(test)


def test_streams_pass_through_in_order_and_metrics_count_them() -> None:
    async def test(fleet: Fleet) -> None:
        body = {"messages": [{"role": "user", "content": "hello"}], "stream": True}
        async with fleet.session.post(
            fleet.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-a"}
        ) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            text = (await r.read()).decode()
        events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
        assert events[-1] == "[DONE]" and [json.loads(e)["i"] for e in events[:-1]] == [0, 1, 2]
        status, metrics = await fleet.get("/metrics", OPS)
        served_by = json.loads(events[0])["served_by"]
        assert status == 200
        assert f'kvstore_router_requests_total{{replica="{served_by}"}} 1.0' in metrics
        assert "kvstore_router_first_choice_total 1.0" in metrics
        assert f'kvstore_router_in_flight{{replica="{served_by}"}} 0.0' in metrics
        async with fleet.session.get(fleet.url + "/v1/models", headers=B) as r:
            assert (await r.json())["data"][0]["id"] == "model-of-r0"
        status, health = await fleet.get("/health", OPS)
        assert status == 200 and json.loads(health)["replicas"] == [{"name": n, "up": True} for n in NAMES]

    with_fleet(test)


def test_callers_need_a_key_and_metrics_and_health_are_for_operators_only() -> None:
    async def test(fleet: Fleet) -> None:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-a"}):
            status, answer = await fleet.post({"prompt": "hello"}, headers)
            assert status == 401 and answer["error"]["type"] == "authentication_error"
        for path in ("/metrics", "/health"):
            for headers in ({}, {"Authorization": "Bearer key-a"}):  # anonymous, or a tenant's key
                status, text = await fleet.get(path, headers)
                assert status == 403 and "kvstore_router" not in text and "127.0.0.1" not in text
        assert fleet.router.stats().routed == 0

    with_fleet(test)


def test_loopback_operators_when_allowed() -> None:
    async def test(fleet: Fleet) -> None:
        status, text = await fleet.get("/metrics")
        assert status == 200 and "kvstore_router_cached_tokens_total" in text

    with_fleet(test, ops_loopback=True)


def test_a_tenant_cannot_name_another_tenants_salt() -> None:
    async def test(fleet: Fleet) -> None:
        _, a = await fleet.post({"prompt": "same prompt"})
        _, b = await fleet.post({"prompt": "same prompt"}, B)
        salt_a, salt_b = tenant_salt(SALT_SECRET, "tenant-a"), tenant_salt(SALT_SECRET, "tenant-b")
        assert a["cache_salt"] == salt_a != b["cache_salt"] == salt_b
        for asked in (b["cache_salt"], "tenant-b", ""):  # B's salt as B's requests carry it, and raw
            _, forged = await fleet.post({"prompt": "same prompt", "cache_salt": asked})
            assert forged["cache_salt"] != b["cache_salt"]
        _, own = await fleet.post({"prompt": "same prompt", "cache_salt": "mine"})
        assert own["cache_salt"] == tenant_salt(SALT_SECRET, "tenant-a", "mine") != salt_a  # namespaced

    with_fleet(test)


def test_a_dead_replica_gets_no_requests_until_it_answers_again() -> None:
    async def test(fleet: Fleet) -> None:
        served = []
        for doc in range(30):  # r2 refuses connections: its share goes to the others, all answered
            status, answer = await fleet.post({"prompt": f"document {doc:04d} ........"})
            assert status == 200
            served.append(answer["served_by"])
        assert "r2" not in served and fleet.router.stats().in_flight == (0, 0, 0)
        status, health = await fleet.get("/health", OPS)
        assert status == 200 and json.loads(health)["status"] == "degraded"
        assert {"name": "r2", "up": False} in json.loads(health)["replicas"] and "127.0.0.1" not in health
        before = fleet.router.stats().routed
        await fleet.start_replica(2)  # back: the probe sees it within its interval
        assert await wait_for(lambda: 2 not in fleet.router_down())
        back = [
            (await fleet.post({"prompt": f"document {doc:04d} ........"}))[1]["served_by"]
            for doc in range(30)
        ]
        assert "r2" in back and fleet.router.stats().routed == before + 30

    with_fleet(test, dead=(2,))


def test_a_replica_that_does_not_answer_in_time_is_a_504_and_gets_no_more_requests() -> None:
    async def test(fleet: Fleet) -> None:
        status, answer = await fleet.post({"prompt": "slow"})  # a replica that sleeps 30 s
        assert status == 504 and answer["error"]["type"] == "upstream_error"
        assert "127.0.0.1" not in answer["error"]["message"]  # named, not located
        (late,) = fleet.router_down()
        assert await wait_for(lambda: fleet.seen.running == 0)  # its request was dropped there
        served = {
            (await fleet.post({"prompt": f"document {d:04d} ........"}))[1]["served_by"] for d in range(20)
        }
        assert NAMES[late] not in served and len(served) == 2

    with_fleet(test, upstream_timeout_s=0.5, probe_interval_s=30.0)


def test_health_is_not_ok_with_every_replica_down() -> None:
    async def test(fleet: Fleet) -> None:
        for i in range(3):
            await fleet.stop_replica(i)
        assert await wait_for(lambda: len(fleet.router_down()) == 3)
        status, health = await fleet.get("/health", OPS)
        assert status == 503 and json.loads(health)["status"] == "down"
        status, answer = await fleet.post({"prompt": "anyone?"})
        assert status == 503 and answer["error"]["message"] == "no replica is up"

    with_fleet(test)


def test_the_keys_file_must_be_the_owners_alone(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("key-a=tenant-a\n")
    os.chmod(keys, 0o644)
    with pytest.raises(FailedPrecondition, match=r"--keys-file .* readable by group or others"):
        read_keys_file(str(keys))
    os.chmod(keys, 0o600)
    assert read_keys_file(str(keys)) == {"key-a": "tenant-a"}


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
