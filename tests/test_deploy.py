"""deploy/: what the manifests and the unit promise, against what the code needs.

- The Kubernetes manifests pass the Kubernetes schemas, offline (``kubernetes-validate``, strict:
  an unknown field fails); the ServiceMonitor is a CRD the tool has no schema for, so it is
  checked structurally against the Services it must select.
- Each server's settings are what ``kvstore serve`` would load in that container: its args
  through the CLI's own parser, its ConfigMap file, the image's and the container's
  ``KVSTORE_*`` variables (Secret values from secrets.example.yaml) through
  ``load_settings``. Against them: ``/dev/shm`` holds the arena, the memory limit holds it, the
  disk holds LMDB's map, engine and sidecar share the socket folder, ``/dev/shm`` and the user
  (the image's UID), the probes reach the metrics listener, the fleet's names and tokens agree.
- The systemd unit passes ``systemd-analyze verify`` with no warning.

The image itself, run in podman where it can be: tests/test_deploy_image.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli.main import build_parser
from kvstore.cli.route import read_salt_secret
from kvstore.server.auth import read_tokens_file
from kvstore.server.config import Settings, load_settings, parse_size

try:
    import kubernetes_validate
    import yaml
except ImportError:
    if os.environ.get("REQUIRE_TEST_TOOLS"):  # the dev extra installs it: CI must not skip these
        raise
    pytest.skip("kubernetes-validate is not installed (pip install -e '.[dev]')", allow_module_level=True)

from tests import deploy_manifests as dm

# ------------------------------------------------------------------ schemas


@pytest.mark.parametrize("version", dm.KUBERNETES_VERSIONS)
def test_manifests_pass_the_kubernetes_schemas(version: str) -> None:
    checked = 0
    for name, doc in dm.all_documents():
        if (doc["apiVersion"], doc["kind"]) in dm.CRDS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} against {version}: {exc}")
        checked += 1
    assert checked >= 8  # ConfigMap, Secret, three Services, two StatefulSets, a Deployment


def test_the_schema_check_refuses_a_misspelled_field_and_a_wrong_type() -> None:
    """The check above would catch a mistake: strict mode refuses a field the API does not have."""
    engine = dm.find("StatefulSet", "vllm")
    misspelled = copy.deepcopy(engine)
    dm.pod(misspelled)["securityContext"]["runAsUsr"] = 10001
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelled, dm.KUBERNETES_VERSIONS[-1], strict=True)
    wrong_type = copy.deepcopy(engine)
    dm.pod(wrong_type)["securityContext"]["runAsUser"] = "10001"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, dm.KUBERNETES_VERSIONS[-1], strict=True)


def test_service_monitors_select_services_and_ports_that_exist() -> None:
    services = [d for _, d in dm.all_documents() if d["kind"] == "Service"]
    secrets = dm.secret_values()
    monitors = [d for _, d in dm.all_documents() if d["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"kvstore", "kvstore-router"}
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        spec = monitor["spec"]
        assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
        selected = [s for s in services if _selects(spec["selector"], s["metadata"].get("labels", {}))]
        assert selected, f"ServiceMonitor {monitor['metadata']['name']} selects no Service"
        for endpoint in spec["endpoints"]:
            assert endpoint["path"] == "/metrics"
            assert re.fullmatch(r"[0-9]+s", endpoint["interval"])
            for service in selected:
                names = {p["name"] for p in service["spec"]["ports"]}
                assert endpoint["port"] in names, (
                    f"{service['metadata']['name']} has no port {endpoint['port']}"
                )
            if "authorization" in endpoint:
                credentials = endpoint["authorization"]["credentials"]
                assert endpoint["authorization"]["type"] == "Bearer"
                assert credentials["name"] == "kvstore-tokens" and credentials["key"] in secrets
    # every kvstore server's metrics port is scraped: both sidecars' Service and the shared nodes'
    scraped = {
        s["metadata"]["name"]
        for m in monitors
        for s in services
        if _selects(m["spec"]["selector"], s["metadata"].get("labels", {}))
    }
    assert scraped == {"vllm", "kvstore-shared", "kvstore-router"}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] in ("In", "NotIn", "Exists"), expression
        value = labels.get(expression["key"])
        if expression["operator"] == "In" and value not in expression["values"]:
            return False
        if expression["operator"] == "NotIn" and value in expression["values"]:
            return False
        if expression["operator"] == "Exists" and value is None:
            return False
    return True


def test_every_mount_names_a_volume_of_its_pod() -> None:
    """What the API server, not the schema, refuses: a mount of a volume the pod does not have."""
    for _, doc in dm.all_documents():
        if doc["kind"] not in ("StatefulSet", "Deployment"):
            continue
        pod = dm.pod(doc)
        volumes = {v["name"] for v in pod["volumes"]}
        volumes |= {c["metadata"]["name"] for c in doc["spec"].get("volumeClaimTemplates", [])}
        for container in pod.get("initContainers", []) + pod["containers"]:
            missing = set(dm.mounts(container).values()) - volumes
            assert not missing, f"{doc['metadata']['name']}/{container['name']} mounts {missing}"


def test_kustomization_applies_every_manifest_and_names_every_image() -> None:
    kustomization = yaml.safe_load((dm.K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(dm.MANIFESTS)
    on_disk = {p.name for p in dm.K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == set(dm.MANIFESTS + dm.EXAMPLES), "a manifest neither applied nor checked here"
    images = {i["name"] for i in kustomization["images"]}
    used = set()
    for _, doc in dm.all_documents():
        if doc["kind"] in ("StatefulSet", "Deployment"):
            pod = dm.pod(doc)
            used |= {c["image"].split(":")[0] for c in pod.get("initContainers", []) + pod["containers"]}
    assert used == images


def test_kustomize_renders_what_the_schemas_accept() -> None:
    """``kubectl apply -k`` as documented: kustomize renders, the images point at the registry."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed here (its kustomize renders deploy/kubernetes)")
    done = subprocess.run(
        ["kubectl", "kustomize", str(dm.K8S)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    rendered = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert len(rendered) == sum(len(dm.documents(name)) for name in dm.MANIFESTS)
    for doc in rendered:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvstore"
        if (doc["apiVersion"], doc["kind"]) not in dm.CRDS:
            kubernetes_validate.validate(doc, dm.KUBERNETES_VERSIONS[-1], strict=True)
        if doc["kind"] in ("StatefulSet", "Deployment"):
            pod = dm.pod(doc)
            for container in pod.get("initContainers", []) + pod["containers"]:
                assert container["image"].startswith("registry.example.com/"), container["image"]


# ------------------------------------------------------------------ the engine pod


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return dm.server_settings(dm.find("StatefulSet", "vllm"), "kvstore", tmp_path_factory.mktemp("sidecar"))


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return dm.server_settings(
        dm.find("StatefulSet", "kvstore-shared"), "kvstore", tmp_path_factory.mktemp("shared")
    )


def test_the_sidecar_runs_first_and_stays_up_beside_the_engine() -> None:
    pod = dm.pod(dm.find("StatefulSet", "vllm"))
    assert [c["name"] for c in pod["initContainers"]] == ["kvstore"]
    assert pod["initContainers"][0]["restartPolicy"] == "Always"  # a native sidecar
    assert [c["name"] for c in pod["containers"]] == ["vllm"]


def test_engine_and_sidecar_share_shm_the_socket_folder_and_the_user(sidecar: Settings) -> None:
    pod = dm.pod(dm.find("StatefulSet", "vllm"))
    engine, kv = dm.container(pod, "vllm"), dm.container(pod, "kvstore")
    # One user, the image's: the socket and the arena are 0600.
    uid = dm.image_uid()
    assert pod["securityContext"]["runAsUser"] == uid
    assert pod["securityContext"]["runAsNonRoot"] is True
    for container in (engine, kv):
        assert container.get("securityContext", {}).get("runAsUser", uid) == uid
    # The arena: one memory-backed volume at /dev/shm in both.
    assert dm.mounts(engine)["/dev/shm"] == dm.mounts(kv)["/dev/shm"]
    assert dm.volume(pod, dm.mounts(kv)["/dev/shm"])["emptyDir"]["medium"] == "Memory"
    # The connector's address is the sidecar's socket, in a folder both mount from one volume.
    config = json.loads(dm.flag(engine["args"], "--kv-transfer-config"))
    assert config["kv_connector_module_path"] == "engine_plugin.vllm_connector"
    assert config["kv_connector_extra_config"]["address"] == f"unix://{sidecar.socket_path}"
    for path in (sidecar.socket_path, Path(sidecar.server.data_socket_path)):
        folder = str(path.parent)
        assert dm.mounts(engine).get(folder) == dm.mounts(kv)[folder], f"{folder} is not shared"
    # The data folder (nvme, the lock) is the sidecar's alone, on its own volume.
    assert sidecar.data_dir in dm.mounts(kv) and sidecar.data_dir not in dm.mounts(engine)


@pytest.mark.parametrize("role", ["sidecar", "shared"])
def test_volumes_and_limits_hold_what_the_settings_ask(role: str, request: pytest.FixtureRequest) -> None:
    settings: Settings = request.getfixturevalue(role)
    workload = dm.find("StatefulSet", "vllm" if role == "sidecar" else "kvstore-shared")
    pod = dm.pod(workload)
    kv = dm.container(pod, "kvstore")
    arena = settings.dram.capacity_bytes
    assert arena >= 8 * dm.GiB  # the documented values, not a toy size
    shm = dm.volume(pod, dm.mounts(kv)["/dev/shm"])["emptyDir"]
    assert dm.quantity(shm["sizeLimit"]) >= arena + dm.SHM_HEADROOM_BYTES
    # The sidecar faults the arena in, so its pages are charged to this container.
    resources = kv["resources"]
    assert dm.quantity(resources["limits"]["memory"]) >= arena + dm.PROCESS_HEADROOM_BYTES
    assert resources["requests"]["memory"] == resources["limits"]["memory"]  # never the one evicted
    # LMDB maps what the nvme tier asks; a disk short of it degrades the tier when it fills.
    map_bytes = settings.nvme.effective_map_size_bytes
    data_volume = dm.mounts(kv)[settings.data_dir]
    claims = {c["metadata"]["name"]: c for c in workload["spec"].get("volumeClaimTemplates", [])}
    if data_volume in claims:
        disk = dm.quantity(claims[data_volume]["spec"]["resources"]["requests"]["storage"])
    else:
        disk = dm.quantity(dm.volume(pod, data_volume)["emptyDir"]["sizeLimit"])
    assert settings.nvme.enabled and disk >= map_bytes
    assert str(settings.nvme_path).startswith(settings.data_dir + "/")
    # The drain (in-flight calls, dram copied to nvme, the flush) fits before the SIGKILL.
    assert pod["terminationGracePeriodSeconds"] >= settings.server.drain_grace_s + 30


@pytest.mark.parametrize("role", ["sidecar", "shared"])
def test_probes_and_ports_reach_the_listeners(role: str, request: pytest.FixtureRequest) -> None:
    settings: Settings = request.getfixturevalue(role)
    workload = dm.find("StatefulSet", "vllm" if role == "sidecar" else "kvstore-shared")
    kv = dm.container(dm.pod(workload), "kvstore")
    host, port = dm.host_port(settings.server.metrics_address)
    assert host == "0.0.0.0"  # the kubelet and Prometheus come from outside the pod
    assert dm.port(kv, "metrics") == port
    for probe, path in (
        ("startupProbe", "/readyz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        get = kv[probe]["httpGet"]
        assert get["path"] == path
        assert get["port"] == "metrics"
    grpc_name = "kvstore-grpc" if role == "sidecar" else "grpc"
    data_name = "kvstore-data" if role == "sidecar" else "data"
    assert dm.host_port(settings.server.tcp_address) == ("0.0.0.0", dm.port(kv, grpc_name))
    assert dm.host_port(settings.server.data_address) == ("0.0.0.0", dm.port(kv, data_name))
    service = dm.find("Service", workload["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # each replica by its own name
    pod = dm.pod(workload)
    declared = {
        p["name"] for c in pod.get("initContainers", []) + pod["containers"] for p in c.get("ports", [])
    }
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= declared


# ------------------------------------------------------------------ the fleet


def test_sidecars_name_every_shared_node_with_a_token_it_accepts(sidecar: Settings, shared: Settings) -> None:
    workload = dm.find("StatefulSet", "kvstore-shared")
    service = workload["spec"]["serviceName"]
    _, port = dm.host_port(shared.server.tcp_address)
    expected = tuple(
        f"{workload['metadata']['name']}-{i}.{service}:{port}" for i in range(workload["spec"]["replicas"])
    )
    assert sidecar.remote.backend == "kvstore"
    assert sidecar.remote.nodes == expected
    namespace = f"t/{sidecar.server.unix_tenant}"  # the engine's blocks, over the Unix socket
    assert sidecar.remote.tokens[namespace] in shared.server.tokens


def test_the_router_names_every_replica_and_its_sidecar(sidecar: Settings, tmp_path: Path) -> None:
    engines = dm.find("StatefulSet", "vllm")
    router_pod = dm.pod(dm.find("Deployment", "kvstore-router"))
    router = dm.container(router_pod, "router")
    args = build_parser().parse_args(router["args"])
    assert args.command == "route"
    engine = dm.container(dm.pod(engines), "vllm")
    name, service = engines["metadata"]["name"], engines["spec"]["serviceName"]
    replicas = [f"{name}-{i}.{service}" for i in range(engines["spec"]["replicas"])]
    engine_port = int(dm.flag(engine["args"], "--port"))
    assert args.backend == [f"http://{r}:{engine_port}" for r in replicas]
    _, sidecar_port = dm.host_port(sidecar.server.tcp_address)
    assert args.sidecar == [f"{r}:{sidecar_port}" for r in replicas]
    assert args.block_size == int(dm.flag(engine["args"], "--block-size"))
    assert args.model == dm.flag(engine["args"], "--model")
    # Its token reaches the engine's blocks at each sidecar.
    secrets = dm.secret_values()
    token_ref = next(v for v in router["env"] if v["name"] == "KVSTORE_TOKEN")["valueFrom"]["secretKeyRef"]
    assert sidecar.server.tokens[secrets[token_ref["key"]]] == sidecar.server.unix_tenant
    # Its keys file: the init container copies it to where --keys-file reads, 0600, and the
    # ops tenant Prometheus scrapes with is one of its tenants.
    keys = dm.container(router_pod, "keys")
    assert keys["command"][:3] == ["install", "-m", "0600"] and keys["command"][-1] == args.keys_file
    keys_file = tmp_path / "keys"
    keys_file.write_text(secrets["router-keys"], encoding="utf-8")
    keys_file.chmod(0o600)
    tenants = read_tokens_file(str(keys_file), setting="--keys-file")
    assert tenants[secrets["ops-key"]] in args.ops_tenant
    # Its salt secret comes from the Secret (one for every pod and restart: warm caches), which
    # the router accepts (it refuses to start with keys and none).
    variable = "KVSTORE_ROUTE_SALT_SECRET"
    salt_ref = next(v for v in router["env"] if v["name"] == variable)["valueFrom"]["secretKeyRef"]
    assert salt_ref["name"] == "kvstore-tokens" and not args.salt_secret_file
    assert read_salt_secret("", {variable: secrets[salt_ref["key"]]})


# ------------------------------------------------------------------ systemd


def test_the_systemd_unit_verifies_without_a_warning(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here (Debian: apt-get install systemd)")
    unit = (dm.DEPLOY / "systemd" / "kvstore.service").read_text(encoding="utf-8")
    exec_start = re.search(r"^ExecStart=(\S+) serve --config (\S+)$", unit, re.M)
    assert exec_start, "ExecStart is not `<kvstore> serve --config <file>`"
    # verify checks that the command exists: point it at this environment's kvstore.
    kvstore = shutil.which("kvstore")
    assert kvstore is not None
    copy_ = tmp_path / "kvstore.service"
    copy_.write_text(unit.replace(exec_start.group(1), kvstore), encoding="utf-8")
    done = subprocess.run(
        ["systemd-analyze", "verify", str(copy_)], capture_output=True, text=True, timeout=60, check=False
    )
    # verify exits 0 on an unknown key or a bad value and only says so: any output fails.
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stderr
    # The folders the settings need are the ones systemd makes for the service.
    env = dict(re.findall(r"^Environment=(KVSTORE_[A-Z_]+)=(\S+)$", unit, re.M))
    settings = load_settings(None, env=env)
    assert settings.data_dir == "/var/lib/" + re.search(r"^StateDirectory=(\S+)$", unit, re.M).group(1)  # type: ignore[union-attr]
    runtime = "/run/" + re.search(r"^RuntimeDirectory=(\S+)$", unit, re.M).group(1)  # type: ignore[union-attr]
    assert str(settings.socket_path.parent) == runtime
    assert str(Path(settings.server.data_socket_path).parent) == runtime
    assert "PrivateDevices=yes" not in unit and "PrivateIPC=yes" not in unit  # /dev/shm is shared


def test_parse_size_matches_kubernetes_quantities() -> None:
    """The sizes compared above mean the same bytes on both sides (dm.GiB == Gi)."""
    assert parse_size("16GiB") == dm.quantity("16Gi") and parse_size("1MiB") == dm.quantity("1Mi")
