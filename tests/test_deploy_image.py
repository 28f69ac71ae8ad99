"""The image of deploy/Containerfile, run as the engine pod runs it, where podman can.

``KVSTORE_TEST_IMAGE`` names a built image (``KVSTORE_TEST_PODMAN_FLAGS``: what this host's podman
needs, e.g. ``--runtime runc --ulimit nofile=16384:16384``). Podman runs its sidecar with the
pod's own args and settings, scaled down, and an "engine" container beside it: sharing
``/dev/shm`` (the sidecar's IPC) and the socket folder as the same user, it writes and reads
blocks through the arena; as another user, or without the shared ``/dev/shm``, it cannot.
Building needs a base image and PyPI, which CI has not, so CI skips it (docs/deploy.md).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests import deploy_manifests as dm

IMAGE = os.environ.get("KVSTORE_TEST_IMAGE", "")
# What the engine container runs: a same-host write and read through the arena, as the connector's.
ENGINE_CHECK = """
import os, sys
from kvstore import ModelIdentity, block_keys, connect
m = ModelIdentity("test/tiny", "aa" * 32, num_layers=2, num_kv_heads=2, head_dim=32, tokens_per_block=16)
with connect(sys.argv[1]) as kv:
    fp = kv.register(m)
    keys = block_keys(fp, list(range(64)), 16)
    size = 2 * 2 * 2 * 32 * 16 * 2
    blocks = [bytes([i + 1]) * size for i in range(len(keys))]
    kv.write(fp, keys, blocks)
    outs = [bytearray(size) for _ in keys]
    n = kv.read_into(fp, keys, [memoryview(o) for o in outs])
    assert n == len(keys) and [bytes(o) for o in outs] == blocks, n
    print("restored", n, "blocks from", kv.attach().name)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _podman(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    flags = shlex.split(os.environ.get("KVSTORE_TEST_PODMAN_FLAGS", "")) if args[0] == "run" else []
    return subprocess.run(
        ["podman", args[0], *flags, *args[1:]], capture_output=True, text=True, timeout=timeout_s, check=False
    )


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.mark.skipif(
    not IMAGE or shutil.which("podman") is None,
    reason="KVSTORE_TEST_IMAGE names no image built from deploy/Containerfile (building needs a "
    "base image and PyPI, which CI has not)",
)
def test_the_image_serves_an_engine_beside_it_as_the_pod_does(tmp_path: Path) -> None:
    uid = dm.image_uid()
    config, run = tmp_path / "config", tmp_path / "run"
    config.mkdir()
    data = tmp_path / "data"
    for folder in (run, data):  # the pod's emptyDirs, writable by the image's user
        folder.mkdir()
        os.chown(folder, uid, uid)
    (config / "sidecar.toml").write_text(dm.find("ConfigMap", "kvstore-config")["data"]["sidecar.toml"])
    (tmp_path / "check.py").write_text(ENGINE_CHECK)
    metrics = _free_port()
    sidecar_args = dm.container(dm.pod(dm.find("StatefulSet", "vllm")), "kvstore")["args"]
    # The pod's settings, scaled to this machine; loopback ports, since it shares the host's network.
    scaled = [
        "dram.capacity_bytes=256MiB",
        "nvme.capacity_bytes=256MiB",
        f"server.tcp_address=127.0.0.1:{_free_port()}",
        f"server.data_address=127.0.0.1:{_free_port()}",
        f"server.metrics_address=127.0.0.1:{metrics}",
        "remote.backend=",  # no shared nodes here
    ]
    name = f"kvstore-test-{os.getpid()}"
    started = _podman(
        "run", "-d", "--name", name, "--network", "host", "--shm-size", "512m",
        # as the pod's securityContext: a read-only root, no capabilities, no escalation
        "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "-v", f"{config}:/etc/kvstore:ro", "-v", f"{run}:/run/kvstore", "-v", f"{data}:/var/lib/kvstore",
        IMAGE, *sidecar_args, *(a for s in scaled for a in ("--set", s)),
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if _get(f"http://127.0.0.1:{metrics}/readyz") == 200:
                    break
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        else:
            pytest.fail(f"the sidecar never became ready: {_podman('logs', name).stderr[-2000:]}")
        assert _get(f"http://127.0.0.1:{metrics}/healthz") == 200
        assert (data / "kvstore.lock").exists() and (data / "nvme").is_dir()  # data_dir is the volume
        socket_file = run / "kvstore.sock"
        assert (socket_file.stat().st_uid, socket_file.stat().st_mode & 0o777) == (uid, 0o600)
        engine = ["-v", f"{run}:/run/kvstore", "-v", f"{tmp_path / 'check.py'}:/check.py:ro"]
        engine += ["--entrypoint", "python", "--rm"]
        address = "unix:///run/kvstore/kvstore.sock"
        # Same user, shared /dev/shm (the pod's IPC) and socket folder: blocks go through the arena.
        same = _podman("run", "--ipc", f"container:{name}", *engine, IMAGE, "/check.py", address)
        assert same.returncode == 0 and "restored 4 blocks" in same.stdout, same.stderr[-2000:]
        # Another user cannot open the 0600 socket.
        other = _podman(
            "run",
            "--ipc",
            f"container:{name}",
            "--user",
            f"{uid + 1}:{uid + 1}",
            *engine,
            IMAGE,
            "/check.py",
            address,
        )
        assert other.returncode != 0 and "Permission denied" in other.stderr
        # Without the shared /dev/shm the arena cannot be mapped.
        apart = _podman("run", *engine, IMAGE, "/check.py", address)
        assert apart.returncode != 0 and "No such file" in apart.stderr
        # SIGTERM drains and exits 0.
        assert _podman("stop", "-t", "30", name).returncode == 0
        assert _podman("inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip() == "0"
        assert "Traceback" not in _podman("logs", name).stderr
    finally:
        _podman("rm", "-f", name)
