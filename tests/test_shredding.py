"""Crypto-shredding while a real ``kvstore serve`` runs with encryption at rest: a tenant's key
file deleted from under it, and ``kvstore shred --tenant T``. Either way, within seconds no
block of that tenant is served from any tier (what was promoted into dram before included),
other tenants keep theirs, and the drop is in the audit log."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.server_process import ServerProcess
from kvstore.client import Client, connect
from kvstore.errors import PermissionDenied
from kvstore.keys import BlockKey, Fingerprint
from kvstore.server.audit import read_audit
from kvstore.server.datadir import remove_shm_files
from kvstore.server.shredding import KEY_CHECK_S
from tests.service_fixtures import MODEL, blocks_for, chain

TOKENS = {"tok-t": "t", "tok-u": "u", "tok-v": "v"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    folder = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))  # short: Unix socket paths are short
    try:
        proc = ServerProcess(
            {
                "dram.capacity_bytes": "4MiB",
                "dram.page_bytes": "1MiB",
                "dram.prefault": "false",
                "nvme.capacity_bytes": "64MiB",
                "nvme.encryption_keys_dir": str(folder / "keys"),
                "server.tokens": ",".join(f"{k}={v}" for k, v in TOKENS.items()),
            },
            folder,
        )
        try:
            yield proc
        finally:
            proc.stop()
    finally:
        remove_shm_files(folder)
        shutil.rmtree(folder, ignore_errors=True)


def key_file(server: ServerProcess, tenant: str) -> Path:
    return server.data_dir / "keys" / f"{f't/{tenant}'.encode().hex()}.key"


def served_blocks(kv: Client, fp: Fingerprint, keys: list[BlockKey], blocks: list[bytes]) -> int:
    """How many of ``keys`` the server serves with their bytes, each asked for on its own."""
    return sum(
        len(got) == 1 and bytes(got[0]) == block
        for key, block in zip(keys, blocks, strict=True)
        for got in [kv.get(fp, [key])]
    )


def stored_on_nvme_then_promoted(kv: Client, salt: str) -> tuple[Fingerprint, list[BlockKey], list[bytes]]:
    """8 blocks written, demoted into nvme (sealed under the tenant's key), and read back, which
    promotes their decrypted bytes into dram."""
    fp = Fingerprint(kv.register(MODEL))
    keys = chain(8, salt=salt)
    blocks = blocks_for(keys)
    kv.put(fp, keys, blocks)
    assert kv.demote("dram") == 8
    assert kv.lookup_tiers(fp, keys).tiers == ("nvme",) * 8
    assert served_blocks(kv, fp, keys, blocks) == 8
    assert kv.lookup_tiers(fp, keys).tiers == ("dram",) * 8  # promoted: plaintext in the arena now
    return fp, keys, blocks


def wait_until_none_served(kv: Client, fp: Fingerprint, keys: list[BlockKey], blocks: list[bytes]) -> float:
    start = time.monotonic()
    while served_blocks(kv, fp, keys, blocks) and time.monotonic() - start < 5 * KEY_CHECK_S + 5:
        time.sleep(0.1)
    return time.monotonic() - start


def test_a_key_file_deleted_while_serving_stops_every_copy_within_seconds(server: ServerProcess) -> None:
    with connect(server.unix, token="tok-t") as t, connect(server.unix, token="tok-u") as u:
        fp, keys, blocks = stored_on_nvme_then_promoted(t, "deleted-key")
        _, u_keys, u_blocks = stored_on_nvme_then_promoted(u, "other-tenant")
        key_file(server, "t").unlink()
        waited = wait_until_none_served(t, fp, keys, blocks)
        assert served_blocks(t, fp, keys, blocks) == 0, f"still served {waited:.1f} s after"
        assert waited < 2 * KEY_CHECK_S + 2
        assert t.lookup(fp, keys) == 0  # dram's copies went too, not only nvme's
        assert served_blocks(u, fp, u_keys, u_blocks) == 8  # another tenant keeps its blocks
        # t goes on with a new key: what it stores from now on is served again
        t.put(fp, keys[:1], blocks[:1])
        assert t.demote("dram") == 1 and key_file(server, "t").exists()  # sealed under a new key
        assert served_blocks(t, fp, keys[:1], blocks[:1]) == 1
    audited = read_audit(server.data_dir / "audit.log").actions
    drops = [a for a in audited if a["namespace"] == "t/t" and str(a["action"]).startswith("shred")]
    assert [(a["action"], a["phase"], a["outcome"]) for a in drops] == [
        ("shred (key file removed)", "done", 8)
    ]


def test_kvstore_shred_drops_a_tenants_key_and_every_copy_at_once(server: ServerProcess) -> None:
    with connect(server.unix, token="tok-v") as v, connect(server.unix, token="tok-u") as u:
        fp, keys, blocks = stored_on_nvme_then_promoted(v, "shred-command")
        more = chain(4, salt="shred-dram-only")
        v.put(fp, more, blocks_for(more))  # in dram only: no sealed copy at all
        with pytest.raises(PermissionDenied, match="only admins shred"):
            u.shred("v")  # u is no admin
        assert key_file(server, "v").exists() and served_blocks(v, fp, keys, blocks) == 8
        done = subprocess.run(
            [sys.executable, "-m", "kvstore", "shred", "--tenant", "v", "--address", server.unix],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )  # over the Unix socket without a token: tenant "local", an admin
        assert done.returncode == 0, done.stderr
        assert "shredded tenant v: key file deleted, 12 blocks dropped" in done.stdout
        assert not key_file(server, "v").exists()
        assert served_blocks(v, fp, keys, blocks) == 0  # at once, no waiting for the key watch
        assert v.lookup(fp, more) == 0
    shreds = [a for a in read_audit(server.data_dir / "audit.log").actions if a["action"] == "shred"]
    assert [(a["tenant"], a["namespace"], a["phase"], a["outcome"]) for a in shreds] == [
        ("local", "t/v", "done", 12)
    ]


def test_a_key_file_there_at_start_is_watched_before_its_key_is_used(tmp_path: Path) -> None:
    # A tenant whose blocks since the restart sit only in dram: its key was never loaded, and
    # deleting the file must still drop them.
    from tiers.cipher import OVERHEAD_BYTES, BlockCipher

    before = BlockCipher(tmp_path, lambda key: key.decode())
    sealed = memoryview(bytearray(16 + OVERHEAD_BYTES))
    for namespace in ("t/w", "t/x"):
        before.seal_into(namespace.encode(), memoryview(b"\0" * 16), sealed)
    restarted = BlockCipher(tmp_path, lambda key: key.decode())
    assert restarted.vanished() == []
    (tmp_path / f"{b't/w'.hex()}.key").unlink()
    assert restarted.vanished() == ["t/w"]
    assert restarted.vanished() == []  # once
    assert restarted.open_into(b"t/x", sealed, memoryview(bytearray(16))) == 16


def test_a_shred_drops_the_copies_a_shared_remote_node_holds() -> None:
    # A sidecar over a shared kvstore node: its tenant "local" stores there as tenant-a. The
    # shred reaches the node's copies too, so no sidecar of the fleet restores them from there.
    from kvstore.server.config import load_settings
    from kvstore.server.serve import start_server
    from tests.service_fixtures import settings_for

    folders = [tempfile.mkdtemp(prefix="kvs-", dir="/tmp") for _ in range(2)]
    shared = start_server(load_settings(env={}, overrides=settings_for(folders[0])))
    try:
        assert shared.tcp_address is not None
        remote = {"remote.backend": "kvstore", "remote.nodes": shared.tcp_address}
        remote["remote.tokens"] = "t/local=tok-a"
        sidecar = start_server(load_settings(env={}, overrides=settings_for(folders[1], **remote)))
        try:
            keys = chain(6, salt="shred-remote")
            with connect(sidecar.unix_address) as kv, connect(shared.tcp_address, token="tok-a") as node:
                fp = Fingerprint(kv.register(MODEL))
                assert kv.write(fp, keys, blocks_for(keys)) == 6
                deadline = time.monotonic() + 10
                while node.lookup(fp, keys) < 6:
                    assert time.monotonic() < deadline, "never reached the shared node"
                    time.sleep(0.05)
                assert kv.shred("local") == (6, False)  # no nvme copy was sealed: no key file
                assert node.lookup(fp, keys) == 0
                assert kv.lookup(fp, keys) == 0  # nor found through the remote tier
        finally:
            sidecar.stop()
    finally:
        shared.stop()
        for folder in folders:
            remove_shm_files(folder)
            shutil.rmtree(folder, ignore_errors=True)
