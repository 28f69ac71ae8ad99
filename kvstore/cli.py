"""The ``kvstore`` console script: one dispatcher, one subcommand per job.

    kvstore serve                  the service: Unix socket sidecar, optional TCP shared store
    kvstore stats                  a running server's tiers and counters (table or --json)
    kvstore invalidate             the kill switch: a fingerprint's blocks, or everything
    kvstore demote                 move blocks out of a tier into the next one (nothing dropped)
    kvstore demo                   end-to-end demonstration of the store on this machine
    kvstore bench tiers [--quick]  per-tier throughput against memcpy and raw LMDB
    kvstore bench service          data planes against raw TCP and memcpy, lookup latency, peers
    kvstore bench calibrate        prefill curve and tier restore costs -> the connector's calibration
    kvstore bench decisions        the connector's plan against all-restore and all-recompute

Every subcommand takes ``--config FILE`` (TOML) and ``--set section.field=value`` overrides;
``KVSTORE_*`` environment variables sit between the two (see ``kvstore.config``). Benchmarks
are imported lazily: only this dispatcher reaches up into ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvstore.config import Settings, load_settings
from kvstore.errors import KvStoreError


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, str] = {}
    for item in args.set or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise KvStoreError(f"--set takes section.field=value, got {item!r}")
        overrides[name.strip()] = value.strip()
    if args.data_dir:
        overrides["data_dir"] = args.data_dir
    return load_settings(args.config, overrides=overrides)


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvstore.server import serve

    overrides = []
    if args.tcp:
        overrides.append(f"server.tcp_address={args.tcp}")
    if args.socket:
        overrides.append(f"server.socket_path={args.socket}")
    args.set = (args.set or []) + overrides
    return serve(_settings(args))


def _client(args: argparse.Namespace) -> Any:
    from kvstore.client import connect

    address = args.address or f"unix://{_settings(args).socket_path}"
    return connect(address, token=args.token or os.environ.get("KVSTORE_TOKEN"))


def _cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvstore stats (tenant {stats['tenant']})")
    for col in ("tier", "blocks", "used", "capacity", "fill", "checksum failures"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for t in stats["tiers"]:
        fill = t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else 0.0
        table.add_row(
            t["name"],
            f"{t['blocks']:,}",
            _size(t["used_bytes"]),
            _size(t["capacity_bytes"]),
            f"{fill:.0%}",
            str(t["checksum_failures"]),
        )
    console = Console()
    console.print(table)
    for line in stats["absent_tiers"]:
        console.print(f"absent: {line}")
    if stats["counters"]:
        counters = Table(title="counters")
        counters.add_column("counter")
        counters.add_column("value", justify="right")
        for name, value in sorted(stats["counters"].items()):
            counters.add_row(name, f"{value:,}")
        console.print(counters)
    for namespace, nbytes in sorted(stats["tenant_bytes"].items()):
        console.print(f"{namespace}: {_size(nbytes)}")
    return 0


def _fingerprint_arg(args: argparse.Namespace, command: str) -> bytes | None:
    """``--fingerprint HEX`` as bytes, None when absent; ValueError (already reported) if bad."""
    if not args.fingerprint:
        return None
    try:
        return bytes.fromhex(args.fingerprint)
    except ValueError:
        print(f"kvstore {command}: --fingerprint takes 64 hex digits", file=sys.stderr)
        raise


def _cmd_invalidate(args: argparse.Namespace) -> int:
    if bool(args.fingerprint) == bool(args.everything):
        print("kvstore invalidate: give --fingerprint HEX or --everything", file=sys.stderr)
        return 2
    try:
        fingerprint = _fingerprint_arg(args, "invalidate")
    except ValueError:
        return 2
    if args.everything and not args.yes:
        whose = (
            "EVERY tenant's" if args.tenant == "*" else f"tenant {args.tenant!r}'s" if args.tenant else "your"
        )
        answer = input(f"Remove all of {whose} cached blocks? Type 'yes' to confirm: ")
        if answer.strip().lower() != "yes":
            print("nothing removed")
            return 1
    with _client(args) as client:
        removed = client.invalidate(fingerprint, tenant=args.tenant, everything=args.everything)
    print(f"removed {removed} blocks")
    return 0


def _cmd_demote(args: argparse.Namespace) -> int:
    try:
        fingerprint = _fingerprint_arg(args, "demote")
    except ValueError:
        return 2
    with _client(args) as client:
        moved = client.demote(args.tier, fingerprint, tenant=args.tenant)
    print(f"moved {moved} blocks out of {args.tier}")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.service:
        from kvstore.demo_service import run_service_demo

        run_service_demo(args.service, args.tcp, args.token or os.environ.get("KVSTORE_TOKEN", ""))
        return 0
    from kvstore.demo import run_demo

    run_demo(_settings(args))
    return 0


def _cmd_bench_tiers(args: argparse.Namespace) -> int:
    from benchmarks.tiers import run_tier_bench

    return run_tier_bench(quick=args.quick, json_path=args.json, data_dir=args.data_dir)


def _cmd_bench_service(args: argparse.Namespace) -> int:
    from benchmarks.service import run_service_bench

    return run_service_bench(quick=args.quick, json_path=args.json, with_peers=not args.no_peers)


def _cmd_bench_calibrate(args: argparse.Namespace) -> int:
    from benchmarks.calibrate import run_calibrate

    return run_calibrate(model=args.model, out_path=args.out, quick=args.quick)


def _cmd_bench_decisions(args: argparse.Namespace) -> int:
    from benchmarks.decisions import run_decisions

    return run_decisions(model=args.model, quick=args.quick, json_path=args.json, plot_path=args.plot)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="TOML configuration file")
    common.add_argument("--set", metavar="SECTION.FIELD=VALUE", action="append", help="override one setting")
    common.add_argument(
        "--data-dir", metavar="DIR", help="folder for the persistent tiers (overrides data_dir)"
    )
    common.add_argument("-v", "--verbose", action="store_true", help="log at debug level")

    parser = argparse.ArgumentParser(
        prog="kvstore", description="Tiered KV-cache offload storage for LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument(
        "--address", help="server address: unix:///path or host:port (default: the local socket)"
    )
    remote.add_argument("--token", help="bearer token (default: $KVSTORE_TOKEN)")

    serve = sub.add_parser("serve", parents=[common], help="run the service")
    serve.add_argument("--tcp", metavar="HOST:PORT", help="also listen on TCP (server.tcp_address)")
    serve.add_argument("--socket", metavar="PATH", help="Unix socket path (server.socket_path)")
    serve.set_defaults(func=_cmd_serve)

    stats = sub.add_parser("stats", parents=[common, remote], help="a running server's tiers and counters")
    stats.add_argument("--json", action="store_true", help="print JSON instead of tables")
    stats.set_defaults(func=_cmd_stats)

    invalidate = sub.add_parser("invalidate", parents=[common, remote], help="remove blocks now")
    invalidate.add_argument("--fingerprint", metavar="HEX", help="every block of this model fingerprint")
    invalidate.add_argument("--everything", action="store_true", help="every block (asks for confirmation)")
    invalidate.add_argument("--tenant", default="", help="another tenant's blocks, or '*' for all (admins)")
    invalidate.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    invalidate.set_defaults(func=_cmd_invalidate)

    demote = sub.add_parser(
        "demote", parents=[common, remote], help="move blocks out of a tier into the next one"
    )
    demote.add_argument("--tier", default="dram", help="the tier to empty (default dram)")
    demote.add_argument("--fingerprint", metavar="HEX", help="only this model fingerprint's blocks")
    demote.add_argument("--tenant", default="", help="another tenant's blocks, or '*' for all (admins)")
    demote.set_defaults(func=_cmd_demote)

    demo = sub.add_parser("demo", parents=[common], help="end-to-end demonstration of the store")
    demo.add_argument(
        "--service", metavar="UNIX_ADDRESS", help="run against a live server's Unix socket instead"
    )
    demo.add_argument("--tcp", metavar="HOST:PORT", help="with --service: the server's TCP listener")
    demo.add_argument("--token", help="with --service: the bearer token for --tcp")
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks measured on this machine")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    tiers = bench_sub.add_parser("tiers", parents=[common], help="per-tier put/get throughput vs references")
    tiers.add_argument("--quick", action="store_true", help="fewer repetitions; under two minutes")
    tiers.add_argument("--json", metavar="PATH", help="write results as JSON")
    tiers.set_defaults(func=_cmd_bench_tiers)
    service = bench_sub.add_parser(
        "service", parents=[common], help="the service against raw TCP, memcpy, peers"
    )
    service.add_argument("--quick", action="store_true", help="fewer blocks and rounds; under three minutes")
    service.add_argument("--json", metavar="PATH", help="write results as JSON")
    service.add_argument("--no-peers", action="store_true", help="skip Redis, Mooncake Store and LMCache")
    service.set_defaults(func=_cmd_bench_service)
    calibrate = bench_sub.add_parser(
        "calibrate",
        parents=[common],
        help="measure prefill and tier restore costs; write the calibration file",
    )
    calibrate.add_argument(
        "--model", metavar="DIR", help="a local HF model folder (default: a tiny random Llama)"
    )
    calibrate.add_argument("--out", metavar="PATH", default="calibration.json", help="where to write it")
    calibrate.add_argument("--quick", action="store_true", help="fewer lengths and repetitions")
    calibrate.set_defaults(func=_cmd_bench_calibrate)
    decisions = bench_sub.add_parser(
        "decisions", parents=[common], help="the plan against all-restore and all-recompute"
    )
    decisions.add_argument(
        "--model", metavar="DIR", help="a local HF model folder (default: a tiny random Llama)"
    )
    decisions.add_argument("--quick", action="store_true", help="a smaller sweep (about five minutes here)")
    decisions.add_argument("--json", metavar="PATH", help="write results as JSON")
    decisions.add_argument("--plot", metavar="PNG", help="draw the three curves per tier and throttle")
    decisions.set_defaults(func=_cmd_bench_decisions)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO if args.command == "serve" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.func(args)
    except KvStoreError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
