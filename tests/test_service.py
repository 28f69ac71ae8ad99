"""The service's rules through real gRPC on 127.0.0.1 and a Unix socket: tenancy, leases and
their limits, the status code of every bad request, health, reflection, metrics, the audit log.

Both data planes moving bytes are in test_service_data_planes.py; the pipelined same-host
writes and reads in test_service_pipelined.py."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.client import connect
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    LeaseExpired,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvstore.frames import encode_frame
from kvstore.keys import ModelIdentity
from tests.service_fixtures import BLOCK, MODEL, Served, blocks_for, chain, served

__all__ = ["served"]


def test_tcp_needs_a_valid_token(served: Served) -> None:
    keys = chain(1)
    with connect(served.tcp) as anonymous, pytest.raises(Unauthenticated):
        anonymous.lookup(MODEL.fingerprint(), keys)
    with connect(served.tcp, token="wrong") as bad, pytest.raises(Unauthenticated):
        bad.lookup(MODEL.fingerprint(), keys)


def test_tenants_cannot_reach_each_others_blocks(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(4)
    blocks = blocks_for(keys)
    with connect(served.tcp, token="tok-a") as a, connect(served.tcp, token="tok-b") as b:
        a.put(fp, keys, blocks)
        assert b.lookup(fp, keys) == 0
        assert b.exists(fp, keys) == [False] * 4
        assert b.get(fp, keys) == []
        assert b.delete(fp, keys) == 0
        assert b.invalidate(fp) == 0
        with pytest.raises(PermissionDenied):
            b.invalidate(fp, tenant="tenant-a")
        lease = a.lookup_tiers(fp, keys, pin_ttl_s=30).lease_id
        with pytest.raises(NotFound):
            b.release(lease)  # not b's lease: indistinguishable from none
        a.release(lease)
        b_blocks = blocks_for(keys)
        b.put(fp, keys, b_blocks)  # same keys, b's own copy
        assert a.get(fp, keys) == blocks
        assert b.get(fp, keys) == b_blocks


def test_shared_scope_is_shared_only_with_grantees(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(3, salt="public-prompt")
    blocks = blocks_for(keys)
    with (
        connect(served.tcp, token="tok-a") as a,
        connect(served.tcp, token="tok-b") as b,
        connect(served.tcp, token="tok-c") as c,
    ):
        a.put(fp, keys, blocks, scope="public")
        assert b.get(fp, keys, scope="public") == blocks
        assert b.lookup(fp, keys) == 0  # not in b's own namespace
        with pytest.raises(PermissionDenied):
            c.lookup(fp, keys, scope="public")


def test_invalidate_own_and_admin_everything(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(2)
    with connect(served.tcp, token="tok-a") as a, connect(served.tcp, token="tok-ops") as ops:
        a.put(fp, keys, blocks_for(keys))
        assert a.invalidate(fp) == 2
        a.put(fp, keys, blocks_for(keys))
        assert ops.invalidate(everything=True, tenant="*") >= 2
        assert a.lookup(fp, keys) == 0


def test_demote_moves_own_blocks_to_nvme_and_admins_any(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys, other = chain(3, "d"), chain(2, "e")
    with (
        connect(served.tcp, token="tok-a") as a,
        connect(served.tcp, token="tok-b") as b,
        connect(served.tcp, token="tok-ops") as ops,
    ):
        blocks = blocks_for(keys)
        a.put(fp, keys, blocks)
        b.put(fp, other, blocks_for(other))
        assert a.demote("dram", fp) == 3
        assert a.lookup_tiers(fp, keys).tiers == ("nvme",) * 3
        assert b.lookup_tiers(fp, other).tiers == ("dram",) * 2  # not a's to move
        assert a.get(fp, keys) == blocks  # served from nvme (and promoted again)
        with pytest.raises(PermissionDenied):
            a.demote("dram", tenant="tenant-b")
        assert ops.demote("dram", tenant="*") >= 2
        assert b.lookup_tiers(fp, other).tiers == ("nvme",) * 2
        with pytest.raises(InvalidArgument):
            a.demote("nvme")
        with pytest.raises(InvalidArgument):
            a.demote("dram", b"short")


def test_bad_requests_get_actionable_codes(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(2)
    with connect(served.tcp, token="tok-a") as a, connect(served.tcp, token="tok-c") as c:
        a.register(MODEL)
        with pytest.raises(InvalidArgument, match="32 bytes"):
            a.lookup(fp, [b"short"])
        with pytest.raises(InvalidArgument, match="32 bytes"):
            a.lookup(b"\x00" * 31, keys)
        with pytest.raises(InvalidArgument, match="layout"):
            a.put(fp, keys[:1], [b"x" * (BLOCK - 1)])
        with pytest.raises(NotFound):
            a.release(987654)
        lease = a.lookup_tiers(fp, keys, pin_ttl_s=30).lease_id
        assert lease == 0  # nothing hit, nothing pinned
        a.put(fp, keys, blocks_for(keys))
        lease = a.lookup_tiers(fp, keys, pin_ttl_s=30).lease_id
        a.release(lease)
        with pytest.raises(NotFound):
            a.release(lease)  # double release
        lease = a.lookup_tiers(fp, keys, pin_ttl_s=0.05).lease_id
        import time

        time.sleep(0.1)
        a.lookup(fp, keys)  # any call collects expired leases
        with pytest.raises(LeaseExpired):
            a.release(lease)
        with pytest.raises(ResourceExhausted, match="quota"):
            c.put(fp, chain(5, "c"), blocks_for(chain(5, "c")))
        with pytest.raises(NotFound):
            a.commit(424242)
        with pytest.raises(FailedPrecondition):
            a.attach()  # the arena is for the Unix socket


def test_oversized_and_malformed_frames(served: Served) -> None:
    channel = grpc.insecure_channel(served.tcp)
    put = channel.stream_unary("/kvstore.v1.KvStore/Put")
    meta = (("authorization", "Bearer tok-a"),)
    with pytest.raises(grpc.RpcError) as info:
        put(iter([encode_frame(b"k" * 32, b"x" * (5 << 20), MODEL.fingerprint())]), metadata=meta)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as info:
        put(iter([b"\x0a\xff\xff"]), metadata=meta)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        put(iter([encode_frame(b"k" * 32, b"x")]), metadata=meta)  # no fingerprint on frame 1
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()


def test_draining_server_refuses_new_requests(served: Served) -> None:
    served.server.service.draining.set()
    with connect(served.unix) as kv, pytest.raises(Unavailable, match="draining"):
        kv.lookup(MODEL.fingerprint(), chain(1))
    served.server.service.draining.clear()


def test_health_and_reflection(served: Served) -> None:
    channel = grpc.insecure_channel(served.tcp)
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KvStore"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert "kvstore.v1.KvStore" in names
    channel.close()


def test_metrics_count_tokens_by_tenant_and_tier(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(4)
    with connect(served.tcp, token="tok-a") as a:
        a.register(MODEL)
        a.put(fp, keys, blocks_for(keys))
        a.lookup(fp, [*keys, *chain(2, "miss")])
    text = urllib.request.urlopen(f"http://127.0.0.1:{served.server.metrics_port}/metrics").read().decode()
    assert 'kvstore_lookup_tokens_total{result="hit",tenant="tenant-a"} 64.0' in text
    assert 'kvstore_lookup_tokens_total{result="miss",tenant="tenant-a"} 32.0' in text
    assert 'kvstore_hit_tokens_total{tenant="tenant-a",tier="dram"} 64.0' in text
    assert 'kvstore_tier_used_bytes{tier="dram"}' in text
    assert "kvstore_request_seconds_bucket" in text
    assert "kvstore_checksum_failures_total 0.0" in text


def test_data_port_refuses_strangers_and_bad_tokens(served: Served) -> None:
    import socket

    from kvstore.client.dataport import DataPortClient
    from kvstore.status import Status
    from kvstore.wire import read_status

    port = served.server.service.data_port
    assert port > 0
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"HTTP")
        assert read_status(s)[0] == Status.INVALID_ARGUMENT
    with pytest.raises(Unauthenticated):
        DataPortClient("127.0.0.1", port, "wrong", "")
    with pytest.raises(Unauthenticated):
        DataPortClient("127.0.0.1", port, None, "")
    with pytest.raises(PermissionDenied):
        DataPortClient("127.0.0.1", port, "tok-c", "public")
    client = DataPortClient("127.0.0.1", port, "tok-a", "")
    with pytest.raises(FailedPrecondition, match="Unix socket"):
        client.resolve(MODEL.fingerprint(), chain(1), 5.0)  # arena slots mean nothing remotely
    client = DataPortClient("127.0.0.1", port, "tok-a", "")
    with pytest.raises(InvalidArgument, match="layout"):
        connect(served.tcp, token="tok-a").register(MODEL)
        client.put(MODEL.fingerprint(), chain(1), [b"x" * 10])
    client.close()


def test_a_tenant_sees_only_its_own_figures(served: Served) -> None:
    fp = MODEL.fingerprint()
    with connect(served.tcp, token="tok-a") as a, connect(served.tcp, token="tok-b") as b:
        a.put(fp, chain(6, salt="a"), blocks_for(chain(6, salt="a")))
        b.put(fp, chain(2, salt="b"), blocks_for(chain(2, salt="b")))
        a_stats, b_stats = a.stats(), b.stats()
    with connect(served.unix) as admin:  # the Unix tenant is an admin here
        everything = admin.stats()
    assert b_stats["blocks"] == 2 and a_stats["blocks"] == 6
    dram = next(t for t in b_stats["tiers"] if t["name"] == "dram")
    assert dram["blocks"] == 2 and dram["used_bytes"] == 2 * BLOCK  # (nvme may hold copies too)
    assert all(t["blocks"] <= 2 for t in b_stats["tiers"])
    assert [(f["fingerprint"], f["blocks"]) for f in b_stats["fingerprints"]] == [(fp.hex(), 2)]
    assert list(b_stats["tenant_bytes"]) == ["t/tenant-b"]
    assert everything["blocks"] >= 8 and sum(f["blocks"] for f in everything["fingerprints"]) >= 8


def test_lease_lifetimes_are_capped_and_checked(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(2, salt="ttl")
    with connect(served.tcp, token="tok-a") as a:
        a.put(fp, keys, blocks_for(keys))
        with pytest.raises(InvalidArgument, match="lease lifetime"):
            a.lookup_tiers(fp, keys, pin_ttl_s=float("inf"))
        assert a.lookup_tiers(fp, keys, pin_ttl_s=-1.0).lease_id == 0  # <= 0: look, do not pin
        lease = a.lookup_tiers(fp, keys, pin_ttl_s=1e9).lease_id  # accepted, capped by the server
    expires = served.server.store.leases._held[lease][0]
    assert expires - served.server.store.leases._clock() <= served.server.store.config.max_lease_ttl_s


def test_a_huge_announced_block_is_refused_before_anything_is_evicted(served: Served) -> None:
    fp = MODEL.fingerprint()
    keys = chain(8, salt="victim")
    with connect(served.tcp, token="tok-b") as b, connect(served.tcp, token="tok-a") as a:
        stored = blocks_for(keys)
        b.put(fp, keys, stored)
        before = served.server.store.stats().counters.get("evictions", 0)
        for size in (1 << 62, (64 << 20) + 1):
            with pytest.raises(InvalidArgument, match="max_block_bytes"):
                _announce(served, size)
        assert b.get(fp, keys) == stored
        assert served.server.store.stats().counters.get("evictions", 0) == before
        assert a.lookup(fp, chain(1, salt="huge")) == 0


def _announce(served: Served, size: int) -> None:
    """A data-port put header announcing ``size`` bytes, and no payload."""
    import socket
    import struct

    from kvstore.status import Status
    from kvstore.wire import MAGIC, read_status, status_error

    host = served.tcp.rpartition(":")[0]
    data_port = served.server.data_port
    assert data_port is not None
    with socket.create_connection((host, data_port.port), timeout=10) as sock:
        token = b"tok-a"
        sock.sendall(MAGIC + struct.pack("<H", len(token)) + token + struct.pack("<H", 0))
        assert read_status(sock)[0] == Status.OK
        key = chain(1, salt="huge")[0]
        sock.sendall(put_header(key, size))
        raise status_error(*read_status(sock))


def put_header(key: bytes, size: int) -> bytes:
    """A one-block data-port put, up to where its payload begins."""
    import struct

    from kvstore.wire import OP_PUT

    head = struct.pack("<B", OP_PUT) + MODEL.fingerprint() + struct.pack("<B32s", 0, b"\0" * 32)
    return head + struct.pack("<I", 1) + key + struct.pack("<Q", size)


def test_a_same_host_write_that_finds_no_room_says_so(served: Served) -> None:
    from kvstore.errors import StoreFull

    fp = MODEL.fingerprint()
    pinned = chain(64, salt="pinned")  # the whole arena (64 blocks), pinned by a lease
    with connect(served.unix) as kv:
        kv.write(fp, pinned, blocks_for(pinned))
        lease = kv.lookup_tiers(fp, pinned, pin_ttl_s=30).lease_id
        assert served.server.store.stats().tiers[0].blocks == 64
        more = chain(8, salt="no-room")
        with pytest.raises(StoreFull) as full:
            kv.write(fp, more, blocks_for(more))
        assert "found no room" in str(full.value)
        assert full.value.stored == 8 - sum(not p for p in kv.exists(fp, more))
        again = chain(2, salt="pinned")  # present already: not a failure
        assert kv.write(fp, again, blocks_for(again)) == 0
        kv.release(lease)


def test_removals_and_admin_actions_are_audited_without_secrets(served: Served) -> None:
    from pathlib import Path

    from kvstore.server.audit import read_audit

    fp = MODEL.fingerprint()
    keys = chain(3, salt="audited")
    with connect(served.tcp, token="tok-a") as a, connect(served.tcp, token="tok-ops") as ops:
        a.put(fp, keys, blocks_for(keys))
        assert a.delete(fp, keys[2:]) == 1
        assert ops.invalidate(fp, tenant="tenant-a") == 2  # an admin acting on another tenant
    text = (Path(served.data_dir) / "audit.log").read_text()
    read = read_audit(Path(served.data_dir) / "audit.log")
    assert read.skipped == 0 and all(r["phase"] == "done" for r in read.actions)
    records = read.actions
    delete = next(r for r in records if r["action"] == "delete" and r["tenant"] == "tenant-a")
    assert delete["key_hashes"] == [keys[2].hex()] and delete["outcome"] == 1
    assert delete["fingerprint"] == fp.hex() and delete["namespace"] == "t/tenant-a"
    admin = next(r for r in records if r["action"] == "invalidate" and r["tenant"] == "ops")
    assert admin["namespace"] == "t/tenant-a" and admin["outcome"] == 2
    assert "tok-" not in text  # never a token (nor prompt text or block bytes: only hashes)
    assert (Path(served.data_dir) / "audit.log").stat().st_mode & 0o777 == 0o600


def test_one_tenant_cannot_fill_the_model_registry(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses
    import hashlib

    import kvstore.server.models as models
    from kvstore.errors import ResourceExhausted

    def model(name: str) -> ModelIdentity:  # other weights: the name alone is no new model
        return dataclasses.replace(
            MODEL, model_id=name, weights_digest=hashlib.sha256(name.encode()).hexdigest()
        )

    monkeypatch.setattr(models, "MAX_MODELS_PER_TENANT", 3)
    with connect(served.tcp, token="tok-b") as b, connect(served.tcp, token="tok-a") as a:
        for i in range(3):
            b.register(model(f"flood/{i}"))
        with pytest.raises(ResourceExhausted, match="registered 3 new model"):
            b.register(model("flood/3"))
        b.register(model("flood/0"))  # known already: fine
        a.register(model("a/own"))  # others still can


@pytest.mark.parametrize("data_plane", ["auto", "grpc"])
def test_request_metrics_are_the_same_whichever_transport(served: Served, data_plane: str) -> None:
    import re

    def count(method: str) -> float:
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{served.server.metrics_port}/metrics").read().decode()
        )
        found = re.search(rf'kvstore_request_seconds_count{{method="{method}"}} ([0-9.e+]+)', text)
        return float(found.group(1)) if found else 0.0

    fp = MODEL.fingerprint()
    keys = chain(2, salt=f"metrics-{data_plane}")
    before = {m: count(m) for m in ("Lookup", "Put", "Get")}
    with connect(served.tcp, token="tok-a", data_plane=data_plane) as a:
        a.put(fp, keys, blocks_for(keys))
        a.lookup(fp, keys)
        a.get(fp, keys)
    assert (
        count("Put") > before["Put"] and count("Lookup") > before["Lookup"] and count("Get") > before["Get"]
    )


def test_a_release_without_answer_lets_go_and_the_connection_carries_on(served: Served) -> None:
    """``release(wait=False)`` on the data port: no round trip; another tenant's lease, an
    unknown one or one released twice is ignored, not an error that would cut the connection."""
    fp = MODEL.fingerprint()
    keys = chain(3, salt="nowait")
    with connect(served.tcp, token="tok-a") as a, connect(served.tcp, token="tok-b") as b:
        a.put(fp, keys, blocks_for(keys))
        lease = a.lookup_tiers(fp, keys, pin_ttl_s=30).lease_id
        assert lease and a.stats()["leases"] >= 1
        b.release(lease, wait=False)  # not b's: ignored, b's connection carries on
        b.release(987654, wait=False)
        assert b.lookup(fp, keys) == 0
        assert a.stats()["leases"] >= 1  # still pinned: b could not release it
        a.release(lease, wait=False)
        a.release(lease, wait=False)  # twice: ignored
        assert a.lookup(fp, keys) == 3  # the same connection, answered in order
        with pytest.raises(NotFound):
            a.release(lease)  # a waited release still says so


def test_a_pinning_lookup_hands_out_arena_slots_whose_lease_can_be_checked(served: Served) -> None:
    """``lookup_tiers(..., slots=True)`` on the Unix socket: where each pinned hit lies in the
    arena (the same bytes a resolve reads), and ``lease_held`` says whether its pin still
    holds: true until released, false after, and false for any other tenant's lease."""
    fp = MODEL.fingerprint()
    keys = chain(3, salt="in-place")
    with connect(served.unix) as kv, connect(served.tcp, token="tok-a") as a:
        stored = blocks_for(keys)
        kv.put(fp, keys, stored)
        found = kv.lookup_tiers(fp, [*keys, *chain(1, salt="absent")], pin_ttl_s=30, slots=True)
        assert found.hit_blocks == 3 and found.tiers == ("dram",) * 3
        assert found.arena and len(found.slots) == 3 and None not in found.slots
        views = kv.arena_views(found.arena, [s for s in found.slots if s is not None])
        assert [bytes(v) for v in views] == stored
        del views
        assert kv.lease_held(found.lease_id)
        assert not a.lease_held(found.lease_id)  # another tenant's: as if there were none
        kv.release(found.lease_id)
        assert not kv.lease_held(found.lease_id)
        assert not kv.lease_held(found.lease_id + 1)  # never granted
        plain = kv.lookup_tiers(fp, keys, pin_ttl_s=30)
        assert plain.slots == () and plain.arena == ""  # only when asked for
        kv.release(plain.lease_id)
        unpinned = kv.lookup_tiers(fp, keys, slots=True)  # slots mean something only pinned
        assert unpinned.lease_id == 0 and unpinned.slots == ()
        a.put(fp, keys, stored)
        remote = a.lookup_tiers(fp, keys, pin_ttl_s=30, slots=True)  # TCP: no arena to map
        assert remote.hit_blocks == 3 and remote.slots == ()
        a.release(remote.lease_id)


def test_arena_slots_are_refused_over_tcp_at_the_wire(served: Served) -> None:
    from kvstore.client.dataport import DataPortClient

    client = DataPortClient("127.0.0.1", served.server.service.data_port, "tok-a", "")
    with pytest.raises(FailedPrecondition, match="Unix socket"):
        client.lookup_slots(MODEL.fingerprint(), chain(1), 5.0)
