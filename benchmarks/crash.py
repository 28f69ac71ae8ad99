"""``kvstore bench crash``: what a ``kill -9`` under load costs, in a cache's everyday states.

Writers store chains of blocks into a ``kvstore serve`` child process the way the vLLM connector
does on the same host (reserve, write the arena in place, commit) and record every block whose
commit returned: acknowledged. After a random time under load the server is killed with SIGKILL
and started again on the same data folder; every block acknowledged in that cycle is then read
back one by one and compared byte for byte (its bytes are a function of its key). Repeated for
each ``State``: from an empty store (the default arena, nvme with room for everything), with nvme
full at the kill (filled first: the salvage must make room by eviction, as a clean stop's spill
does), and with the arena overflowing into nvme (three unpaced writers into a 64 MiB arena: the
kill comes among demotions). Figures per state: acknowledged blocks served after the restarts
(target >= 99%) and corrupt blocks served (target 0).

The price is measured in the same run: the writer's put throughput with the default settings
against the same writer with ``dram.journal=false`` (no crash recovery) and with
``store.write_behind=true``, no kills, same blocks.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import Progress

from benchmarks.common import Result, print_results, write_json
from benchmarks.server_process import ServerProcess
from benchmarks.service_setup import bench_server
from kvstore.client import Client, connect
from kvstore.errors import KvStoreError
from kvstore.keys import BlockKey, ModelIdentity, block_keys
from tiers.dram import DramConfig

MiB = 1 << 20
MODEL = ModelIdentity(
    "bench/crash", "cc" * 32, num_layers=4, num_kv_heads=4, head_dim=64, tokens_per_block=64
)  # 256 KiB blocks
CHAIN_BLOCKS = 8
ARENA_BYTES = 256 * MiB  # the throughput runs
OVERFLOW_ARENA_BYTES = 64 * MiB
CYCLE_BLOCKS = 600  # 150 MiB a cycle: 20 cycles fit the server's 4 GiB nvme tier
PACE_BYTES_PER_S = 100e6  # the writer's rate in the kill cycles: 600 blocks take ~1.6 s


def block_bytes(key: BlockKey) -> bytes:
    """A block's bytes, a function of its key: any torn or foreign byte shows."""
    return (key * (MODEL.block_bytes // len(key) + 1))[: MODEL.block_bytes]


@dataclass
class Load:
    """Writes chains until stopped; ``acked`` holds the keys whose commit returned."""

    address: str
    salt: str
    pace_bytes_per_s: float = 0.0  # 0: as fast as it can
    acked: list[BlockKey] = field(default_factory=list)
    written_bytes: int = 0
    seconds: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self, max_blocks: int = 1 << 30) -> None:
        started = time.perf_counter()
        try:
            with connect(self.address, timeout_s=5) as kv:
                fp = kv.register(MODEL)
                chain = 0
                while not self._stop.is_set() and len(self.acked) < max_blocks:
                    tokens = list(range(CHAIN_BLOCKS * MODEL.tokens_per_block))
                    keys = block_keys(fp, tokens, MODEL.tokens_per_block, cache_salt=f"{self.salt}-{chain}")
                    self._write(kv, fp, keys)
                    chain += 1
                    if self.pace_bytes_per_s:
                        due = started + self.written_bytes / self.pace_bytes_per_s
                        time.sleep(max(0.0, due - time.perf_counter()))
        except (KvStoreError, OSError):
            pass  # the server was killed under us: what was acknowledged is in acked
        self.seconds = time.perf_counter() - started

    def _write(self, kv: Client, fp: bytes, keys: Sequence[BlockKey]) -> None:
        pending = kv.reserve(fp, keys, [MODEL.block_bytes] * len(keys))
        for view, key in zip(pending.views, keys, strict=True):
            if view is not None:
                view[:] = block_bytes(key)
        kv.commit(pending.reservation_id)
        # Acknowledged: the blocks the reservation took (None: present already, or no room).
        self.acked.extend(k for k, v in zip(keys, pending.views, strict=True) if v is not None)
        self.written_bytes += MODEL.block_bytes * sum(v is not None for v in pending.views)

    def stop(self) -> None:
        self._stop.set()


def verify(address: str, keys: Sequence[BlockKey]) -> tuple[int, int]:
    """(served, corrupt) among ``keys``, each read back alone."""
    served = corrupt = 0
    out = memoryview(bytearray(MODEL.block_bytes))
    with connect(address, timeout_s=30) as kv:
        fp = kv.register(MODEL)
        for key in keys:
            if kv.read_into(fp, [key], [out]) == 1:
                served += 1
                corrupt += bytes(out) != block_bytes(key)
    return served, corrupt


def put_throughput(settings: Mapping[str, str], blocks: int) -> float:
    """Bytes per second of the writer into a fresh server, no kills."""
    server = bench_server(ARENA_BYTES, settings)
    try:
        load = Load(server.unix, salt=f"tput-{settings}")
        load.run(max_blocks=blocks)
        return load.written_bytes / load.seconds
    finally:
        server.stop()


@dataclass(frozen=True)
class State:
    """The state of the store the kills come in; a writer's blocks a cycle are its
    ``blocks_per_writer`` at most (its chains of CHAIN_BLOCKS, so a few more)."""

    name: str
    arena_bytes: int
    writers: int = 1
    blocks_per_writer: int = CYCLE_BLOCKS
    pace_bytes_per_s: float = 0.0  # each writer's; 0: as fast as it can
    max_load_s: float = 1.8  # a kill comes 0.3 s to this long into a cycle's load
    nvme_bytes: int = 4 << 30
    fill_nvme: bool = False  # fill nvme (a clean stop's spill) before the first kill

    @property
    def keeps_every_cycle(self) -> bool:
        """Whether nvme holds every cycle's blocks (else, full, each salvage evicts older ones)."""
        return not self.fill_nvme


@dataclass
class Cycles:
    acked: int = 0
    served: int = 0
    corrupt: int = 0
    served_at_end: int = 0
    nvme_full_at_kills: int = 0  # kills that came with nvme at least 99% full
    per_cycle: list[dict[str, float]] = field(default_factory=list)


def kill_cycles(
    state: State,
    cycles: int,
    rng: random.Random,
    progress: Progress | None = None,
    settings: Mapping[str, str] | None = None,
) -> Cycles:
    """``cycles`` rounds of load, SIGKILL, restart and read-back on one data folder, in
    ``state``; then every cycle's blocks read back once more (where nvme keeps them all)."""
    server = bench_server(
        state.arena_bytes, {"nvme.capacity_bytes": str(state.nvme_bytes), **(settings or {})}
    )
    out = Cycles()
    acked: list[BlockKey] = []
    task = progress.add_task(f"kill -9 cycles, {state.name}", total=cycles) if progress else None
    try:
        if state.fill_nvme:
            fill(server, state)
        for cycle in range(cycles):
            loads = [
                Load(
                    server.unix,
                    salt=f"cycle-{cycle}-{w}-{rng.random()}",
                    pace_bytes_per_s=state.pace_bytes_per_s,
                )
                for w in range(state.writers)
            ]
            writers = [threading.Thread(target=load.run, args=(state.blocks_per_writer,)) for load in loads]
            for writer in writers:
                writer.start()
            time.sleep(rng.uniform(0.3, state.max_load_s))
            nvme_used = _nvme_used(server.unix) if state.fill_nvme else 0.0
            server.kill()
            for load in loads:
                load.stop()
            for writer in writers:
                writer.join(30)
            cycle_acked = [key for load in loads for key in load.acked]
            acked.extend(cycle_acked)
            server.start()
            got, bad = verify(server.unix, cycle_acked)
            out.acked += len(cycle_acked)
            out.served += got
            out.corrupt += bad
            out.nvme_full_at_kills += nvme_used >= 0.99
            out.per_cycle.append(
                {
                    "acknowledged": len(cycle_acked),
                    "served": got,
                    "corrupt": bad,
                    "load_s": max(load.seconds for load in loads),
                    "nvme_used_at_kill": nvme_used,
                }
            )
            if progress is not None and task is not None:
                progress.advance(task)
        if state.keeps_every_cycle:  # blocks of earlier cycles must survive the later kills too
            out.served_at_end, bad = verify(server.unix, acked)
            out.corrupt += bad
    finally:
        server.stop()
    return out


def fill(server: ServerProcess, state: State) -> None:
    """Fill nvme the way a cache fills it: more blocks written than it holds (the arena's
    overflow demoted into it), then a clean stop (the arena's blocks spilled into it)."""
    load = Load(server.unix, salt=f"fill-{random.random()}")
    load.run(max_blocks=(state.nvme_bytes + state.arena_bytes // 2) // MODEL.block_bytes)
    server.restart()


def _nvme_used(address: str) -> float:
    """The share of nvme's capacity in use now."""
    with connect(address, timeout_s=5) as kv:
        tiers = kv.stats()["tiers"]
    nvme = next(t for t in tiers if t["name"] == "nvme")
    return float(nvme["used_bytes"]) / float(nvme["capacity_bytes"])


EMPTY = State(
    "from an empty store",
    DramConfig().capacity_bytes,
    blocks_per_writer=CYCLE_BLOCKS,
    pace_bytes_per_s=PACE_BYTES_PER_S,
)
NVME_FULL = State(
    "nvme full at the kill",
    256 * MiB,
    # 100 MiB: in the arena at the kill, with the last cycle's read back (promoted) and no
    # eviction from it before the kill: what is measured is the salvage into a full nvme, not
    # which blocks eviction keeps
    blocks_per_writer=400,
    pace_bytes_per_s=PACE_BYTES_PER_S,
    nvme_bytes=256 * MiB,
    fill_nvme=True,
)
OVERFLOW = State(
    "arena overflowing into nvme",
    OVERFLOW_ARENA_BYTES,
    writers=3,
    blocks_per_writer=4 * CYCLE_BLOCKS // 3,
    max_load_s=2.0,
)


def run_crash_bench(cycles: int, quick: bool, json_path: str | None, seed: int = 0) -> int:
    console = Console(stderr=True)
    rng = random.Random(seed)
    states = (EMPTY, NVME_FULL, OVERFLOW)
    runs = {EMPTY: cycles, NVME_FULL: max(3, cycles // 2), OVERFLOW: max(3, cycles // 4)}
    with Progress(console=console, transient=True) as progress:
        found = {state: kill_cycles(state, runs[state], rng, progress) for state in states}
    blocks = 400 if quick else 2000
    rounds = 3 if quick else 5
    variants: dict[str, dict[str, str]] = {
        "default": {},
        "no journal": {"dram.journal": "false"},
        "write-behind": {"store.write_behind": "true"},
    }
    speeds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):  # interleaved: the machine's noise falls on all three alike
        for name, settings in variants.items():
            speeds[name].append(put_throughput(settings, blocks))
    default_speed = statistics.median(speeds["default"])
    results = []
    for state in states:
        c = found[state]
        how = (
            f"{runs[state]} cycles, {state.arena_bytes >> 20} MiB arena, {state.nvme_bytes >> 20} MiB nvme, {state.writers} writer(s) "
            + (f"at {state.pace_bytes_per_s / 1e6:.0f} MB/s each" if state.pace_bytes_per_s else "unpaced")
        )
        if state.fill_nvme:
            how += f"; nvme filled first, >= 99% full at {c.nvme_full_at_kills} of {runs[state]} kills"
        results.append(
            Result(
                f"acknowledged blocks served after kill -9 + restart, {state.name}",
                c.served,
                "blocks",
                "acknowledged",
                c.acked,
                ">= 0.99",
                how,
            )
        )
        if state.keeps_every_cycle:
            results.append(
                Result(
                    f"... {state.name}: still served after all cycles",
                    c.served_at_end,
                    "blocks",
                    "acknowledged",
                    c.acked,
                    ">= 0.99",
                    "every block of every cycle read back at the end",
                )
            )
        results.append(Result(f"corrupt blocks served, {state.name}", c.corrupt, "blocks", note="target 0"))
    results += [
        Result(
            "same-host put, default (arena journal on)",
            default_speed / 1e9,
            "GB/s",
            "dram.journal=false (no crash recovery)",
            statistics.median(speeds["no journal"]) / 1e9,
            ">= 0.9",
            f"{blocks} blocks into a fresh server, median of {rounds} interleaved rounds",
        ),
        Result(
            "same-host put with store.write_behind=true",
            statistics.median(speeds["write-behind"]) / 1e9,
            "GB/s",
            "default",
            default_speed / 1e9,
            note="also copies every block to nvme at once (survives a reboot, not only a crash)",
        ),
    ]
    print_results("kvstore bench crash", results)
    if json_path:
        write_json(json_path, results, {state.name: found[state].per_cycle for state in states})
    ok = all(
        c.acked > 0
        and c.served >= 0.99 * c.acked
        and c.corrupt == 0
        and (not state.keeps_every_cycle or c.served_at_end >= 0.99 * c.acked)
        for state, c in found.items()
    )
    return 0 if ok else 1
