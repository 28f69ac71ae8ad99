"""``kvstore demo --service ADDRESS``: a short run against a live ``kvstore serve``.

One "engine" on the same host writes the KV blocks of a long shared prompt into the arena in
place; a "replica" elsewhere (over TCP, with its bearer token) finds the prefix and reads it
back byte for byte; another tenant finds nothing; then the server's stats.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvstore.client import connect
from kvstore.demo import MODEL, synthetic_kv
from kvstore.errors import KvStoreError
from kvstore.keys import block_keys


def run_service_demo(
    unix_address: str, tcp_address: str, token: str, say: Callable[[str], None] = print
) -> None:
    size = MODEL.block_bytes
    tokens = list(range(1000, 1000 + 6000))
    with connect(unix_address, token=token) as local:  # same tenant as the remote replica
        fp = local.register(MODEL)
        keys = block_keys(fp, tokens, MODEL.tokens_per_block, cache_salt="demo")
        blocks = [synthetic_kv(k, size) for k in keys]
        start = time.perf_counter()
        stored = local.write(fp, keys, blocks)
        say(
            f"same host: wrote {stored} blocks ({stored * size / 2**20:.0f} MiB) into the arena in place "
            f"in {(time.perf_counter() - start) * 1e3:.0f} ms"
        )
        outs = [memoryview(bytearray(size)) for _ in keys]
        start = time.perf_counter()
        n = local.read_into(fp, keys, outs)
        ok = all(bytes(o) == b for o, b in zip(outs, blocks, strict=True))
        say(f"same host: restored {n} blocks in {(time.perf_counter() - start) * 1e3:.1f} ms, exact: {ok}")
    with connect(tcp_address, token=token) as remote, connect(tcp_address, token="wrong-token") as stranger:
        start = time.perf_counter()
        got = remote.get(fp, keys)
        say(
            f"remote (TCP, token): {remote.lookup(fp, keys)} of {len(keys)} blocks present, fetched "
            f"{len(got)} in {(time.perf_counter() - start) * 1e3:.0f} ms, exact: {got == blocks}"
        )
        try:
            stranger.lookup(fp, keys)
        except KvStoreError as exc:
            say(f"a caller with a wrong token: refused ({type(exc).__name__})")
        stats = remote.stats()
        say("server tiers: " + ", ".join(f"{t['name']} {t['blocks']} blocks" for t in stats["tiers"]))
    with connect(unix_address) as other_tenant:
        say(f"another tenant (the socket's default one): {other_tenant.lookup(fp, keys)} blocks visible")
