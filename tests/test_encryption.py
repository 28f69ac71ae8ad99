"""Encryption at rest in `nvme`: blocks on disk are ciphertext, each tenant has its own key, and
deleting a tenant's key file shreds its blocks (they become misses, deleted and counted)."""

from __future__ import annotations

from pathlib import Path

from kvstore.keys import Fingerprint, block_keys
from kvstore.server.builder import open_store
from kvstore.server.config import load_settings
from kvstore.store import Scope

FP = Fingerprint(b"\x09" * 32)
BLOCK = 1 << 16


def settings_for(folder: Path) -> dict[str, str]:
    return {
        "data_dir": str(folder),
        "dram.capacity_bytes": "1MiB",
        "dram.page_bytes": "64KiB",
        "dram.prefault": "false",
        "nvme.capacity_bytes": "64MiB",
        "nvme.encryption_keys_dir": str(folder / "keys"),
    }


def marker_block(tenant: str, i: int) -> bytes:
    return (f"SECRET-{tenant}-{i}-".encode() * BLOCK)[:BLOCK]


def test_blocks_are_ciphertext_on_disk_and_a_deleted_key_shreds_its_tenant(tmp_path: Path) -> None:
    a, b = Scope("t/tenant-a", FP), Scope("t/tenant-b", FP)
    keys = block_keys(FP, list(range(8 * 16)), 16)
    store = open_store(load_settings(env={}, overrides=settings_for(tmp_path)))
    store.put(a, keys, [marker_block("a", i) for i in range(8)])
    store.put(b, keys, [marker_block("b", i) for i in range(8)])
    store.close()  # spilled to nvme, encrypted
    raw = (tmp_path / "nvme" / "data.mdb").read_bytes()
    assert b"SECRET-" not in raw, "plaintext KV on disk"
    key_files = sorted(p.name for p in (tmp_path / "keys").iterdir())
    assert key_files == sorted(ns.encode().hex() + ".key" for ns in ("t/tenant-a", "t/tenant-b"))
    assert all((tmp_path / "keys" / f).stat().st_mode & 0o077 == 0 for f in key_files)

    (tmp_path / "keys" / (b"t/tenant-a".hex() + ".key")).unlink()  # shred tenant-a
    store = open_store(load_settings(env={}, overrides=settings_for(tmp_path)))
    try:
        out = memoryview(bytearray(BLOCK))
        assert store.get_into(a, keys[0], out) is None
        assert store.get_into(b, keys[0], out) == BLOCK and bytes(out) == marker_block("b", 0)
        assert store.stats().tiers[-1].checksum_failures >= 1  # counted, and deleted
        assert store.get_into(a, keys[0], out) is None
    finally:
        store.close()
