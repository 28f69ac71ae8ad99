"""The deploy manifests as data, and the settings ``kvstore serve`` would load from them.

``server_settings(workload, container, tmp)`` reads a server container as the pod runs it: its
args through the CLI's own parser, the ConfigMap file its ``--config`` names (through the volume
mounted there), the image's and the container's ``KVSTORE_*`` variables (Secret values from
secrets.example.yaml) through ``load_settings``. Shared by tests/test_deploy.py and
tests/test_deploy_image.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kvstore.cli.main import build_parser
from kvstore.server.config import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
MANIFESTS = ("config.yaml", "engine.yaml", "shared.yaml", "router.yaml", "servicemonitor.yaml")
EXAMPLES = ("secrets.example.yaml",)  # validated, not applied by kustomization.yaml
# Native sidecars (an init container with restartPolicy Always) need 1.29; the newest the tool ships.
KUBERNETES_VERSIONS = ("1.29", "1.37")
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
GiB = 1 << 30
# /dev/shm beyond the arena: its journal (about 0.4 KiB a block) and the engine's own use.
SHM_HEADROOM_BYTES = 1 * GiB
PROCESS_HEADROOM_BYTES = 1 * GiB  # the server process beside the arena its pages are charged to


def documents(name: str) -> list[dict[str, Any]]:
    with open(K8S / name, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def all_documents() -> Iterator[tuple[str, dict[str, Any]]]:
    for name in MANIFESTS + EXAMPLES:
        for doc in documents(name):
            yield name, doc


def find(kind: str, name: str) -> dict[str, Any]:
    found = [d for _, d in all_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in deploy/kubernetes"
    return found[0]


def quantity(text: str | int) -> int:
    """A Kubernetes quantity in bytes (``18Gi``, ``1Mi``, ``500G``)."""
    match = re.fullmatch(r"([0-9]+)([KMGTP]i?)?", str(text))
    assert match, f"not a byte quantity: {text!r}"
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10**3, "M": 10**6}
    units.update({"G": 10**9, "T": 10**12, "": 1})
    return int(match.group(1)) * units[match.group(2) or ""]


def secret_values() -> dict[str, str]:
    secret = find("Secret", "kvstore-tokens")
    return {k: str(v) for k, v in secret["stringData"].items()}


def image_env() -> dict[str, str]:
    """The ``KVSTORE_*`` variables deploy/Containerfile sets in the image."""
    text = (DEPLOY / "Containerfile").read_text(encoding="utf-8")
    return dict(re.findall(r"\b(KVSTORE_[A-Z_]+)=(\S+)", text))


def image_uid() -> int:
    match = re.search(r"^ARG UID=(\d+)$", (DEPLOY / "Containerfile").read_text(encoding="utf-8"), re.M)
    assert match, "deploy/Containerfile sets no ARG UID"
    return int(match.group(1))


def pod(workload: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = workload["spec"]["template"]["spec"]
    return pod


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [
        c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == name
    ]
    assert len(found) == 1, f"container {name}: {len(found)}"
    return found[0]


def mounts(container: dict[str, Any]) -> dict[str, str]:
    """mount path -> volume name."""
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [v for v in pod["volumes"] if v["name"] == name]
    assert len(found) == 1, f"volume {name}: {len(found)}"
    return found[0]


def port(container: dict[str, Any], name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert name in ports, f"{container['name']} declares no port {name!r}"
    return int(ports[name])


def server_settings(workload: dict[str, Any], container_name: str, tmp_path: Path) -> Settings:
    """What ``kvstore serve`` loads in this container: its args through the CLI's parser, the
    ConfigMap file its --config names (through the volume mounted there), the image's and
    the container's variables."""
    server = container(pod(workload), container_name)
    args = build_parser().parse_args(server["args"])
    assert args.command == "serve"
    folder, _, key = str(args.config).rpartition("/")
    config = volume(pod(workload), mounts(server)[folder])
    config_map = find("ConfigMap", config["configMap"]["name"])
    toml_path = tmp_path / key
    toml_path.write_text(config_map["data"][key], encoding="utf-8")
    env = image_env()
    secrets = secret_values()
    for var in server.get("env", []):
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        env[var["name"]] = secrets[ref["key"]] if ref else var["value"]
    overrides = dict(item.split("=", 1) for item in args.set or [])
    if args.tcp:
        overrides["server.tcp_address"] = args.tcp
    if args.socket:
        overrides["server.socket_path"] = args.socket
    return load_settings(toml_path, env=env, overrides=overrides)


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    assert len(values) == 1, f"{name}: {values}"
    return values[0]


def key_lines(text: str) -> list[tuple[str, str]]:
    """``KEY=TENANT`` lines (a tokens file's, or the router's keys): (key, tenant) pairs."""
    pairs = []
    for line in text.splitlines():
        key, sep, tenant = line.strip().partition("=")
        if sep:
            pairs.append((key, tenant))
    return pairs
