"""The ``kvstore`` console script: one dispatcher, one subcommand per job.

    kvstore demo                   end-to-end demonstration of the store on this machine
    kvstore bench tiers [--quick]  per-tier throughput against memcpy and raw LMDB

Every subcommand takes ``--config FILE`` (TOML) and ``--set section.field=value`` overrides;
``KVSTORE_*`` environment variables sit between the two (see ``kvstore.config``). Benchmarks
are imported lazily: only this dispatcher reaches up into ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

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


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvstore.demo import run_demo

    run_demo(_settings(args))
    return 0


def _cmd_bench_tiers(args: argparse.Namespace) -> int:
    from benchmarks.tiers import run_tier_bench

    return run_tier_bench(quick=args.quick, json_path=args.json, data_dir=args.data_dir)


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

    demo = sub.add_parser("demo", parents=[common], help="end-to-end demonstration of the store")
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks measured on this machine")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    tiers = bench_sub.add_parser("tiers", parents=[common], help="per-tier put/get throughput vs references")
    tiers.add_argument("--quick", action="store_true", help="fewer repetitions; under two minutes")
    tiers.add_argument("--json", metavar="PATH", help="write results as JSON")
    tiers.set_defaults(func=_cmd_bench_tiers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
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
