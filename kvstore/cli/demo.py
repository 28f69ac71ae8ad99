"""``kvstore demo``: a short end-to-end run of the store on this machine.

Two requests share a long system prompt. The first one's KV blocks are stored; the second one
finds the shared prefix, restores it byte for byte, and only its own suffix would need prefill.
A different model (new weights) and a different tenant salt find nothing. The `dram` arena is
kept small so that blocks demote to `nvme`; then the store is closed, reopened from disk, and
the prefix is restored again: the cache survives the restart.

The KV bytes are synthetic (a deterministic function of each block key) so every restore can be
checked exactly; their size follows the model layout below.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.keys import BlockKey, ModelIdentity, block_keys
from kvstore.server.builder import open_store
from kvstore.server.config import Settings
from kvstore.store import Scope, TieredStore

MODEL = ModelIdentity(
    model_id="demo/tiny-llama",
    weights_digest=hashlib.sha256(b"demo weights v1").hexdigest(),
    num_layers=8,
    num_kv_heads=4,
    head_dim=64,
    tokens_per_block=64,
    kv_dtype="bfloat16",
    tokenizer_digest=hashlib.sha256(b"demo tokenizer").hexdigest(),
    chat_template_version="1",
)


def synthetic_kv(key: BlockKey, size_bytes: int) -> bytes:
    """Deterministic stand-in KV bytes for a block, so restores can be checked exactly."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size_bytes, dtype=np.uint8).tobytes()


def restore(store: TieredStore, scope: Scope, keys: Sequence[BlockKey], size_bytes: int) -> tuple[int, float]:
    """Restore the present prefix into one engine-like buffer; (blocks verified, seconds)."""
    hit = store.lookup(scope, keys, pin_ttl_s=30)
    buffer = memoryview(bytearray(hit.hit_blocks * size_bytes))
    start = time.perf_counter()
    for i, key in enumerate(keys[: hit.hit_blocks]):
        n = store.get_into(scope, key, buffer[i * size_bytes : (i + 1) * size_bytes])
        if n != size_bytes:
            raise RuntimeError(f"block {i} vanished while pinned")
    elapsed = time.perf_counter() - start
    for i, key in enumerate(keys[: hit.hit_blocks]):
        if buffer[i * size_bytes : (i + 1) * size_bytes] != synthetic_kv(key, size_bytes):
            raise RuntimeError(f"block {i} restored with wrong bytes")
    if hit.lease is not None:
        store.release(hit.lease.lease_id)
    return hit.hit_blocks, elapsed


def run_demo(settings: Settings, say: Callable[[str], None] = print) -> None:
    size = MODEL.block_bytes
    fp = MODEL.fingerprint()
    tenant = Scope("demo-tenant", fp)
    rng = np.random.default_rng(7)
    system_prompt = rng.integers(0, 32000, 8192).tolist()
    request_1 = system_prompt + rng.integers(0, 32000, 700).tolist()
    request_2 = system_prompt + rng.integers(0, 32000, 900).tolist()
    keys_1 = block_keys(fp, request_1, MODEL.tokens_per_block, cache_salt="demo-tenant")
    keys_2 = block_keys(fp, request_2, MODEL.tokens_per_block, cache_salt="demo-tenant")

    say(f"model {MODEL.model_id}: {MODEL.block_bytes // 1024} KiB per {MODEL.tokens_per_block}-token block")
    say(f"fingerprint {fp.hex()[:16]}…, data folder {settings.data_dir}")
    store = open_store(settings)
    try:
        for line in store.absent_tiers:
            say(f"tier absent: {line}")
        store.invalidate()  # start clean so the figures below are this run's
        start = time.perf_counter()
        store.put(tenant, keys_1, [synthetic_kv(k, size) for k in keys_1])
        put_s = time.perf_counter() - start
        say(
            f"request 1: stored {len(keys_1)} blocks ({len(keys_1) * size / 2**20:.0f} MiB) in {put_s * 1e3:.0f} ms"
        )
        hit = store.lookup(tenant, keys_2)
        say(
            f"request 2: {hit.hit_blocks} of {len(keys_2)} blocks hit "
            f"({hit.hit_blocks * MODEL.tokens_per_block} of {len(request_2)} tokens), tiers: {_tier_summary(hit.tiers)}"
        )
        blocks, seconds = restore(store, tenant, keys_2, size)
        say(f"request 2: restored {blocks} blocks byte for byte in {seconds * 1e3:.1f} ms")
        other_weights = dataclasses.replace(
            MODEL, weights_digest=hashlib.sha256(b"demo weights v2").hexdigest()
        )
        stale = block_keys(
            other_weights.fingerprint(), request_2, MODEL.tokens_per_block, cache_salt="demo-tenant"
        )
        say(
            f"same prompt, new weights: {store.lookup(Scope('demo-tenant', other_weights.fingerprint()), stale).hit_blocks} hits"
        )
        other_tenant = block_keys(fp, request_2, MODEL.tokens_per_block, cache_salt="other-tenant")
        say(
            f"same prompt, another tenant's salt: {store.lookup(Scope('other-tenant', fp), other_tenant).hit_blocks} hits"
        )
        _say_tiers(store, say)
    finally:
        store.close()

    say("closed the store; reopening from disk …")
    start = time.perf_counter()
    store = open_store(settings)
    try:
        say(
            f"reopened in {(time.perf_counter() - start) * 1e3:.0f} ms with {store.stats().blocks} blocks indexed"
        )
        blocks, seconds = restore(store, tenant, keys_2, size)
        say(f"after restart: restored {blocks} blocks byte for byte in {seconds * 1e3:.1f} ms")
        if blocks == 0 and settings.nvme.enabled:
            raise RuntimeError("the cache did not survive the restart")
        _say_tiers(store, say)
    finally:
        store.close()


def _tier_summary(tiers: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for t in tiers:
        counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{n} in {t}" for t, n in counts.items()) or "none"


def _say_tiers(store: TieredStore, say: Callable[[str], None]) -> None:
    stats = store.stats()
    for usage in stats.tiers:
        say(
            f"  {usage.name:5s} {usage.blocks:5d} blocks  {usage.used_bytes / 2**20:8.1f} MiB of "
            f"{usage.capacity_bytes / 2**20:8.0f} MiB"
        )
    moved = {k: v for k, v in stats.counters.items() if k in ("demotions", "promotions", "checksum_failures")}
    say(f"  counters: {moved}")
