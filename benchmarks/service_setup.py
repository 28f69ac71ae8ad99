"""The service benchmarks' server and workload: a ``kvstore serve`` with the bench token, the
model whose blocks are 2 MiB (and its 256 KiB cut), and chains of blocks to store."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from benchmarks.server_process import ServerProcess
from kvstore.keys import BlockKey, ModelIdentity, block_keys

MiB = 1 << 20
BLOCK = 2 * MiB
TOKEN = "bench-token"
# 2 MiB per block: 16 tokens x 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes (bf16).
MODEL = ModelIdentity(
    "bench/8b-like", "00" * 32, num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16
)
# The same model cut into 2-token blocks: 256 KiB each, the small-block same-host rows.
SMALL_BLOCK = 256 * 1024
SMALL_MODEL = ModelIdentity(
    "bench/8b-like", "00" * 32, num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=2
)


def bench_server(arena_bytes: int, settings: Mapping[str, str] | None = None) -> ServerProcess:
    """The benchmarks' server: a TCP listener with the bench token, messages up to 64 MiB."""
    return ServerProcess(
        {
            "dram.capacity_bytes": str(arena_bytes),
            "nvme.capacity_bytes": "4GiB",
            "server.tokens": f"{TOKEN}=bench",
            "server.max_message_bytes": "64MiB",
            **(settings or {}),
        },
        tcp=True,
    )


def make_blocks(
    count: int, seed: int, model: ModelIdentity = MODEL, size: int = BLOCK
) -> tuple[list[BlockKey], list[bytes]]:
    rng = np.random.default_rng(seed)
    per = model.tokens_per_block
    keys = block_keys(model.fingerprint(), rng.integers(0, 32000, count * per).tolist(), per)
    return keys, [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in keys]


def make_keys(count: int, seed: int, model: ModelIdentity = MODEL) -> list[BlockKey]:
    """The keys of a chain of ``count`` blocks, without their bytes."""
    per = model.tokens_per_block
    tokens = np.random.default_rng(seed).integers(0, 32000, count * per).tolist()
    return block_keys(model.fingerprint(), tokens, per)
