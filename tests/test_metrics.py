"""The metrics port of real ``kvstore serve`` processes: every figure ``kvstore stats`` shows is a
Prometheus series with the same value (the remote tier's health included), beside the process
and build series; only /metrics serves metrics, /healthz and /readyz answer probes (503 while
the server drains); two servers on one host both start with the default metrics address; and
every series the Grafana dashboard and the alert rules in deploy/ query is on /metrics, the
rules passing ``promtool check rules``.

One shared node and one sidecar (remote tier: that node and a dead one) serve the module; the
drain test starts a server of its own, as it stops it.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.ports import free_port
from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.server.config import ServerSettings
from kvstore.server.metrics import Metrics
from kvstore.server.metrics_http import DEFAULT_ADDRESS
from kvstore.server.metrics_store import COUNTERS, GAUGES
from proto import kvstore_pb2 as pb
from proto import kvstore_pb2_grpc as pb_grpc
from tests.service_fixtures import MODEL, blocks_for, chain, process_settings

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "kvstore.json"
RULES = ROOT / "deploy" / "prometheus" / "kvstore-rules.yml"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metrics_url(unix: str) -> str:
    """The metrics port's base URL, as ``kvstore stats`` lists it."""
    with connect(unix) as kv:
        (address,) = [a for a in kv.stats()["addresses"] if a.startswith("metrics ")]
    return address.removeprefix("metrics ").removesuffix("/metrics")


def scrape(base: str) -> Samples:
    status, text = get(f"{base}/metrics")
    assert status == 200, text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} is not on /metrics"
    return samples[key]


class Fleet:
    """A shared node and a sidecar whose remote tier is that node and a dead one, both with the
    default metrics address, and traffic through the sidecar: every labelled series exists."""

    def __init__(self) -> None:
        assert ServerSettings().metrics_address == "auto", "these servers are meant to use the default"
        self.servers: list[ServerProcess] = []
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self.node = ServerProcess({**process_settings(), "server.metrics_address": "auto"}, tcp=True)
        self.servers.append(self.node)
        remote = {
            "remote.backend": "kvstore",
            "remote.nodes": f"{self.node.tcp},127.0.0.1:{free_port()}",  # the second: nobody there
            "remote.tokens": "t/local=tok-a",
            "remote.backoff_s": "300",  # the dead node stays down while the tests read
            "remote.max_backoff_s": "300",
        }
        self.sidecar = ServerProcess({**process_settings(**remote), "server.metrics_address": "auto"})
        self.servers.append(self.sidecar)
        self.node_url, self.url = metrics_url(self.node.unix), metrics_url(self.sidecar.unix)
        keys = chain(16, salt="metrics")
        with connect(self.sidecar.unix) as kv:
            fp = kv.register(MODEL)
            assert kv.write(fp, keys, blocks_for(keys)) == 16
            assert kv.lookup_tiers(fp, keys + chain(2, salt="metrics-miss")).hit_blocks == 16
            outs = [memoryview(bytearray(len(b))) for b in blocks_for(keys[:4])]
            assert kv.read_into(fp, keys[:4], outs) == 4

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        f.stop()


def settled_stats(unix: str) -> dict[str, object]:
    """``kvstore stats --json``'s figures once the remote copies are sent and the dead node is
    down: two reads in a row the same."""
    deadline = time.monotonic() + 30
    with connect(unix) as kv:
        before = kv.stats()
        while True:
            time.sleep(0.2)
            after = kv.stats()
            counters = after["counters"]
            settled = counters.get("remote_nodes_down") == 1 and counters.get("remote_stored_blocks", 0) > 0
            if settled and {**before, "uptime_s": 0} == {**after, "uptime_s": 0}:
                return after
            assert time.monotonic() < deadline, f"the sidecar's figures did not settle: {counters}"
            before = after


def test_every_figure_of_stats_is_a_metric_with_the_same_value(fleet: Fleet) -> None:
    stats = settled_stats(fleet.sidecar.unix)
    samples = scrape(fleet.url)
    checked = {"tenant", "addresses"}  # names, not figures
    for tier in stats["tiers"]:  # type: ignore[attr-defined]
        t = tier["name"]
        for field, name in [
            ("capacity_bytes", "kvstore_tier_capacity_bytes"),
            ("used_bytes", "kvstore_tier_used_bytes"),
            ("stored_bytes", "kvstore_tier_stored_bytes"),
            ("blocks", "kvstore_tier_blocks"),
            ("checksum_failures", "kvstore_tier_checksum_failures_total"),
        ]:
            assert value(samples, name, tier=t) == tier[field], (t, field)
    checked.add("tiers")
    for key, count in stats["counters"].items():  # type: ignore[attr-defined]
        evicted = re.fullmatch(r"evicted_(\w+)_blocks", key)
        if evicted:
            assert value(samples, "kvstore_evictions_total", tier=evicted[1]) == count, key
        else:
            name = (COUNTERS.get(key) or GAUGES.get(key) or (f"kvstore_{key}_total", ""))[0]
            assert value(samples, name) == count, key
    checked.add("counters")
    for namespace, nbytes in stats["tenant_bytes"].items():  # type: ignore[attr-defined]
        assert value(samples, "kvstore_namespace_bytes", namespace=namespace) == nbytes
    checked.add("tenant_bytes")
    absent = [key for key, v in samples.items() if key[0] == "kvstore_tier_absent" and v == 1]
    assert len(absent) == len(stats["absent_tiers"]) > 0  # type: ignore[arg-type]
    checked.add("absent_tiers")
    assert value(samples, "kvstore_blocks") == stats["blocks"] == 16
    assert value(samples, "kvstore_leases") == stats["leases"]
    checked |= {"blocks", "leases"}
    assert (
        value(samples, "kvstore_build_info", version=str(stats["version"]), python=sys.version.split()[0])
        == 1
    )
    checked.add("version")
    # uptime: the process started before its service did, and within this test's lifetime
    started = value(samples, "process_start_time_seconds")
    assert time.time() - 600 < started <= time.time() - float(stats["uptime_s"]) + 1  # type: ignore[arg-type]
    checked.add("uptime_s")
    looked = {
        r: value(samples, "kvstore_lookup_tokens_total", tenant="local", result=r) for r in ("hit", "miss")
    }
    assert (
        (looked["hit"] + looked["miss"], looked["hit"])
        == (stats["lookup_tokens"], stats["hit_tokens"])
        != (0, 0)
    )
    checked |= {"lookup_tokens", "hit_tokens"}
    # per model blocks and bytes: not exported (a walk of every block under the store's lock at
    # each scrape; kvstore.server.metrics_store says why)
    checked.add("fingerprints")
    for listener, count in stats.get("connections", {}).items():  # type: ignore[attr-defined]
        assert value(samples, "kvstore_connections", listener=listener) >= 0 and count >= 0
    for tenant, count in stats.get("tenant_connections", {}).items():  # type: ignore[attr-defined]
        assert value(samples, "kvstore_tenant_connections", tenant=tenant) >= 0 and count >= 0
    checked |= {"connections", "tenant_connections"}
    assert set(stats) <= checked, f"figures of kvstore stats with no metric: {set(stats) - checked}"


def test_the_remote_tiers_health_is_exported(fleet: Fleet) -> None:
    settled_stats(fleet.sidecar.unix)
    samples = scrape(fleet.url)
    assert value(samples, "kvstore_remote_nodes") == 2
    assert value(samples, "kvstore_remote_nodes_down") == 1  # the dead one, in backoff
    assert value(samples, "kvstore_remote_failures_total") >= 1
    assert value(samples, "kvstore_remote_stored_blocks_total") > 0  # the live node's share
    assert value(samples, "kvstore_remote_dropped_blocks_total") >= 0
    # a store without a remote tier still has the series, at zero: rules and panels find them
    node = scrape(fleet.node_url)
    assert value(node, "kvstore_remote_nodes") == value(node, "kvstore_remote_failures_total") == 0


def test_process_and_build_series(fleet: Fleet) -> None:
    samples = scrape(fleet.url)
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"):
        assert value(samples, name) > 0, name
    assert value(samples, "process_max_fds") >= value(samples, "process_open_fds")
    assert any(n == "kvstore_build_info" for n, _ in samples)


def test_only_metrics_serves_metrics_and_the_probes_answer(fleet: Fleet) -> None:
    status, text = get(f"{fleet.url}/metrics")
    assert status == 200 and "kvstore_build_info" in text
    assert get(f"{fleet.url}/healthz") == (200, "ok\n")
    assert get(f"{fleet.url}/readyz") == (200, "ready\n")
    # as Prometheus asks: OpenMetrics, gzipped
    asked = urllib.request.Request(
        f"{fleet.url}/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"},
    )
    with urllib.request.urlopen(asked, timeout=10) as r:
        assert r.headers["Content-Encoding"] == "gzip"
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        assert gzip.decompress(r.read()).decode().rstrip().endswith("# EOF")
    for path in ("/", "/metricsx", "/metrics/x", "/health", "/favicon.ico"):
        status, text = get(f"{fleet.url}{path}")
        assert status == 404 and "kvstore_" not in text, path


def test_two_servers_on_one_host_start_with_the_default_metrics_address(fleet: Fleet) -> None:
    node, sidecar = int(fleet.node_url.rpartition(":")[2]), int(fleet.url.rpartition(":")[2])
    assert node != sidecar
    default = int(DEFAULT_ADDRESS.rpartition(":")[2])
    with open(fleet.sidecar.data_dir / "serve.log") as f:
        log = f.read()
    if default in (node, sidecar):  # the other fell back, and said where
        assert f"metrics port {DEFAULT_ADDRESS} is in use" in log
    assert f"metrics http://127.0.0.1:{sidecar}/metrics" in log  # what serve prints
    # a port named explicitly is bound as named, or the start fails in one line
    folder = tempfile.mkdtemp(prefix="kvmetrics-", dir="/tmp")
    settings = [
        "dram.capacity_bytes=4MiB",
        "dram.page_bytes=1MiB",
        f"server.metrics_address=127.0.0.1:{node}",
    ]
    try:
        taken = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvstore",
                "serve",
                "--data-dir",
                folder,
                *(f"--set={s}" for s in settings),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert taken.returncode != 0 and "Traceback" not in taken.stderr, taken.stderr
    last = taken.stderr.strip().splitlines()[-1]
    assert f"127.0.0.1:{node}" in last and "server.metrics_address" in last, last


def test_readyz_says_starting_until_the_store_is_open() -> None:
    metrics = Metrics()  # the port is served before the store opens (kvstore.server.serve)
    port = metrics.serve("127.0.0.1:0")
    try:
        assert get(f"http://127.0.0.1:{port}/readyz") == (503, "starting\n")
        assert get(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")
        metrics.state = "ready"
        assert get(f"http://127.0.0.1:{port}/readyz") == (200, "ready\n")
    finally:
        metrics.close()


def test_readyz_is_503_while_the_server_drains() -> None:
    settings = {**process_settings(**{"server.drain_grace_s": "20"}), "server.metrics_address": "127.0.0.1:0"}
    server = ServerProcess(settings)
    release = threading.Event()
    try:
        url = metrics_url(server.unix)
        assert get(f"{url}/readyz") == (200, "ready\n")

        def frames() -> Iterator[pb.BlockFrame]:
            release.wait(60)  # a Put stream left open: the drain waits for it
            yield from ()

        with grpc.insecure_channel(server.unix) as channel:
            put = pb_grpc.KvStoreStub(channel).Put.future(frames())
            time.sleep(0.5)  # the stream reaches the server
            os.kill(server.pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while get(f"{url}/readyz")[0] == 200:
                assert time.monotonic() < deadline, "/readyz stayed 200 through the drain"
                time.sleep(0.05)
            assert get(f"{url}/readyz") == (503, "draining\n")
            assert get(f"{url}/healthz") == (200, "ok\n")  # alive: no liveness restart mid-drain
            release.set()
            put.exception(timeout=30)
    finally:
        release.set()
        assert server.stop() == 0


def dashboard_queries() -> list[str]:
    """Each panel's PromQL, Grafana's variables given the values a test can run with."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]
    return [e.replace("$__rate_interval", "1m").replace("$instance", ".*") for e in exprs]


def rule_queries() -> list[str]:
    import yaml  # pyyaml, of the dev extra

    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["expr"] for g in groups for r in g["rules"]]


# Taken out of a query in turn: strings, label matchers, ranges and groupings; then function
# names, keywords and numbers (a function name is followed by "(" only once its grouping is out)
_NOT_SERIES = (
    re.compile(
        r'"[^"]*"|\{[^}]*\}|\[[^]]*\]|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)'
    ),
    re.compile(r"\b[a-z_]+\s*\(|\b(?:and|or|unless|bool|offset)\b|\b\d+(?:\.\d+)?"),
)


def series_in(query: str) -> set[str]:
    """The series names a PromQL query reads."""
    for pattern in _NOT_SERIES:
        query = pattern.sub(" ", query)
    return set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", query))


def test_every_series_the_dashboard_and_the_rules_query_is_on_metrics(fleet: Fleet) -> None:
    dashboard, rules = dashboard_queries(), rule_queries()
    assert len(dashboard) >= 20 and len(rules) >= 10
    assert series_in('sum by (le) (rate(kvstore_x_bucket{a="b"}[5m])) > 0.5 and on (job) up') == {
        "kvstore_x_bucket",
        "up",
    }
    queried = {name for q in dashboard + rules for name in series_in(q)}
    keys = chain(1, salt="metrics")
    with connect(fleet.sidecar.unix) as kv:  # a data connection open: a tenant's connections
        assert kv.read_into(kv.register(MODEL), keys, [memoryview(bytearray(len(blocks_for(keys)[0])))]) == 1
        on_metrics = {name for name, _ in scrape(fleet.url)}
    # `up` is Prometheus' own, of every target
    assert queried - on_metrics == {"up"}, "queried, but not on a real server's /metrics"


def promtool() -> str:
    found = shutil.which("promtool") or shutil.which("promtool", path=str(Path(sys.executable).parent))
    if found is None:
        if os.environ.get("REQUIRE_TEST_TOOLS"):
            pytest.fail("promtool is missing; scripts/test.sh installs it (Debian's prometheus package)")
        pytest.skip("promtool is not installed (apt-get install prometheus); CI runs this check")
    return found


def test_the_alert_rules_pass_promtool() -> None:
    result = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rule_queries())} rules found" in result.stdout
    # and its unit tests: alerts fire on series that mean trouble, stay quiet on healthy ones
    tests = RULES.with_name("kvstore-rules.test.yml")
    result = subprocess.run(
        [promtool(), "test", "rules", str(tests)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_the_dashboards_queries_parse(tmp_path: Path) -> None:
    """promtool parses each panel's query as a recording rule's: a typo fails here, not in Grafana."""
    records = [{"record": f"kvstore:panel_{i}", "expr": q} for i, q in enumerate(dashboard_queries())]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": records}]}))  # JSON is YAML
    result = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
