"""``kvstore demo --service ADDRESS``: a short run against a live ``kvstore serve``.

One "engine" on the same host writes the KV blocks of a long shared prompt into the arena in
place; a "replica" elsewhere (over TCP, with its bearer token) finds the prefix and reads it
back byte for byte; another tenant finds nothing; then the server's stats.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvstore.cli.demo import MODEL, synthetic_kv
from kvstore.client import connect
from kvstore.errors import KvStoreError, StoreFull
from kvstore.keys import block_keys

CHUNK_BLOCKS = 8


def _check_exact(got: Sequence[bytes | memoryview], want: Sequence[bytes], what: str) -> None:
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if bytes(g) != w]
    if bad:
        raise RuntimeError(f"{what}: blocks {bad[:8]} differ from what was stored")


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
        stored = 0
        # In chunks: one reservation must fit the arena, however small /dev/shm made it; the
        # store demotes committed chunks to nvme to make room for the next.
        for i in range(0, len(keys), CHUNK_BLOCKS):
            parent = keys[i - 1] if i else None
            try:
                stored += local.write(
                    fp, keys[i : i + CHUNK_BLOCKS], blocks[i : i + CHUNK_BLOCKS], parent=parent
                )
            except StoreFull as exc:  # a small arena: say so, and show what fitted
                stored += exc.stored
                say(f"same host: the arena is full ({exc})")
                break
        say(
            f"same host: wrote {stored} of {len(keys)} blocks ({stored * size / 2**20:.0f} MiB) into the "
            f"arena in place in {(time.perf_counter() - start) * 1e3:.0f} ms"
        )
        outs = [memoryview(bytearray(size)) for _ in keys]
        start = time.perf_counter()
        n = 0
        for i in range(0, len(keys), CHUNK_BLOCKS):
            got_n = local.read_into(fp, keys[i : i + CHUNK_BLOCKS], outs[i : i + CHUNK_BLOCKS])
            n += got_n
            if got_n < len(keys[i : i + CHUNK_BLOCKS]):
                break
        _check_exact(outs[:n], blocks[:n], "same-host restore")
        say(f"same host: restored {n} blocks in {(time.perf_counter() - start) * 1e3:.1f} ms, byte for byte")
    with connect(tcp_address, token=token) as remote, connect(tcp_address, token="wrong-token") as stranger:
        start = time.perf_counter()
        got = remote.get(fp, keys)
        seconds = time.perf_counter() - start
        _check_exact(got, blocks[: len(got)], "remote get")
        say(
            f"remote (TCP, token): {remote.lookup(fp, keys)} of {len(keys)} blocks present, fetched "
            f"{len(got)} in {seconds * 1e3:.0f} ms, byte for byte"
        )
        try:
            stranger.lookup(fp, keys)
        except KvStoreError as exc:
            say(f"a caller with a wrong token: refused ({type(exc).__name__})")
        stats = remote.stats()
        say("server tiers: " + ", ".join(f"{t['name']} {t['blocks']} blocks" for t in stats["tiers"]))
    with connect(unix_address) as other_tenant:
        say(f"another tenant (the socket's default one): {other_tenant.lookup(fp, keys)} blocks visible")
