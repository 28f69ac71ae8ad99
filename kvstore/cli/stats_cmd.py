"""``kvstore stats``: a running server's tiers, counters and connections, as tables or JSON.

Every counter is shown, those still at zero too (the server sends them all); connections are
counted per listener (data port, data socket, gRPC transports) and per tenant on the data
listeners.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvstore.cli.common import client, duration, size


def add_parser(sub: Any, common: argparse.ArgumentParser, remote: argparse.ArgumentParser) -> None:
    stats = sub.add_parser("stats", parents=[common, remote], help="a running server's tiers and counters")
    stats.add_argument("--json", action="store_true", help="print JSON instead of tables")
    stats.set_defaults(func=run_stats)


def run_stats(args: argparse.Namespace) -> int:
    with client(args) as kv:
        stats = kv.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print_stats(stats)
    return 0


def print_stats(stats: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    looked, hit = stats["lookup_tokens"], stats["hit_tokens"]
    ratio = f"{hit / looked:.1%} of {looked:,} tokens looked up" if looked else "no lookups yet"
    console.print(
        f"kvstore {escape(stats['version'])} up {duration(stats['uptime_s'])}, tenant "
        f"{escape(stats['tenant'])}, token hit ratio {ratio}"
    )
    for address in stats["addresses"]:
        console.print(f"  listening: {escape(address)}")
    connections = stats.get("connections", {})
    if connections:
        listed = ", ".join(f"{escape(name)} {n:,}" for name, n in connections.items())
        console.print(f"  connections: {listed}")
    tenants = stats.get("tenant_connections", {})
    if tenants:
        listed = ", ".join(f"{escape(name)} {n:,}" for name, n in sorted(tenants.items()))
        console.print(f"  data connections by tenant: {listed}")
    table = Table(title="tiers")
    for col in ("tier", "blocks", "used", "capacity", "fill", "checksum failures"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for t in stats["tiers"]:
        fill = t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else 0.0
        table.add_row(
            t["name"],
            f"{t['blocks']:,}",
            size(t["used_bytes"]),
            size(t["capacity_bytes"]),
            f"{fill:.0%}",
            str(t["checksum_failures"]),
        )
    console.print(table)
    for line in stats["absent_tiers"]:
        console.print(f"absent: {escape(line)}")
    if stats["fingerprints"]:
        # Plain lines, not a table: a 64-digit fingerprint must survive any terminal width whole,
        # ready to copy into `kvstore invalidate --fingerprint`.
        console.print("models (kvstore invalidate --model ID, or --fingerprint HEX or a unique prefix):")
        for f in stats["fingerprints"]:
            rank = f" tp rank {f['tp_rank']}/{f['tp_world_size']}," if f["tp_world_size"] > 1 else ""
            model = f["model_id"] or "(model not registered since the data folder was made)"
            print(f"  {f['fingerprint']}  {model},{rank} {f['blocks']:,} blocks, {size(f['bytes'])}")
        sys.stdout.flush()
    counters = Table(title="counters")
    counters.add_column("counter")
    counters.add_column("value", justify="right")
    for name, value in sorted(stats["counters"].items()):
        counters.add_row(name, f"{value:,}")
    console.print(counters)
    for namespace, nbytes in sorted(stats["tenant_bytes"].items()):
        console.print(f"{escape(namespace)}: {size(nbytes)}")
