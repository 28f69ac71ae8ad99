"""What following the sidecars' KV event feeds saves ``kvstore route`` over asking them:

    python -m benchmarks.kv_events [--sidecars 4] [--prompts 2000] [--out bench-results/kv-events.txt]

A fixed replay (seeded): prompts drawn from 40 shared heads of 8 blocks with 2 to 6 blocks of
their own, each routed to the replica whose sidecar holds most of its leading blocks (ties by
rendezvous on the head), whose "engine" then stores the prompt's blocks there (``put`` into that
``kvstore serve``, as the connector's save would). Twice over the same replay on fresh servers:
the router asking every sidecar (``SidecarProbe``, a lookup per sidecar per prompt), then
following their feeds (``FollowedProbe``, ``--sidecar-events``). Reported: lookups the router
sent (counted by the sidecars), their rate over the replay, the router's time to learn a
prompt's hits, and how often the followed hits equal what a lookup answers at the same moment
(measured after the replay's last store settled; lag makes the two differ during it).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.server_process import ServerProcess
from kvstore.client import connect
from kvstore.keys import Fingerprint, ModelIdentity, block_keys
from kvstore.routing.router import SidecarProbe

MODEL = ModelIdentity(
    "bench/events", "bb" * 32, num_layers=2, num_kv_heads=2, head_dim=32, tokens_per_block=16
)
BLOCK = MODEL.block_bytes
HEADS, HEAD_BLOCKS = 40, 8


def replay(prompts: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(32_000) for _ in range(HEAD_BLOCKS * 16)] for _ in range(HEADS)]
    out = []
    for _ in range(prompts):
        own = [rng.randrange(32_000) for _ in range(16 * rng.randint(2, 6))]
        out.append(heads[rng.randrange(HEADS)] + own)
    return out


def _choose(hits: Sequence[tuple[str, ...]], head: bytes) -> int:
    return max(range(len(hits)), key=lambda i: (len(hits[i]), hash((head, i))))


def _lookups(servers: Sequence[ServerProcess]) -> int:
    total = 0
    for server in servers:
        with connect(server.unix) as kv:
            counters = kv.stats()["counters"]
            total += counters["lookup_hit_blocks"] + counters["lookup_miss_blocks"]
    return total


def run(mode: str, sidecars: int, prompts: list[list[int]], folder: Path) -> dict[str, float]:
    settings = {"dram.capacity_bytes": "64MiB", "dram.prefault": "false", "nvme.capacity_bytes": "256MiB"}
    servers, feeds = [], []
    for i in range(sidecars):
        feed = f"ipc://{folder}/{mode}-{i}"
        servers.append(ServerProcess({**settings, "events.publish_address": feed}))
        feeds.append(feed)
    clients = [connect(s.unix) for s in servers]
    fp = Fingerprint(clients[0].register(MODEL))
    for kv in clients[1:]:
        kv.register(MODEL)
    probe: SidecarProbe
    if mode == "follow":
        from kvstore.routing.events import FollowedProbe

        probe = FollowedProbe([s.unix for s in servers], feeds)
        time.sleep(1.0)  # subscriptions reach the publishers (ZMQ's slow joiner)
    else:
        probe = SidecarProbe([s.unix for s in servers], timeout_s=1.0)
    asking = SidecarProbe([s.unix for s in servers], timeout_s=1.0)  # the agreement check only
    try:
        before = _lookups(servers)
        probe_s: list[float] = []
        start = time.perf_counter()
        for tokens in prompts:
            keys = [bytes(k) for k in block_keys(fp, tokens, 16)]
            t = time.perf_counter()
            hits = probe.hits(fp, keys)
            probe_s.append(time.perf_counter() - t)
            chosen = _choose(hits, keys[HEAD_BLOCKS - 1])
            held = len(hits[chosen])
            if held < len(keys):
                clients[chosen].put(
                    fp,
                    keys[held:],
                    [bytes(BLOCK)] * (len(keys) - held),
                    parent=keys[held - 1] if held else None,
                )
        wall_s = time.perf_counter() - start
        sent = _lookups(servers) - before
        time.sleep(1.0)  # the last events arrive
        sample = prompts[:: max(1, len(prompts) // 200)]
        agree = 0
        for tokens in sample:
            keys = [bytes(k) for k in block_keys(fp, tokens, 16)]
            agree += probe.hits(fp, keys) == asking.hits(fp, keys)
        return {
            "prompts": len(prompts),
            "wall_s": wall_s,
            "lookups_sent": sent,  # blocks looked up (the sidecars' counters): a lookup per sidecar per prompt
            "lookup_calls": len(prompts) * sidecars if mode == "poll" else 0,
            "probe_p50_ms": statistics.median(probe_s) * 1e3,
            "probe_p99_ms": sorted(probe_s)[int(len(probe_s) * 0.99)] * 1e3,
            "agreement": agree / len(sample),
            "events": getattr(probe, "events", 0),
            "gaps": sum(i.gaps for i in getattr(probe, "indexes", [])),
        }
    finally:
        probe.close()
        asking.close()
        for kv in clients:
            kv.close()
        for server in servers:
            server.stop()


def store_cost(rounds: int = 5, blocks: int = 4000) -> list[str]:
    """What publishing adds to the store path as an engine sees it: a same-host client's ``put``
    (arena write and commit over the data socket) of chains of 8 blocks of 8 KiB into a
    ``kvstore serve`` whose arena evicts, with events off, on (no subscriber: the publisher
    still builds and sends every batch) and on with a subscriber reading. Rounds alternate;
    the median and best time per block (this machine's noise: see each round's)."""
    import zmq

    variants = ("off", "on", "on + subscriber")
    times: dict[str, list[float]] = {name: [] for name in variants}
    settings = {"dram.capacity_bytes": str(2048 * BLOCK), "dram.page_bytes": "1MiB", "dram.prefault": "false"}
    settings["nvme.enabled"] = "false"
    with tempfile.TemporaryDirectory(prefix="kvs-ev-", dir="/tmp") as folder:
        for r in range(rounds):
            for name in variants:
                feed = f"ipc://{folder}/cost-{r}"
                extra = {} if name == "off" else {"events.publish_address": feed}
                server = ServerProcess({**settings, **extra})
                ctx = zmq.Context()
                sub = ctx.socket(zmq.SUB)
                if name == "on + subscriber":
                    sub.setsockopt(zmq.SUBSCRIBE, b"")
                    sub.setsockopt(zmq.RCVHWM, 0)
                    sub.connect(feed)
                try:
                    with connect(server.unix) as kv:
                        fp = kv.register(MODEL)
                        chains = [
                            block_keys(fp, list(range(i * 128, (i + 1) * 128)), 16)
                            for i in range(blocks // 8)
                        ]
                        data = [bytes(BLOCK)] * 8
                        start = time.perf_counter()
                        for keys in chains:
                            kv.put(fp, keys, data)
                        times[name].append(time.perf_counter() - start)
                finally:
                    sub.close(linger=0)
                    ctx.term()
                    server.stop()
    base = statistics.median(times["off"])
    return [
        f"store path: a same-host client's put of {blocks} blocks (chains of 8, {BLOCK} B) into kvstore serve "
        f"(arena of 2,048 blocks, evicting), {rounds} rounds alternating:",
        *(
            f"  events {name:<16} median {statistics.median(t) * 1e6 / blocks:6.1f} us/block "
            f"({statistics.median(t) / base - 1:+.1%} against off), best {min(t) * 1e6 / blocks:6.1f}; rounds "
            + ", ".join(f"{x * 1e6 / blocks:.0f}" for x in t)
            + ")"
            for name, t in times.items()
        ),
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sidecars", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--store-cost", action="store_true", help="also time the store path with events off and on"
    )
    args = parser.parse_args(argv)
    prompts = replay(args.prompts)
    with tempfile.TemporaryDirectory(prefix="kvs-ev-", dir="/tmp") as folder:
        results = {mode: run(mode, args.sidecars, prompts, Path(folder)) for mode in ("poll", "follow")}
    lines = [
        f"kvstore route: asking {args.sidecars} sidecars per prompt vs following their KV event feeds",
        f"replay: {args.prompts} prompts, {HEADS} shared heads of {HEAD_BLOCKS} blocks + 2-6 own, "
        f"{MODEL.tokens_per_block} tokens/block, {BLOCK} B blocks",
        f"python -m benchmarks.kv_events --sidecars {args.sidecars} --prompts {args.prompts}"
        f"{' --store-cost' if args.store_cost else ''}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}",
        "",
        f"{'mode':<8}{'lookup calls':>14}{'blocks asked':>14}{'calls/s':>10}{'probe p50':>11}"
        f"{'probe p99':>11}{'replay s':>10}{'agree':>8}{'events':>9}{'gaps':>6}",
    ]
    for mode, r in results.items():
        lines.append(
            f"{mode:<8}{r['lookup_calls']:>14.0f}{r['lookups_sent']:>14.0f}"
            f"{r['lookup_calls'] / r['wall_s']:>10.0f}{r['probe_p50_ms']:>9.3f}ms{r['probe_p99_ms']:>9.3f}ms"
            f"{r['wall_s']:>10.2f}{r['agreement']:>8.1%}{r['events']:>9.0f}{r['gaps']:>6.0f}"
        )
    if args.store_cost:
        lines += ["", *store_cost()]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
