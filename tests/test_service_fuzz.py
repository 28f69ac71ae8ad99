"""Thousands of malformed and random requests through a real server. It must stay up, answer
each with a status code from the contract (never INTERNAL or UNKNOWN), and afterwards still
serve the blocks stored before, byte for byte."""

from __future__ import annotations

import os
import shutil
import tempfile

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.client import connect
from kvstore.frames import encode_frame
from kvstore.keys import block_keys
from kvstore.server.config import load_settings
from kvstore.server.serve import start_server
from proto import kvstore_pb2 as pb
from tests.service_fixtures import BLOCK, MODEL, settings_for

OK = grpc.StatusCode.OK
CONTRACT = {
    OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
}
UNARY = {
    "Register": (pb.RegisterRequest, pb.RegisterResponse),
    "Lookup": (pb.LookupRequest, pb.LookupResponse),
    "Exists": (pb.ExistsRequest, pb.ExistsResponse),
    "Heads": (pb.HeadsRequest, pb.HeadsResponse),
    "Delete": (pb.DeleteRequest, pb.DeleteResponse),
    "Invalidate": (pb.InvalidateRequest, pb.InvalidateResponse),
    "Demote": (pb.DemoteRequest, pb.DemoteResponse),
    "Stats": (pb.StatsRequest, pb.StatsResponse),
    "Release": (pb.ReleaseRequest, pb.ReleaseResponse),
    "Attach": (pb.AttachRequest, pb.AttachResponse),
    "Resolve": (pb.ResolveRequest, pb.ResolveResponse),
    "Reserve": (pb.ReserveRequest, pb.ReserveResponse),
    "Commit": (pb.CommitRequest, pb.CommitResponse),
    "Abort": (pb.AbortRequest, pb.AbortResponse),
}
FP = MODEL.fingerprint()

keys = st.lists(
    st.one_of(st.binary(min_size=0, max_size=40), st.binary(min_size=32, max_size=32)), max_size=8
)
fingerprints = st.one_of(st.just(FP), st.binary(max_size=40))
tokens = st.sampled_from([None, "tok-a", "tok-b", "tok-c", "tok-ops", "nonsense", ""])
scopes = st.sampled_from(["", "public", "secret", "x" * 300])
ids = st.integers(min_value=0, max_value=2**64 - 1)
ttls = st.floats(allow_nan=True, allow_infinity=True)

requests = st.one_of(
    st.builds(
        lambda f, k, t, s: ("Lookup", pb.LookupRequest(fingerprint=f, keys=k, pin_ttl_s=t, scope=s)),
        fingerprints,
        keys,
        ttls,
        scopes,
    ),
    st.builds(
        lambda f, k, s: ("Exists", pb.ExistsRequest(fingerprint=f, keys=k, scope=s)),
        fingerprints,
        keys,
        scopes,
    ),
    st.builds(
        lambda f, k, n, s: ("Heads", pb.HeadsRequest(fingerprint=f, keys=k, head_bytes=n, scope=s)),
        fingerprints,
        keys,
        st.integers(0, 2**32 - 1),
        scopes,
    ),
    st.builds(
        lambda k: ("Delete", pb.DeleteRequest(fingerprint=FP, keys=[x for x in k if len(x) != 32])), keys
    ),
    st.builds(
        lambda f: ("Invalidate", pb.InvalidateRequest(fingerprint=f)),
        st.binary(max_size=40).filter(lambda b: b != FP),
    ),
    st.builds(
        lambda t: ("Invalidate", pb.InvalidateRequest(tenant=t)), st.sampled_from(["", "tenant-b", "*"])
    ),
    st.builds(
        lambda t, f: ("Demote", pb.DemoteRequest(tier=t, fingerprint=f)),
        st.sampled_from(["dram", "nvme", "hbm", "", "\x00dram"]),
        st.sampled_from([b"", FP, b"\x01" * 5]),
    ),
    st.builds(lambda i: ("Release", pb.ReleaseRequest(lease_id=i)), ids),
    st.builds(lambda i: ("Commit", pb.CommitRequest(reservation_id=i)), ids),
    st.builds(lambda i: ("Abort", pb.AbortRequest(reservation_id=i)), ids),
    st.builds(lambda: ("Attach", pb.AttachRequest())),
    st.builds(lambda: ("Stats", pb.StatsRequest())),
    st.builds(
        lambda f, k, t: ("Resolve", pb.ResolveRequest(fingerprint=f, keys=k, ttl_s=t)),
        fingerprints,
        keys,
        ttls,
    ),
    st.builds(
        lambda f, k, z, p, t: (
            "Reserve",
            pb.ReserveRequest(fingerprint=f, keys=k, sizes=z, parent=p, ttl_s=t),
        ),
        fingerprints,
        keys,
        st.lists(st.integers(0, 2**40), max_size=8),
        st.binary(max_size=40),
        ttls,
    ),
    st.builds(
        lambda n, layers, h, d: (
            "Register",
            pb.RegisterRequest(
                identity=pb.ModelIdentity(
                    model_id=n,
                    num_layers=layers,
                    num_kv_heads=h,
                    head_dim=d,
                    tokens_per_block=16,
                    kv_dtype="bfloat16",
                )
            ),
        ),
        st.text(max_size=20),
        st.integers(0, 2**32 - 1),
        st.integers(0, 4),
        st.integers(0, 4),
    ),
    st.builds(
        lambda m, raw: (m, raw), st.sampled_from(sorted(UNARY)), st.binary(max_size=200)
    ),  # raw garbage
    st.builds(lambda f, k: ("Get", pb.GetRequest(fingerprint=f, keys=k)), fingerprints, keys),
    st.builds(lambda frames: ("Put", frames), st.lists(st.binary(max_size=100), min_size=0, max_size=4)),
    st.builds(
        lambda k, n, f: ("Put", [encode_frame(k, b"\x01" * n, f)]),
        st.binary(min_size=32, max_size=32),
        st.sampled_from([0, 1, BLOCK - 1, BLOCK + 1]),
        fingerprints,
    ),
)


def _send(channel: grpc.Channel, method: str, request: object, token: str | None) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    path = f"/kvstore.v1.KvStore/{method}"
    try:
        if method == "Get":
            for _ in channel.unary_stream(path, request_serializer=pb.GetRequest.SerializeToString)(
                request, metadata=metadata, timeout=10
            ):
                pass
        elif method == "Put":
            assert isinstance(request, list)
            channel.stream_unary(path)(iter(request), metadata=metadata, timeout=10)
        else:
            serializer = (lambda b: b) if isinstance(request, bytes) else type(request).SerializeToString
            channel.unary_unary(path, request_serializer=serializer)(request, metadata=metadata, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return OK


def test_random_and_malformed_requests_never_break_the_server() -> None:
    data_dir = tempfile.mkdtemp(prefix="kvf-", dir="/tmp")
    server = start_server(load_settings(env={}, overrides=settings_for(data_dir)))
    try:
        good_keys = block_keys(FP, list(range(16 * 6)), 16)
        good = [os.urandom(BLOCK) for _ in good_keys]
        with connect(server.tcp_address or "", token="tok-a") as kv:
            kv.register(MODEL)
            assert kv.put(FP, good_keys, good) == 6
        tcp = grpc.insecure_channel(server.tcp_address or "")
        unix = grpc.insecure_channel(server.unix_address)
        seen: dict[str, set[grpc.StatusCode]] = {}

        @settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(request=requests, token=tokens, via_unix=st.booleans())
        def fuzz(request: tuple[str, object], token: str | None, via_unix: bool) -> None:
            method, body = request
            code = _send(unix if via_unix else tcp, method, body, token)
            seen.setdefault(method, set()).add(code)
            assert code in CONTRACT, f"{method} answered {code}"

        fuzz()
        # Every kind of failure the contract names was exercised, and plenty of calls succeeded.
        codes = set().union(*seen.values())
        assert {
            OK,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.NOT_FOUND,
        } <= codes
        with connect(server.tcp_address or "", token="tok-a") as kv:
            assert kv.get(FP, good_keys) == good  # nothing stored was disturbed
        tcp.close()
        unix.close()
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
