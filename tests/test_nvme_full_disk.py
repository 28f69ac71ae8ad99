"""A real ``kvstore serve`` whose nvme tier sits on a full, then freed, then read-only file system,
and one whose LMDB environment was scribbled between two starts.

The small file system is a 64 MiB ext4 image on a loop device (ext4, as a real NVMe would carry;
a 64 MiB tmpfs faulted the same way before the fix: SIGBUS, exit -7). Mounting needs root; where
it is not possible the tests that need it skip, saying why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from benchmarks.ports import free_port
from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.keys import Fingerprint, ModelIdentity, block_keys
from kvstore.server.datadir import ARENA_ID_FILE, remove_shm_files

MODEL = ModelIdentity(
    "test/full-disk", "cd" * 32, num_layers=4, num_kv_heads=8, head_dim=128, tokens_per_block=16
)
BLOCK = MODEL.block_bytes  # 256 KiB
CHAIN = 16  # blocks a write: 4 MiB
MiB = 1 << 20


class SmallFs:
    """A 64 MiB ext4 file system on a loop device, mounted at ``path``."""

    def __init__(self, options: str = "loop") -> None:
        self.image = Path(tempfile.mkstemp(prefix="kvfs-", suffix=".ext4", dir="/tmp")[1])
        self.path = Path(tempfile.mkdtemp(prefix="kvmnt-", dir="/tmp"))
        os.truncate(self.image, 64 * MiB)
        subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", str(self.image)],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            ["mount", "-o", options, str(self.image), str(self.path)], check=True, capture_output=True
        )

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.path).free

    def fill(self, name: str, leave_bytes: int = 0) -> Path:
        """A filler file taking all but ``leave_bytes`` of the free space (all of it: until ENOSPC)."""
        filler = self.path / name
        try:
            f = open(filler, "ab", buffering=0)  # noqa: SIM115 - closed below
        except OSError:  # full already (not even a directory entry's block left)
            return filler
        with f:
            chunk = b"\xff" * (MiB if leave_bytes else 4096)
            while not leave_bytes or self.free_bytes() - leave_bytes >= MiB:
                try:
                    f.write(chunk)
                    f.flush()
                except OSError:  # ENOSPC: full
                    break
            os.fsync(f.fileno())
        return filler

    def fail(self) -> None:
        """An ext4 error, as a failing disk raises: mounted errors=remount-ro, the file system
        turns read-only under the running server (open files and mappings and all)."""
        device = subprocess.run(["findmnt", "-no", "SOURCE", str(self.path)], capture_output=True, text=True)
        trigger = Path("/sys/fs/ext4") / os.path.basename(device.stdout.strip()) / "trigger_fs_error"
        if not trigger.exists():
            pytest.skip(f"{trigger} is missing: this kernel cannot raise an ext4 error on demand")
        trigger.write_text("kvstore test: a failing disk\n")

    def remount(self, mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", str(self.path)], check=True, capture_output=True)

    def remove(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)
        shutil.rmtree(self.path, ignore_errors=True)
        self.image.unlink(missing_ok=True)


def _mount_refusal() -> str | None:
    if os.geteuid() != 0:
        return "mounting a small file system needs root (CI runs as root)"
    if shutil.which("mkfs.ext4") is None:
        return "mkfs.ext4 is not installed"
    return None


@pytest.fixture
def small_fs(request: pytest.FixtureRequest) -> Iterator[SmallFs]:
    refusal = _mount_refusal()
    if refusal:
        pytest.skip(refusal)
    try:
        fs = SmallFs(getattr(request, "param", "loop"))
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot loop-mount an ext4 image here: {exc.stderr.decode(errors='replace').strip()}")
    try:
        yield fs
    finally:
        fs.remove()


def start(data_dir: Path, log_dir: Path, **settings: str) -> tuple[ServerProcess, int]:
    """A server on ``data_dir`` whose log lives in ``log_dir`` (a full disk cannot take it),
    fresh for each start."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "serve.log"
    target = log_dir / f"{data_dir.name}.log"
    target.unlink(missing_ok=True)
    if not log.is_symlink():
        log.symlink_to(target)
    port = free_port()
    base = {
        "dram.capacity_bytes": "4MiB",
        "dram.page_bytes": "1MiB",
        "dram.prefault": "false",
        "nvme.capacity_bytes": "256MiB",
        "server.metrics_address": f"127.0.0.1:{port}",
    }
    return ServerProcess({**base, **settings}, data_dir), port


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf'^{re.escape(name)}\{{tier="nvme"\}} (\S+)$', text, re.M)
    assert found, f"{name} missing from /metrics"
    return float(found.group(1))


def chain(fp: Fingerprint, n: int) -> list[bytes]:
    tokens = [n * 100_000 + i for i in range(CHAIN * MODEL.tokens_per_block)]
    return list(block_keys(fp, tokens, MODEL.tokens_per_block))


def payload(n: int, i: int) -> bytes:
    return bytes([(n * 7 + i) % 251]) * BLOCK


def wait_for(predicate: object, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def no_arena_left(data_dir: Path) -> bool:
    folder_id = (data_dir / ARENA_ID_FILE).read_text().strip()
    return not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvstore-{folder_id}-")]


@pytest.fixture
def log_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvlog-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_full_disk_degrades_nvme_serves_on_and_writes_resume_when_room_returns(
    small_fs: SmallFs, log_dir: Path
) -> None:
    data_dir = small_fs.path / "d"
    server, port = start(data_dir, log_dir)
    try:
        filler = small_fs.fill("filler", leave_bytes=24 * MiB)
        with connect(server.unix) as kv:
            fp = kv.register(MODEL)
            written = 0
            while metric(port, "kvstore_tier_degraded") == 0 and written < 40:  # 160 MiB at most
                kv.write(fp, chain(fp, written), [payload(written, i) for i in range(CHAIN)])
                written += 1
                time.sleep(0.05)  # the writer commits what dram sent down meanwhile
            assert server.proc.poll() is None, "the server died on a full disk"
            assert metric(port, "kvstore_tier_degraded") == 1, f"{written} chains and no degraded nvme"
            assert metric(port, "kvstore_tier_write_failures_total") > 0
            assert kv.lookup(fp, chain(fp, written - 1)) == CHAIN  # in dram
            # What nvme holds is still served, byte for byte: the first chain went down first.
            got = kv.get(fp, chain(fp, 0))
            assert len(got) == CHAIN and all(bytes(v) == payload(0, i) for i, v in enumerate(got))
            log = (data_dir / "serve.log").read_text()
            assert log.count("degraded:") == 1, log[-3000:]

            filler.unlink()  # room returns
            assert wait_for(lambda: metric(port, "kvstore_tier_degraded") == 0), "writes never resumed"
            before = metric(port, "kvstore_tier_blocks")
            for n in range(100, 104):
                kv.write(fp, chain(fp, n), [payload(n, i) for i in range(CHAIN)])
            assert wait_for(lambda: metric(port, "kvstore_tier_blocks") >= before + 2 * CHAIN)
            assert "writable again" in (data_dir / "serve.log").read_text()
        assert server.proc.poll() is None
    finally:
        assert server.stop() == 0
    assert no_arena_left(data_dir)

    # A start on a disk already full: it starts, says so in one line, serves what nvme holds.
    small_fs.fill("filler-2")
    server, port = start(data_dir, log_dir)
    try:
        log = (data_dir / "serve.log").read_text()
        lines = [line for line in log.splitlines() if "nvme tier" in line and "degraded" in line]
        assert len(lines) == 1, log[-3000:]
        assert metric(port, "kvstore_tier_degraded") == 1
        with connect(server.unix) as kv:
            fp = kv.register(MODEL)
            got = kv.get(fp, chain(fp, 0))
            assert len(got) == CHAIN and all(bytes(v) == payload(0, i) for i, v in enumerate(got))
    finally:
        assert server.stop() == 0
    assert no_arena_left(data_dir)
    remove_shm_files(data_dir)


def test_a_read_only_nvme_file_system_is_served_read_only_and_a_fresh_one_is_off(
    small_fs: SmallFs, log_dir: Path
) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    nvme = small_fs.path / "nvme"
    try:
        server, _ = start(data_dir, log_dir, **{"nvme.path": str(nvme)})
        try:
            with connect(server.unix) as kv:
                fp = kv.register(MODEL)
                kv.write(fp, chain(fp, 0), [payload(0, i) for i in range(CHAIN)])
        finally:
            assert server.stop() == 0  # spilled into nvme
        small_fs.remount("ro")
        server, port = start(data_dir, log_dir, **{"nvme.path": str(nvme)})
        try:
            assert metric(port, "kvstore_tier_degraded") == 1
            log = (data_dir / "serve.log").read_text()
            assert "read-only file system" in log, log[-3000:]
            with connect(server.unix) as kv:
                fp = kv.register(MODEL)
                got = kv.get(fp, chain(fp, 0))
                assert len(got) == CHAIN and all(bytes(v) == payload(0, i) for i, v in enumerate(got))
                kv.write(fp, chain(fp, 1), [payload(1, i) for i in range(CHAIN)])  # dram takes it
                assert kv.lookup(fp, chain(fp, 1)) == CHAIN
        finally:
            assert server.stop() == 0
        # No environment there to serve: the server starts without nvme, and says so.
        server, _ = start(data_dir, log_dir, **{"nvme.path": str(small_fs.path / "fresh")})
        try:
            log = (data_dir / "serve.log").read_text()
            assert len([line for line in log.splitlines() if "nvme tier off" in line]) == 1, log[-3000:]
            with connect(server.unix) as kv:
                assert "nvme" not in [t["name"] for t in kv.stats()["tiers"]]
        finally:
            assert server.stop() == 0
        assert no_arena_left(data_dir)
    finally:
        small_fs.remount("rw")
        remove_shm_files(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.mark.parametrize("small_fs", ["loop,errors=remount-ro"], indirect=True)
def test_a_file_system_turned_read_only_under_a_running_server_degrades_nvme_and_serving_goes_on(
    small_fs: SmallFs, log_dir: Path
) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    try:
        server, port = start(data_dir, log_dir, **{"nvme.path": str(small_fs.path / "nvme")})
        try:
            with connect(server.unix) as kv:
                fp = kv.register(MODEL)
                for n in range(3):  # 12 MiB through a 4 MiB dram: most of it into nvme
                    kv.write(fp, chain(fp, n), [payload(n, i) for i in range(CHAIN)])
                time.sleep(1.5)  # synced (nvme.sync_interval_s = 1 s)
                small_fs.fail()
                for n in range(3, 8):
                    kv.write(fp, chain(fp, n), [payload(n, i) for i in range(CHAIN)])
                assert wait_for(lambda: metric(port, "kvstore_tier_degraded") == 1), "no degraded nvme"
                assert server.proc.poll() is None, "the server died on a read-only file system"
                assert kv.lookup(fp, chain(fp, 7)) == CHAIN  # in dram
                got = kv.get(fp, chain(fp, 0))  # out of nvme, whose pages the kernel still holds
                assert got and all(bytes(v) == payload(0, i) for i, v in enumerate(got))
            log = (data_dir / "serve.log").read_text()
            assert len([line for line in log.splitlines() if "degraded:" in line]) == 1, log[-3000:]
            assert "Read-only file system" in log
        finally:
            assert server.stop() == 0
        assert no_arena_left(data_dir)
    finally:
        remove_shm_files(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


def test_a_scribbled_nvme_is_moved_aside_counted_and_never_served(log_dir: Path) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    try:
        server, _ = start(data_dir, log_dir)
        try:
            with connect(server.unix) as kv:
                fp = kv.register(MODEL)
                for n in range(3):
                    kv.write(fp, chain(fp, n), [payload(n, i) for i in range(CHAIN)])
        finally:
            assert server.stop() == 0  # every block in nvme now
        data = data_dir / "nvme" / "data.mdb"
        env = lmdb.open(str(data.parent), readonly=True, lock=False)
        size = (env.info()["last_pgno"] + 1) * 4096  # the pages in use (the file is reserved ahead)
        env.close()
        with open(data, "r+b") as f:  # both meta pages, and pages in the middle
            for at in (0, 4096, size // 3, size // 2, size - 8192):
                f.seek(at)
                f.write(os.urandom(4096))
        server, port = start(data_dir, log_dir)
        try:
            assert metric(port, "kvstore_tier_damaged_moved_total") == 1
            [moved] = data_dir.glob("nvme.damaged-*")
            assert (moved / "data.mdb").stat().st_size > 0, "kept for inspection"
            log = (data_dir / "serve.log").read_text()
            assert len([line for line in log.splitlines() if str(moved) in line]) == 1, log[-3000:]
            with connect(server.unix) as kv:
                fp = kv.register(MODEL)
                for n in range(3):
                    assert kv.lookup(fp, chain(fp, n)) == 0  # nothing served from the damaged copy
                kv.write(fp, chain(fp, 9), [payload(9, i) for i in range(CHAIN)])
                got = kv.get(fp, chain(fp, 9))
                assert [bytes(v) for v in got] == [payload(9, i) for i in range(CHAIN)]
        finally:
            assert server.stop() == 0
    finally:
        remove_shm_files(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)
