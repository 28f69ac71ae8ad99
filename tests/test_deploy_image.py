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


def _get(url: str, token: str = "") -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _wait_for(url: str, name: str, token: str = "", want: tuple[int, ...] = (200,)) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if _get(url, token) in want:
                return
        except OSError:
            pass  # not listening yet
        if _podman("inspect", name, "--format", "{{.State.Running}}").stdout.strip() != "true":
            break  # it exited: its log says why
        time.sleep(0.5)
    pytest.fail(f"{name} never answered {url}: {_podman('logs', name).stderr[-2000:]}")


needs_image = pytest.mark.skipif(
    not IMAGE or shutil.which("podman") is None,
    reason="KVSTORE_TEST_IMAGE names no image built from deploy/Containerfile (building needs a "
    "base image and PyPI, which CI has not)",
)
# As the pods' securityContext: a read-only root, no capabilities, no escalation.
LOCKED_DOWN = ("--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges")


@needs_image
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
        *LOCKED_DOWN,
        "-v", f"{config}:/etc/kvstore:ro", "-v", f"{run}:/run/kvstore", "-v", f"{data}:/var/lib/kvstore",
        IMAGE, *sidecar_args, *(a for s in scaled for a in ("--set", s)),
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    try:
        _wait_for(f"http://127.0.0.1:{metrics}/readyz", name)
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


@needs_image
def test_the_image_routes_as_the_router_deployment_runs_it(tmp_path: Path) -> None:
    """router.yaml in the image: the init container makes the 0600 keys file out of a Secret
    mounted 0440 under fsGroup, and the router starts on it with the Deployment's args, its
    port open (the kubelet's probe) and /metrics open to the ops key only (Prometheus')."""
    from benchmarks.tiny_model import build_tiny_llama  # torch: only where this test runs

    uid = dm.image_uid()
    secrets = dm.secret_values()
    deployment = dm.pod(dm.find("Deployment", "kvstore-router"))
    init, router = dm.container(deployment, "keys"), dm.container(deployment, "router")
    secret_dir, run = tmp_path / "secrets", tmp_path / "run"
    secret_dir.mkdir()
    run.mkdir()
    os.chown(run, uid, uid)
    keys = secret_dir / "router-keys"
    keys.write_text(secrets["router-keys"])
    os.chown(keys, 0, uid)  # what the kubelet makes of the Secret volume under fsGroup
    keys.chmod(0o440)
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    copied = _podman(
        "run", "--rm", *LOCKED_DOWN, "--user", f"{uid}:{uid}",
        "-v", f"{secret_dir}:{mounts['keys-secret']}:ro", "-v", f"{run}:{mounts['router-run']}",
        "--entrypoint", init["command"][0], IMAGE, *init["command"][1:],
    )  # fmt: skip
    assert copied.returncode == 0, copied.stderr
    copy_ = run / Path(init["command"][-1]).name
    assert (copy_.stat().st_uid, copy_.stat().st_mode & 0o777) == (uid, 0o600)
    model = next(a.split("=", 1)[1] for a in router["args"] if a.startswith("--model="))
    build_tiny_llama(tmp_path / "model", seed=0)
    port = _free_port()
    args = [f"--listen=127.0.0.1:{port}" if a.startswith("--listen=") else a for a in router["args"]]
    # the container's environment as the kubelet makes it: its values, and its Secret's keys
    # (the token, the salt secret)
    env = [
        f"{v['name']}={v['value'] if 'value' in v else secrets[v['valueFrom']['secretKeyRef']['key']]}"
        for v in router["env"]
    ]
    name = f"kvstore-router-test-{os.getpid()}"
    started = _podman(
        "run", "-d", "--name", name, "--network", "host", *LOCKED_DOWN,
        *(arg for pair in env for arg in ("-e", pair)),
        "-v", f"{run}:{mounts['router-run']}:ro", "-v", f"{tmp_path / 'model'}:{model}:ro",
        IMAGE, *args,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    try:
        ops, user = secrets["ops-key"], next(k for k, t in dm.key_lines(secrets["router-keys"]) if t != "ops")
        _wait_for(f"http://127.0.0.1:{port}/metrics", name, token=ops)
        assert _get(f"http://127.0.0.1:{port}/metrics", token=user) == 403
        # the replicas (vllm-0.vllm, ...) do not exist here: /health says none is up
        assert _get(f"http://127.0.0.1:{port}/health", token=ops) == 503
        assert _podman("stop", "-t", "30", name).returncode == 0
        assert "Traceback" not in _podman("logs", name).stderr
    finally:
        _podman("rm", "-f", name)
