"""``kvstore bench replay``'s set-up: the specs and configurations, the traces, the engines and the
other connectors vLLM ships."""

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.calibrate import BLOCK_SIZE
from benchmarks.common import Result
from benchmarks.replay_traces import WORKLOADS, TraceRequest, generate, read_trace
from benchmarks.server_process import ServerProcess
from benchmarks.vllm_engine import Engine
from kvstore.errors import InvalidArgument

RESTORE_TARGET = 1.1
HIT_SHARE = 0.5  # a request is a hit when at least this share of its prompt was cached
# The other KV connectors vLLM ships that offload KV (the disaggregation ones, NIXL and MoRIIO,
# move KV between engines instead), each with the extra config it needs to get past its own checks.
PEERS: dict[str, dict[str, object]] = {
    "LMCacheConnectorV1": {},
    "SimpleCPUOffloadConnector": {},
    "OffloadingConnector": {"cpu_bytes_to_use": 256 << 20},
    "MooncakeStoreConnector": {},  # reads MOONCAKE_CONFIG_PATH: a running Mooncake master's config
    "FlexKVConnectorV1": {},
}
PEER_START_S = 90
CONFIGS = ("vllm", "kvstore-dram", "kvstore-nvme", "example")
# kvstore against each peer, per workload: (figure, key, scale, unit, target)
COMPARED = (
    ("token hit rate", "token_hit_rate", 100.0, "%", "> 1"),
    ("p95 TTFT", "ttft_all_p95_s", 1e3, "ms", "< 1"),
)
NVME_CONFIG_ARENA = 32 << 20  # one arena page, the least there is: most restores read from nvme


@dataclass(frozen=True)
class ReplaySpec:
    model_size: str
    workloads: tuple[str, ...]
    sessions: int
    pool_tokens: int  # vLLM's KV pool, in tokens (at least the 4096-token context)
    prefix_tokens: int  # the restore-vs-vLLM-hit prompt
    rounds: int
    peers: bool
    layerwise: bool = False  # restore-vs-hit also on an engine that loads layer-wise


QUICK = ReplaySpec(
    "small",
    ("agent", "chats"),
    sessions=6,
    pool_tokens=5120,
    prefix_tokens=3008,
    rounds=9,
    peers=False,
    layerwise=True,
)
FULL = ReplaySpec(
    "small",
    tuple(WORKLOADS),
    sessions=16,
    pool_tokens=5120,
    prefix_tokens=3008,
    rounds=9,
    peers=True,
    layerwise=True,
)


@dataclass(frozen=True)
class Config:
    name: str
    label: str
    connector: str | None
    arena_bytes: int = 0  # the kvstore sidecar's dram arena; 0: no sidecar


@dataclass
class Served:
    """What one configuration did on one workload, request by request."""

    prompt: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    held_bytes: int = 0
    restored_bytes: dict[str, int] = field(default_factory=dict)  # the connector's, by tier


def vocab_of(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def fresh_tokens(length: int, seed: int, vocab: int) -> list[int]:
    """A prompt no trace shares."""
    return [(i * 7919 + seed * 104_729) % (vocab - 3) + 3 for i in range(length)]


def make_traces(
    spec: ReplaySpec,
    vocab: int,
    trace: str | None,
    tokenizer: Path,
    workloads: Sequence[str] | None,
    tokens_per_id: int = BLOCK_SIZE,
    limit: int | None = None,
) -> dict[str, list[TraceRequest]]:
    if trace:
        return {Path(trace).stem: read_trace(Path(trace), vocab, tokenizer, tokens_per_id)[:limit]}
    names = tuple(workloads or spec.workloads)
    for name in names:
        if name not in WORKLOADS:
            raise InvalidArgument(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return {name: generate(name, spec.sessions, vocab, seed=11) for name in names}


def make_engine(
    config: Config,
    model_dir: Path,
    servers: dict[str, ServerProcess],
    pool_bytes: int,
    folder: Path,
    calibration: Path,
) -> Engine:
    if config.connector == "kvstore":
        return Engine(
            model_dir,
            servers[config.name].unix,
            calibration=str(calibration),
            prefix_caching=True,
            kv_cache_bytes=pool_bytes,
        )
    extra = {"shared_storage_path": str(folder / "example")} if config.connector == "ExampleConnector" else {}
    return Engine(
        model_dir,
        connector=config.connector,
        connector_config=extra,
        prefix_caching=True,
        kv_cache_bytes=pool_bytes,
    )


def try_peers(model_dir: Path, pool_bytes: int, console: Console) -> list[Result]:
    """Start each other connector once; each that fails is reported with the error it gave."""
    rows = []
    for name, extra in PEERS.items():
        console.print(f"[dim]peer {name} …[/]")
        try:
            engine = Engine(
                model_dir,
                connector=name,
                connector_config=extra,
                prefix_caching=True,
                kv_cache_bytes=pool_bytes,
                start_s=PEER_START_S,
            )
        except (RuntimeError, TimeoutError) as e:
            rows.append(
                Result(f"peer {name}", None, "", note=f"does not start here: {failure_reason(str(e))}")
            )
            continue
        engine.close()
        rows.append(Result(f"peer {name}", None, "", note="starts here, but is not in the replay yet"))
    return rows


def print_peers(console: Console, rows: list[Result]) -> None:
    table = Table(title="the other vLLM KV connectors on this machine")
    table.add_column("connector")
    table.add_column("result")
    for row in rows:
        table.add_row(row.metric.removeprefix("peer "), row.note)
    Console(width=100).print(table)


_ERROR = re.compile(r"(?:^|\s)([A-Za-z_.]*(?:Error|Exception)):\s*(.+)$")


def failure_reason(log: str) -> str:
    """The last ``SomethingError: message`` line of an engine's log."""
    for line in reversed(log.splitlines()):
        found = _ERROR.search(line.replace("[rank0]:", ""))
        if found and "the engine exited" not in line:
            return f"{found.group(1)}: {found.group(2).strip()}"[:160]
    return log.strip().splitlines()[-1][:160] if log.strip() else "no output"
