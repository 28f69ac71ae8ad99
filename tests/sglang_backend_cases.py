"""kvstore as SGLang HiCache's storage tier, against SGLang 0.5.23's own interface and a real
sidecar (``kvstore serve`` in a child process, on its Unix socket and on 127.0.0.1), without an
engine (``tests/sglang_hicache/harness.py``: SGLang's factory, host pool, hash and controller calls).

The last case runs two SGLang engine processes on CPU end to end (with the test-only shims of
``tests/sglang_hicache/shims``). Run by ``tests/test_sglang_backend.py`` in a process that can
import SGLang; not collected by a
plain ``pytest`` run (the file name), so SGLang's imports never reach the vLLM tests' process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.server_process import ServerProcess
from benchmarks.tiny_model import build_tiny_llama
from engine_plugin.sidecar import CONNECT_S
from kvstore.client import Client, connect
from tests.sglang_hicache.engine import PAGE as ENGINE_PAGE
from tests.sglang_hicache.env import ROOT, sglang_env
from tests.sglang_hicache.harness import PAGE, RadixKey, Rank, model_folder
from tests.shm_leftovers import SHM, in_use, listing

TOKEN = "tok-a"
PAGES = 6
PROMPT = array("q", range(7, 7 + PAGES * PAGE))


@pytest.fixture(scope="module")
def sidecar() -> Iterator[ServerProcess]:
    server = ServerProcess(
        {
            "dram.capacity_bytes": "16MiB",
            "dram.page_bytes": "1MiB",
            "dram.prefault": "false",
            "nvme.capacity_bytes": "64MiB",
            "server.tokens": f"{TOKEN}=tenant-a",
        },
        tcp=True,
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def models() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvs-sgl-") as root:
        model_folder(Path(root), "tiny", b"weights of tiny")
        model_folder(Path(root), "other", b"other weights")
        yield Path(root)


def _key(salt: str | None = None, extra_key: str | None = None, pages: int = PAGES) -> RadixKey:
    return RadixKey(PROMPT[: pages * PAGE], extra_key=extra_key, cache_salt=salt)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.reshape(-1), y.reshape(-1)) for x, y in zip(a, b, strict=True)
    )


def _zero(pages: list[torch.Tensor]) -> bool:
    return all(not page.any() for page in pages)


# ----------------------------------------------------------------- round trips


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("interface_v1", [True, False], ids=["zero-copy", "copying"])
@pytest.mark.parametrize("same_host", [True, False], ids=["arena", "data-port"])
def test_pages_round_trip_between_two_ranks(
    sidecar: ServerProcess, models: Path, layout: str, interface_v1: bool, same_host: bool
) -> None:
    address, token = (sidecar.unix, None) if same_host else (sidecar.tcp, TOKEN)
    key = _key(salt=f"round-trip-{layout}-{interface_v1}-{same_host}")
    writer = Rank(address, models / "tiny", layout=layout, interface_v1=interface_v1, token=token)
    reader = Rank(address, models / "tiny", layout=layout, interface_v1=interface_v1, token=token)
    try:
        assert reader.restore(key)[0] == 0  # nothing stored yet
        stored, pages = writer.store(key)
        assert stored == PAGES * PAGE
        # the reader's own host pool, filled from kvstore, holds the writer's bytes
        read, restored = reader.restore(key)
        assert read == PAGES
        assert _same(pages, restored)
        assert writer.store(key)[0] == PAGES * PAGE  # storing again is no failure
    finally:
        writer.close()
        reader.close()


def test_the_factory_loads_the_backend_and_the_controller_picks_its_page_calls(
    sidecar: ServerProcess, models: Path
) -> None:
    zero_copy = Rank(sidecar.unix, models / "tiny", interface_v1=True)
    copying = Rank(sidecar.unix, models / "tiny", interface_v1=False)
    try:
        assert type(zero_copy.backend).__name__ == "KvstoreHiCacheStorage"
        assert zero_copy.controller.page_get_func.__name__ == "_page_get_zero_copy"
        assert copying.controller.page_get_func.__name__ == "_generic_page_get"
        # the two order a layer_first page differently, so they are different fingerprints
        assert zero_copy.backend.identity != copying.backend.identity
    finally:
        zero_copy.close()
        copying.close()


def test_clear_removes_the_models_pages(sidecar: ServerProcess, models: Path) -> None:
    rank = Rank(sidecar.unix, models / "tiny")
    try:
        rank.store(_key("clear"))
        assert rank.hit_tokens(_key("clear")) == PAGES * PAGE
        rank.backend.clear()
        assert rank.hit_tokens(_key("clear")) == 0
    finally:
        rank.close()


# ----------------------------------------------------------------- batch_exists


def test_batch_exists_counts_the_leading_pages_present(sidecar: ServerProcess, models: Path) -> None:
    rank = Rank(sidecar.unix, models / "tiny")
    try:
        # store [0, 1, 2] of a six-page prompt -> 3 pages exist, from the first
        assert rank.store(_key("prefix", pages=3))[0] == 3 * PAGE
        hashes = rank.hashes(_key("prefix"))
        assert rank.backend.batch_exists(hashes) == 3
        assert rank.hit_tokens(_key("prefix")) == 3 * PAGE
        # store all six, then delete page 1 -> only page 0 counts
        rank.store(_key("prefix"))
        assert rank.backend.batch_exists(hashes) == PAGES
        with connect(sidecar.unix) as kv:
            fingerprint = rank.backend.identity.fingerprint()  # type: ignore[union-attr]
            assert kv.delete(fingerprint, rank.backend._keys(hashes[1:2])) == 1
        assert rank.backend.batch_exists(hashes) == 1
        assert rank.backend.exists(hashes[0]) and not rank.backend.exists(hashes[1])
        # a prompt whose first page differs finds nothing, though its later pages' tokens match
        other = array("q", PROMPT)
        other[0] += 1
        assert rank.hit_tokens(RadixKey(other, cache_salt="prefix")) == 0
    finally:
        rank.close()


# ----------------------------------------------------------------- isolation


@pytest.mark.parametrize(
    "other",
    [
        {"folder": "other"},  # other weights
        {"tp_rank": 1, "tp_size": 2},
        {"tp_rank": 0, "tp_size": 2},
        {"dtype": torch.float16},
        {"page_size": 2 * PAGE},
        {"layout": "page_first_direct"},
    ],
    ids=["other-weights", "tp-rank-1-of-2", "tp-rank-0-of-2", "float16", "page-size", "layout"],
)
def test_another_model_rank_dtype_or_page_finds_nothing(
    sidecar: ServerProcess, models: Path, other: dict[str, Any]
) -> None:
    key = _key(salt=f"isolation-{sorted(other.items())}")
    writer = Rank(sidecar.unix, models / "tiny")
    reader = Rank(sidecar.unix, models / other.pop("folder", "tiny"), **other)
    try:
        assert writer.store(key)[0] == PAGES * PAGE
        assert writer.hit_tokens(key) == PAGES * PAGE
        assert writer.backend.identity != reader.backend.identity
        read, pages = reader.restore(key)
        assert (reader.hit_tokens(key), read) == (0, 0)
        assert _zero(pages)
    finally:
        writer.close()
        reader.close()


def test_mla_ranks_share_pages_and_other_salts_do_not(sidecar: ServerProcess, models: Path) -> None:
    """MLA KV is the same on every TP rank (SGLang writes it from rank 0 only): one fingerprint."""
    rank0 = Rank(sidecar.unix, models / "tiny", tp_rank=0, tp_size=2, is_mla=True)
    rank1 = Rank(sidecar.unix, models / "tiny", tp_rank=1, tp_size=2, is_mla=True)
    try:
        assert rank0.backend.identity == rank1.backend.identity
        rank0.store(_key("mla"))
        assert rank1.hit_tokens(_key("mla")) == PAGES * PAGE
    finally:
        rank0.close()
        rank1.close()


def test_the_same_weights_at_another_path_and_name_share_pages(sidecar: ServerProcess, models: Path) -> None:
    """Replicas mount the same weights at other paths and serve them under other names: neither
    is in the fingerprint. Other weights at that same path find nothing."""
    copy = Path(shutil.copytree(models / "tiny", models / "elsewhere" / "tiny"))
    key = _key("moved")
    writer = Rank(sidecar.unix, models / "tiny")
    reader = Rank(sidecar.unix, Path("llama-prod"), model_path=str(copy))  # SGLang's model name
    try:
        assert reader.backend.identity.model_id == "llama-prod"  # a label for operators
        assert reader.backend.identity.fingerprint() == writer.backend.identity.fingerprint()
        stored, pages = writer.store(key)
        assert stored == PAGES * PAGE
        read, restored = reader.restore(key)
        assert read == PAGES and _same(pages, restored)
    finally:
        writer.close()
        reader.close()
    weights = copy / "model.safetensors"
    weights.write_bytes(bytes([weights.read_bytes()[0] ^ 1]) + weights.read_bytes()[1:])
    changed = Rank(sidecar.unix, Path("llama-prod"), model_path=str(copy))
    try:
        read, restored = changed.restore(key)
        assert (changed.hit_tokens(key), read) == (0, 0) and _zero(restored)
    finally:
        changed.close()


@pytest.mark.parametrize(
    "reader_key",
    [
        {"salt": "tenant-b"},
        {"salt": None},
        {"salt": "tenant-a", "extra_key": "lora-1"},
    ],
    ids=["other-salt", "no-salt", "other-extra-key"],
)
def test_another_salt_or_extra_key_finds_nothing(
    sidecar: ServerProcess, models: Path, reader_key: dict[str, Any]
) -> None:
    rank = Rank(sidecar.unix, models / "tiny")
    try:
        assert rank.store(_key("tenant-a"))[0] == PAGES * PAGE
        assert rank.hit_tokens(_key("tenant-a")) == PAGES * PAGE
        read, pages = rank.restore(_key(**reader_key))
        assert read == 0 and _zero(pages)
    finally:
        rank.close()


# ----------------------------------------------------------------- a sick sidecar


def _bounded(fn: Any, limit_s: float) -> Any:
    start = time.monotonic()
    result = fn()
    assert time.monotonic() - start < limit_s, f"took {time.monotonic() - start:.2f} s"
    return result


def test_a_sidecar_that_is_not_there_means_misses(models: Path) -> None:
    rank = Rank("unix:///tmp/kvs-nobody-listens-here.sock", models / "tiny")
    try:
        key = _key("down")
        assert _bounded(lambda: rank.store(key)[0], 3.0) == 0  # the save failed: nothing counted
        assert _bounded(lambda: rank.hit_tokens(key), 1.0) == 0  # the breaker is open: at once
        read, pages = _bounded(lambda: rank.restore(key), 1.0)
        assert read == 0 and _zero(pages)
        hashes = rank.hashes(key)
        assert rank.backend.batch_get([hashes[0]], [rank.pool.get_dummy_flat_data_page()]) == [None]
        assert rank.backend.batch_set([hashes[0]], [rank.pool.get_dummy_flat_data_page()]) is False
        assert rank.backend.unreachable >= 3
    finally:
        rank.close()


def test_a_hung_sidecar_means_misses_within_the_deadline(models: Path) -> None:
    server = ServerProcess(
        {"dram.capacity_bytes": "8MiB", "dram.page_bytes": "1MiB", "dram.prefault": "false"}
    )
    rank = Rank(server.unix, models / "tiny", lookup_timeout_s=0.5)
    try:
        key = _key("hung")
        assert rank.store(key)[0] == PAGES * PAGE
        server.freeze()
        # one call pays its deadline (and a reconnect's allowance at most), then the breaker
        # answers at once
        assert _bounded(lambda: rank.hit_tokens(key), 0.5 + CONNECT_S + 1.0) == 0
        assert _bounded(lambda: rank.hit_tokens(key), 0.2) == 0
        assert _bounded(lambda: rank.store(_key("hung-2"))[0], 0.2) == 0
        # another thread (SGLang's backup thread, say) has a link of its own: bounded as well
        with ThreadPoolExecutor(1) as other_thread:
            hashes = rank.hashes(key)
            assert _bounded(lambda: other_thread.submit(rank.backend.batch_exists, hashes).result(), 2.5) == 0
        server.thaw()
        time.sleep(1.1)  # the first backoff
        assert rank.hit_tokens(key) == PAGES * PAGE
        read, _ = rank.restore(key)
        assert read == PAGES
    finally:
        rank.close()
        server.stop()


# ----------------------------------------------------------------- reads that must not be served


class _ShortReads:
    """A real client whose reads lose the tail of block ``short`` (a lying or broken sidecar)."""

    def __init__(self, kv: Client, short: int) -> None:
        self._kv, self._short = kv, short

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    def get(self, fingerprint: bytes, keys: Any, scope: str = "") -> list[bytes]:
        blocks = self._kv.get(fingerprint, keys, scope)
        return [b[:-1] if i == self._short else b for i, b in enumerate(blocks)]

    def resolve(self, fingerprint: bytes, keys: Any, ttl_s: float = 30.0, scope: str = "") -> Any:
        resolved = self._kv.resolve(fingerprint, keys, ttl_s, scope)
        resolved.views[self._short] = resolved.views[self._short][:-1]
        return resolved


@pytest.mark.parametrize("same_host", [True, False], ids=["arena", "data-port"])
@pytest.mark.parametrize("interface_v1", [True, False], ids=["zero-copy", "copying"])
def test_a_short_block_is_a_miss_and_writes_nothing(
    sidecar: ServerProcess, models: Path, same_host: bool, interface_v1: bool
) -> None:
    address, token = (sidecar.unix, None) if same_host else (sidecar.tcp, TOKEN)
    key = _key(f"short-{same_host}-{interface_v1}")
    writer = Rank(address, models / "tiny", interface_v1=interface_v1, token=token)
    reader = Rank(address, models / "tiny", interface_v1=interface_v1, token=token)
    try:
        _, pages = writer.store(key)
        reader.backend._connect = lambda: _ShortReads(reader.backend.config.sidecar.connect(), short=2)
        read, restored = reader.restore(key)
        assert read == 2  # pages 0 and 1; page 2 came short, so neither it nor later pages count
        assert _same(pages[:2], restored[:2])
        assert _zero(restored[2:])
    finally:
        writer.close()
        reader.close()


def test_pages_gone_between_lookup_and_read_are_misses(sidecar: ServerProcess, models: Path) -> None:
    rank = Rank(sidecar.unix, models / "tiny")
    try:
        key = _key("vanishing")
        _, pages = rank.store(key)
        hashes = rank.hashes(key)
        assert rank.backend.batch_exists(hashes) == PAGES
        with connect(sidecar.unix) as kv:  # another engine's clear, say
            kv.delete(rank.backend.identity.fingerprint(), rank.backend._keys(hashes[3:]))  # type: ignore[union-attr]
        indices = rank.pool.alloc(PAGES * PAGE)
        assert rank.backend.batch_get_v1(hashes, indices) == [True] * 3 + [False] * 3
        assert _same(pages[:3], [rank.pool.get_data_page(int(indices[i * PAGE])) for i in range(3)])
        rank.pool.free(indices)
    finally:
        rank.close()


# ----------------------------------------------------------------- end to end on the engine


ENGINE_SHM = (
    "sglang_loads_",
    "sgl_shm_",
    "sem.mp-",
)  # what an SGLang engine makes in /dev/shm (sem.mp-: its processes' named semaphores, left when one is killed)


def _engine(model: Path, address: str, prompt: Path) -> dict[str, Any]:
    """One engine process's result; the files it made in /dev/shm are gone once it exits."""
    argv = [sys.executable, "-m", "tests.sglang_hicache.engine", str(model), address, str(prompt)]
    before = listing(ENGINE_SHM)
    stdout, killed = "", False
    try:
        done = subprocess.run(argv, cwd=ROOT, env=sglang_env(), capture_output=True, text=True, timeout=300)
        stdout = done.stdout
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        killed = True
        raise
    finally:
        loads = [
            Path(line.removeprefix("LOADS ")) for line in stdout.splitlines() if line.startswith("LOADS ")
        ]
        left = [path for path in loads if path.exists()]  # what the engine should have removed
        # A killed engine removed nothing, and may have died before saying where its file is:
        # what appeared meanwhile that no live process uses (another run's live engine keeps its
        # own mapped) goes too, once the engine's children have followed it (up to 10 s).
        deadline = time.monotonic() + (10 if killed else 0)
        while True:
            new = listing(ENGINE_SHM) - before
            unused = new - in_use()
            if unused == new or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        strays = [SHM / name for name in unused]
        for path in {*left, *strays}:
            path.unlink(missing_ok=True)
    assert loads, f"the engine did not say where its load snapshot lives:\n{stdout[-3000:]}"
    assert not left, f"the engine left {left} in /dev/shm"
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"the engine failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_second_engine_restores_the_prefix_from_kvstore(tmp_path: Path) -> None:
    """Two SGLang engine processes on CPU (the shims: tests/sglang_hicache/shims): the first
    computes a prompt and its pages reach kvstore; the second, with an empty GPU and host cache,
    takes the prompt's full pages from kvstore and answers the same, greedily."""
    model = build_tiny_llama(tmp_path / "model", seed=0)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(f"word{i} token{i % 37}" for i in range(200)))
    server = ServerProcess(
        {"dram.capacity_bytes": "64MiB", "dram.prefault": "false", "nvme.capacity_bytes": "256MiB"}
    )
    try:
        first = _engine(model, server.unix, prompt)
        assert first["cached"].get("storage", 0) == 0
        full_pages = first["prompt_tokens"] // ENGINE_PAGE
        assert first["blocks"] >= full_pages
        second = _engine(model, server.unix, prompt)
        # every full page but the last (SGLang recomputes at least the prompt's last token)
        assert second["cached"]["storage"] >= (full_pages - 1) * ENGINE_PAGE
        assert second["cached"]["storage_backend"] == "KvstoreHiCacheStorage"
        assert second["output_ids"] == first["output_ids"]
    finally:
        server.stop()
