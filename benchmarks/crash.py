"""``kvstore bench crash``: what a ``kill -9`` under load costs, with the default settings.

A writer stores chains of blocks into a ``kvstore serve`` child process the way the vLLM
connector does on the same host (reserve, write the arena in place, commit) and records every
block whose commit returned: acknowledged. After a random time under load the server is killed
with SIGKILL and started again on the same data folder; every block acknowledged so far is then
read back one by one and compared byte for byte (its bytes are a function of its key). Repeated
``cycles`` times. Figures: acknowledged blocks served after the restarts (target >= 99%) and
corrupt blocks served (target 0).

The price is measured in the same run: the writer's put throughput with the default settings
(write-behind to nvme on) against the same writer with ``store.write_behind=false`` (today's
behaviour before write-behind: a crash lost everything in dram), no kills, same blocks.
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
from benchmarks.service import bench_server
from kvstore.client import Client, connect
from kvstore.errors import KvStoreError
from kvstore.keys import BlockKey, ModelIdentity, block_keys
from kvstore.server.config import DramSettings

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


@dataclass
class Cycles:
    acked: int = 0
    served: int = 0
    corrupt: int = 0
    served_at_end: int = 0
    per_cycle: list[dict[str, float]] = field(default_factory=list)


def kill_cycles(
    cycles: int,
    arena_bytes: int,
    max_load_s: float,
    rng: random.Random,
    progress: Progress | None = None,
    max_blocks: int = 1 << 30,
    settings: Mapping[str, str] | None = None,
    pace_bytes_per_s: float = 0.0,
) -> Cycles:
    """``cycles`` rounds of load (at most ``max_blocks`` per round), SIGKILL, restart and
    read-back on one data folder."""
    server = bench_server(arena_bytes, settings)
    out = Cycles()
    acked: list[BlockKey] = []
    task = (
        progress.add_task(f"kill -9 cycles, {arena_bytes >> 20} MiB arena", total=cycles)
        if progress
        else None
    )
    try:
        for cycle in range(cycles):
            load = Load(server.unix, salt=f"cycle-{cycle}-{rng.random()}", pace_bytes_per_s=pace_bytes_per_s)
            writer = threading.Thread(target=load.run, args=(max_blocks,))
            writer.start()
            time.sleep(rng.uniform(0.3, max_load_s))
            server.kill()
            load.stop()
            writer.join(30)
            acked.extend(load.acked)
            server.start()
            got, bad = verify(server.unix, load.acked)
            out.served += got
            out.corrupt += bad
            out.per_cycle.append(
                {"acknowledged": len(load.acked), "served": got, "corrupt": bad, "load_s": load.seconds}
            )
            if progress is not None and task is not None:
                progress.advance(task)
        # Blocks of earlier cycles must survive the later kills too.
        out.served_at_end, bad = verify(server.unix, acked)
        out.corrupt += bad
        out.acked = len(acked)
    finally:
        server.stop()
    return out


def run_crash_bench(cycles: int, quick: bool, json_path: str | None, seed: int = 0) -> int:
    console = Console(stderr=True)
    rng = random.Random(seed)
    default_arena = DramSettings().capacity_bytes
    with Progress(console=console, transient=True) as progress:
        # Paced so that the kill lands while blocks are still being written, and capped so that
        # every cycle's blocks fit the 4 GiB nvme tier the salvage copies them into.
        fits = kill_cycles(
            cycles,
            default_arena,
            1.8,
            rng,
            progress,
            max_blocks=CYCLE_BLOCKS,
            pace_bytes_per_s=PACE_BYTES_PER_S,
        )
        overflow = kill_cycles(
            max(3, cycles // 4), OVERFLOW_ARENA_BYTES, 2.0, rng, progress, max_blocks=4 * CYCLE_BLOCKS
        )
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
    note = "256 KiB blocks, same-host reserve/commit at 100 MB/s, killed while writing"
    results = [
        Result(
            "acknowledged blocks served after kill -9 + restart (default settings)",
            fits.served,
            "blocks",
            "acknowledged",
            fits.acked,
            ">= 0.99",
            f"{cycles} cycles, {default_arena >> 20} MiB arena (the default), {note}",
        ),
        Result(
            "... still served after all cycles",
            fits.served_at_end,
            "blocks",
            "acknowledged",
            fits.acked,
            ">= 0.99",
            "every block of every cycle read back at the end",
        ),
        Result(
            "acknowledged blocks served, load overflowing the arena into nvme",
            overflow.served,
            "blocks",
            "acknowledged",
            overflow.acked,
            note=f"{len(overflow.per_cycle)} cycles, {OVERFLOW_ARENA_BYTES >> 20} MiB arena, writer unpaced: "
            "blocks being demoted to nvme when the kill comes (nvme's write queue) are lost",
        ),
        Result("corrupt blocks served", fits.corrupt + overflow.corrupt, "blocks", note="target 0"),
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
        write_json(json_path, results, {"cycles": fits.per_cycle, "overflow_cycles": overflow.per_cycle})
    ok = fits.acked > 0 and fits.served >= 0.99 * fits.acked and fits.corrupt + overflow.corrupt == 0
    return 0 if ok else 1
