"""``kvstore bench tiers``' rows of CPU work on blocks, no medium: block keys for a long prompt
and the codecs' speed and ratio on bf16 data."""

from __future__ import annotations

import time

import numpy as np
import torch

from benchmarks.common import Result, gbps
from benchmarks.tiers_working import MiB
from kvstore.keys import ModelIdentity, block_keys
from tiers import Codec
from tiers.codec import decode_into, encode


def bench_keys(rounds: int) -> Result:
    fp = ModelIdentity("bench", "w", 32, 8, 128, 16).fingerprint()
    tokens = np.random.default_rng(1).integers(0, 128_000, 32 * 1024).tolist()
    times = []
    for _ in range(rounds * 3):
        start = time.perf_counter()
        keys = block_keys(fp, tokens, 16, cache_salt="tenant")
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    return Result(
        "block keys, 32k-token prompt, 16-token blocks",
        len(keys) / seconds,
        "keys/s",
        note=f"{seconds * 1e3:.2f} ms per prompt",
    )


def bench_codecs() -> list[Result]:
    data = torch.randn(8 * MiB // 2).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    out = bytearray(len(data))
    results = []
    for codec in (Codec.ZSTD, Codec.ZSTD_BYTEPLANE):
        start = time.perf_counter()
        stored = encode(codec, data, 1)
        enc_s = time.perf_counter() - start
        start = time.perf_counter()
        decode_into(codec, stored, memoryview(out), len(data))
        dec_s = time.perf_counter() - start
        name = codec.name.lower()
        results.append(
            Result(f"{name} ratio on bf16 KV", len(data) / len(stored), "x", note="randn as bf16, level 1")
        )
        results.append(Result(f"{name} encode", gbps(len(data), enc_s), "GB/s"))
        results.append(Result(f"{name} decode", gbps(len(data), dec_s), "GB/s"))
    return results
